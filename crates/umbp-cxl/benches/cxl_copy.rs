//! The CXL medium's put (allocate + copy each value into its slot's page through the mapping +
//! commit) and get (resolve + copy out of the page into a caller buffer + release the read) beside
//! a same-run baseline: `memcpy` of the same bytes, in the same value-sized copies, into and out of
//! the same `MAP_SHARED` mapping (its first `UMBP_BENCH_MIB`, the range the medium's slots occupy:
//! its capacity is exactly one round). Both sides run on one thread, reuse one source and one
//! destination buffer of one value, and stamp each value's index into its first bytes, which every
//! get checks. The page size is the value size. The mapping is touched once before timing, so
//! neither side pays the first page faults. The two take turns batch by batch (`batch` keys per
//! medium call, as many copies for the baseline), alternating who goes first, so both meet the same
//! load; after each round the medium evicts the round's keys. Ratio = medium / memcpy.
//!
//! Two ratios per cell, each the median over rounds: of the whole round's GB/s (every batch's time
//! summed), and the median over pairs of neighbouring batches (one in each order) of their own
//! ratios against the memcpy beside them, which a preemption by another process (this is a 2-core
//! VM shared with builds) moves by one pair at most. A second table gives the medium's calls alone,
//! without the copies, per value: the cost that separates the two sides.
//!
//! A file in `/dev/shm` (tmpfs) stands in for a device-DAX device (`/dev/daxX.Y`); a regular file
//! under cargo's target tmp dir adds a page-cache-backed row (no CXL or persistent memory here).
//! Both are ordinary DRAM behind the mapping, so the ratio measures the medium's bookkeeping per
//! value against the copy, not a device.
//!
//! Run: `cargo bench -p umbp-cxl --bench cxl_copy` (on a loaded machine, `chrt -f 10 cargo bench …`
//! as root keeps other processes from preempting the copies). Prints markdown tables of medians.
//! `UMBP_BENCH_ROUNDS` (default 15), `UMBP_BENCH_MIB` (bytes per round and cell, default 128),
//! `UMBP_BENCH_VALUES_KIB` (`64,1024`), `UMBP_BENCH_BATCHES` (`1,8`) and `UMBP_BENCH_DIRS`
//! (`/dev/shm,<target tmp>`: one file per directory) tune it. Each cell prints its per-round ratios
//! on stderr.

use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, ReadRelease, TierType};
use umbp_cxl::{CxlConfig, make_cxl_backend};
use umbp_page::PageBackendConfig;
use umbp_testkit::LocalOnlyRegistrar;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
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

fn median_duration(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// GB/s of `bytes` in `time`.
fn gbps(bytes: u64, time: Duration) -> f64 {
    bytes as f64 / time.as_secs_f64() / 1e9
}

/// Writes value `i`'s stamp into the first bytes of `buf`: each copy then carries a different value,
/// and a get can tell which one it read.
fn stamp(buf: &mut [u8], i: u64) {
    buf[..8].copy_from_slice(&i.to_le_bytes());
}

fn stamp_of(buf: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[..8]);
    u64::from_le_bytes(b)
}

/// One cell: a CXL backend over a file in one directory, with one value size (its page size, so a
/// value is one page and page `j` is the mapping's range `j * size ..`, the baseline's `j`th copy).
struct Cell {
    backend: Box<dyn MediumBackend>,
    /// The mapping's first byte (the backend's one buffer).
    base: *mut u8,
    size: usize,
    src: Vec<u8>,
    dst: Vec<u8>,
    /// The page each key of the round was given by the medium's put.
    page_of: Vec<usize>,
}

impl Cell {
    /// Puts the values of `range` through the medium in one batch: one allocate, a copy into each
    /// slot's page, one commit.
    fn medium_put(&mut self, keys: &[String], range: Range<usize>) -> Duration {
        let keys = &keys[range.clone()];
        let start = Instant::now();
        let reqs: Vec<AllocateRequest> =
            keys.iter().map(|k| AllocateRequest::new(k.clone(), self.size as u64)).collect();
        let slots = self.backend.batch_allocate(&reqs);
        let mut commits = Vec::with_capacity(keys.len());
        for ((i, key), a) in range.clone().zip(keys).zip(&slots) {
            assert!(a.outcome == AllocateOutcome::Allocated && a.pages.len() == 1, "allocate {key}");
            let page = a.pages[0].page_index as usize;
            stamp(&mut self.src, i as u64);
            // SAFETY: the page lies in the mapping (the backend's only buffer, of `count` pages of
            // `size` bytes) and is reserved for this slot until commit; `src` is one page.
            unsafe { std::ptr::copy_nonoverlapping(self.src.as_ptr(), self.base.add(page * self.size), self.size) };
            commits.push(CommitRequest::new(a.slot_id, key.clone()));
            self.page_of[i] = page;
        }
        assert!(self.backend.batch_commit(&commits).iter().all(|c| c.success), "commit");
        start.elapsed()
    }

    /// Gets the values of `range` back through the medium in one batch: one resolve, a copy out of
    /// each key's page, one release; key `i` must read the stamp `expect[i]`.
    fn medium_get(&mut self, keys: &[String], expect: &[u64], range: Range<usize>) -> Duration {
        let keys = &keys[range.clone()];
        let start = Instant::now();
        let hits = self.backend.batch_resolve(keys, false);
        let mut releases = Vec::with_capacity(keys.len());
        for ((key, &want), e) in keys.iter().zip(&expect[range]).zip(&hits) {
            assert!(e.found && e.size == self.size as u64 && e.pages.len() == 1, "resolve {key}");
            let page = e.pages[0].page_index as usize;
            // SAFETY: the page lies in the mapping and is leased to this reader, so nothing writes
            // or frees it until the release below; `dst` is one page.
            unsafe { std::ptr::copy_nonoverlapping(self.base.add(page * self.size), self.dst.as_mut_ptr(), self.size) };
            assert_eq!(stamp_of(&self.dst), want, "{key} read another value");
            releases.push(ReadRelease::new(key.clone(), e.lease));
        }
        self.backend.release_reads(&releases);
        start.elapsed()
    }

    /// The medium's bookkeeping alone: the calls of `medium_put` and `medium_get` for every key,
    /// without the copies, then an evict. Mean time of a put's calls and of a get's calls.
    fn bookkeeping(&mut self, keys: &[String], batch: usize) -> (Duration, Duration) {
        let (mut put, mut get) = (Duration::ZERO, Duration::ZERO);
        for keys in keys.chunks(batch) {
            let start = Instant::now();
            let reqs: Vec<AllocateRequest> =
                keys.iter().map(|k| AllocateRequest::new(k.clone(), self.size as u64)).collect();
            let slots = self.backend.batch_allocate(&reqs);
            let commits: Vec<CommitRequest> =
                slots.iter().zip(keys).map(|(a, k)| CommitRequest::new(a.slot_id, k.clone())).collect();
            assert!(self.backend.batch_commit(&commits).iter().all(|c| c.success), "commit");
            put += start.elapsed();
        }
        for keys in keys.chunks(batch) {
            let start = Instant::now();
            let hits = self.backend.batch_resolve(keys, false);
            let releases: Vec<ReadRelease> =
                hits.iter().zip(keys).map(|(e, k)| ReadRelease::new(k.clone(), e.lease)).collect();
            self.backend.release_reads(&releases);
            get += start.elapsed();
        }
        assert!(self.backend.evict(keys).iter().all(|e| e.bytes_freed > 0), "every key evicts");
        drop(self.backend.drain_pending_events());
        let n = keys.len() as u32;
        (put / n, get / n)
    }

    /// `memcpy` of the same values into the mapping's consecutive pages.
    fn memcpy_put(&mut self, range: Range<usize>) -> Duration {
        let start = Instant::now();
        for i in range {
            stamp(&mut self.src, i as u64);
            // SAFETY: page `i` of `count` lies in the mapping; the medium's slots are committed or
            // free, and nothing else runs, so no copy races.
            unsafe { std::ptr::copy_nonoverlapping(self.src.as_ptr(), self.base.add(i * self.size), self.size) };
        }
        start.elapsed()
    }

    /// `memcpy` of the same pages out of the mapping; page `i` must hold the stamp `expect[i]`.
    fn memcpy_get(&mut self, expect: &[u64], range: Range<usize>) -> Duration {
        let start = Instant::now();
        for (i, &want) in expect[range.clone()].iter().enumerate().map(|(i, w)| (range.start + i, w)) {
            // SAFETY: as in `memcpy_put`; `dst` holds one page.
            unsafe { std::ptr::copy_nonoverlapping(self.base.add(i * self.size), self.dst.as_mut_ptr(), self.size) };
            assert_eq!(stamp_of(&self.dst), want, "page {i} holds another value");
        }
        start.elapsed()
    }
}

/// Per round: GB/s of medium put, memcpy put, medium get and memcpy get over the whole round
/// (every batch's time summed), and the median over the round's batches of each batch's own ratio
/// (medium / the memcpy of the same values right before or after it), which a preemption by
/// another process (this machine has 2 cores shared with builds) moves by one batch at most.
#[derive(Default)]
struct Samples {
    put: Vec<f64>,
    raw_put: Vec<f64>,
    get: Vec<f64>,
    raw_get: Vec<f64>,
    put_paired: Vec<f64>,
    get_paired: Vec<f64>,
    /// The medium's calls without the copies, per value: a put's, a get's.
    calls_put: Vec<Duration>,
    calls_get: Vec<Duration>,
}

fn run_cell(dir: &std::path::Path, size: u64, batch: usize, bytes: u64, rounds: u64) -> Samples {
    let count = (bytes / size).max(1) as usize;
    let capacity = count as u64 * size;
    let tmp = tempfile::Builder::new().prefix("umbp-cxl-bench").tempdir_in(dir).expect("bench dir");
    let config = CxlConfig::new(tmp.path().join("cxl.img"), capacity);
    let backend = make_cxl_backend(&config, PageBackendConfig::new(TierType::Dram, size, Vec::new())).expect("backend");
    backend.init(Arc::new(LocalOnlyRegistrar::new())).expect("init maps the file");
    assert_eq!(backend.capacity().total_bytes, capacity, "one round fills the mapping");
    let base = backend.buffer_ref(0).and_then(|r| r.local_region().map(|l| l.ptr().as_ptr())).expect("the mapping");
    // SAFETY: the mapping is `capacity` bytes, read-write, and nothing else uses it yet. Touching
    // every page now keeps the first page faults out of both sides' timings.
    unsafe { std::ptr::write_bytes(base, 0xA5, capacity as usize) };
    let src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let dst = vec![0; size as usize];
    let mut cell = Cell { backend, base, size: size as usize, src, dst, page_of: vec![0; count] };
    let mut s = Samples::default();
    for round in 0..rounds {
        let keys: Vec<String> = (0..count).map(|i| format!("r{round}-k{i}")).collect();
        // The two take turns batch by batch, alternating who goes first (and the first batch's
        // order from round to round), so both meet the same load on this shared machine (a
        // preemption lands on one batch of one side, not on a phase) and neither always meets the
        // warmer caches.
        let batches: Vec<(Range<usize>, bool)> = (0..count)
            .step_by(batch)
            .enumerate()
            .map(|(b, lo)| (lo..(lo + batch).min(count), (b as u64 + round).is_multiple_of(2)))
            .collect();
        let (mut put, mut raw_put) = (Vec::with_capacity(count), Vec::with_capacity(count));
        for (r, medium_first) in &batches {
            if *medium_first {
                put.push(cell.medium_put(&keys, r.clone()));
                raw_put.push(cell.memcpy_put(r.clone()));
            } else {
                raw_put.push(cell.memcpy_put(r.clone()));
                put.push(cell.medium_put(&keys, r.clone()));
            }
        }
        // Which stamp each page holds after the puts: the last writer's, replayed in the order
        // the batches wrote (value `i` goes to page `i` by memcpy, to key `i`'s page by the medium).
        let mut page_stamp = vec![0u64; count];
        for (r, medium_first) in &batches {
            let memcpy = r.clone().map(|i| (i, i));
            let medium = r.clone().map(|i| (cell.page_of[i], i));
            let writes: Vec<(usize, usize)> =
                if *medium_first { medium.chain(memcpy).collect() } else { memcpy.chain(medium).collect() };
            for (page, i) in writes {
                page_stamp[page] = i as u64;
            }
        }
        let key_stamp: Vec<u64> = cell.page_of.iter().map(|&p| page_stamp[p]).collect();
        let (mut get, mut raw_get) = (Vec::with_capacity(count), Vec::with_capacity(count));
        for (r, medium_first) in &batches {
            if *medium_first {
                get.push(cell.medium_get(&keys, &key_stamp, r.clone()));
                raw_get.push(cell.memcpy_get(&page_stamp, r.clone()));
            } else {
                raw_get.push(cell.memcpy_get(&page_stamp, r.clone()));
                get.push(cell.medium_get(&keys, &key_stamp, r.clone()));
            }
        }
        let evicted = cell.backend.evict(&keys);
        assert!(evicted.iter().all(|e| e.bytes_freed == size), "every key evicts");
        drop(cell.backend.drain_pending_events());
        for (all, times) in
            [(&mut s.put, &put), (&mut s.raw_put, &raw_put), (&mut s.get, &get), (&mut s.raw_get, &raw_get)]
        {
            all.push(gbps(capacity, times.iter().sum()));
        }
        // Whichever side goes second in a batch runs measurably faster (up to 2x at 64 KiB), so a
        // batch's ratio is taken with its neighbour's, which ran in the other order: the geometric
        // mean of the two cancels the order.
        let paired = |ours: &[Duration], base: &[Duration]| {
            let ratios: Vec<f64> = ours.iter().zip(base).map(|(o, b)| b.as_secs_f64() / o.as_secs_f64()).collect();
            let pairs: Vec<f64> = ratios.chunks_exact(2).map(|r| (r[0] * r[1]).sqrt()).collect();
            if pairs.is_empty() { ratios[0] } else { median(pairs) }
        };
        s.put_paired.push(paired(&put, &raw_put));
        s.get_paired.push(paired(&get, &raw_get));
        let keys: Vec<String> = (0..count).map(|i| format!("b{round}-k{i}")).collect();
        let (put, get) = cell.bookkeeping(&keys, batch);
        s.calls_put.push(put);
        s.calls_get.push(get);
    }
    cell.backend.shutdown();
    s
}

fn main() {
    let rounds = env_or("UMBP_BENCH_ROUNDS", 15).max(1);
    let bytes = env_or("UMBP_BENCH_MIB", 128).max(1) * MIB;
    let sizes: Vec<u64> = list_or("UMBP_BENCH_VALUES_KIB", &["64", "1024"])
        .iter()
        .filter_map(|s| s.parse::<u64>().ok())
        .filter(|k| k.is_power_of_two())
        .map(|k| k * KIB)
        .collect();
    let batches: Vec<usize> = list_or("UMBP_BENCH_BATCHES", &["1", "8"])
        .iter()
        .filter_map(|s| s.parse::<usize>().ok())
        .filter(|b| *b > 0)
        .collect();
    let target_tmp = env!("CARGO_TARGET_TMPDIR");
    let dirs: Vec<PathBuf> =
        list_or("UMBP_BENCH_DIRS", &["/dev/shm", target_tmp]).into_iter().map(PathBuf::from).collect();
    println!(
        "CxlBackend vs memcpy of the same mapping ({} MiB per cell and round, medians of {rounds} rounds)\n",
        bytes / MIB
    );
    println!("| file | op | value | batch | CxlBackend GB/s | memcpy GB/s | ratio | ratio of paired batches |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut calls = Vec::new();
    for dir in &dirs {
        if !dir.is_dir() {
            eprintln!("{} skipped: not a directory", dir.display());
            continue;
        }
        for &size in &sizes {
            for &batch in &batches {
                let s = run_cell(dir, size, batch, bytes, rounds);
                let paired = |ours: &[f64], base: &[f64]| {
                    ours.iter().zip(base).map(|(o, b)| format!("{:.2}", o / b)).collect::<Vec<_>>().join(" ")
                };
                eprintln!(
                    "paired {} {} KiB batch {batch} put: {} | get: {}",
                    dir.display(),
                    size / KIB,
                    paired(&s.put, &s.raw_put),
                    paired(&s.get, &s.raw_get)
                );
                let value = if size >= MIB { format!("{} MiB", size / MIB) } else { format!("{} KiB", size / KIB) };
                let us = |d: Duration| d.as_secs_f64() * 1e6;
                let copy_us = |gbps: f64| size as f64 / gbps / 1e3;
                calls.push(format!(
                    "| {} | {value} | {batch} | {:.2} | {:.2} | {:.2} | {:.2} |",
                    dir.display(),
                    us(median_duration(s.calls_put)),
                    us(median_duration(s.calls_get)),
                    copy_us(median(s.raw_put.clone())),
                    copy_us(median(s.raw_get.clone())),
                ));
                let cells = [("put", s.put, s.raw_put, s.put_paired), ("get", s.get, s.raw_get, s.get_paired)];
                for (op, all, raw_all, paired) in cells {
                    let (all, raw_all, paired) = (median(all), median(raw_all), median(paired));
                    println!(
                        "| {} | {op} | {value} | {batch} | {all:.2} | {raw_all:.2} | {:.2} | {paired:.2} |",
                        dir.display(),
                        all / raw_all
                    );
                }
            }
        }
    }
    println!("\nThe medium's calls alone (no copy), µs per value, beside one value's memcpy\n");
    println!("| file | value | batch | put: allocate + commit | get: resolve + release | memcpy in | memcpy out |");
    println!("|---|---|---|---|---|---|---|");
    for row in calls {
        println!("{row}");
    }
}
