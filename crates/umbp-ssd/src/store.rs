//! The drive log's bookkeeping: segments, the key index, placement, LRU and space accounting. Pure
//! state, no IO: the backend takes what it needs from here under its lock and does the IO outside.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Once, OnceLock};

use foldhash::HashMap;

use crate::io::open_segment;

/// A segment id: unique across every directory and never reused, so a reader holding a location
/// can never read another segment's bytes.
pub(crate) type SegId = u64;

/// The file of one segment. Opened (or created) on first use, outside the backend's lock; kept open
/// as long as anyone holds the `Arc`, so a reader finishes even if the segment is deleted meanwhile.
#[derive(Debug)]
pub(crate) struct SegmentFile {
    pub(crate) id: SegId,
    pub(crate) path: PathBuf,
    direct: bool,
    create: bool,
    /// Bytes to allocate when the file is created (0: none).
    prealloc: u64,
    file: OnceLock<Result<File, String>>,
    /// Set once the file's size was raised to `prealloc` (see [`size_for_shared_writes`](Self::size_for_shared_writes)).
    sized: Once,
}

impl SegmentFile {
    /// A segment whose file is opened on first use; created (and `prealloc` bytes allocated) when
    /// `create`.
    pub(crate) fn new(id: SegId, path: PathBuf, direct: bool, create: bool, prealloc: u64) -> Self {
        Self { id, path, direct, create, prealloc, file: OnceLock::new(), sized: Once::new() }
    }

    /// A segment file already opened (recovery).
    pub(crate) fn opened(id: SegId, path: PathBuf, direct: bool, file: File) -> Self {
        let cell = OnceLock::new();
        let _ = cell.set(Ok(file));
        Self { id, path, direct, create: false, prealloc: 0, file: cell, sized: Once::new() }
    }

    /// The open file. Never called under the backend's lock: the first call creates the file.
    pub(crate) fn file(&self) -> io::Result<&File> {
        self.file
            .get_or_init(|| {
                let file = open_segment(&self.path, self.create, self.direct).map_err(|e| e.to_string())?;
                if self.create {
                    if self.prealloc > 0 {
                        preallocate(&file, self.prealloc, &self.path, true);
                    }
                    // The new name must survive a power loss as much as the records written in it.
                    if let Some(dir) = self.path.parent() {
                        sync_dir(dir).map_err(|e| format!("fsync of the directory after creating the segment: {e}"))?;
                    }
                }
                Ok(file)
            })
            .as_ref()
            .map_err(|e| io::Error::other(format!("{}: {e}", self.path.display())))
    }

    /// Raises the file's size to the whole preallocated segment, once (no-op without
    /// preallocation). Called before a write that another write to this segment may run beside:
    /// ext4 runs an appending (size-extending) `O_DIRECT` write alone under the inode lock, so
    /// neighbouring appends would queue behind each other; inside the size they run side by side
    /// (each then converts its blocks from "allocated, unwritten" on completion, which costs a
    /// lone writer more than appending does: 10–20 % on the development VM).
    pub(crate) fn size_for_shared_writes(&self) {
        if self.prealloc == 0 {
            return;
        }
        self.sized.call_once(|| {
            if let Ok(file) = self.file() {
                preallocate(file, self.prealloc, &self.path, false);
            }
        });
    }

    /// Whether the file's size covers the whole preallocated segment (tests).
    #[cfg(test)]
    pub(crate) fn is_sized(&self) -> bool {
        self.sized.is_completed()
    }

    /// The file if it was ever opened.
    pub(crate) fn if_open(&self) -> Option<&File> {
        self.file.get().and_then(|r| r.as_ref().ok())
    }

    pub(crate) fn segment_name(id: SegId) -> String {
        format!("segment_{id:016x}.log")
    }

    pub(crate) fn parse_name(name: &str) -> Option<SegId> {
        let hex = name.strip_prefix("segment_")?.strip_suffix(".log")?;
        if hex.len() != 16 {
            return None;
        }
        u64::from_str_radix(hex, 16).ok()
    }
}

/// `fsync`s a directory, making the creation and removal of the files in it durable.
pub(crate) fn sync_dir(dir: &std::path::Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Allocates `len` bytes of `file` up front, so appends never look for free blocks, never
/// fragment the segment and never find the drive full. With `keep_size` the file's size stays
/// where it is (the blocks lie past its end until written): appends then take ext4's appending
/// path, which writes the blocks as data at once, where writes inside the size must convert them
/// from "unwritten" as each completes (a journalled extent change and a hop to a worker thread:
/// 10–20 % of a lone 1 MiB writer's throughput on the development VM). Best effort: a filesystem
/// without `fallocate` just grows the file as it is written, and one without `keep_size` support
/// gets the size at once.
fn preallocate(file: &File, len: u64, path: &std::path::Path, keep_size: bool) {
    use std::os::fd::AsRawFd;
    let Ok(len) = libc::off_t::try_from(len) else { return };
    let fallocate = |mode: libc::c_int| {
        // SAFETY: `file` is an open descriptor for the duration of the call; fallocate reads no
        // memory.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode, 0, len) };
        if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
    };
    let result = match fallocate(if keep_size { libc::FALLOC_FL_KEEP_SIZE } else { 0 }) {
        Err(e) if keep_size && e.raw_os_error() == Some(libc::EOPNOTSUPP) => fallocate(0),
        other => other,
    };
    if let Err(e) = result {
        tracing::debug!(segment = %path.display(), error = %e, "fallocate failed; the segment grows as written");
    }
}

/// The accounting of one segment.
#[derive(Debug)]
pub(crate) struct SegMeta {
    pub(crate) file: Arc<SegmentFile>,
    pub(crate) dir: usize,
    /// Bytes handed out (the next record's offset).
    pub(crate) append: u64,
    /// Bytes of records the index points at.
    pub(crate) live: u64,
    /// Writes reserved here and not yet finished.
    pub(crate) writers: u32,
    /// No more records are appended.
    pub(crate) sealed: bool,
    /// Written since its last `fdatasync`.
    pub(crate) dirty: bool,
}

/// One drive directory.
#[derive(Debug)]
pub(crate) struct DirState {
    pub(crate) path: PathBuf,
    pub(crate) direct: bool,
    /// Its share of the configured capacity.
    pub(crate) share: u64,
    /// Bytes its segments occupy (live, dead and in flight).
    pub(crate) physical: u64,
    pub(crate) active: Option<SegId>,
}

/// Where a record lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) seg: SegId,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) seq: u64,
}

/// A reserved place for a record: write it at `offset` of `file`, then call `finish_write`.
#[derive(Debug, Clone)]
pub(crate) struct Reservation {
    pub(crate) file: Arc<SegmentFile>,
    pub(crate) loc: Loc,
    /// Writes to the same segment reserved before this one and not finished yet.
    pub(crate) in_flight: u32,
}

/// The log: segments, directories and the sequence counter.
#[derive(Debug, Default)]
pub(crate) struct Log {
    pub(crate) dirs: Vec<DirState>,
    pub(crate) segs: BTreeMap<SegId, SegMeta>,
    pub(crate) next_seg: SegId,
    pub(crate) next_seq: u64,
    pub(crate) segment_bytes: u64,
    /// Allocate each new segment's whole size when it is created.
    pub(crate) preallocate: bool,
    /// Bytes ever reserved (never decreases): compaction paces itself by how fast it grows.
    pub(crate) reserved_total: u64,
}

impl Log {
    /// Reserves `len` bytes for a new record in the directory with the most free space.
    pub(crate) fn reserve(&mut self, len: u64) -> Reservation {
        let dir = self
            .dirs
            .iter()
            .enumerate()
            .max_by(|(ia, a), (ib, b)| {
                let fa = a.share.saturating_sub(a.physical);
                let fb = b.share.saturating_sub(b.physical);
                // Most free space; ties go to the lower index.
                fa.cmp(&fb).then(ib.cmp(ia))
            })
            .map_or(0, |(i, _)| i);
        let seq = self.next_seq;
        self.next_seq += 1;
        let active = self.dirs[dir]
            .active
            .filter(|id| self.segs.get(id).is_some_and(|s| !s.sealed && s.append + len <= self.segment_bytes));
        let id = match active {
            Some(id) => id,
            None => {
                if let Some(old) = self.dirs[dir].active.take()
                    && let Some(s) = self.segs.get_mut(&old)
                {
                    s.sealed = true;
                }
                let id = self.next_seg;
                self.next_seg += 1;
                let d = &self.dirs[dir];
                let prealloc = if self.preallocate { self.segment_bytes } else { 0 };
                let path = d.path.join(SegmentFile::segment_name(id));
                let file = Arc::new(SegmentFile::new(id, path, d.direct, true, prealloc));
                self.segs
                    .insert(id, SegMeta { file, dir, append: 0, live: 0, writers: 0, sealed: false, dirty: false });
                self.dirs[dir].active = Some(id);
                id
            }
        };
        let seg = self.segs.get_mut(&id).expect("the segment was just found or inserted");
        let offset = seg.append;
        let in_flight = seg.writers;
        seg.append += len;
        seg.writers += 1;
        self.dirs[dir].physical += len;
        self.reserved_total += len;
        Reservation { file: Arc::clone(&seg.file), loc: Loc { seg: id, offset, len, seq }, in_flight }
    }

    /// A reserved write finished (whether it landed or not).
    pub(crate) fn finish_write(&mut self, seg: SegId) {
        if let Some(s) = self.segs.get_mut(&seg) {
            s.writers = s.writers.saturating_sub(1);
            s.dirty = true;
        }
    }

    /// The files of every segment written since the last call, for an `fdatasync` outside the
    /// lock (they are marked clean now: a write that finishes after this marks its segment again).
    pub(crate) fn take_unsynced(&mut self) -> Vec<Arc<SegmentFile>> {
        self.segs
            .values_mut()
            .filter(|s| s.dirty)
            .map(|s| {
                s.dirty = false;
                Arc::clone(&s.file)
            })
            .collect()
    }

    /// Seals segment `seg` (after a failed write: a scan stops at the hole it left, so nothing
    /// more is appended behind it).
    pub(crate) fn seal(&mut self, seg: SegId) {
        if let Some(s) = self.segs.get_mut(&seg) {
            s.sealed = true;
            if let Some(d) = self.dirs.get_mut(s.dir)
                && d.active == Some(seg)
            {
                d.active = None;
            }
        }
    }

    /// The record at `loc` is now the index's.
    pub(crate) fn add_live(&mut self, loc: &Loc) {
        if let Some(s) = self.segs.get_mut(&loc.seg) {
            s.live += loc.len;
        }
    }

    /// The record at `loc` is no longer the index's.
    pub(crate) fn kill(&mut self, loc: &Loc) {
        if let Some(s) = self.segs.get_mut(&loc.seg) {
            s.live = s.live.saturating_sub(loc.len);
        }
    }

    /// Seals every active segment (after a clear: nothing live is left in them).
    pub(crate) fn seal_all(&mut self) {
        for d in &mut self.dirs {
            if let Some(id) = d.active.take()
                && let Some(s) = self.segs.get_mut(&id)
            {
                s.sealed = true;
            }
        }
    }

    /// Removes every sealed segment with no live record and no write in flight, returning their
    /// files for deletion outside the lock.
    pub(crate) fn take_dead_segments(&mut self) -> Vec<Arc<SegmentFile>> {
        let dead: Vec<SegId> =
            self.segs.iter().filter(|(_, s)| s.sealed && s.writers == 0 && s.live == 0).map(|(id, _)| *id).collect();
        dead.into_iter()
            .filter_map(|id| self.segs.remove(&id))
            .map(|s| {
                if let Some(d) = self.dirs.get_mut(s.dir) {
                    d.physical = d.physical.saturating_sub(s.append);
                }
                s.file
            })
            .collect()
    }

    /// The sealed, quiet segment with the largest dead fraction at or above `ratio`, if any.
    pub(crate) fn compaction_candidate(&self, ratio: f64) -> Option<SegId> {
        self.segs
            .iter()
            .filter(|(_, s)| s.sealed && s.writers == 0 && s.live > 0 && s.append > 0)
            .map(|(id, s)| (*id, (s.append - s.live.min(s.append)) as f64 / s.append as f64))
            .filter(|(_, dead)| *dead >= ratio)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(id, _)| id)
    }

    /// The oldest sealed, quiet segment: compacting it retires the tombstones whose horizon it
    /// holds once it is gone, and moves the log forward as a circular log.
    pub(crate) fn oldest_sealed(&self) -> Option<SegId> {
        self.segs.iter().find(|(_, s)| s.sealed && s.writers == 0 && s.live > 0 && s.append > 0).map(|(id, _)| *id)
    }

    /// Bytes all segments occupy.
    pub(crate) fn physical_bytes(&self) -> u64 {
        self.segs.values().map(|s| s.append).sum()
    }

    /// Bytes the segment files take on the drive: each a whole segment when preallocated, else
    /// what was appended.
    pub(crate) fn file_bytes(&self) -> u64 {
        if self.preallocate {
            self.segs.values().map(|s| s.append.max(self.segment_bytes)).sum()
        } else {
            self.physical_bytes()
        }
    }

    /// Bytes of live records.
    pub(crate) fn live_bytes(&self) -> u64 {
        self.segs.values().map(|s| s.live).sum()
    }
}

/// Least-recently-used order of owned keys: a tick per key, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Lru {
    by_tick: BTreeMap<u64, String>,
    tick_of: HashMap<String, u64>,
    next: u64,
}

impl Lru {
    pub(crate) fn touch(&mut self, key: &str) {
        let tick = self.next;
        self.next += 1;
        if let Some(old) = self.tick_of.get_mut(key) {
            self.by_tick.remove(old);
            *old = tick;
        } else {
            self.tick_of.insert(key.to_owned(), tick);
        }
        self.by_tick.insert(tick, key.to_owned());
    }

    pub(crate) fn remove(&mut self, key: &str) {
        if let Some(t) = self.tick_of.remove(key) {
            self.by_tick.remove(&t);
        }
    }

    /// Keys, least recently used first.
    #[cfg(test)]
    pub(crate) fn oldest_first(&self) -> impl Iterator<Item = &String> {
        self.by_tick.values()
    }

    /// The least recently used key touched after `after` (from the cold end when `None`), with its
    /// tick: a walk from the cold end that costs `O(log n)` a step and copies nothing else.
    pub(crate) fn next_oldest(&self, after: Option<u64>) -> Option<(u64, &String)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let lower = after.map_or(Unbounded, Excluded);
        self.by_tick.range((lower, Unbounded)).next().map(|(t, k)| (*t, k))
    }

    pub(crate) fn clear(&mut self) {
        self.by_tick.clear();
        self.tick_of.clear();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.tick_of.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn log(dirs: usize, share: u64, segment_bytes: u64) -> Log {
        Log {
            dirs: (0..dirs)
                .map(|i| DirState {
                    path: PathBuf::from(format!("/d{i}")),
                    direct: false,
                    share,
                    physical: 0,
                    active: None,
                })
                .collect(),
            segment_bytes,
            ..Log::default()
        }
    }

    #[test]
    fn segment_names_round_trip() {
        assert_eq!(SegmentFile::parse_name(&SegmentFile::segment_name(0xabc)), Some(0xabc));
        assert_eq!(SegmentFile::parse_name("segment_1.log"), None);
        assert_eq!(SegmentFile::parse_name("other"), None);
    }

    #[test]
    fn placement_prefers_the_emptiest_directory() {
        let mut l = log(2, 1 << 20, 1 << 16);
        let a = l.reserve(8192);
        let b = l.reserve(4096);
        let c = l.reserve(4096);
        let dir_of = |r: &Reservation| l.segs[&r.loc.seg].dir;
        assert_eq!((dir_of(&a), dir_of(&b), dir_of(&c)), (0, 1, 1));
    }

    #[test]
    fn lru_orders_by_last_touch() {
        let mut lru = Lru::default();
        for k in ["a", "b", "c"] {
            lru.touch(k);
        }
        lru.touch("a");
        lru.remove("b");
        assert_eq!(lru.oldest_first().cloned().collect::<Vec<_>>(), ["c", "a"]);
        assert_eq!(lru.len(), 2);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Reserve(u64),
        Land(usize),
        Fail(usize),
        Kill(usize),
        Reclaim,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..=8).prop_map(|n| Op::Reserve(n * 4096)),
            any::<usize>().prop_map(Op::Land),
            any::<usize>().prop_map(Op::Fail),
            any::<usize>().prop_map(Op::Kill),
            Just(Op::Reclaim),
        ]
    }

    proptest! {
        /// Against a model of reservations: no two records ever overlap, a segment holding a live
        /// record or a write in flight is never reclaimed, and live/physical totals add up.
        #[test]
        fn reservations_never_overlap_and_live_data_is_never_reclaimed(ops in prop::collection::vec(op(), 1..200)) {
            let mut l = log(3, 1 << 20, 64 * 1024);
            let mut inflight: Vec<Loc> = Vec::new();
            let mut live: Vec<Loc> = Vec::new();
            let mut all: Vec<Loc> = Vec::new();
            for op in ops {
                match op {
                    Op::Reserve(n) => {
                        let r = l.reserve(n);
                        prop_assert!(r.loc.offset + n <= l.segment_bytes);
                        for o in &all {
                            prop_assert!(o.seg != r.loc.seg || o.offset + o.len <= r.loc.offset || r.loc.offset + n <= o.offset);
                        }
                        all.push(r.loc);
                        inflight.push(r.loc);
                    }
                    Op::Land(i) if !inflight.is_empty() => {
                        let loc = inflight.remove(i % inflight.len());
                        l.finish_write(loc.seg);
                        l.add_live(&loc);
                        live.push(loc);
                    }
                    Op::Fail(i) if !inflight.is_empty() => {
                        let loc = inflight.remove(i % inflight.len());
                        l.finish_write(loc.seg);
                    }
                    Op::Kill(i) if !live.is_empty() => {
                        let loc = live.remove(i % live.len());
                        l.kill(&loc);
                    }
                    Op::Reclaim => {
                        for f in l.take_dead_segments() {
                            prop_assert!(!live.iter().chain(&inflight).any(|x| x.seg == f.id), "reclaimed a busy segment");
                            all.retain(|x| x.seg != f.id);
                        }
                    }
                    _ => {}
                }
                prop_assert_eq!(l.live_bytes(), live.iter().map(|x| x.len).sum::<u64>());
                let physical: u64 = l.dirs.iter().map(|d| d.physical).sum();
                prop_assert_eq!(physical, l.physical_bytes());
                for loc in live.iter().chain(&inflight) {
                    prop_assert!(l.segs.contains_key(&loc.seg));
                }
            }
        }
    }
}
