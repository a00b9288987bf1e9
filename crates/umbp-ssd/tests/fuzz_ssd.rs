//! The SSD medium's fuzz targets (issue 19), driven by proptest for a bounded number of cases: the
//! record decoder and restart recovery over arbitrary bytes and over mutations of records and
//! segments the medium itself wrote (the seed corpus). Mutations fall mostly on the first bytes of
//! a 4 KiB block, where headers are, so cases get past the magic. The same entry points run
//! coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_ssd::fuzzing;

/// Fails any single allocation over 64 MiB (the process aborts with "memory allocation of N bytes
/// failed"): no length a peer or a drive states may size a buffer before it is checked against
/// what actually arrived. Nothing these harnesses do legitimately needs that much at once.
struct CappedAlloc;

const ALLOC_CAP: usize = 64 << 20;

// SAFETY: forwards to the system allocator unchanged, or reports failure (null) for an oversized
// request, which every caller must already handle.
unsafe impl std::alloc::GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc` is passed through.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc_zeroed` is passed through.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `realloc` is passed through.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: CappedAlloc = CappedAlloc;

/// `n` cases, times `UMBP_FUZZ_SCALE` when set (e.g. 100 for a long run without nightly).
fn cases(n: u32) -> u32 {
    let scale = std::env::var("UMBP_FUZZ_SCALE").ok().and_then(|s| s.parse::<u32>().ok()).unwrap_or(1);
    n.saturating_mul(scale.max(1))
}

const BLOCK: usize = 4096;

/// A valid input with a few bytes overwritten (most inside a block's header), then perhaps cut
/// short or cut at a block boundary.
fn mutated(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let edit = (any::<usize>(), 0usize..64, any::<bool>(), any::<u8>());
    (proptest::sample::select(seeds), proptest::collection::vec(edit, 0..4), any::<u32>()).prop_map(
        |(mut b, edits, cut)| {
            for (block, at, in_header, byte) in edits {
                let blocks = b.len().div_ceil(BLOCK).max(1);
                let i = if in_header { (block % blocks) * BLOCK + at } else { block };
                if !b.is_empty() {
                    let i = i % b.len();
                    b[i] = byte;
                }
            }
            match cut % 4 {
                0 => b.truncate(cut as usize % (b.len() + 1)),
                1 => b.truncate((cut as usize % (b.len() / BLOCK + 1)) * BLOCK),
                _ => {}
            }
            b
        },
    )
}

#[test]
fn every_seed_is_valid() {
    for seed in fuzzing::record_seeds() {
        fuzzing::record(&seed);
    }
    let segments = fuzzing::segment_seeds();
    assert!(segments.iter().all(|s| s.len() >= 4 * BLOCK), "the backend wrote records");
    for seed in segments {
        // "a" (its second value), "b" and "c".
        assert_eq!(fuzzing::recovery(&seed), 3, "the backend's own segment recovers whole");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(5_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_record_decoder_takes_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..128)) {
        fuzzing::record(&data);
    }

    #[test]
    fn the_record_decoder_takes_mutated_records(data in mutated(fuzzing::record_seeds())) {
        fuzzing::record(&data);
    }
}

proptest! {
    // Each case is an init of a backend over a scratch directory (about 10 ms); random bytes
    // rarely pass the magic, so most cases are mutations of real segments.
    #![proptest_config(ProptestConfig { cases: cases(100), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn recovery_takes_arbitrary_segments(data in proptest::collection::vec(any::<u8>(), 0..(3 * BLOCK))) {
        let _ = fuzzing::recovery(&data);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(500), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn recovery_takes_mutated_segments(data in mutated(fuzzing::segment_seeds())) {
        let _ = fuzzing::recovery(&data);
    }
}
