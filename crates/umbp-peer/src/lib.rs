//! The umbp-rs node.
//!
//! # Owns
//! - The master client ([`master_client`]): registration, the heartbeat contract (one sequence stream
//!   for every medium, delta bundles, acks, full sync, keepalive, clear) and the routing calls a
//!   client makes.
//! - The peer service ([`peer_service`]): the `UMBPPeer` gRPC server that dispatches slot allocation,
//!   commit, abort, resolve and evict into the node's media (slot ids tagged with the tier, answers
//!   per entry in request order, backend ids stamped at the wire), and the struct-of-arrays codec of
//!   `BatchResolveKeys`.
//! - [`PoolClient`](pool_client::PoolClient), the composition root — the only place that names
//!   concrete media and transfer engines — and the client API over the whole pool.
//!
//! # Never
//! Moves bytes itself (the transfer layer does) or decides placement (the master does).

pub mod master_client;
pub mod peer_client;
pub mod peer_service;
pub mod pool_client;

/// Raises the process's soft open-file limit to its hard limit, as a server does (a node's data
/// server and an SSD medium's log segments each want more descriptors than the common default).
pub use umbp_transfer::raise_open_file_limit;
