//! Master settings: their names (the settings file's `[master]` keys), defaults and validation.
//! The command line (`umbp master`) layers the file, the `UMBP_*` environment and its flags over
//! them through its one settings table; a value out of range is refused as it is read.

use std::net::SocketAddr;
use std::time::Duration;

use umbp_core::ErrorKind;

use crate::routing::{Affinity, EvictionConfig, SelectAlgo};

/// A setting that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Two settings contradict each other, or one is out of range.
    #[error("invalid master configuration: {0}")]
    Invalid(String),
}

impl ConfigError {
    /// What the caller does next: fix the setting (always [`ErrorKind::InvalidInput`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::InvalidInput,
        }
    }
}

/// Settings of the master. Every default is the reference's.
///
/// The one place their names (the settings file's `[master]` and `[master.eviction]` keys),
/// defaults and meaning are written; durations read `"10s"`, sizes `"64MiB"` or bytes, and the
/// cluster token is not a `[master]` key (it is the file's top-level `cluster_token`).
#[derive(Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MasterConfig {
    /// gRPC listen address. Default: `127.0.0.1:50051` (loopback unless told otherwise).
    pub listen: SocketAddr,
    /// Heartbeat TTL; a node's heartbeat interval is `heartbeat_ttl / heartbeat_interval_divisor`.
    /// Env `UMBP_HEARTBEAT_TTL_SEC`. Default: 10 s.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub heartbeat_ttl: Duration,
    /// Env `UMBP_HEARTBEAT_INTERVAL_DIVISOR`. Default: 2 (a 5 s interval).
    #[serde(deserialize_with = "at_least_one")]
    pub heartbeat_interval_divisor: u32,
    /// A node that missed this many TTLs expires. Env `UMBP_MAX_MISSED_HEARTBEATS`. Default: 3 (30 s).
    #[serde(deserialize_with = "at_least_one")]
    pub max_missed_heartbeats: u32,
    /// How often the registry reaper expires silent nodes. Env `UMBP_REAPER_INTERVAL_SEC`. Default: 5 s.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub reaper_interval: Duration,
    /// How long an EXPIRED node record stays listed (cluster status, `umbp stat`) before the reaper
    /// removes it, counted from its expiry (its last heartbeat plus
    /// [`expiry_after`](Self::expiry_after)). A node that comes back within it registers over its
    /// row; after it, like a new node. Without it every crashed node and every client process that
    /// died without unregistering would stay listed forever. Env `UMBP_EXPIRED_RETENTION_SEC`
    /// (0 = remove at expiry). Default: 300 s.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub expired_retention: Duration,
    /// Eviction and route-get lease settings (the routing crate's [`EvictionConfig`], embedded so
    /// the two cannot drift apart):
    /// - `high_watermark`: env `UMBP_EVICTION_HIGH_WATERMARK`, default 0.9;
    /// - `low_watermark`: env `UMBP_EVICTION_LOW_WATERMARK`, default 0.7;
    /// - `check_interval`: env `UMBP_EVICTION_CHECK_INTERVAL_SEC`, default 5 s;
    /// - `lease_duration` (the lease a route-get grants the keys it found; eviction skips them): env
    ///   `UMBP_LEASE_DURATION_SEC`, default 2 s;
    /// - `evict_deadline` (of one `EvictKey` call): env `UMBP_EVICTKEY_DEADLINE_MS`, default 1000 ms.
    #[serde(with = "EvictionSettings")]
    pub eviction: EvictionConfig,
    /// Put selection algorithm. Env `UMBP_ROUTE_PUT_SELECT_ALGO` (`most_available` | `random`; any
    /// other value is an error). Default: `most_available`.
    #[serde(with = "umbp_core::units::serde::from_str")]
    pub route_put_algo: SelectAlgo,
    /// Put affinity. Env `UMBP_ROUTE_PUT_NODE_AFFINITY` (`none` | `same` | `local`; any other value is
    /// an error). Default: `none`. `local` also grants nodes local placement (no route call for a
    /// put their own medium takes; see [`Affinity::Local`]).
    #[serde(with = "umbp_core::units::serde::from_str")]
    pub route_put_affinity: Affinity,
    /// Shards of the key index. Env `UMBP_MASTER_INDEX_SHARDS` (1..=4096). Default: 32.
    #[serde(deserialize_with = "index_shards")]
    pub index_shards: usize,
    /// How long a graceful shutdown waits for in-flight calls. Env
    /// `UMBP_GRPC_SHUTDOWN_DEADLINE_SEC`. Default: 3 s.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub shutdown_deadline: Duration,
    /// When set, every call must carry it as `x-umbp-token` metadata. Env `UMBP_CLUSTER_TOKEN`.
    /// Default: none.
    #[serde(skip)]
    pub cluster_token: Option<String>,
    /// Largest gRPC message accepted or sent, by the master's server and by its `EvictKey` client.
    /// Env `UMBP_MASTER_MAX_MESSAGE_BYTES` (>= 64 KiB). Default: 64 MiB.
    #[serde(serialize_with = "umbp_core::units::serde::size_usize::serialize")]
    #[serde(deserialize_with = "message_bytes")]
    pub max_message_bytes: usize,
    /// Where to serve Prometheus `/metrics` with the cluster gauges (port 0 picks a free one; see
    /// `MasterHandle::metrics_addr`). Env `UMBP_MASTER_METRICS_ADDR`. Default: none (no endpoint).
    #[serde(rename = "metrics_addr")]
    pub metrics_listen: Option<SocketAddr>,
    /// Where the metadata lives: none for this process's memory ([`InMemoryStore`](crate::store::InMemoryStore)),
    /// or `redis://HOST:PORT[/DB]` for a Redis that several masters can share
    /// ([`RedisStore`](crate::store::RedisStore)), or several such URLs comma-separated for the index
    /// sharded over them by key hash ([`ShardedStore`](crate::store::ShardedStore); the first holds
    /// the node records and leases; every master must list the same URLs in the same order). Env
    /// `UMBP_MASTER_METADATA`. Default: none.
    pub metadata: Option<String>,
}

/// The shards of the key index a master may have.
const INDEX_SHARDS: std::ops::RangeInclusive<usize> = 1..=4096;

/// A value the range checks below refuse, as a deserialization error naming the range.
fn out_of_range<E: serde::de::Error>(value: impl std::fmt::Display, expected: &str) -> E {
    E::custom(format!("{value} is out of range: expected {expected}"))
}

fn at_least_one<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let n = <u32 as serde::Deserialize>::deserialize(d)?;
    if n >= 1 { Ok(n) } else { Err(out_of_range(n, "an integer >= 1")) }
}

fn index_shards<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let n = <usize as serde::Deserialize>::deserialize(d)?;
    if INDEX_SHARDS.contains(&n) { Ok(n) } else { Err(out_of_range(n, "an integer in 1..=4096")) }
}

fn message_bytes<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    let n = umbp_core::units::serde::size_usize::deserialize(d)?;
    if n >= MIN_MESSAGE_BYTES { Ok(n) } else { Err(out_of_range(n, "at least 64KiB")) }
}

fn ratio<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let r = <f64 as serde::Deserialize>::deserialize(d)?;
    if r > 0.0 && r <= 1.0 { Ok(r) } else { Err(out_of_range(r, "a number in (0, 1]")) }
}

/// The `[master.eviction]` keys: [`EvictionConfig`]'s own fields, read through serde's remote
/// derive (the routing module stays free of serde; the compiler checks these fields against it).
#[derive(serde::Deserialize, serde::Serialize)]
#[serde(remote = "EvictionConfig", default, deny_unknown_fields)]
struct EvictionSettings {
    #[serde(deserialize_with = "ratio")]
    high_watermark: f64,
    #[serde(deserialize_with = "ratio")]
    low_watermark: f64,
    #[serde(with = "umbp_core::units::serde::duration")]
    check_interval: Duration,
    #[serde(with = "umbp_core::units::serde::duration")]
    lease_duration: Duration,
    #[serde(with = "umbp_core::units::serde::duration")]
    evict_deadline: Duration,
}

impl Default for EvictionSettings {
    // Each missing key keeps `EvictionConfig`'s default, written only there.
    fn default() -> Self {
        let EvictionConfig { high_watermark, low_watermark, check_interval, lease_duration, evict_deadline } =
            EvictionConfig::default();
        Self { high_watermark, low_watermark, check_interval, lease_duration, evict_deadline }
    }
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for MasterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterConfig")
            .field("listen", &self.listen)
            .field("heartbeat_ttl", &self.heartbeat_ttl)
            .field("heartbeat_interval_divisor", &self.heartbeat_interval_divisor)
            .field("max_missed_heartbeats", &self.max_missed_heartbeats)
            .field("reaper_interval", &self.reaper_interval)
            .field("expired_retention", &self.expired_retention)
            .field("eviction", &self.eviction)
            .field("route_put_algo", &self.route_put_algo)
            .field("route_put_affinity", &self.route_put_affinity)
            .field("index_shards", &self.index_shards)
            .field("shutdown_deadline", &self.shutdown_deadline)
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<redacted>"))
            .field("max_message_bytes", &self.max_message_bytes)
            .field("metrics_listen", &self.metrics_listen)
            .field("metadata", &self.metadata.as_deref().map(redact_url))
            .finish()
    }
}

impl Default for MasterConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            heartbeat_ttl: Duration::from_secs(10),
            heartbeat_interval_divisor: 2,
            max_missed_heartbeats: 3,
            reaper_interval: Duration::from_secs(5),
            expired_retention: DEFAULT_EXPIRED_RETENTION,
            eviction: EvictionConfig::default(),
            route_put_algo: SelectAlgo::MostAvailable,
            route_put_affinity: Affinity::None,
            index_shards: 32,
            shutdown_deadline: Duration::from_secs(3),
            cluster_token: None,
            max_message_bytes: 64 << 20,
            metrics_listen: None,
            metadata: None,
        }
    }
}

/// A metadata URL without its credentials (`redis://user:secret@host` → `redis://<redacted>@host`).
fn redact_url(urls: &str) -> String {
    let one = |url: &str| match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, host))) => format!("{scheme}://<redacted>@{host}"),
        _ => url.to_owned(),
    };
    urls.split(',').map(one).collect::<Vec<_>>().join(",")
}

/// The default of [`MasterConfig::expired_retention`]: long enough for an operator to see a node
/// that just died, short enough that a day of client processes does not pile up.
pub const DEFAULT_EXPIRED_RETENTION: Duration = Duration::from_secs(300);

/// The smallest `max_message_bytes` accepted: smaller would refuse ordinary heartbeats.
pub const MIN_MESSAGE_BYTES: usize = 64 << 10;

impl MasterConfig {
    /// The interval nodes are told to heartbeat at.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_ttl / self.heartbeat_interval_divisor.max(1)
    }

    /// A node silent for longer than this expires.
    pub fn expiry_after(&self) -> Duration {
        self.heartbeat_ttl * self.max_missed_heartbeats.max(1)
    }

    /// An EXPIRED record whose last heartbeat is older than this is removed:
    /// [`expiry_after`](Self::expiry_after) plus [`expired_retention`](Self::expired_retention).
    pub fn removal_after(&self) -> Duration {
        self.expiry_after().saturating_add(self.expired_retention)
    }

    /// Checks cross-field rules: watermarks ordered, no zero period, lease or deadline, a node expires
    /// only after more than one heartbeat interval, a usable message size.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.eviction.validate().map_err(|e| ConfigError::Invalid(e.to_string()))?;
        if !INDEX_SHARDS.contains(&self.index_shards) {
            return Err(ConfigError::Invalid(format!("index_shards {} is outside 1..=4096", self.index_shards)));
        }
        if let Some(urls) = &self.metadata
            && urls.split(',').map(str::trim).any(|url| !url.starts_with("redis://"))
        {
            return Err(ConfigError::Invalid(format!(
                "metadata {:?}: expected redis://HOST:PORT[/DB], or several comma-separated (shards)",
                redact_url(urls)
            )));
        }
        if self.heartbeat_ttl.is_zero() || self.reaper_interval.is_zero() || self.heartbeat_interval().is_zero() {
            return Err(ConfigError::Invalid(
                "heartbeat_ttl, the heartbeat interval (ttl / divisor) and reaper_interval must be > 0".into(),
            ));
        }
        if self.expiry_after() <= self.heartbeat_interval() {
            return Err(ConfigError::Invalid(format!(
                "nodes would expire ({:?}) before their next heartbeat is due ({:?}): raise max_missed_heartbeats or \
                 heartbeat_interval_divisor",
                self.expiry_after(),
                self.heartbeat_interval()
            )));
        }
        if self.max_message_bytes < MIN_MESSAGE_BYTES {
            return Err(ConfigError::Invalid(format!(
                "max_message_bytes {} is below the minimum {MIN_MESSAGE_BYTES}",
                self.max_message_bytes
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_reference_timings() {
        let c = MasterConfig::default();
        assert_eq!(c.heartbeat_interval(), Duration::from_secs(5));
        assert_eq!(c.expiry_after(), Duration::from_secs(30));
        assert_eq!(c.eviction.lease_duration, Duration::from_secs(2));
        assert_eq!(c.index_shards, 32);
        assert_eq!(c.expired_retention, Duration::from_secs(300));
        assert_eq!(c.removal_after(), Duration::from_secs(330));
        c.validate().expect("defaults are valid");
    }

    #[test]
    fn watermarks_must_be_ordered() {
        let mut c = MasterConfig::default();
        c.eviction.low_watermark = 0.95;
        assert!(c.validate().is_err());
    }

    #[test]
    fn zero_deadlines_leases_and_early_expiry_are_invalid() {
        let mut c = MasterConfig::default();
        c.eviction.evict_deadline = Duration::ZERO;
        assert!(c.validate().is_err(), "zero evict deadline");
        let mut c = MasterConfig::default();
        c.eviction.lease_duration = Duration::ZERO;
        assert!(c.validate().is_err(), "zero lease");
        // ttl 10 s, divisor 1, 1 missed: expiry (10 s) == interval (10 s).
        let c = MasterConfig { heartbeat_interval_divisor: 1, max_missed_heartbeats: 1, ..MasterConfig::default() };
        assert!(c.validate().is_err(), "expiry must exceed the heartbeat interval");
        let c = MasterConfig { heartbeat_interval_divisor: 2, max_missed_heartbeats: 1, ..MasterConfig::default() };
        c.validate().expect("expiry 10 s > interval 5 s");
        let c = MasterConfig { max_message_bytes: 10, ..MasterConfig::default() };
        assert!(c.validate().is_err(), "tiny message limit");
        for (url, ok) in [
            ("redis://127.0.0.1:6379/2", true),
            ("http://h:1", false),
            ("redis://a:1, redis://b:1", true),
            ("redis://a:1,http://b:1", false),
        ] {
            let c = MasterConfig { metadata: Some(url.into()), ..MasterConfig::default() };
            assert_eq!(c.validate().is_ok(), ok, "{url}");
        }
    }

    #[test]
    fn a_metadata_url_never_shows_its_password() {
        let c = MasterConfig { metadata: Some("redis://u:hunter2@db:6379/0".into()), ..MasterConfig::default() };
        let shown = format!("{c:?}");
        assert!(!shown.contains("hunter2") && shown.contains("<redacted>@db:6379/0"), "{shown}");
        let err = MasterConfig { metadata: Some("rediss://u:hunter2@db".into()), ..MasterConfig::default() }
            .validate()
            .expect_err("only redis://");
        assert!(!err.to_string().contains("hunter2"), "{err}");
    }

    #[test]
    fn the_file_keys_are_the_fields_with_human_units_and_missing_keys_keep_the_defaults() {
        let c: MasterConfig = serde_json::from_str(
            r#"{"heartbeat_ttl":"20s","route_put_algo":"random","max_message_bytes":"8MiB",
                "metrics_addr":"127.0.0.1:9","eviction":{"lease_duration":"3s","high_watermark":0.95}}"#,
        )
        .expect("valid");
        let d = MasterConfig::default();
        assert_eq!(
            (c.heartbeat_ttl, c.route_put_algo, c.max_message_bytes),
            (Duration::from_secs(20), SelectAlgo::Random, 8 << 20)
        );
        assert_eq!(c.metrics_listen, Some(SocketAddr::from(([127, 0, 0, 1], 9))));
        assert_eq!((c.eviction.lease_duration, c.eviction.high_watermark), (Duration::from_secs(3), 0.95));
        assert_eq!(
            (c.eviction.low_watermark, c.eviction.check_interval),
            (d.eviction.low_watermark, d.eviction.check_interval)
        );
        assert_eq!((c.listen, c.index_shards), (d.listen, d.index_shards));
        let none: MasterConfig = serde_json::from_str("{}").expect("empty");
        assert_eq!(none, d);
        for bad in [
            r#"{"heartbeat":"1s"}"#,
            r#"{"cluster_token":"t"}"#,
            r#"{"eviction":{"lease":"1s"}}"#,
            r#"{"heartbeat_ttl":10}"#,
        ] {
            assert!(serde_json::from_str::<MasterConfig>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_config_error_is_invalid_input() {
        assert_eq!(ConfigError::Invalid("x".into()).kind(), ErrorKind::InvalidInput);
        let invalid = MasterConfig { max_message_bytes: 10, ..MasterConfig::default() }.validate().expect_err("tiny");
        assert_eq!(invalid.kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn debug_output_never_shows_the_cluster_token() {
        let c = MasterConfig { cluster_token: Some("s3cret-token".into()), ..MasterConfig::default() };
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret-token"), "{shown}");
        assert!(shown.contains("<redacted>"));
    }
}
