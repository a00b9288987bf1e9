//! The object-store medium: values live as objects in an S3-compatible bucket (or a local
//! directory) and are served through one registered host staging arena.
//!
//! An object store's bytes are not addressable by the transfer layer, so [`ObjectBackend`]
//! publishes an ordinary registered host buffer (the staging arena) and moves bytes between it
//! and the store itself — shape 2 of the medium guide, as the SSD medium does: `batch_allocate`
//! lends staging pages, `batch_commit` uploads them as one object per value and gives them back,
//! `batch_resolve` downloads a value into staging pages (one download per key at a time; the
//! copy stays cached until its pages are needed) and hands them out under a counted read lease,
//! `evict` and `clear_local` delete objects, and `init` re-indexes what the prefix holds.
//!
//! ```
//! use std::sync::Arc;
//! use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, ReadRelease};
//! use umbp_object::{ObjectBackend, ObjectConfig};
//! use umbp_testkit::LocalOnlyRegistrar;
//!
//! // A local directory stands in for a bucket here; `s3://bucket/prefix` with an endpoint and
//! // AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the environment is the real thing.
//! let dir = tempfile::tempdir()?;
//! let url = format!("file://{}", dir.path().display());
//! let config = ObjectConfig::builder(url).page_size(4096).capacity_bytes(1 << 20).staging_pages(16).build()?;
//! let medium = ObjectBackend::new(config);
//! medium.init(Arc::new(LocalOnlyRegistrar::new()))?;
//!
//! // Allocate a slot, write the value into its staging page, commit: the value is uploaded.
//! let slot = medium.batch_allocate(&[AllocateRequest::new("greeting", 5)]).remove(0);
//! assert_eq!(slot.outcome, AllocateOutcome::Allocated);
//! let arena = medium.buffer_ref(0).expect("the staging arena");
//! let base = arena.local_region().expect("host memory").ptr().as_ptr();
//! let at = |page: u32| u64::from(page) as usize * 4096;
//! // SAFETY: the page lies in the registered arena and belongs to this slot until its commit.
//! unsafe { std::ptr::copy_nonoverlapping(b"hello".as_ptr(), base.add(at(slot.pages[0].page_index)), 5) };
//! assert!(medium.batch_commit(&[CommitRequest::new(slot.slot_id, "greeting")])[0].success);
//!
//! // Resolve it: the value is downloaded into a staging page, leased until released.
//! let hit = medium.batch_resolve(&["greeting".to_owned()], false).remove(0);
//! assert!(hit.found && hit.size == 5);
//! // SAFETY: the leased page lies in the arena and no one writes it while the lease is held.
//! let value = unsafe { std::slice::from_raw_parts(base.add(at(hit.pages[0].page_index)), 5) };
//! assert_eq!(value, b"hello");
//! medium.release_reads(&[ReadRelease::new("greeting", hit.lease)]);
//! medium.shutdown();
//!
//! // A new medium on the same store finds the key again.
//! let config = ObjectConfig::builder(format!("file://{}", dir.path().display())).page_size(4096).build()?;
//! let again = ObjectBackend::new(config);
//! again.init(Arc::new(LocalOnlyRegistrar::new()))?;
//! assert_eq!(again.owned_key_count(), 1);
//! again.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Owns
//! The staging arena and its registration, the key index (key → value size and the seq of its
//! object), slots, staged copies and their counted read leases, the event outbox, the worker
//! threads that talk to the store, and every object under its prefix: **one node per prefix**
//! (a second medium on the same prefix would re-index and delete the first one's objects).
//!
//! # Objects
//! One object per value, named `{prefix}{hex(key)}.{seq}` and holding a header (magic, key
//! length, value length, seq, the value's CRC-32C and the header's own CRC-32C), the key and the
//! value. A download checks key, seq, length and CRC; a value the store lost (a store restarted
//! empty) or damaged is a **miss**, never wrong bytes, and its key is dropped with a `Remove`
//! event. A restart lists the prefix and re-indexes every object whose head checks (the newest
//! seq of a key wins; damaged heads are skipped).
//!
//! # Bounds
//! At most `io_threads` requests at once; a request is limited by `request_timeout` and retried
//! with jittered exponential backoff on HTTP 5xx, 429, 408 and lost connections, up to `retries`
//! times. A caller waits for its requests up to `op_timeout` and never with the medium's lock
//! held: a commit that outlasts it answers failed, a resolve busy — a slow or failing store slows
//! only the calls that need it.
//!
//! # Never
//! Moves bytes to or from a peer or names a transfer engine: `init` receives only a
//! [`MemoryRegistrar`](umbp_core::MemoryRegistrar). Never holds its lock across store IO. Never
//! publishes metrics of its own (its series are the generic ones, under `tier=`). This crate may
//! not depend on the transfer layer, the peer, the master, tonic or tokio (`cargo xtask ci`
//! checks it: `[package.metadata.umbp] layer = "backend"`): its HTTP client (`ureq`) and request
//! signing (`rusty-s3`) are synchronous. No TLS: endpoints are `http://`.
//!
//! # Tier
//! It reports [`TierType::Ssd`](umbp_core::TierType::Ssd): to the routing plane a value staged
//! through host memory from a slower medium. A tier of its own is a wire change.

mod backend;
mod config;
mod pool;
mod record;
mod store;

pub use backend::{ObjectBackend, ObjectStats};
pub use config::{
    Credentials, ObjectConfig, ObjectConfigBuilder, ObjectConfigError, ObjectSettings, ObjectUrl, region_from_env,
};
pub use store::StoreError;

/// Builds an object medium and returns it as the interface (only the composition root names
/// concrete backends).
pub fn make_object_backend(config: ObjectConfig) -> Box<dyn umbp_core::MediumBackend> {
    Box::new(ObjectBackend::new(config))
}
