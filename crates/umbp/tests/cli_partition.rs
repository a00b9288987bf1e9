//! Network partitions between real processes (issue 19, item 2), in network namespaces and veth
//! pairs this test creates: a hub namespace holding a bridge, one namespace per `umbp` process (the
//! master and the nodes), and a veth from the test's own namespace into the hub, so the in-process
//! client reaches every process over a real network — not loopback, and never the shared-memory
//! path (processes in other network namespaces are other hosts by its rule).
//!
//! A **cut** between two hosts is a blackhole route to each other on both sides: packets are
//! dropped silently, so connections stall as on a real partition (nothing answers "refused"). A
//! **slow link** is a token-bucket rate limit (`tc qdisc … tbf`) on a host's egress. **Loss** is an
//! nftables rule dropping a random share of a port's packets (`numgen random`). **Delay** is a relay
//! in the holder's namespace that holds every chunk back 100 ms each way, new connections to the
//! data port redirected through it by nftables (a stream-level 200 ms round trip, as toxiproxy
//! injects it). This kernel has no `sch_netem` ("Specified qdisc kind is unknown"), hence these; the
//! slow link is what stretches a transfer long enough to cut it in the middle.
//!
//! What is expected, and asserted:
//!
//! - **A node cut off from the master but not from clients** keeps serving its bytes to clients
//!   that reach it; the master expires it after `heartbeat_ttl × max_missed_heartbeats` of silence,
//!   so routed reads of its keys become misses (never other bytes) and new puts go to the other
//!   node. Once the cut heals, its next heartbeat is answered "unknown node": it registers again
//!   with a full sync, and its keys are routed and read byte-exact again within a bound.
//! - **A holder behind a slow link** (its copies end after the read lease) has its keys fail with
//!   `LeaseExpired` — never bytes read past the lease —, while the keys another holder served in the
//!   same batch are read: each holder's copies are judged by their own end.
//! - **A client cut off from a holder in the middle of a batch get** gets, within `rpc_timeout`
//!   (the deadline of peer calls and of a data connection's progress), a failure for the keys that
//!   holder served (a transfer error or a miss, never other bytes), and the keys of the other holder;
//!   once the cut heals, the same get returns every value byte-exact.
//! - **5% loss on the data plane** (every node's data port, both ways): TCP retransmits what was
//!   dropped, so batch puts and gets of values on both nodes complete and read byte-exact; a copy
//!   the retransmissions stretch past its read lease is discarded and read again, never returned.
//!   No key may end in wrong bytes, and all must be read within a bound.
//! - **200 ms of delay on the data plane** (one node's data port): a single keyed get pays two
//!   delayed round trips (the handshake, then the request and the value) — at least 200 ms — and
//!   still ends inside the 500 ms read lease, so it is a hit; a batch get of keys on both nodes
//!   reads every value byte-exact within a bound (a copy that outlived its lease would be read
//!   again, never returned), and the slow node's values went through the relay.
//!
//! Needs root (namespaces and routes) and, for loss, `nft` (Debian's `nftables`). Without them the
//! tests print why and pass, unless `UMBP_REQUIRE_ROOT=1` (set by `cargo xtask ci` where it runs as
//! root) makes that a failure.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig};

// This file starts its processes inside namespaces (`Proc::try_spawn`), not on the host.
#[expect(dead_code)]
mod cli_support;

use cli_support::{Proc, TempDir, UMBP, field, value};

/// Runs `ip`/`tc` with `args`; the error is the tool's stderr.
fn tool(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program).args(args).output().map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// A private network of namespaces; removed on drop.
struct Net {
    /// Prefix of every name this network made (namespaces, links): `upN`.
    tag: String,
    /// The /24 of the network, `10.213.N`.
    subnet: String,
    /// The namespaces, the hub's first.
    spaces: Vec<String>,
    /// The test's own end of its veth into the hub.
    root_link: String,
    /// Blackhole routes added in the test's own namespace (removed on drop).
    root_routes: Vec<String>,
}

impl Net {
    /// A hub and one namespace per member, each member's `eth0` at `SUBNET.(10 + k)`, and the test
    /// process at `SUBNET.1`. `None` (and the reason) where namespaces cannot be made.
    fn create(members: &[&str]) -> Result<Self, String> {
        let pid = std::process::id() as usize;
        for attempt in 0..40 {
            let n = (pid + attempt * 7) % 250 + 1;
            let tag = format!("up{n}");
            let hub = format!("{tag}hub");
            // Taken (another test process, or a leftover of a killed one): the next number.
            if tool("ip", &["netns", "add", &hub]).is_err() {
                if attempt == 0 && !Path::new("/var/run/netns").exists() && !Path::new("/run/netns").exists() {
                    return Err("cannot create network namespaces (not root?)".into());
                }
                continue;
            }
            let mut net = Self {
                subnet: format!("10.213.{n}"),
                spaces: vec![hub.clone()],
                root_link: format!("{tag}r0"),
                root_routes: Vec::new(),
                tag,
            };
            net.build(&hub, members)?;
            return Ok(net);
        }
        Err("no free network number".into())
    }

    fn build(&mut self, hub: &str, members: &[&str]) -> Result<(), String> {
        tool("ip", &["-n", hub, "link", "add", "br0", "type", "bridge"])?;
        tool("ip", &["-n", hub, "link", "set", "br0", "up"])?;
        // The test's own namespace: one veth, its far end a bridge port.
        let far = format!("{}r1", self.tag);
        tool("ip", &["link", "add", &self.root_link, "type", "veth", "peer", "name", &far])?;
        tool("ip", &["link", "set", &far, "netns", hub])?;
        tool("ip", &["-n", hub, "link", "set", &far, "master", "br0", "up"])?;
        tool("ip", &["addr", "add", &format!("{}.1/24", self.subnet), "dev", &self.root_link])?;
        tool("ip", &["link", "set", &self.root_link, "up"])?;
        for (k, member) in members.iter().enumerate() {
            let ns = self.ns(member);
            tool("ip", &["netns", "add", &ns])?;
            self.spaces.push(ns.clone());
            let (inner, outer) = (format!("{}m{k}", self.tag), format!("{}p{k}", self.tag));
            tool("ip", &["link", "add", &inner, "type", "veth", "peer", "name", &outer])?;
            tool("ip", &["link", "set", &inner, "netns", &ns])?;
            tool("ip", &["-n", &ns, "link", "set", &inner, "name", "eth0"])?;
            tool("ip", &["link", "set", &outer, "netns", hub])?;
            tool("ip", &["-n", hub, "link", "set", &outer, "master", "br0", "up"])?;
            tool("ip", &["-n", &ns, "addr", "add", &format!("{}/24", self.ip(k)), "dev", "eth0"])?;
            tool("ip", &["-n", &ns, "link", "set", "eth0", "up"])?;
            tool("ip", &["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(())
    }

    fn ns(&self, member: &str) -> String {
        format!("{}{member}", self.tag)
    }

    /// The address of the `k`th member.
    fn ip(&self, k: usize) -> String {
        format!("{}.{}", self.subnet, 10 + k)
    }

    /// The test process's own address.
    fn root_ip(&self) -> String {
        format!("{}.1", self.subnet)
    }

    /// Drops every packet between `member` and `peer_ip` (a member's or the test's address), both
    /// ways; `root` says whether `peer_ip` is the test's own namespace, whose side is cut with a
    /// route of its own.
    fn cut(&mut self, member: &str, other: Option<&str>, other_ip: &str, member_ip: &str) -> Result<(), String> {
        tool("ip", &["-n", &self.ns(member), "route", "add", "blackhole", &format!("{other_ip}/32")])?;
        match other {
            Some(o) => tool("ip", &["-n", &self.ns(o), "route", "add", "blackhole", &format!("{member_ip}/32")]),
            None => {
                tool("ip", &["route", "add", "blackhole", &format!("{member_ip}/32")])?;
                self.root_routes.push(format!("{member_ip}/32"));
                Ok(())
            }
        }
    }

    /// Undoes [`cut`](Self::cut).
    fn heal(&mut self, member: &str, other: Option<&str>, other_ip: &str, member_ip: &str) -> Result<(), String> {
        tool("ip", &["-n", &self.ns(member), "route", "del", "blackhole", &format!("{other_ip}/32")])?;
        match other {
            Some(o) => tool("ip", &["-n", &self.ns(o), "route", "del", "blackhole", &format!("{member_ip}/32")]),
            None => {
                self.root_routes.retain(|r| r != &format!("{member_ip}/32"));
                tool("ip", &["route", "del", "blackhole", &format!("{member_ip}/32")])
            }
        }
    }

    /// Limits `member`'s egress to `rate` (a `tc` rate such as `40mbit`).
    fn slow(&self, member: &str, rate: &str) -> Result<(), String> {
        let ns = self.ns(member);
        tool(
            "ip",
            &[
                "netns", "exec", &ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst",
                "64kb", "latency", "2s",
            ],
        )
    }

    /// Lifts [`slow`](Self::slow).
    fn unslow(&self, member: &str) -> Result<(), String> {
        tool("ip", &["netns", "exec", &self.ns(member), "tc", "qdisc", "del", "dev", "eth0", "root"])
    }

    /// Drops `percent`% of the TCP packets to and from `port` in `member`'s namespace, at random
    /// (nftables' `numgen random`: this kernel has no `sch_netem`), counting what it dropped.
    fn lossy(&self, member: &str, port: u16, percent: u8) -> Result<(), String> {
        let ns = self.ns(member);
        let nft = |args: &[&str]| {
            let mut all = vec!["netns", "exec", ns.as_str(), "nft"];
            all.extend_from_slice(args);
            tool("ip", &all)
        };
        nft(&["add", "table", "inet", "umbploss"])?;
        let (port, limit) = (port.to_string(), percent.to_string());
        for (chain, hook, dir) in [("in", "input", "dport"), ("out", "output", "sport")] {
            nft(&["add", "chain", "inet", "umbploss", chain, &format!("{{ type filter hook {hook} priority 0; }}")])?;
            nft(&[
                "add", "rule", "inet", "umbploss", chain, "tcp", dir, &port, "numgen", "random", "mod", "100", "<",
                &limit, "counter", "drop",
            ])?;
        }
        Ok(())
    }

    /// Packets [`lossy`](Self::lossy) dropped in `member`'s namespace so far.
    fn dropped(&self, member: &str) -> u64 {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns(member), "nft", "list", "table", "inet", "umbploss"])
            .output();
        let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        let words: Vec<&str> = text.split_whitespace().collect();
        words.windows(2).filter(|w| w[0] == "packets").filter_map(|w| w[1].parse::<u64>().ok()).sum()
    }

    /// Lifts [`lossy`](Self::lossy).
    fn lossless(&self, member: &str) -> Result<(), String> {
        tool("ip", &["netns", "exec", &self.ns(member), "nft", "delete", "table", "inet", "umbploss"])
    }

    /// Sends new TCP connections from `from_ip` to `port` in `member`'s namespace to `to_port` there
    /// instead (an nftables `redirect`), counting them.
    fn redirect(&self, member: &str, from_ip: &str, port: u16, to_port: u16) -> Result<(), String> {
        let ns = self.ns(member);
        let nft = |args: &[&str]| {
            let mut all = vec!["netns", "exec", ns.as_str(), "nft"];
            all.extend_from_slice(args);
            tool("ip", &all)
        };
        nft(&["add", "table", "ip", "umbpdelay"])?;
        nft(&["add", "chain", "ip", "umbpdelay", "pre", "{ type nat hook prerouting priority -100; }"])?;
        let (port, to) = (port.to_string(), format!(":{to_port}"));
        nft(&[
            "add",
            "rule",
            "ip",
            "umbpdelay",
            "pre",
            "ip",
            "saddr",
            from_ip,
            "tcp",
            "dport",
            &port,
            "counter",
            "redirect",
            "to",
            &to,
        ])
    }

    /// `umbp ARGS…` inside `member`'s namespace, with a clean `UMBP_*` environment.
    fn umbp(&self, member: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns(member), UMBP]).args(args);
        for (var, _) in std::env::vars() {
            if var.starts_with("UMBP_") {
                cmd.env_remove(var);
            }
        }
        cmd.env("RUST_LOG", "info").env("NO_COLOR", "1");
        cmd
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for route in std::mem::take(&mut self.root_routes) {
            let _ = tool("ip", &["route", "del", "blackhole", &route]);
        }
        let _ = tool("ip", &["link", "del", &self.root_link]);
        // Deleting a namespace deletes the links in it (and their veth peers).
        for ns in self.spaces.iter().rev() {
            let _ = tool("ip", &["netns", "del", ns]);
        }
    }
}

/// The network, or `None` with a printed reason (a failure under `UMBP_REQUIRE_ROOT=1`).
fn network(members: &[&str]) -> Option<Net> {
    match Net::create(members) {
        Ok(net) => Some(net),
        Err(why) => {
            assert!(
                std::env::var("UMBP_REQUIRE_ROOT").map_or(true, |v| v != "1"),
                "UMBP_REQUIRE_ROOT=1 but no network namespaces: {why}"
            );
            eprintln!("SKIPPED: network namespaces unavailable: {why}");
            None
        }
    }
}

/// A TCP relay inside a namespace: connections to its port there are forwarded to `target`, every
/// chunk held back `delay` in each direction — a link of `2 × delay` round trip (what `tc netem
/// delay` would give, which this kernel lacks). Threads end when their connections do; the
/// listener when `stop` is set.
struct DelayRelay {
    port: u16,
    stop: Arc<AtomicBool>,
    /// Bytes relayed, both ways.
    relayed: Arc<AtomicU64>,
}

impl DelayRelay {
    fn start(netns: &str, target: SocketAddr, delay: Duration) -> Result<Self, String> {
        let path = format!("/var/run/netns/{netns}");
        let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let relayed = Arc::new(AtomicU64::new(0));
        let (stop2, relayed2) = (Arc::clone(&stop), Arc::clone(&relayed));
        std::thread::spawn(move || {
            // SAFETY: `file` is an open namespace file; setns only changes this thread's namespace.
            if unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) } != 0 {
                let _ = tx.send(Err(format!("setns: {}", std::io::Error::last_os_error())));
                return;
            }
            let listener = match std::net::TcpListener::bind("0.0.0.0:0").and_then(|l| {
                l.set_nonblocking(true)?;
                Ok(l)
            }) {
                Ok(l) => l,
                Err(e) => {
                    let _ = tx.send(Err(format!("bind: {e}")));
                    return;
                }
            };
            let _ = tx.send(listener.local_addr().map(|a| a.port()).map_err(|e| e.to_string()));
            while !stop2.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        // Made in this thread: inside the namespace, so not redirected again.
                        let Ok(server) = std::net::TcpStream::connect(target) else { continue };
                        let _ = client.set_nonblocking(false);
                        for (from, to) in [(client.try_clone(), server.try_clone()), (Ok(server), Ok(client))] {
                            if let (Ok(from), Ok(to)) = (from, to) {
                                relay_one_way(from, to, delay, Arc::clone(&relayed2));
                            }
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        let port = rx.recv_timeout(Duration::from_secs(5)).map_err(|e| e.to_string())??;
        Ok(Self { port, stop, relayed })
    }
}

impl Drop for DelayRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Copies `from` to `to`, each chunk written `delay` after it was read (in order).
fn relay_one_way(mut from: std::net::TcpStream, mut to: std::net::TcpStream, delay: Duration, relayed: Arc<AtomicU64>) {
    use std::io::{Read, Write};
    let (tx, rx) = std::sync::mpsc::channel::<(Instant, Vec<u8>)>();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 256 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    });
    std::thread::spawn(move || {
        while let Ok((due, chunk)) = rx.recv() {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            if to.write_all(&chunk).is_err() {
                return;
            }
            relayed.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

const MASTER: usize = 0;
const N1: usize = 1;
const N2: usize = 2;
const MEMBERS: [&str; 3] = ["m", "n1", "n2"];

/// Starts the master (short heartbeat timings: a silent node expires after 3 × 1 s) and two DRAM
/// nodes, each in its namespace.
fn start_cluster(net: &Net, dir: &Path) -> (Vec<Proc>, String) {
    let master_listen = format!("{}:0", net.ip(MASTER));
    let args = ["master", "--listen", &master_listen, "--heartbeat-ttl", "1s", "--reaper-interval", "500ms"];
    let (master, line) =
        Proc::try_spawn(dir, "master", net.umbp("m", &args), "master").unwrap_or_else(|e| panic!("{e}"));
    let master_addr = field(&line, "listen").to_owned();
    let mut procs = vec![master];
    for (k, name) in [(N1, "n1"), (N2, "n2")] {
        let ip = net.ip(k);
        let args = [
            "node",
            "--master",
            &master_addr,
            "--node-id",
            name,
            "--listen",
            &ip,
            "--medium",
            "dram",
            "--capacity",
            "64MiB",
            "--page-size",
            "64KiB",
            "--prefault",
            "false",
        ];
        let ready = format!("node {name}");
        let (p, _) = Proc::try_spawn(dir, name, net.umbp(name, &args), &ready).unwrap_or_else(|e| panic!("{e}"));
        procs.push(p);
    }
    (procs, master_addr)
}

/// The node each key is routed to now (`None`: no route).
async fn holders(client: &PoolClient, keys: &[String]) -> Vec<Option<String>> {
    let routes = client.master().batch_route_get(keys, &[]).await.expect("route");
    routes.into_iter().map(|r| r.map(|h| h.node_id)).collect()
}

/// [`holders`] once every key is indexed (its holder's heartbeat reached the master), within 10 s.
async fn indexed(client: &PoolClient, keys: &[String]) -> Vec<Option<String>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = holders(client, keys).await;
        if now.iter().all(Option::is_some) || Instant::now() > deadline {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn get_all(client: &PoolClient, keys: &[String], len: usize) -> (Vec<Result<u64, KeyError>>, Vec<Vec<u8>>) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0xEE; len]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let results = client.batch_get(&refs, &mut slices).await;
    (results, bufs)
}

/// Every hit holds its key's own bytes.
fn assert_hits_exact(keys: &[String], results: &[Result<u64, KeyError>], bufs: &[Vec<u8>], len: usize) {
    for ((k, r), b) in keys.iter().zip(results).zip(bufs) {
        if let Ok(size) = r {
            assert_eq!(*size as usize, len, "{k}: size");
            assert!(*b == value(k, len), "{k} came back with other bytes");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cut_off_from_the_master_expires_then_rejoins_when_the_cut_heals() {
    let Some(mut net) = network(&MEMBERS) else { return };
    let dir = TempDir::new("partition-master");
    let (_procs, master) = start_cluster(&net, &dir.0);
    let mut config = PoolClientConfig::new("partition-client", master.clone());
    config.keyed_requests = false; // every read is routed: what the master knows is what is read
    let client = PoolClient::start(config).await.expect("client");

    const LEN: usize = 48 << 10;
    let keys: Vec<String> = (0..40).map(|i| format!("cut-master-{i}")).collect();
    for k in &keys {
        client.put(k, &value(k, LEN)).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
    let before = indexed(&client, &keys).await;
    let on_n1: Vec<String> =
        keys.iter().zip(&before).filter(|(_, h)| h.as_deref() == Some("n1")).map(|(k, _)| k.clone()).collect();
    assert!(!on_n1.is_empty() && on_n1.len() < keys.len(), "puts spread over both nodes: {before:?}");

    // Cut n1 from the master only: the client still reaches both nodes.
    let (n1_ip, m_ip) = (net.ip(N1), net.ip(MASTER));
    net.cut("n1", Some("m"), &m_ip, &n1_ip).expect("cut");
    let cut_at = Instant::now();
    // Expiry: 3 missed heartbeats of 1 s, checked every 500 ms; bound it at 10 s.
    loop {
        let now = holders(&client, &on_n1).await;
        if now.iter().all(Option::is_none) {
            break;
        }
        assert!(cut_at.elapsed() < Duration::from_secs(10), "n1 never expired: {now:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let expired_after = cut_at.elapsed();
    // Its keys are misses now (the master routes nothing there), never other bytes.
    let (results, bufs) = get_all(&client, &on_n1, LEN).await;
    assert_hits_exact(&on_n1, &results, &bufs, LEN);
    assert!(results.iter().all(|r| matches!(r, Err(KeyError::Miss))), "routed reads of an expired node: {results:?}");
    // New puts land on n2, the only live node.
    let fresh: Vec<String> = (0..10).map(|i| format!("cut-master-fresh-{i}")).collect();
    for k in &fresh {
        client.put(k, &value(k, LEN)).await.unwrap_or_else(|e| panic!("put {k} during the cut: {e}"));
    }
    // (A holder tells the master of its new keys with its next heartbeat: wait for the index.)
    let placed = indexed(&client, &fresh).await;
    assert!(placed.iter().all(|h| h.as_deref() == Some("n2")), "puts during the cut: {placed:?}");

    // Heal: n1 registers again (its next heartbeat is told it is unknown) with its keys.
    net.heal("n1", Some("m"), &m_ip, &n1_ip).expect("heal");
    let healed_at = Instant::now();
    loop {
        let now = holders(&client, &on_n1).await;
        if now.iter().all(|h| h.as_deref() == Some("n1")) {
            break;
        }
        assert!(healed_at.elapsed() < Duration::from_secs(15), "n1's keys were not routed again: {now:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rejoined_after = healed_at.elapsed();
    let (results, bufs) = get_all(&client, &on_n1, LEN).await;
    assert!(results.iter().all(|r| r.as_ref().ok() == Some(&(LEN as u64))), "after the heal: {results:?}");
    assert_hits_exact(&on_n1, &results, &bufs, LEN);
    eprintln!("n1 expired {expired_after:?} after the cut and was routed again {rejoined_after:?} after the heal");
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cut_off_from_a_holder_mid_batch_fails_cleanly_and_reads_after_the_heal() {
    let Some(mut net) = network(&MEMBERS) else { return };
    let dir = TempDir::new("partition-client");
    let (_procs, master) = start_cluster(&net, &dir.0);
    let mut config = PoolClientConfig::new("partition-reader", master.clone());
    // Bounded waits: a stalled peer call or transfer gives up after 2 s.
    config.rpc_timeout = Duration::from_secs(2);
    let client = Arc::new(PoolClient::start(config).await.expect("client"));

    const LEN: usize = 1 << 20;
    let keys: Vec<String> = (0..24).map(|i| format!("cut-client-{i}")).collect();
    for k in &keys {
        client.put(k, &value(k, LEN)).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
    let placed = indexed(&client, &keys).await;
    let on_n1 = placed.iter().filter(|h| h.as_deref() == Some("n1")).count();
    assert!(on_n1 > 0, "some keys on n1: {placed:?}");
    // n1 sends at 40 Mbit/s: its share of the batch (12 MiB or so) takes seconds.
    net.slow("n1", "40mbit").expect("tbf");

    // A slow holder: its keys lapse (their copies end long after the 500 ms read lease), but the
    // fast holder's keys of the same batch are judged by their own copies' end and are read.
    let (results, bufs) = get_all(&client, &keys, LEN).await;
    assert_hits_exact(&keys, &results, &bufs, LEN);
    for ((k, r), h) in keys.iter().zip(&results).zip(&placed) {
        match h.as_deref() {
            Some("n2") => assert!(r.is_ok(), "{k} on the fast holder: {r:?}"),
            _ => assert!(matches!(r, Err(KeyError::LeaseExpired { .. })), "{k} over the slow link: {r:?}"),
        }
    }

    // The cut falls inside the slow holder's transfer.
    let started = Instant::now();
    let reader = {
        let (client, keys) = (Arc::clone(&client), keys.clone());
        tokio::spawn(async move { get_all(&client, &keys, LEN).await })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!reader.is_finished(), "the batch ended before the cut ({:?}): nothing was cut mid-way", started.elapsed());
    let (n1_ip, root_ip) = (net.ip(N1), net.root_ip());
    net.cut("n1", None, &root_ip, &n1_ip).expect("cut");
    let (results, bufs) = tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("the batch get never returned after the cut")
        .expect("reader task");
    let took = started.elapsed();
    assert_hits_exact(&keys, &results, &bufs, LEN);
    let failed = results.iter().filter(|r| r.is_err()).count();
    assert!(failed > 0, "a cut mid-batch failed no key: {results:?}");
    for (r, h) in results.iter().zip(&placed) {
        if h.as_deref() == Some("n2") {
            assert!(r.is_ok(), "a key on the reachable node failed: {r:?}");
        }
    }
    eprintln!("batch get cut mid-way returned after {took:?}: {failed} of {} keys failed", keys.len());

    // Heal (and the link back to speed): the same batch reads every value.
    net.heal("n1", None, &root_ip, &n1_ip).expect("heal");
    net.unslow("n1").expect("tbf off");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (results, bufs) = get_all(&client, &keys, LEN).await;
        assert_hits_exact(&keys, &results, &bufs, LEN);
        if results.iter().all(Result::is_ok) {
            break;
        }
        assert!(Instant::now() < deadline, "after the heal: {results:?}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_percent_loss_on_the_data_plane_slows_batches_but_loses_no_byte() {
    let Some(net) = network(&MEMBERS) else { return };
    if Command::new("nft").arg("--version").output().is_err() {
        assert!(
            std::env::var("UMBP_REQUIRE_ROOT").map_or(true, |v| v != "1"),
            "UMBP_REQUIRE_ROOT=1 but no `nft` (install nftables)"
        );
        eprintln!("SKIPPED: no `nft` to drop packets with");
        return;
    }
    let dir = TempDir::new("partition-loss");
    let (_procs, master) = start_cluster(&net, &dir.0);
    let mut config = PoolClientConfig::new("partition-lossy", master.clone());
    config.rpc_timeout = Duration::from_secs(2);
    let client = PoolClient::start(config).await.expect("client");

    const LEN: usize = 256 << 10;
    let first: Vec<String> = (0..16).map(|i| format!("loss-a-{i}")).collect();
    for k in &first {
        client.put(k, &value(k, LEN)).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
    let placed = indexed(&client, &first).await;
    assert!(placed.iter().any(|h| h.as_deref() == Some("n1")) && placed.iter().any(|h| h.as_deref() == Some("n2")));
    // Each node's data port, from the master's routes.
    let routes = client.master().batch_route_get(&first, &[]).await.expect("route");
    let mut ports = std::collections::BTreeMap::new();
    for hit in routes.into_iter().flatten() {
        let port = hit.data_endpoint.rsplit(':').next().and_then(|p| p.parse::<u16>().ok()).expect("a data port");
        ports.insert(hit.node_id, port);
    }
    for (node, port) in &ports {
        net.lossy(node, *port, 5).expect("nft");
    }

    // Under loss: a batch put of new keys, then batch gets of every key, until all are read.
    let second: Vec<String> = (0..16).map(|i| format!("loss-b-{i}")).collect();
    let values: Vec<Vec<u8>> = second.iter().map(|k| value(k, LEN)).collect();
    let pairs: Vec<(&str, &[u8])> = second.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    let started = Instant::now();
    let mut put_rounds = 0;
    let mut pending: Vec<(&str, &[u8])> = pairs.clone();
    while !pending.is_empty() {
        put_rounds += 1;
        let results = client.batch_put(&pending).await;
        pending = pending.into_iter().zip(results).filter(|(_, r)| r.is_err()).map(|(p, _)| p).collect();
        assert!(started.elapsed() < Duration::from_secs(60), "puts under 5% loss never all landed: {pending:?}");
    }
    let all: Vec<String> = first.iter().chain(&second).cloned().collect();
    assert!(indexed(&client, &all).await.iter().all(Option::is_some), "every key indexed");
    let mut get_rounds = 0;
    loop {
        get_rounds += 1;
        let (results, bufs) = get_all(&client, &all, LEN).await;
        assert_hits_exact(&all, &results, &bufs, LEN);
        if results.iter().all(Result::is_ok) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(90), "gets under 5% loss never all read: {results:?}");
    }
    let dropped: u64 = ports.keys().map(|node| net.dropped(node)).sum();
    assert!(dropped > 0, "the loss rule dropped no packet: nothing was tested");
    eprintln!(
        "5% loss: {dropped} packets dropped; {} keys put in {put_rounds} round(s), {} read byte-exact in {get_rounds} round(s), {:?}",
        second.len(),
        all.len(),
        started.elapsed()
    );
    for node in ports.keys() {
        net.lossless(node).expect("nft off");
    }
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_ms_of_delay_on_the_data_plane_slows_reads_but_never_returns_other_bytes() {
    let Some(net) = network(&MEMBERS) else { return };
    if Command::new("nft").arg("--version").output().is_err() {
        assert!(
            std::env::var("UMBP_REQUIRE_ROOT").map_or(true, |v| v != "1"),
            "UMBP_REQUIRE_ROOT=1 but no `nft` (install nftables)"
        );
        eprintln!("SKIPPED: no `nft` to redirect packets with");
        return;
    }
    let dir = TempDir::new("partition-delay");
    let (_procs, master) = start_cluster(&net, &dir.0);
    let writer =
        PoolClient::start(PoolClientConfig::new("partition-delay-writer", master.clone())).await.expect("client");
    const LEN: usize = 256 << 10;
    let keys: Vec<String> = (0..16).map(|i| format!("delay-{i}")).collect();
    for k in &keys {
        writer.put(k, &value(k, LEN)).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
    let placed = indexed(&writer, &keys).await;
    let on_n1: Vec<String> =
        keys.iter().zip(&placed).filter(|(_, h)| h.as_deref() == Some("n1")).map(|(k, _)| k.clone()).collect();
    assert!(!on_n1.is_empty() && on_n1.len() < keys.len(), "keys on both nodes: {placed:?}");
    writer.close().await;
    // n1's data port, and a relay in its namespace that holds every chunk back 100 ms each way;
    // new connections from the test's address to the data port go through it.
    let routes = holders_with_endpoints(&master, &on_n1[..1]).await;
    let endpoint: SocketAddr = routes[0].parse().expect("a data endpoint");
    let relay = DelayRelay::start(&net.ns("n1"), endpoint, Duration::from_millis(100)).expect("relay");
    net.redirect("n1", &net.root_ip(), endpoint.port(), relay.port).expect("nft redirect");

    // A fresh reader: every data connection it makes to n1 is new, so it goes through the relay.
    let reader =
        PoolClient::start(PoolClientConfig::new("partition-delay-reader", master.clone())).await.expect("client");
    // One key on n1: one keyed exchange (hello, then the request and the value): at least two
    // delayed round trips, inside the 500 ms read lease, so a hit with the exact bytes.
    let started = Instant::now();
    let mut one = vec![0u8; LEN];
    let got = reader.get(&on_n1[0], &mut one).await;
    let single = started.elapsed();
    assert_eq!(got, Ok(LEN as u64), "a single get over a 200 ms link");
    assert!(one == value(&on_n1[0], LEN), "byte-exact");
    assert!(single >= Duration::from_millis(200), "the link was not slow: {single:?}");
    // The whole batch: hits are exact; a copy that outlives its lease is read again, never returned;
    // every key is read within a bound.
    let started = Instant::now();
    let mut rounds = 0;
    loop {
        rounds += 1;
        let (results, bufs) = get_all(&reader, &keys, LEN).await;
        assert_hits_exact(&keys, &results, &bufs, LEN);
        if results.iter().all(Result::is_ok) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "over a 200 ms link: {results:?}");
    }
    let relayed = relay.relayed.load(Ordering::Relaxed);
    assert!(relayed >= (on_n1.len() * LEN) as u64, "n1's values went through the delaying relay ({relayed} bytes)");
    eprintln!(
        "200 ms RTT on n1's data plane: one get {single:?}; {} keys ({} on n1) read byte-exact in {rounds} round(s), {:?}; {relayed} bytes relayed",
        keys.len(),
        on_n1.len(),
        started.elapsed()
    );
    reader.close().await;
}

/// Each key's holder's data endpoint, asked of the master by a light client.
async fn holders_with_endpoints(master: &str, keys: &[String]) -> Vec<String> {
    let client =
        PoolClient::start(PoolClientConfig::new("partition-delay-router", master.to_owned())).await.expect("client");
    let routes = client.master().batch_route_get(keys, &[]).await.expect("route");
    client.close().await;
    routes.into_iter().map(|r| r.map(|h| h.data_endpoint).unwrap_or_default()).collect()
}
