//! The region table shared by a node's [`DataServer`](super::DataServer) and its
//! [`TcpEngine`](super::TcpEngine): registered host regions by id, each with an in-flight count so
//! that deregistration can wait until nobody touches the memory any more.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use parking_lot::{Condvar, Mutex};
use umbp_core::LocalRegion;

use super::protocol::Status;

/// One registered region.
#[derive(Debug)]
pub(crate) struct RegionEntry {
    region: LocalRegion,
    /// Whether peers may address the region (false: only this node's own engine uses it, as the
    /// local side of its transfers — the composite engine's bounce pool).
    remote: bool,
    state: Mutex<EntryState>,
    idle: Condvar,
}

#[derive(Debug)]
struct EntryState {
    /// False once deregistration started: no new guard is handed out.
    live: bool,
    /// Guards alive now.
    in_flight: usize,
}

/// Proof that an operation may touch a region's memory: while any guard lives, deregistration of
/// the region blocks, so the owner cannot free the memory (the [`LocalRegion`] invariant holds).
#[derive(Debug)]
pub(crate) struct RegionGuard {
    entry: Arc<RegionEntry>,
}

impl RegionGuard {
    /// The region this guard keeps alive.
    pub(crate) fn region(&self) -> &LocalRegion {
        &self.entry.region
    }

    /// A pointer to `len` bytes at `offset` in the region, or the status to answer with.
    ///
    /// The range is checked with checked arithmetic against the registered length; a returned
    /// pointer is therefore valid for `len` bytes for as long as this guard lives.
    pub(crate) fn range(&self, offset: u64, len: u64) -> Result<(*mut u8, usize), Status> {
        let region = &self.entry.region;
        match offset.checked_add(len) {
            Some(end) if end <= region.len() => {}
            _ => return Err(Status::OutOfRange),
        }
        let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
            return Err(Status::OutOfRange);
        };
        // `offset + len <= region.len()` (checked just above), so the result stays inside the
        // registered region, valid while registered (`LocalRegion`'s invariant) — and it stays
        // registered while this guard lives. `wrapping_add`: the region may be device memory, no
        // Rust allocation, so `add`'s in-bounds rule cannot be claimed for it.
        let ptr = region.ptr().as_ptr().wrapping_add(offset);
        Ok((ptr, len))
    }
}

impl Clone for RegionGuard {
    fn clone(&self) -> Self {
        self.entry.state.lock().in_flight += 1;
        Self { entry: Arc::clone(&self.entry) }
    }
}

impl Drop for RegionGuard {
    fn drop(&mut self) {
        let mut state = self.entry.state.lock();
        state.in_flight -= 1;
        if state.in_flight == 0 && !state.live {
            self.entry.idle.notify_all();
        }
    }
}

/// Access to the local side of one plan of a [`TcpEngine`](super::TcpEngine) batch: either a region
/// registered with this engine (its guard keeps deregistration waiting while the batch may touch
/// it), or caller memory that is not registered, valid for the batch by the caller's contract (the
/// [`LocalRegion`] invariant: it stays valid while any copy of the region is used, which for a
/// batch is until its handle has been waited or dropped).
#[derive(Debug)]
pub(crate) enum LocalSide {
    /// A live registration of this engine.
    Registered(RegionGuard),
    /// Unregistered host memory: the ref's local region, bounded by `len` (the smaller of the
    /// ref's size and the region's length).
    Caller {
        /// The caller's region.
        region: LocalRegion,
        /// Bytes of the region the plan may reach.
        len: u64,
    },
}

impl LocalSide {
    /// A pointer to `len` bytes at `offset`, or `Err` when the range leaves the side's bounds.
    ///
    /// The range is checked with checked arithmetic; a returned pointer is valid for `len` bytes
    /// for as long as the registration guard lives (registered memory) or as the caller keeps its
    /// memory valid (unregistered memory: until the batch's handle is waited or dropped).
    pub(crate) fn range(&self, offset: u64, len: u64) -> Result<*mut u8, Status> {
        match self {
            Self::Registered(guard) => guard.range(offset, len).map(|(ptr, _)| ptr),
            Self::Caller { region, len: bound } => {
                match offset.checked_add(len) {
                    Some(end) if end <= *bound && *bound <= region.len() => {}
                    _ => return Err(Status::OutOfRange),
                }
                let (Ok(offset), Ok(_)) = (usize::try_from(offset), usize::try_from(len)) else {
                    return Err(Status::OutOfRange);
                };
                // `offset + len <= bound <= region.len()` (checked just above), so the result stays
                // inside the caller's region, valid for the batch under `LocalRegion`'s invariant
                // (`wrapping_add`: address arithmetic only, whatever memory the region is).
                Ok(region.ptr().as_ptr().wrapping_add(offset))
            }
        }
    }

    /// The registration guard, if the side is registered memory.
    pub(crate) fn into_guard(self) -> Option<RegionGuard> {
        match self {
            Self::Registered(guard) => Some(guard),
            Self::Caller { .. } => None,
        }
    }
}

/// Bits of a region id that count registrations; the bits above them are the table's epoch.
const COUNTER_BITS: u32 = 40;

/// Registered regions by id. An id is (a random 24-bit epoch per table) << 40 | (a counter from 1),
/// never reused: a peer holding ids from before this process restarted addresses no live region of
/// the new process (except with a chance of 1 in 2^24) and gets "unknown region" instead of
/// another buffer's bytes.
///
/// A [`DashMap`]: every request the data server serves, and every batch the client submits, looks
/// a region up here, so lookups on different connections take different shard locks instead of all
/// counting themselves into one reader lock.
#[derive(Debug)]
pub(crate) struct RegionTable {
    epoch: u64,
    next_id: AtomicU64,
    regions: DashMap<u64, Arc<RegionEntry>>,
}

impl Default for RegionTable {
    fn default() -> Self {
        Self { epoch: random_epoch(), next_id: AtomicU64::new(1), regions: DashMap::new() }
    }
}

/// 24 random bits, never 0 (std's per-process hash keys, mixed with the time and the process id).
fn random_epoch() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    let bits = h.finish() >> COUNTER_BITS;
    bits.max(1)
}

/// Whether `local` (a ref's local view, possibly narrowed by `TransferRef::truncated`) lies inside
/// the registered `region`: the same base address and location, no longer.
fn within(region: &LocalRegion, local: &LocalRegion) -> bool {
    region.ptr() == local.ptr() && region.location() == local.location() && local.len() <= region.len()
}

impl RegionTable {
    /// Adds `region` under a fresh id; `remote`: whether peers may address it.
    pub(crate) fn insert(&self, region: LocalRegion, remote: bool) -> u64 {
        let counter = self.next_id.fetch_add(1, Ordering::Relaxed) & ((1 << COUNTER_BITS) - 1);
        let id = (self.epoch << COUNTER_BITS) | counter;
        let entry = Arc::new(RegionEntry {
            region,
            remote,
            state: Mutex::new(EntryState { live: true, in_flight: 0 }),
            idle: Condvar::new(),
        });
        self.regions.insert(id, entry);
        id
    }

    /// A guard over region `id` for this node's own use, or `None` when no live region has that id.
    pub(crate) fn acquire(&self, id: u64) -> Option<RegionGuard> {
        self.acquire_if(id, |_| true)
    }

    /// A guard over region `id` for a peer's request: `None` also for regions registered as
    /// local-only.
    pub(crate) fn acquire_remote(&self, id: u64) -> Option<RegionGuard> {
        self.acquire_if(id, |e| e.remote)
    }

    fn acquire_if(&self, id: u64, allowed: impl FnOnce(&RegionEntry) -> bool) -> Option<RegionGuard> {
        let entry = self.regions.get(&id).map(|e| Arc::clone(e.value()))?;
        if !allowed(&entry) {
            return None;
        }
        {
            let mut state = entry.state.lock();
            if !state.live {
                return None;
            }
            state.in_flight += 1;
        }
        Some(RegionGuard { entry })
    }

    /// Whether `id` is live and `local` lies inside it (see [`within`]).
    pub(crate) fn is_registered(&self, id: u64, local: &LocalRegion) -> bool {
        self.regions.get(&id).is_some_and(|e| within(&e.region, local))
    }

    /// Removes region `id` if `local` lies inside it (a truncated ref of the region deregisters it
    /// too), then blocks until every guard over it is gone. Returns whether anything was removed.
    /// Unknown ids and foreign regions are a no-op.
    pub(crate) fn remove(&self, id: u64, local: &LocalRegion) -> bool {
        let Some((_, entry)) = self.regions.remove_if(&id, |_, e| within(&e.region, local)) else { return false };
        let mut state = entry.state.lock();
        state.live = false;
        while state.in_flight > 0 {
            // Every guard is held by an operation with a deadline (server requests, client
            // batches), so this ends.
            entry.idle.wait(&mut state);
        }
        true
    }

    /// Number of live regions.
    pub(crate) fn len(&self) -> usize {
        self.regions.len()
    }
}

#[cfg(test)]
mod tests {
    use std::ptr::NonNull;
    use std::time::Duration;

    use umbp_core::MemoryLocation;

    use super::*;

    fn region(buf: &mut [u8]) -> LocalRegion {
        // SAFETY: every test keeps `buf` alive past the table's use of it.
        unsafe { LocalRegion::new(NonNull::from(buf).cast(), 64, MemoryLocation::Host) }
    }

    #[test]
    fn ranges_are_bounds_checked() {
        let mut buf = [0u8; 64];
        let table = RegionTable::default();
        let id = table.insert(region(&mut buf), true);
        let guard = table.acquire(id).expect("live");
        assert!(guard.range(0, 64).is_ok());
        assert!(guard.range(64, 0).is_ok());
        assert_eq!(guard.range(1, 64), Err(Status::OutOfRange));
        assert_eq!(guard.range(u64::MAX, 2), Err(Status::OutOfRange));
        assert_eq!(guard.range(65, 0), Err(Status::OutOfRange));
    }

    #[test]
    fn ids_are_never_reused_and_removal_needs_the_same_region() {
        let mut a = [0u8; 64];
        let mut b = [0u8; 64];
        let table = RegionTable::default();
        let ra = region(&mut a);
        let rb = region(&mut b);
        let id = table.insert(ra, true);
        assert!(!table.remove(id, &rb), "a mismatching region is a no-op");
        assert!(table.remove(id, &ra));
        assert!(!table.remove(id, &ra), "twice is a no-op");
        assert!(table.acquire(id).is_none());
        assert!(table.insert(ra, true) > id);
    }

    #[test]
    fn removal_waits_for_guards() {
        let mut buf = [0u8; 64];
        let r = region(&mut buf);
        let table = Arc::new(RegionTable::default());
        let id = table.insert(r, true);
        let guard = table.acquire(id).expect("live");
        let second = guard.clone();
        drop(guard);
        let (tx, rx) = std::sync::mpsc::channel();
        let t = {
            let table = Arc::clone(&table);
            std::thread::spawn(move || {
                table.remove(id, &r);
                let _ = tx.send(());
            })
        };
        assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "removal must wait for the guard");
        assert!(table.acquire(id).is_none(), "no new guard once removal started");
        drop(second);
        assert!(rx.recv_timeout(Duration::from_secs(5)).is_ok());
        t.join().expect("join");
    }

    #[test]
    fn ids_of_two_tables_differ_in_their_epoch() {
        let mut buf = [0u8; 64];
        let r = region(&mut buf);
        // Two tables (two processes, or one restarted) draw independent 24-bit epochs; retry a few
        // times so a 1-in-16M coincidence cannot fail the test.
        let differs = (0..4).any(|_| {
            let (a, b) = (RegionTable::default(), RegionTable::default());
            let (x, y) = (a.insert(r, true), b.insert(r, true));
            x != y && b.acquire(x).is_none()
        });
        assert!(differs, "a stale id from another table must not address a live region");
        let t = RegionTable::default();
        assert_eq!(t.insert(r, true) >> COUNTER_BITS, t.epoch);
        assert_ne!(t.epoch, 0);
    }

    #[test]
    fn a_truncated_view_matches_and_deregisters_its_region() {
        let mut buf = [0u8; 64];
        let full = region(&mut buf);
        let table = RegionTable::default();
        let id = table.insert(full, true);
        // SAFETY: the same memory as `full`, narrowed.
        let narrow = unsafe { LocalRegion::new(full.ptr(), 32, MemoryLocation::Host) };
        // SAFETY: never dereferenced.
        let wider = unsafe { LocalRegion::new(full.ptr(), 128, MemoryLocation::Host) };
        assert!(table.is_registered(id, &narrow));
        assert!(!table.is_registered(id, &wider), "a view longer than the registration is refused");
        assert!(table.remove(id, &narrow));
        assert!(table.acquire(id).is_none());
    }

    #[test]
    fn local_only_regions_are_not_handed_to_peers() {
        let mut buf = [0u8; 64];
        let table = RegionTable::default();
        let id = table.insert(region(&mut buf), false);
        assert!(table.acquire(id).is_some());
        assert!(table.acquire_remote(id).is_none());
    }
}
