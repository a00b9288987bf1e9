//! The one table of settings: each row maps a path of the settings tree (a file key) to its flag
//! and its `UMBP_*` variables, with the flat keys of earlier files that still name it.
//!
//! Names, defaults and validation are the components' own (their `Deserialize` and `Default`);
//! this table only says where each setting can be written. `tests.rs` checks that every field of
//! the tree has a row, that the flag, the variable and the key share a stem, and that each flag's
//! help states the variables and the component's default.

/// Which command reads a setting (flags are per command; the environment is read by the commands
/// that use it, so a variable meant for another command never fails this one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Scope {
    /// Every command that talks to the master: `--master` and `--token`.
    Global,
    /// `umbp master`.
    Master,
    /// `umbp node`.
    Node,
    /// `umbp get` (the client commands).
    Client,
    /// The master client of `umbp node` and of the client commands (its flags are `umbp node`'s).
    MasterClient,
    /// What the pool client of `umbp node` and of the client commands both read — timeouts,
    /// reroutes, the bounce buffer, the shared-memory path, checksums (its flags are `umbp node`'s;
    /// the client commands take the variables and the file).
    PoolClient,
}

/// How a variable's text becomes a value of the tree (the file's syntax).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EnvKind {
    /// As written: names, addresses, sizes (`64MiB` or bytes), durations (`5s`).
    Text,
    /// A whole number.
    Int,
    /// A number (`0.9`).
    Float,
    /// `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`.
    Bool,
    /// A comma-separated list.
    List,
    /// Whole seconds, at least this many (the reference's `*_SEC` variables).
    Secs(u64),
    /// Whole milliseconds, at least this many (the reference's `*_MS` variables).
    Millis(u64),
}

/// One setting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Row {
    /// Its path in the tree: the file key (`node.ssd.max_value_pages`).
    pub path: &'static str,
    /// The command whose flag it is.
    pub scope: Scope,
    /// The flag (`--ssd-max-value-pages`).
    pub flag: &'static str,
    /// Its variables, the first winning when several are set: the reference's names where one
    /// exists, plus one of the flag's stem where the reference's name has another.
    pub env: &'static [(&'static str, EnvKind)],
    /// Flat keys of earlier files that still name it (`node.ssd_max_value_pages`).
    pub legacy: &'static [&'static str],
}

const fn row(
    path: &'static str,
    scope: Scope,
    flag: &'static str,
    env: &'static [(&'static str, EnvKind)],
    legacy: &'static [&'static str],
) -> Row {
    Row { path, scope, flag, env, legacy }
}

use EnvKind::{Bool, Float, Int, List, Millis, Secs, Text};
use Scope::{Client, Global, Master, MasterClient, Node, PoolClient};

/// Every setting of the tree.
pub(crate) const TABLE: &[Row] = &[
    row("master_address", Global, "--master", &[("UMBP_MASTER_ADDRESS", Text)], &[]),
    row("cluster_token", Global, "--token", &[("UMBP_CLUSTER_TOKEN", Text)], &[]),
    // [master]: umbp_master::MasterConfig.
    row("master.listen", Master, "--listen", &[("UMBP_MASTER_LISTEN", Text)], &[]),
    row("master.heartbeat_ttl", Master, "--heartbeat-ttl", &[("UMBP_HEARTBEAT_TTL_SEC", Secs(1))], &[]),
    row(
        "master.heartbeat_interval_divisor",
        Master,
        "--heartbeat-interval-divisor",
        &[("UMBP_HEARTBEAT_INTERVAL_DIVISOR", Int)],
        &[],
    ),
    row("master.max_missed_heartbeats", Master, "--max-missed-heartbeats", &[("UMBP_MAX_MISSED_HEARTBEATS", Int)], &[]),
    row("master.reaper_interval", Master, "--reaper-interval", &[("UMBP_REAPER_INTERVAL_SEC", Secs(1))], &[]),
    row("master.expired_retention", Master, "--expired-retention", &[("UMBP_EXPIRED_RETENTION_SEC", Secs(0))], &[]),
    row(
        "master.route_put_algo",
        Master,
        "--route-put-algo",
        &[("UMBP_ROUTE_PUT_ALGO", Text), ("UMBP_ROUTE_PUT_SELECT_ALGO", Text)],
        &[],
    ),
    row(
        "master.route_put_affinity",
        Master,
        "--route-put-affinity",
        &[("UMBP_ROUTE_PUT_AFFINITY", Text), ("UMBP_ROUTE_PUT_NODE_AFFINITY", Text)],
        &[],
    ),
    row("master.index_shards", Master, "--index-shards", &[("UMBP_MASTER_INDEX_SHARDS", Int)], &[]),
    row(
        "master.shutdown_deadline",
        Master,
        "--shutdown-deadline",
        &[("UMBP_GRPC_SHUTDOWN_DEADLINE_SEC", Secs(0))],
        &[],
    ),
    row("master.max_message_bytes", Master, "--max-message-bytes", &[("UMBP_MASTER_MAX_MESSAGE_BYTES", Text)], &[]),
    row("master.metrics_addr", Master, "--metrics-addr", &[("UMBP_MASTER_METRICS_ADDR", Text)], &[]),
    row("master.metadata", Master, "--metadata", &[("UMBP_MASTER_METADATA", Text)], &[]),
    // [master.eviction]: umbp_master::routing::EvictionConfig.
    row(
        "master.eviction.check_interval",
        Master,
        "--eviction-check-interval",
        &[("UMBP_EVICTION_CHECK_INTERVAL_SEC", Secs(1))],
        &["master.eviction_check_interval"],
    ),
    row(
        "master.eviction.high_watermark",
        Master,
        "--eviction-high-watermark",
        &[("UMBP_EVICTION_HIGH_WATERMARK", Float)],
        &["master.eviction_high_watermark"],
    ),
    row(
        "master.eviction.low_watermark",
        Master,
        "--eviction-low-watermark",
        &[("UMBP_EVICTION_LOW_WATERMARK", Float)],
        &["master.eviction_low_watermark"],
    ),
    row(
        "master.eviction.lease_duration",
        Master,
        "--lease-duration",
        &[("UMBP_LEASE_DURATION_SEC", Secs(1))],
        &["master.route_get_lease"],
    ),
    row(
        "master.eviction.evict_deadline",
        Master,
        "--evict-deadline",
        &[("UMBP_EVICT_DEADLINE", Text), ("UMBP_EVICTKEY_DEADLINE_MS", Millis(1))],
        &["master.evict_deadline"],
    ),
    // [node]: the node's own settings (PoolClientConfig's).
    row("node.node_id", Node, "--node-id", &[("UMBP_NODE_ID", Text)], &[]),
    row("node.medium", Node, "--medium", &[("UMBP_MEDIUM", Text)], &[]),
    row("node.page_size", Node, "--page-size", &[("UMBP_PAGE_SIZE", Text)], &[]),
    row("node.listen", Node, "--listen", &[("UMBP_NODE_LISTEN", Text), ("UMBP_NODE_ADDRESS", Text)], &[]),
    row("node.peer_port", Node, "--peer-port", &[("UMBP_NODE_PEER_PORT", Int), ("UMBP_PEER_SERVICE_PORT", Int)], &[]),
    row("node.data_port", Node, "--data-port", &[("UMBP_NODE_DATA_PORT", Int), ("UMBP_IO_ENGINE_PORT", Int)], &[]),
    row("node.recache", Node, "--recache", &[("UMBP_RECACHE", Text), ("UMBP_CACHE_REMOTE_FETCHES", Text)], &[]),
    row("node.read_lease", Node, "--read-lease", &[("UMBP_DRAM_READ_LEASE_MS", Millis(1))], &[]),
    row("node.pending_ttl", Node, "--pending-ttl", &[("UMBP_PENDING_TTL", Text)], &[]),
    row("node.rpc_timeout", PoolClient, "--rpc-timeout", &[("UMBP_RPC_TIMEOUT", Text)], &[]),
    row("node.max_reroutes", PoolClient, "--max-reroutes", &[("UMBP_MAX_REROUTES", Int)], &[]),
    row("node.bounce", PoolClient, "--bounce", &[("UMBP_BOUNCE", Text)], &[]),
    row("node.metrics_addr", Node, "--metrics-addr", &[("UMBP_NODE_METRICS_ADDR", Text)], &[]),
    row("node.shared_memory", PoolClient, "--shared-memory", &[("UMBP_SHARED_MEMORY", Bool)], &[]),
    row("node.shared_memory_group", Node, "--shared-memory-group", &[("UMBP_SHARED_MEMORY_GROUP", Text)], &[]),
    row("node.checksums", PoolClient, "--checksums", &[("UMBP_CHECKSUMS", Bool)], &[]),
    // [node.dram]: umbp_peer::pool_client::DramConfig.
    row("node.dram.capacity_bytes", Node, "--capacity", &[("UMBP_CAPACITY", Text)], &["node.capacity"]),
    row("node.dram.prefault", Node, "--prefault", &[("UMBP_DRAM_PREFAULT", Bool)], &["node.prefault"]),
    row("node.dram.use_hugepages", Node, "--hugepages", &[("UMBP_DRAM_HUGEPAGES", Bool)], &["node.hugepages"]),
    row("node.dram.numa_node", Node, "--numa-node", &[("UMBP_NUMA_NODE", Int)], &["node.numa_node"]),
    row(
        "node.dram.transparent_hugepages",
        Node,
        "--transparent-hugepages",
        &[("UMBP_DRAM_TRANSPARENT_HUGEPAGES", Bool)],
        &[],
    ),
    // [node.hbm]: umbp_hbm::HbmConfig.
    row("node.hbm.device", Node, "--hbm-device", &[("UMBP_HBM_DEVICE", Int)], &["node.hbm_device"]),
    row("node.hbm.capacity_bytes", Node, "--hbm-capacity", &[("UMBP_HBM_CAPACITY", Text)], &["node.hbm_capacity"]),
    row("node.hbm.runtime", Node, "--hbm-runtime", &[("UMBP_HBM_RUNTIME", Text)], &["node.hbm_runtime"]),
    // [node.cxl]: umbp_cxl::CxlConfig.
    row("node.cxl.path", Node, "--cxl-path", &[("UMBP_CXL_PATH", Text)], &[]),
    row("node.cxl.capacity_bytes", Node, "--cxl-capacity", &[("UMBP_CXL_CAPACITY", Text)], &[]),
    // [node.object]: umbp_object::ObjectSettings.
    row("node.object.url", Node, "--object-url", &[("UMBP_OBJECT_URL", Text)], &[]),
    row("node.object.endpoint", Node, "--object-endpoint", &[("UMBP_OBJECT_ENDPOINT", Text)], &[]),
    row("node.object.capacity_bytes", Node, "--object-capacity", &[("UMBP_OBJECT_CAPACITY", Text)], &[]),
    row("node.object.staging_pages", Node, "--object-staging-pages", &[("UMBP_OBJECT_STAGING_PAGES", Int)], &[]),
    row("node.object.max_value_pages", Node, "--object-max-value-pages", &[("UMBP_OBJECT_MAX_VALUE_PAGES", Int)], &[]),
    row("node.object.read_lease", Node, "--object-read-lease", &[("UMBP_OBJECT_READ_LEASE", Text)], &[]),
    row("node.object.io_threads", Node, "--object-io-threads", &[("UMBP_OBJECT_IO_THREADS", Int)], &[]),
    row("node.object.op_timeout", Node, "--object-op-timeout", &[("UMBP_OBJECT_OP_TIMEOUT", Text)], &[]),
    row("node.object.retries", Node, "--object-retries", &[("UMBP_OBJECT_RETRIES", Int)], &[]),
    row("node.object.create_bucket", Node, "--object-create-bucket", &[("UMBP_OBJECT_CREATE_BUCKET", Bool)], &[]),
    row("node.object.cache_committed", Node, "--object-cache-committed", &[("UMBP_OBJECT_CACHE_COMMITTED", Bool)], &[]),
    // [node.ssd]: umbp_ssd::SsdSettings.
    row("node.ssd.dirs", Node, "--ssd-dir", &[("UMBP_SSD_DIRS", List)], &["node.ssd_dirs"]),
    row("node.ssd.capacity_bytes", Node, "--ssd-capacity", &[("UMBP_SSD_CAPACITY", Text)], &["node.ssd_capacity"]),
    row("node.ssd.io_engine", Node, "--ssd-io-engine", &[("UMBP_SSD_IO_ENGINE", Text)], &["node.ssd_io_engine"]),
    row(
        "node.ssd.staging_pages",
        Node,
        "--ssd-staging-pages",
        &[("UMBP_SSD_STAGING_PAGES", Int)],
        &["node.ssd_staging_pages"],
    ),
    row(
        "node.ssd.max_value_pages",
        Node,
        "--ssd-max-value-pages",
        &[("UMBP_SSD_MAX_VALUE_PAGES", Int)],
        &["node.ssd_max_value_pages"],
    ),
    row(
        "node.ssd.read_lease",
        Node,
        "--ssd-read-lease",
        &[("UMBP_SSD_READ_LEASE_MS", Millis(1))],
        &["node.ssd_read_lease"],
    ),
    row(
        "node.ssd.sync_interval",
        Node,
        "--ssd-sync-interval",
        &[("UMBP_SSD_SYNC_INTERVAL", Text)],
        &["node.ssd_sync_interval"],
    ),
    row(
        "node.ssd.create_dirs",
        Node,
        "--ssd-create-dirs",
        &[("UMBP_SSD_CREATE_DIRS", Bool)],
        &["node.ssd_create_dirs"],
    ),
    row("node.ssd.cache_committed", Node, "--ssd-cache-committed", &[("UMBP_SSD_CACHE_COMMITTED", Bool)], &[]),
    // [node.master]: umbp_peer::master_client::MasterClientConfig.
    row(
        "node.master.heartbeat_rpc_timeout",
        MasterClient,
        "--heartbeat-rpc-timeout",
        &[("UMBP_HEARTBEAT_RPC_TIMEOUT_MS", Millis(1))],
        &[],
    ),
    row(
        "node.master.events_per_bundle",
        MasterClient,
        "--events-per-bundle",
        &[("UMBP_HEARTBEAT_EVENTS_PER_BUNDLE", Int)],
        &[],
    ),
    row(
        "node.master.max_bundles_per_rpc",
        MasterClient,
        "--max-bundles-per-rpc",
        &[("UMBP_HEARTBEAT_MAX_BUNDLES_PER_RPC", Int)],
        &[],
    ),
    row(
        "node.master.auto_flush_event_threshold",
        MasterClient,
        "--auto-flush-event-threshold",
        &[("UMBP_AUTO_FLUSH_EVENT_THRESHOLD", Int)],
        &[],
    ),
    row(
        "node.master.shutdown_timeout",
        MasterClient,
        "--shutdown-timeout",
        &[("UMBP_RPC_SHUTDOWN_TIMEOUT_MS", Millis(1))],
        &[],
    ),
    row(
        "node.master.max_outbox_events",
        MasterClient,
        "--max-outbox-events",
        &[("UMBP_HEARTBEAT_MAX_OUTBOX_EVENTS", Int)],
        &[],
    ),
    row(
        "node.master.full_sync_chunk_events",
        MasterClient,
        "--full-sync-chunk-events",
        &[("UMBP_FULL_SYNC_CHUNK_EVENTS", Int)],
        &[],
    ),
    row(
        "node.master.max_request_bytes",
        MasterClient,
        "--max-request-bytes",
        &[("UMBP_HEARTBEAT_MAX_REQUEST_BYTES", Text)],
        &[],
    ),
    row(
        "node.master.rpc_timeout",
        MasterClient,
        "--master-rpc-timeout",
        &[("UMBP_MASTER_RPC_TIMEOUT_MS", Millis(1))],
        &[],
    ),
    row(
        "node.master.connect_timeout",
        MasterClient,
        "--master-connect-timeout",
        &[("UMBP_MASTER_CONNECT_TIMEOUT_MS", Millis(1))],
        &[],
    ),
    row("node.master.clear_timeout", MasterClient, "--clear-timeout", &[("UMBP_CLEAR_TIMEOUT_MS", Millis(1))], &[]),
    row(
        "node.master.default_heartbeat_interval",
        MasterClient,
        "--default-heartbeat-interval",
        &[("UMBP_DEFAULT_HEARTBEAT_INTERVAL", Text)],
        &[],
    ),
    row(
        "node.master.max_message_bytes",
        MasterClient,
        "--master-max-message-bytes",
        &[("UMBP_NODE_MASTER_MAX_MESSAGE_BYTES", Text)],
        &[],
    ),
    // [client].
    row("client.max_get_size", Client, "--max-get-size", &[("UMBP_MAX_GET_SIZE", Text)], &[]),
];

/// The row of `path` or of a flat key of earlier files.
pub(crate) fn by_key(key: &str) -> Option<&'static Row> {
    TABLE.iter().find(|r| r.path == key || r.legacy.contains(&key))
}

/// The row of `flag` among the rows of `scopes`.
pub(crate) fn by_flag(scopes: &[Scope], flag: &str) -> Option<&'static Row> {
    TABLE.iter().find(|r| r.flag == flag && scopes.contains(&r.scope))
}
