//! The eviction manager and the registry reaper: the master's background work, and the on-demand
//! eviction of the put path.
//!
//! Both expose a `tick` (one round) that the background loops call every period and that
//! [`MasterHandle`](crate::MasterHandle) exposes, so tests and operators run a round without sleeping.
//! Store calls (which scan shards or take node locks) run on the blocking pool, never on an async
//! worker.
//!
//! # On-demand eviction
//! The background round runs every `check_interval` (5 s): a writer filling the pool faster than
//! that would find no room in between. So a put route that leaves keys unplaced calls
//! [`Evictor::make_room`] before it answers: for the roomiest (node, tier) that could hold the
//! largest unplaced key (the requester's own first under `local` affinity), it evicts least recently
//! used, unleased keys — at least the bytes the unplaced keys need, and enough to bring the medium
//! back to the low watermark, as a round would, so the next puts find room without another eviction
//! — by `EvictKey` to the peer, awaits the answer, and credits what the peer confirmed freed to the
//! node's recorded capacity, page-rounded per key like the budget (the next heartbeat's report
//! replaces the figure). Then the route is computed again. Bounded: at most [`MAX_ROOM_SLOTS`] media
//! per call, each under the `EvictKey` deadline, and the whole of it (the wait for the evictor
//! included) within [`ON_DEMAND_BUDGET`]. No stampede: the evictor is one lock shared with the
//! background round, and a put that waited for it routes again first, so concurrent writers that all
//! found the pool full trigger one eviction, not one each. Keys a peer confirmed evicted are skipped by the next rounds until their
//! `REMOVE` reaches the index, like keys it refused.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use tokio::sync::watch;
use tokio::task::JoinSet;
use tonic::Request;
use tonic::transport::{Channel, Endpoint};
use umbp_core::TierType;
use umbp_proto::v1;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;

use crate::config::MasterConfig;
use crate::routing::{
    Bucket, Candidate, EvictionCandidate, PPM, TierSlot, VictimPicker, charged_bytes, parts_per_million, plan_eviction,
};
use crate::service::now_ms;
use crate::store::{MetadataStore, StoreError};
use umbp_core::RateLimited;
use umbp_proto::token::TokenInjector;

/// Most keys in one `EvictKey` request; a larger victim list is split (4096 keys of up to a few
/// hundred bytes each stay far below any sane message limit).
pub(crate) const EVICT_KEYS_PER_REQUEST: usize = 4096;

/// Most candidates the store lists per (node, tier) bucket in one round: the oldest ones. Enough for
/// several passes of full requests; a bucket that needs more is served over the next rounds.
pub(crate) const CANDIDATES_PER_BUCKET: usize = 8 * EVICT_KEYS_PER_REQUEST;

/// Passes of one round: the first, plus at most this many minus one continuations after peers
/// refused (protected) victims.
pub(crate) const MAX_PASSES: usize = 3;

/// A key its peer refused to evict (0 bytes freed: leased or pinned) is left out of this many
/// following rounds, so protected keys do not eat every round's budget.
pub(crate) const PROTECTED_SKIP_ROUNDS: u64 = 3;

/// Most (node, tier) media one on-demand eviction tries before the put is answered unplaced.
pub(crate) const MAX_ROOM_SLOTS: usize = 3;

/// How long a put route may spend on an on-demand eviction, waiting for the evictor included: well
/// inside a client's route deadline (3 s by default), so a slow peer costs the put its room, never
/// its answer.
pub(crate) const ON_DEMAND_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);

/// Counters of the eviction manager.
#[derive(Debug, Default)]
pub(crate) struct EvictionStats {
    pub(crate) rounds: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) bytes_freed: AtomicU64,
    pub(crate) refused: AtomicU64,
    /// On-demand evictions run for a put that found no room.
    pub(crate) on_demand: AtomicU64,
}

/// What one eviction round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EvictionReport {
    /// Whether any (node, tier) was at or above the high watermark.
    pub pressure: bool,
    /// Keys sent in `EvictKey` requests, in the order they were sent.
    pub requested: Vec<String>,
    /// Bytes the peers reported freed (the values' lengths).
    pub bytes_freed: u64,
    /// Capacity the media got back: each freed key's pages (see
    /// [`charged_bytes`](crate::routing::charged_bytes)), the unit of the budgets and of the
    /// capacity credited to the nodes' records.
    pub capacity_freed: u64,
    /// Keys the peers refused (0 bytes freed).
    pub refused: Vec<String>,
    /// `EvictKey` requests that failed or timed out.
    pub failed_requests: u64,
    /// Whether the round ended early because the master is stopping.
    pub stopped: bool,
}

/// The eviction manager: plans budgets from the nodes' reported capacity, picks least recently used
/// unleased keys and asks their peers to evict them.
#[derive(Debug)]
pub(crate) struct Evictor {
    store: Arc<dyn MetadataStore>,
    config: Arc<MasterConfig>,
    stats: Arc<EvictionStats>,
    stop: watch::Receiver<bool>,
    /// `node → (peer address, client)`; rebuilt when the address changes, dropped on error and when
    /// the node is no longer alive.
    peers: HashMap<Arc<str>, (Arc<str>, UmbpPeerClient<Channel>)>,
    /// `node → key → last round in which it is skipped`.
    refused: HashMap<Arc<str>, HashMap<String, u64>>,
    round: u64,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, StoreError> + Send + 'static) -> Result<T, String> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => Err(format!("store task failed: {e}")),
    }
}

/// The outcome of one node's requests: `(victims, freed bytes per victim key or None if the call
/// failed)`.
type NodeResult = (Arc<str>, Vec<EvictionCandidate>, Result<HashMap<String, u64>, String>);

impl Evictor {
    pub(crate) fn new(
        store: Arc<dyn MetadataStore>,
        config: Arc<MasterConfig>,
        stats: Arc<EvictionStats>,
        stop: watch::Receiver<bool>,
    ) -> Self {
        Self { store, config, stats, stop, peers: HashMap::new(), refused: HashMap::new(), round: 0 }
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// One round. Returns early (with `stopped`) once the master is stopping, aborting calls in
    /// flight.
    pub(crate) async fn tick(&mut self) -> EvictionReport {
        let mut report = EvictionReport::default();
        self.round += 1;
        let round = self.round;
        self.refused.retain(|_, keys| {
            keys.retain(|_, until| *until >= round);
            !keys.is_empty()
        });
        let store = Arc::clone(&self.store);
        let nodes = match blocking(move || store.list_alive()).await {
            Ok(nodes) => nodes,
            Err(e) => {
                warn_store_failed(&e);
                return report;
            }
        };
        // Forget clients of nodes that left or moved (the cache would otherwise grow with churn).
        self.peers.retain(|node, (addr, _)| nodes.iter().any(|n| n.node_id == *node && n.peer_address == *addr));
        self.refused.retain(|node, _| nodes.iter().any(|n| n.node_id == *node));
        let candidates: Vec<Candidate> = nodes
            .iter()
            .map(|n| Candidate {
                node_id: n.node_id.clone(),
                peer_address: n.peer_address.clone(),
                tiers: n.caps.iter().map(TierSlot::from).collect(),
            })
            .collect();
        let eviction = &self.config.eviction;
        let buckets = plan_eviction(&candidates, eviction.high_watermark, eviction.low_watermark);
        if buckets.is_empty() {
            return report;
        }
        report.pressure = true;
        self.stats.rounds.fetch_add(1, Relaxed);
        self.evict_buckets(&buckets, &candidates, &mut report).await;
        report
    }

    /// Brings the given nodes' media that are at or above the high watermark back to the low one now,
    /// as the next background round would (a put route ran them there; see the module docs).
    /// Returns what was evicted.
    pub(crate) async fn relieve(&mut self, nodes: &[Arc<str>]) -> EvictionReport {
        let mut report = EvictionReport::default();
        let store = Arc::clone(&self.store);
        let alive = match blocking(move || store.list_alive()).await {
            Ok(alive) => alive,
            Err(e) => {
                warn_store_failed(&e);
                return report;
            }
        };
        let candidates: Vec<Candidate> = alive
            .iter()
            .filter(|n| nodes.contains(&n.node_id))
            .map(|n| Candidate {
                node_id: n.node_id.clone(),
                peer_address: n.peer_address.clone(),
                tiers: n.caps.iter().map(TierSlot::from).collect(),
            })
            .collect();
        let eviction = &self.config.eviction;
        let buckets = plan_eviction(&candidates, eviction.high_watermark, eviction.low_watermark);
        if buckets.is_empty() {
            return report;
        }
        self.stats.on_demand.fetch_add(1, Relaxed);
        report.pressure = true;
        self.evict_buckets(&buckets, &candidates, &mut report).await;
        report
    }

    /// Makes room for a put route that left keys unplaced: `needed` bytes in all, the largest key
    /// `largest` bytes (see the [module docs](self)). Media of `exclude`d nodes are never touched.
    /// Returns what was evicted; the caller routes again.
    pub(crate) async fn make_room(
        &mut self,
        requester: &str,
        prefer_requester: bool,
        needed: u64,
        largest: u64,
        exclude: &[String],
    ) -> EvictionReport {
        let mut report = EvictionReport::default();
        if needed == 0 || self.stopping() {
            return report;
        }
        let store = Arc::clone(&self.store);
        let nodes = match blocking(move || store.list_alive()).await {
            Ok(nodes) => nodes,
            Err(e) => {
                warn_store_failed(&e);
                return report;
            }
        };
        let candidates: Vec<Candidate> = nodes
            .iter()
            .filter(|n| !n.peer_address.is_empty() && !exclude.iter().any(|x| **x == *n.node_id))
            .map(|n| Candidate {
                node_id: n.node_id.clone(),
                peer_address: n.peer_address.clone(),
                tiers: n.caps.iter().map(TierSlot::from).collect(),
            })
            .collect();
        // Media that could hold the largest key at all, the requester's first (when its own puts go
        // to its own medium), then the roomiest: the fewest bytes to evict.
        let mut slots: Vec<(&Candidate, TierSlot)> = candidates
            .iter()
            .flat_map(|c| c.tiers.iter().map(move |t| (c, *t)))
            .filter(|(_, t)| t.tier != TierType::Unknown && t.total_bytes >= charged_bytes(largest, t.page_size))
            .collect();
        slots.sort_by_key(|(c, t)| {
            (!(prefer_requester && *c.node_id == *requester), std::cmp::Reverse(t.available_bytes))
        });
        if slots.is_empty() {
            return report;
        }
        self.stats.on_demand.fetch_add(1, Relaxed);
        report.pressure = true;
        let low = parts_per_million(self.config.eviction.low_watermark);
        let mut needed = needed;
        for (candidate, slot) in slots.into_iter().take(MAX_ROOM_SLOTS) {
            // In the medium's unit, like the budget (the sum rounded as one value: a lower bound of
            // the keys' pages; the low watermark's budget is the larger whenever a key found no room).
            let shortfall = charged_bytes(needed.max(largest), slot.page_size).saturating_sub(slot.available_bytes);
            if shortfall == 0 {
                break;
            }
            let used = u128::from(slot.total_bytes.saturating_sub(slot.available_bytes));
            let to_low =
                u64::try_from(used.saturating_sub(u128::from(slot.total_bytes) * low / PPM)).unwrap_or(u64::MAX);
            let bucket = Bucket {
                node_id: candidate.node_id.clone(),
                tier: slot.tier,
                budget_bytes: shortfall.max(to_low),
                page_size: slot.page_size,
            };
            let before = report.capacity_freed;
            self.evict_buckets(std::slice::from_ref(&bucket), &candidates, &mut report).await;
            if report.stopped {
                break;
            }
            let freed = report.capacity_freed - before;
            tracing::debug!(node = %bucket.node_id, tier = %bucket.tier, budget = bucket.budget_bytes, freed, "on-demand eviction");
            if freed >= shortfall {
                break;
            }
            needed = needed.saturating_sub(slot.available_bytes.saturating_add(freed));
        }
        report
    }

    /// Evicts for `buckets`: lists their least recently used unleased keys, asks the peers to evict
    /// them, continues down the lists (up to [`MAX_PASSES`]) while peers refuse protected keys.
    async fn evict_buckets(&mut self, buckets: &[Bucket], candidates: &[Candidate], report: &mut EvictionReport) {
        let wanted: Vec<(String, TierType)> = buckets.iter().map(|b| (b.node_id.to_string(), b.tier)).collect();
        let store = Arc::clone(&self.store);
        let found =
            match blocking(move || store.enumerate_eviction_candidates(&wanted, now_ms(), CANDIDATES_PER_BUCKET)).await
            {
                Ok(found) => found,
                Err(e) => {
                    warn_store_failed(&e);
                    return;
                }
            };
        let found = found
            .into_iter()
            .map(|c| EvictionCandidate {
                key: c.key.to_string(),
                node_id: c.node_id,
                tier: c.tier,
                size: c.size,
                last_accessed_ms: c.last_accessed_ms,
            })
            .collect();
        let mut picker = VictimPicker::new(found, buckets);
        for _ in 0..MAX_PASSES {
            if self.stopping() {
                report.stopped = true;
                return;
            }
            let refused = &self.refused;
            let victims = picker.take(|c| refused.get(&c.node_id).is_some_and(|keys| keys.contains_key(&c.key)));
            if victims.is_empty() {
                break;
            }
            if !self.send(victims, candidates, &mut picker, report).await {
                report.stopped = true;
                return;
            }
            if !picker.has_more() {
                break;
            }
        }
    }

    /// Sends one pass's victims, every node concurrently, and feeds the replies back into `picker`.
    /// Returns false if the master began stopping (calls in flight are aborted).
    async fn send(
        &mut self,
        victims: Vec<EvictionCandidate>,
        candidates: &[Candidate],
        picker: &mut VictimPicker,
        report: &mut EvictionReport,
    ) -> bool {
        let mut by_node: HashMap<Arc<str>, Vec<EvictionCandidate>> = HashMap::new();
        for victim in victims {
            by_node.entry(victim.node_id.clone()).or_default().push(victim);
        }
        let mut calls: JoinSet<NodeResult> = JoinSet::new();
        for (node, victims) in by_node {
            let Some(peer) = candidates.iter().find(|c| c.node_id == node).map(|c| c.peer_address.clone()) else {
                continue;
            };
            if peer.is_empty() {
                continue;
            }
            let Some(client) = self.client(&node, &peer) else { continue };
            let mut keys: Vec<String> = Vec::with_capacity(victims.len());
            for victim in &victims {
                // A key on two tiers of the node is one request entry: the peer evicts it everywhere.
                if !keys.contains(&victim.key) {
                    keys.push(victim.key.clone());
                }
            }
            report.requested.extend(keys.iter().cloned());
            self.stats.requests.fetch_add(keys.len() as u64, Relaxed);
            let config = Arc::clone(&self.config);
            calls.spawn(async move {
                let result = evict_on_peer(client, keys, &config).await;
                (node, victims, result)
            });
        }
        let mut stop = self.stop.clone();
        loop {
            let joined = tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => {
                    calls.abort_all();
                    return false;
                }
                joined = calls.join_next() => joined,
            };
            let Some(joined) = joined else { return true };
            let Ok((node, victims, result)) = joined else { continue };
            match result {
                Ok(freed) => {
                    let mut credit: HashMap<TierType, u64> = HashMap::new();
                    for victim in victims {
                        let got = freed.get(&victim.key).copied().unwrap_or(0);
                        report.bytes_freed += got;
                        self.stats.bytes_freed.fetch_add(got, Relaxed);
                        // The victim's charge not freed goes back to its bucket (all of it for a
                        // protected key: the round continues down the list); the pages freed are
                        // credited, in the unit the node reports its capacity in.
                        let returned = picker.settle(&victim, got);
                        report.capacity_freed += returned;
                        if got > 0 {
                            *credit.entry(victim.tier).or_insert(0) += returned;
                            // Gone from the peer; its REMOVE reaches the index with the node's next
                            // heartbeat. Until then no round may pick it again.
                            self.refused
                                .entry(victim.node_id.clone())
                                .or_default()
                                .insert(victim.key.clone(), self.round + PROTECTED_SKIP_ROUNDS);
                        }
                        if got == 0 {
                            // Protected (or already gone): the next rounds leave it out.
                            self.stats.refused.fetch_add(1, Relaxed);
                            if !report.refused.contains(&victim.key) {
                                report.refused.push(victim.key.clone());
                            }
                            self.refused
                                .entry(victim.node_id.clone())
                                .or_default()
                                .insert(victim.key.clone(), self.round + PROTECTED_SKIP_ROUNDS);
                        }
                    }
                    // Routing sees the room now, not at the node's next heartbeat.
                    for (tier, bytes) in credit {
                        let (store, node) = (Arc::clone(&self.store), Arc::clone(&node));
                        if let Err(e) = blocking(move || store.credit_capacity(&node, tier, bytes)).await {
                            warn_store_failed(&e);
                        }
                    }
                }
                Err(e) => {
                    if let Some(held_back) = EVICT_FAILED.check() {
                        tracing::warn!(node = %node, error = %e, held_back, "EvictKey failed");
                    }
                    report.failed_requests += 1;
                    self.peers.remove(&node);
                }
            }
        }
    }

    /// The cached client of `node`, rebuilt if its address changed.
    fn client(&mut self, node: &Arc<str>, peer: &Arc<str>) -> Option<UmbpPeerClient<Channel>> {
        if let Some((addr, client)) = self.peers.get(node)
            && addr == peer
        {
            return Some(client.clone());
        }
        let Ok(endpoint) = Endpoint::from_shared(format!("http://{peer}")) else {
            if let Some(held_back) = EVICT_FAILED.check() {
                tracing::warn!(node = %node, peer = %peer, held_back, "eviction: bad peer address");
            }
            return None;
        };
        let deadline = self.config.eviction.evict_deadline;
        let channel = endpoint.connect_timeout(deadline).timeout(deadline).connect_lazy();
        let client = UmbpPeerClient::new(channel)
            .max_decoding_message_size(self.config.max_message_bytes)
            .max_encoding_message_size(self.config.max_message_bytes);
        self.peers.insert(node.clone(), (peer.clone(), client.clone()));
        Some(client)
    }
}

/// Sends `keys` to one peer in requests of at most [`EVICT_KEYS_PER_REQUEST`], each under the
/// `EvictKey` deadline. Returns the bytes freed per key (keys the reply omits freed nothing).
async fn evict_on_peer(
    mut client: UmbpPeerClient<Channel>,
    keys: Vec<String>,
    config: &MasterConfig,
) -> Result<HashMap<String, u64>, String> {
    let deadline = config.eviction.evict_deadline;
    let mut freed = HashMap::with_capacity(keys.len());
    for chunk in keys.chunks(EVICT_KEYS_PER_REQUEST) {
        let mut request = Request::new(v1::EvictKeyRequest { keys: chunk.to_vec() });
        request.set_timeout(deadline);
        if let Ok(token) = TokenInjector::new(config.cluster_token.as_deref()) {
            token.apply(&mut request);
        }
        match tokio::time::timeout(deadline, client.evict_key(request)).await {
            Ok(Ok(reply)) => {
                for e in reply.into_inner().evicted {
                    *freed.entry(e.key).or_insert(0) += e.bytes_freed;
                }
            }
            Ok(Err(status)) => return Err(status.to_string()),
            Err(_) => return Err(format!("no reply within {deadline:?}")),
        }
    }
    let total: u64 = freed.values().sum();
    tracing::debug!(keys = keys.len(), freed = total, "eviction requests answered");
    Ok(freed)
}

/// What one reaper pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReapReport {
    /// Nodes expired by this pass (ALIVE records whose last heartbeat is older than the expiry).
    pub expired: Vec<String>,
    /// EXPIRED records removed by this pass (their retention passed).
    pub removed: Vec<String>,
}

/// The registry reaper: expires nodes that stopped heartbeating (their rows stay for operators for
/// [`MasterConfig::expired_retention`], their locations go), then removes the expired rows whose
/// retention passed.
pub(crate) async fn reap(store: &Arc<dyn MetadataStore>, config: &MasterConfig) -> ReapReport {
    let expiry = u64::try_from(config.expiry_after().as_millis()).unwrap_or(u64::MAX);
    let removal = u64::try_from(config.removal_after().as_millis()).unwrap_or(u64::MAX);
    let store = Arc::clone(store);
    let pass = move || -> Result<(ReapReport, Vec<String>), StoreError> {
        let now = now_ms();
        let expired = store.expire_stale(now.saturating_sub(expiry))?;
        // Storage nodes expiring is news for an operator; a client process that died is not.
        let mut storage = Vec::new();
        for id in &expired {
            if store.get_node(id)?.is_some_and(|r| r.lends_medium()) {
                storage.push(id.clone());
            }
        }
        let removed = store.remove_expired(now.saturating_sub(removal))?;
        Ok((ReapReport { expired, removed }, storage))
    };
    match blocking(pass).await {
        Ok((report, storage)) => {
            if !storage.is_empty() {
                tracing::warn!(nodes = %storage.join(","), after_ms = expiry, "nodes expired: no heartbeat in time");
            }
            let clients = report.expired.len() - storage.len();
            if clients > 0 {
                tracing::debug!(clients, "clients expired without unregistering");
            }
            if !report.removed.is_empty() {
                tracing::debug!(records = report.removed.len(), "expired records removed after their retention");
            }
            report
        }
        Err(e) => {
            if let Some(held_back) = REAPER_FAILED.check() {
                tracing::warn!(error = %e, held_back, "reaper: store call failed");
            }
            ReapReport::default()
        }
    }
}

static EVICT_FAILED: RateLimited = RateLimited::every(RateLimited::WINDOW);
static EVICTION_STORE_FAILED: RateLimited = RateLimited::every(RateLimited::WINDOW);

fn warn_store_failed(e: &str) {
    if let Some(held_back) = EVICTION_STORE_FAILED.check() {
        tracing::warn!(error = %e, held_back, "eviction: store call failed");
    }
}

static REAPER_FAILED: RateLimited = RateLimited::every(RateLimited::WINDOW);
