//! The external KV index of the metadata stores (contract tests, run against every store): report,
//! revoke, revoke-all, match, hit counts; ghost reports ignored; records gone with their node's
//! expiry, unregister and re-registration.

#![expect(
    clippy::unwrap_used,
    reason = "contract tests are plain functions that `contract!` wraps in #[test]; clippy exempts only the latter"
)]

#[macro_use]
#[path = "store_support/contract.rs"]
mod contract;
mod store_support;

use store_support::*;
use umbp_core::TierType::{self, Dram, Hbm, Ssd};
use umbp_master::store::{ExternalReport, MAX_EXTERNAL_KV_HASHES, MetadataStore, RegisterOutcome, StoreError};

/// `node → [(tier, hashes)]` of a match, as plain values.
type Matched = Vec<(String, Vec<(TierType, Vec<String>)>)>;

/// A match, its request indexes read back as the hashes they name.
fn matched(store: &dyn MetadataStore, hashes: &[&str], count: bool) -> Matched {
    store
        .match_external_kv(&keys(hashes), count)
        .unwrap()
        .into_iter()
        .map(|m| {
            let tiers = m
                .hashes_by_tier
                .into_iter()
                .map(|(tier, idx)| (tier, idx.into_iter().map(|i| hashes[i as usize].to_owned()).collect()))
                .collect();
            (m.node_id.to_string(), tiers)
        })
        .collect()
}

fn node(id: &str, tiers: &[(TierType, &[&str])]) -> (String, Vec<(TierType, Vec<String>)>) {
    (id.to_owned(), tiers.iter().map(|(t, hs)| (*t, keys(hs))).collect())
}

fn report(store: &dyn MetadataStore, id: &str, hashes: &[&str], tier: TierType) -> ExternalReport {
    store.report_external_kv(id, &keys(hashes), tier).unwrap()
}

fn counts(store: &dyn MetadataStore, hashes: &[&str]) -> Vec<(String, u64)> {
    store.external_kv_hit_counts(&keys(hashes)).unwrap()
}

fn a_match_answers_per_node_by_tier_in_request_order(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    register(&store, "b", 1_000);
    assert_eq!(report(&store, "a", &["h1", "h2"], Hbm), ExternalReport::Recorded);
    assert_eq!(report(&store, "a", &["h1"], Dram), ExternalReport::Recorded);
    assert_eq!(report(&store, "b", &["h2", "h3"], Ssd), ExternalReport::Recorded);
    // Additive and idempotent: the same report again changes nothing.
    assert_eq!(report(&store, "a", &["h2", "h1"], Hbm), ExternalReport::Recorded);
    let got = matched(&store, &["h3", "h1", "h2", "nope", "h1"], false);
    assert_eq!(got, vec![node("a", &[(Hbm, &["h1", "h2"]), (Dram, &["h1"])]), node("b", &[(Ssd, &["h3", "h2"])])]);
    // On the wire of the store: request indexes, a repeated hash named by its first occurrence.
    let raw = store.match_external_kv(&keys(&["h3", "h1", "h2", "nope", "h1"]), false).unwrap();
    assert_eq!(raw[0].hashes_by_tier, vec![(Hbm, vec![1, 2]), (Dram, vec![1])]);
    assert_eq!(raw[1].hashes_by_tier, vec![(Ssd, vec![0, 2])]);
    let m = store.match_external_kv(&keys(&["h1", "h2"]), false).unwrap();
    assert_eq!(m[0].matched_hash_count(), 2, "a hash on two tiers counts once");
    assert!(matched(&store, &["nope"], false).is_empty());
    assert!(matched(&store, &[], false).is_empty(), "an empty match matches nothing");
    // The key index is untouched: external blocks are not pool values.
    assert_eq!(store.key_count().unwrap(), 0);
    assert!(store.batch_exists(&keys(&["h1"])).unwrap() == vec![false]);
}

fn revoke_drops_one_tier_and_revoke_all_drops_a_tier(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    register(&store, "b", 1_000);
    report(&store, "a", &["h1", "h2"], Hbm);
    report(&store, "a", &["h1", "h2"], Dram);
    report(&store, "b", &["h1"], Dram);
    store.revoke_external_kv("a", &keys(&["h1", "never"]), Hbm).unwrap();
    assert_eq!(
        matched(&store, &["h1", "h2"], false),
        vec![node("a", &[(Hbm, &["h2"]), (Dram, &["h1", "h2"])]), node("b", &[(Dram, &["h1"])])]
    );
    // A revoke at a tier the node never reported changes nothing.
    store.revoke_external_kv("b", &keys(&["h1"]), Ssd).unwrap();
    store.revoke_all_external_kv_at_tier("a", Dram).unwrap();
    assert_eq!(
        matched(&store, &["h1", "h2"], false),
        vec![node("a", &[(Hbm, &["h2"])]), node("b", &[(Dram, &["h1"])])]
    );
    store.revoke_all_external_kv_at_tier("a", Hbm).unwrap();
    store.revoke_all_external_kv_at_tier("nobody", Hbm).unwrap();
    assert_eq!(matched(&store, &["h1", "h2"], false), vec![node("b", &[(Dram, &["h1"])])]);
    // Revokes need no live node: cleaning up after a dead one is allowed.
    store.unregister("b").unwrap();
    store.revoke_external_kv("b", &keys(&["h1"]), Dram).unwrap();
    store.revoke_all_external_kv_at_tier("b", Dram).unwrap();
    assert!(matched(&store, &["h1"], false).is_empty());
}

fn a_counted_match_counts_each_matched_hash_once(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    register(&store, "b", 1_000);
    report(&store, "a", &["h1", "h2"], Hbm);
    report(&store, "a", &["h1"], Dram);
    report(&store, "b", &["h1"], Dram);
    matched(&store, &["h1", "h2"], false);
    assert!(counts(&store, &["h1", "h2"]).is_empty(), "an uncounted match counts nothing");
    // h1 is held by two nodes on two tiers and asked twice: one hit per call.
    matched(&store, &["h1", "h1", "h2", "miss"], true);
    matched(&store, &["h1", "miss"], true);
    assert_eq!(counts(&store, &["miss", "h2", "h1", "h2"]), vec![("h2".to_owned(), 1), ("h1".to_owned(), 2)]);
    assert!(counts(&store, &[]).is_empty());
    // A revoke that leaves a holder keeps the count; the last holder takes it along.
    store.revoke_external_kv("a", &keys(&["h1"]), Hbm).unwrap();
    assert_eq!(counts(&store, &["h1"]), vec![("h1".to_owned(), 2)]);
    store.revoke_external_kv("a", &keys(&["h2"]), Hbm).unwrap();
    assert!(counts(&store, &["h2"]).is_empty());
}

fn a_report_of_a_node_that_is_not_alive_is_ignored(kind: Kind) {
    let store = kind.one();
    assert_eq!(report(&store, "ghost", &["h1"], Hbm), ExternalReport::NodeNotAlive);
    register(&store, "a", 1_000);
    assert_eq!(store.expire_stale(2_000).unwrap(), vec!["a".to_owned()]);
    assert_eq!(report(&store, "a", &["h1"], Hbm), ExternalReport::NodeNotAlive, "an expired node");
    assert!(matched(&store, &["h1"], false).is_empty());
    matched(&store, &["h1"], true);
    assert!(counts(&store, &["h1"]).is_empty(), "a miss counts nothing");
}

fn expiry_drops_a_nodes_records(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    register(&store, "b", 5_000);
    report(&store, "a", &["h1", "h2"], Hbm);
    report(&store, "a", &["h1"], Ssd);
    report(&store, "b", &["h2"], Dram);
    matched(&store, &["h1"], true);
    assert_eq!(store.expire_stale(2_000).unwrap(), vec!["a".to_owned()]);
    assert_eq!(matched(&store, &["h1", "h2"], false), vec![node("b", &[(Dram, &["h2"])])]);
    assert!(counts(&store, &["h1"]).is_empty(), "h1 went with its last holder");
    // Registered again, the node starts with no records, and reports anew.
    register(&store, "a", 3_000);
    assert_eq!(matched(&store, &["h1", "h2"], false), vec![node("b", &[(Dram, &["h2"])])]);
    report(&store, "a", &["h1"], Hbm);
    assert_eq!(matched(&store, &["h1"], false), vec![node("a", &[(Hbm, &["h1"])])]);
    assert_eq!(store.expire_stale(4_000).unwrap(), vec!["a".to_owned()]);
    assert_eq!(store.remove_expired(4_000).unwrap(), vec!["a".to_owned()]);
    assert!(matched(&store, &["h1"], false).is_empty());
}

fn a_new_incarnation_and_an_unregister_start_the_node_without_records(kind: Kind) {
    let store = kind.one();
    assert_eq!(store.register(registration_of("a", 10), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
    report(&store, "a", &["h1"], Hbm);
    // The same incarnation again changes nothing.
    assert_eq!(store.register(registration_of("a", 10), 1_500, STALE).unwrap(), RegisterOutcome::AlreadyExists);
    assert_eq!(matched(&store, &["h1"], false).len(), 1);
    // A restarted process replaces the live record: its predecessor's blocks are not its own.
    assert_eq!(
        store.register(registration_of("a", 11), 2_000, STALE).unwrap(),
        RegisterOutcome::Replaced { previous: 10 }
    );
    assert!(matched(&store, &["h1"], false).is_empty());
    report(&store, "a", &["h2"], Dram);
    // A superseded process leaving erases nothing; the standing one leaving erases its records.
    assert!(!store.unregister_incarnation("a", 10).unwrap());
    assert_eq!(matched(&store, &["h2"], false).len(), 1);
    assert!(store.unregister_incarnation("a", 11).unwrap());
    assert!(matched(&store, &["h2"], false).is_empty());
    assert_eq!(report(&store, "a", &["h2"], Dram), ExternalReport::NodeNotAlive);
}

fn bad_arguments_are_refused(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 1_000);
    let invalid = |r: Result<(), StoreError>| matches!(r, Err(StoreError::InvalidArgument { .. }));
    let one = keys(&["h"]);
    assert!(invalid(store.report_external_kv("", &one, Hbm).map(drop)));
    assert!(invalid(store.report_external_kv("a", &[], Hbm).map(drop)));
    assert!(invalid(store.report_external_kv("a", &one, TierType::Unknown).map(drop)));
    assert!(invalid(store.report_external_kv("a", &keys(&["h", ""]), Hbm).map(drop)));
    let too_many: Vec<String> = (0..=MAX_EXTERNAL_KV_HASHES).map(|i| format!("h{i}")).collect();
    assert!(invalid(store.report_external_kv("a", &too_many, Hbm).map(drop)));
    assert!(invalid(store.revoke_external_kv("", &one, Hbm)));
    assert!(invalid(store.revoke_external_kv("a", &[], Hbm)));
    assert!(invalid(store.revoke_all_external_kv_at_tier("", Hbm)));
    assert!(invalid(store.revoke_all_external_kv_at_tier("a", TierType::Unknown)));
    assert!(invalid(store.match_external_kv(&too_many, false).map(drop)));
    assert!(invalid(store.external_kv_hit_counts(&keys(&[""])).map(drop)));
    // Nothing was recorded by the refused calls; the largest allowed call goes through.
    assert!(matched(&store, &["h"], false).is_empty());
    let most = &too_many[..MAX_EXTERNAL_KV_HASHES];
    assert_eq!(store.report_external_kv("a", most, Dram).unwrap(), ExternalReport::Recorded);
    let all = store.match_external_kv(most, true).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].matched_hash_count(), MAX_EXTERNAL_KV_HASHES);
}

contract!(
    a_match_answers_per_node_by_tier_in_request_order,
    revoke_drops_one_tier_and_revoke_all_drops_a_tier,
    a_counted_match_counts_each_matched_hash_once,
    a_report_of_a_node_that_is_not_alive_is_ignored,
    expiry_drops_a_nodes_records,
    a_new_incarnation_and_an_unregister_start_the_node_without_records,
    bad_arguments_are_refused,
);
