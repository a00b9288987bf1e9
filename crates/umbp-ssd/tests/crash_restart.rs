//! "Kill the node" restarts: the backend never gets its `shutdown` (no final tombstone flush, no
//! final `fdatasync`), and a new backend on the same files must still serve every acknowledged
//! value byte-exact (`docs/ssd.md`, "Durability": a process crash keeps every record whose commit
//! returned, unless a write reserved before it in its segment was still in flight).
//!
//! - `a_forgotten_backend_leaves_every_committed_value_recoverable`: the backend is
//!   `std::mem::forget`ten (its reaper thread keeps running, its lock stays held); the segment files
//!   as they stand — what a crashed process leaves to the kernel — are recovered in a copy.
//! - `a_sigkilled_writer_loses_no_acknowledged_value`: a child process (this test binary, re-run)
//!   writes values one after another and reports each acknowledged commit; it is SIGKILLed in the
//!   middle of its writes, and every value it reported comes back.
//!
//! Every other value is committed with the writer's CRC-32C of it, and every value comes back with
//! the checksum it was committed with (none for the rest).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend};
use umbp_ssd::{IoEngineKind, SsdBackend, SsdConfig};
use umbp_testkit::{LocalOnlyRegistrar, require};

const PAGE: u64 = 4096;
/// The child's environment: the directory to write in, and the engine.
const CHILD_DIR: &str = "UMBP_SSD_CRASH_CHILD_DIR";
const CHILD_ENGINE: &str = "UMBP_SSD_CRASH_CHILD_ENGINE";

fn engines() -> Vec<IoEngineKind> {
    match umbp_ssd::io_uring_available() {
        Ok(()) => vec![IoEngineKind::Psync, IoEngineKind::IoUring],
        Err(e) => {
            require::skip(
                require::IO_URING,
                format_args!("the io_uring variant: io_uring is not available here ({e})"),
            );
            vec![IoEngineKind::Psync]
        }
    }
}

fn config(dir: &Path, engine: IoEngineKind) -> SsdConfig {
    SsdConfig::builder([dir])
        .page_size(PAGE)
        .capacity_bytes(4096 * PAGE)
        .staging_pages(32)
        // Short leases: the read-back checks go through every key one after another.
        .read_lease_ttl(Duration::from_millis(10))
        .max_value_pages(2)
        .segment_bytes(256 * 1024)
        .watermarks(None)
        .io_engine(engine)
        .build()
        .expect("config")
}

fn live(config: SsdConfig) -> SsdBackend {
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b
}

fn value(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The length of value `i`: from one byte to just under two pages.
fn len_of(i: u64) -> usize {
    1 + (i as usize * 1777) % (2 * PAGE as usize - 1)
}

/// The writer's checksum value `i` is committed with: its CRC-32C for even `i`, none for odd.
fn crc_of(i: u64) -> Option<u32> {
    i.is_multiple_of(2).then(|| crc32c::crc32c(&value(i, len_of(i))))
}

/// Puts value `i` under `key`, with its checksum (see [`crc_of`]).
fn put_value(b: &SsdBackend, key: &str, i: u64) {
    put(b, key, &value(i, len_of(i)), crc_of(i));
}

fn arena(b: &SsdBackend) -> *mut u8 {
    let r = b.buffer_ref(0).expect("a live backend publishes its arena");
    r.local_region().expect("a local region").ptr().as_ptr()
}

fn put(b: &SsdBackend, key: &str, bytes: &[u8], crc32c: Option<u32>) {
    let a = b.batch_allocate(&[AllocateRequest::new(key, bytes.len() as u64)]).remove(0);
    assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {key}");
    for (chunk, page) in bytes.chunks(PAGE as usize).zip(&a.pages) {
        // SAFETY: the page is inside the registered arena and reserved for this slot.
        unsafe {
            std::ptr::copy_nonoverlapping(
                chunk.as_ptr(),
                arena(b).add((u64::from(page.page_index) * PAGE) as usize),
                chunk.len(),
            )
        };
    }
    let commit = CommitRequest::new(a.slot_id, key).with_crc32c(crc32c);
    assert!(b.batch_commit(&[commit])[0].success, "commit {key}");
}

/// `key`'s bytes and the writer's checksum it came back with.
fn get(b: &SsdBackend, key: &str) -> Option<(Vec<u8>, Option<u32>)> {
    let r = b.batch_resolve(&[key.to_owned()], false).remove(0);
    if !r.found {
        return None;
    }
    let mut out = Vec::with_capacity(r.size as usize);
    let mut left = r.size;
    for page in &r.pages {
        let n = left.min(PAGE);
        // SAFETY: the page is inside the arena and leased to this reader.
        out.extend_from_slice(unsafe {
            std::slice::from_raw_parts(arena(b).add((u64::from(page.page_index) * PAGE) as usize), n as usize)
        });
        left -= n;
    }
    Some((out, r.crc32c))
}

/// Reads `key` back and checks it against value `i` and its checksum, letting the read's lease go
/// first if the staging pages are all leased.
fn check(b: &SsdBackend, key: &str, i: u64, what: &str) {
    let want = value(i, len_of(i));
    let start = Instant::now();
    loop {
        match get(b, key) {
            Some((got, crc)) => {
                assert!(got == want, "{what}: {key} came back with other bytes");
                assert_eq!(crc, crc_of(i), "{what}: {key} came back with another checksum");
                return;
            }
            None if b.stats().staging_full_rejects > 0 && start.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(50));
                b.reaper_tick();
            }
            None => panic!("{what}: acknowledged {key} was not recovered ({:?})", b.stats()),
        }
    }
}

#[test]
fn a_forgotten_backend_leaves_every_committed_value_recoverable() {
    for engine in engines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let b = live(config(dir.path(), engine));
        let n = 60u64;
        for i in 0..n {
            put_value(&b, &format!("key-{i}"), i);
        }
        // Killed: no shutdown, no final sync, no flush. The reaper thread keeps running (it ends
        // with the test process) and the directory's lock stays held, as it would by a hung node.
        std::mem::forget(b);
        let second = SsdBackend::new(config(dir.path(), engine));
        assert!(second.init(Arc::new(LocalOnlyRegistrar::new())).is_err(), "{engine}: the directory is still locked");
        // What the dead process left in its files is what the kernel has: recover a copy of it.
        let copy = tempfile::tempdir().expect("tempdir");
        for entry in std::fs::read_dir(dir.path()).expect("read_dir") {
            let path = entry.expect("entry").path();
            if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("segment_")) {
                std::fs::copy(&path, copy.path().join(path.file_name().expect("name"))).expect("copy");
            }
        }
        let b = live(config(copy.path(), engine));
        assert_eq!(b.owned_key_count(), n as usize, "{engine}: every committed key recovered ({:?})", b.stats());
        for i in 0..n {
            check(&b, &format!("key-{i}"), i, engine.as_str());
        }
    }
}

/// The child side of `a_sigkilled_writer_loses_no_acknowledged_value`: does nothing unless run by
/// it. Writes values one after another forever, printing `ACK i` once commit `i` returned.
#[test]
fn crash_child_writer() {
    let Ok(dir) = std::env::var(CHILD_DIR) else { return };
    let engine: IoEngineKind = std::env::var(CHILD_ENGINE).expect("engine").parse().expect("engine name");
    let b = live(config(Path::new(&dir), engine));
    let start = Instant::now();
    for i in 0.. {
        put_value(&b, &format!("key-{i}"), i);
        println!("ACK {i}");
        // Keep going until killed (the parent kills after enough acknowledgements); never outlive
        // a parent that died first, and never shut down cleanly.
        if i > 20_000 || start.elapsed() > Duration::from_secs(60) {
            std::process::abort();
        }
    }
}

#[test]
fn a_sigkilled_writer_loses_no_acknowledged_value() {
    for engine in engines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "crash_child_writer", "--nocapture", "--test-threads", "1"])
            .env(CHILD_DIR, dir.path())
            .env(CHILD_ENGINE, engine.as_str())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the writer");
        let stdout = child.stdout.take().expect("stdout");
        let mut acked: Option<u64> = None;
        let start = Instant::now();
        // Kept open until the kill: a closed pipe would make the writer fail (and unwind into a
        // clean shutdown) instead of dying.
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let line = line.expect("line");
            if let Some(i) = line.strip_prefix("ACK ").and_then(|i| i.trim().parse::<u64>().ok()) {
                acked = Some(i);
                if i >= 150 {
                    break;
                }
            }
            assert!(start.elapsed() < Duration::from_secs(60), "{engine}: the writer is too slow");
        }
        // SIGKILL, in the middle of the next writes.
        child.kill().expect("kill");
        let status = child.wait().expect("wait");
        drop(lines);
        assert!(!status.success(), "{engine}: the writer was killed");
        let acked = acked.expect("the writer acknowledged commits");
        let b = live(config(dir.path(), engine));
        // One writer, one commit at a time: no write was in flight behind an acknowledged one, so
        // every acknowledged value is back (the one being written at the kill may be too).
        let owned = b.owned_key_count() as u64;
        assert!(owned > acked, "{engine}: {owned} keys recovered, {} acknowledged ({:?})", acked + 1, b.stats());
        for i in 0..=acked {
            check(&b, &format!("key-{i}"), i, engine.as_str());
        }
        for i in acked + 1..owned {
            check(&b, &format!("key-{i}"), i, &format!("{engine} (written after the last ack read)"));
        }
    }
}
