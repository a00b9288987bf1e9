//! The `umbp` command behaving like a Unix tool and answering honestly, as real processes: a closed
//! stdout ends a client command quietly (exit status 141) and it still leaves the pool; `stat` shows
//! nodes and clients apart; a second `put` of a key says the stored value was kept, `--replace`
//! replaces it; `rm` waits out a reader's lease; `umbp node` failures carry the OS reason, the hint
//! about the master only when the master is unreachable, and exit status 2 for setup errors; bad
//! settings are refused; long keys are shortened in messages.
//!
//! Every child is killed by a guard's `Drop`; every wait is bounded.

use std::net::TcpListener;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_run;
mod cli_support;

use cli_run::{Out, cli, cli_with};
use cli_support::{Proc, TempDir, command, field, value};

/// Short heartbeats, so keys become visible quickly.
const FAST: &[(&str, &str)] = &[("UMBP_HEARTBEAT_TTL_SEC", "1"), ("UMBP_REAPER_INTERVAL_SEC", "1")];

fn start_master(dir: &Path, env: &[(&str, &str)]) -> (Proc, String) {
    let (master, line) = Proc::try_start(dir, "master", &["master", "--listen", "127.0.0.1:0"], env, "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    (master, address)
}

/// `umbp node` on `master` as `id` with `extra` flags (64 KiB pages unless `extra` sets them).
fn node_args<'a>(master: &'a str, id: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["node", "--master", master, "--node-id", id, "--prefault", "false"];
    if !extra.contains(&"--page-size") {
        args.extend_from_slice(&["--page-size", "64KiB"]);
    }
    args.extend_from_slice(extra);
    args
}

fn start_dram_node(dir: &Path, master: &str, id: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut args = node_args(master, id, &["--capacity", "16MiB"]);
    args.extend_from_slice(extra);
    Proc::try_start(dir, id, &args, env, &format!("node {id}")).unwrap_or_else(|e| panic!("{e}")).0
}

/// Runs `umbp node …` expecting it to fail before it is ready: its exit status and stderr.
fn failed_node(args: &[&str], env: &[(&str, &str)]) -> Out {
    let out = cli_with(args, None, env);
    assert!(!out.text().contains(" ready "), "the node must not start: {}", out.text());
    out
}

fn umbp(master: &str, command: &str, rest: &[&str], stdin: Option<&[u8]>) -> Out {
    let args: Vec<&str> = [command, "--master", master].into_iter().chain(rest.iter().copied()).collect();
    cli(&args, stdin)
}

/// Ids of the records the master holds whose id starts with `cli-` (the client commands').
async fn cli_records(client: &PoolClient) -> Vec<String> {
    let status = client.master().cluster_status().await.expect("cluster status");
    status.nodes.iter().filter(|n| n.node_id.starts_with("cli-")).map(|n| n.node_id.clone()).collect()
}

/// Runs a client command whose stdout is closed before it writes: the reader went away.
fn with_closed_stdout(args: &[&str]) -> (i32, String) {
    let mut cmd = command(args, &[]);
    cmd.env("RUST_LOG", "warn").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn umbp");
    drop(child.stdout.take());
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "`umbp {}` ran past 30 s", args.join(" "));
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    (status.code().unwrap_or(-1), stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_ends_a_client_command_quietly_and_it_still_unregisters() {
    let dir = TempDir::new("pipe");
    let (_master, address) = start_master(&dir.0, FAST);
    let _node = start_dram_node(&dir.0, &address, "n1", &[], FAST);
    let keys: Vec<String> = (0..50).map(|i| format!("k{i}")).collect();
    let out = umbp(&address, "put", &[&keys[0], "-"], Some(b"value"));
    assert_eq!(out.code, 0, "{}", out.stderr);

    let mut exists = vec!["exists", "--master", address.as_str()];
    exists.extend(keys.iter().map(String::as_str));
    for args in [vec!["stat", "--master", address.as_str()], exists, vec!["get", "--master", &address, &keys[0]]] {
        let (code, stderr) = with_closed_stdout(&args);
        assert_eq!(code, 141, "`umbp {}` on a closed pipe: {stderr}", args[0]);
        assert!(!stderr.contains("panicked"), "no panic: {stderr}");
        assert!(stderr.trim().is_empty(), "quiet: {stderr}");
    }
    // None of those commands left its client registered behind it.
    let client = PoolClient::start(PoolClientConfig::new("observer", address.clone())).await.expect("joins");
    assert_eq!(cli_records(&client).await, Vec::<String>::new(), "every client command unregistered");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stat_shows_nodes_and_clients_apart() {
    let dir = TempDir::new("stat");
    let (_master, address) = start_master(&dir.0, FAST);
    let _node = start_dram_node(&dir.0, &address, "n1", &[], FAST);
    // A medium-less client is listed only when it registers: it asks to here (or serves /metrics).
    let mut listed = PoolClientConfig::new("reader-7", address.clone());
    listed.register_client = true;
    let client = PoolClient::start(listed).await.expect("joins");
    let light = PoolClient::start(PoolClientConfig::new("light-8", address.clone())).await.expect("starts");
    let out = umbp(&address, "stat", &[], None);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let text = out.text();
    let first = text.lines().next().unwrap_or_default();
    assert!(first.contains("1 node (1 alive), 1 client, 0 keys"), "{text}");
    let node_table = text.find("\nNODE ").expect("a node table");
    let client_table = text.find("\nCLIENT ").expect("a client table");
    let n1 = text.find("\nn1 ").expect("n1 listed");
    let reader = text.find("\nreader-7 ").expect("the client listed");
    assert!(node_table < n1 && n1 < client_table && client_table < reader, "n1 a node, reader-7 a client:\n{text}");
    assert!(!text.contains("cli-"), "stat leaves out its own client:\n{text}");
    assert!(!text.contains("light-8"), "a light client is not listed:\n{text}");
    light.close().await;
    client.close().await;
}

/// Listening TCP sockets process `pid` holds open (its fds against its namespace's LISTEN table).
fn listeners_of(pid: u32) -> usize {
    let mut listening = std::collections::HashSet::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if cols.len() > 9 && cols[3] == "0A" {
                listening.extend(cols[9].parse::<u64>().ok());
            }
        }
    }
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the process's fds")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|t| t.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.parse::<u64>().ok())
        .filter(|inode| listening.contains(inode))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn umbp_get_is_a_light_client_it_listens_on_nothing_and_is_not_listed() {
    let dir = TempDir::new("light-get");
    let (master, address) = start_master(&dir.0, FAST);
    let node = start_dram_node(&dir.0, &address, "n1", &[], FAST);
    assert!(listeners_of(master.child.id()) > 0 && listeners_of(node.child.id()) > 0, "the check sees listeners");
    // Larger than a pipe's buffer: `umbp get` into a FIFO blocks in its write, mid-command, until
    // this test reads, so it is caught alive with its client up.
    let stored = value("big", 256 << 10);
    assert_eq!(umbp(&address, "put", &["big", "-"], Some(&stored)).code, 0);
    let fifo = dir.0.join("get.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let fifo_arg = fifo.to_str().expect("utf-8 path").to_owned();
    let mut get = command(&["get", "--master", &address, "big", &fifo_arg], &[])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn umbp get");
    // Opening the read end waits for `umbp get` to open the write end: it has joined and read.
    let reader = {
        let fifo = fifo.clone();
        tokio::task::spawn_blocking(move || std::fs::File::open(fifo)).await.expect("join").expect("open fifo")
    };
    assert_eq!(listeners_of(get.id()), 0, "`umbp get` opens no listening socket");
    let observer = PoolClient::start(PoolClientConfig::new("observer", address.clone())).await.expect("starts");
    assert_eq!(cli_records(&observer).await, Vec::<String>::new(), "`umbp get` is not a node of the cluster");
    let out = umbp(&address, "stat", &[], None);
    assert!(out.text().starts_with(&format!("master {address}: 1 node (1 alive), 0 clients")), "{}", out.text());
    let got = tokio::task::spawn_blocking(move || {
        let mut reader = reader;
        let mut got = Vec::new();
        std::io::Read::read_to_end(&mut reader, &mut got).map(|_| got)
    })
    .await
    .expect("join")
    .expect("read fifo");
    let status = get.wait().expect("wait umbp get");
    let mut stderr = String::new();
    if let Some(mut e) = get.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
    }
    assert!(status.success(), "umbp get: {stderr}");
    assert!(got == stored, "byte-exact: {} of {} bytes", got.len(), stored.len());
    observer.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_put_keeps_the_stored_value_and_says_so_and_replace_replaces_it() {
    let dir = TempDir::new("put-twice");
    let (_master, address) = start_master(&dir.0, FAST);
    let _node = start_dram_node(&dir.0, &address, "n1", &[], FAST);
    let (first, second) = (value("first", 3000), value("second", 5000));

    let out = umbp(&address, "put", &["k", "-"], Some(&first));
    assert_eq!((out.code, out.text().starts_with("stored k ")), (0, true), "{} {}", out.text(), out.stderr);
    let out = umbp(&address, "put", &["k", "-"], Some(&second));
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.text().starts_with("kept k: already present"), "says the value was kept: {}", out.text());
    assert!(out.text().contains("--replace"), "offers the way to replace it: {}", out.text());
    let out = umbp(&address, "get", &["k"], None);
    assert!(out.code == 0 && out.stdout == first, "the first value stays: {}", out.stderr);

    let out = umbp(&address, "put", &["--replace", "k", "-"], Some(&second));
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.text().starts_with("stored k "), "{}", out.text());
    let out = umbp(&address, "get", &["k"], None);
    assert!(out.code == 0 && out.stdout == second, "replaced: {} bytes, {}", out.stdout.len(), out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rm_waits_out_a_read_lease_and_a_missing_key_exits_1() {
    let dir = TempDir::new("rm-lease");
    let (_master, address) = start_master(&dir.0, FAST);
    // A read lease far longer than one rm call: a get just before rm holds the key.
    let lease = [("UMBP_DRAM_READ_LEASE_MS", "2500"), FAST[0], FAST[1]];
    let _node = start_dram_node(&dir.0, &address, "n1", &[], &lease);
    assert_eq!(umbp(&address, "put", &["k", "-"], Some(b"v")).code, 0);
    let client = PoolClient::start(PoolClientConfig::new("reader", address.clone())).await.expect("joins");
    let mut buf = [0u8; 8];
    assert_eq!(client.get("k", &mut buf).await, Ok(1));
    let out = umbp(&address, "rm", &["k"], None);
    assert_eq!(out.code, 0, "{} {}", out.text(), out.stderr);
    assert!(out.text().starts_with("removed\tk\t"), "removed once the lease ended: {}", out.text());
    assert_eq!(umbp(&address, "exists", &["k"], None).code, 1, "gone");
    let out = umbp(&address, "rm", &["k"], None);
    assert_eq!((out.code, out.text()), (1, "missing\tk\n".to_owned()), "{}", out.stderr);
    client.close().await;
}

#[test]
fn node_start_failures_carry_the_reason_and_the_right_hint_and_status() {
    let dir = TempDir::new("node-errors");
    let hint = "is `umbp master` running there?";

    // No master: the hint, exit status 3.
    let out = failed_node(&node_args("127.0.0.1:1", "n1", &["--capacity", "16MiB"]), &[]);
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(out.stderr.contains(hint), "{}", out.stderr);

    let (_master, address) = start_master(&dir.0, &[("UMBP_CLUSTER_TOKEN", "s3cret")]);
    let token = [("UMBP_CLUSTER_TOKEN", "s3cret")];
    // A data port in use: the OS reason, no master hint, exit status 2.
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port().to_string();
    let out = failed_node(&node_args(&address, "n1", &["--capacity", "16MiB", "--data-port", &port]), &token);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.to_lowercase().contains("address already in use"), "the OS reason: {}", out.stderr);
    assert!(!out.stderr.contains(hint), "the master is running: {}", out.stderr);
    let taken_peer = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken_peer.local_addr().expect("addr").port().to_string();
    let out = failed_node(&node_args(&address, "n1", &["--capacity", "16MiB", "--peer-port", &port]), &token);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.to_lowercase().contains("address already in use"), "{}", out.stderr);

    // A wrong token: says so, no master hint, exit status 2.
    let out = failed_node(&node_args(&address, "n1", &["--capacity", "16MiB"]), &[("UMBP_CLUSTER_TOKEN", "wrong")]);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("token") && !out.stderr.contains(hint), "{}", out.stderr);

    // Settings the node cannot honour are refused, exit status 2.
    let out = failed_node(&node_args(&address, "n1", &["--page-size", "3"]), &token);
    assert!(out.code == 2 && out.stderr.contains("4KiB"), "page size 3: {}", out.stderr);
    let out = failed_node(&node_args(&address, "n1", &["--page-size", "6KiB"]), &token);
    assert!(out.code == 2 && out.stderr.contains("4KiB"), "page size 6KiB: {}", out.stderr);
    let ssd = dir.0.join("ssd");
    std::fs::create_dir_all(&ssd).expect("ssd dir");
    let ssd = ssd.display().to_string();
    let out =
        failed_node(&node_args(&address, "s1", &["--medium", "ssd", "--ssd-dir", &ssd, "--capacity", "1GiB"]), &token);
    assert!(out.code == 2 && out.stderr.contains("--ssd-capacity"), "--capacity on ssd: {}", out.stderr);

    // A missing SSD directory is refused unless asked for; asked for, it is created.
    let missing = dir.0.join("not-mounted").join("umbp");
    let missing_s = missing.display().to_string();
    let args = ["--medium", "ssd", "--ssd-dir", &missing_s, "--ssd-capacity", "8MiB"];
    let out = failed_node(&node_args(&address, "s1", &args), &token);
    assert!(out.code == 2 && out.stderr.contains("does not exist"), "{}", out.stderr);
    assert!(out.stderr.contains("--ssd-create-dirs") && !missing.exists(), "{}", out.stderr);
    let mut args = node_args(&address, "s1", &args);
    args.push("--ssd-create-dirs");
    let (mut node, _) = Proc::try_start(&dir.0, "s1", &args, &token, "node s1").unwrap_or_else(|e| panic!("{e}"));
    assert!(missing.is_dir(), "created on request");
    node.kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_key_is_shortened_in_messages() {
    let dir = TempDir::new("long-key");
    let (_master, address) = start_master(&dir.0, FAST);
    let _node = start_dram_node(&dir.0, &address, "n1", &[], FAST);
    let key = "x".repeat(300);
    let out = umbp(&address, "get", &[&key], None);
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(!out.stderr.contains(&key), "not echoed in full: {}", out.stderr);
    assert!(out.stderr.contains("(300 bytes)") && out.stderr.contains("not found"), "{}", out.stderr);
    let out = umbp(&address, "put", &[&key, "-"], Some(b"v"));
    assert!(out.code == 0 && !out.text().contains(&key) && out.text().contains("(300 bytes)"), "{}", out.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ssd_node_is_ready_only_once_its_recovered_keys_are_readable() {
    let dir = TempDir::new("ssd-ready");
    // The default heartbeat (10 s TTL, 5 s interval): the ready line must not wait for one.
    let (_master, address) = start_master(&dir.0, &[]);
    let ssd = dir.0.join("ssd");
    std::fs::create_dir_all(&ssd).expect("ssd dir");
    let ssd = ssd.display().to_string();
    let args = node_args(&address, "s1", &["--medium", "ssd", "--ssd-dir", &ssd, "--ssd-capacity", "32MiB"]);
    let (mut node, _) = Proc::try_start(&dir.0, "s1", &args, &[], "node s1").unwrap_or_else(|e| panic!("{e}"));
    let keys: Vec<String> = (0..8).map(|i| format!("ssd-key-{i}")).collect();
    for k in &keys {
        let out = umbp(&address, "put", &[k, "-"], Some(&value(k, 10_000)));
        assert_eq!(out.code, 0, "{}", out.stderr);
    }
    node.kill9();
    let (_node, line) = Proc::try_start(&dir.0, "s1-again", &args, &[], "node s1").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(field(&line, "keys"), "8", "{line}");
    for k in &keys {
        let out = umbp(&address, "get", &[k], None);
        assert!(out.code == 0 && out.stdout == value(k, 10_000), "{k} right after the ready line: {}", out.stderr);
    }
}

/// Issue 13, item 1, as a user runs it: 200 `umbp get` processes in a row from an SSD node with 16
/// staging pages and a read lease (30 s) longer than the whole run, with a `umbp put` every 20 gets.
/// Each process releases what it read before it exits; before releases, the 17th get was `not found`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_umbp_gets_in_a_row_from_a_sixteen_page_ssd_node_all_succeed() {
    let dir = TempDir::new("ssd-200");
    let (_master, address) = start_master(&dir.0, FAST);
    let ssd = dir.0.join("ssd");
    std::fs::create_dir_all(&ssd).expect("ssd dir");
    let ssd = ssd.display().to_string();
    let extra = [
        "--medium",
        "ssd",
        "--ssd-dir",
        &ssd,
        "--ssd-capacity",
        "64MiB",
        "--ssd-staging-pages",
        "16",
        "--ssd-read-lease",
        "30s",
    ];
    let (_node, _) = Proc::try_start(&dir.0, "s1", &node_args(&address, "s1", &extra), FAST, "node s1")
        .unwrap_or_else(|e| panic!("{e}"));
    let client = PoolClient::start(PoolClientConfig::new("writer", address.clone())).await.expect("joins");
    let keys: Vec<String> = (0..200).map(|i| format!("ssd-200-{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value(k, 20_000)).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    // In batches of 8: a batch is staged whole on the node's 16 pages.
    for batch in items.chunks(8) {
        for r in client.batch_put(batch).await {
            r.expect("put");
        }
    }
    client.close().await;
    for (i, (k, v)) in keys.iter().zip(&values).enumerate() {
        let out = umbp(&address, "get", &[k], None);
        assert!(out.code == 0 && out.stdout == *v, "get {i} ({k}): exit {} {}", out.code, out.stderr);
        if i % 20 == 19 {
            let key = format!("interleaved-{i}");
            let out = umbp(&address, "put", &[&key, "-"], Some(&value(&key, 30_000)));
            assert_eq!(out.code, 0, "put after get {i}: {}", out.stderr);
        }
    }
}
