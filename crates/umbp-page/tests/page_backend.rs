//! `PageBackend` behaviour, ported from the reference's `test_page_backend` checklist (same intent per
//! test), over real anonymous host memory and a manual clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, BackendError, CommitRequest, KvEvent, KvEventKind, LocalRegion,
    ManualClock, MediumBackend, MemoryLocation, MemoryRegistrar, PageLocation, ReadRelease, RegistrationError,
    TierType, TransferRef,
};
use umbp_page::{
    HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig, PageMemorySource, RawBuffer, SourceError,
};
use umbp_testkit::LocalOnlyRegistrar;

const PAGE: u64 = 1024;
const PAGES_PER_BUFFER: u64 = 4;
const BUFFERS: usize = 3;
const TOTAL_PAGES: u64 = PAGES_PER_BUFFER * BUFFERS as u64;

struct Fixture {
    backend: PageBackend,
    clock: Arc<ManualClock>,
    registrar: Arc<LocalOnlyRegistrar>,
}

fn fixture_with(tier: TierType, pending_ttl: Duration, lease: Duration) -> Fixture {
    let clock = ManualClock::new();
    let config = PageBackendConfig::new(tier, PAGE, vec![PAGE * PAGES_PER_BUFFER; BUFFERS])
        .with_pending_ttl(pending_ttl)
        .with_read_lease_ttl(lease)
        // Only `reaper_tick` sweeps in these tests: the background reaper must not race them.
        .with_reaper_interval(Duration::from_secs(3600))
        .with_clock(clock.clone());
    let source = HostPageMemorySource::new(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
    let backend = PageBackend::new(config, Box::new(source)).expect("valid config");
    let registrar = Arc::new(LocalOnlyRegistrar::new());
    backend.init(registrar.clone()).expect("init");
    Fixture { backend, clock, registrar }
}

fn fixture() -> Fixture {
    fixture_with(TierType::Dram, Duration::from_secs(5), Duration::from_millis(500))
}

fn alloc(b: &PageBackend, key: &str, size: u64) -> AllocateResult {
    b.batch_allocate(&[AllocateRequest::new(key, size)]).remove(0)
}

fn commit(b: &PageBackend, slot: u64, key: &str) -> (bool, u64) {
    let r = b.batch_commit(&[CommitRequest::new(slot, key)]).remove(0);
    (r.success, r.bytes_committed)
}

fn put(b: &PageBackend, key: &str, size: u64) -> AllocateResult {
    let a = alloc(b, key, size);
    assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {key}");
    assert_eq!(commit(b, a.slot_id, key), (true, size));
    a
}

fn keys(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

fn evict(b: &PageBackend, list: &[&str]) -> Vec<u64> {
    b.evict(&keys(list)).into_iter().map(|r| r.bytes_freed).collect()
}

fn found(b: &PageBackend, key: &str) -> bool {
    b.batch_resolve(&keys(&[key]), false)[0].found
}

fn available_pages(b: &PageBackend) -> u64 {
    b.capacity().available_bytes / PAGE
}

#[test]
fn commit_makes_key_resolvable() {
    let f = fixture();
    let a = put(&f.backend, "k", 1500);
    assert_eq!(a.pages.len(), 2);
    let r = &f.backend.batch_resolve(&keys(&["k"]), false)[0];
    assert!(r.found);
    assert_eq!((r.pages.clone(), r.size, r.page_size), (a.pages, 1500, PAGE));
    assert_eq!(f.backend.drain_pending_events(), vec![KvEvent::add("k", TierType::Dram, 1500)]);
}

#[test]
fn allocate_rejects_already_owned_key() {
    let f = fixture();
    put(&f.backend, "k", 100);
    let before = f.backend.capacity();
    let a = alloc(&f.backend, "k", 100);
    assert_eq!(a.outcome, AllocateOutcome::AlreadyExists);
    assert_eq!(a.slot_id, 0);
    assert!(a.pages.is_empty());
    assert_eq!(f.backend.capacity(), before);
}

#[test]
fn allocate_allows_different_key() {
    let f = fixture();
    put(&f.backend, "a", 100);
    put(&f.backend, "b", 100);
    assert_eq!(f.backend.owned_key_count(), 2);
}

#[test]
fn allocate_does_not_reject_on_pending_duplicate() {
    let f = fixture();
    let a = alloc(&f.backend, "k", 100);
    let b = alloc(&f.backend, "k", 100);
    assert_eq!((a.outcome, b.outcome), (AllocateOutcome::Allocated, AllocateOutcome::Allocated));
    assert_ne!(a.slot_id, b.slot_id);
    assert!(a.slot_id != 0 && b.slot_id != 0);
}

#[test]
fn duplicate_commit_is_idempotent_and_keeps_first() {
    let f = fixture();
    let a = alloc(&f.backend, "k", 1000);
    let b = alloc(&f.backend, "k", 2000);
    assert_eq!(commit(&f.backend, a.slot_id, "k"), (true, 1000));
    let events = f.backend.drain_pending_events();
    assert_eq!(events.len(), 1);
    assert_eq!(commit(&f.backend, b.slot_id, "k"), (true, 1000), "second commit reports the first value's size");
    assert!(f.backend.drain_pending_events().is_empty(), "the losing commit emits nothing");
    assert_eq!(f.backend.batch_resolve(&keys(&["k"]), false)[0].pages, a.pages, "first pages kept");
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 1, "second slot's pages freed");
    assert_eq!(f.backend.batch_abort(&[b.slot_id]), vec![true]);
}

#[test]
fn allocate_fails_with_no_space_when_full_and_recovers_after_abort() {
    let f = fixture();
    let slots: Vec<_> = (0..TOTAL_PAGES).map(|i| alloc(&f.backend, &format!("k{i}"), PAGE)).collect();
    assert!(slots.iter().all(|s| s.outcome == AllocateOutcome::Allocated));
    assert_eq!(alloc(&f.backend, "one-more", PAGE).outcome, AllocateOutcome::FailedNoSpace);
    f.backend.batch_abort(&[slots[3].slot_id]);
    assert_eq!(alloc(&f.backend, "one-more", PAGE).outcome, AllocateOutcome::Allocated);
}

#[test]
fn pending_slot_expires_after_ttl() {
    let f = fixture_with(TierType::Dram, Duration::from_millis(1), Duration::from_millis(500));
    let a = alloc(&f.backend, "k", PAGE);
    f.clock.advance(Duration::from_millis(2));
    f.backend.reaper_tick();
    assert_eq!(commit(&f.backend, a.slot_id, "k"), (false, 0));
    assert!(f.backend.drain_pending_events().is_empty());
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

#[test]
fn expired_slot_cannot_commit_even_before_the_reaper_runs() {
    let f = fixture_with(TierType::Dram, Duration::from_millis(10), Duration::from_millis(500));
    let a = alloc(&f.backend, "k", PAGE);
    f.clock.advance(Duration::from_millis(10));
    assert_eq!(commit(&f.backend, a.slot_id, "k"), (false, 0));
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES, "the failing commit frees the pages");
}

#[test]
fn abort_is_idempotent() {
    let f = fixture();
    let a = alloc(&f.backend, "k", PAGE);
    assert_eq!(f.backend.batch_abort(&[a.slot_id]), vec![true]);
    assert_eq!(f.backend.batch_abort(&[a.slot_id]), vec![true]);
    assert_eq!(f.backend.batch_abort(&[987_654, 0]), vec![true, true]);
    assert!(f.backend.drain_pending_events().is_empty());
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

#[test]
fn evict_removes_key_and_queues_event() {
    let f = fixture();
    put(&f.backend, "k", PAGE);
    f.backend.drain_pending_events();
    assert_eq!(evict(&f.backend, &["k", "ghost"]), vec![PAGE, 0]);
    assert_eq!(f.backend.drain_pending_events(), vec![KvEvent::remove("k", TierType::Dram)]);
    assert!(!found(&f.backend, "k"));
    assert_eq!(evict(&f.backend, &["k"]), vec![0]);
    assert!(f.backend.drain_pending_events().is_empty());
}

#[test]
fn evict_defers_when_read_lease_active() {
    let f = fixture();
    put(&f.backend, "k", PAGE);
    f.backend.drain_pending_events();
    assert!(found(&f.backend, "k"));
    assert_eq!(evict(&f.backend, &["k"]), vec![0]);
    assert!(f.backend.drain_pending_events().is_empty());
    f.clock.advance(Duration::from_millis(501));
    f.backend.reaper_tick();
    assert_eq!(evict(&f.backend, &["k"]), vec![PAGE]);
    assert_eq!(f.backend.drain_pending_events(), vec![KvEvent::remove("k", TierType::Dram)]);
}

#[test]
fn snapshot_owned_keys_returns_every_add_and_leaves_the_outbox() {
    let f = fixture();
    for i in 0..5 {
        put(&f.backend, &format!("k{i}"), 100 + i);
    }
    let mut snap = f.backend.snapshot_owned_keys();
    snap.sort_by(|a, b| a.key.cmp(&b.key));
    let want: Vec<_> = (0..5).map(|i| KvEvent::add(format!("k{i}"), TierType::Dram, 100 + i)).collect();
    assert_eq!(snap, want);
    assert_eq!(f.backend.drain_pending_events().len(), 5, "outbox not disturbed");
}

#[test]
fn buffer_descs_for_pages_dedup_and_order() {
    let f = fixture();
    // Five pages cannot be contiguous in a 4-page buffer: strategy 3 scatters over buffers 0 and 1.
    let a = put(&f.backend, "big", 5 * PAGE);
    let idx: Vec<u32> = a.descs.iter().map(|d| d.buffer_index).collect();
    assert_eq!(idx, vec![0, 1]);
    for d in &a.descs {
        assert_eq!(d.size, PAGES_PER_BUFFER * PAGE);
        assert_eq!(d.location, MemoryLocation::Host);
        assert_eq!(d.backend_id, 0, "backends never stamp their id");
    }
}

#[test]
fn batch_allocate_empty_input_returns_empty() {
    let f = fixture();
    assert!(f.backend.batch_allocate(&[]).is_empty());
    assert!(f.backend.batch_commit(&[]).is_empty());
    assert!(f.backend.batch_abort(&[]).is_empty());
    assert!(f.backend.evict(&[]).is_empty());
}

#[test]
fn batch_allocate_mixed_outcomes_and_descs() {
    let f = fixture();
    put(&f.backend, "owned", 10);
    let r = f.backend.batch_allocate(&[
        AllocateRequest::new("owned", 10),
        AllocateRequest::new("five", 5 * PAGE),
        AllocateRequest::new("zero", 0),
        AllocateRequest::new("huge", 20 * PAGE),
        AllocateRequest::new("rest", 6 * PAGE),
        AllocateRequest::new("no-room", 2 * PAGE),
    ]);
    let outcomes: Vec<_> = r.iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        vec![
            AllocateOutcome::AlreadyExists,
            AllocateOutcome::Allocated,
            AllocateOutcome::Failed,
            // Larger than the whole medium: no peer like us could hold it (the reference said NoSpace).
            AllocateOutcome::Failed,
            AllocateOutcome::Allocated,
            AllocateOutcome::FailedNoSpace,
        ]
    );
    assert!(r[0].descs.is_empty());
    assert_eq!(r[1].descs.iter().map(|d| d.buffer_index).collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
fn sizes_past_u32_pages_fail_without_reserving() {
    let f = fixture();
    let r = alloc(&f.backend, "k", (u64::from(u32::MAX) + 1) * PAGE);
    assert_eq!(r.outcome, AllocateOutcome::Failed);
    assert_eq!(alloc(&f.backend, "max", u64::MAX).outcome, AllocateOutcome::Failed);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

#[test]
fn batch_commit_mixed_success_and_failure() {
    let f = fixture();
    let a = alloc(&f.backend, "k", 100);
    let b = alloc(&f.backend, "k", 200);
    let c = alloc(&f.backend, "other", 300);
    let r = f.backend.batch_commit(&[
        CommitRequest::new(a.slot_id, "k"),
        CommitRequest::new(b.slot_id, "k"),
        CommitRequest::new(424_242, "ghost"),
        CommitRequest::new(c.slot_id, "other"),
    ]);
    let got: Vec<_> = r.iter().map(|r| (r.success, r.bytes_committed)).collect();
    assert_eq!(got, vec![(true, 100), (true, 100), (false, 0), (true, 300)]);
    assert_eq!(f.backend.batch_resolve(&keys(&["k"]), false)[0].pages, a.pages);
    let adds = f.backend.drain_pending_events();
    assert_eq!(adds.len(), 2);
    assert!(adds.iter().all(|e| e.kind == KvEventKind::Add));
}

#[test]
fn batch_abort_mixed_slots_is_idempotent() {
    let f = fixture();
    let a = alloc(&f.backend, "a", 100);
    let b = alloc(&f.backend, "b", 100);
    assert_eq!(f.backend.batch_abort(&[a.slot_id, 77_777]), vec![true, true]);
    assert_eq!(commit(&f.backend, a.slot_id, "a"), (false, 0));
    assert_eq!(commit(&f.backend, b.slot_id, "b"), (true, 100));
}

#[test]
fn batch_resolve_mixed_hits_and_misses() {
    let f = fixture();
    let a = put(&f.backend, "a", 3 * PAGE);
    put(&f.backend, "b", 10);
    let r = f.backend.batch_resolve(&keys(&["a", "nope", "b"]), true);
    assert_eq!(r.len(), 3);
    assert!(r[0].found && !r[1].found && r[2].found);
    assert_eq!(r[0].pages, a.pages);
    assert_eq!(r[0].size, 3 * PAGE);
    assert_eq!(r[0].descs, a.descs);
    assert_eq!(r[1], umbp_core::ResolvedEntry::miss());
    let without = f.backend.batch_resolve(&keys(&["a"]), false);
    assert!(without[0].descs.is_empty(), "descs only when asked for");
}

#[test]
fn batch_resolve_extends_lease_for_hits_only() {
    let f = fixture();
    put(&f.backend, "hit", 10);
    f.backend.batch_resolve(&keys(&["hit", "later"]), false);
    assert_eq!(evict(&f.backend, &["hit"]), vec![0], "hit is leased");
    // `later` missed, so it has no lease: after a put it evicts at once.
    put(&f.backend, "later", 10);
    assert_eq!(evict(&f.backend, &["later"]), vec![10]);
}

#[test]
fn batch_resolve_lease_expires_like_single_key_resolve() {
    let f = fixture_with(TierType::Dram, Duration::from_secs(5), Duration::from_millis(50));
    put(&f.backend, "a", 10);
    put(&f.backend, "b", 10);
    f.backend.batch_resolve(&keys(&["a", "b"]), false);
    assert_eq!(evict(&f.backend, &["a", "b"]), vec![0, 0]);
    f.clock.advance(Duration::from_millis(100));
    assert_eq!(evict(&f.backend, &["a", "b"]), vec![10, 10], "an expired lease no longer protects");
}

#[test]
fn capacity_reflects_allocations() {
    let f = fixture();
    assert_eq!(f.backend.capacity().total_bytes, TOTAL_PAGES * PAGE);
    let a = alloc(&f.backend, "k", 2 * PAGE);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 2);
    commit(&f.backend, a.slot_id, "k");
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 2);
    evict(&f.backend, &["k"]);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

#[test]
fn commit_after_reap_returns_false() {
    let f = fixture();
    let a = alloc(&f.backend, "k", 10);
    f.clock.advance(Duration::from_secs(6));
    f.backend.reaper_tick();
    assert_eq!(commit(&f.backend, a.slot_id, "k"), (false, 0));
    assert!(f.backend.drain_pending_events().is_empty());
}

#[test]
fn clear_local_releases_owned_and_cancels_pending() {
    let f = fixture();
    put(&f.backend, "owned", PAGE);
    let pending = alloc(&f.backend, "pending", PAGE);
    f.backend.clear_local();
    assert!(f.backend.is_clear_full_sync_pending());
    assert_eq!(f.backend.owned_key_count(), 0);
    assert!(!found(&f.backend, "owned"));
    assert!(f.backend.drain_pending_events().is_empty());
    // The pending slot's pages stay reserved (a write may be in flight) until its commit fails.
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 1);
    assert_eq!(commit(&f.backend, pending.slot_id, "pending"), (false, 0));
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
    assert!(f.backend.drain_pending_events().is_empty(), "no ADD for a pre-clear slot");
}

#[test]
fn clear_local_gates_allocate_until_acked() {
    let f = fixture();
    f.backend.clear_local();
    assert_eq!(alloc(&f.backend, "k", 10).outcome, AllocateOutcome::Failed);
    f.backend.clear_full_sync_acked();
    assert!(!f.backend.is_clear_full_sync_pending());
    assert_eq!(alloc(&f.backend, "k", 10).outcome, AllocateOutcome::Allocated);
}

#[test]
fn clear_local_drops_queued_adds() {
    let f = fixture();
    put(&f.backend, "k", 10);
    f.backend.clear_local();
    assert!(f.backend.drain_pending_events().is_empty());
    assert!(f.backend.snapshot_owned_keys().is_empty());
}

#[test]
fn abort_releases_cancelled_pending() {
    let f = fixture();
    let a = alloc(&f.backend, "k", 2 * PAGE);
    f.backend.clear_local();
    assert_eq!(f.backend.batch_abort(&[a.slot_id]), vec![true]);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

#[test]
fn pending_generation_rejects_pre_clear_commit() {
    let f = fixture();
    let a = alloc(&f.backend, "k", PAGE);
    f.backend.clear_local();
    f.backend.clear_full_sync_acked();
    assert_eq!(commit(&f.backend, a.slot_id, "k"), (false, 0));
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
    put(&f.backend, "k", PAGE);
}

#[test]
fn pending_generation_survives_double_clear() {
    let f = fixture();
    let a = alloc(&f.backend, "k", PAGE);
    f.backend.clear_local();
    f.backend.clear_full_sync_acked();
    f.backend.clear_local();
    f.backend.clear_full_sync_acked();
    assert_eq!(commit(&f.backend, a.slot_id, "k"), (false, 0));
}

#[test]
fn clear_local_defers_leased_owned_pages() {
    let f = fixture();
    put(&f.backend, "k", 2 * PAGE);
    assert!(found(&f.backend, "k"));
    f.backend.clear_local();
    assert!(!found(&f.backend, "k"), "logically gone at once");
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 2, "pages held while the reader may copy");
    f.backend.reaper_tick();
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 2);
    f.clock.advance(Duration::from_millis(501));
    f.backend.reaper_tick();
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

#[test]
fn clear_local_mixed_pending_and_leased() {
    let f = fixture();
    put(&f.backend, "a", PAGE);
    found(&f.backend, "a");
    let b = alloc(&f.backend, "b", PAGE);
    f.backend.clear_local();
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 2);
    assert_eq!(commit(&f.backend, b.slot_id, "b"), (false, 0));
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 1);
    f.clock.advance(Duration::from_millis(501));
    f.backend.reaper_tick();
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

#[test]
fn clear_local_sweep_respects_ttl() {
    let f = fixture_with(TierType::Dram, Duration::from_secs(5), Duration::from_secs(10));
    put(&f.backend, "k", PAGE);
    found(&f.backend, "k");
    f.backend.clear_local();
    for _ in 0..5 {
        f.clock.advance(Duration::from_secs(1));
        f.backend.reaper_tick();
        assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 1);
    }
}

#[test]
fn owned_key_count_tracks_commits_and_evicts() {
    let f = fixture();
    assert_eq!(f.backend.owned_key_count(), 0);
    for k in ["a", "b", "c"] {
        put(&f.backend, k, 10);
    }
    assert_eq!(f.backend.owned_key_count(), 3);
    evict(&f.backend, &["b"]);
    assert_eq!(f.backend.owned_key_count(), 2);
}

#[test]
fn separate_instances_per_medium_are_independent() {
    let dram = fixture_with(TierType::Dram, Duration::from_secs(5), Duration::from_millis(500));
    let hbm = fixture_with(TierType::Hbm, Duration::from_secs(5), Duration::from_millis(500));
    put(&dram.backend, "d", 10);
    put(&hbm.backend, "h", 20);
    assert_eq!(dram.backend.tier(), TierType::Dram);
    assert_eq!(hbm.backend.tier(), TierType::Hbm);
    assert!(found(&dram.backend, "d") && !found(&dram.backend, "h"));
    assert!(found(&hbm.backend, "h") && !found(&hbm.backend, "d"));
    assert_eq!(hbm.backend.drain_pending_events(), vec![KvEvent::add("h", TierType::Hbm, 20)]);
    assert_eq!(dram.backend.owned_key_count(), 1);
}

#[test]
fn auto_flush_fires_at_threshold() {
    let f = fixture();
    let fired = Arc::new(AtomicUsize::new(0));
    let counter = fired.clone();
    f.backend.set_auto_flush_hook(
        3,
        Some(Arc::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        })),
    );
    put(&f.backend, "a", 1);
    put(&f.backend, "b", 1);
    assert_eq!(fired.load(Ordering::SeqCst), 0);
    put(&f.backend, "c", 1);
    assert_eq!(fired.load(Ordering::SeqCst), 1);
    put(&f.backend, "d", 1);
    assert_eq!(fired.load(Ordering::SeqCst), 1, "once per crossing");
    f.backend.drain_pending_events();
    for k in ["e", "f", "g"] {
        put(&f.backend, k, 1);
    }
    assert_eq!(fired.load(Ordering::SeqCst), 2, "re-armed by the drain");
}

#[test]
fn auto_flush_without_hook_never_fires() {
    let f = fixture();
    f.backend.set_auto_flush_hook(1, None);
    for i in 0..10 {
        put(&f.backend, &format!("k{i}"), 1);
    }
    assert_eq!(f.backend.drain_pending_events().len(), 10);
}

#[test]
fn copy_pin_segments_cover_the_value_and_block_evict() {
    let f = fixture();
    let a = put(&f.backend, "k", 2 * PAGE + 100);
    let pin = f.backend.acquire_copy_pin("k").expect("owned key pins");
    assert_eq!(pin.total_size, 2 * PAGE + 100);
    let lens: Vec<u64> = pin.segments.iter().map(|s| s.len).collect();
    assert_eq!(lens, vec![PAGE, PAGE, 100]);
    for (seg, page) in pin.segments.iter().zip(&a.pages) {
        assert_eq!(seg.buffer_index, page.buffer_index);
        assert_eq!(seg.offset, u64::from(page.page_index) * PAGE);
    }
    assert!(f.backend.acquire_copy_pin("k").is_none(), "one pin per key");
    assert!(f.backend.acquire_copy_pin("ghost").is_none());
    assert_eq!(evict(&f.backend, &["k"]), vec![0]);
    f.backend.release_copy_pin("k", pin.token + 1);
    assert_eq!(evict(&f.backend, &["k"]), vec![0], "a wrong token releases nothing");
    f.backend.release_copy_pin("k", pin.token);
    assert_eq!(evict(&f.backend, &["k"]), vec![2 * PAGE + 100]);
}

#[test]
fn init_registers_each_buffer_and_shutdown_deregisters_before_release() {
    let f = fixture();
    assert_eq!(f.registrar.register_count(), BUFFERS);
    assert_eq!(f.registrar.last_location(), Some(MemoryLocation::Host));
    assert_eq!(f.backend.buffer_count(), BUFFERS);
    let r = f.backend.buffer_ref(0).expect("buffer 0");
    assert_eq!(r.size(), PAGES_PER_BUFFER * PAGE);
    assert!(r.has_local());
    assert!(f.backend.buffer_ref(BUFFERS).is_none());
    // Init is idempotent: no second registration.
    f.backend.init(f.registrar.clone()).expect("second init");
    assert_eq!(f.registrar.register_count(), BUFFERS);
    f.backend.shutdown();
    assert_eq!(f.registrar.deregister_count(), BUFFERS);
    assert_eq!(f.backend.buffer_count(), 0);
    f.backend.shutdown();
    assert_eq!(f.registrar.deregister_count(), BUFFERS, "second shutdown is a no-op");
    assert!(f.backend.init(f.registrar.clone()).is_err(), "a shut-down backend stays down");
}

#[test]
fn pages_are_real_writable_memory() {
    let f = fixture();
    let a = put(&f.backend, "k", 3 * PAGE);
    for page in &a.pages {
        let r = f.backend.buffer_ref(page.buffer_index as usize).expect("ref");
        let region = r.local_region().expect("local");
        let offset = usize::try_from(u64::from(page.page_index) * PAGE).expect("fits");
        // SAFETY: the region is registered and live (the backend is initialised); the page lies inside it.
        unsafe {
            let p = region.ptr().as_ptr().add(offset);
            std::ptr::write_bytes(p, 0xAB, PAGE as usize);
            assert_eq!(*p.add(PAGE as usize - 1), 0xAB);
        }
    }
    assert!(a.pages.iter().all(|p| u64::from(p.page_index) < PAGES_PER_BUFFER));
    assert_eq!(a.pages.iter().collect::<std::collections::HashSet<&PageLocation>>().len(), 3);
}

#[test]
fn zero_page_size_is_an_invalid_config() {
    let source = HostPageMemorySource::new(HostMemoryOptions::default());
    let err = PageBackend::new(PageBackendConfig::new(TierType::Dram, 0, vec![4096]), Box::new(source))
        .expect_err("page size 0");
    assert!(err.to_string().contains("page_size"), "{err}");
}

#[test]
fn operations_before_init_are_harmless() {
    let source = HostPageMemorySource::new(HostMemoryOptions::default());
    let b = PageBackend::new(PageBackendConfig::new(TierType::Dram, PAGE, vec![4096]), Box::new(source)).expect("ok");
    assert_eq!(alloc(&b, "k", 10).outcome, AllocateOutcome::Failed);
    assert_eq!(b.capacity().total_bytes, 0);
    assert!(b.buffer_ref(0).is_none());
    assert!(b.all_buffer_descs().is_empty());
    b.shutdown();
}

#[test]
fn clear_local_keeps_pinned_pages_reserved_until_the_pin_is_released() {
    let f = fixture();
    put(&f.backend, "k", 2 * PAGE);
    let pin = f.backend.acquire_copy_pin("k").expect("pin");
    f.backend.clear_local();
    f.backend.clear_full_sync_acked();
    assert!(!found(&f.backend, "k"), "the key is gone at once");
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 2, "but the copier's pages are not reusable");
    // The same key can be written and pinned again: the old pin does not block it.
    put(&f.backend, "k", PAGE);
    let again = f.backend.acquire_copy_pin("k").expect("a new pin on the new value");
    f.backend.release_copy_pin("k", again.token);
    assert_eq!(evict(&f.backend, &["k"]), vec![PAGE]);
    f.backend.release_copy_pin("k", pin.token);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES, "releasing the orphaned pin frees its pages");
}

#[test]
fn a_pinned_and_leased_key_cleared_waits_for_both() {
    let f = fixture();
    put(&f.backend, "k", PAGE);
    let pin = f.backend.acquire_copy_pin("k").expect("pin");
    assert!(found(&f.backend, "k"));
    f.backend.clear_local();
    f.backend.release_copy_pin("k", pin.token);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 1, "the reader's lease still holds the page");
    f.clock.advance(Duration::from_millis(501));
    f.backend.reaper_tick();
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}

fn invalid(config: PageBackendConfig) -> String {
    let source = HostPageMemorySource::new(HostMemoryOptions::default());
    match PageBackend::new(config, Box::new(source)) {
        Err(e @ BackendError::InvalidConfig(_)) => {
            assert!(!e.is_retryable(), "a bad config is never retryable");
            e.to_string()
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn bad_configs_are_refused_with_the_setting_named() {
    let base = || PageBackendConfig::new(TierType::Dram, PAGE, vec![4 * PAGE]);
    assert!(invalid(base().with_pending_ttl(Duration::ZERO)).contains("pending_ttl"));
    assert!(invalid(base().with_read_lease_ttl(Duration::from_secs(u64::MAX))).contains("read_lease_ttl"));
    assert!(invalid(base().with_reaper_interval(Duration::ZERO)).contains("reaper_interval"));
    assert!(invalid(PageBackendConfig::new(TierType::Dram, PAGE, vec![])).contains("no whole page"));
    assert!(invalid(PageBackendConfig::new(TierType::Dram, PAGE, vec![PAGE - 1, 10])).contains("no whole page"));
    assert!(invalid(PageBackendConfig::new(TierType::Unknown, PAGE, vec![PAGE])).contains("tier"));
}

#[test]
fn a_source_config_error_is_an_invalid_config_not_out_of_memory() {
    let config = PageBackendConfig::new(TierType::Dram, PAGE, vec![4 * PAGE]);
    let options = HostMemoryOptions { use_hugepages: true, hugepage_size: 3 << 20, ..HostMemoryOptions::default() };
    let b = PageBackend::new(config, Box::new(HostPageMemorySource::new(options))).expect("config");
    let err = b.init(Arc::new(LocalOnlyRegistrar::new())).expect_err("3 MiB is no hugepage size");
    assert!(matches!(err, BackendError::InvalidConfig(_)), "{err:?}");
    assert!(!err.is_retryable());
}

#[test]
fn shutdown_closes_the_state_and_drops_the_hook() {
    let f = fixture();
    let hook: umbp_core::AutoFlushHook = Arc::new(|| {});
    f.backend.set_auto_flush_hook(3, Some(hook.clone()));
    put(&f.backend, "k", 10);
    f.backend.shutdown();
    assert_eq!(Arc::strong_count(&hook), 1, "the backend no longer holds the hook");
    assert_eq!(alloc(&f.backend, "x", 10).outcome, AllocateOutcome::Failed);
    assert!(!found(&f.backend, "k"));
    assert_eq!(f.backend.capacity().total_bytes, 0);
}

/// Records deregistrations and releases in one log, to check their order.
#[derive(Debug, Default)]
struct Log(Mutex<Vec<&'static str>>);

#[derive(Debug)]
struct LoggingSource {
    inner: HostPageMemorySource,
    log: Arc<Log>,
}

impl PageMemorySource for LoggingSource {
    fn allocate(&self, sizes: &[u64]) -> Result<Vec<RawBuffer>, SourceError> {
        self.inner.allocate(sizes)
    }
    fn release(&self) {
        if self.inner.mapped_bytes() > 0 {
            self.log.0.lock().push("release");
        }
        self.inner.release();
    }
    fn location(&self) -> MemoryLocation {
        self.inner.location()
    }
    fn name(&self) -> &str {
        "LoggingSource"
    }
}

#[derive(Debug)]
struct LoggingRegistrar {
    log: Arc<Log>,
}

impl MemoryRegistrar for LoggingRegistrar {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        Ok(TransferRef::local(region))
    }
    fn deregister(&self, _r: &TransferRef) {
        self.log.0.lock().push("deregister");
    }
}

#[test]
fn shutdown_deregisters_every_buffer_before_releasing_memory() {
    let log = Arc::new(Log::default());
    let source = LoggingSource { inner: HostPageMemorySource::new(HostMemoryOptions::default()), log: log.clone() };
    let b = PageBackend::new(PageBackendConfig::new(TierType::Dram, PAGE, vec![4 * PAGE; 3]), Box::new(source))
        .expect("config");
    b.init(Arc::new(LoggingRegistrar { log: log.clone() })).expect("init");
    b.shutdown();
    assert_eq!(*log.0.lock(), vec!["deregister", "deregister", "deregister", "release"]);
}

#[test]
fn init_starts_a_reaper_that_sweeps_on_its_own() {
    let clock = ManualClock::new();
    let config = PageBackendConfig::new(TierType::Dram, PAGE, vec![4 * PAGE])
        .with_pending_ttl(Duration::from_secs(1))
        .with_reaper_interval(Duration::from_millis(1))
        .with_clock(clock.clone());
    let b = PageBackend::new(config, Box::new(HostPageMemorySource::new(HostMemoryOptions::default()))).expect("ok");
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    alloc(&b, "k", PAGE);
    assert_eq!(b.capacity().available_bytes, 3 * PAGE);
    clock.advance(Duration::from_secs(2));
    // No reaper_tick: only the background thread can free the expired slot.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while b.capacity().available_bytes != 4 * PAGE {
        assert!(std::time::Instant::now() < deadline, "the reaper thread never swept");
        std::thread::sleep(Duration::from_millis(2));
    }
    b.shutdown();
}

/// A slot whose writer never commits nor aborts is reaped, and the reap is published as a medium
/// event (the one thing the decorator around a medium cannot see from its calls).
#[test]
fn reaped_pending_slots_are_published_as_medium_events() {
    use umbp_core::{MetricSource, metric_names};
    let f = fixture();
    let reaped = |b: &PageBackend, name: &str| {
        b.sample_metrics()
            .into_iter()
            .find(|s| s.name == name && s.labels == [("event".to_owned(), "pending_slot_reaped".to_owned())])
            .map(|s| s.value)
    };
    assert_eq!(reaped(&f.backend, metric_names::MEDIUM_EVENTS_TOTAL), Some(0));
    alloc(&f.backend, "abandoned", 2 * PAGE);
    f.clock.advance(Duration::from_secs(6));
    f.backend.reaper_tick();
    assert_eq!(reaped(&f.backend, metric_names::MEDIUM_EVENTS_TOTAL), Some(1));
    assert_eq!(reaped(&f.backend, metric_names::MEDIUM_BYTES_TOTAL), Some(2 * PAGE));
}

/// A lease taken before a clear guards the dropped value's pages only: the same key committed
/// after the clear can be evicted at once, and the old reader's release still frees the old pages.
#[test]
fn a_cleared_keys_lease_does_not_guard_its_recommitted_value() {
    let f = fixture();
    put(&f.backend, "k", 2 * PAGE);
    let old = f.backend.batch_resolve(&["k".to_owned()], false).remove(0);
    assert!(old.found);
    f.backend.clear_local();
    f.backend.clear_full_sync_acked();
    put(&f.backend, "k", PAGE);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 3);
    // A reader of the new value joins a lease of its own, not the old one.
    let new = f.backend.batch_resolve(&["k".to_owned()], false).remove(0);
    assert_ne!(new.lease, old.lease);
    f.backend.release_reads(&[ReadRelease::new("k", new.lease)]);
    assert_eq!(f.backend.evict(&["k".to_owned()])[0].bytes_freed, PAGE, "the old lease must not block");
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES - 2, "the old value's pages wait for its reader");
    f.backend.release_reads(&[ReadRelease::new("k", old.lease)]);
    assert_eq!(available_pages(&f.backend), TOTAL_PAGES);
}
