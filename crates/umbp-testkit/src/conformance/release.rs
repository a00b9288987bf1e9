//! Counted read leases and their release; busy answers.
//!
//! A medium whose hits carry no lease id (lease 0: the trait's default `release_reads`, leases only
//! expire) skips the release checks, and the report lists them as skipped.

use umbp_core::ReadRelease;

use super::fixture::{Fixture, Live};

/// Resolves `key` and returns its lease, or skips the check for a medium without releasable leases.
fn leased(fx: &Fixture<'_>, s: &Live, key: &str) -> Option<u64> {
    let hit = s.resolve(key, false);
    assert!(hit.found && !hit.busy, "resolve of a stored key on an idle medium: {hit:?}");
    if hit.lease == 0 {
        fx.skip("the medium's hits carry no lease id: its leases only expire (default release_reads)");
        return None;
    }
    Some(hit.lease)
}

fn release(s: &Live, key: &str, lease: u64) {
    s.backend.release_reads(&[ReadRelease::new(key, lease)]);
}

pub(super) fn release_ends_the_read_lease_at_once(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("k", ps);
    let Some(lease) = leased(fx, &s, "k") else { return };
    assert_eq!(s.evict("k"), 0, "a leased key survives evict");
    release(&s, "k", lease);
    assert_eq!(s.evict("k"), ps, "the last reader released the lease: evict frees the key with no time passing");
    s.backend.release_reads(&[]);
}

pub(super) fn two_readers_hold_one_lease_until_both_release(fx: &Fixture<'_>) {
    let s = fx.live();
    s.put("k", 1);
    let Some(first) = leased(fx, &s, "k") else { return };
    let Some(second) = leased(fx, &s, "k") else { return };
    assert_eq!(first, second, "two hits of a live lease share its id");
    release(&s, "k", first);
    assert_eq!(s.evict("k"), 0, "one reader released, the other still copies: the key stays protected");
    release(&s, "k", second);
    assert_eq!(s.evict("k"), 1, "both released");
}

pub(super) fn a_release_of_an_ended_lease_changes_nothing(fx: &Fixture<'_>) {
    let s = fx.live();
    s.put("k", 1);
    let Some(old) = leased(fx, &s, "k") else { return };
    s.expire(s.read_lease);
    let Some(new) = leased(fx, &s, "k") else { return };
    assert_ne!(old, new, "a lease that expired is not reused");
    release(&s, "k", old);
    s.backend.release_reads(&[ReadRelease::new("k", 0), ReadRelease::new("other", new)]);
    assert_eq!(s.evict("k"), 0, "a late, zero or foreign release ended the live reader's lease");
    release(&s, "k", new);
    assert_eq!(s.evict("k"), 1, "the live reader's release ends it");
    release(&s, "k", new);
    release(&s, "never-stored", 7);
    assert_eq!(s.backend.owned_key_count(), 0, "releases of gone keys change nothing");
}

pub(super) fn release_frees_a_cleared_keys_pages_at_once(fx: &Fixture<'_>) {
    let s = fx.live();
    s.put("k", s.ps());
    let Some(lease) = leased(fx, &s, "k") else { return };
    s.backend.clear_local();
    s.backend.clear_full_sync_acked();
    release(&s, "k", lease);
    // No time passed: only the release can have given the reader's pages back.
    let whole = s.alloc_ok("whole", s.total());
    assert!(s.abort(whole.slot_id), "abort");
    assert_eq!(s.available(), s.total(), "every page is free after the release");
}

pub(super) fn an_idle_medium_never_answers_busy(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    for include_descs in [false, true] {
        let miss = s.resolve("absent", include_descs);
        assert!(!miss.found && !miss.busy, "a key the medium does not own is a miss, never busy: {miss:?}");
    }
    s.put("a", ps);
    s.put("b", 2 * ps + 1);
    let entries = s.backend.batch_resolve(&super::fixture::keys(&["a", "b", "absent"]), true);
    for (key, e) in ["a", "b", "absent"].iter().zip(&entries) {
        assert!(!e.busy, "{key}: a medium with nothing in flight serves what it owns: {e:?}");
        assert!(!(e.busy && e.found), "{key}: busy and found at once");
    }
}

pub(super) fn an_existence_check_holds_no_lease(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    s.put("k", ps);
    assert_eq!(s.backend.batch_contains(&super::fixture::keys(&["k", "absent"])), [true, false], "contains");
    assert_eq!(s.evict("k"), ps, "an existence check left a read lease on the key");
}
