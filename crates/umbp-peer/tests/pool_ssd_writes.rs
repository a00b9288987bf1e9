//! An SSD node takes any batch of puts: a batch with more values than the node has staging pages
//! goes through the arena in rounds (the node answers the keys it has no free staging page for
//! *busy*, and the writer asks it again once its own commits gave pages back), instead of failing
//! `NoSpace` while the drive has room. The node has 16 staging pages of 64 KiB; before the busy
//! answer, a 200-key batch of 20 KB values failed for all but the first 16 keys.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use umbp_master::MasterHandle;
use umbp_peer::pool_client::{Medium, PoolClient, PoolClientConfig, SsdConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

const STAGING_PAGES: u64 = 16;
/// The page size of the node and its clients (64 KiB, one value per page).
const PAGE64: u64 = 16 * PAGE;
/// 20 KB values.
const VALUE: usize = 20_000;

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-pool-ssd-writes").tempdir_in(std::env::temp_dir()).expect("tempdir")
}

/// The node's read lease: far longer than any test, so a page comes back only when its reader
/// releases it.
const READ_LEASE: Duration = Duration::from_secs(30);

/// 64 KiB pages, and the node's read lease (a client measures its copies against its own setting:
/// with the 500 ms default a copy slowed down by a loaded machine would be discarded).
fn with_page(mut c: PoolClientConfig) -> PoolClientConfig {
    c.page_size = PAGE64;
    c.read_lease = READ_LEASE;
    c
}

async fn ssd_node(master: &MasterHandle, dirs: Vec<PathBuf>) -> PoolClient {
    let ssd = SsdConfig {
        dirs,
        // Room for every value of every test (each takes a 64 KiB page of it): nothing is evicted.
        capacity_bytes: 256 << 20,
        staging_pages: STAGING_PAGES,
        read_lease: READ_LEASE,
        ..SsdConfig::default()
    };
    PoolClient::start(with_page(config(master, "ssd", 0)).with_medium(Medium::Ssd(ssd))).await.expect("ssd node starts")
}

/// A client-only node, as one `umbp put` process starts one.
async fn cli(master: &MasterHandle, id: &str) -> PoolClient {
    PoolClient::start(with_page(config(master, id, 0)).with_medium(Medium::None)).await.expect("client starts")
}

fn val(i: usize) -> Vec<u8> {
    value(i, VALUE - (i % 7) * 100)
}

/// One batch put of `keys` (value `val(seed + j)` for key `j`); panics on any failed key.
async fn batch_put_all(writer: &PoolClient, keys: &[String], seed: usize) {
    let values: Vec<Vec<u8>> = (0..keys.len()).map(|j| val(seed + j)).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    let results = writer.batch_put(&items).await;
    let failed: Vec<String> =
        keys.iter().zip(&results).filter_map(|(k, r)| r.as_ref().err().map(|e| format!("{k}: {e}"))).collect();
    assert!(failed.is_empty(), "{} of {} puts failed, first: {:?}", failed.len(), keys.len(), failed.first());
}

/// One batch get of `keys` by `reader`, every value byte-exact (`val(seed + j)` for key `j`).
async fn batch_get_exact(reader: &PoolClient, keys: &[String], seed: usize) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0xEE; VALUE]; keys.len()];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let results = reader.batch_get(&refs, &mut slices).await;
    for (j, (r, b)) in results.iter().zip(&bufs).enumerate() {
        let v = val(seed + j);
        assert_eq!(r, &Ok(v.len() as u64), "get {}", keys[j]);
        assert!(b[..v.len()] == v[..], "bytes of {}", keys[j]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_two_hundred_key_batch_put_to_a_sixteen_page_ssd_node_is_byte_exact() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let writer = cli(&m, "writer").await;
    let keys: Vec<String> = (0..200).map(|i| format!("batch-{i}")).collect();
    batch_put_all(&writer, &keys, 0).await;
    assert_eq!(writer.stats().reroutes, 0, "busy keys were asked of the same node again, not re-routed");
    indexed(&writer, &keys).await;
    let reader = cli(&m, "reader").await;
    batch_get_exact(&reader, &keys, 0).await;
    reader.close().await;
    writer.close().await;
    ssd.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_two_hundred_key_batch_put_to_the_nodes_own_sixteen_page_ssd_medium_is_byte_exact() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let keys: Vec<String> = (0..200).map(|i| format!("own-{i}")).collect();
    // The node writes to its own medium (in place, no RPC): the same rounds.
    batch_put_all(&ssd, &keys, 1000).await;
    indexed(&ssd, &keys).await;
    let reader = cli(&m, "reader").await;
    batch_get_exact(&reader, &keys, 1000).await;
    reader.close().await;
    ssd.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn puts_beside_a_long_read_workload_on_a_sixteen_page_ssd_node_all_succeed() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let seeder = cli(&m, "seeder").await;
    let hot: Vec<String> = (0..64).map(|i| format!("hot-{i}")).collect();
    // Before the readers start: batches of half the arena, which fit it.
    for (b, batch) in hot.chunks(8).enumerate() {
        batch_put_all(&seeder, batch, b * 8).await;
    }
    indexed(&seeder, &hot).await;
    seeder.close().await;
    // Three readers read the 64 hot keys (48 at a time, overlapping) over and over, holding the
    // node's 16 staging pages most of the time, until the writer is done.
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicUsize::new(0));
    let mut readers = Vec::new();
    for r in 0..3 {
        let (m_addr, stop, reads, hot) =
            (m.local_addr().to_string(), Arc::clone(&stop), Arc::clone(&reads), hot.clone());
        readers.push(tokio::spawn(async move {
            let c = with_page(PoolClientConfig::new(format!("reader-{r}"), m_addr).with_medium(Medium::None));
            let reader = PoolClient::start(c).await.expect("reader starts");
            let mut round = 0usize;
            // At least a few rounds each, and on until the writer is done (bounded).
            while round < 3 || (!stop.load(Ordering::Acquire) && round < 500) {
                let start = (r * 16 + round * 8) % hot.len();
                let idx: Vec<usize> = (0..48).map(|j| (start + j) % hot.len()).collect();
                let keys: Vec<String> = idx.iter().map(|i| hot[*i].clone()).collect();
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; VALUE]; keys.len()];
                let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                let results = reader.batch_get(&refs, &mut slices).await;
                for ((i, r), b) in idx.iter().zip(&results).zip(&bufs) {
                    let v = val(*i);
                    assert_eq!(r, &Ok(v.len() as u64), "read {}", hot[*i]);
                    assert!(b[..v.len()] == v[..], "bytes of {}", hot[*i]);
                }
                reads.fetch_add(keys.len(), Ordering::Relaxed);
                round += 1;
            }
            reader.close().await;
        }));
    }
    // Meanwhile: 160 new keys, one batch at a time, of 8 keys (half the arena: only the readers
    // can leave no page free) and then of 40 (more than the arena).
    let writer = cli(&m, "writer").await;
    let fresh: Vec<String> = (0..160).map(|i| format!("fresh-{i}")).collect();
    let (small, large) = fresh.split_at(80);
    for (b, batch) in small.chunks(8).enumerate() {
        batch_put_all(&writer, batch, 5000 + b * 8).await;
    }
    for (b, batch) in large.chunks(40).enumerate() {
        batch_put_all(&writer, batch, 5080 + b * 40).await;
    }
    stop.store(true, Ordering::Release);
    for r in readers {
        r.await.expect("a reader task");
    }
    assert!(reads.load(Ordering::Relaxed) >= 3 * 3 * 48, "the readers ran");
    indexed(&writer, &fresh).await;
    batch_get_exact(&writer, &fresh, 5000).await;
    writer.close().await;
    ssd.close().await;
    m.shutdown().await;
}

/// A batch of several pipelined chunks (about 8 MiB each, in flight together) to one 16-page
/// node: the chunks share the arena and every one gets through, none starved into `Busy`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_key_batch_put_of_several_chunks_shares_sixteen_pages_and_is_byte_exact() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let writer = cli(&m, "writer").await;
    let keys: Vec<String> = (0..1000).map(|i| format!("chunked-{i}")).collect();
    batch_put_all(&writer, &keys, 20_000).await;
    indexed(&writer, &keys).await;
    let reader = cli(&m, "reader").await;
    batch_get_exact(&reader, &keys, 20_000).await;
    reader.close().await;
    writer.close().await;
    ssd.close().await;
    m.shutdown().await;
}
