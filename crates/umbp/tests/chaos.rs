//! Chaos: real processes on loopback — a master, two DRAM nodes and an SSD node, three
//! `umbp chaos-client` processes — under a seeded random schedule of `kill -9` and restart of nodes
//! and of the master, and SIGSTOP/SIGCONT pauses (some long enough for the master to expire the
//! node), while the small DRAM nodes run full and evict. A checker then verifies:
//!
//! 1. **Integrity**: no get returned bytes other than those put under its key (each client checks
//!    every value it reads — key, length, hash and payload — and the checker ties each hit's digest
//!    to the logged put of that key); a final sweep reads every key once more.
//! 2. **SSD durability**: after each `kill -9` of the SSD node and its restart on its directory,
//!    every put it acknowledged at least [`HOLE_GRACE_MS`] before the kill (and that the master had
//!    routed to it before the kill), and every key found there at the previous restart, is routed to
//!    it again — unless the node counted at least as many evictions (its own LRU and the master's)
//!    since the oldest missing key was acknowledged as there are missing keys.
//! 3. **Convergence** within [`CONVERGE_BOUND`] after the last fault and the last client: every
//!    live node is alive at its current address, the node left dead is expired and never routed
//!    to, and each live node's keys (asked of the node itself) are exactly the keys the master
//!    indexes for it.
//!
//! `UMBP_CHAOS_SEED` replays a schedule (the faults, their order, targets and delays — not the
//! threads' interleaving); `UMBP_CHAOS_SECS` sets how long faults are injected (default
//! [`DEFAULT_SECS`]; past about 60 s use `cargo test`, beyond nextest's 2-minute limit);
//! `UMBP_CHAOS_KEEP=1` keeps a passing run's logs; `UMBP_CHAOS_BREAK=ssd-wipe` deletes the SSD
//! directory before each restart (the negative control: the test must fail). The seed is printed
//! first. See docs/reliability.md ("Chaos").

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use umbp::chaos::{GetResult, PutResult, Record, SplitMix64, check_value, now_ms};
use umbp_peer::master_client::NodeLiveness;
use umbp_peer::peer_client::{LeaseRelease, PeerClientConfig, Peers};
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

/// Client processes.
const CLIENTS: u32 = 3;
/// Seconds of faults by default (the whole test then takes about 100 s on a 2-core machine).
const DEFAULT_SECS: u64 = 45;
/// A put acknowledged this close to the SSD node's kill may lie behind a write still in flight
/// (the SSD log's hole rule, docs/ssd.md "Durability"): not checked.
const HOLE_GRACE_MS: u64 = 500;
/// How long after the faults and the clients stop the cluster has to converge. Expiry takes
/// 2 s × 3 missed heartbeats plus a reaper pass; the rest is a full sync and the check itself.
const CONVERGE_BOUND: Duration = Duration::from_secs(25);
/// How long the nodes may take to be alive again after a master restart or a pause (a heartbeat
/// is due every second; the master answers an unknown or expired node's heartbeat with "register
/// again").
const REJOIN_BOUND: Duration = Duration::from_secs(10);
/// Which node stays dead at the end (so expiry and routing around it are checked).
const LEFT_DEAD: usize = 1;
/// The master's and nodes' settings: heartbeats every second, expiry after 6 s of silence, the
/// eviction check every second, puts spread at random (so the small DRAM nodes fill while the SSD
/// node takes its share), and a node ships each key event at once (so the master indexes a put
/// within milliseconds, and the SSD check sees what the node acknowledged before a kill).
const ENV: &[(&str, &str)] = &[
    ("UMBP_HEARTBEAT_TTL_SEC", "2"),
    ("UMBP_MAX_MISSED_HEARTBEATS", "3"),
    ("UMBP_REAPER_INTERVAL_SEC", "1"),
    ("UMBP_EVICTION_CHECK_INTERVAL_SEC", "1"),
    ("UMBP_ROUTE_PUT_SELECT_ALGO", "random"),
    ("UMBP_AUTO_FLUSH_EVENT_THRESHOLD", "1"),
];

/// A node of the cluster and its current process.
struct Node {
    id: &'static str,
    ssd: bool,
    proc: Option<Proc>,
    peer: String,
    metrics: String,
    starts: u32,
}

/// One fault of the schedule.
#[derive(Debug, Clone)]
enum Fault {
    /// `kill -9` a node, restart it after `down_ms` (an SSD node on its directory).
    KillNode { node: usize, down_ms: u64 },
    /// `kill -9` the master, restart it on its port after `down_ms`.
    KillMaster { down_ms: u64 },
    /// SIGSTOP a node (`Some`) or the master (`None`) for `ms`, then SIGCONT.
    Pause { node: Option<usize>, ms: u64 },
}

/// The schedule of `seed`: faults with the gap before each, about `secs` seconds of them. It
/// always kills the SSD node and the master at least once.
fn schedule(seed: u64, secs: u64, nodes: usize, ssd: usize) -> Vec<(u64, Fault)> {
    let mut rng = SplitMix64(seed);
    let mut out = Vec::new();
    let mut t = 0;
    while t < secs * 1000 || out.len() < 4 {
        let gap = rng.range(300, 2500);
        let fault = match rng.range(0, 100) {
            0..35 => Fault::KillNode { node: rng.range(0, nodes as u64) as usize, down_ms: rng.range(0, 2000) },
            35..45 => Fault::KillMaster { down_ms: rng.range(0, 1500) },
            45..85 => Fault::Pause { node: Some(rng.range(0, nodes as u64) as usize), ms: rng.range(200, 8000) },
            _ => Fault::Pause { node: None, ms: rng.range(200, 8000) },
        };
        // A restart takes about a second and a half of its own.
        t += gap
            + match &fault {
                Fault::KillNode { down_ms, .. } | Fault::KillMaster { down_ms } => down_ms + 1500,
                Fault::Pause { ms, .. } => *ms,
            };
        out.push((gap, fault));
    }
    if !out.iter().any(|(_, f)| matches!(f, Fault::KillNode { node, .. } if *node == ssd)) {
        out[1].1 = Fault::KillNode { node: ssd, down_ms: 500 };
    }
    if !out.iter().any(|(_, f)| matches!(f, Fault::KillMaster { .. })) {
        out[3].1 = Fault::KillMaster { down_ms: 500 };
    }
    out
}

/// Keeps the test's directory (moved beside it, and named) when the test fails, or always with
/// `UMBP_CHAOS_KEEP=1`; dropped before the [`TempDir`] that removes it otherwise.
struct KeepOnFailure(PathBuf);

impl Drop for KeepOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var("UMBP_CHAOS_KEEP").is_ok_and(|v| v == "1") {
            let kept = self.0.with_extension("kept");
            let _ = std::fs::remove_dir_all(&kept);
            if std::fs::rename(&self.0, &kept).is_ok() {
                eprintln!("chaos: logs kept in {}", kept.display());
            }
        }
    }
}

/// Each node's eviction counter (its medium's own LRU victims plus the master's evictions it
/// carried out), sampled: (time, node, process start number, count).
type Samples = Arc<Mutex<Vec<(u64, usize, u32, u64)>>>;

/// `GET /metrics` of `addr`, summed over the eviction series; `None` if it does not answer.
fn scrape_evictions(addr: &str) -> Option<u64> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    s.set_write_timeout(Some(Duration::from_millis(500))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: chaos\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    if !body.starts_with("HTTP/1.") || !body.contains("umbp_backend") {
        return None;
    }
    let counted = |l: &&str| {
        (l.starts_with("umbp_backend_ops_total{") && l.contains("op=\"evict\"") && l.contains("status=\"ok\""))
            || (l.starts_with("umbp_backend_medium_events_total{") && l.contains("event=\"eviction_victim\""))
    };
    Some(body.lines().filter(counted).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum::<f64>() as u64)
}

/// Per node, while it runs: its process start number and metrics address.
type Targets = Arc<Mutex<Vec<Option<(u32, String)>>>>;

/// Evictions that `node`'s process `start` counted after `from` (ms): its last sample minus its
/// last sample at or before `from` (zero before its first).
fn evictions_since(samples: &Samples, node: usize, start: u32, from: u64) -> u64 {
    let s = samples.lock().expect("samples");
    let of: Vec<_> = s.iter().filter(|x| x.1 == node && x.2 == start).collect();
    let last = of.last().map_or(0, |x| x.3);
    let before = of.iter().rev().find(|x| x.0 <= from).map_or(0, |x| x.3);
    last - before
}

/// Everything the clients logged, in order per client.
fn read_logs(dir: &Path) -> Vec<Record> {
    let mut out = Vec::new();
    for c in 0..CLIENTS {
        let text = std::fs::read_to_string(dir.join(format!("client-{c}.log"))).unwrap_or_default();
        // A line being written as we read is left for the next read.
        let complete = text.rfind('\n').map_or("", |i| &text[..i]);
        for line in complete.lines() {
            out.push(line.parse().unwrap_or_else(|e| panic!("client {c}: {e}")));
        }
    }
    out
}

struct Chaos {
    dir: PathBuf,
    replay: String,
    master: Option<Proc>,
    master_addr: String,
    master_starts: u32,
    nodes: Vec<Node>,
    samples: Samples,
    /// Each node's start number and metrics address while it runs, for the sampler.
    sampled: Targets,
    rt: tokio::runtime::Runtime,
    client: Option<PoolClient>,
    /// Keys found on the SSD node at its last start (checked again at the next).
    ssd_present: HashSet<String>,
    /// When the SSD node's current process was ready (ms).
    ssd_ready: u64,
    /// When its previous process was ready: puts acknowledged after it and found on it before the
    /// kill are what the restart must bring back.
    ssd_prev_ready: u64,
    ssd_checked: usize,
    ssd_missing: usize,
    /// The longest wait for every node to be alive after a restart of the master or a pause.
    rejoin_max: Duration,
}

impl Chaos {
    /// Prints `what` and appends it to `faults.log` (kept with the logs when the test fails).
    fn note(&mut self, what: String) {
        let line = format!("{} {what}", now_ms());
        eprintln!("chaos: {line}");
        let file = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join("faults.log"));
        if let Ok(mut f) = file {
            let _ = writeln!(f, "{line}");
        }
    }

    fn start_master(&mut self) {
        let listen = if self.master_addr.is_empty() { "127.0.0.1:0".to_owned() } else { self.master_addr.clone() };
        self.master_starts += 1;
        let name = format!("master-{}", self.master_starts);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match Proc::try_start(&self.dir, &name, &["master", "--listen", &listen], ENV, "master") {
                Ok((proc, line)) => {
                    self.master_addr = field(&line, "listen").to_owned();
                    self.master = Some(proc);
                    return;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "{}: the master did not start: {e}", self.replay);
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    fn start_node(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        n.starts += 1;
        let name = format!("{}-{}", n.id, n.starts);
        let ssd_dir = self.dir.join("ssd");
        if n.ssd && n.starts > 1 && std::env::var("UMBP_CHAOS_BREAK").is_ok_and(|b| b == "ssd-wipe") {
            // The negative control: a restart that loses the drive must fail the SSD check.
            let _ = std::fs::remove_dir_all(&ssd_dir);
        }
        let ssd_dir = ssd_dir.to_str().expect("utf-8 path").to_owned();
        let mut args = vec!["node", "--master", &self.master_addr, "--node-id", n.id, "--page-size", "64KiB"];
        args.extend(["--metrics-addr", "127.0.0.1:0"]);
        if n.ssd {
            args.extend(["--medium", "ssd", "--ssd-dir", &ssd_dir, "--ssd-capacity", "32MiB"]);
            args.extend(["--ssd-staging-pages", "64", "--ssd-create-dirs"]);
        } else {
            args.extend(["--medium", "dram", "--capacity", "4MiB", "--prefault", "false"]);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        let (proc, line) = loop {
            match Proc::try_start(&self.dir, &name, &args, ENV, &format!("node {}", n.id)) {
                Ok(started) => break started,
                Err(e) => {
                    assert!(Instant::now() < deadline, "{}: {} did not start: {e}", self.replay, n.id);
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
        };
        n.peer = field(&line, "peer").to_owned();
        n.metrics = field(&line, "metrics").to_owned();
        n.proc = Some(proc);
        self.sampled.lock().expect("sampled")[i] = Some((n.starts, n.metrics.clone()));
        if n.ssd {
            self.ssd_prev_ready = self.ssd_ready;
            self.ssd_ready = now_ms();
        }
    }

    fn signal(&self, pid: u32, sig: &str) {
        let ok = Command::new("kill").args([sig, &pid.to_string()]).status().is_ok_and(|s| s.success());
        assert!(ok, "{}: kill {sig} {pid}", self.replay);
    }

    fn pid(proc: Option<&Proc>) -> u32 {
        proc.expect("a running process").child.id()
    }

    fn run(&mut self, fault: &Fault) {
        match *fault {
            Fault::KillNode { node, down_ms } => {
                let ssd = self.nodes[node].ssd;
                // The last count before the kill: evictions after it are what a restart may miss.
                let (start, addr) = (self.nodes[node].starts, self.nodes[node].metrics.clone());
                self.sampled.lock().expect("sampled")[node] = None;
                if let Some(e) = scrape_evictions(&addr) {
                    self.samples.lock().expect("samples").push((now_ms(), node, start, e));
                }
                let t_kill = now_ms();
                self.nodes[node].proc.as_mut().expect("node").kill9();
                self.nodes[node].proc = None;
                self.note(format!("kill -9 {} (down {down_ms} ms)", self.nodes[node].id));
                std::thread::sleep(Duration::from_millis(down_ms));
                self.start_node(node);
                self.note(format!("restarted {}", self.nodes[node].id));
                if ssd {
                    self.check_ssd_restart(t_kill);
                }
            }
            Fault::KillMaster { down_ms } => {
                self.master.as_mut().expect("master").kill9();
                self.master = None;
                self.note(format!("kill -9 master (down {down_ms} ms)"));
                std::thread::sleep(Duration::from_millis(down_ms));
                self.start_master();
                self.note("restarted master".to_owned());
                self.until_nodes_rejoin("the master's restart");
            }
            Fault::Pause { node, ms } => {
                let (name, pid) = match node {
                    Some(i) => (self.nodes[i].id.to_owned(), Self::pid(self.nodes[i].proc.as_ref())),
                    None => ("master".to_owned(), Self::pid(self.master.as_ref())),
                };
                self.signal(pid, "-STOP");
                self.note(format!("SIGSTOP {name} for {ms} ms"));
                std::thread::sleep(Duration::from_millis(ms));
                self.signal(pid, "-CONT");
                self.note(format!("SIGCONT {name}"));
                // Past the expiry a paused node, or every node of a paused master's, is expired:
                // each registers again by itself.
                self.until_nodes_rejoin(&format!("SIGCONT {name}"));
            }
        }
    }

    /// After a master restart (its index was in its memory) or a pause: every node is registered
    /// and alive, at its current address, within [`REJOIN_BOUND`] of `after`.
    fn until_nodes_rejoin(&mut self, after: &str) {
        let started = Instant::now();
        loop {
            let status = self.rt.block_on(self.client().master().cluster_status());
            let alive = |n: &Node| {
                status.as_ref().is_ok_and(|s| {
                    s.nodes
                        .iter()
                        .any(|r| r.node_id == n.id && r.status == NodeLiveness::Alive && r.peer_address == n.peer)
                })
            };
            if self.nodes.iter().all(alive) {
                break;
            }
            assert!(
                started.elapsed() < REJOIN_BOUND,
                "{}: the nodes were not all alive within {REJOIN_BOUND:?} of {after}: {status:?}",
                self.replay
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        self.rejoin_max = self.rejoin_max.max(started.elapsed());
        self.note(format!("every node alive {:?} after {after}", started.elapsed()));
    }

    fn client(&self) -> &PoolClient {
        self.client.as_ref().expect("the checker's client")
    }

    /// Route-gets `keys` (retrying while the master does not answer), leaving out `exclude`.
    fn route(&self, keys: &[String], exclude: &[String]) -> Vec<Option<String>> {
        let mut out = Vec::with_capacity(keys.len());
        for chunk in keys.chunks(512) {
            let deadline = Instant::now() + Duration::from_secs(15);
            let hits = loop {
                match self.rt.block_on(self.client().master().batch_route_get(chunk, exclude)) {
                    Ok(h) => break h,
                    Err(e) => {
                        assert!(Instant::now() < deadline, "{}: route-get failed: {e}", self.replay);
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            };
            out.extend(hits.into_iter().map(|h| h.map(|h| h.node_id)));
        }
        out
    }

    /// After the SSD node's restart: every put it acknowledged before `t_kill` (less the grace)
    /// and every key it held at its previous start is routed to it again, or evictions explain
    /// the difference.
    fn check_ssd_restart(&mut self, t_kill: u64) {
        let ssd = self.nodes.iter().position(|n| n.ssd).expect("an ssd node");
        let (ssd_id, start) = (self.nodes[ssd].id.to_owned(), self.nodes[ssd].starts);
        let records = read_logs(&self.dir);
        let mut acked: HashMap<&str, u64> = HashMap::new();
        let mut located = HashSet::new();
        for r in &records {
            match r {
                Record::Put { t, key, result: PutResult::Written, .. } => {
                    acked.insert(key, *t);
                }
                Record::Loc { t, key, node } if *node == ssd_id && *t <= t_kill => {
                    located.insert(key.as_str());
                }
                _ => {}
            }
        }
        let prev = self.ssd_prev_ready;
        let mut expected: Vec<(String, u64)> = Vec::new();
        for key in &located {
            if let Some(&t) = acked.get(key)
                && t > prev
                && t + HOLE_GRACE_MS <= t_kill
                && !self.ssd_present.contains(*key)
            {
                expected.push(((*key).to_owned(), t));
            }
        }
        expected.extend(self.ssd_present.iter().map(|k| (k.clone(), prev)));
        let keys: Vec<String> = expected.iter().map(|(k, _)| k.clone()).collect();
        let others: Vec<String> = self.nodes.iter().filter(|n| !n.ssd).map(|n| n.id.to_owned()).collect();
        let routed = self.route(&keys, &others);
        let mut present = HashSet::new();
        let mut missing = Vec::new();
        for ((key, t), hit) in expected.into_iter().zip(routed) {
            if hit.as_deref() == Some(ssd_id.as_str()) {
                present.insert(key);
            } else {
                missing.push((key, t));
            }
        }
        // Evictions are the only excuse, and only those counted after a key was acknowledged: for
        // every missing key, the missing keys acknowledged at or after it never outnumber the
        // evictions the killed process counted since then plus those of the new one.
        missing.sort_by_key(|(_, t)| std::cmp::Reverse(*t));
        let new_process = if missing.is_empty() { 0 } else { scrape_evictions(&self.nodes[ssd].metrics).unwrap_or(0) };
        let mut budget = 0;
        for (i, (key, t)) in missing.iter().enumerate() {
            budget = evictions_since(&self.samples, ssd, start - 1, *t) + new_process;
            assert!(
                (i as u64) < budget,
                "{}: {} keys the SSD node acknowledged at or after {key} (acknowledged at {t}) are gone after its kill \
                 at {t_kill} and restart, with {budget} evictions counted since; newest ones (key, ack ms): {:?}",
                self.replay,
                i + 1,
                &missing[..missing.len().min(10)]
            );
        }
        self.note(format!(
            "ssd check: {} of {} keys back after the restart, {} missing within {budget} evictions counted since",
            present.len(),
            keys.len(),
            missing.len(),
        ));
        self.ssd_checked += keys.len();
        self.ssd_missing += missing.len();
        self.ssd_present = present;
    }
}

impl Chaos {
    /// The keys each live node holds, asked of the node itself (a resolve without descriptors,
    /// its leases released at once), among `keys`.
    fn held(&self, node: &Node, keys: &[String]) -> HashSet<String> {
        let peers = Peers::new(PeerClientConfig {
            timeout: Duration::from_secs(5),
            token: None,
            unreachable_for: Duration::from_millis(1),
        })
        .expect("peers");
        let (peer, _) = self
            .rt
            .block_on(peers.connect(node.id, &node.peer))
            .unwrap_or_else(|e| panic!("{}: {} does not answer: {e}", self.replay, node.id));
        let mut held = HashSet::new();
        // Small batches on an SSD node: it stages each hit in one of its 64 staging pages.
        for chunk in keys.chunks(if node.ssd { 16 } else { 256 }) {
            let mut ask: Vec<String> = chunk.to_vec();
            for _ in 0..100 {
                let reply = self
                    .rt
                    .block_on(peer.resolve(ask.clone(), true))
                    .unwrap_or_else(|e| panic!("{}: resolve on {}: {e}", self.replay, node.id));
                let mut releases = Vec::new();
                let mut busy = Vec::new();
                for (i, key) in ask.iter().enumerate() {
                    match &reply.keys[i] {
                        Some(hit) => {
                            held.insert(key.clone());
                            if hit.lease != 0 {
                                releases.push(LeaseRelease {
                                    key: key.clone(),
                                    lease: hit.lease,
                                    backend_id: hit.backend_id,
                                });
                            }
                        }
                        None if reply.busy.get(i).copied().unwrap_or(false) => busy.push(key.clone()),
                        None => {}
                    }
                }
                let _ = self.rt.block_on(peer.release(releases));
                if busy.is_empty() {
                    break;
                }
                ask = busy;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        held
    }

    /// One look at convergence: `Ok` when every live node is alive at its address, the dead one
    /// expired and routed to by no key, and each live node's keys are exactly its indexed keys.
    fn converged(&self, keys: &[String]) -> Result<(), String> {
        let status = self.rt.block_on(self.client().master().cluster_status()).map_err(|e| e.to_string())?;
        for (i, n) in self.nodes.iter().enumerate() {
            let record = status.nodes.iter().find(|r| r.node_id == n.id);
            let (status_now, peer) =
                record.map_or((NodeLiveness::Unknown, ""), |r| (r.status, r.peer_address.as_str()));
            if i == LEFT_DEAD {
                if status_now == NodeLiveness::Alive {
                    return Err(format!("{} is dead but still alive at the master", n.id));
                }
            } else if status_now != NodeLiveness::Alive || peer != n.peer {
                return Err(format!("{} is {status_now:?} at {peer:?}, runs at {}", n.id, n.peer));
            }
        }
        let dead = self.nodes[LEFT_DEAD].id;
        if let Some(k) = keys.iter().zip(self.route(keys, &[])).find(|(_, h)| h.as_deref() == Some(dead)) {
            return Err(format!("{} is routed to the dead {dead}", k.0));
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if i == LEFT_DEAD {
                continue;
            }
            let held = self.held(n, keys);
            let mut held: Vec<String> = held.into_iter().collect();
            held.sort();
            let others: Vec<String> = self.nodes.iter().filter(|o| o.id != n.id).map(|o| o.id.to_owned()).collect();
            let routed = self.route(&held, &others);
            if let Some((k, _)) = held.iter().zip(&routed).find(|(_, h)| h.as_deref() != Some(n.id)) {
                return Err(format!("{k} is on {} but not indexed there", n.id));
            }
            let status = self.rt.block_on(self.client().master().cluster_status()).map_err(|e| e.to_string())?;
            let indexed = status.nodes.iter().find(|r| r.node_id == n.id).map_or(0, |r| r.key_count);
            if indexed != held.len() as u64 {
                return Err(format!("{} holds {} keys, the master indexes {indexed} for it", n.id, held.len()));
            }
        }
        Ok(())
    }
}

#[test]
fn chaos_faults_never_return_wrong_bytes_lose_ssd_puts_or_stop_convergence() {
    let seed = std::env::var("UMBP_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_ms() ^ (u64::from(std::process::id()) << 32));
    let secs: u64 = std::env::var("UMBP_CHAOS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SECS);
    let replay = format!(
        "seed {seed} (replay: UMBP_CHAOS_SEED={seed} UMBP_CHAOS_SECS={secs} cargo nextest run -p umbp --test chaos)"
    );
    eprintln!("chaos: {replay}");
    let temp = TempDir::new("chaos");
    let dir = temp.0.clone();
    let _keep = KeepOnFailure(dir.clone());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let node = |id, ssd| Node { id, ssd, proc: None, peer: String::new(), metrics: String::new(), starts: 0 };
    let mut c = Chaos {
        dir: dir.clone(),
        replay: replay.clone(),
        master: None,
        master_addr: String::new(),
        master_starts: 0,
        nodes: vec![node("d1", false), node("d2", false), node("s1", true)],
        samples: Samples::default(),
        sampled: Arc::new(Mutex::new(vec![None; 3])),
        rt,
        client: None,
        ssd_present: HashSet::new(),
        ssd_ready: 0,
        ssd_prev_ready: 0,
        ssd_checked: 0,
        ssd_missing: 0,
        rejoin_max: Duration::ZERO,
    };
    c.start_master();
    for i in 0..c.nodes.len() {
        c.start_node(i);
    }
    let ssd = c.nodes.iter().position(|n| n.ssd).expect("ssd node");
    let client = c.rt.block_on(PoolClient::start(PoolClientConfig::new("chaos-checker", c.master_addr.clone())));
    c.client = Some(client.unwrap_or_else(|e| panic!("{replay}: the checker's client: {e}")));
    // The pool works before any fault.
    let canary = value("chaos-canary", 1000);
    c.rt.block_on(c.client().put("chaos-canary", &canary)).unwrap_or_else(|e| panic!("{replay}: canary put: {e}"));
    let mut back = vec![0u8; 1000];
    let got = c.rt.block_on(c.client().get("chaos-canary", &mut back));
    assert!(got.is_ok() && back == canary, "{replay}: canary get: {got:?}");
    let removed = c.rt.block_on(c.client().remove(&["chaos-canary"]));
    assert!(removed.is_ok(), "{replay}: canary remove: {removed:?}");

    // The sampler of the SSD node's eviction counter.
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (stop, samples, sampled) = (stop.clone(), c.samples.clone(), c.sampled.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let targets = sampled.lock().expect("sampled").clone();
                for (node, target) in targets.into_iter().enumerate() {
                    if let Some((start, addr)) = target
                        && let Some(e) = scrape_evictions(&addr)
                    {
                        samples.lock().expect("samples").push((now_ms(), node, start, e));
                    }
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };

    let mut clients = Vec::new();
    for i in 0..CLIENTS {
        let log = dir.join(format!("client-{i}.log"));
        let args = [
            "chaos-client".to_owned(),
            "--master".to_owned(),
            c.master_addr.clone(),
            "--client-id".to_owned(),
            i.to_string(),
            "--clients".to_owned(),
            CLIENTS.to_string(),
            "--seed".to_owned(),
            (seed ^ u64::from(i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_string(),
            "--duration".to_owned(),
            format!("{secs}s"),
            "--log".to_owned(),
            log.to_str().expect("utf-8 path").to_owned(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = cli_support::command(&args, ENV);
        cmd.env("RUST_LOG", "warn").stdout(std::process::Stdio::null());
        cmd.stderr(std::fs::File::create(dir.join(format!("client-{i}.err"))).expect("client stderr"));
        clients.push(cmd.spawn().expect("spawn a chaos client"));
    }

    let plan = schedule(seed, secs, c.nodes.len(), ssd);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut injected = 0;
    for (gap, fault) in &plan {
        std::thread::sleep(Duration::from_millis(*gap));
        if Instant::now() >= end {
            break;
        }
        c.run(fault);
        injected += 1;
    }
    // One node stays dead: the master must expire it and route around it.
    c.nodes[LEFT_DEAD].proc.as_mut().expect("node").kill9();
    c.nodes[LEFT_DEAD].proc = None;
    c.note(format!("kill -9 {} for good", c.nodes[LEFT_DEAD].id));

    for (i, child) in clients.iter_mut().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{replay}: client {i} ran past its duration by a minute");
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let err = std::fs::read_to_string(dir.join(format!("client-{i}.err"))).unwrap_or_default();
        assert!(status.success(), "{replay}: client {i} exited with {status}: {err}");
    }
    let quiet = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();

    // Every node ran full: its medium evicted.
    for (i, n) in c.nodes.iter().enumerate() {
        let most = c.samples.lock().expect("samples").iter().filter(|x| x.1 == i).map(|x| x.3).max().unwrap_or(0);
        assert!(most > 0, "{replay}: {} never evicted: it never filled", n.id);
    }

    // The log checks: every hit is the value of its key, as put.
    let records = read_logs(&dir);
    let mut digests: HashMap<&str, u64> = HashMap::new();
    let (mut puts, mut written, mut gets, mut hits, mut misses, mut errors) = (0, 0, 0, 0, 0, 0);
    for r in &records {
        if let Record::Put { key, digest, result, .. } = r {
            puts += 1;
            written += usize::from(*result == PutResult::Written);
            digests.insert(key, *digest);
        }
    }
    let mut ends = 0;
    for r in &records {
        match r {
            Record::Get { key, result, t } => {
                gets += 1;
                match result {
                    GetResult::Hit(d) => {
                        hits += 1;
                        assert_eq!(digests.get(key.as_str()), Some(d), "{replay}: get {key} at {t}: not the value put");
                    }
                    GetResult::Miss => misses += 1,
                    GetResult::Failed(_) => errors += 1,
                    GetResult::Bad(why) => panic!("{replay}: get {key} at {t} returned wrong bytes: {why}"),
                }
            }
            Record::End { .. } => ends += 1,
            _ => {}
        }
    }
    assert_eq!(ends, CLIENTS, "{replay}: every client logs its end");
    assert!(hits > 0 && written > 0, "{replay}: the workload ran ({written} puts written, {hits} hits)");

    // Convergence, within the bound.
    let mut keys: Vec<String> = digests.keys().map(|k| (*k).to_owned()).collect();
    keys.sort();
    // Measured at the start of the look that succeeded: a look itself takes seconds on a long
    // run's tens of thousands of keys, which is the checker's time, not the cluster's.
    let converged = loop {
        let look = quiet.elapsed();
        match c.converged(&keys) {
            Ok(()) => break look,
            Err(why) => {
                assert!(
                    quiet.elapsed() < CONVERGE_BOUND,
                    "{replay}: not converged {CONVERGE_BOUND:?} after the faults stopped: {why}"
                );
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    };

    // A last read of every key through the pool: a hit is the key's value.
    let mut buf = vec![0u8; 64 * 1024];
    let mut swept = 0;
    for key in &keys {
        match c.rt.block_on(c.client().get(key, &mut buf)) {
            Ok(n) => {
                let got = check_value(key, &buf[..n as usize]);
                assert_eq!(got.as_ref().ok(), digests.get(key.as_str()), "{replay}: sweep get {key}: {got:?}");
                swept += 1;
            }
            Err(KeyError::Miss) => {}
            Err(e) => panic!("{replay}: sweep get {key} failed after convergence: {e}"),
        }
        buf.fill(0);
    }
    let mut summary = String::new();
    let _ = write!(
        summary,
        "chaos summary: {replay}; {injected} faults in {secs} s; {puts} puts ({written} written), {gets} gets \
         ({hits} hits, {misses} misses, {errors} errors), 0 wrong bytes; SSD restarts checked {} keys, {} missing, \
         all within counted evictions; every node alive within {:.1?} of each master restart and pause; converged {converged:.1?} after the faults; sweep read {swept} of {} keys",
        c.ssd_checked,
        c.ssd_missing,
        c.rejoin_max,
        keys.len()
    );
    eprintln!("{summary}");
    if let Some(client) = c.client.take() {
        c.rt.block_on(client.close());
    }
}
