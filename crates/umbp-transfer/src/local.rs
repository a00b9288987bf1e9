//! `LocalCopyEngine`: host ↔ host copies inside one process.
//!
//! A transfer of at least [`stream_threshold`](crate::stream_threshold) bytes (a quarter of the
//! last-level cache) copies with stores that stream past the cache, as a same-host batch get does
//! (`shm/stream.rs`); its summed form then sums the bytes it read. Measured on the 2-core VM (six
//! alternated pairs): a node's own batch get of 1 MiB values 15.9 against 12.6 GB/s, its put 15.0
//! against 12.1 (`docs/benchmarks.md`).

use std::num::NonZeroUsize;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};

use crossbeam_channel::Sender;

use umbp_core::{LocalRegion, MemoryRegistrar, MetricSource, RegistrationError, TransferRef};

use crate::engine::{
    CompletedHandle, FailureKind, PlanSet, SumOf, SummedTransfer, TransferDirection, TransferEngine, TransferFailure,
    TransferHandle, TransferItem, TransferPlan,
};
use crate::planning::{SideKey, plan_in_range, plan_pairs};
use crate::shm::fanout::{Copied, Dst, Piece, Source, ValueCopy, copy_values_spread};

/// Settings of a [`LocalCopyEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalCopyConfig {
    /// Threads one `submit` may copy on. Default: the machine's available parallelism.
    pub threads: usize,
    /// A submit moving fewer bytes than this copies on the calling thread only (spawning costs
    /// microseconds; a small batch is faster alone). Default: 4 MiB.
    pub parallel_threshold: u64,
    /// The smallest piece a large segment is split into for parallel copying. Default: 1 MiB.
    pub min_chunk: u64,
}

impl Default for LocalCopyConfig {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
            parallel_threshold: 4 << 20,
            min_chunk: 1 << 20,
        }
    }
}

/// Copies between host buffers of this process: bounds-checked planning, coalescing of runs
/// adjacent on both sides, and for large batches a copy spread over several threads so one call can
/// use every core. Copies finish inside `submit`.
///
/// The threads are the engine's own, started at its first large submit and kept (`CopyPool`), so
/// concurrent submits (a batch's pipelined chunks) share `threads` copy threads instead of each
/// spawning and joining its own set (six chunks in flight started 42 threads on 16 cores). Measured
/// on the 16-core H200 host, the batch rows of `umbp bench` read the same either way
/// (docs/benchmarks.md): the bound on threads is the point, not speed.
#[derive(Debug, Default)]
pub struct LocalCopyEngine {
    config: LocalCopyConfig,
    pool: CopyPool,
}

impl LocalCopyEngine {
    /// An engine with `config`.
    pub fn new(config: LocalCopyConfig) -> Self {
        Self { config: LocalCopyConfig { threads: config.threads.max(1), ..config }, pool: CopyPool::default() }
    }

    /// The configuration.
    pub fn config(&self) -> &LocalCopyConfig {
        &self.config
    }
}

/// A raw copy job: `len` bytes from `src` to `dst`.
#[derive(Debug, Clone, Copy)]
struct Job {
    src: NonNull<u8>,
    dst: NonNull<u8>,
    len: usize,
    /// Copy with stores that stream past the cache (a batch of at least
    /// [`stream_threshold`](crate::stream_threshold) bytes).
    streamed: bool,
}

// SAFETY: a job is two addresses and a length inside registered host regions; the regions'
// `LocalRegion` invariant keeps them valid for the duration of `submit`, which waits for every
// group it handed to a copy thread before returning (`CopyPool::run`).
unsafe impl Send for Job {}

impl Job {
    fn run(self) {
        let (src, dst) = (self.src.as_ptr() as usize, self.dst.as_ptr() as usize);
        let overlap = src < dst.wrapping_add(self.len) && dst < src.wrapping_add(self.len);
        if overlap {
            // SAFETY: both ranges were bounds-checked against their regions in `submit`; `copy`
            // (memmove) is defined for overlapping ranges.
            unsafe { std::ptr::copy(self.src.as_ptr(), self.dst.as_ptr(), self.len) };
        } else if self.streamed {
            // SAFETY: as above, and the ranges do not overlap.
            unsafe { crate::shm::stream::copy(self.dst.as_ptr(), self.src.as_ptr(), self.len) };
        } else {
            // SAFETY: as above, and the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(self.src.as_ptr(), self.dst.as_ptr(), self.len) };
        }
    }
}

/// One group of a submit's jobs and the latch its submit waits on.
type Group = (Vec<Job>, Arc<Latch>);

/// Copy threads kept by one engine: groups of jobs go to them over a channel, the submitting thread
/// copies one group itself and then waits until every other group of its submit is done (a
/// [`Latch`]), so no job outlives the `submit` that checked its ranges.
#[derive(Debug, Default)]
struct CopyPool {
    /// Started at the first parallel submit; `None` when no thread could be started (every group
    /// is then copied by the submitting thread).
    workers: OnceLock<Option<Sender<Group>>>,
}

impl CopyPool {
    /// Copies every group, the last on this thread, and returns when all are done. `workers`: how
    /// many threads to start at the first call.
    fn run(&self, mut groups: Vec<Vec<Job>>, workers: usize) {
        let mine = groups.pop().unwrap_or_default();
        let latch = Arc::new(Latch::new(groups.len()));
        // Waits for the other groups however this function is left: they copy into caller memory.
        let _wait = WaitOnDrop(&latch);
        let sender = self.workers.get_or_init(|| start_workers(workers));
        for group in groups {
            match sender {
                Some(tx) => {
                    if let Err(err) = tx.send((group, Arc::clone(&latch))) {
                        // The workers are gone (never expected while the engine lives): copy here.
                        let (group, latch) = err.into_inner();
                        run_group(group, &latch);
                    }
                }
                None => run_group(group, &latch),
            }
        }
        mine.into_iter().for_each(Job::run);
    }
}

/// Starts `n` copy threads reading one channel; they exit when the engine (the sender) is dropped.
/// `None` when not one thread could be started.
fn start_workers(n: usize) -> Option<Sender<Group>> {
    let (tx, rx) = crossbeam_channel::unbounded::<Group>();
    let mut started = 0;
    for i in 0..n {
        let rx = rx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("umbp-copy-{i}"))
            .spawn(move || rx.iter().for_each(|(group, latch)| run_group(group, &latch)));
        match spawned {
            Ok(_) => started += 1,
            Err(e) => tracing::warn!(error = %e, "could not start a copy thread; copying on fewer"),
        }
    }
    (started > 0).then_some(tx)
}

/// Copies one group and counts it done, also if a copy panicked (it cannot: plain memmoves).
fn run_group(group: Vec<Job>, latch: &Latch) {
    struct Done<'a>(&'a Latch);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.count_down();
        }
    }
    let _done = Done(latch);
    group.into_iter().for_each(Job::run);
}

/// Counts the groups of one submit still copying.
#[derive(Debug)]
struct Latch {
    left: Mutex<usize>,
    zero: Condvar,
}

impl Latch {
    fn new(n: usize) -> Self {
        Self { left: Mutex::new(n), zero: Condvar::new() }
    }

    fn count_down(&self) {
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        *left = left.saturating_sub(1);
        if *left == 0 {
            self.zero.notify_all();
        }
    }

    fn wait(&self) {
        let mut left = self.left.lock().unwrap_or_else(PoisonError::into_inner);
        while *left > 0 {
            left = self.zero.wait(left).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

struct WaitOnDrop<'a>(&'a Latch);

impl Drop for WaitOnDrop<'_> {
    fn drop(&mut self) {
        self.0.wait();
    }
}

fn local_host(r: &TransferRef) -> Option<&LocalRegion> {
    r.local_region().filter(|l| l.location().is_host())
}

/// Whether any destination range of `jobs` overlaps another job's source or destination range, or
/// its own source range: then the jobs must not be split over threads. A sweep over the ranges sorted
/// by start: a range overlaps an earlier one exactly when it starts before the largest end seen so
/// far; source–source overlaps are harmless (both only read).
fn any_overlap(jobs: &[Job]) -> bool {
    let mut ranges: Vec<(usize, usize, bool)> = Vec::with_capacity(jobs.len() * 2);
    for j in jobs.iter().filter(|j| j.len > 0) {
        let (src, dst) = (j.src.as_ptr() as usize, j.dst.as_ptr() as usize);
        ranges.push((src, src.saturating_add(j.len), false));
        ranges.push((dst, dst.saturating_add(j.len), true));
    }
    ranges.sort_unstable_by_key(|r| r.0);
    let (mut end_any, mut end_dst) = (0usize, 0usize);
    for (start, end, is_dst) in ranges {
        if start < end_dst || (is_dst && start < end_any) {
            return true;
        }
        end_any = end_any.max(end);
        if is_dst {
            end_dst = end_dst.max(end);
        }
    }
    false
}

/// Splits `jobs` into at most `parts` groups of roughly equal bytes, cutting large jobs into pieces
/// of at least `min_chunk`.
fn balance(jobs: Vec<Job>, parts: usize, min_chunk: usize) -> Vec<Vec<Job>> {
    let total: usize = jobs.iter().map(|j| j.len).sum();
    let share = total.div_ceil(parts).max(min_chunk).max(1);
    let mut groups: Vec<Vec<Job>> = vec![Vec::new()];
    let mut filled = 0usize;
    for mut job in jobs {
        while job.len > 0 {
            if filled == share {
                groups.push(Vec::new());
                filled = 0;
            }
            let take = job.len.min(share - filled);
            if let Some(group) = groups.last_mut() {
                group.push(Job { len: take, ..job });
            }
            filled += take;
            // SAFETY: `take <= job.len`, so both pointers stay inside (or one past) their checked ranges.
            job = unsafe { Job { src: job.src.add(take), dst: job.dst.add(take), len: job.len - take, ..job } };
        }
    }
    groups
}

impl MemoryRegistrar for LocalCopyEngine {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        // In-process copies need no registration: the pointer is the handle.
        Ok(TransferRef::local(region))
    }

    fn deregister(&self, _r: &TransferRef) {}
}

impl MetricSource for LocalCopyEngine {}

impl TransferEngine for LocalCopyEngine {
    fn name(&self) -> &str {
        "LocalCopyEngine"
    }

    /// Copies finish inside `submit`.
    fn completes_in_submit(&self) -> bool {
        true
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        local_host(src).is_some() && local_host(dst).is_some()
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        plan_pairs(items, |item| {
            if !self.can_handle(&item.src, &item.dst) {
                return None;
            }
            Some((TransferDirection::Local, SideKey::local(&item.src)?, SideKey::local(&item.dst)?))
        })
    }

    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        let mut failures = Vec::new();
        let mut jobs = Vec::new();
        let mut total = 0u64;
        for plan in &plans {
            let (Some(src), Some(dst)) = (local_host(&plan.src), local_host(&plan.dst)) else {
                failures.push(TransferFailure::new(
                    plan.tags.clone(),
                    FailureKind::Local,
                    "plan has a side that is not local host memory",
                    self.name(),
                ));
                continue;
            };
            if !plan_in_range(plan) || plan.src.size() > src.len() || plan.dst.size() > dst.len() {
                failures.push(TransferFailure::new(
                    plan.tags.clone(),
                    FailureKind::Local,
                    "plan reaches outside its buffers",
                    self.name(),
                ));
                continue;
            }
            let mut mine = Vec::with_capacity(plan.segments.len());
            let mut bytes = 0u64;
            let mut fits = true;
            for s in plan.segments.iter().filter(|s| s.len > 0) {
                let (Ok(src_off), Ok(dst_off), Ok(len)) =
                    (usize::try_from(s.src_offset), usize::try_from(s.dst_offset), usize::try_from(s.len))
                else {
                    fits = false;
                    break;
                };
                // SAFETY: `src_off + len <= plan.src.size() <= src.len()` (checked above), so the
                // pointers stay inside the regions, which are valid under `LocalRegion`'s invariant.
                mine.push(unsafe {
                    Job { src: src.ptr().add(src_off), dst: dst.ptr().add(dst_off), len, streamed: false }
                });
                bytes += s.len;
            }
            if !fits {
                failures.push(TransferFailure::new(
                    plan.tags.clone(),
                    FailureKind::Local,
                    "a segment does not fit this address space",
                    self.name(),
                ));
                continue;
            }
            total += bytes;
            jobs.append(&mut mine);
        }
        if local_streams(total) {
            jobs.iter_mut().for_each(|j| j.streamed = true);
        }
        let threads = self.config.threads;
        if threads <= 1 || total < self.config.parallel_threshold || jobs.is_empty() || any_overlap(&jobs) {
            // One thread, in item order, memmove per job: overlapping jobs (a destination that is
            // another job's source or destination, or its own source) copy exactly as if each item
            // ran after the one before it. Splitting such jobs over threads would race.
            jobs.into_iter().for_each(Job::run);
        } else {
            let min_chunk = usize::try_from(self.config.min_chunk).unwrap_or(usize::MAX).max(1);
            self.pool.run(balance(jobs, threads, min_chunk), threads - 1);
        }
        Ok(Box::new(CompletedHandle::new(failures)))
    }

    /// Copies each tag's items block by block and sums each block right after its copy (the
    /// same-host get's copy, `shm::fanout`, over local sources): the landed bytes for
    /// [`SumOf::Destination`], the bytes read for [`SumOf::Source`]. On the calling thread, or for
    /// a batch past [`parallel_threshold`](LocalCopyConfig::parallel_threshold) spread value by
    /// value over the kept pool of one thread per core that same-host gets copy on (`threads` > 1
    /// only; a value is never split, its blocks are summed in order). `None`, before anything
    /// moved, for items it would not copy exactly as `submit` would: a side that is not local host
    /// memory, a range outside its buffer, a tag whose items do not tile one range of the summed
    /// side, or overlapping ranges (which `submit` copies in order on one thread).
    fn transfer_summed(&self, items: &[TransferItem], sum_of: SumOf) -> Option<SummedTransfer> {
        let values = summed_values(items, sum_of)?;
        let mut jobs = Vec::new();
        for (_, v) in &values {
            let mut at = 0usize;
            for (k, p) in v.pieces.iter().enumerate() {
                let Source::Local(src) = p.source else { return None };
                jobs.push(Job { src, dst: v.piece_dst(k, at)?, len: p.len, streamed: false });
                at += p.len;
            }
        }
        if any_overlap(&jobs) {
            return None;
        }
        let total: u64 = jobs.iter().map(|j| j.len as u64).sum();
        let fan_out = self.config.threads > 1 && total >= self.config.parallel_threshold;
        let (tags, mut copies): (Vec<u64>, Vec<ValueCopy>) = values.into_iter().unzip();
        if local_streams(total) {
            copies.iter_mut().for_each(|c| c.streamed = true);
        }
        // SAFETY: every range was checked inside its host region (`summed_values`),
        // valid under `LocalRegion`'s invariant and not otherwise used until `transfer` returns (the
        // engine's contract); no destination overlaps another range (checked above).
        let copied = unsafe { copy_values_spread(&copies, fan_out) };
        let mut out = SummedTransfer::default();
        for (tag, copied) in tags.into_iter().zip(copied) {
            match copied {
                Copied::Done { crc32c: Some(sum), .. } => drop(out.sums.insert(tag, sum)),
                Copied::Done { crc32c: None, .. } => {}
                Copied::Failed(e) => {
                    out.failures.push(TransferFailure::new(vec![tag], FailureKind::Local, e.to_string(), self.name()));
                }
            }
        }
        Some(out)
    }
}

/// Whether a transfer of `total` bytes streams its stores past the cache: from
/// [`stream_threshold`](crate::stream_threshold), as a same-host batch get does.
fn local_streams(total: u64) -> bool {
    total >= crate::stream_threshold()
}

/// Each tag's value for [`LocalCopyEngine::transfer_summed`], in the order tags first appear, as
/// one copy in the summed side's order: its pieces gathered into one destination range
/// ([`SumOf::Destination`]), or scattered from one source range ([`SumOf::Source`]). `None` for
/// items that are not local host memory inside their buffers, or a tag whose items do not tile
/// one range of the summed side.
fn summed_values(items: &[TransferItem], sum_of: SumOf) -> Option<Vec<(u64, ValueCopy)>> {
    let mut order: Vec<u64> = Vec::new();
    let mut by_tag: std::collections::HashMap<u64, Vec<&TransferItem>> = std::collections::HashMap::new();
    for item in items {
        by_tag
            .entry(item.tag)
            .or_insert_with(|| {
                order.push(item.tag);
                Vec::new()
            })
            .push(item);
    }
    let mut out = Vec::with_capacity(order.len());
    for tag in order {
        let mut mine = by_tag.remove(&tag)?;
        // The summed side's offset of an item: the items must tile one range of that side.
        let at_of = |i: &TransferItem| match sum_of {
            SumOf::Destination => i.dst_offset,
            SumOf::Source => i.src_offset,
        };
        mine.sort_by_key(|i| at_of(i));
        let mut end = at_of(mine.first()?);
        let mut tiled = None;
        let mut pieces = Vec::with_capacity(mine.len());
        let mut dsts = Vec::with_capacity(mine.len());
        for item in mine {
            let src = local_host(&item.src)?;
            let dst = local_host(&item.dst)?;
            let fits = |r: &TransferRef, region: &LocalRegion, offset: u64| {
                offset.checked_add(item.size).is_some_and(|e| e <= r.size()) && r.size() <= region.len()
            };
            let side = match sum_of {
                SumOf::Destination => dst.ptr(),
                SumOf::Source => src.ptr(),
            };
            if *tiled.get_or_insert(side) != side
                || at_of(item) != end
                || !fits(&item.src, src, item.src_offset)
                || !fits(&item.dst, dst, item.dst_offset)
            {
                return None;
            }
            end += item.size;
            let (offset, len) = (usize::try_from(item.src_offset).ok()?, usize::try_from(item.size).ok()?);
            // SAFETY: `offset + len <= src.len()` (checked above): inside the region.
            pieces.push(Piece { source: Source::Local(unsafe { src.ptr().add(offset) }), offset: 0, len });
            let dst_at = usize::try_from(item.dst_offset).ok()?;
            // SAFETY: `dst_at + len <= dst.len()` (checked above): inside the region.
            dsts.push(unsafe { dst.ptr().add(dst_at) });
        }
        let dst = match sum_of {
            SumOf::Destination => Dst::Range(*dsts.first()?),
            SumOf::Source => Dst::Each(dsts),
        };
        out.push((tag, ValueCopy { pieces, dst, sum: true, streamed: false }));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_splits_bytes_evenly_and_keeps_every_byte() {
        let mut a = vec![0u8; 10 << 20];
        let mut b = vec![0u8; 10 << 20];
        let job = Job {
            src: NonNull::new(a.as_mut_ptr()).expect("non-null"),
            dst: NonNull::new(b.as_mut_ptr()).expect("non-null"),
            len: a.len(),
            streamed: false,
        };
        let groups = balance(vec![job], 4, 1 << 20);
        assert_eq!(groups.len(), 4);
        let sizes: Vec<usize> = groups.iter().map(|g| g.iter().map(|j| j.len).sum()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 10 << 20);
        assert!(sizes.iter().all(|s| *s <= (10 << 20) / 4 + 1));
        let groups = balance(vec![Job { len: 4096, ..job }], 4, 1 << 20);
        assert_eq!(groups.len(), 1, "small work is not split below min_chunk");
    }

    #[test]
    fn overlap_detection_ignores_shared_sources_only() {
        let mut a = vec![0u8; 1 << 16];
        let base = NonNull::new(a.as_mut_ptr()).expect("non-null");
        // SAFETY: offsets stay inside `a`; the jobs are only inspected, never run.
        let at = |off: usize| unsafe { base.add(off) };
        let job = |src: usize, dst: usize, len: usize| Job { src: at(src), dst: at(dst), len, streamed: false };
        assert!(!any_overlap(&[job(0, 1000, 100), job(0, 2000, 100)]), "two reads of one source");
        assert!(any_overlap(&[job(0, 50, 100)]), "a job onto its own source");
        assert!(any_overlap(&[job(0, 1000, 100), job(1050, 3000, 100)]), "a destination another job reads");
        assert!(any_overlap(&[job(1050, 3000, 100), job(0, 1000, 100)]), "in either order");
        assert!(any_overlap(&[job(0, 1000, 100), job(200, 1099, 10)]), "two destinations");
        assert!(!any_overlap(&[job(0, 100, 100), job(200, 300, 100)]), "adjacent ranges do not overlap");
        assert!(!any_overlap(&[job(0, 0, 0)]), "empty jobs never overlap");
    }
}
