//! The write path of the SSD medium: allocation (admission against the capacity, LRU eviction to
//! make room), commit (take the slots, reserve their records, spill them, publish what landed)
//! and abort.

use super::state::{JobSlot, Landed};
use super::*;

/// A commit batch between its lock phases: the jobs to write, the requests that answer with
/// another request's outcome, and the keys this batch marked as being written.
#[derive(Default)]
struct Batch {
    jobs: Vec<Job>,
    /// Later commits of a key that an earlier request of this batch commits: (request, winner).
    in_batch_losers: Vec<(usize, usize)>,
    flights: Vec<(String, Arc<Flight>)>,
}

impl SsdBackend {
    /// `batch_allocate`: admits each request against the capacity (evicting down to the low
    /// watermark when it would pass it) and the staging arena.
    pub(super) fn allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        let inner = &self.inner;
        let config = &inner.config;
        let ps = config.page_size;
        let pending_ttl_ms = u64::try_from(config.pending_ttl.as_millis()).unwrap_or(u64::MAX);
        let published = inner.published.read().clone();
        let now = config.clock.now();
        let deadline = now + config.pending_ttl;
        let mut state = inner.state.lock();
        let clearing = inner.clear_pending.load(Ordering::Acquire);
        let total = state.total();
        let total_pages = total / ps;
        let mut results = Vec::with_capacity(requests.len());
        for req in requests {
            let n = req.size.div_ceil(ps);
            // Too large for a staged value here, or for the whole drive: no peer like us would do
            // better, so the writer must not go hunting (Failed, not FailedNoSpace). An empty key
            // cannot be logged (a record names its key; recovery reads a key length of 0 as a torn
            // header and would drop every record after it in the segment).
            if req.size == 0
                || clearing
                || n > config.max_value_pages
                || n > total_pages
                || req.key.is_empty()
                || req.key.len() > MAX_KEY_LEN
                || !state.is_live()
            {
                results.push(AllocateResult::outcome(AllocateOutcome::Failed));
                continue;
            }
            if state.owns(&req.key) {
                results.push(AllocateResult::outcome(AllocateOutcome::AlreadyExists));
                continue;
            }
            let bytes = n * ps;
            if !state.has_room(bytes)
                && let Some(w) = config.watermarks
            {
                let low = (w.low * total as f64) as u64;
                let target = low.min(total - bytes);
                inner.evict_down_to(&mut state, target, now, &[]);
            }
            if !state.has_room(bytes) {
                results.push(AllocateResult::outcome(AllocateOutcome::FailedNoSpace));
                continue;
            }
            // Every allocation holds the lock here, so the id read now is the one taken below, once
            // the slot is admitted (a busy answer takes none, as before the split).
            let slot_id = inner.next_slot_id.load(Ordering::Relaxed);
            let Some(pages) = state.admit(slot_id, req.size, deadline, now) else {
                // The drive has room, but every staging page is held by pending slots (this batch's
                // among them) and readers: busy, not full. The pages come back without eviction
                // (commits, aborts, releases, the TTLs), and `n <= max_value_pages <= staging_pages`,
                // so the value fits once they do: the writer asks again.
                bump(&inner.counters.staging_busy_allocate);
                results.push(AllocateResult::outcome(AllocateOutcome::Busy));
                continue;
            };
            inner.next_slot_id.fetch_add(1, Ordering::Relaxed);
            results.push(AllocateResult {
                outcome: AllocateOutcome::Allocated,
                slot_id,
                pages,
                size: req.size,
                page_size: ps,
                descs: published.as_ref().map(|p| vec![p.desc.clone()]).unwrap_or_default(),
                pending_ttl_ms,
            });
        }
        inner.update_staging_gauge(&state);
        results
    }

    /// `batch_commit`: wait until no other batch writes these keys, take the slots and reserve
    /// their records, write them with no lock held, publish what landed.
    pub(super) fn commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        let inner = &self.inner;
        let mut results = vec![CommitResult::default(); requests.len()];
        let (Some(published), Some(engine)) = (inner.published.read().clone(), inner.engine()) else {
            return results;
        };
        let now = inner.config.clock.now();
        let mut state = inner.wait_for_writers(requests);
        let mut batch = inner.take_slots(&mut state, requests, now, &mut results);
        drop(state);
        if batch.jobs.is_empty() {
            return results;
        }
        inner.write_jobs(engine.as_ref(), &published, &mut batch.jobs);
        inner.publish_writes(batch, &mut results);
        results
    }

    /// `batch_abort`: the slots' pages and bytes go back.
    pub(super) fn abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        let mut state = self.inner.state.lock();
        for id in slot_ids {
            state.abort(*id);
        }
        self.inner.update_staging_gauge(&state);
        vec![true; slot_ids.len()]
    }
}

impl Inner {
    /// Takes the lock once no other batch is writing one of the requests' keys (waiting without
    /// it): the first commit of a key lands before the next one reserves, so the live record (the
    /// first to land) is also the one with the highest seq, as recovery decides.
    fn wait_for_writers(&self, requests: &[CommitRequest]) -> MutexGuard<'_, State> {
        loop {
            let state = self.state.lock();
            match state.writer_of(requests.iter().map(|r| r.key.as_str())) {
                Some(flight) => {
                    drop(state);
                    flight.wait(Duration::from_millis(100));
                }
                None => return state,
            }
        }
    }

    /// Phase 1 of a commit: takes each request's slot and reserves its record's place in the log,
    /// answering at once the requests that write nothing.
    fn take_slots(
        &self,
        state: &mut State,
        requests: &[CommitRequest],
        now: Instant,
        results: &mut [CommitResult],
    ) -> Batch {
        let generation = state.generation();
        let mut batch = Batch::default();
        // This batch's writes reserved so far, per segment.
        let mut own_writes = Vec::new();
        for (i, req) in requests.iter().enumerate() {
            let Some(slot) = state.begin_commit(req.slot_id) else { continue };
            // The commit-time key is the one stored (the trait's contract; `AllocateRequest::key`
            // is a dedup hint), so it is checked here as allocate checks its own: empty or too
            // long, the slot is released and the commit fails.
            let bad_key = req.key.is_empty() || req.key.len() > MAX_KEY_LEN;
            if slot.generation != generation || slot.deadline <= now || bad_key {
                // Pre-clear or expired: the writer's bytes may be stale; the pages go back silently.
                state.abandon_commit(&slot.pages, slot.size);
                continue;
            }
            if let Some(existing) = state.owned(&req.key) {
                // Lost a race with another writer of the same key: the first value stays.
                results[i] = CommitResult { success: true, bytes_committed: existing.size };
                state.abandon_commit(&slot.pages, slot.size);
                continue;
            }
            if let Some(winner) = batch.jobs.iter().find(|j| j.key == req.key) {
                // An earlier request of this batch commits the key: it is first, this one is
                // not written (it answers with the winner's outcome once the batch is published).
                batch.in_batch_losers.push((i, winner.index));
                state.abandon_commit(&slot.pages, slot.size);
                continue;
            }
            let Ok(header) = AlignedBuf::zeroed(header_len(req.key.len()) as usize) else {
                state.abandon_commit(&slot.pages, slot.size);
                continue;
            };
            let (res, flight) = state.reserve_commit(&req.key, record_len(req.key.len(), slot.size));
            let shared = shared_with_others(&res, &mut own_writes);
            batch.flights.push((req.key.clone(), flight));
            batch.jobs.push(Job {
                index: i,
                key: req.key.clone(),
                pages: slot.pages,
                size: slot.size,
                file: res.file,
                loc: res.loc,
                header,
                generation,
                crc32c: req.crc32c,
                flight: None,
                outcome: JobOutcome::IoError,
                shared,
            });
        }
        self.update_staging_gauge(state);
        batch
    }

    /// Phase 3 of a commit: publishes what landed, gives every staging page back (or keeps it as
    /// a clean copy), wakes the commits of the same keys waiting in other batches and makes room
    /// down to the low watermark.
    fn publish_writes(&self, batch: Batch, results: &mut [CommitResult]) {
        let now = self.config.clock.now();
        let cache = self.config.cache_committed;
        let mut state = self.state.lock();
        let mut written = Vec::new();
        for job in batch.jobs {
            let ok = job.outcome == JobOutcome::Ok;
            let slot = JobSlot {
                pages: job.pages,
                size: job.size,
                loc: job.loc,
                generation: job.generation,
                crc32c: job.crc32c,
            };
            match state.finish_commit(&job.key, slot, ok, cache) {
                Landed::Failed | Landed::Cleared => {}
                Landed::Superseded(bytes) => {
                    results[job.index] = CommitResult { success: true, bytes_committed: bytes }
                }
                Landed::Published => {
                    results[job.index] = CommitResult { success: true, bytes_committed: job.size };
                    written.push(job.key);
                }
            }
        }
        for (i, winner) in batch.in_batch_losers {
            if results[winner].success {
                results[i] = results[winner];
            }
        }
        for (key, flight) in batch.flights {
            state.end_writing(&key, &flight);
            flight.finish();
        }
        self.after_commit_watermark(&mut state, now, &written);
        self.update_staging_gauge(&state);
    }

    /// Evicts least recently used keys until `used <= target` (metadata only: no IO), never one in
    /// `spare`.
    pub(super) fn evict_down_to(&self, state: &mut State, target: u64, now: Instant, spare: &[String]) {
        self.evict_while(state, |s| s.used() > target, now, spare);
    }

    /// Evicts least recently used keys (sparing `spare` and keys in use) while `over` holds.
    fn evict_while(&self, state: &mut State, over: impl Fn(&State) -> bool, now: Instant, spare: &[String]) {
        if !over(state) {
            return;
        }
        bump(&self.counters.eviction_round);
        // A set, so stepping over a key costs O(1) however large the batch that was just written.
        let spare: HashSet<&str> = spare.iter().map(String::as_str).collect();
        let victims = state.evict_lru(over, now, &spare);
        self.counters.eviction_victim.fetch_add(victims, Ordering::Relaxed);
    }

    /// The check after a write: at the high watermark, evict down to the low one (sparing the keys
    /// just written, which would otherwise be the only candidates when the rest is leased).
    ///
    /// What is watched is the drive footprint of the values (`used`) plus their records' overhead
    /// (header blocks, padding): live records on the drive, not only values, stay within capacity.
    fn after_commit_watermark(&self, state: &mut State, now: Instant, written: &[String]) {
        if let Some(w) = self.config.watermarks
            && state.footprint() as f64 >= w.high * state.total() as f64
        {
            let low = (w.low * state.total() as f64) as u64;
            self.evict_while(state, |s| s.footprint() > low, now, written);
        }
    }
}

/// Whether a write reserved as `res` may run beside another caller's write to its segment: the
/// segment had more writes in flight than the ones this caller reserved there before (`own`, per
/// segment, which this counts `res` into).
pub(super) fn shared_with_others(res: &crate::store::Reservation, own: &mut Vec<(SegId, u32)>) -> bool {
    let mine = match own.iter_mut().find(|(seg, _)| *seg == res.loc.seg) {
        Some((_, n)) => {
            *n += 1;
            *n - 1
        }
        None => {
            own.push((res.loc.seg, 1));
            0
        }
    };
    res.in_flight > mine
}
