//! The background log work of the SSD medium: tombstones, segment deletion, periodic sync and
//! compaction (methods of the backend's shared state).

use super::*;

impl Inner {
    /// Writes the queued tombstones (one small record each, in one engine batch) and puts them in
    /// force. A tombstone lost to a failed write or a crash only lets its key come back after a
    /// restart, with bytes that still pass their CRC.
    pub(super) fn flush_tombstones(&self) {
        let Some(engine) = self.engine() else { return };
        let (mut batch, generation) = {
            let mut state = self.state.lock();
            if state.tomb_pending.is_empty() {
                return;
            }
            let pending = std::mem::take(&mut state.tomb_pending);
            let generation = state.generation;
            let mut own_writes = Vec::new();
            let batch: Vec<(String, u64, u64, crate::store::Reservation, bool)> = pending
                .into_iter()
                .map(|(key, seq, horizon)| {
                    let res = state.log.reserve(record_len(key.len(), 8));
                    let shared = shared_with_others(&res, &mut own_writes);
                    (key, seq, horizon, res, shared)
                })
                .collect();
            (batch, generation)
        };
        let mut bufs = Vec::with_capacity(batch.len());
        let mut ops = Vec::with_capacity(batch.len());
        let mut op_of = Vec::with_capacity(batch.len());
        for (key, seq, horizon, res, shared) in &batch {
            if *shared {
                res.file.size_for_shared_writes();
            }
            let hl = header_len(key.len()) as usize;
            let Ok(mut buf) = AlignedBuf::zeroed(res.loc.len as usize) else {
                op_of.push(None);
                continue;
            };
            let value = horizon.to_le_bytes();
            buf.as_mut_slice()[hl..hl + 8].copy_from_slice(&value);
            let crc = record::data_crc(key.as_bytes(), &value);
            record::encode_header_flags(&mut buf.as_mut_slice()[..hl], key, 8, *seq, crc, record::FLAG_TOMBSTONE);
            match res.file.file() {
                Ok(f) => {
                    let (ptr, len) = (buf.as_mut_ptr(), buf.len());
                    // SAFETY: `buf` is kept in `bufs` until after the submit; `f` stays open
                    // through `res.file`.
                    ops.push(unsafe { IoOp::new(f, res.loc.offset, &[(ptr, len)], true) });
                    op_of.push(Some(ops.len() - 1));
                }
                Err(_) => op_of.push(None),
            }
            bufs.push(buf);
        }
        engine.submit(&mut ops);
        let mut state = self.state.lock();
        for ((key, seq, horizon, res, _), o) in batch.drain(..).zip(op_of) {
            state.log.finish_write(res.loc.seg);
            let ok = o.is_some_and(|i| ops[i].result.is_ok());
            if !ok {
                state.log.seal(res.loc.seg);
                tracing::warn!(key = %key, "could not log an eviction; the key may come back after a restart");
                continue;
            }
            // Not needed when a clear wiped the log or the key was put again since.
            let superseded = state.generation != generation || state.owned.get(&key).is_some_and(|o| o.loc.seq > seq);
            if superseded {
                continue;
            }
            // A record of the key older than this tombstone was published while the tombstone was
            // being written (a commit reserved before the eviction and landed after it): recovery
            // would hide it, so memory drops it too.
            if state.forget_owned(&key, self.config.page_size, self.config.clock.now()).is_some() {
                state.push_event(KvEvent::remove(key.clone(), TierType::Ssd));
            }
            let loc = Loc { seq, ..res.loc };
            state.log.add_live(&loc);
            if let Some(old) = state.tombs.insert(key, Tomb { loc, horizon }) {
                // The newer tombstone covers every segment the older one did.
                state.log.kill(&old.loc);
            }
        }
        drop(bufs);
    }

    pub(super) fn delete_segments(&self, dead: Vec<Arc<SegmentFile>>) {
        let mut dirs: Vec<&std::path::Path> = Vec::new();
        for seg in &dead {
            match fs::remove_file(&seg.path) {
                Ok(()) => {
                    bump(&self.counters.segment_reclaimed);
                    if let Some(d) = seg.path.parent()
                        && !dirs.contains(&d)
                    {
                        dirs.push(d);
                    }
                }
                // Never created (a segment whose only writes failed before opening it).
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(segment = %seg.path.display(), error = %e, "could not delete a dead segment"),
            }
        }
        // Make the removals durable: a segment that came back after a power loss could bring back
        // keys that were cleared or evicted (their tombstones may have gone with other segments).
        for d in dirs {
            if let Err(e) = sync_dir(d) {
                tracing::warn!(dir = %d.display(), error = %e, "fsync of a directory after deleting segments failed");
            }
        }
    }

    /// `fdatasync`s every segment written since the last sync (no lock held during the syncs).
    pub(super) fn sync_segments(&self) {
        // One pass at a time: a pass that finds a segment clean because another pass took it waits
        // for that pass's syncs to complete first.
        let _pass = self.sync_pass.lock();
        let files = self.state.lock().log.take_unsynced();
        for f in files {
            let Some(file) = f.if_open() else { continue };
            match file.sync_data() {
                Ok(()) => bump(&self.counters.segment_sync),
                Err(e) => {
                    bump(&self.counters.segment_sync_error);
                    tracing::warn!(segment = %f.path.display(), error = %e, "fdatasync of a segment failed");
                }
            }
        }
    }

    /// The reaper's periodic sync: runs [`sync_segments`](Self::sync_segments) once
    /// `sync_interval` has passed since the last one.
    pub(super) fn maybe_sync(&self, now: Instant) {
        let Some(interval) = self.config.sync_interval else { return };
        {
            let mut last = self.last_sync.lock();
            if last.is_some_and(|t| now < t + interval) {
                return;
            }
            *last = Some(now);
        }
        self.sync_segments();
    }

    /// Moves the live records of one sealed segment to the log head, so the segment can be
    /// deleted, if the log needs the room: `expected` is what the writers are expected to append
    /// before the next pass. Returns whether it compacted a segment (`false`: no need, nothing
    /// to compact, or another call is compacting).
    pub(super) fn compact_once(&self, expected: u64) -> bool {
        let Some(engine) = self.engine() else { return false };
        let (victims, generation) = {
            let mut state = self.state.lock();
            if state.compacting {
                return false;
            }
            // Moving live data costs drive bandwidth that puts and gets would otherwise have, so
            // dead records stay until the room is needed: compaction runs once the segment files
            // plus the writers' expected growth before the next pass would pass the capacity plus
            // one segment per directory. That keeps the files within the capacity plus the
            // headroom documented in the crate (one more segment: the one a compaction copies
            // into), as long as the estimate holds and the passes keep up. Fully dead segments
            // are deleted by the sweep regardless.
            let files = state.log.file_bytes();
            let margin = self.config.segment_bytes * self.config.dirs.len() as u64;
            if files.saturating_add(expected) <= state.total.saturating_add(margin) {
                return false;
            }
            // The most wasteful segment (most room per byte moved) if one is dead enough, else the
            // oldest (a circular log: its going also retires the tombstones whose horizon it
            // holds).
            let seg =
                state.log.compaction_candidate(self.config.reclaim_dead_ratio).or_else(|| state.log.oldest_sealed());
            let Some(seg) = seg else { return false };
            let Some(file) = state.log.segs.get(&seg).map(|s| Arc::clone(&s.file)) else { return false };
            // Live records and tombstones in force both move (a tombstone is a record too).
            // From the per-segment index: the work is the segment's records, not every key.
            let victims: Vec<(String, Loc, bool, Arc<SegmentFile>)> = state
                .owned
                .keys_in(seg)
                .map(|(k, o)| (k.clone(), o.loc, false, Arc::clone(&file)))
                .chain(state.tombs.keys_in(seg).map(|(k, t)| (k.clone(), t.loc, true, Arc::clone(&file))))
                .collect();
            if victims.is_empty() {
                return false;
            }
            state.compacting = true;
            (victims, state.generation)
        };
        // Where the index has `key`'s record (or its tombstone) now.
        let current = |state: &State, key: &str, tomb: bool| {
            if tomb { state.tombs.get(key).map(|t| t.loc) } else { state.owned.get(key).map(|o| o.loc) }
        };
        for (key, old_loc, tomb, file) in victims {
            let old = Owned { loc: old_loc, size: 0 };
            let moved = (|| -> io::Result<bool> {
                let mut buf = AlignedBuf::zeroed(old.loc.len as usize)?;
                let ptr = buf.as_mut_ptr();
                let f = file.file()?;
                // SAFETY: `buf` is ours and outlives the submit; `f` is kept open by `file`.
                let mut ops = [unsafe { IoOp::new(f, old.loc.offset, &[(ptr, old.loc.len as usize)], false) }];
                engine.submit(&mut ops);
                let [op] = ops;
                op.result?;
                // Verified before anything is sliced by the header's size (a panic here would
                // end the reaper). A bad record is not moved; a read of it will find out and drop it.
                let Some((h, _)) = record::verify_record(buf.as_slice()) else { return Ok(false) };
                if h.key != key || h.seq != old.loc.seq || h.record_len() != Some(old.loc.len) {
                    return Ok(false);
                }
                let res = {
                    let mut state = self.state.lock();
                    if state.generation != generation || current(&state, &key, tomb) != Some(old.loc) {
                        return Ok(false);
                    }
                    state.pace.compaction += old.loc.len;
                    state.log.reserve(old.loc.len)
                };
                if res.in_flight > 0 {
                    res.file.size_for_shared_writes();
                }
                let nf = res.file.file();
                let result = nf.and_then(|nf| {
                    // SAFETY: as above.
                    let mut ops = [unsafe { IoOp::new(nf, res.loc.offset, &[(ptr, old.loc.len as usize)], true) }];
                    engine.submit(&mut ops);
                    let [op] = ops;
                    op.result
                });
                let mut state = self.state.lock();
                state.log.finish_write(res.loc.seg);
                if result.is_err() {
                    return result.map(|()| false);
                }
                let still = state.generation == generation && current(&state, &key, tomb) == Some(old.loc);
                if !still {
                    return Ok(false);
                }
                // The copy keeps the record's seq: identical bytes, so recovery may find either.
                let new = Loc { seq: old.loc.seq, ..res.loc };
                state.log.kill(&old.loc);
                state.log.add_live(&new);
                if tomb {
                    state.tombs.set_loc(&key, new);
                } else {
                    state.owned.set_loc(&key, new);
                }
                Ok(true)
            })();
            match moved {
                Ok(true) => bump(&self.counters.compaction_moved),
                Ok(false) => {}
                Err(e) => tracing::warn!(key = %key, error = %e, "compaction could not move a record"),
            }
        }
        let dead = {
            let mut state = self.state.lock();
            state.compacting = false;
            state.log.take_dead_segments()
        };
        self.delete_segments(dead);
        true
    }
}
