//! The same-host shared-memory data path, its foundation: a holder hands the memory files behind
//! its registered regions to authenticated processes on the same host, which map them and copy with
//! plain loads and stores (design: `docs/design/shm-data-path.md`).
//!
//! - [`HostIdentity`] — the boot id and the network namespace: two processes may share memory only
//!   when both match (the rule, and why, in the design note).
//! - [`ShmServer`] — a Unix-domain stream socket in the Linux abstract namespace, named after the
//!   node's data endpoint ([`socket_name`]); it admits a peer whose `SO_PEERCRED` user is this
//!   process's (or whose group is a configured one) **and** who presents the cluster token, then
//!   answers "send me region R" with the region's sealed memory file (`SCM_RIGHTS`), its offset and
//!   length, and an epoch. A shared, read-only **epoch table** (one word per region, passed at the
//!   handshake) says at any time which epoch of each region is current: deregistration zeroes the
//!   word, so a client can tell a stale mapping without a round trip.
//! - [`ShmClient`] — connects, authenticates, fetches a region's file and maps it `MAP_SHARED`, with
//!   one cached [`SharedMapping`] per (peer, region id), replaced when its epoch is no longer
//!   current and unmapped when the last user drops it.
//!
//! - [`SharedMemoryEngine`] — the transfer engine over these: the composite engine selects it per
//!   pair before TCP, and hands any pair it fails to TCP.
//!
//! # Safety of mappings
//! The server accepts only files sealed against shrinking (`F_SEAL_SHRINK`) and ranges inside
//! them, and the client checks both again on every file it receives, so no mapping can ever reach
//! past the end of its file: a holder that dies or deregisters leaves its peers' mappings valid
//! memory (the pages live as long as any mapping), never a `SIGBUS`. [`SharedMapping::read_at`] and
//! [`write_at`](SharedMapping::write_at) check the region's epoch before and after the copy, so a
//! copy that raced a deregistration is reported [`ShmError::Stale`], never returned as good bytes.

mod client;
mod engine;
mod epochs;
pub(crate) mod fanout;
mod group;
mod identity;
mod keyed;
mod server;
pub(crate) mod stream;
pub(crate) mod wire;

use std::io;

/// The TCP handshake's constant-time comparison: the time taken says nothing about how much of a
/// wrong token matched.
use crate::tcp::tokens_equal;

pub use client::{SharedMapping, ShmClient, ShmClientConfig};
pub use engine::{SharedMemoryConfig, SharedMemoryEngine};
pub use group::group_id;
pub use identity::HostIdentity;
pub(crate) use keyed::{Copier, SharedReads};
pub use server::{ShmServer, ShmServerConfig};
pub use stream::{copy_streaming, stream_threshold};

/// The longest abstract socket name (`sun_path` is 108 bytes, the first one the abstract marker).
const MAX_SOCKET_NAME: usize = 107;

/// The abstract-namespace socket name of the shared-memory server of the node whose data endpoint
/// is `endpoint` (the `host:port` every remote ref names), or why it cannot be one.
///
/// An abstract name lives in the network namespace (no file to create, clean up after a crash, or
/// share between mount namespaces), so a peer in another namespace cannot reach it at all — the
/// same line the [`HostIdentity`] rule draws — and the endpoint is unique in a namespace because its
/// TCP port is.
pub fn socket_name(endpoint: &str) -> Result<String, ShmError> {
    let name = format!("umbp-shm/{endpoint}");
    if endpoint.is_empty() || name.len() > MAX_SOCKET_NAME || endpoint.contains('\0') {
        return Err(ShmError::Invalid(format!("no socket name for data endpoint {endpoint:?}")));
    }
    Ok(name)
}

/// Why a server turned a client away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The cluster token did not match.
    Token,
    /// The peer's user (and group) may not map this process's memory.
    Credentials,
    /// The hello was malformed (another protocol or version).
    Hello,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Token => "wrong cluster token",
            Self::Credentials => "peer credentials not allowed",
            Self::Hello => "malformed hello",
        })
    }
}

/// What went wrong on the shared-memory path. Every error leaves the caller free to take another
/// path (TCP) for the same bytes.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// The socket, a descriptor or a mapping failed.
    #[error("shared memory with {peer}: {context}: {source}")]
    Io {
        /// The peer's data endpoint (or this server's).
        peer: String,
        /// What was being done.
        context: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The server refused the handshake.
    #[error("{peer} refused the shared-memory handshake: {reason}")]
    Refused {
        /// The peer.
        peer: String,
        /// Why.
        reason: Refusal,
    },
    /// The server has no shareable region by that id (never registered, or deregistered).
    #[error("{peer} has no shareable region {region_id:#x}")]
    UnknownRegion {
        /// The peer.
        peer: String,
        /// The region asked for.
        region_id: u64,
    },
    /// The region was deregistered (or re-registered) while mapped: its bytes are not to be trusted.
    #[error("region {region_id:#x} of {peer} is no longer registered under the mapped epoch")]
    Stale {
        /// The peer.
        peer: String,
        /// The region.
        region_id: u64,
    },
    /// A range outside the region.
    #[error("{len} bytes at offset {offset} leave a region of {region_len} bytes")]
    OutOfRange {
        /// Start of the range.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The peer sent something this protocol does not allow.
    #[error("{peer} broke the shared-memory protocol: {reason}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// A request that can never succeed (a bad configuration, an unsealed file, a bad range).
    #[error("invalid shared-memory request: {0}")]
    Invalid(String),
}

impl ShmError {
    /// What a caller does about it: a refusal or an invalid request is a configuration error that
    /// retrying cannot fix; the rest may pass on another path or after the peer comes back.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::Refused { .. } | Self::Invalid(_) | Self::OutOfRange { .. } => umbp_core::ErrorKind::InvalidInput,
            Self::Io { .. } | Self::UnknownRegion { .. } | Self::Stale { .. } | Self::Protocol { .. } => {
                umbp_core::ErrorKind::Unavailable
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_names_follow_the_endpoint_and_fit_the_address() {
        assert_eq!(socket_name("10.0.0.7:7001").expect("name"), "umbp-shm/10.0.0.7:7001");
        assert!(socket_name("").is_err());
        assert!(socket_name("a\0b:1").is_err());
        let long = "h".repeat(MAX_SOCKET_NAME);
        assert!(matches!(socket_name(&long), Err(ShmError::Invalid(_))));
        let fits = "h".repeat(MAX_SOCKET_NAME - "umbp-shm/".len());
        assert_eq!(socket_name(&fits).expect("fits").len(), MAX_SOCKET_NAME);
    }

    #[test]
    fn refusals_are_configuration_errors() {
        let refused = ShmError::Refused { peer: "p".into(), reason: Refusal::Token };
        assert_eq!(refused.kind(), umbp_core::ErrorKind::InvalidInput);
        assert_eq!(ShmError::Stale { peer: "p".into(), region_id: 1 }.kind(), umbp_core::ErrorKind::Unavailable);
    }
}
