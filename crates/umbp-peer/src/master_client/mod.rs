//! The client half of the master protocol: registration with the full record, the heartbeat contract
//! (one sequence stream for every medium, bounded delta bundles, acks, chunked full sync, keepalive),
//! `clear`, and the routing calls, every one with a deadline.
//!
//! # The heartbeat contract (control-plane spec §3.4, with our fixes)
//! - **One seq stream for all media.** Each round drains every backend of the [`BackendRegistry`]
//!   into one list, cuts it into bundles of at most
//!   [`events_per_bundle`](MasterClientConfig::events_per_bundle) events with consecutive seqs and
//!   appends them to the outbox.
//! - **Send** the bundles with `seq > acked`, at most
//!   [`max_bundles_per_rpc`](MasterClientConfig::max_bundles_per_rpc) (and
//!   [`max_request_bytes`](MasterClientConfig::max_request_bytes)) per RPC, with the live capacity of
//!   every medium and its key count. An empty outbox sends a keepalive (capacity included).
//! - **Reply:** acknowledged bundles leave the outbox; a backlog left after progress re-ticks at once.
//!   Within one registration acks only grow: an `acked_seq` below ours means the master lost the
//!   node's state without saying `UNKNOWN` (a rebuilt store registered it again at seq 0), and one at
//!   or past `next_seq` acknowledges seqs never sent; both send a full sync at once. `UNKNOWN`
//!   re-registers with the full record (FIX §7.2) and sends a full sync; `request_full_sync` sends one
//!   now; an RPC error changes nothing (the same seqs go again next tick — the master re-acks seqs it
//!   already applied).
//! - **Bounded outbox** (FIX §7.9): when queued events would exceed
//!   [`max_outbox_events`](MasterClientConfig::max_outbox_events), the queued deltas are dropped and
//!   a full sync replaces them.
//! - **Full sync**, chunked (FIX §7.9): a **fresh baseline** (`baseline = next_seq; next_seq += 1`:
//!   never a delta's seq, never an earlier sync's), a snapshot of every medium (which empties their
//!   outboxes in the same critical section), cut lazily into chunks `0..n` of bounded events and
//!   bytes, sent in order with `is_full_sync`, `full_sync_chunk`, `full_sync_final` on the last and
//!   `delta_seq_baseline = baseline` on all. It succeeds only when the final chunk's reply acks
//!   exactly `baseline`; anything else (an error, `UNKNOWN`, `request_full_sync`, another ack) restarts
//!   it next tick from chunk 0 with a fresh snapshot and a fresh baseline. After an RPC failure the
//!   next attempt first probes the master with a keepalive, so an outage costs one small RPC per tick,
//!   not a snapshot of every key.
//! - **Wake-ups:** the interval from the registration reply, [`MasterClient::flush`], and each
//!   backend's auto-flush hook (which only signals: it runs under the backend's lock).
//! - [`MasterClient::clear`] clears every medium, sends an empty full sync (each attempt at a fresh
//!   baseline) and reopens writes once it is acknowledged, retrying with backoff until then (FIX
//!   §7.8); if its deadline passes, the heartbeat loop keeps retrying and reopens writes when the
//!   master acknowledges. Shutdown cancels a running clear; nothing registers after shutdown began.
//!
//! - **Incarnations.** Each client takes an incarnation when it is created (wall-clock microseconds,
//!   strictly increasing within the process) and sends it with the registration, every heartbeat and
//!   the unregister. A process restarted under the same node id therefore replaces its predecessor's
//!   live record at once instead of waiting for it to expire. A heartbeat reply with `superseded`
//!   (or a registration refused with `FAILED_PRECONDITION`) means a newer process took the id: the
//!   client logs one ERROR, stops its loop for good, never registers again (it would fight the newer
//!   process) and never unregisters (the record is not its own); every call then fails with
//!   [`MasterClientError::Superseded`], and [`MasterClient::wait_superseded`] resolves so the node
//!   process can stop.
//! - **The first full sync runs inside [`register`](MasterClient::register)** when the node already
//!   owns keys (an SSD node restarted on its drives): its keys are readable when `register` returns.
//!
//! # What the master must do
//! Answer `RegisterClient` with `ALREADY_EXISTS` for a fresh live node of the same (or no)
//! incarnation, replace one of a lower incarnation, refuse one of a higher incarnation with
//! `FAILED_PRECONDITION`; answer a heartbeat of a superseded incarnation `UNKNOWN` with `superseded`
//! and ignore an unregister of one; ack delta bundles in order,
//! re-ack a bundle whose seq is already applied (never ask for a full sync for it); answer a keepalive
//! with the last applied seq; flatten the bundles of a full-sync chunk; take chunk 0 only when
//! `delta_seq_baseline > last_applied` (else answer ALIVE with `acked_seq = last_applied` and apply
//! nothing), add on every chunk, drop the node's locations missing from the sync on the final one,
//! adopt the baseline there and reply `acked_seq = baseline`; refuse an out-of-order chunk with
//! `request_full_sync`; reply `NODE_STATUS_UNKNOWN` for a node it has no record of.

mod config;
mod error;
mod external;
mod external_outbox;
mod heartbeat;
mod masters;
mod types;
pub(crate) mod wire;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use umbp_core::BackendRegistry;
use umbp_proto::token::TokenInjector;
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

pub use config::{ConfigError, MasterClientConfig};
pub use error::MasterClientError;
pub use external::ExternalKvNodeMatch;
pub use masters::parse_master_addresses;
pub use types::{
    ClusterStatus, MasterClientStats, NodeLiveness, NodeRegistration, NodeRole, NodeStatusReport, RouteGetHit,
    RoutePutDecision,
};

use heartbeat::{HbState, Next};

pub use umbp_proto::TOKEN_METADATA;

/// Most heartbeat rounds one wake-up runs back to back before it yields to the loop's wait (which
/// then returns at once); keeps a producer that outpaces the master from starving shutdown.
const MAX_BACK_TO_BACK_ROUNDS: u32 = 64;

type Grpc = UmbpMasterClient<InterceptedService<Channel, TokenInjector>>;

/// Monotonic counters behind [`MasterClientStats`].
#[derive(Debug, Default)]
struct Counters {
    heartbeats_sent: AtomicU64,
    bundles_sent: AtomicU64,
    keepalives_sent: AtomicU64,
    full_syncs_started: AtomicU64,
    full_syncs_completed: AtomicU64,
    full_sync_chunks_sent: AtomicU64,
    registrations: AtomicU64,
    re_registrations: AtomicU64,
    outbox_overflows: AtomicU64,
    rpc_errors: AtomicU64,
    failovers: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// Everything the heartbeat task shares with the handle.
struct Inner {
    config: MasterClientConfig,
    node: NodeRegistration,
    registry: Arc<BackendRegistry>,
    /// The masters, and which one calls go to first (see [`masters`]).
    masters: masters::Masters,
    state: Mutex<HbState>,
    /// Serialises every heartbeat, full sync, registration and clear (the reference's
    /// `hb_send_mutex_`).
    send_lock: tokio::sync::Mutex<()>,
    /// Wakes the loop: `flush`, the auto-flush hooks, and a capped backlog. Shared with the hooks,
    /// which must not keep `Inner` alive (the registry holds the backends that hold the hooks).
    wake: Arc<Notify>,
    /// The loop runs (between `start_heartbeat` and `unregister`/`shutdown`).
    running: AtomicBool,
    shut_down: AtomicBool,
    /// Turns `true` when shutdown begins: cancels a running clear or round, so nothing registers the
    /// node again behind its unregister.
    shutdown: tokio::sync::watch::Sender<bool>,
    /// The master's local placement grant, from its last register or heartbeat reply (see
    /// [`MasterClient::local_puts_granted`]).
    local_puts: AtomicBool,
    /// This process's incarnation of the node id (see [`MasterClient::incarnation`]).
    incarnation: u64,
    /// Turns `true` when the master says a newer process took over the node id: the loop stops and
    /// nothing registers again (see [`MasterClient::wait_superseded`]).
    superseded: tokio::sync::watch::Sender<bool>,
    stats: Counters,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MasterClient")
            .field("node", &self.node)
            .field("config", &self.config)
            .field("media", &self.registry.len())
            .field("state", &*self.state.lock())
            .field("running", &self.running.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Inner {
    /// Sends one RPC with `timeout` as both the gRPC deadline and a local bound, so a master that
    /// accepts the connection and never answers still returns control in time. With several
    /// masters, a call no master answered goes to the next one, each at most once (see
    /// [`masters`]).
    async fn call<Req: Clone, Resp, Fut>(
        &self,
        rpc: &'static str,
        timeout: Duration,
        message: Req,
        send: impl Fn(Grpc, tonic::Request<Req>) -> Fut,
    ) -> Result<Resp, MasterClientError>
    where
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let n = self.masters.len();
        let start = self.masters.current();
        let mut message = Some(message);
        let mut attempt = 0;
        loop {
            let (index, addr, grpc) = self.masters.pick(start, attempt);
            let last = attempt + 1 >= n;
            // Clone only while another master may still need the message.
            let body = if last { message.take() } else { message.clone() };
            let Some(body) = body else { return Err(MasterClientError::InvalidArgument("no message".into())) };
            let mut request = tonic::Request::new(body);
            request.set_timeout(timeout);
            let result = match tokio::time::timeout(timeout, send(grpc, request)).await {
                Err(_elapsed) => Err(MasterClientError::Timeout { rpc, after: timeout }),
                Ok(Err(status)) if deadline_passed(&status) => Err(MasterClientError::Timeout { rpc, after: timeout }),
                Ok(Err(status)) => Err(MasterClientError::Rpc { rpc, status: Box::new(status) }),
                Ok(Ok(response)) => Ok(response.into_inner()),
            };
            match result {
                Err(e) if !last && masters::fails_over(&e) => {
                    bump(&self.stats.rpc_errors, 1);
                    let next = self.masters.pick(start, attempt + 1).1;
                    tracing::warn!(rpc, master = %addr, next = %next, error = %e, "master failed; trying the next one");
                    attempt += 1;
                }
                Err(e) => {
                    bump(&self.stats.rpc_errors, 1);
                    return Err(e);
                }
                Ok(reply) => {
                    if self.masters.answered_by(index) {
                        bump(&self.stats.failovers, 1);
                        tracing::info!(rpc, master = %addr, "failed over to another master");
                    }
                    return Ok(reply);
                }
            }
        }
    }

    /// Installs (`on`) or removes the auto-flush hook on every medium.
    fn set_hooks(&self, on: bool) {
        let threshold = self.config.auto_flush_event_threshold;
        for (_, backend) in self.registry.entries() {
            if on && threshold > 0 {
                let wake = Arc::clone(&self.wake);
                backend.set_auto_flush_hook(threshold, Some(Arc::new(move || wake.notify_one())));
            } else {
                backend.set_auto_flush_hook(0, None);
            }
        }
    }

    async fn unregister(&self, timeout: Duration) -> Result<(), MasterClientError> {
        let request = pb::UnregisterClientRequest { node_id: self.node.node_id.clone(), incarnation: self.incarnation };
        self.call("UnregisterClient", timeout, request, |mut c, r| async move { c.unregister_client(r).await }).await?;
        let mut st = self.state.lock();
        st.registered = false;
        st.register_sent = false;
        st.needs_register = false;
        Ok(())
    }
}

/// Whether `status` reports the call's deadline: the server's `DEADLINE_EXCEEDED`, or the channel's own
/// enforcement of the `grpc-timeout` header (a `CANCELLED` caused by `TimeoutExpired`).
fn deadline_passed(status: &tonic::Status) -> bool {
    if status.code() == tonic::Code::DeadlineExceeded {
        return true;
    }
    // tonic flattens the cause into the message when it builds the status from the error chain.
    if status.code() == tonic::Code::Cancelled && status.message() == tonic::TimeoutExpired(()).to_string() {
        return true;
    }
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// The loop: wait for the interval or a wake-up, then run heartbeat rounds while a backlog shrinks.
/// Ends when the master says a newer process took over the node id (fighting it would flap the
/// node's registration between the two processes).
async fn run_loop(inner: Arc<Inner>) {
    loop {
        let interval = inner.state.lock().interval;
        tokio::select! {
            () = inner.wake.notified() => {}
            () = tokio::time::sleep(interval) => {}
        }
        let mut rounds = 0;
        loop {
            match inner.tick().await {
                Ok(Next::Now) => {
                    rounds += 1;
                    if rounds >= MAX_BACK_TO_BACK_ROUNDS {
                        inner.wake.notify_one();
                        break;
                    }
                }
                Ok(Next::Wait) => break,
                Err(MasterClientError::Superseded { .. }) => {
                    inner.running.store(false, Ordering::Release);
                    return;
                }
                Err(_) => break,
            }
        }
    }
}

/// A fresh incarnation for this process: wall-clock microseconds, so a process restarted later gets
/// a higher one (the master lets the higher replace the lower), and strictly increasing within the
/// process (two clients of one process never share one). Never 0 (0 means "unspecified").
fn new_incarnation() -> u64 {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .max(1);
    let previous = LAST.fetch_max(now, Ordering::Relaxed);
    if previous < now {
        return now;
    }
    // Same microsecond (or a clock step back): one past the highest handed out.
    LAST.fetch_add(1, Ordering::Relaxed) + 1
}

/// A node's connection to the master: registration, the heartbeat loop and the routing calls.
///
/// Every method takes `&self`; share it behind an `Arc`. Dropping it stops the heartbeat loop without
/// unregistering; [`shutdown`](Self::shutdown) stops the loop and unregisters, bounded by
/// [`shutdown_timeout`](MasterClientConfig::shutdown_timeout) even when the master hangs.
///
/// ```no_run
/// # async fn demo(registry: std::sync::Arc<umbp_core::BackendRegistry>) -> Result<(), Box<dyn std::error::Error>> {
/// use umbp_peer::master_client::{MasterClient, MasterClientConfig, NodeRegistration};
///
/// let node = NodeRegistration::new("node-1", "10.0.0.5")
///     .with_peer_address("10.0.0.5:7001")
///     .with_data_endpoint("10.0.0.5:7002");
/// let client = MasterClient::connect("10.0.0.1:50051", MasterClientConfig::default(), node, registry).await?;
/// client.register().await?;
/// client.start_heartbeat()?;
/// let hits = client.batch_route_get(&["key".to_owned()], &[]).await?;
/// client.shutdown().await?;
/// # Ok(()) }
/// ```
pub struct MasterClient {
    inner: Arc<Inner>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for MasterClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl MasterClient {
    /// Opens the connection to the master at `master_addr` (`host:port`, or a `http://` URI), bounded
    /// by [`connect_timeout`](MasterClientConfig::connect_timeout). Nothing is registered yet; the
    /// channel reconnects by itself if the master restarts later.
    ///
    /// `master_addr` may list several masters sharing one metadata store, comma-separated
    /// (`a:50051,b:50051`): the first reachable one is connected now, and every call that no master
    /// answered (unreachable, broken connection, deadline, `UNAVAILABLE`) goes to the next one, each
    /// at most once per call; the one that answers is tried first from then on. A heartbeat answered
    /// by another master continues the same seq stream (the store holds the seq).
    pub async fn connect(
        master_addr: &str,
        config: MasterClientConfig,
        node: NodeRegistration,
        registry: Arc<BackendRegistry>,
    ) -> Result<Self, MasterClientError> {
        config.validate()?;
        if node.node_id.is_empty() {
            return Err(MasterClientError::InvalidArgument("node_id must not be empty".into()));
        }
        let token = TokenInjector::new(config.cluster_token.as_deref())
            .map_err(|e| MasterClientError::InvalidArgument(e.to_string()))?;
        let masters = masters::Masters::connect(master_addr, &config, &token).await?;
        let state = HbState::new(config.default_heartbeat_interval);
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                node,
                registry,
                masters,
                state: Mutex::new(state),
                send_lock: tokio::sync::Mutex::new(()),
                wake: Arc::new(Notify::new()),
                running: AtomicBool::new(false),
                shut_down: AtomicBool::new(false),
                shutdown: tokio::sync::watch::Sender::new(false),
                local_puts: AtomicBool::new(false),
                incarnation: new_incarnation(),
                superseded: tokio::sync::watch::Sender::new(false),
                stats: Counters::default(),
            }),
            task: Mutex::new(None),
        })
    }

    /// Registers the node with its full record: the capacity of every medium with total > 0, the peer
    /// address, the data endpoint and the tags. Adopts the heartbeat interval of the reply.
    ///
    /// The registration carries this process's [`incarnation`](Self::incarnation): a live record of
    /// the same node id left by an earlier process (one that crashed, or still runs) is replaced at
    /// once, and that process's heartbeats are refused from then on. Fails with
    /// [`Superseded`](MasterClientError::Superseded) when a newer process holds the id, and with
    /// [`AlreadyRegistered`](MasterClientError::AlreadyRegistered) when a live record that cannot be
    /// told apart from this process's exists (a master or an older client without incarnations).
    /// (The re-registration the heartbeat loop makes after the master forgot the node counts
    /// `ALREADY_EXISTS` as success.)
    ///
    /// When the node already owns keys (an SSD node restarted on its drives) or has heartbeated
    /// before, the full sync that tells the master about them runs here, before this returns, so the
    /// keys are readable as soon as the node is up; if it fails, the heartbeat loop's first round
    /// sends it (at once, not after an interval). Otherwise deltas start at seq 1.
    pub async fn register(&self) -> Result<(), MasterClientError> {
        if self.inner.shut_down.load(Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        let _send = self.inner.send_lock.lock().await;
        self.inner.register_locked(false).await?;
        if self.inner.state.lock().full_sync_pending
            && let Err(e) = self.inner.full_sync_locked().await
        {
            if matches!(e, MasterClientError::Superseded { .. }) {
                return Err(e);
            }
            tracing::warn!(node = %self.inner.node.node_id, error = %e, "the first full sync failed; the heartbeat loop retries it at once");
        }
        Ok(())
    }

    /// This process's incarnation of the node id: wall-clock microseconds at the client's creation,
    /// sent with the registration, every heartbeat and the unregister. The master lets a higher
    /// incarnation (a restarted process) replace a live record at once and refuses the lower one's
    /// heartbeats from then on.
    pub fn incarnation(&self) -> u64 {
        self.inner.incarnation
    }

    /// Whether the master said a newer process took over this node id. The heartbeat loop has then
    /// stopped for good and [`register`](Self::register) fails with
    /// [`Superseded`](MasterClientError::Superseded); the process should stop (its keys are no longer
    /// indexed).
    pub fn is_superseded(&self) -> bool {
        *self.inner.superseded.borrow()
    }

    /// Resolves once the master says a newer process took over this node id (see
    /// [`is_superseded`](Self::is_superseded)); a node process awaits it to stop with a clear error.
    pub async fn wait_superseded(&self) {
        let mut rx = self.inner.superseded.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Spawns the heartbeat loop on the current tokio runtime and installs the auto-flush hook on every
    /// medium. Idempotent while running. Needs a successful [`register`](Self::register).
    pub fn start_heartbeat(&self) -> Result<(), MasterClientError> {
        if self.inner.shut_down.load(Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        self.inner.check_superseded()?;
        if !self.inner.state.lock().registered {
            return Err(MasterClientError::NotRegistered);
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| MasterClientError::NoRuntime)?;
        let mut task = self.task.lock();
        if task.is_some() {
            return Ok(());
        }
        self.inner.set_hooks(true);
        self.inner.running.store(true, Ordering::Release);
        if self.inner.state.lock().full_sync_pending {
            // The node owns keys the master has not heard of (the first sync failed): send it now,
            // not an interval from now.
            self.inner.wake.notify_one();
        }
        *task = Some(runtime.spawn(run_loop(Arc::clone(&self.inner))));
        Ok(())
    }

    /// Whether the master granted this node local placement: its put policy (`local` affinity) would
    /// place this node's own puts on this node's medium whenever that has room, so `PoolClient` may
    /// write them there without a route call (a key the medium refuses is routed as usual). Taken from
    /// the last register or heartbeat reply; cleared when the master answers `UNKNOWN` and by
    /// [`unregister`](Self::unregister) and [`shutdown`](Self::shutdown); kept through an outage (the
    /// local writes reach the master by the full sync that follows it, so other nodes may not find
    /// them until then).
    pub fn local_puts_granted(&self) -> bool {
        self.inner.local_puts.load(Ordering::Relaxed)
    }

    /// Wakes the heartbeat loop now (an in-flight heartbeat is followed at once by another). A no-op
    /// when the loop is not running.
    pub fn flush(&self) {
        if self.inner.running.load(Ordering::Acquire) {
            self.inner.wake.notify_one();
        }
    }

    /// Runs one heartbeat round now, whether or not the loop runs: a pending re-registration or full
    /// sync, else a delta of what the media queued (or a keepalive). Errors are those of the round's
    /// RPC; the state machine has already handled them (nothing acknowledged is ever lost).
    pub async fn heartbeat_once(&self) -> Result<(), MasterClientError> {
        if self.inner.shut_down.load(Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        self.inner.check_superseded()?;
        if !self.inner.state.lock().registered {
            return Err(MasterClientError::NotRegistered);
        }
        let mut shutdown = self.inner.shutdown.subscribe();
        tokio::select! {
            biased;
            _ = shutdown.wait_for(|down| *down) => Err(MasterClientError::ShutDown),
            result = self.inner.tick() => result.map(|_| ()),
        }
    }

    /// Clears the node: every medium drops its keys and gates allocation, the master gets an empty full
    /// sync, and writes reopen once it is acknowledged. Retries with backoff for
    /// [`clear_timeout`](MasterClientConfig::clear_timeout); see [`clear_within`](Self::clear_within).
    pub async fn clear(&self) -> Result<(), MasterClientError> {
        self.clear_within(self.inner.config.clear_timeout).await
    }

    /// [`clear`](Self::clear) with an explicit deadline. On
    /// [`ClearNotAcknowledged`](MasterClientError::ClearNotAcknowledged) writes stay gated and a full
    /// sync stays pending: the heartbeat loop (when running) keeps retrying and reopens writes once the
    /// master acknowledges. A node that never registered only clears locally.
    pub async fn clear_within(&self, deadline: Duration) -> Result<(), MasterClientError> {
        if self.inner.shut_down.load(Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        self.inner.clear(deadline).await
    }

    /// Stops the heartbeat loop and unregisters (with [`rpc_timeout`](MasterClientConfig::rpc_timeout)).
    /// The loop stays stopped even if the call fails; [`register`](Self::register) and
    /// [`start_heartbeat`](Self::start_heartbeat) may rejoin later.
    pub async fn unregister(&self) -> Result<(), MasterClientError> {
        // No master hears of this node's writes from now on: its puts must ask again.
        self.inner.local_puts.store(false, Ordering::Relaxed);
        self.stop_loop().await;
        self.inner.unregister(self.inner.config.rpc_timeout).await
    }

    /// Stops the loop, cancels a running [`clear`](Self::clear) or
    /// [`heartbeat_once`](Self::heartbeat_once), and unregisters, all within
    /// [`shutdown_timeout`](MasterClientConfig::shutdown_timeout) even when the master hangs. Nothing
    /// registers the node again afterwards. Idempotent: later calls return `Ok` and do nothing, and
    /// every other method then fails with [`ShutDown`](MasterClientError::ShutDown). An error means
    /// only that the unregister did not land (the master expires the node later).
    pub async fn shutdown(&self) -> Result<(), MasterClientError> {
        if self.inner.shut_down.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.inner.local_puts.store(false, Ordering::Relaxed);
        let started = tokio::time::Instant::now();
        let budget = self.inner.config.shutdown_timeout;
        self.inner.shutdown.send_replace(true);
        self.stop_loop().await;
        // The cancelled clear or round releases the send lock at once; holding it keeps anything
        // still in flight from following the unregister.
        let _send = tokio::time::timeout(budget, self.inner.send_lock.lock()).await.ok();
        {
            let st = self.inner.state.lock();
            // A registration whose answer was lost may still stand at the master: unregister too.
            if !st.registered && !st.register_sent {
                return Ok(());
            }
        }
        let remaining = budget.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
        self.inner.unregister(remaining).await
    }

    async fn stop_loop(&self) {
        self.inner.running.store(false, Ordering::Release);
        let task = self.task.lock().take();
        if let Some(task) = task {
            self.inner.set_hooks(false);
            // Dropping an in-flight heartbeat is safe: nothing is popped from the outbox before an ack.
            task.abort();
            let _ = task.await;
        }
    }

    /// Where to write each key: one decision per key, in order. `sizes` is parallel to `keys`;
    /// `exclude` names nodes to avoid.
    pub async fn batch_route_put(
        &self,
        keys: &[String],
        sizes: &[u64],
        exclude: &[String],
    ) -> Result<Vec<RoutePutDecision>, MasterClientError> {
        if keys.len() != sizes.len() {
            return Err(MasterClientError::InvalidArgument(format!("{} keys but {} sizes", keys.len(), sizes.len())));
        }
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let request = pb::BatchRoutePutRequest {
            node_id: self.inner.node.node_id.clone(),
            keys: keys.to_vec(),
            block_sizes: sizes.to_vec(),
            exclude_nodes: exclude.to_vec(),
            columnar: true,
        };
        let reply = self
            .inner
            .call("BatchRoutePut", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                c.batch_route_put(r).await
            })
            .await?;
        wire::decode_route_put(keys.len(), reply)
            .map_err(|reason| MasterClientError::MalformedReply { rpc: "BatchRoutePut", reason })
    }

    /// Where to read each key: `None` for a key no (non-excluded) node holds. The master grants each
    /// hit a short lease. The columnar reply is validated whole; a malformed one is an error.
    pub async fn batch_route_get(
        &self,
        keys: &[String],
        exclude: &[String],
    ) -> Result<Vec<Option<RouteGetHit>>, MasterClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let request = pb::BatchRouteGetRequest {
            node_id: self.inner.node.node_id.clone(),
            keys: keys.to_vec(),
            exclude_nodes: exclude.to_vec(),
        };
        let reply = self
            .inner
            .call("BatchRouteGet", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                c.batch_route_get(r).await
            })
            .await?;
        wire::decode_route_get(keys.len(), reply)
            .map_err(|reason| MasterClientError::MalformedReply { rpc: "BatchRouteGet", reason })
    }

    /// Whether the master's index holds each key (no lease, no access stamp).
    pub async fn batch_lookup(&self, keys: &[String]) -> Result<Vec<bool>, MasterClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let request = pb::BatchLookupRequest { keys: keys.to_vec() };
        let reply =
            self.inner
                .call("BatchLookup", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                    c.batch_lookup(r).await
                })
                .await?;
        wire::decode_lookup(keys.len(), reply)
            .map_err(|reason| MasterClientError::MalformedReply { rpc: "BatchLookup", reason })
    }

    /// The cluster as an operator sees it.
    pub async fn cluster_status(&self) -> Result<ClusterStatus, MasterClientError> {
        let reply = self
            .inner
            .call(
                "GetClusterStatus",
                self.inner.config.rpc_timeout,
                pb::GetClusterStatusRequest {},
                |mut c, r| async move { c.get_cluster_status(r).await },
            )
            .await?;
        Ok(wire::decode_cluster_status(reply))
    }

    /// Counters and heartbeat state.
    pub fn stats(&self) -> MasterClientStats {
        let c = &self.inner.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let st = self.inner.state.lock();
        MasterClientStats {
            heartbeats_sent: get(&c.heartbeats_sent),
            bundles_sent: get(&c.bundles_sent),
            keepalives_sent: get(&c.keepalives_sent),
            full_syncs_started: get(&c.full_syncs_started),
            full_syncs_completed: get(&c.full_syncs_completed),
            full_sync_chunks_sent: get(&c.full_sync_chunks_sent),
            registrations: get(&c.registrations),
            re_registrations: get(&c.re_registrations),
            outbox_overflows: get(&c.outbox_overflows),
            rpc_errors: get(&c.rpc_errors),
            failovers: get(&c.failovers),
            next_seq: st.next_seq,
            acked_seq: st.acked,
            outbox_bundles: st.outbox.len(),
            outbox_events: st.outbox_events,
            full_sync_pending: st.full_sync_pending,
            clear_pending: st.clear_pending,
            heartbeat_interval: st.interval,
        }
    }

    /// The address of the master calls go to first: the one that answered last (after a failover,
    /// the survivor).
    pub fn current_master(&self) -> &str {
        self.inner.masters.current_address()
    }

    /// The node's registration record.
    pub fn node(&self) -> &NodeRegistration {
        &self.inner.node
    }

    /// The settings in force.
    pub fn config(&self) -> &MasterClientConfig {
        &self.inner.config
    }
}

// The handle is shared across tasks.
const _: () = {
    const fn ok<T: Send + Sync>() {}
    ok::<MasterClient>();
};

impl Drop for MasterClient {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().take() {
            task.abort();
            self.inner.set_hooks(false);
        }
    }
}
