//! Commit, abort and the pending-slot TTL.

use std::thread;
use std::time::{Duration, Instant};

use umbp_core::{CommitRequest, CommitResult};

use super::fixture::Fixture;

const FAILED: CommitResult = CommitResult { success: false, bytes_committed: 0 };

pub(super) fn commit_makes_key_resolvable(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let size = 2 * ps + ps / 2 + 1;
    let a = s.alloc_ok("v", size);
    assert!(!s.resolve("v", false).found, "a pending key resolves before its commit");
    let c = s.commit(a.slot_id, "v");
    assert_eq!(c, CommitResult { success: true, bytes_committed: size }, "commit of a fresh slot");
    assert_eq!(s.backend.owned_key_count(), 1, "owned keys after one commit");
    let r = s.resolve("v", false);
    assert!(r.found, "a committed key resolves");
    assert_eq!((r.pages.as_slice(), r.size, r.page_size), (a.pages.as_slice(), size, ps), "resolve after commit");
    assert!(r.descs.is_empty(), "descs were not asked for");
    let r = s.resolve("v", true);
    assert_eq!(r.descs, s.descs_for(&r.pages), "descs when asked for");
    assert_eq!(s.drain(), [s.add("v", size)], "one Add with the value's size and the medium's tier");
}

pub(super) fn commit_binds_the_commit_time_key(fx: &Fixture<'_>) {
    let s = fx.live();
    let a = s.alloc_ok("allocated-as", 1);
    assert!(s.commit(a.slot_id, "committed-as").success, "commit under another key");
    assert!(!s.resolve("allocated-as", false).found, "the allocate-time key is only a dedup hint");
    assert!(s.resolve("committed-as", false).found, "the commit-time key is stored");
    assert_eq!(s.drain(), [s.add("committed-as", 1)], "the Add names the commit-time key");
}

pub(super) fn commit_race_first_wins(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let first = s.alloc_ok("k", ps);
    let second = s.alloc_ok("k", 2 * ps);
    assert_eq!(s.available(), s.total() - 3 * ps, "two pending slots");
    assert_eq!(s.commit(first.slot_id, "k"), CommitResult { success: true, bytes_committed: ps }, "first commit");
    assert_eq!(
        s.commit(second.slot_id, "k"),
        CommitResult { success: true, bytes_committed: ps },
        "the losing commit succeeds and reports the winner's size"
    );
    assert_eq!(s.available(), s.total() - ps, "the loser's pages are freed");
    let r = s.resolve("k", false);
    assert_eq!((r.pages.as_slice(), r.size), (first.pages.as_slice(), ps), "the first value stays");
    assert_eq!(s.backend.owned_key_count(), 1, "one key");

    // The same race inside one batch.
    let x = s.alloc_ok("j", 1);
    let y = s.alloc_ok("j", ps);
    let c = s.backend.batch_commit(&[CommitRequest::new(x.slot_id, "j"), CommitRequest::new(y.slot_id, "j")]);
    let won = CommitResult { success: true, bytes_committed: 1 };
    assert_eq!(c, [won, won], "a race inside one batch: first in request order wins");
    assert_eq!(s.available(), s.total() - 2 * ps, "after both races");
    assert_eq!(s.drain(), [s.add("k", ps), s.add("j", 1)], "one Add per key, none for a lost race");
}

pub(super) fn commit_keeps_the_writers_checksum(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let crc = 0x8a91_36aa;
    let with = s.alloc_ok("with", ps);
    let without = s.alloc_ok("without", 1);
    let c = s.backend.batch_commit(&[
        CommitRequest::new(with.slot_id, "with").with_crc32c(Some(crc)),
        CommitRequest::new(without.slot_id, "without"),
    ]);
    assert!(c.iter().all(|r| r.success), "commits with and without a checksum: {c:?}");
    assert_eq!(s.resolve("with", false).crc32c, Some(crc), "a committed checksum comes back at resolve");
    assert_eq!(s.resolve("with", true).crc32c, Some(crc), "and with descriptors asked for");
    assert_eq!(s.resolve("without", false).crc32c, None, "no checksum committed, none resolved");
    assert_eq!(s.resolve("absent", false).crc32c, None, "a miss carries no checksum");

    // A lost commit race keeps the first writer's value, so it keeps the first writer's checksum.
    let first = s.alloc_ok("race", 1);
    let second = s.alloc_ok("race", 1);
    assert!(s.backend.batch_commit(&[CommitRequest::new(first.slot_id, "race").with_crc32c(Some(1))])[0].success);
    assert!(s.backend.batch_commit(&[CommitRequest::new(second.slot_id, "race").with_crc32c(Some(2))])[0].success);
    assert_eq!(s.resolve("race", false).crc32c, Some(1), "the winner's checksum stays with the winner's bytes");
}

pub(super) fn commit_unknown_slot_fails(fx: &Fixture<'_>) {
    let s = fx.live();
    let real = s.alloc_ok("real", 1);
    let requests: Vec<_> = [0, u64::MAX, u64::MAX - 1].into_iter().map(|id| CommitRequest::new(id, "ghost")).collect();
    assert_eq!(s.backend.batch_commit(&requests), [FAILED; 3], "commit of slots never handed out (incl. 0)");
    assert_eq!(s.backend.owned_key_count(), 0, "a failed commit created a key");
    assert!(!s.resolve("ghost", false).found, "a failed commit made its key resolvable");
    assert!(s.commit(real.slot_id, "real").success, "failed commits disturbed a real slot");
    assert_eq!(s.drain(), [s.add("real", 1)], "failed commits queued events");
}

pub(super) fn commit_after_abort_fails(fx: &Fixture<'_>) {
    let s = fx.live();
    let a = s.alloc_ok("k", s.ps());
    assert!(s.abort(a.slot_id), "abort");
    assert_eq!(s.available(), s.total(), "abort frees the slot's pages");
    // A fresh slot for the same key must not inherit the aborted slot's id.
    let b = s.alloc_ok("k", s.ps());
    assert_ne!(a.slot_id, b.slot_id, "an aborted slot id was handed out again");
    assert_eq!(s.commit(a.slot_id, "k"), FAILED, "commit of an aborted slot");
    assert!(!s.resolve("k", false).found, "the aborted slot's commit stored the key");
    assert!(s.commit(b.slot_id, "k").success, "the fresh slot commits");
    assert_eq!(s.drain(), [s.add("k", s.ps())], "one Add");
}

pub(super) fn commit_consumes_the_slot(fx: &Fixture<'_>) {
    let s = fx.live();
    let a = s.alloc_ok("k", 1);
    assert!(s.commit(a.slot_id, "k").success, "first commit");
    assert_eq!(s.commit(a.slot_id, "other"), FAILED, "a second commit of one slot under another key");
    assert!(!s.resolve("other", false).found, "a used slot stored a second key");
    assert_eq!(s.backend.owned_key_count(), 1, "one key");
    assert_eq!(s.available(), s.total() - s.ps(), "one page in use");
    assert_eq!(s.drain(), [s.add("k", 1)], "one Add");
}

pub(super) fn batch_commit_answers_positionally(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let a = s.alloc_ok("a", 1);
    let b = s.alloc_ok("b", 2 * ps);
    let requests = [CommitRequest::new(a.slot_id, "a"), CommitRequest::new(0, "x"), CommitRequest::new(b.slot_id, "b")];
    let expected = [
        CommitResult { success: true, bytes_committed: 1 },
        FAILED,
        CommitResult { success: true, bytes_committed: 2 * ps },
    ];
    assert_eq!(s.backend.batch_commit(&requests), expected, "commit results in request order");
    assert_eq!(s.drain(), [s.add("a", 1), s.add("b", 2 * ps)], "Adds in commit order");
}

pub(super) fn abort_is_idempotent(fx: &Fixture<'_>) {
    let s = fx.live();
    assert_eq!(s.backend.batch_abort(&[0, u64::MAX, 12_345]), [true; 3], "abort of slots never handed out");
    let a = s.alloc_ok("k", s.ps());
    assert_eq!(s.backend.batch_abort(&[a.slot_id, a.slot_id]), [true, true], "one slot twice in one batch");
    assert!(s.abort(a.slot_id), "abort of an already aborted slot");
    assert_eq!(s.available(), s.total(), "aborts freed exactly the slot's pages");
    let c = s.put("owned", s.ps());
    assert!(s.abort(c.slot_id), "abort of a committed slot");
    assert!(s.resolve("owned", false).found, "abort of a committed slot dropped the key");
    assert_eq!(s.available(), s.total() - s.ps(), "abort of a committed slot freed its pages");
    assert_eq!(s.drain(), [s.add("owned", s.ps())], "aborts queue no events");
}

pub(super) fn pending_slot_expires_after_ttl(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let early = s.alloc_ok("early", ps);
    let late = s.alloc_ok("late", ps);
    let half = s.pending_ttl / 2;
    s.advance(half);
    s.tick();
    assert!(s.commit(early.slot_id, "early").success, "a slot is reaped before its TTL");
    s.advance(s.pending_ttl - half + Duration::from_millis(1));
    s.tick();
    assert_eq!(s.commit(late.slot_id, "late"), FAILED, "commit of a slot past its TTL");
    assert_eq!(s.available(), s.total() - ps, "the expired slot's pages are free again");
    assert!(s.abort(late.slot_id), "abort of a reaped slot");
    assert!(!s.resolve("late", false).found, "an expired slot stored its key");
    assert_eq!(s.drain(), [s.add("early", ps)], "reaping queues no event");
}

pub(super) fn commit_after_ttl_fails_without_a_tick(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let late = s.alloc_ok("late", 2 * ps);
    assert_eq!(s.available(), s.total() - 2 * ps, "the slot holds its pages");
    // No tick: a commit must check the TTL itself, not rely on a sweep having happened.
    s.advance(s.pending_ttl + Duration::from_millis(1));
    assert_eq!(s.commit(late.slot_id, "late"), FAILED, "commit of a slot past its TTL, before any sweep");
    assert_eq!(s.available(), s.total(), "the failed commit freed the expired slot's pages");
    assert!(!s.resolve("late", false).found, "an expired slot stored its key");
    assert_eq!(s.backend.owned_key_count(), 0, "an expired slot became an owned key");
    assert!(s.abort(late.slot_id), "abort of the expired slot");
    s.tick();
    assert_eq!(s.available(), s.total(), "a sweep after the failed commit freed the pages a second time");
    // The clock moving on does not spoil fresh slots.
    s.put("fresh", ps);
    assert_eq!(s.drain(), [s.add("fresh", ps)], "the expired slot queued no event");
}

/// How long [`background_reaper_sweeps_without_tick`] waits for the reaper thread, in real time.
const REAPER_DEADLINE: Duration = Duration::from_secs(3);
/// The pause between two polls of the capacity.
const REAPER_POLL: Duration = Duration::from_millis(5);

pub(super) fn background_reaper_sweeps_without_tick(fx: &Fixture<'_>) {
    let s = fx.live();
    if !s.background_reaper {
        fx.skip("the subject claims no background reaper (Subject::background_reaper is false)");
        return;
    }
    let ps = s.ps();
    let abandoned = s.alloc_ok("abandoned", 2 * ps);
    assert_eq!(s.available(), s.total() - 2 * ps, "the slot holds its pages");
    s.advance(s.pending_ttl + Duration::from_millis(1));
    // Never `tick`: only the medium's own thread may sweep.
    let start = Instant::now();
    while s.available() != s.total() {
        assert!(
            start.elapsed() < REAPER_DEADLINE,
            "the background reaper did not free an expired slot within {REAPER_DEADLINE:?} of real time \
             ({} of {} bytes available, tick never called)",
            s.available(),
            s.total()
        );
        thread::sleep(REAPER_POLL);
    }
    assert_eq!(s.commit(abandoned.slot_id, "abandoned"), FAILED, "commit of a reaped slot");
    assert!(s.abort(abandoned.slot_id), "abort of a reaped slot");
    assert_eq!(s.available(), s.total(), "the reaped pages are freed once");
    assert!(s.drain().is_empty(), "reaping queues no event");
}
