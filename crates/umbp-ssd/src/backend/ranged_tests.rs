//! Tests of ranged resolves: only the covered pages are read, as the reader's own copy.

use super::tests::page_ptr;
use super::*;
use umbp_core::{Clock, ManualClock, ReadRelease};
use umbp_testkit::LocalOnlyRegistrar;

const PAGE: u64 = 4096;
/// An 8-page value.
const SIZE: usize = 8 * PAGE as usize;

fn backend(dir: &std::path::Path, clock: &Arc<ManualClock>) -> SsdBackend {
    backend_of(dir, clock, PAGE, 8)
}

fn backend_of(dir: &std::path::Path, clock: &Arc<ManualClock>, page: u64, max_pages: u64) -> SsdBackend {
    let config = SsdConfig::builder([dir])
        .page_size(page)
        .max_value_pages(max_pages)
        .capacity_bytes(64 * page)
        .staging_pages(16)
        .segment_bytes(64 * page)
        .read_lease_ttl(Duration::from_secs(60))
        .clock(Arc::clone(clock) as Arc<dyn Clock>)
        .build()
        .expect("config");
    let b = SsdBackend::new(config);
    b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    b
}

fn value() -> Vec<u8> {
    (0..SIZE).map(|i| (i * 7 % 251) as u8).collect()
}

/// Puts `bytes` under `key` and drops every cached copy, so the next resolve reads the drive.
fn put(b: &SsdBackend, key: &str, bytes: &[u8]) {
    let a = b.batch_allocate(&[AllocateRequest::new(key, bytes.len() as u64)]).remove(0);
    assert_eq!(a.outcome, AllocateOutcome::Allocated);
    for (chunk, page) in bytes.chunks(b.page_size() as usize).zip(&a.pages) {
        // SAFETY: the page is the slot's, inside the arena, and a chunk fits one page.
        unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), page_ptr(b, page), chunk.len()) };
    }
    assert!(b.batch_commit(&[CommitRequest::new(a.slot_id, key)])[0].success);
    b.drop_cached_copies();
}

/// The value bytes `[at, at + len)` from a hit's pages (value page `first_page` is `pages[0]`).
fn bytes_of(b: &SsdBackend, e: &ResolvedEntry, at: u64, len: u64) -> Vec<u8> {
    let ps = b.page_size();
    (at..at + len)
        .map(|i| {
            let page = &e.pages[(i / ps - e.first_page) as usize];
            // SAFETY: the page lies inside the arena and is leased to this reader.
            unsafe { *page_ptr(b, page).add((i % ps) as usize) }
        })
        .collect()
}

fn ranged(b: &SsdBackend, key: &str, ranges: &[(u64, u64)]) -> ResolvedEntry {
    b.batch_resolve_ranges(&[key.to_owned()], &[ranges.to_vec()], false).remove(0)
}

#[test]
fn a_ranged_resolve_reads_and_stages_only_the_pages_the_ranges_cover() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock);
    let v = value();
    put(&b, "k", &v);
    let before = b.stats();
    let ranges = [(4 * PAGE + 10, 50), (3 * PAGE + 100, 200)];
    let e = ranged(&b, "k", &ranges);
    assert!(e.found && !e.is_whole(), "{e:?}");
    assert_eq!((e.first_page, e.pages.len(), e.size, e.crc32c), (3, 2, SIZE as u64, None));
    for (at, len) in ranges {
        assert_eq!(bytes_of(&b, &e, at, len), v[at as usize..(at + len) as usize], "range at {at}");
    }
    let after = b.stats();
    let read = after.device_read_bytes - before.device_read_bytes;
    assert_eq!(read, PAGE + 2 * PAGE, "the header block and two value pages");
    assert!(read < SIZE as u64);
    assert_eq!(after.partial_reads - before.partial_reads, 1);
    assert_eq!(after.partial_read_avoided_bytes - before.partial_read_avoided_bytes, 6 * PAGE);
    assert_eq!(after.staging_pages_in_use, 2, "only the covered pages are staged");
    assert!(b.inner.state.lock().staged().get("k").is_none(), "a part is never a cached copy");
    b.release_reads(&[ReadRelease::new("k", e.lease)]);
    assert_eq!(b.stats().staging_pages_in_use, 0, "the release frees the part's pages");
    // A release of a lease that ended changes nothing.
    b.release_reads(&[ReadRelease::new("k", e.lease)]);
    assert_eq!(b.stats().staging_pages_in_use, 0);
}

#[test]
fn a_later_whole_resolve_never_finds_a_part() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock);
    let v = value();
    put(&b, "k", &v);
    let part = ranged(&b, "k", &[(5 * PAGE, 10)]);
    assert_eq!((part.first_page, part.pages.len()), (5, 1));
    let before = b.stats().device_read_bytes;
    // The part is still leased: a whole read must read and stage the whole value anyway.
    let whole = b.batch_resolve(&["k".to_owned()], false).remove(0);
    assert!(whole.is_whole(), "{whole:?}");
    assert_eq!(bytes_of(&b, &whole, 0, SIZE as u64), v);
    assert_eq!(b.stats().device_read_bytes - before, PAGE + SIZE as u64, "the whole record");
    // With the whole value cached, a ranged resolve is a staged hit: no drive read.
    let again = ranged(&b, "k", &[(PAGE, 3)]);
    assert!(again.is_whole());
    assert_eq!(b.stats().device_read_bytes - before, PAGE + SIZE as u64);
    assert_eq!(bytes_of(&b, &again, PAGE, 3), v[PAGE as usize..PAGE as usize + 3]);
    b.release_reads(&[
        ReadRelease::new("k", part.lease),
        ReadRelease::new("k", whole.lease),
        ReadRelease::new("k", again.lease),
    ]);
    assert_eq!(b.stats().staging_pages_in_use, 8, "only the cached whole copy stays");
}

#[test]
fn a_parts_pages_are_freed_when_its_lease_ends_and_a_full_span_is_a_whole_read() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock);
    let v = value();
    put(&b, "k", &v);
    let part = ranged(&b, "k", &[(0, 1), (2 * PAGE - 1, 2)]);
    assert_eq!((part.first_page, part.pages.len()), (0, 3));
    assert!(!part.is_whole());
    // The key is protected from nothing by the part (it is a copy), but the pages stay held.
    clock.advance(b.config().read_lease_ttl() - Duration::from_millis(1));
    b.reaper_tick();
    assert_eq!(b.stats().staging_pages_in_use, 3, "held while the lease lives");
    clock.advance(Duration::from_millis(2));
    b.reaper_tick();
    assert_eq!(b.stats().staging_pages_in_use, 0, "the lease's end frees them");
    // Ranges that span every page: a whole read, cached and checked.
    let whole = ranged(&b, "k", &[(0, 10), (SIZE as u64 - 1, 1)]);
    assert!(whole.is_whole());
    assert_eq!(bytes_of(&b, &whole, 0, SIZE as u64), v);
    assert!(b.inner.state.lock().staged().get("k").is_some());
    // Keys without ranges, and misses, in the same batch.
    let keys = ["k".to_owned(), "nope".to_owned()];
    let got = b.batch_resolve_ranges(&keys, &[Vec::new(), vec![(0, 1)]], false);
    assert!(got[0].is_whole() && !got[1].found && !got[1].busy);
    // A cached copy (a staged hit, taken before the batch's drive IO) beside a part of an uncached
    // key: both come back leased and right.
    put(&b, "j", &v);
    let cached = b.batch_resolve(&["k".to_owned()], false).remove(0);
    assert!(cached.is_whole());
    let keys = ["k".to_owned(), "j".to_owned()];
    let got = b.batch_resolve_ranges(&keys, &[vec![(PAGE, 4)], vec![(6 * PAGE, 4)]], false);
    assert!(got[0].is_whole() && got[1].partial, "{got:?}");
    assert_eq!(bytes_of(&b, &got[0], PAGE, 4), v[PAGE as usize..PAGE as usize + 4]);
    assert_eq!(bytes_of(&b, &got[1], 6 * PAGE, 4), v[6 * PAGE as usize..6 * PAGE as usize + 4]);
    assert_eq!(b.stats().staging_pages_in_use, 8 + 1, "the cached copy and the part");
    let mut releases: Vec<ReadRelease> = got.iter().zip(&keys).map(|(e, k)| ReadRelease::new(k, e.lease)).collect();
    releases.push(ReadRelease::new("k", cached.lease));
    releases.push(ReadRelease::new("k", whole.lease));
    b.release_reads(&releases);
    assert_eq!(b.stats().staging_pages_in_use, 8, "only the cached copy stays");
}

#[test]
fn a_part_whose_header_fails_its_check_is_never_served_and_drops_the_key() {
    use std::io::{Seek, SeekFrom, Write};
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend(dir.path(), &clock);
    put(&b, "k", &value());
    let (path, offset) = {
        let state = b.inner.state.lock();
        let loc = state.owned("k").expect("k").loc;
        (state.log().segs.get(&loc.seg).expect("segment").file.path.clone(), loc.offset)
    };
    let mut f = fs::OpenOptions::new().write(true).open(&path).expect("segment file");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(&[0xFF; 8]).expect("scribble over the header");
    f.sync_all().expect("sync");
    let e = ranged(&b, "k", &[(PAGE, 1)]);
    assert!(!e.found && !e.busy, "{e:?}");
    assert_eq!(b.stats().corrupt_reads, 1);
    assert!(!b.inner.state.lock().owns("k"), "the key is dropped");
    assert_eq!(b.stats().staging_pages_in_use, 0);
}

/// The default layout keeps a value in one page: a part of it still reads only its 4 KiB blocks.
#[test]
fn a_part_of_a_one_page_value_reads_only_its_blocks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let b = backend_of(dir.path(), &clock, 16 * PAGE, 1);
    let v = value();
    put(&b, "k", &v);
    let before = b.stats().device_read_bytes;
    // 100 bytes across the edge of blocks 2 and 3, and 8 bytes in block 4.
    let ranges = [(3 * PAGE - 50, 100), (4 * PAGE + 8, 8)];
    let e = ranged(&b, "k", &ranges);
    assert!(e.found && e.partial && !e.is_whole(), "{e:?}");
    assert_eq!((e.first_page, e.pages.len()), (0, 1));
    for (at, len) in ranges {
        assert_eq!(bytes_of(&b, &e, at, len), v[at as usize..(at + len) as usize], "range at {at}");
    }
    assert_eq!(b.stats().device_read_bytes - before, PAGE + 3 * PAGE, "the header and blocks 2..5");
    assert!(b.inner.state.lock().staged().get("k").is_none(), "a part is never a cached copy");
    // A later whole read stages all of it.
    let whole = b.batch_resolve(&["k".to_owned()], false).remove(0);
    assert!(whole.is_whole());
    assert_eq!(bytes_of(&b, &whole, 0, SIZE as u64), v);
    b.release_reads(&[ReadRelease::new("k", e.lease), ReadRelease::new("k", whole.lease)]);
}
