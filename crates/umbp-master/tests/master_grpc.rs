//! The master over real gRPC on 127.0.0.1: registration, the heartbeat contract with our fixes
//! (re-sent bundles re-acked, keepalives refresh capacity, re-registration wipes locations), routing
//! (never a non-ALIVE node, columnar replies), tokens, expiry and eviction against a fake peer.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};
use umbp_master::{MasterConfig, MasterHandle, TOKEN_METADATA};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;
use umbp_proto::v1::umbp_peer_server::{UmbpPeer, UmbpPeerServer};

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
    vec![v1::TierCapacity { tier: DRAM, total_bytes: total, available_bytes: available }]
}

fn registration(node: &str, peer: &str) -> v1::RegisterClientRequest {
    v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        tier_capacities: caps(GIB, GIB),
        peer_address: peer.into(),
        data_endpoint: "127.0.0.1:1".into(),
        tags: vec!["rack=a".into()],
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
        })
        .await
        .expect("route put")
        .into_inner();
    assert_eq!(put.entries[0].outcome, v1::RoutePutOutcome::RoutePutAlreadyExists as i32, "master-side dedup");
    assert_eq!(put.entries[1].outcome, v1::RoutePutOutcome::RoutePutRouted as i32);
    assert_eq!(put.entries[1].node_id, "n1");
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
    c.heartbeat(delta("n1", vec![(1, vec![add("stale", 1)])])).await.expect("hb");
    for (chunk, last, key) in [(0u32, false, "k0"), (1, false, "k1"), (2, true, "k2")] {
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
    c.heartbeat(delta("n1", vec![(1, vec![add("phantom", 1)])])).await.expect("hb");
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Stale now: a restarted node with the same id may register, and its old keys must not linger.
    c.register_client(registration("n1", "127.0.0.1:7001")).await.expect("re-register after staleness");
    assert_eq!(lookup(&mut c, &["phantom"]).await, vec![false]);
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

/// A peer that records the keys the master asks it to evict.
#[derive(Debug, Default, Clone)]
struct EvictRecorder {
    asked: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl UmbpPeer for EvictRecorder {
    async fn get_peer_info(
        &self,
        _: Request<v1::GetPeerInfoRequest>,
    ) -> Result<Response<v1::GetPeerInfoResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn allocate_slot(
        &self,
        _: Request<v1::AllocateSlotRequest>,
    ) -> Result<Response<v1::AllocateSlotResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_allocate_slots(
        &self,
        _: Request<v1::BatchAllocateSlotsRequest>,
    ) -> Result<Response<v1::BatchAllocateSlotsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn commit_slot(&self, _: Request<v1::CommitSlotRequest>) -> Result<Response<v1::CommitSlotResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_commit_slots(
        &self,
        _: Request<v1::BatchCommitSlotsRequest>,
    ) -> Result<Response<v1::BatchCommitSlotsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn abort_slot(&self, _: Request<v1::AbortSlotRequest>) -> Result<Response<v1::AbortSlotResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_abort_slots(
        &self,
        _: Request<v1::BatchAbortSlotsRequest>,
    ) -> Result<Response<v1::BatchAbortSlotsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn resolve_key(&self, _: Request<v1::ResolveKeyRequest>) -> Result<Response<v1::ResolveKeyResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_resolve_keys(
        &self,
        _: Request<v1::BatchResolveKeysRequest>,
    ) -> Result<Response<v1::BatchResolveKeysResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn evict_key(&self, r: Request<v1::EvictKeyRequest>) -> Result<Response<v1::EvictKeyResponse>, Status> {
        let keys = r.into_inner().keys;
        self.asked.lock().extend(keys.iter().cloned());
        let evicted = keys.into_iter().map(|key| v1::EvictedKey { key, bytes_freed: 0 }).collect();
        Ok(Response::new(v1::EvictKeyResponse { evicted }))
    }
}

#[tokio::test]
async fn eviction_asks_the_pressured_node_for_its_least_recently_used_keys() {
    let recorder = EvictRecorder::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let peer_addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(UmbpPeerServer::new(recorder.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let cfg = MasterConfig {
        eviction_check_interval: Duration::from_millis(100),
        route_get_lease: Duration::from_millis(1),
        ..config()
    };
    let (m, mut c) = master(cfg).await;
    c.register_client(registration("n1", &peer_addr.to_string())).await.expect("register");
    // 10 keys of 100 bytes on a 1000-byte tier that is 95 % used: evict down to 70 % = 250 bytes = 3 keys.
    let events: Vec<_> = (0..10).map(|i| add(&format!("k{i}"), 100)).collect();
    let hb = v1::HeartbeatRequest {
        node_id: "n1".into(),
        bundles: vec![v1::EventBundle { seq: 1, events }],
        tier_capacities: caps(1000, 50),
        ..Default::default()
    };
    c.heartbeat(hb).await.expect("hb");
    // Touch k0..k6 so k7, k8, k9 are the least recently used.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let touched: Vec<String> = (0..7).map(|i| format!("k{i}")).collect();
    c.batch_route_get(v1::BatchRouteGetRequest { node_id: "r".into(), keys: touched, exclude_nodes: vec![] })
        .await
        .expect("touch");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while recorder.asked.lock().len() < 3 {
        assert!(tokio::time::Instant::now() < deadline, "no EvictKey arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut first: Vec<String> = recorder.asked.lock()[..3].to_vec();
    first.sort();
    assert_eq!(first, vec!["k7", "k8", "k9"]);
    assert!(m.stats().eviction_rounds >= 1);
    m.shutdown().await;
    server.abort();
}
