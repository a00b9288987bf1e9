//! The per-process Prometheus endpoint: a recorder of its own, the sources it samples, the publish
//! loop and a minimal HTTP server for `GET /metrics`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};
use metrics_util::MetricKindMask;
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use umbp_core::{MediumBackend, MetricSource};

use crate::names;
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

impl MetricsError {
    /// What the caller should do next: an address that cannot be bound is
    /// [`Unavailable`](umbp_core::ErrorKind::Unavailable) (free it, or pick another).
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::Bind { .. } => umbp_core::ErrorKind::Unavailable,
        }
    }
}

/// Settings of a metrics endpoint. Labels stamped on every series belong to the exporter
/// ([`MetricsExporter::new`]), not to the endpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsConfig {
    /// Where `/metrics` is served; port 0 picks a free one. Default: `127.0.0.1:9091`.
    pub listen: SocketAddr,
    /// How often every source is sampled between scrapes (a scrape also samples). Default: 1 s.
    pub interval: Duration,
    /// Connections served at once; one beyond them is closed at once and counted in
    /// [`names::METRICS_REFUSED_CONNECTIONS_TOTAL`]. Default: 8 (at least 1).
    pub max_connections: usize,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9091)),
            interval: Duration::from_secs(1),
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
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

    /// Serves at most `max` connections at once.
    pub fn with_max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }
}

/// Connections the endpoint serves at once by default: Prometheus holds one per scrape.
pub const DEFAULT_MAX_CONNECTIONS: usize = 8;

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
    /// The latest scrape render and when it finished: one render at a time, shared by the scrapes
    /// that arrived while it ran.
    last_render: tokio::sync::Mutex<Option<(Instant, Arc<str>)>>,
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
            last_render: tokio::sync::Mutex::new(None),
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
        let text = self.recorder.handle().render();
        self.publisher.lock().retype_scaled_counters(text)
    }

    /// [`render`](Self::render) for a scrape, single-flight: one render runs at a time (on the
    /// blocking pool), and a scrape that arrived while one ran waits for it and serves its text
    /// instead of rendering again, so a burst of scrapes costs one render and one blocking thread.
    pub async fn render_shared(self: &Arc<Self>) -> Option<Arc<str>> {
        let arrived = Instant::now();
        let mut last = self.last_render.lock().await;
        if let Some((done, text)) = last.as_ref()
            && *done >= arrived
        {
            return Some(Arc::clone(text));
        }
        let e = Arc::clone(self);
        let text: Arc<str> = tokio::task::spawn_blocking(move || e.render()).await.ok()?.into();
        *last = Some((Instant::now(), Arc::clone(&text)));
        Some(text)
    }

    /// Counts a connection the endpoint closed unserved (over its connection limit).
    fn count_refused(&self) {
        let key = metrics::Key::from_static_name(names::METRICS_REFUSED_CONNECTIONS_TOTAL);
        metrics::Recorder::register_counter(&self.recorder, &key, &metadata()).increment(1);
    }

    /// Makes the refusal counter exist (at 0) before the first refusal.
    fn describe_endpoint(&self) {
        use metrics::Recorder;
        self.recorder.describe_counter(
            names::METRICS_REFUSED_CONNECTIONS_TOTAL.into(),
            None,
            names::METRICS_REFUSED_CONNECTIONS_TOTAL_HELP.into(),
        );
        let key = metrics::Key::from_static_name(names::METRICS_REFUSED_CONNECTIONS_TOTAL);
        self.recorder.register_counter(&key, &metadata()).increment(0);
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
        exporter.describe_endpoint();
        let permits = Arc::new(Semaphore::new(config.max_connections.max(1)));
        let server = {
            let exporter = Arc::clone(&exporter);
            tokio::spawn(async move {
                let mut last_warn: Option<Instant> = None;
                loop {
                    match listener.accept().await {
                        Ok((stream, _)) => match Arc::clone(&permits).try_acquire_owned() {
                            Ok(permit) => {
                                let exporter = Arc::clone(&exporter);
                                tokio::spawn(async move {
                                    answer(stream, exporter).await;
                                    drop(permit);
                                });
                            }
                            // Over the limit: close at once (dropping the stream), count it.
                            Err(_) => {
                                drop(stream);
                                exporter.count_refused();
                            }
                        },
                        // Out of descriptors and the like: back off instead of spinning; say so at
                        // most once a second.
                        Err(e) => {
                            if last_warn.is_none_or(|t| t.elapsed() >= ACCEPT_WARN_EVERY) {
                                last_warn = Some(Instant::now());
                                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                            } else {
                                tracing::debug!(error = %e, "metrics endpoint: accept failed");
                            }
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

fn metadata() -> metrics::Metadata<'static> {
    metrics::Metadata::new("umbp", metrics::Level::INFO, Some(module_path!()))
}

/// The largest request head read: a scrape's is a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;
/// How long a client may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client may take to take the reply.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// The least time between two accept-failure warnings.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(1);

/// How reading a request head ended.
enum Head {
    /// The head, through its blank line.
    Complete,
    /// Larger than [`MAX_REQUEST`] with no end in sight.
    TooLarge,
    /// Closed, failed or too slow.
    Gone,
}

/// Answers one HTTP/1.x request on `stream`, then closes it. Only `GET /metrics` (any query string)
/// is served; the peer's bytes are only searched for the end of the head and the request line.
async fn answer(mut stream: TcpStream, exporter: Arc<MetricsExporter>) {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(REQUEST_TIMEOUT, async {
        loop {
            if head.windows(4).any(|w| w == b"\r\n\r\n") {
                return Head::Complete;
            }
            if head.len() >= MAX_REQUEST {
                return Head::TooLarge;
            }
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return Head::Gone,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    let (status, content_type, body): (&str, &str, Arc<str>) = match read {
        Ok(Head::Complete) => {
            let line = head.split(|b| *b == b'\r').next().unwrap_or_default();
            let mut parts = line.split(|b| *b == b' ');
            let (method, target) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
            let path = target.split(|b| *b == b'?').next().unwrap_or_default();
            match (method, path) {
                (b"GET", b"/metrics") => match exporter.render_shared().await {
                    Some(body) => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body),
                    None => ("500 Internal Server Error", "text/plain", "rendering failed\n".into()),
                },
                (b"GET", _) => ("404 Not Found", "text/plain", "umbp: metrics are at /metrics\n".into()),
                _ => ("405 Method Not Allowed", "text/plain", "only GET is served\n".into()),
            }
        }
        Ok(Head::TooLarge) => ("431 Request Header Fields Too Large", "text/plain", "request head too large\n".into()),
        Ok(Head::Gone) | Err(_) => return,
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // A client that does not take the reply is dropped after WRITE_TIMEOUT, giving its permit back.
    let _ = tokio::time::timeout(WRITE_TIMEOUT, async {
        if stream.write_all(reply.as_bytes()).await.is_ok() && stream.write_all(body.as_bytes()).await.is_ok() {
            let _ = stream.shutdown().await;
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_failure_is_unavailable_and_keeps_its_cause() {
        let err = MetricsError::Bind {
            addr: SocketAddr::from(([127, 0, 0, 1], 9091)),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        };
        assert_eq!(err.kind(), umbp_core::ErrorKind::Unavailable);
        assert!(std::error::Error::source(&err).is_some());
    }
}
