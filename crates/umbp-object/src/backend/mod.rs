//! `ObjectBackend`: the slot lifecycle of a staged medium over an object store.
//!
//! ```text
//! allocate ─► PENDING (staging pages) ─commit: upload (worker)─► OWNED (object in the store)
//!                                                                 │ staging pages ─► free
//! resolve of an OWNED key: filled copy? ─yes─► lease it
//!                          └─no─► take staging pages, download (worker, one per key at a time),
//!                                 check key, length and CRC, lease
//! evict: OWNED ─► REMOVE event + the object deleted (worker, in the background)
//! ```
//!
//! Every call that needs the store works in three phases: take what it needs under the lock,
//! hand the requests to the worker pool and wait for them **without** the lock (up to
//! `op_timeout`), and publish the outcome under the lock — the worker does that last step itself,
//! so a caller that stopped waiting leaves nothing half done (its upload's pages come back and
//! its key is not published; its download becomes a clean cached copy).
//!
//! | module | concern |
//! |---|---|
//! | `state` | [`State`](state::State): everything behind the one lock, the byte accounting |
//! | `io` | commit (uploads) and resolve (downloads): the jobs and their completion |
//! | `lifecycle` | `init` (bucket check, recovery, the arena), `shutdown`, `clear_local`, the reaper |

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex, RwLock};
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BufferDesc, CommitRequest,
    CommitResult, EvictResult, KvEvent, MediumBackend, MemoryRegistrar, MetricSource, PageLocation, ReadRelease,
    ResolvedEntry, TierCapacity, TierType, TransferRef,
};
use umbp_page::{HostMemoryOptions, HostPageMemorySource};

use crate::config::ObjectConfig;
use crate::pool::{Job, Pool};
use crate::record::{MAX_KEY_LEN, Name};
use crate::store::Store;

use lifecycle::Reaper;
use state::{Pending, State, TIER};

mod io;
mod lifecycle;
mod state;

/// The name this medium reports.
const NAME: &str = "ObjectBackend";

/// The registered staging arena's base: pages are `page_size` bytes from here.
#[derive(Debug, Clone, Copy)]
struct Arena {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: an address of memory the backend's source owns until `shutdown`, which joins every
// worker before releasing it; who may touch which page is decided under the state lock.
unsafe impl Send for Arena {}
// SAFETY: as above.
unsafe impl Sync for Arena {}

/// What `init` published: immutable until `shutdown`.
#[derive(Debug)]
struct Published {
    registrar: Arc<dyn MemoryRegistrar>,
    registered: TransferRef,
    r#ref: TransferRef,
    desc: BufferDesc,
    arena: Arena,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    New,
    Live,
    ShutDown,
}

struct Inner {
    config: ObjectConfig,
    state: Mutex<State>,
    /// Notified whenever a download completes (resolves wait on it, with the state lock).
    filled: Condvar,
    published: RwLock<Option<Arc<Published>>>,
    store: RwLock<Option<Arc<dyn Store>>>,
    pool: RwLock<Option<Pool>>,
    next_slot_id: AtomicU64,
    clear_pending: AtomicBool,
    /// Set at `shutdown`: queued uploads and downloads end without IO.
    stopping: AtomicBool,
}

/// The object-store medium: a registered host staging arena over an S3-compatible store or a
/// local directory (see the crate docs for what it owns and what it promises).
///
/// Built from an [`ObjectConfig`]; nothing is allocated, listed or read until
/// [`init`](MediumBackend::init).
pub struct ObjectBackend {
    inner: Arc<Inner>,
    source: HostPageMemorySource,
    lifecycle: Mutex<Lifecycle>,
    reaper: Mutex<Option<Reaper>>,
}

impl fmt::Debug for ObjectBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectBackend")
            .field("url", &self.inner.config.url)
            .field("lifecycle", &*self.lifecycle.lock())
            .finish_non_exhaustive()
    }
}

/// What a test or an operator can see of the medium from outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ObjectStats {
    /// Keys owned.
    pub owned_keys: usize,
    /// Staging pages free now.
    pub free_staging_pages: u64,
    /// Staged copies (filling, leased or cached).
    pub staged_copies: usize,
    /// Store requests retried after a transient failure, since `init`.
    pub retries: u64,
}

impl ObjectBackend {
    /// A backend with `config`; nothing happens until [`MediumBackend::init`].
    pub fn new(config: ObjectConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::new(config.page_size)),
                config,
                filled: Condvar::new(),
                published: RwLock::new(None),
                store: RwLock::new(None),
                pool: RwLock::new(None),
                next_slot_id: AtomicU64::new(1),
                clear_pending: AtomicBool::new(false),
                stopping: AtomicBool::new(false),
            }),
            // Prefaulted: the first upload or download through a page must not pay its faults.
            source: HostPageMemorySource::new(HostMemoryOptions::default()),
            lifecycle: Mutex::new(Lifecycle::New),
            reaper: Mutex::new(None),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ObjectConfig {
        &self.inner.config
    }

    /// Runs one reaper pass now: expired slots, leases and deferred frees.
    pub fn reaper_tick(&self) {
        self.inner.expire();
    }

    /// Drops every unleased cached copy, so the next resolve of each key downloads it.
    pub fn drop_cached_copies(&self) {
        let now = self.inner.config.clock.now();
        self.inner.state.lock().drop_clean_copies(now);
    }

    /// A snapshot of the medium's state.
    pub fn stats(&self) -> ObjectStats {
        let retries = self.inner.store().map_or(0, |s| s.retries());
        let state = self.inner.state.lock();
        ObjectStats {
            owned_keys: state.owned.len(),
            free_staging_pages: state.free_staging_pages(),
            staged_copies: state.copies.len(),
            retries,
        }
    }
}

impl Inner {
    fn store(&self) -> Option<Arc<dyn Store>> {
        self.store.read().clone()
    }

    fn published(&self) -> Option<Arc<Published>> {
        self.published.read().clone()
    }

    /// Queues `job` on the worker pool; false once the pool stopped (the job is dropped).
    fn submit(&self, job: Job) -> bool {
        self.pool.read().as_ref().is_some_and(|p| p.submit(job))
    }

    /// Deletes objects in the background (best effort: a failure is logged; an object left behind
    /// is a value a restart may bring back, never a wrong one).
    fn delete_later(self: &Arc<Self>, names: Vec<String>) {
        if names.is_empty() {
            return;
        }
        let Some(store) = self.store() else { return };
        let deadline = std::time::Instant::now() + self.config.op_timeout;
        let queued = self.submit(Box::new(move || {
            for name in names {
                if let Err(e) = store.delete(&name, deadline) {
                    tracing::warn!(object = %name, error = %e, "could not delete an object; a restart may bring its key back");
                }
            }
        }));
        if !queued {
            tracing::debug!("object medium stopping: deletes dropped");
        }
    }

    fn name_of(&self, key: &str, seq: u64) -> String {
        Name::render(self.config.url.prefix(), key, seq)
    }

    fn descs(&self) -> Vec<BufferDesc> {
        self.published().map(|p| vec![p.desc.clone()]).unwrap_or_default()
    }

    fn allocate_one(&self, state: &mut State, r: &AllocateRequest, now: std::time::Instant) -> AllocateResult {
        let config = &self.config;
        let pages = r.size.div_ceil(config.page_size);
        let too_large = pages > config.max_value_pages || state.bytes_of(r.size) > config.capacity_bytes;
        if r.size == 0 || too_large || r.key.len() > MAX_KEY_LEN || !state.is_live() {
            return AllocateResult::outcome(AllocateOutcome::Failed);
        }
        if self.clear_pending.load(Ordering::Acquire) {
            return AllocateResult::outcome(AllocateOutcome::Failed);
        }
        if state.owned.contains_key(&r.key) {
            return AllocateResult::outcome(AllocateOutcome::AlreadyExists);
        }
        if !state.fits(r.size) {
            return AllocateResult::outcome(AllocateOutcome::FailedNoSpace);
        }
        let Some(taken) = state.take_pages(pages, now) else {
            return AllocateResult::outcome(AllocateOutcome::Busy);
        };
        let slot_id = self.next_slot_id.fetch_add(1, Ordering::Relaxed);
        state.reserve(r.size);
        let pending = Pending {
            pages: taken.clone(),
            size: r.size,
            deadline: now + config.pending_ttl,
            generation: state.generation,
        };
        state.pending.insert(slot_id, pending);
        AllocateResult {
            outcome: AllocateOutcome::Allocated,
            slot_id,
            pages: taken,
            size: r.size,
            page_size: config.page_size,
            descs: self.descs(),
            pending_ttl_ms: u64::try_from(config.pending_ttl.as_millis()).unwrap_or(u64::MAX),
        }
    }

    fn hit(
        &self,
        pages: Vec<PageLocation>,
        size: u64,
        lease: u64,
        crc32c: Option<u32>,
        include_descs: bool,
    ) -> ResolvedEntry {
        ResolvedEntry {
            found: true,
            crc32c,
            pages,
            size,
            page_size: self.config.page_size,
            descs: if include_descs { self.descs() } else { Vec::new() },
            lease,
            ..ResolvedEntry::default()
        }
    }
}

impl MetricSource for ObjectBackend {}

impl MediumBackend for ObjectBackend {
    fn tier(&self) -> TierType {
        TIER
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
        self.inner.state.lock().owned.len()
    }

    fn drain_pending_events(&self) -> Vec<KvEvent> {
        self.inner.state.lock().outbox.take()
    }

    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        self.inner.state.lock().owned_events()
    }

    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        let mut state = self.inner.state.lock();
        state.outbox.clear();
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
        // After shutdown nothing fires it, and keeping it could keep alive what it captured.
        if *self.lifecycle.lock() == Lifecycle::ShutDown {
            return;
        }
        self.inner.state.lock().outbox.set_auto_flush(threshold, hook);
    }

    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        requests.iter().map(|r| self.inner.allocate_one(&mut state, r, now)).collect()
    }

    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        Inner::commit(&self.inner, requests)
    }

    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        let mut state = self.inner.state.lock();
        slot_ids
            .iter()
            .map(|id| {
                if let Some(p) = state.pending.remove(id) {
                    state.free_pages(&p.pages);
                    state.unreserve(p.size);
                }
                true
            })
            .collect()
    }

    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        if keys.is_empty() {
            return Vec::new();
        }
        Inner::resolve(&self.inner, keys, include_descs)
    }

    fn release_reads(&self, reads: &[ReadRelease]) {
        if reads.is_empty() {
            return;
        }
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        for r in reads {
            state.release(&r.key, r.lease, now);
        }
    }

    fn batch_contains(&self, keys: &[String]) -> Vec<bool> {
        // From the index: an existence check downloads nothing and holds no staging page.
        let state = self.inner.state.lock();
        keys.iter().map(|k| state.owned.contains_key(k)).collect()
    }

    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        let now = self.inner.config.clock.now();
        let mut dead = Vec::new();
        let results = {
            let mut state = self.inner.state.lock();
            keys.iter()
                .map(|key| {
                    let protected = state.copies.get(key).is_some_and(|c| c.protects(now));
                    let dropped = if protected { None } else { state.drop_owned(key, now) };
                    let bytes_freed = match dropped {
                        Some(o) => {
                            state.push_event(KvEvent::remove(key.clone(), TIER));
                            dead.push(self.inner.name_of(key, o.seq));
                            o.size
                        }
                        None => 0,
                    };
                    EvictResult { key: key.clone(), bytes_freed }
                })
                .collect()
        };
        self.inner.delete_later(dead);
        results
    }

    fn page_size(&self) -> u64 {
        self.inner.config.page_size
    }

    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.inner.descs()
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

impl Drop for ObjectBackend {
    fn drop(&mut self) {
        // An owner that forgot `shutdown` still gets the order right: workers, deregister, release.
        self.shutdown();
    }
}
