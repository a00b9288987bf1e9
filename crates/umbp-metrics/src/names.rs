//! Every series name umbp-rs exports, in one place: the dashboard's vocabulary.
//!
//! The medium-internal and transfer names live in `umbp_core::metric_names` (a medium crate must be
//! able to name them without depending on this crate) and are re-exported here, so this module is the
//! complete list. A medium puts its specifics in a label (`event=…`, `state=…`), never in the name.

pub use umbp_core::metric_names::*;

// --- derived by `InstrumentedBackend` from the `MediumBackend` calls ------------------------------

/// Counter of slot-lifecycle entries by `op=` (allocate, commit, abort, resolve, evict, lookup) and `status=`
/// (ok, exists, no_space, miss, failed). One per key, not per call.
pub const OPS_TOTAL: &str = "umbp_backend_ops_total";
/// Help text of [`OPS_TOTAL`].
pub const OPS_TOTAL_HELP: &str = "Slot-lifecycle entries handled by the medium, by op and status (one per key).";
/// Counter of batch calls by `op=`.
pub const BATCHES_TOTAL: &str = "umbp_backend_batches_total";
/// Help text of [`BATCHES_TOTAL`].
pub const BATCHES_TOTAL_HELP: &str = "Batch calls into the medium, by op.";
/// Counter of bytes committed (`op="commit"`), resolved (`op="resolve"`) and freed (`op="evict"`).
pub const BYTES_TOTAL: &str = "umbp_backend_bytes_total";
/// Help text of [`BYTES_TOTAL`].
pub const BYTES_TOTAL_HELP: &str = "Bytes committed, resolved and freed by eviction, by op.";
/// Seconds spent inside the medium's batch calls, by `op=` (shipped from nanoseconds).
pub const OP_SECONDS_TOTAL: &str = "umbp_backend_op_seconds_total";
/// Help text of [`OP_SECONDS_TOTAL`].
pub const OP_SECONDS_TOTAL_HELP: &str = "Seconds spent inside the medium's batch calls, by op.";

// --- the master's view of the cluster ------------------------------------------------------------

/// Gauge of registered nodes by `status=` (`alive`, `expired`).
pub const MASTER_NODES: &str = "umbp_master_nodes";
/// Help text of [`MASTER_NODES`].
pub const MASTER_NODES_HELP: &str = "Nodes the master knows, by status.";
/// Gauge per `node=` the master knows: 1 while it heartbeats, 0 once expired.
pub const MASTER_NODE_UP: &str = "umbp_master_node_up";
/// Help text of [`MASTER_NODE_UP`].
pub const MASTER_NODE_UP_HELP: &str = "1 for each node the master sees alive, 0 for one it expired.";
/// Gauge of distinct keys in the master's index.
pub const MASTER_KEYS: &str = "umbp_master_keys";
/// Help text of [`MASTER_KEYS`].
pub const MASTER_KEYS_HELP: &str = "Distinct live keys in the master's index.";
/// Gauge of keys the index holds per `node=`.
pub const MASTER_NODE_KEYS: &str = "umbp_master_node_keys";
/// Help text of [`MASTER_NODE_KEYS`].
pub const MASTER_NODE_KEYS_HELP: &str = "Keys the master's index holds for each node.";
/// Gauge of a node's advertised capacity by `node=` and `tier=`.
pub const MASTER_CAPACITY_TOTAL_BYTES: &str = "umbp_master_capacity_total_bytes";
/// Help text of [`MASTER_CAPACITY_TOTAL_BYTES`].
pub const MASTER_CAPACITY_TOTAL_BYTES_HELP: &str = "Capacity each alive node last reported, by node and tier.";
/// Gauge of a node's available bytes by `node=` and `tier=`.
pub const MASTER_CAPACITY_AVAILABLE_BYTES: &str = "umbp_master_capacity_available_bytes";
/// Help text of [`MASTER_CAPACITY_AVAILABLE_BYTES`].
pub const MASTER_CAPACITY_AVAILABLE_BYTES_HELP: &str =
    "Available bytes each alive node last reported, by node and tier.";
/// Gauge of seconds since each `node=`'s last heartbeat.
pub const MASTER_HEARTBEAT_AGE_SECONDS: &str = "umbp_master_heartbeat_age_seconds";
/// Help text of [`MASTER_HEARTBEAT_AGE_SECONDS`].
pub const MASTER_HEARTBEAT_AGE_SECONDS_HELP: &str = "Seconds since each node's last heartbeat.";
/// Counter of heartbeat RPCs received.
pub const MASTER_HEARTBEATS_TOTAL: &str = "umbp_master_heartbeats_total";
/// Help text of [`MASTER_HEARTBEATS_TOTAL`].
pub const MASTER_HEARTBEATS_TOTAL_HELP: &str = "Heartbeat RPCs received.";
/// Counter of heartbeat events by `result=` (`applied`, `skipped`).
pub const MASTER_HEARTBEAT_EVENTS_TOTAL: &str = "umbp_master_heartbeat_events_total";
/// Help text of [`MASTER_HEARTBEAT_EVENTS_TOTAL`].
pub const MASTER_HEARTBEAT_EVENTS_TOTAL_HELP: &str = "Key events carried by heartbeats, by result.";
/// Counter of heartbeat answers that were not a plain ack, by `outcome=` (`full_sync_requested`,
/// `reacked`).
pub const MASTER_HEARTBEAT_RECOVERIES_TOTAL: &str = "umbp_master_heartbeat_recoveries_total";
/// Help text of [`MASTER_HEARTBEAT_RECOVERIES_TOTAL`].
pub const MASTER_HEARTBEAT_RECOVERIES_TOTAL_HELP: &str =
    "Heartbeats answered with a full-sync request or re-acknowledged, by outcome.";
/// Counter of keys routed by `op=` (`put`, `get`).
pub const MASTER_ROUTED_KEYS_TOTAL: &str = "umbp_master_routed_keys_total";
/// Help text of [`MASTER_ROUTED_KEYS_TOTAL`].
pub const MASTER_ROUTED_KEYS_TOTAL_HELP: &str = "Keys routed by the master, by op.";
/// Counter of eviction rounds that found pressure.
pub const MASTER_EVICTION_ROUNDS_TOTAL: &str = "umbp_master_eviction_rounds_total";
/// Help text of [`MASTER_EVICTION_ROUNDS_TOTAL`].
pub const MASTER_EVICTION_ROUNDS_TOTAL_HELP: &str = "Eviction rounds that found a node over its high watermark.";
/// Counter of on-demand evictions: a put found no room, so the master evicted before answering it.
pub const MASTER_ON_DEMAND_EVICTIONS_TOTAL: &str = "umbp_master_on_demand_evictions_total";
/// Help text of [`MASTER_ON_DEMAND_EVICTIONS_TOTAL`].
pub const MASTER_ON_DEMAND_EVICTIONS_TOTAL_HELP: &str = "Evictions the master ran on demand, for a put that found no room (or a medium a put pushed past its high watermark).";
/// Counter of eviction victims by `result=` (`requested`, `refused`).
pub const MASTER_EVICTION_KEYS_TOTAL: &str = "umbp_master_eviction_keys_total";
/// Help text of [`MASTER_EVICTION_KEYS_TOTAL`].
pub const MASTER_EVICTION_KEYS_TOTAL_HELP: &str =
    "Keys the master asked peers to evict (requested) and those a lease or pin protected (refused).";
/// Counter of bytes the peers reported freed by eviction.
pub const MASTER_EVICTED_BYTES_TOTAL: &str = "umbp_master_evicted_bytes_total";
/// Help text of [`MASTER_EVICTED_BYTES_TOTAL`].
pub const MASTER_EVICTED_BYTES_TOTAL_HELP: &str = "Bytes the peers reported freed by master-driven eviction.";
/// Counter of external KV block reports by `result=` (`recorded`, `rejected_not_alive`).
pub const MASTER_EXTERNAL_KV_REPORTS_TOTAL: &str = "umbp_master_external_kv_reports_total";
/// Help text of [`MASTER_EXTERNAL_KV_REPORTS_TOTAL`].
pub const MASTER_EXTERNAL_KV_REPORTS_TOTAL_HELP: &str =
    "External KV block reports, by result (rejected_not_alive: the node was not a live registered node).";

/// The slot-lifecycle operations [`InstrumentedBackend`](crate::InstrumentedBackend) counts, as
/// their `op=` label values. `resolve` is a read (its bytes are read bandwidth); `lookup` is an
/// existence check (`batch_contains`: no bytes, never in the read or hit-rate panels).
pub const OPS: [&str; 6] = ["allocate", "commit", "abort", "resolve", "evict", "lookup"];

/// The outcomes of one entry, as their `status=` label values.
pub const STATUSES: [&str; 5] = ["ok", "exists", "no_space", "miss", "failed"];

// --- the `/metrics` endpoint itself ---------------------------------------------------------------

/// Counter of connections the `/metrics` endpoint closed unserved because it was serving its
/// connection limit already.
pub const METRICS_REFUSED_CONNECTIONS_TOTAL: &str = "umbp_metrics_refused_connections_total";
/// Help text of [`METRICS_REFUSED_CONNECTIONS_TOTAL`].
pub const METRICS_REFUSED_CONNECTIONS_TOTAL_HELP: &str =
    "Connections the metrics endpoint closed unserved, over its connection limit.";

// --- the client side of a node (`PoolClient`) -----------------------------------------------------

/// Counter of keys sent to the master again after a failed attempt (put or get).
pub const CLIENT_REROUTES_TOTAL: &str = "umbp_client_reroutes_total";
/// Help text of [`CLIENT_REROUTES_TOTAL`].
pub const CLIENT_REROUTES_TOTAL_HELP: &str = "Keys re-routed after a failed attempt (put or get).";
/// Counter of reads discarded because the copy outlived the holder's read lease.
pub const CLIENT_LEASE_LAPSES_TOTAL: &str = "umbp_client_lease_lapses_total";
/// Help text of [`CLIENT_LEASE_LAPSES_TOTAL`].
pub const CLIENT_LEASE_LAPSES_TOTAL_HELP: &str = "Reads discarded because the copy outlived the read lease.";
/// Counter of reads whose bytes did not match the checksum their writer put with them (a flipped
/// bit in a holder's memory, on its drive or on the wire): each is discarded and read elsewhere or
/// reported a miss, never returned.
pub const CLIENT_CHECKSUM_FAILURES_TOTAL: &str = "umbp_client_checksum_failures_total";
/// Help text of [`CLIENT_CHECKSUM_FAILURES_TOTAL`].
pub const CLIENT_CHECKSUM_FAILURES_TOTAL_HELP: &str =
    "Reads discarded because their bytes did not match the checksum they were put with.";
/// Counter of writes aborted because the slot's pending TTL was about to pass.
pub const CLIENT_SLOT_EXPIRIES_TOTAL: &str = "umbp_client_slot_expiries_total";
/// Help text of [`CLIENT_SLOT_EXPIRIES_TOTAL`].
pub const CLIENT_SLOT_EXPIRIES_TOTAL_HELP: &str = "Writes aborted because the slot's pending TTL was about to pass.";
/// Counter of re-cache jobs (remote fetches copied to the local medium) by `result=` (`queued`,
/// `dropped`, `stored`).
pub const CLIENT_RECACHE_TOTAL: &str = "umbp_client_recache_total";
/// Help text of [`CLIENT_RECACHE_TOTAL`].
pub const CLIENT_RECACHE_TOTAL_HELP: &str = "Re-cache jobs of remote fetches, by result.";
