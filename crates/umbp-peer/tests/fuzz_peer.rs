//! The node's fuzz targets (issue 19), driven by proptest for a bounded number of cases: the master
//! client's routing-reply decoders, and request sequences to the peer service over a real DRAM
//! medium, over arbitrary bytes and over mutations of encoded messages (the seed corpus). The same
//! entry points run coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_peer::fuzzing;

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
    for seed in fuzzing::route_seeds() {
        fuzzing::route_replies(&seed);
    }
    // The seeds reach past validation: the service accepts every request of the sequence.
    let accepted: Vec<usize> = fuzzing::peer_seeds().iter().map(|seed| fuzzing::peer_requests(seed)).collect();
    assert_eq!(accepted, [8]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn routing_replies_of_arbitrary_bytes(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        fuzzing::route_replies(&data);
    }

    #[test]
    fn mutated_routing_replies(data in mutated(fuzzing::route_seeds())) {
        fuzzing::route_replies(&data);
    }
}

proptest! {
    // Each case builds a medium (about a millisecond).
    #![proptest_config(ProptestConfig { cases: 1_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_peer_requests(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = fuzzing::peer_requests(&data);
    }

    #[test]
    fn mutated_peer_requests(data in mutated(fuzzing::peer_seeds())) {
        let _ = fuzzing::peer_requests(&data);
    }
}
