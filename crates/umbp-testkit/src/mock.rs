//! `MockBackend`: a small, honest medium over one heap buffer.

use std::collections::HashMap;
use std::fmt;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BufferDesc, Clock, CommitRequest,
    CommitResult, EvictResult, KvEvent, LocalRegion, MediumBackend, MemoryLocation, MemoryRegistrar, MetricSample,
    MetricSource, PageLocation, ReadLease, ReadLeases, ReadRelease, ResolvedEntry, SystemClock, TierCapacity, TierType,
    TransferRef,
};

const NAME: &str = "MockBackend";

/// Settings of a [`MockBackend`].
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// The tier the mock claims to serve. Default: [`TierType::Dram`].
    pub tier: TierType,
    /// Bytes per page. Default: 4096.
    pub page_size: u64,
    /// Pages in the one buffer. Default: 16.
    pub pages: u32,
    /// How long an uncommitted slot lives before [`MockBackend::reaper_tick`] frees it. Default: 30 s.
    pub pending_ttl: Duration,
    /// How long a resolve protects a key from eviction. Default: 500 ms.
    pub read_lease_ttl: Duration,
    /// Where TTLs and leases read the time. Default: [`SystemClock`].
    pub clock: Arc<dyn Clock>,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            tier: TierType::Dram,
            page_size: 4096,
            pages: 16,
            pending_ttl: Duration::from_secs(30),
            read_lease_ttl: Duration::from_millis(500),
            clock: SystemClock::shared(),
        }
    }
}

/// How often each entry point of a [`MockBackend`] was called (batch calls, not batch items).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MockCalls {
    /// `init` calls, including idempotent repeats and failures.
    pub init: u64,
    /// `shutdown` calls.
    pub shutdown: u64,
    /// `batch_allocate` calls.
    pub batch_allocate: u64,
    /// `batch_commit` calls.
    pub batch_commit: u64,
    /// `batch_abort` calls.
    pub batch_abort: u64,
    /// `batch_resolve` calls.
    pub batch_resolve: u64,
    /// `evict` calls.
    pub evict: u64,
    /// [`MockBackend::reaper_tick`] calls.
    pub reaper_ticks: u64,
    /// Times the auto-flush hook ran.
    pub auto_flushes: u64,
    /// `release_reads` calls.
    pub release_reads: u64,
}

#[derive(Debug, Default)]
struct Counters {
    init: AtomicU64,
    shutdown: AtomicU64,
    batch_allocate: AtomicU64,
    batch_commit: AtomicU64,
    batch_abort: AtomicU64,
    batch_resolve: AtomicU64,
    evict: AtomicU64,
    reaper_ticks: AtomicU64,
    auto_flushes: AtomicU64,
    release_reads: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// A working fake medium: one heap buffer of `pages × page_size` bytes, registered with the registrar
/// given to `init`, behind the full [`MediumBackend`] contract.
///
/// Unlike the reference's zero-capacity stub it reserves real pages, dedups owned keys, resolves the
/// first writer of a commit race, reaps pending slots after their TTL, protects resolved keys with read
/// leases, gates allocation after a clear and runs the auto-flush hook once per threshold crossing. It
/// passes [`conformance`](crate::conformance), so tests built on it exercise the real contract.
///
/// The page allocator is a plain free list: fine for a fake, not for a production medium.
///
/// # Reaping
/// There is no background thread. Expired pending slots, read leases and deferred frees are swept by
/// [`reaper_tick`](Self::reaper_tick), which a test calls after advancing its
/// [`ManualClock`](umbp_core::ManualClock). Expired leases are also ignored by `evict` without a sweep,
/// and a slot past its TTL fails its commit (freeing its pages) whether or not a sweep ran.
///
/// # Ownership
/// The mock holds no `Arc` back to itself. The auto-flush hook is dropped at `shutdown` (outside the
/// lock), and a hook set after shutdown is dropped at once, so a hook that captures the backend's own
/// `Arc` forms a cycle only while the mock is live.
pub struct MockBackend {
    config: MockConfig,
    state: Mutex<State>,
    calls: Counters,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    New,
    Live,
    ShutDown,
}

struct State {
    lifecycle: Lifecycle,
    memory: Option<LiveMemory>,
    /// Free page indexes, used as a stack: the lowest index is on top after `init`.
    free: Vec<u32>,
    pending: HashMap<u64, Pending>,
    owned: HashMap<String, Owned>,
    leases: ReadLeases,
    /// Pages of keys dropped by a clear while a reader still held a lease on them, the lease's end
    /// and the lease (key, id) whose last release frees them sooner.
    deferred: Vec<(Vec<u32>, Instant, (String, ReadLease))>,
    /// Hits still to be answered busy instead (see [`MockBackend::answer_busy`]).
    busy_hits: u64,
    /// Allocations still to be answered busy instead (see [`MockBackend::answer_allocate_busy`]).
    busy_allocations: u64,
    outbox: Vec<KvEvent>,
    /// Bumped by every clear; a slot from an older generation can no longer commit.
    generation: u64,
    /// Slot ids start at 1 (0 is never a real slot) and are never reused.
    next_slot: u64,
    clear_pending: bool,
    auto_flush: Option<(usize, AutoFlushHook)>,
}

struct Pending {
    pages: Vec<u32>,
    size: u64,
    deadline: Instant,
    generation: u64,
}

struct Owned {
    pages: Vec<u32>,
    size: u64,
    crc32c: Option<u32>,
}

/// Everything that exists only between a successful `init` and `shutdown`.
struct LiveMemory {
    arena: Arena,
    registrar: Arc<dyn MemoryRegistrar>,
    /// The ref as the registrar returned it; deregistered at shutdown.
    registered: TransferRef,
    /// What `buffer_ref(0)` hands out: the registered ref narrowed to whole pages.
    published: TransferRef,
}

/// One zero-filled heap allocation, owned through a raw pointer so that no `Box` is alive (and
/// asserting uniqueness) while the transfer layer writes through the registered pointer.
struct Arena {
    region: LocalRegion,
    len: usize,
}

impl Arena {
    fn allocate(len: usize) -> Result<Self, std::collections::TryReserveError> {
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(len)?;
        bytes.resize(len, 0u8);
        let leaked: &'static mut [u8] = Box::leak(bytes.into_boxed_slice());
        let len = leaked.len();
        let ptr = NonNull::from(leaked).cast::<u8>();
        // SAFETY: `ptr` is a live heap allocation of exactly `len` bytes that only this `Arena` frees,
        // in its `Drop`; `MockBackend::shutdown` deregisters the region before dropping the arena, and
        // `MockBackend`'s own `Drop` runs `shutdown`.
        let region = unsafe { LocalRegion::new(ptr, len as u64, MemoryLocation::Host) };
        Ok(Self { region, len })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let slice = ptr::slice_from_raw_parts_mut(self.region.ptr().as_ptr(), self.len);
        // SAFETY: `slice` is exactly the allocation leaked in `Arena::allocate`, and `drop` runs once.
        drop(unsafe { Box::from_raw(slice) });
    }
}

impl State {
    fn new() -> Self {
        Self {
            lifecycle: Lifecycle::New,
            memory: None,
            free: Vec::new(),
            pending: HashMap::new(),
            owned: HashMap::new(),
            leases: ReadLeases::default(),
            deferred: Vec::new(),
            busy_hits: 0,
            busy_allocations: 0,
            outbox: Vec::new(),
            generation: 0,
            next_slot: 1,
            clear_pending: false,
            auto_flush: None,
        }
    }

    fn take_pages(&mut self, n: usize) -> Option<Vec<u32>> {
        let at = self.free.len().checked_sub(n)?;
        let mut pages = self.free.split_off(at);
        pages.reverse();
        Some(pages)
    }

    fn free_pages(&mut self, pages: Vec<u32>) {
        self.free.extend(pages);
    }

    /// Queues an event and runs the auto-flush hook if the outbox just reached the threshold.
    fn push(&mut self, event: KvEvent, flushes: &AtomicU64) {
        self.outbox.push(event);
        if let Some((threshold, hook)) = &self.auto_flush
            && *threshold > 0
            && self.outbox.len() == *threshold
        {
            bump(flushes);
            hook();
        }
    }

    fn descs(&self) -> Vec<BufferDesc> {
        self.memory.as_ref().map(|m| vec![BufferDesc::from_ref(0, &m.published)]).unwrap_or_default()
    }
}

fn locations(pages: &[u32]) -> Vec<PageLocation> {
    pages.iter().map(|p| PageLocation::new(0, *p)).collect()
}

impl MockBackend {
    /// A mock that allocates nothing until `init`.
    pub fn new(config: MockConfig) -> Self {
        Self { config, state: Mutex::new(State::new()), calls: Counters::default() }
    }

    /// The settings the mock was built with.
    pub fn config(&self) -> &MockConfig {
        &self.config
    }

    /// How often each entry point was called so far.
    pub fn calls(&self) -> MockCalls {
        let c = &self.calls;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MockCalls {
            init: get(&c.init),
            shutdown: get(&c.shutdown),
            batch_allocate: get(&c.batch_allocate),
            batch_commit: get(&c.batch_commit),
            batch_abort: get(&c.batch_abort),
            batch_resolve: get(&c.batch_resolve),
            evict: get(&c.evict),
            reaper_ticks: get(&c.reaper_ticks),
            auto_flushes: get(&c.auto_flushes),
            release_reads: get(&c.release_reads),
        }
    }

    /// Answers the next `hits` resolve hits busy instead (the key is owned, no lease is taken), as
    /// a staged medium with no free staging page does: for tests of readers that must wait a busy
    /// medium out.
    pub fn answer_busy(&self, hits: u64) {
        self.state.lock().busy_hits = hits;
    }

    /// Answers the next `allocations` allocations that would reserve a slot busy instead (nothing is
    /// reserved), as a staged medium whose staging pages are all held by in-flight writes and
    /// reads does: for tests of writers that must wait a busy medium out. Requests that fail,
    /// dedup or find the medium full answer as usual and use none of them.
    pub fn answer_allocate_busy(&self, allocations: u64) {
        self.state.lock().busy_allocations = allocations;
    }

    /// How many pending (allocated, not yet committed or aborted) slots exist.
    pub fn pending_slot_count(&self) -> usize {
        self.state.lock().pending.len()
    }

    /// One sweep of what a reaper thread would do: frees pending slots past their TTL (no event),
    /// drops expired read leases and releases deferred frees whose lease ended.
    pub fn reaper_tick(&self) {
        bump(&self.calls.reaper_ticks);
        let now = self.config.clock.now();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let expired: Vec<u64> = state.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| *id).collect();
        for id in expired {
            if let Some(p) = state.pending.remove(&id) {
                state.free.extend(p.pages);
            }
        }
        state.leases.sweep(now);
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut state.deferred).into_iter().partition(|d| d.1 <= now);
        state.deferred = keep;
        for (pages, _, _) in due {
            state.free.extend(pages);
        }
    }

    fn total_bytes(&self) -> u64 {
        u64::from(self.config.pages) * self.config.page_size
    }

    fn allocate_one(&self, state: &mut State, request: &AllocateRequest, now: Instant) -> AllocateResult {
        let page_size = self.config.page_size;
        let pages_needed = request.size.div_ceil(page_size.max(1));
        // Size 0, or more pages than the medium has in total: no peer of this shape could do better.
        if request.size == 0 || pages_needed > u64::from(self.config.pages) || state.memory.is_none() {
            return AllocateResult::outcome(AllocateOutcome::Failed);
        }
        if state.clear_pending {
            return AllocateResult::outcome(AllocateOutcome::Failed);
        }
        // Only owned keys dedup: two writers may hold pending slots for one key (the first commit wins).
        if state.owned.contains_key(&request.key) {
            return AllocateResult::outcome(AllocateOutcome::AlreadyExists);
        }
        if u64::try_from(state.free.len()).unwrap_or(u64::MAX) < pages_needed {
            return AllocateResult::outcome(AllocateOutcome::FailedNoSpace);
        }
        if state.busy_allocations > 0 {
            state.busy_allocations -= 1;
            return AllocateResult::outcome(AllocateOutcome::Busy);
        }
        // `pages_needed` ≤ `pages` (a u32), so the conversion cannot fail.
        let Some(pages) = usize::try_from(pages_needed).ok().and_then(|n| state.take_pages(n)) else {
            return AllocateResult::outcome(AllocateOutcome::FailedNoSpace);
        };
        let slot_id = state.next_slot;
        state.next_slot += 1;
        let result = AllocateResult {
            outcome: AllocateOutcome::Allocated,
            slot_id,
            pages: locations(&pages),
            size: request.size,
            page_size,
            descs: state.descs(),
            pending_ttl_ms: u64::try_from(self.config.pending_ttl.as_millis()).unwrap_or(u64::MAX),
        };
        let pending = Pending {
            pages,
            size: request.size,
            deadline: now + self.config.pending_ttl,
            generation: state.generation,
        };
        state.pending.insert(slot_id, pending);
        result
    }

    fn commit_one(&self, state: &mut State, request: &CommitRequest, now: Instant) -> CommitResult {
        let Some(slot) = state.pending.remove(&request.slot_id) else {
            return CommitResult { success: false, bytes_committed: 0 };
        };
        // Written before a clear (the master has already been told this node holds nothing), or past
        // its TTL whether or not a reaper swept it yet: the slot is gone and its pages come back.
        if slot.generation != state.generation || slot.deadline <= now {
            state.free_pages(slot.pages);
            return CommitResult { success: false, bytes_committed: 0 };
        }
        if let Some(existing) = state.owned.get(&request.key) {
            // Lost a commit race: the first value stays, the writer still succeeded.
            let bytes_committed = existing.size;
            state.free_pages(slot.pages);
            return CommitResult { success: true, bytes_committed };
        }
        let size = slot.size;
        state.owned.insert(request.key.clone(), Owned { pages: slot.pages, size, crc32c: request.crc32c });
        state.push(KvEvent::add(request.key.clone(), self.config.tier, size), &self.calls.auto_flushes);
        CommitResult { success: true, bytes_committed: size }
    }

    fn evict_one(&self, state: &mut State, key: &str, now: Instant) -> u64 {
        if !state.owned.contains_key(key) {
            return 0;
        }
        if state.leases.active(key, now) {
            return 0;
        }
        let Some(owned) = state.owned.remove(key) else { return 0 };
        state.free_pages(owned.pages);
        state.push(KvEvent::remove(key, self.config.tier), &self.calls.auto_flushes);
        owned.size
    }

    fn snapshot(&self, state: &State) -> Vec<KvEvent> {
        state.owned.iter().map(|(k, o)| KvEvent::add(k.clone(), self.config.tier, o.size)).collect()
    }

    fn shutdown_inner(&self) {
        let mut state = self.state.lock();
        if let Some(memory) = state.memory.take() {
            let LiveMemory { arena, registrar, registered, published: _ } = memory;
            // Deregister first: the registrar may still map these pages.
            registrar.deregister(&registered);
            drop(arena);
        }
        let auto_flush = state.auto_flush.take();
        *state = State::new();
        state.lifecycle = Lifecycle::ShutDown;
        // The hook may own resources whose drop takes locks; run it outside ours.
        drop(state);
        drop(auto_flush);
    }
}

impl fmt::Debug for MockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock();
        f.debug_struct("MockBackend")
            .field("tier", &self.config.tier)
            .field("page_size", &self.config.page_size)
            .field("pages", &self.config.pages)
            .field("lifecycle", &state.lifecycle)
            .field("free_pages", &state.free.len())
            .field("owned", &state.owned.len())
            .field("pending", &state.pending.len())
            .finish_non_exhaustive()
    }
}

impl Drop for MockBackend {
    fn drop(&mut self) {
        // Deregisters before the arena is freed even if the owner forgot to shut down.
        self.shutdown_inner();
    }
}

impl MetricSource for MockBackend {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let in_use = {
            let state = self.state.lock();
            if state.memory.is_some() { u64::from(self.config.pages) - state.free.len() as u64 } else { 0 }
        };
        vec![MetricSample::gauge(
            umbp_core::metric_names::MEDIUM_STATE,
            umbp_core::metric_names::MEDIUM_STATE_HELP,
            vec![("state".into(), "pages_in_use".into())],
            in_use,
        )]
    }
}

impl MediumBackend for MockBackend {
    fn tier(&self) -> TierType {
        self.config.tier
    }

    fn name(&self) -> &str {
        NAME
    }

    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        bump(&self.calls.init);
        let mut state = self.state.lock();
        match state.lifecycle {
            Lifecycle::Live => return Ok(()),
            Lifecycle::ShutDown => return Err(BackendError::ShutDown(NAME.into())),
            Lifecycle::New => {}
        }
        let MockConfig { page_size, pages, .. } = self.config;
        if page_size == 0 || pages == 0 {
            return Err(BackendError::InvalidConfig(format!(
                "mock needs page_size > 0 and pages > 0 (got {page_size} and {pages})"
            )));
        }
        let total = self.total_bytes();
        let len = usize::try_from(total)
            .map_err(|_| BackendError::InvalidConfig(format!("{total} bytes do not fit this address space")))?;
        let arena = Arena::allocate(len).map_err(|e| BackendError::OutOfMemory {
            medium: NAME.into(),
            requested: total,
            source: Box::new(e),
        })?;
        // On refusal the arena drops here, unregistered; the mock stays `New`, so init may be retried.
        let registered = registrar.register_memory(arena.region).map_err(|source| BackendError::Registration {
            medium: NAME.into(),
            buffer_index: 0,
            source,
        })?;
        let published = registered.clone().truncated(total);
        state.free = (0..pages).rev().collect();
        state.memory = Some(LiveMemory { arena, registrar, registered, published });
        state.lifecycle = Lifecycle::Live;
        Ok(())
    }

    fn shutdown(&self) {
        bump(&self.calls.shutdown);
        self.shutdown_inner();
    }

    fn capacity(&self) -> TierCapacity {
        let state = self.state.lock();
        if state.memory.is_none() {
            return TierCapacity::default();
        }
        TierCapacity {
            total_bytes: self.total_bytes(),
            available_bytes: state.free.len() as u64 * self.config.page_size,
        }
    }

    fn owned_key_count(&self) -> usize {
        self.state.lock().owned.len()
    }

    fn drain_pending_events(&self) -> Vec<KvEvent> {
        std::mem::take(&mut self.state.lock().outbox)
    }

    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        self.snapshot(&self.state.lock())
    }

    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        let mut state = self.state.lock();
        state.outbox.clear();
        self.snapshot(&state)
    }

    fn clear_local(&self) {
        let now = self.config.clock.now();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        state.generation += 1;
        // A dropped key's lease leaves with it: it guards the old pages, never a value committed
        // under the same key after the clear.
        for (key, owned) in std::mem::take(&mut state.owned) {
            match state.leases.remove(&key).filter(|l| l.until > now) {
                // A reader may still be copying out of these pages: free them when its lease ends.
                Some(l) => state.deferred.push((owned.pages, l.until, (key, l))),
                None => state.free.extend(owned.pages),
            }
        }
        state.outbox.clear();
        state.clear_pending = true;
    }

    fn clear_full_sync_acked(&self) {
        self.state.lock().clear_pending = false;
    }

    fn is_clear_full_sync_pending(&self) -> bool {
        self.state.lock().clear_pending
    }

    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        let old = {
            let mut state = self.state.lock();
            if state.lifecycle == Lifecycle::ShutDown {
                // Nothing will ever fire it, and keeping it could keep alive whatever it captured
                // (often an `Arc` of this very backend) until the mock itself drops.
                drop(state);
                drop(hook);
                return;
            }
            std::mem::replace(&mut state.auto_flush, hook.map(|h| (threshold, h)))
        };
        // The old hook may own resources whose drop takes locks (even this backend's); drop it
        // outside ours.
        drop(old);
    }

    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        bump(&self.calls.batch_allocate);
        let now = self.config.clock.now();
        let mut state = self.state.lock();
        requests.iter().map(|r| self.allocate_one(&mut state, r, now)).collect()
    }

    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        bump(&self.calls.batch_commit);
        let now = self.config.clock.now();
        let mut state = self.state.lock();
        requests.iter().map(|r| self.commit_one(&mut state, r, now)).collect()
    }

    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        bump(&self.calls.batch_abort);
        let mut state = self.state.lock();
        slot_ids
            .iter()
            .map(|id| {
                if let Some(slot) = state.pending.remove(id) {
                    state.free_pages(slot.pages);
                }
                true
            })
            .collect()
    }

    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        bump(&self.calls.batch_resolve);
        let now = self.config.clock.now();
        let until = now + self.config.read_lease_ttl;
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let descs = if include_descs { state.descs() } else { Vec::new() };
        keys.iter()
            .map(|key| {
                let Some(owned) = state.owned.get(key) else {
                    return ResolvedEntry::miss();
                };
                if state.busy_hits > 0 {
                    state.busy_hits -= 1;
                    return ResolvedEntry::busy();
                }
                let entry = ResolvedEntry {
                    found: true,
                    pages: locations(&owned.pages),
                    size: owned.size,
                    page_size: self.config.page_size,
                    descs: descs.clone(),
                    crc32c: owned.crc32c,
                    ..ResolvedEntry::default()
                };
                ResolvedEntry { lease: state.leases.acquire(key, now, until), ..entry }
            })
            .collect()
    }

    fn release_reads(&self, reads: &[ReadRelease]) {
        bump(&self.calls.release_reads);
        let now = self.config.clock.now();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        for r in reads {
            // A reader of a key a clear dropped: the last one gives the deferred pages back.
            let dropped =
                state.deferred.iter().position(|(_, _, (k, l))| l.id == r.lease && l.until > now && *k == r.key);
            let Some(i) = dropped else {
                state.leases.release(&r.key, r.lease, now);
                continue;
            };
            let lease = &mut state.deferred[i].2.1;
            lease.readers = lease.readers.saturating_sub(1);
            if lease.readers == 0 {
                let (pages, _, _) = state.deferred.swap_remove(i);
                state.free.extend(pages);
            }
        }
    }

    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        bump(&self.calls.evict);
        let now = self.config.clock.now();
        let mut state = self.state.lock();
        keys.iter()
            .map(|key| EvictResult { key: key.clone(), bytes_freed: self.evict_one(&mut state, key, now) })
            .collect()
    }

    fn page_size(&self) -> u64 {
        self.config.page_size
    }

    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.state.lock().descs()
    }

    fn buffer_count(&self) -> usize {
        usize::from(self.state.lock().memory.is_some())
    }

    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        let state = self.state.lock();
        state.memory.as_ref().filter(|_| index == 0).map(|m| m.published.clone())
    }
}
