//! Why a [`TcpEngine`](super::TcpEngine) or a [`DataServer`](super::DataServer) could not start.

use std::io;
use std::net::SocketAddr;

use umbp_core::ErrorKind;

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
        self.kind().is_retryable()
    }

    /// What the caller should do next: a port that cannot be bound is
    /// [`Unavailable`](ErrorKind::Unavailable) (free it or pick another), a thread that cannot be
    /// spawned is [`Retry`](ErrorKind::Retry), and a configuration error is
    /// [`InvalidInput`](ErrorKind::InvalidInput).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Bind { .. } => ErrorKind::Unavailable,
            Self::Spawn(_) => ErrorKind::Retry,
            Self::TokenTooLong { .. } | Self::ConflictingTokens | Self::WildcardWithoutAdvertise { .. } => {
                ErrorKind::InvalidInput
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_start_error_tells_the_caller_what_to_do_next() {
        let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");
        let bind = TcpStartError::Bind { addr, source: io::Error::from(io::ErrorKind::AddrInUse) };
        assert_eq!(bind.kind(), ErrorKind::Unavailable);
        assert!(std::error::Error::source(&bind).is_some(), "the OS error stays the source");
        assert_eq!(TcpStartError::Spawn(io::Error::other("no threads")).kind(), ErrorKind::Retry);
        let config = [
            TcpStartError::TokenTooLong { len: 300, max: 255 },
            TcpStartError::ConflictingTokens,
            TcpStartError::WildcardWithoutAdvertise { addr },
        ];
        for err in config {
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
            assert!(!err.is_retryable());
        }
        assert!(bind.is_retryable());
    }
}
