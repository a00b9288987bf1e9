//! Fuzzing entry points (issue 19): bytes a peer could send, handed to the data plane's own
//! decoders and to a live [`DataServer`]. Not API: hidden from the docs, called by the `fuzz/`
//! crate's targets (coverage-guided, long runs) and by `tests/fuzz_transfer.rs` (proptest, bounded,
//! in CI). Each entry point panics when a property fails, which is what both drivers catch.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::ptr::NonNull;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar};

use crate::shm::wire as shm;
use crate::tcp::batch_wire::{self, BatchAnswer, BatchEntry, PutChecksum, PutEntry};
use crate::tcp::protocol::{
    self, Descriptor, FLAG_CHECKSUM, FLAG_SHARED, HELLO_LEN, HELLO_REPLY_LEN, HelloStatus, MAX_REQUEST_BYTES,
    MAX_SHARED_RANGES, MAX_TOKEN_LEN, Op, REPLY_LEN, REQUEST_LEN, Reply, Request, SETTLE_LEN, Settle, Status,
    TRAILER_LEN, Trailer,
};
use crate::{DataServer, DataServerConfig, KeyedHandler, KeyedLease, KeyedRange, KeyedRead, KeyedSlot, KeyedWrite};

/// Which decoder [`frames`] runs: the first byte, modulo this.
const DECODERS: u8 = 13;

fn array<const N: usize>(b: &[u8]) -> Option<[u8; N]> {
    b.get(..N).and_then(|b| b.try_into().ok())
}

/// Runs one frame decoder (picked by `data[0]`) over the rest of `data`: TCP request, reply,
/// hello, hello reply, trailer, settle, `MAPPED` descriptor; shared-memory hello, request, region
/// reply. Never panics on its own; a decoded frame must say only what its bytes say (it encodes
/// back to them, reserved bytes aside) and no length it accepts exceeds its protocol limit.
pub fn frames(data: &[u8]) {
    let Some((&which, b)) = data.split_first() else { return };
    match which % DECODERS {
        0 => {
            let Some(raw) = array::<REQUEST_LEN>(b) else { return };
            if let Ok(r) = Request::decode(&raw) {
                assert!(r.length <= MAX_REQUEST_BYTES, "a request longer than the protocol allows");
                assert_eq!(r.encode(), raw, "a request re-encodes to its bytes");
            }
        }
        1 => {
            let Some(raw) = array::<REPLY_LEN>(b) else { return };
            if let Ok(r) = Reply::decode(&raw) {
                assert!(r.length <= MAX_REQUEST_BYTES, "a reply longer than the protocol allows");
                let mut expect = raw;
                expect[7] = 0;
                assert_eq!(r.encode(), expect, "a reply re-encodes to its bytes");
            }
        }
        2 => {
            let Some(raw) = array::<HELLO_LEN>(b) else { return };
            if let Ok(h) = protocol::decode_hello(&raw) {
                assert!(h.token_len <= MAX_TOKEN_LEN, "a token longer than the limit");
                if h.version == protocol::VERSION {
                    let hello = protocol::encode_hello(&vec![0; h.token_len]).expect("a token within the limit");
                    assert_eq!(hello[..HELLO_LEN], raw, "a hello re-encodes to its bytes");
                }
            }
        }
        3 => {
            let Some(raw) = array::<HELLO_REPLY_LEN>(b) else { return };
            if let Ok(s) = protocol::decode_hello_reply(&raw) {
                let back = protocol::encode_hello_reply(s);
                assert_eq!((back[..4].to_vec(), back[6]), (raw[..4].to_vec(), raw[6]), "magic and status kept");
            }
        }
        4 => {
            let Some(raw) = array::<TRAILER_LEN>(b) else { return };
            if let Ok((t, crc)) = Trailer::decode(&raw) {
                let back = t.encode(crc);
                assert_eq!(back[..6], raw[..6], "a trailer re-encodes to its verdict and checksum flag");
                if crc.is_some() {
                    assert_eq!(back[8..12], raw[8..12], "and to its checksum");
                }
            }
        }
        5 => {
            let Some(raw) = array::<SETTLE_LEN>(b) else { return };
            if let Ok(s) = Settle::decode(&raw) {
                assert_eq!(s.encode()[..5], raw[..5], "a settle frame re-encodes to its bytes");
            }
        }
        6 => {
            if let Ok(d) = Descriptor::decode(b) {
                assert!((1..=MAX_SHARED_RANGES).contains(&d.ranges.len()), "1 to {MAX_SHARED_RANGES} ranges");
                let sum = d.ranges.iter().try_fold(0u64, |a, r| a.checked_add(r.2));
                assert_eq!(sum, Some(d.size), "the ranges add up to the size");
                // Reserved bytes are ignored; so is the checksum field when the flag says none.
                let mut expect = b.to_vec();
                expect[21..24].fill(0);
                expect[28..32].fill(0);
                if d.crc32c.is_none() {
                    expect[24..28].fill(0);
                }
                assert_eq!(d.encode(), expect, "a descriptor re-encodes to its bytes");
            }
        }
        7 => {
            let Some(raw) = array::<{ shm::HELLO_LEN }>(b) else { return };
            if let Some(token_len) = shm::decode_hello(&raw) {
                assert!(token_len <= shm::MAX_TOKEN_LEN, "a token longer than the limit");
                let hello = shm::encode_hello(&vec![0; token_len]).expect("a token within the limit");
                assert_eq!(hello[..shm::HELLO_LEN], raw, "a hello re-encodes to its bytes");
            }
        }
        8 => {
            let Some(raw) = array::<{ shm::REQUEST_LEN }>(b) else { return };
            if let Some(id) = shm::decode_request(&raw) {
                assert_eq!(shm::encode_request(id), raw, "a request re-encodes to its bytes");
            }
        }
        9 => {
            let Some(raw) = array::<{ shm::REGION_REPLY_LEN }>(b) else { return };
            let (status, r) = shm::decode_region_reply(&raw);
            if let Some(s) = shm::Status::from_byte(status) {
                let mut expect = raw;
                expect[1..4].fill(0);
                assert_eq!(shm::encode_region_reply(s, r), expect, "a region reply re-encodes to its bytes");
            }
        }
        10 => {
            // A GET_KEYS request body; its key count is the first byte.
            let Some((&count, body)) = b.split_first() else { return };
            if let Ok(entries) = batch_wire::decode_request(body, u64::from(count)) {
                assert_eq!(entries.len(), usize::from(count), "one entry per key");
                assert!(entries.iter().all(|e| !e.key.is_empty()), "no empty key");
                assert_eq!(batch_wire::encode_request(&entries), body, "a request body re-encodes to its bytes");
            }
        }
        12 => {
            // A PUT_KEYS request body; its key count is the first byte.
            let Some((&count, body)) = b.split_first() else { return };
            if let Ok(entries) = batch_wire::decode_put_request(body, u64::from(count)) {
                assert_eq!(entries.len(), usize::from(count), "one entry per key");
                assert!(entries.iter().all(|e| !e.key.is_empty() && e.size > 0), "no empty key or value");
                // Reserved bytes and an unflagged checksum aside, it re-encodes to its bytes.
                let again = batch_wire::encode_put_request(&entries);
                assert_eq!(batch_wire::decode_put_request(&again, u64::from(count)).ok(), Some(entries), "kept");
            }
        }
        _ => {
            // A GET_KEYS or PUT_KEYS reply body answering as many keys as its first byte says.
            let Some((&count, body)) = b.split_first() else { return };
            if let Ok(answers) = batch_wire::decode_reply(body, usize::from(count)) {
                assert_eq!(answers.len(), usize::from(count), "one answer per key");
                // Reserved bytes aside, an answer says what its bytes say: re-encoded, it decodes alike.
                let mut again = Vec::new();
                for a in &answers {
                    batch_wire::encode_answer(&mut again, a);
                }
                assert_eq!(batch_wire::decode_reply(&again, answers.len()).ok(), Some(answers), "answers kept");
            }
        }
    }
}

/// Valid frames for [`frames`], one per decoder, made by the encoders (the seed corpus).
pub fn frame_seeds() -> Vec<Vec<u8>> {
    let tagged = |tag: u8, bytes: &[u8]| [&[tag][..], bytes].concat();
    let request = Request { op: Op::Write, flags: 0, id: 7, region: 1, offset: 4096, length: 512 };
    let descriptor =
        Descriptor { size: 30, lease_ns: 5_000_000, ranges: vec![(1, 0, 10), (1, 4096, 20)], crc32c: Some(0x1234) };
    let region = shm::RegionReply { slot: 3, offset: 4096, len: 1 << 20, epoch: 9 };
    let batch = batch_wire::encode_request(&[BatchEntry { key: "a", cap: 64 }, BatchEntry { key: "bc", cap: 1 << 20 }]);
    let put_batch = batch_wire::encode_put_request(&[
        PutEntry { key: "a", size: 64, checksum: PutChecksum::Given(0x0bad_cafe) },
        PutEntry { key: "bc", size: 1 << 20, checksum: PutChecksum::None },
        PutEntry { key: "d", size: 9, checksum: PutChecksum::WhileCopying },
    ]);
    let mut answers = Vec::new();
    for a in [
        BatchAnswer::Mapped(descriptor.clone()),
        BatchAnswer::TooSmall(4096),
        BatchAnswer::Other(Status::Miss),
        BatchAnswer::Other(Status::Busy),
    ] {
        batch_wire::encode_answer(&mut answers, &a);
    }
    vec![
        tagged(0, &request.encode()),
        tagged(1, &Reply { status: Status::Ok, id: 7, length: 512 }.encode()),
        tagged(2, &protocol::encode_hello(b"token").unwrap_or_default()[..HELLO_LEN]),
        tagged(3, &protocol::encode_hello_reply(HelloStatus::Ok)),
        tagged(4, &Trailer::Lapsed.encode(None)),
        tagged(4, &Trailer::Intact.encode(Some(0xdead_beef))),
        tagged(5, &Settle::SendBytes.encode()),
        tagged(6, &descriptor.encode()),
        tagged(7, &shm::encode_hello(b"token").unwrap_or_default()[..shm::HELLO_LEN]),
        tagged(8, &shm::encode_request(42)),
        tagged(9, &shm::encode_region_reply(shm::Status::Ok, region)),
        [&[10u8, 2][..], &batch].concat(),
        [&[11u8, 4][..], &answers].concat(),
        [&[12u8, 2][..], &put_batch].concat(),
    ]
}

/// The cluster token of the fuzzed server.
const TOKEN: &[u8] = b"fuzz-token";
/// Bytes of the server's one region.
const REGION_BYTES: usize = 64 << 10;
/// The keyed handler's one key, and its value's place and size in the region.
const KEY: &str = "k";
const VALUE_BYTES: u64 = 1000;
/// The checksum the fuzz handler says its value was put with (the server only forwards it).
const VALUE_CRC: u32 = 0x0bad_cafe;
/// Where keyed writes land, and the largest one given a slot.
const SLOT_OFFSET: u64 = 8192;
const SLOT_BYTES: u64 = 8192;

/// A keyed handler over the region: [`KEY`] is a hit, any other key a miss; a write of up to
/// [`SLOT_BYTES`] gets a slot, a larger one no space. It counts leases and slots open, so a stream
/// that leaves one open after its connection ends is caught.
struct Handler {
    region: u64,
    open: AtomicI64,
}

impl KeyedHandler for Handler {
    fn open_read(&self, key: &str) -> KeyedRead {
        if key != KEY {
            return KeyedRead::Miss;
        }
        self.open.fetch_add(1, Ordering::SeqCst);
        let lease = KeyedLease { id: 1, backend_id: 0, until: Instant::now() + Duration::from_secs(5) };
        KeyedRead::Hit {
            size: VALUE_BYTES,
            ranges: vec![
                KeyedRange { region_id: self.region, offset: 0, len: 400 },
                KeyedRange { region_id: self.region, offset: 4096, len: VALUE_BYTES - 400 },
            ],
            lease,
            crc32c: Some(VALUE_CRC),
        }
    }

    fn close_read(&self, _key: &str, _lease: KeyedLease) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }

    fn open_write(&self, _key: &str, _tier: u64, size: u64) -> KeyedWrite {
        if size > SLOT_BYTES {
            return KeyedWrite::NoSpace;
        }
        self.open.fetch_add(1, Ordering::SeqCst);
        let slot = KeyedSlot { id: 1, backend_id: 0, until: Instant::now() + Duration::from_secs(5) };
        KeyedWrite::Slot { ranges: vec![KeyedRange { region_id: self.region, offset: SLOT_OFFSET, len: size }], slot }
    }

    fn close_write(&self, _key: &str, _slot: KeyedSlot, received: bool, _crc32c: Option<u32>) -> bool {
        self.open.fetch_sub(1, Ordering::SeqCst);
        received
    }
}

/// A data server with one region and a keyed handler, shared by every case of a process.
struct Harness {
    server: DataServer,
    handler: std::sync::Arc<Handler>,
    region: u64,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let config = DataServerConfig {
            cluster_token: Some(String::from_utf8_lossy(TOKEN).into_owned()),
            handshake_timeout: Duration::from_millis(500),
            io_timeout: Duration::from_secs(2),
            ..DataServerConfig::default()
        };
        let server = DataServer::start(config).expect("a data server on loopback");
        // Leaked: the server (a static too) may touch it until the process ends.
        let memory: &'static mut [u8] = Box::leak(vec![0u8; REGION_BYTES].into_boxed_slice());
        let ptr = NonNull::new(memory.as_mut_ptr()).expect("a leaked box is non-null");
        // SAFETY: the memory is leaked, so it outlives the server; only the server touches it.
        let local = unsafe { LocalRegion::new(ptr, REGION_BYTES as u64, MemoryLocation::Host) };
        let r = server.register_memory(local).expect("host memory registers");
        let region = r.remote().expect("a data server's ref names its region").region_id;
        let handler = std::sync::Arc::new(Handler { region, open: AtomicI64::new(0) });
        server.set_keyed_handler(Some(handler.clone()));
        Harness { server, handler, region }
    })
}

/// Sends `data` to a live data server as one connection's whole stream (then half-closes it) and
/// reads what comes back until the server closes. Every 8 bytes equal to [`REGION_TAG`] are
/// replaced with the id of the server's region first. Properties: the server ends the connection
/// within its deadlines, closes every read lease and slot the stream opened, and then serves a
/// well-behaved client (hello, a READ, a GET_KEY) correctly. Returns the bytes the server sent.
pub fn server_stream(data: &[u8]) -> usize {
    let h = harness();
    let endpoint = h.server.endpoint().to_owned();
    let data = with_region(data, h.region);
    let mut s = TcpStream::connect(&endpoint).expect("connect to the fuzzed server");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    // The server may close early (a malformed frame): the rest of the write then fails, as it may.
    let _ = s.write_all(&data);
    let _ = s.shutdown(Shutdown::Write);
    let started = Instant::now();
    let mut sink = [0u8; 16 << 10];
    let mut received = 0;
    loop {
        match s.read(&mut sink) {
            Ok(0) => break,
            Ok(n) => received += n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the server kept a half-closed connection open for {:?}", started.elapsed())
            }
            Err(_) => break,
        }
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while h.handler.open.load(Ordering::SeqCst) != 0 {
        assert!(Instant::now() < deadline, "a lease or slot outlived its connection");
        std::thread::sleep(Duration::from_millis(1));
    }
    well_behaved_client(&endpoint, h.region);
    received
}

/// Stands for the id of the fuzzed server's region in an input: region ids differ from run to run,
/// so a saved input names this instead.
pub const REGION_TAG: u64 = u64::from_le_bytes(*b"@region@");

/// `data` with every occurrence of [`REGION_TAG`]'s bytes replaced by `region`'s.
fn with_region(data: &[u8], region: u64) -> Vec<u8> {
    let (tag, id) = (REGION_TAG.to_le_bytes(), region.to_le_bytes());
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    while i < data.len() {
        if data[i..].starts_with(&tag) {
            out.extend_from_slice(&id);
            i += tag.len();
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}

fn well_behaved_client(endpoint: &str, region: u64) {
    let mut s = TcpStream::connect(endpoint).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");
    let read = Request { op: Op::Read, flags: 0, id: 1, region, offset: 100, length: 64 };
    let get = Request { op: Op::GetKey, flags: 0, id: 2, region: 0, offset: 1 << 20, length: KEY.len() as u64 };
    let hello = protocol::encode_hello(TOKEN).expect("a short token");
    let stream = [&hello[..], &read.encode(), &get.encode(), KEY.as_bytes()].concat();
    s.write_all(&stream).expect("a well-behaved request");
    let mut answer = [0u8; HELLO_REPLY_LEN];
    s.read_exact(&mut answer).expect("a hello answer");
    assert_eq!(protocol::decode_hello_reply(&answer), Ok(HelloStatus::Ok), "the right token is accepted");
    let mut head = [0u8; REPLY_LEN];
    s.read_exact(&mut head).expect("a READ reply");
    assert_eq!(Reply::decode(&head), Ok(Reply { status: Status::Ok, id: 1, length: 64 }));
    let mut payload = vec![0u8; 64];
    s.read_exact(&mut payload).expect("the READ payload");
    s.read_exact(&mut head).expect("a GET_KEY reply");
    assert_eq!(Reply::decode(&head), Ok(Reply { status: Status::Ok, id: 2, length: VALUE_BYTES }));
    let mut value = vec![0u8; VALUE_BYTES as usize + TRAILER_LEN];
    s.read_exact(&mut value).expect("the value and its trailer");
    let trailer: [u8; TRAILER_LEN] = array(&value[VALUE_BYTES as usize..]).expect("a whole trailer");
    assert_eq!(Trailer::decode(&trailer), Ok((Trailer::Intact, Some(VALUE_CRC))));
}

/// Connection streams for [`server_stream`], made by the encoders: a hello, then each kind of
/// request the server takes (READ, WRITE with its payload, GET_KEY plain and shared with a settle
/// frame, PUT_KEY plain and shared, with and without a checksum, GET_KEYS and PUT_KEYS with their
/// settle frames), and a hello with the wrong token.
pub fn server_seeds() -> Vec<Vec<u8>> {
    let region = REGION_TAG;
    let hello = protocol::encode_hello(TOKEN).unwrap_or_default();
    let req = |op, flags, id, region, offset, length| Request { op, flags, id, region, offset, length }.encode();
    let key = KEY.as_bytes();
    let klen = key.len() as u64;
    let mut out = Vec::new();
    out.push([&hello[..], &req(Op::Read, 0, 1, region, 0, 128)].concat());
    out.push([&hello[..], &req(Op::Write, 0, 2, region, 256, 16), &[7u8; 16]].concat());
    out.push([&hello[..], &req(Op::GetKey, 0, 3, 0, 4096, klen), key].concat());
    let settle = Settle::Done.encode();
    out.push([&hello[..], &req(Op::GetKey, FLAG_SHARED, 4, 0, 4096, klen), key, &settle].concat());
    out.push([&hello[..], &req(Op::PutKey, 0, 5, 1, klen, klen + 32), b"p", &[9u8; 32]].concat());
    let size = 32u64.to_le_bytes();
    let send = Settle::SendBytes.encode();
    out.push(
        [&hello[..], &req(Op::PutKey, FLAG_SHARED, 6, 1, klen, klen + 8), b"q", &size, &send, &[5u8; 32]].concat(),
    );
    let crc = 0x0bad_f00d_u32.to_le_bytes();
    out.push([&hello[..], &req(Op::PutKey, FLAG_CHECKSUM, 7, 1, klen, klen + 4 + 32), b"c", &crc, &[3u8; 32]].concat());
    out.push(
        [&hello[..], &req(Op::PutKey, FLAG_SHARED | FLAG_CHECKSUM, 8, 1, klen, klen + 4 + 8), b"s", &crc, &size, &send]
            .concat(),
    );
    let batch = batch_wire::encode_request(&[BatchEntry { key: KEY, cap: 4096 }, BatchEntry { key: "x", cap: 8 }]);
    out.push([&hello[..], &req(Op::GetKeys, FLAG_SHARED, 9, 0, 2, batch.len() as u64), &batch, &settle].concat());
    out.push(protocol::encode_hello(b"wrong").unwrap_or_default());
    // PUT_KEYS of one key: its slot answered, the copy skipped (flag 0, so the slot is aborted).
    let put = batch_wire::encode_put_request(&[PutEntry { key: "n", size: 32, checksum: PutChecksum::None }]);
    out.push([&hello[..], &req(Op::PutKeys, FLAG_SHARED, 10, 1, 1, put.len() as u64), &put, &settle, &[0u8]].concat());
    // PUT_KEYS of one key summed while copied: the copy flagged done, its CRC-32C after the flags.
    let put = batch_wire::encode_put_request(&[PutEntry { key: "s", size: 32, checksum: PutChecksum::WhileCopying }]);
    let late = [&[1u8][..], &0x1234_5678u32.to_le_bytes()].concat();
    out.push([&hello[..], &req(Op::PutKeys, FLAG_SHARED, 11, 1, 1, put.len() as u64), &put, &settle, &late].concat());
    out
}
