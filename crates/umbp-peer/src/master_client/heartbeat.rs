//! The heartbeat state machine: registration, delta rounds, chunked full sync and clear. Every
//! function here runs with the send lock held (or takes it), so rounds never interleave.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use prost::Message;
use umbp_core::{drain_all_backends, snapshot_all_backends_for_full_sync};
use umbp_proto::v1 as pb;

use super::error::MasterClientError;
use super::{Inner, bump, wire};
use umbp_core::RateLimited;

/// Repeated warnings of the heartbeat loop (every tick of a master outage would print one).
static RE_REGISTER_FAILED: RateLimited = RateLimited::every(RateLimited::WINDOW);
static SYNC_CHUNK_FAILED: RateLimited = RateLimited::every(RateLimited::WINDOW);
static OUTBOX_FULL: RateLimited = RateLimited::every(RateLimited::WINDOW);

/// First pause between two attempts of a clear.
const CLEAR_BACKOFF_START: Duration = Duration::from_millis(50);
/// Longest pause between two attempts of a clear.
const CLEAR_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The shortest heartbeat interval a master can impose.
const MIN_INTERVAL: Duration = Duration::from_millis(1);
/// The longest heartbeat interval a master can impose (a larger value is clamped to it).
const MAX_INTERVAL: Duration = Duration::from_secs(3600);

/// The client's half of the seq contract.
pub(super) struct HbState {
    /// A registration succeeded (and no unregister followed).
    pub(super) registered: bool,
    /// A registration was sent whose outcome this client may not know (it timed out or failed in
    /// transit, yet the master may have applied it): shutdown unregisters anyway (idempotent, and
    /// scoped to this process's incarnation), so a client never leaves a ghost record behind.
    pub(super) register_sent: bool,
    /// The master forgot the node: re-register before anything else.
    pub(super) needs_register: bool,
    /// The heartbeat interval (from the registration reply).
    pub(super) interval: Duration,
    /// Delta bundles not yet acknowledged, ascending consecutive seqs.
    pub(super) outbox: VecDeque<pb::EventBundle>,
    /// Events in `outbox`.
    pub(super) outbox_events: usize,
    /// The seq of the next delta bundle.
    pub(super) next_seq: u64,
    /// The highest seq the master acknowledged.
    pub(super) acked: u64,
    /// The next round sends a full sync.
    pub(super) full_sync_pending: bool,
    /// The media are cleared and gated: the next acknowledged full sync reopens them.
    pub(super) clear_pending: bool,
    /// The last heartbeat RPC failed (no answer): a pending full sync first probes the master with a
    /// keepalive instead of snapshotting every key for a master that is down.
    pub(super) master_unreachable: bool,
    /// The node's external KV set and its queued changes (`external_outbox.rs`).
    pub(super) external: super::external_outbox::ExternalOutbox,
}

impl std::fmt::Debug for HbState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Counts only: the outbox may hold a million events.
        f.debug_struct("HbState")
            .field("registered", &self.registered)
            .field("needs_register", &self.needs_register)
            .field("interval", &self.interval)
            .field("outbox_bundles", &self.outbox.len())
            .field("outbox_events", &self.outbox_events)
            .field("next_seq", &self.next_seq)
            .field("acked", &self.acked)
            .field("full_sync_pending", &self.full_sync_pending)
            .field("clear_pending", &self.clear_pending)
            .field("master_unreachable", &self.master_unreachable)
            .finish()
    }
}

impl HbState {
    pub(super) fn new(interval: Duration) -> Self {
        Self {
            registered: false,
            register_sent: false,
            needs_register: false,
            interval,
            outbox: VecDeque::new(),
            outbox_events: 0,
            next_seq: 1,
            acked: 0,
            full_sync_pending: false,
            clear_pending: false,
            master_unreachable: false,
            external: Default::default(),
        }
    }

    /// A fresh baseline for a full sync (or a clear's empty one): a seq never used before, by a delta
    /// or by another sync. The master accepts a sync only when its baseline is above its
    /// `last_applied`, so a delayed or repeated copy of an older sync can never pass for this one.
    pub(super) fn take_baseline(&mut self) -> u64 {
        let baseline = self.next_seq;
        self.next_seq += 1;
        baseline
    }

    /// The master reports `acked` past anything this registration sent (a record left by an earlier
    /// incarnation of the node): number on from above it, so the next baseline is accepted.
    fn skip_past(&mut self, acked: u64) {
        self.next_seq = self.next_seq.max(acked.saturating_add(1));
    }

    /// Forgets every queued delta (a full sync supersedes them).
    fn drop_outbox(&mut self) {
        self.outbox.clear();
        self.outbox_events = 0;
        self.external.drop_queued();
    }

    /// The master forgot the node: re-register, then full sync.
    fn master_forgot(&mut self) {
        self.needs_register = true;
        self.acked = 0;
        self.full_sync_pending = true;
    }
}

/// What the loop does after a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Next {
    /// Wait for the interval or a wake-up.
    Wait,
    /// Run another round at once (a backlog is draining, or a re-registration wants its full sync).
    Now,
}

fn alive(resp: &pb::HeartbeatResponse) -> bool {
    resp.status == pb::NodeStatus::Alive as i32
}

impl Inner {
    /// One `Heartbeat` RPC; a reply also refreshes the local placement grant. A reply saying a newer
    /// process took over the node id is [`MasterClientError::Superseded`].
    async fn heartbeat_rpc(
        &self,
        timeout: Duration,
        request: pb::HeartbeatRequest,
    ) -> Result<pb::HeartbeatResponse, MasterClientError> {
        let reply = self.call("Heartbeat", timeout, request, |mut c, r| async move { c.heartbeat(r).await }).await;
        if let Ok(reply) = &reply {
            self.local_puts.store(alive(reply) && reply.local_puts, Ordering::Relaxed);
            if !alive(reply) && reply.superseded {
                return Err(self.superseded_now());
            }
        }
        reply
    }

    /// The master says a newer process holds this node id: stop for good (never register again, never
    /// unregister: the record is the newer process's) and say so once, loudly.
    pub(super) fn superseded_now(&self) -> MasterClientError {
        let first = !self.superseded.send_replace(true);
        self.local_puts.store(false, Ordering::Relaxed);
        {
            let mut st = self.state.lock();
            st.registered = false;
            st.register_sent = false;
            st.needs_register = false;
            st.full_sync_pending = false;
        }
        let error = MasterClientError::Superseded { node_id: self.node.node_id.clone(), incarnation: self.incarnation };
        if first {
            tracing::error!(node = %self.node.node_id, incarnation = self.incarnation, "{error}");
        }
        error
    }

    pub(super) fn check_superseded(&self) -> Result<(), MasterClientError> {
        if *self.superseded.borrow() {
            return Err(MasterClientError::Superseded {
                node_id: self.node.node_id.clone(),
                incarnation: self.incarnation,
            });
        }
        Ok(())
    }

    /// The live capacity of every medium with total > 0, and the key count of every medium.
    fn caps_and_counts(&self) -> (Vec<pb::TierCapacity>, Vec<pb::TierKvCount>) {
        let mut caps = Vec::with_capacity(self.registry.len());
        let mut counts = Vec::with_capacity(self.registry.len());
        for (_, backend) in self.registry.entries() {
            let tier = backend.tier();
            let cap = backend.capacity();
            if cap.total_bytes > 0 {
                caps.push(umbp_proto::convert::capacity_to_wire(tier, cap, backend.page_size()));
            }
            counts.push(pb::TierKvCount {
                tier: umbp_proto::convert::tier_to_wire(tier),
                count: backend.owned_key_count() as u64,
            });
        }
        (caps, counts)
    }

    /// Registers with the full record (FIX §7.2: the re-registration too). With `again`,
    /// `ALREADY_EXISTS` counts as success (the master kept a live record of ours). Caller holds the
    /// send lock. Never registers once shutdown began (a clear or a round racing the unregister would
    /// otherwise bring the node back).
    pub(super) async fn register_locked(&self, again: bool) -> Result<(), MasterClientError> {
        if self.shut_down.load(Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        self.check_superseded()?;
        let (caps, _) = self.caps_and_counts();
        let lends_medium = !self.node.peer_address.is_empty() || !caps.is_empty();
        let request = pb::RegisterClientRequest {
            node_id: self.node.node_id.clone(),
            node_address: self.node.node_address.clone(),
            tier_capacities: caps,
            peer_address: self.node.peer_address.clone(),
            data_endpoint: self.node.data_endpoint.clone(),
            tags: self.node.tags.clone(),
            incarnation: self.incarnation,
        };
        // Whether an earlier attempt's outcome is unknown (then a refusal now may be of our own record).
        let uncertain_before = std::mem::replace(&mut self.state.lock().register_sent, true);
        let refused = |e: &MasterClientError| {
            // The master answered: it did not register this attempt, so nothing to unregister for it.
            let definite = match e {
                MasterClientError::Rpc { status, .. } => !matches!(
                    status.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::Unknown
                        | tonic::Code::Cancelled
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Internal
                ),
                _ => false,
            };
            if definite && !uncertain_before {
                self.state.lock().register_sent = false;
            }
        };
        let reply =
            self.call("RegisterClient", self.config.rpc_timeout, request, |mut c, r| async move {
                c.register_client(r).await
            })
            .await;
        let interval_ms = match reply {
            Ok(reply) => {
                self.local_puts.store(reply.local_puts, Ordering::Relaxed);
                Some(reply.heartbeat_interval_ms)
            }
            Err(MasterClientError::Rpc { status, .. }) if status.code() == tonic::Code::AlreadyExists => {
                if !again {
                    if !uncertain_before {
                        self.state.lock().register_sent = false;
                    }
                    return Err(MasterClientError::AlreadyRegistered { node_id: self.node.node_id.clone() });
                }
                None
            }
            // The master's answer to a registration of a lower incarnation than the record's.
            Err(MasterClientError::Rpc { status, .. }) if status.code() == tonic::Code::FailedPrecondition => {
                return Err(self.superseded_now());
            }
            Err(e) => {
                refused(&e);
                return Err(e);
            }
        };
        // Keys owned before this registration may have left their media's outboxes already (an
        // earlier client drained them): a full sync, not the deltas, must tell the master.
        let owns_keys = self.registry.entries().any(|(_, b)| b.owned_key_count() > 0);
        let mut st = self.state.lock();
        if let Some(ms) = interval_ms {
            st.interval = if ms == 0 {
                self.config.default_heartbeat_interval
            } else {
                Duration::from_millis(ms).clamp(MIN_INTERVAL, MAX_INTERVAL)
            };
        }
        // The master starts this node at seq 0. Anything sent before is gone from its view: only a
        // full sync (at a fresh baseline) lines the two up again.
        let had_history = st.next_seq > 1 || !st.outbox.is_empty() || owns_keys;
        st.acked = 0;
        st.needs_register = false;
        st.registered = true;
        if again || had_history {
            st.full_sync_pending = true;
        }
        drop(st);
        bump(&self.stats.registrations, 1);
        if again {
            bump(&self.stats.re_registrations, 1);
        }
        if lends_medium {
            tracing::info!(node = %self.node.node_id, incarnation = self.incarnation, again, "registered with the master");
        } else {
            // A client process (every CLI command is one): not worth an INFO line each.
            tracing::debug!(node = %self.node.node_id, incarnation = self.incarnation, again, "registered with the master");
        }
        Ok(())
    }

    /// One heartbeat round under the send lock.
    pub(super) async fn tick(&self) -> Result<Next, MasterClientError> {
        let _send = self.send_lock.lock().await;
        if self.shut_down.load(Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        self.check_superseded()?;
        let needs_register = self.state.lock().needs_register;
        if needs_register && let Err(e) = self.register_locked(true).await {
            self.warn_re_register_failed(&e);
            return Err(e);
        }
        if self.state.lock().full_sync_pending {
            return self.pending_full_sync_locked().await;
        }

        // One stream for every medium, numbered from one seq space.
        let events = drain_all_backends(self.registry.entries().map(|(_, b)| b));
        if !events.is_empty() && !self.enqueue(events) {
            bump(&self.stats.outbox_overflows, 1);
            return self.pending_full_sync_locked().await;
        }
        self.bundle_external();

        let mut request = self.keepalive_request();
        let budget = self.config.max_request_bytes.saturating_sub(request.encoded_len());
        {
            let st = self.state.lock();
            let mut bytes = 0usize;
            for bundle in st.outbox.iter().filter(|b| b.seq > st.acked).take(self.config.max_bundles_per_rpc) {
                let len = wire::bundle_len(bundle) + st.external.bundle_len(bundle.seq);
                if !request.bundles.is_empty() && bytes + len > budget {
                    break;
                }
                bytes += len;
                request.bundles.push(bundle.clone());
                if let Some(external) = st.external.bundle(bundle.seq) {
                    request.external_bundles.push(external.clone());
                }
            }
        }
        bump(&self.stats.heartbeats_sent, 1);
        if request.bundles.is_empty() {
            bump(&self.stats.keepalives_sent, 1);
        } else {
            bump(&self.stats.bundles_sent, request.bundles.len() as u64);
        }
        let reply = self.heartbeat_rpc(self.config.heartbeat_rpc_timeout, request).await;
        match reply {
            // Nothing changes: the same seqs go again next tick.
            Err(e) => {
                tracing::debug!(node = %self.node.node_id, error = %e, "heartbeat failed; resending next tick");
                self.state.lock().master_unreachable = true;
                Err(e)
            }
            Ok(reply) => {
                self.state.lock().master_unreachable = false;
                self.on_delta_reply(reply).await
            }
        }
    }

    /// A heartbeat without bundles: the live capacity and key count of every medium.
    fn keepalive_request(&self) -> pb::HeartbeatRequest {
        let (caps, counts) = self.caps_and_counts();
        pb::HeartbeatRequest {
            node_id: self.node.node_id.clone(),
            tier_capacities: caps,
            tier_kv_counts: counts,
            incarnation: self.incarnation,
            ..Default::default()
        }
    }

    fn warn_re_register_failed(&self, e: &MasterClientError) {
        if matches!(e, MasterClientError::Superseded { .. }) {
            return;
        }
        if let Some(held_back) = RE_REGISTER_FAILED.check() {
            tracing::warn!(node = %self.node.node_id, error = %e, held_back, "re-registration failed; retrying next tick");
        }
    }

    /// Runs the pending full sync. After an RPC failure the master may well be down: a keepalive
    /// probes it first, so a node does not snapshot (and encode) every key it owns on every tick of an
    /// outage only to have the first chunk fail. An `UNKNOWN` probe re-registers first.
    async fn pending_full_sync_locked(&self) -> Result<Next, MasterClientError> {
        if self.state.lock().master_unreachable {
            bump(&self.stats.heartbeats_sent, 1);
            bump(&self.stats.keepalives_sent, 1);
            let request = self.keepalive_request();
            let reply = self.heartbeat_rpc(self.config.heartbeat_rpc_timeout, request).await;
            match reply {
                Err(e) => {
                    tracing::debug!(node = %self.node.node_id, error = %e, "the master is still unreachable; the full sync waits");
                    return Err(e);
                }
                Ok(reply) => {
                    self.state.lock().master_unreachable = false;
                    if !alive(&reply) {
                        self.state.lock().master_forgot();
                        self.register_locked(true).await?;
                    }
                }
            }
        }
        self.full_sync_locked().await
    }

    /// Numbers `events` into bundles and queues them; `false` when they would overflow the outbox,
    /// in which case the queued deltas are dropped and a full sync is pending instead (FIX §7.9: never
    /// grow without bound; the full sync's snapshot covers every change these deltas describe).
    fn enqueue(&self, events: Vec<umbp_core::KvEvent>) -> bool {
        let mut st = self.state.lock();
        if st.outbox_events.saturating_add(events.len()) > self.config.max_outbox_events {
            if let Some(held_back) = OUTBOX_FULL.check() {
                tracing::warn!(
                    node = %self.node.node_id,
                    queued = st.outbox_events,
                    new = events.len(),
                    limit = self.config.max_outbox_events,
                    held_back,
                    "heartbeat outbox full: dropping queued deltas and sending a full sync"
                );
            }
            st.drop_outbox();
            st.full_sync_pending = true;
            return false;
        }
        let mut events = events.into_iter().map(pb::KvEvent::from).peekable();
        while events.peek().is_some() {
            let bundle: Vec<pb::KvEvent> = events.by_ref().take(self.config.events_per_bundle).collect();
            let seq = st.next_seq;
            st.next_seq += 1;
            st.outbox_events += bundle.len();
            st.outbox.push_back(pb::EventBundle { seq, events: bundle });
        }
        true
    }

    async fn on_delta_reply(&self, reply: pb::HeartbeatResponse) -> Result<Next, MasterClientError> {
        if !alive(&reply) {
            tracing::info!(node = %self.node.node_id, "the master does not know this node: re-registering");
            self.state.lock().master_forgot();
            return match self.register_locked(true).await {
                Ok(()) => Ok(Next::Now),
                Err(e) => {
                    self.warn_re_register_failed(&e);
                    Err(e)
                }
            };
        }
        if reply.request_full_sync {
            tracing::info!(node = %self.node.node_id, acked = reply.acked_seq, "the master asked for a full sync");
            self.state.lock().full_sync_pending = true;
            return self.full_sync_locked().await;
        }
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if reply.acked_seq >= st.next_seq {
            tracing::warn!(
                node = %self.node.node_id,
                acked = reply.acked_seq,
                next_seq = st.next_seq,
                "the master acknowledged seqs this node never sent; resynchronising with a full sync"
            );
            st.skip_past(reply.acked_seq);
            st.full_sync_pending = true;
            return Ok(Next::Now);
        }
        if reply.acked_seq < st.acked {
            // Within one registration the master's applied seq only grows. Going back means it lost
            // this node's state without answering UNKNOWN (a rebuilt store re-registered it at seq 0):
            // an idle node would otherwise stay missing from the index for good.
            tracing::warn!(
                node = %self.node.node_id,
                acked = reply.acked_seq,
                ours = st.acked,
                "the master's acknowledged seq went backwards: it lost this node's state; resynchronising with a full sync"
            );
            st.full_sync_pending = true;
            return Ok(Next::Now);
        }
        let progress = reply.acked_seq > st.acked;
        st.acked = reply.acked_seq;
        while st.outbox.front().is_some_and(|b| b.seq <= st.acked) {
            if let Some(bundle) = st.outbox.pop_front() {
                st.outbox_events = st.outbox_events.saturating_sub(bundle.events.len());
            }
        }
        let acked = st.acked;
        st.external.acked(acked);
        let backlog = !st.outbox.is_empty();
        Ok(if backlog && progress { Next::Now } else { Next::Wait })
    }

    /// Sends a full sync in chunks at a fresh baseline. It succeeds only when the final chunk's reply
    /// acknowledges exactly that baseline; then `full_sync_pending` clears, `acked = baseline` and
    /// writes gated by a clear reopen. Anything else (an RPC error, `UNKNOWN`, `request_full_sync`, or
    /// an ack that is not the baseline: the master did not take this sync) leaves it pending for the
    /// next tick, which starts again from chunk 0 with a fresh snapshot and a fresh baseline.
    pub(super) async fn full_sync_locked(&self) -> Result<Next, MasterClientError> {
        let snapshot = snapshot_all_backends_for_full_sync(self.registry.entries().map(|(_, b)| b));
        let (baseline, external_full_sync) = {
            let mut st = self.state.lock();
            // The snapshot is authoritative: every queued delta is in it (or was undone).
            st.drop_outbox();
            st.full_sync_pending = true;
            (st.take_baseline(), st.external.in_use())
        };
        bump(&self.stats.full_syncs_started, 1);
        let template = pb::HeartbeatRequest {
            is_full_sync: true,
            delta_seq_baseline: baseline,
            external_full_sync,
            // The largest values, so the budget holds for every chunk.
            full_sync_chunk: u32::MAX,
            full_sync_final: true,
            ..self.keepalive_request()
        };
        let budget = self.config.max_request_bytes.saturating_sub(template.encoded_len());
        let total = snapshot.len();
        // Converted and cut lazily: the snapshot and one chunk, never a second copy of every key.
        let mut events = snapshot.into_iter().map(pb::KvEvent::from).peekable();
        let mut chunk_index = 0u32;
        loop {
            let chunk = wire::take_chunk(&mut events, self.config.full_sync_chunk_events, budget, baseline);
            let is_final = events.peek().is_none();
            let bundles =
                if chunk.is_empty() { Vec::new() } else { vec![pb::EventBundle { seq: baseline, events: chunk }] };
            let request = pb::HeartbeatRequest {
                bundles,
                full_sync_chunk: chunk_index,
                full_sync_final: is_final,
                ..template.clone()
            };
            bump(&self.stats.heartbeats_sent, 1);
            bump(&self.stats.full_sync_chunks_sent, 1);
            let reply = self.heartbeat_rpc(self.config.heartbeat_rpc_timeout, request).await;
            let refused = |reason: String| {
                if let Some(held_back) = SYNC_CHUNK_FAILED.check() {
                    tracing::warn!(node = %self.node.node_id, chunk = chunk_index, baseline, reason, held_back, "full sync chunk failed; restarting from chunk 0 next tick");
                }
                MasterClientError::Refused {
                    rpc: "Heartbeat",
                    reason: format!("full sync at baseline {baseline}, chunk {chunk_index}: {reason}"),
                }
            };
            let reply = match reply {
                Err(e @ MasterClientError::Superseded { .. }) => return Err(e),
                Err(e) => {
                    if let Some(held_back) = SYNC_CHUNK_FAILED.check() {
                        tracing::warn!(node = %self.node.node_id, chunk = chunk_index, baseline, error = %e, held_back, "full sync chunk failed; restarting from chunk 0 next tick");
                    }
                    self.state.lock().master_unreachable = true;
                    return Err(e);
                }
                Ok(reply) => reply,
            };
            if !alive(&reply) {
                self.state.lock().master_forgot();
                return Err(refused("the master does not know this node".into()));
            }
            if reply.request_full_sync {
                return Err(refused("the master asked to start over".into()));
            }
            if (is_final && reply.acked_seq != baseline) || (!is_final && reply.acked_seq >= baseline) {
                // The master did not take this sync: its applied seq is at or past the baseline (a
                // stale baseline answered AlreadyApplied), or the final chunk did not move it there.
                if reply.acked_seq > baseline {
                    self.state.lock().skip_past(reply.acked_seq);
                }
                return Err(refused(format!("the master acknowledged seq {}, not the baseline", reply.acked_seq)));
            }
            if is_final {
                break;
            }
            chunk_index = chunk_index.saturating_add(1);
        }
        let (reopen, replay) = {
            let mut st = self.state.lock();
            st.acked = baseline;
            st.full_sync_pending = false;
            // The master dropped the node's external records at chunk 0: report the set again.
            (std::mem::take(&mut st.clear_pending), st.external.replay())
        };
        if reopen {
            self.reopen_writes();
        }
        bump(&self.stats.full_syncs_completed, 1);
        let chunks = u64::from(chunk_index) + 1;
        tracing::info!(node = %self.node.node_id, events = total, chunks, baseline, "full sync acknowledged");
        Ok(if replay { Next::Now } else { Next::Wait })
    }

    fn reopen_writes(&self) {
        for (_, backend) in self.registry.entries() {
            backend.clear_full_sync_acked();
        }
    }

    /// Clears every medium, then sends the empty full sync until the master acknowledges it or
    /// `deadline` passes (FIX §7.8). Shutdown cancels it: a clear must never re-register a node that
    /// has unregistered.
    pub(super) async fn clear(&self, deadline: Duration) -> Result<(), MasterClientError> {
        let mut shutdown = self.shutdown.subscribe();
        tokio::select! {
            biased;
            _ = shutdown.wait_for(|down| *down) => Err(MasterClientError::ShutDown),
            result = self.clear_until(deadline) => result,
        }
    }

    async fn clear_until(&self, deadline: Duration) -> Result<(), MasterClientError> {
        let started = Instant::now();
        let _send = self.send_lock.lock().await;
        if self.shut_down.load(Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        for (_, backend) in self.registry.entries() {
            backend.clear_local();
        }
        let registered = {
            let mut st = self.state.lock();
            st.drop_outbox();
            st.clear_pending = true;
            st.registered
        };
        if !registered {
            // The master holds nothing of this node's: a registration starts it empty.
            self.state.lock().clear_pending = false;
            self.reopen_writes();
            return Ok(());
        }
        let mut attempts = 0u32;
        let mut backoff = CLEAR_BACKOFF_START;
        loop {
            if self.shut_down.load(Ordering::Acquire) {
                return Err(MasterClientError::ShutDown);
            }
            attempts += 1;
            let remaining = deadline.saturating_sub(started.elapsed());
            let error = match self.clear_attempt(remaining).await {
                Ok(()) => return Ok(()),
                Err(e @ MasterClientError::Superseded { .. }) => return Err(e),
                Err(e) => e,
            };
            let remaining = deadline.saturating_sub(started.elapsed());
            if remaining.is_zero() {
                // Writes stay gated; the loop's next full sync (empty: the media are gated) finishes
                // the clear.
                self.state.lock().full_sync_pending = true;
                if self.running.load(Ordering::Acquire) {
                    self.wake.notify_one();
                }
                tracing::warn!(node = %self.node.node_id, attempts, error = %error, "clear not acknowledged; writes stay gated until the heartbeat loop delivers it");
                return Err(MasterClientError::ClearNotAcknowledged {
                    attempts,
                    after: deadline,
                    last: Some(Box::new(error)),
                });
            }
            tracing::debug!(node = %self.node.node_id, attempts, error = %error, "clear not acknowledged yet; retrying");
            tokio::time::sleep(backoff.min(remaining)).await;
            backoff = (backoff * 2).min(CLEAR_BACKOFF_MAX);
        }
    }

    async fn clear_attempt(&self, remaining: Duration) -> Result<(), MasterClientError> {
        if self.state.lock().needs_register {
            self.register_locked(true).await?;
        }
        let (baseline, external_full_sync) = {
            let mut st = self.state.lock();
            (st.take_baseline(), st.external.in_use())
        };
        let request = pb::HeartbeatRequest {
            is_full_sync: true,
            delta_seq_baseline: baseline,
            external_full_sync,
            full_sync_chunk: 0,
            full_sync_final: true,
            ..self.keepalive_request()
        };
        bump(&self.stats.heartbeats_sent, 1);
        bump(&self.stats.full_syncs_started, 1);
        bump(&self.stats.full_sync_chunks_sent, 1);
        let timeout = self.config.heartbeat_rpc_timeout.min(remaining).max(Duration::from_millis(1));
        let reply = self.heartbeat_rpc(timeout, request).await;
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                self.state.lock().master_unreachable = true;
                return Err(e);
            }
        };
        self.state.lock().master_unreachable = false;
        if !alive(&reply) {
            self.state.lock().master_forgot();
            return Err(MasterClientError::Refused {
                rpc: "Heartbeat",
                reason: "the master does not know this node (re-registering)".into(),
            });
        }
        if reply.request_full_sync {
            return Err(MasterClientError::Refused {
                rpc: "Heartbeat",
                reason: "the master asked for a full sync instead of acknowledging the clear".into(),
            });
        }
        if reply.acked_seq != baseline {
            // A stale baseline (AlreadyApplied): nothing was cleared at the master.
            if reply.acked_seq > baseline {
                self.state.lock().skip_past(reply.acked_seq);
            }
            return Err(MasterClientError::Refused {
                rpc: "Heartbeat",
                reason: format!("the master acknowledged seq {}, not the clear's baseline {baseline}", reply.acked_seq),
            });
        }
        let replay = {
            let mut st = self.state.lock();
            st.acked = baseline;
            st.full_sync_pending = false;
            st.clear_pending = false;
            st.external.replay()
        };
        if replay && self.running.load(Ordering::Acquire) {
            self.wake.notify_one();
        }
        self.reopen_writes();
        bump(&self.stats.full_syncs_completed, 1);
        tracing::info!(node = %self.node.node_id, baseline, "clear acknowledged; writes reopen");
        Ok(())
    }
}
