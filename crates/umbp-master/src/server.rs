//! Running the master: the gRPC server, the registry reaper and the eviction manager, with a graceful
//! shutdown.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_server::UmbpMasterServer;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;

use crate::config::MasterConfig;
use crate::routing::{
    Affinity, Candidate, EvictionCandidate, GetAlgo, PutStrategyConfig, RouteGetStrategy, RoutePutStrategy, SelectAlgo,
    TierSlot, plan_eviction, select_victims,
};
use crate::service::{MasterService, ServiceStats, now_ms};
use crate::store::{InMemoryStore, MetadataStore};

/// The metadata key that carries the cluster token on every call.
pub const TOKEN_METADATA: &str = "x-umbp-token";

/// Why the master could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MasterError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The listen address could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The metadata store could not be built.
    #[error("metadata store: {0}")]
    Store(#[from] crate::store::StoreError),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Counters of a running master (for `umbp stat`, metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MasterStats {
    /// Heartbeat RPCs received.
    pub heartbeats: u64,
    /// Events applied from deltas and full syncs.
    pub events_applied: u64,
    /// Heartbeats answered with a full-sync request.
    pub seq_gaps: u64,
    /// Re-sent bundles acknowledged again without re-applying.
    pub reacked: u64,
    /// Keys routed for puts.
    pub route_put_keys: u64,
    /// Keys routed for gets.
    pub route_get_keys: u64,
    /// Eviction rounds that found pressure.
    pub eviction_rounds: u64,
    /// Keys asked to be evicted.
    pub evict_requests: u64,
}

/// A running master. Dropping it without [`shutdown`](Self::shutdown) aborts its tasks.
#[derive(Debug)]
pub struct MasterHandle {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    server: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    stats: Arc<ServiceStats>,
    eviction: Arc<EvictionStats>,
    store: Arc<dyn MetadataStore>,
    shutdown_deadline: Duration,
}

#[derive(Debug, Default)]
struct EvictionStats {
    rounds: std::sync::atomic::AtomicU64,
    requests: std::sync::atomic::AtomicU64,
}

impl MasterHandle {
    /// The address the gRPC server is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The metadata store (for tests and operator tooling in the same process).
    pub fn store(&self) -> &Arc<dyn MetadataStore> {
        &self.store
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> MasterStats {
        use std::sync::atomic::Ordering::Relaxed;
        MasterStats {
            heartbeats: self.stats.heartbeats.load(Relaxed),
            events_applied: self.stats.events_applied.load(Relaxed),
            seq_gaps: self.stats.seq_gaps.load(Relaxed),
            reacked: self.stats.reacked.load(Relaxed),
            route_put_keys: self.stats.route_put_keys.load(Relaxed),
            route_get_keys: self.stats.route_get_keys.load(Relaxed),
            eviction_rounds: self.eviction.rounds.load(Relaxed),
            evict_requests: self.eviction.requests.load(Relaxed),
        }
    }

    /// Stops eviction and the reaper, then the gRPC server, waiting at most the configured shutdown
    /// deadline for in-flight calls.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
        if let Some(server) = self.server.take() {
            match tokio::time::timeout(self.shutdown_deadline, server).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "gRPC server stopped with an error"),
                Ok(Err(e)) => tracing::warn!(error = %e, "gRPC server task failed"),
                Err(_) => tracing::warn!("in-flight calls outlived the shutdown deadline; abandoning them"),
            }
        }
    }
}

impl Drop for MasterHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for task in &self.tasks {
            task.abort();
        }
        if let Some(server) = &self.server {
            server.abort();
        }
    }
}

/// Checks the cluster token on every call when one is configured.
#[derive(Clone)]
struct TokenCheck {
    token: Option<Arc<str>>,
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.token else { return Ok(request) };
        let given = request.metadata().get(TOKEN_METADATA).and_then(|v| v.to_str().ok());
        match given {
            Some(given) if constant_time_eq(given.as_bytes(), expected.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated("wrong cluster token")),
            None => Err(Status::unauthenticated("this cluster requires a token (x-umbp-token)")),
        }
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Starts a master with `config` on the current tokio runtime: binds the listen address (port 0
/// picks a free one; see [`MasterHandle::local_addr`]), then serves until
/// [`MasterHandle::shutdown`].
pub async fn start(config: MasterConfig) -> Result<MasterHandle, MasterError> {
    config.validate()?;
    let store: Arc<dyn MetadataStore> = Arc::new(InMemoryStore::with_shards(config.index_shards)?);
    start_with_store(config, store).await
}

/// [`start`] over a caller-supplied metadata store (a shared store for several masters, or a test
/// double).
pub async fn start_with_store(
    config: MasterConfig,
    store: Arc<dyn MetadataStore>,
) -> Result<MasterHandle, MasterError> {
    config.validate()?;
    let algo = config.route_put_algo.parse::<SelectAlgo>().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "unknown put algorithm; using most_available");
        SelectAlgo::default()
    });
    let affinity = config.route_put_affinity.parse::<Affinity>().unwrap_or_else(|e| {
        tracing::warn!(error = %e, "unknown put affinity; using none");
        Affinity::default()
    });
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| MasterError::Bind { addr: config.listen, source })?;
    let addr = listener.local_addr().map_err(|source| MasterError::Bind { addr: config.listen, source })?;
    let config = Arc::new(config);
    let stats = Arc::new(ServiceStats::default());
    let service = MasterService {
        config: Arc::clone(&config),
        store: Arc::clone(&store),
        put: Arc::new(RoutePutStrategy::new(PutStrategyConfig::new(algo, affinity))),
        get: Arc::new(RouteGetStrategy::new(GetAlgo::LocalPreferring)),
        stats: Arc::clone(&stats),
    };
    tracing::info!(
        %addr,
        heartbeat_interval = ?config.heartbeat_interval(),
        expiry = ?config.expiry_after(),
        put = %format!("{algo}/{affinity}"),
        "master listening"
    );
    let (stop, stopped) = watch::channel(false);
    let grpc = UmbpMasterServer::new(service)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let grpc = tonic::service::interceptor::InterceptedService::new(
        grpc,
        TokenCheck { token: config.cluster_token.as_deref().map(Arc::from) },
    );
    let mut server_stop = stopped.clone();
    let server = tokio::spawn(tonic::transport::Server::builder().add_service(grpc).serve_with_incoming_shutdown(
        // Without TCP_NODELAY, Nagle holds a reply's second write for the client's delayed ACK (~40 ms).
        tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        async move {
            let _ = server_stop.wait_for(|s| *s).await;
        },
    ));
    let eviction = Arc::new(EvictionStats::default());
    let tasks = vec![
        tokio::spawn(reaper(Arc::clone(&store), Arc::clone(&config), stopped.clone())),
        tokio::spawn(evictor(Arc::clone(&store), Arc::clone(&config), Arc::clone(&eviction), stopped)),
    ];
    Ok(MasterHandle {
        addr,
        stop,
        tasks,
        server: Some(server),
        stats,
        eviction,
        store,
        shutdown_deadline: config.shutdown_deadline,
    })
}

/// Expires nodes that stopped heartbeating: their rows stay (for operators), their locations go.
async fn reaper(store: Arc<dyn MetadataStore>, config: Arc<MasterConfig>, mut stop: watch::Receiver<bool>) {
    let expiry = u64::try_from(config.expiry_after().as_millis()).unwrap_or(u64::MAX);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.reaper_interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        match store.expire_stale(now_ms().saturating_sub(expiry)) {
            Ok(expired) if !expired.is_empty() => {
                tracing::warn!(nodes = ?expired, "nodes expired: no heartbeat within {expiry} ms")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "reaper: store call failed"),
        }
    }
}

/// One eviction round: find (node, tier) pairs above the high watermark, pick LRU unleased keys down
/// to the low watermark, and ask each node to evict them. The master's index changes only when the
/// node's REMOVE events arrive; a key the node protects (leased, pinned) comes back next round.
async fn evictor(
    store: Arc<dyn MetadataStore>,
    config: Arc<MasterConfig>,
    stats: Arc<EvictionStats>,
    mut stop: watch::Receiver<bool>,
) {
    let mut peers: HashMap<Arc<str>, (Arc<str>, UmbpPeerClient<Channel>)> = HashMap::new();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.eviction_check_interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let Ok(nodes) = store.list_alive().inspect_err(|e| tracing::warn!(error = %e, "eviction: store call failed"))
        else {
            continue;
        };
        let candidates: Vec<Candidate> = nodes
            .iter()
            .map(|n| Candidate {
                node_id: n.node_id.clone(),
                peer_address: n.peer_address.clone(),
                tiers: n.caps.iter().map(|c| TierSlot::new(c.tier, c.total_bytes, c.available_bytes)).collect(),
            })
            .collect();
        let buckets = plan_eviction(&candidates, config.eviction_high_watermark, config.eviction_low_watermark);
        if buckets.is_empty() {
            continue;
        }
        stats.rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let wanted: Vec<(String, umbp_core::TierType)> =
            buckets.iter().map(|b| (b.node_id.to_string(), b.tier)).collect();
        let Ok(found) = store
            .enumerate_eviction_candidates(&wanted, now_ms(), 0)
            .inspect_err(|e| tracing::warn!(error = %e, "eviction: store call failed"))
        else {
            continue;
        };
        let found = found
            .into_iter()
            .map(|c| EvictionCandidate {
                key: c.key.to_string(),
                node_id: c.node_id,
                tier: c.tier,
                size: c.size,
                last_accessed_ms: c.last_accessed_ms,
            })
            .collect();
        for (node, keys) in select_victims(found, &buckets) {
            let Some(peer) = candidates.iter().find(|c| c.node_id == node).map(|c| c.peer_address.clone()) else {
                continue;
            };
            if peer.is_empty() {
                continue;
            }
            stats.requests.fetch_add(keys.len() as u64, std::sync::atomic::Ordering::Relaxed);
            evict_on_peer(&mut peers, &node, &peer, keys, &config).await;
        }
    }
}

/// Sends one `EvictKey` with the configured deadline through a cached client (rebuilt when the node's
/// address changes, dropped on error). The reply is only logged: REMOVE events update the index.
async fn evict_on_peer(
    peers: &mut HashMap<Arc<str>, (Arc<str>, UmbpPeerClient<Channel>)>,
    node: &Arc<str>,
    peer: &Arc<str>,
    keys: Vec<String>,
    config: &MasterConfig,
) {
    if peers.get(node).is_none_or(|(addr, _)| addr != peer) {
        let Ok(endpoint) = Endpoint::from_shared(format!("http://{peer}")) else {
            tracing::warn!(node = %node, peer = %peer, "eviction: bad peer address");
            return;
        };
        let channel = endpoint.connect_timeout(config.evict_deadline).timeout(config.evict_deadline).connect_lazy();
        peers.insert(node.clone(), (peer.clone(), UmbpPeerClient::new(channel)));
    }
    let Some((_, client)) = peers.get_mut(node) else { return };
    let n = keys.len();
    let mut request = Request::new(v1::EvictKeyRequest { keys });
    request.set_timeout(config.evict_deadline);
    if let Some(token) = &config.cluster_token
        && let Ok(value) = token.parse()
    {
        request.metadata_mut().insert(TOKEN_METADATA, value);
    }
    match tokio::time::timeout(config.evict_deadline, client.evict_key(request)).await {
        Ok(Ok(reply)) => {
            let freed: u64 = reply.get_ref().evicted.iter().map(|e| e.bytes_freed).sum();
            tracing::info!(node = %node, keys = n, freed, "eviction round");
        }
        Ok(Err(status)) => {
            tracing::warn!(node = %node, error = %status, "EvictKey failed");
            peers.remove(node);
        }
        Err(_) => {
            tracing::warn!(node = %node, "EvictKey timed out");
            peers.remove(node);
        }
    }
}
