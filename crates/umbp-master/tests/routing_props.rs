//! Property tests of put routing over random clusters, batches, excludes and every algo × affinity:
//! routed keys fit their slot's projected capacity, no slot is over-committed, dedup is free, and
//! affinity never turns a routable key into `Unavailable`.

use std::collections::HashMap;

use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use umbp_core::TierType;
use umbp_master::routing::{
    Affinity, Candidate, PutDecision, PutStrategyConfig, RoutePutStrategy, SelectAlgo, TierSlot,
};

#[derive(Debug, Clone)]
struct Case {
    candidates: Vec<Candidate>,
    sizes: Vec<u64>,
    exists: Vec<bool>,
    exclude: Vec<String>,
    requester: String,
    config: PutStrategyConfig,
    seed: u64,
}

fn config() -> impl Strategy<Value = PutStrategyConfig> {
    (
        prop_oneof![Just(SelectAlgo::MostAvailable), Just(SelectAlgo::Random)],
        prop_oneof![Just(Affinity::None), Just(Affinity::Same), Just(Affinity::Local)],
    )
        .prop_map(|(algo, affinity)| PutStrategyConfig::new(algo, affinity))
}

fn node(index: usize) -> impl Strategy<Value = Candidate> {
    // Each real tier present or not, with small capacities so batches contend for room.
    proptest::collection::vec(proptest::option::of(0u64..64), 3).prop_map(move |avail| {
        let tiers = TierType::ALL
            .iter()
            .zip(avail)
            .filter_map(|(&tier, avail)| avail.map(|a| TierSlot::new(tier, 64, a)))
            .collect();
        Candidate::new(format!("n{index}"), format!("n{index}:9000"), tiers)
    })
}

fn case() -> impl Strategy<Value = Case> {
    (0usize..6)
        .prop_flat_map(|n| {
            let nodes: Vec<_> = (0..n).map(node).collect();
            (
                nodes,
                proptest::collection::vec((0u64..24, proptest::bool::weighted(0.2)), 0..40),
                proptest::collection::vec(0usize..7, 0..3),
                0usize..7,
                config(),
                any::<u64>(),
            )
        })
        .prop_map(|(candidates, keys, exclude, requester, config, seed)| Case {
            candidates,
            sizes: keys.iter().map(|&(size, _)| size).collect(),
            exists: keys.iter().map(|&(_, exists)| exists).collect(),
            exclude: exclude.into_iter().map(|i| format!("n{i}")).collect(),
            requester: format!("n{requester}"),
            config,
            seed,
        })
}

fn run(case: &Case, sizes: &[u64], exists: &[bool]) -> Vec<PutDecision> {
    RoutePutStrategy::new(case.config).select_batch(
        &case.requester,
        sizes,
        exists,
        &case.candidates,
        &case.exclude,
        &mut SmallRng::seed_from_u64(case.seed),
    )
}

/// The free bytes of every non-excluded (node, tier) before the batch.
fn initial_capacity(case: &Case) -> HashMap<(String, TierType), u64> {
    case.candidates
        .iter()
        .filter(|c| !case.exclude.iter().any(|e| **e == *c.node_id))
        .flat_map(|c| c.tiers.iter().map(|t| ((c.node_id.to_string(), t.tier), t.available_bytes)))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Replays the batch against a model of projected capacity: every routed key names a
    /// non-excluded slot that still had room for it (so per slot the routed sizes never exceed its
    /// free bytes), every dedup key is `AlreadyExists`, and a key is `Unavailable` only if it is
    /// zero-sized or no slot at all could take it at that point — whatever the affinity.
    #[test]
    fn routed_keys_fit_projected_capacity_and_affinity_never_loses_a_key(case in case()) {
        let out = run(&case, &case.sizes, &case.exists);
        prop_assert_eq!(out.len(), case.sizes.len());
        let initial = initial_capacity(&case);
        let mut left = initial.clone();
        for (i, decision) in out.iter().enumerate() {
            let (size, exists) = (case.sizes[i], case.exists[i]);
            if exists {
                prop_assert_eq!(decision, &PutDecision::AlreadyExists);
                continue;
            }
            match decision {
                PutDecision::Routed(p) => {
                    prop_assert!(size > 0);
                    let slot = left.get_mut(&(p.node_id.to_string(), p.tier));
                    prop_assert!(slot.is_some(), "key {} routed to excluded or unknown slot {:?}", i, p);
                    let free = slot.expect("checked");
                    prop_assert!(*free >= size, "key {} of {} bytes over-commits {:?} ({} free)", i, size, p, free);
                    *free -= size;
                    let peer = &case.candidates.iter().find(|c| c.node_id == p.node_id).expect("routed to a candidate").peer_address;
                    prop_assert_eq!(&p.peer_address, peer);
                }
                PutDecision::Unavailable => {
                    let routable = size > 0 && left.values().any(|&free| free >= size);
                    prop_assert!(!routable, "key {} of {} bytes was routable under {} but dropped", i, size, case.config);
                }
                PutDecision::AlreadyExists => prop_assert!(false, "key {} is not indexed", i),
            }
        }
        for (slot, free) in &left {
            prop_assert!(*free <= initial[slot]);
        }
    }

    /// Dropping the dedup keys from the batch leaves every other decision unchanged: an
    /// `AlreadyExists` key consumes no capacity, no random draw and no share of `same`'s total.
    #[test]
    fn already_exists_never_consumes_capacity(case in case()) {
        let out = run(&case, &case.sizes, &case.exists);
        let kept: Vec<usize> = (0..case.sizes.len()).filter(|&i| !case.exists[i]).collect();
        let sizes: Vec<u64> = kept.iter().map(|&i| case.sizes[i]).collect();
        let without_dedup = run(&case, &sizes, &vec![false; sizes.len()]);
        let with_dedup: Vec<PutDecision> = kept.iter().map(|&i| out[i].clone()).collect();
        prop_assert_eq!(with_dedup, without_dedup);
    }

    /// A key alone in its batch is routed under every affinity exactly when the plain algorithm
    /// routes it.
    #[test]
    fn single_key_routability_does_not_depend_on_affinity(case in case(), size in 0u64..80) {
        let routed = |affinity| {
            let case = Case { config: PutStrategyConfig::new(case.config.algo, affinity), ..case.clone() };
            run(&case, &[size], &[false])[0].is_routed()
        };
        let base = routed(Affinity::None);
        prop_assert_eq!(routed(Affinity::Same), base);
        prop_assert_eq!(routed(Affinity::Local), base);
    }

    /// Mismatched dedup lists answer every key `Unavailable`, never panic.
    #[test]
    fn mismatched_lengths_are_all_unavailable(case in case(), extra in 1usize..3) {
        let exists = vec![false; case.sizes.len() + extra];
        let out = run(&case, &case.sizes, &exists);
        prop_assert_eq!(out, vec![PutDecision::Unavailable; case.sizes.len()]);
    }
}
