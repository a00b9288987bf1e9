//! The layering check: a storage backend may not depend on the byte-moving or networked layers, and
//! the GPU runtime shim (`layer = "runtime-shim"`) on no umbp crate, tokio or tonic.
//!
//! A crate declares its layer in its manifest:
//!
//! ```toml
//! [package.metadata.umbp]
//! layer = "backend"
//! ```
//!
//! and [`RULES`] — the one rule table — says which crates each layer may never reach. The check has two
//! halves:
//!
//! - [`check`], a pure function over a simplified [`Graph`] (packages, their layers, dependency edges),
//!   unit-tested below;
//! - [`graph_from_metadata`] / [`check_workspace`], the adapter that builds that graph from `cargo metadata`.
//!
//! What counts as a dependency: normal and build dependencies, followed **transitively** through the
//! resolved graph (a backend that reaches tokio through a helper crate is as wrong as one that names it).
//! Dev-dependencies are ignored at every hop: tests may use anything. The resolved graph is the
//! workspace-wide one, so feature unification makes the check conservative: an edge that any
//! `cargo build --workspace` would compile into a backend counts. A backend's own declared normal and build
//! dependencies count even when they are optional and not enabled, so an `optional = true` tokio cannot
//! slip past.
//!
//! A layer value that no rule mentions is an error too, so a typo (`layer = "backned"`) cannot silently
//! exempt a medium.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::path::Path;

use anyhow::{Context as _, bail};
use cargo_metadata::{DependencyKind, Metadata, MetadataCommand};

/// One row of the rule table: a package of `layer` may not depend on any crate in `forbidden`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerRule {
    /// The value of `[package.metadata.umbp] layer` the rule applies to.
    pub layer: &'static str,
    /// Crate (package) names a package of this layer may not reach through normal or build dependencies.
    pub forbidden: &'static [&'static str],
    /// Why, printed with every violation.
    pub reason: &'static str,
}

/// The rule table. Add a row to forbid more; add a layer by adding rows that name it.
pub const RULES: &[LayerRule] = &[
    LayerRule {
        layer: "backend",
        forbidden: &["umbp-transfer", "umbp-peer", "umbp-master", "umbp-proto"],
        reason: "a storage backend owns bytes and publishes descriptors for them; it never moves them, so it \
                 may not name the transfer layer, the node or the control plane",
    },
    LayerRule {
        layer: "backend",
        forbidden: &["tonic", "tokio"],
        reason: "the medium contract is synchronous and network-free; RPC and async runtimes belong to \
                 umbp-peer and umbp-master",
    },
    LayerRule {
        layer: "backend",
        forbidden: &["umbp-metrics"],
        reason: "a medium is charted by the InstrumentedBackend the composition root wraps it in; it reports \
                 medium-internal state through umbp_core::MetricSource under the generic names, never through \
                 the metrics crate",
    },
    LayerRule {
        layer: "runtime-shim",
        forbidden: &["tokio", "tonic"],
        reason: "the GPU runtime shim is a thin synchronous FFI layer: it never spawns tasks or depends on an \
                 async runtime or RPC",
    },
    LayerRule {
        layer: "runtime-shim",
        forbidden: &[
            "umbp",
            "umbp-core",
            "umbp-page",
            "umbp-hbm",
            "umbp-ssd",
            "umbp-transfer",
            "umbp-peer",
            "umbp-master",
            "umbp-proto",
            "umbp-metrics",
            "umbp-testkit",
        ],
        reason: "the GPU runtime shim sits below every umbp crate: it knows no medium, key, tier or transfer \
                 plan, so it names none of them",
    },
];

/// The kind of a dependency edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DepKind {
    /// `[dependencies]`.
    Normal,
    /// `[build-dependencies]`.
    Build,
    /// `[dev-dependencies]`: ignored by the check.
    Dev,
}

impl DepKind {
    /// The word cargo uses for this kind.
    pub fn label(self) -> &'static str {
        match self {
            DepKind::Normal => "normal",
            DepKind::Build => "build",
            DepKind::Dev => "dev",
        }
    }
}

/// A package in the simplified graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    /// A unique id (cargo's package id in the adapter; any unique string in tests).
    pub id: String,
    /// The crate's package name, which the rules match.
    pub name: String,
    /// The declared `[package.metadata.umbp] layer`, if any.
    pub layer: Option<String>,
}

/// A dependency edge between two package ids.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    /// The depending package's id.
    pub from: String,
    /// The dependency's id.
    pub to: String,
    /// Normal, build or dev.
    pub kind: DepKind,
}

/// The simplified dependency graph the check runs on.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    packages: BTreeMap<String, Package>,
    edges: BTreeSet<Edge>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a package.
    pub fn add_package(&mut self, id: &str, name: &str, layer: Option<&str>) -> &mut Self {
        let package = Package { id: id.to_owned(), name: name.to_owned(), layer: layer.map(str::to_owned) };
        self.packages.insert(id.to_owned(), package);
        self
    }

    /// Adds an edge `from -> to`. An id with no package is its own name.
    pub fn add_edge(&mut self, from: &str, to: &str, kind: DepKind) -> &mut Self {
        self.edges.insert(Edge { from: from.to_owned(), to: to.to_owned(), kind });
        self
    }

    /// The packages, by id.
    pub fn packages(&self) -> impl Iterator<Item = &Package> {
        self.packages.values()
    }

    /// The edges, sorted.
    pub fn edges(&self) -> impl Iterator<Item = &Edge> {
        self.edges.iter()
    }

    fn name_of<'a>(&'a self, id: &'a str) -> &'a str {
        self.packages.get(id).map_or(id, |p| p.name.as_str())
    }
}

/// One hop of a dependency path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hop {
    /// The package reached by this hop.
    pub to: String,
    /// The kind of the edge taken.
    pub kind: DepKind,
}

/// A forbidden dependency of a layered package.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The layered package.
    pub package: String,
    /// Its layer.
    pub layer: String,
    /// The forbidden crate it reaches.
    pub forbidden: String,
    /// The shortest path from `package` to `forbidden`; one hop for a direct edge.
    pub path: Vec<Hop>,
    /// The rule's reason.
    pub reason: &'static str,
}

impl Violation {
    /// Whether the package names the forbidden crate itself.
    pub fn is_direct(&self) -> bool {
        self.path.len() == 1
    }

    /// `build` when any hop is a build dependency, else `normal`.
    pub fn kind(&self) -> DepKind {
        if self.path.iter().any(|h| h.kind == DepKind::Build) { DepKind::Build } else { DepKind::Normal }
    }

    /// The path as `a -> b -> c`, with non-normal hops marked, e.g. `a -> b (build) -> c`.
    pub fn path_string(&self) -> String {
        let mut s = self.package.clone();
        for hop in &self.path {
            s.push_str(" -> ");
            s.push_str(&hop.to);
            if hop.kind != DepKind::Normal {
                s.push_str(&format!(" ({})", hop.kind.label()));
            }
        }
        s
    }
}

impl fmt::Display for Violation {
    /// `umbp-page -> tokio (normal dependency)`, or for a transitive edge
    /// `umbp-page -> tokio (transitive normal dependency, via umbp-page -> helper -> tokio)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = self.kind().label();
        if self.is_direct() {
            write!(f, "{} -> {} ({kind} dependency)", self.package, self.forbidden)
        } else {
            write!(
                f,
                "{} -> {} (transitive {kind} dependency, via {})",
                self.package,
                self.forbidden,
                self.path_string()
            )
        }
    }
}

/// What the check found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Every layered package checked, as `(name, layer)`, sorted.
    pub checked: Vec<(String, String)>,
    /// Packages declaring a layer no rule mentions, as `(name, layer)`.
    pub unknown_layers: Vec<(String, String)>,
    /// Forbidden dependencies, sorted by package then forbidden crate.
    pub violations: Vec<Violation>,
}

impl Outcome {
    /// No violation and no unknown layer.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty() && self.unknown_layers.is_empty()
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let checked: Vec<String> = self.checked.iter().map(|(n, l)| format!("{n} ({l})")).collect();
        if checked.is_empty() {
            writeln!(f, "layering: no package declares [package.metadata.umbp] layer")?;
        } else {
            writeln!(f, "layering: checked {}", checked.join(", "))?;
        }
        for (name, layer) in &self.unknown_layers {
            let known: BTreeSet<&str> = RULES.iter().map(|r| r.layer).collect();
            let known: Vec<&str> = known.into_iter().collect();
            writeln!(f, "forbidden: {name} declares unknown layer {layer:?} (known layers: {})", known.join(", "))?;
        }
        for v in &self.violations {
            writeln!(f, "forbidden edge: {v}")?;
            writeln!(f, "    why: {} layer: {}", v.layer, v.reason)?;
        }
        if self.is_ok() {
            write!(f, "layering: ok")
        } else {
            write!(
                f,
                "layering: {} forbidden edge(s), {} unknown layer(s)",
                self.violations.len(),
                self.unknown_layers.len()
            )
        }
    }
}

/// Checks every layered package of `graph` against `rules`.
///
/// For each package with a layer, walks normal and build edges breadth-first (never dev edges) and
/// reports each forbidden crate reached, once, with its shortest path. The walk does not continue
/// through a forbidden crate: the first forbidden edge on a path is the one to fix.
pub fn check(graph: &Graph, rules: &[LayerRule]) -> Outcome {
    let mut adjacency: BTreeMap<&str, Vec<&Edge>> = BTreeMap::new();
    for edge in graph.edges.iter().filter(|e| e.kind != DepKind::Dev) {
        adjacency.entry(edge.from.as_str()).or_default().push(edge);
    }

    let mut outcome = Outcome::default();
    for package in graph.packages.values() {
        let Some(layer) = package.layer.as_deref() else {
            continue;
        };
        outcome.checked.push((package.name.clone(), layer.to_owned()));
        let layer_rules: Vec<&LayerRule> = rules.iter().filter(|r| r.layer == layer).collect();
        if layer_rules.is_empty() {
            outcome.unknown_layers.push((package.name.clone(), layer.to_owned()));
            continue;
        }
        let forbidden_reason = |name: &str| layer_rules.iter().find(|r| r.forbidden.contains(&name)).map(|r| r.reason);

        // Breadth-first from the package; `parent` records how each id was first reached.
        let mut parent: BTreeMap<&str, (&str, DepKind)> = BTreeMap::new();
        let mut queue = VecDeque::from([package.id.as_str()]);
        let mut reported = BTreeSet::new();
        while let Some(id) = queue.pop_front() {
            for edge in adjacency.get(id).into_iter().flatten() {
                let to = edge.to.as_str();
                if to == package.id || parent.contains_key(to) {
                    continue;
                }
                parent.insert(to, (id, edge.kind));
                let name = graph.name_of(to);
                if let Some(reason) = forbidden_reason(name) {
                    if reported.insert(name.to_owned()) {
                        outcome.violations.push(Violation {
                            package: package.name.clone(),
                            layer: layer.to_owned(),
                            forbidden: name.to_owned(),
                            path: path_to(graph, &parent, &package.id, to),
                            reason,
                        });
                    }
                } else {
                    queue.push_back(to);
                }
            }
        }
    }
    outcome.checked.sort();
    outcome.unknown_layers.sort();
    outcome.violations.sort_by(|a, b| (&a.package, &a.forbidden).cmp(&(&b.package, &b.forbidden)));
    outcome
}

fn path_to(graph: &Graph, parent: &BTreeMap<&str, (&str, DepKind)>, start: &str, end: &str) -> Vec<Hop> {
    let mut hops = Vec::new();
    let mut at = end;
    while at != start {
        let Some(&(from, kind)) = parent.get(at) else { break };
        hops.push(Hop { to: graph.name_of(at).to_owned(), kind });
        at = from;
    }
    hops.reverse();
    hops
}

/// Runs `cargo metadata` for the workspace at `manifest_path` (the current one when `None`): offline
/// first, so no network is touched when the sources are already fetched, then online.
pub fn load_metadata(manifest_path: Option<&Path>) -> anyhow::Result<Metadata> {
    let command = |offline: bool| {
        let mut cmd = MetadataCommand::new();
        if let Some(path) = manifest_path {
            cmd.manifest_path(path);
        }
        if offline {
            cmd.other_options(vec!["--offline".to_owned()]);
        }
        cmd
    };
    match command(true).exec() {
        Ok(metadata) => Ok(metadata),
        Err(offline_err) => {
            command(false).exec().with_context(|| format!("`cargo metadata` failed (offline attempt: {offline_err})"))
        }
    }
}

/// Builds the simplified graph from `cargo metadata` output (which must include the resolve graph).
///
/// Layers are read only for workspace members. Edges come from the resolved graph, one per dependency
/// kind; a layered member's declared normal and build dependencies that the resolve does not show
/// (optional and not enabled) are added as edges to a placeholder package of that name.
pub fn graph_from_metadata(metadata: &Metadata) -> anyhow::Result<Graph> {
    let Some(resolve) = metadata.resolve.as_ref() else {
        bail!("`cargo metadata` output has no resolve graph (was it run with --no-deps?)");
    };
    let members: BTreeSet<&str> = metadata.workspace_members.iter().map(|id| id.repr.as_str()).collect();

    let mut graph = Graph::new();
    for package in &metadata.packages {
        let id = package.id.repr.as_str();
        let layer = if members.contains(id) { declared_layer(package)? } else { None };
        graph.add_package(id, &package.name, layer.as_deref());
    }
    for node in &resolve.nodes {
        for dep in &node.deps {
            if dep.dep_kinds.is_empty() {
                graph.add_edge(&node.id.repr, &dep.pkg.repr, DepKind::Normal);
            }
            for info in &dep.dep_kinds {
                let kind = match info.kind {
                    DependencyKind::Development => DepKind::Dev,
                    DependencyKind::Build => DepKind::Build,
                    // Normal, and anything newer cargo may invent: count it.
                    _ => DepKind::Normal,
                };
                graph.add_edge(&node.id.repr, &dep.pkg.repr, kind);
            }
        }
    }

    // Declared but unresolved (optional, not enabled) dependencies of layered members.
    let layered: Vec<(String, String)> =
        graph.packages().filter(|p| p.layer.is_some()).map(|p| (p.id.clone(), p.name.clone())).collect();
    for (id, _) in &layered {
        let Some(package) = metadata.packages.iter().find(|p| p.id.repr == *id) else {
            continue;
        };
        let resolved: BTreeSet<&str> =
            graph.edges().filter(|e| e.from == *id && e.kind != DepKind::Dev).map(|e| graph.name_of(&e.to)).collect();
        let mut missing = Vec::new();
        for dep in &package.dependencies {
            let kind = match dep.kind {
                DependencyKind::Development => continue,
                DependencyKind::Build => DepKind::Build,
                _ => DepKind::Normal,
            };
            if !resolved.contains(dep.name.as_str()) {
                missing.push((dep.name.clone(), kind));
            }
        }
        for (name, kind) in missing {
            let placeholder = format!("{name} (declared by {id}, not enabled)");
            graph.add_package(&placeholder, &name, None);
            graph.add_edge(id, &placeholder, kind);
        }
    }
    Ok(graph)
}

fn declared_layer(package: &cargo_metadata::Package) -> anyhow::Result<Option<String>> {
    let Some(umbp) = package.metadata.get("umbp") else {
        return Ok(None);
    };
    match umbp.get("layer") {
        None => Ok(None),
        Some(layer) => match layer.as_str() {
            Some(layer) => Ok(Some(layer.to_owned())),
            None => bail!("{}: [package.metadata.umbp] layer must be a string, found {layer}", package.manifest_path),
        },
    }
}

/// Loads the workspace's metadata and checks it against [`RULES`].
pub fn check_workspace(manifest_path: Option<&Path>) -> anyhow::Result<Outcome> {
    let metadata = load_metadata(manifest_path)?;
    let graph = graph_from_metadata(&metadata)?;
    Ok(check(&graph, RULES))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(packages: &[(&str, Option<&str>)], edges: &[(&str, &str, DepKind)]) -> Graph {
        let mut g = Graph::new();
        for &(name, layer) in packages {
            g.add_package(name, name, layer);
        }
        for &(from, to, kind) in edges {
            g.add_edge(from, to, kind);
        }
        g
    }

    const BACKEND: Option<&str> = Some("backend");

    #[test]
    fn clean_graph_passes() {
        let g = graph(
            &[("umbp-core", None), ("umbp-page", BACKEND), ("rustix", None), ("umbp-peer", None), ("tokio", None)],
            &[
                ("umbp-page", "umbp-core", DepKind::Normal),
                ("umbp-page", "rustix", DepKind::Normal),
                ("umbp-peer", "umbp-page", DepKind::Normal),
                ("umbp-peer", "tokio", DepKind::Normal),
            ],
        );
        let outcome = check(&g, RULES);
        assert!(outcome.is_ok(), "{outcome}");
        assert_eq!(outcome.checked, vec![("umbp-page".to_owned(), "backend".to_owned())]);
    }

    #[test]
    fn direct_forbidden_edge_fails_naming_the_edge() {
        let g = graph(
            &[("umbp-page", BACKEND), ("tokio", None), ("umbp-core", None)],
            &[("umbp-page", "umbp-core", DepKind::Normal), ("umbp-page", "tokio", DepKind::Normal)],
        );
        let outcome = check(&g, RULES);
        assert!(!outcome.is_ok());
        assert_eq!(outcome.violations.len(), 1);
        let v = &outcome.violations[0];
        assert!(v.is_direct());
        assert_eq!(v.to_string(), "umbp-page -> tokio (normal dependency)");
        assert!(outcome.to_string().contains("forbidden edge: umbp-page -> tokio (normal dependency)"));
    }

    #[test]
    fn direct_build_dependency_counts() {
        let g = graph(&[("umbp-ssd", BACKEND), ("tonic", None)], &[("umbp-ssd", "tonic", DepKind::Build)]);
        let outcome = check(&g, RULES);
        assert_eq!(outcome.violations.len(), 1);
        assert_eq!(outcome.violations[0].to_string(), "umbp-ssd -> tonic (build dependency)");
    }

    #[test]
    fn transitive_forbidden_edge_fails_naming_the_path() {
        let g = graph(
            &[("umbp-page", BACKEND), ("helper", None), ("inner", None), ("tokio", None)],
            &[
                ("umbp-page", "helper", DepKind::Normal),
                ("helper", "inner", DepKind::Normal),
                ("inner", "tokio", DepKind::Normal),
            ],
        );
        let outcome = check(&g, RULES);
        assert_eq!(outcome.violations.len(), 1);
        let v = &outcome.violations[0];
        assert!(!v.is_direct());
        assert_eq!(v.path_string(), "umbp-page -> helper -> inner -> tokio");
        assert_eq!(
            v.to_string(),
            "umbp-page -> tokio (transitive normal dependency, via umbp-page -> helper -> inner -> tokio)"
        );
    }

    #[test]
    fn a_build_hop_makes_the_path_a_build_dependency() {
        let g = graph(
            &[("umbp-page", BACKEND), ("codegen", None), ("umbp-proto", None)],
            &[("umbp-page", "codegen", DepKind::Build), ("codegen", "umbp-proto", DepKind::Normal)],
        );
        let v = &check(&g, RULES).violations[0];
        assert_eq!(v.kind(), DepKind::Build);
        assert_eq!(v.path_string(), "umbp-page -> codegen (build) -> umbp-proto");
    }

    #[test]
    fn shortest_path_is_reported_once_per_forbidden_crate() {
        let g = graph(
            &[("umbp-page", BACKEND), ("a", None), ("b", None), ("tokio", None)],
            &[
                ("umbp-page", "a", DepKind::Normal),
                ("a", "b", DepKind::Normal),
                ("b", "tokio", DepKind::Normal),
                ("umbp-page", "tokio", DepKind::Normal),
            ],
        );
        let outcome = check(&g, RULES);
        assert_eq!(outcome.violations.len(), 1);
        assert!(outcome.violations[0].is_direct());
    }

    #[test]
    fn the_walk_stops_at_the_first_forbidden_crate() {
        // umbp-transfer -> tokio is the transfer layer's business; only the backend's edge is reported.
        let g = graph(
            &[("umbp-page", BACKEND), ("umbp-transfer", None), ("tokio", None)],
            &[("umbp-page", "umbp-transfer", DepKind::Normal), ("umbp-transfer", "tokio", DepKind::Normal)],
        );
        let outcome = check(&g, RULES);
        let names: Vec<&str> = outcome.violations.iter().map(|v| v.forbidden.as_str()).collect();
        assert_eq!(names, ["umbp-transfer"]);
    }

    #[test]
    fn dev_dependencies_are_ignored() {
        let g = graph(
            &[("umbp-page", BACKEND), ("umbp-testkit", None), ("tokio", None), ("umbp-core", None)],
            &[
                ("umbp-page", "tokio", DepKind::Dev),
                ("umbp-page", "umbp-core", DepKind::Normal),
                // A dev edge deeper in the graph is not followed either.
                ("umbp-core", "umbp-testkit", DepKind::Dev),
                ("umbp-testkit", "tokio", DepKind::Normal),
            ],
        );
        let outcome = check(&g, RULES);
        assert!(outcome.is_ok(), "{outcome}");
    }

    #[test]
    fn a_non_backend_crate_may_depend_on_tokio() {
        let g = graph(
            &[("umbp-page", BACKEND), ("umbp-peer", None), ("tokio", None), ("tonic", None)],
            &[
                ("umbp-peer", "umbp-page", DepKind::Normal),
                ("umbp-peer", "tokio", DepKind::Normal),
                ("umbp-peer", "tonic", DepKind::Normal),
            ],
        );
        assert!(check(&g, RULES).is_ok());
    }

    #[test]
    fn an_unknown_layer_is_an_error() {
        let g = graph(&[("umbp-hbm", Some("backned"))], &[]);
        let outcome = check(&g, RULES);
        assert!(!outcome.is_ok());
        assert_eq!(outcome.unknown_layers, vec![("umbp-hbm".to_owned(), "backned".to_owned())]);
        assert!(outcome.to_string().contains("unknown layer \"backned\""));
    }

    #[test]
    fn every_backend_is_checked_and_every_forbidden_crate_reported() {
        let g = graph(
            &[("umbp-page", BACKEND), ("umbp-hbm", BACKEND), ("umbp-peer", None), ("tonic", None), ("tokio", None)],
            &[
                ("umbp-hbm", "umbp-page", DepKind::Normal),
                ("umbp-page", "tonic", DepKind::Normal),
                ("umbp-hbm", "umbp-peer", DepKind::Normal),
                ("umbp-peer", "tokio", DepKind::Normal),
            ],
        );
        let outcome = check(&g, RULES);
        let found: Vec<String> = outcome.violations.iter().map(|v| format!("{}:{}", v.package, v.forbidden)).collect();
        assert_eq!(found, ["umbp-hbm:tonic", "umbp-hbm:umbp-peer", "umbp-page:tonic"]);
    }

    #[test]
    fn the_runtime_shim_may_reach_no_async_runtime_and_no_umbp_crate() {
        const SHIM: Option<&str> = Some("runtime-shim");
        let clean = graph(
            &[("umbp-gpu", SHIM), ("libloading", None), ("tracing", None), ("umbp-hbm", BACKEND)],
            &[
                ("umbp-gpu", "libloading", DepKind::Normal),
                ("umbp-gpu", "tracing", DepKind::Normal),
                ("umbp-hbm", "umbp-gpu", DepKind::Normal),
            ],
        );
        let outcome = check(&clean, RULES);
        assert!(outcome.is_ok(), "{outcome}");
        assert!(outcome.checked.contains(&("umbp-gpu".to_owned(), "runtime-shim".to_owned())));
        let g = graph(
            &[("umbp-gpu", SHIM), ("tokio", None), ("umbp-core", None), ("helper", None), ("tonic", None)],
            &[
                ("umbp-gpu", "tokio", DepKind::Normal),
                ("umbp-gpu", "umbp-core", DepKind::Normal),
                ("umbp-gpu", "helper", DepKind::Build),
                ("helper", "tonic", DepKind::Normal),
            ],
        );
        let found: Vec<String> =
            check(&g, RULES).violations.iter().map(|v| format!("{}:{}", v.package, v.forbidden)).collect();
        assert_eq!(found, ["umbp-gpu:tokio", "umbp-gpu:tonic", "umbp-gpu:umbp-core"]);
    }

    #[test]
    fn rules_are_extensible() {
        const EXTRA: &[LayerRule] =
            &[LayerRule { layer: "control", forbidden: &["umbp-page"], reason: "the control plane knows no media" }];
        let g = graph(
            &[("umbp-master", Some("control")), ("umbp-page", None)],
            &[("umbp-master", "umbp-page", DepKind::Normal)],
        );
        let outcome = check(&g, EXTRA);
        assert_eq!(outcome.violations[0].to_string(), "umbp-master -> umbp-page (normal dependency)");
        assert_eq!(outcome.violations[0].reason, "the control plane knows no media");
    }
}
