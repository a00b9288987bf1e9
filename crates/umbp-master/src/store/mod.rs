//! The master's metadata store: node membership and the `key → [location]` index.
//!
//! [`MetadataStore`] is the contract the gRPC service, the reaper, routing and eviction run against;
//! [`InMemoryStore`] is its sharded in-process implementation and [`RedisStore`] the same contract in a
//! Redis that several masters can share (one Lua script per atomic write; key layout in its docs);
//! [`ShardedStore`] spreads the index over several stores (several Redis processes) by key hash.
//! The trait is synchronous, object-safe and takes every timestamp from the caller (`now_ms`,
//! wall-clock milliseconds), so both stores give the same answers to the same calls: the contract
//! suite (`tests/store_*.rs`) runs every test against each.
//!
//! # The contract
//! - **Membership** ([`register`](MetadataStore::register), [`unregister`](MetadataStore::unregister),
//!   [`expire_stale`](MetadataStore::expire_stale), [`remove_expired`](MetadataStore::remove_expired)).
//!   A node is absent, [`NodeStatus::Alive`] or [`NodeStatus::Expired`]. Registering inserts an ALIVE
//!   record at seq 0 and replaces an EXPIRED or stale one; a fresh ALIVE record answers
//!   [`RegisterOutcome::AlreadyExists`] unless the registration is a newer *incarnation* (below).
//!   Registering **wipes every location the node held** (the reference kept them, so its first delta
//!   after a restart built on phantom entries). Expiry keeps the row and wipes the locations;
//!   [`remove_expired`](MetadataStore::remove_expired) drops expired rows after the master's
//!   retention; unregistering erases both.
//! - **Incarnations.** Every registration carries the registering process's incarnation (chosen once
//!   per process start, increasing across restarts; 0 = unspecified). A fresh ALIVE record of a lower
//!   incarnation is *replaced* at once ([`RegisterOutcome::Replaced`]: a node restarted after a crash
//!   need not wait for its old record to expire); a registration of a lower incarnation than the
//!   record's is refused ([`RegisterOutcome::Superseded`]). A heartbeat of a lower incarnation than
//!   the record's changes nothing and answers [`HeartbeatOutcome::Superseded`] (its sender must stop),
//!   one of a higher incarnation answers [`HeartbeatOutcome::Unknown`] (register first), and an
//!   unregister of another incarnation erases nothing, so a superseded process can never touch the
//!   newer one's record or locations. Incarnation 0 on either side keeps the plain compare-and-set
//!   and matches any heartbeat.
//! - **The index is built only from heartbeats** ([`apply_heartbeat`](MetadataStore::apply_heartbeat)).
//!   There is no erase-key call: locations change through heartbeats, unregister and expiry. A delta
//!   applies iff its seq is `last_applied + 1`; an older seq is re-acknowledged without being applied
//!   again ([`HeartbeatOutcome::AlreadyApplied`]), a newer one is a gap
//!   ([`HeartbeatOutcome::SeqGap`]: send a full sync).
//! - **Full syncs** arrive in chunks under a *fresh* baseline seq the node never used before (the
//!   node takes `baseline = next_seq; next_seq += 1`, also for the empty sync of a clear). Chunk 0 is
//!   accepted only when `baseline > last_applied`; a baseline at or below it is a late or duplicated
//!   copy, answered [`HeartbeatOutcome::AlreadyApplied`] with the node's seq and applied **not at all**
//!   (the sender sees an ack other than its baseline and starts a fresh sync). Chunks *add* (or
//!   refresh) the node's replicas, marked with the baseline; the final chunk sweeps every replica of
//!   the node the sync did not report and moves `last_applied` to the baseline, which is the ack. So
//!   reads during a sync still see what the node held before it, and an abandoned sync leaves the old
//!   view in place (plus what its chunks added, which the next completed sync sweeps). Every accepted
//!   heartbeat of an ALIVE node — keepalive, gap and re-ack included — refreshes its liveness and its
//!   reported capacity.
//! - **The external KV index** (`report_external_kv` and the rest; the `external` module): advisory
//!   `(hash, node, tier)` records of blocks a node holds outside the pool, apart from the key index.
//!   A report of a node that is not ALIVE records nothing; registration, unregister and expiry drop
//!   the node's records in the same step as its locations.
//! - **Reads** see only ALIVE nodes' locations. The route-get read also grants a lease and stamps the
//!   access time of every key it found, which is what eviction's LRU order and lease skip read.
//!
//! # Errors
//! Contract outcomes (unknown node, a seq gap, a duplicate registration) are values. [`StoreError`] is
//! reserved for invalid arguments and for a backend that failed; [`InMemoryStore`] only ever returns
//! the former, [`RedisStore`] also a retryable [`StoreError::Backend`] while Redis is unreachable.

mod external;
mod memory;
mod redis;
mod sharded;

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use umbp_core::{KvEvent, TierType};

pub use external::{ExternalKvMatch, ExternalReport, MAX_EXTERNAL_KV_HASH_BYTES, MAX_EXTERNAL_KV_HASHES};
pub use memory::{DEFAULT_SHARDS, InMemoryStore, KeyStats, MAX_SHARDS};
pub use redis::{DEFAULT_PREFIX, RedisStore, RedisTimeouts};
pub use sharded::{ShardedStore, shard_of};

/// Capacity of one tier of one node, as the node last reported it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TierCap {
    /// The medium.
    pub tier: TierType,
    /// Allocatable bytes in total.
    pub total_bytes: u64,
    /// Bytes free at the report.
    pub available_bytes: u64,
    /// The medium's page size; 0 if the node did not say (an older node). The medium allocates whole
    /// pages, so eviction charges a key its page-rounded size (see
    /// [`charged_bytes`](crate::routing::charged_bytes)).
    pub page_size: u64,
}

impl TierCap {
    /// The capacity of `tier`: `available_bytes` free of `total_bytes`, page size unknown.
    pub const fn new(tier: TierType, total_bytes: u64, available_bytes: u64) -> Self {
        Self { tier, total_bytes, available_bytes, page_size: 0 }
    }

    /// The same capacity on a medium of `page_size`-byte pages.
    #[must_use]
    pub const fn with_page_size(self, page_size: u64) -> Self {
        Self { page_size, ..self }
    }
}

impl From<&TierCap> for crate::routing::TierSlot {
    fn from(cap: &TierCap) -> Self {
        Self::new(cap.tier, cap.total_bytes, cap.available_bytes).with_page_size(cap.page_size)
    }
}

/// Everything a node says about itself when it registers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Registration {
    /// The node's unique id (must not be empty).
    pub node_id: String,
    /// The node's host, without a port.
    pub node_address: String,
    /// `host:port` of the node's peer service; empty for a client-only node.
    pub peer_address: String,
    /// `host:port` of the node's data-plane server.
    pub data_endpoint: String,
    /// Capacity of every medium the node lends.
    pub tier_capacities: Vec<TierCap>,
    /// Operator tags, `k=v`.
    pub tags: Vec<String>,
    /// The registering process's incarnation (see the [module docs](self)); 0 = unspecified.
    pub incarnation: u64,
}

/// How to reach one ALIVE node, as [`MetadataStore::alive_peer_view`] lists it (cheap to clone: two
/// shared strings).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PeerView {
    /// `host:port` of the node's peer service; empty for a client-only node.
    pub peer_address: Arc<str>,
    /// `host:port` of the node's data-plane server; empty if it registered none.
    pub data_endpoint: Arc<str>,
}

/// Liveness of a node that has a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeStatus {
    /// Heartbeating: its locations are routable.
    Alive,
    /// Missed heartbeats for longer than the TTL: the row is kept for operators, its locations are
    /// gone, and its heartbeats are answered [`HeartbeatOutcome::Unknown`] until it registers again.
    Expired,
}

/// A node's record as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    /// The node's id.
    pub node_id: Arc<str>,
    /// The node's host, without a port.
    pub node_address: String,
    /// `host:port` of the node's peer service.
    pub peer_address: Arc<str>,
    /// `host:port` of the node's data-plane server; empty if it registered none.
    pub data_endpoint: Arc<str>,
    /// Operator tags.
    pub tags: Vec<String>,
    /// Alive or expired.
    pub status: NodeStatus,
    /// When the last heartbeat (of any kind) or the registration arrived; never moves backwards while
    /// the registration lasts (a heartbeat stamped earlier than the last one leaves it as is).
    pub last_heartbeat_ms: u64,
    /// When the record was created by [`MetadataStore::register`].
    pub registered_at_ms: u64,
    /// The highest event seq applied for the node (0 after registration).
    pub last_applied_seq: u64,
    /// The capacity the node last reported (registration, then every accepted heartbeat).
    pub caps: Vec<TierCap>,
    /// The incarnation of the registration that stands (0 if the process sent none).
    pub incarnation: u64,
}

impl NodeRecord {
    /// Whether the node lends a medium (a peer service, or capacity it reported): a storage node,
    /// as opposed to a client that only reads and writes through others.
    pub fn lends_medium(&self) -> bool {
        !self.peer_address.is_empty() || self.caps.iter().any(|c| c.total_bytes > 0)
    }
}

/// One replica of a key: which node holds it, on which tier, and its size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Location {
    /// The holding node.
    pub node_id: Arc<str>,
    /// The medium on that node.
    pub tier: TierType,
    /// Value size in bytes, as the node's last `ADD` for it reported.
    pub size: u64,
}

/// One key an eviction round may pick: a replica that no route-get lease protects.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EvictionCandidate {
    /// The key.
    pub key: Arc<str>,
    /// The node holding the replica.
    pub node_id: Arc<str>,
    /// The medium holding the replica.
    pub tier: TierType,
    /// Value size in bytes.
    pub size: u64,
    /// When a route-get last found the key (its creation time if never).
    pub last_accessed_ms: u64,
}

/// What [`MetadataStore::register`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegisterOutcome {
    /// A new ALIVE record at seq 0 now stands (inserted, or replacing an expired or stale one); the
    /// node holds no locations until it full-syncs.
    Registered,
    /// An ALIVE record that heartbeated within `stale_after_ms` exists with the same incarnation (or
    /// either side's is 0); nothing changed.
    AlreadyExists,
    /// A fresh ALIVE record of a lower incarnation stood and was replaced (a restarted process took
    /// over its id): as [`Registered`](Self::Registered), and the previous incarnation's heartbeats
    /// are answered [`HeartbeatOutcome::Superseded`] from now on.
    Replaced {
        /// The incarnation replaced.
        previous: u64,
    },
    /// A record of a higher incarnation stands (a newer process holds the id); nothing changed.
    Superseded {
        /// The incarnation that stands.
        current: u64,
    },
}

impl RegisterOutcome {
    /// Whether a new record now stands for the registering process.
    pub const fn is_registered(self) -> bool {
        matches!(self, Self::Registered | Self::Replaced { .. })
    }
}

/// What a heartbeat carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeartbeatKind {
    /// No events: liveness and capacity only.
    Keepalive,
    /// One bundle of ownership changes under a sequence number.
    Delta {
        /// The bundle's seq; applied iff it is the node's `last_applied_seq + 1`.
        seq: u64,
        /// `ADD`s and `REMOVE`s, applied in order.
        events: Vec<KvEvent>,
    },
    /// One chunk of a full sync: the node's complete ownership as of `baseline_seq`.
    FullSyncChunk {
        /// A seq the node never used before (above `last_applied_seq`); becomes `last_applied_seq`
        /// when the final chunk lands, and the node's next delta is `baseline_seq + 1`.
        baseline_seq: u64,
        /// 0 for the first chunk, then 1, 2, … in order. The final chunk drops every location of the
        /// node that no chunk of this sync reported.
        chunk_index: u32,
        /// Whether this chunk completes the sync. A single-chunk sync is chunk 0 with `is_final`.
        is_final: bool,
        /// The node's keys; only `ADD`s count (`REMOVE`s are ignored).
        events: Vec<KvEvent>,
    },
}

/// One heartbeat (one bundle or one full-sync chunk) of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatApply {
    /// The sending node.
    pub node_id: String,
    /// When the master received it (wall-clock milliseconds).
    pub now_ms: u64,
    /// The node's capacity now; replaces the stored capacity on every outcome except `Unknown`.
    pub caps: Vec<TierCap>,
    /// Keepalive, delta or full-sync chunk.
    pub kind: HeartbeatKind,
    /// The sender's incarnation; 0 = unspecified (matches any record).
    pub incarnation: u64,
}

/// What [`MetadataStore::apply_heartbeat`] did. Every variant but `Unknown` refreshed the node's
/// liveness and capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeartbeatOutcome {
    /// Accepted: a keepalive, an applied delta, or an accepted full-sync chunk. `acked_seq` is the
    /// node's `last_applied_seq` afterwards (unchanged by a keepalive and by a non-final chunk).
    Applied {
        /// The node's last applied seq.
        acked_seq: u64,
    },
    /// A delta with `seq <= last_applied_seq` (a re-send whose first copy was already applied: the
    /// sender treats it as acknowledged), or a full-sync chunk whose baseline is not above
    /// `last_applied_seq` (a late or duplicated copy: since every sync has a fresh baseline, the sender
    /// of a live sync sees `acked_seq != baseline` and restarts with a new one). Nothing was applied.
    AlreadyApplied {
        /// The node's last applied seq.
        acked_seq: u64,
    },
    /// The master cannot apply this heartbeat in order: a delta seq beyond `last_applied_seq + 1`, a
    /// delta during an unfinished full sync, a full-sync chunk that does not follow the previous
    /// chunk of the same baseline, or a chunk of an older baseline than the sync in progress. Events
    /// were dropped and the seq is unchanged; the node must (re)start a full sync from chunk 0 with a
    /// fresh baseline.
    SeqGap {
        /// The node's last applied seq.
        acked_seq: u64,
    },
    /// No record, or an expired one (or a record of a lower incarnation than the sender's): the node
    /// must register again, then full-sync.
    Unknown,
    /// The record belongs to a higher incarnation than the sender's: a newer process took over the
    /// id. Nothing changed; the sender must stop (registering again would be refused).
    Superseded {
        /// The incarnation that stands.
        current: u64,
    },
}

impl HeartbeatOutcome {
    /// The acknowledged seq, if the node is known.
    pub const fn acked_seq(self) -> Option<u64> {
        match self {
            Self::Applied { acked_seq } | Self::AlreadyApplied { acked_seq } | Self::SeqGap { acked_seq } => {
                Some(acked_seq)
            }
            Self::Unknown | Self::Superseded { .. } => None,
        }
    }

    /// Whether the node must send a full sync (the gRPC reply's `request_full_sync`).
    pub const fn requests_full_sync(self) -> bool {
        matches!(self, Self::SeqGap { .. })
    }
}

/// Errors from a metadata store. Contract outcomes are values, not errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A shard count outside `1..=MAX_SHARDS`.
    #[error("index shard count {shards} is outside 1..={max}")]
    InvalidShardCount {
        /// The rejected count.
        shards: usize,
        /// The largest count accepted.
        max: usize,
    },
    /// An argument no store could accept (an empty node id).
    #[error("invalid argument: {reason}")]
    InvalidArgument {
        /// What was wrong.
        reason: &'static str,
    },
    /// The backing service failed or could not be reached (for remote stores).
    #[error("metadata backend failed: {message}")]
    Backend {
        /// What failed.
        message: String,
        /// Whether the same call may succeed if repeated.
        retryable: bool,
        /// The underlying error, if any.
        #[source]
        source: Option<Box<dyn StdError + Send + Sync + 'static>>,
    },
}

impl StoreError {
    /// Whether the same call may succeed if repeated later.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Backend { retryable, .. } => *retryable,
            Self::InvalidShardCount { .. } | Self::InvalidArgument { .. } => false,
        }
    }

    /// What the caller should do next: fix an invalid argument; retry a backend that says it may
    /// work later ([`Unavailable`](umbp_core::ErrorKind::Unavailable)); report one that says it never
    /// will ([`Internal`](umbp_core::ErrorKind::Internal)).
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::InvalidShardCount { .. } | Self::InvalidArgument { .. } => umbp_core::ErrorKind::InvalidInput,
            Self::Backend { retryable: true, .. } => umbp_core::ErrorKind::Unavailable,
            Self::Backend { retryable: false, .. } => umbp_core::ErrorKind::Internal,
        }
    }
}

/// The master's membership and key index. All methods are synchronous and thread-safe; each write is
/// atomic with respect to the node it concerns (writes of one node are serialized; writes of different
/// nodes run in parallel).
///
/// See the [module documentation](self) for the contract.
pub trait MetadataStore: Send + Sync + fmt::Debug {
    /// Registers a node: inserts an ALIVE record (`last_applied_seq = 0`, `last_heartbeat_ms =
    /// registered_at_ms = now_ms`, caps from the registration), replacing an EXPIRED record or an ALIVE
    /// one whose last heartbeat is more than `stale_after_ms` old. Replacing or not, every location the
    /// node held is wiped. A fresh ALIVE record is left alone ([`RegisterOutcome::AlreadyExists`])
    /// unless the registration's incarnation is higher ([`RegisterOutcome::Replaced`]); a record of a
    /// higher incarnation than the registration's, fresh or not, refuses it
    /// ([`RegisterOutcome::Superseded`]). Incarnation 0 on either side: the plain compare-and-set.
    ///
    /// # Errors
    /// [`StoreError::InvalidArgument`] for an empty node id; backend failures.
    fn register(&self, reg: Registration, now_ms: u64, stale_after_ms: u64) -> Result<RegisterOutcome, StoreError>;

    /// Erases a node's record and every location it held, whatever its incarnation. Returns whether a
    /// record existed; unregistering an absent node is a no-op.
    ///
    /// # Errors
    /// Backend failures.
    fn unregister(&self, node_id: &str) -> Result<bool, StoreError> {
        self.unregister_incarnation(node_id, 0)
    }

    /// [`unregister`](Self::unregister) on behalf of the process of `incarnation`: erases the record
    /// only when it is that incarnation's (or either is 0), so a superseded process leaving cannot
    /// erase the newer one. Returns whether a record was erased.
    ///
    /// # Errors
    /// Backend failures.
    fn unregister_incarnation(&self, node_id: &str, incarnation: u64) -> Result<bool, StoreError>;

    /// Applies one heartbeat (see [`HeartbeatKind`] and [`HeartbeatOutcome`]).
    ///
    /// Delta `ADD` inserts `(node, tier, size)`; a duplicate `(key, node, tier)` **overwrites the
    /// size** with the newer report. Delta `REMOVE` deletes exactly `(key, node, tier)` (no-op if
    /// absent); a key goes with its last location. Events with [`TierType::Unknown`] are skipped.
    ///
    /// # Errors
    /// Backend failures.
    fn apply_heartbeat(&self, hb: HeartbeatApply) -> Result<HeartbeatOutcome, StoreError>;

    /// Expires every ALIVE node whose last heartbeat is older than `cutoff_ms` (strictly): the row is
    /// kept as EXPIRED, its locations are wiped. Returns the ids expired by this call (none on a repeat).
    ///
    /// # Errors
    /// Backend failures.
    fn expire_stale(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError>;

    /// Removes every EXPIRED record whose last heartbeat is older than `cutoff_ms` (strictly): the
    /// master keeps an expired row for operators for a retention, then forgets it. Returns the ids
    /// removed by this call. ALIVE records are never touched.
    ///
    /// # Errors
    /// Backend failures.
    fn remove_expired(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError>;

    /// Raises the available bytes recorded for `tier` of an ALIVE node by `bytes` (never past the
    /// tier's total): the node's peer confirmed that an on-demand eviction freed them, and routing
    /// must see the room before the node's next heartbeat reports it (which then replaces the figure,
    /// as every heartbeat does). A no-op for an absent or expired node or an unreported tier.
    ///
    /// # Errors
    /// Backend failures.
    fn credit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<(), StoreError>;

    /// Lowers the available bytes recorded for `tier` of an ALIVE node by `bytes` (never below 0): a
    /// put route placed that many bytes there, and a concurrent route must not place the same room
    /// twice before the node's next heartbeat reports its real figure (which then replaces it). A
    /// no-op for an absent or expired node or an unreported tier. Returns the tier's capacity after
    /// the debit (`None` for those no-ops), so the caller can tell a medium it ran past a watermark.
    ///
    /// # Errors
    /// Backend failures.
    fn debit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<Option<TierCap>, StoreError>;

    /// The key's locations on ALIVE nodes. No side effects.
    ///
    /// # Errors
    /// Backend failures.
    fn lookup(&self, key: &str) -> Result<Vec<Location>, StoreError>;

    /// For each key, its locations on ALIVE nodes not in `exclude`, in request order. Every key with at
    /// least one such location gets `lease_until = now_ms + lease_ms` (never shortened),
    /// `last_accessed = now_ms` (never moved back) and one more access; other keys are untouched.
    ///
    /// # Errors
    /// Backend failures.
    fn batch_lookup_for_route_get(
        &self,
        keys: &[String],
        exclude: &[String],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Vec<Vec<Location>>, StoreError>;

    /// For each key, whether an ALIVE node holds it. No side effects.
    ///
    /// # Errors
    /// Backend failures.
    fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, StoreError>;

    /// Replicas eviction may pick on the given `(node, tier)` buckets: only those of ALIVE nodes whose
    /// key holds no lease at `now_ms`. Grouped by bucket in request order (a repeated bucket counts
    /// once), oldest `last_accessed_ms` first within a bucket (ties by key), at most `max_per_bucket`
    /// each (0 = no cap; with a cap, the `max_per_bucket` oldest).
    ///
    /// # Errors
    /// Backend failures.
    fn enumerate_eviction_candidates(
        &self,
        buckets: &[(String, TierType)],
        now_ms: u64,
        max_per_bucket: usize,
    ) -> Result<Vec<EvictionCandidate>, StoreError>;

    /// The node's record, alive or expired.
    ///
    /// # Errors
    /// Backend failures.
    fn get_node(&self, node_id: &str) -> Result<Option<NodeRecord>, StoreError>;

    /// Whether the node has an ALIVE record.
    ///
    /// # Errors
    /// Backend failures.
    fn is_alive(&self, node_id: &str) -> Result<bool, StoreError>;

    /// Every ALIVE record, sorted by node id.
    ///
    /// # Errors
    /// Backend failures.
    fn list_alive(&self) -> Result<Vec<NodeRecord>, StoreError>;

    /// Every record, alive or expired, sorted by node id (for cluster status).
    ///
    /// # Errors
    /// Backend failures.
    fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;

    /// `node_id →` how to reach it (peer-service address and data endpoint, as registered) for every
    /// ALIVE node. Route get answers with it, once per call.
    ///
    /// # Errors
    /// Backend failures.
    fn alive_peer_view(&self) -> Result<HashMap<Arc<str>, PeerView>, StoreError>;

    /// Distinct keys in the index.
    ///
    /// # Errors
    /// Backend failures.
    fn key_count(&self) -> Result<u64, StoreError>;

    /// Distinct keys the node holds (on any tier); 0 for an expired or absent node. Cheap (the
    /// in-memory store keeps the count incrementally): cluster status calls it for every node.
    ///
    /// # Errors
    /// Backend failures.
    fn node_key_count(&self, node_id: &str) -> Result<u64, StoreError>;

    /// Records that `node_id` holds the KV blocks `hashes` at `tier` outside the pool (the external
    /// KV index, see `external`'s docs; additive: a block already recorded stays). Records nothing
    /// for a node that is not ALIVE ([`ExternalReport::NodeNotAlive`]). A node's records go with its
    /// locations: at expiry, unregister and registration.
    ///
    /// # Errors
    /// [`StoreError::InvalidArgument`] for an empty node id or hash list, a hash outside 1 to
    /// [`MAX_EXTERNAL_KV_HASH_BYTES`] bytes, more than [`MAX_EXTERNAL_KV_HASHES`] hashes, or
    /// [`TierType::Unknown`]; backend failures.
    fn report_external_kv(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<ExternalReport, StoreError>;

    /// Drops the records `(hash, node_id, tier)` of `hashes`; no liveness check, absent ones ignored.
    ///
    /// # Errors
    /// As [`report_external_kv`](Self::report_external_kv); backend failures.
    fn revoke_external_kv(&self, node_id: &str, hashes: &[String], tier: TierType) -> Result<(), StoreError>;

    /// Drops every record of `node_id` at `tier`; no liveness check.
    ///
    /// # Errors
    /// [`StoreError::InvalidArgument`] for an empty node id or [`TierType::Unknown`]; backend failures.
    fn revoke_all_external_kv_at_tier(&self, node_id: &str, tier: TierType) -> Result<(), StoreError>;

    /// Per node that holds any of `hashes` (sorted by node id), the hashes it holds by tier. With
    /// `count_as_hit`, every distinct matched hash's hit counter goes up by one (once per call,
    /// however many nodes and tiers hold it). An empty list matches nothing.
    ///
    /// # Errors
    /// [`StoreError::InvalidArgument`] for a bad hash or too many; backend failures.
    fn match_external_kv(&self, hashes: &[String], count_as_hit: bool) -> Result<Vec<ExternalKvMatch>, StoreError>;

    /// `(hash, hit count)` for each distinct hash of `hashes` whose count is above 0, in request order.
    /// A hash's counter lives as long as any node holds the hash.
    ///
    /// # Errors
    /// As [`match_external_kv`](Self::match_external_kv); backend failures.
    fn external_kv_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, StoreError>;

    /// Takes the lease `name` for `holder` (a token unique to one master process), or renews it if
    /// `holder` already has it, for `ttl_ms` from now. Returns whether `holder` holds it afterwards:
    /// `false` while another holder's lease runs. The lease lapses by itself `ttl_ms` after its last
    /// renewal, so a holder that dies is replaced within one TTL. Work only one master may do (the
    /// registry reaper, eviction rounds) runs under it. [`RedisStore`] keeps it in Redis under
    /// Redis's own clock (`now_ms` is unused: masters' clocks need not agree); [`InMemoryStore`] in
    /// its process, against `now_ms`.
    ///
    /// # Errors
    /// [`StoreError::InvalidArgument`] for an empty name or holder or a zero TTL; backend failures
    /// (the caller must then act as if it did not hold the lease).
    fn acquire_lease(&self, name: &str, holder: &str, now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError>;

    /// Gives the lease `name` up if `holder` holds it (a master shutting down), so another master
    /// takes it at its next attempt instead of after the TTL. Returns whether it was released.
    ///
    /// # Errors
    /// Backend failures.
    fn release_lease(&self, name: &str, holder: &str) -> Result<bool, StoreError>;
}

/// Checks the arguments of [`MetadataStore::acquire_lease`].
pub(crate) fn check_lease_args(name: &str, holder: &str, ttl_ms: u64) -> Result<(), StoreError> {
    if name.is_empty() || holder.is_empty() {
        return Err(StoreError::InvalidArgument { reason: "a lease needs a name and a holder" });
    }
    if ttl_ms == 0 {
        return Err(StoreError::InvalidArgument { reason: "a lease needs a TTL above 0" });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_store_error_tells_the_caller_what_to_do_next() {
        use umbp_core::ErrorKind;
        assert_eq!(StoreError::InvalidShardCount { shards: 0, max: 4096 }.kind(), ErrorKind::InvalidInput);
        assert_eq!(StoreError::InvalidArgument { reason: "empty node id" }.kind(), ErrorKind::InvalidInput);
        let backend = |retryable| StoreError::Backend {
            message: "redis".into(),
            retryable,
            source: Some(Box::new(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))),
        };
        assert_eq!(backend(true).kind(), ErrorKind::Unavailable);
        assert_eq!(backend(false).kind(), ErrorKind::Internal);
        for err in [backend(true), backend(false), StoreError::InvalidArgument { reason: "x" }] {
            assert_eq!(err.kind().is_retryable(), err.is_retryable(), "{err}");
        }
        assert!(std::error::Error::source(&backend(true)).is_some(), "the backend's error stays the source");
    }

    #[derive(Debug)]
    struct Mock;

    #[expect(unused_variables, reason = "a mock that only has to compile")]
    impl MetadataStore for Mock {
        fn register(&self, reg: Registration, now_ms: u64, stale: u64) -> Result<RegisterOutcome, StoreError> {
            Ok(RegisterOutcome::Registered)
        }
        fn unregister_incarnation(&self, node_id: &str, incarnation: u64) -> Result<bool, StoreError> {
            Ok(false)
        }
        fn apply_heartbeat(&self, hb: HeartbeatApply) -> Result<HeartbeatOutcome, StoreError> {
            Ok(HeartbeatOutcome::Unknown)
        }
        fn expire_stale(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
            Ok(Vec::new())
        }
        fn remove_expired(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
            Ok(Vec::new())
        }
        fn credit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<(), StoreError> {
            Ok(())
        }
        fn debit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<Option<TierCap>, StoreError> {
            Ok(None)
        }
        fn lookup(&self, key: &str) -> Result<Vec<Location>, StoreError> {
            Ok(Vec::new())
        }
        fn batch_lookup_for_route_get(
            &self,
            keys: &[String],
            exclude: &[String],
            now_ms: u64,
            lease_ms: u64,
        ) -> Result<Vec<Vec<Location>>, StoreError> {
            Ok(vec![Vec::new(); keys.len()])
        }
        fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
            Ok(vec![false; keys.len()])
        }
        fn enumerate_eviction_candidates(
            &self,
            buckets: &[(String, TierType)],
            now_ms: u64,
            max: usize,
        ) -> Result<Vec<EvictionCandidate>, StoreError> {
            Ok(Vec::new())
        }
        fn get_node(&self, node_id: &str) -> Result<Option<NodeRecord>, StoreError> {
            Ok(None)
        }
        fn is_alive(&self, node_id: &str) -> Result<bool, StoreError> {
            Ok(false)
        }
        fn list_alive(&self) -> Result<Vec<NodeRecord>, StoreError> {
            Ok(Vec::new())
        }
        fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
            Ok(Vec::new())
        }
        fn alive_peer_view(&self) -> Result<HashMap<Arc<str>, PeerView>, StoreError> {
            Ok(HashMap::new())
        }
        fn key_count(&self) -> Result<u64, StoreError> {
            Ok(0)
        }
        fn node_key_count(&self, node_id: &str) -> Result<u64, StoreError> {
            Ok(0)
        }
        fn report_external_kv(
            &self,
            node_id: &str,
            h: &[String],
            tier: TierType,
        ) -> Result<ExternalReport, StoreError> {
            Ok(ExternalReport::NodeNotAlive)
        }
        fn revoke_external_kv(&self, node_id: &str, h: &[String], tier: TierType) -> Result<(), StoreError> {
            Ok(())
        }
        fn revoke_all_external_kv_at_tier(&self, node_id: &str, tier: TierType) -> Result<(), StoreError> {
            Ok(())
        }
        fn match_external_kv(&self, h: &[String], count: bool) -> Result<Vec<ExternalKvMatch>, StoreError> {
            Ok(Vec::new())
        }
        fn external_kv_hit_counts(&self, h: &[String]) -> Result<Vec<(String, u64)>, StoreError> {
            Ok(Vec::new())
        }
        fn acquire_lease(&self, name: &str, holder: &str, now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError> {
            Ok(true)
        }
        fn release_lease(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
            Ok(true)
        }
    }

    #[test]
    fn trait_is_object_safe_and_a_mock_compiles() {
        let store: Arc<dyn MetadataStore> = Arc::new(Mock);
        assert_eq!(
            store
                .apply_heartbeat(HeartbeatApply {
                    node_id: "n".into(),
                    now_ms: 0,
                    caps: Vec::new(),
                    kind: HeartbeatKind::Keepalive,
                    incarnation: 0,
                })
                .ok(),
            Some(HeartbeatOutcome::Unknown)
        );
        let real: Arc<dyn MetadataStore> = Arc::new(InMemoryStore::new());
        assert_eq!(real.key_count().ok(), Some(0));
    }

    #[test]
    fn outcome_helpers() {
        assert_eq!(HeartbeatOutcome::SeqGap { acked_seq: 3 }.acked_seq(), Some(3));
        assert!(HeartbeatOutcome::SeqGap { acked_seq: 3 }.requests_full_sync());
        assert!(!HeartbeatOutcome::AlreadyApplied { acked_seq: 3 }.requests_full_sync());
        assert_eq!(HeartbeatOutcome::Unknown.acked_seq(), None);
    }

    const _: () = {
        const fn ok<T: Send + Sync>() {}
        ok::<InMemoryStore>();
        ok::<StoreError>();
    };
}
