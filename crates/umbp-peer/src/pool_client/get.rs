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

use tracing::Instrument;

use super::batch_keyed::Prerouted;
use super::holder::{Answer, Hit, Holder, unreachable};
use super::phases::{self, phase};
use super::ranged::{Dest, range_items};
use super::support::{
    BatchProgress, BusyWait, PageLayout, chunk_by_bytes, join_all, pipelined, refuses_connections, route_by_exclude_set,
};
use super::*;
use crate::peer_client::{LeaseRelease, PeerClientError};

/// A holder to ask: a node and its peer address (this node's own is never dialled: its holder is
/// the medium).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Target {
    node: String,
    peer: String,
}

/// Why a key is asked of a holder, which says what a miss there means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Asked {
    /// This node's medium, before any route: a miss is routed next.
    First,
    /// The master routed the key there, or the holder answered it busy: a miss is a stale route,
    /// re-routed without it.
    Routed,
    /// The master has no route, and this node's medium is the last place to look (a key written
    /// here before the master heard): a miss is final.
    LastResort,
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
    /// Keys answered busy, and the holder to ask again (without a route call).
    retry: Vec<Option<Target>>,
}

impl ChunkState {
    fn new(n: usize) -> Self {
        Self {
            results: vec![None; n],
            exclude: vec![BTreeSet::new(); n],
            last_error: HashMap::new(),
            tries: vec![0; n],
            retry: vec![None; n],
        }
    }

    /// Key `i` was answered busy by `target`: not excluded, asked of it again.
    fn busy(&mut self, i: usize, target: &Target) {
        self.last_error.insert(i, KeyError::Busy { node: target.node.clone() });
        self.retry[i] = Some(target.clone());
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

    /// Whether some key of the chunk waits to ask `node` again.
    fn waits_on(&self, node: &str) -> bool {
        self.retry.iter().flatten().any(|t| t.node == node)
    }
}

/// What one holder answered for the keys asked of it.
struct Resolved {
    /// The instant just before the resolve was sent: the lease's conservative start.
    start: Instant,
    /// The holder, when it could be reached (shared by the reads planned on it).
    holder: Option<Arc<Holder>>,
    /// One answer per key, or why the holder could not answer.
    answers: Result<Vec<Answer>, KeyError>,
}

/// One key's planned read.
struct Planned {
    index: usize,
    size: u64,
    holder: Arc<Holder>,
    lease_end: Instant,
    /// The read lease to release once the copy is done (0: none).
    lease: u64,
    /// The holder's medium that serves the key.
    backend_id: u32,
    /// Whether its copy was submitted (false: the key already failed, e.g. a buffer too small; the
    /// plan is kept only to release its lease).
    copied: bool,
    /// A remote holder's data endpoint (from its descriptors), remembered as the key's location
    /// once the read succeeded, so the next single get of the key is one keyed exchange.
    endpoint: Option<Arc<str>>,
    /// The checksum its writer put with the value: the copy is checked against it.
    crc32c: Option<u32>,
}

/// The keys (batch indexes as transfer tags) of a round whose copies the engine may sum as it
/// copies them: values of this node's own medium with a checksum to check, into whole host
/// buffers. Summing each block right after it lands spares the check a second pass over the copy
/// (a local get with checksums on read 0.57–0.91 of one with them off, docs/benchmarks.md).
type Summable = std::collections::HashSet<u64>;

/// What one round of a chunk plans: the copies to submit and the reads they belong to.
#[derive(Default)]
struct Round {
    transfers: Vec<TransferItem>,
    planned: Vec<Planned>,
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
        self.get_bufs(keys, &targets).instrument(phase!(phases::GET)).await
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
        self.get_bufs(keys, &targets).instrument(phase!(phases::GET)).await
    }

    /// The get path over caller buffers (slices or raw ranges).
    async fn get_bufs(&self, keys: &[&str], targets: &[CallerBuf]) -> Vec<Result<u64, KeyError>> {
        let dests: Vec<Dest<'_>> = targets.iter().map(|b| Dest::Whole(*b)).collect();
        self.get_dests(keys, &dests, &[]).await
    }

    /// The get path over destinations (whole values or ranges); `failed[i]`, when there, is key
    /// `i`'s result already (a bad request found on entry: nothing is read for it).
    pub(super) async fn get_dests(
        &self,
        keys: &[&str],
        targets: &[Dest<'_>],
        failed: &[Option<Result<u64, KeyError>>],
    ) -> Vec<Result<u64, KeyError>> {
        let bufs = targets;
        let gate = self.gate.read().await;
        if *gate {
            return vec![Err(KeyError::Closed); keys.len()];
        }
        // One key: one keyed exchange with its holder when the client knows (or is told) where it
        // is; anything unusual falls back to the routed path below.
        if let ([key], [Dest::Whole(buf)]) = (keys, bufs)
            && let Some(result) = self.get_fast(key, *buf).await
        {
            return vec![result];
        }
        let n = keys.len();
        let mut results: Vec<Option<Result<u64, KeyError>>> = vec![None; n];
        for (i, k) in keys.iter().enumerate() {
            if k.is_empty() {
                results[i] = Some(Err(KeyError::EmptyKey));
            } else if i >= bufs.len() {
                results[i] = Some(Err(KeyError::NoBuffer));
            } else if let Some(Some(r)) = failed.get(i) {
                results[i] = Some(r.clone());
            }
        }
        // Keys held on this host: one exchange per holder chunk (`batch_keyed.rs`); the rest, with
        // any routes asked for them there, take the routed path.
        let prerouted = self.get_same_host(keys, targets, &mut results).await;
        let valid: Vec<usize> = (0..n).filter(|i| results[*i].is_none()).collect();
        // Chunks run as a pipeline: one chunk's route and resolve overlap another's transfer. A
        // destination's length stands for its value's size.
        let chunks = chunk_by_bytes(valid, |i| targets[i].bytes());
        let progress = BatchProgress::new();
        let progress = &progress;
        let prerouted = &prerouted;
        let outcomes = pipelined(&chunks, |chunk| {
            let chunk_keys: Vec<&str> = chunk.iter().map(|i| keys[*i]).collect();
            let chunk_targets: Vec<Dest<'_>> = chunk.iter().map(|i| targets[*i]).collect();
            let routes: Prerouted = chunk.iter().map(|i| prerouted[*i].clone()).collect();
            async move { self.get_chunk(&chunk_keys, &chunk_targets, routes, progress).await }
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
        self.hint_all(local_hits);
        self.queue_recache(keys, targets, &results, &fetched_remote);
        results.into_iter().map(|r| r.unwrap_or(Err(KeyError::Miss))).collect()
    }

    /// Reads one chunk: `keys[j]` into `bufs[j]`, with bounded re-routes (`max_reroutes` per key)
    /// and a bounded wait for holders that answer busy ([`BUSY_WAIT`](super::support::BUSY_WAIT)).
    /// Each round: route → resolve on every holder concurrently → one submit → keep the copies that
    /// ended inside their lease → release.
    /// `routes[j]`, when there, is the master's route for `keys[j]`, asked for already: round 0
    /// uses it instead of routing the key again.
    async fn get_chunk(
        &self,
        keys: &[&str],
        bufs: &[Dest<'_>],
        mut routes: Prerouted,
        progress: &BatchProgress,
    ) -> ChunkRead {
        let n = keys.len();
        let mut st = ChunkState::new(n);
        let mut fetched_remote: Vec<usize> = Vec::new();
        let here = Target { node: self.config.node_id.clone(), peer: String::new() };
        // Local first: what this node holds is read without asking the master (a route call per
        // chunk saved). Misses, and every key on a node without a medium, are routed below, with
        // this node excluded. Their copies join the first round's submit.
        let mut carried = Round::default();
        let mut read_locally = vec![false; n];
        let mut local_hits = Vec::new();
        if self.medium.is_some() {
            let asked: Vec<(usize, Asked)> = (0..n).map(|i| (i, Asked::First)).collect();
            let resolved = self.resolve_at(&here, keys, bufs, &asked).instrument(phase!(phases::GET_LOCAL)).await;
            self.take_answers(&here, &asked, resolved, bufs, &mut st, &mut carried);
            for p in &carried.planned {
                read_locally[p.index] = true;
                local_hits.push(keys[p.index].to_owned());
            }
        }
        // A busy key waits while its holders keep serving this chunk; it gives up after BUSY_WAIT
        // without any progress.
        let mut busy = BusyWait::new(progress);
        let mut round_no = 0usize;
        loop {
            // Round 0 carries the local hits' copies; keys the local medium answered busy wait for
            // round 1 (asking again at once would find it just as busy).
            let pending: Vec<usize> = (0..n)
                .filter(|i| {
                    st.results[*i].is_none() && !(round_no == 0 && (read_locally[*i] || st.retry[*i].is_some()))
                })
                .collect();
            let mut round = std::mem::take(&mut carried);
            if pending.is_empty() && round.planned.is_empty() && st.results.iter().all(Option::is_some) {
                break;
            }
            if round_no > 0 {
                let rerouted = pending.iter().filter(|i| st.retry[**i].is_none()).count();
                StatCounters::add(&self.stats.reroutes, rerouted as u64);
                if pending.iter().any(|i| st.retry[*i].is_some()) {
                    // Someone else's reads hold the holder's staging pages: give them time to copy
                    // and release (bounded backoff), then ask the same holder again. After a round
                    // that read something, this chunk's own releases just freed pages: ask at once.
                    busy.pause().await;
                }
            }
            // Keys a holder answered busy go straight back to it; the rest are routed.
            let mut groups: BTreeMap<Target, Vec<(usize, Asked)>> = BTreeMap::new();
            let mut to_route: Vec<usize> = Vec::new();
            for i in pending {
                match (st.retry[i].take(), routes.get_mut(i).and_then(Option::take)) {
                    (Some(target), _) => groups.entry(target).or_default().push((i, Asked::Routed)),
                    (None, Some(h)) if h.node_id != here.node => {
                        let target = Target { node: h.node_id, peer: h.peer_address };
                        groups.entry(target).or_default().push((i, Asked::Routed));
                    }
                    (None, _) => to_route.push(i),
                }
            }
            self.route_gets(keys, &to_route, &here, &mut st, &mut groups).instrument(phase!(phases::GET_ROUTE)).await;
            // Resolve on every holder concurrently, right before the submit.
            let groups: Vec<(Target, Vec<(usize, Asked)>)> = groups.into_iter().collect();
            let resolved =
                join_all(groups.iter().map(|(target, asked)| self.resolve_at(target, keys, bufs, asked)).collect())
                    .instrument(phase!(phases::GET_RESOLVE))
                    .await;
            for ((target, asked), resolved) in groups.iter().zip(resolved) {
                self.take_answers(target, asked, resolved, bufs, &mut st, &mut round);
            }
            busy.round(round.planned.iter().any(|p| p.copied));
            // This node's own values to check are summed as they are copied (see `Summable`).
            let summable: Summable = round
                .planned
                .iter()
                .filter(|p| p.copied && p.holder.is_here() && p.crc32c.is_some() && self.config.checksums)
                .filter(|p| bufs[p.index].whole().is_some_and(|b| !self.in_device_registration(b)))
                .map(|p| p.index as u64)
                .collect();
            let (failed, ended_at, sums) = self
                .transfer_per_holder(std::mem::take(&mut round.transfers), &round.planned, &summable)
                .instrument(phase!(phases::GET_TRANSFER))
                .await;
            // Every copy of this round is over: its holders may reuse the pages now.
            self.release_reads(keys, &round.planned, &st).instrument(phase!(phases::GET_RELEASE)).await;
            // The copies that arrived in time are checked against their values' checksums, all at
            // once (on several threads for a large round).
            let ended_of = |p: &Planned| ended_at.get(p.holder.node()).copied().unwrap_or_else(|| self.clock.now());
            let arrived: Vec<&Planned> = round
                .planned
                .iter()
                .filter(|p| p.copied && !failed.contains_key(&(p.index as u64)) && ended_of(p) <= p.lease_end)
                .collect();
            // Summed while copied: checked against the writer's sum here.
            let mut intact: HashMap<usize, bool> = HashMap::new();
            for p in &arrived {
                if let (Some(&got), Some(expected)) = (sums.get(&(p.index as u64)), p.crc32c) {
                    let ok = got == expected || self.mismatch(keys[p.index], p.holder.node(), p.size, expected, got);
                    intact.insert(p.index, ok);
                }
            }
            // A ranged read cannot be checked against the whole value's sum: it is not asked.
            let (checked, copies): (Vec<usize>, Vec<_>) = arrived
                .iter()
                .filter(|p| !intact.contains_key(&p.index))
                .filter_map(|p| {
                    let buf = bufs[p.index].whole()?;
                    Some((p.index, (keys[p.index], p.holder.node(), buf, p.size, p.crc32c)))
                })
                .unzip();
            intact.extend(checked.into_iter().zip(self.copies_are_intact(&copies).await));
            for p in round.planned.into_iter().filter(|p| p.copied) {
                let node = p.holder.node().to_owned();
                let ended = ended_at.get(&node).copied().unwrap_or_else(|| self.clock.now());
                if let Some((kind, message)) = failed.get(&(p.index as u64)) {
                    let e = KeyError::Transfer { node: node.clone(), kind: *kind, message: message.clone() };
                    st.last_error.insert(p.index, e);
                    if !p.holder.is_here() {
                        self.forget_peer(&node);
                    }
                    st.exclude[p.index].insert(node);
                } else if ended > p.lease_end {
                    // The pages may have been evicted and reused under the copy: read again.
                    StatCounters::add(&self.stats.lease_lapses, 1);
                    st.exclude[p.index].remove(&node);
                    st.last_error.insert(p.index, KeyError::LeaseExpired { node });
                } else if !intact.get(&p.index).copied().unwrap_or(true) {
                    // Corrupt bytes at that holder (or on the way): never returned. The key is read
                    // from another holder if the master knows one, else it is a miss.
                    st.last_error.insert(p.index, KeyError::Miss);
                } else {
                    st.results[p.index] = Some(Ok(p.size));
                    if !p.holder.is_here() {
                        fetched_remote.push(p.index);
                        if let Some(endpoint) = &p.endpoint {
                            self.locations.insert(keys[p.index], p.holder.node(), endpoint, ended);
                        }
                    }
                }
            }
            let busy_expired = busy.expired();
            let carried_here: &[bool] = if round_no == 0 { &read_locally } else { &[] };
            st.settle_round(carried_here, self.config.max_reroutes, busy_expired);
            round_no += 1;
        }
        let results = st
            .results
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| Err(st.last_error.remove(&i).unwrap_or(KeyError::Miss))))
            .collect();
        ChunkRead { results, fetched_remote, local_hits }
    }

    /// Runs a round's copies, one submit per holder, all at once, and tells when each holder's
    /// copies ended. A key's read lease is judged by its own holder's end: one slow holder (a far or
    /// congested link) must not make the keys of a fast one lapse, as a single submit ending with the
    /// slowest would. The keys in `summable` are copied by an engine that sums what lands, where it
    /// can (their sums are the third answer); the rest are summed afterwards by the caller.
    async fn transfer_per_holder(
        &self,
        transfers: Vec<TransferItem>,
        planned: &[Planned],
        summable: &Summable,
    ) -> (HashMap<u64, (FailureKind, String)>, HashMap<String, Instant>, HashMap<u64, u32>) {
        let holder_of: HashMap<u64, &str> = planned.iter().map(|p| (p.index as u64, p.holder.node())).collect();
        let mut by_holder: BTreeMap<&str, Vec<TransferItem>> = BTreeMap::new();
        for t in transfers {
            by_holder.entry(holder_of.get(&t.tag).copied().unwrap_or_default()).or_default().push(t);
        }
        let runs = by_holder.into_iter().map(|(node, items)| async move {
            let (summed, rest): (Vec<TransferItem>, Vec<TransferItem>) =
                items.into_iter().partition(|t| summable.contains(&t.tag));
            let (mut failed, sums) = self.run_transfers_summed(summed, SumOf::Destination).await;
            failed.extend(self.run_transfers(rest).await);
            (node.to_owned(), failed, self.clock.now(), sums)
        });
        let mut failed = HashMap::new();
        let mut ended = HashMap::new();
        let mut sums = HashMap::new();
        for (node, f, at, s) in join_all(runs.collect()).await {
            failed.extend(f);
            ended.insert(node, at);
            sums.extend(s);
        }
        (failed, ended, sums)
    }

    /// Routes `to_route` at the master (one call per distinct exclude set, concurrently) and adds
    /// each key to the group of the holder it was routed to. A key the master has no route for is
    /// looked for on this node's medium (`here`) as a last resort, unless the node has none or it
    /// was looked for there already: then it is a miss at once.
    async fn route_gets(
        &self,
        keys: &[&str],
        to_route: &[usize],
        here: &Target,
        st: &mut ChunkState,
        groups: &mut BTreeMap<Target, Vec<(usize, Asked)>>,
    ) {
        let unreachable = self.recently_unreachable();
        let routed = route_by_exclude_set(
            to_route,
            |i| st.exclude.get(i),
            &unreachable,
            move |set, indexes| async move {
                let route_keys: Vec<String> = indexes.iter().map(|i| keys[*i].to_owned()).collect();
                self.master.batch_route_get(&route_keys, &set).await
            },
        )
        .await;
        for (i, hit) in routed {
            let (target, asked) = match hit {
                Err(e) => {
                    st.results[i] = Some(Err(e));
                    continue;
                }
                Ok(None) if self.medium.is_none() || st.exclude[i].contains(&here.node) => {
                    st.results[i] = Some(Err(st.last_error.remove(&i).unwrap_or(KeyError::Miss)));
                    continue;
                }
                Ok(None) => (here.clone(), Asked::LastResort),
                Ok(Some(h)) if h.node_id == here.node => (here.clone(), Asked::Routed),
                Ok(Some(h)) => (Target { node: h.node_id, peer: h.peer_address }, Asked::Routed),
            };
            groups.entry(target).or_default().push((i, asked));
        }
    }

    /// Resolves the `asked` keys on `target`, with the byte ranges of those whose destination is
    /// ranged (the holder may answer them partially: an SSD then reads only the blocks they
    /// cover); whole-value keys are asked as before.
    ///
    /// A holder that refuses connections (nothing listens at its address: its process is gone)
    /// holds nothing this reader can have: its keys are misses, not errors (it is left out of this
    /// client's routes for a while, so the next reads skip it).
    async fn resolve_at(
        &self,
        target: &Target,
        keys: &[&str],
        dests: &[Dest<'_>],
        asked: &[(usize, Asked)],
    ) -> Resolved {
        let gone = || asked.iter().map(|_| Answer::Miss).collect();
        let holder = match self.holder(&target.node, &target.peer).await {
            Ok(h) => h,
            Err(e) => {
                let answers =
                    if refuses_connections(&target.peer, self.config.rpc_timeout).await { Ok(gone()) } else { Err(e) };
                return Resolved { start: self.clock.now(), holder: None, answers };
            }
        };
        let start = self.clock.now();
        let ask: Vec<String> = asked.iter().map(|(i, _)| keys[*i].to_owned()).collect();
        let ranges: Vec<Vec<(u64, u64)>> = asked
            .iter()
            .map(|(i, _)| match dests.get(*i) {
                Some(Dest::Ranges(r)) => r.iter().map(|(buf, offset)| (*offset, buf.len as u64)).collect(),
                _ => Vec::new(),
            })
            .collect();
        let answers = match holder.resolve(&self.directory, ask, ranges).await {
            Ok(a) => Ok(a),
            // A holder that did not answer is marked by its client; one whose process is gone
            // holds nothing.
            Err(e @ PeerClientError::Rpc { .. }) => {
                if refuses_connections(&target.peer, self.config.rpc_timeout).await {
                    Ok(gone())
                } else {
                    Err(unreachable(&target.node, e))
                }
            }
            Err(e) => Err(unreachable(&target.node, e)),
        };
        Resolved { start, holder: Some(Arc::new(holder)), answers }
    }

    /// Takes `target`'s answers for the `asked` keys: plans the copies of its hits into `round`
    /// (each under the lease the resolve took), sends busy keys back to it next round, and excludes
    /// it for missed keys (final for a last-resort look).
    fn take_answers(
        &self,
        target: &Target,
        asked: &[(usize, Asked)],
        resolved: Resolved,
        bufs: &[Dest<'_>],
        st: &mut ChunkState,
        round: &mut Round,
    ) {
        let node = &target.node;
        let (answers, holder) = match (resolved.answers, resolved.holder) {
            (Ok(answers), holder) => (answers, holder),
            (Err(e), _) => {
                for (i, _) in asked {
                    st.exclude[*i].insert(node.clone());
                    st.last_error.insert(*i, e.clone());
                }
                return;
            }
        };
        let lease_end = resolved.start + self.config.read_lease;
        for ((i, why), answer) in asked.iter().zip(answers) {
            match answer {
                Answer::Busy => st.busy(*i, target),
                Answer::Miss => {
                    st.exclude[*i].insert(node.clone());
                    match why {
                        Asked::First => {}
                        Asked::Routed => drop(st.last_error.insert(*i, KeyError::Miss)),
                        Asked::LastResort => st.results[*i] = Some(Err(KeyError::Miss)),
                    }
                }
                Answer::Hit(hit) => {
                    st.exclude[*i].insert(node.clone());
                    // A hit always comes with its holder (a gone holder answers only misses).
                    let Some(holder) = &holder else { continue };
                    let endpoint = if holder.is_here() {
                        None
                    } else {
                        hit.pages
                            .first()
                            .and_then(|p| hit.refs.get(p.buffer_index as usize))
                            .and_then(|r| r.as_ref()?.remote().map(|r| Arc::from(r.endpoint.as_str())))
                    };
                    let plan = Planned {
                        index: *i,
                        size: hit.size,
                        holder: Arc::clone(holder),
                        lease_end,
                        lease: hit.lease,
                        backend_id: hit.backend_id,
                        copied: true,
                        endpoint,
                        crc32c: hit.crc32c,
                    };
                    self.plan_get(plan, &hit, bufs[*i], st, round);
                }
            }
        }
    }

    /// Plans one hit's copy into the caller's buffer.
    fn plan_get(&self, plan: Planned, hit: &Hit, dest: Dest<'_>, st: &mut ChunkState, round: &mut Round) {
        let (i, size) = (plan.index, plan.size);
        let buf = match dest {
            Dest::Whole(_) if hit.partial_from.is_some() => {
                // Never asked for (a whole read sends no ranges): its other bytes were never read.
                let node = plan.holder.node();
                st.results[i] = Some(Err(KeyError::Failed(format!("a partial hit from {node} for a whole read"))));
                round.planned.push(Planned { copied: false, ..plan });
                return;
            }
            Dest::Whole(buf) => buf,
            Dest::Ranges(ranges) => {
                let layout = PageLayout {
                    pages: &hit.pages,
                    refs: &hit.refs,
                    page_size: hit.page_size,
                    partial_from: hit.partial_from,
                };
                match range_items(ranges, size, layout, i as u64, |b| self.caller_ref(b)) {
                    Ok(items) => {
                        round.transfers.extend(items);
                        round.planned.push(plan);
                    }
                    Err(message) => {
                        st.results[i] = Some(Err(KeyError::BadRanges { message }));
                        // Kept (uncopied) only so that its lease is released with the round's.
                        round.planned.push(Planned { copied: false, ..plan });
                    }
                }
                return;
            }
        };
        if (buf.len as u64) < size {
            st.results[i] = Some(Err(KeyError::BufferTooSmall { needed: size, got: buf.len as u64 }));
            // Kept (uncopied) only so that its lease is released with the round's.
            round.planned.push(Planned { copied: false, ..plan });
            return;
        }
        let (dst, dst_base) = self.caller_ref(CallerBuf { ptr: buf.ptr, len: size as usize });
        let layout = PageLayout { pages: &hit.pages, refs: &hit.refs, page_size: hit.page_size, partial_from: None };
        match page_items(&dst, dst_base, size, layout, i as u64, false) {
            Ok(items) => {
                round.transfers.extend(items);
                round.planned.push(plan);
            }
            Err(e) => {
                let node = plan.holder.node();
                st.results[i] = Some(Err(KeyError::Failed(format!("malformed pages from {node}: {e}"))));
                round.planned.push(Planned { copied: false, ..plan });
            }
        }
    }

    /// Ends the read leases of `planned` (every copy of the round is over, done or failed): this
    /// node's medium at once, each remote holder with one `ReleaseReads`, in the background (the
    /// caller's result never waits for it) unless the chunk still has keys that holder answered
    /// busy, whose next resolve needs the pages back first.
    async fn release_reads(&self, keys: &[&str], planned: &[Planned], st: &ChunkState) {
        let mut by_holder: BTreeMap<String, (Arc<Holder>, Vec<LeaseRelease>)> = BTreeMap::new();
        for p in planned.iter().filter(|p| p.lease != 0) {
            let reads = &mut by_holder
                .entry(p.holder.node().to_owned())
                .or_insert_with(|| (Arc::clone(&p.holder), Vec::new()))
                .1;
            reads.push(LeaseRelease { key: keys[p.index].to_owned(), lease: p.lease, backend_id: p.backend_id });
        }
        let mut waited = Vec::new();
        for (node, (holder, reads)) in by_holder {
            if holder.is_here() {
                holder.release(reads).await;
                continue;
            }
            // Only over a connection still open: a holder that failed does not hold this round up
            // (its leases expire instead).
            if self.peers.open(&node).is_none() {
                continue;
            }
            let send = async move { holder.release(reads).await };
            if st.waits_on(&node) {
                waited.push(send);
            } else {
                self.releases.spawn(send);
            }
        }
        join_all(waited).await;
    }

    /// Queues remotely fetched values for the local medium when the admission policy allows; a full
    /// queue drops the job (counted). Never blocks the caller beyond one copy of the admitted bytes.
    /// A buffer inside a device (non-host) registration is skipped: the CPU cannot read it.
    fn queue_recache(
        &self,
        keys: &[&str],
        bufs: &[Dest<'_>],
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
            let Some(buf) = bufs.get(*i).and_then(|d| d.whole()).filter(|b| *size as usize <= b.len) else { continue };
            if !admit(*size) || self.in_device_registration(buf) {
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
            // The value is about to live here too: the next get finds it locally (routed path).
            self.locations.forget(keys[*i]);
            StatCounters::add(&self.stats.recache_queued, 1);
        }
    }
}
