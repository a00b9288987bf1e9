//! `PeerServiceDispatchTest` of the reference, over real gRPC on 127.0.0.1:0: a node with an HBM and
//! a DRAM `MockBackend` (same page size), plus the server's own behaviour (port exclusivity, token,
//! shutdown) and the choices this port makes (resolve leases only the serving medium, oversized slot
//! ids are refused).

use std::sync::Arc;
use std::time::Duration;

use tonic::Code;
use tonic::transport::Channel;
use umbp_core::{
    AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BackendRegistry, BufferDesc, CommitRequest,
    CommitResult, EvictResult, KvEvent, MediumBackend, MemoryRegistrar, MetricSource, ResolvedEntry, TierCapacity,
    TierType, TransferRef,
};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_peer::peer_service::{
    PeerServer, PeerServerConfig, PeerServerHandle, PeerService, PeerServiceError, decode_batch_resolve, slot_tier,
};
use umbp_proto::convert::{outcome_from_wire, tier_from_wire, tier_to_wire};
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

const PAGE: u64 = 4096;
const DATA_ENDPOINT: &str = "127.0.0.1:7777";

type Client = UmbpPeerClient<Channel>;

fn mock(tier: TierType) -> Arc<MockBackend> {
    let m = Arc::new(MockBackend::new(MockConfig {
        tier,
        page_size: PAGE,
        pages: 16,
        // Long enough that no test races the lease; the lease test relies on it.
        read_lease_ttl: Duration::from_secs(60),
        ..MockConfig::default()
    }));
    m.init(Arc::new(LocalOnlyRegistrar::new())).expect("mock init");
    m
}

/// A node with HBM and DRAM media. DRAM registers first, so ids (DRAM 0, HBM 1) differ from the
/// media order (HBM, DRAM): a test that mixes them up fails.
struct Node {
    hbm: Arc<MockBackend>,
    dram: Arc<MockBackend>,
    server: PeerServerHandle,
    client: Client,
}

impl Node {
    async fn start() -> Self {
        let hbm = mock(TierType::Hbm);
        let dram = mock(TierType::Dram);
        let mut registry = BackendRegistry::new();
        assert_eq!(registry.register(dram.clone()).expect("register dram"), 0);
        assert_eq!(registry.register(hbm.clone()).expect("register hbm"), 1);
        let (server, client) = serve(registry, PeerServerConfig::default()).await;
        Self { hbm, dram, server, client }
    }
}

const DRAM_ID: u32 = 0;
const HBM_ID: u32 = 1;

async fn serve(registry: BackendRegistry, config: PeerServerConfig) -> (PeerServerHandle, Client) {
    let service = PeerService::new(Arc::new(registry), DATA_ENDPOINT);
    let server = PeerServer::start(config, service).await.expect("start peer server");
    let client = connect(&server).await;
    (server, client)
}

async fn connect(server: &PeerServerHandle) -> Client {
    UmbpPeerClient::connect(format!("http://{}", server.local_addr())).await.expect("connect")
}

/// Stores `key` with `size` bytes on `backend` directly (allocate + commit).
fn put_direct(backend: &MockBackend, key: &str, size: u64) {
    let a = backend.batch_allocate(&[AllocateRequest::new(key, size)]).remove(0);
    assert_eq!(a.outcome, umbp_core::AllocateOutcome::Allocated);
    let c = backend.batch_commit(&[CommitRequest::new(a.slot_id, key)]).remove(0);
    assert!(c.success);
}

fn alloc_req(tier: TierType, key: &str, size: u64) -> pb::AllocateSlotRequest {
    pb::AllocateSlotRequest { size, tier: tier_to_wire(tier), key: key.into() }
}

fn allocated() -> i32 {
    pb::AllocateOutcome::AllocateSuccessAllocated as i32
}

fn failed() -> i32 {
    pb::AllocateOutcome::AllocateFailed as i32
}

async fn allocate(client: &mut Client, tier: TierType, key: &str, size: u64) -> pb::AllocateSlotResponse {
    client.allocate_slot(alloc_req(tier, key, size)).await.expect("AllocateSlot").into_inner()
}

async fn commit(client: &mut Client, slot_id: u64, key: &str) -> pb::CommitSlotResponse {
    client
        .commit_slot(pb::CommitSlotRequest { slot_id, key: key.into(), crc32c: None })
        .await
        .expect("CommitSlot")
        .into_inner()
}

async fn abort(client: &mut Client, slot_id: u64) -> bool {
    client.abort_slot(pb::AbortSlotRequest { slot_id }).await.expect("AbortSlot").into_inner().success
}

async fn resolve(client: &mut Client, key: &str) -> pb::ResolveKeyResponse {
    client.resolve_key(pb::ResolveKeyRequest { key: key.into() }).await.expect("ResolveKey").into_inner()
}

async fn batch_resolve(client: &mut Client, keys: &[&str], omit_descs: bool) -> pb::BatchResolveKeysResponse {
    let keys = keys.iter().map(|k| k.to_string()).collect();
    client
        .batch_resolve_keys(pb::BatchResolveKeysRequest { keys, omit_descs, ..Default::default() })
        .await
        .expect("BatchResolveKeys")
        .into_inner()
}

async fn evict(client: &mut Client, keys: &[&str]) -> Vec<pb::EvictedKey> {
    let keys = keys.iter().map(|k| k.to_string()).collect();
    client.evict_key(pb::EvictKeyRequest { keys }).await.expect("EvictKey").into_inner().evicted
}

// --- the reference's PeerServiceDispatchTest -----------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_checksum_reaches_the_medium_and_every_resolve_answers_it() {
    let mut node = Node::start().await;
    let with = allocate(&mut node.client, TierType::Dram, "with", 10).await;
    let without = allocate(&mut node.client, TierType::Hbm, "without", 10).await;
    let commit = |slot_id, key: &str, crc32c| pb::CommitSlotRequest { slot_id, key: key.into(), crc32c };
    let r = node
        .client
        .batch_commit_slots(pb::BatchCommitSlotsRequest {
            entries: vec![commit(with.slot_id, "with", Some(0)), commit(without.slot_id, "without", None)],
        })
        .await
        .expect("BatchCommitSlots")
        .into_inner();
    assert!(r.entries.iter().all(|e| e.success), "{r:?}");
    assert_eq!(resolve(&mut node.client, "with").await.crc32c, Some(0), "a zero checksum is a checksum");
    assert_eq!(resolve(&mut node.client, "without").await.crc32c, None);
    let single = allocate(&mut node.client, TierType::Dram, "single", 10).await;
    let c = node.client.commit_slot(commit(single.slot_id, "single", Some(0xdead_beef))).await.expect("CommitSlot");
    assert!(c.into_inner().success);
    let b = batch_resolve(&mut node.client, &["without", "missing", "single", "with"], true).await;
    assert_eq!(b.checksummed, [false, false, true, true], "per key, across media");
    assert_eq!(b.crc32c, [0, 0, 0xdead_beef, 0]);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_routes_to_the_backend_for_its_tier() {
    let mut node = Node::start().await;
    let r = allocate(&mut node.client, TierType::Hbm, "k", 100).await;
    assert_eq!(r.outcome, allocated());
    assert_eq!(slot_tier(r.slot_id), TierType::Hbm);
    assert_eq!(node.hbm.calls().batch_allocate, 1);
    assert_eq!(node.hbm.pending_slot_count(), 1);
    assert_eq!(node.dram.calls().batch_allocate, 0);
    assert_eq!(node.dram.pending_slot_count(), 0);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_for_a_tier_with_no_backend_fails_cleanly() {
    let mut node = Node::start().await;
    let r = allocate(&mut node.client, TierType::Ssd, "k", 100).await;
    assert_eq!(r.outcome, failed());
    assert_eq!(r.slot_id, 0);
    assert!(r.pages.is_empty() && r.descs.is_empty());
    // An unknown tier number is the same per-entry failure, not an RPC error.
    let mut req = alloc_req(TierType::Hbm, "k", 100);
    req.tier = 42;
    let r = node.client.allocate_slot(req).await.expect("unknown tier is not an RPC error").into_inner();
    assert_eq!(r.outcome, failed());
    assert_eq!(node.hbm.calls().batch_allocate, 0);
    assert_eq!(node.dram.calls().batch_allocate, 0);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_slots_on_two_backends_stay_distinct() {
    let mut node = Node::start().await;
    let a = allocate(&mut node.client, TierType::Hbm, "a", 100).await;
    let b = allocate(&mut node.client, TierType::Dram, "b", 200).await;
    assert_eq!(a.outcome, allocated());
    assert_eq!(b.outcome, allocated());
    // Both mocks number their slots from 1: only the tag tells them apart.
    assert_ne!(a.slot_id, b.slot_id);
    let ca = commit(&mut node.client, a.slot_id, "a").await;
    let cb = commit(&mut node.client, b.slot_id, "b").await;
    assert!(ca.success && cb.success);
    assert_eq!((ca.bytes_committed, cb.bytes_committed), (100, 200));
    assert_eq!(node.hbm.owned_key_count(), 1);
    assert_eq!(node.dram.owned_key_count(), 1);
    assert!(node.hbm.batch_resolve(&["a".into()], false)[0].found);
    assert!(node.dram.batch_resolve(&["b".into()], false)[0].found);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_of_an_unknown_slot_fails() {
    let mut node = Node::start().await;
    let r = commit(&mut node.client, 0, "k").await;
    assert!(!r.success);
    assert_eq!(r.bytes_committed, 0);
    assert_eq!(node.hbm.calls().batch_commit + node.dram.calls().batch_commit, 0);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_peer_info_publishes_every_backends_buffers() {
    let mut node = Node::start().await;
    let info = node.client.get_peer_info(pb::GetPeerInfoRequest {}).await.expect("GetPeerInfo").into_inner();
    assert_eq!(info.data_endpoint, DATA_ENDPOINT);
    assert_eq!(info.page_size, PAGE);
    assert_eq!(info.buffer_descs.len(), 2);
    assert!(info.buffer_descs.iter().all(|d| d.buffer_index == 0));
    let mut ids: Vec<u32> = info.buffer_descs.iter().map(|d| d.backend_id).collect();
    ids.sort_unstable();
    assert_eq!(ids, [DRAM_ID, HBM_ID]);
    assert!(info.buffer_descs.iter().all(|d| d.size == 16 * PAGE));
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_resolve_answers_keys_held_by_different_media() {
    let mut node = Node::start().await;
    put_direct(&node.hbm, "on-hbm", 100);
    put_direct(&node.dram, "on-dram", 200);
    let reply = batch_resolve(&mut node.client, &["on-hbm", "on-dram"], false).await;
    let decoded = decode_batch_resolve(&reply).expect("well-formed");
    let [Some(h), Some(d)] = decoded.keys.as_slice() else { panic!("both keys found: {decoded:?}") };
    assert_ne!(h.backend_id, d.backend_id);
    assert_eq!((h.tier, h.backend_id, h.size), (TierType::Hbm, HBM_ID, 100));
    assert_eq!((d.tier, d.backend_id, d.size), (TierType::Dram, DRAM_ID, 200));
    // One descriptor per (backend, buffer) that a hit lives in.
    let mut desc_ids: Vec<(u32, u32)> = decoded.descs.iter().map(|d| (d.backend_id, d.buffer_index)).collect();
    desc_ids.sort_unstable();
    assert_eq!(desc_ids, [(DRAM_ID, 0), (HBM_ID, 0)]);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_names_the_backend_its_pages_belong_to() {
    let mut node = Node::start().await;
    let a = allocate(&mut node.client, TierType::Hbm, "a", 3 * PAGE).await;
    let b = allocate(&mut node.client, TierType::Dram, "b", PAGE).await;
    assert_eq!((a.backend_id, b.backend_id), (HBM_ID, DRAM_ID));
    assert!(!a.descs.is_empty() && !b.descs.is_empty());
    assert!(a.descs.iter().all(|d| d.backend_id == HBM_ID));
    assert!(b.descs.iter().all(|d| d.backend_id == DRAM_ID));
    assert_eq!(a.pages.len(), 3);
    assert_eq!(a.page_size, PAGE);
    assert_eq!(a.pending_ttl_ms, 30_000);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_of_an_unknown_slot_is_idempotently_true() {
    let mut node = Node::start().await;
    assert!(abort(&mut node.client, 0).await);
    assert!(abort(&mut node.client, 0).await);
    // A slot of a present tier that its backend never issued: the backend's idempotent true.
    let never = umbp_peer::peer_service::tag_slot(TierType::Dram, 999).expect("fits");
    assert!(abort(&mut node.client, never).await);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_reaches_the_backend_that_owns_the_slot() {
    let mut node = Node::start().await;
    let a = allocate(&mut node.client, TierType::Dram, "k", 100).await;
    assert_eq!(node.dram.pending_slot_count(), 1);
    assert!(abort(&mut node.client, a.slot_id).await);
    assert_eq!(node.dram.pending_slot_count(), 0);
    assert_eq!(node.dram.calls().batch_abort, 1);
    assert_eq!(node.hbm.calls().batch_abort, 0);
    let c = commit(&mut node.client, a.slot_id, "k").await;
    assert!(!c.success);
    assert_eq!(node.dram.owned_key_count() + node.hbm.owned_key_count(), 0);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_allocate_groups_by_tier_but_answers_in_request_order() {
    let mut node = Node::start().await;
    let entries = vec![
        alloc_req(TierType::Hbm, "h1", 100),
        alloc_req(TierType::Ssd, "s", 100),
        alloc_req(TierType::Dram, "d", 200),
        alloc_req(TierType::Hbm, "h2", 300),
    ];
    let reply = node
        .client
        .batch_allocate_slots(pb::BatchAllocateSlotsRequest { entries, ..Default::default() })
        .await
        .expect("batch")
        .into_inner();
    let outcomes: Vec<i32> = reply.entries.iter().map(|e| e.outcome).collect();
    assert_eq!(outcomes, [allocated(), failed(), allocated(), allocated()]);
    let tiers: Vec<TierType> = reply.entries.iter().map(|e| slot_tier(e.slot_id)).collect();
    assert_eq!(tiers, [TierType::Hbm, TierType::Unknown, TierType::Dram, TierType::Hbm]);
    // One backend call per present tier.
    assert_eq!((node.hbm.calls().batch_allocate, node.dram.calls().batch_allocate), (1, 1));

    let keys = ["h1", "s", "d", "h2"];
    let commits = reply
        .entries
        .iter()
        .zip(keys)
        .filter(|(e, _)| e.outcome == allocated())
        .map(|(e, k)| pb::CommitSlotRequest { slot_id: e.slot_id, key: k.into(), crc32c: None })
        .collect();
    let done = node.client.batch_commit_slots(pb::BatchCommitSlotsRequest { entries: commits }).await.expect("commit");
    let done = done.into_inner().entries;
    assert!(done.iter().all(|c| c.success));
    let bytes: Vec<u64> = done.iter().map(|c| c.bytes_committed).collect();
    assert_eq!(bytes, [100, 200, 300]);
    assert_eq!((node.hbm.owned_key_count(), node.dram.owned_key_count()), (2, 1));
    assert_eq!((node.hbm.calls().batch_commit, node.dram.calls().batch_commit), (1, 1));
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_commit_of_an_unroutable_slot_reports_false_in_place() {
    let mut node = Node::start().await;
    let good = allocate(&mut node.client, TierType::Hbm, "good", 100).await;
    let entries = vec![
        pb::CommitSlotRequest { slot_id: 0, key: "bad".into(), crc32c: None },
        pb::CommitSlotRequest { slot_id: good.slot_id, key: "good".into(), crc32c: None },
    ];
    let reply = node.client.batch_commit_slots(pb::BatchCommitSlotsRequest { entries }).await.expect("commit");
    let ok: Vec<bool> = reply.into_inner().entries.iter().map(|c| c.success).collect();
    assert_eq!(ok, [false, true]);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_takes_the_first_hit_in_media_order() {
    let mut node = Node::start().await;
    put_direct(&node.hbm, "mirrored", 111);
    put_direct(&node.dram, "mirrored", 222);
    let r = resolve(&mut node.client, "mirrored").await;
    assert!(r.found);
    assert_eq!(r.size, 111);
    assert_eq!(r.backend_id, HBM_ID);
    assert_eq!(tier_from_wire(r.tier), TierType::Hbm);
    assert_eq!(r.page_size, PAGE);
    assert_eq!(r.pages.len(), 1);
    assert!(!r.descs.is_empty() && r.descs.iter().all(|d| d.backend_id == HBM_ID));
    // The first hit ends the walk: DRAM was never asked.
    assert_eq!(node.dram.calls().batch_resolve, 0);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_finds_a_key_held_only_by_a_lower_ranked_medium() {
    let mut node = Node::start().await;
    put_direct(&node.dram, "low", 77);
    let r = resolve(&mut node.client, "low").await;
    assert!(r.found);
    assert_eq!((r.size, r.backend_id, tier_from_wire(r.tier)), (77, DRAM_ID, TierType::Dram));
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_miss_is_not_an_error() {
    let mut node = Node::start().await;
    let r = resolve(&mut node.client, "absent").await;
    assert!(!r.found);
    assert!(r.pages.is_empty() && r.descs.is_empty());
    assert_eq!(r.size, 0);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_resolve_reports_the_serving_tier() {
    let mut node = Node::start().await;
    put_direct(&node.dram, "b-only", 55);
    let reply = batch_resolve(&mut node.client, &["absent", "b-only"], false).await;
    assert_eq!(reply.found, [false, true]);
    let decoded = decode_batch_resolve(&reply).expect("well-formed");
    assert_eq!(decoded.page_size, PAGE);
    assert_eq!(decoded.keys[0], None);
    let hit = decoded.keys[1].as_ref().expect("hit");
    assert_eq!((hit.tier, hit.size, hit.backend_id), (TierType::Dram, 55, DRAM_ID));
    assert_eq!(hit.pages.len(), 1);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evict_fans_out_across_every_medium() {
    let mut node = Node::start().await;
    put_direct(&node.hbm, "mirrored", 111);
    put_direct(&node.dram, "mirrored", 222);
    let evicted = evict(&mut node.client, &["mirrored"]).await;
    assert_eq!(evicted.len(), 1);
    assert_eq!(evicted[0].key, "mirrored");
    assert_eq!(evicted[0].bytes_freed, 333);
    assert_eq!(node.hbm.owned_key_count() + node.dram.owned_key_count(), 0);
    assert!(!resolve(&mut node.client, "mirrored").await.found);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evict_of_an_absent_key_reports_zero_bytes() {
    let mut node = Node::start().await;
    let evicted = evict(&mut node.client, &["absent"]).await;
    assert_eq!(evicted, [pb::EvictedKey { key: "absent".into(), bytes_freed: 0 }]);
    // An empty request is an empty reply.
    assert!(evict(&mut node.client, &[]).await.is_empty());
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_registry_answers_without_crashing() {
    let (server, mut client) = serve(BackendRegistry::new(), PeerServerConfig::default()).await;
    let r = allocate(&mut client, TierType::Dram, "k", 100).await;
    assert_eq!(r.outcome, failed());
    assert!(!resolve(&mut client, "k").await.found);
    let reply = batch_resolve(&mut client, &["a", "b"], false).await;
    let decoded = decode_batch_resolve(&reply).expect("well-formed");
    assert_eq!(decoded.page_size, 0);
    assert_eq!(decoded.keys, [None, None]);
    assert!(!commit(&mut client, 0, "k").await.success);
    assert!(abort(&mut client, 7).await);
    assert_eq!(evict(&mut client, &["k"]).await[0].bytes_freed, 0);
    let info = client.get_peer_info(pb::GetPeerInfoRequest {}).await.expect("GetPeerInfo").into_inner();
    assert!(info.buffer_descs.is_empty());
    assert_eq!(info.page_size, 0);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_server_cannot_bind_the_same_port() {
    let first = PeerServer::start(PeerServerConfig::default(), PeerService::new(Arc::default(), DATA_ENDPOINT))
        .await
        .expect("first server");
    let config = PeerServerConfig { listen: first.local_addr(), ..PeerServerConfig::default() };
    let second = PeerServer::start(config, PeerService::new(Arc::default(), DATA_ENDPOINT)).await;
    match second {
        Err(PeerServiceError::Bind { addr, source }) => {
            assert_eq!(addr, first.local_addr());
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse);
        }
        other => panic!("second bind must fail: {other:?}"),
    }
    first.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_is_required_when_configured() {
    let config = PeerServerConfig { cluster_token: Some("s3cret".into()), ..PeerServerConfig::default() };
    let (server, mut client) = serve(BackendRegistry::new(), config).await;
    let err = client.get_peer_info(pb::GetPeerInfoRequest {}).await.expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated);

    let mut wrong = tonic::Request::new(pb::GetPeerInfoRequest {});
    wrong.metadata_mut().insert(umbp_peer::master_client::TOKEN_METADATA, "nope".parse().expect("ascii"));
    assert_eq!(client.get_peer_info(wrong).await.expect_err("wrong token").code(), Code::Unauthenticated);

    let mut right = tonic::Request::new(pb::GetPeerInfoRequest {});
    right.metadata_mut().insert(umbp_peer::master_client::TOKEN_METADATA, "s3cret".parse().expect("ascii"));
    let info = client.get_peer_info(right).await.expect("right token").into_inner();
    assert_eq!(info.data_endpoint, DATA_ENDPOINT);
    server.shutdown().await;
}

// --- this port's choices and input validation ----------------------------------------------------

/// The reference resolves every key on every medium, leasing a mirrored key everywhere (its §14.6);
/// here only the medium that serves the key is asked, so only it is leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_resolve_leases_only_the_serving_medium() {
    let mut node = Node::start().await;
    put_direct(&node.hbm, "mirrored", 111);
    put_direct(&node.dram, "mirrored", 222);
    put_direct(&node.dram, "dram-only", 50);
    let reply = batch_resolve(&mut node.client, &["mirrored", "dram-only", "absent"], true).await;
    let decoded = decode_batch_resolve(&reply).expect("well-formed");
    assert_eq!(decoded.keys[0].as_ref().map(|k| (k.tier, k.size)), Some((TierType::Hbm, 111)));
    assert_eq!(decoded.keys[1].as_ref().map(|k| (k.tier, k.size)), Some((TierType::Dram, 50)));
    assert_eq!(decoded.keys[2], None);
    // HBM holds a lease on the mirrored key, DRAM does not: only DRAM's copy can be evicted now.
    let evicted = evict(&mut node.client, &["mirrored"]).await;
    assert_eq!(evicted[0].bytes_freed, 222);
    assert_eq!(node.hbm.owned_key_count(), 1);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_resolve_dedups_descs_and_omits_them_on_request() {
    let mut node = Node::start().await;
    for k in ["a", "b", "c"] {
        put_direct(&node.dram, k, 2 * PAGE);
    }
    put_direct(&node.hbm, "h", 10);
    let with = decode_batch_resolve(&batch_resolve(&mut node.client, &["a", "b", "c", "h", "a"], false).await)
        .expect("well-formed");
    assert_eq!(with.keys.iter().flatten().count(), 5);
    // Four DRAM hits and one HBM hit share two buffers: two descriptors, stamped, in (backend, buffer) order.
    let ids: Vec<(u32, u32)> = with.descs.iter().map(|d| (d.backend_id, d.buffer_index)).collect();
    assert_eq!(ids, [(DRAM_ID, 0), (HBM_ID, 0)]);
    let without = decode_batch_resolve(&batch_resolve(&mut node.client, &["a", "b", "c", "h", "a"], true).await)
        .expect("well-formed");
    assert!(without.descs.is_empty());
    assert_eq!(without.keys, with.keys);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_keys_and_zero_sizes_fail_per_entry() {
    let mut node = Node::start().await;
    let entries = vec![
        alloc_req(TierType::Dram, "", 100),
        alloc_req(TierType::Dram, "zero", 0),
        alloc_req(TierType::Dram, "ok", 100),
    ];
    let reply = node
        .client
        .batch_allocate_slots(pb::BatchAllocateSlotsRequest { entries, ..Default::default() })
        .await
        .expect("batch");
    let reply = reply.into_inner().entries;
    let outcomes: Vec<i32> = reply.iter().map(|e| e.outcome).collect();
    assert_eq!(outcomes, [failed(), failed(), allocated()]);
    // An empty key never reaches a medium.
    assert!(!commit(&mut node.client, reply[2].slot_id, "").await.success);
    assert!(commit(&mut node.client, reply[2].slot_id, "ok").await.success);
    assert!(!resolve(&mut node.client, "").await.found);
    let decoded = decode_batch_resolve(&batch_resolve(&mut node.client, &["", "ok"], false).await).expect("ok");
    assert_eq!(decoded.keys[0], None);
    assert!(decoded.keys[1].is_some());
    // ("ok" is leased by the resolve above; evict an unleased key beside the empty one.)
    put_direct(&node.dram, "other", 100);
    let freed: Vec<u64> = evict(&mut node.client, &["", "other"]).await.iter().map(|e| e.bytes_freed).collect();
    assert_eq!(freed, [0, 100]);
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_id_past_56_bits_is_refused_and_released() {
    let inner = mock(TierType::Dram);
    let mut registry = BackendRegistry::new();
    registry.register(Arc::new(HugeSlots(inner.clone()))).expect("register");
    let (server, mut client) = serve(registry, PeerServerConfig::default()).await;
    let r = allocate(&mut client, TierType::Dram, "k", 100).await;
    assert_eq!(outcome_from_wire(r.outcome), umbp_core::AllocateOutcome::Failed);
    assert_eq!(r.slot_id, 0);
    // The service aborted the slot nobody could commit: its pages are free again.
    assert_eq!(inner.pending_slot_count(), 0);
    assert_eq!(inner.capacity().available_bytes, 16 * PAGE);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_clients_each_get_their_own_answers() {
    let node = Node::start().await;
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let mut client = node.client.clone();
        tasks.push(tokio::spawn(async move {
            let tier = if i % 2 == 0 { TierType::Hbm } else { TierType::Dram };
            let key = format!("k{i}");
            let a = allocate(&mut client, tier, &key, 100 + i).await;
            assert_eq!(a.outcome, allocated());
            let c = commit(&mut client, a.slot_id, &key).await;
            assert_eq!((c.success, c.bytes_committed), (true, 100 + i));
            let r = resolve(&mut client, &key).await;
            assert_eq!((r.found, r.size, tier_from_wire(r.tier)), (true, 100 + i, tier));
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!((node.hbm.owned_key_count(), node.dram.owned_key_count()), (8, 8));
    node.server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_page_backends_round_trip_through_the_service() {
    let page = |tier| -> Arc<dyn MediumBackend> {
        let b = PageBackend::new(
            PageBackendConfig::new(tier, PAGE, vec![8 * PAGE]),
            Box::new(HostPageMemorySource::new(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() })),
        )
        .expect("page backend");
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        Arc::new(b)
    };
    let mut registry = BackendRegistry::new();
    registry.register(page(TierType::Hbm)).expect("register");
    registry.register(page(TierType::Dram)).expect("register");
    let (server, mut client) = serve(registry, PeerServerConfig::default()).await;
    let entries = vec![alloc_req(TierType::Dram, "d", 3 * PAGE - 1), alloc_req(TierType::Hbm, "h", PAGE)];
    let a = client
        .batch_allocate_slots(pb::BatchAllocateSlotsRequest { entries, ..Default::default() })
        .await
        .expect("alloc")
        .into_inner();
    assert!(a.entries.iter().all(|e| e.outcome == allocated()));
    let commits = a
        .entries
        .iter()
        .zip(["d", "h"])
        .map(|(e, k)| pb::CommitSlotRequest { slot_id: e.slot_id, key: k.into(), crc32c: None })
        .collect();
    let c = client.batch_commit_slots(pb::BatchCommitSlotsRequest { entries: commits }).await.expect("commit");
    assert!(c.into_inner().entries.iter().all(|c| c.success));
    let decoded = decode_batch_resolve(&batch_resolve(&mut client, &["h", "d", "x"], false).await).expect("ok");
    let h = decoded.keys[0].as_ref().expect("h");
    let d = decoded.keys[1].as_ref().expect("d");
    assert_eq!((h.tier, h.backend_id, h.size), (TierType::Hbm, 0, PAGE));
    assert_eq!((d.tier, d.backend_id, d.size), (TierType::Dram, 1, 3 * PAGE - 1));
    let wire_pages: Vec<(u32, u32)> = a.entries[0].pages.iter().map(|p| (p.buffer_index, p.page_index)).collect();
    let pages: Vec<(u32, u32)> = d.pages.iter().map(|p| (p.buffer_index, p.page_index)).collect();
    assert_eq!(pages, wire_pages);
    assert_eq!(decoded.keys[2], None);
    assert!(decoded.descs.iter().all(|d| d.size == 8 * PAGE));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_serving_within_its_deadline() {
    let config = PeerServerConfig { shutdown_deadline: Duration::from_millis(500), ..PeerServerConfig::default() };
    let (server, mut client) = serve(BackendRegistry::new(), config).await;
    let addr = server.local_addr();
    assert!(!resolve(&mut client, "k").await.found);
    let started = std::time::Instant::now();
    server.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(2), "shutdown took {:?}", started.elapsed());
    // The port is free again and nothing answers on it.
    let fresh = UmbpPeerClient::connect(format!("http://{addr}")).await;
    assert!(fresh.is_err(), "nothing may listen after shutdown");
}

/// A medium whose slot ids do not fit 56 bits: it delegates to a mock and adds 2^56 to every id.
#[derive(Debug)]
struct HugeSlots(Arc<MockBackend>);

const HUGE: u64 = 1 << 56;

impl MetricSource for HugeSlots {}

impl MediumBackend for HugeSlots {
    fn tier(&self) -> TierType {
        self.0.tier()
    }
    fn name(&self) -> &str {
        "HugeSlots"
    }
    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        self.0.init(registrar)
    }
    fn shutdown(&self) {
        self.0.shutdown();
    }
    fn capacity(&self) -> TierCapacity {
        self.0.capacity()
    }
    fn owned_key_count(&self) -> usize {
        self.0.owned_key_count()
    }
    fn drain_pending_events(&self) -> Vec<KvEvent> {
        self.0.drain_pending_events()
    }
    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        self.0.snapshot_owned_keys()
    }
    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        self.0.snapshot_owned_keys_for_full_sync()
    }
    fn clear_local(&self) {
        self.0.clear_local();
    }
    fn clear_full_sync_acked(&self) {
        self.0.clear_full_sync_acked();
    }
    fn is_clear_full_sync_pending(&self) -> bool {
        self.0.is_clear_full_sync_pending()
    }
    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.0.set_auto_flush_hook(threshold, hook);
    }
    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        let mut out = self.0.batch_allocate(requests);
        for r in &mut out {
            r.slot_id += HUGE;
        }
        out
    }
    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        let inner: Vec<CommitRequest> =
            requests.iter().map(|r| CommitRequest::new(r.slot_id.wrapping_sub(HUGE), r.key.clone())).collect();
        self.0.batch_commit(&inner)
    }
    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        let inner: Vec<u64> = slot_ids.iter().map(|id| id.wrapping_sub(HUGE)).collect();
        self.0.batch_abort(&inner)
    }
    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        self.0.batch_resolve(keys, include_descs)
    }
    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        self.0.evict(keys)
    }
    fn page_size(&self) -> u64 {
        self.0.page_size()
    }
    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.0.all_buffer_descs()
    }
    fn buffer_count(&self) -> usize {
        self.0.buffer_count()
    }
    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        self.0.buffer_ref(index)
    }
}
