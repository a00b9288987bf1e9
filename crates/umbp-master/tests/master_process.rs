//! The `umbp-master` binary as a real process: it starts on an OS-assigned port, serves gRPC, and
//! shuts down cleanly on SIGTERM.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

/// Kills the child if the test fails before it exits.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_binary_serves_and_stops_on_sigterm() {
    let child = Command::new(env!("CARGO_BIN_EXE_umbp-master"))
        .args(["--listen", "127.0.0.1:0"])
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn umbp-master");
    let mut guard = Guard(child);
    let stdout = guard.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("addr=").nth(1) {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or_default().to_owned());
            }
        }
    });
    let addr = rx.recv_timeout(Duration::from_secs(20)).expect("the master logs its address");
    let mut client = UmbpMasterClient::connect(format!("http://{addr}")).await.expect("connect");
    let status = client.get_cluster_status(v1::GetClusterStatusRequest {}).await.expect("status").into_inner();
    assert!(status.nodes.is_empty());
    drop(client);
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
