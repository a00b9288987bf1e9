//! `Pool`: one node of a umbp pool in this process, the class every Python API is built on.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use umbp_core::MemoryLocation;
use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::pool_client::{
    KeyError, Medium, PoolClient, PoolClientConfig, RawParts, RecachePolicy, RuntimeSelection,
};

use crate::buffer::View;
use crate::errors::{self, INVALID_INPUT};
use crate::master_client;
use crate::medium::{self, MediumRequest};
use crate::memcheck::range_mapped;
use crate::runtime;

/// What a per-key call answers: a value (put: 1; get: the value's size)
/// or a failure `(kind, message)`.
type KeyResult = Result<u64, (u8, String)>;

/// The node and what the binding keeps beside it.
struct Inner {
    client: Arc<PoolClient>,
    /// The embedded master of a local pool.
    master: Mutex<Option<MasterHandle>>,
    closed: AtomicBool,
    /// Caller memory registered through this binding: base → length. Addresses inside are trusted
    /// (the caller vouched for them); others are checked with `mincore` before any copy.
    regions: Mutex<BTreeMap<usize, usize>>,
    distributed: bool,
    master_address: String,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        // Dropped with the GIL held (a Python object's dealloc): leave the pool in the background
        // rather than block the interpreter on the master's unregister.
        let client = Arc::clone(&self.client);
        let master = self.master.lock().take();
        if let Ok(rt) = runtime() {
            rt.spawn(async move {
                client.close().await;
                if let Some(m) = master {
                    m.shutdown().await;
                }
            });
        }
    }
}

/// One node of a umbp pool in this process.
///
/// `Pool.local(...)` starts an embedded master and one DRAM node (no other process needed);
/// `Pool.node(...)` joins a running master, lending DRAM or nothing. Every I/O call releases the GIL.
/// Batch calls answer per key: with `detail=False` a `list[bool]`, else a list whose items are an
/// `int` (put: 1, also when the key was already there; get: the value's size) or a
/// `(kind, message)` tuple (`KIND_*` codes).
#[pyclass(frozen, module = "umbp._umbp")]
pub(crate) struct Pool {
    inner: Arc<Inner>,
}

/// The address `host` (an IP or a name) resolves to.
fn resolve_ip(host: &str) -> PyResult<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    (host, 0)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .map(|a| a.ip())
        .ok_or_else(|| errors::InvalidInputError::new_err(format!("cannot resolve host {host:?}")))
}

fn check_batch(keys: &[String], ptrs: &[usize], sizes: &[usize]) -> PyResult<()> {
    if keys.len() != ptrs.len() || keys.len() != sizes.len() {
        return Err(errors::InvalidInputError::new_err(format!(
            "ragged batch: {} keys, {} pointers, {} sizes",
            keys.len(),
            ptrs.len(),
            sizes.len()
        )));
    }
    Ok(())
}

/// A key's ranges as Python gave them: `(address, length, value offset)`.
type AddrParts = Vec<(usize, usize, u64)>;

/// A key's ranges as the pool client takes them (a zero pointer only reaches it with its key
/// already failed by the memory check, or with length 0, which the client refuses).
fn raw_parts(list: &[(usize, usize, u64)]) -> RawParts {
    list.iter()
        .map(|(ptr, len, off)| (NonNull::new(*ptr as *mut u8).unwrap_or(NonNull::dangling()), *len, *off))
        .collect()
}

/// Checks a ranged batch's shape: one list of pointers, sizes and offsets per key (and one object
/// size per key for a put), each key's three lists of one length.
fn check_ranged_batch(
    keys: &[String],
    object_sizes: Option<&[u64]>,
    ptrs: &[Vec<usize>],
    sizes: &[Vec<usize>],
    offsets: &[Vec<u64>],
) -> PyResult<()> {
    let n = keys.len();
    if ptrs.len() != n || sizes.len() != n || offsets.len() != n || object_sizes.is_some_and(|s| s.len() != n) {
        return Err(errors::InvalidInputError::new_err(format!(
            "ragged batch: {n} keys, {} pointer lists, {} size lists, {} offset lists{}",
            ptrs.len(),
            sizes.len(),
            offsets.len(),
            object_sizes.map_or(String::new(), |s| format!(", {} object sizes", s.len()))
        )));
    }
    for (i, ((p, s), o)) in ptrs.iter().zip(sizes).zip(offsets).enumerate() {
        if p.len() != s.len() || p.len() != o.len() {
            return Err(errors::InvalidInputError::new_err(format!(
                "ragged ranges of key {i}: {} pointers, {} sizes, {} offsets",
                p.len(),
                s.len(),
                o.len()
            )));
        }
    }
    Ok(())
}

/// Pins one buffer view per key (`writable` for gets) and lists their addresses and lengths; a
/// key count that differs from the object count (`what`: "values", "buffers") is invalid input.
fn views_of(
    keys: &[String],
    objects: &[Bound<'_, PyAny>],
    writable: bool,
    what: &str,
) -> PyResult<(Vec<View>, Vec<usize>, Vec<usize>)> {
    if keys.len() != objects.len() {
        return Err(errors::InvalidInputError::new_err(format!("{} keys but {} {what}", keys.len(), objects.len())));
    }
    let views = objects.iter().map(|v| View::new(v, writable)).collect::<PyResult<Vec<_>>>()?;
    let ptrs = views.iter().map(View::ptr).collect();
    let sizes = views.iter().map(View::len).collect();
    Ok((views, ptrs, sizes))
}

/// The Python list of per-key results.
fn results_list<'py>(py: Python<'py>, results: &[KeyResult], detail: bool) -> PyResult<Bound<'py, PyList>> {
    if !detail {
        return PyList::new(py, results.iter().map(Result::is_ok));
    }
    let items: Vec<Bound<'py, PyAny>> = results
        .iter()
        .map(|r| match r {
            Ok(v) => Ok(v.into_pyobject(py)?.into_any()),
            Err((kind, msg)) => {
                Ok(PyTuple::new(py, [kind.into_pyobject(py)?.into_any(), msg.into_pyobject(py)?.into_any()])?
                    .into_any())
            }
        })
        .collect::<PyResult<_>>()?;
    PyList::new(py, items)
}

fn key_result<T>(r: Result<T, KeyError>, ok: impl FnOnce(T) -> u64) -> KeyResult {
    r.map(ok).map_err(|e| (errors::key_kind(&e), e.to_string()))
}

impl Pool {
    fn open(&self) -> PyResult<&Inner> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(errors::ClosedError::new_err("the pool client is closed"));
        }
        Ok(&self.inner)
    }

    /// Checks every `(ptr, len)` outside a registered region is mapped host memory: the failing
    /// ones get an error result, the others `None`. Device memory is asked about first (a pool with
    /// a GPU runtime): CUDA reserves its device addresses in the process's address space, so
    /// `mincore` alone would pass them and the CPU would fault copying.
    fn check_ranges(&self, ptrs: &[usize], sizes: &[usize]) -> Vec<Option<(u8, String)>> {
        let client = &self.inner.client;
        let on_device = |p: usize| {
            client.has_gpu_runtime()
                && NonNull::new(p as *mut u8).is_some_and(|ptr| !matches!(client.pointer_device(ptr), Ok(None)))
        };
        let regions = self.inner.regions.lock();
        ptrs.iter()
            .zip(sizes)
            .map(|(&p, &n)| {
                if n == 0 {
                    // The pool answers EmptyValue / buffer errors itself.
                    return if p == 0 { Some((INVALID_INPUT, "null pointer".to_owned())) } else { None };
                }
                let inside = regions
                    .range(..=p)
                    .next_back()
                    .is_some_and(|(b, l)| p.checked_add(n).is_some_and(|end| end <= b + l));
                if inside {
                    None
                } else if on_device(p) {
                    Some((INVALID_INPUT, format!("{n} bytes at {p:#x} are device memory: register_memory it first")))
                } else if range_mapped(p, n) {
                    None
                } else {
                    Some((INVALID_INPUT, format!("{n} bytes at {p:#x} are not mapped memory of this process")))
                }
            })
            .collect()
    }

    /// Puts `(key, ptr, len)` items, the GIL released; the caller keeps the memory alive.
    fn put_raw(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<KeyResult>> {
        let inner = self.open()?;
        let checks = self.check_ranges(&ptrs, &sizes);
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        Ok(py.detach(move || {
            let mut results: Vec<Option<KeyResult>> = checks.into_iter().map(|c| c.map(Err)).collect();
            let idx: Vec<usize> = (0..keys.len()).filter(|i| results[*i].is_none()).collect();
            let items: Vec<(&str, NonNull<u8>, usize)> = idx
                .iter()
                .map(|&i| {
                    // A zero pointer only reaches here with length 0; the pool refuses empty values.
                    let p = NonNull::new(ptrs[i] as *mut u8).unwrap_or(NonNull::dangling());
                    (keys[i].as_str(), p, sizes[i])
                })
                .collect();
            // SAFETY: every range is mapped (checked above) or inside memory the caller registered
            // and vouched for; the caller keeps it alive for this call, which waits for every
            // transfer before returning.
            let out = rt.block_on(unsafe { client.batch_put_raw(&items) });
            for (i, r) in idx.into_iter().zip(out) {
                results[i] = Some(key_result(r, |()| 1));
            }
            results.into_iter().map(|r| r.unwrap_or(Err((errors::INTERNAL, "no result".into())))).collect()
        }))
    }

    /// Gets keys into `(ptr, len)` ranges, the GIL released.
    fn get_raw(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Vec<KeyResult>> {
        let inner = self.open()?;
        let checks = self.check_ranges(&ptrs, &sizes);
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        Ok(py.detach(move || {
            let mut results: Vec<Option<KeyResult>> = checks.into_iter().map(|c| c.map(Err)).collect();
            let idx: Vec<usize> = (0..keys.len()).filter(|i| results[*i].is_none()).collect();
            let ks: Vec<&str> = idx.iter().map(|&i| keys[i].as_str()).collect();
            let bufs: Vec<(NonNull<u8>, usize)> = idx
                .iter()
                .map(|&i| (NonNull::new(ptrs[i] as *mut u8).unwrap_or(NonNull::dangling()), sizes[i]))
                .collect();
            // SAFETY: as in `put_raw`; the caller's ranges do not overlap (its contract) and nobody
            // else touches them during the call.
            let out = rt.block_on(unsafe { client.batch_get_raw(&ks, &bufs) });
            for (i, r) in idx.into_iter().zip(out) {
                results[i] = Some(key_result(r, |n| n));
            }
            results.into_iter().map(|r| r.unwrap_or(Err((errors::INTERNAL, "no result".into())))).collect()
        }))
    }

    /// Each key's ranges `(ptr, len, value offset)`, and the keys whose ranges are not all mapped
    /// memory (their error).
    fn ranged_lists(
        &self,
        ptrs: &[Vec<usize>],
        sizes: &[Vec<usize>],
        offsets: &[Vec<u64>],
    ) -> (Vec<AddrParts>, Vec<Option<(u8, String)>>) {
        let mut lists = Vec::with_capacity(ptrs.len());
        let mut failed = Vec::with_capacity(ptrs.len());
        for ((p, s), o) in ptrs.iter().zip(sizes).zip(offsets) {
            failed.push(self.check_ranges(p, s).into_iter().flatten().next());
            lists.push(p.iter().zip(s).zip(o).map(|((ptr, len), off)| (*ptr, *len, *off)).collect());
        }
        (lists, failed)
    }

    fn get_ranges_raw(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        offsets: Vec<Vec<u64>>,
    ) -> PyResult<Vec<KeyResult>> {
        let inner = self.open()?;
        let (lists, failed) = self.ranged_lists(&ptrs, &sizes, &offsets);
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        Ok(py.detach(move || {
            let mut results: Vec<Option<KeyResult>> = failed.into_iter().map(|c| c.map(Err)).collect();
            let idx: Vec<usize> = (0..keys.len()).filter(|i| results[*i].is_none()).collect();
            let ks: Vec<&str> = idx.iter().map(|&i| keys[i].as_str()).collect();
            let ls: Vec<RawParts> = idx.iter().map(|&i| raw_parts(&lists[i])).collect();
            // SAFETY: as in `get_raw`: mapped or registered memory the caller keeps alive and does
            // not touch during the call, no two ranges overlapping (its contract).
            let out = rt.block_on(unsafe { client.batch_get_ranges_raw(&ks, &ls) });
            for (i, r) in idx.into_iter().zip(out) {
                results[i] = Some(key_result(r, |n| n));
            }
            results.into_iter().map(|r| r.unwrap_or(Err((errors::INTERNAL, "no result".into())))).collect()
        }))
    }

    fn put_ranges_raw(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        object_sizes: Vec<u64>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        offsets: Vec<Vec<u64>>,
    ) -> PyResult<Vec<KeyResult>> {
        let inner = self.open()?;
        let (lists, failed) = self.ranged_lists(&ptrs, &sizes, &offsets);
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        Ok(py.detach(move || {
            let mut results: Vec<Option<KeyResult>> = failed.into_iter().map(|c| c.map(Err)).collect();
            let idx: Vec<usize> = (0..keys.len()).filter(|i| results[*i].is_none()).collect();
            let items: Vec<(&str, u64, RawParts)> =
                idx.iter().map(|&i| (keys[i].as_str(), object_sizes[i], raw_parts(&lists[i]))).collect();
            // SAFETY: as in `put_raw`.
            let out = rt.block_on(unsafe { client.batch_put_ranges_raw(&items) });
            for (i, r) in idx.into_iter().zip(out) {
                results[i] = Some(key_result(r, |_| 1));
            }
            results.into_iter().map(|r| r.unwrap_or(Err((errors::INTERNAL, "no result".into())))).collect()
        }))
    }
}

/// The GPU runtime a Python `gpu=` argument names (None: none).
fn gpu_selection(py: Python<'_>, gpu: Option<&str>) -> PyResult<Option<RuntimeSelection>> {
    match gpu.map(str::trim) {
        None | Some("" | "none" | "off") => Ok(None),
        Some(name) => name.parse().map(Some).map_err(|e: String| errors::config_error(py, format!("gpu: {e}"))),
    }
}

#[pymethods]
impl Pool {
    /// Starts a local pool: an embedded master on 127.0.0.1 and one node lending `capacity_bytes` of
    /// `medium` (`dram`, `ssd`, `cxl`, `object`, `hbm`; `medium_settings` holds its settings, as
    /// `umbp node` reads them) in pages of `page_size` bytes, all in this process. `gpu` names a GPU
    /// runtime (`auto`, `cuda`, `cudart`, `hip`, `fake[:N]`; default none) whose copy engine moves the
    /// caller's device buffers (`register_memory` of a device address), pinning host memory with
    /// device `gpu_device`'s context.
    #[staticmethod]
    #[pyo3(signature = (capacity_bytes, page_size = 64 << 10, prefault = false, medium = "dram".to_owned(),
        medium_settings = None, gpu = None, gpu_device = 0))]
    #[expect(clippy::too_many_arguments, reason = "a Python keyword-argument constructor")]
    fn local(
        py: Python<'_>,
        capacity_bytes: u64,
        page_size: u64,
        prefault: bool,
        medium: String,
        medium_settings: Option<Bound<'_, PyDict>>,
        gpu: Option<String>,
        gpu_device: u32,
    ) -> PyResult<Self> {
        let gpu = gpu_selection(py, gpu.as_deref())?;
        let request = MediumRequest {
            name: &medium,
            capacity: capacity_bytes,
            capacity_arg: "capacity_bytes",
            page_size,
            prefault,
            settings: medium_settings.as_ref(),
        };
        let medium = medium::build(py, &request)?;
        if medium == Medium::None {
            return Err(errors::config_error(py, "a local pool needs a medium: its one node holds every value"));
        }
        let rt = runtime()?;
        let (client, master) = py
            .detach(move || {
                rt.block_on(async move {
                    let master = umbp_master::start(MasterConfig {
                        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                        ..MasterConfig::default()
                    })
                    .await
                    .map_err(|e| (errors::INTERNAL, format!("starting the embedded master: {e}")))?;
                    let mut config =
                        PoolClientConfig::new("local", master.local_addr().to_string()).with_medium(medium);
                    config.page_size = page_size;
                    config.recache = RecachePolicy::Off;
                    config.gpu_runtime = gpu;
                    config.gpu_device = gpu_device;
                    match PoolClient::start(config).await {
                        Ok(c) => Ok((c, master)),
                        Err(e) => {
                            master.shutdown().await;
                            Err((errors::pool_kind(&e), errors::pool_message("starting the local pool", &e)))
                        }
                    }
                })
            })
            .map_err(|(k, m)| errors::start_error(py, k, m))?;
        let master_address = master.local_addr().to_string();
        Ok(Self {
            inner: Arc::new(Inner {
                client: Arc::new(client),
                master: Mutex::new(Some(master)),
                closed: AtomicBool::new(false),
                regions: Mutex::new(BTreeMap::new()),
                distributed: false,
                master_address,
            }),
        })
    }

    /// Joins the pool whose master is at `master_address` as node `node_id`, reachable at
    /// `node_address`, lending `lend_bytes` of `medium` (default: DRAM, or nothing when `lend_bytes`
    /// is 0; `medium_settings` as for `local`). `data_port` / `peer_port` 0 pick free ports;
    /// `recache_bytes` re-caches remote values up to that size locally (None: never); `gpu` and
    /// `gpu_device` as for `local`.
    #[staticmethod]
    #[pyo3(signature = (master_address, node_id, node_address = "127.0.0.1".to_owned(), lend_bytes = 0,
        page_size = 2 << 20, data_host = None, data_port = 0, peer_port = 0, bounce_bytes = 64 << 20,
        recache_bytes = None, prefault = false, medium = None, medium_settings = None, gpu = None, gpu_device = 0))]
    #[expect(clippy::too_many_arguments, reason = "a Python keyword-argument constructor")]
    fn node(
        py: Python<'_>,
        master_address: String,
        node_id: String,
        node_address: String,
        lend_bytes: u64,
        page_size: u64,
        data_host: Option<String>,
        data_port: u16,
        peer_port: u16,
        bounce_bytes: u64,
        recache_bytes: Option<u64>,
        prefault: bool,
        medium: Option<String>,
        medium_settings: Option<Bound<'_, PyDict>>,
        gpu: Option<String>,
        gpu_device: u32,
    ) -> PyResult<Self> {
        let node_ip = resolve_ip(&node_address)?;
        let data_ip = match &data_host {
            Some(h) if !h.is_empty() => resolve_ip(h)?,
            _ => node_ip,
        };
        let mut config = PoolClientConfig::new(node_id, master_address.clone());
        config.node_address = node_address;
        config.peer_listen = SocketAddr::new(node_ip, peer_port);
        config.data_listen = SocketAddr::new(data_ip, data_port);
        if page_size > 0 {
            config.page_size = page_size;
        }
        let default_medium = if lend_bytes > 0 { "dram" } else { "none" };
        let request = MediumRequest {
            name: medium.as_deref().unwrap_or(default_medium),
            capacity: lend_bytes,
            capacity_arg: "lend_bytes",
            page_size: config.page_size,
            prefault,
            settings: medium_settings.as_ref(),
        };
        config.medium = medium::build(py, &request)?;
        config.bounce_bytes = bounce_bytes;
        config.recache = recache_bytes.map_or(RecachePolicy::Off, RecachePolicy::UpTo);
        config.gpu_runtime = gpu_selection(py, gpu.as_deref())?;
        config.gpu_device = gpu_device;
        let rt = runtime()?;
        let client = py.detach(move || rt.block_on(PoolClient::start(config))).map_err(|e| {
            errors::start_error(py, errors::pool_kind(&e), errors::pool_message("joining the pool", &e))
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                client: Arc::new(client),
                master: Mutex::new(None),
                closed: AtomicBool::new(false),
                regions: Mutex::new(BTreeMap::new()),
                distributed: true,
                master_address,
            }),
        })
    }

    /// Whether this node joined a running master (`Pool.node`) rather than embedding one.
    #[getter]
    fn distributed(&self) -> bool {
        self.inner.distributed
    }

    /// This node's id.
    #[getter]
    fn node_id(&self) -> String {
        self.inner.client.node_id().to_owned()
    }

    /// The master's `host:port` (the embedded one's for a local pool).
    #[getter]
    fn master_address(&self) -> String {
        self.inner.master_address.clone()
    }

    /// Where this node's peer service listens (`None` for a node that lends nothing).
    #[getter]
    fn peer_address(&self) -> Option<String> {
        self.inner.client.peer_address().map(|a| a.to_string())
    }

    /// Where this node's data server listens.
    #[getter]
    fn data_endpoint(&self) -> String {
        self.inner.client.data_endpoint().to_owned()
    }

    /// Whether `close` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Puts `sizes[i]` bytes at address `ptrs[i]` under `keys[i]`. Values are write-once: a key the
    /// pool holds keeps its bytes (and counts as success). Ragged lists raise `InvalidInputError`.
    #[pyo3(signature = (keys, ptrs, sizes, detail = false))]
    fn put_ptrs<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        detail: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        check_batch(&keys, &ptrs, &sizes)?;
        let results = self.put_raw(py, keys, ptrs, sizes)?;
        results_list(py, &results, detail)
    }

    /// Gets `keys[i]` into the `sizes[i]` bytes at `ptrs[i]` (a buffer longer than the value is
    /// filled up to the value's size, which `detail=True` reports).
    #[pyo3(signature = (keys, ptrs, sizes, detail = false))]
    fn get_ptrs<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        ptrs: Vec<usize>,
        sizes: Vec<usize>,
        detail: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        check_batch(&keys, &ptrs, &sizes)?;
        let results = self.get_raw(py, keys, ptrs, sizes)?;
        results_list(py, &results, detail)
    }

    /// Reads ranges of each key's value: `ptrs[i][j]` receives `sizes[i][j]` bytes of `keys[i]`'s
    /// value from offset `offsets[i][j]`. A key's ranges must be non-empty, disjoint and inside the
    /// value (they need not cover it), else that key fails; `detail=True` reports each value's size.
    /// Ragged lists raise `InvalidInputError`.
    #[pyo3(signature = (keys, ptrs, sizes, offsets, detail = false))]
    fn get_ranges_ptrs<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        offsets: Vec<Vec<u64>>,
        detail: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        check_ranged_batch(&keys, None, &ptrs, &sizes, &offsets)?;
        let results = self.get_ranges_raw(py, keys, ptrs, sizes, offsets)?;
        results_list(py, &results, detail)
    }

    /// Writes each key's value of `object_sizes[i]` bytes assembled from ranges: `sizes[i][j]` bytes
    /// at `ptrs[i][j]` go to offset `offsets[i][j]`; a key's ranges must tile its value exactly, else
    /// that key fails and nothing is written for it. The value is published whole (no reader sees a
    /// part). Ragged lists raise `InvalidInputError`.
    #[pyo3(signature = (keys, object_sizes, ptrs, sizes, offsets, detail = false))]
    #[expect(clippy::too_many_arguments, reason = "the Python signature: keys, sizes and three range lists")]
    fn put_ranges_ptrs<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        object_sizes: Vec<u64>,
        ptrs: Vec<Vec<usize>>,
        sizes: Vec<Vec<usize>>,
        offsets: Vec<Vec<u64>>,
        detail: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        check_ranged_batch(&keys, Some(&object_sizes), &ptrs, &sizes, &offsets)?;
        let results = self.put_ranges_raw(py, keys, object_sizes, ptrs, sizes, offsets)?;
        results_list(py, &results, detail)
    }

    /// Puts each object exporting the buffer protocol (bytes, memoryview, numpy arrays) under its
    /// key, without copying it first.
    #[pyo3(signature = (keys, values, detail = true))]
    fn put_buffers<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        values: Vec<Bound<'py, PyAny>>,
        detail: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let (views, ptrs, sizes) = views_of(&keys, &values, false, "values")?;
        // `views` stays alive (the exporters pinned) until after the call, and is released here,
        // attached.
        let results = self.put_raw(py, keys, ptrs, sizes)?;
        drop(views);
        results_list(py, &results, detail)
    }

    /// Gets each key into a writable buffer (bytearray, memoryview, numpy array).
    #[pyo3(signature = (keys, buffers, detail = true))]
    fn get_into_buffers<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        buffers: Vec<Bound<'py, PyAny>>,
        detail: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let (views, ptrs, sizes) = views_of(&keys, &buffers, true, "buffers")?;
        let results = self.get_raw(py, keys, ptrs, sizes)?;
        drop(views);
        results_list(py, &results, detail)
    }

    /// The value of `key` as `bytes`, or `None` when the pool does not hold it. `size_hint` is the
    /// first buffer's size; a larger value costs a second read.
    #[pyo3(signature = (key, size_hint = 64 << 10))]
    fn get_bytes<'py>(&self, py: Python<'py>, key: String, size_hint: usize) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let inner = self.open()?;
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        let got = py.detach(move || {
            rt.block_on(async move {
                let mut buf = vec![0u8; size_hint.max(1)];
                match client.get(&key, &mut buf).await {
                    Err(KeyError::BufferTooSmall { needed, .. }) => {
                        let len = usize::try_from(needed).map_err(|_| KeyError::Failed("value too large".into()))?;
                        buf = vec![0u8; len];
                        let n = client.get(&key, &mut buf).await?;
                        buf.truncate(n as usize);
                        Ok(buf)
                    }
                    Ok(n) => {
                        buf.truncate(n as usize);
                        Ok(buf)
                    }
                    Err(e) => Err(e),
                }
            })
        });
        match got {
            Ok(v) => Ok(Some(PyBytes::new(py, &v))),
            Err(KeyError::Miss) => Ok(None),
            Err(e) => Err(errors::key_error(&e)),
        }
    }

    /// Whether the pool holds each key.
    fn exists(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<Vec<bool>> {
        let inner = self.open()?;
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        py.detach(move || {
            let ks: Vec<&str> = keys.iter().map(String::as_str).collect();
            rt.block_on(client.batch_exists(&ks))
        })
        .map_err(|e| errors::key_error(&e))
    }

    /// How many of `keys`, from the first, the pool holds (stops at the first miss).
    fn exists_prefix(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<usize> {
        Ok(self.exists(py, keys)?.iter().take_while(|b| **b).count())
    }

    /// Registers `size` bytes at `ptr` for zero-copy puts and gets; the caller keeps the memory
    /// mapped until `deregister_memory(ptr)` or `close`. Host memory, or — on a pool started with a
    /// `gpu` runtime — a device buffer, told apart by asking the runtime about `ptr` (so a torch
    /// CUDA tensor's `data_ptr()` registers as it is). Memory that is neither, or an overlap with a
    /// range already registered, raises `InvalidInputError`. The returned string says where the
    /// memory lives: `"host"` or `"gpu:N"`.
    fn register_memory(&self, py: Python<'_>, ptr: usize, size: usize) -> PyResult<String> {
        self.open()?;
        let inner = Arc::clone(&self.inner);
        // Detached: checking a large host pool page by page takes a while.
        py.detach(move || {
            let p = NonNull::new(ptr as *mut u8).ok_or((INVALID_INPUT, "null pointer".to_owned()))?;
            // The runtime first: a fake runtime's "device memory" is mapped host memory too.
            let location = match inner.client.pointer_device(p) {
                Ok(Some(device)) => MemoryLocation::Gpu { device },
                Ok(None) if range_mapped(ptr, size) => MemoryLocation::Host,
                Ok(None) => {
                    let hint = if inner.client.has_gpu_runtime() {
                        ""
                    } else {
                        " (a device buffer needs a pool started with a gpu runtime, e.g. gpu=\"auto\")"
                    };
                    return Err((
                        INVALID_INPUT,
                        format!("{size} bytes at {ptr:#x} are not mapped memory of this process{hint}"),
                    ));
                }
                Err(e) => return Err((errors::pool_kind(&e), format!("registering memory: {e}"))),
            };
            // SAFETY: the range is mapped host memory (checked) or device memory the GPU runtime
            // knows (asked), and the caller promises to keep it so until it deregisters or closes
            // (this method's documented contract).
            unsafe { inner.client.register_memory_at(p, size as u64, location) }
                .map_err(|e| (errors::pool_kind(&e), format!("registering memory: {e}")))?;
            inner.regions.lock().insert(ptr, size);
            Ok(match location {
                MemoryLocation::Host => "host".to_owned(),
                MemoryLocation::Gpu { device } => format!("gpu:{device}"),
            })
        })
        .map_err(|(k, m)| errors::exception(k, m))
    }

    /// Undoes `register_memory(ptr, …)`; returns whether `ptr` was registered.
    fn deregister_memory(&self, py: Python<'_>, ptr: usize) -> PyResult<bool> {
        self.open()?;
        let inner = Arc::clone(&self.inner);
        Ok(py.detach(move || {
            let known = inner.regions.lock().remove(&ptr).is_some();
            if let Some(p) = NonNull::new(ptr as *mut u8) {
                inner.client.deregister_memory(p);
            }
            known
        }))
    }

    /// Drops every value this node's medium holds (and tells the master).
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.open()?;
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        py.detach(move || rt.block_on(client.clear())).map_err(|e| errors::pool_error("clear", &e))
    }

    /// Sends this node's queued ownership changes to the master and waits for the answer: when it
    /// returns, every key this node stored is visible to every node. A node that lends no memory
    /// owns nothing (its puts are committed on the nodes that hold them, which tell the master
    /// themselves) and, as a light client, is not registered: there is nothing to send.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.open()?;
        if inner.client.medium().is_none() {
            return Ok(());
        }
        let client = Arc::clone(&inner.client);
        let rt = runtime()?;
        py.detach(move || rt.block_on(async move { client.master().heartbeat_once().await })).map_err(|e| {
            let kind = if e.is_retryable() { errors::UNAVAILABLE } else { errors::INTERNAL };
            errors::exception(kind, format!("flush: {e}"))
        })
    }

    /// This node holds the KV blocks `hashes` (str or int) at `tier` outside the pool (an engine's
    /// GPU or pinned memory): queued for its next heartbeat, which is woken now, and shipped again
    /// after every full sync (a restarted master rebuilds the index from its nodes). Raises
    /// `InvalidInputError` for empty hashes or a bad tier, or on a client that lends no memory (it
    /// is not a registered node).
    fn report_external_kv_blocks(&self, hashes: Vec<Bound<'_, PyAny>>, tier: Bound<'_, PyAny>) -> PyResult<()> {
        let (hashes, tier) = (master_client::hashes_of(&hashes)?, master_client::tier_of(&tier)?);
        self.open()?
            .client
            .report_external_kv_blocks(&hashes, tier)
            .map_err(|e| errors::pool_error("report_external_kv_blocks", &e))
    }

    /// This node no longer holds `hashes` at `tier` (queued as `report_external_kv_blocks`).
    fn revoke_external_kv_blocks(&self, hashes: Vec<Bound<'_, PyAny>>, tier: Bound<'_, PyAny>) -> PyResult<()> {
        let (hashes, tier) = (master_client::hashes_of(&hashes)?, master_client::tier_of(&tier)?);
        self.open()?
            .client
            .revoke_external_kv_blocks(&hashes, tier)
            .map_err(|e| errors::pool_error("revoke_external_kv_blocks", &e))
    }

    /// Every block this node holds at `tier` goes (queued as `report_external_kv_blocks`).
    fn revoke_all_external_kv_blocks_at_tier(&self, tier: Bound<'_, PyAny>) -> PyResult<()> {
        let tier = master_client::tier_of(&tier)?;
        self.open()?
            .client
            .revoke_all_external_kv_blocks_at_tier(tier)
            .map_err(|e| errors::pool_error("revoke_all_external_kv_blocks_at_tier", &e))
    }

    /// The nodes holding any of `hashes` outside the pool, as `UMBPMasterClient.match_external_kv`
    /// answers (asked of this client's master).
    #[pyo3(signature = (hashes, count_as_hit = false))]
    fn match_external_kv(
        &self,
        py: Python<'_>,
        hashes: Vec<Bound<'_, PyAny>>,
        count_as_hit: bool,
    ) -> PyResult<Vec<master_client::NodeMatch>> {
        let hashes = master_client::hashes_of(&hashes)?;
        let client = Arc::clone(&self.open()?.client);
        let rt = runtime()?;
        let matches = py
            .detach(move || rt.block_on(async move { client.master().match_external_kv(&hashes, count_as_hit).await }))
            .map_err(|e| {
                let kind = if e.is_retryable() { errors::UNAVAILABLE } else { errors::kind_code(e.kind()) };
                errors::exception(kind, format!("match_external_kv: {e}"))
            })?;
        Ok(matches.into_iter().map(Into::into).collect())
    }

    /// Leaves the pool (a local pool also stops its master). Idempotent; later calls raise
    /// `ClosedError`.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let client = Arc::clone(&self.inner.client);
        let master = self.inner.master.lock().take();
        let rt = runtime()?;
        py.detach(move || {
            rt.block_on(async move {
                client.close().await;
                if let Some(m) = master {
                    // Bounded: a master that does not stop must not hang the interpreter.
                    let _ = tokio::time::timeout(Duration::from_secs(5), m.shutdown()).await;
                }
            })
        });
        self.inner.regions.lock().clear();
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!(
            "<umbp._umbp.Pool node_id={:?} {} master={} {}>",
            self.inner.client.node_id(),
            if self.inner.distributed { "distributed" } else { "local" },
            self.inner.master_address,
            if self.closed() { "closed" } else { "open" }
        )
    }
}
