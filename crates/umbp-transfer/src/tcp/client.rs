//! The client side of the data plane: per-peer connection pools, striping and pipelining.
//!
//! Each peer gets `connections_per_peer` slots. A slot is one worker thread (the writer) that owns at
//! most one connection at a time, connecting lazily and reconnecting after a failure; a connection
//! has a reader thread of its own. A submitted batch is cut into requests (runs longer than
//! `chunk_size` are split), the requests of each peer are striped over its slots, and each writer
//! sends its stripe back to back in gather writes while its reader takes the replies as they come.
//! So a batch is never one round trip per item, and neither side can stall the other: the reader
//! always drains replies while the writer writes.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};

use super::io::{FrameReader, configure, failure_kind, write_all_vectored};
use super::protocol::{self, HELLO_REPLY_LEN, HelloStatus, Op, REPLY_LEN, Reply, Request, Status};
use super::regions::RegionGuard;
use crate::engine::{FailureKind, TransferFailure, TransferHandle};

/// Requests per gather write (two `iovec`s each, well under `IOV_MAX`).
const GROUP_REQUESTS: usize = 256;
/// Payload bytes per gather write.
const GROUP_BYTES: u64 = 16 << 20;
/// Buffer for reply headers (read-ahead bytes of small frames are copied out of it).
const READ_BUFFER: usize = 4 << 10;
/// Per-request weight in bytes when striping (so 100k tiny items spread evenly too).
const REQUEST_WEIGHT: u64 = 512;

/// Client counters.
#[derive(Debug, Default)]
pub(crate) struct ClientMetrics {
    pub(crate) connections_opened: AtomicU64,
    pub(crate) connect_failed: AtomicU64,
    pub(crate) unauthorized: AtomicU64,
}

/// What every slot worker needs.
#[derive(Debug)]
pub(crate) struct ClientShared {
    pub(crate) connect_timeout: Duration,
    pub(crate) io_timeout: Duration,
    /// The encoded hello (magic, version, token).
    pub(crate) hello: Vec<u8>,
    pub(crate) metrics: ClientMetrics,
}

/// One request of a batch: `len` bytes between `local` and (`region`, `remote_offset`) at the peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Req {
    pub(crate) plan: u32,
    pub(crate) op: Op,
    pub(crate) region: u64,
    pub(crate) remote_offset: u64,
    pub(crate) local: *mut u8,
    pub(crate) len: u64,
}

/// A stripe of one batch for one connection.
#[derive(Debug)]
pub(crate) struct Job {
    batch: Arc<Batch>,
    reqs: Vec<Req>,
}

// SAFETY: the raw pointers in `reqs` point into local regions that the batch keeps registered
// (its `RegionGuard`s) until every request of the batch has completed, so they may be used from the
// worker threads; the memory is plain bytes with no thread affinity.
unsafe impl Send for Job {}

/// A group of requests written in one gather write, handed to the reader in order.
#[derive(Debug)]
struct Group {
    batch: Arc<Batch>,
    reqs: Vec<(u64, Req)>,
}

// SAFETY: as for `Job`: the pointers stay valid until the batch's requests have all completed,
// which happens only after the reader has finished with this group.
unsafe impl Send for Group {}

/// A validated plan: the guard keeping its local region registered, and the peer it goes to.
#[derive(Debug)]
pub(crate) struct Guarded {
    pub(crate) guard: RegionGuard,
    pub(crate) endpoint: String,
}

/// Per-plan bookkeeping of a submitted batch.
#[derive(Debug)]
pub(crate) struct PlanMeta {
    pub(crate) tags: Vec<u64>,
    pub(crate) endpoint: String,
}

#[derive(Debug)]
struct BatchState {
    remaining: usize,
    failures: Vec<Option<(FailureKind, String)>>,
    /// Keep the local regions registered until the last request completes.
    guards: Vec<RegionGuard>,
}

/// A submitted batch: what is left, and what failed.
#[derive(Debug)]
pub(crate) struct Batch {
    plans: Vec<PlanMeta>,
    state: Mutex<BatchState>,
    done: Condvar,
}

impl Batch {
    pub(crate) fn new(plans: Vec<PlanMeta>, requests: usize, guards: Vec<RegionGuard>) -> Self {
        let failures = vec![None; plans.len()];
        Self { plans, state: Mutex::new(BatchState { remaining: requests, failures, guards }), done: Condvar::new() }
    }

    /// Marks `n` requests done; `failed` names the failures among them (first failure per plan wins).
    fn complete(&self, n: usize, failed: Vec<(u32, FailureKind, String)>) {
        let mut s = self.state.lock();
        for (plan, kind, message) in failed {
            if let Some(slot) = s.failures.get_mut(plan as usize)
                && slot.is_none()
            {
                *slot = Some((kind, message));
            }
        }
        s.remaining = s.remaining.saturating_sub(n);
        if s.remaining == 0 {
            // No request touches local memory any more: let deregistration proceed.
            s.guards.clear();
            self.done.notify_all();
        }
    }

    /// Keeps the batch from completing while the caller uses its memory, even if every request
    /// of it fails meanwhile (a reader failing a group while its writer is still in `writev`).
    fn hold(&self) -> Hold<'_> {
        self.state.lock().remaining += 1;
        Hold(self)
    }

    fn fail(&self, reqs: &[Req], kind: FailureKind, message: &str) {
        let failed = reqs.iter().map(|r| (r.plan, kind, message.to_owned())).collect();
        self.complete(reqs.len(), failed);
    }

    /// Blocks until every request completed; returns one failure per failed plan.
    fn wait(&self) -> Vec<TransferFailure> {
        let mut s = self.state.lock();
        while s.remaining > 0 {
            self.done.wait(&mut s);
        }
        let mut out = Vec::new();
        for (meta, failure) in self.plans.iter().zip(s.failures.iter_mut()) {
            if let Some((kind, message)) = failure.take() {
                out.push(TransferFailure::new(meta.tags.clone(), kind, message, meta.endpoint.clone()));
            }
        }
        out
    }
}

/// See [`Batch::hold`].
#[derive(Debug)]
struct Hold<'a>(&'a Batch);

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.0.complete(1, Vec::new());
    }
}

/// The handle of a [`TcpEngine`](super::TcpEngine) submit.
#[derive(Debug)]
pub(crate) struct TcpHandle {
    batch: Option<Arc<Batch>>,
    presettled: Vec<TransferFailure>,
}

impl TcpHandle {
    pub(crate) fn new(batch: Arc<Batch>, presettled: Vec<TransferFailure>) -> Self {
        Self { batch: Some(batch), presettled }
    }
}

impl TransferHandle for TcpHandle {
    /// Blocks until every request has been answered or has failed. Bounded: every socket call has
    /// the IO timeout, and a connection that times out fails all its requests.
    fn wait(&mut self) -> Vec<TransferFailure> {
        let mut failures = std::mem::take(&mut self.presettled);
        if let Some(batch) = self.batch.take() {
            failures.extend(batch.wait());
        }
        failures
    }
}

impl Drop for TcpHandle {
    fn drop(&mut self) {
        if let Some(batch) = self.batch.take() {
            batch.wait();
        }
    }
}

/// Splits one peer's requests into at most `parts` contiguous stripes of about equal weight.
pub(crate) fn stripe(reqs: Vec<Req>, parts: usize) -> Vec<Vec<Req>> {
    let weight = |r: &Req| r.len.saturating_add(REQUEST_WEIGHT);
    let total: u64 = reqs.iter().map(weight).fold(0, u64::saturating_add);
    let target = total.div_ceil(parts.max(1) as u64).max(1);
    let mut stripes = vec![Vec::new()];
    let mut filled = 0u64;
    for r in reqs {
        if filled >= target && stripes.len() < parts {
            stripes.push(Vec::new());
            filled = 0;
        }
        filled = filled.saturating_add(weight(&r));
        if let Some(s) = stripes.last_mut() {
            s.push(r);
        }
    }
    stripes.retain(|s| !s.is_empty());
    stripes
}

/// The connections to one peer.
#[derive(Debug)]
pub(crate) struct PeerPool {
    endpoint: String,
    slots: Vec<Slot>,
    next: AtomicUsize,
}

#[derive(Debug)]
struct Slot {
    jobs: Mutex<Option<Sender<Job>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl PeerPool {
    /// A pool of `connections` slots (threads start now; connections are made on first use).
    pub(crate) fn new(shared: &Arc<ClientShared>, endpoint: &str, connections: usize) -> Self {
        let mut slots = Vec::with_capacity(connections);
        for _ in 0..connections.max(1) {
            let (tx, rx) = crossbeam_channel::unbounded::<Job>();
            let worker = {
                let shared = Arc::clone(shared);
                let endpoint = endpoint.to_owned();
                std::thread::Builder::new().name("umbp-tcp-tx".into()).spawn(move || run_slot(&shared, &endpoint, &rx))
            };
            match worker {
                Ok(t) => slots.push(Slot { jobs: Mutex::new(Some(tx)), worker: Mutex::new(Some(t)) }),
                Err(e) => tracing::warn!(%endpoint, error = %e, "tcp engine: cannot spawn a connection worker"),
            }
        }
        Self { endpoint: endpoint.to_owned(), slots, next: AtomicUsize::new(0) }
    }

    /// Stripes `reqs` over the pool's connections.
    pub(crate) fn submit(&self, batch: &Arc<Batch>, reqs: Vec<Req>) {
        let stripes = stripe(reqs, self.slots.len());
        let start = self.next.fetch_add(stripes.len(), Ordering::Relaxed);
        for (i, reqs) in stripes.into_iter().enumerate() {
            let job = Job { batch: Arc::clone(batch), reqs };
            let slot = self.slots.get((start + i) % self.slots.len().max(1));
            let sent = match slot.and_then(|s| s.jobs.lock().clone()) {
                Some(tx) => tx.send(job).map_err(|e| e.into_inner()),
                None => Err(job),
            };
            if let Err(job) = sent {
                job.batch.fail(&job.reqs, FailureKind::ConnectionLost, "the connection pool to this peer is closed");
            }
        }
    }

    /// Stops the workers after the work already queued, waiting until `deadline` at most.
    pub(crate) fn shutdown(&self, deadline: Instant) {
        for s in &self.slots {
            s.jobs.lock().take();
        }
        for s in &self.slots {
            if let Some(t) = s.worker.lock().take() {
                while !t.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(2));
                }
                if t.is_finished() {
                    let _ = t.join();
                } else {
                    tracing::warn!(endpoint = %self.endpoint, "tcp engine: connection worker did not stop in time");
                }
            }
        }
    }
}

/// State of one live connection shared by its writer and reader.
#[derive(Debug)]
struct ConnState {
    /// Set when the connection broke; the reason fails every request still on it.
    error: Mutex<Option<(FailureKind, String)>>,
    dead: AtomicBool,
    /// Groups handed to the reader and not yet completed.
    in_flight: AtomicUsize,
    /// A handle to shut the socket down (which unblocks both threads).
    stream: TcpStream,
}

impl ConnState {
    fn fail(&self, kind: FailureKind, message: String) {
        let mut e = self.error.lock();
        if e.is_none() {
            *e = Some((kind, message));
        }
        self.dead.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn error(&self) -> Option<(FailureKind, String)> {
        if !self.dead.load(Ordering::SeqCst) {
            return None;
        }
        self.error.lock().clone()
    }
}

/// A live connection as its writer sees it.
#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    state: Arc<ConnState>,
    groups: Option<Sender<Group>>,
    reader: Option<JoinHandle<()>>,
    next_id: u64,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The reader drains what it was given, then sees the channel close and exits.
        self.groups.take();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

fn run_slot(shared: &ClientShared, endpoint: &str, jobs: &Receiver<Job>) {
    let mut conn: Option<Conn> = None;
    while let Ok(job) = jobs.recv() {
        if conn.as_ref().is_some_and(|c| !c.usable()) {
            conn = None;
        }
        if conn.is_none() {
            match Conn::open(shared, endpoint) {
                Ok(c) => conn = Some(c),
                Err((kind, message)) => {
                    tracing::debug!(%endpoint, %message, "tcp engine: cannot connect");
                    job.batch.fail(&job.reqs, kind, &message);
                    continue;
                }
            }
        }
        if let Some(c) = conn.as_mut()
            && !c.send(job)
        {
            conn = None;
        }
    }
}

impl Conn {
    fn open(shared: &ClientShared, endpoint: &str) -> Result<Self, (FailureKind, String)> {
        let metrics = &shared.metrics;
        let connect_failed = |kind: FailureKind, message: String| {
            metrics.connect_failed.fetch_add(1, Ordering::Relaxed);
            (kind, message)
        };
        let addrs = endpoint
            .to_socket_addrs()
            .map_err(|e| connect_failed(FailureKind::ConnectionLost, format!("cannot resolve {endpoint}: {e}")))?;
        let mut last = None;
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, shared.connect_timeout.max(Duration::from_millis(1))) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let mut stream = stream.ok_or_else(|| {
            let e = last.map_or_else(|| "no address".to_owned(), |e| e.to_string());
            connect_failed(FailureKind::ConnectionLost, format!("cannot connect to {endpoint}: {e}"))
        })?;
        let io_err = |what: &str, e: io::Error| connect_failed(failure_kind(&e), format!("{what} {endpoint}: {e}"));
        configure(&stream, shared.io_timeout).map_err(|e| io_err("configuring the socket to", e))?;
        stream.write_all(&shared.hello).map_err(|e| io_err("sending the hello to", e))?;
        let mut answer = [0u8; HELLO_REPLY_LEN];
        stream.read_exact(&mut answer).map_err(|e| io_err("reading the hello answer of", e))?;
        match protocol::decode_hello_reply(&answer) {
            Ok(HelloStatus::Ok) => {}
            Ok(HelloStatus::Unauthorized) => {
                metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
                return Err(connect_failed(FailureKind::Unauthorized, format!("{endpoint} refused the cluster token")));
            }
            Ok(HelloStatus::BadVersion) => {
                return Err(connect_failed(
                    FailureKind::Protocol,
                    format!("{endpoint} does not speak protocol version {}", protocol::VERSION),
                ));
            }
            Err(e) => {
                return Err(connect_failed(FailureKind::Protocol, format!("bad hello answer from {endpoint}: {e}")));
            }
        }
        let (Ok(read_half), Ok(control)) = (stream.try_clone(), stream.try_clone()) else {
            return Err(connect_failed(FailureKind::ConnectionLost, "cannot clone the socket".into()));
        };
        let state = Arc::new(ConnState {
            error: Mutex::new(None),
            dead: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            stream: control,
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Group>();
        let reader = {
            let state = Arc::clone(&state);
            let endpoint = endpoint.to_owned();
            std::thread::Builder::new()
                .name("umbp-tcp-rx".into())
                .spawn(move || run_reader(read_half, &state, &rx, &endpoint))
                .map_err(|e| connect_failed(FailureKind::Local, format!("cannot spawn a reader thread: {e}")))?
        };
        metrics.connections_opened.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%endpoint, "tcp engine: connected");
        Ok(Self { stream, state, groups: Some(tx), reader: Some(reader), next_id: 1 })
    }

    /// Whether the connection can take more work: not broken, and — when idle — not closed by the
    /// peer in the meantime (a non-blocking peek sees the end of stream).
    fn usable(&self) -> bool {
        if self.state.dead.load(Ordering::SeqCst) {
            return false;
        }
        if self.state.in_flight.load(Ordering::SeqCst) > 0 {
            return true;
        }
        // Idle: the reader is not reading the socket, so peeking is safe.
        if self.stream.set_nonblocking(true).is_err() {
            return false;
        }
        let alive = matches!(self.stream.peek(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        alive && self.stream.set_nonblocking(false).is_ok()
    }

    /// Writes a job's requests; returns false when the connection broke (every request of the job
    /// is completed either way: by the reader for those handed to it, here for the rest).
    fn send(&mut self, job: Job) -> bool {
        let Job { batch, reqs } = job;
        // The writes below read the batch's local memory: it stays registered until they return.
        let _hold = batch.hold();
        let mut start = 0;
        while start < reqs.len() {
            let mut end = start;
            let mut bytes = 0u64;
            while end < reqs.len() && end - start < GROUP_REQUESTS && bytes < GROUP_BYTES {
                bytes = bytes.saturating_add(reqs[end].len);
                end += 1;
            }
            if let Some((kind, message)) = self.state.error() {
                batch.fail(&reqs[start..], kind, &message);
                return false;
            }
            let group: Vec<(u64, Req)> = reqs[start..end]
                .iter()
                .map(|r| {
                    let id = self.next_id;
                    self.next_id += 1;
                    (id, *r)
                })
                .collect();
            let headers: Vec<[u8; protocol::REQUEST_LEN]> = group
                .iter()
                .map(|(id, r)| {
                    Request { op: r.op, flags: 0, id: *id, region: r.region, offset: r.remote_offset, length: r.len }
                        .encode()
                })
                .collect();
            let mut slices = Vec::with_capacity(group.len() * 2);
            for ((_, r), head) in group.iter().zip(&headers) {
                slices.push(IoSlice::new(head));
                if r.op == Op::Write {
                    // SAFETY: `r.local..r.local + r.len` was bounds-checked against a registered
                    // local region at submit (`RegionGuard::range`, which also checked that `len`
                    // fits `usize`), and the batch's guards keep that region registered — so
                    // valid — until the batch completes, which `_hold` prevents before this write
                    // returns. The slice is only read (by the kernel's `send`).
                    slices.push(IoSlice::new(unsafe { std::slice::from_raw_parts(r.local, r.len as usize) }));
                }
            }
            self.state.in_flight.fetch_add(1, Ordering::SeqCst);
            let handed = match self.groups.as_ref() {
                Some(tx) => tx.send(Group { batch: Arc::clone(&batch), reqs: group }).map_err(|e| e.into_inner()),
                None => Err(Group { batch: Arc::clone(&batch), reqs: group }),
            };
            if let Err(group) = handed {
                // The reader is gone (it only leaves when the channel closes, or if it panicked).
                let message = "the connection's reader stopped";
                self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
                self.state.fail(FailureKind::ConnectionLost, message.into());
                let lost: Vec<Req> = group.reqs.iter().map(|(_, r)| *r).collect();
                batch.fail(&lost, FailureKind::ConnectionLost, message);
                batch.fail(&reqs[end..], FailureKind::ConnectionLost, message);
                return false;
            }
            if let Err(e) = write_all_vectored(&mut self.stream, &mut slices) {
                self.state.fail(failure_kind(&e), format!("writing requests: {e}"));
                batch.fail(&reqs[end..], failure_kind(&e), &format!("writing requests: {e}"));
                return false;
            }
            start = end;
        }
        true
    }
}

fn run_reader(stream: TcpStream, state: &ConnState, groups: &Receiver<Group>, endpoint: &str) {
    let mut reader = FrameReader::new(stream, READ_BUFFER, REPLY_LEN);
    while let Ok(group) = groups.recv() {
        let mut failed = Vec::new();
        let n = group.reqs.len();
        for (id, req) in group.reqs {
            if let Some((kind, message)) = state.error() {
                failed.push((req.plan, kind, message));
                continue;
            }
            match read_reply(&mut reader, id, &req) {
                Ok(Status::Ok) => {}
                Ok(status) => failed.push((req.plan, status_kind(status), status_message(status, &req, endpoint))),
                Err((kind, message)) => {
                    state.fail(kind, message.clone());
                    failed.push((req.plan, kind, message));
                }
            }
        }
        group.batch.complete(n, failed);
        state.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Reads the reply to request `id`, and for a successful READ its payload into local memory.
fn read_reply(reader: &mut FrameReader, id: u64, req: &Req) -> Result<Status, (FailureKind, String)> {
    let mut head = [0u8; REPLY_LEN];
    reader.read_exact_into(&mut head).map_err(|e| (failure_kind(&e), format!("reading a reply: {e}")))?;
    let reply = Reply::decode(&head).map_err(|e| (FailureKind::Protocol, format!("malformed reply: {e}")))?;
    if reply.id != id {
        return Err((FailureKind::Protocol, format!("reply for request {} while {id} was expected", reply.id)));
    }
    let expected = if reply.status == Status::Ok && req.op == Op::Read { req.len } else { 0 };
    if reply.length != expected {
        return Err((FailureKind::Protocol, format!("reply carries {} bytes, {expected} expected", reply.length)));
    }
    if expected > 0 {
        // SAFETY: `req.local..req.local + req.len` was bounds-checked against a registered local
        // region at submit (`RegionGuard::range`, which also checked that `len` fits `usize`); the
        // batch's guards keep it registered — so valid — until this request is completed, after
        // this read. The slice is only handed to
        // the kernel's `recv`; the caller does not use a transfer's destination while it runs.
        let dst = unsafe { std::slice::from_raw_parts_mut(req.local, req.len as usize) };
        reader.read_exact_into(dst).map_err(|e| (failure_kind(&e), format!("reading a payload: {e}")))?;
    }
    Ok(reply.status)
}

fn status_kind(status: Status) -> FailureKind {
    match status {
        Status::Ok => FailureKind::Local,
        Status::UnknownRegion => FailureKind::UnknownRegion,
        Status::OutOfRange => FailureKind::OutOfRange,
        Status::BadRequest => FailureKind::Protocol,
    }
}

fn status_message(status: Status, req: &Req, endpoint: &str) -> String {
    match status {
        Status::UnknownRegion => format!("{endpoint} has no region {}", req.region),
        Status::OutOfRange => {
            format!("{endpoint} refused [{}, +{}) of region {}: out of range", req.remote_offset, req.len, req.region)
        }
        Status::BadRequest | Status::Ok => format!("{endpoint} refused the request ({})", status.as_str()),
    }
}

/// The peers this engine talks to.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    pools: Mutex<HashMap<String, Arc<PeerPool>>>,
}

impl Peers {
    pub(crate) fn get(&self, shared: &Arc<ClientShared>, endpoint: &str, connections: usize) -> Arc<PeerPool> {
        let mut pools = self.pools.lock();
        if let Some(p) = pools.get(endpoint) {
            return Arc::clone(p);
        }
        let pool = Arc::new(PeerPool::new(shared, endpoint, connections));
        pools.insert(endpoint.to_owned(), Arc::clone(&pool));
        pool
    }

    /// Closes the pool of `endpoint` (after its queued work), waiting until `deadline` at most.
    pub(crate) fn forget(&self, endpoint: &str, deadline: Instant) {
        let pool = self.pools.lock().remove(endpoint);
        if let Some(p) = pool {
            p.shutdown(deadline);
        }
    }

    pub(crate) fn shutdown(&self, deadline: Instant) {
        let pools: Vec<Arc<PeerPool>> = self.pools.lock().drain().map(|(_, p)| p).collect();
        for p in pools {
            p.shutdown(deadline);
        }
    }
}
