//! `umbp bench ssd`: an SSD node end to end (issue 7). A `PoolClient` lending `Medium::Ssd`, alone
//! in the cluster of an embedded master, batch-puts and batch-gets 1 MiB and 2 MiB values (page size
//! = value size) with each io engine; beside it, in the same rounds, raw `O_DIRECT` sequential
//! writes and reads of the same number of bytes, in value-sized requests, to a fresh file in the
//! same directory.
//!
//! - **put** = route at the master, allocate staging pages, copy the values in, commit (CRC, drive
//!   write of each record);
//! - **get** = resolve on the node's own medium (drive read into staging pages, CRC check), copy
//!   the values out.
//!
//! The node keeps no clean copy of a committed value (`cache_committed` off), so every get reads
//! the drive; the medium's counters are read around each get and the bench fails unless every key
//! was one drive read and none a staged-copy hit. The keys of all rounds stay stored (the capacity
//! holds them), so no eviction or compaction runs under the measurement. Rounds alternate which
//! side goes first, so drift in the disk's speed hits both alike; each cell is the median of
//! [`SsdBenchOptions::rounds`] rounds, and the range of the per-round ratios is printed beside it.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use umbp_core::metric_names;
use umbp_master::MasterConfig;
use umbp_page::HostRegion;
use umbp_peer::pool_client::{IoEngineKind, Medium, PoolClient, PoolClientConfig, RecachePolicy, SsdConfig};

use crate::bench::BenchError;
use crate::cli::{BenchArgs, SsdEngineChoice};
use crate::progress::Progress;
use crate::units::human_size;

/// The value sizes measured (each node's page size is the value size).
pub const SSD_VALUE_SIZES: [u64; 2] = [1 << 20, 2 << 20];

/// The header of the markdown table.
pub const SSD_TABLE_HEADER: &str =
    "| engine | op | value | PoolClient GB/s | raw O_DIRECT GB/s | ratio | round ratios min–max |";

/// The SSD read lease of the bench node: only the safety net, since the node's own gets release
/// their staging pages as soon as each copy is done, so the next round's put finds them free.
const READ_LEASE: Duration = Duration::from_millis(500);

/// What `umbp bench ssd` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsdBenchOptions {
    /// Rounds per cell; the medians are reported. Default: 5.
    pub rounds: usize,
    /// Bytes per batch put / batch get (at least one 2 MiB value). Default: 256 MiB.
    pub batch_bytes: u64,
    /// Where the node's log and the raw file go: a fresh subdirectory is made in it and removed at
    /// the end. It must be on the drive to measure and allow `O_DIRECT` (not tmpfs).
    pub dir: PathBuf,
    /// The io engines, in order.
    pub engines: Vec<IoEngineKind>,
    /// Skip (with a note) an engine whose node does not start, instead of failing: set for `both`,
    /// where io_uring may be refused by the kernel or a sandbox.
    pub skip_unavailable: bool,
}

impl SsdBenchOptions {
    /// The default batch: 256 MiB, as the backend bench moves per cell and round.
    pub const DEFAULT_BATCH_BYTES: u64 = 256 << 20;

    /// Options for `dir` with every other setting at its default (both engines).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            rounds: 5,
            batch_bytes: Self::DEFAULT_BATCH_BYTES,
            dir: dir.into(),
            engines: vec![IoEngineKind::Psync, IoEngineKind::IoUring],
            skip_unavailable: true,
        }
    }

    /// The defaults overridden by the flags that are set; `--ssd-dir` is required.
    pub fn from_args(args: &BenchArgs) -> Result<Self, BenchError> {
        let dir = args.ssd_dir.clone().ok_or_else(|| {
            BenchError::Options(
                "the ssd suite needs --ssd-dir DIR: a directory on the drive to measure (O_DIRECT; not tmpfs)".into(),
            )
        })?;
        let mut o = Self::new(dir);
        if let Some(r) = args.rounds {
            o.rounds = r;
        }
        if let Some(b) = args.batch_bytes {
            o.batch_bytes = b;
        }
        match args.ssd_io_engine.unwrap_or(SsdEngineChoice::Both) {
            SsdEngineChoice::Psync => (o.engines, o.skip_unavailable) = (vec![IoEngineKind::Psync], false),
            SsdEngineChoice::IoUring => (o.engines, o.skip_unavailable) = (vec![IoEngineKind::IoUring], false),
            SsdEngineChoice::Both => {}
        }
        Ok(o)
    }

    fn validate(&self) -> Result<(), BenchError> {
        let bad = |reason: String| Err(BenchError::Options(reason));
        if self.rounds == 0 {
            return bad("--rounds must be at least 1".into());
        }
        let largest = SSD_VALUE_SIZES[SSD_VALUE_SIZES.len() - 1];
        if self.batch_bytes < largest {
            return bad(format!(
                "--batch-bytes {}: at least 2MiB for the ssd suite (one 2 MiB value)",
                self.batch_bytes
            ));
        }
        if self.batch_bytes > 4 << 30 {
            return bad(format!("--batch-bytes {}: at most 4GiB", self.batch_bytes));
        }
        if self.engines.is_empty() {
            return bad("no io engine to measure".into());
        }
        if !self.dir.is_dir() {
            return bad(format!("--ssd-dir {}: not a directory", self.dir.display()));
        }
        Ok(())
    }
}

/// One row: the node's figure beside the raw figure of the same rounds.
#[derive(Debug, Clone, PartialEq)]
pub struct SsdRow {
    /// The node's io engine.
    pub engine: IoEngineKind,
    /// `put` or `get`.
    pub op: &'static str,
    /// Bytes per value (= the node's page size).
    pub value_bytes: u64,
    /// PoolClient throughput, GB/s (median of the rounds).
    pub pool_gbps: f64,
    /// Raw `O_DIRECT` throughput, GB/s (median of the rounds).
    pub raw_gbps: f64,
    /// The smallest per-round ratio (PoolClient / raw of the same round).
    pub round_ratio_min: f64,
    /// The largest per-round ratio.
    pub round_ratio_max: f64,
}

impl SsdRow {
    /// PoolClient / raw, of the medians.
    pub fn ratio(&self) -> f64 {
        self.pool_gbps / self.raw_gbps
    }
}

/// What `umbp bench ssd` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SsdReport {
    /// Rounds per cell.
    pub rounds: usize,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// The directory measured.
    pub dir: PathBuf,
    /// The table.
    pub rows: Vec<SsdRow>,
    /// Engines skipped, with why.
    pub skipped: Vec<String>,
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
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

impl SsdReport {
    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"engine\":\"{}\",\"op\":\"{}\",\"value_bytes\":{},\"pool_gbps\":{:.4},\"raw_gbps\":{:.4},\
                     \"ratio\":{:.4},\"round_ratio_min\":{:.4},\"round_ratio_max\":{:.4}}}",
                    r.engine,
                    r.op,
                    r.value_bytes,
                    r.pool_gbps,
                    r.raw_gbps,
                    r.ratio(),
                    r.round_ratio_min,
                    r.round_ratio_max
                )
            })
            .collect();
        let skipped: Vec<String> = self.skipped.iter().map(|s| json_string(s)).collect();
        format!(
            "{{\"suite\":\"ssd\",\"dir\":{},\"rounds\":{},\"batch_bytes\":{},\"rows\":[{}],\"skipped\":[{}]}}",
            json_string(&self.dir.display().to_string()),
            self.rounds,
            self.batch_bytes,
            rows.join(","),
            skipped.join(",")
        )
    }
}

impl fmt::Display for SsdReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "SSD node (PoolClient, Medium::Ssd, page = value) batch put/get against raw O_DIRECT on {}, {} per \
             batch, medians of {} rounds",
            self.dir.display(),
            human_size(self.batch_bytes),
            self.rounds
        )?;
        writeln!(f)?;
        writeln!(f, "{SSD_TABLE_HEADER}")?;
        write!(f, "|---|---|---|---|---|---|---|")?;
        for r in &self.rows {
            write!(
                f,
                "\n| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2}–{:.2} |",
                r.engine,
                r.op,
                human_size(r.value_bytes),
                r.pool_gbps,
                r.raw_gbps,
                r.ratio(),
                r.round_ratio_min,
                r.round_ratio_max
            )?;
        }
        for s in &self.skipped {
            write!(f, "\n\n{s}")?;
        }
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}

/// The raw baseline's buffer: a zeroed region of the same kind of memory as the node's staging
/// arena ([`HostRegion`]: anonymous, advised for transparent huge pages). The kind matters: pinning
/// 4 KiB pages for each direct request costs about twice what huge pages do on this VM, which an
/// allocator buffer would credit to the node.
struct AlignedRegion(HostRegion);

impl AlignedRegion {
    fn new(len: usize) -> Result<Self, BenchError> {
        HostRegion::new(len).map(Self).map_err(|e| BenchError::Failed(format!("the baseline's buffer: {e}")))
    }

    fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
}

fn open_direct(path: &Path, create: bool) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(create).create(create).truncate(create).custom_flags(libc::O_DIRECT).open(path)
}

/// Raw `O_DIRECT` sequential writes of `region` to a fresh `path`, one `value`-sized request after
/// the other; GB/s (the open is not timed).
fn raw_write(path: &Path, region: &[u8], value: usize) -> std::io::Result<f64> {
    let file = open_direct(path, true)?;
    let start = Instant::now();
    for (i, chunk) in region.chunks(value).enumerate() {
        file.write_all_at(chunk, (i * value) as u64)?;
    }
    Ok(gbps(region.len() as u64, start.elapsed()))
}

/// Raw `O_DIRECT` sequential reads of `path` back into `region`, in `value`-sized requests; GB/s.
/// The file is removed afterwards.
fn raw_read(path: &Path, region: &mut [u8], value: usize) -> std::io::Result<f64> {
    let file = open_direct(path, false)?;
    let start = Instant::now();
    let bytes = region.len() as u64;
    for (i, chunk) in region.chunks_mut(value).enumerate() {
        file.read_exact_at(chunk, (i * value) as u64)?;
    }
    let rate = gbps(bytes, start.elapsed());
    drop(file);
    std::fs::remove_file(path)?;
    Ok(rate)
}

fn raw_blocking<T>(what: &str, f: impl FnOnce() -> std::io::Result<T>) -> Result<T, BenchError> {
    // Blocking disk IO: keep it off the reactor's scheduling loop.
    tokio::task::block_in_place(f).map_err(|e| BenchError::Failed(format!("raw O_DIRECT {what}: {e}")))
}

/// The medium's drive reads and staged-copy hits so far (generic series; the SSD medium labels
/// its events `device_read_ok` and `staged_copy_hit`).
fn read_counters(node: &PoolClient) -> (u64, u64) {
    let Some(medium) = node.medium() else { return (0, 0) };
    let (mut reads, mut hits) = (0, 0);
    for s in medium.sample_metrics() {
        if s.name != metric_names::MEDIUM_EVENTS_TOTAL {
            continue;
        }
        match s.labels.iter().find(|(k, _)| k == "event").map(|(_, v)| v.as_str()) {
            Some("device_read_ok") => reads = s.value,
            Some("staged_copy_hit") => hits = s.value,
            _ => {}
        }
    }
    (reads, hits)
}

fn first_error(what: &str, results: &[Result<impl Sized, impl fmt::Display>]) -> Result<(), BenchError> {
    match results.iter().enumerate().find_map(|(i, r)| r.as_ref().err().map(|e| (i, e))) {
        Some((i, e)) => Err(BenchError::Failed(format!("{what}, value {i}: {e}"))),
        None => Ok(()),
    }
}

/// Runs the bench: an embedded master on 127.0.0.1, then one SSD node per engine and value size.
pub async fn run(options: SsdBenchOptions) -> Result<SsdReport, BenchError> {
    options.validate()?;
    let root = options.dir.join(format!("umbp-bench-ssd-{}", std::process::id()));
    std::fs::create_dir_all(&root)
        .map_err(|e| BenchError::Options(format!("--ssd-dir: creating {}: {e}", root.display())))?;
    let master = match umbp_master::start(MasterConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..MasterConfig::default()
    })
    .await
    {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&root);
            return Err(e.into());
        }
    };
    let result = measure(&options, &root, &master.local_addr().to_string()).await;
    master.shutdown().await;
    let _ = std::fs::remove_dir_all(&root);
    result
}

async fn measure(options: &SsdBenchOptions, root: &Path, master: &str) -> Result<SsdReport, BenchError> {
    let mut report = SsdReport {
        rounds: options.rounds,
        batch_bytes: options.batch_bytes,
        dir: options.dir.clone(),
        rows: Vec::new(),
        skipped: Vec::new(),
    };
    for &engine in &options.engines {
        for value in SSD_VALUE_SIZES {
            let cell = Cell { engine, value, rounds: options.rounds, count: options.batch_bytes / value };
            match cell.measure(root, master).await {
                Ok(rows) => report.rows.extend(rows),
                Err(CellError::Start(e)) if options.skip_unavailable => {
                    let note = format!("{engine} rows skipped: its node did not start ({e})");
                    crate::progress::note(format_args!("umbp bench ssd: {note}"));
                    report.skipped.push(note);
                    break;
                }
                Err(CellError::Start(e)) => {
                    return Err(BenchError::Failed(format!("starting the {engine} ssd node: {e}")));
                }
                Err(CellError::Bench(e)) => return Err(e),
            }
        }
    }
    Ok(report)
}

/// Why a cell stopped.
enum CellError {
    /// Its node did not start (io_uring refused, say).
    Start(umbp_peer::pool_client::PoolError),
    /// Anything else.
    Bench(BenchError),
}

impl From<BenchError> for CellError {
    fn from(e: BenchError) -> Self {
        Self::Bench(e)
    }
}

/// One engine and value size: a fresh node on a fresh subdirectory.
struct Cell {
    engine: IoEngineKind,
    value: u64,
    rounds: usize,
    count: u64,
}

impl Cell {
    fn node_config(&self, dir: &Path, master: &str) -> PoolClientConfig {
        let bytes = self.count * self.value;
        // Every round's keys stay stored: room for all of them below both the medium's and the
        // master's eviction watermarks (0.9), plus the records' headers.
        let stored = self.rounds as u64 * bytes;
        let capacity = (stored * 3 / 2 + (64 << 20)).div_ceil(self.value) * self.value;
        let ssd = SsdConfig {
            dirs: vec![dir.to_owned()],
            capacity_bytes: capacity,
            io_engine: self.engine,
            // A batch's keys all hold a staging page at once: a get leases every one of them.
            staging_pages: self.count + 2,
            read_lease: READ_LEASE,
            cache_committed: false,
            ..SsdConfig::default()
        };
        let mut c = PoolClientConfig::new(format!("bench-ssd-{}-{}", self.engine, self.value >> 20), master.to_owned())
            .with_medium(Medium::Ssd(ssd));
        c.page_size = self.value;
        c.recache = RecachePolicy::Off;
        c
    }

    async fn measure(&self, root: &Path, master: &str) -> Result<Vec<SsdRow>, CellError> {
        let dir = root.join(format!("{}-{}MiB", self.engine, self.value >> 20));
        std::fs::create_dir_all(&dir).map_err(|e| BenchError::Failed(format!("creating {}: {e}", dir.display())))?;
        let node = PoolClient::start(self.node_config(&dir, master)).await.map_err(CellError::Start)?;
        let result = self.rounds(&node, &dir).await;
        node.close().await;
        let _ = std::fs::remove_dir_all(&dir);
        Ok(result?)
    }

    async fn rounds(&self, node: &PoolClient, dir: &Path) -> Result<Vec<SsdRow>, BenchError> {
        let (n, value) = (self.count as usize, self.value as usize);
        let bytes = self.count * self.value;
        let data: Vec<Vec<u8>> = (0..n).map(|i| vec![(i % 251) as u8 ^ 0x5a; value]).collect();
        let mut out: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let mut raw = AlignedRegion::new(n * value)?;
        for (i, b) in raw.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 253) as u8;
        }
        let raw_file = dir.join("raw-baseline.bin");
        let (mut put, mut get, mut raw_w, mut raw_r) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut progress = Progress::new(
            format!("umbp bench ssd: {} {} values, rounds", self.engine, human_size(self.value)),
            self.rounds,
        );
        for round in 0..self.rounds {
            let keys: Vec<String> = (0..n).map(|i| format!("ssd-{value}-{round}-{i}")).collect();
            let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let items: Vec<(&str, &[u8])> = key_refs.iter().copied().zip(data.iter().map(Vec::as_slice)).collect();
            // Alternate the order, so a drift of the disk's speed within a round favours neither.
            let raw_first = round % 2 == 0;
            if raw_first {
                let slice = raw.as_slice();
                raw_w.push(raw_blocking("write", || raw_write(&raw_file, slice, value))?);
            }
            let t = Instant::now();
            let results = node.batch_put(&items).await;
            put.push(gbps(bytes, t.elapsed()));
            first_error("put", &results)?;
            if !raw_first {
                let slice = raw.as_slice();
                raw_w.push(raw_blocking("write", || raw_write(&raw_file, slice, value))?);
            }
            if raw_first {
                let slice = raw.as_mut_slice();
                raw_r.push(raw_blocking("read", || raw_read(&raw_file, slice, value))?);
            }
            let (reads_before, hits_before) = read_counters(node);
            let stats_before = node.stats();
            let mut slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
            let t = Instant::now();
            let results = node.batch_get(&key_refs, &mut slices).await;
            get.push(gbps(bytes, t.elapsed()));
            first_error("get", &results)?;
            let (reads, hits) = read_counters(node);
            let stats = node.stats();
            let lapses = stats.lease_lapses - stats_before.lease_lapses;
            let reroutes = stats.reroutes - stats_before.reroutes;
            if reads - reads_before != self.count || hits != hits_before || lapses != 0 || reroutes != 0 {
                return Err(BenchError::Failed(format!(
                    "the {} get of round {round} was not one drive read per key: {} drive reads and {} staged-copy \
                     hits for {n} keys, {lapses} lease lapses, {reroutes} reroutes",
                    self.engine,
                    reads - reads_before,
                    hits - hits_before
                )));
            }
            if out != data {
                return Err(BenchError::Failed("get returned other bytes than were put".into()));
            }
            if !raw_first {
                let slice = raw.as_mut_slice();
                raw_r.push(raw_blocking("read", || raw_read(&raw_file, slice, value))?);
            }
            progress.advance(1);
        }
        progress.finish();
        let mut rows = Vec::new();
        for (op, ours, base) in [("put", put, raw_w), ("get", get, raw_r)] {
            let ratios: Vec<f64> = ours.iter().zip(&base).map(|(o, b)| o / b).collect();
            rows.push(SsdRow {
                engine: self.engine,
                op,
                value_bytes: self.value,
                round_ratio_min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
                round_ratio_max: ratios.iter().copied().fold(0.0, f64::max),
                pool_gbps: median(ours),
                raw_gbps: median(base),
            });
        }
        Ok(rows)
    }
}
