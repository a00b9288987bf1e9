//! The package step's cleanup against real cargo: a two-crate workspace packaged twice, with a change
//! to both crates in between, verifies against the *old* sibling without
//! [`xtask::ci::clean_stale_packages`] and against the new one with it.
//!
//! The workspace has no third-party dependency and its own cargo home and target directory, so this
//! runs offline in a second or two and never touches the real cargo home.

use std::path::Path;
use std::process::Command;

use xtask::ci::{cargo_path, clean_stale_packages};

const WORKSPACE: &str = "[workspace]\nmembers = [\"a\", \"b\"]\nresolver = \"3\"\n";

fn manifest(name: &str, deps: &str) -> String {
    format!(
        "[package]\nname = \"{name}\"\nversion = \"0.1.0\"\nedition = \"2024\"\nlicense = \"MIT\"\n\
         description = \"xtask package_stale test crate\"\n\n[dependencies]\n{deps}"
    )
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, text).expect("write");
}

/// `cargo package --workspace` with verification; its stderr on failure.
fn package(root: &Path, home: &Path, target: &Path) -> Result<(), String> {
    let out = Command::new(cargo_path())
        .args(["package", "--workspace", "--allow-dirty", "--offline", "--target-dir"])
        .arg(target)
        .current_dir(root)
        .env("CARGO_HOME", home)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .output()
        .expect("run cargo");
    if out.status.success() { Ok(()) } else { Err(String::from_utf8_lossy(&out.stderr).into_owned()) }
}

#[test]
fn a_second_package_run_verifies_against_the_new_sibling_only_after_the_cleanup() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let root = tmp.path().join("ws");
    let home = tmp.path().join("cargo-home");
    let target = tmp.path().join("target");
    write(&root.join("Cargo.toml"), WORKSPACE);
    write(&root.join("a/Cargo.toml"), &manifest("xtask-stale-a", ""));
    write(
        &root.join("b/Cargo.toml"),
        &manifest("xtask-stale-b", "xtask-stale-a = { path = \"../a\", version = \"0.1.0\" }\n"),
    );
    write(&root.join("a/src/lib.rs"), "//! a\n/// One.\npub fn one() -> u32 { 1 }\n");
    write(&root.join("b/src/lib.rs"), "//! b\n/// One.\npub fn f() -> u32 { xtask_stale_a::one() }\n");
    let ours = [("xtask-stale-a", "0.1.0"), ("xtask-stale-b", "0.1.0")].map(|(n, v)| (n.to_owned(), v.to_owned()));

    package(&root, &home, &target).expect("the first run packages and verifies");
    // `b` now needs a function that only the new `a` has.
    write(
        &root.join("a/src/lib.rs"),
        "//! a\n/// One.\npub fn one() -> u32 { 1 }\n/// Two.\npub fn two() -> u32 { 2 }\n",
    );
    write(
        &root.join("b/src/lib.rs"),
        "//! b\n/// Three.\npub fn f() -> u32 { xtask_stale_a::one() + xtask_stale_a::two() }\n",
    );

    let stale = package(&root, &home, &target).expect_err("without the cleanup, b is verified against the old a");
    assert!(stale.contains("two"), "b should fail on the missing `two`, got:\n{stale}");

    // Sources alone are not enough (the old build of `a` still looks fresh), so both must go.
    let removed = clean_stale_packages(&home, &target, &ours).expect("clean");
    assert!(removed >= 2, "removed {removed}: the unpacked sources and the build of `a` at least");
    package(&root, &home, &target).expect("after the cleanup, b is verified against the new a");
}
