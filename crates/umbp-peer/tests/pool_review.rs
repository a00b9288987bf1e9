//! Review fixes of `PoolClient`: duplicate keys in a batch, a peer restarted on the same ports,
//! close racing a batch, zero-copy caller memory, short buffer lists, lapsed read leases, expired
//! slots, the re-cache policies, and a current-thread runtime.

use std::net::{SocketAddr, TcpListener};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use umbp_core::{BackendRegistry, MediumBackend, MemoryRegistrar};
use umbp_master::MasterHandle;
use umbp_peer::master_client::{MasterClient, MasterClientConfig, NodeRegistration};
use umbp_peer::peer_service::{PeerServer, PeerServerConfig, PeerServerHandle, PeerService};
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig, RecachePolicy};
use umbp_testkit::{MockBackend, MockConfig};
use umbp_transfer::{TcpEngine, TcpEngineConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

fn client_config(master: &MasterHandle, id: &str) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, master.local_addr().to_string());
    c.bounce_bytes = 1 << 20;
    c
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_key_in_one_batch_gets_the_first_write_result() {
    let m = master().await;
    // A full node and no re-route: the first "dup" fails; its repeat must not report Ok.
    let full = PoolClient::start(config(&m, "full", 64 * PAGE)).await.expect("node");
    let hog: Vec<umbp_core::AllocateRequest> =
        (0..64).map(|i| umbp_core::AllocateRequest::new(format!("hog-{i}"), PAGE)).collect();
    full.medium().expect("m").batch_allocate(&hog);
    let mut wc = client_config(&m, "writer");
    wc.max_reroutes = 0;
    let writer = PoolClient::start(wc).await.expect("writer");
    let v = value(1, 100);
    let r = writer.batch_put(&[("dup", &v), ("dup", &v)]).await;
    assert!(r[0].is_err(), "nothing fits: {r:?}");
    assert_eq!(r[0], r[1], "the repeat gets the first occurrence's result");
    // With room, both report Ok and the key is stored once.
    full.close().await;
    let roomy = PoolClient::start(config(&m, "roomy", 64 * PAGE)).await.expect("node");
    let r = writer.batch_put(&[("twice", &v), ("other", &v), ("twice", &v)]).await;
    assert_eq!(r, vec![Ok(()), Ok(()), Ok(())]);
    assert_eq!(roomy.medium().expect("m").owned_key_count(), 2);
    for n in [&writer, &roomy] {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn puts_succeed_after_a_peer_restarts_on_the_same_ports() {
    let m = master().await;
    let mut hc = config(&m, "holder", 64 * PAGE);
    hc.peer_listen = free_port();
    hc.data_listen = free_port();
    let holder = PoolClient::start(hc.clone()).await.expect("holder");
    let writer = PoolClient::start(client_config(&m, "writer")).await.expect("writer");
    let v = value(2, 3 * PAGE as usize + 5);
    writer.put("before", &v).await.expect("put before the restart");
    holder.close().await;
    drop(holder);
    let holder = PoolClient::start(hc).await.expect("holder restarts on the same ports");
    // The first attempts may meet the old connection or descriptors; the client must recover.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    while writer.put(&format!("after-{n}"), &v).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "puts never recovered after the restart");
        n += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for k in 0..5 {
        writer.put(&format!("steady-{k}"), &v).await.expect("puts keep succeeding");
    }
    writer.flush();
    holder.flush();
    indexed(&writer, &["steady-4"]).await;
    let mut buf = vec![0u8; v.len()];
    assert_eq!(writer.get("steady-4", &mut buf).await, Ok(v.len() as u64));
    assert_eq!(buf, v);
    writer.close().await;
    holder.close().await;
    m.shutdown().await;
}

/// A node whose medium is a [`MockBackend`] (so a test can make its reads answer busy) behind a
/// real peer service and data server.
async fn mock_holder(master: &MasterHandle) -> (MasterClient, Arc<MockBackend>, PeerServerHandle, Arc<TcpEngine>) {
    let engine = Arc::new(TcpEngine::new(TcpEngineConfig::default()).expect("data server"));
    let mock = Arc::new(MockBackend::new(MockConfig { page_size: PAGE, pages: 64, ..MockConfig::default() }));
    mock.init(Arc::clone(&engine) as Arc<dyn MemoryRegistrar>).expect("init");
    let mut registry = BackendRegistry::new();
    registry.register(Arc::clone(&mock) as Arc<dyn MediumBackend>).expect("registry");
    let registry = Arc::new(registry);
    let service = PeerService::new(Arc::clone(&registry), engine.endpoint());
    let server = PeerServer::start(PeerServerConfig::default(), service).await.expect("peer server");
    let registration = NodeRegistration::new("mock", "127.0.0.1")
        .with_peer_address(server.local_addr().to_string())
        .with_data_endpoint(engine.endpoint());
    let client =
        MasterClient::connect(&master.local_addr().to_string(), MasterClientConfig::default(), registration, registry)
            .await
            .expect("connect");
    client.register().await.expect("register");
    client.start_heartbeat().expect("heartbeat");
    client.flush();
    (client, mock, server, engine)
}

/// A light client on the routed path (resolve, copy, release) over TCP.
fn routed_client(master: &MasterHandle, id: &str) -> PoolClientConfig {
    let mut c = client_config(master, id);
    c.keyed_requests = false;
    c.shared_memory = false;
    c
}

/// `close` waits for a batch already in flight, which then completes with its bytes, and only then
/// returns; later calls fail `Closed`. The batch is held in flight by its holder answering busy (the
/// reader backs off and asks again) until the test lets it go, so "in flight" and "waited" are
/// observed, not timed: this fails if `close` stops waiting for the calls in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn close_during_batch_get_waits_and_later_calls_say_closed() {
    let m = master().await;
    let (holder, mock, _server, _engine) = mock_holder(&m).await;
    let writer = PoolClient::start(routed_client(&m, "writer")).await.expect("writer");
    let keys: Vec<String> = (0..8).map(|i| format!("c-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, 2 * PAGE as usize)).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in writer.batch_put(&items).await {
        r.expect("put");
    }
    holder.flush();
    indexed(&writer, &keys).await;
    let reader = Arc::new(PoolClient::start(routed_client(&m, "reader")).await.expect("reader"));
    mock.answer_busy(u64::MAX);
    let resolves = mock.calls().batch_resolve;
    let get = {
        let (reader, keys) = (Arc::clone(&reader), keys.clone());
        tokio::spawn(async move {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 2 * PAGE as usize]; keys.len()];
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            let results = reader.batch_get(&refs, &mut slices).await;
            (results, bufs)
        })
    };
    // In flight: the holder has been asked and answered busy.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while mock.calls().batch_resolve == resolves {
        assert!(tokio::time::Instant::now() < deadline, "the batch never reached its holder");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let close = {
        let reader = Arc::clone(&reader);
        tokio::spawn(async move { reader.close().await })
    };
    // However long the batch stays in flight, close does not return before it. (Checked here,
    // while the holder holds the batch. A flag the get task sets after the batch returns would
    // race: the batch lets go of the gate just before it returns, and close may look first.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!get.is_finished(), "the batch is still held in flight by its busy holder");
    assert!(!close.is_finished(), "close returned with a batch in flight");
    mock.answer_busy(0);
    let (results, bufs) =
        tokio::time::timeout(Duration::from_secs(10), get).await.expect("the batch ends").expect("get");
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r, &Ok(values[i].len() as u64), "{}: the batch in flight completes", keys[i]);
        assert_eq!(bufs[i], values[i], "{}", keys[i]);
    }
    tokio::time::timeout(Duration::from_secs(10), close).await.expect("close ends").expect("close");
    let mut buf = vec![0u8; 2 * PAGE as usize];
    assert_eq!(reader.get("c-0", &mut buf).await, Err(KeyError::Closed));
    assert_eq!(reader.put("x", b"y").await, Err(KeyError::Closed));
    writer.close().await;
    m.shutdown().await;
}

/// Batches started around a `close` from four tasks: every key is its bytes or `Closed`, never
/// another error or wrong bytes. (That `close` waits for a batch in flight is the test above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_racing_close_return_their_bytes_or_closed() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let reader = Arc::new(PoolClient::start(config(&m, "reader", 64 * PAGE)).await.expect("reader"));
    let keys: Vec<String> = (0..16).map(|i| format!("c-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..16).map(|i| value(i, 2 * PAGE as usize)).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in holder.batch_put(&items).await {
        r.expect("put");
    }
    holder.flush();
    indexed(&holder, &keys.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let mut tasks = Vec::new();
    for t in 0..4 {
        let reader = Arc::clone(&reader);
        let keys = keys.clone();
        let values = values.clone();
        tasks.push(tokio::spawn(async move {
            let mut closed = false;
            for _ in 0..50 {
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 2 * PAGE as usize]; keys.len()];
                let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                for (i, r) in reader.batch_get(&refs, &mut slices).await.into_iter().enumerate() {
                    match r {
                        Ok(_) => assert_eq!(bufs[i], values[i], "task {t}"),
                        Err(KeyError::Closed) => closed = true,
                        Err(e) => panic!("task {t}: {e}"),
                    }
                }
                if closed {
                    break;
                }
            }
            closed
        }));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    reader.close().await;
    for t in tasks {
        t.await.expect("no task panicked");
    }
    let mut buf = vec![0u8; 2 * PAGE as usize];
    assert_eq!(reader.get("c-0", &mut buf).await, Err(KeyError::Closed));
    assert_eq!(reader.put("x", b"y").await, Err(KeyError::Closed));
    holder.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn registered_memory_round_trips_and_unregistered_slices_still_work() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let client = PoolClient::start(client_config(&m, "client")).await.expect("client");
    let mut region = vec![0u8; 8 * PAGE as usize];
    let ptr = NonNull::new(region.as_mut_ptr()).expect("non-null");
    // SAFETY: `region` outlives the registration (deregistered below before it drops).
    unsafe { client.register_memory(ptr, region.len() as u64) }.expect("register");
    let v = value(3, 2 * PAGE as usize + 9);
    region[PAGE as usize..PAGE as usize + v.len()].copy_from_slice(&v);
    client.put("zc", &region[PAGE as usize..PAGE as usize + v.len()]).await.expect("zero-copy put");
    holder.flush();
    indexed(&client, &["zc"]).await;
    region.fill(0);
    let (inside, _) = region.split_at_mut(4 * PAGE as usize);
    assert_eq!(client.get("zc", &mut inside[PAGE as usize..]).await, Ok(v.len() as u64));
    assert_eq!(&region[PAGE as usize..PAGE as usize + v.len()], v.as_slice());
    // A buffer that is not (entirely) in the region: staged, still correct.
    let mut outside = vec![0u8; v.len()];
    assert_eq!(client.get("zc", &mut outside).await, Ok(v.len() as u64));
    assert_eq!(outside, v);
    client.deregister_memory(ptr);
    region.fill(0);
    assert_eq!(client.get("zc", &mut region[..v.len()]).await, Ok(v.len() as u64), "after deregistration");
    assert_eq!(&region[..v.len()], v.as_slice());
    client.close().await;
    holder.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_get_with_fewer_buffers_than_keys() {
    let m = master().await;
    let node = PoolClient::start(config(&m, "n", 64 * PAGE)).await.expect("node");
    let v = value(4, 700);
    node.put("a", &v).await.expect("put");
    node.put("b", &v).await.expect("put");
    let mut one = vec![0u8; 700];
    let mut bufs = [one.as_mut_slice()];
    let r = node.batch_get(&["a", "b"], &mut bufs).await;
    assert_eq!(r, vec![Ok(700), Err(KeyError::NoBuffer)]);
    assert_eq!(one, v);
    node.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_that_outlives_the_read_lease_is_never_a_hit() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 64 * PAGE)).await.expect("holder");
    let v = value(5, 3 * PAGE as usize);
    holder.put("leased", &v).await.expect("put");
    holder.flush();
    indexed(&holder, &["leased"]).await;
    // A lease shorter than any round trip: every remote read lapses.
    let mut rc = client_config(&m, "reader");
    rc.read_lease = Duration::from_micros(1);
    let reader = PoolClient::start(rc).await.expect("reader");
    let mut buf = vec![0u8; v.len()];
    assert_eq!(reader.get("leased", &mut buf).await, Err(KeyError::LeaseExpired { node: "holder".into() }));
    assert!(reader.stats().lease_lapses >= 1);
    // A normal lease reads it.
    let ok = PoolClient::start(client_config(&m, "reader2")).await.expect("reader");
    assert_eq!(ok.get("leased", &mut buf).await, Ok(v.len() as u64));
    assert_eq!(buf, v);
    for n in [&reader, &ok, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}

/// A clock that moves a minute every time it is read: every slot is past its pending TTL (30 s) by
/// the time its writer looks again, however fast the machine.
#[derive(Debug)]
struct MinutePerRead(Arc<umbp_core::ManualClock>);

impl umbp_core::Clock for MinutePerRead {
    fn now(&self) -> std::time::Instant {
        self.0.advance(Duration::from_secs(60));
        self.0.now()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_past_its_ttl_is_aborted_not_committed() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 64 * PAGE)).await.expect("holder");
    // Routed only: the writer judges its slot by its own (injected) clock — the keyed path's holder
    // judges by the wall clock, tested in umbp-transfer's keyed tests.
    let mut wc = client_config(&m, "writer");
    wc.max_reroutes = 0;
    wc.keyed_requests = false;
    let writer = PoolClient::builder_from(wc)
        .clock(Arc::new(MinutePerRead(umbp_core::ManualClock::new())))
        .start()
        .await
        .expect("writer");
    let v = value(6, 3 * PAGE as usize);
    let r = writer.put("slow", &v).await;
    assert_eq!(r, Err(KeyError::SlotExpired { node: "holder".into() }));
    assert!(writer.stats().slot_expiries >= 1);
    let medium = holder.medium().expect("m");
    assert_eq!(medium.owned_key_count(), 0, "nothing committed");
    // The writer's guard aborted its slot: the holder's pages are all free again, long before the
    // holder's own 30 s reaper would have freed them.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while medium.capacity().available_bytes != medium.capacity().total_bytes {
        assert!(tokio::time::Instant::now() < deadline, "the expired slot was never aborted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    writer.close().await;
    holder.close().await;
    m.shutdown().await;
}

async fn recached(policy: RecachePolicy, size: usize) -> (bool, u64) {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 64 * PAGE)).await.expect("holder");
    let v = value(7, size);
    holder.put("rc", &v).await.expect("put");
    holder.flush();
    indexed(&holder, &["rc"]).await;
    let mut rc = config(&m, "reader", 64 * PAGE);
    rc.recache = policy;
    let reader = PoolClient::start(rc).await.expect("reader");
    let mut buf = vec![0u8; size];
    assert_eq!(reader.get("rc", &mut buf).await, Ok(size as u64));
    assert_eq!(buf, v);
    let queued = reader.stats().recache_queued;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while queued > 0 && reader.stats().recache_stored < queued {
        assert!(tokio::time::Instant::now() < deadline, "re-cache never stored: {:?}", reader.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let here = reader.medium().expect("m").owned_key_count() == 1;
    reader.close().await;
    holder.close().await;
    m.shutdown().await;
    (here, queued)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn recache_follows_the_admission_policy() {
    assert_eq!(recached(RecachePolicy::Off, 3000).await, (false, 0), "off");
    assert_eq!(recached(RecachePolicy::UpTo(1000), 3000).await, (false, 0), "over the cap");
    assert_eq!(recached(RecachePolicy::UpTo(4000), 3000).await, (true, 1), "under the cap");
    assert_eq!(recached(RecachePolicy::Always, 3000).await, (true, 1), "always");
}

#[tokio::test(flavor = "current_thread")]
async fn a_current_thread_runtime_runs_puts_and_gets_inline() {
    let m = master().await;
    let a = PoolClient::start(config(&m, "a", 64 * PAGE)).await.expect("a");
    let b = PoolClient::start(client_config(&m, "b")).await.expect("b");
    let v = value(8, 5000);
    b.put("ct", &v).await.expect("remote put");
    a.flush();
    indexed(&b, &["ct"]).await;
    let mut buf = vec![0u8; 5000];
    assert_eq!(b.get("ct", &mut buf).await, Ok(5000));
    assert_eq!(buf, v);
    b.close().await;
    a.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_data_listen_needs_a_fixed_port_to_be_advertised() {
    // Nothing binds here: the config is refused before any listener opens.
    let m = master().await;
    let mut c = config(&m, "wild", 16 * PAGE);
    c.data_listen = "0.0.0.0:0".parse().expect("addr");
    let err = PoolClient::start(c).await.expect_err("a wildcard with port 0 cannot be advertised");
    assert!(err.to_string().contains("wildcard"), "{err}");
    m.shutdown().await;
}

#[test]
fn config_debug_output_never_shows_the_cluster_token() {
    let mut c = PoolClientConfig::new("n", "127.0.0.1:1");
    c.cluster_token = Some("s3cret-token".into());
    let shown = format!("{c:?}");
    assert!(!shown.contains("s3cret-token"), "{shown}");
    let tcp = umbp_transfer::TcpEngineConfig { cluster_token: Some("s3cret-token".into()), ..Default::default() };
    assert!(!format!("{tcp:?}").contains("s3cret-token"));
}
