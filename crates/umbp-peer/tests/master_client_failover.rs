//! A master client given several masters (`a:50051,b:50051`) on one Redis: when the one it talks to
//! goes, calls fail over to the other and the heartbeat seq stream continues there (no full sync);
//! application errors never fail over; when Redis restarts empty, the node re-registers and
//! full-syncs by itself and its keys are found again, and so when one shard of a sharded index
//! (the directory or another) restarts.

mod master_client_support;

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use master_client_support::{commit, keys, node, page_backend, registry, test_config};
use umbp_core::TierType;
use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::master_client::{MasterClient, MasterClientError};

const PAGE: u64 = 4096;

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
        Self::start_on(free_port())
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port()
}

async fn master(url: &str) -> MasterHandle {
    let config = MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        metadata: Some(url.to_owned()),
        ..MasterConfig::default()
    };
    umbp_master::start(config).await.expect("master on redis")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_fail_over_to_the_other_master_and_the_seq_stream_continues() {
    let redis = Redis::start();
    let (first, second) = (master(&redis.url()).await, master(&redis.url()).await);
    let (a, b) = (first.local_addr().to_string(), second.local_addr().to_string());
    let dram = page_backend(TierType::Dram, PAGE, 256);
    let client = MasterClient::connect(&format!("{a}, {b}"), test_config(), node(), registry(&[Arc::clone(&dram)]))
        .await
        .expect("connect");
    client.register().await.expect("register");
    assert_eq!(client.current_master(), a);

    let before = keys("before", 32);
    commit(&dram, &before);
    client.heartbeat_once().await.expect("delta to the first master");
    let acked = client.stats().acked_seq;
    assert!(acked >= 1);

    first.shutdown().await;
    let after = keys("after", 32);
    commit(&dram, &after);
    let started = Instant::now();
    client.heartbeat_once().await.expect("the delta goes to the second master");
    eprintln!("failover took {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(2));
    let stats = client.stats();
    assert_eq!(client.current_master(), b);
    assert_eq!(stats.failovers, 1);
    assert_eq!(stats.acked_seq, acked + 1, "the same seq stream, one bundle on");
    assert_eq!(stats.full_syncs_started, 0, "no full sync: the store kept the seq");
    let all: Vec<String> = before.iter().chain(&after).cloned().collect();
    assert!(client.batch_lookup(&all).await.expect("lookup").iter().all(|f| *f));

    // An application error is the same on every master: no failover, no retry.
    let err = client.batch_route_put(&[String::new()], &[1], &[]).await.expect_err("an empty key");
    assert!(matches!(err, MasterClientError::Rpc { ref status, .. } if status.code() == tonic::Code::InvalidArgument));
    assert_eq!(client.stats().failovers, 1);
    second.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_starts_when_only_a_later_master_of_its_list_is_up() {
    let redis = Redis::start();
    let up = master(&redis.url()).await;
    let down = format!("127.0.0.1:{}", free_port());
    let list = format!("{down},{}", up.local_addr());
    let client = MasterClient::connect(&list, test_config(), node(), registry(&[])).await.expect("connect");
    client.register().await.expect("register through the master that is up");
    assert_eq!(client.current_master(), up.local_addr().to_string());
    for bad in ["", "a:1,,b:2"] {
        assert!(matches!(
            MasterClient::connect(bad, test_config(), node(), registry(&[])).await,
            Err(MasterClientError::InvalidArgument(_))
        ));
    }
    up.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_redis_restart_the_node_registers_again_and_its_keys_are_found() {
    let redis = Redis::start();
    let port = redis.port;
    let master = master(&redis.url()).await;
    let dram = page_backend(TierType::Dram, PAGE, 256);
    let client =
        MasterClient::connect(&master.local_addr().to_string(), test_config(), node(), registry(&[Arc::clone(&dram)]))
            .await
            .expect("connect");
    client.register().await.expect("register");
    let put = keys("k", 64);
    commit(&dram, &put);
    client.heartbeat_once().await.expect("delta");
    assert!(client.batch_lookup(&put).await.expect("lookup").iter().all(|f| *f));

    // Redis restarts with nothing (persistence off): the index is gone.
    drop(redis);
    let _redis = Redis::start_on(port);
    assert!(client.batch_lookup(&put).await.expect("lookup").iter().all(|f| !*f), "the index is gone");

    // No node restarts: the next heartbeat is answered UNKNOWN, the client registers again and
    // full-syncs, and every key put before is found again.
    let started = Instant::now();
    while !client.batch_lookup(&put).await.expect("lookup").iter().all(|f| *f) {
        assert!(started.elapsed() < Duration::from_secs(5), "the index was not rebuilt: {:?}", client.stats());
        let _ = client.heartbeat_once().await;
    }
    let stats = client.stats();
    assert_eq!(stats.re_registrations, 1, "{stats:?}");
    assert!(stats.full_syncs_completed >= 1, "{stats:?}");
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_one_shard_of_a_sharded_index_restarts_the_node_heals_it() {
    let mut shards: Vec<Redis> = (0..3).map(|_| Redis::start()).collect();
    let urls = shards.iter().map(Redis::url).collect::<Vec<_>>().join(",");
    let master = master(&urls).await;
    let dram = page_backend(TierType::Dram, PAGE, 256);
    let client =
        MasterClient::connect(&master.local_addr().to_string(), test_config(), node(), registry(&[Arc::clone(&dram)]))
            .await
            .expect("connect");
    client.register().await.expect("register");
    let put = keys("k", 96);
    commit(&dram, &put);
    client.heartbeat_once().await.expect("delta");
    assert!(client.batch_lookup(&put).await.expect("lookup").iter().all(|f| *f));

    // A key shard restarts empty, then the directory: each time the keys it held are gone until the
    // node, told by the combined heartbeat reply, registers again or full-syncs.
    for shard in [2, 0] {
        let port = shards[shard].port;
        shards[shard] = {
            drop(std::mem::replace(&mut shards[shard], Redis::start()));
            Redis::start_on(port)
        };
        let started = Instant::now();
        loop {
            let found = client.batch_lookup(&put).await;
            if found.as_ref().is_ok_and(|f| f.iter().all(|f| *f)) {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(5), "shard {shard}: not healed: {:?}", client.stats());
            let _ = client.heartbeat_once().await;
        }
        eprintln!("shard {shard} healed after {:?}: {:?}", started.elapsed(), client.stats());
    }
    assert!(client.stats().full_syncs_completed >= 2);
    master.shutdown().await;
}
