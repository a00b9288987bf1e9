//! The data plane's fuzz targets (issue 19), driven by proptest for a bounded number of cases:
//! arbitrary bytes, and mutations of valid encodings (the seed corpus) so cases get past the first
//! magic and length checks. The same entry points run coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_testkit::fuzz::cases;
use umbp_transfer::fuzzing;

/// Every allocation over [`umbp_testkit::fuzz::ALLOC_CAP`] fails: no length a peer or a drive
/// states may size a buffer before it is checked against what actually arrived.
#[global_allocator]
static ALLOC: umbp_testkit::fuzz::CappedAlloc = umbp_testkit::fuzz::CappedAlloc;

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
