//! The layering check run for real: `cargo xtask layering --manifest-path …` on throwaway workspaces,
//! and on this repository's own workspace.
//!
//! Each throwaway workspace has a `layer = "backend"` crate and a local path crate named `tokio` (a
//! fake, so no network is needed); the check must fail naming the edge when the backend depends on it,
//! and pass when it does not.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A throwaway workspace under cargo's per-test temp dir, removed on drop.
struct Workspace {
    root: PathBuf,
}

impl Workspace {
    /// `crates` is `(name, [package] extras, [dependencies] body)`.
    fn new(test: &str, crates: &[(&str, &str, &str)]) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("layering-{test}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let members: Vec<String> = crates.iter().map(|(name, _, _)| format!("\"{name}\"")).collect();
        write(
            &root.join("Cargo.toml"),
            &format!("[workspace]\nresolver = \"3\"\nmembers = [{}]\n", members.join(", ")),
        );
        for (name, extras, deps) in crates {
            let dir = root.join(name);
            write(
                &dir.join("Cargo.toml"),
                &format!(
                    "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2024\"\npublish = false\n\
                     {extras}\n\n[dependencies]\n{deps}\n"
                ),
            );
            write(&dir.join("src/lib.rs"), "//! A fake crate for the layering test.\n");
        }
        Workspace { root }
    }

    fn layering(&self) -> Output {
        Command::new(env!("CARGO_BIN_EXE_xtask"))
            .args(["layering", "--manifest-path"])
            .arg(self.root.join("Cargo.toml"))
            .output()
            .expect("run xtask")
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

fn write(path: &Path, text: &str) {
    fs::create_dir_all(path.parent().expect("a parent")).expect("create dir");
    fs::write(path, text).expect("write file");
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

const BACKEND: &str = "\n[package.metadata.umbp]\nlayer = \"backend\"";

#[test]
fn a_backend_depending_on_tokio_fails_naming_the_edge() {
    let ws =
        Workspace::new("direct", &[("fake-medium", BACKEND, "tokio = { path = \"../tokio\" }"), ("tokio", "", "")]);
    let output = ws.layering();
    let out = text(&output);
    assert!(!output.status.success(), "the check passed:\n{out}");
    assert!(out.contains("forbidden edge: fake-medium -> tokio (normal dependency)"), "{out}");
}

#[test]
fn the_same_workspace_without_the_edge_passes() {
    let ws = Workspace::new("clean", &[("fake-medium", BACKEND, ""), ("tokio", "", "")]);
    let output = ws.layering();
    let out = text(&output);
    assert!(output.status.success(), "the check failed:\n{out}");
    assert!(out.contains("checked fake-medium (backend)"), "{out}");
}

#[test]
fn a_dev_dependency_on_tokio_passes() {
    let ws = Workspace::new(
        "dev",
        &[("fake-medium", BACKEND, "\n[dev-dependencies]\ntokio = { path = \"../tokio\" }"), ("tokio", "", "")],
    );
    let output = ws.layering();
    assert!(output.status.success(), "the check failed:\n{}", text(&output));
}

#[test]
fn a_transitive_edge_fails_naming_the_path() {
    let ws = Workspace::new(
        "transitive",
        &[
            ("fake-medium", BACKEND, "helper = { path = \"../helper\" }"),
            ("helper", "", "tokio = { path = \"../tokio\" }"),
            ("tokio", "", ""),
        ],
    );
    let output = ws.layering();
    let out = text(&output);
    assert!(!output.status.success(), "the check passed:\n{out}");
    assert!(
        out.contains("fake-medium -> tokio (transitive normal dependency, via fake-medium -> helper -> tokio)"),
        "{out}"
    );
}

#[test]
fn an_optional_edge_that_is_not_enabled_still_fails() {
    let ws = Workspace::new(
        "optional",
        &[("fake-medium", BACKEND, "tokio = { path = \"../tokio\", optional = true }"), ("tokio", "", "")],
    );
    let output = ws.layering();
    let out = text(&output);
    assert!(!output.status.success(), "the check passed:\n{out}");
    assert!(out.contains("forbidden edge: fake-medium -> tokio (normal dependency)"), "{out}");
}

#[test]
fn a_build_dependency_fails() {
    let ws = Workspace::new(
        "build",
        &[("fake-medium", BACKEND, "\n[build-dependencies]\ntokio = { path = \"../tokio\" }"), ("tokio", "", "")],
    );
    let output = ws.layering();
    let out = text(&output);
    assert!(!output.status.success(), "the check passed:\n{out}");
    assert!(out.contains("forbidden edge: fake-medium -> tokio (build dependency)"), "{out}");
}

#[test]
fn an_optional_edge_is_not_hidden_by_a_dev_edge_to_the_same_crate() {
    let ws = Workspace::new(
        "optional-and-dev",
        &[
            (
                "fake-medium",
                BACKEND,
                "tokio = { path = \"../tokio\", optional = true }\n\n[dev-dependencies]\ntokio = { path = \"../tokio\" }",
            ),
            ("tokio", "", ""),
        ],
    );
    let output = ws.layering();
    let out = text(&output);
    assert!(!output.status.success(), "the check passed:\n{out}");
    assert!(out.contains("forbidden edge: fake-medium -> tokio (normal dependency)"), "{out}");
}

/// The media of this workspace that must be checked as backends. Deleting `layer = "backend"` from
/// one of their manifests silently exempts it from the check, so that fails here.
const OUR_BACKENDS: &[&str] = &["umbp-page", "umbp-object"];

#[test]
fn this_workspace_passes_and_checks_every_medium_as_a_backend() {
    let manifest = xtask::workspace_root().join("Cargo.toml");
    let outcome = match xtask::layering::check_workspace(Some(&manifest)) {
        Ok(outcome) => outcome,
        Err(err) => panic!("the layering check could not load {}: {err:#}", manifest.display()),
    };
    assert!(outcome.is_ok(), "this workspace breaks the layering rules:\n{outcome}");
    for medium in OUR_BACKENDS {
        assert!(
            outcome.checked.iter().any(|(name, layer)| name == medium && layer == "backend"),
            "{medium} is not checked as a backend (is `[package.metadata.umbp] layer = \"backend\"` missing \
             from its manifest?):\n{outcome}"
        );
    }
}

#[test]
fn cargo_xtask_layering_defaults_to_this_workspace() {
    let output = Command::new(env!("CARGO_BIN_EXE_xtask")).arg("layering").output().expect("run xtask");
    let out = text(&output);
    assert!(output.status.success(), "the check failed on this workspace:\n{out}");
    assert!(out.contains("umbp-page (backend)") && out.contains("layering: ok"), "{out}");
}
