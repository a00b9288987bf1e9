//! The external KV index through `MasterClient` against a real master on 127.0.0.1: light clients
//! (no medium, no heartbeat) register two engine nodes and report their blocks, a scheduler's light
//! client matches a prompt's hashes and routes to the node holding the longest prefix; counted hits,
//! revokes, ghost reports and bad input.

use std::time::Duration;

use umbp_core::TierType;
use umbp_master::MasterConfig;
use umbp_peer::master_client::{MasterClient, MasterClientConfig, MasterClientError, NodeRegistration};

async fn master() -> umbp_master::MasterHandle {
    let config = MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() };
    umbp_master::start(config).await.expect("master starts")
}

async fn light(master: &umbp_master::MasterHandle, node_id: &str) -> MasterClient {
    let config = MasterClientConfig { rpc_timeout: Duration::from_secs(5), ..MasterClientConfig::default() };
    let node = NodeRegistration::new(node_id, "127.0.0.1");
    MasterClient::connect_light(&master.local_addr().to_string(), config, node).await.expect("connect")
}

fn hashes(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i:02}")).collect()
}

/// The node holding the longest run of `prompt`'s leading hashes, and its length.
fn longest_prefix(matches: &[umbp_peer::master_client::ExternalKvNodeMatch], prompt: &[String]) -> (String, usize) {
    let mut best = (String::new(), 0);
    for m in matches {
        let held: std::collections::HashSet<&str> =
            m.hashes_by_tier.iter().flat_map(|(_, hs)| hs.iter().map(String::as_str)).collect();
        let run = prompt.iter().take_while(|h| held.contains(h.as_str())).count();
        if run > best.1 {
            best = (m.node_id.clone(), run);
        }
    }
    best
}

#[tokio::test]
async fn a_scheduler_routes_a_prefix_to_the_node_that_holds_it() {
    let m = master().await;
    let (a, b) = (light(&m, "engine-a").await, light(&m, "engine-b").await);
    a.register().await.expect("register a");
    b.register().await.expect("register b");
    assert_eq!(a.stats().heartbeats_sent, 0, "a light client sends no heartbeat");
    let prompt = hashes("p", 8);
    // engine-a holds the first 6 pages on HBM, engine-b the first 2 on DRAM and others.
    assert!(a.report_external_kv_blocks("engine-a", &prompt[..6], TierType::Hbm).await.expect("report"));
    assert!(b.report_external_kv_blocks("engine-b", &prompt[..2], TierType::Dram).await.expect("report"));
    assert!(b.report_external_kv_blocks("engine-b", &hashes("q", 4), TierType::Dram).await.expect("report"));

    let scheduler = light(&m, "scheduler").await;
    let matches = scheduler.match_external_kv(&prompt, true).await.expect("match");
    assert_eq!(matches.iter().map(|m| m.node_id.as_str()).collect::<Vec<_>>(), ["engine-a", "engine-b"]);
    assert_eq!(matches[0].hashes_by_tier, vec![(TierType::Hbm, prompt[..6].to_vec())]);
    assert_eq!(matches[1].matched_hash_count(), 2);
    assert_eq!(longest_prefix(&matches, &prompt), ("engine-a".to_owned(), 6));
    let counts = scheduler.get_external_kv_hit_counts(&prompt).await.expect("counts");
    assert_eq!(counts, prompt[..6].iter().map(|h| (h.clone(), 1)).collect::<Vec<_>>());

    // engine-a's HBM is wiped: the prefix now routes to engine-b.
    a.revoke_all_external_kv_blocks_at_tier("engine-a", TierType::Hbm).await.expect("revoke all");
    let matches = scheduler.match_external_kv(&prompt, false).await.expect("match");
    assert_eq!(longest_prefix(&matches, &prompt), ("engine-b".to_owned(), 2));
    b.revoke_external_kv_blocks("engine-b", &prompt[..1], TierType::Dram).await.expect("revoke");
    let matches = scheduler.match_external_kv(&prompt, false).await.expect("match");
    assert_eq!(longest_prefix(&matches, &prompt), (String::new(), 0));
    assert!(scheduler.match_external_kv(&[], false).await.expect("empty").is_empty());

    // The scheduler never registered: reports under its id are ignored.
    assert!(!scheduler.report_external_kv_blocks("scheduler", &prompt, TierType::Hbm).await.expect("report"));
    // Unregistering drops engine-b's records.
    b.unregister().await.expect("unregister");
    assert!(scheduler.match_external_kv(&hashes("q", 4), false).await.expect("match").is_empty());
    m.shutdown().await;
}

#[tokio::test]
async fn bad_input_is_refused_before_or_by_the_master() {
    let m = master().await;
    let c = light(&m, "engine-a").await;
    c.register().await.expect("register");
    let one = hashes("p", 1);
    let invalid = |r: Result<(), MasterClientError>| matches!(r, Err(MasterClientError::InvalidArgument(_)));
    assert!(invalid(c.report_external_kv_blocks("", &one, TierType::Hbm).await.map(drop)));
    assert!(invalid(c.report_external_kv_blocks("engine-a", &[], TierType::Hbm).await.map(drop)));
    assert!(invalid(c.revoke_external_kv_blocks("engine-a", &one, TierType::Unknown).await));
    assert!(invalid(c.revoke_all_external_kv_blocks_at_tier("", TierType::Hbm).await));
    let too_many = hashes("h", umbp_master::store::MAX_EXTERNAL_KV_HASHES + 1);
    match c.match_external_kv(&too_many, false).await {
        Err(MasterClientError::Rpc { status, .. }) => {
            assert_eq!(status.code(), tonic::Code::InvalidArgument);
            assert!(status.message().contains("16384"), "{status}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    m.shutdown().await;
}
