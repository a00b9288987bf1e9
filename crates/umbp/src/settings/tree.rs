//! The settings tree, typed: one table per component, each the component's own config, so a
//! component's names, defaults and validation are written once, in its crate.
//!
//! ```toml
//! master_address = "127.0.0.1:50051"
//! [master]            # umbp_master::MasterConfig
//! [master.eviction]   # its EvictionConfig
//! [node]              # the node's own settings (PoolClientConfig's)
//! [node.dram]         # umbp_peer::pool_client::DramConfig
//! [node.hbm]          # umbp_hbm::HbmConfig
//! [node.cxl]          # umbp_cxl::CxlConfig
//! [node.object]       # umbp_object::ObjectSettings
//! [node.ssd]          # umbp_ssd::SsdSettings
//! [node.master]       # umbp_peer::master_client::MasterClientConfig
//! [client]
//! ```

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use umbp_master::MasterConfig;
use umbp_peer::master_client::MasterClientConfig;
use umbp_peer::pool_client::{
    CxlConfig, DramConfig, HbmConfig, ObjectSettings, PoolClientConfig, RecachePolicy, SsdConfig as SsdSettings,
};

use crate::cli::MediumKind;

/// The master address every command uses when none is given.
pub const DEFAULT_MASTER_ADDRESS: &str = "127.0.0.1:50051";

/// The largest value `umbp get` accepts when none is given: 64 MiB.
pub const DEFAULT_MAX_GET_SIZE: u64 = 64 << 20;

/// Every setting of every command, after the file, the environment and the flags.
#[derive(Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    /// Where nodes and client commands find the master: `host:port`, or several masters sharing one
    /// Redis comma-separated (`a:50051,b:50051`; the master client fails over between them).
    pub master_address: String,
    /// The cluster token (an empty one means none).
    pub cluster_token: Option<String>,
    /// `[master]`.
    pub master: MasterConfig,
    /// `[node]`.
    pub node: NodeSettings,
    /// `[client]`.
    pub client: ClientSettings,
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("master_address", &self.master_address)
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<redacted>"))
            .field("master", &self.master)
            .field("node", &self.node)
            .field("client", &self.client)
            .finish()
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            master_address: DEFAULT_MASTER_ADDRESS.to_owned(),
            cluster_token: None,
            master: MasterConfig::default(),
            node: NodeSettings::default(),
            client: ClientSettings::default(),
        }
    }
}

/// The `[node]` table: the node's own settings and one table per medium.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeSettings {
    /// The node's cluster-unique id (required by `umbp node`).
    pub node_id: Option<String>,
    /// The medium it lends.
    pub medium: MediumKind,
    /// Page size of the medium.
    #[serde(with = "umbp_core::units::serde::size")]
    pub page_size: u64,
    /// Host of the peer service and the data server.
    pub listen: IpAddr,
    /// Peer-service port (0: any free one).
    pub peer_port: u16,
    /// Data-server port (0: any free one).
    pub data_port: u16,
    /// Re-cache policy for remote fetches.
    #[serde(with = "recache")]
    pub recache: RecachePolicy,
    /// Read lease of a resolve.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub read_lease: Duration,
    /// TTL of an uncommitted slot.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub pending_ttl: Duration,
    /// Deadline of each peer RPC, and of a data-plane connection's progress.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub rpc_timeout: Duration,
    /// Re-routes per key.
    pub max_reroutes: u32,
    /// Bounce pool size.
    #[serde(with = "umbp_core::units::serde::size")]
    pub bounce: u64,
    /// Where Prometheus `/metrics` is served (none: no endpoint).
    pub metrics_addr: Option<SocketAddr>,
    /// The same-host shared-memory path.
    pub shared_memory: bool,
    /// A group whose processes the shared-memory server also admits (a name or a gid).
    pub shared_memory_group: Option<GroupSetting>,
    /// End-to-end value checksums (computed at put, checked at get).
    pub checksums: bool,
    /// `[node.dram]`.
    pub dram: DramConfig,
    /// `[node.hbm]`.
    pub hbm: HbmConfig,
    /// `[node.cxl]`.
    pub cxl: CxlConfig,
    /// `[node.object]`.
    pub object: ObjectSettings,
    /// `[node.ssd]`.
    pub ssd: SsdSettings,
    /// `[node.master]`: the node's client of the master.
    pub master: MasterClientConfig,
}

impl Default for NodeSettings {
    /// `PoolClientConfig`'s defaults: written there, read here.
    fn default() -> Self {
        let p = PoolClientConfig::new(String::new(), String::new());
        Self {
            node_id: None,
            medium: MediumKind::Dram,
            page_size: p.page_size,
            listen: p.peer_listen.ip(),
            peer_port: p.peer_listen.port(),
            data_port: p.data_listen.port(),
            recache: p.recache,
            read_lease: p.read_lease,
            pending_ttl: p.pending_ttl,
            rpc_timeout: p.rpc_timeout,
            max_reroutes: p.max_reroutes,
            bounce: p.bounce_bytes,
            metrics_addr: p.metrics_listen,
            shared_memory: p.shared_memory,
            shared_memory_group: p.shared_memory_group.map(GroupSetting::Id),
            checksums: p.checksums,
            dram: DramConfig::default(),
            hbm: HbmConfig::default(),
            cxl: CxlConfig::default(),
            object: ObjectSettings::default(),
            ssd: SsdSettings::default(),
            master: p.master,
        }
    }
}

/// The `[client]` table.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientSettings {
    /// Largest value `umbp get` accepts.
    #[serde(with = "umbp_core::units::serde::size")]
    pub max_get_size: u64,
}

impl Default for ClientSettings {
    fn default() -> Self {
        Self { max_get_size: DEFAULT_MAX_GET_SIZE }
    }
}

/// The re-cache policy: `"off"`, `"always"` or a size cap (`"16MiB"` or bytes).
mod recache {
    use serde::de::{self, Deserializer, Visitor};
    use serde::ser::Serializer;
    use umbp_peer::pool_client::RecachePolicy;

    use super::super::{format_recache, parse_recache};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<RecachePolicy, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RecachePolicy;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"off\", \"always\" or a size cap (\"16MiB\")")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RecachePolicy, E> {
                Ok(RecachePolicy::UpTo(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RecachePolicy, E> {
                u64::try_from(v)
                    .map(RecachePolicy::UpTo)
                    .map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RecachePolicy, E> {
                parse_recache(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }

    pub(super) fn serialize<S: Serializer>(v: &RecachePolicy, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_recache(*v))
    }
}

/// A Unix group as a setting names it: a gid (`1000`, or `"1000"` from a flag or a variable) or a
/// name (`"umbp"`), looked up when the node starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GroupSetting {
    /// A numeric gid.
    Id(u32),
    /// A group name, for the host's group database.
    Name(String),
}

impl GroupSetting {
    /// A gid when `text` is all digits, else a name; an empty one is refused.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("a group is a name or a gid, not empty".into());
        }
        if text.bytes().all(|b| b.is_ascii_digit()) {
            return text.parse().map(Self::Id).map_err(|_| format!("gid {text} is out of range"));
        }
        Ok(Self::Name(text.to_owned()))
    }
}

impl<'de> Deserialize<'de> for GroupSetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, Visitor};
        struct V;
        impl Visitor<'_> for V {
            type Value = GroupSetting;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a group name (\"umbp\") or a gid (1000)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<GroupSetting, E> {
                u32::try_from(v).map(GroupSetting::Id).map_err(|_| E::custom(format!("gid {v} is out of range")))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<GroupSetting, E> {
                u32::try_from(v).map(GroupSetting::Id).map_err(|_| E::custom(format!("gid {v} is out of range")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<GroupSetting, E> {
                GroupSetting::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for GroupSetting {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Id(gid) => s.serialize_u32(*gid),
            Self::Name(name) => s.serialize_str(name),
        }
    }
}
