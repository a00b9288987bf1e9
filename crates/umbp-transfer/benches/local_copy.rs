//! `LocalCopyEngine` on 2 MiB pages in batches of 64 (128 MiB per batch, pages scattered so nothing
//! coalesces), beside a same-run baseline: raw `memcpy` (`ptr::copy_nonoverlapping`) of the same
//! pages on the same number of threads.
//!
//! Run: `cargo xtask bench` or `cargo bench -p umbp-transfer --bench local_copy`. Medians of
//! `UMBP_BENCH_ROUNDS` (default 7) rounds of `UMBP_BENCH_MILLIS` (default 400) each.

use std::hint::black_box;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use umbp_core::{LocalRegion, MemoryLocation, TransferRef};
use umbp_transfer::{LocalCopyConfig, LocalCopyEngine, TransferEngine, TransferItem};

const PAGE: usize = 2 << 20;
const BATCH: usize = 64;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Destination page of source page `i`: a permutation with no two neighbours adjacent.
fn dst_page(i: usize) -> usize {
    (i * 7) % BATCH
}

fn region(buf: &mut [u8]) -> TransferRef {
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: the buffers live for the whole bench and are never resized.
    TransferRef::local(unsafe { LocalRegion::new(ptr, buf.len() as u64, MemoryLocation::Host) })
}

struct SendPtr(*mut u8);
// SAFETY: the bench threads write disjoint pages of buffers that outlive the scope.
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

fn raw_memcpy(src: &TransferRef, dst: &TransferRef, threads: usize) {
    let ptr = |r: &TransferRef| r.local_region().expect("local").ptr().as_ptr();
    let (s, d) = (SendPtr(ptr(src)), SendPtr(ptr(dst)));
    let (s, d) = (&s, &d);
    std::thread::scope(|scope| {
        for t in 0..threads {
            scope.spawn(move || {
                for i in (t..BATCH).step_by(threads) {
                    // SAFETY: page `i` of src and page `dst_page(i)` of dst lie inside the 128 MiB
                    // buffers; each thread takes distinct pages.
                    unsafe { std::ptr::copy_nonoverlapping(s.0.add(i * PAGE), d.0.add(dst_page(i) * PAGE), PAGE) };
                }
            });
        }
    });
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GB/s of `f` run repeatedly for `budget`.
fn gbps(budget: Duration, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut batches = 0u64;
    while start.elapsed() < budget {
        f();
        batches += 1;
    }
    (batches * (BATCH * PAGE) as u64) as f64 / start.elapsed().as_secs_f64() / 1e9
}

fn main() {
    let rounds = env_or("UMBP_BENCH_ROUNDS", 7).max(1);
    let budget = Duration::from_millis(env_or("UMBP_BENCH_MILLIS", 400));
    let mut src = vec![0u8; BATCH * PAGE];
    let mut dst = vec![0u8; BATCH * PAGE];
    src.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    dst.fill(1); // fault every page in before timing
    let (rs, rd) = (region(&mut src), region(&mut dst));
    let items: Vec<TransferItem> = (0..BATCH)
        .map(|i| TransferItem {
            src: rs.clone(),
            src_offset: (i * PAGE) as u64,
            dst: rd.clone(),
            dst_offset: (dst_page(i) * PAGE) as u64,
            size: PAGE as u64,
            tag: i as u64,
        })
        .collect();
    let max_threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("local copy: {BATCH} x 2 MiB pages per batch, {rounds} rounds of {budget:?}; medians");
    println!();
    println!("| engine | threads | item | LocalCopyEngine GB/s | raw memcpy GB/s | ratio |");
    println!("|---|---|---|---|---|---|");
    let mut thread_counts = vec![1, max_threads];
    thread_counts.dedup();
    for threads in thread_counts {
        let engine = LocalCopyEngine::new(LocalCopyConfig { threads, ..LocalCopyConfig::default() });
        let (mut ours, mut base) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            ours.push(gbps(budget, || {
                let set = engine.plan(&items);
                assert!(set.rejected_tags.is_empty());
                let failures = engine.submit(set.plans).expect("submit").wait();
                assert!(failures.is_empty());
            }));
            base.push(gbps(budget, || raw_memcpy(black_box(&rs), black_box(&rd), threads)));
        }
        let (ours, base) = (median(ours), median(base));
        println!("| LocalCopyEngine | {threads} | 2 MiB x {BATCH} | {ours:.2} | {base:.2} | {:.2} |", ours / base);
    }
    drop((rs, rd, items));
    assert_eq!(dst[dst_page(1) * PAGE], src[PAGE], "the copies really happened");
}
