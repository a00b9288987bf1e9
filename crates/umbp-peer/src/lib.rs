//! The umbp-rs node: a process that joins the pool, lends one medium to it (or none), and puts and
//! gets values by key across every node.
//!
//! ```no_run
//! use umbp_peer::{DramConfig, ErrorKind, Medium, PoolClient};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // A node lending 1 GiB of DRAM to the pool whose master listens on 127.0.0.1:50051.
//! let node = PoolClient::builder("node-a", "127.0.0.1:50051")
//!     .medium(Medium::Dram(DramConfig { capacity_bytes: 1 << 30, ..DramConfig::default() }))
//!     .start()
//!     .await?;
//! node.put("llama/blk/0", b"a block of KV cache").await?;
//! let mut buf = vec![0u8; 64 << 10];
//! let len = node.get("llama/blk/0", &mut buf).await?;
//! assert_eq!(&buf[..len as usize], b"a block of KV cache");
//! // Every error says what to do next.
//! if let Err(e) = node.get("never-put", &mut buf).await {
//!     assert_ne!(e.kind(), ErrorKind::Internal);
//! }
//! node.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Owns
//! - [`PoolClient`] ([`pool_client`]): the client API over the whole pool (put, get, exists,
//!   remove, clear) and the node's composition root — the only place that names concrete media and
//!   transfer engines. Put is route → allocate → transfer → commit and get is route → resolve →
//!   transfer → release, each written once over a holder that is this node's medium or a peer.
//! - The master client ([`master_client`]): registration, the heartbeat contract (one sequence
//!   stream for every medium, delta bundles, acks, full sync, keepalive, clear) and the routing calls
//!   a client makes.
//! - The peer service ([`peer_service`]): the `UMBPPeer` gRPC server that dispatches slot
//!   allocation, commit, abort, resolve and evict into the node's media (slot ids tagged with the
//!   tier, answers per entry in request order, backend ids stamped at the wire).
//! - The peer client ([`peer_client`]): the typed client of another node's peer service (the
//!   mirror of the master client: deadlines, the cluster token, unreachable marking).
//!
//! # Never
//! Moves bytes itself (the transfer layer does), decides placement (the master does), or converts
//! wire messages by hand (`umbp-proto` does, once for every speaker).
//!
//! # Errors
//! Every error type has a `kind()` ([`ErrorKind`]): fix the input, retry, route around an
//! unavailable node, build a new client after a close, or report an internal fault; sources are
//! kept (`std::error::Error::source`).

#[doc(hidden)]
pub mod fuzzing;
pub mod master_client;
pub mod peer_client;
pub mod peer_service;
pub mod pool_client;

pub use master_client::{MasterClient, MasterClientConfig, MasterClientError};
pub use peer_client::{PeerClient, PeerClientError};
pub use peer_service::{PeerServer, PeerServerConfig, PeerServerHandle, PeerService, PeerServiceError};
#[cfg(feature = "hbm")]
pub use pool_client::HbmConfig;
#[cfg(feature = "ssd")]
pub use pool_client::SsdConfig;
pub use pool_client::{
    DramConfig, KeyError, Medium, PoolClient, PoolClientBuilder, PoolClientConfig, PoolClientStats, PoolError,
    PutOutcome, RecachePolicy, SharedError,
};
pub use umbp_core::ErrorKind;
/// Raises the process's soft open-file limit to its hard limit, as a server does (a node's data
/// server and an SSD medium's log segments each want more descriptors than the common default).
pub use umbp_transfer::raise_open_file_limit;
