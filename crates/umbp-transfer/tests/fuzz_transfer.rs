//! The data plane's fuzz targets (issue 19), driven by proptest for a bounded number of cases:
//! arbitrary bytes, and mutations of valid encodings (the seed corpus) so cases get past the first
//! magic and length checks. The same entry points run coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_transfer::fuzzing;

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

/// A valid input with a few bytes overwritten, truncated or extended.
fn mutated(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let edits = proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6);
    (proptest::sample::select(seeds), edits, any::<u16>(), proptest::collection::vec(any::<u8>(), 0..64)).prop_map(
        |(mut b, edits, cut, tail)| {
            for (at, byte) in edits {
                if !b.is_empty() {
                    let i = at % b.len();
                    b[i] = byte;
                }
            }
            match cut % 4 {
                0 => b.truncate(usize::from(cut) % (b.len() + 1)),
                1 => b.extend_from_slice(&tail),
                _ => {}
            }
            b
        },
    )
}

#[test]
fn every_seed_decodes() {
    // The seeds must be valid, or the mutations below start from garbage: each frame seed decodes.
    for seed in fuzzing::frame_seeds() {
        fuzzing::frames(&seed);
    }
    let received: Vec<usize> = fuzzing::server_seeds().iter().map(|seed| fuzzing::server_stream(seed)).collect();
    // The READ seed names the server's region (through the tag): its hello answer, reply and 128
    // bytes come back.
    assert_eq!(received[0], 8 + 24 + 128, "{received:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(10_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn frame_decoders_take_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        fuzzing::frames(&data);
    }

    #[test]
    fn frame_decoders_take_mutated_frames(data in mutated(fuzzing::frame_seeds())) {
        fuzzing::frames(&data);
    }
}

proptest! {
    // Each case is a connection to a live server (a few hundred microseconds).
    #![proptest_config(ProptestConfig { cases: cases(1_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_server_survives_arbitrary_streams(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = fuzzing::server_stream(&data);
    }

    #[test]
    fn the_server_survives_mutated_streams(data in mutated(fuzzing::server_seeds())) {
        let _ = fuzzing::server_stream(&data);
    }
}
