//! Large batches run as a pipeline of chunks, and gets read local hits without a route call.
//!
//! - a batch many chunks long (tens of MiB) written from one node and read from every node is
//!   byte-exact, and a key repeated in the first and the last chunk is written once, with the first
//!   value;
//! - a key this node holds is read while the master is down (no route call on the critical path);
//! - the master still hears of local hits (the background access hint bumps its route-get count),
//!   so its LRU eviction does not take a key that is only ever read locally for a cold one.

use std::time::Duration;

use umbp_master::MasterHandle;
use umbp_peer::pool_client::PoolClient;

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

async fn node(master: &MasterHandle, id: &str, capacity: u64) -> PoolClient {
    PoolClient::start(config(master, id, capacity)).await.expect("node starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_many_chunks_round_trips_byte_exact_and_dedups_across_chunks() {
    let m = master().await;
    let nodes = [node(&m, "n1", 48 << 20).await, node(&m, "n2", 48 << 20).await, node(&m, "n3", 48 << 20).await];
    // 40 values of ~1 MiB (a partial last page each): about five 8 MiB chunks.
    let size = 256 * PAGE as usize - 123;
    let mut keys: Vec<String> = (0..40).map(|i| format!("big-{i}")).collect();
    let mut values: Vec<Vec<u8>> = (0..40).map(|i| value(i, size)).collect();
    // The last item repeats the first key with other bytes: the first write wins.
    keys.push(keys[0].clone());
    values.push(value(999, size));
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for (i, r) in nodes[0].batch_put(&items).await.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("put {i}: {e}"));
    }
    for n in &nodes {
        n.flush();
    }
    let unique: Vec<&str> = keys[..40].iter().map(String::as_str).collect();
    indexed(&nodes[0], &unique).await;
    for n in &nodes {
        let mut bufs: Vec<Vec<u8>> = (0..41).map(|_| vec![0u8; size + 5]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let all: Vec<&str> = keys.iter().map(String::as_str).collect();
        let results = n.batch_get(&all, &mut slices).await;
        for (i, r) in results.into_iter().enumerate() {
            assert_eq!(r.unwrap_or_else(|e| panic!("{} get {i}: {e}", n.node_id())), size as u64);
            let expected = if i == 40 { &values[0] } else { &values[i] };
            assert!(bufs[i][..size] == expected[..], "{} key {i}: wrong bytes", n.node_id());
        }
    }
    for n in nodes {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_local_key_is_read_without_the_master_and_the_master_still_hears_of_the_hit() {
    let m = master().await;
    let n1 = node(&m, "n1", 4 << 20).await;
    let keys: Vec<String> = (0..8).map(|i| format!("local-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, 3 * PAGE as usize + 7)).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in n1.batch_put(&items).await {
        r.expect("put");
    }
    indexed(&n1, &keys).await;
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();

    // The access hint: the master's route-get count grows by the keys read here, soon after.
    let before = m.stats().route_get_keys;
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 4 * PAGE as usize]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for r in n1.batch_get(&key_refs, &mut slices).await {
        r.expect("local get");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while m.stats().route_get_keys < before + 8 {
        assert!(tokio::time::Instant::now() < deadline, "the master never heard of the local hits");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // With the master gone, the keys this node holds are still read, byte-exact.
    m.shutdown().await;
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 4 * PAGE as usize]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (i, r) in n1.batch_get(&key_refs, &mut slices).await.into_iter().enumerate() {
        assert_eq!(r.expect("local get without a master"), values[i].len() as u64);
        assert!(bufs[i][..values[i].len()] == values[i][..], "key {i}: wrong bytes");
    }
    n1.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_many_chunks_of_local_hits_tells_the_master_of_every_key() {
    let m = master().await;
    let n1 = node(&m, "n1", 48 << 20).await;
    // 40 values of a MiB: five pipelined chunks, every key a local hit.
    let size = 256 * PAGE as usize;
    let keys: Vec<String> = (0..40).map(|i| format!("hit-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..40).map(|i| value(i, size)).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in n1.batch_put(&items).await {
        r.expect("put");
    }
    indexed(&n1, &keys).await;
    let before = m.stats().route_get_keys;
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = (0..40).map(|_| vec![0u8; size]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (i, r) in n1.batch_get(&key_refs, &mut slices).await.into_iter().enumerate() {
        assert_eq!(r.expect("local get"), size as u64);
        assert!(bufs[i] == values[i], "key {i}: wrong bytes");
    }
    // One hint for the batch: the master hears of all 40 keys, none dropped for want of a permit.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while m.stats().route_get_keys < before + 40 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the master heard of {} of 40 hits",
            m.stats().route_get_keys - before
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(m.stats().route_get_keys, before + 40, "each hit is hinted once");
    n1.close().await;
    m.shutdown().await;
}
