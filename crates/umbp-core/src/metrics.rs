//! The metric seam: components expose samples; a publisher outside them ships them.

/// Generic series a medium may publish from [`MetricSource::sample_metrics`]. A medium puts its
/// specifics in a label (`event=…`, `state=…`), never in the name, so one dashboard charts every
/// medium by its `tier=` label.
pub mod names {
    /// Counter of medium-internal events, by `event=`.
    pub const MEDIUM_EVENTS_TOTAL: &str = "umbp_backend_medium_events_total";
    /// Help text of [`MEDIUM_EVENTS_TOTAL`].
    pub const MEDIUM_EVENTS_TOTAL_HELP: &str = "Medium-internal events, by event.";
    /// Counter of medium-internal bytes (device traffic), by `event=`.
    pub const MEDIUM_BYTES_TOTAL: &str = "umbp_backend_medium_bytes_total";
    /// Help text of [`MEDIUM_BYTES_TOTAL`].
    pub const MEDIUM_BYTES_TOTAL_HELP: &str = "Medium-internal bytes moved, by event.";
    /// Gauge of medium-internal state, by `state=`.
    pub const MEDIUM_STATE: &str = "umbp_backend_medium_state";
    /// Help text of [`MEDIUM_STATE`].
    pub const MEDIUM_STATE_HELP: &str = "Medium-internal state, by state.";

    /// Counter of transfer plans by `engine=`, `direction=` and `status=` (`ok`, `failed`; and
    /// `engine="none", direction="none", status="rejected"` for items no engine would take).
    pub const TRANSFER_OPS_TOTAL: &str = "umbp_transfer_ops_total";
    /// Help text of [`TRANSFER_OPS_TOTAL`].
    pub const TRANSFER_OPS_TOTAL_HELP: &str = "Transfer plans by engine, direction and status.";
    /// Counter of bytes moved by `engine=` and `direction=`.
    pub const TRANSFER_BYTES_TOTAL: &str = "umbp_transfer_bytes_total";
    /// Help text of [`TRANSFER_BYTES_TOTAL`].
    pub const TRANSFER_BYTES_TOTAL_HELP: &str = "Bytes moved by successful transfer plans, by engine and direction.";
    /// Counter of seconds from submit to completion, by `engine=` and `direction=`.
    pub const TRANSFER_SECONDS_TOTAL: &str = "umbp_transfer_seconds_total";
    /// Help text of [`TRANSFER_SECONDS_TOTAL`].
    pub const TRANSFER_SECONDS_TOTAL_HELP: &str =
        "Seconds from submit to completion of transfer plans, by engine and direction.";

    /// Counter of connections a TCP engine opened to peers.
    pub const TRANSFER_TCP_CONNECTIONS_OPENED_TOTAL: &str = "umbp_transfer_tcp_connections_opened_total";
    /// Help text of [`TRANSFER_TCP_CONNECTIONS_OPENED_TOTAL`].
    pub const TRANSFER_TCP_CONNECTIONS_OPENED_TOTAL_HELP: &str = "Connections this TCP engine opened to peers.";
    /// Counter of a TCP engine's failed connection attempts, by `reason=`.
    pub const TRANSFER_TCP_CONNECT_FAILURES_TOTAL: &str = "umbp_transfer_tcp_connect_failures_total";
    /// Help text of [`TRANSFER_TCP_CONNECT_FAILURES_TOTAL`].
    pub const TRANSFER_TCP_CONNECT_FAILURES_TOTAL_HELP: &str =
        "Failed connection attempts of this TCP engine, by reason.";
    /// Counter of requests the TCP data server served, by `status=`.
    pub const TRANSFER_TCP_SERVER_REQUESTS_TOTAL: &str = "umbp_transfer_tcp_server_requests_total";
    /// Help text of [`TRANSFER_TCP_SERVER_REQUESTS_TOTAL`].
    pub const TRANSFER_TCP_SERVER_REQUESTS_TOTAL_HELP: &str = "Requests served by the TCP data server, by status.";
    /// Gauge of connections open on the TCP data server.
    pub const TRANSFER_TCP_SERVER_CONNECTIONS: &str = "umbp_transfer_tcp_server_connections";
    /// Help text of [`TRANSFER_TCP_SERVER_CONNECTIONS`].
    pub const TRANSFER_TCP_SERVER_CONNECTIONS_HELP: &str = "Connections open on the TCP data server.";
    /// Counter of connections the TCP data server refused or closed, by `reason=`.
    pub const TRANSFER_TCP_SERVER_REFUSED_TOTAL: &str = "umbp_transfer_tcp_server_connections_refused_total";
    /// Help text of [`TRANSFER_TCP_SERVER_REFUSED_TOTAL`].
    pub const TRANSFER_TCP_SERVER_REFUSED_TOTAL_HELP: &str =
        "Connections refused or closed by the TCP data server, by reason.";
    /// Counter of bytes of GPU regions the TCP data server moved through host staging.
    pub const TRANSFER_TCP_SERVER_GPU_STAGED_BYTES_TOTAL: &str = "umbp_transfer_tcp_server_gpu_staged_bytes_total";
    /// Help text of [`TRANSFER_TCP_SERVER_GPU_STAGED_BYTES_TOTAL`].
    pub const TRANSFER_TCP_SERVER_GPU_STAGED_BYTES_TOTAL_HELP: &str =
        "Bytes of GPU regions the TCP data server moved between the socket and device memory through host staging.";

    /// Every `umbp_transfer_tcp_*` series name, for checks that a TCP engine publishes nothing else.
    pub const TRANSFER_TCP_ALL: [&str; 6] = [
        TRANSFER_TCP_CONNECTIONS_OPENED_TOTAL,
        TRANSFER_TCP_CONNECT_FAILURES_TOTAL,
        TRANSFER_TCP_SERVER_REQUESTS_TOTAL,
        TRANSFER_TCP_SERVER_CONNECTIONS,
        TRANSFER_TCP_SERVER_REFUSED_TOTAL,
        TRANSFER_TCP_SERVER_GPU_STAGED_BYTES_TOTAL,
    ];
}

/// Counter or gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MetricKind {
    /// Monotonic; the publisher ships the increase since the last sample (after a decrease, a restart
    /// of the count, the new value whole).
    #[default]
    Counter,
    /// A reading, shipped as-is every tick.
    Gauge,
}

/// One reading of one series.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricSample {
    /// The generic series name (for a medium: one of the `umbp_backend_medium_*` names, never a name
    /// carrying the medium).
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// Labels specific to the sample (`event=…`, `state=…`). `tier=` and `backend=` are stamped by
    /// the publisher; a source never sets them.
    pub labels: Vec<(String, String)>,
    /// The raw value.
    pub value: u64,
    /// Counter or gauge.
    pub kind: MetricKind,
    /// Factor applied to the value when shipped (1e-9 turns nanoseconds into seconds).
    pub scale: f64,
}

impl MetricSample {
    /// A counter sample with scale 1.
    pub fn counter(name: &'static str, help: &'static str, labels: Vec<(String, String)>, value: u64) -> Self {
        Self { name, help, labels, value, kind: MetricKind::Counter, scale: 1.0 }
    }

    /// A gauge sample with scale 1.
    pub fn gauge(name: &'static str, help: &'static str, labels: Vec<(String, String)>, value: u64) -> Self {
        Self { name, help, labels, value, kind: MetricKind::Gauge, scale: 1.0 }
    }
}

/// A component that can report state its interface cannot show from outside.
///
/// Called by the publisher, never under a component lock. The default reports nothing.
pub trait MetricSource {
    /// The current samples.
    fn sample_metrics(&self) -> Vec<MetricSample> {
        Vec::new()
    }
}
