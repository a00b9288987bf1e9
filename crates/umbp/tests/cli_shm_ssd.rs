//! An `umbp node --medium ssd` process and this test process as a same-host client: the SSD
//! medium's staging arena is a sealed memory file (the node's `shared_memory`, on by default), so
//! the client's batch puts land in staging pages and its batch gets copy staged values — fresh ones
//! and ones read back from the drive — through its mapping of the arena, with the TCP engine moving
//! no bytes; single keyed gets of staged values are byte-exact too.

use std::path::Path;
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

const SHM: &str = "SharedMemoryEngine";
const TCP: &str = "TcpEngine";
const PAGE: usize = 64 << 10;
/// Keys per batch; the arena has room for two batches, so the first batches' cached copies are
/// gone (their reads are staged from the drive) by the time they are read.
const BATCH: usize = 32;

fn start_ssd_node(dir: &Path, master: &str, drive: &Path) -> Proc {
    let drive = drive.to_str().expect("utf-8 path");
    let args = [
        "node",
        "--master",
        master,
        "--node-id",
        "s1",
        "--medium",
        "ssd",
        "--ssd-dir",
        drive,
        "--ssd-capacity",
        "32MiB",
        "--page-size",
        "64KiB",
        "--ssd-staging-pages",
        "64",
    ];
    let (node, _) = Proc::try_start(dir, "s1", &args, &[], "node s1").unwrap_or_else(|e| panic!("{e}"));
    node
}

async fn indexed(client: &PoolClient, keys: &[String]) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !client.batch_exists(&refs).await.expect("exists").iter().all(|f| *f) {
        assert!(Instant::now() < deadline, "keys never indexed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ssd_holders_staged_values_move_through_shared_memory() {
    let dir = TempDir::new("shm-ssd");
    let drive = dir.0.join("drive");
    std::fs::create_dir_all(&drive).expect("drive dir");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    let mut node = start_ssd_node(&dir.0, &address, &drive);
    let client = PoolClient::start(PoolClientConfig::new("client", address.clone())).await.expect("client");

    let keys: Vec<String> = (0..3 * BATCH).map(|i| format!("ssd-shm-{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().map(|k| value(k, PAGE)).collect();
    for (ks, vs) in keys.chunks(BATCH).zip(values.chunks(BATCH)) {
        let pairs: Vec<(&str, &[u8])> = ks.iter().map(String::as_str).zip(vs.iter().map(Vec::as_slice)).collect();
        for (k, r) in ks.iter().zip(client.batch_put(&pairs).await) {
            r.unwrap_or_else(|e| panic!("put {k}: {e}"));
        }
    }
    indexed(&client, &keys).await;
    for (ks, vs) in keys.chunks(BATCH).zip(values.chunks(BATCH)) {
        let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
        let mut bufs: Vec<Vec<u8>> = ks.iter().map(|_| vec![0u8; PAGE]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        for ((k, r), (buf, v)) in ks.iter().zip(client.batch_get(&refs, &mut slices).await).zip(bufs.iter().zip(vs)) {
            assert_eq!(r.unwrap_or_else(|e| panic!("get {k}: {e}")), PAGE as u64, "{k}");
            assert!(buf == v, "{k} byte-exact");
        }
    }
    let total = (keys.len() * PAGE) as u64;
    assert_eq!(client.transferred_bytes(TCP), 0, "the TCP engine moved no bytes for the SSD holder");
    // At least every byte once each way: a key re-read after its lease lapsed on a loaded machine
    // (or written again after a busy round) is copied again, through the mapping too.
    let through_shm = client.transferred_bytes(SHM);
    assert!(through_shm >= 2 * total, "every put and get byte went through the staging arena's mapping: {through_shm}");

    // Single gets (one keyed exchange each, answered with a place in the staging arena).
    for (k, v) in keys.iter().zip(&values).step_by(7) {
        let mut buf = vec![0u8; PAGE];
        assert_eq!(client.get(k, &mut buf).await.unwrap_or_else(|e| panic!("get {k}: {e}")), PAGE as u64);
        assert!(&buf == v, "{k} byte-exact");
    }
    assert_eq!(client.transferred_bytes(TCP), 0);
    client.close().await;
    node.kill9();
}
