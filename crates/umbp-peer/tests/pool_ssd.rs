//! An SSD node through `PoolClient`: a cross-node put and get through the node's staging arena and
//! drive log, and a node restarted on the same directories that announces its recovered keys and
//! serves every one of them again, byte-exact, to a remote client.

use std::path::PathBuf;

use umbp_core::TierType;
use umbp_master::MasterHandle;
use umbp_peer::pool_client::{Medium, PoolClient, SsdConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

/// Sub-page, one byte short of a page, exactly a page (the SSD medium stores one key per page).
const SIZES: [usize; 4] = [100, 3000, PAGE as usize - 1, PAGE as usize];

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-pool-ssd").tempdir_in(std::env::temp_dir()).expect("tempdir")
}

async fn ssd_node(master: &MasterHandle, id: &str, dirs: Vec<PathBuf>) -> PoolClient {
    let ssd = SsdConfig { dirs, capacity_bytes: 4 << 20, staging_pages: 32, ..SsdConfig::default() };
    PoolClient::start(config(master, id, 0).with_medium(Medium::Ssd(ssd))).await.expect("ssd node starts")
}

async fn client_node(master: &MasterHandle, id: &str) -> PoolClient {
    PoolClient::start(config(master, id, 0).with_medium(Medium::None)).await.expect("client starts")
}

async fn put_all(client: &PoolClient, keys: &[String], values: &[Vec<u8>]) {
    let items: Vec<(&str, &[u8])> = keys.iter().zip(values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for (i, r) in client.batch_put(&items).await.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("put {}: {e}", keys[i]));
    }
    client.flush();
}

async fn get_all(client: &PoolClient, keys: &[String], values: &[Vec<u8>]) {
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0xEE; v.len() + 8]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (i, r) in client.batch_get(&key_refs, &mut slices).await.iter().enumerate() {
        assert_eq!(r.as_ref().ok().copied(), Some(values[i].len() as u64), "get {}: {r:?}", keys[i]);
        assert_eq!(&bufs[i][..values[i].len()], values[i].as_slice(), "bytes of {}", keys[i]);
        assert!(bufs[i][values[i].len()..].iter().all(|b| *b == 0xEE), "nothing written past {}", keys[i]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cross_node_put_and_get_through_an_ssd_node() {
    let master = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&master, "ssd", vec![dir.path().to_path_buf()]).await;
    assert_eq!(ssd.medium().expect("medium").tier(), TierType::Ssd);
    let client = client_node(&master, "client").await;
    let keys: Vec<String> = (0..12).map(|i| format!("xnode-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..12).map(|i| value(i, SIZES[i % SIZES.len()])).collect();
    put_all(&client, &keys, &values).await;
    indexed(&client, &keys).await;
    assert_eq!(ssd.medium().expect("medium").owned_key_count(), 12, "every key landed on the SSD node");
    // A remote reader, then the SSD node itself reading its own medium.
    get_all(&client, &keys, &values).await;
    get_all(&ssd, &keys, &values).await;
    // A value larger than a page can never be stored on this medium: refused, not retried forever.
    let big = value(99, 2 * PAGE as usize);
    assert!(client.put("too-big", &big).await.is_err(), "a two-page value on a one-page-per-key medium");
    client.close().await;
    ssd.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ssd_node_restarted_on_its_directories_serves_every_key_again() {
    let master = master().await;
    let dirs = [tempdir(), tempdir()];
    let paths: Vec<PathBuf> = dirs.iter().map(|d| d.path().to_path_buf()).collect();
    let client = client_node(&master, "client").await;
    let keys: Vec<String> = (0..24).map(|i| format!("restart-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..24).map(|i| value(1000 + i, SIZES[i % SIZES.len()])).collect();

    let first = ssd_node(&master, "ssd", paths.clone()).await;
    put_all(&client, &keys, &values).await;
    indexed(&client, &keys).await;
    first.close().await;
    drop(first);

    // A new node on the same directories: it rebuilds its index from the log and announces the
    // keys in the full sync after it registers.
    let second = ssd_node(&master, "ssd", paths).await;
    assert_eq!(second.medium().expect("medium").owned_key_count(), 24, "every key recovered from the log");
    indexed(&client, &keys).await;
    get_all(&client, &keys, &values).await;
    client.close().await;
    second.close().await;
}
