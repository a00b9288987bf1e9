//! The index of records by key (owned values and tombstones), with indexes by segment and by
//! horizon so compaction and tombstone retirement look only at the records they concern.

use std::collections::BTreeSet;
use std::time::Instant;

use foldhash::{HashMap, HashSet};
use umbp_core::PageLocation;

use crate::store::{Loc, SegId};

#[derive(Debug)]
pub(super) struct Pending {
    pub(super) pages: Vec<PageLocation>,
    pub(super) size: u64,
    pub(super) deadline: Instant,
    pub(super) generation: u64,
}

/// A tombstone on the drive: in force while a segment that may hold an older record of its key
/// (any segment up to `horizon` but its own) still exists.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tomb {
    pub(super) loc: Loc,
    pub(super) horizon: u64,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Owned {
    pub(super) loc: Loc,
    pub(super) size: u64,
    /// The writer's CRC-32C of the value (`CommitRequest::crc32c`), also in the record's header:
    /// handed back on every resolve, never checked here.
    pub(super) crc32c: Option<u32>,
}

impl Owned {
    /// Drive bytes of the record beyond the page-rounded value (header block, padding).
    pub(super) fn overhead(&self, page_size: u64) -> u64 {
        self.loc.len.saturating_sub(self.size.div_ceil(page_size) * page_size)
    }
}

/// A value that names where its record lies on the drive.
pub(super) trait Located {
    fn loc(&self) -> Loc;
    fn set_loc(&mut self, loc: Loc);
    /// A tombstone's horizon (indexed, so retiring tombstones looks at few of them).
    fn horizon(&self) -> Option<u64> {
        None
    }
}

impl Located for Owned {
    fn loc(&self) -> Loc {
        self.loc
    }
    fn set_loc(&mut self, loc: Loc) {
        self.loc = loc;
    }
}

impl Located for Tomb {
    fn loc(&self) -> Loc {
        self.loc
    }
    fn set_loc(&mut self, loc: Loc) {
        self.loc = loc;
    }
    fn horizon(&self) -> Option<u64> {
        Some(self.horizon)
    }
}

/// Records by key with an index by segment, so compaction finds a segment's records in time
/// proportional to their number, not to every key's. Reads go through `Deref` to the map; every
/// change goes through the methods below, which keep the index in step.
#[derive(Debug)]
pub(super) struct KeyIndex<V> {
    map: HashMap<String, V>,
    by_seg: HashMap<SegId, HashSet<String>>,
    /// `(horizon, key)` of the values that have one (tombstones).
    by_horizon: BTreeSet<(u64, String)>,
}

impl<V> Default for KeyIndex<V> {
    fn default() -> Self {
        Self { map: HashMap::default(), by_seg: HashMap::default(), by_horizon: BTreeSet::new() }
    }
}

impl<V> std::ops::Deref for KeyIndex<V> {
    type Target = HashMap<String, V>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<V: Located> KeyIndex<V> {
    fn unindex(&mut self, key: &str, seg: SegId) {
        if let Some(set) = self.by_seg.get_mut(&seg) {
            set.remove(key);
            if set.is_empty() {
                self.by_seg.remove(&seg);
            }
        }
    }

    /// Inserts `key`'s value (returning any old one), indexed by segment and horizon.
    pub(super) fn insert(&mut self, key: String, value: V) -> Option<V> {
        let old = self.remove(&key);
        self.by_seg.entry(value.loc().seg).or_default().insert(key.clone());
        if let Some(h) = value.horizon() {
            self.by_horizon.insert((h, key.clone()));
        }
        self.map.insert(key, value);
        old
    }

    /// Removes `key` and its index entries.
    pub(super) fn remove(&mut self, key: &str) -> Option<V> {
        let v = self.map.remove(key)?;
        self.unindex(key, v.loc().seg);
        if let Some(h) = v.horizon() {
            self.by_horizon.remove(&(h, key.to_owned()));
        }
        Some(v)
    }

    /// Moves `key`'s record to `loc` (a compaction's copy).
    pub(super) fn set_loc(&mut self, key: &str, loc: Loc) {
        let Some(v) = self.map.get_mut(key) else { return };
        let old = v.loc().seg;
        v.set_loc(loc);
        if old != loc.seg {
            self.unindex(key, old);
            self.by_seg.entry(loc.seg).or_default().insert(key.to_owned());
        }
    }

    /// Empties the map and its indexes.
    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.by_seg.clear();
        self.by_horizon.clear();
    }

    /// The keys with a horizon below `bound` (every key with one when `None`), smallest first.
    pub(super) fn horizons_below(&self, bound: Option<u64>) -> impl Iterator<Item = (u64, &String)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let upper = bound.map_or(Unbounded, |b| Excluded((b, String::new())));
        self.by_horizon.range((Unbounded, upper)).map(|(h, k)| (*h, k))
    }

    /// Panics unless the segment index names exactly each key's record segment.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let indexed: usize = self.by_seg.values().map(|s| s.len()).sum();
        assert_eq!(indexed, self.map.len(), "every key is indexed once");
        assert_eq!(self.by_horizon.len(), self.map.values().filter(|v| v.horizon().is_some()).count());
        for (k, v) in &self.map {
            assert!(self.by_seg.get(&v.loc().seg).is_some_and(|s| s.contains(k)), "{k} indexed under its segment");
        }
    }

    /// The keys whose record lies in `seg`.
    pub(super) fn keys_in(&self, seg: SegId) -> impl Iterator<Item = (&String, &V)> {
        self.by_seg.get(&seg).into_iter().flatten().filter_map(|k| self.map.get_key_value(k))
    }
}
