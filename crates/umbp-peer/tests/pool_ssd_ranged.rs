//! A ranged get from an SSD node reads only the blocks its ranges cover from the drive (issue 21),
//! byte-exact, from another node over TCP and on the node itself; a whole get after it still reads
//! (and checks) the whole value; the part's staging pages come back at the reader's release.

use std::time::Duration;

use umbp_core::metric_names;
use umbp_master::MasterHandle;
use umbp_peer::pool_client::{Medium, PoolClient, PoolClientConfig, SsdConfig};

mod pool_support;
mod ranged_support;

use pool_support::{PAGE, config, indexed, master, value};
use ranged_support::read_parts;

/// Pages of the test value (the node keeps up to this many per value).
const VALUE_PAGES: u64 = 64;

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-pool-ssd-ranged").tempdir_in(std::env::temp_dir()).expect("tempdir")
}

/// An SSD node whose every first read reaches the drive (nothing cached at commit), with a lease
/// far longer than the test: its staging pages come back only through releases.
async fn ssd_node(master: &MasterHandle, dir: &std::path::Path) -> PoolClient {
    let ssd = SsdConfig {
        dirs: vec![dir.to_owned()],
        capacity_bytes: 16 << 20,
        staging_pages: 2 * VALUE_PAGES,
        max_value_pages: VALUE_PAGES,
        cache_committed: false,
        read_lease: Duration::from_secs(30),
        ..SsdConfig::default()
    };
    PoolClient::start(config(master, "ssd", 0).with_medium(Medium::Ssd(ssd))).await.expect("ssd node starts")
}

fn reader_config(master: &MasterHandle, id: &str) -> PoolClientConfig {
    let mut c = config(master, id, 0).with_medium(Medium::None);
    c.read_lease = Duration::from_secs(30);
    c.shared_memory = false;
    c
}

/// One sample of the node's medium: `name` with label `key=value`.
fn sample(node: &PoolClient, name: &str, key: &str, value: &str) -> u64 {
    let medium = node.medium().expect("medium");
    let labelled = |s: &umbp_core::MetricSample| s.name == name && s.labels.iter().any(|(k, v)| k == key && v == value);
    medium.sample_metrics().iter().filter(|s| labelled(s)).map(|s| s.value).sum()
}

fn drive_read_bytes(node: &PoolClient) -> u64 {
    sample(node, metric_names::MEDIUM_BYTES_TOTAL, "event", "device_read")
}

fn staging_in_use(node: &PoolClient) -> u64 {
    sample(node, metric_names::MEDIUM_STATE, "state", "staging_pages_in_use")
}

/// Waits (at most 10 s) until the node holds no staging page (the releases are sent in the
/// background): a part's pages come back at its release, and no part is kept as a cached copy.
async fn staging_drains(node: &PoolClient) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while staging_in_use(node) != 0 {
        assert!(tokio::time::Instant::now() < deadline, "{} staging pages still held", staging_in_use(node));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ranged_get_from_an_ssd_node_reads_only_the_blocks_it_covers() {
    let dir = tempdir();
    let m = master().await;
    let node = ssd_node(&m, dir.path()).await;
    let reader = PoolClient::start(reader_config(&m, "reader")).await.expect("reader");
    let size = (VALUE_PAGES * PAGE) as usize - 100;
    let v = value(61, size);
    reader.put("v", &v).await.expect("put");
    indexed(&reader, &["v"]).await;
    staging_drains(&node).await;
    // Most of the value's fourth eighth, as two ranges (one across a block edge), given out of
    // order.
    let eighth = size as u64 / 8;
    let edge = (4 * eighth - 100) / PAGE * PAGE;
    let parts = [(edge - 7, 20), (3 * eighth, eighth as usize - 5000)];
    for (who, client) in [("another node over TCP", &reader), ("the node itself", &node)] {
        let before = drive_read_bytes(&node);
        let (r, bufs) = read_parts(client, "v", &parts).await;
        assert_eq!(r, Ok(size as u64), "{who}");
        for ((off, len), b) in parts.iter().zip(&bufs) {
            assert_eq!(b.as_slice(), &v[*off as usize..*off as usize + len], "{who}: {len} bytes at {off}");
        }
        let read = drive_read_bytes(&node) - before;
        assert!(read > 0, "{who}: the value was read from the drive");
        // The header block and the blocks of the span (an eighth, plus a block at each end).
        assert!(read <= PAGE + eighth + 2 * PAGE, "{who}: {read} drive bytes for an eighth of {size}");
        staging_drains(&node).await;
    }
    // A whole get reads the whole record and checks the value's checksum.
    let before = drive_read_bytes(&node);
    let mut whole = vec![0u8; size];
    assert_eq!(reader.get("v", &mut whole).await, Ok(size as u64));
    assert_eq!(whole, v, "the whole value after ranged reads");
    assert!(drive_read_bytes(&node) - before >= size as u64, "a whole get reads the whole value");
    reader.close().await;
    node.close().await;
    m.shutdown().await;
}
