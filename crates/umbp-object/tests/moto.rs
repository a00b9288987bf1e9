//! The object medium against a real S3-compatible server (`moto_server` on a loopback port) and
//! the faults a remote store has: 503s (a proxy that answers them), a stalled store, a store that
//! stops and comes back empty, damaged objects, and a restart of the medium itself.

mod support;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use support::{Moto, Proxy, get, put, value};
use umbp_core::{AllocateRequest, CommitRequest, KvEvent, KvEventKind, MediumBackend};
use umbp_object::{ObjectBackend, ObjectConfig, ObjectConfigBuilder};
use umbp_testkit::LocalOnlyRegistrar;

const PAGE: u64 = 4096;
const BUCKET: &str = "faults";

fn config(endpoint: &str, prefix: &str) -> ObjectConfigBuilder {
    ObjectConfig::builder(format!("s3://{BUCKET}/{prefix}"))
        .endpoint(endpoint)
        .credentials(support::credentials())
        .page_size(PAGE)
        .capacity_bytes(256 * PAGE)
        .staging_pages(16)
        .max_value_pages(4)
        .io_threads(4)
        .backoff(Duration::from_millis(5))
        .backoff_max(Duration::from_millis(50))
}

fn live(builder: ObjectConfigBuilder) -> ObjectBackend {
    let b = ObjectBackend::new(builder.build().expect("valid config"));
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b
}

fn moto() -> Option<Moto> {
    let m = Moto::start()?;
    m.client(BUCKET).create_bucket();
    Some(m)
}

fn removes(events: &[KvEvent]) -> Vec<&str> {
    events.iter().filter(|e| e.kind == KvEventKind::Remove).map(|e| e.key.as_str()).collect()
}

/// Waits (bounded) until `f` holds.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn values_round_trip_byte_exact_through_the_store() {
    let Some(moto) = moto() else { return };
    let prefix = support::unique_prefix("round");
    let m = live(config(&moto.endpoint(), &prefix));
    let sizes = [1, 100, PAGE as usize, PAGE as usize + 1, 4 * PAGE as usize];
    for (i, n) in sizes.iter().enumerate() {
        assert_eq!(put(&m, &format!("k{i}"), &value(i as u64, *n)), Ok(true), "put k{i}");
    }
    assert_eq!(moto.client(BUCKET).list(&prefix).len(), sizes.len(), "one object per value");
    // Every read below downloads (no cached copy).
    m.drop_cached_copies();
    for (i, n) in sizes.iter().enumerate() {
        assert_eq!(get(&m, &format!("k{i}")), Ok(Some(value(i as u64, *n))), "k{i} byte-exact");
    }
    assert_eq!(get(&m, "absent"), Ok(None));
    // Evict deletes the object (in the background).
    assert_eq!(m.evict(&["k0".to_owned()])[0].bytes_freed, 1);
    eventually("the evicted key's object is deleted", || moto.client(BUCKET).list(&prefix).len() == sizes.len() - 1);
    m.shutdown();
}

#[test]
fn transient_503s_are_retried_and_the_calls_succeed() {
    let Some(moto) = moto() else { return };
    let proxy = Proxy::start(moto.port);
    let m = live(config(&proxy.endpoint(), &support::unique_prefix("retry")).retries(4));
    proxy.fail.store(3, Ordering::SeqCst);
    assert_eq!(put(&m, "k", &value(1, 5000)), Ok(true), "a commit through three 503s");
    assert_eq!(proxy.failed.load(Ordering::SeqCst), 3, "the three 503s were answered");
    m.drop_cached_copies();
    proxy.fail.store(2, Ordering::SeqCst);
    assert_eq!(get(&m, "k"), Ok(Some(value(1, 5000))), "a download through two 503s, byte-exact");
    assert_eq!(proxy.failed.load(Ordering::SeqCst), 5);
    assert!(m.stats().retries >= 5, "the medium retried each 503: {:?}", m.stats());
    m.shutdown();
}

#[test]
fn a_store_failing_past_the_retries_fails_the_commit_and_keeps_nothing() {
    let Some(moto) = moto() else { return };
    let proxy = Proxy::start(moto.port);
    let m = live(config(&proxy.endpoint(), &support::unique_prefix("fail")).retries(2));
    let before = (m.capacity(), m.stats().free_staging_pages);
    proxy.fail.store(1_000, Ordering::SeqCst);
    let t = Instant::now();
    assert_eq!(put(&m, "k", &value(2, 100)), Ok(false), "the commit fails once the retries are spent");
    assert!(t.elapsed() < Duration::from_secs(5), "bounded: {:?}", t.elapsed());
    assert_eq!(proxy.failed.load(Ordering::SeqCst), 3, "one attempt and two retries");
    assert_eq!((m.capacity(), m.stats().free_staging_pages), before, "the slot's bytes and pages came back");
    assert_eq!(m.owned_key_count(), 0);
    assert!(m.drain_pending_events().is_empty(), "no Add for a failed commit");
    // The store recovers: the same key goes in.
    proxy.fail.store(0, Ordering::SeqCst);
    assert_eq!(put(&m, "k", &value(2, 100)), Ok(true));
    m.shutdown();
}

#[test]
fn a_stalled_store_blocks_only_the_calls_that_need_it() {
    let Some(moto) = moto() else { return };
    let proxy = Proxy::start(moto.port);
    let prefix = support::unique_prefix("stall");
    let m = Arc::new(live(config(&proxy.endpoint(), &prefix).op_timeout(Duration::from_secs(1)).retries(0)));
    assert_eq!(put(m.as_ref(), "cached", &value(3, 10)), Ok(true));
    proxy.stall.store(true, Ordering::SeqCst);
    let before = proxy.received.load(Ordering::SeqCst);
    let writer = {
        let m = Arc::clone(&m);
        std::thread::spawn(move || {
            let t = Instant::now();
            (put(m.as_ref(), "slow", &value(4, 10)), t.elapsed())
        })
    };
    eventually("the upload reaches the stalled store", || proxy.received.load(Ordering::SeqCst) > before);
    // Meanwhile every call that needs no store answers at once.
    let t = Instant::now();
    assert_eq!(m.batch_contains(&["cached".to_owned(), "slow".to_owned()]), [true, false]);
    assert_eq!(get(m.as_ref(), "cached"), Ok(Some(value(3, 10))), "a cached copy is served without the store");
    let other = m.batch_allocate(&[AllocateRequest::new("other", 10)]).remove(0);
    assert!(m.batch_abort(&[other.slot_id])[0]);
    let _ = m.capacity();
    assert!(t.elapsed() < Duration::from_millis(500), "calls waited on the stalled upload: {:?}", t.elapsed());
    let (outcome, took) = writer.join().expect("writer");
    assert_eq!(outcome, Ok(false), "the stalled commit answers failed at op_timeout");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "op_timeout bounds it: {took:?}");
    // The upload lands once the store answers; the medium does not publish it and deletes it.
    proxy.stall.store(false, Ordering::SeqCst);
    eventually("the abandoned upload's object is deleted", || {
        moto.client(BUCKET).list(&prefix).iter().all(|n| !n.starts_with(&format!("{prefix}/736c6f77")))
    });
    assert!(!m.batch_contains(&["slow".to_owned()])[0], "an abandoned commit never becomes a key");
    eventually("its staging pages came back", || m.stats().free_staging_pages == 16 - 1);
    m.shutdown();
}

#[test]
fn a_resolve_with_every_staging_page_held_is_busy_not_a_miss() {
    let Some(moto) = moto() else { return };
    let m = live(config(&moto.endpoint(), &support::unique_prefix("busy")).staging_pages(1).max_value_pages(1));
    assert_eq!(put(&m, "a", b"aaa"), Ok(true));
    assert_eq!(put(&m, "b", b"bbb"), Ok(true));
    m.drop_cached_copies();
    let held = m.batch_resolve(&["a".to_owned()], false).remove(0);
    assert!(held.found, "the one page now holds a, leased");
    let b = m.batch_resolve(&["b".to_owned()], false).remove(0);
    assert!(b.busy && !b.found, "b is owned but cannot be staged: busy, not a miss: {b:?}");
    m.release_reads(&[umbp_core::ReadRelease::new("a", held.lease)]);
    assert_eq!(get(&m, "b"), Ok(Some(b"bbb".to_vec())), "the released page serves b");
    m.shutdown();
}

#[test]
fn a_store_that_stops_and_comes_back_empty_answers_misses_never_wrong_bytes() {
    let Some(mut moto) = moto() else { return };
    let m = live(config(&moto.endpoint(), &support::unique_prefix("restart")).retries(1));
    for i in 0..4 {
        assert_eq!(put(&m, &format!("k{i}"), &value(10 + i, 3000)), Ok(true));
    }
    let _ = m.drain_pending_events();
    m.drop_cached_copies();
    // Down: reads miss and writes fail, promptly.
    moto.kill();
    let t = Instant::now();
    assert_eq!(get(&m, "k0"), Ok(None), "an unreachable store is a miss");
    assert_eq!(put(&m, "new", b"x"), Ok(false), "and a failed commit");
    assert!(t.elapsed() < Duration::from_secs(5), "bounded: {:?}", t.elapsed());
    assert_eq!(m.owned_key_count(), 4, "an unreachable store loses no key: it may come back");
    // Back, but empty (moto keeps nothing): the keys are gone, and the master is told.
    moto.restart();
    moto.client(BUCKET).create_bucket();
    for i in 0..4 {
        assert_eq!(get(&m, &format!("k{i}")), Ok(None), "k{i}: a lost object is a miss");
    }
    assert_eq!(m.owned_key_count(), 0, "lost values are dropped");
    let events = m.drain_pending_events();
    let mut gone = removes(&events);
    gone.sort_unstable();
    assert_eq!(gone, ["k0", "k1", "k2", "k3"], "one Remove per lost key");
    // And it serves new values again.
    assert_eq!(put(&m, "k0", &value(99, 10)), Ok(true));
    m.drop_cached_copies();
    assert_eq!(get(&m, "k0"), Ok(Some(value(99, 10))));
    m.shutdown();
}

#[test]
fn a_restarted_medium_reindexes_its_prefix_and_skips_damaged_objects() {
    let Some(moto) = moto() else { return };
    let prefix = support::unique_prefix("recover");
    let a = live(config(&moto.endpoint(), &prefix));
    for i in 0..5 {
        assert_eq!(put(&a, &format!("k{i}"), &value(20 + i, 5000)), Ok(true));
    }
    // One value committed with the writer's checksum: it survives the restart too.
    let slot = a.batch_allocate(&[AllocateRequest::new("sum", 1)]).remove(0);
    assert!(a.batch_commit(&[CommitRequest::new(slot.slot_id, "sum").with_crc32c(Some(0xabcd))])[0].success);
    a.shutdown();
    let raw = moto.client(BUCKET);
    let names = raw.list(&prefix);
    assert_eq!(names.len(), 6);
    let name_of = |key: &str| {
        let hex: String = key.bytes().map(|b| format!("{b:02x}")).collect();
        names.iter().find(|n| n.starts_with(&format!("{prefix}/{hex}."))).expect("the key's object").clone()
    };
    // k1: a damaged head; k2: a damaged value; and a foreign object the medium must leave alone.
    let mut k1 = raw.get(&name_of("k1")).expect("k1");
    k1[5] ^= 0xff;
    raw.put(&name_of("k1"), &k1);
    let mut k2 = raw.get(&name_of("k2")).expect("k2");
    let last = k2.len() - 1;
    k2[last] ^= 0x01;
    raw.put(&name_of("k2"), &k2);
    raw.put(&format!("{prefix}/README"), b"not a value");

    let b = live(config(&moto.endpoint(), &prefix));
    assert_eq!(b.owned_key_count(), 5, "every object but the damaged head is re-indexed");
    let mut keys: Vec<String> = b.snapshot_owned_keys().into_iter().map(|e| e.key).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["k0", "k2", "k3", "k4", "sum"]);
    for i in [0, 3, 4] {
        assert_eq!(get(&b, &format!("k{i}")), Ok(Some(value(20 + i, 5000))), "k{i} byte-exact after the restart");
    }
    assert_eq!(get(&b, "k2"), Ok(None), "a damaged value is a miss, never wrong bytes");
    assert_eq!(removes(&b.drain_pending_events()), ["k2"], "and its key is dropped");
    let sum = b.batch_resolve(&["sum".to_owned()], false).remove(0);
    assert_eq!(sum.crc32c, Some(0xabcd), "the writer's checksum survives the restart");
    b.release_reads(&[umbp_core::ReadRelease::new("sum", sum.lease)]);
    b.shutdown();
    assert!(raw.get(&format!("{prefix}/README")).is_some(), "a foreign object is left alone");
}
