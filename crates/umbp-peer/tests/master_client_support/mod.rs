//! A fake `UMBPMaster` for the master-client tests: a tonic server on 127.0.0.1:0 that records every
//! request, answers from the master's own store (`InMemoryStore`) behind the master's reply mapping,
//! and lets each test script the replies (fail, UNKNOWN, request_full_sync, a given reply,
//! apply-then-delay, hang).

#![expect(dead_code, reason = "each test binary uses a different subset of the helpers")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tonic::{Request, Response, Status};
use umbp_core::{AllocateOutcome, AllocateRequest, BackendRegistry, CommitRequest, KvEvent, MediumBackend, TierType};
use umbp_master::store::{
    HeartbeatApply, HeartbeatKind, HeartbeatOutcome, InMemoryStore, MetadataStore, RegisterOutcome, Registration,
    TierCap,
};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_peer::master_client::{MasterClient, MasterClientConfig, NodeRegistration};
use umbp_proto::convert::{tier_from_wire, tier_to_wire};
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_master_server::{UmbpMaster, UmbpMasterServer};

/// What the fake does with one request.
#[derive(Debug, Clone)]
pub(crate) enum Action {
    /// Apply it as the fixed master would and answer.
    Normal,
    /// Answer with this error status and change nothing.
    Fail(tonic::Code),
    /// Answer `NODE_STATUS_UNKNOWN` and change nothing.
    Unknown,
    /// Answer ALIVE with `request_full_sync` and change nothing.
    RequestFullSync,
    /// Apply it, then wait this long before answering (a lost ack once the client's deadline passes).
    ApplyThenDelay(Duration),
    /// Wait this long, then apply and answer.
    DelayThenApply(Duration),
    /// Answer exactly this and change nothing.
    Reply(pb::HeartbeatResponse),
    /// Never answer.
    Hang,
}

type HeartbeatScript = Box<dyn FnMut(&pb::HeartbeatRequest) -> Action + Send>;
type RegisterScript = Box<dyn FnMut(&pb::RegisterClientRequest) -> Action + Send>;

/// The fixed master's view, delegated to the real store (`umbp_master::store::InMemoryStore`), so the
/// fake answers exactly as the master's store does (chunked full sync, stale baselines answered
/// AlreadyApplied, a duplicate ADD overwriting the size, registration wiping the node's locations).
/// Only the reply mapping of the master's gRPC handler is repeated here, with counters.
#[derive(Debug, Default)]
pub(crate) struct Model {
    store: InMemoryStore,
    /// Full syncs whose final chunk the store accepted.
    pub(crate) full_syncs_applied: u64,
    /// Delta bundles answered AlreadyApplied (a re-send).
    pub(crate) reacked_bundles: u64,
    /// Full-sync chunks answered AlreadyApplied (a stale baseline: nothing applied).
    pub(crate) stale_sync_chunks: u64,
    /// Heartbeats answered with `request_full_sync`.
    pub(crate) seq_gaps: u64,
}

/// Wall-clock milliseconds, as the master stamps heartbeats.
fn now_ms() -> u64 {
    u64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis())).unwrap_or(u64::MAX)
}

fn caps_from_wire(caps: &[pb::TierCapacity]) -> Vec<TierCap> {
    caps.iter().map(|c| TierCap::new(tier_from_wire(c.tier), c.total_bytes, c.available_bytes)).collect()
}

fn events_from_wire(events: impl IntoIterator<Item = pb::KvEvent>) -> Vec<KvEvent> {
    events.into_iter().filter_map(|e| KvEvent::try_from(e).ok()).collect()
}

/// How long a registration stays fresh (a second registration of a fresh node is ALREADY_EXISTS).
const STALE_AFTER_MS: u64 = 30_000;

impl Model {
    /// The store behind the fake (to seed or rebuild a node's state behind the client's back).
    pub(crate) fn store(&self) -> &InMemoryStore {
        &self.store
    }

    /// Whether `node-a` has an ALIVE record.
    pub(crate) fn registered(&self) -> bool {
        self.store.is_alive(NODE).expect("store")
    }

    /// `node-a`'s last applied seq (0 without a record).
    pub(crate) fn last_applied(&self) -> u64 {
        self.store.get_node(NODE).expect("store").map_or(0, |r| r.last_applied_seq)
    }

    /// `node-a`'s locations: (key, wire tier) -> size.
    pub(crate) fn index(&self) -> BTreeMap<(String, i32), u64> {
        let buckets: Vec<(String, TierType)> = TierType::ALL.iter().map(|t| (NODE.to_owned(), *t)).collect();
        self.store
            .enumerate_eviction_candidates(&buckets, 0, 0)
            .expect("store")
            .into_iter()
            .map(|c| ((c.key.to_string(), tier_to_wire(c.tier)), c.size))
            .collect()
    }

    /// The keys the model indexes, with their tiers.
    pub(crate) fn keys(&self) -> Vec<(String, i32)> {
        self.index().into_keys().collect()
    }

    /// The master loses the node's state without telling it (a rebuilt store): the record is
    /// replaced by a fresh one at seq 0 with no locations; the node is never answered UNKNOWN.
    pub(crate) fn rebuild_node(&self) {
        let rec = self.store.get_node(NODE).expect("store").expect("node-a is registered");
        self.store.unregister(NODE).expect("store");
        let reg = Registration {
            node_id: NODE.into(),
            node_address: rec.node_address.clone(),
            peer_address: rec.peer_address.to_string(),
            data_endpoint: rec.data_endpoint.to_string(),
            tier_capacities: rec.caps.clone(),
            tags: rec.tags.clone(),
            incarnation: rec.incarnation,
        };
        assert_eq!(self.store.register(reg, now_ms(), STALE_AFTER_MS).expect("store"), RegisterOutcome::Registered);
    }

    /// Moves `node-a`'s applied seq up to `to` with empty deltas, as a record left by an earlier
    /// incarnation of the node would stand.
    pub(crate) fn advance_stream_to(&self, to: u64) {
        for seq in self.last_applied() + 1..=to {
            let hb = HeartbeatApply {
                node_id: NODE.into(),
                now_ms: now_ms(),
                caps: Vec::new(),
                kind: HeartbeatKind::Delta { seq, events: Vec::new() },
                incarnation: 0,
            };
            assert_eq!(self.store.apply_heartbeat(hb).expect("store"), HeartbeatOutcome::Applied { acked_seq: seq });
        }
    }

    fn register(&self, r: &pb::RegisterClientRequest) -> Result<(), Status> {
        let reg = Registration {
            node_id: r.node_id.clone(),
            node_address: r.node_address.clone(),
            peer_address: r.peer_address.clone(),
            data_endpoint: r.data_endpoint.clone(),
            tier_capacities: caps_from_wire(&r.tier_capacities),
            tags: r.tags.clone(),
            incarnation: r.incarnation,
        };
        match self.store.register(reg, now_ms(), STALE_AFTER_MS) {
            Ok(RegisterOutcome::Registered | RegisterOutcome::Replaced { .. }) => Ok(()),
            Ok(RegisterOutcome::AlreadyExists) => Err(Status::already_exists("node is registered and alive")),
            Ok(RegisterOutcome::Superseded { .. }) => Err(Status::failed_precondition("superseded")),
            Err(e) => Err(Status::invalid_argument(e.to_string())),
        }
    }

    /// The master's heartbeat handler over the store.
    fn heartbeat(&mut self, r: &pb::HeartbeatRequest) -> pb::HeartbeatResponse {
        let alive = |acked_seq, request_full_sync| pb::HeartbeatResponse {
            status: pb::NodeStatus::Alive as i32,
            acked_seq,
            request_full_sync,
            local_puts: false,
            superseded: false,
        };
        let unknown = pb::HeartbeatResponse { status: pb::NodeStatus::Unknown as i32, ..Default::default() };
        let superseded =
            pb::HeartbeatResponse { status: pb::NodeStatus::Unknown as i32, superseded: true, ..Default::default() };
        let apply = |kind| {
            let hb = HeartbeatApply {
                node_id: r.node_id.clone(),
                now_ms: now_ms(),
                caps: caps_from_wire(&r.tier_capacities),
                kind,
                incarnation: r.incarnation,
            };
            self.store.apply_heartbeat(hb).expect("store")
        };
        if r.is_full_sync {
            let events = events_from_wire(r.bundles.iter().flat_map(|b| b.events.iter().cloned()));
            let outcome = apply(HeartbeatKind::FullSyncChunk {
                baseline_seq: r.delta_seq_baseline,
                chunk_index: r.full_sync_chunk,
                is_final: r.full_sync_final,
                events,
            });
            return match outcome {
                HeartbeatOutcome::Unknown => unknown,
                HeartbeatOutcome::Superseded { .. } => superseded,
                HeartbeatOutcome::SeqGap { acked_seq } => {
                    self.seq_gaps += 1;
                    alive(acked_seq, true)
                }
                HeartbeatOutcome::AlreadyApplied { acked_seq } => {
                    self.stale_sync_chunks += 1;
                    alive(acked_seq, false)
                }
                HeartbeatOutcome::Applied { acked_seq } => {
                    if r.full_sync_final {
                        self.full_syncs_applied += 1;
                    }
                    alive(acked_seq, false)
                }
            };
        }
        if r.bundles.is_empty() {
            return match apply(HeartbeatKind::Keepalive) {
                HeartbeatOutcome::Superseded { .. } => superseded,
                outcome => match outcome.acked_seq() {
                    None => unknown,
                    Some(acked) => alive(acked, false),
                },
            };
        }
        let mut acked = 0;
        for b in &r.bundles {
            match apply(HeartbeatKind::Delta { seq: b.seq, events: events_from_wire(b.events.iter().cloned()) }) {
                HeartbeatOutcome::Unknown => return unknown,
                HeartbeatOutcome::Superseded { .. } => return superseded,
                HeartbeatOutcome::SeqGap { acked_seq } => {
                    self.seq_gaps += 1;
                    return alive(acked_seq, true);
                }
                HeartbeatOutcome::AlreadyApplied { acked_seq } => {
                    self.reacked_bundles += 1;
                    acked = acked_seq;
                }
                HeartbeatOutcome::Applied { acked_seq } => acked = acked_seq,
            }
        }
        alive(acked, false)
    }
}

/// The node id every fake test registers.
pub(crate) const NODE: &str = "node-a";

/// Everything the fake recorded.
#[derive(Debug, Default)]
pub(crate) struct Recorded {
    pub(crate) registers: Vec<pb::RegisterClientRequest>,
    /// Every heartbeat, in arrival order, with its arrival time.
    pub(crate) heartbeats: Vec<(Instant, pb::HeartbeatRequest)>,
    pub(crate) unregisters: Vec<String>,
    /// The `x-umbp-token` of every call of any RPC.
    pub(crate) tokens: Vec<Option<String>>,
}

impl Recorded {
    /// The delta heartbeats (not full sync, with bundles).
    pub(crate) fn deltas(&self) -> Vec<&pb::HeartbeatRequest> {
        self.heartbeats.iter().map(|(_, h)| h).filter(|h| !h.is_full_sync && !h.bundles.is_empty()).collect()
    }

    /// The full-sync chunks.
    pub(crate) fn full_sync_chunks(&self) -> Vec<&pb::HeartbeatRequest> {
        self.heartbeats.iter().map(|(_, h)| h).filter(|h| h.is_full_sync).collect()
    }

    /// Every event of every delta bundle, as (seq, key).
    pub(crate) fn delta_events(&self) -> Vec<(u64, String)> {
        self.deltas()
            .into_iter()
            .flat_map(|h| h.bundles.iter().flat_map(|b| b.events.iter().map(move |e| (b.seq, e.key.clone()))))
            .collect()
    }
}

/// The shared state behind the fake service.
pub(crate) struct Fake {
    pub(crate) rec: Mutex<Recorded>,
    pub(crate) model: Mutex<Model>,
    pub(crate) interval_ms: AtomicU64,
    /// The local placement grant every register and ALIVE heartbeat reply carries.
    pub(crate) local_puts: AtomicBool,
    pub(crate) hang_all: AtomicBool,
    heartbeat_script: Mutex<HeartbeatScript>,
    register_script: Mutex<RegisterScript>,
    pub(crate) route_get_reply: Mutex<pb::BatchRouteGetResponse>,
    pub(crate) route_put_reply: Mutex<pb::BatchRoutePutResponse>,
    pub(crate) lookup_reply: Mutex<pb::BatchLookupResponse>,
    pub(crate) cluster_reply: Mutex<pb::GetClusterStatusResponse>,
    pub(crate) last_route_get: Mutex<Option<pb::BatchRouteGetRequest>>,
    pub(crate) last_route_put: Mutex<Option<pb::BatchRoutePutRequest>>,
}

impl Fake {
    /// Scripts the heartbeat replies (the default answers every request normally).
    pub(crate) fn on_heartbeat(&self, script: impl FnMut(&pb::HeartbeatRequest) -> Action + Send + 'static) {
        *self.heartbeat_script.lock() = Box::new(script);
    }

    /// Scripts the registration replies.
    pub(crate) fn on_register(&self, script: impl FnMut(&pb::RegisterClientRequest) -> Action + Send + 'static) {
        *self.register_script.lock() = Box::new(script);
    }

    /// Forgets the node, as a restarted master would.
    pub(crate) fn forget(&self) {
        *self.model.lock() = Model::default();
    }

    fn record_token<T>(&self, request: &Request<T>) {
        let token = request.metadata().get(umbp_proto::TOKEN_METADATA).and_then(|v| v.to_str().ok()).map(str::to_owned);
        self.rec.lock().tokens.push(token);
    }

    async fn maybe_hang(&self) {
        if self.hang_all.load(Ordering::Acquire) {
            std::future::pending::<()>().await;
        }
    }
}

/// The tonic service over the shared state.
struct FakeService(Arc<Fake>);

impl std::ops::Deref for FakeService {
    type Target = Fake;
    fn deref(&self) -> &Fake {
        &self.0
    }
}

#[tonic::async_trait]
impl UmbpMaster for FakeService {
    async fn register_client(
        &self,
        request: Request<pb::RegisterClientRequest>,
    ) -> Result<Response<pb::RegisterClientResponse>, Status> {
        self.record_token(&request);
        self.maybe_hang().await;
        let r = request.into_inner();
        self.rec.lock().registers.push(r.clone());
        let action = (self.register_script.lock())(&r);
        match action {
            Action::Fail(code) => return Err(Status::new(code, "scripted")),
            Action::Hang => std::future::pending::<()>().await,
            _ => {}
        }
        self.model.lock().register(&r)?;
        if let Action::ApplyThenDelay(d) = action {
            // Registered here, but the answer comes too late for the client's deadline.
            tokio::time::sleep(d).await;
        }
        Ok(Response::new(pb::RegisterClientResponse {
            heartbeat_interval_ms: self.interval_ms.load(Ordering::Relaxed),
            local_puts: self.local_puts.load(Ordering::Relaxed),
        }))
    }

    async fn unregister_client(
        &self,
        request: Request<pb::UnregisterClientRequest>,
    ) -> Result<Response<pb::UnregisterClientResponse>, Status> {
        self.record_token(&request);
        self.maybe_hang().await;
        let r = request.into_inner();
        let node_id = r.node_id;
        self.model.lock().store().unregister_incarnation(&node_id, r.incarnation).expect("store");
        self.rec.lock().unregisters.push(node_id);
        Ok(Response::new(pb::UnregisterClientResponse {}))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        self.record_token(&request);
        self.maybe_hang().await;
        let r = request.into_inner();
        self.rec.lock().heartbeats.push((Instant::now(), r.clone()));
        let action = (self.heartbeat_script.lock())(&r);
        let reply = match action {
            Action::Normal => self.model.lock().heartbeat(&r),
            Action::Fail(code) => return Err(Status::new(code, "scripted")),
            Action::Unknown => pb::HeartbeatResponse { status: pb::NodeStatus::Unknown as i32, ..Default::default() },
            Action::RequestFullSync => {
                let acked = self.model.lock().last_applied();
                pb::HeartbeatResponse {
                    status: pb::NodeStatus::Alive as i32,
                    acked_seq: acked,
                    request_full_sync: true,
                    local_puts: false,
                    superseded: false,
                }
            }
            Action::ApplyThenDelay(d) => {
                let reply = self.model.lock().heartbeat(&r);
                tokio::time::sleep(d).await;
                reply
            }
            Action::DelayThenApply(d) => {
                tokio::time::sleep(d).await;
                self.model.lock().heartbeat(&r)
            }
            Action::Reply(reply) => reply,
            Action::Hang => std::future::pending().await,
        };
        let granted = reply.status == pb::NodeStatus::Alive as i32 && self.local_puts.load(Ordering::Relaxed);
        Ok(Response::new(pb::HeartbeatResponse { local_puts: granted, ..reply }))
    }

    async fn route_put(&self, _: Request<pb::RoutePutRequest>) -> Result<Response<pb::RoutePutResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn route_get(&self, _: Request<pb::RouteGetRequest>) -> Result<Response<pb::RouteGetResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn batch_route_put(
        &self,
        request: Request<pb::BatchRoutePutRequest>,
    ) -> Result<Response<pb::BatchRoutePutResponse>, Status> {
        self.record_token(&request);
        self.maybe_hang().await;
        *self.last_route_put.lock() = Some(request.get_ref().clone());
        Ok(Response::new(self.route_put_reply.lock().clone()))
    }

    async fn batch_route_get(
        &self,
        request: Request<pb::BatchRouteGetRequest>,
    ) -> Result<Response<pb::BatchRouteGetResponse>, Status> {
        self.record_token(&request);
        self.maybe_hang().await;
        *self.last_route_get.lock() = Some(request.into_inner());
        Ok(Response::new(self.route_get_reply.lock().clone()))
    }

    async fn batch_lookup(
        &self,
        request: Request<pb::BatchLookupRequest>,
    ) -> Result<Response<pb::BatchLookupResponse>, Status> {
        self.record_token(&request);
        self.maybe_hang().await;
        Ok(Response::new(self.lookup_reply.lock().clone()))
    }

    async fn get_cluster_status(
        &self,
        request: Request<pb::GetClusterStatusRequest>,
    ) -> Result<Response<pb::GetClusterStatusResponse>, Status> {
        self.record_token(&request);
        self.maybe_hang().await;
        Ok(Response::new(self.cluster_reply.lock().clone()))
    }

    // The external KV index is tested against the real master (`master_client_external.rs`).
    async fn report_external_kv_blocks(
        &self,
        _: Request<pb::ReportExternalKvBlocksRequest>,
    ) -> Result<Response<pb::ReportExternalKvBlocksResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn revoke_external_kv_blocks(
        &self,
        _: Request<pb::RevokeExternalKvBlocksRequest>,
    ) -> Result<Response<pb::RevokeExternalKvBlocksResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn revoke_all_external_kv_blocks_at_tier(
        &self,
        _: Request<pb::RevokeAllExternalKvBlocksAtTierRequest>,
    ) -> Result<Response<pb::RevokeAllExternalKvBlocksAtTierResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn match_external_kv(
        &self,
        _: Request<pb::MatchExternalKvRequest>,
    ) -> Result<Response<pb::MatchExternalKvResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }

    async fn get_external_kv_hit_counts(
        &self,
        _: Request<pb::GetExternalKvHitCountsRequest>,
    ) -> Result<Response<pb::GetExternalKvHitCountsResponse>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }
}

/// A running fake master.
pub(crate) struct FakeMaster {
    pub(crate) addr: SocketAddr,
    pub(crate) fake: Arc<Fake>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl FakeMaster {
    /// Starts a fake that hands out `interval_ms` as the heartbeat interval.
    pub(crate) async fn start(interval_ms: u64) -> Self {
        let fake = Arc::new(Fake {
            rec: Mutex::new(Recorded::default()),
            model: Mutex::new(Model::default()),
            interval_ms: AtomicU64::new(interval_ms),
            local_puts: AtomicBool::new(false),
            hang_all: AtomicBool::new(false),
            heartbeat_script: Mutex::new(Box::new(|_| Action::Normal)),
            register_script: Mutex::new(Box::new(|_| Action::Normal)),
            route_get_reply: Mutex::new(pb::BatchRouteGetResponse::default()),
            route_put_reply: Mutex::new(pb::BatchRoutePutResponse::default()),
            lookup_reply: Mutex::new(pb::BatchLookupResponse::default()),
            cluster_reply: Mutex::new(pb::GetClusterStatusResponse::default()),
            last_route_get: Mutex::new(None),
            last_route_put: Mutex::new(None),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let service = UmbpMasterServer::new(FakeService(Arc::clone(&fake)))
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), async {
                    let _ = stopped.await;
                })
                .await;
        });
        Self { addr, fake, stop: Some(stop) }
    }

    pub(crate) fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Polls `cond` over the recorded requests and the model until it holds or `timeout` passes.
    pub(crate) async fn wait_until(&self, timeout: Duration, cond: impl Fn(&Recorded, &Model) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let rec = self.fake.rec.lock();
                let model = self.fake.model.lock();
                if cond(&rec, &model) {
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for FakeMaster {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A live DRAM-style paged medium of `pages` pages of `page_size` bytes, serving `tier`.
pub(crate) fn page_backend(tier: TierType, page_size: u64, pages: u64) -> Arc<PageBackend> {
    let backend = PageBackend::new(
        PageBackendConfig::new(tier, page_size, vec![pages * page_size]),
        Box::new(HostPageMemorySource::new(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() })),
    )
    .expect("valid config");
    backend.init(Arc::new(umbp_testkit::LocalOnlyRegistrar::new())).expect("init");
    Arc::new(backend)
}

/// A registry of `backends`.
pub(crate) fn registry(backends: &[Arc<PageBackend>]) -> Arc<BackendRegistry> {
    let mut registry = BackendRegistry::new();
    for b in backends {
        registry.register(Arc::clone(b) as Arc<dyn MediumBackend>).expect("register");
    }
    Arc::new(registry)
}

/// Allocates and commits every key (one page each); panics if any fails.
pub(crate) fn commit(backend: &PageBackend, keys: &[String]) {
    let size = backend.page_size();
    let requests: Vec<AllocateRequest> = keys.iter().map(|k| AllocateRequest::new(k.clone(), size)).collect();
    let slots = backend.batch_allocate(&requests);
    let commits: Vec<CommitRequest> = slots
        .iter()
        .zip(keys)
        .map(|(s, k)| {
            assert_eq!(s.outcome, AllocateOutcome::Allocated, "allocate {k}");
            CommitRequest::new(s.slot_id, k.clone())
        })
        .collect();
    for (r, k) in backend.batch_commit(&commits).iter().zip(keys) {
        assert!(r.success, "commit {k}");
    }
}

/// Keys `prefix-0 .. prefix-(n-1)`.
pub(crate) fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// A config with short deadlines for tests.
pub(crate) fn test_config() -> MasterClientConfig {
    MasterClientConfig {
        heartbeat_rpc_timeout: Duration::from_millis(1000),
        rpc_timeout: Duration::from_millis(1000),
        connect_timeout: Duration::from_millis(1000),
        shutdown_timeout: Duration::from_millis(1000),
        clear_timeout: Duration::from_millis(3000),
        ..MasterClientConfig::default()
    }
}

/// The node record the tests register.
pub(crate) fn node() -> NodeRegistration {
    NodeRegistration::new("node-a", "127.0.0.1")
        .with_peer_address("127.0.0.1:7001")
        .with_data_endpoint("127.0.0.1:7002")
        .with_tags(vec!["rack=r1".into()])
}

/// Connects and registers a client over `registry`.
pub(crate) async fn client(
    master: &FakeMaster,
    config: MasterClientConfig,
    registry: Arc<BackendRegistry>,
) -> MasterClient {
    let client = MasterClient::connect(&master.addr(), config, node(), registry).await.expect("connect");
    client.register().await.expect("register");
    client
}
