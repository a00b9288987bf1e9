//! `TcpEngine` between two engines of one process: engine `a` pushes and pulls, engine `b` owns the
//! regions. Byte-exact round trips, rejections, deregistration, and the pair rules.

pub mod tcp_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tcp_support::{HostBuf, engine, item, pattern};
use umbp_core::{
    LocalRegion, MemoryLocation, MemoryRegistrar, MetricSource, RegistrationError, RemoteRegion, TransferRef,
};
use umbp_transfer::{
    DataServer, DataServerConfig, FailureKind, TransferDirection, TransferEngine, TransferFailure, TransferItem,
    failed_tags, transfer,
};

fn run(engine: &dyn TransferEngine, items: &[TransferItem]) -> Result<(), Vec<TransferFailure>> {
    transfer(engine, items)
}

fn kinds(failures: &[TransferFailure]) -> Vec<FailureKind> {
    failures.iter().map(|f| f.kind).collect()
}

/// A remote ref that claims more bytes than the region has, so planning lets an out-of-range item
/// through and the server must refuse it.
fn oversized(r: &TransferRef, size: u64) -> TransferRef {
    TransferRef::remote_only(r.remote().expect("registered").clone(), size, MemoryLocation::Host)
}

#[test]
fn single_page_round_trip() {
    let mut src = HostBuf::with_pattern(4096, 1);
    let mut back = HostBuf::zeroed(4096);
    let mut remote = HostBuf::zeroed(64 << 10);
    let (a, b) = (engine(), engine());
    let (src_ref, back_ref, remote_ref) = (src.register(&a), back.register(&a), remote.register(&b));

    run(&a, &[item(&src_ref, 0, &remote_ref, 8192, 4096, 1)]).expect("write");
    assert_eq!(&remote.bytes()[8192..12288], src.bytes());
    assert!(remote.bytes()[..8192].iter().all(|&x| x == 0));
    assert!(remote.bytes()[12288..].iter().all(|&x| x == 0));

    run(&a, &[item(&remote_ref, 8192, &back_ref, 0, 4096, 1)]).expect("read");
    assert_eq!(back.bytes(), src.bytes());
}

#[test]
fn multi_page_items_coalesce_and_round_trip() {
    const PAGE: u64 = 4096;
    let mut src = HostBuf::with_pattern(8 * PAGE as usize, 2);
    let mut back = HostBuf::zeroed(8 * PAGE as usize);
    let mut remote = HostBuf::zeroed(16 * PAGE as usize);
    let (a, b) = (engine(), engine());
    let (src_ref, back_ref, remote_ref) = (src.register(&a), back.register(&a), remote.register(&b));

    let items: Vec<TransferItem> =
        (0..8).map(|i| item(&src_ref, i * PAGE, &remote_ref, (4 + i) * PAGE, PAGE, 7)).collect();
    let set = a.plan(&items);
    assert!(set.rejected_tags.is_empty());
    assert_eq!(set.plans.len(), 1);
    assert_eq!(set.plans[0].segments.len(), 1, "adjacent pages coalesce into one run");
    assert_eq!(set.plans[0].direction, TransferDirection::Push);
    run(&a, &items).expect("write");
    assert_eq!(&remote.bytes()[4 * PAGE as usize..12 * PAGE as usize], src.bytes());

    let items: Vec<TransferItem> =
        (0..8).map(|i| item(&remote_ref, (4 + i) * PAGE, &back_ref, i * PAGE, PAGE, i)).collect();
    assert_eq!(a.plan(&items).plans[0].direction, TransferDirection::Pull);
    run(&a, &items).expect("read");
    assert_eq!(back.bytes(), src.bytes());
}

#[test]
fn scatter_across_several_regions() {
    const PAGE: u64 = 8192;
    let mut src = HostBuf::with_pattern(12 * PAGE as usize, 3);
    let mut back = HostBuf::zeroed(12 * PAGE as usize);
    let mut regions: Vec<HostBuf> = (0..3).map(|_| HostBuf::zeroed(8 * PAGE as usize)).collect();
    let (a, b) = (engine(), engine());
    let (src_ref, back_ref) = (src.register(&a), back.register(&a));
    let refs: Vec<TransferRef> = regions.iter_mut().map(|r| r.register(&b)).collect();

    // Page i goes to region i % 3, at slot 7 - i / 3 (reversed, so nothing coalesces).
    let place = |i: u64| (&refs[(i % 3) as usize], (7 - i / 3) * PAGE);
    let writes: Vec<TransferItem> = (0..12)
        .map(|i| {
            let (r, off) = place(i);
            item(&src_ref, i * PAGE, r, off, PAGE, i)
        })
        .collect();
    let set = a.plan(&writes);
    assert_eq!(set.plans.len(), 3, "one plan per (local buffer, remote region) pair");
    run(&a, &writes).expect("write");
    for i in 0..12u64 {
        let region = &regions[(i % 3) as usize];
        let off = ((7 - i / 3) * PAGE) as usize;
        assert_eq!(
            &region.bytes()[off..off + PAGE as usize],
            &src.bytes()[(i * PAGE) as usize..((i + 1) * PAGE) as usize]
        );
    }
    let reads: Vec<TransferItem> = (0..12)
        .map(|i| {
            let (r, off) = place(i);
            item(r, off, &back_ref, i * PAGE, PAGE, i)
        })
        .collect();
    run(&a, &reads).expect("read");
    assert_eq!(back.bytes(), src.bytes());
}

#[test]
fn partial_tail_page_leaves_the_rest_untouched() {
    let mut src = HostBuf::with_pattern(4096, 4);
    let mut back = HostBuf::filled(4096, 0x55);
    let mut remote = HostBuf::filled(3 * 4096, 0xEE);
    let total = 2 * 4096 + 1000;
    let mut big = HostBuf::with_pattern(total, 5);
    let (a, b) = (engine(), engine());
    let (src_ref, back_ref, remote_ref) = (src.register(&a), back.register(&a), remote.register(&b));

    // Two full pages and a 1000-byte tail.
    let big_ref = big.register(&a);
    let items = vec![
        item(&big_ref, 0, &remote_ref, 0, 4096, 0),
        item(&big_ref, 4096, &remote_ref, 4096, 4096, 0),
        item(&big_ref, 8192, &remote_ref, 8192, 1000, 0),
    ];
    run(&a, &items).expect("write");
    assert_eq!(&remote.bytes()[..total], big.bytes());
    assert!(remote.bytes()[total..].iter().all(|&x| x == 0xEE), "guard bytes after the tail are untouched");

    run(&a, &[item(&src_ref, 0, &remote_ref, 8192, 1000, 1)]).expect("rewrite the tail");
    run(&a, &[item(&remote_ref, 8192, &back_ref, 0, 1000, 1)]).expect("read the tail");
    assert_eq!(&back.bytes()[..1000], &src.bytes()[..1000]);
    assert!(back.bytes()[1000..].iter().all(|&x| x == 0x55), "local guard bytes untouched");
    assert!(remote.bytes()[total..].iter().all(|&x| x == 0xEE));
}

#[test]
fn hundred_thousand_tiny_items_in_one_batch() {
    const N: u64 = 100_000;
    const SIZE: u64 = 8;
    let mut src = HostBuf::with_pattern((N * SIZE) as usize, 6);
    let mut back = HostBuf::zeroed((N * SIZE) as usize);
    // Remote stride 16: no two items are adjacent remotely, so nothing coalesces.
    let mut remote = HostBuf::zeroed((N * 16) as usize);
    let (a, b) = (engine(), engine());
    let (src_ref, back_ref, remote_ref) = (src.register(&a), back.register(&a), remote.register(&b));

    let started = Instant::now();
    let writes: Vec<TransferItem> = (0..N).map(|i| item(&src_ref, i * SIZE, &remote_ref, i * 16, SIZE, i)).collect();
    let set = a.plan(&writes);
    assert_eq!(set.plans[0].segments.len(), N as usize);
    run(&a, &writes).expect("write");
    let reads: Vec<TransferItem> = (0..N).map(|i| item(&remote_ref, i * 16, &back_ref, i * SIZE, SIZE, i)).collect();
    run(&a, &reads).expect("read");
    assert_eq!(back.bytes(), src.bytes());
    for i in 0..N as usize {
        assert_eq!(&remote.bytes()[i * 16..i * 16 + 8], &src.bytes()[i * 8..i * 8 + 8]);
        assert!(remote.bytes()[i * 16 + 8..i * 16 + 16].iter().all(|&x| x == 0));
    }
    // Generous: this guards against a pathological slowdown (one round trip per item), not a speed.
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
}

#[test]
fn sixty_four_mib_item_round_trips() {
    const LEN: usize = 64 << 20;
    let mut src = HostBuf::with_pattern(LEN, 7);
    let mut back = HostBuf::zeroed(LEN);
    let mut remote = HostBuf::zeroed(LEN);
    let (a, b) = (engine(), engine());
    let (src_ref, back_ref, remote_ref) = (src.register(&a), back.register(&a), remote.register(&b));
    run(&a, &[item(&src_ref, 0, &remote_ref, 0, LEN as u64, 1)]).expect("write");
    assert!(remote.bytes() == src.bytes());
    run(&a, &[item(&remote_ref, 0, &back_ref, 0, LEN as u64, 1)]).expect("read");
    assert!(back.bytes() == src.bytes());
}

#[test]
fn out_of_range_fails_only_its_plan() {
    let mut src = HostBuf::with_pattern(8192, 8);
    let mut good = HostBuf::zeroed(8192);
    let mut small = HostBuf::filled(4096, 0xAB);
    let mut back = HostBuf::zeroed(8192);
    let (a, b) = (engine(), engine());
    let src_ref = src.register(&a);
    let (good_ref, small_ref) = (good.register(&b), small.register(&b));
    let lying = oversized(&small_ref, 1 << 20);

    let items = vec![
        item(&src_ref, 0, &good_ref, 0, 4096, 1),
        item(&src_ref, 0, &lying, 2048, 4096, 2), // reaches 2 KiB past the region
        item(&src_ref, 4096, &good_ref, 4096, 4096, 3),
    ];
    let failures = run(&a, &items).expect_err("one plan fails");
    assert_eq!(kinds(&failures), vec![FailureKind::OutOfRange]);
    assert_eq!(failed_tags(&failures), vec![2]);
    assert_eq!(failures[0].endpoint, b.endpoint());
    assert_eq!(good.bytes(), src.bytes(), "the other plans moved");
    assert!(small.bytes().iter().all(|&x| x == 0xAB), "nothing of the refused write landed");

    // The same connection keeps working after a refused WRITE (its payload was consumed).
    let back_ref = back.register(&a);
    let failures = run(&a, &[item(&lying, 4096, &back_ref, 0, 1, 4), item(&good_ref, 0, &back_ref, 0, 8192, 5)])
        .expect_err("the out-of-range read fails");
    assert_eq!(failed_tags(&failures), vec![4]);
    assert_eq!(back.bytes(), src.bytes());
}

#[test]
fn unknown_and_deregistered_regions_are_refused() {
    let mut src = HostBuf::with_pattern(4096, 9);
    let mut remote = HostBuf::filled(4096, 0x11);
    let (a, b) = (engine(), engine());
    let src_ref = src.register(&a);
    let remote_ref = remote.register(&b);

    let unknown = TransferRef::remote_only(
        RemoteRegion { endpoint: b.endpoint().to_owned(), region_id: 999_999 },
        4096,
        MemoryLocation::Host,
    );
    let failures = run(&a, &[item(&src_ref, 0, &unknown, 0, 4096, 1)]).expect_err("unknown region");
    assert_eq!(kinds(&failures), vec![FailureKind::UnknownRegion]);
    let failures = run(&a, &[item(&unknown, 0, &src_ref, 0, 4096, 1)]).expect_err("unknown region");
    assert_eq!(kinds(&failures), vec![FailureKind::UnknownRegion]);

    run(&a, &[item(&src_ref, 0, &remote_ref, 0, 4096, 1)]).expect("live region");
    b.deregister(&remote_ref);
    b.deregister(&remote_ref); // twice is a no-op
    let failures = run(&a, &[item(&src_ref, 0, &remote_ref, 0, 4096, 2)]).expect_err("deregistered");
    assert_eq!(kinds(&failures), vec![FailureKind::UnknownRegion]);
    assert_eq!(b.server().region_count(), 0);
}

/// Raw protocol bytes (the format documented in the crate's `tcp::protocol` module).
fn request(op: u8, id: u64, region: u64, offset: u64, length: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(40);
    out.extend_from_slice(b"UMBP");
    out.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    out.push(op);
    out.push(0);
    for v in [id, region, offset, length] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn hello(stream: &mut TcpStream, token: &[u8]) -> u8 {
    let mut h = Vec::new();
    h.extend_from_slice(b"UMBP");
    h.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    h.extend_from_slice(&(token.len() as u16).to_le_bytes());
    h.extend_from_slice(token);
    stream.write_all(&h).expect("hello");
    let mut answer = [0u8; 8];
    stream.read_exact(&mut answer).expect("hello answer");
    assert_eq!(&answer[..4], b"UMBP");
    answer[6]
}

#[test]
fn deregister_waits_for_an_in_flight_write() {
    let server = Arc::new(DataServer::start(DataServerConfig::default()).expect("server"));
    const LEN: usize = 8 << 20;
    let mut region = HostBuf::zeroed(LEN);
    let r = region.register(&*server);
    let id = r.remote().expect("remote handle").region_id;

    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    assert_eq!(hello(&mut stream, b""), 0);
    // Start an 8 MiB WRITE but send only half of its payload.
    stream.write_all(&request(2, 1, id, 0, LEN as u64)).expect("header");
    let payload = pattern(LEN, 10);
    stream.write_all(&payload[..LEN / 2]).expect("first half");
    std::thread::sleep(Duration::from_millis(100)); // let the server start the write

    let (tx, rx) = mpsc::channel();
    let deregistering = {
        let server = Arc::clone(&server);
        let r = r.clone();
        std::thread::spawn(move || {
            server.deregister(&r);
            tx.send(Instant::now()).expect("send");
        })
    };
    assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "deregister must wait for the in-flight write");
    stream.write_all(&payload[LEN / 2..]).expect("second half");
    let finished = rx.recv_timeout(Duration::from_secs(5)).expect("deregister returns once the write is done");
    deregistering.join().expect("join");
    let mut reply = [0u8; 24];
    stream.read_exact(&mut reply).expect("reply");
    assert_eq!(reply[6], 0, "the write that was in flight completes");
    assert!(finished.elapsed() < Duration::from_secs(5));
    assert!(region.bytes() == payload.as_slice(), "all of it landed before deregister returned");

    // Later requests for the region are refused, and their payload is consumed.
    stream.write_all(&request(2, 2, id, 0, 16)).expect("header");
    stream.write_all(&[0u8; 16]).expect("payload");
    stream.write_all(&request(1, 3, id, 0, 16)).expect("read header");
    for want in [2u64, 3] {
        stream.read_exact(&mut reply).expect("reply");
        assert_eq!(reply[6], 1, "UNKNOWN_REGION");
        assert_eq!(u64::from_le_bytes(reply[8..16].try_into().expect("8 bytes")), want);
    }
    assert!(region.bytes() == payload.as_slice());
}

#[test]
fn deregister_waits_for_an_engine_batch() {
    const LEN: usize = 256 << 20;
    let mut src = HostBuf::with_pattern(LEN / 8, 11);
    let mut remote = HostBuf::zeroed(LEN);
    let (a, b) = (engine(), engine());
    let src_ref = src.register(&a);
    let remote_ref = remote.register(&b);
    let items: Vec<TransferItem> =
        (0..8u64).map(|i| item(&src_ref, 0, &remote_ref, i * (LEN as u64 / 8), LEN as u64 / 8, i)).collect();
    let set = a.plan(&items);
    let mut handle = a.submit(set.plans).expect("submitted");
    std::thread::sleep(Duration::from_millis(20));
    b.deregister(&remote_ref);
    // Once deregister returned the server never touches the region again.
    let snapshot = remote.bytes().to_vec();
    let failures = handle.wait();
    assert!(remote.bytes() == snapshot.as_slice(), "no byte landed after deregister returned");
    if failures.is_empty() {
        // The batch won the race (it finished before deregister started): nothing to check beyond
        // every byte having landed.
        eprintln!("note: the batch finished before deregister; the race was not exercised");
        assert!(remote.bytes().chunks(LEN / 8).all(|c| c == src.bytes()));
    } else {
        assert!(failures.iter().all(|f| f.kind == FailureKind::UnknownRegion), "{failures:?}");
    }
}

#[test]
fn pair_rules() {
    let mut mine = HostBuf::zeroed(4096);
    let mut mine2 = HostBuf::zeroed(4096);
    let mut theirs = HostBuf::zeroed(4096);
    let mut theirs2 = HostBuf::zeroed(4096);
    let mut loose = HostBuf::zeroed(4096);
    let (a, b) = (engine(), engine());
    let (mine_ref, mine2_ref) = (mine.register(&a), mine2.register(&a));
    let (theirs_ref, theirs2_ref) = (theirs.register(&b), theirs2.register(&b));
    let unregistered = TransferRef::local(loose.region());
    let mut gpu_bytes = [0u8; 64];
    // SAFETY: never dereferenced: no engine may take GPU memory as a TCP local side.
    let gpu = TransferRef::local(unsafe {
        LocalRegion::new(std::ptr::NonNull::from(&mut gpu_bytes).cast(), 64, MemoryLocation::Gpu { device: 0 })
    });
    let theirs_published =
        TransferRef::remote_only(theirs_ref.remote().expect("remote").clone(), 4096, MemoryLocation::Host);

    assert!(a.can_handle(&mine_ref, &theirs_ref), "push");
    assert!(a.can_handle(&theirs_ref, &mine_ref), "pull");
    assert!(!a.can_handle(&mine_ref, &mine2_ref), "both local");
    assert!(!a.can_handle(&mine_ref, &unregistered), "both local (one unregistered)");
    assert!(!a.can_handle(&unregistered, &unregistered), "both local (unregistered)");
    assert!(!a.can_handle(&theirs_ref, &theirs2_ref), "both remote");
    assert!(!a.can_handle(&theirs_published, &theirs2_ref), "both remote (remote-only ref)");
    assert!(a.can_handle(&unregistered, &theirs_ref), "unregistered host memory is a local side: push");
    assert!(a.can_handle(&theirs_ref, &unregistered), "unregistered host memory is a local side: pull");
    assert!(a.can_handle(&unregistered, &theirs_published), "push to a published remote-only ref");
    assert!(a.can_handle(&theirs_published, &unregistered), "pull from a published remote-only ref");
    assert!(!a.can_handle(&gpu, &theirs_ref), "GPU memory is never a local side");
    assert!(!a.can_handle(&theirs_ref, &gpu), "GPU memory is never a local side");
    let foreign = theirs_ref.clone();
    assert!(!b.can_handle(&foreign, &theirs2_ref), "b's own regions are local to b");

    let set = a.plan(&[
        item(&mine_ref, 0, &theirs_ref, 0, 4096, 1),
        item(&theirs_ref, 0, &mine_ref, 0, 4096, 2),
        item(&mine_ref, 0, &mine2_ref, 0, 4096, 3),
        item(&unregistered, 0, &theirs_ref, 0, 4096, 4),
        item(&mine_ref, 0, &theirs_ref, 1, 4096, 5), // out of range
        item(&mine_ref, 0, &theirs_ref, 0, 0, 6),    // empty: skipped
        item(&gpu, 0, &theirs_ref, 0, 64, 7),
        item(&unregistered, 1, &theirs_ref, 0, 4096, 8), // out of range of the unregistered ref
    ]);
    assert_eq!(set.rejected_tags, vec![3, 5, 7, 8]);
    let directions: Vec<TransferDirection> = set.plans.iter().map(|p| p.direction).collect();
    assert_eq!(directions, vec![TransferDirection::Push, TransferDirection::Pull, TransferDirection::Push]);

    // A deregistered local side is no longer handled: the ref still names this engine's region,
    // whose owner may have freed the memory — it is not taken as unregistered memory.
    a.deregister(&mine_ref);
    assert!(!a.can_handle(&mine_ref, &theirs_ref));
    assert!(!a.plan(&[item(&mine_ref, 0, &theirs_ref, 0, 4096, 9)]).rejected_tags.is_empty());
}

#[test]
fn submit_rechecks_hand_built_plans() {
    let mut mine = HostBuf::zeroed(4096);
    let mut theirs = HostBuf::zeroed(4096);
    let (a, b) = (engine(), engine());
    let mine_ref = mine.register(&a);
    let theirs_ref = theirs.register(&b);
    let mut plans = a.plan(&[item(&mine_ref, 0, &theirs_ref, 0, 4096, 1)]).plans;
    plans[0].segments[0].src_offset = 1; // now out of range locally
    let mut handle = a.submit(plans.clone()).expect("handle");
    let failures = handle.wait();
    assert_eq!(kinds(&failures), vec![FailureKind::Local]);
    assert!(handle.wait().is_empty(), "a second wait returns nothing");

    plans[0].segments[0].src_offset = 0;
    a.deregister(&mine_ref);
    let failures = a.submit(plans).expect("handle").wait();
    assert_eq!(kinds(&failures), vec![FailureKind::Local], "deregistered local side");
}

#[test]
fn dropping_an_unwaited_handle_drains_it() {
    const LEN: usize = 16 << 20;
    let mut src = HostBuf::with_pattern(LEN, 12);
    let mut remote = HostBuf::zeroed(LEN);
    let (a, b) = (engine(), engine());
    let src_ref = src.register(&a);
    let remote_ref = remote.register(&b);
    let handle = a.submit(a.plan(&[item(&src_ref, 0, &remote_ref, 0, LEN as u64, 1)]).plans).expect("submitted");
    drop(handle);
    assert!(remote.bytes() == src.bytes(), "drop waited for the work");
}

#[test]
fn gpu_memory_is_not_registered() {
    let a = engine();
    let mut buf = [0u8; 64];
    // SAFETY: never dereferenced: registration refuses it.
    let region =
        unsafe { LocalRegion::new(std::ptr::NonNull::from(&mut buf).cast(), 64, MemoryLocation::Gpu { device: 0 }) };
    assert!(matches!(a.register_memory(region), Err(RegistrationError::Unsupported { .. })));
}

#[test]
fn metrics_are_named_for_the_tcp_engine() {
    let mut src = HostBuf::with_pattern(4096, 13);
    let mut remote = HostBuf::zeroed(4096);
    let (a, b) = (engine(), engine());
    assert!(a.sample_metrics().is_empty(), "an unused engine publishes nothing");
    let src_ref = src.register(&a);
    let remote_ref = remote.register(&b);
    run(&a, &[item(&src_ref, 0, &remote_ref, 0, 4096, 1)]).expect("write");
    let _ = run(&a, &[item(&src_ref, 0, &oversized(&remote_ref, 8192), 4096, 4096, 2)]);
    let samples: Vec<_> = a.sample_metrics().into_iter().chain(b.sample_metrics()).collect();
    assert!(!samples.is_empty());
    assert!(samples.iter().all(|s| s.name.starts_with("umbp_transfer_tcp_")), "{samples:?}");
    // Every name is a public one (`umbp_core::metric_names`, re-exported by `umbp_metrics::names`).
    assert!(samples.iter().all(|s| umbp_core::metric_names::TRANSFER_TCP_ALL.contains(&s.name)), "{samples:?}");
    let by_status = |status: &str| {
        samples
            .iter()
            .find(|s| s.name == "umbp_transfer_tcp_server_requests_total" && s.labels[0].1 == status)
            .map(|s| s.value)
    };
    assert_eq!(by_status("ok"), Some(1));
    assert_eq!(by_status("out_of_range"), Some(1));
}

#[test]
fn forgetting_a_peer_reconnects_on_next_use() {
    let mut src = HostBuf::with_pattern(4096, 14);
    let mut remote = HostBuf::zeroed(4096);
    let (a, b) = (engine(), engine());
    let src_ref = src.register(&a);
    let remote_ref = remote.register(&b);
    let opened = |e: &umbp_transfer::TcpEngine| {
        e.sample_metrics()
            .iter()
            .find(|s| s.name == "umbp_transfer_tcp_connections_opened_total")
            .map_or(0, |s| s.value)
    };
    run(&a, &[item(&src_ref, 0, &remote_ref, 0, 4096, 1)]).expect("write");
    run(&a, &[item(&src_ref, 0, &remote_ref, 0, 4096, 1)]).expect("write again");
    let before = opened(&a);
    assert!(before >= 1);
    a.forget_peer(b.endpoint());
    run(&a, &[item(&src_ref, 0, &remote_ref, 0, 4096, 2)]).expect("write after forgetting");
    assert_eq!(opened(&a), before + 1, "a fresh connection");
    assert_eq!(remote.bytes(), src.bytes());
}

#[test]
fn a_silent_peer_times_out() {
    // A "server" that accepts the handshake, swallows requests and never answers.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = listener.local_addr().expect("addr").to_string();
    let silent = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut hello = [0u8; 8];
        s.read_exact(&mut hello).expect("hello");
        let mut answer = b"UMBP".to_vec();
        answer.extend_from_slice(&[1, 0, 0, 0]);
        s.write_all(&answer).expect("answer");
        s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    let config = umbp_transfer::TcpEngineConfig { io_timeout: Duration::from_secs(1), ..tcp_support::fast_config() };
    let mut src = HostBuf::with_pattern(4096, 15);
    let a = umbp_transfer::TcpEngine::new(config).expect("engine");
    let src_ref = src.register(&a);
    let remote =
        TransferRef::remote_only(RemoteRegion { endpoint: endpoint.clone(), region_id: 1 }, 4096, MemoryLocation::Host);
    let started = Instant::now();
    let failures = run(&a, &[item(&src_ref, 0, &remote, 0, 4096, 1)]).expect_err("no answer");
    assert_eq!(kinds(&failures), vec![FailureKind::Timeout]);
    assert_eq!(failures[0].endpoint, endpoint);
    assert!(started.elapsed() < Duration::from_secs(4), "bounded by the io timeout: {:?}", started.elapsed());
    drop(a);
    silent.join().expect("silent server");
}

#[test]
fn unregistered_caller_buffers_push_and_pull_byte_exact() {
    const PAGE: u64 = 64 << 10;
    // Caller memory registered with no engine: used in place as the local side.
    let mut src = HostBuf::with_pattern(8 * PAGE as usize, 21);
    let mut back = HostBuf::filled(8 * PAGE as usize + 100, 0x5A);
    let mut big = HostBuf::with_pattern(24 << 20, 22);
    let mut big_back = HostBuf::zeroed(24 << 20);
    let mut remote = HostBuf::zeroed(32 << 20);
    let (a, b) = (engine(), engine());
    let remote_ref = remote.register(&b);
    let (src_ref, back_ref) = (TransferRef::local(src.region()), TransferRef::local(back.region()));
    assert!(!src_ref.has_remote() && !back_ref.has_remote());

    // Pages reversed remotely, so nothing coalesces; then pulled back in place.
    let writes: Vec<TransferItem> =
        (0..8).map(|i| item(&src_ref, i * PAGE, &remote_ref, (7 - i) * PAGE, PAGE, i)).collect();
    let set = a.plan(&writes);
    assert!(set.rejected_tags.is_empty());
    assert_eq!(set.plans.len(), 1);
    assert_eq!(set.plans[0].direction, TransferDirection::Push);
    run(&a, &writes).expect("push from unregistered memory");
    for i in 0..8usize {
        let p = PAGE as usize;
        assert_eq!(&remote.bytes()[(7 - i) * p..(8 - i) * p], &src.bytes()[i * p..(i + 1) * p], "page {i}");
    }
    let reads: Vec<TransferItem> =
        (0..8).map(|i| item(&remote_ref, (7 - i) * PAGE, &back_ref, i * PAGE, PAGE, i)).collect();
    assert_eq!(a.plan(&reads).plans[0].direction, TransferDirection::Pull);
    run(&a, &reads).expect("pull into unregistered memory");
    assert_eq!(&back.bytes()[..8 * PAGE as usize], src.bytes());
    assert!(back.bytes()[8 * PAGE as usize..].iter().all(|&x| x == 0x5A), "bytes past the items are untouched");

    // One item larger than the engine's chunk size (split into several requests) both ways.
    let (big_ref, big_back_ref) = (TransferRef::local(big.region()), TransferRef::local(big_back.region()));
    run(&a, &[item(&big_ref, 0, &remote_ref, 8 << 20, 24 << 20, 1)]).expect("large push");
    run(&a, &[item(&remote_ref, 8 << 20, &big_back_ref, 0, 24 << 20, 1)]).expect("large pull");
    assert!(big_back.bytes() == big.bytes());
    assert_eq!(a.server().region_count(), 0, "nothing was registered on the caller's node");
}

#[test]
fn registered_and_unregistered_local_sides_share_a_batch() {
    let mut registered = HostBuf::with_pattern(8192, 23);
    let mut loose = HostBuf::with_pattern(8192, 24);
    let mut remote = HostBuf::zeroed(16384);
    let (a, b) = (engine(), engine());
    let (reg_ref, loose_ref) = (registered.register(&a), TransferRef::local(loose.region()));
    let remote_ref = remote.register(&b);
    let items = [item(&reg_ref, 0, &remote_ref, 0, 8192, 1), item(&loose_ref, 0, &remote_ref, 8192, 8192, 2)];
    assert_eq!(a.plan(&items).plans.len(), 2, "one plan per local buffer");
    run(&a, &items).expect("both local sides");
    assert_eq!(&remote.bytes()[..8192], registered.bytes());
    assert_eq!(&remote.bytes()[8192..], loose.bytes());
}

#[test]
fn unregistered_local_sides_are_bounded_by_the_ref_size() {
    let mut local = HostBuf::filled(8192, 0x33);
    let mut remote = HostBuf::with_pattern(8192, 25);
    let (a, b) = (engine(), engine());
    let remote_ref = remote.register(&b);
    // The caller hands out only the first 4 KiB of its buffer.
    let narrow = TransferRef::local(local.region()).truncated(4096);
    let set = a.plan(&[item(&remote_ref, 0, &narrow, 2048, 4096, 1), item(&remote_ref, 0, &narrow, 0, 4096, 2)]);
    assert_eq!(set.rejected_tags, vec![1], "planning bounds the item by the ref's size");
    // A hand-built plan reaching past the ref is refused at submit, before any byte moves.
    let mut plans = set.plans;
    plans[0].segments[0].dst_offset = 2048;
    let failures = a.submit(plans.clone()).expect("handle").wait();
    assert_eq!(kinds(&failures), vec![FailureKind::Local]);
    assert!(local.bytes().iter().all(|&x| x == 0x33), "nothing landed");
    plans[0].segments[0].dst_offset = 0;
    assert!(a.submit(plans).expect("handle").wait().is_empty());
    assert_eq!(&local.bytes()[..4096], &remote.bytes()[..4096]);
    assert!(local.bytes()[4096..].iter().all(|&x| x == 0x33), "nothing past the ref");
}

#[test]
fn dropping_an_unwaited_handle_over_unregistered_memory_drains_it() {
    const LEN: usize = 16 << 20;
    let mut remote = HostBuf::with_pattern(LEN, 26);
    let mut back = HostBuf::zeroed(LEN);
    let (a, b) = (engine(), engine());
    let remote_ref = remote.register(&b);
    let back_ref = TransferRef::local(back.region());
    let handle = a.submit(a.plan(&[item(&remote_ref, 0, &back_ref, 0, LEN as u64, 1)]).plans).expect("submitted");
    drop(handle);
    assert!(back.bytes() == remote.bytes(), "drop waited until the pull had landed");
}
