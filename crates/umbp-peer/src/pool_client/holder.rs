//! [`Holder`]: the node a put allocates on or a get reads from — this node's medium or another
//! node's peer service — behind one set of async calls that speak core types, so the put and get
//! paths are written once. Only [`PoolClient::holder`] tells the two apart.

use std::collections::HashMap;

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, PageLocation, ReadRelease};

use tracing::Instrument;

use super::phases::{self, phase};
use super::support::{blocking, medium_call};
use super::*;
use crate::peer_client::{LeaseRelease, PeerClient, PeerClientError};

/// This node's medium, as a holder.
#[derive(Clone)]
pub(super) struct Here {
    pub(super) node: Arc<str>,
    pub(super) medium: Arc<dyn MediumBackend>,
    /// Whether its calls do drive IO (see `medium_call`).
    pub(super) drive_io: bool,
    /// Told at once of local commits (other nodes see the keys when the master hears).
    pub(super) master: Arc<MasterClient>,
}

/// Where a key's slot or value is: this node's medium or another node.
#[derive(Clone)]
pub(super) enum Holder {
    /// This node's medium.
    Here(Here),
    /// Another node, over its peer service.
    Peer(Box<PeerClient>),
}

/// One allocation on a holder, with the buffer table its pages index (shared by every key of the
/// answer that the same medium served).
pub(super) struct Allocation {
    pub(super) outcome: AllocateOutcome,
    pub(super) slot_id: u64,
    pub(super) pages: Vec<PageLocation>,
    pub(super) refs: Arc<[Option<TransferRef>]>,
    pub(super) page_size: u64,
    /// The slot's pending TTL as the holder stated it (0: not stated).
    pub(super) pending_ttl_ms: u64,
}

/// Where a found key's pages are on its holder.
pub(super) struct Hit {
    pub(super) size: u64,
    pub(super) pages: Vec<PageLocation>,
    /// The buffer table of the medium that serves the key.
    pub(super) refs: Arc<[Option<TransferRef>]>,
    pub(super) page_size: u64,
    /// The read lease to release once the copy is done (0: none).
    pub(super) lease: u64,
    /// The medium that serves the key (0 on this node: its one medium).
    pub(super) backend_id: u32,
    /// The checksum its writer put with the value, to check the copy against.
    pub(super) crc32c: Option<u32>,
    /// `Some(first)`: a partial hit of a ranged read, its pages holding value pages `first ..`
    /// with only the asked ranges' bytes (see [`PageLayout`](super::support::PageLayout)).
    pub(super) partial_from: Option<u64>,
}

/// A holder's answer for one key.
pub(super) enum Answer {
    Hit(Hit),
    Miss,
    /// Held there, but not servable now: ask the same holder again shortly.
    Busy,
}

/// A peer's failure as a key's error: the message says what failed, the source is the peer
/// client's error (with its own sources).
pub(super) fn unreachable(node: &str, e: PeerClientError) -> KeyError {
    KeyError::Unreachable { node: node.to_owned(), message: e.to_string(), source: Some(SharedError::new(e)) }
}

impl Holder {
    /// The holder's node id.
    pub(super) fn node(&self) -> &str {
        match self {
            Self::Here(h) => &h.node,
            Self::Peer(p) => p.node(),
        }
    }

    /// Reserves a slot for each request on the holder's medium of `tier`; one answer per request.
    /// A remote holder's descriptors replace the cached ones in `directory` (a restarted peer
    /// publishes new handles for the same buffers).
    pub(super) async fn allocate(
        &self,
        directory: &PeerDirectory,
        tier: TierType,
        requests: Vec<AllocateRequest>,
    ) -> Result<Vec<Allocation>, KeyError> {
        match self {
            Self::Here(h) => {
                let m = &h.medium;
                // In place for every medium: allocation is bookkeeping (no drive IO), and slots handed
                // out by a call this future could be dropped in the middle of would not be guarded.
                let results = blocking(|| m.batch_allocate(&requests));
                let refs: Arc<[Option<TransferRef>]> = (0..m.buffer_count()).map(|b| m.buffer_ref(b)).collect();
                Ok(results
                    .into_iter()
                    .map(|a| Allocation {
                        outcome: a.outcome,
                        slot_id: a.slot_id,
                        pages: a.pages,
                        refs: Arc::clone(&refs),
                        page_size: a.page_size,
                        pending_ttl_ms: a.pending_ttl_ms,
                    })
                    .collect())
            }
            Self::Peer(p) => {
                let node = p.node();
                let answers = p
                    .allocate(tier, &requests)
                    .instrument(phase!(phases::PUT_ALLOCATE_RPC))
                    .await
                    .map_err(|e| unreachable(node, e))?;
                let descs: Vec<_> = answers.iter().flat_map(|a| a.result.descs.iter().cloned()).collect();
                directory.replace_remote_buffers(node, &descs);
                let mut shelves: HashMap<u32, Arc<[Option<TransferRef>]>> = HashMap::new();
                Ok(answers
                    .into_iter()
                    .map(|a| {
                        let refs = Arc::clone(
                            shelves
                                .entry(a.backend_id)
                                .or_insert_with(|| directory.remote_buffer_snapshot(node, a.backend_id).into()),
                        );
                        let r = a.result;
                        Allocation {
                            outcome: r.outcome,
                            slot_id: r.slot_id,
                            pages: r.pages,
                            refs,
                            page_size: r.page_size,
                            pending_ttl_ms: r.pending_ttl_ms,
                        }
                    })
                    .collect())
            }
        }
    }

    /// Commits slots; whether each was committed, one per request. A holder that cannot be
    /// reached is an error for every slot.
    pub(super) async fn commit(&self, commits: Vec<CommitRequest>) -> Result<Vec<bool>, KeyError> {
        let n = commits.len();
        match self {
            Self::Here(h) => {
                let Some(results) = medium_call(&h.medium, h.drive_io, move |m| m.batch_commit(&commits)).await else {
                    return Ok(vec![false; n]);
                };
                if results.iter().any(|r| r.success) {
                    // Local writes become visible to other nodes as soon as the master hears.
                    h.master.flush();
                }
                let mut out: Vec<bool> = results.iter().map(|r| r.success).collect();
                out.resize(n, false);
                Ok(out)
            }
            Self::Peer(p) => p
                .commit(&commits)
                .instrument(phase!(phases::PUT_COMMIT_RPC))
                .await
                .map_err(|e| unreachable(p.node(), e)),
        }
    }

    /// Aborts slots (best effort: a missed abort is reaped by the slot TTL).
    pub(super) async fn abort(&self, slot_ids: Vec<u64>) {
        if slot_ids.is_empty() {
            return;
        }
        match self {
            Self::Here(h) => drop(blocking(|| h.medium.batch_abort(&slot_ids))),
            Self::Peer(p) => {
                if let Err(e) = p.abort(&slot_ids).await {
                    tracing::debug!(node = p.node(), error = %e, "abort did not land; the slot TTL reaps it");
                }
            }
        }
    }

    /// [`abort`](Self::abort) from a destructor: this node's medium at once, a remote holder in the
    /// background (dropped without a runtime: the slot TTL reaps the slots).
    pub(super) fn abort_detached(&self, slot_ids: Vec<u64>) {
        if slot_ids.is_empty() {
            return;
        }
        match self {
            Self::Here(h) => drop(h.medium.batch_abort(&slot_ids)),
            Self::Peer(p) => {
                let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
                let p = PeerClient::clone(p);
                handle.spawn(async move {
                    let _ = p.abort(&slot_ids).await;
                });
            }
        }
    }
}

impl Holder {
    /// Resolves `keys`, each hit under the holder's read lease; one answer per key. A remote
    /// holder's descriptors replace the cached ones in `directory`, and are not asked for when
    /// they are cached already. `ranges[i]`, when there and not empty, are the `(offset, length)`
    /// byte ranges of key `i` the reader copies: the holder may then answer a partial hit (an SSD
    /// reads only the blocks they cover). Without ranges every hit is whole.
    pub(super) async fn resolve(
        &self,
        directory: &PeerDirectory,
        keys: Vec<String>,
        ranges: Vec<Vec<(u64, u64)>>,
    ) -> Result<Vec<Answer>, PeerClientError> {
        let n = keys.len();
        let ranged = ranges.iter().any(|r| !r.is_empty());
        match self {
            Self::Here(h) => {
                // A panicked resolve reads nothing here: every key is then routed elsewhere.
                let (resolved, refs) = medium_call(&h.medium, h.drive_io, move |m| {
                    let refs: Arc<[Option<TransferRef>]> = (0..m.buffer_count()).map(|b| m.buffer_ref(b)).collect();
                    let entries = if ranged {
                        m.batch_resolve_ranges(&keys, &ranges, false)
                    } else {
                        m.batch_resolve(&keys, false)
                    };
                    (entries, Some(refs))
                })
                .instrument(phase!(phases::GET_RESOLVE_MEDIUM))
                .await
                .unwrap_or_default();
                let mut answers: Vec<Answer> = resolved
                    .into_iter()
                    .map(|r| match &refs {
                        _ if r.busy => Answer::Busy,
                        Some(refs) if r.found => Answer::Hit(Hit {
                            size: r.size,
                            pages: r.pages,
                            refs: Arc::clone(refs),
                            page_size: r.page_size,
                            lease: r.lease,
                            backend_id: 0,
                            crc32c: r.crc32c,
                            partial_from: r.partial.then_some(r.first_page),
                        }),
                        _ => Answer::Miss,
                    })
                    .collect();
                answers.resize_with(n, || Answer::Miss);
                Ok(answers)
            }
            Self::Peer(p) => {
                let node = p.node();
                let decoded = p
                    .resolve_ranges(keys, &ranges, directory.has_remote_buffers(node))
                    .instrument(phase!(phases::GET_RESOLVE_RPC))
                    .await?;
                directory.replace_remote_buffers(node, &decoded.descs);
                let mut shelves: HashMap<u32, Arc<[Option<TransferRef>]>> = HashMap::new();
                Ok(decoded
                    .keys
                    .into_iter()
                    .zip(decoded.busy)
                    .map(|(k, busy)| match k {
                        Some(k) => {
                            let refs = Arc::clone(
                                shelves
                                    .entry(k.backend_id)
                                    .or_insert_with(|| directory.remote_buffer_snapshot(node, k.backend_id).into()),
                            );
                            Answer::Hit(Hit {
                                size: k.size,
                                pages: k.pages,
                                refs,
                                page_size: decoded.page_size,
                                lease: k.lease,
                                backend_id: k.backend_id,
                                crc32c: k.crc32c,
                                partial_from: k.partial.then_some(k.first_page),
                            })
                        }
                        None if busy => Answer::Busy,
                        None => Answer::Miss,
                    })
                    .collect())
            }
        }
    }

    /// Ends read leases (best effort: a lost release only waits for the lease's expiry).
    pub(super) async fn release(&self, reads: Vec<LeaseRelease>) {
        match self {
            Self::Here(h) => {
                let reads: Vec<ReadRelease> = reads.into_iter().map(|r| ReadRelease::new(r.key, r.lease)).collect();
                // Bookkeeping under the medium's lock, no IO: cheap enough to run in place.
                blocking(|| h.medium.release_reads(&reads));
            }
            Self::Peer(p) => {
                if let Err(e) = p.release(reads).await {
                    tracing::debug!(node = p.node(), error = %e, "read release did not land; the read lease expires instead");
                }
            }
        }
    }

    /// Whether this is this node's medium.
    pub(super) fn is_here(&self) -> bool {
        matches!(self, Self::Here(_))
    }
}

impl PoolClient {
    /// The holder for `node` at `peer` (its peer address): this node's medium when `node` is this
    /// node, else a connection to the peer (opened, and its buffers learnt, on first contact).
    pub(super) async fn holder(&self, node: &str, peer: &str) -> Result<Holder, KeyError> {
        if node == self.config.node_id {
            let Some(medium) = &self.medium else {
                return Err(KeyError::Refused { node: node.to_owned(), message: "this node lends no medium".into() });
            };
            return Ok(Holder::Here(Here {
                node: node.into(),
                medium: Arc::clone(medium),
                drive_io: self.medium_drive_io,
                master: Arc::clone(&self.master),
            }));
        }
        self.peer(node, peer).await.map(|p| Holder::Peer(Box::new(p)))
    }
}
