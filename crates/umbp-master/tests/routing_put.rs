//! Put routing: the reference's `test_route_put_strategy` and the strategy half of
//! `test_router_dedup`, plus the exclude fix (the reference skipped excludes for puts).

use std::sync::Arc;

use rand::SeedableRng;
use rand::rngs::StdRng;
use umbp_core::TierType;
use umbp_master::routing::{
    Affinity, Candidate, PutDecision, PutPlacement, PutStrategyConfig, RoutePutStrategy, RoutingConfigError,
    SelectAlgo, TierSlot,
};

const GB: u64 = 1 << 30;

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<RoutePutStrategy>();
    send_sync::<Candidate>();
    send_sync::<PutDecision>();
};

fn node(id: &str, tiers: &[(TierType, u64, u64)]) -> Candidate {
    Candidate::new(
        id,
        format!("{id}-addr"),
        tiers.iter().map(|&(tier, total, avail)| TierSlot::new(tier, total, avail)).collect(),
    )
}

/// One DRAM medium with `available == total` (the strategy reads only `available`).
fn dram(id: &str, avail: u64) -> Candidate {
    node(id, &[(TierType::Dram, avail, avail)])
}

fn strategy(algo: SelectAlgo, affinity: Affinity) -> RoutePutStrategy {
    RoutePutStrategy::new(PutStrategyConfig::new(algo, affinity))
}

fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

fn route(
    strategy: &RoutePutStrategy,
    requester: &str,
    sizes: &[u64],
    exists: &[bool],
    candidates: &[Candidate],
    exclude: &[String],
) -> Vec<PutDecision> {
    strategy.select_batch(requester, sizes, exists, candidates, exclude, &mut rng(7))
}

fn route_new(
    strategy: &RoutePutStrategy,
    requester: &str,
    sizes: &[u64],
    candidates: &[Candidate],
) -> Vec<PutDecision> {
    route(strategy, requester, sizes, &vec![false; sizes.len()], candidates, &[])
}

/// Routes one new key for requester `req` with no excludes.
fn route_one(strategy: &RoutePutStrategy, candidates: &[Candidate], size: u64) -> PutDecision {
    let mut out = route_new(strategy, "req", &[size], candidates);
    assert_eq!(out.len(), 1);
    out.remove(0)
}

#[track_caller]
fn placed(decision: &PutDecision) -> &PutPlacement {
    match decision {
        PutDecision::Routed(placement) => placement,
        other => panic!("expected a routed key, got {other:?}"),
    }
}

#[track_caller]
fn node_of(decision: &PutDecision) -> &str {
    &placed(decision).node_id
}

fn default_strategy() -> RoutePutStrategy {
    RoutePutStrategy::default()
}

// ---- most_available / none: single key ----

#[test]
fn most_available_picks_the_roomiest_tier_regardless_of_medium() {
    let nodes = [node("node-a", &[(TierType::Hbm, 80 * GB, 10 * GB), (TierType::Dram, 512 * GB, 400 * GB)])];
    let decision = route_one(&default_strategy(), &nodes, 4096);
    assert_eq!(node_of(&decision), "node-a");
    assert_eq!(placed(&decision).tier, TierType::Dram);
}

#[test]
fn most_available_picks_the_only_tier_with_room() {
    let nodes = [node("node-a", &[(TierType::Hbm, 80 * GB, 0), (TierType::Dram, 512 * GB, 200 * GB)])];
    assert_eq!(placed(&route_one(&default_strategy(), &nodes, 4096)).tier, TierType::Dram);
}

#[test]
fn every_advertised_tier_is_a_valid_put_target_including_ssd() {
    let nodes = [node(
        "node-a",
        &[(TierType::Hbm, 80 * GB, 0), (TierType::Dram, 512 * GB, 0), (TierType::Ssd, 4096 * GB, 3000 * GB)],
    )];
    assert_eq!(placed(&route_one(&default_strategy(), &nodes, 4096)).tier, TierType::Ssd);
}

#[test]
fn ssd_competes_on_free_space_like_any_other_tier() {
    let only_ssd = [node("a", &[(TierType::Ssd, 100 * GB, 100 * GB)])];
    assert_eq!(placed(&route_one(&default_strategy(), &only_ssd, GB)).tier, TierType::Ssd);

    let ssd_and_dram = [node("a", &[(TierType::Ssd, 100 * GB, 100 * GB), (TierType::Dram, 2 * GB, 2 * GB)])];
    assert_eq!(placed(&route_one(&default_strategy(), &ssd_and_dram, GB)).tier, TierType::Ssd);
}

#[test]
fn unavailable_when_every_tier_is_full() {
    let nodes =
        [node("node-a", &[(TierType::Hbm, 80 * GB, 0), (TierType::Dram, 512 * GB, 0), (TierType::Ssd, 4096 * GB, 0)])];
    assert_eq!(route_one(&default_strategy(), &nodes, 4096), PutDecision::Unavailable);
}

#[test]
fn unavailable_when_the_key_is_larger_than_any_tier() {
    let nodes = [node("node-a", &[(TierType::Hbm, 80 * GB, 10 * GB)])];
    assert_eq!(route_one(&default_strategy(), &nodes, 100 * GB), PutDecision::Unavailable);
    // Exactly the free bytes still fits.
    assert!(route_one(&default_strategy(), &nodes, 10 * GB).is_routed());
}

#[test]
fn most_available_picks_the_roomiest_node_and_names_its_peer() {
    let nodes = [
        node("node-a", &[(TierType::Hbm, 80 * GB, 10 * GB)]),
        node("node-b", &[(TierType::Hbm, 80 * GB, 50 * GB)]),
        node("node-c", &[(TierType::Hbm, 80 * GB, 30 * GB)]),
    ];
    let decision = route_one(&default_strategy(), &nodes, 4096);
    assert_eq!(
        placed(&decision),
        &PutPlacement { node_id: Arc::from("node-b"), tier: TierType::Hbm, peer_address: Arc::from("node-b-addr") }
    );
}

#[test]
fn most_available_first_listed_wins_a_tie() {
    let nodes = [dram("a", 10 * GB), dram("b", 10 * GB)];
    assert_eq!(node_of(&route_one(&default_strategy(), &nodes, GB)), "a");
    let nodes = [node("a", &[(TierType::Dram, 10 * GB, 5 * GB), (TierType::Hbm, 10 * GB, 5 * GB)])];
    // Tiers are visited in ascending order whatever order the node listed them in.
    assert_eq!(placed(&route_one(&default_strategy(), &nodes, GB)).tier, TierType::Hbm);
}

#[test]
fn empty_candidate_list_is_unavailable() {
    assert_eq!(route_one(&default_strategy(), &[], 4096), PutDecision::Unavailable);
}

#[test]
fn candidate_without_tiers_is_skipped() {
    assert_eq!(route_one(&default_strategy(), &[node("node-a", &[])], 4096), PutDecision::Unavailable);
    let nodes = [node("node-a", &[]), dram("node-b", GB)];
    assert_eq!(node_of(&route_one(&default_strategy(), &nodes, 4096)), "node-b");
}

#[test]
fn unknown_tier_is_never_a_target() {
    let nodes = [node("node-a", &[(TierType::Unknown, 100 * GB, 100 * GB)])];
    assert_eq!(route_one(&default_strategy(), &nodes, 4096), PutDecision::Unavailable);
}

// ---- excludes (a fix over the reference, which ignored them for puts) ----

#[test]
fn excluded_node_is_skipped_even_when_roomiest() {
    let nodes =
        [node("node-a", &[(TierType::Hbm, 80 * GB, 50 * GB)]), node("node-b", &[(TierType::Hbm, 80 * GB, 10 * GB)])];
    for algo in [SelectAlgo::MostAvailable, SelectAlgo::Random] {
        for affinity in [Affinity::None, Affinity::Same, Affinity::Local] {
            let strategy = strategy(algo, affinity);
            let out = route(&strategy, "node-a", &[4096; 8], &[false; 8], &nodes, &["node-a".to_owned()]);
            for decision in &out {
                assert_eq!(node_of(decision), "node-b", "{algo}/{affinity}");
            }
        }
    }
}

#[test]
fn excluding_every_node_is_unavailable() {
    let nodes = [dram("a", 10 * GB), dram("b", 10 * GB)];
    let exclude = ["a".to_owned(), "b".to_owned()];
    let out = route(&default_strategy(), "req", &[GB, GB], &[false, false], &nodes, &exclude);
    assert_eq!(out, vec![PutDecision::Unavailable; 2]);
}

#[test]
fn reroute_after_no_space_with_an_exclude_set_lands_elsewhere() {
    // The writer's first try at `a` came back FailedNoSpace (stale capacity); it asks again
    // excluding `a` and must get a different node.
    let nodes = [dram("a", 100 * GB), dram("b", 20 * GB), dram("c", 30 * GB)];
    let first = route_one(&default_strategy(), &nodes, GB);
    assert_eq!(node_of(&first), "a");
    let retry = route(&default_strategy(), "req", &[GB], &[false], &nodes, &["a".to_owned()]);
    assert_eq!(node_of(&retry[0]), "c");
}

// ---- batches: projected capacity, dedup, malformed input ----

#[test]
fn projected_capacity_spreads_a_batch_across_nodes() {
    // Without projection both 6 GB keys would pick node-a (10 GB); with it the second goes to node-b.
    let nodes =
        [node("node-a", &[(TierType::Hbm, 80 * GB, 10 * GB)]), node("node-b", &[(TierType::Hbm, 80 * GB, 8 * GB)])];
    let out = route_new(&default_strategy(), "req", &[6 * GB, 6 * GB], &nodes);
    assert_eq!(node_of(&out[0]), "node-a");
    assert_eq!(node_of(&out[1]), "node-b");
}

#[test]
fn projected_capacity_alternates_between_equal_nodes() {
    let nodes = [dram("a", 10 * GB), dram("b", 10 * GB)];
    let out = route_new(&default_strategy(), "req", &[GB; 6], &nodes);
    let picks: Vec<&str> = out.iter().map(node_of).collect();
    assert_eq!(picks, ["a", "b", "a", "b", "a", "b"]);
}

#[test]
fn projected_capacity_runs_out_then_unavailable() {
    let nodes = [dram("a", 3 * GB), dram("b", 2 * GB)];
    let out = route_new(&default_strategy(), "req", &[2 * GB; 4], &nodes);
    assert_eq!(node_of(&out[0]), "a");
    assert_eq!(node_of(&out[1]), "b");
    assert_eq!(out[2], PutDecision::Unavailable);
    assert_eq!(out[3], PutDecision::Unavailable);
}

#[test]
fn router_dedup_already_exists_uses_no_capacity() {
    // node-a fits exactly one 6 GB key; key 0 is already indexed, so key 1 must still route there.
    let nodes = [node("node-a", &[(TierType::Hbm, 80 * GB, 6 * GB)])];
    let out = route(&default_strategy(), "req", &[6 * GB, 6 * GB], &[true, false], &nodes, &[]);
    assert_eq!(out[0], PutDecision::AlreadyExists);
    assert_eq!(out[0].placement(), None);
    assert_eq!(node_of(&out[1]), "node-a");
}

#[test]
fn order_and_dedup_are_preserved() {
    let nodes = [node("a", &[(TierType::Hbm, 80 * GB, 6 * GB)])];
    let out = route(&default_strategy(), "req", &[6 * GB; 3], &[true, false, true], &nodes, &[]);
    assert_eq!(out.len(), 3);
    assert_eq!(out[0], PutDecision::AlreadyExists);
    assert_eq!(placed(&out[1]).tier, TierType::Hbm);
    assert_eq!(node_of(&out[1]), "a");
    assert_eq!(out[2], PutDecision::AlreadyExists);
}

#[test]
fn already_exists_is_answered_even_with_no_candidates() {
    let out = route(&default_strategy(), "req", &[GB, GB], &[true, false], &[], &[]);
    assert_eq!(out, [PutDecision::AlreadyExists, PutDecision::Unavailable]);
}

#[test]
fn length_mismatch_yields_all_unavailable() {
    let nodes = [node("node-a", &[(TierType::Hbm, 80 * GB, 10 * GB)])];
    let out = route(&default_strategy(), "req", &[4096, 4096], &[false], &nodes, &[]);
    assert_eq!(out, vec![PutDecision::Unavailable; 2]);
    let out = route(&default_strategy(), "req", &[4096], &[false, true], &nodes, &[]);
    assert_eq!(out, vec![PutDecision::Unavailable; 1]);
}

#[test]
fn zero_size_is_unavailable_and_uses_nothing() {
    let nodes = [dram("a", GB)];
    let out = route_new(&default_strategy(), "req", &[0, GB], &nodes);
    assert_eq!(out[0], PutDecision::Unavailable);
    assert_eq!(node_of(&out[1]), "a");
}

#[test]
fn caller_candidates_are_never_modified() {
    let nodes =
        vec![node("node-a", &[(TierType::Hbm, 80 * GB, 10 * GB)]), node("node-b", &[(TierType::Hbm, 80 * GB, 8 * GB)])];
    let before = nodes.clone();
    let first = route_new(&default_strategy(), "req", &[6 * GB, 6 * GB], &nodes);
    assert_eq!(nodes, before);
    // The same snapshot gives the same placements again: no projected state leaks out.
    assert_eq!(route_new(&default_strategy(), "req", &[6 * GB, 6 * GB], &nodes), first);
}

// ---- random ----

#[test]
fn random_never_selects_a_node_that_cannot_fit() {
    let strategy = strategy(SelectAlgo::Random, Affinity::None);
    let nodes = [dram("big", 10_000 * GB), dram("tiny", 1024)];
    for seed in 0..20 {
        let out = strategy.select_batch("req", &[GB; 200], &[false; 200], &nodes, &[], &mut rng(seed));
        assert!(out.iter().all(|d| node_of(d) == "big"), "seed {seed}");
    }
}

#[test]
fn random_is_weighted_by_free_bytes() {
    // Capacities dwarf the total drawn, so projection hardly skews the 80/20 weights.
    let strategy = strategy(SelectAlgo::Random, Affinity::None);
    let nodes = [dram("a", 80_000 * GB), dram("b", 20_000 * GB)];
    const N: usize = 2000;
    let mut total_a = 0;
    for seed in 0..5 {
        let out = strategy.select_batch("req", &[GB; N], &[false; N], &nodes, &[], &mut rng(seed));
        let a = out.iter().filter(|d| node_of(d) == "a").count();
        let b = out.iter().filter(|d| node_of(d) == "b").count();
        assert_eq!(a + b, N);
        assert!(b > 0);
        let frac_a = a as f64 / N as f64;
        // 2000 draws at p = 0.8: σ ≈ 0.009, so these bounds are > 5σ wide.
        assert!((0.75..0.85).contains(&frac_a), "seed {seed}: fraction on a = {frac_a}");
        total_a += a;
    }
    let frac = total_a as f64 / (5 * N) as f64;
    assert!((0.78..0.82).contains(&frac), "pooled fraction on a = {frac}");
}

#[test]
fn random_is_reproducible_from_a_seed() {
    let strategy = strategy(SelectAlgo::Random, Affinity::None);
    let nodes: Vec<Candidate> = (0..8).map(|i| dram(&format!("n{i}"), (i + 1) * 10 * GB)).collect();
    let run = |seed| strategy.select_batch("req", &[GB; 64], &[false; 64], &nodes, &[], &mut rng(seed));
    assert_eq!(run(42), run(42));
    assert_ne!(run(42), run(43));
}

// ---- affinity: same ----

#[test]
fn same_places_a_batch_that_fits_one_node_on_it() {
    for algo in [SelectAlgo::MostAvailable, SelectAlgo::Random] {
        let strategy = strategy(algo, Affinity::Same);
        let nodes = [dram("a", 100 * GB), dram("b", 100 * GB)];
        for seed in 0..10 {
            let out = strategy.select_batch("req", &[GB; 4], &[false; 4], &nodes, &[], &mut rng(seed));
            let first = node_of(&out[0]).to_owned();
            assert!(out.iter().all(|d| node_of(d) == first), "{algo} seed {seed}: {out:?}");
        }
    }
}

#[test]
fn same_falls_back_per_key_and_sticks_to_the_anchor() {
    // 8 GB fits no node alone: keys stay on a node until it fills, then re-anchor.
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Same);
    let nodes = [dram("a", 5 * GB), dram("b", 5 * GB)];
    let out = route_new(&strategy, "req", &[2 * GB; 4], &nodes);
    assert_eq!(node_of(&out[0]), node_of(&out[1]));
    assert_eq!(node_of(&out[2]), node_of(&out[3]));
    assert_ne!(node_of(&out[1]), node_of(&out[2]));
    // Without affinity the same batch alternates.
    let none = route_new(&default_strategy(), "req", &[2 * GB; 4], &nodes);
    assert_ne!(node_of(&none[0]), node_of(&none[1]));
}

#[test]
fn same_never_drops_a_routable_key() {
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Same);
    let nodes = [dram("a", 3 * GB), dram("b", 3 * GB)];
    let out = route_new(&strategy, "req", &[2 * GB, 2 * GB], &nodes);
    assert!(out.iter().all(PutDecision::is_routed), "{out:?}");
    assert_ne!(node_of(&out[0]), node_of(&out[1]));
}

#[test]
fn same_pins_node_and_tier_for_a_whole_batch() {
    // 8 GB fits a's DRAM but not its HBM: every key lands on DRAM, HBM untouched.
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Same);
    let nodes = [node("a", &[(TierType::Hbm, 3 * GB, 3 * GB), (TierType::Dram, 100 * GB, 100 * GB)])];
    let out = route_new(&strategy, "req", &[2 * GB; 4], &nodes);
    for decision in &out {
        assert_eq!(node_of(decision), "a");
        assert_eq!(placed(decision).tier, TierType::Dram);
    }
}

#[test]
fn same_pin_beats_a_roomier_slot_elsewhere() {
    // Pin = the roomiest slot for the whole 4 GB (b's DRAM); keys then stay on it even though the
    // projection makes a's DRAM roomier along the way.
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Same);
    let nodes = [dram("a", 9 * GB), dram("b", 10 * GB)];
    let out = route_new(&strategy, "req", &[GB; 4], &nodes);
    assert!(out.iter().all(|d| node_of(d) == "b"), "{out:?}");
}

#[test]
fn same_fallback_keeps_the_anchor_node_and_changes_tier() {
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Same);
    let nodes = [
        node("a", &[(TierType::Hbm, 2 * GB, 2 * GB)]),
        node("b", &[(TierType::Hbm, 3 * GB, 3 * GB), (TierType::Dram, 3 * GB, 3 * GB)]),
    ];
    // 4 GB exceeds every slot (max 3 GB): no pin.
    let out = route_new(&strategy, "req", &[2 * GB, 2 * GB], &nodes);
    // Key 0: most available → b HBM (first of b's two 3 GB slots); b becomes the anchor.
    assert_eq!((node_of(&out[0]), placed(&out[0]).tier), ("b", TierType::Hbm));
    // Key 1: b's HBM has 1 GB left; the anchor's DRAM wins over a's HBM.
    assert_eq!((node_of(&out[1]), placed(&out[1]).tier), ("b", TierType::Dram));
}

#[test]
fn same_leaves_dedup_keys_out_of_the_batch_total() {
    // The non-dedup total is 2 GB; the 100 GB dedup keys must not stop the whole-batch pin.
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Same);
    let nodes = [dram("a", 4 * GB)];
    let out = route(&strategy, "req", &[100 * GB, GB, 100 * GB, GB], &[true, false, true, false], &nodes, &[]);
    assert_eq!(out[0], PutDecision::AlreadyExists);
    assert_eq!(out[2], PutDecision::AlreadyExists);
    assert_eq!(node_of(&out[1]), "a");
    assert_eq!(node_of(&out[3]), "a");
}

// ---- affinity: local ----

#[test]
fn local_prefers_the_requester_over_a_roomier_node() {
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Local);
    let nodes = [dram("a", 100 * GB), dram("b", 10 * GB)];
    let out = route_new(&strategy, "b", &[GB, GB], &nodes);
    assert!(out.iter().all(|d| node_of(d) == "b"), "{out:?}");
}

#[test]
fn local_prefers_local_dram_over_remote_hbm_and_takes_its_roomiest_tier() {
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Local);
    let nodes = [
        node("remote", &[(TierType::Hbm, 80 * GB, 80 * GB)]),
        node("me", &[(TierType::Hbm, 8 * GB, 2 * GB), (TierType::Dram, 64 * GB, 32 * GB)]),
    ];
    let out = route_new(&strategy, "me", &[GB], &nodes);
    assert_eq!((node_of(&out[0]), placed(&out[0]).tier), ("me", TierType::Dram));
}

#[test]
fn local_falls_back_when_the_requester_is_full() {
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Local);
    let nodes = [dram("a", 100 * GB), dram("b", 2 * GB)];
    let out = route_new(&strategy, "b", &[GB; 3], &nodes);
    let picks: Vec<&str> = out.iter().map(node_of).collect();
    assert_eq!(picks, ["b", "b", "a"]);
}

#[test]
fn local_with_an_unknown_or_empty_requester_uses_the_base_algorithm() {
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Local);
    let nodes = [dram("a", 100 * GB)];
    for requester in ["not-a-member", ""] {
        let out = route_new(&strategy, requester, &[GB, GB], &nodes);
        assert!(out.iter().all(|d| node_of(d) == "a"), "{requester:?}: {out:?}");
    }
}

#[test]
fn local_does_not_prefer_an_excluded_requester() {
    let strategy = strategy(SelectAlgo::MostAvailable, Affinity::Local);
    let nodes = [dram("a", 10 * GB), dram("b", 100 * GB)];
    let out = route(&strategy, "a", &[GB], &[false], &nodes, &["a".to_owned()]);
    assert_eq!(node_of(&out[0]), "b");
}

#[test]
fn one_strategy_serves_many_threads_with_their_own_generators() {
    let strategy = strategy(SelectAlgo::Random, Affinity::Same);
    let nodes: Vec<Candidate> = (0..4).map(|i| dram(&format!("n{i}"), 100 * GB)).collect();
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                for _ in 0..100 {
                    let out = strategy.select_batch("n0", &[GB; 8], &[false; 8], &nodes, &[], &mut rand::rng());
                    assert!(out.iter().all(PutDecision::is_routed));
                }
            });
        }
    });
}

// ---- configuration ----

#[test]
fn config_parses_the_reference_env_values() {
    assert_eq!("most_available".parse::<SelectAlgo>(), Ok(SelectAlgo::MostAvailable));
    assert_eq!(" random ".parse::<SelectAlgo>(), Ok(SelectAlgo::Random));
    assert_eq!("none".parse::<Affinity>(), Ok(Affinity::None));
    assert_eq!("  same  ".parse::<Affinity>(), Ok(Affinity::Same));
    assert_eq!("LOCAL".parse::<Affinity>(), Ok(Affinity::Local));
    assert_eq!("bogus".parse::<SelectAlgo>(), Err(RoutingConfigError::UnknownSelectAlgo { value: "bogus".to_owned() }));
    assert!(matches!("".parse::<Affinity>(), Err(RoutingConfigError::UnknownAffinity { .. })));
    for algo in [SelectAlgo::MostAvailable, SelectAlgo::Random] {
        assert_eq!(algo.to_string().parse::<SelectAlgo>(), Ok(algo));
    }
    for affinity in [Affinity::None, Affinity::Same, Affinity::Local] {
        assert_eq!(affinity.to_string().parse::<Affinity>(), Ok(affinity));
    }
}

#[test]
fn config_defaults_to_most_available_none() {
    let config = PutStrategyConfig::default();
    assert_eq!(config, PutStrategyConfig::new(SelectAlgo::MostAvailable, Affinity::None));
    assert_eq!(config.to_string(), "most_available/none");
    assert_eq!(RoutePutStrategy::default().config(), config);
    assert_eq!(PutStrategyConfig::new(SelectAlgo::Random, Affinity::Same).to_string(), "random/same");
}

// ---- page-rounded room ----

#[test]
fn a_key_takes_its_whole_pages_of_the_projected_room() {
    const PAGE: u64 = 64 << 10;
    let paged = |page_size| {
        vec![Candidate::new(
            "n1",
            "n1-addr",
            vec![TierSlot::new(TierType::Dram, 64 * PAGE, 3 * PAGE).with_page_size(page_size)],
        )]
    };
    // Three free pages hold three 24 KiB values, one a page; by bytes they would seem to hold eight.
    for algo in [SelectAlgo::MostAvailable, SelectAlgo::Random] {
        let s = strategy(algo, Affinity::None);
        let routed = |page_size| {
            route_new(&s, "req", &[24 << 10; 5], &paged(page_size))
                .iter()
                .filter(|d| matches!(d, PutDecision::Routed(_)))
                .count()
        };
        assert_eq!(routed(PAGE), 3, "{algo:?}");
        assert_eq!(routed(0), 5, "{algo:?}: page size unknown, the bytes as before");
    }
    // A key of two pages and a byte takes three: it fits in three free pages, not in two and a half.
    let s = strategy(SelectAlgo::MostAvailable, Affinity::None);
    assert!(matches!(route_one(&s, &paged(PAGE), 2 * PAGE + 1), PutDecision::Routed(_)));
    let half = |page_size| {
        vec![Candidate::new(
            "n1",
            "n1-addr",
            vec![TierSlot::new(TierType::Dram, 64 * PAGE, 2 * PAGE + PAGE / 2).with_page_size(page_size)],
        )]
    };
    assert_eq!(route_one(&s, &half(PAGE), 2 * PAGE + 1), PutDecision::Unavailable);
    assert!(matches!(route_one(&s, &half(0), 2 * PAGE + 1), PutDecision::Routed(_)));
}
