//! The SSD medium's fuzz targets (issue 19), driven by proptest for a bounded number of cases: the
//! record decoder and restart recovery over arbitrary bytes and over mutations of records and
//! segments the medium itself wrote (the seed corpus). Mutations fall mostly on the first bytes of
//! a 4 KiB block, where headers are, so cases get past the magic. The same entry points run
//! coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_ssd::fuzzing;
use umbp_testkit::fuzz::cases;

/// Every allocation over [`umbp_testkit::fuzz::ALLOC_CAP`] fails: no length a peer or a drive
/// states may size a buffer before it is checked against what actually arrived.
#[global_allocator]
static ALLOC: umbp_testkit::fuzz::CappedAlloc = umbp_testkit::fuzz::CappedAlloc;

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
