//! A crashed node rejoins at once, as processes with the master's default timings (a node expires
//! only after 30 s of silence):
//!
//! - an SSD node killed with SIGKILL and restarted at once under the same id on its directory is
//!   accepted on the first try (a new incarnation replaces the dead one's record), and its recovered
//!   keys are indexed by the time it prints its ready line;
//! - a second live process started under the id of a running node takes over, and the first one is
//!   told, in its log, that it was superseded.
//!
//! Every child is killed by a guard's `Drop`; every wait is bounded.

use std::path::Path;
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

const PAGE: usize = 64 * 1024;
/// The master's defaults: heartbeats every 5 s, expiry after 30 s.
const ENV: &[(&str, &str)] = &[];

fn start_master(dir: &Path) -> (Proc, String) {
    let (master, line) = Proc::try_start(dir, "master", &["master", "--listen", "127.0.0.1:0"], ENV, "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = field(&line, "listen").to_owned();
    (master, addr)
}

fn start_ssd_node(dir: &Path, master: &str, ssd_dir: &Path, name: &str) -> Result<(Proc, String), String> {
    let ssd_dir = ssd_dir.to_str().expect("utf-8 path");
    let args = [
        "node",
        "--master",
        master,
        "--node-id",
        "s1",
        "--medium",
        "ssd",
        "--ssd-dir",
        ssd_dir,
        "--ssd-capacity",
        "16MiB",
        "--page-size",
        "64KiB",
        "--ssd-staging-pages",
        "64",
    ];
    Proc::try_start(dir, name, &args, ENV, "node s1")
}

fn start_dram_node(dir: &Path, master: &str, name: &str) -> Result<(Proc, String), String> {
    let args = [
        "node",
        "--master",
        master,
        "--node-id",
        "d1",
        "--medium",
        "dram",
        "--capacity",
        "16MiB",
        "--page-size",
        "64KiB",
        "--prefault",
        "false",
    ];
    Proc::try_start(dir, name, &args, ENV, "node d1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ssd_node_killed_with_sigkill_rejoins_at_once_with_its_keys_readable() {
    let dir = TempDir::new("rejoin-ssd");
    let ssd_dir = dir.0.join("drive");
    std::fs::create_dir_all(&ssd_dir).expect("drive dir");
    let (_master, master) = start_master(&dir.0);
    let (mut node, _) = start_ssd_node(&dir.0, &master, &ssd_dir, "s1").unwrap_or_else(|e| panic!("{e}"));
    let client = PoolClient::start(PoolClientConfig::new("rejoin-client", master.clone())).await.expect("client");

    let keys: Vec<String> = (0..20).map(|i| format!("rejoin-{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value(k, PAGE / 2)).collect();
    for (k, v) in keys.iter().zip(&values) {
        client.put(k, v).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !client.master().batch_lookup(&keys).await.expect("lookup").iter().all(|f| *f) {
        assert!(Instant::now() < deadline, "the first node's keys were never indexed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    node.kill9();
    drop(node);
    // At once, well inside the 30 s the dead registration would stay fresh: the first try succeeds.
    let started = Instant::now();
    let (_node, _) = start_ssd_node(&dir.0, &master, &ssd_dir, "s1-restarted")
        .unwrap_or_else(|e| panic!("the restarted node was refused: {e}"));
    assert!(started.elapsed() < Duration::from_secs(25), "rejoined after {:?}", started.elapsed());
    // Ready means indexed: the node's first full sync ran before its ready line.
    let found = client.master().batch_lookup(&keys).await.expect("lookup");
    assert!(found.iter().all(|f| *f), "recovered keys not indexed at the ready line: {found:?}");
    let status = client.master().cluster_status().await.expect("status");
    assert_eq!(status.storage_nodes().count(), 1, "one record for s1: {:?}", status.nodes);

    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0xEE; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (i, r) in client.batch_get(&refs, &mut slices).await.iter().enumerate() {
        assert_eq!(r.as_ref().ok().copied(), Some(values[i].len() as u64), "get {}: {r:?}", keys[i]);
        assert!(bufs[i] == values[i], "{} came back with other bytes", keys[i]);
    }
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_live_process_with_the_same_id_takes_over_and_the_first_is_told() {
    let dir = TempDir::new("rejoin-twice");
    let (_master, master) = start_master(&dir.0);
    let (mut first, _) = start_dram_node(&dir.0, &master, "d1-first").unwrap_or_else(|e| panic!("{e}"));
    let (_second, line) = start_dram_node(&dir.0, &master, "d1-second")
        .unwrap_or_else(|e| panic!("a second process under a live id was refused: {e}"));
    let second_peer = field(&line, "peer").to_owned();
    // The first learns it at its next heartbeat (every 5 s by default).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = std::fs::read_to_string(&first.log).unwrap_or_default();
        if let Ok(Some(status)) = first.child.try_wait() {
            // It stops with a setup error (exit status 2) that says what happened.
            assert_eq!(status.code(), Some(2), "{}", first.log_tail());
            assert!(log.contains("taken over by a newer process"), "{log}");
            assert!(log.contains("same --node-id"), "{log}");
            break;
        }
        assert!(Instant::now() < deadline, "the first process never stopped:\n{}", first.log_tail());
        std::thread::sleep(Duration::from_millis(100));
    }
    let client = PoolClient::start(PoolClientConfig::new("twice-client", master.clone())).await.expect("client");
    let status = client.master().cluster_status().await.expect("status");
    let d1: Vec<_> = status.nodes.iter().filter(|n| n.node_id == "d1").collect();
    assert_eq!(d1.len(), 1);
    assert_eq!(d1[0].peer_address, second_peer, "the newer process holds the id");
    client.close().await;
}
