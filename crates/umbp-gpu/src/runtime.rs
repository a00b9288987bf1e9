//! The runtime trait, streams, the scoped device switch and runtime selection.

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crate::error::GpuError;
use crate::fake::FakeRuntime;

/// Which way a copy goes. Runtimes with unified addressing could infer it; we pass it anyway, so a
/// pointer in the wrong place fails loudly (HIP, the CUDA runtime, the fake) instead of copying from
/// somewhere unexpected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyKind {
    /// Host to host.
    HostToHost,
    /// Host to device.
    HostToDevice,
    /// Device to host.
    DeviceToHost,
    /// Device to device (the same or another device).
    DeviceToDevice,
}

impl CopyKind {
    /// The kind of a copy from `src_on_device` memory to `dst_on_device` memory.
    pub const fn between(src_on_device: bool, dst_on_device: bool) -> Self {
        match (src_on_device, dst_on_device) {
            (false, false) => Self::HostToHost,
            (false, true) => Self::HostToDevice,
            (true, false) => Self::DeviceToHost,
            (true, true) => Self::DeviceToDevice,
        }
    }

    /// The `cudaMemcpyKind` / `hipMemcpyKind` value (the two enums agree).
    pub(crate) const fn raw(self) -> i32 {
        match self {
            Self::HostToHost => 0,
            Self::HostToDevice => 1,
            Self::DeviceToHost => 2,
            Self::DeviceToDevice => 3,
        }
    }
}

static NEXT_RUNTIME_ID: AtomicU64 = AtomicU64::new(1);

/// A fresh id for a runtime instance: the owner tag of its streams.
pub(crate) fn next_runtime_id() -> u64 {
    NEXT_RUNTIME_ID.fetch_add(1, Ordering::Relaxed)
}

/// A stream of one device: copies enqueued on it run in order, asynchronously to the host. Created by
/// [`GpuRuntime::stream_create`] on the current device and given back with
/// [`GpuRuntime::stream_destroy`] by the same runtime.
///
/// A stream carries the id of the runtime instance that created it: every method that takes one
/// refuses ([`GpuError::ForeignStream`]) a stream of another runtime, so a raw handle never reaches
/// a library that did not make it.
#[derive(Debug)]
pub struct Stream {
    /// The runtime's handle (a pointer for the real runtimes, a counter for the fake).
    pub(crate) raw: usize,
    /// The device the stream belongs to.
    pub(crate) device: u32,
    /// The id of the runtime instance that created the stream.
    pub(crate) owner: u64,
}

impl Stream {
    /// The device the stream was created on.
    pub const fn device(&self) -> u32 {
        self.device
    }

    /// `Ok` when the stream was created by the runtime instance `owner`.
    pub(crate) fn check_owner(&self, owner: u64) -> Result<(), GpuError> {
        if self.owner == owner {
            Ok(())
        } else {
            Err(GpuError::ForeignStream { stream_owner: self.owner, runtime: owner })
        }
    }
}

/// What umbp-rs needs from a GPU runtime. Object safe; every method may be called from any thread.
///
/// "Current device" is per thread, as in the vendor runtimes: [`set_device`](Self::set_device)
/// changes it for the calling thread only; use [`DeviceGuard`] to switch for a scope and restore.
///
/// # Pointers
/// Device pointers are addresses in the process's unified address space (every runtime we load has
/// unified addressing on 64-bit Linux); they must only be handed back to the runtime, never
/// dereferenced by the CPU (the fake's device memory is an exception that tests may rely on).
pub trait GpuRuntime: Send + Sync + fmt::Debug {
    /// A short name: `"hip"`, `"cuda"` (driver API), `"cudart"` or `"fake"`.
    fn name(&self) -> &'static str;

    /// Devices visible to this process.
    fn device_count(&self) -> Result<u32, GpuError>;

    /// Makes `device` current on the calling thread.
    fn set_device(&self, device: u32) -> Result<(), GpuError>;

    /// The calling thread's current device; `None` when the thread has none. The CUDA driver API:
    /// the thread has no current context. HIP and the CUDA runtime have no "none" (they fall back to
    /// device 0 and create its context on first use), so for them `None` means this thread has not
    /// made a device current through this shim (a device made current by other code is not seen).
    fn current_device(&self) -> Result<Option<u32>, GpuError>;

    /// Leaves the calling thread with no current device where the runtime has that state (the CUDA
    /// driver API: no current context); HIP and the CUDA runtime have no such state, and their
    /// current device stays as it is. What [`DeviceGuard`] restores for a thread that had none.
    fn clear_device(&self) -> Result<(), GpuError>;

    /// Allocates `bytes` (> 0) of device memory on the current device. The calling thread must have
    /// a current device (run it under a [`DeviceGuard`]): the CUDA driver API and the fake refuse
    /// otherwise, rather than fall back to device 0. The same holds for `free`, `host_register`,
    /// `host_unregister`, `memcpy` and `stream_create`.
    fn malloc(&self, bytes: usize) -> Result<NonNull<u8>, GpuError>;

    /// Frees device memory.
    ///
    /// # Safety
    /// `ptr` came from [`malloc`](Self::malloc) of this runtime, is not freed yet, and nothing uses
    /// it any more (no copy in flight reads or writes it).
    unsafe fn free(&self, ptr: NonNull<u8>) -> Result<(), GpuError>;

    /// Page-locks (pins) `bytes` of host memory at `ptr` for fast, truly asynchronous copies on every
    /// device.
    ///
    /// # Safety
    /// `ptr` must be valid host memory of `bytes` bytes until
    /// [`host_unregister`](Self::host_unregister).
    unsafe fn host_register(&self, ptr: NonNull<u8>, bytes: usize) -> Result<(), GpuError>;

    /// Undoes [`host_register`](Self::host_register).
    ///
    /// # Safety
    /// `ptr` is the base of a registration of this runtime and no copy in flight uses it.
    unsafe fn host_unregister(&self, ptr: NonNull<u8>) -> Result<(), GpuError>;

    /// Copies `bytes` from `src` to `dst` and returns when the copy is complete.
    ///
    /// # Safety
    /// Both ranges are valid for `bytes` bytes in the places `kind` says (host or device memory);
    /// `dst` does not overlap `src`.
    unsafe fn memcpy(&self, dst: NonNull<u8>, src: NonNull<u8>, bytes: usize, kind: CopyKind) -> Result<(), GpuError>;

    /// Creates a non-blocking stream on the current device.
    fn stream_create(&self) -> Result<Stream, GpuError>;

    /// Enqueues a copy on `stream`; it completes by the next
    /// [`stream_synchronize`](Self::stream_synchronize) of that stream. Host memory that is not
    /// registered makes the runtime copy it synchronously (correct, slower).
    ///
    /// # Safety
    /// As [`memcpy`](Self::memcpy), and both ranges stay valid (and `dst` unread, `src` unwritten by
    /// anyone else) until the stream has been synchronized.
    unsafe fn memcpy_async(
        &self,
        dst: NonNull<u8>,
        src: NonNull<u8>,
        bytes: usize,
        kind: CopyKind,
        stream: &Stream,
    ) -> Result<(), GpuError>;

    /// Enqueues every copy of `copies` (`(dst, src, bytes)`, all of one `kind`) on `stream` in as
    /// few runtime calls as the runtime allows: the CUDA driver's batched copy
    /// (`cuMemcpyBatchAsync_v2`, a CUDA 13 driver) where it exists, else one
    /// [`memcpy_async`](Self::memcpy_async) per copy (the default). A failure cannot be pinned on one
    /// copy: treat every copy of the call as failed.
    ///
    /// # Safety
    /// As [`memcpy_async`](Self::memcpy_async), for every copy.
    unsafe fn memcpy_batch_async(
        &self,
        copies: &[(NonNull<u8>, NonNull<u8>, usize)],
        kind: CopyKind,
        stream: &Stream,
    ) -> Result<(), GpuError> {
        for &(dst, src, bytes) in copies {
            // SAFETY: the caller's contract covers every copy.
            unsafe { self.memcpy_async(dst, src, bytes, kind, stream) }?;
        }
        Ok(())
    }

    /// Whether [`memcpy_batch_async`](Self::memcpy_batch_async) is one runtime call rather than a
    /// loop. Default: false.
    fn has_batched_copy(&self) -> bool {
        false
    }

    /// Waits until every copy enqueued on `stream` has finished; reports the first failure. A stream
    /// of another runtime instance is refused ([`GpuError::ForeignStream`]), as in every method that
    /// takes a stream.
    fn stream_synchronize(&self, stream: &Stream) -> Result<(), GpuError>;

    /// Destroys a stream. It does not wait: copies still queued on it complete, and the runtime
    /// releases the stream once they have; synchronize first to wait for them and see their
    /// failures. A stream of another runtime instance is refused (and dropped, not destroyed).
    fn stream_destroy(&self, stream: Stream) -> Result<(), GpuError>;

    /// The runtime's message for an error code.
    fn error_string(&self, code: i32) -> String;

    /// The device whose memory `ptr` points into, or `None` for memory no device of this runtime
    /// allocated (host memory, pinned or not, and addresses the runtime does not know). How a
    /// binding tells a caller's device buffer from host memory when it is handed a bare address
    /// (SGLang registers its GPU KV pools by address alone). Only asks the runtime: never reads
    /// `ptr`, never makes a device current.
    ///
    /// # Errors
    /// The runtime failed in another way than "not device memory".
    fn pointer_device(&self, ptr: NonNull<u8>) -> Result<Option<u32>, GpuError>;
}

/// Switches the calling thread to a device for a scope and restores the previous state on drop: the
/// previous device, or no current device when the thread had none (the CUDA driver API: no current
/// context, so a guard never leaves a context of a device the thread did not ask for).
///
/// Allocation and release of a device's memory run under one, so the medium's device is fixed at
/// construction and never depends on the calling thread's current device. The guard is bound to
/// its thread (the current device is per thread): it is neither `Send` nor `Sync`.
#[must_use = "the device is restored when the guard drops"]
pub struct DeviceGuard<'a> {
    runtime: &'a dyn GpuRuntime,
    device: u32,
    /// What to restore: `Some(previous)` (`previous` is `None` when the thread had no device), or
    /// `None` when the previous state could not be read (nothing is restored).
    previous: Option<Option<u32>>,
    /// Not `Send`/`Sync`: dropping on another thread would restore that thread's device.
    _thread: PhantomData<*const ()>,
}

impl fmt::Debug for DeviceGuard<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceGuard").field("device", &self.device).field("previous", &self.previous).finish()
    }
}

impl<'a> DeviceGuard<'a> {
    /// Makes `device` current until the guard drops; fails (changing nothing) if the device does not
    /// exist or cannot be made current.
    pub fn switch(runtime: &'a dyn GpuRuntime, device: u32) -> Result<Self, GpuError> {
        let previous = match runtime.current_device() {
            Ok(previous) => Some(previous),
            Err(e) => {
                tracing::warn!(runtime = runtime.name(), device, error = %e, "cannot read the current device; it will not be restored");
                None
            }
        };
        if previous != Some(Some(device)) {
            runtime.set_device(device)?;
        }
        Ok(Self { runtime, device, previous, _thread: PhantomData })
    }

    /// The device this guard made current.
    pub const fn device(&self) -> u32 {
        self.device
    }
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        let result = match self.previous {
            Some(Some(previous)) if previous != self.device => self.runtime.set_device(previous),
            Some(None) => self.runtime.clear_device(),
            _ => Ok(()),
        };
        if let Err(e) = result {
            tracing::warn!(runtime = self.runtime.name(), previous = ?self.previous, error = %e, "could not restore the current device");
        }
    }
}

/// Which runtime to use, as configuration names it (`auto`, `hip`, `cuda`, `cudart`, `fake`,
/// `fake:N`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RuntimeSelection {
    /// The first runtime that loads and sees at least one device: HIP, then the CUDA driver API, then
    /// the CUDA runtime.
    #[default]
    Auto,
    /// HIP (`libamdhip64.so`).
    Hip,
    /// The CUDA driver API (`libcuda.so.1`).
    Cuda,
    /// The CUDA runtime (`libcudart.so`).
    CudaRuntime,
    /// The host-memory fake with this many devices (for tests and demos on machines without a GPU).
    Fake {
        /// Devices the fake reports.
        devices: u32,
    },
}

impl RuntimeSelection {
    /// Opens the selected runtime. `Auto` and the real runtimes are opened once per process and
    /// shared; each `Fake` call makes a new fake (fakes share one table of device memory, so
    /// pointers from one are device memory to all).
    pub fn load(&self) -> Result<Arc<dyn GpuRuntime>, GpuError> {
        match *self {
            Self::Auto => probe().ok_or_else(|| GpuError::NotFound {
                runtime: "GPU",
                tried: [
                    crate::runtime_api::HIP_LIBRARIES,
                    crate::cuda::LIBRARIES,
                    crate::runtime_api::CUDART_LIBRARIES,
                ]
                .concat(),
                reason: "no runtime loaded with at least one device".into(),
            }),
            Self::Hip => shared(&HIP, crate::runtime_api::RuntimeApi::hip),
            Self::Cuda => shared(&CUDA, crate::cuda::CudaDriver::load),
            Self::CudaRuntime => shared(&CUDART, crate::runtime_api::RuntimeApi::cudart),
            Self::Fake { devices } => Ok(Arc::new(FakeRuntime::new(devices))),
        }
    }
}

impl fmt::Display for RuntimeSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Hip => f.write_str("hip"),
            Self::Cuda => f.write_str("cuda"),
            Self::CudaRuntime => f.write_str("cudart"),
            Self::Fake { devices } => write!(f, "fake:{devices}"),
        }
    }
}

impl FromStr for RuntimeSelection {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "hip" | "rocm" => Ok(Self::Hip),
            "cuda" => Ok(Self::Cuda),
            "cudart" => Ok(Self::CudaRuntime),
            "fake" => Ok(Self::Fake { devices: 1 }),
            other => match other.strip_prefix("fake:").map(str::parse::<u32>) {
                Some(Ok(devices)) if devices > 0 => Ok(Self::Fake { devices }),
                _ => {
                    Err(format!("unknown GPU runtime {s:?}: expected auto, hip, cuda, cudart, fake or fake:N (N > 0)"))
                }
            },
        }
    }
}

type Slot = OnceLock<Result<Arc<dyn GpuRuntime>, String>>;
static HIP: Slot = OnceLock::new();
static CUDA: Slot = OnceLock::new();
static CUDART: Slot = OnceLock::new();
static AUTO: OnceLock<Option<Arc<dyn GpuRuntime>>> = OnceLock::new();

/// Opens a real runtime once per process: loading initialises the driver, and the CUDA driver API's
/// primary contexts are per process anyway.
fn shared<R: GpuRuntime + 'static>(
    slot: &Slot,
    open: fn() -> Result<R, GpuError>,
) -> Result<Arc<dyn GpuRuntime>, GpuError> {
    let loaded = slot.get_or_init(|| open().map(|r| Arc::new(r) as Arc<dyn GpuRuntime>).map_err(|e| e.to_string()));
    match loaded {
        Ok(r) => Ok(Arc::clone(r)),
        // The first error is kept as text (errors are not `Clone`): a second attempt would fail the same way.
        Err(reason) => Err(GpuError::Unavailable(reason.clone())),
    }
}

/// Whether the environment asks GPU tests to fail rather than skip when no GPU runtime is found
/// (`UMBP_REQUIRE_GPU=1`, for runs on a GPU machine, where a skip would hide a broken probe).
pub fn gpu_required() -> bool {
    std::env::var("UMBP_REQUIRE_GPU").is_ok_and(|v| v.trim() == "1")
}

/// The machine's GPU runtime, if any: the first of HIP, the CUDA driver API and the CUDA runtime that
/// loads and sees at least one device. Probed once per process; `None` on a machine with no GPU
/// (quietly: that is the normal case on a CPU-only machine). The environment variable
/// `UMBP_GPU_RUNTIME=none` (or `off`) disables the probe.
pub fn probe() -> Option<Arc<dyn GpuRuntime>> {
    AUTO.get_or_init(|| {
        if std::env::var("UMBP_GPU_RUNTIME").is_ok_and(|v| matches!(v.trim(), "none" | "off" | "0")) {
            return None;
        }
        for selection in [RuntimeSelection::Hip, RuntimeSelection::Cuda, RuntimeSelection::CudaRuntime] {
            match selection.load() {
                Ok(r) => match r.device_count() {
                    Ok(n) if n > 0 => {
                        tracing::debug!(runtime = r.name(), devices = n, "GPU runtime found");
                        return Some(r);
                    }
                    Ok(_) => tracing::debug!(runtime = r.name(), "GPU runtime loaded but sees no device"),
                    Err(e) => tracing::debug!(runtime = r.name(), error = %e, "GPU runtime loaded but failed"),
                },
                Err(e) => tracing::debug!(runtime = %selection, error = %e, "GPU runtime not available"),
            }
        }
        None
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_parse_and_print() {
        for s in ["auto", "hip", "cuda", "cudart", "fake:3"] {
            let parsed: RuntimeSelection = s.parse().expect("parses");
            assert_eq!(parsed.to_string(), s);
        }
        assert_eq!("fake".parse::<RuntimeSelection>(), Ok(RuntimeSelection::Fake { devices: 1 }));
        assert!("fake:0".parse::<RuntimeSelection>().is_err());
        assert!("opencl".parse::<RuntimeSelection>().is_err());
    }

    #[test]
    fn copy_kinds_match_the_vendor_enums() {
        assert_eq!(CopyKind::between(false, true), CopyKind::HostToDevice);
        assert_eq!(CopyKind::between(true, false).raw(), 2);
        assert_eq!(CopyKind::DeviceToDevice.raw(), 3);
        assert_eq!(CopyKind::HostToHost.raw(), 0);
    }

    #[test]
    fn device_guard_switches_and_restores() {
        let fake = FakeRuntime::new(3);
        fake.set_device(1).expect("device 1");
        {
            let guard = DeviceGuard::switch(&fake, 2).expect("switch");
            assert_eq!(guard.device(), 2);
            assert_eq!(fake.current_device().expect("current"), Some(2));
        }
        assert_eq!(fake.current_device().expect("current"), Some(1), "restored on drop");
        assert!(matches!(DeviceGuard::switch(&fake, 7), Err(GpuError::InvalidDevice { device: 7, count: 3 })));
        assert_eq!(fake.current_device().expect("current"), Some(1), "a failed switch changes nothing");
    }

    #[test]
    fn a_guard_on_a_thread_with_no_device_restores_none_and_never_touches_device_0() {
        let fake = FakeRuntime::new(3);
        assert_eq!(fake.current_device().expect("current"), None, "a fresh thread has no device");
        {
            let _guard = DeviceGuard::switch(&fake, 2).expect("switch");
            assert_eq!(fake.current_device().expect("current"), Some(2));
        }
        assert_eq!(fake.current_device().expect("current"), None, "no device again, not device 0");
        assert_eq!(fake.set_device_calls(0), 0, "device 0 was never made current");
        assert_eq!(fake.set_device_calls(2), 1);
        assert!(fake.malloc(64).is_err(), "no implicit device 0 for an allocation");
    }

    #[test]
    fn streams_of_another_runtime_are_refused() {
        let a = FakeRuntime::new(1);
        let b = FakeRuntime::new(1);
        let _guard = DeviceGuard::switch(&a, 0).expect("switch");
        let stream = a.stream_create().expect("stream");
        assert!(matches!(b.stream_synchronize(&stream), Err(GpuError::ForeignStream { .. })));
        let mut byte = 0u8;
        let p = NonNull::from(&mut byte);
        // SAFETY: the call is refused before anything is copied.
        let refused = unsafe { b.memcpy_async(p, p, 1, CopyKind::HostToHost, &stream) };
        assert!(matches!(refused, Err(GpuError::ForeignStream { .. })));
        // SAFETY: as above.
        let refused = unsafe { b.memcpy_batch_async(&[(p, p, 1), (p, p, 1)], CopyKind::HostToHost, &stream) };
        assert!(matches!(refused, Err(GpuError::ForeignStream { .. })));
        let other = b.stream_create();
        assert!(other.is_err(), "b has no current device on this thread");
        assert!(matches!(b.stream_destroy(stream), Err(GpuError::ForeignStream { .. })));
        let own = a.stream_create().expect("stream");
        a.stream_synchronize(&own).expect("own stream");
        a.stream_destroy(own).expect("own stream");
    }
}
