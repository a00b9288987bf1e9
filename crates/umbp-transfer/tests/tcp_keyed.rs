//! Keyed requests (GET_KEY, PUT_KEY) against a data server whose handler maps keys to ranges of
//! one registered region: byte-exact gets and puts, every answer, the lease verdict of a send that
//! outlives its lease (a client that stops reading), a write cut off mid-value (aborted, never
//! committed), a server without a handler, a pooled connection the server closed.

pub mod tcp_support;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tcp_support::{HostBuf, pattern};
use umbp_core::TransferRef;
use umbp_transfer::{
    DataServer, DataServerConfig, KeyedClient, KeyedClientConfig, KeyedGet, KeyedHandler, KeyedLease, KeyedPut,
    KeyedRange, KeyedRead, KeyedSlot, KeyedWrite,
};

/// A handler over one region: committed keys and the ranges they occupy, slots handed out at the
/// next free offset, and a log of every lease and slot closed.
struct Table {
    region_id: u64,
    lease: Duration,
    state: Mutex<TableState>,
}

#[derive(Default)]
struct TableState {
    keys: HashMap<String, (u64, u64)>,
    busy: Vec<String>,
    next: u64,
    open_reads: usize,
    closed_reads: Vec<String>,
    slots: HashMap<u64, (String, u64, u64)>,
    committed: Vec<String>,
    aborted: Vec<String>,
    /// The checksums committed with values (forwarded to readers as a medium does).
    crcs: HashMap<String, u32>,
}

impl Table {
    fn new(r: &TransferRef, lease: Duration) -> Arc<Self> {
        let region_id = r.remote().expect("registered for peers").region_id;
        Arc::new(Self { region_id, lease, state: Mutex::new(TableState::default()) })
    }

    fn insert(&self, key: &str, offset: u64, len: u64) {
        self.state.lock().keys.insert(key.to_owned(), (offset, len));
    }
}

impl KeyedHandler for Table {
    fn open_read(&self, key: &str) -> KeyedRead {
        let mut s = self.state.lock();
        if s.busy.iter().any(|k| k == key) {
            return KeyedRead::Busy;
        }
        let Some(&(offset, len)) = s.keys.get(key) else { return KeyedRead::Miss };
        s.open_reads += 1;
        // Two ranges, to check that the server sends them in order as one value.
        let half = len / 2;
        let ranges = vec![
            KeyedRange { region_id: self.region_id, offset, len: half },
            KeyedRange { region_id: self.region_id, offset: offset + half, len: len - half },
        ];
        KeyedRead::Hit {
            size: len,
            ranges,
            lease: KeyedLease { id: 7, backend_id: 0, until: Instant::now() + self.lease },
            crc32c: s.crcs.get(key).copied(),
        }
    }

    fn close_read(&self, key: &str, lease: KeyedLease) {
        assert_eq!(lease.id, 7);
        let mut s = self.state.lock();
        s.open_reads -= 1;
        s.closed_reads.push(key.to_owned());
    }

    fn open_write(&self, key: &str, tier: u64, size: u64) -> KeyedWrite {
        assert_eq!(tier, 1, "the tier travels in the request");
        let mut s = self.state.lock();
        if s.keys.contains_key(key) {
            return KeyedWrite::Exists;
        }
        if size > 1 << 20 {
            return KeyedWrite::NoSpace;
        }
        let (offset, id) = (s.next, s.next + 1);
        s.next += size;
        s.slots.insert(id, (key.to_owned(), offset, size));
        KeyedWrite::Slot {
            ranges: vec![KeyedRange { region_id: self.region_id, offset, len: size }],
            slot: KeyedSlot { id, backend_id: 0, until: Instant::now() + Duration::from_secs(10) },
        }
    }

    fn close_write(&self, key: &str, slot: KeyedSlot, received: bool, crc32c: Option<u32>) -> bool {
        let mut s = self.state.lock();
        let (k, offset, size) = s.slots.remove(&slot.id).expect("a slot closes once");
        assert_eq!(k, key);
        if received {
            if let Some(crc) = crc32c {
                s.crcs.insert(k.clone(), crc);
            }
            s.keys.insert(k, (offset, size));
            s.committed.push(key.to_owned());
        } else {
            s.aborted.push(key.to_owned());
        }
        received
    }
}

fn server() -> DataServer {
    DataServer::start(DataServerConfig { io_timeout: Duration::from_secs(5), ..DataServerConfig::default() })
        .expect("server starts")
}

fn client() -> KeyedClient {
    KeyedClient::new(KeyedClientConfig::default()).expect("client")
}

fn get(c: &KeyedClient, endpoint: &str, key: &str, buf: &mut [u8]) -> KeyedGet {
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: `buf` is borrowed mutably for the whole call.
    unsafe { c.get(endpoint, key, ptr, buf.len()) }.expect("an answer")
}

#[test]
fn a_put_checksum_is_committed_with_the_value_and_comes_back_with_every_get() {
    let mut memory = HostBuf::zeroed(1 << 20);
    let srv = server();
    let r = memory.register(&srv);
    let table = Table::new(&r, Duration::from_secs(10));
    srv.set_keyed_handler(Some(Arc::clone(&table) as Arc<dyn KeyedHandler>));
    let c = client();
    let ep = srv.endpoint().to_owned();
    let value = pattern(70_001, 3);
    // The checksum field is any u32, 0 included: the flag, not the value, says one is present.
    for (key, crc) in [("with", Some(0x1edc_6f41)), ("zero", Some(0)), ("without", None)] {
        assert_eq!(c.put(&ep, key, 1, &value, crc).expect("answer"), KeyedPut::Written, "{key}");
        let mut buf = vec![0u8; value.len()];
        assert_eq!(get(&c, &ep, key, &mut buf), KeyedGet::Hit { size: value.len() as u64, crc32c: crc }, "{key}");
        assert_eq!(buf, value, "{key}: the bytes after the checksum field are the value");
    }
    let s = table.state.lock();
    assert_eq!(s.crcs.get("with"), Some(&0x1edc_6f41), "the holder was handed the writer's checksum");
    assert_eq!(s.crcs.get("zero"), Some(&0));
    assert!(!s.crcs.contains_key("without"), "no checksum sent, none committed");
}

#[test]
fn gets_and_puts_round_trip_byte_exact_with_every_answer() {
    let mut memory = HostBuf::zeroed(4 << 20);
    let srv = server();
    let r = memory.register(&srv);
    let table = Table::new(&r, Duration::from_secs(10));
    srv.set_keyed_handler(Some(Arc::clone(&table) as Arc<dyn KeyedHandler>));
    let c = client();
    let ep = srv.endpoint().to_owned();

    let value = pattern(100_003, 1);
    assert_eq!(c.put(&ep, "k1", 1, &value, None).expect("answer"), KeyedPut::Written);
    assert_eq!(c.put(&ep, "k1", 1, &value, None).expect("answer"), KeyedPut::Exists);
    assert_eq!(c.put(&ep, "big", 1, &vec![0u8; (1 << 20) + 1], None).expect("answer"), KeyedPut::NoSpace);
    let mut buf = vec![0u8; 200_000];
    assert_eq!(get(&c, &ep, "k1", &mut buf), KeyedGet::Hit { size: 100_003, crc32c: None });
    assert_eq!(&buf[..100_003], &value[..]);
    assert_eq!(get(&c, &ep, "nope", &mut buf), KeyedGet::Miss);
    assert_eq!(get(&c, &ep, "k1", &mut buf[..100]), KeyedGet::TooSmall(100_003));
    table.state.lock().busy.push("k1".into());
    assert_eq!(get(&c, &ep, "k1", &mut buf), KeyedGet::Busy);
    let s = table.state.lock();
    assert_eq!(s.committed, vec!["k1"]);
    assert_eq!(s.open_reads, 0, "every lease is closed, the too-small answer's too");
    assert_eq!(s.closed_reads, vec!["k1", "k1"]);
    drop(s);
    // Keys the protocol cannot carry are refused before any connection.
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: `buf` outlives the call.
    let empty = unsafe { c.get(&ep, "", ptr, buf.len()) };
    assert!(matches!(empty, Err(umbp_transfer::KeyedError::BadKey { len: 0, .. })), "{empty:?}");
    let long = c.put(&ep, &"x".repeat(9000), 1, b"v", None);
    assert!(matches!(long, Err(umbp_transfer::KeyedError::BadKey { len: 9000, .. })), "{long:?}");
}

#[test]
fn a_server_without_a_handler_answers_unsupported() {
    let srv = server();
    let c = client();
    let mut buf = [0u8; 16];
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Unsupported);
    assert_eq!(c.put(srv.endpoint(), "k", 1, b"value", None).expect("answer"), KeyedPut::Unsupported);
    // The connection stayed in sync (the put's payload was discarded): it serves the next request.
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Unsupported);
}

/// Sends a raw GET_KEY (see the protocol docs) and returns the socket.
fn raw_get(endpoint: &str, key: &str, cap: u64) -> TcpStream {
    let mut s = TcpStream::connect(endpoint).expect("connect");
    let mut hello = Vec::new();
    hello.extend_from_slice(b"UMBP");
    hello.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    hello.extend_from_slice(&0u16.to_le_bytes());
    s.write_all(&hello).expect("hello");
    let mut answer = [0u8; 8];
    s.read_exact(&mut answer).expect("hello answer");
    assert_eq!(answer[6], 0, "authenticated");
    let mut head = Vec::new();
    head.extend_from_slice(b"UMBP");
    head.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    head.push(3); // GET_KEY
    head.push(0);
    head.extend_from_slice(&42u64.to_le_bytes());
    head.extend_from_slice(&0u64.to_le_bytes());
    head.extend_from_slice(&cap.to_le_bytes());
    head.extend_from_slice(&(key.len() as u64).to_le_bytes());
    head.extend_from_slice(key.as_bytes());
    s.write_all(&head).expect("request");
    s
}

#[test]
fn a_send_that_outlives_the_read_lease_is_marked_lapsed_and_its_lease_closed() {
    const VALUE: usize = 48 << 20;
    let mut memory = HostBuf::with_pattern(VALUE, 3);
    let srv = server();
    let r = memory.register(&srv);
    let table = Table::new(&r, Duration::from_millis(50));
    table.insert("slow", 0, VALUE as u64);
    srv.set_keyed_handler(Some(Arc::clone(&table) as Arc<dyn KeyedHandler>));
    // A reader that stops reading: the value cannot fit the socket buffers, so the server's send
    // blocks past the 50 ms lease.
    let mut s = raw_get(srv.endpoint(), "slow", VALUE as u64);
    std::thread::sleep(Duration::from_millis(300));
    let mut head = [0u8; 24];
    s.read_exact(&mut head).expect("reply header");
    assert_eq!(head[6], 0, "OK: the bytes follow");
    let mut value = vec![0u8; VALUE];
    s.read_exact(&mut value).expect("value");
    let mut trailer = [0u8; 8];
    s.read_exact(&mut trailer).expect("trailer");
    assert_eq!(&trailer[..4], b"UMBP");
    assert_eq!(trailer[4], 1, "lapsed: the send outlived the lease");
    let deadline = Instant::now() + Duration::from_secs(5);
    while table.state.lock().open_reads > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(table.state.lock().open_reads, 0, "the lease was closed");

    // The client reports it as such, never as a hit (a fast reader inside a long lease is intact).
    let c = client();
    let mut buf = vec![0u8; VALUE];
    table.state.lock().keys.insert("fast".into(), (0, 1 << 20));
    assert_eq!(get(&c, srv.endpoint(), "fast", &mut buf), KeyedGet::Hit { size: 1 << 20, crc32c: None });
    let lapsed = Table::new(&r, Duration::ZERO);
    lapsed.insert("k", 0, 4096);
    srv.set_keyed_handler(Some(lapsed as Arc<dyn KeyedHandler>));
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Lapsed);
}

#[test]
fn a_put_cut_off_mid_value_is_aborted_never_committed() {
    let mut memory = HostBuf::zeroed(1 << 20);
    let srv = server();
    let r = memory.register(&srv);
    let table = Table::new(&r, Duration::from_secs(10));
    srv.set_keyed_handler(Some(Arc::clone(&table) as Arc<dyn KeyedHandler>));
    let mut s = TcpStream::connect(srv.endpoint()).expect("connect");
    s.write_all(b"UMBP\x02\x00\x00\x00").expect("hello");
    let mut answer = [0u8; 8];
    s.read_exact(&mut answer).expect("hello answer");
    let mut head = Vec::new();
    head.extend_from_slice(b"UMBP\x02\x00");
    head.push(4); // PUT_KEY
    head.push(0);
    head.extend_from_slice(&1u64.to_le_bytes());
    head.extend_from_slice(&1u64.to_le_bytes()); // tier
    head.extend_from_slice(&3u64.to_le_bytes()); // key length
    head.extend_from_slice(&(3u64 + 65536).to_le_bytes());
    head.extend_from_slice(b"cut");
    head.extend_from_slice(&[7u8; 1000]);
    s.write_all(&head).expect("request");
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    while table.state.lock().aborted.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = table.state.lock();
    assert_eq!(st.aborted, vec!["cut"]);
    assert!(st.committed.is_empty() && !st.keys.contains_key("cut"));
}

#[test]
fn a_get_after_the_server_closed_the_pooled_connection_succeeds() {
    let mut memory = HostBuf::with_pattern(1 << 16, 5);
    let srv =
        DataServer::start(DataServerConfig { idle_timeout: Duration::from_millis(200), ..DataServerConfig::default() })
            .expect("server starts");
    let r = memory.register(&srv);
    let table = Table::new(&r, Duration::from_secs(10));
    table.insert("k", 0, 1 << 16);
    srv.set_keyed_handler(Some(Arc::clone(&table) as Arc<dyn KeyedHandler>));
    let c = client();
    let mut buf = vec![0u8; 1 << 16];
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit { size: 1 << 16, crc32c: None });
    // The server closes the idle connection; the next get takes a fresh one.
    std::thread::sleep(Duration::from_millis(600));
    buf.fill(0);
    assert_eq!(get(&c, srv.endpoint(), "k", &mut buf), KeyedGet::Hit { size: 1 << 16, crc32c: None });
    assert_eq!(&buf[..], memory.bytes());
}

#[test]
fn an_unreachable_holder_is_a_connect_error() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let c = client();
    let mut buf = [0u8; 8];
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: `buf` outlives the call.
    let e = unsafe { c.get(&format!("127.0.0.1:{port}"), "k", ptr, 8) }.expect_err("nothing listens");
    assert!(e.is_unreachable(), "{e}");
}
