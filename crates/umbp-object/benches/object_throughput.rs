//! `ObjectBackend` put (allocate + copy into the staging pages + commit: the upload) and get
//! (resolve: the download + copy out of the staging pages + release) throughput, beside a
//! same-run baseline: the raw client (`rusty-s3` signing, `ureq` sending, as the medium does) doing
//! PUTs and GETs of the same values with the same concurrency, on the same `moto_server`. The two
//! take turns every round, so both see the same server.
//!
//! Run: `cargo bench -p umbp-object --bench object_throughput` (needs `moto_server` on `PATH` or at
//! `UMBP_MOTO_SERVER`). `UMBP_BENCH_ROUNDS` (default 5), `UMBP_BENCH_VALUES` (values per round and
//! side, default 32), `UMBP_BENCH_VALUE_KIB` (default 1024) and `UMBP_BENCH_CONCURRENCY` (requests
//! at once: the medium's `io_threads` and batch, the baseline's threads; default 8) tune it. Gets run
//! after the staged copies are dropped, so every get downloads. `UMBP_BENCH_BATCH` (default: every
//! value of the round in one batch, as a pool client's pipelined chunks keep the medium's workers
//! busy) sets the keys per `batch_commit` and `batch_resolve`; a batch no larger than the
//! concurrency waits for its slowest request before the next starts, which the baseline's threads
//! never do. Prints a markdown table of medians.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, ReadRelease};
use umbp_object::{ObjectBackend, ObjectConfig};
use umbp_testkit::LocalOnlyRegistrar;

const BUCKET: &str = "bench";

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Puts `values` through the medium in batches of `batch`; returns the time taken.
fn medium_put(m: &ObjectBackend, round: u64, values: &[Vec<u8>], batch: usize) -> Duration {
    let base = m.buffer_ref(0).expect("arena").local_region().expect("host").ptr().as_ptr();
    let ps = m.page_size() as usize;
    let t = Instant::now();
    for (c, chunk) in values.chunks(batch).enumerate() {
        let keys: Vec<String> = (0..chunk.len()).map(|i| format!("m{round}-{c}-{i}")).collect();
        let reqs: Vec<AllocateRequest> =
            keys.iter().zip(chunk).map(|(k, v)| AllocateRequest::new(k.clone(), v.len() as u64)).collect();
        let slots = m.batch_allocate(&reqs);
        let mut commits = Vec::with_capacity(slots.len());
        for ((slot, v), k) in slots.iter().zip(chunk).zip(&keys) {
            assert_eq!(slot.outcome, AllocateOutcome::Allocated, "allocate {k}");
            for (p, part) in slot.pages.iter().zip(v.chunks(ps)) {
                // SAFETY: the slot's pages lie in the arena and are the slot's until commit.
                unsafe {
                    std::ptr::copy_nonoverlapping(part.as_ptr(), base.add(p.page_index as usize * ps), part.len())
                };
            }
            commits.push(CommitRequest::new(slot.slot_id, k.clone()));
        }
        assert!(m.batch_commit(&commits).iter().all(|r| r.success), "commits");
    }
    t.elapsed()
}

/// Gets the values of round `round` through the medium in batches, copying each out.
fn medium_get(m: &ObjectBackend, round: u64, values: &[Vec<u8>], batch: usize) -> Duration {
    let base = m.buffer_ref(0).expect("arena").local_region().expect("host").ptr().as_ptr();
    let ps = m.page_size() as usize;
    let mut out = vec![0u8; values.iter().map(Vec::len).max().unwrap_or(0)];
    m.drop_cached_copies();
    let t = Instant::now();
    for (c, chunk) in values.chunks(batch).enumerate() {
        let keys: Vec<String> = (0..chunk.len()).map(|i| format!("m{round}-{c}-{i}")).collect();
        let hits = m.batch_resolve(&keys, false);
        let mut releases = Vec::with_capacity(hits.len());
        for ((hit, v), k) in hits.iter().zip(chunk).zip(&keys) {
            assert!(hit.found, "resolve {k}: {hit:?}");
            let mut at = 0;
            for p in &hit.pages {
                let n = (v.len() - at).min(ps);
                // SAFETY: the leased pages lie in the arena and are not written while leased.
                let src = unsafe { std::slice::from_raw_parts(base.add(p.page_index as usize * ps), n) };
                out[at..at + n].copy_from_slice(src);
                at += n;
            }
            assert!(out[..v.len()] == v[..], "{k} differs");
            releases.push(ReadRelease::new(k.clone(), hit.lease));
        }
        m.release_reads(&releases);
    }
    t.elapsed()
}

/// Runs `f(i)` for every value index on `threads` threads; returns the time taken.
fn raw_parallel(n: usize, threads: usize, f: impl Fn(usize) + Sync) -> Duration {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    f(i);
                }
            });
        }
    });
    t.elapsed()
}

fn main() {
    let Some(moto) = support::Moto::start() else { return };
    let raw = Arc::new(moto.client(BUCKET));
    raw.create_bucket();
    let rounds = env_or("UMBP_BENCH_ROUNDS", 5);
    let count = env_or("UMBP_BENCH_VALUES", 32) as usize;
    let value_len = env_or("UMBP_BENCH_VALUE_KIB", 1024) as usize * 1024;
    let concurrency = env_or("UMBP_BENCH_CONCURRENCY", 8) as usize;
    let batch = (env_or("UMBP_BENCH_BATCH", count as u64) as usize).clamp(1, count);
    let page = (value_len as u64).next_power_of_two().max(4096);
    let config = ObjectConfig::builder(format!("s3://{BUCKET}/medium"))
        .endpoint(moto.endpoint())
        .credentials(support::credentials())
        .page_size(page)
        .capacity_bytes(page * (count as u64) * (rounds + 1))
        .staging_pages(batch as u64)
        .io_threads(concurrency)
        .cache_committed(false)
        .op_timeout(Duration::from_secs(60))
        .request_timeout(Duration::from_secs(60))
        .build()
        .expect("config");
    let m = ObjectBackend::new(config);
    m.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    let values: Vec<Vec<u8>> = (0..count).map(|i| support::value(i as u64, value_len)).collect();
    let bytes = (count * value_len) as f64;
    let mbps = |d: Duration| bytes / d.as_secs_f64() / 1e6;
    let (mut mp, mut rp, mut mg, mut rg) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let raw_name = |i: usize| format!("raw/r{round}-{i}");
        rp.push(mbps(raw_parallel(count, concurrency, |i| raw.put(&raw_name(i), &values[i]))));
        mp.push(mbps(medium_put(&m, round, &values, batch)));
        rg.push(mbps(raw_parallel(count, concurrency, |i| {
            let got = raw.get(&raw_name(i)).expect("raw object");
            assert!(got == values[i], "raw get differs");
        })));
        mg.push(mbps(medium_get(&m, round, &values, batch)));
        eprintln!(
            "round {round}: put medium {:.0} raw {:.0} MB/s; get medium {:.0} raw {:.0} MB/s",
            mp[mp.len() - 1],
            rp[rp.len() - 1],
            mg[mg.len() - 1],
            rg[rg.len() - 1]
        );
    }
    m.shutdown();
    // The ratio of each round (the two sides took turns on the same server), then the median.
    let ratio = |a: &[f64], b: &[f64]| median(a.iter().zip(b).map(|(x, y)| x / y).collect());
    let (put_ratio, get_ratio) = (ratio(&mp, &rp), ratio(&mg, &rg));
    let (mp, rp, mg, rg) = (median(mp), median(rp), median(mg), median(rg));
    println!(
        "\n{count} values of {} KiB per round, batches of {batch}, {concurrency} requests at once, median of {rounds} \
         rounds\n",
        value_len / 1024
    );
    println!("| op | ObjectBackend MB/s | raw rusty-s3 + ureq MB/s | ratio (median of the rounds' ratios) |");
    println!("|---|---|---|---|");
    println!("| put | {mp:.0} | {rp:.0} | {put_ratio:.2} |");
    println!("| get | {mg:.0} | {rg:.0} | {get_ratio:.2} |");
}
