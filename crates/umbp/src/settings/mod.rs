//! Settings of each command, merged from four layers in increasing precedence: the built-in
//! defaults (the components' own `Default`), the TOML file, the `UMBP_*` environment, the
//! command-line flags.
//!
//! - [`tree`]: the settings tree, one table per component config (`[node.ssd]` is
//!   `umbp_ssd::SsdSettings`, …), so names, defaults and validation are written once, in the
//!   component's crate.
//! - [`table`]: the one table mapping each setting's path to its flag and its `UMBP_*` variables
//!   (the reference's names), with the flat keys of earlier files (`node.ssd_max_value_pages`).
//! - [`layer`]: file → environment → flags over that tree, generically.
//! - [`flags`]: the flags each command was given, as values of the tree.
//!
//! The environment is read through a getter (`&dyn Fn(&str) -> Option<String>`), so tests pass a map
//! instead of mutating the process environment. A malformed value in any layer is an error naming
//! where it came from (the file's key, the variable or the flag), never a silent default.

mod flags;
mod group;
mod layer;
mod table;
#[cfg(test)]
mod tests;
mod tree;

use std::net::SocketAddr;
use std::path::PathBuf;

use umbp_core::ErrorKind;
use umbp_peer::pool_client::{Medium, PoolClientConfig, RecachePolicy};

pub use layer::FileConfig;
use table::Scope;
use tree::GroupSetting;
pub use tree::{ClientSettings, DEFAULT_MASTER_ADDRESS, DEFAULT_MAX_GET_SIZE, NodeSettings, Settings};

use crate::cli::{GetArgs, MasterAddress, MasterArgs, MediumKind, NodeArgs};
use crate::units::{UnitError, format_size, parse_size};

/// Reads one environment variable; `None` when it is not set.
pub type EnvGetter<'a> = &'a dyn Fn(&str) -> Option<String>;

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
        /// The parser's message, with the key.
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
    /// A setting is out of range (a flag's value included).
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

impl SettingsError {
    /// What the caller does next: fix the setting, or make the file readable.
    pub fn kind(&self) -> ErrorKind {
        match self {
            // An unreadable file may be a mount not there yet; everything else is a wrong value.
            Self::ReadFile { source, .. } if source.kind() != std::io::ErrorKind::NotFound => ErrorKind::Unavailable,
            Self::ReadFile { .. } | Self::BadFile { .. } | Self::BadEnv { .. } | Self::Missing { .. } => {
                ErrorKind::InvalidInput
            }
            Self::Invalid { .. } => ErrorKind::InvalidInput,
            Self::Master(e) => e.kind(),
            Self::MasterClient(e) => e.kind(),
        }
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

/// Writes a re-cache policy the way [`parse_recache`] reads it.
pub fn format_recache(policy: RecachePolicy) -> String {
    match policy {
        RecachePolicy::Off => "off".into(),
        RecachePolicy::Always => "always".into(),
        RecachePolicy::UpTo(cap) => format_size(cap),
    }
}

/// The master address: flag, else `UMBP_MASTER_ADDRESS`, else the file, else `127.0.0.1:50051`. A
/// comma-separated list names several masters sharing one Redis (the master client fails over
/// between them; it checks the list when it connects).
pub fn resolve_master_address(file: &FileConfig, env: EnvGetter<'_>, flag: &MasterAddress) -> String {
    let flags = flags::global(flag, None);
    // The address is text: no layer can make it invalid.
    layer::layer(file, env, &[Scope::Global], &flags)
        .map_or_else(|_| DEFAULT_MASTER_ADDRESS.to_owned(), |s| s.master_address)
}

/// The settings of `umbp master`.
pub fn resolve_master(
    file: &FileConfig,
    env: EnvGetter<'_>,
    flags: &MasterArgs,
    token: Option<&str>,
) -> Result<umbp_master::MasterConfig, SettingsError> {
    // Not a setting of this master: the reference's store switch, refused unless it names ours.
    if let Some(b) = env("UMBP_METADATA_BACKEND")
        && !b.trim().eq_ignore_ascii_case("inmemory")
    {
        return Err(SettingsError::BadEnv {
            var: "UMBP_METADATA_BACKEND",
            value: b,
            reason: "only `inmemory` names a store here; for Redis, give --metadata redis://HOST:PORT".into(),
        });
    }
    let s = layer::layer(file, env, &[Scope::Global, Scope::Master], &flags::master(flags, token))?;
    let mut c = s.master;
    c.cluster_token = s.cluster_token.filter(|t| !t.is_empty());
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
    let scopes = [Scope::Global, Scope::Node, Scope::MasterClient, Scope::PoolClient];
    let s = layer::layer(file, env, &scopes, &flags::node(flags, token))?;
    let n = s.node;
    let node_id = n.node_id.ok_or(SettingsError::Missing {
        what: "the node id",
        how: "pass --node-id ID, set UMBP_NODE_ID, or set node.node_id in the configuration file",
    })?;
    if node_id.trim().is_empty() || node_id.chars().any(char::is_whitespace) {
        return Err(SettingsError::Invalid {
            setting: "node_id",
            reason: format!("{node_id:?} is empty or has spaces"),
        });
    }
    if flags.capacity.is_some() && n.medium != MediumKind::Dram {
        // Silently ignoring it would lend a different size than the operator asked for.
        let instead = match n.medium {
            MediumKind::Ssd => {
                "an ssd node lends --ssd-capacity of drive (its host staging arena is \
                                --ssd-staging-pages pages of --page-size)"
            }
            MediumKind::Hbm => "an hbm node lends --hbm-capacity of device memory",
            MediumKind::Cxl => "a cxl node lends --cxl-capacity of its --cxl-path",
            MediumKind::Object => "an object node lends --object-capacity of its --object-url",
            _ => "a node with medium none lends nothing",
        };
        return Err(SettingsError::Invalid {
            setting: "--capacity",
            reason: format!("it sizes a dram node's memory; {instead}"),
        });
    }
    let shared_memory_group = match &n.shared_memory_group {
        Some(group) => Some(shared_memory_group(group, flags, n.shared_memory, n.medium)?),
        None => None,
    };
    let mut c = PoolClientConfig::new(node_id, s.master_address);
    c.page_size = n.page_size;
    c.node_address = n.listen.to_string();
    c.peer_listen = SocketAddr::new(n.listen, n.peer_port);
    c.data_listen = SocketAddr::new(n.listen, n.data_port);
    c.recache = n.recache;
    c.read_lease = n.read_lease;
    c.pending_ttl = n.pending_ttl;
    c.rpc_timeout = n.rpc_timeout;
    c.max_reroutes = n.max_reroutes;
    c.bounce_bytes = n.bounce;
    c.metrics_listen = n.metrics_addr;
    c.shared_memory = n.shared_memory;
    c.shared_memory_group = shared_memory_group;
    c.checksums = n.checksums;
    c.medium = match n.medium {
        MediumKind::Dram => Medium::Dram(n.dram),
        MediumKind::Ssd => Medium::Ssd(n.ssd),
        MediumKind::Hbm => Medium::Hbm(n.hbm),
        MediumKind::Cxl => Medium::Cxl(n.cxl),
        MediumKind::Object => Medium::Object(n.object),
        MediumKind::None => Medium::None,
    };
    c.cluster_token = s.cluster_token.filter(|t| !t.is_empty());
    c.master = n.master;
    c.master.cluster_token.clone_from(&c.cluster_token);
    check_node(&c)?;
    Ok(c)
}

/// The gid of `node.shared_memory_group`. The flag is refused where it could admit no one (the
/// path off, or no medium to share), as `--capacity` is; a file shared by many nodes may set it for
/// all of them.
fn shared_memory_group(
    group: &GroupSetting,
    flags: &NodeArgs,
    shared_memory: bool,
    medium: MediumKind,
) -> Result<u32, SettingsError> {
    let invalid = |reason: String| SettingsError::Invalid { setting: "--shared-memory-group", reason };
    if flags.shared_memory_group.is_some() {
        if !shared_memory {
            return Err(invalid(
                "it admits a group to the shared-memory path, which --shared-memory false turns off".into(),
            ));
        }
        if medium == MediumKind::None {
            return Err(invalid("a node with medium none lends no memory for the group to map".into()));
        }
    }
    group::gid(group).map_err(invalid)
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
    let scopes = [Scope::Global, Scope::Client, Scope::MasterClient, Scope::PoolClient];
    let s = layer::layer(file, env, &scopes, &flags::global(master, token))?;
    let mut c = PoolClientConfig::new(node_id, s.master_address);
    c.rpc_timeout = s.node.rpc_timeout;
    c.max_reroutes = s.node.max_reroutes;
    c.bounce_bytes = s.node.bounce;
    c.shared_memory = s.node.shared_memory;
    c.checksums = s.node.checksums;
    c.recache = RecachePolicy::Off;
    c.cluster_token = s.cluster_token.filter(|t| !t.is_empty());
    c.master = s.node.master;
    c.master.cluster_token.clone_from(&c.cluster_token);
    c.master.validate()?;
    Ok(c)
}

/// The largest value `umbp get` accepts: flag, else `UMBP_MAX_GET_SIZE`, else the file, else
/// 64 MiB.
pub fn resolve_max_get_size(file: &FileConfig, env: EnvGetter<'_>, flags: &GetArgs) -> Result<u64, SettingsError> {
    let s = layer::layer(file, env, &[Scope::Global, Scope::Client], &flags::get(flags))?;
    Ok(s.client.max_get_size)
}

/// The smallest page, and what every page size must be a multiple of.
const MIN_PAGE_SIZE: u64 = 4096;

fn check_node(c: &PoolClientConfig) -> Result<(), SettingsError> {
    if c.page_size == 0 || !c.page_size.is_multiple_of(MIN_PAGE_SIZE) {
        // Pages are what the allocators, O_DIRECT and the GPU copies align to.
        return Err(SettingsError::Invalid {
            setting: "page_size",
            reason: format!("{} is not a positive multiple of 4KiB (try 64KiB or 2MiB)", c.page_size),
        });
    }
    let smaller = |setting: &'static str, capacity: u64| SettingsError::Invalid {
        setting,
        reason: format!("{} is smaller than one page of {}", format_size(capacity), format_size(c.page_size)),
    };
    match &c.medium {
        Medium::Dram(d) if d.capacity_bytes < c.page_size => return Err(smaller("capacity", d.capacity_bytes)),
        Medium::Hbm(h) if h.capacity_bytes < c.page_size => return Err(smaller("hbm_capacity", h.capacity_bytes)),
        Medium::Cxl(x) if x.path.as_ref().is_none_or(|p| p.as_os_str().is_empty()) => {
            return Err(SettingsError::Missing {
                what: "the CXL device or file",
                how: "pass --cxl-path PATH, set UMBP_CXL_PATH, or set node.cxl.path in the configuration file",
            });
        }
        Medium::Cxl(x) if x.capacity_bytes < c.page_size => return Err(smaller("cxl_capacity", x.capacity_bytes)),
        Medium::Object(o) if o.url.as_ref().is_none_or(|u| u.is_empty()) => {
            return Err(SettingsError::Missing {
                what: "the object store",
                how: "pass --object-url s3://BUCKET/PREFIX (or file:///DIR), set UMBP_OBJECT_URL, or set \
                      node.object.url in the configuration file",
            });
        }
        // The medium's own rules (URL, endpoint, sizes); credentials are read when it starts.
        Medium::Object(o) => {
            o.check(c.page_size).map_err(|e| SettingsError::Invalid { setting: "object", reason: e.to_string() })?;
        }
        Medium::Ssd(s) => {
            if s.dirs.is_empty() {
                return Err(SettingsError::Missing {
                    what: "the SSD directories",
                    how: "pass --ssd-dir DIR (repeatable), set UMBP_SSD_DIRS, or set node.ssd.dirs in the \
                          configuration file",
                });
            }
            // The medium's own rule, checked before it starts.
            s.check_value_pages()
                .map_err(|e| SettingsError::Invalid { setting: "ssd_max_value_pages", reason: e.to_string() })?;
            if s.capacity_bytes < c.page_size {
                return Err(smaller("ssd_capacity", s.capacity_bytes));
            }
        }
        _ => {}
    }
    c.master.validate()?;
    Ok(())
}

impl MediumKind {
    /// Reads a medium name (`dram`, `hbm`, `ssd`, `cxl`, `object`, `none`): any variant's
    /// [`as_str`](Self::as_str), so a new medium is named in one place.
    pub fn from_name(name: &str) -> Result<Self, String> {
        use clap::ValueEnum as _;
        let name = name.trim().to_ascii_lowercase();
        let all = Self::value_variants();
        if let Some(m) = all.iter().find(|m| m.as_str() == name) {
            return Ok(*m);
        }
        let names: Vec<&str> = all.iter().map(|m| m.as_str()).collect();
        let (last, rest) = names.split_last().map_or(("", &[][..]), |(l, r)| (*l, r));
        Err(format!("{name:?} is not a medium: expected {} or {last}", rest.join(", ")))
    }
}
