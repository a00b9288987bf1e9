//! The node-side external KV path against a real master on 127.0.0.1: changes queued with the
//! two-argument forms travel in the heartbeat's bundles, a restarted master gets the node's whole
//! external set back by the node's full sync (a revoke queued while it was down included), so does
//! a master whose Redis (or one shard of a sharded index) restarted empty, and the `PoolClient`
//! forms of a node that lends DRAM reach a scheduler's match. Every wait is bounded.

#[expect(dead_code, reason = "this binary uses only the node settings of the pool helpers")]
mod pool_support;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_core::TierType::{self, Dram, Hbm, Ssd};
use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::master_client::{MasterClient, MasterClientConfig, NodeRegistration};
use umbp_peer::pool_client::PoolClient;

fn master_config(addr: SocketAddr) -> MasterConfig {
    MasterConfig {
        listen: addr,
        heartbeat_ttl: Duration::from_millis(400),
        heartbeat_interval_divisor: 4,
        max_missed_heartbeats: 4,
        reaper_interval: Duration::from_millis(50),
        ..MasterConfig::default()
    }
}

async fn start_master(addr: SocketAddr) -> MasterHandle {
    umbp_master::start(master_config(addr)).await.expect("master starts")
}

async fn light(addr: SocketAddr, id: &str) -> MasterClient {
    let config = MasterClientConfig { rpc_timeout: Duration::from_secs(2), ..MasterClientConfig::default() };
    MasterClient::connect_light(&addr.to_string(), config, NodeRegistration::new(id, "127.0.0.1"))
        .await
        .expect("connect")
}

fn hashes(prefix: &str, range: std::ops::Range<usize>) -> Vec<String> {
    range.map(|i| format!("{prefix}{i}")).collect()
}

/// `(node, [(tier, hashes)])` per matching node.
type Matched = Vec<(String, Vec<(TierType, Vec<String>)>)>;

/// What a fresh scheduler client matches for `query`.
async fn matched(addr: SocketAddr, query: &[String]) -> Matched {
    let scheduler = light(addr, "scheduler").await;
    match scheduler.match_external_kv(query, false).await {
        Ok(m) => m.into_iter().map(|m| (m.node_id, m.hashes_by_tier)).collect(),
        Err(_) => Vec::new(),
    }
}

/// Waits (at most 10 s) until the master's match of `query` is `want`.
async fn until_matched(addr: SocketAddr, query: &[String], want: &Matched) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = matched(addr, query).await;
        if got == *want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the master's match stayed {got:?}, wanted {want:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_master_gets_the_nodes_external_set_back_from_the_node() {
    let master = start_master("127.0.0.1:0".parse().expect("addr")).await;
    let addr = master.local_addr();
    let node = light(addr, "engine").await;
    node.register().await.expect("register");
    node.start_heartbeat().expect("heartbeat");
    let query: Vec<String> = hashes("p", 0..6).into_iter().chain(hashes("q", 0..1)).collect();

    node.queue_external_kv_report(&hashes("p", 0..6), Hbm).expect("report");
    node.queue_external_kv_report(&hashes("p", 0..2), Dram).expect("report");
    node.queue_external_kv_revoke(&hashes("p", 5..6), Hbm).expect("revoke");
    let before = vec![("engine".to_owned(), vec![(Hbm, hashes("p", 0..5)), (Dram, hashes("p", 0..2))])];
    until_matched(addr, &query, &before).await;
    assert_eq!(node.stats().full_syncs_completed, 0, "the changes rode deltas");

    master.shutdown().await;
    // Changes while the master is down are not lost: a revoke and a report.
    node.queue_external_kv_revoke(&hashes("p", 4..5), Hbm).expect("revoke");
    node.queue_external_kv_report(&hashes("q", 0..1), Ssd).expect("report");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let master = start_master(addr).await;
    assert!(matched(addr, &query).await.is_empty(), "a restarted in-memory master starts empty");
    let after = vec![(
        "engine".to_owned(),
        vec![(Hbm, hashes("p", 0..4)), (Dram, hashes("p", 0..2)), (Ssd, hashes("q", 0..1))],
    )];
    until_matched(addr, &query, &after).await;
    assert!(node.stats().re_registrations >= 1 && node.stats().full_syncs_completed >= 1);
    assert_eq!(node.external_kv_block_count(), 7);

    // A wiped tier goes whole; leaving takes the rest along.
    node.queue_external_kv_revoke_all_at_tier(Hbm).expect("revoke all");
    let left = vec![("engine".to_owned(), vec![(Dram, hashes("p", 0..2)), (Ssd, hashes("q", 0..1))])];
    until_matched(addr, &query, &left).await;
    node.shutdown().await.expect("shutdown");
    assert!(matched(addr, &query).await.is_empty());
    assert!(node.queue_external_kv_report(&query, Hbm).is_err(), "a shut-down client queues nothing");
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_node_reports_through_its_heartbeat_and_a_light_client_is_refused() {
    let master = start_master("127.0.0.1:0".parse().expect("addr")).await;
    let addr = master.local_addr();
    let node = PoolClient::start(pool_support::config(&master, "dram-node", 4 << 20)).await.expect("node");
    let prompt = hashes("page-", 0..8);
    node.report_external_kv_blocks(&prompt[..6], Hbm).expect("report");
    node.revoke_external_kv_blocks(&prompt[4..6], Hbm).expect("revoke");
    until_matched(addr, &prompt, &vec![("dram-node".to_owned(), vec![(Hbm, prompt[..4].to_vec())])]).await;
    assert!(node.report_external_kv_blocks(&prompt, TierType::Unknown).is_err());
    assert!(node.report_external_kv_blocks(&[], Hbm).is_err());

    let mut light_config = umbp_peer::pool_client::PoolClientConfig::new("light", addr.to_string());
    light_config.page_size = pool_support::PAGE;
    let light = PoolClient::start(light_config).await.expect("light client");
    let err = light.report_external_kv_blocks(&prompt, Hbm).expect_err("a light client is not a node");
    assert!(err.to_string().contains("register"), "{err}");

    node.revoke_all_external_kv_blocks_at_tier(Hbm).expect("revoke all");
    until_matched(addr, &prompt, &Vec::new()).await;
    light.close().await;
    node.close().await;
    master.shutdown().await;
}

/// A `redis-server` on a loopback port, persistence off, killed on drop. A missing binary fails.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start_on(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is needed (apt-get install redis-server)");
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
        Self { child, port }
    }

    fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
        Self::start_on(port)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A node on a master over `shards` Redis processes restarts shard `restart` empty: the node's
/// heartbeat is answered UNKNOWN, it registers again, full-syncs and reports its set again.
async fn an_index_in_redis_is_rebuilt_after_a_restart(shards: usize, restart: usize) {
    let mut redis: Vec<Redis> = (0..shards).map(|_| Redis::start()).collect();
    let urls = redis.iter().map(Redis::url).collect::<Vec<_>>().join(",");
    let config = MasterConfig { metadata: Some(urls), ..master_config("127.0.0.1:0".parse().expect("addr")) };
    let master = umbp_master::start(config).await.expect("master on redis");
    let addr = master.local_addr();
    let node = light(addr, "engine").await;
    node.register().await.expect("register");
    node.start_heartbeat().expect("heartbeat");
    let held = hashes("p", 0..64);
    node.queue_external_kv_report(&held, Hbm).expect("report");
    node.queue_external_kv_revoke(&held[60..], Hbm).expect("revoke");
    let want = vec![("engine".to_owned(), vec![(Hbm, held[..60].to_vec())])];
    until_matched(addr, &held, &want).await;

    // The old process dies before the new one binds its port (persistence off: it starts empty).
    let old = redis.remove(restart);
    let port = old.port;
    drop(old);
    redis.insert(restart, Redis::start_on(port));
    until_matched(addr, &held, &want).await;
    assert!(node.stats().re_registrations >= 1, "{:?}", node.stats());
    node.shutdown().await.expect("shutdown");
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_redis_restart_the_index_is_rebuilt_from_the_node() {
    an_index_in_redis_is_rebuilt_after_a_restart(1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_one_shard_of_a_sharded_index_restarts_the_node_heals_it() {
    an_index_in_redis_is_rebuilt_after_a_restart(3, 2).await;
}
