//! The value types and the storage-medium contract of umbp-rs.
//!
//! umbp-rs is a distributed KV-cache buffer pool: nodes lend one storage medium each (host DRAM, GPU
//! HBM, SSD, …), a master decides placement, and a transfer layer moves bytes. This crate is the
//! vocabulary the three share.
//!
//! ```
//! use std::ptr::NonNull;
//! use umbp_core::{
//!     AllocateRequest, ErrorKind, KvEvent, LocalRegion, MemoryLocation, RegistryError, TierType, TransferRef,
//! };
//!
//! // A medium describes memory it owns with a self-describing descriptor; the transfer layer needs
//! // nothing else to copy to or from it.
//! let mut page = vec![0u8; 4096];
//! let base = NonNull::new(page.as_mut_ptr()).expect("a Vec's buffer is never null");
//! // SAFETY: `page` outlives every use of the region below.
//! let region = unsafe { LocalRegion::new(base, 4096, MemoryLocation::Host) };
//! let desc = TransferRef::local(region);
//! assert!(desc.location().is_host() && desc.size() == 4096);
//!
//! // Writers ask a medium for a slot by key and size; what a medium then holds reaches the master
//! // as events.
//! let request = AllocateRequest::new("llama-70b/blk/0", 4096);
//! let event = KvEvent::add(request.key.clone(), TierType::Dram, request.size);
//! assert_eq!(event.tier, TierType::Dram);
//!
//! // Every error says what the caller does next.
//! let err = RegistryError::TooManyBackends { max: 8 };
//! assert_eq!(err.kind(), ErrorKind::InvalidInput);
//! ```
//!
//! # Owns
//! - The wire-stable value types: [`TierType`], [`TierCapacity`], [`PageLocation`], [`KvEvent`], the
//!   slot-lifecycle requests and results ([`AllocateRequest`], [`AllocateResult`], …) and
//!   [`BufferDesc`].
//! - [`TransferRef`], the self-describing endpoint descriptor, and [`LocalRegion`], the one place a raw
//!   pointer enters the system.
//! - The medium contract: [`MediumBackend`] (what every storage medium implements) and
//!   [`MemoryRegistrar`] (the only transfer-layer capability a medium may see: register and
//!   deregister, never move). A resolve answers hit, miss or **busy** ([`ResolvedEntry::busy`]: the
//!   key is here but cannot be served now; retry this medium), and read leases are counted and
//!   released by their readers ([`ReadRelease`], [`ReadLeases`], the table every medium shares).
//! - [`BackendRegistry`] and the event aggregation helpers [`drain_all_backends`] and
//!   [`snapshot_all_backends_for_full_sync`].
//! - The metric seam ([`MetricSource`], [`MetricSample`], [`MetricKind`]) and injected time
//!   ([`Clock`], [`SystemClock`], [`ManualClock`]).
//! - [`RateLimited`], the decision of whether a repeated warning is logged now (the caller logs).
//!
//! # Never
//! Moves bytes, opens sockets, spawns threads or knows a concrete medium. It depends on no other umbp
//! crate.
//!
//! # The rule
//! **A backend owns bytes and publishes descriptors for them; it never moves them.** The contracts of
//! [`MediumBackend`] that the compiler cannot check are listed on the trait and tested against every
//! medium by `umbp_testkit::conformance`.

mod backend;
mod checksum;
mod clock;
mod error;
mod metrics;
mod outbox;
mod ratelimit;
mod registry;
mod transfer_ref;
mod types;
pub mod units;

pub use backend::{AutoFlushHook, MediumBackend};
pub use checksum::{ValueCrc32c, value_crc32c, value_crc32c_of_parts};
pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{BackendError, ErrorKind, RegistrationError, RegistryError};
pub use metrics::{MetricKind, MetricSample, MetricSource, names as metric_names};
pub use outbox::EventOutbox;
pub use ratelimit::RateLimited;
pub use registry::{BackendRegistry, drain_all_backends, snapshot_all_backends_for_full_sync};
#[cfg(unix)]
pub use transfer_ref::SharedBacking;
pub use transfer_ref::{LocalRegion, MemoryLocation, MemoryRegistrar, RemoteRegion, TransferRef};
pub use types::{
    AllocateOutcome, AllocateRequest, AllocateResult, BufferDesc, CommitRequest, CommitResult, EvictResult, KvEvent,
    KvEventKind, MAX_BACKENDS_PER_PEER, PageLocation, ReadLease, ReadLeases, ReadRelease, ResolvedEntry, TierCapacity,
    TierType, covering_pages, covering_span,
};
