//! Node incarnations and the retention of expired records in the metadata stores: a
//! restarted process replaces its predecessor's live record at once, the predecessor's late
//! heartbeats and unregister change nothing, and expired rows go after the master's retention.

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
use umbp_master::store::{HeartbeatOutcome, MetadataStore, NodeStatus, RegisterOutcome, TierCap};

fn a_higher_incarnation_replaces_a_live_record_at_once_and_wipes_its_locations(kind: Kind) {
    for store in kind.all() {
        assert_eq!(store.register(registration_of("a", 100), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
        assert_eq!(
            delta_of(&store, "a", 1_500, 100, 1, vec![add("old", 10)]),
            HeartbeatOutcome::Applied { acked_seq: 1 }
        );
        // The process was killed and restarted well within the stale window.
        let outcome = store.register(registration_of("a", 200), 2_000, STALE).unwrap();
        assert_eq!(outcome, RegisterOutcome::Replaced { previous: 100 });
        assert!(outcome.is_registered());
        let rec = store.get_node("a").unwrap().unwrap();
        assert_eq!((rec.incarnation, rec.last_applied_seq, rec.registered_at_ms), (200, 0, 2_000));
        assert!(locs(&store, "old").is_empty(), "the old incarnation's locations are gone");
        assert_eq!(store.node_key_count("a").unwrap(), 0);

        // The old process's late heartbeats are refused and change nothing.
        assert_eq!(keepalive_of(&store, "a", 2_100, 100), HeartbeatOutcome::Superseded { current: 200 });
        assert_eq!(
            delta_of(&store, "a", 2_200, 100, 1, vec![add("ghost", 10)]),
            HeartbeatOutcome::Superseded { current: 200 }
        );
        assert!(locs(&store, "ghost").is_empty(), "a superseded delta never reaches the index");
        let rec = store.get_node("a").unwrap().unwrap();
        assert_eq!((rec.last_applied_seq, rec.last_heartbeat_ms), (0, 2_000), "liveness untouched");

        // The new one streams from seq 1.
        assert_eq!(
            delta_of(&store, "a", 2_300, 200, 1, vec![add("new", 10)]),
            HeartbeatOutcome::Applied { acked_seq: 1 }
        );
        assert_eq!(locs(&store, "new"), vec![("a".to_owned(), TierType::Dram, 10)]);
    }
}

fn a_lower_incarnation_is_refused_alive_or_expired(kind: Kind) {
    let store = kind.one();
    assert_eq!(store.register(registration_of("a", 200), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    assert_eq!(delta_of(&store, "a", 1_000, 200, 1, vec![add("k", 10)]), HeartbeatOutcome::Applied { acked_seq: 1 });
    let mut older = registration_of("a", 100);
    older.peer_address = "elsewhere:1".into();
    assert_eq!(store.register(older.clone(), 2_000, STALE).unwrap(), RegisterOutcome::Superseded { current: 200 });
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!((&*rec.peer_address, rec.incarnation, rec.last_applied_seq), ("a:7000", 200, 1));
    assert_eq!(locs(&store, "k").len(), 1);
    // Expired, the newer record still holds the id against the older process.
    assert_eq!(store.expire_stale(1_000 + 1).unwrap(), vec!["a".to_owned()]);
    assert_eq!(store.register(older, 90_000, STALE).unwrap(), RegisterOutcome::Superseded { current: 200 });
    assert_eq!(store.get_node("a").unwrap().unwrap().status, NodeStatus::Expired);
    // A later process takes it.
    assert_eq!(store.register(registration_of("a", 300), 90_000, STALE).unwrap(), RegisterOutcome::Registered);
}

fn the_same_incarnation_or_none_keeps_the_compare_and_set(kind: Kind) {
    let store = kind.one();
    assert_eq!(store.register(registration_of("a", 100), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    assert_eq!(store.register(registration_of("a", 100), 1_001, STALE).unwrap(), RegisterOutcome::AlreadyExists);
    assert_eq!(store.register(registration_of("a", 0), 1_002, STALE).unwrap(), RegisterOutcome::AlreadyExists);
    // A record of a process without incarnations cannot be told from a newer one: refused while fresh.
    assert_eq!(store.register(registration_of("b", 0), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    assert_eq!(store.register(registration_of("b", 5), 1_001, STALE).unwrap(), RegisterOutcome::AlreadyExists);
    // Heartbeats without an incarnation match any record.
    assert_eq!(keepalive_of(&store, "a", 1_100, 0), HeartbeatOutcome::Applied { acked_seq: 0 });
    assert_eq!(keepalive_of(&store, "b", 1_100, 7), HeartbeatOutcome::Applied { acked_seq: 0 });
}

fn a_heartbeat_of_a_higher_incarnation_than_the_record_must_register(kind: Kind) {
    let store = kind.one();
    assert_eq!(store.register(registration_of("a", 100), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    assert_eq!(delta_of(&store, "a", 1_100, 300, 1, vec![add("k", 1)]), HeartbeatOutcome::Unknown);
    assert!(locs(&store, "k").is_empty());
}

fn a_superseded_process_cannot_unregister_the_newer_one(kind: Kind) {
    let store = kind.one();
    assert_eq!(store.register(registration_of("a", 100), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    assert_eq!(
        store.register(registration_of("a", 200), 1_100, STALE).unwrap(),
        RegisterOutcome::Replaced { previous: 100 }
    );
    assert_eq!(delta_of(&store, "a", 1_200, 200, 1, vec![add("k", 1)]), HeartbeatOutcome::Applied { acked_seq: 1 });
    assert!(!store.unregister_incarnation("a", 100).unwrap(), "the old process leaving erases nothing");
    assert_eq!(store.get_node("a").unwrap().unwrap().incarnation, 200);
    assert_eq!(locs(&store, "k").len(), 1);
    assert!(store.unregister_incarnation("a", 200).unwrap());
    assert_eq!(store.get_node("a").unwrap(), None);
    // The operator's unconditional form.
    assert_eq!(store.register(registration_of("a", 300), 1_300, STALE).unwrap(), RegisterOutcome::Registered);
    assert!(store.unregister("a").unwrap());
}

fn concurrent_restarts_of_one_id_leave_the_highest_incarnation(kind: Kind) {
    const THREADS: u64 = 8;
    for round in 0..20 {
        let store = Arc::new(kind.one());
        let barrier = Arc::new(Barrier::new(THREADS as usize));
        let outcomes: Vec<RegisterOutcome> = std::thread::scope(|s| {
            let handles: Vec<_> = (1..=THREADS)
                .map(|inc| {
                    let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
                    s.spawn(move || {
                        barrier.wait();
                        let outcome = store.register(registration_of("a", inc), 1_000, STALE).unwrap();
                        if outcome.is_registered() {
                            // Each registration streams its own key; only the winner's may stay.
                            delta_of(&*store, "a", 1_001, inc, 1, vec![add(&format!("k{inc}"), 1)]);
                        }
                        outcome
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(outcomes.iter().all(|o| !matches!(o, RegisterOutcome::AlreadyExists)), "round {round}: {outcomes:?}");
        assert_eq!(store.get_node("a").unwrap().unwrap().incarnation, THREADS, "round {round}");
        for inc in 1..THREADS {
            assert!(locs(&*store, &format!("k{inc}")).is_empty(), "round {round}: k{inc} of a superseded process");
        }
    }
}

fn expired_records_are_removed_after_the_retention(kind: Kind) {
    for store in kind.all() {
        register(&store, "storage", 1_000);
        let client = umbp_master::store::Registration {
            node_id: "client".into(),
            node_address: "127.0.0.1".into(),
            ..Default::default()
        };
        assert_eq!(store.register(client, 1_000, STALE).unwrap(), RegisterOutcome::Registered);
        register(&store, "alive", 1_000);
        assert_eq!(keepalive(&store, "alive", 50_000, caps()), HeartbeatOutcome::Applied { acked_seq: 0 });
        assert_eq!(store.expire_stale(40_000).unwrap(), vec!["client".to_owned(), "storage".to_owned()]);
        // Within the retention nothing goes; ALIVE records never do.
        assert!(store.remove_expired(1_000).unwrap().is_empty());
        assert_eq!(store.list_nodes().unwrap().len(), 3);
        assert_eq!(store.remove_expired(60_000).unwrap(), vec!["client".to_owned(), "storage".to_owned()]);
        let left: Vec<String> = store.list_nodes().unwrap().into_iter().map(|r| r.node_id.to_string()).collect();
        assert_eq!(left, vec!["alive".to_owned()]);
        assert!(store.remove_expired(u64::MAX).unwrap().is_empty(), "idempotent, and ALIVE is kept");
        // A removed node registers as a new one.
        register(&store, "storage", 70_000);
    }
}

fn a_node_that_came_back_before_the_removal_is_kept(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    assert_eq!(store.expire_stale(2_000).unwrap(), vec!["a".to_owned()]);
    register(&store, "a", 3_000);
    assert!(store.remove_expired(u64::MAX).unwrap().is_empty());
    assert!(store.is_alive("a").unwrap());
}

fn records_tell_storage_nodes_from_clients(kind: Kind) {
    let store = kind.one();
    register(&store, "storage", 1_000);
    let client = umbp_master::store::Registration { node_id: "client".into(), ..Default::default() };
    assert_eq!(store.register(client, 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    assert!(store.get_node("storage").unwrap().unwrap().lends_medium());
    assert!(!store.get_node("client").unwrap().unwrap().lends_medium());
}

fn credited_capacity_is_seen_until_the_next_report(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    let low = vec![TierCap::new(TierType::Dram, 1 << 30, 100)];
    assert_eq!(keepalive(&store, "a", 1_100, low), HeartbeatOutcome::Applied { acked_seq: 0 });
    store.credit_capacity("a", TierType::Dram, 1_000).unwrap();
    store.credit_capacity("a", TierType::Ssd, 1_000).unwrap();
    store.credit_capacity("nobody", TierType::Dram, 1_000).unwrap();
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!(rec.caps, vec![TierCap::new(TierType::Dram, 1 << 30, 1_100)]);
    store.credit_capacity("a", TierType::Dram, u64::MAX).unwrap();
    assert_eq!(store.get_node("a").unwrap().unwrap().caps[0].available_bytes, 1 << 30, "never past the total");
    assert_eq!(keepalive(&store, "a", 1_200, caps()), HeartbeatOutcome::Applied { acked_seq: 0 });
    assert_eq!(store.get_node("a").unwrap().unwrap().caps, caps(), "the node's report wins");
}

fn debited_capacity_is_reserved_until_the_next_report(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    let report = vec![TierCap::new(TierType::Dram, 1_000, 600)];
    assert_eq!(keepalive(&store, "a", 1_100, report.clone()), HeartbeatOutcome::Applied { acked_seq: 0 });
    assert_eq!(store.debit_capacity("a", TierType::Dram, 250).unwrap(), Some(TierCap::new(TierType::Dram, 1_000, 350)));
    assert_eq!(
        store.debit_capacity("a", TierType::Dram, 10_000).unwrap(),
        Some(TierCap::new(TierType::Dram, 1_000, 0))
    );
    assert_eq!(store.debit_capacity("a", TierType::Ssd, 1).unwrap(), None, "an unreported tier");
    assert_eq!(store.debit_capacity("nobody", TierType::Dram, 1).unwrap(), None);
    assert_eq!(keepalive(&store, "a", 1_200, report.clone()), HeartbeatOutcome::Applied { acked_seq: 0 });
    assert_eq!(store.get_node("a").unwrap().unwrap().caps, report, "the node's report wins");
    assert_eq!(store.expire_stale(u64::MAX).unwrap(), vec!["a".to_owned()]);
    assert_eq!(store.debit_capacity("a", TierType::Dram, 1).unwrap(), None, "an expired node");
}

/// Incarnations are often nanosecond clocks, seqs and sizes any `u64`: values above 2^53 (where a
/// double, such as a Lua number, loses precision) keep their exact value and order.
fn values_beyond_two_to_the_53_keep_their_order(kind: Kind) {
    let store = kind.one();
    let (old, new) = ((1u64 << 60) + 1, (1u64 << 60) + 2);
    assert_eq!(store.register(registration_of("a", old), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    assert_eq!(
        store.register(registration_of("a", new), 1_001, STALE).unwrap(),
        RegisterOutcome::Replaced { previous: old }
    );
    assert_eq!(
        store.register(registration_of("a", old), 1_002, STALE).unwrap(),
        RegisterOutcome::Superseded { current: new }
    );
    assert_eq!(keepalive_of(&store, "a", 1_003, old), HeartbeatOutcome::Superseded { current: new });
    let big = u64::MAX - 1;
    assert_eq!(
        full_sync(&store, "a", 1_004, big, vec![add("k", u64::MAX)]),
        HeartbeatOutcome::Applied { acked_seq: big }
    );
    assert_eq!(
        delta(&store, "a", 1_005, u64::MAX, vec![add("k2", 1)]),
        HeartbeatOutcome::Applied { acked_seq: u64::MAX }
    );
    assert_eq!(delta(&store, "a", 1_006, big, Vec::new()), HeartbeatOutcome::AlreadyApplied { acked_seq: u64::MAX });
    assert_eq!(locs(&store, "k"), vec![("a".to_owned(), TierType::Dram, u64::MAX)]);
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!((rec.incarnation, rec.last_applied_seq), (new, u64::MAX));
}

contract!(
    a_higher_incarnation_replaces_a_live_record_at_once_and_wipes_its_locations,
    a_lower_incarnation_is_refused_alive_or_expired,
    the_same_incarnation_or_none_keeps_the_compare_and_set,
    a_heartbeat_of_a_higher_incarnation_than_the_record_must_register,
    a_superseded_process_cannot_unregister_the_newer_one,
    concurrent_restarts_of_one_id_leave_the_highest_incarnation,
    expired_records_are_removed_after_the_retention,
    a_node_that_came_back_before_the_removal_is_kept,
    records_tell_storage_nodes_from_clients,
    credited_capacity_is_seen_until_the_next_report,
    debited_capacity_is_reserved_until_the_next_report,
    values_beyond_two_to_the_53_keep_their_order,
);
