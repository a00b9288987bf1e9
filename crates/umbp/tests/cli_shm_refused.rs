//! The shared-memory path refuses a process of another user, through real nodes (issue 17, item 4):
//! a holder `umbp node` run as root, and `umbp get` run as `nobody` (`setpriv`) on the same host.
//! The holder's shared-memory server checks the connecting process's credentials (`SO_PEERCRED`)
//! before anything else and refuses it; the get still returns the value, over TCP. The same get
//! as root is served through the mapping and refused nothing — the control that makes the refusal
//! line the other user's. A holder started with `--shared-memory-group` of nobody's group admits
//! nobody's get, which then copies through the mapping (the holder answers it `mapped`).
//!
//! (A client with a wrong cluster token never gets that far through a node: the master refuses it
//! first. The server's own token check is covered by `umbp-transfer`'s `shm_engine.rs`.)
//!
//! Needs root to run a process as another user. Without it the test prints why and passes, unless
//! `UMBP_REQUIRE_ROOT=1` (set by `cargo xtask ci` where it runs as root) makes that a failure.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, UMBP, command, field, value};

mod metrics_support;

use metrics_support::scrape;

const REFUSAL: &str = "shm peer refused: another user";

/// `nobody`'s uid and gid (`setpriv --reuid --regid`), and the group a holder admits in the second test.
const NOBODY: &str = "65534";

/// Runs `prefix… umbp ARGS` to completion (at most 30 s); (exit code, stdout, stderr).
fn run(mut cmd: Command) -> (Option<i32>, Vec<u8>, String) {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).current_dir("/");
    let child = cmd.spawn().expect("spawn");
    let started = Instant::now();
    let out = child.wait_with_output().expect("wait");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    (out.status.code(), out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Whether this process may run another as `nobody`; prints why not (or fails under
/// `UMBP_REQUIRE_ROOT=1`).
fn may_switch_user() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(std::env::var("UMBP_REQUIRE_ROOT").map_or(true, |v| v != "1"), "UMBP_REQUIRE_ROOT=1 but not root");
    eprintln!("SKIPPED: running a process as another user needs root");
    false
}

/// A master, one root holder node (`extra` flags added, its metrics served) holding `key`, and a
/// copy of the binary every user may run.
struct Cluster {
    dir: TempDir,
    master: Proc,
    node: Proc,
    address: String,
    metrics: String,
    exe: std::path::PathBuf,
}

async fn cluster(name: &str, extra: &[&str], key: &str, expected: &[u8]) -> Cluster {
    let dir = TempDir::new(name);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    let exe = dir.0.join("umbp");
    std::fs::copy(UMBP, &exe).expect("copy umbp");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod umbp");

    let (master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    let mut node_args = vec![
        "node",
        "--master",
        &address,
        "--node-id",
        "h1",
        "--medium",
        "dram",
        "--capacity",
        "16MiB",
        "--page-size",
        "64KiB",
        "--prefault",
        "false",
        "--metrics-addr",
        "127.0.0.1:0",
    ];
    node_args.extend(extra);
    let (node, ready) = Proc::try_start(&dir.0, "h1", &node_args, &[], "node h1").unwrap_or_else(|e| panic!("{e}"));
    let metrics = field(&ready, "metrics").to_owned();
    let client = PoolClient::start(PoolClientConfig::new("refused-writer", address.clone())).await.expect("client");
    client.put(key, expected).await.expect("put");
    client.close().await;
    Cluster { dir, master, node, address, metrics, exe }
}

/// `umbp get KEY` as `nobody` (uid and gid 65534, no other groups).
fn get_as_nobody(c: &Cluster, key: &str) -> (Option<i32>, Vec<u8>, String) {
    let mut cmd = Command::new("setpriv");
    cmd.args([&format!("--reuid={NOBODY}"), &format!("--regid={NOBODY}"), "--clear-groups"]).arg(&c.exe);
    cmd.args(["get", "--master", &c.address, key]).env("RUST_LOG", "info").env("NO_COLOR", "1").env("HOME", "/");
    for (var, _) in std::env::vars().filter(|(v, _)| v.starts_with("UMBP_")) {
        cmd.env_remove(var);
    }
    run(cmd)
}

/// How many keyed requests the holder answered `mapped` (the bytes left through its mapping):
/// `umbp_transfer_tcp_server_requests_total{status="mapped"}` at its `/metrics`.
fn mapped_answers(metrics: &str) -> u64 {
    scrape(metrics)
        .lines()
        .filter(|l| l.starts_with("umbp_transfer_tcp_server_requests_total{") && l.contains("status=\"mapped\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_by_another_user_is_refused_the_mapping_and_served_over_tcp() {
    if !may_switch_user() {
        return;
    }
    let key = "refused-1";
    let expected = value(key, 256 << 10);
    let mut c = cluster("shm-refused", &[], key, &expected).await;

    // The control: the same user's get is not refused, and is answered through the mapping.
    let (code, out, err) = run(command(&["get", "--master", &c.address, key], &[]));
    assert_eq!(code, Some(0), "root get: {err}");
    assert!(out == expected, "root get: other bytes");
    let log = std::fs::read_to_string(&c.node.log).unwrap_or_default();
    assert!(!log.contains(REFUSAL), "a same-user get was refused:\n{log}");
    let mapped = mapped_answers(&c.metrics);
    assert!(mapped >= 1, "root's get was not answered through the mapping");

    // `nobody`: refused the mapping, served over TCP.
    let (code, out, err) = get_as_nobody(&c, key);
    assert_eq!(code, Some(0), "nobody's get: {err}");
    assert!(out == expected, "nobody's get returned other bytes");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = std::fs::read_to_string(&c.node.log).unwrap_or_default();
        if log.lines().any(|l| l.contains(REFUSAL) && l.contains("uid=65534")) {
            break;
        }
        assert!(Instant::now() < deadline, "the holder never refused nobody's mapping:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(mapped_answers(&c.metrics), mapped, "nobody's get was answered through the mapping");
    c.node.kill9();
    drop((c.master, c.dir));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_by_the_admitted_group_goes_through_the_mapping() {
    if !may_switch_user() {
        return;
    }
    let key = "grouped-1";
    let expected = value(key, 256 << 10);
    let mut c = cluster("shm-group", &["--shared-memory-group", NOBODY], key, &expected).await;

    let (code, out, err) = get_as_nobody(&c, key);
    assert_eq!(code, Some(0), "nobody's get: {err}");
    assert!(out == expected, "nobody's get returned other bytes");
    let log = std::fs::read_to_string(&c.node.log).unwrap_or_default();
    assert!(!log.contains(REFUSAL), "the admitted group's get was refused:\n{log}");
    let said = log.lines().any(|l| l.contains("shm server admits this group's processes") && l.contains("gid=65534"));
    assert!(said, "the holder never said whom it admits:\n{log}");
    assert!(mapped_answers(&c.metrics) >= 1, "nobody's get was not answered through the mapping");
    c.node.kill9();
    drop((c.master, c.dir));
}
