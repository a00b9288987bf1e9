//! `PoolClient`: the composition root of a node, and the API a client uses.
//!
//! It is the only place that names concrete media and transfer engines: it builds the composite
//! engine (local copy + TCP, plus GPU copy when the node lends HBM or `gpu_runtime` asks for it), the
//! node's one medium from [`Medium`] with a `match`, `init`s it with the engine as registrar,
//! registers it, starts the peer service and the heartbeat, and offers `put` / `get` / `exists` /
//! `remove` / `clear` / `flush` over the whole pool.
//!
//! Puts and gets follow the reference flow — route at the master, allocate or resolve on the peer,
//! move bytes with the transfer engine, commit or abort — with every peer's RPCs issued
//! concurrently and every transfer submitted before any wait, and, unlike the reference, a bounded
//! re-route in which each key excludes the nodes that failed *it*. Results are per key.
//!
//! Safety rules the paths keep (see `put` and `get`):
//! - a read whose copy ends after the read lease taken by its resolve is discarded, never a hit;
//! - a write never starts, and is never committed, after its slot's pending TTL (minus a margin);
//! - every allocated slot not committed is aborted, also when the call's future is dropped;
//! - `close` waits for the batches in flight (an operation gate) before unmapping anything; calls
//!   after it fail with [`KeyError::Closed`].
//!
//! Descriptors in allocate and resolve replies replace differing cached ones (a peer restarted on the
//! same address publishes new handles); a failed transfer forgets the peer's descriptors and
//! connection, and a peer that cannot be reached is left out of routes for 2 s.

mod batch_keyed;
mod builder;
mod checksum;
mod compose;
mod config;
mod error;
mod external;
mod fast;
mod get;
mod holder;
mod metrics;
pub mod phases;
mod put;
mod ranged;
mod same_host_put;
pub use ranged::{PutParts, RawParts};
mod support;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{RwLock, mpsc};
use umbp_core::{
    BackendRegistry, Clock, LocalRegion, MediumBackend, MemoryLocation, MemoryRegistrar, MetricSource, TierType,
    TransferRef,
};
use umbp_metrics::{MetricsConfig, MetricsExporter, MetricsServer};
use umbp_transfer::shm::ShmClient;
use umbp_transfer::{
    CompositeTransferEngine, FailureKind, KeyedClient, KeyedClientConfig, PeerDirectory, SumOf, TransferEngine,
    TransferItem,
};

use crate::master_client::{MasterClient, MasterClientConfig, NodeRegistration};
use crate::peer_client::{PeerClient, PeerClientConfig, Peers};
use crate::peer_service::{KeyedMedia, PeerServer, PeerServerConfig, PeerServerHandle, PeerService};
pub use builder::PoolClientBuilder;
use compose::{Composed, compose};
#[cfg(feature = "cxl")]
pub use config::CxlConfig;
#[cfg(feature = "hbm")]
pub use config::HbmConfig;
#[cfg(feature = "object")]
pub use config::ObjectSettings;
pub use config::{DramConfig, Medium, PoolClientConfig, RecachePolicy, RuntimeSelection};
#[cfg(feature = "ssd")]
pub use config::{IoEngineKind, SsdConfig};
pub use error::{KeyError, PoolError, SharedError};
pub(crate) use put::slot_deadline;
use support::{CallerBuf, RecacheJob, StatCounters, blocking, offload, page_items, recache_worker};

/// What a successful put did with its key. Values are write-once: a key the pool already holds
/// keeps its stored value, and the caller's bytes are not written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PutOutcome {
    /// The caller's bytes are now the key's value.
    Written,
    /// The pool already held the key; its stored value was kept (remove it first to replace it).
    AlreadyPresent,
}

/// Counters of what the client did (cumulative since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolClientStats {
    /// Keys sent to the master again after a failed attempt (put or get).
    pub reroutes: u64,
    /// Reads discarded because the copy outlived the read lease.
    pub lease_lapses: u64,
    /// Writes aborted because the slot's pending TTL (minus a margin) passed.
    pub slot_expiries: u64,
    /// Re-cache jobs queued.
    pub recache_queued: u64,
    /// Re-cache jobs dropped because the queue was full.
    pub recache_dropped: u64,
    /// Re-cache jobs that stored the value locally.
    pub recache_stored: u64,
    /// Keys read in a keyed exchange with their holder (no routed resolve): single-key gets, and
    /// batch gets from holders on this host (one exchange per holder chunk).
    pub keyed_gets: u64,
    /// Puts written in one keyed exchange with the holder (no allocate or commit RPC): single-key
    /// puts, and batch puts to holders on this host (one exchange per holder chunk).
    pub keyed_puts: u64,
    /// Keys of batch puts written on a holder on this host from copies made while the master was
    /// still routing them (a light client whose batches go to one holder here).
    pub puts_copied_ahead: u64,
    /// Keys copied ahead of their route and then not kept: the master placed them elsewhere or
    /// found them present (their slots were aborted; the keys were settled as it said).
    pub puts_withdrawn: u64,
    /// Reads whose bytes did not match the checksum they were put with: discarded, never returned
    /// (the key was read from another holder or reported a miss).
    pub checksum_failures: u64,
}

/// How long a node that could not be reached is left out of every route.
const UNREACHABLE_FOR: Duration = Duration::from_secs(2);
/// A gauge not refreshed for this long leaves the metrics output (its source went away).
const METRICS_IDLE: Duration = Duration::from_secs(30);
/// Capacity of the re-cache queue; new jobs are dropped when it is full.
const RECACHE_QUEUE: usize = 1024;
/// How often the shared-memory mappings of dead or deregistered holders' regions are dropped
/// (see `ShmSweeper`).
pub const SHM_SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The background task that unmaps same-host holders' memory once it is no longer theirs to share.
///
/// A mapping of a holder's memory file keeps the file's pages alive: without this, a reader that
/// once mapped a holder's region would keep the holder's whole arena resident after the holder
/// deregistered it, exited or crashed, until the reader itself exits (on a real host, a crashed
/// 100 GB node staying in memory). Every [`SHM_SWEEP_EVERY`], and at once when the client finds
/// a holder unreachable ([`wake`](Self::wake)), it runs `ShmClient::sweep` on the blocking pool (a
/// large `munmap` takes a while). It stops at `close`, or when the client is dropped (it holds
/// the `ShmClient` weakly).
#[derive(Debug)]
struct ShmSweeper {
    client: Arc<ShmClient>,
    wake: Arc<tokio::sync::Notify>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl ShmSweeper {
    fn start(client: Arc<ShmClient>) -> Self {
        let wake = Arc::new(tokio::sync::Notify::new());
        let weak = Arc::downgrade(&client);
        let woken = Arc::clone(&wake);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(SHM_SWEEP_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = woken.notified() => {}
                }
                let Some(client) = weak.upgrade() else { return };
                if tokio::task::spawn_blocking(move || client.sweep()).await.is_err() {
                    return;
                }
            }
        });
        Self { client, wake, task: Mutex::new(Some(task)) }
    }

    /// Sweeps now (a holder was found unreachable).
    fn wake(&self) {
        self.wake.notify_one();
    }

    /// Stops the task and drops every connection and mapping.
    fn stop(&self) {
        if let Some(task) = self.task.lock().take() {
            task.abort();
        }
        self.client.clear();
    }
}

/// A node of the pool (with or without a medium) and the client API over the whole pool.
///
/// ```no_run
/// use umbp_peer::pool_client::{KeyError, PoolClient};
///
/// # async fn run() -> Result<(), umbp_peer::pool_client::PoolError> {
/// // A client-only node (it lends nothing) of the master at 127.0.0.1:50051.
/// let client = PoolClient::builder("reader-1", "127.0.0.1:50051").start().await?;
/// let results = client.batch_put(&[("a", b"first".as_slice()), ("b", b"second".as_slice())]).await;
/// assert!(results.iter().all(Result::is_ok));
/// let mut buf = vec![0u8; 16];
/// match client.get("a", &mut buf).await {
///     Ok(len) => assert_eq!(&buf[..len as usize], b"first"),
///     Err(e) if e.is_retryable() => { /* busy, full or unreachable for now: try again */ }
///     Err(KeyError::Miss) => { /* evicted meanwhile */ }
///     Err(e) => panic!("{e}"),
/// }
/// client.close().await;
/// # Ok(())
/// # }
/// ```
///
/// Transfers, and calls on a medium that does drive IO (SSD), run on tokio's blocking pool and are
/// awaited, so the chunks of a batch overlap them; a memory-only medium's calls run under
/// `block_in_place` on a multi-threaded tokio runtime, and inline on a current-thread runtime
/// (correct, but it stalls that runtime for the duration).
#[derive(Debug)]
pub struct PoolClient {
    config: PoolClientConfig,
    medium: Option<Arc<dyn MediumBackend>>,
    /// Whether the medium's calls do drive IO (set by the medium switch; see `medium_call`).
    medium_drive_io: bool,
    engine: Arc<CompositeTransferEngine>,
    data_endpoint: String,
    master: Arc<MasterClient>,
    peer_server: Mutex<Option<PeerServerHandle>>,
    /// Connections to other nodes' peer services, and the nodes that did not answer lately (left
    /// out of routes for [`UNREACHABLE_FOR`]).
    peers: Arc<Peers>,
    directory: PeerDirectory,
    /// Caller memory registered for zero copy: base address → (length, ref).
    user_regions: Mutex<BTreeMap<usize, (u64, TransferRef)>>,
    /// The operation gate: batches hold it shared, `close` exclusively; `true` once closed.
    gate: RwLock<bool>,
    recache_tx: Mutex<Option<mpsc::Sender<RecacheJob>>>,
    recache_worker: Mutex<Option<tokio::task::JoinHandle<()>>>,
    stats: Arc<StatCounters>,
    /// The Prometheus endpoint, when configured.
    metrics: Mutex<Option<MetricsServer>>,
    /// Read releases in flight (see `get`); `close` waits for them.
    releases: support::Releases,
    /// What the read-lease and slot-TTL checks measure time with (the media's own clock is theirs).
    clock: Arc<dyn Clock>,
    /// Keyed gets and puts: one exchange with a holder's data server (see `fast.rs`).
    keyed: Arc<KeyedClient>,
    /// Where keys were last read or written (see `fast.rs`).
    locations: Arc<fast::Locations>,
    /// The holder on this host a light client's batch puts copy into ahead of their route (see
    /// `same_host_put.rs`).
    sole_put_holder: same_host_put::SoleHolder,
    /// Keys read without a route call, told to the master in batches (see `fast.rs`).
    hints: Arc<fast::Hints>,
    /// Unmaps dead or deregistered holders' memory (with `shared_memory`).
    shm_sweeper: Option<ShmSweeper>,
    /// The GPU copy engine's runtime, when the node has one (see [`pointer_device`](Self::pointer_device)).
    gpu_runtime: Option<Arc<dyn umbp_gpu::GpuRuntime>>,
}

impl PoolClient {
    /// Starts a node: transfer engines, the medium, the peer service, registration and the heartbeat.
    /// A node that lends no medium starts no data server and no peer service, and registers (and
    /// heartbeats) only when it serves `/metrics` or sets
    /// [`register_client`](PoolClientConfig::register_client): see
    /// [`PoolClientConfig::registers`].
    pub async fn start(config: PoolClientConfig) -> Result<Self, PoolError> {
        Self::start_with_clock(config, umbp_core::SystemClock::shared()).await
    }

    /// [`start`](Self::start) with the clock the client's read-lease and slot-TTL checks read.
    pub(crate) async fn start_with_clock(config: PoolClientConfig, clock: Arc<dyn Clock>) -> Result<Self, PoolError> {
        if config.node_id.is_empty() || config.master_address.is_empty() {
            return Err(PoolError::Config("node_id and master_address are required".into()));
        }
        if config.page_size == 0 {
            return Err(PoolError::Config("page_size must be greater than 0".into()));
        }
        let Composed { engine, tcp, data_endpoint, medium, medium_drive_io, shm_client, gpu_runtime } =
            compose(&config)?;
        let mut registry = BackendRegistry::new();
        if let Some(m) = &medium {
            m.init(Arc::clone(&engine) as Arc<dyn MemoryRegistrar>)?;
            registry.register(Arc::clone(m))?;
        }
        let registry = Arc::new(registry);
        // Before registering with the master: a node whose endpoint cannot bind never joins.
        let metrics = match config.metrics_listen {
            Some(listen) => {
                let exporter =
                    Arc::new(MetricsExporter::new(&[("node".to_owned(), config.node_id.clone())], METRICS_IDLE));
                if let Some(m) = &medium {
                    exporter.add_backend(m);
                }
                exporter.add_source("transfer", Vec::new(), Arc::clone(&engine) as Arc<dyn MetricSource + Send + Sync>);
                Some(MetricsServer::start(exporter, &MetricsConfig::new(listen)).await?)
            }
            None => None,
        };
        let service = PeerService::new(Arc::clone(&registry), data_endpoint.clone());
        if medium.is_some() && config.keyed_requests {
            // The data server answers keyed gets and puts from the same media, in one exchange.
            let keyed = KeyedMedia::new(&service, config.read_lease, config.pending_ttl);
            tcp.server().set_keyed_handler(Some(Arc::new(keyed)));
        }
        let keyed_config = KeyedClientConfig {
            cluster_token: config.cluster_token.clone(),
            connect_timeout: config.rpc_timeout,
            io_timeout: tcp.config().io_timeout,
            ..KeyedClientConfig::default()
        };
        // Single keys map holders' regions through the engine's client: one connection and one
        // mapping per holder region for the whole node.
        let keyed = match &shm_client {
            Some(shm) => KeyedClient::with_shm_client(keyed_config, Arc::clone(shm)),
            None => KeyedClient::new(keyed_config),
        };
        let keyed = Arc::new(keyed.map_err(|e| PoolError::Config(format!("cluster_token: {e}")))?);
        let peer_server = match &medium {
            Some(_) => Some(
                PeerServer::start(
                    PeerServerConfig {
                        listen: config.peer_listen,
                        cluster_token: config.cluster_token.clone(),
                        ..PeerServerConfig::default()
                    },
                    service.clone(),
                )
                .await?,
            ),
            None => None,
        };
        // Peers must reach this node: a wildcard bind is advertised as `node_address:port`.
        let peer_address = peer_server
            .as_ref()
            .map(|s| {
                let addr = s.local_addr();
                if addr.ip().is_unspecified() {
                    format!("{}:{}", config.node_address, addr.port())
                } else {
                    addr.to_string()
                }
            })
            .unwrap_or_default();
        let node = NodeRegistration::new(&config.node_id, &config.node_address)
            .with_peer_address(peer_address)
            .with_data_endpoint(data_endpoint.clone());
        let master_config = MasterClientConfig { cluster_token: config.cluster_token.clone(), ..config.master.clone() };
        let master = Arc::new(MasterClient::connect(&config.master_address, master_config, node, registry).await?);
        let peers = Peers::new(PeerClientConfig {
            timeout: config.rpc_timeout,
            token: config.cluster_token.clone(),
            unreachable_for: UNREACHABLE_FOR,
        })
        .map_err(|e| PoolError::Config(format!("cluster_token: {e}")))?;
        // A light client (no medium, no /metrics, no opt-in: `PoolClientConfig::registers`) never
        // registers: the master's route and lookup calls take its id only for affinity, and `close`
        // has nothing to unregister (`MasterClient::shutdown` sends nothing for a node that never
        // registered).
        if config.registers() {
            master.register().await?;
            master.start_heartbeat()?;
        }
        // Remote writers' commits land here: wake the heartbeat so the master indexes them at once.
        let weak = Arc::downgrade(&master);
        service.set_change_hook(Some(Arc::new(move || {
            if let Some(m) = weak.upgrade() {
                m.flush();
            }
        })));
        let stats = Arc::new(StatCounters::default());
        if let Some(m) = &metrics {
            m.exporter().add_source("client", Vec::new(), Arc::new(metrics::ClientMetrics(Arc::clone(&stats))));
        }
        let (recache_tx, recache_worker) = match (&medium, config.recache) {
            (Some(m), policy) if policy != RecachePolicy::Off => {
                let (tx, rx) = mpsc::channel(RECACHE_QUEUE);
                let worker = tokio::spawn(recache_worker(
                    rx,
                    Arc::clone(m),
                    Arc::clone(&engine),
                    Arc::downgrade(&master),
                    Arc::clone(&stats),
                ));
                (Some(tx), Some(worker))
            }
            _ => (None, None),
        };
        match config.medium.summary() {
            // A client-only node is usually one CLI command: not worth an info line each.
            None => tracing::debug!(node = %config.node_id, data = %data_endpoint, "client started"),
            Some(medium) => tracing::info!(node = %config.node_id, data = %data_endpoint, "node started {medium}"),
        }
        let shm_sweeper = shm_client.map(ShmSweeper::start);
        Ok(Self {
            config,
            medium,
            medium_drive_io,
            engine,
            data_endpoint,
            master,
            peer_server: Mutex::new(peer_server),
            peers,
            directory: PeerDirectory::new(),
            user_regions: Mutex::new(BTreeMap::new()),
            gate: RwLock::new(false),
            recache_tx: Mutex::new(recache_tx),
            recache_worker: Mutex::new(recache_worker),
            stats,
            metrics: Mutex::new(metrics),
            releases: support::Releases::default(),
            clock,
            keyed,
            locations: Arc::default(),
            sole_put_holder: same_host_put::SoleHolder::default(),
            hints: Arc::default(),
            shm_sweeper,
            gpu_runtime,
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.config.node_id
    }

    /// The peer service address, when the node lends a medium.
    pub fn peer_address(&self) -> Option<SocketAddr> {
        self.peer_server.lock().as_ref().map(PeerServerHandle::local_addr)
    }

    /// The TCP data endpoint; "" for a node that lends no medium (it serves no data).
    pub fn data_endpoint(&self) -> &str {
        &self.data_endpoint
    }

    /// The master client (stats, cluster status).
    pub fn master(&self) -> &MasterClient {
        &self.master
    }

    /// Where Prometheus `/metrics` is served, when configured (`metrics_listen`).
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics.lock().as_ref().map(MetricsServer::local_addr)
    }

    /// The node's medium, if it lends one (wrapped in `InstrumentedBackend` when `metrics_listen` is
    /// set).
    pub fn medium(&self) -> Option<&Arc<dyn MediumBackend>> {
        self.medium.as_ref()
    }

    /// What the client did so far.
    pub fn stats(&self) -> PoolClientStats {
        self.stats.snapshot()
    }

    /// Bytes the transfer engine named `engine` moved for this node so far (`"LocalCopyEngine"`,
    /// `"SharedMemoryEngine"`, `"TcpEngine"`, `"GpuCopyEngine"`): which path the batches' bytes took.
    ///
    /// `"SharedMemoryEngine"` also counts the bytes of keyed single-key gets and puts (see
    /// `keyed_requests`) copied through a mapping of a same-host holder's memory, so it is every
    /// byte this node moved through shared memory. Keyed exchanges whose bytes travel on the data
    /// plane's own connections are counted under no name: `"TcpEngine"` is the batches' TCP
    /// transfers only.
    pub fn transferred_bytes(&self, engine: &str) -> u64 {
        let moved = self.engine.moved_bytes(engine);
        if engine == "SharedMemoryEngine" { moved + self.keyed.shared_copies().2 } else { moved }
    }

    /// Connections to same-host holders' shared-memory servers, and mappings of their regions,
    /// held now (both 0 with `shared_memory` off): for diagnostics and tests of the one client
    /// the engine and the keyed path share.
    pub fn shared_memory_peers(&self) -> (usize, usize) {
        self.shm_sweeper.as_ref().map_or((0, 0), |s| (s.client.peer_count(), s.client.cached_regions()))
    }

    /// A holder was found unreachable: drop its (and any other dead holder's) mappings now.
    fn sweep_shared_memory(&self) {
        if let Some(sweeper) = &self.shm_sweeper {
            sweeper.wake();
        }
    }

    /// Registers caller memory for zero-copy puts and gets. The memory is registered **local only**:
    /// this node's engines can move it, but no peer can address it. A range that overlaps one
    /// already registered is refused ([`PoolError::Config`]): deregister the old one first.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until
    /// [`deregister_memory`](Self::deregister_memory) returns or the client is closed.
    pub unsafe fn register_memory(&self, ptr: NonNull<u8>, len: u64) -> Result<(), PoolError> {
        // SAFETY: this function's contract is `register_memory_at`'s, with host memory.
        unsafe { self.register_memory_at(ptr, len, MemoryLocation::Host) }
    }

    /// Registers caller memory at `location` for zero-copy puts and gets: with
    /// [`MemoryLocation::Gpu`], the caller's own device buffers, which the GPU copy engine moves to and
    /// from this node's medium with no host copy. Registered local only, as
    /// [`register_memory`](Self::register_memory); a range overlapping one already registered is
    /// refused. Device memory is then put from and got into with the raw entry points,
    /// [`batch_put_raw`](Self::batch_put_raw) and [`batch_get_raw`](Self::batch_get_raw), which take
    /// pointers and lengths: a Rust slice (`&[u8]` / `&mut [u8]`) over device memory is undefined
    /// behaviour, so never build one. The client never dereferences a device range itself, only the
    /// engine that registered it copies. A value on another node reaches a GPU buffer (and a GPU
    /// buffer's value another node) through the bounce pool: the network lands in it and the GPU
    /// engine copies on, so [`PoolClientConfig::bounce_bytes`] must hold the largest such value.
    ///
    /// # Safety
    /// As [`register_memory`](Self::register_memory), and `location` is where the memory really lives
    /// (a wrong location selects the wrong engine).
    pub unsafe fn register_memory_at(
        &self,
        ptr: NonNull<u8>,
        len: u64,
        location: MemoryLocation,
    ) -> Result<(), PoolError> {
        let base = ptr.as_ptr() as usize;
        let end = usize::try_from(len)
            .ok()
            .and_then(|l| base.checked_add(l))
            .ok_or_else(|| PoolError::Config(format!("{len} bytes at {ptr:p} do not fit the address space")))?;
        // Held across the registration: two racing registrations of one range cannot both pass.
        let mut regions = self.user_regions.lock();
        let overlapping = regions
            .range(..end.max(base + 1))
            .next_back()
            .filter(|(b, (l, _))| **b == base || (**b as u64).saturating_add(*l) > base as u64);
        if let Some((b, (l, _))) = overlapping {
            return Err(PoolError::Config(format!(
                "{len} bytes at {ptr:p} overlap a registered range ({l} bytes at {b:#x}): deregister it first"
            )));
        }
        // SAFETY: the caller guarantees validity until deregistration and the location (this
        // function's contract).
        let region = unsafe { LocalRegion::new(ptr, len, location) };
        let r = self
            .engine
            .register_local_only(region)
            .map_err(|e| PoolError::Transfer { context: "registering caller memory", source: Box::new(e) })?;
        regions.insert(base, (len, r));
        Ok(())
    }

    /// The device whose memory `ptr` points into, as this node's GPU runtime tells it: `None` for
    /// host memory, or when the node has no GPU runtime (no GPU copy engine could move device
    /// memory anyway). How a binding handed a bare address (SGLang registers its GPU KV pools so)
    /// picks [`register_memory_at`](Self::register_memory_at)'s location.
    ///
    /// # Errors
    /// The runtime failed to answer ([`PoolError::Transfer`]).
    pub fn pointer_device(&self, ptr: NonNull<u8>) -> Result<Option<u32>, PoolError> {
        let Some(runtime) = &self.gpu_runtime else { return Ok(None) };
        runtime.pointer_device(ptr).map_err(|e| PoolError::Transfer {
            context: "asking the GPU runtime about an address",
            source: Box::new(e),
        })
    }

    /// Whether the node has a GPU copy engine (an HBM medium, or [`PoolClientConfig::gpu_runtime`]
    /// found a runtime): device memory can be registered and moved.
    pub fn has_gpu_runtime(&self) -> bool {
        self.gpu_runtime.is_some()
    }

    /// Undoes [`register_memory`](Self::register_memory); unknown pointers are ignored.
    pub fn deregister_memory(&self, ptr: NonNull<u8>) {
        if let Some((_, r)) = self.user_regions.lock().remove(&(ptr.as_ptr() as usize)) {
            self.engine.deregister(&r);
        }
    }

    /// The ref for caller memory: the registered region covering it (zero copy), else an
    /// unregistered host ref (staged through the bounce pool when a peer is on the other side).
    fn caller_ref(&self, buf: CallerBuf) -> (TransferRef, u64) {
        let addr = buf.ptr.as_ptr() as usize;
        if let Some((base, (rlen, r))) = self.user_regions.lock().range(..=addr).next_back()
            && addr.checked_add(buf.len).is_some_and(|end| end <= base + *rlen as usize)
        {
            return (r.clone(), (addr - base) as u64);
        }
        // SAFETY: the caller's slice is borrowed for the whole batch call, which waits for every
        // transfer (and drains on every exit path) before returning.
        let region = unsafe { LocalRegion::new(buf.ptr, buf.len as u64, MemoryLocation::Host) };
        (TransferRef::local(region), 0)
    }

    /// Whether `buf` overlaps caller memory registered at a non-host location (device buffers the
    /// CPU must never read).
    fn in_device_registration(&self, buf: CallerBuf) -> bool {
        let addr = buf.ptr.as_ptr() as usize;
        let end = addr.saturating_add(buf.len).max(addr.saturating_add(1));
        self.user_regions
            .lock()
            .range(..end)
            .rev()
            // Registered ranges never overlap, so their ends grow with their bases: walking down from
            // `end`, the first range ending at or before `addr` ends the overlapping ones.
            .take_while(|(base, (rlen, _))| (**base as u64).saturating_add(*rlen) > addr as u64)
            .any(|(_, (_, r))| !r.location().is_host())
    }

    /// Nodes that failed to answer within the last [`UNREACHABLE_FOR`].
    fn recently_unreachable(&self) -> Vec<String> {
        self.peers.recently_unreachable()
    }

    /// A transfer with `node` failed: its descriptors may be stale (a restart), so forget them and
    /// the connection; the next contact asks `GetPeerInfo` again.
    fn forget_peer(&self, node: &str) {
        self.peers.forget(node);
        self.directory.forget(node);
        self.sweep_shared_memory();
    }

    /// The connection to `node` at `address`: the open one, else a new one, whose `GetPeerInfo` is
    /// authoritative for the peer's buffers. A node that cannot be reached is marked unreachable.
    async fn peer(&self, node: &str, address: &str) -> Result<PeerClient, KeyError> {
        if let Some(client) = self.peers.cached(node, address) {
            return Ok(client);
        }
        let previous = self.peers.open(node).map(|c| c.data_endpoint().to_owned());
        let (client, info) = self.peers.connect(node, address).await.map_err(|e| holder::unreachable(node, e))?;
        if previous.as_ref().is_some_and(|p| *p != info.data_endpoint) {
            tracing::info!(node, old = ?previous, new = %info.data_endpoint, "peer's data endpoint changed");
        }
        // Atomic: readers see the old table or the new one.
        self.directory.reset_remote_buffers(node, &info.descs);
        self.peers.keep(&client);
        Ok(client)
    }

    /// Plans, submits and waits for `items`; returns the failed tags with the failure's kind and
    /// message.
    async fn run_transfers(&self, items: Vec<TransferItem>) -> HashMap<u64, (FailureKind, String)> {
        if items.is_empty() {
            return HashMap::new();
        }
        let tags: Vec<u64> = items.iter().map(|t| t.tag).collect();
        let engine = Arc::clone(&self.engine);
        // Copies and the TCP engine's wait block: run them on the blocking pool so this task can
        // prepare the next chunk meanwhile. A dropped call waits for them (see `Offloaded`).
        let result = offload(move || umbp_transfer::transfer(engine.as_ref(), &items))
            .await
            .unwrap_or_else(|| Err(vec![panicked(tags)]));
        failed_by_tag(result.err().unwrap_or_default())
    }

    /// [`run_transfers`](Self::run_transfers) through an engine that sums each value as it copies
    /// (`sum_of`: what lands, for a read; what it reads, for a write): each tag's CRC-32C beside the
    /// failures. An engine that does not sum these items moved nothing: they are then run as
    /// usual, with no sums.
    async fn run_transfers_summed(
        &self,
        items: Vec<TransferItem>,
        sum_of: SumOf,
    ) -> (HashMap<u64, (FailureKind, String)>, HashMap<u64, u32>) {
        if items.is_empty() {
            return (HashMap::new(), HashMap::new());
        }
        let tags: Vec<u64> = items.iter().map(|t| t.tag).collect();
        let engine = Arc::clone(&self.engine);
        // As `run_transfers`: the copies block, and a dropped call waits for them (`Offloaded`).
        let summed = offload(move || {
            let summed = engine.transfer_summed(&items, sum_of);
            (summed, items)
        })
        .await;
        match summed {
            Some((Some(summed), _)) => (failed_by_tag(summed.failures), summed.sums),
            Some((None, items)) => (self.run_transfers(items).await, HashMap::new()),
            // The copy panicked (it cannot): whether any byte landed is unknown, so every key fails.
            None => (failed_by_tag(vec![panicked(tags)]), HashMap::new()),
        }
    }

    /// Whether the pool holds `key`.
    pub async fn exists(&self, key: &str) -> Result<bool, KeyError> {
        self.batch_exists(&[key]).await.map(|v| v.first().copied().unwrap_or(false))
    }

    /// Whether the pool holds each key (the master's index, or this node's medium for keys written
    /// here that the master has not heard of yet).
    ///
    /// Only the keys the master missed are checked locally, with `batch_resolve`: that takes the
    /// medium's short read lease on a hit, which is harmless (it only delays an eviction by
    /// `read_lease`).
    pub async fn batch_exists(&self, keys: &[&str]) -> Result<Vec<bool>, KeyError> {
        let gate = self.gate.read().await;
        if *gate {
            return Err(KeyError::Closed);
        }
        let owned: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let mut found = self.master.batch_lookup(&owned).await.map_err(|e| KeyError::Routing(e.into()))?;
        if let Some(m) = &self.medium {
            let missed: Vec<usize> = (0..found.len()).filter(|i| !found[*i]).collect();
            if !missed.is_empty() {
                let missed_keys: Vec<String> = missed.iter().map(|i| owned[*i].clone()).collect();
                // A lookup, not a read: charted as op="lookup", never as resolve bytes or hits.
                let held = blocking(|| m.batch_contains(&missed_keys));
                for (i, hit) in missed.iter().zip(held) {
                    found[*i] = hit;
                }
            }
        }
        Ok(found)
    }

    /// Drops every replica of each key the pool knows of; returns the bytes freed per key (0 for a
    /// key no node held or that a reader's lease protected right now).
    pub async fn remove(&self, keys: &[&str]) -> Result<Vec<u64>, KeyError> {
        let gate = self.gate.read().await;
        if *gate {
            return Err(KeyError::Closed);
        }
        let owned: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let mut freed = vec![0u64; keys.len()];
        if let Some(m) = &self.medium {
            for (f, r) in freed.iter_mut().zip(blocking(|| m.evict(&owned))) {
                *f += r.bytes_freed;
            }
        }
        let status = self.master.cluster_status().await.map_err(|e| KeyError::Routing(e.into()))?;
        for node in status.nodes {
            if node.node_id == self.config.node_id || node.peer_address.is_empty() {
                continue;
            }
            let Ok(client) = self.peer(&node.node_id, &node.peer_address).await else { continue };
            if let Ok(bytes) = client.evict(owned.clone()).await {
                for (f, b) in freed.iter_mut().zip(bytes) {
                    *f += b;
                }
            }
        }
        self.master.flush();
        Ok(freed)
    }

    /// Clears this node's medium (and tells the master); writes reopen once the master acknowledges.
    pub async fn clear(&self) -> Result<(), PoolError> {
        let gate = self.gate.read().await;
        if *gate {
            return Err(PoolError::Closed);
        }
        Ok(self.master.clear().await?)
    }

    /// Sends queued ownership changes to the master now.
    pub fn flush(&self) {
        self.master.flush();
    }

    /// Leaves the cluster: waits for every batch in flight (later calls fail with
    /// [`KeyError::Closed`]), stops the re-cache worker and the heartbeat, unregisters (a light
    /// client, never registered, sends nothing), stops the peer service, then shuts the medium down
    /// (deregistering before releasing its memory). Idempotent.
    pub async fn close(&self) {
        let mut closed = self.gate.write().await;
        if *closed {
            return;
        }
        *closed = true;
        // A short-lived client's reads must reach their holders' release before it goes (bounded: a
        // release that cannot land only leaves the lease to expire).
        self.releases.drain(self.config.rpc_timeout.min(Duration::from_secs(2))).await;
        // The worker copies into the medium: drain it before the medium goes.
        drop(self.recache_tx.lock().take());
        let worker = self.recache_worker.lock().take();
        if let Some(worker) = worker {
            let _ = worker.await;
        }
        if let Err(e) = self.master.shutdown().await {
            tracing::warn!(error = %e, "unregister did not land; the master will expire this node");
        }
        let server = self.peer_server.lock().take();
        if let Some(server) = server {
            server.shutdown().await;
        }
        self.peers.clear();
        if let Some(metrics) = self.metrics.lock().take() {
            metrics.shutdown();
        }
        if let Some(m) = &self.medium {
            m.shutdown();
        }
        // Every region is deregistered (peers' mappings read as stale): close the socket too.
        if let Some(server) = self.engine.shm_server() {
            server.shutdown();
        }
        // Nothing is read or written after this: let go of every holder's memory.
        if let Some(sweeper) = &self.shm_sweeper {
            sweeper.stop();
        }
        let regions: Vec<TransferRef> =
            std::mem::take(&mut *self.user_regions.lock()).into_values().map(|(_, r)| r).collect();
        for r in regions {
            self.engine.deregister(&r);
        }
    }
}

/// A transfer that panicked (it cannot): every tag failed, as nothing says which bytes landed.
fn panicked(tags: Vec<u64>) -> umbp_transfer::TransferFailure {
    umbp_transfer::TransferFailure::new(tags, FailureKind::Local, "the transfer panicked", "pool")
}

/// Each failed tag with its failure's kind and message (the first failure naming it), logged.
fn failed_by_tag(failures: Vec<umbp_transfer::TransferFailure>) -> HashMap<u64, (FailureKind, String)> {
    let mut out = HashMap::new();
    for f in failures {
        tracing::debug!(kind = ?f.kind, endpoint = %f.endpoint, message = %f.message, "transfer failure");
        for t in f.tags {
            out.entry(t).or_insert((f.kind, format!("{} via {}", f.message, f.endpoint)));
        }
    }
    out
}
