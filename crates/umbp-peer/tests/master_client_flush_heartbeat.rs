//! The heartbeat loop against a fake master (the reference's `test_master_client_flush_heartbeat`,
//! plus the lost-ack, multi-medium and token cases): flush and auto-flush wake the loop, a backlog
//! goes in bounded back-to-back RPCs with consecutive seqs, a lost ack re-sends the same seqs.

mod master_client_support;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use master_client_support::{Action, FakeMaster, client, commit, keys, page_backend, registry, test_config};
use umbp_core::TierType;
use umbp_peer::master_client::MasterClientConfig;
use umbp_proto::v1 as pb;

/// An interval the tests never reach: anything that arrives was woken.
const LONG_INTERVAL_MS: u64 = 60_000;
const PAGE: u64 = 4096;
const WAIT: Duration = Duration::from_secs(3);

fn quiet_config() -> MasterClientConfig {
    MasterClientConfig { auto_flush_event_threshold: 0, ..test_config() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_wakes_the_loop_long_before_the_interval() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");
    assert_eq!(client.stats().heartbeat_interval, Duration::from_millis(LONG_INTERVAL_MS));

    let ks = keys("flush", 3);
    commit(&dram, &ks);
    let t0 = Instant::now();
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.index().len() == 3).await, "events arrive after a flush");
    assert!(t0.elapsed() < Duration::from_secs(2), "woken, not waiting for the 60 s interval");
    {
        let rec = master.fake.rec.lock();
        let events = rec.delta_events();
        assert_eq!(events.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(), [1, 1, 1], "one bundle, seq 1");
        assert_eq!(events.iter().map(|(_, k)| k.clone()).collect::<BTreeSet<_>>(), ks.into_iter().collect());
    }
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_before_start_is_a_noop() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    commit(&dram, &keys("early", 2));
    client.flush();
    client.flush();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(master.fake.rec.lock().heartbeats.is_empty(), "no loop, no heartbeat");

    client.start_heartbeat().expect("start");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(master.fake.rec.lock().heartbeats.is_empty(), "an early flush leaves no stored wake-up behind");
    assert_eq!(client.stats().outbox_events, 0, "nothing drained before start");

    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.index().len() == 2).await);
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_during_an_inflight_rpc_reticks_right_after_it() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    master.fake.on_heartbeat(move |_| {
        if c.fetch_add(1, Ordering::SeqCst) == 0 {
            Action::DelayThenApply(Duration::from_millis(500))
        } else {
            Action::Normal
        }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");

    commit(&dram, &keys("first", 1));
    client.flush();
    assert!(master.wait_until(WAIT, |r, _| r.heartbeats.len() == 1).await, "first heartbeat in flight");
    commit(&dram, &keys("second", 1));
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.index().len() == 2).await, "the second flush is honoured");

    {
        let rec = master.fake.rec.lock();
        assert_eq!(rec.heartbeats.len(), 2, "exactly one re-tick");
        let (t1, first) = &rec.heartbeats[0];
        let (t2, second) = &rec.heartbeats[1];
        let gap = t2.duration_since(*t1);
        assert!(gap >= Duration::from_millis(450), "serialised behind the in-flight RPC ({gap:?})");
        assert!(gap < Duration::from_millis(1500), "re-ticked immediately after it, not at the interval ({gap:?})");
        assert_eq!(first.bundles.iter().map(|b| b.seq).collect::<Vec<_>>(), [1]);
        assert_eq!(second.bundles.iter().map(|b| b.seq).collect::<Vec<_>>(), [2]);
        assert_eq!(second.bundles[0].events[0].key, "second-0");
    }
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_goes_in_bounded_back_to_back_rpcs_with_consecutive_seqs() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 256);
    let config = MasterClientConfig { events_per_bundle: 4, max_bundles_per_rpc: 16, ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");

    commit(&dram, &keys("backlog", 160)); // 40 bundles of 4
    let t0 = Instant::now();
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.last_applied() == 40).await, "all 40 bundles applied");
    assert!(t0.elapsed() < Duration::from_secs(2), "back to back, not one per interval");

    {
        let rec = master.fake.rec.lock();
        let deltas = rec.deltas();
        // Each RPC carries at most 16 bundles, and 40 bundles take 3 RPCs when the loop wakes after the
        // last commit ([16, 16, 8]); a tick racing the commits may cut one more (e.g. [1, 16, 16, 7]).
        let sizes: Vec<usize> = deltas.iter().map(|h| h.bundles.len()).collect();
        assert!(sizes.iter().all(|n| (1..=16).contains(n)), "bounded bundles per RPC: {sizes:?}");
        assert_eq!(sizes.iter().sum::<usize>(), 40, "{sizes:?}");
        assert!(sizes.len() <= 4, "back to back in few RPCs: {sizes:?}");
        let seqs: Vec<u64> = deltas.iter().flat_map(|h| h.bundles.iter().map(|b| b.seq)).collect();
        assert_eq!(seqs, (1..=40).collect::<Vec<_>>(), "consecutive seqs, none repeated");
        assert!(deltas.iter().flat_map(|h| &h.bundles).all(|b| b.events.len() == 4));
        assert_eq!(master.fake.model.lock().index().len(), 160);
    }
    // The master applied bundle 40 before the client read the reply: wait for the client to take the ack.
    let deadline = Instant::now() + WAIT;
    while client.stats().acked_seq < 40 {
        assert!(Instant::now() < deadline, "the client never took the final ack");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stats = client.stats();
    assert_eq!((stats.acked_seq, stats.next_seq, stats.outbox_bundles), (40, 41, 0));
    assert_eq!(stats.bundles_sent, 40);
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_flush_at_the_threshold_triggers_a_heartbeat() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let config = MasterClientConfig { auto_flush_event_threshold: 8, ..test_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");

    commit(&dram, &keys("below", 7));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(master.fake.rec.lock().heartbeats.is_empty(), "below the threshold nothing wakes the loop");

    commit(&dram, &keys("at", 1));
    assert!(master.wait_until(WAIT, |_, m| m.index().len() == 8).await, "the 8th event wakes the loop");
    assert_eq!(master.fake.rec.lock().deltas().len(), 1);
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_ack_resends_the_same_seqs_without_a_full_sync() {
    let master = FakeMaster::start(100).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let c = Arc::clone(&calls);
    // The master applies the first delta, but its ack arrives after the client's deadline.
    master.fake.on_heartbeat(move |h| {
        if !h.bundles.is_empty() && c.fetch_add(1, Ordering::SeqCst) == 0 {
            Action::ApplyThenDelay(Duration::from_millis(1200))
        } else {
            Action::Normal
        }
    });
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let config = MasterClientConfig { heartbeat_rpc_timeout: Duration::from_millis(300), ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");

    commit(&dram, &keys("lost", 5));
    client.flush();
    let acked = async {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if client.stats().acked_seq == 1 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    };
    assert!(acked.await, "the re-sent bundle is acknowledged");
    commit(&dram, &keys("after", 2));
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.last_applied() == 2).await);

    {
        let rec = master.fake.rec.lock();
        let deltas = rec.deltas();
        assert!(deltas.len() >= 3, "first send, re-send, next delta");
        assert_eq!(deltas[0].bundles.iter().map(|b| b.seq).collect::<Vec<_>>(), [1]);
        assert_eq!(deltas[1].bundles.iter().map(|b| b.seq).collect::<Vec<_>>(), [1], "the same seq again");
        assert_eq!(deltas[1].bundles[0], deltas[0].bundles[0], "the same events again");
        assert!(rec.full_sync_chunks().is_empty(), "no full sync");
    }
    {
        let model = master.fake.model.lock();
        assert!(model.reacked_bundles >= 1);
        assert_eq!(model.seq_gaps, 0);
        assert_eq!(model.index().len(), 7, "nothing lost");
    }
    let stats = client.stats();
    assert!(stats.rpc_errors >= 1);
    assert_eq!(stats.full_syncs_started, 0);
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_media_share_one_seq_stream() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let hbm = page_backend(TierType::Hbm, PAGE, 32);
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let config = MasterClientConfig { events_per_bundle: 3, ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram), Arc::clone(&hbm)])).await;
    client.start_heartbeat().expect("start");

    commit(&dram, &keys("dram", 4));
    commit(&hbm, &keys("hbm", 4));
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.index().len() == 8).await);

    {
        let rec = master.fake.rec.lock();
        let bundles: Vec<&pb::EventBundle> = rec.deltas().into_iter().flat_map(|h| &h.bundles).collect();
        assert_eq!(bundles.iter().map(|b| b.seq).collect::<Vec<_>>(), [1, 2, 3], "one stream: 8 events, 3 bundles");
        let tiers_of = |b: &pb::EventBundle| b.events.iter().map(|e| e.tier).collect::<BTreeSet<_>>();
        assert_eq!(tiers_of(bundles[1]).len(), 2, "a bundle mixes media");
        let hb = &rec.deltas()[0];
        let cap_tiers: BTreeSet<i32> = hb.tier_capacities.iter().map(|c| c.tier).collect();
        assert_eq!(cap_tiers, [pb::TierType::TierHbm as i32, pb::TierType::TierDram as i32].into_iter().collect());
        assert_eq!(hb.tier_kv_counts.iter().map(|c| c.count).sum::<u64>(), 8);
    }
    {
        let model = master.fake.model.lock();
        assert_eq!(model.index().keys().filter(|(_, t)| *t == pb::TierType::TierHbm as i32).count(), 4);
        assert_eq!(model.index().keys().filter(|(_, t)| *t == pb::TierType::TierDram as i32).count(), 4);
    }
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_outbox_sends_keepalives_with_capacity() {
    let master = FakeMaster::start(50).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let client = client(&master, quiet_config(), registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");
    assert!(master.wait_until(WAIT, |r, _| r.heartbeats.len() >= 2).await, "the interval ticks");
    {
        let rec = master.fake.rec.lock();
        for (_, hb) in &rec.heartbeats {
            assert!(hb.bundles.is_empty() && !hb.is_full_sync, "keepalive");
            assert_eq!(hb.tier_capacities.len(), 1, "capacity rides on keepalives");
            assert_eq!(hb.tier_capacities[0].total_bytes, 64 * PAGE);
            assert_eq!(hb.tier_capacities[0].page_size, PAGE, "and the page size");
        }
    }
    assert!(client.stats().keepalives_sent >= 2);
    client.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_token_travels_on_every_call() {
    let master = FakeMaster::start(LONG_INTERVAL_MS).await;
    let dram = page_backend(TierType::Dram, PAGE, 64);
    let config = MasterClientConfig { cluster_token: Some("s3cret".into()), ..quiet_config() };
    let client = client(&master, config, registry(&[Arc::clone(&dram)])).await;
    client.start_heartbeat().expect("start");
    commit(&dram, &keys("tok", 1));
    client.flush();
    assert!(master.wait_until(WAIT, |_, m| m.index().len() == 1).await);
    client.batch_lookup(&[]).await.expect("empty lookup needs no RPC");
    *master.fake.lookup_reply.lock() = pb::BatchLookupResponse { found: vec![true] };
    assert_eq!(client.batch_lookup(&keys("tok", 1)).await.expect("lookup"), [true]);
    client.shutdown().await.expect("shutdown");

    let rec = master.fake.rec.lock();
    assert!(rec.tokens.len() >= 4, "register, heartbeat, lookup, unregister");
    assert!(rec.tokens.iter().all(|t| t.as_deref() == Some("s3cret")), "{:?}", rec.tokens);
}
