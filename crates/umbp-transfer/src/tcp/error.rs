//! Why a [`TcpEngine`](super::TcpEngine) or a [`DataServer`](super::DataServer) could not start.

use std::io;
use std::net::SocketAddr;

/// Errors starting the TCP data plane.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpStartError {
    /// The listen address could not be bound (in use, not local, no permission).
    #[error("binding the data server to {addr}")]
    Bind {
        /// The configured listen address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// The acceptor thread could not be spawned.
    #[error("spawning the data server's acceptor")]
    Spawn(#[source] io::Error),
    /// The cluster token is longer than the protocol carries.
    #[error("cluster token of {len} bytes exceeds the {max}-byte limit")]
    TokenTooLong {
        /// Bytes of the token.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `TcpEngineConfig::server.cluster_token` is set and differs from `TcpEngineConfig::cluster_token`
    /// (the engine uses one token for both sides; leave the server's unset).
    #[error("the server's cluster token differs from the engine's; set only TcpEngineConfig::cluster_token")]
    ConflictingTokens,
    /// The listen address is a wildcard (`0.0.0.0`, `::`) and no `advertise` endpoint is set, so
    /// peers would be told an address they cannot reach.
    #[error("listening on the wildcard address {addr} needs an advertise endpoint")]
    WildcardWithoutAdvertise {
        /// The configured listen address.
        addr: SocketAddr,
    },
}

impl TcpStartError {
    /// Whether starting again (later, or with another port) may succeed; configuration errors never do.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Bind { .. } | Self::Spawn(_))
    }
}
