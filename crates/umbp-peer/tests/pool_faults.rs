//! `PoolClient` under faults: a dead peer in the middle of a batch, and reads racing eviction.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use umbp_core::{
    AllocateRequest, BackendRegistry, CommitRequest, LocalRegion, MediumBackend, MemoryRegistrar, RegistrationError,
    RemoteRegion, TierType, TransferRef,
};
use umbp_master::MasterHandle;
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_peer::master_client::{MasterClient, MasterClientConfig, NodeRegistration};
use umbp_peer::peer_service::{PeerServer, PeerServerConfig, PeerServerHandle, PeerService};
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig};
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

/// A node the master believes alive and holding `keys`, whose peer service is a closed port.
async fn ghost(master: &MasterHandle, keys: &[String]) -> (MasterClient, Arc<dyn MediumBackend>) {
    let cfg = PageBackendConfig::new(TierType::Dram, PAGE, vec![64 * PAGE]);
    let source = HostPageMemorySource::new(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
    let backend = PageBackend::new(cfg, Box::new(source)).expect("config");
    backend.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    let medium: Arc<dyn MediumBackend> = Arc::new(backend);
    let reqs: Vec<AllocateRequest> = keys.iter().map(|k| AllocateRequest::new(k.clone(), 100)).collect();
    let slots = medium.batch_allocate(&reqs);
    let commits: Vec<CommitRequest> =
        slots.iter().zip(keys).map(|(s, k)| CommitRequest::new(s.slot_id, k.clone())).collect();
    assert!(medium.batch_commit(&commits).iter().all(|c| c.success));
    let dead = TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    let mut registry = BackendRegistry::new();
    registry.register(Arc::clone(&medium)).expect("registry");
    let registration = NodeRegistration::new("ghost", "127.0.0.1")
        .with_peer_address(dead.to_string())
        .with_data_endpoint("127.0.0.1:1");
    let client = MasterClient::connect(
        &master.local_addr().to_string(),
        MasterClientConfig::default(),
        registration,
        Arc::new(registry),
    )
    .await
    .expect("connect");
    client.register().await.expect("register");
    client.start_heartbeat().expect("heartbeat");
    client.flush();
    (client, medium)
}

/// A holder whose process is gone (the master still believes it alive; its address refuses
/// connections): its keys are misses for the reader, not errors, and the reader leaves it out of its
/// routes at once. The live keys of the same batch are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_peers_keys_are_misses_and_it_leaves_the_routes() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 64 * PAGE)).await.expect("holder");
    let live: Vec<String> = (0..6).map(|i| format!("live-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..6).map(|i| value(i, 1000 + i * 700)).collect();
    let items: Vec<(&str, &[u8])> = live.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in holder.batch_put(&items).await {
        r.expect("put");
    }
    holder.flush();
    indexed(&holder, &live).await;
    let dead: Vec<String> = (0..3).map(|i| format!("dead-{i}")).collect();
    let (_ghost, _medium) = ghost(&m, &dead).await;
    indexed(&holder, &dead).await;
    let reader = PoolClient::start(PoolClientConfig::new("reader", m.local_addr().to_string())).await.expect("reader");
    // Interleave the dead peer's keys with live ones.
    let keys: Vec<&str> =
        vec![&live[0], &dead[0], &live[1], &live[2], &dead[1], &live[3], &live[4], &dead[2], &live[5]]
            .into_iter()
            .map(String::as_str)
            .collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 8192]; keys.len()];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let start = tokio::time::Instant::now();
    let results = reader.batch_get(&keys, &mut slices).await;
    assert!(start.elapsed() < Duration::from_secs(3), "a refused connection is not waited out");
    for (k, (key, r)) in keys.iter().zip(&results).enumerate() {
        if let Some(i) = live.iter().position(|l| l == key) {
            assert_eq!(r, &Ok(values[i].len() as u64), "{key}");
            assert_eq!(&bufs[k][..values[i].len()], values[i].as_slice(), "{key}");
        } else {
            assert_eq!(r, &Err(KeyError::Miss), "{key}: a refusing holder's key is a miss, not an error");
        }
    }
    // Prompt exclusion: the next read of the dead node's keys routes around it from the start (no
    // resolve at the dead address, so no failed attempt to re-route).
    let reroutes = reader.stats().reroutes;
    let mut buf = vec![0u8; 8192];
    assert_eq!(reader.get(&dead[0], &mut buf).await, Err(KeyError::Miss));
    assert_eq!(reader.stats().reroutes, reroutes, "the dead node was still routed to");
    reader.close().await;
    holder.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_racing_eviction_are_exact_or_fail_never_wrong() {
    let m = master().await;
    let mut hc = config(&m, "holder", 32 * PAGE);
    hc.read_lease = Duration::from_millis(20);
    let holder = Arc::new(PoolClient::start(hc).await.expect("holder"));
    let mut rc = PoolClientConfig::new("reader", m.local_addr().to_string());
    rc.read_lease = Duration::from_millis(20);
    let reader = PoolClient::start(rc).await.expect("reader");
    let keys: Vec<String> = (0..200).map(|i| format!("churn-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..200).map(|i| value(i, 2 * PAGE as usize - i)).collect();
    let first: Vec<(&str, &[u8])> =
        keys[..16].iter().zip(&values[..16]).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    holder.batch_put(&first).await;
    holder.flush();
    let stop = Arc::new(AtomicBool::new(false));
    // The churner evicts old keys and writes new ones into the freed pages.
    let churner = {
        let (holder, keys, values, stop) = (Arc::clone(&holder), keys.clone(), values.clone(), Arc::clone(&stop));
        tokio::spawn(async move {
            let mut next = 16;
            while !stop.load(Ordering::Relaxed) && next < keys.len() {
                let old = &keys[next - 16];
                holder.remove(&[old.as_str()]).await.expect("remove");
                let _ = holder.put(&keys[next], &values[next]).await;
                holder.flush();
                next += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    let mut hits = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < deadline && !churner.is_finished() {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 2 * PAGE as usize]; keys.len()];
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        for (i, r) in reader.batch_get(&refs, &mut slices).await.into_iter().enumerate() {
            if let Ok(size) = r {
                assert_eq!(size as usize, values[i].len(), "size of {}", keys[i]);
                assert_eq!(&bufs[i][..values[i].len()], values[i].as_slice(), "bytes of {}", keys[i]);
                hits += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    churner.await.expect("churner");
    assert!(hits > 0, "some reads hit");
    reader.close().await;
    holder.close().await;
    m.shutdown().await;
}

/// Gives every region a remote handle at `endpoint`, as a data server would.
#[derive(Debug)]
struct RemoteAt {
    endpoint: String,
    next: AtomicU64,
}

impl MemoryRegistrar for RemoteAt {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        let region_id = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(TransferRef::local(region).with_remote(RemoteRegion { endpoint: self.endpoint.clone(), region_id }))
    }

    fn deregister(&self, _: &TransferRef) {}
}

/// A node whose peer service allocates on a [`MockBackend`] (which frees an uncommitted slot only
/// when aborted: it has no reaper of its own) and whose data endpoint is `data`.
async fn mock_holder(master: &MasterHandle, data: &str) -> (MasterClient, Arc<MockBackend>, PeerServerHandle) {
    let mock = Arc::new(MockBackend::new(MockConfig { page_size: PAGE, pages: 16, ..MockConfig::default() }));
    mock.init(Arc::new(RemoteAt { endpoint: data.to_owned(), next: AtomicU64::new(1) })).expect("init");
    let mut registry = BackendRegistry::new();
    registry.register(Arc::clone(&mock) as Arc<dyn MediumBackend>).expect("registry");
    let registry = Arc::new(registry);
    let service = PeerService::new(Arc::clone(&registry), data);
    let server = PeerServer::start(PeerServerConfig::default(), service).await.expect("peer server");
    let registration = NodeRegistration::new("mock", "127.0.0.1")
        .with_peer_address(server.local_addr().to_string())
        .with_data_endpoint(data);
    let client =
        MasterClient::connect(&master.local_addr().to_string(), MasterClientConfig::default(), registration, registry)
            .await
            .expect("connect");
    client.register().await.expect("register");
    client.start_heartbeat().expect("heartbeat");
    client.flush();
    (client, mock, server)
}

/// A put cancelled while its copy is in flight (the client holds the allocation reply, so its
/// guard tracks the slot) has that slot aborted at once. The holder never reaps (a mock medium:
/// no TTL sweep) and the copy is held up by a data endpoint that accepts and never answers, so the
/// slot is freed by the guard's abort or not at all; this fails with `SlotGuard::drop` removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_put_cancelled_mid_copy_has_its_slot_aborted_by_its_guard() {
    let m = master().await;
    let black_hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let data = black_hole.local_addr().expect("addr").to_string();
    let (tx, mut dialled) = tokio::sync::mpsc::unbounded_channel();
    let accepter = tokio::spawn(async move {
        while let Ok((stream, _)) = black_hole.accept().await {
            // Kept open and never answered, until the test drops the receiver.
            if tx.send(stream).is_err() {
                break;
            }
        }
    });
    let (_client, mock, _server) = mock_holder(&m, &data).await;
    let mut writer_config = PoolClientConfig::new("writer", m.local_addr().to_string());
    // The routed path (allocate, copy, commit): a keyed put has no client-side slot to guard.
    writer_config.keyed_requests = false;
    writer_config.shared_memory = false;
    let writer = Arc::new(PoolClient::start(writer_config).await.expect("writer"));
    let v = value(3, 4 * PAGE as usize);
    let put = {
        let (writer, v) = (Arc::clone(&writer), v.clone());
        tokio::spawn(async move { writer.put("cancelled", &v).await })
    };
    // The copy has begun (the writer dialled the slot's data endpoint) and the slot is pending.
    let conn = tokio::time::timeout(Duration::from_secs(10), dialled.recv())
        .await
        .expect("the writer dialled the data endpoint")
        .expect("a connection");
    assert_eq!(mock.pending_slot_count(), 1, "the slot is allocated and pending");
    let aborts = mock.calls().batch_abort;
    put.abort();
    // The dropped put waits for its copy to end: refuse it (close the connection and the listener).
    drop((conn, dialled));
    accepter.abort();
    let joined = tokio::time::timeout(Duration::from_secs(10), put).await.expect("the cancelled put ends");
    assert!(joined.is_err_and(|e| e.is_cancelled()), "the put was cancelled, not finished");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while mock.pending_slot_count() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the cancelled put's slot was never aborted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(mock.calls().batch_abort > aborts, "freed by an abort");
    assert_eq!(mock.calls().batch_commit, 0, "nothing was committed");
    writer.close().await;
    m.shutdown().await;
}

/// Puts cancelled at every stage leak nothing for longer than the pending TTL (2 s here): a slot the
/// client learned of is aborted by its guard (proven alone by the test above), and one whose
/// allocation reply never reached the client is reaped by the holder's TTL, the only bound there is
/// for that case (as in the reference).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn puts_cancelled_at_any_stage_leak_no_slot_past_the_pending_ttl() {
    let m = master().await;
    let mut holder_config = config(&m, "holder", 1024 * PAGE);
    holder_config.pending_ttl = Duration::from_secs(2);
    let holder = PoolClient::start(holder_config).await.expect("holder");
    // The routed path: a keyed put (one exchange, run to its end on the calling thread, its slot
    // settled by the holder whatever happens to the connection) has no allocation to cancel.
    let mut writer_config = PoolClientConfig::new("writer", m.local_addr().to_string());
    writer_config.keyed_requests = false;
    let writer = PoolClient::start(writer_config).await.expect("writer");
    let medium = Arc::clone(holder.medium().expect("m"));
    let total = medium.capacity().total_bytes;
    let v = value(9, 64 * PAGE as usize);
    let mut cancelled = 0;
    for (n, micros) in [100u64, 300, 1000, 2000, 4000, 8000, 16000, 32000].into_iter().enumerate() {
        let key = format!("cancel-{n}");
        if tokio::time::timeout(Duration::from_micros(micros), writer.put(&key, &v)).await.is_err() {
            cancelled += 1;
        }
        // Whatever was allocated and not committed comes back: aborted by the guard, or reaped by the
        // TTL when the allocation reply never reached the client.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
        loop {
            let expected = total - medium.owned_key_count() as u64 * v.len() as u64;
            if medium.capacity().available_bytes == expected {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "a slot leaked after a put cancelled at {micros} us");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(cancelled > 0, "some put was cancelled");
    writer.close().await;
    holder.close().await;
    m.shutdown().await;
}

/// A node the master believes alive and holding `key`, whose medium answers every read busy.
async fn busy_holder(master: &MasterHandle, key: &str) -> (MasterClient, Arc<MockBackend>, PeerServerHandle) {
    let mock = Arc::new(MockBackend::new(MockConfig { page_size: PAGE, pages: 8, ..MockConfig::default() }));
    mock.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    let a = mock.batch_allocate(&[AllocateRequest::new(key, 100)]).remove(0);
    assert!(mock.batch_commit(&[CommitRequest::new(a.slot_id, key)])[0].success);
    mock.answer_busy(u64::MAX);
    let mut registry = BackendRegistry::new();
    registry.register(Arc::clone(&mock) as Arc<dyn MediumBackend>).expect("registry");
    let registry = Arc::new(registry);
    let service = PeerService::new(Arc::clone(&registry), "127.0.0.1:1");
    let server = PeerServer::start(PeerServerConfig::default(), service).await.expect("peer server");
    let registration = NodeRegistration::new("busy", "127.0.0.1")
        .with_peer_address(server.local_addr().to_string())
        .with_data_endpoint("127.0.0.1:1");
    let client =
        MasterClient::connect(&master.local_addr().to_string(), MasterClientConfig::default(), registration, registry)
            .await
            .expect("connect");
    client.register().await.expect("register");
    client.start_heartbeat().expect("heartbeat");
    client.flush();
    (client, mock, server)
}

/// A holder that has the key but stays busy is asked again and again (bounded backoff), never
/// excluded and never reported as missing; once the wait is over the read fails `Busy`, retryable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_stays_busy_is_waited_out_then_reported_busy_not_missing() {
    let m = master().await;
    let (_client, mock, _server) = busy_holder(&m, "hot").await;
    let reader = PoolClient::start(PoolClientConfig::new("reader", m.local_addr().to_string())).await.expect("reader");
    indexed(&reader, &["hot"]).await;
    let asked_before = mock.calls().batch_resolve;
    let mut buf = vec![0u8; 4096];
    let r = reader.get("hot", &mut buf).await;
    assert_eq!(r, Err(KeyError::Busy { node: "busy".into() }), "a busy holder is not a miss");
    assert!(r.as_ref().err().is_some_and(KeyError::is_retryable));
    let asked = mock.calls().batch_resolve - asked_before;
    assert!(asked > 10, "the holder was asked again while busy ({asked} resolves), not excluded");
    reader.close().await;
    m.shutdown().await;
}
