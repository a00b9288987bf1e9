//! `SsdBackend`: the slot lifecycle of a staged medium.
//!
//! ```text
//! allocate ─► PENDING (staging pages) ─commit: spill─► OWNED (record on the drive)
//!                                                        │  staging pages ─► cached clean copy, or free
//! resolve of an OWNED key: cached copy? ─yes─► lease it  │
//!                          └─no─► take staging pages, read the drive (single flight), verify CRC, lease
//! evict / LRU eviction: OWNED ─► dead record (space reclaimed by the reaper) + REMOVE
//!                                 + a tombstone record (written by the reaper) for restarts
//! ```
//!
//! Every call works in three phases when it touches the drive: take what it needs under the lock,
//! do the IO with no lock held, and come back under the lock to publish the outcome (re-checking the
//! clear generation and the key's record, which may have changed meanwhile).

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{RecvTimeoutError, Sender};
use foldhash::{HashMap, HashSet};
use parking_lot::{Condvar, Mutex, RwLock};
use umbp_core::{
    AllocateOutcome, AllocateRequest, AllocateResult, AutoFlushHook, BackendError, BufferDesc, CommitRequest,
    CommitResult, EventOutbox, EvictResult, KvEvent, LocalRegion, MediumBackend, MemoryLocation, MemoryRegistrar,
    MetricSample, MetricSource, PageLocation, ResolvedEntry, TierCapacity, TierType, TransferRef, metric_names,
};
use umbp_page::{HostMemoryOptions, HostPageMemorySource, PageBitmapAllocator, PageMemorySource, RawBuffer};

use crate::config::SsdConfig;
use crate::io::{AlignedBuf, IoEngine, IoOp, make_engine, probe_direct_io};
use crate::record::{self, HeaderError, MAX_KEY_LEN, header_len, record_len};
use crate::staged::{Deferred, LeaseIds, Staged, StagedMap};
use crate::store::{DirState, Loc, Log, Lru, SegId, SegMeta, SegmentFile, sync_dir};

mod io_jobs;
mod medium;
mod open;
mod reclaim;
mod resolve;
#[cfg(test)]
mod tests;

/// The longest a follower waits for the leader of a single-flight read (the reference's 30 s); the
/// wait is also capped at half the read lease (see [`follower_wait`]).
const FOLLOWER_WAIT: Duration = Duration::from_secs(30);
/// How many times a resolve of one key follows someone else's read before it gives up (busy:
/// the reader asks again later).
const FOLLOW_ROUNDS: usize = 3;
/// The reaper thread's name (expiry only).
const REAPER_THREAD: &str = "umbp-reaper-SSD";
/// The log thread's name (tombstones, compaction, segment deletion, sync).
const LOG_THREAD: &str = "umbp-log-SSD";
/// The name this medium reports.
const NAME: &str = "SsdBackend";
/// With an engine that overlaps IO and work (io_uring), a batch of at least this many value bytes
/// is checksummed while it moves: a write hands the values to the drive first and its headers
/// (which carry the CRC) right after; a read arrives in chunks of [`READ_CHUNK`] and each chunk is
/// checked as it lands. Smaller batches are not worth the extra requests.
const OVERLAP_MIN: u64 = 256 * 1024;
/// The chunk of an overlapped read.
const READ_CHUNK: usize = 256 * 1024;

#[derive(Debug)]
struct Pending {
    pages: Vec<PageLocation>,
    size: u64,
    deadline: Instant,
    generation: u64,
}

/// A tombstone on the drive: in force while a segment that may hold an older record of its key
/// (any segment up to `horizon` but its own) still exists.
#[derive(Debug, Clone, Copy)]
struct Tomb {
    loc: Loc,
    horizon: u64,
}

#[derive(Debug, Clone, Copy)]
struct Owned {
    loc: Loc,
    size: u64,
}

impl Owned {
    /// Drive bytes of the record beyond the page-rounded value (header block, padding).
    fn overhead(&self, page_size: u64) -> u64 {
        self.loc.len.saturating_sub(self.size.div_ceil(page_size) * page_size)
    }
}

/// A value that names where its record lies on the drive.
trait Located {
    fn loc(&self) -> Loc;
    fn set_loc(&mut self, loc: Loc);
    /// A tombstone's horizon (indexed, so retiring tombstones looks at few of them).
    fn horizon(&self) -> Option<u64> {
        None
    }
}

impl Located for Owned {
    fn loc(&self) -> Loc {
        self.loc
    }
    fn set_loc(&mut self, loc: Loc) {
        self.loc = loc;
    }
}

impl Located for Tomb {
    fn loc(&self) -> Loc {
        self.loc
    }
    fn set_loc(&mut self, loc: Loc) {
        self.loc = loc;
    }
    fn horizon(&self) -> Option<u64> {
        Some(self.horizon)
    }
}

/// Records by key with an index by segment, so compaction finds a segment's records in time
/// proportional to their number, not to every key's. Reads go through `Deref` to the map; every
/// change goes through the methods below, which keep the index in step.
#[derive(Debug)]
struct KeyIndex<V> {
    map: HashMap<String, V>,
    by_seg: HashMap<SegId, HashSet<String>>,
    /// `(horizon, key)` of the values that have one (tombstones).
    by_horizon: BTreeSet<(u64, String)>,
}

impl<V> Default for KeyIndex<V> {
    fn default() -> Self {
        Self { map: HashMap::default(), by_seg: HashMap::default(), by_horizon: BTreeSet::new() }
    }
}

impl<V> std::ops::Deref for KeyIndex<V> {
    type Target = HashMap<String, V>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<V: Located> KeyIndex<V> {
    fn unindex(&mut self, key: &str, seg: SegId) {
        if let Some(set) = self.by_seg.get_mut(&seg) {
            set.remove(key);
            if set.is_empty() {
                self.by_seg.remove(&seg);
            }
        }
    }

    fn insert(&mut self, key: String, value: V) -> Option<V> {
        let old = self.remove(&key);
        self.by_seg.entry(value.loc().seg).or_default().insert(key.clone());
        if let Some(h) = value.horizon() {
            self.by_horizon.insert((h, key.clone()));
        }
        self.map.insert(key, value);
        old
    }

    fn remove(&mut self, key: &str) -> Option<V> {
        let v = self.map.remove(key)?;
        self.unindex(key, v.loc().seg);
        if let Some(h) = v.horizon() {
            self.by_horizon.remove(&(h, key.to_owned()));
        }
        Some(v)
    }

    /// Moves `key`'s record to `loc` (a compaction's copy).
    fn set_loc(&mut self, key: &str, loc: Loc) {
        let Some(v) = self.map.get_mut(key) else { return };
        let old = v.loc().seg;
        v.set_loc(loc);
        if old != loc.seg {
            self.unindex(key, old);
            self.by_seg.entry(loc.seg).or_default().insert(key.to_owned());
        }
    }

    fn clear(&mut self) {
        self.map.clear();
        self.by_seg.clear();
        self.by_horizon.clear();
    }

    /// The keys with a horizon below `bound` (every key with one when `None`), smallest first.
    fn horizons_below(&self, bound: Option<u64>) -> impl Iterator<Item = (u64, &String)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let upper = bound.map_or(Unbounded, |b| Excluded((b, String::new())));
        self.by_horizon.range((Unbounded, upper)).map(|(h, k)| (*h, k))
    }

    /// Panics unless the segment index names exactly each key's record segment.
    #[cfg(test)]
    fn check(&self) {
        let indexed: usize = self.by_seg.values().map(|s| s.len()).sum();
        assert_eq!(indexed, self.map.len(), "every key is indexed once");
        assert_eq!(self.by_horizon.len(), self.map.values().filter(|v| v.horizon().is_some()).count());
        for (k, v) in &self.map {
            assert!(self.by_seg.get(&v.loc().seg).is_some_and(|s| s.contains(k)), "{k} indexed under its segment");
        }
    }

    /// The keys whose record lies in `seg`.
    fn keys_in(&self, seg: SegId) -> impl Iterator<Item = (&String, &V)> {
        self.by_seg.get(&seg).into_iter().flatten().filter_map(|k| self.map.get_key_value(k))
    }
}

/// One drive read of a key that concurrent resolves of the key wait on.
#[derive(Debug, Default)]
struct Flight {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Flight {
    fn finish(&self) {
        *self.done.lock() = true;
        self.cv.notify_all();
    }

    fn wait(&self, timeout: Duration) -> bool {
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

/// How fast the writers grow the log, measured once per log pass: compaction runs only when the
/// space left would not take what they are expected to write before the next pass.
#[derive(Debug, Default)]
struct Pace {
    /// Bytes reserved by writers (commits, tombstones) up to the last pass.
    seen: u64,
    /// Bytes compaction reserved for its own copies: not demand (counting them would let
    /// compaction feed on itself).
    compaction: u64,
    /// The growth expected before the next pass: the last pass's, or half the previous estimate
    /// if that is more, so a burst is remembered for a few passes.
    expected: u64,
}

impl Pace {
    /// Takes the log's reserved total at a pass; returns the growth expected before the next one.
    fn observe(&mut self, reserved_total: u64) -> u64 {
        let demand = reserved_total.saturating_sub(self.compaction);
        let grown = demand.saturating_sub(self.seen);
        self.seen = demand;
        self.expected = grown.max(self.expected / 2);
        self.expected
    }
}

/// The most segments one log pass compacts, whatever the writers' pace: a bound on how long the
/// pass's sync waits behind compaction.
const MAX_COMPACTIONS_PER_PASS: u64 = 16;

/// Everything behind the backend's one lock.
#[derive(Default)]
struct State {
    /// `None` until `init` and after `shutdown`.
    staging: Option<PageBitmapAllocator>,
    pending: HashMap<u64, Pending>,
    owned: KeyIndex<Owned>,
    lru: Lru,
    staged: StagedMap,
    /// Staging pages of keys dropped while a reader held them: freed at lease end, or when the
    /// lease's last reader releases it.
    deferred: Vec<Deferred>,
    lease_ids: LeaseIds,
    flights: HashMap<String, Arc<Flight>>,
    /// Drive reads in progress per key (protects the key from eviction).
    reading: HashMap<String, u32>,
    /// Commits whose record is being written, per key: a commit of the same key from another
    /// batch waits for it (so one key never has two records in flight, whose seqs could disagree
    /// with which one lands first).
    writing: HashMap<String, Arc<Flight>>,
    log: Log,
    /// Drive bytes reserved by pending slots, commits in flight and owned keys (page-rounded).
    used: u64,
    /// What the owned keys' records take on the drive beyond their page-rounded values in `used`
    /// (header blocks, 4 KiB padding): `used + overhead` is what the after-commit eviction
    /// watches, so live records on the drive stay within the capacity, not only their values.
    overhead: u64,
    total: u64,
    /// Bytes of commits between their lock phases.
    committing: u64,
    compacting: bool,
    pace: Pace,
    /// Evictions not yet logged on the drive: key, the tombstone's seq, its horizon.
    tomb_pending: Vec<(String, u64, u64)>,
    /// Tombstones on the drive still in force, by key.
    tombs: KeyIndex<Tomb>,
    generation: u64,
    outbox: EventOutbox,
}

impl State {
    fn free(&mut self, pages: &[PageLocation]) {
        if let Some(a) = self.staging.as_mut() {
            a.deallocate(pages);
        }
    }

    fn push_event(&mut self, event: KvEvent) {
        self.outbox.push(event);
    }

    /// `n` staging pages, dropping least recently used unleased cached copies to make room.
    fn take_staging(&mut self, n: u64, now: Instant) -> Option<Vec<PageLocation>> {
        loop {
            if let Some(pages) = self.staging.as_mut()?.allocate(n) {
                return Some(pages);
            }
            // From the cold end of the use order: leased copies are stepped over, the rest is not
            // looked at.
            let victim = self.staged.coldest_unleased(now)?.clone();
            if let Some(s) = self.staged.remove(&victim) {
                self.free(&s.pages);
            }
        }
    }

    /// Whether `key` may be evicted now: owned, no live lease on its staged copy, no drive read.
    fn evictable(&self, key: &str, now: Instant) -> bool {
        self.owned.contains_key(key)
            && !self.staged.get(key).is_some_and(|s| s.leased(now))
            && !self.reading.contains_key(key)
    }

    /// Drops `key` from the index (its record becomes dead space), frees its staged copy and queues
    /// a tombstone, so a restart does not bring the key back. A staged copy under a live lease is
    /// not freed but deferred to its lease's end (a reader may still be copying out of it), as
    /// `clear_local` does.
    fn drop_owned(&mut self, key: &str, page_size: u64, now: Instant) -> Option<Owned> {
        let owned = self.forget_owned(key, page_size, now)?;
        // The seq is taken now: a later put of the key gets a larger one and wins over it.
        let seq = self.log.next_seq;
        self.log.next_seq += 1;
        let horizon = self.log.next_seg.saturating_sub(1);
        self.tomb_pending.push((key.to_owned(), seq, horizon));
        Some(owned)
    }

    /// Drops `key` from the index, LRU and staged copies (its record becomes dead space) without
    /// logging anything: for a record that a newer record or tombstone of the key on the drive
    /// already outranks at recovery. The caller queues any event.
    fn forget_owned(&mut self, key: &str, page_size: u64, now: Instant) -> Option<Owned> {
        let owned = self.owned.remove(key)?;
        self.overhead = self.overhead.saturating_sub(owned.overhead(page_size));
        self.lru.remove(key);
        self.used = self.used.saturating_sub(owned.size.div_ceil(page_size) * page_size);
        self.log.kill(&owned.loc);
        if let Some(s) = self.staged.remove(key) {
            match Deferred::of(key, s, now) {
                Ok(d) => self.deferred.push(d),
                Err(pages) => self.free(&pages),
            }
        }
        Some(owned)
    }
}

/// What `init` published: immutable until `shutdown`.
#[derive(Debug)]
struct Published {
    registrar: Arc<dyn MemoryRegistrar>,
    registered: TransferRef,
    r#ref: TransferRef,
    desc: BufferDesc,
    /// The arena's base address and length.
    base: RawBuffer,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lifecycle {
    New,
    Live,
    ShutDown,
}

/// Medium-internal counters, sampled without the lock.
#[derive(Debug, Default)]
struct Counters {
    device_read_ok: AtomicU64,
    device_read_error: AtomicU64,
    device_read_corrupt: AtomicU64,
    device_write_ok: AtomicU64,
    device_write_error: AtomicU64,
    device_read_bytes: AtomicU64,
    device_write_bytes: AtomicU64,
    staged_hit: AtomicU64,
    single_flight_lead: AtomicU64,
    single_flight_merged: AtomicU64,
    staging_full_reject: AtomicU64,
    staging_busy_allocate: AtomicU64,
    lease_released: AtomicU64,
    staging_expired_reclaim: AtomicU64,
    eviction_round: AtomicU64,
    eviction_victim: AtomicU64,
    segment_reclaimed: AtomicU64,
    compaction_moved: AtomicU64,
    recovery_record: AtomicU64,
    recovery_corrupt: AtomicU64,
    recovery_torn_tail: AtomicU64,
    segment_sync: AtomicU64,
    segment_sync_error: AtomicU64,
    staging_in_use: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct Inner {
    config: SsdConfig,
    state: Mutex<State>,
    published: RwLock<Option<Arc<Published>>>,
    engine: RwLock<Option<Arc<dyn IoEngine>>>,
    next_slot_id: AtomicU64,
    clear_pending: AtomicBool,
    counters: Counters,
    /// The directories' locked lock files (see [`lock_dir`]), from `init` to `shutdown`.
    locks: Mutex<Vec<fs::File>>,
    /// When the reaper last synced the segments (`None`: never).
    last_sync: Mutex<Option<Instant>>,
    /// Held through a sync pass (never with `state`'s lock held across a sync).
    sync_pass: Mutex<()>,
}

/// A read or write between its lock phases.
struct Job {
    index: usize,
    key: String,
    pages: Vec<PageLocation>,
    size: u64,
    file: Arc<SegmentFile>,
    loc: Loc,
    header: AlignedBuf,
    generation: u64,
    flight: Option<Arc<Flight>>,
    outcome: JobOutcome,
    /// Another caller's write to the same segment was in flight when this one was reserved.
    shared: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobOutcome {
    Ok,
    IoError,
    Corrupt,
}

/// The background threads: the reaper (slot and lease expiry, no drive IO) and the log thread
/// (segment deletion, tombstone writes, compaction, periodic sync), so a slow drive never delays
/// expiry.
struct Reaper {
    stop: Sender<()>,
    threads: Vec<JoinHandle<()>>,
}

/// The SSD medium: a registered host staging arena over an append-only drive log (see the crate
/// docs for what it owns and the choices it makes).
pub struct SsdBackend {
    inner: Arc<Inner>,
    source: HostPageMemorySource,
    lifecycle: Mutex<Lifecycle>,
    reaper: Mutex<Option<Reaper>>,
}

impl fmt::Debug for SsdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SsdBackend")
            .field("config", &self.inner.config)
            .field("lifecycle", &*self.lifecycle.lock())
            .finish_non_exhaustive()
    }
}

/// Medium-internal facts for tests and operators, read without IO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SsdStats {
    /// Drive reads issued for resolves (excluding recovery and compaction).
    pub device_reads: u64,
    /// Drive writes issued for commits.
    pub device_writes: u64,
    /// Resolves served from a cached staged copy without a drive read.
    pub staged_hits: u64,
    /// Resolves that waited for another resolve's read of the same key.
    pub single_flight_merged: u64,
    /// Resolves that found the key but no free staging page (answered busy: retry here).
    pub staging_full_rejects: u64,
    /// Allocations the drive had room for but no staging page was free for (answered
    /// [`AllocateOutcome::Busy`]: the writer retries here once pages come back).
    pub staging_busy_allocations: u64,
    /// Read leases on staged copies that ended because their last reader released them (before
    /// their expiry).
    pub leases_released: u64,
    /// Records whose CRC failed on a read (dropped, answered as a miss).
    pub corrupt_reads: u64,
    /// Keys evicted by the medium's own LRU.
    pub evicted: u64,
    /// Records recovered from the log at `init`.
    pub recovered: u64,
    /// Records skipped at recovery because their CRC failed.
    pub recovery_corrupt: u64,
    /// Segments whose tail was torn (scan stopped early) at recovery.
    pub torn_tails: u64,
    /// Segment files deleted because nothing live was left in them.
    pub segments_reclaimed: u64,
    /// Records moved by compaction.
    pub compaction_moved: u64,
    /// Segment files currently on the drives.
    pub segments: u64,
    /// Bytes the segment files occupy.
    pub log_bytes: u64,
    /// Bytes of live records.
    pub live_bytes: u64,
    /// Staging pages in use (pending, cached or leased).
    pub staging_pages_in_use: u64,
    /// Tombstones in force on the drives (evicted keys a restart must not bring back).
    pub tombstones: u64,
    /// Segment `fdatasync`s done by the periodic sync (and [`SsdBackend::sync`]).
    pub segment_syncs: u64,
}

/// What `open_log` found.
struct Recovered {
    log: Log,
    /// Owned keys, oldest first.
    owned: Vec<(String, Owned)>,
    /// Tombstones still in force.
    tombs: Vec<(String, Tomb)>,
    /// The capacity in bytes.
    total: u64,
    /// The directories' lock files, locked (held until `shutdown`).
    locks: Vec<fs::File>,
}

/// The lock file in each directory: a backend holds an exclusive `flock` on it from `init` to
/// `shutdown` (or the end of the process), so two backends never share a directory.
const LOCK_FILE: &str = ".umbp-ssd.lock";

/// Takes the directory's lock, or fails with an error that says who holds it.
fn lock_dir(dir: &std::path::Path) -> Result<fs::File, BackendError> {
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

/// One valid record found by a scan (`horizon`: a tombstone's).
struct Found {
    key: String,
    size: u64,
    loc: Loc,
    horizon: Option<u64>,
}

impl Inner {
    fn bytes_of(&self, size: u64) -> u64 {
        size.div_ceil(self.config.page_size) * self.config.page_size
    }

    fn engine(&self) -> Option<Arc<dyn IoEngine>> {
        self.engine.read().clone()
    }

    fn update_staging_gauge(&self, state: &State) {
        let in_use = state.staging.as_ref().map_or(0, |a| a.total_pages() - a.free_pages());
        self.counters.staging_in_use.store(in_use, Ordering::Relaxed);
    }

    /// The `(address, length)` IO segments of a value of `size` bytes in `pages`, each page's
    /// length rounded up to the record alignment.
    fn page_segments(&self, published: &Published, pages: &[PageLocation], size: u64) -> Vec<(*mut u8, usize)> {
        let ps = self.config.page_size;
        let mut remaining = record::align_up(size);
        let mut out = Vec::with_capacity(pages.len());
        for p in pages {
            if remaining == 0 {
                break;
            }
            let len = remaining.min(ps);
            remaining -= len;
            // SAFETY: `page_index < staging pages` (the allocator only hands out pages of the arena),
            // so the offset stays inside the mapped arena.
            let ptr = unsafe { published.base.base().as_ptr().add((u64::from(p.page_index) * ps) as usize) };
            out.push((ptr, len as usize));
        }
        out
    }

    /// Zeroes the bytes between the end of a value of `size` bytes in `pages` and the next record
    /// boundary: they go to the drive with the value, and would otherwise carry whatever an earlier
    /// value left in the staging page.
    fn zero_padding(&self, published: &Published, pages: &[PageLocation], size: u64) {
        let ps = self.config.page_size;
        let pad = record::align_up(size) - size;
        if pad == 0 || size == 0 {
            return;
        }
        // The padding lies in the page holding the value's last byte: pages are multiples of the
        // record alignment, so rounding up never crosses into the next page.
        let last = (size - 1) / ps;
        let Some(page) = pages.get(last as usize) else { return };
        let at = size - last * ps;
        // SAFETY: the page lies inside the arena (see `page_segments`) and `at + pad <= ps`; it
        // belongs to the committing slot, whose writer is done with it, and nothing else writes it.
        unsafe {
            std::ptr::write_bytes(
                published.base.base().as_ptr().add((u64::from(page.page_index) * ps + at) as usize),
                0,
                pad as usize,
            );
        }
    }

    /// CRC-32C of `key` and the value bytes in staging `pages`.
    fn crc_of(&self, published: &Published, key: &str, pages: &[PageLocation], size: u64) -> u32 {
        let ps = self.config.page_size;
        let mut crc = crc32c::crc32c(key.as_bytes());
        let mut remaining = size;
        for p in pages {
            if remaining == 0 {
                break;
            }
            let len = remaining.min(ps);
            remaining -= len;
            // SAFETY: the page lies inside the arena (see `page_segments`); it is held by this call's
            // slot or fill, which no one else writes while the call runs (a writer finished before
            // its commit; a fill target is not published yet).
            let bytes = unsafe {
                std::slice::from_raw_parts(
                    published.base.base().as_ptr().add((u64::from(p.page_index) * ps) as usize),
                    len as usize,
                )
            };
            crc = crc32c::crc32c_append(crc, bytes);
        }
        crc
    }

    fn entry(&self, published: Option<&Published>, pages: Vec<PageLocation>, size: u64, lease: u64) -> ResolvedEntry {
        ResolvedEntry {
            found: true,
            pages,
            size,
            page_size: self.config.page_size,
            descs: published.map(|p| vec![p.desc.clone()]).unwrap_or_default(),
            lease,
            ..ResolvedEntry::default()
        }
    }

    /// Evicts least recently used keys until `used <= target` (metadata only: no IO), never one in
    /// `spare`.
    fn evict_down_to(&self, state: &mut State, target: u64, now: Instant, spare: &[String]) {
        self.evict_while(state, |s| s.used > target, now, spare);
    }

    /// Evicts least recently used keys (sparing `spare` and keys in use) while `over` holds.
    fn evict_while(&self, state: &mut State, over: impl Fn(&State) -> bool, now: Instant, spare: &[String]) {
        if !over(state) {
            return;
        }
        bump(&self.counters.eviction_round);
        let ps = self.config.page_size;
        // Walks the LRU from the cold end one key at a time (no copy of it): the work is the keys
        // looked at (victims and the in-use keys stepped over), not the keys owned.
        // A set, so stepping over a key costs O(1) however large the batch that was just written.
        let spare: HashSet<&str> = spare.iter().map(String::as_str).collect();
        let mut cursor = None;
        while over(state) {
            let Some((tick, key)) = state.lru.next_oldest(cursor).map(|(t, k)| (t, k.clone())) else { break };
            cursor = Some(tick);
            if !state.evictable(&key, now) || spare.contains(key.as_str()) {
                continue;
            }
            if state.drop_owned(&key, ps, now).is_some() {
                bump(&self.counters.eviction_victim);
                state.push_event(KvEvent::remove(key, TierType::Ssd));
            }
        }
    }

    /// The check after a write: at the high watermark, evict down to the low one (sparing the keys
    /// just written, which would otherwise be the only candidates when the rest is leased).
    ///
    /// What is watched is the drive footprint of the values (`used`) plus their records' overhead
    /// (header blocks, padding): live records on the drive, not only values, stay within capacity.
    fn after_commit_watermark(&self, state: &mut State, now: Instant, written: &[String]) {
        if let Some(w) = self.config.watermarks
            && (state.used + state.overhead) as f64 >= w.high * state.total as f64
        {
            let low = (w.low * state.total as f64) as u64;
            self.evict_while(state, |s| s.used + s.overhead > low, now, written);
        }
    }

    /// One reaper pass: expiry, then the log's work, in order (the background threads run the two
    /// halves on their own threads).
    fn sweep(&self) {
        self.expire();
        self.log_pass();
    }

    /// Slot and lease expiry: metadata only, no drive IO, so it keeps its interval whatever the
    /// drive does.
    fn expire(&self) {
        let now = self.config.clock.now();
        {
            let mut state = self.state.lock();
            if state.staging.is_none() {
                return;
            }
            let expired: Vec<u64> =
                state.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(id, _)| *id).collect();
            for id in expired {
                if let Some(p) = state.pending.remove(&id) {
                    state.free(&p.pages);
                    state.used = state.used.saturating_sub(self.bytes_of(p.size));
                    bump(&self.counters.staging_expired_reclaim);
                }
            }
            for s in state.staged.values_mut() {
                s.expire(now);
            }
            let mut due = Vec::new();
            state.deferred.retain_mut(|d| {
                if d.until <= now {
                    due.push(std::mem::take(&mut d.pages));
                    false
                } else {
                    true
                }
            });
            for pages in due {
                state.free(&pages);
            }
            self.update_staging_gauge(&state);
        }
    }

    /// The log's background work: deletes dead segments, writes queued tombstones, compacts one
    /// segment and syncs when due. All of it drive IO, off the reaper's thread.
    fn log_pass(&self) {
        let now = self.config.clock.now();
        let (dead, expected) = {
            let mut state = self.state.lock();
            if state.staging.is_none() {
                return;
            }
            retire_tombstones(&mut state);
            let reserved = state.log.reserved_total;
            (state.log.take_dead_segments(), state.pace.observe(reserved))
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

    /// The last step of a resolve: every hit is checked again under the lock, just before the
    /// entries go to the reader. A hit's lease was taken when its round ran; the resolve may since
    /// have waited on other keys' reads and done drive IO, long enough for that lease to lapse and
    /// its pages to be handed to an allocation or another fill. A hit whose key's cached copy still
    /// holds exactly the pages in the entry gets its lease renewed from now; any other hit becomes a
    /// miss.
    fn revalidate(&self, keys: &[String], mut entries: Vec<ResolvedEntry>) -> Vec<ResolvedEntry> {
        if !entries.iter().any(|e| e.found) {
            return entries;
        }
        let now = self.config.clock.now();
        let until = now + self.config.read_lease_ttl;
        let mut guard = self.state.lock();
        let state = &mut *guard;
        for (key, entry) in keys.iter().zip(entries.iter_mut()) {
            if !entry.found {
                continue;
            }
            match state.staged.get_mut(key) {
                Some(s) if s.pages == entry.pages && s.size == entry.size => {
                    if s.holds(entry.lease, now) {
                        s.extend(until);
                    } else {
                        // The hit's lease ended while the batch waited (lapsed, or its other
                        // readers released it): the copy is still intact, so hold it afresh.
                        entry.lease = s.hold(now, until, &mut state.lease_ids);
                    }
                }
                // The copy went (its pages were needed), but the key may still be here.
                _ if state.owned.contains_key(key) => *entry = ResolvedEntry::busy(),
                _ => *entry = ResolvedEntry::miss(),
            }
        }
        entries
    }

    /// One reader of each hit is done: see [`MediumBackend::release_reads`].
    fn release(&self, reads: &[umbp_core::ReadRelease]) {
        let now = self.config.clock.now();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        let mut freed = false;
        for r in reads {
            if let Some(s) = state.staged.get_mut(&r.key)
                && s.release(r.lease, now)
            {
                bump(&self.counters.lease_released);
                continue;
            }
            // A key dropped while this reader copied: its pages wait for the last reader.
            if let Some(at) = state.deferred.iter_mut().position(|d| d.release(&r.key, r.lease, now)) {
                let d = state.deferred.swap_remove(at);
                state.free(&d.pages);
                freed = true;
            }
        }
        if freed {
            self.update_staging_gauge(state);
        }
    }
}

/// Whether a write reserved as `res` may run beside another caller's write to its segment: the
/// segment had more writes in flight than the ones this caller reserved there before (`own`, per
/// segment, which this counts `res` into).
fn shared_with_others(res: &crate::store::Reservation, own: &mut Vec<(SegId, u32)>) -> bool {
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

/// The most iovecs one write op carries (the kernel's `UIO_MAXIOV` is 1024; io_uring refuses more
/// in one request).
const MAX_WRITE_IOVECS: usize = 1024;

/// Splits records `(segment, offset, length, iovecs)`, in reservation order, into runs that can go
/// out as one write: each record starts where the one before it ends, in the same segment, and a
/// run carries at most `max_iovecs` iovecs (a record alone may carry more: it is one op anyway).
fn adjacent_runs(records: &[(SegId, u64, u64, usize)], max_iovecs: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    let mut iovecs = 0;
    for (i, &(seg, offset, _, n)) in records.iter().enumerate() {
        let extends = runs.last().is_some_and(|run| {
            let (pseg, poff, plen, _) = records[run.end - 1];
            pseg == seg && poff + plen == offset && iovecs + n <= max_iovecs
        });
        match runs.last_mut() {
            Some(run) if extends => {
                run.end = i + 1;
                iovecs += n;
            }
            _ => {
                runs.push(i..i + 1);
                iovecs = n;
            }
        }
    }
    runs
}

/// How long a follower waits for a single-flight leader: at most [`FOLLOWER_WAIT`] and at most half
/// the read lease, so a resolve that follows never holds its other hits' leases for long (they are
/// re-validated and renewed before it returns anyway).
fn follower_wait(lease: Duration) -> Duration {
    FOLLOWER_WAIT.min(lease / 2)
}

/// Bytes available to unprivileged users on the filesystem holding `dir` (`statvfs`).
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
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
fn segment_bytes_in(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().and_then(SegmentFile::parse_name).is_some())
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len().max(m.blocks().saturating_mul(512)))
        .sum()
}

/// Refuses a configuration whose worst case needs more open files than the process may have
/// ([`SsdConfig::max_open_files`]): better a clear error at `init` than `EMFILE` on some later
/// segment, which would fail commits one by one.
fn check_open_file_limit(config: &SsdConfig) -> Result<(), BackendError> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid `rlimit` for the call to fill; nothing else is read or written.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return Ok(());
    }
    let need = config.max_open_files();
    if need > limit.rlim_cur {
        return Err(BackendError::InvalidConfig(format!(
            "{NAME}: up to {need} open files at worst (a segment file per {} bytes of capacity_bytes {} plus headroom, \
             a lock per directory, the io_uring rings), more than the process's open-file limit {} (hard limit {}): \
             raise `ulimit -n` or segment_bytes",
            config.segment_bytes, config.capacity_bytes, limit.rlim_cur, limit.rlim_max
        )));
    }
    Ok(())
}

/// Takes out of force every tombstone no older record of its key can be hiding behind: no segment
/// up to its horizon is left but its own.
fn retire_tombstones(state: &mut State) {
    // A tombstone is in force while a segment up to its horizon other than its own exists. With
    // `oldest` and `second` the two smallest segment ids, that holds for every horizon >= `second`;
    // below it, it holds exactly when the horizon reaches `oldest` and the tombstone lies elsewhere.
    // So only tombstones with a horizon below `second` are looked at (through the horizon index),
    // not every tombstone each pass.
    let mut ids = state.log.segs.keys().copied();
    let (oldest, second) = match ids.next() {
        Some(o) => (Some(o), ids.next()),
        None => (None, None),
    };
    let tombs = &state.tombs;
    let retired: Vec<String> = tombs
        .horizons_below(second)
        .filter(|(h, k)| oldest.is_none_or(|o| *h < o || tombs.get(*k).is_some_and(|t| Some(t.loc.seg) == oldest)))
        .map(|(_, k)| k.clone())
        .collect();
    for key in retired {
        if let Some(t) = state.tombs.remove(&key) {
            state.log.kill(&t.loc);
        }
    }
}

/// Splits `(address, length)` segments into groups of at most `chunk` bytes each (a segment
/// larger than `chunk` is cut; `chunk` and every length are multiples of the record alignment).
fn split_segments(segs: &[(*mut u8, usize)], chunk: usize) -> Vec<Vec<(*mut u8, usize)>> {
    let mut out: Vec<Vec<(*mut u8, usize)>> = Vec::new();
    let mut current = Vec::new();
    let mut room = chunk;
    for &(ptr, len) in segs {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(room);
            // SAFETY: `at + n <= len`, so the address stays inside the segment.
            current.push((unsafe { ptr.add(at) }, n));
            at += n;
            room -= n;
            if room == 0 {
                out.push(std::mem::take(&mut current));
                room = chunk;
            }
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

impl MetricSource for SsdBackend {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let c = &self.inner.counters;
        let mut out = Vec::new();
        let events: [(&str, &AtomicU64); 21] = [
            ("device_read_ok", &c.device_read_ok),
            ("device_read_error", &c.device_read_error),
            ("device_read_corrupt", &c.device_read_corrupt),
            ("device_write_ok", &c.device_write_ok),
            ("device_write_error", &c.device_write_error),
            ("staged_copy_hit", &c.staged_hit),
            ("single_flight_lead", &c.single_flight_lead),
            ("single_flight_merged", &c.single_flight_merged),
            ("staging_slot_full_reject", &c.staging_full_reject),
            ("staging_allocate_busy", &c.staging_busy_allocate),
            ("read_lease_released", &c.lease_released),
            ("staging_expired_reclaim", &c.staging_expired_reclaim),
            ("eviction_round", &c.eviction_round),
            ("eviction_victim", &c.eviction_victim),
            ("segment_reclaimed", &c.segment_reclaimed),
            ("compaction_moved", &c.compaction_moved),
            ("recovery_record", &c.recovery_record),
            ("recovery_corrupt", &c.recovery_corrupt),
            ("recovery_torn_tail", &c.recovery_torn_tail),
            ("segment_sync", &c.segment_sync),
            ("segment_sync_error", &c.segment_sync_error),
        ];
        for (event, v) in events {
            let v = v.load(Ordering::Relaxed);
            if v > 0 {
                out.push(MetricSample::counter(
                    metric_names::MEDIUM_EVENTS_TOTAL,
                    metric_names::MEDIUM_EVENTS_TOTAL_HELP,
                    vec![("event".into(), event.into())],
                    v,
                ));
            }
        }
        for (event, v) in [("device_read", &c.device_read_bytes), ("device_write", &c.device_write_bytes)] {
            let v = v.load(Ordering::Relaxed);
            if v > 0 {
                out.push(MetricSample::counter(
                    metric_names::MEDIUM_BYTES_TOTAL,
                    metric_names::MEDIUM_BYTES_TOTAL_HELP,
                    vec![("event".into(), event.into())],
                    v,
                ));
            }
        }
        let gauge = |state: &str, value: u64| {
            MetricSample::gauge(
                metric_names::MEDIUM_STATE,
                metric_names::MEDIUM_STATE_HELP,
                vec![("state".into(), state.into())],
                value,
            )
        };
        out.push(gauge("staging_pages_in_use", c.staging_in_use.load(Ordering::Relaxed)));
        out.push(gauge("staging_pages_total", self.inner.config.staging_pages));
        // Sampled outside every lock but this short one (the publisher never holds a backend lock).
        let (segments, log_bytes, live_bytes) = {
            let s = self.inner.state.lock();
            (s.log.segs.len() as u64, s.log.physical_bytes(), s.log.live_bytes())
        };
        out.push(gauge("log_segments", segments));
        out.push(gauge("log_bytes", log_bytes));
        out.push(gauge("log_live_bytes", live_bytes));
        out
    }
}

impl Drop for SsdBackend {
    fn drop(&mut self) {
        // An owner that forgot `shutdown` still gets the ordering right: deregister, then release.
        self.shutdown();
    }
}
