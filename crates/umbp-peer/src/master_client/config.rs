//! Settings of the master client: names, defaults and ranges. The command line (`umbp node`) layers
//! the file's `[node.master]`, the `UMBP_*` environment (the reference's names) and its flags over
//! them through its one settings table.

use std::fmt;
use std::time::Duration;

use umbp_core::ErrorKind;

/// A setting that can never work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field of [`MasterClientConfig`] is out of range.
    #[error("invalid master client setting `{setting}`: {reason}")]
    Invalid {
        /// The field.
        setting: &'static str,
        /// Why.
        reason: String,
    },
}

impl ConfigError {
    /// What the caller does next: fix the setting (always [`ErrorKind::InvalidInput`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid { .. } => ErrorKind::InvalidInput,
        }
    }
}

/// Settings of a [`MasterClient`](super::MasterClient).
///
/// The one place their names (the settings file's `[node.master]` keys), defaults and
/// meaning are written; durations read `"3s"`, sizes `"4MiB"` or bytes. The cluster token is not a
/// key of its own (the node's `cluster_token` is handed down).
///
/// Every field has a default (in its doc) and, where noted, the `UMBP_*` variable `umbp node` reads
/// for it. The heartbeat interval is not here: the master hands it out in its registration reply.
#[derive(Clone, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MasterClientConfig {
    /// Deadline of one `Heartbeat` RPC (a delta, a keepalive or one full-sync chunk). Env
    /// `UMBP_HEARTBEAT_RPC_TIMEOUT_MS`. Default: 3000 ms.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub heartbeat_rpc_timeout: Duration,
    /// Most events in one delta bundle (one sequence number). Env `UMBP_HEARTBEAT_EVENTS_PER_BUNDLE`.
    /// Default: 1024.
    #[serde(deserialize_with = "at_least_one")]
    pub events_per_bundle: usize,
    /// Most delta bundles in one `Heartbeat` RPC; a longer backlog goes in back-to-back RPCs. Env
    /// `UMBP_HEARTBEAT_MAX_BUNDLES_PER_RPC`. Default: 16.
    #[serde(deserialize_with = "at_least_one")]
    pub max_bundles_per_rpc: usize,
    /// A backend whose unshipped outbox reaches this many events wakes the heartbeat loop at once;
    /// 0 disables it. Env `UMBP_AUTO_FLUSH_EVENT_THRESHOLD`. Default: 128.
    pub auto_flush_event_threshold: usize,
    /// Deadline of the `UnregisterClient` call made by [`shutdown`](super::MasterClient::shutdown).
    /// Env `UMBP_RPC_SHUTDOWN_TIMEOUT_MS`. Default: 3000 ms.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub shutdown_timeout: Duration,
    /// Most events the client keeps queued (unacknowledged) for the master. When a drain would exceed
    /// it, the queued deltas are dropped and a full sync is sent instead, so a master outage never
    /// grows memory without bound. Env `UMBP_HEARTBEAT_MAX_OUTBOX_EVENTS`. Default: 1 000 000.
    #[serde(deserialize_with = "at_least_one")]
    pub max_outbox_events: usize,
    /// Most events in one full-sync chunk. Env `UMBP_FULL_SYNC_CHUNK_EVENTS`. Default: 32 768.
    #[serde(deserialize_with = "at_least_one")]
    pub full_sync_chunk_events: usize,
    /// Largest encoded `Heartbeat` request the client builds: caps each full-sync chunk and the
    /// bundles of one delta RPC (one bundle, or one event of a chunk, always goes even if larger). Far
    /// below the 64 MiB gRPC limit even with long keys. Env `UMBP_HEARTBEAT_MAX_REQUEST_BYTES`.
    /// Default: 4 MiB.
    #[serde(serialize_with = "umbp_core::units::serde::size_usize::serialize")]
    #[serde(deserialize_with = "request_bytes")]
    pub max_request_bytes: usize,
    /// Deadline of every other RPC (registration, routing, lookup, cluster status, unregister outside
    /// shutdown). Env `UMBP_MASTER_RPC_TIMEOUT_MS`. Default: 3000 ms.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub rpc_timeout: Duration,
    /// Deadline for opening the connection to the master. Env `UMBP_MASTER_CONNECT_TIMEOUT_MS`.
    /// Default: 3000 ms.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub connect_timeout: Duration,
    /// How long [`clear`](super::MasterClient::clear) retries the empty full sync before it returns an
    /// error (the heartbeat loop keeps retrying afterwards). Env `UMBP_CLEAR_TIMEOUT_MS`.
    /// Default: 30 000 ms.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub clear_timeout: Duration,
    /// The heartbeat interval used when the master's registration reply carries 0. Default: 5000 ms
    /// (the reference's).
    #[serde(with = "umbp_core::units::serde::duration")]
    pub default_heartbeat_interval: Duration,
    /// Largest gRPC message sent or accepted. Default: 64 MiB (the master's limit).
    #[serde(with = "umbp_core::units::serde::size_usize")]
    pub max_message_bytes: usize,
    /// Sent as `x-umbp-token` metadata on every call when set. Env `UMBP_CLUSTER_TOKEN` (an empty value
    /// means none). Default: none.
    #[serde(skip)]
    pub cluster_token: Option<String>,
}

impl Default for MasterClientConfig {
    fn default() -> Self {
        Self {
            heartbeat_rpc_timeout: Duration::from_millis(3000),
            events_per_bundle: 1024,
            max_bundles_per_rpc: 16,
            auto_flush_event_threshold: 128,
            shutdown_timeout: Duration::from_millis(3000),
            max_outbox_events: 1_000_000,
            full_sync_chunk_events: 32_768,
            max_request_bytes: 4 << 20,
            rpc_timeout: Duration::from_millis(3000),
            connect_timeout: Duration::from_millis(3000),
            clear_timeout: Duration::from_millis(30_000),
            default_heartbeat_interval: Duration::from_millis(5000),
            max_message_bytes: 64 << 20,
            cluster_token: None,
        }
    }
}

impl fmt::Debug for MasterClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MasterClientConfig")
            .field("heartbeat_rpc_timeout", &self.heartbeat_rpc_timeout)
            .field("events_per_bundle", &self.events_per_bundle)
            .field("max_bundles_per_rpc", &self.max_bundles_per_rpc)
            .field("auto_flush_event_threshold", &self.auto_flush_event_threshold)
            .field("shutdown_timeout", &self.shutdown_timeout)
            .field("max_outbox_events", &self.max_outbox_events)
            .field("full_sync_chunk_events", &self.full_sync_chunk_events)
            .field("max_request_bytes", &self.max_request_bytes)
            .field("rpc_timeout", &self.rpc_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("clear_timeout", &self.clear_timeout)
            .field("default_heartbeat_interval", &self.default_heartbeat_interval)
            .field("max_message_bytes", &self.max_message_bytes)
            // Never print the secret.
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// The smallest request cap: room for the request's fixed fields and a few events.
const MIN_REQUEST_BYTES: usize = 4 << 10;

fn at_least_one<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let n = <usize as serde::Deserialize>::deserialize(d)?;
    if n >= 1 { Ok(n) } else { Err(serde::de::Error::custom(format!("{n} is out of range: expected an integer >= 1"))) }
}

fn request_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let n = umbp_core::units::serde::size_usize::deserialize(d)?;
    if n >= MIN_REQUEST_BYTES {
        Ok(n)
    } else {
        Err(serde::de::Error::custom(format!("{n} is below the minimum of {MIN_REQUEST_BYTES}")))
    }
}

impl MasterClientConfig {
    /// Checks every field's range (called by [`MasterClient::connect`](super::MasterClient::connect)).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |setting: &'static str, reason: String| Err(ConfigError::Invalid { setting, reason });
        for (setting, value) in [
            ("heartbeat_rpc_timeout", self.heartbeat_rpc_timeout),
            ("shutdown_timeout", self.shutdown_timeout),
            ("rpc_timeout", self.rpc_timeout),
            ("connect_timeout", self.connect_timeout),
            ("clear_timeout", self.clear_timeout),
            ("default_heartbeat_interval", self.default_heartbeat_interval),
        ] {
            if value.is_zero() {
                return invalid(setting, "must be greater than 0".into());
            }
        }
        for (setting, value) in [
            ("events_per_bundle", self.events_per_bundle),
            ("max_bundles_per_rpc", self.max_bundles_per_rpc),
            ("max_outbox_events", self.max_outbox_events),
            ("full_sync_chunk_events", self.full_sync_chunk_events),
        ] {
            if value == 0 {
                return invalid(setting, "must be at least 1".into());
            }
        }
        if self.max_request_bytes < MIN_REQUEST_BYTES {
            return invalid(
                "max_request_bytes",
                format!("{} is below the minimum of {MIN_REQUEST_BYTES}", self.max_request_bytes),
            );
        }
        if self.max_request_bytes > self.max_message_bytes / 2 {
            return invalid(
                "max_request_bytes",
                format!(
                    "{} leaves no headroom under max_message_bytes {} (at most half of it)",
                    self.max_request_bytes, self.max_message_bytes
                ),
            );
        }
        if let Some(token) = &self.cluster_token
            && tonic::metadata::MetadataValue::<tonic::metadata::Ascii>::try_from(token.as_str()).is_err()
        {
            return invalid("cluster_token", "must be visible ASCII (it travels as gRPC metadata)".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_reference_values_and_valid() {
        let c = MasterClientConfig::default();
        assert_eq!(c.heartbeat_rpc_timeout, Duration::from_millis(3000));
        assert_eq!(c.events_per_bundle, 1024);
        assert_eq!(c.max_bundles_per_rpc, 16);
        assert_eq!(c.auto_flush_event_threshold, 128);
        assert_eq!(c.shutdown_timeout, Duration::from_millis(3000));
        assert!(c.cluster_token.is_none());
        c.validate().expect("defaults are valid");
    }

    #[test]
    fn every_config_error_is_invalid_input() {
        let invalid = ConfigError::Invalid { setting: "rpc_timeout", reason: "zero".into() };
        assert_eq!(invalid.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn validate_rejects_impossible_settings() {
        let bad = [
            MasterClientConfig { events_per_bundle: 0, ..Default::default() },
            MasterClientConfig { rpc_timeout: Duration::ZERO, ..Default::default() },
            MasterClientConfig { max_request_bytes: 48 << 20, ..Default::default() },
            MasterClientConfig { cluster_token: Some("bad\ntoken".into()), ..Default::default() },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }
}
