//! What a check works with: fresh subjects that are always shut down, and short, loud helpers.

use std::any::Any;
use std::collections::BTreeSet;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, BackendError, BufferDesc, CommitRequest, CommitResult, KvEvent,
    ManualClock, MediumBackend, MemoryRegistrar, PageLocation, ResolvedEntry,
};

use super::{Env, Subject};
use crate::registrar::{FailingRegistrar, LocalOnlyRegistrar};

/// The suite's limits on a subject's size (see `conformance::run`).
const MIN_PAGES: u64 = 4;
const MAX_PAGES: u64 = 4096;

/// A registrar whose outstanding registrations the fixture can count after shutdown.
pub(crate) trait Probe: MemoryRegistrar {
    fn outstanding(&self) -> usize;
}

impl Probe for LocalOnlyRegistrar {
    fn outstanding(&self) -> usize {
        self.live_registrations()
    }
}

impl Probe for FailingRegistrar {
    fn outstanding(&self) -> usize {
        self.accepted().live_registrations()
    }
}

struct Tracked {
    backend: Arc<dyn MediumBackend>,
    probes: Vec<Arc<dyn Probe>>,
}

/// One check's world: the factory, a fresh clock, and every subject built so far.
pub(crate) struct Fixture<'f> {
    factory: &'f dyn Fn(&Env) -> Subject,
    env: Env,
    made: Mutex<Vec<Tracked>>,
    /// Set by [`Fixture::skip`]: the check does not apply to the subject, and why.
    skipped: Mutex<Option<String>>,
}

impl<'f> Fixture<'f> {
    pub(crate) fn new(factory: &'f dyn Fn(&Env) -> Subject) -> Self {
        Self {
            factory,
            env: Env { clock: ManualClock::new() },
            made: Mutex::new(Vec::new()),
            skipped: Mutex::new(None),
        }
    }

    /// A fresh subject, not initialised.
    pub(crate) fn uninit(&self) -> Live {
        let Subject { backend, tick, read_lease, pending_ttl, background_reaper } = (self.factory)(&self.env);
        let mut made = self.made.lock();
        made.push(Tracked { backend: Arc::clone(&backend), probes: Vec::new() });
        Live {
            backend,
            tick,
            read_lease,
            pending_ttl,
            background_reaper,
            clock: Arc::clone(&self.env.clock),
            registrar: Arc::new(LocalOnlyRegistrar::new()),
            index: made.len() - 1,
        }
    }

    /// A fresh subject, initialised with its own [`LocalOnlyRegistrar`] and checked against the
    /// suite's requirements.
    pub(crate) fn live(&self) -> Live {
        let s = self.uninit();
        if let Err(e) = self.init(&s) {
            panic!("init of a fresh subject failed: {e}");
        }
        let ps = s.backend.page_size();
        assert!(ps > 0, "page_size() is 0 after init");
        let pages = s.pages_total();
        assert!(
            (MIN_PAGES..=MAX_PAGES).contains(&pages),
            "subject violates the suite's requirements: {pages} pages of {ps} bytes (needs {MIN_PAGES}..={MAX_PAGES})"
        );
        assert_eq!(s.available(), s.total(), "a fresh medium has all its capacity available");
        s
    }

    /// Initialises `s` with its own registrar.
    pub(crate) fn init(&self, s: &Live) -> Result<(), BackendError> {
        self.init_with(s, Arc::clone(&s.registrar))
    }

    /// Initialises `s` with `registrar`, whose registrations the fixture checks after shutdown.
    pub(crate) fn init_with<R: Probe + 'static>(&self, s: &Live, registrar: Arc<R>) -> Result<(), BackendError> {
        if let Some(t) = self.made.lock().get_mut(s.index) {
            t.probes.push(Arc::clone(&registrar) as Arc<dyn Probe>);
        }
        s.backend.init(registrar)
    }

    /// Marks the check as not applicable to the subject; the body should return right after.
    pub(crate) fn skip(&self, reason: impl Into<String>) {
        *self.skipped.lock() = Some(reason.into());
    }

    /// Why the check was skipped, if it was.
    pub(crate) fn skipped(&self) -> Option<String> {
        self.skipped.lock().clone()
    }

    /// Shuts every subject down (each under its own `catch_unwind`) and reports what went wrong:
    /// a panicking shutdown, or registrations still outstanding afterwards.
    pub(crate) fn finish(&self) -> Vec<String> {
        let made = std::mem::take(&mut *self.made.lock());
        let mut problems = Vec::new();
        for (i, t) in made.iter().enumerate() {
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| t.backend.shutdown())) {
                problems.push(format!("shutdown of subject {i} panicked: {}", panic_message(payload.as_ref())));
            }
            let outstanding: usize = t.probes.iter().map(|p| p.outstanding()).sum();
            if outstanding > 0 {
                problems.push(format!("after shutdown, subject {i} left {outstanding} buffer registration(s) behind"));
            }
        }
        problems
    }
}

/// The message of a caught panic.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panicked with a non-string payload".to_owned()
    }
}

/// A subject as a check uses it.
pub(crate) struct Live {
    pub(crate) backend: Arc<dyn MediumBackend>,
    tick: Box<dyn Fn() + Send + Sync>,
    pub(crate) read_lease: Duration,
    pub(crate) pending_ttl: Duration,
    /// The subject claims a reaper thread that sweeps without `tick`.
    pub(crate) background_reaper: bool,
    clock: Arc<ManualClock>,
    /// The registrar [`Fixture::init`] uses.
    pub(crate) registrar: Arc<LocalOnlyRegistrar>,
    index: usize,
}

pub(crate) fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

/// Events sorted by key, kind and size, for comparing snapshots whose order is unspecified.
pub(crate) fn sorted(mut events: Vec<KvEvent>) -> Vec<KvEvent> {
    events.sort_by(|a, b| (&a.key, a.kind as u8, a.size).cmp(&(&b.key, b.kind as u8, b.size)));
    events
}

impl Live {
    pub(crate) fn ps(&self) -> u64 {
        self.backend.page_size()
    }

    pub(crate) fn total(&self) -> u64 {
        self.backend.capacity().total_bytes
    }

    pub(crate) fn available(&self) -> u64 {
        self.backend.capacity().available_bytes
    }

    pub(crate) fn pages_total(&self) -> u64 {
        self.total() / self.ps().max(1)
    }

    /// Pages a value of `size` bytes occupies.
    pub(crate) fn pages_of(&self, size: u64) -> u64 {
        size.div_ceil(self.ps().max(1))
    }

    pub(crate) fn tick(&self) {
        (self.tick)();
    }

    pub(crate) fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// Moves the clock just past `d` and sweeps.
    pub(crate) fn expire(&self, d: Duration) {
        self.advance(d + Duration::from_millis(1));
        self.tick();
    }

    pub(crate) fn alloc(&self, key: &str, size: u64) -> AllocateResult {
        let mut r = self.backend.batch_allocate(&[AllocateRequest::new(key, size)]);
        assert_eq!(r.len(), 1, "batch_allocate of 1 request returned {} results", r.len());
        r.remove(0)
    }

    pub(crate) fn alloc_ok(&self, key: &str, size: u64) -> AllocateResult {
        let r = self.alloc(key, size);
        assert_eq!(r.outcome, AllocateOutcome::Allocated, "allocate({key:?}, {size} bytes) on a medium with room");
        assert_ne!(r.slot_id, 0, "allocate({key:?}) returned slot id 0, which is never a real slot");
        r
    }

    pub(crate) fn commit(&self, slot_id: u64, key: &str) -> CommitResult {
        let r = self.backend.batch_commit(&[CommitRequest::new(slot_id, key)]);
        assert_eq!(r.len(), 1, "batch_commit of 1 request returned {} results", r.len());
        r[0]
    }

    /// Allocates and commits `key`, asserting both succeed.
    pub(crate) fn put(&self, key: &str, size: u64) -> AllocateResult {
        let a = self.alloc_ok(key, size);
        let c = self.commit(a.slot_id, key);
        assert!(c.success && c.bytes_committed == size, "commit of fresh key {key:?} ({size} bytes) returned {c:?}");
        a
    }

    pub(crate) fn abort(&self, slot_id: u64) -> bool {
        let r = self.backend.batch_abort(&[slot_id]);
        assert_eq!(r.len(), 1, "batch_abort of 1 id returned {} results", r.len());
        r[0]
    }

    pub(crate) fn resolve(&self, key: &str, include_descs: bool) -> ResolvedEntry {
        let mut r = self.backend.batch_resolve(&[key.to_owned()], include_descs);
        assert_eq!(r.len(), 1, "batch_resolve of 1 key returned {} entries", r.len());
        r.remove(0)
    }

    /// Evicts one key and returns the bytes freed.
    pub(crate) fn evict(&self, key: &str) -> u64 {
        let r = self.backend.evict(&[key.to_owned()]);
        assert_eq!(r.len(), 1, "evict of 1 key returned {} results", r.len());
        assert_eq!(r[0].key, key, "evict result does not echo its key");
        r[0].bytes_freed
    }

    pub(crate) fn drain(&self) -> Vec<KvEvent> {
        self.backend.drain_pending_events()
    }

    pub(crate) fn add(&self, key: &str, size: u64) -> KvEvent {
        KvEvent::add(key, self.backend.tier(), size)
    }

    pub(crate) fn remove(&self, key: &str) -> KvEvent {
        KvEvent::remove(key, self.backend.tier())
    }

    /// Asserts that every page lies inside its buffer's published ref and that no page repeats.
    pub(crate) fn assert_pages_valid(&self, pages: &[PageLocation], what: &str) {
        let ps = self.ps();
        let distinct: BTreeSet<_> = pages.iter().collect();
        assert_eq!(distinct.len(), pages.len(), "{what}: a page appears twice in {pages:?}");
        for p in pages {
            let Some(r) = self.backend.buffer_ref(p.buffer_index as usize) else {
                panic!("{what}: page {p:?} names buffer {} which has no buffer_ref", p.buffer_index);
            };
            let end = (u64::from(p.page_index) + 1) * ps;
            assert!(end <= r.size(), "{what}: page {p:?} ends at byte {end}, past its buffer's {} bytes", r.size());
        }
    }

    /// The descriptors a result for `pages` must carry: one per referenced buffer, ascending,
    /// each equal to that buffer's entry in `all_buffer_descs`.
    pub(crate) fn descs_for(&self, pages: &[PageLocation]) -> Vec<BufferDesc> {
        let all = self.backend.all_buffer_descs();
        let used: BTreeSet<u32> = pages.iter().map(|p| p.buffer_index).collect();
        used.into_iter()
            .map(|i| match all.get(i as usize) {
                Some(d) => d.clone(),
                None => panic!("page names buffer {i}, but all_buffer_descs has only {}", all.len()),
            })
            .collect()
    }
}
