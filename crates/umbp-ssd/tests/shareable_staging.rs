//! `SsdConfigBuilder::shareable_staging`: the staging arena becomes a sealed memory file, which
//! the medium registers with `register_shareable` (so a node's shared-memory server can hand it to
//! same-host peers); off, it stays private memory registered with `register_memory`.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_core::{LocalRegion, MediumBackend, MemoryRegistrar, RegistrationError, SharedBacking, TransferRef};
use umbp_ssd::{SsdBackend, SsdConfig};

const PAGE: u64 = 4096;
const PAGES: u64 = 8;

/// What a registration saw: the region's length, and for a shareable one the file's size and seals
/// and the offset.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Memory { len: u64 },
    Shareable { len: u64, file_len: u64, seals: i32, offset: u64 },
}

#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<Seen>>);

impl MemoryRegistrar for Recorder {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.0.lock().push(Seen::Memory { len: region.len() });
        Ok(TransferRef::local(region))
    }

    fn register_shareable(
        &self,
        region: LocalRegion,
        backing: SharedBacking<'_>,
    ) -> Result<TransferRef, RegistrationError> {
        let fd = backing.fd().as_raw_fd();
        // SAFETY: `fd` is a live descriptor for the duration of this call (`SharedBacking`'s
        // borrow); `st` is a plain out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0, "fstat");
        // SAFETY: as above; F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        self.0.lock().push(Seen::Shareable {
            len: region.len(),
            file_len: st.st_size as u64,
            seals,
            offset: backing.offset(),
        });
        Ok(TransferRef::local(region))
    }

    fn deregister(&self, _r: &TransferRef) {}
}

fn registered(shareable: bool) -> Vec<Seen> {
    let dir = tempfile::Builder::new().prefix("umbp-ssd-share").tempdir_in(std::env::temp_dir()).expect("tempdir");
    let config = SsdConfig::builder([dir.path()])
        .page_size(PAGE)
        .capacity_bytes(4 * PAGES * PAGE)
        .staging_pages(PAGES)
        .segment_bytes(1 << 20)
        .shareable_staging(shareable)
        .build()
        .expect("valid config");
    assert_eq!(config.shareable_staging(), shareable);
    let backend = SsdBackend::new(config);
    let recorder = Arc::new(Recorder::default());
    backend.init(Arc::clone(&recorder) as Arc<dyn MemoryRegistrar>).expect("init");
    let seen = recorder.0.lock().clone();
    backend.shutdown();
    seen
}

#[test]
fn a_shareable_staging_arena_is_registered_with_its_sealed_memory_file() {
    let seen = registered(true);
    let [Seen::Shareable { len, file_len, seals, offset }] = seen[..] else { panic!("one shareable arena: {seen:?}") };
    assert_eq!(len, PAGES * PAGE, "the whole arena");
    assert!(file_len >= offset + len, "the file covers the region");
    for seal in [libc::F_SEAL_SHRINK, libc::F_SEAL_GROW, libc::F_SEAL_SEAL] {
        assert_ne!(seals & seal, 0, "seal {seal:#x} in {seals:#x}: a mapping can never reach past the file");
    }
}

#[test]
fn a_private_staging_arena_is_registered_as_memory() {
    assert_eq!(registered(false), vec![Seen::Memory { len: PAGES * PAGE }]);
}
