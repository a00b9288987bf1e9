//! Unit tests of the SSD backend's internals.

use super::io_jobs::{adjacent_runs, split_segments};
use super::lifecycle::LOG_THREAD;
use super::recover::segment_bytes_in;
use super::write::shared_with_others;
use super::*;
use umbp_core::{Clock, ManualClock, ReadRelease};
use umbp_testkit::LocalOnlyRegistrar;

const PAGE: u64 = 4096;

fn backend(dir: &std::path::Path, clock: &Arc<ManualClock>, staging_pages: u64) -> SsdBackend {
    let config = SsdConfig::builder([dir])
        .page_size(PAGE)
        .capacity_bytes(64 * PAGE)
        .staging_pages(staging_pages)
        .segment_bytes(256 * 1024)
        // Leases run on the manual clock; a long one makes the follower wait (half of it, in
        // real time) far longer than any test step.
        .read_lease_ttl(Duration::from_secs(60))
        .clock(Arc::clone(clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b
}

/// Where `page` of the staging arena lies in this process (the ranged tests use it too).
pub(super) fn page_ptr(b: &SsdBackend, page: &PageLocation) -> *mut u8 {
    let r = b.buffer_ref(0).expect("arena");
    let base = r.local_region().expect("local").ptr().as_ptr();
    // SAFETY: the page index comes from the backend, so the offset lies inside the arena.
    unsafe { base.add((u64::from(page.page_index) * b.page_size()) as usize) }
}

fn put(b: &SsdBackend, key: &str, fill: u8, len: usize) {
    put_with(b, key, fill, len, None);
}

/// [`put`] with the writer's checksum `crc32c` (any number: the medium never checks it).
fn put_with(b: &SsdBackend, key: &str, fill: u8, len: usize, crc32c: Option<u32>) {
    let a = b.batch_allocate(&[AllocateRequest::new(key, len as u64)]).remove(0);
    assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {key}");
    // SAFETY: the page is the slot's, inside the arena, and `len` fits one page.
    unsafe { std::ptr::write_bytes(page_ptr(b, &a.pages[0]), fill, len) };
    let commit = CommitRequest::new(a.slot_id, key).with_crc32c(crc32c);
    assert!(b.batch_commit(&[commit])[0].success, "commit {key}");
}

/// `key`'s bytes and writer's checksum if it resolves (the read's lease is handed back).
fn resolve_with_crc(b: &SsdBackend, key: &str) -> Option<(Vec<u8>, Option<u32>)> {
    let e = b.batch_resolve(&[key.to_owned()], false).remove(0);
    let got = e.found.then(|| (read(b, &e), e.crc32c));
    b.release_reads(&[ReadRelease::new(key, e.lease)]);
    got
}

fn read(b: &SsdBackend, e: &ResolvedEntry) -> Vec<u8> {
    // SAFETY: the entry's page lies inside the arena and is leased to this reader.
    unsafe { std::slice::from_raw_parts(page_ptr(b, &e.pages[0]), e.size as usize) }.to_vec()
}

/// A hit resolved early in a batch whose resolve then waits on another key's read: by the time
/// the batch returns, the hit's first lease has lapsed and its page went to an allocation. The
/// entry must not point at that page (a miss, or a renewed lease on the same copy).
#[test]
fn a_hit_whose_lease_lapsed_while_the_batch_waited_is_revalidated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = Arc::new(backend(dir.path(), &clock, 1));
    put(&b, "a", 0xAA, 3000);
    put(&b, "b", 0xBB, 3000);
    // Only "b"'s copy is cached now (one staging page); make "a" the cached one.
    b.drop_cached_copies();
    assert!(b.batch_resolve(&["a".to_owned()], false)[0].found);
    clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
    b.reaper_tick();
    // A read of "b" is in flight elsewhere: the batch follows it.
    let flight = Arc::new(Flight::default());
    b.inner.state.lock().flights_mut().insert("b".into(), Arc::clone(&flight));
    let reader = {
        let b = Arc::clone(&b);
        std::thread::spawn(move || b.batch_resolve(&["a".to_owned(), "b".to_owned()], false))
    };
    // Wait until the reader took its lease on "a" and is following "b".
    let leased = |b: &SsdBackend| {
        let now = b.inner.config.clock.now();
        b.inner.state.lock().staged().get("a").is_some_and(|s| s.leased(now))
    };
    let start = Instant::now();
    while !leased(&b) {
        assert!(start.elapsed() < Duration::from_secs(10), "the reader never leased a");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    // The lease lapses while the reader waits; a writer takes the page and fills it.
    clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
    let slot = b.batch_allocate(&[AllocateRequest::new("c", 3000)]).remove(0);
    assert_eq!(slot.outcome, AllocateOutcome::Allocated, "the unleased copy of a makes room");
    // SAFETY: the page is the slot's.
    unsafe { std::ptr::write_bytes(page_ptr(&b, &slot.pages[0]), 0xCC, 3000) };
    b.inner.state.lock().flights_mut().remove("b");
    flight.finish();
    let entries = reader.join().expect("reader");
    if entries[0].found {
        assert_ne!(entries[0].pages, slot.pages, "a hit points at a page another writer owns");
        assert_eq!(read(&b, &entries[0]), vec![0xAA; 3000], "wrong bytes for a");
    }
    b.batch_abort(&[slot.slot_id]);
}

/// An engine that fails every op starting at `offset` with EIO.
#[derive(Debug)]
struct FailAt(u64);

impl IoEngine for FailAt {
    fn name(&self) -> &'static str {
        "fail-at"
    }

    fn submit(&self, ops: &mut [IoOp]) {
        crate::io::PsyncEngine.submit(ops);
        for op in ops.iter_mut().filter(|op| op.offset() == self.0) {
            op.result = Err(io::Error::from_raw_os_error(libc::EIO));
        }
    }
}

#[test]
fn a_read_error_while_scanning_is_a_torn_tail_not_a_failed_init() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock, 4);
    for (i, k) in ["a", "b", "c"].iter().enumerate() {
        put(&b, k, i as u8 + 1, 3000);
    }
    b.shutdown();
    drop(b);
    // Each record is 8 KiB: the second one's header cannot be read.
    let b = backend_uninit(dir.path(), &clock);
    let recovered = b.open_log(&FailAt(8192)).expect("init survives a read error");
    let keys: Vec<&str> = recovered.owned.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["a"], "the records before the error are recovered");
    assert_eq!(b.inner.counters.recovery_torn_tail.load(Ordering::Relaxed), 1, "counted as a torn tail");
    assert!(recovered.log.segs.values().all(|s| s.sealed), "the segment is sealed");
}

fn backend_uninit(dir: &std::path::Path, clock: &Arc<ManualClock>) -> SsdBackend {
    let config = SsdConfig::builder([dir])
        .page_size(PAGE)
        .capacity_bytes(64 * PAGE)
        .staging_pages(4)
        .segment_bytes(256 * 1024)
        .clock(Arc::clone(clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    SsdBackend::new(config)
}

fn record_bytes(key: &str, value: &[u8], seq: u64, flags: u16) -> Vec<u8> {
    record_bytes_crc(key, value, seq, flags, 0)
}

/// A record as the encoder writes it, with the header's `value_crc` field as given.
fn record_bytes_crc(key: &str, value: &[u8], seq: u64, flags: u16, value_crc: u32) -> Vec<u8> {
    let hl = header_len(key.len()) as usize;
    let mut buf = vec![0u8; hl + record::align_up(value.len() as u64) as usize];
    buf[hl..hl + value.len()].copy_from_slice(value);
    let crc = record::data_crc(key.as_bytes(), value);
    record::encode_header_flags(&mut buf[..hl], key, value.len() as u64, seq, crc, flags, value_crc);
    buf
}

/// The writer's checksum travels with the value: a cached copy, a drive read and a restart (the
/// record's header) all hand it back, and a value committed without one has none.
#[test]
fn the_writers_checksum_comes_back_from_the_drive_and_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = Arc::new(backend(dir.path(), &clock, 8));
    put_with(&b, "with", 0xAA, 3000, Some(0x8a91_36aa));
    put_with(&b, "without", 0xBB, 100, None);
    let want = |b: &SsdBackend, what: &str| {
        assert_eq!(resolve_with_crc(b, "with"), Some((vec![0xAA; 3000], Some(0x8a91_36aa))), "{what}");
        assert_eq!(resolve_with_crc(b, "without"), Some((vec![0xBB; 100], None)), "{what}");
    };
    want(&b, "cached copies");
    assert_eq!(b.stats().device_reads, 0, "served from the copies the commits left");
    b.drop_cached_copies();
    want(&b, "drive reads");
    assert_eq!(b.stats().device_reads, 2, "both read from the drive");
    let b = restarted(b, dir.path(), &clock);
    want(&b, "after a restart");
    assert_eq!(b.stats().device_reads, 2, "both read from the drive after the restart");
    want(&b, "cached copies after a restart");
}

/// A record written before the checksum flag existed (flags 0, the field zero) recovers with no
/// checksum; beside it, one with the flag recovers with its own.
#[test]
fn a_record_without_the_checksum_flag_recovers_without_a_checksum() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut seg = record_bytes("old", &[1u8; 100], 1, 0);
    seg.extend(record_bytes_crc("new", &[2u8; 200], 2, record::FLAG_VALUE_CRC, 0x0bad_cafe));
    // Without the flag the field means nothing, whatever it holds.
    seg.extend(record_bytes_crc("stray", &[3u8; 300], 3, 0, 0x0bad_cafe));
    seg.resize(seg.len() + 8192, 0);
    fs::write(dir.path().join(SegmentFile::segment_name(0)), &seg).expect("write segment");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock, 4);
    assert_eq!(b.owned_key_count(), 3, "{:?}", b.stats());
    assert_eq!(resolve_with_crc(&b, "old"), Some((vec![1u8; 100], None)));
    assert_eq!(resolve_with_crc(&b, "new"), Some((vec![2u8; 200], Some(0x0bad_cafe))));
    assert_eq!(resolve_with_crc(&b, "stray"), Some((vec![3u8; 300], None)));
    assert_eq!(b.stats().corrupt_reads, 0, "the index and the headers agree");
}

/// Hand-made segment: a value, a CRC-valid tombstone of 3 bytes (malformed: skipped, the scan
/// goes on), a value, then a CRC-valid header claiming an absurd size (a torn tail, no panic).
#[test]
fn recovery_rejects_malformed_tombstones_and_absurd_sizes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut seg = record_bytes("a", &[1u8; 100], 1, 0);
    seg.extend(record_bytes("t", &[9u8; 3], 2, record::FLAG_TOMBSTONE));
    seg.extend(record_bytes("b", &[2u8; 200], 3, 0));
    let mut absurd = vec![0u8; header_len(1) as usize];
    record::encode_header(&mut absurd, "z", u64::MAX - 1, 4, 0, None);
    seg.extend(absurd);
    seg.resize(seg.len() + 8192, 0);
    fs::write(dir.path().join(SegmentFile::segment_name(0)), &seg).expect("write segment");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock, 4);
    let mut keys: Vec<String> = b.snapshot_owned_keys().into_iter().map(|e| e.key).collect();
    keys.sort();
    assert_eq!(keys, ["a", "b"], "the malformed tombstone is not a value");
    let stats = b.stats();
    assert_eq!((stats.recovery_corrupt, stats.torn_tails, stats.tombstones), (1, 1, 0), "{stats:?}");
    let e = b.batch_resolve(&["b".to_owned()], false).remove(0);
    assert_eq!(read(&b, &e), vec![2u8; 200]);
}

/// Dropping a key (the corrupt-read path does) while a reader holds a lease on its cached copy
/// must not free the copy's pages under the reader.
#[test]
fn dropping_a_leased_key_defers_its_pages_to_the_lease_end() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock, 1);
    put(&b, "a", 0xAA, 3000);
    let e = b.batch_resolve(&["a".to_owned()], false).remove(0);
    assert!(e.found);
    {
        let now = clock.now();
        let mut state = b.inner.state.lock();
        assert!(state.drop_owned("a", now).is_some());
    }
    assert_eq!(
        b.batch_allocate(&[AllocateRequest::new("c", 10)])[0].outcome,
        AllocateOutcome::Busy,
        "the leased page went to a writer while its reader copies"
    );
    assert_eq!(read(&b, &e), vec![0xAA; 3000]);
    clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
    b.reaper_tick();
    assert_eq!(b.batch_allocate(&[AllocateRequest::new("c", 10)])[0].outcome, AllocateOutcome::Allocated);
}

#[test]
fn split_segments_cuts_at_the_chunk_size_and_keeps_every_byte_in_order() {
    let mut arena = vec![0u8; 64 * 1024];
    let base = arena.as_mut_ptr();
    // SAFETY: every offset stays inside `arena`.
    let segs = unsafe { [(base, 12 * 1024), (base.add(16 * 1024), 4096), (base.add(32 * 1024), 20 * 1024)] };
    let chunks = split_segments(&segs, 8192);
    let lens: Vec<usize> = chunks.iter().map(|c| c.iter().map(|(_, l)| *l).sum()).collect();
    assert_eq!(lens, [8192, 8192, 8192, 8192, 4096]);
    let flat: Vec<(*mut u8, usize)> = chunks.into_iter().flatten().collect();
    assert_eq!(flat.iter().map(|(_, l)| l).sum::<usize>(), 36 * 1024);
    // SAFETY: inside `arena`.
    let (at_8k, at_16k) = unsafe { (base.add(8192), base.add(16 * 1024)) };
    assert_eq!(flat[0], (base, 8192));
    assert_eq!(flat[1], (at_8k, 4096));
    assert_eq!(flat[2], (at_16k, 4096));
}

/// An engine that holds every submit made from a thread whose name is in `held` until the test
/// lets that name go (other threads pass straight through).
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<(std::collections::HashSet<String>, std::collections::HashSet<String>)>,
    cv: Condvar,
}

impl Gate {
    fn hold(&self, name: &str) {
        self.state.lock().0.insert(name.to_owned());
    }

    /// Waits until a submit of thread `name` is being held.
    fn wait_entered(&self, name: &str) {
        let mut st = self.state.lock();
        while !st.1.contains(name) {
            self.cv.wait(&mut st);
        }
    }

    fn release(&self, name: &str) {
        self.state.lock().0.remove(name);
        self.cv.notify_all();
    }
}

impl IoEngine for Gate {
    fn name(&self) -> &'static str {
        "gate"
    }

    fn submit(&self, ops: &mut [IoOp]) {
        let name = std::thread::current().name().unwrap_or_default().to_owned();
        {
            let mut st = self.state.lock();
            if st.0.contains(&name) {
                st.1.insert(name.clone());
                self.cv.notify_all();
                while st.0.contains(&name) {
                    self.cv.wait(&mut st);
                }
            }
        }
        crate::io::PsyncEngine.submit(ops);
    }
}

/// Puts `key` on a named thread (its drive write held by `gate` when the name is held).
fn spawn_put(b: &Arc<SsdBackend>, name: &str, key: &'static str, fill: u8) -> std::thread::JoinHandle<()> {
    let b = Arc::clone(b);
    std::thread::Builder::new().name(name.to_owned()).spawn(move || put(&b, key, fill, 3000)).expect("spawn")
}

fn gated(dir: &std::path::Path, clock: &Arc<ManualClock>) -> (Arc<SsdBackend>, Arc<Gate>) {
    let b = Arc::new(backend(dir, clock, 8));
    // No background pass may write or compact while the test orders the writes.
    b.stop_reaper();
    let gate = Arc::new(Gate::default());
    *b.inner.engine.write() = Some(Arc::clone(&gate) as Arc<dyn IoEngine>);
    (b, gate)
}

fn resolve_bytes(b: &SsdBackend, key: &str) -> Option<Vec<u8>> {
    let e = b.batch_resolve(&[key.to_owned()], false).remove(0);
    e.found.then(|| read(b, &e))
}

fn restarted(b: Arc<SsdBackend>, dir: &std::path::Path, clock: &Arc<ManualClock>) -> SsdBackend {
    b.shutdown();
    drop(b);
    backend(dir, clock, 8)
}

/// Two commits of one key in different batches: A reserves first and lands first; B starts
/// while A's write is in flight and lands second. Whatever the node serves before a restart, it
/// must serve after it (recovery keeps the record with the highest seq).
#[test]
fn a_restart_after_two_racing_commits_serves_the_same_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let (b, gate) = gated(dir.path(), &clock);
    gate.hold("a");
    gate.hold("b");
    let a = spawn_put(&b, "a", "k", 0xAA);
    gate.wait_entered("a");
    let bt = spawn_put(&b, "b", "k", 0xBB);
    // Time for B to reserve and reach the drive (or to wait for A, as it should).
    std::thread::sleep(Duration::from_millis(100));
    gate.release("a");
    a.join().expect("a");
    gate.release("b");
    bt.join().expect("b");
    let before = resolve_bytes(&b, "k").expect("k is served before the restart");
    assert_eq!(before, vec![0xAA; 3000], "the first commit wins");
    let b = restarted(b, dir.path(), &clock);
    let after = resolve_bytes(&b, "k").expect("k is recovered");
    assert_eq!(after, before, "the restart serves other bytes than the node did");
    assert_eq!(b.owned_key_count(), 1);
}

/// A commit of `k` is in flight when another commit of `k` starts; if the second one lands
/// first, `k` is evicted and its tombstone written before the first lands. The node and a
/// restart of it must agree about `k` (a record older than a tombstone on the drive is hidden
/// at recovery, so it must not be served before either).
#[test]
fn a_key_evicted_while_an_older_commit_is_in_flight_agrees_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let (b, gate) = gated(dir.path(), &clock);
    gate.hold("late");
    let late = spawn_put(&b, "late", "k", 0xBB);
    gate.wait_entered("late");
    let early = spawn_put(&b, "early", "k", 0xAA);
    std::thread::sleep(Duration::from_millis(100));
    // Only if the second commit did not wait for the first: evict it and log the tombstone.
    b.evict(&["k".to_owned()]);
    b.inner.flush_tombstones();
    gate.release("late");
    late.join().expect("late");
    early.join().expect("early");
    let before = resolve_bytes(&b, "k");
    let b = restarted(b, dir.path(), &clock);
    assert_eq!(resolve_bytes(&b, "k"), before, "memory and recovery disagree about k");
}

/// Evicted, tombstone logged, then put again: the re-put is recovered after a restart.
#[test]
fn a_key_evicted_then_put_again_is_recovered_after_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = Arc::new(backend(dir.path(), &clock, 8));
    put(&b, "k", 0xAA, 3000);
    b.evict(&["k".to_owned()]);
    b.inner.flush_tombstones();
    put(&b, "k", 0xBB, 3000);
    let b = restarted(b, dir.path(), &clock);
    assert_eq!(resolve_bytes(&b, "k"), Some(vec![0xBB; 3000]));
}

/// Repeated overwrite (evict + put) and eviction under pressure: the segment files on the drive
/// never exceed the capacity by more than the documented headroom
/// ([`SsdConfig::disk_headroom_bytes`]).
#[test]
fn repeated_overwrite_and_eviction_keep_the_log_within_capacity_plus_headroom() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let config = SsdConfig::builder([dir.path()])
        .page_size(PAGE)
        .capacity_bytes(256 * PAGE)
        .staging_pages(8)
        .segment_bytes(32 * PAGE)
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let limit = config.capacity_bytes + config.disk_headroom_bytes();
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b.stop_reaper();
    let mut worst = 0;
    for i in 0..2000u32 {
        let key = format!("k{}", i % 300);
        b.evict(std::slice::from_ref(&key));
        put(&b, &key, i as u8, 3000);
        if i % 3 == 0 {
            b.reaper_tick();
        }
        worst = worst.max(segment_bytes_in(dir.path()));
        assert!(worst <= limit, "step {i}: {worst} bytes of segments > {limit} ({:?})", b.stats());
    }
    eprintln!("worst {worst} limit {limit}");
}

/// A one-directory backend with 4 KiB pages, `capacity_pages` of capacity and segments of 32
/// records of 4 KiB-page values (8 KiB each: a header block and a value block), its reaper
/// stopped so the test decides when log passes run.
fn paced(dir: &std::path::Path, clock: &Arc<ManualClock>, capacity_pages: u64) -> (SsdBackend, u64) {
    let config = SsdConfig::builder([dir])
        .page_size(PAGE)
        .capacity_bytes(capacity_pages * PAGE)
        .staging_pages(8)
        .segment_bytes(32 * PAGE)
        .clock(Arc::clone(clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let limit = config.capacity_bytes + config.disk_headroom_bytes();
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b.stop_reaper();
    (b, limit)
}

/// Writers that append several segments between two log passes: the passes compact as many
/// segments as the measured pace needs, so the files still never pass the capacity plus the
/// headroom. (64 KiB values: a tombstone, 8 KiB, is small beside a record, as with real KV
/// blocks; tombstones in force are live records the watermarks do not count.)
#[test]
fn bursts_between_passes_keep_the_log_within_capacity_plus_headroom() {
    const BIG: u64 = 64 * 1024;
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    // Records of 68 KiB (a header block and the value); 15 to a 1 MiB segment.
    let config = SsdConfig::builder([dir.path()])
        .page_size(BIG)
        .capacity_bytes(128 * BIG)
        .staging_pages(8)
        .segment_bytes(1 << 20)
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let limit = config.capacity_bytes + config.disk_headroom_bytes();
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b.stop_reaper();
    let mut worst = 0;
    for i in 0..1200u32 {
        let key = format!("k{}", i % 150);
        b.evict(std::slice::from_ref(&key));
        let a = b.batch_allocate(&[AllocateRequest::new(key.as_str(), BIG)]).remove(0);
        assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {key}");
        assert!(b.batch_commit(&[CommitRequest::new(a.slot_id, key.as_str())])[0].success, "commit {key}");
        // 40 overwrites between passes: 2.7 MiB, nearly three segments.
        if i % 40 == 39 {
            b.reaper_tick();
        }
        worst = worst.max(segment_bytes_in(dir.path()));
        assert!(worst <= limit, "step {i}: {worst} bytes of segments > {limit} ({:?})", b.stats());
    }
    assert!(b.stats().compaction_moved > 0, "compaction ran ({:?})", b.stats());
    eprintln!("worst {worst} limit {limit}");
}

/// Dead records far beyond an eighth of the capacity are left alone while the log is far from
/// its capacity (moving them would only take bandwidth from the writers); compaction starts
/// once the log comes near the capacity, and the files stay within capacity plus headroom.
#[test]
fn compaction_waits_until_the_log_needs_the_room() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    // 2 MiB of capacity; 64 values of 8 KiB records fill four segments.
    let (b, limit) = paced(dir.path(), &clock, 512);
    for i in 0..64u32 {
        put(&b, &format!("k{i}"), i as u8, 3000);
    }
    // Three quarters of the four segments die: 384 KiB of dead records, well past an eighth of
    // the capacity (256 KiB), which the earlier rule compacted at.
    let victims: Vec<String> = (0..64u32).filter(|i| i % 4 != 0).map(|i| format!("k{i}")).collect();
    assert!(b.evict(&victims).iter().all(|e| e.bytes_freed > 0));
    for _ in 0..10 {
        b.reaper_tick();
    }
    let s = b.stats();
    assert_eq!(s.compaction_moved, 0, "nothing was compacted while the room was not needed: {s:?}");
    let dead = {
        let state = b.inner.state.lock();
        state.log().file_bytes() - state.log().live_bytes()
    };
    assert!(dead > 512 * PAGE / 8, "the dead bytes ({dead}) are past an eighth of the capacity: {s:?}");
    // Keep writing: the log nears its capacity and compaction starts.
    let mut worst = 0;
    for i in 0..600u32 {
        put(&b, &format!("n{i}"), i as u8, 3000);
        if i % 4 == 3 {
            b.reaper_tick();
        }
        worst = worst.max(segment_bytes_in(dir.path()));
        assert!(worst <= limit, "step {i}: {worst} bytes of segments > {limit} ({:?})", b.stats());
    }
    assert!(b.stats().compaction_moved > 0, "compaction ran once the room was needed ({:?})", b.stats());
}

/// Eviction walks the LRU from its cold end and steps over a leased key and a spared one,
/// evicting exactly as many keys as the target needs (no copy of the LRU is taken).
#[test]
fn eviction_takes_the_coldest_keys_in_order_and_steps_over_keys_in_use() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock, 8);
    b.stop_reaper();
    for k in ["a", "b", "c", "d", "e"] {
        put(&b, k, 1, 3000);
    }
    // `b` becomes the most recently used and leased: LRU order a, c, d, e, b.
    assert!(b.batch_resolve(&["b".to_owned()], false)[0].found);
    let now = clock.now();
    let mut state = b.inner.state.lock();
    let target = state.used() - 2 * PAGE;
    b.inner.evict_down_to(&mut state, target, now, &["a".to_owned()]);
    let mut left: Vec<&String> = state.owned_index().keys().collect();
    left.sort();
    assert_eq!(left, ["a", "b", "e"], "c and d go: a is spared, b is leased and warm");
    assert_eq!(state.lru().oldest_first().cloned().collect::<Vec<_>>(), ["a", "e", "b"]);
    // Nothing evictable but spared or leased keys: the walk ends at the warm end.
    b.inner.evict_down_to(&mut state, 0, now, &["a".to_owned(), "e".to_owned()]);
    assert_eq!(state.owned_count(), 3);
}

/// Making room in staging drops the least recently used unleased cached copy, and only as many
/// as needed: the use order is indexed, so this looks at leased copies and victims only.
#[test]
fn staging_pressure_drops_the_coldest_unleased_cached_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock, 3);
    b.stop_reaper();
    for k in ["a", "b", "c"] {
        put(&b, k, 1, 3000);
    }
    // `a` is resolved (leased, most recently used); cache order b, c, a.
    assert!(b.batch_resolve(&["a".to_owned()], false)[0].found);
    assert_eq!(b.batch_allocate(&[AllocateRequest::new("x", 10)])[0].outcome, AllocateOutcome::Allocated);
    {
        let state = b.inner.state.lock();
        assert!(!state.staged().contains_key("b"), "b was the coldest unleased copy");
        assert!(state.staged().contains_key("a") && state.staged().contains_key("c"));
        assert_eq!(state.staged().len(), 2);
    }
    assert_eq!(b.batch_allocate(&[AllocateRequest::new("y", 10)])[0].outcome, AllocateOutcome::Allocated);
    let state = b.inner.state.lock();
    assert!(state.staged().contains_key("a") && !state.staged().contains_key("c"), "the leased copy stays");
    // With only a leased copy left, no more room is made: busy (the drive has room).
    drop(state);
    assert_eq!(b.batch_allocate(&[AllocateRequest::new("z", 10)])[0].outcome, AllocateOutcome::Busy);
}

/// Compaction finds a segment's records through the per-segment index: after every pass the
/// index agrees with each key's record, no key points into a deleted segment, and records were
/// moved (so the index was what compaction used).
#[test]
fn compaction_through_the_segment_index_keeps_every_key_on_a_live_segment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let config = SsdConfig::builder([dir.path()])
        .page_size(PAGE)
        .capacity_bytes(256 * PAGE)
        .staging_pages(8)
        .segment_bytes(32 * PAGE)
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b.stop_reaper();
    for i in 0..600u32 {
        let key = format!("k{}", i % 150);
        b.evict(std::slice::from_ref(&key));
        put(&b, &key, i as u8, 3000);
        if i % 3 == 0 {
            b.reaper_tick();
            let state = b.inner.state.lock();
            state.owned_index().check();
            state.tombs().check();
            for (k, o) in state.owned_index().iter() {
                assert!(state.log().segs.contains_key(&o.loc.seg), "step {i}: {k} in a deleted segment");
            }
            for (k, t) in state.tombs().iter() {
                assert!(state.log().segs.contains_key(&t.loc.seg), "step {i}: tombstone of {k} in a deleted segment");
            }
        }
    }
    assert!(b.stats().compaction_moved > 0, "compaction ran ({:?})", b.stats());
    for i in 0..150u32 {
        let key = format!("k{i}");
        if let Some(v) = resolve_bytes(&b, &key) {
            assert_eq!(v.len(), 3000);
        }
    }
}

/// Waits (real time) up to `bound` for `cond`.
fn eventually(bound: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + bound;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    cond()
}

/// The log thread is stuck in a drive write (a tombstone): slot and lease expiry still run on
/// the reaper's interval.
#[test]
fn expiry_runs_while_the_log_thread_is_stuck_in_drive_io() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let config = SsdConfig::builder([dir.path()])
        .page_size(PAGE)
        .capacity_bytes(64 * PAGE)
        .staging_pages(8)
        .segment_bytes(256 * 1024)
        .read_lease_ttl(Duration::from_secs(5))
        .pending_ttl(Duration::from_secs(5))
        .reaper_interval(Duration::from_millis(5))
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b.stop_reaper();
    let gate = Arc::new(Gate::default());
    *b.inner.engine.write() = Some(Arc::clone(&gate) as Arc<dyn IoEngine>);
    gate.hold(LOG_THREAD);
    *b.reaper.lock() = Some(b.start_reaper().expect("reaper"));
    put(&b, "a", 1, 3000);
    put(&b, "b", 2, 3000);
    b.evict(&["a".to_owned()]);
    gate.wait_entered(LOG_THREAD);
    // A slot never committed and a read lease, both due once the clock moves on.
    let slot = b.batch_allocate(&[AllocateRequest::new("p", 10)]).remove(0);
    assert_eq!(slot.outcome, AllocateOutcome::Allocated);
    assert!(b.batch_resolve(&["b".to_owned()], false)[0].found);
    clock.advance(Duration::from_secs(6));
    let expired = eventually(Duration::from_secs(2), || {
        b.inner.counters.staging_expired_reclaim.load(Ordering::Relaxed) == 1
            && b.inner.state.lock().staged().get("b").is_some_and(|s| s.lease_until.is_none())
    });
    gate.release(LOG_THREAD);
    assert!(expired, "the slot and the lease expired while the log thread was held");
    assert!(!b.batch_commit(&[CommitRequest::new(slot.slot_id, "p")])[0].success, "the slot expired");
    b.shutdown();
}

/// A commit's drive write is held: allocate, a resolve of another key that reads the drive,
/// and an evict, each on its own thread, complete within a bound (the state lock is not held
/// across the write).
#[test]
fn the_state_lock_is_not_held_across_a_commits_drive_write() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let (b, gate) = gated(dir.path(), &clock);
    put(&b, "other", 0x11, 3000);
    put(&b, "victim", 0x22, 3000);
    // So the resolve of `other` has to read the drive.
    b.drop_cached_copies();
    gate.hold("w");
    let writer = spawn_put(&b, "w", "k", 0xAA);
    gate.wait_entered("w");
    let (tx, rx) = crossbeam_channel::unbounded::<&'static str>();
    let mut threads = Vec::new();
    let spawn = |name: &'static str, f: Box<dyn FnOnce(&SsdBackend) + Send>| {
        let (b, tx) = (Arc::clone(&b), tx.clone());
        std::thread::spawn(move || {
            f(&b);
            let _ = tx.send(name);
        })
    };
    threads.push(spawn(
        "allocate",
        Box::new(|b| {
            let a = b.batch_allocate(&[AllocateRequest::new("n", 10)]).remove(0);
            assert_eq!(a.outcome, AllocateOutcome::Allocated);
        }),
    ));
    threads.push(spawn("resolve", Box::new(|b| assert_eq!(resolve_bytes(b, "other"), Some(vec![0x11; 3000])))));
    threads.push(spawn(
        "evict",
        Box::new(|b| {
            let r = b.evict(&["victim".to_owned()]);
            assert!(r.len() == 1 && r[0].bytes_freed > 0, "{r:?}");
        }),
    ));
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while done.len() < 3 {
        match rx.recv_deadline(deadline) {
            Ok(name) => done.push(name),
            Err(_) => break,
        }
    }
    let held = !writer.is_finished();
    gate.release("w");
    writer.join().expect("writer");
    for t in threads {
        t.join().expect("a call panicked");
    }
    assert_eq!(done.len(), 3, "only {done:?} completed while a commit's write was held");
    assert!(held, "the commit's write was held throughout");
    assert_eq!(resolve_bytes(&b, "k"), Some(vec![0xAA; 3000]));
}

/// Retiring tombstones through the horizon index retires exactly the tombstones the rule
/// names (no segment up to the horizon but its own), checked against a scan of all of them
/// while eviction under pressure, re-puts and compaction make and drop tombstones.
#[test]
fn tombstones_retired_through_the_horizon_index_are_exactly_those_out_of_force() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let config = SsdConfig::builder([dir.path()])
        .page_size(PAGE)
        .capacity_bytes(128 * PAGE)
        .staging_pages(8)
        .segment_bytes(32 * PAGE)
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b.stop_reaper();
    let (mut seen, mut retired) = (0, 0);
    for i in 0..1500u32 {
        put(&b, &format!("k{}", (i * 7) % 400), i as u8, 3000);
        b.inner.flush_tombstones();
        if i % 5 == 0 {
            let mut state = b.inner.state.lock();
            let log = state.log();
            let out: std::collections::BTreeSet<String> = state
                .tombs()
                .iter()
                .filter(|(_, t)| !log.segs.range(..=t.horizon).any(|(id, _)| *id != t.loc.seg))
                .map(|(k, _)| k.clone())
                .collect();
            let before: std::collections::BTreeSet<String> = state.tombs().keys().cloned().collect();
            seen = seen.max(before.len());
            state.retire_tombstones();
            state.tombs().check();
            let after: std::collections::BTreeSet<String> = state.tombs().keys().cloned().collect();
            assert_eq!(before.difference(&after).cloned().collect::<std::collections::BTreeSet<_>>(), out);
            retired += out.len();
        }
        if i % 3 == 0 {
            b.reaper_tick();
        }
    }
    assert!(seen > 0 && retired > 0, "tombstones were made ({seen}) and retired ({retired})");
}

#[test]
fn adjacent_runs_cut_at_gaps_other_segments_and_the_iovec_cap() {
    // (segment, offset, length, iovecs)
    let recs = [
        (1, 0, 8192, 2),
        (1, 8192, 8192, 2),
        (1, 16384, 4096, 2),
        // A gap (another caller's record lies between): a new run.
        (1, 24576, 8192, 2),
        // Another segment (rollover): a new run.
        (2, 0, 8192, 2),
        (2, 8192, 8192, 2),
    ];
    assert_eq!(adjacent_runs(&recs, 1024), vec![0..3, 3..4, 4..6]);
    // The cap: at most 5 iovecs a run, so two records of 2 each, then a new run.
    assert_eq!(adjacent_runs(&recs[..3], 5), vec![0..2, 2..3]);
    // A record carrying more than the cap alone is still one run (one op).
    assert_eq!(adjacent_runs(&[(1, 0, 8192, 9), (1, 8192, 4096, 1)], 4), vec![0..1, 1..2]);
    assert!(adjacent_runs(&[], 4).is_empty());
}

#[test]
fn shared_with_others_counts_only_other_callers_writes() {
    let res = |seg: SegId, in_flight: u32| crate::store::Reservation {
        file: Arc::new(SegmentFile::new(seg, std::path::PathBuf::from("/nonexistent"), false, false, 0)),
        loc: Loc { seg, offset: 0, len: 4096, seq: 0 },
        in_flight,
    };
    let mut own = Vec::new();
    // This caller's first write, alone; then its own second and third: not shared.
    assert!(!shared_with_others(&res(1, 0), &mut own));
    assert!(!shared_with_others(&res(1, 1), &mut own));
    assert!(!shared_with_others(&res(1, 2), &mut own));
    // One more in flight than its own two: another caller's.
    assert!(shared_with_others(&res(1, 4), &mut own));
    // Counted per segment.
    assert!(!shared_with_others(&res(2, 0), &mut own));
    assert!(shared_with_others(&res(3, 1), &mut Vec::new()));
}

/// Wraps psync and records the shape of every write op: (offset, bytes, iovecs).
#[derive(Debug, Default)]
struct Recorder {
    writes: Mutex<Vec<(u64, usize, usize)>>,
}

impl IoEngine for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn submit(&self, ops: &mut [IoOp]) {
        for op in ops.iter() {
            let (write, bytes, iovecs) = op.shape();
            if write {
                self.writes.lock().push((op.offset(), bytes, iovecs));
            }
        }
        crate::io::PsyncEngine.submit(ops);
    }
}

fn roomy(dir: &std::path::Path, clock: &Arc<ManualClock>) -> SsdBackend {
    let config = SsdConfig::builder([dir])
        .page_size(PAGE)
        .capacity_bytes(1024 * PAGE)
        .staging_pages(64)
        .segment_bytes(256 * 1024)
        .watermarks(None)
        .clock(Arc::clone(clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b
}

/// Puts `keys` in one batch, key `i` filled with `fill + i`, 3000 bytes each.
fn put_batch(b: &SsdBackend, keys: &[String], fill: u8) {
    let reqs: Vec<AllocateRequest> = keys.iter().map(|k| AllocateRequest::new(k.clone(), 3000)).collect();
    let mut commits = Vec::new();
    for (i, (a, k)) in b.batch_allocate(&reqs).into_iter().zip(keys).enumerate() {
        assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {k}");
        // SAFETY: the page is the slot's, inside the arena, and 3000 bytes fit one page.
        unsafe { std::ptr::write_bytes(page_ptr(b, &a.pages[0]), fill.wrapping_add(i as u8), 3000) };
        commits.push(CommitRequest::new(a.slot_id, k.clone()));
    }
    assert!(b.batch_commit(&commits).iter().all(|c| c.success), "commit");
}

/// A batch's records reserved side by side go out as one write per segment (a rollover in the
/// middle of the batch cuts it in two), and every record comes back byte-exact after a restart:
/// the coalesced write is the same bytes at the same places as one write per record.
#[test]
fn a_batch_goes_out_as_one_write_per_segment_and_survives_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = roomy(dir.path(), &clock);
    b.stop_reaper();
    let rec = Arc::new(Recorder::default());
    *b.inner.engine.write() = Some(Arc::clone(&rec) as Arc<dyn IoEngine>);
    // 8 KiB records (a header block and a value page): 32 to a 256 KiB segment.
    let first: Vec<String> = (0..5).map(|i| format!("a{i}")).collect();
    put_batch(&b, &first, 10);
    assert_eq!(*rec.writes.lock(), vec![(0, 5 * 8192, 10)], "one write for the whole batch");
    rec.writes.lock().clear();
    // 27 records fill the first segment; the other 13 open the next.
    let second: Vec<String> = (0..40).map(|i| format!("b{i}")).collect();
    put_batch(&b, &second, 100);
    assert_eq!(*rec.writes.lock(), vec![(5 * 8192, 27 * 8192, 54), (0, 13 * 8192, 26)]);
    b.shutdown();
    drop(b);
    let b = roomy(dir.path(), &clock);
    assert_eq!(b.owned_key_count(), 45);
    for (keys, fill) in [(&first, 10u8), (&second, 100)] {
        for (i, k) in keys.iter().enumerate() {
            let bytes = resolve_bytes(&b, k).unwrap_or_else(|| panic!("{k} lost"));
            assert_eq!(bytes, vec![fill.wrapping_add(i as u8); 3000], "{k}");
        }
    }
}

/// A lone writer appends (the segment file is only as long as its records, its blocks
/// allocated ahead); once a write finds another caller's write in flight in its segment, the
/// file's size covers the whole segment, and both records survive a restart.
#[test]
fn a_lone_writer_appends_and_a_segment_shared_by_two_writers_is_sized() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let (b, gate) = gated(dir.path(), &clock);
    put(&b, "solo", 1, 3000);
    let seg = {
        let state = b.inner.state.lock();
        let (_, meta) = state.log().segs.iter().next().expect("a segment");
        Arc::clone(&meta.file)
    };
    let meta = fs::metadata(&seg.path).expect("stat");
    assert_eq!(meta.len(), 8192, "a lone writer appends");
    assert!(meta.blocks() * 512 >= 256 * 1024, "the segment's blocks are allocated ahead");
    assert!(!seg.is_sized());
    gate.hold("a");
    let a = spawn_put(&b, "a", "ka", 2);
    gate.wait_entered("a");
    spawn_put(&b, "b", "kb", 3).join().expect("b");
    assert!(seg.is_sized());
    assert_eq!(fs::metadata(&seg.path).expect("stat").len(), 256 * 1024, "sized for shared writes");
    gate.release("a");
    a.join().expect("a");
    let b = restarted(b, dir.path(), &clock);
    assert_eq!(resolve_bytes(&b, "solo"), Some(vec![1; 3000]));
    assert_eq!(resolve_bytes(&b, "ka"), Some(vec![2; 3000]));
    assert_eq!(resolve_bytes(&b, "kb"), Some(vec![3; 3000]));
}

/// The medium's `init` errors tell the caller what to do next through `BackendError::kind`: a
/// directory another medium holds is unavailable (its IO error kept as the source), a medium
/// shut down is closed, and a configuration past the open-file limit is invalid input.
#[test]
fn init_errors_carry_the_kind_that_says_what_to_do_next() {
    use std::error::Error as _;
    use umbp_core::ErrorKind;
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let a = backend(dir.path(), &clock, 4);
    let config = SsdConfig::builder([dir.path()]).page_size(PAGE).capacity_bytes(64 * PAGE).build().expect("config");
    let b = SsdBackend::new(config);
    let in_use = b.init(Arc::new(LocalOnlyRegistrar::new())).expect_err("the directory is a's");
    assert_eq!(in_use.kind(), ErrorKind::Unavailable, "{in_use}");
    assert!(in_use.source().is_some_and(|s| s.is::<io::Error>()), "the flock error is the source: {in_use:?}");
    a.shutdown();
    let closed = a.init(Arc::new(LocalOnlyRegistrar::new())).expect_err("a medium does not come back");
    assert_eq!(closed.kind(), ErrorKind::Closed, "{closed}");
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid `rlimit` for the call to fill.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    if got && limit.rlim_cur != libc::RLIM_INFINITY {
        // More segments in the capacity than the process may open files (refused before any IO).
        let huge = SsdConfig::builder([dir.path()])
            .page_size(PAGE)
            .capacity_bytes(32 * PAGE * (limit.rlim_cur + 16))
            .segment_bytes(32 * PAGE)
            .build()
            .expect("config");
        let err = SsdBackend::new(huge).init(Arc::new(LocalOnlyRegistrar::new())).expect_err("too many files");
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    }
}
