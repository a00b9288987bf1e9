//! The copies of one same-host batch, fanned out over a kept pool of threads.
//!
//! One GET_KEYS exchange answers every key of a batch chunk (`KeyedClient::get_shared_batch`);
//! its values' copies then run on as many threads as the host has cores, as a multi-threaded
//! memcpy would, instead of one thread per chunk: the chunk's exchange is paid once while every
//! core copies. Each value is copied in blocks, and a value to check is summed block by block
//! right after each block lands, while it is still in L2 (summing a whole 1 MiB value after its
//! copy read it back from L3: ~20 % of the copy's time on the 16-core host). A batch too large for
//! the cache ([`ValueCopy::streamed`]) is copied with streaming stores and summed from the
//! holder's bytes instead, which the copy's loads left in the cache.
//!
//! A batch put's writes fan out the same way ([`write_values`]): one PUT_KEYS answers every slot
//! of a chunk, then each value is written (streaming stores, `SharedMapping::write_at`) and summed
//! block by block on a pool thread, so a chunk's exchange is paid once while every core copies.
//! (Before puts streamed and summed while copying, a fanned put ran 14–19 GB/s on the 16-core host
//! against 19–21 for one chunk per core; see `docs/benchmarks.md` for the comparison since.)
//!
//! The pool (`umbp-shm-copy-N`, one thread per core) is started at the first batch large enough
//! to use it and kept for the process; smaller batches copy on the calling thread. Each value is
//! one job, queued behind the values of batches fanned out before (`in_order_on`): of a batch's
//! chunks in flight together, the first fanned out is the first done.
//!
//! The in-process copy engine's summed copies (`LocalCopyEngine::transfer_summed`, a node reading
//! its own medium) use the same loop over local sources ([`Source::Local`]).

use std::num::NonZeroUsize;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use umbp_core::ValueCrc32c;

use super::{SharedMapping, ShmError};

/// Copy work below this runs on the calling thread: handing it to the pool costs more than it
/// saves.
const FAN_OUT_BYTES: u64 = 2 << 20;

/// The block a value is copied and summed in: summed while it is still in L2.
pub(crate) const BLOCK: usize = 256 << 10;

/// The kept pool; `None` when it could not be started (everything then copies on the caller).
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("umbp-shm-copy-{i}"))
            .build()
            .inspect_err(|e| tracing::warn!(error = %e, "no copy pool: same-host batches copy on one thread"))
            .ok()
    })
    .as_ref()
}

/// Where a [`Piece`]'s bytes are.
pub(crate) enum Source {
    /// A holder's region mapped here: read with its epoch checked before and after.
    Mapping(Arc<SharedMapping>),
    /// Host memory of this process (the local copy engine's checked range), valid for reads of the
    /// piece for the call; it may overlap nothing another value of the call writes.
    Local(NonNull<u8>),
}

/// `len` bytes at `offset` of a [`Source`].
pub(crate) struct Piece {
    pub(crate) source: Source,
    pub(crate) offset: u64,
    pub(crate) len: usize,
}

/// Where a [`ValueCopy`]'s pieces go, and so which side is summed.
pub(crate) enum Dst {
    /// One range the pieces fill in order (a read into a caller's buffer). The sum is of the
    /// landed bytes: it checks the copy against the writer's sum.
    Range(NonNull<u8>),
    /// Each piece's own destination, one per piece, in order (a write from a caller's buffer into
    /// a medium's pages). The sum is of the [`Source::Local`] bytes read for the copy — the
    /// caller's value, for a later reader to check its copy against. (A [`Source::Mapping`] piece,
    /// which no write has, would be summed as it landed.)
    Each(Vec<NonNull<u8>>),
}

/// One value's copy: its pieces, in value order, into `dst`.
pub(crate) struct ValueCopy {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) dst: Dst,
    /// Sum the value (see [`Dst`] for which side).
    pub(crate) sum: bool,
    /// Read mapped pieces with streaming stores ([`SharedMapping::read_streamed_at`]): the
    /// destination is left in memory, not in the cache, so the sum is of the holder's bytes as
    /// the copy read them (still in this core's cache), not of the landed ones.
    pub(crate) streamed: bool,
}

// SAFETY: `dst` is caller memory that `copy_values_then`' contract makes valid and exclusive to this
// value's copy for the call; the pieces are shared mappings (themselves `Send + Sync`) or local
// memory the same contract keeps valid and unwritten for the call. Each `ValueCopy` is copied by
// exactly one thread.
unsafe impl Send for ValueCopy {}
// SAFETY: as above: a shared `&ValueCopy` only hands its one copying thread the pointer.
unsafe impl Sync for ValueCopy {}

impl ValueCopy {
    fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len as u64).sum()
    }

    /// Where piece `k`, which starts `at` bytes into the value, is written.
    pub(crate) fn piece_dst(&self, k: usize, at: usize) -> Option<NonNull<u8>> {
        match &self.dst {
            // Wrapping: computing the address is safe; `copy_values_then`' contract makes it valid.
            Dst::Range(dst) => NonNull::new(dst.as_ptr().wrapping_add(at)),
            Dst::Each(dsts) => dsts.get(k).copied(),
        }
    }
}

/// What one value's copy came to.
#[derive(Debug)]
pub(crate) enum Copied {
    /// Every byte copied, each range's epoch current before and after: the value's size, and its
    /// sum when asked for.
    Done { size: u64, crc32c: Option<u32> },
    /// A range could not be read (its region went stale, say): nothing in `dst` is to be used.
    Failed(ShmError),
}

/// Copies every value, on the pool when the batch holds enough bytes and more than one value, then
/// runs `then` over the answers (one per value, in order) **on the pool thread that ran the
/// copies** when they fanned out (else on the calling thread), and returns its result. A caller
/// that hands the answers on from `then` (to a task awaiting them) does not wait for the calling
/// thread to be woken first: that wake-up (tens of microseconds on a virtualised host) leaves the
/// path it waits on.
///
/// # Safety
/// Each destination (a [`Dst::Range`] for its pieces' total length, each [`Dst::Each`] pointer
/// for its piece's length) is valid for writes, no two overlap, and nobody else
/// reads or writes them until this returns; each [`Source::Local`] piece is valid for reads of
/// `offset + len` bytes, written by nobody until this returns, and overlaps no `dst`.
pub(crate) unsafe fn copy_values_then<R: Send>(values: &[ValueCopy], then: impl FnOnce(Vec<Copied>) -> R + Send) -> R {
    let total: u64 = values.iter().map(ValueCopy::bytes).sum();
    // SAFETY: this function's contract, per value.
    each_value_then(values, total >= FAN_OUT_BYTES, |v| unsafe { copy_value(v) }, then)
}

/// The copies of [`copy_values_then`], fanned out over the pool only if `fan_out` (and there is
/// more than one value), else on the calling thread.
///
/// # Safety
/// As [`copy_values_then`].
pub(crate) unsafe fn copy_values_spread(values: &[ValueCopy], fan_out: bool) -> Vec<Copied> {
    // SAFETY: this function's contract, per value.
    each_value(values, fan_out, |v| unsafe { copy_value(v) })
}

/// `run` over every value, on the pool when `fan_out` (and there is more than one value and a
/// pool), else on the calling thread; the answers in order.
fn each_value<T: Sync, R: Send>(values: &[T], fan_out: bool, run: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
    each_value_then(values, fan_out, run, |answers| answers)
}

/// [`each_value`], then `then` over the answers on the thread that finished the last value (a
/// pool thread when the values fanned out).
fn each_value_then<T: Sync, R: Send, U: Send>(
    values: &[T],
    fan_out: bool,
    run: impl Fn(&T) -> R + Sync + Send,
    then: impl FnOnce(Vec<R>) -> U + Send,
) -> U {
    match pool() {
        Some(pool) if values.len() > 1 && fan_out => in_order_on(pool, values, run, then),
        _ => then(values.iter().map(run).collect()),
    }
}

/// `run` over every value on `pool`, one job per value, the jobs queued in value order behind
/// those of batches fanned out before; `then` over the answers on the pool thread whose value
/// finished last. Blocks until every job has run.
///
/// Why queued jobs rather than a parallel iterator: the iterator splits a batch by `join`, and a
/// pool thread waiting on a `join` whose other half another thread took runs whatever it can
/// take meanwhile — another batch's whole iterator, on its own stack — so the first batch ends
/// only after that one. With a batch's chunks in flight together, their copies interleaved and
/// the first chunk, cut small to start copying early, was answered last (a 2-core timeline); a
/// pipelined chunk waited for every copy in flight. Queued jobs run in the order they were
/// fanned out, and a batch ends when its last job does. (On the 16-core host the change also
/// took a node's reads of its own medium from ~34 to ~44 GB/s: see `docs/benchmarks.md`.)
fn in_order_on<T: Sync, R: Send, U: Send>(
    pool: &rayon::ThreadPool,
    values: &[T],
    run: impl Fn(&T) -> R + Sync + Send,
    then: impl FnOnce(Vec<R>) -> U + Send,
) -> U {
    let slots: Vec<Mutex<Option<R>>> = values.iter().map(|_| Mutex::new(None)).collect();
    let left = AtomicUsize::new(values.len());
    let then = Mutex::new(Some(then));
    let out: Mutex<Option<U>> = Mutex::new(None);
    let (run, slots, left, then_once, out_slot) = (&run, &slots, &left, &then, &out);
    // Jobs spawned from outside the pool go to its shared queue, which pool threads take from
    // in order once their own work is done; a pool thread's own spawns keep a per-thread order.
    pool.in_place_scope_fifo(|scope| {
        for (value, slot) in values.iter().zip(slots) {
            scope.spawn_fifo(move |_| {
                *lock(slot) = Some(run(value));
                // The last value's job (every other job's answer stored before its decrement).
                if left.fetch_sub(1, Ordering::AcqRel) == 1
                    && let Some(then) = lock(then_once).take()
                {
                    let answers = slots.iter().filter_map(|slot| lock(slot).take()).collect();
                    *lock(out_slot) = Some(then(answers));
                }
            });
        }
    });
    // Every job ran (a panic in one is raised by the scope above), so the last one ran `then`.
    match out.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(out) => out,
        None => unreachable!("the job that finished the last value ran `then`"),
    }
}

/// A lock whose holder cannot leave its data half-written (each is a single store or take).
fn lock<V>(m: &Mutex<V>) -> MutexGuard<'_, V> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `len` bytes at `offset` of a holder's region mapped here: where part of a put's value goes.
pub(crate) struct Target {
    pub(crate) mapping: Arc<SharedMapping>,
    pub(crate) offset: u64,
    pub(crate) len: usize,
}

/// One value's write into a holder's slot: `src`, cut in order over `targets`.
pub(crate) struct ValueWrite<'a> {
    pub(crate) src: &'a [u8],
    pub(crate) targets: Vec<Target>,
    /// Sum `src` while it is written (each block right after its copy, still in L2).
    pub(crate) sum: bool,
}

/// Writes every value into its targets, on the pool when the batch holds enough bytes and more
/// than one value. One answer per value, in order: its sum when asked for (`Ok(None)` when not),
/// or why it could not be written (a region gone stale, targets that do not cover the value): the
/// slot must then not be committed.
pub(crate) fn write_values(values: &[ValueWrite<'_>]) -> Vec<Result<Option<u32>, ShmError>> {
    let total: u64 = values.iter().map(|v| v.src.len() as u64).sum();
    each_value(values, total >= FAN_OUT_BYTES, write_value)
}

/// Writes one value block by block, summing each block after its copy when asked.
fn write_value(v: &ValueWrite<'_>) -> Result<Option<u32>, ShmError> {
    let covered = v.targets.iter().try_fold(0usize, |t, part| t.checked_add(part.len));
    if covered != Some(v.src.len()) {
        return Err(ShmError::Invalid(format!("slot ranges for a value of {} bytes", v.src.len())));
    }
    let mut sum = v.sum.then(ValueCrc32c::new);
    let mut at = 0usize;
    for part in &v.targets {
        let src = &v.src[at..at + part.len];
        for (k, block) in src.chunks(BLOCK).enumerate() {
            part.mapping.write_at(part.offset + (k * BLOCK) as u64, block)?;
            if let Some(sum) = &mut sum {
                sum.update(block);
            }
        }
        at += part.len;
    }
    Ok(sum.map(|s| s.finish()))
}

/// Copies one value block by block, summing each block after it lands when asked; a streamed
/// value's mapped pieces as [`ValueCopy::streamed`] says.
///
/// # Safety
/// As [`copy_values_then`], for this value.
unsafe fn copy_value(v: &ValueCopy) -> Copied {
    let mut sum = v.sum.then(ValueCrc32c::new);
    let mut at = 0usize;
    for (k, piece) in v.pieces.iter().enumerate() {
        let Some(dst) = v.piece_dst(k, at) else {
            return Copied::Failed(ShmError::Invalid(format!("no destination for piece {k}")));
        };
        let sums_source = v.streamed || matches!(v.dst, Dst::Each(_));
        let mut done = 0usize;
        while done < piece.len {
            let n = (piece.len - done).min(BLOCK);
            // SAFETY: `done + n` is at most the piece's length, for which its destination is valid
            // and ours alone (this function's contract).
            let block = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr().add(done), n) };
            // Whether the arm summed the block already: the bytes read, when the copy streamed
            // past the cache or wrote a medium; else the landed block is summed below.
            let summed = match &piece.source {
                Source::Mapping(mapping) if v.streamed => {
                    let seen = |seen: &[u8]| {
                        if let Some(sum) = &mut sum {
                            sum.update(seen);
                        }
                    };
                    if let Err(e) = mapping.read_streamed_at(piece.offset + done as u64, block, seen) {
                        return Copied::Failed(e);
                    }
                    true
                }
                Source::Mapping(mapping) => {
                    if let Err(e) = mapping.read_at(piece.offset + done as u64, block) {
                        return Copied::Failed(e);
                    }
                    false
                }
                Source::Local(src) => {
                    // SAFETY: `offset + done + n <= offset + len`, inside the checked local range
                    // (`copy_values_then`' contract), which does not overlap `dst`; read only.
                    let from = unsafe { std::slice::from_raw_parts(src.as_ptr().add(piece.offset as usize + done), n) };
                    if v.streamed {
                        // SAFETY: as above.
                        unsafe { super::stream::copy(block.as_mut_ptr(), from.as_ptr(), n) };
                    } else {
                        block.copy_from_slice(from);
                    }
                    match &mut sum {
                        Some(sum) if sums_source => {
                            sum.update(from);
                            true
                        }
                        _ => false,
                    }
                }
            };
            if let Some(sum) = &mut sum
                && !summed
            {
                sum.update(block);
            }
            done += n;
        }
        at += piece.len;
    }
    Copied::Done { size: at as u64, crc32c: sum.map(|s| s.finish()) }
}

#[cfg(test)]
mod tests {
    use super::super::epochs::EpochTable;
    use super::*;

    const REGION: usize = 8 << 20;

    /// A region of [`REGION`] bytes in a memory file, mapped as a same-host writer maps a holder's,
    /// current at epoch 1 of its table's slot 0.
    fn region() -> (Arc<SharedMapping>, Arc<EpochTable>) {
        let fd = rustix::fs::memfd_create("fanout-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
        rustix::fs::ftruncate(&fd, REGION as u64).expect("size");
        let (table, _fd) = EpochTable::create(2).expect("table");
        let table = Arc::new(table);
        table.store(0, 1);
        let mapping = SharedMapping::for_tests(&fd, REGION as u64, Arc::clone(&table), 0, 1).expect("mapped");
        (Arc::new(mapping), table)
    }

    fn value(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    fn target(mapping: &Arc<SharedMapping>, offset: u64, len: usize) -> Target {
        Target { mapping: Arc::clone(mapping), offset, len }
    }

    /// Enough bytes to take the pool: every value lands where its targets say, in order across
    /// targets; each sum is of the value; a value its targets do not cover fails alone.
    #[test]
    fn fanned_writes_land_in_their_targets_and_fail_value_by_value() {
        let (mapping, _table) = region();
        let values: Vec<Vec<u8>> = (0..4).map(|i| value((1 << 20) + 3 * i, i as u8)).collect();
        let mut writes: Vec<ValueWrite<'_>> = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let at = (i as u64) * (2 << 20);
                // The second value in two ranges, the second range first in the region.
                let targets = if i == 1 {
                    let half = v.len() / 2;
                    vec![target(&mapping, at + (1 << 20), half), target(&mapping, at, v.len() - half)]
                } else {
                    vec![target(&mapping, at, v.len())]
                };
                ValueWrite { src: v, targets, sum: i % 2 == 0 }
            })
            .collect();
        let short = value(4096, 9);
        writes.push(ValueWrite { src: &short, targets: vec![target(&mapping, 7 << 20, 4095)], sum: true });
        let written = write_values(&writes);
        assert_eq!(written.len(), 5);
        for (i, v) in values.iter().enumerate() {
            let expected = (i % 2 == 0).then(|| {
                let mut sum = ValueCrc32c::new();
                sum.update(v);
                sum.finish()
            });
            assert_eq!(written[i].as_ref().ok(), Some(&expected), "value {i}");
            let mut landed = vec![0u8; v.len()];
            let at = (i as u64) * (2 << 20);
            if i == 1 {
                let half = v.len() / 2;
                mapping.read_at(at + (1 << 20), &mut landed[..half]).expect("read");
                mapping.read_at(at, &mut landed[half..]).expect("read");
            } else {
                mapping.read_at(at, &mut landed).expect("read");
            }
            assert!(landed == *v, "value {i} landed byte-exact");
        }
        assert!(matches!(written[4], Err(ShmError::Invalid(_))), "{:?}", written[4]);
    }

    /// A streamed read sums the holder's bytes as the copy read them, not the landed ones (out of
    /// the cache after streaming stores): `seen` is handed the mapping's own range. A region gone
    /// stale fails, summed or not.
    #[test]
    fn a_streamed_read_sums_the_holders_bytes_and_fails_when_stale() {
        let (mapping, table) = region();
        let value = value((1 << 20) + 77, 5);
        mapping.write_at(4096, &value).expect("written");
        let mut dst = vec![0u8; value.len()];
        let mut seen_at = None;
        let read = mapping.read_streamed_at(4096, &mut dst, |seen| seen_at = Some((seen.as_ptr(), seen.to_vec())));
        assert!(read.is_ok(), "{read:?}");
        assert!(dst == value, "landed byte-exact");
        let (at, seen) = seen_at.expect("seen");
        assert_eq!(at, mapping.as_ptr().as_ptr().wrapping_add(4096).cast_const(), "the holder's bytes");
        assert!(seen == value);
        table.store(0, 2);
        let read = mapping.read_streamed_at(4096, &mut dst, |_| {});
        assert!(matches!(read, Err(ShmError::Stale { region_id: 1, .. })), "{read:?}");
    }

    /// Streamed and plain copies of the same mapped values, fanned out, land the same bytes with
    /// the same sums (the writer's), values of several blocks and of no whole number of them.
    #[test]
    fn streamed_and_plain_copies_land_the_same_bytes_and_sums() {
        let (mapping, _table) = region();
        let values: Vec<Vec<u8>> = (0..3).map(|i| value((2 << 20) + 1000 * i + 3, 20 + i as u8)).collect();
        for (i, v) in values.iter().enumerate() {
            mapping.write_at((i as u64) * (5 << 19), v).expect("written");
        }
        for streamed in [false, true] {
            let mut dsts: Vec<Vec<u8>> = values.iter().map(|v| vec![0xEE; v.len()]).collect();
            let copies: Vec<ValueCopy> = dsts
                .iter_mut()
                .enumerate()
                .map(|(i, d)| ValueCopy {
                    pieces: vec![Piece {
                        source: Source::Mapping(Arc::clone(&mapping)),
                        offset: (i as u64) * (5 << 19),
                        len: d.len(),
                    }],
                    dst: Dst::Range(NonNull::new(d.as_mut_ptr()).expect("non-null")),
                    sum: true,
                    streamed,
                })
                .collect();
            // SAFETY: each destination is its own vector, alive and unread until this returns.
            let copied = unsafe { copy_values_then(&copies, |copied| copied) };
            for (i, (c, v)) in copied.iter().zip(&values).enumerate() {
                let expected = umbp_core::value_crc32c(v);
                assert!(
                    matches!(c, Copied::Done { size, crc32c: Some(s) } if *size == v.len() as u64 && *s == expected),
                    "value {i}, streamed {streamed}: {c:?}"
                );
            }
            drop(copies);
            assert!(dsts == values, "streamed {streamed}: byte-exact");
        }
    }

    /// A region deregistered (its epoch moved on) before the writes: every value fails as stale.
    #[test]
    fn writes_into_a_stale_region_fail() {
        let (mapping, table) = region();
        table.store(0, 2);
        let values: Vec<Vec<u8>> = (0..3).map(|i| value(1 << 20, i)).collect();
        let writes: Vec<ValueWrite<'_>> = values
            .iter()
            .enumerate()
            .map(|(i, v)| ValueWrite { src: v, targets: vec![target(&mapping, (i as u64) << 20, v.len())], sum: false })
            .collect();
        for w in write_values(&writes) {
            assert!(matches!(w, Err(ShmError::Stale { region_id: 1, .. })), "{w:?}");
        }
    }

    /// Gates values wait at in [`a_batch_fanned_out_first_ends_while_a_later_one_copies`].
    #[derive(Default)]
    struct Gates {
        open: std::sync::Mutex<Vec<&'static str>>,
        changed: std::sync::Condvar,
    }

    impl Gates {
        /// Waits (at most 10 s) until `name` is opened.
        fn pass(&self, name: &'static str) {
            let open = self.open.lock().expect("gates");
            let (_open, _) = self
                .changed
                .wait_timeout_while(open, std::time::Duration::from_secs(10), |open| !open.contains(&name))
                .expect("gates");
        }

        fn open(&self, names: &[&'static str]) {
            self.open.lock().expect("gates").extend_from_slice(names);
            self.changed.notify_all();
        }
    }

    /// Two batches on a pool of two threads: the first ends when its own values are done, though a
    /// pool thread that finished one of them has gone on to the second batch's, which still wait.
    /// (Fanned out with a parallel iterator, the first batch ended only after the second: the
    /// thread that took the second's work did so while waiting on a `join` of the first.)
    #[test]
    fn a_batch_fanned_out_first_ends_while_a_later_one_copies() {
        use std::sync::mpsc::channel;
        use std::time::Duration;
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("pool");
        let gates = Gates::default();
        let (started_tx, started) = channel::<&'static str>();
        let (done_tx, done) = channel::<(char, Vec<&'static str>, bool)>();
        let run = |v: &&'static str| {
            started_tx.send(*v).expect("started");
            gates.pass(v);
            *v
        };
        let wait = |n: usize| (0..n).map(|_| started.recv_timeout(Duration::from_secs(10)).ok()).collect::<Vec<_>>();
        let (first, second) = (["a0", "a1"], ["b0", "b1"]);
        std::thread::scope(|s| {
            let (pool, run) = (&pool, &run);
            let tx = done_tx.clone();
            s.spawn(move || {
                in_order_on(pool, &first, run, |answers| {
                    tx.send(('a', answers, rayon::current_thread_index().is_some())).expect("done");
                });
            });
            let mut a = wait(2);
            a.sort();
            assert_eq!(a, [Some("a0"), Some("a1")], "both threads on the first batch");
            let tx = done_tx.clone();
            s.spawn(move || {
                in_order_on(pool, &second, run, |answers| {
                    tx.send(('b', answers, rayon::current_thread_index().is_some())).expect("done");
                });
            });
            // One thread is freed and takes a value of the second batch, which waits at its gate.
            gates.open(&["a0"]);
            let b = wait(1);
            gates.open(&["a1"]);
            let ended = done.recv_timeout(Duration::from_secs(5));
            gates.open(&["b0", "b1"]);
            assert!(matches!(b[..], [Some("b0" | "b1")]), "{b:?}");
            assert_eq!(
                ended.ok(),
                Some(('a', vec!["a0", "a1"], true)),
                "the first batch answered, in order, on a pool thread, while the second waits"
            );
            let ended = done.recv_timeout(Duration::from_secs(10)).ok();
            assert_eq!(ended, Some(('b', vec!["b0", "b1"], true)));
        });
    }
}
