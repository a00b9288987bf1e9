//! Randomized: the in-memory store gives the same observable answers at 1, 3 and 8 shards, the Redis
//! store gives the same answers as the in-memory one, and they match a plain sequential model of the
//! contract.

#[macro_use]
#[path = "store_support/contract.rs"]
mod contract;
mod store_support;

use std::collections::BTreeMap;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use store_support::*;
use umbp_core::{KvEvent, KvEventKind, TierType};
use umbp_master::store::{
    HeartbeatApply, HeartbeatKind, HeartbeatOutcome, InMemoryStore, MetadataStore, NodeStatus, RegisterOutcome,
};

const NODES: [&str; 3] = ["n0", "n1", "n2"];
const KEY_SPACE: u8 = 10;
const TIERS: [TierType; 2] = [TierType::Dram, TierType::Hbm];

#[derive(Debug, Clone)]
enum Op {
    Register {
        node: usize,
    },
    Unregister {
        node: usize,
    },
    /// seq = last applied + `offset` − 1 (0: a re-send, 1: in order, 2: a gap).
    Delta {
        node: usize,
        offset: u64,
        events: Vec<(bool, u8, usize, u64)>,
    },
    Chunk {
        node: usize,
        baseline_offset: u64,
        chunk: u32,
        is_final: bool,
        events: Vec<(u8, usize, u64)>,
    },
    Keepalive {
        node: usize,
    },
    Expire {
        age: u64,
    },
    RouteGet {
        keys: Vec<u8>,
        exclude: Option<usize>,
        lease: u64,
    },
    Exists {
        keys: Vec<u8>,
    },
    Evict {
        node: usize,
        tier: usize,
        cap: usize,
    },
    Advance {
        ms: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let node = 0..NODES.len();
    let event = (any::<bool>(), 0..KEY_SPACE, 0..TIERS.len(), 1..4u64);
    prop_oneof![
        1 => node.clone().prop_map(|node| Op::Register { node }),
        1 => node.clone().prop_map(|node| Op::Unregister { node }),
        6 => (node.clone(), prop_oneof![1 => Just(0u64), 6 => Just(1u64), 1 => Just(2u64)],
              proptest::collection::vec(event, 0..8))
            .prop_map(|(node, offset, events)| Op::Delta { node, offset, events }),
        3 => (node.clone(), 0..4u64, 0..3u32, any::<bool>(),
              proptest::collection::vec((0..KEY_SPACE, 0..TIERS.len(), 1..4u64), 0..6))
            .prop_map(|(node, baseline_offset, chunk, is_final, events)| {
                Op::Chunk { node, baseline_offset, chunk, is_final, events }
            }),
        1 => node.clone().prop_map(|node| Op::Keepalive { node }),
        1 => (0..50u64).prop_map(|age| Op::Expire { age }),
        2 => (proptest::collection::vec(0..KEY_SPACE, 0..6), proptest::option::of(node.clone()), 0..30u64)
            .prop_map(|(keys, exclude, lease)| Op::RouteGet { keys, exclude, lease }),
        1 => proptest::collection::vec(0..KEY_SPACE, 0..6).prop_map(|keys| Op::Exists { keys }),
        1 => (node, 0..TIERS.len(), 0..3usize).prop_map(|(node, tier, cap)| Op::Evict { node, tier, cap }),
        2 => (1..20u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn key(k: u8) -> String {
    format!("k{k}")
}

/// A node in the model: (alive, last heartbeat, last applied seq, in-progress sync (baseline, next
/// chunk)).
type ModelNode = (bool, u64, u64, Option<(u64, u32)>);

/// The contract, written as plainly as possible.
#[derive(Default)]
struct Model {
    nodes: BTreeMap<String, ModelNode>,
    /// key → [(node, tier, size, tag of the last full sync that reported it (0: deltas only))] in
    /// insertion order
    index: BTreeMap<String, Vec<(String, TierType, u64, u64)>>,
}

impl Model {
    fn wipe(&mut self, node: &str) {
        for locs in self.index.values_mut() {
            locs.retain(|(n, _, _, _)| n != node);
        }
        self.index.retain(|_, locs| !locs.is_empty());
    }

    fn add(&mut self, node: &str, key: &str, tier: TierType, size: u64, tag: Option<u64>) {
        let locs = self.index.entry(key.to_owned()).or_default();
        match locs.iter_mut().find(|(n, t, _, _)| n == node && *t == tier) {
            Some(loc) => {
                loc.2 = size;
                if let Some(tag) = tag {
                    loc.3 = tag;
                }
            }
            None => locs.push((node.to_owned(), tier, size, tag.unwrap_or(0))),
        }
    }

    fn sweep(&mut self, node: &str, keep: u64) {
        for locs in self.index.values_mut() {
            locs.retain(|(n, _, _, tag)| n != node || *tag == keep);
        }
        self.index.retain(|_, locs| !locs.is_empty());
    }

    fn remove(&mut self, node: &str, key: &str, tier: TierType) {
        if let Some(locs) = self.index.get_mut(key) {
            if let Some(pos) = locs.iter().position(|(n, t, _, _)| n == node && *t == tier) {
                locs.remove(pos);
            }
            if locs.is_empty() {
                self.index.remove(key);
            }
        }
    }

    fn register(&mut self, node: &str, now: u64) -> RegisterOutcome {
        if let Some((true, last_hb, _, _)) = self.nodes.get(node)
            && now.saturating_sub(*last_hb) <= STALE
        {
            return RegisterOutcome::AlreadyExists;
        }
        self.nodes.insert(node.to_owned(), (true, now, 0, None));
        self.wipe(node);
        RegisterOutcome::Registered
    }

    fn heartbeat(&mut self, node: &str, now: u64, kind: &HeartbeatKind) -> HeartbeatOutcome {
        let Some((true, last_hb, last, progress)) = self.nodes.get(node).copied() else {
            return HeartbeatOutcome::Unknown;
        };
        let mut state = (true, last_hb.max(now), last, progress);
        let outcome = match kind {
            HeartbeatKind::Keepalive => HeartbeatOutcome::Applied { acked_seq: last },
            HeartbeatKind::Delta { seq, events } => {
                if *seq <= last {
                    HeartbeatOutcome::AlreadyApplied { acked_seq: last }
                } else if *seq == last + 1 && progress.is_none() {
                    state.2 = *seq;
                    for e in events {
                        match e.kind {
                            KvEventKind::Add => self.add(node, &e.key, e.tier, e.size, None),
                            KvEventKind::Remove => self.remove(node, &e.key, e.tier),
                        }
                    }
                    HeartbeatOutcome::Applied { acked_seq: *seq }
                } else {
                    state.3 = None;
                    HeartbeatOutcome::SeqGap { acked_seq: last }
                }
            }
            HeartbeatKind::FullSyncChunk { baseline_seq, chunk_index, is_final, events } => {
                let (baseline, chunk) = (*baseline_seq, *chunk_index);
                let newer = progress.is_none_or(|(b, _)| baseline >= b);
                let in_order = if chunk == 0 { newer } else { progress == Some((baseline, chunk)) };
                if baseline <= last {
                    HeartbeatOutcome::AlreadyApplied { acked_seq: last }
                } else if in_order {
                    for e in events.iter().filter(|e| e.kind == KvEventKind::Add) {
                        self.add(node, &e.key, e.tier, e.size, Some(baseline));
                    }
                    if *is_final {
                        self.sweep(node, baseline);
                        state.2 = baseline;
                        state.3 = None;
                    } else {
                        state.3 = Some((baseline, chunk + 1));
                    }
                    HeartbeatOutcome::Applied { acked_seq: state.2 }
                } else {
                    if newer {
                        state.3 = None;
                    }
                    HeartbeatOutcome::SeqGap { acked_seq: last }
                }
            }
        };
        self.nodes.insert(node.to_owned(), state);
        outcome
    }

    fn expire(&mut self, cutoff: u64) -> Vec<String> {
        let expired: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, (alive, last_hb, _, _))| *alive && *last_hb < cutoff)
            .map(|(n, _)| n.clone())
            .collect();
        for n in &expired {
            if let Some(state) = self.nodes.get_mut(n) {
                state.0 = false;
                state.3 = None;
            }
            self.wipe(n);
        }
        expired
    }
}

/// Runs `ops` on every store (the first is the reference for the stamps and listings) and on the
/// model, checking every answer and the whole observable state after each step.
fn run(ops: &[Op], stores: &[Subject]) -> Result<(), TestCaseError> {
    let mut model = Model::default();
    let mut now = 100_000u64;
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Register { node } => {
                let expected = model.register(NODES[*node], now);
                for s in stores {
                    prop_assert_eq!(
                        s.register(registration(NODES[*node]), now, STALE).expect("store call"),
                        expected,
                        "step {}",
                        step
                    );
                }
            }
            Op::Unregister { node } => {
                let expected = model.nodes.remove(NODES[*node]).is_some();
                model.wipe(NODES[*node]);
                for s in stores {
                    prop_assert_eq!(s.unregister(NODES[*node]).expect("store call"), expected, "step {}", step);
                }
            }
            Op::Delta { .. } | Op::Chunk { .. } | Op::Keepalive { .. } => {
                let (node, kind) = match op {
                    Op::Delta { node, offset, events } => {
                        let last = model.nodes.get(NODES[*node]).map_or(0, |s| s.2);
                        let events = events
                            .iter()
                            .map(|(is_add, k, t, size)| {
                                if *is_add {
                                    KvEvent::add(key(*k), TIERS[*t], *size)
                                } else {
                                    KvEvent::remove(key(*k), TIERS[*t])
                                }
                            })
                            .collect();
                        (*node, HeartbeatKind::Delta { seq: (last + offset).saturating_sub(1), events })
                    }
                    Op::Chunk { node, baseline_offset, chunk, is_final, events } => {
                        let last = model.nodes.get(NODES[*node]).map_or(0, |s| s.2);
                        let events =
                            events.iter().map(|(k, t, size)| KvEvent::add(key(*k), TIERS[*t], *size)).collect();
                        // last - 1, last (stale copies), then fresh baselines last + 1, last + 2.
                        let baseline_seq = (last + baseline_offset).saturating_sub(1);
                        (
                            *node,
                            HeartbeatKind::FullSyncChunk {
                                baseline_seq,
                                chunk_index: *chunk,
                                is_final: *is_final,
                                events,
                            },
                        )
                    }
                    Op::Keepalive { node } => (*node, HeartbeatKind::Keepalive),
                    _ => unreachable!(),
                };
                let expected = model.heartbeat(NODES[node], now, &kind);
                for s in stores {
                    let hb = HeartbeatApply {
                        node_id: NODES[node].to_owned(),
                        now_ms: now,
                        caps: caps(),
                        kind: kind.clone(),
                        incarnation: 0,
                    };
                    prop_assert_eq!(s.apply_heartbeat(hb).expect("store call"), expected, "step {}: {:?}", step, op);
                }
            }
            Op::Expire { age } => {
                let cutoff = now - age * 1_000;
                let expected = model.expire(cutoff);
                for s in stores {
                    prop_assert_eq!(s.expire_stale(cutoff).expect("store call"), expected.clone(), "step {}", step);
                }
            }
            Op::RouteGet { keys, exclude, lease } => {
                let keys: Vec<String> = keys.iter().map(|k| key(*k)).collect();
                let exclude: Vec<String> = exclude.iter().map(|n| NODES[*n].to_owned()).collect();
                let answers: Vec<_> = stores
                    .iter()
                    .map(|s| s.batch_lookup_for_route_get(&keys, &exclude, now, *lease).expect("store call"))
                    .collect();
                for (i, k) in keys.iter().enumerate() {
                    let expected: Vec<(String, TierType, u64)> = model
                        .index
                        .get(k)
                        .into_iter()
                        .flatten()
                        .filter(|(n, _, _, _)| !exclude.contains(n))
                        .map(|(n, t, size, _)| (n.clone(), *t, *size))
                        .collect();
                    for a in &answers {
                        let got: Vec<_> = a[i].iter().map(|l| (l.node_id.to_string(), l.tier, l.size)).collect();
                        prop_assert_eq!(&got, &expected, "step {}: key {}", step, k);
                    }
                }
            }
            Op::Exists { keys } => {
                let keys: Vec<String> = keys.iter().map(|k| key(*k)).collect();
                let expected: Vec<bool> = keys.iter().map(|k| model.index.contains_key(k)).collect();
                for s in stores {
                    prop_assert_eq!(s.batch_exists(&keys).expect("store call"), expected.clone(), "step {}", step);
                }
            }
            Op::Evict { node, tier, cap } => {
                let buckets = [(NODES[*node].to_owned(), TIERS[*tier])];
                let first = stores[0].enumerate_eviction_candidates(&buckets, now, *cap).expect("store call");
                for s in &stores[1..] {
                    prop_assert_eq!(
                        s.enumerate_eviction_candidates(&buckets, now, *cap).expect("store call"),
                        first.clone()
                    );
                }
            }
            Op::Advance { ms } => now += ms * 1_000,
        }
        // The whole observable state agrees after every step.
        for k in 0..KEY_SPACE {
            let expected: Vec<(String, TierType, u64)> =
                model.index.get(&key(k)).into_iter().flatten().map(|(n, t, size, _)| (n.clone(), *t, *size)).collect();
            for s in stores {
                let got: Vec<_> = s
                    .lookup(&key(k))
                    .expect("store call")
                    .into_iter()
                    .map(|l| (l.node_id.to_string(), l.tier, l.size))
                    .collect();
                prop_assert_eq!(&got, &expected, "step {}: key {}", step, k);
                prop_assert_eq!(s.key_stats(&key(k)), stores[0].key_stats(&key(k)));
            }
        }
        for s in stores {
            prop_assert_eq!(s.key_count().expect("store call"), model.index.len() as u64);
            prop_assert_eq!(s.list_nodes().expect("store call"), stores[0].list_nodes().expect("store call"));
            for n in NODES {
                let held = model.index.values().filter(|locs| locs.iter().any(|(m, _, _, _)| m == n)).count() as u64;
                prop_assert_eq!(s.node_key_count(n).expect("store call"), held);
                let status = s
                    .get_node(n)
                    .expect("store call")
                    .map(|r| (r.status == NodeStatus::Alive, r.last_heartbeat_ms, r.last_applied_seq));
                prop_assert_eq!(status, model.nodes.get(n).map(|m| (m.0, m.1, m.2)));
            }
        }
    }
    Ok(())
}

/// Random operation sequences on the subject's stores and the model. The in-memory subject runs at 1,
/// 3 and 8 shards (its answers must not depend on the count); the Redis subject runs against the
/// in-memory store, on one `redis-server` for the whole run, each case under a key prefix of its own.
fn stores_agree_with_each_other_and_the_model(kind: Kind) {
    let server = (kind != Kind::Memory).then(RedisServer::start);
    let case = AtomicU64::new(0);
    let cases = if server.is_some() { 128 } else { 256 };
    let mut runner = TestRunner::new(ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() });
    let result = runner.run(&proptest::collection::vec(op(), 1..100), |ops| {
        let stores = match &server {
            None => Kind::Memory.stores_of(&[1, 3, 8]),
            Some(server) => {
                let prefix = format!("case{}", case.fetch_add(1, Ordering::Relaxed));
                vec![
                    Subject::Memory(InMemoryStore::with_shards(8).expect("store call")),
                    if kind == Kind::Sharded {
                        store_support::sharded(Arc::clone(server), &prefix)
                    } else {
                        Arc::clone(server).subject(&prefix)
                    },
                ]
            }
        };
        run(&ops, &stores)
    });
    if let Err(err) = result {
        panic!("{err}");
    }
}

contract!(stores_agree_with_each_other_and_the_model);
