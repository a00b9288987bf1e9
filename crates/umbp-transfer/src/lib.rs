//! The transfer layer: the only code in umbp-rs that moves bytes.
//!
//! Storage media publish self-describing [`TransferRef`](umbp_core::TransferRef)s and never copy;
//! this crate copies between them. A [`TransferEngine`] is a
//! [`MemoryRegistrar`](umbp_core::MemoryRegistrar) that can also plan and run copies:
//!
//! - [`LocalCopyEngine`] — host ↔ host inside one process (coalescing, parallel for large batches);
//! - [`GpuCopyEngine`] — inside one process with a GPU side (host ↔ device, device ↔ device), batched
//!   as asynchronous copies on a stream with one synchronisation per device, over the GPU runtime
//!   `umbp-gpu` opens at run time;
//! - [`TcpEngine`] and its [`DataServer`] — the remote data plane for machines without RDMA: a node
//!   serves its registered regions over TCP, peers read and write them by (region id, offset, length);
//!   the local side of a push or pull is any host memory of the caller, registered or not, in place;
//!   given a GPU runtime, the server also serves GPU regions through a bounded host staging buffer;
//!   floods of silent, slow or idle connections cannot lock real peers out (bounded handshakes,
//!   per-address caps, idle eviction), and repeated warnings are rate-limited;
//! - keyed requests on the same data plane — [`KeyedClient`] and the server's [`KeyedHandler`]: a
//!   get or a put of one key in one exchange, the server asking the node's handler which ranges of
//!   its registered regions hold (or will hold) the value, moving the bytes itself, and saying in a
//!   trailer whether the read lease covered the send;
//! - [`SharedMemoryEngine`] (in [`shm`]) — the same-host path: a holder on this host hands its
//!   registered regions' sealed memory files over a Unix socket, and the bytes are copied through a
//!   mapping of them; failures fall back to TCP;
//! - [`CompositeTransferEngine`] — what a node actually holds: registration fans out to every engine,
//!   each (src, dst) pair goes to the first engine that can handle it, caller memory no engine can
//!   address is staged through one bounce pool, and every engine is measured per direction.
//!
//! ```
//! use std::ptr::NonNull;
//! use umbp_core::{LocalRegion, MemoryLocation, TransferRef};
//! use umbp_transfer::{LocalCopyEngine, TransferItem, transfer};
//!
//! fn host_ref(bytes: &mut [u8]) -> TransferRef {
//!     let base = NonNull::new(bytes.as_mut_ptr()).expect("a slice's pointer is never null");
//!     // SAFETY: each buffer below outlives the transfer that uses its ref.
//!     TransferRef::local(unsafe { LocalRegion::new(base, bytes.len() as u64, MemoryLocation::Host) })
//! }
//!
//! let mut value = vec![7u8; 8192];
//! let mut pages = vec![0u8; 16384];
//! let (src, dst) = (host_ref(&mut value), host_ref(&mut pages));
//! // The value's two 4 KiB halves into pages 3 and 1 of a medium, in one batch.
//! let items = [
//!     TransferItem { src: src.clone(), src_offset: 0, dst: dst.clone(), dst_offset: 3 * 4096, size: 4096, tag: 0 },
//!     TransferItem { src, src_offset: 4096, dst, dst_offset: 4096, size: 4096, tag: 1 },
//! ];
//! transfer(&LocalCopyEngine::default(), &items).expect("every item copied");
//! assert!(pages[3 * 4096..].iter().all(|&b| b == 7) && pages[4096..2 * 4096].iter().all(|&b| b == 7));
//! assert!(pages[..4096].iter().all(|&b| b == 0));
//! ```
//!
//! # Owns
//! Engines, their connections and threads, the data server's region table, the bounce pool and the
//! peer directory (which remote buffers this node knows).
//!
//! # Never
//! Knows a storage medium, or what a key or a tier means: a keyed request's key and tier number are
//! handed to the node's [`KeyedHandler`] as they came, and only the ranges it answers are touched.
//! Descriptors are self-describing, so adding a medium never edits this crate.

mod composite;
mod directory;
mod engine;
mod fd_limit;
#[doc(hidden)]
pub mod fuzzing;
mod gpu;
mod local;
pub mod phases;
mod planning;
pub mod shm;
mod tcp;
mod warn;

pub use composite::{CompositeConfig, CompositeTransferEngine};
pub use directory::{MAX_BUFFERS_PER_BACKEND, PeerDirectory};
pub use engine::{
    BounceCopy, CompletedHandle, FailureKind, PlanSet, Segment, Staging, SumOf, SummedTransfer, TransferDirection,
    TransferEngine, TransferFailure, TransferHandle, TransferItem, TransferPlan, failed_tags, transfer,
};
pub use fd_limit::raise_open_file_limit;
pub use gpu::{GpuCopyConfig, GpuCopyEngine};
pub use local::{LocalCopyConfig, LocalCopyEngine};
pub use shm::{SharedMemoryConfig, SharedMemoryEngine, copy_streaming, stream_threshold};
pub use tcp::{
    ClosingSlot, DataServer, DataServerConfig, KeyedBatchItem, KeyedBatchPut, KeyedClient, KeyedClientConfig,
    KeyedError, KeyedGet, KeyedHandler, KeyedLease, KeyedPut, KeyedRange, KeyedRead, KeyedSlot, KeyedWrite,
    PutChecksum, SentGetBatch, TcpEngine, TcpEngineConfig, TcpStartError,
};

const _: () = {
    const fn pin<T: Send + Sync>() {}
    pin::<LocalCopyEngine>();
    pin::<GpuCopyEngine>();
    pin::<CompositeTransferEngine>();
    pin::<PeerDirectory>();
    pin::<SharedMemoryEngine>();
};
