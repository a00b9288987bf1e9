//! The master client's public value types.

use std::time::Duration;

use umbp_core::{TierCapacity, TierType};

/// What a node tells the master about itself when it registers. Sent whole on every registration,
/// including the re-registration after the master forgot the node (FIX over the reference, which
/// dropped the peer address and the data endpoint there and left the node routable but unreachable).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeRegistration {
    /// The node's cluster-unique id. Must not be empty.
    pub node_id: String,
    /// The node's host, without a port.
    pub node_address: String,
    /// `host:port` of the node's `UMBPPeer` service; empty for a client-only node.
    pub peer_address: String,
    /// `host:port` of the node's TCP data server; empty when it has none.
    pub data_endpoint: String,
    /// Operator tags, `k=v`.
    pub tags: Vec<String>,
}

impl NodeRegistration {
    /// A record with `node_id` and `node_address` and nothing else.
    pub fn new(node_id: impl Into<String>, node_address: impl Into<String>) -> Self {
        Self { node_id: node_id.into(), node_address: node_address.into(), ..Self::default() }
    }

    /// Sets the peer-service address.
    pub fn with_peer_address(mut self, peer_address: impl Into<String>) -> Self {
        self.peer_address = peer_address.into();
        self
    }

    /// Sets the data endpoint.
    pub fn with_data_endpoint(mut self, data_endpoint: impl Into<String>) -> Self {
        self.data_endpoint = data_endpoint.into();
        self
    }

    /// Sets the tags.
    pub fn with_tags(mut self, tags: Vec<String>) -> Self {
        self.tags = tags;
        self
    }
}

/// Where the master wants one key written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoutePutDecision {
    /// Write it to `tier` of `node_id`.
    Routed {
        /// The target node.
        node_id: String,
        /// The target tier.
        tier: TierType,
        /// `host:port` of the target's peer service.
        peer_address: String,
        /// `host:port` of the target's data-plane server; empty when it registered none or the
        /// master is older than this field.
        data_endpoint: String,
    },
    /// The master's index already holds the key: nothing to write (count it as a success).
    AlreadyExists,
    /// No node can take it now (also any outcome this client does not understand).
    Unavailable,
}

/// Where the master says one key can be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteGetHit {
    /// The node holding it.
    pub node_id: String,
    /// `host:port` of that node's peer service.
    pub peer_address: String,
    /// `host:port` of that node's data-plane server; empty when it registered none or the master is
    /// older than this field.
    pub data_endpoint: String,
    /// The tier it is on.
    pub tier: TierType,
    /// Its size in bytes, as the holder reported it.
    pub size: u64,
}

/// A node's liveness as the master reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeLiveness {
    /// Heartbeating.
    Alive,
    /// Silent too long; its locations are gone until it registers again.
    Expired,
    /// Not set, or a value this client does not know.
    Unknown,
}

/// What a registered process is to the pool, as the master reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRole {
    /// Lends a medium (it has a peer service or reported capacity).
    Storage,
    /// Lends nothing: an engine process or a CLI command that reads and writes through others.
    Client,
    /// Not set (an older master), or a value this client does not know.
    Unknown,
}

/// One node in [`ClusterStatus`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStatusReport {
    /// The node id.
    pub node_id: String,
    /// Its host.
    pub node_address: String,
    /// Its peer-service address.
    pub peer_address: String,
    /// Its data endpoint.
    pub data_endpoint: String,
    /// Its liveness.
    pub status: NodeLiveness,
    /// Last reported capacity, per tier.
    pub tier_capacities: Vec<(TierType, TierCapacity)>,
    /// Keys the master's index holds for it.
    pub key_count: u64,
    /// Time since its last heartbeat.
    pub last_heartbeat_age: Duration,
    /// The highest heartbeat seq the master applied for it.
    pub last_applied_seq: u64,
    /// Its tags.
    pub tags: Vec<String>,
    /// Storage node or client. An older master sends nothing: then [`NodeRole::Unknown`], and a
    /// caller may tell the two apart by `tier_capacities` being empty.
    pub role: NodeRole,
    /// The incarnation of the registration that stands (0 if the process sent none).
    pub incarnation: u64,
}

impl NodeStatusReport {
    /// Whether it lends a medium: [`NodeRole::Storage`], or (from an older master that sends no
    /// role) a reported capacity or a peer address.
    pub fn is_storage(&self) -> bool {
        match self.role {
            NodeRole::Storage => true,
            NodeRole::Client => false,
            NodeRole::Unknown => !self.tier_capacities.is_empty() || !self.peer_address.is_empty(),
        }
    }
}

/// The cluster as an operator sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClusterStatus {
    /// Every node the master knows: ALIVE ones, and EXPIRED ones within the retention.
    pub nodes: Vec<NodeStatusReport>,
    /// Distinct keys in the index.
    pub total_keys: u64,
    /// How long the master keeps an EXPIRED record listed before removing it (zero from an older
    /// master, which never removes them).
    pub expired_retention: Duration,
}

impl ClusterStatus {
    /// The storage nodes (they lend a medium), in the master's order.
    pub fn storage_nodes(&self) -> impl Iterator<Item = &NodeStatusReport> {
        self.nodes.iter().filter(|n| n.is_storage())
    }

    /// The clients (they lend nothing), in the master's order.
    pub fn clients(&self) -> impl Iterator<Item = &NodeStatusReport> {
        self.nodes.iter().filter(|n| !n.is_storage())
    }
}

/// Counters and heartbeat state of one [`MasterClient`](super::MasterClient), for tests and metrics.
/// Counters only grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct MasterClientStats {
    /// `Heartbeat` RPCs attempted, of every kind (deltas, keepalives, full-sync chunks).
    pub heartbeats_sent: u64,
    /// Delta bundles sent (a re-sent bundle counts again).
    pub bundles_sent: u64,
    /// Keepalives (heartbeats without bundles) sent.
    pub keepalives_sent: u64,
    /// Full syncs begun (each restart from chunk 0 counts, as does every empty full sync of a clear).
    pub full_syncs_started: u64,
    /// Full syncs the master acknowledged (final chunk applied).
    pub full_syncs_completed: u64,
    /// Full-sync chunks sent.
    pub full_sync_chunks_sent: u64,
    /// Successful registrations, the first included.
    pub registrations: u64,
    /// Re-registrations after the master forgot the node.
    pub re_registrations: u64,
    /// Times the bounded outbox overflowed and its deltas were replaced by a full sync.
    pub outbox_overflows: u64,
    /// RPCs that failed or timed out.
    pub rpc_errors: u64,
    /// Calls answered by another master than the one tried first (see `master_address` lists).
    pub failovers: u64,
    /// The seq the next delta bundle will get.
    pub next_seq: u64,
    /// The highest seq the master acknowledged.
    pub acked_seq: u64,
    /// Bundles queued and not yet acknowledged.
    pub outbox_bundles: usize,
    /// Events in those bundles.
    pub outbox_events: usize,
    /// A full sync is due.
    pub full_sync_pending: bool,
    /// A clear is waiting for the master's acknowledgement (writes gated).
    pub clear_pending: bool,
    /// The heartbeat interval in force.
    pub heartbeat_interval: Duration,
}
