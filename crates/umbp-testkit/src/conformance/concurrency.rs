//! Many callers at once: peer-service handlers and the heartbeat share one medium.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::resume_unwind;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;

use umbp_core::{AllocateOutcome, CommitResult, KvEvent, KvEventKind};

use super::fixture::{Fixture, Live};

const CLIENTS: usize = 6;
const ROUNDS: usize = 48;

#[derive(Default)]
struct ClientLog {
    /// Every key this client committed, with its size.
    committed: Vec<(String, u64)>,
    /// Every key this client evicted.
    evicted: Vec<String>,
    /// Committed, resolved (so leased) and therefore still owned: `(key, size)`.
    survivors: Vec<(String, u64)>,
}

/// One client's loop over its own keys: allocate, then abort, or commit and evict, or commit and
/// keep under a read lease. A failure panics with the client's number.
fn client(s: &Live, t: usize) -> ClientLog {
    let ps = s.ps();
    let mut log = ClientLog::default();
    for i in 0..ROUNDS {
        let key = format!("client{t}-{i}");
        let size = if i % 2 == 0 { 1 } else { ps + 1 };
        let a = s.alloc(&key, size);
        match a.outcome {
            AllocateOutcome::Allocated => {}
            // Other clients hold the pages right now; a real writer would try another peer (or,
            // busy, this one again).
            AllocateOutcome::FailedNoSpace | AllocateOutcome::Busy => continue,
            other => panic!("client {t}: allocate({key}, {size}) returned {other:?}"),
        }
        match i % 4 {
            0 => assert!(s.abort(a.slot_id), "client {t}: abort of {key}"),
            // Only two clients keep a key, one page each, so the others never starve.
            2 if t < 2 && log.survivors.is_empty() => {
                let c = s.commit(a.slot_id, &key);
                assert_eq!(c, CommitResult { success: true, bytes_committed: size }, "client {t}: commit {key}");
                log.committed.push((key.clone(), size));
                assert_eq!(s.resolve(&key, false).size, size, "client {t}: resolve {key}");
                assert_eq!(s.evict(&key), 0, "client {t}: evict of leased {key}");
                log.survivors.push((key, size));
            }
            _ => {
                let c = s.commit(a.slot_id, &key);
                assert_eq!(c, CommitResult { success: true, bytes_committed: size }, "client {t}: commit {key}");
                log.committed.push((key.clone(), size));
                assert_eq!(s.evict(&key), size, "client {t}: evict of {key}");
                log.evicted.push(key.clone());
                assert!(!s.resolve(&key, false).found, "client {t}: {key} resolves after its evict");
                assert_eq!(s.evict(&key), 0, "client {t}: second evict of {key}");
            }
        }
    }
    log
}

pub(super) fn concurrent_clients_keep_accounting_exact(fx: &Fixture<'_>) {
    let s = fx.live();
    let s = &s;
    let done = AtomicBool::new(false);
    let (logs, shipped) = thread::scope(|scope| {
        let heartbeat = scope.spawn(|| {
            let mut shipped = Vec::new();
            while !done.load(Ordering::Acquire) {
                shipped.extend(s.drain());
                let c = s.backend.capacity();
                assert!(c.available_bytes <= c.total_bytes, "heartbeat: capacity {c:?}");
                s.backend.snapshot_owned_keys();
                thread::yield_now();
            }
            shipped
        });
        let clients: Vec<_> = (0..CLIENTS).map(|t| scope.spawn(move || client(s, t))).collect();
        // Join every client before stopping the heartbeat, so a failing client cannot leave it spinning.
        let joined: Vec<_> = clients.into_iter().map(|c| c.join()).collect();
        done.store(true, Ordering::Release);
        let shipped = heartbeat.join().unwrap_or_else(|p| resume_unwind(p));
        let logs: Vec<ClientLog> = joined.into_iter().map(|j| j.unwrap_or_else(|p| resume_unwind(p))).collect();
        (logs, shipped)
    });

    let mut events = shipped;
    events.extend(s.drain());
    let committed: BTreeMap<&str, u64> =
        logs.iter().flat_map(|l| &l.committed).map(|(k, n)| (k.as_str(), *n)).collect();
    let evicted: BTreeSet<&str> = logs.iter().flat_map(|l| &l.evicted).map(String::as_str).collect();
    let survivors: Vec<&(String, u64)> = logs.iter().flat_map(|l| &l.survivors).collect();
    assert!(!committed.is_empty(), "no client managed a single commit");

    assert_eq!(events.len(), committed.len() + evicted.len(), "one Add per commit and one Remove per evict");
    let mut added = BTreeMap::new();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.tier, s.backend.tier(), "event {e:?} names another tier");
        match e.kind {
            KvEventKind::Add => {
                assert_eq!(committed.get(e.key.as_str()), Some(&e.size), "Add {e:?} for no commit of that size");
                assert!(added.insert(e.key.as_str(), i).is_none(), "a second Add for {}", e.key);
            }
            KvEventKind::Remove => {
                assert!(evicted.contains(e.key.as_str()), "Remove {e:?} for no evict");
                assert!(added.contains_key(e.key.as_str()), "the Remove of {} came before its Add", e.key);
            }
        }
    }

    let ps = s.ps();
    assert_eq!(s.backend.owned_key_count(), survivors.len(), "owned keys after the clients finished");
    let held: u64 = survivors.iter().map(|(_, n)| s.pages_of(*n) * ps).sum();
    assert_eq!(s.available(), s.total() - held, "only the survivors' pages are in use");
    let snapshot: BTreeSet<String> = s.backend.snapshot_owned_keys().into_iter().map(|e| e.key).collect();
    let expected: BTreeSet<String> = survivors.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(snapshot, expected, "the snapshot lists exactly the survivors");

    s.expire(s.read_lease);
    for (key, size) in &survivors {
        assert_eq!(s.evict(key), *size, "evict of survivor {key} once its lease ended");
    }
    assert_eq!((s.available(), s.backend.owned_key_count()), (s.total(), 0), "everything freed at the end");
}

pub(super) fn concurrent_commits_of_one_key_keep_one_value(fx: &Fixture<'_>) {
    const WRITERS: usize = 4;
    let s = fx.live();
    let ps = s.ps();
    for round in 0..8 {
        let key = format!("shared-{round}");
        // Allocate up front: a panic before the barrier would leave the other writers waiting.
        let slots: Vec<(u64, u64)> = (0..WRITERS)
            .map(|t| {
                let size = (t as u64 + 1).min(ps);
                (s.alloc_ok(&key, size).slot_id, size)
            })
            .collect();
        let barrier = Barrier::new(WRITERS);
        let results: Vec<CommitResult> = thread::scope(|scope| {
            let handles: Vec<_> = slots
                .iter()
                .map(|(slot, _)| {
                    let (s, key, barrier) = (&s, &key, &barrier);
                    scope.spawn(move || {
                        barrier.wait();
                        s.commit(*slot, key)
                    })
                })
                .collect();
            let joined: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
            joined.into_iter().map(|j| j.unwrap_or_else(|p| resume_unwind(p))).collect()
        });
        let winner = s.resolve(&key, false);
        assert!(winner.found, "round {round}: no commit stored the key");
        assert!(slots.iter().any(|(_, n)| *n == winner.size), "round {round}: stored size is nobody's");
        for r in &results {
            assert_eq!(*r, CommitResult { success: true, bytes_committed: winner.size }, "round {round}: {results:?}");
        }
        assert_eq!(s.available(), s.total() - ps, "round {round}: the losers' pages are freed");
        assert_eq!(s.drain(), [s.add(&key, winner.size)], "round {round}: one Add");
        s.expire(s.read_lease);
        assert_eq!(s.evict(&key), winner.size, "round {round}: evict");
        assert_eq!(s.drain(), [s.remove(&key)], "round {round}: one Remove");
    }
}

/// Writers in [`full_sync_snapshot_is_atomic_under_concurrent_commits`].
const SYNC_WRITERS: usize = 4;
/// Full syncs the heartbeat runs while the writers write.
const FULL_SYNCS: usize = 200;
/// Drains the heartbeat applies after each full sync.
const DRAINS_PER_FULL_SYNC: usize = 3;
/// A bound on each writer's keys, should the heartbeat stall.
const MAX_SYNC_ROUNDS: usize = 200_000;
/// Keys each writer keeps at most (the rest it evicts at once); few, so snapshots stay cheap.
const MAX_KEPT_PER_WRITER: u64 = 2;

/// Sets its flag when dropped, so that a failing thread still releases the ones waiting on it.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// The master's index of one medium: key → size.
type Index = BTreeMap<String, u64>;

/// Applies drained deltas in order, as the master does. With distinct keys, every Add is for a key
/// the index lacks and every Remove for one it holds; anything else means an event was lost or
/// delivered twice across a full-sync snapshot.
fn apply_deltas(index: &mut Index, events: Vec<KvEvent>, s: &Live, what: &str) {
    for e in events {
        assert_eq!(e.tier, s.backend.tier(), "{what}: event {e:?} names another tier");
        match e.kind {
            KvEventKind::Add => {
                if let Some(size) = index.insert(e.key.clone(), e.size) {
                    panic!("{what}: Add of {} which the index already holds ({size} bytes)", e.key);
                }
            }
            KvEventKind::Remove => {
                if index.remove(&e.key).is_none() {
                    panic!(
                        "{what}: Remove of {} which the index never held: its Add was lost (dropped from the \
                         outbox but missing from the full-sync snapshot?)",
                        e.key
                    );
                }
            }
        }
    }
}

/// A full sync: the snapshot replaces the index.
fn full_sync(s: &Live) -> Index {
    let mut index = Index::new();
    for e in s.backend.snapshot_owned_keys_for_full_sync() {
        assert_eq!((e.kind, e.tier), (KvEventKind::Add, s.backend.tier()), "full-sync snapshot entry {e:?}");
        assert!(index.insert(e.key.clone(), e.size).is_none(), "the full-sync snapshot lists {} twice", e.key);
    }
    index
}

/// One writer: commits distinct one-byte keys until `stop`, evicting each right after except every
/// eighth, which it keeps while its budget lasts. Returns the kept keys.
fn sync_writer(s: &Live, t: usize, keep_budget: usize, stop: &AtomicBool) -> Vec<(String, u64)> {
    let mut kept = Vec::new();
    for i in 0..MAX_SYNC_ROUNDS {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let key = format!("sync{t}-{i}");
        let a = s.alloc(&key, 1);
        match a.outcome {
            AllocateOutcome::Allocated => {}
            AllocateOutcome::FailedNoSpace | AllocateOutcome::Busy => {
                thread::yield_now();
                continue;
            }
            other => panic!("writer {t}: allocate({key}, 1) returned {other:?}"),
        }
        let c = s.commit(a.slot_id, &key);
        assert_eq!(c, CommitResult { success: true, bytes_committed: 1 }, "writer {t}: commit {key}");
        // Pause with the key committed but not yet evicted: a heartbeat that runs now (on a machine
        // with fewer cores than threads, it runs only when a writer pauses) sees the key straddle
        // its full sync, which is where a snapshot that is not atomic with its outbox clear loses
        // events. It also keeps the writers from starving the heartbeat of the lock.
        thread::yield_now();
        if i % 8 == 7 && kept.len() < keep_budget {
            kept.push((key, 1));
        } else {
            assert_eq!(s.evict(&key), 1, "writer {t}: evict {key}");
        }
    }
    kept
}

pub(super) fn full_sync_snapshot_is_atomic_under_concurrent_commits(fx: &Fixture<'_>) {
    let s = fx.live();
    let s = &s;
    // Each writer holds at most one transient page; what is left is shared out for keeping.
    let spare = s.pages_total().saturating_sub(SYNC_WRITERS as u64) / SYNC_WRITERS as u64;
    let keep_budget = usize::try_from(spare.min(MAX_KEPT_PER_WRITER)).unwrap_or(0);
    let stop = AtomicBool::new(false);
    let start = Barrier::new(SYNC_WRITERS + 1);
    let (mut index, kept) = thread::scope(|scope| {
        let (stop, start) = (&stop, &start);
        let heartbeat = scope.spawn(move || {
            // The writers stop once the heartbeat is done, or has failed.
            let _stop = SetOnDrop(stop);
            start.wait();
            let mut index = Index::new();
            // The last full sync races the writers too, so nothing after it rebuilds the index from
            // scratch and hides what it lost.
            for sync in 1..=FULL_SYNCS {
                index = full_sync(s);
                for _ in 0..DRAINS_PER_FULL_SYNC {
                    apply_deltas(&mut index, s.drain(), s, &format!("a drain after full sync {sync}"));
                }
            }
            index
        });
        let writers: Vec<_> = (0..SYNC_WRITERS)
            .map(|t| {
                scope.spawn(move || {
                    start.wait();
                    sync_writer(s, t, keep_budget, stop)
                })
            })
            .collect();
        let joined: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        let index = heartbeat.join().unwrap_or_else(|p| resume_unwind(p));
        let kept: Vec<(String, u64)> =
            joined.into_iter().flat_map(|j| j.unwrap_or_else(|p| resume_unwind(p))).collect();
        (index, kept)
    });
    apply_deltas(&mut index, s.drain(), s, "the final drain");
    let owned: Index = s.backend.snapshot_owned_keys().into_iter().map(|e| (e.key, e.size)).collect();
    let lost: Vec<&String> = owned.keys().filter(|k| !index.contains_key(*k)).collect();
    let stale: Vec<&String> = index.keys().filter(|k| !owned.contains_key(*k)).collect();
    assert!(
        lost.is_empty() && stale.is_empty(),
        "the index rebuilt from full syncs and drains differs from the owned keys: missing {lost:?}, stale \
         {stale:?} (the full-sync snapshot and its outbox clear must be one critical section)"
    );
    assert_eq!(index, owned, "the rebuilt index's sizes");
    let kept: Index = kept.into_iter().collect();
    assert_eq!(owned, kept, "the owned keys are exactly the ones the writers kept");
}

/// Committers in [`clear_local_races_no_new_owned_key_before_ack`].
const CLEAR_COMMITTERS: usize = 3;
/// Successful commits to wait for before clearing.
const COMMITS_BEFORE_CLEAR: usize = 8;
/// Rounds each committer runs after it has seen the clear return.
const ROUNDS_AFTER_CLEAR: usize = 64;

/// One committer: allocate, commit and evict distinct keys until `stop`. After it has seen
/// `cleared` (set once `clear_local` returned), no allocation may succeed, a slot allocated earlier
/// may not commit, and no key may be owned.
fn clear_committer(
    s: &Live,
    t: usize,
    commits: &AtomicUsize,
    cleared: &AtomicBool,
    after_clear: &AtomicUsize,
    stop: &AtomicBool,
) {
    let mut i = 0usize;
    while !stop.load(Ordering::Acquire) {
        let key = format!("clear{t}-{i}");
        i += 1;
        let clear_returned = cleared.load(Ordering::Acquire);
        let a = s.alloc(&key, 1);
        if clear_returned {
            after_clear.fetch_add(1, Ordering::AcqRel);
            assert_eq!(s.backend.owned_key_count(), 0, "committer {t}: a key is owned between clear and ack");
        }
        match a.outcome {
            AllocateOutcome::Allocated => {
                assert!(!clear_returned, "committer {t}: allocate({key}) succeeded between clear_local and the ack")
            }
            AllocateOutcome::Failed | AllocateOutcome::FailedNoSpace | AllocateOutcome::Busy => {
                thread::yield_now();
                continue;
            }
            other => panic!("committer {t}: allocate({key}, 1) returned {other:?}"),
        }
        let clear_returned = cleared.load(Ordering::Acquire);
        let c = s.commit(a.slot_id, &key);
        if c.success {
            assert!(
                !clear_returned,
                "committer {t}: {key}, allocated before clear_local, committed after it returned: {c:?}"
            );
            assert_eq!(c.bytes_committed, 1, "committer {t}: commit {key}");
            commits.fetch_add(1, Ordering::AcqRel);
            // 1 byte, or 0 when a clear dropped the key first.
            let freed = s.evict(&key);
            assert!(freed <= 1, "committer {t}: evict {key} freed {freed} bytes");
        } else {
            assert!(s.abort(a.slot_id), "committer {t}: abort of {key}'s slot");
        }
    }
}

pub(super) fn clear_local_races_no_new_owned_key_before_ack(fx: &Fixture<'_>) {
    let s = fx.live();
    let s = &s;
    let parked = s.alloc_ok("parked", 1);
    let commits = AtomicUsize::new(0);
    let cleared = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let after_clear: Vec<AtomicUsize> = (0..CLEAR_COMMITTERS).map(|_| AtomicUsize::new(0)).collect();
    let running = AtomicUsize::new(CLEAR_COMMITTERS);
    thread::scope(|scope| {
        let (commits, cleared, stop, running) = (&commits, &cleared, &stop, &running);
        let committers: Vec<_> = after_clear
            .iter()
            .enumerate()
            .map(|(t, after_clear)| {
                scope.spawn(move || {
                    /// Counts the committer out however it ends.
                    struct Exit<'a>(&'a AtomicUsize);
                    impl Drop for Exit<'_> {
                        fn drop(&mut self) {
                            self.0.fetch_sub(1, Ordering::AcqRel);
                        }
                    }
                    let _exit = Exit(running);
                    clear_committer(s, t, commits, cleared, after_clear, stop);
                })
            })
            .collect();
        // Whatever happens below, the committers stop.
        let stopper = SetOnDrop(stop);
        let alive = || running.load(Ordering::Acquire) > 0;
        while commits.load(Ordering::Acquire) < COMMITS_BEFORE_CLEAR && alive() {
            thread::yield_now();
        }
        s.backend.clear_local();
        cleared.store(true, Ordering::Release);
        while alive() && after_clear.iter().any(|n| n.load(Ordering::Acquire) < ROUNDS_AFTER_CLEAR) {
            assert_eq!(s.backend.owned_key_count(), 0, "a key is owned between clear_local and the ack");
            assert!(s.backend.snapshot_owned_keys().is_empty(), "the snapshot lists a key between clear and ack");
            assert!(s.backend.is_clear_full_sync_pending(), "the clear is no longer pending before the ack");
            thread::yield_now();
        }
        let c = s.commit(parked.slot_id, "parked");
        assert!(!c.success, "a slot allocated before clear_local committed after it: {c:?}");
        drop(stopper);
        let joined: Vec<_> = committers.into_iter().map(|c| c.join()).collect();
        for j in joined {
            j.unwrap_or_else(|p| resume_unwind(p));
        }
    });
    assert!(commits.load(Ordering::Acquire) >= COMMITS_BEFORE_CLEAR, "the committers never committed");
    assert_eq!(s.backend.owned_key_count(), 0, "a key is owned before the ack");
    assert!(s.drain().is_empty(), "events queued between clear_local and the ack");
    assert!(s.abort(parked.slot_id), "abort of the parked slot");
    s.backend.clear_full_sync_acked();
    assert_eq!(s.available(), s.total(), "every page is free once the racing slots are committed, failed or aborted");
    s.put("after-ack", 1);
    assert_eq!(s.drain(), [s.add("after-ack", 1)], "allocation works again after the ack");
}
