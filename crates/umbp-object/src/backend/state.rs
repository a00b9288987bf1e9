//! `State`: everything behind the object medium's one lock, and the byte accounting over it.
//!
//! Invariants every method keeps:
//! - `used` is the page-rounded bytes of the pending slots, plus those of the uploads in flight,
//!   plus those of the owned keys; `used <= total` (admission checks it);
//! - every staging page is free or held by one holder: a pending slot, an upload in flight, a
//!   staged copy (filling, or filled and maybe leased), or a deferred free. An upload or a filling
//!   copy's download gives its pages back itself, when it completes.

use std::collections::HashMap;
use std::time::Instant;

use umbp_core::{EventOutbox, KvEvent, PageLocation, TierCapacity, TierType};
use umbp_page::PageBitmapAllocator;

/// The tier this medium reports (see the crate docs: a staged medium to the routing plane).
pub(super) const TIER: TierType = TierType::Ssd;

/// An allocated slot waiting for its commit.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) pages: Vec<PageLocation>,
    pub(super) size: u64,
    pub(super) deadline: Instant,
    pub(super) generation: u64,
}

/// An owned key: its value's size, the seq of the object holding it, the writer's checksum.
#[derive(Debug, Clone, Copy)]
pub(super) struct Owned {
    pub(super) size: u64,
    pub(super) seq: u64,
    pub(super) crc32c: Option<u32>,
}

/// A staged copy of an owned key's value in staging pages: filling (its download in flight), or
/// filled, leased while readers copy out of it and a clean cache entry after.
#[derive(Debug)]
pub(super) struct Staged {
    pub(super) pages: Vec<PageLocation>,
    pub(super) size: u64,
    /// The download that fills it: the copy's identity.
    pub(super) flight: u64,
    /// Whether that download is still in flight (the pages belong to it).
    pub(super) filling: bool,
    /// Resolves waiting for it to fill: it may not be reclaimed under them.
    pub(super) waiters: u32,
    lease: u64,
    readers: u32,
    until: Option<Instant>,
    touched: u64,
}

impl Staged {
    fn leased(&self, now: Instant) -> bool {
        self.until.is_some_and(|t| t > now)
    }

    /// Whether its pages may be taken for another use now.
    fn reclaimable(&self, now: Instant) -> bool {
        !self.filling && self.waiters == 0 && !self.leased(now)
    }

    /// Whether the key must not be evicted now: a reader holds or awaits the copy.
    pub(super) fn protects(&self, now: Instant) -> bool {
        self.filling || self.waiters > 0 || self.leased(now)
    }
}

/// Pages of a key dropped (cleared, evicted, lost) while readers held them: freed at the lease's
/// end, or when its last reader releases it.
#[derive(Debug)]
struct Deferred {
    pages: Vec<PageLocation>,
    key: String,
    lease: u64,
    readers: u32,
    until: Instant,
}

/// Everything behind the medium's lock.
#[derive(Debug)]
pub(super) struct State {
    page_size: u64,
    /// `None` until `init` and after `shutdown`.
    staging: Option<PageBitmapAllocator>,
    pub(super) pending: HashMap<u64, Pending>,
    pub(super) owned: HashMap<String, Owned>,
    pub(super) copies: HashMap<String, Staged>,
    deferred: Vec<Deferred>,
    used: u64,
    total: u64,
    pub(super) generation: u64,
    next_seq: u64,
    next_lease: u64,
    next_flight: u64,
    tick: u64,
    pub(super) outbox: EventOutbox,
}

impl State {
    pub(super) fn new(page_size: u64) -> Self {
        Self {
            page_size,
            staging: None,
            pending: HashMap::new(),
            owned: HashMap::new(),
            copies: HashMap::new(),
            deferred: Vec::new(),
            used: 0,
            total: 0,
            generation: 0,
            next_seq: 1,
            next_lease: 0,
            next_flight: 0,
            tick: 0,
            outbox: EventOutbox::default(),
        }
    }

    /// Goes live over what recovery found; seqs continue after `next_seq`.
    pub(super) fn install(
        &mut self,
        staging: PageBitmapAllocator,
        total: u64,
        owned: Vec<(String, Owned)>,
        next_seq: u64,
    ) {
        self.used = owned.iter().map(|(_, o)| self.bytes_of(o.size)).sum();
        self.owned = owned.into_iter().collect();
        self.total = total;
        self.next_seq = next_seq;
        self.staging = Some(staging);
    }

    pub(super) fn is_live(&self) -> bool {
        self.staging.is_some()
    }

    /// The bytes a value of `size` takes against the capacity (page-rounded).
    pub(super) fn bytes_of(&self, size: u64) -> u64 {
        size.div_ceil(self.page_size) * self.page_size
    }

    pub(super) fn capacity(&self) -> TierCapacity {
        if !self.is_live() {
            return TierCapacity::default();
        }
        TierCapacity { total_bytes: self.total, available_bytes: self.total.saturating_sub(self.used) }
    }

    /// Whether `size` more bytes fit the capacity.
    pub(super) fn fits(&self, size: u64) -> bool {
        self.used + self.bytes_of(size) <= self.total
    }

    /// Counts `size` against the capacity (a new slot).
    pub(super) fn reserve(&mut self, size: u64) {
        self.used += self.bytes_of(size);
    }

    /// Gives `size` back (a slot or upload that ended without a key, a key dropped).
    pub(super) fn unreserve(&mut self, size: u64) {
        self.used = self.used.saturating_sub(self.bytes_of(size));
    }

    pub(super) fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq - 1
    }

    pub(super) fn next_flight(&mut self) -> u64 {
        self.next_flight += 1;
        self.next_flight
    }

    pub(super) fn push_event(&mut self, event: KvEvent) {
        self.outbox.push(event);
    }

    // ---- staging pages --------------------------------------------------------------------

    /// `n` free staging pages, reclaiming the coldest unleased cached copies if needed; `None`
    /// when readers and writers hold too many (busy).
    pub(super) fn take_pages(&mut self, n: u64, now: Instant) -> Option<Vec<PageLocation>> {
        loop {
            let free = self.staging.as_ref()?.free_pages();
            if free >= n {
                return self.staging.as_mut()?.allocate(n);
            }
            let coldest = self
                .copies
                .iter()
                .filter(|(_, c)| c.reclaimable(now))
                .min_by_key(|(_, c)| c.touched)
                .map(|(k, _)| k.clone())?;
            if let Some(c) = self.copies.remove(&coldest) {
                self.free_pages(&c.pages);
            }
        }
    }

    /// Returns pages to the arena (a no-op once shut down: the arena went with the state).
    pub(super) fn free_pages(&mut self, pages: &[PageLocation]) {
        if let Some(s) = self.staging.as_mut() {
            s.deallocate(pages);
        }
    }

    /// How many staging pages are free (for tests and logs).
    pub(super) fn free_staging_pages(&self) -> u64 {
        self.staging.as_ref().map_or(0, PageBitmapAllocator::free_pages)
    }

    // ---- staged copies and leases ---------------------------------------------------------

    /// Starts a copy of `key` filling by download `flight`, with one waiter (the resolve that
    /// started it).
    pub(super) fn start_copy(&mut self, key: &str, pages: Vec<PageLocation>, size: u64, flight: u64) {
        let copy =
            Staged { pages, size, flight, filling: true, waiters: 1, lease: 0, readers: 0, until: None, touched: 0 };
        self.copies.insert(key.to_owned(), copy);
    }

    /// Keeps a just-uploaded value's pages as a clean (unleased) copy of `key`, so a read of it
    /// downloads nothing until its pages are wanted for something else.
    pub(super) fn cache_copy(&mut self, key: &str, pages: Vec<PageLocation>, size: u64) {
        self.tick += 1;
        self.next_flight += 1;
        let copy = Staged {
            pages,
            size,
            flight: self.next_flight,
            filling: false,
            waiters: 0,
            lease: 0,
            readers: 0,
            until: None,
            touched: self.tick,
        };
        if let Some(old) = self.copies.insert(key.to_owned(), copy) {
            // A key just published has no copy; a stale one (never leased) goes back.
            self.free_pages(&old.pages);
        }
    }

    /// Adds a reader to the filled copy of `key` (starting a lease, or joining the live one and
    /// extending it to `until`); returns its pages, size and lease id.
    pub(super) fn hold(&mut self, key: &str, now: Instant, until: Instant) -> Option<(Vec<PageLocation>, u64, u64)> {
        self.tick += 1;
        let tick = self.tick;
        let c = self.copies.get_mut(key).filter(|c| !c.filling)?;
        if c.leased(now) {
            c.readers = c.readers.saturating_add(1);
            c.until = c.until.map(|t| t.max(until));
        } else {
            self.next_lease += 1;
            c.lease = self.next_lease;
            c.readers = 1;
            c.until = Some(until);
        }
        c.touched = tick;
        Some((c.pages.clone(), c.size, c.lease))
    }

    /// Removes one reader of lease `lease` on `key`, from its copy or from a dropped key's
    /// deferred pages (freed with the last reader).
    pub(super) fn release(&mut self, key: &str, lease: u64, now: Instant) {
        if lease == 0 {
            return;
        }
        if let Some(c) = self.copies.get_mut(key)
            && c.lease == lease
            && c.leased(now)
        {
            c.readers = c.readers.saturating_sub(1);
            if c.readers == 0 {
                c.until = None;
            }
            return;
        }
        if let Some(i) = self.deferred.iter().position(|d| d.key == key && d.lease == lease && d.until > now) {
            let d = &mut self.deferred[i];
            d.readers = d.readers.saturating_sub(1);
            if d.readers == 0 {
                let d = self.deferred.swap_remove(i);
                self.free_pages(&d.pages);
            }
        }
    }

    /// Drops `key`'s copy: a filling copy's pages stay with its download (which frees them), a
    /// leased copy's are deferred to its lease, the rest are freed now.
    pub(super) fn drop_copy(&mut self, key: &str, now: Instant) {
        let Some(c) = self.copies.remove(key) else { return };
        if c.filling {
            return;
        }
        match c.until.filter(|t| *t > now) {
            Some(until) => {
                self.deferred.push(Deferred {
                    pages: c.pages,
                    key: key.to_owned(),
                    lease: c.lease,
                    readers: c.readers,
                    until,
                });
            }
            None => self.free_pages(&c.pages),
        }
    }

    /// Drops an owned key (evicted, lost by the store): its copy, its bytes; returns its record.
    pub(super) fn drop_owned(&mut self, key: &str, now: Instant) -> Option<Owned> {
        let o = self.owned.remove(key)?;
        self.drop_copy(key, now);
        self.unreserve(o.size);
        Some(o)
    }

    /// Drops every unleased filled copy (so the next resolve of each key downloads it).
    pub(super) fn drop_clean_copies(&mut self, now: Instant) {
        let clean: Vec<String> =
            self.copies.iter().filter(|(_, c)| c.reclaimable(now)).map(|(k, _)| k.clone()).collect();
        for k in clean {
            self.drop_copy(&k, now);
        }
    }

    // ---- expiry and clear -----------------------------------------------------------------

    /// Frees what expired by `now`: pending slots past their TTL, ended leases, deferred pages.
    pub(super) fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| *id).collect();
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                self.free_pages(&p.pages);
                self.unreserve(p.size);
            }
        }
        for c in self.copies.values_mut() {
            if c.until.is_some_and(|t| t <= now) {
                c.until = None;
                c.readers = 0;
            }
        }
        let (due, keep): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.deferred).into_iter().partition(|d| d.until <= now);
        self.deferred = keep;
        for d in due {
            self.free_pages(&d.pages);
        }
    }

    /// Forgets every owned key (no events), bumps the generation; returns the dropped keys and
    /// seqs, whose objects the caller deletes.
    pub(super) fn clear(&mut self, now: Instant) -> Vec<(String, u64)> {
        self.generation += 1;
        let keys: Vec<String> = self.copies.keys().cloned().collect();
        for k in keys {
            self.drop_copy(&k, now);
        }
        let owned = std::mem::take(&mut self.owned);
        for o in owned.values() {
            self.unreserve(o.size);
        }
        self.outbox.clear();
        owned.into_iter().map(|(k, o)| (k, o.seq)).collect()
    }

    /// Every owned key as an `Add` event.
    pub(super) fn owned_events(&self) -> Vec<KvEvent> {
        self.owned.iter().map(|(k, o)| KvEvent::add(k.clone(), TIER, o.size)).collect()
    }
}
