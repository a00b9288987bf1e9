//! The CUDA driver API (`libcuda.so.1`), opened at run time.
//!
//! Every NVIDIA driver installs `libcuda.so.1`; the CUDA runtime (`libcudart`) ships only with an SDK
//! or a framework. Driving the driver API directly is what lets a binary built with no SDK run on any
//! NVIDIA machine. "Current device" is the calling thread's current context: we use each device's
//! primary context (the one the CUDA runtime would use), retained once and kept for the process.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::NonNull;

use libloading::Library;
use parking_lot::Mutex;

use crate::error::GpuError;
use crate::runtime::{CopyKind, GpuRuntime, Stream, next_runtime_id};
use crate::runtime_api::{open_first, symbol};

pub(crate) const LIBRARIES: &[&str] = &["libcuda.so.1", "libcuda.so"];
const LIBRARY: &str = "libcuda.so.1";

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuDevicePtr = u64;

/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context.
const HOST_REGISTER_PORTABLE: c_uint = 1;
/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`: sources are read in stream order, as `cuMemcpyAsync` does.
const SRC_ACCESS_ORDER_STREAM: c_int = 1;

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (a `CUmemorytype`).
const POINTER_MEMORY_TYPE: c_int = 2;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (an int).
const POINTER_DEVICE_ORDINAL: c_int = 9;
/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: c_uint = 2;
/// `CUDA_ERROR_INVALID_VALUE`: what the attribute query answers for memory the driver never saw.
const ERROR_INVALID_VALUE: CuResult = 1;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MemLocation {
    kind: c_int,
    id: c_int,
}

/// `CUmemcpyAttributes`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct MemcpyAttributes {
    src_access_order: c_int,
    src_loc_hint: MemLocation,
    dst_loc_hint: MemLocation,
    flags: c_uint,
}

/// `cuMemcpyBatchAsync_v2` (the CUDA 13 form: no failure index).
type BatchCopy = unsafe extern "C" fn(
    *mut CuDevicePtr,
    *mut CuDevicePtr,
    *mut usize,
    usize,
    *mut MemcpyAttributes,
    *mut usize,
    usize,
    CuStream,
) -> CuResult;

#[derive(Clone, Copy)]
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_get_device: unsafe extern "C" fn(*mut CuDevice) -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    memcpy: unsafe extern "C" fn(CuDevicePtr, CuDevicePtr, usize) -> CuResult,
    memcpy_async: unsafe extern "C" fn(CuDevicePtr, CuDevicePtr, usize, CuStream) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult,
}

/// The CUDA driver API.
pub(crate) struct CudaDriver {
    /// This instance's id: the owner tag of its streams.
    id: u64,
    api: Api,
    count: u32,
    /// The driver's batched copy, when the driver has it (CUDA 13 drivers).
    batch_copy: Option<BatchCopy>,
    /// Retained primary contexts by device ordinal (as addresses: contexts are process-wide handles).
    contexts: Mutex<Vec<Option<usize>>>,
    /// Keeps the function pointers in `api` valid.
    _lib: Library,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver").field("devices", &self.count).finish_non_exhaustive()
    }
}

impl CudaDriver {
    /// Opens `libcuda.so.1` and initialises the driver.
    pub(crate) fn load() -> Result<Self, GpuError> {
        let (lib, _) = open_first("CUDA driver", LIBRARIES)?;
        // SAFETY: each type below is the documented C signature of the named driver API function
        // (the `_v2` names are the 64-bit ABI the headers map the plain names to); the pointers live in
        // `Self` next to `lib`, which outlives them.
        let api = unsafe {
            Api {
                init: symbol(&lib, LIBRARY, "cuInit")?,
                device_get_count: symbol(&lib, LIBRARY, "cuDeviceGetCount")?,
                device_get: symbol(&lib, LIBRARY, "cuDeviceGet")?,
                primary_ctx_retain: symbol(&lib, LIBRARY, "cuDevicePrimaryCtxRetain")?,
                ctx_set_current: symbol(&lib, LIBRARY, "cuCtxSetCurrent")?,
                ctx_get_current: symbol(&lib, LIBRARY, "cuCtxGetCurrent")?,
                ctx_get_device: symbol(&lib, LIBRARY, "cuCtxGetDevice")?,
                mem_alloc: symbol(&lib, LIBRARY, "cuMemAlloc_v2")?,
                mem_free: symbol(&lib, LIBRARY, "cuMemFree_v2")?,
                host_register: symbol(&lib, LIBRARY, "cuMemHostRegister_v2")?,
                host_unregister: symbol(&lib, LIBRARY, "cuMemHostUnregister")?,
                memcpy: symbol(&lib, LIBRARY, "cuMemcpy")?,
                memcpy_async: symbol(&lib, LIBRARY, "cuMemcpyAsync")?,
                stream_create: symbol(&lib, LIBRARY, "cuStreamCreate")?,
                stream_synchronize: symbol(&lib, LIBRARY, "cuStreamSynchronize")?,
                stream_destroy: symbol(&lib, LIBRARY, "cuStreamDestroy_v2")?,
                get_error_string: symbol(&lib, LIBRARY, "cuGetErrorString")?,
                pointer_get_attribute: symbol(&lib, LIBRARY, "cuPointerGetAttribute")?,
            }
        };
        // SAFETY: the documented signature of `cuMemcpyBatchAsync_v2` (CUDA 13); older drivers lack
        // the symbol and copies are enqueued one by one instead.
        let batch_copy = unsafe { symbol::<BatchCopy>(&lib, LIBRARY, "cuMemcpyBatchAsync_v2") }.ok();
        let mut this =
            Self { id: next_runtime_id(), api, batch_copy, count: 0, contexts: Mutex::new(Vec::new()), _lib: lib };
        // SAFETY: plain value argument; cuInit is idempotent.
        this.check("cuInit", unsafe { (this.api.init)(0) })?;
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the call's duration.
        this.check("cuDeviceGetCount", unsafe { (this.api.device_get_count)(&mut n) })?;
        this.count = u32::try_from(n).unwrap_or(0);
        this.contexts = Mutex::new(vec![None; this.count as usize]);
        Ok(this)
    }

    fn check(&self, call: &'static str, code: CuResult) -> Result<(), GpuError> {
        if code == 0 {
            Ok(())
        } else {
            Err(GpuError::Call { runtime: "cuda", call, code, message: self.error_string(code) })
        }
    }

    /// The primary context of `device`, retained on first use.
    fn context(&self, device: u32) -> Result<CuContext, GpuError> {
        if device >= self.count {
            return Err(GpuError::InvalidDevice { device, count: self.count });
        }
        let mut contexts = self.contexts.lock();
        if let Some(Some(ctx)) = contexts.get(device as usize) {
            return Ok(*ctx as CuContext);
        }
        let ordinal = c_int::try_from(device).map_err(|_| GpuError::InvalidDevice { device, count: self.count })?;
        let mut dev: CuDevice = 0;
        // SAFETY: `dev` is a valid out-pointer; `ordinal < count`.
        self.check("cuDeviceGet", unsafe { (self.api.device_get)(&mut dev, ordinal) })?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `dev` is a device handle from cuDeviceGet. The
        // retain is never released: the context lives as long as the process, as the CUDA runtime's does.
        self.check("cuDevicePrimaryCtxRetain", unsafe { (self.api.primary_ctx_retain)(&mut ctx, dev) })?;
        if let Some(slot) = contexts.get_mut(device as usize) {
            *slot = Some(ctx as usize);
        }
        Ok(ctx)
    }

    /// Fails unless the calling thread has a current context: every call below needs one, and
    /// falling back to device 0 (as the CUDA runtime does) would create device 0's primary context
    /// in a process that may only use another GPU. Callers run under a `DeviceGuard` for their
    /// device.
    fn ensure_context(&self, call: &'static str) -> Result<(), GpuError> {
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        self.check("cuCtxGetCurrent", unsafe { (self.api.ctx_get_current)(&mut ctx) })?;
        if ctx.is_null() { Err(GpuError::NoCurrentDevice { call }) } else { Ok(()) }
    }
}

impl GpuRuntime for CudaDriver {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn device_count(&self) -> Result<u32, GpuError> {
        Ok(self.count)
    }

    fn set_device(&self, device: u32) -> Result<(), GpuError> {
        let ctx = self.context(device)?;
        // SAFETY: `ctx` is a retained primary context (never released).
        self.check("cuCtxSetCurrent", unsafe { (self.api.ctx_set_current)(ctx) })
    }

    fn current_device(&self) -> Result<Option<u32>, GpuError> {
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer.
        self.check("cuCtxGetCurrent", unsafe { (self.api.ctx_get_current)(&mut ctx) })?;
        if ctx.is_null() {
            return Ok(None);
        }
        let mut dev: CuDevice = 0;
        // SAFETY: `dev` is a valid out-pointer; a context is current.
        self.check("cuCtxGetDevice", unsafe { (self.api.ctx_get_device)(&mut dev) })?;
        u32::try_from(dev).map(Some).map_err(|_| GpuError::Invalid(format!("the current context reports device {dev}")))
    }

    fn clear_device(&self) -> Result<(), GpuError> {
        // SAFETY: a null context is cuCtxSetCurrent's documented way to unbind the thread's context.
        self.check("cuCtxSetCurrent", unsafe { (self.api.ctx_set_current)(std::ptr::null_mut()) })
    }

    fn malloc(&self, bytes: usize) -> Result<NonNull<u8>, GpuError> {
        if bytes == 0 {
            return Err(GpuError::Invalid("a zero-byte device allocation".into()));
        }
        self.ensure_context("cuMemAlloc")?;
        let mut p: CuDevicePtr = 0;
        // SAFETY: `p` is a valid out-pointer; a context is current.
        self.check("cuMemAlloc", unsafe { (self.api.mem_alloc)(&mut p, bytes) })?;
        NonNull::new(p as usize as *mut u8)
            .ok_or_else(|| GpuError::Invalid("the driver returned a null allocation".into()))
    }

    unsafe fn free(&self, ptr: NonNull<u8>) -> Result<(), GpuError> {
        self.ensure_context("cuMemFree")?;
        // SAFETY: the caller guarantees `ptr` is a live allocation of this runtime that nothing uses.
        self.check("cuMemFree", unsafe { (self.api.mem_free)(ptr.as_ptr() as usize as CuDevicePtr) })
    }

    unsafe fn host_register(&self, ptr: NonNull<u8>, bytes: usize) -> Result<(), GpuError> {
        self.ensure_context("cuMemHostRegister")?;
        // SAFETY: the caller guarantees `bytes` of host memory at `ptr` stay valid while registered.
        self.check("cuMemHostRegister", unsafe {
            (self.api.host_register)(ptr.as_ptr().cast(), bytes, HOST_REGISTER_PORTABLE)
        })
    }

    unsafe fn host_unregister(&self, ptr: NonNull<u8>) -> Result<(), GpuError> {
        self.ensure_context("cuMemHostUnregister")?;
        // SAFETY: the caller guarantees `ptr` is a registration base no copy in flight uses.
        self.check("cuMemHostUnregister", unsafe { (self.api.host_unregister)(ptr.as_ptr().cast()) })
    }

    unsafe fn memcpy(&self, dst: NonNull<u8>, src: NonNull<u8>, bytes: usize, _kind: CopyKind) -> Result<(), GpuError> {
        self.ensure_context("cuMemcpy")?;
        // cuMemcpy infers the direction from the pointers (unified addressing, always on for 64-bit
        // Linux processes), so `kind` is not passed.
        // SAFETY: the caller guarantees both ranges are valid.
        self.check("cuMemcpy", unsafe {
            (self.api.memcpy)(dst.as_ptr() as usize as CuDevicePtr, src.as_ptr() as usize as CuDevicePtr, bytes)
        })
    }

    fn stream_create(&self) -> Result<Stream, GpuError> {
        let device = self.current_device()?.ok_or(GpuError::NoCurrentDevice { call: "cuStreamCreate" })?;
        let mut s: CuStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer; a context is current.
        self.check("cuStreamCreate", unsafe { (self.api.stream_create)(&mut s, STREAM_NON_BLOCKING) })?;
        Ok(Stream { raw: s as usize, device, owner: self.id })
    }

    unsafe fn memcpy_async(
        &self,
        dst: NonNull<u8>,
        src: NonNull<u8>,
        bytes: usize,
        _kind: CopyKind,
        stream: &Stream,
    ) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        // SAFETY: the caller guarantees both ranges stay valid until the stream is synchronized;
        // `stream.raw` is a live stream of this driver instance: `Stream` is only made by
        // `stream_create` (its fields are private to this crate), the owner check above refuses
        // another instance's, and `stream_destroy` consumes it, so it is not destroyed yet.
        self.check("cuMemcpyAsync", unsafe {
            (self.api.memcpy_async)(
                dst.as_ptr() as usize as CuDevicePtr,
                src.as_ptr() as usize as CuDevicePtr,
                bytes,
                stream.raw as CuStream,
            )
        })
    }

    unsafe fn memcpy_batch_async(
        &self,
        copies: &[(NonNull<u8>, NonNull<u8>, usize)],
        kind: CopyKind,
        stream: &Stream,
    ) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        let Some(batch_copy) = self.batch_copy.filter(|_| copies.len() > 1) else {
            for &(dst, src, bytes) in copies {
                // SAFETY: the caller's contract covers every copy.
                unsafe { self.memcpy_async(dst, src, bytes, kind, stream) }?;
            }
            return Ok(());
        };
        let mut dsts: Vec<CuDevicePtr> = copies.iter().map(|c| c.0.as_ptr() as usize as CuDevicePtr).collect();
        let mut srcs: Vec<CuDevicePtr> = copies.iter().map(|c| c.1.as_ptr() as usize as CuDevicePtr).collect();
        let mut sizes: Vec<usize> = copies.iter().map(|c| c.2).collect();
        let mut attrs = MemcpyAttributes { src_access_order: SRC_ACCESS_ORDER_STREAM, ..MemcpyAttributes::default() };
        let mut first: usize = 0;
        // SAFETY: the three arrays hold `copies.len()` entries each and one attribute entry applies from
        // copy 0; the driver reads them during the call only. The caller guarantees every range stays
        // valid until the stream is synchronized; `stream.raw` is a live stream of this driver
        // instance (owner checked above; see `memcpy_async`).
        self.check("cuMemcpyBatchAsync", unsafe {
            batch_copy(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                copies.len(),
                &mut attrs,
                &mut first,
                1,
                stream.raw as CuStream,
            )
        })
    }

    fn has_batched_copy(&self) -> bool {
        self.batch_copy.is_some()
    }

    fn stream_synchronize(&self, stream: &Stream) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        // SAFETY: `stream.raw` is a live stream of this driver instance (owner checked above; only
        // `stream_create` makes a `Stream`, and only `stream_destroy`, which consumes it, ends it).
        self.check("cuStreamSynchronize", unsafe { (self.api.stream_synchronize)(stream.raw as CuStream) })
    }

    fn stream_destroy(&self, stream: Stream) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        // SAFETY: `stream.raw` is a live stream of this driver instance (owner checked above), and
        // `stream` is consumed, so it is destroyed once. cuStreamDestroy does not wait: queued work
        // completes and the driver releases the stream afterwards.
        self.check("cuStreamDestroy", unsafe { (self.api.stream_destroy)(stream.raw as CuStream) })
    }

    fn pointer_device(&self, ptr: NonNull<u8>) -> Result<Option<u32>, GpuError> {
        let addr = ptr.as_ptr() as CuDevicePtr;
        let mut kind: c_uint = 0;
        // SAFETY: `kind` is a valid out-pointer of the attribute's type (a `CUmemorytype`); the
        // query only looks the address up, it never dereferences it.
        let rc = unsafe { (self.api.pointer_get_attribute)((&raw mut kind).cast(), POINTER_MEMORY_TYPE, addr) };
        if rc == ERROR_INVALID_VALUE {
            // Memory the driver never allocated nor registered: host memory.
            return Ok(None);
        }
        self.check("cuPointerGetAttribute", rc)?;
        if kind != MEMORYTYPE_DEVICE {
            return Ok(None);
        }
        let mut ordinal: c_int = -1;
        // SAFETY: as above, with an int attribute.
        let rc = unsafe { (self.api.pointer_get_attribute)((&raw mut ordinal).cast(), POINTER_DEVICE_ORDINAL, addr) };
        self.check("cuPointerGetAttribute", rc)?;
        u32::try_from(ordinal)
            .map(Some)
            .map_err(|_| GpuError::Invalid(format!("the driver reports device {ordinal} for {ptr:p}")))
    }

    fn error_string(&self, code: i32) -> String {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out-pointer; the driver stores a static string (or fails).
        let rc = unsafe { (self.api.get_error_string)(code, &mut p) };
        if rc != 0 || p.is_null() {
            return format!("CUDA error {code}");
        }
        // SAFETY: non-null, NUL-terminated and static for the library's life.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}
