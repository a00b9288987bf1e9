//! Ranged resolves over the wire (issue 21): the peer service hands a request's per-key ranges to
//! the medium's `batch_resolve_ranges` and answers its partial hits; a request without ranges (an
//! older client's) or with malformed ones asks for whole values; the peer client refuses a partial
//! hit for a key it asked for whole.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use umbp_core::{
    AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BackendRegistry, BufferDesc, CommitRequest,
    CommitResult, EvictResult, KvEvent, MediumBackend, MemoryRegistrar, MetricSource, ReadRelease, ResolvedEntry,
    TierCapacity, TierType, TransferRef, covering_pages,
};
use umbp_peer::PeerClientError;
use umbp_peer::peer_client::{PeerClientConfig, Peers};
use umbp_peer::peer_service::{PeerServer, PeerServerConfig, PeerServerHandle, PeerService};
use umbp_proto::WireError;
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

const PAGE: u64 = 4096;

/// A memory medium that answers ranged resolves partially, as a staged medium would: the pages
/// the ranges span. It records what it was asked; `rogue` makes it answer partially even for keys
/// asked whole.
#[derive(Debug)]
struct Parts {
    inner: MockBackend,
    asked: Mutex<Vec<Vec<(u64, u64)>>>,
    rogue: bool,
}

impl MetricSource for Parts {}

impl MediumBackend for Parts {
    fn tier(&self) -> TierType {
        self.inner.tier()
    }
    fn name(&self) -> &str {
        "Parts"
    }
    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        self.inner.init(registrar)
    }
    fn shutdown(&self) {
        self.inner.shutdown();
    }
    fn capacity(&self) -> TierCapacity {
        self.inner.capacity()
    }
    fn owned_key_count(&self) -> usize {
        self.inner.owned_key_count()
    }
    fn drain_pending_events(&self) -> Vec<KvEvent> {
        self.inner.drain_pending_events()
    }
    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        self.inner.snapshot_owned_keys()
    }
    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        self.inner.snapshot_owned_keys_for_full_sync()
    }
    fn clear_local(&self) {
        self.inner.clear_local();
    }
    fn clear_full_sync_acked(&self) {
        self.inner.clear_full_sync_acked();
    }
    fn is_clear_full_sync_pending(&self) -> bool {
        self.inner.is_clear_full_sync_pending()
    }
    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.inner.set_auto_flush_hook(threshold, hook);
    }
    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        self.inner.batch_allocate(requests)
    }
    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        self.inner.batch_commit(requests)
    }
    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        self.inner.batch_abort(slot_ids)
    }
    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        if self.rogue {
            return self.batch_resolve_ranges(keys, &[], include_descs);
        }
        self.inner.batch_resolve(keys, include_descs)
    }
    fn batch_resolve_ranges(
        &self,
        keys: &[String],
        ranges: &[Vec<(u64, u64)>],
        include_descs: bool,
    ) -> Vec<ResolvedEntry> {
        self.asked.lock().push(ranges.iter().flatten().copied().collect());
        let mut entries = self.inner.batch_resolve(keys, include_descs);
        for (i, e) in entries.iter_mut().enumerate().filter(|(_, e)| e.found) {
            let asked = ranges.get(i).map_or(&[][..], Vec::as_slice);
            let span = if self.rogue && asked.is_empty() { Some((1, 1)) } else { covering_pages(asked, e.size, PAGE) };
            if let Some((first, count)) = span {
                e.pages = e.pages[first as usize..(first + count) as usize].to_vec();
                e.first_page = first;
                e.partial = true;
            }
        }
        entries
    }
    fn release_reads(&self, reads: &[ReadRelease]) {
        self.inner.release_reads(reads);
    }
    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        self.inner.evict(keys)
    }
    fn page_size(&self) -> u64 {
        self.inner.page_size()
    }
    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.inner.all_buffer_descs()
    }
    fn buffer_count(&self) -> usize {
        self.inner.buffer_count()
    }
    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        self.inner.buffer_ref(index)
    }
}

/// A node whose one medium holds `a` and `b`, 4 pages each.
async fn node(rogue: bool) -> (Arc<Parts>, PeerServerHandle) {
    let config = MockConfig {
        tier: TierType::Dram,
        page_size: PAGE,
        pages: 16,
        read_lease_ttl: Duration::from_secs(60),
        ..MockConfig::default()
    };
    let medium = Arc::new(Parts { inner: MockBackend::new(config), asked: Mutex::default(), rogue });
    medium.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    for key in ["a", "b"] {
        let a = medium.batch_allocate(&[AllocateRequest::new(key, 4 * PAGE)]).remove(0);
        assert!(medium.batch_commit(&[CommitRequest::new(a.slot_id, key)])[0].success);
    }
    let mut registry = BackendRegistry::new();
    registry.register(medium.clone()).expect("register");
    let service = PeerService::new(Arc::new(registry), "127.0.0.1:7777");
    let server = PeerServer::start(PeerServerConfig::default(), service).await.expect("peer server");
    (medium, server)
}

async fn peer(server: &PeerServerHandle) -> umbp_peer::PeerClient {
    let peers = Peers::new(PeerClientConfig {
        timeout: Duration::from_secs(5),
        token: None,
        unreachable_for: Duration::from_secs(1),
    })
    .expect("peers");
    peers.connect("node", &server.local_addr().to_string()).await.expect("connect").0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_reach_the_medium_and_partial_hits_come_back() {
    let (medium, server) = node(false).await;
    let client = peer(&server).await;
    let keys = vec!["a".to_owned(), "b".to_owned(), "absent".to_owned()];
    let ranges = vec![vec![(PAGE + 10, 20), (2 * PAGE + 1, 5)], Vec::new(), vec![(0, 1)]];
    let d = client.resolve_ranges(keys.clone(), &ranges, false).await.expect("resolve");
    assert_eq!(
        medium.asked.lock().as_slice(),
        [vec![(PAGE + 10, 20), (2 * PAGE + 1, 5), (0, 1)]],
        "the ranges arrived"
    );
    let a = d.keys[0].as_ref().expect("a hit");
    assert!(a.partial && a.first_page == 1 && a.pages.len() == 2, "{a:?}");
    let b = d.keys[1].as_ref().expect("b hit");
    assert!(!b.partial && b.first_page == 0 && b.pages.len() == 4, "a key without ranges is whole: {b:?}");
    assert!(d.keys[2].is_none());
    // Without ranges (what an older client sends) the medium is asked for whole values.
    medium.asked.lock().clear();
    let d = client.resolve(keys.clone(), true).await.expect("resolve");
    assert!(medium.asked.lock().is_empty(), "no ranged resolve");
    assert!(d.keys[0].as_ref().is_some_and(|k| !k.partial && k.pages.len() == 4));
    // Malformed ranges read as none: whole values.
    let mut grpc = UmbpPeerClient::connect(format!("http://{}", server.local_addr())).await.expect("connect");
    let request = pb::BatchResolveKeysRequest {
        keys,
        omit_descs: true,
        range_count: vec![1, 0],
        range_offset: vec![PAGE],
        range_length: vec![1],
    };
    let reply = grpc.batch_resolve_keys(request).await.expect("rpc").into_inner();
    assert!(reply.partial.is_empty() && medium.asked.lock().is_empty(), "{reply:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_hit_for_a_key_asked_whole_is_refused() {
    let (_medium, server) = node(true).await;
    let client = peer(&server).await;
    let err = client.resolve(vec!["a".to_owned()], true).await.expect_err("a part of a whole read");
    assert!(
        matches!(err, PeerClientError::Malformed { source: WireError::BadPartial { key_index: 0, .. }, .. }),
        "{err:?}"
    );
    // Asked with ranges, the same answer is what the reader wanted.
    let d = client.resolve_ranges(vec!["a".to_owned()], &[vec![(PAGE, 1)]], true).await.expect("resolve");
    assert!(d.keys[0].as_ref().is_some_and(|k| k.partial));
    server.shutdown().await;
}
