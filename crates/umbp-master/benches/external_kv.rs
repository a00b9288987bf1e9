//! `match_external_kv` of 1,024 hashes at the master (issue 21, item 2; target ≤ 1 ms): in the
//! in-memory store (the call alone) and over gRPC on loopback (one client, one call at a time: the
//! latency a scheduler sees), uncounted and counted. The gRPC cells have a same-run baseline: a
//! `BatchLookup` of the same 1,024 strings (the transport and codec floor of that request; the
//! key index is empty, so its store work is nil).
//!
//! The index: 16 nodes, each holding 8,192 hashes on HBM and the first 2,048 of them mirrored on
//! DRAM; nodes share halves of their ranges, so a matched hash has two holders. A query is a prompt
//! of 1,024 hashes of which 768 are held (a 768-block prefix) and 256 are misses.
//!
//! With `UMBP_BENCH_REDIS_URL` (a running Redis, e.g. `redis://127.0.0.1:6379/15`; its keys under
//! the prefix `umbp-bench-external` are replaced) the store cells run on a `RedisStore` too.
//!
//! Run: `cargo bench -p umbp-master --bench external_kv`. `UMBP_BENCH_ROUNDS` (default 5) rounds of
//! `UMBP_BENCH_CALLS` (default 200) calls per cell; per round the median latency, then the median
//! and the spread of the rounds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::TierType;
use umbp_master::MasterConfig;
use umbp_master::store::{InMemoryStore, MetadataStore, RedisStore, RedisTimeouts, Registration};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

const NODES: usize = 16;
const PER_NODE: usize = 8_192;
const MIRRORED: usize = 2_048;
const QUERY: usize = 1_024;
const HELD: usize = 768;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn hash(i: usize) -> String {
    format!("{:064x}", (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Node `n` holds hashes `[n * PER_NODE / 2, n * PER_NODE / 2 + PER_NODE)`.
fn node_hashes(n: usize) -> Vec<String> {
    let start = n * PER_NODE / 2;
    (start..start + PER_NODE).map(hash).collect()
}

/// A prompt whose first `HELD` hashes node 3 (and node 2 or 4) holds, then misses.
fn query() -> Vec<String> {
    let start = 3 * PER_NODE / 2;
    (start..start + HELD).map(hash).chain((0..QUERY - HELD).map(|i| format!("miss-{i}"))).collect()
}

fn fill(store: &dyn MetadataStore) {
    let now = umbp_now();
    for n in 0..NODES {
        let id = format!("node-{n:02}");
        let reg = Registration { node_id: id.clone(), peer_address: format!("10.0.0.{n}:7000"), ..Default::default() };
        store.register(reg, now, 30_000).expect("register");
        let hashes = node_hashes(n);
        store.report_external_kv(&id, &hashes, TierType::Hbm).expect("report");
        store.report_external_kv(&id, &hashes[..MIRRORED], TierType::Dram).expect("report");
    }
}

fn umbp_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn report(label: &str, mut rounds: Vec<Duration>) {
    let med = median(&mut rounds);
    let (lo, hi) = (rounds[0], rounds[rounds.len() - 1]);
    println!(
        "{label:<44} median {:>8.1} µs  (rounds {:.1}–{:.1} µs)",
        med.as_secs_f64() * 1e6,
        lo.as_secs_f64() * 1e6,
        hi.as_secs_f64() * 1e6
    );
}

fn main() {
    let rounds = env_or("UMBP_BENCH_ROUNDS", 5) as usize;
    let calls = env_or("UMBP_BENCH_CALLS", 200) as usize;
    let q = query();

    let memory = InMemoryStore::new();
    let mut stores: Vec<(&str, Box<dyn MetadataStore>)> = vec![("in-memory store", Box::new(memory))];
    if let Ok(url) = std::env::var("UMBP_BENCH_REDIS_URL") {
        let redis = RedisStore::connect_with(&url, "umbp-bench-external", RedisTimeouts::default()).expect("redis");
        for n in 0..NODES {
            redis.unregister(&format!("node-{n:02}")).expect("clean");
        }
        stores.push(("Redis store", Box::new(redis)));
    }
    for (name, store) in &stores {
        store_cells(name, &**store, &q, rounds, calls);
    }
    grpc_cells(&q, rounds, calls);
}

/// The store alone: `match_external_kv` of `q`, uncounted then counted.
fn store_cells(name: &str, store: &dyn MetadataStore, q: &[String], rounds: usize, calls: usize) {
    fill(store);
    assert_eq!(store.match_external_kv(q, false).expect("match").len(), 2, "two nodes hold the prefix");
    for count in [false, true] {
        let per_round: Vec<Duration> = (0..rounds)
            .map(|_| {
                let mut lat: Vec<Duration> = (0..calls)
                    .map(|_| {
                        let t = Instant::now();
                        let m = store.match_external_kv(q, count).expect("match");
                        let took = t.elapsed();
                        assert_eq!(m.len(), 2);
                        took
                    })
                    .collect();
                median(&mut lat)
            })
            .collect();
        report(&format!("{name}, 1024 hashes, count_as_hit={count}"), per_round);
    }
}

/// Over gRPC on loopback: one client, one call at a time.
fn grpc_cells(q: &[String], rounds: usize, calls: usize) {
    let q = q.to_vec();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let config = MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() };
        let master = umbp_master::start(config).await.expect("master");
        let shared: Arc<dyn MetadataStore> = Arc::clone(master.store());
        tokio::task::spawn_blocking(move || fill(&*shared)).await.expect("fill");
        let mut c = UmbpMasterClient::connect(format!("http://{}", master.local_addr())).await.expect("connect");
        // Rounds of the three cells interleave, so noise hits them alike.
        let mut per_cell: [Vec<Duration>; 3] = Default::default();
        for _ in 0..rounds {
            for (cell, rounds_of_cell) in per_cell.iter_mut().enumerate() {
                let mut lat = Vec::with_capacity(calls);
                for _ in 0..calls {
                    let (hashes, count_as_hit) = (q.clone(), cell == 1);
                    let t = Instant::now();
                    if cell == 2 {
                        let reply = c.batch_lookup(v1::BatchLookupRequest { keys: hashes }).await.expect("lookup");
                        lat.push(t.elapsed());
                        assert_eq!(reply.get_ref().found.len(), QUERY);
                    } else {
                        let request = v1::MatchExternalKvRequest { hashes, count_as_hit };
                        let reply = c.match_external_kv(request).await.expect("match");
                        lat.push(t.elapsed());
                        assert_eq!(reply.get_ref().matches.len(), 2);
                    }
                }
                rounds_of_cell.push(median(&mut lat));
            }
        }
        let [uncounted, counted, lookup] = per_cell;
        report("gRPC on loopback, 1024 hashes, count_as_hit=false", uncounted);
        report("gRPC on loopback, 1024 hashes, count_as_hit=true", counted);
        report("baseline: gRPC BatchLookup of the same 1024", lookup);
        master.shutdown().await;
    });
}
