//! `HbmPageMemorySource` and `make_hbm_backend`.

use std::fmt;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_core::{BackendError, MediumBackend, MemoryLocation, TierType};
use umbp_gpu::{DeviceGuard, GpuError, GpuRuntime, RuntimeSelection};
use umbp_page::{PageBackend, PageBackendConfig, PageMemorySource, RawBuffer, SourceError};

const NAME: &str = "HbmPageMemorySource";

/// Errors of the HBM medium's construction.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HbmError {
    /// The configured device does not exist, or the runtime failed to answer.
    #[error("GPU device {device}: {source}")]
    Device {
        /// The configured device.
        device: u32,
        /// The runtime's error.
        #[source]
        source: GpuError,
    },
    /// The backend configuration is invalid (no capacity, a page larger than the capacity, …).
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Settings of an HBM medium: the one place their names (the settings file's `[node.hbm]` keys),
/// defaults and meaning are written.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HbmConfig {
    /// The GPU whose memory is lent (an ordinal of the runtime). Default: 0.
    pub device: u32,
    /// Bytes of device memory to lend, as one allocation (`"1GiB"` or bytes). Default: 1 GiB.
    #[serde(with = "umbp_core::units::serde::size")]
    pub capacity_bytes: u64,
    /// The GPU runtime a node opens for this medium (`auto` finds HIP or CUDA; `fake` serves host
    /// memory, for tests and demos). [`make_hbm_backend`] is handed the runtime itself. Default:
    /// auto.
    #[serde(with = "umbp_core::units::serde::from_str")]
    pub runtime: RuntimeSelection,
}

impl Default for HbmConfig {
    fn default() -> Self {
        Self { device: 0, capacity_bytes: 1 << 30, runtime: RuntimeSelection::Auto }
    }
}

impl HbmConfig {
    /// Lends `capacity_bytes` of device `device` (runtime: auto).
    pub fn new(device: u32, capacity_bytes: u64) -> Self {
        Self { device, capacity_bytes, ..Self::default() }
    }

    /// Sets the device.
    pub fn with_device(mut self, device: u32) -> Self {
        self.device = device;
        self
    }

    /// Sets the capacity.
    pub fn with_capacity_bytes(mut self, capacity_bytes: u64) -> Self {
        self.capacity_bytes = capacity_bytes;
        self
    }
}

/// Device memory of one GPU as a [`PageMemorySource`].
///
/// The device is fixed at construction and never the calling thread's current device: allocation and
/// release run under a [`DeviceGuard`] that switches to it and restores the caller's device.
/// Allocation is all or nothing (a failure frees what the same call obtained); usable sizes are the
/// exact requests (device allocations are not rounded up in a way we can use). Dropping the source
/// releases its memory.
pub struct HbmPageMemorySource {
    runtime: Arc<dyn GpuRuntime>,
    device: u32,
    /// Live allocations: (base, length).
    buffers: Mutex<Vec<(NonNull<u8>, u64)>>,
}

// SAFETY: the source holds device addresses and a thread-safe runtime; the addresses are only handed to
// the runtime (free) and published as descriptors, under the mutex.
unsafe impl Send for HbmPageMemorySource {}
// SAFETY: as above; every access to `buffers` is under its mutex.
unsafe impl Sync for HbmPageMemorySource {}

impl fmt::Debug for HbmPageMemorySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("runtime", &self.runtime.name())
            .field("device", &self.device)
            .field("buffers", &self.buffers.lock().len())
            .finish()
    }
}

impl HbmPageMemorySource {
    /// A source over device `device` of `runtime`; fails if the runtime has no such device. Nothing is
    /// allocated until [`allocate`](PageMemorySource::allocate).
    pub fn new(runtime: Arc<dyn GpuRuntime>, device: u32) -> Result<Self, HbmError> {
        let count = runtime.device_count().map_err(|source| HbmError::Device { device, source })?;
        if device >= count {
            return Err(HbmError::Device { device, source: GpuError::InvalidDevice { device, count } });
        }
        Ok(Self { runtime, device, buffers: Mutex::new(Vec::new()) })
    }

    /// The runtime.
    pub fn runtime(&self) -> &Arc<dyn GpuRuntime> {
        &self.runtime
    }

    /// Bytes of device memory held now.
    pub fn allocated_bytes(&self) -> u64 {
        self.buffers.lock().iter().map(|(_, len)| len).sum()
    }

    fn failure(&self, requested: u64, error: GpuError) -> SourceError {
        let kind = if error.is_out_of_memory() { io::ErrorKind::OutOfMemory } else { io::ErrorKind::Other };
        SourceError::Allocation {
            source_name: format!("{NAME}(device {})", self.device),
            requested,
            source: io::Error::new(kind, error),
        }
    }

    /// Frees `buffers` on this source's device (the caller holds a guard for it).
    fn free_all(&self, buffers: Vec<(NonNull<u8>, u64)>) {
        for (base, len) in buffers {
            // SAFETY: each buffer came from `malloc` of this runtime in `allocate` and is freed once (it
            // was removed from `self.buffers`, or never added); `release`'s contract says the caller
            // deregistered it, so no copy uses it.
            if let Err(e) = unsafe { self.runtime.free(base) } {
                tracing::warn!(source = NAME, device = self.device, bytes = len, error = %e, "device free failed");
            }
        }
    }
}

impl Drop for HbmPageMemorySource {
    fn drop(&mut self) {
        self.release();
    }
}

impl PageMemorySource for HbmPageMemorySource {
    fn allocate(&self, sizes: &[u64]) -> Result<Vec<RawBuffer>, SourceError> {
        let guard =
            DeviceGuard::switch(self.runtime.as_ref(), self.device).map_err(|e| self.failure(sizes.iter().sum(), e))?;
        // Held across the allocations: a concurrent `release` must not miss a call in flight.
        let mut held = self.buffers.lock();
        let mut taken: Vec<(NonNull<u8>, u64)> = Vec::new();
        for &size in sizes.iter().filter(|&&s| s != 0) {
            let result = usize::try_from(size)
                .map_err(|_| GpuError::Invalid(format!("{size} bytes do not fit this address space")))
                .and_then(|bytes| self.runtime.malloc(bytes));
            match result {
                Ok(base) => taken.push((base, size)),
                Err(e) => {
                    // All or nothing: give back this call's buffers only.
                    self.free_all(taken);
                    drop(guard);
                    return Err(self.failure(size, e));
                }
            }
        }
        let out = taken
            .iter()
            // SAFETY: each base is a live device allocation of exactly `len` bytes, valid until
            // `release` frees it.
            .map(|&(base, len)| unsafe { RawBuffer::new(base, len) })
            .collect();
        held.extend(taken);
        drop(guard);
        Ok(out)
    }

    fn release(&self) {
        let buffers = std::mem::take(&mut *self.buffers.lock());
        if buffers.is_empty() {
            return;
        }
        match DeviceGuard::switch(self.runtime.as_ref(), self.device) {
            Ok(_guard) => self.free_all(buffers),
            Err(e) => {
                // Freeing on the wrong device would fail too; the memory goes with the process.
                tracing::error!(source = NAME, device = self.device, error = %e, "cannot switch to the device; device memory leaked");
            }
        }
    }

    fn location(&self) -> MemoryLocation {
        MemoryLocation::Gpu { device: self.device }
    }

    fn name(&self) -> &str {
        NAME
    }
}

/// Builds the HBM medium: a [`PageBackend`] for tier HBM over one allocation of
/// `config.capacity_bytes` on `config.device`, returned as the interface (only the composition root
/// names concrete backends). `backend` supplies the page size, TTLs, leases and clock; its tier and
/// buffer sizes are replaced by the HBM ones. Nothing is allocated until `init`.
pub fn make_hbm_backend(
    runtime: Arc<dyn GpuRuntime>,
    config: &HbmConfig,
    backend: PageBackendConfig,
) -> Result<Box<dyn MediumBackend>, HbmError> {
    let source = HbmPageMemorySource::new(runtime, config.device)?;
    let backend = PageBackendConfig { tier: TierType::Hbm, buffer_sizes: vec![config.capacity_bytes], ..backend };
    Ok(Box::new(PageBackend::new(backend, Box::new(source))?))
}

#[cfg(test)]
mod tests {
    use umbp_gpu::FakeRuntime;

    use super::*;

    #[test]
    fn allocates_on_its_own_device_and_restores_the_callers() {
        let fake = Arc::new(FakeRuntime::new(3));
        fake.set_device(2).expect("device 2");
        let source = HbmPageMemorySource::new(Arc::clone(&fake) as Arc<dyn GpuRuntime>, 1).expect("device 1 exists");
        let buffers = source.allocate(&[4096, 0, 8192]).expect("allocate");
        assert_eq!(buffers.len(), 2, "zero sizes are skipped");
        assert_eq!(buffers.iter().map(RawBuffer::len).collect::<Vec<_>>(), vec![4096, 8192], "usable = requested");
        for b in &buffers {
            assert_eq!(FakeRuntime::device_of(b.base(), b.len() as usize), Some(1), "memory of the fixed device");
        }
        assert_eq!(fake.current_device().expect("current"), Some(2), "the caller's device is restored");
        assert_eq!(source.location(), MemoryLocation::Gpu { device: 1 });
        assert_eq!(source.device(), Some(1));
        source.release();
        source.release();
        assert_eq!(fake.live_bytes(), 0, "release frees everything, and is idempotent");
    }

    #[test]
    fn allocation_is_all_or_nothing() {
        let fake = Arc::new(FakeRuntime::new(1));
        let source = HbmPageMemorySource::new(Arc::clone(&fake) as Arc<dyn GpuRuntime>, 0).expect("device 0");
        let kept = source.allocate(&[1024]).expect("first call");
        fake.fail_mallocs_after(2);
        let err = source.allocate(&[1024, 1024, 1024]).expect_err("third allocation fails");
        assert!(matches!(err, SourceError::Allocation { .. }), "{err}");
        assert_eq!(fake.live_bytes(), 1024, "this call's buffers are freed, the earlier call's kept");
        assert_eq!(source.allocated_bytes(), 1024);
        assert_eq!(kept.len(), 1);
        drop(source);
        assert_eq!(fake.live_bytes(), 0, "drop releases");
    }

    #[test]
    fn a_missing_device_is_refused_at_construction() {
        let fake: Arc<dyn GpuRuntime> = Arc::new(FakeRuntime::new(2));
        let err = HbmPageMemorySource::new(fake, 2).expect_err("no device 2");
        assert!(matches!(err, HbmError::Device { device: 2, .. }), "{err}");
    }

    #[test]
    fn make_hbm_backend_is_an_hbm_tier_page_backend() {
        let fake: Arc<dyn GpuRuntime> = Arc::new(FakeRuntime::new(1));
        let backend =
            make_hbm_backend(fake, &HbmConfig::new(0, 1 << 20), PageBackendConfig::new(TierType::Dram, 4096, vec![]))
                .expect("backend");
        assert_eq!(backend.tier(), TierType::Hbm);
        assert_eq!(backend.page_size(), 4096);
    }
}
