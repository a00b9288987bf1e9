//! Routing over gRPC on loopback (issue 4, deliverable 5): `BatchRoutePut` of new keys (each one
//! checked routed) and `BatchRouteGet` of indexed ones, keys per second at batches of 1, 32, 128
//! and 1,024 from concurrent clients, beside a same-run baseline: the bare gRPC round trip of the
//! same batch shape through `BatchLookup` of indexed keys as long (the transport and codec floor;
//! the store's existence check is tens of nanoseconds per key).
//!
//! Run: `cargo bench -p umbp-master --bench grpc_routing`. `UMBP_BENCH_ROUNDS` (default 5) rounds of
//! `UMBP_BENCH_MILLIS` (default 500) per cell; medians. Target: ≥ 200 k keys/s at batch 128.

use std::time::{Duration, Instant};

use tonic::transport::Channel;
use umbp_master::MasterConfig;
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

const NODES: usize = 16;
const KEYS: usize = 100_000;
const CLIENTS: usize = 4;
/// A put's value size: small enough that the routes of a whole run (reserved against the nodes'
/// capacity until their next heartbeat, which this bench never sends) never fill the pool.
const VALUE: u64 = 4096;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Clone, Copy, PartialEq)]
enum Op {
    Put,
    Get,
    Lookup,
}

async fn one_call(c: &mut UmbpMasterClient<Channel>, op: Op, keys: Vec<String>) {
    let n = keys.len();
    match op {
        Op::Put => {
            let r = v1::BatchRoutePutRequest {
                node_id: "bench".into(),
                block_sizes: vec![VALUE; n],
                keys,
                exclude_nodes: vec![],
                columnar: true,
            };
            let reply = c.batch_route_put(r).await.expect("route put");
            let routed = reply.get_ref().outcome.iter().filter(|&&o| o == v1::RoutePutOutcome::RoutePutRouted as i32);
            assert_eq!(routed.count(), n, "every new key is routed");
        }
        Op::Get => {
            let r = v1::BatchRouteGetRequest { node_id: "bench".into(), keys, exclude_nodes: vec![] };
            let reply = c.batch_route_get(r).await.expect("route get");
            assert_eq!(reply.get_ref().node_ref.len(), n);
        }
        Op::Lookup => {
            let reply = c.batch_lookup(v1::BatchLookupRequest { keys }).await.expect("lookup");
            assert_eq!(reply.get_ref().found.len(), n);
        }
    }
}

/// Keys per second from `CLIENTS` concurrent clients for `budget`.
async fn rate(client: &UmbpMasterClient<Channel>, op: Op, batch: usize, budget: Duration) -> f64 {
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..CLIENTS {
        let mut c = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0u64;
            let mut i = t * 7919;
            while start.elapsed() < budget {
                // A put routes new keys, as long as the indexed ones (an indexed key is answered
                // "already exists", not routed).
                let keys: Vec<String> = match op {
                    Op::Put => (0..batch).map(|j| format!("key-{:08}", KEYS * (1 + t) + (i + j) % KEYS)).collect(),
                    Op::Get | Op::Lookup => (0..batch).map(|j| format!("key-{:08}", (i + j) % KEYS)).collect(),
                };
                i += batch;
                one_call(&mut c, op, keys).await;
                done += batch as u64;
            }
            done
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("client task");
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds = env_or("UMBP_BENCH_ROUNDS", 5).max(1);
    let budget = Duration::from_millis(env_or("UMBP_BENCH_MILLIS", 500));
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let config = MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() };
        let master = umbp_master::start(config).await.expect("master");
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", master.local_addr()))
            .expect("endpoint")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect");
        let mut client = UmbpMasterClient::new(channel);
        // 16 nodes with room, each holding 1/16 of the keys (so gets hit).
        let capacity = v1::TierCapacity { tier: v1::TierType::TierDram as i32, total_bytes: 1 << 40, available_bytes: 1 << 40, page_size: 0 };
        for n in 0..NODES {
            let node_id = format!("node-{n:02}");
            client
                .register_client(v1::RegisterClientRequest {
                    node_id: node_id.clone(),
                    node_address: "127.0.0.1".into(),
                    tier_capacities: vec![capacity],
                    peer_address: format!("127.0.0.1:{}", 20000 + n),
                    data_endpoint: String::new(),
                    tags: vec![],
                    incarnation: 0,
                })
                .await
                .expect("register");
            let events: Vec<v1::KvEvent> = (n..KEYS)
                .step_by(NODES)
                .map(|k| v1::KvEvent { kind: 0, key: format!("key-{k:08}"), tier: v1::TierType::TierDram as i32, size: 2 << 20 })
                .collect();
            client
                .heartbeat(v1::HeartbeatRequest {
                    node_id,
                    is_full_sync: true,
                    bundles: vec![v1::EventBundle { seq: 0, events }],
                    full_sync_final: true,
                    // A heartbeat's capacities replace the node's: one without them leaves it no
                    // medium, and every put unroutable.
                    tier_capacities: vec![capacity],
                    ..Default::default()
                })
                .await
                .expect("full sync");
        }
        println!("gRPC routing on 127.0.0.1: {CLIENTS} concurrent clients, {NODES} nodes, {KEYS} keys indexed; {rounds} rounds of {budget:?}; medians");
        println!();
        println!("| rpc | batch | keys/s | baseline keys/s (BatchLookup, same batch) | ratio |");
        println!("|---|---|---|---|---|");
        for (op, name) in [(Op::Put, "BatchRoutePut"), (Op::Get, "BatchRouteGet")] {
            for batch in [1usize, 32, 128, 1024] {
                let (mut ours, mut base) = (Vec::new(), Vec::new());
                for _ in 0..rounds {
                    ours.push(rate(&client, op, batch, budget).await);
                    base.push(rate(&client, Op::Lookup, batch, budget).await);
                }
                let (ours, base) = (median(ours), median(base));
                println!("| {name} | {batch} | {ours:.0} | {base:.0} | {:.2} |", ours / base);
            }
        }
        master.shutdown().await;
    });
}
