//! `umbp bench metadata`: the master's metadata path over gRPC (issue 18), with its index in this
//! process's memory, in one Redis, and sharded over three Redis processes, in one run.
//!
//! Each store sits behind a real in-process master on 127.0.0.1; the bench talks raw gRPC to it:
//!
//! - **heartbeat ingestion**: [`MetadataBenchOptions::nodes`] simulated nodes register, then each
//!   sends delta heartbeats of [`MetadataBenchOptions::events_per_heartbeat`] ADD events (one
//!   bundle, the next seq), one after another, for [`MetadataBenchOptions::duration`]; events/s;
//! - **route-put**: [`MetadataBenchOptions::callers`] concurrent callers, each on its own
//!   connection, send `BatchRoutePut` of [`MetadataBenchOptions::batch`] new keys; keys/s;
//! - **route-get**: the same callers send `BatchRouteGet` of `batch` keys picked at random among
//!   the ingested ones (every one must be found); keys/s.
//!
//! The Redis servers are `redis-server` processes the bench starts on free loopback ports with
//! persistence off and kills at the end; without `redis-server` only the in-memory row runs, with
//! a note. A last step measures the metadata memory per key in Redis: `INFO memory`
//! `used_memory` of a fresh server before and after one node indexes
//! [`MetadataBenchOptions::memory_keys`] keys of [`KEY_BYTES`] bytes on one tier.
//!
//! Client, master and Redis share this machine's cores, so the figures are of the whole path on one
//! host, not of the master alone.

use std::fmt;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};
use umbp_master::MasterConfig;
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

use crate::bench::BenchError;
use crate::cli::BenchArgs;
use crate::progress::Progress;
use crate::units::format_duration;

/// The header of the markdown table.
pub const METADATA_TABLE_HEADER: &str =
    "| store | heartbeat events/s | ratio | route-put keys/s | ratio | route-get keys/s | ratio |";

/// The length of every key the bench indexes (a SHA-256 in hex, as a KV-cache block hash is).
pub const KEY_BYTES: usize = 64;

/// The size every indexed key claims (4 KiB: nothing here moves bytes).
const VALUE_SIZE: u64 = 4096;

/// What each simulated node lends: enough that no route-put runs out of room or starts eviction.
const NODE_BYTES: u64 = 1 << 40;

/// How long a `redis-server` may take to accept connections.
const REDIS_START: Duration = Duration::from_secs(10);

/// What `umbp bench metadata` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataBenchOptions {
    /// How long each cell is measured. Default: 3 s (9 cells: about 30 s in all).
    pub duration: Duration,
    /// Simulated nodes sending heartbeats. Default: 8.
    pub nodes: usize,
    /// ADD events per heartbeat. Default: 512.
    pub events_per_heartbeat: usize,
    /// Concurrent route-put / route-get callers, each on its own connection. Default: 8.
    pub callers: usize,
    /// Keys per batch route call. Default: 128.
    pub batch: usize,
    /// Keys indexed for the memory-per-key step (0 skips it). Default: 100 000.
    pub memory_keys: usize,
    /// Redis shards of the sharded row. Default: 3.
    pub shards: usize,
    /// The Redis server program. Default: `redis-server`.
    pub redis_server: String,
}

impl Default for MetadataBenchOptions {
    fn default() -> Self {
        Self {
            duration: Duration::from_secs(3),
            nodes: 8,
            events_per_heartbeat: 512,
            callers: 8,
            batch: 128,
            memory_keys: 100_000,
            shards: 3,
            redis_server: "redis-server".into(),
        }
    }
}

impl MetadataBenchOptions {
    /// The defaults overridden by the flags that are set.
    pub fn from_args(args: &BenchArgs) -> Self {
        let mut o = Self::default();
        if let Some(d) = args.duration {
            o.duration = d;
        }
        if let Some(n) = args.memory_keys {
            o.memory_keys = n;
        }
        o
    }

    fn validate(&self) -> Result<(), BenchError> {
        let bad = |reason: &str| Err(BenchError::Options(reason.into()));
        if self.duration.is_zero() || self.duration > Duration::from_secs(600) {
            return bad("--duration must be above 0 and at most 10m");
        }
        if self.nodes == 0 || self.callers == 0 || self.batch == 0 || self.events_per_heartbeat == 0 {
            return bad("nodes, callers, batch and events per heartbeat must be at least 1");
        }
        if self.shards < 2 {
            return bad("the sharded row needs at least 2 shards");
        }
        if self.memory_keys > 10_000_000 {
            return bad("--memory-keys: at most 10000000");
        }
        Ok(())
    }
}

/// One store's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataRow {
    /// `memory`, `redis x1`, `redis x3 (sharded)`.
    pub store: String,
    /// Heartbeat events applied per second.
    pub events_per_s: f64,
    /// Route-put decisions (keys) per second.
    pub put_keys_per_s: f64,
    /// Route-get decisions (keys) per second.
    pub get_keys_per_s: f64,
}

/// The metadata memory per key in Redis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryReport {
    /// Keys indexed (one node, one tier).
    pub keys: usize,
    /// `used_memory` after the node registered, before its keys.
    pub used_before: u64,
    /// `used_memory` after the keys were indexed.
    pub used_after: u64,
}

impl MemoryReport {
    /// Bytes of Redis memory per indexed key.
    pub fn bytes_per_key(&self) -> f64 {
        self.used_after.saturating_sub(self.used_before) as f64 / self.keys.max(1) as f64
    }
}

/// What `umbp bench metadata` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct MetadataReport {
    /// The options it ran with.
    pub options: MetadataBenchOptions,
    /// The in-memory row first, then the Redis rows.
    pub rows: Vec<MetadataRow>,
    /// The memory step, where it ran.
    pub memory: Option<MemoryReport>,
    /// Why rows or steps were skipped.
    pub notes: Vec<String>,
}

/// `a / b`, 0 where `b` is 0.
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// A rate as `1.23 M`, `456.7 k` or `89`.
fn rate(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2} M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1} k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl MetadataReport {
    /// The in-memory row, which the ratios divide by.
    fn base(&self) -> Option<&MetadataRow> {
        self.rows.first()
    }

    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let base = self.base().cloned();
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                let (e, p, g) = base
                    .as_ref()
                    .map(|b| {
                        (
                            ratio(r.events_per_s, b.events_per_s),
                            ratio(r.put_keys_per_s, b.put_keys_per_s),
                            ratio(r.get_keys_per_s, b.get_keys_per_s),
                        )
                    })
                    .unwrap_or_default();
                format!(
                    "{{\"store\":{},\"events_per_s\":{:.0},\"route_put_keys_per_s\":{:.0},\"route_get_keys_per_s\":{:.0},\
                     \"events_ratio\":{e:.4},\"route_put_ratio\":{p:.4},\"route_get_ratio\":{g:.4}}}",
                    json_string(&r.store),
                    r.events_per_s,
                    r.put_keys_per_s,
                    r.get_keys_per_s
                )
            })
            .collect();
        let memory = match &self.memory {
            Some(m) => format!(
                "{{\"keys\":{},\"key_bytes\":{KEY_BYTES},\"used_before\":{},\"used_after\":{},\"bytes_per_key\":{:.1}}}",
                m.keys,
                m.used_before,
                m.used_after,
                m.bytes_per_key()
            ),
            None => "null".into(),
        };
        let notes: Vec<String> = self.notes.iter().map(|n| json_string(n)).collect();
        let o = &self.options;
        format!(
            "{{\"suite\":\"metadata\",\"duration_ms\":{},\"nodes\":{},\"events_per_heartbeat\":{},\"callers\":{},\
             \"batch\":{},\"rows\":[{}],\"memory\":{memory},\"notes\":[{}]}}",
            o.duration.as_millis(),
            o.nodes,
            o.events_per_heartbeat,
            o.callers,
            o.batch,
            rows.join(","),
            notes.join(",")
        )
    }
}

impl fmt::Display for MetadataReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "metadata over gRPC to an in-process master, {} per cell: {} nodes sending heartbeats of {} ADD events; \
             {} route callers at batch {}; ratio = the row / the memory row",
            format_duration(o.duration),
            o.nodes,
            o.events_per_heartbeat,
            o.callers,
            o.batch
        )?;
        writeln!(f)?;
        writeln!(f, "{METADATA_TABLE_HEADER}")?;
        writeln!(f, "|---|---|---|---|---|---|---|")?;
        if let Some(base) = self.base() {
            for r in &self.rows {
                writeln!(
                    f,
                    "| {} | {} | {:.2} | {} | {:.2} | {} | {:.2} |",
                    r.store,
                    rate(r.events_per_s),
                    ratio(r.events_per_s, base.events_per_s),
                    rate(r.put_keys_per_s),
                    ratio(r.put_keys_per_s, base.put_keys_per_s),
                    rate(r.get_keys_per_s),
                    ratio(r.get_keys_per_s, base.get_keys_per_s)
                )?;
            }
        }
        if let Some(m) = &self.memory {
            writeln!(f)?;
            writeln!(
                f,
                "Redis memory per key: {:.0} bytes ({} keys of {KEY_BYTES} bytes, one node, one tier: \
                 used_memory {} -> {})",
                m.bytes_per_key(),
                m.keys,
                m.used_before,
                m.used_after
            )?;
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        Ok(())
    }
}

/// A `redis-server` on a free loopback port with persistence off, killed on drop.
struct RedisProcess {
    child: Child,
    port: u16,
}

impl RedisProcess {
    /// Starts `program` and waits (bounded) until it accepts connections.
    fn start(program: &str) -> Result<Self, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .map_err(|e| format!("no free loopback port: {e}"))?;
        let child = Command::new(program)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {program}: {e}"))?;
        let mut server = Self { child, port };
        let deadline = Instant::now() + REDIS_START;
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(format!("{program} on port {port} exited: {status}"));
            }
            if Instant::now() >= deadline {
                return Err(format!("{program} on port {port} did not start in {REDIS_START:?}"));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(server)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// `used_memory` of `INFO memory`, over a plain connection (inline command, one bulk reply).
    fn used_memory(&self) -> Result<u64, BenchError> {
        let fail = |e: String| BenchError::Failed(format!("INFO memory of the Redis on port {}: {e}", self.port));
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).map_err(|e| fail(e.to_string()))?;
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| fail(e.to_string()))?;
        s.write_all(b"INFO memory\r\n").map_err(|e| fail(e.to_string()))?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = s.read(&mut chunk).map_err(|e| fail(e.to_string()))?;
            if n == 0 {
                return Err(fail("connection closed".into()));
            }
            buf.extend_from_slice(&chunk[..n]);
            // `$LEN\r\n` then LEN bytes then `\r\n`.
            let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else { continue };
            let header = String::from_utf8_lossy(&buf[..eol]).into_owned();
            let len: usize = header
                .strip_prefix('$')
                .and_then(|l| l.parse().ok())
                .ok_or_else(|| fail(format!("reply {header:?}")))?;
            if buf.len() >= eol + 2 + len {
                let body = String::from_utf8_lossy(&buf[eol + 2..eol + 2 + len]).into_owned();
                return body
                    .lines()
                    .find_map(|l| l.strip_prefix("used_memory:"))
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| fail("no used_memory line".into()));
            }
        }
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A key of [`KEY_BYTES`] hex digits, unique per (`phase`, `a`, `b`, `c`).
fn key(phase: u64, a: u64, b: u64, c: u64) -> String {
    format!("{phase:016x}{a:016x}{b:016x}{c:016x}")
}

fn node_id(i: usize) -> String {
    format!("bench-meta-node-{i}")
}

fn dram(total: u64) -> Vec<v1::TierCapacity> {
    vec![v1::TierCapacity {
        tier: v1::TierType::TierDram as i32,
        total_bytes: total,
        available_bytes: total,
        page_size: 0,
    }]
}

/// A gRPC error as a bench failure.
fn grpc(what: &str) -> impl Fn(tonic::Status) -> BenchError + '_ {
    move |s| BenchError::Failed(format!("{what}: {} ({})", s.message(), s.code()))
}

/// A new connection to the master at `addr`.
async fn connect(addr: &str) -> Result<UmbpMasterClient<Channel>, BenchError> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| BenchError::Failed(format!("master address {addr}: {e}")))?;
    let channel = endpoint.connect().await.map_err(|e| BenchError::Failed(format!("connecting to {addr}: {e}")))?;
    Ok(UmbpMasterClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20))
}

/// Registers node `i` (incarnation 1, lending [`NODE_BYTES`] of DRAM).
async fn register(client: &mut UmbpMasterClient<Channel>, i: usize) -> Result<(), BenchError> {
    client
        .register_client(v1::RegisterClientRequest {
            node_id: node_id(i),
            node_address: "127.0.0.1".into(),
            tier_capacities: dram(NODE_BYTES),
            peer_address: format!("127.0.0.1:{}", 20_000 + i),
            incarnation: 1,
            ..Default::default()
        })
        .await
        .map_err(grpc("register"))?;
    Ok(())
}

/// Sends node `i`'s heartbeat `seq`: one bundle of `events` ADD events; checks that it was applied.
async fn heartbeat(
    client: &mut UmbpMasterClient<Channel>,
    phase: u64,
    i: usize,
    seq: u64,
    events: usize,
) -> Result<(), BenchError> {
    let events = (0..events as u64)
        .map(|j| v1::KvEvent {
            kind: v1::KvEventKind::KvEventAdd as i32,
            key: key(phase, i as u64, seq, j),
            tier: v1::TierType::TierDram as i32,
            size: VALUE_SIZE,
        })
        .collect();
    let reply = client
        .heartbeat(v1::HeartbeatRequest {
            node_id: node_id(i),
            bundles: vec![v1::EventBundle { seq, events }],
            tier_capacities: dram(NODE_BYTES),
            incarnation: 1,
            ..Default::default()
        })
        .await
        .map_err(grpc("heartbeat"))?
        .into_inner();
    if reply.status != v1::NodeStatus::Alive as i32 || reply.acked_seq != seq || reply.request_full_sync {
        return Err(BenchError::Failed(format!(
            "heartbeat seq {seq} of {} not applied: status {}, acked {}, full sync asked {}",
            node_id(i),
            reply.status,
            reply.acked_seq,
            reply.request_full_sync
        )));
    }
    Ok(())
}

/// Phase tags of the keys.
const INGEST: u64 = 1;
const PUT: u64 = 2;
const MEMORY: u64 = 3;

/// A tiny xorshift, for picking keys to route-get.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// The three cells against the master at `addr`.
async fn measure(o: &MetadataBenchOptions, store: &str, addr: &str) -> Result<MetadataRow, BenchError> {
    let mut progress = Progress::new(format!("umbp bench metadata: {store}"), 3);
    // Ingestion: every node registers first (not timed), then sends heartbeats until the deadline.
    let mut clients = Vec::with_capacity(o.nodes);
    for i in 0..o.nodes {
        let mut c = connect(addr).await?;
        register(&mut c, i).await?;
        clients.push(c);
    }
    let started = Instant::now();
    let until = started + o.duration;
    let events = o.events_per_heartbeat;
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            tokio::spawn(async move {
                let mut seq = 0u64;
                while Instant::now() < until {
                    seq += 1;
                    heartbeat(&mut c, INGEST, i, seq, events).await?;
                }
                Ok::<u64, BenchError>(seq)
            })
        })
        .collect();
    let mut seqs = Vec::with_capacity(o.nodes);
    for t in tasks {
        seqs.push(t.await.map_err(|e| BenchError::Failed(format!("heartbeat task: {e}")))??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let events_per_s = seqs.iter().sum::<u64>() as f64 * events as f64 / elapsed;
    progress.advance(1);

    // Route-put of new keys; route-get of ingested ones.
    let batch = o.batch;
    let put_keys_per_s = route_callers(o, addr, move |c, round| {
        let keys = (0..batch as u64).map(|j| key(PUT, c as u64, round, j)).collect();
        Call::Put(v1::BatchRoutePutRequest {
            node_id: format!("bench-meta-caller-{c}"),
            keys,
            block_sizes: vec![VALUE_SIZE; batch],
            exclude_nodes: Vec::new(),
            columnar: true,
        })
    })
    .await?;
    progress.advance(1);
    let seqs = std::sync::Arc::new(seqs);
    let get_keys_per_s = route_callers(o, addr, {
        let seqs = std::sync::Arc::clone(&seqs);
        move |c, round| {
            let mut state = (c as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (round + 1);
            let keys = (0..batch)
                .map(|_| {
                    let node = (next(&mut state) % seqs.len() as u64) as usize;
                    let seq = 1 + next(&mut state) % seqs[node].max(1);
                    key(INGEST, node as u64, seq, next(&mut state) % events as u64)
                })
                .collect();
            Call::Get(v1::BatchRouteGetRequest {
                node_id: format!("bench-meta-caller-{c}"),
                keys,
                exclude_nodes: Vec::new(),
            })
        }
    })
    .await?;
    progress.advance(1);
    progress.finish();
    Ok(MetadataRow { store: store.into(), events_per_s, put_keys_per_s, get_keys_per_s })
}

/// One batch route call.
enum Call {
    Put(v1::BatchRoutePutRequest),
    Get(v1::BatchRouteGetRequest),
}

/// [`MetadataBenchOptions::callers`] callers, each on its own connection, sending `make(caller,
/// round)` until the duration is up; keys decided per second. Every put must be routed and every
/// get found.
async fn route_callers<F>(o: &MetadataBenchOptions, addr: &str, make: F) -> Result<f64, BenchError>
where
    F: Fn(usize, u64) -> Call + Clone + Send + 'static,
{
    let mut clients = Vec::with_capacity(o.callers);
    for _ in 0..o.callers {
        clients.push(connect(addr).await?);
    }
    let started = Instant::now();
    let until = started + o.duration;
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, mut client)| {
            let make = make.clone();
            tokio::spawn(async move {
                let mut keys = 0u64;
                let mut round = 0u64;
                while Instant::now() < until {
                    match make(c, round) {
                        Call::Put(req) => {
                            let n = req.keys.len();
                            let reply = client.batch_route_put(req).await.map_err(grpc("batch route-put"))?;
                            let routed = reply
                                .get_ref()
                                .outcome
                                .iter()
                                .filter(|&&o| o == v1::RoutePutOutcome::RoutePutRouted as i32)
                                .count();
                            if routed != n {
                                return Err(BenchError::Failed(format!("route-put: {routed} of {n} keys routed")));
                            }
                            keys += n as u64;
                        }
                        Call::Get(req) => {
                            let n = req.keys.len();
                            let reply = client.batch_route_get(req).await.map_err(grpc("batch route-get"))?;
                            let found = reply.get_ref().node_ref.iter().filter(|&&r| r > 0).count();
                            if found != n {
                                return Err(BenchError::Failed(format!(
                                    "route-get: {found} of {n} ingested keys found"
                                )));
                            }
                            keys += n as u64;
                        }
                    }
                    round += 1;
                }
                Ok::<u64, BenchError>(keys)
            })
        })
        .collect();
    let mut keys = 0;
    for t in tasks {
        keys += t.await.map_err(|e| BenchError::Failed(format!("route task: {e}")))??;
    }
    Ok(keys as f64 / started.elapsed().as_secs_f64())
}

/// An in-process master on 127.0.0.1 over `metadata` (none: memory).
async fn start_master(metadata: Option<String>) -> Result<umbp_master::MasterHandle, BenchError> {
    Ok(umbp_master::start(MasterConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        // No simulated node may expire while the bench runs.
        heartbeat_ttl: Duration::from_secs(600),
        metadata,
        ..MasterConfig::default()
    })
    .await?)
}

/// The row of one store: a master over `metadata`, measured, shut down.
async fn row(o: &MetadataBenchOptions, store: &str, metadata: Option<String>) -> Result<MetadataRow, BenchError> {
    let master = start_master(metadata).await?;
    let result = measure(o, store, &master.local_addr().to_string()).await;
    master.shutdown().await;
    result
}

/// The memory step: one node indexes `o.memory_keys` keys through a master over a fresh Redis.
async fn memory_step(o: &MetadataBenchOptions) -> Result<MemoryReport, String> {
    let redis = RedisProcess::start(&o.redis_server)?;
    let master = start_master(Some(redis.url())).await.map_err(|e| e.to_string())?;
    let result = async {
        let mut client = connect(&master.local_addr().to_string()).await?;
        register(&mut client, 0).await?;
        let used_before = redis.used_memory()?;
        let per = o.events_per_heartbeat.clamp(128, 1024);
        let mut progress = Progress::new("umbp bench metadata: memory per key, keys", o.memory_keys);
        let (mut sent, mut seq) = (0usize, 0u64);
        while sent < o.memory_keys {
            let n = per.min(o.memory_keys - sent);
            seq += 1;
            heartbeat(&mut client, MEMORY, 0, seq, n).await?;
            sent += n;
            progress.advance(n);
        }
        progress.finish();
        let status = client
            .get_cluster_status(v1::GetClusterStatusRequest {})
            .await
            .map_err(grpc("cluster status"))?
            .into_inner();
        if status.total_keys != o.memory_keys as u64 {
            return Err(BenchError::Failed(format!(
                "the master indexed {} keys, not {}",
                status.total_keys, o.memory_keys
            )));
        }
        let used_after = redis.used_memory()?;
        Ok(MemoryReport { keys: o.memory_keys, used_before, used_after })
    }
    .await
    .map_err(|e: BenchError| e.to_string());
    master.shutdown().await;
    drop(redis);
    result
}

/// Runs the suite: the in-memory row, then (where `redis-server` starts) one Redis, the shards
/// and the memory step.
///
/// # Errors
/// [`BenchError::Options`] for options that can never work; [`BenchError::Failed`] or
/// [`BenchError::Master`] when a measured call fails or a master does not start.
pub async fn run(options: MetadataBenchOptions) -> Result<MetadataReport, BenchError> {
    options.validate()?;
    let o = &options;
    let mut rows = vec![row(o, "memory", None).await?];
    let mut notes = Vec::new();
    let mut memory = None;
    match RedisProcess::start(&o.redis_server) {
        Err(why) => notes.push(format!("{why}: only the in-memory row ran (install redis-server for the Redis rows)")),
        Ok(one) => {
            rows.push(row(o, "redis x1", Some(one.url())).await?);
            drop(one);
            let mut shards = Vec::with_capacity(o.shards);
            for _ in 0..o.shards {
                shards.push(RedisProcess::start(&o.redis_server).map_err(BenchError::Failed)?);
            }
            let urls: Vec<String> = shards.iter().map(RedisProcess::url).collect();
            rows.push(row(o, &format!("redis x{} (sharded)", o.shards), Some(urls.join(","))).await?);
            drop(shards);
            if o.memory_keys > 0 {
                match memory_step(o).await {
                    Ok(m) => memory = Some(m),
                    Err(why) => notes.push(format!("memory per key not measured: {why}")),
                }
            }
        }
    }
    Ok(MetadataReport { options, rows, memory, notes })
}
