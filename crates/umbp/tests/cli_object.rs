//! `umbp node --medium object`: the object settings (`--object-url`, `--object-endpoint`, …, their
//! `UMBP_OBJECT_*` variables and `[node.object]` keys) in the precedence file < environment < flags,
//! the errors that name them, and a real round trip against `moto_server` (an S3 stand-in the test
//! starts on a loopback port): an object node process, a value put by one `umbp put` process and
//! read back byte-exact by another `umbp get` process, then the node SIGKILLed and a new one on the
//! same prefix serving the value again from the store (restart recovery), its read charted under
//! `tier="SSD"` by the generic series (the medium has no metrics code). Without `moto_server`
//! (on `PATH` or at `UMBP_MOTO_SERVER`) the round trip skips with a printed reason, or fails under
//! `UMBP_REQUIRE_MOTO=1`.

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{CommandFactory, Parser};
use umbp::{Cli, Command as UmbpCommand, FileConfig, SettingsError, resolve_node};
use umbp_peer::pool_client::{Medium, ObjectSettings, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, command, field, value};

mod metrics_support;

use metrics_support::scrape;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |var| map.get(var).cloned()
}

fn node_args(args: &[&str]) -> umbp::NodeArgs {
    let cli = Cli::try_parse_from(["umbp", "node"].into_iter().chain(args.iter().copied())).expect("command line");
    match cli.command {
        UmbpCommand::Node(a) => a,
        other => panic!("parsed {other:?}"),
    }
}

fn object(c: &PoolClientConfig) -> ObjectSettings {
    match &c.medium {
        Medium::Object(o) => o.clone(),
        other => panic!("not an object medium: {other:?}"),
    }
}

#[test]
fn object_settings_follow_file_then_env_then_flags() {
    let f = FileConfig::parse(
        "[node]\nnode_id = \"o1\"\nmedium = \"object\"\n[node.object]\nurl = \"s3://file-bkt/p\"\n\
         endpoint = \"http://127.0.0.1:1\"\ncapacity_bytes = \"4GiB\"\nop_timeout = \"2s\"\n",
        Path::new("test.toml"),
    )
    .expect("valid file");
    let none = node_args(&[]);
    let o = object(&resolve_node(&f, &env(&[]), &none, None).expect("file"));
    assert_eq!(
        (o.url.as_deref(), o.endpoint.as_deref(), o.capacity_bytes, o.op_timeout),
        (Some("s3://file-bkt/p"), Some("http://127.0.0.1:1"), 4 << 30, Duration::from_secs(2))
    );
    let e = env(&[("UMBP_OBJECT_URL", "s3://env-bkt/q"), ("UMBP_OBJECT_CAPACITY", "64MiB")]);
    let o = object(&resolve_node(&f, &e, &none, None).expect("file + env"));
    assert_eq!((o.url.as_deref(), o.capacity_bytes), (Some("s3://env-bkt/q"), 64 << 20));
    let flags = node_args(&[
        "--object-url",
        "s3://flag-bkt/r",
        "--object-endpoint",
        "http://127.0.0.1:2",
        "--object-capacity",
        "1GiB",
        "--object-create-bucket",
        "true",
    ]);
    let c = resolve_node(&f, &e, &flags, None).expect("file + env + flags");
    let o = object(&c);
    assert_eq!(
        (o.url.as_deref(), o.endpoint.as_deref(), o.capacity_bytes, o.create_bucket),
        (Some("s3://flag-bkt/r"), Some("http://127.0.0.1:2"), 1 << 30, true)
    );
    assert_eq!(
        c.medium.summary().as_deref(),
        Some(
            "medium=object capacity_bytes=1073741824 url=s3://flag-bkt/r endpoint=http://127.0.0.1:2 staging_pages=128 io_threads=16"
        )
    );
}

#[test]
fn an_object_node_needs_a_url_and_refuses_what_can_never_work() {
    let base = ["--node-id", "o", "--medium", "object"];
    let resolve = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        resolve_node(&FileConfig::default(), &env(&[]), &node_args(&args), None)
    };
    let err = resolve(&[]).expect_err("no url");
    assert!(matches!(err, SettingsError::Missing { .. }) && err.to_string().contains("--object-url"), "{err}");
    let err = resolve(&["--object-url", "gs://bucket"]).expect_err("not s3 or file");
    assert!(matches!(err, SettingsError::Invalid { setting: "object", .. }), "{err}");
    let err =
        resolve(&["--object-url", "s3://bkt/p", "--object-endpoint", "https://s3.example.com"]).expect_err("no TLS");
    assert!(err.to_string().contains("only http://"), "{err}");
    let err = resolve(&["--object-url", "s3://bkt/p", "--capacity", "1GiB"]).expect_err("--capacity is dram's");
    assert!(err.to_string().contains("--object-capacity"), "{err}");
    // Credentials are the environment's, read when the medium starts: the settings check passes.
    resolve(&["--object-url", "s3://bkt/p"]).expect("an s3 url without an endpoint flag");
    let help = Cli::command().find_subcommand_mut("node").expect("node").render_long_help().to_string();
    for needle in ["--object-url", "[env: UMBP_OBJECT_URL]", "--object-endpoint", "AWS_ACCESS_KEY_ID"] {
        assert!(help.contains(needle), "missing {needle:?} in:\n{help}");
    }
}

/// A `moto_server` on a free loopback port, killed on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    /// Starts one, or `None` after printing why (a failure under `UMBP_REQUIRE_MOTO=1`).
    fn start() -> Option<Self> {
        let found = match std::env::var_os("UMBP_MOTO_SERVER") {
            Some(p) => Some(PathBuf::from(p)).filter(|p| p.is_file()),
            None => std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
                .map(|d| d.join("moto_server"))
                .find(|p| p.is_file()),
        };
        let Some(binary) = found else {
            let required = std::env::var("UMBP_REQUIRE_MOTO").is_ok_and(|v| v.trim() == "1");
            assert!(!required, "UMBP_REQUIRE_MOTO=1 but moto_server is neither on PATH nor at UMBP_MOTO_SERVER");
            eprintln!("skipped: no moto_server (pip install 'moto[server]'; set UMBP_REQUIRE_MOTO=1 to fail instead)");
            return None;
        };
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let child = Command::new(binary)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto_server");
        let moto = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server did not listen on {port} within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(moto)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `umbp ARGS…` to completion: its exit code and stderr.
fn umbp(args: &[&str]) -> (i32, String) {
    let out = command(args, &[]).stdin(Stdio::null()).output().expect("run umbp");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_value_put_by_one_process_is_read_byte_exact_by_another_from_an_object_node() {
    let Some(moto) = Moto::start() else { return };
    let dir = TempDir::new("object");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let master = field(&line, "listen").to_owned();
    let endpoint = format!("http://127.0.0.1:{}", moto.port);
    let args = [
        "node",
        "--master",
        &master,
        "--node-id",
        "o1",
        "--medium",
        "object",
        "--object-url",
        "s3://umbp-cli/node-o1",
        "--object-endpoint",
        &endpoint,
        "--object-create-bucket",
        "true",
        "--object-max-value-pages",
        "4",
        "--page-size",
        "64KiB",
    ];
    // Credentials and region the AWS way (moto takes any).
    let aws = [("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")];
    let (mut node, ready) = Proc::try_start(&dir.0, "o1", &args, &aws, "node o1").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(field(&ready, "medium"), "object", "{ready}");

    // Three pages and a bit: the value spans staging pages and is one object.
    let input = dir.0.join("v.in");
    let v = value("object-key", 200_000);
    std::fs::write(&input, &v).expect("write input");
    let (code, err) = umbp(&["put", "--master", &master, "object-key", input.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "put: {err}");
    let output = dir.0.join("v.out");
    let (code, err) = umbp(&["get", "--master", &master, "object-key", output.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "get: {err}");
    assert!(std::fs::read(&output).expect("output") == v, "the value read back differs");

    // The node dies; a new one on the same prefix re-indexes the store and serves the value again
    // (downloaded: the new process has no copy of it).
    node.kill9();
    let with_metrics: Vec<&str> = args.iter().copied().chain(["--metrics-addr", "127.0.0.1:0"]).collect();
    let (_node, ready) =
        Proc::try_start(&dir.0, "o1-again", &with_metrics, &aws, "node o1").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(field(&ready, "medium"), "object", "{ready}");
    let again = dir.0.join("v.again");
    let (code, err) = umbp(&["get", "--master", &master, "object-key", again.to_str().expect("utf-8")]);
    assert_eq!(code, 0, "get after the node's restart: {err}");
    assert!(std::fs::read(&again).expect("output") == v, "the value read back after the restart differs");

    // Charted with no metrics code of its own: the generic series, under the tier it reports.
    let text = scrape(field(&ready, "metrics"));
    let resolves = text.lines().find(|l| {
        l.starts_with("umbp_backend_ops_total{") && l.contains("tier=\"SSD\"") && l.contains("op=\"resolve\"")
    });
    assert!(resolves.is_some(), "no resolve series under tier=\"SSD\":\n{text}");
}
