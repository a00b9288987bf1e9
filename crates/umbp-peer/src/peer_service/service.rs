//! [`PeerService`]: the `UmbpPeer` handlers. Each handler moves its request into one blocking task
//! that runs the synchronous dispatch below against the media snapshot.

use std::collections::BTreeMap;
use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::Instrument;
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, BackendRegistry, BufferDesc, CommitRequest, MediumBackend,
    ReadRelease, ResolvedEntry, TierType,
};
use umbp_proto::convert::{outcome_to_wire, outcome_to_wire_for, tier_from_wire, tier_to_wire};
use umbp_proto::resolve::{ResolvedKey, decode_request_ranges, encode_batch_resolve};
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_peer_server::UmbpPeer;

use super::{slot_local, slot_tier, tag_slot};
use crate::pool_client::phases::{self, phase};

/// The `UMBPPeer` service of one node: dispatches every call into the node's media.
///
/// Cheap to clone (one `Arc`). The media are the registry's at construction, in its order (ascending
/// tier); a medium registered later is not seen. See the [module docs](super) for the semantics.
#[derive(Clone)]
pub struct PeerService {
    inner: Arc<Dispatch>,
    /// Runs after a commit or evict changed what the node owns (set by the composition root to wake
    /// the heartbeat, so the master hears of remote writes in milliseconds, not at the next interval).
    on_change: Arc<parking_lot::RwLock<Option<ChangeHook>>>,
}

/// Called after remote commits and evictions; must be cheap and must not block.
pub type ChangeHook = Arc<dyn Fn() + Send + Sync>;

impl std::fmt::Debug for PeerService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerService").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl PeerService {
    /// A service over the media of `registry`, advertising `data_endpoint` (`host:port` of the node's
    /// TCP data server) in `GetPeerInfo`. An empty registry is allowed: every allocation fails and
    /// every resolve misses.
    pub fn new(registry: Arc<BackendRegistry>, data_endpoint: impl Into<String>) -> Self {
        let media = registry
            .entries()
            .map(|(id, backend)| Medium { id, tier: backend.tier(), backend: Arc::clone(backend) })
            .collect();
        Self {
            inner: Arc::new(Dispatch { media, page_size: registry.page_size(), data_endpoint: data_endpoint.into() }),
            on_change: Arc::default(),
        }
    }

    /// Installs the hook run after every commit or evict batch that changed what the node owns
    /// (replaces an earlier one). Shared by every clone of the service, so it may be set after the
    /// server started.
    pub fn set_change_hook(&self, hook: Option<ChangeHook>) {
        *self.on_change.write() = hook;
    }

    /// The media the service dispatches to: (backend id, tier, medium), ascending tier.
    pub(super) fn media(&self) -> impl Iterator<Item = (u32, TierType, &Arc<dyn MediumBackend>)> {
        self.inner.media.iter().map(|m| (m.id, m.tier, &m.backend))
    }

    pub(super) fn changed(&self) {
        if let Some(hook) = self.on_change.read().as_ref() {
            hook();
        }
    }

    /// The data endpoint advertised in `GetPeerInfo`.
    pub fn data_endpoint(&self) -> &str {
        &self.inner.data_endpoint
    }

    /// Runs `f` against the dispatch on the blocking pool.
    async fn blocking<T, F>(&self, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Dispatch) -> T + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || f(&inner)).await.map_err(|e| {
            tracing::error!(error = %e, "peer service handler panicked");
            Status::internal("peer service handler failed")
        })
    }
}

#[derive(Debug)]
struct Medium {
    id: u32,
    tier: TierType,
    backend: Arc<dyn MediumBackend>,
}

#[derive(Debug)]
struct Dispatch {
    /// Ascending tier, as the registry iterates.
    media: Vec<Medium>,
    page_size: u64,
    data_endpoint: String,
}

fn failed_allocation() -> pb::AllocateSlotResponse {
    pb::AllocateSlotResponse { outcome: outcome_to_wire(AllocateOutcome::Failed), ..Default::default() }
}

/// A descriptor as published: stamped with the registry's backend id.
fn stamped(desc: &BufferDesc, backend_id: u32) -> pb::BufferDesc {
    let mut wire = pb::BufferDesc::from(desc);
    wire.backend_id = backend_id;
    wire
}

/// Whether a medium's hit is usable: its pages can hold its value (a partial hit's: they lie
/// inside it, at least one). A medium that says otherwise is answered as a miss (and logged, and
/// its lease released: no reader will copy), so a reader never runs past the pages it was given.
fn usable_hit(medium: &Medium, key: &str, entry: &ResolvedEntry, page_size: u64) -> bool {
    if !entry.found {
        return false;
    }
    let covered = if entry.partial {
        let value_pages = if page_size == 0 { 0 } else { entry.size.div_ceil(page_size) };
        !entry.pages.is_empty() && entry.first_page.saturating_add(entry.pages.len() as u64) <= value_pages
    } else {
        entry.first_page == 0 && (entry.pages.len() as u64).saturating_mul(page_size) >= entry.size
    };
    if !covered {
        tracing::warn!(
            backend = medium.backend.name(),
            size = entry.size,
            pages = entry.pages.len(),
            page_size,
            "resolve hit whose pages cannot hold its value; answering a miss"
        );
        medium.backend.release_reads(&[ReadRelease::new(key, entry.lease)]);
    }
    covered
}

impl Dispatch {
    fn peer_info(&self) -> pb::GetPeerInfoResponse {
        let buffer_descs = self
            .media
            .iter()
            .flat_map(|m| m.backend.all_buffer_descs().into_iter().map(move |d| stamped(&d, m.id)))
            .collect();
        pb::GetPeerInfoResponse { data_endpoint: self.data_endpoint.clone(), buffer_descs, page_size: self.page_size }
    }

    /// Allocates every entry on the medium of its tier. `accepts_busy`: the caller understands
    /// `ALLOCATE_BUSY`; for one that does not, busy is answered as no space (what it got before).
    fn allocate(&self, mut entries: Vec<pb::AllocateSlotRequest>, accepts_busy: bool) -> Vec<pb::AllocateSlotResponse> {
        let mut out = vec![failed_allocation(); entries.len()];
        for medium in &self.media {
            let mut at = Vec::new();
            let mut requests = Vec::new();
            for (i, e) in entries.iter_mut().enumerate() {
                if tier_from_wire(e.tier) != medium.tier {
                    continue;
                }
                if e.key.is_empty() || e.size == 0 {
                    tracing::debug!(index = i, size = e.size, "allocate: empty key or size 0");
                    continue;
                }
                at.push(i);
                requests.push(AllocateRequest { key: std::mem::take(&mut e.key), size: e.size });
            }
            if requests.is_empty() {
                continue;
            }
            let results = medium.backend.batch_allocate(&requests);
            if results.len() != requests.len() {
                tracing::warn!(
                    backend = medium.backend.name(),
                    asked = requests.len(),
                    answered = results.len(),
                    "batch_allocate broke its contract; unanswered entries fail"
                );
            }
            let mut refused = Vec::new();
            for (i, result) in at.into_iter().zip(results) {
                out[i] = self.allocation_answer(medium, result, accepts_busy, &mut refused);
            }
            if !refused.is_empty() {
                // Nobody can ever commit these slots; give their pages back now rather than at TTL.
                medium.backend.batch_abort(&refused);
            }
        }
        out
    }

    fn allocation_answer(
        &self,
        medium: &Medium,
        result: AllocateResult,
        accepts_busy: bool,
        refused: &mut Vec<u64>,
    ) -> pb::AllocateSlotResponse {
        if result.outcome != AllocateOutcome::Allocated {
            let outcome = outcome_to_wire_for(result.outcome, accepts_busy);
            return pb::AllocateSlotResponse { outcome, ..Default::default() };
        }
        let Some(slot_id) = tag_slot(medium.tier, result.slot_id) else {
            tracing::error!(
                backend = medium.backend.name(),
                slot_id = result.slot_id,
                "backend slot id does not fit 56 bits; refusing the slot"
            );
            refused.push(result.slot_id);
            return failed_allocation();
        };
        pb::AllocateSlotResponse {
            outcome: outcome_to_wire(AllocateOutcome::Allocated),
            slot_id,
            pages: result.pages.into_iter().map(pb::PageLocation::from).collect(),
            page_size: result.page_size,
            descs: result.descs.iter().map(|d| stamped(d, medium.id)).collect(),
            pending_ttl_ms: result.pending_ttl_ms,
            backend_id: medium.id,
        }
    }

    fn commit(&self, mut entries: Vec<pb::CommitSlotRequest>) -> Vec<pb::CommitSlotResponse> {
        let mut out = vec![pb::CommitSlotResponse { success: false, bytes_committed: 0 }; entries.len()];
        for medium in &self.media {
            let mut at = Vec::new();
            let mut requests = Vec::new();
            for (i, e) in entries.iter_mut().enumerate() {
                if slot_tier(e.slot_id) != medium.tier || e.key.is_empty() {
                    continue;
                }
                at.push(i);
                requests
                    .push(CommitRequest::new(slot_local(e.slot_id), std::mem::take(&mut e.key)).with_crc32c(e.crc32c));
            }
            if requests.is_empty() {
                continue;
            }
            let results = medium.backend.batch_commit(&requests);
            if results.len() != requests.len() {
                tracing::warn!(backend = medium.backend.name(), "batch_commit broke its contract");
            }
            for (i, r) in at.into_iter().zip(results) {
                out[i] = pb::CommitSlotResponse { success: r.success, bytes_committed: r.bytes_committed };
            }
        }
        out
    }

    fn abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        let mut out = vec![true; slot_ids.len()];
        for medium in &self.media {
            let (at, locals): (Vec<usize>, Vec<u64>) = slot_ids
                .iter()
                .enumerate()
                .filter(|(_, id)| slot_tier(**id) == medium.tier)
                .map(|(i, id)| (i, slot_local(*id)))
                .unzip();
            if locals.is_empty() {
                continue;
            }
            let results = medium.backend.batch_abort(&locals);
            if results.len() != locals.len() {
                tracing::warn!(backend = medium.backend.name(), "batch_abort broke its contract");
            }
            for (i, ok) in at.into_iter().zip(results) {
                out[i] = ok;
            }
        }
        out
    }

    fn resolve_one(&self, key: String) -> pb::ResolveKeyResponse {
        if key.is_empty() {
            return pb::ResolveKeyResponse::default();
        }
        let keys = [key];
        let mut busy = false;
        for medium in &self.media {
            let Some(entry) = medium.backend.batch_resolve(&keys, true).into_iter().next() else { continue };
            busy |= entry.busy;
            if !usable_hit(medium, &keys[0], &entry, self.page_size) {
                continue;
            }
            return pb::ResolveKeyResponse {
                found: true,
                pages: entry.pages.into_iter().map(pb::PageLocation::from).collect(),
                page_size: entry.page_size,
                descs: entry.descs.iter().map(|d| stamped(d, medium.id)).collect(),
                size: entry.size,
                backend_id: medium.id,
                tier: tier_to_wire(medium.tier),
                busy: false,
                lease_id: entry.lease,
                crc32c: entry.crc32c,
            };
        }
        pb::ResolveKeyResponse { busy, ..Default::default() }
    }

    /// Each medium, in order, is asked only for the keys no earlier medium answered (see the module
    /// docs for why this differs from the reference). With `ranges` (one list per key, from a
    /// ranged reader), each medium is asked with them and may answer partial hits.
    fn batch_resolve(
        &self,
        keys: Vec<String>,
        omit_descs: bool,
        ranges: Vec<Vec<(u64, u64)>>,
    ) -> pb::BatchResolveKeysResponse {
        let mut answers: Vec<Option<ResolvedKey>> = vec![None; keys.len()];
        // A key some medium holds but cannot serve now: busy unless a later medium serves it.
        let mut busy = vec![false; keys.len()];
        let mut descs: BTreeMap<(u32, u32), BufferDesc> = BTreeMap::new();
        let mut remaining: Vec<usize> = (0..keys.len()).filter(|i| !keys[*i].is_empty()).collect();
        for medium in &self.media {
            if remaining.is_empty() {
                break;
            }
            let ask: Vec<String> = remaining.iter().map(|i| keys[*i].clone()).collect();
            let entries = if ranges.is_empty() {
                medium.backend.batch_resolve(&ask, !omit_descs)
            } else {
                let asked: Vec<Vec<(u64, u64)>> =
                    remaining.iter().map(|i| ranges.get(*i).cloned().unwrap_or_default()).collect();
                medium.backend.batch_resolve_ranges(&ask, &asked, !omit_descs)
            };
            if entries.len() != ask.len() {
                tracing::warn!(backend = medium.backend.name(), "batch_resolve broke its contract");
            }
            let mut entries = entries.into_iter();
            let mut unanswered = Vec::new();
            for i in remaining {
                match entries.next() {
                    Some(entry) if usable_hit(medium, &keys[i], &entry, self.page_size) => {
                        for d in &entry.descs {
                            descs
                                .entry((medium.id, d.buffer_index))
                                .or_insert_with(|| d.clone().with_backend_id(medium.id));
                        }
                        answers[i] = Some(ResolvedKey {
                            tier: medium.tier,
                            backend_id: medium.id,
                            size: entry.size,
                            pages: entry.pages,
                            lease: entry.lease,
                            crc32c: entry.crc32c,
                            partial: entry.partial,
                            first_page: entry.first_page,
                        });
                    }
                    Some(entry) if entry.busy => {
                        busy[i] = true;
                        unanswered.push(i);
                    }
                    _ => unanswered.push(i),
                }
            }
            remaining = unanswered;
        }
        let descs: Vec<BufferDesc> = if omit_descs { Vec::new() } else { descs.into_values().collect() };
        encode_batch_resolve(&answers, &busy, &descs, self.page_size)
    }

    /// Hands each release to the medium that answered its hit (by backend id); unknown ids and
    /// empty keys are ignored.
    fn release(&self, reads: Vec<pb::ReadRelease>) {
        for medium in &self.media {
            let mine: Vec<ReadRelease> = reads
                .iter()
                .filter(|r| r.backend_id == medium.id && !r.key.is_empty() && r.lease_id != 0)
                .map(|r| ReadRelease::new(r.key.clone(), r.lease_id))
                .collect();
            if !mine.is_empty() {
                medium.backend.release_reads(&mine);
            }
        }
    }

    fn evict(&self, keys: Vec<String>) -> pb::EvictKeyResponse {
        let mut freed = vec![0u64; keys.len()];
        let (at, ask): (Vec<usize>, Vec<String>) =
            keys.iter().enumerate().filter(|(_, k)| !k.is_empty()).map(|(i, k)| (i, k.clone())).unzip();
        if !ask.is_empty() {
            for medium in &self.media {
                let results = medium.backend.evict(&ask);
                if results.len() != ask.len() {
                    tracing::warn!(backend = medium.backend.name(), "evict broke its contract");
                }
                for (i, r) in at.iter().zip(results) {
                    freed[*i] = freed[*i].saturating_add(r.bytes_freed);
                }
            }
        }
        pb::EvictKeyResponse {
            evicted: keys
                .into_iter()
                .zip(freed)
                .map(|(key, bytes_freed)| pb::EvictedKey { key, bytes_freed })
                .collect(),
        }
    }
}

#[tonic::async_trait]
impl UmbpPeer for PeerService {
    async fn get_peer_info(
        &self,
        _request: Request<pb::GetPeerInfoRequest>,
    ) -> Result<Response<pb::GetPeerInfoResponse>, Status> {
        self.blocking(Dispatch::peer_info).await.map(Response::new)
    }

    async fn allocate_slot(
        &self,
        request: Request<pb::AllocateSlotRequest>,
    ) -> Result<Response<pb::AllocateSlotResponse>, Status> {
        let entry = request.into_inner();
        // The single-entry call carries no accepts_busy: busy is answered as no space.
        let answer = self.blocking(move |d| d.allocate(vec![entry], false)).await?;
        Ok(Response::new(answer.into_iter().next().unwrap_or_else(failed_allocation)))
    }

    async fn batch_allocate_slots(
        &self,
        request: Request<pb::BatchAllocateSlotsRequest>,
    ) -> Result<Response<pb::BatchAllocateSlotsResponse>, Status> {
        let pb::BatchAllocateSlotsRequest { entries, accepts_busy } = request.into_inner();
        let entries =
            self.blocking(move |d| d.allocate(entries, accepts_busy)).instrument(phase!(phases::PEER_ALLOCATE)).await?;
        Ok(Response::new(pb::BatchAllocateSlotsResponse { entries }))
    }

    async fn commit_slot(
        &self,
        request: Request<pb::CommitSlotRequest>,
    ) -> Result<Response<pb::CommitSlotResponse>, Status> {
        let entry = request.into_inner();
        let answer = self.blocking(move |d| d.commit(vec![entry])).await?;
        if answer.iter().any(|a| a.success) {
            self.changed();
        }
        Ok(Response::new(answer.into_iter().next().unwrap_or_default()))
    }

    async fn batch_commit_slots(
        &self,
        request: Request<pb::BatchCommitSlotsRequest>,
    ) -> Result<Response<pb::BatchCommitSlotsResponse>, Status> {
        let entries = request.into_inner().entries;
        let entries = self.blocking(move |d| d.commit(entries)).instrument(phase!(phases::PEER_COMMIT)).await?;
        if entries.iter().any(|a| a.success) {
            self.changed();
        }
        Ok(Response::new(pb::BatchCommitSlotsResponse { entries }))
    }

    async fn abort_slot(
        &self,
        request: Request<pb::AbortSlotRequest>,
    ) -> Result<Response<pb::AbortSlotResponse>, Status> {
        let slot_id = request.into_inner().slot_id;
        let answer = self.blocking(move |d| d.abort(&[slot_id])).await?;
        Ok(Response::new(pb::AbortSlotResponse { success: answer.first().copied().unwrap_or(true) }))
    }

    async fn batch_abort_slots(
        &self,
        request: Request<pb::BatchAbortSlotsRequest>,
    ) -> Result<Response<pb::BatchAbortSlotsResponse>, Status> {
        let slot_ids = request.into_inner().slot_ids;
        let success = self.blocking(move |d| d.abort(&slot_ids)).await?;
        Ok(Response::new(pb::BatchAbortSlotsResponse { success }))
    }

    async fn resolve_key(
        &self,
        request: Request<pb::ResolveKeyRequest>,
    ) -> Result<Response<pb::ResolveKeyResponse>, Status> {
        let key = request.into_inner().key;
        self.blocking(move |d| d.resolve_one(key)).await.map(Response::new)
    }

    async fn batch_resolve_keys(
        &self,
        request: Request<pb::BatchResolveKeysRequest>,
    ) -> Result<Response<pb::BatchResolveKeysResponse>, Status> {
        let request = request.into_inner();
        let ranges = decode_request_ranges(&request);
        let pb::BatchResolveKeysRequest { keys, omit_descs, .. } = request;
        self.blocking(move |d| d.batch_resolve(keys, omit_descs, ranges))
            .instrument(phase!(phases::PEER_RESOLVE))
            .await
            .map(Response::new)
    }

    async fn release_reads(
        &self,
        request: Request<pb::ReleaseReadsRequest>,
    ) -> Result<Response<pb::ReleaseReadsResponse>, Status> {
        let reads = request.into_inner().reads;
        if !reads.is_empty() {
            self.blocking(move |d| d.release(reads)).await?;
        }
        Ok(Response::new(pb::ReleaseReadsResponse {}))
    }

    async fn evict_key(&self, request: Request<pb::EvictKeyRequest>) -> Result<Response<pb::EvictKeyResponse>, Status> {
        let keys = request.into_inner().keys;
        if keys.is_empty() {
            return Ok(Response::new(pb::EvictKeyResponse::default()));
        }
        let reply = self.blocking(move |d| d.evict(keys)).await?;
        if reply.evicted.iter().any(|e| e.bytes_freed > 0) {
            self.changed();
        }
        Ok(Response::new(reply))
    }
}
