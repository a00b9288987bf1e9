//! `BatchResolveCodec` of the reference: the struct-of-arrays `BatchResolveKeys` reply, through real
//! protobuf bytes, plus property tests (round trip; no input makes the decoder panic).

use proptest::prelude::*;
use prost::Message;
use umbp_core::{BufferDesc, MemoryLocation, PageLocation, RemoteRegion, TierType};
use umbp_proto::WireError as CodecError;
use umbp_proto::convert::tier_to_wire;
use umbp_proto::resolve::{
    DecodedResolve, ResolvedKey, decode_batch_resolve, decode_request_ranges, encode_batch_resolve,
    encode_request_ranges,
};
use umbp_proto::v1 as pb;

const PAGE: u64 = 4096;

fn hit(tier: TierType, backend_id: u32, size: u64, pages: &[(u32, u32)]) -> Option<ResolvedKey> {
    let pages = pages.iter().map(|(b, p)| PageLocation::new(*b, *p)).collect();
    Some(ResolvedKey { tier, backend_id, size, pages, lease: 0, crc32c: None, partial: false, first_page: 0 })
}

fn desc(backend_id: u32, buffer_index: u32, location: MemoryLocation, remote: Option<u64>) -> BufferDesc {
    BufferDesc {
        backend_id,
        buffer_index,
        size: 64 * PAGE,
        location,
        remote: remote.map(|region_id| RemoteRegion { endpoint: "127.0.0.1:7000".into(), region_id }),
    }
}

/// Encodes, serializes, parses and decodes: what a reader on another node sees.
fn over_the_wire(keys: &[Option<ResolvedKey>], descs: &[BufferDesc], page_size: u64) -> DecodedResolve {
    let bytes = encode_batch_resolve(keys, &[], descs, page_size).encode_to_vec();
    let parsed = pb::BatchResolveKeysResponse::decode(bytes.as_slice()).expect("parse");
    decode_batch_resolve(&parsed).expect("decode")
}

fn sample() -> (Vec<Option<ResolvedKey>>, Vec<BufferDesc>) {
    let keys = vec![
        hit(TierType::Hbm, 1, 2 * PAGE, &[(0, 3), (0, 4)]),
        None,
        hit(TierType::Dram, 0, PAGE + 1, &[(1, 0), (0, 9)]),
        hit(TierType::Ssd, 2, 5, &[(0, 0)]),
    ];
    let descs = vec![
        desc(0, 0, MemoryLocation::Host, Some(11)),
        desc(0, 1, MemoryLocation::Host, Some(12)),
        desc(1, 0, MemoryLocation::Gpu { device: 3 }, None),
        desc(2, 0, MemoryLocation::Host, Some(13)),
    ];
    (keys, descs)
}

#[test]
fn checksums_ride_per_key_and_only_when_some_hit_has_one() {
    let (mut keys, descs) = sample();
    let plain = encode_batch_resolve(&keys, &[], &descs, PAGE);
    assert!(plain.checksummed.is_empty() && plain.crc32c.is_empty(), "no hit carries one: no arrays");
    keys[0].as_mut().expect("a hit").crc32c = Some(0);
    keys[3].as_mut().expect("a hit").crc32c = Some(0xffff_ffff);
    let wire = encode_batch_resolve(&keys, &[], &descs, PAGE);
    assert_eq!(wire.checksummed, [true, false, false, true], "per key, misses and unchecked hits false");
    let decoded = over_the_wire(&keys, &descs, PAGE);
    let crcs: Vec<_> = decoded.keys.iter().map(|k| k.as_ref().and_then(|k| k.crc32c)).collect();
    assert_eq!(crcs, [Some(0), None, None, Some(0xffff_ffff)], "a zero checksum is a checksum");

    let mut bad = wire.clone();
    bad.crc32c.pop();
    assert!(decode_batch_resolve(&bad).is_err(), "crc32c shorter than checksummed is refused");
    let mut bad = wire;
    bad.checksummed.push(true);
    bad.crc32c.push(1);
    assert!(decode_batch_resolve(&bad).is_err(), "arrays longer than the keys are refused");
}

#[test]
fn round_trip_preserves_every_field() {
    let (keys, descs) = sample();
    let decoded = over_the_wire(&keys, &descs, PAGE);
    let busy = vec![false; keys.len()];
    assert_eq!(decoded, DecodedResolve { page_size: PAGE, descs, keys, busy });
}

#[test]
fn flattened_pages_slice_by_key() {
    let keys = vec![
        hit(TierType::Dram, 0, 2 * PAGE, &[(0, 1), (0, 2)]),
        None,
        hit(TierType::Dram, 0, 3 * PAGE, &[(1, 7), (1, 8), (0, 0)]),
    ];
    let wire = encode_batch_resolve(&keys, &[], &[], PAGE);
    assert_eq!(wire.found, [true, false, true]);
    assert_eq!(wire.page_count, [2, 0, 3]);
    assert_eq!(wire.buffer_index, [0, 0, 1, 1, 0]);
    assert_eq!(wire.page_index, [1, 2, 7, 8, 0]);
    let decoded = decode_batch_resolve(&wire).expect("decode");
    assert_eq!(decoded.keys, keys);
}

#[test]
fn omit_descs_round_trips() {
    let (keys, _) = sample();
    let decoded = over_the_wire(&keys, &[], PAGE);
    assert!(decoded.descs.is_empty());
    assert_eq!(decoded.keys, keys);
}

#[test]
fn all_not_found() {
    let wire = encode_batch_resolve(&[None, None, None], &[], &[], PAGE);
    assert_eq!(wire.found, [false; 3]);
    assert_eq!(wire.page_count, [0; 3]);
    assert!(wire.buffer_index.is_empty() && wire.page_index.is_empty());
    assert_eq!(over_the_wire(&[None, None, None], &[], PAGE).keys, [None, None, None]);
}

#[test]
fn empty_batch() {
    let decoded = over_the_wire(&[], &[], PAGE);
    assert_eq!(decoded, DecodedResolve { page_size: PAGE, descs: Vec::new(), keys: Vec::new(), busy: Vec::new() });
}

#[test]
fn malformed_mismatched_arrays_rejected() {
    let (keys, descs) = sample();
    let good = encode_batch_resolve(&keys, &[], &descs, PAGE);
    type Cut = fn(&mut pb::BatchResolveKeysResponse);
    let cuts: [(&str, Cut); 5] = [
        ("tier", |r| {
            r.tier.pop();
        }),
        ("size", |r| {
            r.size.pop();
        }),
        ("page_count", |r| {
            r.page_count.pop();
        }),
        ("backend_id", |r| {
            r.backend_id.pop();
        }),
        ("tier", |r| r.tier.push(0)),
    ];
    for (field, cut) in cuts {
        let mut bad = good.clone();
        cut(&mut bad);
        match decode_batch_resolve(&bad) {
            Err(CodecError::MismatchedArrays { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    // A `found` array shorter than the rest is the same defect, seen from the other side.
    let mut bad = good.clone();
    bad.found.pop();
    assert!(matches!(decode_batch_resolve(&bad), Err(CodecError::MismatchedArrays { .. })));
    let mut bad = good;
    bad.page_index.pop();
    assert!(matches!(decode_batch_resolve(&bad), Err(CodecError::MismatchedPageArrays { .. })));
}

#[test]
fn malformed_truncated_pages_rejected() {
    let (keys, descs) = sample();
    let good = encode_batch_resolve(&keys, &[], &descs, PAGE);
    let mut short = good.clone();
    short.buffer_index.pop();
    short.page_index.pop();
    assert_eq!(decode_batch_resolve(&short), Err(CodecError::PageCountMismatch { declared: 5, flattened: 4 }));
    // Surplus pages would shift nothing, but they mean the writer is broken: refused too.
    let mut long = good;
    long.buffer_index.push(0);
    long.page_index.push(0);
    assert_eq!(decode_batch_resolve(&long), Err(CodecError::PageCountMismatch { declared: 5, flattened: 6 }));
}

#[test]
fn malformed_replies_of_other_shapes_are_rejected() {
    let (keys, descs) = sample();
    let good = encode_batch_resolve(&keys, &[], &descs, PAGE);

    // A miss that claims pages (and carries them, so the counts still add up).
    let mut bad = good.clone();
    bad.page_count[1] = 1;
    bad.buffer_index.push(0);
    bad.page_index.push(0);
    assert_eq!(decode_batch_resolve(&bad), Err(CodecError::PagesForMiss { key_index: 1, page_count: 1 }));

    // A hit whose pages cannot hold its size.
    let mut bad = good.clone();
    bad.size[0] = 2 * PAGE + 1;
    assert!(matches!(decode_batch_resolve(&bad), Err(CodecError::PagesDoNotCoverSize { key_index: 0, .. })));

    // Backend ids outside the descriptor shelves, on a hit or on a descriptor.
    let mut bad = good.clone();
    bad.backend_id[0] = 8;
    assert_eq!(decode_batch_resolve(&bad), Err(CodecError::BackendIdOutOfRange { backend_id: 8 }));
    let mut bad = good.clone();
    bad.descs[0].backend_id = u32::MAX;
    assert_eq!(decode_batch_resolve(&bad), Err(CodecError::BackendIdOutOfRange { backend_id: u32::MAX }));

    // A memory kind this build does not know.
    let mut bad = good.clone();
    bad.descs[0].location = 7;
    assert_eq!(decode_batch_resolve(&bad), Err(CodecError::UnknownMemoryKind { value: 7 }));

    // Page counts whose sum overflows 32 bits must not wrap around to a "valid" total.
    let mut bad = good;
    bad.page_count[0] = u32::MAX;
    bad.page_count[2] = 4;
    assert!(matches!(decode_batch_resolve(&bad), Err(CodecError::PageCountMismatch { .. })));
}

#[test]
fn optimized_wire_is_smaller_than_per_key_descs() {
    const KEYS: u32 = 1000;
    const PAGES: u32 = 8;
    let descs: Vec<BufferDesc> = (0..4).map(|b| desc(0, b, MemoryLocation::Host, Some(u64::from(b)))).collect();
    let keys: Vec<Option<ResolvedKey>> = (0..KEYS)
        .map(|k| {
            let pages: Vec<(u32, u32)> = (0..PAGES).map(|p| (k % 4, (k * PAGES + p) % 4096)).collect();
            hit(TierType::Dram, 0, u64::from(PAGES) * PAGE, &pages)
        })
        .collect();
    let soa = encode_batch_resolve(&keys, &[], &descs, PAGE).encoded_len();

    // The per-key shape: one ResolveKeyResponse per key, each carrying its descriptors.
    let per_key: usize = keys
        .iter()
        .flatten()
        .map(|k| {
            let own: Vec<pb::BufferDesc> = descs
                .iter()
                .filter(|d| k.pages.iter().any(|p| p.buffer_index == d.buffer_index))
                .map(pb::BufferDesc::from)
                .collect();
            let msg = pb::ResolveKeyResponse {
                found: true,
                pages: k.pages.iter().copied().map(pb::PageLocation::from).collect(),
                page_size: PAGE,
                descs: own,
                size: k.size,
                backend_id: k.backend_id,
                tier: tier_to_wire(k.tier),
                ..Default::default()
            };
            // Framed as an element of a repeated field.
            let len = msg.encoded_len();
            1 + prost::encoding::encoded_len_varint(len as u64) + len
        })
        .sum();
    println!("1000 keys x 8 pages: SoA {soa} bytes, per-key {per_key} bytes");
    assert!(soa < per_key, "SoA {soa} must be smaller than per-key {per_key}");
    assert!(soa * 2 < per_key, "SoA should at least halve the reply: {soa} vs {per_key}");
}

// --- properties ----------------------------------------------------------------------------------

fn arb_tier() -> impl Strategy<Value = TierType> {
    prop::sample::select(TierType::ALL.to_vec())
}

fn arb_key(page_size: u64) -> impl Strategy<Value = Option<ResolvedKey>> {
    prop::option::of((arb_tier(), 0u32..8, prop::collection::vec((any::<u32>(), any::<u32>()), 0..12)).prop_flat_map(
        move |(tier, backend_id, pages)| {
            let max = pages.len() as u64 * page_size;
            (0..=max).prop_map(move |size| ResolvedKey {
                tier,
                backend_id,
                size,
                pages: pages.iter().map(|(b, p)| PageLocation::new(*b, *p)).collect(),
                lease: 0,
                crc32c: None,
                partial: false,
                first_page: 0,
            })
        },
    ))
}

fn arb_desc() -> impl Strategy<Value = BufferDesc> {
    (
        0u32..8,
        any::<u32>(),
        any::<u64>(),
        prop::option::of(any::<u32>()),
        prop::option::of(("[a-z0-9.:]{0,20}", any::<u64>())),
    )
        .prop_map(|(backend_id, buffer_index, size, gpu, remote)| BufferDesc {
            backend_id,
            buffer_index,
            size,
            location: gpu.map_or(MemoryLocation::Host, |device| MemoryLocation::Gpu { device }),
            remote: remote.map(|(endpoint, region_id)| RemoteRegion { endpoint, region_id }),
        })
}

fn arb_batch() -> impl Strategy<Value = DecodedResolve> {
    (1u64..(1 << 22)).prop_flat_map(|page_size| {
        (
            prop::collection::vec(
                (arb_key(page_size), any::<bool>(), any::<u64>(), prop::option::of(any::<u32>())),
                0..40,
            ),
            prop::collection::vec(arb_desc(), 0..6),
        )
            .prop_map(move |(entries, descs)| {
                let mut keys = Vec::new();
                let mut busy = Vec::new();
                for (key, b, lease, crc32c) in entries {
                    // A hit is never busy; a hit may hold a lease and carry a checksum. Some
                    // hits with pages are partial: their value grown by up to 2 pages before
                    // them (and to reach into their last page), which they start after.
                    busy.push(key.is_none() && b);
                    keys.push(key.map(|k| {
                        let n = k.pages.len() as u64;
                        if !(b && n > 0) {
                            return ResolvedKey { lease, crc32c, ..k };
                        }
                        let first_page = lease % 3;
                        let size = k.size.max((n - 1) * page_size + 1) + first_page * page_size;
                        ResolvedKey { lease, crc32c, partial: true, first_page, size, ..k }
                    }));
                }
                DecodedResolve { page_size, descs, keys, busy }
            })
    })
}

fn arb_wire() -> impl Strategy<Value = pb::BatchResolveKeysResponse> {
    let small = 0usize..6;
    (
        small.clone(),
        small.clone(),
        small.clone(),
        small,
        0usize..12,
        0usize..12,
        0u64..8,
        prop::collection::vec(0u32..5, 0..6),
        (0usize..6, 0usize..6, 0usize..6, 0usize..6),
        (0usize..6, prop::collection::vec(0u64..4, 0..6)),
    )
        .prop_map(
            |(found, tier, size, backend, bi, pi, page_size, counts, (busy, leases, checked, crcs), parts)| {
                let (partial, first_page) = parts;
                pb::BatchResolveKeysResponse {
                    descs: Vec::new(),
                    page_size,
                    found: (0..found).map(|i| i % 2 == 0).collect(),
                    tier: (0..tier).map(|i| i as i32 - 1).collect(),
                    size: (0..size).map(|i| i as u64 * 3).collect(),
                    page_count: counts,
                    buffer_index: (0..bi as u32).collect(),
                    page_index: (0..pi as u32).collect(),
                    backend_id: (0..backend as u32).map(|i| i * 3).collect(),
                    busy: (0..busy).map(|i| i % 3 == 0).collect(),
                    lease_id: (0..leases).map(|i| i as u64).collect(),
                    checksummed: (0..checked).map(|i| i % 2 == 1).collect(),
                    crc32c: (0..crcs).map(|i| i as u32 * 7).collect(),
                    partial: (0..partial).map(|i| i % 2 == 0).collect(),
                    first_page,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decode_inverts_encode(batch in arb_batch()) {
        let wire = encode_batch_resolve(&batch.keys, &batch.busy, &batch.descs, batch.page_size);
        let parsed = pb::BatchResolveKeysResponse::decode(wire.encode_to_vec().as_slice()).expect("parse");
        prop_assert_eq!(decode_batch_resolve(&parsed), Ok(batch));
    }

    #[test]
    fn no_reply_makes_the_decoder_panic_or_misslice(wire in arb_wire()) {
        if let Ok(decoded) = decode_batch_resolve(&wire) {
            // Whatever it accepts is exactly consistent: every page sent belongs to exactly one key.
            prop_assert_eq!(decoded.keys.len(), wire.found.len());
            let pages: usize = decoded.keys.iter().flatten().map(|k| k.pages.len()).sum();
            prop_assert_eq!(pages, wire.buffer_index.len());
            let reencoded = encode_batch_resolve(&decoded.keys, &decoded.busy, &decoded.descs, decoded.page_size);
            prop_assert_eq!(reencoded.buffer_index, wire.buffer_index);
            prop_assert_eq!(reencoded.page_index, wire.page_index);
        }
    }
}

#[test]
fn busy_and_leases_travel_only_when_needed_and_round_trip() {
    let keys = vec![hit(TierType::Ssd, 0, 5, &[(0, 1)]).map(|k| ResolvedKey { lease: 42, ..k }), None, None];
    let busy = [false, true, false];
    let wire = encode_batch_resolve(&keys, &busy, &[], PAGE);
    assert_eq!(wire.busy, [false, true, false]);
    assert_eq!(wire.lease_id, [42, 0, 0]);
    let decoded = decode_batch_resolve(&wire).expect("decode");
    assert_eq!((decoded.keys, decoded.busy), (keys, busy.to_vec()));
    // Nothing busy and no lease: neither array is sent (an older reply decodes the same way).
    let plain = encode_batch_resolve(&[None, hit(TierType::Dram, 0, 1, &[(0, 0)])], &[], &[], PAGE);
    assert!(plain.busy.is_empty() && plain.lease_id.is_empty());
    assert_eq!(decode_batch_resolve(&plain).expect("decode").busy, [false, false]);
    // A busy flag on a hit is malformed, so is an optional array of the wrong length.
    let mut bad = wire.clone();
    bad.busy = vec![true, true, false];
    assert_eq!(decode_batch_resolve(&bad), Err(CodecError::BusyHit { key_index: 0 }));
    let mut short = wire;
    short.lease_id = vec![1];
    assert!(matches!(decode_batch_resolve(&short), Err(CodecError::MismatchedArrays { field: "lease_id", .. })));
}

#[test]
fn partial_hits_travel_only_when_needed_and_round_trip() {
    // A value of 5 pages, of which a partial hit holds pages 2 and 3.
    let part =
        hit(TierType::Ssd, 1, 5 * PAGE, &[(0, 9), (0, 4)]).map(|k| ResolvedKey { partial: true, first_page: 2, ..k });
    let keys = vec![hit(TierType::Dram, 0, 5, &[(0, 1)]), part, None];
    let wire = encode_batch_resolve(&keys, &[], &[], PAGE);
    assert_eq!((wire.partial.as_slice(), wire.first_page.as_slice()), (&[false, true, false][..], &[0, 2, 0][..]));
    assert_eq!(decode_batch_resolve(&wire).expect("decode").keys, keys);
    // No partial hit: neither array is sent (what an older node sends, decoded as whole).
    let whole = encode_batch_resolve(&keys[..1], &[], &[], PAGE);
    assert!(whole.partial.is_empty() && whole.first_page.is_empty());
    let bad = |edit: &dyn Fn(&mut pb::BatchResolveKeysResponse)| {
        let mut w = wire.clone();
        edit(&mut w);
        decode_batch_resolve(&w)
    };
    let reason = |r: Result<DecodedResolve, CodecError>| match r {
        Err(CodecError::BadPartial { key_index, reason }) => (key_index, reason),
        other => panic!("expected a bad partial, got {other:?}"),
    };
    assert_eq!(reason(bad(&|w| w.first_page[1] = 4)), (1, "pages outside the value"), "pages 4..6 of 5");
    assert_eq!(reason(bad(&|w| w.first_page[1] = u64::MAX)), (1, "pages outside the value"), "no overflow");
    assert_eq!(reason(bad(&|w| w.partial[2] = true)), (2, "a miss"));
    assert_eq!(reason(bad(&|w| w.first_page[0] = 1)), (0, "a first page for a whole hit"));
    assert!(matches!(
        bad(&|w| w.first_page.truncate(2)),
        Err(CodecError::MismatchedArrays { field: "first_page", .. })
    ));
    // A part with no pages is refused: a hit with nothing to read.
    let empty = hit(TierType::Ssd, 1, 5 * PAGE, &[]).map(|k| ResolvedKey { partial: true, first_page: 1, ..k });
    let w = encode_batch_resolve(&[empty], &[], &[], PAGE);
    assert_eq!(reason(decode_batch_resolve(&w)), (0, "pages outside the value"));
}

#[test]
fn request_ranges_round_trip_and_malformed_ones_read_as_none() {
    let request = |keys: &[&str]| pb::BatchResolveKeysRequest {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
        ..Default::default()
    };
    let mut r = request(&["a", "b", "c"]);
    let ranges = vec![vec![(5, 10), (100, 1)], Vec::new(), vec![(0, 7)]];
    encode_request_ranges(&mut r, &ranges);
    assert_eq!(r.range_count, [2, 0, 1]);
    assert_eq!(decode_request_ranges(&r), ranges);
    // No ranges: nothing sent (an older client's request), and nothing decoded.
    let mut plain = request(&["a", "b"]);
    encode_request_ranges(&mut plain, &[Vec::new()]);
    assert!(plain.range_count.is_empty() && plain.range_offset.is_empty());
    assert!(decode_request_ranges(&plain).is_empty());
    // Fewer lists than keys: the rest are whole.
    let mut short = request(&["a", "b"]);
    encode_request_ranges(&mut short, &[vec![(1, 2)]]);
    assert_eq!(decode_request_ranges(&short), [vec![(1, 2)], Vec::new()]);
    for edit in [
        |r: &mut pb::BatchResolveKeysRequest| r.range_count.push(0),
        |r: &mut pb::BatchResolveKeysRequest| r.range_count[0] = 3,
        |r: &mut pb::BatchResolveKeysRequest| r.range_length.truncate(2),
        |r: &mut pb::BatchResolveKeysRequest| r.range_count[0] = u32::MAX,
    ] {
        let mut bad = r.clone();
        edit(&mut bad);
        assert!(decode_request_ranges(&bad).is_empty(), "{bad:?}");
    }
}
