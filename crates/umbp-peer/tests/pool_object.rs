//! An object-store node through `PoolClient` (its store a local directory, `file:///dir`, so no S3
//! stand-in is needed here; `umbp-object`'s own tests and `umbp`'s `cli_object.rs` run against
//! `moto_server`): batches of multi-page values larger than the node's staging arena go through
//! in rounds, byte-exact, to a remote client and to the node itself, and a node restarted on the
//! same store re-indexes it and serves every key again.

use std::path::Path;

use umbp_core::TierType;
use umbp_master::MasterHandle;
use umbp_peer::pool_client::{Medium, ObjectSettings, PoolClient};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

/// Sub-page, exactly a page, a page and a bit, two pages (the node stores values of up to two).
const SIZES: [usize; 4] = [100, PAGE as usize, PAGE as usize + 1, 2 * PAGE as usize];

/// Staging pages of the node: fewer than a batch's values need at once.
const STAGING_PAGES: u64 = 8;

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-pool-object").tempdir_in(std::env::temp_dir()).expect("tempdir")
}

async fn object_node(master: &MasterHandle, id: &str, store: &Path) -> PoolClient {
    let object = ObjectSettings {
        url: Some(format!("file://{}", store.display())),
        capacity_bytes: 4 << 20,
        staging_pages: STAGING_PAGES,
        max_value_pages: 2,
        ..ObjectSettings::default()
    };
    PoolClient::start(config(master, id, 0).with_medium(Medium::Object(object))).await.expect("object node starts")
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

fn objects(store: &Path) -> usize {
    std::fs::read_dir(store)
        .expect("store dir")
        .filter_map(Result::ok)
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_larger_than_the_staging_arena_round_trip_through_an_object_node() {
    let master = master().await;
    let store = tempdir();
    let node = object_node(&master, "object", store.path()).await;
    assert_eq!(node.medium().expect("medium").tier(), TierType::Ssd, "a staged medium's tier");
    let client = client_node(&master, "client").await;
    // 40 values of up to two pages: several times what 8 staging pages hold at once.
    let keys: Vec<String> = (0..40).map(|i| format!("obj-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..40).map(|i| value(i, SIZES[i % SIZES.len()])).collect();
    put_all(&client, &keys, &values).await;
    indexed(&client, &keys).await;
    assert_eq!(node.medium().expect("medium").owned_key_count(), 40, "every key landed on the object node");
    assert_eq!(objects(store.path()), 40, "one object per value");
    // A remote reader, then the node reading its own medium.
    get_all(&client, &keys, &values).await;
    get_all(&node, &keys, &values).await;
    // Larger than its largest value: refused, not retried forever.
    assert!(client.put("too-big", &value(99, 3 * PAGE as usize)).await.is_err(), "a three-page value");
    client.close().await;
    node.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_object_node_restarted_on_its_store_serves_every_key_again() {
    let master = master().await;
    let store = tempdir();
    let client = client_node(&master, "client").await;
    let keys: Vec<String> = (0..24).map(|i| format!("restart-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..24).map(|i| value(1000 + i, SIZES[i % SIZES.len()])).collect();

    let first = object_node(&master, "object", store.path()).await;
    put_all(&client, &keys, &values).await;
    indexed(&client, &keys).await;
    first.close().await;
    drop(first);

    // A new node on the same store: it lists it, checks each object's head and announces the keys
    // in the full sync after it registers.
    let second = object_node(&master, "object", store.path()).await;
    assert_eq!(second.medium().expect("medium").owned_key_count(), 24, "every key re-indexed from the store");
    indexed(&client, &keys).await;
    get_all(&client, &keys, &values).await;
    client.close().await;
    second.close().await;
}
