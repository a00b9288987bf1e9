//! The shared-memory engine inside the composite, over the real TCP data plane and a real
//! `ShmServer` (holder and reader in one process: the path needs only the same host): selection
//! before TCP, byte-exact pulls and pushes with TCP moving nothing, a region deregistered while
//! mapped, a mapping gone stale between plan and submit falling back to TCP, a wrong token and a
//! holder without a server left to TCP (and remembered), regions that are not shareable.

use std::os::fd::OwnedFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, SharedBacking, TransferRef};
use umbp_transfer::shm::{ShmServer, ShmServerConfig};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, LocalCopyEngine, SharedMemoryConfig, SharedMemoryEngine, TcpEngine,
    TcpEngineConfig, TransferEngine, TransferItem, failed_tags, transfer,
};

const LEN: usize = 4 << 20;

/// A sealed memory file mapped read-write, as a shareable medium makes one; never unmapped (the
/// test process ends).
struct SealedFile {
    fd: OwnedFd,
    base: NonNull<u8>,
}

impl SealedFile {
    fn new() -> Self {
        let fd = rustix::fs::memfd_create("test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
        rustix::fs::ftruncate(&fd, LEN as u64).expect("size");
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).expect("seal");
        // SAFETY: a fresh shared mapping of the whole file.
        let base = unsafe {
            rustix::mm::mmap(ptr::null_mut(), LEN, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
        }
        .expect("mmap");
        Self { fd, base: NonNull::new(base.cast()).expect("non-null") }
    }

    fn region(&self) -> LocalRegion {
        // SAFETY: the mapping lives as long as the test process.
        unsafe { LocalRegion::new(self.base, LEN as u64, MemoryLocation::Host) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the live mapping; the tests read it only between transfers.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), LEN) }
    }

    fn fill(&self, at: usize, data: &[u8]) {
        assert!(at + data.len() <= LEN);
        // SAFETY: inside the live mapping (checked); the tests write it only between transfers.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), self.base.as_ptr().add(at), data.len()) };
    }
}

/// A holder: TCP (serving) + a shared-memory server named after its data endpoint.
fn holder(token: &str) -> CompositeTransferEngine {
    let tcp = TcpEngine::new(TcpEngineConfig { cluster_token: Some(token.into()), ..TcpEngineConfig::default() })
        .expect("tcp engine");
    let server = ShmServer::start(ShmServerConfig::new(tcp.endpoint(), token)).expect("shm server");
    CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), Arc::new(tcp)],
        CompositeConfig { bounce_bytes: 0 },
    )
    .expect("composite")
    .with_shm_server(Arc::new(server))
}

/// A reader that serves nothing: local copy, shared memory, client-only TCP.
fn reader(token: &str, retry_after: Duration) -> CompositeTransferEngine {
    let tcp =
        TcpEngine::client_only(TcpEngineConfig { cluster_token: Some(token.into()), ..TcpEngineConfig::default() })
            .expect("tcp engine");
    let shm = SharedMemoryEngine::new(SharedMemoryConfig { retry_after, ..SharedMemoryConfig::new("", token) });
    CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), Arc::new(shm), Arc::new(tcp)],
        CompositeConfig { bounce_bytes: 0 },
    )
    .expect("composite")
}

fn published(r: &TransferRef) -> TransferRef {
    TransferRef::remote_only(r.remote().expect("registered with tcp").clone(), r.size(), r.location())
}

fn host(buf: &mut [u8]) -> TransferRef {
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: every buffer outlives the transfers that use it.
    TransferRef::local(unsafe { LocalRegion::new(ptr, buf.len() as u64, MemoryLocation::Host) })
}

fn item(src: &TransferRef, so: u64, dst: &TransferRef, d: u64, size: u64, tag: u64) -> TransferItem {
    TransferItem { src: src.clone(), src_offset: so, dst: dst.clone(), dst_offset: d, size, tag }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

#[test]
fn same_host_pairs_take_the_shared_path_and_tcp_moves_nothing() {
    let (h, r) = (holder("t"), reader("t", Duration::from_secs(5)));
    let file = SealedFile::new();
    let owned = h.register_shareable(file.region(), SharedBacking::new(std::os::fd::AsFd::as_fd(&file.fd), 0));
    let target = published(&owned.expect("registered"));
    assert_eq!(h.shm_server().expect("server").region_count(), 1);

    // Puts: 16 × 64 KiB from a caller buffer into the holder's pages.
    let mut value = pattern(1 << 20, 3);
    let src = host(&mut value);
    let puts: Vec<_> = (0..16).map(|i| item(&src, i * 65536, &target, (1 << 20) + i * 65536, 65536, i)).collect();
    let set = r.plan(&puts);
    assert!(set.rejected_tags.is_empty());
    assert!(set.plans.iter().all(|p| r.engines()[p.engine.expect("owned")].name() == "SharedMemoryEngine"));
    assert!(r.submit(set.plans).expect("submitted").wait().is_empty());
    assert_eq!(file.bytes()[1 << 20..2 << 20], value[..]);

    // Gets back, into another caller buffer.
    file.fill(0, &pattern(1 << 20, 9));
    let mut back = vec![0u8; 2 << 20];
    let dst = host(&mut back);
    transfer(&r, &[item(&target, 0, &dst, 0, 2 << 20, 0)]).expect("pulled");
    assert_eq!(back[..], file.bytes()[..2 << 20]);

    assert_eq!(r.moved_bytes("SharedMemoryEngine"), 3 << 20);
    assert_eq!(r.moved_bytes("TcpEngine"), 0, "the TCP engine moved no bytes");
}

#[test]
fn a_region_deregistered_while_mapped_is_never_read_through_the_mapping() {
    let (h, r) = (holder("t"), reader("t", Duration::from_secs(5)));
    let file = SealedFile::new();
    let owned = h.register_shareable(file.region(), SharedBacking::new(std::os::fd::AsFd::as_fd(&file.fd), 0));
    let owned = owned.expect("registered");
    let target = published(&owned);
    let mut back = vec![0u8; 4096];
    let dst = host(&mut back);
    transfer(&r, &[item(&target, 0, &dst, 0, 4096, 0)]).expect("mapped and read");
    assert_eq!(r.moved_bytes("SharedMemoryEngine"), 4096);

    // Deregistered: the server first (the mapping reads stale), then TCP (unknown region).
    h.deregister(&owned);
    assert_eq!(h.shm_server().expect("server").region_count(), 0);
    let failures = transfer(&r, &[item(&target, 0, &dst, 0, 4096, 1)]).expect_err("the region is gone");
    assert_eq!(failed_tags(&failures), [1]);
    assert!(
        failures.iter().all(|f| f.endpoint != "SharedMemoryEngine"),
        "answered by TCP, the last engine for the pair: {failures:?}"
    );
    assert_eq!(r.moved_bytes("SharedMemoryEngine"), 4096, "nothing more through the mapping");
}

#[test]
fn a_mapping_gone_stale_between_plan_and_submit_falls_back_to_tcp() {
    let (h, r) = (holder("t"), reader("t", Duration::from_secs(5)));
    let file = SealedFile::new();
    file.fill(0, &pattern(65536, 5));
    let owned = h.register_shareable(file.region(), SharedBacking::new(std::os::fd::AsFd::as_fd(&file.fd), 0));
    let owned = owned.expect("registered");
    let target = published(&owned);
    let mut back = vec![0u8; 65536];
    let dst = host(&mut back);
    let set = r.plan(&[item(&target, 0, &dst, 0, 65536, 7)]);
    assert_eq!(r.engines()[set.plans[0].engine.expect("owned")].name(), "SharedMemoryEngine");
    // Only the shared-memory registration ends: TCP still serves the region.
    let server = h.shm_server().expect("server");
    assert!(server.deregister(owned.remote().expect("remote").region_id));
    assert!(r.submit(set.plans).expect("submitted").wait().is_empty(), "TCP took the pair over");
    assert_eq!(back[..], file.bytes()[..65536]);
    assert_eq!(r.moved_bytes("TcpEngine"), 65536);
    assert_eq!(r.moved_bytes("SharedMemoryEngine"), 0);
    // And the region is remembered as not shared: the next plan goes straight to TCP.
    let set = r.plan(&[item(&target, 0, &dst, 0, 65536, 8)]);
    assert_eq!(r.engines()[set.plans[0].engine.expect("owned")].name(), "TcpEngine");
}

#[test]
fn a_wrong_token_or_a_holder_without_a_server_is_left_to_tcp_and_remembered() {
    let h = holder("right");
    let file = SealedFile::new();
    let owned = h.register_shareable(file.region(), SharedBacking::new(std::os::fd::AsFd::as_fd(&file.fd), 0));
    let target = published(&owned.expect("registered"));
    let mut back = vec![0u8; 4096];
    let dst = host(&mut back);

    // A reader with the wrong token: refused by the shm server, and by TCP too.
    let wrong = reader("wrong", Duration::from_secs(60));
    assert!(!wrong.engines()[1].can_handle(&target, &dst), "refused");
    assert!(transfer(&wrong, &[item(&target, 0, &dst, 0, 4096, 0)]).is_err());
    assert_eq!(wrong.moved_bytes("SharedMemoryEngine"), 0);

    // A holder with no shared-memory server (plain TCP): TCP moves the bytes.
    let plain = CompositeTransferEngine::new(
        vec![Arc::new(
            TcpEngine::new(TcpEngineConfig { cluster_token: Some("right".into()), ..Default::default() }).expect("tcp"),
        )],
        CompositeConfig { bounce_bytes: 0 },
    )
    .expect("composite");
    let mut medium = vec![1u8; 8192];
    let plain_target = published(
        &plain.register_memory(host(&mut medium).local_region().copied().expect("local")).expect("registered"),
    );
    let r = reader("right", Duration::from_secs(60));
    transfer(&r, &[item(&plain_target, 0, &dst, 0, 4096, 0)]).expect("over TCP");
    assert_eq!(back, vec![1u8; 4096]);
    assert_eq!((r.moved_bytes("TcpEngine"), r.moved_bytes("SharedMemoryEngine")), (4096, 0));
    // Remembered: the shm engine does not try that holder again for a while (no connect).
    assert!(!r.engines()[1].can_handle(&plain_target, &dst));
    // The right holder still takes the shared path from the same reader.
    transfer(&r, &[item(&target, 0, &dst, 0, 4096, 1)]).expect("shared");
    assert_eq!(r.moved_bytes("SharedMemoryEngine"), 4096);
}

#[test]
fn regions_registered_without_a_file_are_not_shared() {
    let (h, r) = (holder("t"), reader("t", Duration::from_secs(60)));
    let mut medium = pattern(8192, 1);
    let owned = h.register_memory(host(&mut medium).local_region().copied().expect("local")).expect("registered");
    assert_eq!(h.shm_server().expect("server").region_count(), 0, "register_memory shares nothing");
    let target = published(&owned);
    let mut back = vec![0u8; 8192];
    let dst = host(&mut back);
    transfer(&r, &[item(&target, 0, &dst, 0, 8192, 0)]).expect("over TCP");
    assert_eq!(back, medium);
    assert_eq!((r.moved_bytes("TcpEngine"), r.moved_bytes("SharedMemoryEngine")), (8192, 0));
}
