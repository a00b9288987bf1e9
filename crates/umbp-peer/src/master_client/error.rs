//! Errors of the master client.

use std::time::Duration;

use umbp_core::ErrorKind;

use super::config::ConfigError;

/// Why a call to the master failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MasterClientError {
    /// The configuration can never work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The master address or the node's registration record is unusable.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The connection to the master could not be opened.
    #[error("connecting to the master at {addr}")]
    Connect {
        /// The master address.
        addr: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The master did not answer within the deadline (it may be down, overloaded or hung).
    #[error("{rpc} timed out after {after:?}")]
    Timeout {
        /// The RPC.
        rpc: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The master (or the transport) answered with an error status.
    #[error("{rpc} failed: {status}")]
    Rpc {
        /// The RPC.
        rpc: &'static str,
        /// The status.
        #[source]
        status: Box<tonic::Status>,
    },
    /// The first registration found a live node with this id at the master that cannot be told apart
    /// from this process (a master, or an earlier client, without incarnations): another process runs
    /// under the same id, or the old record must expire first. (With incarnations on both sides a
    /// restarted process replaces its predecessor at once instead.)
    #[error("node {node_id} is already registered and alive at the master")]
    AlreadyRegistered {
        /// The node id.
        node_id: String,
    },
    /// A newer process registered this node id (a higher incarnation) and took it over: this process's
    /// heartbeats are refused, its heartbeat loop has stopped and it will not register again. Stop
    /// this process, or run it under another node id.
    #[error(
        "node {node_id} was taken over by a newer process with the same node id (this process's incarnation \
         {incarnation} is superseded): stop this process, or give it another node id"
    )]
    Superseded {
        /// The node id.
        node_id: String,
        /// This process's incarnation.
        incarnation: u64,
    },
    /// The master's reply breaks the protocol (for example arrays of the wrong length); nothing of it
    /// was used.
    #[error("malformed {rpc} reply: {reason}")]
    MalformedReply {
        /// The RPC.
        rpc: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The master answered, but refused what was asked (for example it no longer knows the node, or
    /// asked for a full sync instead of acknowledging an empty one).
    #[error("{rpc} refused: {reason}")]
    Refused {
        /// The RPC.
        rpc: &'static str,
        /// What the master said.
        reason: String,
    },
    /// The call needs a successful [`register`](super::MasterClient::register) first.
    #[error("the node is not registered with the master yet")]
    NotRegistered,
    /// The client was shut down.
    #[error("the master client is shut down")]
    ShutDown,
    /// [`start_heartbeat`](super::MasterClient::start_heartbeat) was called outside a tokio runtime.
    #[error("the heartbeat loop needs a tokio runtime")]
    NoRuntime,
    /// The master did not acknowledge a clear before the deadline. Writes stay gated; the heartbeat
    /// loop (when running) keeps retrying and reopens them once the master acknowledges.
    #[error("the master did not acknowledge the clear within {after:?} ({attempts} attempts)")]
    ClearNotAcknowledged {
        /// Attempts made.
        attempts: u32,
        /// The deadline.
        after: Duration,
        /// The last attempt's error, if it failed with one.
        #[source]
        last: Option<Box<MasterClientError>>,
    },
}

impl MasterClientError {
    /// Whether the same call may succeed later (the master or the network may recover).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Connect { .. } | Self::Timeout { .. } | Self::Refused { .. } | Self::ClearNotAcknowledged { .. } => {
                true
            }
            Self::Rpc { status, .. } => matches!(
                status.code(),
                tonic::Code::Unavailable
                    | tonic::Code::DeadlineExceeded
                    | tonic::Code::ResourceExhausted
                    | tonic::Code::Aborted
                    | tonic::Code::Unknown
                    | tonic::Code::Internal
                    | tonic::Code::Cancelled
            ),
            Self::AlreadyRegistered { .. } => true,
            _ => false,
        }
    }

    /// What the caller does next; agrees with [`is_retryable`](Self::is_retryable). A master that
    /// cannot be reached (or answered with a transport-level status) is
    /// [`Unavailable`](ErrorKind::Unavailable); a deadline, a refusal, a clear not yet
    /// acknowledged or a live predecessor under the same id is [`Retry`](ErrorKind::Retry); a
    /// process superseded or shut down is [`Closed`](ErrorKind::Closed); a reply that breaks the
    /// protocol is [`Internal`](ErrorKind::Internal); the rest is fixed by the caller.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Config(_) | Self::InvalidArgument(_) | Self::NotRegistered | Self::NoRuntime => {
                ErrorKind::InvalidInput
            }
            Self::Connect { .. } => ErrorKind::Unavailable,
            Self::Timeout { .. } | Self::Refused { .. } | Self::ClearNotAcknowledged { .. } => ErrorKind::Retry,
            Self::AlreadyRegistered { .. } => ErrorKind::Retry,
            Self::Rpc { status, .. } => match status.code() {
                tonic::Code::DeadlineExceeded | tonic::Code::ResourceExhausted | tonic::Code::Aborted => {
                    ErrorKind::Retry
                }
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled => {
                    ErrorKind::Unavailable
                }
                _ => ErrorKind::InvalidInput,
            },
            Self::Superseded { .. } | Self::ShutDown => ErrorKind::Closed,
            Self::MalformedReply { .. } => ErrorKind::Internal,
        }
    }

    /// The gRPC status of an [`Rpc`](Self::Rpc) error.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            Self::Rpc { status, .. } => Some(status),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_agrees_with_is_retryable_and_names_what_to_do() {
        let rpc = |code| MasterClientError::Rpc { rpc: "Heartbeat", status: Box::new(tonic::Status::new(code, "x")) };
        let all = [
            MasterClientError::InvalidArgument("x".into()),
            MasterClientError::Timeout { rpc: "RouteGet", after: Duration::from_secs(1) },
            rpc(tonic::Code::Unavailable),
            rpc(tonic::Code::DeadlineExceeded),
            rpc(tonic::Code::Internal),
            rpc(tonic::Code::Unauthenticated),
            rpc(tonic::Code::FailedPrecondition),
            MasterClientError::AlreadyRegistered { node_id: "n".into() },
            MasterClientError::Superseded { node_id: "n".into(), incarnation: 1 },
            MasterClientError::MalformedReply { rpc: "RouteGet", reason: "x".into() },
            MasterClientError::Refused { rpc: "Heartbeat", reason: "x".into() },
            MasterClientError::NotRegistered,
            MasterClientError::ShutDown,
            MasterClientError::NoRuntime,
            MasterClientError::ClearNotAcknowledged { attempts: 1, after: Duration::from_secs(1), last: None },
        ];
        for e in &all {
            assert_eq!(e.kind().is_retryable(), e.is_retryable(), "{e:?}");
        }
        assert_eq!(rpc(tonic::Code::Unavailable).kind(), ErrorKind::Unavailable);
        assert_eq!(rpc(tonic::Code::Unauthenticated).kind(), ErrorKind::InvalidInput);
        assert_eq!(MasterClientError::ShutDown.kind(), ErrorKind::Closed);
        assert_eq!(MasterClientError::Superseded { node_id: "n".into(), incarnation: 1 }.kind(), ErrorKind::Closed);
        assert_eq!(MasterClientError::MalformedReply { rpc: "x", reason: "y".into() }.kind(), ErrorKind::Internal);
    }
}
