//! Fuzzing entry points (issue 19): bytes a master could send as a routing reply, handed to the
//! master client's validating decoders, and request sequences a peer could send to this node's
//! peer service. Not API: hidden from the docs, called by the `fuzz/` crate's targets
//! (coverage-guided, long runs) and by `tests/fuzz_peer.rs` (proptest, bounded, in CI). Each entry
//! point panics when a property fails, which is what both drivers catch.

use prost::Message;
use umbp_proto::v1 as pb;

use crate::master_client::wire;

/// The most keys a routing reply is decoded for.
const MAX_KEYS: u8 = 16;

/// Decodes `data` (`[keys][which][protobuf bytes]`) as a `BatchRouteGet`, `BatchRoutePut` or
/// `BatchLookup` reply for `keys % 16` keys, with the master client's decoders. Properties: an
/// accepted reply has one answer per key, a hit names a node the reply lists (with an id), a routed
/// put names its node.
pub fn route_replies(data: &[u8]) {
    let [keys, which, bytes @ ..] = data else { return };
    let keys = usize::from(keys % MAX_KEYS);
    match which % 3 {
        0 => {
            let Ok(reply) = pb::BatchRouteGetResponse::decode(bytes) else { return };
            let Ok(hits) = wire::decode_route_get(keys, reply.clone()) else { return };
            assert_eq!(hits.len(), keys, "one route-get answer per key");
            for (i, hit) in hits.iter().enumerate() {
                let Some(hit) = hit else {
                    assert_eq!(reply.node_ref[i], 0, "key {i}: a ref decoded as a miss");
                    continue;
                };
                let node = &reply.nodes[reply.node_ref[i] as usize - 1];
                assert!(!hit.node_id.is_empty(), "key {i}: a hit without a node");
                assert_eq!((&hit.node_id, hit.size), (&node.node_id, reply.size[i]), "key {i}: its own node");
            }
        }
        1 => {
            let Ok(reply) = pb::BatchRoutePutResponse::decode(bytes) else { return };
            let Ok(decisions) = wire::decode_route_put(keys, reply.clone()) else { return };
            assert_eq!(decisions.len(), keys, "one route-put answer per key");
            for (i, d) in decisions.into_iter().enumerate() {
                if let crate::master_client::RoutePutDecision::Routed { node_id, .. } = d {
                    assert!(!node_id.is_empty(), "a routed put names its node");
                    if reply.entries.is_empty() {
                        let node = &reply.nodes[reply.node_ref[i] as usize - 1];
                        assert_eq!(node_id, node.node_id, "key {i}: its own node");
                    }
                }
            }
        }
        _ => {
            let Ok(reply) = pb::BatchLookupResponse::decode(bytes) else { return };
            if let Ok(found) = wire::decode_lookup(keys, reply) {
                assert_eq!(found.len(), keys, "one lookup answer per key");
            }
        }
    }
}

/// Valid routing replies for [`route_replies`], made by the encoders.
pub fn route_seeds() -> Vec<Vec<u8>> {
    let node = |id: &str| pb::NodeInfo {
        node_id: id.into(),
        peer_address: format!("{id}:7000"),
        data_endpoint: format!("{id}:7002"),
    };
    let dram = umbp_proto::convert::tier_to_wire(umbp_core::TierType::Dram);
    let get = pb::BatchRouteGetResponse {
        nodes: vec![node("a"), node("b")],
        node_ref: vec![1, 0, 2, 1],
        tier: vec![dram; 4],
        size: vec![10, 0, 30, 40],
    };
    let entry = |outcome: pb::RoutePutOutcome, id: &str| pb::RoutePutEntry {
        outcome: outcome as i32,
        node_id: id.into(),
        tier: dram,
        peer_address: "a:7000".into(),
        data_endpoint: "a:7002".into(),
    };
    let put = pb::BatchRoutePutResponse {
        entries: vec![
            entry(pb::RoutePutOutcome::RoutePutRouted, "a"),
            entry(pb::RoutePutOutcome::RoutePutAlreadyExists, ""),
            entry(pb::RoutePutOutcome::RoutePutUnavailable, ""),
        ],
        ..Default::default()
    };
    let columns = pb::BatchRoutePutResponse {
        nodes: vec![node("a"), node("b")],
        node_ref: vec![2, 0, 1],
        tier: vec![dram; 3],
        outcome: [
            pb::RoutePutOutcome::RoutePutRouted,
            pb::RoutePutOutcome::RoutePutAlreadyExists,
            pb::RoutePutOutcome::RoutePutRouted,
        ]
        .map(|o| o as i32)
        .to_vec(),
        ..Default::default()
    };
    let lookup = pb::BatchLookupResponse { found: vec![true, false] };
    vec![
        [&[4u8, 0][..], &get.encode_to_vec()].concat(),
        [&[3u8, 1][..], &put.encode_to_vec()].concat(),
        [&[3u8, 1][..], &columns.encode_to_vec()].concat(),
        [&[2u8, 2][..], &lookup.encode_to_vec()].concat(),
    ]
}

#[cfg(feature = "dram")]
pub use self::keyed::{keyed_seeds, keyed_stream};
#[cfg(feature = "dram")]
pub use self::service::{peer_requests, peer_seeds};

#[cfg(feature = "dram")]
mod keyed;

#[cfg(feature = "dram")]
mod service {
    use std::collections::BTreeSet;
    use std::sync::{Arc, OnceLock};

    use prost::Message;
    use tonic::{Code, Request};
    use umbp_core::{BackendRegistry, MediumBackend, MemoryRegistrar, TierType};
    use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
    use umbp_proto::v1 as pb;
    use umbp_proto::v1::umbp_peer_server::UmbpPeer;

    use crate::PeerService;

    /// The most requests one input is cut into.
    const MAX_REQUESTS: usize = 16;
    const PAGE: u64 = 4096;
    const PAGES: u64 = 64;

    fn runtime() -> &'static tokio::runtime::Runtime {
        static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
        RT.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a tokio runtime")
        })
    }

    /// Registers the medium's memory with nobody, as a node without peers would.
    #[derive(Debug)]
    struct NoPeers;

    impl MemoryRegistrar for NoPeers {
        fn register_memory(
            &self,
            region: umbp_core::LocalRegion,
        ) -> Result<umbp_core::TransferRef, umbp_core::RegistrationError> {
            Ok(umbp_core::TransferRef::local(region))
        }

        fn deregister(&self, _r: &umbp_core::TransferRef) {}
    }

    fn split(data: &[u8]) -> Vec<(u8, &[u8])> {
        let mut out = Vec::new();
        let mut rest = data;
        while let [which, l0, l1, tail @ ..] = rest {
            let len = usize::from(u16::from_le_bytes([*l0, *l1])).min(tail.len());
            out.push((*which, &tail[..len]));
            rest = &tail[len..];
            if out.len() == MAX_REQUESTS {
                break;
            }
        }
        out
    }

    fn join(parts: &[(u8, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (which, bytes) in parts {
            out.push(*which);
            out.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(u16::MAX).to_le_bytes());
            out.extend_from_slice(bytes);
        }
        out
    }

    fn refused(what: &str, s: &tonic::Status) {
        assert!(!matches!(s.code(), Code::Internal | Code::Unknown), "{what}: the peer service failed: {s}");
    }

    /// What a sequence left behind for the cleanup: slots it was given, keys it committed, read
    /// leases it was granted.
    #[derive(Default)]
    struct Left {
        slots: BTreeSet<u64>,
        keys: BTreeSet<String>,
        leases: Vec<pb::ReadRelease>,
    }

    /// Sends the requests of `data` (each `[rpc: u8][len: u16 LE][protobuf bytes]`; bytes that are
    /// not the RPC's message are skipped, as tonic would refuse them) to a peer service over a fresh
    /// DRAM medium of 64 pages. Properties: no request makes the service fail; every batch reply has
    /// one entry per request entry; a `BatchResolveKeys` reply passes the client's own decoder; and
    /// once the slots it was given are aborted, the read leases it was granted released and the keys
    /// it committed evicted, the medium is empty again (no page leaked by any request). Returns how
    /// many requests the service accepted.
    pub fn peer_requests(data: &[u8]) -> usize {
        let config = PageBackendConfig::new(TierType::Dram, PAGE, vec![PAGE * PAGES]);
        let source = HostPageMemorySource::new(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
        let backend = Arc::new(PageBackend::new(config, Box::new(source)).expect("a DRAM medium"));
        backend.init(Arc::new(NoPeers)).expect("the medium starts");
        let mut registry = BackendRegistry::new();
        registry.register(backend.clone()).expect("a DRAM medium registers");
        let service = PeerService::new(Arc::new(registry), "127.0.0.1:1");
        let mut left = Left::default();
        let accepted = runtime().block_on(async {
            let mut accepted = 0;
            for (which, bytes) in split(data) {
                accepted += usize::from(send(&service, which, bytes, &mut left).await);
            }
            accepted
        });
        backend.batch_abort(&left.slots.iter().map(|s| crate::peer_service::slot_local(*s)).collect::<Vec<_>>());
        let releases: Vec<umbp_core::ReadRelease> =
            left.leases.iter().map(|r| umbp_core::ReadRelease::new(r.key.clone(), r.lease_id)).collect();
        backend.release_reads(&releases);
        let _ = backend.evict(&left.keys.iter().cloned().collect::<Vec<_>>());
        let cap = backend.capacity();
        assert_eq!(cap.available_bytes, cap.total_bytes, "pages leaked ({} keys owned)", backend.owned_key_count());
        backend.shutdown();
        accepted
    }

    async fn send(service: &PeerService, which: u8, bytes: &[u8], left: &mut Left) -> bool {
        match which % 8 {
            0 => {
                let Ok(r) = pb::BatchAllocateSlotsRequest::decode(bytes) else { return false };
                let n = r.entries.len();
                match service.batch_allocate_slots(Request::new(r)).await {
                    Ok(reply) => {
                        let entries = reply.into_inner().entries;
                        assert_eq!(entries.len(), n, "one allocation answer per entry");
                        left.slots.extend(entries.iter().filter(|e| e.slot_id != 0).map(|e| e.slot_id));
                        true
                    }
                    Err(s) => {
                        refused("batch allocate", &s);
                        false
                    }
                }
            }
            1 => {
                let Ok(r) = pb::BatchCommitSlotsRequest::decode(bytes) else { return false };
                let asked: Vec<String> = r.entries.iter().map(|e| e.key.clone()).collect();
                match service.batch_commit_slots(Request::new(r)).await {
                    Ok(reply) => {
                        let entries = reply.into_inner().entries;
                        assert_eq!(entries.len(), asked.len(), "one commit answer per entry");
                        for (e, key) in entries.iter().zip(asked) {
                            if e.success {
                                left.keys.insert(key);
                            }
                        }
                        true
                    }
                    Err(s) => {
                        refused("batch commit", &s);
                        false
                    }
                }
            }
            2 => {
                let Ok(r) = pb::BatchAbortSlotsRequest::decode(bytes) else { return false };
                let n = r.slot_ids.len();
                match service.batch_abort_slots(Request::new(r)).await {
                    Ok(reply) => {
                        assert_eq!(reply.into_inner().success.len(), n, "one abort answer per slot");
                        true
                    }
                    Err(s) => {
                        refused("batch abort", &s);
                        false
                    }
                }
            }
            3 => {
                let Ok(r) = pb::BatchResolveKeysRequest::decode(bytes) else { return false };
                let keys = r.keys.clone();
                match service.batch_resolve_keys(Request::new(r)).await {
                    Ok(reply) => {
                        let reply = reply.into_inner();
                        let decoded = umbp_proto::resolve::decode_batch_resolve(&reply)
                            .expect("the service's reply passes the client's decoder");
                        assert_eq!(decoded.keys.len(), keys.len(), "one resolve answer per key");
                        for (key, hit) in keys.iter().zip(&decoded.keys) {
                            if let Some(hit) = hit.as_ref().filter(|h| h.lease != 0) {
                                left.leases.push(pb::ReadRelease {
                                    key: key.clone(),
                                    lease_id: hit.lease,
                                    ..Default::default()
                                });
                            }
                        }
                        true
                    }
                    Err(s) => {
                        refused("batch resolve", &s);
                        false
                    }
                }
            }
            4 => {
                let Ok(r) = pb::ReleaseReadsRequest::decode(bytes) else { return false };
                service.release_reads(Request::new(r)).await.map_err(|s| refused("release reads", &s)).is_ok()
            }
            5 => {
                let Ok(r) = pb::EvictKeyRequest::decode(bytes) else { return false };
                service.evict_key(Request::new(r)).await.map_err(|s| refused("evict", &s)).is_ok()
            }
            6 => {
                let Ok(r) = pb::ResolveKeyRequest::decode(bytes) else { return false };
                let key = r.key.clone();
                match service.resolve_key(Request::new(r)).await {
                    Ok(reply) => {
                        let reply = reply.into_inner();
                        if reply.found && reply.lease_id != 0 {
                            left.leases.push(pb::ReadRelease { key, lease_id: reply.lease_id, ..Default::default() });
                        }
                        true
                    }
                    Err(s) => {
                        refused("resolve", &s);
                        false
                    }
                }
            }
            _ => service
                .get_peer_info(Request::new(pb::GetPeerInfoRequest {}))
                .await
                .map_err(|s| refused("peer info", &s))
                .is_ok(),
        }
    }

    /// Request sequences a writer and a reader send, made by the encoders: allocate two keys (one
    /// twice, one with no tier), commit one, abort the other, resolve (batch and single), release,
    /// evict, peer info.
    pub fn peer_seeds() -> Vec<Vec<u8>> {
        let dram = umbp_proto::convert::tier_to_wire(TierType::Dram);
        let alloc = |key: &str, size, tier| pb::AllocateSlotRequest { size, tier, key: key.into() };
        // Slot ids as the service tags them: the tier in the top byte, the medium's id below.
        let slot = |local: u64| crate::peer_service::tag_slot(TierType::Dram, local).unwrap_or_default();
        let life = vec![
            (
                0,
                pb::BatchAllocateSlotsRequest {
                    entries: vec![alloc("a", 5000, dram), alloc("b", 100, dram), alloc("a", 1, dram), alloc("c", 1, 0)],
                    accepts_busy: true,
                }
                .encode_to_vec(),
            ),
            (
                1,
                pb::BatchCommitSlotsRequest {
                    entries: vec![pb::CommitSlotRequest { slot_id: slot(1), key: "a".into(), crc32c: Some(7) }],
                }
                .encode_to_vec(),
            ),
            (2, pb::BatchAbortSlotsRequest { slot_ids: vec![slot(2), slot(99)] }.encode_to_vec()),
            (
                3,
                pb::BatchResolveKeysRequest { keys: vec!["a".into(), "b".into()], ..Default::default() }
                    .encode_to_vec(),
            ),
            (6, pb::ResolveKeyRequest { key: "a".into() }.encode_to_vec()),
            (
                4,
                pb::ReleaseReadsRequest {
                    reads: vec![pb::ReadRelease { key: "a".into(), lease_id: 1, ..Default::default() }],
                }
                .encode_to_vec(),
            ),
            (5, pb::EvictKeyRequest { keys: vec!["a".into(), "zz".into()] }.encode_to_vec()),
            (7, Vec::new()),
        ];
        vec![join(&life)]
    }
}
