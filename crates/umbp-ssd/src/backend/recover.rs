//! Restart recovery of the SSD medium: the directories are opened and locked, every segment is
//! scanned (both CRCs of every record verified, torn tails dropped) and the newest record of each
//! key decides whether it is owned or held down by a tombstone.

use super::*;

/// What `open_log` found.
pub(super) struct Recovered {
    pub(super) log: Log,
    /// Owned keys, oldest first.
    pub(super) owned: Vec<(String, Owned)>,
    /// Tombstones still in force.
    pub(super) tombs: Vec<(String, Tomb)>,
    /// The capacity in bytes.
    pub(super) total: u64,
    /// The directories' lock files, locked (held until `shutdown`).
    pub(super) locks: Vec<fs::File>,
}

/// The lock file in each directory: a backend holds an exclusive `flock` on it from `init` to
/// `shutdown` (or the end of the process), so two backends never share a directory.
pub(super) const LOCK_FILE: &str = ".umbp-ssd.lock";

/// Takes the directory's lock, or fails with an error that says who holds it.
pub(super) fn lock_dir(dir: &std::path::Path) -> Result<fs::File, BackendError> {
    use std::os::fd::AsRawFd;
    let path = dir.join(LOCK_FILE);
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| SsdBackend::io_error(format!("opening the lock file {}", path.display()), e))?;
    loop {
        // SAFETY: `file` is an open descriptor for the duration of the call; flock touches no memory.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            continue;
        }
        let context = if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            format!(
                "{} is in use by another SSD medium (in this or another process): its lock file {} is locked",
                dir.display(),
                path.display()
            )
        } else {
            format!("locking {}", path.display())
        };
        return Err(SsdBackend::io_error(context, e));
    }
}

/// One valid record found by a scan (`horizon`: a tombstone's; `crc32c`: the writer's checksum).
pub(super) struct Found {
    key: String,
    size: u64,
    loc: Loc,
    horizon: Option<u64>,
    crc32c: Option<u32>,
}

/// Bytes available to unprivileged users on the filesystem holding `dir` (`statvfs`).
pub(super) fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `path` is a valid NUL-terminated string and `st` is writable for one `statvfs`.
    let rc = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: `statvfs` returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Bytes the segment files already in `dir` take on the drive (allocated blocks: a segment's
/// preallocation lies past its end until written).
pub(super) fn segment_bytes_in(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().and_then(SegmentFile::parse_name).is_some())
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len().max(m.blocks().saturating_mul(512)))
        .sum()
}

impl SsdBackend {
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
            // take its share of the headroom beyond the capacity (`docs/ssd.md`, "Disk use").
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
        for Found { key, size, loc, horizon, crc32c } in records {
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
            owned.insert(key, Owned { loc, size, crc32c });
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
                let crc32c = header.value_crc;
                out.push(Found { key: header.key, size: header.value_size, loc, horizon, crc32c });
            } else {
                bump(&c.recovery_corrupt);
                tracing::warn!(segment = %seg.path.display(), offset, key = %header.key, "record fails its CRC; skipped");
            }
            offset += rlen;
        }
        Ok(offset)
    }
}
