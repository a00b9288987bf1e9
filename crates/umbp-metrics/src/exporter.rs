//! The per-process Prometheus endpoint: a recorder of its own, the sources it samples, the publish
//! loop and a minimal HTTP server for `GET /metrics`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use metrics_util::MetricKindMask;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use umbp_core::{MediumBackend, MetricSource};

use crate::publisher::{Labels, MetricPublisher};

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetricsError {
    /// The listen address could not be bound.
    #[error("binding the metrics endpoint on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Settings of a metrics endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsConfig {
    /// Where `/metrics` is served; port 0 picks a free one. Default: `127.0.0.1:9091`.
    pub listen: SocketAddr,
    /// How often every source is sampled between scrapes (a scrape also samples). Default: 1 s.
    pub interval: Duration,
    /// Labels stamped on every series of the process (a node stamps `node=`). Default: none.
    pub labels: Labels,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { listen: SocketAddr::from(([127, 0, 0, 1], 9091)), interval: Duration::from_secs(1), labels: Vec::new() }
    }
}

impl MetricsConfig {
    /// Defaults, serving on `listen`.
    pub fn new(listen: SocketAddr) -> Self {
        Self { listen, ..Self::default() }
    }

    /// Samples every `interval` between scrapes.
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = interval;
        self
    }

    /// Stamps `key=value` on every series.
    pub fn with_label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.push((key.into(), value.into()));
        self
    }
}

struct Source {
    id: String,
    labels: Labels,
    source: Arc<dyn MetricSource + Send + Sync>,
}

/// The series of one process: a Prometheus recorder of its own (never the global one, so several
/// nodes and a master can share a process and each export only its own series) and the sources it
/// samples.
pub struct MetricsExporter {
    recorder: PrometheusRecorder,
    sources: Mutex<Vec<Source>>,
    publisher: Mutex<MetricPublisher>,
}

impl std::fmt::Debug for MetricsExporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsExporter").field("sources", &self.sources.lock().len()).finish_non_exhaustive()
    }
}

impl MetricsExporter {
    /// An exporter stamping `labels` on every series. A gauge not published for `gauge_idle` (its
    /// source went away: an expired node, a dropped medium) disappears from the output.
    pub fn new(labels: &[(String, String)], gauge_idle: Duration) -> Self {
        let mut builder = PrometheusBuilder::new().idle_timeout(MetricKindMask::GAUGE, Some(gauge_idle));
        for (k, v) in labels {
            builder = builder.add_global_label(k.clone(), v.clone());
        }
        Self {
            recorder: builder.build_recorder(),
            sources: Mutex::new(Vec::new()),
            publisher: Mutex::new(MetricPublisher::new()),
        }
    }

    /// Samples `source` at every publish, stamping `labels` on its series. `id` keeps the counter
    /// baselines of two sources apart.
    pub fn add_source(&self, id: impl Into<String>, labels: Labels, source: Arc<dyn MetricSource + Send + Sync>) {
        self.sources.lock().push(Source { id: id.into(), labels, source });
    }

    /// Samples a medium under `tier=` and `backend=` (its [`MediumBackend::name`]).
    pub fn add_backend(&self, backend: &Arc<dyn MediumBackend>) {
        let name = backend.name().to_owned();
        let labels =
            vec![("tier".to_owned(), backend.tier().as_str().to_owned()), ("backend".to_owned(), name.clone())];
        let source: Arc<dyn MetricSource + Send + Sync> = Arc::clone(backend) as Arc<dyn MetricSource + Send + Sync>;
        self.add_source(format!("backend:{name}"), labels, source);
    }

    /// Samples every source now and updates the series. Blocking (a source may take a lock or walk
    /// an index): call it off an async worker.
    pub fn publish(&self) {
        let sources: Vec<(String, Labels, Arc<dyn MetricSource + Send + Sync>)> =
            self.sources.lock().iter().map(|s| (s.id.clone(), s.labels.clone(), Arc::clone(&s.source))).collect();
        let mut publisher = self.publisher.lock();
        for (id, labels, source) in sources {
            publisher.publish(&id, &labels, source.sample_metrics(), &self.recorder);
        }
    }

    /// Publishes, then renders every series in the Prometheus text format.
    pub fn render(&self) -> String {
        self.publish();
        self.recorder.handle().render()
    }

    /// The recorder (for tests that check series without HTTP).
    pub fn recorder(&self) -> &PrometheusRecorder {
        &self.recorder
    }
}

/// A running `/metrics` endpoint. Dropping it stops the server and the publish loop.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    exporter: Arc<MetricsExporter>,
    tasks: Vec<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `config.listen` and serves `exporter` on the current tokio runtime; samples every
    /// `config.interval` and on every scrape.
    pub async fn start(exporter: Arc<MetricsExporter>, config: &MetricsConfig) -> Result<Self, MetricsError> {
        let bind = |source| MetricsError::Bind { addr: config.listen, source };
        let listener = TcpListener::bind(config.listen).await.map_err(bind)?;
        let addr = listener.local_addr().map_err(bind)?;
        let interval = config.interval.max(Duration::from_millis(10));
        let ticker = {
            let exporter = Arc::clone(&exporter);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(interval).await;
                    let e = Arc::clone(&exporter);
                    if tokio::task::spawn_blocking(move || e.publish()).await.is_err() {
                        return;
                    }
                }
            })
        };
        let server = {
            let exporter = Arc::clone(&exporter);
            tokio::spawn(async move {
                loop {
                    match listener.accept().await {
                        Ok((stream, _)) => {
                            tokio::spawn(answer(stream, Arc::clone(&exporter)));
                        }
                        // Out of descriptors and the like: back off instead of spinning.
                        Err(e) => {
                            tracing::debug!(error = %e, "metrics endpoint: accept failed");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            })
        };
        tracing::info!(%addr, "metrics endpoint listening (GET /metrics)");
        Ok(Self { addr, exporter, tasks: vec![ticker, server] })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The exporter it serves.
    pub fn exporter(&self) -> &Arc<MetricsExporter> {
        &self.exporter
    }

    /// Stops serving.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The largest request head read: a scrape's is a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;
/// How long a client may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers one HTTP/1.x request on `stream`, then closes it. Only `GET /metrics` (any query string)
/// is served; the peer's bytes are only searched for the end of the head and the request line.
async fn answer(mut stream: TcpStream, exporter: Arc<MetricsExporter>) {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(REQUEST_TIMEOUT, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        true
    })
    .await;
    if !matches!(read, Ok(true)) {
        return;
    }
    let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|b| *b == b' ');
    let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let path = target.split(|b| *b == b'?').next().unwrap_or_default();
    let (status, content_type, body) = match (method, path) {
        (b"GET", b"/metrics") => {
            let e = Arc::clone(&exporter);
            match tokio::task::spawn_blocking(move || e.render()).await {
                Ok(body) => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body),
                Err(_) => ("500 Internal Server Error", "text/plain", "rendering failed\n".to_owned()),
            }
        }
        (b"GET", _) => ("404 Not Found", "text/plain", "umbp: metrics are at /metrics\n".to_owned()),
        _ => ("405 Method Not Allowed", "text/plain", "only GET is served\n".to_owned()),
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if stream.write_all(reply.as_bytes()).await.is_ok() && stream.write_all(body.as_bytes()).await.is_ok() {
        let _ = stream.shutdown().await;
    }
}
