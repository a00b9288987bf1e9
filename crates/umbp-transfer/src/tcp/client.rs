//! The client side of the data plane: per-peer connection pools, striping and pipelining.
//!
//! Each peer gets `connections_per_peer` slots. A slot is one worker thread (the writer) that owns at
//! most one connection at a time, connecting lazily and reconnecting after a failure; a connection
//! has a reader thread of its own. A submitted batch is cut into requests (runs longer than
//! `chunk_size` are split), the requests of each peer are striped over its slots, and each writer
//! sends its stripe back to back in gather writes while its reader takes the replies as they come.
//! So a batch is never one round trip per item, and neither side can stall the other: the reader
//! always drains replies while the writer writes.
//!
//! # A connection the server closed
//! A server closes connections on its own: idle ones at its idle timeout, and the one idle longest
//! when it needs room for a newcomer (its connection caps). A pooled connection closed that way is
//! normally seen before use (an idle connection is checked for an end of stream), but the close can
//! also cross the next requests on the wire. So a request lost with its connection (the connection
//! broke: end of stream, reset, broken pipe; not a timeout or a refusal) is sent once more, on a
//! fresh connection, before it fails with [`FailureKind::ConnectionLost`]. Resending is safe: a
//! READ is repeated, and a WRITE puts the same bytes at the same place again (the batch still owns
//! the remote range until it completes). Likewise a handshake the server dropped before answering
//! (its pending-handshake caps) is tried again, up to [`OPEN_ATTEMPTS`] times.

use std::io::IoSlice;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use dashmap::DashMap;
use parking_lot::{Condvar, Mutex};

use super::io::{FrameReader, dial, failure_kind, idle_and_open, write_all_vectored};
use super::protocol::{self, Op, REPLY_LEN, Reply, Request, Status};
use super::regions::RegionGuard;
use crate::engine::{FailureKind, TransferFailure, TransferHandle};
use crate::warn::{WarnLimiter, warn_limited};

/// Requests per gather write (two `iovec`s each, well under `IOV_MAX`).
const GROUP_REQUESTS: usize = 256;
/// Payload bytes per gather write.
const GROUP_BYTES: u64 = 16 << 20;
/// Buffer for reply headers (read-ahead bytes of small frames are copied out of it).
const READ_BUFFER: usize = 4 << 10;
/// Per-request weight in bytes when striping (so 100k tiny items spread evenly too).
const REQUEST_WEIGHT: u64 = 512;
/// Connection attempts when the server drops the handshake unanswered.
const OPEN_ATTEMPTS: u32 = 3;
/// Pause before the second attempt (doubled for the third).
const OPEN_BACKOFF: Duration = Duration::from_millis(20);

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
    /// A pooled connection unused this long is closed.
    pub(crate) idle_timeout: Duration,
    /// The encoded hello (magic, version, token).
    pub(crate) hello: Vec<u8>,
    pub(crate) metrics: ClientMetrics,
    /// Repeated warnings are rate-limited through it.
    pub(crate) warns: WarnLimiter,
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

/// A stripe of one batch for one connection. Requests from `done` on are not handed on yet; dropping
/// the job (a worker that stopped or panicked) fails them, so no waiter is left counting.
#[derive(Debug)]
pub(crate) struct Job {
    batch: Arc<Batch>,
    reqs: Vec<Req>,
    done: usize,
    /// A resend of requests lost with a connection: lost again, they fail.
    retried: bool,
}

// SAFETY: the raw pointers in `reqs` point into local memory that stays valid while any thread
// touches it (`Batch::touch`): registered regions because the batch keeps them registered (its
// `RegionGuard`s), unregistered caller memory because the caller keeps it valid until the batch's
// handle has been waited or dropped, and both of those wait until no thread touches the memory
// any more. So they may be used from the worker threads; the memory is plain bytes with no thread
// affinity.
unsafe impl Send for Job {}

impl Job {
    fn new(batch: Arc<Batch>, reqs: Vec<Req>) -> Self {
        Self { batch, reqs, done: 0, retried: false }
    }

    /// The requests not handed on yet, after their connection broke with `kind`: a job resending
    /// them if they may be resent (see the module docs), else they fail here.
    fn retry_or_fail(mut self, kind: FailureKind, message: &str) -> Option<Self> {
        if kind != FailureKind::ConnectionLost || self.retried || self.done >= self.reqs.len() {
            self.fail_rest(kind, message);
            return None;
        }
        let rest = self.reqs.split_off(self.done);
        Some(Self { batch: Arc::clone(&self.batch), reqs: rest, done: 0, retried: true })
    }

    /// Fails every request not handed on yet.
    fn fail_rest(&mut self, kind: FailureKind, message: &str) {
        let rest = self.reqs.get(self.done..).unwrap_or_default();
        self.batch.fail(rest, kind, message);
        self.done = self.reqs.len();
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if self.done < self.reqs.len() {
            self.fail_rest(FailureKind::ConnectionLost, "the connection worker stopped");
        }
    }
}

/// A group of requests written in one gather write, handed to the reader in order. Dropping it
/// unsettled (a reader that stopped or panicked) fails its requests.
#[derive(Debug)]
struct Group {
    batch: Arc<Batch>,
    reqs: Vec<(u64, Req)>,
    settled: bool,
    /// Its requests are a resend (see [`Job::retried`]).
    retried: bool,
}

// SAFETY: as for `Job`: the pointers are only dereferenced under `Batch::touch`.
unsafe impl Send for Group {}

impl Group {
    fn settle(&mut self, failed: Vec<(u32, FailureKind, String)>) {
        self.settled = true;
        self.batch.complete(self.reqs.iter().map(|(_, r)| r.plan), failed);
    }

    /// Settles every request except `resend` (indices into `reqs`, in order), which are returned
    /// as a job for a fresh connection; that job completes them.
    fn settle_but(&mut self, failed: Vec<(u32, FailureKind, String)>, resend: &[usize]) -> Option<Job> {
        if resend.is_empty() {
            self.settle(failed);
            return None;
        }
        self.settled = true;
        let mut skip = resend.iter().copied().peekable();
        let mut kept = Vec::with_capacity(resend.len());
        let mut completed = Vec::with_capacity(self.reqs.len() - resend.len());
        for (i, (_, r)) in self.reqs.iter().enumerate() {
            if skip.peek() == Some(&i) {
                skip.next();
                kept.push(*r);
            } else {
                completed.push(r.plan);
            }
        }
        self.batch.complete(completed.into_iter(), failed);
        Some(Job { batch: Arc::clone(&self.batch), reqs: kept, done: 0, retried: true })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if !self.settled {
            let message = "the connection's reader stopped";
            let failed =
                self.reqs.iter().map(|(_, r)| (r.plan, FailureKind::ConnectionLost, message.to_owned())).collect();
            self.settle(failed);
        }
    }
}

/// A validated plan: the guard keeping its local region registered (`None` for unregistered caller
/// memory, valid by the caller's contract), and the peer it goes to.
#[derive(Debug)]
pub(crate) struct Guarded {
    pub(crate) guard: Option<RegionGuard>,
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
    /// Requests not completed yet.
    remaining: usize,
    /// Requests not completed yet, per plan.
    outstanding: Vec<usize>,
    /// Threads reading or writing the batch's local memory now.
    touching: usize,
    /// Set when the waiter gave up at the deadline: no thread starts touching the memory afterwards.
    expired: bool,
    failures: Vec<Option<(FailureKind, String)>>,
    /// Keep the local regions registered while any thread may touch them.
    guards: Vec<RegionGuard>,
    /// The connections that carried the batch's requests (shut down at the deadline).
    conns: Vec<Weak<ConnState>>,
}

/// A submitted batch: what is left, and what failed.
#[derive(Debug)]
pub(crate) struct Batch {
    plans: Vec<PlanMeta>,
    deadline: Instant,
    state: Mutex<BatchState>,
    done: Condvar,
}

impl Batch {
    /// A batch of `per_plan[i]` requests for plan `i`, to finish by `deadline`.
    pub(crate) fn new(plans: Vec<PlanMeta>, per_plan: Vec<usize>, guards: Vec<RegionGuard>, deadline: Instant) -> Self {
        let failures = vec![None; plans.len()];
        let state = BatchState {
            remaining: per_plan.iter().sum(),
            outstanding: per_plan,
            touching: 0,
            expired: false,
            failures,
            guards,
            conns: Vec::new(),
        };
        Self { plans, deadline, state: Mutex::new(state), done: Condvar::new() }
    }

    /// Marks the requests of `plans` (one entry per request) done; `failed` names the failures among
    /// them (first failure per plan wins).
    fn complete(&self, plans: impl Iterator<Item = u32>, failed: Vec<(u32, FailureKind, String)>) {
        let mut s = self.state.lock();
        for (plan, kind, message) in failed {
            if let Some(slot) = s.failures.get_mut(plan as usize)
                && slot.is_none()
            {
                *slot = Some((kind, message));
            }
        }
        for plan in plans {
            if let Some(n) = s.outstanding.get_mut(plan as usize) {
                *n = n.saturating_sub(1);
            }
            s.remaining = s.remaining.saturating_sub(1);
        }
        self.settle(&mut s);
    }

    /// Once no thread can touch the local memory any more, lets deregistration proceed and wakes
    /// the waiter.
    fn settle(&self, s: &mut BatchState) {
        if (s.remaining == 0 || s.expired) && s.touching == 0 {
            s.guards.clear();
            self.done.notify_all();
        }
    }

    /// Permission to read or write the batch's local memory, over `conn`, until the returned guard
    /// drops; `None` once the waiter gave up on the batch.
    fn touch(&self, conn: &Arc<ConnState>) -> Option<Touch<'_>> {
        let mut s = self.state.lock();
        if s.expired {
            return None;
        }
        s.touching += 1;
        if !s.conns.iter().any(|c| std::ptr::eq(c.as_ptr(), Arc::as_ptr(conn))) {
            s.conns.push(Arc::downgrade(conn));
        }
        Some(Touch(self))
    }

    fn fail(&self, reqs: &[Req], kind: FailureKind, message: &str) {
        let failed = reqs.iter().map(|r| (r.plan, kind, message.to_owned())).collect();
        self.complete(reqs.iter().map(|r| r.plan), failed);
    }

    /// Blocks until every request completed, or until the deadline: then the connections carrying
    /// the batch are shut down (their threads stop touching its memory at once) and what is left
    /// fails with [`FailureKind::Timeout`]. Returns one failure per failed plan.
    fn wait(&self) -> Vec<TransferFailure> {
        let mut s = self.state.lock();
        loop {
            if s.touching == 0 && (s.remaining == 0 || s.expired) {
                break;
            }
            if s.expired {
                // Only threads already touching the memory remain; their sockets are shut down.
                self.done.wait(&mut s);
                continue;
            }
            if Instant::now() >= self.deadline {
                s.expired = true;
                let conns = std::mem::take(&mut s.conns);
                drop(s);
                for c in conns.iter().filter_map(Weak::upgrade) {
                    c.fail(FailureKind::Timeout, "a batch on this connection passed its deadline".into());
                }
                s = self.state.lock();
                continue;
            }
            let _ = self.done.wait_until(&mut s, self.deadline);
        }
        let mut out = Vec::new();
        let BatchState { failures, outstanding, .. } = &mut *s;
        for ((meta, failure), left) in self.plans.iter().zip(failures.iter_mut()).zip(outstanding.iter()) {
            let failure = failure.take().or_else(|| {
                (*left > 0).then(|| (FailureKind::Timeout, "no answer before the batch deadline".to_owned()))
            });
            if let Some((kind, message)) = failure {
                out.push(TransferFailure::new(meta.tags.clone(), kind, message, meta.endpoint.clone()));
            }
        }
        // A late completion must not report again on a second wait.
        outstanding.iter_mut().for_each(|n| *n = 0);
        out
    }
}

/// See [`Batch::touch`].
#[derive(Debug)]
struct Touch<'a>(&'a Batch);

impl Drop for Touch<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.touching -= 1;
        self.0.settle(&mut s);
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
    /// Blocks until every request has been answered or has failed, at most until the batch's
    /// deadline (`TcpEngineConfig::batch_timeout` after submit).
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
    shared: Arc<ClientShared>,
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
                Err(e) => warn_limited!(shared.warns, "spawn_failed", %endpoint, error = %e,
                    "tcp engine: cannot spawn a connection worker"),
            }
        }
        Self { endpoint: endpoint.to_owned(), slots, next: AtomicUsize::new(0), shared: Arc::clone(shared) }
    }

    /// Stripes `reqs` over the pool's connections.
    pub(crate) fn submit(&self, batch: &Arc<Batch>, reqs: Vec<Req>) {
        let stripes = stripe(reqs, self.slots.len());
        let start = self.next.fetch_add(stripes.len(), Ordering::Relaxed);
        for (i, reqs) in stripes.into_iter().enumerate() {
            let job = Job::new(Arc::clone(batch), reqs);
            let slot = self.slots.get((start + i) % self.slots.len().max(1));
            let sent = match slot.and_then(|s| s.jobs.lock().clone()) {
                Some(tx) => tx.send(job).map_err(|e| e.into_inner()),
                None => Err(job),
            };
            if let Err(mut job) = sent {
                job.fail_rest(FailureKind::ConnectionLost, "the connection pool to this peer is closed");
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
                    warn_limited!(self.shared.warns, "worker_detached", endpoint = %self.endpoint,
                        "tcp engine: connection worker did not stop in time");
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
    // Requests lost with a connection come back here (from its reader) to be sent again.
    let (resend_tx, resends) = crossbeam_channel::unbounded::<Job>();
    let mut conn: Option<Conn> = None;
    let idle = shared.idle_timeout.max(Duration::from_millis(1));
    loop {
        let job = match resends.try_recv() {
            Ok(job) => job,
            Err(_) => crossbeam_channel::select! {
                recv(resends) -> job => match job {
                    Ok(job) => job,
                    Err(_) => continue,
                },
                recv(jobs) -> job => match job {
                    Ok(job) => job,
                    Err(_) => {
                        // Closing: the reader hands back what it lost, which is sent once more.
                        drop(conn.take());
                        while let Ok(job) = resends.try_recv() {
                            dispatch(shared, endpoint, &mut conn, &resend_tx, job);
                        }
                        return;
                    }
                },
                default(idle) => {
                    if conn.take().is_some() {
                        tracing::debug!(%endpoint, "tcp engine: closed an idle connection");
                    }
                    continue;
                }
            },
        };
        dispatch(shared, endpoint, &mut conn, &resend_tx, job);
    }
}

/// Sends `job` over `conn`, (re)connecting first if needed; requests the connection loses while
/// being written are sent once more on a fresh one.
fn dispatch(shared: &ClientShared, endpoint: &str, conn: &mut Option<Conn>, resend: &Sender<Job>, job: Job) {
    let mut next = Some(job);
    while let Some(mut job) = next.take() {
        if conn.as_ref().is_some_and(|c| !c.usable()) {
            *conn = None;
        }
        if conn.is_none() {
            match Conn::open_retrying(shared, endpoint, resend) {
                Ok(c) => *conn = Some(c),
                Err((kind, message)) => {
                    tracing::debug!(%endpoint, %message, "tcp engine: cannot connect");
                    job.fail_rest(kind, &message);
                    return;
                }
            }
        }
        if let Some(c) = conn.as_mut()
            && let Err(rest) = c.send(job)
        {
            // Dropping the connection joins its reader, which hands back what it lost.
            *conn = None;
            next = rest;
        }
    }
}

/// Why a connection could not be opened.
struct OpenFailure {
    kind: FailureKind,
    message: String,
    /// The server accepted the connection and closed it before answering the hello (its
    /// pending-handshake caps): worth another attempt.
    dropped: bool,
}

impl Conn {
    /// [`open`](Self::open), tried again (after a short pause) while the server drops the
    /// handshake unanswered, at most [`OPEN_ATTEMPTS`] times.
    fn open_retrying(
        shared: &ClientShared,
        endpoint: &str,
        resend: &Sender<Job>,
    ) -> Result<Self, (FailureKind, String)> {
        let mut attempt = 1;
        loop {
            match Self::open(shared, endpoint, resend) {
                Ok(c) => return Ok(c),
                Err(f) if f.dropped && attempt < OPEN_ATTEMPTS => {
                    tracing::debug!(%endpoint, message = %f.message, attempt, "tcp engine: handshake dropped; trying again");
                    std::thread::sleep(OPEN_BACKOFF * attempt);
                    attempt += 1;
                }
                Err(f) => return Err((f.kind, f.message)),
            }
        }
    }

    fn open(shared: &ClientShared, endpoint: &str, resend: &Sender<Job>) -> Result<Self, OpenFailure> {
        let metrics = &shared.metrics;
        let connect_failed = |kind: FailureKind, message: String| {
            metrics.connect_failed.fetch_add(1, Ordering::Relaxed);
            OpenFailure { kind, message, dropped: false }
        };
        let stream = dial(endpoint, shared.connect_timeout, shared.io_timeout, &shared.hello).map_err(|f| {
            if f.kind == FailureKind::Unauthorized {
                metrics.unauthorized.fetch_add(1, Ordering::Relaxed);
            }
            OpenFailure { dropped: f.dropped, ..connect_failed(f.kind, f.message) }
        })?;
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
        let io_timeout = shared.io_timeout;
        let reader = {
            let state = Arc::clone(&state);
            let endpoint = endpoint.to_owned();
            let resend = resend.clone();
            std::thread::Builder::new()
                .name("umbp-tcp-rx".into())
                .spawn(move || run_reader(read_half, &state, &rx, &endpoint, io_timeout, &resend))
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
        idle_and_open(&self.stream)
    }

    /// Writes a job's requests; `Err` when the connection broke, carrying the requests not handed
    /// to the reader yet if they may be sent again (see the module docs). Every request of the job
    /// is completed or handed on either way: by the reader for those handed to it, here (or by the
    /// returned job) for the rest.
    fn send(&mut self, mut job: Job) -> Result<(), Option<Job>> {
        let batch = Arc::clone(&job.batch);
        // The writes below read the batch's local memory: it stays registered until they return.
        let Some(_touch) = batch.touch(&self.state) else {
            job.fail_rest(FailureKind::Timeout, "the batch passed its deadline before it was sent");
            return Ok(());
        };
        while job.done < job.reqs.len() {
            let start = job.done;
            let mut end = start;
            let mut bytes = 0u64;
            while end < job.reqs.len() && end - start < GROUP_REQUESTS && bytes < GROUP_BYTES {
                bytes = bytes.saturating_add(job.reqs[end].len);
                end += 1;
            }
            if let Some((kind, message)) = self.state.error() {
                return Err(job.retry_or_fail(kind, &message));
            }
            let group: Vec<(u64, Req)> = job.reqs[start..end]
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
                    // SAFETY: `r.local..r.local + r.len` was bounds-checked against the plan's
                    // local side at submit (`LocalSide::range`, which also checked that `len` fits
                    // `usize`). That memory stays valid while `_touch` lives, which is until after
                    // this write: a registered region because the batch's guards keep it
                    // registered, unregistered caller memory because the caller keeps it valid
                    // until the handle is waited or dropped, and waiting blocks on `_touch`. The
                    // slice is only read (by the kernel's `send`).
                    slices.push(IoSlice::new(unsafe { std::slice::from_raw_parts(r.local, r.len as usize) }));
                }
            }
            self.state.in_flight.fetch_add(1, Ordering::SeqCst);
            // From here the group (and its failure, should the connection break) is the reader's.
            job.done = end;
            let group = Group { batch: Arc::clone(&batch), reqs: group, settled: false, retried: job.retried };
            let handed = match self.groups.as_ref() {
                Some(tx) => tx.send(group).map_err(|e| e.into_inner()),
                None => Err(group),
            };
            if let Err(group) = handed {
                // The reader is gone (it only leaves when the channel closes, or if it panicked).
                // Dropping the group fails its requests.
                drop(group);
                let message = "the connection's reader stopped";
                self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
                self.state.fail(FailureKind::ConnectionLost, message.into());
                job.fail_rest(FailureKind::ConnectionLost, message);
                return Err(None);
            }
            if let Err(e) = write_all_vectored(&mut self.stream, &mut slices) {
                // The group already handed over is the reader's to resend or fail; the rest is ours.
                self.state.fail(failure_kind(&e), format!("writing requests: {e}"));
                let (kind, message) = self.state.error().unwrap_or((failure_kind(&e), e.to_string()));
                return Err(job.retry_or_fail(kind, &message));
            }
        }
        Ok(())
    }
}

fn run_reader(
    stream: TcpStream,
    state: &Arc<ConnState>,
    groups: &Receiver<Group>,
    endpoint: &str,
    io_timeout: Duration,
    resend: &Sender<Job>,
) {
    let mut reader = FrameReader::new(stream, READ_BUFFER, REPLY_LEN, io_timeout);
    while let Ok(mut group) = groups.recv() {
        let batch = Arc::clone(&group.batch);
        let mut failed = Vec::new();
        match batch.touch(state) {
            None => {
                // The waiter gave up on the batch (and shut this connection down).
                let message = "the batch passed its deadline";
                failed.extend(group.reqs.iter().map(|(_, r)| (r.plan, FailureKind::Timeout, message.to_owned())));
                group.settle(failed);
            }
            Some(_touch) => {
                // Requests the broken connection lost, to send once more (see the module docs).
                let mut lost = Vec::new();
                for (i, (id, req)) in group.reqs.iter().enumerate() {
                    let broken = match state.error() {
                        Some(reason) => Some(reason),
                        None => match read_reply(&mut reader, *id, req) {
                            Ok(Status::Ok) => None,
                            Ok(status) => {
                                failed.push((req.plan, status_kind(status), status_message(status, req, endpoint)));
                                None
                            }
                            Err((kind, message)) => {
                                // The first reason wins: a deadline that shut the socket down, not
                                // the broken read it caused.
                                state.fail(kind, message.clone());
                                Some(state.error().unwrap_or((kind, message)))
                            }
                        },
                    };
                    match broken {
                        Some((FailureKind::ConnectionLost, _)) if !group.retried => lost.push(i),
                        Some((kind, message)) => failed.push((req.plan, kind, message)),
                        None => {}
                    }
                }
                if let Some(job) = group.settle_but(failed, &lost)
                    && let Err(e) = resend.send(job)
                {
                    // The slot's worker is gone: dropping the job fails its requests.
                    drop(e.into_inner());
                }
            }
        }
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
        // SAFETY: `req.local..req.local + req.len` was bounds-checked against the plan's local side
        // at submit (`LocalSide::range`, which also checked that `len` fits `usize`). It stays
        // valid while the reader holds the batch's `Touch`, which is until after this read: a
        // registered region because the batch's guards keep it registered, unregistered caller
        // memory because the caller keeps it valid until the handle is waited or dropped, and
        // waiting blocks on the touch. The slice is only handed to the kernel's `recv`; the caller
        // does not use a transfer's destination while it runs.
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
        Status::DeviceError => FailureKind::RemoteDevice,
        // Keyed statuses never answer a READ or WRITE: a server that sends one is off protocol.
        Status::BadRequest
        | Status::Miss
        | Status::Busy
        | Status::TooSmall
        | Status::Exists
        | Status::NoSpace
        | Status::Failed
        | Status::Unsupported
        | Status::Mapped => FailureKind::Protocol,
    }
}

fn status_message(status: Status, req: &Req, endpoint: &str) -> String {
    match status {
        Status::UnknownRegion => format!("{endpoint} has no region {}", req.region),
        Status::OutOfRange => {
            format!("{endpoint} refused [{}, +{}) of region {}: out of range", req.remote_offset, req.len, req.region)
        }
        Status::DeviceError => format!(
            "{endpoint} could not copy [{}, +{}) of GPU region {} through host staging (its GPU runtime failed)",
            req.remote_offset, req.len, req.region
        ),
        _ => format!("{endpoint} refused the request ({})", status.as_str()),
    }
}

/// The peers this engine talks to: a [`DashMap`], because every batch looks up each of its peers
/// here, and one peer's lookup (or the first contact that starts its pool) should not wait for
/// another's.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    pools: DashMap<String, Arc<PeerPool>>,
}

impl Peers {
    pub(crate) fn get(&self, shared: &Arc<ClientShared>, endpoint: &str, connections: usize) -> Arc<PeerPool> {
        if let Some(p) = self.pools.get(endpoint) {
            return Arc::clone(&p);
        }
        // Under the entry's shard lock: two first contacts with one peer start one pool.
        let entry = self.pools.entry(endpoint.to_owned());
        Arc::clone(&entry.or_insert_with(|| Arc::new(PeerPool::new(shared, endpoint, connections))))
    }

    /// Closes the pool of `endpoint` (after its queued work), waiting until `deadline` at most.
    pub(crate) fn forget(&self, endpoint: &str, deadline: Instant) {
        if let Some((_, p)) = self.pools.remove(endpoint) {
            p.shutdown(deadline);
        }
    }

    pub(crate) fn shutdown(&self, deadline: Instant) {
        let mut pools = Vec::new();
        self.pools.retain(|_, p| {
            pools.push(Arc::clone(p));
            false
        });
        for p in pools {
            p.shutdown(deadline);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(plan: u32) -> Req {
        Req { plan, op: Op::Read, region: 1, remote_offset: 0, local: std::ptr::null_mut(), len: 1 }
    }

    fn batch(per_plan: Vec<usize>) -> Arc<Batch> {
        let metas = per_plan.iter().map(|_| PlanMeta { tags: vec![7], endpoint: "peer".into() }).collect();
        Arc::new(Batch::new(metas, per_plan, Vec::new(), Instant::now() + Duration::from_secs(30)))
    }

    #[test]
    fn a_job_dropped_by_a_stopped_worker_fails_its_requests() {
        let b = batch(vec![2]);
        let job = Job::new(Arc::clone(&b), vec![req(0), req(0)]);
        // A worker that panics unwinds through its job.
        let _ = std::thread::spawn(move || {
            let _job = job;
            panic!("worker died");
        })
        .join();
        let started = Instant::now();
        let failures = b.wait();
        assert!(started.elapsed() < Duration::from_secs(5), "the waiter is not left counting");
        assert_eq!(failures.len(), 1);
        assert_eq!(failures[0].kind, FailureKind::ConnectionLost);
    }

    #[test]
    fn a_group_dropped_by_a_stopped_reader_fails_its_requests() {
        let b = batch(vec![1, 1]);
        let group =
            Group { batch: Arc::clone(&b), reqs: vec![(1, req(0)), (2, req(1))], settled: false, retried: false };
        drop(group);
        let started = Instant::now();
        let failures = b.wait();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(failures.len(), 2);
        assert!(failures.iter().all(|f| f.kind == FailureKind::ConnectionLost), "{failures:?}");
    }
}
