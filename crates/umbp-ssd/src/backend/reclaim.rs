//! Reclaiming drive space: the log thread's pass (dead segments deleted, tombstones written,
//! compaction paced by the writers, sync when due) and compaction itself, which moves a sealed
//! segment's live records to the log head so the segment can go.

use super::*;

/// The most segments one log pass compacts, whatever the writers' pace: a bound on how long the
/// pass's sync waits behind compaction.
const MAX_COMPACTIONS_PER_PASS: u64 = 16;

/// How fast the writers grow the log, measured once per log pass: compaction runs only when the
/// space left would not take what they are expected to write before the next pass.
#[derive(Debug, Default)]
pub(super) struct Pace {
    /// Bytes reserved by writers (commits, tombstones) up to the last pass.
    seen: u64,
    /// Bytes compaction reserved for its own copies: not demand (counting them would let
    /// compaction feed on itself).
    pub(super) compaction: u64,
    /// The growth expected before the next pass: the last pass's, or half the previous estimate
    /// if that is more, so a burst is remembered for a few passes.
    expected: u64,
}

impl Pace {
    /// Takes the log's reserved total at a pass; returns the growth expected before the next one.
    pub(super) fn observe(&mut self, reserved_total: u64) -> u64 {
        let demand = reserved_total.saturating_sub(self.compaction);
        let grown = demand.saturating_sub(self.seen);
        self.seen = demand;
        self.expected = grown.max(self.expected / 2);
        self.expected
    }
}

impl Inner {
    /// The log's background work: deletes dead segments, writes queued tombstones, compacts one
    /// segment and syncs when due. All of it drive IO, off the reaper's thread.
    pub(super) fn log_pass(&self) {
        let now = self.config.clock.now();
        let (dead, expected) = {
            let mut state = self.state.lock();
            if !state.is_live() {
                return;
            }
            state.retire_tombstones();
            let expected = state.observe_pace();
            (state.log_mut().take_dead_segments(), expected)
        };
        self.delete_segments(dead);
        self.flush_tombstones();
        // The log grows a whole (preallocated) segment at a time.
        let seg = self.config.segment_bytes;
        let expected = expected.div_ceil(seg).saturating_mul(seg);
        // Compacting a segment at least half dead (the default `reclaim_dead_ratio`) frees at least
        // half a segment, so twice the expected growth in segments keeps up with the writers.
        for _ in 0..(2 + 2 * (expected / seg)).min(MAX_COMPACTIONS_PER_PASS) {
            if !self.compact_once(expected) {
                break;
            }
        }
        self.maybe_sync(now);
    }

    /// Deletes dead segments' files and makes the removals durable.
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

    /// Moves the live records of one sealed segment to the log head, so the segment can be
    /// deleted, if the log needs the room: `expected` is what the writers are expected to append
    /// before the next pass. Returns whether it compacted a segment (`false`: no need, nothing
    /// to compact, or another call is compacting).
    pub(super) fn compact_once(&self, expected: u64) -> bool {
        let Some(engine) = self.engine() else { return false };
        let (victims, file, generation) = {
            let mut state = self.state.lock();
            if state.compacting() {
                return false;
            }
            // Moving live data costs drive bandwidth that puts and gets would otherwise have, so
            // dead records stay until the room is needed: compaction runs once the segment files
            // plus the writers' expected growth before the next pass would pass the capacity plus
            // one segment per directory. That keeps the files within the capacity plus the
            // headroom documented in `docs/ssd.md` (one more segment: the one a compaction copies
            // into), as long as the estimate holds and the passes keep up. Fully dead segments
            // are deleted by the sweep regardless.
            let files = state.log().file_bytes();
            let margin = self.config.segment_bytes * self.config.dirs.len() as u64;
            if files.saturating_add(expected) <= state.total().saturating_add(margin) {
                return false;
            }
            // The most wasteful segment (most room per byte moved) if one is dead enough, else the
            // oldest (a circular log: its going also retires the tombstones whose horizon it
            // holds).
            let log = state.log();
            let seg = log.compaction_candidate(self.config.reclaim_dead_ratio).or_else(|| log.oldest_sealed());
            let Some(seg) = seg else { return false };
            let Some(file) = log.segs.get(&seg).map(|s| Arc::clone(&s.file)) else { return false };
            // Live records and tombstones in force both move (a tombstone is a record too).
            // From the per-segment index: the work is the segment's records, not every key.
            let Some(victims) = state.start_compaction(seg) else { return false };
            (victims, file, state.generation())
        };
        for (key, old_loc, tomb) in victims {
            let moved = (|| -> io::Result<bool> {
                let mut buf = AlignedBuf::zeroed(old_loc.len as usize)?;
                let ptr = buf.as_mut_ptr();
                let f = file.file()?;
                // SAFETY: `buf` is ours and outlives the submit; `f` is kept open by `file`.
                let mut ops = [unsafe { IoOp::new(f, old_loc.offset, &[(ptr, old_loc.len as usize)], false) }];
                engine.submit(&mut ops);
                let [op] = ops;
                op.result?;
                // Verified before anything is sliced by the header's size (a panic here would
                // end the reaper). A bad record is not moved; a read of it will find out and drop it.
                let Some((h, _)) = record::verify_record(buf.as_slice()) else { return Ok(false) };
                if h.key != key || h.seq != old_loc.seq || h.record_len() != Some(old_loc.len) {
                    return Ok(false);
                }
                let res = {
                    let mut state = self.state.lock();
                    if state.generation() != generation || state.record_loc(&key, tomb) != Some(old_loc) {
                        return Ok(false);
                    }
                    state.reserve_copy(old_loc.len)
                };
                if res.in_flight > 0 {
                    res.file.size_for_shared_writes();
                }
                let nf = res.file.file();
                let result = nf.and_then(|nf| {
                    // SAFETY: as above.
                    let mut ops = [unsafe { IoOp::new(nf, res.loc.offset, &[(ptr, old_loc.len as usize)], true) }];
                    engine.submit(&mut ops);
                    let [op] = ops;
                    op.result
                });
                let mut state = self.state.lock();
                state.log_mut().finish_write(res.loc.seg);
                if result.is_err() {
                    return result.map(|()| false);
                }
                let still = state.generation() == generation && state.record_loc(&key, tomb) == Some(old_loc);
                if !still {
                    return Ok(false);
                }
                // The copy keeps the record's seq: identical bytes, so recovery may find either.
                let new = Loc { seq: old_loc.seq, ..res.loc };
                state.move_record(&key, tomb, old_loc, new);
                Ok(true)
            })();
            match moved {
                Ok(true) => bump(&self.counters.compaction_moved),
                Ok(false) => {}
                Err(e) => tracing::warn!(key = %key, error = %e, "compaction could not move a record"),
            }
        }
        let dead = { self.state.lock().end_compaction() };
        self.delete_segments(dead);
        true
    }
}
