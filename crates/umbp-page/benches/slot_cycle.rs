//! The slot cycle allocate → commit → resolve → evict on `PageBackend`, per key, for batches of 1 and
//! 128 keys on 1 and 2 threads, beside a same-run baseline: the bare bookkeeping floor of a
//! `std::collections::HashMap` insert + get + remove of the same keys (what any key → pages map must
//! pay at least).
//!
//! Run: `cargo xtask bench` or `cargo bench -p umbp-page --bench slot_cycle`. Prints a markdown table
//! of medians over several rounds; `UMBP_BENCH_ROUNDS` (default 7) and `UMBP_BENCH_MILLIS` (per round,
//! default 300) tune it.

use std::collections::HashMap;

use parking_lot::Mutex;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, ManualClock, MediumBackend, TierType};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_testkit::LocalOnlyRegistrar;

const PAGE: u64 = 4096;
const PAGES: u64 = 64 * 1024;
const KEYS_PER_THREAD: usize = 1024;
/// A short lease keeps the shared manual clock's total advance (one lease per chunk, from every thread)
/// far below the pending TTL, so another thread's advances never expire a slot mid-cycle.
const LEASE: Duration = Duration::from_millis(1);
const PENDING_TTL: Duration = Duration::from_secs(24 * 3600);

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A backend on a manual clock: the cycle moves time past the read lease between resolve and evict,
/// so the evict frees the key while the lease bookkeeping (insert, expiry check, erase) is still paid.
fn backend() -> (PageBackend, Arc<ManualClock>) {
    let clock = ManualClock::new();
    let config = PageBackendConfig::new(TierType::Dram, PAGE, vec![PAGES * PAGE])
        .with_read_lease_ttl(LEASE)
        .with_pending_ttl(PENDING_TTL)
        .with_clock(clock.clone());
    let source = HostPageMemorySource::new(HostMemoryOptions::default());
    let b = PageBackend::new(config, Box::new(source)).expect("config");
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    (b, clock)
}

/// One full cycle over `keys` in batches of `batch`; returns keys processed.
fn cycle(b: &PageBackend, clock: &ManualClock, keys: &[String], batch: usize) -> u64 {
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
    // A node's heartbeat ships the outbox regularly; here once per 1024-key pass, so the outbox stays
    // bounded as it does in a node.
    black_box(b.drain_pending_events());
    keys.len() as u64
}

/// The floor: a key → (pages, size) map's insert, get and remove, with the same key clones, behind one
/// lock shared by every thread and taken once per phase of a batch (as the backend takes its lock once
/// per batch call), so the 2-thread rows compare contended lock against contended lock.
fn baseline(map: &Mutex<HashMap<String, (u64, u64)>>, keys: &[String], batch: usize) -> u64 {
    for chunk in keys.chunks(batch) {
        {
            let mut m = map.lock();
            for (i, k) in chunk.iter().enumerate() {
                m.insert(k.clone(), (i as u64, PAGE));
            }
        }
        {
            let m = map.lock();
            for k in chunk {
                black_box(m.get(k));
            }
        }
        {
            let mut m = map.lock();
            for k in chunk {
                black_box(m.remove(k));
            }
        }
    }
    keys.len() as u64
}

/// Runs `work` on `threads` threads for `budget`; returns wall-clock ns per key over all threads.
fn round<S: Send>(
    threads: usize,
    budget: Duration,
    setup: impl Fn(usize) -> S + Sync,
    work: impl Fn(&mut S, &[String]) -> u64 + Sync,
) -> f64 {
    let barrier = std::sync::Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, setup, work) = (&barrier, &setup, &work);
                s.spawn(move || {
                    let keys: Vec<String> = (0..KEYS_PER_THREAD).map(|i| format!("t{t}-block-{i:08}")).collect();
                    let mut state = setup(t);
                    barrier.wait();
                    let start = Instant::now();
                    let mut n = 0u64;
                    while start.elapsed() < budget {
                        n += work(&mut state, &keys);
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
    let rounds = env_or("UMBP_BENCH_ROUNDS", 7).max(1);
    let budget = Duration::from_millis(env_or("UMBP_BENCH_MILLIS", 300));
    println!("slot cycle: {rounds} rounds of {budget:?} each; medians; ns per key = wall time / keys over all threads");
    println!();
    println!(
        "| workload | threads | batch | PageBackend ns/key | baseline ns/key (locked HashMap insert+get+remove) | ratio |"
    );
    println!("|---|---|---|---|---|---|");
    for threads in [1usize, 2] {
        for batch in [1usize, 128] {
            let (b, clock) = backend();
            let mut ours = Vec::new();
            let mut base = Vec::new();
            // Interleave the two so machine noise hits both alike.
            for _ in 0..rounds {
                ours.push(round(threads, budget, |_| (), |_, keys| cycle(&b, &clock, keys, batch)));
                let map = Mutex::new(HashMap::with_capacity(KEYS_PER_THREAD * threads));
                base.push(round(threads, budget, |_| (), |_, keys| baseline(&map, keys, batch)));
            }
            let (ours, base) = (median(ours), median(base));
            println!(
                "| allocate→commit→resolve→evict | {threads} | {batch} | {ours:.0} | {base:.0} | {:.2} |",
                ours / base
            );
            b.shutdown();
        }
    }
}
