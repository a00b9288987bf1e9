//! The master over real gRPC on 127.0.0.1: registration, the heartbeat contract with our fixes
//! (re-sent bundles re-acked, keepalives refresh capacity, re-registration wipes locations), routing
//! (never a non-ALIVE node, columnar replies), tokens, expiry and eviction against a fake peer.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::Channel;
use tonic::{Code, Request};
use umbp_core::TierType;
use umbp_master::store::{
    EvictionCandidate, ExternalKvMatch, ExternalReport, HeartbeatApply, HeartbeatOutcome, InMemoryStore, Location,
    MetadataStore, NodeRecord, PeerView, RegisterOutcome, Registration, StoreError,
};
use umbp_master::{MasterConfig, MasterHandle, TOKEN_METADATA};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

const DRAM: i32 = v1::TierType::TierDram as i32;
const GIB: u64 = 1 << 30;

fn config() -> MasterConfig {
    MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() }
}

async fn master(config: MasterConfig) -> (MasterHandle, UmbpMasterClient<Channel>) {
    let handle = umbp_master::start(config).await.expect("master starts");
    let client = UmbpMasterClient::connect(format!("http://{}", handle.local_addr())).await.expect("connect");
    (handle, client)
}

fn caps(total: u64, available: u64) -> Vec<v1::TierCapacity> {
    vec![v1::TierCapacity { tier: DRAM, total_bytes: total, available_bytes: available, page_size: 0 }]
}

fn registration(node: &str, peer: &str) -> v1::RegisterClientRequest {
    v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        tier_capacities: caps(GIB, GIB),
        peer_address: peer.into(),
        data_endpoint: "127.0.0.1:1".into(),
        tags: vec!["rack=a".into()],
        incarnation: 0,
    }
}

fn add(key: &str, size: u64) -> v1::KvEvent {
    v1::KvEvent { kind: v1::KvEventKind::KvEventAdd as i32, key: key.into(), tier: DRAM, size }
}

fn delta(node: &str, bundles: Vec<(u64, Vec<v1::KvEvent>)>) -> v1::HeartbeatRequest {
    v1::HeartbeatRequest {
        node_id: node.into(),
        bundles: bundles.into_iter().map(|(seq, events)| v1::EventBundle { seq, events }).collect(),
        tier_capacities: caps(GIB, GIB / 2),
        ..Default::default()
    }
}

async fn lookup(c: &mut UmbpMasterClient<Channel>, keys: &[&str]) -> Vec<bool> {
    let keys = keys.iter().map(|k| k.to_string()).collect();
    c.batch_lookup(v1::BatchLookupRequest { keys }).await.expect("lookup").into_inner().found
}

#[tokio::test]
async fn register_heartbeat_route_and_lookup() {
    let (m, mut c) = master(config()).await;
    let reply = c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register").into_inner();
    assert_eq!(reply.heartbeat_interval_ms, 5000);
    let dup = c.register_client(registration("n1", "127.0.0.1:7001")).await.expect_err("fresh duplicate");
    assert_eq!(dup.code(), Code::AlreadyExists);

    let hb = c.heartbeat(delta("n1", vec![(1, vec![add("a", 10), add("b", 20)])])).await.expect("hb").into_inner();
    assert_eq!((hb.status, hb.acked_seq, hb.request_full_sync), (v1::NodeStatus::Alive as i32, 1, false));
    assert_eq!(lookup(&mut c, &["a", "b", "c"]).await, vec![true, true, false]);

    let keys = vec!["a".to_string(), "zz".to_string(), "b".to_string()];
    let get = c
        .batch_route_get(v1::BatchRouteGetRequest { node_id: "reader".into(), keys, exclude_nodes: vec![] })
        .await
        .expect("route get")
        .into_inner();
    assert_eq!(get.nodes.len(), 1, "one node listed once");
    assert_eq!(get.nodes[0].peer_address, "127.0.0.1:7001");
    assert_eq!(get.node_ref, vec![1, 0, 1]);
    assert_eq!(get.size, vec![10, 0, 20]);

    let put = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "writer".into(),
            keys: vec!["a".into(), "new".into()],
            block_sizes: vec![10, 4096],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect("route put")
        .into_inner();
    assert_eq!(put.entries[0].outcome, v1::RoutePutOutcome::RoutePutAlreadyExists as i32, "master-side dedup");
    assert_eq!(put.entries[1].outcome, v1::RoutePutOutcome::RoutePutRouted as i32);
    assert_eq!(put.entries[1].node_id, "n1");
    m.shutdown().await;
}

/// A route reply names the holder's (or target's) data endpoint as it registered it, so a client can
/// go straight to its data server; a node that registered none is named with an empty one.
#[tokio::test]
async fn route_replies_carry_the_registered_data_endpoint() {
    let (m, mut c) = master(config()).await;
    let with =
        v1::RegisterClientRequest { data_endpoint: "127.0.0.1:9101".into(), ..registration("n1", "127.0.0.1:7001") };
    let without = v1::RegisterClientRequest { data_endpoint: String::new(), ..registration("n2", "127.0.0.1:7002") };
    c.register_client(with).await.expect("register n1");
    c.register_client(without).await.expect("register n2");
    c.heartbeat(delta("n1", vec![(1, vec![add("a", 10)])])).await.expect("hb n1");
    c.heartbeat(delta("n2", vec![(1, vec![add("b", 20)])])).await.expect("hb n2");

    let keys = vec!["a".to_string(), "b".to_string(), "zz".to_string()];
    let get = c
        .batch_route_get(v1::BatchRouteGetRequest { node_id: "reader".into(), keys, exclude_nodes: vec![] })
        .await
        .expect("route get")
        .into_inner();
    let endpoint_of = |i: usize| {
        let node = &get.nodes[get.node_ref[i] as usize - 1];
        (node.node_id.as_str(), node.data_endpoint.as_str())
    };
    assert_eq!(endpoint_of(0), ("n1", "127.0.0.1:9101"));
    assert_eq!(endpoint_of(1), ("n2", ""), "a node that registered no data endpoint");
    assert_eq!(get.node_ref[2], 0);

    let one = c
        .route_get(v1::RouteGetRequest { key: "a".into(), node_id: "reader".into(), exclude_nodes: vec![] })
        .await
        .expect("unary route get")
        .into_inner();
    assert!(one.found);
    assert_eq!((one.node_id.as_str(), one.data_endpoint.as_str()), ("n1", "127.0.0.1:9101"));

    // Only n1 may take the put: n2 is excluded.
    let put = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "writer".into(),
            keys: vec!["new".into()],
            block_sizes: vec![4096],
            exclude_nodes: vec!["n2".into()],
            columnar: false,
        })
        .await
        .expect("route put")
        .into_inner();
    assert_eq!(put.entries[0].outcome, v1::RoutePutOutcome::RoutePutRouted as i32);
    assert_eq!((put.entries[0].node_id.as_str(), put.entries[0].data_endpoint.as_str()), ("n1", "127.0.0.1:9101"));
    // The columnar reply a client asks for: each routed node listed once, with its addresses.
    let keys: Vec<String> = ["c1", "a", "c2", "c3", "c4", "c1"].map(String::from).to_vec();
    let put = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "writer".into(),
            block_sizes: vec![4096; keys.len()],
            keys,
            exclude_nodes: vec![],
            columnar: true,
        })
        .await
        .expect("columnar route put")
        .into_inner();
    assert!(put.entries.is_empty(), "no entries beside the columns");
    let (routed, exists) =
        (v1::RoutePutOutcome::RoutePutRouted as i32, v1::RoutePutOutcome::RoutePutAlreadyExists as i32);
    assert_eq!(
        put.outcome,
        vec![routed, exists, routed, routed, routed, exists],
        "dedup against the index and the batch"
    );
    assert_eq!((put.node_ref[1], put.node_ref[5]), (0, 0), "a key not routed names no node");
    assert_eq!(
        put.tier,
        vec![
            v1::TierType::TierDram as i32,
            0,
            v1::TierType::TierDram as i32,
            v1::TierType::TierDram as i32,
            v1::TierType::TierDram as i32,
            0
        ]
    );
    let mut listed: Vec<_> =
        put.nodes.iter().map(|n| (n.node_id.as_str(), n.peer_address.as_str(), n.data_endpoint.as_str())).collect();
    listed.sort_unstable();
    listed.dedup();
    assert_eq!(listed.len(), put.nodes.len(), "each node listed once");
    for i in [0, 2, 3, 4] {
        let node = &put.nodes[put.node_ref[i] as usize - 1];
        let expected = match node.node_id.as_str() {
            "n1" => ("127.0.0.1:7001", "127.0.0.1:9101"),
            "n2" => ("127.0.0.1:7002", ""),
            other => panic!("key {i} routed to unknown node {other}"),
        };
        assert_eq!((node.peer_address.as_str(), node.data_endpoint.as_str()), expected, "key {i}");
    }
    let put = c
        .route_put(v1::RoutePutRequest {
            key: "other".into(),
            node_id: "writer".into(),
            block_size: 4096,
            exclude_nodes: vec!["n1".into()],
        })
        .await
        .expect("unary route put")
        .into_inner();
    assert_eq!(put.outcome, v1::RoutePutOutcome::RoutePutRouted as i32);
    assert_eq!((put.node_id.as_str(), put.data_endpoint.as_str()), ("n2", ""));
    m.shutdown().await;
}

#[tokio::test]
async fn a_resent_bundle_is_reacked_not_punished_with_a_full_sync() {
    let (m, mut c) = master(config()).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    let first = c.heartbeat(delta("n1", vec![(1, vec![add("a", 1)]), (2, vec![add("b", 2)])])).await.expect("hb");
    assert_eq!(first.into_inner().acked_seq, 2);
    // The ack was lost: the client re-sends 1..2 and adds 3.
    let again = c
        .heartbeat(delta("n1", vec![(1, vec![add("a", 1)]), (2, vec![add("b", 2)]), (3, vec![add("c", 3)])]))
        .await
        .expect("hb")
        .into_inner();
    assert_eq!((again.acked_seq, again.request_full_sync), (3, false));
    assert_eq!(m.stats().reacked, 2);
    assert_eq!(lookup(&mut c, &["a", "b", "c"]).await, vec![true, true, true]);
    // A real gap still asks for a full sync.
    let gap = c.heartbeat(delta("n1", vec![(9, vec![add("x", 1)])])).await.expect("hb").into_inner();
    assert!(gap.request_full_sync);
    assert_eq!(gap.acked_seq, 3);
    m.shutdown().await;
}

#[tokio::test]
async fn keepalives_refresh_capacity_and_unknown_nodes_are_told_so() {
    let (m, mut c) = master(config()).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    let keepalive =
        v1::HeartbeatRequest { node_id: "n1".into(), tier_capacities: caps(GIB, 123), ..Default::default() };
    let r = c.heartbeat(keepalive).await.expect("keepalive").into_inner();
    assert!(!r.request_full_sync, "a keepalive never asks for a full sync");
    let status = c.get_cluster_status(v1::GetClusterStatusRequest {}).await.expect("status").into_inner();
    assert_eq!(status.nodes[0].tier_capacities[0].available_bytes, 123);
    assert_eq!(status.nodes[0].tags, vec!["rack=a".to_string()]);
    let unknown = c.heartbeat(delta("ghost", vec![(1, vec![add("a", 1)])])).await.expect("hb").into_inner();
    assert_eq!(unknown.status, v1::NodeStatus::Unknown as i32);
    m.shutdown().await;
}

#[tokio::test]
async fn chunked_full_sync_replaces_the_index_and_lines_up_the_next_delta() {
    let (m, mut c) = master(config()).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    c.heartbeat(delta("n1", vec![(1, vec![add("stale", 1), add("k1", 1)])])).await.expect("hb");
    for (chunk, last, key) in [(0u32, false, "k0"), (1, false, "k1"), (2, true, "k2")] {
        // Between chunks the node's previous view stays routable (mark and sweep, no wipe first).
        let mid = c
            .batch_route_get(v1::BatchRouteGetRequest {
                node_id: "r".into(),
                keys: vec!["stale".into(), "k1".into()],
                exclude_nodes: vec![],
            })
            .await
            .expect("route")
            .into_inner();
        assert_eq!(mid.node_ref, vec![1, 1], "before chunk {chunk}");
        let r = c
            .heartbeat(v1::HeartbeatRequest {
                node_id: "n1".into(),
                is_full_sync: true,
                bundles: vec![v1::EventBundle { seq: 5, events: vec![add(key, 8)] }],
                delta_seq_baseline: 5,
                full_sync_chunk: chunk,
                full_sync_final: last,
                ..Default::default()
            })
            .await
            .expect("chunk")
            .into_inner();
        assert!(!r.request_full_sync, "chunk {chunk} accepted");
    }
    assert_eq!(lookup(&mut c, &["stale", "k0", "k1", "k2"]).await, vec![false, true, true, true]);
    let next = c.heartbeat(delta("n1", vec![(6, vec![add("k3", 1)])])).await.expect("hb").into_inner();
    assert_eq!((next.acked_seq, next.request_full_sync), (6, false), "the delta after the baseline lines up");
    m.shutdown().await;
}

#[tokio::test]
async fn reregistering_wipes_the_nodes_old_locations() {
    let cfg = MasterConfig {
        heartbeat_ttl: Duration::from_millis(100),
        max_missed_heartbeats: 1,
        reaper_interval: Duration::from_secs(3600),
        ..config()
    };
    let (m, mut c) = master(cfg).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    c.heartbeat(delta("n1", vec![(1, vec![add("phantom", 1), add("again", 1)])])).await.expect("hb");
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Stale now: a restarted node with the same id may register, and its old keys must not linger.
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("re-register after staleness");
    assert_eq!(lookup(&mut c, &["phantom"]).await, vec![false]);
    let status = c.get_cluster_status(v1::GetClusterStatusRequest {}).await.expect("status").into_inner();
    assert_eq!((status.total_keys, status.nodes[0].key_count), (0, 0), "the old entries are gone, not just hidden");
    // The new registration reports one of its old keys again: it must be routable, not shadowed by a
    // leftover location of the old registration.
    c.heartbeat(delta("n1", vec![(1, vec![add("again", 7)])])).await.expect("hb");
    assert_eq!(lookup(&mut c, &["phantom", "again"]).await, vec![false, true]);
    let get = c
        .route_get(v1::RouteGetRequest { key: "again".into(), node_id: "r".into(), exclude_nodes: vec![] })
        .await
        .expect("route")
        .into_inner();
    assert!(get.found && get.size == 7, "{get:?}");
    m.shutdown().await;
}

#[tokio::test]
async fn a_silent_node_expires_and_disappears_from_routes() {
    let cfg = MasterConfig {
        heartbeat_ttl: Duration::from_millis(200),
        max_missed_heartbeats: 1,
        reaper_interval: Duration::from_millis(50),
        ..config()
    };
    let (m, mut c) = master(cfg).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    c.heartbeat(delta("n1", vec![(1, vec![add("a", 1)])])).await.expect("hb");
    let route = |c: &mut UmbpMasterClient<Channel>| {
        let mut c = c.clone();
        async move {
            c.batch_route_get(v1::BatchRouteGetRequest {
                node_id: "r".into(),
                keys: vec!["a".into()],
                exclude_nodes: vec![],
            })
            .await
            .expect("route")
            .into_inner()
        }
    };
    assert_eq!(route(&mut c).await.node_ref, vec![1]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = route(&mut c).await;
    assert_eq!(after.node_ref, vec![0], "an expired node is never a route");
    assert!(after.nodes.is_empty());
    let put = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "w".into(),
            keys: vec!["b".into()],
            block_sizes: vec![1],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect("route put")
        .into_inner();
    assert_eq!(put.entries[0].outcome, v1::RoutePutOutcome::RoutePutUnavailable as i32);
    let status = c.get_cluster_status(v1::GetClusterStatusRequest {}).await.expect("status").into_inner();
    assert_eq!(status.nodes[0].status, v1::NodeStatus::Expired as i32, "the row is kept for operators");
    let hb = c.heartbeat(delta("n1", vec![(2, vec![])])).await.expect("hb").into_inner();
    assert_eq!(hb.status, v1::NodeStatus::Unknown as i32, "an expired node must register again");
    m.shutdown().await;
}

#[tokio::test]
async fn malformed_requests_are_invalid_arguments() {
    let (m, mut c) = master(config()).await;
    let mismatch = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "w".into(),
            keys: vec!["a".into()],
            block_sizes: vec![],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect_err("length mismatch");
    assert_eq!(mismatch.code(), Code::InvalidArgument);
    let empty = c
        .route_get(v1::RouteGetRequest { key: String::new(), node_id: "r".into(), exclude_nodes: vec![] })
        .await
        .expect_err("empty key");
    assert_eq!(empty.code(), Code::InvalidArgument);
    let no_id = c.register_client(registration("", "x:1")).await.expect_err("empty node id");
    assert_eq!(no_id.code(), Code::InvalidArgument);
    m.shutdown().await;
}

#[tokio::test]
async fn the_cluster_token_is_required_on_every_call() {
    let (m, mut c) = master(MasterConfig { cluster_token: Some("s3cret".into()), ..config() }).await;
    let denied = c.batch_lookup(v1::BatchLookupRequest { keys: vec![] }).await.expect_err("no token");
    assert_eq!(denied.code(), Code::Unauthenticated);
    let mut wrong = Request::new(v1::BatchLookupRequest { keys: vec![] });
    wrong.metadata_mut().insert(TOKEN_METADATA, "nope".parse().expect("ascii"));
    assert_eq!(c.batch_lookup(wrong).await.expect_err("wrong token").code(), Code::Unauthenticated);
    let mut right = Request::new(v1::BatchLookupRequest { keys: vec!["a".into()] });
    right.metadata_mut().insert(TOKEN_METADATA, "s3cret".parse().expect("ascii"));
    assert_eq!(c.batch_lookup(right).await.expect("right token").into_inner().found, vec![false]);
    m.shutdown().await;
}

fn full_sync_chunk(
    node: &str,
    baseline: u64,
    chunk: u32,
    last: bool,
    events: Vec<v1::KvEvent>,
) -> v1::HeartbeatRequest {
    v1::HeartbeatRequest {
        node_id: node.into(),
        is_full_sync: true,
        bundles: vec![v1::EventBundle { seq: baseline, events }],
        delta_seq_baseline: baseline,
        full_sync_chunk: chunk,
        full_sync_final: last,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_stale_full_sync_copy_is_reacked_not_counted_as_applied() {
    let (m, mut c) = master(config()).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    let r = c.heartbeat(full_sync_chunk("n1", 5, 0, true, vec![add("k1", 1), add("x", 1)])).await.expect("hb");
    assert_eq!(r.into_inner().acked_seq, 5);
    assert_eq!(m.stats().events_applied, 2);
    let late = c.heartbeat(full_sync_chunk("n1", 5, 0, true, vec![add("k1", 1)])).await.expect("hb").into_inner();
    assert_eq!((late.acked_seq, late.request_full_sync), (5, false));
    assert_eq!(m.stats().events_applied, 2, "nothing of the stale copy was applied");
    assert_eq!(m.stats().reacked, 1);
    assert_eq!(lookup(&mut c, &["k1", "x"]).await, vec![true, true]);
    m.shutdown().await;
}

#[tokio::test]
async fn unknown_event_kinds_and_empty_keys_are_skipped_not_added() {
    let (m, mut c) = master(config()).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    let future_kind = v1::KvEvent { kind: 7, key: "mystery".into(), tier: DRAM, size: 1 };
    let r = c
        .heartbeat(delta("n1", vec![(1, vec![future_kind, add("", 1), add("real", 1)])]))
        .await
        .expect("hb")
        .into_inner();
    assert_eq!((r.acked_seq, r.request_full_sync), (1, false), "the bundle itself is applied");
    assert_eq!(lookup(&mut c, &["mystery", "", "real"]).await, vec![false, false, true]);
    assert_eq!((m.stats().events_applied, m.stats().events_skipped), (1, 2));
    m.shutdown().await;
}

#[tokio::test]
async fn a_key_repeated_in_one_put_batch_is_routed_once() {
    let (m, mut c) = master(config()).await;
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    // The node has 1000 bytes free: "a" twice at 600 would not fit twice if it were counted twice.
    c.heartbeat(v1::HeartbeatRequest { node_id: "n1".into(), tier_capacities: caps(GIB, 1000), ..Default::default() })
        .await
        .expect("keepalive");
    let put = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "w".into(),
            keys: vec!["a".into(), "a".into(), "b".into(), "huge".into(), "huge".into()],
            block_sizes: vec![600, 600, 400, 5000, 5000],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect("route put")
        .into_inner();
    let outcomes: Vec<i32> = put.entries.iter().map(|e| e.outcome).collect();
    use v1::RoutePutOutcome::*;
    assert_eq!(
        outcomes,
        vec![
            RoutePutRouted as i32,
            RoutePutAlreadyExists as i32,
            RoutePutRouted as i32,
            RoutePutUnavailable as i32,
            RoutePutUnavailable as i32
        ],
        "{put:?}"
    );
    m.shutdown().await;
}

/// An in-memory store whose route-get read also names a node that is not alive, as a store shared
/// by several masters could in the window of an expiry.
#[derive(Debug)]
struct GhostLocations(InMemoryStore);

impl MetadataStore for GhostLocations {
    fn register(&self, reg: Registration, now_ms: u64, stale: u64) -> Result<RegisterOutcome, StoreError> {
        self.0.register(reg, now_ms, stale)
    }
    fn unregister_incarnation(&self, node_id: &str, incarnation: u64) -> Result<bool, StoreError> {
        self.0.unregister_incarnation(node_id, incarnation)
    }
    fn remove_expired(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        self.0.remove_expired(cutoff_ms)
    }
    fn credit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<(), StoreError> {
        self.0.credit_capacity(node_id, tier, bytes)
    }
    fn debit_capacity(
        &self,
        node_id: &str,
        tier: TierType,
        bytes: u64,
    ) -> Result<Option<umbp_master::store::TierCap>, StoreError> {
        self.0.debit_capacity(node_id, tier, bytes)
    }
    fn apply_heartbeat(&self, hb: HeartbeatApply) -> Result<HeartbeatOutcome, StoreError> {
        self.0.apply_heartbeat(hb)
    }
    fn expire_stale(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        self.0.expire_stale(cutoff_ms)
    }
    fn lookup(&self, key: &str) -> Result<Vec<Location>, StoreError> {
        self.0.lookup(key)
    }
    fn batch_lookup_for_route_get(
        &self,
        keys: &[String],
        exclude: &[String],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Vec<Vec<Location>>, StoreError> {
        let mut out = self.0.batch_lookup_for_route_get(keys, exclude, now_ms, lease_ms)?;
        for locations in &mut out {
            locations.push(Location { node_id: "ghost".into(), tier: TierType::Dram, size: 1 });
        }
        Ok(out)
    }
    fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        self.0.batch_exists(keys)
    }
    fn enumerate_eviction_candidates(
        &self,
        buckets: &[(String, TierType)],
        now_ms: u64,
        max: usize,
    ) -> Result<Vec<EvictionCandidate>, StoreError> {
        self.0.enumerate_eviction_candidates(buckets, now_ms, max)
    }
    fn get_node(&self, node_id: &str) -> Result<Option<NodeRecord>, StoreError> {
        self.0.get_node(node_id)
    }
    fn is_alive(&self, node_id: &str) -> Result<bool, StoreError> {
        self.0.is_alive(node_id)
    }
    fn list_alive(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.0.list_alive()
    }
    fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.0.list_nodes()
    }
    fn alive_peer_view(&self) -> Result<HashMap<Arc<str>, PeerView>, StoreError> {
        self.0.alive_peer_view()
    }
    fn key_count(&self) -> Result<u64, StoreError> {
        self.0.key_count()
    }
    fn node_key_count(&self, node_id: &str) -> Result<u64, StoreError> {
        self.0.node_key_count(node_id)
    }
    fn report_external_kv(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<ExternalReport, StoreError> {
        self.0.report_external_kv(node_id, hashes, tier)
    }
    fn revoke_external_kv(&self, node_id: &str, hashes: &[String], tier: TierType) -> Result<(), StoreError> {
        self.0.revoke_external_kv(node_id, hashes, tier)
    }
    fn revoke_all_external_kv_at_tier(&self, node_id: &str, tier: TierType) -> Result<(), StoreError> {
        self.0.revoke_all_external_kv_at_tier(node_id, tier)
    }
    fn match_external_kv(&self, hashes: &[String], count_as_hit: bool) -> Result<Vec<ExternalKvMatch>, StoreError> {
        self.0.match_external_kv(hashes, count_as_hit)
    }
    fn external_kv_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, StoreError> {
        self.0.external_kv_hit_counts(hashes)
    }
    fn acquire_lease(&self, name: &str, holder: &str, now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError> {
        self.0.acquire_lease(name, holder, now_ms, ttl_ms)
    }
    fn release_lease(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
        self.0.release_lease(name, holder)
    }
}

#[tokio::test]
async fn routes_never_name_a_node_missing_from_the_alive_view() {
    let store: Arc<dyn MetadataStore> = Arc::new(GhostLocations(InMemoryStore::new()));
    let handle = umbp_master::start_with_store(config(), store).await.expect("master starts");
    let mut c = UmbpMasterClient::connect(format!("http://{}", handle.local_addr())).await.expect("connect");
    let get = c
        .batch_route_get(v1::BatchRouteGetRequest {
            node_id: "r".into(),
            keys: vec!["k".into(), "j".into()],
            exclude_nodes: vec![],
        })
        .await
        .expect("route")
        .into_inner();
    assert_eq!(get.node_ref, vec![0, 0], "{get:?}");
    assert!(get.nodes.is_empty());
    let one = c
        .route_get(v1::RouteGetRequest { key: "k".into(), node_id: "r".into(), exclude_nodes: vec![] })
        .await
        .expect("route")
        .into_inner();
    assert!(!one.found);
    // A live node's replica is still chosen over the ghost.
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("register");
    c.heartbeat(delta("n1", vec![(1, vec![add("k", 3)])])).await.expect("hb");
    for _ in 0..20 {
        let get = c
            .batch_route_get(v1::BatchRouteGetRequest {
                node_id: "r".into(),
                keys: vec!["k".into()],
                exclude_nodes: vec![],
            })
            .await
            .expect("route")
            .into_inner();
        assert_eq!(get.node_ref, vec![1]);
        assert_eq!(get.nodes.len(), 1);
        assert_eq!(get.nodes[0].node_id, "n1");
    }
    handle.shutdown().await;
}
