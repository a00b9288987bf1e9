//! The outbox, snapshots, clear and the auto-flush hook.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use umbp_core::{
    AllocateOutcome, AllocateRequest, AutoFlushHook, drain_all_backends, snapshot_all_backends_for_full_sync,
};

use super::fixture::{Fixture, Live, keys, sorted};

pub(super) fn events_follow_operation_order(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("a", 1);
    s.put("b", ps);
    assert_eq!(s.evict("a"), 1, "evict a");
    // Operations that change no ownership queue nothing.
    assert!(!s.commit(0, "ghost").success, "commit of slot 0");
    assert!(s.abort(999_999), "abort of an unknown slot");
    assert_eq!(s.evict("never-stored"), 0, "evict of an unknown key");
    assert!(s.resolve("b", false).found, "resolve b");
    assert_eq!(s.evict("b"), 0, "evict of a leased key");
    assert_eq!(s.alloc("zero", 0).outcome, AllocateOutcome::Failed, "zero size");
    let p = s.alloc_ok("pending", 1);
    assert!(s.abort(p.slot_id), "abort");
    assert_eq!(s.drain(), [s.add("a", 1), s.add("b", ps), s.remove("a")], "the outbox, in operation order");
    assert!(s.drain().is_empty(), "a drain empties the outbox");
}

pub(super) fn snapshot_does_not_mutate_outbox(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("a", 1);
    s.put("b", ps);
    let expected = sorted(vec![s.add("a", 1), s.add("b", ps)]);
    assert_eq!(sorted(s.backend.snapshot_owned_keys()), expected, "the snapshot lists every owned key as Add");
    assert_eq!(sorted(s.backend.snapshot_owned_keys()), expected, "a second snapshot");
    assert_eq!(s.drain(), [s.add("a", 1), s.add("b", ps)], "the outbox after two snapshots");
    assert_eq!(s.evict("a"), 1, "evict a");
    assert_eq!(s.backend.snapshot_owned_keys(), [s.add("b", ps)], "the snapshot after evicting a");
    assert_eq!(s.drain(), [s.remove("a")], "the outbox after a third snapshot");
}

pub(super) fn full_sync_snapshot_clears_outbox(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("a", 1);
    s.put("b", ps);
    assert_eq!(s.evict("a"), 1, "evict a");
    s.put("c", 1);
    let snapshot = sorted(s.backend.snapshot_owned_keys_for_full_sync());
    assert_eq!(snapshot, [s.add("b", ps), s.add("c", 1)], "the full-sync snapshot lists the owned keys");
    assert!(s.drain().is_empty(), "the full-sync snapshot must clear the outbox");
    assert_eq!(s.backend.owned_key_count(), 2, "a snapshot drops no key");
    s.put("d", ps);
    assert_eq!(s.drain(), [s.add("d", ps)], "the outbox keeps working after a full-sync snapshot");
}

pub(super) fn clear_local_drops_keys_and_gates_allocation(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("a", 1);
    s.put("b", ps);
    let pending = s.alloc_ok("p", ps);
    assert!(!s.backend.is_clear_full_sync_pending(), "a fresh medium is not clearing");
    s.backend.clear_local();
    assert!(s.backend.is_clear_full_sync_pending(), "clear_local sets the pending flag");
    assert_eq!(s.backend.owned_key_count(), 0, "owned keys after clear");
    let hits: Vec<bool> = s.backend.batch_resolve(&keys(&["a", "b"]), false).iter().map(|e| e.found).collect();
    assert_eq!(hits, [false, false], "cleared keys resolve");
    assert!(s.drain().is_empty(), "clear queues no Remove and drops the outbox");
    assert!(s.backend.snapshot_owned_keys().is_empty(), "snapshot after clear");
    assert!(s.backend.snapshot_owned_keys_for_full_sync().is_empty(), "full-sync snapshot after clear");
    assert_eq!(s.available(), s.total() - ps, "cleared keys' pages are free; the pending slot still holds its page");

    let gated = s.backend.batch_allocate(&[AllocateRequest::new("a", 1), AllocateRequest::new("c", ps)]);
    let outcomes: Vec<_> = gated.iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [AllocateOutcome::Failed; 2], "allocation between clear and ack");
    assert_eq!(s.evict("a"), 0, "evict of a cleared key");
    assert!(s.drain().is_empty(), "nothing queued while clearing");
    assert_eq!(s.backend.owned_key_count(), 0, "no key appears before the ack");

    s.backend.clear_full_sync_acked();
    assert!(!s.backend.is_clear_full_sync_pending(), "the ack clears the pending flag");
    assert!(s.abort(pending.slot_id), "abort of a pre-clear slot");
    assert_eq!(s.available(), s.total(), "everything is free");
    s.put("a", 1);
    assert_eq!(s.drain(), [s.add("a", 1)], "allocation works again after the ack");
}

pub(super) fn pre_clear_slot_cannot_commit(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    let before = s.alloc_ok("k", ps);
    s.backend.clear_local();
    assert!(!s.commit(before.slot_id, "k").success, "commit of a pre-clear slot before the ack");
    s.backend.clear_full_sync_acked();
    let during = s.alloc_ok("k", ps);
    s.backend.clear_local();
    s.backend.clear_full_sync_acked();
    assert!(!s.commit(during.slot_id, "k").success, "commit of a pre-clear slot after the ack");
    assert_eq!(s.backend.owned_key_count(), 0, "a pre-clear slot stored its key");
    assert!(s.drain().is_empty(), "a pre-clear commit queued an event");
    assert!(s.abort(before.slot_id) && s.abort(during.slot_id), "abort of pre-clear slots");
    assert_eq!(s.available(), s.total(), "pre-clear slots' pages are freed");
    s.put("k", ps);
}

pub(super) fn clear_local_releases_leased_pages_by_lease_end(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("k", 2 * ps);
    assert!(s.resolve("k", false).found, "resolve");
    s.backend.clear_local();
    assert!(s.available() >= s.total() - 2 * ps, "clear left more than the leased pages in use");
    s.backend.clear_full_sync_acked();
    assert!(!s.resolve("k", false).found, "a leased key survived the clear");
    let again = s.alloc_ok("k", ps);
    assert!(s.abort(again.slot_id), "abort");
    s.expire(s.read_lease);
    assert_eq!(s.available(), s.total(), "leased pages are free once the lease ended");
}

/// A hook that counts its calls.
fn counting_hook() -> (AutoFlushHook, Arc<AtomicUsize>) {
    let fired = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&fired);
    let hook: AutoFlushHook = Arc::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    (hook, fired)
}

fn fired(counter: &AtomicUsize) -> usize {
    counter.load(Ordering::SeqCst)
}

fn put_many(s: &Live, names: &[&str]) {
    for name in names {
        s.put(name, 1);
    }
}

pub(super) fn auto_flush_fires_once_at_threshold(fx: &Fixture<'_>) {
    let s = fx.live();
    let (hook, count) = counting_hook();
    s.backend.set_auto_flush_hook(3, Some(hook));
    put_many(&s, &["a", "b"]);
    assert_eq!(fired(&count), 0, "2 events, threshold 3");
    s.put("c", 1);
    assert_eq!(fired(&count), 1, "the 3rd event reaches the threshold");
    s.put("d", 1);
    assert_eq!(fired(&count), 1, "the 4th event must not fire again");
    let evicted = s.backend.evict(&keys(&["a", "b", "c", "d"]));
    assert!(evicted.iter().all(|e| e.bytes_freed == 1), "evict");
    assert_eq!(fired(&count), 1, "events 5..8 must not fire");
    assert_eq!(s.drain().len(), 8, "the outbox holds every event");
    put_many(&s, &["e", "f"]);
    assert_eq!(fired(&count), 1, "2 events after a drain");
    s.put("g", 1);
    assert_eq!(fired(&count), 2, "a drain re-arms the hook");
}

pub(super) fn auto_flush_rearms_after_full_sync_snapshot(fx: &Fixture<'_>) {
    let s = fx.live();
    let (hook, count) = counting_hook();
    s.backend.set_auto_flush_hook(2, Some(hook));
    put_many(&s, &["a", "b"]);
    assert_eq!(fired(&count), 1, "threshold 2 reached");
    s.backend.snapshot_owned_keys_for_full_sync();
    s.put("c", 1);
    assert_eq!(fired(&count), 1, "1 event after the full-sync snapshot");
    assert_eq!(s.evict("c"), 1, "evict c");
    assert_eq!(fired(&count), 2, "a Remove counts, and the full-sync snapshot re-armed the hook");
    s.backend.snapshot_owned_keys();
    s.put("d", 1);
    assert_eq!(fired(&count), 2, "a plain snapshot neither empties nor re-arms");
}

pub(super) fn auto_flush_disabled_by_zero_and_none(fx: &Fixture<'_>) {
    let s = fx.live();
    let (hook, count) = counting_hook();
    s.backend.set_auto_flush_hook(0, Some(hook));
    put_many(&s, &["a", "b"]);
    assert_eq!(fired(&count), 0, "threshold 0 disables the hook");
    s.drain();
    s.backend.set_auto_flush_hook(1, None);
    s.put("c", 1);
    assert_eq!(fired(&count), 0, "no hook installed");
    s.drain();
    let (old, old_count) = counting_hook();
    let (new, new_count) = counting_hook();
    s.backend.set_auto_flush_hook(1, Some(old));
    s.backend.set_auto_flush_hook(1, Some(new));
    s.put("d", 1);
    assert_eq!((fired(&old_count), fired(&new_count)), (0, 1), "a new hook replaces the old one");
    s.drain();
    s.backend.set_auto_flush_hook(1, None);
    assert_eq!(s.evict("d"), 1, "evict d");
    assert_eq!(fired(&new_count), 1, "None removes the hook");
}

pub(super) fn events_concatenate_across_media_in_one_stream(fx: &Fixture<'_>) {
    let first = fx.live();
    let second = fx.live();
    let ps = first.ps();
    first.put("a1", 1);
    second.put("b1", second.ps());
    first.put("a2", ps);
    assert_eq!(first.evict("a1"), 1, "evict a1");
    let media = [Arc::clone(&first.backend), Arc::clone(&second.backend)];
    let stream = drain_all_backends(&media);
    let expected = [first.add("a1", 1), first.add("a2", ps), first.remove("a1"), second.add("b1", second.ps())];
    assert_eq!(stream, expected, "the first medium's events, then the second's");
    assert!(drain_all_backends(&media).is_empty(), "a second drain is empty");

    first.put("a3", 1);
    second.put("b2", 1);
    let snapshot = snapshot_all_backends_for_full_sync(&media);
    assert_eq!(snapshot.len(), 4, "every owned key of both media: {snapshot:?}");
    let (head, tail) = snapshot.split_at(2);
    assert_eq!(sorted(head.to_vec()), [first.add("a2", ps), first.add("a3", 1)], "the first medium's keys come first");
    assert_eq!(sorted(tail.to_vec()), [second.add("b1", second.ps()), second.add("b2", 1)], "then the second's");
    assert!(drain_all_backends(&media).is_empty(), "the full-sync snapshot cleared both outboxes");
}
