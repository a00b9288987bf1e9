//! Identity, init, shutdown and metrics.

use std::sync::Arc;

use umbp_core::{MediumBackend, TierType};

use super::fixture::Fixture;
use crate::registrar::{FailingRegistrar, LocalOnlyRegistrar};

pub(super) fn subject_meets_suite_requirements(fx: &Fixture<'_>) {
    // `live` asserts the geometry; the rest is identity.
    let s = fx.live();
    assert_ne!(s.backend.tier(), TierType::Unknown, "a medium must serve a real tier");
    assert!(!s.backend.name().is_empty(), "name() is empty");
    assert!(!s.read_lease.is_zero() && !s.pending_ttl.is_zero(), "the subject reports a zero lease or TTL");
    let total = s.total();
    s.put("probe", 1);
    assert_eq!(s.total(), total, "total capacity changed when a key was stored");
}

pub(super) fn before_init_publishes_nothing(fx: &Fixture<'_>) {
    let s = fx.uninit();
    assert!(s.backend.buffer_ref(0).is_none(), "buffer_ref(0) is Some before init");
    assert!(s.backend.all_buffer_descs().is_empty(), "all_buffer_descs is not empty before init");
}

pub(super) fn init_is_idempotent_and_registers_buffers(fx: &Fixture<'_>) {
    let s = fx.live();
    let b = &s.backend;
    let n = b.buffer_count();
    assert!(n >= 1, "a live medium publishes no buffer");
    assert_eq!(s.registrar.register_count(), n, "init must register each of its {n} buffers exactly once");

    assert!(fx.init(&s).is_ok(), "a second init with the same registrar failed");
    let other = Arc::new(LocalOnlyRegistrar::new());
    assert!(fx.init_with(&s, Arc::clone(&other)).is_ok(), "a second init with another registrar failed");
    assert_eq!(s.registrar.register_count(), n, "a second init registered buffers again");
    assert_eq!(other.register_count(), 0, "a second init registered buffers with the new registrar");

    let ps = s.ps();
    let descs = b.all_buffer_descs();
    assert_eq!(descs.len(), n, "all_buffer_descs has {} entries for {n} buffers", descs.len());
    let mut published = 0u64;
    for (i, d) in descs.iter().enumerate() {
        let Some(r) = b.buffer_ref(i) else { panic!("buffer_ref({i}) is None for one of {n} buffers") };
        assert!(r.is_valid() && r.has_local(), "buffer_ref({i}) is not a usable local ref: {r:?}");
        assert_eq!(r.size() % ps, 0, "buffer_ref({i}) publishes {} bytes, not whole {ps}-byte pages", r.size());
        let Some(region) = r.local_region() else { panic!("buffer_ref({i}) has no local region") };
        assert!(s.registrar.is_registered(region), "buffer_ref({i})'s region was never registered");
        assert!(r.size() <= region.len(), "buffer_ref({i}) publishes more bytes than it registered");
        assert_eq!(r.location(), region.location(), "buffer_ref({i})'s location differs from its region's");
        assert_eq!(d.buffer_index as usize, i, "all_buffer_descs is not in ascending buffer order");
        assert_eq!(d.backend_id, 0, "a backend publishes backend_id 0; the wire boundary stamps the real id");
        assert_eq!((d.size, d.location), (r.size(), r.location()), "desc {i} disagrees with buffer_ref({i})");
        published += r.size();
    }
    assert!(published >= s.total(), "buffers publish {published} bytes but capacity claims {}", s.total());
    assert_eq!(s.registrar.last_location(), b.buffer_ref(n - 1).map(|r| r.location()), "registered location");
    assert!(b.buffer_ref(n).is_none(), "buffer_ref({n}) is Some past the last buffer");
    assert!(b.buffer_ref(usize::MAX).is_none(), "buffer_ref(usize::MAX) is Some");
}

pub(super) fn init_failure_is_reported_and_retryable(fx: &Fixture<'_>) {
    let s = fx.uninit();
    let refusing = Arc::new(FailingRegistrar::new());
    let Err(e) = fx.init_with(&s, Arc::clone(&refusing)) else {
        panic!("init succeeded although the registrar refused every registration");
    };
    assert!(refusing.refused_count() >= 1, "init reported {e} without trying to register");
    assert!(s.backend.buffer_ref(0).is_none(), "a failed init published buffer 0");
    // A refused registration is retryable (`BackendError::is_retryable`): the medium must come up
    // with a registrar that accepts.
    assert!(e.is_retryable(), "a refused registration should be a retryable init error, got {e}");
    if let Err(e) = fx.init(&s) {
        panic!("init after a refused registration failed: {e}");
    }
    s.put("after-retry", 1);
    s.backend.shutdown();
    assert_eq!(s.registrar.live_registrations(), 0, "shutdown after a retried init left registrations");

    // Refuse the second registration: a medium with several buffers must undo the first.
    let s2 = fx.uninit();
    let partial = Arc::new(FailingRegistrar::allowing(1));
    let outcome = fx.init_with(&s2, Arc::clone(&partial));
    s2.backend.shutdown();
    s2.backend.shutdown();
    assert_eq!(
        partial.accepted().live_registrations(),
        0,
        "after init ({}) and shutdown, registrations remain",
        if outcome.is_ok() { "ok: one buffer" } else { "failed" }
    );
}

pub(super) fn shutdown_deregisters_everything_and_is_idempotent(fx: &Fixture<'_>) {
    let s = fx.live();
    let n = s.registrar.register_count();
    s.put("owned", s.ps());
    s.alloc_ok("pending", 1);
    s.resolve("owned", true);
    s.backend.shutdown();
    assert_eq!(s.registrar.live_registrations(), 0, "shutdown left buffers registered");
    assert!(s.registrar.deregister_count() >= n, "shutdown deregistered fewer buffers than it registered");
    assert_published_nothing(&s.backend, "after shutdown");
    let d = s.registrar.deregister_count();
    s.backend.shutdown();
    assert_eq!(s.registrar.deregister_count(), d, "a second shutdown deregistered again");
    assert_eq!(s.registrar.register_count(), n, "shutdown registered something");
    assert_published_nothing(&s.backend, "after a second shutdown");
}

/// A shut-down medium publishes no buffer: its memory is gone, so a ref to it would dangle.
fn assert_published_nothing(b: &Arc<dyn MediumBackend>, when: &str) {
    assert_eq!(b.buffer_count(), 0, "buffer_count() {when}");
    assert!(b.buffer_ref(0).is_none(), "buffer_ref(0) is Some {when}");
    assert!(b.all_buffer_descs().is_empty(), "all_buffer_descs is not empty {when}");
}

pub(super) fn shutdown_without_init_is_harmless(fx: &Fixture<'_>) {
    let s = fx.uninit();
    s.backend.shutdown();
    s.backend.shutdown();
    assert_eq!(s.registrar.register_count() + s.registrar.deregister_count(), 0, "touched the registrar");
}

pub(super) fn shut_down_backend_refuses_init(fx: &Fixture<'_>) {
    let s = fx.live();
    s.backend.shutdown();
    let again = Arc::new(LocalOnlyRegistrar::new());
    assert!(fx.init_with(&s, Arc::clone(&again)).is_err(), "init after shutdown succeeded");
    assert_eq!(again.register_count(), 0, "a refused init registered memory");
}

pub(super) fn metric_samples_follow_the_naming_rule(fx: &Fixture<'_>) {
    let s = fx.live();
    s.put("k", 1);
    s.alloc_ok("p", 1);
    for m in s.backend.sample_metrics() {
        assert!(m.name.starts_with("umbp_backend_medium_"), "sample {:?} is not under a generic medium name", m.name);
        assert!(!m.help.is_empty(), "sample {} has no help text", m.name);
        for (label, _) in &m.labels {
            assert!(
                label != "tier" && label != "backend",
                "sample {} sets {label}=, which the publisher stamps",
                m.name
            );
        }
    }
}
