//! The `MediumBackend` implementation of the SSD medium: a thin layer over the backend's state,
//! recovery, write and read paths.

use super::resolve::Plan;
use super::*;

impl MediumBackend for SsdBackend {
    fn tier(&self) -> TierType {
        TierType::Ssd
    }

    fn name(&self) -> &str {
        NAME
    }

    fn init(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        let mut lifecycle = self.lifecycle.lock();
        match *lifecycle {
            Lifecycle::Live => return Ok(()),
            Lifecycle::ShutDown => return Err(BackendError::ShutDown(NAME.into())),
            Lifecycle::New => {}
        }
        let config = &self.inner.config;
        check_open_file_limit(config)?;
        let engine: Arc<dyn IoEngine> =
            make_engine(config.io_engine, config.queue_depth, config.io_uring_rings as usize)
                .map_err(|e| Self::io_error(format!("starting the {} io engine", config.io_engine), e))?
                .into();
        let Recovered { log, owned, tombs, total, locks } = self.open_log(engine.as_ref())?;
        let arena = config.staging_pages * config.page_size;
        let buffers = self.source.allocate(&[arena]).map_err(|e| BackendError::OutOfMemory {
            medium: NAME.into(),
            requested: arena,
            reason: std::error::Error::source(&e).map_or_else(|| e.to_string(), |c| format!("{e}: {c}")),
        })?;
        let Some(base) = buffers.first().copied() else {
            self.source.release();
            return Err(BackendError::OutOfMemory {
                medium: NAME.into(),
                requested: arena,
                reason: "no buffer".into(),
            });
        };
        // The arena is exactly `staging_pages` pages, whatever rounding the source applied.
        let staging = match PageBitmapAllocator::new(config.page_size, &[arena]) {
            Ok(a) => a,
            Err(e) => {
                self.source.release();
                return Err(BackendError::InvalidConfig(e.to_string()));
            }
        };
        let registered = match self.register(registrar.as_ref(), base) {
            Ok(r) => r,
            Err(e) => {
                self.source.release();
                return Err(e);
            }
        };
        let r#ref = registered.clone().truncated(arena);
        let desc = BufferDesc::from_ref(0, &r#ref);
        let reaper = match self.start_reaper() {
            Ok(r) => r,
            Err(e) => {
                registrar.deregister(&registered);
                self.source.release();
                return Err(Self::io_error("starting the reaper thread".into(), e));
            }
        };
        // SAFETY: the arena stays mapped until `shutdown`, which drops the engine (and its rings)
        // before releasing the arena; nothing between here and publishing can fail.
        unsafe { engine.register_arena(base.base().as_ptr(), arena as usize) };
        let recovered = owned.len();
        let engine_name = engine.name();
        *self.inner.engine.write() = Some(engine);
        *self.inner.published.write() = Some(Arc::new(Published { registrar, registered, r#ref, desc, base }));
        {
            let mut state = self.inner.state.lock();
            let mut used = 0;
            let mut overhead = 0;
            for (key, o) in owned {
                used += self.inner.bytes_of(o.size);
                overhead += o.overhead(config.page_size);
                state.lru.touch(&key);
                state.owned.insert(key, o);
            }
            state.used = used;
            state.overhead = overhead;
            state.total = total;
            state.log = log;
            state.pace = Pace::default();
            state.tombs.clear();
            for (key, t) in tombs {
                state.tombs.insert(key, t);
            }
            state.staging = Some(staging);
        }
        *self.reaper.lock() = Some(reaper);
        *self.inner.locks.lock() = locks;
        *lifecycle = Lifecycle::Live;
        tracing::info!(dirs = ?config.dirs, capacity = total, recovered, engine = engine_name, "SSD medium live");
        Ok(())
    }

    fn shutdown(&self) {
        let mut lifecycle = self.lifecycle.lock();
        if *lifecycle == Lifecycle::ShutDown {
            return;
        }
        *lifecycle = Lifecycle::ShutDown;
        self.stop_reaper();
        // Log the last evictions, so the keys stay gone after a restart.
        self.inner.flush_tombstones();
        let old = std::mem::take(&mut *self.inner.state.lock());
        // Make what was written durable before the process may go (outside the lock).
        for seg in old.log.segs.values() {
            if let Some(f) = seg.file.if_open()
                && let Err(e) = f.sync_data()
            {
                tracing::warn!(segment = %seg.file.path.display(), error = %e, "fdatasync failed at shutdown");
            }
        }
        drop(old);
        *self.inner.engine.write() = None;
        // The directories are free for another medium once nothing more is written to them.
        self.inner.locks.lock().clear();
        // Deregister before release: a transport may still map the arena.
        if let Some(p) = self.inner.published.write().take() {
            p.registrar.deregister(&p.registered);
        }
        self.source.release();
    }

    fn capacity(&self) -> TierCapacity {
        let state = self.inner.state.lock();
        if state.staging.is_none() {
            return TierCapacity::default();
        }
        TierCapacity { total_bytes: state.total, available_bytes: state.total.saturating_sub(state.used) }
    }

    fn owned_key_count(&self) -> usize {
        self.inner.state.lock().owned.len()
    }

    fn drain_pending_events(&self) -> Vec<KvEvent> {
        self.inner.state.lock().outbox.take()
    }

    fn snapshot_owned_keys(&self) -> Vec<KvEvent> {
        let state = self.inner.state.lock();
        state.owned.iter().map(|(k, o)| KvEvent::add(k.clone(), TierType::Ssd, o.size)).collect()
    }

    fn snapshot_owned_keys_for_full_sync(&self) -> Vec<KvEvent> {
        let mut state = self.inner.state.lock();
        state.outbox.clear();
        state.owned.iter().map(|(k, o)| KvEvent::add(k.clone(), TierType::Ssd, o.size)).collect()
    }

    fn clear_local(&self) {
        let now = self.inner.config.clock.now();
        let dead = {
            let mut state = self.inner.state.lock();
            state.generation += 1;
            state.owned.clear();
            state.overhead = 0;
            state.lru.clear();
            // The whole log goes: nothing is left for a tombstone to hold down.
            state.tombs.clear();
            state.tomb_pending.clear();
            let staged = state.staged.take();
            for (key, s) in staged {
                match Deferred::of(&key, s, now) {
                    // A reader may still be copying out of these pages.
                    Ok(d) => state.deferred.push(d),
                    Err(pages) => state.free(&pages),
                }
            }
            let pending: u64 = state.pending.values().map(|p| self.inner.bytes_of(p.size)).sum();
            state.used = pending + state.committing;
            // Every record is dead now; the files go as soon as no write is in flight in them.
            let segs: Vec<u64> = state.log.segs.keys().copied().collect();
            for id in segs {
                if let Some(s) = state.log.segs.get_mut(&id) {
                    s.live = 0;
                }
            }
            state.log.seal_all();
            state.outbox.clear();
            self.inner.update_staging_gauge(&state);
            // Set under the lock so no allocation slips between the generation bump and the gate.
            self.inner.clear_pending.store(true, Ordering::Release);
            state.log.take_dead_segments()
        };
        // Deleting the files keeps a restart from bringing the cleared keys back.
        self.inner.delete_segments(dead);
    }

    fn clear_full_sync_acked(&self) {
        self.inner.clear_pending.store(false, Ordering::Release);
    }

    fn is_clear_full_sync_pending(&self) -> bool {
        self.inner.clear_pending.load(Ordering::Acquire)
    }

    fn set_auto_flush_hook(&self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.inner.state.lock().outbox.set_auto_flush(threshold, hook);
    }

    fn batch_allocate(&self, requests: &[AllocateRequest]) -> Vec<AllocateResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        let inner = &self.inner;
        let config = &inner.config;
        let ps = config.page_size;
        let pending_ttl_ms = u64::try_from(config.pending_ttl.as_millis()).unwrap_or(u64::MAX);
        let published = inner.published.read().clone();
        let now = config.clock.now();
        let deadline = now + config.pending_ttl;
        let mut state = inner.state.lock();
        let clearing = inner.clear_pending.load(Ordering::Acquire);
        let generation = state.generation;
        let total_pages = state.total / ps;
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
            {
                results.push(AllocateResult::outcome(AllocateOutcome::Failed));
                continue;
            }
            if state.staging.is_none() {
                results.push(AllocateResult::outcome(AllocateOutcome::Failed));
                continue;
            }
            if state.owned.contains_key(&req.key) {
                results.push(AllocateResult::outcome(AllocateOutcome::AlreadyExists));
                continue;
            }
            let bytes = n * ps;
            if state.used + bytes > state.total
                && let Some(w) = config.watermarks
            {
                let low = (w.low * state.total as f64) as u64;
                let target = low.min(state.total - bytes);
                inner.evict_down_to(&mut state, target, now, &[]);
            }
            if state.used + bytes > state.total {
                results.push(AllocateResult::outcome(AllocateOutcome::FailedNoSpace));
                continue;
            }
            let Some(pages) = state.take_staging(n, now) else {
                // The drive has room, but every staging page is held by pending slots (this batch's
                // among them) and readers: busy, not full. The pages come back without eviction
                // (commits, aborts, releases, the TTLs), and `n <= max_value_pages <= staging_pages`,
                // so the value fits once they do: the writer asks again.
                bump(&inner.counters.staging_busy_allocate);
                results.push(AllocateResult::outcome(AllocateOutcome::Busy));
                continue;
            };
            state.used += bytes;
            let slot_id = inner.next_slot_id.fetch_add(1, Ordering::Relaxed);
            state.pending.insert(slot_id, Pending { pages: pages.clone(), size: req.size, deadline, generation });
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

    fn batch_commit(&self, requests: &[CommitRequest]) -> Vec<CommitResult> {
        if requests.is_empty() {
            return Vec::new();
        }
        let inner = &self.inner;
        let config = &inner.config;
        let mut results = vec![CommitResult::default(); requests.len()];
        let (Some(published), Some(engine)) = (inner.published.read().clone(), inner.engine()) else {
            return results;
        };
        let now = config.clock.now();
        // Phase 1: take the slots and reserve their places in the log.
        let mut jobs: Vec<Job> = Vec::new();
        // Later commits of a key that an earlier request of this batch commits: (request, winner).
        let mut in_batch_losers = Vec::new();
        let mut flights: Vec<(String, Arc<Flight>)> = Vec::new();
        {
            // Wait (without the lock) until no other batch is writing one of these keys: the first
            // commit of a key lands before the next one reserves, so the live record (the first to
            // land) is also the one with the highest seq, as recovery decides.
            let mut state = loop {
                let state = inner.state.lock();
                let busy = requests.iter().find_map(|r| state.writing.get(&r.key).cloned());
                match busy {
                    Some(flight) => {
                        drop(state);
                        flight.wait(Duration::from_millis(100));
                    }
                    None => break state,
                }
            };
            let generation = state.generation;
            // This batch's writes reserved so far, per segment.
            let mut own_writes = Vec::new();
            for (i, req) in requests.iter().enumerate() {
                let Some(slot) = state.pending.remove(&req.slot_id) else { continue };
                let bytes = inner.bytes_of(slot.size);
                // The commit-time key is the one stored (the trait's contract; `AllocateRequest::key`
                // is a dedup hint), so it is checked here as allocate checks its own: empty or too
                // long, the slot is released and the commit fails.
                let bad_key = req.key.is_empty() || req.key.len() > MAX_KEY_LEN;
                if slot.generation != generation || slot.deadline <= now || bad_key {
                    // Pre-clear or expired: the writer's bytes may be stale; the pages go back silently.
                    state.free(&slot.pages);
                    state.used = state.used.saturating_sub(bytes);
                    continue;
                }
                if let Some(existing) = state.owned.get(&req.key) {
                    // Lost a race with another writer of the same key: the first value stays.
                    results[i] = CommitResult { success: true, bytes_committed: existing.size };
                    state.free(&slot.pages);
                    state.used = state.used.saturating_sub(bytes);
                    continue;
                }
                if let Some(winner) = jobs.iter().find(|j| j.key == req.key) {
                    // An earlier request of this batch commits the key: it is first, this one is
                    // not written (it answers with the winner's outcome after phase 3).
                    in_batch_losers.push((i, winner.index));
                    state.free(&slot.pages);
                    state.used = state.used.saturating_sub(bytes);
                    continue;
                }
                let Ok(header) = AlignedBuf::zeroed(header_len(req.key.len()) as usize) else {
                    state.free(&slot.pages);
                    state.used = state.used.saturating_sub(bytes);
                    continue;
                };
                let res = state.log.reserve(record_len(req.key.len(), slot.size));
                let shared = shared_with_others(&res, &mut own_writes);
                state.committing += bytes;
                let flight = Arc::new(Flight::default());
                state.writing.insert(req.key.clone(), Arc::clone(&flight));
                flights.push((req.key.clone(), flight));
                jobs.push(Job {
                    index: i,
                    key: req.key.clone(),
                    pages: slot.pages,
                    size: slot.size,
                    file: res.file,
                    loc: res.loc,
                    header,
                    generation,
                    flight: None,
                    outcome: JobOutcome::IoError,
                    shared,
                });
            }
            inner.update_staging_gauge(&state);
        }
        if jobs.is_empty() {
            return results;
        }
        // Phase 2: spill, with no lock held.
        inner.write_jobs(engine.as_ref(), &published, &mut jobs);
        // Phase 3: publish what landed, give every staging page back (or keep it as a clean copy).
        let now = config.clock.now();
        let mut state = inner.state.lock();
        let mut written = Vec::new();
        for job in jobs {
            let bytes = inner.bytes_of(job.size);
            state.committing = state.committing.saturating_sub(bytes);
            state.log.finish_write(job.loc.seg);
            if job.outcome != JobOutcome::Ok {
                state.free(&job.pages);
                state.used = state.used.saturating_sub(bytes);
                // Recovery stops at the first hole in a segment: append nothing behind this one.
                state.log.seal(job.loc.seg);
                continue;
            }
            if state.generation != job.generation {
                // A clear happened during the write (it kept this commit's bytes in `used`, as
                // `committing`): the value is dropped, its record is dead.
                state.free(&job.pages);
                state.used = state.used.saturating_sub(bytes);
                continue;
            }
            // Commits of one key are serialized (`writing`), so neither case below is expected; both
            // keep memory where recovery would be: a value already owned stays (first wins, and it
            // is the newer record), and a record older than a tombstone of the key on the drive is
            // dead (the tombstone hides it at a restart).
            let existing = state.owned.get(&job.key).map(|o| o.size);
            let tomb_newer = state.tombs.get(&job.key).is_some_and(|t| t.loc.seq > job.loc.seq);
            if tomb_newer || existing.is_some() {
                results[job.index] = CommitResult { success: true, bytes_committed: existing.unwrap_or(job.size) };
                state.free(&job.pages);
                state.used = state.used.saturating_sub(bytes);
                continue;
            }
            state.log.add_live(&job.loc);
            // The new record outranks every older one of the key: its tombstones are not needed.
            if let Some(t) = state.tombs.remove(&job.key) {
                state.log.kill(&t.loc);
            }
            state.tomb_pending.retain(|(k, _, _)| *k != job.key);
            let owned = Owned { loc: job.loc, size: job.size };
            state.overhead += owned.overhead(config.page_size);
            state.owned.insert(job.key.clone(), owned);
            state.lru.touch(&job.key);
            if config.cache_committed && !state.staged.contains_key(&job.key) {
                state.staged.insert(job.key.clone(), Staged::clean(job.pages, job.size));
            } else {
                state.free(&job.pages);
            }
            state.push_event(KvEvent::add(job.key.clone(), TierType::Ssd, job.size));
            results[job.index] = CommitResult { success: true, bytes_committed: job.size };
            written.push(job.key);
        }
        for (i, winner) in in_batch_losers {
            if results[winner].success {
                results[i] = results[winner];
            }
        }
        for (key, flight) in flights {
            if state.writing.get(&key).is_some_and(|f| Arc::ptr_eq(f, &flight)) {
                state.writing.remove(&key);
            }
            flight.finish();
        }
        inner.after_commit_watermark(&mut state, now, &written);
        inner.update_staging_gauge(&state);
        results
    }

    fn batch_abort(&self, slot_ids: &[u64]) -> Vec<bool> {
        if slot_ids.is_empty() {
            return Vec::new();
        }
        let mut state = self.inner.state.lock();
        for id in slot_ids {
            if let Some(slot) = state.pending.remove(id) {
                state.free(&slot.pages);
                state.used = state.used.saturating_sub(self.inner.bytes_of(slot.size));
            }
        }
        self.inner.update_staging_gauge(&state);
        vec![true; slot_ids.len()]
    }

    fn batch_resolve(&self, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        if keys.is_empty() {
            return Vec::new();
        }
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

    fn batch_contains(&self, keys: &[String]) -> Vec<bool> {
        // From the index: an existence check must not read the drive nor hold a staging page.
        let state = self.inner.state.lock();
        keys.iter().map(|k| state.owned.contains_key(k)).collect()
    }

    fn release_reads(&self, reads: &[umbp_core::ReadRelease]) {
        if !reads.is_empty() {
            self.inner.release(reads);
        }
    }

    fn evict(&self, keys: &[String]) -> Vec<EvictResult> {
        let now = self.inner.config.clock.now();
        let ps = self.inner.config.page_size;
        let mut state = self.inner.state.lock();
        let mut results = Vec::with_capacity(keys.len());
        for key in keys {
            let bytes_freed = if state.evictable(key, now) {
                match state.drop_owned(key, ps, now) {
                    Some(o) => {
                        state.push_event(KvEvent::remove(key.clone(), TierType::Ssd));
                        o.size
                    }
                    None => 0,
                }
            } else {
                0
            };
            results.push(EvictResult { key: key.clone(), bytes_freed });
        }
        self.inner.update_staging_gauge(&state);
        results
    }

    fn page_size(&self) -> u64 {
        self.inner.config.page_size
    }

    fn all_buffer_descs(&self) -> Vec<BufferDesc> {
        self.inner.published.read().as_ref().map(|p| vec![p.desc.clone()]).unwrap_or_default()
    }

    fn buffer_count(&self) -> usize {
        usize::from(self.inner.published.read().is_some())
    }

    fn buffer_ref(&self, index: usize) -> Option<TransferRef> {
        if index != 0 {
            return None;
        }
        self.inner.published.read().as_ref().map(|p| p.r#ref.clone())
    }
}
