//! Developer tasks for umbp-rs, run as `cargo xtask <task>` (the alias lives in `.cargo/config.toml`).
//!
//! - `cargo xtask ci` — the one test command: fmt, clippy `-D warnings`, rustdoc `-D warnings`, the
//!   layering check, the commit-subject rule ([`history`]), cargo-deny, the tests, the Python suite,
//!   bench compilation and packaging, in that order, stopping at the first failure.
//! - `cargo xtask layering` — only the layering check ([`layering`]).
//! - `cargo xtask bench [ARGS]` — `cargo bench --workspace --bench '*' [ARGS]`: every bench target.
//! - `cargo xtask bench-python [ARGS]` — `python/bench/run.sh [ARGS]`: the Python package beside the
//!   Rust `PoolClient` (release builds of both), over TCP to a node in another process.
//!
//! This crate owns the workspace's build policy: the layering rule table ([`layering::RULES`]) lives here
//! and nowhere else. It must never be published (`publish = false`) nor depended on by a library crate.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};

pub mod ci;
pub mod history;
pub mod layering;

const USAGE: &str = "\
usage: cargo xtask <task> [options]

tasks:
  ci [--skip STEP]... [--fast] [--list]
        run every CI step in order, stopping at the first failure.
        --skip STEP  do not run STEP (repeatable; names from --list)
        --fast       skip the slow, rarely-failing steps (deny, package)
        --list       list the steps and exit
  layering [--manifest-path PATH]
        check that no layered crate (`layer = \"backend\"`, `\"runtime-shim\"`) depends on a forbidden crate
  bench [ARGS]...
        cargo bench --workspace --bench '*' [ARGS]... (arguments after `--` go to the bench binaries)
  bench-python [ARGS]...
        python/bench/run.sh [ARGS]...: Python batch put/get beside the Rust PoolClient, release
        builds (RUNS=N runs, default 5; ARGS go to python/bench/bench_remote.py, e.g. --json)
  help
        print this message
";

/// The workspace root: the parent of this crate's manifest directory.
pub fn workspace_root() -> PathBuf {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir.parent().map_or_else(|| manifest_dir.to_path_buf(), Path::to_path_buf)
}

/// Runs the task named by `args` (the arguments after `cargo xtask`).
pub fn run(args: Vec<String>) -> anyhow::Result<()> {
    let mut args = args.into_iter();
    let task = args.next();
    let rest: Vec<String> = args.collect();
    let root = workspace_root();
    match task.as_deref() {
        Some("ci") => {
            let Some(options) = parse_ci(&rest)? else { return Ok(()) };
            ci::run(&root, &options)
        }
        Some("layering") => {
            let manifest_path = parse_layering(&rest)?.unwrap_or_else(|| root.join("Cargo.toml"));
            let outcome = layering::check_workspace(Some(&manifest_path))?;
            println!("{outcome}");
            if !outcome.is_ok() {
                bail!("the layering check found forbidden dependencies (see above)");
            }
            Ok(())
        }
        Some("bench") => ci::run_cargo_owned(&root, &bench_args(rest)),
        Some("bench-python") => {
            let status = std::process::Command::new("bash")
                .arg("python/bench/run.sh")
                .args(&rest)
                .current_dir(&root)
                .status()
                .context("could not start `bash python/bench/run.sh`")?;
            if !status.success() {
                bail!("`python/bench/run.sh` exited with {status}");
            }
            Ok(())
        }
        Some("help" | "-h" | "--help") => {
            print!("{USAGE}");
            Ok(())
        }
        None => {
            print!("{USAGE}");
            bail!("no task given")
        }
        Some(other) => {
            print!("{USAGE}");
            bail!("unknown task `{other}`")
        }
    }
}

/// Parses `ci` options; `None` when the task is already done (`--list`).
fn parse_ci(args: &[String]) -> anyhow::Result<Option<ci::CiOptions>> {
    let mut options = ci::CiOptions::default();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--fast" => options.fast = true,
            "--list" => {
                for step in ci::Step::ALL {
                    let fast = if step.skipped_by_fast() { "  [skipped by --fast]" } else { "" };
                    println!("{:<9} {}{fast}", step.name(), step.about());
                }
                return Ok(None);
            }
            "--skip" => {
                let Some(name) = args.next() else { bail!("--skip needs a step name") };
                options.skip.push(parse_step(name)?);
            }
            other => match other.strip_prefix("--skip=") {
                Some(name) => options.skip.push(parse_step(name)?),
                None => bail!("unknown option `{other}` for `cargo xtask ci`\n\n{USAGE}"),
            },
        }
    }
    Ok(Some(options))
}

fn parse_step(name: &str) -> anyhow::Result<ci::Step> {
    match ci::Step::from_name(name) {
        Some(step) => Ok(step),
        None => {
            let names: Vec<&str> = ci::Step::ALL.iter().map(|s| s.name()).collect();
            bail!("unknown step `{name}` (steps: {})", names.join(", "))
        }
    }
}

fn parse_layering(args: &[String]) -> anyhow::Result<Option<PathBuf>> {
    let mut manifest_path = None;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--manifest-path" => {
                let Some(path) = args.next() else { bail!("--manifest-path needs a path") };
                manifest_path = Some(PathBuf::from(path));
            }
            other => match other.strip_prefix("--manifest-path=") {
                Some(path) => manifest_path = Some(PathBuf::from(path)),
                None => bail!("unknown option `{other}` for `cargo xtask layering`\n\n{USAGE}"),
            },
        }
    }
    Ok(manifest_path)
}

/// `cargo bench` arguments: the whole workspace's bench targets unless the caller picks packages or
/// benches. Only `[[bench]]` targets run (`--bench '*'`; `--benches` would also run the libraries'
/// libtest harnesses, which `bench = true` by default), so arguments after `--` reach the
/// (harness = false) bench binaries and not a libtest harness that would reject them.
fn bench_args(user: Vec<String>) -> Vec<String> {
    let cargo_part = user.iter().take_while(|a| *a != "--");
    let mut picks_package = false;
    let mut picks_bench = false;
    for arg in cargo_part {
        picks_package |= arg == "-p" || arg.starts_with("--package") || arg.starts_with("-p");
        picks_bench |= arg.starts_with("--bench") || arg == "--all-targets";
    }
    let mut args = vec!["bench".to_owned()];
    if !picks_package {
        args.push("--workspace".to_owned());
    }
    if !picks_bench {
        args.extend(["--bench".to_owned(), "*".to_owned()]);
    }
    args.extend(user);
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|a| (*a).to_owned()).collect()
    }

    #[test]
    fn ci_options_parse() {
        let options = parse_ci(&strings(&["--skip", "deny", "--skip=package", "--fast"])).unwrap().unwrap();
        assert_eq!(options.skip, [ci::Step::Deny, ci::Step::Package]);
        assert!(options.fast);
        assert!(parse_ci(&strings(&["--skip", "bogus"])).is_err());
        assert!(parse_ci(&strings(&["--skip"])).is_err());
        assert!(parse_ci(&strings(&["--frobnicate"])).is_err());
    }

    #[test]
    fn bench_forwards_arguments() {
        assert_eq!(bench_args(vec![]), strings(&["bench", "--workspace", "--bench", "*"]));
        assert_eq!(
            bench_args(strings(&["--", "--quick"])),
            strings(&["bench", "--workspace", "--bench", "*", "--", "--quick"])
        );
        assert_eq!(
            bench_args(strings(&["-p", "umbp-page", "--bench", "slot_cycle", "--", "-p", "x"])),
            strings(&["bench", "-p", "umbp-page", "--bench", "slot_cycle", "--", "-p", "x"])
        );
    }
}
