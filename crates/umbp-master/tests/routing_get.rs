//! Get routing: the reference's `test_route_get_strategy` and `test_local_preferring_route_get`.

use std::collections::{BTreeMap, BTreeSet};

use rand::SeedableRng;
use rand::rngs::StdRng;
use umbp_core::TierType;
use umbp_master::routing::{GetAlgo, Replica, ReplicaNode, RouteGetStrategy, RoutingConfigError};

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<RouteGetStrategy>();
    send_sync::<Replica>();
};

fn loc(node_id: &str, tier: TierType) -> Replica {
    Replica::new(node_id, tier, 4096)
}

fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// The node each of `n` selections picked.
fn picks(strategy: RouteGetStrategy, requester: &str, locations: &[Replica], n: usize, seed: u64) -> Vec<String> {
    let mut rng = rng(seed);
    (0..n)
        .map(|_| {
            let index = strategy.select(requester, locations, &mut rng).expect("non-empty list");
            locations[index].node_id.to_string()
        })
        .collect()
}

#[test]
fn local_replica_wins_whatever_its_tier() {
    let locations = [loc("dram-a", TierType::Dram), loc("requester", TierType::Ssd)];
    for seed in 0..100 {
        let index = RouteGetStrategy::default().select("requester", &locations, &mut rng(seed));
        assert_eq!(index, Some(1));
    }
}

#[test]
fn local_replica_beats_remote_peers_on_the_same_tier() {
    let locations = [loc("dram-a", TierType::Dram), loc("requester", TierType::Dram), loc("dram-c", TierType::Dram)];
    let picked = picks(RouteGetStrategy::default(), "requester", &locations, 100, 1);
    assert!(picked.iter().all(|node| node == "requester"));
}

#[test]
fn non_local_requester_spreads_across_every_tier() {
    let locations = [
        loc("dram-a", TierType::Dram),
        loc("dram-b", TierType::Dram),
        loc("hbm-x", TierType::Hbm),
        loc("ssd-y", TierType::Ssd),
    ];
    let seen: BTreeSet<String> =
        picks(RouteGetStrategy::default(), "requester", &locations, 2000, 2).into_iter().collect();
    assert_eq!(seen.len(), 4, "every replica is reachable whatever its tier: {seen:?}");
}

#[test]
fn without_a_local_replica_the_choice_is_roughly_uniform() {
    let locations = [loc("node-a", TierType::Hbm), loc("node-b", TierType::Hbm), loc("node-c", TierType::Hbm)];
    const N: usize = 9000;
    for algo in [GetAlgo::LocalPreferring, GetAlgo::Random] {
        for seed in 0..5 {
            let mut counts = BTreeMap::<String, usize>::new();
            for node in picks(RouteGetStrategy::new(algo), "requester", &locations, N, seed) {
                *counts.entry(node).or_default() += 1;
            }
            assert_eq!(counts.len(), 3);
            for (node, count) in counts {
                // p = 1/3 over 9000 draws: σ ≈ 0.005, so ±0.03 is six σ.
                let ratio = count as f64 / N as f64;
                assert!((0.303..0.363).contains(&ratio), "{algo} seed {seed}: {node} got {ratio}");
            }
        }
    }
}

#[test]
fn empty_requester_falls_back_to_random() {
    let locations = [loc("node-a", TierType::Dram), loc("node-b", TierType::Dram), loc("", TierType::Dram)];
    let seen: BTreeSet<String> = picks(RouteGetStrategy::default(), "", &locations, 500, 3).into_iter().collect();
    // An empty requester never "matches" a replica, not even one with an empty node id.
    assert_eq!(seen.len(), 3);
}

#[test]
fn random_algo_ignores_the_local_replica() {
    let locations = [loc("requester", TierType::Dram), loc("node-b", TierType::Dram)];
    let seen: BTreeSet<String> =
        picks(RouteGetStrategy::new(GetAlgo::Random), "requester", &locations, 500, 4).into_iter().collect();
    assert_eq!(seen.len(), 2);
}

#[test]
fn single_replica_is_returned() {
    let locations = [loc("only", TierType::Ssd)];
    assert_eq!(RouteGetStrategy::default().select("requester", &locations, &mut rng(0)), Some(0));
}

#[test]
fn no_replica_selects_nothing() {
    let locations: [Replica; 0] = [];
    assert_eq!(RouteGetStrategy::default().select("requester", &locations, &mut rng(0)), None);
}

#[test]
fn batch_keeps_key_order_and_leaves_empty_keys_unselected() {
    let per_key = vec![
        vec![loc("dram-a", TierType::Dram), loc("requester", TierType::Ssd)],
        vec![],
        vec![loc("only", TierType::Hbm)],
        vec![loc("node-c", TierType::Dram)],
    ];
    let out = RouteGetStrategy::default().select_batch("requester", &per_key, &mut rng(5));
    assert_eq!(out, [Some(1), None, Some(0), Some(0)]);
}

#[test]
fn batch_matches_single_selects_with_the_same_seed() {
    let per_key: Vec<Vec<Replica>> =
        (0..50).map(|k| (0..(k % 4)).map(|n| loc(&format!("n{n}"), TierType::Dram)).collect()).collect();
    let strategy = RouteGetStrategy::default();
    let batch = strategy.select_batch("n9", &per_key, &mut rng(6));
    let mut single_rng = rng(6);
    let singles: Vec<Option<usize>> = per_key.iter().map(|l| strategy.select("n9", l, &mut single_rng)).collect();
    assert_eq!(batch, singles);
}

/// The store's own location type plugs in through [`ReplicaNode`] without copying.
struct StoreLocation {
    node: String,
}

impl ReplicaNode for StoreLocation {
    fn node_id(&self) -> &str {
        &self.node
    }
}

#[test]
fn runs_over_any_location_type_and_slices_of_references() {
    let owned = [StoreLocation { node: "x".to_owned() }, StoreLocation { node: "me".to_owned() }];
    assert_eq!(RouteGetStrategy::default().select("me", &owned, &mut rng(0)), Some(1));
    let borrowed: Vec<&StoreLocation> = owned.iter().collect();
    let per_key: Vec<&[&StoreLocation]> = vec![&borrowed, &borrowed[..1]];
    assert_eq!(RouteGetStrategy::default().select_batch("me", &per_key, &mut rng(0)), [Some(1), Some(0)]);
}

#[test]
fn get_algo_parses_and_defaults_to_local_preferring() {
    assert_eq!(GetAlgo::default(), GetAlgo::LocalPreferring);
    assert_eq!(RouteGetStrategy::default().algo(), GetAlgo::LocalPreferring);
    assert_eq!("local_preferring".parse::<GetAlgo>(), Ok(GetAlgo::LocalPreferring));
    assert_eq!(" Random".parse::<GetAlgo>(), Ok(GetAlgo::Random));
    assert!(matches!("tier_priority".parse::<GetAlgo>(), Err(RoutingConfigError::UnknownGetAlgo { .. })));
    assert_eq!(GetAlgo::Random.to_string(), "random");
}
