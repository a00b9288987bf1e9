//! Heartbeat ingestion of the metadata stores (contract tests, run against both): deltas, seq gaps,
//! re-acks, chunked full syncs and capacity refresh.

#![expect(
    clippy::unwrap_used,
    reason = "contract tests are plain functions that `contract!` wraps in #[test]; clippy exempts only the latter"
)]

#[macro_use]
#[path = "store_support/contract.rs"]
mod contract;
mod store_support;

use store_support::*;
use umbp_core::{KvEvent, TierType};
use umbp_master::store::{HeartbeatOutcome, MetadataStore, RegisterOutcome, Registration, TierCap};

/// Owned keys (store_support's `keys`, kept unused here so its dead-code expectation holds).
fn owned(list: &[&str]) -> Vec<String> {
    list.iter().map(|key| (*key).to_owned()).collect()
}

fn dram(node: &str, size: u64) -> (String, TierType, u64) {
    (node.to_owned(), TierType::Dram, size)
}

fn delta_add_and_remove(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        let events = vec![add("k1", 10), KvEvent::add("k1", TierType::Hbm, 11), add("k2", 20), rm("k2")];
        assert_eq!(delta(&store, "a", 1, 1, events), HeartbeatOutcome::Applied { acked_seq: 1 });
        assert_eq!(locs(&store, "k1"), vec![("a".to_owned(), TierType::Hbm, 11), dram("a", 10)]);
        assert!(locs(&store, "k2").is_empty(), "ADD then REMOVE in one bundle applies in order");
        // REMOVE deletes exactly (key, node, tier).
        assert_eq!(delta(&store, "a", 2, 2, vec![rm("k1")]).acked_seq(), Some(2));
        assert_eq!(locs(&store, "k1"), vec![("a".to_owned(), TierType::Hbm, 11)]);
        assert_eq!(store.node_key_count("a").unwrap(), 1);
        // REMOVE of something absent is a no-op; the key goes with its last location.
        assert_eq!(
            delta(&store, "a", 3, 3, vec![rm("nope"), KvEvent::remove("k1", TierType::Hbm)]).acked_seq(),
            Some(3)
        );
        assert_eq!(store.key_count().unwrap(), 0);
        assert_eq!(store.node_key_count("a").unwrap(), 0);
        assert_eq!(store.get_node("a").unwrap().unwrap().last_applied_seq, 3);
    }
}

fn remove_only_touches_the_sending_node(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    register(&store, "b", 0);
    delta(&store, "a", 1, 1, vec![add("k", 1)]);
    delta(&store, "b", 1, 1, vec![add("k", 1)]);
    delta(&store, "b", 2, 2, vec![rm("k")]);
    assert_eq!(locs(&store, "k"), vec![dram("a", 1)]);
}

fn duplicate_add_overwrites_the_size(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        delta(&store, "a", 1, 1, vec![add("k", 100)]);
        delta(&store, "a", 2, 2, vec![add("k", 300)]);
        // One location, with the newer report's size (the reference kept the old size, §7.7).
        assert_eq!(locs(&store, "k"), vec![dram("a", 300)]);
        assert_eq!(store.node_key_count("a").unwrap(), 1);
    }
}

fn unknown_tier_events_are_skipped(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    assert_eq!(
        delta(&store, "a", 1, 1, vec![KvEvent::add("k", TierType::Unknown, 1), add("ok", 1)]).acked_seq(),
        Some(1)
    );
    assert!(store.lookup("k").unwrap().is_empty());
    assert_eq!(store.key_count().unwrap(), 1);
}

fn seq_gap_keeps_liveness_and_caps_but_not_seq_or_events(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    assert_eq!(delta(&store, "a", 10, 1, vec![add("k1", 1)]).acked_seq(), Some(1));
    let gap = delta(&store, "a", 20, 3, vec![add("k3", 1)]);
    assert_eq!(gap, HeartbeatOutcome::SeqGap { acked_seq: 1 });
    assert!(gap.requests_full_sync());
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!((rec.last_heartbeat_ms, rec.last_applied_seq), (20, 1));
    assert_eq!(rec.caps, caps(), "§7.3 fix: a gap refreshes capacity too");
    assert!(store.lookup("k3").unwrap().is_empty());
    // Liveness was refreshed: a reaper with cutoff 15 leaves it alone.
    assert!(store.expire_stale(15).unwrap().is_empty());
    // The stream resumes where the master stands.
    assert_eq!(delta(&store, "a", 30, 2, vec![add("k2", 1)]), HeartbeatOutcome::Applied { acked_seq: 2 });
}

fn resent_applied_delta_is_reacked_without_reapplying(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        assert_eq!(delta(&store, "a", 1, 1, vec![add("k", 1)]).acked_seq(), Some(1));
        assert_eq!(delta(&store, "a", 2, 2, vec![rm("k")]).acked_seq(), Some(2));
        // A re-send of seq 1 (its ack was lost) must not resurrect k, nor ask for a full sync (§7.4).
        let again = delta(&store, "a", 3, 1, vec![add("k", 1)]);
        assert_eq!(again, HeartbeatOutcome::AlreadyApplied { acked_seq: 2 });
        assert!(!again.requests_full_sync());
        assert!(store.lookup("k").unwrap().is_empty());
        // Re-sending the latest one is also a re-ack.
        assert_eq!(delta(&store, "a", 4, 2, vec![rm("k")]), HeartbeatOutcome::AlreadyApplied { acked_seq: 2 });
        let rec = store.get_node("a").unwrap().unwrap();
        assert_eq!((rec.last_applied_seq, rec.last_heartbeat_ms), (2, 4));
        assert_eq!(delta(&store, "a", 5, 3, vec![add("k", 7)]), HeartbeatOutcome::Applied { acked_seq: 3 });
        assert_eq!(locs(&store, "k"), vec![dram("a", 7)]);
    }
}

fn keepalive_refreshes_caps_and_liveness_and_acks_last_applied(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    delta(&store, "a", 1, 1, vec![add("k", 1)]);
    let new_caps = vec![TierCap::new(TierType::Dram, 1 << 30, 12345), TierCap::new(TierType::Hbm, 10, 5)];
    assert_eq!(keepalive(&store, "a", 500, new_caps.clone()), HeartbeatOutcome::Applied { acked_seq: 1 });
    let rec = store.get_node("a").unwrap().unwrap();
    assert_eq!(rec.caps, new_caps, "§7.3 fix: keepalives refresh capacity");
    assert_eq!((rec.last_heartbeat_ms, rec.last_applied_seq), (500, 1));
    assert_eq!(locs(&store, "k"), vec![dram("a", 1)]);
}

fn page_sizes_round_trip_through_register_keepalive_and_credit(kind: Kind) {
    let store = kind.one();
    let paged = vec![
        TierCap::new(TierType::Dram, 1 << 30, 1 << 29).with_page_size(2 << 20),
        TierCap::new(TierType::Ssd, 1 << 40, 1 << 20).with_page_size(64 << 10),
        TierCap::new(TierType::Hbm, 10, 5),
    ];
    let reg = Registration { tier_capacities: paged.clone(), ..registration("a") };
    assert_eq!(store.register(reg, 0, STALE).unwrap(), RegisterOutcome::Registered);
    assert_eq!(store.get_node("a").unwrap().unwrap().caps, paged, "eviction charges whole pages of these");
    assert_eq!(store.list_alive().unwrap()[0].caps, paged, "the evictor's view");
    // Crediting freed pages changes the room, never the page size.
    store.credit_capacity("a", TierType::Ssd, 64 << 10).unwrap();
    let credited = store.get_node("a").unwrap().unwrap().caps;
    assert_eq!(credited[1], TierCap::new(TierType::Ssd, 1 << 40, (1 << 20) + (64 << 10)).with_page_size(64 << 10));
    // The node's next report wins, its page sizes included.
    let report = vec![TierCap::new(TierType::Dram, 1 << 30, 7).with_page_size(4096)];
    assert_eq!(keepalive(&store, "a", 500, report.clone()), HeartbeatOutcome::Applied { acked_seq: 0 });
    assert_eq!(store.get_node("a").unwrap().unwrap().caps, report);
}

fn liveness_never_moves_backwards(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    keepalive(&store, "a", 500, caps());
    keepalive(&store, "a", 400, caps());
    assert_eq!(store.get_node("a").unwrap().unwrap().last_heartbeat_ms, 500);
}

fn full_sync_replaces_the_nodes_locations_only(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        register(&store, "b", 0);
        delta(&store, "a", 1, 1, vec![add("gone", 1), add("kept", 1), add("shared", 1)]);
        delta(&store, "b", 1, 1, vec![add("shared", 2)]);
        // REMOVEs in a full sync are ignored.
        let sync = vec![add("kept", 5), add("fresh", 6), rm("kept")];
        assert_eq!(full_sync(&store, "a", 2, 9, sync), HeartbeatOutcome::Applied { acked_seq: 9 });
        assert!(store.lookup("gone").unwrap().is_empty());
        assert_eq!(locs(&store, "kept"), vec![dram("a", 5)]);
        assert_eq!(locs(&store, "fresh"), vec![dram("a", 6)]);
        assert_eq!(locs(&store, "shared"), vec![dram("b", 2)]);
        assert_eq!(store.get_node("a").unwrap().unwrap().last_applied_seq, 9);
        assert_eq!(delta(&store, "a", 3, 10, vec![add("next", 1)]), HeartbeatOutcome::Applied { acked_seq: 10 });
    }
}

fn empty_full_sync_clears_the_node(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    delta(&store, "a", 1, 1, (0..100).map(|i| add(&format!("k{i}"), 1)).collect());
    // A clear's empty sync carries a fresh baseline (the node's next seq).
    assert_eq!(full_sync(&store, "a", 2, 2, Vec::new()), HeartbeatOutcome::Applied { acked_seq: 2 });
    assert_eq!(store.key_count().unwrap(), 0);
    assert_eq!(store.node_key_count("a").unwrap(), 0);
}

fn full_sync_heals_a_gap(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    delta(&store, "a", 1, 1, vec![add("k1", 1)]);
    assert!(delta(&store, "a", 2, 5, vec![add("k5", 1)]).requests_full_sync());
    assert_eq!(full_sync(&store, "a", 3, 5, vec![add("k1", 1), add("k5", 1)]).acked_seq(), Some(5));
    assert_eq!(store.key_count().unwrap(), 2);
    assert_eq!(delta(&store, "a", 4, 6, vec![rm("k1")]).acked_seq(), Some(6));
}

fn chunked_full_sync_then_delta_lines_up_at_baseline_plus_one(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        delta(&store, "a", 1, 1, vec![add("stale", 1)]);
        let keys: Vec<String> = (0..300).map(|i| format!("key-{i}")).collect();
        let part = |range: std::ops::Range<usize>| keys[range].iter().map(|k| add(k, 64)).collect::<Vec<_>>();
        assert_eq!(chunk(&store, "a", 2, 40, 0, false, part(0..100)), HeartbeatOutcome::Applied { acked_seq: 1 });
        // Mark and sweep: a key absent from the sync stays readable until the final chunk.
        assert_eq!(locs(&store, "stale"), vec![dram("a", 1)]);
        assert_eq!(chunk(&store, "a", 3, 40, 1, false, part(100..200)), HeartbeatOutcome::Applied { acked_seq: 1 });
        assert_eq!(store.get_node("a").unwrap().unwrap().last_applied_seq, 1, "seq moves on the final chunk only");
        assert_eq!(locs(&store, "stale"), vec![dram("a", 1)]);
        assert_eq!(chunk(&store, "a", 4, 40, 2, true, part(200..300)), HeartbeatOutcome::Applied { acked_seq: 40 });
        assert!(store.lookup("stale").unwrap().is_empty(), "the final chunk sweeps what the sync did not report");
        assert_eq!(store.key_count().unwrap(), 300);
        assert_eq!(store.node_key_count("a").unwrap(), 300);
        assert_eq!(store.batch_exists(&keys).unwrap(), vec![true; 300]);
        assert_eq!(delta(&store, "a", 5, 41, vec![rm("key-0")]), HeartbeatOutcome::Applied { acked_seq: 41 });
        assert_eq!(store.key_count().unwrap(), 299);
    }
}

fn out_of_order_chunk_is_a_gap_and_the_sync_restarts_from_chunk_zero(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    // Chunk 1 without chunk 0.
    assert_eq!(chunk(&store, "a", 1, 10, 1, true, vec![add("x", 1)]), HeartbeatOutcome::SeqGap { acked_seq: 0 });
    assert!(store.lookup("x").unwrap().is_empty());
    // Chunk 2 after chunk 0 (chunk 1 lost): refused, and the in-progress sync is abandoned.
    chunk(&store, "a", 2, 10, 0, false, vec![add("c0", 1)]);
    assert_eq!(chunk(&store, "a", 3, 10, 2, false, vec![add("c2", 1)]), HeartbeatOutcome::SeqGap { acked_seq: 0 });
    assert_eq!(chunk(&store, "a", 4, 10, 1, true, vec![add("c1", 1)]), HeartbeatOutcome::SeqGap { acked_seq: 0 });
    // A chunk of another baseline does not continue the sync either.
    chunk(&store, "a", 5, 10, 0, false, vec![add("c0", 1)]);
    assert_eq!(chunk(&store, "a", 6, 11, 1, true, vec![add("c1", 1)]), HeartbeatOutcome::SeqGap { acked_seq: 0 });
    // Restart from chunk 0.
    chunk(&store, "a", 7, 12, 0, false, vec![add("c0", 1)]);
    assert_eq!(chunk(&store, "a", 8, 12, 1, true, vec![add("c1", 1)]), HeartbeatOutcome::Applied { acked_seq: 12 });
    assert_eq!(store.key_count().unwrap(), 2);
    assert!(store.lookup("c2").unwrap().is_empty());
}

fn delta_during_unfinished_full_sync_is_a_gap(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    delta(&store, "a", 1, 1, vec![add("k", 1)]);
    chunk(&store, "a", 2, 5, 0, false, vec![add("c0", 1)]);
    assert_eq!(delta(&store, "a", 3, 2, vec![add("d", 1)]), HeartbeatOutcome::SeqGap { acked_seq: 1 });
    assert!(store.lookup("d").unwrap().is_empty());
    // The sync was abandoned: its next chunk is refused.
    assert!(chunk(&store, "a", 4, 5, 1, true, vec![add("c1", 1)]).requests_full_sync());
    // A re-send of an applied delta is still just a re-ack, even mid-sync.
    chunk(&store, "a", 5, 5, 0, false, Vec::new());
    assert_eq!(delta(&store, "a", 6, 1, vec![add("k", 1)]), HeartbeatOutcome::AlreadyApplied { acked_seq: 1 });
    assert_eq!(chunk(&store, "a", 7, 5, 1, true, vec![add("c1", 1)]), HeartbeatOutcome::Applied { acked_seq: 5 });
}

fn keepalive_does_not_disturb_a_chunked_sync(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    chunk(&store, "a", 1, 3, 0, false, vec![add("c0", 1)]);
    assert_eq!(keepalive(&store, "a", 2, caps()), HeartbeatOutcome::Applied { acked_seq: 0 });
    assert_eq!(chunk(&store, "a", 3, 3, 1, true, vec![add("c1", 1)]), HeartbeatOutcome::Applied { acked_seq: 3 });
}

fn full_sync_older_than_last_applied_is_a_stale_copy(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    full_sync(&store, "a", 1, 4, vec![add("k", 1)]);
    delta(&store, "a", 2, 5, vec![rm("k")]);
    // A delayed duplicate of the baseline-4 sync must not resurrect k.
    assert_eq!(full_sync(&store, "a", 3, 4, vec![add("k", 1)]), HeartbeatOutcome::AlreadyApplied { acked_seq: 5 });
    assert!(store.lookup("k").unwrap().is_empty());
    // Every sync carries a fresh baseline, so one at the current seq is a stale copy too: nothing is
    // applied (not even its implicit wipe) and the ack is not its baseline.
    delta(&store, "a", 4, 6, vec![add("kept", 1)]);
    assert_eq!(full_sync(&store, "a", 5, 6, Vec::new()), HeartbeatOutcome::AlreadyApplied { acked_seq: 6 });
    assert_eq!(locs(&store, "kept"), vec![dram("a", 1)]);
    // A fresh baseline (e.g. a local clear's empty sync) is accepted.
    assert_eq!(full_sync(&store, "a", 6, 7, Vec::new()), HeartbeatOutcome::Applied { acked_seq: 7 });
    assert!(store.lookup("kept").unwrap().is_empty());
}

fn a_late_copy_of_an_applied_sync_applies_nothing(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        assert_eq!(
            full_sync(&store, "a", 1, 5, vec![add("k1", 1), add("x", 2)]),
            HeartbeatOutcome::Applied { acked_seq: 5 }
        );
        // A late copy of the B=5 sync's chunk 0 that lacks x (e.g. a retry of an earlier attempt).
        assert_eq!(
            chunk(&store, "a", 2, 5, 0, true, vec![add("k1", 1)]),
            HeartbeatOutcome::AlreadyApplied { acked_seq: 5 }
        );
        assert_eq!(
            chunk(&store, "a", 3, 5, 0, false, vec![add("k1", 1)]),
            HeartbeatOutcome::AlreadyApplied { acked_seq: 5 }
        );
        assert_eq!(locs(&store, "x"), vec![dram("a", 2)], "the stale copy must not drop x");
        assert_eq!(locs(&store, "k1"), vec![dram("a", 1)]);
        assert_eq!(store.node_key_count("a").unwrap(), 2);
        // The stream continues at 6, undisturbed.
        assert_eq!(delta(&store, "a", 4, 6, vec![rm("x")]), HeartbeatOutcome::Applied { acked_seq: 6 });
    }
}

fn reads_during_a_chunked_sync_see_the_previous_view(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        register(&store, "b", 0);
        delta(&store, "a", 1, 1, vec![add("held", 1), add("dropped", 1), KvEvent::add("held", TierType::Hbm, 3)]);
        delta(&store, "b", 1, 1, vec![add("dropped", 9)]);
        // Chunk 0 reports "held" on DRAM only (size changed), chunk 1 a new key.
        assert_eq!(chunk(&store, "a", 2, 2, 0, false, vec![add("held", 4)]).acked_seq(), Some(1));
        let got = store.batch_lookup_for_route_get(&owned(&["held", "dropped"]), &[], 3, 10).unwrap();
        assert_eq!(got[0].len(), 2, "a key held before the sync and reported by it stays visible: {got:?}");
        assert!(got[1].iter().any(|l| &*l.node_id == "a"), "a key absent from the sync stays until the final chunk");
        assert_eq!(store.node_key_count("a").unwrap(), 2);
        assert_eq!(chunk(&store, "a", 4, 2, 1, false, vec![add("new", 5)]).acked_seq(), Some(1));
        assert_eq!(locs(&store, "dropped"), vec![dram("a", 1), dram("b", 9)]);
        assert_eq!(store.node_key_count("a").unwrap(), 3);
        assert_eq!(chunk(&store, "a", 5, 2, 2, true, Vec::new()), HeartbeatOutcome::Applied { acked_seq: 2 });
        assert_eq!(locs(&store, "held"), vec![dram("a", 4)], "the unreported HBM replica is swept");
        assert_eq!(locs(&store, "dropped"), vec![dram("b", 9)], "b's replica is not a's to sweep");
        assert_eq!(locs(&store, "new"), vec![dram("a", 5)]);
        assert_eq!(store.node_key_count("a").unwrap(), 2);
        assert_eq!(store.key_count().unwrap(), 3);
    }
}

fn an_abandoned_sync_keeps_the_old_view_and_the_next_sync_ends_exact(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        delta(&store, "a", 1, 1, vec![add("old1", 1), add("old2", 1)]);
        // Chunks 0 and 1 of baseline 2, then the node gives up (e.g. it was cleared or timed out).
        chunk(&store, "a", 2, 2, 0, false, vec![add("old1", 1), add("half", 1)]);
        chunk(&store, "a", 3, 2, 1, false, vec![add("half2", 1)]);
        assert_eq!(locs(&store, "old2"), vec![dram("a", 1)], "nothing is swept by an unfinished sync");
        // A fresh sync with a new baseline replaces it; a late chunk of the abandoned one is refused
        // without disturbing the new one.
        assert_eq!(chunk(&store, "a", 4, 3, 0, false, vec![add("fresh", 1)]).acked_seq(), Some(1));
        assert_eq!(chunk(&store, "a", 5, 2, 2, true, vec![add("late", 1)]), HeartbeatOutcome::SeqGap { acked_seq: 1 });
        assert_eq!(chunk(&store, "a", 6, 2, 0, true, vec![add("late", 1)]), HeartbeatOutcome::SeqGap { acked_seq: 1 });
        assert!(store.lookup("late").unwrap().is_empty());
        assert_eq!(chunk(&store, "a", 7, 3, 1, true, vec![add("old2", 1)]), HeartbeatOutcome::Applied { acked_seq: 3 });
        let all = owned(&["old1", "old2", "half", "half2", "fresh", "late"]);
        assert_eq!(store.batch_exists(&all).unwrap(), vec![false, true, false, false, true, false]);
        assert_eq!(store.key_count().unwrap(), 2);
        assert_eq!(store.node_key_count("a").unwrap(), 2);
    }
}

fn reregistration_wipes_and_requires_a_fresh_stream(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    full_sync(&store, "a", 1, 7, vec![add("k", 1)]);
    store.expire_stale(100).unwrap();
    register(&store, "a", 200);
    assert!(store.lookup("k").unwrap().is_empty());
    // The master restarts the node's stream at 0; the node full-syncs at its own seq.
    assert_eq!(full_sync(&store, "a", 201, 7, vec![add("k", 1)]), HeartbeatOutcome::Applied { acked_seq: 7 });
    assert_eq!(locs(&store, "k"), vec![dram("a", 1)]);
}

contract!(
    delta_add_and_remove,
    remove_only_touches_the_sending_node,
    duplicate_add_overwrites_the_size,
    unknown_tier_events_are_skipped,
    seq_gap_keeps_liveness_and_caps_but_not_seq_or_events,
    resent_applied_delta_is_reacked_without_reapplying,
    keepalive_refreshes_caps_and_liveness_and_acks_last_applied,
    page_sizes_round_trip_through_register_keepalive_and_credit,
    liveness_never_moves_backwards,
    full_sync_replaces_the_nodes_locations_only,
    empty_full_sync_clears_the_node,
    full_sync_heals_a_gap,
    chunked_full_sync_then_delta_lines_up_at_baseline_plus_one,
    out_of_order_chunk_is_a_gap_and_the_sync_restarts_from_chunk_zero,
    delta_during_unfinished_full_sync_is_a_gap,
    keepalive_does_not_disturb_a_chunked_sync,
    full_sync_older_than_last_applied_is_a_stale_copy,
    a_late_copy_of_an_applied_sync_applies_nothing,
    reads_during_a_chunked_sync_see_the_previous_view,
    an_abandoned_sync_keeps_the_old_view_and_the_next_sync_ends_exact,
    reregistration_wipes_and_requires_a_fresh_stream,
);
