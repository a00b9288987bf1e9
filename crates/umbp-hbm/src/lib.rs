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

/// What a caller should do about a [`GpuError`](umbp_gpu::GpuError). Here, not on the error, because
/// the runtime shim sits below every umbp crate (the layering rule of `runtime-shim`) and so cannot
/// name [`ErrorKind`](umbp_core::ErrorKind).
///
/// No runtime, a runtime too old or one that failed to load is
/// [`Unavailable`](umbp_core::ErrorKind::Unavailable); device memory exhausted is
/// [`Retry`](umbp_core::ErrorKind::Retry); a device the machine lacks or a request the shim refuses is
/// [`InvalidInput`](umbp_core::ErrorKind::InvalidInput); any other failed call, or a misuse of the
/// shim, is [`Internal`](umbp_core::ErrorKind::Internal).
pub fn gpu_error_kind(err: &umbp_gpu::GpuError) -> umbp_core::ErrorKind {
    use umbp_core::ErrorKind;
    use umbp_gpu::GpuError;
    match err {
        GpuError::NotFound { .. } | GpuError::MissingSymbol { .. } | GpuError::Unavailable(_) => ErrorKind::Unavailable,
        err if err.is_out_of_memory() => ErrorKind::Retry,
        GpuError::InvalidDevice { .. } | GpuError::Invalid(_) => ErrorKind::InvalidInput,
        _ => ErrorKind::Internal,
    }
}

impl HbmError {
    /// What the caller should do next: [`gpu_error_kind`] of the runtime's error, or the backend
    /// error's own kind.
    pub fn kind(&self) -> umbp_core::ErrorKind {
        match self {
            Self::Device { source, .. } => gpu_error_kind(source),
            Self::Backend(err) => err.kind(),
        }
    }
}

#[cfg(test)]
mod tests {
    use umbp_core::{BackendError, ErrorKind};
    use umbp_gpu::GpuError;

    use super::*;

    fn call(code: i32) -> GpuError {
        GpuError::Call { runtime: "fake", call: "malloc", code, message: "x".into() }
    }

    #[test]
    fn each_gpu_error_tells_the_caller_what_to_do_next() {
        let expected = [
            (
                GpuError::NotFound { runtime: "hip", tried: vec!["libamdhip64.so"], reason: "x".into() },
                ErrorKind::Unavailable,
            ),
            (
                GpuError::MissingSymbol { library: "cuda", symbol: "cuMemAlloc", reason: "x".into() },
                ErrorKind::Unavailable,
            ),
            (GpuError::Unavailable("x".into()), ErrorKind::Unavailable),
            (call(2), ErrorKind::Retry),
            (call(1), ErrorKind::Internal),
            (GpuError::InvalidDevice { device: 3, count: 1 }, ErrorKind::InvalidInput),
            (GpuError::Invalid("zero bytes".into()), ErrorKind::InvalidInput),
            (GpuError::ForeignStream { stream_owner: 1, runtime: 2 }, ErrorKind::Internal),
            (GpuError::NoCurrentDevice { call: "malloc" }, ErrorKind::Internal),
        ];
        for (err, kind) in expected {
            assert_eq!(gpu_error_kind(&err), kind, "{err}");
        }
    }

    #[test]
    fn an_hbm_error_answers_for_its_cause() {
        let device = HbmError::Device { device: 3, source: GpuError::InvalidDevice { device: 3, count: 1 } };
        assert_eq!(device.kind(), ErrorKind::InvalidInput);
        assert!(std::error::Error::source(&device).is_some(), "the runtime's error stays the source");
        assert_eq!(HbmError::Device { device: 0, source: call(2) }.kind(), ErrorKind::Retry);
        assert_eq!(HbmError::Backend(BackendError::ShutDown("hbm".into())).kind(), ErrorKind::Closed);
    }
}
