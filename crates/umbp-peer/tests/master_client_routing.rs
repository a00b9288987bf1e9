//! The routing calls through the real client against a fake master (the reference's
//! `test_batch_route_get_columnar`, plus our fix: a malformed columnar reply is an error, never a
//! panic or a wrong hit), the other replies' validation, and deadlines on every routing call.

mod master_client_support;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use master_client_support::{FakeMaster, client, keys, page_backend, registry, test_config};
use umbp_core::{TierCapacity, TierType};
use umbp_peer::master_client::{
    MasterClientConfig, MasterClientError, NodeLiveness, NodeRole, RouteGetHit, RoutePutDecision,
};
use umbp_proto::v1 as pb;

const LONG_INTERVAL_MS: u64 = 60_000;
const PAGE: u64 = 4096;

async fn routed_client(master: &FakeMaster, config: MasterClientConfig) -> umbp_peer::master_client::MasterClient {
    client(master, config, registry(&[page_backend(TierType::Dram, PAGE, 16)])).await
}

fn nodes(ids: &[&str]) -> Vec<pb::NodeInfo> {
    ids.iter()
        .map(|id| pb::NodeInfo {
            node_id: (*id).into(),
            peer_address: format!("{id}.peer:7001"),
            data_endpoint: format!("{id}.data:7002"),
        })
        .collect()
}

fn hit(node: &str, tier: TierType, size: u64) -> Option<RouteGetHit> {
    Some(RouteGetHit {
        node_id: node.into(),
        peer_address: format!("{node}.peer:7001"),
        data_endpoint: format!("{node}.data:7002"),
        tier,
        size,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_columnar_route_get_reply_decodes_through_the_real_client() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let client = routed_client(&master, test_config()).await;
    *master.fake.route_get_reply.lock() = pb::BatchRouteGetResponse {
        nodes: nodes(&["n1", "n2"]),
        node_ref: vec![1, 0, 2, 1, 0],
        tier: vec![pb::TierType::TierDram as i32, 0, pb::TierType::TierHbm as i32, pb::TierType::TierSsd as i32, 0],
        size: vec![100, 0, 200, 300, 0],
    };
    let ks = keys("route", 5);
    let hits = client.batch_route_get(&ks, &["n9".to_owned()]).await.expect("valid reply");
    assert_eq!(
        hits,
        [hit("n1", TierType::Dram, 100), None, hit("n2", TierType::Hbm, 200), hit("n1", TierType::Ssd, 300), None]
    );
    let request = master.fake.last_route_get.lock().clone().expect("sent");
    assert_eq!(request.node_id, "node-a", "the requester travels (the master prefers its own replica)");
    assert_eq!(request.keys, ks);
    assert_eq!(request.exclude_nodes, ["n9"]);

    // Every key a miss, and an empty batch (no RPC at all).
    *master.fake.route_get_reply.lock() =
        pb::BatchRouteGetResponse { nodes: vec![], node_ref: vec![0, 0], tier: vec![0, 0], size: vec![0, 0] };
    assert_eq!(client.batch_route_get(&keys("miss", 2), &[]).await.expect("valid"), [None, None]);
    *master.fake.last_route_get.lock() = None;
    assert!(client.batch_route_get(&[], &[]).await.expect("empty").is_empty());
    assert!(master.fake.last_route_get.lock().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_columnar_reply_is_an_error_never_a_wrong_hit() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let client = routed_client(&master, test_config()).await;
    let dram = pb::TierType::TierDram as i32;
    let bad = [
        (
            "short node_ref",
            pb::BatchRouteGetResponse {
                nodes: nodes(&["n1"]),
                node_ref: vec![1],
                tier: vec![dram; 2],
                size: vec![1; 2],
            },
        ),
        (
            "long tier",
            pb::BatchRouteGetResponse {
                nodes: nodes(&["n1"]),
                node_ref: vec![1, 1],
                tier: vec![dram; 3],
                size: vec![1; 2],
            },
        ),
        (
            "missing size",
            pb::BatchRouteGetResponse {
                nodes: nodes(&["n1"]),
                node_ref: vec![1, 1],
                tier: vec![dram; 2],
                size: vec![],
            },
        ),
        (
            "ref past nodes",
            pb::BatchRouteGetResponse {
                nodes: nodes(&["n1"]),
                node_ref: vec![1, 2],
                tier: vec![dram; 2],
                size: vec![1; 2],
            },
        ),
        (
            "ref without nodes",
            pb::BatchRouteGetResponse { nodes: vec![], node_ref: vec![0, 1], tier: vec![dram; 2], size: vec![1; 2] },
        ),
        ("empty reply", pb::BatchRouteGetResponse::default()),
    ];
    for (what, reply) in bad {
        *master.fake.route_get_reply.lock() = reply;
        let err = client.batch_route_get(&keys("k", 2), &[]).await.expect_err(what);
        assert!(matches!(err, MasterClientError::MalformedReply { rpc: "BatchRouteGet", .. }), "{what}: {err}");
        assert!(!err.is_retryable(), "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_put_and_lookup_replies_are_validated() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let client = routed_client(&master, test_config()).await;
    *master.fake.route_put_reply.lock() = pb::BatchRoutePutResponse {
        entries: vec![
            pb::RoutePutEntry {
                outcome: pb::RoutePutOutcome::RoutePutRouted as i32,
                node_id: "n1".into(),
                tier: pb::TierType::TierDram as i32,
                peer_address: "n1.peer:7001".into(),
                data_endpoint: "n1.data:7002".into(),
            },
            pb::RoutePutEntry { outcome: pb::RoutePutOutcome::RoutePutAlreadyExists as i32, ..Default::default() },
            pb::RoutePutEntry::default(),
        ],
        // An older master: it answers entries whatever the request asks.
        ..Default::default()
    };
    let decisions = client.batch_route_put(&keys("p", 3), &[10, 20, 30], &[]).await.expect("valid");
    let asked = master.fake.last_route_put.lock().take().expect("the master was asked");
    assert!(asked.columnar, "the client asks for the columnar reply (and reads an older master's entries)");
    assert_eq!(
        decisions,
        [
            RoutePutDecision::Routed {
                node_id: "n1".into(),
                tier: TierType::Dram,
                peer_address: "n1.peer:7001".into(),
                data_endpoint: "n1.data:7002".into(),
            },
            RoutePutDecision::AlreadyExists,
            RoutePutDecision::Unavailable,
        ]
    );
    let err = client.batch_route_put(&keys("p", 2), &[10, 20], &[]).await.expect_err("3 entries for 2 keys");
    assert!(matches!(err, MasterClientError::MalformedReply { rpc: "BatchRoutePut", .. }), "{err}");
    let err = client.batch_route_put(&keys("p", 2), &[10], &[]).await.expect_err("sizes not parallel");
    assert!(matches!(err, MasterClientError::InvalidArgument(_)), "{err}");

    *master.fake.lookup_reply.lock() = pb::BatchLookupResponse { found: vec![true, false] };
    assert_eq!(client.batch_lookup(&keys("l", 2)).await.expect("valid"), [true, false]);
    let err = client.batch_lookup(&keys("l", 3)).await.expect_err("2 answers for 3 keys");
    assert!(matches!(err, MasterClientError::MalformedReply { rpc: "BatchLookup", .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_status_is_decoded() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let client = routed_client(&master, test_config()).await;
    *master.fake.cluster_reply.lock() = pb::GetClusterStatusResponse {
        nodes: vec![pb::NodeStatusInfo {
            node_id: "n1".into(),
            node_address: "10.0.0.1".into(),
            peer_address: "10.0.0.1:7001".into(),
            data_endpoint: "10.0.0.1:7002".into(),
            status: pb::NodeStatus::Alive as i32,
            tier_capacities: vec![pb::TierCapacity {
                tier: pb::TierType::TierDram as i32,
                total_bytes: 100,
                available_bytes: 40,
                page_size: 0,
            }],
            key_count: 7,
            last_heartbeat_age_ms: 1500,
            last_applied_seq: 12,
            tags: vec!["rack=r1".into()],
            role: pb::NodeRole::Storage as i32,
            incarnation: 42,
        }],
        total_keys: 7,
        expired_retention_ms: 300_000,
    };
    let status = client.cluster_status().await.expect("status");
    assert_eq!(status.total_keys, 7);
    let n = &status.nodes[0];
    assert_eq!((n.node_id.as_str(), n.status, n.key_count, n.last_applied_seq), ("n1", NodeLiveness::Alive, 7, 12));
    assert_eq!(n.tier_capacities, [(TierType::Dram, TierCapacity { total_bytes: 100, available_bytes: 40 })]);
    assert_eq!(n.last_heartbeat_age, Duration::from_millis(1500));
    assert_eq!(n.data_endpoint, "10.0.0.1:7002");
    assert_eq!((n.role, n.incarnation, n.is_storage()), (NodeRole::Storage, 42, true));
    assert_eq!(status.expired_retention, Duration::from_secs(300));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_status_tells_storage_nodes_from_clients() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let client = routed_client(&master, test_config()).await;
    let node = |id: &str, role: pb::NodeRole, caps: bool| pb::NodeStatusInfo {
        node_id: id.into(),
        status: pb::NodeStatus::Alive as i32,
        tier_capacities: if caps {
            vec![pb::TierCapacity {
                tier: pb::TierType::TierDram as i32,
                total_bytes: 1,
                available_bytes: 1,
                page_size: 0,
            }]
        } else {
            Vec::new()
        },
        role: role as i32,
        ..Default::default()
    };
    *master.fake.cluster_reply.lock() = pb::GetClusterStatusResponse {
        nodes: vec![
            node("s1", pb::NodeRole::Storage, true),
            node("c1", pb::NodeRole::Client, false),
            // An older master sends no role: the capacity decides.
            node("s2", pb::NodeRole::Unspecified, true),
            node("c2", pb::NodeRole::Unspecified, false),
        ],
        ..Default::default()
    };
    let status = client.cluster_status().await.expect("status");
    let ids = |it: &mut dyn Iterator<Item = &umbp_peer::master_client::NodeStatusReport>| {
        it.map(|n| n.node_id.clone()).collect::<Vec<_>>()
    };
    assert_eq!(ids(&mut status.storage_nodes()), ["s1", "s2"]);
    assert_eq!(ids(&mut status.clients()), ["c1", "c2"]);
    assert_eq!(status.nodes[2].role, NodeRole::Unknown);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_calls_are_bounded_by_their_deadline() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let config = MasterClientConfig { rpc_timeout: Duration::from_millis(200), ..test_config() };
    let client = routed_client(&master, config).await;
    master.fake.hang_all.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let err = client.batch_route_get(&keys("k", 1), &[]).await.expect_err("hangs");
    assert!(matches!(err, MasterClientError::Timeout { rpc: "BatchRouteGet", .. }), "{err}");
    assert!(err.is_retryable());
    let err = client.batch_route_put(&keys("k", 1), &[1], &[]).await.expect_err("hangs");
    assert!(matches!(err, MasterClientError::Timeout { rpc: "BatchRoutePut", .. }), "{err}");
    let err = client.batch_lookup(&keys("k", 1)).await.expect_err("hangs");
    assert!(matches!(err, MasterClientError::Timeout { rpc: "BatchLookup", .. }), "{err}");
    let err = client.cluster_status().await.expect_err("hangs");
    assert!(matches!(err, MasterClientError::Timeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_millis(4 * 200 + 800), "each bounded: {:?}", t0.elapsed());
    assert!(client.stats().rpc_errors >= 4);
}
