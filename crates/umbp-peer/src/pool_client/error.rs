//! The errors of the pool client: [`PoolError`] (a node could not start or stop) and [`KeyError`]
//! (one key of a batch failed), each with a `kind()` that says what to do next.

use std::sync::Arc;

use umbp_core::ErrorKind;
use umbp_transfer::FailureKind;

use crate::master_client::MasterClientError;

/// An error kept as the source of a [`KeyError`], which is `Clone` and `Eq` while the errors it
/// wraps are neither: shared, and compared by what it says. Its `source()` is the wrapped error's,
/// so a chain printed through it reads as the original.
#[derive(Debug, Clone)]
pub struct SharedError(Arc<dyn std::error::Error + Send + Sync>);

impl SharedError {
    /// Shares `error`.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(error))
    }

    /// The wrapped error (downcast it to the type that raised it).
    pub fn get(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl PartialEq for SharedError {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for SharedError {}

impl std::fmt::Display for SharedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl From<MasterClientError> for SharedError {
    fn from(e: MasterClientError) -> Self {
        Self::new(e)
    }
}

/// Why a node could not start or stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// A setting is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The medium could not come up.
    #[error("medium: {0}")]
    Medium(#[from] umbp_core::BackendError),
    /// The registry refused the medium.
    #[error("registry: {0}")]
    Registry(#[from] umbp_core::RegistryError),
    /// The transfer layer could not start, or refused a registration.
    #[error("transfer layer: {context}: {source}")]
    Transfer {
        /// What was being done.
        context: &'static str,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The TCP data server could not start (its port in use, say); the source says why.
    #[error("data plane")]
    DataPlane(#[source] umbp_transfer::TcpStartError),
    /// The client was closed.
    #[error("the client is closed")]
    Closed,
    /// The peer service could not start.
    #[error("peer service: {0}")]
    PeerService(#[from] crate::peer_service::PeerServiceError),
    /// The master refused or could not be reached.
    #[error("master: {0}")]
    Master(#[from] MasterClientError),
    /// The metrics endpoint could not start.
    #[error(transparent)]
    Metrics(#[from] umbp_metrics::MetricsError),
}

impl PoolError {
    /// What the caller does next: fix a setting or an address in use ([`ErrorKind::InvalidInput`]),
    /// wait for the master ([`ErrorKind::Unavailable`]), build a new client after
    /// [`Closed`](Self::Closed), or report the rest.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Config(_) => ErrorKind::InvalidInput,
            Self::Medium(e) => e.kind(),
            Self::Registry(e) => e.kind(),
            Self::Transfer { .. } => ErrorKind::Internal,
            Self::DataPlane(e) => e.kind(),
            Self::Closed => ErrorKind::Closed,
            Self::PeerService(e) => e.kind(),
            Self::Master(e) => e.kind(),
            Self::Metrics(e) => e.kind(),
        }
    }

    /// Whether a listen address of this node could not be bound (its peer, data or metrics port
    /// in use, or not an address of this host): a setup error the operator fixes, not a failure
    /// of the pool.
    pub fn is_bind_failure(&self) -> bool {
        matches!(
            self,
            Self::PeerService(crate::peer_service::PeerServiceError::Bind { .. })
                | Self::DataPlane(umbp_transfer::TcpStartError::Bind { .. })
                | Self::Metrics(umbp_metrics::MetricsError::Bind { .. })
        )
    }
}

/// Why one key of a batch failed. [`is_retryable`](Self::is_retryable) says whether the same
/// request may succeed later (the client already re-routed it `max_reroutes` times).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// Keys must not be empty.
    #[error("empty key")]
    EmptyKey,
    /// Values must not be empty.
    #[error("empty value")]
    EmptyValue,
    /// No node can take the value now (every candidate full, excluded or gone).
    #[error("no node can take a value of {size} bytes")]
    NoSpace {
        /// The value size.
        size: u64,
    },
    /// The value is larger than the total capacity of every medium in the pool: it can never be
    /// stored.
    #[error("a value of {size} bytes is larger than the largest medium in the pool ({largest} bytes)")]
    TooLarge {
        /// The value size.
        size: u64,
        /// Total bytes of the largest medium the master knows of.
        largest: u64,
    },
    /// A node refused the value for good (larger than its medium, no medium for the tier, clearing)
    /// or refused the commit.
    #[error("{node} refused the value: {message}")]
    Refused {
        /// The node that refused.
        node: String,
        /// What it refused.
        message: String,
    },
    /// The key is not in the pool.
    #[error("not found")]
    Miss,
    /// The caller's buffer is shorter than the stored value.
    #[error("buffer of {got} bytes is shorter than the stored value of {needed} bytes")]
    BufferTooSmall {
        /// The stored size.
        needed: u64,
        /// The buffer's size.
        got: u64,
    },
    /// `batch_get` was given fewer buffers than keys: this key has none.
    #[error("no buffer for this key")]
    NoBuffer,
    /// A ranged call's ranges for this key cannot be served: none, an empty or overlapping one, or
    /// one past the value's end; fix the ranges.
    #[error("bad ranges: {message}")]
    BadRanges {
        /// What is wrong with them.
        message: String,
    },
    /// A node could not be reached, or its RPC failed or answered malformed data.
    #[error("{node} unreachable: {message}")]
    Unreachable {
        /// The node.
        node: String,
        /// What failed.
        message: String,
        /// The peer client's error, when one caused it.
        #[source]
        source: Option<SharedError>,
    },
    /// Moving the bytes to or from a node failed.
    #[error("transfer with {node} failed ({kind:?}): {message}")]
    Transfer {
        /// The node on the other side.
        node: String,
        /// The transfer layer's failure kind.
        kind: FailureKind,
        /// What happened.
        message: String,
    },
    /// The node stayed busy for as long as a read or write waits it out (about 10 s): a read's
    /// holder has the key, or a write's node has room, but every staging page is in use by other
    /// reads and writes. Try again later.
    #[error("{node} is busy serving other reads and writes (no staging page free); try again")]
    Busy {
        /// The holder.
        node: String,
    },
    /// A read copied for longer than the holder's read lease (`read_lease`): the pages may have been
    /// evicted and reused under it, so the bytes are not trusted. The buffer's contents are unspecified.
    #[error(
        "the read lease on {node} lapsed before the copy finished (a link too slow for read_lease: raise \
         read_lease on every node of the cluster, or read fewer bytes per call)"
    )]
    LeaseExpired {
        /// The holder.
        node: String,
    },
    /// A write would have finished after the slot's pending TTL: aborted instead of committed.
    #[error("the slot on {node} expired before the write finished")]
    SlotExpired {
        /// The node.
        node: String,
    },
    /// The master could not route the key (or answer a lookup).
    #[error("routing: {0}")]
    Routing(#[source] SharedError),
    /// The client was closed (before or during the call).
    #[error("the client is closed")]
    Closed,
    /// Anything else (an unaddressable buffer, a malformed slot).
    #[error("{0}")]
    Failed(String),
}

impl KeyError {
    /// What the caller does next. Agrees with [`is_retryable`](Self::is_retryable): a bad request
    /// (or a key that is not there) is [`ErrorKind::InvalidInput`], a node or the master that did
    /// not answer [`ErrorKind::Unavailable`], a full, busy or racing pool [`ErrorKind::Retry`].
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::EmptyKey
            | Self::EmptyValue
            | Self::TooLarge { .. }
            | Self::Refused { .. }
            | Self::Miss
            | Self::BufferTooSmall { .. }
            | Self::NoBuffer
            | Self::BadRanges { .. } => ErrorKind::InvalidInput,
            Self::NoSpace { .. }
            | Self::Busy { .. }
            | Self::Transfer { .. }
            | Self::LeaseExpired { .. }
            | Self::SlotExpired { .. } => ErrorKind::Retry,
            Self::Unreachable { .. } | Self::Routing(_) => ErrorKind::Unavailable,
            Self::Closed => ErrorKind::Closed,
            Self::Failed(_) => ErrorKind::Internal,
        }
    }

    /// Whether the same request may succeed later or on another node.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::NoSpace { .. }
                | Self::Unreachable { .. }
                | Self::Busy { .. }
                | Self::Transfer { .. }
                | Self::LeaseExpired { .. }
                | Self::SlotExpired { .. }
                | Self::Routing(_)
        )
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;
    use crate::peer_client::PeerClientError;

    fn every_key_error() -> Vec<KeyError> {
        let node = || "n1".to_owned();
        let peer = PeerClientError::Mismatch { what: "keys", got: 1, asked: 2 };
        vec![
            KeyError::EmptyKey,
            KeyError::EmptyValue,
            KeyError::NoSpace { size: 1 },
            KeyError::TooLarge { size: 2, largest: 1 },
            KeyError::Refused { node: node(), message: "no".into() },
            KeyError::Miss,
            KeyError::BufferTooSmall { needed: 2, got: 1 },
            KeyError::NoBuffer,
            KeyError::Unreachable { node: node(), message: peer.to_string(), source: Some(SharedError::new(peer)) },
            KeyError::Transfer { node: node(), kind: FailureKind::Local, message: "x".into() },
            KeyError::Busy { node: node() },
            KeyError::LeaseExpired { node: node() },
            KeyError::SlotExpired { node: node() },
            KeyError::Routing(MasterClientError::NotRegistered.into()),
            KeyError::Closed,
            KeyError::Failed("x".into()),
        ]
    }

    #[test]
    fn a_key_errors_kind_agrees_with_is_retryable() {
        for e in every_key_error() {
            assert_eq!(e.kind().is_retryable(), e.is_retryable(), "{e:?}");
        }
        assert_eq!(KeyError::Closed.kind(), ErrorKind::Closed);
        assert_eq!(KeyError::Failed("x".into()).kind(), ErrorKind::Internal);
        assert_eq!(KeyError::Miss.kind(), ErrorKind::InvalidInput);
        assert_eq!(KeyError::Busy { node: "n".into() }.kind(), ErrorKind::Retry);
    }

    #[test]
    fn key_errors_keep_their_sources_and_stay_comparable() {
        let routing = KeyError::Routing(MasterClientError::ShutDown.into());
        let source = routing.source().expect("the master error is the source");
        assert_eq!(source.to_string(), MasterClientError::ShutDown.to_string());
        let KeyError::Routing(shared) = &routing else { unreachable!() };
        assert!(shared.get().downcast_ref::<MasterClientError>().is_some(), "the typed error is reachable");
        assert_eq!(routing.clone(), routing, "Clone and Eq survive");
        let peer = PeerClientError::Mismatch { what: "keys", got: 1, asked: 2 };
        let e =
            KeyError::Unreachable { node: "n".into(), message: peer.to_string(), source: Some(SharedError::new(peer)) };
        assert!(e.source().is_some());
    }

    #[test]
    fn a_pool_errors_kind_says_what_to_do_next() {
        assert_eq!(PoolError::Config("x".into()).kind(), ErrorKind::InvalidInput);
        assert_eq!(PoolError::Closed.kind(), ErrorKind::Closed);
        assert_eq!(PoolError::Master(MasterClientError::ShutDown).kind(), ErrorKind::Closed);
        let bind = crate::peer_service::PeerServiceError::Bind {
            addr: ([127, 0, 0, 1], 1).into(),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        };
        assert_eq!(PoolError::PeerService(bind).kind(), ErrorKind::InvalidInput);
        let transfer = PoolError::Transfer { context: "GPU copy engine", source: "no device".into() };
        assert_eq!(transfer.kind(), ErrorKind::Internal);
        assert!(transfer.source().is_some(), "the engine's error stays the source");
    }
}
