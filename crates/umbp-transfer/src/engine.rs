//! The engine contract: items in, plans out, handles to wait on.

use std::fmt;

use umbp_core::{ErrorKind, LocalRegion, MemoryRegistrar, MetricSource, RegistrationError, TransferRef};

/// One copy the caller wants: `size` bytes from `src` at `src_offset` to `dst` at `dst_offset`.
/// `tag` names the caller's unit of failure (usually a key's index in a batch); several items may
/// share a tag, and a failed plan fails every tag in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferItem {
    /// Where the bytes are.
    pub src: TransferRef,
    /// Byte offset inside `src`.
    pub src_offset: u64,
    /// Where the bytes go.
    pub dst: TransferRef,
    /// Byte offset inside `dst`.
    pub dst_offset: u64,
    /// Bytes to copy; a 0-byte item is skipped, not rejected.
    pub size: u64,
    /// The caller's failure unit.
    pub tag: u64,
}

/// Which way bytes cross the process boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransferDirection {
    /// Local memory to a remote node (a remote write).
    Push,
    /// A remote node to local memory (a remote read).
    Pull,
    /// Both sides in this process.
    Local,
}

impl TransferDirection {
    /// Every direction, in metric order.
    pub const ALL: [TransferDirection; 3] = [Self::Push, Self::Pull, Self::Local];

    /// The `direction=` metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Push => "push",
            Self::Pull => "pull",
            Self::Local => "local",
        }
    }

    pub(crate) const fn index(self) -> usize {
        match self {
            Self::Push => 0,
            Self::Pull => 1,
            Self::Local => 2,
        }
    }
}

/// A contiguous run of one plan: `len` bytes from `src_offset` in the plan's `src` to `dst_offset` in
/// its `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Offset inside the plan's source.
    pub src_offset: u64,
    /// Offset inside the plan's destination.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Copies the composite engine performs around a staged plan: caller memory that no engine could
/// address directly goes through the bounce pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staging {
    /// The `plan` call that made the plan: unique per call, so rounds of plan sets submitted
    /// together never share the pool.
    pub epoch: u64,
    /// The bounce round the plan belongs to within its epoch; rounds run one after another, each
    /// filling the pool once.
    pub round: u32,
    /// Whether the pool is the plan's source (caller memory is copied into the pool before the
    /// transfer) or its destination (copied out of the pool after it).
    pub pool_is_src: bool,
    /// Caller ↔ bounce copies of the plan's items.
    pub copies: Vec<BounceCopy>,
}

/// One caller ↔ bounce copy of a staged item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BounceCopy {
    /// The caller's memory (a ref with a local region).
    pub user: TransferRef,
    /// Offset inside `user`.
    pub user_offset: u64,
    /// Offset inside the bounce pool.
    pub bounce_offset: u64,
    /// Bytes.
    pub len: u64,
    /// The item's tag.
    pub tag: u64,
}

/// Work for one engine between one (src, dst) pair of buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferPlan {
    /// The source buffer.
    pub src: TransferRef,
    /// The destination buffer.
    pub dst: TransferRef,
    /// The runs to copy, coalesced where adjacent on both sides.
    pub segments: Vec<Segment>,
    /// The tags of the items in the plan (consecutive duplicates removed).
    pub tags: Vec<u64>,
    /// Push, pull or local.
    pub direction: TransferDirection,
    /// Set by the composite engine: the index of the engine that owns the plan.
    pub engine: Option<usize>,
    /// Set by the composite engine when the plan moves staged caller memory.
    pub staging: Option<Staging>,
}

impl TransferPlan {
    /// Total bytes of the plan.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }
}

/// The result of planning: the plans, and the tags of items no plan could take (out of range,
/// unaddressable, too large to stage). The caller must treat rejected tags as failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanSet {
    /// Plans to submit.
    pub plans: Vec<TransferPlan>,
    /// Tags that will not be moved.
    pub rejected_tags: Vec<u64>,
}

/// Why a plan failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FailureKind {
    /// Planning refused the item (no engine, out of range, too large for the bounce pool).
    Rejected,
    /// The engine posted nothing for the plan.
    NotSubmitted,
    /// The remote side refused the range (beyond the registered region).
    OutOfRange,
    /// The remote side does not know the region (never registered, or deregistered).
    UnknownRegion,
    /// The peer refused the cluster token.
    Unauthorized,
    /// The connection broke or could not be made.
    ConnectionLost,
    /// The peer did not answer in time.
    Timeout,
    /// The peer serves its maximum of connections; retry later or elsewhere.
    Busy,
    /// The peer sent something that is not the protocol.
    Protocol,
    /// A local error (a GPU runtime call, an invalid plan handed to submit).
    Local,
    /// The remote side's GPU runtime failed to move the bytes of its GPU region through host
    /// staging.
    RemoteDevice,
}

impl FailureKind {
    /// What the caller should do next (named `error_kind`, not `kind`, because a
    /// [`TransferFailure`]'s `kind` field is this enum):
    ///
    /// - [`InvalidInput`](ErrorKind::InvalidInput): the item or the token can never work as given
    ///   ([`Rejected`](Self::Rejected), [`OutOfRange`](Self::OutOfRange),
    ///   [`Unauthorized`](Self::Unauthorized));
    /// - [`Retry`](ErrorKind::Retry): the peer is busy or slow ([`Busy`](Self::Busy),
    ///   [`Timeout`](Self::Timeout));
    /// - [`Unavailable`](ErrorKind::Unavailable): the peer, its region or its device is gone; forget
    ///   its descriptors and resolve again, or go elsewhere ([`ConnectionLost`](Self::ConnectionLost),
    ///   [`UnknownRegion`](Self::UnknownRegion), [`RemoteDevice`](Self::RemoteDevice));
    /// - [`Internal`](ErrorKind::Internal): a bug on one side ([`NotSubmitted`](Self::NotSubmitted),
    ///   [`Protocol`](Self::Protocol), [`Local`](Self::Local)).
    pub fn error_kind(self) -> ErrorKind {
        match self {
            Self::Rejected | Self::OutOfRange | Self::Unauthorized => ErrorKind::InvalidInput,
            Self::Busy | Self::Timeout => ErrorKind::Retry,
            Self::ConnectionLost | Self::UnknownRegion | Self::RemoteDevice => ErrorKind::Unavailable,
            Self::NotSubmitted | Self::Protocol | Self::Local => ErrorKind::Internal,
        }
    }
}

/// One failed plan: every tag in it failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?} via {endpoint}: {message}")]
pub struct TransferFailure {
    /// The tags of the failed plan.
    pub tags: Vec<u64>,
    /// What kind of failure.
    pub kind: FailureKind,
    /// What happened, for logs.
    pub message: String,
    /// The engine or peer it happened at.
    pub endpoint: String,
}

impl TransferFailure {
    /// A failure of `tags`.
    pub fn new(tags: Vec<u64>, kind: FailureKind, message: impl Into<String>, endpoint: impl Into<String>) -> Self {
        Self { tags, kind, message: message.into(), endpoint: endpoint.into() }
    }

    /// What the caller should do next: [`FailureKind::error_kind`] of its `kind`.
    pub fn error_kind(&self) -> ErrorKind {
        self.kind.error_kind()
    }
}

/// Every tag named by `failures`, sorted and deduplicated.
pub fn failed_tags(failures: &[TransferFailure]) -> Vec<u64> {
    let mut tags: Vec<u64> = failures.iter().flat_map(|f| f.tags.iter().copied()).collect();
    tags.sort_unstable();
    tags.dedup();
    tags
}

/// Submitted work. [`wait`](Self::wait) blocks until every plan has finished (bounded: engines put a
/// deadline on every wait) and reports one failure per failed plan; it never stops at the first
/// failure. A second `wait` returns nothing. Dropping a handle that was never waited on waits for
/// the work first, because the work may still be reading or writing memory the caller owns.
pub trait TransferHandle: Send + fmt::Debug {
    /// Waits for everything and returns the failures.
    fn wait(&mut self) -> Vec<TransferFailure>;
}

/// A handle whose work finished inside `submit`.
#[derive(Debug, Default)]
pub struct CompletedHandle {
    failures: Vec<TransferFailure>,
}

impl CompletedHandle {
    /// A settled handle carrying `failures`.
    pub fn new(failures: Vec<TransferFailure>) -> Self {
        Self { failures }
    }
}

impl TransferHandle for CompletedHandle {
    fn wait(&mut self) -> Vec<TransferFailure> {
        std::mem::take(&mut self.failures)
    }
}

/// A way to move bytes between [`TransferRef`]s: it registers memory (so it is a
/// [`MemoryRegistrar`]), says which pairs of endpoints it can serve, turns items into plans and runs
/// them.
///
/// Plan, submit, overlap other work, wait (what [`transfer`] does in one call):
///
/// ```
/// use std::ptr::NonNull;
/// use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, TransferRef};
/// use umbp_transfer::{LocalCopyEngine, TransferEngine, TransferItem};
///
/// let engine = LocalCopyEngine::default();
/// let mut medium = vec![0u8; 1 << 20];
/// let base = NonNull::new(medium.as_mut_ptr()).expect("non-null");
/// // SAFETY: `medium` outlives its registration (deregistered below) and every copy.
/// let region = unsafe { LocalRegion::new(base, 1 << 20, MemoryLocation::Host) };
/// // A medium registers what it owns and publishes the descriptor it gets back.
/// let dst = engine.register_memory(region).expect("host memory");
///
/// let mut value = b"hello, pool".to_vec();
/// let src_base = NonNull::new(value.as_mut_ptr()).expect("non-null");
/// // SAFETY: `value` outlives the batch (waited for below). Unregistered caller memory is fine.
/// let src = TransferRef::local(unsafe { LocalRegion::new(src_base, 11, MemoryLocation::Host) });
/// let items =
///     [TransferItem { src: src.clone(), src_offset: 0, dst: dst.clone(), dst_offset: 4096, size: 11, tag: 42 }];
/// // Reaches past the end of `src`: rejected by tag, never copied.
/// let bad = TransferItem { src, src_offset: 8, dst: dst.clone(), dst_offset: 0, size: 11, tag: 43 };
///
/// assert!(engine.can_handle(&items[0].src, &items[0].dst));
/// let plans = engine.plan(&[items[0].clone(), bad]);
/// assert_eq!(plans.rejected_tags, [43]);
/// let mut handle = engine.submit(plans.plans).expect("posted");
/// // … other work overlaps the copy here …
/// assert!(handle.wait().is_empty(), "no plan failed");
/// assert_eq!(&medium[4096..4096 + 11], b"hello, pool");
/// engine.deregister(&dst);
/// ```
pub trait TransferEngine: MemoryRegistrar + MetricSource {
    /// A short, stable name (the `engine=` metric label).
    fn name(&self) -> &str;

    /// Whether this engine can move bytes from `src` to `dst`. Pair-based: one side alone never
    /// decides.
    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool;

    /// Groups `items` into plans. Pure: nothing moves. Items this engine cannot handle, or whose range
    /// lies outside either ref, are rejected by tag; 0-byte items are skipped.
    fn plan(&self, items: &[TransferItem]) -> PlanSet;

    /// Whether `submit` finishes the work before it returns (a synchronous engine such as the
    /// in-process copy) rather than starting it and returning at once. The composite engine submits
    /// asynchronous engines first so a synchronous engine's work overlaps theirs. Default: `false`.
    fn completes_in_submit(&self) -> bool {
        false
    }

    /// Whether a failed plan of this engine may be handed to the next engine that can handle its
    /// pair (the composite engine does so at once): for a short path whose failure says nothing
    /// about the bytes, such as the same-host shared-memory path falling back to TCP. Such an engine
    /// must complete its work in `submit` ([`completes_in_submit`](Self::completes_in_submit)).
    /// Default: `false`.
    fn fallback_on_failure(&self) -> bool {
        false
    }

    /// Registers `region` for use as the local side of this engine's own transfers only: peers must
    /// never be able to address it (the composite engine's bounce pool). Engines that publish
    /// nothing to peers register it as usual (the default).
    fn register_local_only(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.register_memory(region)
    }

    /// Starts the plans. `Err` means nothing was posted and every tag of every plan failed. Engines
    /// re-check each plan's ranges here: a hand-built plan never reaches memory out of range.
    ///
    /// # Memory the caller did not register
    /// Engines that can (the in-process copy, TCP) take caller memory that is registered with no
    /// engine as the local side of a plan, in place. Such memory is valid for the batch by the
    /// caller's contract (the [`LocalRegion`] invariant): the caller must keep it valid — and must
    /// not read a destination or write a source of the batch — until the returned handle's
    /// [`wait`](TransferHandle::wait) has returned or the handle has been dropped (dropping waits).
    /// Registered memory is additionally protected by its registration: deregistering it waits for
    /// the batches using it.
    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure>;

    /// Moves `items` as [`transfer`] does, and sums each tag's value as it copies, each block
    /// right after its copy, while it is still in the cache (an end-to-end checksum without a
    /// second pass over the bytes). `sum_of` tells which side (see [`SumOf`]); a tag's items must
    /// tile one range of that side, and the sum is of that range in order. `None`: this engine does
    /// not sum as it copies (the default), or not these items, and **nothing moved**: the caller
    /// transfers and sums itself. Blocks until the copies are done, as [`transfer`] does.
    fn transfer_summed(&self, items: &[TransferItem], sum_of: SumOf) -> Option<SummedTransfer> {
        let _ = (items, sum_of);
        None
    }
}

/// Which side of a [`TransferEngine::transfer_summed`] copy each tag's sum covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumOf {
    /// The bytes as they landed, in destination order (a read into a caller's buffer: the sum
    /// checks the copy against the writer's). Each tag's items tile one destination range.
    Destination,
    /// The bytes the copy read, in source order (a write from a caller's buffer: the sum is of
    /// the caller's value, which a later reader checks its copy against — a copy gone wrong here
    /// is then caught, as it would not be by a sum of what landed). Each tag's items tile one
    /// source range.
    Source,
}

/// What [`TransferEngine::transfer_summed`] did: the CRC-32C of each tag whose bytes all landed,
/// and the failures (their tags' bytes are not to be used).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SummedTransfer {
    /// Tag → the CRC-32C of its bytes as they landed.
    pub sums: std::collections::HashMap<u64, u32>,
    /// The tags that failed, and why.
    pub failures: Vec<TransferFailure>,
}

/// Plans, submits and waits: for callers with nothing to overlap. `Ok` when every item moved;
/// otherwise every failure, rejected items included.
pub fn transfer(engine: &dyn TransferEngine, items: &[TransferItem]) -> Result<(), Vec<TransferFailure>> {
    if items.is_empty() {
        return Ok(());
    }
    let PlanSet { plans, rejected_tags } = engine.plan(items);
    let mut failures = Vec::new();
    if !rejected_tags.is_empty() {
        failures.push(TransferFailure::new(
            rejected_tags,
            FailureKind::Rejected,
            "no engine can move these items as given",
            engine.name(),
        ));
    }
    if !plans.is_empty() {
        let tags: Vec<u64> = plans.iter().flat_map(|p| p.tags.iter().copied()).collect();
        match engine.submit(plans) {
            Ok(mut handle) => failures.extend(handle.wait()),
            Err(mut failure) => {
                failure.tags = tags;
                failures.push(failure);
            }
        }
    }
    if failures.is_empty() { Ok(()) } else { Err(failures) }
}

#[cfg(test)]
mod error_kind_tests {
    use super::*;

    #[test]
    fn every_failure_kind_tells_the_caller_what_to_do_next() {
        use FailureKind::*;
        let expected = [
            (Rejected, ErrorKind::InvalidInput),
            (OutOfRange, ErrorKind::InvalidInput),
            (Unauthorized, ErrorKind::InvalidInput),
            (Busy, ErrorKind::Retry),
            (Timeout, ErrorKind::Retry),
            (ConnectionLost, ErrorKind::Unavailable),
            (UnknownRegion, ErrorKind::Unavailable),
            (RemoteDevice, ErrorKind::Unavailable),
            (NotSubmitted, ErrorKind::Internal),
            (Protocol, ErrorKind::Internal),
            (Local, ErrorKind::Internal),
        ];
        for (kind, what) in expected {
            assert_eq!(kind.error_kind(), what, "{kind:?}");
            assert_eq!(TransferFailure::new(vec![1], kind, "x", "peer").error_kind(), what);
        }
    }
}
