//! A region a holder deregisters while a same-host reader has it mapped is unmapped by the reader
//! within a few seconds, with no call of the reader's and the holder alive (its connection open):
//! the `PoolClient`'s periodic sweep drops mappings whose epoch the holder zeroed. (A mapping keeps
//! the memory file's pages: without the sweep, the deregistered memory would stay resident in the
//! reader until it exits.)
//!
//! The holder is a node of this process, the reader a light client of this process: the holder's
//! own mapping goes when its medium shuts down, so what is left in `/proc/self/maps` of the
//! holder's memory file is the reader's.

mod pool_support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use pool_support::{config, indexed, master, value};
use umbp_peer::pool_client::{PoolClient, PoolClientConfig, SHM_SWEEP_EVERY};

/// What the DRAM medium names its memory files.
const MEMFD: &str = "/memfd:umbp-host";

/// Inode → mappings of that memory file in this process.
fn memfd_mappings() -> BTreeMap<u64, usize> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let mut out = BTreeMap::new();
    for line in maps.lines().filter(|l| l.contains(MEMFD)) {
        let inode = line.split_whitespace().nth(4).and_then(|i| i.parse().ok()).expect("inode");
        *out.entry(inode).or_insert(0) += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deregistered_region_is_unmapped_by_its_reader() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 8 << 20)).await.expect("holder");
    let own = memfd_mappings();
    assert!(!own.is_empty(), "the holder's medium is a memory file");
    let reader = PoolClient::start(PoolClientConfig::new("reader", m.local_addr().to_string())).await.expect("reader");

    let keys: Vec<String> = (0..4).map(|i| format!("dereg-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| value(i, 256 << 10)).collect();
    let pairs: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for r in reader.batch_put(&pairs).await {
        r.expect("put");
    }
    indexed(&reader, &keys).await;
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for r in reader.batch_get(&refs, &mut slices).await {
        r.expect("get");
    }
    assert!(bufs == values, "byte-exact");
    assert_eq!(reader.transferred_bytes("TcpEngine"), 0);
    let mapped = memfd_mappings();
    assert!(own.iter().any(|(inode, n)| mapped.get(inode) > Some(n)), "the reader mapped the holder's memory");
    assert_eq!(reader.shared_memory_peers().0, 1);

    // The holder deregisters its regions (and releases its own mapping) but stays up: the reader's
    // connection stays open, so only the zeroed epochs tell the sweep.
    holder.medium().expect("medium").shutdown();
    let stopped = Instant::now();
    let bound = 5 * SHM_SWEEP_EVERY;
    loop {
        let left: BTreeMap<u64, usize> = memfd_mappings().into_iter().filter(|(i, _)| own.contains_key(i)).collect();
        if left.is_empty() {
            break;
        }
        assert!(stopped.elapsed() < bound, "deregistered memory still mapped after {bound:?}: {left:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(reader.shared_memory_peers(), (1, 0), "the connection stays; the mapping went");
    reader.close().await;
    holder.close().await;
}
