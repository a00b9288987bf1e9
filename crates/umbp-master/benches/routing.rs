//! In-process routing decisions per second (issue 4, deliverable 5).
//!
//! Put: 16 alive candidates × 2 tiers (HBM + DRAM), batches of 1 and 128 keys of 2 MiB, for every
//! algo × affinity. Get: 3 replicas per key, requester remote or holding one. Each row is the median
//! of several rounds beside a same-run baseline that does only the bare selection work (a plain loop
//! picking the roomiest fitting slot of a flat array per key, subtracting the size; or a uniform
//! index draw for gets), so the ratio shows what the strategy's bookkeeping (excludes, affinity,
//! tier grouping, placements with shared ids) costs on top.
//!
//! Run: `cargo bench -p umbp-master --bench routing` (CLI arguments such as `--bench` are ignored).
//! Target: ≥ 1 M put decisions/s at batch 128.

use std::hint::black_box;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use umbp_core::TierType;
use umbp_master::routing::{
    Affinity, Candidate, PutDecision, PutStrategyConfig, Replica, RouteGetStrategy, RoutePutStrategy, SelectAlgo,
    TierSlot,
};

const GIB: u64 = 1 << 30;
const KEY_SIZE: u64 = 2 << 20;
const NODES: usize = 16;
const ROUNDS: usize = 9;
/// Keys routed per round, whatever the batch size (so every row does the same work).
const KEYS_PER_ROUND: usize = 256 * 1024;

fn candidates() -> Vec<Candidate> {
    (0..NODES as u64)
        .map(|i| {
            Candidate::new(
                format!("node-{i}"),
                format!("10.0.0.{i}:7000"),
                vec![
                    TierSlot::new(TierType::Hbm, 192 * GIB, (20 + 7 * i) * GIB),
                    TierSlot::new(TierType::Dram, 512 * GIB, (100 + 13 * ((i * 5) % NODES as u64)) * GIB),
                ],
            )
        })
        .collect()
}

/// Runs `round` (which routes `keys_per_call` keys) until `KEYS_PER_ROUND` keys are done, `ROUNDS`
/// times after one warm-up; returns the median decisions per second.
fn measure(keys_per_call: usize, mut round: impl FnMut()) -> f64 {
    let calls = (KEYS_PER_ROUND / keys_per_call).max(1);
    let mut rates = Vec::with_capacity(ROUNDS);
    for warm_up in [true].into_iter().chain([false; ROUNDS]) {
        let start = Instant::now();
        for _ in 0..calls {
            round();
        }
        let elapsed = start.elapsed().max(Duration::from_nanos(1));
        if !warm_up {
            rates.push((calls * keys_per_call) as f64 / elapsed.as_secs_f64());
        }
    }
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

/// The bare selection cost: copy the free bytes into a flat array, then per key take the roomiest
/// slot that fits and subtract the key's size.
fn baseline_put(candidates: &[Candidate], sizes: &[u64]) -> Vec<Option<usize>> {
    let mut free: Vec<u64> = candidates.iter().flat_map(|c| c.tiers.iter().map(|t| t.available_bytes)).collect();
    let mut out = Vec::with_capacity(sizes.len());
    for &size in sizes {
        let mut best = None;
        let mut best_free = 0;
        for (slot, &f) in free.iter().enumerate() {
            if f >= size && f > best_free {
                best = Some(slot);
                best_free = f;
            }
        }
        if let Some(slot) = best {
            free[slot] -= size;
        }
        out.push(best);
    }
    out
}

struct Row {
    op: &'static str,
    config: String,
    batch: usize,
    ours: f64,
    baseline: f64,
}

fn put_rows(rows: &mut Vec<Row>) {
    let candidates = candidates();
    let exclude: Vec<String> = Vec::new();
    for batch in [1usize, 128] {
        let sizes = vec![KEY_SIZE; batch];
        let exists = vec![false; batch];
        let baseline = measure(batch, || {
            black_box(baseline_put(black_box(&candidates), black_box(&sizes)));
        });
        for algo in [SelectAlgo::MostAvailable, SelectAlgo::Random] {
            for affinity in [Affinity::None, Affinity::Same, Affinity::Local] {
                let config = PutStrategyConfig::new(algo, affinity);
                let strategy = RoutePutStrategy::new(config);
                let mut rng = SmallRng::seed_from_u64(1);
                let mut routed = 0usize;
                let ours = measure(batch, || {
                    let out = strategy.select_batch(
                        black_box("node-5"),
                        black_box(&sizes),
                        black_box(&exists),
                        black_box(&candidates),
                        black_box(&exclude),
                        &mut rng,
                    );
                    routed += out.iter().filter(|d| matches!(d, PutDecision::Routed(_))).count();
                    black_box(out);
                });
                assert!(routed > 0, "the bench cluster must have room");
                rows.push(Row { op: "put", config: config.to_string(), batch, ours, baseline });
            }
        }
    }
}

fn get_rows(rows: &mut Vec<Row>) {
    const KEYS: usize = 128;
    let per_key: Vec<Vec<Replica>> = (0..KEYS)
        .map(|k| {
            (0..3).map(|r| Replica::new(format!("node-{}", (k + 5 * r) % NODES), TierType::Dram, KEY_SIZE)).collect()
        })
        .collect();
    let mut rng = SmallRng::seed_from_u64(2);
    let strategy = RouteGetStrategy::default();
    for batch in [1usize, KEYS] {
        let slice = &per_key[..batch];
        let baseline = measure(batch, || {
            let out: Vec<Option<usize>> = black_box(slice)
                .iter()
                .map(|locations| (!locations.is_empty()).then(|| rng.random_range(0..locations.len())))
                .collect();
            black_box(out);
        });
        for (label, requester) in
            [("local_preferring, remote requester", "node-99"), ("local_preferring, ~1/5 local", "node-0")]
        {
            let ours = measure(batch, || {
                black_box(strategy.select_batch(black_box(requester), black_box(slice), &mut rng));
            });
            rows.push(Row { op: "get", config: label.to_owned(), batch, ours, baseline });
        }
    }
}

fn main() {
    // `cargo bench` passes `--bench`; there are no options to parse.
    let mut rows = Vec::new();
    put_rows(&mut rows);
    get_rows(&mut rows);
    println!(
        "routing decisions/s, in-process, {NODES} candidates × 2 tiers, median of {ROUNDS} rounds of {KEYS_PER_ROUND} keys"
    );
    println!();
    println!("| op | strategy | batch | ours (M decisions/s) | baseline (M/s) | ours / baseline | ns per key |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for row in &rows {
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.0} |",
            row.op,
            row.config,
            row.batch,
            row.ours / 1e6,
            row.baseline / 1e6,
            row.ours / row.baseline,
            1e9 / row.ours
        );
    }
}
