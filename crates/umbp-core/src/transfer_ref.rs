//! Endpoint descriptors and the registration capability handed to media.

use std::fmt;
#[cfg(unix)]
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::RegistrationError;

/// Where a piece of memory lives. Together with the pointer this is what lets the transfer layer pick
/// an engine, and it is the one fact a descriptor cannot recover by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MemoryLocation {
    /// Host memory addressable by the CPU.
    #[default]
    Host,
    /// Device memory of one GPU.
    Gpu {
        /// The device ordinal.
        device: u32,
    },
}

impl MemoryLocation {
    /// Whether this is host memory.
    pub const fn is_host(self) -> bool {
        matches!(self, Self::Host)
    }

    /// The device ordinal, `None` for host memory.
    pub const fn device(self) -> Option<u32> {
        match self {
            Self::Host => None,
            Self::Gpu { device } => Some(device),
        }
    }
}

/// A process-local memory region: a pointer, a length and where the memory lives.
///
/// # Invariant
/// `ptr` is valid for reads and writes of `len` bytes for as long as the region is registered with a
/// transfer engine (and therefore for as long as any [`TransferRef`] carrying it is used). For
/// [`MemoryLocation::Gpu`] the pointer is a device pointer and must only be handed to the GPU runtime.
/// The invariant is established by the `unsafe` constructor; the medium that owns the memory upholds it
/// by deregistering before it releases the memory.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalRegion {
    ptr: NonNull<u8>,
    len: u64,
    location: MemoryLocation,
}

// SAFETY: a `LocalRegion` is an address and a length; whoever dereferences it does so under the
// invariant above, and the memory behind it is plain bytes with no thread affinity.
unsafe impl Send for LocalRegion {}
// SAFETY: as above; shared references only copy the address.
unsafe impl Sync for LocalRegion {}

impl LocalRegion {
    /// Describes `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes (host memory, or device memory of the
    /// named GPU) until every registration of this region has been deregistered and no copy of it is
    /// used any more.
    pub const unsafe fn new(ptr: NonNull<u8>, len: u64, location: MemoryLocation) -> Self {
        Self { ptr, len, location }
    }

    /// The base address.
    pub const fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The length in bytes.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the memory lives.
    pub const fn location(&self) -> MemoryLocation {
        self.location
    }
}

impl fmt::Debug for LocalRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("location", &self.location)
            .finish()
    }
}

/// How a remote node reaches a registered region over the data plane: the region's id on the owning
/// node's data server and the server's address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// The data endpoint, `host:port`.
    pub endpoint: String,
    /// The region id assigned by the owning node's data server.
    pub region_id: u64,
}

/// A self-describing transfer endpoint: one buffer as every transport sees it.
///
/// A struct of merged per-transport handles rather than an enum, because one buffer is several things
/// at once: a host (or device) pointer for an in-process copy, and a remote region for a peer. A ref
/// with neither is invalid (what an out-of-range `buffer_ref` would have been in the reference; here
/// that is `None`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TransferRef {
    size: u64,
    location: MemoryLocation,
    local: Option<LocalRegion>,
    /// Shared, so cloning a ref (once per page of every transfer) never allocates.
    remote: Option<Arc<RemoteRegion>>,
}

impl TransferRef {
    /// A ref for process-local memory with no transport handle yet.
    pub fn local(region: LocalRegion) -> Self {
        Self { size: region.len(), location: region.location(), local: Some(region), remote: None }
    }

    /// A ref for memory owned by another node, reachable only through `remote`.
    pub fn remote_only(remote: RemoteRegion, size: u64, location: MemoryLocation) -> Self {
        Self { size, location, local: None, remote: Some(Arc::new(remote)) }
    }

    /// The same ref with a remote handle attached (what registration with a data plane adds).
    pub fn with_remote(mut self, remote: RemoteRegion) -> Self {
        self.remote = Some(Arc::new(remote));
        self
    }

    /// The same ref narrowed to its first `size` bytes (a medium publishes only whole pages).
    ///
    /// Never grows the ref: a larger `size` is clamped to the current one.
    pub fn truncated(mut self, size: u64) -> Self {
        self.size = self.size.min(size);
        // Narrow the local view too, so no engine can bound a copy by the wider mapped length.
        if let Some(local) = self.local.as_mut() {
            local.len = local.len.min(self.size);
        }
        self
    }

    /// Usable bytes behind the ref.
    pub const fn size(&self) -> u64 {
        self.size
    }

    /// Host or GPU memory.
    pub const fn location(&self) -> MemoryLocation {
        self.location
    }

    /// The process-local region, when this process can address the memory.
    pub const fn local_region(&self) -> Option<&LocalRegion> {
        self.local.as_ref()
    }

    /// The remote handle, when a data plane registered the memory.
    pub fn remote(&self) -> Option<&RemoteRegion> {
        self.remote.as_deref()
    }

    /// Whether this process can address the bytes directly.
    pub fn has_local(&self) -> bool {
        self.local.is_some() && self.size > 0
    }

    /// Whether a remote node can reach the bytes.
    pub fn has_remote(&self) -> bool {
        self.remote.is_some() && self.size > 0
    }

    /// Whether any transport can use the ref.
    pub fn is_valid(&self) -> bool {
        self.has_local() || self.has_remote()
    }
}

/// The file behind a shareable host region: a sealed memory file (a Linux `memfd`) that another
/// process on the same host may map, and the byte offset in it where the region starts.
///
/// A medium whose memory can be shared hands this to
/// [`MemoryRegistrar::register_shareable`]; a registrar that serves same-host peers keeps its own
/// duplicate of the descriptor (the borrow ends with the call) and drops it in
/// [`deregister`](MemoryRegistrar::deregister). The medium keeps the file sealed against shrinking,
/// so no process that maps it can take a `SIGBUS` from a truncation.
#[cfg(unix)]
#[derive(Debug, Clone, Copy)]
pub struct SharedBacking<'fd> {
    fd: BorrowedFd<'fd>,
    offset: u64,
}

#[cfg(unix)]
impl<'fd> SharedBacking<'fd> {
    /// The region lives in the file `fd`, from byte `offset` on.
    pub const fn new(fd: BorrowedFd<'fd>, offset: u64) -> Self {
        Self { fd, offset }
    }

    /// The file.
    pub const fn fd(&self) -> BorrowedFd<'fd> {
        self.fd
    }

    /// Where the region starts in the file.
    pub const fn offset(&self) -> u64 {
        self.offset
    }
}

/// The registration capability of the transfer layer, and the only part of it a medium may see.
///
/// A medium registers each buffer it owns in `init` and deregisters it in `shutdown`, before it
/// releases the memory (an engine may still hold a mapping of those pages). It has no way to move
/// bytes through this trait: that is the point.
pub trait MemoryRegistrar: Send + Sync + fmt::Debug {
    /// Registers `region` with every transport and returns the merged ref. The returned ref always
    /// carries `region` as its local part.
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError>;

    /// Registers `region`, whose bytes are also the file `backing` describes, so that a transport
    /// serving same-host peers may hand them the file to map. The default ignores the file and is
    /// [`register_memory`](Self::register_memory): every registrar that cannot share memory stays as
    /// it is. Undone by [`deregister`](Self::deregister), as a plain registration is.
    #[cfg(unix)]
    fn register_shareable(
        &self,
        region: LocalRegion,
        backing: SharedBacking<'_>,
    ) -> Result<TransferRef, RegistrationError> {
        let _ = backing;
        self.register_memory(region)
    }

    /// Undoes [`register_memory`](Self::register_memory). Deregistering a ref twice, or one this
    /// registrar never issued, is a no-op.
    fn deregister(&self, r: &TransferRef);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refs_merge_local_and_remote_handles() {
        let mut buf = [0u8; 64];
        // SAFETY: `buf` outlives every use of the region in this test.
        let region = unsafe { LocalRegion::new(NonNull::from(&mut buf).cast(), 64, MemoryLocation::Host) };
        let r = TransferRef::local(region);
        assert!(r.has_local() && !r.has_remote() && r.is_valid());
        let r = r.with_remote(RemoteRegion { endpoint: "127.0.0.1:1".into(), region_id: 7 });
        assert!(r.has_local() && r.has_remote());
        assert_eq!(r.clone().truncated(1000).size(), 64, "truncation never grows a ref");
        assert_eq!(r.clone().truncated(32).size(), 32);
        assert_eq!(
            r.clone().truncated(32).local_region().map(LocalRegion::len),
            Some(32),
            "the local view narrows too"
        );
        let empty = TransferRef::local(region).truncated(0);
        assert!(!empty.is_valid());
    }

    #[cfg(unix)]
    #[test]
    fn register_shareable_defaults_to_register_memory() {
        use std::os::fd::AsFd;
        use std::sync::atomic::{AtomicUsize, Ordering};

        #[derive(Debug, Default)]
        struct Counting(AtomicUsize);
        impl MemoryRegistrar for Counting {
            fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
                self.0.fetch_add(1, Ordering::SeqCst);
                Ok(TransferRef::local(region))
            }
            fn deregister(&self, _: &TransferRef) {}
        }

        let mut buf = [0u8; 64];
        // SAFETY: `buf` outlives every use of the region in this test.
        let region = unsafe { LocalRegion::new(NonNull::from(&mut buf).cast(), 64, MemoryLocation::Host) };
        let file = std::fs::File::open("/dev/null").expect("/dev/null");
        let backing = SharedBacking::new(file.as_fd(), 4096);
        assert_eq!(backing.offset(), 4096);
        let registrar = Counting::default();
        let r = registrar.register_shareable(region, backing).expect("registered");
        assert_eq!(registrar.0.load(Ordering::SeqCst), 1, "the default is one plain registration");
        assert_eq!(r.local_region(), Some(&region));
    }

    #[test]
    fn location_reports_device() {
        assert_eq!(MemoryLocation::Gpu { device: 3 }.device(), Some(3));
        assert!(MemoryLocation::Host.is_host());
    }
}
