//! The master index's map layout against `DashMap`, as bare maps: keys per second.
//!
//! Both maps hold `Arc<str> → value` (a size and three atomic stamps, like the index's entries),
//! hashed with foldhash:
//!
//! - **sharded**: the layout of `InMemoryStore` — 32 `parking_lot::RwLock<HashMap>` shards picked by
//!   `foldhash(key, fixed seed) % 32`; a batch is grouped by shard (the store's counting sort) and
//!   takes each shard's lock once.
//! - **dashmap**: `DashMap` with its default shard count, one lookup (one shard lock) per key.
//! - **dashmap/32**: the same with 32 shards, as ours.
//!
//! Two workloads, at 1, 2, 4, … threads (up to the CPU count, at least 4) over 100 k keys:
//!
//! - **route-get**: batches of 128 random keys, each found and stamped (lease, access time, count
//!   with atomics under the read lock), as `batch_lookup_for_route_get` does;
//! - **ingest**: each thread a node applying 1024-key bundles of its own keys (insert, or update the
//!   size of a key already there), as a heartbeat's `ADD`s do; then removing them.
//!
//! What the bare maps cannot show, and what decided the layout, is the store's multi-key operations:
//! a full-sync chunk and the sweep hold one shard across a group of keys (and the shard's reverse
//! index `node → keys`), which `DashMap` has no public API for (only per-key guards, or `retain`
//! over the whole map). Each figure is the median of five rounds.
//!
//! Run: `cargo bench -p umbp-master --bench index_map` (arguments are ignored).

use std::hash::BuildHasher;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use foldhash::HashMap;
use foldhash::fast::{FixedState, RandomState};
use parking_lot::RwLock;

const KEYS: usize = 100_000;
const BATCH: usize = 128;
const BUNDLE: usize = 1024;
/// Keys each thread looks up per round of route-get.
const LOOKUPS_PER_THREAD: usize = 400_000;
const ROUNDS: usize = 5;
const SHARDS: usize = 32;
const SHARD_SEED: u64 = 0x756d_6270_2d73_6864;

/// One key's value: what an index entry carries besides its locations.
#[derive(Debug, Default)]
struct Value {
    size: u64,
    lease_until_ms: AtomicU64,
    last_accessed_ms: AtomicU64,
    access_count: AtomicU64,
}

impl Value {
    fn new(size: u64) -> Self {
        Self { size, ..Self::default() }
    }

    fn stamp(&self, now_ms: u64) -> u64 {
        self.lease_until_ms.fetch_max(now_ms + 5_000, Ordering::Relaxed);
        self.last_accessed_ms.fetch_max(now_ms, Ordering::Relaxed);
        self.access_count.fetch_add(1, Ordering::Relaxed);
        self.size
    }
}

/// The operations both layouts run, each over a batch.
trait IndexMap: Sync {
    fn lookup_batch(&self, keys: &[Arc<str>], now_ms: u64) -> u64;
    fn upsert_batch(&self, keys: &[Arc<str>], size: u64);
    fn remove_batch(&self, keys: &[Arc<str>]);
}

/// The store's layout: fixed-seed shard pick, one lock per shard per batch.
struct Sharded {
    shards: Vec<RwLock<HashMap<Arc<str>, Value>>>,
    hasher: FixedState,
}

impl Sharded {
    fn new() -> Self {
        Self { shards: (0..SHARDS).map(|_| RwLock::default()).collect(), hasher: FixedState::with_seed(SHARD_SEED) }
    }

    /// `InMemoryStore::group_by_shard`: indices ordered by shard, with each shard's start.
    fn group_by_shard(&self, keys: &[Arc<str>]) -> (Vec<u32>, Vec<u32>) {
        let shards = self.shards.len();
        let mut shard_of = Vec::with_capacity(keys.len());
        let mut starts = vec![0u32; shards + 1];
        for key in keys {
            let s = (self.hasher.hash_one(&**key) % shards as u64) as usize;
            shard_of.push(s as u32);
            starts[s + 1] += 1;
        }
        for s in 0..shards {
            starts[s + 1] += starts[s];
        }
        let mut cursor = starts.clone();
        let mut order = vec![0u32; keys.len()];
        for (index, &s) in shard_of.iter().enumerate() {
            let slot = &mut cursor[s as usize];
            order[*slot as usize] = index as u32;
            *slot += 1;
        }
        (order, starts)
    }
}

impl IndexMap for Sharded {
    fn lookup_batch(&self, keys: &[Arc<str>], now_ms: u64) -> u64 {
        let (order, starts) = self.group_by_shard(keys);
        let mut found = 0;
        for (s, run) in starts.windows(2).enumerate() {
            if run[0] == run[1] {
                continue;
            }
            let map = self.shards[s].read();
            for &index in &order[run[0] as usize..run[1] as usize] {
                if let Some(value) = map.get(&*keys[index as usize]) {
                    found += value.stamp(now_ms);
                }
            }
        }
        found
    }

    fn upsert_batch(&self, keys: &[Arc<str>], size: u64) {
        let (order, starts) = self.group_by_shard(keys);
        for (s, run) in starts.windows(2).enumerate() {
            if run[0] == run[1] {
                continue;
            }
            let mut map = self.shards[s].write();
            for &index in &order[run[0] as usize..run[1] as usize] {
                let key = &keys[index as usize];
                map.entry(Arc::clone(key)).and_modify(|value| value.size = size).or_insert_with(|| Value::new(size));
            }
        }
    }

    fn remove_batch(&self, keys: &[Arc<str>]) {
        let (order, starts) = self.group_by_shard(keys);
        for (s, run) in starts.windows(2).enumerate() {
            if run[0] == run[1] {
                continue;
            }
            let mut map = self.shards[s].write();
            for &index in &order[run[0] as usize..run[1] as usize] {
                map.remove(&*keys[index as usize]);
            }
        }
    }
}

/// `DashMap`: one shard lock per key.
struct Dash(DashMap<Arc<str>, Value, RandomState>);

impl IndexMap for Dash {
    fn lookup_batch(&self, keys: &[Arc<str>], now_ms: u64) -> u64 {
        keys.iter().filter_map(|key| self.0.get(&**key).map(|value| value.stamp(now_ms))).sum()
    }

    fn upsert_batch(&self, keys: &[Arc<str>], size: u64) {
        for key in keys {
            self.0.entry(Arc::clone(key)).and_modify(|value| value.size = size).or_insert_with(|| Value::new(size));
        }
    }

    fn remove_batch(&self, keys: &[Arc<str>]) {
        for key in keys {
            self.0.remove(&**key);
        }
    }
}

/// Keys shaped like a KV-cache block key: a prefix and a hex hash (as the `ingest` bench).
fn keys() -> Vec<Arc<str>> {
    (0..KEYS as u64)
        .map(|i| Arc::from(format!("llama-70b/blk/{:016x}{:08x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15), i)))
        .collect()
}

/// A reproducible pseudo-random batch sequence for one thread (xorshift).
fn batches(keys: &[Arc<str>], thread: usize) -> Vec<Vec<Arc<str>>> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64 ^ ((thread as u64 + 1) << 32);
    (0..LOOKUPS_PER_THREAD / BATCH)
        .map(|_| {
            (0..BATCH)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    Arc::clone(&keys[(state % keys.len() as u64) as usize])
                })
                .collect()
        })
        .collect()
}

/// Runs `work(thread)` on `threads` threads started together; returns the wall time.
fn timed(threads: usize, work: impl Fn(usize) + Sync) -> Duration {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let (barrier, work) = (&barrier, &work);
            scope.spawn(move || {
                barrier.wait();
                work(thread);
            });
        }
        barrier.wait();
        let started = Instant::now();
        // The scope joins every thread before returning.
        started
    })
    .elapsed()
}

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Route-get: every thread looks up its batches in a map holding every key. Keys per second.
fn route_get(map: &dyn IndexMap, keys: &[Arc<str>], threads: usize) -> f64 {
    map.upsert_batch(keys, 1 << 20);
    let work: Vec<Vec<Vec<Arc<str>>>> = (0..threads).map(|t| batches(keys, t)).collect();
    let rates = (0..ROUNDS)
        .map(|round| {
            let elapsed = timed(threads, |t| {
                for batch in &work[t] {
                    black_box(map.lookup_batch(batch, round as u64));
                }
            });
            (threads * LOOKUPS_PER_THREAD) as f64 / elapsed.as_secs_f64()
        })
        .collect();
    map.remove_batch(keys);
    median(rates)
}

/// Ingest: each thread inserts its share of the keys in bundles, updates them once, removes them.
/// Key operations per second.
fn ingest(map: &dyn IndexMap, keys: &[Arc<str>], threads: usize) -> f64 {
    let share = keys.len() / threads;
    let rates = (0..ROUNDS)
        .map(|_| {
            let elapsed = timed(threads, |t| {
                let mine = &keys[t * share..(t + 1) * share];
                for bundle in mine.chunks(BUNDLE) {
                    map.upsert_batch(bundle, 1 << 20);
                }
                for bundle in mine.chunks(BUNDLE) {
                    map.upsert_batch(bundle, 1 << 21);
                }
                for bundle in mine.chunks(BUNDLE) {
                    map.remove_batch(bundle);
                }
            });
            (3 * threads * share) as f64 / elapsed.as_secs_f64()
        })
        .collect();
    median(rates)
}

fn main() {
    let keys = keys();
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    println!(
        "index_map: {KEYS} keys, route-get batches of {BATCH}, ingest bundles of {BUNDLE}; Mkeys/s, median of {ROUNDS}"
    );
    // DashMap's default: four shards per CPU, rounded up to a power of two.
    println!("({cpus} CPUs: dashmap's default is {} shards)", (cpus * 4).next_power_of_two());
    println!("{:<10} {:>7}  {:>10}  {:>10}  {:>10}", "workload", "threads", "sharded", "dashmap", "dashmap/32");
    for threads in [1, 2, 4, 8, 16].into_iter().filter(|&t| t <= cpus.max(4)) {
        for (name, run) in
            [("route-get", route_get as fn(&dyn IndexMap, &[Arc<str>], usize) -> f64), ("ingest", ingest)]
        {
            let sharded = run(&Sharded::new(), &keys, threads);
            let dash = run(&Dash(DashMap::with_hasher(RandomState::default())), &keys, threads);
            let dash32 =
                run(&Dash(DashMap::with_hasher_and_shard_amount(RandomState::default(), SHARDS)), &keys, threads);
            println!("{name:<10} {threads:>7}  {:>10.2}  {:>10.2}  {:>10.2}", sharded / 1e6, dash / 1e6, dash32 / 1e6);
        }
    }
}
