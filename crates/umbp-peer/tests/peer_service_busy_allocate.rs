//! The peer service's busy allocation, over real gRPC on 127.0.0.1:0: a caller that says it
//! accepts `ALLOCATE_BUSY` gets it; an older caller (no `accepts_busy`, or the single-entry
//! `AllocateSlot`) gets `ALLOCATE_FAILED_NO_SPACE`, what it got before the value existed, instead
//! of a value it would read as a hard failure.

use std::sync::Arc;

use tonic::transport::Channel;
use umbp_core::{AllocateOutcome, BackendRegistry, MediumBackend, TierType};
use umbp_peer::peer_service::{PeerServer, PeerServerConfig, PeerServerHandle, PeerService};
use umbp_proto::convert::outcome_from_wire;
use umbp_proto::v1 as pb;
use umbp_proto::v1::umbp_peer_client::UmbpPeerClient;
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

const PAGE: u64 = 4096;

async fn start() -> (Arc<MockBackend>, PeerServerHandle, UmbpPeerClient<Channel>) {
    let mock = Arc::new(MockBackend::new(MockConfig {
        tier: TierType::Ssd,
        page_size: PAGE,
        pages: 16,
        ..MockConfig::default()
    }));
    mock.init(Arc::new(LocalOnlyRegistrar::new())).expect("mock init");
    let mut registry = BackendRegistry::new();
    registry.register(mock.clone()).expect("register");
    let service = PeerService::new(Arc::new(registry), "127.0.0.1:7777");
    let server = PeerServer::start(PeerServerConfig::default(), service).await.expect("start peer server");
    let client = UmbpPeerClient::connect(format!("http://{}", server.local_addr())).await.expect("connect");
    (mock, server, client)
}

fn entry(key: &str) -> pb::AllocateSlotRequest {
    pb::AllocateSlotRequest { size: 100, tier: pb::TierType::TierSsd as i32, key: key.into() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_reaches_a_caller_that_accepts_it_and_is_no_space_for_an_older_one() {
    let (mock, _server, mut client) = start().await;
    mock.answer_allocate_busy(u64::MAX);
    let new = client
        .batch_allocate_slots(pb::BatchAllocateSlotsRequest {
            entries: vec![entry("a"), entry("b")],
            accepts_busy: true,
        })
        .await
        .expect("BatchAllocateSlots")
        .into_inner();
    for e in &new.entries {
        assert_eq!(e.outcome, pb::AllocateOutcome::AllocateBusy as i32, "{e:?}");
        assert_eq!(outcome_from_wire(e.outcome), AllocateOutcome::Busy);
        assert!(e.slot_id == 0 && e.pages.is_empty(), "busy reserves nothing: {e:?}");
    }
    let old = client
        .batch_allocate_slots(pb::BatchAllocateSlotsRequest { entries: vec![entry("c")], ..Default::default() })
        .await
        .expect("BatchAllocateSlots")
        .into_inner();
    assert_eq!(old.entries[0].outcome, pb::AllocateOutcome::AllocateFailedNoSpace as i32, "an older caller");
    let single = client.allocate_slot(entry("d")).await.expect("AllocateSlot").into_inner();
    assert_eq!(single.outcome, pb::AllocateOutcome::AllocateFailedNoSpace as i32, "the single-entry call");
    assert_eq!(mock.pending_slot_count(), 0);
    // Not busy any more: a slot, whoever asks.
    mock.answer_allocate_busy(0);
    let ok = client
        .batch_allocate_slots(pb::BatchAllocateSlotsRequest { entries: vec![entry("e")], accepts_busy: true })
        .await
        .expect("BatchAllocateSlots")
        .into_inner();
    assert_eq!(outcome_from_wire(ok.entries[0].outcome), AllocateOutcome::Allocated);
}
