//! The `/metrics` endpoint over real HTTP: a plain `TcpStream` GET, as `curl` would send, and the
//! clients it must survive (slow, silent, too many, oversized, not GET). Every server binds loopback;
//! every client read is bounded by a timeout.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use umbp_core::{AllocateRequest, MediumBackend, MetricSample, MetricSource, TierType};
use umbp_metrics::{InstrumentedBackend, MetricsConfig, MetricsExporter, MetricsServer, names};
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

fn get(addr: SocketAddr, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: curl/8\r\nAccept: */*\r\n\r\n").expect("send");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("read");
    let (head, body) = reply.split_once("\r\n\r\n").expect("head and body");
    (head.lines().next().unwrap_or_default().to_owned(), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_metrics_serves_fresh_series_and_refuses_other_paths() {
    let medium: Arc<dyn MediumBackend> = InstrumentedBackend::wrap(Arc::new(MockBackend::new(MockConfig {
        tier: TierType::Hbm,
        ..MockConfig::default()
    })));
    medium.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    let exporter = Arc::new(MetricsExporter::new(&[("node".into(), "n1".into())], Duration::from_secs(60)));
    exporter.add_backend(&medium);
    // A long interval: only the scrape itself can have published what the test reads.
    let config = MetricsConfig::new("127.0.0.1:0".parse().expect("addr")).with_interval(Duration::from_secs(3600));
    let server = MetricsServer::start(Arc::clone(&exporter), &config).await.expect("start");
    let addr = server.local_addr();
    assert_ne!(addr.port(), 0);

    medium.batch_allocate(&[AllocateRequest::new("k", 4096)]);
    let (status, body) = tokio::task::spawn_blocking(move || get(addr, "/metrics")).await.expect("get");
    assert_eq!(status, "HTTP/1.1 200 OK");
    let line = body
        .lines()
        .find(|l| l.starts_with(names::OPS_TOTAL) && l.contains("op=\"allocate\""))
        .unwrap_or_else(|| panic!("no allocate series in\n{body}"));
    for label in ["node=\"n1\"", "tier=\"HBM\"", "backend=\"MockBackend\"", "status=\"ok\""] {
        assert!(line.contains(label), "{label} missing from {line}");
    }
    assert!(line.ends_with(" 1"), "{line}");

    let (status, _) = tokio::task::spawn_blocking(move || get(addr, "/")).await.expect("get");
    assert!(status.contains("404"), "{status}");
    server.shutdown();
}

/// A source whose sampling takes `delay` and is counted: a render's cost made visible.
struct SlowSource {
    delay: Duration,
    samples: AtomicUsize,
}

impl MetricSource for SlowSource {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        self.samples.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        vec![MetricSample::gauge(names::MASTER_KEYS, names::MASTER_KEYS_HELP, Vec::new(), 7)]
    }
}

/// An endpoint on a free loopback port serving `source` (never sampled but by a scrape).
async fn serve(source: Arc<SlowSource>, max_connections: usize) -> MetricsServer {
    let exporter = Arc::new(MetricsExporter::new(&[], Duration::from_secs(60)));
    exporter.add_source("slow", Vec::new(), source);
    let config = MetricsConfig::new("127.0.0.1:0".parse().expect("addr"))
        .with_interval(Duration::from_secs(3600))
        .with_max_connections(max_connections);
    MetricsServer::start(exporter, &config).await.expect("start")
}

fn slow(delay: Duration) -> Arc<SlowSource> {
    Arc::new(SlowSource { delay, samples: AtomicUsize::new(0) })
}

/// Sends `request` raw and returns whatever comes back before the server closes (empty when it
/// closed or reset without a reply). Bounded by a 5 s read timeout.
fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let _ = s.write_all(request);
    let mut reply = Vec::new();
    match s.read_to_end(&mut reply) {
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => panic!("no answer in 5 s"),
        _ => String::from_utf8_lossy(&reply).into_owned(),
    }
}

/// A scrape that must succeed within `within`, retried while the endpoint closes it unserved.
fn scrape_within(addr: SocketAddr, within: Duration) -> String {
    let start = Instant::now();
    loop {
        let reply = raw(addr, format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes());
        if reply.starts_with("HTTP/1.1 200 OK") {
            return reply;
        }
        assert!(start.elapsed() < within, "no successful scrape within {within:?}: {reply:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_do_not_block_a_scrape() {
    let server = serve(slow(Duration::ZERO), 8).await;
    let addr = server.local_addr();
    tokio::task::spawn_blocking(move || {
        // One never finishes its request, one sends a request and never reads, one sends nothing.
        let mut unfinished = TcpStream::connect(addr).expect("connect");
        unfinished.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").expect("send");
        let mut unread = TcpStream::connect(addr).expect("connect");
        unread.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").expect("send");
        let silent = TcpStream::connect(addr).expect("connect");
        let start = Instant::now();
        let reply = scrape_within(addr, Duration::from_secs(3));
        // Well inside the 5 s request timeout: the good scrape waited for none of them.
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
        assert!(reply.contains("umbp_master_keys 7"), "{reply}");
        drop((unfinished, unread, silent));
    })
    .await
    .expect("clients");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_limit_are_closed_at_once_and_counted() {
    let server = serve(slow(Duration::ZERO), 2).await;
    let addr = server.local_addr();
    tokio::task::spawn_blocking(move || {
        // Two stalled clients hold both permits.
        let stalled: Vec<TcpStream> = (0..2)
            .map(|_| {
                let mut s = TcpStream::connect(addr).expect("connect");
                s.write_all(b"GET /metrics HTTP/1.1\r\n").expect("send");
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        // The third is closed unserved, at once (not after the 5 s request timeout).
        let start = Instant::now();
        let reply = raw(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
        assert_eq!(reply, "", "served over the limit");
        assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
        // Once the stalled clients leave, a scrape succeeds and shows the refusal.
        drop(stalled);
        let reply = scrape_within(addr, Duration::from_secs(3));
        let line = reply
            .lines()
            .find(|l| l.starts_with(names::METRICS_REFUSED_CONNECTIONS_TOTAL))
            .unwrap_or_else(|| panic!("no refusal counter in\n{reply}"));
        let refused: u64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("value");
        assert!(refused >= 1, "{line}");
    })
    .await
    .expect("clients");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_heads_and_non_get_requests_are_refused() {
    let server = serve(slow(Duration::ZERO), 8).await;
    let addr = server.local_addr();
    tokio::task::spawn_blocking(move || {
        // A head over 8 KiB with no end: an error or a close, never the metrics.
        let mut huge = b"GET /metrics HTTP/1.1\r\nX-Pad: ".to_vec();
        huge.resize(huge.len() + (16 << 10), b'a');
        let reply = raw(addr, &huge);
        assert!(reply.is_empty() || reply.starts_with("HTTP/1.1 431"), "{reply:?}");
        for request in [&b"POST /metrics HTTP/1.1\r\n\r\n"[..], b"\x00\x01\xff garbage\r\n\r\n", b"\r\n\r\n"] {
            let reply = raw(addr, request);
            assert!(reply.starts_with("HTTP/1.1 405"), "{request:?} -> {reply:?}");
        }
        // The endpoint still serves.
        scrape_within(addr, Duration::from_secs(3));
    })
    .await
    .expect("clients");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_scrapes_share_one_render() {
    let source = slow(Duration::from_millis(300));
    let server = serve(Arc::clone(&source), 8).await;
    let addr = server.local_addr();
    tokio::task::spawn_blocking(move || {
        let scrapes: Vec<_> =
            (0..6).map(|_| std::thread::spawn(move || scrape_within(addr, Duration::from_secs(5)))).collect();
        for s in scrapes {
            let reply = s.join().expect("scrape");
            assert!(reply.contains("umbp_master_keys 7"), "{reply}");
        }
    })
    .await
    .expect("clients");
    // Six scrapes at once, one (or, if one arrived after the first render ended, two) renders.
    let n = source.samples.load(Ordering::SeqCst);
    assert!(n <= 2, "{n} renders for 6 concurrent scrapes");
    server.shutdown();
}

/// `MetricsConfig` has no labels of its own: they belong to `MetricsExporter::new`. (An exhaustive
/// literal: a field added back fails to compile here.)
#[test]
fn metrics_config_carries_no_labels() {
    let MetricsConfig { listen, interval, max_connections } = MetricsConfig::default();
    assert_eq!(listen.ip().to_string(), "127.0.0.1");
    assert_eq!(interval, Duration::from_secs(1));
    assert_eq!(max_connections, umbp_metrics::DEFAULT_MAX_CONNECTIONS);
}
