//! The plain inputs and outputs of put routing.

use std::sync::Arc;

use umbp_core::TierType;

/// One medium of a node as last reported by its heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TierSlot {
    /// The medium.
    pub tier: TierType,
    /// Allocatable bytes in total (eviction's denominator; put routing reads only `available_bytes`).
    pub total_bytes: u64,
    /// Bytes free at the last report.
    pub available_bytes: u64,
    /// The medium's page size, 0 if unknown: eviction charges a victim its page-rounded size, the
    /// unit `total_bytes` and `available_bytes` count in (see [`charged_bytes`](super::charged_bytes)).
    pub page_size: u64,
}

impl TierSlot {
    /// A slot with `total_bytes` of which `available_bytes` are free, page size unknown.
    pub const fn new(tier: TierType, total_bytes: u64, available_bytes: u64) -> Self {
        Self { tier, total_bytes, available_bytes, page_size: 0 }
    }

    /// The same slot on a medium of `page_size`-byte pages.
    #[must_use]
    pub const fn with_page_size(self, page_size: u64) -> Self {
        Self { page_size, ..self }
    }
}

/// An alive node a put may land on.
///
/// The caller lists **only ALIVE nodes**: the strategies trust the list, so a route never names a
/// node the registry has given up on. Identifiers are `Arc<str>` so that a placement shares the
/// caller's strings instead of copying them per key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Candidate {
    /// The node's id.
    pub node_id: Arc<str>,
    /// Where the node's peer service listens (copied into each placement on this node).
    pub peer_address: Arc<str>,
    /// The node's media and their capacity, in any order.
    pub tiers: Vec<TierSlot>,
}

impl Candidate {
    /// A candidate from its id, peer address and media.
    pub fn new(node_id: impl Into<Arc<str>>, peer_address: impl Into<Arc<str>>, tiers: Vec<TierSlot>) -> Self {
        Self { node_id: node_id.into(), peer_address: peer_address.into(), tiers }
    }
}

/// Where one key should be written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PutPlacement {
    /// The chosen node.
    pub node_id: Arc<str>,
    /// The chosen medium on that node.
    pub tier: TierType,
    /// The node's peer address, so the writer can connect without another lookup.
    pub peer_address: Arc<str>,
}

/// The routing answer for one key of a put batch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PutDecision {
    /// Write the key here.
    Routed(PutPlacement),
    /// The master's index already holds the key; the writer skips it (no capacity was used).
    AlreadyExists,
    /// No alive, non-excluded medium has room for the key right now (or the request was malformed:
    /// a zero size, or a dedup list of the wrong length).
    Unavailable,
}

impl PutDecision {
    /// The placement, if the key was routed.
    pub fn placement(&self) -> Option<&PutPlacement> {
        match self {
            Self::Routed(placement) => Some(placement),
            Self::AlreadyExists | Self::Unavailable => None,
        }
    }

    /// Whether the key was routed to a node.
    pub fn is_routed(&self) -> bool {
        matches!(self, Self::Routed(_))
    }
}
