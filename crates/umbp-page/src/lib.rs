//! Paged storage media: anything whose bytes the transfer layer can address directly (host DRAM, GPU
//! HBM, CXL, a pmem mapping).
//!
//! A paged medium is one small type implementing [`PageMemorySource`] (five methods: where memory
//! comes from and where it lives). [`PageBackend`] is everything after allocation, written once for
//! every paged medium: the bitmap page allocator ([`PageBitmapAllocator`]), pending slots with a TTL
//! and a reaper thread, counted read leases (a reader's release ends its lease at once), copy pins, dedup, the clear generation, the allocation gate and
//! the event outbox. It never consults the tier.
//!
//! ```
//! use std::sync::Arc;
//! use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, ReadRelease, TierType};
//! use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
//! use umbp_testkit::LocalOnlyRegistrar;
//!
//! // 4 MiB of host DRAM in 64 KiB pages.
//! let config = PageBackendConfig::new(TierType::Dram, 64 << 10, vec![4 << 20]);
//! let source = HostPageMemorySource::new(HostMemoryOptions::default());
//! let dram = PageBackend::new(config, Box::new(source)).expect("a valid geometry");
//! // A node hands `init` its transfer engine; the medium only registers memory with it.
//! dram.init(Arc::new(LocalOnlyRegistrar::new())).expect("memory");
//!
//! // A put: reserve pages, let the transfer layer write them (the slot's `descs`), commit the key.
//! let slot = dram.batch_allocate(&[AllocateRequest::new("llama/blk/0", 100 << 10)]).remove(0);
//! assert_eq!(slot.outcome, AllocateOutcome::Allocated);
//! assert_eq!(slot.pages.len(), 2);
//! assert!(dram.batch_commit(&[CommitRequest::new(slot.slot_id, "llama/blk/0")])[0].success);
//!
//! // A get: resolve the key to its pages under a read lease, copy, release the lease.
//! let hit = dram.batch_resolve(&["llama/blk/0".to_owned()], true).remove(0);
//! assert!(hit.found && hit.size == 100 << 10);
//! dram.release_reads(&[ReadRelease::new("llama/blk/0", hit.lease)]);
//! dram.shutdown();
//! ```
//!
//! # Owns
//! The medium's buffers (through its source), the key → pages map, slots, leases, pins and the outbox.
//!
//! # Never
//! Moves bytes: `init` receives a [`MemoryRegistrar`](umbp_core::MemoryRegistrar) and nothing that can
//! copy. This crate may not depend on the transfer layer, the peer, the master, tonic or tokio; `cargo
//! xtask ci` fails the build if it does (`[package.metadata.umbp] layer = "backend"`).
//!
//! # Platforms
//! Linux: `HostPageMemorySource` uses `mmap`, `madvise` and `mbind`, and `memfd_create` with file
//! seals for shareable memory.

mod allocator;
mod backend;
mod host;
mod shared;
mod source;

pub use allocator::{AllocatorError, PageBitmapAllocator};
pub use backend::{CopyPin, CopySegment, PageBackend, PageBackendConfig, make_page_backend};
pub use host::{HostMemoryOptions, HostPageMemorySource, HostRegion};
pub use source::{PageMemorySource, RawBuffer, SourceError};
