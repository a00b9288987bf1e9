//! Many threads at once against one `SsdBackend` with a small drive, so that LRU eviction, dead
//! segment deletion and compaction all run (the reaper in the background, plus explicit sweeps)
//! while writers and readers work: every value read back is the last one written under its key —
//! a miss is allowed (the key may have been evicted), wrong bytes never are. Each io engine.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend};
use umbp_ssd::{IoEngineKind, SsdBackend, SsdConfig, Watermarks};
use umbp_testkit::{LocalOnlyRegistrar, require};

const PAGE: u64 = 8192;
/// The least work a run must do to count: verified puts and reads over all threads.
const MIN_PUTS: u64 = 50;
const MIN_HITS: u64 = 10;

fn pattern(thread: usize, key: usize, version: u32, len: usize) -> Vec<u8> {
    let seed = (thread as u32).wrapping_mul(0x9E37_79B9) ^ (key as u32).wrapping_mul(0x85EB_CA6B) ^ version;
    (0..len).map(|i| (seed.wrapping_add(i as u32).wrapping_mul(2_654_435_761) >> 24) as u8).collect()
}

fn run(engine: IoEngineKind) {
    let dir = tempfile::Builder::new().prefix("umbp-ssd-stress").tempdir_in(std::env::temp_dir()).expect("tempdir");
    let config = SsdConfig::builder([dir.path().join("a"), dir.path().join("b")])
        .page_size(PAGE)
        .capacity_bytes(48 * PAGE)
        .staging_pages(24)
        .max_value_pages(2)
        .segment_bytes(256 * 1024)
        .io_engine(engine)
        .watermarks(Some(Watermarks { high: 0.9, low: 0.6 }))
        .read_lease_ttl(Duration::from_millis(5))
        .reaper_interval(Duration::from_millis(2))
        .build()
        .expect("config");
    let b = Arc::new(SsdBackend::new(config.clone()));
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    let base = b.buffer_ref(0).and_then(|r| r.local_region().map(|l| l.ptr().as_ptr() as usize)).expect("arena");
    // At least 1.5 s, and on a loaded machine longer (up to 20 s) until the run has done enough
    // work to mean something: a time bound alone once left the io_uring leg with too few reads.
    let (deadline, hard_deadline) =
        (Instant::now() + Duration::from_millis(1500), Instant::now() + Duration::from_secs(20));
    let (all_puts, all_hits) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let b = Arc::clone(&b);
            let (all_puts, all_hits) = (Arc::clone(&all_puts), Arc::clone(&all_hits));
            std::thread::spawn(move || {
                let base = base as *mut u8;
                let mut versions = [0u32; 16];
                let (mut puts, mut hits) = (0u64, 0u64);
                let mut step = 0usize;
                let enough =
                    || all_puts.load(Ordering::Relaxed) > MIN_PUTS && all_hits.load(Ordering::Relaxed) > MIN_HITS;
                while Instant::now() < deadline || (!enough() && Instant::now() < hard_deadline) {
                    step += 1;
                    let k = (step * 7 + t) % versions.len();
                    let key = format!("t{t}-k{k}");
                    let len = 1 + (step * 1237 + t * 31) % (2 * PAGE as usize);
                    if !step.is_multiple_of(3) {
                        let a = b.batch_allocate(&[AllocateRequest::new(key.clone(), len as u64)]).remove(0);
                        match a.outcome {
                            AllocateOutcome::Allocated => {
                                let v = pattern(t, k, versions[k] + 1, len);
                                for (j, p) in a.pages.iter().enumerate() {
                                    let off = j * PAGE as usize;
                                    let n = (len - off).min(PAGE as usize);
                                    // SAFETY: the page is in the arena and reserved for this slot.
                                    unsafe {
                                        std::ptr::copy_nonoverlapping(
                                            v[off..].as_ptr(),
                                            base.add(p.page_index as usize * PAGE as usize),
                                            n,
                                        )
                                    };
                                }
                                let c = b.batch_commit(&[CommitRequest::new(a.slot_id, key.clone())]).remove(0);
                                assert!(c.success, "commit of {key}");
                                if c.bytes_committed == len as u64 {
                                    versions[k] += 1;
                                    puts += 1;
                                    all_puts.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            // Owned already (only this thread writes the key): evict, write later.
                            AllocateOutcome::AlreadyExists => {
                                b.evict(std::slice::from_ref(&key));
                            }
                            AllocateOutcome::FailedNoSpace | AllocateOutcome::Busy => {}
                            AllocateOutcome::Failed => panic!("{key} of {len} bytes refused for good"),
                        }
                    } else {
                        let r = b.batch_resolve(std::slice::from_ref(&key), false).remove(0);
                        if r.found {
                            let mut got = Vec::with_capacity(r.size as usize);
                            let mut left = r.size as usize;
                            for p in &r.pages {
                                let n = left.min(PAGE as usize);
                                // SAFETY: the page is in the arena and leased to this reader.
                                got.extend_from_slice(unsafe {
                                    std::slice::from_raw_parts(base.add(p.page_index as usize * PAGE as usize), n)
                                });
                                left -= n;
                            }
                            let want = pattern(t, k, versions[k], r.size as usize);
                            assert!(got == want, "{key}: read back bytes of another version or key");
                            hits += 1;
                            all_hits.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if step.is_multiple_of(50) {
                        b.reaper_tick();
                    }
                    if step.is_multiple_of(20) {
                        // The next reads of these keys go to the drive.
                        b.drop_cached_copies();
                    }
                }
                (puts, hits, versions)
            })
        })
        .collect();
    let (mut puts, mut hits) = (0, 0);
    let mut latest = Vec::new();
    for t in threads {
        let (p, h, v) = t.join().expect("worker");
        puts += p;
        hits += h;
        latest.push(v);
    }
    let s = b.stats();
    eprintln!("{engine}: {puts} puts, {hits} verified reads, {s:?}");
    assert!(puts > MIN_PUTS && hits > MIN_HITS, "{engine}: too little work in 20 s: {puts} puts, {hits} reads");
    assert!(s.evicted > 0, "{engine}: the drive never filled: {s:?}");
    assert!(s.device_reads > 0, "{engine}: no read reached the drive: {s:?}");
    assert!(b.capacity().available_bytes <= b.capacity().total_bytes);
    let mut before: Vec<(String, u64)> = b.snapshot_owned_keys().into_iter().map(|e| (e.key, e.size)).collect();
    before.sort();
    b.shutdown();
    drop(b);

    // After all that churn, a restart recovers exactly the keys that were owned, each with the
    // last bytes written under it: no evicted key comes back, no older value either.
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("restart");
    let mut after: Vec<(String, u64)> = b.snapshot_owned_keys().into_iter().map(|e| (e.key, e.size)).collect();
    after.sort();
    assert_eq!(after, before, "{engine}: the recovered keys");
    let base = b.buffer_ref(0).and_then(|r| r.local_region().map(|l| l.ptr().as_ptr())).expect("arena");
    for (key, size) in &after {
        let (t, k) = key.trim_start_matches('t').split_once("-k").expect("key shape");
        let (t, k): (usize, usize) = (t.parse().expect("thread"), k.parse().expect("key"));
        let r = b.batch_resolve(std::slice::from_ref(key), false).remove(0);
        assert!(r.found, "{engine}: {key} resolves after the restart");
        let mut got = Vec::new();
        let mut left = *size as usize;
        for p in &r.pages {
            let n = left.min(PAGE as usize);
            // SAFETY: the page is in the arena and leased to this reader.
            got.extend_from_slice(unsafe {
                std::slice::from_raw_parts(base.add(p.page_index as usize * PAGE as usize), n)
            });
            left -= n;
        }
        assert!(got == pattern(t, k, latest[t][k], *size as usize), "{engine}: {key} recovered other bytes");
        // Let the read lease lapse, so its staging pages serve the next key.
        std::thread::sleep(Duration::from_millis(6));
    }
    b.shutdown();
}

#[test]
fn concurrent_writers_readers_eviction_and_reclaim_never_return_wrong_bytes() {
    run(IoEngineKind::Psync);
    match umbp_ssd::io_uring_available() {
        Ok(()) => run(IoEngineKind::IoUring),
        Err(e) => {
            require::skip(require::IO_URING, format_args!("the io_uring part: io_uring is not available here ({e})"))
        }
    }
}
