//! `umbp bench`: the binary runs a small bench end to end (the local node, a child node process over
//! TCP, the latency probe) and prints the table with its ratio column.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbp::bench::TABLE_HEADER;

/// Runs `umbp ARGS`, killing it past `limit`; returns (exit code, stdout, stderr).
fn run_bounded(args: &[&str], limit: Duration) -> (Option<i32>, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_umbp"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn umbp");
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("umbp {args:?} ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().expect("stdout").read_to_string(&mut out).expect("read stdout");
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("read stderr");
    (status.code(), out, err)
}

#[test]
fn a_small_bench_prints_every_row_beside_its_baseline() {
    let (code, out, err) = run_bounded(&["bench", "--rounds", "1", "--batch-bytes", "4MiB"], Duration::from_secs(20));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains(TABLE_HEADER), "{out}");
    assert!(out.contains("| ratio |"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("| local |") || l.starts_with("| remote")).collect();
    assert_eq!(rows.len(), 8, "put and get of 64 KiB and 1 MiB, local and remote:\n{out}");
    for row in &rows {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 7, "{row}");
        let ratio: f64 = cells[6].parse().expect("the ratio is a number");
        assert!(ratio.is_finite() && ratio > 0.0, "{row}");
    }
    assert!(out.contains("memcpy") && out.contains("raw TCP x4"), "{out}");
    assert!(out.contains("p50") && out.contains("p99"), "{out}");
}

#[test]
fn the_bench_refuses_impossible_options_and_hides_its_child() {
    let (code, _, err) = run_bounded(&["bench", "--batch-bytes", "4KiB"], Duration::from_secs(10));
    assert_eq!(code, Some(2), "bad options are a usage error: {err}");
    assert!(err.contains("at least 1MiB"), "{err}");

    let (code, out, _) = run_bounded(&["--help"], Duration::from_secs(10));
    assert_eq!(code, Some(0));
    assert!(out.contains("bench"), "{out}");
    assert!(!out.contains("bench-child"), "the child subcommand is hidden:\n{out}");
}
