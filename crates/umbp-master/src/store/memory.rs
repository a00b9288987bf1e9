//! [`InMemoryStore`]: the metadata store as sharded in-process maps.
//!
//! # Layout
//! - **Meta**: one `RwLock` over `node_id → record`, with the node's full-sync progress and its
//!   *handle* (`id` + an `alive` flag shared by every location of the node).
//! - **Block shards**: `N` shards (default [`DEFAULT_SHARDS`], `1..=`[`MAX_SHARDS`]) picked by
//!   `foldhash(key, fixed seed) % N`, each a `RwLock` over `key → entry` (locations plus atomic lease,
//!   last-access and access-count stamps) and a reverse index `node → keys` so wiping a node costs
//!   O(its keys), not a scan.
//! - **Node locks**: a fixed set of striped mutexes, one taken (by node id) for the whole of every
//!   write that concerns a node — register, unregister, expire, heartbeat — so the writes of one node
//!   are linearizable even though their meta and shard halves take different locks. Without it a
//!   heartbeat that passed its seq check could insert locations after a concurrent unregister or expiry
//!   wiped the node, leaving phantoms no later write would clean.
//!
//! # Lock order
//! node stripe → meta → (meta released) → one shard at a time. Meta and a shard are **never held
//! together**, and no thread holds two shards or two stripes, so no cycle exists.
//!
//! # Readers
//! Reads take one shard's read lock at a time (a batch is grouped by shard) and never touch meta: a
//! location is returned iff its node handle's `alive` flag is set. Expiry, unregister and re-register
//! clear the flag under the meta lock *before* wiping the shards, so a reader racing the wipe skips
//! the doomed locations instead of routing to them. Route-get stamps (lease, last access, count) are
//! atomics updated under the shard's **read** lock, so concurrent route-gets do not serialize.
//!
//! # Visibility windows
//! A heartbeat's seq becomes visible (meta) a moment before its events (shards); a full-sync chunk
//! and the final sweep are atomic per shard, not across shards. A sync never wipes first: its chunks
//! add replicas tagged with the baseline and the final chunk sweeps the untagged ones, so a key the
//! node held before the sync and still holds is visible throughout. Both are invisible to a peer, which only ever sees acks sent
//! after the whole heartbeat was applied.

use std::collections::{BinaryHeap, HashMap as StdHashMap};
use std::fmt;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use foldhash::fast::FixedState;
use foldhash::{HashMap, HashSet};
use parking_lot::{Mutex, RwLock};
use umbp_core::{KvEvent, KvEventKind, TierType};

use super::external::{self, ExternalIndex};
use super::{
    EvictionCandidate, ExternalKvMatch, ExternalReport, HeartbeatApply, HeartbeatKind, HeartbeatOutcome, Location,
    MetadataStore, NodeRecord, NodeStatus, PeerView, RegisterOutcome, Registration, StoreError, TierCap,
};

/// Block shards of [`InMemoryStore::new`] (the reference's `UMBP_MASTER_INDEX_SHARDS` default).
pub const DEFAULT_SHARDS: usize = 32;

/// The largest shard count [`InMemoryStore::with_shards`] accepts.
pub const MAX_SHARDS: usize = 4096;

/// Striped node locks. Writes of nodes sharing a stripe serialize; 64 keeps that rare for hundreds of
/// nodes at 64 mutexes of memory.
const NODE_STRIPES: usize = 64;

/// Seed of the shard hash. Fixed so a key's shard does not depend on the process (a shared store
/// would need that); distinct from the per-map random seeds so a shard's map does not see keys whose
/// hashes all agree in their low bits.
const SHARD_SEED: u64 = 0x756d_6270_2d73_6864;

/// The identity of one registration of a node, shared by every location it holds.
struct NodeHandle {
    id: Arc<str>,
    /// Cleared (under the meta lock) when the registration ends: expiry, unregister, re-register.
    alive: AtomicBool,
    /// Distinct keys this registration holds, kept up to date by every write of the node (all under
    /// its node lock), so [`MetadataStore::node_key_count`] is O(1) instead of a scan of every shard.
    key_count: AtomicU64,
}

impl NodeHandle {
    fn new(id: Arc<str>) -> Arc<Self> {
        Arc::new(Self { id, alive: AtomicBool::new(true), key_count: AtomicU64::new(0) })
    }

    /// Adds a signed change to the key count (wrapping arithmetic makes a negative change a
    /// subtraction).
    fn add_keys(&self, delta: i64) {
        if delta != 0 {
            self.key_count.fetch_add(delta as u64, Ordering::Relaxed);
        }
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

/// One replica inside an entry.
struct Loc {
    node: Arc<NodeHandle>,
    tier: TierType,
    size: u64,
    /// The baseline of the last full sync that reported this replica; 0 if only deltas did. A
    /// completed full sync sweeps the node's replicas whose tag is not its baseline (baselines are
    /// always > 0: a sync is accepted only above the node's last applied seq).
    sync_tag: u64,
}

impl Loc {
    fn is_node(&self, node: &NodeHandle) -> bool {
        std::ptr::eq(Arc::as_ptr(&self.node), node) || self.node.id == node.id
    }

    fn is_node_id(&self, node_id: &str) -> bool {
        &*self.node.id == node_id
    }

    fn location(&self) -> Location {
        Location { node_id: Arc::clone(&self.node.id), tier: self.tier, size: self.size }
    }
}

/// One key of the index.
struct Entry {
    /// The map's own key, kept here so the reverse index can share it without a second lookup.
    key: Arc<str>,
    /// Never empty: an entry goes with its last location. Insertion order.
    locs: Vec<Loc>,
    lease_until_ms: AtomicU64,
    last_accessed_ms: AtomicU64,
    access_count: AtomicU64,
}

impl Entry {
    fn has_alive(&self) -> bool {
        self.locs.iter().any(|loc| loc.node.is_alive())
    }

    fn alive_locations(&self) -> Vec<Location> {
        self.locs.iter().filter(|loc| loc.node.is_alive()).map(Loc::location).collect()
    }
}

/// The maps of one block shard.
#[derive(Default)]
struct ShardMap {
    entries: HashMap<Arc<str>, Entry>,
    /// `node → keys it holds in this shard` (on any tier). Nodes with no key have no row.
    by_node: HashMap<Arc<str>, HashSet<Arc<str>>>,
}

impl ShardMap {
    /// Drops every location of the node in this shard.
    fn wipe_node(&mut self, node_id: &str) {
        let Some(keys) = self.by_node.remove(node_id) else { return };
        for key in keys {
            if let Some(entry) = self.entries.get_mut(&*key) {
                entry.locs.retain(|loc| !loc.is_node_id(node_id));
                if entry.locs.is_empty() {
                    self.entries.remove(&*key);
                }
            }
        }
    }

    /// Applies events (already filtered to this shard, in order) of one node. With `sync_tag`
    /// (a full-sync chunk) `REMOVE`s are ignored and every `ADD` tags its replica with the sync's
    /// baseline. Returns the change in the number of distinct keys the node holds in this shard.
    fn apply(
        &mut self,
        node: &Arc<NodeHandle>,
        events: &[KvEvent],
        order: &[u32],
        sync_tag: Option<u64>,
        now_ms: u64,
    ) -> i64 {
        let Self { entries, by_node } = self;
        let node_keys = by_node.entry(Arc::clone(&node.id)).or_default();
        let before = node_keys.len() as i64;
        for &index in order {
            let Some(event) = events.get(index as usize) else { continue };
            if event.tier == TierType::Unknown {
                continue;
            }
            match (event.kind, sync_tag) {
                (KvEventKind::Add, _) => add(entries, node_keys, node, event, sync_tag, now_ms),
                (KvEventKind::Remove, None) => remove(entries, node_keys, node, event),
                (KvEventKind::Remove, Some(_)) => {}
            }
        }
        let after = node_keys.len() as i64;
        if node_keys.is_empty() {
            by_node.remove(&*node.id);
        }
        after - before
    }

    /// The sweep of a completed full sync: drops every replica of the node not tagged with
    /// `keep_tag`. Returns how many distinct keys the node stopped holding in this shard.
    fn sweep_node(&mut self, node_id: &str, keep_tag: u64) -> u64 {
        let Self { entries, by_node } = self;
        let Some(keys) = by_node.get_mut(node_id) else { return 0 };
        let before = keys.len();
        keys.retain(|key| {
            let Some(entry) = entries.get_mut(&**key) else { return false };
            entry.locs.retain(|loc| !loc.is_node_id(node_id) || loc.sync_tag == keep_tag);
            let held = entry.locs.iter().any(|loc| loc.is_node_id(node_id));
            if entry.locs.is_empty() {
                entries.remove(&**key);
            }
            held
        });
        let removed = (before - keys.len()) as u64;
        if keys.is_empty() {
            by_node.remove(node_id);
        }
        removed
    }
}

fn add(
    entries: &mut HashMap<Arc<str>, Entry>,
    node_keys: &mut HashSet<Arc<str>>,
    node: &Arc<NodeHandle>,
    event: &KvEvent,
    sync_tag: Option<u64>,
    now_ms: u64,
) {
    let loc = Loc { node: Arc::clone(node), tier: event.tier, size: event.size, sync_tag: sync_tag.unwrap_or(0) };
    if let Some(entry) = entries.get_mut(event.key.as_str()) {
        let mut held_by_node = false;
        for existing in &mut entry.locs {
            if existing.is_node(node) {
                if existing.tier == event.tier {
                    // A duplicate ADD: the newer report's size wins (see MetadataStore::apply_heartbeat);
                    // a full sync also marks the replica as reported by it, so its sweep keeps it.
                    existing.size = event.size;
                    if let Some(tag) = sync_tag {
                        existing.sync_tag = tag;
                    }
                    return;
                }
                held_by_node = true;
            }
        }
        entry.locs.push(loc);
        if !held_by_node {
            node_keys.insert(Arc::clone(&entry.key));
        }
    } else {
        let key: Arc<str> = Arc::from(event.key.as_str());
        node_keys.insert(Arc::clone(&key));
        let entry = Entry {
            key: Arc::clone(&key),
            locs: vec![loc],
            lease_until_ms: AtomicU64::new(0),
            last_accessed_ms: AtomicU64::new(now_ms),
            access_count: AtomicU64::new(0),
        };
        entries.insert(key, entry);
    }
}

fn remove(
    entries: &mut HashMap<Arc<str>, Entry>,
    node_keys: &mut HashSet<Arc<str>>,
    node: &NodeHandle,
    event: &KvEvent,
) {
    let key = event.key.as_str();
    let Some(entry) = entries.get_mut(key) else { return };
    let Some(pos) = entry.locs.iter().position(|loc| loc.is_node(node) && loc.tier == event.tier) else { return };
    entry.locs.remove(pos);
    if !entry.locs.iter().any(|loc| loc.is_node(node)) {
        node_keys.remove(key);
    }
    if entry.locs.is_empty() {
        entries.remove(key);
    }
}

/// A block shard, padded to its own cache lines so neighbouring locks do not false-share.
#[repr(align(128))]
#[derive(Default)]
struct Shard(RwLock<ShardMap>);

/// An eviction candidate ordered oldest first (ties by key), for the bounded heap of
/// `enumerate_eviction_candidates`.
struct ByAge(EvictionCandidate);

impl PartialEq for ByAge {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for ByAge {}

impl PartialOrd for ByAge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByAge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0.last_accessed_ms, &*self.0.key).cmp(&(other.0.last_accessed_ms, &*other.0.key))
    }
}

/// The route-get stamps of one key ([`InMemoryStore::key_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyStats {
    /// The key is leased (skipped by eviction) while `now < lease_until_ms`; 0 if never leased.
    pub lease_until_ms: u64,
    /// The last route-get that found the key, or when its entry was created.
    pub last_accessed_ms: u64,
    /// Route-gets that found the key.
    pub access_count: u64,
}

/// A chunked full sync that has started and not finished.
#[derive(Debug, Clone, Copy)]
struct FullSyncProgress {
    baseline_seq: u64,
    next_chunk: u32,
}

/// A node's row in the meta map.
struct NodeState {
    record: NodeRecord,
    handle: Arc<NodeHandle>,
    full_sync: Option<FullSyncProgress>,
}

/// What the shard phase of a heartbeat does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ShardWork {
    None,
    /// Delta: `ADD`s and `REMOVE`s.
    Delta,
    /// A full-sync chunk: add (or refresh) the `ADD`s tagged with the sync's baseline; the final
    /// chunk then sweeps the node's replicas not tagged with it (mark and sweep, so the node's
    /// previous view stays readable while the sync runs and survives an abandoned sync).
    Sync {
        baseline: u64,
        sweep: bool,
    },
}

/// The sharded in-memory [`MetadataStore`].
///
/// ```
/// use umbp_core::{KvEvent, TierType};
/// use umbp_master::store::{HeartbeatApply, HeartbeatKind, HeartbeatOutcome, InMemoryStore, MetadataStore,
///     RegisterOutcome, Registration};
///
/// # fn main() -> Result<(), umbp_master::store::StoreError> {
/// let store = InMemoryStore::new();
/// let reg = Registration { node_id: "n1".into(), peer_address: "10.0.0.1:7000".into(), ..Default::default() };
/// assert_eq!(store.register(reg, 1_000, 30_000)?, RegisterOutcome::Registered);
/// let hb = HeartbeatApply {
///     node_id: "n1".into(),
///     now_ms: 2_000,
///     caps: Vec::new(),
///     kind: HeartbeatKind::Delta { seq: 1, events: vec![KvEvent::add("k", TierType::Dram, 4096)] },
///     incarnation: 0,
/// };
/// assert_eq!(store.apply_heartbeat(hb)?, HeartbeatOutcome::Applied { acked_seq: 1 });
/// assert_eq!(store.lookup("k")?.len(), 1);
/// # Ok(())
/// # }
/// ```
pub struct InMemoryStore {
    shards: Box<[Shard]>,
    shard_hasher: FixedState,
    meta: RwLock<HashMap<Arc<str>, NodeState>>,
    node_locks: Box<[Mutex<()>]>,
    /// `lease name → (holder, until_ms)` (see [`MetadataStore::acquire_lease`]).
    leases: Mutex<StdHashMap<String, (String, u64)>>,
    /// The external KV index; a node's records change under its node lock.
    external: ExternalIndex,
}

impl fmt::Debug for InMemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InMemoryStore")
            .field("shards", &self.shards.len())
            .field("nodes", &self.meta.read().len())
            .finish_non_exhaustive()
    }
}

impl Default for InMemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl InMemoryStore {
    /// A store with [`DEFAULT_SHARDS`] block shards.
    pub fn new() -> Self {
        Self::build(DEFAULT_SHARDS)
    }

    /// A store with `shards` block shards (`1..=`[`MAX_SHARDS`]; the reference advises 64 for hundreds
    /// of nodes).
    ///
    /// # Errors
    /// [`StoreError::InvalidShardCount`] outside that range.
    pub fn with_shards(shards: usize) -> Result<Self, StoreError> {
        if !(1..=MAX_SHARDS).contains(&shards) {
            return Err(StoreError::InvalidShardCount { shards, max: MAX_SHARDS });
        }
        Ok(Self::build(shards))
    }

    fn build(shards: usize) -> Self {
        Self {
            shards: (0..shards).map(|_| Shard::default()).collect(),
            shard_hasher: FixedState::with_seed(SHARD_SEED),
            meta: RwLock::new(HashMap::default()),
            node_locks: (0..NODE_STRIPES).map(|_| Mutex::new(())).collect(),
            leases: Mutex::new(StdHashMap::new()),
            external: ExternalIndex::default(),
        }
    }

    /// The number of block shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The route-get stamps of a key in the index (whatever its nodes' status), for diagnostics and
    /// tests; `None` if no entry exists.
    pub fn key_stats(&self, key: &str) -> Option<KeyStats> {
        let map = self.shard(self.shard_index(key)).read();
        map.entries.get(key).map(|entry| KeyStats {
            lease_until_ms: entry.lease_until_ms.load(Ordering::Relaxed),
            last_accessed_ms: entry.last_accessed_ms.load(Ordering::Relaxed),
            access_count: entry.access_count.load(Ordering::Relaxed),
        })
    }

    fn hash(&self, s: &str) -> u64 {
        self.shard_hasher.hash_one(s)
    }

    fn shard_index(&self, key: &str) -> usize {
        // Lossless: the result is below the shard count, a usize.
        (self.hash(key) % self.shards.len() as u64) as usize
    }

    fn shard(&self, index: usize) -> &RwLock<ShardMap> {
        // `index` always comes from `shard_index` or `0..len`.
        &self.shards[index % self.shards.len()].0
    }

    fn node_lock(&self, node_id: &str) -> &Mutex<()> {
        let stripe = (self.hash(node_id).rotate_left(17) % NODE_STRIPES as u64) as usize;
        &self.node_locks[stripe % NODE_STRIPES]
    }

    /// Drops every location and external record of the node (its node lock is held).
    fn wipe_node_everywhere(&self, node_id: &str) {
        self.external.wipe_node(node_id);
        for shard in self.shards.iter() {
            let mut map = shard.0.write();
            if map.by_node.contains_key(node_id) {
                map.wipe_node(node_id);
            }
        }
    }

    /// Indices `0..keys.len()` ordered by shard (stable: request order within a shard), with the start
    /// of each shard's run.
    fn group_by_shard<'k>(&self, keys: impl ExactSizeIterator<Item = &'k str>) -> (Vec<u32>, Vec<u32>) {
        let shards = self.shards.len();
        let len = keys.len();
        let mut shard_of = Vec::with_capacity(len);
        let mut starts = vec![0u32; shards + 1];
        for key in keys {
            let s = self.shard_index(key);
            shard_of.push(s as u32);
            starts[s + 1] += 1;
        }
        for s in 0..shards {
            starts[s + 1] += starts[s];
        }
        let mut cursor = starts.clone();
        let mut order = vec![0u32; len];
        for (index, &s) in shard_of.iter().enumerate() {
            let slot = &mut cursor[s as usize];
            order[*slot as usize] = index as u32;
            *slot += 1;
        }
        (order, starts)
    }

    /// Applies a heartbeat's events to the shards (the node lock is held, meta is not) and keeps the
    /// handle's key count.
    fn apply_events(&self, node: &Arc<NodeHandle>, events: &[KvEvent], work: ShardWork, now_ms: u64) {
        let (sync_tag, sweep) = match work {
            ShardWork::None => return,
            ShardWork::Delta => (None, None),
            ShardWork::Sync { baseline, sweep } => (Some(baseline), sweep.then_some(baseline)),
        };
        let mut change = 0i64;
        let mut shard_pass = |map: &mut ShardMap, order: &[u32]| {
            if !order.is_empty() {
                change += map.apply(node, events, order, sync_tag, now_ms);
            }
            if let Some(keep) = sweep {
                change -= map.sweep_node(&node.id, keep) as i64;
            }
        };
        if self.shards.len() == 1 {
            let order: Vec<u32> = (0..events.len() as u32).collect();
            shard_pass(&mut self.shard(0).write(), &order);
        } else {
            let (order, starts) = self.group_by_shard(events.iter().map(|event| event.key.as_str()));
            for (s, run) in starts.windows(2).enumerate() {
                let (start, end) = (run[0] as usize, run[1] as usize);
                if start == end && sweep.is_none() {
                    continue;
                }
                let mut map = self.shard(s).write();
                if start == end && !map.by_node.contains_key(&*node.id) {
                    continue;
                }
                shard_pass(&mut map, &order[start..end]);
            }
        }
        node.add_keys(change);
    }

    /// Runs `visit(shard_map, key_index)` for every key, one shard read lock per distinct shard.
    fn for_each_key(&self, keys: &[String], mut visit: impl FnMut(&ShardMap, usize)) {
        if self.shards.len() == 1 {
            let map = self.shard(0).read();
            (0..keys.len()).for_each(|index| visit(&map, index));
            return;
        }
        if let [key] = keys {
            let map = self.shard(self.shard_index(key)).read();
            visit(&map, 0);
            return;
        }
        let (order, starts) = self.group_by_shard(keys.iter().map(String::as_str));
        for (s, run) in starts.windows(2).enumerate() {
            let (start, end) = (run[0] as usize, run[1] as usize);
            if start == end {
                continue;
            }
            let map = self.shard(s).read();
            for &index in &order[start..end] {
                visit(&map, index as usize);
            }
        }
    }

    /// Sets an ALIVE node's recorded available bytes on `tier` to `to(cap)` and returns the result.
    /// Meta only: heartbeats of the node rewrite the same field under the meta lock, so the two never
    /// interleave.
    fn adjust_available(&self, node_id: &str, tier: TierType, to: impl FnOnce(&TierCap) -> u64) -> Option<TierCap> {
        let mut meta = self.meta.write();
        let state = meta.get_mut(node_id).filter(|state| state.record.status == NodeStatus::Alive)?;
        let cap = state.record.caps.iter_mut().find(|c| c.tier == tier)?;
        cap.available_bytes = to(cap);
        Some(*cap)
    }

    fn records(&self, alive_only: bool) -> Vec<NodeRecord> {
        let meta = self.meta.read();
        let mut out: Vec<NodeRecord> = meta
            .values()
            .filter(|state| !alive_only || state.record.status == NodeStatus::Alive)
            .map(|state| state.record.clone())
            .collect();
        drop(meta);
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        out
    }
}

impl MetadataStore for InMemoryStore {
    fn register(&self, reg: Registration, now_ms: u64, stale_after_ms: u64) -> Result<RegisterOutcome, StoreError> {
        if reg.node_id.is_empty() {
            return Err(StoreError::InvalidArgument { reason: "empty node_id" });
        }
        let _node = self.node_lock(&reg.node_id).lock();
        let node_id: Arc<str> = Arc::from(reg.node_id);
        let mut outcome = RegisterOutcome::Registered;
        {
            let mut meta = self.meta.write();
            if let Some(old) = meta.get(&*node_id) {
                let (new, current) = (reg.incarnation, old.record.incarnation);
                if new != 0 && current != 0 && new < current {
                    // A newer process holds the id (alive, or expired and not yet removed): an older
                    // one coming back must not take it over.
                    return Ok(RegisterOutcome::Superseded { current });
                }
                let fresh = old.record.status == NodeStatus::Alive
                    && now_ms.saturating_sub(old.record.last_heartbeat_ms) <= stale_after_ms;
                if fresh {
                    if new == 0 || current == 0 || new == current {
                        return Ok(RegisterOutcome::AlreadyExists);
                    }
                    // A restarted process (a higher incarnation): it replaces the live record at
                    // once instead of waiting for it to expire.
                    outcome = RegisterOutcome::Replaced { previous: current };
                }
                old.handle.alive.store(false, Ordering::Release);
            }
            let record = NodeRecord {
                node_id: Arc::clone(&node_id),
                node_address: reg.node_address,
                peer_address: Arc::from(reg.peer_address),
                data_endpoint: Arc::from(reg.data_endpoint),
                tags: reg.tags,
                status: NodeStatus::Alive,
                last_heartbeat_ms: now_ms,
                registered_at_ms: now_ms,
                last_applied_seq: 0,
                caps: reg.tier_capacities,
                incarnation: reg.incarnation,
            };
            let state = NodeState { record, handle: NodeHandle::new(Arc::clone(&node_id)), full_sync: None };
            meta.insert(Arc::clone(&node_id), state);
        }
        // The new registration starts empty: the old one's locations are dead (its handle is no longer
        // alive, so readers already skip them) and are removed here.
        self.wipe_node_everywhere(&node_id);
        Ok(outcome)
    }

    fn unregister_incarnation(&self, node_id: &str, incarnation: u64) -> Result<bool, StoreError> {
        let _node = self.node_lock(node_id).lock();
        let removed = {
            let mut meta = self.meta.write();
            match meta.get(node_id) {
                Some(state)
                    if incarnation != 0 && state.record.incarnation != 0 && state.record.incarnation != incarnation =>
                {
                    // Another process's registration: a superseded process leaving must not erase it.
                    None
                }
                Some(_) => meta.remove(node_id),
                None => None,
            }
        };
        let Some(state) = removed else { return Ok(false) };
        state.handle.alive.store(false, Ordering::Release);
        self.wipe_node_everywhere(node_id);
        Ok(true)
    }

    fn apply_heartbeat(&self, hb: HeartbeatApply) -> Result<HeartbeatOutcome, StoreError> {
        let HeartbeatApply { node_id, now_ms, caps, kind, incarnation } = hb;
        let _node = self.node_lock(&node_id).lock();
        let (outcome, work, handle) = {
            let mut meta = self.meta.write();
            let Some(state) = meta.get_mut(node_id.as_str()) else { return Ok(HeartbeatOutcome::Unknown) };
            let current = state.record.incarnation;
            if incarnation != 0 && current != 0 && incarnation != current {
                // Another process's record: a superseded sender must stop; a newer one (its record
                // lost to an older one's re-registration) registers again and replaces it.
                return Ok(if incarnation < current {
                    HeartbeatOutcome::Superseded { current }
                } else {
                    HeartbeatOutcome::Unknown
                });
            }
            if state.record.status != NodeStatus::Alive {
                return Ok(HeartbeatOutcome::Unknown);
            }
            // Every answer below refreshes liveness and capacity (keepalives, gaps and re-acks too).
            let record = &mut state.record;
            record.last_heartbeat_ms = record.last_heartbeat_ms.max(now_ms);
            record.caps = caps;
            let last = record.last_applied_seq;
            let (outcome, work) = match &kind {
                HeartbeatKind::Keepalive => (HeartbeatOutcome::Applied { acked_seq: last }, ShardWork::None),
                HeartbeatKind::Delta { seq, .. } => {
                    if *seq <= last {
                        (HeartbeatOutcome::AlreadyApplied { acked_seq: last }, ShardWork::None)
                    } else if *seq == last + 1 && state.full_sync.is_none() {
                        record.last_applied_seq = *seq;
                        (HeartbeatOutcome::Applied { acked_seq: *seq }, ShardWork::Delta)
                    } else {
                        // A gap, or a delta that would land on a half-finished full sync.
                        state.full_sync = None;
                        (HeartbeatOutcome::SeqGap { acked_seq: last }, ShardWork::None)
                    }
                }
                HeartbeatKind::FullSyncChunk { baseline_seq, chunk_index, is_final, .. } => {
                    let (baseline, chunk) = (*baseline_seq, *chunk_index);
                    let progress = state.full_sync;
                    let in_order = if chunk == 0 {
                        // A new sync, or chunk 0 of the one in progress sent again: (re)start it.
                        progress.is_none_or(|p| baseline >= p.baseline_seq)
                    } else {
                        progress.is_some_and(|p| p.baseline_seq == baseline && p.next_chunk == chunk)
                    };
                    if baseline <= last {
                        // Every sync carries a baseline the node never used before, so one at or below
                        // the stream's position is a late or duplicated copy: apply nothing. Its sender
                        // sees an ack that is not its baseline and starts a fresh sync.
                        (HeartbeatOutcome::AlreadyApplied { acked_seq: last }, ShardWork::None)
                    } else if !in_order {
                        // A stray chunk of an older sync than the one in progress leaves that one alone;
                        // a chunk out of order in the current (or an unknown newer) sync abandons it.
                        if progress.is_none_or(|p| baseline >= p.baseline_seq) {
                            state.full_sync = None;
                        }
                        (HeartbeatOutcome::SeqGap { acked_seq: last }, ShardWork::None)
                    } else {
                        if *is_final {
                            state.full_sync = None;
                            record.last_applied_seq = baseline;
                        } else {
                            state.full_sync =
                                Some(FullSyncProgress { baseline_seq: baseline, next_chunk: chunk.saturating_add(1) });
                        }
                        (
                            HeartbeatOutcome::Applied { acked_seq: record.last_applied_seq },
                            ShardWork::Sync { baseline, sweep: *is_final },
                        )
                    }
                }
            };
            (outcome, work, Arc::clone(&state.handle))
        };
        match kind {
            HeartbeatKind::Delta { events, .. } | HeartbeatKind::FullSyncChunk { events, .. }
                if work != ShardWork::None =>
            {
                self.apply_events(&handle, &events, work, now_ms);
            }
            _ => {}
        }
        Ok(outcome)
    }

    fn expire_stale(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        let is_stale =
            |state: &NodeState| state.record.status == NodeStatus::Alive && state.record.last_heartbeat_ms < cutoff_ms;
        let candidates: Vec<Arc<str>> = {
            let meta = self.meta.read();
            meta.values().filter(|state| is_stale(state)).map(|state| Arc::clone(&state.record.node_id)).collect()
        };
        let mut expired = Vec::with_capacity(candidates.len());
        for node_id in candidates {
            let _node = self.node_lock(&node_id).lock();
            {
                let mut meta = self.meta.write();
                // Re-check: the node may have heartbeated or re-registered since the scan.
                let Some(state) = meta.get_mut(&*node_id) else { continue };
                if !is_stale(state) {
                    continue;
                }
                state.record.status = NodeStatus::Expired;
                state.full_sync = None;
                state.handle.alive.store(false, Ordering::Release);
                state.handle.key_count.store(0, Ordering::Relaxed);
            }
            self.wipe_node_everywhere(&node_id);
            expired.push(node_id.to_string());
        }
        expired.sort();
        Ok(expired)
    }

    fn remove_expired(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        let is_old = |state: &NodeState| {
            state.record.status == NodeStatus::Expired && state.record.last_heartbeat_ms < cutoff_ms
        };
        let candidates: Vec<Arc<str>> = {
            let meta = self.meta.read();
            meta.values().filter(|state| is_old(state)).map(|state| Arc::clone(&state.record.node_id)).collect()
        };
        let mut removed = Vec::with_capacity(candidates.len());
        for node_id in candidates {
            let _node = self.node_lock(&node_id).lock();
            let mut meta = self.meta.write();
            // Re-check: the node may have registered again since the scan.
            if meta.get(&*node_id).is_some_and(is_old) {
                // Its locations went at expiry; only the row is left.
                meta.remove(&*node_id);
                removed.push(node_id.to_string());
            }
        }
        removed.sort();
        Ok(removed)
    }

    fn credit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<(), StoreError> {
        self.adjust_available(node_id, tier, |cap| cap.available_bytes.saturating_add(bytes).min(cap.total_bytes));
        Ok(())
    }

    fn debit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<Option<TierCap>, StoreError> {
        Ok(self.adjust_available(node_id, tier, |cap| cap.available_bytes.saturating_sub(bytes)))
    }

    fn lookup(&self, key: &str) -> Result<Vec<Location>, StoreError> {
        let map = self.shard(self.shard_index(key)).read();
        Ok(map.entries.get(key).map(Entry::alive_locations).unwrap_or_default())
    }

    fn batch_lookup_for_route_get(
        &self,
        keys: &[String],
        exclude: &[String],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Vec<Vec<Location>>, StoreError> {
        let mut out = vec![Vec::new(); keys.len()];
        let lease_until = now_ms.saturating_add(lease_ms);
        self.for_each_key(keys, |map, index| {
            let Some(entry) = keys.get(index).and_then(|key| map.entries.get(key.as_str())) else { return };
            let found: Vec<Location> = entry
                .locs
                .iter()
                .filter(|loc| loc.node.is_alive() && !exclude.iter().any(|ex| loc.is_node_id(ex)))
                .map(Loc::location)
                .collect();
            if found.is_empty() {
                return;
            }
            entry.lease_until_ms.fetch_max(lease_until, Ordering::Relaxed);
            entry.last_accessed_ms.fetch_max(now_ms, Ordering::Relaxed);
            entry.access_count.fetch_add(1, Ordering::Relaxed);
            if let Some(slot) = out.get_mut(index) {
                *slot = found;
            }
        });
        Ok(out)
    }

    fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        let mut out = vec![false; keys.len()];
        self.for_each_key(keys, |map, index| {
            let exists = keys.get(index).and_then(|key| map.entries.get(key.as_str())).is_some_and(Entry::has_alive);
            if let Some(slot) = out.get_mut(index) {
                *slot = exists;
            }
        });
        Ok(out)
    }

    fn enumerate_eviction_candidates(
        &self,
        buckets: &[(String, TierType)],
        now_ms: u64,
        max_per_bucket: usize,
    ) -> Result<Vec<EvictionCandidate>, StoreError> {
        // node → [(tier, output bucket)], buckets deduplicated in request order.
        let mut wanted: StdHashMap<&str, Vec<(TierType, usize)>> = StdHashMap::new();
        let mut bucket_count = 0;
        for (node_id, tier) in buckets {
            let tiers = wanted.entry(node_id.as_str()).or_default();
            if !tiers.iter().any(|(t, _)| t == tier) {
                tiers.push((*tier, bucket_count));
                bucket_count += 1;
            }
        }
        // With a cap, each bucket keeps only its `max_per_bucket` oldest in a bounded max-heap, so a
        // node of millions of keys costs a scan but not a copy of every key.
        let mut per_bucket: Vec<BinaryHeap<ByAge>> = (0..bucket_count).map(|_| BinaryHeap::new()).collect();
        for shard in self.shards.iter() {
            let map = shard.0.read();
            for (node_id, tiers) in &wanted {
                let Some(keys) = map.by_node.get(*node_id) else { continue };
                for key in keys {
                    let Some(entry) = map.entries.get(&**key) else { continue };
                    if entry.lease_until_ms.load(Ordering::Relaxed) > now_ms {
                        continue;
                    }
                    let last_accessed_ms = entry.last_accessed_ms.load(Ordering::Relaxed);
                    for loc in &entry.locs {
                        if !loc.is_node_id(node_id) || !loc.node.is_alive() {
                            continue;
                        }
                        let Some(&(_, bucket)) = tiers.iter().find(|(t, _)| *t == loc.tier) else { continue };
                        let Some(heap) = per_bucket.get_mut(bucket) else { continue };
                        if max_per_bucket > 0
                            && heap.len() >= max_per_bucket
                            && heap
                                .peek()
                                .is_some_and(|top| (top.0.last_accessed_ms, &*top.0.key) <= (last_accessed_ms, &**key))
                        {
                            continue;
                        }
                        heap.push(ByAge(EvictionCandidate {
                            key: Arc::clone(&entry.key),
                            node_id: Arc::clone(&loc.node.id),
                            tier: loc.tier,
                            size: loc.size,
                            last_accessed_ms,
                        }));
                        if max_per_bucket > 0 && heap.len() > max_per_bucket {
                            heap.pop();
                        }
                    }
                }
            }
        }
        Ok(per_bucket.into_iter().flat_map(|heap| heap.into_sorted_vec().into_iter().map(|c| c.0)).collect())
    }

    fn get_node(&self, node_id: &str) -> Result<Option<NodeRecord>, StoreError> {
        Ok(self.meta.read().get(node_id).map(|state| state.record.clone()))
    }

    fn is_alive(&self, node_id: &str) -> Result<bool, StoreError> {
        Ok(self.meta.read().get(node_id).is_some_and(|state| state.record.status == NodeStatus::Alive))
    }

    fn list_alive(&self) -> Result<Vec<NodeRecord>, StoreError> {
        Ok(self.records(true))
    }

    fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        Ok(self.records(false))
    }

    fn alive_peer_view(&self) -> Result<StdHashMap<Arc<str>, PeerView>, StoreError> {
        let meta = self.meta.read();
        Ok(meta
            .values()
            .filter(|state| state.record.status == NodeStatus::Alive)
            .map(|state| {
                let view = PeerView {
                    peer_address: Arc::clone(&state.record.peer_address),
                    data_endpoint: Arc::clone(&state.record.data_endpoint),
                };
                (Arc::clone(&state.record.node_id), view)
            })
            .collect())
    }

    fn key_count(&self) -> Result<u64, StoreError> {
        Ok(self.shards.iter().map(|shard| shard.0.read().entries.len() as u64).sum())
    }

    fn node_key_count(&self, node_id: &str) -> Result<u64, StoreError> {
        Ok(self.meta.read().get(node_id).map_or(0, |state| {
            if state.record.status == NodeStatus::Alive { state.handle.key_count.load(Ordering::Relaxed) } else { 0 }
        }))
    }

    fn report_external_kv(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<ExternalReport, StoreError> {
        external::check_node_tier(node_id, tier)?;
        external::check_hashes(hashes, true)?;
        // Under the node lock: an expiry or re-registration wipes the node's records under it too, so
        // a report that passed the liveness check cannot land after the wipe.
        let _node = self.node_lock(node_id).lock();
        if !self.meta.read().get(node_id).is_some_and(|state| state.record.status == NodeStatus::Alive) {
            return Ok(ExternalReport::NodeNotAlive);
        }
        self.external.report(node_id, hashes, tier);
        Ok(ExternalReport::Recorded)
    }

    fn revoke_external_kv(&self, node_id: &str, hashes: &[String], tier: TierType) -> Result<(), StoreError> {
        external::check_node_tier(node_id, tier)?;
        external::check_hashes(hashes, true)?;
        self.external.revoke(node_id, hashes, tier);
        Ok(())
    }

    fn revoke_all_external_kv_at_tier(&self, node_id: &str, tier: TierType) -> Result<(), StoreError> {
        external::check_node_tier(node_id, tier)?;
        self.external.revoke_all_at_tier(node_id, tier);
        Ok(())
    }

    fn match_external_kv(&self, hashes: &[String], count_as_hit: bool) -> Result<Vec<ExternalKvMatch>, StoreError> {
        external::check_hashes(hashes, false)?;
        Ok(self.external.matches(hashes, count_as_hit))
    }

    fn external_kv_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, StoreError> {
        external::check_hashes(hashes, false)?;
        Ok(self.external.hit_counts(hashes))
    }

    fn acquire_lease(&self, name: &str, holder: &str, now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError> {
        super::check_lease_args(name, holder, ttl_ms)?;
        let mut leases = self.leases.lock();
        let until = now_ms.saturating_add(ttl_ms);
        match leases.get_mut(name) {
            Some((current, current_until)) if current != holder && *current_until > now_ms => Ok(false),
            Some(lease) => {
                *lease = (holder.to_owned(), until);
                Ok(true)
            }
            None => {
                leases.insert(name.to_owned(), (holder.to_owned(), until));
                Ok(true)
            }
        }
    }

    fn release_lease(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
        let mut leases = self.leases.lock();
        if leases.get(name).is_some_and(|(current, _)| current == holder) {
            leases.remove(name);
            return Ok(true);
        }
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The window between clearing a node's `alive` flag and wiping its locations (expiry, unregister
    /// and re-register do both, in that order): readers must already skip the doomed locations.
    #[test]
    fn reads_skip_locations_of_a_dead_handle_before_the_wipe() {
        for shards in [1, 8] {
            let store = InMemoryStore::with_shards(shards).expect("shards");
            for node in ["dead", "live"] {
                let reg =
                    Registration { node_id: node.into(), peer_address: format!("{node}:1"), ..Default::default() };
                assert_eq!(store.register(reg, 0, 30_000).ok(), Some(RegisterOutcome::Registered));
            }
            let hb = |node: &str, key: &str| HeartbeatApply {
                node_id: node.into(),
                now_ms: 1,
                caps: Vec::new(),
                kind: HeartbeatKind::Delta { seq: 1, events: vec![KvEvent::add(key, TierType::Dram, 8)] },
                incarnation: 0,
            };
            store.apply_heartbeat(hb("dead", "k")).expect("apply");
            store.apply_heartbeat(hb("live", "shared")).expect("apply");
            let mut shared_dead = hb("dead", "shared");
            shared_dead.kind = HeartbeatKind::Delta { seq: 2, events: vec![KvEvent::add("shared", TierType::Dram, 8)] };
            store.apply_heartbeat(shared_dead).expect("apply");
            // Kill the handle only: the locations stay in the shards, as during the race.
            store.meta.read().get("dead").expect("node").handle.alive.store(false, Ordering::Release);
            let keys = vec!["k".to_owned(), "shared".to_owned()];
            assert_eq!(store.lookup("k").ok(), Some(Vec::new()));
            let routed = store.batch_lookup_for_route_get(&keys, &[], 10, 10).expect("read");
            assert!(routed[0].is_empty(), "{shards} shards");
            assert_eq!(routed[1].iter().map(|l| &*l.node_id).collect::<Vec<_>>(), vec!["live"]);
            assert_eq!(store.key_stats("k").map(|s| s.access_count), Some(0), "no lease for a dead-only key");
            assert_eq!(store.batch_exists(&keys).ok(), Some(vec![false, true]));
            let buckets = [("dead".to_owned(), TierType::Dram)];
            assert_eq!(store.enumerate_eviction_candidates(&buckets, 10, 0).ok(), Some(Vec::new()));
        }
    }
}
