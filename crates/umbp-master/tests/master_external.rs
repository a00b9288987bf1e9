//! The external KV index over real gRPC on 127.0.0.1: report, match (with the holders' peer
//! addresses), counted hits, revokes, ghost reports ignored and counted, bad input refused with
//! INVALID_ARGUMENT, and a silent node's records gone with it through the master's reaper.

use std::time::Duration;

use tonic::Code;
use tonic::transport::Channel;
use umbp_master::MasterConfig;
use umbp_master::store::MAX_EXTERNAL_KV_HASHES;
use umbp_proto::v1;
use umbp_proto::v1::umbp_master_client::UmbpMasterClient;

const HBM: i32 = v1::TierType::TierHbm as i32;
const DRAM: i32 = v1::TierType::TierDram as i32;

fn config() -> MasterConfig {
    MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() }
}

async fn master(config: MasterConfig) -> (umbp_master::MasterHandle, UmbpMasterClient<Channel>) {
    let handle = umbp_master::start(config).await.expect("master starts");
    let client = UmbpMasterClient::connect(format!("http://{}", handle.local_addr())).await.expect("connect");
    (handle, client)
}

async fn register(c: &mut UmbpMasterClient<Channel>, node: &str, peer: &str) {
    let request = v1::RegisterClientRequest {
        node_id: node.into(),
        node_address: "127.0.0.1".into(),
        peer_address: peer.into(),
        ..Default::default()
    };
    c.register_client(request).await.expect("register");
}

fn owned(hashes: &[&str]) -> Vec<String> {
    hashes.iter().map(|h| (*h).to_owned()).collect()
}

async fn report(c: &mut UmbpMasterClient<Channel>, node: &str, hashes: &[&str], tier: i32) -> bool {
    let request = v1::ReportExternalKvBlocksRequest { node_id: node.into(), hashes: owned(hashes), tier };
    c.report_external_kv_blocks(request).await.expect("report").into_inner().recorded
}

/// `(node, peer, [(tier, hashes)])` of a match.
async fn matched(
    c: &mut UmbpMasterClient<Channel>,
    hashes: &[&str],
    count_as_hit: bool,
) -> Vec<(String, String, Vec<(i32, Vec<String>)>)> {
    let request = v1::MatchExternalKvRequest { hashes: owned(hashes), count_as_hit };
    let reply = c.match_external_kv(request).await.expect("match").into_inner();
    let named = |idx: Vec<u32>| idx.into_iter().map(|i| hashes[i as usize].to_owned()).collect();
    reply
        .matches
        .into_iter()
        .map(|m| {
            (m.node_id, m.peer_address, m.hashes_by_tier.into_iter().map(|t| (t.tier, named(t.hash_indexes))).collect())
        })
        .collect()
}

#[tokio::test]
async fn report_match_count_and_revoke_over_grpc() {
    let (m, mut c) = master(config()).await;
    register(&mut c, "gpu-a", "127.0.0.1:7001").await;
    register(&mut c, "gpu-b", "").await;
    assert!(report(&mut c, "gpu-a", &["p0", "p1", "p2"], HBM).await);
    assert!(report(&mut c, "gpu-a", &["p0"], DRAM).await);
    assert!(report(&mut c, "gpu-b", &["p0", "q1"], DRAM).await);

    let got = matched(&mut c, &["p0", "p1", "p2", "p3"], true).await;
    assert_eq!(
        got,
        vec![
            ("gpu-a".into(), "127.0.0.1:7001".into(), vec![(HBM, owned(&["p0", "p1", "p2"])), (DRAM, owned(&["p0"]))]),
            ("gpu-b".into(), String::new(), vec![(DRAM, owned(&["p0"]))]),
        ]
    );
    let counts = c
        .get_external_kv_hit_counts(v1::GetExternalKvHitCountsRequest { hashes: owned(&["p3", "p1", "p0"]) })
        .await
        .expect("hit counts")
        .into_inner()
        .entries;
    let counts: Vec<(String, u64)> = counts.into_iter().map(|e| (e.hash, e.hit_count_total)).collect();
    assert_eq!(counts, vec![("p1".to_owned(), 1), ("p0".to_owned(), 1)]);

    let revoke = v1::RevokeExternalKvBlocksRequest { node_id: "gpu-a".into(), hashes: owned(&["p2"]), tier: HBM };
    c.revoke_external_kv_blocks(revoke).await.expect("revoke");
    let all = v1::RevokeAllExternalKvBlocksAtTierRequest { node_id: "gpu-b".into(), tier: DRAM };
    c.revoke_all_external_kv_blocks_at_tier(all).await.expect("revoke all");
    let got = matched(&mut c, &["p0", "p2", "q1"], false).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].2, vec![(HBM, owned(&["p0"])), (DRAM, owned(&["p0"]))]);
    assert!(matched(&mut c, &[], false).await.is_empty(), "an empty match is no error");
    assert_eq!(m.stats().external_reports_recorded, 3);
    m.shutdown().await;
}

#[tokio::test]
async fn a_ghost_report_is_answered_ok_ignored_and_counted() {
    let (m, mut c) = master(config()).await;
    assert!(!report(&mut c, "ghost", &["p0"], HBM).await, "answered OK, not recorded");
    assert!(matched(&mut c, &["p0"], false).await.is_empty());
    assert_eq!(m.stats().external_reports_rejected_not_alive, 1);
    assert_eq!(m.stats().external_reports_recorded, 0);
    m.shutdown().await;
}

#[tokio::test]
async fn bad_input_is_invalid_argument() {
    let (m, mut c) = master(config()).await;
    register(&mut c, "a", "").await;
    let report = |node: &str, hashes: Vec<String>, tier| v1::ReportExternalKvBlocksRequest {
        node_id: node.into(),
        hashes,
        tier,
    };
    let too_many: Vec<String> = (0..=MAX_EXTERNAL_KV_HASHES).map(|i| format!("h{i}")).collect();
    for bad in [
        report("", owned(&["h"]), HBM),
        report("a", Vec::new(), HBM),
        report("a", owned(&["h"]), v1::TierType::TierUnknown as i32),
        report("a", owned(&[""]), HBM),
    ] {
        let err = c.report_external_kv_blocks(bad.clone()).await.expect_err("refused");
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}: {err}");
    }
    let err = c.report_external_kv_blocks(report("a", too_many.clone(), HBM)).await.expect_err("too many");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains(&MAX_EXTERNAL_KV_HASHES.to_string()), "names the limit: {err}");
    let err = c
        .match_external_kv(v1::MatchExternalKvRequest { hashes: too_many, count_as_hit: false })
        .await
        .expect_err("too many");
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .revoke_all_external_kv_blocks_at_tier(v1::RevokeAllExternalKvBlocksAtTierRequest {
            node_id: String::new(),
            tier: HBM,
        })
        .await
        .expect_err("no node");
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = c
        .revoke_external_kv_blocks(v1::RevokeExternalKvBlocksRequest { node_id: "a".into(), hashes: vec![], tier: HBM })
        .await
        .expect_err("no hashes");
    assert_eq!(err.code(), Code::InvalidArgument);
    m.shutdown().await;
}

#[tokio::test]
async fn a_silent_nodes_records_expire_with_it() {
    let cfg = MasterConfig {
        heartbeat_ttl: Duration::from_millis(200),
        max_missed_heartbeats: 1,
        reaper_interval: Duration::from_millis(50),
        ..config()
    };
    let (m, mut c) = master(cfg).await;
    register(&mut c, "gpu-a", "").await;
    assert!(report(&mut c, "gpu-a", &["p0"], HBM).await);
    assert_eq!(matched(&mut c, &["p0"], false).await.len(), 1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !matched(&mut c, &["p0"], false).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the reaper never dropped the records");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!report(&mut c, "gpu-a", &["p0"], HBM).await, "an expired node's report is ignored");
    m.shutdown().await;
}

fn ext(op: v1::ExternalKvOp, tier: i32, hashes: &[&str]) -> v1::ExternalKvEvent {
    v1::ExternalKvEvent { op: op as i32, tier, hashes: owned(hashes) }
}

/// A heartbeat of delta bundles `seqs` (no key events) carrying `external` under the first.
fn external_delta(node: &str, seqs: &[u64], external: Vec<v1::ExternalKvEvent>) -> v1::HeartbeatRequest {
    v1::HeartbeatRequest {
        node_id: node.into(),
        bundles: seqs.iter().map(|&seq| v1::EventBundle { seq, events: vec![] }).collect(),
        external_bundles: vec![v1::ExternalKvBundle { seq: seqs[0], events: external }],
        ..Default::default()
    }
}

fn sync(node: &str, baseline: u64, external_full_sync: bool) -> v1::HeartbeatRequest {
    v1::HeartbeatRequest {
        node_id: node.into(),
        is_full_sync: true,
        delta_seq_baseline: baseline,
        full_sync_final: true,
        external_full_sync,
        ..Default::default()
    }
}

#[tokio::test]
async fn external_changes_ride_heartbeat_bundles_under_their_seq() {
    use v1::ExternalKvOp::{ExternalKvReport as Report, ExternalKvRevoke as Revoke};
    let (m, mut c) = master(config()).await;
    register(&mut c, "node", "").await;
    let hb = external_delta(
        "node",
        &[1],
        vec![
            ext(Report, HBM, &["p0", "p1"]),
            ext(Report, DRAM, &["p0"]),
            ext(Report, v1::TierType::TierUnknown as i32, &["bad"]),
        ],
    );
    let reply = c.heartbeat(hb.clone()).await.expect("hb").into_inner();
    assert_eq!((reply.acked_seq, reply.request_full_sync), (1, false));
    assert_eq!(
        matched(&mut c, &["p0", "p1", "bad"], false).await,
        vec![("node".into(), String::new(), vec![(HBM, owned(&["p0", "p1"])), (DRAM, owned(&["p0"]))])]
    );
    assert_eq!(m.stats().events_skipped, 1, "an invalid external event is skipped, not an error");
    // A re-send after a lost ack is re-acknowledged; its changes are idempotent.
    assert_eq!(c.heartbeat(hb).await.expect("hb").into_inner().acked_seq, 1);
    let revoke = external_delta("node", &[2], vec![ext(Revoke, HBM, &["p1"])]);
    assert_eq!(c.heartbeat(revoke).await.expect("hb").into_inner().acked_seq, 2);
    assert_eq!(matched(&mut c, &["p1"], false).await, vec![]);
    // A gap applies nothing: the changes come again after the full sync.
    let gap = external_delta("node", &[9], vec![ext(Report, HBM, &["gap"])]);
    assert!(c.heartbeat(gap).await.expect("hb").into_inner().request_full_sync);
    assert!(matched(&mut c, &["gap"], false).await.is_empty());
    // A full sync that says nothing of an external set leaves the records (a light client's, say).
    assert_eq!(c.heartbeat(sync("node", 10, false)).await.expect("sync").into_inner().acked_seq, 10);
    assert_eq!(matched(&mut c, &["p0"], false).await.len(), 1);
    // One that carries an external set drops them: the node reports its set again in deltas.
    assert_eq!(c.heartbeat(sync("node", 11, true)).await.expect("sync").into_inner().acked_seq, 11);
    assert!(matched(&mut c, &["p0"], false).await.is_empty());
    m.shutdown().await;
}
