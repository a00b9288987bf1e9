//! HIP and the CUDA runtime, opened at run time. The two APIs have the same shape (`hipMalloc` /
//! `cudaMalloc`, the same copy-kind values, the same per-thread current device), so one type serves
//! both, told apart by the symbol prefix.

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::ptr::NonNull;

use libloading::Library;

use crate::error::GpuError;
use crate::runtime::{CopyKind, GpuRuntime, Stream, next_runtime_id};

thread_local! {
    /// The runtime instances (by id) through which the calling thread made a device current. HIP
    /// and the CUDA runtime have no "no current device" (they report device 0 and create its
    /// context on first use), so a thread not in here reads as having none.
    static SET_HERE: RefCell<HashSet<u64>> = RefCell::new(HashSet::new());
}

pub(crate) const HIP_LIBRARIES: &[&str] = &["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"];
pub(crate) const CUDART_LIBRARIES: &[&str] =
    &["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"];

/// `hipHostRegisterPortable` / `cudaHostRegisterPortable`: pinned for every device, not only the
/// current one.
const HOST_REGISTER_PORTABLE: c_uint = 1;
/// `hipStreamNonBlocking` / `cudaStreamNonBlocking`: no implicit synchronisation with the legacy
/// default stream.
const STREAM_NON_BLOCKING: c_uint = 1;

type Err = c_int;
type RawStream = *mut c_void;

/// Opens the first library of `names` that loads.
pub(crate) fn open_first(runtime: &'static str, names: &[&'static str]) -> Result<(Library, &'static str), GpuError> {
    let mut last = String::new();
    for name in names {
        // SAFETY: loading a vendor runtime runs its initialisers; these are the libraries the vendor
        // ships for exactly this use, and we call nothing in them until every symbol resolved.
        match unsafe { Library::new(name) } {
            Ok(lib) => return Ok((lib, name)),
            Err(e) => last = e.to_string(),
        }
    }
    Err(GpuError::NotFound { runtime, tried: names.to_vec(), reason: last })
}

/// Resolves `symbol` in `lib` as a function pointer of type `T`.
///
/// # Safety
/// `T` must be the symbol's real signature, and the pointer must not outlive `lib`.
pub(crate) unsafe fn symbol<T: Copy>(
    lib: &Library,
    library: &'static str,
    symbol: &'static str,
) -> Result<T, GpuError> {
    let mut name = symbol.as_bytes().to_vec();
    name.push(0);
    // SAFETY: the caller guarantees `T` is the symbol's signature.
    let sym = unsafe { lib.get::<T>(&name) }.map_err(|e| GpuError::MissingSymbol {
        library,
        symbol,
        reason: e.to_string(),
    })?;
    Ok(*sym)
}

/// The function table of a HIP-shaped runtime.
#[derive(Clone, Copy)]
struct Api {
    get_device_count: unsafe extern "C" fn(*mut c_int) -> Err,
    set_device: unsafe extern "C" fn(c_int) -> Err,
    get_device: unsafe extern "C" fn(*mut c_int) -> Err,
    malloc: unsafe extern "C" fn(*mut *mut c_void, usize) -> Err,
    free: unsafe extern "C" fn(*mut c_void) -> Err,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> Err,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> Err,
    memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> Err,
    memcpy_async: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, RawStream) -> Err,
    stream_create_with_flags: unsafe extern "C" fn(*mut RawStream, c_uint) -> Err,
    stream_synchronize: unsafe extern "C" fn(RawStream) -> Err,
    stream_destroy: unsafe extern "C" fn(RawStream) -> Err,
    get_error_string: unsafe extern "C" fn(Err) -> *const c_char,
    pointer_get_attributes: unsafe extern "C" fn(*mut PointerAttributes, *const c_void) -> Err,
}

/// `cudaPointerAttributes` (CUDA 11 and later) / `hipPointerAttribute_t` (ROCm 6 and later), whose
/// leading fields agree: the memory type, then the device. Padded past either struct's size, so a
/// runtime with more trailing fields never writes beyond it.
#[repr(C)]
struct PointerAttributes {
    kind: c_int,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
    _rest: [u64; 8],
}

/// `cudaMemoryTypeDevice` / `hipMemoryTypeDevice` (ROCm 6 numbering).
const MEMORY_TYPE_DEVICE: c_int = 2;

/// HIP or the CUDA runtime.
pub(crate) struct RuntimeApi {
    /// This instance's id: the owner tag of its streams.
    id: u64,
    name: &'static str,
    library: &'static str,
    api: Api,
    /// Keeps the function pointers in `api` valid.
    _lib: Library,
}

impl std::fmt::Debug for RuntimeApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeApi").field("name", &self.name).field("library", &self.library).finish_non_exhaustive()
    }
}

impl RuntimeApi {
    /// Opens HIP.
    pub(crate) fn hip() -> Result<Self, GpuError> {
        Self::open("hip", "hip", HIP_LIBRARIES)
    }

    /// Opens the CUDA runtime.
    pub(crate) fn cudart() -> Result<Self, GpuError> {
        Self::open("cudart", "cuda", CUDART_LIBRARIES)
    }

    fn open(name: &'static str, prefix: &'static str, names: &[&'static str]) -> Result<Self, GpuError> {
        let (lib, library) = open_first(name, names)?;
        // Symbol names are leaked once per runtime load (a handful of short strings, once per process).
        let sym = |base: &str| -> &'static str { Box::leak(format!("{prefix}{base}").into_boxed_str()) };
        // SAFETY: each type below is the documented C signature of the named HIP / CUDA runtime
        // function (the two APIs agree); the pointers live in `Self` next to `lib`, which outlives them.
        let api = unsafe {
            Api {
                get_device_count: symbol(&lib, library, sym("GetDeviceCount"))?,
                set_device: symbol(&lib, library, sym("SetDevice"))?,
                get_device: symbol(&lib, library, sym("GetDevice"))?,
                malloc: symbol(&lib, library, sym("Malloc"))?,
                free: symbol(&lib, library, sym("Free"))?,
                host_register: symbol(&lib, library, sym("HostRegister"))?,
                host_unregister: symbol(&lib, library, sym("HostUnregister"))?,
                memcpy: symbol(&lib, library, sym("Memcpy"))?,
                memcpy_async: symbol(&lib, library, sym("MemcpyAsync"))?,
                stream_create_with_flags: symbol(&lib, library, sym("StreamCreateWithFlags"))?,
                stream_synchronize: symbol(&lib, library, sym("StreamSynchronize"))?,
                stream_destroy: symbol(&lib, library, sym("StreamDestroy"))?,
                get_error_string: symbol(&lib, library, sym("GetErrorString"))?,
                pointer_get_attributes: symbol(&lib, library, sym("PointerGetAttributes"))?,
            }
        };
        Ok(Self { id: next_runtime_id(), name, library, api, _lib: lib })
    }

    fn check(&self, call: &'static str, code: Err) -> Result<(), GpuError> {
        if code == 0 {
            Ok(())
        } else {
            Err(GpuError::Call { runtime: self.name, call, code, message: self.error_string(code) })
        }
    }
}

impl GpuRuntime for RuntimeApi {
    fn name(&self) -> &'static str {
        self.name
    }

    fn device_count(&self) -> Result<u32, GpuError> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer for the call's duration.
        self.check("GetDeviceCount", unsafe { (self.api.get_device_count)(&mut n) })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    fn set_device(&self, device: u32) -> Result<(), GpuError> {
        let count = self.device_count()?;
        if device >= count {
            return Err(GpuError::InvalidDevice { device, count });
        }
        // `device < count`, which fits a c_int.
        let ordinal = c_int::try_from(device).map_err(|_| GpuError::InvalidDevice { device, count })?;
        // SAFETY: plain value argument.
        self.check("SetDevice", unsafe { (self.api.set_device)(ordinal) })?;
        SET_HERE.with(|s| s.borrow_mut().insert(self.id));
        Ok(())
    }

    fn current_device(&self) -> Result<Option<u32>, GpuError> {
        if !SET_HERE.with(|s| s.borrow().contains(&self.id)) {
            return Ok(None);
        }
        let mut d: c_int = 0;
        // SAFETY: `d` is a valid out-pointer for the call's duration.
        self.check("GetDevice", unsafe { (self.api.get_device)(&mut d) })?;
        u32::try_from(d).map(Some).map_err(|_| GpuError::Invalid(format!("the runtime reports device {d}")))
    }

    /// HIP and the CUDA runtime cannot unbind a thread's device: it stays as it is (only the record
    /// that this thread set one is dropped).
    fn clear_device(&self) -> Result<(), GpuError> {
        SET_HERE.with(|s| s.borrow_mut().remove(&self.id));
        Ok(())
    }

    fn malloc(&self, bytes: usize) -> Result<NonNull<u8>, GpuError> {
        if bytes == 0 {
            return Err(GpuError::Invalid("a zero-byte device allocation".into()));
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer for the call's duration.
        self.check("Malloc", unsafe { (self.api.malloc)(&mut p, bytes) })?;
        NonNull::new(p.cast::<u8>()).ok_or_else(|| GpuError::Invalid("the runtime returned a null allocation".into()))
    }

    unsafe fn free(&self, ptr: NonNull<u8>) -> Result<(), GpuError> {
        // SAFETY: the caller guarantees `ptr` is a live allocation of this runtime that nothing uses.
        self.check("Free", unsafe { (self.api.free)(ptr.as_ptr().cast()) })
    }

    unsafe fn host_register(&self, ptr: NonNull<u8>, bytes: usize) -> Result<(), GpuError> {
        // SAFETY: the caller guarantees `bytes` of host memory at `ptr` stay valid while registered.
        self.check("HostRegister", unsafe {
            (self.api.host_register)(ptr.as_ptr().cast(), bytes, HOST_REGISTER_PORTABLE)
        })
    }

    unsafe fn host_unregister(&self, ptr: NonNull<u8>) -> Result<(), GpuError> {
        // SAFETY: the caller guarantees `ptr` is a registration base no copy in flight uses.
        self.check("HostUnregister", unsafe { (self.api.host_unregister)(ptr.as_ptr().cast()) })
    }

    unsafe fn memcpy(&self, dst: NonNull<u8>, src: NonNull<u8>, bytes: usize, kind: CopyKind) -> Result<(), GpuError> {
        // SAFETY: the caller guarantees both ranges are valid where `kind` says.
        self.check("Memcpy", unsafe { (self.api.memcpy)(dst.as_ptr().cast(), src.as_ptr().cast(), bytes, kind.raw()) })
    }

    fn stream_create(&self) -> Result<Stream, GpuError> {
        let device = self.current_device()?.ok_or(GpuError::NoCurrentDevice { call: "StreamCreateWithFlags" })?;
        let mut s: RawStream = std::ptr::null_mut();
        // SAFETY: `s` is a valid out-pointer for the call's duration.
        self.check("StreamCreateWithFlags", unsafe {
            (self.api.stream_create_with_flags)(&mut s, STREAM_NON_BLOCKING)
        })?;
        Ok(Stream { raw: s as usize, device, owner: self.id })
    }

    unsafe fn memcpy_async(
        &self,
        dst: NonNull<u8>,
        src: NonNull<u8>,
        bytes: usize,
        kind: CopyKind,
        stream: &Stream,
    ) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        // SAFETY: the caller guarantees both ranges stay valid until the stream is synchronized;
        // `stream.raw` is a live stream of this runtime instance: `Stream` is only made by
        // `stream_create` (its fields are private to this crate), the owner check above refuses
        // another instance's, and `stream_destroy` consumes it, so it is not destroyed yet.
        self.check("MemcpyAsync", unsafe {
            (self.api.memcpy_async)(
                dst.as_ptr().cast(),
                src.as_ptr().cast(),
                bytes,
                kind.raw(),
                stream.raw as RawStream,
            )
        })
    }

    fn stream_synchronize(&self, stream: &Stream) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        // SAFETY: `stream.raw` is a live stream of this runtime instance (owner checked above; see
        // `memcpy_async`).
        self.check("StreamSynchronize", unsafe { (self.api.stream_synchronize)(stream.raw as RawStream) })
    }

    fn stream_destroy(&self, stream: Stream) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        // SAFETY: `stream.raw` is a live stream of this runtime instance (owner checked above), and
        // `stream` is consumed, so it is destroyed once. The runtime does not wait: queued work
        // completes and the stream is released afterwards.
        self.check("StreamDestroy", unsafe { (self.api.stream_destroy)(stream.raw as RawStream) })
    }

    fn pointer_device(&self, ptr: NonNull<u8>) -> Result<Option<u32>, GpuError> {
        let mut attrs = PointerAttributes {
            kind: 0,
            device: -1,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            _rest: [0; 8],
        };
        // SAFETY: `attrs` is a valid out-pointer at least as large as the runtime's struct; the
        // query only looks the address up, it never dereferences it.
        let rc = unsafe { (self.api.pointer_get_attributes)(&mut attrs, ptr.as_ptr().cast_const().cast()) };
        if rc != 0 {
            // Older runtimes answer "invalid value" for memory they never saw; newer ones answer
            // success with an unregistered type. Either way not device memory.
            return Ok(None);
        }
        if attrs.kind != MEMORY_TYPE_DEVICE {
            return Ok(None);
        }
        u32::try_from(attrs.device)
            .map(Some)
            .map_err(|_| GpuError::Invalid(format!("the runtime reports device {} for {ptr:p}", attrs.device)))
    }

    fn error_string(&self, code: i32) -> String {
        // SAFETY: the runtime returns a pointer to a static NUL-terminated string (or null).
        let p = unsafe { (self.api.get_error_string)(code) };
        if p.is_null() {
            return format!("error {code}");
        }
        // SAFETY: non-null and NUL-terminated, static for the library's life (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}
