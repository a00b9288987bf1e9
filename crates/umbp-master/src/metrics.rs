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
                names::MASTER_ON_DEMAND_EVICTIONS_TOTAL,
                names::MASTER_ON_DEMAND_EVICTIONS_TOTAL_HELP,
                vec![],
                &e.on_demand,
            ),
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
            counter(
                names::MASTER_EXTERNAL_KV_REPORTS_TOTAL,
                names::MASTER_EXTERNAL_KV_REPORTS_TOTAL_HELP,
                vec![label("result", "recorded")],
                &s.external.reports_recorded,
            ),
            counter(
                names::MASTER_EXTERNAL_KV_REPORTS_TOTAL,
                names::MASTER_EXTERNAL_KV_REPORTS_TOTAL_HELP,
                vec![label("result", "rejected_not_alive")],
                &s.external.reports_rejected_not_alive,
            ),
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
            let up = n.status == NodeStatus::Alive;
            if up {
                alive += 1;
            } else {
                expired += 1;
            }
            out.push(MetricSample::gauge(
                names::MASTER_NODE_UP,
                names::MASTER_NODE_UP_HELP,
                vec![node.clone()],
                u64::from(up),
            ));
            // An expired node's capacity is not in the pool any more: not exported (the last
            // reading leaves the output with the exporter's gauge idle timeout). Its heartbeat age
            // keeps growing, so a panel shows how long it has been gone.
            if up {
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

#[cfg(test)]
mod tests {
    use umbp_core::TierType;

    use super::*;
    use crate::store::{InMemoryStore, Registration, TierCap};

    fn find<'a>(samples: &'a [MetricSample], name: &str, node: &str) -> Vec<&'a MetricSample> {
        samples.iter().filter(|s| s.name == name && s.labels.iter().any(|(k, v)| k == "node" && v == node)).collect()
    }

    /// An expired node is `node_up 0`, keeps its growing heartbeat age and exports no capacity; an
    /// alive one is `node_up 1` with its capacity.
    #[test]
    fn expired_nodes_are_down_keep_their_heartbeat_age_and_lose_their_capacity() {
        let store = Arc::new(InMemoryStore::new());
        let now = now_ms();
        for (id, at) in [("live", now), ("gone", now - 60_000)] {
            let reg = Registration {
                node_id: id.to_owned(),
                node_address: "127.0.0.1".to_owned(),
                peer_address: format!("{id}:7000"),
                data_endpoint: format!("{id}:7001"),
                tier_capacities: vec![TierCap::new(TierType::Dram, 1 << 30, 1 << 29)],
                tags: Vec::new(),
                incarnation: 0,
            };
            store.register(reg, at, 30_000).expect("register");
        }
        assert_eq!(store.expire_stale(now - 30_000).expect("expire"), vec!["gone".to_owned()]);
        let metrics = ClusterMetrics {
            store: store as Arc<dyn MetadataStore>,
            stats: Arc::new(ServiceStats::default()),
            eviction: Arc::new(EvictionStats::default()),
        };
        let samples = metrics.sample_metrics();
        let up = |node| find(&samples, names::MASTER_NODE_UP, node).iter().map(|s| s.value).collect::<Vec<_>>();
        assert_eq!(up("live"), [1]);
        assert_eq!(up("gone"), [0]);
        let age = find(&samples, names::MASTER_HEARTBEAT_AGE_SECONDS, "gone");
        assert_eq!(age.len(), 1);
        assert!(age[0].value >= 60_000, "{:?}", age[0]);
        assert!(find(&samples, names::MASTER_CAPACITY_TOTAL_BYTES, "gone").is_empty());
        assert!(find(&samples, names::MASTER_CAPACITY_AVAILABLE_BYTES, "gone").is_empty());
        assert_eq!(find(&samples, names::MASTER_CAPACITY_TOTAL_BYTES, "live").len(), 1);
    }

    /// On-demand evictions are a series of their own, beside the background rounds.
    #[test]
    fn on_demand_evictions_are_counted_apart_from_rounds() {
        let eviction = Arc::new(EvictionStats::default());
        eviction.on_demand.fetch_add(3, std::sync::atomic::Ordering::Relaxed);
        let metrics = ClusterMetrics {
            store: Arc::new(InMemoryStore::new()) as Arc<dyn MetadataStore>,
            stats: Arc::new(ServiceStats::default()),
            eviction,
        };
        let samples = metrics.sample_metrics();
        let value = |name| samples.iter().find(|s| s.name == name).map(|s| s.value);
        assert_eq!(value(names::MASTER_ON_DEMAND_EVICTIONS_TOTAL), Some(3));
        assert_eq!(value(names::MASTER_EVICTION_ROUNDS_TOTAL), Some(0));
    }
}
