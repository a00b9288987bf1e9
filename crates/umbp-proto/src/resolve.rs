//! The struct-of-arrays codec of `BatchResolveKeys` (the reference's `batch_resolve_codec.h`).
//!
//! A reply carries one entry per requested key in parallel arrays (`found`, `tier`, `size`,
//! `page_count`, `backend_id`) and the pages of every hit flattened into `buffer_index` /
//! `page_index`: key `i` owns the next `page_count[i]` entries. Buffer descriptors travel once per
//! batch, deduplicated by `(backend_id, buffer_index)`, instead of once per key.
//!
//! Optional per-key arrays ride along: `busy` (the node holds the key but cannot serve it now:
//! retry this node), `lease_id` (the read lease a hit holds, for `ReleaseReads`) and the pair
//! `checksummed` / `crc32c` (the CRC-32C a hit's writer committed with it). Each is sent only when
//! some key needs it; an empty one decodes as all false / all 0 / no checksum.
//!
//! A hit of a key asked with byte ranges may be **partial**: the pair `partial` / `first_page`
//! (sent only when some hit is) says that its pages hold value pages `first_page ..` and only the
//! asked bytes in them. A whole hit's pages cover its size; a partial hit's lie inside the value.
//!
//! Both directions are pure functions. The decoder trusts nothing: a reply whose arrays disagree is
//! rejected as a whole (an error, never a panic and never a page sliced from the wrong key).

use umbp_core::{BufferDesc, MAX_BACKENDS_PER_PEER, PageLocation, TierType};

use crate::convert::{WireError, tier_from_wire, tier_to_wire};
use crate::v1 as pb;

/// Where one key's bytes are, as a `BatchResolveKeys` reply states it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ResolvedKey {
    /// The tier of the medium that serves the key.
    pub tier: TierType,
    /// The registry id of that medium on its node (the `backend_id` of its descriptors).
    pub backend_id: u32,
    /// Value size in bytes.
    pub size: u64,
    /// The pages, in value order; buffer indexes are local to `backend_id`.
    pub pages: Vec<PageLocation>,
    /// The read lease the hit holds on that medium, to release once the copy is done (0: none).
    pub lease: u64,
    /// The CRC-32C its writer committed with the value, for the reader to check its copy against.
    pub crc32c: Option<u32>,
    /// Only the asked ranges' bytes are in the pages, which hold value pages `first_page ..
    /// first_page + pages.len()` (see `umbp_core::ResolvedEntry::partial`).
    pub partial: bool,
    /// The value page `pages[0]` holds (0 unless `partial`).
    pub first_page: u64,
}

/// A decoded `BatchResolveKeys` reply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DecodedResolve {
    /// The node's page size (0 from a node without media).
    pub page_size: u64,
    /// Descriptors of the buffers the hits live in, stamped with their backend ids; empty when the
    /// request set `omit_descs`.
    pub descs: Vec<BufferDesc>,
    /// One entry per requested key, in request order; `None` is a miss (or busy).
    pub keys: Vec<Option<ResolvedKey>>,
    /// One entry per requested key: the node holds the key but cannot serve it now (retry this
    /// node shortly; never set for a hit).
    pub busy: Vec<bool>,
}

/// Encodes a `BatchResolveKeys` reply: one entry per key (`None` = miss), which misses are busy
/// (`busy[i]` for key `i`; a shorter slice leaves the rest not busy, a hit is never busy), the
/// batch's descriptors (already deduplicated and stamped; pass none when the request set
/// `omit_descs`) and the node's page size.
///
/// A miss is sent as `found = false` with tier, size, backend id and page count 0 and no pages. A key
/// with more than `u32::MAX` pages cannot be represented; its count saturates and the reply then
/// decodes as [`WireError::PageCountMismatch`] rather than as wrong pages.
pub fn encode_batch_resolve(
    keys: &[Option<ResolvedKey>],
    busy: &[bool],
    descs: &[BufferDesc],
    page_size: u64,
) -> pb::BatchResolveKeysResponse {
    let n = keys.len();
    let total_pages: usize = keys.iter().flatten().map(|k| k.pages.len()).sum();
    let mut out = pb::BatchResolveKeysResponse {
        descs: descs.iter().map(pb::BufferDesc::from).collect(),
        page_size,
        found: Vec::with_capacity(n),
        tier: Vec::with_capacity(n),
        size: Vec::with_capacity(n),
        page_count: Vec::with_capacity(n),
        buffer_index: Vec::with_capacity(total_pages),
        page_index: Vec::with_capacity(total_pages),
        backend_id: Vec::with_capacity(n),
        busy: Vec::new(),
        lease_id: Vec::new(),
        checksummed: Vec::new(),
        crc32c: Vec::new(),
        partial: Vec::new(),
        first_page: Vec::new(),
    };
    let busy_at = |i: usize| keys[i].is_none() && busy.get(i).copied().unwrap_or(false);
    if (0..n).any(busy_at) {
        out.busy = (0..n).map(busy_at).collect();
    }
    if keys.iter().flatten().any(|k| k.lease != 0) {
        out.lease_id = keys.iter().map(|k| k.as_ref().map_or(0, |k| k.lease)).collect();
    }
    if keys.iter().flatten().any(|k| k.crc32c.is_some()) {
        let crc = |k: &Option<ResolvedKey>| k.as_ref().and_then(|k| k.crc32c);
        out.checksummed = keys.iter().map(|k| crc(k).is_some()).collect();
        out.crc32c = keys.iter().map(|k| crc(k).unwrap_or(0)).collect();
    }
    if keys.iter().flatten().any(|k| k.partial) {
        let part = |k: &Option<ResolvedKey>| k.as_ref().filter(|k| k.partial).map(|k| k.first_page);
        out.partial = keys.iter().map(|k| part(k).is_some()).collect();
        out.first_page = keys.iter().map(|k| part(k).unwrap_or(0)).collect();
    }
    for key in keys {
        match key {
            Some(k) => {
                out.found.push(true);
                out.tier.push(tier_to_wire(k.tier));
                out.size.push(k.size);
                out.page_count.push(u32::try_from(k.pages.len()).unwrap_or(u32::MAX));
                out.backend_id.push(k.backend_id);
                out.buffer_index.extend(k.pages.iter().map(|p| p.buffer_index));
                out.page_index.extend(k.pages.iter().map(|p| p.page_index));
            }
            None => {
                out.found.push(false);
                out.tier.push(tier_to_wire(TierType::Unknown));
                out.size.push(0);
                out.page_count.push(0);
                out.backend_id.push(0);
            }
        }
    }
    out
}

/// Decodes a `BatchResolveKeys` reply.
///
/// # Errors
/// Any inconsistency fails the whole batch: a per-key array whose length differs from `found`'s,
/// flattened arrays of different lengths, page counts that do not sum to the flattened length, a miss
/// with pages, a whole hit whose pages cannot hold its size, a partial hit with no pages or pages
/// past its value (or a partial miss, or a first page for a whole hit), a backend id ≥
/// `MAX_BACKENDS_PER_PEER`, or a descriptor of an unknown memory kind.
pub fn decode_batch_resolve(resp: &pb::BatchResolveKeysResponse) -> Result<DecodedResolve, WireError> {
    let n = resp.found.len();
    for (field, len) in [
        ("tier", resp.tier.len()),
        ("size", resp.size.len()),
        ("page_count", resp.page_count.len()),
        ("backend_id", resp.backend_id.len()),
    ] {
        if len != n {
            return Err(WireError::MismatchedArrays { field, len, expected: n });
        }
    }
    // Optional arrays: absent (empty) or one entry per key.
    for (field, len) in [
        ("busy", resp.busy.len()),
        ("lease_id", resp.lease_id.len()),
        ("checksummed", resp.checksummed.len()),
        ("crc32c", resp.crc32c.len()),
        ("partial", resp.partial.len()),
        ("first_page", resp.first_page.len()),
    ] {
        if len != 0 && len != n {
            return Err(WireError::MismatchedArrays { field, len, expected: n });
        }
    }
    if resp.checksummed.len() != resp.crc32c.len() {
        return Err(WireError::MismatchedArrays {
            field: "crc32c",
            len: resp.crc32c.len(),
            expected: resp.checksummed.len(),
        });
    }
    if resp.partial.len() != resp.first_page.len() {
        return Err(WireError::MismatchedArrays {
            field: "first_page",
            len: resp.first_page.len(),
            expected: resp.partial.len(),
        });
    }
    if resp.buffer_index.len() != resp.page_index.len() {
        return Err(WireError::MismatchedPageArrays {
            buffer_index: resp.buffer_index.len(),
            page_index: resp.page_index.len(),
        });
    }
    let flattened = resp.buffer_index.len();
    let declared: u64 = resp.page_count.iter().map(|c| u64::from(*c)).sum();
    if usize::try_from(declared).ok() != Some(flattened) {
        return Err(WireError::PageCountMismatch { declared, flattened });
    }
    let descs = resp
        .descs
        .iter()
        .map(|d| {
            check_backend_id(d.backend_id)?;
            BufferDesc::try_from(d)
        })
        .collect::<Result<Vec<_>, _>>()?;

    let mut keys = Vec::with_capacity(n);
    let mut busy = Vec::with_capacity(n);
    let mut at = 0usize;
    for i in 0..n {
        // Every index below is < n (checked above) and every page range lies inside the flattened
        // arrays (counts sum to their length), so no access can panic.
        let count = resp.page_count[i];
        let busy_i = resp.busy.get(i).copied().unwrap_or(false);
        let partial = resp.partial.get(i).copied().unwrap_or(false);
        let first_page = resp.first_page.get(i).copied().unwrap_or(0);
        if !resp.found[i] {
            if count != 0 {
                return Err(WireError::PagesForMiss { key_index: i, page_count: count });
            }
            if partial {
                return Err(WireError::BadPartial { key_index: i, reason: "a miss" });
            }
            keys.push(None);
            busy.push(busy_i);
            continue;
        }
        if busy_i {
            return Err(WireError::BusyHit { key_index: i });
        }
        let size = resp.size[i];
        let backend_id = resp.backend_id[i];
        check_backend_id(backend_id)?;
        if partial {
            // Inside the value: at least one page, none past its last.
            let value_pages = if resp.page_size == 0 { 0 } else { size.div_ceil(resp.page_size) };
            if count == 0 || first_page.checked_add(u64::from(count)).is_none_or(|end| end > value_pages) {
                return Err(WireError::BadPartial { key_index: i, reason: "pages outside the value" });
            }
        } else if first_page != 0 {
            return Err(WireError::BadPartial { key_index: i, reason: "a first page for a whole hit" });
        } else if u64::from(count).saturating_mul(resp.page_size) < size {
            return Err(WireError::PagesDoNotCoverSize {
                key_index: i,
                size,
                page_count: count,
                page_size: resp.page_size,
            });
        }
        // `count` ≤ Σ page_count = flattened, a usize: the conversion cannot fail.
        let end = at + usize::try_from(count).unwrap_or(usize::MAX);
        let pages = resp.buffer_index[at..end]
            .iter()
            .zip(&resp.page_index[at..end])
            .map(|(b, p)| PageLocation::new(*b, *p))
            .collect();
        at = end;
        let lease = resp.lease_id.get(i).copied().unwrap_or(0);
        let crc32c = match resp.checksummed.get(i) {
            Some(true) => resp.crc32c.get(i).copied(),
            _ => None,
        };
        let tier = tier_from_wire(resp.tier[i]);
        keys.push(Some(ResolvedKey { tier, backend_id, size, pages, lease, crc32c, partial, first_page }));
        busy.push(false);
    }
    Ok(DecodedResolve { page_size: resp.page_size, descs, keys, busy })
}

fn check_backend_id(backend_id: u32) -> Result<(), WireError> {
    if usize::try_from(backend_id).is_ok_and(|id| id < MAX_BACKENDS_PER_PEER) {
        Ok(())
    } else {
        Err(WireError::BackendIdOutOfRange { backend_id })
    }
}

/// Puts per-key byte ranges on a `BatchResolveKeys` request: `ranges[i]` are `(offset, length)`
/// pairs of key `i`'s value (empty, or missing when `ranges` is shorter: the whole value). Nothing
/// is added when no key has ranges, so the request is what an older client sends.
pub fn encode_request_ranges(request: &mut pb::BatchResolveKeysRequest, ranges: &[Vec<(u64, u64)>]) {
    let n = request.keys.len();
    if !ranges.iter().take(n).any(|r| !r.is_empty()) {
        return;
    }
    let of = |i: usize| ranges.get(i).map_or(&[][..], Vec::as_slice);
    request.range_count = (0..n).map(|i| u32::try_from(of(i).len()).unwrap_or(u32::MAX)).collect();
    for i in 0..n {
        request.range_offset.extend(of(i).iter().map(|r| r.0));
        request.range_length.extend(of(i).iter().map(|r| r.1));
    }
}

/// The per-key byte ranges of a `BatchResolveKeys` request: one list per key (empty: the whole
/// value), or no lists at all when the request has none. Ranges whose arrays disagree with the
/// keys (a count per key, counts summing to the pairs) read as none: a whole value is always a
/// correct answer, so a malformed hint costs only the bytes it would have saved.
pub fn decode_request_ranges(request: &pb::BatchResolveKeysRequest) -> Vec<Vec<(u64, u64)>> {
    let n = request.keys.len();
    let pairs = request.range_offset.len();
    let declared: u64 = request.range_count.iter().map(|c| u64::from(*c)).sum();
    if request.range_count.len() != n
        || request.range_length.len() != pairs
        || usize::try_from(declared).ok() != Some(pairs)
    {
        return Vec::new();
    }
    let mut at = 0usize;
    request
        .range_count
        .iter()
        .map(|c| {
            // The counts sum to `pairs` (checked above): every run lies inside the arrays.
            let end = at + *c as usize;
            let run = request.range_offset[at..end].iter().copied().zip(request.range_length[at..end].iter().copied());
            at = end;
            run.collect()
        })
        .collect()
}
