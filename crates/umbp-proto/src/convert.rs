//! Conversions between `umbp-core` values and the `umbp.v1` messages, written once for every speaker
//! of the protocols (the master, the master client, the peer service and its clients), so both
//! sides of a call agree by construction.
//!
//! - Messages convert with `From` (core → wire: always possible) and `TryFrom` (wire → core: a
//!   message this build cannot read safely is refused with a [`WireError`]).
//! - Enums travel as `i32` inside messages (prost keeps unknown values), so they convert with plain
//!   functions: [`tier_to_wire`] / [`tier_from_wire`], [`outcome_to_wire`] / [`outcome_from_wire`].
//!   An unknown value from a newer peer reads as the safe default documented on each, never as an
//!   error: one new tier must not fail a whole heartbeat.

use umbp_core::{
    AllocateOutcome, BufferDesc, KvEvent, KvEventKind, MemoryLocation, PageLocation, RemoteRegion, TierCapacity,
    TierType,
};

use crate::v1;

/// Why a message from the wire cannot become a core value. Any of these refuses the whole message:
/// a field that cannot be read safely is never guessed at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A descriptor's memory kind is unknown to this build: a buffer whose memory cannot be
    /// classified cannot be transferred to safely.
    #[error("buffer descriptor with unknown memory kind {value}")]
    UnknownMemoryKind {
        /// The wire value.
        value: i32,
    },
    /// An event of a kind this build does not know (a newer peer's): reading it as an add would
    /// invent locations.
    #[error("event with unknown kind {value}")]
    UnknownEventKind {
        /// The wire value.
        value: i32,
    },
    /// An event without a key.
    #[error("event without a key")]
    EmptyKey,
    /// A per-key array of a `BatchResolveKeys` reply is not as long as `found`.
    #[error("malformed resolve reply: `{field}` has {len} entries for {expected} keys")]
    MismatchedArrays {
        /// The offending array.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The length of `found`.
        expected: usize,
    },
    /// The flattened page arrays differ in length.
    #[error("malformed resolve reply: {buffer_index} buffer indexes but {page_index} page indexes")]
    MismatchedPageArrays {
        /// Length of `buffer_index`.
        buffer_index: usize,
        /// Length of `page_index`.
        page_index: usize,
    },
    /// The page counts do not add up to the flattened pages.
    #[error("malformed resolve reply: page counts sum to {declared} but {flattened} pages were sent")]
    PageCountMismatch {
        /// Σ `page_count`.
        declared: u64,
        /// Length of the flattened arrays.
        flattened: usize,
    },
    /// A missed key claims pages.
    #[error("malformed resolve reply: key {key_index} is a miss with {page_count} pages")]
    PagesForMiss {
        /// Position of the key in the request.
        key_index: usize,
        /// Its page count.
        page_count: u32,
    },
    /// A hit's pages cannot hold its value (a reader would run past them).
    #[error("malformed resolve reply: key {key_index} has {size} bytes in {page_count} pages of {page_size} bytes")]
    PagesDoNotCoverSize {
        /// Position of the key in the request.
        key_index: usize,
        /// Value size.
        size: u64,
        /// Pages sent for it.
        page_count: u32,
        /// The reply's page size.
        page_size: u64,
    },
    /// A hit or descriptor names a backend id outside `0..MAX_BACKENDS_PER_PEER`.
    #[error("malformed resolve reply: backend id {backend_id} is out of range")]
    BackendIdOutOfRange {
        /// The id.
        backend_id: u32,
    },
    /// A key is answered both as a hit and as busy.
    #[error("malformed resolve reply: key {key_index} is both a hit and busy")]
    BusyHit {
        /// Position of the key in the request.
        key_index: usize,
    },
    /// A partial hit's pages are not inside its value (or it is a miss, or names a first page
    /// while whole): a reader would copy pages the value does not have.
    #[error("malformed resolve reply: key {key_index} is a bad partial hit ({reason})")]
    BadPartial {
        /// Position of the key in the request.
        key_index: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl WireError {
    /// What a caller does next: a refused message is a peer speaking a protocol this build cannot
    /// read, never something to retry as is.
    pub const fn kind(&self) -> umbp_core::ErrorKind {
        umbp_core::ErrorKind::Internal
    }
}

/// The wire value of a tier.
pub fn tier_to_wire(tier: TierType) -> i32 {
    // Tier numbers are small: always representable.
    i32::try_from(tier.wire()).unwrap_or(0)
}

/// A tier from the wire; negative or unknown numbers become [`TierType::Unknown`], so a newer peer's
/// tier is ignored rather than an error.
pub fn tier_from_wire(value: i32) -> TierType {
    u32::try_from(value).map_or(TierType::Unknown, TierType::from_wire)
}

impl From<AllocateOutcome> for v1::AllocateOutcome {
    fn from(outcome: AllocateOutcome) -> Self {
        match outcome {
            AllocateOutcome::Allocated => Self::AllocateSuccessAllocated,
            AllocateOutcome::AlreadyExists => Self::AllocateSuccessAlreadyExists,
            AllocateOutcome::Failed => Self::AllocateFailed,
            AllocateOutcome::FailedNoSpace => Self::AllocateFailedNoSpace,
            AllocateOutcome::Busy => Self::AllocateBusy,
        }
    }
}

impl From<v1::AllocateOutcome> for AllocateOutcome {
    /// `UNSPECIFIED` reads as [`AllocateOutcome::Failed`] (see [`outcome_from_wire`]).
    fn from(outcome: v1::AllocateOutcome) -> Self {
        match outcome {
            v1::AllocateOutcome::AllocateSuccessAllocated => Self::Allocated,
            v1::AllocateOutcome::AllocateSuccessAlreadyExists => Self::AlreadyExists,
            v1::AllocateOutcome::AllocateFailedNoSpace => Self::FailedNoSpace,
            v1::AllocateOutcome::AllocateBusy => Self::Busy,
            v1::AllocateOutcome::AllocateFailed | v1::AllocateOutcome::AllocateUnspecified => Self::Failed,
        }
    }
}

/// The wire value of an allocation outcome.
pub fn outcome_to_wire(outcome: AllocateOutcome) -> i32 {
    v1::AllocateOutcome::from(outcome) as i32
}

/// The wire value of an allocation outcome for a caller that may not know `ALLOCATE_BUSY`: busy
/// becomes `ALLOCATE_FAILED_NO_SPACE` unless the caller said it accepts busy. An older client thus
/// sees what it saw before the value existed (it tries another node), instead of an unknown value,
/// which it would read as a hard failure.
pub fn outcome_to_wire_for(outcome: AllocateOutcome, accepts_busy: bool) -> i32 {
    match outcome {
        AllocateOutcome::Busy if !accepts_busy => outcome_to_wire(AllocateOutcome::FailedNoSpace),
        other => outcome_to_wire(other),
    }
}

/// An allocation outcome from the wire; `UNSPECIFIED` and unknown values (a newer peer's outcome)
/// read as [`AllocateOutcome::Failed`]: never as a success (no slot to write into) and never as
/// busy (no unbounded retry of a peer whose answer is not understood).
pub fn outcome_from_wire(value: i32) -> AllocateOutcome {
    v1::AllocateOutcome::try_from(value).map_or(AllocateOutcome::Failed, AllocateOutcome::from)
}

impl From<PageLocation> for v1::PageLocation {
    fn from(page: PageLocation) -> Self {
        Self { buffer_index: page.buffer_index, page_index: page.page_index }
    }
}

impl From<&v1::PageLocation> for PageLocation {
    fn from(page: &v1::PageLocation) -> Self {
        Self::new(page.buffer_index, page.page_index)
    }
}

impl From<&BufferDesc> for v1::BufferDesc {
    /// With `backend_id` as the descriptor carries it (stamp it first: see
    /// [`BufferDesc::with_backend_id`]).
    fn from(desc: &BufferDesc) -> Self {
        let (location, device) = match desc.location {
            MemoryLocation::Host => (v1::MemoryKind::MemoryHost, 0),
            MemoryLocation::Gpu { device } => (v1::MemoryKind::MemoryGpu, device),
        };
        Self {
            backend_id: desc.backend_id,
            buffer_index: desc.buffer_index,
            size: desc.size,
            location: location as i32,
            device,
            tcp: desc
                .remote
                .as_ref()
                .map(|r| v1::RemoteRegion { endpoint: r.endpoint.clone(), region_id: r.region_id }),
        }
    }
}

impl TryFrom<&v1::BufferDesc> for BufferDesc {
    type Error = WireError;

    /// # Errors
    /// [`WireError::UnknownMemoryKind`] for a memory kind this build does not know.
    fn try_from(desc: &v1::BufferDesc) -> Result<Self, WireError> {
        let location = match v1::MemoryKind::try_from(desc.location) {
            Ok(v1::MemoryKind::MemoryHost) => MemoryLocation::Host,
            Ok(v1::MemoryKind::MemoryGpu) => MemoryLocation::Gpu { device: desc.device },
            Err(_) => return Err(WireError::UnknownMemoryKind { value: desc.location }),
        };
        Ok(Self {
            backend_id: desc.backend_id,
            buffer_index: desc.buffer_index,
            size: desc.size,
            location,
            remote: desc.tcp.as_ref().map(|r| RemoteRegion { endpoint: r.endpoint.clone(), region_id: r.region_id }),
        })
    }
}

impl From<KvEvent> for v1::KvEvent {
    fn from(event: KvEvent) -> Self {
        let kind = match event.kind {
            KvEventKind::Add => v1::KvEventKind::KvEventAdd,
            KvEventKind::Remove => v1::KvEventKind::KvEventRemove,
        };
        Self { kind: kind as i32, key: event.key, tier: tier_to_wire(event.tier), size: event.size }
    }
}

impl TryFrom<v1::KvEvent> for KvEvent {
    type Error = WireError;

    /// # Errors
    /// [`WireError::UnknownEventKind`] for a kind this build does not know, [`WireError::EmptyKey`]
    /// for an event without a key.
    fn try_from(event: v1::KvEvent) -> Result<Self, WireError> {
        let kind = match v1::KvEventKind::try_from(event.kind) {
            Ok(v1::KvEventKind::KvEventAdd) => KvEventKind::Add,
            Ok(v1::KvEventKind::KvEventRemove) => KvEventKind::Remove,
            Err(_) => return Err(WireError::UnknownEventKind { value: event.kind }),
        };
        if event.key.is_empty() {
            return Err(WireError::EmptyKey);
        }
        Ok(Self { kind, key: event.key, tier: tier_from_wire(event.tier), size: event.size })
    }
}

/// One tier's capacity on the wire, with the medium's page size (0: unknown), which the master needs
/// to charge a key the pages it occupies rather than its byte length.
pub fn capacity_to_wire(tier: TierType, cap: TierCapacity, page_size: u64) -> v1::TierCapacity {
    v1::TierCapacity {
        tier: tier_to_wire(tier),
        total_bytes: cap.total_bytes,
        available_bytes: cap.available_bytes,
        page_size,
    }
}

/// One tier's capacity from the wire (an unknown tier reads as [`TierType::Unknown`]: the caller
/// decides whether to skip it).
pub fn capacity_from_wire(cap: &v1::TierCapacity) -> (TierType, TierCapacity) {
    (tier_from_wire(cap.tier), TierCapacity { total_bytes: cap.total_bytes, available_bytes: cap.available_bytes })
}
