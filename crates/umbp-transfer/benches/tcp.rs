//! `TcpEngine` throughput between two processes on 127.0.0.1, beside a plain-socket baseline
//! measured in the same run.
//!
//! The parent re-executes this binary as the server child (`UMBP_TCP_BENCH_CHILD=1`). The child runs
//! a `TcpEngine` with one registered region of `TOTAL` bytes, and a trivial raw sink/source: per
//! connection, `W <len>` makes it `read_exact` `len` bytes into a buffer and answer one byte, `R
//! <len>` makes it `write_all` `len` bytes. For each item size the parent moves `TOTAL` bytes per
//! round as `TOTAL / item` items (remote offsets reversed so nothing coalesces), through the engine
//! over `connections` pooled connections, and as the same bytes streamed over the same number of
//! plain connections. Medians of `UMBP_BENCH_ROUNDS` rounds (default 5).
//!
//! Each size runs with three local sides: the buffer registered with the engine, the same buffer
//! unregistered (a caller's buffer, used in place), and the unregistered buffer through a
//! `CompositeTransferEngine` over `LocalCopyEngine` + `TcpEngine` (what a node's client runs).
//!
//! `cargo bench -p umbp-transfer --bench tcp` (extra arguments such as `--bench` are ignored).
//! Environment: `UMBP_BENCH_ROUNDS`, `UMBP_BENCH_ITEM_KIB` (e.g. `64,1024`), `UMBP_BENCH_CONNECTIONS` (default 4), `UMBP_BENCH_TOTAL_MIB`
//! (default 256).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use std::sync::Arc;

use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, RemoteRegion, TransferRef};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, LocalCopyEngine, TcpEngine, TcpEngineConfig, TransferEngine,
    TransferItem, transfer,
};

const CHILD_ENV: &str = "UMBP_TCP_BENCH_CHILD";
const ITEM_SIZES: [u64; 3] = [64 << 10, 1 << 20, 4 << 20];

/// The item sizes to run: `UMBP_BENCH_ITEM_KIB` (comma-separated KiB) or [`ITEM_SIZES`].
fn item_sizes() -> Vec<u64> {
    match std::env::var("UMBP_BENCH_ITEM_KIB") {
        Ok(list) => list.split(',').filter_map(|s| s.trim().parse::<u64>().ok()).map(|k| k << 10).collect(),
        Err(_) => ITEM_SIZES.to_vec(),
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn total_bytes() -> u64 {
    env_or("UMBP_BENCH_TOTAL_MIB", 256) << 20
}

fn main() {
    if std::env::var(CHILD_ENV).as_deref() == Ok("1") {
        child();
    } else {
        parent();
    }
}

/// A page-touched heap buffer, registered as a host region.
struct Buffer {
    data: Vec<u8>,
}

impl Buffer {
    fn new(len: usize, seed: u8) -> Self {
        let data = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        Self { data }
    }

    fn region(&mut self) -> LocalRegion {
        let ptr = NonNull::new(self.data.as_mut_ptr()).expect("non-null");
        // SAFETY: the buffer outlives the engine it is registered with (declared before it).
        unsafe { LocalRegion::new(ptr, self.data.len() as u64, MemoryLocation::Host) }
    }
}

fn child() {
    let total = total_bytes() as usize;
    let mut region = Buffer::new(total, 1);
    let engine = TcpEngine::new(TcpEngineConfig::default()).expect("child engine");
    let r = engine.register_memory(region.region()).expect("register");
    let raw = TcpListener::bind("127.0.0.1:0").expect("raw listener");
    println!(
        "BENCH_CHILD {} {} {} {}",
        engine.endpoint(),
        r.remote().expect("remote").region_id,
        total,
        raw.local_addr().expect("addr")
    );
    std::io::stdout().flush().expect("flush");
    std::thread::spawn(move || {
        for stream in raw.incoming().map_while(Result::ok) {
            std::thread::spawn(move || raw_serve(stream));
        }
    });
    // Serve until the parent closes our stdin (or a generous deadline passes).
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(300));
        std::process::exit(3);
    });
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(engine);
}

/// The raw baseline's server side: a sink for `W`, a source for `R`.
fn raw_serve(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let mut buf: Vec<u8> = Vec::new();
    loop {
        let mut head = [0u8; 9];
        if s.read_exact(&mut head).is_err() {
            return;
        }
        let len = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes")) as usize;
        if buf.len() < len {
            buf = vec![7u8; len];
        }
        let ok = match head[0] {
            b'W' => s.read_exact(&mut buf[..len]).and_then(|()| s.write_all(&[1])),
            b'R' => s.write_all(&buf[..len]),
            _ => return,
        };
        if ok.is_err() {
            return;
        }
    }
}

struct ChildProcess(std::process::Child);

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.0.stdin.take();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn human(size: u64) -> String {
    if size >= 1 << 20 { format!("{} MiB", size >> 20) } else { format!("{} KiB", size >> 10) }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Streams `total` bytes over `conns` plain connections (each its share of `buf`), both ways.
fn raw_round(conns: &mut [TcpStream], buf: &mut [u8], write: bool) -> Duration {
    let share = buf.len() / conns.len();
    let started = Instant::now();
    std::thread::scope(|scope| {
        for (s, chunk) in conns.iter_mut().zip(buf.chunks_mut(share)) {
            scope.spawn(move || {
                let mut head = [0u8; 9];
                head[0] = if write { b'W' } else { b'R' };
                head[1..].copy_from_slice(&(chunk.len() as u64).to_le_bytes());
                s.write_all(&head).expect("raw header");
                if write {
                    s.write_all(chunk).expect("raw write");
                    let mut ack = [0u8; 1];
                    s.read_exact(&mut ack).expect("raw ack");
                } else {
                    s.read_exact(chunk).expect("raw read");
                }
            });
        }
    });
    started.elapsed()
}

fn parent() {
    let rounds = env_or("UMBP_BENCH_ROUNDS", 5).max(1) as usize;
    let connections = env_or("UMBP_BENCH_CONNECTIONS", 4).max(1) as usize;
    let total = total_bytes();

    let mut child = ChildProcess(
        Command::new(std::env::current_exe().expect("bench binary"))
            .env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the server child"),
    );
    let stdout = child.0.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("child line");
    let f: Vec<&str> = line.split_whitespace().collect();
    assert!(f.len() == 5 && f[0] == "BENCH_CHILD", "child said {line:?}");
    let remote = TransferRef::remote_only(
        RemoteRegion { endpoint: f[1].to_owned(), region_id: f[2].parse().expect("id") },
        f[3].parse().expect("size"),
        MemoryLocation::Host,
    );
    let raw_addr = f[4].to_owned();

    let mut local = Buffer::new(total as usize, 2);
    let mut raw_buf = Buffer::new(total as usize, 3);
    let config = TcpEngineConfig { connections_per_peer: connections, ..TcpEngineConfig::default() };
    let engine = TcpEngine::new(config.clone()).expect("engine");
    let local_ref = engine.register_memory(local.region()).expect("register");
    let loose_ref = TransferRef::local(local.region());
    let composite = CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), Arc::new(TcpEngine::new(config).expect("engine"))],
        CompositeConfig::default(),
    )
    .expect("composite");
    let mut raw: Vec<TcpStream> = (0..connections)
        .map(|_| {
            let s = TcpStream::connect(&raw_addr).expect("raw connect");
            s.set_nodelay(true).expect("nodelay");
            s
        })
        .collect();

    let expected = local.data.clone();
    println!(
        "TcpEngine vs raw TCP, 127.0.0.1, two processes, {} MiB per round, median of {rounds} rounds",
        total >> 20
    );
    println!();
    println!("| op | item | local side | connections | TcpEngine GB/s | raw TCP GB/s | ratio |");
    println!("|----|------|------------|-------------|----------------|--------------|-------|");
    let variants: [(&str, &dyn TransferEngine, &TransferRef); 3] = [
        ("registered", &engine, &local_ref),
        ("unregistered", &engine, &loose_ref),
        ("unregistered, composite", &composite, &loose_ref),
    ];
    for size in item_sizes() {
        for (side, engine, local_ref) in variants {
            run_size(engine, local_ref, &remote, size, side, &mut raw, &mut raw_buf, rounds, connections);
        }
        assert!(local.data == expected, "a write then read of the same items returns the same bytes");
    }
    drop(composite);
    drop(engine);
    drop(child);
}

/// One table row per direction: `size`-byte items between `local_ref` and `remote` through `engine`,
/// beside the raw stream.
#[expect(clippy::too_many_arguments, reason = "a bench helper: the row's inputs, spelled out")]
fn run_size(
    engine: &dyn TransferEngine,
    local_ref: &TransferRef,
    remote: &TransferRef,
    size: u64,
    side: &str,
    raw: &mut [TcpStream],
    raw_buf: &mut Buffer,
    rounds: usize,
    connections: usize,
) {
    let total = local_ref.size();
    let n = total / size;
    let writes: Vec<TransferItem> = (0..n)
        .map(|i| TransferItem {
            src: local_ref.clone(),
            src_offset: i * size,
            dst: remote.clone(),
            dst_offset: (n - 1 - i) * size,
            size,
            tag: i,
        })
        .collect();
    let reads: Vec<TransferItem> = writes
        .iter()
        .map(|w| TransferItem {
            src: w.dst.clone(),
            src_offset: w.dst_offset,
            dst: w.src.clone(),
            dst_offset: w.src_offset,
            size,
            tag: w.tag,
        })
        .collect();
    for (op, items, write) in [("write", &writes, true), ("read", &reads, false)] {
        // Warm up both paths once.
        transfer(engine, items).expect("engine warm-up");
        raw_round(raw, &mut raw_buf.data, write);
        let mut ours = Vec::new();
        let mut base = Vec::new();
        for _ in 0..rounds {
            let started = Instant::now();
            transfer(engine, items).expect("engine transfer");
            ours.push(gbps(total, started.elapsed()));
            base.push(gbps(total, raw_round(raw, &mut raw_buf.data, write)));
        }
        let (ours, base) = (median(ours), median(base));
        println!("| {op} | {} | {side} | {connections} | {ours:.2} | {base:.2} | {:.2} |", human(size), ours / base);
    }
}
