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
//! - [`CompositeTransferEngine`] — what a node actually holds: registration fans out to every engine,
//!   each (src, dst) pair goes to the first engine that can handle it, caller memory no engine can
//!   address is staged through one bounce pool, and every engine is measured per direction.
//!
//! # Owns
//! Engines, their connections and threads, the data server's region table, the bounce pool and the
//! peer directory (which remote buffers this node knows).
//!
//! # Never
//! Knows a storage medium, a key or a tier. Descriptors are self-describing, so adding a medium never
//! edits this crate.

mod composite;
mod directory;
mod engine;
mod fd_limit;
mod gpu;
mod local;
mod planning;
mod tcp;
mod warn;

pub use composite::{CompositeConfig, CompositeTransferEngine};
pub use directory::{MAX_BUFFERS_PER_BACKEND, PeerDirectory};
pub use engine::{
    BounceCopy, CompletedHandle, FailureKind, PlanSet, Segment, Staging, TransferDirection, TransferEngine,
    TransferFailure, TransferHandle, TransferItem, TransferPlan, failed_tags, transfer,
};
pub use fd_limit::raise_open_file_limit;
pub use gpu::{GpuCopyConfig, GpuCopyEngine};
pub use local::{LocalCopyConfig, LocalCopyEngine};
pub use tcp::{DataServer, DataServerConfig, TcpEngine, TcpEngineConfig, TcpStartError};

const _: () = {
    const fn pin<T: Send + Sync>() {}
    pin::<LocalCopyEngine>();
    pin::<GpuCopyEngine>();
    pin::<CompositeTransferEngine>();
    pin::<PeerDirectory>();
};
