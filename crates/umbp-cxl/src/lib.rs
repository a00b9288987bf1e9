//! The CXL / persistent-memory medium: a paged medium over memory the CPU addresses but the kernel
//! does not own as ordinary RAM.
//!
//! CXL Type-3 memory and persistent memory reach a process as a device-DAX character device
//! (`/dev/daxX.Y`) or as a file on a DAX-mounted filesystem; a regular or tmpfs file stands in for
//! them on a machine with neither. This is the seed's "shape 1": [`CxlPageMemorySource`] is a
//! [`PageMemorySource`] that maps the device or file `MAP_SHARED` (length the capacity, rounded up to
//! the device's `align` from sysfs, 2 MiB when sysfs does not say, or the base page for a file), and
//! [`make_cxl_backend`] wraps it in the shared [`PageBackend`](umbp_page::PageBackend), which owns the
//! slot lifecycle, leases, pins and the event outbox for every paged medium.
//!
//! The source's [`location`](PageMemorySource::location) is `Host`: the CPU loads and stores this
//! memory like DRAM, and [`MemoryLocation`](umbp_core::MemoryLocation) distinguishes only host memory
//! from one GPU's device memory (the fact that picks an engine), so the transfer layer's host engines
//! copy it. The tier is DRAM for the same reason: to the routing plane it is byte-addressable host
//! memory, and a tier of its own is a wire change (`docs/architecture.md`, "Adding a medium").
//!
//! ```
//! use umbp_core::TierType;
//! use umbp_cxl::{CxlConfig, make_cxl_backend};
//! use umbp_page::PageBackendConfig;
//!
//! // A file stands in for /dev/dax0.0 here.
//! let dir = tempfile::tempdir().expect("tempdir");
//! let config = CxlConfig::new(dir.path().join("cxl.img"), 8 << 20);
//! let page = PageBackendConfig::new(TierType::Dram, 2 << 20, Vec::new());
//! let backend = make_cxl_backend(&config, page).expect("the file can grow to 8 MiB");
//! assert_eq!(backend.tier(), TierType::Dram);
//! ```
//!
//! # Owns
//! Its mappings of the device or file (through its source). The bytes stay in the device or file
//! after shutdown; a restart does not recover the keys in them (the slot table is `PageBackend`'s,
//! in DRAM).
//!
//! # Never
//! Moves bytes: it maps memory and publishes descriptors for it, and the transfer layer copies. It may
//! not depend on the transfer layer, the peer, the master, tonic or tokio (`[package.metadata.umbp]
//! layer = "backend"`, checked by `cargo xtask ci`).
//!
//! # Platforms
//! Linux: device-DAX, sysfs and `fallocate`.

mod source;

pub use source::{CxlConfig, CxlError, CxlPageMemorySource, DEFAULT_DAX_ALIGN, make_cxl_backend};

#[doc(no_inline)]
pub use umbp_page::PageMemorySource;

const _: () = {
    const fn pin<T: Send + Sync>() {}
    pin::<CxlPageMemorySource>();
};
