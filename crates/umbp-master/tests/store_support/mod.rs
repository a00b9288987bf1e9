//! Helpers shared by the `store_*` integration tests.

#![expect(dead_code, reason = "each test file uses a different subset of the helpers")]

use umbp_core::{KvEvent, TierType};
use umbp_master::store::{
    HeartbeatApply, HeartbeatKind, HeartbeatOutcome, InMemoryStore, MetadataStore, RegisterOutcome, Registration,
    TierCap,
};

/// The reference's stale window (ttl 10 s × 3 missed).
pub(crate) const STALE: u64 = 30_000;

/// A registration with a peer address derived from the id and one 1 GiB DRAM tier.
pub(crate) fn registration(node_id: &str) -> Registration {
    Registration {
        node_id: node_id.to_owned(),
        node_address: "127.0.0.1".to_owned(),
        peer_address: format!("{node_id}:7000"),
        data_endpoint: format!("{node_id}:7001"),
        tier_capacities: vec![TierCap::new(TierType::Dram, 1 << 30, 1 << 30)],
        tags: vec!["role=test".to_owned()],
        incarnation: 0,
    }
}

/// [`registration`] of the process of `incarnation`.
pub(crate) fn registration_of(node_id: &str, incarnation: u64) -> Registration {
    Registration { incarnation, ..registration(node_id) }
}

/// A keepalive from the process of `incarnation`.
pub(crate) fn keepalive_of(store: &dyn MetadataStore, node_id: &str, now: u64, incarnation: u64) -> HeartbeatOutcome {
    store
        .apply_heartbeat(HeartbeatApply {
            node_id: node_id.to_owned(),
            now_ms: now,
            caps: caps(),
            kind: HeartbeatKind::Keepalive,
            incarnation,
        })
        .expect("in-memory store call")
}

/// A delta from the process of `incarnation`.
pub(crate) fn delta_of(
    store: &dyn MetadataStore,
    node_id: &str,
    now: u64,
    incarnation: u64,
    seq: u64,
    events: Vec<KvEvent>,
) -> HeartbeatOutcome {
    store
        .apply_heartbeat(HeartbeatApply {
            node_id: node_id.to_owned(),
            now_ms: now,
            caps: caps(),
            kind: HeartbeatKind::Delta { seq, events },
            incarnation,
        })
        .expect("in-memory store call")
}

/// Registers `node_id` at `now`, asserting it was registered.
pub(crate) fn register(store: &dyn MetadataStore, node_id: &str, now: u64) {
    assert_eq!(
        store.register(registration(node_id), now, STALE).expect("in-memory store call"),
        RegisterOutcome::Registered
    );
}

/// A DRAM `ADD`.
pub(crate) fn add(key: &str, size: u64) -> KvEvent {
    KvEvent::add(key, TierType::Dram, size)
}

/// A DRAM `REMOVE`.
pub(crate) fn rm(key: &str) -> KvEvent {
    KvEvent::remove(key, TierType::Dram)
}

/// The default capacity report.
pub(crate) fn caps() -> Vec<TierCap> {
    vec![TierCap::new(TierType::Dram, 1 << 30, 1 << 29)]
}

/// Applies a delta.
pub(crate) fn delta(
    store: &dyn MetadataStore,
    node_id: &str,
    now: u64,
    seq: u64,
    events: Vec<KvEvent>,
) -> HeartbeatOutcome {
    store
        .apply_heartbeat(HeartbeatApply {
            node_id: node_id.to_owned(),
            now_ms: now,
            caps: caps(),
            kind: HeartbeatKind::Delta { seq, events },
            incarnation: 0,
        })
        .expect("in-memory store call")
}

/// Applies a keepalive with the given capacity.
pub(crate) fn keepalive(store: &dyn MetadataStore, node_id: &str, now: u64, caps: Vec<TierCap>) -> HeartbeatOutcome {
    store
        .apply_heartbeat(HeartbeatApply {
            node_id: node_id.to_owned(),
            now_ms: now,
            caps,
            kind: HeartbeatKind::Keepalive,
            incarnation: 0,
        })
        .expect("in-memory store call")
}

/// Applies one full-sync chunk.
pub(crate) fn chunk(
    store: &dyn MetadataStore,
    node_id: &str,
    now: u64,
    baseline_seq: u64,
    chunk_index: u32,
    is_final: bool,
    events: Vec<KvEvent>,
) -> HeartbeatOutcome {
    store
        .apply_heartbeat(HeartbeatApply {
            node_id: node_id.to_owned(),
            now_ms: now,
            caps: caps(),
            kind: HeartbeatKind::FullSyncChunk { baseline_seq, chunk_index, is_final, events },
            incarnation: 0,
        })
        .expect("in-memory store call")
}

/// Applies a single-chunk full sync.
pub(crate) fn full_sync(
    store: &dyn MetadataStore,
    node_id: &str,
    now: u64,
    baseline_seq: u64,
    events: Vec<KvEvent>,
) -> HeartbeatOutcome {
    chunk(store, node_id, now, baseline_seq, 0, true, events)
}

/// `(node, tier, size)` of a key's locations, sorted.
pub(crate) fn locs(store: &dyn MetadataStore, key: &str) -> Vec<(String, TierType, u64)> {
    let mut out: Vec<_> = store
        .lookup(key)
        .expect("in-memory store call")
        .into_iter()
        .map(|loc| (loc.node_id.to_string(), loc.tier, loc.size))
        .collect();
    out.sort();
    out
}

/// Owned keys.
pub(crate) fn keys(list: &[&str]) -> Vec<String> {
    list.iter().map(|key| (*key).to_owned()).collect()
}

/// Stores of every interesting shard count.
pub(crate) fn stores() -> Vec<InMemoryStore> {
    [1, 8, 32].into_iter().map(|n| InMemoryStore::with_shards(n).expect("in-memory store call")).collect()
}
