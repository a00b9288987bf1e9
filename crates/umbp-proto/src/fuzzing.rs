//! Fuzzing entry points (issue 19): bytes a peer could send as a `BatchResolveKeys` reply (the
//! columnar codec) or as heartbeat event bundles, handed to this crate's decoders. Not API: hidden
//! from the docs, called by the `fuzz/` crate's targets (coverage-guided, long runs) and by
//! `tests/fuzz_proto.rs` (proptest, bounded, in CI). Each entry point panics when a property
//! fails, which is what both drivers catch.

use prost::Message;
use umbp_core::{BufferDesc, KvEvent, MemoryLocation, PageLocation, RemoteRegion, TierType};

use crate::convert::tier_to_wire;
use crate::resolve::{ResolvedKey, decode_batch_resolve, encode_batch_resolve};
use crate::v1 as pb;

/// Decodes `data` as a `BatchResolveKeysResponse` (as tonic would) and then with
/// [`decode_batch_resolve`]. Properties: an accepted reply has one entry per key, every hit's pages
/// cover its size and were sliced from its own run of the flattened arrays (so the pages of all
/// hits, in order, are the flattened arrays), a hit is never busy, and encoding the decoded reply
/// again decodes to the same thing.
pub fn resolve(data: &[u8]) {
    let Ok(resp) = pb::BatchResolveKeysResponse::decode(data) else { return };
    let Ok(d) = decode_batch_resolve(&resp) else { return };
    assert_eq!(d.keys.len(), resp.found.len(), "one entry per key");
    assert_eq!(d.busy.len(), resp.found.len(), "one busy flag per key");
    let mut flat: Vec<(u32, u32)> = Vec::new();
    for (i, key) in d.keys.iter().enumerate() {
        let Some(k) = key else { continue };
        assert!(!d.busy[i], "key {i}: a hit reported busy");
        assert!(resp.found[i], "key {i}: a miss decoded as a hit");
        assert_eq!(k.pages.len() as u64, u64::from(resp.page_count[i]), "key {i}: its page count");
        if k.partial {
            let value_pages = k.size.div_ceil(d.page_size);
            assert!(
                !k.pages.is_empty() && k.first_page + k.pages.len() as u64 <= value_pages,
                "key {i}: a part past the value"
            );
        } else {
            assert_eq!(k.first_page, 0, "key {i}: a whole hit from a later page");
            assert!(k.pages.len() as u64 * d.page_size >= k.size, "key {i}: pages too few for its size");
        }
        flat.extend(k.pages.iter().map(|p| (p.buffer_index, p.page_index)));
    }
    let wire: Vec<(u32, u32)> = resp.buffer_index.iter().copied().zip(resp.page_index.iter().copied()).collect();
    assert_eq!(flat, wire, "every page sliced from its own key's run");
    let again = encode_batch_resolve(&d.keys, &d.busy, &d.descs, d.page_size);
    assert_eq!(decode_batch_resolve(&again).as_ref(), Ok(&d), "a decoded reply re-encodes to itself");
}

/// Valid `BatchResolveKeysResponse` bytes, made by the encoder: hits on two media with leases (one
/// with a checksum, one without), a busy miss, a plain miss, host and GPU descriptors.
pub fn resolve_seeds() -> Vec<Vec<u8>> {
    let hit = |backend_id, size, pages: &[(u32, u32)], lease, crc32c| {
        Some(ResolvedKey {
            tier: if backend_id == 0 { TierType::Dram } else { TierType::Ssd },
            backend_id,
            size,
            pages: pages.iter().map(|&(b, p)| PageLocation::new(b, p)).collect(),
            lease,
            crc32c,
            partial: false,
            first_page: 0,
        })
    };
    let desc = |backend_id, buffer_index, location| BufferDesc {
        backend_id,
        buffer_index,
        size: 1 << 20,
        location,
        remote: Some(RemoteRegion { endpoint: "127.0.0.1:7002".into(), region_id: 5 }),
    };
    let keys = [hit(0, 5000, &[(0, 1), (0, 7)], 11, Some(0xe306_9283)), None, None, hit(1, 10, &[(1, 0)], 0, None)];
    let descs = [desc(0, 0, MemoryLocation::Host), desc(1, 1, MemoryLocation::Gpu { device: 2 })];
    // A partial hit (pages 1 and 2 of a 4-page value) beside a whole one.
    let part = hit(1, 4 * 4096, &[(1, 3), (1, 8)], 12, None).map(|k| ResolvedKey { partial: true, first_page: 1, ..k });
    vec![
        encode_batch_resolve(&keys, &[false, true, false, false], &descs, 4096).encode_to_vec(),
        encode_batch_resolve(&keys[..2], &[], &[], 4096).encode_to_vec(),
        encode_batch_resolve(&[keys[0].clone(), part], &[], &descs, 4096).encode_to_vec(),
    ]
}

/// Decodes `data` as a `HeartbeatRequest` (as tonic would) and converts every event of every
/// bundle as the master does. Properties: an accepted event has a key and a kind this build knows,
/// and converts back to the wire event it came from.
pub fn events(data: &[u8]) {
    let Ok(req) = pb::HeartbeatRequest::decode(data) else { return };
    for event in req.bundles.into_iter().flat_map(|b| b.events) {
        let Ok(e) = KvEvent::try_from(event.clone()) else { continue };
        assert!(!e.key.is_empty(), "an event without a key accepted");
        let back = pb::KvEvent::from(e);
        assert_eq!((back.kind, &back.key, back.size), (event.kind, &event.key, event.size), "an event round-trips");
    }
}

/// Valid `HeartbeatRequest` bytes: a delta of two bundles (adds and a remove) and a full-sync chunk.
pub fn event_seeds() -> Vec<Vec<u8>> {
    let event = |kind: pb::KvEventKind, key: &str, size| pb::KvEvent {
        kind: kind as i32,
        key: key.into(),
        tier: tier_to_wire(TierType::Dram),
        size,
    };
    let bundle = |seq, events| pb::EventBundle { seq, events };
    let delta = pb::HeartbeatRequest {
        node_id: "node-1".into(),
        bundles: vec![
            bundle(1, vec![event(pb::KvEventKind::KvEventAdd, "a", 100), event(pb::KvEventKind::KvEventAdd, "b", 7)]),
            bundle(2, vec![event(pb::KvEventKind::KvEventRemove, "a", 0)]),
        ],
        tier_capacities: vec![pb::TierCapacity {
            tier: tier_to_wire(TierType::Dram),
            total_bytes: 1 << 30,
            available_bytes: 1 << 29,
            page_size: 2 << 20,
        }],
        ..Default::default()
    };
    let sync = pb::HeartbeatRequest {
        node_id: "node-1".into(),
        bundles: vec![bundle(9, vec![event(pb::KvEventKind::KvEventAdd, "c", 4096)])],
        is_full_sync: true,
        delta_seq_baseline: 8,
        full_sync_final: true,
        ..Default::default()
    };
    vec![delta.encode_to_vec(), sync.encode_to_vec()]
}
