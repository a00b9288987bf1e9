//! `MockBackend` through the `MediumBackend` interface, `BackendRegistry` routing and event
//! aggregation over mocks, and proof that the conformance suite fails broken media.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BackendRegistry, BufferDesc,
    CommitRequest, CommitResult, EvictResult, KvEvent, LocalRegion, MAX_BACKENDS_PER_PEER, ManualClock, MediumBackend,
    MemoryLocation, MemoryRegistrar, MetricKind, MetricSample, MetricSource, ReadRelease, RegistrationError,
    RegistryError, ResolvedEntry, TierCapacity, TierType, TransferRef, drain_all_backends,
    snapshot_all_backends_for_full_sync,
};
use umbp_testkit::conformance::{self, Env, Subject};
use umbp_testkit::{FailingRegistrar, LocalOnlyRegistrar, MockBackend, MockConfig};

fn mock(tier: TierType) -> Arc<MockBackend> {
    Arc::new(MockBackend::new(MockConfig { tier, ..MockConfig::default() }))
}

/// A live mock behind the interface, with the registrar it was initialised with.
fn live(tier: TierType) -> (Arc<dyn MediumBackend>, Arc<LocalOnlyRegistrar>) {
    let backend: Arc<dyn MediumBackend> = mock(tier);
    let registrar = Arc::new(LocalOnlyRegistrar::new());
    if let Err(e) = backend.init(Arc::clone(&registrar) as Arc<dyn MemoryRegistrar>) {
        panic!("init of a mock failed: {e}");
    }
    (backend, registrar)
}

fn put(b: &dyn MediumBackend, key: &str, size: u64) -> AllocateResult {
    let a = b.batch_allocate(&[AllocateRequest::new(key, size)]).remove(0);
    assert_eq!(a.outcome, AllocateOutcome::Allocated);
    assert_eq!(b.batch_commit(&[CommitRequest::new(a.slot_id, key)])[0].bytes_committed, size);
    a
}

fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

#[test]
fn defaults_are_documented_values() {
    let c = MockConfig::default();
    assert_eq!((c.tier, c.page_size, c.pages), (TierType::Dram, 4096, 16));
    assert_eq!((c.pending_ttl, c.read_lease_ttl), (Duration::from_secs(30), Duration::from_millis(500)));
    let m = MockBackend::new(c);
    assert_eq!((m.name(), m.tier(), m.page_size()), ("MockBackend", TierType::Dram, 4096));
    assert_eq!(m.capacity(), TierCapacity::default(), "no memory before init");
}

#[test]
fn allocate_commit_resolve_evict_round_trip() {
    let (b, registrar) = live(TierType::Dram);
    assert_eq!(registrar.last_location(), Some(MemoryLocation::Host));
    let a = put(&*b, "k", 128);
    assert_eq!((a.pages.len(), a.page_size, a.descs.len()), (1, 4096, 1));

    // The bytes are real: write through the published pointer, as a transfer engine would.
    let r = b.buffer_ref(0).unwrap();
    let base = r.local_region().unwrap().ptr();
    let offset = a.pages[0].page_index as usize * 4096;
    let payload: Vec<u8> = (0..128u8).collect();
    // SAFETY: the page lies inside the registered buffer (checked by the suite's page-range check,
    // and here by construction: 16 pages of 4096 bytes); the mock stays live until the end of the test.
    unsafe { std::ptr::copy_nonoverlapping(payload.as_ptr(), base.as_ptr().add(offset), payload.len()) };

    let resolved = b.batch_resolve(&keys(&["k", "missing"]), true);
    assert!(resolved[0].found && !resolved[1].found);
    assert_eq!((resolved[0].size, resolved[0].pages.as_slice()), (128, a.pages.as_slice()));
    let mut back = vec![0u8; 128];
    // SAFETY: as above; nothing writes the page concurrently.
    unsafe { std::ptr::copy_nonoverlapping(base.as_ptr().add(offset), back.as_mut_ptr(), back.len()) };
    assert_eq!(back, payload);

    assert_eq!(b.evict(&keys(&["k"]))[0].bytes_freed, 0, "the resolve's read lease protects the key");
    b.shutdown();
    assert_eq!((registrar.register_count(), registrar.live_registrations()), (1, 0));
}

#[test]
fn evict_frees_once_the_lease_ends() {
    let clock = ManualClock::new();
    let m = MockBackend::new(MockConfig { clock: clock.clone(), ..MockConfig::default() });
    m.init(Arc::new(LocalOnlyRegistrar::new())).unwrap();
    put(&m, "k", 128);
    m.batch_resolve(&keys(&["k"]), false);
    clock.advance(Duration::from_millis(501));
    assert_eq!(m.evict(&keys(&["k"])), [EvictResult { key: "k".into(), bytes_freed: 128 }], "no tick needed");
    assert_eq!(m.owned_key_count(), 0);
}

#[test]
fn drain_and_snapshot_events() {
    let (b, _) = live(TierType::Dram);
    put(&*b, "a", 1);
    put(&*b, "b", 2);
    assert_eq!(b.snapshot_owned_keys().len(), 2);
    assert_eq!(b.drain_pending_events(), [KvEvent::add("a", TierType::Dram, 1), KvEvent::add("b", TierType::Dram, 2)]);
    assert!(b.drain_pending_events().is_empty());
    assert_eq!(b.snapshot_owned_keys().len(), 2, "draining drops no key");
}

#[test]
fn reaper_tick_frees_expired_slots_and_counts_calls() {
    let clock = ManualClock::new();
    let m = MockBackend::new(MockConfig { clock: clock.clone(), pages: 4, ..MockConfig::default() });
    m.init(Arc::new(LocalOnlyRegistrar::new())).unwrap();
    let a = m.batch_allocate(&[AllocateRequest::new("p", 1)]).remove(0);
    assert_eq!(m.pending_slot_count(), 1);
    m.reaper_tick();
    assert_eq!(m.pending_slot_count(), 1, "not yet expired");
    clock.advance(Duration::from_secs(31));
    m.reaper_tick();
    assert_eq!(m.pending_slot_count(), 0);
    assert_eq!(m.batch_commit(&[CommitRequest::new(a.slot_id, "p")]), [CommitResult::default()]);
    let calls = m.calls();
    assert_eq!((calls.init, calls.batch_allocate, calls.batch_commit, calls.reaper_ticks), (1, 1, 1, 2));
}

#[test]
fn sample_metrics_reports_pages_in_use_as_a_gauge() {
    let (b, _) = live(TierType::Dram);
    put(&*b, "k", 4096 * 2 + 1);
    let samples: Vec<MetricSample> = b.sample_metrics();
    assert_eq!(samples.len(), 1);
    let s = &samples[0];
    assert_eq!((s.name, s.kind, s.value), ("umbp_backend_medium_state", MetricKind::Gauge, 3));
    assert_eq!(s.labels, [("state".to_owned(), "pages_in_use".to_owned())]);
}

#[test]
fn init_reports_bad_config_and_refused_registration() {
    let m = MockBackend::new(MockConfig { page_size: 0, ..MockConfig::default() });
    assert!(matches!(m.init(Arc::new(LocalOnlyRegistrar::new())), Err(BackendError::InvalidConfig(_))));

    let m = MockBackend::new(MockConfig::default());
    let refusing = Arc::new(FailingRegistrar::new());
    let err = m.init(Arc::clone(&refusing) as Arc<dyn MemoryRegistrar>).unwrap_err();
    assert!(matches!(err, BackendError::Registration { buffer_index: 0, .. }) && err.is_retryable());
    assert_eq!(refusing.refused_count(), 1);
    m.init(Arc::new(LocalOnlyRegistrar::new())).unwrap();
    assert_eq!(m.buffer_count(), 1, "a retried init brings the mock up");
}

#[test]
fn dropping_a_live_mock_deregisters_its_buffer() {
    let registrar = Arc::new(LocalOnlyRegistrar::new());
    let m = MockBackend::new(MockConfig::default());
    m.init(Arc::clone(&registrar) as Arc<dyn MemoryRegistrar>).unwrap();
    assert_eq!(registrar.live_registrations(), 1);
    drop(m);
    assert_eq!(registrar.live_registrations(), 0);
}

#[test]
fn registry_routes_by_tier_through_the_interface_only() {
    let hbm: Arc<dyn MediumBackend> = mock(TierType::Hbm);
    let mut registry = BackendRegistry::new();
    assert_eq!(registry.register(Arc::clone(&hbm)), Ok(0));
    assert!(Arc::ptr_eq(registry.get(TierType::Hbm).unwrap(), &hbm));
    assert!(registry.get(TierType::Dram).is_none(), "a tier the node does not lend");
    let all = registry.all();
    assert_eq!(all.len(), 1);
    assert!(Arc::ptr_eq(&all[0], &hbm));
    assert_eq!((registry.backend_id(&hbm), registry.page_size()), (Some(0), 4096));
}

#[test]
fn registry_assigns_ids_refuses_mismatches_and_keeps_ids_on_replace() {
    let mut registry = BackendRegistry::new();
    let hbm: Arc<dyn MediumBackend> = mock(TierType::Hbm);
    let dram: Arc<dyn MediumBackend> = mock(TierType::Dram);
    assert_eq!(registry.register(Arc::clone(&hbm)), Ok(0));
    assert_eq!(registry.register(Arc::clone(&dram)), Ok(1));

    let odd: Arc<dyn MediumBackend> =
        Arc::new(MockBackend::new(MockConfig { tier: TierType::Ssd, page_size: 8192, ..MockConfig::default() }));
    assert_eq!(
        registry.register(odd),
        Err(RegistryError::PageSizeMismatch { tier: TierType::Ssd, got: 8192, expected: 4096 })
    );
    assert!(registry.get(TierType::Ssd).is_none(), "a refusal changes nothing");
    assert_eq!(registry.register(mock(TierType::Unknown)), Err(RegistryError::UnknownTier(TierType::Unknown)));

    let hbm2: Arc<dyn MediumBackend> = mock(TierType::Hbm);
    assert_eq!(registry.register(Arc::clone(&hbm2)), Ok(0), "a replacement keeps its tier's id");
    assert!(Arc::ptr_eq(registry.by_id(0).unwrap(), &hbm2));
    assert_eq!(registry.backend_id(&hbm), None, "the replaced backend is gone");
    assert_eq!(registry.register(mock(TierType::Ssd)), Ok(2));
    assert_eq!(registry.len(), 3);
}

#[test]
fn registry_id_space_is_not_consumed_by_replacements() {
    // Only three real tiers exist, so a ninth distinct tier (`TooManyBackends`) cannot be built
    // through the public API. What can be tested: ids stay inside 0..MAX_BACKENDS_PER_PEER and
    // replacing a tier many times never spends a new id.
    let mut registry = BackendRegistry::new();
    for round in 0..3 * MAX_BACKENDS_PER_PEER {
        for (expected, tier) in TierType::ALL.into_iter().enumerate() {
            assert_eq!(registry.register(mock(tier)), Ok(expected as u32), "round {round}, {tier}");
        }
    }
    assert_eq!(registry.len(), TierType::ALL.len());
    assert!(registry.entries().all(|(id, _)| (id as usize) < MAX_BACKENDS_PER_PEER));
}

#[test]
fn registry_iterates_in_ascending_tier_order() {
    let mut registry = BackendRegistry::new();
    for tier in [TierType::Ssd, TierType::Hbm, TierType::Dram] {
        registry.register(mock(tier)).unwrap();
    }
    let tiers: Vec<TierType> = registry.all().iter().map(|b| b.tier()).collect();
    assert_eq!(tiers, TierType::ALL);
    let ids: Vec<u32> = registry.entries().map(|(id, _)| id).collect();
    assert_eq!(ids, [1, 2, 0], "ids follow registration order, iteration follows tiers");
}

#[test]
fn events_aggregate_across_backends_in_list_order() {
    let (hbm, _) = live(TierType::Hbm);
    let (ssd, _) = live(TierType::Ssd);
    put(&*ssd, "s", 2);
    put(&*hbm, "h", 1);
    let media = [Arc::clone(&hbm), Arc::clone(&ssd)];
    assert_eq!(drain_all_backends(&media), [KvEvent::add("h", TierType::Hbm, 1), KvEvent::add("s", TierType::Ssd, 2)]);
    assert!(drain_all_backends(&media).is_empty());
    assert_eq!(snapshot_all_backends_for_full_sync(&media).len(), 2);
}

#[test]
fn full_sync_snapshot_also_drops_the_outbox() {
    let (hbm, _) = live(TierType::Hbm);
    let (dram, _) = live(TierType::Dram);
    put(&*hbm, "h", 1);
    put(&*dram, "d", 1);
    let media = [hbm, dram];
    let snapshot = snapshot_all_backends_for_full_sync(&media);
    assert_eq!(snapshot, [KvEvent::add("h", TierType::Hbm, 1), KvEvent::add("d", TierType::Dram, 1)]);
    assert!(drain_all_backends(&media).is_empty());
}

#[test]
fn auto_flush_hook_fires_at_threshold() {
    let m = MockBackend::new(MockConfig::default());
    m.init(Arc::new(LocalOnlyRegistrar::new())).unwrap();
    let fired = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&fired);
    m.set_auto_flush_hook(2, Some(Arc::new(move || _ = counter.fetch_add(1, Ordering::SeqCst))));
    put(&m, "a", 1);
    assert_eq!(fired.load(Ordering::SeqCst), 0);
    put(&m, "b", 1);
    assert_eq!(fired.load(Ordering::SeqCst), 1, "fires on the 2nd commit");
    put(&m, "c", 1);
    assert_eq!((fired.load(Ordering::SeqCst), m.calls().auto_flushes), (1, 1), "once per crossing");
}

// --- the suite can fail -------------------------------------------------------------------------

/// One deliberate contract violation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Multi-key evict answers in reverse order.
    ReversedEvict,
    /// Abort of a slot id it never issued reports `false`.
    StrictAbort,
    /// The auto-flush hook fires one event early.
    EarlyAutoFlush,
    /// A value larger than the medium is `FailedNoSpace` (the reference's defect).
    OversizeIsNoSpace,
    /// Shutdown never deregisters (init hands the mock a registrar that drops deregistrations).
    LeaksRegistrations,
    /// The full-sync snapshot takes the lock twice: snapshot, then clear the outbox separately, so an
    /// event queued in between is neither in the snapshot nor ever shipped.
    TwoStepFullSync,
    /// Hits name their leases, but `release_reads` is not forwarded (a decorator that forgot it):
    /// leases only expire, and the default `batch_contains` leaves its leases behind.
    ForgetsRelease,
    /// A full medium answers busy instead of `FailedNoSpace` (takes full for busy: its writers
    /// would wait for room that only an eviction can make).
    BusyForFull,
    /// `clear_local` is not forwarded (a decorator that forgot it).
    ForgetsClear,
    /// `capacity` reports the whole medium free, whatever is reserved.
    FrozenCapacity,
    /// `owned_key_count` is always 0.
    CountsNoKeys,
    /// The outbox is drained into nothing: events are lost.
    LosesEvents,
    /// Every resolve is a miss.
    ResolvesNothing,
    /// Commits forget the writer's checksum (a medium that stores only pages and size).
    DropsChecksums,
    /// An empty abort batch answers one `true` (a decorator that pads its answers).
    PadsEmptyBatches,
    /// A key the medium does not own is answered busy (takes "not here" for "not now": its
    /// readers would wait instead of looking elsewhere).
    BusyForMissing,
    /// Samples carry `tier=` themselves (which the publisher stamps: the series would clash).
    LabelsItsTier,
    /// Reports the `Unknown` tier.
    UnknownTier,
    /// Describes a buffer before `init` registered any (a reader would copy from nothing).
    PublishesEarly,
    /// A failed `init` reports success (the node would serve a medium with no memory).
    SwallowsInitErrors,
    /// `shutdown` without an `init` panics (a node that failed to start would crash on cleanup).
    PanicsOnShutdownWithoutInit,
    /// A ranged resolve answers a part that starts one page later than its pages do (an
    /// off-by-one in a staged medium's partial read: the reader copies the wrong bytes).
    ShiftsRangedParts,
}

/// A registrar that forwards registrations and swallows deregistrations.
#[derive(Debug)]
struct Leaky(Arc<dyn MemoryRegistrar>);

impl MemoryRegistrar for Leaky {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.0.register_memory(region)
    }
    fn deregister(&self, _: &TransferRef) {}
}

#[derive(Debug)]
struct Flawed {
    inner: MockBackend,
    flaw: Flaw,
    issued: Mutex<HashSet<u64>>,
}

impl MetricSource for Flawed {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let mut samples = self.inner.sample_metrics();
        if self.flaw == Flaw::LabelsItsTier {
            for s in &mut samples {
                s.labels.push(("tier".to_owned(), "dram".to_owned()));
            }
        }
        samples
    }
}

impl MediumBackend for Flawed {
    fn tier(&self) -> TierType {
        if self.flaw == Flaw::UnknownTier { TierType::Unknown } else { self.inner.tier() }
    }
    fn name(&self) -> &str {
        "Flawed"
    }
    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        match self.flaw {
            Flaw::LeaksRegistrations => self.inner.init(Arc::new(Leaky(registrar))),
            Flaw::SwallowsInitErrors => {
                let _ = self.inner.init(registrar);
                Ok(())
            }
            _ => self.inner.init(registrar),
        }
    }
    fn shutdown(&self) {
        if self.flaw == Flaw::PanicsOnShutdownWithoutInit {
            assert!(self.inner.buffer_count() > 0, "shutdown before init");
        }
        self.inner.shutdown();
    }
    fn capacity(&self) -> TierCapacity {
        let c = self.inner.capacity();
        match self.flaw {
            Flaw::FrozenCapacity => TierCapacity { available_bytes: c.total_bytes, ..c },
            _ => c,
        }
    }
    fn owned_key_count(&self) -> usize {
        match self.flaw {
            Flaw::CountsNoKeys => 0,
            _ => self.inner.owned_key_count(),
        }
    }
    fn drain_pending_events(&self) -> Vec<KvEvent> {
        let events = self.inner.drain_pending_events();
        if self.flaw == Flaw::LosesEvents { Vec::new() } else { events }
    }
    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        self.inner.snapshot_owned_keys()
    }
    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        if self.flaw == Flaw::TwoStepFullSync {
            let snapshot = self.inner.snapshot_owned_keys();
            // The window stays open until a writer changed the owned keys (at most 20 ms): a
            // yield alone left it empty through a whole run on a loaded 2-core machine (CI,
            // 2026-12-05), and the check then saw no flaw.
            let until = std::time::Instant::now() + std::time::Duration::from_millis(20);
            while self.inner.owned_key_count() == snapshot.len() && std::time::Instant::now() < until {
                std::thread::yield_now();
            }
            self.inner.drain_pending_events();
            return snapshot;
        }
        self.inner.snapshot_owned_keys_for_full_sync()
    }
    fn clear_local(&self) {
        if self.flaw != Flaw::ForgetsClear {
            self.inner.clear_local();
        }
    }
    fn clear_full_sync_acked(&self) {
        self.inner.clear_full_sync_acked();
    }
    fn is_clear_full_sync_pending(&self) -> bool {
        self.inner.is_clear_full_sync_pending()
    }
    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        let threshold = match self.flaw {
            Flaw::EarlyAutoFlush => threshold.saturating_sub(1),
            _ => threshold,
        };
        self.inner.set_auto_flush_hook(threshold, hook);
    }
    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        let total = self.inner.capacity().total_bytes;
        let mut results = self.inner.batch_allocate(requests);
        self.issued.lock().extend(results.iter().map(|r| r.slot_id).filter(|id| *id != 0));
        if self.flaw == Flaw::BusyForFull {
            for r in results.iter_mut().filter(|r| r.outcome == AllocateOutcome::FailedNoSpace) {
                r.outcome = AllocateOutcome::Busy;
            }
        }
        if self.flaw == Flaw::OversizeIsNoSpace {
            for (r, q) in results.iter_mut().zip(requests) {
                if q.size > total {
                    r.outcome = AllocateOutcome::FailedNoSpace;
                }
            }
        }
        results
    }
    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        if self.flaw == Flaw::DropsChecksums {
            let stripped: Vec<_> = requests.iter().map(|r| r.clone().with_crc32c(None)).collect();
            return self.inner.batch_commit(&stripped);
        }
        self.inner.batch_commit(requests)
    }
    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        if self.flaw == Flaw::PadsEmptyBatches && slot_ids.is_empty() {
            return vec![true];
        }
        let mut results = self.inner.batch_abort(slot_ids);
        if self.flaw == Flaw::StrictAbort {
            let issued = self.issued.lock();
            for (ok, id) in results.iter_mut().zip(slot_ids) {
                *ok = issued.contains(id);
            }
        }
        results
    }
    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        if self.flaw == Flaw::ResolvesNothing {
            return keys.iter().map(|_| ResolvedEntry::miss()).collect();
        }
        let mut entries = self.inner.batch_resolve(keys, include_descs);
        if self.flaw == Flaw::BusyForMissing {
            for e in entries.iter_mut().filter(|e| !e.found) {
                *e = ResolvedEntry::busy();
            }
        }
        entries
    }
    fn batch_resolve_ranges(
        &self,
        keys: &[String],
        ranges: &[Vec<(u64, u64)>],
        include_descs: bool,
    ) -> Vec<ResolvedEntry> {
        let mut entries = self.batch_resolve(keys, include_descs);
        if self.flaw == Flaw::ShiftsRangedParts {
            for (e, r) in entries.iter_mut().zip(ranges) {
                if e.found && !r.is_empty() && e.pages.len() > 1 {
                    e.pages.pop();
                    e.partial = true;
                    e.first_page = 1;
                }
            }
        }
        entries
    }
    fn release_reads(&self, reads: &[ReadRelease]) {
        if self.flaw != Flaw::ForgetsRelease {
            self.inner.release_reads(reads);
        }
    }
    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        let mut results = self.inner.evict(keys);
        if self.flaw == Flaw::ReversedEvict {
            results.reverse();
        }
        results
    }
    fn page_size(&self) -> u64 {
        self.inner.page_size()
    }
    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        let descs = self.inner.all_buffer_descs();
        if self.flaw == Flaw::PublishesEarly && descs.is_empty() {
            let early = BufferDesc {
                backend_id: 0,
                buffer_index: 0,
                size: self.inner.page_size(),
                location: umbp_core::MemoryLocation::Host,
                remote: None,
            };
            return vec![early];
        }
        descs
    }
    fn buffer_count(&self) -> usize {
        self.inner.buffer_count()
    }
    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        self.inner.buffer_ref(index)
    }
}

fn failed_checks(flaw: Flaw) -> BTreeSet<&'static str> {
    let report = conformance::run_report(move |env: &Env| {
        let config = MockConfig { clock: env.clock(), pages: 8, ..MockConfig::default() };
        let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
        let flawed = Arc::new(Flawed { inner: MockBackend::new(config), flaw, issued: Mutex::default() });
        let reaper = Arc::clone(&flawed);
        Subject {
            backend: flawed,
            tick: Box::new(move || reaper.inner.reaper_tick()),
            read_lease,
            pending_ttl,
            background_reaper: false,
        }
    });
    assert_eq!(report.passed.len() + report.failed.len() + report.skipped.len(), conformance::checks().len());
    report.failed_names().into_iter().collect()
}

#[test]
fn suite_fails_a_full_sync_snapshot_that_clears_the_outbox_separately() {
    assert_eq!(
        failed_checks(Flaw::TwoStepFullSync),
        BTreeSet::from(["full_sync_snapshot_is_atomic_under_concurrent_commits"])
    );
}

#[test]
fn suite_fails_a_release_that_never_reaches_the_medium() {
    assert_eq!(
        failed_checks(Flaw::ForgetsRelease),
        BTreeSet::from([
            "release_ends_the_read_lease_at_once",
            "two_readers_hold_one_lease_until_both_release",
            "a_release_of_an_ended_lease_changes_nothing",
            "release_frees_a_cleared_keys_pages_at_once",
            // The default batch_contains releases through it too.
            "an_existence_check_holds_no_lease",
        ])
    );
}

#[test]
fn suite_fails_reversed_evict_results() {
    assert_eq!(
        failed_checks(Flaw::ReversedEvict),
        BTreeSet::from(["evict_results_one_per_key_in_order", "evict_unknown_is_zero_and_evict_is_idempotent"])
    );
}

#[test]
fn suite_fails_abort_that_is_not_idempotent() {
    assert_eq!(
        failed_checks(Flaw::StrictAbort),
        BTreeSet::from(["abort_is_idempotent", "events_follow_operation_order"])
    );
}

#[test]
fn suite_fails_an_early_auto_flush() {
    assert_eq!(
        failed_checks(Flaw::EarlyAutoFlush),
        BTreeSet::from([
            "auto_flush_fires_once_at_threshold",
            "auto_flush_rearms_after_full_sync_snapshot",
            "auto_flush_disabled_by_zero_and_none",
        ])
    );
}

#[test]
fn suite_fails_no_space_for_an_impossible_value() {
    assert_eq!(
        failed_checks(Flaw::OversizeIsNoSpace),
        BTreeSet::from(["key_larger_than_medium_is_failed_not_no_space", "batch_allocate_answers_positionally"])
    );
}

#[test]
fn suite_fails_busy_for_a_full_medium() {
    let failed = failed_checks(Flaw::BusyForFull);
    assert!(failed.contains("an_idle_medium_never_answers_allocate_busy"), "{failed:?}");
    assert!(failed.contains("full_medium_reports_no_space_then_recovers_after_abort"), "{failed:?}");
}

/// The mock answers allocations busy on request (for writers that must wait it out): nothing is
/// reserved, and the requests that would fail or dedup anyway answer as usual.
#[test]
fn answer_allocate_busy_answers_the_next_allocations_busy() {
    let mock = mock(TierType::Dram);
    mock.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    put(mock.as_ref(), "owned", 10);
    mock.answer_allocate_busy(2);
    let r = mock.batch_allocate(&[
        AllocateRequest::new("owned", 10),
        AllocateRequest::new("zero", 0),
        AllocateRequest::new("a", 10),
        AllocateRequest::new("b", 10),
        AllocateRequest::new("c", 10),
    ]);
    let outcomes: Vec<AllocateOutcome> = r.iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        [
            AllocateOutcome::AlreadyExists,
            AllocateOutcome::Failed,
            AllocateOutcome::Busy,
            AllocateOutcome::Busy,
            AllocateOutcome::Allocated
        ]
    );
    assert_eq!(mock.pending_slot_count(), 1, "busy reserved nothing");
}

#[test]
fn suite_fails_every_check_after_which_registrations_leak() {
    // The skipped background-reaper check initialises a subject too, so it fails here as well.
    let never_initialised = ["before_init_publishes_nothing", "shutdown_without_init_is_harmless"];
    let expected: BTreeSet<&str> =
        conformance::checks().iter().map(|c| c.name).filter(|n| !never_initialised.contains(n)).collect();
    assert_eq!(failed_checks(Flaw::LeaksRegistrations), expected);
}

#[test]
fn run_panics_with_every_failed_check_by_name() {
    let result = std::panic::catch_unwind(|| {
        conformance::run(|env: &Env| {
            let config = MockConfig { clock: env.clock(), pages: 8, ..MockConfig::default() };
            let flawed = Arc::new(Flawed {
                inner: MockBackend::new(config),
                flaw: Flaw::ReversedEvict,
                issued: Mutex::default(),
            });
            let reaper = Arc::clone(&flawed);
            Subject {
                backend: flawed,
                tick: Box::new(move || reaper.inner.reaper_tick()),
                read_lease: Duration::from_millis(500),
                pending_ttl: Duration::from_secs(30),
                background_reaper: false,
            }
        });
    });
    let payload = result.unwrap_err();
    let message = payload.downcast_ref::<String>().unwrap();
    assert!(message.contains("FAILED evict_results_one_per_key_in_order: "), "{message}");
    assert!(message.contains("FAILED evict_unknown_is_zero_and_evict_is_idempotent: "), "{message}");
}

// --- ownership of the auto-flush hook -----------------------------------------------------------

/// A hook payload that calls back into the backend when dropped, as a hook owning a handle to the
/// node might; dropping it under the backend's lock would deadlock.
struct CallsBackOnDrop(std::sync::Weak<MockBackend>, Arc<AtomicUsize>);

impl Drop for CallsBackOnDrop {
    fn drop(&mut self) {
        if let Some(backend) = self.0.upgrade() {
            backend.owned_key_count();
            backend.capacity();
        }
        self.1.fetch_add(1, Ordering::SeqCst);
    }
}

fn hook_holding<T: Send + Sync + 'static>(payload: T) -> AutoFlushHook {
    Arc::new(move || {
        let _ = &payload;
    })
}

#[test]
fn shutdown_drops_a_hook_that_captures_the_backend() {
    let m = Arc::new(MockBackend::new(MockConfig::default()));
    m.init(Arc::new(LocalOnlyRegistrar::new())).unwrap();
    m.set_auto_flush_hook(1, Some(hook_holding(Arc::clone(&m))));
    assert_eq!(Arc::strong_count(&m), 2, "the hook holds the backend: a cycle while live");
    m.shutdown();
    assert_eq!(Arc::strong_count(&m), 1, "shutdown dropped the hook, breaking the cycle");
    m.set_auto_flush_hook(1, Some(hook_holding(Arc::clone(&m))));
    assert_eq!(Arc::strong_count(&m), 1, "a hook set after shutdown is dropped at once");
    let weak = Arc::downgrade(&m);
    drop(m);
    assert!(weak.upgrade().is_none(), "the mock was freed");
}

#[test]
fn a_hook_is_dropped_outside_the_backend_lock() {
    let m = Arc::new(MockBackend::new(MockConfig::default()));
    m.init(Arc::new(LocalOnlyRegistrar::new())).unwrap();
    let dropped = Arc::new(AtomicUsize::new(0));
    let hook = || hook_holding(CallsBackOnDrop(Arc::downgrade(&m), Arc::clone(&dropped)));
    m.set_auto_flush_hook(1, Some(hook()));
    m.set_auto_flush_hook(1, Some(hook()));
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "replacing a hook drops the old one (without deadlock)");
    m.set_auto_flush_hook(1, None);
    assert_eq!(dropped.load(Ordering::SeqCst), 2, "None drops the hook");
    m.set_auto_flush_hook(1, Some(hook()));
    m.shutdown();
    assert_eq!(dropped.load(Ordering::SeqCst), 3, "shutdown drops the hook (without deadlock)");
    m.set_auto_flush_hook(1, Some(hook()));
    assert_eq!(dropped.load(Ordering::SeqCst), 4, "a hook set after shutdown is dropped at once (without deadlock)");
}

// --- the opt-in background-reaper check ---------------------------------------------------------

const BACKGROUND_CHECK: &str = "background_reaper_sweeps_without_tick";

fn background_check() -> &'static conformance::Check {
    match conformance::checks().iter().find(|c| c.name == BACKGROUND_CHECK) {
        Some(check) => check,
        None => panic!("{BACKGROUND_CHECK} is missing"),
    }
}

/// A mock that claims a background reaper, with or without really running one.
fn mock_claiming_a_reaper(env: &Env, runs_one: bool) -> Subject {
    let config = MockConfig { clock: env.clock(), pages: 8, ..MockConfig::default() };
    let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
    let mock = Arc::new(MockBackend::new(config));
    if runs_one {
        let weak = Arc::downgrade(&mock);
        std::thread::spawn(move || {
            while let Some(m) = weak.upgrade() {
                m.reaper_tick();
                drop(m);
                std::thread::sleep(Duration::from_millis(1));
            }
        });
    }
    let reaper = Arc::clone(&mock);
    Subject {
        backend: mock,
        tick: Box::new(move || reaper.reaper_tick()),
        read_lease,
        pending_ttl,
        background_reaper: true,
    }
}

#[test]
fn the_background_reaper_check_is_skipped_and_reported_for_a_medium_without_one() {
    let report = conformance::run_report(|env: &Env| {
        let config = MockConfig { clock: env.clock(), ..MockConfig::default() };
        let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
        let mock = Arc::new(MockBackend::new(config));
        let reaper = Arc::clone(&mock);
        Subject {
            backend: mock,
            tick: Box::new(move || reaper.reaper_tick()),
            read_lease,
            pending_ttl,
            background_reaper: false,
        }
    });
    assert!(report.is_ok(), "{report}");
    let skipped: Vec<&str> = report.skipped.iter().map(|(name, _)| *name).collect();
    assert_eq!(skipped, [BACKGROUND_CHECK]);
    assert!(!report.passed.contains(&BACKGROUND_CHECK), "a skipped check is not reported as passed");
    assert!(report.to_string().contains(&format!("(1 skipped)\n  skipped {BACKGROUND_CHECK}: ")), "{report}");
}

#[test]
fn the_background_reaper_check_passes_with_a_reaper_thread() {
    assert_eq!(background_check().outcome(|env| mock_claiming_a_reaper(env, true)), conformance::Outcome::Passed);
}

#[test]
fn the_background_reaper_check_fails_a_medium_that_only_claims_one() {
    // Waits out the check's 3 s deadline.
    match background_check().outcome(|env| mock_claiming_a_reaper(env, false)) {
        conformance::Outcome::Failed(message) => {
            assert!(message.contains("background reaper did not free an expired slot"), "{message}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[test]
fn suite_fails_a_clear_that_never_reaches_the_medium() {
    let failed = failed_checks(Flaw::ForgetsClear);
    for check in [
        "clear_local_drops_keys_and_gates_allocation",
        "pre_clear_slot_cannot_commit",
        "clear_local_releases_leased_pages_by_lease_end",
        "clear_local_races_no_new_owned_key_before_ack",
        "release_frees_a_cleared_keys_pages_at_once",
    ] {
        assert!(failed.contains(check), "{check} passed: {failed:?}");
    }
}

#[test]
fn suite_fails_a_capacity_that_never_moves() {
    let failed = failed_checks(Flaw::FrozenCapacity);
    for check in [
        "capacity_accounting",
        "full_medium_reports_no_space_then_recovers_after_abort",
        "zero_size_is_failed",
        "pending_slot_expires_after_ttl",
    ] {
        assert!(failed.contains(check), "{check} passed: {failed:?}");
    }
}

#[test]
fn suite_fails_an_owned_key_count_stuck_at_zero() {
    let failed = failed_checks(Flaw::CountsNoKeys);
    for check in [
        "owned_key_count_tracks_commits_and_evicts",
        "commit_makes_key_resolvable",
        "concurrent_clients_keep_accounting_exact",
    ] {
        assert!(failed.contains(check), "{check} passed: {failed:?}");
    }
}

#[test]
fn suite_fails_an_outbox_drained_into_nothing() {
    let failed = failed_checks(Flaw::LosesEvents);
    for check in [
        "events_follow_operation_order",
        "snapshot_does_not_mutate_outbox",
        "full_sync_snapshot_clears_outbox",
        "auto_flush_fires_once_at_threshold",
        "events_concatenate_across_media_in_one_stream",
    ] {
        assert!(failed.contains(check), "{check} passed: {failed:?}");
    }
}

#[test]
fn suite_fails_a_medium_that_resolves_nothing() {
    let failed = failed_checks(Flaw::ResolvesNothing);
    for check in [
        "commit_makes_key_resolvable",
        "batch_resolve_answers_positionally",
        "resolve_renews_the_read_lease",
        "release_ends_the_read_lease_at_once",
        "multi_page_values_round_trip_bookkeeping",
    ] {
        assert!(failed.contains(check), "{check} passed: {failed:?}");
    }
}

#[test]
fn suite_fails_each_lifecycle_and_answer_shape_flaw() {
    for (flaw, checks) in [
        (Flaw::PadsEmptyBatches, &["empty_batches_return_empty"][..]),
        (Flaw::BusyForMissing, &["an_idle_medium_never_answers_busy", "resolve_miss_takes_no_lease"]),
        (Flaw::LabelsItsTier, &["metric_samples_follow_the_naming_rule"]),
        (Flaw::UnknownTier, &["subject_meets_suite_requirements"]),
        (Flaw::PublishesEarly, &["before_init_publishes_nothing"]),
        (Flaw::SwallowsInitErrors, &["init_failure_is_reported_and_retryable"]),
        (Flaw::PanicsOnShutdownWithoutInit, &["shutdown_without_init_is_harmless"]),
    ] {
        let failed = failed_checks(flaw);
        for check in checks {
            assert!(failed.contains(check), "{flaw:?}: {check} passed: {failed:?}");
        }
    }
}

#[test]
fn suite_fails_a_ranged_part_that_names_the_wrong_pages() {
    let failed = failed_checks(Flaw::ShiftsRangedParts);
    assert_eq!(failed, BTreeSet::from(["ranged_resolve_holds_every_asked_byte"]), "only the ranged check");
}

#[test]
fn suite_fails_a_medium_that_forgets_checksums() {
    let failed = failed_checks(Flaw::DropsChecksums);
    assert_eq!(failed, BTreeSet::from(["commit_keeps_the_writers_checksum"]), "only the checksum check");
}

/// Which checks some negative control above proves can fail (a flaw that breaks every check for one
/// generic reason, leaked registrations, does not count): every check but the ones pinned here,
/// which no flawed medium fails yet. A new check joins the pinned list until a flaw fails it.
#[test]
fn every_check_but_the_pinned_few_is_failed_by_some_flaw() {
    let flaws = [
        Flaw::ReversedEvict,
        Flaw::StrictAbort,
        Flaw::EarlyAutoFlush,
        Flaw::OversizeIsNoSpace,
        Flaw::TwoStepFullSync,
        Flaw::ForgetsRelease,
        Flaw::BusyForFull,
        Flaw::ForgetsClear,
        Flaw::FrozenCapacity,
        Flaw::CountsNoKeys,
        Flaw::LosesEvents,
        Flaw::ResolvesNothing,
        Flaw::DropsChecksums,
        Flaw::PadsEmptyBatches,
        Flaw::BusyForMissing,
        Flaw::LabelsItsTier,
        Flaw::UnknownTier,
        Flaw::PublishesEarly,
        Flaw::SwallowsInitErrors,
        Flaw::PanicsOnShutdownWithoutInit,
        Flaw::ShiftsRangedParts,
    ];
    let failed: BTreeSet<&str> = flaws.into_iter().flat_map(failed_checks).collect();
    let never: BTreeSet<&str> = conformance::checks().iter().map(|c| c.name).filter(|n| !failed.contains(n)).collect();
    let pinned = BTreeSet::from([
        // A second init that registers again: only the leaked-registrations flaw, which fails
        // everything (a decorator cannot make the mock register twice).
        "init_is_idempotent_and_registers_buffers",
        // Proven apart (the_background_reaper_check_fails_a_medium_that_only_claims_one).
        "background_reaper_sweeps_without_tick",
    ]);
    assert_eq!(never, pinned, "checks no flaw fails");
}
