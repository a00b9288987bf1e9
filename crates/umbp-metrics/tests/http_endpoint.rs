//! The `/metrics` endpoint over real HTTP: a plain `TcpStream` GET, as `curl` would send.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use umbp_core::{AllocateRequest, MediumBackend, TierType};
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
