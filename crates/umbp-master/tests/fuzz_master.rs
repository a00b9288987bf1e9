//! The master's fuzz target (issue 19), driven by proptest for a bounded number of cases: request
//! sequences as protobuf bytes, arbitrary and mutated from a node's life made by the encoders (the
//! seed corpus), each against a fresh master. The same entry point runs coverage-guided under
//! `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_master::fuzzing;
use umbp_testkit::fuzz::cases;

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
fn every_seed_is_served() {
    // The seeds reach past validation: the master accepts every request of a node's life.
    let accepted: Vec<usize> = fuzzing::seeds().iter().map(|seed| fuzzing::requests(seed)).collect();
    assert_eq!(accepted, [11, 4]);
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
