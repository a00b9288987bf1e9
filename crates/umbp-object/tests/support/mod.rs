//! What the object medium's tests share: a `moto_server` each test starts on a free loopback port
//! (found on `PATH` or at `UMBP_MOTO_SERVER`; missing, the test skips with a printed reason, or
//! fails under `UMBP_REQUIRE_MOTO=1`), a raw S3 client for poking objects, a loopback HTTP proxy
//! that answers 503 or stalls on demand, and byte-level put/get through a medium's staging arena.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rusty_s3::{Bucket, S3Action, UrlStyle};
use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, ReadRelease};
use umbp_object::Credentials;

/// The switch that turns a missing `moto_server` from a skip into a failure (CI sets it).
pub const REQUIRE_MOTO: &str = "UMBP_REQUIRE_MOTO";

/// The credentials every test uses (moto accepts any).
pub fn credentials() -> Credentials {
    Credentials { key: "testing".into(), secret: "testing".into(), token: None }
}

/// `moto_server`'s path, or why there is none.
fn moto_binary() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("UMBP_MOTO_SERVER") {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("UMBP_MOTO_SERVER={} is not a file", p.display())) };
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("moto_server"))
        .find(|p| p.is_file())
        .ok_or_else(|| "moto_server is not on PATH (pip install 'moto[server]', or set UMBP_MOTO_SERVER)".to_owned())
}

/// A free loopback port (bound and released: a race with other processes is possible but rare).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("local addr").port()
}

/// A running `moto_server`, killed when dropped.
pub struct Moto {
    binary: PathBuf,
    pub port: u16,
    child: Option<Child>,
}

impl Moto {
    /// Starts one, or `None` after printing why (a failure under `UMBP_REQUIRE_MOTO=1`).
    pub fn start() -> Option<Self> {
        let binary = match moto_binary() {
            Ok(b) => b,
            Err(why) => {
                umbp_testkit::require::skip(REQUIRE_MOTO, format_args!("no S3 stand-in: {why}"));
                return None;
            }
        };
        let mut m = Self { binary, port: free_port(), child: None };
        m.spawn();
        Some(m)
    }

    fn spawn(&mut self) {
        let child = Command::new(&self.binary)
            .args(["-H", "127.0.0.1", "-p", &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start moto_server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!("moto_server exited at start ({status}) on port {}", self.port);
            }
            assert!(Instant::now() < deadline, "moto_server did not listen on {} within 30 s", self.port);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops the server (its state is lost).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills and starts it again on the same port: an empty store (moto keeps nothing).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// A raw client of `bucket` on this server.
    pub fn client(&self, bucket: &str) -> Raw {
        Raw::new(&self.endpoint(), bucket)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Raw S3 calls (rusty-s3 + ureq), for setting up and corrupting what a medium wrote.
pub struct Raw {
    bucket: Bucket,
    creds: rusty_s3::Credentials,
    agent: ureq::Agent,
}

const SIGN: Duration = Duration::from_secs(60);

impl Raw {
    pub fn new(endpoint: &str, bucket: &str) -> Self {
        let url = url::Url::parse(endpoint).expect("endpoint url");
        let bucket = Bucket::new(url, UrlStyle::Path, bucket.to_owned(), "us-east-1").expect("bucket");
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            // Kept alive for as many threads as a bench runs, as the medium's own client does.
            .max_idle_connections(64)
            .max_idle_connections_per_host(64)
            .build()
            .new_agent();
        Self { bucket, creds: rusty_s3::Credentials::new("testing", "testing"), agent }
    }

    fn status(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> (u16, Vec<u8>) {
        let mut r = r.expect("request to moto");
        let status = r.status().as_u16();
        let body = r.body_mut().with_config().limit(1 << 30).read_to_vec().expect("body");
        (status, body)
    }

    pub fn create_bucket(&self) {
        let a = self.bucket.create_bucket(&self.creds);
        let (s, b) = Self::status(self.agent.put(a.sign(SIGN).as_str()).send(a.body().as_str()));
        assert!(s == 200 || s == 409, "create bucket: HTTP {s} {}", String::from_utf8_lossy(&b));
    }

    pub fn put(&self, name: &str, body: &[u8]) {
        let url = self.bucket.put_object(Some(&self.creds), name).sign(SIGN);
        let (s, b) = Self::status(self.agent.put(url.as_str()).send(body));
        assert_eq!(s, 200, "put {name}: {}", String::from_utf8_lossy(&b));
    }

    pub fn get(&self, name: &str) -> Option<Vec<u8>> {
        let url = self.bucket.get_object(Some(&self.creds), name).sign(SIGN);
        match Self::status(self.agent.get(url.as_str()).call()) {
            (200, b) => Some(b),
            (404, _) => None,
            (s, b) => panic!("get {name}: HTTP {s} {}", String::from_utf8_lossy(&b)),
        }
    }

    pub fn list(&self, prefix: &str) -> Vec<String> {
        let mut a = self.bucket.list_objects_v2(Some(&self.creds));
        a.with_prefix(prefix);
        let (s, b) = Self::status(self.agent.get(a.sign(SIGN).as_str()).call());
        assert_eq!(s, 200, "list: {}", String::from_utf8_lossy(&b));
        let page = rusty_s3::actions::ListObjectsV2::parse_response(&String::from_utf8_lossy(&b)).expect("listing");
        page.contents.into_iter().map(|c| c.key).collect()
    }
}

/// A loopback HTTP/1.1 proxy in front of `upstream`, one request per connection: it answers the
/// next `fail` requests with 503 itself, holds requests unanswered while `stall` is set, and
/// forwards the rest.
pub struct Proxy {
    pub port: u16,
    pub fail: Arc<AtomicUsize>,
    pub stall: Arc<AtomicBool>,
    /// Requests read whole (answered or not yet).
    pub received: Arc<AtomicU64>,
    /// Requests answered 503.
    pub failed: Arc<AtomicU64>,
    /// Requests forwarded upstream.
    pub forwarded: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    pub fn start(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let p = Self {
            port,
            fail: Arc::new(AtomicUsize::new(0)),
            stall: Arc::new(AtomicBool::new(false)),
            received: Arc::new(AtomicU64::new(0)),
            failed: Arc::new(AtomicU64::new(0)),
            forwarded: Arc::new(AtomicU64::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
        };
        let counters =
            Counters { received: p.received.clone(), failed: p.failed.clone(), forwarded: p.forwarded.clone() };
        let (fail, stall, stop) = (p.fail.clone(), p.stall.clone(), p.stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let (fail, stall, stop, counters) =
                            (fail.clone(), stall.clone(), stop.clone(), counters.clone());
                        std::thread::spawn(move || {
                            let _ = serve(client, upstream, &fail, &stall, &counters, &stop);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        p
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.stall.store(false, Ordering::Relaxed);
    }
}

/// The proxy's counters, shared with its connection threads.
#[derive(Clone)]
struct Counters {
    received: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    forwarded: Arc<AtomicU64>,
}

fn serve(
    mut client: TcpStream,
    upstream: u16,
    fail: &AtomicUsize,
    stall: &AtomicBool,
    counters: &Counters,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    client.set_nonblocking(false)?;
    client.set_read_timeout(Some(Duration::from_secs(30)))?;
    // The head, then the body by Content-Length.
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    let head_end = loop {
        let n = client.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let len: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = client.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    counters.received.fetch_add(1, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(60);
    while stall.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    if fail.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
        counters.failed.fetch_add(1, Ordering::SeqCst);
        let body = "<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>";
        let r = format!(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        client.write_all(r.as_bytes())?;
        return client.shutdown(Shutdown::Both);
    }
    counters.forwarded.fetch_add(1, Ordering::SeqCst);
    // One request per connection: ask upstream to close after answering.
    let mut new_head: String = head
        .split("\r\n")
        .filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("connection:"))
        .map(|l| format!("{l}\r\n"))
        .collect();
    new_head.push_str("Connection: close\r\n\r\n");
    let mut up = TcpStream::connect(("127.0.0.1", upstream))?;
    up.write_all(new_head.as_bytes())?;
    up.write_all(&buf[head_end..head_end + len])?;
    std::io::copy(&mut up, &mut client)?;
    client.shutdown(Shutdown::Both)
}

/// Writes `value` under `key` through `medium`'s staging arena (allocate, copy, commit); the
/// allocation's outcome when it is not a slot, else whether the commit succeeded.
pub fn put(medium: &dyn MediumBackend, key: &str, value: &[u8]) -> Result<bool, AllocateOutcome> {
    let slot = medium.batch_allocate(&[AllocateRequest::new(key, value.len() as u64)]).remove(0);
    if slot.outcome != AllocateOutcome::Allocated {
        return Err(slot.outcome);
    }
    let base = arena(medium);
    let ps = slot.page_size as usize;
    for (p, chunk) in slot.pages.iter().zip(value.chunks(ps)) {
        // SAFETY: the slot's pages lie in the registered arena and are the slot's until commit.
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), base.add(p.page_index as usize * ps), chunk.len()) };
    }
    Ok(medium.batch_commit(&[CommitRequest::new(slot.slot_id, key)])[0].success)
}

/// Reads `key` through `medium` (resolve, copy out, release): `Ok(None)` for a miss, `Err(())`
/// for busy.
pub fn get(medium: &dyn MediumBackend, key: &str) -> Result<Option<Vec<u8>>, ()> {
    let hit = medium.batch_resolve(&[key.to_owned()], false).remove(0);
    if hit.busy {
        return Err(());
    }
    if !hit.found {
        return Ok(None);
    }
    let base = arena(medium);
    let ps = hit.page_size as usize;
    let mut out = Vec::with_capacity(hit.size as usize);
    let mut left = hit.size as usize;
    for p in &hit.pages {
        let n = left.min(ps);
        // SAFETY: the leased pages lie in the arena and are not written while the lease is held.
        out.extend_from_slice(unsafe { std::slice::from_raw_parts(base.add(p.page_index as usize * ps), n) });
        left -= n;
    }
    medium.release_reads(&[ReadRelease::new(key, hit.lease)]);
    Ok(Some(out))
}

fn arena(medium: &dyn MediumBackend) -> *mut u8 {
    let r = medium.buffer_ref(0).expect("a live medium publishes its arena");
    r.local_region().expect("host memory").ptr().as_ptr()
}

/// `n` bytes that differ by `seed`.
pub fn value(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A prefix no other test or subject uses.
pub fn unique_prefix(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}
