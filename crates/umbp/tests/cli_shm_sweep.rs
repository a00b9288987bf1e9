//! A reader lets go of same-host holders' memory, with real processes: a `umbp node` holder and
//! this test process as the reader.
//!
//! - The reader maps each of the holder's regions **once**, whether batches (the shared-memory
//!   engine) or single keys (the keyed client) read it: the two share one client.
//! - Single-key gets and puts through shared memory are counted as `"SharedMemoryEngine"` bytes,
//!   and the TCP engine moves none.
//! - After the holder is SIGKILLed, the reader's mappings of its memory file disappear from
//!   `/proc/self/maps` within a few seconds **without the reader calling anything**: the
//!   `PoolClient`'s periodic sweep. (A mapping keeps the file's pages: without the sweep, the dead
//!   holder's whole arena would stay resident until the reader exits.)

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig, SHM_SWEEP_EVERY};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

const SHM: &str = "SharedMemoryEngine";
const TCP: &str = "TcpEngine";
/// What the DRAM medium names its memory files (`/memfd:umbp-host (deleted)` in the maps).
const MEMFD: &str = "/memfd:umbp-host";

/// Inode → how many mappings of that memory file `/proc/<pid>/maps` lists.
fn memfd_mappings(pid: &str) -> BTreeMap<u64, usize> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut out = BTreeMap::new();
    for line in maps.lines().filter(|l| l.contains(MEMFD)) {
        // address perms offset dev inode path
        let inode = line.split_whitespace().nth(4).and_then(|i| i.parse().ok()).expect("inode");
        *out.entry(inode).or_insert(0) += 1;
    }
    out
}

/// This process's mappings of the memory files `of` names.
fn mine_of(of: &BTreeMap<u64, usize>) -> BTreeMap<u64, usize> {
    memfd_mappings("self").into_iter().filter(|(inode, _)| of.contains_key(inode)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_maps_a_holder_once_and_lets_go_when_it_dies() {
    let dir = TempDir::new("shm-sweep");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    let args = [
        "node",
        "--master",
        &address,
        "--node-id",
        "holder",
        "--medium",
        "dram",
        "--capacity",
        "32MiB",
        "--prefault",
        "false",
        "--page-size",
        "64KiB",
    ];
    let (mut holder, _) =
        Proc::try_start(&dir.0, "holder", &args, &[], "node holder").unwrap_or_else(|e| panic!("{e}"));
    let holder_pid = holder.child.id().to_string();
    let client = PoolClient::start(PoolClientConfig::new("reader", address.clone())).await.expect("client");

    // Batch puts and gets: the engine maps the holder's region.
    let len = 256 << 10;
    let keys: Vec<String> = (0..8).map(|i| format!("sweep-{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value(k, len)).collect();
    let pairs: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for r in client.batch_put(&pairs).await {
        r.expect("batch put");
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !client.batch_exists(&refs).await.expect("exists").iter().all(|f| *f) {
        assert!(Instant::now() < deadline, "keys never indexed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (r, (buf, v)) in client.batch_get(&refs, &mut slices).await.into_iter().zip(bufs.iter().zip(&values)) {
        assert_eq!(r, Ok(len as u64));
        assert!(buf == v, "byte-exact");
    }
    let batches = client.transferred_bytes(SHM);
    assert_eq!(batches, 2 * (keys.len() * len) as u64, "the batches went through the mappings");

    // A single keyed get and a single keyed put of a large value: the keyed client's copies.
    let mut one = vec![0u8; len];
    assert_eq!(client.get(&keys[0], &mut one).await.expect("single get"), len as u64);
    assert!(one == values[0], "byte-exact");
    let single = value("sweep-single", len);
    client.put("sweep-single", &single).await.expect("single put");
    let stats = client.stats();
    // The batches were keyed too (one GET_KEYS or PUT_KEYS per holder chunk), then one each.
    let batched = keys.len() as u64;
    assert_eq!(
        (stats.keyed_gets, stats.keyed_puts),
        (batched + 1, batched + 1),
        "the batches and both single calls took the keyed path"
    );
    assert_eq!(client.transferred_bytes(TCP), 0, "the TCP engine moved no bytes");
    assert_eq!(
        client.transferred_bytes(SHM),
        batches + 2 * len as u64,
        "single-key bytes through shared memory are counted too"
    );

    // One mapping per holder region, one connection, however many paths used them.
    let holders = memfd_mappings(&holder_pid);
    assert!(!holders.is_empty(), "the holder's memory is a memory file");
    let mine = mine_of(&holders);
    assert!(!mine.is_empty(), "the reader mapped the holder's memory");
    assert!(mine.values().all(|n| *n == 1), "one mapping per region, not one per path: {mine:?}");
    assert_eq!(client.shared_memory_peers(), (1, mine.len()), "one connection, one cached mapping per region");

    // The holder dies; the reader calls nothing and still lets go of its memory.
    holder.kill9();
    let killed = Instant::now();
    let bound = 5 * SHM_SWEEP_EVERY;
    loop {
        let left = mine_of(&holders);
        if left.is_empty() {
            break;
        }
        assert!(killed.elapsed() < bound, "the dead holder's memory is still mapped after {bound:?}: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("the dead holder's memory was unmapped {:?} after the kill", killed.elapsed());
    assert_eq!(client.shared_memory_peers(), (0, 0));
    client.close().await;
}
