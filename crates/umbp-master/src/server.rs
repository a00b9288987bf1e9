//! Running the master: the gRPC server, the registry reaper and the eviction manager, with a graceful
//! shutdown.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use umbp_proto::token::TokenCheck;
use umbp_proto::v1::umbp_master_server::UmbpMasterServer;

use crate::config::MasterConfig;
use crate::evictor::{EvictionReport, EvictionStats, Evictor, ReapReport, reap};
use crate::lease::{DutyLease, lease_loop};
use crate::metrics::ClusterMetrics;
use crate::routing::{GetAlgo, PutStrategyConfig, RouteGetStrategy, RoutePutStrategy};
use crate::service::{MasterService, ServiceStats};
use crate::store::{InMemoryStore, MetadataStore, RedisStore, ShardedStore, StoreError};

/// A gauge not refreshed for this long leaves the metrics output (an expired or removed node's).
const METRICS_IDLE: std::time::Duration = std::time::Duration::from_secs(30);

pub use umbp_proto::TOKEN_METADATA;

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
    /// The metrics endpoint could not start.
    #[error(transparent)]
    Metrics(#[from] umbp_metrics::MetricsError),
}

/// Counters of a running master (for `umbp stat`, metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MasterStats {
    /// Heartbeat RPCs received.
    pub heartbeats: u64,
    /// Events applied from deltas and full syncs.
    pub events_applied: u64,
    /// Events dropped on arrival: an unknown kind or an empty key.
    pub events_skipped: u64,
    /// Heartbeats answered with a full-sync request.
    pub seq_gaps: u64,
    /// Re-sent bundles acknowledged again without re-applying, and stale full-sync copies refused.
    pub reacked: u64,
    /// Keys routed for puts.
    pub route_put_keys: u64,
    /// Keys routed for gets.
    pub route_get_keys: u64,
    /// Eviction rounds that found pressure.
    pub eviction_rounds: u64,
    /// Keys asked to be evicted.
    pub evict_requests: u64,
    /// Bytes the peers reported freed by eviction.
    pub evict_bytes_freed: u64,
    /// Eviction victims the peers refused (0 bytes freed: leased or pinned).
    pub evict_refused: u64,
    /// On-demand evictions: put routes that found no room and evicted before answering.
    pub on_demand_evictions: u64,
    /// External KV block reports recorded.
    pub external_reports_recorded: u64,
    /// External KV block reports ignored: their node was not a live registered node.
    pub external_reports_rejected_not_alive: u64,
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
    evictor: Arc<tokio::sync::Mutex<Evictor>>,
    store: Arc<dyn MetadataStore>,
    config: Arc<MasterConfig>,
    metrics: Option<umbp_metrics::MetricsServer>,
    lease: Arc<DutyLease>,
}

impl MasterHandle {
    /// The address the gRPC server is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where Prometheus `/metrics` is served, when `metrics_listen` is set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(umbp_metrics::MetricsServer::local_addr)
    }

    /// The metadata store (for tests and operator tooling in the same process).
    pub fn store(&self) -> &Arc<dyn MetadataStore> {
        &self.store
    }

    /// Whether this master holds the duty lease now: it runs the registry reaper and the eviction
    /// rounds for every master on its store (see the crate docs, "Several masters").
    pub fn holds_duty_lease(&self) -> bool {
        self.lease.held()
    }

    /// This master's token in the duty lease (unique per process and start).
    pub fn lease_holder(&self) -> &str {
        self.lease.holder()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> MasterStats {
        use std::sync::atomic::Ordering::Relaxed;
        MasterStats {
            heartbeats: self.stats.heartbeats.load(Relaxed),
            events_applied: self.stats.events_applied.load(Relaxed),
            events_skipped: self.stats.events_skipped.load(Relaxed),
            seq_gaps: self.stats.seq_gaps.load(Relaxed),
            reacked: self.stats.reacked.load(Relaxed),
            route_put_keys: self.stats.route_put_keys.load(Relaxed),
            route_get_keys: self.stats.route_get_keys.load(Relaxed),
            eviction_rounds: self.eviction.rounds.load(Relaxed),
            evict_requests: self.eviction.requests.load(Relaxed),
            evict_bytes_freed: self.eviction.bytes_freed.load(Relaxed),
            evict_refused: self.eviction.refused.load(Relaxed),
            on_demand_evictions: self.eviction.on_demand.load(Relaxed),
            external_reports_recorded: self.stats.external.reports_recorded.load(Relaxed),
            external_reports_rejected_not_alive: self.stats.external.reports_rejected_not_alive.load(Relaxed),
        }
    }

    /// Runs one eviction round now (the background loop runs one every `eviction.check_interval`;
    /// rounds never overlap). For tests and operator tooling.
    pub async fn run_eviction_round(&self) -> EvictionReport {
        self.evictor.lock().await.tick().await
    }

    /// Runs the registry reaper once now; returns the nodes it expired.
    pub async fn run_reaper(&self) -> Vec<String> {
        reap(&self.store, &self.config).await.expired
    }

    /// Runs the registry reaper once now: what it expired and which expired records it removed
    /// (their [`expired_retention`](MasterConfig::expired_retention) passed).
    pub async fn run_reaper_pass(&self) -> ReapReport {
        reap(&self.store, &self.config).await
    }

    /// Stops eviction (a round in progress is cut short) and the reaper, then the gRPC server. The
    /// whole shutdown is bounded by the configured shutdown deadline: what is still running then —
    /// in-flight calls, a background task stuck in a store call — is aborted.
    pub async fn shutdown(mut self) {
        let deadline = tokio::time::Instant::now() + self.config.shutdown_deadline;
        let _ = self.stop.send(true);
        for mut task in self.tasks.drain(..) {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                tracing::warn!("a background task outlived the shutdown deadline; aborting it");
                task.abort();
            }
        }
        // The next master takes the duties at its next attempt, not after the lease's TTL.
        let _ = tokio::time::timeout_at(deadline, self.lease.release()).await;
        if let Some(mut server) = self.server.take() {
            match tokio::time::timeout_at(deadline, &mut server).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "gRPC server stopped with an error"),
                Ok(Err(e)) => tracing::warn!(error = %e, "gRPC server task failed"),
                Err(_) => {
                    tracing::warn!("in-flight calls outlived the shutdown deadline; aborting them");
                    server.abort();
                }
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

/// Starts a master with `config` on the current tokio runtime: opens its metadata store (this
/// process's memory, or the Redis of [`MasterConfig::metadata`]), binds the listen address (port 0
/// picks a free one; see [`MasterHandle::local_addr`]), then serves until
/// [`MasterHandle::shutdown`].
pub async fn start(config: MasterConfig) -> Result<MasterHandle, MasterError> {
    config.validate()?;
    let store: Arc<dyn MetadataStore> = match config.metadata.clone() {
        None => Arc::new(InMemoryStore::with_shards(config.index_shards)?),
        // Connecting blocks (bounded by the store's connect timeout): off the async workers.
        Some(urls) => {
            tokio::task::spawn_blocking(move || open_redis(&urls)).await.map_err(|err| StoreError::Backend {
                message: format!("connecting to the metadata store: {err}"),
                retryable: false,
                source: None,
            })??
        }
    };
    start_with_store(config, store).await
}

/// The store of a `metadata` setting: one Redis, or a [`ShardedStore`] over the comma-separated
/// endpoints (the first is the directory; every master must list the same ones in the same order).
fn open_redis(urls: &str) -> Result<Arc<dyn MetadataStore>, StoreError> {
    let mut shards: Vec<Arc<dyn MetadataStore>> = Vec::new();
    for url in urls.split(',').map(str::trim) {
        shards.push(Arc::new(RedisStore::connect(url)?));
    }
    if shards.len() == 1 {
        return Ok(shards.remove(0));
    }
    Ok(Arc::new(ShardedStore::new(shards)?))
}

/// [`start`] over a caller-supplied metadata store (a shared store for several masters, or a test
/// double).
pub async fn start_with_store(
    config: MasterConfig,
    store: Arc<dyn MetadataStore>,
) -> Result<MasterHandle, MasterError> {
    config.validate()?;
    let (algo, affinity) = (config.route_put_algo, config.route_put_affinity);
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| MasterError::Bind { addr: config.listen, source })?;
    let addr = listener.local_addr().map_err(|source| MasterError::Bind { addr: config.listen, source })?;
    let config = Arc::new(config);
    let stats = Arc::new(ServiceStats::default());
    let eviction = Arc::new(EvictionStats::default());
    // Before the gRPC server starts: a master whose endpoint cannot bind serves nothing.
    let metrics = match config.metrics_listen {
        Some(listen) => {
            let exporter = Arc::new(umbp_metrics::MetricsExporter::new(&[], METRICS_IDLE));
            let cluster = ClusterMetrics {
                store: Arc::clone(&store),
                stats: Arc::clone(&stats),
                eviction: Arc::clone(&eviction),
            };
            exporter.add_source("master", Vec::new(), Arc::new(cluster));
            Some(umbp_metrics::MetricsServer::start(exporter, &umbp_metrics::MetricsConfig::new(listen)).await?)
        }
        None => None,
    };
    let (stop, stopped) = watch::channel(false);
    let lease = Arc::new(DutyLease::new(Arc::clone(&store), addr));
    // Before the loops start: a lone master runs its first reaper pass as the holder.
    lease.attempt().await;
    let evictor = Arc::new(tokio::sync::Mutex::new(Evictor::new(
        Arc::clone(&store),
        Arc::clone(&config),
        Arc::clone(&eviction),
        stopped.clone(),
    )));
    let service = MasterService {
        config: Arc::clone(&config),
        store: Arc::clone(&store),
        put: Arc::new(RoutePutStrategy::new(PutStrategyConfig::new(algo, affinity))),
        get: Arc::new(RouteGetStrategy::new(GetAlgo::LocalPreferring)),
        stats: Arc::clone(&stats),
        evictor: Arc::clone(&evictor),
        relief_pending: Arc::default(),
        lease: Arc::clone(&lease),
    };
    let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    tracing::info!(
        %addr,
        heartbeat_interval_ms = ms(config.heartbeat_interval()),
        expiry_ms = ms(config.expiry_after()),
        expired_retention_ms = ms(config.expired_retention),
        put_algo = %algo,
        put_affinity = %affinity,
        high_watermark = config.eviction.high_watermark,
        low_watermark = config.eviction.low_watermark,
        "master listening"
    );
    let grpc = UmbpMasterServer::new(service)
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let grpc =
        tonic::service::interceptor::InterceptedService::new(grpc, TokenCheck::new(config.cluster_token.as_deref()));
    let mut server_stop = stopped.clone();
    let server = tokio::spawn(tonic::transport::Server::builder().add_service(grpc).serve_with_incoming_shutdown(
        // Without TCP_NODELAY, Nagle holds a reply's second write for the client's delayed ACK (~40 ms).
        tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        async move {
            let _ = server_stop.wait_for(|s| *s).await;
        },
    ));
    let tasks = vec![
        tokio::spawn(lease_loop(Arc::clone(&lease), stopped.clone())),
        tokio::spawn(reaper_loop(Arc::clone(&store), Arc::clone(&config), Arc::clone(&lease), stopped.clone())),
        tokio::spawn(eviction_loop(Arc::clone(&evictor), Arc::clone(&config), Arc::clone(&lease), stopped)),
    ];
    Ok(MasterHandle {
        addr,
        stop,
        tasks,
        server: Some(server),
        stats,
        eviction,
        evictor,
        store,
        config,
        metrics,
        lease,
    })
}

/// Runs the reaper every `reaper_interval` until stopped, while this master holds the duty lease.
async fn reaper_loop(
    store: Arc<dyn MetadataStore>,
    config: Arc<MasterConfig>,
    lease: Arc<DutyLease>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.reaper_interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if lease.held() {
            reap(&store, &config).await;
        }
    }
}

/// Runs an eviction round every `eviction.check_interval` until stopped. The master's index changes
/// only when the nodes' REMOVE events arrive.
async fn eviction_loop(
    evictor: Arc<tokio::sync::Mutex<Evictor>>,
    config: Arc<MasterConfig>,
    lease: Arc<DutyLease>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(config.eviction.check_interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if !lease.held() {
            continue;
        }
        let report = evictor.lock().await.tick().await;
        if report.stopped {
            return;
        }
    }
}
