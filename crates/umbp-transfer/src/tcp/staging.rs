//! The host staging buffer through which a data server connection moves the bytes of GPU regions:
//! the CPU (and the socket) cannot touch device memory, so a WRITE payload is read from the socket
//! into staging and copied host → device with the GPU runtime, and a READ payload is copied
//! device → host into staging and written to the socket from there.
//!
//! One buffer per connection, allocated when the connection first serves a GPU region (host-only
//! traffic never pays for it), page-locked with the runtime where it allows (direct DMA), bounded by
//! [`DataServerConfig::gpu_staging_bytes`](super::DataServerConfig::gpu_staging_bytes): a larger
//! request moves in pieces.

use std::ptr::NonNull;
use std::sync::Arc;

use umbp_gpu::{DeviceGuard, GpuRuntime};

/// A private anonymous mapping, pinned with `runtime` when the runtime accepts it; unpinned and
/// unmapped on drop.
#[derive(Debug)]
pub(crate) struct DeviceStaging {
    base: NonNull<u8>,
    len: usize,
    /// The runtime that pinned the buffer and the device current while it did, if it did.
    pinned: Option<(Arc<dyn GpuRuntime>, u32)>,
}

impl DeviceStaging {
    /// Maps `len` (> 0) bytes and tries to pin them with `runtime`, under a scoped switch to
    /// `device` (the device of the region that needs staging: the connection touches no other, and
    /// unpins under the same device); `Err` is the reason for a log line (the mapping failed). A
    /// runtime that refuses to pin leaves the buffer usable, pageable.
    pub(crate) fn new(runtime: &Arc<dyn GpuRuntime>, device: u32, len: usize) -> Result<Self, String> {
        // SAFETY: a fresh private anonymous mapping aliases nothing; it is unmapped in `Drop`.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(|e| format!("mapping {len} bytes of GPU staging: {e}"))?;
        let Some(base) = NonNull::new(ptr.cast::<u8>()) else {
            return Err("mmap returned null".into());
        };
        let pinned = match DeviceGuard::switch(runtime.as_ref(), device).and_then(|_guard| {
            // SAFETY: the mapping is valid host memory of `len` bytes until `Drop`, which unpins it
            // before unmapping.
            unsafe { runtime.host_register(base, len) }
        }) {
            Ok(()) => Some((Arc::clone(runtime), device)),
            Err(e) => {
                tracing::debug!(runtime = runtime.name(), error = %e, len, "GPU staging left unpinned");
                None
            }
        };
        Ok(Self { base, len, pinned })
    }

    /// The buffer's first byte.
    pub(crate) fn ptr(&self) -> NonNull<u8> {
        self.base
    }

    /// The buffer's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the runtime pinned the buffer.
    #[cfg(test)]
    pub(crate) fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }
}

impl Drop for DeviceStaging {
    fn drop(&mut self) {
        if let Some((runtime, device)) = self.pinned.take() {
            let unpinned = DeviceGuard::switch(runtime.as_ref(), device).and_then(|_guard| {
                // SAFETY: `base` is the base of this runtime's registration (made in `new`); every
                // copy through the buffer is synchronous, so none is in flight once its owner drops it.
                unsafe { runtime.host_unregister(self.base) }
            });
            if let Err(e) = unpinned {
                tracing::warn!(runtime = runtime.name(), error = %e, "could not unpin the GPU staging buffer");
            }
        }
        // SAFETY: the mapping made in `new`, unpinned above; nothing references it any more.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use umbp_gpu::FakeRuntime;

    use super::*;

    #[test]
    fn staging_is_pinned_with_the_runtime_and_unpinned_on_drop() {
        let fake = Arc::new(FakeRuntime::new(1));
        let runtime: Arc<dyn GpuRuntime> = Arc::clone(&fake) as Arc<dyn GpuRuntime>;
        let staging = DeviceStaging::new(&runtime, 0, 64 << 10).expect("maps");
        assert!(staging.is_pinned());
        assert_eq!(staging.len(), 64 << 10);
        assert_eq!(fake.stats().host_registers, 1);
        drop(staging);
        assert_eq!(fake.stats().host_unregisters, 1);
    }
}
