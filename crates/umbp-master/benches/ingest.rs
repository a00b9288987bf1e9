//! Heartbeat event ingestion of the in-memory metadata store, in events applied per second.
//!
//! One thread applies 1024-event delta bundles (`ADD` of 100 k new keys, then `REMOVE` of them) and
//! single-chunk full syncs of 100 k keys, to a default 32-shard store. The same-run baseline does the
//! least a master could: `std::collections::HashMap<String, u64>` insert / remove of the same owned
//! keys. Bundles are built before the clock starts (the gRPC layer hands the store decoded, owned
//! events). Each figure is the median of several rounds. A last row, for scale, times route-get reads
//! (`batch_lookup_for_route_get`, 128 keys a call) against plain `HashMap::get`.
//!
//! Run: `cargo bench -p umbp-master --bench ingest` (arguments are ignored).

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use umbp_core::{KvEvent, TierType};
use umbp_master::store::{
    HeartbeatApply, HeartbeatKind, HeartbeatOutcome, InMemoryStore, MetadataStore, Registration, TierCap,
};

const KEYS: usize = 100_000;
const BUNDLE: usize = 1024;
const ROUNDS: usize = 9;
const NODE: &str = "bench-node";

/// Keys shaped like a KV-cache block key: a prefix and a hex hash.
fn keys() -> Vec<String> {
    (0..KEYS as u64).map(|i| format!("llama-70b/blk/{:016x}{:08x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15), i)).collect()
}

fn adds(keys: &[String]) -> Vec<KvEvent> {
    keys.iter().map(|k| KvEvent::add(k.clone(), TierType::Dram, 1 << 20)).collect()
}

fn removes(keys: &[String]) -> Vec<KvEvent> {
    keys.iter().map(|k| KvEvent::remove(k.clone(), TierType::Dram)).collect()
}

fn bundles(events: Vec<KvEvent>) -> Vec<Vec<KvEvent>> {
    let mut out = Vec::new();
    let mut it = events.into_iter().peekable();
    while it.peek().is_some() {
        out.push(it.by_ref().take(BUNDLE).collect());
    }
    out
}

fn caps() -> Vec<TierCap> {
    vec![TierCap::new(TierType::Dram, 1 << 40, 1 << 39)]
}

fn fresh_store() -> InMemoryStore {
    let store = InMemoryStore::new();
    let reg = Registration { node_id: NODE.into(), peer_address: "127.0.0.1:7000".into(), ..Default::default() };
    store.register(reg, 0, 30_000).expect("register");
    store
}

/// Applies delta bundles from `first_seq`; returns the time taken.
fn apply_deltas(store: &InMemoryStore, bundles: Vec<Vec<KvEvent>>, first_seq: u64) -> Duration {
    let start = Instant::now();
    for (i, events) in bundles.into_iter().enumerate() {
        let seq = first_seq + i as u64;
        let hb = HeartbeatApply {
            node_id: NODE.into(),
            now_ms: seq,
            caps: caps(),
            kind: HeartbeatKind::Delta { seq, events },
            incarnation: 0,
        };
        let outcome = store.apply_heartbeat(hb).expect("apply");
        assert_eq!(outcome, HeartbeatOutcome::Applied { acked_seq: seq });
    }
    start.elapsed()
}

fn apply_full_sync(store: &InMemoryStore, events: Vec<KvEvent>, baseline_seq: u64) -> Duration {
    let start = Instant::now();
    let kind = HeartbeatKind::FullSyncChunk { baseline_seq, chunk_index: 0, is_final: true, events };
    let outcome =
        store.apply_heartbeat(HeartbeatApply { node_id: NODE.into(), now_ms: 1, caps: caps(), kind, incarnation: 0 });
    let elapsed = start.elapsed();
    assert_eq!(outcome.expect("apply"), HeartbeatOutcome::Applied { acked_seq: baseline_seq });
    elapsed
}

fn rate(events: usize, elapsed: Duration) -> f64 {
    events as f64 / elapsed.as_secs_f64().max(1e-9)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

struct Row {
    name: &'static str,
    ours: Vec<f64>,
    base: Vec<f64>,
}

fn main() {
    let keys = keys();
    let mut rows = vec![
        Row { name: "delta ADD, 1024-event bundles, 100k new keys", ours: vec![], base: vec![] },
        Row { name: "delta REMOVE, 1024-event bundles, 100k keys", ours: vec![], base: vec![] },
        Row { name: "full sync, one chunk of 100k ADDs, empty node", ours: vec![], base: vec![] },
        Row { name: "full sync, one chunk of 100k ADDs, replacing 100k held", ours: vec![], base: vec![] },
        Row { name: "(reads) route-get lookups, batches of 128 hits, 100k keys held", ours: vec![], base: vec![] },
    ];
    for _ in 0..ROUNDS {
        // Delta ADD then REMOVE.
        let store = fresh_store();
        let add_bundles = bundles(adds(&keys));
        let n_add = add_bundles.len() as u64;
        rows[0].ours.push(rate(KEYS, apply_deltas(&store, add_bundles, 1)));
        assert_eq!(store.key_count().expect("count"), KEYS as u64);
        rows[1].ours.push(rate(KEYS, apply_deltas(&store, bundles(removes(&keys)), n_add + 1)));
        assert_eq!(store.key_count().expect("count"), 0);

        // Full sync into an empty node (a master restart), then again over the same keys.
        let store = fresh_store();
        rows[2].ours.push(rate(KEYS, apply_full_sync(&store, adds(&keys), 10)));
        rows[3].ours.push(rate(KEYS, apply_full_sync(&store, adds(&keys), 20)));
        assert_eq!(store.key_count().expect("count"), KEYS as u64);

        // Route-get reads over the synced keys, 128 per call (leases and access stamps included).
        let start = Instant::now();
        for (i, batch) in keys.chunks(128).enumerate() {
            let found = store.batch_lookup_for_route_get(batch, &[], i as u64, 2_000).expect("route-get");
            black_box(found);
        }
        rows[4].ours.push(rate(KEYS, start.elapsed()));
        drop(store);

        // Baseline: the same owned keys into a plain map.
        let add_events = adds(&keys);
        let remove_events = removes(&keys);
        let mut map: HashMap<String, u64> = HashMap::new();
        let start = Instant::now();
        for event in add_events {
            map.insert(event.key, event.size);
        }
        let add_time = start.elapsed();
        let start = Instant::now();
        for event in &remove_events {
            map.remove(&event.key);
        }
        let remove_time = start.elapsed();
        black_box(&map);
        // Full-sync baseline: clear the node's entries and insert the chunk.
        let full_events = adds(&keys);
        let mut full_map: HashMap<String, u64> = HashMap::new();
        let start = Instant::now();
        full_map.clear();
        for event in full_events {
            full_map.insert(event.key, event.size);
        }
        let full_empty = start.elapsed();
        let full_events = adds(&keys);
        let start = Instant::now();
        full_map.clear();
        for event in full_events {
            full_map.insert(event.key, event.size);
        }
        let full_replace = start.elapsed();
        let start = Instant::now();
        for batch in keys.chunks(128) {
            let found: Vec<Option<u64>> = batch.iter().map(|k| full_map.get(k).copied()).collect();
            black_box(found);
        }
        rows[4].base.push(rate(KEYS, start.elapsed()));
        black_box(&full_map);
        rows[0].base.push(rate(KEYS, add_time));
        rows[1].base.push(rate(KEYS, remove_time));
        rows[2].base.push(rate(KEYS, full_empty));
        rows[3].base.push(rate(KEYS, full_replace));
    }

    println!("Heartbeat ingestion, InMemoryStore (32 shards), 1 thread, median of {ROUNDS} rounds\n");
    println!("| operation | umbp-master events/s | HashMap<String, u64> events/s | ratio |");
    println!("|---|---:|---:|---:|");
    for row in rows {
        let (ours, base) = (median(row.ours), median(row.base));
        println!("| {} | {:.2} M | {:.2} M | {:.2} |", row.name, ours / 1e6, base / 1e6, ours / base);
    }
}
