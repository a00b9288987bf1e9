//! The wire is stable: field numbers and enum values are pinned here by golden encodings, so an
//! accidental renumbering in a `.proto` file fails a test instead of breaking old peers.

use prost::Message;
use umbp_proto::v1;

#[test]
fn tier_values_are_the_core_wire_values() {
    assert_eq!(v1::TierType::TierUnknown as i32, 0);
    assert_eq!(v1::TierType::TierHbm as i32, 1);
    assert_eq!(v1::TierType::TierDram as i32, 2);
    assert_eq!(v1::TierType::TierSsd as i32, 3);
    assert_eq!(v1::AllocateOutcome::AllocateSuccessAllocated as i32, 1);
    assert_eq!(v1::AllocateOutcome::AllocateFailedNoSpace as i32, 4);
    assert_eq!(v1::NodeStatus::Alive as i32, 1);
    assert_eq!(v1::RoutePutOutcome::RoutePutAlreadyExists as i32, 2);
}

#[test]
fn heartbeat_field_numbers_are_pinned() {
    let req = v1::HeartbeatRequest {
        node_id: "n".into(),
        is_full_sync: true,
        delta_seq_baseline: 7,
        full_sync_chunk: 2,
        full_sync_final: true,
        ..Default::default()
    };
    // field 1 (len) "n", field 3 (varint) 1, field 6 (varint) 7, field 8 (varint) 2, field 9 (varint) 1.
    assert_eq!(req.encode_to_vec(), vec![0x0a, 1, b'n', 0x18, 1, 0x30, 7, 0x40, 2, 0x48, 1]);
}

#[test]
fn the_local_placement_grant_field_numbers_are_pinned() {
    let reg = v1::RegisterClientResponse { heartbeat_interval_ms: 5, local_puts: true };
    // field 1 (varint) 5, field 3 (varint) 1.
    assert_eq!(reg.encode_to_vec(), vec![0x08, 5, 0x18, 1]);
    let hb = v1::HeartbeatResponse { local_puts: true, ..Default::default() };
    // field 4 (varint) 1.
    assert_eq!(hb.encode_to_vec(), vec![0x20, 1]);
}

#[test]
fn buffer_desc_field_numbers_are_pinned() {
    let d = v1::BufferDesc {
        backend_id: 1,
        buffer_index: 2,
        size: 3,
        location: v1::MemoryKind::MemoryGpu as i32,
        device: 5,
        tcp: Some(v1::RemoteRegion { endpoint: "e".into(), region_id: 9 }),
    };
    assert_eq!(d.encode_to_vec(), vec![0x08, 1, 0x10, 2, 0x18, 3, 0x20, 1, 0x28, 5, 0x32, 5, 0x0a, 1, b'e', 0x10, 9]);
    let back = v1::BufferDesc::decode(d.encode_to_vec().as_slice()).expect("decodes");
    assert_eq!(back, d);
}

#[test]
fn columnar_route_get_reply_round_trips() {
    let r = v1::BatchRouteGetResponse {
        nodes: vec![v1::NodeInfo {
            node_id: "a".into(),
            peer_address: "127.0.0.1:1".into(),
            data_endpoint: "127.0.0.1:2".into(),
        }],
        node_ref: vec![1, 0, 1],
        tier: vec![v1::TierType::TierDram as i32; 3],
        size: vec![10, 0, 30],
    };
    assert_eq!(v1::BatchRouteGetResponse::decode(r.encode_to_vec().as_slice()).expect("decodes"), r);
}

#[test]
fn an_unknown_enum_value_still_decodes() {
    // A newer peer's tier 9 decodes (as an unknown i32), it does not fail the message.
    let bytes = vec![0x08, 9, 0x10, 100, 0x18, 50];
    let cap = v1::TierCapacity::decode(bytes.as_slice()).expect("decodes");
    assert_eq!(cap.tier, 9);
    assert!(v1::TierType::try_from(cap.tier).is_err());
}

#[test]
fn the_capacity_page_size_is_field_4_and_an_older_report_reads_as_unknown() {
    let cap = v1::TierCapacity { page_size: 65_536, ..Default::default() };
    // field 4 (varint) 65536.
    assert_eq!(cap.encode_to_vec(), vec![0x20, 0x80, 0x80, 0x04]);
    // An older node's report (fields 1-3 only) decodes with page size 0: unknown.
    let old = v1::TierCapacity::decode([0x08, 2, 0x10, 100, 0x18, 50].as_slice()).expect("decodes");
    assert_eq!((old.total_bytes, old.available_bytes, old.page_size), (100, 50, 0));
}

#[test]
fn the_read_release_and_busy_field_numbers_are_pinned() {
    let r = v1::BatchResolveKeysResponse { busy: vec![true], lease_id: vec![7], ..Default::default() };
    // field 10 (packed bool) [1], field 11 (packed varint) [7].
    assert_eq!(r.encode_to_vec(), vec![0x52, 1, 1, 0x5a, 1, 7]);
    let one = v1::ResolveKeyResponse { busy: true, lease_id: 9, ..Default::default() };
    // field 8 (varint) 1, field 9 (varint) 9.
    assert_eq!(one.encode_to_vec(), vec![0x40, 1, 0x48, 9]);
    let release =
        v1::ReleaseReadsRequest { reads: vec![v1::ReadRelease { key: "k".into(), lease_id: 5, backend_id: 2 }] };
    // field 1 (len 7): { field 1 "k", field 2 (varint) 5, field 3 (varint) 2 }.
    assert_eq!(release.encode_to_vec(), vec![0x0a, 7, 0x0a, 1, b'k', 0x10, 5, 0x18, 2]);
}

#[test]
fn the_incarnation_role_and_retention_field_numbers_are_pinned() {
    // RegisterClientRequest.incarnation = 14 (varint): tag 0x70.
    let reg = v1::RegisterClientRequest { incarnation: 3, ..Default::default() };
    assert_eq!(reg.encode_to_vec(), vec![0x70, 3]);
    // UnregisterClientRequest.incarnation = 2.
    assert_eq!(v1::UnregisterClientRequest { incarnation: 3, ..Default::default() }.encode_to_vec(), vec![0x10, 3]);
    // HeartbeatRequest.incarnation = 10.
    assert_eq!(v1::HeartbeatRequest { incarnation: 3, ..Default::default() }.encode_to_vec(), vec![0x50, 3]);
    // HeartbeatResponse.superseded = 5.
    assert_eq!(v1::HeartbeatResponse { superseded: true, ..Default::default() }.encode_to_vec(), vec![0x28, 1]);
    // NodeStatusInfo.role = 11, incarnation = 12.
    let info = v1::NodeStatusInfo { role: v1::NodeRole::Client as i32, incarnation: 3, ..Default::default() };
    assert_eq!(info.encode_to_vec(), vec![0x58, 2, 0x60, 3]);
    assert_eq!(
        (v1::NodeRole::Unspecified as i32, v1::NodeRole::Storage as i32, v1::NodeRole::Client as i32),
        (0, 1, 2)
    );
    // GetClusterStatusResponse.expired_retention_ms = 3.
    let status = v1::GetClusterStatusResponse { expired_retention_ms: 3, ..Default::default() };
    assert_eq!(status.encode_to_vec(), vec![0x18, 3]);
}

#[test]
fn the_allocate_busy_value_and_accepts_busy_field_are_pinned() {
    assert_eq!(v1::AllocateOutcome::AllocateBusy as i32, 5);
    // field 1 (varint) 5: a busy answer carries nothing else.
    let busy = v1::AllocateSlotResponse { outcome: v1::AllocateOutcome::AllocateBusy as i32, ..Default::default() };
    assert_eq!(busy.encode_to_vec(), vec![0x08, 5]);
    // field 2 (varint) 1.
    let req = v1::BatchAllocateSlotsRequest { entries: Vec::new(), accepts_busy: true };
    assert_eq!(req.encode_to_vec(), vec![0x10, 1]);
    // An older caller's request (no field 2) reads as not accepting busy.
    let old = v1::BatchAllocateSlotsRequest::decode([0x0a, 0x00].as_slice()).expect("decodes");
    assert!(!old.accepts_busy && old.entries.len() == 1);
}

#[test]
fn the_route_reply_data_endpoint_field_numbers_are_pinned() {
    // NodeInfo.data_endpoint = 3: tag 0x1a.
    let node = v1::NodeInfo { data_endpoint: "d".into(), ..Default::default() };
    assert_eq!(node.encode_to_vec(), vec![0x1a, 1, b'd']);
    // RoutePutEntry.data_endpoint = 5 and RoutePutResponse.data_endpoint = 5: tag 0x2a.
    let entry = v1::RoutePutEntry { data_endpoint: "d".into(), ..Default::default() };
    assert_eq!(entry.encode_to_vec(), vec![0x2a, 1, b'd']);
    let put = v1::RoutePutResponse { data_endpoint: "d".into(), ..Default::default() };
    assert_eq!(put.encode_to_vec(), vec![0x2a, 1, b'd']);
    // RouteGetResponse.data_endpoint = 6: tag 0x32.
    let get = v1::RouteGetResponse { data_endpoint: "d".into(), ..Default::default() };
    assert_eq!(get.encode_to_vec(), vec![0x32, 1, b'd']);
    // An older master's node (no field 3) reads as having no data endpoint.
    let old = v1::NodeInfo::decode([0x0a, 1, b'n'].as_slice()).expect("decodes");
    assert!(old.node_id == "n" && old.data_endpoint.is_empty());
}

#[test]
fn the_columnar_route_put_field_numbers_are_pinned() {
    // BatchRoutePutRequest.columnar = 5: tag 0x28. An older master skips it and answers entries.
    let request = v1::BatchRoutePutRequest { columnar: true, ..Default::default() };
    assert_eq!(request.encode_to_vec(), vec![0x28, 1]);
    // BatchRoutePutResponse: nodes = 2 (0x12), then packed node_ref = 3 (0x1a), tier = 4 (0x22),
    // outcome = 5 (0x2a).
    let reply = v1::BatchRoutePutResponse {
        nodes: vec![v1::NodeInfo { node_id: "n".into(), ..Default::default() }],
        node_ref: vec![1],
        tier: vec![2],
        outcome: vec![1],
        ..Default::default()
    };
    assert_eq!(reply.encode_to_vec(), vec![0x12, 3, 0x0a, 1, b'n', 0x1a, 1, 1, 0x22, 1, 2, 0x2a, 1, 1]);
    // An older client's request (no field 5) asks for entries.
    let old = v1::BatchRoutePutRequest::decode([0x0a, 1, b'w'].as_slice()).expect("decodes");
    assert!(old.node_id == "w" && !old.columnar);
}
