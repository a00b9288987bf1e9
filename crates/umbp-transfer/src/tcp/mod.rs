//! `TcpEngine`: the remote data plane for machines without RDMA.
//!
//! Each node runs one [`DataServer`] over the host regions registered with its [`TcpEngine`]. A
//! registered region gets an id (fresh, never reused) and its [`TransferRef`] carries
//! (data endpoint, region id), so a peer can address it. A peer reads or writes a range of it by
//! (region id, offset, length); the server bounds-checks every request against the registered region
//! before touching memory and streams the payload straight between the socket and the region.
//! Connections to a peer are pooled and striped, and a batch is pipelined. The wire format is in
//! [`protocol`]; the contract mirrors the RDMA engine of the reference (`MoriIoEngine`), with one
//! difference: TCP needs no memory registration on the *local* side, so the local side of a pair may
//! be any host memory of this process — a region registered with this engine, or caller memory
//! registered with nobody. Unregistered caller memory therefore goes to the socket directly (no
//! bounce copy through the composite engine's pool); it must stay valid until the batch's handle
//! has been waited or dropped (see [`TcpEngine`]). Only the *remote* side must be registered: it is a
//! region of another node's data server.
//!
//! # GPU regions
//! An engine started with a GPU runtime ([`TcpEngine::with_gpu_runtime`]) also serves GPU regions
//! registered with it (an HBM medium's device memory): the data server stages their bytes through
//! a bounded host buffer per connection, copying with the runtime (see [`DataServer`]). Peers see
//! no difference. A GPU region is never the *local* side of this engine's own transfers.
//!
//! # Client only
//! A node that lends no memory starts its engine [`TcpEngine::client_only`]: no data server
//! listens (no port, no thread of a server) and its endpoint is "". It reaches peers as any engine
//! does; only memory for peers to reach cannot be registered with it.
//!
//! # Threads
//! The server: a gate thread that accepts every connection and runs every handshake over
//! non-blocking sockets (a connection that has not authenticated costs a descriptor, never a
//! thread), and one thread per authenticated connection. The client: per peer and connection, a
//! writer thread (lives as long as the engine) and a reader thread (lives as long as the
//! connection). No thread per request.
//!
//! # Under a flood
//! The data port is reachable by anyone who can route to it, so nothing an unauthenticated socket
//! can do takes what authenticated peers need: handshakes have a short deadline and their own caps
//! (in total and per source address), authenticated connections are capped in total and per
//! source address, and at every cap the oldest pending handshake or the connection idle longest
//! makes room for the newcomer (see [`DataServerConfig`] for the limits and their defaults).
//! Clients resend a request lost with a connection the server closed, once, on a fresh one. Every
//! per-connection warning is rate-limited per kind, with the count suppressed.

pub(crate) mod batch_wire;
mod client;
mod conns;
mod error;
mod gate;
mod io;
pub(crate) mod keyed;
mod keyed_client;
pub(crate) mod protocol;
mod regions;
mod server;
mod staging;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use umbp_core::{LocalRegion, MemoryRegistrar, MetricSample, MetricSource, RegistrationError, TransferRef};
use umbp_gpu::GpuRuntime;

pub use self::batch_wire::PutChecksum;
use self::client::{Batch, ClientShared, PeerPool, Peers, PlanMeta, Req, TcpHandle};
pub use self::error::TcpStartError;
/// The constant-time token comparison, shared with the shared-memory handshake.
pub(crate) use self::io::tokens_equal;
pub use self::keyed::{ClosingSlot, KeyedHandler, KeyedLease, KeyedRange, KeyedRead, KeyedSlot, KeyedWrite};
pub use self::keyed_client::{
    KeyedBatchItem, KeyedBatchPut, KeyedClient, KeyedClientConfig, KeyedError, KeyedGet, KeyedPut, SentGetBatch,
};
use self::protocol::{MAX_REQUEST_BYTES, Op};
use self::regions::LocalSide;
pub use self::server::{DataServer, DataServerConfig};
use crate::engine::{
    CompletedHandle, FailureKind, PlanSet, TransferDirection, TransferEngine, TransferFailure, TransferHandle,
    TransferItem, TransferPlan,
};
use crate::planning::{SideKey, plan_in_range, plan_pairs};

/// Settings of a [`TcpEngine`].
#[derive(Clone, PartialEq, Eq)]
pub struct TcpEngineConfig {
    /// The engine's own data server (where peers reach this node's registered regions). Default:
    /// [`DataServerConfig::default`] (loopback, OS-chosen port). Leave its `cluster_token` unset.
    pub server: DataServerConfig,
    /// The cluster token: presented to peers and required of them. Default: `None` (an empty token
    /// is presented, and any peer is served).
    pub cluster_token: Option<String>,
    /// Connections per peer; a batch is striped over them. Default: 4.
    pub connections_per_peer: usize,
    /// Timeout of a connection attempt. Default: 5 s.
    pub connect_timeout: Duration,
    /// Timeout of every socket read and write of the client, and of its whole handshake. A peer
    /// that makes no progress for this long fails every request on that connection with
    /// [`FailureKind::Timeout`]. Default: 30 s.
    pub io_timeout: Duration,
    /// The longest a submitted batch may take, from `submit` to its last reply, however the peer
    /// paces its bytes. When it passes, `wait` shuts down the connections carrying the batch (other
    /// batches on them fail too) and fails what is left with [`FailureKind::Timeout`]. Default: 60 s.
    pub batch_timeout: Duration,
    /// A pooled connection unused this long is closed (reconnected on next use). Keep it below the
    /// peers' server idle timeout. Default: 30 s.
    pub idle_timeout: Duration,
    /// The largest request: runs longer than this are split, so the stripes of a batch balance.
    /// Clamped to `1 ..= 1 GiB`. Default: 4 MiB.
    pub chunk_size: u64,
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for TcpEngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpEngineConfig")
            .field("server", &self.server)
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<redacted>"))
            .field("connections_per_peer", &self.connections_per_peer)
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("batch_timeout", &self.batch_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("chunk_size", &self.chunk_size)
            .finish()
    }
}

impl Default for TcpEngineConfig {
    fn default() -> Self {
        Self {
            server: DataServerConfig::default(),
            cluster_token: None,
            connections_per_peer: 4,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            batch_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30),
            chunk_size: 4 << 20,
        }
    }
}

/// Grace for stopping the engine's threads on drop (they finish queued work first).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

use umbp_core::metric_names::{
    TRANSFER_TCP_CONNECT_FAILURES_TOTAL as CONNECT_FAILURES_TOTAL,
    TRANSFER_TCP_CONNECT_FAILURES_TOTAL_HELP as CONNECT_FAILURES_HELP,
    TRANSFER_TCP_CONNECTIONS_OPENED_TOTAL as CONNECTIONS_OPENED_TOTAL,
    TRANSFER_TCP_CONNECTIONS_OPENED_TOTAL_HELP as CONNECTIONS_OPENED_HELP,
};

/// The TCP data plane: serves this node's registered host regions through its [`DataServer`] and
/// reads and writes peers' regions over pooled, striped, pipelined connections.
///
/// A ref is *remote* for this engine when it has a remote handle naming another endpoint. The engine
/// handles a pair when exactly one side is remote and the other is host memory of this process:
///
/// - memory registered with this engine (and still registered: a ref carrying this engine's handle
///   whose region was deregistered is refused, since its owner may have freed it). Its registration
///   guard is held while the batch may touch it, so `deregister` waits for the batch;
/// - or memory registered with no engine at all (a ref with a host local region and no remote
///   handle): the caller's buffer, used in place. Its validity is the caller's contract: the memory
///   must stay valid (and the caller must not use a pull's destination) until the handle of the
///   batch has been waited or dropped — dropping waits. This is what the [`LocalRegion`] invariant
///   already demands of whoever built the ref.
///
/// Either way every segment is bounded by the size of the ref the plan carries (planning and again
/// at submit). GPU memory is never a local side; GPU regions registered with an engine started
/// [`with_gpu_runtime`](Self::with_gpu_runtime) are served to peers through host staging.
#[derive(Debug)]
pub struct TcpEngine {
    config: TcpEngineConfig,
    server: DataServer,
    client: Arc<ClientShared>,
    peers: Peers,
}

impl TcpEngine {
    /// Starts the engine and its data server.
    ///
    /// # Errors
    /// The server cannot bind its address or spawn its thread; the token is longer than the
    /// protocol allows (1024 bytes) or conflicts with `server.cluster_token`; or the server listens
    /// on a wildcard address without an advertised endpoint.
    pub fn new(config: TcpEngineConfig) -> Result<Self, TcpStartError> {
        Self::start(config, None)
    }

    /// As [`new`](Self::new), and the data server serves GPU regions registered with the engine
    /// (memory of `runtime`'s devices), staging their bytes through host memory with `runtime`
    /// (see [`DataServer::start_with_gpu`]). Host regions are served as by [`new`](Self::new).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_gpu_runtime(config: TcpEngineConfig, runtime: Arc<dyn GpuRuntime>) -> Result<Self, TcpStartError> {
        Self::start(config, Some(runtime))
    }

    /// An engine that only reaches peers and serves none: no data server listens (no socket, no
    /// thread of a server), [`endpoint`](Self::endpoint) is "" and `config.server`'s address is
    /// not used. It reads and writes peers' regions exactly as [`new`](Self::new)'s does, from
    /// unregistered caller memory or from memory registered
    /// [local only](TransferEngine::register_local_only); registering memory for peers to reach
    /// ([`MemoryRegistrar::register_memory`]) fails with [`RegistrationError::Refused`]. For a node
    /// that lends no medium.
    ///
    /// # Errors
    /// The token is longer than the protocol allows (1024 bytes) or conflicts with
    /// `server.cluster_token`.
    pub fn client_only(config: TcpEngineConfig) -> Result<Self, TcpStartError> {
        Self::build(config, None, false)
    }

    fn start(config: TcpEngineConfig, gpu: Option<Arc<dyn GpuRuntime>>) -> Result<Self, TcpStartError> {
        Self::build(config, gpu, true)
    }

    fn build(config: TcpEngineConfig, gpu: Option<Arc<dyn GpuRuntime>>, serve: bool) -> Result<Self, TcpStartError> {
        if config.server.cluster_token.is_some() && config.server.cluster_token != config.cluster_token {
            return Err(TcpStartError::ConflictingTokens);
        }
        let token = config.cluster_token.as_deref().unwrap_or("").as_bytes();
        let hello = protocol::encode_hello(token)
            .map_err(|_| TcpStartError::TokenTooLong { len: token.len(), max: protocol::MAX_TOKEN_LEN })?;
        let server_config = DataServerConfig { cluster_token: config.cluster_token.clone(), ..config.server.clone() };
        let server = if serve {
            DataServer::start_with(server_config, Arc::default(), gpu)?
        } else {
            DataServer::unbound(server_config, Arc::default())
        };
        let client = Arc::new(ClientShared {
            connect_timeout: config.connect_timeout,
            io_timeout: config.io_timeout,
            idle_timeout: config.idle_timeout,
            hello,
            metrics: client::ClientMetrics::default(),
            warns: crate::warn::WarnLimiter::new(config.server.warn_interval),
        });
        Ok(Self { config, server, client, peers: Peers::default() })
    }

    /// The data endpoint of this node (`host:port`), as carried by registered refs; "" for a
    /// [client-only](Self::client_only) engine (nothing to advertise).
    pub fn endpoint(&self) -> &str {
        self.server.endpoint()
    }

    /// The configuration.
    pub fn config(&self) -> &TcpEngineConfig {
        &self.config
    }

    /// The engine's data server (one that does not listen, for a [client-only](Self::client_only)
    /// engine: see [`DataServer::is_listening`]).
    pub fn server(&self) -> &DataServer {
        &self.server
    }

    /// Closes the connections to `endpoint` once the work already submitted to it has finished (a
    /// later transfer to it connects again). For a peer that left the cluster.
    pub fn forget_peer(&self, endpoint: &str) {
        self.peers.forget(endpoint, Instant::now() + SHUTDOWN_GRACE);
    }

    /// Whether `r` names a region of another node.
    fn is_remote(&self, r: &TransferRef) -> bool {
        r.remote().is_some_and(|rr| rr.endpoint != self.endpoint())
    }

    /// Whether `r` can be the local side of a pair: host memory of this process that is either a
    /// live registration of this engine or registered with no engine (no remote handle).
    fn is_local_side(&self, r: &TransferRef) -> bool {
        match r.remote() {
            None => r.local_region().is_some_and(|l| l.location().is_host() && r.size() <= l.len()),
            Some(rr) if rr.endpoint == self.endpoint() => self.server.owns(r),
            Some(_) => false,
        }
    }

    /// Access to the local side `r` of a plan being submitted (see [`is_local_side`](Self::is_local_side)).
    fn local_side(&self, r: &TransferRef) -> Result<LocalSide, &'static str> {
        match r.remote() {
            None => {
                let region = r.local_region().ok_or("local side has no local memory")?;
                if !region.location().is_host() {
                    return Err("local side is not host memory");
                }
                if r.size() > region.len() {
                    return Err("local side claims more bytes than its region");
                }
                Ok(LocalSide::Caller { region: *region, len: r.size() })
            }
            Some(rr) if rr.endpoint == self.endpoint() => {
                self.server.guard(r).map(LocalSide::Registered).ok_or("local side is not a live region of this engine")
            }
            Some(_) => Err("local side names another endpoint"),
        }
    }

    fn chunk(&self) -> u64 {
        self.config.chunk_size.clamp(1, MAX_REQUEST_BYTES)
    }

    fn pool(&self, endpoint: &str) -> Arc<PeerPool> {
        self.peers.get(&self.client, endpoint, self.config.connections_per_peer.max(1))
    }

    /// Validates one plan and cuts it into requests; `Err` is the reason it fails locally.
    fn requests(&self, index: u32, plan: &TransferPlan, out: &mut Vec<Req>) -> Result<client::Guarded, String> {
        let (local, remote, op) = if self.is_remote(&plan.dst) && !self.is_remote(&plan.src) {
            (&plan.src, &plan.dst, Op::Write)
        } else if self.is_remote(&plan.src) && !self.is_remote(&plan.dst) {
            (&plan.dst, &plan.src, Op::Read)
        } else {
            return Err("plan does not have exactly one remote side".into());
        };
        if !plan_in_range(plan) {
            return Err("plan reaches outside its buffers".into());
        }
        let side = self.local_side(local)?;
        let Some(rr) = remote.remote() else { return Err("remote side has no remote handle".into()) };
        let chunk = self.chunk();
        for s in &plan.segments {
            let (local_off, remote_off) =
                if op == Op::Write { (s.src_offset, s.dst_offset) } else { (s.dst_offset, s.src_offset) };
            let mut done = 0u64;
            while done < s.len {
                let len = (s.len - done).min(chunk);
                let local_at = local_off.checked_add(done).ok_or("offset overflow")?;
                let remote_at = remote_off.checked_add(done).ok_or("offset overflow")?;
                let ptr = side.range(local_at, len).map_err(|_| "plan reaches outside its local region")?;
                out.push(Req { plan: index, op, region: rr.region_id, remote_offset: remote_at, local: ptr, len });
                done += len;
            }
        }
        Ok(client::Guarded { guard: side.into_guard(), endpoint: rr.endpoint.clone() })
    }
}

impl Drop for TcpEngine {
    fn drop(&mut self) {
        // Client workers first (they finish queued work); the server stops when its field drops.
        self.peers.shutdown(Instant::now() + SHUTDOWN_GRACE);
    }
}

impl MemoryRegistrar for TcpEngine {
    /// Host memory, and GPU memory when the engine was started with a runtime that has the device
    /// ([`with_gpu_runtime`](TcpEngine::with_gpu_runtime)); other GPU memory →
    /// [`RegistrationError::Unsupported`]. The ref carries `region` and (this engine's endpoint, a
    /// fresh region id). A [client-only](TcpEngine::client_only) engine serves no peers: →
    /// [`RegistrationError::Refused`].
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.server.register_memory(region)
    }

    /// Peers' later requests for the region fail with "unknown region"; blocks until every server
    /// request and local transfer touching the region has finished, so the caller may free the
    /// memory on return. A ref of another engine, or a second call, is a no-op.
    fn deregister(&self, r: &TransferRef) {
        self.server.deregister(r);
    }
}

const _: () = {
    const fn pin<T: Send + Sync>() {}
    pin::<TcpEngine>();
    pin::<DataServer>();
};

impl MetricSource for TcpEngine {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let mut out = Vec::new();
        let m = &self.client.metrics;
        let opened = m.connections_opened.load(Ordering::Relaxed);
        if opened > 0 {
            out.push(MetricSample::counter(CONNECTIONS_OPENED_TOTAL, CONNECTIONS_OPENED_HELP, Vec::new(), opened));
        }
        let failed = m.connect_failed.load(Ordering::Relaxed);
        let unauthorized = m.unauthorized.load(Ordering::Relaxed);
        for (reason, v) in [("unauthorized", unauthorized), ("other", failed.saturating_sub(unauthorized))] {
            if v > 0 {
                out.push(MetricSample::counter(
                    CONNECT_FAILURES_TOTAL,
                    CONNECT_FAILURES_HELP,
                    vec![("reason".to_owned(), reason.to_owned())],
                    v,
                ));
            }
        }
        self.server.sample_metrics(&mut out);
        out
    }
}

impl TransferEngine for TcpEngine {
    fn name(&self) -> &str {
        "TcpEngine"
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        (self.is_remote(dst) && self.is_local_side(src)) || (self.is_remote(src) && self.is_local_side(dst))
    }

    /// The region gets an id, so this engine accepts it as the local side, but the data server
    /// refuses peers' requests for it. Host memory only.
    fn register_local_only(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.server.register_local_only(region)
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        plan_pairs(items, |item| {
            if !self.can_handle(&item.src, &item.dst) {
                return None;
            }
            if self.is_remote(&item.dst) {
                Some((TransferDirection::Push, SideKey::local(&item.src)?, SideKey::remote(&item.dst)?))
            } else {
                Some((TransferDirection::Pull, SideKey::remote(&item.src)?, SideKey::local(&item.dst)?))
            }
        })
    }

    /// Validates every plan again (exactly one remote side; a local side that is a live
    /// registration of this engine or unregistered host memory; every segment inside both refs),
    /// cuts the plans into requests and hands them to the peers' connections. A registered local
    /// side is kept registered (its deregistration waits) until the batch is done; an unregistered
    /// one must be kept valid by the caller until the returned handle has been waited or dropped.
    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        let mut presettled = Vec::new();
        let mut metas = Vec::with_capacity(plans.len());
        let mut per_plan = Vec::with_capacity(plans.len());
        let mut guards = Vec::new();
        let mut by_peer: HashMap<String, Vec<Req>> = HashMap::new();
        let mut total = 0usize;
        let mut reqs = Vec::new();
        for (index, plan) in plans.iter().enumerate() {
            let Ok(index32) = u32::try_from(index) else {
                metas.push(PlanMeta { tags: Vec::new(), endpoint: String::new() });
                per_plan.push(0);
                presettled.push(TransferFailure::new(
                    plan.tags.clone(),
                    FailureKind::Local,
                    "too many plans",
                    self.name(),
                ));
                continue;
            };
            reqs.clear();
            match self.requests(index32, plan, &mut reqs) {
                Ok(client::Guarded { guard, endpoint }) => {
                    metas.push(PlanMeta { tags: plan.tags.clone(), endpoint: endpoint.clone() });
                    per_plan.push(reqs.len());
                    if !reqs.is_empty() {
                        guards.extend(guard);
                        total += reqs.len();
                        by_peer.entry(endpoint).or_default().append(&mut reqs);
                    }
                }
                Err(message) => {
                    metas.push(PlanMeta { tags: Vec::new(), endpoint: String::new() });
                    per_plan.push(0);
                    presettled.push(TransferFailure::new(plan.tags.clone(), FailureKind::Local, message, self.name()));
                }
            }
        }
        if total == 0 {
            return Ok(Box::new(CompletedHandle::new(presettled)));
        }
        let deadline = Instant::now() + self.config.batch_timeout;
        let batch = Arc::new(Batch::new(metas, per_plan, guards, deadline));
        for (endpoint, reqs) in by_peer {
            self.pool(&endpoint).submit(&batch, reqs);
        }
        Ok(Box::new(TcpHandle::new(batch, presettled)))
    }
}
