//! The SSD slot state machine against a reference model: random sequences of allocate, write +
//! commit, abort, resolve (+ read back), evict, drop of cached copies and clock moves (with reaper
//! sweeps) must leave the backend and a plain model in agreement on every answer, every event, the
//! owned keys, the capacity and the bytes read back. The staging arena and the drive are sized so
//! that no allocation runs out of room (exhaustion is tested on its own in `ssd_backend.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use umbp_core::{
    AllocateOutcome, AllocateRequest, Clock, CommitRequest, KvEvent, ManualClock, MediumBackend, TierType,
};
use umbp_ssd::{SsdBackend, SsdConfig};
use umbp_testkit::LocalOnlyRegistrar;

const PAGE: u64 = 4096;
const KEYS: usize = 6;
const LEASE: Duration = Duration::from_millis(100);
const TTL: Duration = Duration::from_millis(300);

#[derive(Debug, Clone)]
enum Op {
    Alloc { key: usize, size: u64 },
    Commit { slot: usize, key: usize, seed: u8 },
    Abort { slot: usize },
    Resolve { key: usize },
    Evict { key: usize },
    Advance { ms: u64 },
    DropCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..KEYS, 1..=2 * PAGE).prop_map(|(key, size)| Op::Alloc { key, size }),
        3 => (any::<usize>(), 0..KEYS, any::<u8>()).prop_map(|(slot, key, seed)| Op::Commit { slot, key, seed }),
        1 => any::<usize>().prop_map(|slot| Op::Abort { slot }),
        3 => (0..KEYS).prop_map(|key| Op::Resolve { key }),
        2 => (0..KEYS).prop_map(|key| Op::Evict { key }),
        2 => (0u64..250).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::DropCache),
    ]
}

fn key(i: usize) -> String {
    format!("key-{i}")
}

fn pattern(seed: u8, size: u64) -> Vec<u8> {
    (0..size).map(|i| (i as u8).wrapping_mul(7) ^ seed).collect()
}

#[derive(Debug)]
struct Slot {
    id: u64,
    size: u64,
    pages: Vec<umbp_core::PageLocation>,
    deadline: Instant,
}

#[derive(Debug, Default)]
struct Model {
    /// key → (size, seed)
    owned: BTreeMap<String, (u64, u8)>,
    /// key → lease end
    leases: BTreeMap<String, Instant>,
    pending: Vec<Slot>,
    events: Vec<KvEvent>,
}

fn pages(size: u64) -> u64 {
    size.div_ceil(PAGE)
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::Builder::new().prefix("umbp-ssd-model").tempdir_in(std::env::temp_dir()).expect("tempdir");
    let clock = ManualClock::new();
    let config = SsdConfig::builder([dir.path()])
        .page_size(PAGE)
        .capacity_bytes(128 * PAGE)
        .staging_pages(128)
        .max_value_pages(2)
        .segment_bytes(256 * 1024)
        .watermarks(None)
        .read_lease_ttl(LEASE)
        .pending_ttl(TTL)
        // The test sweeps by hand; the background reaper is slowed down to stay out of the way.
        .reaper_interval(Duration::from_secs(3600))
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    let base = b.buffer_ref(0).and_then(|r| r.local_region().map(|l| l.ptr().as_ptr())).expect("arena");
    let total = b.capacity().total_bytes;
    let mut m = Model::default();
    for op in ops {
        let now = clock.now();
        match op {
            Op::Alloc { key: k, size } => {
                let r = b.batch_allocate(&[AllocateRequest::new(key(k), size)]).remove(0);
                if m.owned.contains_key(&key(k)) {
                    prop_assert_eq!(r.outcome, AllocateOutcome::AlreadyExists);
                } else {
                    prop_assert_eq!(r.outcome, AllocateOutcome::Allocated);
                    prop_assert_eq!(r.pages.len() as u64, pages(size));
                    m.pending.push(Slot { id: r.slot_id, size, pages: r.pages, deadline: now + TTL });
                }
            }
            Op::Commit { slot, key: k, seed } => {
                if m.pending.is_empty() {
                    continue;
                }
                let s = m.pending.remove(slot % m.pending.len());
                let bytes = pattern(seed, s.size);
                for (j, p) in s.pages.iter().enumerate() {
                    let off = j * PAGE as usize;
                    let n = (bytes.len() - off).min(PAGE as usize);
                    // An expired slot's pages may have been handed out again: only live slots are
                    // written.
                    if s.deadline > now {
                        // SAFETY: the page is in the arena and reserved for this live pending slot.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                bytes[off..].as_ptr(),
                                base.add(p.page_index as usize * PAGE as usize),
                                n,
                            )
                        };
                    }
                }
                let c = b.batch_commit(&[CommitRequest::new(s.id, key(k))]).remove(0);
                if s.deadline <= now {
                    prop_assert!(!c.success, "an expired slot committed");
                } else if let Some((size, _)) = m.owned.get(&key(k)) {
                    prop_assert!(c.success && c.bytes_committed == *size, "a lost race: {:?}", c);
                } else {
                    prop_assert!(c.success && c.bytes_committed == s.size, "commit: {:?}", c);
                    m.owned.insert(key(k), (s.size, seed));
                    m.events.push(KvEvent::add(key(k), TierType::Ssd, s.size));
                }
            }
            Op::Abort { slot } => {
                if m.pending.is_empty() {
                    prop_assert_eq!(b.batch_abort(&[u64::MAX]), [true]);
                    continue;
                }
                let s = m.pending.remove(slot % m.pending.len());
                prop_assert_eq!(b.batch_abort(&[s.id]), [true]);
            }
            Op::Resolve { key: k } => {
                let r = b.batch_resolve(&[key(k)], true).remove(0);
                match m.owned.get(&key(k)) {
                    None => prop_assert!(!r.found),
                    Some((size, seed)) => {
                        prop_assert!(r.found && r.size == *size, "resolve of an owned key: {:?}", r);
                        let mut got = Vec::new();
                        for (j, p) in r.pages.iter().enumerate() {
                            let n = (*size as usize - j * PAGE as usize).min(PAGE as usize);
                            // SAFETY: the page is in the arena and leased to this reader.
                            got.extend_from_slice(unsafe {
                                std::slice::from_raw_parts(base.add(p.page_index as usize * PAGE as usize), n)
                            });
                        }
                        prop_assert!(got == pattern(*seed, *size), "bytes of {} differ", key(k));
                        let until = now + LEASE;
                        let e = m.leases.entry(key(k)).or_insert(until);
                        *e = (*e).max(until);
                    }
                }
            }
            Op::Evict { key: k } => {
                let freed = b.evict(&[key(k)]).remove(0).bytes_freed;
                let leased = m.leases.get(&key(k)).is_some_and(|t| *t > now);
                match m.owned.get(&key(k)) {
                    Some((size, _)) if !leased => {
                        prop_assert_eq!(freed, *size);
                        m.owned.remove(&key(k));
                        m.leases.remove(&key(k));
                        m.events.push(KvEvent::remove(key(k), TierType::Ssd));
                    }
                    _ => prop_assert_eq!(freed, 0),
                }
            }
            Op::Advance { ms } => {
                clock.advance(Duration::from_millis(ms));
                b.reaper_tick();
                let now = clock.now();
                m.pending.retain(|s| s.deadline > now);
            }
            Op::DropCache => b.drop_cached_copies(),
        }
        prop_assert_eq!(b.drain_pending_events(), std::mem::take(&mut m.events));
        prop_assert_eq!(b.owned_key_count(), m.owned.len());
        // Slots past their deadline may not have been swept yet; they still count until then.
        let now = clock.now();
        let pending: u64 = m.pending.iter().filter(|s| s.deadline > now).map(|s| pages(s.size) * PAGE).sum();
        let owned: u64 = m.owned.values().map(|(size, _)| pages(*size) * PAGE).sum();
        let available = b.capacity().available_bytes;
        prop_assert!(available <= total - owned - pending, "capacity: {} > {}", available, total - owned - pending);
    }
    // Every pending slot expired and swept: the capacity is exact.
    clock.advance(TTL + LEASE);
    b.reaper_tick();
    let owned: u64 = m.owned.values().map(|(size, _)| pages(*size) * PAGE).sum();
    prop_assert_eq!(b.capacity().available_bytes, total - owned);
    let mut snapshot: Vec<(String, u64)> = b.snapshot_owned_keys().into_iter().map(|e| (e.key, e.size)).collect();
    snapshot.sort();
    let expected: Vec<(String, u64)> = m.owned.iter().map(|(k, (s, _))| (k.clone(), *s)).collect();
    prop_assert_eq!(snapshot, expected);
    b.shutdown();
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn ssd_backend_matches_the_model(ops in prop::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
