//! The local placement grant: a master with `local` put affinity lets a node write its own puts to
//! its own medium without a route call.
//!
//! - a granted node's puts make no `BatchRoutePut`, reach the master's index by heartbeat, and are
//!   read byte-exact from another node;
//! - a key the granted node's medium refuses (full) is routed as usual, to another node, even with
//!   no re-routes configured, and every key is still written and read back byte-exact;
//! - without `local` affinity, and for a node that lends no medium, there is no grant and every put
//!   is routed.

use umbp_master::routing::Affinity;
use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::pool_client::{Medium, PoolClient};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

/// A master on 127.0.0.1 whose put policy prefers the writer's own node.
async fn local_affinity_master() -> MasterHandle {
    umbp_master::start(MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        route_put_affinity: Affinity::Local,
        ..MasterConfig::default()
    })
    .await
    .expect("master")
}

async fn node(master: &MasterHandle, id: &str, capacity: u64) -> PoolClient {
    PoolClient::start(config(master, id, capacity)).await.expect("node starts")
}

/// Reads `keys` on `reader` and checks each against `values`.
async fn read_back(reader: &PoolClient, keys: &[String], values: &[Vec<u8>]) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (i, r) in reader.batch_get(&refs, &mut slices).await.into_iter().enumerate() {
        assert_eq!(r.unwrap_or_else(|e| panic!("{} get {i}: {e}", reader.node_id())), values[i].len() as u64);
        assert!(bufs[i] == values[i], "{} key {i}: wrong bytes", reader.node_id());
    }
}

/// Writes every key from `writer` (each must succeed); how many keys the master routed meanwhile.
async fn put_all(m: &MasterHandle, writer: &PoolClient, keys: &[String], values: &[Vec<u8>]) -> u64 {
    let items: Vec<(&str, &[u8])> = keys.iter().zip(values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    let routed_before = m.stats().route_put_keys;
    for (i, r) in writer.batch_put(&items).await.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("{} put {i}: {e}", writer.node_id()));
    }
    m.stats().route_put_keys - routed_before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_granted_node_writes_its_own_puts_without_a_route_call() {
    let m = local_affinity_master().await;
    let (n1, n2) = (node(&m, "n1", 4 << 20).await, node(&m, "n2", 4 << 20).await);
    assert!(n1.master().local_puts_granted(), "a DRAM node under local affinity is granted local placement");
    let keys: Vec<String> = (0..16).map(|i| format!("granted-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..16).map(|i| value(i, 2 * PAGE as usize + 11)).collect();
    assert_eq!(put_all(&m, &n1, &keys, &values).await, 0, "a granted put makes no route call");
    // The heartbeat tells the master, and another node reads them over the data plane.
    indexed(&n2, &keys).await;
    read_back(&n2, &keys, &values).await;
    read_back(&n1, &keys, &values).await;
    n1.close().await;
    n2.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_the_granted_medium_refuses_is_routed_to_another_node() {
    let m = local_affinity_master().await;
    // n1 holds 16 pages; the batch needs 24. No re-routes: the granted local round must not use
    // up the one routed round the refused keys are owed.
    let mut n1_config = config(&m, "n1", 16 * PAGE);
    n1_config.max_reroutes = 0;
    let n1 = PoolClient::start(n1_config).await.expect("node starts");
    let n2 = node(&m, "n2", 4 << 20).await;
    assert!(n1.master().local_puts_granted());
    let keys: Vec<String> = (0..8).map(|i| format!("spill-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| value(100 + i, 3 * PAGE as usize)).collect();
    // 5 keys of 3 pages fit in 16 pages: the other 3 were refused locally and routed.
    assert_eq!(put_all(&m, &n1, &keys, &values).await, 3, "exactly the keys n1 refused are routed");
    indexed(&n1, &keys).await;
    read_back(&n2, &keys, &values).await;
    read_back(&n1, &keys, &values).await;
    n1.close().await;
    n2.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_grant_without_local_affinity_or_without_a_medium() {
    // Default affinity: no grant, every put is routed.
    let m = master().await;
    let n1 = node(&m, "n1", 4 << 20).await;
    assert!(!n1.master().local_puts_granted(), "no grant under the default affinity");
    let keys: Vec<String> = (0..4).map(|i| format!("routed-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| value(200 + i, PAGE as usize)).collect();
    assert_eq!(put_all(&m, &n1, &keys, &values).await, 4, "every put is routed without a grant");
    indexed(&n1, &keys).await;
    n1.close().await;
    m.shutdown().await;

    // Local affinity, but a client-only node: nothing to place locally, no grant.
    let m = local_affinity_master().await;
    let store = node(&m, "store", 4 << 20).await;
    let client = PoolClient::start(config(&m, "client", 0).with_medium(Medium::None)).await.expect("client starts");
    assert!(!client.master().local_puts_granted(), "a node that lends nothing is never granted");
    assert_eq!(put_all(&m, &client, &keys, &values).await, 4, "a client-only node's puts are routed");
    indexed(&client, &keys).await;
    read_back(&client, &keys, &values).await;
    client.close().await;
    store.close().await;
    m.shutdown().await;
}
