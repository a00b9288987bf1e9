//! `ObjectBackend` passes the medium conformance suite against a real S3-compatible server
//! (`moto_server`, started by the test on a loopback port) and against a local directory.
//!
//! The suite is written for media whose values span pages and whose capacity is the arena, so the
//! subject matches: values up to the whole medium (`max_value_pages`), a staging arena as large as
//! the capacity (so cached copies are reclaimed only when their pages are wanted). Each subject
//! gets a prefix of its own, so no subject recovers another's objects.

mod support;

use std::sync::Arc;
use std::time::Duration;

use support::Moto;
use umbp_object::{ObjectBackend, ObjectConfig};
use umbp_testkit::conformance::{self, Env, Subject};

const PAGE: u64 = 4096;
const PAGES: u64 = 16;

fn subject(env: &Env, url: &str, endpoint: Option<&str>) -> Subject {
    let mut b = ObjectConfig::builder(url)
        .page_size(PAGE)
        .capacity_bytes(PAGES * PAGE)
        .staging_pages(PAGES)
        .max_value_pages(PAGES)
        .io_threads(4)
        .reaper_interval(Duration::from_millis(2))
        .pending_ttl(Duration::from_millis(50))
        .read_lease_ttl(Duration::from_millis(80))
        .credentials(support::credentials())
        .clock(env.clock());
    if let Some(e) = endpoint {
        b = b.endpoint(e);
    }
    let config = b.build().expect("valid config");
    let (read_lease, pending_ttl) = (config.read_lease_ttl(), config.pending_ttl());
    let backend = Arc::new(ObjectBackend::new(config));
    let reaper = Arc::clone(&backend);
    Subject { backend, tick: Box::new(move || reaper.reaper_tick()), read_lease, pending_ttl, background_reaper: true }
}

#[test]
fn object_backend_conforms_over_moto_s3() {
    let Some(moto) = Moto::start() else { return };
    moto.client("conformance").create_bucket();
    let endpoint = moto.endpoint();
    conformance::run(|env| {
        let url = format!("s3://conformance/{}", support::unique_prefix("subject"));
        subject(env, &url, Some(&endpoint))
    });
}

#[test]
fn object_backend_conforms_over_a_local_directory() {
    let root = tempfile::tempdir().expect("tempdir");
    conformance::run(|env| {
        let dir = root.path().join(support::unique_prefix("subject"));
        std::fs::create_dir(&dir).expect("subject dir");
        subject(env, &format!("file://{}", dir.display()), None)
    });
}
