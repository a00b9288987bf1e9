//! Observability for umbp-rs: every medium charted by its `tier=` label, with no metrics code in the
//! medium.
//!
//! ```
//! use std::io::{Read as _, Write as _};
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use umbp_core::MediumBackend;
//! use umbp_metrics::{InstrumentedBackend, MetricsConfig, MetricsExporter, MetricsServer};
//! use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = tokio::runtime::Runtime::new()?;
//! runtime.block_on(async {
//!     // The composition root wraps whatever medium the node lends; the medium has no metrics code.
//!     let medium = InstrumentedBackend::wrap(Arc::new(MockBackend::new(MockConfig::default())));
//!     medium.init(Arc::new(LocalOnlyRegistrar::new()))?;
//!     let labels = [("node".to_owned(), "node-1".to_owned())];
//!     let exporter = Arc::new(MetricsExporter::new(&labels, Duration::from_secs(30)));
//!     exporter.add_backend(&medium);
//!     // Port 0 picks a free port; the server says which.
//!     let server = MetricsServer::start(exporter, &MetricsConfig::new("127.0.0.1:0".parse()?)).await?;
//!     let addr = server.local_addr();
//!     let scrape = tokio::task::spawn_blocking(move || -> std::io::Result<String> {
//!         let mut conn = std::net::TcpStream::connect(addr)?;
//!         conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
//!         let mut reply = String::new();
//!         conn.read_to_string(&mut reply)?;
//!         Ok(reply)
//!     });
//!     let reply = scrape.await??;
//!     assert!(reply.starts_with("HTTP/1.1 200"));
//!     assert!(reply.lines().any(|l| l.starts_with("umbp_backend_") && l.contains(r#"tier="DRAM""#)));
//!     server.shutdown();
//!     Ok(())
//! })
//! # }
//! ```
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
