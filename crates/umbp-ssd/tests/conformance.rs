//! `SsdBackend` passes the medium conformance suite with each io engine, with its staging arena
//! private or shareable (a sealed memory file), with its background reaper racing the suite's own
//! ticks.
//!
//! The suite is written for media whose values span pages and whose capacity is the arena, so the
//! subject is configured to match: values up to the whole medium (`max_value_pages`), a staging
//! arena as large as the drive capacity (so a committed value's cached staging pages are never
//! reclaimed under the suite's feet), and no LRU eviction of its own (the suite fills the medium and
//! expects every committed key to stay).

use std::sync::Arc;
use std::time::Duration;

use umbp_ssd::{IoEngineKind, SsdBackend, SsdConfig};
use umbp_testkit::conformance::{self, Env, Subject};
use umbp_testkit::require;

const PAGE: u64 = 4096;
const PAGES: u64 = 16;

fn subject(env: &Env, engine: IoEngineKind, shareable_staging: bool) -> Subject {
    subject_with(env, engine, shareable_staging, true)
}

fn subject_with(env: &Env, engine: IoEngineKind, shareable_staging: bool, cache_committed: bool) -> Subject {
    let dir = tempfile::Builder::new().prefix("umbp-ssd-conf").tempdir_in(std::env::temp_dir()).expect("tempdir");
    let config = SsdConfig::builder([dir.path()])
        .page_size(PAGE)
        .capacity_bytes(PAGES * PAGE)
        .staging_pages(PAGES)
        .max_value_pages(PAGES)
        .segment_bytes(1 << 20)
        .io_engine(engine)
        .shareable_staging(shareable_staging)
        .cache_committed(cache_committed)
        .watermarks(None)
        .reaper_interval(Duration::from_millis(2))
        .pending_ttl(Duration::from_millis(50))
        .read_lease_ttl(Duration::from_millis(80))
        .clock(env.clock())
        .build()
        .expect("valid config");
    let (read_lease, pending_ttl) = (config.read_lease_ttl(), config.pending_ttl());
    let backend = Arc::new(SsdBackend::new(config));
    let reaper = Arc::clone(&backend);
    Subject {
        backend,
        // The closure owns the directory: it is removed when the suite drops the subject.
        tick: Box::new(move || {
            let _keep = &dir;
            reaper.reaper_tick();
        }),
        read_lease,
        pending_ttl,
        background_reaper: true,
    }
}

#[test]
fn ssd_backend_conforms_with_psync() {
    conformance::run(|env| subject(env, IoEngineKind::Psync, false));
}

/// Without a cached copy of what was just written, every first read reaches the drive: a ranged
/// resolve then reads only the blocks it covers (a partial hit), and its check still passes. (Other
/// checks expect a resolve right after a commit to answer the slot's own pages, which only a
/// cached commit does, so only the ranged check is asked of this subject.)
#[test]
fn ssd_backend_passes_the_ranged_check_when_every_read_reaches_the_drive() {
    let name = "ranged_resolve_holds_every_asked_byte";
    let Some(check) = conformance::checks().iter().find(|c| c.name == name) else { panic!("{name} is missing") };
    assert_eq!(check.run(|env| subject_with(env, IoEngineKind::Psync, false, false)), Ok(()));
}

/// The staging arena as a sealed memory file (what a node with the shared-memory path uses): the
/// drive IO (direct IO into shared-memory pages) behaves the same.
#[test]
fn ssd_backend_conforms_with_a_shareable_staging_arena() {
    conformance::run(|env| subject(env, IoEngineKind::Psync, true));
}

#[test]
fn ssd_backend_conforms_with_io_uring() {
    if let Err(e) = umbp_ssd::io_uring_available() {
        return require::skip(require::IO_URING, format_args!("io_uring is not available here ({e})"));
    }
    conformance::run(|env| subject(env, IoEngineKind::IoUring, false));
}

/// io_uring registers the staging arena as a fixed buffer: a memory file's pages must do as well.
#[test]
fn ssd_backend_conforms_with_io_uring_and_a_shareable_staging_arena() {
    if let Err(e) = umbp_ssd::io_uring_available() {
        return require::skip(require::IO_URING, format_args!("io_uring is not available here ({e})"));
    }
    conformance::run(|env| subject(env, IoEngineKind::IoUring, true));
}
