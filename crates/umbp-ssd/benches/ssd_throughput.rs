//! `SsdBackend` put (allocate + copy into the staging pages + commit) and get (resolve + copy out of
//! the staging pages) throughput for 1 MiB and 2 MiB values, with each io engine, in batches of 1
//! and 8 keys, beside a same-run baseline: raw `O_DIRECT` sequential writes and reads of the same
//! number of bytes, in the same value-sized requests, to a file in the same directory. The two
//! take turns in groups of about `UMBP_BENCH_GROUP_MIB` (default 16) MiB — the baseline writes (or
//! reads) a group, then the backend puts (or gets) as many bytes — so both see the same drive:
//! a shared VM disk's speed swings by a factor of two from one second to the next, which made
//! back-to-back phases of 256 MiB compare different disks.
//!
//! Run: `cargo xtask bench -p umbp-ssd` or `cargo bench -p umbp-ssd --bench ssd_throughput`. Prints
//! a markdown table of medians. `UMBP_BENCH_ROUNDS` (default 5), `UMBP_BENCH_MIB` (bytes per round
//! and cell, default 256), `UMBP_BENCH_GROUP_MIB` and `UMBP_BENCH_DIR` (default: the system temp dir) tune it;
//! `UMBP_BENCH_ENGINES` (`psync,io_uring`), `UMBP_BENCH_VALUES_MIB` (`1,2`) and `UMBP_BENCH_BATCHES`
//! (`1,8`) pick cells. Gets run after the staged copies are dropped, so every get reads the drive.
//! Each cell also reports on stderr how many records compaction moved (0: it never competed).

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, ManualClock, MediumBackend};
use umbp_page::HostRegion;
use umbp_ssd::{IoEngineKind, SsdBackend, SsdConfig};
use umbp_testkit::LocalOnlyRegistrar;

const MIB: u64 = 1 << 20;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A buffer for `O_DIRECT` of the same kind of memory as the backend's staging arena
/// ([`HostRegion`]: anonymous, advised for transparent huge pages), filled with a pattern. The kind
/// matters on this VM: pinning 4 KiB pages for a direct read or write costs about twice what a huge
/// page does, which an allocator buffer would otherwise credit to the backend.
struct Aligned(HostRegion);

impl Aligned {
    fn new(len: usize) -> Self {
        let mut region = HostRegion::new(len).expect("baseline buffer");
        region.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        Self(region)
    }
    fn slice(&self) -> &[u8] {
        self.0.as_slice()
    }
    fn slice_mut(&mut self) -> &mut [u8] {
        self.0.as_mut_slice()
    }
}

/// The raw baseline of one round: `O_DIRECT` sequential writes, then reads, of `size`-byte requests
/// from one aligned buffer, to a fresh file in the bench directory.
struct Raw {
    file: std::fs::File,
    path: PathBuf,
    buf: Aligned,
    size: u64,
    written: u64,
    read: u64,
}

impl Raw {
    fn new(dir: &Path, size: u64) -> Self {
        let path = dir.join("raw-baseline.bin");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .expect("O_DIRECT open (the bench needs a filesystem that allows it)");
        Self { file, path, buf: Aligned::new(size as usize), size, written: 0, read: 0 }
    }

    /// Writes the next `n` requests; how long they took.
    fn write(&mut self, n: usize) -> Duration {
        let start = Instant::now();
        for _ in 0..n {
            self.file.write_all_at(self.buf.slice(), self.written * self.size).expect("write");
            self.written += 1;
        }
        start.elapsed()
    }

    /// Reads the next `n` requests back; how long they took.
    fn read(&mut self, n: usize) -> Duration {
        let start = Instant::now();
        for _ in 0..n {
            self.file.read_exact_at(self.buf.slice_mut(), self.read * self.size).expect("read");
            self.read += 1;
        }
        start.elapsed()
    }
}

impl Drop for Raw {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// GB/s of `bytes` in `time`.
fn gbps(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

fn arena(b: &SsdBackend) -> *mut u8 {
    b.buffer_ref(0).and_then(|r| r.local_region().map(|l| l.ptr().as_ptr())).expect("arena")
}

/// Puts then gets `count` values of `size` bytes in batches of `batch`, each group of `group` keys
/// right after the raw baseline wrote (or read) as many bytes: both see the same drive conditions
/// (this VM's disk swings by a factor of two within seconds). GB/s of put, get, raw write and raw
/// read.
#[expect(clippy::too_many_arguments, reason = "a bench cell's parameters, spelled out")]
fn round_of(
    b: &SsdBackend,
    clock: &ManualClock,
    dir: &Path,
    round: u64,
    size: u64,
    count: u64,
    batch: u64,
    group: usize,
) -> (f64, f64, f64, f64) {
    let page = b.page_size();
    let src = Aligned::new(size as usize);
    let mut dst = Aligned::new(size as usize);
    let base = arena(b);
    let mut raw = Raw::new(dir, size);
    let keys: Vec<String> = (0..count).map(|i| format!("r{round}-k{i}")).collect();
    let (mut put, mut raw_write) = (Duration::ZERO, Duration::ZERO);
    for keys in keys.chunks(group) {
        raw_write += raw.write(keys.len());
        let start = Instant::now();
        for chunk in keys.chunks(batch as usize) {
            let reqs: Vec<AllocateRequest> = chunk.iter().map(|k| AllocateRequest::new(k.clone(), size)).collect();
            let allocated = b.batch_allocate(&reqs);
            let mut commits = Vec::with_capacity(chunk.len());
            for (a, k) in allocated.iter().zip(chunk) {
                assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {k}");
                for (j, p) in a.pages.iter().enumerate() {
                    let off = j as u64 * page;
                    let n = (size - off).min(page) as usize;
                    // SAFETY: the page is inside the arena and reserved for this slot.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.slice().as_ptr().add(off as usize),
                            base.add((u64::from(p.page_index) * page) as usize),
                            n,
                        )
                    };
                }
                commits.push(CommitRequest::new(a.slot_id, k.clone()));
            }
            assert!(b.batch_commit(&commits).iter().all(|c| c.success), "commit");
        }
        put += start.elapsed();
    }
    b.drop_cached_copies();
    let lease = b.config().read_lease_ttl();
    let (mut get, mut raw_read) = (Duration::ZERO, Duration::ZERO);
    for keys in keys.chunks(group) {
        raw_read += raw.read(keys.len());
        let start = Instant::now();
        for chunk in keys.chunks(batch as usize) {
            let entries = b.batch_resolve(chunk, false);
            for e in &entries {
                assert!(e.found && e.size == size, "resolve");
                for (j, p) in e.pages.iter().enumerate() {
                    let off = j as u64 * page;
                    let n = (size - off).min(page) as usize;
                    // SAFETY: the page is inside the arena and leased to this reader.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            base.add((u64::from(p.page_index) * page) as usize),
                            dst.slice_mut().as_mut_ptr().add(off as usize),
                            n,
                        )
                    };
                }
            }
            // The reader is done: end its leases so the pages serve the next batch.
            clock.advance(lease + Duration::from_millis(1));
        }
        get += start.elapsed();
    }
    assert_eq!(dst.slice(), src.slice(), "the last value read back differs");
    drop(raw);
    b.evict(&keys);
    b.reaper_tick();
    let bytes = size * count;
    (gbps(bytes, put), gbps(bytes, get), gbps(bytes, raw_write), gbps(bytes, raw_read))
}

/// A comma-separated list from `name`, or `default`.
fn list_or(name: &str, default: &[&str]) -> Vec<String> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v.split(',').map(|s| s.trim().to_owned()).collect(),
        _ => default.iter().map(|s| (*s).to_owned()).collect(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds = env_or("UMBP_BENCH_ROUNDS", 5).max(1);
    let bytes = env_or("UMBP_BENCH_MIB", 256).max(8) * MIB;
    let group_bytes = env_or("UMBP_BENCH_GROUP_MIB", 16).max(1) * MIB;
    let root = std::env::var_os("UMBP_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = tempfile::Builder::new().prefix("umbp-ssd-bench").tempdir_in(&root).expect("bench dir");
    let mut engines = Vec::new();
    for name in list_or("UMBP_BENCH_ENGINES", &["psync", "io_uring"]) {
        match name.parse::<IoEngineKind>() {
            Ok(IoEngineKind::IoUring) => match umbp_ssd::io_uring_available() {
                Ok(()) => engines.push(IoEngineKind::IoUring),
                Err(e) => eprintln!("io_uring rows skipped: {e}"),
            },
            Ok(kind) => engines.push(kind),
            Err(e) => eprintln!("{e}"),
        }
    }
    let sizes: Vec<u64> = list_or("UMBP_BENCH_VALUES_MIB", &["1", "2"])
        .iter()
        .filter_map(|s| s.parse::<u64>().ok())
        .map(|m| m * MIB)
        .collect();
    let batches: Vec<u64> = list_or("UMBP_BENCH_BATCHES", &["1", "8"])
        .iter()
        .filter_map(|s| s.parse::<u64>().ok())
        .filter(|b| *b > 0)
        .collect();
    println!(
        "SsdBackend vs raw O_DIRECT on {} ({} MiB per cell and round, medians of {rounds} rounds)\n",
        root.display(),
        bytes / MIB
    );
    println!("| engine | op | value | batch | SsdBackend GB/s | raw O_DIRECT GB/s | ratio |");
    println!("|---|---|---|---|---|---|---|");
    for &engine in &engines {
        for &size in &sizes {
            for &batch in &batches {
                let clock = ManualClock::new();
                let cell_dir = dir.path().join(format!("{engine}-{size}-{batch}"));
                let config = SsdConfig::builder([cell_dir.clone()])
                    .page_size(size)
                    .capacity_bytes(4 * bytes)
                    .staging_pages(16)
                    .io_engine(engine)
                    .watermarks(None)
                    .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
                    .build()
                    .expect("config");
                let b = SsdBackend::new(config);
                b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
                let count = bytes / size;
                let (mut put, mut get, mut rw, mut rr) = (vec![], vec![], vec![], vec![]);
                // Whole batches of about `UMBP_BENCH_GROUP_MIB` per group.
                let group = ((group_bytes / size).max(1).div_ceil(batch) * batch) as usize;
                for round in 0..rounds {
                    let (p, g, w, r) = round_of(&b, &clock, dir.path(), round, size, count, batch, group);
                    rw.push(w);
                    rr.push(r);
                    put.push(p);
                    get.push(g);
                }
                // Compaction competes with puts for the drive: say whether it ran in this cell.
                let stats = b.stats();
                eprintln!(
                    "{engine} {} MiB batch {batch}: compaction moved {} records, {} segments deleted",
                    size / MIB,
                    stats.compaction_moved,
                    stats.segments_reclaimed
                );
                // Each round's own ratios (ours over the baseline of the same round): pooled over
                // runs, a steadier figure than one run's ratio of medians on a noisy disk.
                let paired = |ours: &[f64], base: &[f64]| {
                    ours.iter().zip(base).map(|(o, b)| format!("{:.2}", o / b)).collect::<Vec<_>>().join(" ")
                };
                eprintln!(
                    "paired {engine} {} {batch} put: {} | get: {}",
                    size / MIB,
                    paired(&put, &rw),
                    paired(&get, &rr)
                );
                b.shutdown();
                drop(b);
                let _ = std::fs::remove_dir_all(&cell_dir);
                let value = format!("{} MiB", size / MIB);
                for (op, ours, base) in [("put", median(put), median(rw)), ("get", median(get), median(rr))] {
                    println!("| {engine} | {op} | {value} | {batch} | {ours:.2} | {base:.2} | {:.2} |", ours / base);
                }
            }
        }
    }
}
