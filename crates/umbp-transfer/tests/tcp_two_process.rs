//! `TcpEngine` against a data server in another process.
//!
//! The child is this test binary re-executed to run only [`child_server`] with `UMBP_TCP_CHILD=1`:
//! it registers two regions filled with a known pattern, prints
//! `UMBP_CHILD <endpoint> <main id> <main size> <doomed id> <doomed size>` and serves until its stdin
//! closes (or a deadline passes). `dereg` on its stdin deregisters the doomed region. Every child
//! is killed and reaped by a guard, whatever the test does.

pub mod tcp_support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use tcp_support::{HostBuf, fast_config, item, pattern};
use umbp_core::{MemoryLocation, MemoryRegistrar, RemoteRegion, TransferRef};
use umbp_transfer::{
    DataServerConfig, FailureKind, TcpEngine, TcpEngineConfig, TransferEngine, TransferFailure, failed_tags, transfer,
};

const CHILD_ENV: &str = "UMBP_TCP_CHILD";
const TOKEN_ENV: &str = "UMBP_TCP_CHILD_TOKEN";
/// The child's soft open-file limit, when set.
const NOFILE_ENV: &str = "UMBP_TCP_CHILD_NOFILE";
const MAIN_SIZE: usize = 64 << 20;
const MAIN_SEED: u64 = 42;
const DOOMED_SIZE: usize = 1 << 20;
const DOOMED_SEED: u64 = 43;
/// A child never outlives this, even if the parent forgets it.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);

/// The server side. A no-op unless this process is a child spawned by [`Child::spawn`].
#[test]
fn child_server() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("1") {
        return;
    }
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_DEADLINE);
        std::process::exit(3);
    });
    if let Some(limit) = std::env::var(NOFILE_ENV).ok().and_then(|v| v.parse::<u64>().ok()) {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let hard = getrlimit(Resource::Nofile).maximum;
        setrlimit(Resource::Nofile, Rlimit { current: Some(limit), maximum: hard }).expect("lower RLIMIT_NOFILE");
    }
    // Buffers first: locals drop in reverse order, so the engine stops before they are freed.
    let mut main = HostBuf::with_pattern(MAIN_SIZE, MAIN_SEED);
    let mut doomed = HostBuf::with_pattern(DOOMED_SIZE, DOOMED_SEED);
    let server = DataServerConfig { io_timeout: Duration::from_secs(5), ..Default::default() };
    let engine =
        TcpEngine::new(TcpEngineConfig { server, cluster_token: std::env::var(TOKEN_ENV).ok(), ..Default::default() })
            .expect("child engine");
    let main_ref = main.register(&engine);
    let doomed_ref = doomed.register(&engine);
    let id = |r: &TransferRef| r.remote().expect("registered").region_id;
    println!("UMBP_CHILD {} {} {MAIN_SIZE} {} {DOOMED_SIZE}", engine.endpoint(), id(&main_ref), id(&doomed_ref));
    std::io::stdout().flush().expect("flush");
    for line in std::io::stdin().lock().lines() {
        match line.as_deref().map(str::trim) {
            Ok("dereg") => {
                engine.deregister(&doomed_ref);
                println!("UMBP_CHILD_DEREGISTERED");
                std::io::stdout().flush().expect("flush");
            }
            Ok("quit") | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// A running child server; killed and reaped on drop.
struct Child {
    process: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: Receiver<String>,
    endpoint: String,
    main: TransferRef,
    doomed: TransferRef,
}

impl Child {
    fn spawn(token: Option<&str>) -> Self {
        Self::spawn_with(token, None)
    }

    /// A child whose soft open-file limit is `nofile` (when given).
    fn spawn_with(token: Option<&str>, nofile: Option<u64>) -> Self {
        let mut command = Command::new(std::env::current_exe().expect("test binary"));
        command
            .args(["--exact", "child_server", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        match token {
            Some(t) => command.env(TOKEN_ENV, t),
            None => command.env_remove(TOKEN_ENV),
        };
        match nofile {
            Some(n) => command.env(NOFILE_ENV, n.to_string()),
            None => command.env_remove(NOFILE_ENV),
        };
        let mut process = command.spawn().expect("spawn the child");
        let stdout = process.stdout.take().expect("piped stdout");
        let stdin = process.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut child = Self {
            process,
            stdin,
            lines,
            endpoint: String::new(),
            main: TransferRef::remote_only(
                RemoteRegion { endpoint: String::new(), region_id: 0 },
                0,
                MemoryLocation::Host,
            ),
            doomed: TransferRef::remote_only(
                RemoteRegion { endpoint: String::new(), region_id: 0 },
                0,
                MemoryLocation::Host,
            ),
        };
        let ready = child.expect_line("UMBP_CHILD ");
        let f: Vec<&str> = ready.split_whitespace().collect();
        assert_eq!(f.len(), 6, "child said {ready:?}");
        let num = |s: &str| s.parse::<u64>().expect("number");
        child.endpoint = f[1].to_owned();
        let remote = |id: u64, size: u64| {
            TransferRef::remote_only(
                RemoteRegion { endpoint: f[1].to_owned(), region_id: id },
                size,
                MemoryLocation::Host,
            )
        };
        child.main = remote(num(f[2]), num(f[3]));
        child.doomed = remote(num(f[4]), num(f[5]));
        child
    }

    /// Waits (bounded) for `prefix` on the child's stdout and returns the rest of that line from
    /// `prefix` on (libtest may print its own words before it on the same line).
    fn expect_line(&self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(at) = line.find(prefix) {
                        return line[at..].to_owned();
                    }
                }
                Err(e) => panic!("child never printed {prefix:?}: {e}"),
            }
        }
    }

    fn command(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("child stdin");
        writeln!(stdin, "{line}").expect("write to child");
        stdin.flush().expect("flush");
    }

    /// A remote ref into the child's main region that claims `size` bytes.
    fn main_claiming(&self, size: u64) -> TransferRef {
        TransferRef::remote_only(self.main.remote().expect("remote").clone(), size, MemoryLocation::Host)
    }

    fn kill(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stdin.take();
        self.kill();
    }
}

fn parent_engine(token: Option<&str>) -> TcpEngine {
    TcpEngine::new(TcpEngineConfig { cluster_token: token.map(str::to_owned), ..fast_config() }).expect("parent engine")
}

fn kinds(failures: &[TransferFailure]) -> Vec<FailureKind> {
    failures.iter().map(|f| f.kind).collect()
}

#[test]
fn two_process_round_trips_and_rejections() {
    let mut child = Child::spawn(None);
    let engine = parent_engine(None);
    let mut buf = HostBuf::zeroed(4 << 20);
    let local = buf.register(&engine);

    // The child's pattern arrives intact.
    transfer(&engine, &[item(&child.main, 1 << 20, &local, 0, 4 << 20, 1)]).expect("read the pattern");
    assert!(buf.bytes() == &pattern(MAIN_SIZE, MAIN_SEED)[1 << 20..5 << 20]);

    // Write something else and read it back through another buffer.
    let mut src = HostBuf::with_pattern(3 << 20, 7);
    let mut back = HostBuf::zeroed(3 << 20);
    let (src_ref, back_ref) = (src.register(&engine), back.register(&engine));
    let writes: Vec<_> =
        (0..3u64).map(|i| item(&src_ref, i << 20, &child.main, (10 + 2 * i) << 20, 1 << 20, i)).collect();
    transfer(&engine, &writes).expect("write");
    let reads: Vec<_> =
        (0..3u64).map(|i| item(&child.main, (10 + 2 * i) << 20, &back_ref, i << 20, 1 << 20, i)).collect();
    transfer(&engine, &reads).expect("read back");
    assert!(back.bytes() == src.bytes());

    // Out of bounds: the ref claims more than the region has. (Another local buffer for the good
    // item, so it is a plan of its own: a plan fails as a whole.)
    let lying = child.main_claiming(MAIN_SIZE as u64 + (1 << 20));
    let failures = transfer(
        &engine,
        &[item(&src_ref, 0, &lying, MAIN_SIZE as u64, 4096, 10), item(&back_ref, 0, &child.main, 0, 4096, 11)],
    )
    .expect_err("out of range");
    assert_eq!(kinds(&failures), vec![FailureKind::OutOfRange]);
    assert_eq!(failed_tags(&failures), vec![10]);
    assert_eq!(failures[0].endpoint, child.endpoint);
    let failures = transfer(&engine, &[item(&lying, MAIN_SIZE as u64 - 1, &back_ref, 0, 2, 12)]).expect_err("oob read");
    assert_eq!(kinds(&failures), vec![FailureKind::OutOfRange]);

    // Unknown region.
    let unknown = TransferRef::remote_only(
        RemoteRegion { endpoint: child.endpoint.clone(), region_id: 123_456 },
        4096,
        MemoryLocation::Host,
    );
    let failures = transfer(&engine, &[item(&src_ref, 0, &unknown, 0, 4096, 13)]).expect_err("unknown");
    assert_eq!(kinds(&failures), vec![FailureKind::UnknownRegion]);

    // Deregistered region: readable before, refused after.
    transfer(&engine, &[item(&child.doomed, 0, &back_ref, 0, 4096, 14)]).expect("doomed is live");
    assert_eq!(&back.bytes()[..4096], &pattern(DOOMED_SIZE, DOOMED_SEED)[..4096]);
    child.command("dereg");
    child.expect_line("UMBP_CHILD_DEREGISTERED");
    let failures = transfer(
        &engine,
        &[item(&child.doomed, 0, &back_ref, 0, 4096, 15), item(&src_ref, 0, &child.doomed, 0, 4096, 16)],
    )
    .expect_err("deregistered");
    assert_eq!(kinds(&failures), vec![FailureKind::UnknownRegion, FailureKind::UnknownRegion]);

    // The main region still works on the same connections.
    transfer(&engine, &reads).expect("still serving");
    assert!(back.bytes() == src.bytes());
}

#[test]
fn wrong_token_is_refused() {
    let child = Child::spawn(Some("s3cret"));
    for token in [Some("wrong"), None] {
        let engine = parent_engine(token);
        let mut buf = HostBuf::zeroed(4096);
        let local = buf.register(&engine);
        let failures = transfer(&engine, &[item(&child.main, 0, &local, 0, 4096, 1)]).expect_err("refused");
        assert_eq!(kinds(&failures), vec![FailureKind::Unauthorized], "token {token:?}");
        assert_eq!(failures[0].endpoint, child.endpoint);
    }
    let engine = parent_engine(Some("s3cret"));
    let mut buf = HostBuf::zeroed(4096);
    let local = buf.register(&engine);
    transfer(&engine, &[item(&child.main, 0, &local, 0, 4096, 1)]).expect("right token");
    assert_eq!(buf.bytes(), &pattern(MAIN_SIZE, MAIN_SEED)[..4096]);
}

/// Connects, optionally completes the handshake, sends `bytes`, and reports whether the server
/// closed the connection within a few seconds.
fn server_closes_after(endpoint: &str, handshake: bool, bytes: &[u8]) -> bool {
    let mut s = TcpStream::connect(endpoint).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    if handshake {
        let mut hello = b"UMBP".to_vec();
        hello.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
        hello.extend_from_slice(&0u16.to_le_bytes());
        s.write_all(&hello).expect("hello");
        let mut answer = [0u8; 8];
        s.read_exact(&mut answer).expect("answer");
        assert_eq!(answer[6], 0, "handshake accepted");
    }
    let _ = s.write_all(bytes);
    let mut sink = [0u8; 64];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => return !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
        }
    }
}

fn frame(magic: &[u8; 4], version: u16, op: u8, length: u64) -> Vec<u8> {
    let mut f = magic.to_vec();
    f.extend_from_slice(&version.to_le_bytes());
    f.push(op);
    f.push(0);
    for v in [1u64, 1, 0, length] {
        f.extend_from_slice(&v.to_le_bytes());
    }
    f
}

#[test]
fn garbage_clients_do_not_disturb_a_well_formed_one() {
    let child = Child::spawn(None);
    let engine = parent_engine(None);
    let mut src = HostBuf::with_pattern(1 << 20, 21);
    let mut back = HostBuf::zeroed(1 << 20);
    let (src_ref, back_ref) = (src.register(&engine), back.register(&engine));

    let endpoint = child.endpoint.clone();
    let garbage = std::thread::spawn(move || {
        let mut closed = Vec::new();
        for round in 0..3 {
            closed.push(server_closes_after(&endpoint, false, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
            closed.push(server_closes_after(&endpoint, false, &pattern(4096, round)));
            closed.push(server_closes_after(&endpoint, true, &frame(b"JUNK", 1, 1, 16)));
            closed.push(server_closes_after(&endpoint, true, &frame(b"UMBP", 9, 1, 16)));
            closed.push(server_closes_after(&endpoint, true, &frame(b"UMBP", 1, 7, 16)));
            closed.push(server_closes_after(&endpoint, true, &frame(b"UMBP", 1, 2, u64::MAX)));
        }
        closed
    });
    for round in 0..20u64 {
        let off = (round % 8) << 20;
        transfer(&engine, &[item(&src_ref, 0, &child.main, off, 1 << 20, round)]).expect("write");
        transfer(&engine, &[item(&child.main, off, &back_ref, 0, 1 << 20, round)]).expect("read");
        assert!(back.bytes() == src.bytes());
    }
    let closed = garbage.join().expect("garbage thread");
    assert!(closed.iter().all(|&c| c), "the server closes every garbage connection: {closed:?}");
    // And keeps serving afterwards.
    transfer(&engine, &[item(&child.main, 32 << 20, &back_ref, 0, 1 << 20, 99)]).expect("read after garbage");
    assert!(back.bytes() == &pattern(MAIN_SIZE, MAIN_SEED)[32 << 20..33 << 20]);
}

#[test]
fn killing_the_server_mid_batch_fails_pending_items_promptly() {
    let mut child = Child::spawn(None);
    let engine = parent_engine(None);
    let mut bufs: Vec<HostBuf> = (0..4).map(|i| HostBuf::with_pattern(16 << 20, i)).collect();
    let refs: Vec<TransferRef> = bufs.iter_mut().map(|b| b.register(&engine)).collect();
    // Warm up: the pooled connections exist before the big batch.
    transfer(&engine, &[item(&refs[0], 0, &child.main, 0, 16 << 20, 0)]).expect("warm up");

    // 1 GiB of writes: 256 items of 4 MiB (four plans, one per local buffer).
    let items: Vec<_> = (0..256u64)
        .map(|i| {
            let b = (i % 4) as usize;
            item(&refs[b], ((i / 4) % 4) << 22, &child.main, (i % 16) << 22, 4 << 20, i)
        })
        .collect();
    let set = engine.plan(&items);
    assert_eq!(set.plans.len(), 4);
    let mut handle = engine.submit(set.plans).expect("submitted");
    // Killed right away: 1 GiB cannot have crossed loopback yet (no sleep whose length a fast
    // machine could outrun).
    child.kill();
    let started = Instant::now();
    let failures = handle.wait();
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(4), "wait took {waited:?}");
    assert!(!failures.is_empty(), "the batch cannot have finished before the kill");
    for f in &failures {
        assert!(matches!(f.kind, FailureKind::ConnectionLost | FailureKind::Timeout), "{f:?}");
        assert_eq!(f.endpoint, child.endpoint);
    }

    // Later submits fail fast too (nothing listens any more).
    let started = Instant::now();
    let failures = transfer(&engine, &[item(&refs[0], 0, &child.main, 0, 4096, 1)]).expect_err("server gone");
    assert_eq!(kinds(&failures), vec![FailureKind::ConnectionLost]);
    assert!(started.elapsed() < Duration::from_secs(4));
}

#[test]
fn killing_the_server_mid_read_batch_fails_pending_items_promptly_and_reports_them() {
    let mut child = Child::spawn(None);
    let engine = parent_engine(None);
    let mut bufs: Vec<HostBuf> = (0..4).map(|i| HostBuf::with_pattern(16 << 20, 100 + i)).collect();
    let refs: Vec<TransferRef> = bufs.iter_mut().map(|b| b.register(&engine)).collect();
    // Warm up: the pooled connections exist before the big batch.
    transfer(&engine, &[item(&child.main, 0, &refs[0], 0, 16 << 20, 0)]).expect("warm up read");

    // 1 GiB of reads: 256 items of 4 MiB from the child into the four local buffers.
    let items: Vec<_> = (0..256u64)
        .map(|i| {
            let b = (i % 4) as usize;
            item(&child.main, (i % 16) << 22, &refs[b], ((i / 4) % 4) << 22, 4 << 20, i)
        })
        .collect();
    let set = engine.plan(&items);
    let mut handle = engine.submit(set.plans).expect("submitted");
    // Killed right away: 1 GiB cannot have crossed loopback yet.
    child.kill();
    let started = Instant::now();
    let failures = handle.wait();
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(4), "wait took {waited:?}");
    assert!(!failures.is_empty(), "the batch cannot have finished before the kill");
    for f in &failures {
        assert!(matches!(f.kind, FailureKind::ConnectionLost | FailureKind::Timeout), "{f:?}");
        assert_eq!(f.endpoint, child.endpoint);
    }
    // Each failure names the items it failed, and only items of this batch.
    for f in &failures {
        assert!(!f.tags.is_empty(), "a failure without the items it failed: {f:?}");
        assert!(f.tags.iter().all(|t| *t < 256), "a tag outside the batch: {f:?}");
    }
}

#[test]
fn a_server_out_of_descriptors_still_takes_a_real_peer() {
    match umbp_transfer::raise_open_file_limit() {
        Ok(n) if n >= 4096 => {}
        other => {
            println!("skipped: this process cannot hold the flood's descriptors ({other:?})");
            return;
        }
    }
    // The child runs out of descriptors long before its caps (256 pending, 1024 served).
    let child = Child::spawn_with(None, Some(64));
    let addr: std::net::SocketAddr = child.endpoint.parse().expect("child address");
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // A steady flood of sockets that never say hello.
        let flood = s.spawn(|| {
            let mut held = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && held.len() < 3000 {
                if let Ok(c) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
                    held.push(c);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            held.len()
        });
        std::thread::sleep(Duration::from_millis(300));
        for round in 0..3u64 {
            // A new peer each round, so each needs a new connection.
            let engine = parent_engine(None);
            let mut buf = HostBuf::zeroed(1 << 20);
            let local = buf.register(&engine);
            let result = transfer(&engine, &[item(&child.main, round << 20, &local, 0, 1 << 20, round)]);
            if let Err(f) = result {
                stop.store(true, std::sync::atomic::Ordering::SeqCst);
                panic!("round {round}: a real peer was locked out: {f:?}");
            }
            let at = (round as usize) << 20;
            assert!(buf.bytes() == &pattern(MAIN_SIZE, MAIN_SEED)[at..at + (1 << 20)], "round {round}");
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(flood.join().expect("flood") > 100, "the flood ran");
    });
}
