//! Observability for umbp-rs: every medium charted by its `tier=` label, with no metrics code in the
//! medium.
//!
//! # Owns
//! - [`InstrumentedBackend`], the decorator the composition root wraps around the node's medium. It
//!   derives the generic series — entries by op and status, batches, bytes committed / resolved /
//!   freed, time inside the medium — from the [`MediumBackend`](umbp_core::MediumBackend) calls
//!   themselves.
//! - [`names`]: every series name umbp-rs exports (the medium-internal and transfer names are
//!   re-exported from `umbp_core::metric_names`, where a medium crate can reach them).
//! - [`MetricPublisher`], which turns [`MetricSource`](umbp_core::MetricSource) samples into
//!   `metrics`-crate series (counters as deltas, gauges as readings), stamping `tier=` and
//!   `backend=` itself.
//! - [`MetricsExporter`] and [`MetricsServer`]: a process's own Prometheus recorder (never the global
//!   one, so several nodes and a master can share a process, as in tests and `umbp demo`), its
//!   sources, a publish loop and a minimal `GET /metrics` HTTP endpoint.
//! - The Grafana dashboard ([`DASHBOARD_JSON`], `dashboards/umbp.json`) and its provisioning example.
//!
//! # Never
//! Is depended on by a medium crate (the layering check forbids it): a medium publishes
//! medium-internal state through `MetricSource::sample_metrics` under the generic
//! `umbp_backend_medium_*` names and puts its specifics in a label. It never names a concrete medium
//! or engine, and never installs a global recorder.
//!
//! # Why our own HTTP endpoint
//! `metrics-exporter-prometheus`'s listener cannot report the port it bound for port 0 and cannot
//! sample the sources when a scrape arrives; ours does both in a page over tokio, so the
//! exporter's crate is used without default features (its push gateway pulls a C crypto build). It
//! serves at most [`MetricsConfig::max_connections`] connections at once (closing the others at once
//! and counting them), renders single-flight on the blocking pool (a scrape burst costs one render),
//! and gives a client 5 s to send its request and 10 s to take the reply.
#![forbid(unsafe_code)]

mod exporter;
mod instrumented;
pub mod names;
mod publisher;

pub use exporter::{DEFAULT_MAX_CONNECTIONS, MetricsConfig, MetricsError, MetricsExporter, MetricsServer};
pub use instrumented::{InstrumentedBackend, Op, OpCounts, Status};
pub use publisher::{Labels, MetricPublisher};

/// The Grafana dashboard (`dashboards/umbp.json`): fleet, every medium by `tier=`, transfer engines.
pub const DASHBOARD_JSON: &str = include_str!("../dashboards/umbp.json");
