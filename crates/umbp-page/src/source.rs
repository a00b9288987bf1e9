//! The seam a paged medium implements.

use std::fmt;
use std::os::fd::{BorrowedFd, RawFd};
use std::ptr::NonNull;

use umbp_core::{MemoryLocation, SharedBacking};

/// One buffer handed out by a [`PageMemorySource`]: a base address and its **usable** size (which may
/// exceed the request, e.g. after huge-page rounding; `PageBackend` publishes what is reported), and,
/// for memory another process on the same host may map, the file behind it
/// ([`shared_backing`](Self::shared_backing)), which `PageBackend` hands to
/// [`MemoryRegistrar::register_shareable`](umbp_core::MemoryRegistrar::register_shareable).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct RawBuffer {
    base: NonNull<u8>,
    len: u64,
    /// The file descriptor of the memory file behind the buffer and the buffer's offset in it.
    shared: Option<(RawFd, u64)>,
}

// SAFETY: a `RawBuffer` is an address and a length of memory owned by its source; it carries no
// thread affinity and is only dereferenced by the transfer layer under `LocalRegion`'s invariant.
unsafe impl Send for RawBuffer {}
// SAFETY: as above; sharing copies the address only.
unsafe impl Sync for RawBuffer {}

impl RawBuffer {
    /// Describes `len` usable bytes at `base`.
    ///
    /// # Safety
    /// `base` must be valid for reads and writes of `len` bytes (in the source's location) until the
    /// source that produced it is released.
    pub const unsafe fn new(base: NonNull<u8>, len: u64) -> Self {
        Self { base, len, shared: None }
    }

    /// Describes `len` usable bytes at `base` that are also the bytes of the file `fd` from byte
    /// `offset` on (a `MAP_SHARED` mapping of a sealed memory file), so a same-host peer may map them.
    ///
    /// # Safety
    /// As [`new`](Self::new); and `fd` must stay open, and its bytes `offset..offset + len` must stay
    /// the bytes at `base`, until the source that produced the buffer is released.
    pub unsafe fn new_shared(base: NonNull<u8>, len: u64, fd: BorrowedFd<'_>, offset: u64) -> Self {
        use std::os::fd::AsRawFd as _;
        Self { base, len, shared: Some((fd.as_raw_fd(), offset)) }
    }

    /// The file behind the buffer and where the buffer starts in it, when the source made the memory
    /// shareable; `None` for private memory. Valid while the source holds the buffer (the contract of
    /// [`new_shared`](Self::new_shared)).
    pub fn shared_backing(&self) -> Option<SharedBacking<'_>> {
        self.shared.map(|(fd, offset)| {
            // SAFETY: `new_shared`'s contract keeps `fd` open until the source is released, and a
            // `RawBuffer` is only used while its source holds it (as its base pointer is).
            SharedBacking::new(unsafe { BorrowedFd::borrow_raw(fd) }, offset)
        })
    }

    /// The base address (a device pointer for GPU sources).
    pub const fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// Usable bytes.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer is empty.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for RawBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RawBuffer")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("shared", &self.shared)
            .finish()
    }
}

/// Why a source could not provide memory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The operating system or device refused the allocation.
    #[error("{source_name}: allocating {requested} bytes failed")]
    Allocation {
        /// The source.
        source_name: String,
        /// Bytes asked for in the failing call.
        requested: u64,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The request can never be served (e.g. a size that overflows when rounded up).
    #[error("{source_name}: invalid request: {reason}")]
    Invalid {
        /// The source.
        source_name: String,
        /// Why.
        reason: String,
    },
}

impl SourceError {
    /// What the caller should do next: an allocation the system refused may succeed once memory is
    /// freed ([`ErrorKind::Retry`](umbp_core::ErrorKind::Retry), as [`BackendError::OutOfMemory`](umbp_core::BackendError::OutOfMemory));
    /// an invalid request never does.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::Allocation { .. } => umbp_core::ErrorKind::Retry,
            Self::Invalid { .. } => umbp_core::ErrorKind::InvalidInput,
        }
    }
}

/// Where a paged medium gets memory. Slots, leases and events are [`PageBackend`](crate::PageBackend)'s
/// job; a source only allocates, releases and says where its memory lives.
///
/// [`location`](Self::location) and [`device`](Self::device) are the facts a descriptor cannot
/// recover: `PageBackend` mirrors them into every [`TransferRef`](umbp_core::TransferRef) it publishes,
/// and a wrong answer makes a local transfer pick the wrong engine with no error at build or init time.
///
/// A new paged medium is one of these (a sketch over the global allocator;
/// [`HostPageMemorySource`](crate::HostPageMemorySource) is the real host one, with `mmap`, NUMA
/// binding and huge pages):
///
/// ```
/// use std::alloc::{Layout, alloc_zeroed, dealloc};
/// use std::ptr::NonNull;
/// use std::sync::{Arc, Mutex};
/// use umbp_core::{MediumBackend, MemoryLocation, TierType};
/// use umbp_page::{PageBackend, PageBackendConfig, PageMemorySource, RawBuffer, SourceError};
///
/// #[derive(Debug, Default)]
/// struct HeapSource {
///     held: Mutex<Vec<(NonNull<u8>, Layout)>>,
/// }
///
/// // SAFETY: the pointers are plain heap memory, owned by the source, with no thread affinity.
/// unsafe impl Send for HeapSource {}
/// // SAFETY: as above; the list is behind a mutex.
/// unsafe impl Sync for HeapSource {}
///
/// impl PageMemorySource for HeapSource {
///     fn allocate(&self, sizes: &[u64]) -> Result<Vec<RawBuffer>, SourceError> {
///         let invalid = |reason: &str| SourceError::Invalid { source_name: "heap".into(), reason: reason.into() };
///         let mut held = self.held.lock().expect("not poisoned");
///         let mut out = Vec::new();
///         for &size in sizes.iter().filter(|&&s| s > 0) {
///             let layout = usize::try_from(size)
///                 .ok()
///                 .and_then(|len| Layout::from_size_align(len, 4096).ok())
///                 .ok_or_else(|| invalid("size past the address space"))?;
///             // SAFETY: `layout` has a non-zero size.
///             let base = NonNull::new(unsafe { alloc_zeroed(layout) }).ok_or_else(|| invalid("out of memory"))?;
///             held.push((base, layout));
///             // SAFETY: `base` holds `size` bytes until `release` frees it.
///             out.push(unsafe { RawBuffer::new(base, size) });
///         }
///         Ok(out) // (a real source gives back what this call got when a later size fails)
///     }
///
///     fn release(&self) {
///         for (base, layout) in self.held.lock().expect("not poisoned").drain(..) {
///             // SAFETY: allocated above with this layout, freed once (drained).
///             unsafe { dealloc(base.as_ptr(), layout) };
///         }
///     }
///
///     fn location(&self) -> MemoryLocation {
///         MemoryLocation::Host
///     }
///
///     fn name(&self) -> &str {
///         "heap"
///     }
/// }
///
/// // Everything after allocation is PageBackend's.
/// let config = PageBackendConfig::new(TierType::Dram, 4096, vec![64 << 10]);
/// let backend = PageBackend::new(config, Box::new(HeapSource::default())).expect("a valid geometry");
/// backend.init(Arc::new(umbp_testkit::LocalOnlyRegistrar::new())).expect("memory");
/// assert_eq!(backend.capacity().total_bytes, 64 << 10);
/// backend.shutdown();
/// ```
pub trait PageMemorySource: Send + Sync + fmt::Debug + 'static {
    /// One buffer per non-zero size (zero sizes are skipped, so the result may be shorter than
    /// `sizes`), all or nothing: on failure everything this call obtained is given back and nothing
    /// from earlier calls is touched. Reports usable sizes.
    fn allocate(&self, sizes: &[u64]) -> Result<Vec<RawBuffer>, SourceError>;

    /// Gives back every buffer this source handed out. Idempotent. The caller deregisters the buffers
    /// first.
    fn release(&self);

    /// Where the memory lives (for GPU memory: which device — fixed at construction, never the calling
    /// thread's current device).
    fn location(&self) -> MemoryLocation;

    /// The device ordinal, `None` for host memory. Must agree with [`location`](Self::location).
    fn device(&self) -> Option<u32> {
        self.location().device()
    }

    /// A short name for logs.
    fn name(&self) -> &str;
}

#[cfg(test)]
mod tests {
    use umbp_core::ErrorKind;

    use super::*;

    #[test]
    fn a_refused_allocation_is_retry_and_an_invalid_request_is_invalid_input() {
        let refused = SourceError::Allocation {
            source_name: "host".into(),
            requested: 1 << 30,
            source: std::io::Error::from(std::io::ErrorKind::OutOfMemory),
        };
        assert_eq!(refused.kind(), ErrorKind::Retry);
        assert!(std::error::Error::source(&refused).is_some(), "the OS error stays the source");
        let invalid = SourceError::Invalid { source_name: "host".into(), reason: "overflow".into() };
        assert_eq!(invalid.kind(), ErrorKind::InvalidInput);
    }
}
