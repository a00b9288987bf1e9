//! The peer service's busy answer and `ReleaseReads`, over real gRPC on 127.0.0.1:0: a node with an
//! HBM and a DRAM `MockBackend` (leases long enough that only a release can end them).

use std::sync::Arc;
use std::time::Duration;

use tonic::transport::Channel;
use umbp_core::{AllocateRequest, BackendRegistry, CommitRequest, MediumBackend, TierType};
use umbp_peer::peer_service::{PeerServer, PeerServerConfig, PeerServerHandle, PeerService, decode_batch_resolve};
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

const PAGE: u64 = 4096;

type Client = UmbpPeerClient<Channel>;

fn mock(tier: TierType) -> Arc<MockBackend> {
    let m = Arc::new(MockBackend::new(MockConfig {
        tier,
        page_size: PAGE,
        pages: 16,
        read_lease_ttl: Duration::from_secs(600),
        ..MockConfig::default()
    }));
    m.init(Arc::new(LocalOnlyRegistrar::new())).expect("mock init");
    m
}

struct Node {
    hbm: Arc<MockBackend>,
    dram: Arc<MockBackend>,
    _server: PeerServerHandle,
    client: Client,
}

/// DRAM registers first (id 0), HBM second (id 1); HBM is asked first (ascending tier).
const DRAM_ID: u32 = 0;
const HBM_ID: u32 = 1;

async fn start() -> Node {
    let hbm = mock(TierType::Hbm);
    let dram = mock(TierType::Dram);
    let mut registry = BackendRegistry::new();
    assert_eq!(registry.register(dram.clone()).expect("register dram"), DRAM_ID);
    assert_eq!(registry.register(hbm.clone()).expect("register hbm"), HBM_ID);
    let service = PeerService::new(Arc::new(registry), "127.0.0.1:7777");
    let server = PeerServer::start(PeerServerConfig::default(), service).await.expect("start peer server");
    let client = UmbpPeerClient::connect(format!("http://{}", server.local_addr())).await.expect("connect");
    Node { hbm, dram, _server: server, client }
}

fn put(backend: &MockBackend, key: &str) {
    let a = backend.batch_allocate(&[AllocateRequest::new(key, PAGE)]).remove(0);
    assert!(backend.batch_commit(&[CommitRequest::new(a.slot_id, key)])[0].success);
}

async fn batch_resolve(client: &mut Client, keys: &[&str]) -> umbp_peer::peer_service::DecodedResolve {
    let keys = keys.iter().map(|k| k.to_string()).collect();
    let reply = client
        .batch_resolve_keys(pb::BatchResolveKeysRequest { keys, omit_descs: true, ..Default::default() })
        .await
        .expect("BatchResolveKeys")
        .into_inner();
    decode_batch_resolve(&reply).expect("well-formed")
}

async fn release(client: &mut Client, key: &str, lease_id: u64, backend_id: u32) {
    let reads = vec![pb::ReadRelease { key: key.into(), lease_id, backend_id }];
    client.release_reads(pb::ReleaseReadsRequest { reads }).await.expect("ReleaseReads");
}

async fn evicted(client: &mut Client, key: &str) -> u64 {
    let reply = client.evict_key(pb::EvictKeyRequest { keys: vec![key.into()] }).await.expect("EvictKey");
    reply.into_inner().evicted[0].bytes_freed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_medium_is_answered_busy_not_a_miss() {
    let mut node = start().await;
    put(&node.dram, "k");
    node.dram.answer_busy(2);
    let d = batch_resolve(&mut node.client, &["k", "absent"]).await;
    assert_eq!(d.keys, [None, None]);
    assert_eq!(d.busy, [true, false], "the held key is busy, the absent one a miss");
    let one = node.client.resolve_key(pb::ResolveKeyRequest { key: "k".into() }).await.expect("ResolveKey");
    let one = one.into_inner();
    assert!(one.busy && !one.found, "ResolveKey says busy too: {one:?}");
    let d = batch_resolve(&mut node.client, &["k"]).await;
    let hit = d.keys[0].as_ref().expect("served once the medium is no longer busy");
    assert!(hit.lease != 0 && !d.busy[0], "a hit carries its lease and is not busy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_on_one_medium_gives_way_to_a_hit_on_another() {
    let mut node = start().await;
    put(&node.hbm, "k");
    put(&node.dram, "k");
    node.hbm.answer_busy(1);
    let d = batch_resolve(&mut node.client, &["k"]).await;
    let hit = d.keys[0].as_ref().expect("DRAM serves what HBM cannot now");
    assert_eq!((hit.backend_id, d.busy[0]), (DRAM_ID, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_reads_ends_the_lease_on_the_medium_that_served_the_hit() {
    let mut node = start().await;
    put(&node.dram, "k");
    let d = batch_resolve(&mut node.client, &["k"]).await;
    let lease = d.keys[0].as_ref().expect("hit").lease;
    assert_eq!(evicted(&mut node.client, "k").await, 0, "leased for 600 s");
    // A release naming another medium, or another lease, ends nothing.
    release(&mut node.client, "k", lease, HBM_ID).await;
    release(&mut node.client, "k", lease + 1, DRAM_ID).await;
    assert_eq!(evicted(&mut node.client, "k").await, 0, "still leased");
    assert_eq!(node.dram.calls().release_reads, 1, "only the DRAM-addressed release reached DRAM");
    release(&mut node.client, "k", lease, DRAM_ID).await;
    assert_eq!(evicted(&mut node.client, "k").await, PAGE, "the released key is evictable at once");
    // An empty release is an empty answer, not an error.
    node.client.release_reads(pb::ReleaseReadsRequest { reads: Vec::new() }).await.expect("empty release");
}
