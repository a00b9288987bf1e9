//! The get path, per pipelined chunk: route → resolve on every holder concurrently, right before the one submit → wait
//! → keep only copies that finished inside the read lease, re-reading the rest → release.
//!
//! A resolve takes a read lease on the holder (`read_lease`, 500 ms by default) that protects the
//! pages from eviction while the copy runs. The wire carries no lease length, so the client uses its
//! own `read_lease` setting (nodes of one cluster share it) and measures from the instant *before*
//! the resolve RPC was sent (earlier than the holder's clock starts: conservative). A copy that ends
//! after that deadline may have read pages already reused by another key: it is discarded
//! ([`KeyError::LeaseExpired`] once re-reads are exhausted), never returned as a hit.
//!
//! **Release.** Once a round's copies are over (done or failed), every hit's lease is released: on
//! this node's medium in place, on each remote holder with one `ReleaseReads` sent in the
//! background (the result never waits for it; `close` waits for releases still in flight, so a
//! one-shot client does not exit before its release leaves). A staged medium (SSD) therefore gets
//! its staging pages back as soon as the copy is done, not after its lease.
//!
//! **Busy.** A holder that has the key but cannot serve it now (every staging page held by other
//! readers) answers busy. The key is not excluded and not reported missing: it is asked of the
//! same holder again (no route call), at once after a round that read something (this chunk's own
//! releases just freed pages), else after a backoff doubling from 1 ms to 100 ms. A chunk gives its
//! busy keys up ([`KeyError::Busy`]) only after [`BUSY_WAIT`](super::support::BUSY_WAIT) in which
//! no chunk of its batch read anything (siblings sharing one arena do not starve each other into
//! failing). Busy answers do not use up `max_reroutes`. The wait is [`BusyWait`], shared with the
//! put path.
//!
//! **Gone holders.** A holder that refuses connections (nothing listens at its address: its process
//! is gone, though the master may not know yet) makes its keys misses, not errors: they are
//! re-routed without it like a stale route, and the client leaves it out of its routes for a while.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use umbp_core::{PageLocation, ReadRelease};

use super::holder::unreachable;
use super::support::{BatchProgress, BusyWait, chunk_by_bytes, join_all, medium_call, pipelined, refuses_connections};
use super::*;
use crate::peer_client::{LeaseRelease, PeerClientError};

/// Where a found key lives on a remote holder.
struct Hit {
    size: u64,
    pages: Vec<PageLocation>,
    /// The holder's buffer refs by index (of the medium that serves the key).
    refs: Vec<Option<TransferRef>>,
    page_size: u64,
    /// The read lease to release once the copy is done (0: none).
    lease: u64,
    /// The holder's medium that serves the key.
    backend_id: u32,
}

/// A remote holder's answer for one key.
enum Answer {
    Hit(Hit),
    Miss,
    /// Held there, but not servable now: ask the same holder again shortly.
    Busy,
}

/// This node's medium's answer for one key (a hit is planned in place).
#[derive(Clone, Copy)]
enum Here {
    Found,
    Missing,
    Busy,
}

/// Where a key that was answered busy is asked again.
enum Retry {
    /// This node's medium.
    Here,
    /// The same remote holder, without a route call.
    Remote { node: String, peer: String },
}

/// What reading one chunk produced.
struct ChunkRead {
    /// One result per key of the chunk.
    results: Vec<Result<u64, KeyError>>,
    /// Positions fetched from another node (re-cache candidates).
    fetched_remote: Vec<usize>,
    /// Keys found on this node's medium (the master hears of them in one hint per batch).
    local_hits: Vec<String>,
}

/// Per-key state of one chunk's read.
struct ChunkState {
    results: Vec<Option<Result<u64, KeyError>>>,
    exclude: Vec<BTreeSet<String>>,
    last_error: HashMap<usize, KeyError>,
    /// Routed attempts that failed (busy answers do not count).
    tries: Vec<u32>,
    /// Keys answered busy, and where to ask again.
    retry: Vec<Option<Retry>>,
}

impl ChunkState {
    fn new(n: usize) -> Self {
        Self {
            results: vec![None; n],
            exclude: vec![BTreeSet::new(); n],
            last_error: HashMap::new(),
            tries: vec![0; n],
            retry: (0..n).map(|_| None).collect(),
        }
    }

    /// Key `i` was answered busy by `node`: not excluded, asked again at `retry`.
    fn busy(&mut self, i: usize, retry: Retry, node: &str) {
        self.last_error.insert(i, KeyError::Busy { node: node.to_owned() });
        self.retry[i] = Some(retry);
    }

    /// Ends a round for the keys still open: a busy one waits (it fails once `busy_expired`), one
    /// whose first copy was carried into this round (`carried[i]`, the local hits of round 0) is
    /// routed next, any other used up a route and fails after `max_reroutes` of them.
    fn settle_round(&mut self, carried: &[bool], max_reroutes: u32, busy_expired: bool) {
        for (i, result) in self.results.iter_mut().enumerate() {
            if result.is_some() {
                continue;
            }
            if self.retry[i].is_some() {
                if busy_expired {
                    self.retry[i] = None;
                    *result = Some(Err(self.last_error.remove(&i).unwrap_or(KeyError::Miss)));
                }
                continue;
            }
            if carried.get(i).copied().unwrap_or(false) {
                continue;
            }
            self.tries[i] += 1;
            if self.tries[i] > max_reroutes {
                *result = Some(Err(self.last_error.remove(&i).unwrap_or(KeyError::Miss)));
            }
        }
    }

    /// Whether some key of the chunk waits to ask remote `node` again.
    fn waits_on(&self, node: &str) -> bool {
        self.retry.iter().flatten().any(|r| matches!(r, Retry::Remote { node: n, .. } if n == node))
    }
}

/// One key's planned read.
struct Planned {
    index: usize,
    size: u64,
    node: String,
    /// The holder's peer address; `None` for this node's medium.
    peer: Option<String>,
    lease_end: Instant,
    /// The read lease to release once the copy is done (0: none).
    lease: u64,
    /// The holder's medium that serves the key (remote holders only).
    backend_id: u32,
    /// Whether its copy was submitted (false: the key already failed, e.g. a buffer too small; the
    /// plan is kept only to release its lease).
    copied: bool,
}

impl PoolClient {
    /// Reads `key` into `buf`; returns the value's size.
    pub async fn get(&self, key: &str, buf: &mut [u8]) -> Result<u64, KeyError> {
        let mut bufs = [buf];
        self.batch_get(&[key], &mut bufs).await.pop().unwrap_or(Err(KeyError::Failed("empty result".into())))
    }

    /// Reads every key into its buffer; one result per key (the value's size), in order. A buffer
    /// shorter than the value is an error for that key; a longer one is filled up to the size. A key
    /// without a buffer (fewer buffers than keys) gets [`KeyError::NoBuffer`]. On an error the
    /// buffer's contents are unspecified.
    pub async fn batch_get(&self, keys: &[&str], bufs: &mut [&mut [u8]]) -> Vec<Result<u64, KeyError>> {
        // The caller's buffers, borrowed for this call (every transfer is waited for).
        let targets: Vec<CallerBuf> = bufs.iter_mut().map(|b| CallerBuf::of_mut(b)).collect();
        self.get_bufs(keys, &targets).await
    }

    /// [`batch_get`](Self::batch_get) into raw ranges `(ptr, len)`: the way to get into memory no
    /// Rust slice may cover, such as device buffers registered with
    /// [`register_memory_at`](Self::register_memory_at). The client never dereferences a range
    /// inside a device registration (a fetched value is re-cached locally only from host memory);
    /// only the transfer engine that registered the memory copies into it.
    ///
    /// # Safety
    /// Each `len` bytes at `ptr` lie inside one region registered with this client
    /// ([`register_memory`](Self::register_memory) or [`register_memory_at`](Self::register_memory_at),
    /// at its true location), or are valid host memory; they stay valid, and are neither read nor
    /// written by anyone else, until the returned future completes or is dropped; no two ranges
    /// overlap; and a registration is not undone before then.
    pub async unsafe fn batch_get_raw(
        &self,
        keys: &[&str],
        bufs: &[(NonNull<u8>, usize)],
    ) -> Vec<Result<u64, KeyError>> {
        let targets: Vec<CallerBuf> = bufs.iter().map(|(ptr, len)| CallerBuf { ptr: *ptr, len: *len }).collect();
        self.get_bufs(keys, &targets).await
    }

    /// The get path over caller buffers (slices or raw ranges).
    async fn get_bufs(&self, keys: &[&str], targets: &[CallerBuf]) -> Vec<Result<u64, KeyError>> {
        let bufs = targets;
        let gate = self.gate.read().await;
        if *gate {
            return vec![Err(KeyError::Closed); keys.len()];
        }
        let n = keys.len();
        let mut results: Vec<Option<Result<u64, KeyError>>> = vec![None; n];
        for (i, k) in keys.iter().enumerate() {
            if k.is_empty() {
                results[i] = Some(Err(KeyError::EmptyKey));
            } else if i >= bufs.len() {
                results[i] = Some(Err(KeyError::NoBuffer));
            }
        }
        let valid: Vec<usize> = (0..n).filter(|i| results[*i].is_none()).collect();
        // Chunks run as a pipeline: one chunk's route and resolve overlap another's transfer. A
        // buffer's length stands for its value's size.
        let chunks = chunk_by_bytes(valid, |i| targets[i].len as u64);
        let progress = BatchProgress::new();
        let progress = &progress;
        let outcomes = pipelined(&chunks, |chunk| {
            let chunk_keys: Vec<&str> = chunk.iter().map(|i| keys[*i]).collect();
            let chunk_targets: Vec<CallerBuf> = chunk.iter().map(|i| targets[*i]).collect();
            async move { self.get_chunk(&chunk_keys, &chunk_targets, progress).await }
        })
        .await;
        let mut fetched_remote: Vec<usize> = Vec::new();
        let mut local_hits: Vec<String> = Vec::new();
        for (chunk, outcome) in chunks.iter().zip(outcomes) {
            for (i, r) in chunk.iter().zip(outcome.results) {
                results[*i] = Some(r);
            }
            fetched_remote.extend(outcome.fetched_remote.into_iter().map(|j| chunk[j]));
            local_hits.extend(outcome.local_hits);
        }
        // One access hint for the whole batch's local hits.
        self.touch(local_hits);
        self.queue_recache(keys, targets, &results, &fetched_remote);
        results.into_iter().map(|r| r.unwrap_or(Err(KeyError::Miss))).collect()
    }

    /// Reads one chunk: `keys[j]` into `targets[j]`, with bounded re-routes (`max_reroutes` per
    /// key) and a bounded wait for holders that answer busy ([`BUSY_WAIT`](super::support::BUSY_WAIT)).
    async fn get_chunk(&self, keys: &[&str], targets: &[CallerBuf], progress: &BatchProgress) -> ChunkRead {
        let n = keys.len();
        let mut st = ChunkState::new(n);
        let mut fetched_remote: Vec<usize> = Vec::new();
        let me = self.config.node_id.clone();
        // Local first: what this node holds is read without asking the master (a route call per
        // chunk saved). Misses, and every key on a node without a medium, are routed below, with
        // this node excluded. Their copies join the first round's submit.
        let mut carried: (Vec<TransferItem>, Vec<Planned>) = (Vec::new(), Vec::new());
        let mut read_locally = vec![false; n];
        let mut local_hits = Vec::new();
        if let Some(m) = &self.medium {
            let all: Vec<(usize, bool)> = (0..n).map(|i| (i, true)).collect();
            let answers = self.read_here(m, keys, targets, &all, &mut carried.0, &mut carried.1, &mut st.results).await;
            for (i, answer) in answers.into_iter().enumerate() {
                match answer {
                    Here::Found => {
                        st.exclude[i].insert(me.clone());
                        read_locally[i] = true;
                        local_hits.push(keys[i].to_owned());
                    }
                    // Held here but busy: ask this medium again next round.
                    Here::Busy => st.busy(i, Retry::Here, &me),
                    Here::Missing => {
                        st.exclude[i].insert(me.clone());
                    }
                }
            }
        }
        // A busy key waits while its holders keep serving this chunk; it gives up after BUSY_WAIT
        // without any progress.
        let mut busy = BusyWait::new(progress);
        let mut round = 0usize;
        loop {
            // Round 0 carries the local hits' copies; keys the local medium answered busy wait for
            // round 1 (asking again at once would find it just as busy).
            let pending: Vec<usize> = (0..n)
                .filter(|i| st.results[*i].is_none() && !(round == 0 && (read_locally[*i] || st.retry[*i].is_some())))
                .collect();
            let (mut transfers, mut planned) = std::mem::take(&mut carried);
            if pending.is_empty() && planned.is_empty() && st.results.iter().all(Option::is_some) {
                break;
            }
            if round > 0 {
                let rerouted = pending.iter().filter(|i| st.retry[**i].is_none()).count();
                StatCounters::add(&self.stats.reroutes, rerouted as u64);
                if pending.iter().any(|i| st.retry[*i].is_some()) {
                    // Someone else's reads hold the holder's staging pages: give them time to copy
                    // and release (bounded backoff), then ask the same holder again. After a round
                    // that read something, this chunk's own releases just freed pages: ask at once.
                    busy.pause().await;
                }
            }
            // Keys a holder answered busy go straight back to it; the rest are routed, one call per
            // distinct exclude set, concurrently.
            let mut local: Vec<(usize, bool)> = Vec::new();
            let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
            let mut to_route: Vec<usize> = Vec::new();
            for i in &pending {
                match st.retry[*i].take() {
                    Some(Retry::Here) => local.push((*i, true)),
                    Some(Retry::Remote { node, peer }) => groups.entry((node, peer)).or_default().push(*i),
                    None => to_route.push(*i),
                }
            }
            let unreachable = self.recently_unreachable();
            let mut by_set: BTreeMap<Vec<String>, Vec<usize>> = BTreeMap::new();
            for i in &to_route {
                let mut set = st.exclude[*i].clone();
                set.extend(unreachable.iter().cloned());
                by_set.entry(set.into_iter().collect()).or_default().push(*i);
            }
            let sets: Vec<(Vec<String>, Vec<usize>)> = by_set.into_iter().collect();
            let calls = sets
                .iter()
                .map(|(set, indexes)| async move {
                    let route_keys: Vec<String> = indexes.iter().map(|i| keys[*i].to_owned()).collect();
                    self.master.batch_route_get(&route_keys, set).await
                })
                .collect();
            for ((_, indexes), hits) in sets.iter().zip(join_all(calls).await) {
                let hits = match hits {
                    Ok(h) => h,
                    Err(e) => {
                        for i in indexes {
                            st.results[*i] = Some(Err(KeyError::Routing(e.to_string())));
                        }
                        continue;
                    }
                };
                for (i, hit) in indexes.iter().zip(hits) {
                    match hit {
                        // Not indexed (yet): the key may have been written here before the master
                        // heard. Without a medium, or once tried here, it is a miss at once.
                        None if self.medium.is_none() || st.exclude[*i].contains(&me) => {
                            st.results[*i] = Some(Err(st.last_error.remove(i).unwrap_or(KeyError::Miss)))
                        }
                        None => local.push((*i, false)),
                        Some(h) if h.node_id == me => local.push((*i, true)),
                        Some(h) => groups.entry((h.node_id, h.peer_address)).or_default().push(*i),
                    }
                }
            }
            // Resolve on every holder concurrently, right before the submit.
            let groups: Vec<((String, String), Vec<usize>)> = groups.into_iter().collect();
            let resolves = join_all(
                groups.iter().map(|((node, peer), indexes)| self.resolve_remote(keys, indexes, node, peer)).collect(),
            )
            .await;
            for (((node, peer), indexes), (start, found)) in groups.iter().zip(resolves) {
                let found = match found {
                    Ok(f) => f,
                    Err(e) => {
                        for i in indexes {
                            st.exclude[*i].insert(node.clone());
                            st.last_error.insert(*i, e.clone());
                        }
                        continue;
                    }
                };
                let lease_end = start + self.config.read_lease;
                for (i, f) in indexes.iter().zip(found) {
                    match f {
                        Answer::Miss => {
                            // A stale route: re-route without this node.
                            st.exclude[*i].insert(node.clone());
                            st.last_error.insert(*i, KeyError::Miss);
                        }
                        Answer::Busy => {
                            st.busy(*i, Retry::Remote { node: node.clone(), peer: peer.clone() }, node);
                        }
                        Answer::Hit(hit) => {
                            let plan = Planned {
                                index: *i,
                                size: hit.size,
                                node: node.clone(),
                                peer: Some(peer.clone()),
                                lease_end,
                                lease: hit.lease,
                                backend_id: hit.backend_id,
                                copied: true,
                            };
                            self.plan_get(
                                plan,
                                &hit.pages,
                                &hit.refs,
                                hit.page_size,
                                targets[*i],
                                &mut transfers,
                                &mut planned,
                                &mut st.results,
                            );
                        }
                    }
                }
            }
            // This node's part, in the gap before the submit.
            if let Some(m) = &self.medium
                && !local.is_empty()
            {
                let answers =
                    self.read_here(m, keys, targets, &local, &mut transfers, &mut planned, &mut st.results).await;
                for ((i, routed_here), answer) in local.iter().zip(answers) {
                    match answer {
                        Here::Found => {
                            st.exclude[*i].insert(me.clone());
                        }
                        Here::Busy => st.busy(*i, Retry::Here, &me),
                        // The master's index is stale: try another replica.
                        Here::Missing if *routed_here => {
                            st.exclude[*i].insert(me.clone());
                            st.last_error.insert(*i, KeyError::Miss);
                        }
                        // No route and no local copy: a miss at once.
                        Here::Missing => {
                            st.exclude[*i].insert(me.clone());
                            st.results[*i] = Some(Err(KeyError::Miss));
                        }
                    }
                }
            }
            busy.round(planned.iter().any(|p| p.copied));
            let failed = self.run_transfers(transfers).await;
            let ended = Instant::now();
            // Every copy of this round is over: its holders may reuse the pages now.
            self.release_reads(keys, &planned, &st).await;
            for p in planned.into_iter().filter(|p| p.copied) {
                if let Some((kind, message)) = failed.get(&(p.index as u64)) {
                    st.last_error.insert(
                        p.index,
                        KeyError::Transfer { node: p.node.clone(), kind: *kind, message: message.clone() },
                    );
                    st.exclude[p.index].insert(p.node.clone());
                    if p.node != me {
                        self.forget_peer(&p.node);
                    }
                } else if ended > p.lease_end {
                    // The pages may have been evicted and reused under the copy: read again.
                    StatCounters::add(&self.stats.lease_lapses, 1);
                    st.exclude[p.index].remove(&p.node);
                    st.last_error.insert(p.index, KeyError::LeaseExpired { node: p.node });
                } else {
                    st.results[p.index] = Some(Ok(p.size));
                    if p.node != me {
                        fetched_remote.push(p.index);
                    }
                }
            }
            let busy_expired = busy.expired();
            let carried_here: &[bool] = if round == 0 { &read_locally } else { &[] };
            st.settle_round(carried_here, self.config.max_reroutes, busy_expired);
            round += 1;
        }
        let results = st
            .results
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| Err(st.last_error.remove(&i).unwrap_or(KeyError::Miss))))
            .collect();
        ChunkRead { results, fetched_remote, local_hits }
    }

    /// Ends the read leases of `planned` (every copy of the round is over, done or failed): this
    /// node's medium at once, each remote holder with one `ReleaseReads`, in the background (the
    /// caller's result never waits for it) unless the chunk still has keys that holder answered
    /// busy, whose next resolve needs the pages back first.
    async fn release_reads(&self, keys: &[&str], planned: &[Planned], st: &ChunkState) {
        let mut local: Vec<ReadRelease> = Vec::new();
        let mut remote: BTreeMap<(String, String), Vec<LeaseRelease>> = BTreeMap::new();
        for p in planned.iter().filter(|p| p.lease != 0) {
            let key = keys[p.index].to_owned();
            match &p.peer {
                None => local.push(ReadRelease::new(key, p.lease)),
                Some(peer) => remote.entry((p.node.clone(), peer.clone())).or_default().push(LeaseRelease {
                    key,
                    lease: p.lease,
                    backend_id: p.backend_id,
                }),
            }
        }
        if let Some(m) = &self.medium
            && !local.is_empty()
        {
            // Bookkeeping under the medium's lock, no IO: cheap enough to run in place.
            blocking(|| m.release_reads(&local));
        }
        let mut waited = Vec::new();
        for ((node, _), reads) in remote {
            // Only over a connection still open: a holder that failed does not hold this round up
            // (its leases expire instead).
            let Some(client) = self.peers.open(&node) else { continue };
            let waits = st.waits_on(&node);
            let send = async move {
                if let Err(e) = client.release(reads).await {
                    tracing::debug!(node, error = %e, "read release did not land; the read lease expires instead");
                }
            };
            if waits {
                waited.push(send);
            } else {
                self.releases.spawn(send);
            }
        }
        join_all(waited).await;
    }

    /// Resolves `local` (index, whether the master routed it here) on this node's medium and plans
    /// the copies of the keys found, each under the medium's read lease. Returns, per entry, what
    /// the medium answered.
    #[expect(clippy::too_many_arguments, reason = "the chunk's keys and the round's accumulators")]
    async fn read_here(
        &self,
        m: &Arc<dyn MediumBackend>,
        keys: &[&str],
        targets: &[CallerBuf],
        local: &[(usize, bool)],
        transfers: &mut Vec<TransferItem>,
        planned: &mut Vec<Planned>,
        results: &mut [Option<Result<u64, KeyError>>],
    ) -> Vec<Here> {
        let local_keys: Vec<String> = local.iter().map(|(i, _)| keys[*i].to_owned()).collect();
        let start = Instant::now();
        // A panicked resolve reads nothing here: every key is then routed elsewhere.
        let (resolved, refs) = medium_call(m, self.medium_drive_io, move |m| {
            let refs: Vec<Option<TransferRef>> = (0..m.buffer_count()).map(|b| m.buffer_ref(b)).collect();
            (m.batch_resolve(&local_keys, false), refs)
        })
        .await
        .unwrap_or_default();
        let mut answers = vec![Here::Missing; local.len()];
        for ((a, (i, _)), r) in answers.iter_mut().zip(local).zip(resolved) {
            if r.busy {
                *a = Here::Busy;
            } else if r.found {
                *a = Here::Found;
                let plan = Planned {
                    index: *i,
                    size: r.size,
                    node: self.config.node_id.clone(),
                    peer: None,
                    lease_end: start + self.config.read_lease,
                    lease: r.lease,
                    backend_id: 0,
                    copied: true,
                };
                self.plan_get(plan, &r.pages, &refs, r.page_size, targets[*i], transfers, planned, results);
            }
        }
        answers
    }

    /// Tells the master, in the background, that `keys` were just read here, so its LRU eviction
    /// sees them as recently used (a local hit skips the route call that would have stamped them).
    /// A hint: dropped when [`TOUCHES_IN_FLIGHT`] hints are already in flight.
    fn touch(&self, keys: Vec<String>) {
        if keys.is_empty() {
            return;
        }
        let Ok(permit) = Arc::clone(&self.touches).try_acquire_owned() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let master = Arc::clone(&self.master);
        runtime.spawn(async move {
            let _permit = permit;
            if let Err(e) = master.batch_route_get(&keys, &[]).await {
                tracing::debug!(error = %e, "access hint for local hits did not reach the master");
            }
        });
    }

    #[expect(clippy::too_many_arguments, reason = "one key's read plan and the round's accumulators")]
    fn plan_get(
        &self,
        plan: Planned,
        pages: &[PageLocation],
        refs: &[Option<TransferRef>],
        page_size: u64,
        target: CallerBuf,
        transfers: &mut Vec<TransferItem>,
        planned: &mut Vec<Planned>,
        results: &mut [Option<Result<u64, KeyError>>],
    ) {
        let (i, size) = (plan.index, plan.size);
        if (target.len as u64) < size {
            results[i] = Some(Err(KeyError::BufferTooSmall { needed: size, got: target.len as u64 }));
            // Kept (uncopied) only so that its lease is released with the round's.
            planned.push(Planned { copied: false, ..plan });
            return;
        }
        let (dst, dst_base) = self.caller_ref(CallerBuf { ptr: target.ptr, len: size as usize });
        match page_items(&dst, dst_base, size, pages, refs, page_size, i as u64, false) {
            Ok(items) => {
                transfers.extend(items);
                planned.push(plan);
            }
            Err(e) => {
                results[i] = Some(Err(KeyError::Failed(format!("malformed pages from {}: {e}", plan.node))));
                planned.push(Planned { copied: false, ..plan });
            }
        }
    }

    /// Resolves `indexes` on `node`: the instant just before the resolve was sent (the lease's
    /// conservative start) and one answer per key.
    ///
    /// A holder that refuses connections (nothing listens at its address: its process is gone)
    /// holds nothing this reader can have: its keys are misses, not errors, and it is left out of
    /// this client's routes for a while (`mark_unreachable`) so the next reads skip it.
    async fn resolve_remote(
        &self,
        keys: &[&str],
        indexes: &[usize],
        node: &str,
        peer: &str,
    ) -> (Instant, Result<Vec<Answer>, KeyError>) {
        let gone = || indexes.iter().map(|_| Answer::Miss).collect();
        let client = match self.peer(node, peer).await {
            Ok(c) => c,
            Err(e) => {
                if refuses_connections(peer, self.config.rpc_timeout).await {
                    return (Instant::now(), Ok(gone()));
                }
                return (Instant::now(), Err(e));
            }
        };
        let omit_descs = self.directory.has_remote_buffers(node);
        let start = Instant::now();
        let decoded = match client.resolve(indexes.iter().map(|i| keys[*i].to_owned()).collect(), omit_descs).await {
            Ok(d) => d,
            Err(e) => {
                // A holder that did not answer is marked by the client; one whose process is gone
                // holds nothing.
                if matches!(e, PeerClientError::Rpc { .. }) && refuses_connections(peer, self.config.rpc_timeout).await
                {
                    return (start, Ok(gone()));
                }
                return (start, Err(unreachable(node, &e)));
            }
        };
        self.directory.replace_remote_buffers(node, &decoded.descs);
        let mut shelves: HashMap<u32, Vec<Option<TransferRef>>> = HashMap::new();
        let found = decoded
            .keys
            .into_iter()
            .zip(decoded.busy)
            .map(|(k, busy)| match k {
                Some(k) => {
                    let refs = shelves
                        .entry(k.backend_id)
                        .or_insert_with(|| self.directory.remote_buffer_snapshot(node, k.backend_id))
                        .clone();
                    Answer::Hit(Hit {
                        size: k.size,
                        pages: k.pages,
                        refs,
                        page_size: decoded.page_size,
                        lease: k.lease,
                        backend_id: k.backend_id,
                    })
                }
                None if busy => Answer::Busy,
                None => Answer::Miss,
            })
            .collect();
        (start, Ok(found))
    }

    /// Queues remotely fetched values for the local medium when the admission policy allows; a full
    /// queue drops the job (counted). Never blocks the caller beyond one copy of the admitted bytes.
    /// A buffer inside a device (non-host) registration is skipped: the CPU cannot read it.
    fn queue_recache(
        &self,
        keys: &[&str],
        bufs: &[CallerBuf],
        results: &[Option<Result<u64, KeyError>>],
        fetched: &[usize],
    ) {
        let tx = self.recache_tx.lock().clone();
        let Some(tx) = tx else { return };
        let admit = |size: u64| match self.config.recache {
            RecachePolicy::Off => false,
            RecachePolicy::UpTo(cap) => size <= cap,
            RecachePolicy::Always => true,
        };
        for i in fetched {
            let Some(Some(Ok(size))) = results.get(*i) else { continue };
            let Some(buf) = bufs.get(*i).filter(|b| *size as usize <= b.len) else { continue };
            if !admit(*size) || self.in_device_registration(*buf) {
                continue;
            }
            let Ok(permit) = tx.try_reserve() else {
                StatCounters::add(&self.stats.recache_dropped, 1);
                continue;
            };
            // SAFETY: `buf` is a caller buffer of this call (a slice it borrows, or a raw range its
            // contract keeps valid until the call returns) that is not device memory registered
            // with this client, so host memory; the value's `size <= len` bytes were just written
            // by the finished transfer, and nothing else writes them during the call.
            let bytes = unsafe { std::slice::from_raw_parts(buf.ptr.as_ptr(), *size as usize) }.to_vec();
            permit.send(RecacheJob { key: keys[*i].to_owned(), bytes });
            StatCounters::add(&self.stats.recache_queued, 1);
        }
    }
}
