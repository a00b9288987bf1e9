//! The masters a client talks to: one or more addresses (`a:50051,b:50051`), each with its own
//! channel, and the failover between them.
//!
//! Masters sharing one metadata store answer every call the same way, so a call that fails for want
//! of a master — it could not be reached, the connection broke, it did not answer within the
//! deadline, or it said `UNAVAILABLE` (its store is unreachable) — is sent to the next one, each
//! master at most once per call (a bounded retry: a call costs at most one deadline per master).
//! An answer, whatever it says (`ALREADY_EXISTS`, `INVALID_ARGUMENT`, …), ends the call: an
//! application error is the same on every master. The master that answered becomes the one the
//! next calls go to first, so after a failover every call goes straight to the survivor.
//!
//! Every call is safe to repeat on another master: heartbeats carry seqs the store re-acknowledges,
//! routes and lookups only read or reserve, an unregister of a gone record is a no-op. A
//! registration whose first copy was applied before its master died is answered `ALREADY_EXISTS` by
//! the next one, which the heartbeat loop's re-registration counts as success.

use std::sync::atomic::{AtomicUsize, Ordering};

use tonic::transport::{Channel, Endpoint};
use umbp_proto::token::TokenInjector;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

use super::{Grpc, MasterClientConfig, MasterClientError};

/// The addresses of a `master_address` setting: a comma-separated list of `host:port` (or
/// `http://` URIs), blanks around each ignored.
///
/// # Errors
/// An empty list or an empty entry.
pub fn parse_master_addresses(list: &str) -> Result<Vec<String>, MasterClientError> {
    let addrs: Vec<String> = list.split(',').map(|a| a.trim().to_owned()).collect();
    if addrs.iter().any(String::is_empty) {
        return Err(MasterClientError::InvalidArgument(format!(
            "master address list {list:?} has an empty entry (expected host:port[,host:port…])"
        )));
    }
    Ok(addrs)
}

/// One channel per master and the index of the one calls go to first.
pub(super) struct Masters {
    list: Vec<(String, Grpc)>,
    current: AtomicUsize,
}

impl std::fmt::Debug for Masters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Masters")
            .field("addresses", &self.list.iter().map(|(a, _)| a.as_str()).collect::<Vec<_>>())
            .field("current", &self.current.load(Ordering::Relaxed))
            .finish()
    }
}

impl Masters {
    /// Channels to every master of `list`. The first one that accepts a connection (in order, each
    /// within the connect timeout) is connected now and becomes the current one; the others connect
    /// when first used (and reconnect by themselves after a restart, as every channel does).
    ///
    /// # Errors
    /// An invalid address; no master reachable (the first failure).
    pub(super) async fn connect(
        list: &str,
        config: &MasterClientConfig,
        token: &TokenInjector,
    ) -> Result<Self, MasterClientError> {
        let addrs = parse_master_addresses(list)?;
        let mut endpoints = Vec::with_capacity(addrs.len());
        for addr in &addrs {
            let uri = if addr.contains("://") { addr.clone() } else { format!("http://{addr}") };
            let endpoint = Endpoint::from_shared(uri)
                .map_err(|e| MasterClientError::InvalidArgument(format!("master address {addr:?}: {e}")))?
                .connect_timeout(config.connect_timeout)
                .tcp_nodelay(true);
            endpoints.push(endpoint);
        }
        let mut first_error = None;
        let mut connected = None;
        for (i, endpoint) in endpoints.iter().enumerate() {
            let error = match tokio::time::timeout(config.connect_timeout, endpoint.connect()).await {
                Err(_elapsed) => MasterClientError::Timeout { rpc: "connect", after: config.connect_timeout },
                Ok(Err(source)) => MasterClientError::Connect { addr: addrs[i].clone(), source },
                Ok(Ok(channel)) => {
                    connected = Some((i, channel));
                    break;
                }
            };
            if addrs.len() > 1 {
                tracing::warn!(master = %addrs[i], error = %error, "master unreachable; trying the next one");
            }
            first_error.get_or_insert(error);
        }
        let Some((current, channel)) = connected else {
            return Err(first_error.unwrap_or(MasterClientError::InvalidArgument("no master address".into())));
        };
        let client = |channel: Channel| {
            UmbpMasterClient::with_interceptor(channel, token.clone())
                .max_decoding_message_size(config.max_message_bytes)
                .max_encoding_message_size(config.max_message_bytes)
        };
        let mut channel = Some(channel);
        let list = addrs
            .into_iter()
            .zip(endpoints)
            .enumerate()
            .map(|(i, (addr, endpoint))| {
                let ch = if i == current { channel.take() } else { None };
                (addr, client(ch.unwrap_or_else(|| endpoint.connect_lazy())))
            })
            .collect();
        Ok(Self { list, current: AtomicUsize::new(current) })
    }

    /// How many masters.
    pub(super) fn len(&self) -> usize {
        self.list.len()
    }

    /// The `attempt`-th master to try for a call, from the current one on: its index, address and
    /// client.
    pub(super) fn pick(&self, start: usize, attempt: usize) -> (usize, &str, Grpc) {
        let i = (start + attempt) % self.list.len();
        let (addr, grpc) = &self.list[i];
        (i, addr, grpc.clone())
    }

    /// The index of the master calls go to first.
    pub(super) fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    /// The address of the master calls go to first.
    pub(super) fn current_address(&self) -> &str {
        &self.list[self.current() % self.list.len()].0
    }

    /// Makes master `i` (which just answered) the first for the next calls; returns whether it was
    /// another one (a failover).
    pub(super) fn answered_by(&self, i: usize) -> bool {
        self.current.swap(i, Ordering::Relaxed) != i
    }
}

/// Whether a call that failed with `error` should go to the next master: the master could not be
/// reached or did not answer in time, or answered that it cannot serve now. Never for an answer.
pub(super) fn fails_over(error: &MasterClientError) -> bool {
    match error {
        MasterClientError::Timeout { .. } | MasterClientError::Connect { .. } => true,
        MasterClientError::Rpc { status, .. } => {
            matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled)
                && (status.code() == tonic::Code::Unavailable || is_transport(status))
        }
        _ => false,
    }
}

/// Whether a status was made by the channel from a transport error (a broken connection) rather
/// than sent by the master: it has a source error, which a status decoded off the wire never has.
fn is_transport(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_of_masters_parses_and_an_empty_entry_is_refused() {
        assert_eq!(parse_master_addresses("a:1").unwrap_or_default(), vec!["a:1"]);
        assert_eq!(parse_master_addresses(" a:1 , http://b:2").unwrap_or_default(), vec!["a:1", "http://b:2"]);
        for bad in ["", "a:1,", ",a:1", "a:1,,b:2"] {
            assert!(parse_master_addresses(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_a_missing_master_fails_over_never_an_answer() {
        let rpc = |code| MasterClientError::Rpc { rpc: "x", status: Box::new(tonic::Status::new(code, "m")) };
        let d = std::time::Duration::from_secs(1);
        assert!(fails_over(&MasterClientError::Timeout { rpc: "x", after: d }));
        assert!(fails_over(&rpc(tonic::Code::Unavailable)));
        for code in [
            tonic::Code::AlreadyExists,
            tonic::Code::InvalidArgument,
            tonic::Code::FailedPrecondition,
            tonic::Code::Unauthenticated,
            tonic::Code::Internal,
            // Sent by a master (no transport source): an answer.
            tonic::Code::Unknown,
        ] {
            assert!(!fails_over(&rpc(code)), "{code:?}");
        }
    }
}
