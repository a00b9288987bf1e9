//! The GPU HBM medium: a paged medium whose pages are device memory of one GPU.
//!
//! This is the seed's "shape 1": [`HbmPageMemorySource`] is a [`PageMemorySource`] of five methods, and
//! [`make_hbm_backend`] wraps it in the shared [`PageBackend`](umbp_page::PageBackend), which owns the
//! slot lifecycle, leases, pins and the event outbox for every paged medium. The source's
//! [`location`](PageMemorySource::location) is `Gpu { device }` with the device fixed at construction:
//! that is the fact a descriptor cannot recover, and it is what makes a local transfer against this
//! medium select the GPU copy engine.
//!
//! The GPU runtime is a [`GpuRuntime`] from `umbp-gpu` (HIP or CUDA opened at run time, or the
//! host-memory fake), so this crate builds and tests on machines with no GPU and no GPU SDK.
//!
//! ```
//! use std::sync::Arc;
//! use umbp_core::TierType;
//! use umbp_gpu::{FakeRuntime, GpuRuntime};
//! use umbp_hbm::{HbmConfig, make_hbm_backend};
//! use umbp_page::PageBackendConfig;
//!
//! // The host-memory fake stands in for a GPU here; `umbp_gpu::probe()` finds a real one.
//! let gpu: Arc<dyn GpuRuntime> = Arc::new(FakeRuntime::new(1));
//! let page = PageBackendConfig::new(TierType::Hbm, 2 << 20, Vec::new());
//! let backend = make_hbm_backend(gpu, &HbmConfig::new(0, 64 << 20), page).expect("device 0 exists");
//! assert_eq!(backend.tier(), TierType::Hbm);
//! ```
//!
//! # Owns
//! The device allocations of the medium (through its source).
//!
//! # Never
//! Moves bytes: it allocates and frees device memory and publishes descriptors for it, and the
//! transfer layer copies. It may not depend on the transfer layer, the peer, the master, tonic or
//! tokio (`[package.metadata.umbp] layer = "backend"`, checked by `cargo xtask ci`).

mod source;

pub use source::{HbmConfig, HbmError, HbmPageMemorySource, make_hbm_backend};

// Re-exported so a caller can name the pieces of `make_hbm_backend` without its own dependencies.
pub use umbp_gpu::{GpuRuntime, RuntimeSelection};
#[doc(no_inline)]
pub use umbp_page::PageMemorySource;

const _: () = {
    const fn pin<T: Send + Sync>() {}
    pin::<HbmPageMemorySource>();
};
