//! Ranged resolves (`batch_resolve_ranges`): every hit, whole or partial, holds every asked byte.
//!
//! Bytes are checked where the medium's buffers are host memory this process addresses; a medium
//! whose buffers are not (device memory) is checked for its bookkeeping only.

use umbp_core::{MemoryLocation, PageLocation, ReadRelease, ResolvedEntry};

use super::fixture::{Fixture, Live, keys};

/// The byte at value offset `i` of the test value.
fn pattern(i: u64) -> u8 {
    (i * 13 % 251) as u8
}

/// The host address of byte `at` of `page`, when the medium's buffer is host memory here.
fn host_byte(s: &Live, page: &PageLocation, at: u64) -> Option<*mut u8> {
    let r = s.backend.buffer_ref(page.buffer_index as usize)?;
    let local = r.local_region()?;
    if r.location() != MemoryLocation::Host || local.location() != MemoryLocation::Host {
        return None;
    }
    let offset = u64::from(page.page_index) * s.ps() + at;
    // SAFETY: `offset` lies inside the buffer (pages are checked in range by the callers) and the
    // region is host memory this process maps.
    (offset < local.len()).then(|| unsafe { local.ptr().as_ptr().add(offset as usize) })
}

/// Value bytes `[at, at + len)` of a hit (`None`: not host memory), from value page
/// `entry.first_page` on.
fn bytes_of(s: &Live, e: &ResolvedEntry, at: u64, len: u64) -> Option<Vec<u8>> {
    let ps = s.ps();
    (at..at + len)
        .map(|i| {
            let page = e.pages.get(usize::try_from((i / ps).checked_sub(e.first_page)?).ok()?)?;
            // SAFETY: the page is leased to this reader; the byte lies inside it.
            host_byte(s, page, i % ps).map(|p| unsafe { *p })
        })
        .collect()
}

/// Puts a value of `size` bytes under `key`, filled with [`pattern`] where the pages are host
/// memory; whether they are.
fn put_pattern(s: &Live, key: &str, size: u64) -> bool {
    let a = s.alloc_ok(key, size);
    let ps = s.ps();
    let mut host = true;
    for i in 0..size {
        match host_byte(s, &a.pages[(i / ps) as usize], i % ps) {
            // SAFETY: the page belongs to this pending slot, written by nobody else.
            Some(p) => unsafe { *p = pattern(i) },
            None => {
                host = false;
                break;
            }
        }
    }
    let c = s.commit(a.slot_id, key);
    assert!(c.success, "commit of {key:?}");
    host
}

fn release(s: &Live, key: &str, e: &ResolvedEntry) {
    s.backend.release_reads(&[ReadRelease::new(key, e.lease)]);
}

pub(super) fn ranged_resolve_holds_every_asked_byte(fx: &Fixture<'_>) {
    let s = fx.live();
    let ps = s.ps();
    assert!(s.backend.batch_resolve_ranges(&[], &[], false).is_empty(), "an empty batch");
    // Three pages (the last one partly used); a range in the second page and one in the third,
    // down to pages of one byte.
    let size = 2 * ps + (ps / 2).max(1);
    let host = put_pattern(&s, "k", size);
    let ranges = vec![(ps + ps / 4, (ps / 8).max(1)), (2 * ps, (ps / 4).max(1))];
    let asked = keys(&["k", "nope", "k"]);
    let r = s.backend.batch_resolve_ranges(&asked, &[ranges.clone(), vec![(0, 1)]], true);
    assert_eq!(r.len(), 3, "one entry per key");
    let part = &r[0];
    assert!(part.found && !part.busy, "a ranged resolve of a stored key on an idle medium: {part:?}");
    assert_eq!((part.size, part.page_size), (size, ps), "size and page size");
    if part.partial || !part.is_whole() {
        assert!(part.partial, "a hit that is not whole says it is partial: {part:?}");
        let end = part.first_page + part.pages.len() as u64;
        assert!(part.first_page <= 1 && end == 3, "pages {}..{end} cover the ranges' pages 1..3", part.first_page);
        assert_eq!(part.crc32c, None, "a part carries no whole-value checksum");
    }
    s.assert_pages_valid(&part.pages, "a ranged hit");
    assert_eq!(part.descs, s.descs_for(&part.pages), "a ranged hit's descriptors");
    assert!(!r[1].found && !r[1].busy && r[1].pages.is_empty() && r[1].lease == 0, "a miss: {:?}", r[1]);
    assert!(r[2].is_whole(), "a key without ranges resolves whole: {:?}", r[2]);
    if host {
        for (at, len) in &ranges {
            let want: Vec<u8> = (*at..at + len).map(pattern).collect();
            assert_eq!(bytes_of(&s, part, *at, *len), Some(want), "range at {at}");
        }
        let whole: Vec<u8> = (0..size).map(pattern).collect();
        assert_eq!(bytes_of(&s, &r[2], 0, size).as_ref(), Some(&whole), "the whole value");
    }
    // A later whole resolve, with the ranged hit still held, is whole.
    let later = s.resolve("k", false);
    assert!(later.is_whole(), "a whole resolve after a ranged one: {later:?}");
    if host {
        let whole: Vec<u8> = (0..size).map(pattern).collect();
        assert_eq!(bytes_of(&s, &later, 0, size), Some(whole), "the whole value after a ranged read");
    }
    release(&s, "k", part);
    release(&s, "k", &r[2]);
    release(&s, "k", &later);
    // Every lease ended: nothing of the ranged read is left behind.
    s.expire(s.read_lease);
    assert_eq!(s.evict("k"), size, "the key is evictable once its readers are gone");
    assert_eq!(s.available(), s.total(), "every page came back");
}
