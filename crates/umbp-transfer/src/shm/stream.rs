//! A copy whose stores stream past the cache (non-temporal stores), for same-host puts and large
//! same-host batch gets (and large in-process copies, `local.rs`).
//!
//! A put writes into the holder's slots: memory this process never reads again and the holder
//! does not read until a reader asks. Ordinary stores first read every destination line into the
//! cache (read-for-ownership), evict the caller's own data to make room, and write the lines back
//! later; streaming stores skip the read. Measured (2-core VM, 64 MiB batches, three pairs): batch
//! puts of 1 MiB values 1.43× and of 64 KiB values 1.33×, single 1 MiB puts p50 0.74× the time
//! (`docs/benchmarks.md`, "Puts that stream past the cache"). The price: a value read right after
//! its put is no longer in the cache (the bench's gets of just-put values read 0.88–0.92×).
//!
//! A batch get streams from [`stream_threshold`] bytes (a quarter of the last-level cache): a
//! destination that large does not stay in the cache anyway, and ordinary stores would first read
//! each of its lines from memory. Its values are then summed from the holder's bytes as the copy
//! read them, not the landed ones. Measured on the 2-core VM (32 MiB L3, 64 MiB batches, five
//! alternated pairs): batch gets of 1 MiB values 14.3 against 11.3 GB/s, of 64 KiB values 11.5
//! against 10.0 (`docs/benchmarks.md`, "Large batch gets stream past the cache"). (An earlier
//! trial on a VM whose 300 MiB L3 held a 64 MiB batch found no gain: below the threshold, as
//! this rule now says.) Smaller batches keep ordinary stores, so a caller that reads its values
//! right away finds them in the cache.

use std::sync::OnceLock;

/// Copies shorter than this use an ordinary copy: the stream's fence and its unaligned ends cost
/// more than the read-for-ownership they save, and a small value is likely read again soon.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const STREAM_MIN: usize = 16 << 10;

/// Copies `len` bytes from `src` to `dst` with streaming stores where the CPU has them (x86-64),
/// and an ordinary copy elsewhere or for short copies. Every store is globally visible when this
/// returns (a store fence ends the stream), so a message sent after it (a put's settle) follows
/// the bytes.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst` for writes of `len`
/// bytes, the two not overlapping.
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN {
        // SAFETY: this function's contract.
        unsafe { x86::copy(dst, src, len) };
        return;
    }
    // SAFETY: this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// The bytes from which a batch's copies stream their stores past the cache (a same-host get's,
/// through a [`KeyedBatchItem`](crate::KeyedBatchItem)'s `stream`, and the in-process copy's
/// transfers, [`LocalCopyEngine`](crate::LocalCopyEngine)): a quarter of the last-level cache, the
/// size from which glibc's `memcpy` streams one copy (`x86_non_temporal_threshold`, a quarter of
/// L3 since glibc 2.38). A destination that large would not stay in the cache anyway, and ordinary
/// stores first read each of its lines from memory. Read once from sysfs.
pub fn stream_threshold() -> u64 {
    static THRESHOLD: OnceLock<u64> = OnceLock::new();
    *THRESHOLD.get_or_init(|| last_level_cache_bytes() / 4)
}

/// The last-level cache's size as sysfs gives it for CPU 0 (the highest cache level listed), or
/// [`ASSUMED_LLC`] where sysfs does not say.
fn last_level_cache_bytes() -> u64 {
    let mut best: Option<(u32, u64)> = None;
    for index in 0..8 {
        let dir = format!("/sys/devices/system/cpu/cpu0/cache/index{index}");
        let read = |name: &str| std::fs::read_to_string(format!("{dir}/{name}")).ok();
        let (Some(level), Some(size)) = (read("level"), read("size")) else { continue };
        let (Ok(level), Some(size)) = (level.trim().parse::<u32>(), cache_size(size.trim())) else { continue };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, size));
        }
    }
    best.map_or(ASSUMED_LLC, |(_, size)| size)
}

/// The last-level cache assumed where sysfs does not tell it.
const ASSUMED_LLC: u64 = 32 << 20;

/// A sysfs cache size: a count with an optional `K`, `M` or `G` suffix (`32768K`).
fn cache_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.as_bytes().last()? {
        b'K' => (&text[..text.len() - 1], 10),
        b'M' => (&text[..text.len() - 1], 20),
        b'G' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

/// The streaming copy between two slices: the copy a same-host put writes a holder's slot with,
/// so the bytes land where a put leaves them — in memory, not in this core's caches (on x86-64;
/// an ordinary copy elsewhere). `umbp bench` writes its memory-resident baseline's source with it.
///
/// # Panics
/// If the two slices differ in length (as [`slice::copy_from_slice`]).
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming between slices of different lengths");
    // SAFETY: two slices of `src.len()` bytes, one borrowed mutably, so they cannot overlap.
    unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, __m512i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128, _mm512_loadu_si512, _mm512_stream_si512,
    };
    use std::sync::OnceLock;

    /// Whether the CPU has AVX-512F (64-byte streaming stores), asked once.
    fn avx512() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx512f"))
    }

    /// # Safety
    /// As [`super::copy`].
    pub(super) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
        // Streaming stores need an aligned destination: the unaligned head goes the ordinary way.
        let head = (dst as usize).wrapping_neg() & 63;
        let head = head.min(len);
        // SAFETY: `head <= len`, inside both ranges (this function's contract).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        // SAFETY: `head <= len`, so both pointers stay inside their ranges.
        let (dst, src, len) = unsafe { (dst.add(head), src.add(head), len - head) };
        let done = if avx512() {
            // SAFETY: the CPU has AVX-512F (checked above); `dst` is 64-byte aligned; the rest is
            // this function's contract.
            unsafe { stream_avx512(dst, src, len) }
        } else {
            // SAFETY: SSE2 is part of x86-64; `dst` is 64-byte aligned; the rest as above.
            unsafe { stream_sse2(dst, src, len) }
        };
        // SAFETY: orders the streaming stores before every later store of this thread.
        unsafe { _mm_sfence() };
        // SAFETY: `done <= len`: the tail is inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done) };
    }

    /// Streams whole 256-byte runs; returns the bytes copied (a multiple of 256, at most `len`).
    ///
    /// # Safety
    /// AVX-512F is available, `dst` is 64-byte aligned, and [`super::copy`]'s contract holds.
    #[target_feature(enable = "avx512f")]
    unsafe fn stream_avx512(dst: *mut u8, src: *const u8, len: usize) -> usize {
        let mut at = 0;
        while at + 256 <= len {
            // SAFETY: `at + 256 <= len`: every load and store is inside the ranges; the stores'
            // addresses are 64-byte aligned (`dst` is, and each offset is a multiple of 64).
            unsafe {
                let s = src.add(at);
                let d = dst.add(at);
                let a = _mm512_loadu_si512(s.cast::<__m512i>());
                let b = _mm512_loadu_si512(s.add(64).cast::<__m512i>());
                let c = _mm512_loadu_si512(s.add(128).cast::<__m512i>());
                let e = _mm512_loadu_si512(s.add(192).cast::<__m512i>());
                _mm512_stream_si512(d.cast::<__m512i>(), a);
                _mm512_stream_si512(d.add(64).cast::<__m512i>(), b);
                _mm512_stream_si512(d.add(128).cast::<__m512i>(), c);
                _mm512_stream_si512(d.add(192).cast::<__m512i>(), e);
            }
            at += 256;
        }
        at
    }

    /// Streams whole 64-byte runs with SSE2; returns the bytes copied.
    ///
    /// # Safety
    /// `dst` is 16-byte aligned, and [`super::copy`]'s contract holds.
    unsafe fn stream_sse2(dst: *mut u8, src: *const u8, len: usize) -> usize {
        let mut at = 0;
        while at + 64 <= len {
            // SAFETY: `at + 64 <= len`: inside the ranges; the stores are 16-byte aligned.
            unsafe {
                let s = src.add(at);
                let d = dst.add(at);
                let a = _mm_loadu_si128(s.cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(48).cast::<__m128i>());
                _mm_stream_si128(d.cast::<__m128i>(), a);
                _mm_stream_si128(d.add(16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(48).cast::<__m128i>(), e);
            }
            at += 64;
        }
        at
    }

    #[cfg(test)]
    pub(super) fn force_sse2(dst: *mut u8, src: *const u8, len: usize) -> usize {
        // SAFETY: the test passes disjoint buffers of `len` bytes with `dst` 64-byte aligned.
        let done = unsafe { stream_sse2(dst, src, len) };
        // SAFETY: as in `copy`.
        unsafe { _mm_sfence() };
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length around the thresholds and run sizes, at every destination misalignment mod 64
    /// (and a few source ones), copies exactly its bytes and nothing past them.
    #[test]
    fn copies_every_length_and_alignment_exactly() {
        let src: Vec<u8> = (0..(STREAM_MIN * 2 + 1024)).map(|i| (i * 7 + 3) as u8).collect();
        let mut lens = vec![0, 1, 63, 64, 255, 256, 257, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 1];
        lens.extend([STREAM_MIN + 63, STREAM_MIN + 255, STREAM_MIN + 300, STREAM_MIN * 2]);
        for len in lens {
            for dst_off in 0..64 {
                for src_off in [0, 1, 17] {
                    let mut dst = vec![0xAAu8; len + 128 + 64];
                    // SAFETY: `dst_off + len + 64 <= dst.len()` and `src_off + len <= src.len()`;
                    // two distinct vectors.
                    unsafe { copy(dst.as_mut_ptr().add(dst_off), src.as_ptr().add(src_off), len) };
                    assert_eq!(
                        &dst[dst_off..dst_off + len],
                        &src[src_off..src_off + len],
                        "len {len} at {dst_off}/{src_off}"
                    );
                    assert!(dst[..dst_off].iter().all(|b| *b == 0xAA), "nothing before");
                    assert!(dst[dst_off + len..].iter().all(|b| *b == 0xAA), "nothing past the end");
                }
            }
        }
    }

    /// Sysfs cache sizes read as bytes; anything else is not a size.
    #[test]
    fn cache_sizes_read_with_their_suffix() {
        assert_eq!(cache_size("32768K"), Some(32 << 20));
        assert_eq!(cache_size("2M"), Some(2 << 20));
        assert_eq!(cache_size("1G"), Some(1 << 30));
        assert_eq!(cache_size("4096"), Some(4096));
        for bad in ["", "K", "12Q", "-1K", "1.5M"] {
            assert_eq!(cache_size(bad), None, "{bad:?}");
        }
    }

    /// A batch streams from a quarter of the largest cache level sysfs lists (or of the assumed
    /// one), which is at least as large as its first level's.
    #[test]
    fn batches_stream_from_a_quarter_of_the_last_level_cache() {
        let llc = last_level_cache_bytes();
        assert_eq!(stream_threshold(), llc / 4);
        let first = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index0/size")
            .ok()
            .and_then(|s| cache_size(s.trim()));
        assert!(llc >= first.unwrap_or(0).max(1 << 20), "the last level: {llc} bytes");
    }

    /// The slice form copies exactly, short and streamed lengths alike.
    #[test]
    fn the_slice_form_copies_exactly() {
        for len in [0, 5, STREAM_MIN, STREAM_MIN * 3 + 7] {
            let src: Vec<u8> = (0..len).map(|i| (i * 11 + 5) as u8).collect();
            let mut dst = vec![0u8; len];
            copy_streaming(&mut dst, &src);
            assert_eq!(dst, src, "len {len}");
        }
    }

    /// The SSE2 loop (the fallback on CPUs without AVX-512F) copies whole runs exactly.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_sse2_loop_copies_whole_runs() {
        let src: Vec<u8> = (0..70_000).map(|i| (i * 13 + 1) as u8).collect();
        let mut dst = vec![0u8; 70_000 + 64];
        let at = (dst.as_ptr() as usize).wrapping_neg() & 63;
        let done = x86::force_sse2(dst[at..].as_mut_ptr(), src.as_ptr(), 70_000);
        assert_eq!(done, 70_000 / 64 * 64);
        assert_eq!(&dst[at..at + done], &src[..done]);
    }
}
