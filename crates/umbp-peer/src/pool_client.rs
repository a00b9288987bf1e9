//! `PoolClient`: the composition root of a node, and the API a client uses.
//!
//! It is the only place that names concrete media and transfer engines: it builds the composite
//! engine (local copy + TCP), the node's one medium from [`Medium`] with a `match`, `init`s it with
//! the engine as registrar, registers it, starts the peer service and the heartbeat, and offers
//! `put` / `get` / `exists` / `remove` / `clear` / `flush` over the whole pool.
//!
//! Puts and gets follow the reference flow — route at the master, allocate or resolve on the peer,
//! move bytes with the transfer engine, commit or abort — with every peer's transfers submitted
//! before any wait, and, unlike the reference, a bounded re-route with an exclude set after
//! `FailedNoSpace`, a peer failure or a miss. Results are per key.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};
use umbp_core::{
    AllocateOutcome, AllocateRequest, BackendRegistry, CommitRequest, LocalRegion, MediumBackend, MemoryLocation,
    MemoryRegistrar, PageLocation, TierType, TransferRef,
};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, LocalCopyEngine, PeerDirectory, TcpEngine, TcpEngineConfig,
    TransferEngine, TransferItem, failed_tags,
};

use crate::master_client::{MasterClient, MasterClientConfig, MasterClientError, NodeRegistration, RoutePutDecision};
use crate::peer_service::{
    PeerServer, PeerServerConfig, PeerServerHandle, PeerService, decode_batch_resolve, desc_from_wire,
    outcome_from_wire, page_from_wire, tier_to_wire,
};

/// The medium a node lends. A node lends exactly one medium, or none (a client-only node).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Medium {
    /// No medium: the node only reads and writes the pool.
    None,
    /// Host DRAM through `PageBackend` over anonymous memory.
    Dram(DramConfig),
}

/// Settings of a DRAM medium.
#[derive(Debug, Clone, PartialEq)]
pub struct DramConfig {
    /// Bytes of host memory to lend. Default: 4 GiB.
    pub capacity_bytes: u64,
    /// Use hugetlb pages (falls back to transparent huge pages). Default: false.
    pub use_hugepages: bool,
    /// Bind the memory to this NUMA node. Default: none.
    pub numa_node: Option<u32>,
    /// Touch every page at start-up. Default: true.
    pub prefault: bool,
}

impl Default for DramConfig {
    fn default() -> Self {
        Self { capacity_bytes: 4 << 30, use_hugepages: false, numa_node: None, prefault: true }
    }
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

/// Settings of a [`PoolClient`].
#[derive(Debug, Clone)]
pub struct PoolClientConfig {
    /// This node's unique id. Required.
    pub node_id: String,
    /// `host:port` of the master. Required.
    pub master_address: String,
    /// The host other nodes reach this node at. Default: `127.0.0.1`.
    pub node_address: String,
    /// Where the peer service listens (only when the node lends a medium). Default: `127.0.0.1:0`.
    pub peer_listen: SocketAddr,
    /// Where the TCP data server listens. Default: `127.0.0.1:0`.
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
    /// Deadline of every peer RPC. Default: 5 s.
    pub rpc_timeout: Duration,
    /// The master client's settings.
    pub master: MasterClientConfig,
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
        }
    }

    /// The same config lending `medium`.
    pub fn with_medium(mut self, medium: Medium) -> Self {
        self.medium = medium;
        self
    }
}

/// Why a node could not start or stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// A setting is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The medium could not come up.
    #[error("medium: {0}")]
    Medium(#[from] umbp_core::BackendError),
    /// The registry refused the medium.
    #[error("registry: {0}")]
    Registry(#[from] umbp_core::RegistryError),
    /// The transfer layer could not start.
    #[error("transfer layer: {0}")]
    Transfer(String),
    /// The peer service could not start.
    #[error("peer service: {0}")]
    PeerService(#[from] crate::peer_service::PeerServiceError),
    /// The master refused or could not be reached.
    #[error("master: {0}")]
    Master(#[from] MasterClientError),
}

/// Why one key of a batch failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// Keys must not be empty.
    #[error("empty key")]
    EmptyKey,
    /// Values must not be empty.
    #[error("empty value")]
    EmptyValue,
    /// No node can take the value (every candidate full, excluded or gone).
    #[error("no node can take a value of {size} bytes")]
    NoSpace {
        /// The value size.
        size: u64,
    },
    /// The value can never be stored (larger than any medium, refused by the medium).
    #[error("the pool refused the value: {0}")]
    Refused(String),
    /// The key is not in the pool.
    #[error("not found")]
    Miss,
    /// The caller's buffer is shorter than the stored value.
    #[error("buffer of {got} bytes is shorter than the stored value of {needed} bytes")]
    BufferTooSmall {
        /// The stored size.
        needed: u64,
        /// The buffer's size.
        got: u64,
    },
    /// A peer or the master failed the key (after every re-route).
    #[error("{0}")]
    Failed(String),
}

type PeerClient = UmbpPeerClient<Channel>;

/// Where a found key lives on a peer: size, pages, the peer's buffer refs by index, page size.
type Located = (u64, Vec<PageLocation>, Vec<Option<TransferRef>>, u64);

/// A node of the pool (with or without a medium) and the client API over the whole pool.
///
/// Needs a multi-threaded tokio runtime: transfers wait on blocking engines via `block_in_place`.
#[derive(Debug)]
pub struct PoolClient {
    config: PoolClientConfig,
    medium: Option<Arc<dyn MediumBackend>>,
    engine: Arc<CompositeTransferEngine>,
    data_endpoint: String,
    master: Arc<MasterClient>,
    peer_server: Mutex<Option<PeerServerHandle>>,
    peers: Mutex<HashMap<String, (String, PeerClient)>>,
    directory: PeerDirectory,
    /// Caller memory registered for zero copy: base address → (length, ref).
    user_regions: Mutex<BTreeMap<usize, (u64, TransferRef)>>,
    closed: std::sync::atomic::AtomicBool,
}

/// One key of a put group on its way to a node.
struct PutSlot {
    index: usize,
    slot_id: u64,
}

/// Work of one node in one round of a batch.
enum Target {
    Local,
    Remote { node: String, peer: String },
}

impl PoolClient {
    /// Starts a node: transfer engines, the medium, the peer service, registration and the heartbeat.
    pub async fn start(config: PoolClientConfig) -> Result<Self, PoolError> {
        if config.node_id.is_empty() || config.master_address.is_empty() {
            return Err(PoolError::Config("node_id and master_address are required".into()));
        }
        if config.page_size == 0 {
            return Err(PoolError::Config("page_size must be greater than 0".into()));
        }
        let tcp = TcpEngine::new(TcpEngineConfig {
            server: umbp_transfer::DataServerConfig { listen: config.data_listen, ..Default::default() },
            cluster_token: config.cluster_token.clone(),
            ..TcpEngineConfig::default()
        })
        .map_err(|e| PoolError::Transfer(e.to_string()))?;
        let data_endpoint = tcp.endpoint().to_owned();
        let engines: Vec<Arc<dyn TransferEngine>> = vec![Arc::new(LocalCopyEngine::default()), Arc::new(tcp)];
        let engine = Arc::new(
            CompositeTransferEngine::new(engines, CompositeConfig { bounce_bytes: config.bounce_bytes })
                .map_err(|e| PoolError::Transfer(e.to_string()))?,
        );
        // The medium switch: one arm per medium. Adding a medium adds an arm here and nowhere else.
        let medium: Option<Arc<dyn MediumBackend>> = match &config.medium {
            Medium::None => None,
            Medium::Dram(dram) => {
                let backend_config =
                    PageBackendConfig::new(TierType::Dram, config.page_size, vec![dram.capacity_bytes])
                        .with_pending_ttl(config.pending_ttl)
                        .with_read_lease_ttl(config.read_lease);
                let source = HostPageMemorySource::new(HostMemoryOptions {
                    use_hugepages: dram.use_hugepages,
                    numa_node: dram.numa_node,
                    prefault: dram.prefault,
                    ..HostMemoryOptions::default()
                });
                Some(Arc::new(PageBackend::new(backend_config, Box::new(source))?))
            }
        };
        let mut registry = BackendRegistry::new();
        if let Some(m) = &medium {
            m.init(Arc::clone(&engine) as Arc<dyn MemoryRegistrar>)?;
            registry.register(Arc::clone(m))?;
        }
        let registry = Arc::new(registry);
        let service = PeerService::new(Arc::clone(&registry), data_endpoint.clone());
        let peer_server = match &medium {
            Some(_) => Some(
                PeerServer::start(
                    PeerServerConfig {
                        listen: config.peer_listen,
                        cluster_token: config.cluster_token.clone(),
                        ..PeerServerConfig::default()
                    },
                    service.clone(),
                )
                .await?,
            ),
            None => None,
        };
        let peer_address = peer_server.as_ref().map(|s| s.local_addr().to_string()).unwrap_or_default();
        let node = NodeRegistration::new(&config.node_id, &config.node_address)
            .with_peer_address(peer_address)
            .with_data_endpoint(data_endpoint.clone());
        let master_config = MasterClientConfig { cluster_token: config.cluster_token.clone(), ..config.master.clone() };
        let master = Arc::new(MasterClient::connect(&config.master_address, master_config, node, registry).await?);
        master.register().await?;
        master.start_heartbeat()?;
        // Remote writers' commits land here: wake the heartbeat so the master indexes them at once.
        let weak = Arc::downgrade(&master);
        service.set_change_hook(Some(Arc::new(move || {
            if let Some(m) = weak.upgrade() {
                m.flush();
            }
        })));
        tracing::info!(node = %config.node_id, medium = ?config.medium, data = %data_endpoint, "node started");
        Ok(Self {
            config,
            medium,
            engine,
            data_endpoint,
            master,
            peer_server: Mutex::new(peer_server),
            peers: Mutex::new(HashMap::new()),
            directory: PeerDirectory::new(),
            user_regions: Mutex::new(BTreeMap::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.config.node_id
    }

    /// The peer service address, when the node lends a medium.
    pub fn peer_address(&self) -> Option<SocketAddr> {
        self.peer_server.lock().as_ref().map(PeerServerHandle::local_addr)
    }

    /// The TCP data endpoint.
    pub fn data_endpoint(&self) -> &str {
        &self.data_endpoint
    }

    /// The master client (stats, cluster status).
    pub fn master(&self) -> &MasterClient {
        &self.master
    }

    /// The node's medium, if it lends one.
    pub fn medium(&self) -> Option<&Arc<dyn MediumBackend>> {
        self.medium.as_ref()
    }

    /// Registers caller memory for zero-copy puts and gets (and makes it reachable by peers).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes until
    /// [`deregister_memory`](Self::deregister_memory) returns or the client is closed.
    pub unsafe fn register_memory(&self, ptr: NonNull<u8>, len: u64) -> Result<(), PoolError> {
        // SAFETY: the caller guarantees validity until deregistration (this function's contract).
        let region = unsafe { LocalRegion::new(ptr, len, MemoryLocation::Host) };
        let r = self.engine.register_memory(region).map_err(|e| PoolError::Transfer(e.to_string()))?;
        self.user_regions.lock().insert(ptr.as_ptr() as usize, (len, r));
        Ok(())
    }

    /// Undoes [`register_memory`](Self::register_memory); unknown pointers are ignored.
    pub fn deregister_memory(&self, ptr: NonNull<u8>) {
        if let Some((_, r)) = self.user_regions.lock().remove(&(ptr.as_ptr() as usize)) {
            self.engine.deregister(&r);
        }
    }

    /// The ref for caller memory: the registered region covering it (zero copy), else an
    /// unregistered host ref (staged through the bounce pool when a peer is on the other side).
    fn caller_ref(&self, ptr: *const u8, len: usize) -> Option<(TransferRef, u64)> {
        let addr = ptr as usize;
        if let Some((base, (rlen, r))) = self.user_regions.lock().range(..=addr).next_back()
            && addr + len <= base + *rlen as usize
        {
            return Some((r.clone(), (addr - base) as u64));
        }
        let ptr = NonNull::new(ptr.cast_mut())?;
        // SAFETY: the caller's slice is borrowed for the whole batch call, which waits for every
        // transfer (and drains on every exit path) before returning.
        let region = unsafe { LocalRegion::new(ptr, len as u64, MemoryLocation::Host) };
        Some((TransferRef::local(region), 0))
    }

    async fn peer(&self, node: &str, peer: &str) -> Result<PeerClient, String> {
        if let Some((addr, client)) = self.peers.lock().get(node)
            && addr == peer
        {
            return Ok(client.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{peer}"))
            .map_err(|e| format!("bad peer address {peer}: {e}"))?
            .connect_timeout(self.config.rpc_timeout)
            .timeout(self.config.rpc_timeout)
            .tcp_nodelay(true);
        let channel = endpoint.connect().await.map_err(|e| format!("connecting to {node} at {peer}: {e}"))?;
        let mut client = UmbpPeerClient::new(channel).max_decoding_message_size(64 << 20);
        // First contact: cache every buffer the peer publishes.
        let info = client
            .get_peer_info(self.request(pb::GetPeerInfoRequest {}))
            .await
            .map_err(|e| format!("GetPeerInfo from {node}: {}", e.message()))?
            .into_inner();
        let descs: Vec<_> = info.buffer_descs.iter().filter_map(|d| desc_from_wire(d).ok()).collect();
        self.directory.forget(node);
        self.directory.cache_remote_buffers(node, &descs);
        self.peers.lock().insert(node.to_owned(), (peer.to_owned(), client.clone()));
        Ok(client)
    }

    fn forget_peer(&self, node: &str) {
        self.peers.lock().remove(node);
        self.directory.forget(node);
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(message);
        r.set_timeout(self.config.rpc_timeout);
        if let Some(token) = &self.config.cluster_token
            && let Ok(v) = token.parse()
        {
            r.metadata_mut().insert(crate::master_client::TOKEN_METADATA, v);
        }
        r
    }

    /// Writes `key` (a batch of one).
    pub async fn put(&self, key: &str, value: &[u8]) -> Result<(), KeyError> {
        self.batch_put(&[(key, value)]).await.pop().unwrap_or(Err(KeyError::Failed("empty result".into())))
    }

    /// Writes every `(key, value)`; one result per item, in order. A key the pool already holds counts
    /// as written.
    pub async fn batch_put(&self, items: &[(&str, &[u8])]) -> Vec<Result<(), KeyError>> {
        let mut results: Vec<Option<Result<(), KeyError>>> = vec![None; items.len()];
        for (i, (key, value)) in items.iter().enumerate() {
            if key.is_empty() {
                results[i] = Some(Err(KeyError::EmptyKey));
            } else if value.is_empty() {
                results[i] = Some(Err(KeyError::EmptyValue));
            }
        }
        let mut exclude: Vec<String> = Vec::new();
        let mut last_error: HashMap<usize, KeyError> = HashMap::new();
        for _attempt in 0..=self.config.max_reroutes {
            let pending: Vec<usize> = (0..items.len()).filter(|i| results[*i].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let keys: Vec<String> = pending.iter().map(|i| items[*i].0.to_owned()).collect();
            let sizes: Vec<u64> = pending.iter().map(|i| items[*i].1.len() as u64).collect();
            let decisions = match self.master.batch_route_put(&keys, &sizes, &exclude).await {
                Ok(d) => d,
                Err(e) => {
                    for i in &pending {
                        results[*i] = Some(Err(KeyError::Failed(format!("routing: {e}"))));
                    }
                    break;
                }
            };
            let mut groups: BTreeMap<(String, String, TierType), Vec<usize>> = BTreeMap::new();
            for (i, d) in pending.iter().zip(decisions) {
                match d {
                    RoutePutDecision::AlreadyExists => results[*i] = Some(Ok(())),
                    RoutePutDecision::Unavailable => {
                        let e = last_error.remove(i).unwrap_or(KeyError::NoSpace { size: items[*i].1.len() as u64 });
                        results[*i] = Some(Err(e));
                    }
                    RoutePutDecision::Routed { node_id, peer_address, tier } => {
                        groups.entry((node_id, peer_address, tier)).or_default().push(*i)
                    }
                }
            }
            let outcome = self.put_round(items, groups).await;
            for (i, r) in outcome.done {
                results[i] = Some(r);
            }
            for (i, e) in outcome.retry {
                last_error.insert(i, e);
            }
            exclude.extend(outcome.exclude);
            exclude.sort();
            exclude.dedup();
        }
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                r.unwrap_or_else(|| {
                    Err(last_error.remove(&i).unwrap_or(KeyError::Failed("re-routes exhausted".into())))
                })
            })
            .collect()
    }

    async fn put_round(
        &self,
        items: &[(&str, &[u8])],
        groups: BTreeMap<(String, String, TierType), Vec<usize>>,
    ) -> RoundOutcome<()> {
        let mut out = RoundOutcome::default();
        let mut transfers: Vec<TransferItem> = Vec::new();
        // Per group: what to commit (or abort) once the bytes landed.
        let mut commits: Vec<(Target, Vec<PutSlot>)> = Vec::new();
        for ((node, peer, tier), indexes) in groups {
            let target = if node == self.config.node_id {
                Target::Local
            } else {
                Target::Remote { node: node.clone(), peer: peer.clone() }
            };
            let allocated = match &target {
                Target::Local => self.allocate_local(items, &indexes),
                Target::Remote { node, peer } => self.allocate_remote(items, &indexes, node, peer, tier).await,
            };
            let allocated = match allocated {
                Ok(a) => a,
                Err(message) => {
                    // The peer failed as a whole: re-route its keys elsewhere.
                    for i in &indexes {
                        out.retry.push((*i, KeyError::Failed(message.clone())));
                    }
                    out.exclude.push(node.clone());
                    if let Target::Remote { node, .. } = &target {
                        self.forget_peer(node);
                    }
                    continue;
                }
            };
            let mut slots = Vec::new();
            for (i, a) in indexes.iter().zip(allocated) {
                match a {
                    Alloc::Exists => out.done.push((*i, Ok(()))),
                    Alloc::NoSpace => {
                        out.retry.push((*i, KeyError::NoSpace { size: items[*i].1.len() as u64 }));
                        out.exclude.push(node.clone());
                    }
                    Alloc::Failed(e) => out.done.push((*i, Err(e))),
                    Alloc::Slot { slot_id, pages, refs, page_size } => {
                        let value = items[*i].1;
                        let Some((src, src_base)) = self.caller_ref(value.as_ptr(), value.len()) else {
                            out.done.push((*i, Err(KeyError::Failed("unaddressable buffer".into()))));
                            continue;
                        };
                        match page_items(&src, src_base, value.len() as u64, &pages, &refs, page_size, *i as u64, true)
                        {
                            Ok(page_items) => {
                                transfers.extend(page_items);
                                slots.push(PutSlot { index: *i, slot_id });
                            }
                            Err(e) => {
                                out.done.push((*i, Err(KeyError::Failed(e))));
                                slots.push(PutSlot { index: *i, slot_id });
                                out.abort_only.push(*i);
                            }
                        }
                    }
                }
            }
            commits.push((target, slots));
        }
        // Submit every group's transfers at once, then wait (the local copies complete in submit).
        let failed = self.run_transfers(&transfers);
        for (target, slots) in commits {
            let (ok, bad): (Vec<&PutSlot>, Vec<&PutSlot>) =
                slots.iter().partition(|s| !failed.contains(&(s.index as u64)) && !out.abort_only.contains(&s.index));
            for s in &bad {
                if !out.abort_only.contains(&s.index) {
                    out.retry.push((s.index, KeyError::Failed("transfer failed".into())));
                }
            }
            let keys: Vec<(u64, String)> = ok.iter().map(|s| (s.slot_id, items[s.index].0.to_owned())).collect();
            let aborts: Vec<u64> = bad.iter().map(|s| s.slot_id).collect();
            match target {
                Target::Local => {
                    if let Some(m) = &self.medium {
                        let reqs: Vec<CommitRequest> =
                            keys.iter().map(|(id, k)| CommitRequest::new(*id, k.clone())).collect();
                        let results = m.batch_commit(&reqs);
                        if results.iter().any(|r| r.success) {
                            // Local writes become visible to other nodes as soon as the master hears.
                            self.master.flush();
                        }
                        for (s, r) in ok.iter().zip(results) {
                            out.done.push((
                                s.index,
                                if r.success { Ok(()) } else { Err(KeyError::Failed("commit refused".into())) },
                            ));
                        }
                        m.batch_abort(&aborts);
                    }
                }
                Target::Remote { node, peer } => {
                    let Ok(mut client) = self.peer(&node, &peer).await else {
                        for s in &ok {
                            out.retry.push((s.index, KeyError::Failed(format!("{node} unreachable at commit"))));
                        }
                        out.exclude.push(node);
                        continue;
                    };
                    let entries =
                        keys.iter().map(|(id, k)| pb::CommitSlotRequest { slot_id: *id, key: k.clone() }).collect();
                    match client.batch_commit_slots(self.request(pb::BatchCommitSlotsRequest { entries })).await {
                        Ok(reply) => {
                            let reply = reply.into_inner().entries;
                            for (n, s) in ok.iter().enumerate() {
                                let good = reply.get(n).is_some_and(|r| r.success);
                                out.done.push((
                                    s.index,
                                    if good {
                                        Ok(())
                                    } else {
                                        Err(KeyError::Failed(format!("{node} refused the commit")))
                                    },
                                ));
                            }
                        }
                        Err(e) => {
                            for s in &ok {
                                out.retry
                                    .push((s.index, KeyError::Failed(format!("commit on {node}: {}", e.message()))));
                            }
                            out.exclude.push(node.clone());
                        }
                    }
                    if !aborts.is_empty() {
                        // Best effort: a missed abort is reaped by the slot TTL.
                        let _ = client
                            .batch_abort_slots(self.request(pb::BatchAbortSlotsRequest { slot_ids: aborts }))
                            .await;
                    }
                }
            }
        }
        out
    }

    fn allocate_local(&self, items: &[(&str, &[u8])], indexes: &[usize]) -> Result<Vec<Alloc>, String> {
        let Some(m) = &self.medium else { return Err("this node lends no medium".into()) };
        let reqs: Vec<AllocateRequest> =
            indexes.iter().map(|i| AllocateRequest::new(items[*i].0, items[*i].1.len() as u64)).collect();
        let refs: Vec<Option<TransferRef>> = (0..m.buffer_count()).map(|b| m.buffer_ref(b)).collect();
        Ok(m.batch_allocate(&reqs)
            .into_iter()
            .map(|a| match a.outcome {
                AllocateOutcome::Allocated => {
                    Alloc::Slot { slot_id: a.slot_id, pages: a.pages, refs: refs.clone(), page_size: a.page_size }
                }
                AllocateOutcome::AlreadyExists => Alloc::Exists,
                AllocateOutcome::FailedNoSpace => Alloc::NoSpace,
                AllocateOutcome::Failed => {
                    Alloc::Failed(KeyError::Refused("the local medium refused the value".into()))
                }
            })
            .collect())
    }

    async fn allocate_remote(
        &self,
        items: &[(&str, &[u8])],
        indexes: &[usize],
        node: &str,
        peer: &str,
        tier: TierType,
    ) -> Result<Vec<Alloc>, String> {
        let mut client = self.peer(node, peer).await?;
        // The tier the master routed to: the peer service dispatches on it.
        let entries: Vec<pb::AllocateSlotRequest> = indexes
            .iter()
            .map(|i| pb::AllocateSlotRequest {
                size: items[*i].1.len() as u64,
                tier: tier_to_wire(tier),
                key: items[*i].0.to_owned(),
            })
            .collect();
        let reply = client
            .batch_allocate_slots(self.request(pb::BatchAllocateSlotsRequest { entries }))
            .await
            .map_err(|e| format!("allocate on {node}: {}", e.message()))?
            .into_inner();
        if reply.entries.len() != indexes.len() {
            return Err(format!("{node} answered {} of {} allocations", reply.entries.len(), indexes.len()));
        }
        let descs: Vec<_> =
            reply.entries.iter().flat_map(|e| e.descs.iter()).filter_map(|d| desc_from_wire(d).ok()).collect();
        self.directory.cache_remote_buffers(node, &descs);
        let mut shelves: HashMap<u32, Vec<Option<TransferRef>>> = HashMap::new();
        Ok(reply
            .entries
            .into_iter()
            .map(|e| match outcome_from_wire(e.outcome) {
                AllocateOutcome::Allocated => {
                    let refs = shelves
                        .entry(e.backend_id)
                        .or_insert_with(|| self.directory.remote_buffer_snapshot(node, e.backend_id))
                        .clone();
                    Alloc::Slot {
                        slot_id: e.slot_id,
                        pages: e.pages.iter().map(page_from_wire).collect(),
                        refs,
                        page_size: e.page_size,
                    }
                }
                AllocateOutcome::AlreadyExists => Alloc::Exists,
                AllocateOutcome::FailedNoSpace => Alloc::NoSpace,
                AllocateOutcome::Failed => Alloc::Failed(KeyError::Refused(format!("{node} refused the value"))),
            })
            .collect())
    }

    /// Plans, submits and waits for `items`; returns the failed tags.
    fn run_transfers(&self, items: &[TransferItem]) -> Vec<u64> {
        if items.is_empty() {
            return Vec::new();
        }
        let engine = Arc::clone(&self.engine);
        let run = move || match umbp_transfer::transfer(engine.as_ref(), items) {
            Ok(()) => Vec::new(),
            Err(failures) => {
                for f in &failures {
                    tracing::debug!(kind = ?f.kind, endpoint = %f.endpoint, message = %f.message, "transfer failure");
                }
                failed_tags(&failures)
            }
        };
        // The TCP engine's wait blocks: keep it off the reactor's scheduling loop.
        tokio::task::block_in_place(run)
    }

    /// Reads `key` into `buf`; returns the value's size.
    pub async fn get(&self, key: &str, buf: &mut [u8]) -> Result<u64, KeyError> {
        let mut bufs = [buf];
        self.batch_get(&[key], &mut bufs).await.pop().unwrap_or(Err(KeyError::Failed("empty result".into())))
    }

    /// Reads every key into its buffer; one result per key (the value's size), in order. A buffer
    /// shorter than the value is an error for that key; a longer one is filled up to the size.
    pub async fn batch_get(&self, keys: &[&str], bufs: &mut [&mut [u8]]) -> Vec<Result<u64, KeyError>> {
        let n = keys.len().min(bufs.len());
        let mut results: Vec<Option<Result<u64, KeyError>>> = vec![None; keys.len()];
        for (i, k) in keys.iter().enumerate() {
            if k.is_empty() {
                results[i] = Some(Err(KeyError::EmptyKey));
            } else if i >= n {
                results[i] = Some(Err(KeyError::Failed("no buffer for this key".into())));
            }
        }
        // Pointers to the caller's buffers, valid for this call (we wait for every transfer).
        let targets: Vec<(usize, usize)> = bufs.iter_mut().map(|b| (b.as_mut_ptr() as usize, b.len())).collect();
        let mut exclude: Vec<String> = Vec::new();
        let mut last_error: HashMap<usize, KeyError> = HashMap::new();
        let mut fetched_remote: Vec<usize> = Vec::new();
        for _attempt in 0..=self.config.max_reroutes {
            let pending: Vec<usize> = (0..keys.len()).filter(|i| results[*i].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let route_keys: Vec<String> = pending.iter().map(|i| keys[*i].to_owned()).collect();
            let hits = match self.master.batch_route_get(&route_keys, &exclude).await {
                Ok(h) => h,
                Err(e) => {
                    for i in &pending {
                        results[*i] = Some(Err(KeyError::Failed(format!("routing: {e}"))));
                    }
                    break;
                }
            };
            let mut local: Vec<usize> = Vec::new();
            let mut groups: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
            for (i, hit) in pending.iter().zip(hits) {
                match hit {
                    // Not indexed (yet): the key may have been written here before the master heard.
                    None if exclude.iter().any(|e| e == &self.config.node_id) => {
                        results[*i] = Some(Err(last_error.remove(i).unwrap_or(KeyError::Miss)))
                    }
                    None => local.push(*i),
                    Some(h) if h.node_id == self.config.node_id => local.push(*i),
                    Some(h) => groups.entry((h.node_id, h.peer_address)).or_default().push(*i),
                }
            }
            let mut transfers = Vec::new();
            let mut sizes: HashMap<usize, u64> = HashMap::new();
            let mut group_of: HashMap<usize, String> = HashMap::new();
            for ((node, peer), indexes) in groups {
                match self.resolve_remote(keys, &indexes, &node, &peer).await {
                    Err(message) => {
                        for i in &indexes {
                            last_error.insert(*i, KeyError::Failed(message.clone()));
                        }
                        exclude.push(node.clone());
                        self.forget_peer(&node);
                    }
                    Ok(found) => {
                        for (i, f) in indexes.iter().zip(found) {
                            match f {
                                None => {
                                    // A stale route: re-route without this node.
                                    last_error.insert(*i, KeyError::Miss);
                                    exclude.push(node.clone());
                                }
                                Some((size, pages, refs, page_size)) => {
                                    self.plan_get(
                                        *i,
                                        size,
                                        &pages,
                                        &refs,
                                        page_size,
                                        targets[*i],
                                        &mut transfers,
                                        &mut results,
                                        &mut sizes,
                                    );
                                    group_of.insert(*i, node.clone());
                                }
                            }
                        }
                    }
                }
            }
            if let Some(m) = &self.medium {
                let local_keys: Vec<String> = local.iter().map(|i| keys[*i].to_owned()).collect();
                let refs: Vec<Option<TransferRef>> = (0..m.buffer_count()).map(|b| m.buffer_ref(b)).collect();
                let resolved = if local_keys.is_empty() { Vec::new() } else { m.batch_resolve(&local_keys, false) };
                for (i, r) in local.iter().zip(resolved) {
                    if r.found {
                        self.plan_get(
                            *i,
                            r.size,
                            &r.pages,
                            &refs,
                            r.page_size,
                            targets[*i],
                            &mut transfers,
                            &mut results,
                            &mut sizes,
                        );
                    } else {
                        last_error.insert(*i, KeyError::Miss);
                    }
                }
            } else {
                for i in &local {
                    last_error.insert(*i, KeyError::Miss);
                }
            }
            exclude.push(self.config.node_id.clone());
            let failed = self.run_transfers(&transfers);
            for (i, size) in sizes {
                if results[i].is_some() {
                    continue;
                }
                if failed.contains(&(i as u64)) {
                    last_error.insert(i, KeyError::Failed("transfer failed".into()));
                    if let Some(node) = group_of.get(&i) {
                        exclude.push(node.clone());
                        self.forget_peer(node);
                    }
                } else {
                    results[i] = Some(Ok(size));
                    if group_of.contains_key(&i) {
                        fetched_remote.push(i);
                    }
                }
            }
            exclude.sort();
            exclude.dedup();
        }
        self.recache(keys, bufs, &results, &fetched_remote);
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.unwrap_or_else(|| Err(last_error.remove(&i).unwrap_or(KeyError::Miss))))
            .collect()
    }

    #[expect(clippy::too_many_arguments, reason = "one call site; the pieces of one key's read plan")]
    fn plan_get(
        &self,
        i: usize,
        size: u64,
        pages: &[PageLocation],
        refs: &[Option<TransferRef>],
        page_size: u64,
        target: (usize, usize),
        transfers: &mut Vec<TransferItem>,
        results: &mut [Option<Result<u64, KeyError>>],
        sizes: &mut HashMap<usize, u64>,
    ) {
        let (ptr, len) = target;
        if (len as u64) < size {
            results[i] = Some(Err(KeyError::BufferTooSmall { needed: size, got: len as u64 }));
            return;
        }
        let Some((dst, dst_base)) = self.caller_ref(ptr as *const u8, size as usize) else {
            results[i] = Some(Err(KeyError::Failed("unaddressable buffer".into())));
            return;
        };
        match page_items(&dst, dst_base, size, pages, refs, page_size, i as u64, false) {
            Ok(items) => {
                transfers.extend(items);
                sizes.insert(i, size);
            }
            Err(e) => results[i] = Some(Err(KeyError::Failed(e))),
        }
    }

    async fn resolve_remote(
        &self,
        keys: &[&str],
        indexes: &[usize],
        node: &str,
        peer: &str,
    ) -> Result<Vec<Option<Located>>, String> {
        let mut client = self.peer(node, peer).await?;
        let omit_descs = self.directory.has_remote_buffers(node);
        let request =
            pb::BatchResolveKeysRequest { keys: indexes.iter().map(|i| keys[*i].to_owned()).collect(), omit_descs };
        let reply = client
            .batch_resolve_keys(self.request(request))
            .await
            .map_err(|e| format!("resolve on {node}: {}", e.message()))?
            .into_inner();
        let decoded = decode_batch_resolve(&reply).map_err(|e| format!("malformed resolve reply from {node}: {e}"))?;
        if decoded.keys.len() != indexes.len() {
            return Err(format!("{node} answered {} of {} keys", decoded.keys.len(), indexes.len()));
        }
        self.directory.cache_remote_buffers(node, &decoded.descs);
        let mut shelves: HashMap<u32, Vec<Option<TransferRef>>> = HashMap::new();
        Ok(decoded
            .keys
            .into_iter()
            .map(|k| {
                k.map(|k| {
                    let refs = shelves
                        .entry(k.backend_id)
                        .or_insert_with(|| self.directory.remote_buffer_snapshot(node, k.backend_id))
                        .clone();
                    (k.size, k.pages, refs, decoded.page_size)
                })
            })
            .collect())
    }

    /// Writes remotely fetched values to the local medium when the admission policy allows.
    fn recache(&self, keys: &[&str], bufs: &[&mut [u8]], results: &[Option<Result<u64, KeyError>>], fetched: &[usize]) {
        let Some(m) = &self.medium else { return };
        let admit = |size: u64| match self.config.recache {
            RecachePolicy::Off => false,
            RecachePolicy::UpTo(cap) => size <= cap,
            RecachePolicy::Always => true,
        };
        let picked: Vec<(usize, u64)> = fetched
            .iter()
            .filter_map(|i| match results.get(*i) {
                Some(Some(Ok(size))) if admit(*size) => Some((*i, *size)),
                _ => None,
            })
            .collect();
        if picked.is_empty() {
            return;
        }
        let reqs: Vec<AllocateRequest> = picked.iter().map(|(i, size)| AllocateRequest::new(keys[*i], *size)).collect();
        let refs: Vec<Option<TransferRef>> = (0..m.buffer_count()).map(|b| m.buffer_ref(b)).collect();
        let mut items = Vec::new();
        let mut slots = Vec::new();
        for ((i, size), a) in picked.iter().zip(m.batch_allocate(&reqs)) {
            if a.outcome != AllocateOutcome::Allocated {
                continue; // NoSpace or already here: re-caching is best effort.
            }
            let buf = &bufs[*i];
            let Some((src, base)) = self.caller_ref(buf.as_ptr(), *size as usize) else { continue };
            match page_items(&src, base, *size, &a.pages, &refs, a.page_size, *i as u64, true) {
                Ok(p) => {
                    items.extend(p);
                    slots.push((*i, a.slot_id));
                }
                Err(_) => {
                    m.batch_abort(&[a.slot_id]);
                }
            }
        }
        let failed = self.run_transfers(&items);
        let (ok, bad): (Vec<_>, Vec<_>) = slots.into_iter().partition(|(i, _)| !failed.contains(&(*i as u64)));
        m.batch_commit(&ok.iter().map(|(i, id)| CommitRequest::new(*id, keys[*i])).collect::<Vec<_>>());
        m.batch_abort(&bad.iter().map(|(_, id)| *id).collect::<Vec<_>>());
    }

    /// Whether the pool holds `key`.
    pub async fn exists(&self, key: &str) -> Result<bool, KeyError> {
        self.batch_exists(&[key]).await.map(|v| v.first().copied().unwrap_or(false))
    }

    /// Whether the pool holds each key (the master's index, or this node's medium for keys written
    /// here that the master has not heard of yet).
    pub async fn batch_exists(&self, keys: &[&str]) -> Result<Vec<bool>, KeyError> {
        let owned: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let mut found = self.master.batch_lookup(&owned).await.map_err(|e| KeyError::Failed(format!("lookup: {e}")))?;
        if let Some(m) = &self.medium {
            let owned_here: std::collections::HashSet<String> =
                m.snapshot_owned_keys().into_iter().map(|e| e.key).collect();
            for (f, k) in found.iter_mut().zip(keys) {
                *f = *f || owned_here.contains(*k);
            }
        }
        Ok(found)
    }

    /// Drops every replica of each key the pool knows of; returns the bytes freed per key (0 for a
    /// key no node held or that a reader's lease protected right now).
    pub async fn remove(&self, keys: &[&str]) -> Result<Vec<u64>, KeyError> {
        let owned: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let mut freed = vec![0u64; keys.len()];
        if let Some(m) = &self.medium {
            for (f, r) in freed.iter_mut().zip(m.evict(&owned)) {
                *f += r.bytes_freed;
            }
        }
        let status =
            self.master.cluster_status().await.map_err(|e| KeyError::Failed(format!("cluster status: {e}")))?;
        for node in status.nodes {
            if node.node_id == self.config.node_id || node.peer_address.is_empty() {
                continue;
            }
            let Ok(mut client) = self.peer(&node.node_id, &node.peer_address).await else { continue };
            if let Ok(reply) = client.evict_key(self.request(pb::EvictKeyRequest { keys: owned.clone() })).await {
                for (f, e) in freed.iter_mut().zip(reply.into_inner().evicted) {
                    *f += e.bytes_freed;
                }
            }
        }
        self.master.flush();
        Ok(freed)
    }

    /// Clears this node's medium (and tells the master); writes reopen once the master acknowledges.
    pub async fn clear(&self) -> Result<(), PoolError> {
        Ok(self.master.clear().await?)
    }

    /// Sends queued ownership changes to the master now.
    pub fn flush(&self) {
        self.master.flush();
    }

    /// Leaves the cluster: stops the heartbeat and unregisters, stops the peer service, then shuts the
    /// medium down (deregistering before releasing its memory). Idempotent.
    pub async fn close(&self) {
        if self.closed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        if let Err(e) = self.master.shutdown().await {
            tracing::warn!(error = %e, "unregister did not land; the master will expire this node");
        }
        let server = self.peer_server.lock().take();
        if let Some(server) = server {
            server.shutdown().await;
        }
        self.peers.lock().clear();
        if let Some(m) = &self.medium {
            m.shutdown();
        }
        let regions: Vec<TransferRef> =
            std::mem::take(&mut *self.user_regions.lock()).into_values().map(|(_, r)| r).collect();
        for r in regions {
            self.engine.deregister(&r);
        }
    }
}

/// What allocating one key on a node produced.
enum Alloc {
    Slot { slot_id: u64, pages: Vec<PageLocation>, refs: Vec<Option<TransferRef>>, page_size: u64 },
    Exists,
    NoSpace,
    Failed(KeyError),
}

/// What one round of a batch decided.
struct RoundOutcome<T> {
    done: Vec<(usize, Result<T, KeyError>)>,
    retry: Vec<(usize, KeyError)>,
    exclude: Vec<String>,
    abort_only: Vec<usize>,
}

impl<T> Default for RoundOutcome<T> {
    fn default() -> Self {
        Self { done: Vec::new(), retry: Vec::new(), exclude: Vec::new(), abort_only: Vec::new() }
    }
}

/// One transfer item per page between the caller's memory (`user`, from `user_base`) and the
/// medium's pages. `to_medium` is a put.
#[expect(clippy::too_many_arguments, reason = "the pieces of one key's page layout")]
fn page_items(
    user: &TransferRef,
    user_base: u64,
    size: u64,
    pages: &[PageLocation],
    refs: &[Option<TransferRef>],
    page_size: u64,
    tag: u64,
    to_medium: bool,
) -> Result<Vec<TransferItem>, String> {
    if page_size == 0 || pages.len() as u64 != size.div_ceil(page_size) {
        return Err(format!("{} pages of {page_size} bytes cannot hold {size} bytes", pages.len()));
    }
    let mut items = Vec::with_capacity(pages.len());
    for (p, page) in pages.iter().enumerate() {
        let offset = p as u64 * page_size;
        let len = page_size.min(size - offset);
        let Some(Some(medium_ref)) = refs.get(page.buffer_index as usize) else {
            return Err(format!("no descriptor for buffer {}", page.buffer_index));
        };
        let medium_offset = u64::from(page.page_index) * page_size;
        let (src, src_offset, dst, dst_offset) = if to_medium {
            (user.clone(), user_base + offset, medium_ref.clone(), medium_offset)
        } else {
            (medium_ref.clone(), medium_offset, user.clone(), user_base + offset)
        };
        items.push(TransferItem { src, src_offset, dst, dst_offset, size: len, tag });
    }
    Ok(items)
}
