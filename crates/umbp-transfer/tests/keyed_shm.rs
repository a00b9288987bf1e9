//! Keyed gets over shared memory (`KeyedClient::get_shared`) against a real data server and a real
//! `ShmServer` named after its endpoint (holder and reader in one process: the path needs only the
//! same host): the value copied from the mapping (no value bytes on the socket), the lease closed
//! after the settle frame, a lease that ended before the copy did (lapsed, never a hit), a region
//! the holder does not share and a holder without a server (both served the TCP way, byte-exact),
//! a region deregistered from the shared path while mapped (never read through the stale mapping);
//! keyed puts copied into the slot through the mapping and committed by the settle frame, a put
//! whose slot ended before its settle (aborted, never committed), a put into a region the holder
//! does not share (its bytes sent in the same exchange).

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
    ClosingSlot, DataServer, DataServerConfig, KeyedBatchItem, KeyedBatchPut, KeyedClient, KeyedClientConfig,
    KeyedError, KeyedGet, KeyedHandler, KeyedLease, KeyedPut, KeyedRange, KeyedRead, KeyedSlot, KeyedWrite,
    PutChecksum,
};

const LEN: usize = 16 << 20;
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

/// Where slots go: (region id, next free offset, open slots: id → (key, region, offset, len)).
type Slots = (u64, u64, HashMap<u64, (String, u64, u64, u64)>);

/// A handler: keys at (region, offset, len), a lease of `lease` from the resolve, a count of
/// leases open, slots handed out at the next free offset of one region.
struct Table {
    lease: Duration,
    /// Sleeps this long in the resolve after the lease began (to outlast a short lease).
    stall: Duration,
    keys: Mutex<HashMap<String, (u64, u64, u64)>>,
    /// Where slots go.
    slots: Mutex<Slots>,
    /// A slot lasts this long from the allocation.
    slot_ttl: Duration,
    committed: Mutex<Vec<String>>,
    aborted: Mutex<Vec<String>>,
    /// Checksums committed with values, handed back with them.
    crcs: Mutex<HashMap<String, u32>>,
    open: Mutex<usize>,
    closed: Mutex<Vec<String>>,
    /// The batch forms the server called, with their sizes, in order.
    batches: Mutex<Vec<(&'static str, usize)>>,
}

impl Table {
    fn new(lease: Duration, stall: Duration) -> Arc<Self> {
        Arc::new(Self {
            lease,
            stall,
            keys: Mutex::new(HashMap::new()),
            slots: Mutex::new((0, 4 << 20, HashMap::new())),
            slot_ttl: Duration::from_secs(10),
            committed: Mutex::new(Vec::new()),
            aborted: Mutex::new(Vec::new()),
            crcs: Mutex::new(HashMap::new()),
            open: Mutex::new(0),
            closed: Mutex::new(Vec::new()),
            batches: Mutex::new(Vec::new()),
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
        let crc32c = self.crcs.lock().get(key).copied();
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
            crc32c,
        }
    }

    fn close_read(&self, key: &str, _lease: KeyedLease) {
        *self.open.lock() -= 1;
        self.closed.lock().push(key.to_owned());
    }

    fn open_write(&self, key: &str, _tier: u64, size: u64) -> KeyedWrite {
        if self.keys.lock().contains_key(key) {
            return KeyedWrite::Exists;
        }
        let until = Instant::now() + self.slot_ttl;
        std::thread::sleep(self.stall);
        let mut slots = self.slots.lock();
        let (region_id, offset) = (slots.0, slots.1);
        slots.1 += size;
        let id = slots.2.len() as u64 + 1;
        slots.2.insert(id, (key.to_owned(), region_id, offset, size));
        KeyedWrite::Slot {
            ranges: vec![KeyedRange { region_id, offset, len: size }],
            slot: KeyedSlot { id, backend_id: 0, until },
        }
    }

    fn close_write(&self, key: &str, slot: KeyedSlot, received: bool, crc32c: Option<u32>) -> bool {
        let (k, region_id, offset, len) = self.slots.lock().2.get(&slot.id).cloned().expect("an open slot");
        assert_eq!(k, key);
        if received {
            if let Some(crc) = crc32c {
                self.crcs.lock().insert(key.to_owned(), crc);
            }
            self.insert(key, region_id, offset, len);
            self.committed.lock().push(key.to_owned());
        } else {
            self.aborted.lock().push(key.to_owned());
        }
        received
    }

    fn open_reads(&self, keys: &[&str]) -> Vec<KeyedRead> {
        self.batches.lock().push(("open_reads", keys.len()));
        keys.iter().map(|key| self.open_read(key)).collect()
    }

    fn close_reads(&self, reads: &[(&str, KeyedLease)]) {
        self.batches.lock().push(("close_reads", reads.len()));
        for (key, lease) in reads {
            self.close_read(key, *lease);
        }
    }

    fn open_writes(&self, writes: &[(&str, u64)], tier: u64) -> Vec<KeyedWrite> {
        self.batches.lock().push(("open_writes", writes.len()));
        writes.iter().map(|(key, size)| self.open_write(key, tier, *size)).collect()
    }

    fn close_writes(&self, slots: &[ClosingSlot<'_>]) -> Vec<bool> {
        self.batches.lock().push(("close_writes", slots.len()));
        slots.iter().map(|c| self.close_write(c.key, c.slot, c.received, c.crc32c)).collect()
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
    table.slots.lock().0 = region_id;
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
        assert_eq!(
            get(&c, &ep, &format!("k{i}"), &mut buf),
            KeyedGet::Hit { size: len as u64, crc32c: None },
            "value of {len} bytes"
        );
        assert_eq!(&buf[..len], &value[..], "byte-exact at {len}");
    }
    let copied: u64 = [1u64, 4096, 65_536, 1 << 20, 1_000_003].iter().sum();
    assert_eq!(c.shared_copies(), (5, 0, copied), "every byte came through the mapping");
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
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit { size: value.len() as u64, crc32c: None });
    assert_eq!(buf, value);
    assert_eq!(c.shared_copies(), (0, 0, 0));

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
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit { size: value.len() as u64, crc32c: None });
    assert_eq!(buf, value);
    assert_eq!(c.shared_copies(), (0, 0, 0));
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
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit { size: old.len() as u64, crc32c: None });
    assert_eq!(c.shared_copies().0, 1, "mapped once");

    // The holder withdraws the region from the shared path (its epoch slot is zeroed): the cached
    // mapping is stale, the server no longer names the region, and the value comes over TCP.
    assert!(shm.deregister(region));
    let new = pattern(65_536, 6);
    file.fill(0, &new);
    buf.fill(0);
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit { size: new.len() as u64, crc32c: None });
    assert_eq!(buf, new);
    assert_eq!(c.shared_copies().0, 1, "not read through the stale mapping");
    assert_eq!(table.settled().len(), 2);
}

fn put(c: &KeyedClient, endpoint: &str, key: &str, value: &[u8]) -> KeyedPut {
    c.put_shared(endpoint, key, 1, value, None).expect("an answer")
}

#[test]
fn a_same_host_put_is_copied_into_the_slot_and_committed_by_the_settle() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, _) = holder(&file, &table, true);
    let ep = srv.endpoint().to_owned();
    let c = client();
    let mut copied = 0;
    // Below `SHARED_PUT_MIN` the value goes the TCP way (one round trip); from it on, through the
    // mapping.
    for (i, len) in [1usize, 65_536, 1 << 20, 3 << 20].into_iter().enumerate() {
        let key = format!("p{i}");
        let value = pattern(len, 10 + i as u64);
        // Every other value carries a checksum: through the shared put's header and back in the
        // MAPPED descriptor of the get.
        let crc = (i % 2 == 0).then_some(0xabc0 + i as u32);
        assert_eq!(c.put_shared(&ep, &key, 1, &value, crc).expect("an answer"), KeyedPut::Written, "{len} bytes");
        copied += len as u64;
        let mut buf = vec![0u8; len];
        assert_eq!(get(&c, &ep, &key, &mut buf), KeyedGet::Hit { size: len as u64, crc32c: crc });
        assert_eq!(buf, value, "the committed bytes are the value");
    }
    assert_eq!(put(&c, &ep, "p0", b"again"), KeyedPut::Exists);
    let (gets, puts, bytes) = c.shared_copies();
    let put_bytes = (1 << 20) + (3 << 20);
    assert_eq!((gets, puts, bytes), (4, 2, copied + put_bytes), "the large puts and every get through the mapping");
    assert_eq!(*table.committed.lock(), vec!["p0", "p1", "p2", "p3"]);
    assert!(table.aborted.lock().is_empty());
}

#[test]
fn a_put_settled_after_its_slot_ended_is_aborted_never_committed() {
    let file = SealedFile::new();
    let mut table = Table::new(Duration::from_secs(10), Duration::from_millis(20));
    Arc::get_mut(&mut table).expect("unshared").slot_ttl = Duration::from_millis(2);
    let (srv, _shm, _) = holder(&file, &table, true);
    let c = client();
    assert_eq!(put(&c, srv.endpoint(), "late", &pattern(1 << 20, 7)), KeyedPut::Failed);
    assert_eq!(c.shared_copies().1, 1, "copied through the mapping, then refused by the slot's end");
    assert!(table.committed.lock().is_empty());
    assert_eq!(*table.aborted.lock(), vec!["late"]);
    let mut buf = vec![0u8; 16];
    assert_eq!(get(&c, srv.endpoint(), "late", &mut buf), KeyedGet::Miss);
}

#[test]
fn a_put_into_a_region_the_holder_does_not_share_sends_its_bytes() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, _) = holder(&file, &table, true);
    let other = SealedFile::new();
    let unshared = srv.register_memory(other.region()).expect("registered").remote().expect("remote").region_id;
    table.slots.lock().0 = unshared;
    let c = client();
    let value = pattern(300_001, 8);
    assert_eq!(put(&c, srv.endpoint(), "k", &value), KeyedPut::Written);
    assert_eq!(c.shared_copies(), (0, 0, 0), "nothing through a mapping");
    let mut buf = vec![0u8; value.len()];
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit { size: value.len() as u64, crc32c: None });
    assert_eq!(buf, value);
    assert_eq!(*table.committed.lock(), vec!["k"]);
}

/// One GET_KEYS of `keys` into `bufs`.
fn get_batch(c: &KeyedClient, endpoint: &str, keys: &[&str], bufs: &mut [Vec<u8>]) -> Vec<KeyedGet> {
    get_batch_verified(c, endpoint, keys, bufs, false)
}

/// One GET_KEYS of `keys` into `bufs`, checked when `verify`, written with streaming stores when
/// `stream`.
fn get_batch_streamed(
    c: &KeyedClient,
    endpoint: &str,
    keys: &[&str],
    bufs: &mut [Vec<u8>],
    (verify, stream): (bool, bool),
) -> Vec<KeyedGet> {
    let items: Vec<KeyedBatchItem<'_>> =
        batch_items(keys, bufs, verify).into_iter().map(|item| KeyedBatchItem { stream, ..item }).collect();
    // SAFETY: every buffer is borrowed mutably for the whole call; distinct vectors never overlap.
    unsafe { c.get_shared_batch(endpoint, &items) }.expect("an answer")
}

/// One GET_KEYS of `keys` into `bufs`, each copy checked against its checksum when `verify`.
fn get_batch_verified(
    c: &KeyedClient,
    endpoint: &str,
    keys: &[&str],
    bufs: &mut [Vec<u8>],
    verify: bool,
) -> Vec<KeyedGet> {
    let items = batch_items(keys, bufs, verify);
    // SAFETY: every buffer is borrowed mutably for the whole call; distinct vectors never overlap.
    unsafe { c.get_shared_batch(endpoint, &items) }.expect("an answer")
}

/// One batch item per key, into `bufs` (borrowed mutably for as long as the items live).
fn batch_items<'a>(keys: &[&'a str], bufs: &'a mut [Vec<u8>], verify: bool) -> Vec<KeyedBatchItem<'a>> {
    keys.iter()
        .zip(bufs.iter_mut())
        .map(|(key, buf)| KeyedBatchItem {
            key,
            dst: NonNull::new(buf.as_mut_ptr()).expect("non-null"),
            cap: buf.len(),
            verify,
            stream: false,
        })
        .collect()
}

#[test]
fn a_same_host_batch_get_copies_every_value_and_ends_every_lease() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let ep = srv.endpoint().to_owned();
    let lens = [1usize, 4096, 65_536, 1 << 20, 1_000_003];
    let mut values = Vec::new();
    for (i, len) in lens.into_iter().enumerate() {
        let value = pattern(len, i as u64 + 11);
        let at = i * (2 << 20) + 3;
        file.fill(at, &value);
        table.insert(&format!("k{i}"), region, at as u64, len as u64);
        values.push(value);
    }
    let keys = ["k0", "k1", "nope", "k2", "k3", "k4", "k3"];
    let mut bufs: Vec<Vec<u8>> = keys
        .iter()
        .enumerate()
        // The last one is too small for k3's value.
        .map(|(j, _)| vec![0u8; if j == 6 { 10 } else { 1 << 20 | 7 }])
        .collect();
    let c = client();
    let got = get_batch(&c, &ep, &keys, &mut bufs);
    let hit = |len: usize| KeyedGet::Hit { size: len as u64, crc32c: None };
    assert_eq!(
        got,
        vec![hit(1), hit(4096), KeyedGet::Miss, hit(65_536), hit(1 << 20), hit(1_000_003), KeyedGet::TooSmall(1 << 20)],
        "a hit per stored key, in request order; a miss and a too-small answered in place"
    );
    for (j, i) in [(0usize, 0usize), (1, 1), (3, 2), (4, 3), (5, 4)] {
        assert_eq!(&bufs[j][..lens[i]], &values[i][..], "key k{i} byte-exact");
    }
    let copied: u64 = [1u64, 4096, 65_536, 1 << 20, 1_000_003].iter().sum();
    assert_eq!(c.shared_copies(), (5, 0, copied), "every byte came through the mapping, in one exchange");
    assert_eq!(table.settled().len(), 6, "every lease the batch opened was ended (the too-small one at once)");
    assert_eq!(
        *table.batches.lock(),
        [("open_reads", 7), ("close_reads", 1), ("close_reads", 5)],
        "the handler is asked once per step of the batch, not once per key"
    );
}

/// `get_shared_batch_then` hands the answers over before it sends the settle frame: while the
/// caller holds them (long enough for a settle already sent to be served), the holder still has
/// every lease open; the settle that follows ends them.
#[test]
fn a_batch_get_answers_before_it_settles() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let values: Vec<Vec<u8>> = (0..2).map(|i| pattern(70_000, i + 3)).collect();
    for (i, value) in values.iter().enumerate() {
        file.fill(i << 20, value);
        table.insert(&format!("k{i}"), region, (i as u64) << 20, value.len() as u64);
    }
    let mut bufs = vec![vec![0u8; 70_000]; 2];
    let items = batch_items(&["k0", "k1"], &mut bufs, false);
    let c = client();
    let mut seen = None;
    // SAFETY: every buffer is borrowed mutably for the whole call; distinct vectors never overlap.
    unsafe {
        c.get_shared_batch_then(srv.endpoint(), &items, |answers| {
            std::thread::sleep(Duration::from_millis(100));
            seen = Some((answers, *table.open.lock()));
        })
    }
    .expect("answered and settled");
    let (answers, open) = seen.expect("the answers were handed over");
    let hit = KeyedGet::Hit { size: 70_000, crc32c: None };
    assert_eq!(answers, vec![hit, hit]);
    assert_eq!(open, 2, "both leases were still open while the caller held the answers");
    assert_eq!(table.settled().len(), 2, "the settle after the answers ended them");
    assert_eq!(bufs, values, "byte-exact");
}

/// A batch large enough to fan its copies out is answered from the copy pool's thread that ran
/// them (the caller's thread is not woken first), byte-exact; a small batch copies and answers on
/// the calling thread. Either way the copies are counted before the answers are out.
#[test]
fn a_fanned_batch_get_is_answered_from_the_copy_pool() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let len = 1 << 20;
    let values: Vec<Vec<u8>> = (0..4).map(|i| pattern(len, i + 11)).collect();
    for (i, value) in values.iter().enumerate() {
        file.fill(i * len, value);
        table.insert(&format!("f{i}"), region, (i * len) as u64, len as u64);
    }
    let c = client();
    let answered_on = |keys: &[&str], bufs: &mut [Vec<u8>]| {
        let items = batch_items(keys, bufs, true);
        let mut seen = None;
        // SAFETY: every buffer is borrowed mutably for the whole call; distinct vectors never
        // overlap.
        unsafe {
            c.get_shared_batch_then(srv.endpoint(), &items, |answers| {
                seen = Some((answers, std::thread::current().name().map(str::to_owned), c.shared_copies()));
            })
        }
        .expect("answered and settled");
        seen.expect("the answers were handed over")
    };
    let caller = std::thread::current().name().map(str::to_owned);

    let mut bufs = vec![vec![0u8; len]; 4];
    let (answers, thread, (gets, _, bytes)) = answered_on(&["f0", "f1", "f2", "f3"], &mut bufs);
    assert_eq!((gets, bytes), (4, 4 * len as u64), "the copies were counted before the answers were out");
    assert!(answers.iter().all(|a| matches!(a, KeyedGet::Hit { size, .. } if *size == len as u64)), "{answers:?}");
    assert!(bufs == values, "byte-exact");
    let thread = thread.unwrap_or_default();
    assert!(thread.starts_with("umbp-shm-copy-"), "answered on {thread:?}, not a copy pool thread");

    let mut small = vec![vec![0u8; len]];
    let (answers, thread, (gets, _, bytes)) = answered_on(&["f1"], &mut small);
    assert_eq!((gets, bytes), (5, 5 * len as u64));
    assert!(matches!(answers[..], [KeyedGet::Hit { .. }]), "{answers:?}");
    assert_eq!(thread, caller, "one value copies and answers on the calling thread");
    assert!(small[0] == values[1], "byte-exact");
}

/// A batch request sent from one thread (`send_get_shared_batch`) is answered on another
/// (`finish_get_shared_batch_then`): the holder leases every key before the finishing thread reads
/// a byte, the copies are byte-exact, the settle ends the leases. Without an idle connection
/// nothing is sent; items other than those sent are refused before a byte is copied; a request
/// dropped unfinished ends its leases.
#[test]
fn a_batch_request_sent_here_is_finished_on_another_thread() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let values: Vec<Vec<u8>> = (0..3).map(|i| pattern(60_000, i + 7)).collect();
    for (i, value) in values.iter().enumerate() {
        file.fill(i << 20, value);
        table.insert(&format!("k{i}"), region, (i as u64) << 20, value.len() as u64);
    }
    let keys = ["k0", "k1", "k2"];
    let request: Vec<(&str, usize)> = keys.iter().map(|k| (*k, 60_000)).collect();
    let hit = KeyedGet::Hit { size: 60_000, crc32c: None };
    let c = client();
    assert!(c.send_get_shared_batch(srv.endpoint(), &request).is_none(), "no idle connection: nothing sent");
    // One exchange leaves its connection idle.
    assert_eq!(get_batch(&c, srv.endpoint(), &["k0"], &mut [vec![0u8; 60_000]]), vec![hit]);
    table.settled();
    let open_until = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while *table.open.lock() != n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        *table.open.lock()
    };

    let sent = c.send_get_shared_batch(srv.endpoint(), &request).expect("sent on the idle connection");
    assert_eq!(open_until(3), 3, "the holder leased every key before the client read a byte");
    let mut bufs = vec![vec![0u8; 60_000]; 3];
    let answers = std::thread::scope(|s| {
        s.spawn(|| {
            let items = batch_items(&keys, &mut bufs, false);
            let mut answers = None;
            // SAFETY: every buffer is borrowed mutably for the whole call; distinct vectors never
            // overlap.
            unsafe { c.finish_get_shared_batch_then(sent, &items, |a| answers = Some(a)) }.expect("finished");
            answers.expect("answered")
        })
        .join()
        .expect("the finishing thread")
    });
    assert_eq!(answers, vec![hit; 3]);
    assert_eq!(bufs, values, "byte-exact");
    assert_eq!(table.settled().len(), 4, "the settle ended the batch's leases");

    // Other items than were sent: refused, nothing copied.
    let sent = c.send_get_shared_batch(srv.endpoint(), &request).expect("sent again");
    let mut other = vec![vec![0u8; 60_000]; 3];
    let items = batch_items(&["k0", "k2", "k1"], &mut other, false);
    // SAFETY: as above.
    let refused = unsafe { c.finish_get_shared_batch_then(sent, &items, |_| panic!("never answered")) };
    assert!(matches!(refused, Err(KeyedError::Protocol { .. })), "{refused:?}");
    assert!(other.iter().all(|b| b.iter().all(|&x| x == 0)), "no byte copied");
    assert_eq!(open_until(0), 0, "the dropped connection ended the leases");

    // Dropped unfinished: its connection closes, and the holder ends the leases.
    assert_eq!(get_batch(&c, srv.endpoint(), &["k1"], &mut [vec![0u8; 60_000]]), vec![hit]);
    assert_eq!(open_until(0), 0);
    let sent = c.send_get_shared_batch(srv.endpoint(), &request).expect("sent on the idle connection");
    assert_eq!(open_until(3), 3);
    drop(sent);
    assert_eq!(open_until(0), 0, "a request dropped unfinished ends its leases");
}

/// The holder checks every range a batch's answer names before it offers it: a value said to lie
/// in a region it has not registered, or past the end of its region, is never offered as mapped
/// (its lease is closed before the reply leaves) and is left to the routed path, while the batch's
/// good values are copied.
#[test]
fn a_batch_answer_outside_a_shared_region_is_left_to_the_routed_path() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let value = pattern(50_000, 5);
    file.fill(4096, &value);
    table.insert("good", region, 4096, value.len() as u64);
    table.insert("unknown-region", region + 1000, 4096, 50_000);
    // Both halves start inside the region; the second ends past it.
    table.insert("past-the-end", region, LEN as u64 - 30_000, 50_000);
    table.insert("again", region, 4096, value.len() as u64);
    let keys = ["unknown-region", "good", "past-the-end", "again"];
    let mut bufs = vec![vec![0u8; 50_000]; keys.len()];
    let got = get_batch(&client(), srv.endpoint(), &keys, &mut bufs);
    let hit = KeyedGet::Hit { size: 50_000, crc32c: None };
    assert_eq!(got, vec![KeyedGet::Unsupported, hit, KeyedGet::Unsupported, hit]);
    assert!(bufs[1] == value && bufs[3] == value, "the good values byte-exact");
    assert_eq!(table.settled().len(), 4, "every lease ended");
    assert_eq!(
        *table.batches.lock(),
        [("open_reads", 4), ("close_reads", 2), ("close_reads", 2)],
        "the two bad answers' leases closed by the holder before its reply, the good ones by the settle"
    );
}

#[test]
fn a_batch_whose_leases_end_before_the_copy_is_lapsed_never_a_hit() {
    let file = SealedFile::new();
    // Each lease (2 ms from its resolve) is over before the answer leaves (a 20 ms stall per key).
    let table = Table::new(Duration::from_millis(2), Duration::from_millis(20));
    let (srv, _shm, region) = holder(&file, &table, true);
    file.fill(0, &pattern(65_536, 3));
    table.insert("a", region, 0, 65_536);
    table.insert("b", region, 0, 65_536);
    let c = client();
    let mut bufs = vec![vec![0u8; 65_536], vec![0u8; 65_536]];
    assert_eq!(get_batch(&c, srv.endpoint(), &["a", "b"], &mut bufs), vec![KeyedGet::Lapsed, KeyedGet::Lapsed]);
    assert_eq!(table.settled().len(), 2);
}

#[test]
fn a_batch_to_a_holder_without_the_shared_path_is_left_to_the_routed_path() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _none, region) = holder(&file, &table, false);
    file.fill(0, &pattern(4096, 5));
    table.insert("k", region, 0, 4096);
    let c = client();
    let mut bufs = vec![vec![0u8; 4096]];
    assert_eq!(get_batch(&c, srv.endpoint(), &["k"], &mut bufs), vec![KeyedGet::Unsupported]);
    assert!(bufs[0].iter().all(|b| *b == 0), "nothing was read");
    assert_eq!(table.settled().len(), 0, "no lease was taken: the holder was never asked");

    // A region the holder does not share: that key is left to the routed path, its lease ended.
    let other = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let unshared = srv.register_memory(other.region()).expect("registered").remote().expect("remote").region_id;
    other.fill(0, &pattern(4096, 6));
    table.insert("unshared", unshared, 0, 4096);
    table.insert("shared", region, 0, 4096);
    let mut bufs = vec![vec![0u8; 4096], vec![0u8; 4096]];
    assert_eq!(
        get_batch(&c, srv.endpoint(), &["unshared", "shared"], &mut bufs),
        vec![KeyedGet::Unsupported, KeyedGet::Hit { size: 4096, crc32c: None }]
    );
    assert_eq!(bufs[1], pattern(4096, 5));
    assert_eq!(table.settled().len(), 2);
}

#[test]
fn a_batch_refuses_bad_keys_and_too_many_keys() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, _) = holder(&file, &table, true);
    let c = client();
    let mut bufs = [vec![0u8; 8]];
    let items = [KeyedBatchItem {
        key: "",
        dst: NonNull::new(bufs[0].as_mut_ptr()).expect("non-null"),
        cap: 8,
        verify: false,
        stream: false,
    }];
    // SAFETY: the buffer outlives the call.
    assert!(unsafe { c.get_shared_batch(srv.endpoint(), &items) }.is_err(), "an empty key");
    let many: Vec<KeyedBatchItem<'_>> = (0..=KeyedClient::MAX_BATCH_KEYS)
        .map(|_| KeyedBatchItem {
            key: "k",
            dst: NonNull::new(bufs[0].as_mut_ptr()).expect("non-null"),
            cap: 0,
            verify: false,
            stream: false,
        })
        .collect();
    // SAFETY: as above (nothing is written: the call is refused before it is sent).
    assert!(unsafe { c.get_shared_batch(srv.endpoint(), &many) }.is_err(), "too many keys");
    assert_eq!(table.settled().len(), 0);
}

/// One PUT_KEYS of `(key, value, crc)` to tier 1.
fn put_batch(c: &KeyedClient, endpoint: &str, items: &[(&str, &[u8], Option<u32>)]) -> Vec<KeyedPut> {
    let given = |crc: Option<u32>| crc.map_or(PutChecksum::None, PutChecksum::Given);
    let batch: Vec<KeyedBatchPut<'_>> =
        items.iter().map(|(key, value, crc32c)| KeyedBatchPut { key, value, checksum: given(*crc32c) }).collect();
    c.put_shared_batch(endpoint, 1, &batch).expect("an answer")
}

#[test]
fn a_same_host_batch_put_commits_every_value_copied_into_its_slot() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, region) = holder(&file, &table, true);
    let ep = srv.endpoint().to_owned();
    file.fill(0, b"old");
    table.insert("present", region, 0, 3);
    let values: Vec<Vec<u8>> =
        [1usize, 4096, 1 << 20, 3 << 20].iter().enumerate().map(|(i, len)| pattern(*len, 20 + i as u64)).collect();
    let keys = ["b0", "b1", "b2", "b3"];
    let crcs = [Some(0x1111), None, Some(0x3333), None];
    let mut items: Vec<(&str, &[u8], Option<u32>)> =
        keys.iter().zip(&values).zip(crcs).map(|((k, v), c)| (*k, v.as_slice(), c)).collect();
    items.insert(2, ("present", b"new".as_slice(), None));
    let c = client();
    assert_eq!(
        put_batch(&c, &ep, &items),
        vec![KeyedPut::Written, KeyedPut::Written, KeyedPut::Exists, KeyedPut::Written, KeyedPut::Written]
    );
    let total: u64 = values.iter().map(|v| v.len() as u64).sum();
    assert_eq!(c.shared_copies(), (0, 4, total), "every value copied into its slot through the mapping");
    assert_eq!(*table.committed.lock(), vec!["b0", "b1", "b2", "b3"], "committed in one settle");
    assert!(table.aborted.lock().is_empty());
    assert_eq!(
        *table.batches.lock(),
        [("open_writes", 5), ("close_writes", 4)],
        "the handler allocates and commits once per batch, not once per key"
    );
    // The committed bytes, with their checksums, read back in one GET_KEYS.
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let got = get_batch(&c, &ep, &keys, &mut bufs);
    for (((g, v), buf), crc) in got.iter().zip(&values).zip(&bufs).zip(crcs) {
        assert_eq!(*g, KeyedGet::Hit { size: v.len() as u64, crc32c: crc });
        assert_eq!(buf, v, "byte-exact");
    }
    assert_eq!(table.settled().len(), 4);
}

/// A value summed while it is copied in is stored with the same CRC-32C as one summed first:
/// values of one block, of several blocks and across ranges, mixed in one batch with a key summed
/// by the caller and one without a sum (whose settle still carries the sums after the flags).
#[test]
fn a_batch_put_summed_while_copying_stores_each_values_checksum() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, _) = holder(&file, &table, true);
    let ep = srv.endpoint().to_owned();
    let values: Vec<Vec<u8>> = [1usize, 65_536, (1 << 20) + 7, 3 << 20]
        .iter()
        .enumerate()
        .map(|(i, len)| pattern(*len, 40 + i as u64))
        .collect();
    let keys = ["w0", "w1", "w2", "w3"];
    let checksums = [
        PutChecksum::WhileCopying,
        PutChecksum::None,
        PutChecksum::WhileCopying,
        PutChecksum::Given(umbp_core::value_crc32c(&values[3])),
    ];
    let batch: Vec<KeyedBatchPut<'_>> = keys
        .iter()
        .zip(&values)
        .zip(checksums)
        .map(|((key, value), checksum)| KeyedBatchPut { key, value, checksum })
        .collect();
    let c = client();
    assert_eq!(c.put_shared_batch(&ep, 1, &batch).expect("an answer"), vec![KeyedPut::Written; 4]);
    assert_eq!(*table.committed.lock(), keys, "committed in one settle");
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let got = get_batch_verified(&c, &ep, &keys, &mut bufs, true);
    let want = [
        Some(umbp_core::value_crc32c(&values[0])),
        None,
        Some(umbp_core::value_crc32c(&values[2])),
        Some(umbp_core::value_crc32c(&values[3])),
    ];
    for (((g, v), buf), crc) in got.iter().zip(&values).zip(&bufs).zip(want) {
        assert_eq!(*g, KeyedGet::Hit { size: v.len() as u64, crc32c: crc }, "the stored sum is the value's");
        assert_eq!(buf, v, "byte-exact");
    }
}

#[test]
fn a_batch_put_settled_after_its_slots_ended_commits_none() {
    let file = SealedFile::new();
    // Each slot lasts 2 ms; each allocation stalls 20 ms, so every slot ends before the settle.
    let mut table = Table::new(Duration::from_secs(10), Duration::from_millis(20));
    Arc::get_mut(&mut table).expect("unshared").slot_ttl = Duration::from_millis(2);
    let (srv, _shm, _) = holder(&file, &table, true);
    let c = client();
    let (a, b) = (pattern(4096, 1), pattern(1 << 20, 2));
    assert_eq!(
        put_batch(&c, srv.endpoint(), &[("a", &a, None), ("b", &b, None)]),
        vec![KeyedPut::Failed, KeyedPut::Failed]
    );
    assert!(table.committed.lock().is_empty(), "nothing committed after its slot ended");
    assert_eq!(*table.aborted.lock(), vec!["a", "b"]);
}

/// A confirmed batch put copies every value, asks `confirm` once (after the copies), commits what
/// it confirms and aborts the rest, which are answered withdrawn and never readable.
#[test]
fn a_confirmed_batch_put_commits_only_what_it_confirms() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, _) = holder(&file, &table, true);
    let ep = srv.endpoint().to_owned();
    let values: Vec<Vec<u8>> = (0..4).map(|i| pattern(70_000 + i, 60 + i as u64)).collect();
    let keys = ["c0", "c1", "c2", "c3"];
    let batch: Vec<KeyedBatchPut<'_>> = keys
        .iter()
        .zip(&values)
        .map(|(key, value)| KeyedBatchPut { key, value, checksum: PutChecksum::WhileCopying })
        .collect();
    let c = client();
    let mut asked = 0;
    // A short answer: the missing flag (c3) is not confirmed either.
    let got = c.put_shared_batch_confirmed(&ep, 1, &batch, &mut || {
        asked += 1;
        vec![true, false, true]
    });
    assert_eq!(
        got.expect("an answer"),
        vec![KeyedPut::Written, KeyedPut::Withdrawn, KeyedPut::Written, KeyedPut::Withdrawn]
    );
    assert_eq!(asked, 1, "asked once");
    assert_eq!(*table.committed.lock(), vec!["c0", "c2"]);
    assert_eq!(*table.aborted.lock(), vec!["c1", "c3"]);
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let got = get_batch(&c, &ep, &keys, &mut bufs);
    assert!(matches!(got[0], KeyedGet::Hit { .. }) && matches!(got[2], KeyedGet::Hit { .. }));
    assert_eq!((got[1], got[3]), (KeyedGet::Miss, KeyedGet::Miss), "withdrawn keys were never stored");
    assert_eq!((&bufs[0], &bufs[2]), (&values[0], &values[2]));
}

#[test]
fn a_batch_put_to_a_holder_without_the_shared_path_allocates_nothing() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _none, _) = holder(&file, &table, false);
    let c = client();
    let v = pattern(4096, 3);
    assert_eq!(put_batch(&c, srv.endpoint(), &[("k", &v, None)]), vec![KeyedPut::Unsupported]);
    assert!(table.committed.lock().is_empty() && table.aborted.lock().is_empty(), "never asked");
    let empty = [KeyedBatchPut { key: "e", value: &[], checksum: PutChecksum::None }];
    assert!(c.put_shared_batch(srv.endpoint(), 1, &empty).is_err(), "an empty value is refused");
}

#[test]
fn a_verified_batch_get_reports_a_copy_that_does_not_match_its_checksum() {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, _) = holder(&file, &table, true);
    let c = client();
    let (good, bad) = (pattern(1 << 20, 31), pattern(65_536, 32));
    let crc = |v: &[u8]| Some(umbp_core::value_crc32c(v));
    let written = put_batch(&c, srv.endpoint(), &[("good", &good, crc(&good)), ("bad", &bad, crc(&bad))]);
    assert_eq!(written, vec![KeyedPut::Written, KeyedPut::Written]);
    // One bit of "bad" flips in the holder's memory after the put.
    let (_, region, offset, _) = table.slots.lock().2.values().find(|s| s.0 == "bad").cloned().expect("its slot");
    assert_eq!(region, table.slots.lock().0);
    let mut byte = [0u8; 1];
    // SAFETY: inside the live mapping; nothing reads it concurrently.
    unsafe { ptr::copy_nonoverlapping(file.base.as_ptr().add(offset as usize + 100), byte.as_mut_ptr(), 1) };
    file.fill(offset as usize + 100, &[byte[0] ^ 0x10]);
    let mut bufs = [vec![0u8; good.len()], vec![0u8; bad.len()]];
    let got = get_batch_verified(&c, srv.endpoint(), &["good", "bad"], &mut bufs, true);
    let expected = umbp_core::value_crc32c(&bad);
    assert_eq!(got[0], KeyedGet::Hit { size: good.len() as u64, crc32c: crc(&good) });
    assert!(matches!(got[1], KeyedGet::Corrupt { expected: e, got: g } if e == expected && g != e), "{:?}", got[1]);
    assert_eq!(bufs[0], good);
    // The control: unverified, the same copy is a hit with the flipped bit in it.
    let got = get_batch(&c, srv.endpoint(), &["bad"], &mut bufs[1..]);
    assert_eq!(got, vec![KeyedGet::Hit { size: bad.len() as u64, crc32c: Some(expected) }]);
    assert_eq!(bufs[1].iter().zip(&bad).filter(|(a, b)| a != b).count(), 1, "exactly one byte differs");
}

/// A batch large enough fans its copies out over the kept copy threads, each value summed block by
/// block as it lands (or, streamed, as the copy reads it): every value is byte-exact, and a
/// flipped byte deep inside a value of several blocks (and of no whole number of them) is still
/// caught.
#[test]
fn a_large_verified_batch_fans_out_and_still_catches_a_corrupt_block() {
    for stream in [false, true] {
        large_verified_batch(stream);
    }
}

fn large_verified_batch(stream: bool) {
    let file = SealedFile::new();
    let table = Table::new(Duration::from_secs(10), Duration::ZERO);
    let (srv, _shm, _) = holder(&file, &table, true);
    let c = client();
    let mut values: Vec<Vec<u8>> = (0..8).map(|i| pattern(1 << 20, 40 + i)).collect();
    values.push(pattern(3 << 20 | 5, 60));
    let keys: Vec<String> = (0..values.len()).map(|i| format!("big{i}")).collect();
    let crc = |v: &[u8]| Some(umbp_core::value_crc32c(v));
    let items: Vec<(&str, &[u8], Option<u32>)> =
        keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice(), crc(v))).collect();
    assert!(put_batch(&c, srv.endpoint(), &items).iter().all(|p| *p == KeyedPut::Written));
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let got = get_batch_streamed(&c, srv.endpoint(), &key_refs, &mut bufs, (true, stream));
    for (i, (g, v)) in got.iter().zip(&values).enumerate() {
        assert_eq!(*g, KeyedGet::Hit { size: v.len() as u64, crc32c: crc(v) }, "value {i}");
        assert_eq!(bufs[i], *v, "value {i} byte-exact");
    }
    let copy_threads = std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("umbp-shm-copy"))
        .count();
    assert!(copy_threads >= 1, "the copies ran on the kept copy threads");
    // One byte of the last value flips in the holder's memory, in its third 1 MiB.
    let (_, _, offset, _) = table.slots.lock().2.values().find(|s| s.0 == "big8").cloned().expect("its slot");
    let at = offset as usize + (5 << 19) + 17;
    let mut byte = [0u8; 1];
    // SAFETY: inside the live mapping; nothing reads it concurrently.
    unsafe { ptr::copy_nonoverlapping(file.base.as_ptr().add(at), byte.as_mut_ptr(), 1) };
    file.fill(at, &[byte[0] ^ 0x01]);
    bufs.iter_mut().for_each(|b| b.fill(0));
    let got = get_batch_streamed(&c, srv.endpoint(), &key_refs, &mut bufs, (true, stream));
    let expected = umbp_core::value_crc32c(&values[8]);
    assert!(matches!(got[8], KeyedGet::Corrupt { expected: e, got: g } if e == expected && g != e), "{:?}", got[8]);
    for (i, v) in values.iter().enumerate().take(8) {
        assert_eq!(got[i], KeyedGet::Hit { size: v.len() as u64, crc32c: crc(v) }, "value {i}");
        assert_eq!(bufs[i], *v, "value {i} byte-exact");
    }
}
