//! Placement decisions: where a put goes, which replica a get reads, and what eviction frees.
//!
//! Every strategy here is a **pure function** over plain input structs: it reads a snapshot the
//! caller took from the metadata store (alive nodes and their last reported capacity, a key's
//! locations, eviction candidates) and returns a decision. Nothing here locks, allocates shared
//! state or talks to the store, so a strategy is trivially `Send + Sync`, costs nanoseconds per key,
//! and is tested without a master. The gRPC service glues store and strategies together.
//!
//! Randomness is always **passed in** (`&mut impl Rng`): the service hands each call the thread's
//! generator (`&mut rand::rng()`), tests and benchmarks a seeded one, so every decision is
//! reproducible from a seed and no strategy needs a lock around a shared generator.
//!
//! # Put routing ([`RoutePutStrategy`])
//! A batch of keys with their sizes and dedup flags is placed on the alive [`Candidate`]s:
//! `most_available` or `random` (weighted by free bytes) × node affinity `none`, `same` or `local`
//! ([`PutStrategyConfig`]). Each routed key's size is subtracted from a batch-local copy of the
//! capacities (*projected capacity*), so one batch spreads over nodes instead of piling onto the
//! snapshot's roomiest slot. Excluded nodes are skipped (a writer re-routes with an exclude set
//! after a peer answered `FailedNoSpace`). Affinity biases the choice but never turns a key the base
//! algorithm could place into [`PutDecision::Unavailable`].
//!
//! # Get routing ([`RouteGetStrategy`])
//! The requester's own replica, on any tier, wins (a local read needs no network); otherwise a
//! uniformly random replica spreads readers over the holders.
//!
//! ```
//! use rand::{SeedableRng, rngs::SmallRng};
//! use umbp_core::TierType;
//! use umbp_master::routing::{
//!     Affinity, Candidate, PutDecision, PutStrategyConfig, Replica, RouteGetStrategy,
//!     RoutePutStrategy, SelectAlgo, TierSlot,
//! };
//!
//! const GIB: u64 = 1 << 30;
//! let alive = [
//!     Candidate::new("a", "10.0.0.1:7000", vec![TierSlot::new(TierType::Dram, 64 * GIB, 10 * GIB)]),
//!     Candidate::new("b", "10.0.0.2:7000", vec![TierSlot::new(TierType::Dram, 64 * GIB, 8 * GIB)]),
//! ];
//! let put = RoutePutStrategy::new(PutStrategyConfig::new(SelectAlgo::MostAvailable, Affinity::None));
//! let mut rng = SmallRng::seed_from_u64(0); // service code: `&mut rand::rng()`
//! let out = put.select_batch("b", &[6 * GIB, 6 * GIB, GIB], &[false, false, true], &alive, &[], &mut rng);
//! // Projected capacity: `a` is roomiest first, then has only 4 GiB left, so the second key goes to `b`.
//! assert_eq!(out[0].placement().map(|p| &*p.node_id), Some("a"));
//! assert_eq!(out[1].placement().map(|p| &*p.node_id), Some("b"));
//! assert_eq!(out[2], PutDecision::AlreadyExists);
//!
//! let replicas = [Replica::new("a", TierType::Dram, GIB), Replica::new("b", TierType::Ssd, GIB)];
//! assert_eq!(RouteGetStrategy::default().select("b", &replicas, &mut rng), Some(1));
//! ```
//!
//! # Eviction ([`plan_eviction`], [`select_victims`])
//! Every (node, tier) whose use reached the high watermark gets a byte budget that brings it back to
//! the low watermark; victims are taken least recently used first until each budget is spent, each
//! charged its size rounded up to the medium's pages ([`charged_bytes`]), the unit media count their
//! capacity in. Put routing charges a key the same way.

mod config;
mod error;
mod evict;
mod get;
mod put;
mod types;

pub use config::{Affinity, GetAlgo, PutStrategyConfig, SelectAlgo};
pub use error::RoutingConfigError;
pub use evict::{
    Bucket, EvictionCandidate, EvictionConfig, NodeTiers, VictimPicker, charged_bytes, plan_eviction, select_victims,
};
pub(crate) use evict::{PPM, parts_per_million};
pub use get::{Replica, ReplicaNode, RouteGetStrategy};
pub use put::RoutePutStrategy;
pub use types::{Candidate, PutDecision, PutPlacement, TierSlot};
