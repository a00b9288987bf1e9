//! Evict, resolve, read leases and the capacity they account for.

use umbp_core::{AllocateOutcome, EvictResult, ResolvedEntry};

use super::fixture::{Fixture, keys};

pub(super) fn evict_results_one_per_key_in_order(fx: &Fixture<'_>) {
    let s = fx.live();
    let size = 2 * s.ps() + 1;
    s.put("k", size);
    let r = s.backend.evict(&keys(&["miss-1", "k", "miss-2"]));
    let expected = [
        EvictResult { key: "miss-1".into(), bytes_freed: 0 },
        EvictResult { key: "k".into(), bytes_freed: size },
        EvictResult { key: "miss-2".into(), bytes_freed: 0 },
    ];
    assert_eq!(r, expected, "evict results are positional");
    assert_eq!(s.drain(), [s.add("k", size), s.remove("k")], "events");
}

pub(super) fn evict_unknown_is_zero_and_evict_is_idempotent(fx: &Fixture<'_>) {
    let s = fx.live();
    assert_eq!(s.evict("never-stored"), 0, "evict of an unknown key");
    let ps = s.ps();
    s.put("k", ps);
    let r = s.backend.evict(&keys(&["k", "k"]));
    let freed: Vec<u64> = r.iter().map(|e| e.bytes_freed).collect();
    assert_eq!(freed, [ps, 0], "one key twice in one evict: freed once, in request order");
    assert_eq!(s.evict("k"), 0, "evict of an already evicted key");
    assert_eq!(s.backend.owned_key_count(), 0, "owned keys");
    assert_eq!(s.available(), s.total(), "capacity");
    assert_eq!(s.drain(), [s.add("k", ps), s.remove("k")], "exactly one Remove");
}

pub(super) fn evict_never_touches_pending_slots(fx: &Fixture<'_>) {
    let s = fx.live();
    let a = s.alloc_ok("p", s.ps());
    assert_eq!(s.evict("p"), 0, "evict of a key that is only pending");
    assert_eq!(s.available(), s.total() - s.ps(), "evict freed a pending slot's pages");
    assert!(s.commit(a.slot_id, "p").success, "the pending slot still commits after an evict of its key");
    assert_eq!(s.drain(), [s.add("p", s.ps())], "no Remove for a pending key");
}

pub(super) fn read_lease_blocks_evict_until_expiry(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("k", ps);
    assert!(s.resolve("k", false).found, "resolve");
    assert_eq!(s.evict("k"), 0, "evict of a key under a read lease");
    assert!(s.resolve("k", false).found, "a leased key must survive evict");
    assert_eq!(s.backend.owned_key_count(), 1, "owned keys");
    s.tick();
    assert_eq!(s.evict("k"), 0, "a sweep before the lease ends released it");
    s.expire(s.read_lease);
    assert_eq!(s.evict("k"), ps, "evict after the lease ended");
    assert_eq!(s.available(), s.total(), "capacity");
    assert_eq!(s.drain(), [s.add("k", ps), s.remove("k")], "one Remove, only for the successful evict");
}

pub(super) fn resolve_renews_the_read_lease(fx: &Fixture<'_>) {
    let s = fx.live();
    let lease = s.read_lease;
    s.put("k", 1);
    assert!(s.resolve("k", false).found, "first resolve");
    s.advance(lease / 2);
    assert!(s.resolve("k", false).found, "second resolve");
    // Past the first lease, inside the second.
    s.advance(lease * 3 / 4);
    s.tick();
    assert_eq!(s.evict("k"), 0, "a later reader's lease must protect the key for its full length");
    s.expire(lease);
    assert_eq!(s.evict("k"), 1, "evict once every lease ended");
}

pub(super) fn resolve_miss_takes_no_lease(fx: &Fixture<'_>) {
    let s = fx.live();
    for include_descs in [false, true] {
        assert_eq!(s.resolve("k", include_descs), ResolvedEntry::miss(), "a miss carries nothing");
    }
    s.put("k", 1);
    assert_eq!(s.evict("k"), 1, "a miss before the commit took a lease on the key");
}

pub(super) fn batch_resolve_answers_positionally(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let a = s.put("a", 1);
    let b = s.put("b", 2 * ps + 1);
    let r = s.backend.batch_resolve(&keys(&["b", "x", "a", "b"]), true);
    assert_eq!(r.len(), 4, "one entry per key");
    let found: Vec<bool> = r.iter().map(|e| e.found).collect();
    assert_eq!(found, [true, false, true, true], "hits and misses in request order");
    assert_eq!(r[1], ResolvedEntry::miss(), "a miss carries nothing");
    for (i, (alloc, size)) in [(0, (&b, 2 * ps + 1)), (2, (&a, 1)), (3, (&b, 2 * ps + 1))] {
        let e = &r[i];
        assert_eq!((e.pages.as_slice(), e.size, e.page_size), (alloc.pages.as_slice(), size, ps), "entry {i}");
        assert_eq!(e.descs, s.descs_for(&e.pages), "entry {i} descs");
    }
    assert!(s.backend.batch_resolve(&keys(&["a", "b"]), false).iter().all(|e| e.descs.is_empty()), "unasked descs");
}

pub(super) fn capacity_accounting(fx: &Fixture<'_>) {
    let s = fx.live();
    let (total, ps) = (s.total(), s.ps());
    let a = s.alloc_ok("k", 2 * ps);
    assert_eq!(s.available(), total - 2 * ps, "allocate reserves the slot's pages");
    assert!(s.commit(a.slot_id, "k").success, "commit");
    assert_eq!(s.available(), total - 2 * ps, "commit keeps the same pages");
    assert_eq!(s.alloc("k", ps).outcome, AllocateOutcome::AlreadyExists, "dedup");
    assert_eq!(s.alloc("zero", 0).outcome, AllocateOutcome::Failed, "zero size");
    assert!(s.resolve("k", false).found, "resolve");
    assert_eq!(s.available(), total - 2 * ps, "dedup, failures and resolve reserve nothing");
    let b = s.alloc_ok("p", ps);
    assert_eq!(s.available(), total - 3 * ps, "a second slot");
    assert!(s.abort(b.slot_id), "abort");
    assert_eq!(s.available(), total - 2 * ps, "abort returns its pages");
    s.expire(s.read_lease);
    assert_eq!(s.evict("k"), 2 * ps, "evict");
    assert_eq!(s.available(), total, "evict returns the pages");
    assert_eq!(s.total(), total, "total never moves");
}

pub(super) fn owned_key_count_tracks_commits_and_evicts(fx: &Fixture<'_>) {
    let s = fx.live();
    let count = || s.backend.owned_key_count();
    assert_eq!(count(), 0, "fresh medium");
    let pending = s.alloc_ok("a", 1);
    assert_eq!(count(), 0, "a pending slot is not an owned key");
    assert!(s.commit(pending.slot_id, "a").success, "commit a");
    assert_eq!(count(), 1, "after committing a");
    let winner = s.alloc_ok("b", 1);
    let loser = s.alloc_ok("b", 1);
    assert!(s.commit(winner.slot_id, "b").success, "commit b");
    assert_eq!(count(), 2, "after committing b");
    assert!(s.commit(loser.slot_id, "b").success, "a lost race succeeds");
    assert_eq!(count(), 2, "a lost race adds no key");
    assert_eq!(s.evict("a"), 1, "evict a");
    assert_eq!(s.evict("a"), 0, "evict a again");
    assert_eq!(count(), 1, "after evicting a");
    assert_eq!(s.evict("b"), 1, "evict b");
    assert_eq!(count(), 0, "after evicting b");
    s.put("c", 1);
    s.backend.clear_local();
    assert_eq!(count(), 0, "after clear_local");
}
