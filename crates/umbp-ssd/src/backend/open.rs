//! Construction, statistics, the reaper threads and restart recovery of the SSD medium.

use super::*;

impl SsdBackend {
    /// A backend with `config`; nothing is allocated, opened or read until [`MediumBackend::init`].
    pub fn new(config: SsdConfig) -> Self {
        // Prefaulted: the first spill or fill into a page must not pay its page faults.
        let options = HostMemoryOptions::default();
        Self {
            inner: Arc::new(Inner {
                config,
                state: Mutex::new(State::default()),
                published: RwLock::new(None),
                engine: RwLock::new(None),
                next_slot_id: AtomicU64::new(1),
                clear_pending: AtomicBool::new(false),
                counters: Counters::default(),
                locks: Mutex::new(Vec::new()),
                last_sync: Mutex::new(None),
                sync_pass: Mutex::new(()),
            }),
            source: HostPageMemorySource::new(options),
            lifecycle: Mutex::new(Lifecycle::New),
            reaper: Mutex::new(None),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SsdConfig {
        &self.inner.config
    }

    /// Runs one reaper pass now: expired slots and leases, due deferred frees, deletion of dead
    /// segments, tombstone writes and compaction if the log needs the room.
    pub fn reaper_tick(&self) {
        self.inner.sweep();
    }

    /// `fdatasync`s every segment written since the last sync, now (the reaper does it every
    /// `sync_interval`). When it returns, every record whose commit returned before the call is on
    /// stable storage, short of a hole left by a write still in flight (see the crate docs).
    pub fn sync(&self) {
        self.inner.sync_segments();
    }

    /// Counters and gauges of the medium.
    pub fn stats(&self) -> SsdStats {
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (segments, log_bytes, live_bytes, tombstones) = {
            let s = self.inner.state.lock();
            (s.log.segs.len() as u64, s.log.physical_bytes(), s.log.live_bytes(), s.tombs.len() as u64)
        };
        SsdStats {
            device_reads: l(&c.device_read_ok) + l(&c.device_read_error) + l(&c.device_read_corrupt),
            device_writes: l(&c.device_write_ok) + l(&c.device_write_error),
            staged_hits: l(&c.staged_hit),
            single_flight_merged: l(&c.single_flight_merged),
            staging_full_rejects: l(&c.staging_full_reject),
            staging_busy_allocations: l(&c.staging_busy_allocate),
            leases_released: l(&c.lease_released),
            corrupt_reads: l(&c.device_read_corrupt),
            evicted: l(&c.eviction_victim),
            recovered: l(&c.recovery_record),
            recovery_corrupt: l(&c.recovery_corrupt),
            torn_tails: l(&c.recovery_torn_tail),
            segments_reclaimed: l(&c.segment_reclaimed),
            compaction_moved: l(&c.compaction_moved),
            segments,
            log_bytes,
            live_bytes,
            staging_pages_in_use: l(&c.staging_in_use),
            tombstones,
            segment_syncs: l(&c.segment_sync),
        }
    }

    /// Drops every unleased cached staged copy, so the next resolve of each key reads the drive.
    pub fn drop_cached_copies(&self) {
        let now = self.inner.config.clock.now();
        let mut state = self.inner.state.lock();
        let keys: Vec<String> = state.staged.iter().filter(|(_, s)| !s.leased(now)).map(|(k, _)| k.clone()).collect();
        for k in keys {
            if let Some(s) = state.staged.remove(&k) {
                state.free(&s.pages);
            }
        }
        self.inner.update_staging_gauge(&state);
    }

    pub(super) fn start_reaper(&self) -> io::Result<Reaper> {
        let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
        let inner = Arc::clone(&self.inner);
        let interval = inner.config.reaper_interval;
        let spawn = |name: &str, pass: fn(&Inner)| {
            let inner = Arc::clone(&inner);
            let stopped = stopped.clone();
            std::thread::Builder::new().name(name.into()).spawn(move || {
                loop {
                    match stopped.recv_timeout(interval) {
                        Err(RecvTimeoutError::Timeout) => pass(&inner),
                        Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                    }
                }
            })
        };
        let reaper = spawn(REAPER_THREAD, Inner::expire)?;
        let log = match spawn(LOG_THREAD, Inner::log_pass) {
            Ok(t) => t,
            Err(e) => {
                drop(stop);
                let _ = reaper.join();
                return Err(e);
            }
        };
        Ok(Reaper { stop, threads: vec![reaper, log] })
    }

    pub(super) fn stop_reaper(&self) {
        if let Some(reaper) = self.reaper.lock().take() {
            // Dropping the only sender wakes both threads (their receive sees it disconnected).
            drop(reaper.stop);
            for t in reaper.threads {
                if t.join().is_err() {
                    tracing::error!("SSD reaper or log thread panicked");
                }
            }
        }
    }

    pub(super) fn io_error(context: String, source: io::Error) -> BackendError {
        BackendError::Io { medium: NAME.into(), context, source }
    }

    /// Opens the directories, recovers (or wipes) the log and returns it with the owned keys.
    pub(super) fn open_log(&self, engine: &dyn IoEngine) -> Result<Recovered, BackendError> {
        let config = &self.inner.config;
        let n = config.dirs.len() as u64;
        let total = (config.capacity_bytes / config.page_size) * config.page_size;
        let mut log = Log { segment_bytes: config.segment_bytes, preallocate: config.preallocate, ..Log::default() };
        // (segment id, directory index) of every segment file found.
        let mut found: Vec<(SegId, usize)> = Vec::new();
        let mut locks = Vec::with_capacity(config.dirs.len());
        for (i, dir) in config.dirs.iter().enumerate() {
            fs::create_dir_all(dir).map_err(|e| Self::io_error(format!("creating {}", dir.display()), e))?;
            locks.push(lock_dir(dir)?);
            let direct = config.direct_io && probe_direct_io(dir);
            if config.direct_io && !direct {
                tracing::info!(dir = %dir.display(), "O_DIRECT refused by the filesystem; using buffered IO");
            }
            let share = total / n + if i == 0 { total % n } else { 0 };
            // The advertised capacity is a promise about the drive: say so when the filesystem
            // cannot keep it (the log's own segments already there count as room). The log may
            // take its share of the headroom beyond the capacity (crate docs, "Disk use").
            if let Some(free) = free_bytes(dir) {
                let ours = segment_bytes_in(dir);
                let need = share.saturating_add(config.disk_headroom_bytes().div_ceil(n));
                if free.saturating_add(ours) < need {
                    tracing::warn!(dir = %dir.display(), share, need, free, "the filesystem has less free space than this directory's share of the SSD capacity plus its headroom; writes may fail with ENOSPC");
                }
            }
            log.dirs.push(DirState { path: dir.clone(), direct, share, physical: 0, active: None });
            let entries = fs::read_dir(dir).map_err(|e| Self::io_error(format!("listing {}", dir.display()), e))?;
            for entry in entries {
                let entry = entry.map_err(|e| Self::io_error(format!("listing {}", dir.display()), e))?;
                if let Some(id) = entry.file_name().to_str().and_then(SegmentFile::parse_name) {
                    found.push((id, i));
                }
            }
        }
        found.sort_unstable();
        if !config.recover {
            for (id, dir) in &found {
                let path = log.dirs[*dir].path.join(SegmentFile::segment_name(*id));
                fs::remove_file(&path).map_err(|e| Self::io_error(format!("removing {}", path.display()), e))?;
            }
            found.clear();
            for d in &log.dirs {
                sync_dir(&d.path).map_err(|e| Self::io_error(format!("fsync of {}", d.path.display()), e))?;
            }
        }
        // Every record found, newest wins per key.
        let mut records: Vec<Found> = Vec::new();
        for (id, dir) in found {
            let d = &log.dirs[dir];
            let path = d.path.join(SegmentFile::segment_name(id));
            let file = crate::io::open_segment(&path, false, d.direct)
                .map_err(|e| Self::io_error(format!("opening {}", path.display()), e))?;
            let len = file.metadata().map_err(|e| Self::io_error(format!("stat {}", path.display()), e))?.len();
            let seg = Arc::new(SegmentFile::opened(id, path, d.direct, file));
            let end = self.scan_segment(engine, &seg, len, &mut records)?;
            log.dirs[dir].physical += end;
            log.segs
                .insert(id, SegMeta { file: seg, dir, append: end, live: 0, writers: 0, sealed: true, dirty: false });
            log.next_seg = log.next_seg.max(id + 1);
        }
        records.sort_by_key(|r| std::cmp::Reverse(r.loc.seq));
        log.next_seq = records.first().map_or(1, |r| r.loc.seq + 1);
        let mut owned: HashMap<String, Owned> = HashMap::default();
        let mut tombs: Vec<(String, Tomb)> = Vec::new();
        let mut seen: foldhash::HashSet<String> = foldhash::HashSet::default();
        let mut used = 0u64;
        let max_value = config.max_value_pages * config.page_size;
        for Found { key, size, loc, horizon } in records {
            // Newest first: only the newest record of a key decides, a tombstone as much as a value.
            if !seen.insert(key.clone()) {
                continue;
            }
            if let Some(horizon) = horizon {
                log.add_live(&loc);
                tombs.push((key, Tomb { loc, horizon }));
                continue;
            }
            if size > max_value || size == 0 {
                continue;
            }
            let bytes = size.div_ceil(config.page_size) * config.page_size;
            if used + bytes > total {
                // The capacity shrank since these were written: keep the newest that fit.
                continue;
            }
            used += bytes;
            log.add_live(&loc);
            owned.insert(key, Owned { loc, size });
        }
        let mut owned: Vec<(String, Owned)> = owned.into_iter().collect();
        // Oldest first, so the LRU starts in write order.
        owned.sort_by_key(|(_, o)| o.loc.seq);
        Ok(Recovered { log, owned, tombs, total, locks })
    }

    /// Reads every record of one segment, verifying both CRCs; returns where valid data ends.
    pub(super) fn scan_segment(
        &self,
        engine: &dyn IoEngine,
        seg: &Arc<SegmentFile>,
        len: u64,
        out: &mut Vec<Found>,
    ) -> Result<u64, BackendError> {
        let c = &self.inner.counters;
        let file = seg.file().map_err(|e| Self::io_error("opening a segment".into(), e))?;
        let mut offset = 0u64;
        let read = |offset: u64, len: usize| -> io::Result<AlignedBuf> {
            let mut buf = AlignedBuf::zeroed(len)?;
            let ptr = buf.as_mut_ptr();
            // SAFETY: `buf` is ours alone and outlives the submit; `file` is open.
            let mut ops = [unsafe { IoOp::new(file, offset, &[(ptr, len)], false) }];
            engine.submit(&mut ops);
            let [op] = ops;
            op.result.map(|()| buf)
        };
        // A read error ends the segment's scan as a torn tail would: what was read so far stays
        // recovered, the segment is sealed (every recovered segment is), init goes on.
        let failed = |offset: u64, e: io::Error| {
            bump(&c.recovery_torn_tail);
            tracing::warn!(segment = %seg.path.display(), offset, error = %e, "read error while scanning; dropping the rest of the segment");
        };
        while offset + record::ALIGN <= len {
            let mut block = match read(offset, record::ALIGN as usize) {
                Ok(b) => b,
                Err(e) => {
                    failed(offset, e);
                    break;
                }
            };
            let header = match record::decode_header(block.as_slice()) {
                Err(HeaderError::Short { needed }) if offset + needed as u64 <= len => match read(offset, needed) {
                    Ok(b) => {
                        block = b;
                        record::decode_header(block.as_slice())
                    }
                    Err(e) => {
                        failed(offset, e);
                        break;
                    }
                },
                other => other,
            };
            let Ok(header) = header else {
                // Zeroes past the last record, or a torn or corrupt header: nothing after it can be
                // trusted to start on a record boundary.
                if block.as_slice().iter().any(|b| *b != 0) {
                    bump(&c.recovery_torn_tail);
                    tracing::warn!(segment = %seg.path.display(), offset, "torn or corrupt record header; dropping the rest of the segment");
                }
                break;
            };
            // `value_size` comes from the drive: bounded by the segment before anything is sized
            // or sliced by it.
            let Some(rlen) = header.record_len().filter(|r| offset.checked_add(*r).is_some_and(|end| end <= len))
            else {
                bump(&c.recovery_torn_tail);
                tracing::warn!(segment = %seg.path.display(), offset, "record runs past the end of the segment (torn write); dropped");
                break;
            };
            if !header.well_formed() {
                // The header is intact (its CRC holds), so its length can be stepped over.
                bump(&c.recovery_corrupt);
                tracing::warn!(segment = %seg.path.display(), offset, key = %header.key, "malformed record (a tombstone whose value is not 8 bytes); skipped");
                offset += rlen;
                continue;
            }
            let hlen = header_len(header.key.len());
            let vlen = (rlen - hlen) as usize;
            let value = match read(offset + hlen, vlen) {
                Ok(v) => v,
                Err(e) => {
                    failed(offset, e);
                    break;
                }
            };
            // `vlen` is `value_size` rounded up, so the slice is in bounds.
            let body = &value.as_slice()[..header.value_size as usize];
            if record::data_crc(header.key.as_bytes(), body) == header.data_crc {
                bump(&c.recovery_record);
                let loc = Loc { seg: seg.id, offset, len: rlen, seq: header.seq };
                let horizon = (header.flags & record::FLAG_TOMBSTONE != 0).then(|| {
                    let mut h = [0u8; 8];
                    h.copy_from_slice(&body[..8]);
                    u64::from_le_bytes(h)
                });
                out.push(Found { key: header.key, size: header.value_size, loc, horizon });
            } else {
                bump(&c.recovery_corrupt);
                tracing::warn!(segment = %seg.path.display(), offset, key = %header.key, "record fails its CRC; skipped");
            }
            offset += rlen;
        }
        Ok(offset)
    }

    pub(super) fn register(
        &self,
        registrar: &dyn MemoryRegistrar,
        base: RawBuffer,
    ) -> Result<TransferRef, BackendError> {
        // SAFETY: `base` came from `self.source`, which keeps it mapped until `release`; the
        // registration is undone in `shutdown` (or on a failed init) before `release` is called.
        let region = unsafe { LocalRegion::new(base.base(), base.len(), MemoryLocation::Host) };
        registrar.register_memory(region).map_err(|source| BackendError::Registration {
            medium: NAME.into(),
            buffer_index: 0,
            source,
        })
    }
}
