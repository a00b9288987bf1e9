//! Error enums of the core contract. Contract outcomes (no space, unknown slot, 0-byte evict) are
//! return values, never errors.

use crate::types::TierType;

/// What a caller should do about an error: the one question every umbp error answers through its
/// `kind()`, whichever crate raised it (the shape of SlateDB's public `ErrorKind`).
///
/// ```
/// use umbp_core::{BackendError, ErrorKind};
///
/// let e = BackendError::InvalidConfig("page_size must be a power of two".into());
/// assert_eq!(e.kind(), ErrorKind::InvalidInput);
/// assert!(!e.kind().is_retryable());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request or the configuration can never succeed as given: fix it, do not retry it.
    InvalidInput,
    /// A transient condition (busy, timed out, out of room for now): the same call may succeed later.
    Retry,
    /// Something the call needs (the master, a peer, a device) cannot be reached: retry after it is
    /// back, or route around it.
    Unavailable,
    /// The object was shut down or closed: build a new one.
    Closed,
    /// A bug or an invariant broken: report it, with the error's source chain.
    Internal,
}

impl ErrorKind {
    /// Whether the same call may succeed if made again later ([`Retry`](Self::Retry) and
    /// [`Unavailable`](Self::Unavailable)).
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::Retry | Self::Unavailable)
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::InvalidInput => "invalid input",
            Self::Retry => "retry",
            Self::Unavailable => "unavailable",
            Self::Closed => "closed",
            Self::Internal => "internal",
        })
    }
}

/// Why a medium could not come up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The medium's memory could not be obtained.
    #[error("{medium}: could not allocate {requested} bytes of backing memory")]
    OutOfMemory {
        /// The medium.
        medium: String,
        /// Bytes asked for.
        requested: u64,
        /// What the allocator said: its error, kept as the source (or, where it has none, a
        /// message: `"…".into()`).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// A buffer could not be registered with the transfer layer.
    #[error("{medium}: registering buffer {buffer_index} failed")]
    Registration {
        /// The medium.
        medium: String,
        /// The buffer.
        buffer_index: usize,
        /// The registrar's error.
        #[source]
        source: RegistrationError,
    },
    /// The configuration can never work; the message names the setting.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The medium was shut down and cannot be initialised again.
    #[error("{0}: already shut down")]
    ShutDown(String),
    /// A device or file-system operation failed.
    #[error("{medium}: {context}")]
    Io {
        /// The medium.
        medium: String,
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

impl BackendError {
    /// Whether retrying `init` later (with the same configuration) may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::OutOfMemory { .. } | Self::Registration { .. } | Self::Io { .. })
    }

    /// What the caller should do next.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::OutOfMemory { .. } | Self::Registration { .. } => ErrorKind::Retry,
            Self::Io { .. } => ErrorKind::Unavailable,
            Self::InvalidConfig(_) => ErrorKind::InvalidInput,
            Self::ShutDown(_) => ErrorKind::Closed,
        }
    }
}

/// Why a region could not be registered with a transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistrationError {
    /// No transport accepts memory of this kind (for example GPU memory without a GPU engine).
    #[error("no transport can register {len} bytes of {location:?} memory")]
    Unsupported {
        /// Region length.
        len: u64,
        /// Where it lives.
        location: crate::MemoryLocation,
    },
    /// The transport refused the region.
    #[error("{transport} refused the region: {reason}")]
    Refused {
        /// The transport.
        transport: String,
        /// Its reason.
        reason: String,
    },
}

impl RegistrationError {
    /// What the caller should do next: no transport will ever take this memory as configured.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

/// Why a backend could not join a [`BackendRegistry`](crate::BackendRegistry).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Every medium on a node shares one page size (the master's KV block size).
    #[error("{tier} backend has page size {got}, but this node's media use {expected}")]
    PageSizeMismatch {
        /// The rejected backend's tier.
        tier: TierType,
        /// Its page size.
        got: u64,
        /// The registry's page size.
        expected: u64,
    },
    /// The backend-id space is exhausted.
    #[error("a node can register at most {max} backends")]
    TooManyBackends {
        /// The limit.
        max: usize,
    },
    /// A backend of tier `Unknown` cannot be routed to.
    #[error("a backend must have a real tier, not {0}")]
    UnknownTier(TierType),
}

impl RegistryError {
    /// What the caller should do next: every variant is a configuration that can never join.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_backend_error_tells_the_caller_what_to_do_next() {
        let io = BackendError::Io { medium: "ssd".into(), context: "open".into(), source: std::io::Error::other("x") };
        assert_eq!(io.kind(), ErrorKind::Unavailable);
        assert_eq!(BackendError::InvalidConfig("x".into()).kind(), ErrorKind::InvalidInput);
        assert_eq!(BackendError::ShutDown("dram".into()).kind(), ErrorKind::Closed);
        let refused = std::io::Error::from(std::io::ErrorKind::OutOfMemory);
        let oom = BackendError::OutOfMemory { medium: "dram".into(), requested: 1, source: Box::new(refused) };
        assert_eq!(oom.kind(), ErrorKind::Retry);
        let cause = std::error::Error::source(&oom).expect("the allocator's error is the source");
        assert_eq!(cause.to_string(), std::io::Error::from(std::io::ErrorKind::OutOfMemory).to_string());
        assert_eq!(oom.kind().is_retryable(), oom.is_retryable());
        assert_eq!(RegistryError::TooManyBackends { max: 1 }.kind(), ErrorKind::InvalidInput);
        assert!(!ErrorKind::Closed.is_retryable() && ErrorKind::Unavailable.is_retryable());
    }
}
