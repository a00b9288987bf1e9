//! End-to-end checksums on the client side: computed over a put's value, checked over a get's
//! copy (see [`PoolClientConfig::checksums`]). The holder only stores the writer's checksum and
//! hands it back; every check happens here, on the bytes that landed in the caller's buffer, so a
//! flip anywhere between the writer's buffer and the reader's — the holder's memory, its drive, the
//! wire, a mapping — is caught.

use umbp_core::{RateLimited, value_crc32c, value_crc32c_of_parts};

use super::ranged::Src;
use super::support::{CallerBuf, StatCounters, blocking, join_all, offload};
use super::*;

/// One warning line per window: a corrupt holder would otherwise log every read.
static MISMATCH: RateLimited = RateLimited::every(RateLimited::WINDOW);

/// Values at least this large are checksummed off the async worker (`block_in_place`): a CRC runs
/// at several GB/s, so below this it costs less than the hand-off.
const OFF_WORKER_BYTES: usize = 1 << 20;

/// Threads of the blocking pool one batch's checksums are spread over, at most (one core sums
/// about 10 GB/s, so a 16-core host's copies need most of its cores to keep up).
const MAX_SUM_THREADS: usize = 16;

fn crc_of(bytes: &[u8]) -> u32 {
    if bytes.len() >= OFF_WORKER_BYTES { blocking(|| value_crc32c(bytes)) } else { value_crc32c(bytes) }
}

/// A host buffer of the running call, as an address the blocking pool may read: the [`Offloaded`]
/// that reads it waits for the work when dropped, so the buffer outlives every read.
///
/// [`Offloaded`]: super::support::Offloaded
#[derive(Debug, Clone, Copy)]
struct Span {
    addr: usize,
    len: usize,
}

impl Span {
    /// # Safety
    /// `addr..addr + len` is host memory valid for reads and not written while the checksum runs.
    unsafe fn crc(self) -> u32 {
        // SAFETY: this function's contract.
        value_crc32c(unsafe { self.bytes() })
    }

    /// # Safety
    /// As [`crc`](Self::crc); the slice lives no longer than that contract.
    unsafe fn bytes<'a>(self) -> &'a [u8] {
        // SAFETY: this function's contract.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

/// One value to sum: one span, or the spans of its parts in value order.
#[derive(Debug, Clone)]
enum Summed {
    One(Span),
    Parts(Vec<Span>),
}

impl Summed {
    fn len(&self) -> usize {
        match self {
            Self::One(s) => s.len,
            Self::Parts(p) => p.iter().map(|s| s.len).sum(),
        }
    }

    /// # Safety
    /// As [`Span::crc`], for every span.
    unsafe fn crc(&self) -> u32 {
        match self {
            // SAFETY: this function's contract.
            Self::One(s) => unsafe { s.crc() },
            // SAFETY: this function's contract.
            Self::Parts(p) => value_crc32c_of_parts(p.iter().map(|s| unsafe { s.bytes() })),
        }
    }
}

/// The CRC-32C of each span, in order: inline for a small batch (less than the hand-off costs),
/// else on up to [`MAX_SUM_THREADS`] threads of the blocking pool, awaited without holding the
/// async worker, so the batch's other chunks move meanwhile.
///
/// # Safety
/// Every span is host memory valid for reads, and not written, until the returned future resolves
/// or is dropped (a dropped one waits for the work).
async unsafe fn crcs_of(spans: Vec<Summed>) -> Vec<u32> {
    let total: usize = spans.iter().map(Summed::len).sum();
    let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get).min(MAX_SUM_THREADS);
    if total < OFF_WORKER_BYTES || threads < 2 || spans.len() < 2 {
        // SAFETY: this function's contract.
        return blocking(|| spans.iter().map(|s| unsafe { s.crc() }).collect());
    }
    // Contiguous groups of about equal bytes, one per thread.
    let share = total.div_ceil(threads);
    let mut groups: Vec<Vec<Summed>> = vec![Vec::new()];
    let mut filled = 0;
    for span in spans {
        if filled >= share {
            groups.push(Vec::new());
            filled = 0;
        }
        filled += span.len();
        if let Some(group) = groups.last_mut() {
            group.push(span);
        }
    }
    // SAFETY: this function's contract; each `Offloaded` waits for its work when dropped.
    let runs = groups.into_iter().map(|g| offload(move || g.iter().map(|s| unsafe { s.crc() }).collect::<Vec<u32>>()));
    let mut out = Vec::new();
    for sums in join_all(runs.collect()).await {
        // A panicked sum (it cannot panic) would leave the batch short: its keys then fail their check.
        out.extend(sums.unwrap_or_default());
    }
    out
}

impl PoolClient {
    /// The CRC-32C of a put's value: `None` when checksums are off or the buffer is device memory
    /// (the CPU must not read it).
    pub(super) fn value_checksum(&self, value: CallerBuf) -> Option<u32> {
        if !self.config.checksums || value.len == 0 || self.in_device_registration(value) {
            return None;
        }
        // SAFETY: `value` is a caller buffer of the running call (a slice it borrows, or a raw range
        // its contract keeps valid and unwritten until the call returns), in host memory (checked
        // above); only read, before this returns.
        let bytes = unsafe { std::slice::from_raw_parts(value.ptr.as_ptr().cast_const(), value.len) };
        Some(crc_of(bytes))
    }

    /// The CRC-32C of each put value (see [`value_checksum`](Self::value_checksum)), the batch's
    /// bytes summed on several threads.
    pub(super) async fn value_checksums(&self, values: &[Src<'_>]) -> Vec<Option<u32>> {
        if !self.config.checksums {
            return vec![None; values.len()];
        }
        let span = |b: &CallerBuf| Span { addr: b.ptr.as_ptr() as usize, len: b.len };
        // Every part in host memory, or none summed; each value's parts listed once.
        let host = |b: &CallerBuf| !self.in_device_registration(*b);
        let spans: Vec<Option<Summed>> = values
            .iter()
            .map(|v| match v {
                _ if v.size() == 0 => None,
                Src::Whole(b) => host(b).then(|| Summed::One(span(b))),
                Src::Ranges { .. } => {
                    let parts = v.parts();
                    parts.iter().all(host).then(|| Summed::Parts(parts.iter().map(span).collect()))
                }
            })
            .collect();
        let summed: Vec<bool> = spans.iter().map(Option::is_some).collect();
        let spans: Vec<Summed> = spans.into_iter().flatten().collect();
        let n = spans.len();
        // SAFETY: caller buffers of the running call, in host memory (checked above), which its
        // contract keeps valid and unwritten until it returns; awaited here.
        let mut crcs = unsafe { crcs_of(spans) }.await.into_iter();
        let out: Vec<Option<u32>> = summed.iter().map(|s| if *s { crcs.next() } else { None }).collect();
        if out.iter().flatten().count() != n {
            // Cannot happen (a sum never panics); a put without its checksum is still a valid put.
            return out.into_iter().map(|_| None).collect();
        }
        out
    }

    /// [`copy_is_intact`](Self::copy_is_intact) for a round's copies at once: `(key, node, buf,
    /// size, expected)` each, the bytes summed on several threads.
    pub(super) async fn copies_are_intact(&self, copies: &[(&str, &str, CallerBuf, u64, Option<u32>)]) -> Vec<bool> {
        let checked: Vec<bool> = copies
            .iter()
            .map(|(_, _, buf, _, expected)| {
                self.config.checksums && expected.is_some() && !self.in_device_registration(*buf)
            })
            .collect();
        let spans: Vec<Summed> = copies
            .iter()
            .zip(&checked)
            .filter(|(_, c)| **c)
            .map(|((_, _, buf, size, _), _)| {
                Summed::One(Span {
                    addr: buf.ptr.as_ptr() as usize,
                    len: usize::try_from(*size).unwrap_or(usize::MAX).min(buf.len),
                })
            })
            .collect();
        // SAFETY: caller buffers of the running call, host memory (checked above), whose first
        // `len` bytes this round's copies wrote and nothing writes now; awaited here.
        let mut crcs = unsafe { crcs_of(spans) }.await.into_iter();
        copies
            .iter()
            .zip(checked)
            .map(|((key, node, _, size, expected), c)| match (c, expected) {
                (true, Some(expected)) => {
                    let got = crcs.next();
                    got == Some(*expected) || self.mismatch(key, node, *size, *expected, got.unwrap_or(!*expected))
                }
                _ => true,
            })
            .collect()
    }

    /// Whether the `size` bytes a get copied from `node` into `buf` are the value its writer put,
    /// as `expected` (the writer's checksum) says; true when there is nothing to check (no
    /// checksum, checksums off, a device buffer). A mismatch is counted and logged.
    pub(super) fn copy_is_intact(
        &self,
        key: &str,
        node: &str,
        buf: CallerBuf,
        size: u64,
        expected: Option<u32>,
    ) -> bool {
        let Some(expected) = expected else { return true };
        if !self.config.checksums || self.in_device_registration(buf) {
            return true;
        }
        let len = usize::try_from(size).unwrap_or(usize::MAX).min(buf.len);
        // SAFETY: as in `value_checksum`: a caller buffer of the running call, host memory, whose
        // first `len <= buf.len` bytes the copy just wrote; only read, before this returns.
        let bytes = unsafe { std::slice::from_raw_parts(buf.ptr.as_ptr().cast_const(), len) };
        let got = crc_of(bytes);
        got == expected || self.mismatch(key, node, size, expected, got)
    }

    /// Counts and logs a read whose bytes do not match their checksum; false (the copy is not intact).
    pub(super) fn mismatch(&self, key: &str, node: &str, size: u64, expected: u32, got: u32) -> bool {
        StatCounters::add(&self.stats.checksum_failures, 1);
        if let Some(held_back) = MISMATCH.check() {
            tracing::warn!(
                key,
                node,
                size,
                expected = format_args!("{expected:#010x}"),
                got = format_args!("{got:#010x}"),
                held_back,
                "a read's bytes do not match the checksum they were put with: discarded (corruption in \
                 the holder's memory, on its drive or on the wire); the key is read elsewhere or missed"
            );
        }
        false
    }
}
