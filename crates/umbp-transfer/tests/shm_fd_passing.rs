//! The shared-memory foundation with real processes: a child process serves sealed memory files
//! over the Unix socket, this process maps them and sees the child's writes (and the child ours); a
//! wrong token and a peer of another user are refused; a deregistered region reads as stale; a
//! killed holder leaves the mapping valid memory and new requests fail cleanly.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::ptr;
use std::sync::Arc;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};
use umbp_transfer::shm::{HostIdentity, Refusal, ShmClient, ShmClientConfig, ShmError, ShmServer, ShmServerConfig};

/// What a child started by this file does (`serve` or `client`).
const CHILD: &str = "UMBP_SHM_TEST_CHILD";
const ENDPOINT: &str = "UMBP_SHM_TEST_ENDPOINT";
const TOKEN: &str = "UMBP_SHM_TEST_TOKEN";
/// Bytes of the child's memory file: region 7 is all of it, region 8 its pages 3 and 4.
const FILE_LEN: usize = 1 << 20;
const PAGE: usize = 4096;

/// A sealed memory file of `len` bytes mapped read-write, as a shareable medium makes one.
struct SealedFile {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
}

impl SealedFile {
    fn new(len: usize) -> Self {
        let fd = rustix::fs::memfd_create("test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
        rustix::fs::ftruncate(&fd, len as u64).expect("size");
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).expect("seal");
        // SAFETY: a fresh shared mapping of the whole file, unmapped never (the test process ends).
        let base = unsafe {
            rustix::mm::mmap(ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
        }
        .expect("mmap");
        Self { fd, base: base.cast(), len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the live mapping of `len` bytes; `&mut self` makes this the only reference here.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }
}

fn unique_endpoint(test: &str) -> String {
    format!("test-{}-{test}", std::process::id())
}

/// The child's side: runs only when this binary was started as a child.
#[test]
fn child_entry() {
    match std::env::var(CHILD).as_deref() {
        Ok("serve") => serve_child(),
        Ok("client") => client_child(),
        _ => {}
    }
}

/// Serves region 7 (the whole file) and 8 (pages 3..5), then obeys commands on stdin.
fn serve_child() {
    let endpoint = std::env::var(ENDPOINT).expect("endpoint");
    let token = std::env::var(TOKEN).expect("token");
    let mut file = SealedFile::new(FILE_LEN);
    for (i, b) in file.bytes().iter_mut().enumerate() {
        *b = (i / PAGE) as u8;
    }
    let server = ShmServer::start(ShmServerConfig::new(endpoint, token)).expect("server");
    server.register(7, file.fd.as_fd(), 0, FILE_LEN as u64).expect("region 7");
    server.register(8, file.fd.as_fd(), 3 * PAGE as u64, 2 * PAGE as u64).expect("region 8");
    println!("@@ READY");
    for line in std::io::stdin().lock().lines() {
        let line = line.expect("a command");
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words[..] {
            ["fill", b] => {
                file.bytes().fill(b.parse().expect("a byte"));
                "OK".to_owned()
            }
            ["check", at, b] => {
                let ok = file.bytes()[at.parse::<usize>().expect("offset")] == b.parse::<u8>().expect("byte");
                if ok { "YES".to_owned() } else { "NO".to_owned() }
            }
            ["dereg", id] => format!("{}", server.deregister(id.parse().expect("id"))),
            ["rereg", id] => {
                let epoch = server.register(id.parse().expect("id"), file.fd.as_fd(), 0, FILE_LEN as u64);
                format!("EPOCH {}", epoch.expect("registered"))
            }
            ["exit"] => return,
            _ => panic!("unknown command {line:?}"),
        };
        println!("@@ {reply}");
    }
}

/// Maps region 7 of the endpoint and prints the outcome (run as another user).
fn client_child() {
    let endpoint = std::env::var(ENDPOINT).expect("endpoint");
    let token = std::env::var(TOKEN).expect("token");
    let client = ShmClient::new(ShmClientConfig::new(token));
    match client.region(&endpoint, 7) {
        Ok(m) => println!("@@ RESULT OK {}", m.len()),
        Err(ShmError::Refused { reason, .. }) => println!("@@ RESULT REFUSED {reason:?}"),
        Err(e) => println!("@@ RESULT ERROR {e}"),
    }
}

/// A serving child and its pipes.
struct Holder {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    endpoint: String,
}

impl Holder {
    fn start(test: &str, token: &str) -> Self {
        let endpoint = unique_endpoint(test);
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
            .env(CHILD, "serve")
            .env(ENDPOINT, &endpoint)
            .env(TOKEN, token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the holder");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut holder = Self { child, stdin, stdout, endpoint };
        holder.expect_line("READY");
        holder
    }

    /// The child's next line of its own.
    fn line(&mut self) -> String {
        loop {
            let mut line = String::new();
            assert!(self.stdout.read_line(&mut line).expect("read") > 0, "the holder exited");
            // The test harness prints its own words around ours; ours follow a marker.
            if let Some((_, ours)) = line.split_once("@@ ") {
                return ours.trim().to_owned();
            }
        }
    }

    fn expect_line(&mut self, want: &str) {
        assert_eq!(self.line(), want);
    }

    fn command(&mut self, command: &str) -> String {
        writeln!(self.stdin, "{command}").expect("send a command");
        self.line()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_parent_maps_a_childs_region_and_both_see_each_others_writes() {
    let mut holder = Holder::start("maps", "secret");
    let client = ShmClient::new(ShmClientConfig::new("secret"));
    let region = client.region(&holder.endpoint, 7).expect("mapped");
    assert_eq!(region.len(), FILE_LEN as u64);
    let mut page = vec![0u8; PAGE];
    region.read_at(5 * PAGE as u64, &mut page).expect("read");
    assert!(page.iter().all(|&b| b == 5), "the child's initial bytes");
    // Region 8 starts mid-file: its first byte is the file's page 3.
    let eight = client.region(&holder.endpoint, 8).expect("mapped");
    assert_eq!(eight.len(), 2 * PAGE as u64);
    let mut two = [0u8; 2];
    eight.read_at(PAGE as u64 - 1, &mut two).expect("read");
    assert_eq!(two, [3, 4]);
    assert!(matches!(eight.read_at(2 * PAGE as u64 - 1, &mut two), Err(ShmError::OutOfRange { .. })));
    // The child writes; we see it without another request.
    assert_eq!(holder.command("fill 171"), "OK");
    region.read_at(0, &mut page).expect("read");
    assert!(page.iter().all(|&b| b == 171));
    // We write; the child sees it.
    region.write_at(777, &[9]).expect("write");
    assert_eq!(holder.command("check 777 9"), "YES");
    // The cache hands out the same mapping while current.
    assert!(Arc::ptr_eq(&region, &client.region(&holder.endpoint, 7).expect("cached")));
    assert_eq!(client.cached_regions(), 2);
    assert!(client.connected(&holder.endpoint));
}

#[test]
fn a_wrong_token_is_refused_and_the_right_one_still_served() {
    let holder = Holder::start("token", "right");
    let wrong = ShmClient::new(ShmClientConfig::new("wrong"));
    let err = wrong.region(&holder.endpoint, 7).expect_err("refused");
    assert!(matches!(err, ShmError::Refused { reason: Refusal::Token, .. }), "{err:?}");
    let none = ShmClient::new(ShmClientConfig::new(""));
    assert!(matches!(none.region(&holder.endpoint, 7), Err(ShmError::Refused { reason: Refusal::Token, .. })));
    let right = ShmClient::new(ShmClientConfig::new("right"));
    assert!(right.region(&holder.endpoint, 7).is_ok());
}

#[test]
fn a_deregistered_region_reads_as_stale_and_a_new_registration_maps_again() {
    let mut holder = Holder::start("dereg", "t");
    let client = ShmClient::new(ShmClientConfig::new("t"));
    let region = client.region(&holder.endpoint, 7).expect("mapped");
    assert!(region.is_current());
    assert_eq!(holder.command("dereg 7"), "true");
    assert!(!region.is_current(), "the epoch table says so at once");
    let mut buf = [0u8; 8];
    assert!(matches!(region.read_at(0, &mut buf), Err(ShmError::Stale { region_id: 7, .. })));
    assert!(matches!(region.write_at(0, &buf), Err(ShmError::Stale { .. })));
    assert!(matches!(client.region(&holder.endpoint, 7), Err(ShmError::UnknownRegion { region_id: 7, .. })));
    assert_eq!(client.cached_regions(), 0, "the stale mapping left the cache");
    // Still valid memory: reading it through the raw pointer cannot fault.
    // SAFETY: `region` is alive and at least one byte long.
    let _ = unsafe { region.as_ptr().read_volatile() };
    let reply = holder.command("rereg 7");
    let epoch: u64 = reply.strip_prefix("EPOCH ").expect("an epoch").parse().expect("a number");
    let again = client.region(&holder.endpoint, 7).expect("mapped again");
    assert_eq!(again.epoch(), epoch);
    assert!(again.epoch() > region.epoch(), "epochs are never reused");
    again.read_at(4 * PAGE as u64, &mut buf).expect("read");
    assert_eq!(buf, [4; 8]);
}

#[test]
fn a_holder_killed_mid_copy_leaves_the_mapping_valid_and_new_requests_fail_cleanly() {
    let mut holder = Holder::start("killed", "t");
    let client = ShmClient::new(ShmClientConfig::new("t"));
    let region = client.region(&holder.endpoint, 7).expect("mapped");
    assert_eq!(holder.command("fill 66"), "OK");
    // A reader copies the whole region over and over while the holder is killed under it.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (region, stop) = (Arc::clone(&region), Arc::clone(&stop));
        std::thread::spawn(move || {
            let (mut buf, mut copies) = (vec![0u8; FILE_LEN], 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                region.read_at(0, &mut buf).expect("a dead holder's pages are still readable");
                assert!(buf.iter().all(|&b| b == 66));
                copies += 1;
            }
            copies
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(20));
    holder.child.kill().expect("kill");
    holder.child.wait().expect("reaped");
    std::thread::sleep(std::time::Duration::from_millis(20));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let copies = reader.join().expect("the reader survived the holder's death");
    assert!(copies > 0);
    // The holder's process and its file descriptors are gone; our mapping keeps the pages.
    let mut all = vec![0u8; FILE_LEN];
    // SAFETY: the mapping is alive and `FILE_LEN` long; no other thread writes it now.
    unsafe { ptr::copy_nonoverlapping(region.as_ptr().as_ptr(), all.as_mut_ptr(), FILE_LEN) };
    assert!(all.iter().all(|&b| b == 66), "no SIGBUS, and the last bytes written");
    region.write_at(0, &[1, 2, 3]).expect("still writable memory");
    // New requests fail cleanly: the connection is gone and nobody listens any more.
    let err = client.region(&holder.endpoint, 8).expect_err("the holder is gone");
    assert!(matches!(err, ShmError::Io { .. }), "{err:?}");
    assert!(err.kind().is_retryable(), "another path may serve the bytes");
    assert!(!client.connected(&holder.endpoint));
    let fresh = ShmClient::new(ShmClientConfig::new("t"));
    assert!(matches!(fresh.region(&holder.endpoint, 7), Err(ShmError::Io { .. })));
    // A sweep drops the dead holder's mappings; ours stays valid until we let go.
    client.sweep();
    assert_eq!(client.cached_regions(), 0);
    region.read_at(0, &mut all[..3]).expect("valid memory");
    assert_eq!(&all[..3], &[1, 2, 3]);
}

/// Runs the client child as `nobody` against `server` and returns its RESULT line.
fn nobody_client(endpoint: &str, token: &str) -> String {
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(CHILD, "client")
        .env(ENDPOINT, endpoint)
        .env(TOKEN, token)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("run the client as nobody");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "the nobody client failed: {text}{}", String::from_utf8_lossy(&out.stderr));
    text.lines()
        .find_map(|l| l.split_once("@@ ").map(|(_, ours)| ours.trim().to_owned()))
        .unwrap_or_else(|| panic!("no result: {text}"))
}

#[test]
fn a_peer_of_another_user_is_refused_unless_its_group_is_allowed() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: running a peer as another user needs root");
        return;
    }
    let file = SealedFile::new(64 << 10);
    let endpoint = unique_endpoint("uid");
    let server = ShmServer::start(ShmServerConfig::new(endpoint.clone(), "t")).expect("server");
    server.register(7, file.fd.as_fd(), 0, 64 << 10).expect("register");
    assert_eq!(nobody_client(&endpoint, "t"), "RESULT REFUSED Credentials", "same token, another user");
    drop(server);
    let endpoint = unique_endpoint("gid");
    let mut config = ShmServerConfig::new(endpoint.clone(), "t");
    config.allowed_gid = Some(65534);
    let server = ShmServer::start(config).expect("server");
    server.register(7, file.fd.as_fd(), 0, 64 << 10).expect("register");
    assert_eq!(nobody_client(&endpoint, "t"), format!("RESULT OK {}", 64 << 10), "the allowed group");
    assert_eq!(nobody_client(&endpoint, "x"), "RESULT REFUSED Token", "the group still needs the token");
}

#[test]
fn the_server_refuses_files_a_mapping_could_fault_on() {
    let server = ShmServer::start(ShmServerConfig::new(unique_endpoint("unsealed"), "t")).expect("server");
    let unsealed = rustix::fs::memfd_create("u", MemfdFlags::CLOEXEC).expect("memfd");
    rustix::fs::ftruncate(&unsealed, 8192).expect("size");
    assert!(matches!(server.register(1, unsealed.as_fd(), 0, 8192), Err(ShmError::Invalid(_))), "can shrink");
    let sealed = SealedFile::new(8192);
    assert!(matches!(server.register(1, sealed.fd.as_fd(), 4096, 8192), Err(ShmError::Invalid(_))), "past the end");
    assert!(matches!(server.register(1, sealed.fd.as_fd(), 0, 0), Err(ShmError::Invalid(_))), "empty");
    assert_eq!(server.region_count(), 0);
    assert!(server.register(1, sealed.fd.as_fd(), 4096, 4096).is_ok());
    assert_eq!(server.region_count(), 1);
}

#[test]
fn a_server_shutdown_makes_every_mapping_stale() {
    let mut file = SealedFile::new(16 << 10);
    let endpoint = unique_endpoint("shutdown");
    let server = ShmServer::start(ShmServerConfig::new(endpoint.clone(), "t")).expect("server");
    let first = server.register(1, file.fd.as_fd(), 0, 8192).expect("register");
    let second = server.register(2, file.fd.as_fd(), 8192, 8192).expect("register");
    assert!(second > first);
    let client = ShmClient::new(ShmClientConfig::new("t"));
    let (one, two) = (client.region(&endpoint, 1).expect("map"), client.region(&endpoint, 2).expect("map"));
    file.bytes()[8192] = 42;
    let mut b = [0u8];
    two.read_at(0, &mut b).expect("read");
    assert_eq!(b, [42]);
    assert_eq!(server.connection_count(), 1, "one connection per client and holder");
    server.shutdown();
    assert!(!one.is_current() && !two.is_current());
    assert!(matches!(client.region(&endpoint, 1), Err(ShmError::Io { .. })), "nobody listens any more");
}

#[test]
fn processes_of_this_test_share_one_host_identity() {
    let me = HostIdentity::current().expect("identity");
    let out = Command::new("cat").arg("/proc/sys/kernel/random/boot_id").output().expect("cat");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), me.boot_id);
}
