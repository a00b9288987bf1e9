//! Error enums of the core contract. Contract outcomes (no space, unknown slot, 0-byte evict) are
//! return values, never errors.

use crate::types::TierType;

/// Why a medium could not come up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The medium's memory could not be obtained.
    #[error("{medium}: could not allocate {requested} bytes of backing memory: {reason}")]
    OutOfMemory {
        /// The medium.
        medium: String,
        /// Bytes asked for.
        requested: u64,
        /// What the allocator said.
        reason: String,
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
