//! A focused latency probe (ignored by default; run it in release): single keyed gets of 64 KiB and
//! 1 MiB (and single keyed puts) from a holder in **another process** on this host, over the TCP exchange
//! (`KeyedClient::get`) and over the shared-memory answer (`KeyedClient::get_shared`), in
//! alternating blocks so a change in the machine's load reaches both paths alike; prints p50 / p99.
//!
//! ```text
//! cargo test --release -p umbp-transfer --test keyed_shm_latency -- --ignored --nocapture
//! KEYED_LATENCY_CALLS=5000 cargo test --release …   # calls per path and size (default 2000)
//! ```

use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar};
use umbp_transfer::shm::{ShmServer, ShmServerConfig};
use umbp_transfer::{
    DataServer, DataServerConfig, KeyedClient, KeyedClientConfig, KeyedGet, KeyedHandler, KeyedLease, KeyedPut,
    KeyedRange, KeyedRead, KeyedSlot, KeyedWrite,
};

const CHILD: &str = "KEYED_LATENCY_CHILD";
const TOKEN: &str = "latency-token";
const SIZES: [usize; 2] = [64 << 10, 1 << 20];
const BLOCKS: usize = 10;

/// Serves key `"<size>"` for every size in [`SIZES`], from one sealed memory file.
struct Values {
    region_id: u64,
}

impl KeyedHandler for Values {
    fn open_read(&self, key: &str) -> KeyedRead {
        let until = Instant::now() + Duration::from_secs(5);
        match key.parse::<u64>() {
            Ok(size) if SIZES.contains(&(size as usize)) => KeyedRead::Hit {
                size,
                ranges: vec![KeyedRange { region_id: self.region_id, offset: 0, len: size }],
                lease: KeyedLease { id: 0, backend_id: 0, until },
                crc32c: None,
            },
            _ => KeyedRead::Miss,
        }
    }
    fn close_read(&self, _key: &str, _lease: KeyedLease) {}
    /// Every put gets the same slot (at 2 MiB): the probe never reads puts back.
    fn open_write(&self, _key: &str, _tier: u64, size: u64) -> KeyedWrite {
        KeyedWrite::Slot {
            ranges: vec![KeyedRange { region_id: self.region_id, offset: 2 << 20, len: size }],
            slot: KeyedSlot { id: 1, backend_id: 0, until: Instant::now() + Duration::from_secs(5) },
        }
    }
    fn close_write(&self, _key: &str, _slot: KeyedSlot, received: bool, _crc32c: Option<u32>) -> bool {
        received
    }
}

/// The holder's side: runs only when this binary was started as the child.
#[test]
fn child_entry() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let len = 4 << 20;
    let fd: OwnedFd =
        rustix::fs::memfd_create("latency", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
    rustix::fs::ftruncate(&fd, len as u64).expect("size");
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).expect("seal");
    // SAFETY: a fresh shared mapping of the whole file, kept for the process's life.
    let base =
        unsafe { rustix::mm::mmap(ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0) }
            .expect("mmap");
    // SAFETY: the live mapping of `len` bytes, only written here, before anyone reads it.
    unsafe { std::slice::from_raw_parts_mut(base.cast::<u8>(), len) }.iter_mut().enumerate().for_each(|(i, b)| {
        *b = (i % 251) as u8;
    });
    let srv = DataServer::start(DataServerConfig { cluster_token: Some(TOKEN.into()), ..DataServerConfig::default() })
        .expect("server");
    // SAFETY: the mapping lives as long as this process.
    let region =
        unsafe { LocalRegion::new(NonNull::new(base.cast()).expect("mapped"), len as u64, MemoryLocation::Host) };
    let region_id = srv.register_memory(region).expect("registered").remote().expect("remote").region_id;
    srv.set_keyed_handler(Some(Arc::new(Values { region_id })));
    let shm = ShmServer::start(ShmServerConfig::new(srv.endpoint(), TOKEN)).expect("shm server");
    shm.register(region_id, fd.as_fd(), 0, len as u64).expect("shared");
    println!("@@ READY {}", srv.endpoint());
    // Serve until the parent closes our stdin.
    let _ = std::io::stdin().lock().lines().count();
}

struct Holder(Child);

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

#[test]
#[ignore = "a latency probe: run it by hand, in release"]
fn keyed_get_latency_over_tcp_and_shared_memory() {
    let calls: usize = std::env::var("KEYED_LATENCY_CALLS").ok().and_then(|v| v.parse().ok()).unwrap_or(2000);
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the holder");
    let stdout = child.stdout.take().expect("stdout");
    let holder = Holder(child);
    let endpoint = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.split_once("@@ READY ").map(|(_, e)| e.trim().to_owned()))
        .expect("the holder is ready");
    let client =
        KeyedClient::new(KeyedClientConfig { cluster_token: Some(TOKEN.into()), ..KeyedClientConfig::default() })
            .expect("client");
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load before: {}", load.trim());
    for size in SIZES {
        let key = size.to_string();
        let mut buf = vec![0u8; size];
        let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
        let mut times = [Vec::with_capacity(calls), Vec::with_capacity(calls)];
        let one = |shared: bool| {
            let t = Instant::now();
            // SAFETY: `buf` outlives the call and nothing else touches it meanwhile.
            let got = unsafe {
                if shared {
                    client.get_shared(&endpoint, &key, ptr, size)
                } else {
                    client.get(&endpoint, &key, ptr, size)
                }
            };
            assert_eq!(got.expect("an answer"), KeyedGet::Hit { size: size as u64, crc32c: None });
            t.elapsed()
        };
        for shared in [false, true] {
            for _ in 0..20 {
                one(shared);
            }
        }
        for block in 0..2 * BLOCKS {
            let shared = block % 2 == 1;
            for _ in 0..calls / BLOCKS {
                times[usize::from(shared)].push(one(shared));
            }
        }
        assert!(buf.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8), "byte-exact");
        let put = |shared: bool| {
            let t = Instant::now();
            let done = if shared {
                client.put_shared(&endpoint, &key, 1, &buf, None)
            } else {
                client.put(&endpoint, &key, 1, &buf, None)
            };
            assert_eq!(done.expect("an answer"), KeyedPut::Written);
            t.elapsed()
        };
        let mut put_times = [Vec::with_capacity(calls), Vec::with_capacity(calls)];
        for shared in [false, true] {
            for _ in 0..20 {
                put(shared);
            }
        }
        for block in 0..2 * BLOCKS {
            let shared = block % 2 == 1;
            for _ in 0..calls / BLOCKS {
                put_times[usize::from(shared)].push(put(shared));
            }
        }
        for (path, t) in ["tcp", "shared"].iter().zip(&mut times) {
            t.sort();
            println!(
                "keyed get {:>5} KiB over {path:<6}: p50 {:>8.1} us  p99 {:>8.1} us  ({} calls)",
                size >> 10,
                percentile(t, 0.5),
                percentile(t, 0.99),
                t.len()
            );
        }
        for (path, t) in ["tcp", "shared"].iter().zip(&mut put_times) {
            t.sort();
            println!(
                "keyed put {:>5} KiB over {path:<6}: p50 {:>8.1} us  p99 {:>8.1} us  ({} calls)",
                size >> 10,
                percentile(t, 0.5),
                percentile(t, 0.99),
                t.len()
            );
        }
    }
    assert!(client.shared_copies().0 >= calls as u64, "the shared path was taken");
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load after: {}", load.trim());
    drop(holder);
}
