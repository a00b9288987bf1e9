//! The master's cluster series, sampled from the store and the service counters by the metrics
//! endpoint (`MasterConfig::metrics_listen`).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use umbp_core::{MetricSample, MetricSource};
use umbp_metrics::names;

use crate::evictor::EvictionStats;
use crate::service::{ServiceStats, now_ms};
use crate::store::{MetadataStore, NodeStatus};

/// What the master knows, as metric samples: membership, capacity per node and tier, keys, and the
/// heartbeat, routing and eviction counters.
pub(crate) struct ClusterMetrics {
    pub(crate) store: Arc<dyn MetadataStore>,
    pub(crate) stats: Arc<ServiceStats>,
    pub(crate) eviction: Arc<EvictionStats>,
}

fn label(k: &str, v: &str) -> (String, String) {
    (k.to_owned(), v.to_owned())
}

impl MetricSource for ClusterMetrics {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let mut out = Vec::new();
        let counter = |name, help, labels, v: &std::sync::atomic::AtomicU64| {
            MetricSample::counter(name, help, labels, v.load(Relaxed))
        };
        let s = &self.stats;
        let e = &self.eviction;
        out.extend([
            counter(names::MASTER_HEARTBEATS_TOTAL, names::MASTER_HEARTBEATS_TOTAL_HELP, vec![], &s.heartbeats),
            counter(
                names::MASTER_HEARTBEAT_EVENTS_TOTAL,
                names::MASTER_HEARTBEAT_EVENTS_TOTAL_HELP,
                vec![label("result", "applied")],
                &s.events_applied,
            ),
            counter(
                names::MASTER_HEARTBEAT_EVENTS_TOTAL,
                names::MASTER_HEARTBEAT_EVENTS_TOTAL_HELP,
                vec![label("result", "skipped")],
                &s.events_skipped,
            ),
            counter(
                names::MASTER_HEARTBEAT_RECOVERIES_TOTAL,
                names::MASTER_HEARTBEAT_RECOVERIES_TOTAL_HELP,
                vec![label("outcome", "full_sync_requested")],
                &s.seq_gaps,
            ),
            counter(
                names::MASTER_HEARTBEAT_RECOVERIES_TOTAL,
                names::MASTER_HEARTBEAT_RECOVERIES_TOTAL_HELP,
                vec![label("outcome", "reacked")],
                &s.reacked,
            ),
            counter(
                names::MASTER_ROUTED_KEYS_TOTAL,
                names::MASTER_ROUTED_KEYS_TOTAL_HELP,
                vec![label("op", "put")],
                &s.route_put_keys,
            ),
            counter(
                names::MASTER_ROUTED_KEYS_TOTAL,
                names::MASTER_ROUTED_KEYS_TOTAL_HELP,
                vec![label("op", "get")],
                &s.route_get_keys,
            ),
            counter(names::MASTER_EVICTION_ROUNDS_TOTAL, names::MASTER_EVICTION_ROUNDS_TOTAL_HELP, vec![], &e.rounds),
            counter(
                names::MASTER_EVICTION_KEYS_TOTAL,
                names::MASTER_EVICTION_KEYS_TOTAL_HELP,
                vec![label("result", "requested")],
                &e.requests,
            ),
            counter(
                names::MASTER_EVICTION_KEYS_TOTAL,
                names::MASTER_EVICTION_KEYS_TOTAL_HELP,
                vec![label("result", "refused")],
                &e.refused,
            ),
            counter(names::MASTER_EVICTED_BYTES_TOTAL, names::MASTER_EVICTED_BYTES_TOTAL_HELP, vec![], &e.bytes_freed),
        ]);
        // The store is in memory (or a shared store answering for it); a failing call costs this
        // sample its cluster gauges, never the process.
        let nodes = match self.store.list_nodes() {
            Ok(n) => n,
            Err(err) => {
                tracing::debug!(error = %err, "metrics: listing nodes failed");
                return out;
            }
        };
        let now = now_ms();
        let (mut alive, mut expired) = (0u64, 0u64);
        for n in &nodes {
            let node = label("node", &n.node_id);
            match n.status {
                NodeStatus::Alive => alive += 1,
                NodeStatus::Expired => {
                    expired += 1;
                    continue;
                }
            }
            for cap in &n.caps {
                let labels = vec![node.clone(), label("tier", cap.tier.as_str())];
                out.push(MetricSample::gauge(
                    names::MASTER_CAPACITY_TOTAL_BYTES,
                    names::MASTER_CAPACITY_TOTAL_BYTES_HELP,
                    labels.clone(),
                    cap.total_bytes,
                ));
                out.push(MetricSample::gauge(
                    names::MASTER_CAPACITY_AVAILABLE_BYTES,
                    names::MASTER_CAPACITY_AVAILABLE_BYTES_HELP,
                    labels,
                    cap.available_bytes,
                ));
            }
            if let Ok(keys) = self.store.node_key_count(&n.node_id) {
                out.push(MetricSample::gauge(
                    names::MASTER_NODE_KEYS,
                    names::MASTER_NODE_KEYS_HELP,
                    vec![node.clone()],
                    keys,
                ));
            }
            let mut age = MetricSample::gauge(
                names::MASTER_HEARTBEAT_AGE_SECONDS,
                names::MASTER_HEARTBEAT_AGE_SECONDS_HELP,
                vec![node],
                now.saturating_sub(n.last_heartbeat_ms),
            );
            age.scale = 1e-3;
            out.push(age);
        }
        for (status, n) in [("alive", alive), ("expired", expired)] {
            out.push(MetricSample::gauge(
                names::MASTER_NODES,
                names::MASTER_NODES_HELP,
                vec![label("status", status)],
                n,
            ));
        }
        if let Ok(keys) = self.store.key_count() {
            out.push(MetricSample::gauge(names::MASTER_KEYS, names::MASTER_KEYS_HELP, vec![], keys));
        }
        out
    }
}
