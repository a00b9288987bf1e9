//! `GpuCopyEngine`: copies inside one process where at least one side is GPU memory.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, MetricSource, RegistrationError, TransferRef};
use umbp_gpu::{CopyKind, DeviceGuard, GpuError, GpuRuntime, Stream};

use crate::engine::{
    CompletedHandle, FailureKind, PlanSet, TransferDirection, TransferEngine, TransferFailure, TransferHandle,
    TransferItem, TransferPlan,
};
use crate::planning::{SideKey, plan_in_range, plan_pairs};

/// Settings of a [`GpuCopyEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuCopyConfig {
    /// Page-lock (pin) host memory registered with the engine, so copies to and from it are direct DMA
    /// and can run asynchronously (pageable memory is staged by the driver, one copy at a time). A
    /// region the runtime refuses to pin is still accepted, unpinned. Default: true.
    pub pin_host_memory: bool,
    /// Run a submit's copies as asynchronous copies on one stream per device with one
    /// synchronisation per device, instead of one blocking copy per segment. Small pages need it: a
    /// blocking copy pays the whole launch-and-wait latency for every page. Default: true.
    pub batch: bool,
    /// Threads that enqueue a batched submit's copies, each on its own stream, when the batch has
    /// many copies smaller than 1 MiB. 1 keeps every copy on the calling thread. On an H200 with the
    /// CUDA 13 driver, 4 threads moved scattered 64 KiB pages no faster than 1 (16.8 against 16.6
    /// GB/s: the per-copy cost is not the enqueueing thread's), hence the default; a runtime whose
    /// enqueue path is the limit may gain from more. Default: 1.
    pub submit_threads: usize,
    /// Enqueue a stream's copies with the runtime's batched copy (`cuMemcpyBatchAsync` on a CUDA 13
    /// driver) instead of one call per copy, where the runtime has one. A failed batched call fails
    /// every plan with a copy in it. Default: true.
    pub driver_batch: bool,
    /// The device made current (under a scoped switch) while host memory is pinned and unpinned. A
    /// registration is portable (every device sees it), but the runtime needs a current device to
    /// make it; an HBM node sets its medium's device so it never touches another GPU (on the CUDA
    /// driver API, touching a device creates its context). Default: 0.
    pub pin_device: u32,
}

impl Default for GpuCopyConfig {
    fn default() -> Self {
        Self { pin_host_memory: true, batch: true, submit_threads: 1, driver_batch: true, pin_device: 0 }
    }
}

/// Copies smaller than this (mean) are "small": a batch of them may be spread over submitting threads.
const SMALL_COPY: usize = 1 << 20;
/// A submitting thread gets at least this many copies (fewer are not worth a thread).
const MIN_JOBS_PER_LANE: usize = 16;

/// One host registration the engine pinned: its length and how many refs share it.
#[derive(Debug, Clone, Copy)]
struct Pin {
    len: u64,
    refs: u32,
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    segments: AtomicU64,
    bytes: AtomicU64,
    pinned_bytes: AtomicU64,
}

/// Copies between local buffers when at least one side is GPU memory: host → device, device → host
/// and device → device (the same or another GPU). Host memory need not be registered (it is then
/// pageable and slower); registered host memory is pinned with the runtime (see
/// [`GpuCopyConfig::pin_host_memory`]), and GPU memory a caller registers (its own device buffers) is
/// accepted as is, so a client can put from and get into device memory with no host copy.
///
/// A submit runs per device: the device is made current for the batch (and the caller's restored),
/// every segment is enqueued as an asynchronous copy on a stream of that device — with the runtime's
/// batched copy where it has one (one driver call for a whole run of pages: 2.3x at 64 KiB on an
/// H200) — and the stream is synchronised once: one wait per batch, not one per page. Copies finish
/// inside `submit`.
///
/// The engine claims a pair only by the refs' locations; it never looks at what the memory is. A
/// medium that labels device memory as host memory therefore reaches the host copy engine instead,
/// which is why a medium's location is tested through a real composite.
pub struct GpuCopyEngine {
    runtime: Arc<dyn GpuRuntime>,
    devices: u32,
    config: GpuCopyConfig,
    /// Pinned host registrations by base address.
    pins: Mutex<HashMap<usize, Pin>>,
    /// Idle streams per device.
    streams: Mutex<BTreeMap<u32, Vec<Stream>>>,
    counters: Counters,
}

impl fmt::Debug for GpuCopyEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuCopyEngine")
            .field("runtime", &self.runtime.name())
            .field("devices", &self.devices)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl GpuCopyEngine {
    /// An engine over `runtime`'s devices.
    pub fn new(runtime: Arc<dyn GpuRuntime>, config: GpuCopyConfig) -> Result<Self, GpuError> {
        let devices = runtime.device_count()?;
        Ok(Self {
            runtime,
            devices,
            config,
            pins: Mutex::new(HashMap::new()),
            streams: Mutex::new(BTreeMap::new()),
            counters: Counters::default(),
        })
    }

    /// The runtime.
    pub fn runtime(&self) -> &Arc<dyn GpuRuntime> {
        &self.runtime
    }

    /// The configuration.
    pub fn config(&self) -> &GpuCopyConfig {
        &self.config
    }

    /// Device batches run so far (one stream synchronisation each when batching).
    pub fn batches(&self) -> u64 {
        self.counters.batches.load(Ordering::Relaxed)
    }

    /// Copy segments run so far.
    pub fn segments(&self) -> u64 {
        self.counters.segments.load(Ordering::Relaxed)
    }

    /// Bytes of host memory pinned by this engine now.
    pub fn pinned_bytes(&self) -> u64 {
        self.counters.pinned_bytes.load(Ordering::Relaxed)
    }

    /// Whether the host memory at `base` is pinned by this engine now.
    pub fn is_pinned(&self, base: NonNull<u8>) -> bool {
        self.pins.lock().contains_key(&(base.as_ptr() as usize))
    }

    /// A local region this engine can address: host memory, or memory of one of its devices.
    fn addressable(&self, r: &TransferRef) -> Option<LocalRegion> {
        let local = *r.local_region()?;
        match local.location() {
            MemoryLocation::Host => Some(local),
            MemoryLocation::Gpu { device } if device < self.devices => Some(local),
            MemoryLocation::Gpu { .. } => None,
        }
    }

    fn take_stream(&self, device: u32) -> Result<Stream, GpuError> {
        if let Some(s) = self.streams.lock().get_mut(&device).and_then(Vec::pop) {
            return Ok(s);
        }
        // The caller holds a guard for `device`: the stream is created on it.
        self.runtime.stream_create()
    }

    fn return_stream(&self, stream: Stream) {
        self.streams.lock().entry(stream.device()).or_default().push(stream);
    }

    /// Runs the plans of one device under a guard; returns the failures.
    fn run_device(&self, device: u32, plans: &[(&TransferPlan, Vec<Job>)]) -> Vec<TransferFailure> {
        let endpoint = format!("gpu:dev{device}");
        let fail_all = |message: String| {
            plans
                .iter()
                .map(|(p, _)| {
                    TransferFailure::new(p.tags.clone(), FailureKind::Local, message.clone(), endpoint.clone())
                })
                .collect::<Vec<_>>()
        };
        let _guard = match DeviceGuard::switch(self.runtime.as_ref(), device) {
            Ok(g) => g,
            Err(e) => return fail_all(format!("cannot make the device current: {e}")),
        };
        let mut failures = Vec::new();
        let segments: u64 = plans.iter().map(|(_, jobs)| jobs.len() as u64).sum();
        if !self.config.batch {
            for (plan, jobs) in plans {
                for job in jobs {
                    // SAFETY: `job` was built from a plan checked against both refs' local regions, which
                    // are valid under `LocalRegion`'s invariant for the duration of `submit`.
                    if let Err(e) = unsafe { self.runtime.memcpy(job.dst, job.src, job.len, job.kind) } {
                        failures.push(TransferFailure::new(
                            plan.tags.clone(),
                            FailureKind::Local,
                            e.to_string(),
                            endpoint.clone(),
                        ));
                        break;
                    }
                }
            }
        } else {
            // Every job with the index of its plan, in plan order.
            let flat: Vec<(usize, Job)> =
                plans.iter().enumerate().flat_map(|(i, (_, jobs))| jobs.iter().map(move |j| (i, *j))).collect();
            let lanes = self.lanes_for(&flat);
            let mut failed: BTreeMap<usize, String> = BTreeMap::new();
            if lanes <= 1 {
                self.run_lane(device, &flat, &mut failed);
            } else {
                // Several submitting threads, one stream each, for runtimes whose enqueue rate limits
                // small pages (see `GpuCopyConfig::submit_threads`). Contiguous shares keep each
                // stream's copies in order.
                let share = flat.len().div_ceil(lanes);
                let mut shares = flat.chunks(share);
                let mine = shares.next().unwrap_or(&[]);
                let results: Vec<BTreeMap<usize, String>> = std::thread::scope(|s| {
                    let handles: Vec<_> = shares
                        .map(|c| {
                            let handle = s.spawn(move || {
                                let mut f = BTreeMap::new();
                                self.run_lane(device, c, &mut f);
                                f
                            });
                            (c, handle)
                        })
                        .collect();
                    let mut own = BTreeMap::new();
                    self.run_lane(device, mine, &mut own);
                    let mut out = vec![own];
                    for (c, h) in handles {
                        match h.join() {
                            Ok(f) => out.push(f),
                            // A panicking lane cannot tell which of its copies ran: fail them all.
                            Err(_) => out
                                .push(c.iter().map(|(i, _)| (*i, "a submitting thread panicked".to_owned())).collect()),
                        }
                    }
                    out
                });
                for f in results {
                    failed.extend(f);
                }
            }
            for (i, message) in failed {
                if let Some((plan, _)) = plans.get(i) {
                    failures.push(TransferFailure::new(
                        plan.tags.clone(),
                        FailureKind::Local,
                        message,
                        endpoint.clone(),
                    ));
                }
            }
        }
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        self.counters.segments.fetch_add(segments, Ordering::Relaxed);
        failures
    }

    /// How many submitting threads (each with its own stream) a batch of `jobs` gets: one, unless
    /// there are many small copies.
    fn lanes_for(&self, jobs: &[(usize, Job)]) -> usize {
        let threads = self.config.submit_threads.max(1);
        if threads == 1 || jobs.is_empty() {
            return 1;
        }
        let bytes: usize = jobs.iter().map(|(_, j)| j.len).sum();
        if bytes / jobs.len() >= SMALL_COPY {
            return 1;
        }
        threads.min(jobs.len() / MIN_JOBS_PER_LANE).max(1)
    }

    /// Enqueues `jobs` on one stream of `device` from the calling thread and waits once; records the
    /// plans that failed (by index) in `failed`.
    fn run_lane(&self, device: u32, jobs: &[(usize, Job)], failed: &mut BTreeMap<usize, String>) {
        if jobs.is_empty() {
            return;
        }
        // Each submitting thread needs the device current (the CUDA driver's context is per thread).
        let _guard = match DeviceGuard::switch(self.runtime.as_ref(), device) {
            Ok(g) => g,
            Err(e) => {
                for (i, _) in jobs {
                    failed.entry(*i).or_insert_with(|| format!("cannot make the device current: {e}"));
                }
                return;
            }
        };
        let stream = match self.take_stream(device) {
            Ok(s) => s,
            Err(e) => {
                for (i, _) in jobs {
                    failed.entry(*i).or_insert_with(|| format!("cannot create a stream: {e}"));
                }
                return;
            }
        };
        let mut enqueued: Vec<usize> = Vec::new();
        let mut note = |i: usize, result: Result<(), GpuError>, failed: &mut BTreeMap<usize, String>| match result {
            Ok(()) => {
                if enqueued.last() != Some(&i) {
                    enqueued.push(i);
                }
            }
            Err(e) => {
                failed.entry(i).or_insert_with(|| e.to_string());
            }
        };
        if self.config.driver_batch && self.runtime.has_batched_copy() {
            // One runtime call per run of copies of one kind; a failed call fails its whole run.
            for run in jobs.chunk_by(|a, b| a.1.kind == b.1.kind) {
                let copies: Vec<(NonNull<u8>, NonNull<u8>, usize)> =
                    run.iter().map(|(_, j)| (j.dst, j.src, j.len)).collect();
                let kind = run.first().map_or(CopyKind::HostToDevice, |(_, j)| j.kind);
                // SAFETY: as for `memcpy_async` below, for every copy of the run.
                let result = unsafe { self.runtime.memcpy_batch_async(&copies, kind, &stream) };
                for (i, _) in run {
                    note(*i, result.as_ref().map(|_| ()).map_err(clone_error), failed);
                }
            }
        } else {
            for (i, job) in jobs {
                if failed.contains_key(i) {
                    continue;
                }
                // SAFETY: `job` was built from a plan checked against both refs' local regions, which
                // are valid under `LocalRegion`'s invariant for the duration of `submit`; the stream is
                // synchronised below, before `submit` returns.
                let result = unsafe { self.runtime.memcpy_async(job.dst, job.src, job.len, job.kind, &stream) };
                note(*i, result, failed);
            }
        }
        // One wait for the lane. A failure here cannot be pinned on one copy: every plan with a copy
        // on this stream fails.
        match self.runtime.stream_synchronize(&stream) {
            Ok(()) => self.return_stream(stream),
            Err(e) => {
                for i in enqueued {
                    failed.entry(i).or_insert_with(|| e.to_string());
                }
                // A stream that reported an error may stay poisoned: do not reuse it.
                if let Err(e) = self.runtime.stream_destroy(stream) {
                    tracing::debug!(device, error = %e, "destroying a failed stream");
                }
            }
        }
    }
}

impl Drop for GpuCopyEngine {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut *self.streams.lock());
        for (device, list) in streams {
            let Ok(_guard) = DeviceGuard::switch(self.runtime.as_ref(), device) else { continue };
            for s in list {
                let _ = self.runtime.stream_destroy(s);
            }
        }
        // Regions still pinned were not deregistered by their owners; unpin them so the pages are not
        // locked for the rest of the process (errors are harmless if the memory is already gone).
        let pins = std::mem::take(&mut *self.pins.lock());
        if pins.is_empty() {
            return;
        }
        let Ok(_guard) = DeviceGuard::switch(self.runtime.as_ref(), self.config.pin_device) else { return };
        for base in pins.keys() {
            if let Some(ptr) = NonNull::new(*base as *mut u8) {
                // SAFETY: `ptr` is the base of a registration this engine made; no copy is in flight
                // (the engine is being dropped, so no `submit` runs).
                let _ = unsafe { self.runtime.host_unregister(ptr) };
            }
        }
    }
}

/// `GpuError` is not `Clone` (it may carry a loader error); a failed batched call is reported to every
/// plan of the run by its message.
fn clone_error(e: &GpuError) -> GpuError {
    GpuError::Unavailable(e.to_string())
}

/// One copy: `len` bytes from `src` to `dst`, in the places `kind` says.
#[derive(Debug, Clone, Copy)]
struct Job {
    src: NonNull<u8>,
    dst: NonNull<u8>,
    len: usize,
    kind: CopyKind,
}

// SAFETY: a job is two addresses and a length inside regions valid (under `LocalRegion`'s invariant)
// for the whole `submit`, which joins every submitting thread before it returns; the addresses are
// only handed to the GPU runtime, which is itself thread-safe.
unsafe impl Send for Job {}
// SAFETY: as above; sharing a job copies the addresses only.
unsafe impl Sync for Job {}

impl MemoryRegistrar for GpuCopyEngine {
    /// Host memory is pinned once per (base, length): a registration of a region already pinned
    /// with that exact length takes a count on the pin; one at a pinned base with another length, or
    /// one the runtime refused to pin, is accepted unpinned and takes no count. Pinning runs under a
    /// scoped switch to [`GpuCopyConfig::pin_device`].
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        match region.location() {
            MemoryLocation::Gpu { device } if device >= self.devices => {
                Err(RegistrationError::Unsupported { len: region.len(), location: region.location() })
            }
            MemoryLocation::Gpu { .. } => Ok(TransferRef::local(region)),
            MemoryLocation::Host => {
                if self.config.pin_host_memory && !region.is_empty() {
                    let base = region.ptr().as_ptr() as usize;
                    let mut pins = self.pins.lock();
                    match pins.entry(base) {
                        // The same region again (another ref of one buffer): share the pin.
                        Entry::Occupied(mut pin) if pin.get().len == region.len() => pin.get_mut().refs += 1,
                        // A different length at a pinned base: leave it to the existing pin (no count
                        // taken, so its deregistration gives none back).
                        Entry::Occupied(_) => {}
                        Entry::Vacant(slot) => {
                            let len = usize::try_from(region.len()).unwrap_or(usize::MAX);
                            let pinned =
                                DeviceGuard::switch(self.runtime.as_ref(), self.config.pin_device).and_then(|_guard| {
                                    // SAFETY: the region is valid host memory until it is deregistered
                                    // (`LocalRegion`'s invariant); `deregister` unpins it before that.
                                    unsafe { self.runtime.host_register(region.ptr(), len) }
                                });
                            match pinned {
                                Ok(()) => {
                                    slot.insert(Pin { len: region.len(), refs: 1 });
                                    self.counters.pinned_bytes.fetch_add(region.len(), Ordering::Relaxed);
                                }
                                // Unpinned memory still copies, only slower: accept it.
                                Err(e) => tracing::debug!(bytes = region.len(), error = %e, "host memory not pinned"),
                            }
                        }
                    }
                }
                Ok(TransferRef::local(region))
            }
        }
    }

    /// Gives back the count a registration took: only a ref whose (base, length) is a pin of this
    /// engine does, so a ref that took none (another length at a pinned base, a refused pin) changes
    /// nothing, and a deregistration beyond the registrations of that (base, length) is a no-op.
    /// Refs of one (base, length) are indistinguishable: each registration takes one count, each
    /// deregistration of any of them returns one, and the last unpins.
    fn deregister(&self, r: &TransferRef) {
        let Some(local) = r.local_region().filter(|l| l.location().is_host()) else { return };
        let base = local.ptr().as_ptr() as usize;
        let mut pins = self.pins.lock();
        let Some(pin) = pins.get_mut(&base).filter(|p| p.len == local.len()) else { return };
        pin.refs = pin.refs.saturating_sub(1);
        if pin.refs > 0 {
            return;
        }
        let len = pin.len;
        pins.remove(&base);
        let unpinned = DeviceGuard::switch(self.runtime.as_ref(), self.config.pin_device).and_then(|_guard| {
            // SAFETY: the region is a registration base this engine pinned; its owner deregisters it
            // before releasing it and no copy of this engine is in flight on it (copies finish inside
            // `submit`).
            unsafe { self.runtime.host_unregister(local.ptr()) }
        });
        if let Err(e) = unpinned {
            tracing::warn!(bytes = len, error = %e, "unpinning host memory failed");
        }
        self.counters.pinned_bytes.fetch_sub(len, Ordering::Relaxed);
    }
}

// The composite engine already charges plans, bytes and seconds per engine and direction; the
// engine's own counters are exposed through `batches`, `segments` and `pinned_bytes`.
impl MetricSource for GpuCopyEngine {}

impl TransferEngine for GpuCopyEngine {
    fn name(&self) -> &str {
        "GpuCopyEngine"
    }

    /// Copies finish inside `submit` (one stream synchronisation per device).
    fn completes_in_submit(&self) -> bool {
        true
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        match (self.addressable(src), self.addressable(dst)) {
            (Some(s), Some(d)) => !s.location().is_host() || !d.location().is_host(),
            _ => false,
        }
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        plan_pairs(items, |item| {
            if !self.can_handle(&item.src, &item.dst) {
                return None;
            }
            Some((TransferDirection::Local, SideKey::local(&item.src)?, SideKey::local(&item.dst)?))
        })
    }

    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        let mut failures = Vec::new();
        let mut by_device: BTreeMap<u32, Vec<(&TransferPlan, Vec<Job>)>> = BTreeMap::new();
        for plan in &plans {
            let reject =
                |message: &str| TransferFailure::new(plan.tags.clone(), FailureKind::Local, message, "GpuCopyEngine");
            let (Some(src), Some(dst)) = (self.addressable(&plan.src), self.addressable(&plan.dst)) else {
                failures.push(reject("plan has a side this engine cannot address"));
                continue;
            };
            let device = match (src.location(), dst.location()) {
                (_, MemoryLocation::Gpu { device }) | (MemoryLocation::Gpu { device }, MemoryLocation::Host) => device,
                (MemoryLocation::Host, MemoryLocation::Host) => {
                    failures.push(reject("plan has no GPU side"));
                    continue;
                }
            };
            if !plan_in_range(plan) || plan.src.size() > src.len() || plan.dst.size() > dst.len() {
                failures.push(reject("plan reaches outside its buffers"));
                continue;
            }
            let kind = CopyKind::between(!src.location().is_host(), !dst.location().is_host());
            let mut jobs = Vec::with_capacity(plan.segments.len());
            let mut fits = true;
            for s in plan.segments.iter().filter(|s| s.len > 0) {
                let (Ok(src_off), Ok(dst_off), Ok(len)) =
                    (usize::try_from(s.src_offset), usize::try_from(s.dst_offset), usize::try_from(s.len))
                else {
                    fits = false;
                    break;
                };
                // Address arithmetic only (`wrapping_add`: device addresses are no Rust allocation, so
                // `add`'s in-bounds rule cannot be claimed for them); `offset + len <= ref size <=
                // region len` (checked above) keeps both inside their regions for the runtime.
                let (Some(src_ptr), Some(dst_ptr)) = (
                    NonNull::new(src.ptr().as_ptr().wrapping_add(src_off)),
                    NonNull::new(dst.ptr().as_ptr().wrapping_add(dst_off)),
                ) else {
                    fits = false;
                    break;
                };
                jobs.push(Job { src: src_ptr, dst: dst_ptr, len, kind });
                self.counters.bytes.fetch_add(s.len, Ordering::Relaxed);
            }
            if !fits {
                failures.push(reject("a segment does not fit this address space"));
                continue;
            }
            by_device.entry(device).or_default().push((plan, jobs));
        }
        for (device, plans) in &by_device {
            failures.extend(self.run_device(*device, plans));
        }
        Ok(Box::new(CompletedHandle::new(failures)))
    }
}
