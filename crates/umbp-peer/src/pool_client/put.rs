//! The put path: route (skipped for a node the master granted local placement) → allocate (every group concurrently) → one submit for every group's pages →
//! commit survivors (every group concurrently) → abort the rest, with a bounded re-route of failed
//! keys, each excluding the nodes that failed *it*. A large batch runs as a pipeline of chunks of
//! about 8 MiB, up to six in flight, so one chunk's route, allocate and commit calls overlap
//! another chunk's bytes moving (the copies run on the blocking pool, not in this task).
//!
//! **Busy.** A node that has room for a value but no free staging page right now (an SSD node
//! whose staging arena is held by in-flight writes and reads) answers busy. The key is neither
//! excluded nor re-routed, and the answer does not use up `max_reroutes`: it is asked of the same
//! node (and tier) again, without a route call, once the round's commits are over — at once after
//! a round that allocated or settled something (its commits just gave pages back), else after the
//! get path's backoff (1 ms doubling to 100 ms). A chunk gives its busy keys up
//! ([`KeyError::Busy`]) only after [`BUSY_WAIT`](super::support::BUSY_WAIT) in which no chunk of
//! its batch made progress. So a batch larger than a node's staging arena goes through it in
//! rounds. Allocations on this node's own medium are treated alike.
//!
//! Slots are guarded from the moment they are allocated ([`SlotGuard`]): any key that does not end in
//! a successful commit — a transfer failure, a refused or failed commit, a malformed reply, an
//! expired slot, or the whole future being dropped — has its slot aborted.
//!
//! A slot lives `pending_ttl_ms` (from the allocate reply; the client's `pending_ttl` when the peer
//! sends 0) after the allocation. The client never starts a copy into a slot whose TTL minus a margin
//! has passed, and never commits one whose copy ended after it: the peer may already have reaped the
//! slot and given its pages to another key.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, PageLocation};

use tracing::Instrument;

use super::holder::{Allocation, Holder};
use super::phases::{self, phase};
use super::ranged::{Src, range_put_items};
use super::same_host_put::PutRoutes;
use super::support::{
    BatchProgress, BusyWait, PageLayout, SlotGuard, chunk_by_bytes, join_all, pipelined, route_by_exclude_set,
};
use super::*;
use crate::master_client::RoutePutDecision;

/// What allocating one key on a node produced.
enum Alloc {
    /// `refs` is the node's buffer table, shared by every key of the reply.
    Slot {
        slot_id: u64,
        pages: Vec<PageLocation>,
        refs: Arc<[Option<TransferRef>]>,
        page_size: u64,
        deadline: Instant,
    },
    Exists,
    NoSpace,
    /// The node has room but no free staging page now: ask it again shortly.
    Busy,
    Refused,
}

/// Keys routed to one node in one round.
#[derive(Clone)]
struct Group {
    node: String,
    peer: String,
    tier: TierType,
    indexes: Vec<usize>,
}

/// Per-key state of one pipelined chunk, keyed by the item's index in the batch (sparse: a chunk
/// holds a few of a batch's keys).
#[derive(Default)]
struct PutState {
    results: HashMap<usize, Result<PutOutcome, KeyError>>,
    exclude: HashMap<usize, BTreeSet<String>>,
    last_error: HashMap<usize, KeyError>,
    /// Keys a node answered busy: asked of the same node and tier again, without a route call.
    /// `indexes` of the group is unused.
    busy: HashMap<usize, Group>,
}

impl PutState {
    /// Key `i` was answered busy by `group`'s node: not excluded, asked of it again.
    fn busy(&mut self, i: usize, group: &Group) {
        self.last_error.insert(i, KeyError::Busy { node: group.node.clone() });
        self.busy.insert(i, Group { indexes: Vec::new(), ..group.clone() });
    }

    /// Key `i` is out of tries: it ends with its last error.
    fn give_up(&mut self, i: usize) {
        let e = self.last_error.remove(&i).unwrap_or(KeyError::Failed("re-routes exhausted".into()));
        self.results.insert(i, Err(e));
    }

    /// Key `i` failed on `node` in a way another node may not: try elsewhere.
    fn retry_elsewhere(&mut self, i: usize, node: &str, e: KeyError) {
        self.exclude.entry(i).or_default().insert(node.to_owned());
        self.last_error.insert(i, e);
    }

    /// Key `i`'s outcome once the chunk is done.
    fn outcome(&mut self, i: usize) -> Result<PutOutcome, KeyError> {
        self.results.remove(&i).unwrap_or_else(|| {
            Err(self.last_error.remove(&i).unwrap_or(KeyError::Failed("re-routes exhausted".into())))
        })
    }
}

/// The groups of keys that were answered busy, each on the node (and tier) that answered it;
/// takes them out of `st.busy` (a key answered busy again is put back by its round).
fn busy_groups(st: &mut PutState, retry: Vec<usize>) -> Vec<Group> {
    let mut by_target: BTreeMap<(String, String, TierType), Vec<usize>> = BTreeMap::new();
    for i in retry {
        if let Some(g) = st.busy.remove(&i) {
            by_target.entry((g.node, g.peer, g.tier)).or_default().push(i);
        }
    }
    by_target.into_iter().map(|((node, peer, tier), indexes)| Group { node, peer, tier, indexes }).collect()
}

/// Splits `fresh` into groups of the keys with a placement in `routes` (by node, peer and tier)
/// and the keys without one.
fn prerouted_groups(routes: &PutRoutes, fresh: Vec<usize>) -> (Vec<Group>, Vec<usize>) {
    let mut by_target: BTreeMap<(String, String, TierType), Vec<usize>> = BTreeMap::new();
    let mut unplaced = Vec::new();
    for i in fresh {
        match routes.get(i).and_then(Option::as_ref) {
            Some(target) => by_target.entry(target.clone()).or_default().push(i),
            None => unplaced.push(i),
        }
    }
    let groups = by_target.into_iter().map(|((node, peer, tier), indexes)| Group { node, peer, tier, indexes });
    (groups.collect(), unplaced)
}

/// When a slot allocated at `start` with a TTL of `ttl` stops being safe to write (a margin of a
/// quarter of the TTL, at most 2 s, before it). Also the holder's rule for keyed puts.
pub(crate) fn slot_deadline(start: Instant, ttl: Duration) -> Instant {
    let margin = (ttl / 4).min(Duration::from_secs(2));
    start + ttl.saturating_sub(margin)
}

impl PoolClient {
    /// Writes `key` (a batch of one).
    pub async fn put(&self, key: &str, value: &[u8]) -> Result<(), KeyError> {
        self.put_outcome(key, value).await.map(|_| ())
    }

    /// Writes `key` and says whether these bytes were stored or the pool already held the key (its
    /// stored value is kept: values are write-once).
    pub async fn put_outcome(&self, key: &str, value: &[u8]) -> Result<PutOutcome, KeyError> {
        self.batch_put_outcomes(&[(key, value)]).await.pop().unwrap_or(Err(KeyError::Failed("empty result".into())))
    }

    /// [`batch_put`](Self::batch_put), telling per item whether its bytes were written or the key was
    /// already present.
    pub async fn batch_put_outcomes(&self, items: &[(&str, &[u8])]) -> Vec<Result<PutOutcome, KeyError>> {
        let bufs: Vec<(&str, Src<'_>)> = items.iter().map(|(k, v)| (*k, Src::Whole(CallerBuf::of(v)))).collect();
        self.put_srcs(&bufs, &[]).instrument(phase!(phases::PUT)).await
    }

    /// Writes every `(key, value)`; one result per item, in order. A key the pool already holds counts
    /// as written (on a node granted local placement — `local` put affinity — a key only another node
    /// holds is written here too, with these bytes: the first writer wins per node, not pool-wide). A key repeated in the batch is written once (its first value) and every repeat gets
    /// that write's result.
    pub async fn batch_put(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), KeyError>> {
        self.batch_put_outcomes(items).await.into_iter().map(|r| r.map(|_| ())).collect()
    }

    /// [`batch_put`](Self::batch_put) from raw ranges `(key, ptr, len)`: the way to put from memory
    /// no Rust slice may cover, such as device buffers registered with
    /// [`register_memory_at`](Self::register_memory_at). The client never dereferences the
    /// pointers; only the transfer engine that registered the memory copies from them.
    ///
    /// # Safety
    /// Each `len` bytes at `ptr` lie inside one region registered with this client
    /// ([`register_memory`](Self::register_memory) or [`register_memory_at`](Self::register_memory_at),
    /// at its true location), stay valid and unwritten by anyone else until the returned future
    /// completes or is dropped, and that registration is not undone before then. (Host memory that
    /// is not registered is accepted too, as by `batch_put`, if it is valid host memory.)
    pub async unsafe fn batch_put_raw(&self, items: &[(&str, NonNull<u8>, usize)]) -> Vec<Result<(), KeyError>> {
        let bufs: Vec<(&str, Src<'_>)> =
            items.iter().map(|(k, ptr, len)| (*k, Src::Whole(CallerBuf { ptr: *ptr, len: *len }))).collect();
        self.put_srcs(&bufs, &[]).instrument(phase!(phases::PUT)).await.into_iter().map(|r| r.map(|_| ())).collect()
    }

    /// The put path over sources (whole buffers or ranges); `failed[i]`, when there, is item `i`'s
    /// result already (a bad request found on entry: nothing is written for it).
    pub(super) async fn put_srcs(
        &self,
        items: &[(&str, Src<'_>)],
        failed: &[Option<Result<PutOutcome, KeyError>>],
    ) -> Vec<Result<PutOutcome, KeyError>> {
        let gate = self.gate.read().await;
        if *gate {
            return vec![Err(KeyError::Closed); items.len()];
        }
        // One key from a client that lends no medium: a route call and one keyed exchange with the
        // holder; anything unusual falls back to the routed path below.
        if let [(key, Src::Whole(value))] = items
            && let Some(result) = self.put_fast(key, *value).await
        {
            return vec![result];
        }
        let n = items.len();
        let mut results: Vec<Option<Result<PutOutcome, KeyError>>> = vec![None; n];
        let mut repeat_of: Vec<Option<usize>> = vec![None; n];
        // foldhash (randomly seeded): a batch's keys are hashed once here, on the path the caller
        // waits on; SipHash cost ~0.15 µs a key (1,024 keys of a 64 KiB batch on the VM).
        let mut first_of: foldhash::HashMap<&str, usize> =
            foldhash::HashMap::with_capacity_and_hasher(items.len(), foldhash::fast::RandomState::default());
        for (i, (key, value)) in items.iter().enumerate() {
            if key.is_empty() {
                results[i] = Some(Err(KeyError::EmptyKey));
            } else if let Some(Some(r)) = failed.get(i) {
                results[i] = Some(r.clone());
            } else if value.size() == 0 {
                results[i] = Some(Err(KeyError::EmptyValue));
            } else if let Some(first) = first_of.get(key) {
                repeat_of[i] = Some(*first);
            } else {
                first_of.insert(key, i);
            }
        }
        let unique: Vec<usize> = (0..n).filter(|i| results[*i].is_none() && repeat_of[*i].is_none()).collect();
        // Keys placed on holders of this host: one exchange per holder chunk (`batch_keyed.rs`);
        // the rest, with the placements asked for them there, take the routed path.
        let routes = self.put_same_host(items, &unique, &mut results).await;
        let unique: Vec<usize> = unique.into_iter().filter(|i| results[*i].is_none()).collect();
        // Chunks run as a pipeline: one chunk's route and allocate overlap another's transfer.
        let chunks = chunk_by_bytes(unique, |i| items[i].1.size());
        let progress = BatchProgress::new();
        let routes = &routes;
        let states = pipelined(&chunks, |chunk| self.put_chunk(items, chunk, routes, &progress)).await;
        for (chunk, mut st) in chunks.iter().zip(states) {
            for i in chunk {
                results[*i] = Some(st.outcome(*i));
            }
        }
        self.tell_too_large(items, &mut results).await;
        let mut out: Vec<Result<PutOutcome, KeyError>> = Vec::with_capacity(n);
        for (i, repeat) in repeat_of.iter().enumerate() {
            let r = match (results[i].take(), *repeat) {
                (Some(r), _) => r,
                (None, Some(first)) => out[first].clone(),
                (None, None) => Err(KeyError::Failed("re-routes exhausted".into())),
            };
            out.push(r);
        }
        out
    }

    /// Writes one chunk of distinct, valid keys (`chunk` holds their indexes in `items`): route,
    /// allocate, transfer, commit, with bounded re-routes, and a bounded wait for nodes that answer
    /// busy (see the module docs).
    /// `routes[i]`, when there, is the master's placement for item `i`, asked for already: the
    /// first routed round uses it instead of routing the key again.
    async fn put_chunk(
        &self,
        items: &[(&str, Src<'_>)],
        chunk: &[usize],
        routes: &PutRoutes,
        progress: &BatchProgress,
    ) -> PutState {
        let mut st = PutState::default();
        let mut guard = SlotGuard::default();
        // A granted local round comes on top of the routed ones: a key the medium refuses still
        // gets the master's placement (and its re-routes), even with `max_reroutes` 0.
        let granted_tier = self.medium.as_ref().filter(|_| self.master.local_puts_granted()).map(|m| m.tier());
        let granted = u32::from(granted_tier.is_some());
        let last_attempt = self.config.max_reroutes + granted;
        // Routed (or granted local) rounds used; asking a busy node again does not count.
        let mut attempt = 0u32;
        let mut wait = BusyWait::new(progress);
        loop {
            let pending: Vec<usize> = chunk.iter().copied().filter(|i| !st.results.contains_key(i)).collect();
            if pending.is_empty() {
                break;
            }
            let (retry, fresh): (Vec<usize>, Vec<usize>) = pending.into_iter().partition(|i| st.busy.contains_key(i));
            let mut groups = Vec::new();
            if !fresh.is_empty() {
                if attempt > last_attempt {
                    for i in fresh {
                        st.give_up(i);
                    }
                } else {
                    if attempt > granted {
                        StatCounters::add(&self.stats.reroutes, fresh.len() as u64);
                    }
                    groups = match granted_tier {
                        Some(tier) if attempt == 0 => vec![self.local_group(tier, fresh)],
                        _ if attempt == 0 => {
                            // Placements asked for already (by the same-host pass) are used once.
                            let (placed, unplaced) = prerouted_groups(routes, fresh);
                            let mut groups = placed;
                            if !unplaced.is_empty() {
                                let routed = self.route_puts(items, &unplaced, &mut st);
                                groups.extend(routed.instrument(phase!(phases::PUT_ROUTE)).await);
                            }
                            groups
                        }
                        _ => self.route_puts(items, &fresh, &mut st).instrument(phase!(phases::PUT_ROUTE)).await,
                    };
                    attempt += 1;
                }
            }
            if !retry.is_empty() {
                if wait.expired() {
                    for i in retry {
                        st.busy.remove(&i);
                        st.give_up(i);
                    }
                } else {
                    // In-flight writes and reads hold the node's staging pages: give them time to
                    // commit and release (bounded backoff) unless this chunk's own last round just
                    // gave pages back, then ask the same node again.
                    wait.pause().await;
                    groups.extend(busy_groups(&mut st, retry));
                }
            }
            if groups.is_empty() {
                continue;
            }
            let settled = st.results.len();
            let allocated = self.put_round(items, &groups, &mut guard, &mut st).await;
            guard.abort_all().instrument(phase!(phases::PUT_ABORT)).await;
            wait.round(allocated || st.results.len() > settled);
        }
        st
    }

    /// Every pending key as one group on this node's own medium (of `tier`), for a node the master
    /// granted local placement (its `local` affinity would route them here anyway): the first round
    /// then needs no route call, which on a node writing to itself is most of a put's control-plane
    /// cost. A key the medium refuses (full, too large) is retried with this node excluded, through
    /// the master, as after any other refusal. A key held only by another node gets a replica here
    /// too, with this caller's bytes: the master's cross-node dedup (first writer wins across the
    /// pool) is what the grant gives up; within this node the first writer still wins.
    fn local_group(&self, tier: TierType, pending: Vec<usize>) -> Group {
        Group {
            node: self.config.node_id.clone(),
            // This node's own address is never dialled: its holder is the medium itself.
            peer: String::new(),
            tier,
            indexes: pending,
        }
    }

    /// Turns `NoSpace` into `TooLarge` for values larger than every medium's total capacity (one
    /// cluster-status call, only when some key found no space).
    async fn tell_too_large(&self, items: &[(&str, Src<'_>)], results: &mut [Option<Result<PutOutcome, KeyError>>]) {
        if !results.iter().any(|r| matches!(r, Some(Err(KeyError::NoSpace { .. })))) {
            return;
        }
        let Ok(status) = self.master.cluster_status().await else { return };
        let largest =
            status.nodes.iter().flat_map(|n| n.tier_capacities.iter().map(|(_, c)| c.total_bytes)).max().unwrap_or(0);
        for (r, (_, value)) in results.iter_mut().zip(items) {
            let size = value.size();
            if matches!(r, Some(Err(KeyError::NoSpace { .. }))) && size > largest {
                *r = Some(Err(KeyError::TooLarge { size, largest }));
            }
        }
    }

    /// Routes `pending` at the master, one call per distinct exclude set (concurrently), and groups
    /// the routed keys by node and tier.
    async fn route_puts(&self, items: &[(&str, Src<'_>)], pending: &[usize], st: &mut PutState) -> Vec<Group> {
        let unreachable = self.recently_unreachable();
        let routed = route_by_exclude_set(
            pending,
            |i| st.exclude.get(&i),
            &unreachable,
            move |set, indexes| async move {
                let keys: Vec<String> = indexes.iter().map(|i| items[*i].0.to_owned()).collect();
                let sizes: Vec<u64> = indexes.iter().map(|i| items[*i].1.size()).collect();
                self.master.batch_route_put(&keys, &sizes, &set).await
            },
        )
        .await;
        let mut groups: BTreeMap<(String, String, TierType), Vec<usize>> = BTreeMap::new();
        for (i, decision) in routed {
            match decision {
                Err(e) => {
                    st.results.insert(i, Err(e));
                }
                Ok(RoutePutDecision::AlreadyExists) => {
                    st.results.insert(i, Ok(PutOutcome::AlreadyPresent));
                }
                Ok(RoutePutDecision::Unavailable) => {
                    let size = items[i].1.size();
                    let e = st.last_error.remove(&i).unwrap_or(KeyError::NoSpace { size });
                    st.results.insert(i, Err(e));
                }
                Ok(RoutePutDecision::Routed { node_id, peer_address, tier, .. }) => {
                    groups.entry((node_id, peer_address, tier)).or_default().push(i)
                }
            }
        }
        groups.into_iter().map(|((node, peer, tier), indexes)| Group { node, peer, tier, indexes }).collect()
    }

    /// One round: allocate every group, copy, commit. Returns whether any slot was allocated (its
    /// pages come back to the node by the round's end, committed or aborted).
    async fn put_round(
        &self,
        items: &[(&str, Src<'_>)],
        groups: &[Group],
        guard: &mut SlotGuard,
        st: &mut PutState,
    ) -> bool {
        let mut allocated_any = false;
        // 1. Allocate on every node at once.
        let allocs = join_all(groups.iter().map(|g| self.allocate_group(items, g)).collect())
            .instrument(phase!(phases::PUT_ALLOCATE))
            .await;
        let mut transfers = Vec::new();
        let mut planned: Vec<(usize, usize, u64, Instant)> = Vec::new();
        let mut holders: Vec<Option<Holder>> = vec![None; groups.len()];
        for (g, (group, alloc)) in groups.iter().zip(allocs).enumerate() {
            let node = group.node.as_str();
            let (holder, allocated) = match alloc {
                Ok(a) => a,
                Err(e) => {
                    for i in &group.indexes {
                        st.retry_elsewhere(*i, node, e.clone());
                    }
                    continue;
                }
            };
            // Guard every slot before anything else can fail.
            for a in &allocated {
                if let Alloc::Slot { slot_id, .. } = a {
                    guard.track(&holder, *slot_id);
                    allocated_any = true;
                }
            }
            holders[g] = Some(holder);
            for (i, a) in group.indexes.iter().zip(allocated) {
                let (_, value) = items[*i];
                match a {
                    Alloc::Exists => {
                        st.results.insert(*i, Ok(PutOutcome::AlreadyPresent));
                    }
                    Alloc::NoSpace => st.retry_elsewhere(*i, node, KeyError::NoSpace { size: value.size() }),
                    Alloc::Busy => st.busy(*i, group),
                    Alloc::Refused => st.retry_elsewhere(
                        *i,
                        node,
                        KeyError::Refused { node: node.to_owned(), message: "allocation refused".into() },
                    ),
                    Alloc::Slot { slot_id, pages, refs, page_size, deadline } => {
                        if self.clock.now() >= deadline {
                            // Never start a copy into a slot that may be reaped under it.
                            StatCounters::add(&self.stats.slot_expiries, 1);
                            st.last_error.insert(*i, KeyError::SlotExpired { node: node.to_owned() });
                            continue;
                        }
                        let layout = PageLayout { pages: &pages, refs: &refs, page_size, partial_from: None };
                        let planned_items = match value {
                            Src::Whole(buf) => {
                                let (src, base) = self.caller_ref(buf);
                                page_items(&src, base, value.size(), layout, *i as u64, true)
                            }
                            Src::Ranges { size, parts } => {
                                range_put_items(parts, size, layout, *i as u64, |b| self.caller_ref(b))
                            }
                        };
                        match planned_items {
                            Ok(p) => {
                                transfers.extend(p);
                                planned.push((g, *i, slot_id, deadline));
                            }
                            Err(e) => st.retry_elsewhere(
                                *i,
                                node,
                                KeyError::Unreachable {
                                    node: node.to_owned(),
                                    message: format!("malformed slot: {e}"),
                                    source: None,
                                },
                            ),
                        }
                    }
                }
            }
        }
        // 2. One submit for every group (the local copies complete in submit), then wait; the
        // values' checksums are summed meanwhile (off the async worker for a large round). A whole
        // value written into this node's own medium is summed as it is copied instead, each block
        // right after its copy read it (one pass over the value, not two).
        let summable: HashSet<u64> = planned
            .iter()
            .filter(|(g, ..)| self.config.checksums && holders[*g].as_ref().is_some_and(Holder::is_here))
            .filter(|(_, i, ..)| matches!(items[*i].1, Src::Whole(b) if !self.in_device_registration(b)))
            .map(|(_, i, ..)| *i as u64)
            .collect();
        let (summed, rest): (Vec<TransferItem>, Vec<TransferItem>) =
            transfers.into_iter().partition(|t| summable.contains(&t.tag));
        let values: Vec<(usize, Src<'_>)> = planned
            .iter()
            .filter(|(_, i, ..)| !summable.contains(&(*i as u64)))
            .map(|(_, i, _, _)| (*i, items[*i].1))
            .collect();
        let moved = async {
            let (mut failed, sums) = self.run_transfers_summed(summed, SumOf::Source).await;
            failed.extend(self.run_transfers(rest).await);
            (failed, sums)
        };
        let srcs: Vec<Src<'_>> = values.iter().map(|(_, v)| *v).collect();
        let ((failed, copied_sums), sums) =
            tokio::join!(moved.instrument(phase!(phases::PUT_TRANSFER)), self.value_checksums(&srcs));
        let mut crc32c: HashMap<usize, Option<u32>> = values.iter().map(|(i, _)| *i).zip(sums).collect();
        for i in &summable {
            crc32c.insert(*i as usize, copied_sums.get(i).copied());
        }
        // An engine that declined to sum copied as usual: those values are summed now.
        let unsummed: Vec<usize> = summable
            .iter()
            .map(|i| *i as usize)
            .filter(|i| crc32c.get(i) == Some(&None) && !failed.contains_key(&(*i as u64)))
            .collect();
        if !unsummed.is_empty() {
            let srcs: Vec<Src<'_>> = unsummed.iter().map(|i| items[*i].1).collect();
            for (i, sum) in unsummed.iter().zip(self.value_checksums(&srcs).await) {
                crc32c.insert(*i, sum);
            }
        }
        let ended = self.clock.now();
        let mut commits: BTreeMap<usize, Vec<(usize, u64)>> = BTreeMap::new();
        for (g, i, slot_id, deadline) in planned {
            let node = groups[g].node.as_str();
            if let Some((kind, message)) = failed.get(&(i as u64)) {
                let e = KeyError::Transfer { node: node.to_owned(), kind: *kind, message: message.clone() };
                st.retry_elsewhere(i, node, e);
                if matches!(holders[g], Some(Holder::Peer(_))) {
                    // The transfer may have failed on stale descriptors (a restarted peer).
                    self.forget_peer(node);
                }
            } else if ended >= deadline {
                StatCounters::add(&self.stats.slot_expiries, 1);
                st.last_error.insert(i, KeyError::SlotExpired { node: node.to_owned() });
            } else {
                commits.entry(g).or_default().push((i, slot_id));
            }
        }
        // 3. Commit the survivors on every node at once.
        let commits: Vec<(usize, Vec<(usize, u64)>)> = commits.into_iter().collect();
        // Only groups that allocated planned a copy: each has its holder.
        let replies = join_all(
            commits.iter().map(|(g, list)| self.commit_group(items, holders[*g].as_ref(), list, &crc32c)).collect(),
        )
        .instrument(phase!(phases::PUT_COMMIT))
        .await;
        for ((g, list), reply) in commits.iter().zip(replies) {
            let node = groups[*g].node.as_str();
            for ((i, slot_id), ok) in list.iter().zip(reply) {
                match ok {
                    Ok(()) => {
                        guard.settle(node, *slot_id);
                        st.results.insert(*i, Ok(PutOutcome::Written));
                    }
                    Err(e) => st.retry_elsewhere(*i, node, e),
                }
            }
        }
        allocated_any
    }

    /// Allocates a group's keys on its node: the holder and one outcome per key.
    async fn allocate_group(&self, items: &[(&str, Src<'_>)], group: &Group) -> Result<(Holder, Vec<Alloc>), KeyError> {
        let holder = self.holder(&group.node, &group.peer).await?;
        let requests: Vec<AllocateRequest> =
            group.indexes.iter().map(|i| AllocateRequest::new(items[*i].0, items[*i].1.size())).collect();
        let start = self.clock.now();
        // The tier the master routed to: the peer service dispatches on it.
        let allocations = holder.allocate(&self.directory, group.tier, requests).await?;
        let allocs = allocations.into_iter().map(|a| self.alloc(a, start)).collect();
        Ok((holder, allocs))
    }

    /// One allocation answer, with the slot's deadline counted from `start` (just before the call).
    fn alloc(&self, a: Allocation, start: Instant) -> Alloc {
        match a.outcome {
            AllocateOutcome::Allocated => {
                let ttl = if a.pending_ttl_ms == 0 {
                    self.config.pending_ttl
                } else {
                    Duration::from_millis(a.pending_ttl_ms)
                };
                Alloc::Slot {
                    slot_id: a.slot_id,
                    pages: a.pages,
                    refs: a.refs,
                    page_size: a.page_size,
                    deadline: slot_deadline(start, ttl),
                }
            }
            AllocateOutcome::AlreadyExists => Alloc::Exists,
            AllocateOutcome::FailedNoSpace => Alloc::NoSpace,
            AllocateOutcome::Busy => Alloc::Busy,
            AllocateOutcome::Failed => Alloc::Refused,
        }
    }

    /// Commits `(key index, slot)` pairs on `holder`; one result per pair.
    async fn commit_group(
        &self,
        items: &[(&str, Src<'_>)],
        holder: Option<&Holder>,
        list: &[(usize, u64)],
        crc32c: &HashMap<usize, Option<u32>>,
    ) -> Vec<Result<(), KeyError>> {
        let Some(holder) = holder else { return vec![Err(KeyError::Failed("no holder".into())); list.len()] };
        let node = holder.node();
        let refused = || KeyError::Refused { node: node.to_owned(), message: "commit refused".into() };
        let commits: Vec<CommitRequest> = list
            .iter()
            .map(|(i, id)| CommitRequest::new(*id, items[*i].0).with_crc32c(crc32c.get(i).copied().flatten()))
            .collect();
        match holder.commit(commits).await {
            Ok(done) => done.into_iter().map(|ok| if ok { Ok(()) } else { Err(refused()) }).collect(),
            Err(e) => vec![Err(e); list.len()],
        }
    }
}
