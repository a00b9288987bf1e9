//! Batch gets and puts with holders on this host in one exchange per holder chunk (issue 17).
//!
//! The routed path pays, per pipelined chunk, a route call to the master, a resolve RPC to each
//! holder and a release RPC — each a gRPC round trip of ~150–250 µs on a 16-core host, while the
//! copy of an 8 MiB chunk at memory speed takes ~0.2 ms. For keys whose holder is on this host
//! (its shared-memory server answers), a batch get instead sends each holder one GET_KEYS per
//! chunk (`umbp_transfer`'s `KeyedClient::get_shared_batch`): the holder resolves every key under
//! its read lease and answers where the values lie in its shared memory, the client copies them
//! from its own mappings and ends every lease with one settle frame, all on one connection.
//! A get's chunks are large but the first (a small first chunk's answer is copied while the
//! rest resolve), four in flight, and each chunk's copies fan out over every core
//! (`umbp_transfer`'s kept copy pool): the exchange is paid once per chunk while all cores copy.
//! A put's chunks are halves of the batch, fanned out alike ([`Spread`]).
//!
//! - **Where the keys are**: the client's location cache (as the single-key path); a client that
//!   lends no medium asks the master once for the keys it has no location for (one route call per
//!   [`ROUTE_KEYS`] keys, which also stamps the master's LRU). A node with a medium of its own uses
//!   cached locations only: its routed path looks at its own medium first.
//! - **What it keeps**: a key is a hit only if its copy ended inside the holder's lease (measured
//!   from before the request left) and inside this client's `read_lease`, and its bytes match the
//!   checksum it was put with. Cache hits are told to the master's LRU in batched hints.
//! - **What it leaves**: every other key — a miss at the cached holder, busy, lapsed, a holder
//!   elsewhere or without the path, a value it cannot map, a corrupt copy, a failed exchange — goes
//!   on to the routed path, which keeps all of its rules. A too-small buffer is that key's error.
//! - **No re-cache**: a value read from a holder on this host is already in this host's memory.
//!
//! **Puts** to holders on this host take the same kind of exchange: see `same_host_put.rs`.

use std::collections::BTreeMap;

use tracing::Instrument;
use umbp_transfer::{KeyedBatchItem, KeyedClient, KeyedGet};

use super::phases::{self, phase};
use super::ranged::Dest;
use super::support::{StatCounters, offload_early, pipelined_with};
use super::*;
use crate::master_client::RouteGetHit;

/// Keys per route call for the keys a light client has no location for.
pub(super) const ROUTE_KEYS: usize = 4096;
/// The smallest chunk a same-host batch is cut into (see [`Spread`]).
const MIN_CHUNK_BYTES: u64 = 1 << 20;
/// The largest chunk of a same-host batch (see [`Spread`]).
const CHUNK_BYTES: u64 = 32 << 20;
/// A get's chunks in flight at once (see [`Spread::ramped`]).
const GET_DEPTH: usize = 4;

/// How a same-host batch is cut and run. A chunk is one exchange with its holder (GET_KEYS or
/// PUT_KEYS), and its copies fan out over every core inside it (`umbp_transfer`'s kept copy
/// pool), so chunks are large — up to half the batch, at most [`CHUNK_BYTES`] — and several are
/// in flight: one's exchange overlaps the others' copies. (Before, a batch was cut into one chunk
/// per core, each copied on its own thread: on the 16-core host each of 16 chunks of 4 MiB waited
/// ~0.1–0.3 ms for a thread and ~0.1–0.5 ms for its exchange, beside ~1.3 ms of copying.)
pub(super) struct Spread {
    /// The largest chunk.
    pub(super) chunk_bytes: u64,
    /// A holder's first chunk; each next is twice the one before, up to `chunk_bytes`.
    first_bytes: u64,
    /// Chunks in flight at once.
    pub(super) depth: usize,
}

impl Spread {
    /// A put's: chunks of half the batch (at most [`CHUNK_BYTES`]), two in flight.
    pub(super) fn fanned(total_bytes: u64) -> Self {
        let chunk_bytes = (total_bytes / 2).clamp(MIN_CHUNK_BYTES, CHUNK_BYTES);
        Self { chunk_bytes, first_bytes: chunk_bytes, depth: 2 }
    }

    /// A get's: the first chunk an eighth of the batch (at most a quarter of the largest), each
    /// next twice the one before up to half the batch (at most [`CHUNK_BYTES`]), [`GET_DEPTH`] in
    /// flight — a batch of 64 MiB goes as chunks of 8, 16, 32 and 8 MiB, all at once. Nothing is
    /// copied before the first answer: the holder's answer to a small chunk comes back first
    /// (its resolve costs ~1–3 µs a key on the 16-core host) and the cores copy it while the
    /// larger ones are resolved. Against two halves in flight, 64 MiB gets on the 16-core host
    /// ran ~8–12 % faster with 1 MiB values and ~12 % with 64 KiB ones (`docs/benchmarks.md`).
    pub(super) fn ramped(total_bytes: u64) -> Self {
        let chunk_bytes = (total_bytes / 2).clamp(MIN_CHUNK_BYTES, CHUNK_BYTES);
        let first_bytes = (total_bytes / 8).min(chunk_bytes / 4).max(MIN_CHUNK_BYTES).min(chunk_bytes);
        Self { chunk_bytes, first_bytes, depth: GET_DEPTH }
    }

    /// The bytes a holder's chunk `n` (0 the first) is closed at.
    pub(super) fn chunk_limit(&self, n: usize) -> u64 {
        let doublings = u32::try_from(n).unwrap_or(u32::MAX).min(u64::BITS - 1);
        self.first_bytes.saturating_mul(1 << doublings).min(self.chunk_bytes)
    }

    /// Cuts each holder's keys, in order, into chunks of at most
    /// [`chunk_limit`](Self::chunk_limit) bytes (a chunk closes at the value that reaches it)
    /// and `KeyedClient::MAX_BATCH_KEYS` keys; `bytes` tells a key's size.
    pub(super) fn cut<H: Clone, K>(
        &self,
        by_holder: impl IntoIterator<Item = (H, Vec<K>)>,
        bytes: impl Fn(&K) -> u64,
    ) -> Vec<(H, Vec<K>)> {
        let mut chunks = Vec::new();
        for (holder, keys) in by_holder {
            let (mut chunk, mut filled, mut n) = (Vec::new(), 0u64, 0);
            for key in keys {
                filled += bytes(&key);
                chunk.push(key);
                if filled >= self.chunk_limit(n) || chunk.len() == KeyedClient::MAX_BATCH_KEYS {
                    chunks.push((holder.clone(), std::mem::take(&mut chunk)));
                    (filled, n) = (0, n + 1);
                }
            }
            if !chunk.is_empty() {
                chunks.push((holder, chunk));
            }
        }
        chunks
    }
}

/// One key to read over GET_KEYS: its index in the batch, its destination, and whether its
/// location came from the cache (then the master hears of the read in a hint).
struct Planned {
    index: usize,
    buf: CallerBuf,
    cached: bool,
}

/// The master's routes for keys routed here and left to the routed path (by batch index), which
/// then uses them instead of routing those keys again.
pub(super) type Prerouted = Vec<Option<RouteGetHit>>;

/// A holder: its node and its data endpoint.
type HolderId = (Arc<str>, Arc<str>);
/// Each holder's keys.
type ByHolder = BTreeMap<HolderId, Vec<Planned>>;

impl PoolClient {
    /// Reads what it can of a batch from holders on this host (see the module docs), setting
    /// `results[i]` for each key it settled; the keys it leaves `None` take the routed path, with
    /// the routes it asked the master for (see [`Prerouted`]).
    pub(super) async fn get_same_host(
        &self,
        keys: &[&str],
        targets: &[Dest<'_>],
        results: &mut [Option<Result<u64, KeyError>>],
    ) -> Prerouted {
        let mut prerouted: Prerouted = vec![None; keys.len()];
        if !self.config.keyed_requests || !self.config.shared_memory {
            return prerouted;
        }
        let now = self.clock.now();
        let mut by_holder = ByHolder::new();
        let mut unplaced: Vec<(usize, CallerBuf)> = Vec::new();
        // Found locations are refreshed now: the batch's end does not revisit its keys.
        let located = self.locations.get_many_refreshed(keys, now);
        for (i, location) in located.into_iter().enumerate() {
            let Some(buf) = targets.get(i).and_then(Dest::whole) else { continue };
            if results[i].is_some() || self.in_device_registration(buf) {
                continue;
            }
            match location {
                Some((node, endpoint)) => {
                    by_holder.entry((node, endpoint)).or_default().push(Planned { index: i, buf, cached: true });
                }
                None if self.medium.is_none() => unplaced.push((i, buf)),
                None => {}
            }
        }
        if !unplaced.is_empty() {
            self.route_same_host(keys, unplaced, &mut by_holder, &mut prerouted)
                .instrument(phase!(phases::GET_ROUTE))
                .await;
        }
        if by_holder.is_empty() {
            return prerouted;
        }
        // Chunks of at most MAX_BATCH_KEYS keys, each one GET_KEYS whose copies fan out (see
        // `Spread`).
        let total: u64 = by_holder.values().flatten().map(|p| p.buf.len as u64).sum();
        let spread = Spread::ramped(total);
        // A batch too large for the cache to keep is written past it (`KeyedBatchItem::stream`).
        let stream = total >= umbp_transfer::stream_threshold();
        let chunks = spread.cut(by_holder, |p: &Planned| p.buf.len as u64);
        let order: Vec<Vec<usize>> = (0..chunks.len()).map(|c| vec![c]).collect();
        let chunks = &chunks;
        let exchanges = pipelined_with(spread.depth, &order, |c| async move {
            let ((node, endpoint), planned) = &chunks[c[0]];
            let items: Vec<(String, CallerBuf)> = planned.iter().map(|p| (keys[p.index].to_owned(), p.buf)).collect();
            // Each copy is checked block by block as it lands, while its bytes are in the cache
            // (every destination here is host memory).
            let verify = self.config.checksums;
            let keyed = Arc::clone(&self.keyed);
            let at = endpoint.to_string();
            let sent = self.clock.now();
            // The request leaves from this task, before the copying is handed to a blocking
            // thread: the holder resolves while the hand-off runs (`send_get_shared_batch`;
            // without an idle connection, the blocking thread sends it).
            let request: Vec<(&str, usize)> = items.iter().map(|(key, buf)| (key.as_str(), buf.len)).collect();
            let request = keyed.send_get_shared_batch(&at, &request);
            // The answers come back before the settle frame that ends the holder's leases is sent
            // (`get_shared_batch_then`): this call does not wait for that send.
            let got = offload_early(move |early| {
                let batch: Vec<KeyedBatchItem<'_>> = items
                    .iter()
                    .map(|(key, buf)| KeyedBatchItem { key, dst: buf.ptr, cap: buf.len, verify, stream })
                    .collect();
                let mut early = Some(early);
                let answered = |answers| {
                    if let Some(early) = early.take() {
                        early.send(Ok(answers));
                    }
                };
                // SAFETY: each destination is a caller buffer of this call (a slice it borrows
                // exclusively, or a raw range its contract keeps valid and unshared), host memory
                // (device registrations were left out above), no two overlapping (the batch
                // calls' contract); the offloaded work is waited for, even if this call is
                // dropped, until the answers are sent, after which no destination is touched
                // (`offload_early`, `get_shared_batch_then`). `batch` is the batch `request` sent.
                let settled = unsafe {
                    match request {
                        Some(request) => keyed.finish_get_shared_batch_then(request, &batch, answered),
                        None => keyed.get_shared_batch_then(&at, &batch, answered),
                    }
                };
                // Answered already, a failed settle only leaves the leases to run out.
                if let (Err(e), Some(early)) = (settled, early) {
                    early.send(Err(e));
                }
            })
            .await;
            // The client's own bound, as on the routed path: from before the request left.
            let late = self.clock.now() > sent + self.config.read_lease;
            (node, endpoint, got, late)
        })
        .instrument(phase!(phases::GET_KEYED));
        // The access hints of cached keys are written while the exchanges are out (polled after
        // them, so they do not delay the first request); only the hits' are sent.
        let hint_keys = async {
            chunks
                .iter()
                .flat_map(|(_, planned)| planned)
                .filter(|p| p.cached)
                .map(|p| (p.index, keys[p.index].to_owned()))
                .collect::<Vec<(usize, String)>>()
        };
        let (answers, hint_keys) = tokio::join!(exchanges, hint_keys);
        let mut hits = Vec::new();
        for ((_, planned), (node, endpoint, got, late)) in chunks.iter().zip(answers) {
            let answers = match got {
                Some(Ok(answers)) if answers.len() == planned.len() => answers,
                Some(Err(e)) => {
                    tracing::debug!(node = %node, error = %e, "batched same-host get failed; taking the routed path");
                    if e.is_unreachable() {
                        self.forget_holder(node, endpoint);
                    }
                    continue;
                }
                _ => continue,
            };
            for (p, answer) in planned.iter().zip(answers) {
                let key = keys[p.index];
                match answer {
                    KeyedGet::Hit { .. } if late => {
                        StatCounters::add(&self.stats.lease_lapses, 1);
                    }
                    // Checked already (`verify`).
                    KeyedGet::Hit { size, .. } => hits.push((p, node.clone(), endpoint.clone(), size)),
                    KeyedGet::Corrupt { expected, got } => {
                        // Corrupt bytes at that holder: counted, never returned; the routed path
                        // reads the key elsewhere, or reports a miss.
                        self.mismatch(key, node, p.buf.len as u64, expected, got);
                        self.locations.forget(key);
                        prerouted[p.index] = None;
                    }
                    KeyedGet::TooSmall(size) => {
                        results[p.index] = Some(Err(KeyError::BufferTooSmall { needed: size, got: p.buf.len as u64 }));
                    }
                    KeyedGet::Lapsed => StatCounters::add(&self.stats.lease_lapses, 1),
                    KeyedGet::Miss => {
                        // Not there (any more): the routed path asks the master afresh.
                        self.locations.forget(key);
                        prerouted[p.index] = None;
                    }
                    KeyedGet::Busy | KeyedGet::Unsupported => {}
                }
            }
        }
        for (p, _, _, size) in &hits {
            results[p.index] = Some(Ok(*size));
            prerouted[p.index] = None;
        }
        // Cached locations were refreshed at the lookup; the routed keys' are new.
        let routed = hits.iter().filter(|(p, ..)| !p.cached);
        self.locations
            .insert_many(routed.map(|(p, node, endpoint, _)| (keys[p.index], node, endpoint)), self.clock.now());
        StatCounters::add(&self.stats.keyed_gets, hits.len() as u64);
        let mut hit = vec![false; keys.len()];
        for (p, ..) in &hits {
            hit[p.index] = true;
        }
        self.hint_all(hint_keys.into_iter().filter(|(i, _)| hit[*i]).map(|(_, key)| key));
        prerouted
    }

    /// Routes the keys a light client has no location for, adds those held on another node with
    /// a data endpoint to `by_holder`, and keeps every route in `prerouted` for the routed path (a
    /// key the master has no route for, or a failed call, is routed again there).
    async fn route_same_host(
        &self,
        keys: &[&str],
        unplaced: Vec<(usize, CallerBuf)>,
        by_holder: &mut ByHolder,
        prerouted: &mut Prerouted,
    ) {
        let unreachable = self.recently_unreachable();
        for part in unplaced.chunks(ROUTE_KEYS) {
            let route_keys: Vec<String> = part.iter().map(|(i, _)| keys[*i].to_owned()).collect();
            let Ok(hits) = self.master.batch_route_get(&route_keys, &unreachable).await else { return };
            for ((i, buf), hit) in part.iter().zip(hits) {
                let Some(hit) = hit else { continue };
                if !hit.data_endpoint.is_empty() && hit.node_id != self.config.node_id {
                    by_holder
                        .entry((hit.node_id.as_str().into(), hit.data_endpoint.as_str().into()))
                        .or_default()
                        .push(Planned { index: *i, buf: *buf, cached: false });
                }
                prerouted[*i] = Some(hit);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Each holder's chunk sizes, in keys, of `keys` values of `value` bytes at one holder and of
    /// `other` at a second.
    fn cut(spread: &Spread, keys: usize, other: usize, value: u64) -> Vec<(char, usize)> {
        let by_holder = [('a', vec![value; keys]), ('b', vec![value; other])];
        spread.cut(by_holder, |bytes| *bytes).into_iter().map(|(h, c)| (h, c.len())).collect()
    }

    /// A get's first chunk is small and each next doubles; all of a 64 MiB batch is in flight
    /// at once; each holder's keys start over at a small chunk.
    #[test]
    fn a_get_starts_with_a_small_chunk_and_doubles() {
        let spread = Spread::ramped(64 * MIB);
        assert_eq!(spread.depth, GET_DEPTH);
        let limits: Vec<u64> = (0..5).map(|n| spread.chunk_limit(n) / MIB).collect();
        assert_eq!(limits, [8, 16, 32, 32, 32]);
        assert_eq!(cut(&spread, 64, 0, MIB), [('a', 8), ('a', 16), ('a', 32), ('a', 8)]);
        assert!(cut(&spread, 64, 0, MIB).len() <= spread.depth, "one batch, one wave");
        assert_eq!(cut(&spread, 1024, 0, 64 << 10), [('a', 128), ('a', 256), ('a', 512), ('a', 128)]);
        let spread = Spread::ramped(40 * MIB);
        assert_eq!(cut(&spread, 24, 16, MIB), [('a', 5), ('a', 10), ('a', 9), ('b', 5), ('b', 10), ('b', 1)]);
        // A large batch: the first chunk stays at a quarter of the largest.
        let spread = Spread::ramped(1 << 30);
        let limits: Vec<u64> = (0..4).map(|n| spread.chunk_limit(n) / MIB).collect();
        assert_eq!(limits, [8, 16, 32, 32]);
        assert_eq!(spread.chunk_limit(usize::MAX), CHUNK_BYTES);
        // A small one: no chunk under the smallest.
        let spread = Spread::ramped(2 * MIB);
        assert_eq!((spread.chunk_limit(0), spread.chunk_limit(3)), (MIB, MIB));
        assert_eq!(cut(&spread, 8, 0, MIB / 4), [('a', 4), ('a', 4)]);
    }

    /// A put's chunks are halves of the batch (at most the largest), two in flight; no chunk
    /// holds more keys than one exchange takes.
    #[test]
    fn a_put_is_cut_in_halves() {
        let spread = Spread::fanned(64 * MIB);
        assert_eq!(spread.depth, 2);
        assert_eq!(cut(&spread, 64, 0, MIB), [('a', 32), ('a', 32)]);
        let spread = Spread::fanned(1 << 30);
        assert_eq!(cut(&spread, 3, 0, 20 * MIB), [('a', 2), ('a', 1)]);
        let keys = KeyedClient::MAX_BATCH_KEYS;
        assert_eq!(cut(&spread, keys + 1, 0, 1), [('a', keys), ('a', 1)]);
    }
}
