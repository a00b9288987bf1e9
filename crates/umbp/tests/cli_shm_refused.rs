//! The shared-memory path refuses a process of another user, through real nodes (issue 17, item 4):
//! a holder `umbp node` run as root, and `umbp get` run as `nobody` (`setpriv`) on the same host.
//! The holder's shared-memory server checks the connecting process's credentials (`SO_PEERCRED`)
//! before anything else and refuses it; the get still returns the value, over TCP. The same get
//! as root is served through the mapping and refused nothing — the control that makes the refusal
//! line the other user's.
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

const REFUSAL: &str = "shm peer refused: another user";

/// Runs `prefix… umbp ARGS` to completion (at most 30 s); (exit code, stdout, stderr).
fn run(mut cmd: Command) -> (Option<i32>, Vec<u8>, String) {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).current_dir("/");
    let child = cmd.spawn().expect("spawn");
    let started = Instant::now();
    let out = child.wait_with_output().expect("wait");
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    (out.status.code(), out.stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_by_another_user_is_refused_the_mapping_and_served_over_tcp() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        assert!(std::env::var("UMBP_REQUIRE_ROOT").map_or(true, |v| v != "1"), "UMBP_REQUIRE_ROOT=1 but not root");
        eprintln!("SKIPPED: running a process as another user needs root");
        return;
    }
    let dir = TempDir::new("shm-refused");
    // A copy of the binary every user may run, whatever the checkout's permissions.
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).expect("chmod dir");
    let exe = dir.0.join("umbp");
    std::fs::copy(UMBP, &exe).expect("copy umbp");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod umbp");

    let (master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    let node_args = [
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
    ];
    let (mut node, _) = Proc::try_start(&dir.0, "h1", &node_args, &[], "node h1").unwrap_or_else(|e| panic!("{e}"));
    let client = PoolClient::start(PoolClientConfig::new("refused-writer", address.clone())).await.expect("client");
    let key = "refused-1";
    let expected = value(key, 256 << 10);
    client.put(key, &expected).await.expect("put");
    client.close().await;

    // The control: the same user's get is not refused.
    let (code, out, err) = run(command(&["get", "--master", &address, key], &[]));
    assert_eq!(code, Some(0), "root get: {err}");
    assert!(out == expected, "root get: other bytes");
    let log = std::fs::read_to_string(&node.log).unwrap_or_default();
    assert!(!log.contains(REFUSAL), "a same-user get was refused:\n{log}");

    // `nobody`: refused the mapping, served over TCP.
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(&exe);
    cmd.args(["get", "--master", &address, key]).env("RUST_LOG", "info").env("NO_COLOR", "1").env("HOME", "/");
    for (var, _) in std::env::vars().filter(|(v, _)| v.starts_with("UMBP_")) {
        cmd.env_remove(var);
    }
    let (code, out, err) = run(cmd);
    assert_eq!(code, Some(0), "nobody's get: {err}");
    assert!(out == expected, "nobody's get returned other bytes");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = std::fs::read_to_string(&node.log).unwrap_or_default();
        if log.lines().any(|l| l.contains(REFUSAL) && l.contains("uid=65534")) {
            break;
        }
        assert!(Instant::now() < deadline, "the holder never refused nobody's mapping:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    node.kill9();
    drop(master);
}
