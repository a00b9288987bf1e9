//! Conversions between `umbp-core` values and the `umbp.v1` messages of the peer protocol. Pure
//! functions: the service encodes with them and a client decodes with them, so both sides agree by
//! construction.

use umbp_core::{AllocateOutcome, BufferDesc, MemoryLocation, PageLocation, RemoteRegion};
use umbp_proto::v1 as pb;

use super::codec::CodecError;

pub use umbp_proto::convert::{tier_from_wire, tier_to_wire};

/// The wire value of an allocation outcome.
pub fn outcome_to_wire(outcome: AllocateOutcome) -> i32 {
    let wire = match outcome {
        AllocateOutcome::Allocated => pb::AllocateOutcome::AllocateSuccessAllocated,
        AllocateOutcome::AlreadyExists => pb::AllocateOutcome::AllocateSuccessAlreadyExists,
        AllocateOutcome::Failed => pb::AllocateOutcome::AllocateFailed,
        AllocateOutcome::FailedNoSpace => pb::AllocateOutcome::AllocateFailedNoSpace,
        AllocateOutcome::Busy => pb::AllocateOutcome::AllocateBusy,
    };
    wire as i32
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
    match pb::AllocateOutcome::try_from(value) {
        Ok(pb::AllocateOutcome::AllocateSuccessAllocated) => AllocateOutcome::Allocated,
        Ok(pb::AllocateOutcome::AllocateSuccessAlreadyExists) => AllocateOutcome::AlreadyExists,
        Ok(pb::AllocateOutcome::AllocateFailedNoSpace) => AllocateOutcome::FailedNoSpace,
        Ok(pb::AllocateOutcome::AllocateBusy) => AllocateOutcome::Busy,
        Ok(pb::AllocateOutcome::AllocateFailed | pb::AllocateOutcome::AllocateUnspecified) | Err(_) => {
            AllocateOutcome::Failed
        }
    }
}

/// A page location on the wire.
pub fn page_to_wire(page: PageLocation) -> pb::PageLocation {
    pb::PageLocation { buffer_index: page.buffer_index, page_index: page.page_index }
}

/// A page location from the wire.
pub fn page_from_wire(page: &pb::PageLocation) -> PageLocation {
    PageLocation::new(page.buffer_index, page.page_index)
}

/// A buffer descriptor on the wire, with `backend_id` as the descriptor carries it (stamp it first:
/// see [`BufferDesc::with_backend_id`]).
pub fn desc_to_wire(desc: &BufferDesc) -> pb::BufferDesc {
    let (location, device) = match desc.location {
        MemoryLocation::Host => (pb::MemoryKind::MemoryHost, 0),
        MemoryLocation::Gpu { device } => (pb::MemoryKind::MemoryGpu, device),
    };
    pb::BufferDesc {
        backend_id: desc.backend_id,
        buffer_index: desc.buffer_index,
        size: desc.size,
        location: location as i32,
        device,
        tcp: desc.remote.as_ref().map(|r| pb::RemoteRegion { endpoint: r.endpoint.clone(), region_id: r.region_id }),
    }
}

/// A buffer descriptor from the wire.
///
/// # Errors
/// [`CodecError::UnknownMemoryKind`] for a memory kind this build does not know: a buffer whose
/// memory cannot be classified cannot be transferred to safely.
pub fn desc_from_wire(desc: &pb::BufferDesc) -> Result<BufferDesc, CodecError> {
    let location = match pb::MemoryKind::try_from(desc.location) {
        Ok(pb::MemoryKind::MemoryHost) => MemoryLocation::Host,
        Ok(pb::MemoryKind::MemoryGpu) => MemoryLocation::Gpu { device: desc.device },
        Err(_) => return Err(CodecError::UnknownMemoryKind { value: desc.location }),
    };
    Ok(BufferDesc {
        backend_id: desc.backend_id,
        buffer_index: desc.buffer_index,
        size: desc.size,
        location,
        remote: desc.tcp.as_ref().map(|r| RemoteRegion { endpoint: r.endpoint.clone(), region_id: r.region_id }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_round_trip_and_unspecified_is_failed() {
        for o in [
            AllocateOutcome::Allocated,
            AllocateOutcome::AlreadyExists,
            AllocateOutcome::Failed,
            AllocateOutcome::FailedNoSpace,
            AllocateOutcome::Busy,
        ] {
            assert_eq!(outcome_from_wire(outcome_to_wire(o)), o);
            assert_eq!(outcome_from_wire(outcome_to_wire_for(o, true)), o);
        }
        assert_eq!(outcome_from_wire(0), AllocateOutcome::Failed);
        assert_eq!(outcome_from_wire(99), AllocateOutcome::Failed);
        assert_eq!(outcome_from_wire(-1), AllocateOutcome::Failed);
    }

    #[test]
    fn busy_reaches_only_a_caller_that_accepts_it() {
        // An older caller (accepts_busy unset) gets what it got before busy existed: no space.
        assert_eq!(
            outcome_from_wire(outcome_to_wire_for(AllocateOutcome::Busy, false)),
            AllocateOutcome::FailedNoSpace
        );
        assert_eq!(outcome_to_wire(AllocateOutcome::Busy), pb::AllocateOutcome::AllocateBusy as i32);
        for o in [AllocateOutcome::Allocated, AllocateOutcome::AlreadyExists, AllocateOutcome::Failed] {
            assert_eq!(outcome_to_wire_for(o, false), outcome_to_wire(o), "{o:?} is unchanged");
        }
    }

    #[test]
    fn descs_round_trip_and_unknown_memory_kind_is_an_error() {
        let host = BufferDesc {
            backend_id: 3,
            buffer_index: 7,
            size: 1 << 20,
            location: MemoryLocation::Host,
            remote: Some(RemoteRegion { endpoint: "127.0.0.1:9".into(), region_id: 11 }),
        };
        let gpu = BufferDesc { location: MemoryLocation::Gpu { device: 2 }, remote: None, ..host.clone() };
        for d in [host, gpu] {
            assert_eq!(desc_from_wire(&desc_to_wire(&d)).ok(), Some(d));
        }
        let bad = pb::BufferDesc { location: 9, ..pb::BufferDesc::default() };
        assert!(matches!(desc_from_wire(&bad), Err(CodecError::UnknownMemoryKind { value: 9 })));
    }
}
