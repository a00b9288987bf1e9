//! `MockBackend` passes the conformance suite, at the smallest and at a larger geometry.

use std::sync::Arc;
use std::time::Duration;

use umbp_core::TierType;
use umbp_testkit::conformance::{self, Env, Subject};
use umbp_testkit::{MockBackend, MockConfig};

fn subject(env: &Env, config: MockConfig) -> Subject {
    let config = MockConfig { clock: env.clock(), ..config };
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
}

#[test]
fn mock_backend_conforms() {
    conformance::run(|env| subject(env, MockConfig::default()));
}

#[test]
fn mock_backend_conforms_at_the_smallest_geometry() {
    // 4 one-byte pages and a lease longer than the pending TTL: the suite's edge of what it accepts.
    conformance::run(|env| {
        let config = MockConfig {
            tier: TierType::Hbm,
            page_size: 1,
            pages: 4,
            pending_ttl: Duration::from_millis(3),
            read_lease_ttl: Duration::from_millis(7),
            ..MockConfig::default()
        };
        subject(env, config)
    });
}

#[test]
fn mock_backend_conforms_at_the_largest_geometry() {
    conformance::run(|env| subject(env, MockConfig { pages: 4096, page_size: 512, ..MockConfig::default() }));
}

#[test]
fn every_check_has_a_distinct_name_and_a_contract() {
    let checks = conformance::checks();
    // Pinned: a check that disappears (or a new one) shows here, not as a silently shorter suite.
    // A new check also joins mock_backend.rs's negative-control coverage list.
    assert_eq!(checks.len(), 62, "the suite has {} checks", checks.len());
    let mut names: Vec<_> = checks.iter().map(|c| c.name).collect();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), checks.len(), "two checks share a name");
    assert!(checks.iter().all(|c| !c.contract.is_empty()));
}

#[test]
fn a_single_check_runs_alone() {
    let Some(check) = conformance::checks().iter().find(|c| c.name == "commit_race_first_wins") else {
        panic!("commit_race_first_wins is missing");
    };
    assert_eq!(check.run(|env| subject(env, MockConfig::default())), Ok(()));
}

#[test]
fn mock_backend_conforms_with_a_background_reaper_thread() {
    // A thread sweeps every millisecond against the suite's clock, racing every check's own ticks; the
    // subject claims it, so the background-reaper check runs instead of being skipped.
    let report = conformance::run_report(|env| {
        let config = MockConfig { clock: env.clock(), pages: 64, ..MockConfig::default() };
        let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
        let mock = Arc::new(MockBackend::new(config));
        let weak = Arc::downgrade(&mock);
        std::thread::spawn(move || {
            while let Some(mock) = weak.upgrade() {
                mock.reaper_tick();
                drop(mock);
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let reaper = Arc::clone(&mock);
        Subject {
            backend: mock,
            tick: Box::new(move || reaper.reaper_tick()),
            read_lease,
            pending_ttl,
            background_reaper: true,
        }
    });
    assert!(report.is_ok() && report.skipped.is_empty(), "{report}");
}
