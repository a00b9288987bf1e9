//! What the client side of a node did, as metric samples for its `/metrics` endpoint.

use std::sync::Arc;

use umbp_core::{MetricSample, MetricSource};
use umbp_metrics::names;

use super::support::StatCounters;

/// The client counters of [`PoolClientStats`](super::PoolClientStats), as `umbp_client_*` series.
pub(super) struct ClientMetrics(pub(super) Arc<StatCounters>);

impl MetricSource for ClientMetrics {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let s = self.0.snapshot();
        let result = |r: &str| vec![("result".to_owned(), r.to_owned())];
        vec![
            MetricSample::counter(names::CLIENT_REROUTES_TOTAL, names::CLIENT_REROUTES_TOTAL_HELP, vec![], s.reroutes),
            MetricSample::counter(
                names::CLIENT_LEASE_LAPSES_TOTAL,
                names::CLIENT_LEASE_LAPSES_TOTAL_HELP,
                vec![],
                s.lease_lapses,
            ),
            MetricSample::counter(
                names::CLIENT_CHECKSUM_FAILURES_TOTAL,
                names::CLIENT_CHECKSUM_FAILURES_TOTAL_HELP,
                vec![],
                s.checksum_failures,
            ),
            MetricSample::counter(
                names::CLIENT_SLOT_EXPIRIES_TOTAL,
                names::CLIENT_SLOT_EXPIRIES_TOTAL_HELP,
                vec![],
                s.slot_expiries,
            ),
            MetricSample::counter(
                names::CLIENT_RECACHE_TOTAL,
                names::CLIENT_RECACHE_TOTAL_HELP,
                result("queued"),
                s.recache_queued,
            ),
            MetricSample::counter(
                names::CLIENT_RECACHE_TOTAL,
                names::CLIENT_RECACHE_TOTAL_HELP,
                result("dropped"),
                s.recache_dropped,
            ),
            MetricSample::counter(
                names::CLIENT_RECACHE_TOTAL,
                names::CLIENT_RECACHE_TOTAL_HELP,
                result("stored"),
                s.recache_stored,
            ),
        ]
    }
}
