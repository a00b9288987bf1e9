//! Ranged gets and puts: parts of a stored value, each into (or from) a buffer of its own
//! (issue 21).
//!
//! A ranged put assembles one value of a stated size from ranges of several buffers — `(buffer,
//! value offset)` pairs that tile `[0, size)` exactly — through the routed put path: the slot is
//! allocated for the whole value, each range is copied into the pages it covers, and the value is
//! published by the one commit, so no reader ever sees a part of it. Its checksum is summed over
//! the ranges in value order (the same sum as of the assembled value).
//!
//! A ranged get names, per key, a set of `(buffer, value offset)` ranges — disjoint, each inside
//! the value — and reads exactly those bytes: the routed get path as for a whole value (route,
//! resolve under a read lease, one submit per holder, the lease judged, release), with one transfer
//! item per (range, page) overlap instead of one per page, so over TCP only the requested bytes
//! cross the wire, and through a mapping or a local copy only they are copied. The ranges need not
//! cover the value (a get is a subset, not a tiling); the result is the value's size.
//!
//! The resolve carries each key's ranges, so a holder may answer a **partial** hit whose pages
//! hold only the value pages the ranges span, with only their bytes: an SSD holder then reads only
//! the 4 KiB blocks from the first asked byte to the last instead of staging the whole value (a
//! whole cached copy, or a holder that predates ranges, answers whole, which serves as well).
//! Whole-value gets send no ranges and never take a partial hit.
//!
//! What a ranged get does not do: take the single-key keyed exchange (a ranged get is routed), check
//! the value's end-to-end checksum (it sums the whole value; a part cannot be checked against it),
//! or re-cache the value locally.

use umbp_core::PageLocation;

use tracing::Instrument;

use super::phases::{self, phase};
use super::support::{CallerBuf, PageLayout};
use super::*;

/// Where a get's bytes go, per key: the whole value into one buffer, or ranges of it into
/// buffers of their own.
#[derive(Debug, Clone, Copy)]
pub(super) enum Dest<'r> {
    /// The whole value, from offset 0, into one buffer at least as long.
    Whole(CallerBuf),
    /// `(buffer, value offset)`: each buffer receives `buffer.len` bytes of the value from its
    /// offset. Disjoint (checked on entry), inside the value (checked against its size).
    Ranges(&'r [(CallerBuf, u64)]),
}

impl Dest<'_> {
    /// The bytes the destination receives (what a pipelined chunk is sized by).
    pub(super) fn bytes(&self) -> u64 {
        match self {
            Self::Whole(buf) => buf.len as u64,
            Self::Ranges(ranges) => ranges.iter().map(|(b, _)| b.len as u64).sum(),
        }
    }

    /// The whole-value buffer, when this is one.
    pub(super) fn whole(&self) -> Option<CallerBuf> {
        match self {
            Self::Whole(buf) => Some(*buf),
            Self::Ranges(_) => None,
        }
    }
}

/// Where a put's bytes come from, per key: one buffer holding the whole value, or ranges of
/// buffers that tile a value of `size` bytes.
#[derive(Debug, Clone, Copy)]
pub(super) enum Src<'r> {
    /// The whole value.
    Whole(CallerBuf),
    /// `(buffer, value offset)` pairs tiling `[0, size)` (checked on entry).
    Ranges {
        /// The value's size.
        size: u64,
        /// The parts.
        parts: &'r [(CallerBuf, u64)],
    },
}

impl Src<'_> {
    /// The value's size.
    pub(super) fn size(&self) -> u64 {
        match self {
            Self::Whole(buf) => buf.len as u64,
            Self::Ranges { size, .. } => *size,
        }
    }

    /// The buffers, in value order.
    pub(super) fn parts(&self) -> Vec<CallerBuf> {
        match self {
            Self::Whole(buf) => vec![*buf],
            Self::Ranges { parts, .. } => {
                let mut sorted: Vec<(CallerBuf, u64)> = parts.to_vec();
                sorted.sort_unstable_by_key(|(_, offset)| *offset);
                sorted.into_iter().map(|(b, _)| b).collect()
            }
        }
    }
}

/// Why a put's ranges cannot assemble a value of `size` bytes: they must tile `[0, size)` exactly
/// (no gap, no overlap, nothing past the end), and `size` must not be 0.
pub(super) fn check_tiling(parts: &[(CallerBuf, u64)], size: u64) -> Result<(), String> {
    if size == 0 {
        return Err("a value of 0 bytes".into());
    }
    check_ranges(parts)?;
    let mut spans: Vec<(u64, u64)> = parts.iter().map(|(b, o)| (*o, *o + b.len as u64)).collect();
    spans.sort_unstable();
    let mut at = 0;
    for (start, end) in spans {
        if start != at {
            return Err(format!("no range covers [{at}, {start})"));
        }
        at = end;
    }
    match at.cmp(&size) {
        std::cmp::Ordering::Less => Err(format!("no range covers [{at}, {size})")),
        std::cmp::Ordering::Greater => Err(format!("the ranges end at {at}, past the value's {size} bytes")),
        std::cmp::Ordering::Equal => Ok(()),
    }
}

/// One transfer item per (range, page) overlap from each range's buffer into the slot's pages;
/// the mirror of [`range_items`] (same checks).
pub(super) fn range_put_items(
    parts: &[(CallerBuf, u64)],
    size: u64,
    layout: PageLayout<'_>,
    tag: u64,
    place: impl FnMut(CallerBuf) -> (TransferRef, u64),
) -> Result<Vec<TransferItem>, String> {
    let mut items = range_items(parts, size, layout, tag, place)?;
    for t in &mut items {
        std::mem::swap(&mut t.src, &mut t.dst);
        std::mem::swap(&mut t.src_offset, &mut t.dst_offset);
    }
    Ok(items)
}

/// Why a key's ranges cannot be read, before any call: none, an empty one, an offset past
/// `u64::MAX`, or two that overlap.
pub(super) fn check_ranges(ranges: &[(CallerBuf, u64)]) -> Result<(), String> {
    if ranges.is_empty() {
        return Err("no ranges".into());
    }
    let mut spans: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (i, (buf, offset)) in ranges.iter().enumerate() {
        if buf.len == 0 {
            return Err(format!("range {i} is empty"));
        }
        let end = offset
            .checked_add(buf.len as u64)
            .ok_or_else(|| format!("range {i} ({} bytes at {offset}) ends past the largest offset", buf.len))?;
        spans.push((*offset, end));
    }
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(format!("ranges [{}, {}) and [{}, {}) overlap", w[0].0, w[0].1, w[1].0, w[1].1));
    }
    Ok(())
}

/// One transfer item per (range, page) overlap from the medium's pages into each range's buffer
/// (`place` gives a buffer's transfer ref and its offset in it). An error names a range outside the
/// value or pages that cannot hold it.
pub(super) fn range_items(
    ranges: &[(CallerBuf, u64)],
    size: u64,
    layout: PageLayout<'_>,
    tag: u64,
    mut place: impl FnMut(CallerBuf) -> (TransferRef, u64),
) -> Result<Vec<TransferItem>, String> {
    let PageLayout { pages, refs, page_size, partial_from } = layout;
    // Whole: every page of the value. Partial: value pages `first_page ..`, inside the value; each
    // range must then lie in them (checked per range below).
    let value_pages = if page_size == 0 { 0 } else { size.div_ceil(page_size) };
    let first_page = partial_from.unwrap_or(0);
    let fits = match partial_from {
        None => pages.len() as u64 == value_pages,
        Some(first) => !pages.is_empty() && first.saturating_add(pages.len() as u64) <= value_pages,
    };
    if page_size == 0 || !fits {
        return Err(format!(
            "{} pages of {page_size} bytes from page {first_page} cannot hold {size} bytes",
            pages.len()
        ));
    }
    let medium_ref = |page: &PageLocation| match refs.get(page.buffer_index as usize) {
        Some(Some(r)) => Ok(r.clone()),
        _ => Err(format!("no descriptor for buffer {}", page.buffer_index)),
    };
    let mut items = Vec::with_capacity(ranges.len());
    for (buf, offset) in ranges {
        let end = offset
            .checked_add(buf.len as u64)
            .filter(|end| *end <= size)
            .ok_or_else(|| format!("a range of {} bytes at {offset} reaches past the value's {size} bytes", buf.len))?;
        let (dst, dst_base) = place(*buf);
        let mut at = *offset;
        while at < end {
            let page = (at / page_size)
                .checked_sub(first_page)
                .and_then(|p| pages.get(usize::try_from(p).ok()?))
                .ok_or_else(|| format!("byte {at} lies outside the {} pages from page {first_page}", pages.len()))?;
            let in_page = at % page_size;
            let len = (page_size - in_page).min(end - at);
            items.push(TransferItem {
                src: medium_ref(page)?,
                src_offset: u64::from(page.page_index) * page_size + in_page,
                dst: dst.clone(),
                dst_offset: dst_base + (at - offset),
                size: len,
                tag,
            });
            at += len;
        }
    }
    Ok(items)
}

impl PoolClient {
    /// Reads parts of each key's value: `ranges[i]` holds `(buffer, value offset)` pairs for
    /// `keys[i]`, each buffer filled with `buffer.len()` bytes of the value from its offset. One
    /// result per key (the value's size), in order. A key's ranges must be non-empty, disjoint and
    /// inside the value, else that key fails with [`KeyError::BadRanges`] and nothing is read for it;
    /// they need not cover the value. A key without ranges (fewer lists than keys) gets
    /// [`KeyError::NoBuffer`]. On an error a key's buffers are unspecified. See the `ranged` module
    /// for what a ranged get does not do (the keyed exchange, the checksum, re-caching).
    pub async fn batch_get_ranges(
        &self,
        keys: &[&str],
        ranges: &mut [Vec<(&mut [u8], u64)>],
    ) -> Vec<Result<u64, KeyError>> {
        let lists: Vec<Vec<(CallerBuf, u64)>> =
            ranges.iter_mut().map(|list| list.iter_mut().map(|(b, o)| (CallerBuf::of_mut(b), *o)).collect()).collect();
        self.get_range_lists(keys, &lists).await
    }

    /// [`batch_get_ranges`](Self::batch_get_ranges) into raw ranges `(ptr, len, value offset)`, as
    /// [`batch_get_raw`](Self::batch_get_raw) is to [`batch_get`](Self::batch_get).
    ///
    /// # Safety
    /// As [`batch_get_raw`](Self::batch_get_raw), for every range of every key: no two ranges
    /// overlap in memory, of one key or of several.
    pub async unsafe fn batch_get_ranges_raw(&self, keys: &[&str], ranges: &[RawParts]) -> Vec<Result<u64, KeyError>> {
        let lists: Vec<Vec<(CallerBuf, u64)>> = ranges
            .iter()
            .map(|list| list.iter().map(|(ptr, len, o)| (CallerBuf { ptr: *ptr, len: *len }, *o)).collect())
            .collect();
        self.get_range_lists(keys, &lists).await
    }

    async fn get_range_lists(&self, keys: &[&str], lists: &[Vec<(CallerBuf, u64)>]) -> Vec<Result<u64, KeyError>> {
        let checked: Vec<Option<Result<u64, KeyError>>> =
            lists.iter().map(|l| check_ranges(l).err().map(|message| Err(KeyError::BadRanges { message }))).collect();
        let dests: Vec<Dest<'_>> = lists.iter().map(|l| Dest::Ranges(l)).collect();
        self.get_dests(keys, &dests, &checked).instrument(phase!(phases::GET)).await
    }
}

/// The parts of one ranged put: `(bytes, value offset)` pairs.
pub type PutParts<'a> = Vec<(&'a [u8], u64)>;

/// The raw parts of one ranged call: `(pointer, length, value offset)` triples.
pub type RawParts = Vec<(NonNull<u8>, usize, u64)>;

impl PoolClient {
    /// Writes values assembled from ranges: `items[i]` is `(key, value size, parts)`, each part a
    /// `(buffer, value offset)` pair, the parts tiling `[0, size)` exactly. The value is published
    /// whole by one commit (no reader sees a part); one result per item, as
    /// [`batch_put_outcomes`](Self::batch_put_outcomes). A key whose parts do not tile its size fails
    /// with [`KeyError::BadRanges`] and nothing is written for it.
    pub async fn batch_put_ranges(&self, items: &[(&str, u64, PutParts<'_>)]) -> Vec<Result<PutOutcome, KeyError>> {
        let lists: Vec<Vec<(CallerBuf, u64)>> =
            items.iter().map(|(_, _, parts)| parts.iter().map(|(b, o)| (CallerBuf::of(b), *o)).collect()).collect();
        self.put_range_lists(items.iter().map(|(k, size, _)| (*k, *size)).collect(), &lists).await
    }

    /// [`batch_put_ranges`](Self::batch_put_ranges) from raw parts `(ptr, len, value offset)`, as
    /// [`batch_put_raw`](Self::batch_put_raw) is to [`batch_put`](Self::batch_put).
    ///
    /// # Safety
    /// As [`batch_put_raw`](Self::batch_put_raw), for every part of every item.
    pub async unsafe fn batch_put_ranges_raw(
        &self,
        items: &[(&str, u64, RawParts)],
    ) -> Vec<Result<PutOutcome, KeyError>> {
        let lists: Vec<Vec<(CallerBuf, u64)>> = items
            .iter()
            .map(|(_, _, parts)| parts.iter().map(|(ptr, len, o)| (CallerBuf { ptr: *ptr, len: *len }, *o)).collect())
            .collect();
        self.put_range_lists(items.iter().map(|(k, size, _)| (*k, *size)).collect(), &lists).await
    }

    async fn put_range_lists(
        &self,
        keys: Vec<(&str, u64)>,
        lists: &[Vec<(CallerBuf, u64)>],
    ) -> Vec<Result<PutOutcome, KeyError>> {
        let failed: Vec<Option<Result<PutOutcome, KeyError>>> = keys
            .iter()
            .zip(lists)
            .map(|((_, size), l)| check_tiling(l, *size).err().map(|message| Err(KeyError::BadRanges { message })))
            .collect();
        let items: Vec<(&str, Src<'_>)> =
            keys.iter().zip(lists).map(|((k, size), parts)| (*k, Src::Ranges { size: *size, parts })).collect();
        self.put_srcs(&items, &failed).instrument(phase!(phases::PUT)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(len: usize) -> CallerBuf {
        // Never dereferenced by these tests.
        CallerBuf { ptr: NonNull::dangling(), len }
    }

    #[test]
    fn put_ranges_must_tile_the_value() {
        assert!(check_tiling(&[(buf(4), 4), (buf(4), 0)], 8).is_ok());
        assert!(check_tiling(&[(buf(8), 0)], 8).is_ok());
        assert!(check_tiling(&[(buf(4), 0), (buf(3), 5)], 8).unwrap_err().contains("[4, 5)"), "a gap");
        assert!(check_tiling(&[(buf(4), 0)], 8).unwrap_err().contains("[4, 8)"), "short");
        assert!(check_tiling(&[(buf(9), 0)], 8).unwrap_err().contains("past"), "long");
        assert!(check_tiling(&[(buf(4), 0), (buf(4), 2)], 6).unwrap_err().contains("overlap"));
        assert!(check_tiling(&[], 0).is_err() && check_tiling(&[(buf(1), 0)], 0).is_err(), "empty value");
    }

    #[test]
    fn ranges_must_be_non_empty_disjoint_and_addressable() {
        assert!(check_ranges(&[(buf(4), 0), (buf(4), 4), (buf(1), 100)]).is_ok(), "touching ranges are disjoint");
        assert!(check_ranges(&[(buf(4), 8), (buf(4), 0)]).is_ok(), "in any order");
        assert!(check_ranges(&[]).is_err(), "none");
        assert!(check_ranges(&[(buf(0), 0)]).unwrap_err().contains("empty"));
        assert!(check_ranges(&[(buf(4), 0), (buf(4), 3)]).unwrap_err().contains("overlap"));
        assert!(check_ranges(&[(buf(8), 10), (buf(2), 12)]).unwrap_err().contains("overlap"), "one inside another");
        assert!(check_ranges(&[(buf(2), u64::MAX)]).unwrap_err().contains("past the largest offset"));
    }

    #[test]
    fn items_cover_each_range_page_by_page_and_nothing_else() {
        let region = TransferRef::remote_only(
            umbp_core::RemoteRegion { endpoint: "127.0.0.1:1".into(), region_id: 3 },
            1 << 20,
            MemoryLocation::Host,
        );
        let refs = [Some(region)];
        // A value of 10 000 bytes on pages 7, 2 and 5 of 4096 bytes.
        let pages = [PageLocation::new(0, 7), PageLocation::new(0, 2), PageLocation::new(0, 5)];
        let layout = PageLayout { pages: &pages, refs: &refs, page_size: 4096, partial_from: None };
        let place = |b: CallerBuf| {
            (
                TransferRef::remote_only(
                    umbp_core::RemoteRegion { endpoint: "me".into(), region_id: 9 },
                    1 << 20,
                    MemoryLocation::Host,
                ),
                b.len as u64,
            )
        };
        // 100 bytes from 4000 (spanning pages 0 and 1), 8 bytes from 9000 (page 2).
        let items = range_items(&[(buf(100), 4000), (buf(8), 9000)], 10_000, layout, 5, place).expect("items");
        let got: Vec<(u64, u64, u64)> = items.iter().map(|t| (t.src_offset, t.dst_offset, t.size)).collect();
        assert_eq!(
            got,
            [(7 * 4096 + 4000, 100, 96), (2 * 4096, 100 + 96, 4), (5 * 4096 + (9000 - 8192), 8, 8)],
            "(medium offset, caller offset, bytes) per overlap"
        );
        assert!(items.iter().all(|t| t.tag == 5));
        let err = range_items(&[(buf(10), 9995)], 10_000, layout, 5, place).unwrap_err();
        assert!(err.contains("reaches past"), "{err}");
        let err = range_items(&[(buf(1), 0)], 20_000, layout, 5, place).unwrap_err();
        assert!(err.contains("cannot hold"), "{err}");
        // A partial hit: pages 7 and 2 hold value pages 2 and 3 of a 20 000-byte value.
        let part = PageLayout { pages: &pages[..2], partial_from: Some(2), ..layout };
        let items = range_items(&[(buf(8), 3 * 4096 - 4)], 20_000, part, 5, place).expect("items");
        let got: Vec<(u64, u64, u64)> = items.iter().map(|t| (t.src_offset, t.dst_offset, t.size)).collect();
        assert_eq!(got, [(7 * 4096 + 4092, 8, 4), (2 * 4096, 12, 4)], "offsets from the part's first page");
        let err = range_items(&[(buf(4), 100)], 20_000, part, 5, place).unwrap_err();
        assert!(err.contains("outside"), "a range before the part: {err}");
        let err = range_items(&[(buf(4), 4 * 4096)], 20_000, part, 5, place).unwrap_err();
        assert!(err.contains("outside"), "a range after the part: {err}");
        let past = PageLayout { partial_from: Some(4), ..part };
        assert!(range_items(&[(buf(1), 4 * 4096)], 20_000, past, 5, place).unwrap_err().contains("cannot hold"));
        let none = PageLayout { pages: &[], partial_from: Some(0), ..layout };
        assert!(range_items(&[(buf(1), 0)], 20_000, none, 5, place).unwrap_err().contains("cannot hold"));
    }
}
