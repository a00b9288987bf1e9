//! Incarnations through the master client against a real master on 127.0.0.1: a process restarted
//! under the same node id takes over at once (and its recovered keys are indexed when `register`
//! returns); the process it replaced learns it was superseded, stops heartbeating for good and never
//! fights back; an older process starting late is refused.

mod master_client_support;

use std::sync::Arc;
use std::time::Duration;

use master_client_support::{commit, keys, node, page_backend, registry, test_config};
use umbp_core::TierType;
use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::master_client::{MasterClient, MasterClientError};

const PAGE: u64 = 4096;
const WAIT: Duration = Duration::from_secs(10);

async fn real_master() -> MasterHandle {
    umbp_master::start(MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        // Heartbeats every 500 ms, so the superseded client hears of it quickly.
        heartbeat_ttl: Duration::from_secs(1),
        ..MasterConfig::default()
    })
    .await
    .expect("master")
}

async fn found(client: &MasterClient, keys: &[String]) -> Vec<bool> {
    client.batch_lookup(keys).await.expect("lookup")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_process_takes_over_and_the_superseded_one_stops_for_good() {
    let master = real_master().await;
    let addr = master.local_addr().to_string();
    let old_medium = page_backend(TierType::Dram, PAGE, 64);
    let old = MasterClient::connect(&addr, test_config(), node(), registry(&[Arc::clone(&old_medium)]))
        .await
        .expect("connect");
    old.register().await.expect("first process registers");
    old.start_heartbeat().expect("loop");
    commit(&old_medium, &keys("old", 3));
    old.flush();
    let deadline = tokio::time::Instant::now() + WAIT;
    while found(&old, &keys("old", 3)).await != [true; 3] {
        assert!(tokio::time::Instant::now() < deadline, "the first process's keys were never indexed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The "restarted" process, on a medium that recovered its own keys (an SSD node on its drives),
    // registers under the same id while the old record is fresh: no wait, no ALREADY_EXISTS.
    let new_medium = page_backend(TierType::Dram, PAGE, 64);
    commit(&new_medium, &keys("recovered", 4));
    let new = MasterClient::connect(&addr, test_config(), node(), registry(&[Arc::clone(&new_medium)]))
        .await
        .expect("connect");
    assert!(new.incarnation() > old.incarnation());
    new.register().await.expect("the restarted process registers at once");
    // Readable the moment `register` returns: the full sync ran inside it.
    assert_eq!(found(&new, &keys("recovered", 4)).await, [true; 4]);
    assert_eq!(found(&new, &keys("old", 3)).await, [false; 3], "the old registration's keys are gone");
    new.start_heartbeat().expect("loop");

    // The old process hears of it at its next heartbeat and stops.
    tokio::time::timeout(WAIT, old.wait_superseded()).await.expect("the old process learns it was superseded");
    assert!(old.is_superseded());
    assert!(matches!(old.heartbeat_once().await, Err(MasterClientError::Superseded { .. })));
    let err = old.register().await.expect_err("never registers again");
    assert!(matches!(err, MasterClientError::Superseded { .. }), "{err}");
    assert!(err.to_string().contains("another node id"), "{err}");
    assert!(!err.is_retryable());
    // Whatever it still writes never reaches the index, and it does not fight the new process.
    commit(&old_medium, &keys("late", 2));
    old.flush();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(old.stats().registrations, 1, "no re-registration loop");
    assert_eq!(found(&new, &keys("late", 2)).await, [false; 2]);
    let record = master.store().get_node("node-a").expect("store").expect("record");
    assert_eq!(record.incarnation, new.incarnation());
    // Its shutdown does not unregister the new process.
    old.shutdown().await.expect("shutdown");
    assert!(master.store().is_alive("node-a").expect("store"));
    assert_eq!(found(&new, &keys("recovered", 4)).await, [true; 4]);
    new.shutdown().await.expect("shutdown");
    assert_eq!(master.store().get_node("node-a").expect("store"), None, "the live process unregisters");
    master.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_process_registering_late_is_refused() {
    let master = real_master().await;
    let addr = master.local_addr().to_string();
    let medium = || registry(&[page_backend(TierType::Dram, PAGE, 8)]);
    // Created first: the lower incarnation.
    let older = MasterClient::connect(&addr, test_config(), node(), medium()).await.expect("connect");
    let newer = MasterClient::connect(&addr, test_config(), node(), medium()).await.expect("connect");
    newer.register().await.expect("newer");
    let err = older.register().await.expect_err("older");
    assert!(matches!(err, MasterClientError::Superseded { ref node_id, .. } if node_id == "node-a"), "{err}");
    assert!(older.is_superseded());
    assert!(matches!(older.start_heartbeat(), Err(MasterClientError::Superseded { .. })));
    assert_eq!(master.store().get_node("node-a").expect("store").expect("record").incarnation, newer.incarnation());
    newer.shutdown().await.expect("shutdown");
    master.shutdown().await;
}
