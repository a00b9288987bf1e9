//! `umbp bench soak`: a long mixed workload at pool pressure, with every process's memory, file
//! descriptors and threads and the master's index size sampled as it runs (issue 19, item 5).
//!
//! It starts a master and two DRAM nodes as child processes (this executable re-run as `umbp master`
//! and `umbp node`, on free loopback ports, each node lending [`NODE_CAPACITY`]), and a client in this
//! process that, until `--duration` has passed, writes batches of new keys (64 KiB, 256 KiB and 1 MiB
//! values, every value derived from its key so a mix-up is caught) and reads random keys of the
//! recent past, pacing itself [`PACE`] between rounds. It writes far more than the pool holds, so the
//! master evicts all along. Every read that hits is compared byte for byte with what was written; a
//! miss (an evicted key) is counted, never an error.
//!
//! Every `interval` (a minute, or a sixth of the run when shorter) it samples, per process: private
//! resident memory (`RssAnon`: a leak shows there, while the media and the client's mappings of
//! same-host media are shared memory), open file descriptors (`/proc/PID/fd`) and threads
//! (`Threads:`); the keys in the master's index and the bytes the media hold; and prints a line. The
//! report compares the last sample with the warm one: the later of the first sample after the pool
//! first filled up and the sample a third into the run (allocator arenas and runtime threads settle
//! in the first minutes: an hour's run measured the client 14 → 31 MiB over its first ten minutes,
//! then 31 → 33 over the last fifty). **Flat** is the target. The run fails if any read returned
//! other bytes than those written.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig};

use crate::bench::BenchError;
use crate::cli::BenchArgs;

/// Bytes each node lends: small, so the workload keeps the pool full.
pub const NODE_CAPACITY: &str = "128MiB";

/// The nodes' page: small, so the pool fills by bytes, not by pages of mostly slack.
pub const PAGE_SIZE: &str = "64KiB";

/// The pause between two rounds of the client (a round: one batch put, one batch get).
pub const PACE: Duration = Duration::from_millis(10);

/// Keys per batch put and per batch get.
const BATCH: usize = 8;

/// How many recently written keys reads pick from: about what the pool holds, so reads hit and miss.
const RECENT: usize = 512;

/// The value sizes written, in turn.
const SIZES: [usize; 3] = [64 << 10, 256 << 10, 1 << 20];

/// What the soak runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoakOptions {
    /// How long the workload runs. Default: 1 hour.
    pub duration: Duration,
}

impl SoakOptions {
    /// The options of `umbp bench soak` (`--duration`).
    pub fn from_args(args: &BenchArgs) -> Self {
        Self { duration: args.duration.unwrap_or(Duration::from_secs(3600)) }
    }

    /// A sample every minute, or six over a shorter run.
    pub fn interval(&self) -> Duration {
        (self.duration / 6).min(Duration::from_secs(60)).max(Duration::from_millis(500))
    }
}

/// One process's figures at one sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessSample {
    /// Private resident memory (`RssAnon`), KiB: where a leak shows. A node's medium and a
    /// client's mappings of same-host nodes' media are shared memory, not in it.
    pub anon_kib: u64,
    /// Open file descriptors.
    pub fds: u64,
    /// Threads.
    pub threads: u64,
}

/// The processes sampled, in the order of [`Sample::processes`].
pub const PROCESSES: [&str; 4] = ["master", "node 1", "node 2", "client"];

/// One sample of the whole run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Since the workload started.
    pub at: Duration,
    /// Per process, in the order of [`PROCESSES`].
    pub processes: [ProcessSample; 4],
    /// Keys in the master's index.
    pub index_keys: u64,
    /// Bytes the nodes' media hold (allocated), as their last heartbeats told the master.
    pub used_bytes: u64,
    /// Operations so far.
    pub counts: Counts,
}

/// What the client did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Values written (acknowledged).
    pub puts: u64,
    /// Puts that failed.
    pub put_errors: u64,
    /// Values read and compared.
    pub hits: u64,
    /// Reads of evicted keys.
    pub misses: u64,
    /// Reads that failed otherwise (not wrong bytes).
    pub get_errors: u64,
    /// Reads that returned other bytes than those written: must stay 0.
    pub wrong: u64,
}

/// The samples and the verdict.
#[derive(Debug, Clone)]
pub struct SoakReport {
    /// The run's length.
    pub duration: Duration,
    /// Every sample, the first at the start.
    pub samples: Vec<Sample>,
    /// Why puts and reads failed (not misses): each error's text and how many times, most first.
    pub errors: Vec<(String, u64)>,
    /// The baseline sample of the growth: the later of the first sample after the pool first filled
    /// up and the sample a third into the run; `None` when the pool never filled (the run was too
    /// short to press it): growth from the start.
    pub warm: Option<usize>,
}

impl SoakReport {
    /// The growth of each process's figures from the warm sample to the last, as ratios (last /
    /// warm), per process: (rss, fds, threads).
    pub fn growth(&self) -> Vec<(f64, f64, f64)> {
        let first = self.samples.get(self.warm.unwrap_or(0));
        let (Some(first), Some(last)) = (first, self.samples.last()) else { return Vec::new() };
        let ratio = |a: u64, b: u64| if a == 0 { 1.0 } else { b as f64 / a as f64 };
        first
            .processes
            .iter()
            .zip(&last.processes)
            .map(|(a, b)| (ratio(a.anon_kib, b.anon_kib), ratio(a.fds, b.fds), ratio(a.threads, b.threads)))
            .collect()
    }
}

impl fmt::Display for SoakReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "soak: {:?} of batch puts ({BATCH} values of 64 KiB / 256 KiB / 1 MiB) and batch gets of recent keys, \
             a master and two {NODE_CAPACITY} DRAM nodes as processes\n",
            self.duration
        )?;
        writeln!(f, "{SAMPLE_HEADER}")?;
        writeln!(f, "|{}", "---|".repeat(9))?;
        for s in &self.samples {
            writeln!(f, "{}", sample_row(s))?;
        }
        if let Some(last) = self.samples.last() {
            let c = last.counts;
            writeln!(
                f,
                "\noperations: {} puts ({} failed), {} hits compared, {} misses (evicted), {} failed reads, {} wrong bytes",
                c.puts, c.put_errors, c.hits, c.misses, c.get_errors, c.wrong
            )?;
        }
        for (error, n) in &self.errors {
            writeln!(f, "  {n} x {error}")?;
        }
        match self.warm {
            Some(w) => writeln!(
                f,
                "growth from sample {w} (the pool full, a third into the run or later) to the last, last / first:"
            )?,
            None => writeln!(f, "growth from the start to the last sample (the pool never filled), last / first:")?,
        }
        for (name, (rss, fds, threads)) in PROCESSES.iter().zip(self.growth()) {
            writeln!(f, "  {name}: memory {rss:.2}, file descriptors {fds:.2}, threads {threads:.2}")?;
        }
        Ok(())
    }
}

/// The header of the sample table.
pub const SAMPLE_HEADER: &str = "| at | master anon MiB / fds / threads | node 1 | node 2 | client | index keys | pool MiB used | puts / hits / misses | wrong |";

fn sample_row(s: &Sample) -> String {
    let p = |p: &ProcessSample| format!("{} / {} / {}", p.anon_kib / 1024, p.fds, p.threads);
    format!(
        "| {:.0}s | {} | {} | {} | {} | {} | {} | {} / {} / {} | {} |",
        s.at.as_secs_f64(),
        p(&s.processes[0]),
        p(&s.processes[1]),
        p(&s.processes[2]),
        p(&s.processes[3]),
        s.index_keys,
        s.used_bytes >> 20,
        s.counts.puts,
        s.counts.hits,
        s.counts.misses,
        s.counts.wrong
    )
}

/// A child `umbp` process, killed on drop.
struct ChildProc {
    child: Child,
    ready: String,
}

impl ChildProc {
    /// Starts `umbp ARGS…` and waits (up to 30 s) for its line starting with `prefix` and holding
    /// ` ready `.
    fn start(args: &[&str], prefix: &str) -> Result<Self, BenchError> {
        let exe = std::env::current_exe().map_err(|e| BenchError::Child(format!("finding this executable: {e}")))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| BenchError::Child(format!("starting umbp {}: {e}", args.join(" "))))?;
        let stdout = child.stdout.take().ok_or_else(|| BenchError::Child("no stdout".into()))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // Read every line (the child must never block on a full pipe); the first ready one is sent.
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut proc = Self { child, ready: String::new() };
        while Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) if line.starts_with(prefix) && line.contains(" ready ") => {
                    proc.ready = line;
                    return Ok(proc);
                }
                _ => {
                    if let Ok(Some(status)) = proc.child.try_wait() {
                        return Err(BenchError::Child(format!("umbp {} exited with {status}", args.join(" "))));
                    }
                }
            }
        }
        Err(BenchError::Child(format!("umbp {} was not ready in 30 s", args.join(" "))))
    }

    fn field(&self, name: &str) -> Option<&str> {
        self.ready.split_whitespace().find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A process's figures from `/proc` (zeros where it cannot be read: the process is gone).
pub fn process_sample(pid: u32) -> ProcessSample {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
    ProcessSample { anon_kib: field("RssAnon:"), fds, threads: field("Threads:") }
}

/// The bytes of `key`, `len` long: every key's value differs, so a mix-up is caught.
fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (0..len).map(|i| (seed.wrapping_add(i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8).collect()
}

/// Runs the soak (see the module docs).
pub async fn run(options: SoakOptions) -> Result<SoakReport, BenchError> {
    if options.duration.is_zero() {
        return Err(BenchError::Options("--duration must be above 0".into()));
    }
    let master = ChildProc::start(&["master", "--listen", "127.0.0.1:0", "--heartbeat-ttl", "4s"], "master")?;
    let address = master.field("listen").ok_or_else(|| BenchError::Child("no listen= in the master's line".into()))?;
    let address = address.to_owned();
    let node = |id: &str| {
        let args = [
            "node",
            "--master",
            &address,
            "--node-id",
            id,
            "--medium",
            "dram",
            "--capacity",
            NODE_CAPACITY,
            "--page-size",
            PAGE_SIZE,
            "--prefault",
            "false",
        ];
        ChildProc::start(&args, &format!("node {id}"))
    };
    let nodes = [node("soak-1")?, node("soak-2")?];
    let client = PoolClient::start(PoolClientConfig::new("soak-client", address.clone()))
        .await
        .map_err(|source| BenchError::Node { node: "soak-client".into(), source })?;
    let pids = [master.child.id(), nodes[0].child.id(), nodes[1].child.id(), std::process::id()];
    let result = soak(&client, &options, pids).await;
    client.close().await;
    result
}

async fn soak(client: &PoolClient, options: &SoakOptions, pids: [u32; 4]) -> Result<SoakReport, BenchError> {
    let interval = options.interval();
    let started = Instant::now();
    let mut counts = Counts::default();
    let mut errors: HashMap<String, u64> = HashMap::new();
    let mut samples = Vec::new();
    let mut warm = None;
    let mut recent: VecDeque<(String, usize)> = VecDeque::with_capacity(RECENT);
    let mut next_sample = started;
    let mut seq = 0u64;
    // A cheap deterministic generator for which recent keys to read.
    let mut pick = 0x2545_f491_4f6c_dd1du64;
    loop {
        let now = Instant::now();
        if now >= next_sample {
            let status = client.master().cluster_status().await.ok();
            let index_keys = status.as_ref().map_or(0, |s| s.total_keys);
            let used_bytes = status.as_ref().map_or(0, |s| {
                s.storage_nodes()
                    .flat_map(|n| n.tier_capacities.iter())
                    .map(|(_, c)| c.total_bytes.saturating_sub(c.available_bytes))
                    .sum()
            });
            let processes = pids.map(process_sample);
            let sample = Sample { at: now - started, processes, index_keys, used_bytes, counts };
            // The pool has filled once reads start missing (the master evicted).
            if warm.is_none() && counts.misses > 0 {
                warm = Some(samples.len());
            }
            // Progress on a long run: each sample as it is taken (stderr; the report goes to stdout).
            eprintln!("{}", sample_row(&sample));
            samples.push(sample);
            next_sample += interval;
            if now - started >= options.duration {
                break;
            }
        }
        // One round: a batch of new keys, then a batch of recent ones.
        let keys: Vec<(String, usize)> = (0..BATCH)
            .map(|i| {
                seq += 1;
                (format!("soak-{seq}"), SIZES[(seq as usize + i) % SIZES.len()])
            })
            .collect();
        let values: Vec<Vec<u8>> = keys.iter().map(|(k, len)| value(k, *len)).collect();
        let items: Vec<(&str, &[u8])> =
            keys.iter().zip(&values).map(|((k, _), v)| (k.as_str(), v.as_slice())).collect();
        for ((key, len), r) in keys.iter().zip(client.batch_put(&items).await) {
            match r {
                Ok(()) => {
                    counts.puts += 1;
                    if recent.len() == RECENT {
                        recent.pop_front();
                    }
                    recent.push_back((key.clone(), *len));
                }
                Err(e) => {
                    counts.put_errors += 1;
                    *errors.entry(format!("put: {e}")).or_default() += 1;
                }
            }
        }
        if !recent.is_empty() {
            let chosen: Vec<(String, usize)> = (0..BATCH)
                .map(|_| {
                    pick ^= pick << 13;
                    pick ^= pick >> 7;
                    pick ^= pick << 17;
                    recent[(pick % recent.len() as u64) as usize].clone()
                })
                .collect();
            let refs: Vec<&str> = chosen.iter().map(|(k, _)| k.as_str()).collect();
            let mut bufs: Vec<Vec<u8>> = chosen.iter().map(|(_, len)| vec![0xA5; *len]).collect();
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            let results = client.batch_get(&refs, &mut slices).await;
            for (((key, len), r), buf) in chosen.iter().zip(results).zip(&bufs) {
                match r {
                    Ok(size) if size as usize == *len && *buf == value(key, *len) => counts.hits += 1,
                    Ok(_) => counts.wrong += 1,
                    Err(KeyError::Miss) => counts.misses += 1,
                    Err(e) => {
                        counts.get_errors += 1;
                        *errors.entry(format!("get: {e}")).or_default() += 1;
                    }
                }
            }
        }
        tokio::time::sleep(PACE).await;
    }
    let mut errors: Vec<(String, u64)> = errors.into_iter().collect();
    errors.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let warm = warm_sample(warm, samples.len());
    let report = SoakReport { duration: options.duration, samples, errors, warm };
    if counts.wrong > 0 {
        return Err(BenchError::Failed(format!("{} reads returned other bytes than written\n{report}", counts.wrong)));
    }
    Ok(report)
}

/// The baseline of the growth among `len` samples: the later of the first one after the pool filled
/// (`filled`) and the one a third into the run; `None` when the pool never filled.
fn warm_sample(filled: Option<usize>, len: usize) -> Option<usize> {
    filled.map(|f| f.max(len / 3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_is_read_from_a_third_into_the_run_or_after_the_pool_filled() {
        // An hour: 61 samples, the pool full at the second; the settling of the first minutes is
        // left out of the growth.
        assert_eq!(warm_sample(Some(1), 61), Some(20));
        // A short run whose pool filled late: from the fill.
        assert_eq!(warm_sample(Some(5), 7), Some(5));
        assert_eq!(warm_sample(None, 61), None);
    }
}
