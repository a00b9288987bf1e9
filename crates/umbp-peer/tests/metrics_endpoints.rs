//! The Prometheus endpoints of a real master and real nodes in one process, scraped over HTTP the way
//! `curl` or Prometheus would, and the Grafana dashboard checked against what they export: every
//! metric name a dashboard query uses must have a running publisher.

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest};
use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::pool_client::{DramConfig, Medium, PoolClient, PoolClientConfig, RecachePolicy, SsdConfig};

const PAGE: u64 = 4096;
/// Short, so an abandoned slot is reaped (a medium-internal event) within the test.
const PENDING_TTL: Duration = Duration::from_millis(300);

fn any_port() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// `GET path` over a plain TCP connection; returns the status line and the body.
async fn http_get(addr: SocketAddr, path: &'static str) -> (String, String) {
    tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: curl/8\r\nAccept: */*\r\n\r\n").expect("send");
        let mut reply = String::new();
        s.read_to_string(&mut reply).expect("read");
        let (head, body) = reply.split_once("\r\n\r\n").expect("head and body");
        (head.lines().next().unwrap_or_default().to_owned(), body.to_owned())
    })
    .await
    .expect("scrape task")
}

async fn scrape(addr: SocketAddr) -> String {
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    body
}

/// The metric names of a Prometheus text exposition.
fn exported_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// Every `umbp_*` identifier in a PromQL expression.
fn promql_names(expr: &str, out: &mut BTreeSet<String>) {
    let mut token = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            token.push(c);
        } else {
            // A label value ("…") or a label name never starts with umbp_ in our dashboard; names do.
            if token.starts_with("umbp_") {
                out.insert(std::mem::take(&mut token));
            }
            token.clear();
        }
    }
}

/// The metric names of every query of the dashboard: panel targets and template variables.
fn dashboard_names() -> BTreeSet<String> {
    fn walk(v: &serde_json::Value, out: &mut BTreeSet<String>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr" | "query" | "definition", serde_json::Value::String(s)) => promql_names(s, out),
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| walk(i, out)),
            _ => {}
        }
    }
    let json: serde_json::Value = serde_json::from_str(umbp_metrics::DASHBOARD_JSON).expect("the dashboard is JSON");
    let mut out = BTreeSet::new();
    walk(&json, &mut out);
    out
}

fn node_config(master: &MasterHandle, id: &str, medium: bool) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, master.local_addr().to_string());
    if medium {
        c = c.with_medium(Medium::Dram(DramConfig {
            capacity_bytes: 256 * PAGE,
            prefault: false,
            ..DramConfig::default()
        }));
    }
    c.page_size = PAGE;
    c.bounce_bytes = 1 << 20;
    c.recache = RecachePolicy::Off;
    c.pending_ttl = PENDING_TTL;
    c.metrics_listen = Some(any_port());
    // The nodes share one host: with the shared-memory path their batches would never open the
    // TCP connections whose series the dashboard charts.
    c.shared_memory = false;
    c
}

struct Cluster {
    master: MasterHandle,
    /// n1, n2 (DRAM), client (no medium), s1 (SSD).
    nodes: Vec<PoolClient>,
    _ssd_dir: tempfile::TempDir,
}

/// A master and two DRAM nodes with metrics endpoints, a client-only node (with one too), and
/// traffic that touches every op: puts across both nodes over TCP, hits and a miss, a remove, an
/// abandoned slot reaped by the medium.
async fn cluster_with_traffic() -> Cluster {
    let master = umbp_master::start(MasterConfig {
        listen: any_port(),
        metrics_listen: Some(any_port()),
        ..MasterConfig::default()
    })
    .await
    .expect("master");
    let mut nodes = Vec::new();
    for (id, medium) in [("n1", true), ("n2", true), ("client", false)] {
        nodes.push(PoolClient::start(node_config(&master, id, medium)).await.expect("node"));
    }
    let client = &nodes[2];
    let keys: Vec<String> = (0..16).map(|i| format!("metrics-key-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..16).map(|i| vec![i as u8; (PAGE as usize) * 2 + 17]).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for r in client.batch_put(&items).await {
        r.expect("put");
    }
    // Wait for the index, then read everything back plus one key nobody has.
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !client.batch_exists(&refs).await.expect("exists").iter().all(|f| *f) {
        assert!(tokio::time::Instant::now() < deadline, "keys never indexed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut bufs: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; PAGE as usize * 3]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for r in client.batch_get(&refs, &mut slices).await {
        r.expect("get");
    }
    let mut miss = vec![0u8; 16];
    assert!(client.get("metrics-no-such-key", &mut miss).await.is_err());
    client.remove(&refs[..2]).await.expect("remove");
    // A writer that never commits: the medium reaps its slot.
    let medium = nodes[0].medium().expect("n1 lends a medium");
    medium.batch_allocate(&[AllocateRequest::new("abandoned", PAGE)]);
    tokio::time::sleep(PENDING_TTL + Duration::from_millis(500)).await;
    master.run_eviction_round().await;

    // A medium another crate wrote, composed in by its match arm alone: an SSD node, joined after
    // the routed traffic (so the puts above stay on DRAM) and driven through its own medium.
    let ssd_dir = tempfile::tempdir().expect("temp dir");
    let mut ssd = node_config(&master, "s1", false).with_medium(Medium::Ssd(SsdConfig {
        dirs: vec![ssd_dir.path().to_owned()],
        capacity_bytes: 64 * PAGE,
        staging_pages: 4,
        ..SsdConfig::default()
    }));
    ssd.pending_ttl = Duration::from_secs(30);
    let s1 = PoolClient::start(ssd).await.expect("ssd node");
    let medium = s1.medium().expect("s1 lends a medium");
    let slot = medium.batch_allocate(&[AllocateRequest::new("on-ssd", PAGE)]);
    assert_eq!(slot[0].outcome, AllocateOutcome::Allocated);
    assert!(medium.batch_commit(&[CommitRequest::new(slot[0].slot_id, "on-ssd")])[0].success);
    assert!(medium.batch_resolve(&["on-ssd".to_owned()], false)[0].found);
    nodes.push(s1);
    Cluster { master, nodes, _ssd_dir: ssd_dir }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_metric_the_dashboard_queries_is_exported_by_a_running_master_or_node() {
    let cluster = cluster_with_traffic().await;
    let mut exported = exported_names(&scrape(cluster.master.metrics_addr().expect("master metrics")).await);
    for node in &cluster.nodes {
        exported.extend(exported_names(&scrape(node.metrics_address().expect("node metrics")).await));
    }
    let wanted = dashboard_names();
    assert!(wanted.len() >= 20, "the dashboard queries only {wanted:?}");
    let missing: Vec<&String> = wanted.difference(&exported).collect();
    assert!(missing.is_empty(), "the dashboard queries series nobody exports: {missing:?}\nexported: {exported:?}");
    // The `node` variable lists every node, a client-only one included: its series carries each
    // node's node= label.
    let json: serde_json::Value = serde_json::from_str(umbp_metrics::DASHBOARD_JSON).expect("dashboard JSON");
    let var = json["templating"]["list"]
        .as_array()
        .and_then(|l| l.iter().find(|v| v["name"] == "node"))
        .and_then(|v| v["definition"].as_str())
        .expect("node variable");
    let series = var
        .strip_prefix("label_values(")
        .and_then(|r| r.split(',').next())
        .expect("label_values(series, node)")
        .trim()
        .to_owned();
    for node in &cluster.nodes {
        let text = scrape(node.metrics_address().expect("node metrics")).await;
        let id = format!("node=\"{}\"", node.node_id());
        assert!(
            text.lines().any(|l| l.starts_with(&format!("{series}{{")) && l.contains(&id)),
            "the node variable's {series} has no {id}:\n{text}"
        );
    }
    let master = scrape(cluster.master.metrics_addr().expect("master metrics")).await;
    assert!(master.lines().any(|l| l.starts_with("umbp_master_node_up{") && l.ends_with(" 1")), "{master}");
    for node in &cluster.nodes {
        node.close().await;
    }
    cluster.master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn curl_of_a_running_node_and_master_shows_the_series() {
    let cluster = cluster_with_traffic().await;
    let master = scrape(cluster.master.metrics_addr().expect("master metrics")).await;
    let has = |text: &str, name: &str, labels: &[&str]| {
        text.lines().any(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
            || (labels.is_empty() && text.lines().any(|l| l.starts_with(&format!("{name} "))))
    };
    assert!(master.lines().any(|l| l == "umbp_master_nodes{status=\"alive\"} 4"), "{master}");
    for node in ["n1", "n2"] {
        let n = format!("node=\"{node}\"");
        assert!(has(&master, "umbp_master_capacity_total_bytes", &[&n, "tier=\"DRAM\""]), "{master}");
        assert!(has(&master, "umbp_master_capacity_available_bytes", &[&n, "tier=\"DRAM\""]), "{master}");
        assert!(has(&master, "umbp_master_node_keys", &[&n]), "{master}");
    }
    assert!(has(&master, "umbp_master_routed_keys_total", &["op=\"put\""]), "{master}");
    assert!(has(&master, "umbp_master_keys", &[]), "{master}");

    let n1 = scrape(cluster.nodes[0].metrics_address().expect("n1 metrics")).await;
    let dram = ["node=\"n1\"", "tier=\"DRAM\"", "backend=\"PageBackend\""];
    for (name, extra) in [
        ("umbp_backend_ops_total", "op=\"commit\""),
        ("umbp_backend_batches_total", "op=\"allocate\""),
        ("umbp_backend_bytes_total", "op=\"resolve\""),
        ("umbp_backend_op_seconds_total", "op=\"commit\""),
        ("umbp_backend_medium_state", "state=\"read_leases\""),
        ("umbp_backend_medium_events_total", "event=\"pending_slot_reaped\""),
    ] {
        let mut labels = dram.to_vec();
        labels.push(extra);
        assert!(has(&n1, name, &labels), "{name} {labels:?} missing:\n{n1}");
    }
    let reaped = n1
        .lines()
        .find(|l| l.starts_with("umbp_backend_medium_events_total{") && l.contains("pending_slot_reaped"))
        .expect("reaped series");
    assert!(reaped.ends_with(" 1"), "{reaped}");
    // The client-only node moved the bytes: its transfer engine's series, by engine.
    let client = scrape(cluster.nodes[2].metrics_address().expect("client metrics")).await;
    assert!(has(&client, "umbp_transfer_bytes_total", &["node=\"client\"", "engine="]), "{client}");
    assert!(!client.contains("umbp_backend_ops_total"), "a client-only node has no medium:\n{client}");
    // The SSD medium has no metrics code for the generic series, and its own under generic names.
    let s1 = scrape(cluster.nodes[3].metrics_address().expect("s1 metrics")).await;
    for (name, extra) in [
        ("umbp_backend_ops_total", "op=\"commit\""),
        ("umbp_backend_bytes_total", "op=\"commit\""),
        ("umbp_backend_op_seconds_total", "op=\"resolve\""),
        ("umbp_backend_medium_bytes_total", "event="),
        ("umbp_backend_medium_state", "state="),
    ] {
        assert!(has(&s1, name, &["node=\"s1\"", "tier=\"SSD\"", extra]), "{name} {extra} missing:\n{s1}");
    }
    assert!(has(&master, "umbp_master_capacity_total_bytes", &["node=\"s1\"", "tier=\"SSD\""]), "{master}");
    for node in &cluster.nodes {
        node.close().await;
    }
    cluster.master.shutdown().await;
}

/// The value of the one series `name` whose line carries every label in `labels`, 0 when absent.
fn series_value(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
        .map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).expect("a value"))
        .sum()
}

/// `PoolClient::batch_exists` on a node's own medium is a lookup: the resolve series (read bytes,
/// hits and misses: the read-bandwidth and hit-rate panels) do not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exists_checks_are_lookups_not_resolves() {
    let master =
        umbp_master::start(MasterConfig { listen: any_port(), ..MasterConfig::default() }).await.expect("master");
    let node = PoolClient::start(node_config(&master, "n1", true)).await.expect("node");
    let addr = node.metrics_address().expect("metrics");
    let resolve = |text: &str| {
        (
            series_value(text, "umbp_backend_ops_total", &["op=\"resolve\""]),
            series_value(text, "umbp_backend_bytes_total", &["op=\"resolve\""]),
        )
    };
    let before = scrape(addr).await;
    // Keys the master does not know: each one is looked up in the node's own medium.
    for _ in 0..3 {
        let found = node.batch_exists(&["exists-a", "exists-b"]).await.expect("exists");
        assert_eq!(found, [false, false]);
    }
    let after = scrape(addr).await;
    assert_eq!(resolve(&after), resolve(&before), "exists moved the resolve series:\n{after}");
    let lookups = series_value(&after, "umbp_backend_ops_total", &["op=\"lookup\"", "status=\"miss\""]);
    assert_eq!(lookups, 6.0, "{after}");
    node.close().await;
    master.shutdown().await;
}

/// The medium is wrapped in `InstrumentedBackend` only when the node serves `/metrics`: without an
/// endpoint its own samples carry no derived series (and its calls pay no counting).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_medium_is_instrumented_only_when_metrics_are_served() {
    let master =
        umbp_master::start(MasterConfig { listen: any_port(), ..MasterConfig::default() }).await.expect("master");
    let mut bare = node_config(&master, "bare", true);
    bare.metrics_listen = None;
    for (config, instrumented) in [(bare, false), (node_config(&master, "served", true), true)] {
        let node = PoolClient::start(config).await.expect("node");
        assert_eq!(node.metrics_address().is_some(), instrumented);
        let medium = node.medium().expect("a medium");
        medium.batch_allocate(&[AllocateRequest::new("probe", PAGE)]);
        let derived = medium.sample_metrics().iter().any(|s| s.name == "umbp_backend_ops_total");
        assert_eq!(derived, instrumented, "instrumented={instrumented}");
        node.close().await;
    }
    master.shutdown().await;
}
