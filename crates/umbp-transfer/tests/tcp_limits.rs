//! The TCP data plane against slow, silent, idle and hostile peers: every deadline holds, no peer
//! can pin a region or lock others out, and refs in every shape a medium hands out work.

pub mod tcp_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tcp_support::{HostBuf, engine, fast_config, item, pattern};
use umbp_core::{MemoryLocation, MemoryRegistrar, MetricSource, RemoteRegion, TransferRef};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, DataServer, DataServerConfig, FailureKind, LocalCopyEngine, TcpEngine,
    TcpEngineConfig, TransferEngine, TransferFailure, failed_tags, transfer,
};

fn kinds(failures: &[TransferFailure]) -> Vec<FailureKind> {
    failures.iter().map(|f| f.kind).collect()
}

/// The protocol version the server speaks (written out here, not taken from the crate, so a
/// version change shows in this test).
const VERSION: u16 = 2;

fn request(op: u8, id: u64, region: u64, offset: u64, length: u64) -> Vec<u8> {
    let mut out = b"UMBP".to_vec();
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&[op, 0]);
    for v in [id, region, offset, length] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn hello_bytes(version: u16) -> Vec<u8> {
    let mut h = b"UMBP".to_vec();
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(&0u16.to_le_bytes());
    h
}

/// Connects and says hello; returns the socket and the server's hello status.
fn hello(addr: &str, version: u16) -> (TcpStream, u8) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    s.write_all(&hello_bytes(version)).expect("hello");
    let mut answer = [0u8; 8];
    s.read_exact(&mut answer).expect("hello answer");
    (s, answer[6])
}

/// Whether the server closes `s` within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).expect("timeout");
    let mut sink = [0u8; 64];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => return !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }
}

/// Sends `bytes` one at a time, `every` apart, until they run out or the peer closes.
fn trickle(mut s: TcpStream, bytes: Vec<u8>, every: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for b in bytes {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(every);
        }
    })
}

fn server(config: DataServerConfig) -> DataServer {
    DataServer::start(config).expect("server")
}

#[test]
fn a_trickling_write_cannot_hold_deregister() {
    let mut region = HostBuf::zeroed(4096);
    let server = server(DataServerConfig { io_timeout: Duration::from_secs(1), ..DataServerConfig::default() });
    let r = region.register(&server);
    let id = r.remote().expect("remote").region_id;
    let (mut s, status) = hello(&server.local_addr().to_string(), VERSION);
    assert_eq!(status, 0);
    s.write_all(&request(2, 1, id, 0, 1024)).expect("header");
    s.write_all(&[7u8; 8]).expect("first bytes");
    // One byte every 500 ms: each read makes progress, so only a deadline on the whole request ends it.
    let pacer = trickle(s.try_clone().expect("clone"), vec![7u8; 40], Duration::from_millis(500));
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    server.deregister(&r);
    let took = started.elapsed();
    assert!(took < Duration::from_millis(2500), "deregister waited {took:?} for a trickling peer");
    assert!(closed_within(&mut s, Duration::from_secs(3)), "the late request closed its connection");
    pacer.join().expect("pacer");
}

/// A fake data server: answers the hello with `status`, then answers every request by trickling
/// bytes, one per `every`.
fn fake_server(status: u8, every: Duration) -> (String, std::thread::JoinHandle<()>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = listener.local_addr().expect("addr").to_string();
    let t = std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else { return };
        let mut hello = [0u8; 8];
        if s.read_exact(&mut hello).is_err() {
            return;
        }
        let mut answer = b"UMBP".to_vec();
        answer.extend_from_slice(&VERSION.to_le_bytes());
        answer.extend_from_slice(&[status, 0]);
        if s.write_all(&answer).is_err() || status != 0 {
            return;
        }
        let mut head = [0u8; 40];
        if s.read_exact(&mut head).is_err() {
            return;
        }
        // A READ reply header then its payload, at a trickle, for at most ~20 s.
        let mut reply = b"UMBP".to_vec();
        reply.extend_from_slice(&[1, 0, 0, 0]);
        reply.extend_from_slice(&head[8..16]);
        reply.extend_from_slice(&head[32..40]);
        for b in reply.into_iter().chain(std::iter::repeat_n(0u8, 40)) {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(every);
        }
    });
    (endpoint, t)
}

#[test]
fn wait_is_bounded_against_a_trickling_server() {
    let (endpoint, fake) = fake_server(0, Duration::from_millis(300));
    let mut local = HostBuf::zeroed(4096);
    let config = TcpEngineConfig {
        io_timeout: Duration::from_secs(1),
        batch_timeout: Duration::from_millis(1500),
        ..fast_config()
    };
    let a = TcpEngine::new(config).expect("engine");
    let local_ref = local.register(&a);
    let remote = TransferRef::remote_only(RemoteRegion { endpoint, region_id: 1 }, 4096, MemoryLocation::Host);
    let started = Instant::now();
    let failures = transfer(&a, &[item(&remote, 0, &local_ref, 0, 4096, 1)]).expect_err("too slow");
    let took = started.elapsed();
    assert_eq!(kinds(&failures), vec![FailureKind::Timeout]);
    assert!(took < Duration::from_millis(3000), "wait took {took:?}");
    // The batch's threads let go of the local buffer: deregistering it does not wait.
    let started = Instant::now();
    a.deregister(&local_ref);
    assert!(started.elapsed() < Duration::from_secs(1));
    drop(a);
    fake.join().expect("fake server");
}

#[test]
fn a_busy_server_is_reported_as_busy() {
    let (endpoint, fake) = fake_server(3, Duration::from_millis(1));
    let mut local = HostBuf::zeroed(4096);
    let a = engine();
    let local_ref = local.register(&a);
    let remote =
        TransferRef::remote_only(RemoteRegion { endpoint: endpoint.clone(), region_id: 1 }, 4096, MemoryLocation::Host);
    let failures = transfer(&a, &[item(&remote, 0, &local_ref, 0, 4096, 1)]).expect_err("busy");
    assert_eq!(kinds(&failures), vec![FailureKind::Busy]);
    assert!(failures[0].message.contains("busy"), "{}", failures[0].message);
    fake.join().expect("fake server");

    // And the real server answers BUSY beyond max_connections when every connection is in the
    // middle of a request (an idle one would make room instead).
    let mut region = HostBuf::zeroed(4096);
    let server = server(DataServerConfig { max_connections: 1, ..DataServerConfig::default() });
    let id = region.register(&server).remote().expect("remote").region_id;
    let addr = server.local_addr().to_string();
    let mut busy = false;
    for attempt in 1..=20u32 {
        let (mut first, status) = hello(&addr, VERSION);
        assert_eq!(status, 0);
        // A WRITE whose payload never finishes keeps the first connection busy.
        first.write_all(&request(2, 1, id, 0, 1024)).expect("header");
        first.write_all(&[1u8; 16]).expect("some payload");
        // Give its thread time to start reading the request (more on each attempt).
        std::thread::sleep(Duration::from_millis(20) * attempt);
        let (_second, status) = hello(&addr, VERSION);
        if status == 3 {
            busy = true;
            break;
        }
        assert_eq!(status, 0, "OK (the first was still idle and made room) or BUSY");
    }
    assert!(busy, "a full server of busy connections answers BUSY");
}

#[test]
fn an_idle_connection_makes_room_for_a_new_peer() {
    let mut remote = HostBuf::with_pattern(4096, 12);
    let mut local = HostBuf::zeroed(4096);
    let config =
        DataServerConfig { max_connections: 2, io_timeout: Duration::from_secs(5), ..DataServerConfig::default() };
    let b = TcpEngine::new(TcpEngineConfig { server: config, ..fast_config() }).expect("server engine");
    let remote_ref = remote.register(&b);
    // Two authenticated connections that never send a request fill the server.
    let (mut oldest, status) = hello(b.endpoint(), VERSION);
    assert_eq!(status, 0);
    let (_newer, status) = hello(b.endpoint(), VERSION);
    assert_eq!(status, 0);
    let a = TcpEngine::new(TcpEngineConfig { connections_per_peer: 1, ..fast_config() }).expect("client");
    let local_ref = local.register(&a);
    let target = TransferRef::remote_only(remote_ref.remote().expect("remote").clone(), 4096, MemoryLocation::Host);
    transfer(&a, &[item(&target, 0, &local_ref, 0, 4096, 1)]).expect("a new peer gets in");
    assert_eq!(local.bytes(), remote.bytes());
    assert!(closed_within(&mut oldest, Duration::from_secs(3)), "the connection idle longest made room");
    let evicted = b
        .sample_metrics()
        .iter()
        .find(|m| m.labels.iter().any(|(k, v)| k == "reason" && v == "idle_evicted"))
        .map(|m| m.value);
    assert_eq!(evicted, Some(1));
}

#[test]
fn a_version_mismatch_is_a_protocol_failure() {
    let server = server(DataServerConfig::default());
    let (_s, status) = hello(&server.local_addr().to_string(), VERSION - 1);
    assert_eq!(status, 2, "BAD_VERSION to an older client");
    let (_s, status) = hello(&server.local_addr().to_string(), VERSION + 1);
    assert_eq!(status, 2, "BAD_VERSION to a newer client");
    let (endpoint, fake) = fake_server(2, Duration::from_millis(1));
    let mut local = HostBuf::zeroed(4096);
    let a = engine();
    let local_ref = local.register(&a);
    let remote = TransferRef::remote_only(RemoteRegion { endpoint, region_id: 1 }, 4096, MemoryLocation::Host);
    let failures = transfer(&a, &[item(&remote, 0, &local_ref, 0, 4096, 1)]).expect_err("version");
    assert_eq!(kinds(&failures), vec![FailureKind::Protocol]);
    fake.join().expect("fake server");
}

#[test]
fn silent_sockets_do_not_lock_out_a_good_peer() {
    let mut remote = HostBuf::with_pattern(4096, 3);
    let mut local = HostBuf::zeroed(4096);
    let handshake_timeout = Duration::from_millis(500);
    let config = DataServerConfig { max_handshakes: 4, handshake_timeout, ..DataServerConfig::default() };
    let b = TcpEngine::new(TcpEngineConfig { server: config, ..fast_config() }).expect("server engine");
    let a = engine();
    let (remote_ref, local_ref) = (remote.register(&b), local.register(&a));
    let target = TransferRef::remote_only(remote_ref.remote().expect("remote").clone(), 4096, MemoryLocation::Host);
    // Fill the handshake slots: two silent sockets and two trickling a hello.
    let mut silent: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(b.endpoint()).expect("connect")).collect();
    let pacers: Vec<_> = (0..2)
        .map(|_| {
            let s = TcpStream::connect(b.endpoint()).expect("connect");
            trickle(s, hello_bytes(VERSION), Duration::from_millis(150))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let started = Instant::now();
    let mut attempts = 0;
    loop {
        attempts += 1;
        match transfer(&a, &[item(&target, 0, &local_ref, 0, 4096, 1)]) {
            Ok(()) => break,
            Err(f) => {
                assert!(started.elapsed() < handshake_timeout * 4, "still locked out after {attempts} attempts: {f:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    assert_eq!(local.bytes(), remote.bytes());
    for s in &mut silent {
        assert!(closed_within(s, Duration::from_secs(2)), "a silent socket is closed at the handshake deadline");
    }
    for p in pacers {
        p.join().expect("pacer");
    }
}

#[test]
fn idle_connections_are_closed_on_both_sides() {
    let server_config = DataServerConfig { idle_timeout: Duration::from_millis(300), ..DataServerConfig::default() };
    let server = server(server_config);
    let (mut s, status) = hello(&server.local_addr().to_string(), VERSION);
    assert_eq!(status, 0);
    assert!(closed_within(&mut s, Duration::from_secs(3)), "the server closes an idle connection");

    let mut remote = HostBuf::zeroed(4096);
    let mut local = HostBuf::with_pattern(4096, 4);
    let b = engine();
    let a = TcpEngine::new(TcpEngineConfig { idle_timeout: Duration::from_millis(200), ..fast_config() })
        .expect("client engine");
    let (remote_ref, local_ref) = (remote.register(&b), local.register(&a));
    transfer(&a, &[item(&local_ref, 0, &remote_ref, 0, 4096, 1)]).expect("write");
    assert!(b.server().connection_count() > 0);
    let deadline = Instant::now() + Duration::from_secs(3);
    while b.server().connection_count() > 0 {
        assert!(Instant::now() < deadline, "the client closes its idle pooled connections");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The next transfer reconnects.
    transfer(&a, &[item(&remote_ref, 0, &local_ref, 0, 4096, 2)]).expect("read after idle close");
    assert_eq!(local.bytes(), remote.bytes());
}

#[test]
fn a_stream_of_large_writes_is_acknowledged_as_it_lands() {
    const LEN: usize = 8 << 20;
    let mut region = HostBuf::zeroed(2 * LEN);
    let server = server(DataServerConfig::default());
    let r = region.register(&server);
    let id = r.remote().expect("remote").region_id;
    let (mut s, status) = hello(&server.local_addr().to_string(), VERSION);
    assert_eq!(status, 0);
    let payload = pattern(LEN, 5);
    let mut burst = request(2, 1, id, 0, LEN as u64);
    burst.extend_from_slice(&payload);
    burst.extend_from_slice(&request(2, 2, id, LEN as u64, LEN as u64));
    burst.extend_from_slice(&payload[..LEN / 2]);
    let writer = {
        let mut s = s.try_clone().expect("clone");
        std::thread::spawn(move || s.write_all(&burst).expect("burst"))
    };
    // The second write is still incomplete: its predecessor's reply must not wait for it.
    let mut reply = [0u8; 24];
    s.set_read_timeout(Some(Duration::from_secs(3))).expect("timeout");
    s.read_exact(&mut reply).expect("the first write's reply arrives while the second is in flight");
    assert_eq!((reply[6], u64::from_le_bytes(reply[8..16].try_into().expect("8"))), (0, 1));
    writer.join().expect("writer");
    s.write_all(&payload[LEN / 2..]).expect("rest");
    s.read_exact(&mut reply).expect("second reply");
    assert_eq!(reply[6], 0);
    drop(s);
    server.deregister(&r);
    assert!(region.bytes()[..LEN] == payload[..] && region.bytes()[LEN..] == payload[..]);
}

#[test]
fn truncated_refs_of_registered_regions_work_and_deregister() {
    let mut local = HostBuf::with_pattern(8192, 6);
    let mut remote = HostBuf::zeroed(8192);
    let (a, b) = (engine(), engine());
    let full = local.register(&a);
    let remote_ref = remote.register(&b);
    // A medium publishes whole pages only: the ref narrowed to 4 KiB.
    let narrow = full.clone().truncated(4096);
    assert!(a.can_handle(&narrow, &remote_ref), "a truncated ref of a registered region is this engine's");
    transfer(&a, &[item(&narrow, 0, &remote_ref, 0, 4096, 1)]).expect("push through the truncated ref");
    assert_eq!(remote.bytes()[..4096], local.bytes()[..4096]);
    // The narrow and the full ref of one buffer in one batch: separate plans, each its own size.
    let items = [item(&narrow, 0, &remote_ref, 0, 4096, 2), item(&full, 4096, &remote_ref, 4096, 4096, 3)];
    assert_eq!(a.plan(&items).plans.len(), 2);
    transfer(&a, &items).expect("both sizes");
    assert_eq!(remote.bytes(), local.bytes());
    a.deregister(&narrow);
    assert_eq!(a.server().region_count(), 0, "a truncated ref deregisters its region");
    assert!(!a.can_handle(&full, &remote_ref));
}

#[test]
fn region_ids_of_two_servers_do_not_collide() {
    let (mut x, mut y) = (HostBuf::zeroed(64), HostBuf::zeroed(64));
    let (a, b) = (server(DataServerConfig::default()), server(DataServerConfig::default()));
    let id = |r: &TransferRef| r.remote().expect("remote").region_id;
    let (ra, rb) = (x.register(&a), y.register(&b));
    // 24 random bits of epoch per server: equal only with a chance of 1 in 16M.
    assert_ne!(id(&ra), id(&rb), "a restarted peer must not reissue the ids of its predecessor");
    a.deregister(&ra);
    b.deregister(&rb);
}

#[test]
fn the_bounce_pool_is_not_addressable_by_peers() {
    let mut user = vec![0u8; 4096];
    let mut back = HostBuf::zeroed(4096);
    let node = CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), Arc::new(engine())],
        CompositeConfig { bounce_bytes: 64 << 10 },
    )
    .expect("composite");
    let peer = engine();
    // SAFETY: `user` outlives the registration (deregistered below).
    let region = unsafe {
        umbp_core::LocalRegion::new(std::ptr::NonNull::new(user.as_mut_ptr()).expect("ptr"), 4096, MemoryLocation::Host)
    };
    let registered = node.register_memory(region).expect("registered");
    let remote = registered.remote().expect("tcp handle").clone();
    // The pool was registered first, so its id is the one before the user buffer's.
    let pool = TransferRef::remote_only(
        RemoteRegion { endpoint: remote.endpoint.clone(), region_id: remote.region_id - 1 },
        4096,
        MemoryLocation::Host,
    );
    let back_ref = back.register(&peer);
    let failures = transfer(&peer, &[item(&pool, 0, &back_ref, 0, 4096, 1)]).expect_err("the pool is private");
    assert_eq!(kinds(&failures), vec![FailureKind::UnknownRegion]);
    let failures = transfer(&peer, &[item(&back_ref, 0, &pool, 0, 4096, 2)]).expect_err("and not writable");
    assert_eq!(kinds(&failures), vec![FailureKind::UnknownRegion]);
    node.deregister(&registered);
}

#[test]
fn deregistering_the_local_side_waits_for_a_client_batch() {
    const LEN: usize = 64 << 20;
    let mut src = HostBuf::with_pattern(LEN, 8);
    let mut remote = HostBuf::zeroed(LEN);
    let (a, b) = (engine(), engine());
    let (src_ref, remote_ref) = (src.register(&a), remote.register(&b));
    let mut handle = a.submit(a.plan(&[item(&src_ref, 0, &remote_ref, 0, LEN as u64, 1)]).plans).expect("submitted");
    // Deregistering the local side while the batch reads it blocks until the batch lets go.
    a.deregister(&src_ref);
    let failures = handle.wait();
    assert!(failures.is_empty(), "{failures:?}");
    assert!(remote.bytes() == src.bytes(), "the batch finished reading before deregister returned");
}

#[test]
fn dropping_the_engine_with_an_unwaited_handle_neither_hangs_nor_loses_bytes() {
    const LEN: usize = 16 << 20;
    let mut src = HostBuf::with_pattern(LEN, 9);
    let mut remote = HostBuf::zeroed(LEN);
    let b = engine();
    let remote_ref = remote.register(&b);
    let a = engine();
    let src_ref = src.register(&a);
    let handle = a.submit(a.plan(&[item(&src_ref, 0, &remote_ref, 0, LEN as u64, 1)]).plans).expect("submitted");
    let started = Instant::now();
    drop(a);
    drop(handle);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(remote.bytes() == src.bytes(), "queued work finished before the engine went away");
}

#[test]
fn a_trickling_garbage_client_does_not_disturb_a_good_one() {
    let mut remote = HostBuf::with_pattern(1 << 20, 10);
    let mut local = HostBuf::zeroed(1 << 20);
    let config = DataServerConfig { handshake_timeout: Duration::from_millis(500), ..DataServerConfig::default() };
    let b = TcpEngine::new(TcpEngineConfig { server: config, ..fast_config() }).expect("server engine");
    let a = engine();
    let (remote_ref, local_ref) = (remote.register(&b), local.register(&a));
    let (tx, rx) = mpsc::channel();
    let garbage = {
        let endpoint = b.endpoint().to_owned();
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(endpoint).expect("connect");
            let pacer = trickle(s.try_clone().expect("clone"), b"UMBX garbage".to_vec(), Duration::from_millis(100));
            tx.send(closed_within(&mut s, Duration::from_secs(3))).expect("send");
            pacer.join().expect("pacer");
        })
    };
    for round in 0..10 {
        transfer(&a, &[item(&remote_ref, 0, &local_ref, 0, 1 << 20, round)]).expect("read beside garbage");
        assert!(local.bytes() == remote.bytes());
    }
    assert!(rx.recv_timeout(Duration::from_secs(5)).expect("garbage thread"), "the garbage socket is closed");
    garbage.join().expect("garbage");
}

#[test]
fn a_failed_plan_fails_only_its_tags_and_is_counted() {
    // Composite metrics over TCP: a push to a deregistered region is a failed plan of TcpEngine.
    let mut user = HostBuf::with_pattern(4096, 11);
    let mut remote = HostBuf::zeroed(4096);
    let b = engine();
    let node = CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), Arc::new(engine())],
        CompositeConfig { bounce_bytes: 64 << 10 },
    )
    .expect("composite");
    let remote_ref = remote.register(&b);
    let target = TransferRef::remote_only(remote_ref.remote().expect("remote").clone(), 4096, MemoryLocation::Host);
    let user_ref = user.register(&node);
    transfer(&node, &[item(&user_ref, 0, &target, 0, 4096, 1)]).expect("push");
    b.deregister(&remote_ref);
    let failures = transfer(&node, &[item(&user_ref, 0, &target, 0, 4096, 2)]).expect_err("gone");
    assert_eq!(failed_tags(&failures), vec![2]);
    let m = node.sample_metrics();
    let count = |status: &str| {
        m.iter()
            .find(|s| {
                s.name == "umbp_transfer_ops_total"
                    && s.labels.iter().any(|(k, v)| k == "engine" && v == "TcpEngine")
                    && s.labels.iter().any(|(k, v)| k == "direction" && v == "push")
                    && s.labels.iter().any(|(k, v)| k == "status" && v == status)
            })
            .map(|s| s.value)
    };
    assert_eq!(count("ok"), Some(1));
    assert_eq!(count("failed"), Some(1));
    node.deregister(&user_ref);
}

/// A fake data server whose first connection serves one READ and then, as the next request
/// arrives, closes without answering — a server closing an idle connection just as the client
/// reuses it. Later connections serve every READ with `payload`.
fn closing_server(payload: Vec<u8>) -> (String, std::thread::JoinHandle<usize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = listener.local_addr().expect("addr").to_string();
    let serve = move |s: &mut TcpStream, at_most: usize| -> usize {
        let mut hello = [0u8; 8];
        if s.read_exact(&mut hello).is_err() {
            return 0;
        }
        let mut answer = b"UMBP".to_vec();
        answer.extend_from_slice(&VERSION.to_le_bytes());
        answer.extend_from_slice(&[0, 0]);
        if s.write_all(&answer).is_err() {
            return 0;
        }
        let mut served = 0;
        while served < at_most {
            let mut head = [0u8; 40];
            if s.read_exact(&mut head).is_err() {
                break;
            }
            let mut reply = b"UMBP".to_vec();
            reply.extend_from_slice(&VERSION.to_le_bytes());
            reply.extend_from_slice(&[0, 0]);
            reply.extend_from_slice(&head[8..16]);
            reply.extend_from_slice(&head[32..40]);
            let len = u64::from_le_bytes(head[32..40].try_into().expect("8 bytes")) as usize;
            reply.extend_from_slice(&payload[..len]);
            if s.write_all(&reply).is_err() {
                break;
            }
            served += 1;
        }
        served
    };
    let t = std::thread::spawn(move || {
        let Ok((mut first, _)) = listener.accept() else { return 0 };
        first.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut served = serve(&mut first, 1);
        // The next request starts to arrive: close with it unread (the peer sees a reset).
        let mut one = [0u8; 1];
        let _ = first.read(&mut one);
        drop(first);
        if let Ok((mut second, _)) = listener.accept() {
            second.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            served += serve(&mut second, usize::MAX);
        }
        served
    });
    (endpoint, t)
}

#[test]
fn a_pooled_connection_closed_under_a_request_is_reconnected_transparently() {
    let payload = pattern(4096, 13);
    let (endpoint, fake) = closing_server(payload.clone());
    let mut local = HostBuf::zeroed(4096);
    let a = TcpEngine::new(TcpEngineConfig { connections_per_peer: 1, ..fast_config() }).expect("client");
    let local_ref = local.register(&a);
    let remote = TransferRef::remote_only(RemoteRegion { endpoint, region_id: 1 }, 4096, MemoryLocation::Host);
    transfer(&a, &[item(&remote, 0, &local_ref, 0, 4096, 1)]).expect("first read");
    assert_eq!(local.bytes(), &payload[..]);
    // The pooled connection is reused, and the server closes it as the request arrives.
    a.deregister(&local_ref);
    let mut again = HostBuf::zeroed(4096);
    let again_ref = again.register(&a);
    transfer(&a, &[item(&remote, 0, &again_ref, 0, 4096, 2)]).expect("the request is resent on a new connection");
    assert_eq!(again.bytes(), &payload[..]);
    drop(a);
    assert_eq!(fake.join().expect("fake server"), 2, "one read per connection");
}

#[test]
fn a_pooled_connection_the_server_closed_for_idleness_does_not_fail_the_next_transfer() {
    let mut remote = HostBuf::with_pattern(4096, 14);
    let mut local = HostBuf::zeroed(4096);
    let config = DataServerConfig { idle_timeout: Duration::from_millis(200), ..fast_config().server };
    let b = TcpEngine::new(TcpEngineConfig { server: config, ..fast_config() }).expect("server engine");
    // The client keeps its pooled connections far longer than the server does.
    let a = TcpEngine::new(TcpEngineConfig { idle_timeout: Duration::from_secs(600), ..fast_config() })
        .expect("client engine");
    let (remote_ref, local_ref) = (remote.register(&b), local.register(&a));
    for round in 0..3 {
        transfer(&a, &[item(&remote_ref, 0, &local_ref, 0, 4096, round)]).expect("read");
        assert_eq!(local.bytes(), remote.bytes());
        let deadline = Instant::now() + Duration::from_secs(5);
        while b.server().connection_count() > 0 {
            assert!(Instant::now() < deadline, "the server closes the idle connection");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
