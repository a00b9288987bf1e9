//! Paged storage media: anything whose bytes the transfer layer can address directly (host DRAM, GPU
//! HBM, CXL, a pmem mapping).
//!
//! A paged medium is one small type implementing [`PageMemorySource`] (five methods: where memory
//! comes from and where it lives). [`PageBackend`] is everything after allocation, written once for
//! every paged medium: the bitmap page allocator ([`PageBitmapAllocator`]), pending slots with a TTL
//! and a reaper thread, counted read leases (a reader's release ends its lease at once), copy pins, dedup, the clear generation, the allocation gate and
//! the event outbox. It never consults the tier.
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
//! Linux: `HostPageMemorySource` uses `mmap`, `madvise` and `mbind`.

mod allocator;
mod backend;
mod host;
mod source;

pub use allocator::{AllocatorError, PageBitmapAllocator};
pub use backend::{CopyPin, CopySegment, PageBackend, PageBackendConfig, make_page_backend};
pub use host::{HostMemoryOptions, HostPageMemorySource, HostRegion};
pub use source::{PageMemorySource, RawBuffer, SourceError};
