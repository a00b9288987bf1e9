//! The CXL medium passes the medium conformance suite over a regular file and over a tmpfs file
//! (`/dev/shm`), the stand-ins for a device-DAX device here; and refuses a path it cannot use with an
//! error naming it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use umbp_core::TierType;
use umbp_cxl::{CxlConfig, CxlError, CxlPageMemorySource};
use umbp_page::{PageBackend, PageBackendConfig};
use umbp_testkit::conformance::{self, Env, Subject};

fn subject(env: &Env, path: &Path, config: PageBackendConfig) -> Subject {
    let config = config.with_clock(env.clock());
    let (read_lease, pending_ttl) = (config.read_lease_ttl, config.pending_ttl);
    let source = CxlPageMemorySource::open(&CxlConfig::new(path, config.buffer_sizes.iter().sum()))
        .expect("the file can hold the geometry");
    let backend = Arc::new(PageBackend::new(config, Box::new(source)).expect("valid config"));
    let reaper = Arc::clone(&backend);
    Subject { backend, tick: Box::new(move || reaper.reaper_tick()), read_lease, pending_ttl, background_reaper: true }
}

#[test]
fn cxl_backend_conforms_over_a_regular_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cxl.img");
    // The reference geometry: 3 buffers x 4 pages x 1 KiB (each buffer its own page-aligned range).
    conformance::run(|env| subject(env, &path, PageBackendConfig::new(TierType::Dram, 1024, vec![4096; 3])));
}

#[test]
fn cxl_backend_conforms_over_a_tmpfs_file_with_a_busy_reaper() {
    let shm = Path::new("/dev/shm");
    assert!(shm.is_dir(), "this test needs a tmpfs at /dev/shm");
    let dir = tempfile::tempdir_in(shm).expect("tempdir in /dev/shm");
    let path = dir.path().join("cxl.img");
    conformance::run(|env| {
        subject(
            env,
            &path,
            PageBackendConfig::new(TierType::Dram, 4096, vec![256 * 4096])
                .with_reaper_interval(Duration::from_millis(1))
                .with_pending_ttl(Duration::from_millis(20))
                .with_read_lease_ttl(Duration::from_millis(40)),
        )
    });
}

#[test]
fn a_directory_a_missing_parent_and_a_file_that_cannot_grow_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = CxlPageMemorySource::open(&CxlConfig::new(dir.path(), 1 << 20)).expect_err("a directory");
    assert!(matches!(err, CxlError::NotMappable { kind: "directory", .. }), "{err}");
    assert!(err.to_string().contains(&dir.path().display().to_string()), "names the path: {err}");

    let missing = dir.path().join("no-such-dir/cxl.img");
    let err = CxlPageMemorySource::open(&CxlConfig::new(&missing, 1 << 20)).expect_err("no parent");
    assert!(matches!(err, CxlError::Open { .. }), "{err}");

    // 1 PiB: more than this filesystem (or any test machine's) holds.
    let huge = dir.path().join("huge.img");
    let err = CxlPageMemorySource::open(&CxlConfig::new(&huge, 1 << 50)).expect_err("cannot grow to 1 PiB");
    assert!(matches!(err, CxlError::Grow { capacity, .. } if capacity == 1 << 50), "{err}");
    assert!(err.to_string().contains("huge.img"), "names the path: {err}");
    assert!(!huge.exists(), "the file the failed open created is removed");

    let err = CxlPageMemorySource::open(&CxlConfig::default()).expect_err("no path");
    assert!(matches!(err, CxlError::NoPath), "{err}");
    let err = CxlPageMemorySource::open(&CxlConfig::new(dir.path().join("z"), 0)).expect_err("zero capacity");
    assert!(matches!(err, CxlError::Capacity { .. }), "{err}");
}

#[test]
fn a_device_that_is_not_a_dax_device_is_refused_when_mapped() {
    // /dev/null is a character device with no sysfs geometry: it opens, and mapping it fails.
    let source = CxlPageMemorySource::open(&CxlConfig::new("/dev/null", 2 << 20)).expect("a character device opens");
    assert_eq!(source.align(), umbp_cxl::DEFAULT_DAX_ALIGN);
    let err = umbp_page::PageMemorySource::allocate(&source, &[2 << 20]).expect_err("/dev/null does not map");
    assert!(matches!(err, umbp_page::SourceError::Allocation { .. }), "{err}");
}
