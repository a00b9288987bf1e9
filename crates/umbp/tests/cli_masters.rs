//! Two `umbp master` processes on one `redis-server`, a node and clients given both addresses: a
//! master killed with SIGKILL in the middle of a put/get workload costs the workload an error window
//! under 5 s (measured and asserted), and no acknowledged key is lost; a Redis restarted empty is
//! rebuilt by the node without restarting any process, and the keys put before are read again.

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

const VALUE: usize = 4096;
/// How long after its put a key is read: several heartbeat intervals (0.5 s here), so the node's
/// report of it reached the index.
const VISIBLE_AFTER: Duration = Duration::from_millis(1500);

/// A `redis-server` on a free loopback port, persistence off, killed on drop.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start() -> Self {
        Self::start_on(TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port())
    }

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
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_master(dir: &std::path::Path, name: &str, redis: &Redis) -> (Proc, String) {
    let url = format!("redis://127.0.0.1:{}/0", redis.port);
    let args = ["master", "--listen", "127.0.0.1:0", "--metadata", &url, "--heartbeat-ttl", "1s"];
    let (proc, line) = Proc::try_start(dir, name, &args, &[], "master").unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    (proc, address)
}

/// The span from the first failed operation's start to the last one's end (zero without failures).
#[derive(Debug, Default)]
struct Window {
    first: Option<Instant>,
    last: Option<Instant>,
    failures: u32,
}

impl Window {
    fn fail(&mut self, started: Instant, what: &str, err: &dyn std::fmt::Display) {
        eprintln!("{what} failed after {:?}: {err}", started.elapsed());
        self.first.get_or_insert(started);
        self.last = Some(Instant::now());
        self.failures += 1;
    }

    fn span(&self) -> Duration {
        match (self.first, self.last) {
            (Some(first), Some(last)) => last - first,
            _ => Duration::ZERO,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_workload_costs_under_five_seconds_and_no_key() {
    let dir = TempDir::new("masters-kill");
    let redis = Redis::start();
    let (mut first, a) = start_master(&dir.0, "master-a", &redis);
    let (second, b) = start_master(&dir.0, "master-b", &redis);
    let list = format!("{a},{b}");
    // Pages of the value's size: every put of the run fits, nothing is evicted.
    let node_args = [
        "node",
        "--master",
        &list,
        "--node-id",
        "holder",
        "--medium",
        "dram",
        "--capacity",
        "256MiB",
        "--page-size",
        "4096",
        "--prefault",
        "false",
    ];
    let (_node, _) =
        Proc::try_start(&dir.0, "holder", &node_args, &[], "node holder").unwrap_or_else(|e| panic!("{e}"));
    let writer = PoolClient::start(PoolClientConfig::new("writer", list.clone())).await.expect("writer");
    let reader = PoolClient::start(PoolClientConfig::new("reader", list.clone())).await.expect("reader");

    let started = Instant::now();
    let mut acked: Vec<(String, Instant)> = Vec::new();
    let mut next_read = 0;
    let mut window = Window::default();
    let mut killed_at = None;
    let mut buf = vec![0u8; VALUE];
    let mut i = 0u32;
    // The longest single operation: a failover shows here even when nothing fails.
    let mut slowest = Duration::ZERO;
    while started.elapsed() < Duration::from_secs(8) {
        if killed_at.is_none() && started.elapsed() > Duration::from_secs(2) {
            first.kill9();
            killed_at = Some(Instant::now());
            eprintln!("killed master {a} after {} acknowledged puts", acked.len());
        }
        let key = format!("key-{i:05}");
        i += 1;
        let t = Instant::now();
        let put = writer.put(&key, &value(&key, VALUE)).await;
        slowest = slowest.max(t.elapsed());
        match put {
            Ok(()) => acked.push((key, Instant::now())),
            Err(e) => window.fail(t, "put", &e),
        }
        // Each acknowledged key is read once, by a client that never saw it: a routed get.
        if let Some((key, at)) = acked.get(next_read)
            && at.elapsed() >= VISIBLE_AFTER
        {
            let t = Instant::now();
            let got = reader.get(key, &mut buf).await;
            slowest = slowest.max(t.elapsed());
            match got {
                Ok(n) => {
                    assert_eq!(n as usize, VALUE, "{key}");
                    assert!(buf == value(key, VALUE), "{key}: other bytes than the value");
                }
                Err(e) => window.fail(t, "get", &e),
            }
            next_read += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let killed_at = killed_at.expect("the master was killed");
    let after_kill = acked.iter().filter(|(_, at)| *at > killed_at).count();
    eprintln!(
        "acknowledged {} puts ({after_kill} after the kill), {} failed operations, error window {:?}, slowest \
         operation {slowest:?}",
        acked.len(),
        window.failures,
        window.span()
    );
    assert!(slowest < Duration::from_secs(5), "an operation took {slowest:?}");
    assert!(after_kill > 0, "the workload went on after the kill");
    assert!(window.span() < Duration::from_secs(5), "error window {:?}", window.span());

    // No acknowledged key is lost: every one reads back through the surviving master.
    tokio::time::sleep(VISIBLE_AFTER).await;
    for (key, _) in &acked {
        let n = reader.get(key, &mut buf).await.unwrap_or_else(|e| panic!("{key} lost: {e}"));
        assert_eq!(n as usize, VALUE);
        assert!(buf == value(key, VALUE), "{key}");
    }
    // The killed master held the duty lease (it started first); the survivor took it over.
    let log = std::fs::read_to_string(&second.log).unwrap_or_default();
    assert!(log.contains("duty lease taken"), "master B never took the duty lease:\n{}", second.log_tail());
    writer.close().await;
    reader.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restarted_empty_is_rebuilt_without_restarting_any_process() {
    let dir = TempDir::new("masters-redis-restart");
    let mut redis = Redis::start();
    let port = redis.port;
    let (_first, a) = start_master(&dir.0, "master-a", &redis);
    let (_second, b) = start_master(&dir.0, "master-b", &redis);
    let list = format!("{a},{b}");
    let node_args = [
        "node",
        "--master",
        &list,
        "--node-id",
        "holder",
        "--medium",
        "dram",
        "--capacity",
        "64MiB",
        "--page-size",
        "4096",
        "--prefault",
        "false",
    ];
    let (_node, _) =
        Proc::try_start(&dir.0, "holder", &node_args, &[], "node holder").unwrap_or_else(|e| panic!("{e}"));
    let writer = PoolClient::start(PoolClientConfig::new("writer", list.clone())).await.expect("writer");
    let keys: Vec<String> = (0..200).map(|i| format!("before-{i:03}")).collect();
    for key in &keys {
        writer.put(key, &value(key, VALUE)).await.expect("put");
    }
    tokio::time::sleep(VISIBLE_AFTER).await;

    // Redis restarts with nothing (persistence off). No process restarts.
    drop(std::mem::replace(&mut redis, Redis::start()));
    redis = Redis::start_on(port);
    let restarted = Instant::now();
    // A reader that joins afterwards routes every get through the rebuilt index.
    let reader = PoolClient::start(PoolClientConfig::new("reader", list.clone())).await.expect("reader");
    let mut buf = vec![0u8; VALUE];
    let mut pending: Vec<&String> = keys.iter().collect();
    while !pending.is_empty() {
        assert!(
            restarted.elapsed() < Duration::from_secs(10),
            "{} keys still missing {:?} after the restart",
            pending.len(),
            restarted.elapsed()
        );
        let mut missing = Vec::new();
        for key in pending {
            match reader.get(key, &mut buf).await {
                Ok(n) => {
                    assert_eq!(n as usize, VALUE, "{key}");
                    assert!(buf == value(key, VALUE), "{key}: other bytes than the value");
                }
                Err(_) => missing.push(key),
            }
        }
        pending = missing;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    eprintln!("every key read again {:?} after the Redis restart", restarted.elapsed());
    writer.close().await;
    reader.close().await;
    drop(redis);
}
