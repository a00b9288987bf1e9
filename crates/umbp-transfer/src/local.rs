//! `LocalCopyEngine`: host ↔ host copies inside one process.

use std::num::NonZeroUsize;
use std::ptr::NonNull;

use umbp_core::{LocalRegion, MemoryRegistrar, MetricSource, RegistrationError, TransferRef};

use crate::engine::{
    CompletedHandle, FailureKind, PlanSet, TransferDirection, TransferEngine, TransferFailure, TransferHandle,
    TransferItem, TransferPlan,
};
use crate::planning::{SideKey, plan_in_range, plan_pairs};

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
#[derive(Debug, Default)]
pub struct LocalCopyEngine {
    config: LocalCopyConfig,
}

impl LocalCopyEngine {
    /// An engine with `config`.
    pub fn new(config: LocalCopyConfig) -> Self {
        Self { config: LocalCopyConfig { threads: config.threads.max(1), ..config } }
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
}

// SAFETY: a job is two addresses and a length inside registered host regions; the regions'
// `LocalRegion` invariant keeps them valid for the duration of `submit`, which joins every copy
// thread before returning.
unsafe impl Send for Job {}

impl Job {
    fn run(self) {
        let (src, dst) = (self.src.as_ptr() as usize, self.dst.as_ptr() as usize);
        let overlap = src < dst.wrapping_add(self.len) && dst < src.wrapping_add(self.len);
        if overlap {
            // SAFETY: both ranges were bounds-checked against their regions in `submit`; `copy`
            // (memmove) is defined for overlapping ranges.
            unsafe { std::ptr::copy(self.src.as_ptr(), self.dst.as_ptr(), self.len) };
        } else {
            // SAFETY: as above, and the ranges do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(self.src.as_ptr(), self.dst.as_ptr(), self.len) };
        }
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
            job = unsafe { Job { src: job.src.add(take), dst: job.dst.add(take), len: job.len - take } };
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
                mine.push(unsafe { Job { src: src.ptr().add(src_off), dst: dst.ptr().add(dst_off), len } });
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
        let threads = self.config.threads;
        if threads <= 1 || total < self.config.parallel_threshold || jobs.is_empty() || any_overlap(&jobs) {
            // One thread, in item order, memmove per job: overlapping jobs (a destination that is
            // another job's source or destination, or its own source) copy exactly as if each item
            // ran after the one before it. Splitting such jobs over threads would race.
            jobs.into_iter().for_each(Job::run);
        } else {
            let min_chunk = usize::try_from(self.config.min_chunk).unwrap_or(usize::MAX).max(1);
            let mut groups = balance(jobs, threads, min_chunk);
            let mine = groups.pop().unwrap_or_default();
            std::thread::scope(|s| {
                for group in groups {
                    s.spawn(move || group.into_iter().for_each(Job::run));
                }
                mine.into_iter().for_each(Job::run);
            });
        }
        Ok(Box::new(CompletedHandle::new(failures)))
    }
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
        let job = |src: usize, dst: usize, len: usize| Job { src: at(src), dst: at(dst), len };
        assert!(!any_overlap(&[job(0, 1000, 100), job(0, 2000, 100)]), "two reads of one source");
        assert!(any_overlap(&[job(0, 50, 100)]), "a job onto its own source");
        assert!(any_overlap(&[job(0, 1000, 100), job(1050, 3000, 100)]), "a destination another job reads");
        assert!(any_overlap(&[job(1050, 3000, 100), job(0, 1000, 100)]), "in either order");
        assert!(any_overlap(&[job(0, 1000, 100), job(200, 1099, 10)]), "two destinations");
        assert!(!any_overlap(&[job(0, 100, 100), job(200, 300, 100)]), "adjacent ranges do not overlap");
        assert!(!any_overlap(&[job(0, 0, 0)]), "empty jobs never overlap");
    }
}
