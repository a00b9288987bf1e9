//! Get routing: the requester's own replica first, else a uniformly random one.

use std::sync::Arc;

use rand::Rng;
use umbp_core::TierType;

use super::config::GetAlgo;

/// Anything that names the node holding a replica, so the strategy can run directly over the
/// store's own location type without copying it.
pub trait ReplicaNode {
    /// The id of the node holding this replica.
    fn node_id(&self) -> &str;
}

/// A replica of a key: the node and medium holding it and its size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Replica {
    /// The node holding the replica.
    pub node_id: Arc<str>,
    /// The medium it sits on.
    pub tier: TierType,
    /// Its size in bytes.
    pub size: u64,
}

impl Replica {
    /// A replica on `node_id`'s `tier`.
    pub fn new(node_id: impl Into<Arc<str>>, tier: TierType, size: u64) -> Self {
        Self { node_id: node_id.into(), tier, size }
    }
}

impl ReplicaNode for Replica {
    fn node_id(&self) -> &str {
        &self.node_id
    }
}

impl<T: ReplicaNode + ?Sized> ReplicaNode for &T {
    fn node_id(&self) -> &str {
        (**self).node_id()
    }
}

/// Picks which replica of a key a reader fetches.
///
/// The store has already dropped excluded and non-alive nodes from the list; the strategy only
/// chooses. With [`GetAlgo::LocalPreferring`] (the default) the requester's own replica wins on
/// whatever medium it sits, because a local read needs no network and every medium is otherwise
/// treated alike; without one, a uniform draw spreads readers of a hot key over all holders. The
/// strategy holds no generator: it uses the one it is handed, so it is `Send + Sync` and lock-free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RouteGetStrategy {
    algo: GetAlgo,
}

impl RouteGetStrategy {
    /// A strategy with the given algorithm.
    pub const fn new(algo: GetAlgo) -> Self {
        Self { algo }
    }

    /// The algorithm this strategy uses.
    pub const fn algo(&self) -> GetAlgo {
        self.algo
    }

    /// The index of the replica to read, or `None` if `locations` is empty.
    ///
    /// An empty `requester` never matches a replica, so it gets a random one.
    pub fn select<L: ReplicaNode, R: Rng + ?Sized>(
        &self,
        requester: &str,
        locations: &[L],
        rng: &mut R,
    ) -> Option<usize> {
        match locations.len() {
            0 => return None,
            1 => return Some(0),
            _ => {}
        }
        if self.algo == GetAlgo::LocalPreferring
            && !requester.is_empty()
            && let Some(local) = locations.iter().position(|loc| loc.node_id() == requester)
        {
            return Some(local);
        }
        Some(rng.random_range(0..locations.len()))
    }

    /// One [`select`](Self::select) per key, in key order; a key with no replica gets `None`.
    pub fn select_batch<L, K, R>(&self, requester: &str, per_key: &[K], rng: &mut R) -> Vec<Option<usize>>
    where
        L: ReplicaNode,
        K: AsRef<[L]>,
        R: Rng + ?Sized,
    {
        per_key.iter().map(|locations| self.select(requester, locations.as_ref(), rng)).collect()
    }
}
