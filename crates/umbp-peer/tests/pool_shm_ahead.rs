//! Batch puts copied into a same-host holder while the master routes them (`same_host_put.rs`):
//!
//! - a light client whose batches went wholly to one holder on this host copies its next batch
//!   ahead of the route, and every key is written byte-exact through the shared path;
//! - keys the master says are present elsewhere are withdrawn from that holder (never committed
//!   there: a get returns the first writer's bytes), and keys it places on another holder are
//!   written there; either ends the streak, so the next batch is routed before it is copied;
//! - keys the holder already has are answered present and the streak goes on; keys present only
//!   elsewhere, copied for nothing, end it;
//! - a batch copied ahead whose route never comes (the master is gone) commits nothing: every
//!   copy is withdrawn and the holder's pages come back.
//! - a batch put leaves its keys located: with the master gone after it, the client still reads
//!   them from their holder.

mod pool_support;

use umbp_master::routing::Affinity;
use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::pool_client::{PoolClient, PoolClientConfig, PutOutcome};

use pool_support::{PAGE, config, indexed, master, value};

const TCP: &str = "TcpEngine";

/// `n` keys `prefix-i` and values of 16 pages and a bit, seeded by `seed`.
fn batch(prefix: &str, n: usize, seed: usize) -> (Vec<String>, Vec<Vec<u8>>) {
    let keys = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let values = (0..n).map(|i| value(seed + i, 16 * PAGE as usize + 5 * i + 1)).collect();
    (keys, values)
}

async fn put(client: &PoolClient, keys: &[String], values: &[Vec<u8>]) -> Vec<PutOutcome> {
    let items: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    let got = client.batch_put_outcomes(&items).await;
    keys.iter().zip(got).map(|(k, r)| r.unwrap_or_else(|e| panic!("put {k}: {e}"))).collect()
}

async fn read_back(client: &PoolClient, keys: &[String], values: &[Vec<u8>]) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = client.batch_get(&refs, &mut slices).await;
    for ((k, r), (buf, v)) in keys.iter().zip(got).zip(bufs.iter().zip(values)) {
        assert_eq!(r, Ok(v.len() as u64), "{k}");
        assert!(buf == v, "{k} byte-exact");
    }
}

/// Waits (at most 5 s) until `node`'s medium holds pages for its keys and nothing else: the
/// slots of withdrawn keys were aborted, not leaked. Every value of `batch` takes 17 pages.
async fn pages_held_only_by_keys(node: &PoolClient) {
    let medium = node.medium().expect("a node lends a medium");
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let capacity = medium.capacity();
        let used = capacity.total_bytes - capacity.available_bytes;
        let keys = medium.owned_key_count() as u64;
        if used == keys * 17 * PAGE {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{used} bytes in use for {keys} keys");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn light(m: &MasterHandle) -> PoolClientConfig {
    PoolClientConfig::new("light", m.local_addr().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_to_one_holder_here_are_copied_while_the_master_routes() {
    let m = master().await;
    let a = PoolClient::start(config(&m, "a", 16 << 20)).await.expect("node a");
    let light = PoolClient::start(light(&m)).await.expect("client");

    // The first batch is routed first: nothing is known of where this client's keys go.
    let (k1, v1) = batch("first", 8, 1);
    assert!(put(&light, &k1, &v1).await.iter().all(|o| *o == PutOutcome::Written));
    let s = light.stats();
    assert_eq!((s.keyed_puts, s.puts_copied_ahead, s.puts_withdrawn), (8, 0, 0));

    // Every key went to `a`: the next batch is copied there while the master routes it.
    let (k2, v2) = batch("second", 8, 100);
    assert!(put(&light, &k2, &v2).await.iter().all(|o| *o == PutOutcome::Written));
    let s = light.stats();
    assert_eq!((s.keyed_puts, s.puts_copied_ahead, s.puts_withdrawn), (16, 8, 0));

    // Keys `a` holds already are answered present (with their first bytes kept) and end nothing.
    indexed(&light, &k2).await;
    let (mut k3, mut v3) = batch("third", 4, 200);
    k3.extend_from_slice(&k2[..4]);
    v3.extend((0..4).map(|i| value(999 + i, v2[i].len())));
    let outcomes = put(&light, &k3, &v3).await;
    assert_eq!(outcomes[..4], [PutOutcome::Written; 4]);
    assert_eq!(outcomes[4..], [PutOutcome::AlreadyPresent; 4]);
    assert_eq!(light.stats().puts_copied_ahead, 12);
    let (k4, v4) = batch("fourth", 8, 300);
    put(&light, &k4, &v4).await;
    assert_eq!(light.stats().puts_copied_ahead, 20, "still copied ahead");

    for (k, v) in [(&k1, &v1), (&k2, &v2), (&k3[..4].to_vec(), &v3[..4].to_vec()), (&k4, &v4)] {
        read_back(&light, k, v).await;
    }
    assert_eq!(light.transferred_bytes(TCP), 0, "the TCP engine moved no bytes");
    light.close().await;
    a.close().await;
}

/// A light client with a streak on holder `a` (its first batch went wholly there), then a second
/// holder `b` holding keys of its own (`held`), indexed. The master has `local` affinity: a
/// node's own puts stay on it, so `b` holds keys `a` has never seen.
struct TwoHolders {
    _m: MasterHandle,
    a: PoolClient,
    b: PoolClient,
    light: PoolClient,
    held: Vec<String>,
    held_values: Vec<Vec<u8>>,
}

async fn two_holders() -> TwoHolders {
    let m = umbp_master::start(MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        route_put_affinity: Affinity::Local,
        ..MasterConfig::default()
    })
    .await
    .expect("master");
    let a = PoolClient::start(config(&m, "a", 16 << 20)).await.expect("node a");
    let light = PoolClient::start(light(&m)).await.expect("client");
    let (k1, v1) = batch("first", 8, 1);
    put(&light, &k1, &v1).await;
    let b = PoolClient::start(config(&m, "b", 16 << 20)).await.expect("node b");
    let (held, held_values) = batch("held", 4, 50);
    put(&b, &held, &held_values).await;
    indexed(&light, &held).await;
    TwoHolders { _m: m, a, b, light, held, held_values }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_placed_elsewhere_are_withdrawn_and_end_the_streak() {
    let TwoHolders { _m, a, b, light, held, held_values } = two_holders().await;

    // The light client writes those keys (other bytes) and new ones, copied into `a` ahead of the
    // route. The held keys are withdrawn from `a`: the first writer's bytes stay the value.
    let (mut keys, mut values) = batch("mixed", 16, 500);
    keys.extend_from_slice(&held);
    values.extend((0..4).map(|i| value(777 + i, held_values[i].len())));
    let outcomes = put(&light, &keys, &values).await;
    assert_eq!(outcomes[16..], [PutOutcome::AlreadyPresent; 4]);
    let s = light.stats();
    assert!(s.puts_withdrawn >= 4, "the held keys were copied into `a` and withdrawn: {s:?}");
    assert_eq!(s.puts_copied_ahead + s.puts_withdrawn, 20, "every key was copied ahead: {s:?}");
    read_back(&light, &held, &held_values).await;
    read_back(&light, &keys[..16], &values[..16]).await;
    let medium = a.medium().expect("a lends a medium");
    assert!(medium.batch_contains(&held).iter().all(|c| !c), "a withdrawn key is not stored on a");
    pages_held_only_by_keys(&a).await;

    // With two holders to place them on, some of the 16 new keys went to `b` (withdrawn from `a`,
    // then written there): the streak ended, and the next batch is routed before it is copied.
    assert!(s.puts_withdrawn > 4, "some new keys were placed on b: {s:?}");
    let (k3, v3) = batch("after", 8, 900);
    put(&light, &k3, &v3).await;
    assert_eq!(light.stats().puts_copied_ahead, s.puts_copied_ahead, "routed first");
    read_back(&light, &k3, &v3).await;
    assert_eq!(light.transferred_bytes(TCP), 0, "the TCP engine moved no bytes");
    for c in [&light, &a, &b] {
        c.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_whose_route_fails_commits_nothing_it_copied_ahead() {
    let m = master().await;
    let a = PoolClient::start(config(&m, "a", 16 << 20)).await.expect("node a");
    let light = PoolClient::start(light(&m)).await.expect("client");
    let (k1, v1) = batch("first", 8, 1);
    put(&light, &k1, &v1).await;
    indexed(&light, &k1).await;
    pages_held_only_by_keys(&a).await;

    // The master goes away: the next batch is copied into `a`, and its route fails.
    m.shutdown().await;
    let (k2, v2) = batch("orphan", 8, 100);
    let items: Vec<(&str, &[u8])> = k2.iter().map(String::as_str).zip(v2.iter().map(Vec::as_slice)).collect();
    let got = light.batch_put(&items).await;
    assert!(got.iter().all(Result::is_err), "no route, no write: {got:?}");
    let s = light.stats();
    assert_eq!(s.puts_copied_ahead, 0, "{s:?}");
    assert_eq!(s.puts_withdrawn, 8, "every key was copied into `a` and withdrawn: {s:?}");
    let medium = a.medium().expect("a lends a medium");
    assert!(medium.batch_contains(&k2).iter().all(|c| !c), "nothing committed without its route");
    assert_eq!(medium.owned_key_count(), 8);
    pages_held_only_by_keys(&a).await;
    light.close().await;
    a.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn re_putting_keys_held_elsewhere_ends_the_streak() {
    let TwoHolders { _m, a, b, light, held, held_values } = two_holders().await;

    // Only keys `b` holds: all present, all copied into `a` for nothing.
    let outcomes = put(&light, &held, &held_values).await;
    assert_eq!(outcomes, [PutOutcome::AlreadyPresent; 4]);
    let s = light.stats();
    assert_eq!((s.puts_copied_ahead, s.puts_withdrawn), (0, 4), "{s:?}");
    // So the next batch is routed before it is copied.
    let (k2, v2) = batch("next", 8, 100);
    put(&light, &k2, &v2).await;
    assert_eq!(light.stats().puts_withdrawn, 4, "nothing copied ahead");
    assert_eq!(light.stats().puts_copied_ahead, 0);
    read_back(&light, &k2, &v2).await;
    for c in [&light, &a, &b] {
        c.close().await;
    }
}

/// A same-host batch put leaves its keys' locations with the client (recorded after its answer
/// is sent, off the caller's path): with the master gone right after the put, the same client
/// still reads every key from the holder, without a route call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_put_leaves_its_keys_located() {
    let m = master().await;
    let a = PoolClient::start(config(&m, "a", 16 << 20)).await.expect("node a");
    let light = PoolClient::start(light(&m)).await.expect("client");
    let (keys, values) = batch("located", 8, 1);
    assert_eq!(put(&light, &keys, &values).await, [PutOutcome::Written; 8]);
    assert_eq!(light.stats().keyed_puts, 8, "written through the shared path");
    m.shutdown().await;
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    // The locations land just after the put's answer: a few tries, bounded.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let got = light.batch_get(&refs, &mut slices).await;
        if got.iter().all(Result::is_ok) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no route, and no location: {got:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(bufs, values, "byte-exact from the located holder");
    assert_eq!(light.stats().keyed_gets, 8, "every key read in a keyed exchange");
    light.close().await;
    a.close().await;
}
