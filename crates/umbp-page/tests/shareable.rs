//! A `PageBackend` over shareable host memory tells its registrar each buffer's memory file
//! (`register_shareable`), the file maps to the very bytes the backend's refs describe, and private
//! memory keeps the plain registration.

use std::os::fd::{AsFd, OwnedFd};
use std::ptr;
use std::sync::Arc;

use rustix::mm::{MapFlags, ProtFlags};
use std::sync::Mutex;
use umbp_core::{LocalRegion, MediumBackend, MemoryRegistrar, RegistrationError, SharedBacking, TierType, TransferRef};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};

/// What a registration carried: the region, and for a shareable one a duplicate of its file and the
/// offset (a registrar keeps its own descriptor; the borrow ends with the call).
#[derive(Debug, Default)]
struct Recording {
    plain: Mutex<Vec<LocalRegion>>,
    shared: Mutex<Vec<(LocalRegion, OwnedFd, u64)>>,
    deregistered: Mutex<usize>,
}

impl MemoryRegistrar for Recording {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.plain.lock().expect("not poisoned").push(region);
        Ok(TransferRef::local(region))
    }

    fn register_shareable(
        &self,
        region: LocalRegion,
        backing: SharedBacking<'_>,
    ) -> Result<TransferRef, RegistrationError> {
        let fd = backing
            .fd()
            .try_clone_to_owned()
            .map_err(|e| RegistrationError::Refused { transport: "recording".into(), reason: e.to_string() })?;
        self.shared.lock().expect("not poisoned").push((region, fd, backing.offset()));
        Ok(TransferRef::local(region))
    }

    fn deregister(&self, _: &TransferRef) {
        *self.deregistered.lock().expect("not poisoned") += 1;
    }
}

fn backend(shareable: bool) -> PageBackend {
    let source = HostPageMemorySource::new(HostMemoryOptions { shareable, ..HostMemoryOptions::default() });
    PageBackend::new(PageBackendConfig::new(TierType::Dram, 4096, vec![16 << 10, 64 << 10]), Box::new(source))
        .expect("a valid geometry")
}

#[test]
fn shareable_buffers_are_registered_with_their_file() {
    let registrar = Arc::new(Recording::default());
    let b = backend(true);
    b.init(registrar.clone()).expect("init");
    assert!(registrar.plain.lock().expect("not poisoned").is_empty(), "no plain registration for shareable memory");
    let shared = registrar.shared.lock().expect("not poisoned");
    assert_eq!(shared.len(), 2, "one registration per buffer");
    for (i, (region, fd, offset)) in shared.iter().enumerate() {
        assert_eq!(*offset, 0, "each buffer is its own file");
        let len = region.len() as usize;
        // The file is what a same-host peer maps: the same bytes as the region.
        // SAFETY: a fresh shared mapping of the buffer's file (null hint, no MAP_FIXED), unmapped below.
        let peer = unsafe {
            rustix::mm::mmap(ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd.as_fd(), 0)
        }
        .expect("map the file");
        // SAFETY: the region is registered (live until shutdown below) and `peer` maps `len` bytes.
        let (mine, theirs) = unsafe {
            (
                std::slice::from_raw_parts_mut(region.ptr().as_ptr(), len),
                std::slice::from_raw_parts_mut(peer.cast::<u8>(), len),
            )
        };
        mine[len - 1] = 0x40 + i as u8;
        assert_eq!(theirs[len - 1], 0x40 + i as u8);
        // SAFETY: unmapping the mapping made above, once.
        unsafe { rustix::mm::munmap(peer, len) }.expect("munmap");
    }
    drop(shared);
    b.shutdown();
    assert_eq!(*registrar.deregistered.lock().expect("not poisoned"), 2, "deregistered as plain registrations are");
}

#[test]
fn private_buffers_keep_the_plain_registration() {
    let registrar = Arc::new(Recording::default());
    let b = backend(false);
    b.init(registrar.clone()).expect("init");
    assert_eq!(registrar.plain.lock().expect("not poisoned").len(), 2);
    assert!(registrar.shared.lock().expect("not poisoned").is_empty());
    b.shutdown();
}

#[test]
fn a_registrar_without_sharing_serves_shareable_memory_as_before() {
    // The testkit's registrar has only `register_memory`: the default `register_shareable` uses it.
    let b = backend(true);
    b.init(Arc::new(umbp_testkit::LocalOnlyRegistrar::new())).expect("init");
    assert_eq!(b.capacity().total_bytes, 80 << 10);
    b.shutdown();
}
