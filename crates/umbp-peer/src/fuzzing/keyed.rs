//! The keyed data plane as a node serves it: a [`DataServer`] whose keyed handler is the node's
//! own [`KeyedMedia`] over a DRAM medium registered with that server.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use umbp_core::{BackendRegistry, MediumBackend, MemoryRegistrar, TierType};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBackend, PageBackendConfig};
use umbp_transfer::{DataServer, DataServerConfig};

use crate::PeerService;
use crate::peer_service::KeyedMedia;

const PAGE: u64 = 4096;
const PAGES: u64 = 64;
/// Op codes and the shared-memory flag of the data plane (`umbp-transfer`'s `tcp/protocol.rs`).
const GET_KEY: u8 = 3;
const PUT_KEY: u8 = 4;
const FLAG_SHARED: u8 = 1;

struct Harness {
    server: Arc<DataServer>,
    backend: Arc<PageBackend>,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let config = DataServerConfig {
            handshake_timeout: Duration::from_millis(500),
            io_timeout: Duration::from_secs(2),
            ..DataServerConfig::default()
        };
        let server = Arc::new(DataServer::start(config).expect("a data server on loopback"));
        let config = PageBackendConfig::new(TierType::Dram, PAGE, vec![PAGE * PAGES])
            .with_pending_ttl(Duration::from_secs(60))
            .with_read_lease_ttl(Duration::from_secs(60));
        let source = HostPageMemorySource::new(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
        let backend = Arc::new(PageBackend::new(config, Box::new(source)).expect("a DRAM medium"));
        let registrar: Arc<dyn MemoryRegistrar> = server.clone();
        backend.init(registrar).expect("the medium registers with the data server");
        let mut registry = BackendRegistry::new();
        registry.register(backend.clone()).expect("a DRAM medium registers");
        let service = PeerService::new(Arc::new(registry), server.endpoint());
        // Long leases and slots: a lease or slot the server fails to close is still held when the
        // case ends, so the leak check below sees it.
        let keyed = KeyedMedia::new(&service, Duration::from_secs(60), Duration::from_secs(60));
        server.set_keyed_handler(Some(Arc::new(keyed)));
        Harness { server, backend }
    })
}

fn hello() -> Vec<u8> {
    let mut out = b"UMBP".to_vec();
    out.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

fn request(op: u8, flags: u8, id: u64, region: u64, offset: u64, length: u64) -> Vec<u8> {
    let mut out = b"UMBP".to_vec();
    out.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    out.extend_from_slice(&[op, flags]);
    for v in [id, region, offset, length] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn put(id: u64, key: &str, value: &[u8]) -> Vec<u8> {
    let tier = u64::from(TierType::Dram.wire());
    let len = (key.len() + value.len()) as u64;
    [request(PUT_KEY, 0, id, tier, key.len() as u64, len), key.as_bytes().to_vec(), value.to_vec()].concat()
}

/// A PUT_KEY carrying the value's checksum (flag 2) between the key and the value.
fn put_checked(id: u64, key: &str, crc: u32, value: &[u8]) -> Vec<u8> {
    let tier = u64::from(TierType::Dram.wire());
    let len = (key.len() + 4 + value.len()) as u64;
    [
        request(PUT_KEY, 2, id, tier, key.len() as u64, len),
        key.as_bytes().to_vec(),
        crc.to_le_bytes().to_vec(),
        value.to_vec(),
    ]
    .concat()
}

fn get(id: u64, key: &str, flags: u8) -> Vec<u8> {
    [request(GET_KEY, flags, id, 0, 1 << 20, key.len() as u64), key.as_bytes().to_vec()].concat()
}

/// Sends `data` to the node's data server as one connection's whole stream (then half-closes it)
/// and reads what comes back until the server closes. Properties: the server ends the connection
/// within its deadlines; once the keys the stream stored are evicted, every page of the medium is
/// free again (no read lease or slot outlives its connection); and the server then stores and
/// serves a well-behaved client's value byte for byte. Returns the bytes the server sent.
pub fn keyed_stream(data: &[u8]) -> usize {
    let h = harness();
    let mut s = TcpStream::connect(h.server.endpoint()).expect("connect to the fuzzed server");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("read timeout");
    let _ = s.write_all(data);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = [0u8; 16 << 10];
    let mut received = 0;
    loop {
        match s.read(&mut sink) {
            Ok(0) => break,
            Ok(n) => received += n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the server kept a half-closed connection open")
            }
            Err(_) => break,
        }
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let keys: Vec<String> = h.backend.snapshot_owned_keys().into_iter().map(|e| e.key).collect();
        let _ = h.backend.evict(&keys);
        let cap = h.backend.capacity();
        if cap.available_bytes == cap.total_bytes {
            break;
        }
        assert!(Instant::now() < deadline, "pages held after the connection ended: {cap:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    well_behaved_client(h);
    received
}

fn well_behaved_client(h: &Harness) {
    let value: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let mut s = TcpStream::connect(h.server.endpoint()).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");
    s.write_all(&[hello(), put(1, "probe", &value), get(2, "probe", 0)].concat()).expect("a good client writes");
    let mut answer = [0u8; 8];
    s.read_exact(&mut answer).expect("a hello answer");
    assert_eq!(answer[6], 0, "the hello is accepted");
    let mut head = [0u8; 24];
    s.read_exact(&mut head).expect("the PUT_KEY reply");
    assert_eq!((head[6], &head[8..16]), (0, &1u64.to_le_bytes()[..]), "the probe is stored");
    s.read_exact(&mut head).expect("the GET_KEY reply");
    assert_eq!((head[6], &head[8..16]), (0, &2u64.to_le_bytes()[..]), "the probe is found");
    assert_eq!(&head[16..24], &(value.len() as u64).to_le_bytes(), "the probe's size");
    let mut got = vec![0u8; value.len() + 8];
    s.read_exact(&mut got).expect("the value and its trailer");
    assert!(got[..value.len()] == value[..], "the probe comes back byte for byte");
    assert_eq!((&got[value.len()..value.len() + 4], got[value.len() + 4]), (&b"UMBP"[..], 0), "intact");
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(2);
    while h.backend.evict(&["probe".to_owned()]).first().is_none_or(|r| r.bytes_freed == 0) {
        assert!(Instant::now() < deadline, "the probe's read lease outlived its connection");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Connection streams for [`keyed_stream`]: PUT_KEY then GET_KEY of values of one and of several
/// pages, the shared-memory forms (a `MAPPED` answer settled with "send the bytes" or "done"), a
/// key put twice, a miss, a value larger than the medium.
pub fn keyed_seeds() -> Vec<Vec<u8>> {
    let value = |n: usize| (0..n).map(|i| i as u8).collect::<Vec<u8>>();
    let settle = |verdict: u8| [&b"UMBP"[..], &[verdict, 0, 0, 0]].concat();
    let tier = u64::from(TierType::Dram.wire());
    let shared_put = |id, key: &str, size: u64| {
        [
            request(PUT_KEY, FLAG_SHARED, id, tier, key.len() as u64, key.len() as u64 + 8),
            key.as_bytes().to_vec(),
            size.to_le_bytes().to_vec(),
        ]
        .concat()
    };
    vec![
        [hello(), put(1, "a", &value(100)), get(2, "a", 0), get(3, "zz", 0)].concat(),
        [hello(), put(1, "b", &value(10_000)), put(2, "b", &value(10)), get(3, "b", FLAG_SHARED), settle(1)].concat(),
        [hello(), put(1, "c", &value(3)), get(2, "c", FLAG_SHARED), settle(0)].concat(),
        [hello(), shared_put(1, "d", 300), settle(1), value(300), get(2, "d", 0)].concat(),
        [hello(), put_checked(1, "f", 0x1edc_6f41, &value(50)), get(2, "f", 0), get(3, "f", FLAG_SHARED), settle(0)]
            .concat(),
        // Claims a value larger than the medium; the stream ends after a few of its bytes.
        [hello(), request(PUT_KEY, 0, 1, tier, 1, PAGE * PAGES + 2), b"e".to_vec(), value(16)].concat(),
    ]
}
