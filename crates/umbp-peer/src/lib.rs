//! The umbp-rs node.
//!
//! # Owns
//! The master client ([`master_client`]): registration, the heartbeat contract (one sequence stream
//! for every medium, delta bundles, acks, full sync, keepalive, clear) and the routing calls a client
//! makes. Later: the `UMBPPeer` service and `PoolClient`, the composition root — the only place that
//! names concrete media and transfer engines.
//!
//! # Never
//! Moves bytes itself (the transfer layer does) or decides placement (the master does).

pub mod master_client;
