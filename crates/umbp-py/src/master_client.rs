//! `UMBPMasterClient`: the master's control plane from Python, for schedulers and sidecars (issue 21,
//! item 2) — register a node, report and revoke the KV blocks it holds outside the pool (an engine's
//! GPU HBM or pinned host memory), and match a prompt's block hashes to the nodes that hold them.
//! The reference's class of the same name (ROCm/mori `docs/api/umbp.rst`), over
//! `umbp_peer::master_client::MasterClient::connect_light`: no medium, no heartbeat thread.
//!
//! ```python
//! from umbp._umbp import UMBPMasterClient
//! a = UMBPMasterClient("127.0.0.1:50051", node_id="engine-a")
//! a.register_self()
//! a.report_external_kv_blocks("engine-a", ["h0", "h1"], 1)          # 1 = HBM
//! [m] = UMBPMasterClient("127.0.0.1:50051").match_external_kv(["h0", "h1", "h2"])
//! assert m.node_id == "engine-a" and m.matched_hash_count() == 2
//! ```
//!
//! Hashes are `str` (SGLang's hex digests) or `int` (sent as its decimal string, so `h` and `str(h)`
//! name the same block); tiers are ints or `UMBPTierType` members (an `IntEnum`: 1 HBM, 2 DRAM,
//! 3 SSD) or their names. `hashes_by_tier` is keyed by the tier's int, which a `UMBPTierType` key
//! finds. Errors raise the module's exceptions by kind (`InvalidInputError` for bad input or an
//! `INVALID_ARGUMENT` from the master, `UnavailableError` for a master that cannot be reached).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyString};
use umbp_core::TierType;
use umbp_peer::master_client::{
    ExternalKvNodeMatch, MasterClient, MasterClientConfig, MasterClientError, NodeRegistration,
};

use crate::errors::{self, INVALID_INPUT};
use crate::runtime;

fn master_error(context: &str, e: &MasterClientError) -> PyErr {
    errors::exception(errors::kind_code(e.kind()), format!("{context}: {e}"))
}

fn invalid(message: impl Into<String>) -> PyErr {
    errors::exception(INVALID_INPUT, message.into())
}

/// The hashes as strings: a `str` as is, an `int` as its decimal digits.
pub(crate) fn hashes_of(hashes: &[Bound<'_, PyAny>]) -> PyResult<Vec<String>> {
    hashes
        .iter()
        .map(|h| {
            if h.is_instance_of::<PyString>() {
                h.extract::<String>()
            } else if h.is_instance_of::<PyInt>() && !h.is_instance_of::<PyBool>() {
                h.str()?.extract::<String>()
            } else {
                Err(invalid(format!("a hash must be a str or an int, not {}", h.get_type().name()?)))
            }
        })
        .collect()
}

/// A tier from an int, a `UMBPTierType` member or a name (`"HBM"`, `"dram"`, …).
pub(crate) fn tier_of(tier: &Bound<'_, PyAny>) -> PyResult<TierType> {
    let parsed = if let Ok(n) = tier.extract::<u32>() {
        TierType::from_wire(n)
    } else if let Ok(name) = tier.extract::<String>() {
        TierType::ALL.into_iter().find(|t| t.as_str().eq_ignore_ascii_case(&name)).unwrap_or(TierType::Unknown)
    } else {
        TierType::Unknown
    };
    if parsed == TierType::Unknown {
        return Err(invalid(format!("tier {tier} is not HBM (1), DRAM (2) or SSD (3)")));
    }
    Ok(parsed)
}

impl From<ExternalKvNodeMatch> for NodeMatch {
    fn from(m: ExternalKvNodeMatch) -> Self {
        Self { node_id: m.node_id, peer_address: m.peer_address, tiers: m.hashes_by_tier }
    }
}

/// One node that holds some of the hashes a `match_external_kv` asked for.
#[pyclass(frozen, module = "umbp._umbp", name = "UMBPExternalKvNodeMatch")]
pub(crate) struct NodeMatch {
    /// The holding node.
    #[pyo3(get)]
    node_id: String,
    /// Its peer-service address as registered (empty for a node that registered none).
    #[pyo3(get)]
    peer_address: String,
    tiers: Vec<(TierType, Vec<String>)>,
}

#[pymethods]
impl NodeMatch {
    /// `{tier: [hash, …]}`, fastest tier first, hashes in request order; a hash held on two tiers is
    /// in both buckets.
    #[getter]
    fn hashes_by_tier<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (tier, hashes) in &self.tiers {
            out.set_item(tier.wire(), hashes.clone())?;
        }
        Ok(out)
    }

    /// Distinct hashes matched on this node (a hash on two tiers counts once).
    fn matched_hash_count(&self) -> usize {
        ExternalKvNodeMatch { node_id: String::new(), peer_address: String::new(), hashes_by_tier: self.tiers.clone() }
            .matched_hash_count()
    }

    fn __repr__(&self) -> String {
        let tiers: Vec<String> = self.tiers.iter().map(|(t, h)| format!("{}: {}", t.as_str(), h.len())).collect();
        format!("UMBPExternalKvNodeMatch(node_id={:?}, tiers={{{}}})", self.node_id, tiers.join(", "))
    }
}

/// How often counted matches found one hash.
#[pyclass(frozen, module = "umbp._umbp", name = "UMBPExternalKvHitCountEntry")]
pub(crate) struct HitCountEntry {
    /// The hash.
    #[pyo3(get)]
    hash: String,
    /// Counted matches that found it while some node held it.
    #[pyo3(get)]
    hit_count_total: u64,
}

#[pymethods]
impl HitCountEntry {
    fn __repr__(&self) -> String {
        format!("UMBPExternalKvHitCountEntry(hash={:?}, hit_count_total={})", self.hash, self.hit_count_total)
    }
}

/// A lightweight client of the master's control plane: no medium, no heartbeat thread.
#[pyclass(frozen, module = "umbp._umbp", name = "UMBPMasterClient")]
pub(crate) struct PyMasterClient {
    client: std::sync::Arc<MasterClient>,
    registered: AtomicBool,
}

impl PyMasterClient {
    /// Runs `f` on the module's runtime with the GIL released.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        context: &str,
        f: impl AsyncFnOnce(&MasterClient) -> Result<T, MasterClientError> + Send,
    ) -> PyResult<T> {
        let rt = runtime()?;
        let client = std::sync::Arc::clone(&self.client);
        py.detach(move || rt.block_on(async move { f(&client).await })).map_err(|e| master_error(context, &e))
    }
}

#[pymethods]
impl PyMasterClient {
    /// Connects to the master at `master_address` (`host:port`, several comma-separated). Without
    /// a `node_id` the client gets one of its own (`umbp-master-client-<pid>-<n>`) and can match,
    /// count and report for other nodes, but not register.
    #[new]
    #[pyo3(signature = (master_address, node_id = String::new(), node_address = String::new()))]
    fn new(py: Python<'_>, master_address: String, node_id: String, node_address: String) -> PyResult<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let node_id = if node_id.is_empty() {
            format!("umbp-master-client-{}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
        } else {
            node_id
        };
        let config = MasterClientConfig { rpc_timeout: Duration::from_secs(10), ..MasterClientConfig::default() };
        let node = NodeRegistration::new(node_id, node_address);
        let rt = runtime()?;
        let client = py
            .detach(move || rt.block_on(MasterClient::connect_light(&master_address, config, node)))
            .map_err(|e| master_error("connecting to the master", &e))?;
        Ok(Self { client: std::sync::Arc::new(client), registered: AtomicBool::new(false) })
    }

    /// This client's node id.
    #[getter]
    fn node_id(&self) -> String {
        self.client.node().node_id.clone()
    }

    /// Registers this node with the master (as a node that lends no pool medium), so reports under
    /// its id are recorded. `tier_capacities` (`{tier: (total, available)}`) is accepted for the
    /// reference's signature; the pool routes nothing to this node, so no capacity is recorded. This
    /// client sends no heartbeat: the master expires the record after its expiry (30 s by default)
    /// and drops the blocks reported under the id with it; a long-lived node reports through its own
    /// heartbeat instead (`PoolClient::report_external_kv_blocks`).
    #[pyo3(signature = (tier_capacities = None))]
    fn register_self(&self, py: Python<'_>, tier_capacities: Option<Bound<'_, PyAny>>) -> PyResult<()> {
        drop(tier_capacities);
        self.run(py, "registering", async |c| c.register().await)?;
        self.registered.store(true, Ordering::Release);
        Ok(())
    }

    /// Unregisters this node; the master drops its records. Raises `InvalidInputError` if it is not
    /// registered.
    fn unregister_self(&self, py: Python<'_>) -> PyResult<()> {
        if !self.registered.load(Ordering::Acquire) {
            return Err(invalid(format!("node {} is not registered", self.client.node().node_id)));
        }
        self.run(py, "unregistering", async |c| c.unregister().await)?;
        self.registered.store(false, Ordering::Release);
        Ok(())
    }

    /// Whether `register_self` succeeded and no `unregister_self` followed.
    fn is_registered(&self) -> bool {
        self.registered.load(Ordering::Acquire)
    }

    /// Records that `node_id` holds `hashes` at `tier` (additive). Returns whether the master
    /// recorded them: `False` when `node_id` is not a live registered node (the report is ignored).
    fn report_external_kv_blocks(
        &self,
        py: Python<'_>,
        node_id: String,
        hashes: Vec<Bound<'_, PyAny>>,
        tier: Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let (hashes, tier) = (hashes_of(&hashes)?, tier_of(&tier)?);
        self.run(py, "report_external_kv_blocks", async move |c| {
            c.report_external_kv_blocks(&node_id, &hashes, tier).await
        })
    }

    /// Drops `hashes` of `node_id` at `tier` (other tiers untouched; no liveness check).
    fn revoke_external_kv_blocks(
        &self,
        py: Python<'_>,
        node_id: String,
        hashes: Vec<Bound<'_, PyAny>>,
        tier: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (hashes, tier) = (hashes_of(&hashes)?, tier_of(&tier)?);
        self.run(py, "revoke_external_kv_blocks", async move |c| {
            c.revoke_external_kv_blocks(&node_id, &hashes, tier).await
        })
    }

    /// Drops every hash of `node_id` at `tier`.
    fn revoke_all_external_kv_blocks_at_tier(
        &self,
        py: Python<'_>,
        node_id: String,
        tier: Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let tier = tier_of(&tier)?;
        self.run(py, "revoke_all_external_kv_blocks_at_tier", async move |c| {
            c.revoke_all_external_kv_blocks_at_tier(&node_id, tier).await
        })
    }

    /// The nodes that hold any of `hashes`, sorted by node id (empty for no match or no hashes).
    /// `count_as_hit=True` belongs on the real request-routing path only: it counts each distinct
    /// matched hash once.
    #[pyo3(signature = (hashes, count_as_hit = false))]
    fn match_external_kv(
        &self,
        py: Python<'_>,
        hashes: Vec<Bound<'_, PyAny>>,
        count_as_hit: bool,
    ) -> PyResult<Vec<NodeMatch>> {
        let hashes = hashes_of(&hashes)?;
        let matches =
            self.run(py, "match_external_kv", async move |c| c.match_external_kv(&hashes, count_as_hit).await)?;
        Ok(matches
            .into_iter()
            .map(|m| NodeMatch { node_id: m.node_id, peer_address: m.peer_address, tiers: m.hashes_by_tier })
            .collect())
    }

    /// How often counted matches found each hash: one entry per distinct hash with a count (absent:
    /// never counted, or no node holds it any more), in request order.
    fn get_external_kv_hit_counts(
        &self,
        py: Python<'_>,
        hashes: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<HitCountEntry>> {
        let hashes = hashes_of(&hashes)?;
        let counts =
            self.run(py, "get_external_kv_hit_counts", async move |c| c.get_external_kv_hit_counts(&hashes).await)?;
        Ok(counts.into_iter().map(|(hash, hit_count_total)| HitCountEntry { hash, hit_count_total }).collect())
    }

    fn __repr__(&self) -> String {
        format!("UMBPMasterClient(master={:?}, node_id={:?})", self.client.current_master(), self.client.node().node_id)
    }
}
