//! Phase 1 of a resolve: hits, misses, single-flight reads led and followed.

use super::*;

/// What phase 1 of a resolve decided for one key.
pub(super) enum Plan {
    Done(ResolvedEntry),
    Lead,
    Follow(Arc<Flight>),
}

impl SsdBackend {
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
            let mut guard = inner.state.lock();
            let state = &mut *guard;
            let generation = state.generation;
            for key in keys {
                if let Some(s) = state.staged.get_mut(key) {
                    let lease = s.hold(now, lease_until, &mut state.lease_ids);
                    let (pages, size) = (s.pages.clone(), s.size);
                    state.staged.touch(key);
                    state.lru.touch(key);
                    bump(&inner.counters.staged_hit);
                    plans.push(Plan::Done(inner.entry(descs, pages, size, lease)));
                    continue;
                }
                if config.single_flight
                    && let Some(f) = state.flights.get(key)
                {
                    bump(&inner.counters.single_flight_merged);
                    plans.push(Plan::Follow(Arc::clone(f)));
                    continue;
                }
                let Some(owned) = state.owned.get(key).copied() else {
                    plans.push(Plan::Done(ResolvedEntry::miss()));
                    continue;
                };
                let Some(file) = state.log.segs.get(&owned.loc.seg).map(|s| Arc::clone(&s.file)) else {
                    plans.push(Plan::Done(ResolvedEntry::miss()));
                    continue;
                };
                let n = owned.size.div_ceil(config.page_size);
                let Some(pages) = state.take_staging(n, now) else {
                    // The key is here, but every staging page is held by a reader or a writer:
                    // busy, so the reader waits (its own and others' releases free pages) and asks
                    // this node again instead of treating the key as missing (pinned by a test).
                    // Only a value no arena could ever stage (or a medium shut down) is a miss.
                    let stageable = state.staging.as_ref().is_some_and(|a| n <= a.total_pages());
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
                let flight = config.single_flight.then(|| {
                    let f = Arc::new(Flight::default());
                    state.flights.insert(key.clone(), Arc::clone(&f));
                    bump(&inner.counters.single_flight_lead);
                    f
                });
                *state.reading.entry(key.clone()).or_insert(0) += 1;
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
                    flight,
                    outcome: JobOutcome::IoError,
                    shared: false,
                });
            }
            inner.update_staging_gauge(state);
        }
        if jobs.is_empty() {
            return plans;
        }
        inner.read_jobs(engine.as_ref(), &published, &mut jobs);
        let now = config.clock.now();
        let lease_until = now + config.read_lease_ttl;
        let mut finished = Vec::new();
        {
            let mut guard = inner.state.lock();
            let state = &mut *guard;
            for job in jobs {
                if let Some(n) = state.reading.get_mut(&job.key) {
                    *n -= 1;
                    if *n == 0 {
                        state.reading.remove(&job.key);
                    }
                }
                if let Some(f) = &job.flight {
                    if state.flights.get(&job.key).is_some_and(|g| Arc::ptr_eq(f, g)) {
                        state.flights.remove(&job.key);
                    }
                    finished.push(Arc::clone(f));
                }
                let current = state.generation == job.generation
                    && state.owned.get(&job.key).is_some_and(|o| o.loc.seq == job.loc.seq);
                let entry = match job.outcome {
                    JobOutcome::Ok if current => {
                        state.lru.touch(&job.key);
                        if let Some(s) = state.staged.get_mut(&job.key) {
                            // Another fill of the key landed first (single flight off): share it.
                            let lease = s.hold(now, lease_until, &mut state.lease_ids);
                            let (pages, size) = (s.pages.clone(), s.size);
                            state.staged.touch(&job.key);
                            state.free(&job.pages);
                            inner.entry(descs, pages, size, lease)
                        } else {
                            let pages = job.pages.clone();
                            let mut staged = Staged::clean(job.pages, job.size);
                            let lease = staged.hold(now, lease_until, &mut state.lease_ids);
                            state.staged.insert(job.key.clone(), staged);
                            inner.entry(descs, pages, job.size, lease)
                        }
                    }
                    JobOutcome::Corrupt if current => {
                        state.free(&job.pages);
                        // Never serve wrong bytes: the key goes, and the master hears about it.
                        if state.drop_owned(&job.key, config.page_size, now).is_some() {
                            state.push_event(KvEvent::remove(job.key.clone(), TierType::Ssd));
                        }
                        ResolvedEntry::miss()
                    }
                    _ => {
                        state.free(&job.pages);
                        ResolvedEntry::miss()
                    }
                };
                plans[job.index] = Plan::Done(entry);
            }
            inner.update_staging_gauge(state);
        }
        for f in finished {
            f.finish();
        }
        plans
    }
}
