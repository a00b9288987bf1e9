//! `TransferEngine::transfer_summed` on the in-process copy: each tag's bytes land exactly, and
//! its CRC-32C is the sum of its value — gathered into one destination range (a read, summing what
//! landed) or scattered from one source range into pages (a write, summing what it read), on one
//! thread or spread over several; anything `submit` would copy differently (a range outside its
//! buffer, a tag not tiling one range of the summed side, overlapping ranges) is declined before a
//! byte moves; the composite engine charges what it carried.

use std::ptr::NonNull;
use std::sync::Arc;

use umbp_core::{LocalRegion, MemoryLocation, TransferRef, value_crc32c};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, LocalCopyConfig, LocalCopyEngine, SumOf, TransferEngine, TransferItem,
};

const PAGE: usize = 64 << 10;

struct Buf(Vec<u8>);

impl Buf {
    fn pattern(len: usize, seed: u8) -> Self {
        Self((0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed ^ (i >> 16) as u8)).collect())
    }

    fn r(&mut self) -> TransferRef {
        let ptr = NonNull::new(self.0.as_mut_ptr()).expect("non-null");
        // SAFETY: the Vec is never resized and outlives every transfer in the test.
        TransferRef::local(unsafe { LocalRegion::new(ptr, self.0.len() as u64, MemoryLocation::Host) })
    }
}

fn item(src: &TransferRef, so: usize, dst: &TransferRef, d: usize, size: usize, tag: u64) -> TransferItem {
    TransferItem {
        src: src.clone(),
        src_offset: so as u64,
        dst: dst.clone(),
        dst_offset: d as u64,
        size: size as u64,
        tag,
    }
}

/// A value's expected landing: where its destination starts, and its source parts `(offset, len)`.
type Expected = (usize, Vec<(usize, usize)>);

/// A "medium" of pages and values scattered over them: value `t` is the pages `pages[t]` (in value
/// order), the last cut to `tail` bytes; the destinations are consecutive. Items are listed out of
/// destination order, as a caller may.
fn layout(medium: &TransferRef, dst: &TransferRef) -> (Vec<TransferItem>, Vec<Expected>) {
    let values: Vec<(Vec<usize>, usize)> = (0..40)
        .map(|t| {
            let pages = vec![(t * 7 + 3) % 120, (t * 11 + 5) % 120 + 120, (t * 13 + 1) % 60 + 240];
            (pages, if t % 3 == 0 { PAGE } else { 1 + t * 997 % PAGE })
        })
        .collect();
    let (mut items, mut expected) = (Vec::new(), Vec::new());
    let mut at = 0;
    for (t, (pages, tail)) in values.iter().enumerate() {
        let start = at;
        let mut parts = Vec::new();
        for (p, page) in pages.iter().enumerate() {
            let len = if p + 1 == pages.len() { *tail } else { PAGE };
            parts.push((page * PAGE, len));
            items.push(item(medium, page * PAGE, dst, at, len, t as u64));
            at += len;
        }
        expected.push((start, parts));
    }
    items.reverse();
    (items, expected)
}

#[test]
fn every_tag_lands_exactly_with_the_sum_of_its_bytes() {
    let engine = LocalCopyEngine::default();
    let (mut medium, mut out) = (Buf::pattern(300 * PAGE, 7), Buf(vec![0; 300 * PAGE]));
    let (m, d) = (medium.r(), out.r());
    let (items, expected) = layout(&m, &d);
    let summed = engine.transfer_summed(&items, SumOf::Destination).expect("local host items are summed");
    assert!(summed.failures.is_empty(), "{:?}", summed.failures);
    assert_eq!(summed.sums.len(), expected.len());
    for (t, (start, parts)) in expected.iter().enumerate() {
        let want: Vec<u8> = parts.iter().flat_map(|(at, len)| medium.0[*at..at + len].iter().copied()).collect();
        assert_eq!(&out.0[*start..start + want.len()], want.as_slice(), "value {t}'s bytes");
        assert_eq!(summed.sums.get(&(t as u64)), Some(&value_crc32c(&want)), "value {t}'s sum");
    }
}

/// The same layout the other way: each value is one range of the caller's buffer, written into
/// scattered pages (a put), on one thread and spread over four.
#[test]
fn a_write_into_pages_lands_exactly_with_the_sum_of_its_source() {
    let spread = LocalCopyConfig { threads: 4, parallel_threshold: 0, ..LocalCopyConfig::default() };
    for engine in [LocalCopyEngine::default(), LocalCopyEngine::new(spread)] {
        let (mut values, mut medium) = (Buf::pattern(300 * PAGE, 5), Buf(vec![0; 300 * PAGE]));
        let (v, m) = (values.r(), medium.r());
        let (reads, expected) = layout(&m, &v);
        // Each read item turned round: from the value's range into its page.
        let items: Vec<TransferItem> = reads
            .iter()
            .map(|i| item(&v, i.dst_offset as usize, &m, i.src_offset as usize, i.size as usize, i.tag))
            .collect();
        let summed = engine.transfer_summed(&items, SumOf::Source).expect("local host items are summed");
        assert!(summed.failures.is_empty(), "{:?}", summed.failures);
        assert_eq!(summed.sums.len(), expected.len());
        for (t, (start, parts)) in expected.iter().enumerate() {
            let size: usize = parts.iter().map(|(_, len)| len).sum();
            let value = &values.0[*start..start + size];
            let mut at = 0;
            for (page_at, len) in parts {
                assert_eq!(&medium.0[*page_at..page_at + len], &value[at..at + len], "value {t}'s page at {page_at}");
                at += len;
            }
            assert_eq!(summed.sums.get(&(t as u64)), Some(&value_crc32c(value)), "value {t}'s sum");
        }
        // Scattered destinations are not one range: summing what landed is declined.
        assert_eq!(engine.transfer_summed(&items, SumOf::Destination), None);
    }
}

/// A transfer of at least the stream threshold streams its stores past the cache and sums the
/// bytes it read: a read into one range and a write into scattered pages both land exactly, each
/// value with its own sum, on one thread and spread over four.
#[test]
fn a_transfer_past_the_stream_threshold_lands_exactly_with_its_sums() {
    const VALUE: usize = (1 << 20) + 3;
    let n = usize::try_from(umbp_transfer::stream_threshold() / VALUE as u64).expect("fits") + 2;
    let spread = LocalCopyConfig { threads: 4, parallel_threshold: 0, ..LocalCopyConfig::default() };
    for engine in [LocalCopyEngine::default(), LocalCopyEngine::new(spread)] {
        let (mut medium, mut out) = (Buf::pattern(n * VALUE, 11), Buf(vec![0; n * VALUE]));
        let (m, d) = (medium.r(), out.r());
        // Value t from the medium's t-th range into the destination's (n - 1 - t)-th.
        let reads: Vec<TransferItem> =
            (0..n).map(|t| item(&m, t * VALUE, &d, (n - 1 - t) * VALUE, VALUE, t as u64)).collect();
        let summed = engine.transfer_summed(&reads, SumOf::Destination).expect("local host items are summed");
        assert!(summed.failures.is_empty(), "{:?}", summed.failures);
        for t in 0..n {
            let value = &medium.0[t * VALUE..(t + 1) * VALUE];
            assert!(out.0[(n - 1 - t) * VALUE..(n - t) * VALUE] == *value, "value {t} landed");
            assert_eq!(summed.sums.get(&(t as u64)), Some(&value_crc32c(value)), "value {t}'s sum");
        }
        // And back, into the medium cleared, summing what it read.
        medium.0.fill(0);
        let writes: Vec<TransferItem> =
            (0..n).map(|t| item(&d, (n - 1 - t) * VALUE, &m, t * VALUE, VALUE, t as u64)).collect();
        let summed = engine.transfer_summed(&writes, SumOf::Source).expect("local host items are summed");
        assert!(summed.failures.is_empty(), "{:?}", summed.failures);
        for t in 0..n {
            let value = &out.0[(n - 1 - t) * VALUE..(n - t) * VALUE];
            assert!(medium.0[t * VALUE..(t + 1) * VALUE] == *value, "value {t} written back");
            assert_eq!(summed.sums.get(&(t as u64)), Some(&value_crc32c(value)), "value {t}'s sum");
        }
    }
}

#[test]
fn what_submit_would_copy_otherwise_is_declined_before_a_byte_moves() {
    let engine = LocalCopyEngine::default();
    let (mut medium, mut out) = (Buf::pattern(8 * PAGE, 3), Buf(vec![0; 8 * PAGE]));
    let (m, d) = (medium.r(), out.r());
    let cases = [
        ("a gap in the destination", vec![item(&m, 0, &d, 0, PAGE, 1), item(&m, PAGE, &d, PAGE + 1, PAGE, 1)]),
        ("a source range past its buffer", vec![item(&m, 7 * PAGE + 1, &d, 0, PAGE, 1)]),
        ("a destination range past its buffer", vec![item(&m, 0, &d, 7 * PAGE + 1, PAGE, 1)]),
        ("two tags writing one range", vec![item(&m, 0, &d, 0, PAGE, 1), item(&m, PAGE, &d, PAGE / 2, PAGE, 2)]),
        ("a copy onto its own source", vec![item(&m, 0, &m, PAGE / 2, PAGE, 1)]),
    ];
    for (what, items) in cases {
        assert_eq!(engine.transfer_summed(&items, SumOf::Destination), None, "{what}");
        assert!(out.0.iter().all(|b| *b == 0), "{what}: nothing moved");
    }
    let (mut values, mut pages) = (Buf::pattern(8 * PAGE, 4), Buf(vec![0; 8 * PAGE]));
    let (v, p) = (values.r(), pages.r());
    let cases = [
        ("a gap in the source", vec![item(&v, 0, &p, 0, PAGE, 1), item(&v, PAGE + 1, &p, 2 * PAGE, PAGE, 1)]),
        ("a destination range past its buffer", vec![item(&v, 0, &p, 7 * PAGE + 1, PAGE, 1)]),
        ("two tags writing one page", vec![item(&v, 0, &p, 0, PAGE, 1), item(&v, PAGE, &p, PAGE / 2, PAGE, 2)]),
    ];
    for (what, items) in cases {
        assert_eq!(engine.transfer_summed(&items, SumOf::Source), None, "{what}");
        assert!(pages.0.iter().all(|b| *b == 0), "{what}: nothing moved");
    }
}

#[test]
fn the_composite_sums_through_the_in_process_copy_and_charges_it() {
    let composite =
        CompositeTransferEngine::new(vec![Arc::new(LocalCopyEngine::default())], CompositeConfig { bounce_bytes: 0 })
            .expect("composite");
    let (mut medium, mut out) = (Buf::pattern(300 * PAGE, 9), Buf(vec![0; 300 * PAGE]));
    let (m, d) = (medium.r(), out.r());
    let (items, expected) = layout(&m, &d);
    let total: u64 = items.iter().map(|i| i.size).sum();
    let summed = composite.transfer_summed(&items, SumOf::Destination).expect("summed");
    assert_eq!(summed.sums.len(), expected.len());
    assert_eq!(composite.moved_bytes("LocalCopyEngine"), total);
}
