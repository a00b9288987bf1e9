//! Registration, full sync, clear and shutdown against a fake master (the reference's
//! `test_master_client_lifecycle`, plus our fixes: the full record on re-registration, chunked full
//! sync, the bounded outbox, clear retried until acknowledged, a bounded shutdown).

mod master_client_support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use master_client_support::{Action, FakeMaster, client, commit, keys, node, page_backend, registry, test_config};
use parking_lot::Mutex;
use prost::Message;
use umbp_core::{AllocateOutcome, AllocateRequest, MediumBackend, TierType};
use umbp_peer::master_client::{MasterClient, MasterClientConfig, MasterClientError};
use umbp_proto::v1 as pb;

const LONG_INTERVAL_MS: u64 = 60_000;
const PAGE: u64 = 4096;
const WAIT: Duration = Duration::from_secs(3);

fn quiet_config() -> MasterClientConfig {
    MasterClientConfig { auto_flush_event_threshold: 0, ..test_config() }
}

fn is_delta(h: &pb::HeartbeatRequest) -> bool {
    !h.is_full_sync && !h.bundles.is_empty()
}

/// Every key of every chunk of the full syncs recorded so far.
fn full_sync_keys(chunks: &[&pb::HeartbeatRequest]) -> Vec<String> {
    chunks.iter().flat_map(|h| h.bundles.iter().flat_map(|b| b.events.iter().map(|e| e.key.clone()))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_sends_the_full_record_and_adopts_the_interval() {
    let master = FakeMaster::start(1234).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    {
        let rec = master.fake.rec.lock();
        let r = &rec.registers[0];
        assert_eq!(r.node_id, "node-a");
        assert_eq!(r.node_address, "127.0.0.1");
        assert_eq!(r.peer_address, "127.0.0.1:7001");
        assert_eq!(r.data_endpoint, "127.0.0.1:7002");
        assert_eq!(r.tags, ["rack=r1"]);
        assert_eq!(r.tier_capacities.len(), 1);
        assert_eq!(r.tier_capacities[0].tier, pb::TierType::TierDram as i32);
        assert_eq!(r.tier_capacities[0].total_bytes, 64 * PAGE);
        assert_eq!(r.tier_capacities[0].page_size, PAGE, "the master charges victims whole pages");
    }
    let stats = client.stats();
    assert_eq!(stats.heartbeat_interval, Duration::from_millis(1234));
    assert_eq!((stats.registrations, stats.re_registrations, stats.full_sync_pending), (1, 0, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registering_while_owning_keys_full_syncs_before_register_returns() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    commit(&dram, &keys("old", 3));
    // An earlier client shipped (drained) these events; the new one must not rely on the outbox.
    assert_eq!(dram.drain_pending_events().len(), 3);
    // A node restarted on keys it still owns (an SSD node on its drives): they are indexed when
    // `register` returns, not a heartbeat interval (here a minute) later.
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    assert!(!client.stats().full_sync_pending);
    let chunks = master.fake.rec.lock().full_sync_chunks().len();
    assert_eq!(chunks, 1);
    assert_eq!(master.fake.model.lock().index().len(), 3);
    assert_eq!(client.stats().acked_seq, 1, "a fresh baseline (1): deltas start at seq 2");
    assert_eq!(client.stats().next_seq, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_registration_that_finds_a_live_node_is_an_error() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    master.fake.on_register(|_| Action::Fail(tonic::Code::AlreadyExists));
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client =
        MasterClient::connect(&master.addr(), quiet_config(), node(), registry(&[dram])).await.expect("connect");
    let err = client.register().await.expect_err("a live node with this id exists");
    assert!(matches!(err, MasterClientError::AlreadyRegistered { ref node_id } if node_id == "node-a"), "{err}");
    assert!(matches!(client.start_heartbeat(), Err(MasterClientError::NotRegistered)));
    assert!(matches!(client.heartbeat_once().await, Err(MasterClientError::NotRegistered)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_re_registers_with_the_full_record_then_full_syncs() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("before", 5));
    client.heartbeat_once().await.expect("delta");
    assert_eq!(master.fake.model.lock().index().len(), 5);

    master.fake.forget(); // the master restarted
    commit(&dram, &keys("after", 2));
    client.start_heartbeat().expect("start");
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.full_syncs_applied == 1 && m.index().len() == 7).await);

    {
        let rec = master.fake.rec.lock();
        assert_eq!(rec.registers.len(), 2);
        let again = &rec.registers[1];
        assert_eq!(again.peer_address, "127.0.0.1:7001", "FIX §7.2: the peer address is sent again");
        assert_eq!(again.data_endpoint, "127.0.0.1:7002", "and the data endpoint");
        assert_eq!(again.tags, ["rack=r1"]);
        assert_eq!(again.tier_capacities.len(), 1);
        let chunks = rec.full_sync_chunks();
        assert_eq!(chunks.len(), 1);
        let mut synced = full_sync_keys(&chunks);
        synced.sort();
        let mut owned: Vec<String> = keys("before", 5).into_iter().chain(keys("after", 2)).collect();
        owned.sort();
        assert_eq!(synced, owned, "the full sync carries every owned key");
        // The delta of the two new keys was drained (seq 2) before the UNKNOWN; the sync takes the
        // next, fresh seq as its baseline.
        assert_eq!(chunks[0].delta_seq_baseline, 3);
        assert!(chunks[0].full_sync_final && chunks[0].full_sync_chunk == 0);
    }
    let stats = client.stats();
    assert_eq!((stats.re_registrations, stats.acked_seq, stats.next_seq), (1, 3, 4));

    // Deltas continue from the baseline.
    commit(&dram, &keys("later", 1));
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.last_applied() == 4 && m.index().len() == 8).await);
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_placement_grant_follows_the_masters_replies() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    master.fake.local_puts.store(true, Ordering::SeqCst);
    let unknown_once = Arc::new(AtomicBool::new(false));
    let u = Arc::clone(&unknown_once);
    master.fake.on_heartbeat(move |_| if u.swap(false, Ordering::SeqCst) { Action::Unknown } else { Action::Normal });
    // Registering does not re-register on its own here: the UNKNOWN reply's re-registration is
    // refused, so the cleared grant is observable.
    let refuse = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&refuse);
    master.fake.on_register(move |_| {
        if r.load(Ordering::SeqCst) { Action::Fail(tonic::Code::Unavailable) } else { Action::Normal }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    assert!(client.local_puts_granted(), "the register reply grants it");

    // The master withdraws it: the next heartbeat reply says so.
    master.fake.local_puts.store(false, Ordering::SeqCst);
    client.heartbeat_once().await.expect("keepalive");
    assert!(!client.local_puts_granted(), "an ALIVE reply without the grant withdraws it");
    master.fake.local_puts.store(true, Ordering::SeqCst);
    client.heartbeat_once().await.expect("keepalive");
    assert!(client.local_puts_granted(), "and a later one restores it");

    // UNKNOWN: the master lost this node, so the grant goes with it until a registration succeeds.
    refuse.store(true, Ordering::SeqCst);
    unknown_once.store(true, Ordering::SeqCst);
    let _ = client.heartbeat_once().await;
    assert!(!client.local_puts_granted(), "an UNKNOWN reply clears the grant");
    refuse.store(false, Ordering::SeqCst);
    for _ in 0..3 {
        if client.local_puts_granted() {
            break;
        }
        let _ = client.heartbeat_once().await;
    }
    assert!(client.local_puts_granted(), "the re-registration's reply grants it again");
    client.shutdown().await.expect("shutdown");
    assert!(!client.local_puts_granted(), "no master hears of a shut-down node's writes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn already_exists_on_re_registration_counts_as_success() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let unknown_once = Arc::new(AtomicBool::new(true));
    let u = Arc::clone(&unknown_once);
    master.fake.on_heartbeat(move |h| {
        if is_delta(h) && u.swap(false, Ordering::SeqCst) { Action::Unknown } else { Action::Normal }
    });
    let registers = Arc::new(AtomicUsize::new(0));
    let r = Arc::clone(&registers);
    master.fake.on_register(move |_| {
        if r.fetch_add(1, Ordering::SeqCst) == 0 { Action::Normal } else { Action::Fail(tonic::Code::AlreadyExists) }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("k", 3));
    client.heartbeat_once().await.expect("answered UNKNOWN, re-registered");
    assert_eq!(client.stats().re_registrations, 1, "ALREADY_EXISTS is success here");
    client.heartbeat_once().await.expect("full sync");
    assert_eq!(master.fake.model.lock().index().len(), 3);
    assert_eq!(client.stats().full_syncs_completed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_full_sync_sends_a_full_sync_at_once() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let once = Arc::new(AtomicBool::new(true));
    let o = Arc::clone(&once);
    master.fake.on_heartbeat(move |h| {
        if is_delta(h) && o.swap(false, Ordering::SeqCst) { Action::RequestFullSync } else { Action::Normal }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("k", 4));
    client.heartbeat_once().await.expect("delta refused, full sync sent in the same round");
    {
        let rec = master.fake.rec.lock();
        assert_eq!(rec.heartbeats.len(), 2);
        assert!(rec.heartbeats[1].1.is_full_sync);
        assert_eq!(rec.heartbeats[1].1.delta_seq_baseline, 2, "a fresh baseline, not the refused delta's seq");
    }
    assert_eq!(master.fake.model.lock().index().len(), 4);
    let stats = client.stats();
    assert_eq!((stats.full_syncs_completed, stats.acked_seq, stats.outbox_bundles), (1, 2, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100k_key_full_sync_arrives_in_chunks_under_the_byte_cap() {
    const N: usize = 100_000;
    const CAP: usize = 1 << 20;
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let once = Arc::new(AtomicBool::new(true));
    let o = Arc::clone(&once);
    master.fake.on_heartbeat(move |h| {
        if is_delta(h) && o.swap(false, Ordering::SeqCst) { Action::RequestFullSync } else { Action::Normal }
    });
    let dram = page_backend(TierType::Dram, 64, N as u64);
    let config = MasterClientConfig { max_request_bytes: CAP, ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    let owned: Vec<String> = (0..N).map(|i| format!("kv-block-{i:06}-0123456789abcdef0123456789")).collect();
    commit(&dram, &owned);
    client.heartbeat_once().await.expect("full sync");

    let baseline = N.div_ceil(1024) as u64 + 1;
    {
        let rec = master.fake.rec.lock();
        let chunks = rec.full_sync_chunks();
        assert!(chunks.len() >= 4, "several chunks: {}", chunks.len());
        assert_eq!(chunks[0].delta_seq_baseline, baseline, "a fresh baseline after the refused deltas");
        for (i, c) in chunks.iter().enumerate() {
            assert_eq!(c.full_sync_chunk as usize, i, "chunks in order from 0");
            assert_eq!(c.full_sync_final, i + 1 == chunks.len(), "final only on the last");
            assert_eq!(c.delta_seq_baseline, baseline);
            assert!(c.encoded_len() <= CAP, "chunk {i} is {} bytes", c.encoded_len());
        }
        let synced = full_sync_keys(&chunks);
        assert_eq!(synced.len(), N, "no duplicates");
        assert_eq!(synced.into_iter().collect::<BTreeSet<_>>(), owned.iter().cloned().collect());
    }
    assert_eq!(master.fake.model.lock().index().len(), N);
    let stats = client.stats();
    assert_eq!((stats.acked_seq, stats.outbox_events, stats.full_sync_pending), (baseline, 0, false));
    assert_eq!(stats.full_sync_chunks_sent as usize, master.fake.rec.lock().full_sync_chunks().len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_middle_chunk_restarts_from_chunk_zero() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let refused = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicBool::new(false));
    let (r, f) = (Arc::clone(&refused), Arc::clone(&failed));
    master.fake.on_heartbeat(move |h| {
        if is_delta(h) && !r.swap(true, Ordering::SeqCst) {
            return Action::RequestFullSync;
        }
        if h.is_full_sync && h.full_sync_chunk == 2 && !f.swap(true, Ordering::SeqCst) {
            return Action::Fail(tonic::Code::Unavailable);
        }
        Action::Normal
    });
    let dram = page_backend(TierType::Dram, 64, 2000);
    let config = MasterClientConfig { full_sync_chunk_events: 500, ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("k", 2000));
    let err = client.heartbeat_once().await.expect_err("chunk 2 fails");
    assert!(err.is_retryable(), "{err}");
    assert!(client.stats().full_sync_pending);
    commit(&dram, &keys("late", 3));
    client.heartbeat_once().await.expect("the retry starts over and completes");

    {
        let rec = master.fake.rec.lock();
        let chunks = rec.full_sync_chunks();
        let order: Vec<(u32, bool)> = chunks.iter().map(|c| (c.full_sync_chunk, c.full_sync_final)).collect();
        assert_eq!(
            order,
            [(0, false), (1, false), (2, false), (0, false), (1, false), (2, false), (3, false), (4, true)],
            "restart from chunk 0 with a fresh snapshot (2003 keys: 5 chunks)"
        );
        assert_eq!(full_sync_keys(&chunks[3..]).len(), 2003);
    }
    assert_eq!(master.fake.model.lock().index().len(), 2003);
    let stats = client.stats();
    assert_eq!((stats.full_syncs_started, stats.full_syncs_completed), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflowing_outbox_turns_into_a_full_sync_instead_of_growing() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let fail_deltas = Arc::new(AtomicBool::new(true));
    let fail_syncs = Arc::new(AtomicBool::new(true));
    let (d, s) = (Arc::clone(&fail_deltas), Arc::clone(&fail_syncs));
    master.fake.on_heartbeat(move |h| {
        // Keepalives (the probe before a full sync) follow the full syncs.
        let fail =
            if h.bundles.is_empty() || h.is_full_sync { s.load(Ordering::SeqCst) } else { d.load(Ordering::SeqCst) };
        if fail { Action::Fail(tonic::Code::Unavailable) } else { Action::Normal }
    });
    let dram = page_backend(TierType::Dram, PAGE, 256);
    let config = MasterClientConfig { max_outbox_events: 64, events_per_bundle: 16, ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;

    commit(&dram, &keys("a", 40));
    assert!(client.heartbeat_once().await.is_err());
    assert_eq!((client.stats().outbox_events, client.stats().outbox_bundles), (40, 3), "queued for a resend");

    commit(&dram, &keys("b", 40)); // 80 > 64
    assert!(client.heartbeat_once().await.is_err(), "the full sync (its probe) fails too");
    let stats = client.stats();
    assert_eq!(stats.outbox_overflows, 1);
    assert_eq!(stats.outbox_events, 0, "deltas dropped, not grown");
    assert!(stats.full_sync_pending);

    commit(&dram, &keys("c", 100));
    assert!(client.heartbeat_once().await.is_err());
    assert_eq!(client.stats().outbox_events, 0, "while a full sync is pending nothing queues");

    fail_syncs.store(false, Ordering::SeqCst);
    client.heartbeat_once().await.expect("the full sync lands");
    assert_eq!(master.fake.model.lock().index().len(), 180, "nothing lost");
    {
        let rec = master.fake.rec.lock();
        let last = rec.full_sync_chunks().last().map(|c| (c.delta_seq_baseline, c.full_sync_final));
        assert_eq!(last, Some((4, true)), "a fresh baseline (3 bundles were numbered)");
    }

    fail_deltas.store(false, Ordering::SeqCst);
    commit(&dram, &keys("d", 2));
    client.heartbeat_once().await.expect("deltas resume at baseline + 1");
    assert_eq!(master.fake.model.lock().last_applied(), 5);
    assert_eq!(master.fake.model.lock().index().len(), 182);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clear_is_retried_until_acknowledged_and_writes_stay_gated_until_then() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let attempts = Arc::new(AtomicUsize::new(0));
    let seen_at_ack: Arc<Mutex<Option<(bool, AllocateOutcome)>>> = Arc::new(Mutex::new(None));
    let (a, seen, b) = (Arc::clone(&attempts), Arc::clone(&seen_at_ack), Arc::clone(&dram));
    master.fake.on_heartbeat(move |h| {
        if !(h.is_full_sync && h.bundles.is_empty()) {
            return Action::Normal;
        }
        if a.fetch_add(1, Ordering::SeqCst) < 2 {
            return Action::Fail(tonic::Code::Unavailable);
        }
        // The third attempt: the gate must still be closed while the master has not answered.
        let outcome = b.batch_allocate(&[AllocateRequest::new("during", PAGE)])[0].outcome;
        *seen.lock() = Some((b.is_clear_full_sync_pending(), outcome));
        Action::Normal
    });
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("k", 5));
    client.heartbeat_once().await.expect("delta");
    assert_eq!(master.fake.model.lock().index().len(), 5);

    client.clear().await.expect("acknowledged on the third attempt");
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
    assert_eq!(*seen_at_ack.lock(), Some((true, AllocateOutcome::Failed)), "gated until the ack");
    assert!(!dram.is_clear_full_sync_pending(), "reopened after the ack");
    assert_eq!(dram.owned_key_count(), 0);
    assert!(master.fake.model.lock().index().is_empty(), "the master dropped the node's locations");
    commit(&dram, &keys("new", 1));
    let stats = client.stats();
    assert!(!stats.clear_pending && !stats.full_sync_pending);
    assert_eq!(stats.acked_seq, 4, "the third attempt's baseline: every attempt takes a fresh one");
    client.heartbeat_once().await.expect("delta");
    assert_eq!(master.fake.model.lock().keys(), [("new-0".to_owned(), pb::TierType::TierDram as i32)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clear_past_its_deadline_is_finished_by_the_heartbeat_loop() {
    let master = FakeMaster::start(50).await;
    let down = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&down);
    master.fake.on_heartbeat(move |_| {
        if d.load(Ordering::SeqCst) { Action::Fail(tonic::Code::Unavailable) } else { Action::Normal }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("k", 3));
    client.heartbeat_once().await.expect("delta");

    down.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let err = client.clear_within(Duration::from_millis(300)).await.expect_err("the master is down");
    assert!(t0.elapsed() < Duration::from_millis(1300), "bounded by the deadline: {:?}", t0.elapsed());
    assert!(matches!(err, MasterClientError::ClearNotAcknowledged { attempts, .. } if attempts >= 2), "{err}");
    assert!(dram.is_clear_full_sync_pending(), "writes stay gated");
    assert!(client.stats().clear_pending);

    client.start_heartbeat().expect("start");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(dram.is_clear_full_sync_pending(), "still gated while the master is down");
    down.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + WAIT;
    while dram.is_clear_full_sync_pending() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!dram.is_clear_full_sync_pending(), "the loop delivered the clear and reopened writes");
    assert!(master.fake.model.lock().index().is_empty());
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_when_the_master_hangs() {
    let master = FakeMaster::start(50).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let config = MasterClientConfig {
        heartbeat_rpc_timeout: Duration::from_millis(2000),
        shutdown_timeout: Duration::from_millis(300),
        ..quiet_config()
    };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");
    master.fake.hang_all.store(true, Ordering::SeqCst);
    commit(&dram, &keys("k", 2));
    client.flush();
    tokio::time::sleep(Duration::from_millis(100)).await; // a heartbeat now hangs in flight

    let t0 = Instant::now();
    let err = client.shutdown().await.expect_err("the unregister cannot land");
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(300 + 700), "bounded: {took:?}");
    assert!(matches!(err, MasterClientError::Timeout { rpc: "UnregisterClient", .. }), "{err}");
    client.shutdown().await.expect("a second shutdown is a no-op");
    assert!(matches!(client.register().await, Err(MasterClientError::ShutDown)));
    assert!(matches!(client.start_heartbeat(), Err(MasterClientError::ShutDown)));
    client.flush(); // a no-op
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_the_loop_and_unregisters() {
    let master = FakeMaster::start(30).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");
    assert!(master.wait_until(WAIT, |r, _| r.heartbeats.len() >= 2).await);
    client.shutdown().await.expect("shutdown");
    assert_eq!(master.fake.rec.lock().unregisters, ["node-a"]);
    let sent = master.fake.rec.lock().heartbeats.len();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(master.fake.rec.lock().heartbeats.len(), sent, "no heartbeat after shutdown");
    // The hook is gone: committing past the threshold wakes nothing (and must not panic).
    commit(&dram, &keys("after", 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_client_stops_the_loop() {
    let master = FakeMaster::start(30).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");
    assert!(master.wait_until(WAIT, |r, _| !r.heartbeats.is_empty()).await);
    drop(client);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let sent = master.fake.rec.lock().heartbeats.len();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(master.fake.rec.lock().heartbeats.len(), sent);
}

/// The baselines of the full syncs recorded so far (one per sync: its chunk 0), and every delta seq.
fn baselines_and_delta_seqs(master: &FakeMaster) -> (Vec<u64>, Vec<u64>) {
    let rec = master.fake.rec.lock();
    let baselines =
        rec.full_sync_chunks().iter().filter(|c| c.full_sync_chunk == 0).map(|c| c.delta_seq_baseline).collect();
    let deltas = rec.deltas().iter().flat_map(|h| h.bundles.iter().map(|b| b.seq)).collect();
    (baselines, deltas)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_chunk_ack_other_than_the_baseline_restarts_the_sync_at_a_fresh_baseline() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let step = Arc::new(AtomicUsize::new(0));
    let s = Arc::clone(&step);
    master.fake.on_heartbeat(move |h| {
        if is_delta(h) && s.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            return Action::RequestFullSync;
        }
        if h.is_full_sync && h.full_sync_final && s.compare_exchange(1, 2, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            // The master answers the final chunk without adopting the baseline: it did not take it.
            return Action::Reply(pb::HeartbeatResponse {
                status: pb::NodeStatus::Alive as i32,
                acked_seq: h.delta_seq_baseline - 1,
                request_full_sync: false,
                local_puts: false,
                superseded: false,
            });
        }
        Action::Normal
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let config = MasterClientConfig { full_sync_chunk_events: 4, ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("k", 10));
    let err = client.heartbeat_once().await.expect_err("the final chunk's ack is not the baseline");
    assert!(matches!(err, MasterClientError::Refused { .. }), "{err}");
    let stats = client.stats();
    assert!(stats.full_sync_pending, "the sync failed and stays pending");
    assert_eq!((stats.full_syncs_started, stats.full_syncs_completed), (1, 0));

    client.heartbeat_once().await.expect("the restart lands");
    assert_eq!(master.fake.model.lock().index().len(), 10);
    commit(&dram, &keys("after", 2));
    client.heartbeat_once().await.expect("delta");
    client.clear().await.expect("clear");
    commit(&dram, &keys("new", 1));
    client.heartbeat_once().await.expect("delta");
    assert_eq!(master.fake.model.lock().keys(), [("new-0".to_owned(), pb::TierType::TierDram as i32)]);

    {
        let rec = master.fake.rec.lock();
        let first: Vec<(u32, bool)> =
            rec.full_sync_chunks().iter().take(6).map(|c| (c.full_sync_chunk, c.full_sync_final)).collect();
        assert_eq!(
            first,
            [(0, false), (1, false), (2, true), (0, false), (1, false), (2, true)],
            "restarted at chunk 0"
        );
    }
    let (baselines, delta_seqs) = baselines_and_delta_seqs(&master);
    assert_eq!(delta_seqs, [1, 4, 6]);
    assert_eq!(baselines, [2, 3, 5], "a fresh baseline per sync (the clear's included), strictly increasing");
    assert!(baselines.iter().all(|b| !delta_seqs.contains(b)), "a baseline is never a delta's seq");
    let stats = client.stats();
    assert_eq!((stats.acked_seq, stats.next_seq), (6, 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_baseline_answered_already_applied_is_not_success() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let once = Arc::new(AtomicBool::new(true));
    let o = Arc::clone(&once);
    master.fake.on_heartbeat(move |h| {
        if !h.is_full_sync && h.bundles.is_empty() && o.swap(false, Ordering::SeqCst) {
            Action::RequestFullSync
        } else {
            Action::Normal
        }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    // The master's record of this node stands at seq 20: past anything this client numbered.
    master.fake.model.lock().advance_stream_to(20);
    commit(&dram, &keys("k", 3));
    // Their deltas went out before (the sync's snapshot carries the keys): the next round is a keepalive.
    assert_eq!(dram.drain_pending_events().len(), 3);
    let err = client.heartbeat_once().await.expect_err("a keepalive asked for a sync whose baseline is stale");
    assert!(matches!(err, MasterClientError::Refused { .. }), "{err}");
    assert_eq!(master.fake.model.lock().stale_sync_chunks, 1, "answered AlreadyApplied");
    assert!(master.fake.model.lock().index().is_empty(), "nothing applied");
    assert!(client.stats().full_sync_pending);
    assert_eq!(client.stats().next_seq, 21, "numbers on past the master's seq");

    client.heartbeat_once().await.expect("the next baseline is above the master's");
    assert_eq!(master.fake.model.lock().index().len(), 3);
    assert_eq!((client.stats().acked_seq, master.fake.model.lock().last_applied()), (21, 21));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_that_goes_backwards_means_the_master_lost_the_node_and_forces_a_full_sync() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("k", 5));
    client.heartbeat_once().await.expect("delta");
    assert_eq!(client.stats().acked_seq, 1);
    // A rebuilt store: the node is registered again at seq 0, and nobody tells it UNKNOWN.
    master.fake.model.lock().rebuild_node();
    assert!(master.fake.model.lock().index().is_empty());

    client.heartbeat_once().await.expect("a keepalive answered with acked 0");
    assert!(client.stats().full_sync_pending, "acks only grow within one registration");
    client.heartbeat_once().await.expect("full sync");
    assert_eq!(master.fake.model.lock().index().len(), 5, "the idle node is back in the index");
    assert_eq!(client.stats().full_syncs_completed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_full_sync_probes_with_a_keepalive_while_the_master_is_down() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let down = Arc::new(AtomicBool::new(true));
    let d = Arc::clone(&down);
    master.fake.on_heartbeat(move |_| {
        if d.load(Ordering::SeqCst) { Action::Fail(tonic::Code::Unavailable) } else { Action::Normal }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    commit(&dram, &keys("k", 40));
    // The attempt inside `register` fails: registered, with the sync still pending.
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    assert!(client.stats().full_sync_pending);
    for _ in 0..4 {
        assert!(client.heartbeat_once().await.is_err());
    }
    {
        let rec = master.fake.rec.lock();
        assert_eq!(rec.full_sync_chunks().len(), 1, "one attempt (in register), then only probes");
        let probes = rec.heartbeats.iter().filter(|(_, h)| !h.is_full_sync && h.bundles.is_empty()).count();
        assert_eq!(probes, 4);
    }
    assert_eq!(client.stats().full_syncs_started, 1, "no snapshot while the master is down");

    down.store(false, Ordering::SeqCst);
    client.heartbeat_once().await.expect("the probe answers, the full sync follows in the same round");
    assert_eq!(master.fake.model.lock().index().len(), 40);
    assert_eq!(client.stats().full_syncs_completed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_a_running_clear_and_nothing_registers_afterwards() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    // Every clear attempt is answered UNKNOWN, so the clear keeps re-registering and retrying.
    master.fake.on_heartbeat(|h| if h.is_full_sync { Action::Unknown } else { Action::Normal });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = Arc::new(client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await);
    commit(&dram, &keys("k", 3));
    client.heartbeat_once().await.expect("delta");

    let c = Arc::clone(&client);
    let clear = tokio::spawn(async move { c.clear_within(Duration::from_secs(20)).await });
    assert!(master.wait_until(WAIT, |r, _| r.registers.len() >= 3).await, "the clear re-registers");
    let t0 = Instant::now();
    client.shutdown().await.expect("shutdown");
    let result = tokio::time::timeout(Duration::from_secs(2), clear).await.expect("the clear ends").expect("join");
    assert!(matches!(result, Err(MasterClientError::ShutDown)), "{result:?}");
    assert!(t0.elapsed() < Duration::from_secs(1), "cancelled, not run to its deadline: {:?}", t0.elapsed());

    let registers = master.fake.rec.lock().registers.len();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(master.fake.rec.lock().registers.len(), registers, "no registration after shutdown");
    assert_eq!(master.fake.rec.lock().unregisters, ["node-a"]);
    assert!(!master.fake.model.lock().registered(), "the node stays unregistered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_unregisters_a_registration_whose_answer_was_lost() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    // The master registers the node but answers after the client's deadline.
    master.fake.on_register(|_| Action::ApplyThenDelay(Duration::from_millis(1500)));
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client =
        MasterClient::connect(&master.addr(), quiet_config(), node(), registry(&[dram])).await.expect("connect");
    let err = client.register().await.expect_err("the answer comes too late");
    assert!(matches!(err, MasterClientError::Timeout { rpc: "RegisterClient", .. }), "{err}");
    assert!(master.fake.model.lock().registered(), "yet the master registered it");
    // The process exits: no ghost record may stay behind.
    client.shutdown().await.expect("shutdown");
    assert_eq!(master.fake.rec.lock().unregisters, ["node-a"]);
    assert!(!master.fake.model.lock().registered());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_after_a_refused_registration_unregisters_nothing() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    // Another process holds the id (the master answered ALREADY_EXISTS): its record is not ours.
    master.fake.on_register(|_| Action::Fail(tonic::Code::AlreadyExists));
    let client = MasterClient::connect(
        &master.addr(),
        quiet_config(),
        node(),
        registry(&[page_backend(TierType::Dram, PAGE, 8)]),
    )
    .await
    .expect("connect");
    assert!(client.register().await.is_err());
    client.shutdown().await.expect("shutdown");
    assert!(master.fake.rec.lock().unregisters.is_empty());
}
