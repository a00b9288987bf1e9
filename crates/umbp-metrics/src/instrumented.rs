//! `InstrumentedBackend`: the generic per-medium series, derived from the `MediumBackend` calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BufferDesc, CommitRequest,
    CommitResult, EvictResult, KvEvent, MediumBackend, MemoryRegistrar, MetricSample, MetricSource, ReadRelease,
    ResolvedEntry, TierCapacity, TierType, TransferRef,
};

use crate::names;

/// A slot-lifecycle call, in the order of [`names::OPS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `batch_allocate`.
    Allocate = 0,
    /// `batch_commit`.
    Commit = 1,
    /// `batch_abort`.
    Abort = 2,
    /// `batch_resolve`.
    Resolve = 3,
    /// `evict`.
    Evict = 4,
    /// `batch_contains`: an existence check, no bytes.
    Lookup = 5,
}

impl Op {
    /// Every op, in label order.
    pub const ALL: [Op; 6] = [Op::Allocate, Op::Commit, Op::Abort, Op::Resolve, Op::Evict, Op::Lookup];

    /// The `op=` label value.
    pub const fn as_str(self) -> &'static str {
        names::OPS[self as usize]
    }

    /// Whether the op moves a byte count into `umbp_backend_bytes_total`.
    const fn counts_bytes(self) -> bool {
        matches!(self, Op::Commit | Op::Resolve | Op::Evict)
    }
}

/// The outcome of one entry, in the order of [`names::STATUSES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// Done (allocated, committed, aborted, found, freed).
    Ok = 0,
    /// Allocate: the key was already there.
    Exists = 1,
    /// Allocate: the medium is full now, or busy (it has room but no free staging page now; the
    /// writer retries it here). Resolve: busy (the key is here, but the medium cannot serve it now;
    /// the reader retries it here).
    NoSpace = 2,
    /// Resolve, lookup: not found. Evict: nothing freed (unknown, leased or pinned).
    Miss = 3,
    /// Refused for good.
    Failed = 4,
}

impl Status {
    /// Every status, in label order.
    pub const ALL: [Status; 5] = [Status::Ok, Status::Exists, Status::NoSpace, Status::Miss, Status::Failed];

    /// The `status=` label value.
    pub const fn as_str(self) -> &'static str {
        names::STATUSES[self as usize]
    }
}

/// The counters of one op in one shard, on a cache line of their own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct OpCounters {
    batches: AtomicU64,
    nanos: AtomicU64,
    bytes: AtomicU64,
    entries: [AtomicU64; 5],
    /// Duration of the latest timed small call: what each untimed small call is charged.
    last_small_nanos: AtomicU64,
}

/// Adds `n` to a counter. In an owned shard only the owning thread writes, so a plain load and
/// store (no locked read-modify-write: ~1 ns instead of ~6) is exact; the shared shard adds
/// atomically.
#[inline]
fn add(cell: &AtomicU64, n: u64, owned: bool) {
    if owned {
        cell.store(cell.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    } else {
        cell.fetch_add(n, Ordering::Relaxed);
    }
}

impl OpCounters {
    /// Counts one call and says whether to time it: every call of [`TIME_EVERY_ENTRIES`] entries or
    /// more, and one in [`TIME_ONE_IN`] smaller calls (reading the clock twice costs ~80 ns on our
    /// machines, as much as a one-key call into a paged medium; see
    /// `benches/instrumented_overhead.rs`).
    #[inline]
    fn begin(&self, small: bool, owned: bool) -> bool {
        let n = self.batches.load(Ordering::Relaxed);
        add(&self.batches, 1, owned);
        !small || n.is_multiple_of(TIME_ONE_IN)
    }

    /// Adds one call's tally. Only non-zero cells are touched: a batch usually has one outcome.
    #[inline]
    fn record(&self, tally: &Tally, owned: bool) {
        if tally.bytes > 0 {
            add(&self.bytes, tally.bytes, owned);
        }
        for (cell, n) in self.entries.iter().zip(tally.entries) {
            if n > 0 {
                add(cell, n, owned);
            }
        }
    }
}

/// Calls with at least this many entries are always timed: the clock is noise beside them.
const TIME_EVERY_ENTRIES: usize = 8;
/// One in this many smaller calls is timed; each of the others is charged the latest timed one's
/// duration. The first small call of a shard is timed, so a quiet medium's figure is a real one.
const TIME_ONE_IN: u64 = 32;

/// Threads that own a shard at once; a thread beyond them writes the shared shard atomically.
const OWNED_SHARDS: usize = 32;

/// The counters of every op in one shard.
#[derive(Debug, Default)]
struct Shard {
    ops: [OpCounters; 6],
}

/// Shard ownership: a thread claims an id on its first instrumented call and gives it back when it
/// exits (the mutex orders the old owner's last writes before the new owner's first), so ids stay
/// few even as a blocking pool replaces its threads.
mod owner {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use parking_lot::Mutex;

    use super::OWNED_SHARDS;

    static FREE: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    static NEXT: AtomicUsize = AtomicUsize::new(0);

    /// The shard id of this thread, or [`OWNED_SHARDS`] for the shared one.
    struct Claim(usize);

    impl Drop for Claim {
        fn drop(&mut self) {
            if self.0 < OWNED_SHARDS {
                FREE.lock().push(self.0);
            }
        }
    }

    thread_local! {
        static CLAIM: Claim = Claim(claim());
    }

    fn claim() -> usize {
        if let Some(id) = FREE.lock().pop() {
            return id;
        }
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        if id < OWNED_SHARDS { id } else { OWNED_SHARDS }
    }

    /// This thread's shard id (the shared one while the thread is being torn down).
    #[inline]
    pub(super) fn shard() -> usize {
        CLAIM.try_with(|c| c.0).unwrap_or(OWNED_SHARDS)
    }
}

/// One call's outcomes, counted locally before touching the shared counters.
#[derive(Default)]
struct Tally {
    entries: [u64; 5],
    bytes: u64,
}

impl Tally {
    fn add(&mut self, status: Status, bytes: u64) {
        self.entries[status as usize] += 1;
        self.bytes += bytes;
    }
}

/// A snapshot of one op's counters (see [`InstrumentedBackend::counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// Batch calls.
    pub batches: u64,
    /// Nanoseconds spent inside the medium.
    pub nanos: u64,
    /// Bytes committed, resolved or freed (0 for allocate and abort).
    pub bytes: u64,
    /// Entries by [`Status`] (index with `status as usize`).
    pub entries: [u64; 5],
}

impl OpCounts {
    /// Entries that ended with `status`.
    pub const fn entries(&self, status: Status) -> u64 {
        self.entries[status as usize]
    }
}

/// A decorator over any [`MediumBackend`] that derives the generic series — entries by op and
/// status, batches, bytes committed / resolved / freed, time inside the medium — from the calls
/// themselves, so a medium is charted the moment it is composed in, with no metrics code of its own.
///
/// Every method but the five slot calls passes straight through; [`sample_metrics`](MetricSource::sample_metrics)
/// returns the derived series followed by the inner medium's own samples, unchanged.
///
/// Classification, per entry: allocate `Allocated`→ok, `AlreadyExists`→exists,
/// `FailedNoSpace` and `Busy`→no_space, `Failed`→failed; commit success→ok (+bytes) else failed; abort
/// `true`→ok else failed; resolve found→ok (+size), busy→no_space, else miss; lookup (`batch_contains`, an
/// existence check) found→ok else miss, no bytes; evict bytes freed > 0→ok (+bytes) else
/// miss. The counters are monotonic for the life of the decorator, and exact — except the time: a
/// call of 8 entries or more is always timed; one in 32 smaller calls is timed and each of the
/// others is charged the latest timed small call's duration (reading the clock would otherwise cost
/// as much as a one-key call into a paged medium).
///
/// Cost: the counters live in per-thread shards (a thread owns one, so its adds are plain stores,
/// not locked instructions) and are summed when sampled; see `benches/instrumented_overhead.rs`.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
///
/// use umbp_core::{AllocateRequest, MediumBackend};
/// use umbp_metrics::{InstrumentedBackend, MetricsExporter};
/// use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};
///
/// // The composition root's one line: any medium, wrapped.
/// let medium = InstrumentedBackend::wrap(Arc::new(MockBackend::new(MockConfig::default())));
/// medium.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
/// medium.batch_allocate(&[AllocateRequest::new("k", 4096)]);
///
/// let exporter = MetricsExporter::new(&[], Duration::from_secs(30));
/// exporter.add_backend(&medium);
/// let text = exporter.render();
/// let line = text.lines().find(|l| l.starts_with("umbp_backend_ops_total{")).expect("series");
/// assert!(line.contains(r#"tier="DRAM""#) && line.contains(r#"op="allocate""#) && line.ends_with(" 1"));
/// ```
#[derive(Debug)]
pub struct InstrumentedBackend {
    inner: Arc<dyn MediumBackend>,
    /// One shard per owning thread, then the shared one (index [`OWNED_SHARDS`]).
    shards: Box<[Shard]>,
}

impl InstrumentedBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn MediumBackend>) -> Self {
        Self { inner, shards: (0..=OWNED_SHARDS).map(|_| Shard::default()).collect() }
    }

    /// Wraps `inner` and returns the decorator as the trait object the composition root registers.
    pub fn wrap(inner: Arc<dyn MediumBackend>) -> Arc<dyn MediumBackend> {
        Arc::new(Self::new(inner))
    }

    /// The wrapped medium.
    pub fn inner(&self) -> &Arc<dyn MediumBackend> {
        &self.inner
    }

    /// The counters of `op` so far, summed over the shards.
    pub fn counts(&self, op: Op) -> OpCounts {
        let mut out = OpCounts::default();
        for shard in self.shards.iter() {
            let c = &shard.ops[op as usize];
            out.batches += c.batches.load(Ordering::Relaxed);
            out.nanos += c.nanos.load(Ordering::Relaxed);
            out.bytes += c.bytes.load(Ordering::Relaxed);
            for (sum, cell) in out.entries.iter_mut().zip(&c.entries) {
                *sum += cell.load(Ordering::Relaxed);
            }
        }
        out
    }

    /// Runs `call` (timed when [`OpCounters::begin`] says so, else charged the latest small call's
    /// time) and records its tally under `op`.
    #[inline]
    fn measure<R>(&self, op: Op, entries: usize, call: impl FnOnce() -> R, classify: impl FnOnce(&R, &mut Tally)) -> R {
        let shard = owner::shard();
        let owned = shard < OWNED_SHARDS;
        let counters = &self.shards[shard].ops[op as usize];
        let small = entries < TIME_EVERY_ENTRIES;
        let out = if counters.begin(small, owned) {
            let start = Instant::now();
            let out = call();
            // Saturating: a call longer than 584 years is not worth a panic path.
            let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
            add(&counters.nanos, nanos, owned);
            if small {
                counters.last_small_nanos.store(nanos, Ordering::Relaxed);
            }
            out
        } else {
            add(&counters.nanos, counters.last_small_nanos.load(Ordering::Relaxed), owned);
            call()
        };
        let mut tally = Tally::default();
        classify(&out, &mut tally);
        counters.record(&tally, owned);
        out
    }
}

impl MetricSource for InstrumentedBackend {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let label = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        let mut out = Vec::new();
        for op in Op::ALL {
            let c = self.counts(op);
            for status in Status::ALL {
                let n = c.entries(status);
                if n > 0 {
                    out.push(MetricSample::counter(
                        names::OPS_TOTAL,
                        names::OPS_TOTAL_HELP,
                        vec![label("op", op.as_str()), label("status", status.as_str())],
                        n,
                    ));
                }
            }
            if c.batches == 0 {
                continue;
            }
            let op_label = || vec![label("op", op.as_str())];
            out.push(MetricSample::counter(names::BATCHES_TOTAL, names::BATCHES_TOTAL_HELP, op_label(), c.batches));
            let mut seconds =
                MetricSample::counter(names::OP_SECONDS_TOTAL, names::OP_SECONDS_TOTAL_HELP, op_label(), c.nanos);
            seconds.scale = 1e-9;
            out.push(seconds);
            // Emitted at 0 too once the op ran: a panel's series exists from the first call.
            if op.counts_bytes() {
                out.push(MetricSample::counter(names::BYTES_TOTAL, names::BYTES_TOTAL_HELP, op_label(), c.bytes));
            }
        }
        out.extend(self.inner.sample_metrics());
        out
    }
}

impl MediumBackend for InstrumentedBackend {
    fn tier(&self) -> TierType {
        self.inner.tier()
    }

    fn name(&self) -> &str {
        self.inner.name()
    }

    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        self.inner.init(registrar)
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }

    fn capacity(&self) -> TierCapacity {
        self.inner.capacity()
    }

    fn owned_key_count(&self) -> usize {
        self.inner.owned_key_count()
    }

    fn drain_pending_events(&self) -> Vec<KvEvent> {
        self.inner.drain_pending_events()
    }

    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        self.inner.snapshot_owned_keys()
    }

    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        self.inner.snapshot_owned_keys_for_full_sync()
    }

    fn clear_local(&self) {
        self.inner.clear_local();
    }

    fn clear_full_sync_acked(&self) {
        self.inner.clear_full_sync_acked();
    }

    fn is_clear_full_sync_pending(&self) -> bool {
        self.inner.is_clear_full_sync_pending()
    }

    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.inner.set_auto_flush_hook(threshold, hook);
    }

    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        self.measure(
            Op::Allocate,
            requests.len(),
            || self.inner.batch_allocate(requests),
            |results, t| {
                for r in results {
                    let status = match r.outcome {
                        AllocateOutcome::Allocated => Status::Ok,
                        AllocateOutcome::AlreadyExists => Status::Exists,
                        // Busy, like a busy resolve: the medium could not serve the entry now.
                        AllocateOutcome::FailedNoSpace | AllocateOutcome::Busy => Status::NoSpace,
                        AllocateOutcome::Failed => Status::Failed,
                    };
                    t.add(status, 0);
                }
            },
        )
    }

    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        self.measure(
            Op::Commit,
            requests.len(),
            || self.inner.batch_commit(requests),
            |results, t| {
                for r in results {
                    if r.success { t.add(Status::Ok, r.bytes_committed) } else { t.add(Status::Failed, 0) }
                }
            },
        )
    }

    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        self.measure(
            Op::Abort,
            slot_ids.len(),
            || self.inner.batch_abort(slot_ids),
            |results, t| {
                for ok in results {
                    t.add(if *ok { Status::Ok } else { Status::Failed }, 0);
                }
            },
        )
    }

    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        self.measure(Op::Resolve, keys.len(), || self.inner.batch_resolve(keys, include_descs), tally_resolves)
    }

    fn batch_resolve_ranges(
        &self,
        keys: &[String],
        ranges: &[Vec<(u64, u64)>],
        include_descs: bool,
    ) -> Vec<ResolvedEntry> {
        // Counted as resolves: the same answers, served partially or not.
        self.measure(
            Op::Resolve,
            keys.len(),
            || self.inner.batch_resolve_ranges(keys, ranges, include_descs),
            tally_resolves,
        )
    }

    fn release_reads(&self, reads: &[ReadRelease]) {
        // Not a slot-lifecycle op of its own: a release only ends leases early.
        self.inner.release_reads(reads);
    }

    fn batch_contains(&self, keys: &[String]) -> Vec<bool> {
        self.measure(
            Op::Lookup,
            keys.len(),
            || self.inner.batch_contains(keys),
            |results, t| {
                for found in results {
                    t.add(if *found { Status::Ok } else { Status::Miss }, 0);
                }
            },
        )
    }

    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        self.measure(
            Op::Evict,
            keys.len(),
            || self.inner.evict(keys),
            |results, t| {
                for r in results {
                    if r.bytes_freed > 0 { t.add(Status::Ok, r.bytes_freed) } else { t.add(Status::Miss, 0) }
                }
            },
        )
    }

    fn page_size(&self) -> u64 {
        self.inner.page_size()
    }

    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.inner.all_buffer_descs()
    }

    fn buffer_count(&self) -> usize {
        self.inner.buffer_count()
    }

    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        self.inner.buffer_ref(index)
    }
}

/// How a resolve's answers are counted: a hit with its bytes, a busy key as no space, a miss.
fn tally_resolves(results: &Vec<ResolvedEntry>, t: &mut Tally) {
    for r in results {
        match (r.found, r.busy) {
            (true, _) => t.add(Status::Ok, r.size),
            (false, true) => t.add(Status::NoSpace, 0),
            (false, false) => t.add(Status::Miss, 0),
        }
    }
}
