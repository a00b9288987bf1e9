//! The flags a command was given, as values of the settings tree in the file's syntax, named by
//! the flag (the table maps each to its path). Absent flags are left out: the layers below decide.

use std::time::Duration;

use toml::Value;

use super::layer::FlagValue;
use crate::cli::{GetArgs, MasterAddress, MasterArgs, NodeArgs};
use crate::units::{format_duration, format_size};

#[derive(Default)]
struct Flags(Vec<FlagValue>);

impl Flags {
    fn text(&mut self, flag: &'static str, v: Option<impl ToString>) {
        if let Some(v) = v {
            self.0.push((flag, Value::String(v.to_string())));
        }
    }
    fn int(&mut self, flag: &'static str, v: Option<impl TryInto<i64>>) {
        if let Some(v) = v {
            // Beyond i64 only as an absurd page count: saturate, and the range checks refuse it.
            self.0.push((flag, Value::Integer(v.try_into().unwrap_or(i64::MAX))));
        }
    }
    fn size(&mut self, flag: &'static str, v: Option<u64>) {
        self.text(flag, v.map(format_size));
    }
    fn duration(&mut self, flag: &'static str, v: Option<Duration>) {
        self.text(flag, v.map(format_duration));
    }
    fn float(&mut self, flag: &'static str, v: Option<f64>) {
        if let Some(v) = v {
            self.0.push((flag, Value::Float(v)));
        }
    }
    fn bool(&mut self, flag: &'static str, v: Option<bool>) {
        if let Some(v) = v {
            self.0.push((flag, Value::Boolean(v)));
        }
    }
}

fn with_global(f: &mut Flags, master: Option<&MasterAddress>, token: Option<&str>) {
    f.text("--master", master.and_then(|m| m.master.as_deref()));
    f.text("--token", token);
}

/// `--master` and `--token`.
pub(crate) fn global(master: &MasterAddress, token: Option<&str>) -> Vec<FlagValue> {
    let mut f = Flags::default();
    with_global(&mut f, Some(master), token);
    f.0
}

/// The flags of `umbp master`.
pub(crate) fn master(a: &MasterArgs, token: Option<&str>) -> Vec<FlagValue> {
    let mut f = Flags::default();
    with_global(&mut f, None, token);
    f.text("--listen", a.listen);
    f.duration("--heartbeat-ttl", a.heartbeat_ttl);
    f.int("--max-missed-heartbeats", a.max_missed_heartbeats);
    f.duration("--reaper-interval", a.reaper_interval);
    f.duration("--expired-retention", a.expired_retention);
    f.text("--route-put-algo", a.route_put_algo);
    f.text("--route-put-affinity", a.route_put_affinity);
    f.int("--heartbeat-interval-divisor", a.heartbeat_interval_divisor);
    f.duration("--eviction-check-interval", a.eviction_check_interval);
    f.float("--eviction-high-watermark", a.eviction_high_watermark);
    f.float("--eviction-low-watermark", a.eviction_low_watermark);
    f.duration("--lease-duration", a.lease_duration);
    f.duration("--evict-deadline", a.evict_deadline);
    f.int("--index-shards", a.index_shards);
    f.duration("--shutdown-deadline", a.shutdown_deadline);
    f.size("--max-message-bytes", a.max_message_bytes);
    f.text("--metrics-addr", a.metrics_addr);
    f.text("--metadata", a.metadata.as_deref());
    f.0
}

/// The flags of `umbp node`.
pub(crate) fn node(a: &NodeArgs, token: Option<&str>) -> Vec<FlagValue> {
    let mut f = Flags::default();
    with_global(&mut f, Some(&a.master), token);
    f.text("--node-id", a.node_id.as_deref());
    f.text("--medium", a.medium.map(|m| m.as_str()));
    f.size("--page-size", a.page_size);
    f.text("--listen", a.listen);
    f.int("--peer-port", a.peer_port);
    f.int("--data-port", a.data_port);
    f.text("--recache", a.recache.as_deref());
    f.duration("--read-lease", a.read_lease);
    f.duration("--pending-ttl", a.pending_ttl);
    f.duration("--rpc-timeout", a.rpc_timeout);
    f.int("--max-reroutes", a.max_reroutes);
    f.size("--bounce", a.bounce);
    f.text("--metrics-addr", a.metrics_addr);
    f.bool("--shared-memory", a.shared_memory);
    f.text("--shared-memory-group", a.shared_memory_group.as_deref());
    f.bool("--checksums", a.checksums);
    f.size("--capacity", a.capacity);
    f.bool("--prefault", a.prefault);
    f.bool("--hugepages", a.hugepages);
    f.int("--numa-node", a.numa_node);
    f.bool("--transparent-hugepages", a.transparent_hugepages);
    f.int("--hbm-device", a.hbm_device);
    f.size("--hbm-capacity", a.hbm_capacity);
    f.text("--hbm-runtime", a.hbm_runtime.as_deref());
    f.text("--cxl-path", a.cxl_path.as_ref().map(|p| p.display()));
    f.size("--cxl-capacity", a.cxl_capacity);
    f.text("--object-url", a.object_url.as_deref());
    f.text("--object-endpoint", a.object_endpoint.as_deref());
    f.size("--object-capacity", a.object_capacity);
    f.int("--object-staging-pages", a.object_staging_pages);
    f.int("--object-max-value-pages", a.object_max_value_pages);
    f.duration("--object-read-lease", a.object_read_lease);
    f.int("--object-io-threads", a.object_io_threads);
    f.duration("--object-op-timeout", a.object_op_timeout);
    f.int("--object-retries", a.object_retries);
    f.bool("--object-create-bucket", a.object_create_bucket);
    f.bool("--object-cache-committed", a.object_cache_committed);
    if !a.ssd_dir.is_empty() {
        let dirs = a.ssd_dir.iter().map(|d| Value::String(d.display().to_string())).collect();
        f.0.push(("--ssd-dir", Value::Array(dirs)));
    }
    f.size("--ssd-capacity", a.ssd_capacity);
    f.text("--ssd-io-engine", a.ssd_io_engine.as_deref());
    f.int("--ssd-staging-pages", a.ssd_staging_pages);
    f.int("--ssd-max-value-pages", a.ssd_max_value_pages);
    f.duration("--ssd-read-lease", a.ssd_read_lease);
    f.text("--ssd-sync-interval", a.ssd_sync_interval.as_deref());
    // A switch: absent means "not set here", never "false".
    f.bool("--ssd-create-dirs", a.ssd_create_dirs.then_some(true));
    f.bool("--ssd-cache-committed", a.ssd_cache_committed);
    let m = &a.master_client;
    f.duration("--heartbeat-rpc-timeout", m.heartbeat_rpc_timeout);
    f.int("--events-per-bundle", m.events_per_bundle);
    f.int("--max-bundles-per-rpc", m.max_bundles_per_rpc);
    f.int("--auto-flush-event-threshold", m.auto_flush_event_threshold);
    f.duration("--shutdown-timeout", m.shutdown_timeout);
    f.int("--max-outbox-events", m.max_outbox_events);
    f.int("--full-sync-chunk-events", m.full_sync_chunk_events);
    f.size("--max-request-bytes", m.max_request_bytes);
    f.duration("--master-rpc-timeout", m.master_rpc_timeout);
    f.duration("--master-connect-timeout", m.master_connect_timeout);
    f.duration("--clear-timeout", m.clear_timeout);
    f.duration("--default-heartbeat-interval", m.default_heartbeat_interval);
    f.size("--master-max-message-bytes", m.master_max_message_bytes);
    f.0
}

/// The flags of `umbp get` that are settings.
pub(crate) fn get(a: &GetArgs) -> Vec<FlagValue> {
    let mut f = Flags::default();
    with_global(&mut f, Some(&a.master), None);
    f.size("--max-get-size", a.max_size);
    f.0
}
