//! Several masters on one Redis: the duty lease (reaper and eviction) moves to a surviving master
//! within a few seconds of its holder's death and expired nodes still expire; a master whose Redis
//! is down answers promptly with a retryable `UNAVAILABLE` and serves again when it is back; two
//! stores racing one registration or one lease: exactly one wins.

mod store_support;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use store_support::{RedisServer, registration};
use tonic::transport::Channel;
use umbp_master::store::{MetadataStore, NodeStatus, RegisterOutcome};
use umbp_master::{MasterConfig, MasterHandle};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

const DRAM: i32 = v1::TierType::TierDram as i32;

/// Masters that expire a node silent for 1 s and reap every 100 ms.
async fn master(url: &str) -> (MasterHandle, UmbpMasterClient<Channel>) {
    let config = MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        metadata: Some(url.to_owned()),
        heartbeat_ttl: Duration::from_secs(1),
        max_missed_heartbeats: 1,
        reaper_interval: Duration::from_millis(100),
        ..MasterConfig::default()
    };
    let handle = umbp_master::start(config).await.expect("master on redis starts");
    let client = UmbpMasterClient::connect(format!("http://{}", handle.local_addr())).await.expect("connect");
    (handle, client)
}

fn register_request(node: &str) -> v1::RegisterClientRequest {
    v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        peer_address: "127.0.0.1:1".into(),
        ..Default::default()
    }
}

async fn wait_for(what: &str, bound: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < bound, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_duty_lease_moves_to_a_surviving_master_which_expires_nodes() {
    let server = RedisServer::start();
    let url = server.url(0);
    let (first, _) = master(&url).await;
    let (second, mut c) = master(&url).await;
    assert!(first.holds_duty_lease(), "the first master took the lease at start");
    assert!(!second.holds_duty_lease(), "one holder at a time");

    // The holder dies without releasing (its tasks aborted, as a crash): the survivor takes the lease
    // within TTL (3 s) + one attempt period (1 s).
    drop(first);
    let took = wait_for("the survivor takes the lease", Duration::from_secs(5), || second.holds_duty_lease()).await;
    eprintln!("lease taken over after {took:?}");

    // Its reaper runs: a node that registered and then fell silent expires.
    c.register_client(register_request("silent")).await.expect("register");
    let store = Arc::clone(second.store());
    wait_for("the silent node expires", Duration::from_secs(4), || {
        store.get_node("silent").ok().flatten().is_some_and(|r| r.status == NodeStatus::Expired)
    })
    .await;

    // A graceful shutdown releases the lease: a new master takes it at once.
    second.shutdown().await;
    let (third, _) = master(&url).await;
    assert!(third.holds_duty_lease(), "released on shutdown, taken at start");
    third.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_answers_unavailable_promptly_while_redis_is_down_and_serves_when_it_is_back() {
    let server = RedisServer::start();
    let (url, port) = (server.url(0), server.port());
    let (handle, mut c) = master(&url).await;
    c.register_client(register_request("n1")).await.expect("register");
    drop(server);

    let started = Instant::now();
    let err = c
        .batch_route_get(v1::BatchRouteGetRequest {
            node_id: "r".into(),
            keys: vec!["k".into()],
            exclude_nodes: vec![],
        })
        .await
        .expect_err("no Redis, no route");
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("unreachable"), "{err}");
    let err = c
        .heartbeat(v1::HeartbeatRequest { node_id: "n1".into(), ..Default::default() })
        .await
        .expect_err("no Redis, no heartbeat");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");

    // Redis comes back empty (persistence off): the master serves again, and the node it lost is
    // told UNKNOWN, which makes its client register again and full-sync.
    let _server = RedisServer::start_on(port);
    let hb = c
        .heartbeat(v1::HeartbeatRequest { node_id: "n1".into(), ..Default::default() })
        .await
        .expect("served again")
        .into_inner();
    assert_eq!(hb.status, v1::NodeStatus::Unknown as i32);
    c.register_client(register_request("n1")).await.expect("registers again");
    handle.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_whose_redis_hangs_answers_unavailable_within_the_client_deadline() {
    let server = RedisServer::start();
    let (handle, mut c) = master(&server.url(0)).await;
    c.register_client(register_request("n1")).await.expect("register");
    server.signal("-STOP");
    let started = Instant::now();
    let err = c
        .batch_route_get(v1::BatchRouteGetRequest {
            node_id: "r".into(),
            keys: vec!["k".into()],
            exclude_nodes: vec![],
        })
        .await
        .expect_err("a stopped Redis answers nothing");
    let took = started.elapsed();
    server.signal("-CONT");
    eprintln!("answered {:?} after {took:?}", err.code());
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(took < Duration::from_millis(2900), "inside a client's 3 s deadline: {took:?}");
    // Redis continues: the master serves again.
    c.heartbeat(v1::HeartbeatRequest { node_id: "n1".into(), ..Default::default() }).await.expect("served again");
    handle.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_masters_over_three_redis_shards_share_one_index_spread_over_them() {
    let servers: Vec<_> = (0..3).map(|_| RedisServer::start()).collect();
    let urls = servers.iter().map(|s| s.url(0)).collect::<Vec<_>>().join(",");
    let (first, mut c) = master(&urls).await;
    let (second, mut d) = master(&urls).await;
    c.register_client(v1::RegisterClientRequest {
        tier_capacities: vec![v1::TierCapacity {
            tier: DRAM,
            total_bytes: 1 << 30,
            available_bytes: 1 << 30,
            page_size: 0,
        }],
        ..register_request("n1")
    })
    .await
    .expect("register");
    let keys: Vec<String> = (0..128).map(|i| format!("key/{i:03}")).collect();
    let put = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "w".into(),
            keys: keys.clone(),
            block_sizes: vec![4096; keys.len()],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect("route put")
        .into_inner();
    assert!(put.entries.iter().all(|e| e.node_id == "n1"));
    let events = keys
        .iter()
        .map(|key| v1::KvEvent { kind: v1::KvEventKind::KvEventAdd as i32, key: key.clone(), tier: DRAM, size: 4096 })
        .collect();
    let hb = d
        .heartbeat(v1::HeartbeatRequest {
            node_id: "n1".into(),
            bundles: vec![v1::EventBundle { seq: 1, events }],
            ..Default::default()
        })
        .await
        .expect("heartbeat through the second master")
        .into_inner();
    assert_eq!((hb.acked_seq, hb.request_full_sync), (1, false));
    // Gets through the first master find every key; the keys spread over every Redis.
    let get = c
        .batch_route_get(v1::BatchRouteGetRequest { node_id: "r".into(), keys: keys.clone(), exclude_nodes: vec![] })
        .await
        .expect("route get")
        .into_inner();
    assert!(get.node_ref.iter().all(|&r| r > 0), "{:?}", get.node_ref);
    let per_shard: Vec<u64> = servers.iter().map(|s| s.store("umbp").key_count().expect("count")).collect();
    assert_eq!(per_shard.iter().sum::<u64>(), 128, "{per_shard:?}");
    assert!(per_shard.iter().all(|&n| n > 20), "spread: {per_shard:?}");
    let status = d.get_cluster_status(v1::GetClusterStatusRequest {}).await.expect("status").into_inner();
    assert_eq!((status.total_keys, status.nodes[0].key_count), (128, 128));
    first.shutdown().await;
    second.shutdown().await;
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock").as_millis() as u64
}

#[test]
fn two_masters_racing_one_registration_or_one_lease_exactly_one_wins() {
    let server = RedisServer::start();
    for round in 0..20 {
        let stores: Vec<Arc<dyn MetadataStore>> = (0..2).map(|_| Arc::new(server.store("umbp")) as _).collect();
        let barrier = Arc::new(Barrier::new(stores.len()));
        let node = format!("n{round}");
        let lease = format!("duties-{round}");
        let outcomes: Vec<(RegisterOutcome, bool)> = stores
            .iter()
            .enumerate()
            .map(|(i, store)| {
                let (store, barrier, node, lease) =
                    (Arc::clone(store), Arc::clone(&barrier), node.clone(), lease.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    let registered = store.register(registration(&node), now(), 30_000).expect("register");
                    let leased = store.acquire_lease(&lease, &format!("master-{i}"), now(), 10_000).expect("lease");
                    (registered, leased)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("racer"))
            .collect();
        let registered = outcomes.iter().filter(|(r, _)| *r == RegisterOutcome::Registered).count();
        let exists = outcomes.iter().filter(|(r, _)| *r == RegisterOutcome::AlreadyExists).count();
        assert_eq!((registered, exists), (1, 1), "round {round}: {outcomes:?}");
        assert_eq!(outcomes.iter().filter(|(_, l)| *l).count(), 1, "round {round}: {outcomes:?}");
    }
}
