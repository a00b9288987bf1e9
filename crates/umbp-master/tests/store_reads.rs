//! Reads of the metadata stores (contract tests, run against both): lookups, route-get leases and
//! access stamps, existence and eviction candidates.

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
use umbp_master::store::{EvictionCandidate, KeyStats, Location, MetadataStore};

fn ids(locations: &[Location]) -> Vec<String> {
    let mut out: Vec<_> = locations.iter().map(|loc| loc.node_id.to_string()).collect();
    out.sort();
    out
}

fn stats(store: &Subject, key: &str) -> KeyStats {
    store.key_stats(key).expect("key in the index")
}

fn route_get_leases_and_stamps_only_found_keys(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        delta(&store, "a", 100, 1, vec![add("hit", 8), add("idle", 8)]);
        let before = stats(&store, "hit");
        assert_eq!(before, KeyStats { lease_until_ms: 0, last_accessed_ms: 100, access_count: 0 });

        let got = store.batch_lookup_for_route_get(&keys(&["hit", "miss", "hit"]), &[], 1_000, 2_000).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[0], vec![Location { node_id: "a".into(), tier: TierType::Dram, size: 8 }]);
        assert!(got[1].is_empty());
        assert_eq!(got[2], got[0]);
        // Both occurrences of "hit" count as accesses.
        assert_eq!(stats(&store, "hit"), KeyStats { lease_until_ms: 3_000, last_accessed_ms: 1_000, access_count: 2 });
        assert_eq!(stats(&store, "idle"), KeyStats { lease_until_ms: 0, last_accessed_ms: 100, access_count: 0 });
        assert_eq!(store.key_stats("miss"), None);

        // A later, shorter lease never shortens the earlier one; last access never moves back.
        store.batch_lookup_for_route_get(&keys(&["hit"]), &[], 500, 10).unwrap();
        assert_eq!(stats(&store, "hit"), KeyStats { lease_until_ms: 3_000, last_accessed_ms: 1_000, access_count: 3 });
    }
}

fn lookup_and_exists_have_no_side_effects(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    delta(&store, "a", 100, 1, vec![add("k", 8)]);
    assert_eq!(store.lookup("k").unwrap().len(), 1);
    assert_eq!(store.batch_exists(&keys(&["k", "nope", "k"])).unwrap(), vec![true, false, true]);
    assert_eq!(stats(&store, "k"), KeyStats { lease_until_ms: 0, last_accessed_ms: 100, access_count: 0 });
}

fn excluded_nodes_are_filtered_inside_and_grant_no_lease(kind: Kind) {
    for store in kind.all() {
        register(&store, "a", 0);
        register(&store, "b", 0);
        delta(&store, "a", 1, 1, vec![add("both", 1), add("only-a", 1)]);
        delta(&store, "b", 1, 1, vec![add("both", 1)]);
        let got = store.batch_lookup_for_route_get(&keys(&["both", "only-a"]), &keys(&["a"]), 1_000, 2_000).unwrap();
        assert_eq!(ids(&got[0]), vec!["b"]);
        assert!(got[1].is_empty(), "every replica excluded = not found");
        assert_eq!(stats(&store, "both").access_count, 1);
        assert_eq!(stats(&store, "only-a"), KeyStats { lease_until_ms: 0, last_accessed_ms: 1, access_count: 0 });
        // Excluding everything: nothing found, nothing leased.
        let none = store.batch_lookup_for_route_get(&keys(&["both"]), &keys(&["b", "a"]), 2_000, 2_000).unwrap();
        assert!(none[0].is_empty());
        assert_eq!(stats(&store, "both").access_count, 1);
    }
}

fn never_returns_locations_of_expired_or_unregistered_nodes(kind: Kind) {
    for store in kind.all() {
        register(&store, "dead", 0);
        register(&store, "live", 0);
        register(&store, "gone", 0);
        delta(&store, "dead", 10, 1, vec![add("k", 1), add("dead-only", 1)]);
        delta(&store, "gone", 10, 1, vec![add("k", 1)]);
        delta(&store, "live", 50_000, 1, vec![add("k", 1)]);
        keepalive(&store, "gone", 50_000, caps());
        assert_eq!(store.expire_stale(40_000).unwrap(), vec!["dead".to_owned()]);
        store.unregister("gone").unwrap();
        let got = store.batch_lookup_for_route_get(&keys(&["k", "dead-only"]), &[], 60_000, 2_000).unwrap();
        assert_eq!(ids(&got[0]), vec!["live"]);
        assert!(got[1].is_empty());
        assert_eq!(ids(&store.lookup("k").unwrap()), vec!["live"]);
        assert_eq!(store.batch_exists(&keys(&["dead-only"])).unwrap(), vec![false]);
    }
}

fn cand(key: &str, node: &str, tier: TierType, size: u64, last: u64) -> EvictionCandidate {
    EvictionCandidate { key: key.into(), node_id: node.into(), tier, size, last_accessed_ms: last }
}

/// a: DRAM keys d0..d4 added at t = 10..14; HBM key h0 at t = 20. b: DRAM key b0 at t = 30.
fn eviction_fixture(store: &Subject) {
    register(store, "a", 0);
    register(store, "b", 0);
    for i in 0..5u64 {
        delta(store, "a", 10 + i, i + 1, vec![add(&format!("d{i}"), 100 + i)]);
    }
    delta(store, "a", 20, 6, vec![KvEvent::add("h0", TierType::Hbm, 7)]);
    delta(store, "b", 30, 1, vec![add("b0", 9)]);
}

fn eviction_candidates_oldest_first_and_leased_skipped(kind: Kind) {
    for store in kind.all() {
        eviction_fixture(&store);
        // Touch d0 (oldest) with a lease until 2_100, and d1 with a lease that ends at 1_005.
        store.batch_lookup_for_route_get(&keys(&["d0"]), &[], 100, 2_000).unwrap();
        store.batch_lookup_for_route_get(&keys(&["d1"]), &[], 5, 1_000).unwrap();
        let got = store.enumerate_eviction_candidates(&[("a".into(), TierType::Dram)], 1_500, 0).unwrap();
        // d0 is leased; d1's lease ended at 1_005, and its access at t=5 did not move its last access
        // back from 11.
        assert_eq!(
            got,
            vec![
                cand("d1", "a", TierType::Dram, 101, 11),
                cand("d2", "a", TierType::Dram, 102, 12),
                cand("d3", "a", TierType::Dram, 103, 13),
                cand("d4", "a", TierType::Dram, 104, 14),
            ]
        );
        // After d0's lease ends it is a candidate again, ordered by its access at t=100.
        let later = store.enumerate_eviction_candidates(&[("a".into(), TierType::Dram)], 2_100, 0).unwrap();
        let order: Vec<_> = later.iter().map(|c| c.key.to_string()).collect();
        assert_eq!(order, vec!["d1", "d2", "d3", "d4", "d0"]);
    }
}

fn eviction_candidates_cap_and_only_requested_buckets(kind: Kind) {
    for store in kind.all() {
        eviction_fixture(&store);
        let got = store
            .enumerate_eviction_candidates(
                &[("b".into(), TierType::Dram), ("a".into(), TierType::Dram), ("a".into(), TierType::Dram)],
                1_000,
                2,
            )
            .unwrap();
        // Buckets in request order (the repeat counts once), each capped at its 2 oldest.
        assert_eq!(
            got,
            vec![
                cand("b0", "b", TierType::Dram, 9, 30),
                cand("d0", "a", TierType::Dram, 100, 10),
                cand("d1", "a", TierType::Dram, 101, 11),
            ]
        );
        let hbm = store.enumerate_eviction_candidates(&[("a".into(), TierType::Hbm)], 1_000, 0).unwrap();
        assert_eq!(hbm, vec![cand("h0", "a", TierType::Hbm, 7, 20)]);
        assert!(store.enumerate_eviction_candidates(&[("a".into(), TierType::Ssd)], 1_000, 0).unwrap().is_empty());
        assert!(store.enumerate_eviction_candidates(&[("zz".into(), TierType::Dram)], 1_000, 0).unwrap().is_empty());
        assert!(store.enumerate_eviction_candidates(&[], 1_000, 0).unwrap().is_empty());
    }
}

fn eviction_candidates_skip_expired_nodes(kind: Kind) {
    let store = kind.one();
    eviction_fixture(&store);
    keepalive(&store, "b", 10_000, caps());
    store.expire_stale(5_000).unwrap();
    let got = store
        .enumerate_eviction_candidates(&[("a".into(), TierType::Dram), ("b".into(), TierType::Dram)], 20_000, 0)
        .unwrap();
    assert_eq!(got, vec![cand("b0", "b", TierType::Dram, 9, 30)]);
}

fn counts_follow_the_index(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    register(&store, "b", 0);
    delta(&store, "a", 1, 1, vec![add("x", 1), KvEvent::add("x", TierType::Hbm, 1), add("y", 1)]);
    delta(&store, "b", 1, 1, vec![add("x", 1)]);
    assert_eq!(store.key_count().unwrap(), 2);
    assert_eq!(store.node_key_count("a").unwrap(), 2, "a key on two tiers of a node counts once");
    assert_eq!(store.node_key_count("b").unwrap(), 1);
    assert_eq!(store.node_key_count("nobody").unwrap(), 0);
}

contract!(
    route_get_leases_and_stamps_only_found_keys,
    lookup_and_exists_have_no_side_effects,
    excluded_nodes_are_filtered_inside_and_grant_no_lease,
    never_returns_locations_of_expired_or_unregistered_nodes,
    eviction_candidates_oldest_first_and_leased_skipped,
    eviction_candidates_cap_and_only_requested_buckets,
    eviction_candidates_skip_expired_nodes,
    counts_follow_the_index,
);
