//! `SsdBackend`: the slot lifecycle of a staged medium.
//!
//! ```text
//! allocate ─► PENDING (staging pages) ─commit: spill─► OWNED (record on the drive)
//!                                                        │  staging pages ─► cached clean copy, or free
//! resolve of an OWNED key: cached copy? ─yes─► lease it  │
//!                          └─no─► take staging pages, read the drive (single flight), verify CRC, lease
//! evict / LRU eviction: OWNED ─► dead record (space reclaimed by the reaper) + REMOVE
//!                                 + a tombstone record (written by the reaper) for restarts
//! ```
//!
//! Every call works in three phases when it touches the drive: take what it needs under the lock,
//! do the IO with no lock held, and come back under the lock to publish the outcome (re-checking the
//! clear generation and the key's record, which may have changed meanwhile).
//!
//! One module per concern (the layout of foyer's block engine); this one holds the backend's
//! types and a thin [`MediumBackend`] impl that delegates to them:
//!
//! | module | concern |
//! |---|---|
//! | `state` | [`State`](state::State), everything behind the one lock, and the byte accounting (fields private, invariants in its methods) |
//! | `index` | the records by key, indexed by segment and by tombstone horizon |
//! | `lifecycle` | `init`, `shutdown`, `clear_local`, the reaper threads and expiry |
//! | `recover` | opening the directories and scanning the log at `init` |
//! | `write` | allocate (admission, eviction to make room), commit, abort |
//! | `read` | resolve with single flight, re-validation, read releases |
//! | `ranged` | ranged resolves: only the pages the ranges cover read and staged, as the reader's own copy |
//! | `io_jobs` | the drive IO of read and write jobs, no lock held |
//! | `reclaim` | the log thread's pass, segment deletion, compaction |
//! | `tombstone` | writing evictions' tombstones and putting them in force |
//! | `sync` | the periodic and on-demand `fdatasync` |
//! | `metrics` | counters, [`SsdStats`], the metric samples |

use std::fmt;
use std::fs;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};
use foldhash::{HashMap, HashSet};
use parking_lot::{Condvar, Mutex, MutexGuard, RwLock};
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BufferDesc, CommitRequest,
    CommitResult, EvictResult, KvEvent, LocalRegion, MediumBackend, MemoryLocation, MemoryRegistrar, MetricSample,
    MetricSource, PageLocation, ResolvedEntry, TierCapacity, TierType, TransferRef, metric_names,
};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBitmapAllocator, PageMemorySource, RawBuffer};

use crate::config::SsdConfig;
use crate::io::{AlignedBuf, IoEngine, IoOp, make_engine, probe_direct_io};
use crate::record::{self, HeaderError, MAX_KEY_LEN, header_len, record_len};
use crate::store::{DirState, Loc, Log, SegId, SegMeta, SegmentFile, sync_dir};

use index::{Owned, Tomb};
use io_jobs::{Job, JobOutcome};
use lifecycle::Reaper;
pub use metrics::SsdStats;
use metrics::{Counters, bump};
use read::Flight;
use recover::Recovered;
use state::State;

mod index;
mod io_jobs;
mod lifecycle;
mod metrics;
mod ranged;
#[cfg(test)]
mod ranged_tests;
mod read;
mod reclaim;
mod recover;
mod state;
#[cfg(test)]
mod state_tests;
mod sync;
#[cfg(test)]
mod tests;
mod tombstone;
mod write;

/// The name this medium reports.
const NAME: &str = "SsdBackend";

/// What `init` published: immutable until `shutdown`.
#[derive(Debug)]
struct Published {
    registrar: Arc<dyn MemoryRegistrar>,
    registered: TransferRef,
    r#ref: TransferRef,
    desc: BufferDesc,
    /// The arena's base address and length.
    base: RawBuffer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    New,
    Live,
    ShutDown,
}

struct Inner {
    config: SsdConfig,
    state: Mutex<State>,
    published: RwLock<Option<Arc<Published>>>,
    engine: RwLock<Option<Arc<dyn IoEngine>>>,
    next_slot_id: AtomicU64,
    clear_pending: AtomicBool,
    counters: Counters,
    /// The directories' locked lock files (see [`recover::lock_dir`]), from `init` to `shutdown`.
    locks: Mutex<Vec<fs::File>>,
    /// When the reaper last synced the segments (`None`: never).
    last_sync: Mutex<Option<Instant>>,
    /// Held through a sync pass (never with `state`'s lock held across a sync).
    sync_pass: Mutex<()>,
}

/// The SSD medium: a registered host staging arena over an append-only drive log (see the crate
/// docs for what it owns, and `docs/ssd.md` for the choices it makes).
///
/// Built from an [`SsdConfig`]; nothing is allocated, opened or read until
/// [`init`](MediumBackend::init), which recovers what an earlier medium left in the directories:
///
/// ```
/// use std::sync::Arc;
/// use umbp_core::{MediumBackend, TierType};
/// use umbp_ssd::{SsdBackend, SsdConfig};
///
/// let dir = tempfile::tempdir()?;
/// let config = SsdConfig::builder([dir.path()])
///     .page_size(4096)
///     .capacity_bytes(1 << 20)
///     .staging_pages(16)
///     .segment_bytes(1 << 20)
///     .build()?;
/// let ssd = SsdBackend::new(config);
/// ssd.init(Arc::new(umbp_testkit::LocalOnlyRegistrar::new()))?;
/// assert_eq!(ssd.tier(), TierType::Ssd);
/// assert_eq!(ssd.capacity().total_bytes, 1 << 20);
/// assert_eq!(ssd.owned_key_count(), 0, "an empty directory recovers nothing");
/// ssd.shutdown();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct SsdBackend {
    inner: Arc<Inner>,
    source: HostPageMemorySource,
    lifecycle: Mutex<Lifecycle>,
    reaper: Mutex<Option<Reaper>>,
}

impl fmt::Debug for SsdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SsdBackend")
            .field("config", &self.inner.config)
            .field("lifecycle", &*self.lifecycle.lock())
            .finish_non_exhaustive()
    }
}

impl SsdBackend {
    /// A backend with `config`; nothing is allocated, opened or read until [`MediumBackend::init`].
    pub fn new(config: SsdConfig) -> Self {
        // Prefaulted: the first spill or fill into a page must not pay its page faults.
        // Shareable: a sealed memory file a same-host peer may map (the registrar learns its file).
        let options = HostMemoryOptions { shareable: config.shareable_staging, ..HostMemoryOptions::default() };
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::new(config.page_size)),
                config,
                published: RwLock::new(None),
                engine: RwLock::new(None),
                next_slot_id: AtomicU64::new(1),
                clear_pending: AtomicBool::new(false),
                counters: Counters::default(),
                locks: Mutex::new(Vec::new()),
                last_sync: Mutex::new(None),
                sync_pass: Mutex::new(()),
            }),
            source: HostPageMemorySource::new(options),
            lifecycle: Mutex::new(Lifecycle::New),
            reaper: Mutex::new(None),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SsdConfig {
        &self.inner.config
    }

    /// Runs one reaper pass now: expired slots and leases, due deferred frees, deletion of dead
    /// segments, tombstone writes and compaction if the log needs the room.
    pub fn reaper_tick(&self) {
        self.inner.sweep();
    }

    /// `fdatasync`s every segment written since the last sync, now (the reaper does it every
    /// `sync_interval`). When it returns, every record whose commit returned before the call is on
    /// stable storage, short of a hole left by a write still in flight (see the crate docs).
    pub fn sync(&self) {
        self.inner.sync_segments();
    }

    /// Drops every unleased cached staged copy, so the next resolve of each key reads the drive.
    pub fn drop_cached_copies(&self) {
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        state.drop_unleased_copies(now);
        self.inner.update_staging_gauge(&state);
    }
}

impl Inner {
    fn engine(&self) -> Option<Arc<dyn IoEngine>> {
        self.engine.read().clone()
    }

    fn update_staging_gauge(&self, state: &State) {
        self.counters.staging_in_use.store(state.staging_in_use(), Ordering::Relaxed);
    }

    pub(super) fn entry(&self, published: Option<&Published>, hit: state::Hit) -> ResolvedEntry {
        ResolvedEntry {
            found: true,
            pages: hit.pages,
            size: hit.size,
            page_size: self.config.page_size,
            descs: published.map(|p| vec![p.desc.clone()]).unwrap_or_default(),
            lease: hit.lease,
            crc32c: hit.crc32c,
            ..ResolvedEntry::default()
        }
    }
}

impl MediumBackend for SsdBackend {
    fn tier(&self) -> TierType {
        TierType::Ssd
    }

    fn name(&self) -> &str {
        NAME
    }

    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        self.start(registrar)
    }

    fn shutdown(&self) {
        self.stop();
    }

    fn capacity(&self) -> TierCapacity {
        self.inner.state.lock().capacity()
    }

    fn owned_key_count(&self) -> usize {
        self.inner.state.lock().owned_count()
    }

    fn drain_pending_events(&self) -> Vec<KvEvent> {
        self.inner.state.lock().take_events()
    }

    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        self.inner.state.lock().owned_events()
    }

    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        let mut state = self.inner.state.lock();
        state.clear_events();
        state.owned_events()
    }

    fn clear_local(&self) {
        self.clear();
    }

    fn clear_full_sync_acked(&self) {
        self.inner.clear_pending.store(false, Ordering::Release);
    }

    fn is_clear_full_sync_pending(&self) -> bool {
        self.inner.clear_pending.load(Ordering::Acquire)
    }

    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.inner.state.lock().set_auto_flush(threshold, hook);
    }

    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        self.allocate(requests)
    }

    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        self.commit(requests)
    }

    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        if slot_ids.is_empty() {
            return Vec::new();
        }
        self.abort(slot_ids)
    }

    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.resolve(keys, include_descs)
    }

    fn batch_resolve_ranges(
        &self,
        keys: &[String],
        ranges: &[Vec<(u64, u64)>],
        include_descs: bool,
    ) -> Vec<ResolvedEntry> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.resolve_ranges(keys, ranges, include_descs)
    }

    fn batch_contains(&self, keys: &[String]) -> Vec<bool> {
        // From the index: an existence check must not read the drive nor hold a staging page.
        let state = self.inner.state.lock();
        keys.iter().map(|k| state.owns(k)).collect()
    }

    fn release_reads(&self, reads: &[umbp_core::ReadRelease]) {
        if !reads.is_empty() {
            self.inner.release(reads);
        }
    }

    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        let mut results = Vec::with_capacity(keys.len());
        for key in keys {
            let dropped = if state.evictable(key, now) { state.drop_owned(key, now) } else { None };
            let bytes_freed = match dropped {
                Some(o) => {
                    state.push_event(KvEvent::remove(key.clone(), TierType::Ssd));
                    o.size
                }
                None => 0,
            };
            results.push(EvictResult { key: key.clone(), bytes_freed });
        }
        self.inner.update_staging_gauge(&state);
        results
    }

    fn page_size(&self) -> u64 {
        self.inner.config.page_size
    }

    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.inner.published.read().as_ref().map(|p| vec![p.desc.clone()]).unwrap_or_default()
    }

    fn buffer_count(&self) -> usize {
        usize::from(self.inner.published.read().is_some())
    }

    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        if index != 0 {
            return None;
        }
        self.inner.published.read().as_ref().map(|p| p.r#ref.clone())
    }
}

impl Drop for SsdBackend {
    fn drop(&mut self) {
        // An owner that forgot `shutdown` still gets the ordering right: deregister, then release.
        self.shutdown();
    }
}
