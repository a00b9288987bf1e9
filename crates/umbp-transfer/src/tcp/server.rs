//! The data server: serves the regions registered on this node to peers over TCP.
//!
//! One gate thread accepts connections and runs every handshake over non-blocking sockets (see
//! [`gate`]: what it caps and evicts, and why), then hands each authenticated
//! connection to a thread of its own (capped by
//! [`max_connections`](DataServerConfig::max_connections), the table in
//! [`conns`](super::conns)). A connection thread reads request headers through a small buffer,
//! streams WRITE payloads from the socket straight into region memory, and answers with gather
//! writes (reply headers and READ payloads, the latter straight from region memory). See
//! [`protocol`] for the bytes.
//!
//! GPU regions (a server started with a GPU runtime accepts them) cannot be reached by the socket:
//! their bytes pass through the connection's host staging buffer ([`DeviceStaging`]) with the
//! runtime's synchronous copies, in pieces of at most
//! [`gpu_staging_bytes`](DataServerConfig::gpu_staging_bytes). Host regions never touch it.
//!
//! Every per-connection warning goes through the server's [`WarnLimiter`]: at most one line per
//! kind per [`warn_interval`](DataServerConfig::warn_interval), carrying the count suppressed.

use std::io::{self, IoSlice};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use umbp_core::{LocalRegion, MemoryRegistrar, MetricSample, RegistrationError, RemoteRegion, TransferRef};
use umbp_gpu::{CopyKind, DeviceGuard, GpuRuntime};

use super::conns::{Activity, Conns};
use super::error::TcpStartError;
use super::gate;
use super::io::{FrameReader, SocketClock, is_timeout, write_all_vectored_until};
use super::keyed::KeyedHandler;
use super::protocol::{self, FrameError, Op, REQUEST_LEN, Reply, Request, Status};
use super::regions::{RegionGuard, RegionTable};
use super::staging::DeviceStaging;
use crate::warn::{WarnLimiter, warn_limited};

#[path = "keyed_server.rs"]
mod keyed_server;

/// Settings of a [`DataServer`].
///
/// The limits keep the port usable under a flood (see the gate's docs, `tcp/gate.rs`): a socket
/// that has not authenticated holds a descriptor for at most
/// [`handshake_timeout`](Self::handshake_timeout) and never a thread, pending handshakes are
/// capped apart from authenticated connections and per source address, and at any cap the
/// oldest pending handshake or the connection idle longest makes room for the newcomer.
#[derive(Clone, PartialEq, Eq)]
pub struct DataServerConfig {
    /// Address to listen on. Default: `127.0.0.1:0` (loopback, a port chosen by the OS). A wildcard
    /// address (`0.0.0.0`, `::`) needs [`advertise`](Self::advertise).
    pub listen: SocketAddr,
    /// The endpoint peers are told to use (`host:port`), for when `listen` is a wildcard address or
    /// the node is reached through another name. Default: `None` — the address actually bound.
    pub advertise: Option<String>,
    /// The cluster token a peer must present in the handshake, for a server started on its own.
    /// Inside a [`TcpEngineConfig`](super::TcpEngineConfig) leave it unset: the engine's
    /// `cluster_token` serves both sides. Default: `None` (no authentication: any peer that speaks
    /// the protocol is served).
    pub cluster_token: Option<String>,
    /// Authenticated connections served at once (one thread each). A newcomer beyond this closes
    /// the connection idle longest; only when every connection is in the middle of a request is it
    /// answered `BUSY`. Default: 1024.
    pub max_connections: usize,
    /// Authenticated connections from one source address at once (an IPv6 source counts by its
    /// /64 prefix, here and in [`max_handshakes_per_peer`](Self::max_handshakes_per_peer)); beyond
    /// it a newcomer closes that address's connection idle longest (or is answered `BUSY`), so
    /// one host cannot displace everyone else's. Default: 256.
    pub max_connections_per_peer: usize,
    /// Connections still in the handshake at once, apart from the authenticated ones. They cost a
    /// descriptor each, no thread; beyond this the oldest one is closed. Default: 256.
    pub max_handshakes: usize,
    /// Connections in the handshake from one source address at once; beyond it that address's
    /// oldest one is closed, so a flood from one host displaces only its own sockets. Default: 64.
    pub max_handshakes_per_peer: usize,
    /// The whole handshake must arrive within this of the accept, however it is paced (a real
    /// client sends it the moment it connects). Default: 1 s.
    pub handshake_timeout: Duration,
    /// A request must arrive in full (header and WRITE payload) within this once it has started,
    /// and a batch of replies must be sent within it. A request that misses it closes the
    /// connection (releasing the regions it touched). Default: 30 s.
    pub io_timeout: Duration,
    /// A connection with no request for this long is closed. Keep it above the clients'
    /// [`idle_timeout`](super::TcpEngineConfig::idle_timeout) (they close first). Default: 60 s.
    pub idle_timeout: Duration,
    /// Bytes of the host staging buffer a connection allocates (once, when it first serves a GPU
    /// region) to move GPU bytes between the socket and device memory; a longer request moves in
    /// pieces of this size. Clamped to at least 4 KiB. Only used by a server started with a GPU
    /// runtime. Default: 4 MiB.
    pub gpu_staging_bytes: usize,
    /// Each kind of warning (a refused handshake, a malformed frame, …) is logged at most once per
    /// this; the line carries `suppressed`, how many of that kind were not logged since the last.
    /// The engine's client side uses it too. Default: 5 s.
    pub warn_interval: Duration,
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for DataServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataServerConfig")
            .field("listen", &self.listen)
            .field("advertise", &self.advertise)
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<redacted>"))
            .field("max_connections", &self.max_connections)
            .field("max_connections_per_peer", &self.max_connections_per_peer)
            .field("max_handshakes", &self.max_handshakes)
            .field("max_handshakes_per_peer", &self.max_handshakes_per_peer)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("gpu_staging_bytes", &self.gpu_staging_bytes)
            .field("warn_interval", &self.warn_interval)
            .finish()
    }
}

impl Default for DataServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise: None,
            cluster_token: None,
            max_connections: 1024,
            max_connections_per_peer: 256,
            max_handshakes: 256,
            max_handshakes_per_peer: 64,
            handshake_timeout: Duration::from_secs(1),
            io_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            gpu_staging_bytes: 4 << 20,
            warn_interval: Duration::from_secs(5),
        }
    }
}

/// Replies gathered before one `writev`: at most this many.
const MAX_QUEUED_REPLIES: usize = 256;
/// …or this many payload bytes, READ (to send) and WRITE (received) together: large reads go out one
/// by one as soon as they are known, and a stream of large writes is acknowledged as it lands.
const MAX_QUEUED_PAYLOAD: usize = 4 << 20;
/// …or replies this old: a slow stream of requests still gets timely answers.
const MAX_QUEUED_AGE: Duration = Duration::from_millis(2);
/// Buffer for request headers (read-ahead bytes of small frames are copied out of it).
const READ_BUFFER: usize = 4 << 10;
/// The smallest GPU staging buffer.
const MIN_GPU_STAGING: usize = 4 << 10;
/// Scratch for discarding the payload of a refused WRITE.
const DISCARD_BUFFER: usize = 16 << 10;
/// How long `Drop` waits for the server's threads.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Counters of a data server.
#[derive(Debug, Default)]
pub(crate) struct ServerMetrics {
    pub(crate) accepted: AtomicU64,
    pub(crate) refused_limit: AtomicU64,
    pub(crate) refused_handshake_limit: AtomicU64,
    pub(crate) handshake_timeouts: AtomicU64,
    idle_closed: AtomicU64,
    pub(crate) idle_evicted: AtomicU64,
    pub(crate) refused_unauthorized: AtomicU64,
    pub(crate) refused_version: AtomicU64,
    pub(crate) refused_malformed: AtomicU64,
    malformed_frames: AtomicU64,
    requests: [AtomicU64; Status::ALL.len()],
    /// Bytes moved between the socket and GPU regions through host staging.
    gpu_staged_bytes: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn label(k: &str, v: &str) -> Vec<(String, String)> {
    vec![(k.to_owned(), v.to_owned())]
}

use umbp_core::metric_names::{
    TRANSFER_TCP_SERVER_CONNECTIONS as SERVER_CONNECTIONS,
    TRANSFER_TCP_SERVER_CONNECTIONS_HELP as SERVER_CONNECTIONS_HELP,
    TRANSFER_TCP_SERVER_GPU_STAGED_BYTES_TOTAL as SERVER_GPU_STAGED_BYTES,
    TRANSFER_TCP_SERVER_GPU_STAGED_BYTES_TOTAL_HELP as SERVER_GPU_STAGED_HELP,
    TRANSFER_TCP_SERVER_REFUSED_TOTAL as SERVER_REFUSED_TOTAL,
    TRANSFER_TCP_SERVER_REFUSED_TOTAL_HELP as SERVER_REFUSED_HELP,
    TRANSFER_TCP_SERVER_REQUESTS_TOTAL as SERVER_REQUESTS_TOTAL,
    TRANSFER_TCP_SERVER_REQUESTS_TOTAL_HELP as SERVER_REQUESTS_HELP,
};

/// State shared by the gate and the connection threads.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: DataServerConfig,
    regions: Arc<RegionTable>,
    /// The runtime GPU regions are copied with; `None`: host regions only.
    gpu: Option<Arc<dyn GpuRuntime>>,
    pub(crate) stop: AtomicBool,
    /// The authenticated connections.
    pub(crate) conns: Mutex<Conns>,
    /// Connections in the handshake now (the gate's count, published for `connection_count`).
    pub(crate) handshaking: AtomicUsize,
    /// Connections' idle instants are measured from this.
    pub(crate) epoch: Instant,
    pub(crate) metrics: ServerMetrics,
    /// Every per-connection warning goes through it.
    pub(crate) warns: WarnLimiter,
    /// Serves keyed requests (GET_KEY, PUT_KEY); `None`: they are answered `UNSUPPORTED`.
    pub(crate) keyed: RwLock<Option<Arc<dyn KeyedHandler>>>,
}

impl Shared {
    fn new(config: DataServerConfig, regions: Arc<RegionTable>, gpu: Option<Arc<dyn GpuRuntime>>) -> Arc<Self> {
        let warns = WarnLimiter::new(config.warn_interval);
        Arc::new(Self {
            config,
            regions,
            gpu,
            stop: AtomicBool::new(false),
            conns: Mutex::new(Conns::default()),
            handshaking: AtomicUsize::new(0),
            epoch: Instant::now(),
            metrics: ServerMetrics::default(),
            warns,
            keyed: RwLock::new(None),
        })
    }
}

/// A node's data server: serves the regions registered with it to peers, by (region id, offset,
/// length). [`TcpEngine`](super::TcpEngine) starts one and shares its region table; it is also
/// usable alone (it is a [`MemoryRegistrar`]: registered refs carry this server's endpoint and the
/// region id).
///
/// Dropping it stops accepting, closes every connection and joins the threads (waiting at most a
/// few seconds).
#[derive(Debug)]
pub struct DataServer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    endpoint: String,
    acceptor: Option<JoinHandle<()>>,
}

impl DataServer {
    /// Binds `config.listen` and starts serving an empty region table.
    ///
    /// # Errors
    /// The address cannot be bound, the acceptor cannot be spawned, or `listen` is a wildcard
    /// address without `advertise`.
    pub fn start(config: DataServerConfig) -> Result<Self, TcpStartError> {
        Self::start_with(config, Arc::new(RegionTable::default()), None)
    }

    /// As [`start`](Self::start), and GPU regions (memory of `runtime`'s devices) may be registered
    /// too: peers read and write them through a host staging buffer per connection (see
    /// [`DataServerConfig::gpu_staging_bytes`]), copied with `runtime`.
    ///
    /// # Errors
    /// As [`start`](Self::start).
    pub fn start_with_gpu(config: DataServerConfig, runtime: Arc<dyn GpuRuntime>) -> Result<Self, TcpStartError> {
        Self::start_with(config, Arc::new(RegionTable::default()), Some(runtime))
    }

    /// Binds `config.listen` and starts serving `regions`, GPU regions with `gpu`.
    pub(crate) fn start_with(
        config: DataServerConfig,
        regions: Arc<RegionTable>,
        gpu: Option<Arc<dyn GpuRuntime>>,
    ) -> Result<Self, TcpStartError> {
        if config.listen.ip().is_unspecified() && config.advertise.is_none() {
            return Err(TcpStartError::WildcardWithoutAdvertise { addr: config.listen });
        }
        let bind = |source| TcpStartError::Bind { addr: config.listen, source };
        let listener = TcpListener::bind(config.listen).map_err(bind)?;
        let local_addr = listener.local_addr().map_err(bind)?;
        let endpoint = config.advertise.clone().unwrap_or_else(|| local_addr.to_string());
        let shared = Shared::new(config, regions, gpu);
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("umbp-tcp-accept".into())
                .spawn(move || gate::run(&shared, &listener))
                .map_err(TcpStartError::Spawn)?
        };
        tracing::debug!(%endpoint, "tcp data server listening");
        Ok(Self { shared, local_addr, endpoint, acceptor: Some(acceptor) })
    }

    /// A server that serves no peer: it binds no socket and starts no thread, its endpoint is ""
    /// (nothing to advertise) and its address the unspecified `0.0.0.0:0`. Its region table still
    /// takes local-only registrations (the local side of a client's own transfers); registering
    /// memory for peers fails ([`RegistrationError::Refused`]). A client-only
    /// [`TcpEngine`](super::TcpEngine)'s.
    pub(crate) fn unbound(config: DataServerConfig, regions: Arc<RegionTable>) -> Self {
        let shared = Shared::new(config, regions, None);
        Self {
            shared,
            local_addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
            endpoint: String::new(),
            acceptor: None,
        }
    }

    /// Whether the server listens for peers (false for a client-only engine's, which serves none).
    pub fn is_listening(&self) -> bool {
        self.acceptor.is_some()
    }

    /// The endpoint peers use to reach this server (`host:port`): the advertised one if configured,
    /// else the address actually bound; "" for a server that does not listen.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The address actually bound (`0.0.0.0:0` for a server that does not listen).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The configuration.
    pub fn config(&self) -> &DataServerConfig {
        &self.shared.config
    }

    /// Serves keyed requests (GET_KEY, PUT_KEY: a get or a put in one exchange, see
    /// [`KeyedHandler`] and [`KeyedClient`](crate::KeyedClient)) with `handler` from now on; `None`
    /// answers them `UNSUPPORTED` (the client takes the routed path).
    pub fn set_keyed_handler(&self, handler: Option<Arc<dyn KeyedHandler>>) {
        *self.shared.keyed.write() = handler;
    }

    /// Regions registered now.
    pub fn region_count(&self) -> usize {
        self.shared.regions.len()
    }

    /// Connections open now (in the handshake or authenticated).
    pub fn connection_count(&self) -> usize {
        self.shared.conns.lock().len() + self.handshake_count()
    }

    /// Connections in the handshake now (accepted, not authenticated yet).
    pub fn handshake_count(&self) -> usize {
        self.shared.handshaking.load(Ordering::SeqCst)
    }

    /// Registers `region` for this node's own transfers only: the ref carries this server's
    /// (endpoint, region id) so the engine can use it as the local side, but peers' requests for the
    /// id are refused as an unknown region.
    pub(crate) fn register_local_only(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.register(region, false)
    }

    /// Whether this server can serve GPU regions (it was started with a GPU runtime).
    pub fn serves_gpu_memory(&self) -> bool {
        self.shared.gpu.is_some()
    }

    fn register(&self, region: LocalRegion, remote: bool) -> Result<TransferRef, RegistrationError> {
        if let Some(device) = region.location().device() {
            // Device memory is for peers only (through staging): the engine's own transfers never
            // use it as a local side. It needs a runtime that has the device.
            let servable =
                remote && self.shared.gpu.as_ref().is_some_and(|gpu| gpu.device_count().is_ok_and(|n| device < n));
            if !servable {
                return Err(RegistrationError::Unsupported { len: region.len(), location: region.location() });
            }
        }
        if remote && !self.is_listening() {
            return Err(RegistrationError::Refused {
                transport: "TcpEngine".into(),
                reason: "this engine serves no peers (started client-only): memory for peers to reach \
                         cannot be registered with it"
                    .into(),
            });
        }
        let region_id = self.shared.regions.insert(region, remote);
        Ok(TransferRef::local(region).with_remote(RemoteRegion { endpoint: self.endpoint.clone(), region_id }))
    }

    /// The server's samples.
    pub(crate) fn sample_metrics(&self, out: &mut Vec<MetricSample>) {
        let m = &self.shared.metrics;
        if m.accepted.load(Ordering::Relaxed) > 0 {
            let open = u64::try_from(self.connection_count()).unwrap_or(u64::MAX);
            out.push(MetricSample::gauge(SERVER_CONNECTIONS, SERVER_CONNECTIONS_HELP, Vec::new(), open));
        }
        for (status, count) in Status::ALL.iter().zip(&m.requests) {
            let v = count.load(Ordering::Relaxed);
            if v > 0 {
                out.push(MetricSample::counter(
                    SERVER_REQUESTS_TOTAL,
                    SERVER_REQUESTS_HELP,
                    label("status", status.as_str()),
                    v,
                ));
            }
        }
        let staged = m.gpu_staged_bytes.load(Ordering::Relaxed);
        if staged > 0 {
            out.push(MetricSample::counter(SERVER_GPU_STAGED_BYTES, SERVER_GPU_STAGED_HELP, Vec::new(), staged));
        }
        for (reason, count) in [
            ("limit", &m.refused_limit),
            ("handshake_limit", &m.refused_handshake_limit),
            ("handshake_timeout", &m.handshake_timeouts),
            ("idle", &m.idle_closed),
            ("idle_evicted", &m.idle_evicted),
            ("unauthorized", &m.refused_unauthorized),
            ("bad_version", &m.refused_version),
            ("malformed_hello", &m.refused_malformed),
            ("malformed_frame", &m.malformed_frames),
        ] {
            let v = count.load(Ordering::Relaxed);
            if v > 0 {
                out.push(MetricSample::counter(SERVER_REFUSED_TOTAL, SERVER_REFUSED_HELP, label("reason", reason), v));
            }
        }
    }

    /// Whether `r` carries a live registration of this server.
    pub(crate) fn owns(&self, r: &TransferRef) -> bool {
        match (r.local_region(), r.remote()) {
            (Some(local), Some(remote)) => {
                local.location().is_host()
                    && remote.endpoint == self.endpoint
                    && self.shared.regions.is_registered(remote.region_id, local)
            }
            _ => false,
        }
    }

    /// A guard over the registration `r` carries, when it is live and `r` lies inside it.
    pub(crate) fn guard(&self, r: &TransferRef) -> Option<RegionGuard> {
        let (local, remote) = (r.local_region()?, r.remote()?);
        if remote.endpoint != self.endpoint {
            return None;
        }
        if !local.location().is_host() {
            return None;
        }
        let guard = self.shared.regions.acquire(remote.region_id)?;
        let inside = guard.region().ptr() == local.ptr()
            && guard.region().location() == local.location()
            && local.len() <= guard.region().len()
            && r.size() <= local.len();
        inside.then_some(guard)
    }
}

impl MemoryRegistrar for DataServer {
    /// Host memory, and GPU memory of a device of the server's runtime when it was started with one
    /// ([`start_with_gpu`](DataServer::start_with_gpu)); other GPU memory →
    /// [`RegistrationError::Unsupported`]. The returned ref carries `region` and this server's
    /// (endpoint, region id); the id is fresh and never reused.
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.register(region, true)
    }

    /// Makes later requests for the region fail with "unknown region", then blocks until every
    /// request already touching it has finished (each is bounded by the IO timeout in total), so
    /// the caller may free the memory when this returns. A truncated ref of the region works too. A
    /// ref of another server, or one already deregistered, is a no-op.
    fn deregister(&self, r: &TransferRef) {
        if let (Some(local), Some(remote)) = (r.local_region(), r.remote())
            && remote.endpoint == self.endpoint
        {
            self.shared.regions.remove(remote.region_id, local);
        }
    }
}

impl Drop for DataServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if self.acceptor.is_none() {
            // It never listened: no thread, no connection.
            return;
        }
        // Wake the acceptor, blocked in `accept`, with a connection of our own.
        let wake = match self.local_addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), self.local_addr.port())
            }
            IpAddr::V6(ip) if ip.is_unspecified() => {
                SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), self.local_addr.port())
            }
            _ => self.local_addr,
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        let deadline = Instant::now() + SHUTDOWN_GRACE;
        if let Some(acceptor) = self.acceptor.take() {
            join_until(acceptor, deadline, &self.shared.warns);
        }
        let conns = self.shared.conns.lock().drain();
        for (stream, _) in &conns {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, thread) in conns {
            if let Some(t) = thread {
                join_until(t, deadline, &self.shared.warns);
            }
        }
    }
}

/// Joins `t` if it finishes before `deadline`; otherwise leaves it detached (it holds only shared
/// state and finishes on its own once its socket call returns).
fn join_until(t: JoinHandle<()>, deadline: Instant, warns: &WarnLimiter) {
    while !t.is_finished() {
        if Instant::now() >= deadline {
            warn_limited!(warns, "thread_detached", "tcp data server thread did not stop in time; leaving it detached");
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = t.join();
}

/// Why a connection ended.
#[derive(Debug)]
enum End {
    /// The peer closed it, or the server is stopping.
    Closed,
    /// A socket error (including a timeout in the middle of a request).
    Io(io::Error),
    /// The peer sent something that is not the protocol.
    Malformed(FrameError),
    /// No request came for the idle timeout.
    Idle,
    /// Closed to make room for a newer connection while idle.
    Evicted,
}

impl From<io::Error> for End {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

/// Serves an authenticated connection until it ends (the gate ran the handshake).
/// `write_half` is a clone of `stream`.
pub(crate) fn serve(shared: &Shared, stream: TcpStream, write_half: TcpStream, peer: SocketAddr, activity: &Activity) {
    tracing::debug!(%peer, "tcp data server: connection authenticated");
    let io_timeout = shared.config.io_timeout;
    let mut conn = ServerConn {
        shared,
        activity,
        reader: FrameReader::new(stream, READ_BUFFER, REQUEST_LEN, io_timeout),
        writer: write_half,
        write_clock: SocketClock::new(io_timeout),
        replies: ReplyQueue::default(),
        scratch: vec![0u8; DISCARD_BUFFER].into_boxed_slice(),
        staging: None,
        staged: 0,
    };
    match conn.run() {
        Ok(()) | Err(End::Closed) => tracing::debug!(%peer, "tcp data server: connection closed"),
        Err(End::Idle) => {
            bump(&shared.metrics.idle_closed);
            tracing::debug!(%peer, "tcp data server: idle connection closed");
        }
        Err(End::Evicted) => tracing::debug!(%peer, "tcp data server: idle connection evicted for a newer one"),
        Err(End::Io(e)) => tracing::debug!(%peer, error = %e, "tcp data server: connection dropped"),
        Err(End::Malformed(e)) => {
            bump(&shared.metrics.malformed_frames);
            warn_limited!(shared.warns, "malformed_frame", %peer, reason = %e,
                "tcp data server: malformed frame; closing the connection");
        }
    }
}

/// Replies waiting for one gather write.
#[derive(Debug, Default)]
struct ReplyQueue {
    headers: Vec<[u8; protocol::REPLY_LEN]>,
    /// Per header: the READ payload that follows it, if any: a range of a guarded region, or of
    /// the connection's GPU staging buffer (a GPU region's bytes, copied there).
    payloads: Vec<Option<(*const u8, usize)>>,
    /// Keeps the regions of queued payloads registered until they are written.
    guards: Vec<RegionGuard>,
    /// READ payload bytes to send plus WRITE payload bytes received since the last flush.
    payload_bytes: usize,
    /// When the oldest queued reply was queued.
    oldest: Option<Instant>,
}

impl ReplyQueue {
    fn full(&self) -> bool {
        self.headers.len() >= MAX_QUEUED_REPLIES
            || self.payload_bytes >= MAX_QUEUED_PAYLOAD
            || self.oldest.is_some_and(|t| t.elapsed() >= MAX_QUEUED_AGE)
    }
}

struct ServerConn<'a> {
    shared: &'a Shared,
    /// Busy or idle (evictable while idle).
    activity: &'a Activity,
    reader: FrameReader,
    writer: TcpStream,
    write_clock: SocketClock,
    replies: ReplyQueue,
    scratch: Box<[u8]>,
    /// Host staging for GPU regions, allocated on first use.
    staging: Option<DeviceStaging>,
    /// Bytes at the start of `staging` holding queued READ payloads (free again after a flush).
    staged: usize,
}

/// Where a GPU request's bytes go: the runtime, the staging buffer and the region's device.
struct DeviceSide {
    gpu: Arc<dyn GpuRuntime>,
    staging: NonNull<u8>,
    capacity: usize,
    device: u32,
}

impl ServerConn<'_> {
    fn run(&mut self) -> Result<(), End> {
        loop {
            if self.reader.buffered() == 0 && !self.replies.headers.is_empty() && !self.more_pending() {
                // About to block on the socket: everything answered so far goes out first. (While
                // the client keeps sending, replies accumulate and leave in one gather write.)
                self.flush()?;
            }
            let Some(head) = self.next_header()? else {
                // The peer finished sending; it may still be reading.
                return self.flush();
            };
            let request = Request::decode(&head).map_err(End::Malformed)?;
            self.handle(request)?;
            if self.replies.full() {
                self.flush()?;
            }
        }
    }

    /// Whether request bytes can be read right now without blocking (a non-blocking fill of the
    /// header buffer). Errors count as "no": the blocking read that follows reports them.
    fn more_pending(&mut self) -> bool {
        let stream = self.reader.get_ref();
        if stream.set_nonblocking(true).is_err() {
            return false;
        }
        let more = matches!(self.reader.fill(), Ok(n) if n > 0);
        let restored = self.reader.get_ref().set_nonblocking(false).is_ok();
        more && restored
    }

    /// The next request header; `None` when the peer closed the connection between requests.
    /// Between requests the connection may idle up to the idle timeout; once a header has started,
    /// the request (header and payload) must arrive within the IO timeout in total.
    fn next_header(&mut self) -> Result<Option<[u8; REQUEST_LEN]>, End> {
        let idle_until = Instant::now() + self.shared.config.idle_timeout;
        if self.reader.buffered() == 0 {
            // Nothing queued and nothing buffered: the gate may evict us while we wait.
            self.activity.idle().map_err(|_| End::Evicted)?;
        }
        self.reader.set_deadline(Some(idle_until));
        loop {
            match self.reader.fill() {
                Ok(0) if self.activity.is_evicted() => return Err(End::Evicted),
                Ok(0) => return Ok(None),
                Ok(_) => {
                    // Evicted after the bytes arrived: the request is dropped unanswered (the client
                    // resends it on a new connection).
                    self.activity.busy().map_err(|_| End::Evicted)?;
                    break;
                }
                Err(_) if self.activity.is_evicted() => return Err(End::Evicted),
                Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {
                    if self.shared.stop.load(Ordering::Relaxed) {
                        return Err(End::Closed);
                    }
                    if Instant::now() >= idle_until {
                        return Err(End::Idle);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.reader.set_deadline(Some(Instant::now() + self.shared.config.io_timeout));
        let mut head = [0u8; REQUEST_LEN];
        self.reader.read_exact_into(&mut head)?;
        Ok(Some(head))
    }

    /// The region range a request names, or the status refusing it. Nothing is touched here.
    fn resolve(&self, r: &Request) -> Result<(RegionGuard, *mut u8, usize), Status> {
        if r.flags != 0 {
            return Err(Status::BadRequest);
        }
        let guard = self.shared.regions.acquire_remote(r.region).ok_or(Status::UnknownRegion)?;
        let (ptr, len) = guard.range(r.offset, r.length)?;
        Ok((guard, ptr, len))
    }

    fn handle(&mut self, r: Request) -> Result<(), End> {
        let write = match r.op {
            Op::Read => false,
            Op::Write => true,
            Op::GetKey => return self.get_key(r),
            Op::PutKey => return self.put_key(r),
            Op::GetKeys => return self.get_keys(r),
            Op::PutKeys => return self.put_keys(r),
        };
        let resolved = self.resolve(&r);
        let device = resolved.as_ref().ok().and_then(|(guard, _, _)| guard.region().location().device());
        if let (Some(device), Ok((guard, ptr, len))) = (device, &resolved) {
            let status = if write {
                self.write_device(r.id, guard, device, *ptr, *len)?
            } else {
                self.read_device(r.id, guard, device, *ptr, *len)?
            };
            bump(&self.shared.metrics.requests[status as usize]);
            return Ok(());
        }
        let status = match (write, resolved) {
            (true, Ok((guard, ptr, len))) => {
                // SAFETY: `ptr..ptr + len` lies inside the region (bounds-checked by
                // `RegionGuard::range` in `resolve`), which stays registered — so valid, per
                // `LocalRegion`'s invariant — while `guard` lives, i.e. until after this read. The
                // slice is only handed to the kernel's `recv`; the medium guarantees nobody else
                // uses bytes a transfer is writing.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
                self.reader.read_exact_into(dst)?;
                drop(guard);
                self.replies.payload_bytes += len;
                self.queue(Reply { status: Status::Ok, id: r.id, length: 0 }, None);
                Status::Ok
            }
            (true, Err(status)) => {
                self.discard(r.length)?;
                self.queue(Reply { status, id: r.id, length: 0 }, None);
                status
            }
            (false, Ok((guard, ptr, len))) => {
                self.queue(Reply { status: Status::Ok, id: r.id, length: r.length }, Some((guard, ptr, len)));
                Status::Ok
            }
            (false, Err(status)) => {
                self.queue(Reply { status, id: r.id, length: 0 }, None);
                status
            }
        };
        bump(&self.shared.metrics.requests[status as usize]);
        Ok(())
    }

    fn queue(&mut self, reply: Reply, payload: Option<(RegionGuard, *mut u8, usize)>) {
        self.replies.oldest.get_or_insert_with(Instant::now);
        self.replies.headers.push(reply.encode());
        match payload {
            Some((guard, ptr, len)) => {
                self.replies.payloads.push(Some((ptr.cast_const(), len)));
                self.replies.guards.push(guard);
                self.replies.payload_bytes += len;
            }
            None => self.replies.payloads.push(None),
        }
    }

    /// The runtime, the connection's staging buffer (allocated on first use) and `device`, for a
    /// request on a GPU region; `None` (logged) when the server has no runtime or the buffer cannot
    /// be mapped.
    fn device_side(&mut self, device: u32) -> Option<DeviceSide> {
        let gpu = Arc::clone(self.shared.gpu.as_ref()?);
        if self.staging.is_none() {
            let len = self.shared.config.gpu_staging_bytes.max(MIN_GPU_STAGING);
            match DeviceStaging::new(&gpu, device, len) {
                Ok(staging) => self.staging = Some(staging),
                Err(reason) => {
                    warn_limited!(self.shared.warns, "gpu_staging", %reason,
                        "tcp data server: no GPU staging buffer; refusing the request");
                    return None;
                }
            }
        }
        let staging = self.staging.as_ref()?;
        Some(DeviceSide { staging: staging.ptr(), capacity: staging.len(), gpu, device })
    }

    /// A WRITE into a GPU region: the payload is read into staging piece by piece, each piece
    /// copied host → device. The whole payload is read whatever happens, so the stream stays in
    /// sync; a failed copy answers [`Status::DeviceError`].
    fn write_device(
        &mut self,
        id: u64,
        _guard: &RegionGuard,
        device: u32,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Status, End> {
        if self.staged > 0 {
            // Queued READ payloads live in staging: send them before it is reused.
            self.flush()?;
        }
        let status = match self.device_side(device) {
            None => {
                self.discard(len as u64)?;
                Status::DeviceError
            }
            Some(side) => {
                let switched = DeviceGuard::switch(side.gpu.as_ref(), side.device);
                let mut failure = switched.as_ref().err().map(ToString::to_string);
                let mut done = 0usize;
                while done < len {
                    let n = (len - done).min(side.capacity);
                    // SAFETY: the staging buffer is `capacity >= n` bytes of host memory owned by
                    // this connection (`self.staging`, neither dropped nor replaced while the
                    // connection runs); no queued reply references it (`staged` is 0, flushed
                    // above), so nothing else reads or writes it now.
                    let buf = unsafe { std::slice::from_raw_parts_mut(side.staging.as_ptr(), n) };
                    self.reader.read_exact_into(buf)?;
                    if failure.is_none() {
                        // SAFETY: `ptr..ptr + len` lies inside the GPU region (bounds-checked by
                        // `RegionGuard::range`), which the caller's guard keeps registered (so
                        // allocated, per `LocalRegion`'s invariant) until after this synchronous
                        // copy; `done + n <= len`. The source is `n` host bytes of staging; device
                        // memory and the mapping never overlap.
                        let copied = unsafe {
                            let dst = NonNull::new_unchecked(ptr.wrapping_add(done));
                            side.gpu.memcpy(dst, side.staging, n, CopyKind::HostToDevice)
                        };
                        if let Err(e) = copied {
                            failure = Some(e.to_string());
                        }
                    }
                    done += n;
                }
                drop(switched);
                match failure {
                    None => {
                        self.shared.metrics.gpu_staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
                        Status::Ok
                    }
                    Some(error) => {
                        warn_limited!(self.shared.warns, "gpu_copy", device, %error,
                            "tcp data server: copying a WRITE into device memory failed");
                        Status::DeviceError
                    }
                }
            }
        };
        self.replies.payload_bytes += len;
        self.queue(Reply { status, id, length: 0 }, None);
        Ok(status)
    }

    /// A READ of a GPU region: copied device → host into staging and sent from there. A READ that
    /// fits the staging space left joins the queued replies (so small reads still share one gather
    /// write); a larger one goes out alone, piece by piece.
    fn read_device(
        &mut self,
        id: u64,
        _guard: &RegionGuard,
        device: u32,
        ptr: *mut u8,
        len: usize,
    ) -> Result<Status, End> {
        if len == 0 {
            self.queue(Reply { status: Status::Ok, id, length: 0 }, None);
            return Ok(Status::Ok);
        }
        let Some(side) = self.device_side(device) else {
            self.queue(Reply { status: Status::DeviceError, id, length: 0 }, None);
            return Ok(Status::DeviceError);
        };
        if len > side.capacity - self.staged {
            self.flush()?;
        }
        let switched = match DeviceGuard::switch(side.gpu.as_ref(), side.device) {
            Ok(switched) => switched,
            Err(error) => {
                warn_limited!(self.shared.warns, "gpu_copy", device, %error,
                    "tcp data server: cannot switch to the region's device");
                self.queue(Reply { status: Status::DeviceError, id, length: 0 }, None);
                return Ok(Status::DeviceError);
            }
        };
        let first = len.min(side.capacity);
        let at = if len <= side.capacity { self.staged } else { 0 };
        // SAFETY: `at + first <= capacity`: either the READ fits after the `staged` bytes of
        // queued payloads (checked above, else flushed, making `staged` 0), or it is larger than
        // staging and starts at 0 (flushed above). So the destination is inside this connection's
        // staging buffer and overlaps no queued payload. The source lies inside the GPU region
        // (bounds-checked by `RegionGuard::range`), kept registered by the caller's guard past this
        // synchronous copy.
        let copied = unsafe {
            let dst = NonNull::new_unchecked(side.staging.as_ptr().add(at));
            side.gpu.memcpy(dst, NonNull::new_unchecked(ptr), first, CopyKind::DeviceToHost)
        };
        if let Err(error) = copied {
            warn_limited!(self.shared.warns, "gpu_copy", device, %error,
                "tcp data server: copying a READ out of device memory failed");
            self.queue(Reply { status: Status::DeviceError, id, length: 0 }, None);
            return Ok(Status::DeviceError);
        }
        if len <= side.capacity {
            drop(switched);
            // SAFETY: `at + len <= capacity` (above): a range of the staging buffer, which lives as
            // long as the connection; it is not written again before this reply is flushed
            // (`staged` covers it until the flush resets it).
            let payload = unsafe { side.staging.as_ptr().add(at) };
            self.staged = at + len;
            self.replies.oldest.get_or_insert_with(Instant::now);
            self.replies.headers.push(Reply { status: Status::Ok, id, length: len as u64 }.encode());
            self.replies.payloads.push(Some((payload.cast_const(), len)));
            self.replies.payload_bytes += len;
            self.shared.metrics.gpu_staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
            return Ok(Status::Ok);
        }
        // Larger than staging: the header and the first piece, then piece after piece, all within
        // one IO timeout. A copy that fails once the reply is under way cannot be reported in the
        // stream any more: the connection closes (its requests fail as a lost connection).
        let deadline = Instant::now() + self.shared.config.io_timeout;
        let head = Reply { status: Status::Ok, id, length: len as u64 }.encode();
        // SAFETY: the first `first` bytes of staging, just filled by the copy above.
        let piece = unsafe { std::slice::from_raw_parts(side.staging.as_ptr(), first) };
        write_all_vectored_until(
            &mut self.writer,
            &mut [IoSlice::new(&head), IoSlice::new(piece)],
            deadline,
            &mut self.write_clock,
        )?;
        let mut done = first;
        while done < len {
            let n = (len - done).min(side.capacity);
            // SAFETY: as the first copy: `n <= capacity` bytes into staging (nothing queued: flushed
            // above), from inside the guarded GPU region (`done + n <= len`).
            let copied = unsafe {
                let src = NonNull::new_unchecked(ptr.wrapping_add(done));
                side.gpu.memcpy(side.staging, src, n, CopyKind::DeviceToHost)
            };
            if let Err(error) = copied {
                warn_limited!(self.shared.warns, "gpu_copy", device, %error,
                    "tcp data server: a READ of device memory failed mid-reply; closing the connection");
                return Err(End::Io(io::Error::other(format!("device copy failed mid-reply: {error}"))));
            }
            // SAFETY: the `n` bytes of staging just filled.
            let piece = unsafe { std::slice::from_raw_parts(side.staging.as_ptr(), n) };
            write_all_vectored_until(&mut self.writer, &mut [IoSlice::new(piece)], deadline, &mut self.write_clock)?;
            done += n;
        }
        drop(switched);
        self.shared.metrics.gpu_staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(Status::Ok)
    }

    /// Reads and drops `len` payload bytes of a refused WRITE, keeping the stream in sync.
    fn discard(&mut self, mut len: u64) -> Result<(), End> {
        while len > 0 {
            let n = usize::try_from(len).unwrap_or(usize::MAX).min(self.scratch.len());
            let buf = self.scratch.get_mut(..n).ok_or(End::Closed)?;
            self.reader.read_exact_into(buf)?;
            len -= n as u64;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), End> {
        if self.replies.headers.is_empty() {
            return Ok(());
        }
        let q = &self.replies;
        let mut slices = Vec::with_capacity(q.headers.len() * 2);
        for (head, payload) in q.headers.iter().zip(&q.payloads) {
            slices.push(IoSlice::new(head));
            if let Some((ptr, len)) = *payload {
                // SAFETY: either `ptr..ptr + len` was bounds-checked against its host region by
                // `RegionGuard::range`, and the region stays registered (so valid) while the guard
                // in `q.guards` lives, which is until after this write; or it is a range of the
                // connection's GPU staging buffer (`read_device`), which lives as long as the
                // connection and is not written before `staged` is reset below. The slice is only
                // read (by the kernel's `send`).
                slices.push(IoSlice::new(unsafe { std::slice::from_raw_parts(ptr, len) }));
            }
        }
        let deadline = Instant::now() + self.shared.config.io_timeout;
        let result = write_all_vectored_until(&mut self.writer, &mut slices, deadline, &mut self.write_clock);
        drop(slices);
        self.replies.headers.clear();
        self.replies.payloads.clear();
        self.replies.guards.clear();
        self.replies.payload_bytes = 0;
        self.replies.oldest = None;
        self.staged = 0;
        result.map_err(End::Io)
    }
}
