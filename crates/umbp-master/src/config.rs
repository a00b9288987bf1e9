//! Master settings: defaults, then `UMBP_*` environment variables (the reference's names where one
//! exists), then whatever the caller (the `umbp master` command line) sets on top.

use std::net::SocketAddr;
use std::time::Duration;

/// A setting that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// An environment variable holds something that is not a valid value.
    #[error("{var}={value:?}: {reason}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What a valid value looks like.
        reason: String,
    },
    /// Two settings contradict each other, or one is out of range.
    #[error("invalid master configuration: {0}")]
    Invalid(String),
}

/// Settings of the master. Every default is the reference's.
#[derive(Debug, Clone, PartialEq)]
pub struct MasterConfig {
    /// gRPC listen address. Default: `127.0.0.1:50051` (loopback unless told otherwise).
    pub listen: SocketAddr,
    /// Heartbeat TTL; a node's heartbeat interval is `heartbeat_ttl / heartbeat_interval_divisor`.
    /// Env `UMBP_HEARTBEAT_TTL_SEC`. Default: 10 s.
    pub heartbeat_ttl: Duration,
    /// Env `UMBP_HEARTBEAT_INTERVAL_DIVISOR`. Default: 2 (a 5 s interval).
    pub heartbeat_interval_divisor: u32,
    /// A node that missed this many TTLs expires. Env `UMBP_MAX_MISSED_HEARTBEATS`. Default: 3 (30 s).
    pub max_missed_heartbeats: u32,
    /// How often the registry reaper expires silent nodes. Env `UMBP_REAPER_INTERVAL_SEC`. Default: 5 s.
    pub reaper_interval: Duration,
    /// How often eviction checks the watermarks. Env `UMBP_EVICTION_CHECK_INTERVAL_SEC`. Default: 5 s.
    pub eviction_check_interval: Duration,
    /// A node tier is evicted when used/total reaches this. Env `UMBP_EVICTION_HIGH_WATERMARK`.
    /// Default: 0.9.
    pub eviction_high_watermark: f64,
    /// … down to this. Env `UMBP_EVICTION_LOW_WATERMARK`. Default: 0.7.
    pub eviction_low_watermark: f64,
    /// Lease a route-get grants the keys it found (eviction skips them). Env
    /// `UMBP_LEASE_DURATION_SEC`. Default: 2 s.
    pub route_get_lease: Duration,
    /// Deadline of an `EvictKey` call to a peer. Env `UMBP_EVICTKEY_DEADLINE_MS`. Default: 1000 ms.
    pub evict_deadline: Duration,
    /// Put selection algorithm: `most_available` or `random`. Env `UMBP_ROUTE_PUT_SELECT_ALGO`.
    /// Default: `most_available`.
    pub route_put_algo: String,
    /// Put affinity: `none`, `same` or `local`. Env `UMBP_ROUTE_PUT_NODE_AFFINITY`. Default: `none`.
    pub route_put_affinity: String,
    /// Shards of the key index. Env `UMBP_MASTER_INDEX_SHARDS` (1..=4096). Default: 32.
    pub index_shards: usize,
    /// How long a graceful shutdown waits for in-flight calls. Env
    /// `UMBP_GRPC_SHUTDOWN_DEADLINE_SEC`. Default: 3 s.
    pub shutdown_deadline: Duration,
    /// When set, every call must carry it as `x-umbp-token` metadata. Env `UMBP_CLUSTER_TOKEN`.
    /// Default: none.
    pub cluster_token: Option<String>,
    /// Largest gRPC message accepted or sent. Default: 64 MiB.
    pub max_message_bytes: usize,
}

impl Default for MasterConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            heartbeat_ttl: Duration::from_secs(10),
            heartbeat_interval_divisor: 2,
            max_missed_heartbeats: 3,
            reaper_interval: Duration::from_secs(5),
            eviction_check_interval: Duration::from_secs(5),
            eviction_high_watermark: 0.9,
            eviction_low_watermark: 0.7,
            route_get_lease: Duration::from_secs(2),
            evict_deadline: Duration::from_millis(1000),
            route_put_algo: "most_available".into(),
            route_put_affinity: "none".into(),
            index_shards: 32,
            shutdown_deadline: Duration::from_secs(3),
            cluster_token: None,
            max_message_bytes: 64 << 20,
        }
    }
}

/// Reads `var` through `get` and parses it; absent means `None`.
fn parse<T: std::str::FromStr>(
    get: &dyn Fn(&str) -> Option<String>,
    var: &'static str,
    what: &str,
    valid: impl Fn(&T) -> bool,
) -> Result<Option<T>, ConfigError> {
    let Some(value) = get(var) else { return Ok(None) };
    match value.trim().parse::<T>() {
        Ok(v) if valid(&v) => Ok(Some(v)),
        _ => Err(ConfigError::BadEnv { var, value, reason: format!("expected {what}") }),
    }
}

impl MasterConfig {
    /// Defaults overridden by the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::default().with_env(&|var| std::env::var(var).ok())
    }

    /// `self` overridden by the variables `get` returns (tests pass a map instead of the process
    /// environment). A malformed value is an error naming the variable, never a silent default.
    pub fn with_env(mut self, get: &dyn Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let secs =
            |v: &'static str, min: u64| parse::<u64>(get, v, &format!("whole seconds >= {min}"), move |s| *s >= min);
        if let Some(s) = secs("UMBP_HEARTBEAT_TTL_SEC", 1)? {
            self.heartbeat_ttl = Duration::from_secs(s);
        }
        if let Some(d) = parse::<u32>(get, "UMBP_HEARTBEAT_INTERVAL_DIVISOR", "an integer >= 1", |d| *d >= 1)? {
            self.heartbeat_interval_divisor = d;
        }
        if let Some(m) = parse::<u32>(get, "UMBP_MAX_MISSED_HEARTBEATS", "an integer >= 1", |m| *m >= 1)? {
            self.max_missed_heartbeats = m;
        }
        if let Some(s) = secs("UMBP_REAPER_INTERVAL_SEC", 1)? {
            self.reaper_interval = Duration::from_secs(s);
        }
        if let Some(s) = secs("UMBP_EVICTION_CHECK_INTERVAL_SEC", 1)? {
            self.eviction_check_interval = Duration::from_secs(s);
        }
        let ratio = "a number in (0, 1]";
        if let Some(h) = parse::<f64>(get, "UMBP_EVICTION_HIGH_WATERMARK", ratio, |h| *h > 0.0 && *h <= 1.0)? {
            self.eviction_high_watermark = h;
        }
        if let Some(l) = parse::<f64>(get, "UMBP_EVICTION_LOW_WATERMARK", ratio, |l| *l > 0.0 && *l <= 1.0)? {
            self.eviction_low_watermark = l;
        }
        if let Some(s) = secs("UMBP_LEASE_DURATION_SEC", 1)? {
            self.route_get_lease = Duration::from_secs(s);
        }
        if let Some(ms) = parse::<u64>(get, "UMBP_EVICTKEY_DEADLINE_MS", "milliseconds >= 1", |m| *m >= 1)? {
            self.evict_deadline = Duration::from_millis(ms);
        }
        if let Some(a) = get("UMBP_ROUTE_PUT_SELECT_ALGO") {
            self.route_put_algo = a.trim().to_owned();
        }
        if let Some(a) = get("UMBP_ROUTE_PUT_NODE_AFFINITY") {
            self.route_put_affinity = a.trim().to_owned();
        }
        if let Some(n) =
            parse::<usize>(get, "UMBP_MASTER_INDEX_SHARDS", "an integer in 1..=4096", |n| (1..=4096).contains(n))?
        {
            self.index_shards = n;
        }
        if let Some(s) = secs("UMBP_GRPC_SHUTDOWN_DEADLINE_SEC", 0)? {
            self.shutdown_deadline = Duration::from_secs(s);
        }
        if let Some(t) = get("UMBP_CLUSTER_TOKEN").filter(|t| !t.is_empty()) {
            self.cluster_token = Some(t);
        }
        Ok(self)
    }

    /// The interval nodes are told to heartbeat at.
    pub fn heartbeat_interval(&self) -> Duration {
        self.heartbeat_ttl / self.heartbeat_interval_divisor.max(1)
    }

    /// A node silent for longer than this expires.
    pub fn expiry_after(&self) -> Duration {
        self.heartbeat_ttl * self.max_missed_heartbeats.max(1)
    }

    /// Checks cross-field rules (watermarks ordered, routing names known).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (high, low) = (self.eviction_high_watermark, self.eviction_low_watermark);
        if !(0.0 < low && low < high && high <= 1.0) {
            return Err(ConfigError::Invalid(format!(
                "eviction watermarks must satisfy 0 < low < high <= 1 (low {low}, high {high})"
            )));
        }
        if !(1..=4096).contains(&self.index_shards) {
            return Err(ConfigError::Invalid(format!("index_shards {} is outside 1..=4096", self.index_shards)));
        }
        if self.heartbeat_ttl.is_zero() || self.reaper_interval.is_zero() || self.eviction_check_interval.is_zero() {
            return Err(ConfigError::Invalid(
                "heartbeat_ttl, reaper_interval and eviction_check_interval must be > 0".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn defaults_are_the_reference_timings() {
        let c = MasterConfig::default();
        assert_eq!(c.heartbeat_interval(), Duration::from_secs(5));
        assert_eq!(c.expiry_after(), Duration::from_secs(30));
        assert_eq!(c.route_get_lease, Duration::from_secs(2));
        assert_eq!(c.index_shards, 32);
        c.validate().expect("defaults are valid");
    }

    #[test]
    fn env_overrides_defaults() {
        let c = MasterConfig::default()
            .with_env(&env(&[
                ("UMBP_HEARTBEAT_TTL_SEC", "4"),
                ("UMBP_HEARTBEAT_INTERVAL_DIVISOR", "4"),
                ("UMBP_MASTER_INDEX_SHARDS", "8"),
                ("UMBP_ROUTE_PUT_SELECT_ALGO", "random"),
                ("UMBP_EVICTKEY_DEADLINE_MS", "250"),
                ("UMBP_CLUSTER_TOKEN", "s3cret"),
            ]))
            .expect("valid env");
        assert_eq!(c.heartbeat_interval(), Duration::from_secs(1));
        assert_eq!(c.index_shards, 8);
        assert_eq!(c.route_put_algo, "random");
        assert_eq!(c.evict_deadline, Duration::from_millis(250));
        assert_eq!(c.cluster_token.as_deref(), Some("s3cret"));
    }

    #[test]
    fn garbage_in_the_environment_is_an_error_naming_the_variable() {
        for (var, value) in [
            ("UMBP_HEARTBEAT_TTL_SEC", "ten"),
            ("UMBP_HEARTBEAT_TTL_SEC", "-1"),
            ("UMBP_HEARTBEAT_TTL_SEC", "0"),
            ("UMBP_MASTER_INDEX_SHARDS", "5000"),
            ("UMBP_EVICTION_HIGH_WATERMARK", "1.5"),
        ] {
            let err = MasterConfig::default().with_env(&env(&[(var, value)])).expect_err(value);
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn watermarks_must_be_ordered() {
        let c = MasterConfig { eviction_low_watermark: 0.95, ..MasterConfig::default() };
        assert!(c.validate().is_err());
    }
}
