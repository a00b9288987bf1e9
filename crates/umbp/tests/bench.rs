//! `umbp bench`: the binary runs a small bench end to end (the local node, a child node process over
//! TCP and through shared memory, the latency probes of both client paths, `umbp get` as a process) and prints the table with
//! its ratio column;
//! `umbp bench ssd` does the same for an SSD node beside raw `O_DIRECT` IO.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umbp::bench::{BASELINE_TOLERANCE, BenchPath, BenchRow, TABLE_HEADER, baseline_warnings, memcpy_threads};
use umbp::bench_metadata::METADATA_TABLE_HEADER;
use umbp::bench_ssd::SSD_TABLE_HEADER;

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
    let args = ["bench", "--rounds", "1", "--batch-bytes", "4MiB", "--latency-calls", "100"];
    let (code, out, err) = run_bounded(&args, Duration::from_secs(30));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains(TABLE_HEADER), "{out}");
    assert!(out.contains("| ratio |"), "{out}");
    let rows: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("| local |") || l.starts_with("| remote") || l.starts_with("| same host"))
        .collect();
    assert_eq!(
        rows.len(),
        24,
        "put and get of 64 KiB and 1 MiB, local, remote and same-host (three times each, gets four), and \
         routed local puts:\n{out}"
    );
    assert_eq!(rows.iter().filter(|r| r.contains("| put (routed) |")).count(), 2, "{out}");
    let same_host = rows.iter().filter(|r| r.starts_with("| same host (2 processes, shared memory) |"));
    assert_eq!(same_host.clone().filter(|r| r.contains("| memcpy |")).count(), 4, "{out}");
    assert_eq!(same_host.clone().filter(|r| r.contains("| pool over TCP |")).count(), 4, "{out}");
    // Gets also beside memcpy from a source in memory, where a put leaves a holder's bytes.
    let from_memory: Vec<&&str> = same_host.filter(|r| r.contains("| memcpy, source in memory |")).collect();
    assert_eq!(from_memory.len(), 2, "{out}");
    assert!(from_memory.iter().all(|r| r.contains("| get |")), "{out}");
    // Puts also beside their own copy, with streaming stores.
    let streamed: Vec<&&str> = rows.iter().filter(|r| r.contains("| copy with streaming stores |")).collect();
    assert_eq!(streamed.len(), 2, "{out}");
    assert!(streamed.iter().all(|r| r.starts_with("| same host") && r.contains("| put |")), "{out}");
    // And gets beside theirs: streaming stores from a source in memory.
    let streamed: Vec<&&str> =
        rows.iter().filter(|r| r.contains("| copy with streaming stores, source in memory |")).collect();
    assert_eq!(streamed.len(), 2, "{out}");
    assert!(streamed.iter().all(|r| r.starts_with("| same host") && r.contains("| get |")), "{out}");
    for row in &rows {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 7, "{row}");
        let ratio: f64 = cells[6].parse().expect("the ratio is a number");
        // Printed to 2 decimals: a loaded machine's 0.004 (a 64 KiB same-host cell beside memcpy)
        // prints 0.00 (seen in whole-suite runs on 2 cores).
        assert!(ratio.is_finite() && ratio >= 0.0, "{row}");
    }
    assert!(out.contains("memcpy") && out.contains("raw TCP x4"), "{out}");
    assert!(out.contains(&format!("memcpy baseline on {} threads", memcpy_threads())), "{out}");
    // The single get and put, each on both client paths, with the ratio of the two.
    let get =
        out.lines().find(|l| l.starts_with("single 64 KiB remote get, 100 calls per path in 10 alternating blocks"));
    let put = out.lines().find(|l| l.starts_with("single 64 KiB remote put of a new key, 100 calls per path"));
    for line in [get, put] {
        let line = line.unwrap_or_else(|| panic!("no single get or put line:\n{out}"));
        assert!(line.contains("keyed (") && line.contains("routed (") && line.contains("keyed/routed p50 "), "{line}");
        assert_eq!(line.matches(" µs, p99 ").count(), 2, "{line}");
    }
    // The single 1 MiB get and put on one host: shared memory beside TCP, with their ratio.
    let get = out.lines().find(|l| l.starts_with("single 1 MiB same-host get, 100 calls per path in 10 alternating"));
    let put = out.lines().find(|l| l.starts_with("single 1 MiB same-host put of a new key, 100 calls per path"));
    for line in [get, put] {
        let line = line.unwrap_or_else(|| panic!("no single 1 MiB get or put line:\n{out}"));
        assert!(
            line.contains("shared memory (") && line.contains("TCP (") && line.contains("shared/TCP p50 "),
            "{line}"
        );
        assert_eq!(line.matches(" µs, p99 ").count(), 2, "{line}");
    }
    // Which path the same-host keys took: with one round of 4 MiB batches, every key keyed.
    for line in [
        "same-host 64 KiB batches, 64 keys: 64 put in a keyed exchange (",
        "same-host 1 MiB batches, 4 keys: 4 put in a keyed exchange (",
    ] {
        assert!(out.contains(line), "{line}:\n{out}");
    }
    assert!(
        out.contains("`umbp get` of a 64 KiB value as a process, 30 runs: p50 ")
            && out.contains("(`umbp --version`: p50 "),
        "the CLI get beside the process start:\n{out}"
    );
}

#[test]
fn the_bench_json_names_the_baseline_threads_and_its_warnings() {
    let args = ["bench", "--rounds", "1", "--batch-bytes", "4MiB", "--latency-calls", "100", "--json"];
    let (code, out, err) = run_bounded(&args, Duration::from_secs(30));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let json = out.trim();
    // The fields of before stay; the new ones are added.
    assert_eq!(json.matches("\"baseline_gbps\":").count(), 24, "{json}");
    assert_eq!(json.matches("\"baseline_min_gbps\":").count(), 24, "{json}");
    assert_eq!(json.matches("\"baseline_max_gbps\":").count(), 24, "{json}");
    assert_eq!(
        json.matches("\"baseline_unsettled_gbps\":null").count(),
        14,
        "only in-cache memcpy rows have one: {json}"
    );
    assert_eq!(json.matches("\"path\":\"same-host\"").count(), 14, "{json}");
    assert_eq!(json.matches("\"baseline\":\"copy with streaming stores\"").count(), 2, "{json}");
    assert_eq!(json.matches("\"baseline\":\"copy with streaming stores, source in memory\"").count(), 2, "{json}");
    assert_eq!(json.matches("\"baseline\":\"memcpy, source in memory\"").count(), 2, "{json}");
    assert!(json.contains(&format!("\"memcpy_threads\":{}", memcpy_threads())), "{json}");
    assert!(json.contains("\"baseline_warnings\":["), "{json}");
    // `latency` stays the default client's single get (now the keyed path); the routed path and the
    // puts are beside it.
    for field in ["latency", "latency_routed", "put_latency", "put_latency_routed"] {
        let prefix = format!("\"{field}\":{{\"value_bytes\":65536,\"calls\":100,\"p50_us\":");
        assert_eq!(json.matches(&prefix).count(), 1, "{field}: {json}");
    }
    // The 1 MiB same-host single calls, shared memory and TCP (100 calls: the least per path).
    for field in ["latency_1m_shm", "latency_1m_tcp", "put_latency_1m_shm", "put_latency_1m_tcp"] {
        let prefix = format!("\"{field}\":{{\"value_bytes\":1048576,\"calls\":100,\"p50_us\":");
        assert_eq!(json.matches(&prefix).count(), 1, "{field}: {json}");
    }
    assert!(json.contains("\"breakdown\":null,\"breakdown_routed\":null,"), "no --breakdown: {json}");
    assert!(json.contains("\"batch_phases\":[]"), "no --breakdown, no batch phases: {json}");
    for value in [65_536, 1_048_576] {
        let keys = (4 << 20) / value;
        let prefix = format!("{{\"value_bytes\":{value},\"keys\":{keys},\"keyed_puts\":{keys},\"copied_ahead\":");
        assert!(json.contains(&prefix), "{prefix}: {json}");
    }
    assert!(
        json.contains("\"cli_get\":{\"value_bytes\":65536,\"get\":{\"runs\":30,\"p50_ms\":")
            && json.contains("\"version\":{\"runs\":30,\"p50_ms\":"),
        "{json}"
    );
    // A warning in the JSON is also on stderr.
    if !json.contains("\"baseline_warnings\":[]") {
        assert!(err.contains("warning:"), "{err}");
    }
}

fn row(path: BenchPath, op: &'static str, value_bytes: u64, baseline: &str, gbps: f64) -> BenchRow {
    BenchRow {
        path,
        op,
        value_bytes,
        pool_gbps: 1.0,
        baseline_gbps: gbps,
        baseline: baseline.into(),
        baseline_range: (gbps, gbps),
        unsettled_baseline_gbps: None,
    }
}

#[test]
fn two_baselines_of_one_kind_more_than_the_tolerance_apart_are_warned_of() {
    let local = BenchPath::Local;
    let agree = [
        row(local, "put", 65536, "memcpy", 8.0),
        row(local, "put (routed)", 65536, "memcpy", 8.0 * (1.0 + BASELINE_TOLERANCE) - 0.01),
        // Other sizes and other kinds of baseline are not compared.
        row(local, "put", 1 << 20, "memcpy", 2.0),
        row(BenchPath::Remote, "put", 65536, "raw TCP x4", 3.0),
        // A raw TCP write and a raw TCP read are different baselines.
        row(BenchPath::Remote, "get", 65536, "raw TCP x4", 5.0),
        // So are the pool's TCP put and get that the same-host rows stand beside.
        row(BenchPath::SameHost, "put", 65536, "pool over TCP", 1.0),
        row(BenchPath::SameHost, "get", 65536, "pool over TCP", 3.0),
    ];
    assert_eq!(baseline_warnings(&agree), Vec::<String>::new());

    let disagree = [row(local, "put", 65536, "memcpy", 2.0), row(local, "put (routed)", 65536, "memcpy", 7.5)];
    let warnings = baseline_warnings(&disagree);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("2.00") && warnings[0].contains("7.50") && warnings[0].contains("64 KiB"),
        "{warnings:?}"
    );

    // Put and get of one cell share one baseline: the pair is warned of once, naming both.
    let shared = [
        row(local, "put", 65536, "memcpy", 2.0),
        row(local, "get", 65536, "memcpy", 2.0),
        row(local, "put (routed)", 65536, "memcpy", 7.5),
    ];
    let warnings = baseline_warnings(&shared);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("local put/get 64 KiB"), "{warnings:?}");

    // The same-host rows' memcpy is the local rows' memcpy of the same size: compared across paths.
    let across = [row(local, "put", 65536, "memcpy", 8.0), row(BenchPath::SameHost, "get", 65536, "memcpy", 4.0)];
    let warnings = baseline_warnings(&across);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("same-host get 64 KiB"), "{warnings:?}");

    // A threaded baseline below one thread's unsettled copy of the same rounds: the cores were busy.
    let mut busy = row(local, "put", 1 << 20, "memcpy", 6.5);
    busy.unsettled_baseline_gbps = Some(6.9);
    let mut quiet = row(local, "put", 65536, "memcpy", 12.0);
    quiet.unsettled_baseline_gbps = Some(6.5);
    let warnings = baseline_warnings(&[busy, quiet]);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("1 MiB") && warnings[0].contains("busy"), "{warnings:?}");
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

/// A directory on the disk the workspace is on: the ssd suite needs `O_DIRECT`, which tmpfs (a
/// common system temp dir) refuses.
fn work_disk_dir(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("bench dir");
    dir
}

/// The cells of a markdown table row.
fn cells(row: &str) -> Vec<&str> {
    row.trim_matches('|').split('|').map(str::trim).collect()
}

#[test]
fn a_small_ssd_bench_prints_every_engine_and_size_beside_raw_o_direct() {
    let dir = work_disk_dir("bench-ssd");
    let dir_arg = dir.to_str().expect("utf-8 path");
    let args = ["bench", "ssd", "--ssd-dir", dir_arg, "--rounds", "1", "--batch-bytes", "4MiB"];
    let (code, out, err) = run_bounded(&args, Duration::from_secs(60));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains(SSD_TABLE_HEADER), "{out}");
    assert!(err.contains("umbp bench ssd: psync 1 MiB values, rounds 1/1"), "progress on stderr:\n{err}");
    let rows: Vec<Vec<&str>> =
        out.lines().filter(|l| l.starts_with("| psync") || l.starts_with("| io_uring")).map(cells).collect();
    let mut expected = vec![
        ("psync", "put", "1 MiB"),
        ("psync", "get", "1 MiB"),
        ("psync", "put", "2 MiB"),
        ("psync", "get", "2 MiB"),
    ];
    // io_uring may be refused (an old kernel, a seccomp sandbox): then the table says so instead.
    if out.contains("io_uring rows skipped") {
        assert!(!out.contains("| io_uring |"), "{out}");
    } else {
        expected.extend([
            ("io_uring", "put", "1 MiB"),
            ("io_uring", "get", "1 MiB"),
            ("io_uring", "put", "2 MiB"),
            ("io_uring", "get", "2 MiB"),
        ]);
    }
    let found: Vec<(&str, &str, &str)> = rows.iter().map(|c| (c[0], c[1], c[2])).collect();
    assert_eq!(found, expected, "{out}");
    for row in &rows {
        assert_eq!(row.len(), 7, "{row:?}");
        let number = |i: usize| -> f64 { row[i].parse().unwrap_or_else(|_| panic!("cell {i} of {row:?} is a number")) };
        let (pool, raw, ratio) = (number(3), number(4), number(5));
        assert!(pool >= 0.0 && raw >= 0.0 && ratio > 0.0 && ratio.is_finite(), "{row:?}");
        if pool < 0.01 || raw < 0.01 {
            // A figure printed as 0.00 (a megabyte taking over 200 ms on a loaded machine) carries
            // no digits to check the ratio against: the shape of the row is all a test can pin.
            continue;
        }
        // Every figure is printed to two decimals: the ratio is pool / raw within that rounding.
        let (low, high) = ((pool - 0.005) / (raw + 0.005) - 0.005, (pool + 0.005) / (raw - 0.005).max(1e-9) + 0.005);
        assert!(low <= ratio && ratio <= high, "{row:?}: not pool / raw");
        let (low, high) = row[6].split_once('–').expect("a range of round ratios");
        let (low, high): (f64, f64) = (low.parse().expect("low"), high.parse().expect("high"));
        // One round: the range is that round's ratio, which is the ratio of the medians.
        assert!((low - ratio).abs() < 0.011 && (high - ratio).abs() < 0.011, "{row:?}");
    }
    let left: Vec<_> = std::fs::read_dir(&dir).expect("bench dir").collect();
    assert!(left.is_empty(), "the bench removes its subdirectory: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_ssd_bench_prints_json_for_one_engine() {
    let dir = work_disk_dir("bench-ssd-json");
    let dir_arg = dir.to_str().expect("utf-8 path");
    let args = [
        "bench",
        "ssd",
        "--ssd-dir",
        dir_arg,
        "--ssd-io-engine",
        "psync",
        "--rounds",
        "1",
        "--batch-bytes",
        "2MiB",
        "--json",
    ];
    let (code, out, err) = run_bounded(&args, Duration::from_secs(60));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let json = out.trim();
    assert!(json.starts_with("{\"suite\":\"ssd\"") && json.ends_with('}'), "{json}");
    assert_eq!(json.matches("\"engine\":\"psync\"").count(), 4, "put and get of two sizes: {json}");
    assert!(!json.contains("io_uring"), "{json}");
    assert_eq!(json.matches("\"ratio\":").count(), 4, "{json}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_ssd_bench_needs_a_directory_and_a_batch_of_one_value() {
    let (code, _, err) = run_bounded(&["bench", "ssd"], Duration::from_secs(10));
    assert_eq!(code, Some(2), "a usage error: {err}");
    assert!(err.contains("--ssd-dir"), "{err}");
    let dir = work_disk_dir("bench-ssd-usage");
    let dir_arg = dir.to_str().expect("utf-8 path");
    let (code, _, err) =
        run_bounded(&["bench", "ssd", "--ssd-dir", dir_arg, "--batch-bytes", "1MiB"], Duration::from_secs(10));
    assert_eq!(code, Some(2), "a usage error: {err}");
    assert!(err.contains("at least 2MiB"), "{err}");
    let (code, _, err) =
        run_bounded(&["bench", "ssd", "--ssd-dir", dir_arg, "--ssd-io-engine", "aio"], Duration::from_secs(10));
    assert_eq!(code, Some(2), "clap refuses an unknown engine: {err}");
    let _ = std::fs::remove_dir_all(&dir);
    let (code, out, _) = run_bounded(&["bench", "--help"], Duration::from_secs(10));
    assert_eq!(code, Some(0));
    for needle in ["--ssd-dir", "--ssd-io-engine", "- io_uring:", "- both:", "SUITE ssd", "O_DIRECT"] {
        assert!(out.contains(needle), "`umbp bench --help` lacks {needle:?}:\n{out}");
    }
}

/// Whether `redis-server` runs here (CI installs it; the metadata suite runs its Redis rows then).
fn redis_server_installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_small_metadata_bench_prints_each_store_beside_the_memory_row() {
    let args = ["bench", "metadata", "--duration", "200ms", "--memory-keys", "2000"];
    let (code, out, err) = run_bounded(&args, Duration::from_secs(30));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains(METADATA_TABLE_HEADER), "{out}");
    assert!(err.contains("umbp bench metadata: memory 3/3"), "progress on stderr:\n{err}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("| memory |") || l.starts_with("| redis")).collect();
    let expected = if redis_server_installed() { 3 } else { 1 };
    assert_eq!(rows.len(), expected, "{out}");
    for row in &rows {
        let cells = cells(row);
        assert_eq!(cells.len(), 7, "{row}");
        for ratio in [cells[2], cells[4], cells[6]] {
            let ratio: f64 = ratio.parse().expect("a ratio");
            assert!(ratio.is_finite() && ratio > 0.0, "{row}");
        }
    }
    assert!(rows[0].contains("| 1.00 | ") && !rows[0].contains("| 0 |"), "{out}");
    if expected == 3 {
        assert!(rows[1].starts_with("| redis x1 |") && rows[2].starts_with("| redis x3 (sharded) |"), "{out}");
        let line = out.lines().find(|l| l.starts_with("Redis memory per key: ")).expect("the memory line");
        assert!(line.contains("(2000 keys of 64 bytes"), "{line}");
    }
}

#[test]
fn the_metadata_bench_without_redis_server_runs_the_memory_row_and_says_why() {
    let empty = std::env::temp_dir().join(format!("umbp-bench-no-redis-{}", std::process::id()));
    std::fs::create_dir_all(&empty).expect("an empty PATH directory");
    let child = Command::new(env!("CARGO_BIN_EXE_umbp"))
        .args(["bench", "metadata", "--duration", "100ms", "--json"])
        .env("PATH", &empty)
        .stdin(Stdio::null())
        .output()
        .expect("run umbp");
    let _ = std::fs::remove_dir(&empty);
    let out = String::from_utf8_lossy(&child.stdout);
    assert_eq!(child.status.code(), Some(0), "{out}\n{}", String::from_utf8_lossy(&child.stderr));
    let json = out.trim();
    assert!(json.starts_with("{\"suite\":\"metadata\"") && json.ends_with('}'), "{json}");
    assert_eq!(json.matches("\"store\":").count(), 1, "the memory row only: {json}");
    assert!(json.contains("\"memory\":null") && json.contains("cannot start redis-server"), "{json}");
}

#[test]
fn a_short_soak_samples_every_process_and_reads_no_wrong_byte() {
    let (code, out, err) = run_bounded(&["bench", "soak", "--duration", "4s"], Duration::from_secs(60));
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains(umbp::bench_soak::SAMPLE_HEADER), "{out}");
    let samples: Vec<&str> = out
        .lines()
        .filter(|l| l.strip_prefix("| ").is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit())))
        .collect();
    assert!(samples.len() >= 6, "a sample at the start and six over the run:\n{out}");
    // Every process was read from /proc: no column of zeros.
    for line in &samples {
        let processes: Vec<&str> = line.split('|').skip(2).take(4).map(str::trim).collect();
        // Memory may round to 0 MiB; a live process has descriptors and threads.
        let read = |p: &&str| p.split(" / ").skip(1).all(|n| n.parse::<u64>().is_ok_and(|n| n > 0));
        assert!(processes.len() == 4 && processes.iter().all(read), "unsampled: {line}\n{out}");
    }
    assert!(out.contains(", 0 wrong bytes"), "{out}");
    assert!(out.contains("growth from "), "{out}");
}
