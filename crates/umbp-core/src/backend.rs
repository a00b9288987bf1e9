//! The storage-medium contract.

use std::fmt;
use std::sync::Arc;

use crate::error::BackendError;
use crate::metrics::MetricSource;
use crate::transfer_ref::{MemoryRegistrar, TransferRef};
use crate::types::{
    AllocateRequest, AllocateResult, BufferDesc, CommitRequest, CommitResult, EvictResult, KvEvent, ReadRelease,
    ResolvedEntry, TierCapacity, TierType,
};

/// The callback a backend runs when its unshipped outbox reaches the auto-flush threshold.
///
/// It runs **under the backend's lock**: it must be cheap, must not block and must not call back into
/// the backend. Signal the heartbeat thread and return.
pub type AutoFlushHook = Arc<dyn Fn() + Send + Sync>;

/// One storage medium of a node: it owns bytes, the key → pages map, leases, capacity and the event
/// outbox, and publishes descriptors for its buffers. **It never moves bytes**: `init` receives only a
/// [`MemoryRegistrar`].
///
/// Every method takes `&self` and may be called concurrently from peer-service handlers and the
/// heartbeat thread; implementations lock internally.
///
/// # Contracts the compiler cannot check
/// `umbp_testkit::conformance::run` tests each of these against any implementation.
/// - Events go to the heartbeat in one stream under one sequence space per node
///   ([`drain_all_backends`](crate::drain_all_backends)); a backend never numbers its own bundles.
/// - [`snapshot_owned_keys_for_full_sync`](Self::snapshot_owned_keys_for_full_sync) clears the outbox
///   in the same critical section as the snapshot; [`snapshot_owned_keys`](Self::snapshot_owned_keys)
///   does not mutate.
/// - `FailedNoSpace` only when another peer could succeed; a key larger than the medium can ever hold
///   (or of size 0) is `Failed`.
/// - An allocate answers [`Busy`](crate::AllocateOutcome::Busy) only when the medium has room for
///   the value but a transient resource the slot needs (a staged medium's staging pages) is held
///   by pending slots and readers right now: it reserves nothing, and the resource comes back
///   without anyone evicting (commits, aborts, releases, the pending TTL and the read lease). The
///   writer retries this medium after a short wait; it never takes busy for full, and never
///   excludes the node for it. A full medium is `FailedNoSpace`, never busy; an idle medium (no
///   pending slot, no live read lease) never answers busy; a medium that can always reserve what
///   it has room for never answers busy at all.
/// - [`evict`](Self::evict) returns one result per key in request order; unknown, freed, leased or
///   pinned keys report 0 bytes.
/// - [`batch_abort`](Self::batch_abort) is idempotent (an unknown slot reports `true`). Commit of an
///   unknown, reaped, aborted or pre-clear slot reports `false`. Two commits of one key: the first
///   wins, the second frees its pages and reports success with the first value's size.
/// - [`init`](Self::init) is idempotent and leaves the backend fully live (its own reaper started);
///   [`shutdown`](Self::shutdown) tolerates a failed `init` and deregisters before releasing memory.
/// - No new owned key appears between [`clear_local`](Self::clear_local) and
///   [`clear_full_sync_acked`](Self::clear_full_sync_acked).
/// - The auto-flush hook fires exactly once each time the unshipped outbox grows to the threshold
///   (length == threshold after a push); draining or snapshotting for full sync re-arms it; a
///   threshold of 0 disables it.
/// - A resolve answers each key with a hit, a miss or **busy**. A miss means the medium does not own
///   the key. Busy means it owns the key but cannot serve it now (a staged medium with every staging
///   page held by other readers or writers): the reader waits and asks this medium again; it never
///   treats busy as a miss or excludes the node for it. A medium that can always serve what it owns
///   never answers busy. Running out of a resource the key needs to be served is never a miss.
/// - Read leases are counted ([`ReadLeases`](crate::ReadLeases) is the shared table): every hit
///   adds a reader to its key's lease and carries the lease's id; [`release_reads`](Self::release_reads)
///   removes one reader, and the lease (the key's protection from eviction, a staged copy's hold on
///   its pages) ends when the last reader is released or when it expires, whichever comes first. A
///   release of a lease that already ended changes nothing. The expiry stays the safety net for a
///   reader that died.
pub trait MediumBackend: MetricSource + Send + Sync + fmt::Debug {
    // --- identity -------------------------------------------------------------------------------

    /// The tier this medium serves. One instance is one medium; no method takes a tier.
    fn tier(&self) -> TierType;

    /// A short, stable name for logs and the `backend=` metric label.
    fn name(&self) -> &str;

    // --- ownership ------------------------------------------------------------------------------

    /// Obtains the medium's memory, registers every buffer with `registrar` and starts any background
    /// work (the reaper). Idempotent: a second call on a live backend returns `Ok` and does nothing.
    ///
    /// The backend keeps `registrar` to deregister its buffers in [`shutdown`](Self::shutdown); it is
    /// the only transfer-layer object a medium ever holds, and it cannot move bytes.
    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError>;

    /// Stops background work, deregisters every buffer (with the registrar given to `init`) and then
    /// releases the memory. Tolerates a failed or missing `init`; a second call is a no-op. A shut-down
    /// backend refuses `init`. Must not run concurrently with other calls.
    fn shutdown(&self);

    // --- control plane --------------------------------------------------------------------------

    /// Total and available allocatable bytes.
    fn capacity(&self) -> TierCapacity;

    /// How many keys the medium owns.
    fn owned_key_count(&self) -> usize;

    /// Returns and clears the outbox of ownership changes not yet shipped to the master.
    fn drain_pending_events(&self) -> Vec<KvEvent>;

    /// Every owned key as an `Add` event. Does not touch the outbox.
    fn snapshot_owned_keys(&self) -> Vec<KvEvent>;

    /// Every owned key as an `Add` event, clearing the outbox in the same critical section so no event
    /// committed in between is lost or duplicated.
    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent>;

    /// Drops every owned key (no `Remove` events: the empty full sync that follows is authoritative),
    /// invalidates pending slots, clears the outbox and gates allocation until
    /// [`clear_full_sync_acked`](Self::clear_full_sync_acked).
    fn clear_local(&self);

    /// The master acknowledged the empty full sync after a clear: allocation opens again.
    fn clear_full_sync_acked(&self);

    /// Whether a clear is waiting for its full sync to be acknowledged.
    fn is_clear_full_sync_pending(&self) -> bool;

    /// Installs (or, with `None`, removes) the auto-flush hook. See the trait docs for when it fires.
    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>);

    // --- slot lifecycle -------------------------------------------------------------------------

    /// Reserves room for each request; one result per request, in request order. An empty batch
    /// returns an empty vector. A batch larger than what the medium can reserve at once (a staged
    /// medium's staging arena) is answered `Allocated` for what fits and `Busy` for the rest: the
    /// writer commits the first part and asks again for the rest.
    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult>;

    /// Commits each slot under its key; one result per request, in request order.
    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult>;

    /// Releases each pending slot; `true` for every id, known or not (idempotent).
    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool>;

    /// Looks each key up and takes a read lease on every hit, protecting its pages from eviction
    /// while a reader copies (the hit's [`lease`](ResolvedEntry::lease) names it). Misses and busy
    /// answers take no lease. One entry per key, in request order.
    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry>;

    /// [`batch_resolve`](Self::batch_resolve) for readers that want only parts of each value:
    /// `ranges[i]` lists the `(offset, length)` byte ranges of `keys[i]`'s value the reader will
    /// copy (empty, or missing when `ranges` is shorter: the whole value). One entry per key, in
    /// request order, with the same hits, misses, busy answers and leases as `batch_resolve`.
    ///
    /// A hit may be **partial** ([`ResolvedEntry::partial`]): its pages hold value pages
    /// `first_page .. first_page + pages.len()`, covering every asked range, and only the asked
    /// ranges' bytes in them are the value's. A staged medium (SSD) answers partially so that it
    /// reads and stages only the blocks the ranges cover; a partial hit is a reader's own copy
    /// under its own lease (released by [`release_reads`](Self::release_reads) or expiry like any
    /// hit) and never a cached whole value for later reads. Being a copy, no eviction of the key
    /// can touch it, so its lease need not protect the key from eviction (the SSD's does not). A
    /// whole-value hit is always a correct answer too.
    ///
    /// The default resolves whole values: right for media whose pages are the value's home
    /// (memory), where serving a part costs nothing more than serving the whole.
    fn batch_resolve_ranges(
        &self,
        keys: &[String],
        ranges: &[Vec<(u64, u64)>],
        include_descs: bool,
    ) -> Vec<ResolvedEntry> {
        let _ = ranges;
        self.batch_resolve(keys, include_descs)
    }

    /// The reader finished copying these hits: each removes one reader from the lease it names, and
    /// a lease whose last reader is gone ends now (its key may be evicted, a staged copy's pages
    /// reused) instead of at its expiry. Call it once per hit, after the copy completed (or failed):
    /// releasing a hit whose copy still runs lets its pages be reused under it. Unknown keys, lease
    /// 0 and leases that already ended are ignored.
    ///
    /// The default does nothing: the leases simply expire (correct, but it holds pages for the
    /// whole lease).
    fn release_reads(&self, reads: &[ReadRelease]) {
        let _ = reads;
    }

    /// Whether the medium owns each key: an existence check, which reads no value. One answer per
    /// key, in request order. The default resolves without descriptors and releases each hit's
    /// lease at once (a busy key is owned too); a medium overrides it when it can answer from its
    /// index alone, a decorator to tell lookups from reads.
    fn batch_contains(&self, keys: &[String]) -> Vec<bool> {
        let entries = self.batch_resolve(keys, false);
        let held: Vec<ReadRelease> = entries
            .iter()
            .zip(keys)
            .filter(|(e, _)| e.found && e.lease != 0)
            .map(|(e, k)| ReadRelease::new(k.clone(), e.lease))
            .collect();
        if !held.is_empty() {
            self.release_reads(&held);
        }
        entries.into_iter().map(|e| e.found || e.busy).collect()
    }

    /// Frees each key that is owned and neither leased nor pinned; one result per key, in request
    /// order, with 0 bytes for every key it did not free.
    fn evict(&self, keys: &[String]) -> Vec<EvictResult>;

    // --- bootstrap ------------------------------------------------------------------------------

    /// The page size of the medium (every medium on a node shares one).
    fn page_size(&self) -> u64;

    /// Descriptors of every buffer in ascending buffer index (empty before `init`).
    fn all_buffer_descs(&self) -> Vec<BufferDesc>;

    // --- local endpoints ------------------------------------------------------------------------

    /// How many buffers the medium publishes.
    fn buffer_count(&self) -> usize;

    /// The in-process endpoint of buffer `index`; `None` when out of range or before `init`.
    fn buffer_ref(&self, index: usize) -> Option<TransferRef>;
}
