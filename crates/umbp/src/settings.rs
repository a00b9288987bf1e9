//! Settings of each command, merged from four layers in increasing precedence: the built-in
//! defaults, the TOML file, the `UMBP_*` environment, the command-line flags.
//!
//! The environment is read through a getter (`&dyn Fn(&str) -> Option<String>`), so tests pass a map
//! instead of mutating the process environment. A malformed value in any layer is an error naming
//! where it came from (the file's key or the variable), never a silent default.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use umbp_master::MasterConfig;
use umbp_master::routing::RoutingConfigError;
use umbp_peer::master_client::MasterClientConfig;
use umbp_peer::pool_client::{DramConfig, HbmConfig, Medium, PoolClientConfig, RecachePolicy, RuntimeSelection};
use umbp_peer::pool_client::{IoEngineKind, SsdConfig};

use crate::cli::{GetArgs, MasterAddress, MasterArgs, MediumKind, NodeArgs};
use crate::units::{UnitError, format_size, parse_duration, parse_size};

/// Reads one environment variable; `None` when it is not set.
pub type EnvGetter<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The master address every command uses when none is given.
pub const DEFAULT_MASTER_ADDRESS: &str = "127.0.0.1:50051";

/// The largest value `umbp get` accepts when none is given: 64 MiB.
pub const DEFAULT_MAX_GET_SIZE: u64 = 64 << 20;

/// A setting that could not be read or can never work.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SettingsError {
    /// The configuration file could not be read.
    #[error("reading the configuration file {}: {source}", path.display())]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The configuration file is not valid TOML of the expected shape (an unknown key included).
    #[error("configuration file {}: {message}", path.display())]
    BadFile {
        /// The file.
        path: PathBuf,
        /// The parser's message, with the line and the key.
        message: String,
    },
    /// An environment variable holds something that is not a valid value.
    #[error("{var}={value:?}: {reason}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// What it held.
        value: String,
        /// What a valid value looks like.
        reason: String,
    },
    /// A required setting is set nowhere.
    #[error("{what} is required: {how}")]
    Missing {
        /// The setting.
        what: &'static str,
        /// Where it can be set.
        how: &'static str,
    },
    /// A setting is out of range.
    #[error("invalid setting {setting}: {reason}")]
    Invalid {
        /// The setting.
        setting: &'static str,
        /// Why.
        reason: String,
    },
    /// The master's settings are invalid.
    #[error(transparent)]
    Master(#[from] umbp_master::ConfigError),
    /// The master client's settings are invalid.
    #[error(transparent)]
    MasterClient(#[from] umbp_peer::master_client::ConfigError),
}

/// A byte size in the file: an integer (bytes) or a string (`"64MiB"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a size: bytes (4096) or a string with a unit (\"64MiB\")")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v).map(ByteSize).map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                parse_size(v).map(ByteSize).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// A duration in the file: a string with a unit (`"500ms"`, `"5s"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a duration with a unit (\"500ms\", \"5s\")")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HumanDuration, E> {
                Err(E::custom(format!("a duration needs a unit: write \"{v}s\" or \"{v}ms\"")))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<HumanDuration, E> {
                Err(E::custom(format!("a duration needs a unit: write \"{v}s\" or \"{v}ms\"")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                parse_duration(v).map(HumanDuration).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// The re-cache policy in the file: `"off"`, `"always"` or a size cap (`"16MiB"` or bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recache(pub RecachePolicy);

impl<'de> Deserialize<'de> for Recache {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Recache;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"off\", \"always\" or a size cap (\"16MiB\")")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Recache, E> {
                Ok(Recache(RecachePolicy::UpTo(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Recache, E> {
                u64::try_from(v)
                    .map(|v| Recache(RecachePolicy::UpTo(v)))
                    .map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Recache, E> {
                parse_recache(v).map(Recache).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// Reads a re-cache policy: `off` (or `false`, `0`), `always` (or `true`), or a size cap.
pub fn parse_recache(text: &str) -> Result<RecachePolicy, UnitError> {
    match text.trim().to_ascii_lowercase().as_str() {
        "off" | "false" | "0" => Ok(RecachePolicy::Off),
        "always" | "true" | "on" => Ok(RecachePolicy::Always),
        _ => parse_size(text).map(RecachePolicy::UpTo),
    }
}

/// Reads an SSD sync interval: a duration greater than zero, or `off` (sync only at shutdown).
fn parse_sync_interval(text: &str) -> Result<Option<Duration>, String> {
    match text.trim() {
        "off" | "false" | "none" => Ok(None),
        t => match parse_duration(t) {
            Ok(d) if !d.is_zero() => Ok(Some(d)),
            Ok(_) => Err("must be greater than zero (\"off\" syncs only at shutdown)".into()),
            Err(e) => Err(e.to_string()),
        },
    }
}

/// Writes a re-cache policy the way [`parse_recache`] reads it.
pub fn format_recache(policy: RecachePolicy) -> String {
    match policy {
        RecachePolicy::Off => "off".into(),
        RecachePolicy::Always => "always".into(),
        RecachePolicy::UpTo(cap) => format_size(cap),
    }
}

/// The whole configuration file. Every key is optional; unknown keys are errors.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    /// Where nodes and client commands find the master.
    pub master_address: Option<String>,
    /// The cluster token.
    pub cluster_token: Option<String>,
    /// `[master]`.
    pub master: MasterFile,
    /// `[node]`.
    pub node: NodeFile,
    /// `[client]`.
    pub client: ClientFile,
}

/// The `[master]` table: [`MasterConfig`]'s fields.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MasterFile {
    /// gRPC listen address.
    pub listen: Option<SocketAddr>,
    /// Heartbeat TTL.
    pub heartbeat_ttl: Option<HumanDuration>,
    /// The heartbeat interval is the TTL divided by this.
    pub heartbeat_interval_divisor: Option<u32>,
    /// TTLs of silence before a node expires.
    pub max_missed_heartbeats: Option<u32>,
    /// How often silent nodes are expired.
    pub reaper_interval: Option<HumanDuration>,
    /// How long an expired node stays listed before its record is removed.
    pub expired_retention: Option<HumanDuration>,
    /// How often eviction checks the watermarks.
    pub eviction_check_interval: Option<HumanDuration>,
    /// Eviction starts at this fill ratio.
    pub eviction_high_watermark: Option<f64>,
    /// … and stops at this one.
    pub eviction_low_watermark: Option<f64>,
    /// Lease of a route-get.
    pub route_get_lease: Option<HumanDuration>,
    /// Deadline of an `EvictKey` call.
    pub evict_deadline: Option<HumanDuration>,
    /// `most_available` or `random`.
    pub route_put_algo: Option<String>,
    /// `none`, `same` or `local`.
    pub route_put_affinity: Option<String>,
    /// Shards of the key index.
    pub index_shards: Option<usize>,
    /// How long shutdown waits for in-flight calls.
    pub shutdown_deadline: Option<HumanDuration>,
    /// Largest gRPC message.
    pub max_message_bytes: Option<ByteSize>,
    /// Where Prometheus `/metrics` is served.
    pub metrics_addr: Option<SocketAddr>,
}

/// The `[node]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeFile {
    /// The node's id.
    pub node_id: Option<String>,
    /// The medium it lends.
    pub medium: Option<MediumKind>,
    /// Bytes it lends.
    pub capacity: Option<ByteSize>,
    /// Page size.
    pub page_size: Option<ByteSize>,
    /// Host of the peer service and data server.
    pub listen: Option<IpAddr>,
    /// Peer-service port.
    pub peer_port: Option<u16>,
    /// Data-server port.
    pub data_port: Option<u16>,
    /// Touch the medium's pages at start-up.
    pub prefault: Option<bool>,
    /// Use huge pages.
    pub hugepages: Option<bool>,
    /// NUMA node to bind the medium to.
    pub numa_node: Option<u32>,
    /// The GPU an hbm node lends.
    pub hbm_device: Option<u32>,
    /// Device memory an hbm node lends.
    pub hbm_capacity: Option<ByteSize>,
    /// The GPU runtime of an hbm node.
    pub hbm_runtime: Option<String>,
    /// An ssd node's directories, one per drive.
    pub ssd_dirs: Option<Vec<PathBuf>>,
    /// Drive bytes an ssd node lends.
    pub ssd_capacity: Option<ByteSize>,
    /// The io engine of an ssd node (`psync`, `io_uring`).
    pub ssd_io_engine: Option<String>,
    /// Host staging pages of an ssd node.
    pub ssd_staging_pages: Option<u64>,
    /// The largest value of an ssd node, in pages.
    pub ssd_max_value_pages: Option<u64>,
    /// The SSD read lease.
    pub ssd_read_lease: Option<HumanDuration>,
    /// Create an ssd directory that does not exist (default: refuse).
    pub ssd_create_dirs: Option<bool>,
    /// How often an ssd node syncs its log: a duration, or `off` (only at shutdown).
    pub ssd_sync_interval: Option<String>,
    /// Re-cache policy for remote fetches.
    pub recache: Option<Recache>,
    /// Read lease of a resolve.
    pub read_lease: Option<HumanDuration>,
    /// TTL of an uncommitted slot.
    pub pending_ttl: Option<HumanDuration>,
    /// Deadline of each peer RPC.
    pub rpc_timeout: Option<HumanDuration>,
    /// Re-routes per key.
    pub max_reroutes: Option<u32>,
    /// Bounce pool size.
    pub bounce: Option<ByteSize>,
    /// Where Prometheus `/metrics` is served.
    pub metrics_addr: Option<SocketAddr>,
}

/// The `[client]` table.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientFile {
    /// Largest value `umbp get` accepts.
    pub max_get_size: Option<ByteSize>,
}

impl FileConfig {
    /// Parses the text of a configuration file; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, SettingsError> {
        toml::from_str(text)
            .map_err(|e| SettingsError::BadFile { path: origin.to_owned(), message: e.to_string().trim().to_owned() })
    }

    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, SettingsError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| SettingsError::ReadFile { path: path.to_owned(), source })?;
        Self::parse(&text, path)
    }

    /// The file named by `flag`, else by `UMBP_CONFIG`; no file gives every key unset.
    pub fn discover(flag: Option<&Path>, env: EnvGetter<'_>) -> Result<Self, SettingsError> {
        match flag.map(Path::to_owned).or_else(|| env("UMBP_CONFIG").filter(|p| !p.is_empty()).map(PathBuf::from)) {
            Some(path) => Self::load(&path),
            None => Ok(Self::default()),
        }
    }
}

/// Reads `var` and parses it with `parse`; `None` when unset.
fn env_value<T, E: std::fmt::Display>(
    env: EnvGetter<'_>,
    var: &'static str,
    parse: impl Fn(&str) -> Result<T, E>,
) -> Result<Option<T>, SettingsError> {
    let Some(value) = env(var) else { return Ok(None) };
    parse(value.trim()).map(Some).map_err(|e| SettingsError::BadEnv { var, value, reason: e.to_string() })
}

fn env_parsed<T: std::str::FromStr>(
    env: EnvGetter<'_>,
    var: &'static str,
    expected: &'static str,
) -> Result<Option<T>, SettingsError> {
    env_value(env, var, |s| s.parse::<T>().map_err(|_| format!("expected {expected}")))
}

fn env_bool(env: EnvGetter<'_>, var: &'static str) -> Result<Option<bool>, SettingsError> {
    env_value(env, var, |s| match s.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err("expected true or false"),
    })
}

/// The cluster token: flag, else `UMBP_CLUSTER_TOKEN`, else the file; an empty value means none.
fn resolve_token(file: &FileConfig, env: EnvGetter<'_>, flag: Option<&str>) -> Option<String> {
    flag.map(str::to_owned)
        .or_else(|| env("UMBP_CLUSTER_TOKEN"))
        .or_else(|| file.cluster_token.clone())
        .filter(|t| !t.is_empty())
}

/// The master address: flag, else `UMBP_MASTER_ADDRESS`, else the file, else `127.0.0.1:50051`.
pub fn resolve_master_address(file: &FileConfig, env: EnvGetter<'_>, flag: &MasterAddress) -> String {
    flag.master
        .clone()
        .or_else(|| env("UMBP_MASTER_ADDRESS").filter(|a| !a.is_empty()))
        .or_else(|| file.master_address.clone())
        .unwrap_or_else(|| DEFAULT_MASTER_ADDRESS.to_owned())
}

/// The settings of `umbp master`.
pub fn resolve_master(
    file: &FileConfig,
    env: EnvGetter<'_>,
    flags: &MasterArgs,
    token: Option<&str>,
) -> Result<MasterConfig, SettingsError> {
    let mut c = MasterConfig::default();
    // The file.
    let f = &file.master;
    let dur = |d: Option<HumanDuration>, into: &mut Duration| {
        if let Some(HumanDuration(d)) = d {
            *into = d;
        }
    };
    if let Some(listen) = f.listen {
        c.listen = listen;
    }
    dur(f.heartbeat_ttl, &mut c.heartbeat_ttl);
    if let Some(d) = f.heartbeat_interval_divisor {
        c.heartbeat_interval_divisor = d;
    }
    if let Some(m) = f.max_missed_heartbeats {
        c.max_missed_heartbeats = m;
    }
    dur(f.reaper_interval, &mut c.reaper_interval);
    dur(f.expired_retention, &mut c.expired_retention);
    dur(f.eviction_check_interval, &mut c.eviction.check_interval);
    if let Some(h) = f.eviction_high_watermark {
        c.eviction.high_watermark = h;
    }
    if let Some(l) = f.eviction_low_watermark {
        c.eviction.low_watermark = l;
    }
    dur(f.route_get_lease, &mut c.eviction.lease_duration);
    dur(f.evict_deadline, &mut c.eviction.evict_deadline);
    if let Some(a) = &f.route_put_algo {
        c.route_put_algo = a.parse().map_err(|e: RoutingConfigError| SettingsError::Invalid {
            setting: "master.route_put_algo",
            reason: e.to_string(),
        })?;
    }
    if let Some(a) = &f.route_put_affinity {
        c.route_put_affinity = a.parse().map_err(|e: RoutingConfigError| SettingsError::Invalid {
            setting: "master.route_put_affinity",
            reason: e.to_string(),
        })?;
    }
    if let Some(n) = f.index_shards {
        c.index_shards = n;
    }
    dur(f.shutdown_deadline, &mut c.shutdown_deadline);
    if let Some(ByteSize(b)) = f.max_message_bytes {
        c.max_message_bytes = usize::try_from(b).map_err(|_| SettingsError::Invalid {
            setting: "master.max_message_bytes",
            reason: format!("{b} is too large"),
        })?;
    }
    c.cluster_token = file.cluster_token.clone().filter(|t| !t.is_empty());
    if let Some(a) = f.metrics_addr {
        c.metrics_listen = Some(a);
    }
    // The environment: the master's own variables, then the listen address.
    let mut c = c.with_env(env)?;
    if let Some(listen) = env_parsed::<SocketAddr>(env, "UMBP_MASTER_LISTEN", "HOST:PORT (an IP address)")? {
        c.listen = listen;
    }
    // The flags.
    if let Some(listen) = flags.listen {
        c.listen = listen;
    }
    if let Some(ttl) = flags.heartbeat_ttl {
        c.heartbeat_ttl = ttl;
    }
    if let Some(m) = flags.max_missed_heartbeats {
        c.max_missed_heartbeats = m;
    }
    if let Some(r) = flags.reaper_interval {
        c.reaper_interval = r;
    }
    if let Some(r) = flags.expired_retention {
        c.expired_retention = r;
    }
    if let Some(a) = flags.route_put_algo {
        c.route_put_algo = a;
    }
    if let Some(a) = flags.route_put_affinity {
        c.route_put_affinity = a;
    }
    if let Some(d) = flags.heartbeat_interval_divisor {
        c.heartbeat_interval_divisor = d;
    }
    if let Some(d) = flags.eviction_check_interval {
        c.eviction.check_interval = d;
    }
    if let Some(h) = flags.eviction_high_watermark {
        c.eviction.high_watermark = h;
    }
    if let Some(l) = flags.eviction_low_watermark {
        c.eviction.low_watermark = l;
    }
    if let Some(d) = flags.lease_duration {
        c.eviction.lease_duration = d;
    }
    if let Some(d) = flags.evict_deadline {
        c.eviction.evict_deadline = d;
    }
    if let Some(n) = flags.index_shards {
        c.index_shards = n;
    }
    if let Some(d) = flags.shutdown_deadline {
        c.shutdown_deadline = d;
    }
    if let Some(b) = flags.max_message_bytes {
        c.max_message_bytes = usize::try_from(b).map_err(|_| SettingsError::Invalid {
            setting: "--max-message-bytes",
            reason: format!("{b} is too large"),
        })?;
    }
    if let Some(a) = flags.metrics_addr {
        c.metrics_listen = Some(a);
    }
    if let Some(t) = token {
        c.cluster_token = Some(t.to_owned()).filter(|t| !t.is_empty());
    }
    c.validate()?;
    Ok(c)
}

/// The settings of `umbp node`: a whole [`PoolClientConfig`].
pub fn resolve_node(
    file: &FileConfig,
    env: EnvGetter<'_>,
    flags: &NodeArgs,
    token: Option<&str>,
) -> Result<PoolClientConfig, SettingsError> {
    let f = &file.node;
    let master_address = resolve_master_address(file, env, &flags.master);
    let node_id = flags
        .node_id
        .clone()
        .or_else(|| env("UMBP_NODE_ID").filter(|s| !s.is_empty()))
        .or_else(|| f.node_id.clone())
        .ok_or(SettingsError::Missing {
            what: "the node id",
            how: "pass --node-id ID, set UMBP_NODE_ID, or set node.node_id in the configuration file",
        })?;
    if node_id.trim().is_empty() || node_id.chars().any(char::is_whitespace) {
        return Err(SettingsError::Invalid {
            setting: "node_id",
            reason: format!("{node_id:?} is empty or has spaces"),
        });
    }
    let mut c = PoolClientConfig::new(node_id, master_address);
    let mut dram = DramConfig::default();

    // Each setting: flag, else environment, else file, else the default already in `c`.
    let medium = match flags.medium {
        Some(m) => Some(m),
        None => env_value(env, "UMBP_MEDIUM", MediumKind::from_name)?.or(f.medium),
    }
    .unwrap_or(MediumKind::Dram);
    if flags.capacity.is_some() && medium != MediumKind::Dram {
        // Silently ignoring it would lend a different size than the operator asked for.
        let instead = match medium {
            MediumKind::Ssd => {
                "an ssd node lends --ssd-capacity of drive (its host staging arena is \
                                --ssd-staging-pages pages of --page-size)"
            }
            MediumKind::Hbm => "an hbm node lends --hbm-capacity of device memory",
            _ => "a node with medium none lends nothing",
        };
        return Err(SettingsError::Invalid {
            setting: "--capacity",
            reason: format!("it sizes a dram node's memory; {instead}"),
        });
    }
    if let Some(b) = pick(flags.capacity, env_value(env, "UMBP_CAPACITY", parse_size)?, f.capacity.map(|b| b.0)) {
        dram.capacity_bytes = b;
    }
    if let Some(b) = pick(flags.page_size, env_value(env, "UMBP_PAGE_SIZE", parse_size)?, f.page_size.map(|b| b.0)) {
        c.page_size = b;
    }
    let host = pick(flags.listen, env_parsed::<IpAddr>(env, "UMBP_NODE_ADDRESS", "an IP address")?, f.listen)
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let peer_port =
        pick(flags.peer_port, env_parsed::<u16>(env, "UMBP_PEER_SERVICE_PORT", "a port number")?, f.peer_port)
            .unwrap_or(0);
    let data_port = pick(flags.data_port, env_parsed::<u16>(env, "UMBP_IO_ENGINE_PORT", "a port number")?, f.data_port)
        .unwrap_or(0);
    c.node_address = host.to_string();
    c.peer_listen = SocketAddr::new(host, peer_port);
    c.data_listen = SocketAddr::new(host, data_port);
    if let Some(p) = pick(flags.prefault, env_bool(env, "UMBP_DRAM_PREFAULT")?, f.prefault) {
        dram.prefault = p;
    }
    if let Some(h) = pick(None, env_bool(env, "UMBP_DRAM_HUGEPAGES")?, f.hugepages) {
        dram.use_hugepages = h;
    }
    dram.numa_node = f.numa_node;
    let mut hbm = HbmConfig::default();
    if let Some(d) =
        pick(flags.hbm_device, env_parsed::<u32>(env, "UMBP_HBM_DEVICE", "a device ordinal")?, f.hbm_device)
    {
        hbm.device = d;
    }
    if let Some(b) =
        pick(flags.hbm_capacity, env_value(env, "UMBP_HBM_CAPACITY", parse_size)?, f.hbm_capacity.map(|b| b.0))
    {
        hbm.capacity_bytes = b;
    }
    let runtime_flag = flags
        .hbm_runtime
        .as_deref()
        .map(str::parse::<RuntimeSelection>)
        .transpose()
        .map_err(|reason| SettingsError::Invalid { setting: "--hbm-runtime", reason })?;
    let runtime_file = f
        .hbm_runtime
        .as_deref()
        .map(str::parse::<RuntimeSelection>)
        .transpose()
        .map_err(|reason| SettingsError::Invalid { setting: "node.hbm_runtime", reason })?;
    let runtime_env = env_value(env, "UMBP_HBM_RUNTIME", str::parse::<RuntimeSelection>)?;
    if let Some(r) = pick(runtime_flag, runtime_env, runtime_file) {
        hbm.runtime = r;
    }
    let recache_flag = flags
        .recache
        .as_deref()
        .map(parse_recache)
        .transpose()
        .map_err(|e| SettingsError::Invalid { setting: "--recache", reason: e.to_string() })?;
    if let Some(r) =
        pick(recache_flag, env_value(env, "UMBP_CACHE_REMOTE_FETCHES", parse_recache)?, f.recache.map(|r| r.0))
    {
        c.recache = r;
    }
    let lease_ms = env_value(env, "UMBP_DRAM_READ_LEASE_MS", |s| match s.parse::<u64>() {
        Ok(ms) if ms >= 1 => Ok(Duration::from_millis(ms)),
        _ => Err("expected milliseconds >= 1"),
    })?;
    if let Some(d) = pick(None, lease_ms, f.read_lease.map(|d| d.0)) {
        c.read_lease = d;
    }
    if let Some(HumanDuration(d)) = f.pending_ttl {
        c.pending_ttl = d;
    }
    if let Some(HumanDuration(d)) = f.rpc_timeout {
        c.rpc_timeout = d;
    }
    if let Some(n) = f.max_reroutes {
        c.max_reroutes = n;
    }
    if let Some(ByteSize(b)) = f.bounce {
        c.bounce_bytes = b;
    }
    c.metrics_listen = pick(
        flags.metrics_addr,
        env_parsed::<SocketAddr>(env, "UMBP_NODE_METRICS_ADDR", "HOST:PORT (an IP address)")?,
        f.metrics_addr,
    );
    let mut ssd = SsdConfig::default();
    let dirs_env = env_value(env, "UMBP_SSD_DIRS", |s| {
        let dirs: Vec<PathBuf> = s.split(',').map(str::trim).filter(|d| !d.is_empty()).map(PathBuf::from).collect();
        if dirs.is_empty() { Err("expected a comma-separated list of directories") } else { Ok(dirs) }
    })?;
    let dirs_flag = (!flags.ssd_dir.is_empty()).then(|| flags.ssd_dir.clone());
    if let Some(d) = pick(dirs_flag, dirs_env, f.ssd_dirs.clone()) {
        ssd.dirs = d;
    }
    if let Some(b) =
        pick(flags.ssd_capacity, env_value(env, "UMBP_SSD_CAPACITY", parse_size)?, f.ssd_capacity.map(|b| b.0))
    {
        ssd.capacity_bytes = b;
    }
    let engine = |setting: &'static str, value: Option<&str>| {
        value
            .map(str::parse::<IoEngineKind>)
            .transpose()
            .map_err(|e| SettingsError::Invalid { setting, reason: e.to_string() })
    };
    let engine_flag = engine("--ssd-io-engine", flags.ssd_io_engine.as_deref())?;
    let engine_file = engine("node.ssd_io_engine", f.ssd_io_engine.as_deref())?;
    let engine_env = env_value(env, "UMBP_SSD_IO_ENGINE", str::parse::<IoEngineKind>)?;
    if let Some(e) = pick(engine_flag, engine_env, engine_file) {
        ssd.io_engine = e;
    }
    let staging_env = env_parsed::<u64>(env, "UMBP_SSD_STAGING_PAGES", "a page count")?;
    if let Some(n) = pick(flags.ssd_staging_pages, staging_env, f.ssd_staging_pages) {
        ssd.staging_pages = n;
    }
    let max_pages_env = env_parsed::<u64>(env, "UMBP_SSD_MAX_VALUE_PAGES", "a page count")?;
    if let Some(n) = pick(flags.ssd_max_value_pages, max_pages_env, f.ssd_max_value_pages) {
        ssd.max_value_pages = n;
    }
    let ssd_lease_ms = env_value(env, "UMBP_SSD_READ_LEASE_MS", |s| match s.parse::<u64>() {
        Ok(ms) if ms >= 1 => Ok(Duration::from_millis(ms)),
        _ => Err("expected milliseconds >= 1"),
    })?;
    if let Some(d) = pick(flags.ssd_read_lease, ssd_lease_ms, f.ssd_read_lease.map(|d| d.0)) {
        ssd.read_lease = d;
    }
    if let Some(b) =
        pick(flags.ssd_create_dirs.then_some(true), env_bool(env, "UMBP_SSD_CREATE_DIRS")?, f.ssd_create_dirs)
    {
        ssd.create_dirs = b;
    }
    let sync = |setting: &'static str, value: Option<&str>| {
        value.map(parse_sync_interval).transpose().map_err(|reason| SettingsError::Invalid { setting, reason })
    };
    let sync_flag = sync("--ssd-sync-interval", flags.ssd_sync_interval.as_deref())?;
    let sync_file = sync("node.ssd_sync_interval", f.ssd_sync_interval.as_deref())?;
    let sync_env = env_value(env, "UMBP_SSD_SYNC_INTERVAL", parse_sync_interval)?;
    if let Some(i) = pick(sync_flag, sync_env, sync_file) {
        ssd.sync_interval = i;
    }
    c.medium = match medium {
        MediumKind::Dram => Medium::Dram(dram),
        MediumKind::Ssd => Medium::Ssd(ssd),
        MediumKind::Hbm => Medium::Hbm(hbm),
        MediumKind::None => Medium::None,
    };
    c.cluster_token = resolve_token(file, env, token);
    c.master = MasterClientConfig::default().with_env(env)?;
    c.master.cluster_token.clone_from(&c.cluster_token);
    check_node(&c)?;
    Ok(c)
}

/// The settings of a client command (`put`, `get`, `exists`, `rm`, `stat`): a node with no medium
/// named `node_id`.
pub fn resolve_client(
    file: &FileConfig,
    env: EnvGetter<'_>,
    master: &MasterAddress,
    token: Option<&str>,
    node_id: String,
) -> Result<PoolClientConfig, SettingsError> {
    let mut c = PoolClientConfig::new(node_id, resolve_master_address(file, env, master));
    let f = &file.node;
    if let Some(HumanDuration(d)) = f.rpc_timeout {
        c.rpc_timeout = d;
    }
    if let Some(n) = f.max_reroutes {
        c.max_reroutes = n;
    }
    if let Some(ByteSize(b)) = f.bounce {
        c.bounce_bytes = b;
    }
    c.recache = RecachePolicy::Off;
    c.cluster_token = resolve_token(file, env, token);
    c.master = MasterClientConfig::default().with_env(env)?;
    c.master.cluster_token.clone_from(&c.cluster_token);
    c.master.validate()?;
    Ok(c)
}

/// The largest value `umbp get` accepts: flag, else the file, else 64 MiB.
pub fn resolve_max_get_size(file: &FileConfig, flags: &GetArgs) -> u64 {
    flags.max_size.or(file.client.max_get_size.map(|b| b.0)).unwrap_or(DEFAULT_MAX_GET_SIZE)
}

/// The smallest page, and what every page size must be a multiple of.
const MIN_PAGE_SIZE: u64 = 4096;

/// The first layer that sets a value: flag, then environment, then file.
fn pick<T>(flag: Option<T>, env: Option<T>, file: Option<T>) -> Option<T> {
    flag.or(env).or(file)
}

fn check_node(c: &PoolClientConfig) -> Result<(), SettingsError> {
    if c.page_size == 0 || !c.page_size.is_multiple_of(MIN_PAGE_SIZE) {
        // Pages are what the allocators, O_DIRECT and the GPU copies align to.
        return Err(SettingsError::Invalid {
            setting: "page_size",
            reason: format!("{} is not a positive multiple of 4KiB (try 64KiB or 2MiB)", c.page_size),
        });
    }
    if let Medium::Dram(d) = &c.medium
        && d.capacity_bytes < c.page_size
    {
        return Err(SettingsError::Invalid {
            setting: "capacity",
            reason: format!(
                "{} is smaller than one page of {}",
                format_size(d.capacity_bytes),
                format_size(c.page_size)
            ),
        });
    }
    if let Medium::Hbm(h) = &c.medium
        && h.capacity_bytes < c.page_size
    {
        return Err(SettingsError::Invalid {
            setting: "hbm_capacity",
            reason: format!(
                "{} is smaller than one page of {}",
                format_size(h.capacity_bytes),
                format_size(c.page_size)
            ),
        });
    }
    if let Medium::Ssd(s) = &c.medium {
        if s.dirs.is_empty() {
            return Err(SettingsError::Missing {
                what: "the SSD directories",
                how: "pass --ssd-dir DIR (repeatable), set UMBP_SSD_DIRS, or set node.ssd_dirs in the configuration file",
            });
        }
        if s.max_value_pages == 0 || s.max_value_pages > s.staging_pages {
            // The medium stages a whole value at once: a value of more pages than the arena holds
            // could never be written or read.
            return Err(SettingsError::Invalid {
                setting: "ssd_max_value_pages",
                reason: format!("{} must be in 1..=ssd_staging_pages ({})", s.max_value_pages, s.staging_pages),
            });
        }
        if s.capacity_bytes < c.page_size {
            return Err(SettingsError::Invalid {
                setting: "ssd_capacity",
                reason: format!(
                    "{} is smaller than one page of {}",
                    format_size(s.capacity_bytes),
                    format_size(c.page_size)
                ),
            });
        }
    }
    c.master.validate()?;
    Ok(())
}

impl MediumKind {
    /// Reads a medium name (`dram`, `hbm`, `none`).
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name.trim().to_ascii_lowercase().as_str() {
            "dram" => Ok(Self::Dram),
            "hbm" => Ok(Self::Hbm),
            "ssd" => Ok(Self::Ssd),
            "none" => Ok(Self::None),
            other => Err(format!("{other:?} is not a medium: expected dram, hbm, ssd or none")),
        }
    }
}
