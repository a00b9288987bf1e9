//! The staged copies of owned keys and the read leases on them.
//!
//! A resolve fills (or finds) a staged copy of a key's value in staging pages and hands the reader
//! those pages under a **counted** read lease: every hit adds a reader to the copy's current lease
//! and carries the lease's id; a reader that finished copying releases it
//! ([`MediumBackend::release_reads`](umbp_core::MediumBackend::release_reads)), and the lease ends
//! with its last reader, so the copy's pages can serve the next read at once instead of after the
//! whole lease. The lease's expiry stays the safety net for a reader that died: an expired lease
//! ends whatever its count. A release naming a lease that already ended changes nothing.

use std::collections::BTreeMap;
use std::time::Instant;

use foldhash::HashMap;
use umbp_core::PageLocation;

/// A staged copy of an owned key's value in staging pages: clean, and leased while a reader may be
/// copying out of it.
#[derive(Debug)]
pub(crate) struct Staged {
    pub(crate) pages: Vec<PageLocation>,
    pub(crate) size: u64,
    /// When the current lease ends at the latest; `None`: no lease (a clean cached copy whose
    /// pages may be taken).
    pub(crate) lease_until: Option<Instant>,
    /// The current lease's id (meaningful while `lease_until` is live).
    lease: u64,
    /// Hits of the current lease not yet released.
    readers: u32,
    /// Its place in the use order: set by [`StagedMap`] (insert, touch), never by hand.
    touched: u64,
}

impl Staged {
    /// An unleased copy (a value just written, kept as a clean cache entry).
    pub(crate) fn clean(pages: Vec<PageLocation>, size: u64) -> Self {
        Self { pages, size, lease_until: None, lease: 0, readers: 0, touched: 0 }
    }

    pub(crate) fn leased(&self, now: Instant) -> bool {
        self.lease_until.is_some_and(|t| t > now)
    }

    /// Adds a reader to the live lease (extended to `until`), or starts a lease with id from
    /// `ids`; returns the id the hit carries.
    pub(crate) fn hold(&mut self, now: Instant, until: Instant, ids: &mut LeaseIds) -> u64 {
        if self.leased(now) {
            self.readers = self.readers.saturating_add(1);
            self.lease_until = self.lease_until.map(|t| t.max(until));
        } else {
            self.lease = ids.next();
            self.readers = 1;
            self.lease_until = Some(until);
        }
        self.lease
    }

    /// Whether `lease` is this copy's live lease at `now` (a hit still holding it).
    pub(crate) fn holds(&self, lease: u64, now: Instant) -> bool {
        lease != 0 && self.lease == lease && self.leased(now)
    }

    /// Extends the live lease to `until` without adding a reader.
    pub(crate) fn extend(&mut self, until: Instant) {
        self.lease_until = self.lease_until.map(|t| t.max(until));
    }

    /// Removes one reader of `lease`; the lease ends with its last reader. A lease that is not the
    /// live one is left alone. Returns whether the copy is now unleased.
    pub(crate) fn release(&mut self, lease: u64, now: Instant) -> bool {
        if !self.holds(lease, now) {
            return false;
        }
        self.readers = self.readers.saturating_sub(1);
        if self.readers == 0 {
            self.lease_until = None;
            return true;
        }
        false
    }

    /// Ends the lease if it expired by `now` (the reader's time is up; the copy stays as a clean
    /// cache entry).
    pub(crate) fn expire(&mut self, now: Instant) {
        if self.lease_until.is_some_and(|t| t <= now) {
            self.lease_until = None;
            self.readers = 0;
        }
    }

    /// The lease to defer the copy's pages to when its key is dropped under a reader: its end and
    /// its id, or `None` when no lease is live.
    pub(crate) fn live_lease(&self, now: Instant) -> Option<(Instant, u64)> {
        self.lease_until.filter(|t| *t > now).map(|t| (t, self.lease))
    }
}

/// Lease ids of one medium: never 0, never reused.
#[derive(Debug, Default)]
pub(crate) struct LeaseIds(u64);

impl LeaseIds {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 += 1;
        self.0
    }
}

/// Staging pages under a read lease that no staged copy owns: those of a key dropped (cleared,
/// evicted, corrupt) while a reader held them, or a partial read's (a reader's own copy of some
/// pages of a value, never a cached copy). Freed at the lease's end, or as soon as the lease's
/// last reader releases it.
#[derive(Debug)]
pub(crate) struct Deferred {
    pub(crate) pages: Vec<PageLocation>,
    pub(crate) until: Instant,
    pub(crate) key: String,
    pub(crate) lease: u64,
    readers: u32,
}

impl Deferred {
    /// The pages of `staged` (dropped under key `key`), deferred to its live lease; `Err` gives the
    /// pages back when no lease is live (free them now).
    pub(crate) fn of(key: &str, staged: Staged, now: Instant) -> Result<Self, Vec<PageLocation>> {
        match staged.live_lease(now) {
            Some((until, lease)) => {
                Ok(Self { pages: staged.pages, until, key: key.to_owned(), lease, readers: staged.readers })
            }
            None => Err(staged.pages),
        }
    }

    /// A partial read's `pages` of `key`, held for its one reader under `lease` until `until`.
    pub(crate) fn leased(key: &str, pages: Vec<PageLocation>, until: Instant, lease: u64) -> Self {
        Self { pages, until, key: key.to_owned(), lease, readers: 1 }
    }

    /// Whether these are `pages` of `key` held under the live lease `lease` at `now`.
    pub(crate) fn holds(&self, key: &str, lease: u64, pages: &[PageLocation], now: Instant) -> bool {
        lease != 0 && self.lease == lease && self.key == key && self.until > now && self.pages == pages
    }

    /// Removes one reader of `lease` on `key`; true when that was the last (free the pages now).
    pub(crate) fn release(&mut self, key: &str, lease: u64, now: Instant) -> bool {
        if lease == 0 || self.lease != lease || self.key != key || self.until <= now {
            return false;
        }
        self.readers = self.readers.saturating_sub(1);
        self.readers == 0
    }
}

/// The staged copies by key, with an index by last use: picking the coldest unleased copy walks
/// from the cold end and steps over leased copies only, instead of scanning every copy.
#[derive(Debug, Default)]
pub(crate) struct StagedMap {
    map: HashMap<String, Staged>,
    by_touch: BTreeMap<u64, String>,
    tick: u64,
}

impl StagedMap {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Staged> {
        self.map.get(key)
    }

    /// The copy of `key`, to update its lease (its place in the use order stays: see [`touch`](Self::touch)).
    pub(crate) fn get_mut(&mut self, key: &str) -> Option<&mut Staged> {
        self.map.get_mut(key)
    }

    pub(crate) fn contains_key(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    /// Marks `key`'s copy as the most recently used.
    pub(crate) fn touch(&mut self, key: &str) {
        let tick = self.next_tick();
        if let Some(s) = self.map.get_mut(key) {
            if let Some(k) = self.by_touch.remove(&s.touched) {
                self.by_touch.insert(tick, k);
            }
            s.touched = tick;
        }
    }

    /// Inserts `staged` as the most recently used copy (replacing any copy of the key, returned).
    pub(crate) fn insert(&mut self, key: String, mut staged: Staged) -> Option<Staged> {
        let old = self.remove(&key);
        staged.touched = self.next_tick();
        self.by_touch.insert(staged.touched, key.clone());
        self.map.insert(key, staged);
        old
    }

    pub(crate) fn remove(&mut self, key: &str) -> Option<Staged> {
        let s = self.map.remove(key)?;
        self.by_touch.remove(&s.touched);
        Some(s)
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut Staged> {
        self.map.values_mut()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&String, &Staged)> {
        self.map.iter()
    }

    /// Empties the map, handing back every copy.
    pub(crate) fn take(&mut self) -> HashMap<String, Staged> {
        self.by_touch.clear();
        std::mem::take(&mut self.map)
    }

    /// The least recently used copy with no live lease.
    pub(crate) fn coldest_unleased(&self, now: Instant) -> Option<&String> {
        self.by_touch.values().find(|k| self.map.get(*k).is_some_and(|s| !s.leased(now)))
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        debug_assert_eq!(self.map.len(), self.by_touch.len());
        self.map.len()
    }
}
