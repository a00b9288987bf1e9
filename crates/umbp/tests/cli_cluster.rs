//! The `umbp` binary as real processes: a master and three DRAM nodes on free 127.0.0.1 ports,
//! driven by the client commands and by an in-test `PoolClient`. Also a node killed with SIGKILL
//! mid-workload (its keys become misses, no other key is affected, the master expires it) and a
//! master killed and restarted on the same port mid-workload (the nodes recover on their own).
//!
//! Every child is killed by a guard's `Drop`; every wait is bounded.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use umbp_peer::master_client::NodeLiveness;
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig};

mod cli_run;
mod cli_support;

use cli_run::{Out, cli, cli_with};
use cli_support::{Proc, TempDir, field, value};

const PAGE: &str = "64KiB";

/// Short heartbeats, so keys become visible and nodes recover quickly.
const FAST_HEARTBEATS: &[(&str, &str)] =
    &[("UMBP_HEARTBEAT_TTL_SEC", "1"), ("UMBP_MAX_MISSED_HEARTBEATS", "10"), ("UMBP_REAPER_INTERVAL_SEC", "1")];

impl Proc {
    /// Starts `umbp ARGS…` and waits for its ready line (`PREFIX … ready …`); returns the line.
    fn start(dir: &Path, name: &str, args: &[&str], env: &[(&str, &str)], ready: &str) -> (Self, String) {
        Self::try_start(dir, name, args, env, ready).unwrap_or_else(|e| panic!("{e}"))
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, then waits (bounded) for the exit status.
    fn terminate(&mut self) -> ExitStatus {
        let status = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status().expect("kill -TERM");
        assert!(status.success(), "kill -TERM {}", self.name);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(Instant::now() < deadline, "{} ignored SIGTERM:\n{}", self.name, self.log_tail());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A master and nodes as processes.
struct Cluster {
    master: Proc,
    address: String,
    nodes: Vec<Proc>,
    dir: PathBuf,
    env: Vec<(String, String)>,
}

impl Cluster {
    fn start(dir: &Path, nodes: usize, env: &[(&str, &str)]) -> Self {
        let (master, line) = Proc::start(dir, "master", &["master", "--listen", "127.0.0.1:0"], env, "master");
        let address = field(&line, "listen").to_owned();
        let mut cluster = Self {
            master,
            address,
            nodes: Vec::new(),
            dir: dir.to_owned(),
            env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        };
        for n in 1..=nodes {
            cluster.start_node(&format!("n{n}"));
        }
        cluster
    }

    fn env(&self) -> Vec<(&str, &str)> {
        self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
    }

    fn start_node(&mut self, id: &str) {
        let args = [
            "node",
            "--master",
            &self.address,
            "--node-id",
            id,
            "--medium",
            "dram",
            "--capacity",
            "64MiB",
            "--page-size",
            PAGE,
            "--prefault",
            "false",
        ];
        let (node, line) = Proc::start(&self.dir, id, &args, &self.env(), &format!("node {id}"));
        assert!(field(&line, "peer").starts_with("127.0.0.1:"), "peer address on loopback: {line}");
        assert!(field(&line, "data").starts_with("127.0.0.1:"), "data endpoint on loopback: {line}");
        assert_eq!(field(&line, "medium"), "dram", "{line}");
        self.nodes.push(node);
    }

    fn node(&mut self, id: &str) -> &mut Proc {
        self.nodes.iter_mut().find(|n| n.name == id).expect("node")
    }

    /// A client-only `PoolClient` in this process.
    async fn client(&self, id: &str) -> PoolClient {
        PoolClient::start(PoolClientConfig::new(id, self.address.clone())).await.expect("in-test client joins")
    }

    fn umbp(&self, command: &str, rest: &[&str], stdin: Option<&[u8]>) -> Out {
        let args: Vec<&str> =
            [command, "--master", self.address.as_str()].into_iter().chain(rest.iter().copied()).collect();
        cli(&args, stdin)
    }
}

/// Waits until the master's index says `present` for every key.
async fn until_indexed(client: &PoolClient, keys: &[String], present: bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(found) = client.master().batch_lookup(keys).await
            && found.iter().all(|f| *f == present)
        {
            return;
        }
        assert!(Instant::now() < deadline, "the master never saw the keys {}", if present { "arrive" } else { "go" });
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Puts `keys` (sizes cycle through sub-page, multi-page with a tail, and larger) and checks each.
async fn put_all(client: &PoolClient, keys: &[String]) -> Vec<Vec<u8>> {
    let sizes = [100usize, 3 * 65536 + 17, 1 << 20, 65536];
    let values: Vec<Vec<u8>> = keys.iter().enumerate().map(|(i, k)| value(k, sizes[i % sizes.len()])).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for (key, r) in keys.iter().zip(client.batch_put(&items).await) {
        r.unwrap_or_else(|e| panic!("put {key}: {e}"));
    }
    client.flush();
    values
}

/// Gets `keys` into buffers one byte larger than each value; `Ok(bytes)` or the key's error.
async fn get_all(client: &PoolClient, keys: &[String], lens: &[usize]) -> Vec<Result<Vec<u8>, KeyError>> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = lens.iter().map(|l| vec![0u8; l + 1]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let results = client.batch_get(&refs, &mut slices).await;
    results.into_iter().zip(bufs).map(|(r, b)| r.map(|n| b[..n as usize].to_vec())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_round_trip_bytes_through_the_cli_and_a_client() {
    let dir = TempDir::new("round-trip");
    let mut cluster = Cluster::start(&dir.0, 3, FAST_HEARTBEATS);

    // The CLI: put files of several shapes, get them back byte-exact, to a file and to stdout.
    let shapes =
        [("small", 100usize), ("multi-page-tail", 3 * 65536 + 17), ("large", (1 << 20) + 5), ("one-page", 65536)];
    for (name, len) in shapes {
        let path = dir.0.join(format!("{name}.in"));
        std::fs::write(&path, value(name, len)).expect("write input");
        let out = cluster.umbp("put", &[name, path.to_str().expect("utf-8")], None);
        assert_eq!(out.code, 0, "put {name}: {}", out.stderr);
        assert!(out.text().contains(&format!("stored {name}")), "{}", out.text());
    }
    let stdin_value = value("from-stdin", 5000);
    let out = cluster.umbp("put", &["from-stdin", "-"], Some(&stdin_value));
    assert_eq!(out.code, 0, "put from stdin: {}", out.stderr);
    for (name, len) in shapes {
        let path = dir.0.join(format!("{name}.out"));
        let out = cluster.umbp("get", &[name, path.to_str().expect("utf-8")], None);
        assert_eq!(out.code, 0, "get {name}: {}", out.stderr);
        assert!(std::fs::read(&path).expect("output file") == value(name, len), "{name}: bytes differ");
        let out = cluster.umbp("get", &[name], None);
        assert_eq!(out.code, 0, "get {name} to stdout: {}", out.stderr);
        assert!(out.stdout == value(name, len), "{name} on stdout: {} bytes, want {len}", out.stdout.len());
    }
    let out = cluster.umbp("get", &["from-stdin", "-"], None);
    assert!(out.code == 0 && out.stdout == stdin_value, "stdin round trip: {}", out.stderr);

    // Misses, exists, a too-small --max-size.
    let out = cluster.umbp("get", &["never-written", &dir.0.join("x.out").display().to_string()], None);
    assert_eq!(out.code, 1, "a miss exits 1: {}", out.stderr);
    assert!(out.stderr.contains("not found") && !dir.0.join("x.out").exists(), "{}", out.stderr);
    let out = cluster.umbp("exists", &["small", "large", "never-written"], None);
    assert_eq!(out.code, 1, "one key missing: {}", out.stderr);
    assert_eq!(out.text(), "present\tsmall\npresent\tlarge\nmissing\tnever-written\n");
    assert_eq!(cluster.umbp("exists", &["small", "large"], None).code, 0);
    let out = cluster.umbp("get", &["--max-size", "1KiB", "large"], None);
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(out.stderr.contains("--max-size"), "says how to fix it: {}", out.stderr);

    // An in-test client reads what the CLI wrote, and the CLI reads what it writes.
    let client = cluster.client("test-client").await;
    let names: Vec<String> = shapes.iter().map(|(n, _)| (*n).to_owned()).collect();
    let lens: Vec<usize> = shapes.iter().map(|(_, l)| *l).collect();
    for ((name, len), got) in shapes.iter().zip(get_all(&client, &names, &lens).await) {
        assert!(got.as_ref().is_ok_and(|v| *v == value(name, *len)), "client get {name}: {:?}", got.map(|v| v.len()));
    }
    let keys: Vec<String> = (0..24).map(|i| format!("client-key-{i}")).collect();
    let values = put_all(&client, &keys).await;
    until_indexed(&client, &keys, true).await;
    for i in [0, 1, 2, 7] {
        let out = cluster.umbp("get", &[&keys[i]], None);
        assert!(out.code == 0 && out.stdout == values[i], "cli get {}: {}", keys[i], out.stderr);
    }

    // stat: every node alive with its keys, the total.
    let out = cluster.umbp("stat", &[], None);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let text = out.text();
    for id in ["n1", "n2", "n3"] {
        let row = text.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("stat lists {id}:\n{text}"));
        assert!(row.contains("alive") && row.contains("dram") && row.contains("64 MiB"), "{row}");
    }
    assert!(!text.contains("test-client"), "the in-test client lends nothing: a light client, not listed:\n{text}");
    let total = 5 + keys.len();
    assert!(text.lines().next().is_some_and(|l| l.contains(&format!("{total} keys"))), "{text}");

    // rm: every replica goes (rm itself waits out a read lease the gets above may still hold); a
    // key no node held is `missing`, exit status 1.
    let out = cluster.umbp("rm", &["small", "never-written"], None);
    assert_eq!(out.code, 1, "one key was missing: {}", out.stderr);
    let lines: Vec<String> = out.text().lines().map(str::to_owned).collect();
    assert!(lines.len() == 2 && lines[0].starts_with("removed\tsmall\t"), "{lines:?}");
    assert_eq!(lines[1], "missing\tnever-written");
    assert_eq!(cluster.umbp("get", &["small"], None).code, 1, "removed: a miss");
    assert_eq!(cluster.umbp("exists", &["small"], None).code, 1);

    // A bad command line and a wrong master are clear errors, not hangs.
    assert_eq!(cli(&["put"], None).code, 2);
    let out = cli(&["get", "--master", "127.0.0.1:1", "k"], None);
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(out.stderr.contains("127.0.0.1:1"), "{}", out.stderr);

    // SIGTERM stops every process cleanly.
    client.close().await;
    for node in &mut cluster.nodes {
        let status = node.terminate();
        assert!(status.success(), "{} exited with {status}", node.name);
    }
    let status = cluster.master.terminate();
    assert!(status.success(), "master exited with {status}");
}

/// Counts of a background workload.
#[derive(Default)]
struct Tally {
    wrong_bytes: AtomicU64,
    survivor_failures: AtomicU64,
    rounds: AtomicU64,
    hits: AtomicU64,
}

/// Reads `keys` in a loop until `stop`: any wrong byte is counted, and so is any failure of a key
/// outside `fragile` (the keys a test expects to lose).
fn spawn_reader(
    client: Arc<PoolClient>,
    keys: Vec<String>,
    values: Vec<Vec<u8>>,
    fragile: Vec<bool>,
    stop: Arc<AtomicBool>,
    tally: Arc<Tally>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let lens: Vec<usize> = values.iter().map(Vec::len).collect();
        while !stop.load(Ordering::Relaxed) {
            for (i, got) in get_all(&client, &keys, &lens).await.into_iter().enumerate() {
                match got {
                    Ok(bytes) if bytes == values[i] => {
                        tally.hits.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        tally.wrong_bytes.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) if fragile[i] => {}
                    Err(_) => {
                        tally.survivor_failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            tally.rounds.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_workload_loses_only_its_keys_and_expires() {
    let dir = TempDir::new("kill9");
    let env = [("UMBP_HEARTBEAT_TTL_SEC", "1"), ("UMBP_MAX_MISSED_HEARTBEATS", "2"), ("UMBP_REAPER_INTERVAL_SEC", "1")];
    let mut cluster = Cluster::start(&dir.0, 3, &env);
    let client = Arc::new(cluster.client("kill-test-client").await);
    let keys: Vec<String> = (0..60).map(|i| format!("k9-{i}")).collect();
    let values = put_all(&client, &keys).await;
    until_indexed(&client, &keys, true).await;

    // Where each key lives, by the master's index.
    let routes = client.master().batch_route_get(&keys, &[]).await.expect("route");
    let holder: Vec<String> = routes.iter().map(|r| r.as_ref().expect("indexed").node_id.clone()).collect();
    let victim = "n2";
    let fragile: Vec<bool> = holder.iter().map(|h| h == victim).collect();
    let lost = fragile.iter().filter(|f| **f).count();
    assert!(lost > 0 && lost < keys.len(), "keys spread over the nodes: {holder:?}");

    // Readers run throughout; a writer keeps putting new keys, which re-route around the dead node.
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let reader = spawn_reader(
        Arc::clone(&client),
        keys.clone(),
        values.clone(),
        fragile.clone(),
        Arc::clone(&stop),
        Arc::clone(&tally),
    );
    let writer = {
        let (client, stop) = (Arc::clone(&client), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut written = Vec::new();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("k9-late-{n}");
                let v = value(&key, 70_000);
                client.put(&key, &v).await.unwrap_or_else(|e| panic!("put {key} with a node down: {e}"));
                written.push(key);
                n += 1;
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            written
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    cluster.node(victim).kill9();
    let killed = Instant::now();

    // The master expires it (TTL 1 s × 2 missed, reaper every 1 s).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let status = client.master().cluster_status().await.expect("status");
        let gone = status.nodes.iter().find(|n| n.node_id == victim).is_none_or(|n| n.status == NodeLiveness::Expired);
        if gone {
            break;
        }
        assert!(Instant::now() < deadline, "the master never expired {victim}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let expired_after = killed.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    reader.await.expect("reader");
    let late_keys = writer.await.expect("writer");

    eprintln!(
        "{victim} held {lost} of {} keys; expired {expired_after:?} after SIGKILL; {} read rounds, {} hits, {} late puts",
        keys.len(),
        tally.rounds.load(Ordering::Relaxed),
        tally.hits.load(Ordering::Relaxed),
        late_keys.len()
    );
    assert_eq!(tally.wrong_bytes.load(Ordering::Relaxed), 0, "a get returned wrong bytes");
    assert_eq!(tally.survivor_failures.load(Ordering::Relaxed), 0, "a key on a live node failed");
    assert!(tally.rounds.load(Ordering::Relaxed) >= 3, "the readers ran through the kill");
    assert!(expired_after < Duration::from_secs(10), "expired after {expired_after:?}");

    // After expiry: the victim's keys are plain misses, every other key is exact.
    let lens: Vec<usize> = values.iter().map(Vec::len).collect();
    for (i, got) in get_all(&client, &keys, &lens).await.into_iter().enumerate() {
        if fragile[i] {
            assert_eq!(got.err(), Some(KeyError::Miss), "{} was on {victim}", keys[i]);
        } else {
            assert!(got.as_ref().is_ok_and(|v| *v == values[i]), "{} on {}: {:?}", keys[i], holder[i], got.err());
        }
    }
    // Keys written while the node was dying: exact, or a miss if they had landed on it.
    let late_lens = vec![70_000; late_keys.len()];
    for (key, got) in late_keys.iter().zip(get_all(&client, &late_keys, &late_lens).await) {
        match got {
            Ok(v) => assert!(v == value(key, 70_000), "{key}: wrong bytes"),
            Err(e) => assert_eq!(e, KeyError::Miss, "{key}"),
        }
    }
    assert!(!late_keys.is_empty());

    // The CLI sees the same cluster.
    let out = cluster.umbp("stat", &[], None);
    let row = out.text().lines().find(|l| l.starts_with(victim)).map(str::to_owned).unwrap_or_default();
    assert!(row.is_empty() || row.contains("expired"), "stat shows {victim} expired:\n{}", out.text());
    let first_lost = keys.iter().zip(&fragile).find(|(_, f)| **f).map(|(k, _)| k.as_str()).expect("a lost key");
    let first_kept = keys.iter().zip(&fragile).find(|(_, f)| !**f).map(|(k, _)| k.clone()).expect("a kept key");
    assert_eq!(cluster.umbp("exists", &[first_lost], None).code, 1);
    let out = cluster.umbp("get", &[&first_kept], None);
    let i = keys.iter().position(|k| *k == first_kept).expect("index");
    assert!(out.code == 0 && out.stdout == values[i], "{}", out.stderr);
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_recovers_from_a_master_restart_without_restarting_nodes() {
    let dir = TempDir::new("restart");
    let mut cluster = Cluster::start(&dir.0, 3, FAST_HEARTBEATS);
    let node_pids: Vec<u32> = cluster.nodes.iter().map(Proc::pid).collect();
    let client = Arc::new(cluster.client("restart-test-client").await);
    let keys: Vec<String> = (0..40).map(|i| format!("mr-{i}")).collect();
    let values = put_all(&client, &keys).await;
    until_indexed(&client, &keys, true).await;

    // Readers run throughout: while the master is down gets fail (no route), never with wrong bytes.
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let fragile = vec![true; keys.len()];
    let reader =
        spawn_reader(Arc::clone(&client), keys.clone(), values.clone(), fragile, Arc::clone(&stop), Arc::clone(&tally));
    tokio::time::sleep(Duration::from_millis(300)).await;

    cluster.master.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let hits_before_restart = tally.hits.load(Ordering::Relaxed);
    // A new master on the same port (retrying while the old socket lingers).
    let listen = cluster.address.clone();
    let deadline = Instant::now() + Duration::from_secs(15);
    let master = loop {
        match Proc::try_start(&dir.0, "master-2", &["master", "--listen", &listen], &cluster.env(), "master") {
            Ok((proc, line)) => {
                assert_eq!(field(&line, "listen"), listen);
                break proc;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "the new master never started: {e}");
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    cluster.master = master;
    let restarted = Instant::now();

    // The nodes re-register and full-sync on their own: the new master learns every key again.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(status) = client.master().cluster_status().await {
            let alive =
                status.nodes.iter().filter(|n| n.node_id.starts_with('n') && n.status == NodeLiveness::Alive).count();
            if alive == 3 && status.total_keys >= keys.len() as u64 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "the nodes never re-registered with the new master");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let recovered_after = restarted.elapsed();
    eprintln!("the new master knew every node and key {recovered_after:?} after it started");
    until_indexed(&client, &keys, true).await;
    let hits_before_check = tally.hits.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    reader.await.expect("reader");
    assert_eq!(tally.wrong_bytes.load(Ordering::Relaxed), 0, "a get returned wrong bytes");
    assert!(tally.hits.load(Ordering::Relaxed) > hits_before_check, "reads succeed again after the restart");
    assert!(hits_before_restart > 0, "reads succeeded before the restart");

    // Every key reads back, new puts work, and the CLI works against the new master.
    let lens: Vec<usize> = values.iter().map(Vec::len).collect();
    for (i, got) in get_all(&client, &keys, &lens).await.into_iter().enumerate() {
        assert!(got.as_ref().is_ok_and(|v| *v == values[i]), "{} after the restart: {:?}", keys[i], got.err());
    }
    let fresh: Vec<String> = (0..12).map(|i| format!("mr-after-{i}")).collect();
    let fresh_values = put_all(&client, &fresh).await;
    until_indexed(&client, &fresh, true).await;
    let out = cluster.umbp("get", &[&fresh[1]], None);
    assert!(out.code == 0 && out.stdout == fresh_values[1], "{}", out.stderr);
    let out = cluster.umbp("stat", &[], None);
    assert_eq!(out.text().lines().filter(|l| l.contains("alive") && l.starts_with('n')).count(), 3, "{}", out.text());

    // The same node processes, never restarted.
    for (node, pid) in cluster.nodes.iter_mut().zip(node_pids) {
        assert!(node.running() && node.pid() == pid, "{} was restarted or died", node.name);
    }
    assert!(recovered_after < Duration::from_secs(15), "recovered after {recovered_after:?}");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_token_is_required_by_every_command() {
    let dir = TempDir::new("token");
    let env = [("UMBP_CLUSTER_TOKEN", "s3cret"), ("UMBP_HEARTBEAT_TTL_SEC", "1")];
    let cluster = Cluster::start(&dir.0, 1, &env);
    let master = cluster.address.as_str();

    // Without the token: refused, clearly, with the usual failure status.
    let out = cli(&["stat", "--master", master], None);
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(out.stderr.contains("token"), "says why: {}", out.stderr);
    let out = cli(&["put", "--master", master, "--token", "wrong", "k", "-"], Some(b"v"));
    assert_eq!(out.code, 3, "a wrong token is refused: {}", out.stderr);
    // A light client makes no call to start: its first call is the one refused.
    let light = PoolClient::start(PoolClientConfig::new("no-token", master)).await.expect("a light client starts");
    let err = light.exists("k").await.expect_err("no token");
    assert!(err.to_string().contains("token"), "{err}");
    light.close().await;
    // One that registers is refused at start.
    let mut listed = PoolClientConfig::new("no-token-listed", master);
    listed.register_client = true;
    let err = PoolClient::start(listed).await.expect_err("no token");
    assert!(err.to_string().contains("token"), "{err}");

    // With it, from the flag or from the environment.
    let out = cli(&["put", "--master", master, "--token", "s3cret", "k", "-"], Some(b"value"));
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = cli_with(&["get", "--master", master, "k"], None, &[("UMBP_CLUSTER_TOKEN", "s3cret")]);
    assert!(out.code == 0 && out.stdout == b"value", "{}", out.stderr);
    let mut config = PoolClientConfig::new("with-token", master);
    config.cluster_token = Some("s3cret".into());
    config.master.cluster_token = Some("s3cret".into());
    let client = PoolClient::start(config).await.expect("joins with the token");
    let mut buf = [0u8; 16];
    assert_eq!(client.get("k", &mut buf).await, Ok(5), "the data port accepts the token too");
    assert_eq!(&buf[..5], b"value");
    client.close().await;
}
