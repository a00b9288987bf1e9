//! `PageBackend`: the slot lifecycle of every paged medium, written once.
//!
//! ```text
//! allocate ─► PENDING ─commit─► OWNED ─evict─► freed (+REMOVE)
//!               │                 │
//!               ├─abort / TTL / pre-clear commit ─► freed silently
//!               │                 └─clear_local─► freed now, or deferred to its lease's end (no event)
//! overlays on OWNED: read lease (counted readers, ends at the last release or its TTL; blocks
//!                   evict) · copy pin (no TTL, blocks evict)
//! ```

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};
// foldhash: randomly seeded and minimally DoS-resistant, several times faster than SipHash on the
// short keys of a slot cycle (SipHash was the largest single cost in the slot-cycle benchmark).
use foldhash::HashMap;
use parking_lot::{Mutex, RwLock};
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BufferDesc, Clock, CommitRequest,
    CommitResult, EventOutbox, EvictResult, KvEvent, LocalRegion, MediumBackend, MemoryRegistrar, MetricSample,
    MetricSource, PageLocation, ReadLease, ReadLeases, ReadRelease, ResolvedEntry, SystemClock, TierCapacity, TierType,
    TransferRef, metric_names,
};

use crate::allocator::PageBitmapAllocator;
use crate::source::{PageMemorySource, RawBuffer, SourceError};

/// The longest TTL, lease or interval a config may set (30 days).
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Settings of a [`PageBackend`]. Every duration must be greater than 0 and at most 30 days, and at
/// least one buffer must hold a whole page.
#[derive(Clone)]
pub struct PageBackendConfig {
    /// The tier the backend serves. Default: DRAM.
    pub tier: TierType,
    /// Page size in bytes; every medium on a node shares it (it is the master's KV block size).
    /// Default: 2 MiB.
    pub page_size: u64,
    /// Sizes of the buffers to obtain from the source (zeros are skipped). Default: none.
    pub buffer_sizes: Vec<u64>,
    /// How long an allocated, uncommitted slot stays reserved. Default: 30 s.
    pub pending_ttl: Duration,
    /// How long a resolve protects a key's pages from eviction while a reader copies. Default: 500 ms.
    pub read_lease_ttl: Duration,
    /// How often the reaper sweeps expired slots, leases and deferred frees. Default: 200 ms.
    pub reaper_interval: Duration,
    /// A copy pin held longer than this is reported (never freed). Default: 30 s.
    pub long_pin_warning: Duration,
    /// The time source for TTLs and leases. Default: the system clock.
    pub clock: Arc<dyn Clock>,
}

impl Default for PageBackendConfig {
    fn default() -> Self {
        Self {
            tier: TierType::Dram,
            page_size: 2 << 20,
            buffer_sizes: Vec::new(),
            pending_ttl: Duration::from_secs(30),
            read_lease_ttl: Duration::from_millis(500),
            reaper_interval: Duration::from_millis(200),
            long_pin_warning: Duration::from_secs(30),
            clock: SystemClock::shared(),
        }
    }
}

impl PageBackendConfig {
    /// A config for `tier` with the given page size and buffers and every other setting at its
    /// default.
    pub fn new(tier: TierType, page_size: u64, buffer_sizes: Vec<u64>) -> Self {
        Self { tier, page_size, buffer_sizes, ..Self::default() }
    }

    /// Sets the pending-slot TTL.
    pub fn with_pending_ttl(mut self, ttl: Duration) -> Self {
        self.pending_ttl = ttl;
        self
    }

    /// Sets the read-lease TTL.
    pub fn with_read_lease_ttl(mut self, ttl: Duration) -> Self {
        self.read_lease_ttl = ttl;
        self
    }

    /// Sets the reaper interval.
    pub fn with_reaper_interval(mut self, interval: Duration) -> Self {
        self.reaper_interval = interval;
        self
    }

    /// Sets the age at which a held copy pin is reported.
    pub fn with_long_pin_warning(mut self, after: Duration) -> Self {
        self.long_pin_warning = after;
        self
    }

    /// Sets the clock.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    fn validate(&self) -> Result<(), BackendError> {
        let invalid = |msg: String| Err(BackendError::InvalidConfig(msg));
        if self.page_size == 0 {
            return invalid("page_size must be greater than 0".into());
        }
        if self.tier == TierType::Unknown {
            return invalid("tier must be a real tier, not UNKNOWN".into());
        }
        if !self.buffer_sizes.iter().any(|size| *size >= self.page_size) {
            return invalid(format!(
                "buffer_sizes {:?} hold no whole page of {} bytes: the medium would have no capacity",
                self.buffer_sizes, self.page_size
            ));
        }
        for (name, value) in [
            ("pending_ttl", self.pending_ttl),
            ("read_lease_ttl", self.read_lease_ttl),
            ("reaper_interval", self.reaper_interval),
            ("long_pin_warning", self.long_pin_warning),
        ] {
            if value.is_zero() {
                return invalid(format!("{name} must be greater than 0"));
            }
            // Deadlines are `now + ttl`; a bound keeps that addition far from overflow.
            if value > MAX_DURATION {
                return invalid(format!("{name} of {value:?} exceeds the maximum of {MAX_DURATION:?}"));
            }
        }
        Ok(())
    }
}

impl fmt::Debug for PageBackendConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageBackendConfig")
            .field("tier", &self.tier)
            .field("page_size", &self.page_size)
            .field("buffer_sizes", &self.buffer_sizes)
            .field("pending_ttl", &self.pending_ttl)
            .field("read_lease_ttl", &self.read_lease_ttl)
            .field("reaper_interval", &self.reaper_interval)
            .field("long_pin_warning", &self.long_pin_warning)
            .finish_non_exhaustive()
    }
}

/// One contiguous piece of a pinned value: `len` bytes at `offset` inside buffer `buffer_index`
/// (reach the memory through [`MediumBackend::buffer_ref`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySegment {
    /// The buffer.
    pub buffer_index: u32,
    /// Byte offset inside the buffer.
    pub offset: u64,
    /// Bytes of the value in this segment.
    pub len: u64,
}

/// A copy pin: the key's pages cannot be evicted until [`PageBackend::release_copy_pin`] is called
/// with `token`. Used by a copier that reads a committed value out of the medium (for example into
/// a slower tier) without a lease's TTL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPin {
    /// The value's bytes, in order, one segment per page.
    pub segments: Vec<CopySegment>,
    /// Value size in bytes.
    pub total_size: u64,
    /// Proof of ownership for the release.
    pub token: u64,
}

#[derive(Debug)]
struct Pending {
    pages: Vec<PageLocation>,
    size: u64,
    deadline: Instant,
    generation: u64,
}

#[derive(Debug)]
struct Owned {
    pages: Vec<PageLocation>,
    size: u64,
    /// The writer's checksum of the value, handed back on every resolve.
    crc32c: Option<u32>,
}

#[derive(Debug)]
struct Pin {
    token: u64,
    acquired_at: Instant,
    warned: bool,
}

#[derive(Debug)]
struct Deferred {
    pages: Vec<PageLocation>,
    release_at: Instant,
    /// The dropped key and the read lease taken out of the table with it: its last release frees
    /// the pages before `release_at`.
    lease: Option<(String, ReadLease)>,
}

/// The pages of a key dropped by `clear_local` while a copier held its pin: they stay reserved until
/// the pin is released (and, if a reader also held a lease, until that lease ends too).
#[derive(Debug)]
struct OrphanedPin {
    pages: Vec<PageLocation>,
    not_before: Instant,
    acquired_at: Instant,
    warned: bool,
}

/// Everything behind the backend's one lock.
#[derive(Default)]
struct State {
    /// `None` until `init` and after `shutdown`.
    allocator: Option<PageBitmapAllocator>,
    pending: HashMap<u64, Pending>,
    owned: HashMap<String, Owned>,
    leases: ReadLeases,
    pins: HashMap<String, Pin>,
    /// Pins of keys that `clear_local` dropped, by token.
    orphaned_pins: HashMap<u64, OrphanedPin>,
    deferred: Vec<Deferred>,
    outbox: EventOutbox,
    generation: u64,
    next_pin_token: u64,
}

impl State {
    fn free(&mut self, pages: &[PageLocation]) {
        if let Some(allocator) = self.allocator.as_mut() {
            allocator.deallocate(pages);
        }
    }

    fn push_event(&mut self, event: KvEvent) {
        self.outbox.push(event);
    }

    fn lease_active(&mut self, key: &str, now: Instant) -> bool {
        self.leases.active(key, now)
    }

    /// Returns the pending slots it reaped and their pages.
    fn sweep(&mut self, now: Instant, long_pin: Duration, tier: TierType) -> (u64, u64) {
        let expired: Vec<u64> = self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| *id).collect();
        let mut reaped = (0u64, 0u64);
        for id in expired {
            if let Some(p) = self.pending.remove(&id) {
                self.free(&p.pages);
                reaped.0 += 1;
                reaped.1 += p.pages.len() as u64;
            }
        }
        self.leases.sweep(now);
        for (key, pin) in &mut self.pins {
            if !pin.warned && now.saturating_duration_since(pin.acquired_at) >= long_pin {
                pin.warned = true;
                tracing::warn!(%tier, key = %key, held = ?now.saturating_duration_since(pin.acquired_at), "copy pin held unusually long; its key cannot be evicted");
            }
        }
        for (token, pin) in &mut self.orphaned_pins {
            if !pin.warned && now.saturating_duration_since(pin.acquired_at) >= long_pin {
                pin.warned = true;
                tracing::warn!(%tier, token, held = ?now.saturating_duration_since(pin.acquired_at), "copy pin of a cleared key held unusually long; its pages stay reserved");
            }
        }
        let mut due = Vec::new();
        self.deferred.retain_mut(|d| {
            if d.release_at <= now {
                due.push(std::mem::take(&mut d.pages));
                false
            } else {
                true
            }
        });
        for pages in due {
            self.free(&pages);
        }
        reaped
    }
}

/// What `init` published: immutable until `shutdown`, so `buffer_ref` needs no state lock.
#[derive(Debug)]
struct Published {
    registrar: Arc<dyn MemoryRegistrar>,
    /// The refs as the registrar returned them (deregistered at shutdown).
    registered: Vec<TransferRef>,
    /// The refs narrowed to whole pages (what is handed out).
    refs: Vec<TransferRef>,
    descs: Vec<BufferDesc>,
}

impl Published {
    fn deregister_all(&self) {
        for r in &self.registered {
            self.registrar.deregister(r);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    New,
    Live,
    ShutDown,
}

struct Inner {
    config: PageBackendConfig,
    state: Mutex<State>,
    published: RwLock<Option<Arc<Published>>>,
    next_slot_id: AtomicU64,
    clear_pending: AtomicBool,
    /// Pending slots the reaper freed because their writer never committed nor aborted, and their
    /// pages: what the interface cannot show from outside (published as medium events).
    reaped_slots: AtomicU64,
    reaped_pages: AtomicU64,
}

impl Inner {
    fn sweep(&self) {
        let now = self.config.clock.now();
        let (slots, pages) = self.state.lock().sweep(now, self.config.long_pin_warning, self.config.tier);
        if slots > 0 {
            self.reaped_slots.fetch_add(slots, Ordering::Relaxed);
            self.reaped_pages.fetch_add(pages, Ordering::Relaxed);
        }
    }

    fn descs_for_pages(published: Option<&Published>, pages: &[PageLocation]) -> Vec<BufferDesc> {
        let Some(published) = published else { return Vec::new() };
        let mut indexes: Vec<u32> = pages.iter().map(|p| p.buffer_index).collect();
        indexes.sort_unstable();
        indexes.dedup();
        indexes.into_iter().filter_map(|i| published.descs.get(i as usize).cloned()).collect()
    }
}

struct Reaper {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

/// A paged medium: slots, leases, pins and the outbox over memory from a [`PageMemorySource`].
///
/// Serves DRAM (with [`HostPageMemorySource`](crate::HostPageMemorySource)), HBM and any other
/// page-addressable medium; it never consults its tier. `init` starts a reaper thread that sweeps
/// expired pending slots, expired leases and due deferred frees every `reaper_interval`;
/// [`reaper_tick`](Self::reaper_tick) runs the same sweep synchronously (tests drive it with a
/// [`ManualClock`](umbp_core::ManualClock)).
///
/// Deliberate differences from the reference: a value larger than the whole medium is `Failed` (the
/// reference said `FailedNoSpace`, sending writers hunting for a peer that cannot exist); a commit or
/// lease check treats an expired deadline as expired even before the reaper swept it, so the outcome
/// never depends on reaper timing; `shutdown` stops the reaper.
///
/// It never answers busy (neither [`AllocateOutcome::Busy`] nor a busy resolve): its pages are the
/// capacity, so an allocation it has room for always gets them, and an owned key is always served
/// from where it lies.
///
/// ```
/// use std::sync::Arc;
/// use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, KvEventKind, MediumBackend, TierType};
/// use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
/// use umbp_testkit::LocalOnlyRegistrar;
///
/// // Two 1 MiB buffers of 4 KiB pages.
/// let config = PageBackendConfig::new(TierType::Dram, 4096, vec![1 << 20; 2]);
/// let source = HostPageMemorySource::new(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
/// let backend = PageBackend::new(config, Box::new(source)).expect("a valid geometry");
/// backend.init(Arc::new(LocalOnlyRegistrar::new())).expect("memory");
/// assert_eq!(backend.capacity().total_bytes, 2 << 20);
///
/// let slot = backend.batch_allocate(&[AllocateRequest::new("k", 10_000)]).remove(0);
/// assert_eq!(slot.outcome, AllocateOutcome::Allocated);
/// assert!(backend.batch_commit(&[CommitRequest::new(slot.slot_id, "k")])[0].success);
/// // The same key again is deduplicated, not stored twice.
/// let again = backend.batch_allocate(&[AllocateRequest::new("k", 10_000)]).remove(0);
/// assert_eq!(again.outcome, AllocateOutcome::AlreadyExists);
///
/// // What the node's heartbeat ships to the master.
/// let events = backend.drain_pending_events();
/// assert_eq!((events[0].kind, events[0].key.as_str()), (KvEventKind::Add, "k"));
/// assert_eq!(backend.evict(&["k".to_owned()])[0].bytes_freed, 10_000);
/// backend.shutdown();
/// ```
pub struct PageBackend {
    inner: Arc<Inner>,
    source: Box<dyn PageMemorySource>,
    lifecycle: Mutex<Lifecycle>,
    reaper: Mutex<Option<Reaper>>,
}

impl fmt::Debug for PageBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageBackend")
            .field("config", &self.inner.config)
            .field("source", &self.source)
            .field("lifecycle", &*self.lifecycle.lock())
            .finish_non_exhaustive()
    }
}

/// Builds a paged medium and returns it as the interface (only the composition root names concrete
/// backends).
pub fn make_page_backend(
    config: PageBackendConfig,
    source: Box<dyn PageMemorySource>,
) -> Result<Box<dyn MediumBackend>, BackendError> {
    Ok(Box::new(PageBackend::new(config, source)?))
}

impl PageBackend {
    /// A backend over `source`; nothing is allocated until [`MediumBackend::init`].
    pub fn new(config: PageBackendConfig, source: Box<dyn PageMemorySource>) -> Result<Self, BackendError> {
        config.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                state: Mutex::new(State { next_pin_token: 1, ..State::default() }),
                published: RwLock::new(None),
                next_slot_id: AtomicU64::new(1),
                clear_pending: AtomicBool::new(false),
                reaped_slots: AtomicU64::new(0),
                reaped_pages: AtomicU64::new(0),
            }),
            source,
            lifecycle: Mutex::new(Lifecycle::New),
            reaper: Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PageBackendConfig {
        &self.inner.config
    }

    /// Runs one reaper sweep now: frees expired pending slots and due deferred frees, drops expired
    /// leases, reports long-held pins.
    pub fn reaper_tick(&self) {
        self.inner.sweep();
    }

    /// Pins a committed key against eviction and describes its bytes. `None` when the key is not
    /// owned or already pinned.
    pub fn acquire_copy_pin(&self, key: &str) -> Option<CopyPin> {
        let now = self.inner.config.clock.now();
        let page_size = self.inner.config.page_size;
        let mut state = self.inner.state.lock();
        if state.pins.contains_key(key) {
            return None;
        }
        let owned = state.owned.get(key)?;
        let mut remaining = owned.size;
        let segments = owned
            .pages
            .iter()
            .map(|p| {
                let len = remaining.min(page_size);
                remaining -= len;
                CopySegment { buffer_index: p.buffer_index, offset: u64::from(p.page_index) * page_size, len }
            })
            .collect();
        let total_size = owned.size;
        let token = state.next_pin_token;
        state.next_pin_token += 1;
        state.pins.insert(key.to_owned(), Pin { token, acquired_at: now, warned: false });
        Some(CopyPin { segments, total_size, token })
    }

    /// Releases a copy pin. An unknown key or a wrong token is ignored. Releasing the pin of a key
    /// that `clear_local` dropped frees its pages (or defers them to the end of a reader's lease).
    pub fn release_copy_pin(&self, key: &str, token: u64) {
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        if state.pins.get(key).is_some_and(|p| p.token == token) {
            state.pins.remove(key);
        } else if let Some(orphan) = state.orphaned_pins.remove(&token) {
            if orphan.not_before <= now {
                state.free(&orphan.pages);
            } else {
                state.deferred.push(Deferred { pages: orphan.pages, release_at: orphan.not_before, lease: None });
            }
        }
    }

    fn start_reaper(&self) -> std::io::Result<Reaper> {
        let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
        let inner = Arc::clone(&self.inner);
        let interval = inner.config.reaper_interval;
        let thread =
            std::thread::Builder::new().name(format!("umbp-reaper-{}", inner.config.tier)).spawn(move || {
                loop {
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => inner.sweep(),
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            })?;
        Ok(Reaper { stop, thread })
    }

    fn stop_reaper(&self) {
        if let Some(reaper) = self.reaper.lock().take() {
            // A full channel means a stop is already queued; a dropped sender also wakes the thread.
            let _ = reaper.stop.try_send(());
            drop(reaper.stop);
            if reaper.thread.join().is_err() {
                tracing::error!(tier = %self.inner.config.tier, "reaper thread panicked");
            }
        }
    }

    /// Registers every buffer, all or nothing. On failure everything registered so far is
    /// deregistered again.
    fn register_all(
        &self,
        registrar: &dyn MemoryRegistrar,
        buffers: &[RawBuffer],
    ) -> Result<Vec<TransferRef>, BackendError> {
        let location = self.source.location();
        let mut registered = Vec::with_capacity(buffers.len());
        for (i, buffer) in buffers.iter().enumerate() {
            // SAFETY: `buffer` came from `self.source`, which keeps it valid until `release`; every
            // registration is deregistered (in `shutdown` or just below) before `release` is called.
            let region = unsafe { LocalRegion::new(buffer.base(), buffer.len(), location) };
            // Shareable memory tells the registrar its file, so a same-host peer may map it.
            let registration = match buffer.shared_backing() {
                Some(backing) => registrar.register_shareable(region, backing),
                None => registrar.register_memory(region),
            };
            match registration {
                Ok(r) => registered.push(r),
                Err(source) => {
                    for r in &registered {
                        registrar.deregister(r);
                    }
                    return Err(BackendError::Registration {
                        medium: self.source.name().to_owned(),
                        buffer_index: i,
                        source,
                    });
                }
            }
        }
        Ok(registered)
    }
}

impl Drop for PageBackend {
    fn drop(&mut self) {
        // An owner that forgot `shutdown` still gets the ordering right: deregister, then release.
        self.shutdown();
    }
}

impl MetricSource for PageBackend {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let (pending, deferred, leases, pins) = {
            let state = self.inner.state.lock();
            (state.pending.len(), state.deferred.len(), state.leases.len(), state.pins.len())
        };
        let gauge = |state: &str, value: usize| {
            MetricSample::gauge(
                metric_names::MEDIUM_STATE,
                metric_names::MEDIUM_STATE_HELP,
                vec![("state".into(), state.into())],
                value as u64,
            )
        };
        let reaped = self.inner.reaped_slots.load(Ordering::Relaxed);
        let reaped_bytes = self.inner.reaped_pages.load(Ordering::Relaxed).saturating_mul(self.inner.config.page_size);
        let event = || vec![("event".to_owned(), "pending_slot_reaped".to_owned())];
        vec![
            gauge("pending_slots", pending),
            gauge("deferred_frees", deferred),
            gauge("read_leases", leases),
            gauge("copy_pins", pins),
            // Writers that allocated and never committed nor aborted (a crashed or stuck client).
            MetricSample::counter(
                metric_names::MEDIUM_EVENTS_TOTAL,
                metric_names::MEDIUM_EVENTS_TOTAL_HELP,
                event(),
                reaped,
            ),
            MetricSample::counter(
                metric_names::MEDIUM_BYTES_TOTAL,
                metric_names::MEDIUM_BYTES_TOTAL_HELP,
                event(),
                reaped_bytes,
            ),
        ]
    }
}

impl MediumBackend for PageBackend {
    fn tier(&self) -> TierType {
        self.inner.config.tier
    }

    fn name(&self) -> &str {
        "PageBackend"
    }

    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        let mut lifecycle = self.lifecycle.lock();
        match *lifecycle {
            Lifecycle::Live => return Ok(()),
            Lifecycle::ShutDown => return Err(BackendError::ShutDown(self.source.name().to_owned())),
            Lifecycle::New => {}
        }
        let config = &self.inner.config;
        let requested: u64 = config.buffer_sizes.iter().fold(0u64, |a, b| a.saturating_add(*b));
        let buffers = self.source.allocate(&config.buffer_sizes).map_err(|e| match e {
            // A request the source can never serve is a configuration error, not a retryable one.
            SourceError::Invalid { .. } => BackendError::InvalidConfig(format!("{}: {e}", self.source.name())),
            _ => BackendError::OutOfMemory { medium: self.source.name().to_owned(), requested, source: Box::new(e) },
        })?;
        let usable: Vec<u64> = buffers.iter().map(RawBuffer::len).collect();
        let allocator = match PageBitmapAllocator::new(config.page_size, &usable) {
            Ok(a) => a,
            Err(e) => {
                self.source.release();
                return Err(BackendError::InvalidConfig(e.to_string()));
            }
        };
        let registered = match self.register_all(registrar.as_ref(), &buffers) {
            Ok(r) => r,
            Err(e) => {
                self.source.release();
                return Err(e);
            }
        };
        let refs: Vec<TransferRef> = registered
            .iter()
            .enumerate()
            .map(|(i, r)| r.clone().truncated(allocator.buffer_pages(i) * config.page_size))
            .collect();
        let descs =
            refs.iter().enumerate().map(|(i, r)| BufferDesc::from_ref(i as u32, r)).collect::<Vec<BufferDesc>>();
        let reaper = match self.start_reaper() {
            Ok(r) => r,
            Err(e) => {
                for r in &registered {
                    registrar.deregister(r);
                }
                self.source.release();
                return Err(BackendError::Io {
                    medium: self.source.name().to_owned(),
                    context: "starting the reaper thread".into(),
                    source: e,
                });
            }
        };
        // Publish before opening allocation, so no allocation ever sees missing descriptors.
        *self.inner.published.write() = Some(Arc::new(Published { registrar, registered, refs, descs }));
        self.inner.state.lock().allocator = Some(allocator);
        *self.reaper.lock() = Some(reaper);
        *lifecycle = Lifecycle::Live;
        tracing::debug!(tier = %config.tier, source = self.source.name(), buffers = buffers.len(), "page backend live");
        Ok(())
    }

    fn shutdown(&self) {
        let mut lifecycle = self.lifecycle.lock();
        if *lifecycle == Lifecycle::ShutDown {
            return;
        }
        *lifecycle = Lifecycle::ShutDown;
        self.stop_reaper();
        // First close the state, so every later call fails cleanly instead of handing out pages of
        // memory about to be unmapped; the hook is dropped outside the lock (it may own anything).
        let old = {
            let mut state = self.inner.state.lock();
            let next_pin_token = state.next_pin_token;
            std::mem::replace(&mut *state, State { next_pin_token, ..State::default() })
        };
        drop(old);
        // Deregister before release: a transport may still map these pages.
        if let Some(published) = self.inner.published.write().take() {
            published.deregister_all();
        }
        self.source.release();
    }

    fn capacity(&self) -> TierCapacity {
        let state = self.inner.state.lock();
        state.allocator.as_ref().map_or_else(TierCapacity::default, |a| TierCapacity {
            total_bytes: a.total_bytes(),
            available_bytes: a.available_bytes(),
        })
    }

    fn owned_key_count(&self) -> usize {
        self.inner.state.lock().owned.len()
    }

    fn drain_pending_events(&self) -> Vec<KvEvent> {
        self.inner.state.lock().outbox.take()
    }

    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        let tier = self.inner.config.tier;
        let state = self.inner.state.lock();
        state.owned.iter().map(|(k, o)| KvEvent::add(k.clone(), tier, o.size)).collect()
    }

    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        let tier = self.inner.config.tier;
        let mut state = self.inner.state.lock();
        state.outbox.clear();
        state.owned.iter().map(|(k, o)| KvEvent::add(k.clone(), tier, o.size)).collect()
    }

    fn clear_local(&self) {
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        state.generation += 1;
        if !state.pins.is_empty() {
            // A copier should be quiesced before a clear. If it was not, its pages must outlive the
            // key: they stay reserved until the pin is released, never handed to another writer.
            tracing::error!(tier = %self.inner.config.tier, pins = state.pins.len(), "clear_local with copy pins held; their pages stay reserved until released");
        }
        let owned = std::mem::take(&mut state.owned);
        // A dropped key's lease leaves the table with it: it guards the old pages (deferred below),
        // never a value committed under the same key after the clear, which its readers never saw.
        let mut pins = std::mem::take(&mut state.pins);
        for (key, o) in owned {
            let live = state.leases.remove(&key).filter(|l| l.until > now);
            if let Some(pin) = pins.remove(&key) {
                let orphan = OrphanedPin {
                    pages: o.pages,
                    not_before: live.map_or(now, |l| l.until),
                    acquired_at: pin.acquired_at,
                    warned: pin.warned,
                };
                state.orphaned_pins.insert(pin.token, orphan);
                continue;
            }
            match live {
                // A reader may still be copying out of these pages: free them when its lease ends.
                Some(l) => state.deferred.push(Deferred { pages: o.pages, release_at: l.until, lease: Some((key, l)) }),
                None => state.free(&o.pages),
            }
        }
        state.outbox.clear();
        // Set under the lock so no allocation can slip between the generation bump and the gate.
        self.inner.clear_pending.store(true, Ordering::Release);
    }

    fn clear_full_sync_acked(&self) {
        self.inner.clear_pending.store(false, Ordering::Release);
    }

    fn is_clear_full_sync_pending(&self) -> bool {
        self.inner.clear_pending.load(Ordering::Acquire)
    }

    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.inner.state.lock().outbox.set_auto_flush(threshold, hook);
    }

    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        let config = &self.inner.config;
        let page_size = config.page_size;
        let pending_ttl_ms = u64::try_from(config.pending_ttl.as_millis()).unwrap_or(u64::MAX);
        let published = self.inner.published.read().clone();
        let now = config.clock.now();
        let deadline = now + config.pending_ttl;
        let mut state = self.inner.state.lock();
        let clearing = self.inner.clear_pending.load(Ordering::Acquire);
        let generation = state.generation;
        let mut results = Vec::with_capacity(requests.len());
        for req in requests {
            let pages_needed = req.size.div_ceil(page_size);
            if req.size == 0 || pages_needed > u64::from(u32::MAX) || clearing {
                results.push(AllocateResult::outcome(AllocateOutcome::Failed));
                continue;
            }
            if state.owned.contains_key(&req.key) {
                results.push(AllocateResult::outcome(AllocateOutcome::AlreadyExists));
                continue;
            }
            let Some(allocator) = state.allocator.as_mut() else {
                results.push(AllocateResult::outcome(AllocateOutcome::Failed));
                continue;
            };
            if pages_needed > allocator.total_pages() {
                // No peer with a medium like ours could hold it either: don't send the writer hunting.
                results.push(AllocateResult::outcome(AllocateOutcome::Failed));
                continue;
            }
            let Some(pages) = allocator.allocate(pages_needed) else {
                results.push(AllocateResult::outcome(AllocateOutcome::FailedNoSpace));
                continue;
            };
            let slot_id = self.inner.next_slot_id.fetch_add(1, Ordering::Relaxed);
            let descs = Inner::descs_for_pages(published.as_deref(), &pages);
            state.pending.insert(slot_id, Pending { pages: pages.clone(), size: req.size, deadline, generation });
            results.push(AllocateResult {
                outcome: AllocateOutcome::Allocated,
                slot_id,
                pages,
                size: req.size,
                page_size,
                descs,
                pending_ttl_ms,
            });
        }
        results
    }

    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        let tier = self.inner.config.tier;
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        let generation = state.generation;
        let mut results = Vec::with_capacity(requests.len());
        for req in requests {
            let Some(slot) = state.pending.remove(&req.slot_id) else {
                results.push(CommitResult::default());
                continue;
            };
            if slot.generation != generation || slot.deadline <= now {
                // Pre-clear or expired: the writer's bytes may be stale; the pages go back silently.
                state.free(&slot.pages);
                results.push(CommitResult::default());
                continue;
            }
            if let Some(existing) = state.owned.get(&req.key) {
                // Lost a race with another writer of the same key: the first value stays.
                let bytes_committed = existing.size;
                state.free(&slot.pages);
                results.push(CommitResult { success: true, bytes_committed });
                continue;
            }
            state.owned.insert(req.key.clone(), Owned { pages: slot.pages, size: slot.size, crc32c: req.crc32c });
            state.push_event(KvEvent::add(req.key.clone(), tier, slot.size));
            results.push(CommitResult { success: true, bytes_committed: slot.size });
        }
        results
    }

    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        if slot_ids.is_empty() {
            return Vec::new();
        }
        let mut state = self.inner.state.lock();
        for id in slot_ids {
            if let Some(slot) = state.pending.remove(id) {
                state.free(&slot.pages);
            }
        }
        vec![true; slot_ids.len()]
    }

    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        if keys.is_empty() {
            return Vec::new();
        }
        let config = &self.inner.config;
        let published = if include_descs { self.inner.published.read().clone() } else { None };
        let now = config.clock.now();
        let lease_until = now + config.read_lease_ttl;
        let mut state = self.inner.state.lock();
        let mut results = Vec::with_capacity(keys.len());
        for key in keys {
            let Some(owned) = state.owned.get(key) else {
                results.push(ResolvedEntry::miss());
                continue;
            };
            let mut entry = ResolvedEntry {
                found: true,
                pages: owned.pages.clone(),
                size: owned.size,
                page_size: config.page_size,
                descs: Inner::descs_for_pages(published.as_deref(), &owned.pages),
                crc32c: owned.crc32c,
                ..ResolvedEntry::default()
            };
            entry.lease = state.leases.acquire(key, now, lease_until);
            results.push(entry);
        }
        results
    }

    fn batch_contains(&self, keys: &[String]) -> Vec<bool> {
        // From the index: an existence check takes no lease.
        let state = self.inner.state.lock();
        keys.iter().map(|k| state.owned.contains_key(k)).collect()
    }

    fn release_reads(&self, reads: &[ReadRelease]) {
        if reads.is_empty() {
            return;
        }
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        for r in reads {
            // A reader of a key a clear dropped: its lease went to the deferred free, and the last
            // such reader gives the pages back now.
            let dropped = state
                .deferred
                .iter()
                .position(|d| d.lease.as_ref().is_some_and(|(k, l)| l.id == r.lease && l.until > now && *k == r.key));
            let Some(i) = dropped else {
                state.leases.release(&r.key, r.lease, now);
                continue;
            };
            let last = state.deferred[i].lease.as_mut().is_some_and(|(_, l)| {
                l.readers = l.readers.saturating_sub(1);
                l.readers == 0
            });
            if last {
                let d = state.deferred.swap_remove(i);
                state.free(&d.pages);
            }
        }
    }

    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        let tier = self.inner.config.tier;
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        let mut results = Vec::with_capacity(keys.len());
        for key in keys {
            let evictable =
                state.owned.contains_key(key) && !state.lease_active(key, now) && !state.pins.contains_key(key);
            let bytes_freed = match evictable.then(|| state.owned.remove(key)).flatten() {
                Some(owned) => {
                    state.free(&owned.pages);
                    state.push_event(KvEvent::remove(key.clone(), tier));
                    owned.size
                }
                None => 0,
            };
            results.push(EvictResult { key: key.clone(), bytes_freed });
        }
        results
    }

    fn page_size(&self) -> u64 {
        self.inner.config.page_size
    }

    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.inner.published.read().as_ref().map(|p| p.descs.clone()).unwrap_or_default()
    }

    fn buffer_count(&self) -> usize {
        self.inner.published.read().as_ref().map_or(0, |p| p.refs.len())
    }

    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        self.inner.published.read().as_ref().and_then(|p| p.refs.get(index).cloned())
    }
}
