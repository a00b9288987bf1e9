//! [`PeerClient`]: the typed client of another node's `UMBPPeer` service, the mirror of
//! [`MasterClient`](crate::master_client::MasterClient) for the peer protocol.
//!
//! It speaks `umbp-core` types (wire conversion through `umbp_proto::convert` and
//! `umbp_proto::resolve`), puts the RPC deadline and the cluster token on every call
//! ([`TokenInjector`]), and reports a peer that did not answer to its [`Peers`], which leaves the node
//! out of routes for a while and drops the connection. Callers never build a `pb::…Request`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use umbp_core::{AllocateRequest, AllocateResult, BufferDesc, CommitRequest, ErrorKind, PageLocation, TierType};
use umbp_proto::WireError;
use umbp_proto::convert::{outcome_from_wire, tier_to_wire};
use umbp_proto::resolve::{DecodedResolve, decode_batch_resolve, encode_request_ranges};
use umbp_proto::token::{InvalidToken, TokenInjector};
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;

type Grpc = UmbpPeerClient<InterceptedService<Channel, TokenInjector>>;

/// The largest reply a peer may send (a resolve of a large batch with descriptors).
const MAX_DECODING_BYTES: usize = 64 << 20;

/// Why a call to a peer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerClientError {
    /// The peer address is not a usable URI.
    #[error("bad peer address {address}: {source}")]
    BadAddress {
        /// The address.
        address: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The cluster token cannot travel as metadata.
    #[error(transparent)]
    InvalidToken(#[from] InvalidToken),
    /// The connection could not be opened.
    #[error("connecting to {address}: {source}")]
    Connect {
        /// The address.
        address: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The peer (or the transport) answered with an error status, or not before the deadline.
    #[error("{rpc}: {}", status.message())]
    Rpc {
        /// The RPC.
        rpc: &'static str,
        /// The status.
        #[source]
        status: Box<tonic::Status>,
    },
    /// The reply could not be read (a field this build does not know, arrays that disagree).
    #[error("malformed {rpc} reply: {source}")]
    Malformed {
        /// The RPC.
        rpc: &'static str,
        /// What is wrong with it.
        #[source]
        source: WireError,
    },
    /// The reply answered another number of entries than were asked.
    #[error("answered {got} of {asked} {what}")]
    Mismatch {
        /// What was asked (`allocations`, `keys`).
        what: &'static str,
        /// Entries in the reply.
        got: usize,
        /// Entries asked.
        asked: usize,
    },
}

impl PeerClientError {
    /// What the caller does next: a peer that cannot be reached is routed around
    /// ([`ErrorKind::Unavailable`]); an unusable address or token is fixed, not retried; a reply
    /// this build cannot read is reported ([`ErrorKind::Internal`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::BadAddress { .. } | Self::InvalidToken(_) => ErrorKind::InvalidInput,
            Self::Connect { .. } => ErrorKind::Unavailable,
            Self::Rpc { status, .. } => match status.code() {
                tonic::Code::InvalidArgument | tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                    ErrorKind::InvalidInput
                }
                tonic::Code::DeadlineExceeded | tonic::Code::ResourceExhausted => ErrorKind::Retry,
                _ => ErrorKind::Unavailable,
            },
            Self::Malformed { .. } | Self::Mismatch { .. } => ErrorKind::Internal,
        }
    }
}

/// What a peer says about itself at first contact (`GetPeerInfo`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerInfo {
    /// `host:port` of its TCP data server.
    pub data_endpoint: String,
    /// Every buffer of every medium it lends, stamped with their backend ids (a descriptor of a
    /// memory kind this build does not know is left out: nothing can be copied to it safely).
    pub descs: Vec<BufferDesc>,
}

/// One allocation as a peer answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteAllocation {
    /// The medium that answered (the `backend_id` of its descriptors).
    pub backend_id: u32,
    /// The outcome, the slot, its pages and the descriptors of their buffers.
    pub result: AllocateResult,
}

/// One read lease to end on a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRelease {
    /// The key that was read.
    pub key: String,
    /// The lease its hit carried.
    pub lease: u64,
    /// The medium that served it.
    pub backend_id: u32,
}

/// How a client talks to peers.
#[derive(Debug, Clone)]
pub struct PeerClientConfig {
    /// The deadline of every call (and of opening a connection).
    pub timeout: Duration,
    /// The cluster token, when the cluster has one.
    pub token: Option<String>,
    /// How long a node that did not answer is left out of routes.
    pub unreachable_for: Duration,
}

/// The connections of one client to the peers it talks to, and the nodes that did not answer
/// lately. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Peers {
    config: PeerClientConfig,
    token: TokenInjector,
    conns: Mutex<HashMap<String, PeerClient>>,
    unreachable: Mutex<HashMap<String, Instant>>,
}

impl Peers {
    /// Connections made with `config`.
    ///
    /// # Errors
    /// [`PeerClientError::InvalidToken`] when the token cannot travel as metadata.
    pub fn new(config: PeerClientConfig) -> Result<Arc<Self>, PeerClientError> {
        let token = TokenInjector::new(config.token.as_deref())?;
        Ok(Arc::new(Self { config, token, conns: Mutex::default(), unreachable: Mutex::default() }))
    }

    /// The open connection to `node` at `address`, if there is one.
    pub fn cached(&self, node: &str, address: &str) -> Option<PeerClient> {
        self.conns.lock().get(node).filter(|c| &*c.address == address).cloned()
    }

    /// The open connection to `node`, at whatever address.
    pub fn open(&self, node: &str) -> Option<PeerClient> {
        self.conns.lock().get(node).cloned()
    }

    /// Opens a connection to `node` at `address` and asks for its [`PeerInfo`] (authoritative for
    /// its buffers). [`keep`](Self::keep) it for later calls once its buffers are known. A node that
    /// cannot be reached is marked unreachable.
    ///
    /// # Errors
    /// [`PeerClientError::BadAddress`], [`PeerClientError::Connect`] or the `GetPeerInfo` call's
    /// error.
    pub async fn connect(
        self: &Arc<Self>,
        node: &str,
        address: &str,
    ) -> Result<(PeerClient, PeerInfo), PeerClientError> {
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|source| PeerClientError::BadAddress { address: address.to_owned(), source })?
            .connect_timeout(self.config.timeout)
            .timeout(self.config.timeout)
            .tcp_nodelay(true);
        let channel = match endpoint.connect().await {
            Ok(c) => c,
            Err(source) => {
                self.mark_unreachable(node);
                return Err(PeerClientError::Connect { address: address.to_owned(), source });
            }
        };
        let grpc =
            UmbpPeerClient::with_interceptor(channel, self.token.clone()).max_decoding_message_size(MAX_DECODING_BYTES);
        let mut client = PeerClient {
            node: node.into(),
            address: address.into(),
            data_endpoint: Arc::from(""),
            grpc,
            timeout: self.config.timeout,
            peers: Arc::downgrade(self),
        };
        let info = client.info().await?;
        client.data_endpoint = info.data_endpoint.as_str().into();
        Ok((client, info))
    }

    /// Keeps `client` as the open connection to its node (replacing any other).
    pub fn keep(&self, client: &PeerClient) {
        self.conns.lock().insert(client.node.to_string(), client.clone());
    }

    /// `node` did not answer: drop its connection and leave it out of routes for a while.
    pub fn mark_unreachable(&self, node: &str) {
        self.unreachable.lock().insert(node.to_owned(), Instant::now());
        self.conns.lock().remove(node);
    }

    /// Nodes that did not answer within the last `unreachable_for`.
    pub fn recently_unreachable(&self) -> Vec<String> {
        let mut map = self.unreachable.lock();
        map.retain(|_, at| at.elapsed() < self.config.unreachable_for);
        map.keys().cloned().collect()
    }

    /// Drops the connection to `node` (the next contact opens a new one and asks `GetPeerInfo`).
    pub fn forget(&self, node: &str) {
        self.conns.lock().remove(node);
    }

    /// Drops every connection.
    pub fn clear(&self) {
        self.conns.lock().clear();
    }
}

/// A connection to one node's `UMBPPeer` service. Cheap to clone. Every call carries the deadline
/// and the cluster token; a call that fails on the transport or with an error status marks the node
/// unreachable in the [`Peers`] that opened it.
#[derive(Debug, Clone)]
pub struct PeerClient {
    node: Arc<str>,
    address: Arc<str>,
    data_endpoint: Arc<str>,
    grpc: Grpc,
    timeout: Duration,
    peers: std::sync::Weak<Peers>,
}

impl PeerClient {
    /// The node this connection reaches.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The address it was opened to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The node's data endpoint, as its `GetPeerInfo` stated it.
    pub fn data_endpoint(&self) -> &str {
        &self.data_endpoint
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(message);
        r.set_timeout(self.timeout);
        r
    }

    /// The node did not answer `rpc`: mark it and say why.
    fn failed(&self, rpc: &'static str, status: tonic::Status) -> PeerClientError {
        if let Some(peers) = self.peers.upgrade() {
            peers.mark_unreachable(&self.node);
        }
        PeerClientError::Rpc { rpc, status: Box::new(status) }
    }

    /// `GetPeerInfo`.
    ///
    /// # Errors
    /// [`PeerClientError::Rpc`].
    pub async fn info(&self) -> Result<PeerInfo, PeerClientError> {
        let reply = self
            .grpc
            .clone()
            .get_peer_info(self.request(pb::GetPeerInfoRequest {}))
            .await
            .map_err(|e| self.failed("GetPeerInfo", e))?
            .into_inner();
        let descs = reply.buffer_descs.iter().filter_map(|d| BufferDesc::try_from(d).ok()).collect();
        Ok(PeerInfo { data_endpoint: reply.data_endpoint, descs })
    }

    /// Allocates a slot for each request on the node's medium of `tier`, accepting busy answers; one
    /// answer per request, in order. A reply with another number of entries is refused and the
    /// slots it allocated are aborted at once (they cannot be matched to keys).
    ///
    /// # Errors
    /// [`PeerClientError::Rpc`] or [`PeerClientError::Mismatch`].
    pub async fn allocate(
        &self,
        tier: TierType,
        requests: &[AllocateRequest],
    ) -> Result<Vec<RemoteAllocation>, PeerClientError> {
        let entries = requests
            .iter()
            .map(|r| pb::AllocateSlotRequest { size: r.size, tier: tier_to_wire(tier), key: r.key.clone() })
            .collect();
        let reply = self
            .grpc
            .clone()
            .batch_allocate_slots(self.request(pb::BatchAllocateSlotsRequest { entries, accepts_busy: true }))
            .await
            .map_err(|e| self.failed("allocate", e))?
            .into_inner();
        let answers: Vec<RemoteAllocation> = reply.entries.into_iter().map(allocation_from_wire).collect();
        if answers.len() != requests.len() {
            let ids: Vec<u64> = answers
                .iter()
                .filter(|a| a.result.outcome == umbp_core::AllocateOutcome::Allocated)
                .map(|a| a.result.slot_id)
                .collect();
            let _ = self.abort(&ids).await;
            return Err(PeerClientError::Mismatch { what: "allocations", got: answers.len(), asked: requests.len() });
        }
        Ok(answers)
    }

    /// Commits slots; whether each was committed, one per request (a missing answer is `false`).
    ///
    /// # Errors
    /// [`PeerClientError::Rpc`].
    pub async fn commit(&self, commits: &[CommitRequest]) -> Result<Vec<bool>, PeerClientError> {
        let entries = commits
            .iter()
            .map(|c| pb::CommitSlotRequest { slot_id: c.slot_id, key: c.key.clone(), crc32c: c.crc32c })
            .collect();
        let reply = self
            .grpc
            .clone()
            .batch_commit_slots(self.request(pb::BatchCommitSlotsRequest { entries }))
            .await
            .map_err(|e| self.failed("commit", e))?
            .into_inner()
            .entries;
        Ok((0..commits.len()).map(|n| reply.get(n).is_some_and(|r| r.success)).collect())
    }

    /// Aborts slots (idempotent on the peer; a missed abort is reaped by the slot TTL). Does not mark
    /// the node: an abort is best effort.
    ///
    /// # Errors
    /// [`PeerClientError::Rpc`].
    pub async fn abort(&self, slot_ids: &[u64]) -> Result<(), PeerClientError> {
        if slot_ids.is_empty() {
            return Ok(());
        }
        self.grpc
            .clone()
            .batch_abort_slots(self.request(pb::BatchAbortSlotsRequest { slot_ids: slot_ids.to_vec() }))
            .await
            .map(drop)
            .map_err(|status| PeerClientError::Rpc { rpc: "abort", status: Box::new(status) })
    }

    /// Resolves `keys` (without descriptors when `omit_descs`: the caller already holds them); one
    /// answer per key.
    ///
    /// # Errors
    /// [`PeerClientError::Rpc`], [`PeerClientError::Malformed`] or [`PeerClientError::Mismatch`].
    pub async fn resolve(&self, keys: Vec<String>, omit_descs: bool) -> Result<DecodedResolve, PeerClientError> {
        self.resolve_ranges(keys, &[], omit_descs).await
    }

    /// [`resolve`](Self::resolve) for a reader that copies only `ranges[i]` (`(offset, length)`
    /// pairs; empty or missing: the whole value) of key `i`: the node may answer partial hits
    /// (`ResolvedKey::partial`), which hold only those bytes. A node that predates ranges answers
    /// whole values, which serve as well.
    ///
    /// # Errors
    /// As [`resolve`](Self::resolve).
    pub async fn resolve_ranges(
        &self,
        keys: Vec<String>,
        ranges: &[Vec<(u64, u64)>],
        omit_descs: bool,
    ) -> Result<DecodedResolve, PeerClientError> {
        let asked = keys.len();
        let mut request = pb::BatchResolveKeysRequest { keys, omit_descs, ..Default::default() };
        encode_request_ranges(&mut request, ranges);
        let reply = self
            .grpc
            .clone()
            .batch_resolve_keys(self.request(request))
            .await
            .map_err(|e| self.failed("resolve", e))?
            .into_inner();
        let decoded =
            decode_batch_resolve(&reply).map_err(|source| PeerClientError::Malformed { rpc: "resolve", source })?;
        if decoded.keys.len() != asked {
            return Err(PeerClientError::Mismatch { what: "keys", got: decoded.keys.len(), asked });
        }
        // A part of a value the reader asked for whole would leave it with bytes it never read.
        let whole = |i: usize| ranges.get(i).is_none_or(Vec::is_empty);
        if let Some(i) = (0..asked).find(|i| whole(*i) && decoded.keys[*i].as_ref().is_some_and(|k| k.partial)) {
            let source = WireError::BadPartial { key_index: i, reason: "a key asked for whole" };
            return Err(PeerClientError::Malformed { rpc: "resolve", source });
        }
        Ok(decoded)
    }

    /// Ends read leases (best effort: a lost release only waits for the lease's expiry). Does not
    /// mark the node.
    ///
    /// # Errors
    /// [`PeerClientError::Rpc`].
    pub async fn release(&self, reads: Vec<LeaseRelease>) -> Result<(), PeerClientError> {
        let reads = reads
            .into_iter()
            .map(|r| pb::ReadRelease { key: r.key, lease_id: r.lease, backend_id: r.backend_id })
            .collect();
        self.grpc
            .clone()
            .release_reads(self.request(pb::ReleaseReadsRequest { reads }))
            .await
            .map(drop)
            .map_err(|status| PeerClientError::Rpc { rpc: "release", status: Box::new(status) })
    }

    /// Frees `keys` on every medium of the node; the bytes freed per key, in order (a missing answer
    /// is 0). Does not mark the node (a remove asks every node, reachable or not).
    ///
    /// # Errors
    /// [`PeerClientError::Rpc`].
    pub async fn evict(&self, keys: Vec<String>) -> Result<Vec<u64>, PeerClientError> {
        let n = keys.len();
        let reply = self
            .grpc
            .clone()
            .evict_key(self.request(pb::EvictKeyRequest { keys }))
            .await
            .map_err(|status| PeerClientError::Rpc { rpc: "evict", status: Box::new(status) })?
            .into_inner();
        let mut freed: Vec<u64> = reply.evicted.into_iter().map(|e| e.bytes_freed).collect();
        freed.resize(n, 0);
        Ok(freed)
    }
}

/// One allocate answer as core values (a descriptor of an unknown memory kind is left out).
fn allocation_from_wire(e: pb::AllocateSlotResponse) -> RemoteAllocation {
    RemoteAllocation {
        backend_id: e.backend_id,
        result: AllocateResult {
            outcome: outcome_from_wire(e.outcome),
            slot_id: e.slot_id,
            pages: e.pages.iter().map(PageLocation::from).collect(),
            size: 0,
            page_size: e.page_size,
            descs: e.descs.iter().filter_map(|d| BufferDesc::try_from(d).ok()).collect(),
            pending_ttl_ms: e.pending_ttl_ms,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_says_what_to_do_next() {
        let status = |code| PeerClientError::Rpc { rpc: "allocate", status: Box::new(tonic::Status::new(code, "x")) };
        assert_eq!(status(tonic::Code::Unavailable).kind(), ErrorKind::Unavailable);
        assert_eq!(status(tonic::Code::Internal).kind(), ErrorKind::Unavailable);
        assert_eq!(status(tonic::Code::DeadlineExceeded).kind(), ErrorKind::Retry);
        assert_eq!(status(tonic::Code::Unauthenticated).kind(), ErrorKind::InvalidInput);
        assert_eq!(PeerClientError::InvalidToken(InvalidToken).kind(), ErrorKind::InvalidInput);
        let malformed = PeerClientError::Malformed { rpc: "resolve", source: WireError::EmptyKey };
        assert_eq!(malformed.kind(), ErrorKind::Internal);
        assert!(std::error::Error::source(&malformed).is_some(), "the wire error stays the source");
        assert_eq!(PeerClientError::Mismatch { what: "keys", got: 1, asked: 2 }.kind(), ErrorKind::Internal);
        let bad = Endpoint::from_shared("http://bad address".to_owned()).expect_err("not a URI");
        assert_eq!(
            PeerClientError::BadAddress { address: "bad address".into(), source: bad }.kind(),
            ErrorKind::InvalidInput
        );
    }

    #[tokio::test]
    async fn a_node_that_refuses_connections_is_marked_and_forgotten_after_the_window() {
        let config = PeerClientConfig {
            timeout: Duration::from_millis(500),
            token: None,
            unreachable_for: Duration::from_millis(50),
        };
        let peers = Peers::new(config).expect("no token");
        // Port 1 on loopback: nothing listens there.
        let err = peers.connect("n1", "127.0.0.1:1").await.expect_err("nothing listens");
        assert_eq!(err.kind(), ErrorKind::Unavailable);
        assert_eq!(peers.recently_unreachable(), ["n1"]);
        assert!(peers.open("n1").is_none());
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert!(peers.recently_unreachable().is_empty(), "left out for the window only");
    }

    #[test]
    fn a_token_that_cannot_be_metadata_is_refused() {
        let config = PeerClientConfig {
            timeout: Duration::from_secs(1),
            token: Some("a\nb".into()),
            unreachable_for: Duration::ZERO,
        };
        assert_eq!(Peers::new(config).map(drop).map_err(|e| e.kind()), Err(ErrorKind::InvalidInput));
    }
}
