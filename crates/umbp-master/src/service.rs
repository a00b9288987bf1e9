//! The `UMBPMaster` gRPC service: glue between the wire, the metadata store and the routing
//! strategies. Every handler is short: validate, call the store, call a strategy, encode.

// foldhash (randomly seeded): a route hashes every key of its batch, and node names per key, on
// the path a writer waits on; SipHash was a sixth of a 1,024-key route.
use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tonic::{Request, Response, Status};
use umbp_core::{KvEvent, TierCapacity, TierType};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_server::UmbpMaster;

use crate::config::MasterConfig;
use crate::evictor::{Evictor, ON_DEMAND_BUDGET};
use crate::routing::{Affinity, Candidate, PutDecision, RouteGetStrategy, RoutePutStrategy, TierSlot, charged_bytes};
use crate::store::{
    HeartbeatApply, HeartbeatKind, HeartbeatOutcome, MetadataStore, NodeStatus, RegisterOutcome, Registration,
    StoreError, TierCap,
};
use umbp_core::RateLimited;

/// Wall-clock milliseconds: store timestamps must mean the same across restarts and replicas.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

use umbp_proto::convert::{capacity_from_wire, capacity_to_wire};
pub(crate) use umbp_proto::convert::{tier_from_wire, tier_to_wire};

fn caps_from_wire(caps: &[v1::TierCapacity]) -> Vec<TierCap> {
    caps.iter()
        .map(|c| {
            let (tier, cap) = capacity_from_wire(c);
            TierCap::new(tier, cap.total_bytes, cap.available_bytes).with_page_size(c.page_size)
        })
        .filter(|c| c.tier != TierType::Unknown)
        .collect()
}

/// Whether the master grants a node with these media local placement (`local_puts` in the register
/// and heartbeat replies): under `local` affinity its put policy places a requester's keys on the
/// requester's own medium whenever that has room, so the node may skip the route call for them (a
/// key its medium refuses is routed as usual). A node that lends nothing is never granted it.
fn grants_local_puts(config: &MasterConfig, caps: &[v1::TierCapacity]) -> bool {
    config.route_put_affinity == Affinity::Local && caps.iter().any(|c| c.total_bytes > 0)
}

fn caps_to_wire(caps: &[TierCap]) -> Vec<v1::TierCapacity> {
    caps.iter()
        .map(|c| {
            let cap = TierCapacity { total_bytes: c.total_bytes, available_bytes: c.available_bytes };
            capacity_to_wire(c.tier, cap, c.page_size)
        })
        .collect()
}

/// The wire events as store events. An event of a kind this master does not know (a newer peer's)
/// or with an empty key is dropped and counted in `skipped`, never guessed at: reading an unknown
/// kind as an `ADD` would invent locations.
fn events_from_wire(events: Vec<v1::KvEvent>, skipped: &mut u64) -> Vec<KvEvent> {
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        match KvEvent::try_from(e) {
            Ok(event) => out.push(event),
            Err(_) => *skipped += 1,
        }
    }
    out
}

/// `dram=68719476736/68719476736 ssd=…`: every medium's free/total bytes, for log lines.
pub(crate) fn caps_for_log(caps: &[TierCap]) -> String {
    let mut out = String::new();
    for c in caps {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&format!("{}={}/{}", c.tier.as_str().to_ascii_lowercase(), c.available_bytes, c.total_bytes));
    }
    if out.is_empty() { "none".to_owned() } else { out }
}

static STORE_FAILED: RateLimited = RateLimited::every(RateLimited::WINDOW);
static EVENTS_SKIPPED: RateLimited = RateLimited::every(RateLimited::WINDOW);

pub(crate) fn store_status(e: StoreError) -> Status {
    // The master never crashes on a store failure: the caller retries, or another replica answers.
    if let Some(held_back) = STORE_FAILED.check() {
        tracing::warn!(error = %e, held_back, "metadata store call failed");
    }
    match e {
        StoreError::InvalidArgument { reason } => Status::invalid_argument(reason),
        other => Status::unavailable(other.to_string()),
    }
}

/// Runs a store call on the blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("store task failed: {e}")))?
        .map_err(store_status)
}

/// One `Heartbeat` RPC against the store (synchronous: the caller runs it on the blocking pool).
fn apply_heartbeat_request(
    store: &dyn MetadataStore,
    stats: &ServiceStats,
    mut r: v1::HeartbeatRequest,
) -> Result<v1::HeartbeatResponse, Status> {
    let mut external = crate::external::HeartbeatExternal::take(&mut r);
    let caps = caps_from_wire(&r.tier_capacities);
    let now = now_ms();
    let incarnation = r.incarnation;
    let apply =
        |kind| HeartbeatApply { node_id: r.node_id.clone(), now_ms: now, caps: caps.clone(), kind, incarnation };
    let unknown = || v1::HeartbeatResponse { status: v1::NodeStatus::Unknown as i32, ..Default::default() };
    let superseded = |current: u64| {
        tracing::debug!(node = %r.node_id, incarnation, current, "heartbeat of a superseded incarnation refused");
        v1::HeartbeatResponse { status: v1::NodeStatus::Unknown as i32, superseded: true, ..Default::default() }
    };
    let alive = |acked_seq, request_full_sync| v1::HeartbeatResponse {
        status: v1::NodeStatus::Alive as i32,
        acked_seq,
        request_full_sync,
        // Stamped by the caller, which knows the master's configuration.
        local_puts: false,
        superseded: false,
    };
    let mut skipped = 0;
    let reply = if r.is_full_sync {
        let events: Vec<KvEvent> =
            r.bundles.into_iter().flat_map(|b| events_from_wire(b.events, &mut skipped)).collect();
        let n = events.len() as u64;
        let first_with_external = r.external_full_sync && r.full_sync_chunk == 0;
        let kind = HeartbeatKind::FullSyncChunk {
            baseline_seq: r.delta_seq_baseline,
            chunk_index: r.full_sync_chunk,
            is_final: r.full_sync_final,
            events,
        };
        match store.apply_heartbeat(apply(kind)).map_err(store_status)? {
            HeartbeatOutcome::Unknown => unknown(),
            HeartbeatOutcome::Superseded { current } => superseded(current),
            HeartbeatOutcome::SeqGap { acked_seq } => {
                stats.seq_gaps.fetch_add(1, Ordering::Relaxed);
                alive(acked_seq, true)
            }
            HeartbeatOutcome::AlreadyApplied { acked_seq } => {
                // A late or duplicated copy of a sync: nothing applied. Its sender sees an ack that is
                // not its baseline and starts a fresh sync.
                stats.reacked.fetch_add(1, Ordering::Relaxed);
                alive(acked_seq, false)
            }
            HeartbeatOutcome::Applied { acked_seq } => {
                stats.events_applied.fetch_add(n, Ordering::Relaxed);
                if first_with_external {
                    crate::external::clear_node(store, &r.node_id)?;
                }
                alive(acked_seq, false)
            }
        }
    } else if r.bundles.is_empty() {
        // A keepalive refreshes liveness and capacity; it never asks for a full sync.
        match store.apply_heartbeat(apply(HeartbeatKind::Keepalive)).map_err(store_status)? {
            HeartbeatOutcome::Superseded { current } => superseded(current),
            outcome => match outcome.acked_seq() {
                None => unknown(),
                Some(acked) => alive(acked, false),
            },
        }
    } else {
        let mut reply = None;
        let mut acked = 0;
        for bundle in r.bundles {
            let events = events_from_wire(bundle.events, &mut skipped);
            let n = events.len() as u64;
            match store
                .apply_heartbeat(apply(HeartbeatKind::Delta { seq: bundle.seq, events }))
                .map_err(store_status)?
            {
                HeartbeatOutcome::Unknown => {
                    reply = Some(unknown());
                    break;
                }
                HeartbeatOutcome::Superseded { current } => {
                    reply = Some(superseded(current));
                    break;
                }
                HeartbeatOutcome::SeqGap { acked_seq } => {
                    // Bundles before the gap stay applied; the node heals with a full sync.
                    stats.seq_gaps.fetch_add(1, Ordering::Relaxed);
                    reply = Some(alive(acked_seq, true));
                    break;
                }
                HeartbeatOutcome::AlreadyApplied { acked_seq } => {
                    // A re-send after a lost ack: acknowledge again, never punish with a full sync.
                    stats.reacked.fetch_add(1, Ordering::Relaxed);
                    external.apply(store, stats, &r.node_id, bundle.seq)?;
                    acked = acked_seq;
                }
                HeartbeatOutcome::Applied { acked_seq } => {
                    stats.events_applied.fetch_add(n, Ordering::Relaxed);
                    external.apply(store, stats, &r.node_id, bundle.seq)?;
                    acked = acked_seq;
                }
            }
        }
        reply.unwrap_or_else(|| alive(acked, false))
    };
    if skipped > 0 {
        stats.events_skipped.fetch_add(skipped, Ordering::Relaxed);
        if let Some(held_back) = EVENTS_SKIPPED.check() {
            tracing::warn!(node = %r.node_id, skipped, held_back, "dropped events of an unknown kind or with an empty key");
        }
    }
    Ok(reply)
}

impl crate::routing::ReplicaNode for crate::store::Location {
    fn node_id(&self) -> &str {
        &self.node_id
    }
}

/// Counters the service keeps for operators and tests.
#[derive(Debug, Default)]
pub(crate) struct ServiceStats {
    pub(crate) heartbeats: AtomicU64,
    pub(crate) events_applied: AtomicU64,
    pub(crate) events_skipped: AtomicU64,
    pub(crate) seq_gaps: AtomicU64,
    pub(crate) reacked: AtomicU64,
    pub(crate) route_put_keys: AtomicU64,
    pub(crate) route_get_keys: AtomicU64,
    pub(crate) external: crate::external::ExternalStats,
}

/// `node_id → data endpoint` of the put candidates, beside them (a route put's reply names it).
type DataEndpoints = HashMap<Arc<str>, Arc<str>>;

/// The `UMBPMaster` implementation.
#[derive(Debug, Clone)]
pub(crate) struct MasterService {
    pub(crate) config: Arc<MasterConfig>,
    pub(crate) store: Arc<dyn MetadataStore>,
    pub(crate) put: Arc<RoutePutStrategy>,
    pub(crate) get: Arc<RouteGetStrategy>,
    pub(crate) stats: Arc<ServiceStats>,
    /// The eviction manager, shared with the background round: a put that finds no room evicts
    /// through it on demand (see the evictor's module docs).
    pub(crate) evictor: Arc<tokio::sync::Mutex<Evictor>>,
    /// A relief eviction (a put route ran a medium past the high watermark) is queued or running:
    /// later routes do not queue another.
    pub(crate) relief_pending: Arc<std::sync::atomic::AtomicBool>,
    /// The duty lease: relief evictions, like eviction rounds, run only on its holder (another
    /// master's routes leave the pressure to the holder's next round).
    pub(crate) lease: Arc<crate::lease::DutyLease>,
}

impl MasterService {
    /// Every ALIVE node with a reachable peer service and at least one medium, as put candidates,
    /// with each candidate's data endpoint by node id (kept beside the routing type, which needs none).
    fn put_candidates(&self) -> Result<(Vec<Candidate>, DataEndpoints), Status> {
        let nodes = self.store.list_alive().map_err(store_status)?;
        let mut endpoints = HashMap::with_capacity(nodes.len());
        let candidates = nodes
            .into_iter()
            .filter(|n| n.status == NodeStatus::Alive && !n.peer_address.is_empty() && !n.caps.is_empty())
            .map(|n| {
                endpoints.insert(Arc::clone(&n.node_id), n.data_endpoint);
                Candidate {
                    node_id: n.node_id,
                    peer_address: n.peer_address,
                    tiers: n.caps.iter().map(TierSlot::from).collect(),
                }
            })
            .collect();
        Ok((candidates, endpoints))
    }

    fn route_put_batch(
        &self,
        requester: &str,
        keys: &[String],
        sizes: &[u64],
        exclude: &[String],
    ) -> Result<RoutedPuts, Status> {
        if keys.len() != sizes.len() {
            return Err(Status::invalid_argument(format!(
                "{} keys but {} block sizes: the arrays must be parallel",
                keys.len(),
                sizes.len()
            )));
        }
        if keys.iter().any(String::is_empty) {
            return Err(Status::invalid_argument("a key must not be empty"));
        }
        let mut exists = self.store.batch_exists(keys).map_err(store_status)?;
        // A key repeated within the batch is routed once, at its first occurrence; each repeat is
        // answered after it (see `repeat_of`) and uses no capacity.
        let mut first: HashMap<&str, usize> = HashMap::with_capacity(keys.len());
        let mut repeat_of: Vec<Option<usize>> = vec![None; keys.len()];
        for (i, key) in keys.iter().enumerate() {
            match first.get(key.as_str()) {
                Some(&j) => {
                    repeat_of[i] = Some(j);
                    exists[i] = true;
                }
                None => {
                    first.insert(key.as_str(), i);
                }
            }
        }
        let (candidates, endpoints) = self.put_candidates()?;
        let mut decisions = self.put.select_batch(requester, sizes, &exists, &candidates, exclude, &mut rand::rng());
        // A repeat of a key routed (or already stored) is AlreadyExists: the writer writes the key
        // once. A repeat of a key that could not be placed is Unavailable like its first occurrence.
        for (i, j) in repeat_of.iter().enumerate() {
            if let Some(j) = *j {
                decisions[i] = match decisions[j] {
                    PutDecision::Unavailable => PutDecision::Unavailable,
                    PutDecision::Routed(_) | PutDecision::AlreadyExists => PutDecision::AlreadyExists,
                };
            }
        }
        // What each routed key takes of its medium: its page-rounded size, the unit the node reports.
        let pages: HashMap<(&str, TierType), u64> =
            candidates.iter().flat_map(|c| c.tiers.iter().map(move |t| ((&*c.node_id, t.tier), t.page_size))).collect();
        let charges = decisions
            .iter()
            .zip(sizes)
            .map(|(d, &size)| match d {
                PutDecision::Routed(p) => charged_bytes(size, pages.get(&(&*p.node_id, p.tier)).copied().unwrap_or(0)),
                PutDecision::AlreadyExists | PutDecision::Unavailable => 0,
            })
            .collect();
        Ok(RoutedPuts { decisions, endpoints, charges })
    }

    /// [`route_put_batch`](Self::route_put_batch), making room when keys found none: evicts least
    /// recently used, unleased keys on demand (one eviction at a time, shared with the background
    /// round; a call that waited for another's eviction routes again first) and routes again.
    async fn route_put_making_room(
        &self,
        requester: &str,
        keys: &[String],
        sizes: &[u64],
        exclude: &[String],
    ) -> Result<RoutedPuts, Status> {
        self.stats.route_put_keys.fetch_add(keys.len() as u64, Ordering::Relaxed);
        let routed = self.route_put_batch(requester, keys, sizes, exclude)?;
        if unplaced(&routed.decisions, keys, sizes).0 == 0 {
            self.reserve(&routed)?;
            return Ok(routed);
        }
        self.make_room_and_route(requester, keys, sizes, exclude).await
    }

    /// The slow path of [`route_put_making_room`](Self::route_put_making_room): some keys found no
    /// room.
    async fn make_room_and_route(
        &self,
        requester: &str,
        keys: &[String],
        sizes: &[u64],
        exclude: &[String],
    ) -> Result<RoutedPuts, Status> {
        // Bounded, well inside a client's route deadline: waiting for the evictor (a background round
        // against a slow peer may hold it) and the eviction itself share ON_DEMAND_BUDGET.
        let deadline = tokio::time::Instant::now() + ON_DEMAND_BUDGET;
        let Ok(mut evictor) = tokio::time::timeout_at(deadline, self.evictor.lock()).await else {
            let routed = self.route_put_batch(requester, keys, sizes, exclude)?;
            self.reserve(&routed)?;
            return Ok(routed);
        };
        // Another put may have made room while this one waited for the evictor.
        let routed = self.route_put_batch(requester, keys, sizes, exclude)?;
        let (needed, largest) = unplaced(&routed.decisions, keys, sizes);
        let routed = if needed == 0 {
            routed
        } else {
            let prefer_requester = self.config.route_put_affinity == Affinity::Local;
            let evicting = evictor.make_room(requester, prefer_requester, needed, largest, exclude);
            match tokio::time::timeout_at(deadline, evicting).await {
                Ok(report) if report.bytes_freed == 0 => routed,
                // Freed something (or ran out of time, having perhaps freed some): route again.
                _ => self.route_put_batch(requester, keys, sizes, exclude)?,
            }
        };
        // Reserved before the next waiter routes, so it does not place the same room.
        self.reserve(&routed)?;
        Ok(routed)
    }

    /// Debits the routed keys' pages from the nodes' recorded capacity (projected capacity across
    /// calls): without it, concurrent writers routed between two heartbeats of a node would all be
    /// sent to the same free bytes, and all but the first would be refused by the peer. The node's
    /// next heartbeat replaces the figure with its real one.
    fn reserve(&self, routed: &RoutedPuts) -> Result<(), Status> {
        let mut debits: HashMap<(&Arc<str>, TierType), u64> = HashMap::new();
        for (decision, &charge) in routed.decisions.iter().zip(&routed.charges) {
            if let PutDecision::Routed(p) = decision {
                *debits.entry((&p.node_id, p.tier)).or_insert(0) += charge;
            }
        }
        if debits.is_empty() {
            return Ok(());
        }
        let high = self.config.eviction.high_watermark;
        // In place, like the route's own store reads: a short meta write per routed node, cheaper
        // than a hand-off to the blocking pool on the hot path.
        let mut pressed: Vec<Arc<str>> = Vec::new();
        for ((node, tier), bytes) in debits {
            let left = self.store.debit_capacity(node, tier, bytes).map_err(store_status)?;
            let over = left.is_some_and(|c| at_or_above(c.total_bytes, c.available_bytes, high));
            if over && !pressed.iter().any(|p| p == node) {
                pressed.push(Arc::clone(node));
            }
        }
        if !pressed.is_empty() {
            self.relieve_soon(pressed);
        }
        Ok(())
    }

    /// Runs a relief eviction for `nodes` on the evictor, after this route is answered (one queued at
    /// a time: it plans from the store's figures when it runs, so routes in the meantime are covered).
    /// Keeping every medium below the high watermark between background rounds leaves room for the
    /// writes in flight, which a pool filled to the last byte would refuse.
    fn relieve_soon(&self, nodes: Vec<Arc<str>>) {
        if !self.lease.held() || self.relief_pending.swap(true, Ordering::AcqRel) {
            return;
        }
        let (evictor, pending) = (Arc::clone(&self.evictor), Arc::clone(&self.relief_pending));
        tokio::spawn(async move {
            let mut evictor = evictor.lock().await;
            pending.store(false, Ordering::Release);
            evictor.relieve(&nodes).await;
        });
    }

    /// The columnar route-get answer; never names a node that is not ALIVE.
    fn route_get_batch(
        &self,
        requester: &str,
        keys: &[String],
        exclude: &[String],
    ) -> Result<v1::BatchRouteGetResponse, Status> {
        if keys.iter().any(String::is_empty) {
            return Err(Status::invalid_argument("a key must not be empty"));
        }
        let lease_ms = u64::try_from(self.config.eviction.lease_duration.as_millis()).unwrap_or(u64::MAX);
        // The view is taken first: the store returns ALIVE nodes only, and a node that expires after
        // the view is filtered (and grants no lease) inside the store. Taking it after the lookup would
        // let a location the store found and leased be dropped here, leaving a lease on a key the
        // reply calls missing. What remains is a node that registers *and* reports keys between the
        // two reads: filtered below, its key leased for one lease period at worst.
        let view = self.store.alive_peer_view().map_err(store_status)?;
        let per_key = self.store.batch_lookup_for_route_get(keys, exclude, now_ms(), lease_ms).map_err(store_status)?;
        let mut rng = rand::rng();
        let mut reply = v1::BatchRouteGetResponse {
            nodes: Vec::new(),
            node_ref: Vec::with_capacity(keys.len()),
            tier: Vec::with_capacity(keys.len()),
            size: Vec::with_capacity(keys.len()),
        };
        let mut nodes = NodeRefs::default();
        for locations in &per_key {
            let alive: Vec<_> = locations.iter().filter(|l| view.contains_key(&l.node_id)).collect();
            let picked = self.get.select(requester, &alive, &mut rng).and_then(|i| alive.get(i).copied());
            match picked {
                Some(loc) => {
                    let index = nodes.refer(&loc.node_id, || {
                        let (peer_address, data_endpoint) = view
                            .get(&loc.node_id)
                            .map(|p| (p.peer_address.to_string(), p.data_endpoint.to_string()))
                            .unwrap_or_default();
                        v1::NodeInfo { node_id: loc.node_id.to_string(), peer_address, data_endpoint }
                    });
                    reply.node_ref.push(index);
                    reply.tier.push(tier_to_wire(loc.tier));
                    reply.size.push(loc.size);
                }
                None => {
                    reply.node_ref.push(0);
                    reply.tier.push(0);
                    reply.size.push(0);
                }
            }
        }
        reply.nodes = nodes.nodes;
        self.stats.route_get_keys.fetch_add(keys.len() as u64, Ordering::Relaxed);
        Ok(reply)
    }
}

#[tonic::async_trait]
impl UmbpMaster for MasterService {
    async fn register_client(
        &self,
        request: Request<v1::RegisterClientRequest>,
    ) -> Result<Response<v1::RegisterClientResponse>, Status> {
        let r = request.into_inner();
        if r.node_id.is_empty() {
            return Err(Status::invalid_argument("node_id must not be empty"));
        }
        let node_id = r.node_id.clone();
        let local_puts = grants_local_puts(&self.config, &r.tier_capacities);
        let incarnation = r.incarnation;
        let reg = Registration {
            node_id: r.node_id,
            node_address: r.node_address,
            peer_address: r.peer_address,
            data_endpoint: r.data_endpoint,
            tier_capacities: caps_from_wire(&r.tier_capacities),
            tags: r.tags,
            incarnation,
        };
        let lends_medium = !reg.peer_address.is_empty() || reg.tier_capacities.iter().any(|c| c.total_bytes > 0);
        let log = (reg.peer_address.clone(), reg.data_endpoint.clone(), caps_for_log(&reg.tier_capacities));
        let stale_after = u64::try_from(self.config.expiry_after().as_millis()).unwrap_or(u64::MAX);
        let store = Arc::clone(&self.store);
        // Registering wipes the node's old locations (a scan of its keys): off the async workers.
        let outcome = blocking(move || store.register(reg, now_ms(), stale_after)).await?;
        match outcome {
            RegisterOutcome::Registered | RegisterOutcome::Replaced { .. } => {
                let replaced = match outcome {
                    RegisterOutcome::Replaced { previous } => previous,
                    _ => 0,
                };
                let (peer, data, tiers) = log;
                if lends_medium {
                    // One line per storage node join, settings as key=value.
                    tracing::info!(node = %node_id, incarnation, replaced, peer = %peer, data = %data, tiers = %tiers, "node joined");
                } else {
                    // A client (an engine process, every CLI command): not news for an operator.
                    tracing::debug!(node = %node_id, incarnation, replaced, "client joined");
                }
                let interval = u64::try_from(self.config.heartbeat_interval().as_millis()).unwrap_or(u64::MAX);
                Ok(Response::new(v1::RegisterClientResponse { heartbeat_interval_ms: interval, local_puts }))
            }
            RegisterOutcome::AlreadyExists => Err(Status::already_exists(format!(
                "node {node_id} is already registered and alive, by a process that sent no incarnation or the same \
                 one: another process runs under this id (give this one another node id), or wait {:?} for the old \
                 record to expire",
                self.config.expiry_after()
            ))),
            RegisterOutcome::Superseded { current } => Err(Status::failed_precondition(format!(
                "node {node_id}: superseded: a newer process (incarnation {current}) holds this id; this process \
                 (incarnation {incarnation}) must stop"
            ))),
        }
    }

    async fn unregister_client(
        &self,
        request: Request<v1::UnregisterClientRequest>,
    ) -> Result<Response<v1::UnregisterClientResponse>, Status> {
        let r = request.into_inner();
        let (node_id, incarnation) = (r.node_id, r.incarnation);
        let (store, id) = (Arc::clone(&self.store), node_id.clone());
        let record = blocking({
            let (store, id) = (Arc::clone(&store), id.clone());
            move || store.get_node(&id)
        })
        .await?;
        if blocking(move || store.unregister_incarnation(&id, incarnation)).await? {
            if record.as_ref().is_some_and(crate::store::NodeRecord::lends_medium) {
                tracing::info!(node = %node_id, incarnation, "node left");
            } else {
                tracing::debug!(node = %node_id, incarnation, "client left");
            }
        }
        Ok(Response::new(v1::UnregisterClientResponse {}))
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        self.stats.heartbeats.fetch_add(1, Ordering::Relaxed);
        // Every heartbeat takes the node's lock stripe, which a full-sync chunk of a node sharing the
        // stripe may hold for tens of ms, and a chunk itself applies up to ~100k events: all of it runs
        // on the blocking pool, never on an async worker.
        let (store, stats) = (Arc::clone(&self.store), Arc::clone(&self.stats));
        let request = request.into_inner();
        let local_puts = grants_local_puts(&self.config, &request.tier_capacities);
        let mut reply = tokio::task::spawn_blocking(move || apply_heartbeat_request(&*store, &stats, request))
            .await
            .map_err(|e| Status::internal(format!("heartbeat apply task failed: {e}")))??;
        reply.local_puts = local_puts && reply.status == v1::NodeStatus::Alive as i32;
        Ok(Response::new(reply))
    }

    async fn route_put(&self, request: Request<v1::RoutePutRequest>) -> Result<Response<v1::RoutePutResponse>, Status> {
        let r = request.into_inner();
        let entry = self
            .route_put_making_room(&r.node_id, &[r.key], &[r.block_size], &r.exclude_nodes)
            .await?
            .entries()
            .pop()
            .unwrap_or_default();
        Ok(Response::new(v1::RoutePutResponse {
            outcome: entry.outcome,
            node_id: entry.node_id,
            tier: entry.tier,
            peer_address: entry.peer_address,
            data_endpoint: entry.data_endpoint,
        }))
    }

    async fn route_get(&self, request: Request<v1::RouteGetRequest>) -> Result<Response<v1::RouteGetResponse>, Status> {
        let r = request.into_inner();
        let reply = self.route_get_batch(&r.node_id, &[r.key], &r.exclude_nodes)?;
        let hit = reply.node_ref.first().copied().unwrap_or(0);
        let node = (hit as usize).checked_sub(1).and_then(|i| reply.nodes.get(i));
        Ok(Response::new(match node {
            Some(node) => v1::RouteGetResponse {
                found: true,
                node_id: node.node_id.clone(),
                tier: reply.tier.first().copied().unwrap_or(0),
                size: reply.size.first().copied().unwrap_or(0),
                peer_address: node.peer_address.clone(),
                data_endpoint: node.data_endpoint.clone(),
            },
            None => v1::RouteGetResponse::default(),
        }))
    }

    async fn batch_route_put(
        &self,
        request: Request<v1::BatchRoutePutRequest>,
    ) -> Result<Response<v1::BatchRoutePutResponse>, Status> {
        let r = request.into_inner();
        let routed = self.route_put_making_room(&r.node_id, &r.keys, &r.block_sizes, &r.exclude_nodes).await?;
        Ok(Response::new(if r.columnar { routed.columns() } else { routed.entries_reply() }))
    }

    async fn batch_route_get(
        &self,
        request: Request<v1::BatchRouteGetRequest>,
    ) -> Result<Response<v1::BatchRouteGetResponse>, Status> {
        let r = request.into_inner();
        Ok(Response::new(self.route_get_batch(&r.node_id, &r.keys, &r.exclude_nodes)?))
    }

    async fn batch_lookup(
        &self,
        request: Request<v1::BatchLookupRequest>,
    ) -> Result<Response<v1::BatchLookupResponse>, Status> {
        let keys = request.into_inner().keys;
        let found = self.store.batch_exists(&keys).map_err(store_status)?;
        Ok(Response::new(v1::BatchLookupResponse { found }))
    }

    async fn get_cluster_status(
        &self,
        _request: Request<v1::GetClusterStatusRequest>,
    ) -> Result<Response<v1::GetClusterStatusResponse>, Status> {
        let store = Arc::clone(&self.store);
        let retention_ms = u64::try_from(self.config.expired_retention.as_millis()).unwrap_or(u64::MAX);
        // Per-node key counts are O(1), but the total sums every shard: off the async workers.
        blocking(move || cluster_status(&*store, retention_ms)).await.map(Response::new)
    }

    async fn report_external_kv_blocks(
        &self,
        request: Request<v1::ReportExternalKvBlocksRequest>,
    ) -> Result<Response<v1::ReportExternalKvBlocksResponse>, Status> {
        self.report_external(request.into_inner()).await.map(Response::new)
    }

    async fn revoke_external_kv_blocks(
        &self,
        request: Request<v1::RevokeExternalKvBlocksRequest>,
    ) -> Result<Response<v1::RevokeExternalKvBlocksResponse>, Status> {
        self.revoke_external(request.into_inner()).await.map(Response::new)
    }

    async fn revoke_all_external_kv_blocks_at_tier(
        &self,
        request: Request<v1::RevokeAllExternalKvBlocksAtTierRequest>,
    ) -> Result<Response<v1::RevokeAllExternalKvBlocksAtTierResponse>, Status> {
        self.revoke_all_external(request.into_inner()).await.map(Response::new)
    }

    async fn match_external_kv(
        &self,
        request: Request<v1::MatchExternalKvRequest>,
    ) -> Result<Response<v1::MatchExternalKvResponse>, Status> {
        self.match_external(request.into_inner()).await.map(Response::new)
    }

    async fn get_external_kv_hit_counts(
        &self,
        request: Request<v1::GetExternalKvHitCountsRequest>,
    ) -> Result<Response<v1::GetExternalKvHitCountsResponse>, Status> {
        self.external_hit_counts(request.into_inner()).await.map(Response::new)
    }
}

/// Whether a medium's used fraction is at or above `high` (the eviction plan's test, in floats: only
/// a trigger).
fn at_or_above(total: u64, available: u64, high: f64) -> bool {
    total > 0 && (total.saturating_sub(available) as f64) >= high * total as f64
}

/// A put route's answer: each key's decision, the routed nodes' data endpoints, and what each
/// routed key takes of its medium (its page-rounded size; 0 for a key not routed) for
/// [`MasterService::reserve`]. Put on the wire once, in the form the caller asked for.
struct RoutedPuts {
    decisions: Vec<PutDecision>,
    endpoints: DataEndpoints,
    charges: Vec<u64>,
}

impl RoutedPuts {
    /// One entry per key, every routed entry naming its node in full (a caller without
    /// `columnar`, and the single-key `RoutePut`).
    fn entries(self) -> Vec<v1::RoutePutEntry> {
        let endpoints = self.endpoints;
        self.decisions
            .into_iter()
            .map(|d| match d {
                PutDecision::Routed(p) => v1::RoutePutEntry {
                    outcome: v1::RoutePutOutcome::RoutePutRouted as i32,
                    node_id: p.node_id.to_string(),
                    tier: tier_to_wire(p.tier),
                    peer_address: p.peer_address.to_string(),
                    data_endpoint: endpoints.get(&p.node_id).map(|e| e.to_string()).unwrap_or_default(),
                },
                PutDecision::AlreadyExists => v1::RoutePutEntry {
                    outcome: v1::RoutePutOutcome::RoutePutAlreadyExists as i32,
                    ..Default::default()
                },
                PutDecision::Unavailable => v1::RoutePutEntry::default(),
            })
            .collect()
    }

    fn entries_reply(self) -> v1::BatchRoutePutResponse {
        v1::BatchRoutePutResponse { entries: self.entries(), ..Default::default() }
    }

    /// The columnar reply: each routed node named once. Encoding and decoding 1,024 entries that
    /// repeat three strings each cost more than the master's placement itself.
    fn columns(self) -> v1::BatchRoutePutResponse {
        let n = self.decisions.len();
        let mut reply = v1::BatchRoutePutResponse {
            node_ref: Vec::with_capacity(n),
            tier: Vec::with_capacity(n),
            outcome: Vec::with_capacity(n),
            ..Default::default()
        };
        let mut nodes = NodeRefs::default();
        for d in self.decisions {
            let (outcome, node_ref, tier) = match d {
                PutDecision::Routed(p) => {
                    let node_ref = nodes.refer(&p.node_id, || v1::NodeInfo {
                        node_id: p.node_id.to_string(),
                        peer_address: p.peer_address.to_string(),
                        data_endpoint: self.endpoints.get(&p.node_id).map(|e| e.to_string()).unwrap_or_default(),
                    });
                    (v1::RoutePutOutcome::RoutePutRouted, node_ref, tier_to_wire(p.tier))
                }
                PutDecision::AlreadyExists => (v1::RoutePutOutcome::RoutePutAlreadyExists, 0, 0),
                PutDecision::Unavailable => (v1::RoutePutOutcome::RoutePutUnavailable, 0, 0),
            };
            reply.outcome.push(outcome as i32);
            reply.node_ref.push(node_ref);
            reply.tier.push(tier);
        }
        reply.nodes = nodes.nodes;
        reply
    }
}

/// A columnar reply's node list: each node once, referred to by its 1-based place.
#[derive(Default)]
struct NodeRefs {
    refs: HashMap<Arc<str>, u32>,
    nodes: Vec<v1::NodeInfo>,
}

impl NodeRefs {
    /// `node`'s reference, listing it (`info`) the first time.
    fn refer(&mut self, node: &Arc<str>, info: impl FnOnce() -> v1::NodeInfo) -> u32 {
        if let Some(&r) = self.refs.get(node) {
            return r;
        }
        self.nodes.push(info());
        let r = self.nodes.len() as u32;
        self.refs.insert(Arc::clone(node), r);
        r
    }
}

/// Bytes the unplaced keys of a put route need in all, and the largest of them (a repeated key counts
/// once: its repeats are answered like it).
fn unplaced(decisions: &[PutDecision], keys: &[String], sizes: &[u64]) -> (u64, u64) {
    let mut needed = 0u64;
    let mut largest = 0u64;
    let mut seen: HashSet<&str> = HashSet::new();
    for ((decision, &size), key) in decisions.iter().zip(sizes).zip(keys) {
        if *decision == PutDecision::Unavailable && size > 0 && seen.insert(key) {
            needed = needed.saturating_add(size);
            largest = largest.max(size);
        }
    }
    (needed, largest)
}

/// The operator view of the cluster.
fn cluster_status(store: &dyn MetadataStore, retention_ms: u64) -> Result<v1::GetClusterStatusResponse, StoreError> {
    let now = now_ms();
    let nodes = store.list_nodes()?;
    let mut out = Vec::with_capacity(nodes.len());
    for n in nodes {
        let key_count = store.node_key_count(&n.node_id)?;
        let role = if n.lends_medium() { v1::NodeRole::Storage } else { v1::NodeRole::Client };
        out.push(v1::NodeStatusInfo {
            node_id: n.node_id.to_string(),
            node_address: n.node_address,
            peer_address: n.peer_address.to_string(),
            data_endpoint: n.data_endpoint.to_string(),
            status: match n.status {
                NodeStatus::Alive => v1::NodeStatus::Alive as i32,
                NodeStatus::Expired => v1::NodeStatus::Expired as i32,
            },
            tier_capacities: caps_to_wire(&n.caps),
            key_count,
            last_heartbeat_age_ms: now.saturating_sub(n.last_heartbeat_ms),
            last_applied_seq: n.last_applied_seq,
            tags: n.tags,
            role: role as i32,
            incarnation: n.incarnation,
        });
    }
    out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    let total_keys = store.key_count()?;
    Ok(v1::GetClusterStatusResponse { nodes: out, total_keys, expired_retention_ms: retention_ms })
}
