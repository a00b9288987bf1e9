//! The wire decoders' fuzz targets (issue 19), driven by proptest for a bounded number of cases:
//! the columnar `BatchResolveKeys` reply and heartbeat event bundles, over arbitrary bytes and over
//! mutations of encoded messages (the seed corpus), so cases get past the protobuf framing. The
//! same entry points run coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_proto::fuzzing;
use umbp_testkit::fuzz::{ALLOC_CAP, cases};

/// Every allocation over [`umbp_testkit::fuzz::ALLOC_CAP`] fails: no length a peer or a drive
/// states may size a buffer before it is checked against what actually arrived.
#[global_allocator]
static ALLOC: umbp_testkit::fuzz::CappedAlloc = umbp_testkit::fuzz::CappedAlloc;

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
