//! Fuzzing entry points (issue 19): a sequence of requests a node or client could send, each as
//! the protobuf bytes tonic would decode, sent to a fresh master on loopback. Not API: hidden from
//! the docs, called by the `fuzz/` crate's targets (coverage-guided, long runs) and by
//! `tests/fuzz_master.rs` (proptest, bounded, in CI). The entry point panics when a property fails,
//! which is what both drivers catch.

use std::sync::OnceLock;

use prost::Message;
use tonic::Code;
use tonic::transport::Channel;
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

use crate::MasterConfig;

/// The most requests one input is cut into.
const MAX_REQUESTS: usize = 16;
/// The peer address every registration is given: nothing listens there, so an eviction the master
/// attempts fails at once instead of reaching out (an input's own address could name any host).
const NOWHERE: &str = "127.0.0.1:1";

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("a tokio runtime")
    })
}

/// One request of a sequence: which RPC, and its message bytes.
fn split(data: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    let mut rest = data;
    while let [which, l0, l1, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*l0, *l1])).min(tail.len());
        out.push((*which, &tail[..len]));
        rest = &tail[len..];
        if out.len() == MAX_REQUESTS {
            break;
        }
    }
    out
}

/// Joins requests into the input format of [`requests`].
fn join(parts: &[(u8, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (which, bytes) in parts {
        out.push(*which);
        out.extend_from_slice(&u16::try_from(bytes.len()).unwrap_or(u16::MAX).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    out
}

/// An error a hostile request may earn: anything but a failure of the master itself (a panic in a
/// handler or in a store task reaches the client as `Internal` or `Unknown`).
fn refused(what: &str, s: &tonic::Status) {
    assert!(!matches!(s.code(), Code::Internal | Code::Unknown), "{what}: the master failed: {s}");
}

/// Sends the requests of `data` (each `[rpc: u8][len: u16 LE][protobuf bytes]`; bytes that are not
/// the RPC's message are skipped, as tonic would refuse them) to a fresh master with an in-memory
/// store. Properties: no request makes the master fail (`Internal`, `Unknown`, a dropped
/// connection); an accepted batch reply has one entry per key; a columnar route-get reply refers
/// only to nodes it lists, each with an id; a routed put names a node; and the master still answers
/// its cluster status afterwards. Returns how many requests the master accepted.
pub fn requests(data: &[u8]) -> usize {
    runtime().block_on(async {
        let config = MasterConfig { listen: ([127, 0, 0, 1], 0).into(), ..MasterConfig::default() };
        let master = crate::start(config).await.expect("a master on loopback");
        let mut c = UmbpMasterClient::connect(format!("http://{}", master.local_addr())).await.expect("connect");
        let mut accepted = 0;
        for (which, bytes) in split(data) {
            accepted += usize::from(send(&mut c, which, bytes).await);
        }
        let status = c.get_cluster_status(pb::GetClusterStatusRequest {}).await;
        assert!(status.is_ok(), "the master answers after the sequence: {status:?}");
        master.shutdown().await;
        accepted
    })
}

/// A columnar route-put reply: no entries, three columns of one value per key, a routed key
/// refers to a listed node with an id, any other key to none.
fn route_put_columns(p: &pb::BatchRoutePutResponse, keys: usize) {
    assert!(p.entries.is_empty(), "a columnar reply has no entries");
    assert_eq!((p.outcome.len(), p.node_ref.len(), p.tier.len()), (keys, keys, keys), "columns");
    for (&outcome, &node_ref) in p.outcome.iter().zip(&p.node_ref) {
        if outcome == pb::RoutePutOutcome::RoutePutRouted as i32 {
            let node = p.nodes.get((node_ref as usize).wrapping_sub(1)).expect("a routed key's node is listed");
            assert!(!node.node_id.is_empty(), "a routed put names its node");
        } else {
            assert_eq!(node_ref, 0, "a key not routed refers to no node");
        }
    }
}

/// Sends one request; whether the master accepted it.
async fn send(c: &mut UmbpMasterClient<Channel>, which: u8, bytes: &[u8]) -> bool {
    match which % 8 {
        0 => {
            let Ok(mut r) = pb::RegisterClientRequest::decode(bytes) else { return false };
            if !r.peer_address.is_empty() {
                r.peer_address = NOWHERE.into();
            }
            c.register_client(r).await.map_err(|s| refused("register", &s)).is_ok()
        }
        1 => {
            let Ok(r) = pb::HeartbeatRequest::decode(bytes) else { return false };
            c.heartbeat(r).await.map_err(|s| refused("heartbeat", &s)).is_ok()
        }
        2 => {
            let Ok(r) = pb::BatchRoutePutRequest::decode(bytes) else { return false };
            let (keys, columnar) = (r.keys.len(), r.columnar);
            match c.batch_route_put(r).await {
                Ok(reply) => {
                    let p = reply.into_inner();
                    if columnar {
                        route_put_columns(&p, keys);
                    } else {
                        assert_eq!(p.entries.len(), keys, "one route-put entry per key");
                        for e in &p.entries {
                            if e.outcome == pb::RoutePutOutcome::RoutePutRouted as i32 {
                                assert!(!e.node_id.is_empty(), "a routed put names its node");
                            }
                        }
                    }
                    true
                }
                Err(s) => {
                    refused("batch route put", &s);
                    false
                }
            }
        }
        3 => {
            let Ok(r) = pb::BatchRouteGetRequest::decode(bytes) else { return false };
            let keys = r.keys.len();
            match c.batch_route_get(r).await {
                Ok(reply) => {
                    let g = reply.into_inner();
                    assert_eq!((g.node_ref.len(), g.tier.len(), g.size.len()), (keys, keys, keys), "columns");
                    for &node_ref in &g.node_ref {
                        if node_ref != 0 {
                            let node = g.nodes.get(node_ref as usize - 1).expect("a ref to a listed node");
                            assert!(!node.node_id.is_empty(), "a referenced node has an id");
                        }
                    }
                    true
                }
                Err(s) => {
                    refused("batch route get", &s);
                    false
                }
            }
        }
        4 => {
            let Ok(r) = pb::BatchLookupRequest::decode(bytes) else { return false };
            let keys = r.keys.len();
            match c.batch_lookup(r).await {
                Ok(reply) => {
                    assert_eq!(reply.into_inner().found.len(), keys, "one answer per key");
                    true
                }
                Err(s) => {
                    refused("batch lookup", &s);
                    false
                }
            }
        }
        5 => {
            let Ok(r) = pb::RoutePutRequest::decode(bytes) else { return false };
            match c.route_put(r).await {
                Ok(reply) => {
                    let e = reply.into_inner();
                    if e.outcome == pb::RoutePutOutcome::RoutePutRouted as i32 {
                        assert!(!e.node_id.is_empty(), "a routed put names its node");
                    }
                    true
                }
                Err(s) => {
                    refused("route put", &s);
                    false
                }
            }
        }
        6 => {
            let Ok(r) = pb::RouteGetRequest::decode(bytes) else { return false };
            match c.route_get(r).await {
                Ok(reply) => {
                    let g = reply.into_inner();
                    assert!(!g.found || !g.node_id.is_empty(), "a found key names its node");
                    true
                }
                Err(s) => {
                    refused("route get", &s);
                    false
                }
            }
        }
        _ => {
            let Ok(r) = pb::UnregisterClientRequest::decode(bytes) else { return false };
            c.unregister_client(r).await.map_err(|s| refused("unregister", &s)).is_ok()
        }
    }
}

/// Request sequences of a node's life, made by the encoders: register, heartbeats with delta
/// bundles (adds, a remove, a repeated seq, a gap), a full sync in two chunks, routes and lookups
/// of held and missing keys, unregister.
pub fn seeds() -> Vec<Vec<u8>> {
    let dram = umbp_proto::convert::tier_to_wire(umbp_core::TierType::Dram);
    let caps = vec![pb::TierCapacity { tier: dram, total_bytes: 1 << 30, available_bytes: 1 << 29, page_size: 0 }];
    let register = pb::RegisterClientRequest {
        node_id: "n1".into(),
        node_address: "127.0.0.1".into(),
        tier_capacities: caps.clone(),
        peer_address: NOWHERE.into(),
        data_endpoint: "127.0.0.1:2".into(),
        tags: vec!["rack=a".into()],
        incarnation: 5,
    };
    let event =
        |kind: pb::KvEventKind, key: &str, size| pb::KvEvent { kind: kind as i32, key: key.into(), tier: dram, size };
    let add = |key: &str, size| event(pb::KvEventKind::KvEventAdd, key, size);
    let delta = |bundles: Vec<(u64, Vec<pb::KvEvent>)>| pb::HeartbeatRequest {
        node_id: "n1".into(),
        bundles: bundles.into_iter().map(|(seq, events)| pb::EventBundle { seq, events }).collect(),
        tier_capacities: caps.clone(),
        incarnation: 5,
        ..Default::default()
    };
    let sync = |chunk, last, events| pb::HeartbeatRequest {
        is_full_sync: true,
        delta_seq_baseline: 3,
        full_sync_chunk: chunk,
        full_sync_final: last,
        ..delta(vec![(0, events)])
    };
    let keys = |k: &[&str]| k.iter().map(|k| (*k).to_owned()).collect::<Vec<_>>();
    let life = vec![
        (0, register.encode_to_vec()),
        (
            1,
            delta(vec![
                (1, vec![add("a", 100), add("b", 4096)]),
                (2, vec![event(pb::KvEventKind::KvEventRemove, "a", 0)]),
            ])
            .encode_to_vec(),
        ),
        (1, delta(vec![(2, vec![add("c", 1)])]).encode_to_vec()),
        (1, delta(vec![(9, vec![add("d", 1)])]).encode_to_vec()),
        (
            2,
            pb::BatchRoutePutRequest {
                node_id: "n1".into(),
                keys: keys(&["x", "b", "x"]),
                block_sizes: vec![10, 20, 10],
                exclude_nodes: vec![],
                columnar: false,
            }
            .encode_to_vec(),
        ),
        (
            2,
            pb::BatchRoutePutRequest {
                node_id: "n1".into(),
                keys: keys(&["y", "c", "y", "z"]),
                block_sizes: vec![10, 20, 10, 0],
                exclude_nodes: vec![],
                columnar: true,
            }
            .encode_to_vec(),
        ),
        (
            3,
            pb::BatchRouteGetRequest { node_id: "n1".into(), keys: keys(&["a", "b", "zz"]), exclude_nodes: vec![] }
                .encode_to_vec(),
        ),
        (4, pb::BatchLookupRequest { keys: keys(&["a", "b"]) }.encode_to_vec()),
        (
            5,
            pb::RoutePutRequest { key: "y".into(), node_id: "n1".into(), block_size: 1 << 31, exclude_nodes: vec![] }
                .encode_to_vec(),
        ),
        (
            6,
            pb::RouteGetRequest { key: "b".into(), node_id: "n2".into(), exclude_nodes: keys(&["n1"]) }.encode_to_vec(),
        ),
        (7, pb::UnregisterClientRequest { node_id: "n1".into(), incarnation: 5 }.encode_to_vec()),
    ];
    let resync = vec![
        (0, register.encode_to_vec()),
        (1, sync(0, false, vec![add("p", 1), add("q", 2)]).encode_to_vec()),
        (1, sync(1, true, vec![add("r", 3)]).encode_to_vec()),
        (
            3,
            pb::BatchRouteGetRequest { node_id: "c1".into(), keys: keys(&["p", "r"]), exclude_nodes: vec![] }
                .encode_to_vec(),
        ),
    ];
    vec![join(&life), join(&resync)]
}
