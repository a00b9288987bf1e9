//! The cost of `InstrumentedBackend`: the slot cycle of `umbp-page`'s `slot_cycle` bench
//! (allocate → commit → resolve → evict per key) on a `PageBackend`, called through
//! `Arc<dyn MediumBackend>` as the node calls it, bare and wrapped, in the same run.
//!
//! Run: `cargo bench -p umbp-metrics --bench instrumented_overhead`. Prints a markdown table of
//! medians; `UMBP_BENCH_ROUNDS` (default 15) and `UMBP_BENCH_MILLIS` (per round, default 200) tune it.
//! Both variants drive the same backend (so the same maps and allocator state) and alternate round
//! by round, so machine noise hits both alike.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, ManualClock, MediumBackend, TierType};
use umbp_metrics::InstrumentedBackend;
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_testkit::LocalOnlyRegistrar;

const PAGE: u64 = 4096;
const PAGES: u64 = 64 * 1024;
const KEYS_PER_THREAD: usize = 1024;
/// As in `slot_cycle`: a short lease on a shared manual clock never expires a pending slot.
const LEASE: Duration = Duration::from_millis(1);
const PENDING_TTL: Duration = Duration::from_secs(24 * 3600);

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// One `PageBackend`, seen bare and through the decorator: both variants run on the same maps and
/// the same allocator state, so what differs between them is the decorator alone.
fn backends() -> (Arc<dyn MediumBackend>, Arc<dyn MediumBackend>, Arc<ManualClock>) {
    let clock = ManualClock::new();
    let config = PageBackendConfig::new(TierType::Dram, PAGE, vec![PAGES * PAGE])
        .with_read_lease_ttl(LEASE)
        .with_pending_ttl(PENDING_TTL)
        .with_clock(clock.clone());
    let source = HostPageMemorySource::new(HostMemoryOptions::default());
    let bare: Arc<dyn MediumBackend> = Arc::new(PageBackend::new(config, Box::new(source)).expect("config"));
    bare.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    let wrapped = InstrumentedBackend::wrap(Arc::clone(&bare));
    (bare, wrapped, clock)
}

/// One full cycle over `keys` in batches of `batch`; returns keys processed.
fn cycle(b: &dyn MediumBackend, clock: &ManualClock, keys: &[String], batch: usize) -> u64 {
    for chunk in keys.chunks(batch) {
        let reqs: Vec<AllocateRequest> = chunk.iter().map(|k| AllocateRequest::new(k.clone(), PAGE)).collect();
        let allocated = b.batch_allocate(&reqs);
        let commits: Vec<CommitRequest> = allocated
            .iter()
            .zip(chunk)
            .map(|(a, k)| {
                assert_eq!(a.outcome, AllocateOutcome::Allocated);
                CommitRequest::new(a.slot_id, k.clone())
            })
            .collect();
        black_box(b.batch_commit(&commits));
        black_box(b.batch_resolve(chunk, false));
        clock.advance(LEASE);
        let freed = b.evict(chunk);
        assert!(freed.iter().all(|r| r.bytes_freed == PAGE), "every key evicted");
    }
    black_box(b.drain_pending_events());
    keys.len() as u64
}

/// Runs the cycle on `threads` threads for `budget`; returns wall-clock ns per key over all threads.
fn round(b: &dyn MediumBackend, clock: &ManualClock, threads: usize, batch: usize, budget: Duration) -> f64 {
    let barrier = std::sync::Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    let keys: Vec<String> = (0..KEYS_PER_THREAD).map(|i| format!("t{t}-block-{i:08}")).collect();
                    barrier.wait();
                    let start = Instant::now();
                    let mut n = 0u64;
                    while start.elapsed() < budget {
                        n += cycle(b, clock, &keys, batch);
                    }
                    n
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let keys: u64 = handles.into_iter().map(|h| h.join().expect("bench thread")).sum();
        start.elapsed().as_nanos() as f64 / keys as f64
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds = env_or("UMBP_BENCH_ROUNDS", 15).max(1);
    let budget = Duration::from_millis(env_or("UMBP_BENCH_MILLIS", 200));
    println!("InstrumentedBackend overhead: {rounds} rounds of {budget:?} each, alternating; medians; ns per key");
    println!();
    println!(
        "| workload | threads | batch | bare PageBackend ns/key | InstrumentedBackend ns/key | ratio | overhead |"
    );
    println!("|---|---|---|---|---|---|---|");
    for threads in [1usize, 2] {
        for batch in [1usize, 128] {
            let (bare, wrapped, clock) = backends();
            let mut b = Vec::new();
            let mut w = Vec::new();
            for _ in 0..rounds {
                b.push(round(bare.as_ref(), &clock, threads, batch, budget));
                w.push(round(wrapped.as_ref(), &clock, threads, batch, budget));
            }
            let (b, w) = (median(b), median(w));
            println!(
                "| allocate→commit→resolve→evict | {threads} | {batch} | {b:.0} | {w:.0} | {:.3} | {:+.1}% |",
                w / b,
                (w / b - 1.0) * 100.0
            );
            bare.shutdown();
        }
    }
}
