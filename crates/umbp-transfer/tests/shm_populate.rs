//! A fresh shared mapping has its page tables filled in the background (`MADV_POPULATE_WRITE`), so
//! copies through it take no page fault per 4 KiB page; with `populate` off nothing is filled until
//! touched. Holder and reader in one process (the server needs only the same host and user).

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rustix::fs::{MemfdFlags, SealFlags};
use umbp_transfer::shm::{ShmClient, ShmClientConfig, ShmServer, ShmServerConfig};

const LEN: u64 = 64 << 20;

/// The value of `field` (`"Rss:"`, `"VmFlags:"`) of the mapping of this process that contains
/// `addr`, from /proc/self/smaps.
fn smaps_field(addr: usize, field: &str) -> String {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((lo, hi)) = range.split_once('-')
            && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
        {
            inside = lo <= addr && addr < hi;
            continue;
        }
        if inside && let Some(value) = line.strip_prefix(field) {
            return value.trim().to_owned();
        }
    }
    panic!("no mapping holds {addr:#x} with a {field} line");
}

/// The resident size (kB) of the mapping that contains `addr`.
fn rss_kb(addr: usize) -> u64 {
    smaps_field(addr, "Rss:").trim_end_matches("kB").trim().parse().expect("Rss kB")
}

fn serve(test: &str) -> (ShmServer, String) {
    let endpoint = format!("test-{}-{test}", std::process::id());
    let fd = rustix::fs::memfd_create("populate", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).expect("memfd");
    rustix::fs::ftruncate(&fd, LEN).expect("size");
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).expect("seal");
    let server = ShmServer::start(ShmServerConfig::new(endpoint.clone(), "t")).expect("server");
    server.register(1, fd.as_fd(), 0, LEN).expect("region");
    (server, endpoint)
}

/// A reader's mapping asks for transparent huge pages (`MADV_HUGEPAGE`, shown as `hg` among the
/// mapping's flags) like the holder's own, so a host with shmem THP on `advise` maps the holder's
/// 2 MiB pages whole on the reader's side too.
#[test]
fn a_new_mapping_is_advised_huge_pages() {
    let (_server, endpoint) = serve("huge");
    let client = ShmClient::new(ShmClientConfig { populate: false, ..ShmClientConfig::new("t") });
    let mapping = client.region(&endpoint, 1).expect("mapped");
    let flags = smaps_field(mapping.as_ptr().as_ptr() as usize, "VmFlags:");
    assert!(flags.split_whitespace().any(|f| f == "hg"), "VmFlags: {flags}");
}

#[test]
fn a_new_mapping_is_populated_in_the_background() {
    let (_server, endpoint) = serve("on");
    let client = ShmClient::new(ShmClientConfig::new("t"));
    let mapping = client.region(&endpoint, 1).expect("mapped");
    let addr = mapping.as_ptr().as_ptr() as usize;
    let deadline = Instant::now() + Duration::from_secs(10);
    while rss_kb(addr) < LEN >> 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(rss_kb(addr), LEN >> 10, "every page of the mapping is mapped without being touched");
    assert!(mapping.is_current());
}

/// A client that copies one value and exits (`umbp get`) must not pay for populating the whole
/// mapping: the filling starts only after a delay (200 ms).
#[test]
fn a_new_mapping_is_not_populated_at_once() {
    let (_server, endpoint) = serve("later");
    let client = ShmClient::new(ShmClientConfig::new("t"));
    let start = Instant::now();
    let mapping = client.region(&endpoint, 1).expect("mapped");
    let addr = mapping.as_ptr().as_ptr() as usize;
    // Long enough for an immediate populating to have mapped pages, well inside the delay.
    std::thread::sleep(Duration::from_millis(50));
    let early = rss_kb(addr);
    // Judged only when this check ran inside the delay (unless the machine stalled this thread).
    if start.elapsed() < Duration::from_millis(150) {
        assert_eq!(early, 0, "nothing populated in the first moments");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while rss_kb(addr) < LEN >> 10 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(rss_kb(addr), LEN >> 10, "then every page");
}

#[test]
fn with_populate_off_nothing_is_mapped_until_touched() {
    let (_server, endpoint) = serve("off");
    let client = ShmClient::new(ShmClientConfig { populate: false, ..ShmClientConfig::new("t") });
    let mapping = client.region(&endpoint, 1).expect("mapped");
    let addr = mapping.as_ptr().as_ptr() as usize;
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rss_kb(addr), 0, "no page mapped");
    mapping.write_at(0, &[1u8; 4096]).expect("written");
    assert_eq!(rss_kb(addr), 4, "the one page touched");
}

#[test]
fn a_mapping_dropped_while_populating_is_unmapped() {
    let (_server, endpoint) = serve("drop");
    let client = ShmClient::new(ShmClientConfig::new("t"));
    let addr = client.region(&endpoint, 1).expect("mapped").as_ptr().as_ptr() as usize;
    // The client's cache and the caller let go at once: the populating thread holds the mapping for
    // at most one step, then it is unmapped.
    client.clear();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mapped = || {
        std::fs::read_to_string("/proc/self/maps").expect("maps").lines().any(|l| {
            let range = l.split(' ').next().unwrap_or_default();
            range.split_once('-').is_some_and(|(lo, hi)| {
                let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap_or(0), usize::from_str_radix(hi, 16).unwrap_or(0));
                lo <= addr && addr < hi && l.contains("populate")
            })
        })
    };
    while mapped() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!mapped(), "unmapped once the populating thread let go");
}
