//! The settings of a [`PoolClient`](super::PoolClient) and of the medium it lends.

use std::net::SocketAddr;
use std::time::Duration;

/// How a node names its GPU runtime ([`HbmConfig::runtime`]).
pub use umbp_gpu::RuntimeSelection;
#[cfg(feature = "ssd")]
pub use umbp_ssd::IoEngineKind;

#[cfg(feature = "ssd")]
use super::PoolError;
use crate::master_client::MasterClientConfig;

/// The medium a node lends. A node lends exactly one medium, or none (a client-only node).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Medium {
    /// No medium: the node only reads and writes the pool.
    None,
    /// Host DRAM through `PageBackend` over anonymous memory.
    #[cfg(feature = "dram")]
    Dram(DramConfig),
    /// GPU HBM through `PageBackend` over device memory of one GPU (`umbp-hbm`).
    #[cfg(feature = "hbm")]
    Hbm(HbmConfig),
    /// Local drives through `SsdBackend`: a registered host staging arena over a drive log
    /// (`umbp-ssd`).
    #[cfg(feature = "ssd")]
    Ssd(umbp_ssd::SsdSettings),
    /// CXL or persistent memory through `PageBackend` over a shared mapping of a device-DAX device or
    /// a file (`umbp-cxl`).
    #[cfg(feature = "cxl")]
    Cxl(CxlConfig),
    /// An S3-compatible object store (or a local directory) through a registered host staging
    /// arena (`umbp-object`).
    #[cfg(feature = "object")]
    Object(umbp_object::ObjectSettings),
}

impl Medium {
    /// The medium's name as the command line and the settings file spell it (`dram`, `object`, …;
    /// `none` for a client-only node). Every medium has its arm here, checked by the compiler, so a
    /// new one cannot be left out of the lines that name it.
    pub fn name(&self) -> &'static str {
        match self {
            Self::None => "none",
            #[cfg(feature = "dram")]
            Self::Dram(_) => "dram",
            #[cfg(feature = "hbm")]
            Self::Hbm(_) => "hbm",
            #[cfg(feature = "ssd")]
            Self::Ssd(_) => "ssd",
            #[cfg(feature = "cxl")]
            Self::Cxl(_) => "cxl",
            #[cfg(feature = "object")]
            Self::Object(_) => "object",
        }
    }

    /// The bytes the medium lends (0 for a client-only node).
    pub fn capacity_bytes(&self) -> u64 {
        match self {
            Self::None => 0,
            #[cfg(feature = "dram")]
            Self::Dram(d) => d.capacity_bytes,
            #[cfg(feature = "hbm")]
            Self::Hbm(h) => h.capacity_bytes,
            #[cfg(feature = "ssd")]
            Self::Ssd(s) => s.capacity_bytes,
            #[cfg(feature = "cxl")]
            Self::Cxl(c) => c.capacity_bytes,
            #[cfg(feature = "object")]
            Self::Object(o) => o.capacity_bytes,
        }
    }

    /// The medium's settings as `key=value` pairs for a log line (`medium=dram capacity_bytes=…`);
    /// `None` for a client-only node.
    pub fn summary(&self) -> Option<String> {
        match self {
            Self::None => None,
            #[cfg(feature = "dram")]
            Self::Dram(d) => Some(format!(
                "medium=dram capacity_bytes={} hugepages={} thp={} prefault={} numa_node={}",
                d.capacity_bytes,
                d.use_hugepages,
                d.transparent_hugepages,
                d.prefault,
                d.numa_node.map_or_else(|| "none".to_owned(), |n| n.to_string())
            )),
            #[cfg(feature = "hbm")]
            Self::Hbm(h) => Some(format!(
                "medium=hbm capacity_bytes={} device={} runtime={}",
                h.capacity_bytes, h.device, h.runtime
            )),
            #[cfg(feature = "ssd")]
            Self::Ssd(s) => Some(format!(
                "medium=ssd capacity_bytes={} dirs={} io_engine={} staging_pages={} max_value_pages={} \
                 read_lease_ms={} sync_interval_ms={}",
                s.capacity_bytes,
                s.dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(","),
                s.io_engine,
                s.staging_pages,
                s.max_value_pages,
                s.read_lease.as_millis(),
                s.sync_interval.map_or_else(|| "off".to_owned(), |d| d.as_millis().to_string())
            )),
            #[cfg(feature = "cxl")]
            Self::Cxl(c) => Some(format!(
                "medium=cxl capacity_bytes={} path={}",
                c.capacity_bytes,
                c.path.as_ref().map_or_else(|| "none".to_owned(), |p| p.display().to_string())
            )),
            #[cfg(feature = "object")]
            Self::Object(o) => Some(format!(
                "medium=object capacity_bytes={} url={} endpoint={} staging_pages={} io_threads={}",
                o.capacity_bytes,
                o.url.as_deref().unwrap_or("none"),
                o.endpoint.as_deref().unwrap_or("env"),
                o.staging_pages,
                o.io_threads
            )),
        }
    }
}

/// Settings of a DRAM medium: the one place their names (the settings file's `[node.dram]` keys),
/// defaults and meaning are written.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DramConfig {
    /// Bytes of host memory to lend (`"4GiB"` or bytes). Default: 4 GiB.
    #[serde(with = "umbp_core::units::serde::size")]
    pub capacity_bytes: u64,
    /// Use hugetlb pages (reserved in `/proc/sys/vm/nr_hugepages`). Without them, or when none are
    /// reserved, the memory is still advised for transparent huge pages. Default: false.
    pub use_hugepages: bool,
    /// Bind the memory to this NUMA node. Default: none.
    pub numa_node: Option<u32>,
    /// Touch every page at start-up. Default: true.
    pub prefault: bool,
    /// Advise the memory for transparent huge pages (fewer TLB misses and page pins; with THP
    /// `defrag=madvise` a first touch may compact memory, at start-up when prefaulting). Default:
    /// true.
    pub transparent_hugepages: bool,
}

impl Default for DramConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: 4 << 30,
            use_hugepages: false,
            numa_node: None,
            prefault: true,
            transparent_hugepages: true,
        }
    }
}

/// Settings of an HBM medium: the HBM crate's own (device, capacity, runtime).
#[cfg(feature = "hbm")]
pub use umbp_hbm::HbmConfig;

/// Settings of a CXL medium: the CXL crate's own (path, capacity).
#[cfg(feature = "cxl")]
pub use umbp_cxl::CxlConfig;

/// Settings of an object-store medium: the object crate's own.
#[cfg(feature = "object")]
pub use umbp_object::ObjectSettings;

/// Settings of an SSD medium: the SSD crate's own [`umbp_ssd::SsdSettings`] (the rest of
/// `umbp_ssd::SsdConfig` keeps its defaults). The old name, kept for call sites.
#[cfg(feature = "ssd")]
pub type SsdConfig = umbp_ssd::SsdSettings;

/// Refuses a directory of an SSD medium that does not exist (or is not a directory), naming it and
/// the way out.
#[cfg(feature = "ssd")]
pub(super) fn ssd_dirs_exist(dirs: &[std::path::PathBuf]) -> Result<(), PoolError> {
    for dir in dirs {
        match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(PoolError::Config(format!("ssd directory {} is not a directory", dir.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(PoolError::Config(format!(
                    "ssd directory {} does not exist: mount the drive and create it, or ask for it to be \
                     created (--ssd-create-dirs, UMBP_SSD_CREATE_DIRS=true, node.ssd.create_dirs = true)",
                    dir.display()
                )));
            }
            Err(e) => return Err(PoolError::Config(format!("ssd directory {}: {e}", dir.display()))),
        }
    }
    Ok(())
}

/// Whether values fetched from a remote node are also written to the local medium.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecachePolicy {
    /// Never.
    Off,
    /// Values up to this many bytes.
    UpTo(u64),
    /// Every value.
    Always,
}

/// Settings of a [`PoolClient`](super::PoolClient).
#[derive(Clone)]
pub struct PoolClientConfig {
    /// This node's unique id. Required.
    pub node_id: String,
    /// `host:port` of the master. Required.
    pub master_address: String,
    /// The host other nodes reach this node at. Default: `127.0.0.1`.
    pub node_address: String,
    /// Where the peer service listens (only when the node lends a medium). Default: `127.0.0.1:0`.
    pub peer_listen: SocketAddr,
    /// Where the TCP data server listens (only when the node lends a medium: a node that lends none
    /// serves no data). Default: `127.0.0.1:0`.
    pub data_listen: SocketAddr,
    /// The medium this node lends. Default: none.
    pub medium: Medium,
    /// Page size of the medium (the pool's KV block size). Default: 2 MiB.
    pub page_size: u64,
    /// How long an allocated, uncommitted slot lives. Default: 30 s.
    pub pending_ttl: Duration,
    /// How long a resolve protects a key from eviction. Env `UMBP_DRAM_READ_LEASE_MS`. Default: 500 ms.
    pub read_lease: Duration,
    /// Bounce pool for caller memory that is not registered. Default: 64 MiB.
    pub bounce_bytes: u64,
    /// Shared cluster token for gRPC and the data port. Default: none.
    pub cluster_token: Option<String>,
    /// How many times a key is re-routed (excluding the nodes that failed it). Default: 2.
    pub max_reroutes: u32,
    /// Re-cache remote fetches locally. Default: values up to 16 MiB.
    pub recache: RecachePolicy,
    /// Deadline of every peer RPC, and the longest a data-plane connection may make no progress
    /// before its transfers fail (a holder partitioned away mid-transfer: its reads are useless after
    /// the read lease anyway). Default: 5 s.
    pub rpc_timeout: Duration,
    /// The master client's settings.
    pub master: MasterClientConfig,
    /// Where to serve Prometheus `/metrics` (port 0 picks a free one; see
    /// [`PoolClient::metrics_address`](super::PoolClient::metrics_address)). Default: none (no endpoint, and the medium is not wrapped
    /// in `InstrumentedBackend`: nothing would read its counters).
    pub metrics_listen: Option<SocketAddr>,
    /// The GPU runtime of a node that lends no HBM (an HBM node uses its medium's). With one, the GPU
    /// copy engine joins, so the caller can put from and get into its own device buffers
    /// ([`register_memory_at`](super::PoolClient::register_memory_at)); `auto` probes the machine (and
    /// finds nothing under `UMBP_GPU_RUNTIME=none`). Default: none, so a DRAM, SSD or client-only
    /// node never probes a GPU nor pins its medium and bounce pool with one.
    pub gpu_runtime: Option<RuntimeSelection>,
    /// The device whose context a node without HBM pins its host memory with (for the GPU copy
    /// engine of [`gpu_runtime`](Self::gpu_runtime)): the rank's own GPU, so that a process serving
    /// GPU 3 never creates a context on GPU 0 (on the CUDA driver API, touching a device creates
    /// one, costing that GPU memory). An HBM node uses its medium's device. Default: 0.
    pub gpu_device: u32,
    /// Whether a node that lends no medium registers with the master anyway (listed as a client in
    /// the cluster status and `umbp stat`, heartbeating, unregistered at `close`). A node that lends
    /// a medium always registers, and so does one that serves `/metrics`
    /// ([`metrics_listen`](Self::metrics_listen): an operator who scrapes it wants it listed).
    /// Otherwise a medium-less node is a *light client*: no registration, no heartbeat, no data
    /// server, no peer service — it only asks the master for routes and talks to the holders.
    /// Default: false.
    pub register_client: bool,
    /// Whether single-key gets and puts use **keyed requests**: one exchange with the holder's data
    /// server instead of the routed resolve/allocate → transfer → release/commit RPCs (see the
    /// `fast` module of `pool_client`; anything unusual still takes the routed path). As a node,
    /// whether its data server answers other nodes' keyed requests. Off: every call is routed (for
    /// a comparison, or a cluster with an older node that closes connections at unknown ops).
    /// Default: true.
    pub keyed_requests: bool,
    /// Whether same-host traffic takes the **shared-memory path**: a DRAM medium allocates its
    /// memory as sealed memory files and the node serves them to authenticated processes of the
    /// same user on this host (a Unix socket named after its data endpoint), and the client copies
    /// to and from same-host holders' memory through mappings of those files instead of over TCP
    /// (falling back to TCP for any pair the path cannot take). Off: no memory file, no socket,
    /// every byte over TCP. Default: true.
    pub shared_memory: bool,
    /// Besides processes of this node's own user, the shared-memory server admits same-host peers
    /// whose **effective group** is this gid (`SO_PEERCRED`; supplementary groups do not count),
    /// for ranks that run as different users of one group. They still need the cluster token.
    /// Such a peer maps this node's memory as the owner does: it may read and write every value
    /// in it. Only a node that lends a medium runs the server. Default: `None` (same user only).
    pub shared_memory_group: Option<u32>,
    /// Whether values carry an **end-to-end checksum**: a put computes the value's CRC-32C
    /// (hardware-assisted) and the holder stores it with the value; a get checks the bytes it
    /// copied against it, and bytes that do not match (a flipped bit in a holder's memory, on its
    /// drive or on the wire) are discarded, counted (`umbp_client_checksum_failures_total`), logged,
    /// and read from another holder or reported a miss — never returned. A value put without one
    /// (this setting off at its writer) is not checked; neither is a buffer in device memory, which
    /// the CPU cannot read. Off: no checksum computed or checked. Default: true.
    pub checksums: bool,
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for PoolClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolClientConfig")
            .field("node_id", &self.node_id)
            .field("master_address", &self.master_address)
            .field("node_address", &self.node_address)
            .field("peer_listen", &self.peer_listen)
            .field("data_listen", &self.data_listen)
            .field("medium", &self.medium)
            .field("page_size", &self.page_size)
            .field("pending_ttl", &self.pending_ttl)
            .field("read_lease", &self.read_lease)
            .field("bounce_bytes", &self.bounce_bytes)
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<redacted>"))
            .field("max_reroutes", &self.max_reroutes)
            .field("recache", &self.recache)
            .field("rpc_timeout", &self.rpc_timeout)
            .field("master", &self.master)
            .field("metrics_listen", &self.metrics_listen)
            .field("gpu_runtime", &self.gpu_runtime)
            .field("gpu_device", &self.gpu_device)
            .field("register_client", &self.register_client)
            .field("keyed_requests", &self.keyed_requests)
            .field("shared_memory", &self.shared_memory)
            .field("shared_memory_group", &self.shared_memory_group)
            .field("checksums", &self.checksums)
            .finish()
    }
}

impl PoolClientConfig {
    /// A client-only node `node_id` of the master at `master_address`, every other setting default.
    pub fn new(node_id: impl Into<String>, master_address: impl Into<String>) -> Self {
        Self {
            node_id: node_id.into(),
            master_address: master_address.into(),
            node_address: "127.0.0.1".into(),
            peer_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            data_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            medium: Medium::None,
            page_size: 2 << 20,
            pending_ttl: Duration::from_secs(30),
            read_lease: Duration::from_millis(500),
            bounce_bytes: 64 << 20,
            cluster_token: None,
            max_reroutes: 2,
            recache: RecachePolicy::UpTo(16 << 20),
            rpc_timeout: Duration::from_secs(5),
            master: MasterClientConfig::default(),
            metrics_listen: None,
            gpu_runtime: None,
            gpu_device: 0,
            register_client: false,
            keyed_requests: true,
            shared_memory: true,
            shared_memory_group: None,
            checksums: true,
        }
    }

    /// The same config lending `medium`.
    pub fn with_medium(mut self, medium: Medium) -> Self {
        self.medium = medium;
        self
    }

    /// Whether the node registers with the master (and heartbeats): it lends a medium, serves
    /// `/metrics`, or asks to ([`register_client`](Self::register_client)).
    pub fn registers(&self) -> bool {
        !matches!(self.medium, Medium::None) || self.metrics_listen.is_some() || self.register_client
    }
}
