//! Keyed gets over shared memory (`KeyedClient::get_shared`) against a real data server and a real
//! `ShmServer` named after its endpoint (holder and reader in one process: the path needs only the
//! same host): the value copied from the mapping (no value bytes on the socket), the lease closed
//! after the settle frame, a lease that ended before the copy did (lapsed, never a hit), a region
//! the holder does not share and a holder without a server (both served the TCP way, byte-exact),
//! a region deregistered from the shared path while mapped (never read through the stale mapping).

pub mod tcp_support;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use tcp_support::pattern;
use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar};
use umbp_transfer::shm::{ShmServer, ShmServerConfig};
use umbp_transfer::{
    DataServer, DataServerConfig, KeyedClient, KeyedClientConfig, KeyedGet, KeyedHandler, KeyedLease, KeyedRange,
    KeyedRead, KeyedSlot, KeyedWrite,
};

const LEN: usize = 4 << 20;
const TOKEN: &str = "keyed-shm-token";

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

    fn fill(&self, at: usize, data: &[u8]) {
        assert!(at + data.len() <= LEN);
        // SAFETY: inside the live mapping (checked); the tests write it only between gets.
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), self.base.as_ptr().add(at), data.len()) };
    }
}

/// A read-only handler: keys at (region, offset, len), a lease of `lease` from the resolve, and a
/// count of leases open.
struct Table {
    lease: Duration,
    /// Sleeps this long in the resolve after the lease began (to outlast a short lease).
    stall: Duration,
    keys: Mutex<HashMap<String, (u64, u64, u64)>>,
    open: Mutex<usize>,
    closed: Mutex<Vec<String>>,
}

impl Table {
    fn new(lease: Duration, stall: Duration) -> Arc<Self> {
        Arc::new(Self {
            lease,
            stall,
            keys: Mutex::new(HashMap::new()),
            open: Mutex::new(0),
            closed: Mutex::new(Vec::new()),
        })
    }

    fn insert(&self, key: &str, region_id: u64, offset: u64, len: u64) {
        self.keys.lock().insert(key.to_owned(), (region_id, offset, len));
    }

    /// Waits (bounded) until every lease is closed; the closed keys.
    fn settled(&self) -> Vec<String> {
        let until = Instant::now() + Duration::from_secs(5);
        while *self.open.lock() > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(*self.open.lock(), 0, "every lease is closed");
        self.closed.lock().clone()
    }
}

impl KeyedHandler for Table {
    fn open_read(&self, key: &str) -> KeyedRead {
        let until = Instant::now() + self.lease;
        let Some(&(region_id, offset, len)) = self.keys.lock().get(key) else { return KeyedRead::Miss };
        std::thread::sleep(self.stall);
        *self.open.lock() += 1;
        // Two ranges, to check they are copied in order as one value.
        let half = len / 2;
        KeyedRead::Hit {
            size: len,
            ranges: vec![
                KeyedRange { region_id, offset, len: half },
                KeyedRange { region_id, offset: offset + half, len: len - half },
            ],
            lease: KeyedLease { id: 1, backend_id: 0, until },
        }
    }

    fn close_read(&self, key: &str, _lease: KeyedLease) {
        *self.open.lock() -= 1;
        self.closed.lock().push(key.to_owned());
    }

    fn open_write(&self, _key: &str, _tier: u64, _size: u64) -> KeyedWrite {
        KeyedWrite::Unsupported
    }

    fn close_write(&self, _key: &str, _slot: KeyedSlot, _received: bool) -> bool {
        false
    }
}

/// A holder: a data server with the file registered, a handler, and (when `shared`) a
/// shared-memory server that shares the file's region. Returns the region id too.
fn holder(file: &SealedFile, table: &Arc<Table>, shared: bool) -> (DataServer, Option<ShmServer>, u64) {
    let srv = DataServer::start(DataServerConfig {
        io_timeout: Duration::from_secs(5),
        cluster_token: Some(TOKEN.into()),
        ..DataServerConfig::default()
    })
    .expect("server starts");
    let r = srv.register_memory(file.region()).expect("registered");
    let region_id = r.remote().expect("remote").region_id;
    srv.set_keyed_handler(Some(Arc::clone(table) as Arc<dyn KeyedHandler>));
    let shm = shared.then(|| {
        let shm = ShmServer::start(ShmServerConfig::new(srv.endpoint(), TOKEN)).expect("shm server");
        shm.register(region_id, std::os::fd::AsFd::as_fd(&file.fd), 0, LEN as u64).expect("shared");
        shm
    });
    (srv, shm, region_id)
}

fn client() -> KeyedClient {
    KeyedClient::new(KeyedClientConfig { cluster_token: Some(TOKEN.into()), ..KeyedClientConfig::default() })
        .expect("client")
}

fn get(c: &KeyedClient, endpoint: &str, key: &str, buf: &mut [u8]) -> KeyedGet {
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: `buf` is borrowed mutably for the whole call.
    unsafe { c.get_shared(endpoint, key, ptr, buf.len()) }.expect("an answer")
}

#[test]
fn a_same_host_get_copies_from_the_mapping_and_closes_the_lease() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let ep = srv.endpoint().to_owned();
    let c = client();
    for (i, len) in [1usize, 4096, 65_536, 1 << 20, 1_000_003].into_iter().enumerate() {
        let value = pattern(len, i as u64 + 1);
        let at = i * (1 << 20) / 2 + 7;
        file.fill(at, &value);
        table.insert(&format!("k{i}"), region, at as u64, len as u64);
        let mut buf = vec![0u8; len + 10];
        assert_eq!(get(&c, &ep, &format!("k{i}"), &mut buf), KeyedGet::Hit(len as u64), "value of {len} bytes");
        assert_eq!(&buf[..len], &value[..], "byte-exact at {len}");
    }
    let copied: u64 = [1u64, 4096, 65_536, 1 << 20, 1_000_003].iter().sum();
    assert_eq!(c.shared_copies(), (5, copied), "every byte came through the mapping");
    assert_eq!(table.settled().len(), 5, "each lease ended by the settle frame");
    // Answers other than a hit are the same as over TCP.
    let mut small = vec![0u8; 10];
    assert_eq!(get(&c, &ep, "k3", &mut small), KeyedGet::TooSmall(1 << 20));
    assert_eq!(get(&c, &ep, "nope", &mut small), KeyedGet::Miss);
    assert_eq!(table.settled().len(), 6);
}

#[test]
fn a_copy_that_ends_after_the_lease_is_lapsed_never_a_hit() {
    let file = SealedFile::new();
    // The lease (2 ms from the resolve) is over before the answer even leaves (a 20 ms stall).
    let table = Table::new(Duration::from_millis(2), Duration::from_millis(20));
    let (srv, _shm, region) = holder(&file, &table, true);
    file.fill(0, &pattern(65_536, 3));
    table.insert("k", region, 0, 65_536);
    let c = client();
    let mut buf = vec![0u8; 65_536];
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Lapsed);
    assert_eq!(c.shared_copies().0, 1, "copied through the mapping, then judged by the lease");
    assert_eq!(table.settled(), vec!["k".to_owned()]);
}

#[test]
fn regions_without_the_shared_path_are_served_over_tcp_byte_exact() {
    // A holder without a shared-memory server: the client never asks for a descriptor.
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _none, region) = holder(&file, &table, false);
    let value = pattern(300_000, 4);
    file.fill(100, &value);
    table.insert("k", region, 100, value.len() as u64);
    let c = client();
    let mut buf = vec![0u8; value.len()];
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit(value.len() as u64));
    assert_eq!(buf, value);
    assert_eq!(c.shared_copies(), (0, 0));

    // A holder with a server that does not share this region (an SSD staging arena, say): the
    // descriptor names a region the client cannot map, so it asks for the bytes in the same
    // exchange.
    let other = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, shm, _) = holder(&file, &table, true);
    let unshared = srv.register_memory(other.region()).expect("registered").remote().expect("remote").region_id;
    other.fill(0, &value);
    table.insert("k", unshared, 0, value.len() as u64);
    buf.fill(0);
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit(value.len() as u64));
    assert_eq!(buf, value);
    assert_eq!(c.shared_copies(), (0, 0));
    assert_eq!(shm.as_ref().map(ShmServer::connection_count), Some(1), "the client did reach the server");
    assert_eq!(table.settled(), vec!["k".to_owned()]);
}

#[test]
fn a_region_deregistered_from_the_shared_path_is_never_read_through_its_mapping() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, shm, region) = holder(&file, &table, true);
    let shm = shm.expect("server");
    let old = pattern(65_536, 5);
    file.fill(0, &old);
    table.insert("k", region, 0, old.len() as u64);
    let c = client();
    let mut buf = vec![0u8; old.len()];
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit(old.len() as u64));
    assert_eq!(c.shared_copies().0, 1, "mapped once");

    // The holder withdraws the region from the shared path (its epoch slot is zeroed): the cached
    // mapping is stale, the server no longer names the region, and the value comes over TCP.
    assert!(shm.deregister(region));
    let new = pattern(65_536, 6);
    file.fill(0, &new);
    buf.fill(0);
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit(new.len() as u64));
    assert_eq!(buf, new);
    assert_eq!(c.shared_copies().0, 1, "not read through the stale mapping");
    assert_eq!(table.settled().len(), 2);
}
