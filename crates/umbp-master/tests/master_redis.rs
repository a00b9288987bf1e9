//! A master whose metadata lives in Redis (`MasterConfig::metadata`) serves a put/get workload over
//! real gRPC, and a second master on the same Redis answers from the same index.

mod store_support;

use std::time::Duration;

use store_support::RedisServer;
use tonic::transport::Channel;
use umbp_master::{MasterConfig, MasterHandle};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

const DRAM: i32 = v1::TierType::TierDram as i32;
const GIB: u64 = 1 << 30;

async fn master(url: &str) -> (MasterHandle, UmbpMasterClient<Channel>) {
    let config = MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        metadata: Some(url.to_owned()),
        ..MasterConfig::default()
    };
    let handle = umbp_master::start(config).await.expect("master on redis starts");
    let client = UmbpMasterClient::connect(format!("http://{}", handle.local_addr())).await.expect("connect");
    (handle, client)
}

fn registration(node: &str, peer: &str) -> v1::RegisterClientRequest {
    v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        tier_capacities: vec![v1::TierCapacity { tier: DRAM, total_bytes: GIB, available_bytes: GIB, page_size: 0 }],
        peer_address: peer.into(),
        data_endpoint: format!("{peer}0"),
        tags: Vec::new(),
        incarnation: 0,
    }
}

fn heartbeat(node: &str, seq: u64, keys: &[String], size: u64) -> v1::HeartbeatRequest {
    let events = keys
        .iter()
        .map(|key| v1::KvEvent { kind: v1::KvEventKind::KvEventAdd as i32, key: key.clone(), tier: DRAM, size })
        .collect();
    v1::HeartbeatRequest {
        node_id: node.into(),
        bundles: vec![v1::EventBundle { seq, events }],
        tier_capacities: vec![v1::TierCapacity {
            tier: DRAM,
            total_bytes: GIB,
            available_bytes: GIB / 2,
            page_size: 0,
        }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_on_redis_serves_puts_and_gets_and_shares_its_index() {
    let server = RedisServer::start();
    let url = server.url(0);
    let (first, mut c) = master(&url).await;
    for node in ["n1", "n2"] {
        let peer = if node == "n1" { "127.0.0.1:7001" } else { "127.0.0.1:7002" };
        c.register_client(registration(node, peer)).await.expect("register");
    }

    // Puts: route a batch, then the chosen nodes report the keys in their heartbeats.
    let keys: Vec<String> = (0..128).map(|i| format!("prefix/{i:03}")).collect();
    let put = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "writer".into(),
            keys: keys.clone(),
            block_sizes: vec![4096; keys.len()],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect("route put")
        .into_inner();
    assert_eq!(put.entries.len(), keys.len());
    let mut by_node: std::collections::HashMap<String, Vec<String>> = Default::default();
    for (key, entry) in keys.iter().zip(&put.entries) {
        assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutRouted as i32, "{key}");
        by_node.entry(entry.node_id.clone()).or_default().push(key.clone());
    }
    for (node, held) in &by_node {
        let hb = c.heartbeat(heartbeat(node, 1, held, 4096)).await.expect("heartbeat").into_inner();
        assert_eq!((hb.acked_seq, hb.request_full_sync), (1, false), "{node}");
    }

    // Gets: every key is found where it was put, and a second put of it is deduplicated.
    let get = c
        .batch_route_get(v1::BatchRouteGetRequest {
            node_id: "reader".into(),
            keys: keys.clone(),
            exclude_nodes: vec![],
        })
        .await
        .expect("route get")
        .into_inner();
    assert!(get.node_ref.iter().all(|&r| r > 0), "every key found: {:?}", get.node_ref);
    assert_eq!(get.size, vec![4096; keys.len()]);
    let again = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "writer".into(),
            keys: keys[..4].to_vec(),
            block_sizes: vec![4096; 4],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect("route put again")
        .into_inner();
    assert!(again.entries.iter().all(|e| e.outcome == v1::RoutePutOutcome::RoutePutAlreadyExists as i32));

    // A second master on the same Redis sees the same nodes and keys, and continues n1's stream.
    let (second, mut d) = master(&url).await;
    let found = d.batch_lookup(v1::BatchLookupRequest { keys: keys.clone() }).await.expect("lookup").into_inner();
    assert!(found.found.iter().all(|&f| f));
    let n1 = by_node.get("n1").cloned().unwrap_or_default();
    let hb = d.heartbeat(heartbeat("n1", 2, &n1, 8192)).await.expect("heartbeat on the second master").into_inner();
    assert_eq!(hb.acked_seq, 2);
    first.shutdown().await;
    second.shutdown().await;
}

#[tokio::test]
async fn a_master_whose_redis_is_unreachable_fails_to_start_promptly() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let started = std::time::Instant::now();
    let config = MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        metadata: Some(format!("redis://127.0.0.1:{port}/0")),
        ..MasterConfig::default()
    };
    let Err(err) = umbp_master::start(config).await else { panic!("no Redis, no master") };
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(err.to_string().contains("unreachable"), "{err}");
}
