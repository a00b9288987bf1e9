//! `SsdBackend` behaviour beyond the conformance suite: staging pages come back, single-flight
//! reads, eviction, restart recovery, corruption and torn tails, reclaim of dead space, several
//! drives, released reads and the pinned staging-exhaustion answer (busy). Bytes move through the published arena, the
//! way the transfer layer would move them.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use umbp_core::{
    AllocateOutcome, AllocateRequest, CommitRequest, KvEvent, ManualClock, MediumBackend, MetricKind, MetricSource,
    ReadRelease, ResolvedEntry, TierType, metric_names,
};
use umbp_ssd::{IoEngineKind, SsdBackend, SsdConfig, SsdConfigBuilder, Watermarks};
use umbp_testkit::{LocalOnlyRegistrar, require};

const PAGE: u64 = 4096;

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-ssd-test").tempdir_in(std::env::temp_dir()).expect("tempdir")
}

fn builder(dirs: &[&Path]) -> SsdConfigBuilder {
    SsdConfig::builder(dirs.iter().map(|d| d.to_path_buf()))
        .page_size(PAGE)
        .capacity_bytes(64 * PAGE)
        // Room for every read lease a test takes (leases run on the system clock unless a test
        // injects one).
        .staging_pages(64)
        .segment_bytes(256 * 1024)
}

/// The engines to run a test body with: psync always, io_uring where the kernel allows it.
fn engines() -> Vec<IoEngineKind> {
    match umbp_ssd::io_uring_available() {
        Ok(()) => vec![IoEngineKind::Psync, IoEngineKind::IoUring],
        Err(e) => {
            require::skip(
                require::IO_URING,
                format_args!("the io_uring variant: io_uring is not available here ({e})"),
            );
            vec![IoEngineKind::Psync]
        }
    }
}

fn live(config: SsdConfig) -> Arc<SsdBackend> {
    let b = Arc::new(SsdBackend::new(config));
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b
}

/// A value that prints as its length and checksum, not its bytes.
#[derive(Clone, PartialEq, Eq)]
struct Bytes(Vec<u8>);

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sum = self.0.iter().fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
        write!(f, "Bytes(len {}, sum {sum:x})", self.0.len())
    }
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

fn value(seed: u64, len: usize) -> Bytes {
    Bytes(raw_value(seed, len))
}

fn raw_value(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn arena(b: &SsdBackend) -> (*mut u8, u64) {
    let r = b.buffer_ref(0).expect("a live backend publishes its arena");
    let region = *r.local_region().expect("a local region");
    (region.ptr().as_ptr(), region.len())
}

/// Allocates, copies `bytes` into the staging pages and commits, like a writer would.
fn put(b: &SsdBackend, key: &str, bytes: &[u8]) -> AllocateOutcome {
    let a = b.batch_allocate(&[AllocateRequest::new(key, bytes.len() as u64)]).remove(0);
    if a.outcome != AllocateOutcome::Allocated {
        return a.outcome;
    }
    let (base, len) = arena(b);
    for (chunk, page) in bytes.chunks(PAGE as usize).zip(&a.pages) {
        let off = u64::from(page.page_index) * PAGE;
        assert!(off + chunk.len() as u64 <= len);
        // SAFETY: the page is inside the registered arena and reserved for this slot.
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), base.add(off as usize), chunk.len()) };
    }
    let c = b.batch_commit(&[CommitRequest::new(a.slot_id, key)]);
    assert!(c[0].success, "commit of {key}");
    AllocateOutcome::Allocated
}

fn resolve(b: &SsdBackend, key: &str) -> ResolvedEntry {
    b.batch_resolve(&[key.to_owned()], true).remove(0)
}

/// [`get`], then the release a reader sends once its copy is done.
fn get_and_release(b: &SsdBackend, key: &str) -> Option<Bytes> {
    let r = resolve(b, key);
    let bytes = copy_out(b, &r);
    b.release_reads(&[ReadRelease::new(key, r.lease)]);
    bytes
}

/// Resolves and copies the value out of its staging pages, like a reader would (the lease is
/// left to expire).
fn get(b: &SsdBackend, key: &str) -> Option<Bytes> {
    copy_out(b, &resolve(b, key))
}

fn copy_out(b: &SsdBackend, r: &ResolvedEntry) -> Option<Bytes> {
    if !r.found {
        return None;
    }
    let (base, _) = arena(b);
    let mut out = Vec::with_capacity(r.size as usize);
    let mut remaining = r.size;
    for page in &r.pages {
        let n = remaining.min(PAGE);
        let off = u64::from(page.page_index) * PAGE;
        // SAFETY: the page is inside the arena and leased to this reader.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(base.add(off as usize), n as usize) });
        remaining -= n;
    }
    Some(Bytes(out))
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .expect("read_dir")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("segment_")))
        .collect();
    v.sort();
    v
}

#[test]
fn two_staging_pages_take_ten_sequential_puts() {
    for cache in [true, false] {
        let dir = tempdir();
        let clock = ManualClock::new();
        let b = live(
            builder(&[dir.path()])
                .staging_pages(2)
                .cache_committed(cache)
                .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
                .build()
                .expect("config"),
        );
        for i in 0..10 {
            assert_eq!(
                put(&b, &format!("k{i}"), &value(i, 3000)),
                AllocateOutcome::Allocated,
                "put {i} (cache {cache})"
            );
        }
        // Each read leases a staging page; once its lease ends the page serves the next read.
        for i in 0..10 {
            assert_eq!(get(&b, &format!("k{i}")), Some(value(i, 3000)), "get {i}");
            clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
        }
        assert_eq!(b.owned_key_count(), 10);
    }
}

#[test]
fn keys_larger_than_a_page_are_failed_not_no_space() {
    let dir = tempdir();
    let b = live(builder(&[dir.path()]).build().expect("config"));
    let r = b.batch_allocate(&[AllocateRequest::new("big", PAGE + 1), AllocateRequest::new("ok", PAGE)]);
    assert_eq!(r[0].outcome, AllocateOutcome::Failed);
    assert_eq!(r[1].outcome, AllocateOutcome::Allocated);
    assert_eq!(r[1].pages.len(), 1);
    assert_eq!(b.capacity().total_bytes, 64 * PAGE, "capacity is the drive's, not the 8-page arena's");
}

#[test]
fn concurrent_resolves_of_one_key_read_the_drive_once() {
    for engine in engines() {
        let dir = tempdir();
        let b = live(
            builder(&[dir.path()])
                .io_engine(engine)
                .max_value_pages(4)
                // Long enough that no follower gives up waiting on a loaded machine (the follower
                // wait is capped at half the lease); each round releases its readers' leases.
                .read_lease_ttl(Duration::from_secs(10))
                .build()
                .expect("config"),
        );
        let v = value(7, 3 * PAGE as usize + 100);
        put(&b, "hot", &v);
        for round in 0..5 {
            b.drop_cached_copies();
            let before = b.stats().device_reads;
            let n = 8;
            let barrier = Arc::new(Barrier::new(n));
            let readers: Vec<_> = (0..n)
                .map(|_| {
                    let (b, barrier) = (Arc::clone(&b), Arc::clone(&barrier));
                    std::thread::spawn(move || {
                        barrier.wait();
                        b.batch_resolve(&["hot".to_owned()], false).remove(0)
                    })
                })
                .collect();
            let entries: Vec<_> = readers.into_iter().map(|t| t.join().expect("reader")).collect();
            assert!(entries.iter().all(|e| e.found && e.size == v.len() as u64), "{engine}: every reader hits");
            assert!(entries.windows(2).all(|w| w[0].pages == w[1].pages), "{engine}: one staged copy for all");
            assert_eq!(b.stats().device_reads - before, 1, "{engine} round {round}: one drive read for {n} readers");
            assert_eq!(get_and_release(&b, "hot"), Some(v.clone()));
            // Every reader is done: release, so the next round can drop the staged copy.
            let releases: Vec<ReadRelease> = entries.iter().map(|e| ReadRelease::new("hot", e.lease)).collect();
            b.release_reads(&releases);
        }
    }
}

/// The negative control of `concurrent_resolves_of_one_key_read_the_drive_once`: with single
/// flight off, the same concurrent readers do read the drive more than once (so the test above
/// measures the coalescing, not a race the readers happen to lose).
#[test]
fn without_single_flight_concurrent_resolves_read_the_drive_more_than_once() {
    let dir = tempdir();
    let b = live(
        builder(&[dir.path()])
            .max_value_pages(4)
            .single_flight(false)
            .read_lease_ttl(Duration::from_millis(30))
            .build()
            .expect("config"),
    );
    let v = value(7, 4 * PAGE as usize);
    put(&b, "hot", &v);
    let (rounds, n) = (20, 8);
    let before = b.stats().device_reads;
    for _ in 0..rounds {
        b.drop_cached_copies();
        let barrier = Arc::new(Barrier::new(n));
        let readers: Vec<_> = (0..n)
            .map(|_| {
                let (b, barrier) = (Arc::clone(&b), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    b.batch_resolve(&["hot".to_owned()], false).remove(0)
                })
            })
            .collect();
        let entries: Vec<_> = readers.into_iter().map(|t| t.join().expect("reader")).collect();
        assert!(entries.iter().all(|e| e.found), "every reader hits");
        assert_eq!(get(&b, "hot"), Some(v.clone()));
        drop_leases(&b);
    }
    let reads = b.stats().device_reads - before;
    assert!(reads > rounds, "{reads} drive reads for {rounds} rounds of {n} readers without single flight");
    assert_eq!(b.stats().single_flight_merged, 0);
}

/// Waits out every read lease (the backend runs on the system clock with a short lease).
fn drop_leases(b: &SsdBackend) {
    std::thread::sleep(b.config().read_lease_ttl() + Duration::from_millis(5));
    b.reaper_tick();
}

#[test]
fn resolve_with_every_staging_page_leased_is_busy_not_a_miss() {
    let dir = tempdir();
    let clock = ManualClock::new();
    let b = live(
        builder(&[dir.path()])
            .staging_pages(2)
            .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
            .build()
            .expect("config"),
    );
    for (i, k) in ["a", "b", "c"].iter().enumerate() {
        put(&b, k, &value(i as u64, 100));
    }
    b.drop_cached_copies();
    let a = resolve(&b, "a");
    assert!(a.found && resolve(&b, "b").found, "two leased reads fill both staging pages");
    // The key is here, but no staging page is free: busy (retry this node), never a miss, counted
    // as staging_slot_full_reject.
    let c = resolve(&b, "c");
    assert!(c.busy && !c.found, "staging exhausted on resolve is busy: {c:?}");
    assert_eq!(c, umbp_core::ResolvedEntry::busy(), "a busy answer carries nothing else");
    assert_eq!(b.stats().staging_full_rejects, 1);
    assert_eq!(b.owned_key_count(), 3, "the key was not dropped");
    let rejects = b
        .sample_metrics()
        .into_iter()
        .find(|m| m.labels.iter().any(|(k, v)| k == "event" && v == "staging_slot_full_reject"))
        .expect("the reject is a medium event");
    assert_eq!((rejects.name, rejects.value), (metric_names::MEDIUM_EVENTS_TOTAL, 1));
    assert!(!resolve(&b, "never-stored").busy, "an unknown key is a miss, not busy");
    // Allocation is busy (the drive has room) while every page is leased.
    assert_eq!(put(&b, "d", &value(9, 10)), AllocateOutcome::Busy);
    // The reader of "a" is done: its page serves "c" at once, with no lease expiry.
    b.release_reads(&[ReadRelease::new("a", a.lease)]);
    assert_eq!(b.stats().leases_released, 1);
    assert_eq!(get(&b, "c"), Some(value(2, 100)), "a released page serves the next read");
    clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
    b.reaper_tick();
    assert_eq!(put(&b, "d", &value(9, 10)), AllocateOutcome::Allocated, "once the leases end, a put fits");
}

#[test]
fn released_reads_let_sixteen_staging_pages_serve_any_number_of_reads_and_puts() {
    // No clock moves: only releases give pages back. On the code before releases this wedged after
    // 16 reads (a miss for the 17th and no room for a put).
    let dir = tempdir();
    let clock = ManualClock::new();
    let b = live(
        builder(&[dir.path()])
            .staging_pages(16)
            .capacity_bytes(512 * PAGE)
            .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
            .build()
            .expect("config"),
    );
    for i in 0..200u64 {
        put(&b, &format!("k{i}"), &value(i, 3000));
    }
    b.drop_cached_copies();
    for i in 0..200u64 {
        let key = format!("k{i}");
        assert_eq!(get_and_release(&b, &key), Some(value(i, 3000)), "read {i}");
        if i % 10 == 0 {
            assert_eq!(
                put(&b, &format!("p{i}"), &value(1000 + i, 100)),
                AllocateOutcome::Allocated,
                "put after read {i}"
            );
        }
    }
    assert_eq!(b.stats().staging_full_rejects, 0, "no read ever found the arena full");
    assert!(b.stats().leases_released >= 200);
}

#[test]
fn a_staged_copy_read_by_two_readers_stays_leased_until_both_release() {
    let dir = tempdir();
    let clock = ManualClock::new();
    let b = live(
        builder(&[dir.path()])
            .staging_pages(1)
            .max_value_pages(1)
            .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
            .build()
            .expect("config"),
    );
    put(&b, "a", &value(1, 100));
    put(&b, "b", &value(2, 100));
    b.drop_cached_copies();
    let first = resolve(&b, "a");
    let second = resolve(&b, "a");
    assert!(first.found && second.found);
    assert_eq!((first.pages.clone(), first.lease), (second.pages.clone(), second.lease), "one copy, one lease");
    b.release_reads(&[ReadRelease::new("a", first.lease)]);
    assert!(resolve(&b, "b").busy, "the second reader still copies out of the only page");
    // A second release of the same hit is a reader bug; the contract is once per hit. Releasing
    // an unknown lease or key changes nothing.
    b.release_reads(&[ReadRelease::new("a", first.lease + 99), ReadRelease::new("zz", first.lease)]);
    assert!(resolve(&b, "b").busy, "stale or unknown releases end nothing");
    b.release_reads(&[ReadRelease::new("a", second.lease)]);
    assert_eq!(get_and_release(&b, "b"), Some(value(2, 100)), "the last release frees the page");
}

#[test]
fn a_late_release_of_a_lapsed_lease_leaves_the_next_readers_lease_alone() {
    let dir = tempdir();
    let clock = ManualClock::new();
    let b = live(
        builder(&[dir.path()])
            .staging_pages(1)
            .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
            .build()
            .expect("config"),
    );
    put(&b, "a", &value(1, 100));
    put(&b, "b", &value(2, 100));
    b.drop_cached_copies();
    let slow = resolve(&b, "a");
    clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
    b.reaper_tick();
    let next = resolve(&b, "a");
    assert!(next.found);
    assert_ne!(slow.lease, next.lease, "a lapsed lease is not reused");
    b.release_reads(&[ReadRelease::new("a", slow.lease)]);
    assert!(resolve(&b, "b").busy, "the late release did not end the live reader's lease");
    b.release_reads(&[ReadRelease::new("a", next.lease)]);
    assert!(resolve(&b, "b").found);
}

#[test]
fn a_key_cleared_under_a_reader_frees_its_staging_page_at_the_release() {
    let dir = tempdir();
    let clock = ManualClock::new();
    let b = live(
        builder(&[dir.path()])
            .staging_pages(1)
            .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
            .build()
            .expect("config"),
    );
    put(&b, "a", &value(1, 100));
    put(&b, "b", &value(2, 100));
    b.drop_cached_copies();
    let a = resolve(&b, "a");
    b.clear_local();
    b.clear_full_sync_acked();
    put_expect_busy(&b, "c");
    b.release_reads(&[ReadRelease::new("a", a.lease)]);
    assert_eq!(put(&b, "c", &value(3, 100)), AllocateOutcome::Allocated, "the deferred page came back at the release");
}

#[test]
fn an_existence_check_reads_no_drive_and_takes_no_staging_page() {
    let dir = tempdir();
    let clock = ManualClock::new();
    let b = live(
        builder(&[dir.path()])
            .staging_pages(1)
            .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
            .build()
            .expect("config"),
    );
    put(&b, "a", &value(1, 100));
    put(&b, "b", &value(2, 100));
    b.drop_cached_copies();
    let reads = b.stats().device_reads;
    assert_eq!(b.batch_contains(&["a".to_owned(), "b".to_owned(), "c".to_owned()]), [true, true, false]);
    assert_eq!(b.stats().device_reads, reads, "contains read the drive");
    assert_eq!(get_and_release(&b, "b"), Some(value(2, 100)), "the only staging page is still free");
}

fn put_expect_busy(b: &SsdBackend, key: &str) {
    assert_eq!(put(b, key, &value(7, 100)), AllocateOutcome::Busy, "the reader still holds the only page");
}

/// Writes `bytes` into the pages of an allocated slot `a` and commits it under `key`.
fn fill_and_commit(b: &SsdBackend, a: &umbp_core::AllocateResult, key: &str, bytes: &[u8]) {
    assert_eq!(a.outcome, AllocateOutcome::Allocated, "{key}");
    let (base, len) = arena(b);
    for (chunk, page) in bytes.chunks(PAGE as usize).zip(&a.pages) {
        let off = u64::from(page.page_index) * PAGE;
        assert!(off + chunk.len() as u64 <= len);
        // SAFETY: the page is inside the registered arena and reserved for this slot.
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), base.add(off as usize), chunk.len()) };
    }
    assert!(b.batch_commit(&[CommitRequest::new(a.slot_id, key)])[0].success, "commit of {key}");
}

#[test]
fn allocate_with_every_staging_page_held_is_busy_while_a_full_drive_is_no_space() {
    let dir = tempdir();
    let clock = ManualClock::new();
    let b = live(
        builder(&[dir.path()])
            .staging_pages(4)
            .clock(Arc::clone(&clock) as Arc<dyn umbp_core::Clock>)
            .build()
            .expect("config"),
    );
    // A batch of six on four staging pages: four slots, and busy for the rest (the drive has room
    // for all six). Before, the rest was FailedNoSpace, and a writer went looking elsewhere.
    let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
    let reqs: Vec<AllocateRequest> = keys.iter().map(|k| AllocateRequest::new(k.clone(), 100)).collect();
    let first = b.batch_allocate(&reqs);
    let outcomes: Vec<AllocateOutcome> = first.iter().map(|a| a.outcome).collect();
    assert_eq!(outcomes[..4], [AllocateOutcome::Allocated; 4]);
    assert_eq!(outcomes[4..], [AllocateOutcome::Busy; 2], "staging exhausted with room on the drive is busy");
    assert!(first[4].pages.is_empty() && first[4].slot_id == 0, "busy reserves nothing");
    assert_eq!(b.capacity().available_bytes, 60 * PAGE, "only the four slots are reserved");
    assert_eq!(b.stats().staging_busy_allocations, 2);
    let busy = b
        .sample_metrics()
        .into_iter()
        .find(|m| m.labels.iter().any(|(k, v)| k == "event" && v == "staging_allocate_busy"))
        .expect("a busy allocation is a medium event");
    assert_eq!((busy.name, busy.value), (metric_names::MEDIUM_EVENTS_TOTAL, 2));
    // The writer commits what it got; its pages come back (as clean cached copies, which a
    // writer may take), and the busy keys fit when asked again.
    for (i, a) in first[..4].iter().enumerate() {
        fill_and_commit(&b, a, &keys[i], &value(i as u64, 100));
    }
    let again = b.batch_allocate(&reqs[4..]);
    for (j, a) in again.iter().enumerate() {
        fill_and_commit(&b, a, &keys[4 + j], &value(4 + j as u64, 100));
    }
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(get_and_release(&b, k), Some(value(i as u64, 100)), "{k} reads back byte-exact");
    }
    // Readers holding every staging page make a writer busy too, until one releases.
    b.drop_cached_copies();
    let held: Vec<ResolvedEntry> = keys[..4].iter().map(|k| resolve(&b, k)).collect();
    assert!(held.iter().all(|e| e.found));
    assert_eq!(put(&b, "w", &value(9, 100)), AllocateOutcome::Busy, "four readers hold the four pages");
    b.release_reads(&[ReadRelease::new(keys[0].clone(), held[0].lease)]);
    assert_eq!(put(&b, "w", &value(9, 100)), AllocateOutcome::Allocated, "a released page takes the write");
    assert_eq!(b.owned_key_count(), 7, "no key was dropped for the busy answers");

    // A full drive is FailedNoSpace, never busy, whatever the staging arena has free.
    let dir = tempdir();
    let b = live(builder(&[dir.path()]).capacity_bytes(2 * PAGE).watermarks(None).build().expect("config"));
    assert_eq!(put(&b, "a", &value(1, 10)), AllocateOutcome::Allocated);
    assert_eq!(put(&b, "b", &value(2, 10)), AllocateOutcome::Allocated);
    assert_eq!(put(&b, "c", &value(3, 10)), AllocateOutcome::FailedNoSpace, "full is no space, not busy");
    let batch = b.batch_allocate(&[AllocateRequest::new("d", 10), AllocateRequest::new("e", 10)]);
    assert!(batch.iter().all(|a| a.outcome == AllocateOutcome::FailedNoSpace), "a batch too: {batch:?}");
    assert_eq!(b.stats().staging_busy_allocations, 0);
}

#[test]
fn eviction_under_pressure_keeps_the_newest_keys_and_reports_removes() {
    let dir = tempdir();
    let b = live(
        builder(&[dir.path()])
            .capacity_bytes(8 * PAGE)
            .watermarks(Some(Watermarks { high: 0.9, low: 0.5 }))
            .build()
            .expect("config"),
    );
    for i in 0..20 {
        assert_eq!(put(&b, &format!("k{i:02}"), &value(i, 1000)), AllocateOutcome::Allocated, "put {i}");
        assert!(b.capacity().available_bytes <= b.capacity().total_bytes);
    }
    let owned = b.owned_key_count();
    assert!((1..=8).contains(&owned), "{owned} keys on an 8-page drive");
    assert_eq!(get(&b, "k19"), Some(value(19, 1000)), "the newest key stays");
    assert_eq!(get(&b, "k00"), None, "the oldest key went");
    let events = b.drain_pending_events();
    let removes: Vec<&KvEvent> = events.iter().filter(|e| e.kind == umbp_core::KvEventKind::Remove).collect();
    assert_eq!(removes.len(), 20 - owned, "one Remove per evicted key");
    assert!(b.stats().evicted as usize == 20 - owned);
}

#[test]
fn full_drive_with_a_leased_key_evicts_around_it_or_reports_no_space() {
    let dir = tempdir();
    let b = live(
        builder(&[dir.path()])
            .capacity_bytes(2 * PAGE)
            .watermarks(Some(Watermarks { high: 1.0, low: 0.5 }))
            .build()
            .expect("config"),
    );
    put(&b, "a", &value(1, 10));
    assert_eq!(get(&b, "a"), Some(value(1, 10)), "a is leased by a reader");
    put(&b, "b", &value(2, 10));
    assert_eq!(b.capacity().available_bytes, 0, "the drive is full: a is leased, b was just written");
    assert_eq!(b.owned_key_count(), 2);
    assert_eq!(put(&b, "c", &value(3, 10)), AllocateOutcome::Allocated, "room is made around the lease");
    assert_eq!(get(&b, "a"), Some(value(1, 10)), "the leased key survived");
    assert_eq!(get(&b, "b"), None, "the unleased key was the victim");
    assert_eq!(get(&b, "c"), Some(value(3, 10)));
    assert_eq!(b.evict(&["a".to_owned()])[0].bytes_freed, 0, "a leased key cannot be evicted");
    assert_eq!(b.drain_pending_events().iter().filter(|e| e.kind == umbp_core::KvEventKind::Remove).count(), 1);

    // Without eviction of its own, a full drive whose only key is leased says FailedNoSpace.
    let dir = tempdir();
    let b = live(builder(&[dir.path()]).capacity_bytes(PAGE).watermarks(None).build().expect("config"));
    put(&b, "a", &value(1, 10));
    assert!(get(&b, "a").is_some());
    assert_eq!(put(&b, "b", &value(2, 10)), AllocateOutcome::FailedNoSpace);
    assert_eq!(get(&b, "a"), Some(value(1, 10)));
}

#[test]
fn restart_recovers_every_key_byte_exact() {
    for engine in engines() {
        let dirs = [tempdir(), tempdir()];
        let paths: Vec<&Path> = dirs.iter().map(|d| d.path()).collect();
        let config = || builder(&paths).io_engine(engine).max_value_pages(4).build().expect("config");
        let b = live(config());
        let values: Vec<(String, Bytes)> =
            (0..12).map(|i| (format!("key-{i}"), value(i, 1 + (i as usize * 1237) % (4 * PAGE as usize)))).collect();
        for (k, v) in &values {
            put(&b, k, v);
        }
        assert_eq!(b.evict(&["key-3".to_owned()])[0].bytes_freed, values[3].1.len() as u64);
        put(&b, "key-3", &value(99, 77));
        b.shutdown();
        drop(b);
        assert!(paths.iter().all(|p| !segments(p).is_empty()), "{engine}: both directories hold segments");

        let b = live(config());
        assert_eq!(b.owned_key_count(), 12, "{engine}: every key recovered");
        assert_eq!(b.stats().recovered, 13, "{engine}: 13 records, one superseded");
        let mut snapshot = b.snapshot_owned_keys_for_full_sync();
        snapshot.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(snapshot.len(), 12, "recovered keys are announced in the full sync");
        assert!(snapshot.iter().all(|e| e.tier == TierType::Ssd && e.kind == umbp_core::KvEventKind::Add));
        for (k, v) in &values {
            let expect = if k == "key-3" { value(99, 77) } else { v.clone() };
            assert_eq!(get(&b, k), Some(expect), "{engine}: {k} after restart (newest record wins)");
        }
        put(&b, "after", &value(5, 5));
        assert_eq!(get(&b, "after"), Some(value(5, 5)));
    }
}

#[test]
fn a_corrupted_byte_is_a_counted_miss_never_wrong_bytes() {
    let dir = tempdir();
    let config = || builder(&[dir.path()]).build().expect("config");
    let b = live(config());
    put(&b, "good", &value(1, 3000));
    put(&b, "bad", &value(2, 3000));
    b.drain_pending_events();
    b.drop_cached_copies();
    // The second record starts at 8 KiB (4 KiB header + 4 KiB value); flip a value byte.
    let seg = segments(dir.path()).remove(0);
    let mut bytes = fs::read(&seg).expect("read segment");
    bytes[8192 + 4096 + 100] ^= 0x40;
    fs::write(&seg, &bytes).expect("write segment");
    assert_eq!(get(&b, "bad"), None, "a corrupt record is a miss");
    assert_eq!(b.stats().corrupt_reads, 1, "counted");
    assert_eq!(b.drain_pending_events(), [KvEvent::remove("bad", TierType::Ssd)], "the master hears of it");
    assert!(
        b.sample_metrics().iter().any(|m| m.kind == MetricKind::Counter
            && m.labels.iter().any(|(k, v)| k == "event" && v == "device_read_corrupt"))
    );
    assert_eq!(get(&b, "good"), Some(value(1, 3000)), "the neighbour is intact");
    assert_eq!(get(&b, "bad"), None, "still a miss");
    b.shutdown();
    drop(b);
    // At restart the scan verifies every CRC: the corrupt record is skipped, the rest recovered.
    let b = live(config());
    assert_eq!(b.owned_key_count(), 1);
    assert_eq!(b.stats().recovery_corrupt, 1);
    assert_eq!(get(&b, "good"), Some(value(1, 3000)));
    assert_eq!(get(&b, "bad"), None);
}

#[test]
fn a_torn_tail_is_dropped_at_recovery() {
    let dir = tempdir();
    let config = || builder(&[dir.path()]).max_value_pages(2).build().expect("config");
    let b = live(config());
    for i in 0..3 {
        put(&b, &format!("k{i}"), &value(i, 6000));
    }
    b.shutdown();
    drop(b);
    // Each record is 4 KiB of header + 8 KiB of value; cut the last one in half (the file may be
    // longer: its size is raised to the whole segment when writes share it).
    let seg = segments(dir.path()).remove(0);
    let len = fs::metadata(&seg).expect("stat").len();
    assert!(len >= 3 * 12288, "{len}");
    fs::OpenOptions::new().write(true).open(&seg).expect("open").set_len(3 * 12288 - 6000).expect("truncate");
    let b = live(config());
    assert_eq!(b.owned_key_count(), 2, "the torn record is gone");
    assert_eq!(b.stats().torn_tails, 1);
    assert_eq!(get(&b, "k2"), None);
    assert_eq!(get(&b, "k1"), Some(value(1, 6000)));
    // Garbage after the last record (a torn header) is dropped too, and new writes still land.
    put(&b, "k2", &value(2, 6000));
    b.shutdown();
    drop(b);
    let b = live(config());
    assert_eq!(b.owned_key_count(), 3);
    assert_eq!(get(&b, "k2"), Some(value(2, 6000)));
}

#[test]
fn dead_space_is_reclaimed_and_live_records_survive_compaction() {
    let dir = tempdir();
    // Each record is 8 KiB; a segment holds 24. 64 one-page values fill the 64-page capacity, and
    // their 512 KiB of records outgrow it on the drive, so dead space is reclaimed.
    let config = || {
        builder(&[dir.path()])
            .capacity_bytes(64 * PAGE)
            .segment_bytes(128 * 1024 + 64 * 1024)
            .reclaim_dead_ratio(0.5)
            .watermarks(None)
            .build()
            .expect("config")
    };
    let b = live(config());
    for i in 0..64 {
        put(&b, &format!("k{i}"), &value(i, 4000));
    }
    let before = b.stats();
    assert!(before.segments >= 2, "{before:?}");
    // Evict everything but every fourth key.
    let victims: Vec<String> = (0..64).filter(|i| i % 4 != 0).map(|i| format!("k{i}")).collect();
    assert!(b.evict(&victims).iter().all(|e| e.bytes_freed > 0));
    for _ in 0..20 {
        b.reaper_tick();
    }
    let after = b.stats();
    assert!(after.compaction_moved > 0, "{after:?}");
    assert!(after.segments_reclaimed > 0, "{after:?}");
    // Less than before, although 48 tombstones (8 KiB each) were written meanwhile; they retire
    // once no segment that could hold an evicted key's old record is left.
    assert!(after.log_bytes < before.log_bytes, "dead space reclaimed: {before:?} -> {after:?}");
    assert_eq!(after.live_bytes, 16 * 8192);
    b.drop_cached_copies();
    for i in (0..64).step_by(4) {
        assert_eq!(get(&b, &format!("k{i}")), Some(value(i, 4000)), "k{i} after compaction");
    }
    b.shutdown();
    drop(b);
    let b = live(config());
    for i in (0..64).step_by(4) {
        assert_eq!(get(&b, &format!("k{i}")), Some(value(i, 4000)), "k{i}: compacted records recover");
    }
    // Evictions are logged as tombstones: no evicted key comes back, though most of their records
    // are still on the drive.
    assert_eq!(b.owned_key_count(), 16, "only the survivors are recovered");
    for i in (0..64).filter(|i| i % 4 != 0) {
        assert_eq!(get(&b, &format!("k{i}")), None, "evicted k{i} came back");
    }
}

#[test]
fn evicted_and_re_put_keys_recover_as_they_were_left() {
    for engine in engines() {
        let dir = tempdir();
        let config = || builder(&[dir.path()]).io_engine(engine).watermarks(None).build().expect("config");
        let b = live(config());
        for i in 0..6 {
            put(&b, &format!("k{i}"), &value(i, 3000));
        }
        // k0, k1: evicted. k2: evicted, then put again with other bytes. k3: put, evicted, put,
        // evicted. k4, k5: untouched.
        let evict = |keys: &[&str]| {
            let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
            assert!(b.evict(&keys).iter().all(|e| e.bytes_freed > 0), "evict {keys:?}");
        };
        evict(&["k0", "k1", "k2", "k3"]);
        b.reaper_tick(); // some tombstones are written now, the rest at shutdown
        put(&b, "k2", &value(22, 500));
        put(&b, "k3", &value(33, 700));
        evict(&["k3"]);
        b.shutdown();
        drop(b);
        let b = live(config());
        let mut keys: Vec<String> = b.snapshot_owned_keys().into_iter().map(|e| e.key).collect();
        keys.sort();
        assert_eq!(keys, ["k2", "k4", "k5"], "{engine}");
        assert_eq!(get(&b, "k2"), Some(value(22, 500)), "{engine}: the newest value of a re-put key");
        assert_eq!(get(&b, "k4"), Some(value(4, 3000)));
        assert!(b.stats().tombstones >= 1, "{engine}: {:?}", b.stats());
        // A tombstone never hides a later put.
        put(&b, "k0", &value(100, 10));
        b.shutdown();
        drop(b);
        let b = live(config());
        assert_eq!(get(&b, "k0"), Some(value(100, 10)), "{engine}");
        assert_eq!(get(&b, "k1"), None, "{engine}");
    }
}

#[test]
fn clear_local_deletes_the_log_so_a_restart_brings_nothing_back() {
    let dir = tempdir();
    let config = || builder(&[dir.path()]).build().expect("config");
    let b = live(config());
    for i in 0..5 {
        put(&b, &format!("k{i}"), &value(i, 100));
    }
    b.clear_local();
    b.clear_full_sync_acked();
    b.reaper_tick();
    assert!(segments(dir.path()).is_empty(), "cleared segments are deleted");
    b.shutdown();
    drop(b);
    let b = live(config());
    assert_eq!(b.owned_key_count(), 0);
}

#[test]
fn metrics_use_generic_names_with_event_and_state_labels() {
    let dir = tempdir();
    let b = live(builder(&[dir.path()]).build().expect("config"));
    put(&b, "k", &value(1, 10));
    b.drop_cached_copies();
    get(&b, "k");
    let samples = b.sample_metrics();
    for m in &samples {
        assert!(m.name.starts_with("umbp_backend_medium_"), "{}", m.name);
        assert!(m.labels.iter().all(|(k, _)| k == "event" || k == "state"), "{:?}", m.labels);
    }
    let has =
        |name: &str, label: &str| samples.iter().any(|m| m.name == name && m.labels.iter().any(|(_, v)| v == label));
    assert!(has(metric_names::MEDIUM_BYTES_TOTAL, "device_write"));
    assert!(has(metric_names::MEDIUM_BYTES_TOTAL, "device_read"));
    assert!(has(metric_names::MEDIUM_STATE, "staging_pages_total"));
    assert!(has(metric_names::MEDIUM_EVENTS_TOTAL, "single_flight_lead"));
}

#[test]
fn large_multi_page_values_round_trip_through_a_restart() {
    // Multi-page values of hundreds of KiB in one batch: one engine submission, pages scattered
    // over the arena, records far larger than a header block (with io_uring, the overlapped
    // paths, whose headers carry the writers' checksums, one value committed without).
    const BIG_PAGE: u64 = 512 * 1024;
    for engine in engines() {
        let dir = tempdir();
        let config = || {
            SsdConfig::builder([dir.path()])
                .page_size(BIG_PAGE)
                .capacity_bytes(32 * BIG_PAGE)
                .staging_pages(16)
                .max_value_pages(2)
                .segment_bytes(8 << 20)
                .io_engine(engine)
                .build()
                .expect("config")
        };
        let b = live(config());
        let sizes = [300 * 1024, BIG_PAGE as usize, 2 * BIG_PAGE as usize - 1];
        let values: Vec<Bytes> = sizes.iter().enumerate().map(|(i, n)| value(i as u64 + 40, *n)).collect();
        let reqs: Vec<AllocateRequest> =
            values.iter().enumerate().map(|(i, v)| AllocateRequest::new(format!("big{i}"), v.len() as u64)).collect();
        let allocated = b.batch_allocate(&reqs);
        let (base, _) = arena(&b);
        for (a, v) in allocated.iter().zip(&values) {
            assert_eq!(a.outcome, AllocateOutcome::Allocated);
            for (chunk, page) in v.chunks(BIG_PAGE as usize).zip(&a.pages) {
                // SAFETY: the page is inside the arena and reserved for this slot.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        chunk.as_ptr(),
                        base.add((u64::from(page.page_index) * BIG_PAGE) as usize),
                        chunk.len(),
                    )
                };
            }
        }
        let crcs: Vec<Option<u32>> =
            values.iter().enumerate().map(|(i, v)| (i != 1).then(|| crc32c::crc32c(&v.0))).collect();
        let commits: Vec<CommitRequest> = allocated
            .iter()
            .enumerate()
            .map(|(i, a)| CommitRequest::new(a.slot_id, format!("big{i}")).with_crc32c(crcs[i]))
            .collect();
        assert!(b.batch_commit(&commits).iter().all(|c| c.success), "{engine}: batch commit");
        b.shutdown();
        drop(b);
        let b = live(config());
        assert_eq!(b.owned_key_count(), 3, "{engine}: recovered");
        for (i, v) in values.iter().enumerate() {
            let r = b.batch_resolve(&[format!("big{i}")], false).remove(0);
            assert!(r.found && r.size == v.len() as u64, "{engine}: big{i}");
            assert_eq!(r.crc32c, crcs[i], "{engine}: the writer's checksum of big{i}");
            let mut got = Vec::new();
            let mut remaining = r.size;
            for page in &r.pages {
                let n = remaining.min(BIG_PAGE);
                // SAFETY: the page is inside the arena and leased to this reader.
                got.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(
                        base_of(&b).add((u64::from(page.page_index) * BIG_PAGE) as usize),
                        n as usize,
                    )
                });
                remaining -= n;
            }
            assert_eq!(Bytes(got), *v, "{engine}: bytes of big{i}");
        }
        // A flipped byte deep inside a large value (a middle read chunk) is caught on a read.
        b.shutdown();
        drop(b);
        let b = live(config());
        let seg = segments(dir.path()).remove(0);
        let mut bytes = fs::read(&seg).expect("read segment");
        let big1 = 4096 + 300 * 1024; // big0's record: a header block and 300 KiB of value
        bytes[big1 + 4096 + 300_000] ^= 0x01;
        fs::write(&seg, &bytes).expect("write segment");
        assert!(!b.batch_resolve(&["big1".to_owned()], false)[0].found, "{engine}: corrupt big1 is a miss");
        assert_eq!(b.stats().corrupt_reads, 1, "{engine}");
        assert!(b.batch_resolve(&["big0".to_owned(), "big2".to_owned()], false).iter().all(|e| e.found));
    }
}

fn base_of(b: &SsdBackend) -> *mut u8 {
    arena(b).0
}

#[test]
fn an_empty_key_is_refused_at_allocate_and_commit_so_no_record_hides_later_ones() {
    let dir = tempdir();
    let config = || builder(&[dir.path()]).build().expect("config");
    let b = live(config());
    put(&b, "a", &value(1, 100));
    assert_eq!(b.batch_allocate(&[AllocateRequest::new("", 10)])[0].outcome, AllocateOutcome::Failed);
    // The commit-time key is the one stored, so an empty one is refused there too.
    let slot = b.batch_allocate(&[AllocateRequest::new("x", 10)]).remove(0);
    assert_eq!(slot.outcome, AllocateOutcome::Allocated);
    assert!(!b.batch_commit(&[CommitRequest::new(slot.slot_id, "")])[0].success, "commit under an empty key");
    assert_eq!(b.capacity().available_bytes, b.capacity().total_bytes - PAGE, "the refused slot is released");
    put(&b, "b", &value(2, 100));
    b.shutdown();
    drop(b);
    let b = live(config());
    assert_eq!(b.owned_key_count(), 2);
    assert_eq!(get(&b, "b"), Some(value(2, 100)), "the record after the refused one is recovered");
}

#[test]
fn the_padding_after_a_value_is_zeroes_not_an_earlier_value() {
    for engine in engines() {
        let dir = tempdir();
        let b = live(builder(&[dir.path()]).io_engine(engine).staging_pages(1).build().expect("config"));
        // One staging page: the second value is written into the page the first one filled.
        put(&b, "old", &[0xAB; PAGE as usize]);
        put(&b, "new", &value(3, 10));
        b.shutdown();
        drop(b);
        let bytes = fs::read(segments(dir.path()).remove(0)).expect("read segment");
        // Record 0: 4 KiB header + 4 KiB value; record 1's value starts at 12 KiB.
        let pad = &bytes[12288 + 10..16384];
        assert!(
            pad.iter().all(|b| *b == 0),
            "{engine}: {} bytes of the old value leaked",
            pad.iter().filter(|b| **b == 0xAB).count()
        );
    }
}

#[test]
fn a_second_backend_on_a_directory_in_use_fails_to_init_with_a_clear_error() {
    let (a, b_dir) = (tempdir(), tempdir());
    let first = live(builder(&[a.path()]).build().expect("config"));
    put(&first, "k", &value(1, 10));
    // Any directory of the second medium already in use is refused, here its second one.
    let second = SsdBackend::new(builder(&[b_dir.path(), a.path()]).build().expect("config"));
    let err = second.init(Arc::new(LocalOnlyRegistrar::new())).expect_err("the directory is in use");
    let msg = err.to_string();
    assert!(msg.contains("in use by another SSD medium") && msg.contains(&a.path().display().to_string()), "{msg}");
    assert_eq!(get(&first, "k"), Some(value(1, 10)), "the first medium is untouched");
    assert!(!segments(a.path()).is_empty());
    first.shutdown();
    drop(first);
    // Once the first is shut down, the directory is free.
    let third = live(builder(&[a.path()]).build().expect("config"));
    assert_eq!(get(&third, "k"), Some(value(1, 10)));
}

#[test]
fn the_reaper_syncs_written_segments_periodically_not_only_at_shutdown() {
    let dir = tempdir();
    let b = live(
        builder(&[dir.path()])
            .reaper_interval(Duration::from_millis(2))
            .sync_interval(Some(Duration::from_millis(10)))
            .build()
            .expect("config"),
    );
    put(&b, "k", &value(1, 100));
    let start = std::time::Instant::now();
    while b.stats().segment_syncs == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no periodic sync: {:?}", b.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
    // Nothing written since: nothing more to sync.
    let synced = b.stats().segment_syncs;
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(b.stats().segment_syncs, synced, "clean segments are not synced again");
    put(&b, "k2", &value(2, 100));
    b.sync();
    assert_eq!(b.stats().segment_syncs, synced + 1, "an explicit sync covers the new write");
    // Off: only shutdown syncs.
    let dir = tempdir();
    let b = live(
        builder(&[dir.path()]).reaper_interval(Duration::from_millis(2)).sync_interval(None).build().expect("config"),
    );
    put(&b, "k", &value(1, 100));
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(b.stats().segment_syncs, 0);
}

/// A configuration whose worst case needs more open files than the process may have fails `init`
/// with an error naming the limit, instead of running into `EMFILE` on some later segment; one
/// that needs exactly the limit starts.
#[test]
fn a_configuration_needing_more_open_files_than_the_limit_fails_init() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid `rlimit` for the call to fill.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
    if limit.rlim_cur == libc::RLIM_INFINITY || limit.rlim_cur > 1 << 24 {
        let why = format!("the open-file limit ({}) is too large to reach with a test configuration", limit.rlim_cur);
        return require::skip(require::OPEN_FILES, why);
    }
    let dir = tempdir();
    let segment = 256 * 1024;
    // One directory, psync: segment files for the capacity plus two segments of headroom, plus the
    // active one, plus the directory lock: capacity / segment + 4.
    let config = |open_files: u64| {
        builder(&[dir.path()]).capacity_bytes((open_files - 4) * segment).watermarks(None).build().expect("config")
    };
    let over = config(limit.rlim_cur + 1);
    assert_eq!(over.max_open_files(), limit.rlim_cur + 1);
    let b = SsdBackend::new(over);
    let err = b.init(Arc::new(LocalOnlyRegistrar::new())).expect_err("over the open-file limit");
    let msg = err.to_string();
    assert!(msg.contains("open-file limit") && msg.contains(&limit.rlim_cur.to_string()), "{msg}");
    let at = config(limit.rlim_cur);
    assert_eq!(at.max_open_files(), limit.rlim_cur);
    let b = live(at);
    b.shutdown();
}
