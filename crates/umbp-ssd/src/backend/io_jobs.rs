//! Drive IO of the SSD medium's read and write jobs (no lock held): plain and overlapped reads
//! with their verification, writes of records from staging pages.

use super::*;

/// With an engine that overlaps IO and work (io_uring), a batch of at least this many value bytes
/// is checksummed while it moves: a write hands the values to the drive first and its headers
/// (which carry the CRC) right after; a read arrives in chunks of [`READ_CHUNK`] and each chunk is
/// checked as it lands. Smaller batches are not worth the extra requests.
pub(super) const OVERLAP_MIN: u64 = 256 * 1024;
/// The chunk of an overlapped read.
pub(super) const READ_CHUNK: usize = 256 * 1024;

/// A read or write between its lock phases.
pub(super) struct Job {
    pub(super) index: usize,
    pub(super) key: String,
    pub(super) pages: Vec<PageLocation>,
    pub(super) size: u64,
    pub(super) file: Arc<SegmentFile>,
    pub(super) loc: Loc,
    pub(super) header: AlignedBuf,
    pub(super) generation: u64,
    /// The writer's CRC-32C of the value: a write puts it in the header, a read expects it there.
    pub(super) crc32c: Option<u32>,
    pub(super) flight: Option<Arc<Flight>>,
    pub(super) outcome: JobOutcome,
    /// Another caller's write to the same segment was in flight when this one was reserved.
    pub(super) shared: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum JobOutcome {
    Ok,
    IoError,
    Corrupt,
}

/// The most iovecs one write op carries (the kernel's `UIO_MAXIOV` is 1024; io_uring refuses more
/// in one request).
pub(super) const MAX_WRITE_IOVECS: usize = 1024;

/// Splits records `(segment, offset, length, iovecs)`, in reservation order, into runs that can go
/// out as one write: each record starts where the one before it ends, in the same segment, and a
/// run carries at most `max_iovecs` iovecs (a record alone may carry more: it is one op anyway).
pub(super) fn adjacent_runs(records: &[(SegId, u64, u64, usize)], max_iovecs: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    let mut iovecs = 0;
    for (i, &(seg, offset, _, n)) in records.iter().enumerate() {
        let extends = runs.last().is_some_and(|run| {
            let (pseg, poff, plen, _) = records[run.end - 1];
            pseg == seg && poff + plen == offset && iovecs + n <= max_iovecs
        });
        match runs.last_mut() {
            Some(run) if extends => {
                run.end = i + 1;
                iovecs += n;
            }
            _ => {
                runs.push(i..i + 1);
                iovecs = n;
            }
        }
    }
    runs
}

/// Splits `(address, length)` segments into groups of at most `chunk` bytes each (a segment
/// larger than `chunk` is cut; `chunk` and every length are multiples of the record alignment).
pub(super) fn split_segments(segs: &[(*mut u8, usize)], chunk: usize) -> Vec<Vec<(*mut u8, usize)>> {
    let mut out: Vec<Vec<(*mut u8, usize)>> = Vec::new();
    let mut current = Vec::new();
    let mut room = chunk;
    for &(ptr, len) in segs {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(room);
            // SAFETY: `at + n <= len`, so the address stays inside the segment.
            current.push((unsafe { ptr.add(at) }, n));
            at += n;
            room -= n;
            if room == 0 {
                out.push(std::mem::take(&mut current));
                room = chunk;
            }
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

impl Inner {
    /// The `(address, length)` IO segments of a value of `size` bytes in `pages`, each page's
    /// length rounded up to the record alignment.
    pub(super) fn page_segments(
        &self,
        published: &Published,
        pages: &[PageLocation],
        size: u64,
    ) -> Vec<(*mut u8, usize)> {
        let ps = self.config.page_size;
        let mut remaining = record::align_up(size);
        let mut out = Vec::with_capacity(pages.len());
        for p in pages {
            if remaining == 0 {
                break;
            }
            let len = remaining.min(ps);
            remaining -= len;
            // SAFETY: `page_index < staging pages` (the allocator only hands out pages of the arena),
            // so the offset stays inside the mapped arena.
            let ptr = unsafe { published.base.base().as_ptr().add((u64::from(p.page_index) * ps) as usize) };
            out.push((ptr, len as usize));
        }
        out
    }

    /// Zeroes the bytes between the end of a value of `size` bytes in `pages` and the next record
    /// boundary: they go to the drive with the value, and would otherwise carry whatever an earlier
    /// value left in the staging page.
    pub(super) fn zero_padding(&self, published: &Published, pages: &[PageLocation], size: u64) {
        let ps = self.config.page_size;
        let pad = record::align_up(size) - size;
        if pad == 0 || size == 0 {
            return;
        }
        // The padding lies in the page holding the value's last byte: pages are multiples of the
        // record alignment, so rounding up never crosses into the next page.
        let last = (size - 1) / ps;
        let Some(page) = pages.get(last as usize) else { return };
        let at = size - last * ps;
        // SAFETY: the page lies inside the arena (see `page_segments`) and `at + pad <= ps`; it
        // belongs to the committing slot, whose writer is done with it, and nothing else writes it.
        unsafe {
            std::ptr::write_bytes(
                published.base.base().as_ptr().add((u64::from(page.page_index) * ps + at) as usize),
                0,
                pad as usize,
            );
        }
    }

    /// CRC-32C of `key` and the value bytes in staging `pages`.
    pub(super) fn crc_of(&self, published: &Published, key: &str, pages: &[PageLocation], size: u64) -> u32 {
        let ps = self.config.page_size;
        let mut crc = crc32c::crc32c(key.as_bytes());
        let mut remaining = size;
        for p in pages {
            if remaining == 0 {
                break;
            }
            let len = remaining.min(ps);
            remaining -= len;
            // SAFETY: the page lies inside the arena (see `page_segments`); it is held by this call's
            // slot or fill, which no one else writes while the call runs (a writer finished before
            // its commit; a fill target is not published yet).
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    published.base.base().as_ptr().add((u64::from(p.page_index) * ps) as usize),
                    len as usize,
                )
            };
            crc = crc32c::crc32c_append(crc, bytes);
        }
        crc
    }

    /// Reads the records of `jobs` into their staging pages and verifies them (no lock held).
    pub(super) fn read_jobs(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        if engine.overlaps() && jobs.iter().map(|j| j.size).sum::<u64>() >= OVERLAP_MIN {
            self.read_jobs_overlapped(engine, published, jobs);
            return;
        }
        let mut ops = Vec::with_capacity(jobs.len());
        let mut opened = Vec::with_capacity(jobs.len());
        for job in jobs.iter_mut() {
            match job.file.file() {
                Ok(f) => {
                    let mut segs = vec![(job.header.as_mut_ptr(), job.header.len())];
                    segs.extend(self.page_segments(published, &job.pages, job.size));
                    // SAFETY: the header buffer is the job's; the staging pages are held by this
                    // fill and not yet published, so nothing else reads or writes them; `f` is kept
                    // open by `job.file` until after the submit.
                    ops.push(unsafe { IoOp::new(f, job.loc.offset, &segs, false) });
                    opened.push(true);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a segment to read");
                    opened.push(false);
                }
            }
        }
        engine.submit(&mut ops);
        let mut results = ops.into_iter();
        for (job, was_opened) in jobs.iter_mut().zip(opened) {
            let ok = was_opened && results.next().is_some_and(|op| op.result.is_ok());
            let crc = if ok { Some(self.crc_of(published, &job.key, &job.pages, job.size)) } else { None };
            self.judge_read(job, crc);
        }
    }

    /// Sets a read job's outcome from its header and the CRC of what landed (`None`: the IO
    /// failed) and counts it.
    pub(super) fn judge_read(&self, job: &mut Job, crc: Option<u32>) {
        {
            job.outcome = match crc {
                None => JobOutcome::IoError,
                Some(crc) => match record::decode_header(job.header.as_slice()) {
                    Ok(h)
                        if h.key == job.key
                            && h.value_size == job.size
                            && h.seq == job.loc.seq
                            && h.value_crc == job.crc32c
                            && crc == h.data_crc =>
                    {
                        JobOutcome::Ok
                    }
                    _ => JobOutcome::Corrupt,
                },
            };
            let c = &self.counters;
            match job.outcome {
                JobOutcome::Ok => {
                    bump(&c.device_read_ok);
                    c.device_read_bytes.fetch_add(job.loc.len, Ordering::Relaxed);
                }
                JobOutcome::IoError => bump(&c.device_read_error),
                JobOutcome::Corrupt => {
                    bump(&c.device_read_corrupt);
                    tracing::error!(key = %job.key, segment = %job.file.path.display(), offset = job.loc.offset, "SSD record fails its CRC check; dropping the key");
                }
            }
        }
    }

    /// `read_jobs` for an engine that overlaps: each record is read as its header plus value
    /// chunks, and the CRC runs over every chunk as soon as it and the ones before it have landed.
    pub(super) fn read_jobs_overlapped(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        /// One op of one job: the header, or value chunk `chunk` with the value bytes it holds.
        struct Part {
            job: usize,
            chunk: Option<usize>,
        }
        /// Per job: running CRC, the next chunk to fold in, which chunks landed, whether all is well.
        struct Progress {
            crc: u32,
            next: usize,
            landed: Vec<bool>,
            /// `(address, value bytes)` of each chunk (padding excluded).
            value: Vec<Vec<(*const u8, usize)>>,
            ok: bool,
        }
        let mut ops = Vec::new();
        let mut parts = Vec::new();
        let mut progress = Vec::with_capacity(jobs.len());
        for (j, job) in jobs.iter_mut().enumerate() {
            let mut p = Progress {
                crc: crc32c::crc32c(job.key.as_bytes()),
                next: 0,
                landed: Vec::new(),
                value: Vec::new(),
                ok: true,
            };
            let f = match job.file.file() {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a segment to read");
                    p.ok = false;
                    progress.push(p);
                    continue;
                }
            };
            // SAFETY: the header buffer is the job's and untouched until the submit returns.
            ops.push(unsafe { IoOp::new(f, job.loc.offset, &[(job.header.as_mut_ptr(), job.header.len())], false) });
            parts.push(Part { job: j, chunk: None });
            let mut offset = job.loc.offset + job.header.len() as u64;
            let mut value_left = job.size as usize;
            for chunk in split_segments(&self.page_segments(published, &job.pages, job.size), READ_CHUNK) {
                let len: usize = chunk.iter().map(|(_, l)| *l).sum();
                // SAFETY: the staging pages are held by this fill and not yet published, so nothing
                // else reads or writes them; `f` stays open through `job.file`.
                ops.push(unsafe { IoOp::new(f, offset, &chunk, false) });
                parts.push(Part { job: j, chunk: Some(p.landed.len()) });
                let mut value = Vec::with_capacity(chunk.len());
                for (ptr, l) in chunk {
                    let n = l.min(value_left);
                    value_left -= n;
                    if n > 0 {
                        value.push((ptr.cast_const(), n));
                    }
                }
                p.value.push(value);
                p.landed.push(false);
                offset += len as u64;
            }
            progress.push(p);
        }
        {
            let mut on_complete = |i: usize| {
                let Part { job, chunk } = parts[i];
                let Some(c) = chunk else { return };
                let p = &mut progress[job];
                p.landed[c] = true;
                // Fold in every chunk that is now contiguous with what was folded before.
                while p.next < p.landed.len() && p.landed[p.next] {
                    for (ptr, n) in &p.value[p.next] {
                        // SAFETY: the chunk's read completed into staging pages held by this fill
                        // (see above); `n` bytes of value lie there.
                        let bytes = unsafe { std::slice::from_raw_parts(*ptr, *n) };
                        p.crc = crc32c::crc32c_append(p.crc, bytes);
                    }
                    p.next += 1;
                }
            };
            engine.submit_ordered(&mut ops, &mut on_complete);
        }
        for (i, op) in ops.iter().enumerate() {
            if op.result.is_err() {
                progress[parts[i].job].ok = false;
            }
        }
        for (job, p) in jobs.iter_mut().zip(progress) {
            let whole = p.ok && p.next == p.landed.len();
            self.judge_read(job, whole.then_some(p.crc));
        }
    }

    /// `write_jobs` for an engine that overlaps: the values go to the drive first; while they
    /// move, the CRCs are computed and the headers encoded, and the headers follow in the same
    /// ring. A record whose header did not land is no record: a scan stops at its header block.
    pub(super) fn write_jobs_overlapped(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        let mut values = Vec::with_capacity(jobs.len());
        let mut headers = Vec::with_capacity(jobs.len());
        let mut which = Vec::with_capacity(jobs.len());
        for (j, job) in jobs.iter_mut().enumerate() {
            match job.file.file() {
                Ok(f) => {
                    let segs = self.page_segments(published, &job.pages, job.size);
                    // SAFETY: the staging pages belong to the committing slot (its writer is done;
                    // the checksum only reads them); the header buffer is filled by the checksum
                    // step before its op is handed to the kernel (`submit_split`'s contract) and
                    // not touched after; `f` stays open through `job.file`.
                    values.push(unsafe { IoOp::new(f, job.loc.offset + job.header.len() as u64, &segs, true) });
                    // SAFETY: as above.
                    headers.push(unsafe {
                        IoOp::new(f, job.loc.offset, &[(job.header.as_mut_ptr(), job.header.len())], true)
                    });
                    which.push(j);
                }
                Err(e) => tracing::warn!(error = %e, "cannot open a segment to write"),
            }
        }
        let split = values.len();
        values.extend(headers);
        let mut ops = values;
        {
            let mut checksum = || {
                for &j in &which {
                    let job = &mut jobs[j];
                    let crc = self.crc_of(published, &job.key, &job.pages, job.size);
                    record::encode_header(job.header.as_mut_slice(), &job.key, job.size, job.loc.seq, crc, job.crc32c);
                }
            };
            engine.submit_split(&mut ops, split, &mut checksum);
        }
        let mut results: Vec<Option<io::Result<()>>> = Vec::with_capacity(jobs.len());
        results.resize_with(jobs.len(), || None);
        for (k, &j) in which.iter().enumerate() {
            let value = std::mem::replace(&mut ops[k].result, Ok(()));
            let header = std::mem::replace(&mut ops[split + k].result, Ok(()));
            results[j] = Some(value.and(header));
        }
        for (job, result) in jobs.iter_mut().zip(results) {
            self.count_write(job, result);
        }
    }

    /// Sets a write job's outcome (`None`: it never reached the drive) and counts it.
    pub(super) fn count_write(&self, job: &mut Job, result: Option<io::Result<()>>) {
        job.outcome = match result {
            Some(Ok(())) => {
                bump(&self.counters.device_write_ok);
                self.counters.device_write_bytes.fetch_add(job.loc.len, Ordering::Relaxed);
                JobOutcome::Ok
            }
            Some(Err(e)) => {
                bump(&self.counters.device_write_error);
                tracing::warn!(key = %job.key, segment = %job.file.path.display(), error = %e, "SSD write failed");
                JobOutcome::IoError
            }
            None => {
                bump(&self.counters.device_write_error);
                JobOutcome::IoError
            }
        };
    }

    /// Checksums the values of `jobs` and encodes their headers.
    pub(super) fn encode_headers(&self, published: &Published, jobs: &mut [Job]) {
        for job in jobs {
            let crc = self.crc_of(published, &job.key, &job.pages, job.size);
            record::encode_header(job.header.as_mut_slice(), &job.key, job.size, job.loc.seq, crc, job.crc32c);
        }
    }

    /// One write op per run of records reserved side by side in `jobs` (see [`adjacent_runs`]),
    /// appended to `ops`, with the jobs each op carries (`None`: the segment would not open).
    ///
    /// # Safety
    /// As [`IoOp::new`]: the jobs' headers and staging pages must stay valid and untouched by
    /// anyone else (but the caller filling the headers before the op is submitted) until the
    /// submit returns.
    pub(super) unsafe fn push_write_ops(
        &self,
        published: &Published,
        jobs: &mut [Job],
        ops: &mut Vec<IoOp>,
        carried: &mut Vec<(std::ops::Range<usize>, Option<usize>)>,
    ) {
        let shape: Vec<(SegId, u64, u64, usize)> =
            jobs.iter().map(|j| (j.loc.seg, j.loc.offset, j.loc.len, 1 + j.pages.len())).collect();
        for run in adjacent_runs(&shape, MAX_WRITE_IOVECS) {
            let mut segs = Vec::new();
            for job in &mut jobs[run.clone()] {
                segs.push((job.header.as_mut_ptr(), job.header.len()));
                segs.extend(self.page_segments(published, &job.pages, job.size));
            }
            let first = &jobs[run.start];
            let op = match first.file.file() {
                Ok(f) => {
                    // SAFETY: the caller's contract; `f` stays open through the jobs' `file`.
                    ops.push(unsafe { IoOp::new(f, first.loc.offset, &segs, true) });
                    Some(ops.len() - 1)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a segment to write");
                    None
                }
            };
            carried.push((run, op));
        }
    }

    /// Writes the records of `jobs` from their staging pages (no lock held).
    ///
    /// With an engine that overlaps, large values go out as concurrent writes from registered
    /// buffers (see [`write_jobs_overlapped`](Self::write_jobs_overlapped)), so their segments
    /// are sized first: appends would queue behind each other. (A record written as one
    /// header-and-value request instead pins every staging page per request and checksums before
    /// writing: io_uring single 1 MiB puts measured 0.67 of raw that way, 0.76 this way.)
    /// Otherwise the records are checksummed, then those reserved side by side go out as one
    /// write each run (one system call; a lone appender pays ext4's per-write costs once per
    /// run).
    pub(super) fn write_jobs(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        for job in jobs.iter() {
            self.zero_padding(published, &job.pages, job.size);
        }
        let total: u64 = jobs.iter().map(|j| j.size).sum();
        if engine.overlaps() && total >= OVERLAP_MIN {
            for job in jobs.iter() {
                job.file.size_for_shared_writes();
            }
            self.write_jobs_overlapped(engine, published, jobs);
            return;
        }
        for job in jobs.iter() {
            if job.shared {
                job.file.size_for_shared_writes();
            }
        }
        self.encode_headers(published, jobs);
        let mut ops = Vec::new();
        let mut carried = Vec::new();
        // SAFETY: the headers are the jobs' own buffers, encoded above and not touched until the
        // submit returns; the staging pages belong to the committing slots (their writers are
        // done).
        unsafe { self.push_write_ops(published, jobs, &mut ops, &mut carried) };
        engine.submit(&mut ops);
        for (run, op) in carried {
            for job in &mut jobs[run] {
                let result = op.map(|i| match &ops[i].result {
                    Ok(()) => Ok(()),
                    Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                });
                self.count_write(job, result);
            }
        }
    }
}
