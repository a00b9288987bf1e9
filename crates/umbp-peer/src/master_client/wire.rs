//! Pure conversions between `umbp-core` values and the `umbp.v1` messages, the full-sync chunker and
//! the validating decoders of the routing replies. No I/O here, so every rule is unit-tested.

use std::time::Duration;

use prost::Message;
use umbp_proto::v1 as pb;

use super::types::{ClusterStatus, NodeLiveness, NodeRole, NodeStatusReport, RouteGetHit, RoutePutDecision};

use umbp_proto::convert::{capacity_from_wire, tier_from_wire};

/// Bytes a message adds to its parent when it is one element of a repeated message field (tag, length
/// prefix and body).
pub(crate) fn nested_len(body: usize) -> usize {
    1 + prost::encoding::encoded_len_varint(body as u64) + body
}

/// Bytes `event` adds to a bundle.
pub(crate) fn event_len(event: &pb::KvEvent) -> usize {
    nested_len(event.encoded_len())
}

/// Bytes `bundle` adds to a request.
pub(crate) fn bundle_len(bundle: &pb::EventBundle) -> usize {
    nested_len(bundle.encoded_len())
}

/// Takes the next full-sync chunk from `events`: at most `max_events` events whose bundle (at `seq`)
/// encodes to at most `max_bytes`. A chunk always holds at least one event when any is left, so a
/// single oversized event still goes (alone); an exhausted iterator gives an empty chunk. Order is
/// kept. The snapshot is converted and cut lazily, so a full sync holds the remaining snapshot and one
/// chunk, never a second copy of the whole.
pub(crate) fn take_chunk<I: Iterator<Item = pb::KvEvent>>(
    events: &mut std::iter::Peekable<I>,
    max_events: usize,
    max_bytes: usize,
    seq: u64,
) -> Vec<pb::KvEvent> {
    let max_events = max_events.max(1);
    // The bundle's own header: its seq field and its length prefix inside the request (bounded by
    // the varint of max_bytes).
    let header =
        1 + prost::encoding::encoded_len_varint(seq) + 1 + prost::encoding::encoded_len_varint(max_bytes as u64);
    let budget = max_bytes.saturating_sub(header);
    let mut chunk: Vec<pb::KvEvent> = Vec::new();
    let mut bytes = 0usize;
    while chunk.len() < max_events {
        let Some(len) = events.peek().map(event_len) else { break };
        if !chunk.is_empty() && bytes + len > budget {
            break;
        }
        let Some(event) = events.next() else { break };
        bytes += len;
        chunk.push(event);
    }
    chunk
}

/// Splits a whole snapshot with [`take_chunk`]; an empty snapshot gives no chunks.
#[cfg(test)]
pub(crate) fn split_into_chunks(
    events: Vec<pb::KvEvent>,
    max_events: usize,
    max_bytes: usize,
    seq: u64,
) -> Vec<Vec<pb::KvEvent>> {
    let mut events = events.into_iter().peekable();
    let mut chunks = Vec::new();
    while events.peek().is_some() {
        chunks.push(take_chunk(&mut events, max_events, max_bytes, seq));
    }
    chunks
}

/// Decodes a `BatchRoutePut` reply for `keys` keys: the columnar form this client asks for, or an
/// older master's one entry per key (a reply with entries). Every key must be answered; a `ROUTED`
/// key must name a node (columnar: refer to a listed node with an id). Unknown outcome numbers (a
/// newer master) read as `Unavailable`: never write on a decision the client does not understand.
pub(crate) fn decode_route_put(keys: usize, reply: pb::BatchRoutePutResponse) -> Result<Vec<RoutePutDecision>, String> {
    if !reply.entries.is_empty() || keys == 0 {
        return decode_route_put_entries(keys, reply.entries);
    }
    columns_fit(
        keys,
        &[("outcome", reply.outcome.len()), ("node_ref", reply.node_ref.len()), ("tier", reply.tier.len())],
    )?;
    let mut out = Vec::with_capacity(keys);
    for (i, (&outcome, &node_ref)) in reply.outcome.iter().zip(&reply.node_ref).enumerate() {
        out.push(match pb::RoutePutOutcome::try_from(outcome) {
            Ok(pb::RoutePutOutcome::RoutePutRouted) => {
                let node = referenced_node(&reply.nodes, node_ref, i)?;
                RoutePutDecision::Routed {
                    node_id: node.node_id.clone(),
                    tier: tier_from_wire(reply.tier[i]),
                    peer_address: node.peer_address.clone(),
                    data_endpoint: node.data_endpoint.clone(),
                }
            }
            Ok(pb::RoutePutOutcome::RoutePutAlreadyExists) => RoutePutDecision::AlreadyExists,
            Ok(pb::RoutePutOutcome::RoutePutUnavailable) | Err(_) => RoutePutDecision::Unavailable,
        });
    }
    Ok(out)
}

/// An older master's `BatchRoutePut` reply: one entry per key.
fn decode_route_put_entries(keys: usize, entries: Vec<pb::RoutePutEntry>) -> Result<Vec<RoutePutDecision>, String> {
    if entries.len() != keys {
        return Err(format!("{} entries for {keys} keys", entries.len()));
    }
    entries
        .into_iter()
        .enumerate()
        .map(|(i, e)| match pb::RoutePutOutcome::try_from(e.outcome) {
            Ok(pb::RoutePutOutcome::RoutePutRouted) => {
                if e.node_id.is_empty() {
                    return Err(format!("entry {i} is ROUTED without a node id"));
                }
                Ok(RoutePutDecision::Routed {
                    node_id: e.node_id,
                    tier: tier_from_wire(e.tier),
                    peer_address: e.peer_address,
                    data_endpoint: e.data_endpoint,
                })
            }
            Ok(pb::RoutePutOutcome::RoutePutAlreadyExists) => Ok(RoutePutDecision::AlreadyExists),
            Ok(pb::RoutePutOutcome::RoutePutUnavailable) | Err(_) => Ok(RoutePutDecision::Unavailable),
        })
        .collect()
}

/// Decodes the columnar `BatchRouteGet` reply for `keys` keys (FIX over the reference, which trusted
/// it): `node_ref`, `tier` and `size` must each have exactly `keys` entries; a ref is 1-based into
/// `nodes` with 0 meaning "not found"; a ref past `nodes.len()` or a referenced node without an id is
/// an error. A malformed reply is rejected whole, never turned into a wrong hit.
pub(crate) fn decode_route_get(
    keys: usize,
    reply: pb::BatchRouteGetResponse,
) -> Result<Vec<Option<RouteGetHit>>, String> {
    columns_fit(keys, &[("node_ref", reply.node_ref.len()), ("tier", reply.tier.len()), ("size", reply.size.len())])?;
    let mut hits = Vec::with_capacity(keys);
    for (i, &node_ref) in reply.node_ref.iter().enumerate() {
        if node_ref == 0 {
            hits.push(None);
            continue;
        }
        let node = referenced_node(&reply.nodes, node_ref, i)?;
        hits.push(Some(RouteGetHit {
            node_id: node.node_id.clone(),
            peer_address: node.peer_address.clone(),
            data_endpoint: node.data_endpoint.clone(),
            tier: tier_from_wire(reply.tier[i]),
            size: reply.size[i],
        }));
    }
    Ok(hits)
}

/// A columnar reply's columns, by name and length: each must have one value per key.
fn columns_fit(keys: usize, columns: &[(&str, usize)]) -> Result<(), String> {
    match columns.iter().find(|(_, len)| *len != keys) {
        Some((name, len)) => Err(format!("{name} has {len} entries for {keys} keys")),
        None => Ok(()),
    }
}

/// The node key `key`'s 1-based `node_ref` names in a columnar reply's `nodes`: it must be listed
/// and have an id.
fn referenced_node(nodes: &[pb::NodeInfo], node_ref: u32, key: usize) -> Result<&pb::NodeInfo, String> {
    let node = (node_ref as usize)
        .checked_sub(1)
        .and_then(|n| nodes.get(n))
        .ok_or_else(|| format!("key {key} refers to node {node_ref} but the reply lists {} nodes", nodes.len()))?;
    if node.node_id.is_empty() {
        return Err(format!("node {node_ref} (referenced by key {key}) has no node id"));
    }
    Ok(node)
}

/// Decodes a `BatchLookup` reply for `keys` keys.
pub(crate) fn decode_lookup(keys: usize, reply: pb::BatchLookupResponse) -> Result<Vec<bool>, String> {
    if reply.found.len() != keys {
        return Err(format!("{} answers for {keys} keys", reply.found.len()));
    }
    Ok(reply.found)
}

/// Converts the operator view.
pub(crate) fn decode_cluster_status(reply: pb::GetClusterStatusResponse) -> ClusterStatus {
    let nodes = reply
        .nodes
        .into_iter()
        .map(|n| NodeStatusReport {
            status: match pb::NodeStatus::try_from(n.status) {
                Ok(pb::NodeStatus::Alive) => NodeLiveness::Alive,
                Ok(pb::NodeStatus::Expired) => NodeLiveness::Expired,
                Ok(pb::NodeStatus::Unknown) | Err(_) => NodeLiveness::Unknown,
            },
            tier_capacities: n.tier_capacities.iter().map(capacity_from_wire).collect(),
            node_id: n.node_id,
            node_address: n.node_address,
            peer_address: n.peer_address,
            data_endpoint: n.data_endpoint,
            key_count: n.key_count,
            last_heartbeat_age: Duration::from_millis(n.last_heartbeat_age_ms),
            last_applied_seq: n.last_applied_seq,
            tags: n.tags,
            role: match pb::NodeRole::try_from(n.role) {
                Ok(pb::NodeRole::Storage) => NodeRole::Storage,
                Ok(pb::NodeRole::Client) => NodeRole::Client,
                Ok(pb::NodeRole::Unspecified) | Err(_) => NodeRole::Unknown,
            },
            incarnation: n.incarnation,
        })
        .collect();
    ClusterStatus {
        nodes,
        total_keys: reply.total_keys,
        expired_retention: Duration::from_millis(reply.expired_retention_ms),
    }
}

#[cfg(test)]
mod tests {
    use umbp_core::TierType;
    use umbp_proto::convert::tier_to_wire;

    use super::*;

    fn node(id: &str) -> pb::NodeInfo {
        pb::NodeInfo { node_id: id.into(), peer_address: format!("{id}:7000"), data_endpoint: format!("{id}:7002") }
    }

    fn reply(nodes: &[&str], refs: &[u32], tiers: &[TierType], sizes: &[u64]) -> pb::BatchRouteGetResponse {
        pb::BatchRouteGetResponse {
            nodes: nodes.iter().map(|n| node(n)).collect(),
            node_ref: refs.to_vec(),
            tier: tiers.iter().map(|t| tier_to_wire(*t)).collect(),
            size: sizes.to_vec(),
        }
    }

    #[test]
    fn columnar_reply_dedups_nodes_with_one_based_refs() {
        let mut r = reply(
            &["a", "b"],
            &[1, 2, 1, 0],
            &[TierType::Dram, TierType::Hbm, TierType::Ssd, TierType::Unknown],
            &[10, 20, 30, 0],
        );
        // "b" as an older master (or a node that registered no data server) sends it: no endpoint.
        r.nodes[1].data_endpoint.clear();
        let hits = decode_route_get(4, r).expect("valid");
        let a = hits[0].as_ref().expect("hit");
        assert_eq!((a.node_id.as_str(), a.peer_address.as_str(), a.tier, a.size), ("a", "a:7000", TierType::Dram, 10));
        assert_eq!(a.data_endpoint, "a:7002");
        let b = hits[1].as_ref().expect("hit");
        assert_eq!((b.node_id.as_str(), b.tier, b.size, b.data_endpoint.as_str()), ("b", TierType::Hbm, 20, ""));
        let a2 = hits[2].as_ref().expect("hit");
        assert_eq!((a2.node_id.as_str(), a2.tier, a2.size), ("a", TierType::Ssd, 30));
        assert!(hits[3].is_none(), "ref 0 is a miss");
    }

    #[test]
    fn columnar_reply_all_misses_and_empty() {
        let hits = decode_route_get(3, reply(&[], &[0, 0, 0], &[TierType::Unknown; 3], &[0, 0, 0])).expect("valid");
        assert_eq!(hits, vec![None, None, None]);
        assert!(decode_route_get(0, pb::BatchRouteGetResponse::default()).expect("valid").is_empty());
    }

    #[test]
    fn columnar_reply_with_wrong_lengths_is_an_error() {
        let t = TierType::Dram;
        for (r, what) in [
            (reply(&["a"], &[1], &[t, t], &[1, 1]), "node_ref"),
            (reply(&["a"], &[1, 1], &[t], &[1, 1]), "tier"),
            (reply(&["a"], &[1, 1], &[t, t], &[1]), "size"),
            (reply(&["a"], &[1, 1, 1], &[t, t, t], &[1, 1, 1]), "node_ref"),
        ] {
            let err = decode_route_get(2, r).expect_err(what);
            assert!(err.contains(what), "{err}");
        }
        // Keys present but an empty reply: the reference's silent mismatch.
        assert!(decode_route_get(2, pb::BatchRouteGetResponse::default()).is_err());
    }

    #[test]
    fn columnar_reply_with_out_of_range_ref_is_an_error() {
        let t = TierType::Dram;
        assert!(decode_route_get(2, reply(&["a"], &[1, 2], &[t, t], &[1, 1])).is_err());
        assert!(decode_route_get(1, reply(&[], &[1], &[t], &[1])).is_err());
        assert!(decode_route_get(1, reply(&["a"], &[u32::MAX], &[t], &[1])).is_err());
        // A referenced node without an id cannot be routed to.
        assert!(decode_route_get(1, reply(&[""], &[1], &[t], &[1])).is_err());
        // An unreferenced bad node is harmless.
        assert_eq!(decode_route_get(1, reply(&[""], &[0], &[t], &[0])).expect("valid"), vec![None]);
    }

    #[test]
    fn route_put_decoding_validates_lengths_and_routed_entries() {
        let routed = |id: &str| pb::RoutePutEntry {
            outcome: pb::RoutePutOutcome::RoutePutRouted as i32,
            node_id: id.into(),
            tier: tier_to_wire(TierType::Dram),
            peer_address: "p:1".into(),
            data_endpoint: "d:2".into(),
        };
        let exists =
            pb::RoutePutEntry { outcome: pb::RoutePutOutcome::RoutePutAlreadyExists as i32, ..Default::default() };
        let unknown = pb::RoutePutEntry { outcome: 42, ..Default::default() };
        let ok = decode_route_put(
            4,
            pb::BatchRoutePutResponse {
                entries: vec![routed("a"), exists, pb::RoutePutEntry::default(), unknown],
                ..Default::default()
            },
        )
        .expect("valid");
        assert_eq!(
            ok,
            vec![
                RoutePutDecision::Routed {
                    node_id: "a".into(),
                    tier: TierType::Dram,
                    peer_address: "p:1".into(),
                    data_endpoint: "d:2".into(),
                },
                RoutePutDecision::AlreadyExists,
                RoutePutDecision::Unavailable,
                RoutePutDecision::Unavailable,
            ]
        );
        let entries = |e: Vec<pb::RoutePutEntry>| pb::BatchRoutePutResponse { entries: e, ..Default::default() };
        assert!(decode_route_put(2, entries(vec![routed("a")])).is_err());
        assert!(decode_route_put(1, entries(vec![routed("")])).is_err());
    }

    #[test]
    fn columnar_route_put_decoding_shares_nodes_and_validates_refs() {
        let node = |id: &str| pb::NodeInfo {
            node_id: id.into(),
            peer_address: format!("p-{id}"),
            data_endpoint: format!("d-{id}"),
        };
        let (routed, exists, none) = (
            pb::RoutePutOutcome::RoutePutRouted as i32,
            pb::RoutePutOutcome::RoutePutAlreadyExists as i32,
            pb::RoutePutOutcome::RoutePutUnavailable as i32,
        );
        let dram = tier_to_wire(TierType::Dram);
        let reply = |nodes: Vec<pb::NodeInfo>, outcome: Vec<i32>, node_ref: Vec<u32>| pb::BatchRoutePutResponse {
            tier: vec![dram; outcome.len()],
            nodes,
            outcome,
            node_ref,
            ..Default::default()
        };
        let to = |id: &str| RoutePutDecision::Routed {
            node_id: id.into(),
            tier: TierType::Dram,
            peer_address: format!("p-{id}"),
            data_endpoint: format!("d-{id}"),
        };
        let ok = decode_route_put(
            5,
            reply(vec![node("a"), node("b")], vec![routed, exists, routed, none, 42], vec![2, 0, 1, 0, 0]),
        )
        .expect("valid");
        assert_eq!(
            ok,
            vec![
                to("b"),
                RoutePutDecision::AlreadyExists,
                to("a"),
                RoutePutDecision::Unavailable,
                RoutePutDecision::Unavailable
            ]
        );
        // A column of the wrong length, a routed key referring to no listed node or to one without
        // an id: the reply is refused whole.
        assert!(decode_route_put(2, reply(vec![node("a")], vec![routed], vec![1])).is_err());
        let mut short = reply(vec![node("a")], vec![routed, routed], vec![1, 1]);
        short.tier.pop();
        assert!(decode_route_put(2, short).is_err());
        assert!(decode_route_put(1, reply(vec![node("a")], vec![routed], vec![0])).is_err());
        assert!(decode_route_put(1, reply(vec![node("a")], vec![routed], vec![2])).is_err());
        assert!(decode_route_put(1, reply(vec![node("")], vec![routed], vec![1])).is_err());
        // An empty reply for keys is refused, not read as "nothing routed".
        assert!(decode_route_put(1, pb::BatchRoutePutResponse::default()).is_err());
    }

    #[test]
    fn lookup_decoding_validates_length() {
        assert_eq!(decode_lookup(2, pb::BatchLookupResponse { found: vec![true, false] }).expect("ok"), [true, false]);
        assert!(decode_lookup(3, pb::BatchLookupResponse { found: vec![true] }).is_err());
    }

    fn events(n: usize, key_len: usize) -> Vec<pb::KvEvent> {
        (0..n)
            .map(|i| {
                let mut key = format!("k{i}-");
                key.extend(std::iter::repeat_n('x', key_len.saturating_sub(key.len())));
                pb::KvEvent::from(umbp_core::KvEvent::add(key, TierType::Dram, 4096))
            })
            .collect()
    }

    #[test]
    fn chunks_respect_the_event_cap_and_keep_order() {
        let evs = events(25, 8);
        let chunks = split_into_chunks(evs.clone(), 10, 1 << 20, 7);
        assert_eq!(chunks.iter().map(Vec::len).collect::<Vec<_>>(), [10, 10, 5]);
        assert_eq!(chunks.concat(), evs);
        assert!(split_into_chunks(Vec::new(), 10, 1 << 20, 7).is_empty());
    }

    #[test]
    fn chunks_respect_the_byte_cap() {
        let max_bytes = 8 << 10;
        let evs = events(1000, 200);
        let chunks = split_into_chunks(evs.clone(), usize::MAX, max_bytes, u64::MAX);
        assert!(chunks.len() > 1);
        for c in &chunks {
            let bundle = pb::EventBundle { seq: u64::MAX, events: c.clone() };
            assert!(bundle_len(&bundle) <= max_bytes, "{} > {max_bytes}", bundle_len(&bundle));
        }
        assert_eq!(chunks.concat(), evs);
    }

    #[test]
    fn an_oversized_event_travels_alone() {
        let mut evs = events(3, 8);
        evs.insert(1, events(1, 10_000).remove(0));
        let chunks = split_into_chunks(evs, 100, 4096, 1);
        assert_eq!(chunks.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 2]);
    }

    #[test]
    fn tiers_round_trip_and_garbage_is_unknown() {
        for t in TierType::ALL {
            assert_eq!(tier_from_wire(tier_to_wire(t)), t);
        }
        assert_eq!(tier_from_wire(-3), TierType::Unknown);
        assert_eq!(tier_from_wire(99), TierType::Unknown);
    }
}
