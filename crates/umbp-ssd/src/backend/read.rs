//! The read path of the SSD medium: hits on cached staged copies, drive reads into staging pages
//! with single flight (one drive read for any number of concurrent resolves of a key), the final
//! re-validation of every hit, and the readers' releases.

use super::state::{Filled, JobSlot, Released};
use super::*;

/// The longest a follower waits for the leader of a single-flight read (the reference's 30 s); the
/// wait is also capped at half the read lease (see [`follower_wait`]).
const FOLLOWER_WAIT: Duration = Duration::from_secs(30);
/// How many times a resolve of one key follows someone else's read before it gives up (busy:
/// the reader asks again later).
const FOLLOW_ROUNDS: usize = 3;

/// One drive read (or write) of a key that concurrent resolves (or commits) of the key wait on.
#[derive(Debug, Default)]
pub(super) struct Flight {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Flight {
    /// Ends the flight, waking every waiter.
    pub(super) fn finish(&self) {
        *self.done.lock() = true;
        self.cv.notify_all();
    }

    /// Waits up to `timeout` for the flight to end; whether it did.
    pub(super) fn wait(&self, timeout: Duration) -> bool {
        let mut done = self.done.lock();
        let deadline = Instant::now() + timeout;
        while !*done {
            if self.cv.wait_until(&mut done, deadline).timed_out() {
                return *done;
            }
        }
        true
    }
}

/// What phase 1 of a resolve decided for one key.
pub(super) enum Plan {
    Done(ResolvedEntry),
    Lead,
    Follow(Arc<Flight>),
}

/// How long a follower waits for a single-flight leader: at most [`FOLLOWER_WAIT`] and at most half
/// the read lease, so a resolve that follows never holds its other hits' leases for long (they are
/// re-validated and renewed before it returns anyway).
pub(super) fn follower_wait(lease: Duration) -> Duration {
    FOLLOWER_WAIT.min(lease / 2)
}

impl SsdBackend {
    /// `batch_resolve`: a round over every key, then, per key that someone else was reading,
    /// follow that read and look again; last, every hit is re-validated.
    pub(super) fn resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        let wait = follower_wait(self.inner.config.read_lease_ttl);
        let plans = self.resolve_round(keys, include_descs);
        let entries: Vec<ResolvedEntry> = plans
            .into_iter()
            .zip(keys)
            .map(|(plan, key)| {
                let mut plan = plan;
                // Follow someone else's read, then look again: usually the staged copy is there.
                // A key still being read by someone else after that is busy, not missing: the
                // reader asks again later.
                for _ in 0..FOLLOW_ROUNDS {
                    match plan {
                        Plan::Done(entry) => return entry,
                        Plan::Lead => return ResolvedEntry::miss(),
                        Plan::Follow(flight) => {
                            if !flight.wait(wait) {
                                tracing::warn!(key = %key, "gave up waiting for another read of the key; answering busy");
                                return ResolvedEntry::busy();
                            }
                            plan = self
                                .resolve_round(std::slice::from_ref(key), include_descs)
                                .pop()
                                .unwrap_or(Plan::Done(ResolvedEntry::miss()));
                        }
                    }
                }
                match plan {
                    Plan::Done(entry) => entry,
                    Plan::Follow(_) => ResolvedEntry::busy(),
                    Plan::Lead => ResolvedEntry::miss(),
                }
            })
            .collect();
        self.inner.revalidate(keys, entries)
    }

    /// Resolves `keys` (one round: hits, misses and reads led here; keys being read by someone else
    /// come back as `Follow`).
    pub(super) fn resolve_round(&self, keys: &[String], include_descs: bool) -> Vec<Plan> {
        let inner = &self.inner;
        let config = &inner.config;
        let Some(published) = inner.published.read().clone() else {
            return keys.iter().map(|_| Plan::Done(ResolvedEntry::miss())).collect();
        };
        let Some(engine) = inner.engine() else {
            return keys.iter().map(|_| Plan::Done(ResolvedEntry::miss())).collect();
        };
        let descs = include_descs.then_some(published.as_ref());
        let now = config.clock.now();
        let lease_until = now + config.read_lease_ttl;
        let mut plans = Vec::with_capacity(keys.len());
        let mut jobs = Vec::new();
        {
            let mut state = inner.state.lock();
            let generation = state.generation();
            for key in keys {
                if let Some(hit) = state.hold_staged(key, now, lease_until) {
                    bump(&inner.counters.staged_hit);
                    plans.push(Plan::Done(inner.entry(descs, hit)));
                    continue;
                }
                if config.single_flight
                    && let Some(f) = state.flight_of(key)
                {
                    bump(&inner.counters.single_flight_merged);
                    plans.push(Plan::Follow(f));
                    continue;
                }
                let Some(owned) = state.owned(key) else {
                    plans.push(Plan::Done(ResolvedEntry::miss()));
                    continue;
                };
                let Some(file) = state.log().segs.get(&owned.loc.seg).map(|s| Arc::clone(&s.file)) else {
                    plans.push(Plan::Done(ResolvedEntry::miss()));
                    continue;
                };
                let n = owned.size.div_ceil(config.page_size);
                let Some(pages) = state.take_staging(n, now) else {
                    // The key is here, but every staging page is held by a reader or a writer:
                    // busy, so the reader waits (its own and others' releases free pages) and asks
                    // this node again instead of treating the key as missing (pinned by a test).
                    // Only a value no arena could ever stage (or a medium shut down) is a miss.
                    let stageable = state.stageable(n);
                    if stageable {
                        bump(&inner.counters.staging_full_reject);
                    }
                    let entry = if stageable { ResolvedEntry::busy() } else { ResolvedEntry::miss() };
                    plans.push(Plan::Done(entry));
                    continue;
                };
                let Ok(header) = AlignedBuf::zeroed(header_len(key.len()) as usize) else {
                    state.free(&pages);
                    plans.push(Plan::Done(ResolvedEntry::miss()));
                    continue;
                };
                let flight = state.start_read(key, config.single_flight);
                if flight.is_some() {
                    bump(&inner.counters.single_flight_lead);
                }
                plans.push(Plan::Lead);
                jobs.push(Job {
                    index: plans.len() - 1,
                    key: key.clone(),
                    pages,
                    size: owned.size,
                    file,
                    loc: owned.loc,
                    header,
                    generation,
                    crc32c: owned.crc32c,
                    flight,
                    outcome: JobOutcome::IoError,
                    shared: false,
                });
            }
            inner.update_staging_gauge(&state);
        }
        if jobs.is_empty() {
            return plans;
        }
        inner.read_jobs(engine.as_ref(), &published, &mut jobs);
        let now = config.clock.now();
        let lease_until = now + config.read_lease_ttl;
        let mut finished = Vec::new();
        {
            let mut state = inner.state.lock();
            for job in jobs {
                let slot = JobSlot {
                    pages: job.pages,
                    size: job.size,
                    loc: job.loc,
                    generation: job.generation,
                    crc32c: job.crc32c,
                };
                let filled = state.finish_read(&job.key, job.flight.as_ref(), slot, job.outcome, now, lease_until);
                let entry = match filled {
                    Filled::Hit(hit) => inner.entry(descs, hit),
                    Filled::Miss => ResolvedEntry::miss(),
                };
                if let Some(f) = job.flight {
                    finished.push(f);
                }
                plans[job.index] = Plan::Done(entry);
            }
            inner.update_staging_gauge(&state);
        }
        for f in finished {
            f.finish();
        }
        plans
    }
}

impl Inner {
    /// The last step of a resolve: every hit is checked again under the lock, just before the
    /// entries go to the reader. A hit's lease was taken when its round ran; the resolve may since
    /// have waited on other keys' reads and done drive IO, long enough for that lease to lapse and
    /// its pages to be handed to an allocation or another fill. A hit whose key's cached copy still
    /// holds exactly the pages in the entry gets its lease renewed from now; any other hit becomes a
    /// miss.
    pub(super) fn revalidate(&self, keys: &[String], mut entries: Vec<ResolvedEntry>) -> Vec<ResolvedEntry> {
        if !entries.iter().any(|e| e.found) {
            return entries;
        }
        let now = self.config.clock.now();
        let until = now + self.config.read_lease_ttl;
        let mut state = self.state.lock();
        for (key, entry) in keys.iter().zip(entries.iter_mut()) {
            if entry.found {
                state.revalidate(key, entry, now, until);
            }
        }
        entries
    }

    /// One reader of each hit is done: see [`MediumBackend::release_reads`].
    pub(super) fn release(&self, reads: &[umbp_core::ReadRelease]) {
        let now = self.config.clock.now();
        let mut state = self.state.lock();
        let mut freed = false;
        for r in reads {
            match state.release_read(r, now) {
                Released::Lease => bump(&self.counters.lease_released),
                Released::Freed => freed = true,
                Released::Nothing => {}
            }
        }
        if freed {
            self.update_staging_gauge(&state);
        }
    }
}
