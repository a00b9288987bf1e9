//! End-to-end checksums on the client side: computed over a put's value, checked over a get's
//! copy (see [`PoolClientConfig::checksums`]). The holder only stores the writer's checksum and
//! hands it back; every check happens here, on the bytes that landed in the caller's buffer, so a
//! flip anywhere between the writer's buffer and the reader's — the holder's memory, its drive, the
//! wire, a mapping — is caught.

use umbp_core::{RateLimited, value_crc32c};

use super::support::{CallerBuf, StatCounters, blocking};
use super::*;

/// One warning line per window: a corrupt holder would otherwise log every read.
static MISMATCH: RateLimited = RateLimited::every(RateLimited::WINDOW);

/// Values at least this large are checksummed off the async worker (`block_in_place`): a CRC runs
/// at several GB/s, so below this it costs less than the hand-off.
const OFF_WORKER_BYTES: usize = 1 << 20;

fn crc_of(bytes: &[u8]) -> u32 {
    if bytes.len() >= OFF_WORKER_BYTES { blocking(|| value_crc32c(bytes)) } else { value_crc32c(bytes) }
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
        if got == expected {
            return true;
        }
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
