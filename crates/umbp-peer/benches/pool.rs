//! Batch put and batch get through `PoolClient` (issue 5, deliverable 6), each beside its same-run
//! baseline:
//!
//! - **local**: a node writing to and reading from its own DRAM medium, against raw `memcpy` of the
//!   same bytes on one thread;
//! - **remote**: a client-only node in this process and a DRAM node in a CHILD PROCESS (this binary
//!   re-executed), bytes over the TCP data plane, against a plain socket stream of the same bytes to a
//!   sink / from a source in the same child over one connection per data-plane connection;
//! - the p50 / p99 latency of a single 64 KiB remote get.
//!
//! Run: `cargo bench -p umbp-peer --bench pool` (also `cargo xtask bench`). `UMBP_BENCH_ROUNDS`
//! (default 5) rounds per cell; medians.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umbp_master::MasterConfig;
use umbp_peer::pool_client::{DramConfig, Medium, PoolClient, PoolClientConfig, RecachePolicy};

const CHILD_ENV: &str = "UMBP_BENCH_POOL_CHILD";
const BATCH_BYTES: usize = 64 << 20;
const CONNECTIONS: usize = 4;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn node_config(id: &str, master: &str, medium: Medium) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, master).with_medium(medium);
    c.page_size = 64 << 10;
    c.recache = RecachePolicy::Off;
    c
}

fn dram(bytes: u64) -> Medium {
    Medium::Dram(DramConfig { capacity_bytes: bytes, prefault: true, ..DramConfig::default() })
}

/// The child: a DRAM node plus a raw TCP sink/source; prints its addresses, serves until stdin closes.
fn child(master: String) {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let node = PoolClient::start(node_config("bench-node", &master, dram(1 << 30))).await.expect("node");
        let raw = TcpListener::bind("127.0.0.1:0").expect("bind");
        let raw_addr = raw.local_addr().expect("addr");
        std::thread::spawn(move || {
            for stream in raw.incoming().flatten() {
                std::thread::spawn(move || raw_peer(stream));
            }
        });
        println!("ready raw={raw_addr}");
        // Serve until the parent closes stdin.
        tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        })
        .await
        .expect("stdin");
        node.close().await;
    });
}

/// One raw connection: a 9-byte header (b'w' or b'r' + u64 length) then that many bytes in or out.
fn raw_peer(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let mut buf = vec![0u8; 1 << 20];
    let mut header = [0u8; 9];
    while s.read_exact(&mut header).is_ok() {
        let mut left = u64::from_le_bytes(header[1..9].try_into().unwrap_or_default()) as usize;
        while left > 0 {
            let n = left.min(buf.len());
            let ok =
                if header[0] == b'w' { s.read_exact(&mut buf[..n]).is_ok() } else { s.write_all(&buf[..n]).is_ok() };
            if !ok {
                return;
            }
            left -= n;
        }
        if s.write_all(&[1]).is_err() {
            return;
        }
    }
}

/// GB/s of moving `total` bytes over `CONNECTIONS` raw streams (write = to the child, read = from it).
fn raw_rate(addr: &str, total: usize, write: bool) -> f64 {
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..CONNECTIONS {
            s.spawn(|| {
                let mut c = TcpStream::connect(addr).expect("connect raw");
                let _ = c.set_nodelay(true);
                let share = total / CONNECTIONS;
                let mut header = [0u8; 9];
                header[0] = if write { b'w' } else { b'r' };
                header[1..].copy_from_slice(&(share as u64).to_le_bytes());
                c.write_all(&header).expect("header");
                let mut buf = vec![7u8; 1 << 20];
                let mut left = share;
                while left > 0 {
                    let n = left.min(buf.len());
                    if write {
                        c.write_all(&buf[..n]).expect("write");
                    } else {
                        c.read_exact(&mut buf[..n]).expect("read");
                    }
                    left -= n;
                }
                let mut ack = [0u8; 1];
                c.read_exact(&mut ack).expect("ack");
            });
        }
    });
    total as f64 / start.elapsed().as_secs_f64() / 1e9
}

struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn main() {
    if let Ok(master) = std::env::var(CHILD_ENV) {
        child(master);
        return;
    }
    let rounds = env_or("UMBP_BENCH_ROUNDS", 5).max(1) as usize;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    rt.block_on(async move {
        let master = umbp_master::start(MasterConfig {
            listen: "127.0.0.1:0".parse().expect("addr"),
            ..MasterConfig::default()
        })
        .await
        .expect("master");
        let master_addr = master.local_addr().to_string();
        println!("PoolClient batch put/get, {} MiB per batch, medians of {rounds} rounds", BATCH_BYTES >> 20);
        println!();
        println!("| path | op | value | PoolClient GB/s | baseline GB/s | baseline | ratio |");
        println!("|---|---|---|---|---|---|---|");

        // Local: a node with its own medium, alone in the cluster, so every key routes to itself.
        let local = PoolClient::start(node_config("local", &master_addr, dram(1 << 30))).await.expect("local node");
        for value in [64usize << 10, 1 << 20] {
            let n = BATCH_BYTES / value;
            let data: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; value]).collect();
            let mut out: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
            let (mut put, mut get, mut copy) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..rounds {
                let keys: Vec<String> = (0..n).map(|i| format!("local-{value}-{round}-{i}")).collect();
                let items: Vec<(&str, &[u8])> =
                    keys.iter().zip(&data).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
                let t = Instant::now();
                assert!(local.batch_put(&items).await.iter().all(Result::is_ok), "local put");
                put.push(BATCH_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
                let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let mut slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
                let t = Instant::now();
                assert!(local.batch_get(&key_refs, &mut slices).await.iter().all(Result::is_ok), "local get");
                get.push(BATCH_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
                let t = Instant::now();
                for (d, s) in out.iter_mut().zip(&data) {
                    d.copy_from_slice(std::hint::black_box(s));
                }
                copy.push(BATCH_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
            }
            let (put, get, copy) = (median(put), median(get), median(copy));
            let label = if value >= 1 << 20 { "1 MiB".to_string() } else { format!("{} KiB", value >> 10) };
            println!("| local | put | {label} | {put:.2} | {copy:.2} | memcpy | {:.2} |", put / copy);
            println!("| local | get | {label} | {get:.2} | {copy:.2} | memcpy | {:.2} |", get / copy);
        }
        local.close().await;

        // Remote: a DRAM node in a child process; this process is a client-only node.
        let exe = std::env::current_exe().expect("exe");
        let mut child = Guard(
            Command::new(exe)
                .env(CHILD_ENV, &master_addr)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn node"),
        );
        let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
        let raw_addr = loop {
            let line = lines.next().expect("child output").expect("line");
            if let Some(addr) = line.strip_prefix("ready raw=") {
                break addr.to_owned();
            }
        };
        let client = PoolClient::start(node_config("bench-client", &master_addr, Medium::None)).await.expect("client");
        for value in [64usize << 10, 1 << 20] {
            let n = BATCH_BYTES / value;
            let data: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; value]).collect();
            let mut out: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
            let (mut put, mut get, mut raw_w, mut raw_r) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for round in 0..rounds {
                let keys: Vec<String> = (0..n).map(|i| format!("remote-{value}-{round}-{i}")).collect();
                let items: Vec<(&str, &[u8])> =
                    keys.iter().zip(&data).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
                let t = Instant::now();
                assert!(client.batch_put(&items).await.iter().all(Result::is_ok), "remote put");
                put.push(BATCH_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
                // Reads need the master to know the keys: ship the node's ADDs (auto-flush does it
                // every 128 events; wait for the index rather than guess).
                let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let owned: Vec<String> = keys.clone();
                let deadline = Instant::now() + Duration::from_secs(20);
                while !client.master().batch_lookup(&owned).await.expect("lookup").iter().all(|f| *f) {
                    assert!(Instant::now() < deadline, "keys never indexed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let mut slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
                let t = Instant::now();
                assert!(client.batch_get(&key_refs, &mut slices).await.iter().all(Result::is_ok), "remote get");
                get.push(BATCH_BYTES as f64 / t.elapsed().as_secs_f64() / 1e9);
                assert_eq!(out[n / 2], data[n / 2], "bytes survived the round trip");
                raw_w.push(tokio::task::block_in_place(|| raw_rate(&raw_addr, BATCH_BYTES, true)));
                raw_r.push(tokio::task::block_in_place(|| raw_rate(&raw_addr, BATCH_BYTES, false)));
                tokio::time::sleep(Duration::from_millis(600)).await; // read leases expire
                let _ = client.remove(&key_refs).await;
            }
            let (put, get, raw_w, raw_r) = (median(put), median(get), median(raw_w), median(raw_r));
            let label = if value >= 1 << 20 { "1 MiB".to_string() } else { format!("{} KiB", value >> 10) };
            println!(
                "| remote (2 processes) | put | {label} | {put:.2} | {raw_w:.2} | raw TCP x{CONNECTIONS} | {:.2} |",
                put / raw_w
            );
            println!(
                "| remote (2 processes) | get | {label} | {get:.2} | {raw_r:.2} | raw TCP x{CONNECTIONS} | {:.2} |",
                get / raw_r
            );
        }

        // Latency of a single 64 KiB remote get.
        let value = vec![5u8; 64 << 10];
        client.put("latency-key", &value).await.expect("put");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !client.exists("latency-key").await.expect("exists") {
            assert!(Instant::now() < deadline, "never indexed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut buf = vec![0u8; 64 << 10];
        let mut lat = Vec::new();
        for _ in 0..1000 {
            let t = Instant::now();
            client.get("latency-key", &mut buf).await.expect("get");
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(f64::total_cmp);
        println!();
        println!(
            "single 64 KiB remote get (route + resolve + TCP read), 1000 calls: p50 {:.0} µs, p99 {:.0} µs",
            lat[500], lat[990]
        );
        client.close().await;
        drop(child.0.stdin.take());
        drop(child);
        master.shutdown().await;
    });
}
