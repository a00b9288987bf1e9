//! The names of the `tracing` spans around each phase of a get and a put (issue 16): one place, so
//! a breakdown (`umbp bench --breakdown`) and tests can find them, and a new phase is added beside
//! the others.
//!
//! Every span is at TRACE level, with target [`TARGET`]: when no subscriber wants them, creating
//! one costs the usual cached callsite-interest check (one atomic load and a compare), and the
//! instrumented future only enters and exits a disabled span. Enable them in logs with
//! `RUST_LOG=umbp::phase=trace`.
//!
//! Spans nest: a whole call ([`GET`], [`PUT`]) holds its phases, and a phase may hold a finer one
//! (the RPC or the medium call inside a resolve). In a batch, the phases of different chunks run
//! concurrently (one chunk's route overlaps another's transfer); in a single-key call they follow
//! each other.
//!
//! The peer service's spans ([`PEER_RESOLVE`], [`PEER_ALLOCATE`], [`PEER_COMMIT`]) are recorded in
//! the holder's process, not the caller's.

/// The target of every phase span.
pub const TARGET: &str = umbp_transfer::phases::TARGET;

/// A whole `get` / `batch_get` call.
pub const GET: &str = "umbp.get";
/// The first look at this node's own medium, before any route (nodes with a medium only).
pub const GET_LOCAL: &str = "umbp.get.local";
/// The route call(s) to the master.
pub const GET_ROUTE: &str = "umbp.get.route";
/// Resolving the routed keys on their holders (every holder concurrently): connection lookup, the
/// peer RPC or the medium call, and decoding the answer.
pub const GET_RESOLVE: &str = "umbp.get.resolve";
/// Inside a resolve: the peer RPC alone (a remote holder).
pub const GET_RESOLVE_RPC: &str = "umbp.get.resolve.rpc";
/// Inside a resolve: the medium call alone (this node's medium, the local look included).
pub const GET_RESOLVE_MEDIUM: &str = "umbp.get.resolve.medium";
/// The copies of a round: one submit and the wait (a hop to the blocking pool included).
pub const GET_TRANSFER: &str = "umbp.get.transfer";
/// Ending the read leases of a round (a remote release is usually sent in the background).
pub const GET_RELEASE: &str = "umbp.get.release";
/// A keyed get: one exchange with the holder's data server that resolves, sends and releases
/// (`fast.rs`), on the calling thread.
pub const GET_KEYED: &str = "umbp.get.keyed";
/// Inside a batch's keyed exchanges with holders on this host (one span per chunk, each on its
/// exchange's thread): the request and the holder's answer, the copies, the settle frame.
pub use umbp_transfer::phases::{GET_KEYED_COPY, GET_KEYED_REPLY, GET_KEYED_SETTLE};

/// A whole `put` / `batch_put` call.
pub const PUT: &str = "umbp.put";
/// The route call(s) to the master (skipped for a node granted local placement).
pub const PUT_ROUTE: &str = "umbp.put.route";
/// Allocating slots on every routed node concurrently: connection lookup, the peer RPC or the
/// medium call, and decoding the answer.
pub const PUT_ALLOCATE: &str = "umbp.put.allocate";
/// Inside an allocate: the peer RPC alone (a remote holder).
pub const PUT_ALLOCATE_RPC: &str = "umbp.put.allocate.rpc";
/// The copies of a round: one submit and the wait (a hop to the blocking pool included).
pub const PUT_TRANSFER: &str = "umbp.put.transfer";
/// Committing the copied slots on every node concurrently.
pub const PUT_COMMIT: &str = "umbp.put.commit";
/// Inside a commit: the peer RPC alone (a remote holder).
pub const PUT_COMMIT_RPC: &str = "umbp.put.commit.rpc";
/// Aborting the slots of a round that were not committed (a no-op when every slot was).
pub const PUT_ABORT: &str = "umbp.put.abort";
/// A keyed put: one exchange with the holder's data server that allocates, receives and commits
/// (`fast.rs`), on the calling thread.
pub const PUT_KEYED: &str = "umbp.put.keyed";
/// Inside a batch's keyed exchanges with holders on this host (one span per chunk): the request
/// and the holder's allocation, the writes, the wait for the master's placement when copied while
/// routed, the settle frame and the holder's commit.
pub use umbp_transfer::phases::{PUT_KEYED_COMMIT, PUT_KEYED_COPY, PUT_KEYED_REPLY, PUT_KEYED_ROUTE_WAIT};

/// The peer service's `BatchResolveKeys` handler (in the holder's process).
pub const PEER_RESOLVE: &str = "umbp.peer.resolve";
/// The peer service's `BatchAllocateSlots` handler (in the holder's process).
pub const PEER_ALLOCATE: &str = "umbp.peer.allocate";
/// The peer service's `BatchCommitSlots` handler (in the holder's process).
pub const PEER_COMMIT: &str = "umbp.peer.commit";

/// The phases of a get, in the order they run (a single-key get records some; a batch, per chunk,
/// others).
pub const GET_PHASES: [&str; 11] = [
    GET_LOCAL,
    GET_ROUTE,
    GET_KEYED,
    GET_KEYED_REPLY,
    GET_KEYED_COPY,
    GET_KEYED_SETTLE,
    GET_RESOLVE,
    GET_RESOLVE_RPC,
    GET_RESOLVE_MEDIUM,
    GET_TRANSFER,
    GET_RELEASE,
];

/// The phases of a put, in the order they run (a single-key put records some; a batch, per chunk,
/// others).
pub const PUT_PHASES: [&str; 12] = [
    PUT_ROUTE,
    PUT_KEYED,
    PUT_KEYED_REPLY,
    PUT_KEYED_COPY,
    PUT_KEYED_ROUTE_WAIT,
    PUT_KEYED_COMMIT,
    PUT_ALLOCATE,
    PUT_ALLOCATE_RPC,
    PUT_TRANSFER,
    PUT_COMMIT,
    PUT_COMMIT_RPC,
    PUT_ABORT,
];

/// A TRACE span named `$name` (one of the constants above) with target [`TARGET`], for
/// `.instrument(..)` or `.in_scope(..)`.
macro_rules! phase {
    ($name:expr) => {
        ::tracing::trace_span!(target: $crate::pool_client::phases::TARGET, $name)
    };
}
pub(crate) use phase;
