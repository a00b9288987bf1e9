//! The eviction manager against fake peers over real gRPC: LRU victims, protected keys (0 bytes
//! freed) refunded and skipped, `EvictKey` split by count and sent to nodes concurrently, and a
//! shutdown bounded even while a peer hangs.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use umbp_master::routing::EvictionConfig;
use umbp_master::{MasterConfig, MasterHandle};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;
use umbp_proto::v1::umbp_peer_server::{UmbpPeer, UmbpPeerServer};

const DRAM: i32 = v1::TierType::TierDram as i32;

/// A peer that records every `EvictKey` request; frees each key's `value_bytes` (100 by default)
/// unless protected; can answer late or never.
#[derive(Debug, Clone)]
struct FakePeer {
    requests: Arc<Mutex<Vec<Vec<String>>>>,
    protect: Arc<HashSet<String>>,
    delay: Duration,
    hang: bool,
    value_bytes: u64,
}

impl Default for FakePeer {
    fn default() -> Self {
        Self { requests: Arc::default(), protect: Arc::default(), delay: Duration::ZERO, hang: false, value_bytes: 100 }
    }
}

impl FakePeer {
    fn asked(&self) -> Vec<String> {
        self.requests.lock().iter().flatten().cloned().collect()
    }
}

#[tonic::async_trait]
impl UmbpPeer for FakePeer {
    async fn release_reads(
        &self,
        _: Request<v1::ReleaseReadsRequest>,
    ) -> Result<Response<v1::ReleaseReadsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_peer_info(
        &self,
        _: Request<v1::GetPeerInfoRequest>,
    ) -> Result<Response<v1::GetPeerInfoResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn allocate_slot(
        &self,
        _: Request<v1::AllocateSlotRequest>,
    ) -> Result<Response<v1::AllocateSlotResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_allocate_slots(
        &self,
        _: Request<v1::BatchAllocateSlotsRequest>,
    ) -> Result<Response<v1::BatchAllocateSlotsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn commit_slot(&self, _: Request<v1::CommitSlotRequest>) -> Result<Response<v1::CommitSlotResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_commit_slots(
        &self,
        _: Request<v1::BatchCommitSlotsRequest>,
    ) -> Result<Response<v1::BatchCommitSlotsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn abort_slot(&self, _: Request<v1::AbortSlotRequest>) -> Result<Response<v1::AbortSlotResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_abort_slots(
        &self,
        _: Request<v1::BatchAbortSlotsRequest>,
    ) -> Result<Response<v1::BatchAbortSlotsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn resolve_key(&self, _: Request<v1::ResolveKeyRequest>) -> Result<Response<v1::ResolveKeyResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn batch_resolve_keys(
        &self,
        _: Request<v1::BatchResolveKeysRequest>,
    ) -> Result<Response<v1::BatchResolveKeysResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn evict_key(&self, r: Request<v1::EvictKeyRequest>) -> Result<Response<v1::EvictKeyResponse>, Status> {
        let keys = r.into_inner().keys;
        self.requests.lock().push(keys.clone());
        if self.hang {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(self.delay).await;
        let evicted = keys
            .into_iter()
            .map(|key| {
                let bytes_freed = if self.protect.contains(&key) { 0 } else { self.value_bytes };
                v1::EvictedKey { key, bytes_freed }
            })
            .collect();
        Ok(Response::new(v1::EvictKeyResponse { evicted }))
    }
}

async fn serve(peer: FakePeer) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let server = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(UmbpPeerServer::new(peer))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
    });
    (addr, server)
}

/// Rounds only when the test asks (the background loop waits an hour).
fn config(evict_deadline: Duration) -> MasterConfig {
    MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        eviction: EvictionConfig {
            check_interval: Duration::from_secs(3600),
            lease_duration: Duration::from_millis(1),
            evict_deadline,
            ..EvictionConfig::default()
        },
        ..MasterConfig::default()
    }
}

async fn master(config: MasterConfig) -> (MasterHandle, UmbpMasterClient<Channel>) {
    let handle = umbp_master::start(config).await.expect("master starts");
    let client = UmbpMasterClient::connect(format!("http://{}", handle.local_addr())).await.expect("connect");
    (handle, client)
}

/// Registers `node` at `peer` holding `keys` (`size` bytes each) on a DRAM tier of `total` bytes with
/// `available` free.
async fn node_with_keys(
    c: &mut UmbpMasterClient<Channel>,
    node: &str,
    peer: &str,
    keys: &[String],
    size: u64,
    total: u64,
    available: u64,
) {
    let cap = v1::TierCapacity { tier: DRAM, total_bytes: total, available_bytes: available, page_size: 0 };
    node_with_cap(c, node, peer, keys, size, cap).await;
}

/// Registers `node` at `peer` holding `keys` (`size` bytes each) on the DRAM medium `cap`.
async fn node_with_cap(
    c: &mut UmbpMasterClient<Channel>,
    node: &str,
    peer: &str,
    keys: &[String],
    size: u64,
    cap: v1::TierCapacity,
) {
    let caps = vec![cap];
    c.register_client(v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        tier_capacities: caps.clone(),
        peer_address: peer.into(),
        data_endpoint: "127.0.0.1:1".into(),
        tags: vec![],
        incarnation: 0,
    })
    .await
    .expect("register");
    let events = keys
        .iter()
        .map(|k| v1::KvEvent { kind: v1::KvEventKind::KvEventAdd as i32, key: k.clone(), tier: DRAM, size })
        .collect();
    c.heartbeat(v1::HeartbeatRequest {
        node_id: node.into(),
        bundles: vec![v1::EventBundle { seq: 1, events }],
        tier_capacities: caps,
        ..Default::default()
    })
    .await
    .expect("hb");
}

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// 10 keys of 100 bytes on a 1000-byte tier that is 95 % used: evict down to 70 % = 250 bytes. k0..k6
/// are touched, so k7, k8, k9 are the least recently used.
async fn pressured_node(c: &mut UmbpMasterClient<Channel>, peer: &str) {
    node_with_keys(c, "n1", peer, &keys("k", 10), 100, 1000, 50).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    c.batch_route_get(v1::BatchRouteGetRequest { node_id: "r".into(), keys: keys("k", 7), exclude_nodes: vec![] })
        .await
        .expect("touch");
    tokio::time::sleep(Duration::from_millis(5)).await;
}

#[tokio::test]
async fn eviction_asks_the_pressured_node_for_its_least_recently_used_keys() {
    let peer = FakePeer::default();
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    pressured_node(&mut c, &addr).await;
    let report = m.run_eviction_round().await;
    let mut asked = report.requested.clone();
    asked.sort();
    assert_eq!(asked, vec!["k7", "k8", "k9"]);
    assert_eq!(report.bytes_freed, 300);
    assert!(report.refused.is_empty());
    assert_eq!(peer.asked().len(), 3);
    assert_eq!(m.stats().eviction_rounds, 1);
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn protected_keys_are_refunded_and_skipped_in_the_next_rounds() {
    // The peer protects the two oldest keys (leased or pinned there): it frees 0 bytes for them.
    let peer = FakePeer { protect: Arc::new(["k7".to_owned(), "k8".to_owned()].into()), ..FakePeer::default() };
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    pressured_node(&mut c, &addr).await;

    let first = m.run_eviction_round().await;
    // The same round continues down the LRU list with the 200 bytes k7 and k8 did not free.
    assert_eq!(first.requested, vec!["k7", "k8", "k9", "k0", "k1"], "{first:?}");
    assert_eq!(first.refused, vec!["k7", "k8"]);
    assert_eq!(first.bytes_freed, 300);

    // The 300 bytes the peer confirmed are credited to the node's recorded capacity at once (65 %
    // used): the next round sees no pressure and evicts nothing more before the node reports again.
    let second = m.run_eviction_round().await;
    assert!(!second.pressure && second.requested.is_empty(), "{second:?}");
    // The peer sent no REMOVEs (it is a fake) and reports the old pressure again: the next round must
    // spend its budget neither on the protected keys nor on the ones already evicted (their REMOVEs
    // are on the way), but on the next-oldest.
    let caps = vec![v1::TierCapacity { tier: DRAM, total_bytes: 1000, available_bytes: 50, page_size: 0 }];
    c.heartbeat(v1::HeartbeatRequest { node_id: "n1".into(), tier_capacities: caps, ..Default::default() })
        .await
        .expect("keepalive");
    let third = m.run_eviction_round().await;
    assert_eq!(third.requested, vec!["k2", "k3", "k4"], "{third:?}");
    assert_eq!(m.stats().evict_refused, 2);
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn evict_requests_are_split_by_count() {
    let peer = FakePeer::default();
    let (addr, server) = serve(peer.clone()).await;
    let mut cfg = config(Duration::from_secs(5));
    cfg.eviction.high_watermark = 0.2;
    cfg.eviction.low_watermark = 0.1;
    let (m, mut c) = master(cfg).await;
    // 5000 one-byte keys on a full 10 000-byte tier: the budget (9000 bytes) takes all of them.
    node_with_keys(&mut c, "n1", &addr, &keys("key-", 5000), 1, 10_000, 0).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let report = m.run_eviction_round().await;
    assert_eq!(report.requested.len(), 5000);
    let sizes: Vec<usize> = peer.requests.lock().iter().map(Vec::len).collect();
    assert_eq!(sizes, vec![4096, 904], "at most 4096 keys per EvictKey");
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn nodes_are_asked_concurrently() {
    let slow = Duration::from_millis(400);
    let (p1, p2) = (FakePeer { delay: slow, ..FakePeer::default() }, FakePeer { delay: slow, ..FakePeer::default() });
    let (a1, s1) = serve(p1.clone()).await;
    let (a2, s2) = serve(p2.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(5))).await;
    node_with_keys(&mut c, "n1", &a1, &keys("a", 10), 100, 1000, 50).await;
    node_with_keys(&mut c, "n2", &a2, &keys("b", 10), 100, 1000, 50).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let started = Instant::now();
    let report = m.run_eviction_round().await;
    let took = started.elapsed();
    assert_eq!(report.requested.len(), 6);
    assert!(took < slow * 2 - Duration::from_millis(100), "two 400 ms peers took {took:?}: asked one at a time");
    m.shutdown().await;
    s1.abort();
    s2.abort();
}

#[tokio::test]
async fn shutdown_is_bounded_while_a_peer_hangs_in_an_eviction_round() {
    let peer = FakePeer { hang: true, ..FakePeer::default() };
    let (addr, server) = serve(peer.clone()).await;
    let mut cfg = config(Duration::from_secs(60));
    cfg.eviction.check_interval = Duration::from_millis(20);
    cfg.shutdown_deadline = Duration::from_millis(300);
    let (m, mut c) = master(cfg).await;
    pressured_node(&mut c, &addr).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while peer.requests.lock().is_empty() {
        assert!(Instant::now() < deadline, "no EvictKey arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The round is now stuck in a call with a 60 s deadline.
    let started = Instant::now();
    m.shutdown().await;
    let took = started.elapsed();
    assert!(took < Duration::from_millis(300 + 700), "shutdown took {took:?}");
    server.abort();
}

async fn route_put(c: &mut UmbpMasterClient<Channel>, key: &str, size: u64) -> v1::RoutePutEntry {
    let reply = c
        .batch_route_put(v1::BatchRoutePutRequest {
            node_id: "writer".into(),
            keys: vec![key.into()],
            block_sizes: vec![size],
            exclude_nodes: vec![],
            columnar: false,
        })
        .await
        .expect("route put")
        .into_inner();
    reply.entries.into_iter().next().expect("one entry")
}

#[tokio::test]
async fn a_put_that_finds_no_room_evicts_on_demand_before_it_is_answered() {
    let peer = FakePeer::default();
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    // Full: 10 keys of 100 bytes, nothing free; no background round will come (an hour away).
    node_with_keys(&mut c, "n1", &addr, &keys("k", 10), 100, 1000, 0).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let entry = route_put(&mut c, "new", 100).await;
    assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutRouted as i32, "{entry:?}");
    assert_eq!(entry.node_id, "n1");
    // The least recently used keys went first, down to the low watermark (300 bytes).
    let mut asked = peer.asked();
    asked.sort();
    assert_eq!(asked, vec!["k0", "k1", "k2"]);
    let stats = m.stats();
    assert_eq!((stats.on_demand_evictions, stats.eviction_rounds, stats.evict_bytes_freed), (1, 0, 300));
    // A key larger than any medium makes no one evict anything.
    let huge = route_put(&mut c, "huge", 5000).await;
    assert_eq!(huge.outcome, v1::RoutePutOutcome::RoutePutUnavailable as i32);
    assert_eq!(peer.asked().len(), 3);
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn concurrent_puts_into_a_full_pool_do_not_stampede() {
    let peer = FakePeer { delay: Duration::from_millis(50), ..FakePeer::default() };
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(2))).await;
    node_with_keys(&mut c, "n1", &addr, &keys("k", 10), 100, 1000, 0).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    // Six writers find the pool full at once; one eviction (300 bytes) makes room for all of them.
    let writers: Vec<_> = (0..6)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move { route_put(&mut c, &format!("w{i}"), 50).await })
        })
        .collect();
    for w in writers {
        let entry = w.await.expect("writer");
        assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutRouted as i32, "{entry:?}");
    }
    // One on-demand eviction, plus at most one relief round queued behind it (the six routes took
    // the medium back to full); six evictions would be a stampede.
    let requests = peer.requests.lock().len();
    assert!((1..=2).contains(&requests), "{requests} EvictKey requests for six concurrent puts");
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn a_put_that_takes_a_medium_past_the_high_watermark_evicts_soon() {
    let peer = FakePeer::default();
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    // 85 % used, below the 90 % high watermark: no pressure yet.
    node_with_keys(&mut c, "n1", &addr, &keys("k", 10), 100, 1000, 150).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert!(!m.run_eviction_round().await.pressure);
    let entry = route_put(&mut c, "new", 100).await;
    assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutRouted as i32);
    // The route took it to 95 %: a relief eviction down to 70 % follows at once, not at the next
    // background round (an hour away).
    let deadline = Instant::now() + Duration::from_secs(10);
    while peer.asked().len() < 3 {
        assert!(Instant::now() < deadline, "no relief eviction: {:?}", peer.asked());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut asked = peer.asked();
    asked.sort();
    assert_eq!(asked, vec!["k0", "k1", "k2"]);
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn a_put_is_answered_even_when_the_peer_hangs_in_an_on_demand_eviction() {
    let peer = FakePeer { hang: true, ..FakePeer::default() };
    let (addr, server) = serve(peer.clone()).await;
    // The EvictKey deadline alone would hold the put for a minute.
    let (m, mut c) = master(config(Duration::from_secs(60))).await;
    node_with_keys(&mut c, "n1", &addr, &keys("k", 10), 100, 1000, 0).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let answered = tokio::time::timeout(Duration::from_secs(20), route_put(&mut c, "new", 100)).await;
    let entry = answered.expect("the route is answered within the on-demand budget, not the EvictKey deadline");
    assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutUnavailable as i32, "no room was made");
    assert_eq!(peer.requests.lock().len(), 1, "the eviction was tried");
    server.abort();
    drop(m);
}

/// The chaos run's SSD medium: 64 KiB pages, values of 24 KiB (one page each).
const PAGE: u64 = 64 << 10;
const VALUE: u64 = 24 << 10;

/// `node`'s medium of 1000 pages holding `held` one-page keys (`prefix`0…), with the free pages it
/// reports.
async fn paged_node(
    c: &mut UmbpMasterClient<Channel>,
    node: &str,
    peer: &str,
    prefix: &str,
    held: usize,
    free_pages: u64,
) {
    let cap =
        v1::TierCapacity { tier: DRAM, total_bytes: 1000 * PAGE, available_bytes: free_pages * PAGE, page_size: PAGE };
    node_with_cap(c, node, peer, &keys(prefix, held), VALUE, cap).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
}

#[tokio::test]
async fn a_round_on_a_paged_medium_evicts_the_pages_it_needs_not_page_over_value_times_more() {
    let peer = FakePeer { value_bytes: VALUE, ..FakePeer::default() };
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    // 950 of 1000 pages used (95 %): back to 70 % is 250 pages, 250 keys. Charging each key its 24 KiB
    // instead of its page evicted ceil(250 × 64 / 24) = 667.
    paged_node(&mut c, "n1", &addr, "k", 950, 50).await;
    let report = m.run_eviction_round().await;
    let evicted = report.requested.len();
    assert!((250..=251).contains(&evicted), "{evicted} keys evicted for 250 pages");
    assert_eq!(report.bytes_freed, evicted as u64 * VALUE, "the peer reports value bytes");
    assert_eq!(report.capacity_freed, evicted as u64 * PAGE, "the medium got pages back");
    // The credit is in pages too: the node's record shows the 300 free pages at once (crediting the
    // value bytes would show about 144) until its next report.
    let status = c.get_cluster_status(v1::GetClusterStatusRequest {}).await.expect("status").into_inner();
    let cap = &status.nodes[0].tier_capacities[0];
    assert_eq!((cap.available_bytes, cap.page_size), ((50 + evicted as u64) * PAGE, PAGE));
    assert!(!m.run_eviction_round().await.pressure);
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn an_on_demand_eviction_on_a_paged_medium_evicts_the_pages_it_needs() {
    let peer = FakePeer { value_bytes: VALUE, ..FakePeer::default() };
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    // Full: a put finds no room, and the on-demand eviction goes down to the low watermark, 300
    // pages (it evicted 800 keys when it spent value bytes).
    paged_node(&mut c, "n1", &addr, "k", 1000, 0).await;
    let entry = route_put(&mut c, "new", VALUE).await;
    assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutRouted as i32, "{entry:?}");
    let evicted = peer.asked().len();
    assert!((300..=301).contains(&evicted), "{evicted} keys evicted for 300 pages");
    assert_eq!(m.stats().on_demand_evictions, 1);
    m.shutdown().await;
    server.abort();
}

#[tokio::test]
async fn an_on_demand_eviction_stops_at_the_medium_whose_freed_pages_cover_the_key() {
    let (first, second) = (
        FakePeer { value_bytes: VALUE, ..FakePeer::default() },
        FakePeer { value_bytes: VALUE, ..FakePeer::default() },
    );
    let (first_addr, first_server) = serve(first.clone()).await;
    let (second_addr, second_server) = serve(second.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    paged_node(&mut c, "n1", &first_addr, "a", 1000, 0).await;
    paged_node(&mut c, "n2", &second_addr, "b", 1000, 0).await;
    // A 400-page key: more than the low watermark's 300 pages, so one medium frees 400 pages (400 keys,
    // 150 pages' worth of value bytes). Judged by the value bytes, the first medium would fall short
    // and the second would be evicted as well.
    let entry = route_put(&mut c, "big", 400 * PAGE).await;
    assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutRouted as i32, "{entry:?}");
    // (The route takes that medium past the high watermark again, so a relief eviction of 300 more
    // keys may follow there; never on the other medium.)
    let asked = [first.asked().len(), second.asked().len()];
    assert!(asked.contains(&0) && asked.iter().any(|&n| n >= 400), "keys evicted per node: {asked:?}");
    m.shutdown().await;
    first_server.abort();
    second_server.abort();
}

#[tokio::test]
async fn a_routed_put_reserves_its_pages() {
    let peer = FakePeer { value_bytes: VALUE, ..FakePeer::default() };
    let (addr, server) = serve(peer.clone()).await;
    let (m, mut c) = master(config(Duration::from_secs(1))).await;
    // 101 free pages of 1000: just below the high watermark.
    paged_node(&mut c, "n1", &addr, "k", 899, 101).await;
    let entry = route_put(&mut c, "new", VALUE).await;
    assert_eq!(entry.outcome, v1::RoutePutOutcome::RoutePutRouted as i32, "{entry:?}");
    // The route reserved the key's page (debiting its 24 KiB would leave 100.6 pages and no pressure):
    // the medium is at the high watermark, and a relief eviction brings it back to the low one.
    let deadline = Instant::now() + Duration::from_secs(10);
    while peer.asked().len() < 200 {
        assert!(Instant::now() < deadline, "no relief eviction: {} keys asked", peer.asked().len());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(peer.asked().len(), 200, "900 pages used, 700 kept");
    m.shutdown().await;
    server.abort();
}
