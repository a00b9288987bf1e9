//! The metadata stores under concurrent writers and readers (contract tests, run against both).

#![expect(
    clippy::unwrap_used,
    reason = "contract tests are plain functions that `contract!` wraps in #[test]; clippy exempts only the latter"
)]

#[macro_use]
#[path = "store_support/contract.rs"]
mod contract;
mod store_support;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use store_support::*;
use umbp_core::{KvEvent, TierType};
use umbp_master::store::{MetadataStore, RegisterOutcome};

const KEYS: u64 = 256;

fn key(i: u64) -> String {
    format!("key-{i:04}")
}

/// Two writers re-`ADD` every key with a size that encodes (round, key index) and remove half of them
/// each round, while readers route-get batches. A reader must never see a torn entry: every size
/// belongs to its key, no (node, tier) repeats, and only the two writers appear.
fn route_gets_racing_heartbeats_never_see_torn_entries(kind: Kind) {
    for store in kind.stores_of(&[1, 8]) {
        let store = Arc::new(store);
        register(&*store, "w0", 0);
        register(&*store, "w1", 0);
        let stop = Arc::new(AtomicBool::new(false));
        let all_keys: Vec<String> = (0..KEYS).map(key).collect();

        let writers: Vec<_> = ["w0", "w1"]
            .into_iter()
            .map(|node| {
                let store = Arc::clone(&store);
                thread::spawn(move || {
                    for round in 1..=200u64 {
                        let mut events: Vec<KvEvent> = (0..KEYS).map(|i| add(&key(i), round * 1_000 + i)).collect();
                        events.extend((0..KEYS).filter(|i| (i + round) % 2 == 0).map(|i| rm(&key(i))));
                        let outcome = delta(&*store, node, round, round, events);
                        assert_eq!(outcome.acked_seq(), Some(round));
                    }
                })
            })
            .collect();
        let readers: Vec<_> = (0..2)
            .map(|r| {
                let (store, stop, all_keys) = (Arc::clone(&store), Arc::clone(&stop), all_keys.clone());
                thread::spawn(move || {
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let exclude = if r == 1 { keys(&["w1"]) } else { Vec::new() };
                        let got = store.batch_lookup_for_route_get(&all_keys, &exclude, 10, 100).unwrap();
                        assert_eq!(got.len(), all_keys.len());
                        for (i, locations) in got.iter().enumerate() {
                            let mut pairs = HashSet::new();
                            for loc in locations {
                                assert_eq!(loc.size % 1_000, i as u64, "size of another key: torn entry");
                                assert!(pairs.insert((loc.node_id.clone(), loc.tier)), "duplicate location");
                                assert!(&*loc.node_id == "w0" || (&*loc.node_id == "w1" && r == 0));
                                seen += 1;
                            }
                        }
                        let exists = store.batch_exists(&all_keys).unwrap();
                        assert_eq!(exists.len(), all_keys.len());
                    }
                    seen
                })
            })
            .collect();
        for writer in writers {
            writer.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for reader in readers {
            reader.join().unwrap();
        }
        // Quiescent: round 200 removed the even keys, so only the odd ones remain, on both writers.
        for i in 0..KEYS {
            let expected = if i % 2 == 0 { 0 } else { 2 };
            assert_eq!(store.lookup(&key(i)).unwrap().len(), expected, "key {i}");
        }
        assert_eq!(store.key_count().unwrap(), KEYS / 2);
    }
}

/// Heartbeats of a node race its unregister or expiry. Once the node is no longer alive, no location
/// of it may remain in the index: a heartbeat that passed its seq check must not insert after the
/// wipe (the store serializes the writes of one node).
fn no_phantom_locations_after_membership_churn(kind: Kind) {
    for store in kind.stores_of(&[1, 8]) {
        let store = Arc::new(store);
        for episode in 0..200u64 {
            assert_eq!(store.register(registration("churn"), episode, 0).unwrap(), RegisterOutcome::Registered);
            let barrier = Arc::new(Barrier::new(3));
            let heartbeaters: Vec<_> = (0..2u64)
                .map(|t| {
                    let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
                    thread::spawn(move || {
                        barrier.wait();
                        for i in 0..200u64 {
                            let Some(rec) = store.get_node("churn").unwrap() else { return };
                            let events = (0..32).map(|k| add(&key((i * 32 + k + t * 7) % KEYS), 1)).collect();
                            let outcome = if i % 10 == 9 {
                                full_sync(&*store, "churn", i, rec.last_applied_seq + 1, events)
                            } else {
                                delta(&*store, "churn", i, rec.last_applied_seq + 1, events)
                            };
                            if outcome.acked_seq().is_none() {
                                return;
                            }
                        }
                    })
                })
                .collect();
            barrier.wait();
            thread::yield_now();
            if episode % 2 == 0 {
                store.unregister("churn").unwrap();
            } else {
                store.expire_stale(u64::MAX).unwrap();
            }
            for h in heartbeaters {
                h.join().unwrap();
            }
            assert_eq!(store.key_count().unwrap(), 0, "phantom locations after episode {episode}");
            assert_eq!(store.node_key_count("churn").unwrap(), 0);
        }
        // Registration after the churn starts clean.
        assert_eq!(store.register(registration("churn"), 1_000, STALE).unwrap(), RegisterOutcome::Registered);
        assert_eq!(store.key_count().unwrap(), 0);
        assert!(store.enumerate_eviction_candidates(&[("churn".into(), TierType::Dram)], 0, 0).unwrap().is_empty());
    }
}

contract!(route_gets_racing_heartbeats_never_see_torn_entries, no_phantom_locations_after_membership_churn,);
