//! `PageBackend` over real anonymous host memory passes the medium conformance suite, at several
//! geometries, with and without its background reaper racing the suite's own ticks; and so does its
//! shareable memory (sealed memory files mapped `MAP_SHARED`).

use std::sync::Arc;
use std::time::Duration;

use umbp_core::TierType;
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_testkit::conformance::{self, Env, Subject};

fn subject(env: &Env, config: PageBackendConfig) -> Subject {
    subject_with(env, config, false)
}

fn subject_with(env: &Env, config: PageBackendConfig, shareable: bool) -> Subject {
    let config = config.with_clock(env.clock());
    let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
    let source =
        HostPageMemorySource::new(HostMemoryOptions { prefault: false, shareable, ..HostMemoryOptions::default() });
    let backend = Arc::new(PageBackend::new(config, Box::new(source)).expect("valid config"));
    let reaper = Arc::clone(&backend);
    Subject { backend, tick: Box::new(move || reaper.reaper_tick()), read_lease, pending_ttl, background_reaper: true }
}

#[test]
fn page_backend_conforms_with_three_small_buffers() {
    // The reference test geometry: 3 buffers x 4 pages x 1 KiB.
    conformance::run(|env| subject(env, PageBackendConfig::new(TierType::Dram, 1024, vec![4096; 3])));
}

#[test]
fn page_backend_conforms_with_one_large_buffer_and_a_busy_reaper() {
    // A 1 ms background reaper sweeps against the same manual clock while the suite ticks.
    conformance::run(|env| {
        subject(
            env,
            PageBackendConfig::new(TierType::Hbm, 4096, vec![256 * 4096])
                .with_reaper_interval(Duration::from_millis(1))
                .with_pending_ttl(Duration::from_millis(20))
                .with_read_lease_ttl(Duration::from_millis(40)),
        )
    });
}

#[test]
fn page_backend_conforms_with_many_one_page_buffers() {
    // Every multi-page value scatters across buffers (strategy 3 of the allocator).
    conformance::run(|env| subject(env, PageBackendConfig::new(TierType::Ssd, 4096, vec![4096; 64])));
}

#[test]
fn shareable_page_backend_conforms_with_three_small_buffers() {
    conformance::run(|env| subject_with(env, PageBackendConfig::new(TierType::Dram, 1024, vec![4096; 3]), true));
}

#[test]
fn shareable_page_backend_conforms_with_many_one_page_buffers_and_a_busy_reaper() {
    conformance::run(|env| {
        subject_with(
            env,
            PageBackendConfig::new(TierType::Dram, 4096, vec![4096; 64])
                .with_reaper_interval(Duration::from_millis(1))
                .with_pending_ttl(Duration::from_millis(20))
                .with_read_lease_ttl(Duration::from_millis(40)),
            true,
        )
    });
}
