//! `SharedMemoryEngine`: the bytes of a pair whose remote side is a region of a holder on this host,
//! copied through a mapping of the holder's memory file instead of over the TCP data plane.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_core::{
    LocalRegion, MemoryLocation, MemoryRegistrar, MetricSource, RegistrationError, RemoteRegion, TransferRef,
};

use super::{SharedMapping, ShmClient, ShmClientConfig, ShmError};
use crate::engine::{
    CompletedHandle, FailureKind, PlanSet, TransferDirection, TransferEngine, TransferFailure, TransferHandle,
    TransferItem, TransferPlan,
};
use crate::local::{LocalCopyConfig, LocalCopyEngine};
use crate::planning::{SideKey, plan_in_range, plan_pairs};

/// Settings of a [`SharedMemoryEngine`].
#[derive(Debug, Clone)]
pub struct SharedMemoryConfig {
    /// The handshake's settings: the cluster token and the socket timeout.
    pub client: ShmClientConfig,
    /// This node's own data endpoint ("" for a node that serves none): refs naming it are this
    /// process's memory, never a holder's.
    pub own_endpoint: String,
    /// How long a holder without a shared path (no server on this host, a refusal, a broken
    /// connection), or a region it does not share, is left to the next engine before it is tried
    /// again. Default: 5 s.
    pub retry_after: Duration,
    /// The copies (threads, and the size from which one submit spreads over them).
    pub copy: LocalCopyConfig,
}

impl SharedMemoryConfig {
    /// Defaults for a node whose data endpoint is `own_endpoint` ("" for none), with cluster token
    /// `token`.
    pub fn new(own_endpoint: impl Into<String>, token: impl Into<Vec<u8>>) -> Self {
        Self {
            client: ShmClientConfig::new(token),
            own_endpoint: own_endpoint.into(),
            retry_after: Duration::from_secs(5),
            copy: LocalCopyConfig::default(),
        }
    }
}

/// What is remembered about a holder that has no shared path, or regions it does not share.
#[derive(Debug, Default)]
struct Refused {
    /// The holder is left to the next engine until then.
    peer_until: Option<Instant>,
    /// Regions it does not share (or that went stale), each until then.
    regions: HashMap<u64, Instant>,
}

/// The same-host data path: a pair of local host memory and a region of a holder **on this host**
/// is copied with loads and stores through a `MAP_SHARED` mapping of the holder's sealed memory file
/// (obtained once over the holder's [`ShmServer`](super::ShmServer) socket and cached by the
/// [`ShmClient`]); leases, commits and releases still go through the holder.
///
/// # Selection
/// [`can_handle`](TransferEngine::can_handle) is true for a pair whose one side is host memory of
/// this process and whose other side is a remote-only ref of another endpoint that this engine can
/// map now: the holder's socket answered the handshake and named the region. "Same host" needs no
/// published identity: the holder's socket lives in the Linux abstract namespace of its network
/// namespace, so a reader that reaches it shares the holder's kernel (and boot) and network
/// namespace — the [`HostIdentity`](super::HostIdentity) rule, checked by construction. A holder
/// without a server (another host, the path off, an older build), a refusal or a broken
/// connection leaves that holder to the next engine for
/// [`retry_after`](SharedMemoryConfig::retry_after); a region the holder does not share (an SSD
/// staging arena, GPU memory) is remembered the same way, so a peer without the path costs one
/// connect per interval, not one per batch.
///
/// # Copies and staleness
/// `submit` checks each holder's connection once (a holder that hung up is forgotten and its pairs
/// fail with [`FailureKind::ConnectionLost`]), copies every plan on the in-process copy engine
/// (coalesced; large submits over several threads), then checks each mapping's epoch: a region the
/// holder deregistered or re-registered during the copy fails its plan with
/// [`FailureKind::UnknownRegion`] — never reported as good bytes. Every failure is one the
/// composite engine hands to the next engine of the pair (TCP) at once
/// ([`fallback_on_failure`](TransferEngine::fallback_on_failure)).
///
/// The engine registers nothing itself: the composite engine hands shareable regions to the node's
/// [`ShmServer`](super::ShmServer) (see
/// [`CompositeTransferEngine::with_shm_server`](crate::CompositeTransferEngine::with_shm_server)).
pub struct SharedMemoryEngine {
    config: SharedMemoryConfig,
    client: Arc<ShmClient>,
    copy: LocalCopyEngine,
    refused: Mutex<HashMap<String, Refused>>,
}

impl fmt::Debug for SharedMemoryEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedMemoryEngine")
            .field("own_endpoint", &self.config.own_endpoint)
            .field("retry_after", &self.config.retry_after)
            .field("cached_regions", &self.client.cached_regions())
            .finish_non_exhaustive()
    }
}

/// The pair of a plan or item as this engine sees it.
struct Pair<'a> {
    direction: TransferDirection,
    remote_ref: &'a TransferRef,
    remote: &'a RemoteRegion,
}

impl SharedMemoryEngine {
    /// An engine with `config`; it connects to nobody until a pair asks for it.
    pub fn new(config: SharedMemoryConfig) -> Self {
        let client = Arc::new(ShmClient::new(config.client.clone()));
        Self::with_client(config, client)
    }

    /// An engine that maps holders' regions through `client` (whose settings replace
    /// `config.client`), shared with the process's other users of the shared path — the keyed
    /// client's single-key gets and puts (`KeyedClient::with_shm_client`) — so a process holds one
    /// connection and one mapping per holder region, not one per user.
    pub fn with_client(config: SharedMemoryConfig, client: Arc<ShmClient>) -> Self {
        let copy = LocalCopyEngine::new(config.copy.clone());
        Self { config, client, copy, refused: Mutex::new(HashMap::new()) }
    }

    /// The client that maps holders' regions (for diagnostics and [`ShmClient::sweep`]).
    pub fn client(&self) -> &Arc<ShmClient> {
        &self.client
    }

    /// Whether `r` is a holder's region: a remote handle of another, non-empty endpoint and no
    /// memory of this process.
    fn remote_of<'a>(&self, r: &'a TransferRef) -> Option<&'a RemoteRegion> {
        if r.local_region().is_some() || !r.location().is_host() {
            return None;
        }
        r.remote().filter(|rr| !rr.endpoint.is_empty() && rr.endpoint != self.config.own_endpoint)
    }

    fn pair<'a>(&self, src: &'a TransferRef, dst: &'a TransferRef) -> Option<Pair<'a>> {
        match (self.remote_of(src), self.remote_of(dst)) {
            (Some(remote), None) if local_host(dst) => {
                Some(Pair { direction: TransferDirection::Pull, remote_ref: src, remote })
            }
            (None, Some(remote)) if local_host(src) => {
                Some(Pair { direction: TransferDirection::Push, remote_ref: dst, remote })
            }
            _ => None,
        }
    }

    /// Whether `(endpoint, region_id)` is left to other engines now.
    fn refused(&self, endpoint: &str, region_id: u64) -> bool {
        let now = Instant::now();
        let mut refused = self.refused.lock();
        let Some(entry) = refused.get_mut(endpoint) else { return false };
        if entry.peer_until.is_some_and(|t| now < t) {
            return true;
        }
        entry.peer_until = None;
        match entry.regions.get(&region_id) {
            Some(&until) if now < until => true,
            Some(_) => {
                entry.regions.remove(&region_id);
                false
            }
            None => false,
        }
    }

    /// Remembers that `endpoint` (or only its region, for an error about one region) has no shared
    /// path for a while.
    fn remember(&self, endpoint: &str, region_id: u64, error: &ShmError) {
        let until = Instant::now() + self.config.retry_after;
        let mut refused = self.refused.lock();
        let entry = refused.entry(endpoint.to_owned()).or_default();
        match error {
            ShmError::UnknownRegion { .. } | ShmError::Stale { .. } | ShmError::OutOfRange { .. } => {
                tracing::debug!(peer = endpoint, region_id, error = %error, "region not shared; using the next engine");
                entry.regions.insert(region_id, until);
            }
            ShmError::Io { source, .. }
                if matches!(source.kind(), std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound) =>
            {
                // No server by that name in this network namespace: another host, or the path off.
                tracing::debug!(peer = endpoint, "no shared-memory server for this peer on this host");
                entry.peer_until = Some(until);
            }
            _ => {
                tracing::warn!(peer = endpoint, error = %error, "shared-memory path unavailable; using TCP for a while");
                entry.peer_until = Some(until);
            }
        }
    }

    /// The current mapping of a holder's region, or `None` (remembered) when there is none.
    fn mapping(&self, remote: &RemoteRegion) -> Option<Arc<SharedMapping>> {
        if self.refused(&remote.endpoint, remote.region_id) {
            return None;
        }
        match self.client.region(&remote.endpoint, remote.region_id) {
            Ok(mapping) => Some(mapping),
            Err(error) => {
                self.remember(&remote.endpoint, remote.region_id, &error);
                None
            }
        }
    }

    /// The plan with its remote side replaced by the mapped region, and the mapping (which must
    /// outlive the copy), or why it fails.
    fn localize(
        &self,
        plan: &TransferPlan,
        hung_up: &mut HashMap<String, bool>,
    ) -> Result<(TransferPlan, Arc<SharedMapping>), TransferFailure> {
        let fail = |kind, message: String, endpoint: &str| {
            TransferFailure::new(plan.tags.clone(), kind, message, endpoint.to_owned())
        };
        let Some(pair) = self.pair(&plan.src, &plan.dst) else {
            return Err(fail(FailureKind::Local, "plan is not local host memory and a holder's region".into(), ""));
        };
        let endpoint = pair.remote.endpoint.as_str();
        if !plan_in_range(plan) {
            return Err(fail(FailureKind::Local, "plan reaches outside its buffers".into(), endpoint));
        }
        let gone = *hung_up.entry(endpoint.to_owned()).or_insert_with(|| {
            let gone = self.client.has_peer(endpoint) && !self.client.connected(endpoint);
            if gone {
                self.client.forget_peer(endpoint);
                // Other holders may have gone too: unmap what they leave behind now.
                self.client.sweep();
                self.remember(
                    endpoint,
                    pair.remote.region_id,
                    &ShmError::Protocol {
                        peer: endpoint.to_owned(),
                        reason: "the holder closed its connection".into(),
                    },
                );
            }
            gone
        });
        if gone {
            return Err(fail(FailureKind::ConnectionLost, "the holder went away".into(), endpoint));
        }
        let Some(mapping) = self.mapping(pair.remote) else {
            return Err(fail(FailureKind::UnknownRegion, "no current mapping of the region".into(), endpoint));
        };
        if pair.remote_ref.size() > mapping.len() {
            return Err(fail(
                FailureKind::OutOfRange,
                format!("a ref of {} bytes over a shared region of {}", pair.remote_ref.size(), mapping.len()),
                endpoint,
            ));
        }
        // SAFETY: the mapping is valid memory for `mapping.len()` bytes while `mapping` lives (its
        // file is sealed against shrinking), and the caller keeps the `Arc` until the copy is done.
        let region = unsafe { LocalRegion::new(mapping.as_ptr(), mapping.len(), MemoryLocation::Host) };
        let mapped = TransferRef::local(region).truncated(pair.remote_ref.size());
        let mut local = plan.clone();
        match pair.direction {
            TransferDirection::Pull => local.src = mapped,
            _ => local.dst = mapped,
        }
        local.direction = TransferDirection::Local;
        Ok((local, mapping))
    }
}

fn local_host(r: &TransferRef) -> bool {
    r.local_region().is_some_and(|l| l.location().is_host() && r.size() <= l.len())
}

impl MemoryRegistrar for SharedMemoryEngine {
    /// Registers nothing: a holder's regions reach its peers through its
    /// [`ShmServer`](super::ShmServer), and local memory needs no registration to be copied. The ref
    /// carries `region` only.
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        Ok(TransferRef::local(region))
    }

    fn deregister(&self, _r: &TransferRef) {}
}

impl MetricSource for SharedMemoryEngine {}

impl TransferEngine for SharedMemoryEngine {
    fn name(&self) -> &str {
        "SharedMemoryEngine"
    }

    /// Copies finish inside `submit`.
    fn completes_in_submit(&self) -> bool {
        true
    }

    fn fallback_on_failure(&self) -> bool {
        true
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        let Some(pair) = self.pair(src, dst) else { return false };
        self.mapping(pair.remote).is_some_and(|m| pair.remote_ref.size() <= m.len())
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        plan_pairs(items, |item| {
            if !self.can_handle(&item.src, &item.dst) {
                return None;
            }
            let pair = self.pair(&item.src, &item.dst)?;
            match pair.direction {
                TransferDirection::Pull => {
                    Some((pair.direction, SideKey::remote(&item.src)?, SideKey::local(&item.dst)?))
                }
                _ => Some((pair.direction, SideKey::local(&item.src)?, SideKey::remote(&item.dst)?)),
            }
        })
    }

    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        let mut failures = Vec::new();
        let mut hung_up = HashMap::new();
        let mut local = Vec::with_capacity(plans.len());
        let mut held = Vec::with_capacity(plans.len());
        for plan in &plans {
            match self.localize(plan, &mut hung_up) {
                Ok((p, mapping)) => {
                    held.push((plan.tags.clone(), mapping));
                    local.push(p);
                }
                Err(failure) => failures.push(failure),
            }
        }
        if !local.is_empty() {
            failures.extend(self.copy.submit(local)?.wait());
        }
        // After the copy: a region deregistered (or re-registered) meanwhile makes its bytes
        // untrustworthy, whichever way they went.
        for (tags, mapping) in held {
            if !mapping.is_current() {
                let error = ShmError::Stale { peer: mapping.peer().to_owned(), region_id: mapping.region_id() };
                self.client.evict(mapping.peer(), mapping.region_id());
                self.remember(mapping.peer(), mapping.region_id(), &error);
                failures.push(TransferFailure::new(
                    tags,
                    FailureKind::UnknownRegion,
                    error.to_string(),
                    mapping.peer(),
                ));
            }
        }
        Ok(Box::new(CompletedHandle::new(failures)))
    }
}
