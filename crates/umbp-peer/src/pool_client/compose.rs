//! The composition root: the only place that names concrete media and transfer engines. It builds
//! the composite engine (local copy + shared memory (`shared_memory`) + TCP, plus GPU copy when the node lends HBM or `gpu_runtime`
//! asks for it; the TCP engine serves peers only when the node lends a medium) and the node's one
//! medium from its [`Medium`] setting, with a `match`: adding a medium adds an arm here and nowhere
//! else.

use std::net::SocketAddr;
use std::sync::Arc;

use umbp_core::MediumBackend;
#[cfg(any(feature = "dram", feature = "hbm", feature = "cxl"))]
use umbp_core::TierType;
use umbp_gpu::GpuRuntime;
use umbp_metrics::InstrumentedBackend;
#[cfg(any(feature = "dram", feature = "hbm", feature = "cxl"))]
use umbp_page::PageBackendConfig;
#[cfg(feature = "dram")]
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend};
use umbp_transfer::shm::{ShmClient, ShmClientConfig, ShmServer, ShmServerConfig};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, GpuCopyConfig, GpuCopyEngine, LocalCopyConfig, LocalCopyEngine,
    SharedMemoryConfig, SharedMemoryEngine, TcpEngine, TcpEngineConfig, TransferEngine,
};

#[cfg(feature = "ssd")]
use super::config::ssd_dirs_exist;
use super::{Medium, PoolClientConfig, PoolError, RuntimeSelection, support};

/// The smallest submit the in-process copy engine spreads over threads, on a host of `cores`.
///
/// Where the pipeline's chunks in flight fill the cores, a chunk copies on its own thread: spreading
/// it hands each value to another thread for nothing (on two cores a spread chunk read local 1 MiB
/// gets at 1.07× the old path, against 1.26× on its own thread). With more cores than chunks in
/// flight, a chunk on one thread would leave the rest idle — local 1 MiB gets read 20–25 GB/s,
/// 0.3 of memcpy, on the 16-core host while copies from another process there read 44 — so a
/// chunk spreads from [`SPREAD_FROM`] up. A submit larger than two chunks (one huge value) spreads
/// everywhere.
fn copy_parallel_threshold(cores: usize) -> u64 {
    if cores > support::PIPELINE_DEPTH { SPREAD_FROM } else { 2 * support::PIPELINE_CHUNK_BYTES }
}

/// The smallest chunk that spreads on a host with more cores than chunks in flight: two values of
/// 1 MiB (a copy thread's hand-off costs microseconds; a 64 KiB copy takes about as long).
const SPREAD_FROM: u64 = 2 << 20;

/// What the composition root built for one node.
pub(super) struct Composed {
    /// Every engine of the node behind one.
    pub(super) engine: Arc<CompositeTransferEngine>,
    /// The TCP engine inside it: its data server answers keyed requests (see `fast.rs`).
    pub(super) tcp: Arc<TcpEngine>,
    /// The TCP data server's advertised endpoint ("" for a node that lends no medium: it serves no
    /// data).
    pub(super) data_endpoint: String,
    /// The node's medium, not yet `init`ed (none for a client-only node).
    pub(super) medium: Option<Arc<dyn MediumBackend>>,
    /// Whether the medium's calls do drive IO (see `medium_call`).
    pub(super) medium_drive_io: bool,
    /// The node's one client of same-host holders' shared-memory servers (with `shared_memory`):
    /// the engine's batches and the keyed client's single keys both map through it, so the process
    /// holds one connection per holder and one mapping per holder region; the `PoolClient` sweeps
    /// it (see `ShmClient::sweep`).
    pub(super) shm_client: Option<Arc<ShmClient>>,
    /// The GPU runtime the GPU copy engine runs on (the HBM medium's, or `gpu_runtime`'s).
    pub(super) gpu_runtime: Option<Arc<dyn GpuRuntime>>,
}

/// Builds the engines and the medium `config` names.
pub(super) fn compose(config: &PoolClientConfig) -> Result<Composed, PoolError> {
    // The GPU runtime: the HBM medium's, else the one `gpu_runtime` asks for (none by default:
    // other nodes never touch a GPU unless asked). The GPU copy engine joins over it (so callers
    // can put from and get into device memory), and the TCP data server stages peers' reads and
    // writes of GPU regions (an HBM medium's pages) with it.
    let gpu_runtime: Option<Arc<dyn GpuRuntime>> = match (&config.medium, config.gpu_runtime) {
        #[cfg(feature = "hbm")]
        (Medium::Hbm(hbm), _) => Some(
            hbm.runtime
                .load()
                .map_err(|e| PoolError::Config(format!("hbm medium: GPU runtime {}: {e}", hbm.runtime)))?,
        ),
        (_, None) => None,
        (_, Some(RuntimeSelection::Auto)) => umbp_gpu::probe(),
        (_, Some(selection)) => {
            Some(selection.load().map_err(|e| PoolError::Config(format!("gpu_runtime {selection}: {e}")))?)
        }
    };
    let tcp_config = TcpEngineConfig {
        server: umbp_transfer::DataServerConfig {
            listen: config.data_listen,
            advertise: advertised(config, config.data_listen)?,
            ..Default::default()
        },
        cluster_token: config.cluster_token.clone(),
        // A partitioned holder stalls its connections silently: fail them after the RPC deadline,
        // not the engine's 30 s default (a read's lease ended long before).
        io_timeout: config.rpc_timeout,
        ..TcpEngineConfig::default()
    };
    // A node that lends no medium has nothing for peers to reach: its engine serves none (no data
    // port, no server thread) and its endpoint is "".
    let tcp = match (&config.medium, &gpu_runtime) {
        (Medium::None, _) => TcpEngine::client_only(tcp_config),
        (_, Some(runtime)) => TcpEngine::with_gpu_runtime(tcp_config, Arc::clone(runtime)),
        (_, None) => TcpEngine::new(tcp_config),
    }
    .map_err(PoolError::DataPlane)?;
    let tcp = Arc::new(tcp);
    let data_endpoint = tcp.endpoint().to_owned();
    let copy_config = LocalCopyConfig::default();
    let copy_config =
        LocalCopyConfig { parallel_threshold: copy_parallel_threshold(copy_config.threads), ..copy_config };
    // Selection is by order: in-process copies, then same-host holders' memory through shared
    // mappings (any pair it fails falls back to the next engine), then TCP.
    let mut engines: Vec<Arc<dyn TransferEngine>> = vec![Arc::new(LocalCopyEngine::new(copy_config.clone()))];
    let token = config.cluster_token.clone().unwrap_or_default().into_bytes();
    // One client of holders' shared-memory servers for the whole node (the keyed client gets it
    // too); its socket calls are local, hence the short default timeout (5 s), not the data plane's.
    let shm_client = config.shared_memory.then(|| Arc::new(ShmClient::new(ShmClientConfig::new(token.clone()))));
    if let Some(client) = &shm_client {
        let shm_config =
            SharedMemoryConfig { copy: copy_config, ..SharedMemoryConfig::new(data_endpoint.clone(), token.clone()) };
        engines.push(Arc::new(SharedMemoryEngine::with_client(shm_config, Arc::clone(client))));
    }
    engines.push(Arc::clone(&tcp) as Arc<dyn TransferEngine>);
    if let Some(runtime) = &gpu_runtime {
        // Pinning needs a current device: an HBM node uses its medium's, so it never touches
        // (on the CUDA driver API: creates a context on) another GPU.
        let pin_device = match &config.medium {
            #[cfg(feature = "hbm")]
            Medium::Hbm(hbm) => hbm.device,
            _ => config.gpu_device,
        };
        let gpu = GpuCopyEngine::new(Arc::clone(runtime), GpuCopyConfig { pin_device, ..GpuCopyConfig::default() })
            .map_err(|e| PoolError::Transfer { context: "GPU copy engine", source: Box::new(e) })?;
        engines.push(Arc::new(gpu));
    }
    let mut composite = CompositeTransferEngine::new(engines, CompositeConfig { bounce_bytes: config.bounce_bytes })
        .map_err(|e| PoolError::Transfer { context: "composite engine", source: Box::new(e) })?;
    // A node that lends a medium serves its shareable regions to same-host peers; one that cannot
    // (the socket name taken, say) still serves them over TCP.
    if config.shared_memory && !matches!(config.medium, Medium::None) && !data_endpoint.is_empty() {
        let mut shm = ShmServerConfig::new(data_endpoint.clone(), token);
        shm.allowed_gid = config.shared_memory_group;
        match ShmServer::start(shm) {
            Ok(server) => composite = composite.with_shm_server(Arc::new(server)),
            Err(e) => tracing::warn!(data = %data_endpoint, error = %e, "no shared-memory server; peers use TCP"),
        }
    }
    let engine = Arc::new(composite);
    // The medium switch: one arm per medium, each behind its crate feature. Adding a medium adds an
    // arm here and nowhere else. Each arm also says whether the medium's calls do drive IO (see
    // `medium_call`).
    let (medium, medium_drive_io): (Option<Arc<dyn MediumBackend>>, bool) = match &config.medium {
        Medium::None => (None, false),
        #[cfg(feature = "dram")]
        Medium::Dram(dram) => {
            let backend_config = PageBackendConfig::new(TierType::Dram, config.page_size, vec![dram.capacity_bytes])
                .with_pending_ttl(config.pending_ttl)
                .with_read_lease_ttl(config.read_lease);
            let source = HostPageMemorySource::new(HostMemoryOptions {
                use_hugepages: dram.use_hugepages,
                numa_node: dram.numa_node,
                prefault: dram.prefault,
                transparent_hugepages: dram.transparent_hugepages,
                // Sealed memory files same-host peers may map (the composite hands them to the
                // shared-memory server at registration).
                shareable: config.shared_memory,
                ..HostMemoryOptions::default()
            });
            (Some(Arc::new(PageBackend::new(backend_config, Box::new(source))?)), false)
        }
        #[cfg(feature = "hbm")]
        Medium::Hbm(hbm) => {
            let runtime = gpu_runtime.clone().ok_or_else(|| PoolError::Config("hbm medium: no GPU runtime".into()))?;
            let backend_config = PageBackendConfig::new(TierType::Hbm, config.page_size, Vec::new())
                .with_pending_ttl(config.pending_ttl)
                .with_read_lease_ttl(config.read_lease);
            let backend = umbp_hbm::make_hbm_backend(
                runtime,
                &umbp_hbm::HbmConfig::new(hbm.device, hbm.capacity_bytes),
                backend_config,
            )
            .map_err(|e| PoolError::Config(format!("hbm medium: {e}")))?;
            (Some(Arc::from(backend)), false)
        }
        #[cfg(feature = "ssd")]
        Medium::Ssd(ssd) => {
            if !ssd.create_dirs {
                ssd_dirs_exist(&ssd.dirs)?;
            }
            let ssd_config = umbp_ssd::SsdConfig::builder(ssd.dirs.iter().cloned())
                .page_size(config.page_size)
                .capacity_bytes(ssd.capacity_bytes)
                .io_engine(ssd.io_engine)
                .staging_pages(ssd.staging_pages)
                .pending_ttl(config.pending_ttl)
                .read_lease_ttl(ssd.read_lease)
                .sync_interval(ssd.sync_interval)
                .max_value_pages(ssd.max_value_pages)
                .cache_committed(ssd.cache_committed)
                // A staging arena same-host peers may map, as the DRAM medium's memory.
                .shareable_staging(config.shared_memory)
                .build()
                .map_err(|e| PoolError::Config(format!("ssd medium: {e}")))?;
            (Some(Arc::from(umbp_ssd::make_ssd_backend(ssd_config))), true)
        }
        #[cfg(feature = "cxl")]
        Medium::Cxl(cxl) => {
            let backend_config = PageBackendConfig::new(TierType::Dram, config.page_size, Vec::new())
                .with_pending_ttl(config.pending_ttl)
                .with_read_lease_ttl(config.read_lease);
            let backend = umbp_cxl::make_cxl_backend(cxl, backend_config)
                .map_err(|e| PoolError::Config(format!("cxl medium: {e}")))?;
            (Some(Arc::from(backend)), false)
        }
        #[cfg(feature = "object")]
        Medium::Object(object) => {
            let object_config = object
                .builder(config.page_size)
                .pending_ttl(config.pending_ttl)
                .build()
                .map_err(|e| PoolError::Config(format!("object medium: {e}")))?;
            // Its calls wait on the store's requests.
            (Some(Arc::from(umbp_object::make_object_backend(object_config))), true)
        }
    };
    // Every medium is charted by its tier= with no metrics code of its own (when a /metrics
    // endpoint is configured; otherwise nothing would read the counters).
    let medium = if config.metrics_listen.is_some() { medium.map(InstrumentedBackend::wrap) } else { medium };
    Ok(Composed { engine, tcp, data_endpoint, medium, medium_drive_io, shm_client, gpu_runtime })
}

/// The data endpoint to advertise for a data server listening on `listen`: none (the bound address) for
/// a specific IP; `node_address:port` for a wildcard IP, which then needs a fixed port.
fn advertised(config: &PoolClientConfig, listen: SocketAddr) -> Result<Option<String>, PoolError> {
    if !listen.ip().is_unspecified() {
        return Ok(None);
    }
    if listen.port() == 0 {
        return Err(PoolError::Config(format!(
            "data_listen {listen} is a wildcard address with port 0: peers could not be told where to connect; \
             give it a fixed port (it is advertised as {}:PORT)",
            config.node_address
        )));
    }
    Ok(Some(format!("{}:{}", config.node_address, listen.port())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipelined chunk copies on its own thread where the chunks in flight fill the cores, and
    /// spreads over the copy threads where they cannot.
    #[test]
    fn a_chunk_spreads_only_with_more_cores_than_chunks_in_flight() {
        let chunk = support::PIPELINE_CHUNK_BYTES;
        for cores in [1, 2, support::PIPELINE_DEPTH] {
            assert!(copy_parallel_threshold(cores) > chunk, "{cores} cores");
        }
        for cores in [support::PIPELINE_DEPTH + 1, 16, 128] {
            assert!(copy_parallel_threshold(cores) <= chunk, "{cores} cores");
            // Two 1 MiB values are worth a hand-off; one 64 KiB value is not.
            assert!(copy_parallel_threshold(cores) <= 2 << 20 && copy_parallel_threshold(cores) > 64 << 10);
        }
    }
}
