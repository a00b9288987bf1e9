//! Ranged resolves: a reader that wants only parts of a value gets only the blocks they cover read
//! from the drive (issue 21: "an SSD node reads only the blocks the ranges cover").
//!
//! Per key: a cached whole staged copy is served as for any resolve (it costs no drive read).
//! Otherwise the 4 KiB blocks of the value from the first asked byte to the last are read — with
//! the record's header block, each at 4 KiB-aligned drive offsets for `O_DIRECT` (the value
//! starts on the block after the header) — into staging pages for the value pages they lie in, at
//! their offsets in those pages (pages are multiples of 4 KiB), and answered as a **partial** hit
//! ([`ResolvedEntry::partial`], [`ResolvedEntry::first_page`]) under a lease of its own. So a
//! part of a one-page value (the default layout) reads only its blocks too. The pages are the
//! reader's copy, held like a dropped key's deferred pages (released by `release_reads` or at the
//! lease's end) and never a cached copy: a later whole read stages the whole value.
//!
//! What a partial read checks: the header (its own CRC, and that it names this key, size,
//! sequence number and writer's checksum — the same as a whole read). What it cannot check: the
//! record's data CRC, which sums the key and the *whole* value, so the bytes of a part go
//! unverified by the medium (the hit carries no `crc32c`, since there is no whole value to check
//! against either).
//!
//! No single flight: a partial read stages only its own reader's pages and shares them with no
//! one, so there is nothing to merge into; following a concurrent whole read would wait for more IO
//! than the part needs. A span covering every block of the value is read as a whole value (cached,
//! fully checked, single flight).

use super::state::JobSlot;
use super::*;

/// A partial read between its lock phases.
struct PartJob {
    /// The key's position in the request.
    index: usize,
    key: String,
    /// The value page the staged pages start at.
    first_page: u64,
    /// The value's bytes `[blocks.0, blocks.1)` are read: whole 4 KiB blocks of the record.
    blocks: (u64, u64),
    pages: Vec<PageLocation>,
    size: u64,
    file: Arc<SegmentFile>,
    loc: Loc,
    header: AlignedBuf,
    generation: u64,
    crc32c: Option<u32>,
    outcome: JobOutcome,
}

/// What phase 1 decided for one key of a ranged resolve.
enum Step {
    Done(ResolvedEntry),
    /// Resolve it as a whole value.
    Whole,
    /// A partial read, in the job list.
    Part,
}

impl SsdBackend {
    /// `batch_resolve_ranges`: whole-value resolves for keys without ranges (or whose ranges span
    /// every page), partial reads for the rest, every hit re-validated at the end.
    pub(super) fn resolve_ranges(
        &self,
        keys: &[String],
        ranges: &[Vec<(u64, u64)>],
        include_descs: bool,
    ) -> Vec<ResolvedEntry> {
        let inner = &self.inner;
        let config = &inner.config;
        let (Some(published), Some(engine)) = (inner.published.read().clone(), inner.engine()) else {
            return keys.iter().map(|_| ResolvedEntry::miss()).collect();
        };
        let descs = include_descs.then_some(published.as_ref());
        let ps = config.page_size;
        let now = config.clock.now();
        let lease_until = now + config.read_lease_ttl;
        let mut steps = Vec::with_capacity(keys.len());
        let mut jobs = Vec::new();
        {
            let mut state = inner.state.lock();
            let generation = state.generation();
            for (i, key) in keys.iter().enumerate() {
                let asked = ranges.get(i).map_or(&[][..], Vec::as_slice);
                if asked.is_empty() {
                    steps.push(Step::Whole);
                    continue;
                }
                if let Some(hit) = state.hold_staged(key, now, lease_until) {
                    bump(&inner.counters.staged_hit);
                    steps.push(Step::Done(inner.entry(descs, hit)));
                    continue;
                }
                let Some(owned) = state.owned(key) else {
                    steps.push(Step::Done(ResolvedEntry::miss()));
                    continue;
                };
                let value_end = record::align_up(owned.size);
                let blocks = umbp_core::covering_span(asked, owned.size)
                    .map(|(lo, hi)| (lo / record::ALIGN * record::ALIGN, record::align_up(hi)))
                    .filter(|b| *b != (0, value_end));
                let Some(blocks) = blocks else {
                    steps.push(Step::Whole);
                    continue;
                };
                let first_page = blocks.0 / ps;
                let count = blocks.1.div_ceil(ps) - first_page;
                let Some(file) = state.log().segs.get(&owned.loc.seg).map(|s| Arc::clone(&s.file)) else {
                    steps.push(Step::Done(ResolvedEntry::miss()));
                    continue;
                };
                let Some(pages) = state.take_staging(count, now) else {
                    // Busy, as a whole read would answer (see `resolve_round`).
                    let stageable = state.stageable(count);
                    if stageable {
                        bump(&inner.counters.staging_full_reject);
                    }
                    steps.push(Step::Done(if stageable { ResolvedEntry::busy() } else { ResolvedEntry::miss() }));
                    continue;
                };
                let Ok(header) = AlignedBuf::zeroed(header_len(key.len()) as usize) else {
                    state.free(&pages);
                    steps.push(Step::Done(ResolvedEntry::miss()));
                    continue;
                };
                // Counted as a drive read of the key (it is not evicted under the read).
                state.start_read(key, false);
                steps.push(Step::Part);
                jobs.push(PartJob {
                    index: i,
                    key: key.clone(),
                    first_page,
                    blocks,
                    pages,
                    size: owned.size,
                    file,
                    loc: owned.loc,
                    header,
                    generation,
                    crc32c: owned.crc32c,
                    outcome: JobOutcome::IoError,
                });
            }
            inner.update_staging_gauge(&state);
        }
        // The whole-value keys go through the ordinary resolve (single flight, caching).
        let whole_at: Vec<usize> = (0..keys.len()).filter(|i| matches!(steps[*i], Step::Whole)).collect();
        let mut whole = if whole_at.is_empty() {
            Vec::new()
        } else {
            let whole_keys: Vec<String> = whole_at.iter().map(|i| keys[*i].clone()).collect();
            self.resolve(&whole_keys, include_descs)
        }
        .into_iter();
        let mut entries: Vec<ResolvedEntry> = steps
            .into_iter()
            .map(|step| match step {
                Step::Done(entry) => entry,
                Step::Whole => whole.next().unwrap_or_else(ResolvedEntry::miss),
                Step::Part => ResolvedEntry::miss(),
            })
            .collect();
        if !jobs.is_empty() {
            inner.read_parts(engine.as_ref(), &published, &mut jobs);
            let now = config.clock.now();
            let until = now + config.read_lease_ttl;
            let mut state = inner.state.lock();
            for job in jobs {
                let slot = JobSlot {
                    pages: job.pages.clone(),
                    size: job.size,
                    loc: job.loc,
                    generation: job.generation,
                    crc32c: job.crc32c,
                };
                if let Some(lease) = state.finish_partial(&job.key, slot, job.outcome, now, until) {
                    entries[job.index] = ResolvedEntry {
                        found: true,
                        pages: job.pages,
                        size: job.size,
                        page_size: ps,
                        descs: descs.map(|p| vec![p.desc.clone()]).unwrap_or_default(),
                        lease,
                        // A part cannot be checked against the whole value's sum.
                        crc32c: None,
                        partial: true,
                        first_page: job.first_page,
                        ..ResolvedEntry::default()
                    };
                }
            }
            inner.update_staging_gauge(&state);
        }
        // Every hit taken here (staged hits before the drive IO, parts after it) is checked again
        // and renewed; the whole-value keys' resolve did that for its own.
        let now = config.clock.now();
        let until = now + config.read_lease_ttl;
        let mut state = inner.state.lock();
        for (i, (key, entry)) in keys.iter().zip(entries.iter_mut()).enumerate() {
            if entry.found && whole_at.binary_search(&i).is_err() {
                state.revalidate(key, entry, now, until);
            }
        }
        drop(state);
        entries
    }
}

impl Inner {
    /// Reads each partial job's header block and value span into its buffers (no lock held) and
    /// judges the header; counts the drive bytes read and those a whole read would have added.
    fn read_parts(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [PartJob]) {
        let ps = self.config.page_size;
        let mut ops = Vec::with_capacity(2 * jobs.len());
        let mut opened = Vec::with_capacity(jobs.len());
        for job in jobs.iter_mut() {
            let f = match job.file.file() {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a segment to read");
                    opened.push(false);
                    continue;
                }
            };
            // Each staged page receives the blocks of its value page that lie in the span.
            let (lo, hi) = job.blocks;
            let mut segs = Vec::with_capacity(job.pages.len());
            for (j, p) in job.pages.iter().enumerate() {
                let page_at = (job.first_page + j as u64) * ps;
                let (from, to) = (lo.max(page_at), hi.min(page_at + ps));
                if from >= to {
                    continue;
                }
                // SAFETY: `page_index < staging pages` (the allocator hands out only pages of the
                // arena) and `to - page_at <= ps`, so the bytes lie inside the mapped arena.
                let ptr = unsafe {
                    published.base.base().as_ptr().add((u64::from(p.page_index) * ps + (from - page_at)) as usize)
                };
                segs.push((ptr, (to - from) as usize));
            }
            let value_at = job.loc.offset + job.header.len() as u64 + lo;
            // SAFETY: the header buffer is the job's; the staging pages are held by this read and
            // not yet handed to anyone; `f` stays open through `job.file` until after the submit.
            ops.push(unsafe { IoOp::new(f, job.loc.offset, &[(job.header.as_mut_ptr(), job.header.len())], false) });
            // SAFETY: as above.
            ops.push(unsafe { IoOp::new(f, value_at, &segs, false) });
            opened.push(true);
        }
        engine.submit(&mut ops);
        let mut results = ops.into_iter();
        let c = &self.counters;
        for (job, was_opened) in jobs.iter_mut().zip(opened) {
            let ok = was_opened && {
                let header = results.next().is_some_and(|op| op.result.is_ok());
                let value = results.next().is_some_and(|op| op.result.is_ok());
                header && value
            };
            job.outcome = if !ok {
                JobOutcome::IoError
            } else {
                match record::decode_header(job.header.as_slice()) {
                    Ok(h)
                        if h.key == job.key
                            && h.value_size == job.size
                            && h.seq == job.loc.seq
                            && h.value_crc == job.crc32c =>
                    {
                        JobOutcome::Ok
                    }
                    _ => JobOutcome::Corrupt,
                }
            };
            match job.outcome {
                JobOutcome::Ok => {
                    bump(&c.device_read_ok);
                    bump(&c.partial_read);
                    let read = job.header.len() as u64 + (job.blocks.1 - job.blocks.0);
                    c.device_read_bytes.fetch_add(read, Ordering::Relaxed);
                    c.partial_read_avoided_bytes.fetch_add(job.loc.len.saturating_sub(read), Ordering::Relaxed);
                }
                JobOutcome::IoError => bump(&c.device_read_error),
                JobOutcome::Corrupt => {
                    bump(&c.device_read_corrupt);
                    tracing::error!(key = %job.key, segment = %job.file.path.display(), offset = job.loc.offset, "SSD record header fails its check on a partial read; dropping the key");
                }
            }
        }
    }
}
