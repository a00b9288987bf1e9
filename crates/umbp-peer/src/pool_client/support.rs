//! Pieces the put and get paths share: caller buffers, the blocking helper, a small `join_all`,
//! the slot guard, the re-cache worker and page-item planning.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::Poll;
use std::time::Duration;

use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::sync::mpsc;
use umbp_core::{
    AllocateOutcome, AllocateRequest, CommitRequest, LocalRegion, MediumBackend, MemoryLocation, PageLocation,
    TransferRef,
};
use umbp_transfer::{CompositeTransferEngine, TransferItem};

use super::PoolClientStats;
use super::holder::Holder;
use crate::master_client::MasterClient;

/// A caller's buffer for the duration of one batch call.
#[derive(Debug, Clone, Copy)]
pub(super) struct CallerBuf {
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
}

// SAFETY: a `CallerBuf` is derived from a slice the batch call borrows (shared for puts, exclusive
// for gets) for its whole duration; the pointer is only handed to transfer engines, which finish
// (or are drained) before the call returns. Moving the call's future between threads moves the
// borrow with it.
unsafe impl Send for CallerBuf {}
// SAFETY: as above; the client never dereferences it concurrently from two places for one key.
unsafe impl Sync for CallerBuf {}

impl CallerBuf {
    /// A buffer the engines only read (a put's value).
    pub(super) fn of(slice: &[u8]) -> Self {
        Self { ptr: NonNull::new(slice.as_ptr().cast_mut()).unwrap_or(NonNull::dangling()), len: slice.len() }
    }

    /// A buffer the engines write (a get's destination): derived from a unique borrow.
    pub(super) fn of_mut(slice: &mut [u8]) -> Self {
        Self { ptr: NonNull::new(slice.as_mut_ptr()).unwrap_or(NonNull::dangling()), len: slice.len() }
    }
}

/// Runs blocking work: under `block_in_place` on a multi-threaded runtime, inline otherwise (a
/// current-thread runtime cannot `block_in_place`; inline is correct but stalls that runtime).
pub(super) fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Blocking work moved to tokio's blocking pool and awaited without holding a worker, so the task
/// that awaits it can drive other futures meanwhile (the next chunk's route and allocate).
///
/// The work may touch memory the awaiting call borrows (a caller's buffer behind a `LocalRegion`),
/// so dropping an `Offloaded` before the work ends **waits for the work** (work started by
/// [`offload_early`]: until it sends its answer): a cancelled batch never returns while a copy
/// still runs on its buffers. Resolves to `None` if the work panicked.
pub(super) struct Offloaded<R> {
    rx: tokio::sync::oneshot::Receiver<R>,
    done: Arc<WorkDone>,
}

/// Set once the offloaded closure has run or been dropped unrun.
#[derive(Default)]
pub(super) struct WorkDone {
    finished: parking_lot::Mutex<bool>,
    cv: parking_lot::Condvar,
}

/// Marks [`WorkDone`] when dropped: after the work (it is dropped at the closure's end) or with the
/// closure if the pool never ran it (a runtime shutting down).
struct MarkDone(Arc<WorkDone>);

impl Drop for MarkDone {
    fn drop(&mut self) {
        *self.0.finished.lock() = true;
        self.0.cv.notify_all();
    }
}

/// Runs a call on this node's medium: on the blocking pool, awaited, when the medium does drive IO
/// (`drive_io`), else in place; `None` if the call panicked on the pool.
///
/// A batch's pipelined chunks are futures of one task, so a call that blocked the task for a drive
/// write (an SSD commit) or read (a resolve) would stall every other chunk's route, allocate and copy
/// for as long as the drive takes; awaited, it overlaps them. A memory-only medium (DRAM, HBM)
/// answers in microseconds, less than the hand-off to the blocking pool costs, so it runs in place
/// (under `block_in_place` on a multi-threaded runtime).
///
/// The call owns everything it touches (no caller buffer), so a dropped future does not wait for it:
/// it runs to its end detached (a commit then settles its slots, which the dropped batch's guard's
/// aborts leave alone; a resolve's leases lapse), and no async worker blocks on a slow drive.
pub(super) async fn medium_call<R: Send + 'static>(
    medium: &Arc<dyn MediumBackend>,
    drive_io: bool,
    f: impl FnOnce(&dyn MediumBackend) -> R + Send + 'static,
) -> Option<R> {
    let Some(handle) = Handle::try_current().ok().filter(|_| drive_io) else {
        return Some(blocking(|| f(medium.as_ref())));
    };
    let medium = Arc::clone(medium);
    match handle.spawn_blocking(move || f(medium.as_ref())).await {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::error!(error = %e, "a call on this node's medium panicked; its keys fail or miss");
            None
        }
    }
}

/// Runs `f` on the blocking pool (inline without a runtime); see [`Offloaded`].
pub(super) fn offload<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> Offloaded<R> {
    let done = Arc::new(WorkDone::default());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mark = MarkDone(Arc::clone(&done));
    let work = move || {
        let _mark = mark;
        let _ = tx.send(f());
    };
    match Handle::try_current() {
        Ok(h) => drop(h.spawn_blocking(work)),
        Err(_) => work(),
    }
    Offloaded { rx, done }
}

/// [`offload`] for work whose answer is ready before its end: `f` hands the answer over with
/// [`Early::send`], which also marks the work done (so a dropped [`Offloaded`] waits no longer),
/// and may then finish what the caller need not wait for (a frame that ends a holder's leases) —
/// touching nothing the awaiting call borrows. Work that ends without sending resolves to `None`.
pub(super) fn offload_early<R: Send + 'static>(f: impl FnOnce(Early<R>) + Send + 'static) -> Offloaded<R> {
    let done = Arc::new(WorkDone::default());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let early = Early { tx, _mark: MarkDone(Arc::clone(&done)) };
    let work = move || f(early);
    match Handle::try_current() {
        Ok(h) => drop(h.spawn_blocking(work)),
        Err(_) => work(),
    }
    Offloaded { rx, done }
}

/// The answer of [`offload_early`]'s work, sent once.
pub(super) struct Early<R> {
    tx: tokio::sync::oneshot::Sender<R>,
    _mark: MarkDone,
}

impl<R> Early<R> {
    /// Marks the work done, then hands `answer` to the awaiting call (in that order, so the woken
    /// call never waits on the mark). The caller of `send` has stopped touching borrowed memory.
    pub(super) fn send(self, answer: R) {
        let Self { tx, _mark: mark } = self;
        drop(mark);
        let _ = tx.send(answer);
    }
}

impl<R> Future for Offloaded<R> {
    type Output = Option<R>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Option<R>> {
        Pin::new(&mut self.rx).poll(cx).map(Result::ok)
    }
}

impl<R> Drop for Offloaded<R> {
    fn drop(&mut self) {
        let mut finished = self.done.finished.lock();
        while !*finished {
            self.done.cv.wait(&mut finished);
        }
    }
}

/// Bytes per pipelined chunk of a batch. Each chunk is routed, allocated (or resolved), moved and
/// committed on its own, so one chunk's control calls overlap another's data movement; a batch
/// smaller than this is one chunk and runs exactly as before.
pub(super) const PIPELINE_CHUNK_BYTES: u64 = 8 << 20;

/// Chunks of one batch in flight at once. Chosen by measurement: over eight runs each of `umbp bench`
/// on a 2-core VM, depth 6 beat 1 and 3 on the local cells (64 KiB put 0.46 / 0.59 / 0.68 of memcpy)
/// and matched them on the remote ones; 8 was no better than 6.
pub(super) const PIPELINE_DEPTH: usize = 6;

/// Splits `indexes` (in order) into chunks of about [`PIPELINE_CHUNK_BYTES`] by `size`.
pub(super) fn chunk_by_bytes(indexes: Vec<usize>, size: impl Fn(usize) -> u64) -> Vec<Vec<usize>> {
    let mut chunks = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0u64;
    for i in indexes {
        current.push(i);
        bytes = bytes.saturating_add(size(i));
        if bytes >= PIPELINE_CHUNK_BYTES {
            chunks.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Runs `f` over every chunk, at most [`PIPELINE_DEPTH`] at once, in one task (the chunks borrow
/// the caller's batch); outputs in chunk order. Chunks start in order (the semaphore is fair).
pub(super) async fn pipelined<'a, T, Fut>(chunks: &'a [Vec<usize>], f: impl Fn(&'a [usize]) -> Fut) -> Vec<T>
where
    Fut: Future<Output = T>,
{
    pipelined_with(PIPELINE_DEPTH, chunks, f).await
}

/// [`pipelined`] with at most `depth` chunks at once.
pub(super) async fn pipelined_with<'a, T, Fut>(
    depth: usize,
    chunks: &'a [Vec<usize>],
    f: impl Fn(&'a [usize]) -> Fut,
) -> Vec<T>
where
    Fut: Future<Output = T>,
{
    let permits = tokio::sync::Semaphore::new(depth.max(1));
    let (permits, f) = (&permits, &f);
    join_all(
        chunks
            .iter()
            .map(|chunk| async move {
                // Never closed, so `acquire` cannot fail; a failure would only lift the bound.
                let _permit = permits.acquire().await.ok();
                f(chunk).await
            })
            .collect(),
    )
    .await
}

/// Awaits every future concurrently; outputs in input order.
pub(super) async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futures.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *slot = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending { Poll::Pending } else { Poll::Ready(()) }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// How long a chunk waits out nodes that answer busy (a read: the key is there but every staging
/// page is held by other readers; a write: the node has room but every staging page is held by
/// in-flight writes and reads) before it gives their keys up with
/// [`KeyError::Busy`](super::KeyError::Busy): longer than the SSD read lease (3 s), so even pages
/// held by a reader that died come back within it.
pub(super) const BUSY_WAIT: Duration = Duration::from_secs(10);
/// The first wait before asking a busy node again; it doubles each round up to the maximum.
pub(super) const BUSY_BACKOFF_MIN: Duration = Duration::from_millis(1);
/// The longest wait between two asks of a busy node.
pub(super) const BUSY_BACKOFF_MAX: Duration = Duration::from_millis(100);

/// When any chunk of one batch last made progress. The chunks of a batch run together and may
/// share one small staging arena: a chunk that keeps losing the race for its pages to its siblings
/// is not starved into [`KeyError::Busy`](super::KeyError::Busy) while they move; it gives up only
/// once the whole batch stopped moving.
#[derive(Debug)]
pub(super) struct BatchProgress(parking_lot::Mutex<std::time::Instant>);

impl BatchProgress {
    /// Progress counts from now.
    pub(super) fn new() -> Self {
        Self(parking_lot::Mutex::new(std::time::Instant::now()))
    }

    fn mark(&self) {
        *self.0.lock() = std::time::Instant::now();
    }

    fn last(&self) -> std::time::Instant {
        *self.0.lock()
    }
}

/// One chunk's wait for nodes that answered busy, shared by the get and put paths: after a round
/// that made progress (it copied or committed something, so its own releases and commits just gave
/// pages back) a busy node is asked again at once; otherwise after a backoff doubling from
/// [`BUSY_BACKOFF_MIN`] to [`BUSY_BACKOFF_MAX`]. The chunk gives its busy keys up once
/// [`BUSY_WAIT`] passed without progress of any chunk of its batch.
#[derive(Debug)]
pub(super) struct BusyWait<'a> {
    batch: &'a BatchProgress,
    last_progress: std::time::Instant,
    backoff: Duration,
    progressed: bool,
}

impl<'a> BusyWait<'a> {
    /// A wait that counts from now, as if the chunk had just made progress.
    pub(super) fn new(batch: &'a BatchProgress) -> Self {
        Self { batch, last_progress: std::time::Instant::now(), backoff: BUSY_BACKOFF_MIN, progressed: true }
    }

    /// Records whether the round that just ran made progress.
    pub(super) fn round(&mut self, progressed: bool) {
        self.progressed = progressed;
        if progressed {
            self.last_progress = std::time::Instant::now();
            self.backoff = BUSY_BACKOFF_MIN;
            self.batch.mark();
        }
    }

    /// Before asking a busy node again: waits the backoff (and doubles it) unless the last round
    /// made progress.
    pub(super) async fn pause(&mut self) {
        if !self.progressed {
            tokio::time::sleep(self.backoff).await;
            self.backoff = (self.backoff * 2).min(BUSY_BACKOFF_MAX);
        }
    }

    /// Whether [`BUSY_WAIT`] passed since the last progress of this chunk or of any other chunk
    /// of its batch: give the busy keys up.
    pub(super) fn expired(&self) -> bool {
        self.last_progress.max(self.batch.last()).elapsed() >= BUSY_WAIT
    }
}

/// Read releases sent in the background (fire and forget: a reader's result never waits for its
/// release), kept so that `close` can wait for the ones still in flight: a short-lived client (one
/// `umbp get`) must not exit before its release leaves, or the holder keeps the pages for the whole
/// read lease.
#[derive(Debug, Default)]
pub(super) struct Releases {
    tasks: parking_lot::Mutex<Vec<tokio::task::JoinHandle<()>>>,
}

impl Releases {
    /// Runs `release` in the background (dropped without a runtime: the lease then expires).
    pub(super) fn spawn(&self, release: impl Future<Output = ()> + Send + 'static) {
        let Ok(handle) = Handle::try_current() else { return };
        let task = handle.spawn(release);
        let mut tasks = self.tasks.lock();
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }

    /// Waits (at most `bound`) for every release still in flight.
    pub(super) async fn drain(&self, bound: Duration) {
        let tasks = std::mem::take(&mut *self.tasks.lock());
        let all = async {
            for t in tasks {
                let _ = t.await;
            }
        };
        if tokio::time::timeout(bound, all).await.is_err() {
            tracing::debug!("read releases still in flight at close; their leases expire instead");
        }
    }
}

/// Whether `peer` (`host:port`) refuses TCP connections now: nothing listens there (the holder's
/// process is gone). A timeout or any other failure is not a refusal.
pub(super) async fn refuses_connections(peer: &str, timeout: Duration) -> bool {
    matches!(
        tokio::time::timeout(timeout, tokio::net::TcpStream::connect(peer)).await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// The live counters behind [`PoolClientStats`].
#[derive(Debug, Default)]
pub(super) struct StatCounters {
    pub(super) reroutes: AtomicU64,
    pub(super) lease_lapses: AtomicU64,
    pub(super) slot_expiries: AtomicU64,
    pub(super) recache_queued: AtomicU64,
    pub(super) recache_dropped: AtomicU64,
    pub(super) recache_stored: AtomicU64,
    pub(super) keyed_gets: AtomicU64,
    pub(super) keyed_puts: AtomicU64,
    pub(super) puts_copied_ahead: AtomicU64,
    pub(super) puts_withdrawn: AtomicU64,
    pub(super) checksum_failures: AtomicU64,
}

impl StatCounters {
    pub(super) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self) -> PoolClientStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PoolClientStats {
            reroutes: get(&self.reroutes),
            lease_lapses: get(&self.lease_lapses),
            slot_expiries: get(&self.slot_expiries),
            recache_queued: get(&self.recache_queued),
            recache_dropped: get(&self.recache_dropped),
            recache_stored: get(&self.recache_stored),
            keyed_gets: get(&self.keyed_gets),
            keyed_puts: get(&self.keyed_puts),
            puts_copied_ahead: get(&self.puts_copied_ahead),
            puts_withdrawn: get(&self.puts_withdrawn),
            checksum_failures: get(&self.checksum_failures),
        }
    }
}

/// Allocated-but-unsettled slots of one batch, by holder. Whatever is still here when the guard is
/// flushed or dropped is aborted: every failure branch (and a cancelled future) releases its slots at
/// once instead of waiting for the pending TTL.
#[derive(Default)]
pub(super) struct SlotGuard {
    slots: HashMap<String, (Holder, Vec<u64>)>,
}

impl SlotGuard {
    /// Tracks a slot on `holder`.
    pub(super) fn track(&mut self, holder: &Holder, slot_id: u64) {
        self.slots.entry(holder.node().to_owned()).or_insert_with(|| (holder.clone(), Vec::new())).1.push(slot_id);
    }

    /// The slot was committed: nothing to abort.
    pub(super) fn settle(&mut self, node: &str, slot_id: u64) {
        if let Some((_, list)) = self.slots.get_mut(node) {
            list.retain(|id| *id != slot_id);
        }
    }

    /// Aborts everything still tracked (best effort: a missed abort is reaped by the slot TTL).
    pub(super) async fn abort_all(&mut self) {
        for (holder, ids) in std::mem::take(&mut self.slots).into_values() {
            holder.abort(ids).await;
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        for (holder, ids) in std::mem::take(&mut self.slots).into_values() {
            holder.abort_detached(ids);
        }
    }
}

/// Where a value's pages are on a medium: the pages in value order, the medium's buffer table
/// they index, and its page size. `partial_from` is `None` for the whole value's pages; a partial
/// hit of a ranged read (`Some(first)`) holds value pages `first ..` only, with only its ranges'
/// bytes in them.
#[derive(Clone, Copy)]
pub(super) struct PageLayout<'a> {
    pub(super) pages: &'a [PageLocation],
    pub(super) refs: &'a [Option<TransferRef>],
    pub(super) page_size: u64,
    pub(super) partial_from: Option<u64>,
}

/// One transfer item per page between the caller's memory (`user`, from `user_base`) and the
/// medium's pages. `to_medium` is a put.
pub(super) fn page_items(
    user: &TransferRef,
    user_base: u64,
    size: u64,
    layout: PageLayout<'_>,
    tag: u64,
    to_medium: bool,
) -> Result<Vec<TransferItem>, String> {
    let PageLayout { pages, refs, page_size, partial_from } = layout;
    if page_size == 0 || partial_from.is_some() || pages.len() as u64 != size.div_ceil(page_size) {
        return Err(format!("{} pages of {page_size} bytes cannot hold {size} bytes", pages.len()));
    }
    let mut items = Vec::with_capacity(pages.len());
    for (p, page) in pages.iter().enumerate() {
        let offset = p as u64 * page_size;
        let len = page_size.min(size - offset);
        let Some(Some(medium_ref)) = refs.get(page.buffer_index as usize) else {
            return Err(format!("no descriptor for buffer {}", page.buffer_index));
        };
        let medium_offset = u64::from(page.page_index) * page_size;
        let (src, src_offset, dst, dst_offset) = if to_medium {
            (user.clone(), user_base + offset, medium_ref.clone(), medium_offset)
        } else {
            (medium_ref.clone(), medium_offset, user.clone(), user_base + offset)
        };
        items.push(TransferItem { src, src_offset, dst, dst_offset, size: len, tag });
    }
    Ok(items)
}

/// Groups keys by the nodes each must not be routed to — its own exclusions and every node
/// unreachable now — so that one route call serves each distinct set (sets in a stable order).
pub(super) fn by_exclude_set<'a>(
    keys: &[usize],
    excluded: impl Fn(usize) -> Option<&'a BTreeSet<String>>,
    unreachable: &[String],
) -> Vec<(Vec<String>, Vec<usize>)> {
    let mut by_set: BTreeMap<Vec<String>, Vec<usize>> = BTreeMap::new();
    for &i in keys {
        let mut set: BTreeSet<String> = excluded(i).cloned().unwrap_or_default();
        set.extend(unreachable.iter().cloned());
        by_set.entry(set.into_iter().collect()).or_default().push(i);
    }
    by_set.into_iter().collect()
}

/// Routes `keys` at the master once per distinct exclude set ([`by_exclude_set`]), the calls
/// concurrent; `route` makes one call for a set and its keys. Returns `(key, answer)` for every key
/// the calls answered, and [`KeyError::Routing`](super::KeyError::Routing) for every key of a set
/// whose call failed (the error shared among them).
pub(super) async fn route_by_exclude_set<'a, T, Fut>(
    keys: &[usize],
    excluded: impl Fn(usize) -> Option<&'a BTreeSet<String>>,
    unreachable: &[String],
    route: impl Fn(Vec<String>, Vec<usize>) -> Fut,
) -> Vec<(usize, Result<T, super::KeyError>)>
where
    Fut: Future<Output = Result<Vec<T>, crate::master_client::MasterClientError>>,
{
    let sets = by_exclude_set(keys, excluded, unreachable);
    let calls = sets.iter().map(|(set, indexes)| route(set.clone(), indexes.clone())).collect();
    let mut out = Vec::with_capacity(keys.len());
    for ((_, indexes), answer) in sets.iter().zip(join_all(calls).await) {
        match answer {
            Ok(answers) => out.extend(indexes.iter().copied().zip(answers.into_iter().map(Ok))),
            Err(e) => {
                let e = super::SharedError::new(e);
                out.extend(indexes.iter().map(|i| (*i, Err(super::KeyError::Routing(e.clone())))));
            }
        }
    }
    out
}

/// A value fetched from a peer, to store on this node's medium.
#[derive(Debug)]
pub(super) struct RecacheJob {
    pub(super) key: String,
    pub(super) bytes: Vec<u8>,
}

/// Stores re-cache jobs on the local medium, one at a time, off the get path. Ends when the sender
/// is dropped (at `close`).
pub(super) async fn recache_worker(
    mut rx: mpsc::Receiver<RecacheJob>,
    medium: Arc<dyn MediumBackend>,
    engine: Arc<CompositeTransferEngine>,
    master: Weak<MasterClient>,
    stats: Arc<StatCounters>,
) {
    while let Some(job) = rx.recv().await {
        let (medium, engine) = (Arc::clone(&medium), Arc::clone(&engine));
        let stored =
            tokio::task::spawn_blocking(move || store_locally(medium.as_ref(), &engine, &job)).await.unwrap_or(false);
        if stored {
            StatCounters::add(&stats.recache_stored, 1);
            if let Some(m) = master.upgrade() {
                m.flush();
            }
        }
    }
}

/// Allocate → copy → commit on the local medium; `NoSpace` or an existing key is a silent no-op.
fn store_locally(medium: &dyn MediumBackend, engine: &CompositeTransferEngine, job: &RecacheJob) -> bool {
    let size = job.bytes.len() as u64;
    let Some(a) = medium.batch_allocate(&[AllocateRequest::new(job.key.clone(), size)]).pop() else { return false };
    if a.outcome != AllocateOutcome::Allocated {
        return false;
    }
    let refs: Vec<Option<TransferRef>> = (0..medium.buffer_count()).map(|b| medium.buffer_ref(b)).collect();
    let buf = CallerBuf::of(&job.bytes);
    // SAFETY: `job.bytes` outlives the transfer below, which completes before this function returns.
    let src = TransferRef::local(unsafe { LocalRegion::new(buf.ptr, size, MemoryLocation::Host) });
    let layout = PageLayout { pages: &a.pages, refs: &refs, page_size: a.page_size, partial_from: None };
    let ok = match page_items(&src, 0, size, layout, 0, true) {
        Ok(items) => umbp_transfer::transfer(engine, &items).is_ok(),
        Err(_) => false,
    };
    if ok && medium.batch_commit(&[CommitRequest::new(a.slot_id, job.key.clone())]).first().is_some_and(|r| r.success) {
        return true;
    }
    medium.batch_abort(&[a.slot_id]);
    false
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    use super::*;

    #[test]
    fn chunks_follow_the_byte_budget_and_keep_order() {
        let sizes = [3u64 << 20, 3 << 20, 3 << 20, 9 << 20, 1, 1];
        let chunks = chunk_by_bytes((0..sizes.len()).collect(), |i| sizes[i]);
        assert_eq!(chunks, vec![vec![0, 1, 2], vec![3], vec![4, 5]]);
        assert!(chunk_by_bytes(Vec::new(), |_| 1).is_empty());
        assert_eq!(chunk_by_bytes(vec![7], |_| u64::MAX), vec![vec![7]], "one key is never split");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pipelined_chunks_stay_within_the_depth_and_answer_in_order() {
        let chunks: Vec<Vec<usize>> = (0..12).map(|i| vec![i]).collect();
        let (now, peak) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let out = pipelined(&chunks, |chunk| {
            let (now, peak) = (&now, &peak);
            async move {
                let inside = now.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(inside, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5 + (chunk[0] as u64 % 3) * 3)).await;
                now.fetch_sub(1, Ordering::SeqCst);
                chunk[0] * 10
            }
        })
        .await;
        assert_eq!(out, (0..12).map(|i| i * 10).collect::<Vec<_>>());
        assert_eq!(peak.load(Ordering::SeqCst), PIPELINE_DEPTH, "chunks overlap, up to the depth");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_busy_wait_backs_off_without_progress_and_resets_on_it() {
        let batch = BatchProgress::new();
        let mut w = BusyWait::new(&batch);
        w.pause().await;
        assert_eq!(w.backoff, BUSY_BACKOFF_MIN, "right after progress: ask again at once, no backoff used");
        w.round(false);
        let mut next = Vec::new();
        for _ in 0..9 {
            w.pause().await;
            next.push(w.backoff);
        }
        assert_eq!(next[..3], [2, 4, 8].map(Duration::from_millis), "doubling from 1 ms");
        assert_eq!(next[8], BUSY_BACKOFF_MAX, "capped at 100 ms: {next:?}");
        assert!(!w.expired(), "a few rounds are far inside the wait");
        w.round(true);
        assert_eq!(w.backoff, BUSY_BACKOFF_MIN, "progress resets the backoff");
        if let Some(long_ago) = w.last_progress.checked_sub(BUSY_WAIT) {
            w.last_progress = long_ago;
            assert!(!w.expired(), "another chunk of the batch moved just now: keep waiting");
            *batch.0.lock() = long_ago;
            assert!(w.expired(), "no progress of the batch for the whole wait: give up");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dropping_an_offloaded_job_waits_for_the_work() {
        let finished = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&finished);
        let mut job = Box::pin(offload(move || {
            std::thread::sleep(Duration::from_millis(150));
            flag.store(true, Ordering::SeqCst);
            7
        }));
        // Poll once (the work is running), then cancel: the drop must not return before the work.
        assert!(tokio::time::timeout(Duration::from_millis(10), job.as_mut()).await.is_err());
        drop(job);
        assert!(finished.load(Ordering::SeqCst), "the drop returned while the work still ran");
        assert_eq!(offload(|| 5).await, Some(5));
        assert_eq!(offload(|| -> u8 { panic!("boom") }).await, None, "a panic is None, not a hang");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_early_answer_frees_the_caller_while_the_work_goes_on() {
        // The work answers, then waits (up to 10 s) for the caller to have dropped its future: a
        // drop that still waited for the work would hold the caller until the wait gave up.
        let (freed_tx, freed_rx) = std::sync::mpsc::channel::<()>();
        let (ended_tx, ended_rx) = std::sync::mpsc::channel::<bool>();
        let job = offload_early(move |early: Early<u32>| {
            early.send(7);
            let freed = freed_rx.recv_timeout(Duration::from_secs(10)).is_ok();
            let _ = ended_tx.send(freed);
        });
        assert_eq!(job.await, Some(7));
        freed_tx.send(()).expect("the work waits");
        let freed = tokio::task::spawn_blocking(move || ended_rx.recv_timeout(Duration::from_secs(20)))
            .await
            .expect("joined")
            .expect("the work ended");
        assert!(freed, "the caller was held until the work ended");
        assert_eq!(offload_early(|_: Early<u8>| {}).await, None, "work that never answers is None");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn medium_calls_of_one_task_overlap_instead_of_blocking_it() {
        // Four chunks of one batch, each with a drive-IO medium call: awaited on the blocking pool
        // they overlap. Each call waits (up to 10 s) until all four are inside at once, which only
        // happens when none blocks the task; run one after another, the first gives up and says so.
        let medium: Arc<dyn MediumBackend> =
            Arc::new(umbp_testkit::MockBackend::new(umbp_testkit::MockConfig::default()));
        let inside = Arc::new((std::sync::Mutex::new(0usize), std::sync::Condvar::new()));
        let calls = (0..4)
            .map(|i| {
                let inside = Arc::clone(&inside);
                medium_call(&medium, true, move |m| {
                    let (count, all_in) = &*inside;
                    let mut n = count.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    *n += 1;
                    all_in.notify_all();
                    let (n, waited) = all_in
                        .wait_timeout_while(n, Duration::from_secs(10), |n| *n < 4)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    drop(n);
                    (i, !waited.timed_out(), m.tier())
                })
            })
            .collect();
        let out = join_all(calls).await;
        assert_eq!(out.iter().map(|o| o.map(|(i, _, _)| i)).collect::<Vec<_>>(), [Some(0), Some(1), Some(2), Some(3)]);
        assert!(out.iter().all(|o| o.is_some_and(|(_, together, _)| together)), "the calls ran one after another");
        assert_eq!(medium_call(&medium, true, |_| -> u8 { panic!("boom") }).await, None, "a panic is None");
        assert_eq!(medium_call(&medium, false, |m| m.tier()).await, Some(medium.tier()), "in place");
    }
}
