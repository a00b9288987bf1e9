//! Batch puts to holders on this host in one exchange per holder chunk (issue 17).
//!
//! A client that lends no medium routes its keys at the master (one call per [`ROUTE_KEYS`] keys:
//! the master's placement and cross-node dedup are kept), then sends each same-host holder one
//! PUT_KEYS per chunk (`KeyedClient::put_shared_batch`): the holder allocates every slot, the
//! client copies the values in through its mappings, the holder commits what arrived before each
//! slot's end. A key written so is remembered as located there (a later get of it skips the
//! master). Every other key — routed to another host, refused, failed — takes the routed path; a
//! routed-elsewhere or busy key keeps its route there (no second route call), a refused one is
//! routed afresh. A put's chunks are a get's: two large ones in flight, each one exchange whose
//! writes fan out over every core ([`Spread`]).
//!
//! **Copying while the master routes.** The route call is the one step before which nothing can
//! be copied: 0.6–1.2 ms for a 64 MiB batch of 64 keys on the 2-core VM, 15–25 % of the batch.
//! - A client whose last batch went wholly to one holder here ([`SoleHolder`]: at least
//!   [`SOLE_AFTER_KEYS`] keys, every one written or already present there) starts every chunk's
//!   exchange with that holder at once, beside one route call for the whole batch. Each chunk's
//!   thread copies its values in, then waits for the route ([`RouteGate`]) and commits only the
//!   keys the master placed on that holder (`KeyedClient::put_shared_batch_confirmed`); the rest
//!   are withdrawn (their slots aborted) and settled as the master said — already present, or left
//!   to the routed path with their route. So the master still decides every placement and dedup;
//!   only the copy starts early. Any key neither written nor found there (placed elsewhere,
//!   present elsewhere and so copied for nothing, refused) ends the streak: the next batch routes
//!   first, so a stream of re-puts of keys held elsewhere is not copied key by key.
//! - Otherwise the first chunk's keys are routed in a call of their own, so their copies start
//!   while the master routes the rest.
//!
//! A host with several holders a client's keys spread over (one per GPU rank) never starts the
//! streak, so no bytes are copied twice there; a host with one holder copies at once.

use std::collections::BTreeMap;
use std::time::Duration;

use parking_lot::Condvar;
use tracing::Instrument;
use umbp_transfer::{KeyedBatchPut, KeyedError, KeyedPut, PutChecksum};

use super::batch_keyed::{ROUTE_KEYS, Spread};
use super::phases::{self, phase};
use super::ranged::Src;
use super::support::{StatCounters, offload_early, pipelined_with};
use super::*;
use crate::master_client::RoutePutDecision;

/// The master's placements for keys a same-host put left to the routed path (by batch index):
/// `(node, peer address, tier)`.
pub(super) type PutRoutes = Vec<Option<PutRoute>>;

/// A put holder: its node, data endpoint, peer address and tier.
type PutHolder = (String, String, String, TierType);
/// A placement for the routed path: `(node, peer address, tier)` (see [`PutRoutes`]).
type PutRoute = (String, String, TierType);
/// What a put settled for one key: its result, its placement for the routed path.
type PutSettled = (Option<Result<PutOutcome, KeyError>>, Option<PutRoute>);
/// What a put settled, by batch index (`None`: a key it did not take). Dense rather than a map:
/// a batch of 1,024 keys settles every one of them on the path its caller waits on.
type Settled = Vec<Option<PutSettled>>;
/// Each chunk: its holder and its keys (batch indexes).
type HolderChunks = Vec<(PutHolder, Vec<usize>)>;
/// A chunk's exchange: the holder's node and endpoint and its answers (`None`: the work panicked).
type ChunkAnswer<'a> = (&'a String, &'a String, Option<Result<Vec<KeyedPut>, KeyedError>>);

/// The fewest keys a batch must have written on one holder here to start the streak (a batch of
/// a few keys lands on one of several holders by chance).
pub(super) const SOLE_AFTER_KEYS: usize = 4;
/// The longest a chunk's thread waits for the route before it withdraws its keys: well past a
/// route call's own deadline, well inside a slot's life.
const ROUTE_WAIT: Duration = Duration::from_secs(10);

/// The same-host holder every key of this client's last same-host put batch went to, if any
/// (see the module docs).
#[derive(Debug, Default)]
pub(super) struct SoleHolder(Mutex<Option<PutHolder>>);

/// How one batch's keys went, for [`SoleHolder`].
#[derive(Debug, Clone, PartialEq)]
enum Streak {
    /// No key reached a holder here (all already present, say): says nothing.
    Silent,
    /// Every key that reached a holder here went to this one and was written or found there.
    One(PutHolder, usize),
    /// Keys went elsewhere, or were refused: route first next time.
    Broken,
}

impl Streak {
    fn and(self, other: Streak) -> Streak {
        match (self, other) {
            (Streak::Silent, s) | (s, Streak::Silent) => s,
            (Streak::One(a, n), Streak::One(b, m)) if a == b => Streak::One(a, n + m),
            _ => Streak::Broken,
        }
    }
}

impl SoleHolder {
    fn get(&self) -> Option<PutHolder> {
        self.0.lock().clone()
    }

    fn record(&self, streak: Streak) {
        let mut sole = self.0.lock();
        match streak {
            Streak::Silent => {}
            Streak::One(holder, written) if written >= SOLE_AFTER_KEYS => *sole = Some(holder),
            Streak::One(holder, _) if sole.as_ref() == Some(&holder) => {}
            Streak::One(..) | Streak::Broken => *sole = None,
        }
    }
}

/// The route of a batch copied ahead of it: the chunks' threads wait here for which keys (by batch
/// index) the master placed on their holder. Opened once; dropped unopened, it opens with none
/// confirmed (the batch was abandoned), so no thread waits for a route that will not come.
#[derive(Debug, Default)]
struct RouteGate {
    confirmed: Mutex<Option<Arc<[bool]>>>,
    opened: Condvar,
}

impl RouteGate {
    fn open(&self, confirmed: Vec<bool>) {
        let mut slot = self.confirmed.lock();
        if slot.is_none() {
            *slot = Some(confirmed.into());
        }
        self.opened.notify_all();
    }

    /// Whether each of `indexes` is confirmed, once the gate is open (none, after [`ROUTE_WAIT`]).
    fn wait(&self, indexes: &[usize]) -> Vec<bool> {
        let mut slot = self.confirmed.lock();
        let until = std::time::Instant::now() + ROUTE_WAIT;
        while slot.is_none() {
            if self.opened.wait_until(&mut slot, until).timed_out() {
                tracing::debug!("no route within {ROUTE_WAIT:?}; withdrawing the keys copied ahead");
                return vec![false; indexes.len()];
            }
        }
        let confirmed = slot.as_ref().map(Arc::clone).unwrap_or_else(|| Arc::from(Vec::new()));
        indexes.iter().map(|i| confirmed.get(*i).copied().unwrap_or(false)).collect()
    }
}

/// Opens its gate with none confirmed if it was not opened before it is dropped.
struct OpenOnDrop(Arc<RouteGate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open(Vec::new());
    }
}

impl PoolClient {
    /// Writes what it can of a batch's distinct keys (`unique`) to holders on this host (see the
    /// module docs), setting `results[i]` for each key it settled; the keys it leaves `None` take
    /// the routed path, with the placements it asked the master for (see [`PutRoutes`]).
    pub(super) async fn put_same_host(
        &self,
        items: &[(&str, Src<'_>)],
        unique: &[usize],
        results: &mut [Option<Result<PutOutcome, KeyError>>],
    ) -> PutRoutes {
        let mut routes: PutRoutes = vec![None; items.len()];
        if !self.config.keyed_requests || !self.config.shared_memory || self.medium.is_some() {
            return routes;
        }
        let candidates: Vec<usize> = unique
            .iter()
            .copied()
            .filter(|i| matches!(items[*i].1, Src::Whole(b) if b.len > 0 && !self.in_device_registration(b)))
            .collect();
        if candidates.is_empty() {
            return routes;
        }
        let total: u64 = candidates.iter().map(|i| items[*i].1.size()).sum();
        let spread = Spread::fanned(total);
        // Copies ahead block their threads until the route returns: only where they run on the
        // blocking pool, never inline in the task that drives the route (no runtime).
        let ahead = self.sole_put_holder.get().filter(|_| tokio::runtime::Handle::try_current().is_ok());
        let (settled, streak) = match ahead {
            Some(holder) => self.put_ahead(items, &candidates, &spread, holder).await,
            None => {
                let mut bytes = 0u64;
                let first = candidates
                    .iter()
                    .position(|i| {
                        bytes += items[*i].1.size();
                        bytes >= spread.chunk_bytes
                    })
                    .map_or(candidates.len(), |at| at + 1);
                let (head, rest) = candidates.split_at(first);
                let ((head, a), (rest, b)) =
                    tokio::join!(self.put_group(items, head, &spread), self.put_group(items, rest, &spread));
                // The groups' keys are disjoint.
                (head.into_iter().zip(rest).map(|(h, r)| h.or(r)).collect(), a.and(b))
            }
        };
        self.sole_put_holder.record(streak);
        for (i, (result, route)) in settled.into_iter().enumerate().filter_map(|(i, s)| Some((i, s?))) {
            if result.is_some() {
                results[i] = result;
            }
            routes[i] = route;
        }
        routes
    }

    /// Routes `keys` (batch indexes) in calls of [`ROUTE_KEYS`] and writes those placed on a holder
    /// on this host with one PUT_KEYS per chunk; per key: its result if settled here, and the
    /// placement the routed path is to use (`None`: routed afresh).
    async fn put_group(&self, items: &[(&str, Src<'_>)], keys: &[usize], spread: &Spread) -> (Settled, Streak) {
        let mut out: Settled = vec![None; items.len()];
        if keys.is_empty() {
            return (out, Streak::Silent);
        }
        let Some(decisions) = self.route_group(items, keys).await else {
            return (out, Streak::Broken);
        };
        let mut by_holder: BTreeMap<PutHolder, Vec<usize>> = BTreeMap::new();
        let mut elsewhere = false;
        for (i, decision) in decisions {
            match decision {
                RoutePutDecision::AlreadyExists => {
                    out[i] = Some((Some(Ok(PutOutcome::AlreadyPresent)), None));
                }
                RoutePutDecision::Routed { node_id, tier, peer_address, data_endpoint } => {
                    out[i] = Some((None, Some((node_id.clone(), peer_address.clone(), tier))));
                    if !data_endpoint.is_empty() && node_id != self.config.node_id {
                        by_holder.entry((node_id, data_endpoint, peer_address, tier)).or_default().push(i);
                    } else {
                        elsewhere = true;
                    }
                }
                // No room: the routed path makes room.
                RoutePutDecision::Unavailable => elsewhere = true,
            }
        }
        let chunks = holder_chunks(items, by_holder, spread);
        let answers = self.put_chunks(items, &chunks, spread, None).await;
        let streak = self.settle_chunks(&chunks, answers, &mut out, None);
        (out, if elsewhere { Streak::Broken } else { streak })
    }

    /// Copies every key of `keys` into `holder` while the master routes them (see the module
    /// docs); settles each key as [`put_group`](Self::put_group) does.
    async fn put_ahead(
        &self,
        items: &[(&str, Src<'_>)],
        keys: &[usize],
        spread: &Spread,
        holder: PutHolder,
    ) -> (Settled, Streak) {
        let gate = Arc::new(RouteGate::default());
        let chunks = holder_chunks(items, BTreeMap::from([(holder.clone(), keys.to_vec())]), spread);
        let route = {
            // Dropped with the batch (or once opened): no thread waits for this route then.
            let opener = OpenOnDrop(Arc::clone(&gate));
            let holder = &holder;
            async move {
                let decisions = self.route_group(items, keys).await;
                // Placed on the holder and on the tier its slots were allocated in (a key placed
                // elsewhere, another tier included, is written there by the routed path).
                let mut placed_here = vec![false; items.len()];
                for (i, d) in decisions.iter().flatten() {
                    placed_here[*i] = matches!(d, RoutePutDecision::Routed { node_id, tier, .. }
                        if *node_id == holder.0 && *tier == holder.3);
                }
                opener.0.open(placed_here.clone());
                (decisions, placed_here)
            }
        };
        // The chunks first: their exchanges are on their threads before this task spends its time
        // on the route call's request.
        let (answers, (decisions, placed_here)) =
            tokio::join!(self.put_chunks(items, &chunks, spread, Some(&gate)), route);
        let mut out: Settled = vec![None; items.len()];
        // A failed route withdrew every copy: each key is routed afresh (and counted withdrawn).
        let mut elsewhere = decisions.is_none();
        for (i, decision) in decisions.into_iter().flatten() {
            match decision {
                RoutePutDecision::AlreadyExists => {
                    out[i] = Some((Some(Ok(PutOutcome::AlreadyPresent)), None));
                }
                RoutePutDecision::Routed { node_id, tier, peer_address, .. } => {
                    elsewhere |= !placed_here[i];
                    out[i] = Some((None, Some((node_id, peer_address, tier))));
                }
                RoutePutDecision::Unavailable => elsewhere = true,
            }
        }
        let streak = self.settle_chunks(&chunks, answers, &mut out, Some(&placed_here));
        (out, if elsewhere { Streak::Broken } else { streak })
    }

    /// The master's placement of each of `keys`, in calls of [`ROUTE_KEYS`]; `None` if a call
    /// failed (the routed path then routes every key afresh).
    async fn route_group(&self, items: &[(&str, Src<'_>)], keys: &[usize]) -> Option<Vec<(usize, RoutePutDecision)>> {
        let unreachable = self.recently_unreachable();
        let mut decisions = Vec::with_capacity(keys.len());
        for part in keys.chunks(ROUTE_KEYS) {
            let names: Vec<String> = part.iter().map(|i| items[*i].0.to_owned()).collect();
            let sizes: Vec<u64> = part.iter().map(|i| items[*i].1.size()).collect();
            let routed =
                self.master.batch_route_put(&names, &sizes, &unreachable).instrument(phase!(phases::PUT_ROUTE)).await;
            decisions.extend(part.iter().copied().zip(routed.ok()?));
        }
        Some(decisions)
    }

    /// One PUT_KEYS per chunk, [`Spread::depth`] in flight, each chunk's values copied (and
    /// summed) over the kept copy pool; with `gate`, each chunk commits only the keys the gate
    /// confirms.
    async fn put_chunks<'c>(
        &self,
        items: &[(&str, Src<'_>)],
        chunks: &'c HolderChunks,
        spread: &Spread,
        gate: Option<&Arc<RouteGate>>,
    ) -> Vec<ChunkAnswer<'c>> {
        let order: Vec<Vec<usize>> = (0..chunks.len()).map(|c| vec![c]).collect();
        pipelined_with(spread.depth, &order, |c| async move {
            let ((node, endpoint, _, tier), indexes) = &chunks[c[0]];
            let values: Vec<(String, CallerBuf)> = indexes
                .iter()
                .filter_map(|i| match items[*i].1 {
                    Src::Whole(b) => Some((items[*i].0.to_owned(), b)),
                    Src::Ranges { .. } => None,
                })
                .collect();
            let keyed = Arc::clone(&self.keyed);
            let at = endpoint.clone();
            let wire_tier = u64::from(tier.wire());
            let gate = gate.map(Arc::clone);
            let indexes = indexes.clone();
            // Each value is summed as it is copied in: each block right after its copy, while it
            // is still in L2, so a value is read once (summing it first, then copying it, read it
            // twice: checksums on/off 0.61–0.72 for these puts on the 2-core VM).
            let checksum = if self.config.checksums { PutChecksum::WhileCopying } else { PutChecksum::None };
            let (locations, clock) = (Arc::clone(&self.locations), Arc::clone(&self.clock));
            let held_by: (Arc<str>, Arc<str>) = (node.as_str().into(), endpoint.as_str().into());
            let got = offload_early(move |early| {
                let batch: Vec<KeyedBatchPut<'_>> = values
                    .iter()
                    .map(|(key, buf)| {
                        // SAFETY: a caller buffer of this call (a slice it borrows, or a raw range
                        // its contract keeps valid and unwritten until the call returns), host
                        // memory (checked above); only read, and the offloaded work is waited for,
                        // even if the call is dropped, until its answer is sent (`offload_early`);
                        // `batch` is gone by then.
                        let value = unsafe { std::slice::from_raw_parts(buf.ptr.as_ptr().cast_const(), buf.len) };
                        KeyedBatchPut { key, value, checksum }
                    })
                    .collect();
                let got = match gate {
                    Some(gate) => keyed.put_shared_batch_confirmed(&at, wire_tier, &batch, &mut || gate.wait(&indexes)),
                    None => keyed.put_shared_batch(&at, wire_tier, &batch),
                };
                drop(batch);
                // Written means kept there (committed, and placed there when copied ahead). Their
                // locations are recorded after the answer is sent: the batch's end, which the
                // caller waits for, takes no pass over its keys (a get racing this finds no
                // location and routes, as before the put).
                let kept: Vec<usize> = match &got {
                    Ok(answers) => (0..answers.len()).filter(|&j| answers[j] == KeyedPut::Written).collect(),
                    Err(_) => Vec::new(),
                };
                early.send(got);
                let (node, endpoint) = &held_by;
                locations.insert_many(kept.into_iter().map(|j| (values[j].0.as_str(), node, endpoint)), clock.now());
            })
            .await;
            (node, endpoint, got)
        })
        .instrument(phase!(phases::PUT_KEYED))
        .await
    }

    /// Settles each key of `chunks` from its holder's answer, into `out` (which holds its route);
    /// says how the batch went for [`SoleHolder`]. Copied ahead, only the keys `ahead` says the
    /// master placed on the holder (by batch index) are settled: the rest were withdrawn.
    fn settle_chunks(
        &self,
        chunks: &HolderChunks,
        answers: Vec<ChunkAnswer<'_>>,
        out: &mut Settled,
        ahead: Option<&[bool]>,
    ) -> Streak {
        let placed = |i: usize| ahead.is_none_or(|placed| placed.get(i).copied().unwrap_or(false));
        let mut streak = Streak::Silent;
        for ((holder, indexes), (node, endpoint, got)) in chunks.iter().zip(answers) {
            let answers = match got {
                Some(Ok(answers)) if answers.len() == indexes.len() => answers,
                Some(Err(e)) => {
                    // Whether the holder committed any of them is unknown: the routed path finds
                    // out (a committed key is answered as present).
                    tracing::debug!(node = %node, error = %e, "batched same-host put failed; taking the routed path");
                    if e.is_unreachable() {
                        self.forget_holder(node, endpoint);
                    }
                    for i in indexes.iter().filter(|i| placed(**i)) {
                        out[*i] = Some((None, None));
                    }
                    streak = Streak::Broken;
                    continue;
                }
                _ => {
                    streak = Streak::Broken;
                    continue;
                }
            };
            let (mut written, mut withdrawn) = (0u64, 0u64);
            let mut kept = 0usize;
            for (i, answer) in indexes.iter().zip(answers) {
                if !placed(*i) {
                    withdrawn += u64::from(answer == KeyedPut::Withdrawn);
                    continue;
                }
                let settled = match answer {
                    // Its location was recorded by the chunk's work (`put_chunks`).
                    KeyedPut::Written => {
                        written += 1;
                        Some(Ok(PutOutcome::Written))
                    }
                    KeyedPut::Exists => Some(Ok(PutOutcome::AlreadyPresent)),
                    // The routed path asks the same node (it waits for a busy one).
                    KeyedPut::Busy | KeyedPut::Unsupported => None,
                    // Routed afresh (a withdrawn key was confirmed here: it cannot be, but is
                    // then not stored).
                    KeyedPut::NoSpace | KeyedPut::Failed | KeyedPut::Withdrawn => {
                        out[*i] = Some((None, None));
                        None
                    }
                };
                if settled.is_some() {
                    kept += 1;
                } else {
                    streak = Streak::Broken;
                }
                if let (Some(result), Some(Some(entry))) = (settled, out.get_mut(*i)) {
                    entry.0 = Some(result);
                }
            }
            StatCounters::add(&self.stats.keyed_puts, written);
            if ahead.is_some() {
                StatCounters::add(&self.stats.puts_copied_ahead, written);
                StatCounters::add(&self.stats.puts_withdrawn, withdrawn);
                // Copied for nothing (present elsewhere, say): route first until a batch again
                // goes wholly to one holder, so re-puts of present keys are not all copied.
                if withdrawn > 0 {
                    streak = Streak::Broken;
                }
            }
            if kept > 0 {
                streak = streak.and(Streak::One(holder.clone(), kept));
            }
        }
        streak
    }
}

/// Cuts each holder's keys into chunks of [`Spread::chunk_bytes`] (at most
/// `KeyedClient::MAX_BATCH_KEYS` keys each).
fn holder_chunks(
    items: &[(&str, Src<'_>)],
    by_holder: BTreeMap<PutHolder, Vec<usize>>,
    spread: &Spread,
) -> HolderChunks {
    spread.cut(by_holder, |i| items[*i].1.size())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(node: &str) -> PutHolder {
        (node.into(), format!("{node}:1"), format!("{node}:2"), TierType::Dram)
    }

    #[test]
    fn a_streak_starts_only_with_enough_keys_on_one_holder() {
        let sole = SoleHolder::default();
        sole.record(Streak::One(holder("a"), SOLE_AFTER_KEYS - 1));
        assert_eq!(sole.get(), None, "a few keys on one holder may be chance");
        sole.record(Streak::One(holder("a"), SOLE_AFTER_KEYS));
        assert_eq!(sole.get(), Some(holder("a")));
        // A small batch to the same holder keeps it; silence says nothing.
        sole.record(Streak::One(holder("a"), 1));
        sole.record(Streak::Silent);
        assert_eq!(sole.get(), Some(holder("a")));
        // A small batch to another holder, or any key elsewhere, ends it.
        sole.record(Streak::One(holder("b"), 1));
        assert_eq!(sole.get(), None);
        sole.record(Streak::One(holder("b"), SOLE_AFTER_KEYS));
        sole.record(Streak::Broken);
        assert_eq!(sole.get(), None);
    }

    #[test]
    fn streaks_of_two_holders_are_broken() {
        assert_eq!(Streak::One(holder("a"), 2).and(Streak::One(holder("a"), 3)), Streak::One(holder("a"), 5));
        assert_eq!(Streak::One(holder("a"), 2).and(Streak::One(holder("b"), 3)), Streak::Broken);
        assert_eq!(Streak::Silent.and(Streak::One(holder("a"), 2)), Streak::One(holder("a"), 2));
        assert_eq!(Streak::Broken.and(Streak::Silent), Streak::Broken);
    }

    #[test]
    fn a_gate_confirms_what_it_was_opened_with_and_an_abandoned_one_nothing() {
        let gate = Arc::new(RouteGate::default());
        let waiter = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || gate.wait(&[0, 2, 5]))
        };
        gate.open(vec![true, false, true]);
        gate.open(vec![false; 3]); // only the first opening counts
        assert_eq!(waiter.join().expect("waiter"), vec![true, true, false]);

        let gate = Arc::new(RouteGate::default());
        let waiter = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || gate.wait(&[0, 1]))
        };
        drop(OpenOnDrop(Arc::clone(&gate)));
        assert_eq!(waiter.join().expect("waiter"), vec![false, false]);
    }
}
