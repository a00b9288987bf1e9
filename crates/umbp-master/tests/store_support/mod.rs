//! Helpers shared by the `store_*` integration tests, and the two subjects of the store contract
//! suite: every contract test is a function of a [`Kind`], and `contract!` (`contract.rs`) runs it
//! once against the in-memory store and once against a [`RedisStore`] on a `redis-server` the test
//! starts.

#![expect(dead_code, reason = "each test file uses a different subset of the helpers")]

mod redis_server;

use std::collections::HashMap;
use std::sync::Arc;

pub(crate) use redis_server::RedisServer;
use umbp_core::{KvEvent, TierType};
use umbp_master::store::{
    EvictionCandidate, ExternalKvMatch, ExternalReport, HeartbeatApply, HeartbeatKind, HeartbeatOutcome, InMemoryStore,
    KeyStats, Location, MetadataStore, NodeRecord, PeerView, RedisStore, RedisTimeouts, RegisterOutcome, Registration,
    ShardedStore, StoreError, TierCap, shard_of,
};

/// Which store a contract test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// [`InMemoryStore`].
    Memory,
    /// [`RedisStore`] on its own `redis-server`.
    Redis,
    /// [`ShardedStore`] over three Redis stores (databases 0, 1, 2 of one `redis-server`).
    Sharded,
}

impl Kind {
    /// One fresh store.
    pub(crate) fn one(self) -> Subject {
        match self {
            Self::Memory => Subject::Memory(InMemoryStore::new()),
            Self::Redis => RedisServer::start().subject("umbp"),
            Self::Sharded => sharded(RedisServer::start(), "umbp"),
        }
    }

    /// Fresh stores: the in-memory store at each of `shards`; one Redis store.
    pub(crate) fn stores_of(self, shards: &[usize]) -> Vec<Subject> {
        match self {
            Self::Memory => {
                shards.iter().map(|&n| Subject::Memory(InMemoryStore::with_shards(n).expect("store call"))).collect()
            }
            Self::Redis | Self::Sharded => vec![self.one()],
        }
    }

    /// Fresh stores of every configuration worth running: the in-memory store at 1, 8 and 32 shards
    /// (its answers must not depend on the count); one Redis store.
    pub(crate) fn all(self) -> Vec<Subject> {
        match self {
            Self::Memory => self.stores_of(&[1, 8, 32]),
            Self::Redis | Self::Sharded => vec![self.one()],
        }
    }
}

/// A [`ShardedStore`] over databases 0, 1 and 2 of `server`, every shard under `prefix`.
pub(crate) fn sharded(server: Arc<RedisServer>, prefix: &str) -> Subject {
    let shards: Vec<Arc<RedisStore>> = (0..3)
        .map(|db| {
            Arc::new(
                RedisStore::connect_with(&server.url(db), prefix, RedisTimeouts::default())
                    .expect("connect to the test redis"),
            )
        })
        .collect();
    let dyn_shards = shards.iter().map(|s| Arc::clone(s) as Arc<dyn MetadataStore>).collect();
    Subject::Sharded(Box::new(ShardedStore::new(dyn_shards).expect("shards")), shards, server)
}

/// A store under test; a [`MetadataStore`] itself (every call goes to the store).
#[derive(Debug)]
pub(crate) enum Subject {
    /// The in-memory store.
    Memory(InMemoryStore),
    /// A Redis store and the server it talks to (stopped when the last subject on it goes).
    Redis(Box<RedisStore>, Arc<RedisServer>),
    /// A sharded store, its shards and their server.
    Sharded(Box<ShardedStore>, Vec<Arc<RedisStore>>, Arc<RedisServer>),
}

impl Subject {
    /// The route-get stamps of a key (each store has the diagnostic).
    pub(crate) fn key_stats(&self, key: &str) -> Option<KeyStats> {
        match self {
            Self::Memory(store) => store.key_stats(key),
            Self::Redis(store, _) => store.key_stats(key).expect("store call"),
            Self::Sharded(_, shards, _) => shards[shard_of(key, shards.len())].key_stats(key).expect("store call"),
        }
    }
}

impl Subject {
    fn store(&self) -> &dyn MetadataStore {
        match self {
            Self::Memory(store) => store,
            Self::Redis(store, _) => &**store,
            Self::Sharded(store, _, _) => &**store,
        }
    }
}

/// Every call goes to the store under test.
impl MetadataStore for Subject {
    fn register(&self, reg: Registration, now_ms: u64, stale: u64) -> Result<RegisterOutcome, StoreError> {
        self.store().register(reg, now_ms, stale)
    }
    fn unregister_incarnation(&self, node_id: &str, incarnation: u64) -> Result<bool, StoreError> {
        self.store().unregister_incarnation(node_id, incarnation)
    }
    fn apply_heartbeat(&self, hb: HeartbeatApply) -> Result<HeartbeatOutcome, StoreError> {
        self.store().apply_heartbeat(hb)
    }
    fn expire_stale(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        self.store().expire_stale(cutoff_ms)
    }
    fn remove_expired(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        self.store().remove_expired(cutoff_ms)
    }
    fn credit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<(), StoreError> {
        self.store().credit_capacity(node_id, tier, bytes)
    }
    fn debit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<Option<TierCap>, StoreError> {
        self.store().debit_capacity(node_id, tier, bytes)
    }
    fn lookup(&self, key: &str) -> Result<Vec<Location>, StoreError> {
        self.store().lookup(key)
    }
    fn batch_lookup_for_route_get(
        &self,
        keys: &[String],
        exclude: &[String],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Vec<Vec<Location>>, StoreError> {
        self.store().batch_lookup_for_route_get(keys, exclude, now_ms, lease_ms)
    }
    fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        self.store().batch_exists(keys)
    }
    fn enumerate_eviction_candidates(
        &self,
        buckets: &[(String, TierType)],
        now_ms: u64,
        max: usize,
    ) -> Result<Vec<EvictionCandidate>, StoreError> {
        self.store().enumerate_eviction_candidates(buckets, now_ms, max)
    }
    fn get_node(&self, node_id: &str) -> Result<Option<NodeRecord>, StoreError> {
        self.store().get_node(node_id)
    }
    fn is_alive(&self, node_id: &str) -> Result<bool, StoreError> {
        self.store().is_alive(node_id)
    }
    fn list_alive(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.store().list_alive()
    }
    fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.store().list_nodes()
    }
    fn alive_peer_view(&self) -> Result<HashMap<Arc<str>, PeerView>, StoreError> {
        self.store().alive_peer_view()
    }
    fn key_count(&self) -> Result<u64, StoreError> {
        self.store().key_count()
    }
    fn node_key_count(&self, node_id: &str) -> Result<u64, StoreError> {
        self.store().node_key_count(node_id)
    }
    fn report_external_kv(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<ExternalReport, StoreError> {
        self.store().report_external_kv(node_id, hashes, tier)
    }
    fn revoke_external_kv(&self, node_id: &str, hashes: &[String], tier: TierType) -> Result<(), StoreError> {
        self.store().revoke_external_kv(node_id, hashes, tier)
    }
    fn revoke_all_external_kv_at_tier(&self, node_id: &str, tier: TierType) -> Result<(), StoreError> {
        self.store().revoke_all_external_kv_at_tier(node_id, tier)
    }
    fn match_external_kv(&self, hashes: &[String], count_as_hit: bool) -> Result<Vec<ExternalKvMatch>, StoreError> {
        self.store().match_external_kv(hashes, count_as_hit)
    }
    fn external_kv_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, StoreError> {
        self.store().external_kv_hit_counts(hashes)
    }
    fn acquire_lease(&self, name: &str, holder: &str, now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError> {
        self.store().acquire_lease(name, holder, now_ms, ttl_ms)
    }
    fn release_lease(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
        self.store().release_lease(name, holder)
    }
}

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
        .expect("store call")
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
        .expect("store call")
}

/// Registers `node_id` at `now`, asserting it was registered.
pub(crate) fn register(store: &dyn MetadataStore, node_id: &str, now: u64) {
    assert_eq!(store.register(registration(node_id), now, STALE).expect("store call"), RegisterOutcome::Registered);
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
        .expect("store call")
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
        .expect("store call")
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
        .expect("store call")
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
        .expect("store call")
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

/// One route-get of `key` at t=1 with a 10 ms lease; its locations.
pub(crate) fn route_get_once(store: &dyn MetadataStore, key: &str) -> Vec<Location> {
    store.batch_lookup_for_route_get(&keys(&[key]), &[], 1, 10).expect("store call").remove(0)
}
