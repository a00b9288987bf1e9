//! Node incarnations, the retention of expired records and the roles in the cluster status, over
//! real gRPC on 127.0.0.1: a restarted process (a higher incarnation) replaces the live record at
//! once, the old one's heartbeats are answered `superseded` and its unregister erases nothing, an
//! older process is refused, and expired records leave the status after the retention.

use std::time::Duration;

use tonic::Code;
use tonic::transport::Channel;
use umbp_master::{MasterConfig, MasterHandle};
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

fn storage(node: &str, incarnation: u64) -> v1::RegisterClientRequest {
    v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        tier_capacities: vec![v1::TierCapacity { tier: DRAM, total_bytes: GIB, available_bytes: GIB, page_size: 0 }],
        peer_address: format!("127.0.0.1:{}", 7000 + incarnation % 1000),
        data_endpoint: "127.0.0.1:1".into(),
        tags: vec![],
        incarnation,
    }
}

fn client_only(node: &str, incarnation: u64) -> v1::RegisterClientRequest {
    v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        incarnation,
        ..Default::default()
    }
}

fn delta(node: &str, incarnation: u64, seq: u64, key: &str) -> v1::HeartbeatRequest {
    v1::HeartbeatRequest {
        node_id: node.into(),
        bundles: vec![v1::EventBundle {
            seq,
            events: vec![v1::KvEvent {
                kind: v1::KvEventKind::KvEventAdd as i32,
                key: key.into(),
                tier: DRAM,
                size: 8,
            }],
        }],
        incarnation,
        ..Default::default()
    }
}

async fn found(c: &mut UmbpMasterClient<Channel>, keys: &[&str]) -> Vec<bool> {
    let keys = keys.iter().map(|k| k.to_string()).collect();
    c.batch_lookup(v1::BatchLookupRequest { keys }).await.expect("lookup").into_inner().found
}

async fn status(c: &mut UmbpMasterClient<Channel>) -> v1::GetClusterStatusResponse {
    c.get_cluster_status(v1::GetClusterStatusRequest {}).await.expect("status").into_inner()
}

#[tokio::test]
async fn a_restarted_process_replaces_its_live_record_at_once() {
    let (m, mut c) = master(config()).await;
    c.register_client(storage("n1", 100)).await.expect("first process");
    let hb = c.heartbeat(delta("n1", 100, 1, "old")).await.expect("hb").into_inner();
    assert_eq!(hb.status, v1::NodeStatus::Alive as i32);
    // kill -9, restart with the same id: no 30 s wait for the old record to expire.
    c.register_client(storage("n1", 200)).await.expect("the restarted process registers at once");
    assert_eq!(found(&mut c, &["old"]).await, vec![false], "the old process's keys are gone");
    let st = status(&mut c).await;
    assert_eq!(st.nodes.len(), 1);
    assert_eq!((st.nodes[0].incarnation, st.nodes[0].peer_address.as_str()), (200, "127.0.0.1:7200"));

    // A late heartbeat of the old incarnation: refused, flagged, and nothing of it is indexed.
    let late = c.heartbeat(delta("n1", 100, 2, "ghost")).await.expect("hb").into_inner();
    assert_eq!((late.status, late.superseded), (v1::NodeStatus::Unknown as i32, true));
    assert_eq!(found(&mut c, &["ghost"]).await, vec![false]);
    let keepalive = v1::HeartbeatRequest { node_id: "n1".into(), incarnation: 100, ..Default::default() };
    assert!(c.heartbeat(keepalive).await.expect("hb").into_inner().superseded);
    // The old process leaving erases nothing of the new one.
    c.unregister_client(v1::UnregisterClientRequest { node_id: "n1".into(), incarnation: 100 }).await.expect("unreg");
    assert_eq!(status(&mut c).await.nodes.len(), 1);

    // The new incarnation streams as usual.
    let hb = c.heartbeat(delta("n1", 200, 1, "new")).await.expect("hb").into_inner();
    assert_eq!((hb.status, hb.acked_seq, hb.superseded), (v1::NodeStatus::Alive as i32, 1, false));
    assert_eq!(found(&mut c, &["new"]).await, vec![true]);
    c.unregister_client(v1::UnregisterClientRequest { node_id: "n1".into(), incarnation: 200 }).await.expect("unreg");
    assert!(status(&mut c).await.nodes.is_empty());
    m.shutdown().await;
}

#[tokio::test]
async fn an_older_process_is_refused_with_a_clear_error() {
    let (m, mut c) = master(config()).await;
    c.register_client(storage("n1", 200)).await.expect("newer");
    let err = c.register_client(storage("n1", 100)).await.expect_err("older");
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("superseded") && err.message().contains("200"), "{}", err.message());
    // Same incarnation, or one that sends none: the plain compare-and-set.
    assert_eq!(c.register_client(storage("n1", 200)).await.expect_err("same").code(), Code::AlreadyExists);
    let legacy = c.register_client(storage("n1", 0)).await.expect_err("no incarnation");
    assert_eq!(legacy.code(), Code::AlreadyExists);
    assert!(legacy.message().contains("another node id"), "{}", legacy.message());
    m.shutdown().await;
}

#[tokio::test]
async fn the_status_tells_storage_nodes_from_clients() {
    let (m, mut c) = master(config()).await;
    c.register_client(storage("store-1", 1)).await.expect("storage");
    c.register_client(client_only("cli-1", 2)).await.expect("client");
    let st = status(&mut c).await;
    let role = |id: &str| st.nodes.iter().find(|n| n.node_id == id).map(|n| n.role);
    assert_eq!(role("store-1"), Some(v1::NodeRole::Storage as i32));
    assert_eq!(role("cli-1"), Some(v1::NodeRole::Client as i32));
    assert_eq!(st.expired_retention_ms, 300_000, "the default retention");
    m.shutdown().await;
}

#[tokio::test]
async fn expired_records_leave_the_status_after_the_retention() {
    let config = MasterConfig {
        heartbeat_ttl: Duration::from_secs(1),
        max_missed_heartbeats: 1,
        heartbeat_interval_divisor: 2,
        expired_retention: Duration::from_secs(1),
        // The test runs the reaper itself.
        reaper_interval: Duration::from_secs(3600),
        ..config()
    };
    let (m, mut c) = master(config).await;
    c.register_client(storage("crashed", 1)).await.expect("storage");
    c.register_client(client_only("cli", 2)).await.expect("client");
    c.register_client(storage("alive", 3)).await.expect("storage");
    let keepalive = v1::HeartbeatRequest { node_id: "alive".into(), incarnation: 3, ..Default::default() };
    // Bounded: expiry after 1 s of silence, removal 1 s after that.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut expired = Vec::new();
    let mut removed = Vec::new();
    while removed.len() < 2 {
        assert!(tokio::time::Instant::now() < deadline, "expired {expired:?}, removed {removed:?}");
        c.heartbeat(keepalive.clone()).await.expect("keepalive");
        let pass = m.run_reaper_pass().await;
        expired.extend(pass.expired);
        removed.extend(pass.removed);
        if expired.len() == 2 && removed.is_empty() {
            let listed: Vec<String> = status(&mut c).await.nodes.into_iter().map(|n| n.node_id).collect();
            assert_eq!(listed.len(), 3, "an expired record is listed during the retention: {listed:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    expired.sort();
    removed.sort();
    assert_eq!(expired, vec!["cli".to_owned(), "crashed".to_owned()]);
    assert_eq!(removed, expired);
    let listed: Vec<String> = status(&mut c).await.nodes.into_iter().map(|n| n.node_id).collect();
    assert_eq!(listed, vec!["alive".to_owned()]);
    m.shutdown().await;
}
