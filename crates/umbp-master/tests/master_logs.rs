//! Logs an operator can read: a storage node joining is one INFO line with its settings as
//! `key=value`; a client (every CLI command is one) joining or leaving is DEBUG, not INFO; a warning
//! repeated on every request is printed once per window with the count held back.

use std::io::Write;
use std::sync::Arc;

use parking_lot::Mutex;
use tonic::transport::Channel;
use umbp_master::MasterConfig;
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

/// Every formatted line, shared with the subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock()).lines().map(str::to_owned).collect()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

// The only test of this binary: it owns the process-wide subscriber (heartbeats are applied on the
// blocking pool, so a thread-local one would miss their lines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joins_are_one_info_line_for_nodes_and_debug_for_clients_and_repeats_are_rate_limited() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(captured.clone())
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this test binary");

    let m =
        umbp_master::start(MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() })
            .await
            .expect("master");
    let mut c: UmbpMasterClient<Channel> =
        UmbpMasterClient::connect(format!("http://{}", m.local_addr())).await.expect("connect");
    let dram = v1::TierType::TierDram as i32;
    c.register_client(v1::RegisterClientRequest {
        node_id: "store-1".into(),
        node_address: "127.0.0.1".into(),
        tier_capacities: vec![v1::TierCapacity {
            tier: dram,
            total_bytes: 1 << 30,
            available_bytes: 1 << 29,
            page_size: 0,
        }],
        peer_address: "127.0.0.1:7001".into(),
        data_endpoint: "127.0.0.1:7002".into(),
        tags: vec![],
        incarnation: 7,
    })
    .await
    .expect("storage node");
    // Ten CLI commands: each registers a client-only node and unregisters it.
    for i in 0..10 {
        let node_id = format!("cli-{i}");
        let reg = v1::RegisterClientRequest { node_id: node_id.clone(), incarnation: 1, ..Default::default() };
        c.register_client(reg).await.expect("client");
        c.unregister_client(v1::UnregisterClientRequest { node_id, incarnation: 1 }).await.expect("unregister");
    }
    // A peer sending events of a kind this master does not know, on every heartbeat.
    for seq in 1..=50 {
        let event = v1::KvEvent { kind: 99, key: format!("k{seq}"), tier: dram, size: 1 };
        let hb = v1::HeartbeatRequest {
            node_id: "store-1".into(),
            bundles: vec![v1::EventBundle { seq, events: vec![event] }],
            incarnation: 7,
            ..Default::default()
        };
        c.heartbeat(hb).await.expect("heartbeat");
    }
    m.shutdown().await;

    let lines = captured.lines();
    let joined: Vec<&String> = lines.iter().filter(|l| l.contains("node joined")).collect();
    assert_eq!(joined.len(), 1, "{lines:#?}");
    let line = joined[0];
    assert!(line.contains(" INFO "), "{line}");
    for field in [
        "node=store-1",
        "incarnation=7",
        "peer=127.0.0.1:7001",
        "data=127.0.0.1:7002",
        "tiers=dram=536870912/1073741824",
    ] {
        assert!(line.contains(field), "{field} missing from {line}");
    }
    assert!(!line.contains('{') && !line.contains("TierCap"), "a Debug struct in {line}");
    assert!(!lines.iter().any(|l| l.contains("cli-")), "client joins and leaves are not INFO: {lines:#?}");
    let listening: Vec<&String> = lines.iter().filter(|l| l.contains("master listening")).collect();
    assert_eq!(listening.len(), 1);
    assert!(listening[0].contains("heartbeat_interval_ms=5000") && !listening[0].contains('{'), "{}", listening[0]);
    let dropped = lines.iter().filter(|l| l.contains("dropped events of an unknown kind")).count();
    assert_eq!(dropped, 1, "50 bad heartbeats, one line per window: {lines:#?}");
}
