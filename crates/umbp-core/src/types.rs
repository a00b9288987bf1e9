//! Wire-stable value types shared by media, the control plane and the transfer layer.

use std::fmt;

use crate::transfer_ref::{MemoryLocation, RemoteRegion, TransferRef};

/// How many media one node may register; also the width of a reader's per-backend descriptor shelves.
pub const MAX_BACKENDS_PER_PEER: usize = 8;

/// A storage tier. The numeric values travel on the wire and in metrics and never change; a new medium
/// takes a new number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(u32)]
pub enum TierType {
    /// Not a tier: the value a missing or malformed field decodes to.
    #[default]
    Unknown = 0,
    /// GPU high-bandwidth memory.
    Hbm = 1,
    /// Host DRAM.
    Dram = 2,
    /// A local drive, staged through host DRAM.
    Ssd = 3,
}

impl TierType {
    /// Every real tier in ascending order (the registry's iteration order).
    pub const ALL: [TierType; 3] = [TierType::Hbm, TierType::Dram, TierType::Ssd];

    /// The stable wire value.
    pub const fn wire(self) -> u32 {
        self as u32
    }

    /// Decodes a wire value; unknown numbers become [`TierType::Unknown`] rather than an error so an old
    /// node can read a newer peer's message and ignore the tier it does not know.
    pub const fn from_wire(value: u32) -> Self {
        match value {
            1 => Self::Hbm,
            2 => Self::Dram,
            3 => Self::Ssd,
            _ => Self::Unknown,
        }
    }

    /// The upper-case name used in logs and as the `tier=` metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "UNKNOWN",
            Self::Hbm => "HBM",
            Self::Dram => "DRAM",
            Self::Ssd => "SSD",
        }
    }
}

impl fmt::Display for TierType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Bytes a medium can hold and bytes still free (pending, owned and deferred pages all count as used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierCapacity {
    /// Allocatable bytes in total.
    pub total_bytes: u64,
    /// Allocatable bytes not reserved by any slot, key or deferred free.
    pub available_bytes: u64,
}

/// One page of one buffer of a medium. Buffer indexes are local to a backend (every backend numbers
/// from 0); the wire boundary adds the backend id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct PageLocation {
    /// Index of the buffer inside its backend.
    pub buffer_index: u32,
    /// Index of the page inside the buffer.
    pub page_index: u32,
}

impl PageLocation {
    /// A page location.
    pub const fn new(buffer_index: u32, page_index: u32) -> Self {
        Self { buffer_index, page_index }
    }
}

/// Whether a key appeared on or disappeared from a medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvEventKind {
    /// The key was committed and is now owned by the medium.
    Add = 0,
    /// The key was evicted.
    Remove = 1,
}

/// An ownership change the master learns about through the heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvEvent {
    /// Add or remove.
    pub kind: KvEventKind,
    /// The key.
    pub key: String,
    /// The medium the change happened on.
    pub tier: TierType,
    /// Value size in bytes; 0 for [`KvEventKind::Remove`].
    pub size: u64,
}

impl KvEvent {
    /// An `Add` event.
    pub fn add(key: impl Into<String>, tier: TierType, size: u64) -> Self {
        Self { kind: KvEventKind::Add, key: key.into(), tier, size }
    }

    /// A `Remove` event (size 0).
    pub fn remove(key: impl Into<String>, tier: TierType) -> Self {
        Self { kind: KvEventKind::Remove, key: key.into(), tier, size: 0 }
    }
}

/// What a medium did with one allocation request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AllocateOutcome {
    /// A slot was reserved; the writer may now write its pages and commit.
    Allocated,
    /// The key is already owned here; nothing was reserved and the writer need not write.
    AlreadyExists,
    /// The request can never succeed here or elsewhere (zero size, larger than any medium can hold,
    /// medium clearing). The writer must not retry on another peer.
    #[default]
    Failed,
    /// The medium is full right now; another peer may well succeed (or this one, once room is
    /// made by eviction).
    FailedNoSpace,
    /// The medium has room for the value, but a transient resource the slot needs is exhausted
    /// right now (a staged medium with every staging page held by pending slots of in-flight
    /// writes and by readers): nothing was reserved. The writer retries **this** medium shortly,
    /// after its own in-flight commits have given pages back; it neither tries another peer for it
    /// nor treats the medium as full, and nobody needs to evict to make room. A medium that can
    /// always reserve what it has room for never answers it.
    Busy,
}

impl AllocateOutcome {
    /// Whether the writer holds a usable answer (a fresh slot or an existing copy).
    pub const fn is_success(self) -> bool {
        matches!(self, Self::Allocated | Self::AlreadyExists)
    }

    /// Whether routing should try another peer.
    pub const fn is_retryable_elsewhere(self) -> bool {
        matches!(self, Self::FailedNoSpace)
    }

    /// Whether the writer should ask the same medium again shortly (busy, not full).
    pub const fn is_retryable_here(self) -> bool {
        matches!(self, Self::Busy)
    }
}

/// Reserve room for one key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AllocateRequest {
    /// The key; used for dedup only (commit binds the commit-time key).
    pub key: String,
    /// Value size in bytes.
    pub size: u64,
}

impl AllocateRequest {
    /// An allocation request.
    pub fn new(key: impl Into<String>, size: u64) -> Self {
        Self { key: key.into(), size }
    }
}

/// The answer to one [`AllocateRequest`]. Every field but `outcome` is meaningful only when the outcome
/// is [`AllocateOutcome::Allocated`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AllocateResult {
    /// What happened.
    pub outcome: AllocateOutcome,
    /// The slot to commit or abort; never 0 for a real slot.
    pub slot_id: u64,
    /// The reserved pages, in value order.
    pub pages: Vec<PageLocation>,
    /// The requested value size.
    pub size: u64,
    /// The medium's page size.
    pub page_size: u64,
    /// Descriptors of the buffers the pages live in (deduplicated, ascending buffer index).
    pub descs: Vec<BufferDesc>,
    /// How long the slot stays reserved without a commit, in milliseconds.
    pub pending_ttl_ms: u64,
}

impl AllocateResult {
    /// A result carrying only an outcome (every non-`Allocated` answer).
    pub fn outcome(outcome: AllocateOutcome) -> Self {
        Self { outcome, ..Self::default() }
    }
}

/// Make the pages of a slot the value of a key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CommitRequest {
    /// The slot from [`AllocateResult::slot_id`].
    pub slot_id: u64,
    /// The key the value is stored under (the commit-time key is the one that counts).
    pub key: String,
    /// The writer's CRC-32C of the value, when it computed one: the medium keeps it beside the key
    /// and hands it back on every resolve, so a reader can tell the bytes it copied are the bytes
    /// that were put. The medium never computes nor checks it (it never reads values).
    pub crc32c: Option<u32>,
}

impl CommitRequest {
    /// A commit request without a checksum.
    pub fn new(slot_id: u64, key: impl Into<String>) -> Self {
        Self { slot_id, key: key.into(), crc32c: None }
    }

    /// The same request carrying the writer's CRC-32C of the value.
    #[must_use]
    pub fn with_crc32c(mut self, crc32c: Option<u32>) -> Self {
        self.crc32c = crc32c;
        self
    }
}

/// The answer to one [`CommitRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommitResult {
    /// False when the slot is unknown, reaped, aborted or from before a clear.
    pub success: bool,
    /// Size of the value now owned under the key (the first writer's size on a lost race).
    pub bytes_committed: u64,
}

/// Where a key's bytes are, as answered by a resolve.
///
/// Three answers: a **hit** (`found`, with pages and a read lease), a **miss** (the medium does not
/// own the key: look elsewhere) and **busy** (`busy`: the medium owns the key but cannot serve it
/// right now, e.g. every staging page is in use by other readers; retry *this* medium after a short
/// wait, do not exclude it and do not report the key as missing).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResolvedEntry {
    /// Whether the medium owns the key and serves it now. A miss or busy entry carries nothing else.
    pub found: bool,
    /// The medium owns the key but cannot serve it now: retry here (never set together with
    /// `found`).
    pub busy: bool,
    /// The pages, in value order.
    pub pages: Vec<PageLocation>,
    /// Value size in bytes.
    pub size: u64,
    /// The medium's page size.
    pub page_size: u64,
    /// Buffer descriptors for the pages (empty when not requested or on a miss).
    pub descs: Vec<BufferDesc>,
    /// The read lease this hit holds, to hand back in a [`ReadRelease`] once the copy is done; 0 on
    /// a miss, on busy, and from a medium whose leases only lapse.
    pub lease: u64,
    /// The CRC-32C the value's writer committed with it ([`CommitRequest::crc32c`]), if any: the
    /// reader checks the bytes it copied against it.
    pub crc32c: Option<u32>,
    /// A **partial** hit, answered only to
    /// [`batch_resolve_ranges`](crate::MediumBackend::batch_resolve_ranges): its pages hold value
    /// pages `first_page .. first_page + pages.len()`, and in them only the bytes of the asked
    /// ranges are the value's (the medium read no more). Copy nothing else out of it.
    pub partial: bool,
    /// The value page `pages[0]` holds: 0 for a whole value (see [`partial`](Self::partial)).
    pub first_page: u64,
}

impl ResolvedEntry {
    /// A miss.
    pub fn miss() -> Self {
        Self::default()
    }

    /// Whether a hit's pages hold the whole value (not partial, from its first byte, enough of
    /// them for its size); `false` for a partial hit and for a miss.
    pub fn is_whole(&self) -> bool {
        self.found
            && !self.partial
            && self.first_page == 0
            && self.page_size != 0
            && self.pages.len() as u64 >= self.size.div_ceil(self.page_size)
    }

    /// Busy: the key is here, but cannot be served now; retry this medium shortly.
    pub fn busy() -> Self {
        Self { busy: true, ..Self::default() }
    }
}

/// The value pages that a set of `(offset, length)` byte ranges of a value of `size` bytes touch,
/// in pages of `page_size` bytes: `(first page, page count)` of the union span of the ranges,
/// clipped to the value. `None` when no range touches the value (none given, all empty or past its
/// end) or `page_size` is 0: read the whole value then.
pub fn covering_pages(ranges: &[(u64, u64)], size: u64, page_size: u64) -> Option<(u64, u64)> {
    if page_size == 0 {
        return None;
    }
    let (lo, hi) = covering_span(ranges, size)?;
    Some((lo / page_size, hi.div_ceil(page_size) - lo / page_size))
}

/// The byte span `[start, end)` from the first byte to the last that a set of `(offset, length)`
/// ranges of a value of `size` bytes touch, clipped to the value; `None` when no range touches it.
pub fn covering_span(ranges: &[(u64, u64)], size: u64) -> Option<(u64, u64)> {
    let (mut lo, mut hi) = (u64::MAX, 0u64);
    for &(offset, len) in ranges {
        let end = offset.saturating_add(len).min(size);
        if offset < end {
            lo = lo.min(offset);
            hi = hi.max(end);
        }
    }
    (lo < hi).then_some((lo, hi))
}

/// A reader is done copying one hit: the read it held on `key` under lease `lease` (the hit's
/// [`ResolvedEntry::lease`]) may end now instead of at the lease's expiry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReadRelease {
    /// The key that was read.
    pub key: String,
    /// The lease the hit carried.
    pub lease: u64,
}

impl ReadRelease {
    /// A release of one hit.
    pub fn new(key: impl Into<String>, lease: u64) -> Self {
        Self { key: key.into(), lease }
    }
}

/// The read leases of one medium, counted: each hit of a key adds a reader to the key's current
/// lease (starting one, with a fresh id, when none is live); a release removes one reader of the
/// lease it names, and the lease ends when its last reader is gone. A release naming a lease that
/// already ended (lapsed, or released to zero and replaced) changes nothing, so a late reader can
/// never end a later reader's lease.
///
/// Shared by the media so every one counts the same way; it holds no clock and no lock (the
/// medium's state lock guards it).
#[derive(Debug, Clone, Default)]
pub struct ReadLeases {
    by_key: std::collections::HashMap<String, ReadLease>,
    next_id: u64,
}

/// One key's live read lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLease {
    /// The id hits carry (never 0).
    pub id: u64,
    /// Until when it protects the key whatever its readers do (the safety net for a reader that
    /// died).
    pub until: std::time::Instant,
    /// Hits not yet released.
    pub readers: u32,
}

impl ReadLeases {
    /// A fresh lease id (never 0).
    pub fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Adds a reader to `key`'s lease live at `now` (extending it to `until`), or starts a lease;
    /// returns the lease id the hit carries.
    pub fn acquire(&mut self, key: &str, now: std::time::Instant, until: std::time::Instant) -> u64 {
        if let Some(l) = self.by_key.get_mut(key)
            && l.until > now
        {
            l.readers = l.readers.saturating_add(1);
            l.until = l.until.max(until);
            return l.id;
        }
        let id = self.next_id();
        self.by_key.insert(key.to_owned(), ReadLease { id, until, readers: 1 });
        id
    }

    /// Removes one reader of lease `id` on `key`; returns whether the lease ended (its last reader
    /// released it). A lease that is not `key`'s live one is left alone.
    pub fn release(&mut self, key: &str, id: u64, now: std::time::Instant) -> bool {
        let Some(l) = self.by_key.get_mut(key) else { return false };
        if id == 0 || l.id != id || l.until <= now {
            return false;
        }
        l.readers = l.readers.saturating_sub(1);
        if l.readers == 0 {
            self.by_key.remove(key);
            return true;
        }
        false
    }

    /// Whether `key` has a live lease at `now` (an expired one is dropped).
    pub fn active(&mut self, key: &str, now: std::time::Instant) -> bool {
        match self.by_key.get(key) {
            Some(l) if l.until > now => true,
            Some(_) => {
                self.by_key.remove(key);
                false
            }
            None => false,
        }
    }

    /// `key`'s live lease at `now`, if any.
    pub fn get(&self, key: &str, now: std::time::Instant) -> Option<ReadLease> {
        self.by_key.get(key).copied().filter(|l| l.until > now)
    }

    /// Drops every lease that ended by `now`.
    pub fn sweep(&mut self, now: std::time::Instant) {
        self.by_key.retain(|_, l| l.until > now);
    }

    /// Removes `key`'s lease (whatever its state) and returns it.
    pub fn remove(&mut self, key: &str) -> Option<ReadLease> {
        self.by_key.remove(key)
    }

    /// Empties the table, handing back every lease by key (ids keep counting up).
    pub fn take(&mut self) -> std::collections::HashMap<String, ReadLease> {
        std::mem::take(&mut self.by_key)
    }

    /// How many keys hold a lease (live or not yet swept).
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether no key holds a lease.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// What evicting one key freed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EvictResult {
    /// The key, echoed so results can be checked positionally.
    pub key: String,
    /// Bytes freed; 0 for an unknown, already freed, leased or pinned key (not an error: the master
    /// retries protected keys next round).
    pub bytes_freed: u64,
}

/// The descriptor of one buffer of a medium as published to other nodes: everything a remote
/// transfer needs, and nothing process-local (no pointer).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BufferDesc {
    /// The backend's id on its node. Backends always publish 0; the peer-service wire boundary stamps
    /// the registry's id, because buffer indexes alone collide across media.
    pub backend_id: u32,
    /// Index of the buffer inside its backend.
    pub buffer_index: u32,
    /// Allocatable bytes of the buffer.
    pub size: u64,
    /// Host or GPU memory.
    pub location: MemoryLocation,
    /// The data-plane handle a remote node uses to reach the buffer, if a registering transport is
    /// active.
    pub remote: Option<RemoteRegion>,
}

impl BufferDesc {
    /// The published form of a buffer's [`TransferRef`] (drops the process-local pointer).
    pub fn from_ref(buffer_index: u32, r: &TransferRef) -> Self {
        Self { backend_id: 0, buffer_index, size: r.size(), location: r.location(), remote: r.remote().cloned() }
    }

    /// The same descriptor with the registry's backend id stamped on it.
    pub fn with_backend_id(mut self, backend_id: u32) -> Self {
        self.backend_id = backend_id;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_wire_values_are_stable() {
        assert_eq!(TierType::Unknown.wire(), 0);
        assert_eq!(TierType::Hbm.wire(), 1);
        assert_eq!(TierType::Dram.wire(), 2);
        assert_eq!(TierType::Ssd.wire(), 3);
        for t in TierType::ALL {
            assert_eq!(TierType::from_wire(t.wire()), t);
        }
        assert_eq!(TierType::from_wire(99), TierType::Unknown);
        assert_eq!(TierType::Dram.to_string(), "DRAM");
    }

    #[test]
    fn tiers_order_ascending_by_wire_value() {
        let mut v = vec![TierType::Ssd, TierType::Hbm, TierType::Dram];
        v.sort();
        assert_eq!(v, TierType::ALL);
    }

    #[test]
    fn page_locations_order_lexicographically() {
        assert!(PageLocation::new(0, 5) < PageLocation::new(1, 0));
        assert!(PageLocation::new(1, 0) < PageLocation::new(1, 1));
    }

    #[test]
    fn read_leases_count_readers_and_ignore_stale_releases() {
        let t0 = std::time::Instant::now();
        let lease = std::time::Duration::from_secs(3);
        let mut l = ReadLeases::default();
        let a = l.acquire("k", t0, t0 + lease);
        let b = l.acquire("k", t0, t0 + lease);
        assert_eq!(a, b, "two readers of one live lease share its id");
        assert_ne!(a, 0);
        assert!(!l.release("k", a, t0), "one of two readers released: the lease stays");
        assert!(l.active("k", t0));
        assert!(l.release("k", a, t0), "the last reader ends it");
        assert!(!l.active("k", t0));
        // A lease that lapsed is replaced; the old one's late release leaves the new one alone.
        let old = l.acquire("k", t0, t0 + lease);
        let later = t0 + lease * 2;
        let new = l.acquire("k", later, later + lease);
        assert_ne!(old, new, "a lapsed lease is not extended");
        assert!(!l.release("k", old, later), "a stale release");
        assert!(l.active("k", later), "the new reader is still protected");
        assert!(!l.release("k", 0, later) && !l.release("other", new, later), "unknown ids and keys");
        assert!(l.release("k", new, later));
        assert!(l.is_empty());
    }

    #[test]
    fn a_busy_entry_is_neither_a_hit_nor_a_miss() {
        let b = ResolvedEntry::busy();
        assert!(b.busy && !b.found && b.pages.is_empty() && b.lease == 0);
        assert_ne!(b, ResolvedEntry::miss());
    }

    #[test]
    fn covering_pages_spans_the_union_of_the_ranges_inside_the_value() {
        assert_eq!(covering_pages(&[(100, 10)], 10_000, 4096), Some((0, 1)));
        assert_eq!(covering_pages(&[(4096, 1)], 10_000, 4096), Some((1, 1)));
        assert_eq!(covering_pages(&[(9000, 8), (4000, 100)], 10_000, 4096), Some((0, 3)), "a span, any order");
        assert_eq!(covering_pages(&[(4095, 2)], 10_000, 4096), Some((0, 2)), "a range across a page edge");
        assert_eq!(covering_pages(&[(9000, 5000)], 10_000, 4096), Some((2, 1)), "clipped to the value");
        assert_eq!(covering_pages(&[(10_000, 5)], 10_000, 4096), None, "past the end");
        assert_eq!(covering_pages(&[(7, 0)], 10_000, 4096), None, "empty");
        assert_eq!(covering_pages(&[], 10_000, 4096), None);
        assert_eq!(covering_pages(&[(0, 1)], 10_000, 0), None);
        assert_eq!(covering_pages(&[(u64::MAX, 9)], 10_000, 4096), None, "no overflow");
        assert_eq!(covering_span(&[(9000, 8), (4000, 100)], 10_000), Some((4000, 9008)));
        assert_eq!(covering_span(&[(9990, 100)], 10_000), Some((9990, 10_000)));
    }

    #[test]
    fn a_whole_entry_holds_every_page_from_the_first() {
        let pages = vec![PageLocation::new(0, 4), PageLocation::new(0, 1)];
        let whole = ResolvedEntry { found: true, pages, size: 5000, page_size: 4096, ..ResolvedEntry::default() };
        assert!(whole.is_whole());
        assert!(!ResolvedEntry { first_page: 1, ..whole.clone() }.is_whole());
        assert!(!ResolvedEntry { partial: true, ..whole.clone() }.is_whole(), "all pages, some bytes");
        assert!(!ResolvedEntry { size: 9000, ..whole.clone() }.is_whole(), "too few pages");
        assert!(!ResolvedEntry::miss().is_whole());
    }

    #[test]
    fn only_no_space_is_retryable_elsewhere() {
        assert!(AllocateOutcome::FailedNoSpace.is_retryable_elsewhere());
        assert!(!AllocateOutcome::Failed.is_retryable_elsewhere());
        assert!(AllocateOutcome::AlreadyExists.is_success());
        assert!(!AllocateOutcome::FailedNoSpace.is_success());
    }

    #[test]
    fn busy_is_retried_here_never_elsewhere_and_is_no_success() {
        let b = AllocateOutcome::Busy;
        assert!(b.is_retryable_here() && !b.is_retryable_elsewhere() && !b.is_success());
        for o in [AllocateOutcome::Allocated, AllocateOutcome::AlreadyExists, AllocateOutcome::Failed] {
            assert!(!o.is_retryable_here(), "{o:?}");
        }
        assert!(!AllocateOutcome::FailedNoSpace.is_retryable_here(), "full is not busy");
        assert_eq!(AllocateResult::outcome(b).slot_id, 0, "busy reserves nothing");
    }
}
