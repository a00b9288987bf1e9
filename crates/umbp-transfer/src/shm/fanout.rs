//! The copies of one same-host batch, fanned out over a kept pool of threads.
//!
//! One GET_KEYS exchange answers every key of a batch chunk (`KeyedClient::get_shared_batch`);
//! its values' copies then run on as many threads as the host has cores, as a multi-threaded
//! memcpy would, instead of one thread per chunk: the chunk's exchange is paid once while every
//! core copies. Each value is copied in blocks, and a value to check is summed block by block
//! right after each block lands, while it is still in L2 (summing a whole 1 MiB value after its
//! copy read it back from L3: ~20 % of the copy's time on the 16-core host).
//!
//! A batch put's writes fan out the same way ([`write_values`]): one PUT_KEYS answers every slot
//! of a chunk, then each value is written (streaming stores, `SharedMapping::write_at`) and summed
//! block by block on a pool thread, so a chunk's exchange is paid once while every core copies.
//! (Before puts streamed and summed while copying, a fanned put ran 14–19 GB/s on the 16-core host
//! against 19–21 for one chunk per core; see `docs/benchmarks.md` for the comparison since.)
//!
//! The pool (`umbp-shm-copy-N`, one thread per core) is started at the first batch large enough
//! to use it and kept for the process; smaller batches copy on the calling thread.
//!
//! The in-process copy engine's summed copies (`LocalCopyEngine::transfer_summed`, a node reading
//! its own medium) use the same loop over local sources ([`Source::Local`]).

use std::num::NonZeroUsize;
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;
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

/// `run` over every value, one value per pool thread when `fan_out` (and there is more than one
/// value and a pool), else on the calling thread; the answers in order.
fn each_value<T: Sync, R: Send>(values: &[T], fan_out: bool, run: impl Fn(&T) -> R + Sync + Send) -> Vec<R> {
    each_value_then(values, fan_out, run, |answers| answers)
}

/// [`each_value`], then `then` over the answers on the thread that collected them (a pool thread
/// when the values fanned out).
fn each_value_then<T: Sync, R: Send, U: Send>(
    values: &[T],
    fan_out: bool,
    run: impl Fn(&T) -> R + Sync + Send,
    then: impl FnOnce(Vec<R>) -> U + Send,
) -> U {
    match pool() {
        Some(pool) if values.len() > 1 && fan_out => {
            pool.install(|| then(values.par_iter().with_max_len(1).map(run).collect()))
        }
        _ => then(values.iter().map(run).collect()),
    }
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

/// Copies one value block by block, summing each block after it lands when asked.
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
        let mut done = 0usize;
        while done < piece.len {
            let n = (piece.len - done).min(BLOCK);
            // SAFETY: `done + n` is at most the piece's length, for which its destination is valid
            // and ours alone (this function's contract).
            let block = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr().add(done), n) };
            match &piece.source {
                Source::Mapping(mapping) => {
                    if let Err(e) = mapping.read_at(piece.offset + done as u64, block) {
                        return Copied::Failed(e);
                    }
                }
                Source::Local(src) => {
                    // SAFETY: `offset + done + n <= offset + len`, inside the checked local range
                    // (`copy_values_then`' contract), which does not overlap `dst`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr().add(piece.offset as usize + done),
                            block.as_mut_ptr(),
                            n,
                        )
                    };
                }
            }
            if let Some(sum) = &mut sum {
                match (&v.dst, &piece.source) {
                    // SAFETY: as the copy above: inside the checked local range, read only.
                    (Dst::Each(_), Source::Local(src)) => sum.update(unsafe {
                        std::slice::from_raw_parts(src.as_ptr().add(piece.offset as usize + done), n)
                    }),
                    _ => sum.update(block),
                }
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
}
