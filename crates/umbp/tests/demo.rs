//! `umbp demo`: in process through the library, and as the binary a newcomer runs first.

use std::process::Command;
use std::time::Duration;

use umbp::demo::{self, DemoOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_reads_back_every_key_and_reports_placement() {
    let options = DemoOptions { keys: 96, capacity: 32 << 20, max_value: 256 << 10, ..DemoOptions::default() };
    let report = tokio::time::timeout(Duration::from_secs(60), demo::run(options.clone()))
        .await
        .expect("the demo finishes")
        .expect("the demo runs");
    assert!(report.passed(), "{report}");
    assert_eq!(report.local_hits + report.remote_hits, 96);
    assert!(report.remote_hits > 0, "some keys come over TCP from other nodes");
    assert_eq!(report.expected_misses, 16);
    assert_eq!(report.placement.len(), 3);
    assert_eq!(report.placement.iter().map(|p| p.keys).sum::<u64>(), 96, "each key stored once");
    assert_eq!(report.placement.iter().map(|p| p.indexed_keys).sum::<u64>(), 96, "the master indexed them all");
    let text = report.to_string();
    for needle in ["put  96 keys", "hits 96", "misses 16", "placement", "n1", "n2", "n3", "result: PASS"] {
        assert!(text.contains(needle), "summary lacks {needle:?}:\n{text}");
    }
}

#[test]
fn the_binary_runs_the_demo_and_refuses_impossible_options() {
    let out = Command::new(env!("CARGO_BIN_EXE_umbp"))
        .args(["demo", "--keys", "48", "--capacity", "16MiB", "--max-value", "128KiB"])
        .env("NO_COLOR", "1")
        .output()
        .expect("run umbp demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("result: PASS"), "{stdout}");

    let out = Command::new(env!("CARGO_BIN_EXE_umbp")).args(["demo", "--nodes", "1"]).output().expect("run umbp demo");
    assert_eq!(out.status.code(), Some(2), "bad options are a usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 2"));
}
