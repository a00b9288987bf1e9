//! The wire decoders' fuzz targets (issue 19), driven by proptest for a bounded number of cases:
//! the columnar `BatchResolveKeys` reply and heartbeat event bundles, over arbitrary bytes and over
//! mutations of encoded messages (the seed corpus), so cases get past the protobuf framing. The
//! same entry points run coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_proto::fuzzing;

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
fn every_seed_decodes() {
    use prost::Message;
    for seed in fuzzing::resolve_seeds() {
        let resp = umbp_proto::v1::BatchResolveKeysResponse::decode(seed.as_slice()).expect("a seed decodes");
        assert!(umbp_proto::resolve::decode_batch_resolve(&resp).is_ok(), "a seed is a valid reply");
        fuzzing::resolve(&seed);
    }
    for seed in fuzzing::event_seeds() {
        let req = umbp_proto::v1::HeartbeatRequest::decode(seed.as_slice()).expect("a seed decodes");
        assert!(!req.bundles.is_empty());
        fuzzing::events(&seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(5_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn resolve_replies_of_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        fuzzing::resolve(&data);
    }

    #[test]
    fn mutated_resolve_replies(data in mutated(fuzzing::resolve_seeds())) {
        fuzzing::resolve(&data);
    }

    #[test]
    fn event_bundles_of_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        fuzzing::events(&data);
    }

    #[test]
    fn mutated_event_bundles(data in mutated(fuzzing::event_seeds())) {
        fuzzing::events(&data);
    }
}

#[test]
fn the_allocation_cap_refuses_an_oversized_allocation() {
    let layout = std::alloc::Layout::from_size_align(ALLOC_CAP + 1, 8).expect("a layout");
    // SAFETY: a non-zero size; the pointer is only compared with null (it is null, or freed).
    let p = unsafe { std::alloc::alloc(layout) };
    let refused = p.is_null();
    if !refused {
        // SAFETY: allocated just above with this layout.
        unsafe { std::alloc::dealloc(p, layout) };
    }
    assert!(refused, "a {ALLOC_CAP}+1 byte allocation went through");
}
