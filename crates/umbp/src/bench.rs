//! `umbp bench`: batch put and batch get through `PoolClient` (issue 5, deliverable 6), each beside
//! its same-run baseline:
//!
//! - **local**: a node writing to and reading from its own DRAM medium, against raw `memcpy` of the
//!   same bytes on as many threads as the pool's local copy engine may use ([`memcpy_threads`]: the
//!   machine's best copy), measured on a quiet process right before and right after each round's
//!   cell (see [`quiet_memcpy_gbps`]); the bench warns when two baselines of one run disagree by more
//!   than [`BASELINE_TOLERANCE`]. The master runs with `local` put affinity, so it grants the node local
//!   placement and its puts need no route call; the `put (routed)` rows measure the same puts on a
//!   node of a second master without that affinity, where every chunk is routed first;
//! - **remote**: a client-only node in this process (with the shared-memory path off) and a DRAM node
//!   in a CHILD PROCESS (`umbp bench-child`, the same binary re-executed), bytes over the TCP data
//!   plane, against a plain socket stream of the same bytes (from the same source buffers, into the
//!   same destination buffers, the child's side a region as large as the batch) to and from the same
//!   child, over as many connections as the data plane pools ([`CONNECTIONS`]);
//! - **same host**: the same child read and written by a client with the shared-memory path on (issue
//!   17), in the same rounds as the remote rows: each figure beside the memcpy baseline (as the local
//!   rows'; a get also beside memcpy from a source in memory, where a put leaves a holder's bytes,
//!   and beside the same copy with streaming stores, a large batch get's own copy; a put beside its
//!   own streamed copy: see [`bench_memcpy`](crate::bench_memcpy)) and beside
//!   the TCP path's figure of the same round,
//!   the bench failing if the TCP engine moved any of these bytes;
//! - the p50 / p99 latency of a single 64 KiB remote get and of a single 64 KiB remote put, each on
//!   both client paths in the same run (`measure_latency`: the default keyed path, one exchange
//!   with the holder's data server, and the routed path of a client with `keyed_requests = false`,
//!   in alternating blocks), and of `umbp get` of the value as a process beside `umbp --version`
//!   ([`bench_cli`](crate::bench_cli)).
//!
//! The same measurements as `cargo bench -p umbp --bench pool`; each cell is the median of
//! [`BenchOptions::rounds`] rounds.

use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_master::MasterConfig;
use umbp_master::routing::Affinity;
use umbp_peer::pool_client::{DramConfig, Medium, PoolClient, PoolClientConfig, RecachePolicy};

use crate::bench_breakdown::{BatchPhases, Recorder, Samples, batch_phases_table, recorded};
use crate::bench_keyed::SameHostKeys;
pub(crate) use crate::bench_latency::latency_blocks;
use crate::bench_latency::{LATENCY_KEY, measure_large_latency, measure_latency};
pub use crate::bench_latency::{Latencies, Latency};
pub use crate::bench_memcpy::{
    memcpy_from_memory_gbps, memcpy_threads, quiet_memcpy_gbps, streamed_copy_gbps, streamed_from_memory_gbps,
};
use crate::cli::BenchArgs;
use crate::progress::Progress;
use crate::units::human_size;

/// Raw TCP connections of the remote baseline (the data plane's pooled connections per peer).
pub const CONNECTIONS: usize = 4;

/// The value sizes measured.
pub const VALUE_SIZES: [usize; 2] = [64 << 10, 1 << 20];

/// The size of the value whose single-get latency is measured.
pub const LATENCY_VALUE: usize = 64 << 10;

/// The size of the value whose single get and put are measured on the same-host paths: through
/// shared memory (the default client) beside TCP (a client with `shared_memory = false`).
pub const LATENCY_LARGE_VALUE: usize = 1 << 20;

/// Calls per path of the [`LATENCY_LARGE_VALUE`] probes for `calls` of the 64 KiB ones: a quarter
/// (each call moves 16× the bytes, and every put is kept in the child's memory), at least 100 (for
/// a p99).
pub fn large_latency_calls(calls: usize) -> usize {
    calls.div_ceil(4).max(100)
}

/// Blocks the single-call probes alternate the two client paths in (each path's calls split evenly),
/// so a change in the machine's load during the probe reaches both paths alike.
pub const LATENCY_BLOCKS: usize = 10;

/// Untimed calls of each kind on each path before a probe (connections, location cache, allocator).
pub(crate) const WARM_UP: usize = 10;

/// The memcpy baseline's name in the table.
const MEMCPY: &str = "memcpy";

/// The baseline name of the same-host get rows measured against memcpy from a source in memory
/// ([`memcpy_from_memory_gbps`]).
const MEMCPY_FROM_MEMORY: &str = "memcpy, source in memory";

/// The baseline name of the same-host get rows measured against the get's own copy of a large
/// batch, streaming stores from a source in memory ([`streamed_from_memory_gbps`]).
const STREAMED_FROM_MEMORY: &str = "copy with streaming stores, source in memory";

/// The baseline name of the same-host put rows measured against the put's own copy, with
/// streaming stores ([`streamed_copy_gbps`]).
const STREAMED_COPY: &str = "copy with streaming stores";

/// The baseline name of the same-host rows measured against the pool's own TCP path.
const POOL_TCP: &str = "pool over TCP";

/// The engines whose moved bytes tell which path a same-host batch took.
const SHM_ENGINE: &str = "SharedMemoryEngine";
const TCP_ENGINE: &str = "TcpEngine";

/// Page size of the bench nodes.
const PAGE_SIZE: u64 = 64 << 10;

/// How long the bench waits for the master to index keys, or for the child to start.
const WAIT: Duration = Duration::from_secs(30);

/// The line the child prints once it serves; the raw sink/source address follows.
const READY_PREFIX: &str = "bench-child ready raw=";

/// How far apart (max / min − 1) two same-kind baselines of one run may be before the bench warns.
pub const BASELINE_TOLERANCE: f64 = 0.20;

/// The header of the markdown table.
pub const TABLE_HEADER: &str = "| path | op | value | PoolClient GB/s | baseline GB/s | baseline | ratio |";

/// What the bench runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchOptions {
    /// Rounds per cell; the medians are reported. Default: 5.
    pub rounds: usize,
    /// Bytes per batch put / batch get (at least 1 MiB). Default: 64 MiB.
    pub batch_bytes: u64,
    /// Single gets timed for the latency percentiles. Default: 1000.
    pub latency_calls: usize,
    /// The program run as the child node, with `bench-child --master ADDR --capacity BYTES`.
    /// Default: this executable.
    pub child_program: Option<PathBuf>,
    /// Also time the phases of single remote puts and gets (`--breakdown`, see
    /// [`bench_breakdown`](crate::bench_breakdown)). Default: off.
    pub breakdown: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self { rounds: 5, batch_bytes: 64 << 20, latency_calls: 1000, child_program: None, breakdown: false }
    }
}

impl BenchOptions {
    /// The defaults overridden by the flags that are set.
    pub fn from_args(args: &BenchArgs) -> Self {
        let d = Self::default();
        Self {
            rounds: args.rounds.unwrap_or(d.rounds),
            batch_bytes: args.batch_bytes.unwrap_or(d.batch_bytes),
            latency_calls: args.latency_calls.unwrap_or(d.latency_calls),
            child_program: None,
            breakdown: args.breakdown,
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        let bad = |reason: String| Err(BenchError::Options(reason));
        if self.rounds == 0 {
            return bad("--rounds must be at least 1".into());
        }
        if self.batch_bytes < 1 << 20 {
            return bad(format!("--batch-bytes {}: at least 1MiB (one 1 MiB value)", self.batch_bytes));
        }
        if self.batch_bytes > 4 << 30 {
            return bad(format!("--batch-bytes {}: at most 4GiB", self.batch_bytes));
        }
        if self.latency_calls < 100 {
            return bad(format!("--latency-calls {}: at least 100 (for a p99)", self.latency_calls));
        }
        Ok(())
    }

    /// DRAM each bench node lends: every round's keys of both sizes (the local node keeps them all),
    /// with room below the master's eviction watermark.
    fn capacity(&self) -> u64 {
        Self::room_for(2 * self.rounds as u64 * self.batch_bytes)
    }

    /// DRAM the child node lends: [`capacity`](Self::capacity) plus the single puts of both client
    /// paths, of the latency probe and of the breakdown (warm-ups included), kept until the end.
    fn child_capacity(&self) -> u64 {
        let singles = 4 * (self.latency_calls + WARM_UP) as u64 * LATENCY_VALUE as u64
            + 2 * (large_latency_calls(self.latency_calls) + WARM_UP + 1) as u64 * LATENCY_LARGE_VALUE as u64;
        Self::room_for(2 * self.rounds as u64 * self.batch_bytes + singles)
    }

    /// `stored` bytes with room below the master's eviction watermark, in whole pages.
    fn room_for(stored: u64) -> u64 {
        (stored + stored / 2 + (64 << 20)).div_ceil(PAGE_SIZE) * PAGE_SIZE
    }
}

/// Why the bench could not run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The options can never work.
    #[error("{0}")]
    Options(String),
    /// The embedded master did not start.
    #[error("starting the master: {0}")]
    Master(#[from] umbp_master::MasterError),
    /// A node did not start.
    #[error("starting node {node}: {source}")]
    Node {
        /// The node.
        node: String,
        /// The cause.
        #[source]
        source: umbp_peer::pool_client::PoolError,
    },
    /// The child process failed.
    #[error("the child node process: {0}")]
    Child(String),
    /// An operation under measurement failed.
    #[error("{0}")]
    Failed(String),
}

/// Where a row's bytes went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchPath {
    /// The node's own medium, in this process.
    Local,
    /// A node in another process, over the TCP data plane.
    Remote,
    /// A node in another process on this host, through its shared memory (issue 17).
    SameHost,
}

/// One row of the table: a PoolClient figure beside its baseline.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRow {
    /// Local or remote.
    pub path: BenchPath,
    /// `put` or `get`.
    pub op: &'static str,
    /// Bytes per value.
    pub value_bytes: u64,
    /// PoolClient throughput, GB/s (median).
    pub pool_gbps: f64,
    /// Baseline throughput, GB/s (median).
    pub baseline_gbps: f64,
    /// What the baseline is.
    pub baseline: String,
    /// Lowest and highest baseline sample of the row's rounds, GB/s (their spread shows a disturbed
    /// baseline).
    pub baseline_range: (f64, f64),
    /// For memcpy rows, the median of the old, unsettled baseline of the same rounds: one thread's
    /// timed copy taken the moment the cell before it returned, with no settle and no warm-up. Beside
    /// [`baseline_gbps`](Self::baseline_gbps) it shows what the cell's background work costs a copy.
    pub unsettled_baseline_gbps: Option<f64>,
}

impl BenchRow {
    /// PoolClient / baseline.
    pub fn ratio(&self) -> f64 {
        self.pool_gbps / self.baseline_gbps
    }
}

/// What the bench measured.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    /// Rounds per cell.
    pub rounds: usize,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// The table.
    pub rows: Vec<BenchRow>,
    /// The single 64 KiB remote get and put, keyed and routed.
    pub latency: Latencies,
    /// Threads of the memcpy baseline ([`memcpy_threads`]).
    pub memcpy_threads: usize,
    /// One line per pair of same-kind baselines of this run that differ by more than
    /// [`BASELINE_TOLERANCE`]; empty when the baselines agree.
    pub baseline_warnings: Vec<String>,
    /// Where the time of one remote put and get goes on the keyed path (`--breakdown` only).
    pub breakdown: Option<crate::bench_breakdown::Breakdown>,
    /// The same on the routed path, recorded in blocks alternating with the keyed ones.
    pub breakdown_routed: Option<crate::bench_breakdown::Breakdown>,
    /// `umbp get` of the latency value as a process, beside `umbp --version` ([`crate::bench_cli`]).
    pub cli_get: Option<crate::bench_cli::CliGet>,
    /// Where the time of the remote and same-host batches went, phase by phase (`--breakdown` only).
    pub batch_phases: Vec<BatchPhases>,
    /// Which path the same-host batches' keys took, per value size.
    pub same_host_keys: Vec<SameHostKeys>,
}

fn value_label(bytes: u64) -> String {
    human_size(bytes)
}

impl BenchReport {
    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"path\":\"{}\",\"op\":\"{}\",\"value_bytes\":{},\"pool_gbps\":{:.4},\"baseline_gbps\":{:.4},\
                     \"baseline\":\"{}\",\"ratio\":{:.4},\"baseline_min_gbps\":{:.4},\"baseline_max_gbps\":{:.4},\"baseline_unsettled_gbps\":{}}}",
                    path_label(r.path),
                    r.op,
                    r.value_bytes,
                    r.pool_gbps,
                    r.baseline_gbps,
                    r.baseline,
                    r.ratio(),
                    r.baseline_range.0,
                    r.baseline_range.1,
                    r.unsettled_baseline_gbps.map_or_else(|| "null".to_owned(), |g| format!("{g:.4}"))
                )
            })
            .collect();
        format!(
            "{{\"rounds\":{},\"batch_bytes\":{},\"rows\":[{}],\"latency\":{},\"latency_routed\":{},\"put_latency\":{},\
             \"put_latency_routed\":{},\"latency_1m_shm\":{},\"latency_1m_tcp\":{},\"put_latency_1m_shm\":{},\
             \"put_latency_1m_tcp\":{},\"memcpy_threads\":{},\"baseline_warnings\":[{}],\"breakdown\":{},\"breakdown_routed\":{},\
             \"cli_get\":{},\"batch_phases\":[{}],\"same_host_keys\":[{}]}}",
            self.rounds,
            self.batch_bytes,
            rows.join(","),
            self.latency.get.to_json(),
            self.latency.get_routed.to_json(),
            self.latency.put.to_json(),
            self.latency.put_routed.to_json(),
            self.latency.get_large.to_json_of(LATENCY_LARGE_VALUE),
            self.latency.get_large_tcp.to_json_of(LATENCY_LARGE_VALUE),
            self.latency.put_large.to_json_of(LATENCY_LARGE_VALUE),
            self.latency.put_large_tcp.to_json_of(LATENCY_LARGE_VALUE),
            self.memcpy_threads,
            self.baseline_warnings.iter().map(|w| format!("\"{}\"", w.replace('"', "'"))).collect::<Vec<_>>().join(","),
            self.breakdown.as_ref().map_or_else(|| "null".to_owned(), |b| b.to_json()),
            self.breakdown_routed.as_ref().map_or_else(|| "null".to_owned(), |b| b.to_json()),
            self.cli_get.as_ref().map_or_else(|| "null".to_owned(), crate::bench_cli::CliGet::to_json),
            self.batch_phases.iter().map(BatchPhases::to_json).collect::<Vec<_>>().join(","),
            self.same_host_keys.iter().map(SameHostKeys::to_json).collect::<Vec<_>>().join(",")
        )
    }
}

/// Compares every pair of rows with the same baseline (same kind, same value size, and for raw TCP the
/// same direction): one warning per pair whose medians differ by more than [`BASELINE_TOLERANCE`].
/// Also warns of a memcpy baseline slower than its own unsettled one-thread sample (the cores were
/// busy, so the threaded copy is not the machine's best).
pub fn baseline_warnings(rows: &[BenchRow]) -> Vec<String> {
    // Rows of one cell share one baseline (local put and get): one entry per distinct baseline.
    let mut distinct: Vec<(&BenchRow, String)> = Vec::new();
    for r in rows {
        match distinct.iter_mut().find(|(d, _)| {
            d.path == r.path
                && d.value_bytes == r.value_bytes
                && d.baseline == r.baseline
                && d.baseline_gbps == r.baseline_gbps
        }) {
            Some((_, ops)) => {
                ops.push('/');
                ops.push_str(r.op);
            }
            None => distinct.push((r, format!("{} {}", path_label(r.path), r.op))),
        }
    }
    let mut warnings = Vec::new();
    for (r, ops) in &distinct {
        // All baselines of a run can be low together (a neighbour holding a core throughout): then the
        // threaded best copy is no faster than one thread's hasty copy of the same rounds.
        if let Some(one) = r.unsettled_baseline_gbps.filter(|&one| r.baseline_gbps < one) {
            warnings.push(format!(
                "{} baseline of {ops} {} reads {:.2} GB/s on all threads, below one thread's {one:.2} GB/s: the \
                 cores were busy",
                r.baseline,
                value_label(r.value_bytes),
                r.baseline_gbps
            ));
        }
    }
    for (i, (a, a_ops)) in distinct.iter().enumerate() {
        for (b, b_ops) in &distinct[i + 1..] {
            // memcpy is one copy for put and get; a raw TCP write and a raw TCP read (or the pool's TCP
            // put and get) are two different baselines, never compared.
            let direction = |r: &BenchRow| if r.baseline == MEMCPY { "" } else { r.op };
            if a.baseline != b.baseline || a.value_bytes != b.value_bytes || direction(a) != direction(b) {
                continue;
            }
            let ((lo, lo_ops), (hi, hi_ops)) =
                if a.baseline_gbps < b.baseline_gbps { ((a, a_ops), (b, b_ops)) } else { ((b, b_ops), (a, a_ops)) };
            if hi.baseline_gbps > lo.baseline_gbps * (1.0 + BASELINE_TOLERANCE) {
                warnings.push(format!(
                    "{} baseline of {lo_ops} {} reads {:.2} GB/s but {:.2} GB/s for {hi_ops}: more than {:.0}% \
                     apart, the machine was not quiet",
                    a.baseline,
                    value_label(lo.value_bytes),
                    lo.baseline_gbps,
                    hi.baseline_gbps,
                    BASELINE_TOLERANCE * 100.0
                ));
            }
        }
    }
    warnings
}

fn path_label(path: BenchPath) -> &'static str {
    match path {
        BenchPath::Local => "local",
        BenchPath::Remote => "remote",
        BenchPath::SameHost => "same-host",
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "PoolClient batch put/get, {} per batch, medians of {} rounds; memcpy baseline on {} threads",
            human_size(self.batch_bytes),
            self.rounds,
            self.memcpy_threads
        )?;
        writeln!(f)?;
        writeln!(f, "{TABLE_HEADER}")?;
        writeln!(f, "|---|---|---|---|---|---|---|")?;
        for r in &self.rows {
            let path = match r.path {
                BenchPath::Local => "local",
                BenchPath::Remote => "remote (2 processes, TCP)",
                BenchPath::SameHost => "same host (2 processes, shared memory)",
            };
            writeln!(
                f,
                "| {path} | {} | {} | {:.2} | {:.2} | {} | {:.2} |",
                r.op,
                value_label(r.value_bytes),
                r.pool_gbps,
                r.baseline_gbps,
                r.baseline,
                r.ratio()
            )?;
        }
        writeln!(f)?;
        write!(f, "{}", self.latency)?;
        if let Some(c) = &self.cli_get {
            write!(f, "\n{c}")?;
        }
        for b in [&self.breakdown_routed, &self.breakdown].into_iter().flatten() {
            write!(f, "\n\n{b}")?;
        }
        for k in &self.same_host_keys {
            write!(f, "\n{k}")?;
        }
        if !self.batch_phases.is_empty() {
            write!(f, "\n\n{}", batch_phases_table(&self.batch_phases))?;
        }
        for w in &self.baseline_warnings {
            write!(f, "\nwarning: {w}")?;
        }
        Ok(())
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn gbps(bytes: usize, since: Instant) -> f64 {
    bytes as f64 / since.elapsed().as_secs_f64() / 1e9
}

pub(crate) fn node_config(id: &str, master: &str, medium: Medium) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, master).with_medium(medium);
    c.page_size = PAGE_SIZE;
    c.recache = RecachePolicy::Off;
    c
}

fn dram(bytes: u64) -> Medium {
    Medium::Dram(DramConfig { capacity_bytes: bytes, prefault: true, ..DramConfig::default() })
}

pub(crate) async fn start_node(config: PoolClientConfig) -> Result<PoolClient, BenchError> {
    let node = config.node_id.clone();
    PoolClient::start(config).await.map_err(|source| BenchError::Node { node, source })
}

/// Waits until the master's index lists every key.
pub(crate) async fn until_indexed(client: &PoolClient, keys: &[String]) -> Result<(), BenchError> {
    let deadline = Instant::now() + WAIT;
    loop {
        let found = client.master().batch_lookup(keys).await.map_err(|e| BenchError::Failed(format!("lookup: {e}")))?;
        if found.iter().all(|f| *f) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(BenchError::Failed(format!("the master never indexed the keys within {WAIT:?}")));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `umbp bench-child`: a DRAM node plus a raw TCP sink/source on 127.0.0.1; prints its ready line
/// with the raw address, then serves until stdin closes (the parent exits or drops the pipe).
pub async fn serve_child(master: &str, capacity: u64) -> Result<(), BenchError> {
    let node = start_node(node_config("bench-node", master, dram(capacity))).await?;
    let raw = TcpListener::bind("127.0.0.1:0").map_err(|e| BenchError::Child(format!("binding the raw sink: {e}")))?;
    let raw_addr = raw.local_addr().map_err(|e| BenchError::Child(e.to_string()))?;
    std::thread::spawn(move || {
        let arenas = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        for stream in raw.incoming().flatten() {
            let arenas = std::sync::Arc::clone(&arenas);
            std::thread::spawn(move || raw_peer(stream, &arenas));
        }
    });
    println!("{READY_PREFIX}{raw_addr}");
    let _ = std::io::stdout().flush();
    let _ = tokio::task::spawn_blocking(|| {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
    })
    .await;
    node.close().await;
    Ok(())
}

/// One raw connection: a 9-byte header (b'w' or b'r' + u64 length) then that many bytes in or out,
/// then a one-byte ack. The bytes land in (or leave from) a region as large as the request, as the
/// pool's bytes land in distinct pages; it is allocated on the first request and reused after.
fn raw_peer(mut s: TcpStream, arenas: &std::sync::Mutex<Vec<Vec<u8>>>) {
    let _ = s.set_nodelay(true);
    // Every round opens new connections: reuse the regions the last ones faulted in.
    let mut arena: Vec<u8> = arenas.lock().ok().and_then(|mut a| a.pop()).unwrap_or_default();
    raw_serve(&mut s, &mut arena);
    if let Ok(mut a) = arenas.lock() {
        a.push(arena);
    }
}

fn raw_serve(s: &mut TcpStream, arena: &mut Vec<u8>) {
    let mut header = [0u8; 9];
    while s.read_exact(&mut header).is_ok() {
        let mut len = [0u8; 8];
        len.copy_from_slice(&header[1..9]);
        let Ok(len) = usize::try_from(u64::from_le_bytes(len)) else { return };
        if len > 4 << 30 {
            return;
        }
        if arena.len() < len {
            arena.resize(len, 7);
        }
        let region = &mut arena[..len];
        let ok = if header[0] == b'w' { s.read_exact(region).is_ok() } else { s.write_all(region).is_ok() };
        if !ok || s.write_all(&[1]).is_err() {
            return;
        }
    }
}

/// GB/s of moving the same bytes as the pool over [`CONNECTIONS`] raw streams: `write` sends
/// `values` to the child, a read fills `values` from it. Each stream carries a contiguous share of
/// the values, one `write_all` / `read_exact` per value.
fn raw_rate(addr: &str, values: &mut [Vec<u8>], write: bool) -> std::io::Result<f64> {
    let total: usize = values.iter().map(Vec::len).sum();
    let per = values.len().div_ceil(CONNECTIONS).max(1);
    let start = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = values
            .chunks_mut(per)
            .map(|share| {
                s.spawn(move || -> std::io::Result<()> {
                    let mut c = TcpStream::connect(addr)?;
                    c.set_nodelay(true)?;
                    let bytes: usize = share.iter().map(Vec::len).sum();
                    let mut header = [0u8; 9];
                    header[0] = if write { b'w' } else { b'r' };
                    header[1..].copy_from_slice(&(bytes as u64).to_le_bytes());
                    c.write_all(&header)?;
                    for v in share.iter_mut() {
                        if write {
                            c.write_all(v)?;
                        } else {
                            c.read_exact(v)?;
                        }
                    }
                    let mut ack = [0u8; 1];
                    c.read_exact(&mut ack)
                })
            })
            .collect();
        for w in workers {
            w.join().map_err(|_| std::io::Error::other("a raw stream thread panicked"))??;
        }
        Ok::<(), std::io::Error>(())
    })?;
    Ok(gbps(total, start))
}

fn raw_rate_blocking(addr: &str, values: &mut [Vec<u8>], write: bool) -> Result<f64, BenchError> {
    // The streams block: keep them off the reactor's scheduling loop.
    tokio::task::block_in_place(|| raw_rate(addr, values, write))
        .map_err(|e| BenchError::Failed(format!("raw stream to the child: {e}")))
}

/// Starts `program bench-child` lending `capacity` bytes of DRAM to `master`; returns its guard and
/// the address of its raw sink/source once it serves.
pub(crate) async fn start_child(
    program: &std::path::Path,
    master: &str,
    capacity: u64,
) -> Result<(ChildGuard, String), BenchError> {
    let mut child = ChildGuard(
        Command::new(program)
            .args(["bench-child", "--master", master, "--capacity", &capacity.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| BenchError::Child(format!("spawning {}: {e}", program.display())))?,
    );
    let stdout = child.0.stdout.take().ok_or_else(|| BenchError::Child("no stdout".into()))?;
    let raw_addr = tokio::time::timeout(
        WAIT,
        tokio::task::spawn_blocking(move || {
            for line in BufReader::new(stdout).lines() {
                let line = line.map_err(|e| BenchError::Child(format!("reading its output: {e}")))?;
                if let Some(addr) = line.strip_prefix(READY_PREFIX) {
                    return Ok(addr.to_owned());
                }
            }
            Err(BenchError::Child("it exited before it was ready".into()))
        }),
    )
    .await
    .map_err(|_| BenchError::Child(format!("not ready within {WAIT:?}")))?
    .map_err(|e| BenchError::Child(e.to_string()))??;
    Ok((child, raw_addr))
}

/// Stops the child when dropped: closes its stdin (it leaves the cluster and exits), kills it if it
/// is still there after two seconds, and reaps it.
pub(crate) struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        drop(self.0.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(2);
        while matches!(self.0.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn fail(what: &str, results: &[Result<impl Sized, impl fmt::Display>]) -> Result<(), BenchError> {
    match results.iter().find_map(|r| r.as_ref().err()) {
        Some(e) => Err(BenchError::Failed(format!("{what}: {e}"))),
        None => Ok(()),
    }
}

/// Runs the bench: an embedded master on 127.0.0.1, a local node, then a node in a child process.
pub async fn run(options: BenchOptions) -> Result<BenchReport, BenchError> {
    options.validate()?;
    if options.breakdown {
        // The process's subscriber only logs: the phase spans are timed on a runtime of their own.
        return crate::bench_breakdown::on_recording_runtime(move || run_validated(options)).await?;
    }
    run_validated(options).await
}

async fn run_validated(options: BenchOptions) -> Result<BenchReport, BenchError> {
    // `local` affinity: the master grants the local node local placement (its puts skip the route
    // call). The remote rows are unaffected: their writer lends no medium, so it is never granted.
    let master = bench_master(Affinity::Local).await?;
    let result = measure(&options, &master.local_addr().to_string()).await;
    master.shutdown().await;
    result
}

/// An in-process master on 127.0.0.1 with the given put affinity.
pub(crate) async fn bench_master(affinity: Affinity) -> Result<umbp_master::MasterHandle, BenchError> {
    Ok(umbp_master::start(MasterConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        // Heartbeats every second, so small batches (fewer keys than the auto-flush threshold) are
        // indexed quickly; the wait for the index is not timed.
        heartbeat_ttl: Duration::from_secs(2),
        route_put_affinity: affinity,
        ..MasterConfig::default()
    })
    .await?)
}

async fn measure(options: &BenchOptions, master: &str) -> Result<BenchReport, BenchError> {
    let rounds = options.rounds;
    let batch = options.batch_bytes as usize;
    let mut rows = Vec::new();

    // Local: a node with its own medium, alone in the cluster, granted local placement.
    let local = start_node(node_config("local", master, dram(options.capacity()))).await?;
    let local_result = measure_local(&local, rounds, batch, LocalRows::Granted, &mut rows).await;
    local.close().await;
    local_result?;

    // The same puts through a master without `local` affinity: every chunk is routed first.
    let routed_master = bench_master(Affinity::None).await?;
    let routed_result = async {
        let addr = routed_master.local_addr().to_string();
        let node = start_node(node_config("local-routed", &addr, dram(options.capacity()))).await?;
        let result = measure_local(&node, rounds, batch, LocalRows::Routed, &mut rows).await;
        node.close().await;
        result
    }
    .await;
    routed_master.shutdown().await;
    routed_result?;

    // Remote: a DRAM node in a child process; this process is a client-only node.
    let program = match &options.child_program {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| BenchError::Child(format!("finding this executable: {e}")))?,
    };
    let (child, raw_addr) = start_child(&program, master, options.child_capacity()).await?;

    let client = start_node(node_config("bench-client", master, Medium::None)).await?;
    // The same client on the routed path, for the single-call probes.
    let mut routed_config = node_config("bench-client-routed", master, Medium::None);
    routed_config.keyed_requests = false;
    let routed = match start_node(routed_config).await {
        Ok(routed) => routed,
        Err(e) => {
            client.close().await;
            return Err(e);
        }
    };
    // The remote rows' client: the child is on this host, so only with the shared path off do the
    // batches cross the TCP data plane.
    let mut tcp_config = node_config("bench-client-tcp", master, Medium::None);
    tcp_config.shared_memory = false;
    let tcp = match start_node(tcp_config).await {
        Ok(tcp) => tcp,
        Err(e) => {
            routed.close().await;
            client.close().await;
            return Err(e);
        }
    };
    let (mut batch_phases, mut same_host_keys) = (Vec::new(), Vec::new());
    let result = async {
        let clients = Clients { tcp: &tcp, shm: &client };
        let found = (&mut rows, &mut batch_phases, &mut same_host_keys);
        measure_remote(&clients, &raw_addr, rounds, batch, found).await?;
        let mut latency = measure_latency(&client, &routed, options.latency_calls).await?;
        measure_large_latency(&client, &tcp, large_latency_calls(options.latency_calls), &mut latency).await?;
        // The key the latency probe stored, got by `umbp get` processes (light clients).
        let cli_get = crate::bench_cli::measure(&program, master, LATENCY_KEY, LATENCY_VALUE as u64).await?;
        let breakdown = if options.breakdown {
            Some(crate::bench_breakdown::measure(&client, &routed, options.latency_calls).await?)
        } else {
            None
        };
        Ok::<_, BenchError>((latency, breakdown, cli_get))
    }
    .await;
    tcp.close().await;
    routed.close().await;
    client.close().await;
    drop(child);
    let (latency, breakdown, cli_get) = result?;
    let (breakdown, breakdown_routed) = breakdown.unzip();
    let baseline_warnings = baseline_warnings(&rows);
    for w in &baseline_warnings {
        crate::progress::note(format_args!("umbp bench: warning: {w}"));
    }
    Ok(BenchReport {
        rounds,
        batch_bytes: options.batch_bytes,
        rows,
        latency,
        memcpy_threads: memcpy_threads(),
        baseline_warnings,
        breakdown,
        breakdown_routed,
        cli_get: Some(cli_get),
        batch_phases,
        same_host_keys,
    })
}

/// Which local rows [`measure_local`] produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LocalRows {
    /// Put and get on a node granted local placement.
    Granted,
    /// Put only, on a node whose every put chunk is routed at the master.
    Routed,
}

async fn measure_local(
    local: &PoolClient,
    rounds: usize,
    batch: usize,
    which: LocalRows,
    rows: &mut Vec<BenchRow>,
) -> Result<(), BenchError> {
    for value in VALUE_SIZES {
        let n = batch / value;
        let bytes = n * value;
        let mut data: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let mut out: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let (mut put, mut get, mut copy, mut unsettled) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let what = match which {
            LocalRows::Granted => "local",
            LocalRows::Routed => "local routed",
        };
        let mut progress =
            Progress::new(format!("umbp bench: {what} {} values, rounds", human_size(value as u64)), rounds);
        for round in 0..rounds {
            let keys: Vec<String> = (0..n).map(|i| format!("local-{value}-{round}-{i}")).collect();
            stamp_values(&mut data, stamp_seed(1, round));
            let items: Vec<(&str, &[u8])> = keys.iter().zip(&data).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
            // The baseline right before the cell and right after it, each on a settled process; the
            // round's sample is the better of the two (a copy a neighbour interrupted is not the best).
            let (before, hasty) = quiet_memcpy_gbps(&mut out, &data, bytes).await;
            unsettled.push(hasty);
            let t = Instant::now();
            let results = local.batch_put(&items).await;
            put.push(gbps(bytes, t));
            fail("local put", &results)?;
            if which == LocalRows::Routed {
                let (after, hasty) = quiet_memcpy_gbps(&mut out, &data, bytes).await;
                copy.push(before.max(after));
                unsettled.push(hasty);
                progress.advance(1);
                continue;
            }
            let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            poison(&mut out);
            let mut slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
            let t = Instant::now();
            let results = local.batch_get(&key_refs, &mut slices).await;
            get.push(gbps(bytes, t));
            fail("local get", &results)?;
            verify("local", &out, &data)?;
            let (after, hasty) = quiet_memcpy_gbps(&mut out, &data, bytes).await;
            copy.push(before.max(after));
            unsettled.push(hasty);
            progress.advance(1);
        }
        progress.finish();
        let range = spread(&copy);
        let copy = median(copy);
        let unsettled = median(unsettled);
        let cells = match which {
            LocalRows::Granted => vec![("put", put), ("get", get)],
            LocalRows::Routed => vec![("put (routed)", put)],
        };
        for (op, figures) in cells {
            rows.push(BenchRow {
                path: BenchPath::Local,
                op,
                value_bytes: value as u64,
                pool_gbps: median(figures),
                baseline_gbps: copy,
                baseline: MEMCPY.into(),
                baseline_range: range,
                unsettled_baseline_gbps: Some(unsettled),
            });
        }
    }
    Ok(())
}

/// The lowest and highest of `samples`.
fn spread(samples: &[f64]) -> (f64, f64) {
    samples.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// The two clients of the child's rows: the TCP path and the shared-memory path.
struct Clients<'a> {
    tcp: &'a PoolClient,
    shm: &'a PoolClient,
}

/// The seed of a round's values: each path (`path`) and round stamps values of its own.
fn stamp_seed(path: u64, round: usize) -> u64 {
    (path << 32) | round as u64
}

/// Fills each value with bytes of its own, from `seed` (the path and round) and its index: a fill
/// byte, and in every 4 KiB page a 16-byte stamp of (seed, index, page). A value read back from
/// another key, another round or left unwritten differs from the one put, so [`verify`] can fail
/// in every round, not only the first. Cheap (a memset and a store per page), since it runs per
/// round beside the timed cells.
pub(crate) fn stamp_values(values: &mut [Vec<u8>], seed: u64) {
    for (i, value) in values.iter_mut().enumerate() {
        // splitmix64 of the seed and index.
        let mut z =
            seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_add(1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let key = z ^ (z >> 31);
        // Never the poison byte, so an unwritten tail shows.
        let fill = match key as u8 {
            POISON => !POISON,
            b => b,
        };
        value.fill(fill);
        for (page, chunk) in value.chunks_mut(4096).enumerate() {
            let mut stamp = [0u8; 16];
            stamp[..8].copy_from_slice(&key.to_le_bytes());
            stamp[8..].copy_from_slice(&(page as u64).to_le_bytes());
            let n = chunk.len().min(16);
            chunk[..n].copy_from_slice(&stamp[..n]);
        }
    }
}

/// The byte of a poisoned buffer.
const POISON: u8 = 0xA5;

/// What every destination buffer holds before a get (untimed): a get that leaves a buffer or part
/// of one unwritten fails [`verify`], whatever an earlier round or baseline copied there.
pub(crate) fn poison(out: &mut [Vec<u8>]) {
    for buf in out {
        buf.fill(POISON);
    }
}

/// Every value read back equals the one put, byte for byte (the whole batch, not a sample).
pub(crate) fn verify(what: &str, out: &[Vec<u8>], data: &[Vec<u8>]) -> Result<(), BenchError> {
    if out.len() != data.len() {
        return Err(BenchError::Failed(format!("{what} get: {} buffers for {} values", out.len(), data.len())));
    }
    match out.iter().zip(data).position(|(o, d)| o != d) {
        Some(i) => Err(BenchError::Failed(format!("{what} get returned other bytes than were put (value {i})"))),
        None => Ok(()),
    }
}

/// One batch put then batch get of `data` under `keys` through `client`, every value checked
/// byte-exact (into destinations poisoned first); returns (put GB/s, get GB/s). The keys are removed after (read leases lapse first).
async fn put_get_round(
    client: &PoolClient,
    keys: &[String],
    data: &[Vec<u8>],
    out: &mut [Vec<u8>],
    what: &str,
) -> Result<(f64, f64), BenchError> {
    let bytes = data.iter().map(Vec::len).sum();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(data).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    let t = Instant::now();
    let results = client.batch_put(&items).await;
    let put = gbps(bytes, t);
    fail(&format!("{what} put"), &results)?;
    // Reads need the master to know the keys: the child's node ships its ADDs at auto-flush or at its
    // next heartbeat; wait for the index rather than guess.
    until_indexed(client, keys).await?;
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    poison(out);
    let mut slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
    let t = Instant::now();
    let results = client.batch_get(&key_refs, &mut slices).await;
    let get = gbps(bytes, t);
    fail(&format!("{what} get"), &results)?;
    verify(what, out, data)?;
    Ok((put, get))
}

async fn measure_remote(
    clients: &Clients<'_>,
    raw_addr: &str,
    rounds: usize,
    batch: usize,
    (rows, batch_phases, same_host_keys): (&mut Vec<BenchRow>, &mut Vec<BatchPhases>, &mut Vec<SameHostKeys>),
) -> Result<(), BenchError> {
    // Under `--breakdown`, the batches' phase spans are recorded too.
    let recorder = Recorder::current();
    for value in VALUE_SIZES {
        let (mut tcp_spans, mut shm_spans) = (Samples::default(), Samples::default());
        let n = batch / value;
        let bytes = n * value;
        let mut data: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let mut out: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        // The source of the memory-resident baseline, streamed from `data` before each copy.
        let mut staged: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let (mut put, mut get, mut raw_w, mut raw_r) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut shm_put, mut shm_get, mut copy, mut unsettled) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut from_memory, mut streamed, mut streamed_from_memory) = (Vec::new(), Vec::new(), Vec::new());
        let mut keyed = SameHostKeys::new(value as u64);
        let mut progress =
            Progress::new(format!("umbp bench: remote {} values, rounds", human_size(value as u64)), rounds);
        for round in 0..rounds {
            // TCP: the pool's data plane, then the raw sockets in the same round.
            let keys: Vec<String> = (0..n).map(|i| format!("remote-{value}-{round}-{i}")).collect();
            stamp_values(&mut data, stamp_seed(2, round));
            let round_trip = put_get_round(clients.tcp, &keys, &data, &mut out, "remote");
            let (p, g) = recorded(recorder.as_deref(), &mut tcp_spans, round_trip).await?;
            put.push(p);
            get.push(g);
            raw_w.push(raw_rate_blocking(raw_addr, &mut data, true)?);
            raw_r.push(raw_rate_blocking(raw_addr, &mut out, false)?);
            tokio::time::sleep(Duration::from_millis(600)).await; // read leases expire
            let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let _ = clients.tcp.remove(&key_refs).await;

            // Shared memory: the same bytes to and from the same child, between two memcpy baselines.
            let keys: Vec<String> = (0..n).map(|i| format!("same-host-{value}-{round}-{i}")).collect();
            stamp_values(&mut data, stamp_seed(3, round));
            let (before, hasty) = quiet_memcpy_gbps(&mut out, &data, bytes).await;
            unsettled.push(hasty);
            let over_tcp = clients.shm.transferred_bytes(TCP_ENGINE);
            let through_shm = clients.shm.transferred_bytes(SHM_ENGINE);
            let stats = clients.shm.stats();
            let round_trip = put_get_round(clients.shm, &keys, &data, &mut out, "same-host");
            let (p, g) = recorded(recorder.as_deref(), &mut shm_spans, round_trip).await?;
            keyed.add(n as u64, &stats, &clients.shm.stats());
            let (over_tcp, through_shm) = (
                clients.shm.transferred_bytes(TCP_ENGINE) - over_tcp,
                clients.shm.transferred_bytes(SHM_ENGINE) - through_shm,
            );
            if over_tcp != 0 || through_shm < 2 * bytes as u64 {
                return Err(BenchError::Failed(format!(
                    "the same-host batches did not take the shared path: {over_tcp} bytes over TCP, {through_shm} \
                     through shared memory (is the path off by UMBP_SHARED_MEMORY, or refused by the child?)"
                )));
            }
            shm_put.push(p);
            shm_get.push(g);
            let (after, hasty) = quiet_memcpy_gbps(&mut out, &data, bytes).await;
            copy.push(before.max(after));
            unsettled.push(hasty);
            from_memory.push(memcpy_from_memory_gbps(&mut out, &data, &mut staged, bytes));
            streamed_from_memory.push(streamed_from_memory_gbps(&mut out, &data, &mut staged, bytes));
            streamed.push(streamed_copy_gbps(&mut out, &data, bytes));
            tokio::time::sleep(Duration::from_millis(600)).await;
            let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let _ = clients.shm.remove(&key_refs).await;
            progress.advance(1);
        }
        progress.finish();
        batch_phases.extend(BatchPhases::cells("remote (TCP)", value as u64, &tcp_spans));
        batch_phases.extend(BatchPhases::cells("same host (shm)", value as u64, &shm_spans));
        same_host_keys.push(keyed);
        let (copy_range, copy, unsettled) = (spread(&copy), median(copy), median(unsettled));
        let (from_memory_range, from_memory) = (spread(&from_memory), median(from_memory));
        let (streamed_range, streamed) = (spread(&streamed), median(streamed));
        let (streamed_from_memory_range, streamed_from_memory) =
            (spread(&streamed_from_memory), median(streamed_from_memory));
        for (op, tcp, raw, shm) in [("put", put, raw_w, shm_put), ("get", get, raw_r, shm_get)] {
            let row = |path, pool_gbps, baseline_gbps, baseline: &str, baseline_range, unsettled| BenchRow {
                path,
                op,
                value_bytes: value as u64,
                pool_gbps,
                baseline_gbps,
                baseline: baseline.into(),
                baseline_range,
                unsettled_baseline_gbps: unsettled,
            };
            let (tcp_range, tcp) = (spread(&tcp), median(tcp));
            let shm = median(shm);
            rows.push(row(
                BenchPath::Remote,
                tcp,
                median(raw.clone()),
                &format!("raw TCP x{CONNECTIONS}"),
                spread(&raw),
                None,
            ));
            rows.push(row(BenchPath::SameHost, shm, copy, MEMCPY, copy_range, Some(unsettled)));
            if op == "get" {
                rows.push(row(BenchPath::SameHost, shm, from_memory, MEMCPY_FROM_MEMORY, from_memory_range, None));
                rows.push(row(
                    BenchPath::SameHost,
                    shm,
                    streamed_from_memory,
                    STREAMED_FROM_MEMORY,
                    streamed_from_memory_range,
                    None,
                ));
            } else {
                rows.push(row(BenchPath::SameHost, shm, streamed, STREAMED_COPY, streamed_range, None));
            }
            rows.push(row(BenchPath::SameHost, shm, tcp, POOL_TCP, tcp_range, None));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(n: usize, len: usize, seed: u64) -> Vec<Vec<u8>> {
        let mut values = vec![vec![0u8; len]; n];
        stamp_values(&mut values, seed);
        values
    }

    /// The byte check fails on every wrong copy a get could make, in any round: a value left
    /// unwritten, another key's value, an earlier round's value, one flipped byte, a short tail.
    #[test]
    fn the_byte_check_fails_on_every_wrong_copy() {
        let (n, len) = (8, 64 * 1024 + 5);
        let data = batch(n, len, stamp_seed(1, 1));
        let mut out = data.clone();
        assert!(verify("t", &out, &data).is_ok());
        poison(&mut out);
        assert!(verify("t", &out, &data).is_err(), "an unwritten buffer");
        let mut out = data.clone();
        out[3].clone_from(&data[4]);
        assert!(verify("t", &out, &data).is_err(), "another key's value");
        let earlier = batch(n, len, stamp_seed(1, 0));
        assert!(verify("t", &earlier, &data).is_err(), "the same key's value of an earlier round");
        let other_path = batch(n, len, stamp_seed(2, 1));
        assert!(verify("t", &other_path, &data).is_err(), "another path's value of the same round");
        let mut out = data.clone();
        out[n - 1][len / 2] ^= 1;
        assert!(verify("t", &out, &data).is_err(), "one flipped bit");
        let mut out = data.clone();
        poison(&mut out[5..6]);
        out[5][..len - 1].copy_from_slice(&data[5][..len - 1]);
        assert!(verify("t", &out, &data).is_err(), "the last byte left unwritten");
        assert!(verify("t", &out[..n - 1], &data).is_err(), "a buffer short");
    }

    /// Values of a batch, of two rounds and of two paths are pairwise different, and no value is
    /// the poison.
    #[test]
    fn stamped_values_differ_by_key_round_and_path() {
        let mut seen = std::collections::HashSet::new();
        for seed in [stamp_seed(1, 0), stamp_seed(1, 1), stamp_seed(2, 0), stamp_seed(3, 0)] {
            for v in batch(16, 4096, seed) {
                assert!(v[16..].iter().all(|b| *b != POISON), "the fill is never the poison");
                assert!(seen.insert(v), "a value repeats");
            }
        }
    }
}
