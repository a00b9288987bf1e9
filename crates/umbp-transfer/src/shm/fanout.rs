//! The copies of one same-host batch, fanned out over a kept pool of threads.
//!
//! One GET_KEYS exchange answers every key of a batch chunk (`KeyedClient::get_shared_batch`);
//! its values' copies then run on as many threads as the host has cores, as a multi-threaded
//! memcpy would, instead of one thread per chunk: the chunk's exchange is paid once while every
//! core copies. Each value is copied in blocks, and a value to check is summed block by block
//! right after each block lands, while it is still in L2 (summing a whole 1 MiB value after its
//! copy read it back from L3: ~20 % of the copy's time on the 16-core host).
//!
//! A batch put is not fanned out: on the 16-core host, one PUT_KEYS per large chunk with its
//! sums and copies on the pool put 1 MiB values at 14–19 GB/s against 19–21 for one chunk per core
//! copying on its own thread (the holder allocates a chunk's slots one exchange at a time, which
//! sixteen chunks in flight overlap).
//!
//! The pool (`umbp-shm-copy-N`, one thread per core) is started at the first batch large enough
//! to use it and kept for the process; smaller batches copy on the calling thread.

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

/// A range of a holder's region, mapped here: `len` bytes at `offset`.
pub(crate) struct Piece {
    pub(crate) mapping: Arc<SharedMapping>,
    pub(crate) offset: u64,
    pub(crate) len: usize,
}

/// One value's copy: its pieces, in value order, into `dst`.
pub(crate) struct ValueCopy {
    pub(crate) pieces: Vec<Piece>,
    pub(crate) dst: NonNull<u8>,
    /// Sum the copied bytes (the value has a checksum to check them against).
    pub(crate) sum: bool,
}

// SAFETY: `dst` is caller memory that `copy_values`' contract makes valid and exclusive to this
// value's copy for the call; the pieces are shared mappings (themselves `Send + Sync`). Each
// `ValueCopy` is copied by exactly one thread.
unsafe impl Send for ValueCopy {}
// SAFETY: as above: a shared `&ValueCopy` only hands its one copying thread the pointer.
unsafe impl Sync for ValueCopy {}

impl ValueCopy {
    fn bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len as u64).sum()
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

/// Copies every value, on the pool when the batch holds enough bytes and more than one value.
/// One answer per value, in order.
///
/// # Safety
/// Each `dst` is valid for writes of its pieces' total length, no two overlap, and nobody else
/// reads or writes them until this returns.
pub(crate) unsafe fn copy_values(values: &[ValueCopy]) -> Vec<Copied> {
    // SAFETY: this function's contract, per value.
    let run = |v: &ValueCopy| unsafe { copy_value(v) };
    let total: u64 = values.iter().map(ValueCopy::bytes).sum();
    match pool() {
        Some(pool) if values.len() > 1 && total >= FAN_OUT_BYTES => {
            pool.install(|| values.par_iter().with_max_len(1).map(run).collect())
        }
        _ => values.iter().map(run).collect(),
    }
}

/// Copies one value block by block, summing each block after it lands when asked.
///
/// # Safety
/// As [`copy_values`], for this value.
unsafe fn copy_value(v: &ValueCopy) -> Copied {
    let mut sum = v.sum.then(ValueCrc32c::new);
    let mut at = 0usize;
    for piece in &v.pieces {
        let mut done = 0usize;
        while done < piece.len {
            let n = (piece.len - done).min(BLOCK);
            // SAFETY: `at + done + n` is at most the pieces' total, for which `dst` is valid and
            // ours alone (this function's contract).
            let block = unsafe { std::slice::from_raw_parts_mut(v.dst.as_ptr().add(at + done), n) };
            if let Err(e) = piece.mapping.read_at(piece.offset + done as u64, block) {
                return Copied::Failed(e);
            }
            if let Some(sum) = &mut sum {
                sum.update(block);
            }
            done += n;
        }
        at += piece.len;
    }
    Copied::Done { size: at as u64, crc32c: sum.map(|s| s.finish()) }
}
