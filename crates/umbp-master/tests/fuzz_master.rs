//! The master's fuzz target (issue 19), driven by proptest for a bounded number of cases: request
//! sequences as protobuf bytes, arbitrary and mutated from a node's life made by the encoders (the
//! seed corpus), each against a fresh master. The same entry point runs coverage-guided under
//! `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_master::fuzzing;

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
    let edits = proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4);
    (proptest::sample::select(seeds), edits, any::<u16>(), proptest::collection::vec(any::<u8>(), 0..32)).prop_map(
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
fn every_seed_is_served() {
    // The seeds reach past validation: the master accepts every request of a node's life.
    let accepted: Vec<usize> = fuzzing::seeds().iter().map(|seed| fuzzing::requests(seed)).collect();
    assert_eq!(accepted, [10, 4]);
}

proptest! {
    // Each case starts a master (a few milliseconds).
    #![proptest_config(ProptestConfig { cases: cases(300), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_request_sequences(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = fuzzing::requests(&data);
    }

    #[test]
    fn mutated_request_sequences(data in mutated(fuzzing::seeds())) {
        let _ = fuzzing::requests(&data);
    }
}
