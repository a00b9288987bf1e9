//! Every conversion between `umbp-core` values and the `umbp.v1` messages: round trips through real
//! protobuf bytes (what a peer on another node decodes) and every refusal path of [`WireError`].

use proptest::prelude::*;
use prost::Message;
use umbp_core::{
    AllocateOutcome, BufferDesc, ErrorKind, KvEvent, KvEventKind, MemoryLocation, PageLocation, RemoteRegion,
    TierCapacity, TierType,
};
use umbp_proto::WireError;
use umbp_proto::convert::{
    capacity_from_wire, capacity_to_wire, outcome_from_wire, outcome_to_wire, outcome_to_wire_for, tier_from_wire,
    tier_to_wire,
};
use umbp_proto::v1;

/// Encodes `msg` and parses the bytes back: what the other side of a call sees.
fn through_bytes<M: Message + Default>(msg: &M) -> M {
    M::decode(msg.encode_to_vec().as_slice()).expect("a message we encoded decodes")
}

const OUTCOMES: [AllocateOutcome; 5] = [
    AllocateOutcome::Allocated,
    AllocateOutcome::AlreadyExists,
    AllocateOutcome::Failed,
    AllocateOutcome::FailedNoSpace,
    AllocateOutcome::Busy,
];

#[test]
fn tiers_round_trip_and_strangers_are_unknown() {
    for tier in TierType::ALL {
        assert_eq!(tier_from_wire(tier_to_wire(tier)), tier);
        assert_eq!(tier_to_wire(tier), v1::TierType::try_from(tier_to_wire(tier)).expect("known") as i32);
    }
    assert_eq!(tier_from_wire(-1), TierType::Unknown);
    assert_eq!(tier_from_wire(99), TierType::Unknown);
    assert_eq!(tier_to_wire(TierType::Unknown), 0);
    assert_eq!(tier_to_wire(TierType::Dram), v1::TierType::TierDram as i32);
}

#[test]
fn outcomes_round_trip_and_unspecified_is_failed() {
    for o in OUTCOMES {
        assert_eq!(outcome_from_wire(outcome_to_wire(o)), o);
        assert_eq!(outcome_from_wire(outcome_to_wire_for(o, true)), o);
        assert_eq!(AllocateOutcome::from(v1::AllocateOutcome::from(o)), o);
        let reply = v1::AllocateSlotResponse { outcome: outcome_to_wire(o), ..Default::default() };
        assert_eq!(outcome_from_wire(through_bytes(&reply).outcome), o);
    }
    assert_eq!(outcome_from_wire(0), AllocateOutcome::Failed);
    assert_eq!(outcome_from_wire(99), AllocateOutcome::Failed);
    assert_eq!(outcome_from_wire(-1), AllocateOutcome::Failed);
}

#[test]
fn busy_reaches_only_a_caller_that_accepts_it() {
    // An older caller (accepts_busy unset) gets what it got before busy existed: no space.
    assert_eq!(outcome_from_wire(outcome_to_wire_for(AllocateOutcome::Busy, false)), AllocateOutcome::FailedNoSpace);
    assert_eq!(outcome_to_wire(AllocateOutcome::Busy), v1::AllocateOutcome::AllocateBusy as i32);
    for o in [AllocateOutcome::Allocated, AllocateOutcome::AlreadyExists, AllocateOutcome::Failed] {
        assert_eq!(outcome_to_wire_for(o, false), outcome_to_wire(o), "{o:?} is unchanged");
    }
}

#[test]
fn an_unknown_memory_kind_is_refused() {
    let bad = v1::BufferDesc { location: 9, ..v1::BufferDesc::default() };
    assert_eq!(BufferDesc::try_from(&through_bytes(&bad)), Err(WireError::UnknownMemoryKind { value: 9 }));
}

#[test]
fn an_unknown_event_kind_and_an_empty_key_are_refused() {
    let unknown = v1::KvEvent { kind: 7, key: "k".into(), ..Default::default() };
    assert_eq!(KvEvent::try_from(through_bytes(&unknown)), Err(WireError::UnknownEventKind { value: 7 }));
    let keyless = v1::KvEvent { kind: v1::KvEventKind::KvEventAdd as i32, ..Default::default() };
    assert_eq!(KvEvent::try_from(through_bytes(&keyless)), Err(WireError::EmptyKey));
}

#[test]
fn an_unknown_capacity_tier_reads_as_unknown() {
    let cap = v1::TierCapacity { tier: 42, total_bytes: 10, available_bytes: 4, page_size: 0 };
    assert_eq!(capacity_from_wire(&cap), (TierType::Unknown, TierCapacity { total_bytes: 10, available_bytes: 4 }));
}

#[test]
fn every_refusal_is_internal() {
    // A refused message is a peer this build cannot read: no retry makes it readable.
    let all = [
        WireError::UnknownMemoryKind { value: 1 },
        WireError::UnknownEventKind { value: 1 },
        WireError::EmptyKey,
        WireError::MismatchedArrays { field: "tier", len: 1, expected: 2 },
        WireError::MismatchedPageArrays { buffer_index: 1, page_index: 2 },
        WireError::PageCountMismatch { declared: 1, flattened: 2 },
        WireError::PagesForMiss { key_index: 0, page_count: 1 },
        WireError::PagesDoNotCoverSize { key_index: 0, size: 9, page_count: 1, page_size: 4 },
        WireError::BackendIdOutOfRange { backend_id: 99 },
        WireError::BusyHit { key_index: 0 },
    ];
    for e in all {
        assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
    }
}

fn tier() -> impl Strategy<Value = TierType> {
    prop::sample::select(TierType::ALL.to_vec())
}

fn location() -> impl Strategy<Value = MemoryLocation> {
    prop_oneof![Just(MemoryLocation::Host), any::<u32>().prop_map(|device| MemoryLocation::Gpu { device })]
}

fn desc() -> impl Strategy<Value = BufferDesc> {
    (any::<u32>(), any::<u32>(), any::<u64>(), location(), prop::option::of(("[a-z0-9.:]{0,20}", any::<u64>())))
        .prop_map(|(backend_id, buffer_index, size, location, remote)| BufferDesc {
            backend_id,
            buffer_index,
            size,
            location,
            remote: remote.map(|(endpoint, region_id)| RemoteRegion { endpoint, region_id }),
        })
}

proptest! {
    #[test]
    fn descs_round_trip_through_bytes(d in desc()) {
        let wire = through_bytes(&v1::BufferDesc::from(&d));
        prop_assert_eq!(BufferDesc::try_from(&wire), Ok(d));
    }

    #[test]
    fn pages_round_trip_through_bytes(buffer_index in any::<u32>(), page_index in any::<u32>()) {
        let page = PageLocation::new(buffer_index, page_index);
        let wire = through_bytes(&v1::PageLocation::from(page));
        prop_assert_eq!(PageLocation::from(&wire), page);
    }

    #[test]
    fn events_round_trip_through_bytes(
        remove in any::<bool>(), key in "[a-z0-9/_-]{1,40}", tier in tier(), size in any::<u64>()
    ) {
        let kind = if remove { KvEventKind::Remove } else { KvEventKind::Add };
        let event = KvEvent { kind, key, tier, size };
        let wire = through_bytes(&v1::KvEvent::from(event.clone()));
        prop_assert_eq!(KvEvent::try_from(wire), Ok(event));
    }

    #[test]
    fn capacities_round_trip_through_bytes(
        tier in tier(), total_bytes in any::<u64>(), available_bytes in any::<u64>(), page_size in any::<u64>()
    ) {
        let cap = TierCapacity { total_bytes, available_bytes };
        let wire = through_bytes(&capacity_to_wire(tier, cap, page_size));
        prop_assert_eq!(capacity_from_wire(&wire), (tier, cap));
        prop_assert_eq!(wire.page_size, page_size);
    }

    #[test]
    fn no_tier_or_outcome_number_panics(value in any::<i32>()) {
        let _ = tier_from_wire(value);
        let _ = outcome_from_wire(value);
    }

    #[test]
    fn no_desc_or_event_bytes_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        if let Ok(d) = v1::BufferDesc::decode(bytes.as_slice()) {
            let _ = BufferDesc::try_from(&d);
        }
        if let Ok(e) = v1::KvEvent::decode(bytes.as_slice()) {
            let _ = KvEvent::try_from(e);
        }
    }
}
