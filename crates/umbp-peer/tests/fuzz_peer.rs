//! The node's fuzz targets (issue 19), driven by proptest for a bounded number of cases: the master
//! client's routing-reply decoders, and request sequences to the peer service over a real DRAM
//! medium, over arbitrary bytes and over mutations of encoded messages (the seed corpus). The same
//! entry points run coverage-guided under `cargo fuzz` (`fuzz/`).

use proptest::prelude::*;
use umbp_peer::fuzzing;
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
    for seed in fuzzing::route_seeds() {
        fuzzing::route_replies(&seed);
    }
    // The seeds reach past validation: the service accepts every request of the sequence.
    let accepted: Vec<usize> = fuzzing::peer_seeds().iter().map(|seed| fuzzing::peer_requests(seed)).collect();
    assert_eq!(accepted, [8]);
    let received: Vec<usize> = fuzzing::keyed_seeds().iter().map(|seed| fuzzing::keyed_stream(seed)).collect();
    // Hello answers, replies, values and trailers: each seed reaches past the handshake (the last
    // one's stream ends inside its value, so its reply is never sent).
    assert!(received[..4].iter().all(|&n| n > 8 + 24), "{received:?}");
    assert_eq!(received[0], 8 + 24 + (24 + 100 + 16) + 24, "put a, get a (value and trailer), miss");
    // The checksum a put carried comes back in the trailer of the get, and in the MAPPED
    // descriptor of the shared one: reply, value and trailer, then MAPPED with a one-range descriptor.
    assert_eq!(received[4], 8 + 24 + (24 + 50 + 16) + (24 + 32 + 24), "put f with its checksum, get f twice");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(5_000), failure_persistence: None, ..ProptestConfig::default() })]

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
    #![proptest_config(ProptestConfig { cases: cases(1_000), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_peer_requests(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = fuzzing::peer_requests(&data);
    }

    #[test]
    fn arbitrary_keyed_streams(data in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = fuzzing::keyed_stream(&data);
    }

    #[test]
    fn mutated_keyed_streams(data in mutated(fuzzing::keyed_seeds())) {
        let _ = fuzzing::keyed_stream(&data);
    }

    #[test]
    fn mutated_peer_requests(data in mutated(fuzzing::peer_seeds())) {
        let _ = fuzzing::peer_requests(&data);
    }
}

/// Every fuzz target's seeds, by target name (`fuzz/fuzz_targets/<name>.rs`).
fn corpus() -> Vec<(&'static str, Vec<Vec<u8>>)> {
    vec![
        ("tcp_frames", umbp_transfer::fuzzing::frame_seeds()),
        ("tcp_server", umbp_transfer::fuzzing::server_seeds()),
        ("ssd_record", umbp_ssd::fuzzing::record_seeds()),
        ("ssd_recovery", umbp_ssd::fuzzing::segment_seeds()),
        ("resolve_reply", umbp_proto::fuzzing::resolve_seeds()),
        ("heartbeat_events", umbp_proto::fuzzing::event_seeds()),
        ("master_requests", umbp_master::fuzzing::seeds()),
        ("route_replies", fuzzing::route_seeds()),
        ("peer_requests", fuzzing::peer_seeds()),
        ("keyed_stream", fuzzing::keyed_seeds()),
    ]
}

/// `fuzz/corpus/<target>/seed-<i>` are the seeds above, byte for byte, so `cargo fuzz` starts from
/// what the encoders make today. `UMBP_BLESS_FUZZ_CORPUS=1` rewrites them.
#[test]
fn the_fuzz_seed_corpus_is_what_the_encoders_make() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
    let bless = std::env::var_os("UMBP_BLESS_FUZZ_CORPUS").is_some();
    for (target, seeds) in corpus() {
        let dir = root.join(target);
        let seed_files = |dir: &std::path::Path| -> Vec<(String, Vec<u8>)> {
            let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
            let mut files: Vec<(String, Vec<u8>)> = entries
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str().map(str::to_owned).map(|n| (n, e.path())))
                .filter(|(n, _)| n.starts_with("seed-"))
                .map(|(n, p)| (n, std::fs::read(p).expect("a corpus file")))
                .collect();
            files.sort();
            files
        };
        if bless {
            for (name, _) in seed_files(&dir) {
                std::fs::remove_file(dir.join(name)).expect("removing a stale seed");
            }
            std::fs::create_dir_all(&dir).expect("the corpus directory");
            for (i, seed) in seeds.iter().enumerate() {
                std::fs::write(dir.join(format!("seed-{i}")), seed).expect("writing a seed");
            }
        }
        let mut want: Vec<(String, Vec<u8>)> =
            seeds.into_iter().enumerate().map(|(i, s)| (format!("seed-{i}"), s)).collect();
        want.sort();
        let got = seed_files(&dir);
        let names = |v: &[(String, Vec<u8>)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want), "fuzz/corpus/{target}: rerun with UMBP_BLESS_FUZZ_CORPUS=1");
        for ((name, a), (_, b)) in got.iter().zip(&want) {
            assert!(a == b, "fuzz/corpus/{target}/{name} is stale: rerun with UMBP_BLESS_FUZZ_CORPUS=1");
        }
    }
}
