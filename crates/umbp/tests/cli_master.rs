//! `umbp master` as a real process, the one entry point of the master (it replaces the separate
//! `umbp-master` binary and its test): it starts on an OS-assigned port, serves gRPC, and shuts
//! down cleanly on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const UMBP: &str = env!("CARGO_BIN_EXE_umbp");

/// Kills the child if the test fails before it exits.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn umbp_master_serves_and_stops_on_sigterm() {
    let child = Command::new(UMBP)
        .args(["master", "--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .env_remove("UMBP_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn umbp master");
    let mut guard = Guard(child);
    let stdout = guard.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listen=").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_owned());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(20)).expect("the master prints its address");
    assert!(!addr.ends_with(":0"), "an OS-assigned port: {addr}");
    // It serves gRPC: the cluster status, over the master's API, lists no node.
    let stat = Command::new(UMBP)
        .args(["stat", "--master", &addr])
        .env_remove("UMBP_CONFIG")
        .env("RUST_LOG", "off")
        .output()
        .expect("run umbp stat");
    let text = String::from_utf8_lossy(&stat.stdout);
    assert!(stat.status.success(), "umbp stat: {}", String::from_utf8_lossy(&stat.stderr));
    assert!(text.contains("0 nodes"), "no node has joined: {text}");
    let pid = guard.0.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(code) = guard.0.try_wait().expect("wait") {
            assert!(code.success(), "exit status {code}");
            break;
        }
        assert!(Instant::now() < deadline, "the master did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
}
