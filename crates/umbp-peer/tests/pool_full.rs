//! A full pool keeps taking puts: a put that finds no node with room makes the master evict least
//! recently used, unleased keys on demand (synchronously, before it answers the route) instead of
//! failing until the next 5-second eviction round. Every put of three times the pool's capacity
//! succeeds, and every get afterwards returns the exact bytes or a clean miss.

use std::path::PathBuf;

use umbp_master::MasterHandle;
use umbp_peer::pool_client::{KeyError, Medium, PoolClient, SsdConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

const MIB: usize = 1 << 20;

async fn client_node(master: &MasterHandle, id: &str) -> PoolClient {
    PoolClient::start(config(master, id, 0).with_medium(Medium::None)).await.expect("client starts")
}

/// `count` sequential puts of distinct 1 MiB values: every one must succeed.
async fn fill(client: &PoolClient, prefix: &str, count: usize) -> Vec<(String, Vec<u8>)> {
    let mut written = Vec::with_capacity(count);
    let mut failed = Vec::new();
    for i in 0..count {
        let key = format!("{prefix}-{i:04}");
        let bytes = value(i, MIB);
        if let Err(e) = client.put(&key, &bytes).await {
            failed.push(format!("{key}: {e}"));
        }
        written.push((key, bytes));
    }
    assert!(failed.is_empty(), "{} of {count} puts failed, first: {:?}", failed.len(), failed.first());
    written
}

/// Every key reads back byte-exact or is a clean miss; the newest keys (which eviction spares, being
/// the most recently written) must all be there. Returns how many were hits.
async fn check(client: &PoolClient, written: &[(String, Vec<u8>)], newest_must_hit: usize) -> usize {
    let mut buf = vec![0u8; MIB];
    let mut hits = 0;
    for (i, (key, bytes)) in written.iter().enumerate() {
        buf.fill(0xEE);
        match client.get(key, &mut buf).await {
            Ok(n) => {
                assert_eq!(n as usize, bytes.len(), "size of {key}");
                assert!(buf == *bytes, "wrong bytes for {key}");
                hits += 1;
            }
            Err(KeyError::Miss) => {
                assert!(i + newest_must_hit < written.len(), "{key}, one of the newest, is missing");
            }
            Err(e) => panic!("get {key}: {e} (a get must return the bytes or a clean miss)"),
        }
    }
    hits
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_dram_pool_takes_three_times_its_capacity_of_sequential_puts() {
    const CAPACITY: usize = 64 * MIB;
    let master = master().await;
    let dram = PoolClient::start(config(&master, "dram", CAPACITY as u64)).await.expect("dram node");
    let client = client_node(&master, "writer").await;
    let written = fill(&client, "full", 3 * CAPACITY / MIB).await;
    let newest: Vec<&str> = written.iter().rev().take(8).map(|(k, _)| k.as_str()).collect();
    indexed(&client, &newest).await;
    let hits = check(&client, &written, 8).await;
    assert!((8..=CAPACITY / MIB).contains(&hits), "{hits} hits");
    let stats = master.stats();
    assert!(stats.evict_bytes_freed >= (2 * CAPACITY) as u64 - (8 * MIB) as u64, "{stats:?}");
    client.close().await;
    dram.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_that_lends_the_pool_can_fill_it_too() {
    const CAPACITY: usize = 16 * MIB;
    let master = master().await;
    let dram = PoolClient::start(config(&master, "dram", CAPACITY as u64)).await.expect("dram node");
    let pages = dram.medium().expect("medium").capacity().total_bytes / PAGE;
    assert_eq!(pages, (CAPACITY as u64) / PAGE);
    let written = fill(&dram, "self", 3 * CAPACITY / MIB).await;
    check(&dram, &written, 4).await;
    dram.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_into_a_full_pool_all_succeed() {
    const CAPACITY: usize = 32 * MIB;
    let master = master().await;
    let dram = PoolClient::start(config(&master, "dram", CAPACITY as u64)).await.expect("dram node");
    let (a, b, c, d) = (
        client_node(&master, "writer-a").await,
        client_node(&master, "writer-b").await,
        client_node(&master, "writer-c").await,
        client_node(&master, "writer-d").await,
    );
    let per_writer = 3 * CAPACITY / MIB / 4;
    let (wa, wb, wc, wd) = tokio::join!(
        fill(&a, "wa", per_writer),
        fill(&b, "wb", per_writer),
        fill(&c, "wc", per_writer),
        fill(&d, "wd", per_writer),
    );
    for written in [&wa, &wb, &wc, &wd] {
        check(&a, written, 0).await;
    }
    for w in [a, b, c, d] {
        w.close().await;
    }
    dram.close().await;
}

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-pool-full").tempdir_in(std::env::temp_dir()).expect("tempdir")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_ssd_node_takes_three_times_its_capacity_of_sequential_puts() {
    const CAPACITY: usize = 16 * MIB;
    let master = master().await;
    let dir = tempdir();
    let ssd = SsdConfig {
        dirs: vec![PathBuf::from(dir.path())],
        capacity_bytes: CAPACITY as u64,
        staging_pages: 16,
        ..SsdConfig::default()
    };
    let mut node_config = config(&master, "ssd", 0).with_medium(Medium::Ssd(ssd));
    // One value per page on this medium.
    node_config.page_size = MIB as u64;
    let node = PoolClient::start(node_config).await.expect("ssd node");
    let client = client_node(&master, "writer").await;
    let written = fill(&client, "ssd-full", 3 * CAPACITY / MIB).await;
    check(&client, &written, 2).await;
    client.close().await;
    node.close().await;
}
