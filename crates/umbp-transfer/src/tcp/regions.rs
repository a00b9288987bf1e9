//! The region table shared by a node's [`DataServer`](super::DataServer) and its
//! [`TcpEngine`](super::TcpEngine): registered host regions by id, each with an in-flight count so
//! that deregistration can wait until nobody touches the memory any more.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex, RwLock};
use umbp_core::LocalRegion;

use super::protocol::Status;

/// One registered region.
#[derive(Debug)]
pub(crate) struct RegionEntry {
    region: LocalRegion,
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
        // SAFETY: `offset + len <= region.len()` (checked just above), so the result stays inside
        // the registered region, which is one allocation valid while registered (`LocalRegion`'s
        // invariant) — and it stays registered while this guard lives.
        let ptr = unsafe { region.ptr().as_ptr().add(offset) };
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

/// Registered regions by id. Ids start at 1 and are never reused.
#[derive(Debug)]
pub(crate) struct RegionTable {
    next_id: AtomicU64,
    regions: RwLock<HashMap<u64, Arc<RegionEntry>>>,
}

impl Default for RegionTable {
    fn default() -> Self {
        Self { next_id: AtomicU64::new(1), regions: RwLock::new(HashMap::new()) }
    }
}

impl RegionTable {
    /// Adds `region` under a fresh id.
    pub(crate) fn insert(&self, region: LocalRegion) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let entry = Arc::new(RegionEntry {
            region,
            state: Mutex::new(EntryState { live: true, in_flight: 0 }),
            idle: Condvar::new(),
        });
        self.regions.write().insert(id, entry);
        id
    }

    /// A guard over region `id`, or `None` when no live region has that id.
    pub(crate) fn acquire(&self, id: u64) -> Option<RegionGuard> {
        let entry = Arc::clone(self.regions.read().get(&id)?);
        {
            let mut state = entry.state.lock();
            if !state.live {
                return None;
            }
            state.in_flight += 1;
        }
        Some(RegionGuard { entry })
    }

    /// Whether `id` is live and describes exactly `region`.
    pub(crate) fn is_registered(&self, id: u64, region: &LocalRegion) -> bool {
        self.regions.read().get(&id).is_some_and(|e| e.region == *region)
    }

    /// Removes region `id` if it describes `region`, then blocks until every guard over it is gone.
    /// Returns whether anything was removed. Unknown ids and mismatching regions are a no-op.
    pub(crate) fn remove(&self, id: u64, region: &LocalRegion) -> bool {
        let entry = {
            let mut map = self.regions.write();
            match map.get(&id) {
                Some(e) if e.region == *region => map.remove(&id),
                _ => None,
            }
        };
        let Some(entry) = entry else { return false };
        let mut state = entry.state.lock();
        state.live = false;
        while state.in_flight > 0 {
            // Every guard is held by an operation bounded by socket timeouts, so this ends.
            entry.idle.wait(&mut state);
        }
        true
    }

    /// Number of live regions.
    pub(crate) fn len(&self) -> usize {
        self.regions.read().len()
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
        let id = table.insert(region(&mut buf));
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
        let id = table.insert(ra);
        assert!(!table.remove(id, &rb), "a mismatching region is a no-op");
        assert!(table.remove(id, &ra));
        assert!(!table.remove(id, &ra), "twice is a no-op");
        assert!(table.acquire(id).is_none());
        assert!(table.insert(ra) > id);
    }

    #[test]
    fn removal_waits_for_guards() {
        let mut buf = [0u8; 64];
        let r = region(&mut buf);
        let table = Arc::new(RegionTable::default());
        let id = table.insert(r);
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
}
