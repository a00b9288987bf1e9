//! `State`: everything behind the SSD medium's one lock, and the byte accounting over it.
//!
//! The fields are private to this module, so the accounting changes in one place. Every method
//! returns with these invariants holding (checked by [`State::check`], which the proptest in
//! `tests` runs after every step of arbitrary sequences):
//!
//! - `used` is the page-rounded bytes of the pending slots, plus `committing` (the bytes of commits
//!   between their lock phases), plus the page-rounded bytes of the owned values;
//! - `used <= total`: admission never passes the capacity, and recovery keeps the newest records
//!   that fit;
//! - `overhead` is what the owned keys' records take on the drive beyond their page-rounded values;
//! - every staging page is free or held by one holder: a pending slot, a staged copy, a deferred
//!   free, or an IO job between its lock phases (which gives it back through a method here);
//! - the log's live bytes are the owned keys' records plus the tombstones in force.

use std::sync::Arc;
use std::time::Instant;

use foldhash::HashMap;
use umbp_core::{
    AutoFlushHook, EventOutbox, KvEvent, PageLocation, ReadRelease, ResolvedEntry, TierCapacity, TierType,
};
use umbp_page::PageBitmapAllocator;

use super::index::{KeyIndex, Owned, Pending, Tomb};
use super::io_jobs::JobOutcome;
use super::read::Flight;
use super::reclaim::Pace;
use crate::staged::{Deferred, LeaseIds, Staged, StagedMap};
use crate::store::{Loc, Log, Lru, Reservation, SegId, SegmentFile};

/// Everything behind the backend's one lock.
pub(super) struct State {
    /// The staging page size: the unit `used` rounds values to.
    page_size: u64,
    /// `None` until `init` and after `shutdown`.
    staging: Option<PageBitmapAllocator>,
    pending: HashMap<u64, Pending>,
    owned: KeyIndex<Owned>,
    lru: Lru,
    staged: StagedMap,
    /// Staging pages under a read lease that no staged copy owns (a key dropped while a reader
    /// held its copy, or a partial read's pages): freed at lease end, or when the lease's last
    /// reader releases it.
    deferred: Vec<Deferred>,
    lease_ids: LeaseIds,
    flights: HashMap<String, Arc<Flight>>,
    /// Drive reads in progress per key (protects the key from eviction).
    reading: HashMap<String, u32>,
    /// Commits whose record is being written, per key: a commit of the same key from another
    /// batch waits for it (so one key never has two records in flight, whose seqs could disagree
    /// with which one lands first).
    writing: HashMap<String, Arc<Flight>>,
    log: Log,
    /// Drive bytes reserved by pending slots, commits in flight and owned keys (page-rounded).
    used: u64,
    /// What the owned keys' records take on the drive beyond their page-rounded values in `used`
    /// (header blocks, 4 KiB padding): `used + overhead` is what the after-commit eviction
    /// watches, so live records on the drive stay within the capacity, not only their values.
    overhead: u64,
    total: u64,
    /// Bytes of commits between their lock phases.
    committing: u64,
    compacting: bool,
    pace: Pace,
    /// Evictions not yet logged on the drive: key, the tombstone's seq, its horizon.
    tomb_pending: Vec<(String, u64, u64)>,
    /// Tombstones on the drive still in force, by key.
    tombs: KeyIndex<Tomb>,
    generation: u64,
    outbox: EventOutbox,
}

/// The staging pages and the record of an IO job between its lock phases.
pub(super) struct JobSlot {
    /// The staging pages the value is in (a commit's) or lands in (a read's).
    pub(super) pages: Vec<PageLocation>,
    /// The value's size in bytes.
    pub(super) size: u64,
    /// Where the record lies (is written) on the drive.
    pub(super) loc: Loc,
    /// The clear generation when the job was taken.
    pub(super) generation: u64,
    /// The writer's CRC-32C of the value (a commit's, or the owned record's for a read).
    pub(super) crc32c: Option<u32>,
}

/// A leased copy of a value for a reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hit {
    /// The staging pages the copy lies in.
    pub(super) pages: Vec<PageLocation>,
    /// The value's size in bytes.
    pub(super) size: u64,
    /// The reader's lease on the copy.
    pub(super) lease: u64,
    /// The writer's CRC-32C of the value, if it committed one.
    pub(super) crc32c: Option<u32>,
}

/// How a commit's record ended, once its write is back (see [`State::finish_commit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Landed {
    /// The write failed: the slot is released, the segment sealed.
    Failed,
    /// A clear happened meanwhile: the value is dropped, its record is dead.
    Cleared,
    /// Another value of the key stays (first wins) or a newer tombstone hides this record: the
    /// commit succeeds with these bytes, the record is dead.
    Superseded(u64),
    /// The key is owned now.
    Published,
}

/// What a resolve's drive read leaves behind (see [`State::finish_fill`]).
pub(super) enum Filled {
    /// The value, leased to the reader.
    Hit(Hit),
    /// Nothing to serve.
    Miss,
}

/// What one reader's release did (see [`State::release_read`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Released {
    /// One reader of a cached copy's lease is done.
    Lease,
    /// The last reader of a dropped key's pages is done: they are free now.
    Freed,
    /// Nothing matched (a lapsed or unknown lease).
    Nothing,
}

impl State {
    /// An empty state for staging pages of `page_size` bytes (not live until [`install`](Self::install)).
    pub(super) fn new(page_size: u64) -> Self {
        Self {
            page_size,
            staging: None,
            pending: HashMap::default(),
            owned: KeyIndex::default(),
            lru: Lru::default(),
            staged: StagedMap::default(),
            deferred: Vec::new(),
            lease_ids: LeaseIds::default(),
            flights: HashMap::default(),
            reading: HashMap::default(),
            writing: HashMap::default(),
            log: Log::default(),
            used: 0,
            overhead: 0,
            total: 0,
            committing: 0,
            compacting: false,
            pace: Pace::default(),
            tomb_pending: Vec::new(),
            tombs: KeyIndex::default(),
            generation: 0,
            outbox: EventOutbox::default(),
        }
    }

    /// The drive bytes a value of `size` bytes takes in `used` (page-rounded).
    fn bytes_of(&self, size: u64) -> u64 {
        size.div_ceil(self.page_size) * self.page_size
    }

    // ---- lifecycle -------------------------------------------------------------------------

    /// Goes live over what recovery found: `owned` oldest first (the LRU starts in write order).
    pub(super) fn install(
        &mut self,
        staging: PageBitmapAllocator,
        total: u64,
        log: Log,
        owned: Vec<(String, Owned)>,
        tombs: Vec<(String, Tomb)>,
    ) {
        let (mut used, mut overhead) = (0, 0);
        for (key, o) in owned {
            used += self.bytes_of(o.size);
            overhead += o.overhead(self.page_size);
            self.lru.touch(&key);
            self.owned.insert(key, o);
        }
        self.used = used;
        self.overhead = overhead;
        self.total = total;
        self.log = log;
        self.pace = Pace::default();
        self.tombs.clear();
        for (key, t) in tombs {
            self.tombs.insert(key, t);
        }
        self.staging = Some(staging);
    }

    /// Whether the medium is live (between `init` and `shutdown`).
    pub(super) fn is_live(&self) -> bool {
        self.staging.is_some()
    }

    /// The clear generation: bumped by every [`clear`](Self::clear).
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// The capacity in bytes.
    pub(super) fn total(&self) -> u64 {
        self.total
    }

    /// Drive bytes reserved (page-rounded values of pending slots, commits and owned keys).
    pub(super) fn used(&self) -> u64 {
        self.used
    }

    /// `used` plus the owned records' overhead: the live records' drive footprint.
    pub(super) fn footprint(&self) -> u64 {
        self.used + self.overhead
    }

    /// What `capacity()` answers (zero when not live).
    pub(super) fn capacity(&self) -> TierCapacity {
        if !self.is_live() {
            return TierCapacity::default();
        }
        TierCapacity { total_bytes: self.total, available_bytes: self.total.saturating_sub(self.used) }
    }

    /// Staging pages in use (pending, cached, deferred or in an IO job).
    pub(super) fn staging_in_use(&self) -> u64 {
        self.staging.as_ref().map_or(0, |a| a.total_pages() - a.free_pages())
    }

    /// The log.
    pub(super) fn log(&self) -> &Log {
        &self.log
    }

    /// The log, to reserve, finish and seal writes and take segments (its own accounting of live
    /// bytes moves only through the methods of this type).
    pub(super) fn log_mut(&mut self) -> &mut Log {
        &mut self.log
    }

    // ---- events ----------------------------------------------------------------------------

    /// Queues an event for the master.
    pub(super) fn push_event(&mut self, event: KvEvent) {
        self.outbox.push(event);
    }

    /// The queued events, taken.
    pub(super) fn take_events(&mut self) -> Vec<KvEvent> {
        self.outbox.take()
    }

    /// Drops the queued events (a full sync replaces them).
    pub(super) fn clear_events(&mut self) {
        self.outbox.clear();
    }

    /// Sets the outbox's auto-flush threshold and hook.
    pub(super) fn set_auto_flush(&mut self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.outbox.set_auto_flush(threshold, hook);
    }

    // ---- owned keys ------------------------------------------------------------------------

    /// Whether `key` is owned (committed and not dropped).
    pub(super) fn owns(&self, key: &str) -> bool {
        self.owned.contains_key(key)
    }

    /// `key`'s record and size, if owned.
    pub(super) fn owned(&self, key: &str) -> Option<Owned> {
        self.owned.get(key).copied()
    }

    /// How many keys are owned.
    pub(super) fn owned_count(&self) -> usize {
        self.owned.len()
    }

    /// An `Add` for every owned key (a snapshot for the master).
    pub(super) fn owned_events(&self) -> Vec<KvEvent> {
        self.owned.iter().map(|(k, o)| KvEvent::add(k.clone(), TierType::Ssd, o.size)).collect()
    }

    /// Tombstones in force.
    pub(super) fn tomb_count(&self) -> usize {
        self.tombs.len()
    }

    // ---- staging pages and slots -----------------------------------------------------------

    /// Gives staging pages back (no drive bytes: those go with [`release`](Self::release)).
    pub(super) fn free(&mut self, pages: &[PageLocation]) {
        if let Some(a) = self.staging.as_mut() {
            a.deallocate(pages);
        }
    }

    /// Releases a slot's reservation: its staging pages and its drive bytes.
    fn release(&mut self, pages: &[PageLocation], size: u64) {
        self.free(pages);
        self.used = self.used.saturating_sub(self.bytes_of(size));
    }

    /// `n` staging pages, dropping least recently used unleased cached copies to make room.
    pub(super) fn take_staging(&mut self, n: u64, now: Instant) -> Option<Vec<PageLocation>> {
        loop {
            if let Some(pages) = self.staging.as_mut()?.allocate(n) {
                return Some(pages);
            }
            // From the cold end of the use order: leased copies are stepped over, the rest is not
            // looked at.
            let victim = self.staged.coldest_unleased(now)?.clone();
            if let Some(s) = self.staged.remove(&victim) {
                self.free(&s.pages);
            }
        }
    }

    /// Whether a value of `n` pages could ever be staged here (`false` too when not live).
    pub(super) fn stageable(&self, n: u64) -> bool {
        self.staging.as_ref().is_some_and(|a| n <= a.total_pages())
    }

    /// Whether `bytes` more fit in the capacity.
    pub(super) fn has_room(&self, bytes: u64) -> bool {
        self.used + bytes <= self.total
    }

    /// Admits a slot of `size` bytes as `slot_id`: its staging pages (`None`: none free, busy)
    /// and its drive bytes, the caller having checked [`has_room`](Self::has_room).
    pub(super) fn admit(
        &mut self,
        slot_id: u64,
        size: u64,
        deadline: Instant,
        now: Instant,
    ) -> Option<Vec<PageLocation>> {
        let pages = self.take_staging(size.div_ceil(self.page_size), now)?;
        self.used += self.bytes_of(size);
        let generation = self.generation;
        self.pending.insert(slot_id, Pending { pages: pages.clone(), size, deadline, generation });
        Some(pages)
    }

    /// Aborts pending slot `slot_id` (no-op if it is gone).
    pub(super) fn abort(&mut self, slot_id: u64) {
        if let Some(slot) = self.pending.remove(&slot_id) {
            self.release(&slot.pages, slot.size);
        }
    }

    /// Expiry at `now`: pending slots past their deadline (returns how many), read leases, and
    /// deferred frees that are due.
    pub(super) fn expire(&mut self, now: Instant) -> u64 {
        let expired: Vec<u64> = self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| *id).collect();
        let count = expired.len() as u64;
        for id in expired {
            self.abort(id);
        }
        for s in self.staged.values_mut() {
            s.expire(now);
        }
        let mut due = Vec::new();
        self.deferred.retain_mut(|d| {
            if d.until <= now {
                due.push(std::mem::take(&mut d.pages));
                false
            } else {
                true
            }
        });
        for pages in due {
            self.free(&pages);
        }
        count
    }

    // ---- commits ---------------------------------------------------------------------------

    /// The first commit of another batch still writing one of `keys`, if any.
    pub(super) fn writer_of<'a>(&self, mut keys: impl Iterator<Item = &'a str>) -> Option<Arc<Flight>> {
        keys.find_map(|k| self.writing.get(k).cloned())
    }

    /// Takes pending slot `slot_id` into a commit: its bytes count as `committing` until
    /// [`abandon_commit`](Self::abandon_commit) or [`finish_commit`](Self::finish_commit).
    pub(super) fn begin_commit(&mut self, slot_id: u64) -> Option<Pending> {
        let slot = self.pending.remove(&slot_id)?;
        self.committing += self.bytes_of(slot.size);
        Some(slot)
    }

    /// A commit taken by [`begin_commit`](Self::begin_commit) that writes nothing: the slot is
    /// released.
    pub(super) fn abandon_commit(&mut self, pages: &[PageLocation], size: u64) {
        self.committing = self.committing.saturating_sub(self.bytes_of(size));
        self.release(pages, size);
    }

    /// Reserves the place of `key`'s record of `len` bytes and marks the key as being written.
    pub(super) fn reserve_commit(&mut self, key: &str, len: u64) -> (Reservation, Arc<Flight>) {
        let res = self.log.reserve(len);
        let flight = Arc::new(Flight::default());
        self.writing.insert(key.to_owned(), Arc::clone(&flight));
        (res, flight)
    }

    /// The record of a commit came back from the drive (`ok`: it landed at `loc`): publishes the
    /// key, or releases the slot. `cache`: keep the staging pages as a clean cached copy.
    pub(super) fn finish_commit(&mut self, key: &str, job: JobSlot, ok: bool, cache: bool) -> Landed {
        let JobSlot { pages, size, loc, generation, crc32c } = job;
        self.log.finish_write(loc.seg);
        if !ok {
            self.abandon_commit(&pages, size);
            // Recovery stops at the first hole in a segment: append nothing behind this one.
            self.log.seal(loc.seg);
            return Landed::Failed;
        }
        if self.generation != generation {
            // A clear happened during the write (it kept this commit's bytes in `used`, as
            // `committing`): the value is dropped, its record is dead.
            self.abandon_commit(&pages, size);
            return Landed::Cleared;
        }
        // Commits of one key are serialized (`writing`), so neither case below is expected; both
        // keep memory where recovery would be: a value already owned stays (first wins, and it
        // is the newer record), and a record older than a tombstone of the key on the drive is
        // dead (the tombstone hides it at a restart).
        let existing = self.owned.get(key).map(|o| o.size);
        let tomb_newer = self.tombs.get(key).is_some_and(|t| t.loc.seq > loc.seq);
        if tomb_newer || existing.is_some() {
            self.abandon_commit(&pages, size);
            return Landed::Superseded(existing.unwrap_or(size));
        }
        self.committing = self.committing.saturating_sub(self.bytes_of(size));
        self.log.add_live(&loc);
        // The new record outranks every older one of the key: its tombstones are not needed.
        if let Some(t) = self.tombs.remove(key) {
            self.log.kill(&t.loc);
        }
        self.tomb_pending.retain(|(k, _, _)| k != key);
        let owned = Owned { loc, size, crc32c };
        self.overhead += owned.overhead(self.page_size);
        self.owned.insert(key.to_owned(), owned);
        self.lru.touch(key);
        if cache && !self.staged.contains_key(key) {
            self.staged.insert(key.to_owned(), Staged::clean(pages, size));
        } else {
            self.free(&pages);
        }
        self.push_event(KvEvent::add(key.to_owned(), TierType::Ssd, size));
        Landed::Published
    }

    /// The key is no longer being written by `flight`'s batch.
    pub(super) fn end_writing(&mut self, key: &str, flight: &Arc<Flight>) {
        if self.writing.get(key).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            self.writing.remove(key);
        }
    }

    // ---- eviction --------------------------------------------------------------------------

    /// Whether `key` may be evicted now: owned, no live lease on its staged copy, no drive read.
    pub(super) fn evictable(&self, key: &str, now: Instant) -> bool {
        self.owned.contains_key(key)
            && !self.staged.get(key).is_some_and(|s| s.leased(now))
            && !self.reading.contains_key(key)
    }

    /// Evicts least recently used keys (sparing `spare` and keys in use) while `over` holds;
    /// returns how many went, each with a `Remove` queued.
    pub(super) fn evict_lru(
        &mut self,
        over: impl Fn(&State) -> bool,
        now: Instant,
        spare: &foldhash::HashSet<&str>,
    ) -> u64 {
        // Walks the LRU from the cold end one key at a time (no copy of it): the work is the keys
        // looked at (victims and the in-use keys stepped over), not the keys owned.
        let mut victims = 0;
        let mut cursor = None;
        while over(self) {
            let Some((tick, key)) = self.lru.next_oldest(cursor).map(|(t, k)| (t, k.clone())) else { break };
            cursor = Some(tick);
            if !self.evictable(&key, now) || spare.contains(key.as_str()) {
                continue;
            }
            if self.drop_owned(&key, now).is_some() {
                victims += 1;
                self.push_event(KvEvent::remove(key, TierType::Ssd));
            }
        }
        victims
    }

    /// Drops `key` from the index (its record becomes dead space), frees its staged copy and queues
    /// a tombstone, so a restart does not bring the key back. A staged copy under a live lease is
    /// not freed but deferred to its lease's end (a reader may still be copying out of it), as
    /// `clear` does.
    pub(super) fn drop_owned(&mut self, key: &str, now: Instant) -> Option<Owned> {
        let owned = self.forget_owned(key, now)?;
        // The seq is taken now: a later put of the key gets a larger one and wins over it.
        let seq = self.log.next_seq;
        self.log.next_seq += 1;
        let horizon = self.log.next_seg.saturating_sub(1);
        self.tomb_pending.push((key.to_owned(), seq, horizon));
        Some(owned)
    }

    /// Drops `key` from the index, LRU and staged copies (its record becomes dead space) without
    /// logging anything: for a record that a newer record or tombstone of the key on the drive
    /// already outranks at recovery. The caller queues any event.
    pub(super) fn forget_owned(&mut self, key: &str, now: Instant) -> Option<Owned> {
        let owned = self.owned.remove(key)?;
        self.overhead = self.overhead.saturating_sub(owned.overhead(self.page_size));
        self.lru.remove(key);
        self.used = self.used.saturating_sub(self.bytes_of(owned.size));
        self.log.kill(&owned.loc);
        if let Some(s) = self.staged.remove(key) {
            self.defer_or_free(key, s, now);
        }
        Some(owned)
    }

    /// A dropped staged copy: its pages wait for a live lease's readers, or are freed now.
    fn defer_or_free(&mut self, key: &str, s: Staged, now: Instant) {
        match Deferred::of(key, s, now) {
            Ok(d) => self.deferred.push(d),
            Err(pages) => self.free(&pages),
        }
    }

    /// `clear_local`: every owned key and tombstone goes, every record is dead; pending slots and
    /// commits in flight keep their bytes (they finish against the new generation). Returns the
    /// segments already dead.
    pub(super) fn clear(&mut self, now: Instant) -> Vec<Arc<SegmentFile>> {
        self.generation += 1;
        self.owned.clear();
        self.overhead = 0;
        self.lru.clear();
        // The whole log goes: nothing is left for a tombstone to hold down.
        self.tombs.clear();
        self.tomb_pending.clear();
        for (key, s) in self.staged.take() {
            // A reader may still be copying out of these pages.
            self.defer_or_free(&key, s, now);
        }
        let pending: u64 = self.pending.values().map(|p| self.bytes_of(p.size)).sum();
        self.used = pending + self.committing;
        // Every record is dead now; the files go as soon as no write is in flight in them.
        for s in self.log.segs.values_mut() {
            s.live = 0;
        }
        self.log.seal_all();
        self.outbox.clear();
        self.log.take_dead_segments()
    }

    // ---- reads -----------------------------------------------------------------------------

    /// Leases `key`'s cached copy (if any) until `until` and marks it used.
    pub(super) fn hold_staged(&mut self, key: &str, now: Instant, until: Instant) -> Option<Hit> {
        let s = self.staged.get_mut(key)?;
        let lease = s.hold(now, until, &mut self.lease_ids);
        // A cached copy is of an owned key (dropping the key drops or defers the copy).
        let crc32c = self.owned.get(key).and_then(|o| o.crc32c);
        let hit = Hit { pages: s.pages.clone(), size: s.size, lease, crc32c };
        self.staged.touch(key);
        self.lru.touch(key);
        Some(hit)
    }

    /// Drops every unleased cached copy.
    pub(super) fn drop_unleased_copies(&mut self, now: Instant) {
        let keys: Vec<String> = self.staged.iter().filter(|(_, s)| !s.leased(now)).map(|(k, _)| k.clone()).collect();
        for k in keys {
            if let Some(s) = self.staged.remove(&k) {
                self.free(&s.pages);
            }
        }
    }

    /// The single-flight read of `key` in progress, if any.
    pub(super) fn flight_of(&self, key: &str) -> Option<Arc<Flight>> {
        self.flights.get(key).cloned()
    }

    /// Starts a drive read of `key` (protecting it from eviction), leading a single flight
    /// others may follow when `single_flight`.
    pub(super) fn start_read(&mut self, key: &str, single_flight: bool) -> Option<Arc<Flight>> {
        let flight = single_flight.then(|| {
            let f = Arc::new(Flight::default());
            self.flights.insert(key.to_owned(), Arc::clone(&f));
            f
        });
        *self.reading.entry(key.to_owned()).or_insert(0) += 1;
        flight
    }

    /// A drive read of `key` into `pages` (a [`take_staging`](Self::take_staging)) came back
    /// with `outcome`: the pages become the key's leased cached copy, or go back. A corrupt record
    /// drops the key (never serve wrong bytes), with a `Remove` for the master.
    pub(super) fn finish_read(
        &mut self,
        key: &str,
        flight: Option<&Arc<Flight>>,
        job: JobSlot,
        outcome: JobOutcome,
        now: Instant,
        until: Instant,
    ) -> Filled {
        let JobSlot { pages, size, loc, generation, crc32c } = job;
        self.end_read(key);
        if let Some(f) = flight
            && self.flights.get(key).is_some_and(|g| Arc::ptr_eq(f, g))
        {
            self.flights.remove(key);
        }
        let current = self.generation == generation && self.owned.get(key).is_some_and(|o| o.loc.seq == loc.seq);
        match outcome {
            JobOutcome::Ok if current => {
                if let Some(hit) = self.hold_staged(key, now, until) {
                    // Another fill of the key landed first (single flight off): share it.
                    self.free(&pages);
                    Filled::Hit(hit)
                } else {
                    self.lru.touch(key);
                    let mut staged = Staged::clean(pages.clone(), size);
                    let lease = staged.hold(now, until, &mut self.lease_ids);
                    self.staged.insert(key.to_owned(), staged);
                    // `current`: the record read is the owned one, so is its checksum.
                    Filled::Hit(Hit { pages, size, lease, crc32c })
                }
            }
            JobOutcome::Corrupt if current => {
                self.free(&pages);
                if self.drop_owned(key, now).is_some() {
                    self.push_event(KvEvent::remove(key.to_owned(), TierType::Ssd));
                }
                Filled::Miss
            }
            _ => {
                self.free(&pages);
                Filled::Miss
            }
        }
    }

    /// One drive read of `key` (a [`start_read`](Self::start_read)) is over.
    fn end_read(&mut self, key: &str) {
        if let Some(n) = self.reading.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.reading.remove(key);
            }
        }
    }

    /// A partial drive read of `key` (some of its value's pages, into `job.pages` from
    /// [`take_staging`](Self::take_staging), started by [`start_read`](Self::start_read) without a
    /// flight) came back with `outcome`. The pages become the reader's own copy under a fresh lease
    /// until `until` (returned): held like a dropped key's deferred pages, freed when the lease's
    /// reader releases it or at its end, and never a staged copy of the key (a later whole read
    /// must not find a part). A corrupt header drops the key as [`finish_read`](Self::finish_read)
    /// does; anything else gives the pages back (`None`: a miss).
    pub(super) fn finish_partial(
        &mut self,
        key: &str,
        job: JobSlot,
        outcome: JobOutcome,
        now: Instant,
        until: Instant,
    ) -> Option<u64> {
        let JobSlot { pages, loc, generation, .. } = job;
        self.end_read(key);
        let current = self.generation == generation && self.owned.get(key).is_some_and(|o| o.loc.seq == loc.seq);
        match outcome {
            JobOutcome::Ok if current => {
                let lease = self.lease_ids.next();
                self.lru.touch(key);
                self.deferred.push(Deferred::leased(key, pages, until, lease));
                Some(lease)
            }
            JobOutcome::Corrupt if current => {
                self.free(&pages);
                if self.drop_owned(key, now).is_some() {
                    self.push_event(KvEvent::remove(key.to_owned(), TierType::Ssd));
                }
                None
            }
            _ => {
                self.free(&pages);
                None
            }
        }
    }

    /// Checks a hit of `key` again just before it goes to the reader (see `Inner::revalidate`):
    /// renews its lease from `now`, or turns it into a busy or a miss.
    pub(super) fn revalidate(&mut self, key: &str, entry: &mut ResolvedEntry, now: Instant, until: Instant) {
        if !entry.is_whole() {
            // A partial copy: the reader's own pages, held while its lease lives.
            let held = self.deferred.iter_mut().find(|d| d.holds(key, entry.lease, &entry.pages, now));
            match held {
                Some(d) => d.until = d.until.max(until),
                None if self.owned.contains_key(key) => *entry = ResolvedEntry::busy(),
                None => *entry = ResolvedEntry::miss(),
            }
            return;
        }
        match self.staged.get_mut(key) {
            Some(s) if s.pages == entry.pages && s.size == entry.size => {
                if s.holds(entry.lease, now) {
                    s.extend(until);
                } else {
                    // The hit's lease ended while the batch waited (lapsed, or its other
                    // readers released it): the copy is still intact, so hold it afresh.
                    entry.lease = s.hold(now, until, &mut self.lease_ids);
                }
            }
            // The copy went (its pages were needed), but the key may still be here.
            _ if self.owned.contains_key(key) => *entry = ResolvedEntry::busy(),
            _ => *entry = ResolvedEntry::miss(),
        }
    }

    /// One reader of a hit is done.
    pub(super) fn release_read(&mut self, r: &ReadRelease, now: Instant) -> Released {
        if let Some(s) = self.staged.get_mut(&r.key)
            && s.release(r.lease, now)
        {
            return Released::Lease;
        }
        // A key dropped while this reader copied: its pages wait for the last reader.
        if let Some(at) = self.deferred.iter_mut().position(|d| d.release(&r.key, r.lease, now)) {
            let d = self.deferred.swap_remove(at);
            self.free(&d.pages);
            return Released::Freed;
        }
        Released::Nothing
    }

    // ---- tombstones ------------------------------------------------------------------------

    /// The evictions waiting for their tombstone: key, seq, horizon.
    pub(super) fn take_tomb_pending(&mut self) -> Vec<(String, u64, u64)> {
        std::mem::take(&mut self.tomb_pending)
    }

    /// A tombstone of `key` (seq `loc.seq`, written at `loc` under clear generation `generation`)
    /// is on the drive: puts it in force. Returns whether it dropped an owned record of the key
    /// (one older than the tombstone that was published while it was written).
    pub(super) fn land_tombstone(
        &mut self,
        key: String,
        loc: Loc,
        horizon: u64,
        generation: u64,
        now: Instant,
    ) -> bool {
        // Not needed when a clear wiped the log or the key was put again since.
        let superseded = self.generation != generation || self.owned.get(&key).is_some_and(|o| o.loc.seq > loc.seq);
        if superseded {
            return false;
        }
        // A record of the key older than this tombstone was published while the tombstone was
        // being written (a commit reserved before the eviction and landed after it): recovery
        // would hide it, so memory drops it too.
        let dropped = self.forget_owned(&key, now).is_some();
        if dropped {
            self.push_event(KvEvent::remove(key.clone(), TierType::Ssd));
        }
        self.log.add_live(&loc);
        if let Some(old) = self.tombs.insert(key, Tomb { loc, horizon }) {
            // The newer tombstone covers every segment the older one did.
            self.log.kill(&old.loc);
        }
        dropped
    }

    /// Takes out of force every tombstone no older record of its key can be hiding behind: no
    /// segment up to its horizon is left but its own.
    pub(super) fn retire_tombstones(&mut self) {
        // A tombstone is in force while a segment up to its horizon other than its own exists. With
        // `oldest` and `second` the two smallest segment ids, that holds for every horizon >= `second`;
        // below it, it holds exactly when the horizon reaches `oldest` and the tombstone lies elsewhere.
        // So only tombstones with a horizon below `second` are looked at (through the horizon index),
        // not every tombstone each pass.
        let mut ids = self.log.segs.keys().copied();
        let (oldest, second) = match ids.next() {
            Some(o) => (Some(o), ids.next()),
            None => (None, None),
        };
        let tombs = &self.tombs;
        let retired: Vec<String> = tombs
            .horizons_below(second)
            .filter(|(h, k)| oldest.is_none_or(|o| *h < o || tombs.get(*k).is_some_and(|t| Some(t.loc.seg) == oldest)))
            .map(|(_, k)| k.clone())
            .collect();
        for key in retired {
            if let Some(t) = self.tombs.remove(&key) {
                self.log.kill(&t.loc);
            }
        }
    }

    // ---- compaction ------------------------------------------------------------------------

    /// The writers' expected growth before the next log pass (see [`Pace`]).
    pub(super) fn observe_pace(&mut self) -> u64 {
        let reserved = self.log.reserved_total;
        self.pace.observe(reserved)
    }

    /// Starts compacting segment `seg` unless a compaction runs: its live records and tombstones
    /// in force (key, where, whether a tombstone), from the per-segment index. `None`: another
    /// compaction runs, or nothing is there to move.
    pub(super) fn start_compaction(&mut self, seg: SegId) -> Option<Vec<(String, Loc, bool)>> {
        if self.compacting {
            return None;
        }
        let victims: Vec<(String, Loc, bool)> = self
            .owned
            .keys_in(seg)
            .map(|(k, o)| (k.clone(), o.loc, false))
            .chain(self.tombs.keys_in(seg).map(|(k, t)| (k.clone(), t.loc, true)))
            .collect();
        if victims.is_empty() {
            return None;
        }
        self.compacting = true;
        Some(victims)
    }

    /// Whether a compaction runs.
    pub(super) fn compacting(&self) -> bool {
        self.compacting
    }

    /// The compaction is over: the segments it left dead.
    pub(super) fn end_compaction(&mut self) -> Vec<Arc<SegmentFile>> {
        self.compacting = false;
        self.log.take_dead_segments()
    }

    /// Where the index has `key`'s record (`tomb`: its tombstone) now.
    pub(super) fn record_loc(&self, key: &str, tomb: bool) -> Option<Loc> {
        if tomb { self.tombs.get(key).map(|t| t.loc) } else { self.owned.get(key).map(|o| o.loc) }
    }

    /// Reserves the place of a compaction's copy of `len` bytes (not counted as writers' demand).
    pub(super) fn reserve_copy(&mut self, len: u64) -> Reservation {
        self.pace.compaction += len;
        self.log.reserve(len)
    }

    /// `key`'s record (`tomb`: its tombstone) moved from `old` to `new` (same seq).
    pub(super) fn move_record(&mut self, key: &str, tomb: bool, old: Loc, new: Loc) {
        self.log.kill(&old);
        self.log.add_live(&new);
        if tomb {
            self.tombs.set_loc(key, new);
        } else {
            self.owned.set_loc(key, new);
        }
    }

    /// Panics unless every accounting invariant of the module docs holds; `in_flight` are the
    /// pages and sizes of commits between their lock phases, and `out` every other staging page
    /// held outside (reads in flight).
    #[cfg(test)]
    pub(super) fn check(&self, in_flight: &[(Vec<PageLocation>, u64)], out: u64) {
        let pending: u64 = self.pending.values().map(|p| self.bytes_of(p.size)).sum();
        let committing: u64 = in_flight.iter().map(|(_, s)| self.bytes_of(*s)).sum();
        let owned: u64 = self.owned.values().map(|o| self.bytes_of(o.size)).sum();
        assert_eq!(self.committing, committing, "committing is the commits in flight");
        assert_eq!(self.used, pending + committing + owned, "used is pending + committing + owned");
        assert!(self.used <= self.total, "used {} within the capacity {}", self.used, self.total);
        let overhead: u64 = self.owned.values().map(|o| o.overhead(self.page_size)).sum();
        assert_eq!(self.overhead, overhead, "overhead is the owned records'");
        if let Some(a) = &self.staging {
            let held: u64 = self.pending.values().map(|p| p.pages.len() as u64).sum::<u64>()
                + self.staged.iter().map(|(_, s)| s.pages.len() as u64).sum::<u64>()
                + self.deferred.iter().map(|d| d.pages.len() as u64).sum::<u64>()
                + in_flight.iter().map(|(p, _)| p.len() as u64).sum::<u64>()
                + out;
            assert_eq!(a.total_pages() - a.free_pages(), held, "every page in use has one holder");
        }
        let live: u64 =
            self.owned.values().map(|o| o.loc.len).sum::<u64>() + self.tombs.values().map(|t| t.loc.len).sum::<u64>();
        assert_eq!(self.log.live_bytes(), live, "the log's live bytes are the owned records and tombstones");
        assert_eq!(self.lru.len(), self.owned.len(), "one LRU entry per owned key");
        self.owned.check();
        self.tombs.check();
    }

    /// The owned keys' index (tests).
    #[cfg(test)]
    pub(super) fn owned_index(&self) -> &KeyIndex<Owned> {
        &self.owned
    }

    /// The tombstones' index (tests).
    #[cfg(test)]
    pub(super) fn tombs(&self) -> &KeyIndex<Tomb> {
        &self.tombs
    }

    /// The LRU (tests).
    #[cfg(test)]
    pub(super) fn lru(&self) -> &Lru {
        &self.lru
    }

    /// The staged copies (tests).
    #[cfg(test)]
    pub(super) fn staged(&self) -> &StagedMap {
        &self.staged
    }

    /// The single-flight reads (tests plant and remove one).
    #[cfg(test)]
    pub(super) fn flights_mut(&mut self) -> &mut HashMap<String, Arc<Flight>> {
        &mut self.flights
    }
}
