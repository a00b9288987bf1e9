//! The data port under a flood: a thousand sockets that never say hello and a thousand that
//! authenticate and then sit idle, beside a real workload that must keep succeeding byte-exact,
//! with and without a cluster token; and a flood from one source address that displaces only its
//! own connections.

pub mod tcp_support;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tcp_support::{HostBuf, fast_config, item, pattern};
use umbp_core::{MemoryLocation, MemoryRegistrar, TransferRef};
use umbp_transfer::{DataServerConfig, TcpEngine, TcpEngineConfig, transfer};

const SILENT: usize = 1000;
const IDLE: usize = 1000;
/// Descriptors the flood test needs: its own ends of both floods, the server's ends (capped by the
/// server's limits, three descriptors per authenticated connection) and the workload's.
const FLOOD_DESCRIPTORS: u64 = 4096;

/// Raises the soft open-file limit to the hard one; `Err` says why the test cannot run here (the
/// hard limit is below `need`).
fn raise_open_files(need: u64) -> Result<(), String> {
    let now = umbp_transfer::raise_open_file_limit().map_err(|e| format!("cannot raise RLIMIT_NOFILE: {e}"))?;
    if now < need {
        return Err(format!("RLIMIT_NOFILE hard limit {now} is below the {need} descriptors the test needs"));
    }
    Ok(())
}

/// The client hello with `token`.
fn hello_bytes(token: &str) -> Vec<u8> {
    let mut h = b"UMBP".to_vec();
    h.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    h.extend_from_slice(&u16::try_from(token.len()).expect("short token").to_le_bytes());
    h.extend_from_slice(token.as_bytes());
    h
}

fn token_config(token: Option<&str>) -> TcpEngineConfig {
    TcpEngineConfig { cluster_token: token.map(str::to_owned), ..fast_config() }
}

/// The server's limits are its defaults: they are what a node runs with.
fn flood_beside_a_workload(token: Option<&str>) {
    if let Err(reason) = raise_open_files(FLOOD_DESCRIPTORS) {
        println!("skipped: {reason}");
        return;
    }
    const REGION: usize = 1 << 20;
    const PIECE: usize = 64 << 10;
    let mut remote = HostBuf::zeroed(REGION);
    let server =
        TcpEngine::new(TcpEngineConfig { cluster_token: token.map(str::to_owned), ..TcpEngineConfig::default() })
            .expect("server engine");
    let remote_ref = remote.register(&server);
    let target =
        TransferRef::remote_only(remote_ref.remote().expect("remote").clone(), REGION as u64, MemoryLocation::Host);
    let endpoint = server.endpoint().to_owned();
    let defaults = DataServerConfig::default();

    let rounds = AtomicUsize::new(0);
    let flooded = AtomicBool::new(false);
    std::thread::scope(|s| {
        let workload = s.spawn(|| -> Result<usize, String> {
            let mut src = HostBuf::zeroed(PIECE);
            let mut back = HostBuf::zeroed(PIECE);
            let client = TcpEngine::new(token_config(token)).map_err(|e| e.to_string())?;
            let (src_ref, back_ref) = (src.register(&client), back.register(&client));
            let give_up = Instant::now() + Duration::from_secs(120);
            let mut flooded_at = None;
            let mut after = 0usize;
            for round in 0usize.. {
                let seed = round as u64 + 1;
                let at = ((round % (REGION / PIECE)) * PIECE) as u64;
                // Only this thread touches `src` and `back` between transfers.
                client.deregister(&src_ref);
                let expected = pattern(PIECE, seed);
                let mut staged = HostBuf::with_pattern(PIECE, seed);
                let staged_ref = staged.register(&client);
                let write = transfer(&client, &[item(&staged_ref, 0, &target, at, PIECE as u64, 1)]);
                client.deregister(&staged_ref);
                write.map_err(|f| format!("round {round}: write failed: {f:?}"))?;
                transfer(&client, &[item(&target, at, &back_ref, 0, PIECE as u64, 2)])
                    .map_err(|f| format!("round {round}: read failed: {f:?}"))?;
                if back.bytes() != &expected[..] {
                    return Err(format!("round {round}: read back wrong bytes"));
                }
                // A new peer (new connections, as a command-line client makes) reads it too.
                let mut fresh_back = HostBuf::zeroed(PIECE);
                let fresh = TcpEngine::new(token_config(token)).map_err(|e| e.to_string())?;
                let fresh_ref = fresh_back.register(&fresh);
                let read = transfer(&fresh, &[item(&target, at, &fresh_ref, 0, PIECE as u64, 3)]);
                drop(fresh);
                read.map_err(|f| format!("round {round}: a new peer's read failed: {f:?}"))?;
                if fresh_back.bytes() != &expected[..] {
                    return Err(format!("round {round}: a new peer read wrong bytes"));
                }
                rounds.fetch_add(1, Ordering::SeqCst);
                if flooded.load(Ordering::SeqCst) {
                    let since = *flooded_at.get_or_insert_with(Instant::now);
                    after += 1;
                    // Past the handshake deadline of every silent socket, and then some.
                    if after >= 20 && since.elapsed() > defaults.handshake_timeout * 2 {
                        return Ok(round + 1);
                    }
                }
                if Instant::now() > give_up {
                    return Err(format!("the workload did not finish ({round} rounds)"));
                }
            }
            unreachable!("the loop returns")
        });
        // Start the floods once the workload's pooled connections exist.
        let started = Instant::now();
        while rounds.load(Ordering::SeqCst) < 3 && !workload.is_finished() {
            assert!(started.elapsed() < Duration::from_secs(60), "the workload never got going");
            std::thread::sleep(Duration::from_millis(5));
        }
        let silent =
            s.spawn(|| (0..SILENT).map(|_| TcpStream::connect(&endpoint).expect("silent connect")).collect::<Vec<_>>());
        let idle = s.spawn(|| {
            let hello = hello_bytes(token.unwrap_or(""));
            let mut held: Vec<TcpStream> = Vec::with_capacity(IDLE + 100);
            for _ in 0..IDLE {
                let mut c = TcpStream::connect(&endpoint).expect("idle connect");
                // The server may close an old idle one to make room: the write can fail then.
                let _ = c.write_all(&hello);
                held.push(c);
            }
            if token.is_some() {
                // And some with the wrong token, refused at once.
                for _ in 0..100 {
                    let mut c = TcpStream::connect(&endpoint).expect("wrong-token connect");
                    let _ = c.write_all(&hello_bytes("not the token"));
                    held.push(c);
                }
            }
            held
        });
        let silent = silent.join().expect("silent flood");
        let idle = idle.join().expect("idle flood");
        flooded.store(true, Ordering::SeqCst);
        let result = workload.join().expect("workload thread");
        let done = result.unwrap_or_else(|e| panic!("the workload failed beside the flood: {e}"));
        assert!(done >= 23, "{done} rounds");
        // What the flood holds on the server is bounded by the per-address caps (everything here
        // comes from 127.0.0.1), whatever the flood's size.
        let bound = defaults.max_handshakes_per_peer + defaults.max_connections_per_peer;
        let deadline = Instant::now() + Duration::from_secs(20);
        while server.server().connection_count() > bound {
            assert!(
                Instant::now() < deadline,
                "the server holds {} connections (bound {bound})",
                server.server().connection_count()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        drop((silent, idle));
    });
}

#[test]
fn a_flood_of_silent_and_idle_connections_does_not_stop_a_workload() {
    flood_beside_a_workload(None);
}

#[test]
fn a_flood_of_silent_and_idle_connections_does_not_stop_a_workload_with_a_token() {
    flood_beside_a_workload(Some("cluster secret"));
}

/// A TCP connection to `to` from the loopback address `from` (all of 127/8 is loopback on Linux).
fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None)?;
    bind(&fd, &SocketAddr::new(IpAddr::V4(from), 0))?;
    connect(&fd, &to)?;
    Ok(TcpStream::from(fd))
}

fn read_request(id: u64, region: u64, length: u64) -> Vec<u8> {
    let mut out = b"UMBP".to_vec();
    out.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    out.extend_from_slice(&[1, 0]);
    for v in [id, region, 0, length] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

#[test]
fn a_flood_from_one_address_displaces_only_its_own_connections() {
    if let Err(reason) = raise_open_files(2048) {
        println!("skipped: {reason}");
        return;
    }
    let (attacker, victim) = (Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3));
    let mut remote = HostBuf::with_pattern(4096, 21);
    let config = DataServerConfig {
        max_connections: 16,
        max_connections_per_peer: 4,
        max_handshakes: 16,
        max_handshakes_per_peer: 4,
        // Generous: the victim's half-sent hello must outlive the flood on a loaded machine.
        handshake_timeout: Duration::from_secs(10),
        ..fast_config().server
    };
    let server = TcpEngine::new(TcpEngineConfig { server: config, ..fast_config() }).expect("server");
    let region = remote.register(&server).remote().expect("remote").region_id;
    let addr = server.server().local_addr();
    let hello = hello_bytes("");
    let Ok(mut kept) = connect_from(victim, addr) else {
        println!("skipped: cannot bind 127.0.0.3 as a source address here");
        return;
    };
    // The victim: one idle authenticated connection, and one handshake half sent.
    kept.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    kept.write_all(&hello).expect("hello");
    let mut answer = [0u8; 8];
    kept.read_exact(&mut answer).expect("answer");
    assert_eq!(answer[6], 0);
    let mut slow = connect_from(victim, addr).expect("victim connect");
    slow.write_all(&hello[..4]).expect("half a hello");

    // The attacker: a hundred idle handshakes and a hundred silent sockets.
    let mut flood = Vec::new();
    for _ in 0..100 {
        let mut c = connect_from(attacker, addr).expect("attacker connect");
        let _ = c.write_all(&hello);
        flood.push(c);
    }
    for _ in 0..100 {
        flood.push(connect_from(attacker, addr).expect("attacker connect"));
    }

    // A new peer from a third address still gets in (a real engine, from 127.0.0.1).
    let mut local = HostBuf::zeroed(4096);
    let client = TcpEngine::new(fast_config()).expect("client");
    let local_ref = local.register(&client);
    let target = TransferRef::remote_only(
        umbp_core::RemoteRegion { endpoint: server.endpoint().to_owned(), region_id: region },
        4096,
        MemoryLocation::Host,
    );
    transfer(&client, &[item(&target, 0, &local_ref, 0, 4096, 1)]).expect("a new peer gets in beside the flood");
    assert_eq!(local.bytes(), remote.bytes());

    // The victim's connections were not displaced: the idle one still serves, the slow
    // handshake completes.
    kept.write_all(&read_request(7, region, 16)).expect("request on the kept connection");
    let mut reply = [0u8; 24 + 16];
    kept.read_exact(&mut reply).expect("the victim's idle connection still serves");
    assert_eq!((reply[6], &reply[24..]), (0, &remote.bytes()[..16]));
    slow.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    slow.write_all(&hello[4..]).expect("rest of the hello");
    slow.read_exact(&mut answer).expect("the victim's slow handshake is answered");
    assert_eq!(answer[6], 0, "OK");
    // The attacker holds no more than its per-address caps (an evicted connection's thread may
    // still be on its way out: poll).
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.server().connection_count() > 4 + 4 + 2 + 1 {
        assert!(Instant::now() < deadline, "{} connections held", server.server().connection_count());
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(flood);
}
