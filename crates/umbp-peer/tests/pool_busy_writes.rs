//! A node that answers a put's allocations *busy* (it has room, but no free staging page right
//! now) is asked again and again (the get path's bounded backoff), never excluded and never
//! re-routed; once the wait is over without progress the put fails `Busy`, retryable, and no slot
//! is left behind. Before the busy answer existed the node said `NoSpace` at once, and the writer
//! went looking for another node (or failed the key).

use std::sync::Arc;
use std::time::Duration;

use umbp_core::{BackendRegistry, MediumBackend};
use umbp_master::MasterHandle;
use umbp_peer::master_client::{MasterClient, MasterClientConfig, NodeRegistration};
use umbp_peer::peer_service::{PeerServer, PeerServerConfig, PeerServerHandle, PeerService};
use umbp_peer::pool_client::{KeyError, PoolClient};
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

#[expect(dead_code, reason = "this file waits for the master's view of the node, not for an index entry")]
mod pool_support;

use pool_support::{PAGE, config, master, value};

/// A node the master routes puts to, whose medium answers every allocation busy.
async fn busy_writer_target(master: &MasterHandle) -> (MasterClient, Arc<MockBackend>, PeerServerHandle) {
    let mock = Arc::new(MockBackend::new(MockConfig { page_size: PAGE, pages: 64, ..MockConfig::default() }));
    mock.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    mock.answer_allocate_busy(u64::MAX);
    let mut registry = BackendRegistry::new();
    registry.register(Arc::clone(&mock) as Arc<dyn MediumBackend>).expect("registry");
    let registry = Arc::new(registry);
    let service = PeerService::new(Arc::clone(&registry), "127.0.0.1:1");
    let server = PeerServer::start(PeerServerConfig::default(), service).await.expect("peer server");
    let registration = NodeRegistration::new("busy", "127.0.0.1")
        .with_peer_address(server.local_addr().to_string())
        .with_data_endpoint("127.0.0.1:1");
    let client =
        MasterClient::connect(&master.local_addr().to_string(), MasterClientConfig::default(), registration, registry)
            .await
            .expect("connect");
    client.register().await.expect("register");
    client.start_heartbeat().expect("heartbeat");
    client.flush();
    (client, mock, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_stays_busy_is_asked_again_then_the_put_fails_busy_not_no_space() {
    let m = master().await;
    let (_client, mock, _server) = busy_writer_target(&m).await;
    let mut c = config(&m, "writer", 0).with_medium(umbp_peer::pool_client::Medium::None);
    c.max_reroutes = 1;
    let writer = PoolClient::start(c).await.expect("writer");
    // The master routes puts to the node once its capacity arrived (by heartbeat).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = writer.master().cluster_status().await.expect("cluster status");
        let lends = status
            .nodes
            .iter()
            .any(|n| n.node_id == "busy" && n.tier_capacities.iter().any(|(_, c)| c.total_bytes > 0));
        if lends {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the busy node's capacity never reached the master");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked_before = mock.calls().batch_allocate;
    let v = value(1, 100);
    let r = writer.put("k", &v).await;
    assert_eq!(r, Err(KeyError::Busy { node: "busy".into() }), "a busy node is neither full nor refused");
    assert!(r.as_ref().err().is_some_and(KeyError::is_retryable));
    let asked = mock.calls().batch_allocate - asked_before;
    assert!(asked > 10, "the node was asked again while busy ({asked} allocations), not excluded");
    assert_eq!(writer.stats().reroutes, 0, "asking a busy node again is not a re-route");
    assert_eq!(mock.pending_slot_count(), 0, "busy reserved nothing");
    writer.close().await;
    m.shutdown().await;
}
