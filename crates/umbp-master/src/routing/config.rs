//! Strategy names, as the reference's environment variables spell them.

use std::fmt;
use std::str::FromStr;

use super::error::RoutingConfigError;

/// How a put picks among the media that fit a key (`UMBP_ROUTE_PUT_SELECT_ALGO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SelectAlgo {
    /// The medium with the most free bytes; the first listed wins a tie (`most_available`).
    ///
    /// Deterministic and self-balancing: with projected capacity a batch fills the roomiest slot
    /// down to the next one and then alternates.
    #[default]
    MostAvailable,
    /// A medium drawn with probability proportional to its free bytes (`random`).
    ///
    /// Spreads concurrent batches from many writers, which all see the same stale snapshot and would
    /// otherwise all pick the same roomiest node.
    Random,
}

impl SelectAlgo {
    /// The environment spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::MostAvailable => "most_available",
            Self::Random => "random",
        }
    }
}

impl fmt::Display for SelectAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SelectAlgo {
    type Err = RoutingConfigError;

    /// Parses `most_available` or `random`, ignoring surrounding whitespace and ASCII case. The
    /// master's configuration turns an error into a startup error (not the reference's silent
    /// fallback).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let value = s.trim();
        if value.eq_ignore_ascii_case("most_available") {
            Ok(Self::MostAvailable)
        } else if value.eq_ignore_ascii_case("random") {
            Ok(Self::Random)
        } else {
            Err(RoutingConfigError::UnknownSelectAlgo { value: s.to_owned() })
        }
    }
}

/// Whether the keys of one put batch are steered towards a node (`UMBP_ROUTE_PUT_NODE_AFFINITY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Affinity {
    /// Every key is placed on its own by [`SelectAlgo`] (`none`).
    #[default]
    None,
    /// Keep a batch together (`same`): if one medium fits the whole batch, pin it; otherwise stay on
    /// the node the previous key landed on while it has room. A prefix read later hits one peer.
    Same,
    /// Prefer the requester's own node (`local`), on its roomiest medium, before any other node —
    /// deliberately local DRAM over remote HBM, because the writer usually reads its keys back.
    /// The master also grants every node that lends a medium *local placement* (`local_puts` in the
    /// register and heartbeat replies): such a node writes its own puts to its own medium without a
    /// route call and routes only the keys its medium refuses. What that gives up is cross-node
    /// dedup: a key another node already holds gets a second replica on the writer, with the
    /// writer's bytes (the same bytes for content-addressed keys; otherwise the first writer wins per
    /// node, not across the pool).
    Local,
}

impl Affinity {
    /// The environment spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Same => "same",
            Self::Local => "local",
        }
    }
}

impl fmt::Display for Affinity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Affinity {
    type Err = RoutingConfigError;

    /// Parses `none`, `same` or `local`, ignoring surrounding whitespace and ASCII case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let value = s.trim();
        if value.eq_ignore_ascii_case("none") {
            Ok(Self::None)
        } else if value.eq_ignore_ascii_case("same") {
            Ok(Self::Same)
        } else if value.eq_ignore_ascii_case("local") {
            Ok(Self::Local)
        } else {
            Err(RoutingConfigError::UnknownAffinity { value: s.to_owned() })
        }
    }
}

/// The put strategy's settings: algorithm × affinity. The default is `most_available/none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PutStrategyConfig {
    /// How a medium is picked among those that fit.
    pub algo: SelectAlgo,
    /// How the keys of a batch are steered.
    pub affinity: Affinity,
}

impl PutStrategyConfig {
    /// A configuration from its two halves.
    pub const fn new(algo: SelectAlgo, affinity: Affinity) -> Self {
        Self { algo, affinity }
    }
}

impl fmt::Display for PutStrategyConfig {
    /// `algo/affinity`, e.g. `most_available/none` (what the master prints at start).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.algo, self.affinity)
    }
}

/// How a get picks among a key's replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GetAlgo {
    /// The requester's own replica on any tier, else a uniformly random one (`local_preferring`).
    #[default]
    LocalPreferring,
    /// A uniformly random replica, even when the requester holds one (`random`).
    Random,
}

impl GetAlgo {
    /// The configuration spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::LocalPreferring => "local_preferring",
            Self::Random => "random",
        }
    }
}

impl fmt::Display for GetAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for GetAlgo {
    type Err = RoutingConfigError;

    /// Parses `local_preferring` or `random`, ignoring surrounding whitespace and ASCII case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let value = s.trim();
        if value.eq_ignore_ascii_case("local_preferring") {
            Ok(Self::LocalPreferring)
        } else if value.eq_ignore_ascii_case("random") {
            Ok(Self::Random)
        } else {
            Err(RoutingConfigError::UnknownGetAlgo { value: s.to_owned() })
        }
    }
}
