//! Registry state machine of the metadata stores (contract tests, run against both): register,
//! replace, unregister, expire.

#![expect(
    clippy::unwrap_used,
    reason = "contract tests are plain functions that `contract!` wraps in #[test]; clippy exempts only the latter"
)]

#[macro_use]
#[path = "store_support/contract.rs"]
mod contract;
mod store_support;

use std::sync::{Arc, Barrier};

use store_support::*;
use umbp_core::TierType;
use umbp_master::store::{
    HeartbeatOutcome, InMemoryStore, MetadataStore, NodeStatus, RegisterOutcome, StoreError, TierCap,
};

fn register_inserts_alive_record_at_seq_zero(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 1_000);
        let rec = store.get_node("a").unwrap().unwrap();
        assert_eq!(rec.status, NodeStatus::Alive);
        assert_eq!((rec.last_heartbeat_ms, rec.registered_at_ms, rec.last_applied_seq), (1_000, 1_000, 0));
        assert_eq!(&*rec.peer_address, "a:7000");
        assert_eq!(&*rec.data_endpoint, "a:7001");
        assert_eq!(rec.node_address, "127.0.0.1");
        assert_eq!(rec.tags, vec!["role=test".to_owned()]);
        assert_eq!(rec.caps, vec![TierCap::new(TierType::Dram, 1 << 30, 1 << 30)]);
        assert!(store.is_alive("a").unwrap());
        assert!(!store.is_alive("b").unwrap());
        assert_eq!(store.get_node("b").unwrap(), None);
    }
}

fn empty_node_id_is_rejected(kind: Kind) {
    let store = kind.one();
    let err = store.register(registration(""), 0, STALE).unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument { .. }));
    assert!(!err.is_retryable());
}

#[test]
fn shard_count_is_validated() {
    assert!(matches!(InMemoryStore::with_shards(0), Err(StoreError::InvalidShardCount { shards: 0, .. })));
    assert!(InMemoryStore::with_shards(4097).is_err());
    assert_eq!(InMemoryStore::with_shards(4096).unwrap().shard_count(), 4096);
    assert_eq!(InMemoryStore::new().shard_count(), 32);
}

fn fresh_duplicate_registration_is_refused_and_changes_nothing(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    assert_eq!(delta(&store, "a", 2_000, 1, vec![add("k", 10)]), HeartbeatOutcome::Applied { acked_seq: 1 });
    let mut other = registration("a");
    other.peer_address = "elsewhere:1".into();
    // Exactly at the stale boundary the record still counts as fresh.
    assert_eq!(store.register(other, 2_000 + STALE, STALE).unwrap(), RegisterOutcome::AlreadyExists);
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!((&*rec.peer_address, rec.last_applied_seq, rec.registered_at_ms), ("a:7000", 1, 1_000));
    assert_eq!(locs(&store, "k").len(), 1);
}

fn stale_alive_record_is_replaced_and_its_locations_wiped(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 1_000);
        register(&store, "b", 1_000);
        assert_eq!(delta(&store, "a", 2_000, 1, vec![add("k1", 10), add("k2", 20)]).acked_seq(), Some(1));
        assert_eq!(delta(&store, "b", 2_000, 1, vec![add("k1", 10)]).acked_seq(), Some(1));
        let mut again = registration("a");
        again.peer_address = "new:7000".into();
        assert_eq!(store.register(again, 2_000 + STALE + 1, STALE).unwrap(), RegisterOutcome::Registered);
        let rec = store.get_node("a").unwrap().unwrap();
        assert_eq!((&*rec.peer_address, rec.last_applied_seq, rec.registered_at_ms), ("new:7000", 0, 32_001));
        // §7.5 fix: the old registration's locations are gone; b's replica of k1 stays.
        assert_eq!(locs(&store, "k1"), vec![("b".to_owned(), TierType::Dram, 10)]);
        assert!(locs(&store, "k2").is_empty());
        assert_eq!(store.node_key_count("a").unwrap(), 0);
        assert_eq!(store.key_count().unwrap(), 1);
        // The new registration starts its stream at seq 0: seq 1 applies.
        assert_eq!(delta(&store, "a", 40_000, 1, vec![add("k3", 1)]), HeartbeatOutcome::Applied { acked_seq: 1 });
    }
}

fn expired_record_is_replaced(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    assert_eq!(store.expire_stale(1_001).unwrap(), vec!["a".to_owned()]);
    // Even "fresh" by time, an expired record is replaced.
    assert_eq!(store.register(registration("a"), 1_002, STALE).unwrap(), RegisterOutcome::Registered);
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!((rec.status, rec.registered_at_ms), (NodeStatus::Alive, 1_002));
}

fn concurrent_registrations_of_one_id_register_exactly_once(kind: Kind) {
    for _ in 0..20 {
        let store = Arc::new(kind.one());
        let threads = 8;
        let barrier = Arc::new(Barrier::new(threads));
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    let mut reg = registration("same");
                    reg.peer_address = format!("p{i}:1");
                    barrier.wait();
                    store.register(reg, 5_000, STALE).unwrap()
                })
            })
            .collect();
        let outcomes: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(outcomes.iter().filter(|o| **o == RegisterOutcome::Registered).count(), 1, "{outcomes:?}");
        assert_eq!(store.list_nodes().unwrap().len(), 1);
    }
}

fn unregister_cascades_and_is_idempotent(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        register(&store, "b", 0);
        delta(&store, "a", 1, 1, vec![add("shared", 5), add("only-a", 6)]);
        delta(&store, "b", 1, 1, vec![add("shared", 5)]);
        assert!(store.unregister("a").unwrap());
        assert_eq!(store.get_node("a").unwrap(), None);
        assert_eq!(locs(&store, "shared"), vec![("b".to_owned(), TierType::Dram, 5)]);
        assert!(locs(&store, "only-a").is_empty());
        assert_eq!(store.key_count().unwrap(), 1);
        assert!(!store.unregister("a").unwrap());
        assert!(!store.unregister("never").unwrap());
        assert_eq!(delta(&store, "a", 2, 2, vec![add("x", 1)]), HeartbeatOutcome::Unknown);
        assert!(store.lookup("x").unwrap().is_empty());
    }
}

fn heartbeat_from_unknown_node_is_unknown_and_changes_nothing(kind: Kind) {
    let store = kind.one();
    assert_eq!(delta(&store, "ghost", 1, 1, vec![add("k", 1)]), HeartbeatOutcome::Unknown);
    assert_eq!(keepalive(&store, "ghost", 1, caps()), HeartbeatOutcome::Unknown);
    assert_eq!(full_sync(&store, "ghost", 1, 0, vec![add("k", 1)]), HeartbeatOutcome::Unknown);
    assert_eq!(store.key_count().unwrap(), 0);
    assert!(store.list_nodes().unwrap().is_empty());
}

fn expire_keeps_row_wipes_locations_and_is_idempotent(kind: Kind) {
    for store in kind.all() {
        register(&store, "old", 0);
        register(&store, "new", 0);
        delta(&store, "old", 1_000, 1, vec![add("k", 1), add("shared", 2)]);
        delta(&store, "new", 9_000, 1, vec![add("shared", 2)]);
        // Strictly older than the cutoff expires; equal does not.
        assert_eq!(store.expire_stale(9_000).unwrap(), vec!["old".to_owned()]);
        let rec = store.get_node("old").unwrap().unwrap();
        assert_eq!(rec.status, NodeStatus::Expired);
        assert_eq!(rec.last_applied_seq, 1);
        assert!(!store.is_alive("old").unwrap());
        assert!(store.lookup("k").unwrap().is_empty());
        assert_eq!(locs(&store, "shared"), vec![("new".to_owned(), TierType::Dram, 2)]);
        assert_eq!(store.node_key_count("old").unwrap(), 0);
        assert_eq!(store.expire_stale(9_000).unwrap(), Vec::<String>::new());
        assert_eq!(store.list_nodes().unwrap().len(), 2);
        assert_eq!(store.list_alive().unwrap().len(), 1);
        assert_eq!(store.alive_peer_view().unwrap().keys().map(|k| k.to_string()).collect::<Vec<_>>(), vec!["new"]);
    }
}

fn heartbeat_to_expired_node_is_unknown_and_does_not_revive_it(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    store.expire_stale(1).unwrap();
    assert_eq!(delta(&store, "a", 50, 1, vec![add("k", 1)]), HeartbeatOutcome::Unknown);
    assert_eq!(keepalive(&store, "a", 50, caps()), HeartbeatOutcome::Unknown);
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!((rec.status, rec.last_heartbeat_ms), (NodeStatus::Expired, 0));
    assert!(store.lookup("k").unwrap().is_empty());
}

fn listings_are_sorted_and_peer_view_has_alive_only(kind: Kind) {
    let store = kind.one();
    for id in ["c", "a", "b"] {
        register(&store, id, 10);
    }
    keepalive(&store, "a", 100, caps());
    keepalive(&store, "c", 100, caps());
    assert_eq!(store.expire_stale(50).unwrap(), vec!["b".to_owned()]);
    let ids =
        |recs: Vec<umbp_master::store::NodeRecord>| recs.into_iter().map(|r| r.node_id.to_string()).collect::<Vec<_>>();
    assert_eq!(ids(store.list_nodes().unwrap()), vec!["a", "b", "c"]);
    assert_eq!(ids(store.list_alive().unwrap()), vec!["a", "c"]);
    let view = store.alive_peer_view().unwrap();
    assert_eq!(view.len(), 2);
    assert_eq!(view.get("a").map(|p| &*p.peer_address), Some("a:7000"));
    assert_eq!(view.get("a").map(|p| &*p.data_endpoint), Some("a:7001"), "the data endpoint as registered");
}

contract!(
    register_inserts_alive_record_at_seq_zero,
    empty_node_id_is_rejected,
    fresh_duplicate_registration_is_refused_and_changes_nothing,
    stale_alive_record_is_replaced_and_its_locations_wiped,
    expired_record_is_replaced,
    concurrent_registrations_of_one_id_register_exactly_once,
    unregister_cascades_and_is_idempotent,
    heartbeat_from_unknown_node_is_unknown_and_changes_nothing,
    expire_keeps_row_wipes_locations_and_is_idempotent,
    heartbeat_to_expired_node_is_unknown_and_does_not_revive_it,
    listings_are_sorted_and_peer_view_has_alive_only,
);
