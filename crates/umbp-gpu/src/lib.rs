//! A thin GPU runtime shim: what umbp-rs needs from a GPU, behind one trait, with the vendor runtimes
//! opened at run time.
//!
//! [`GpuRuntime`] covers device count, set/get device, device malloc/free, host memory registration
//! (pinning), synchronous and stream-ordered copies (one at a time, or many in one call where the
//! driver has a batched copy), streams and error strings. Implementations:
//!
//! - HIP (`libamdhip64.so`) and the CUDA runtime (`libcudart.so`), which share one shape of API;
//! - the CUDA driver API (`libcuda.so.1`), which every NVIDIA driver installs, so a binary built on a
//!   machine with no CUDA SDK runs on any NVIDIA machine;
//! - [`FakeRuntime`]: "device memory" is host memory with device ids, copies are checked against the
//!   direction they claim, failures can be injected. HBM code paths and the GPU copy engine are
//!   tested with it on machines without a GPU.
//!
//! The libraries are opened with `libloading` (`dlopen`), never linked: the workspace builds and tests
//! on machines with no GPU and no GPU SDK. [`probe`] finds what the machine has; [`RuntimeSelection`]
//! names a runtime in configuration.
//!
//! ```
//! use umbp_gpu::{CopyKind, GpuRuntime, RuntimeSelection};
//!
//! // The machine's runtime when it has a GPU, else the fake (which always loads).
//! let gpu = umbp_gpu::probe().unwrap_or_else(|| RuntimeSelection::Fake { devices: 1 }.load().expect("fake"));
//! gpu.set_device(0).expect("device 0");
//! let src = [7u8; 4096];
//! let dev = gpu.malloc(src.len()).expect("device memory");
//! let host = std::ptr::NonNull::from(&src).cast::<u8>();
//! // SAFETY: `dev` holds 4096 device bytes and `src` 4096 host bytes, both live for the copy.
//! unsafe { gpu.memcpy(dev, host, src.len(), CopyKind::HostToDevice) }.expect("copy");
//! // SAFETY: allocated above, unused from here on.
//! unsafe { gpu.free(dev) }.expect("free");
//! ```
//!
//! # Owns
//! The loaded runtime libraries and, for the CUDA driver API, the devices' primary contexts.
//!
//! # Never
//! Knows a medium, a key, a tier or a transfer plan; never spawns threads or depends on an async
//! runtime. It hands out device pointers and copies bytes only when a caller asks it to. It depends
//! on no umbp crate, tokio or tonic (`[package.metadata.umbp] layer = "runtime-shim"`, checked by
//! `cargo xtask ci`).
//!
//! # Platforms
//! The real runtimes are looked for on Linux (`.so` names); elsewhere only the fake is available.

mod cuda;
mod error;
mod fake;
mod runtime;
mod runtime_api;

pub use error::GpuError;
pub use fake::{FakeRuntime, FakeStats};
pub use runtime::{CopyKind, DeviceGuard, GpuRuntime, RuntimeSelection, Stream, gpu_required, probe};

const _: () = {
    const fn pin<T: Send + Sync>() {}
    pin::<FakeRuntime>();
    pin::<Stream>();
};
