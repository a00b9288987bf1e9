//! `cargo xtask ci`: every check CI runs, in order, stopping at the first failure.

use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use cargo_metadata::MetadataCommand;

use crate::layering;

/// A step of `cargo xtask ci`, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// `cargo fmt --all -- --check`.
    Fmt,
    /// `cargo clippy --workspace --all-targets -- -D warnings`.
    Clippy,
    /// `cargo doc --workspace --no-deps` with `RUSTDOCFLAGS=-D warnings`: a broken or private
    /// intra-doc link fails here rather than rotting in the published docs.
    Doc,
    /// The layering check ([`crate::layering`]).
    Layering,
    /// Commit subjects since the rule was adopted are `area: summary`, at most 72 characters
    /// ([`crate::history`]).
    History,
    /// `cargo deny check bans licenses sources`, when cargo-deny is installed.
    Deny,
    /// `cargo nextest run --workspace` and `cargo test --workspace --doc`, or `cargo test --workspace`.
    Test,
    /// `python/run_tests.sh`: the umbp wheel built into a venv under target/, and its pytest suite
    /// (SGLang's `UMBPStore` on the `mori.umbp` surface). Needs `python3` and PyPI.
    Python,
    /// `cargo build --workspace --benches`: benches compile; they are never timed here.
    Benches,
    /// `cargo package --workspace --allow-dirty`: every publishable crate packaged and built from its
    /// package.
    Package,
}

impl Step {
    /// Every step, in order.
    pub const ALL: [Step; 10] = [
        Step::Fmt,
        Step::Clippy,
        Step::Doc,
        Step::Layering,
        Step::History,
        Step::Deny,
        Step::Test,
        Step::Python,
        Step::Benches,
        Step::Package,
    ];

    /// The step's name, as `--skip` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Step::Fmt => "fmt",
            Step::Clippy => "clippy",
            Step::Doc => "doc",
            Step::Layering => "layering",
            Step::History => "history",
            Step::Deny => "deny",
            Step::Test => "test",
            Step::Python => "python",
            Step::Benches => "benches",
            Step::Package => "package",
        }
    }

    /// One line on what the step does.
    pub fn about(self) -> &'static str {
        match self {
            Step::Fmt => "formatting (cargo fmt --all -- --check)",
            Step::Clippy => "lints (cargo clippy --workspace --all-targets -- -D warnings)",
            Step::Doc => "docs build without warnings (RUSTDOCFLAGS=-D warnings cargo doc --workspace --no-deps)",
            Step::Layering => "no backend crate depends on transfer/peer/master/proto, tonic or tokio",
            Step::History => "commit subjects are `area: summary`, at most 72 characters (git log)",
            Step::Deny => "dependency bans, licenses and sources (cargo deny check bans licenses sources)",
            Step::Test => "tests (cargo nextest run --workspace + doc tests, or cargo test --workspace)",
            Step::Python => "the Python package's suite (python/run_tests.sh: wheel into target/pyenv, pytest)",
            Step::Benches => "benches compile (cargo build --workspace --benches)",
            Step::Package => "every publishable crate packages and builds from its package (cargo package --workspace)",
        }
    }

    /// Whether `--fast` skips this step.
    pub fn skipped_by_fast(self) -> bool {
        matches!(self, Step::Deny | Step::Package)
    }

    /// Parses a step name.
    pub fn from_name(name: &str) -> Option<Step> {
        Step::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Options of `cargo xtask ci`.
#[derive(Debug, Clone, Default)]
pub struct CiOptions {
    /// Steps not to run.
    pub skip: Vec<Step>,
    /// Skip the slow, rarely-failing steps ([`Step::skipped_by_fast`]).
    pub fast: bool,
}

enum StepResult {
    Passed,
    Skipped(String),
}

/// Runs `cargo xtask ci` in the workspace at `root`.
pub fn run(root: &Path, options: &CiOptions) -> anyhow::Result<()> {
    let started = Instant::now();
    let names: Vec<&str> = Step::ALL.iter().map(|s| s.name()).collect();
    println!("xtask ci: {} steps ({}) in {}", Step::ALL.len(), names.join(", "), root.display());

    let mut summary: Vec<(Step, String, Duration)> = Vec::new();
    let total = Step::ALL.len();
    for (i, step) in Step::ALL.into_iter().enumerate() {
        println!();
        println!("==> [{}/{total}] {}: {}", i + 1, step.name(), step.about());
        let step_started = Instant::now();
        let result = if options.skip.contains(&step) {
            Ok(StepResult::Skipped("--skip".to_owned()))
        } else if options.fast && step.skipped_by_fast() {
            Ok(StepResult::Skipped("--fast".to_owned()))
        } else {
            run_step(step, root)
        };
        let elapsed = step_started.elapsed();
        match result {
            Ok(StepResult::Passed) => {
                println!("<== {}: ok ({})", step.name(), secs(elapsed));
                summary.push((step, "ok".to_owned(), elapsed));
            }
            Ok(StepResult::Skipped(why)) => {
                println!("<== {}: skipped: {why}", step.name());
                summary.push((step, format!("skipped: {why}"), elapsed));
            }
            Err(err) => {
                println!("<== {}: FAILED ({})", step.name(), secs(elapsed));
                summary.push((step, "FAILED".to_owned(), elapsed));
                print_summary(&summary, started.elapsed());
                return Err(err.context(format!("xtask ci: step `{}` failed", step.name())));
            }
        }
    }
    print_summary(&summary, started.elapsed());
    let skipped = summary.iter().filter(|(_, status, _)| status != "ok").count();
    let skipped = if skipped == 0 { String::new() } else { format!(" ({skipped} skipped)") };
    println!("xtask ci: all steps passed{skipped} in {}", secs(started.elapsed()));
    Ok(())
}

fn print_summary(summary: &[(Step, String, Duration)], total: Duration) {
    let mut out = String::from("\nxtask ci summary:\n");
    for (step, status, elapsed) in summary {
        let _ = writeln!(out, "  {:<9} {:>7}  {status}", step.name(), secs(*elapsed));
    }
    let _ = write!(out, "  {:<9} {:>7}", "total", secs(total));
    println!("{out}");
}

fn secs(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

fn run_step(step: Step, root: &Path) -> anyhow::Result<StepResult> {
    match step {
        Step::Fmt => run_cargo(root, &["fmt", "--all", "--", "--check"])?,
        Step::Clippy => run_cargo(root, &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?,
        Step::Doc => {
            // Appended to what the caller set, so a local `RUSTDOCFLAGS` still applies.
            let mut flags = std::env::var("RUSTDOCFLAGS").unwrap_or_default();
            flags.push_str(" -D warnings");
            run_cargo_env(root, &["doc", "--workspace", "--no-deps"], &[("RUSTDOCFLAGS", flags.trim().to_owned())])?
        }
        Step::Layering => {
            let outcome = layering::check_workspace(Some(&root.join("Cargo.toml")))?;
            println!("{outcome}");
            if !outcome.is_ok() {
                bail!("the layering check found forbidden dependencies (see above)");
            }
        }
        Step::History => match crate::history::check(root)? {
            Some(n) => println!("{n} commit subjects since {} follow the rule", &crate::history::ADOPTED_AFTER[..12]),
            None => {
                return Ok(StepResult::Skipped(
                    "this clone does not hold the commit the rule starts after (a shallow clone)".to_owned(),
                ));
            }
        },
        Step::Deny => {
            if !cargo_subcommand_available(root, "deny") {
                return Ok(StepResult::Skipped(
                    "cargo-deny is not installed (install it with `cargo install cargo-deny --locked`; \
                     .ci/run does)"
                        .to_owned(),
                ));
            }
            // Advisories need the network (the advisory database); bans, licenses and sources do not.
            run_cargo(root, &["deny", "check", "bans", "licenses", "sources"])?;
        }
        Step::Test => {
            let env = required_features_env();
            if cargo_subcommand_available(root, "nextest") {
                run_cargo_env(root, &["nextest", "run", "--workspace", "--profile", "ci"], &env)?;
                // nextest does not run doc tests.
                run_cargo(root, &["test", "--workspace", "--doc"])?;
            } else {
                println!("cargo-nextest is not installed: running `cargo test` instead");
                run_cargo_env(root, &["test", "--workspace"], &env)?;
            }
        }
        Step::Python => {
            let python = Command::new("python3").arg("--version").stdout(Stdio::null()).status();
            if !python.is_ok_and(|s| s.success()) {
                bail!("python3 is not installed: the python step needs CPython >= 3.9 with venv and pip (and PyPI)");
            }
            println!("$ python/run_tests.sh");
            let status = Command::new("bash")
                .arg("python/run_tests.sh")
                .current_dir(root)
                .status()
                .context("could not start `bash python/run_tests.sh`")?;
            if !status.success() {
                bail!("`python/run_tests.sh` exited with {status}");
            }
        }
        Step::Benches => run_cargo(root, &["build", "--workspace", "--benches"])?,
        Step::Package => package(root)?,
    }
    Ok(StepResult::Passed)
}

/// Where the package step builds: its own target directory, so the verification builds (each crate
/// from its `.crate`, with its own feature set) never touch the developer's `target/debug` and keep
/// their third-party dependencies warm between runs.
pub const PACKAGE_TARGET_SUBDIR: &str = "package-verify";

/// `cargo package --workspace --allow-dirty`, verifying every package, leaving out `publish = false`
/// members.
///
/// `--workspace` packages the members together (cargo ≥ 1.90), so an internal dependency resolves to its
/// sibling's fresh package through a temporary local registry rather than to crates.io, where it does
/// not exist yet. Verification then builds each crate from its own `.crate` (the library and binaries,
/// default features), which proves the package carries every file it needs. `cargo package` does not
/// skip `publish = false` members by itself, so they are excluded by name, read from the metadata.
/// Offline first: the earlier steps have fetched everything.
///
/// Before packaging, [`clean_stale_packages`] removes what an earlier run left of our crates: cargo
/// treats the temporary registry as immutable, so it would otherwise verify a crate against its
/// siblings' *previous* sources.
fn package(root: &Path) -> anyhow::Result<()> {
    let metadata = MetadataCommand::new()
        .manifest_path(root.join("Cargo.toml"))
        .no_deps()
        .other_options(vec!["--offline".to_owned()])
        .exec()
        .context("`cargo metadata --no-deps` failed")?;
    let target_dir = metadata.target_directory.as_std_path().join(PACKAGE_TARGET_SUBDIR);
    let mut args: Vec<String> = ["package", "--workspace", "--allow-dirty"].map(String::from).into();
    args.extend(["--target-dir".to_owned(), target_dir.display().to_string()]);
    let mut ours = Vec::new();
    for package in metadata.workspace_packages() {
        if package.publish.as_ref().is_some_and(Vec::is_empty) {
            args.extend(["--exclude".to_owned(), package.name.to_string()]);
        } else {
            ours.push((package.name.to_string(), package.version.to_string()));
        }
    }
    let clean = || -> anyhow::Result<()> {
        let removed = clean_stale_packages(&cargo_home(), &target_dir, &ours)?;
        println!("removed {removed} stale unpacked or built copies of our packages");
        Ok(())
    };
    clean()?;
    let mut offline = args.clone();
    offline.push("--offline".to_owned());
    let (ok, stderr) = run_cargo_teeing_stderr(root, &offline)?;
    if ok {
        return Ok(());
    }
    // Only a resolution that needed the network is worth a second try; a crate that fails to build
    // from its package fails the same way online, after rebuilding everything.
    if !needs_network(&stderr) {
        bail!("`cargo {}` failed (see above)", offline.join(" "));
    }
    println!("offline packaging could not resolve every dependency; retrying online");
    clean()?;
    run_cargo_owned(root, &args)
}

/// Whether cargo's error output says an `--offline` run lacked something it would fetch online.
fn needs_network(stderr: &str) -> bool {
    stderr.contains("offline mode") || stderr.contains("--offline")
}

/// Runs `cargo ARGS` in `root` with its stderr passed through line by line and kept; returns whether
/// it succeeded and the stderr.
fn run_cargo_teeing_stderr(root: &Path, args: &[String]) -> anyhow::Result<(bool, String)> {
    let line = format!("cargo {}", args.join(" "));
    println!("$ {line}");
    let mut child = Command::new(cargo_path())
        .args(args)
        .current_dir(root)
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("could not start `{line}`"))?;
    let mut kept = String::new();
    if let Some(stderr) = child.stderr.take() {
        for text in BufReader::new(stderr).lines() {
            let text = text.with_context(|| format!("could not read the output of `{line}`"))?;
            eprintln!("{text}");
            kept.push_str(&text);
            kept.push('\n');
        }
    }
    let status = child.wait().with_context(|| format!("could not wait for `{line}`"))?;
    Ok((status.success(), kept))
}

/// Cargo's home: `$CARGO_HOME`, else `~/.cargo`.
pub fn cargo_home() -> PathBuf {
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        return PathBuf::from(home);
    }
    std::env::var_os("HOME").map_or_else(|| PathBuf::from(".cargo"), |home| PathBuf::from(home).join(".cargo"))
}

/// Removes every copy an earlier `cargo package --workspace` left of `packages` (name, version), and
/// returns how many it removed.
///
/// Cargo takes a registry's crates to be immutable, which the temporary registry of a workspace
/// package is not, so a second run would verify against the first run's sources twice over:
///
/// - the unpacked sources: `CARGO_HOME/registry/src/<local registry>/NAME-VERSION`, reused as long as
///   its `.cargo-ok` marker is there. A local registry's directory is named `-HASH` (no host), and
///   the hash is cargo's own, so every such directory goes through the cleanup (another checkout's
///   copies are unpacked again when it next packages; two package steps must not run at once under
///   one cargo home); crates.io's extractions are left alone.
/// - the builds: their fingerprints compare the sources' modification times, and a `.crate` carries a
///   fixed one from 2006, so a freshly unpacked changed source still looks older than the old build.
///   Every fingerprint and build-script directory of our packages under `target_dir`'s `debug`
///   profile goes (`target_dir` is the package step's own, so the developer's builds stay warm).
pub fn clean_stale_packages(
    cargo_home: &Path,
    target_dir: &Path,
    packages: &[(String, String)],
) -> anyhow::Result<usize> {
    let mut removed = 0;
    let src = cargo_home.join("registry").join("src");
    for registry in read_dir_names(&src)? {
        if !registry.starts_with('-') {
            continue;
        }
        for (name, version) in packages {
            removed += remove_dir_if_present(&src.join(&registry).join(format!("{name}-{version}")))?;
        }
    }
    let profile = target_dir.join("debug");
    for kind in [".fingerprint", "build"] {
        let dir = profile.join(kind);
        for entry in read_dir_names(&dir)? {
            // `NAME-HASH`: compare the whole name, so `umbp` does not take `umbp-core`'s entries.
            let Some((name, hash)) = entry.rsplit_once('-') else { continue };
            let is_hash = hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit());
            if is_hash && packages.iter().any(|(ours, _)| ours == name) {
                removed += remove_dir_if_present(&dir.join(&entry))?;
            }
        }
    }
    Ok(removed)
}

/// The names in `dir`, or none when it does not exist.
fn read_dir_names(dir: &Path) -> anyhow::Result<Vec<String>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(err).with_context(|| format!("could not list {}", dir.display())),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("could not list {}", dir.display()))?;
        if let Some(name) = entry.file_name().to_str() {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

fn remove_dir_if_present(dir: &Path) -> anyhow::Result<usize> {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(1),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(err) => Err(err).with_context(|| format!("could not remove {}", dir.display())),
    }
}

/// The cargo that runs us (`cargo xtask` sets `CARGO`), else the one on `PATH`.
pub fn cargo_path() -> PathBuf {
    std::env::var_os("CARGO").map_or_else(|| PathBuf::from("cargo"), PathBuf::from)
}

/// The machine features whose tests the test step forbids to skip: umbp-testkit's `require`
/// switches, each set to `1` unless the environment already sets it. This CI machine has io_uring,
/// transparent huge pages (`madvise`) and an open-file limit the tests can reach, so a test that
/// would skip for lack of one (a broken probe, a lost feature) fails instead. A machine without one
/// runs e.g. `UMBP_REQUIRE_IO_URING=0 cargo xtask ci`. Not `UMBP_REQUIRE_GPU` (no GPU here), and
/// nothing for hugetlb pages (none are reserved here).
pub const REQUIRED_FEATURES: [&str; 3] = ["UMBP_REQUIRE_IO_URING", "UMBP_REQUIRE_THP", "UMBP_REQUIRE_OPEN_FILES"];

/// The switch of the tests that need root (network namespaces for the partition tests, a process
/// run as another user): demanded only when the test step runs as root, so a run as another user
/// still skips them (with a printed reason) instead of failing.
pub const REQUIRE_ROOT: &str = "UMBP_REQUIRE_ROOT";

/// Whether this process runs as root (effective uid 0, from `/proc/self/status`).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|ids| ids.split_whitespace().nth(1)) == Some("0")
    })
}

/// The [`REQUIRED_FEATURES`] the environment leaves unset, each set to `1`, and [`REQUIRE_ROOT`]
/// when running as root and the environment leaves it unset.
fn required_features_env() -> Vec<(&'static str, String)> {
    let root = running_as_root().then_some(REQUIRE_ROOT);
    REQUIRED_FEATURES
        .iter()
        .copied()
        .chain(root)
        .filter(|v| std::env::var_os(v).is_none())
        .map(|v| (v, "1".to_owned()))
        .collect()
}

/// Runs `cargo ARGS` in `root`, printing the command line first; fails naming the command.
pub fn run_cargo(root: &Path, args: &[&str]) -> anyhow::Result<()> {
    run_cargo_env(root, args, &[])
}

/// [`run_cargo`] with environment variables `env` set for cargo (and the tests it runs).
fn run_cargo_env(root: &Path, args: &[&str], env: &[(&str, String)]) -> anyhow::Result<()> {
    let owned: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    run_cargo_owned_env(root, &owned, env)
}

/// [`run_cargo`] with owned arguments.
pub fn run_cargo_owned(root: &Path, args: &[String]) -> anyhow::Result<()> {
    run_cargo_owned_env(root, args, &[])
}

fn run_cargo_owned_env(root: &Path, args: &[String], env: &[(&str, String)]) -> anyhow::Result<()> {
    let vars: String = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    let line = format!("{vars}cargo {}", args.join(" "));
    println!("$ {line}");
    let status = Command::new(cargo_path())
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .current_dir(root)
        .status()
        .with_context(|| format!("could not start `{line}`"))?;
    if !status.success() {
        bail!("`{line}` exited with {status}");
    }
    Ok(())
}

fn cargo_subcommand_available(root: &Path, subcommand: &str) -> bool {
    Command::new(cargo_path())
        .args([subcommand, "--version"])
        .current_dir(root)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_switch_follows_the_effective_uid() {
        let uid = std::process::Command::new("id").arg("-u").output().expect("id -u");
        let root = String::from_utf8_lossy(&uid.stdout).trim() == "0";
        assert_eq!(running_as_root(), root);
        if std::env::var_os(REQUIRE_ROOT).is_none() {
            assert_eq!(required_features_env().iter().any(|(v, _)| *v == REQUIRE_ROOT), root);
        }
    }

    #[test]
    fn step_names_round_trip_and_are_unique() {
        for step in Step::ALL {
            assert_eq!(Step::from_name(step.name()), Some(step));
        }
        assert_eq!(Step::from_name("nope"), None);
    }

    #[test]
    fn python_runs_after_the_rust_tests_and_is_not_skipped_by_fast() {
        let names: Vec<&str> = Step::ALL.iter().map(|s| s.name()).collect();
        let at = |n: &str| names.iter().position(|s| *s == n);
        assert_eq!(at("python"), at("test").map(|t| t + 1));
        assert!(!Step::Python.skipped_by_fast());
    }

    #[test]
    fn fast_skips_deny_and_package_only() {
        let fast: Vec<&str> = Step::ALL.iter().filter(|s| s.skipped_by_fast()).map(|s| s.name()).collect();
        assert_eq!(fast, ["deny", "package"]);
    }

    #[test]
    fn only_an_offline_resolution_failure_is_retried_online() {
        let offline = "error: failed to prepare local package for uploading\n\nCaused by:\n  no matching \
                       package named `foo` found\n  As a reminder, you're using offline mode (--offline) which \
                       can sometimes cause surprising resolution failures";
        assert!(needs_network(offline));
        let build = "error[E0599]: no method named `two` found\nerror: failed to verify package tarball";
        assert!(!needs_network(build));
    }

    /// Builds a fake cargo home and package target dir holding one stale copy of everything
    /// [`clean_stale_packages`] must remove, and one of everything it must keep.
    #[test]
    fn clean_stale_packages_removes_our_old_copies_and_nothing_else() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let home = tmp.path().join("cargo-home");
        let target = tmp.path().join("target");
        let local = home.join("registry/src/-14cd1cce6819ff87");
        let crates_io = home.join("registry/src/index.crates.io-1949cf8c6b5b557f");
        let fingerprint = target.join("debug/.fingerprint");
        let build = target.join("debug/build");
        let removed_paths = [
            local.join("umbp-core-0.1.0"),
            local.join("umbp-0.1.0"),
            fingerprint.join("umbp-core-83b6a9f9648b8a2a"),
            fingerprint.join("umbp-b8ad9c96c5a42c85"),
            build.join("umbp-proto-0123456789abcdef"),
        ];
        let kept_paths = [
            local.join("umbp-core-0.0.9"),
            local.join("serde-1.0.0"),
            crates_io.join("umbp-core-0.1.0"),
            fingerprint.join("serde-83b6a9f9648b8a2a"),
            fingerprint.join("umbp-core-extra-83b6a9f9648b8a2a"),
            fingerprint.join("umbp-core-not-a-hash"),
        ];
        for dir in removed_paths.iter().chain(&kept_paths) {
            std::fs::create_dir_all(dir.join("src")).expect("mkdir");
            std::fs::write(dir.join(".cargo-ok"), "{\"v\":1}").expect("write");
        }
        let ours: Vec<(String, String)> =
            ["umbp-core", "umbp", "umbp-proto"].into_iter().map(|name| (name.to_owned(), "0.1.0".to_owned())).collect();

        let removed = clean_stale_packages(&home, &target, &ours).expect("clean");

        assert_eq!(removed, removed_paths.len());
        for dir in &removed_paths {
            assert!(!dir.exists(), "{} should be removed", dir.display());
        }
        for dir in &kept_paths {
            assert!(dir.exists(), "{} should be kept", dir.display());
        }
        // Nothing left: a second run removes nothing, and missing directories are not an error.
        assert_eq!(clean_stale_packages(&home, &target, &ours).expect("clean"), 0);
        let empty = tmp.path().join("nothing-here");
        assert_eq!(clean_stale_packages(&empty, &empty, &ours).expect("clean"), 0);
    }
}
