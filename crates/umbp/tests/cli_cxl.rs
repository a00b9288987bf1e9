//! `umbp node --medium cxl`: the CXL settings (`--cxl-path`, `--cxl-capacity`, their `UMBP_CXL_*`
//! variables and `[node.cxl]` keys) in the precedence file < environment < flags, the errors that name
//! them, and a real round trip: a cxl node process over a file standing in for `/dev/daxX.Y`, a value
//! put by one `umbp put` process and read back byte-exact by another `umbp get` process, and the
//! value's bytes found in the file after the node is killed (its pages are the mapping, not DRAM).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use clap::{CommandFactory, Parser};
use umbp::{Cli, Command, FileConfig, SettingsError, resolve_node};
use umbp_peer::pool_client::{CxlConfig, Medium, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, command, field, value};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |var| map.get(var).cloned()
}

fn node_args(args: &[&str]) -> umbp::NodeArgs {
    let cli = Cli::try_parse_from(["umbp", "node"].into_iter().chain(args.iter().copied())).expect("command line");
    match cli.command {
        Command::Node(a) => a,
        other => panic!("parsed {other:?}"),
    }
}

fn cxl(c: &PoolClientConfig) -> CxlConfig {
    match &c.medium {
        Medium::Cxl(x) => x.clone(),
        other => panic!("not a cxl medium: {other:?}"),
    }
}

#[test]
fn cxl_settings_follow_file_then_env_then_flags() {
    let f = FileConfig::parse(
        "[node]\nnode_id = \"c1\"\nmedium = \"cxl\"\n[node.cxl]\npath = \"/dev/dax0.0\"\ncapacity_bytes = \"4GiB\"\n",
        Path::new("test.toml"),
    )
    .expect("valid file");
    let none = node_args(&[]);
    let c = resolve_node(&f, &env(&[]), &none, None).expect("file");
    assert_eq!(cxl(&c), CxlConfig::new("/dev/dax0.0", 4 << 30));
    let e = env(&[("UMBP_CXL_PATH", "/dev/dax1.0"), ("UMBP_CXL_CAPACITY", "64MiB")]);
    let c = resolve_node(&f, &e, &none, None).expect("file + env");
    assert_eq!(cxl(&c), CxlConfig::new("/dev/dax1.0", 64 << 20));
    let flags = node_args(&["--cxl-path", "/mnt/pmem/umbp.img", "--cxl-capacity", "1GiB"]);
    let c = resolve_node(&f, &e, &flags, None).expect("file + env + flags");
    assert_eq!(cxl(&c), CxlConfig::new("/mnt/pmem/umbp.img", 1 << 30));
    assert_eq!(c.medium.summary().as_deref(), Some("medium=cxl capacity_bytes=1073741824 path=/mnt/pmem/umbp.img"));
}

#[test]
fn a_cxl_node_needs_a_path_and_a_page_of_capacity() {
    let err = resolve_node(&FileConfig::default(), &env(&[]), &node_args(&["--node-id", "c", "--medium", "cxl"]), None)
        .expect_err("no path");
    assert!(matches!(err, SettingsError::Missing { .. }) && err.to_string().contains("--cxl-path"), "{err}");
    let flags = node_args(&["--node-id", "c", "--medium", "cxl", "--cxl-path", "/x", "--cxl-capacity", "1MiB"]);
    let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err("smaller than a page");
    assert!(matches!(err, SettingsError::Invalid { setting: "cxl_capacity", .. }), "{err}");
    let flags = node_args(&["--node-id", "c", "--medium", "cxl", "--cxl-path", "/x", "--capacity", "1GiB"]);
    let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err("--capacity is dram's");
    assert!(err.to_string().contains("--cxl-capacity"), "{err}");
    let help = Cli::command().find_subcommand_mut("node").expect("node").render_long_help().to_string();
    for needle in ["--cxl-path", "[env: UMBP_CXL_PATH]", "--cxl-capacity", "[env: UMBP_CXL_CAPACITY] [default: 1GiB]"] {
        assert!(help.contains(needle), "missing {needle:?} in:\n{help}");
    }
}

/// `umbp ARGS…` to completion: its exit code and stderr.
fn umbp(args: &[&str]) -> (i32, String) {
    let out = command(args, &[]).stdin(Stdio::null()).output().expect("run umbp");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_value_put_by_one_process_is_read_byte_exact_by_another_from_a_cxl_node() {
    let dir = TempDir::new("cxl");
    let image: PathBuf = dir.0.join("dax-stand-in.img");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let master = field(&line, "listen").to_owned();
    let image_arg = image.to_str().expect("utf-8 path");
    let args = [
        "node",
        "--master",
        &master,
        "--node-id",
        "c1",
        "--medium",
        "cxl",
        "--cxl-path",
        image_arg,
        "--cxl-capacity",
        "16MiB",
        "--page-size",
        "64KiB",
    ];
    let (mut node, ready) = Proc::try_start(&dir.0, "c1", &args, &[], "node c1").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(field(&ready, "medium"), "cxl", "{ready}");
    assert_eq!(std::fs::metadata(&image).expect("the image").len(), 16 << 20, "the node grew the file");

    // Three pages and a bit: the value spans pages of the mapping.
    let input = dir.0.join("v.in");
    let v = value("cxl-key", 200_000);
    std::fs::write(&input, &v).expect("write input");
    let (code, err) = umbp(&["put", "--master", &master, "cxl-key", input.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "put: {err}");
    let output = dir.0.join("v.out");
    let (code, err) = umbp(&["get", "--master", &master, "cxl-key", output.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "get: {err}");
    assert!(std::fs::read(&output).expect("output") == v, "the value read back differs");

    // The node's pages are the file (MAP_SHARED): after the node is killed, the value's first page is
    // in the file at a page boundary.
    node.kill9();
    let bytes = std::fs::read(&image).expect("read the image");
    let page = 64 << 10;
    assert!(bytes.chunks(page).any(|p| p == &v[..page]), "the value's first page is not in the CXL file");
}
