//! The SSD medium: values live in an append-only log on local drives and are served through one
//! registered host staging arena.
//!
//! A drive's bytes are not addressable by the transfer layer, so [`SsdBackend`] publishes an
//! ordinary registered host buffer (the staging arena, from [`umbp_page::HostPageMemorySource`])
//! and moves bytes between it and the drive itself: `batch_allocate` lends staging pages,
//! `batch_commit` spills them to a CRC-checked, segmented drive log and gives them back,
//! `batch_resolve` fills staging pages from the drive (one read for any number of concurrent
//! resolves of a key) under a counted read lease, and a restart recovers the log. How it works
//! and what it promises — durability, disk use, staging pressure, the differences from the
//! reference — is in `docs/ssd.md` of the repository.
//!
//! ```
//! use std::sync::Arc;
//! use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, ReadRelease};
//! use umbp_ssd::{SsdBackend, SsdConfig};
//! use umbp_testkit::LocalOnlyRegistrar;
//!
//! let dir = tempfile::tempdir()?;
//! let config = SsdConfig::builder([dir.path()])
//!     .page_size(4096)
//!     .capacity_bytes(1 << 20)
//!     .staging_pages(16)
//!     .segment_bytes(1 << 20)
//!     .build()?;
//! let ssd = SsdBackend::new(config);
//! // A transport would register the arena; a process-local registrar will do here.
//! ssd.init(Arc::new(LocalOnlyRegistrar::new()))?;
//!
//! // Allocate a slot, write the value into its staging page, commit it to the drive.
//! let slot = ssd.batch_allocate(&[AllocateRequest::new("greeting", 5)]).remove(0);
//! assert_eq!(slot.outcome, AllocateOutcome::Allocated);
//! let arena = ssd.buffer_ref(0).expect("the staging arena");
//! let base = arena.local_region().expect("host memory").ptr().as_ptr();
//! let at = |page: u32| u64::from(page) as usize * 4096;
//! // SAFETY: the page lies in the registered arena and belongs to this slot until its commit.
//! unsafe { std::ptr::copy_nonoverlapping(b"hello".as_ptr(), base.add(at(slot.pages[0].page_index)), 5) };
//! assert!(ssd.batch_commit(&[CommitRequest::new(slot.slot_id, "greeting")])[0].success);
//!
//! // Resolve it: staging pages holding the value, leased until the reader releases them.
//! ssd.drop_cached_copies(); // forget the clean copy the commit kept, so this reads the drive
//! let hit = ssd.batch_resolve(&["greeting".to_owned()], false).remove(0);
//! assert!(hit.found && hit.size == 5);
//! // SAFETY: the leased page lies in the arena and no one writes it while the lease is held.
//! let value = unsafe { std::slice::from_raw_parts(base.add(at(hit.pages[0].page_index)), 5) };
//! assert_eq!(value, b"hello");
//! ssd.release_reads(&[ReadRelease::new("greeting", hit.lease)]);
//! ssd.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Owns
//! The staging arena and its registration, the drive log and its index, slots, counted read leases, the
//! medium's LRU and the event outbox; the directories it is given, each locked (`.umbp-ssd.lock`)
//! from `init` to `shutdown`, so two media never share one.
//!
//! # Never
//! Moves bytes to or from a peer or names a transfer engine: `init` receives only a
//! [`MemoryRegistrar`](umbp_core::MemoryRegistrar). Never holds its lock across drive IO: every call
//! takes what it needs under the lock, does the IO without it and re-checks afterwards. This crate
//! may not depend on the transfer layer, the peer, the master, tonic or tokio (`cargo xtask ci`
//! checks it: `[package.metadata.umbp] layer = "backend"`).
//!
//! # Platforms
//! Linux only (`O_DIRECT`, `preadv`/`pwritev`, io_uring and the host staging source).

mod backend;
mod config;
#[doc(hidden)]
pub mod fuzzing;
mod io;
mod record;
mod staged;
mod store;

pub use backend::{SsdBackend, SsdStats};
pub use config::{IoEngineKind, SsdConfig, SsdConfigBuilder, SsdConfigError, SsdSettings, Watermarks};

/// Builds an SSD medium and returns it as the interface (only the composition root names concrete
/// backends).
pub fn make_ssd_backend(config: SsdConfig) -> Box<dyn umbp_core::MediumBackend> {
    Box::new(SsdBackend::new(config))
}

/// Whether this process may use io_uring (`Err` carries why not: ENOSYS, EPERM, …). Tests and the
/// command line use it to skip or refuse the `io_uring` engine with a clear message.
pub fn io_uring_available() -> std::io::Result<()> {
    io::make_engine(IoEngineKind::IoUring, 8, 1).map(|_| ())
}
