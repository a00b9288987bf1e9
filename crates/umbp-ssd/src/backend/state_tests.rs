//! Property test of [`State`]'s byte accounting: arbitrary sequences of its methods, driven as the
//! backend drives them (allocate, commit in two phases, abort, evict, read in two phases, release,
//! expire, clear, tombstones, compaction, partial reads), with every invariant of the `state`
//! module checked after every step, every hit carrying the checksum its owned record was committed
//! with, and no partial read ever becoming a staged copy.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use umbp_core::{PageLocation, ReadRelease};
use umbp_page::PageBitmapAllocator;

use super::io_jobs::JobOutcome;
use super::read::Flight;
use super::state::{Filled, Hit, JobSlot, State};
use crate::record::record_len;
use crate::store::{DirState, Loc, Log};
use std::sync::Arc;

const PAGE: u64 = 4096;
const STAGING: u64 = 12;
const CAPACITY: u64 = 24 * PAGE;
const KEYS: u8 = 6;

#[derive(Debug, Clone)]
enum Op {
    Allocate { key: u8, size: u64 },
    Abort { slot: usize },
    BeginCommit { slot: usize, key: u8 },
    FinishCommit { commit: usize, ok: bool, cache: bool },
    Evict { key: u8 },
    EvictDownTo { target: u64 },
    Read { key: u8 },
    FinishRead { read: usize, outcome: u8 },
    ReadPart { key: u8, pages: u64 },
    FinishPart { read: usize, outcome: u8 },
    Release { lease: usize },
    Advance { ms: u64 },
    Clear,
    FlushTombstones { ok: bool },
    Compact,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..KEYS, 1..=4 * PAGE).prop_map(|(key, size)| Op::Allocate { key, size }),
        1 => any::<usize>().prop_map(|slot| Op::Abort { slot }),
        3 => (any::<usize>(), 0..KEYS).prop_map(|(slot, key)| Op::BeginCommit { slot, key }),
        3 => (any::<usize>(), prop::bool::weighted(0.85), any::<bool>())
            .prop_map(|(commit, ok, cache)| Op::FinishCommit { commit, ok, cache }),
        1 => (0..KEYS).prop_map(|key| Op::Evict { key }),
        1 => (0..=CAPACITY).prop_map(|target| Op::EvictDownTo { target }),
        2 => (0..KEYS).prop_map(|key| Op::Read { key }),
        2 => (any::<usize>(), 0..3u8).prop_map(|(read, outcome)| Op::FinishRead { read, outcome }),
        2 => (0..KEYS, 1..=4u64).prop_map(|(key, pages)| Op::ReadPart { key, pages }),
        2 => (any::<usize>(), 0..3u8).prop_map(|(read, outcome)| Op::FinishPart { read, outcome }),
        1 => any::<usize>().prop_map(|lease| Op::Release { lease }),
        1 => (0..200u64).prop_map(|ms| Op::Advance { ms }),
        1 => Just(Op::Clear),
        1 => any::<bool>().prop_map(|ok| Op::FlushTombstones { ok }),
        1 => Just(Op::Compact),
    ]
}

/// A commit between its lock phases.
struct Commit {
    key: String,
    loc: Loc,
    pages: Vec<PageLocation>,
    size: u64,
    generation: u64,
    flight: Arc<Flight>,
}

/// A drive read between its lock phases.
struct Read {
    key: String,
    pages: Vec<PageLocation>,
    size: u64,
    loc: Loc,
    generation: u64,
    crc32c: Option<u32>,
    flight: Option<Arc<Flight>>,
}

fn live_state() -> State {
    let mut state = State::new(PAGE);
    let log = Log {
        dirs: vec![DirState {
            // Never opened: the log's accounting is metadata only.
            path: std::path::PathBuf::from("/nonexistent/umbp-ssd-proptest"),
            direct: false,
            share: CAPACITY,
            physical: 0,
            active: None,
        }],
        segment_bytes: 8 * PAGE,
        next_seq: 1,
        ..Log::default()
    };
    let staging = PageBitmapAllocator::new(PAGE, &[STAGING * PAGE]).expect("allocator");
    state.install(staging, CAPACITY, log, Vec::new(), Vec::new());
    state
}

fn key(k: u8) -> String {
    format!("k{k}")
}

/// The writer's checksum the model commits a record of `seq` with: none for some, so a hit that
/// kept a checksum it should not (or lost one) shows.
fn crc_of_seq(seq: u64) -> Option<u32> {
    (!seq.is_multiple_of(3)).then_some((seq as u32).wrapping_mul(0x9E37_79B9))
}

/// A hit of `key` must hand back the checksum its owned record was committed with.
fn check_hit(state: &State, key: &str, hit: &Hit) {
    let owned = state.owned(key).expect("a hit is of an owned key");
    assert_eq!(hit.crc32c, crc_of_seq(owned.loc.seq), "the hit of {key} carries its record's checksum");
}

/// Runs `ops` against a live state, checking the invariants after each.
fn run(ops: &[Op]) {
    let mut state = live_state();
    let start = Instant::now();
    let mut now = start;
    let (mut slots, mut commits, mut reads, mut leases) =
        (Vec::new(), Vec::<Commit>::new(), Vec::<Read>::new(), Vec::new());
    let mut parts = Vec::<Read>::new();
    let mut next_slot = 1;
    for (step, op) in ops.iter().enumerate() {
        match op.clone() {
            Op::Allocate { key: k, size } => {
                let bytes = size.div_ceil(PAGE) * PAGE;
                if !state.owns(&key(k)) && state.has_room(bytes) {
                    if let Some(pages) = state.admit(next_slot, size, now + Duration::from_millis(100), now) {
                        assert_eq!(pages.len() as u64, size.div_ceil(PAGE));
                        slots.push(next_slot);
                    }
                    next_slot += 1;
                }
            }
            Op::Abort { slot } if !slots.is_empty() => {
                let id = slots.swap_remove(slot % slots.len());
                state.abort(id);
            }
            Op::BeginCommit { slot, key: k } if !slots.is_empty() => {
                let id = slots.swap_remove(slot % slots.len());
                let k = key(k);
                if state.writer_of(std::iter::once(k.as_str())).is_some() {
                    // The backend waits for the other batch; here the slot goes back to the pool.
                    slots.push(id);
                    continue;
                }
                let Some(slot) = state.begin_commit(id) else { continue };
                if slot.generation != state.generation() || slot.deadline <= now || state.owns(&k) {
                    state.abandon_commit(&slot.pages, slot.size);
                    continue;
                }
                let (res, flight) = state.reserve_commit(&k, record_len(k.len(), slot.size));
                let generation = state.generation();
                commits.push(Commit { key: k, loc: res.loc, pages: slot.pages, size: slot.size, generation, flight });
            }
            Op::FinishCommit { commit, ok, cache } if !commits.is_empty() => {
                let c = commits.swap_remove(commit % commits.len());
                let crc32c = crc_of_seq(c.loc.seq);
                let slot = JobSlot { pages: c.pages, size: c.size, loc: c.loc, generation: c.generation, crc32c };
                state.finish_commit(&c.key, slot, ok, cache);
                state.end_writing(&c.key, &c.flight);
            }
            Op::Evict { key: k } if state.evictable(&key(k), now) => {
                state.drop_owned(&key(k), now);
            }
            Op::EvictDownTo { target } => {
                state.evict_lru(|s| s.used() > target, now, &foldhash::HashSet::default());
            }
            Op::Read { key: k } => {
                let k = key(k);
                let until = now + Duration::from_millis(150);
                if let Some(hit) = state.hold_staged(&k, now, until) {
                    check_hit(&state, &k, &hit);
                    leases.push(ReadRelease { key: k, lease: hit.lease });
                } else if state.flight_of(&k).is_none()
                    && let Some(owned) = state.owned(&k)
                    && let Some(pages) = state.take_staging(owned.size.div_ceil(PAGE), now)
                {
                    let flight = state.start_read(&k, true);
                    let generation = state.generation();
                    let (size, loc, crc32c) = (owned.size, owned.loc, owned.crc32c);
                    reads.push(Read { key: k, pages, size, loc, generation, crc32c, flight });
                }
            }
            Op::FinishRead { read, outcome } if !reads.is_empty() => {
                let r = reads.swap_remove(read % reads.len());
                let outcome = [JobOutcome::Ok, JobOutcome::IoError, JobOutcome::Corrupt][outcome as usize];
                let until = now + Duration::from_millis(150);
                let slot =
                    JobSlot { pages: r.pages, size: r.size, loc: r.loc, generation: r.generation, crc32c: r.crc32c };
                let filled = state.finish_read(&r.key, r.flight.as_ref(), slot, outcome, now, until);
                if let Filled::Hit(hit) = filled {
                    check_hit(&state, &r.key, &hit);
                    leases.push(ReadRelease { key: r.key, lease: hit.lease });
                }
            }
            Op::ReadPart { key: k, pages } => {
                // As the backend: a cached copy is served whole; otherwise some of the value's
                // pages are staged for this reader alone (no flight).
                let k = key(k);
                let until = now + Duration::from_millis(150);
                if let Some(hit) = state.hold_staged(&k, now, until) {
                    check_hit(&state, &k, &hit);
                    leases.push(ReadRelease { key: k, lease: hit.lease });
                } else if let Some(owned) = state.owned(&k)
                    && let Some(pages) = state.take_staging(pages.min(owned.size.div_ceil(PAGE)), now)
                {
                    assert!(state.start_read(&k, false).is_none(), "a partial read leads no flight");
                    let generation = state.generation();
                    let (size, loc, crc32c) = (owned.size, owned.loc, owned.crc32c);
                    parts.push(Read { key: k, pages, size, loc, generation, crc32c, flight: None });
                }
            }
            Op::FinishPart { read, outcome } if !parts.is_empty() => {
                let r = parts.swap_remove(read % parts.len());
                let outcome = [JobOutcome::Ok, JobOutcome::IoError, JobOutcome::Corrupt][outcome as usize];
                let until = now + Duration::from_millis(150);
                let staged_before = state.staged().contains_key(&r.key);
                let slot =
                    JobSlot { pages: r.pages, size: r.size, loc: r.loc, generation: r.generation, crc32c: r.crc32c };
                if let Some(lease) = state.finish_partial(&r.key, slot, outcome, now, until) {
                    leases.push(ReadRelease { key: r.key.clone(), lease });
                }
                let staged_after = state.staged().contains_key(&r.key);
                assert!(staged_after == staged_before || !staged_after, "a partial read became a staged copy");
            }
            Op::Release { lease } if !leases.is_empty() => {
                let r = leases.swap_remove(lease % leases.len());
                state.release_read(&r, now);
            }
            Op::Advance { ms } => {
                now += Duration::from_millis(ms);
                state.expire(now);
                // The model keeps the ids of the slots this expired: a later abort or commit of
                // one finds nothing, as the backend's would.
            }
            Op::Clear => {
                state.clear(now);
            }
            Op::FlushTombstones { ok } => {
                let generation = state.generation();
                for (k, seq, horizon) in state.take_tomb_pending() {
                    let res = state.log_mut().reserve(record_len(k.len(), 8));
                    state.log_mut().finish_write(res.loc.seg);
                    if ok {
                        state.land_tombstone(k, Loc { seq, ..res.loc }, horizon, generation, now);
                    } else {
                        state.log_mut().seal(res.loc.seg);
                    }
                }
                state.retire_tombstones();
                state.log_mut().take_dead_segments();
            }
            Op::Compact => {
                let Some(seg) = state.log().oldest_sealed() else { continue };
                let Some(victims) = state.start_compaction(seg) else { continue };
                for (k, old, tomb) in victims {
                    if state.record_loc(&k, tomb) != Some(old) {
                        continue;
                    }
                    let res = state.reserve_copy(old.len);
                    state.log_mut().finish_write(res.loc.seg);
                    state.move_record(&k, tomb, old, Loc { seq: old.seq, ..res.loc });
                }
                state.end_compaction();
            }
            _ => {}
        }
        let in_flight: Vec<(Vec<PageLocation>, u64)> = commits.iter().map(|c| (c.pages.clone(), c.size)).collect();
        let out: u64 = reads.iter().chain(&parts).map(|r| r.pages.len() as u64).sum();
        let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| state.check(&in_flight, out)));
        if let Err(e) = checked {
            panic!("after step {step} ({op:?}) of {ops:?}: {:?}", e.downcast_ref::<String>());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whatever the sequence of operations, `used` is the pending slots plus the commits in flight
    /// plus the owned values (never above the capacity), the overhead is the owned records', every
    /// staging page in use has exactly one holder, and the log's live bytes are the index's.
    #[test]
    fn state_accounting_holds_under_any_sequence(ops in prop::collection::vec(op(), 1..120)) {
        run(&ops);
    }
}

/// A fixed sequence through every path (a smoke test that the model above reaches them).
#[test]
fn state_accounting_holds_through_a_put_read_evict_clear_cycle() {
    run(&[
        Op::Allocate { key: 0, size: 5000 },
        Op::Allocate { key: 1, size: 100 },
        Op::BeginCommit { slot: 0, key: 0 },
        Op::BeginCommit { slot: 0, key: 1 },
        Op::FinishCommit { commit: 0, ok: true, cache: false },
        Op::FinishCommit { commit: 0, ok: true, cache: true },
        Op::Read { key: 0 },
        Op::Read { key: 1 },
        Op::FinishRead { read: 0, outcome: 0 },
        Op::Release { lease: 0 },
        Op::ReadPart { key: 0, pages: 1 },
        Op::FinishPart { read: 0, outcome: 0 },
        Op::Release { lease: 0 },
        Op::ReadPart { key: 0, pages: 1 },
        Op::FinishPart { read: 0, outcome: 0 },
        Op::Advance { ms: 200 },
        Op::Evict { key: 1 },
        Op::FlushTombstones { ok: true },
        Op::Compact,
        Op::Allocate { key: 2, size: 9000 },
        Op::Clear,
        Op::BeginCommit { slot: 0, key: 2 },
        Op::Advance { ms: 500 },
    ]);
}
