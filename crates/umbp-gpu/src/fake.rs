//! `FakeRuntime`: a GPU runtime whose device memory is host memory, for tests.

use std::alloc::Layout;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::GpuError;
use crate::runtime::{CopyKind, GpuRuntime, Stream, next_runtime_id};

/// Device allocations are aligned like the real runtimes' (256 bytes).
const ALIGN: usize = 256;

/// Every fake's device memory, by base address: (device, length). One table for the process, so a
/// pointer one fake handed out is device memory to every fake (a test's caller buffer and a node's
/// medium come from different fakes and must still agree on which memory is "on the device").
static DEVICE_MEMORY: Mutex<BTreeMap<usize, (u32, usize)>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// The calling thread's current device per fake instance (the vendor runtimes keep it per
    /// thread too); no entry: the thread has no current device, as a thread of the CUDA driver API
    /// with no current context.
    static CURRENT: RefCell<HashMap<u64, u32>> = RefCell::new(HashMap::new());
}

/// The device that holds `[ptr, ptr + len)` entirely, if fake device memory does.
fn device_of(ptr: usize, len: usize) -> Option<u32> {
    let table = DEVICE_MEMORY.lock();
    let (base, (device, size)) = table.range(..=ptr).next_back()?;
    let end = ptr.checked_add(len)?;
    (end <= base + size).then_some(*device)
}

/// What a [`FakeRuntime`] was asked to do (cumulative).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FakeStats {
    /// Successful device allocations.
    pub mallocs: u64,
    /// Successful frees.
    pub frees: u64,
    /// Synchronous copies.
    pub sync_copies: u64,
    /// Copies enqueued on a stream.
    pub async_copies: u64,
    /// Stream synchronizations.
    pub stream_syncs: u64,
    /// Bytes copied (both kinds).
    pub bytes_copied: u64,
    /// Host registrations.
    pub host_registers: u64,
    /// Host deregistrations.
    pub host_unregisters: u64,
    /// Copies refused because a side was not where the copy kind said.
    pub refused_copies: u64,
    /// Batched-copy calls (only with [`FakeRuntime::with_batched_copy`]).
    pub batched_calls: u64,
    /// Copies made by batched-copy calls.
    pub batched_copies: u64,
}

#[derive(Debug, Default)]
struct Counters {
    mallocs: AtomicU64,
    frees: AtomicU64,
    sync_copies: AtomicU64,
    async_copies: AtomicU64,
    stream_syncs: AtomicU64,
    bytes_copied: AtomicU64,
    host_registers: AtomicU64,
    host_unregisters: AtomicU64,
    refused_copies: AtomicU64,
    batched_calls: AtomicU64,
    batched_copies: AtomicU64,
}

/// A GPU runtime for tests: `devices` fake devices whose memory is host memory (so tests can read
/// it directly), a per-thread current device, copies checked against the direction they claim (a
/// host-to-device copy whose destination is not fake device memory, or runs past the end of its
/// allocation, fails as a real runtime would fail or fault), injectable allocation failures and
/// counters of every call.
///
/// Stricter than the vendor runtimes where that exposes bugs: a thread has no current device until
/// it sets one (as with the CUDA driver API), and allocation, free, host (de)registration, blocking
/// copies and stream creation fail without one instead of falling back to device 0; every
/// [`set_device`](GpuRuntime::set_device) is counted per device
/// ([`set_device_calls`](Self::set_device_calls)), so a test can assert a device was never touched;
/// a stream of another runtime instance is refused.
#[derive(Debug)]
pub struct FakeRuntime {
    id: u64,
    devices: u32,
    counters: Counters,
    /// `set_device` calls per device.
    set_device_calls: Vec<AtomicU64>,
    /// Allocations left before `malloc` fails (`u64::MAX`: never).
    malloc_budget: AtomicU64,
    /// Host registrations: base → length.
    pinned: Mutex<BTreeMap<usize, usize>>,
    /// This fake's own allocations, so dropping the fake frees what tests leaked.
    owned: Mutex<BTreeMap<usize, usize>>,
    next_stream: AtomicU64,
    /// Whether the fake offers a batched copy (as a CUDA 13 driver does).
    batched: bool,
}

impl FakeRuntime {
    /// A fake with `devices` devices (at least one).
    pub fn new(devices: u32) -> Self {
        Self {
            id: next_runtime_id(),
            devices: devices.max(1),
            counters: Counters::default(),
            set_device_calls: (0..devices.max(1)).map(|_| AtomicU64::new(0)).collect(),
            malloc_budget: AtomicU64::new(u64::MAX),
            pinned: Mutex::new(BTreeMap::new()),
            owned: Mutex::new(BTreeMap::new()),
            next_stream: AtomicU64::new(1),
            batched: false,
        }
    }

    /// The same fake, offering a batched copy: [`GpuRuntime::memcpy_batch_async`] checks every copy
    /// of a call before it copies anything, and refuses the whole call if one is wrong.
    pub fn with_batched_copy(mut self) -> Self {
        self.batched = true;
        self
    }

    /// Makes every allocation after the next `n` fail with an out-of-memory error (to test
    /// all-or-nothing allocation); `u64::MAX` lifts the limit.
    pub fn fail_mallocs_after(&self, n: u64) {
        self.malloc_budget.store(n, Ordering::SeqCst);
    }

    /// What the fake was asked to do so far.
    pub fn stats(&self) -> FakeStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FakeStats {
            mallocs: get(&c.mallocs),
            frees: get(&c.frees),
            sync_copies: get(&c.sync_copies),
            async_copies: get(&c.async_copies),
            stream_syncs: get(&c.stream_syncs),
            bytes_copied: get(&c.bytes_copied),
            host_registers: get(&c.host_registers),
            host_unregisters: get(&c.host_unregisters),
            refused_copies: get(&c.refused_copies),
            batched_calls: get(&c.batched_calls),
            batched_copies: get(&c.batched_copies),
        }
    }

    /// How many times `device` was made current (by [`set_device`](GpuRuntime::set_device), which
    /// is how a [`DeviceGuard`](crate::DeviceGuard) switches) on any thread: 0 means this fake never
    /// touched the device (on the CUDA driver API that would have created its context).
    pub fn set_device_calls(&self, device: u32) -> u64 {
        self.set_device_calls.get(device as usize).map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The device whose fake memory holds `[ptr, ptr + len)`, if any fake's does.
    pub fn device_of(ptr: NonNull<u8>, len: usize) -> Option<u32> {
        device_of(ptr.as_ptr() as usize, len)
    }

    /// Bytes of live device memory this fake allocated.
    pub fn live_bytes(&self) -> u64 {
        self.owned.lock().values().map(|l| *l as u64).sum()
    }

    /// Whether `ptr` is the base of a live host registration with this fake.
    pub fn is_host_registered(&self, ptr: NonNull<u8>) -> bool {
        self.pinned.lock().contains_key(&(ptr.as_ptr() as usize))
    }

    fn error(&self, call: &'static str, code: i32) -> GpuError {
        GpuError::Call { runtime: "fake", call, code, message: self.error_string(code) }
    }

    fn current(&self) -> Option<u32> {
        CURRENT.with(|c| c.borrow().get(&self.id).copied())
    }

    /// The current device, or the error a call that needs one fails with.
    fn require_device(&self, call: &'static str) -> Result<u32, GpuError> {
        self.current().ok_or(GpuError::NoCurrentDevice { call })
    }

    /// Checks a copy against its kind and the fake device table, then copies.
    fn copy(
        &self,
        call: &'static str,
        dst: NonNull<u8>,
        src: NonNull<u8>,
        bytes: usize,
        kind: CopyKind,
    ) -> Result<(), GpuError> {
        self.check_copy(call, dst, src, bytes, kind)?;
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: the caller's contract (`memcpy`'s) makes both ranges valid for `bytes`; device sides
        // were checked to lie inside one live fake allocation, which is host memory. `copy` (memmove)
        // tolerates the overlap the contract forbids anyway.
        unsafe { std::ptr::copy(src.as_ptr(), dst.as_ptr(), bytes) };
        self.counters.bytes_copied.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Whether a copy is where its kind says: a side the kind calls host memory touches no device
    /// memory, and a device side lies inside one allocation (a real runtime rejects or faults
    /// otherwise).
    fn check_copy(
        &self,
        call: &'static str,
        dst: NonNull<u8>,
        src: NonNull<u8>,
        bytes: usize,
        kind: CopyKind,
    ) -> Result<(), GpuError> {
        if bytes == 0 {
            return Ok(());
        }
        let (src_addr, dst_addr) = (src.as_ptr() as usize, dst.as_ptr() as usize);
        let on_device = |addr: usize| device_of(addr, bytes).is_some();
        let touches_device = |addr: usize| {
            let table = DEVICE_MEMORY.lock();
            let end = addr.saturating_add(bytes);
            table.range(..end).next_back().is_some_and(|(base, (_, size))| base + size > addr)
        };
        let src_ok = match kind {
            CopyKind::HostToHost | CopyKind::HostToDevice => !touches_device(src_addr),
            CopyKind::DeviceToHost | CopyKind::DeviceToDevice => on_device(src_addr),
        };
        let dst_ok = match kind {
            CopyKind::HostToHost | CopyKind::DeviceToHost => !touches_device(dst_addr),
            CopyKind::HostToDevice | CopyKind::DeviceToDevice => on_device(dst_addr),
        };
        if !src_ok || !dst_ok {
            self.counters.refused_copies.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(?kind, src_ok, dst_ok, bytes, "fake runtime refused a copy");
            return Err(self.error(call, 1));
        }
        Ok(())
    }
}

impl Drop for FakeRuntime {
    fn drop(&mut self) {
        let owned = std::mem::take(&mut *self.owned.lock());
        let mut table = DEVICE_MEMORY.lock();
        for (base, len) in owned {
            table.remove(&base);
            if let Ok(layout) = Layout::from_size_align(len, ALIGN) {
                // SAFETY: `base` was allocated by this fake with this layout and not freed (it is still
                // in `owned`); the fake is going away, so nothing can use it through the fake again.
                unsafe { std::alloc::dealloc(base as *mut u8, layout) };
            }
        }
    }
}

impl GpuRuntime for FakeRuntime {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn device_count(&self) -> Result<u32, GpuError> {
        Ok(self.devices)
    }

    fn set_device(&self, device: u32) -> Result<(), GpuError> {
        if device >= self.devices {
            return Err(GpuError::InvalidDevice { device, count: self.devices });
        }
        CURRENT.with(|c| c.borrow_mut().insert(self.id, device));
        if let Some(calls) = self.set_device_calls.get(device as usize) {
            calls.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn current_device(&self) -> Result<Option<u32>, GpuError> {
        Ok(self.current())
    }

    fn clear_device(&self) -> Result<(), GpuError> {
        CURRENT.with(|c| c.borrow_mut().remove(&self.id));
        Ok(())
    }

    fn malloc(&self, bytes: usize) -> Result<NonNull<u8>, GpuError> {
        if bytes == 0 {
            return Err(GpuError::Invalid("a zero-byte device allocation".into()));
        }
        let device = self.require_device("malloc")?;
        let budget = self.malloc_budget.load(Ordering::SeqCst);
        if budget != u64::MAX {
            if budget == 0 {
                return Err(self.error("malloc", 2));
            }
            self.malloc_budget.store(budget - 1, Ordering::SeqCst);
        }
        let layout = Layout::from_size_align(bytes, ALIGN).map_err(|e| GpuError::Invalid(e.to_string()))?;
        // SAFETY: `layout` has a non-zero size (checked above).
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or_else(|| self.error("malloc", 2))?;
        let addr = ptr.as_ptr() as usize;
        DEVICE_MEMORY.lock().insert(addr, (device, bytes));
        self.owned.lock().insert(addr, bytes);
        self.counters.mallocs.fetch_add(1, Ordering::Relaxed);
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: NonNull<u8>) -> Result<(), GpuError> {
        self.require_device("free")?;
        let addr = ptr.as_ptr() as usize;
        let Some(len) = self.owned.lock().remove(&addr) else {
            return Err(self.error("free", 1));
        };
        DEVICE_MEMORY.lock().remove(&addr);
        let layout = Layout::from_size_align(len, ALIGN).map_err(|e| GpuError::Invalid(e.to_string()))?;
        // SAFETY: `ptr` was allocated by this fake with this layout (it was in `owned`, removed just now
        // so it cannot be freed twice); the caller guarantees nothing uses it any more.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        self.counters.frees.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn host_register(&self, ptr: NonNull<u8>, bytes: usize) -> Result<(), GpuError> {
        self.require_device("host_register")?;
        let addr = ptr.as_ptr() as usize;
        if bytes == 0 || device_of(addr, 1).is_some() {
            return Err(self.error("host_register", 1));
        }
        let mut pinned = self.pinned.lock();
        // Overlapping registrations fail in the real runtimes (cudaErrorHostMemoryAlreadyRegistered).
        let end = addr.saturating_add(bytes);
        if pinned.range(..end).next_back().is_some_and(|(base, len)| base + len > addr) {
            return Err(self.error("host_register", 712));
        }
        pinned.insert(addr, bytes);
        self.counters.host_registers.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn host_unregister(&self, ptr: NonNull<u8>) -> Result<(), GpuError> {
        self.require_device("host_unregister")?;
        if self.pinned.lock().remove(&(ptr.as_ptr() as usize)).is_none() {
            return Err(self.error("host_unregister", 713));
        }
        self.counters.host_unregisters.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn memcpy(&self, dst: NonNull<u8>, src: NonNull<u8>, bytes: usize, kind: CopyKind) -> Result<(), GpuError> {
        self.require_device("memcpy")?;
        self.copy("memcpy", dst, src, bytes, kind)?;
        self.counters.sync_copies.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn stream_create(&self) -> Result<Stream, GpuError> {
        let device = self.require_device("stream_create")?;
        let raw = self.next_stream.fetch_add(1, Ordering::Relaxed) as usize;
        Ok(Stream { raw, device, owner: self.id })
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
        // The fake runs the copy at once: stream order is trivially kept.
        self.copy("memcpy_async", dst, src, bytes, kind)?;
        self.counters.async_copies.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    unsafe fn memcpy_batch_async(
        &self,
        copies: &[(NonNull<u8>, NonNull<u8>, usize)],
        kind: CopyKind,
        stream: &Stream,
    ) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        if !self.batched {
            for &(dst, src, bytes) in copies {
                // SAFETY: the caller's contract covers every copy.
                unsafe { self.memcpy_async(dst, src, bytes, kind, stream) }?;
            }
            return Ok(());
        }
        for &(dst, src, bytes) in copies {
            self.check_copy("memcpy_batch_async", dst, src, bytes, kind)?;
        }
        for &(dst, src, bytes) in copies {
            self.copy("memcpy_batch_async", dst, src, bytes, kind)?;
        }
        self.counters.batched_calls.fetch_add(1, Ordering::Relaxed);
        self.counters.batched_copies.fetch_add(copies.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    fn has_batched_copy(&self) -> bool {
        self.batched
    }

    fn stream_synchronize(&self, stream: &Stream) -> Result<(), GpuError> {
        stream.check_owner(self.id)?;
        self.counters.stream_syncs.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn stream_destroy(&self, stream: Stream) -> Result<(), GpuError> {
        stream.check_owner(self.id)
    }

    fn error_string(&self, code: i32) -> String {
        match code {
            0 => "no error",
            1 => "invalid argument",
            2 => "out of memory",
            712 => "host memory already registered",
            713 => "host memory not registered",
            _ => "unknown error",
        }
        .to_owned()
    }

    fn pointer_device(&self, ptr: NonNull<u8>) -> Result<Option<u32>, GpuError> {
        // Device memory of any fake (one table for the process, see `DEVICE_MEMORY`).
        Ok(device_of(ptr.as_ptr() as usize, 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_memory_is_host_memory_with_a_device_id() {
        let fake = FakeRuntime::new(2);
        fake.set_device(1).expect("device 1");
        let d = fake.malloc(4096).expect("malloc");
        assert_eq!(FakeRuntime::device_of(d, 4096), Some(1));
        assert_eq!(FakeRuntime::device_of(d, 4097), None, "past the end is not device memory");
        let src = vec![7u8; 4096];
        let src_ptr = NonNull::new(src.as_ptr().cast_mut()).expect("non-null");
        // SAFETY: `d` holds 4096 bytes, `src` is 4096 bytes of host memory.
        unsafe { fake.memcpy(d, src_ptr, 4096, CopyKind::HostToDevice) }.expect("h2d");
        // SAFETY: fake device memory is host memory; 4096 bytes are live.
        assert_eq!(unsafe { std::slice::from_raw_parts(d.as_ptr(), 4096) }, &src[..]);
        let stats = fake.stats();
        assert_eq!((stats.mallocs, stats.sync_copies, stats.bytes_copied), (1, 1, 4096));
        // SAFETY: allocated above, unused now.
        unsafe { fake.free(d) }.expect("free");
        assert_eq!(fake.live_bytes(), 0);
    }

    #[test]
    fn pointer_device_tells_device_memory_from_host_memory() {
        let fake = FakeRuntime::new(2);
        fake.set_device(1).expect("device 1");
        let d = fake.malloc(4096).expect("malloc");
        let inside = NonNull::new(d.as_ptr().wrapping_add(4095)).expect("non-null");
        assert_eq!(fake.pointer_device(d).expect("query"), Some(1));
        assert_eq!(fake.pointer_device(inside).expect("query"), Some(1), "an address inside the allocation");
        let host = [0u8; 64];
        let h = NonNull::new(host.as_ptr().cast_mut()).expect("non-null");
        assert_eq!(fake.pointer_device(h).expect("query"), None, "host memory");
        // SAFETY: allocated above, unused now.
        unsafe { fake.free(d) }.expect("free");
        assert_eq!(fake.pointer_device(d).expect("query"), None, "freed memory is no device's");
    }

    #[test]
    fn copies_that_lie_about_their_direction_are_refused() {
        let fake = FakeRuntime::new(1);
        fake.set_device(0).expect("device 0");
        let d = fake.malloc(1024).expect("malloc");
        let mut host = vec![0u8; 1024];
        let h = NonNull::new(host.as_mut_ptr()).expect("non-null");
        // SAFETY: both ranges are 1024 live bytes; the fake checks the claimed kinds before copying.
        unsafe {
            assert!(fake.memcpy(h, d, 1024, CopyKind::HostToDevice).is_err(), "dst is host memory");
            assert!(fake.memcpy(d, h, 1024, CopyKind::HostToHost).is_err(), "dst is device memory");
            assert!(fake.memcpy(h, d, 1024, CopyKind::DeviceToHost).is_ok());
        }
        assert_eq!(fake.stats().refused_copies, 2);
        // SAFETY: allocated above, unused now.
        unsafe { fake.free(d) }.expect("free");
    }

    #[test]
    fn injected_malloc_failures_and_registrations() {
        let fake = FakeRuntime::new(1);
        fake.set_device(0).expect("device 0");
        fake.fail_mallocs_after(1);
        let a = fake.malloc(64).expect("first allocation");
        let err = fake.malloc(64).expect_err("second fails");
        assert!(err.is_out_of_memory(), "{err}");
        let host = [0u8; 64];
        let h = NonNull::new(host.as_ptr().cast_mut()).expect("non-null");
        // SAFETY: `host` outlives the registration.
        unsafe {
            fake.host_register(h, 64).expect("register");
            assert!(fake.host_register(h, 64).is_err(), "twice");
            assert!(fake.is_host_registered(h));
            fake.host_unregister(h).expect("unregister");
            assert!(fake.host_unregister(h).is_err(), "unknown");
            fake.free(a).expect("free");
        }
    }
}
