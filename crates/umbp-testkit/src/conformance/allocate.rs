//! Allocation: outcomes, sizes, dedup and the pages handed out.

use std::collections::BTreeSet;

use umbp_core::{AllocateOutcome, AllocateRequest, PageLocation};

use super::fixture::{Fixture, keys};

pub(super) fn empty_batches_return_empty(fx: &Fixture<'_>) {
    let s = fx.live();
    let b = &s.backend;
    assert!(b.batch_allocate(&[]).is_empty(), "batch_allocate([]) is not empty");
    assert!(b.batch_commit(&[]).is_empty(), "batch_commit([]) is not empty");
    assert!(b.batch_abort(&[]).is_empty(), "batch_abort([]) is not empty");
    assert!(b.batch_resolve(&[], true).is_empty(), "batch_resolve([], true) is not empty");
    assert!(b.batch_resolve(&[], false).is_empty(), "batch_resolve([], false) is not empty");
    assert!(b.evict(&[]).is_empty(), "evict([]) is not empty");
    assert!(s.drain().is_empty(), "empty batches queued events");
    assert_eq!(s.available(), s.total(), "empty batches changed capacity");
}

pub(super) fn zero_size_is_failed(fx: &Fixture<'_>) {
    let s = fx.live();
    assert_eq!(s.alloc("zero", 0).outcome, AllocateOutcome::Failed, "a 0-byte value");
    let r = s.backend.batch_allocate(&[AllocateRequest::new("zero", 0), AllocateRequest::new("one", 1)]);
    let outcomes: Vec<_> = r.iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [AllocateOutcome::Failed, AllocateOutcome::Allocated], "a 0-byte value beside a 1-byte one");
    assert_eq!(s.available(), s.total() - s.ps(), "only the 1-byte value reserves a page");
    assert!(s.drain().is_empty(), "allocation queued events");
}

pub(super) fn key_larger_than_medium_is_failed_not_no_space(fx: &Fixture<'_>) {
    let s = fx.live();
    let (total, ps) = (s.total(), s.ps());
    let too_big = [total + 1, (s.pages_total() + 1) * ps, u64::MAX - 1, u64::MAX];
    for size in too_big {
        assert_eq!(
            s.alloc("huge", size).outcome,
            AllocateOutcome::Failed,
            "{size} bytes on an empty {total}-byte medium"
        );
    }
    // Partly full: still Failed (no peer of this size would do better), while a value that fits
    // the medium but not its free space is FailedNoSpace (an emptier peer could take it).
    s.put("resident", 1);
    for size in too_big {
        assert_eq!(s.alloc("huge", size).outcome, AllocateOutcome::Failed, "{size} bytes on a partly full medium");
    }
    assert_eq!(s.alloc("whole", total).outcome, AllocateOutcome::FailedNoSpace, "a medium-sized value, partly full");
    assert_eq!(s.available(), total - ps, "failed allocations reserved pages");
}

pub(super) fn value_of_full_capacity_fits_an_empty_medium(fx: &Fixture<'_>) {
    let s = fx.live();
    let total = s.total();
    let r = s.alloc_ok("whole", total);
    assert_eq!(r.pages.len() as u64, s.pages_total(), "a medium-sized value takes every page");
    s.assert_pages_valid(&r.pages, "medium-sized value");
    assert_eq!(s.available(), 0, "a medium-sized slot leaves nothing available");
    assert!(s.commit(r.slot_id, "whole").success, "commit of the medium-sized value");
    assert_eq!(s.resolve("whole", false).size, total, "resolved size");
    s.expire(s.read_lease);
    assert_eq!(s.evict("whole"), total, "evicting the medium-sized value");
    assert_eq!(s.available(), total, "capacity after evicting everything");
}

pub(super) fn full_medium_reports_no_space_then_recovers_after_abort(fx: &Fixture<'_>) {
    let s = fx.live();
    let (ps, n) = (s.ps(), s.pages_total());
    let requests: Vec<_> = (0..n).map(|i| AllocateRequest::new(format!("fill-{i}"), ps)).collect();
    let filled = s.backend.batch_allocate(&requests);
    assert_eq!(filled.len() as u64, n, "one result per request");
    for (i, r) in filled.iter().enumerate() {
        assert_eq!(r.outcome, AllocateOutcome::Allocated, "one-page value {i} of {n} on a {n}-page medium");
    }
    assert_eq!(s.available(), 0, "every page is reserved");
    assert_eq!(s.alloc("extra", 1).outcome, AllocateOutcome::FailedNoSpace, "one byte more on a full medium");
    assert!(s.abort(filled[0].slot_id), "abort of a pending slot");
    assert_eq!(s.available(), ps, "an abort returns its page");
    let again = s.alloc_ok("extra", 1);
    assert_eq!(s.alloc("extra-2", 1).outcome, AllocateOutcome::FailedNoSpace, "full again");
    let mut slots: Vec<u64> = filled.iter().skip(1).map(|r| r.slot_id).collect();
    slots.push(again.slot_id);
    assert!(s.backend.batch_abort(&slots).iter().all(|ok| *ok), "abort of every pending slot");
    assert_eq!(s.available(), s.total(), "aborting everything frees everything");
}

pub(super) fn allocate_result_describes_its_pages(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let size = 2 * ps + 1;
    let r = s.alloc_ok("three-pages", size);
    assert_eq!(r.pages.len(), 3, "a value of 2 pages + 1 byte takes 3 pages");
    s.assert_pages_valid(&r.pages, "allocate");
    assert_eq!((r.size, r.page_size), (size, ps), "allocate echoes the size and reports the page size");
    let ttl_ms = u64::try_from(s.pending_ttl.as_millis()).unwrap_or(u64::MAX);
    assert_eq!(r.pending_ttl_ms, ttl_ms, "pending_ttl_ms is the configured pending TTL");
    assert_eq!(r.descs, s.descs_for(&r.pages), "descs: one per buffer the pages use, ascending");
    assert_eq!(s.available(), s.total() - 3 * ps, "the slot reserves its pages");
    assert!(s.drain().is_empty(), "an allocation queues no event");
}

pub(super) fn batch_allocate_answers_positionally(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("owned", ps);
    let requests = [
        AllocateRequest::new("a", ps),
        AllocateRequest::new("zero", 0),
        AllocateRequest::new("owned", ps),
        AllocateRequest::new("huge", s.total() + 1),
        AllocateRequest::new("b", 2 * ps),
    ];
    let r = s.backend.batch_allocate(&requests);
    let outcomes: Vec<_> = r.iter().map(|r| r.outcome).collect();
    use AllocateOutcome::{Allocated, AlreadyExists, Failed};
    assert_eq!(outcomes, [Allocated, Failed, AlreadyExists, Failed, Allocated], "outcomes in request order");
    assert_eq!((r[0].size, r[4].size), (ps, 2 * ps), "sizes echo their own requests");
    assert_eq!((r[0].pages.len(), r[4].pages.len()), (1, 2), "page counts follow their own requests");
    assert_ne!(r[0].slot_id, r[4].slot_id, "two slots share an id");
    assert_eq!(s.available(), s.total() - 4 * ps, "capacity after the batch");
}

pub(super) fn allocate_dedups_owned_key(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("k", ps);
    let available = s.available();
    for size in [ps, 2 * ps, 1] {
        assert_eq!(s.alloc("k", size).outcome, AllocateOutcome::AlreadyExists, "allocate of an owned key ({size} B)");
    }
    assert_eq!(s.available(), available, "AlreadyExists reserved pages");
    assert_eq!(s.drain(), [s.add("k", ps)], "only the first commit queued an event");
    assert_eq!(s.evict("k"), ps, "evict");
    s.alloc_ok("k", ps);
}

pub(super) fn pending_duplicates_are_allowed(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let r = s.backend.batch_allocate(&[AllocateRequest::new("k", ps), AllocateRequest::new("k", ps)]);
    assert_eq!(r.len(), 2, "one result per request");
    let third = s.alloc_ok("k", ps);
    let all = [&r[0], &r[1], &third];
    for (i, a) in all.iter().enumerate() {
        assert_eq!(a.outcome, AllocateOutcome::Allocated, "pending slot {i} for one key (pending never dedups)");
    }
    let ids: BTreeSet<u64> = all.iter().map(|a| a.slot_id).collect();
    assert!(ids.len() == 3 && !ids.contains(&0), "slot ids must be distinct and non-zero: {ids:?}");
    let pages: Vec<PageLocation> = all.iter().flat_map(|a| a.pages.clone()).collect();
    s.assert_pages_valid(&pages, "three pending slots of one key");
    assert_eq!(s.available(), s.total() - 3 * ps, "each pending slot holds its own page");
    let ids: Vec<u64> = ids.into_iter().collect();
    assert_eq!(s.backend.batch_abort(&ids), [true; 3], "abort");
    assert_eq!(s.available(), s.total(), "aborts free everything");
}

pub(super) fn pages_of_live_values_never_overlap(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let mut pages = Vec::new();
    let mut slots = Vec::new();
    let mut committed = Vec::new();
    // Mixed sizes until full; every other value committed.
    for i in 0.. {
        let key = format!("v{i}");
        let size = (i % 3 + 1) * ps;
        let r = s.alloc(&key, size);
        match r.outcome {
            AllocateOutcome::Allocated => {}
            AllocateOutcome::FailedNoSpace if size > ps => continue,
            AllocateOutcome::FailedNoSpace => break,
            other => panic!("allocate({key}, {size}) on a medium with room returned {other:?}"),
        }
        pages.extend(r.pages.iter().copied());
        s.assert_pages_valid(&pages, "every page of every live slot and key");
        if i % 2 == 0 {
            assert!(s.commit(r.slot_id, &key).success, "commit {key}");
            committed.push(key);
        } else {
            slots.push(r.slot_id);
        }
    }
    assert_eq!(pages.len() as u64, s.pages_total(), "filling the medium used every page");
    assert_eq!(s.available(), 0, "a filled medium has nothing available");
    assert!(s.backend.batch_abort(&slots).iter().all(|ok| *ok), "abort");
    let freed = s.backend.evict(&keys(&committed.iter().map(String::as_str).collect::<Vec<_>>()));
    assert!(freed.iter().all(|e| e.bytes_freed > 0), "evicting unleased keys frees them: {freed:?}");
    assert_eq!(s.available(), s.total(), "freeing everything restores capacity");
}

pub(super) fn multi_page_values_round_trip_bookkeeping(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("one", 1);
    let size = 2 * ps + 1;
    let a = s.put("three", size);
    assert_eq!(a.pages.len(), 3, "2 pages + 1 byte takes 3 pages");
    s.assert_pages_valid(&a.pages, "a three-page value");
    let one = s.resolve("one", false);
    assert!(a.pages.iter().all(|p| !one.pages.contains(p)), "two values share a page");
    let r = s.resolve("three", true);
    assert!(r.found, "a committed three-page value resolves");
    assert_eq!((r.pages.as_slice(), r.size, r.page_size), (a.pages.as_slice(), size, ps), "resolve");
    assert_eq!(r.descs, s.descs_for(&r.pages), "resolve descs");
    s.expire(s.read_lease);
    let before = s.available();
    assert_eq!(s.evict("three"), size, "evict reports the value's size");
    assert_eq!(s.available(), before + 3 * ps, "evict frees all three pages");
}

/// An idle medium (no pending slot of anyone else, no live read lease) answers every allocation
/// with a slot, a dedup or — full — `FailedNoSpace`, never busy: busy is only for a transient
/// resource held by work in flight, and a medium with nothing in flight holds none. Written one
/// value at a time (each committed and read back, with the read released, before the next), then
/// past full, then after an eviction.
pub(super) fn an_idle_medium_never_answers_allocate_busy(fx: &Fixture<'_>) {
    let s = fx.live();
    let (ps, n) = (s.ps(), s.pages_total());
    let busy = |r: &umbp_core::AllocateResult, what: &str| {
        assert_ne!(r.outcome, AllocateOutcome::Busy, "{what}: busy from a medium with nothing in flight");
    };
    let mut stored = Vec::new();
    for i in 0..n {
        let key = format!("idle-{i}");
        let r = s.alloc(&key, ps);
        busy(&r, &key);
        if r.outcome != AllocateOutcome::Allocated {
            // A medium that evicts on its own may answer otherwise; it just must not be busy.
            continue;
        }
        assert!(s.commit(r.slot_id, &key).success, "commit of {key}");
        let hit = s.resolve(&key, false);
        assert!(hit.found, "{key} reads back");
        if hit.lease != 0 {
            s.backend.release_reads(&[umbp_core::ReadRelease::new(key.clone(), hit.lease)]);
        }
        stored.push(key);
    }
    // Leases that only lapse (lease 0) end here.
    s.expire(s.read_lease);
    let more = s.alloc("one-more", ps);
    busy(&more, "a value past full");
    if more.outcome == AllocateOutcome::Allocated {
        assert!(s.abort(more.slot_id));
    }
    let batch = s.backend.batch_allocate(&[AllocateRequest::new("more-a", ps), AllocateRequest::new("more-b", 1)]);
    for r in &batch {
        busy(r, "a batch past full");
    }
    let ids: Vec<u64> = batch.iter().filter(|r| r.outcome == AllocateOutcome::Allocated).map(|r| r.slot_id).collect();
    s.backend.batch_abort(&ids);
    let Some(first) = stored.first() else { return };
    if s.evict(first) > 0 {
        let r = s.alloc("after-evict", ps);
        assert_eq!(r.outcome, AllocateOutcome::Allocated, "an idle medium with a page free takes a one-page value");
        assert!(s.abort(r.slot_id));
    }
}
