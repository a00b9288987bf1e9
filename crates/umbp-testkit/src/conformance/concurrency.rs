//! Many callers at once: peer-service handlers and the heartbeat share one medium.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::resume_unwind;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use umbp_core::{AllocateOutcome, CommitResult, KvEventKind};

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
            // Other clients hold the pages right now; a real writer would try another peer.
            AllocateOutcome::FailedNoSpace => continue,
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
