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

    fn start_reaper(&self) -> io::Result<Reaper> {
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

    fn stop_reaper(&self) {
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

    fn io_error(context: String, source: io::Error) -> BackendError {
        BackendError::Io { medium: NAME.into(), context, source }
    }

    /// Opens the directories, recovers (or wipes) the log and returns it with the owned keys.
    fn open_log(&self, engine: &dyn IoEngine) -> Result<Recovered, BackendError> {
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
    fn scan_segment(
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

    fn register(&self, registrar: &dyn MemoryRegistrar, base: RawBuffer) -> Result<TransferRef, BackendError> {
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

    /// Writes the queued tombstones (one small record each, in one engine batch) and puts them in
    /// force. A tombstone lost to a failed write or a crash only lets its key come back after a
    /// restart, with bytes that still pass their CRC.
    fn flush_tombstones(&self) {
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

    fn delete_segments(&self, dead: Vec<Arc<SegmentFile>>) {
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
    fn sync_segments(&self) {
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
    fn maybe_sync(&self, now: Instant) {
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
    fn compact_once(&self, expected: u64) -> bool {
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

    /// Reads the records of `jobs` into their staging pages and verifies them (no lock held).
    fn read_jobs(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        if engine.overlaps() && jobs.iter().map(|j| j.size).sum::<u64>() >= OVERLAP_MIN {
            self.read_jobs_overlapped(engine, published, jobs);
            return;
        }
        let mut ops = Vec::with_capacity(jobs.len());
        let mut opened = Vec::with_capacity(jobs.len());
        for job in jobs.iter_mut() {
            match job.file.file() {
                Ok(f) => {
                    let mut segs = vec![(job.header.as_mut_ptr(), job.header.len())];
                    segs.extend(self.page_segments(published, &job.pages, job.size));
                    // SAFETY: the header buffer is the job's; the staging pages are held by this
                    // fill and not yet published, so nothing else reads or writes them; `f` is kept
                    // open by `job.file` until after the submit.
                    ops.push(unsafe { IoOp::new(f, job.loc.offset, &segs, false) });
                    opened.push(true);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a segment to read");
                    opened.push(false);
                }
            }
        }
        engine.submit(&mut ops);
        let mut results = ops.into_iter();
        for (job, was_opened) in jobs.iter_mut().zip(opened) {
            let ok = was_opened && results.next().is_some_and(|op| op.result.is_ok());
            let crc = if ok { Some(self.crc_of(published, &job.key, &job.pages, job.size)) } else { None };
            self.judge_read(job, crc);
        }
    }

    /// Sets a read job's outcome from its header and the CRC of what landed (`None`: the IO
    /// failed) and counts it.
    fn judge_read(&self, job: &mut Job, crc: Option<u32>) {
        {
            job.outcome = match crc {
                None => JobOutcome::IoError,
                Some(crc) => match record::decode_header(job.header.as_slice()) {
                    Ok(h)
                        if h.key == job.key
                            && h.value_size == job.size
                            && h.seq == job.loc.seq
                            && crc == h.data_crc =>
                    {
                        JobOutcome::Ok
                    }
                    _ => JobOutcome::Corrupt,
                },
            };
            let c = &self.counters;
            match job.outcome {
                JobOutcome::Ok => {
                    bump(&c.device_read_ok);
                    c.device_read_bytes.fetch_add(job.loc.len, Ordering::Relaxed);
                }
                JobOutcome::IoError => bump(&c.device_read_error),
                JobOutcome::Corrupt => {
                    bump(&c.device_read_corrupt);
                    tracing::error!(key = %job.key, segment = %job.file.path.display(), offset = job.loc.offset, "SSD record fails its CRC check; dropping the key");
                }
            }
        }
    }

    /// `read_jobs` for an engine that overlaps: each record is read as its header plus value
    /// chunks, and the CRC runs over every chunk as soon as it and the ones before it have landed.
    fn read_jobs_overlapped(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        /// One op of one job: the header, or value chunk `chunk` with the value bytes it holds.
        struct Part {
            job: usize,
            chunk: Option<usize>,
        }
        /// Per job: running CRC, the next chunk to fold in, which chunks landed, whether all is well.
        struct Progress {
            crc: u32,
            next: usize,
            landed: Vec<bool>,
            /// `(address, value bytes)` of each chunk (padding excluded).
            value: Vec<Vec<(*const u8, usize)>>,
            ok: bool,
        }
        let mut ops = Vec::new();
        let mut parts = Vec::new();
        let mut progress = Vec::with_capacity(jobs.len());
        for (j, job) in jobs.iter_mut().enumerate() {
            let mut p = Progress {
                crc: crc32c::crc32c(job.key.as_bytes()),
                next: 0,
                landed: Vec::new(),
                value: Vec::new(),
                ok: true,
            };
            let f = match job.file.file() {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a segment to read");
                    p.ok = false;
                    progress.push(p);
                    continue;
                }
            };
            // SAFETY: the header buffer is the job's and untouched until the submit returns.
            ops.push(unsafe { IoOp::new(f, job.loc.offset, &[(job.header.as_mut_ptr(), job.header.len())], false) });
            parts.push(Part { job: j, chunk: None });
            let mut offset = job.loc.offset + job.header.len() as u64;
            let mut value_left = job.size as usize;
            for chunk in split_segments(&self.page_segments(published, &job.pages, job.size), READ_CHUNK) {
                let len: usize = chunk.iter().map(|(_, l)| *l).sum();
                // SAFETY: the staging pages are held by this fill and not yet published, so nothing
                // else reads or writes them; `f` stays open through `job.file`.
                ops.push(unsafe { IoOp::new(f, offset, &chunk, false) });
                parts.push(Part { job: j, chunk: Some(p.landed.len()) });
                let mut value = Vec::with_capacity(chunk.len());
                for (ptr, l) in chunk {
                    let n = l.min(value_left);
                    value_left -= n;
                    if n > 0 {
                        value.push((ptr.cast_const(), n));
                    }
                }
                p.value.push(value);
                p.landed.push(false);
                offset += len as u64;
            }
            progress.push(p);
        }
        {
            let mut on_complete = |i: usize| {
                let Part { job, chunk } = parts[i];
                let Some(c) = chunk else { return };
                let p = &mut progress[job];
                p.landed[c] = true;
                // Fold in every chunk that is now contiguous with what was folded before.
                while p.next < p.landed.len() && p.landed[p.next] {
                    for (ptr, n) in &p.value[p.next] {
                        // SAFETY: the chunk's read completed into staging pages held by this fill
                        // (see above); `n` bytes of value lie there.
                        let bytes = unsafe { std::slice::from_raw_parts(*ptr, *n) };
                        p.crc = crc32c::crc32c_append(p.crc, bytes);
                    }
                    p.next += 1;
                }
            };
            engine.submit_ordered(&mut ops, &mut on_complete);
        }
        for (i, op) in ops.iter().enumerate() {
            if op.result.is_err() {
                progress[parts[i].job].ok = false;
            }
        }
        for (job, p) in jobs.iter_mut().zip(progress) {
            let whole = p.ok && p.next == p.landed.len();
            self.judge_read(job, whole.then_some(p.crc));
        }
    }

    /// `write_jobs` for an engine that overlaps: the values go to the drive first; while they
    /// move, the CRCs are computed and the headers encoded, and the headers follow in the same
    /// ring. A record whose header did not land is no record: a scan stops at its header block.
    fn write_jobs_overlapped(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        let mut values = Vec::with_capacity(jobs.len());
        let mut headers = Vec::with_capacity(jobs.len());
        let mut which = Vec::with_capacity(jobs.len());
        for (j, job) in jobs.iter_mut().enumerate() {
            match job.file.file() {
                Ok(f) => {
                    let segs = self.page_segments(published, &job.pages, job.size);
                    // SAFETY: the staging pages belong to the committing slot (its writer is done;
                    // the checksum only reads them); the header buffer is filled by the checksum
                    // step before its op is handed to the kernel (`submit_split`'s contract) and
                    // not touched after; `f` stays open through `job.file`.
                    values.push(unsafe { IoOp::new(f, job.loc.offset + job.header.len() as u64, &segs, true) });
                    // SAFETY: as above.
                    headers.push(unsafe {
                        IoOp::new(f, job.loc.offset, &[(job.header.as_mut_ptr(), job.header.len())], true)
                    });
                    which.push(j);
                }
                Err(e) => tracing::warn!(error = %e, "cannot open a segment to write"),
            }
        }
        let split = values.len();
        values.extend(headers);
        let mut ops = values;
        {
            let mut checksum = || {
                for &j in &which {
                    let job = &mut jobs[j];
                    let crc = self.crc_of(published, &job.key, &job.pages, job.size);
                    record::encode_header(job.header.as_mut_slice(), &job.key, job.size, job.loc.seq, crc);
                }
            };
            engine.submit_split(&mut ops, split, &mut checksum);
        }
        let mut results: Vec<Option<io::Result<()>>> = Vec::with_capacity(jobs.len());
        results.resize_with(jobs.len(), || None);
        for (k, &j) in which.iter().enumerate() {
            let value = std::mem::replace(&mut ops[k].result, Ok(()));
            let header = std::mem::replace(&mut ops[split + k].result, Ok(()));
            results[j] = Some(value.and(header));
        }
        for (job, result) in jobs.iter_mut().zip(results) {
            self.count_write(job, result);
        }
    }

    /// Sets a write job's outcome (`None`: it never reached the drive) and counts it.
    fn count_write(&self, job: &mut Job, result: Option<io::Result<()>>) {
        job.outcome = match result {
            Some(Ok(())) => {
                bump(&self.counters.device_write_ok);
                self.counters.device_write_bytes.fetch_add(job.loc.len, Ordering::Relaxed);
                JobOutcome::Ok
            }
            Some(Err(e)) => {
                bump(&self.counters.device_write_error);
                tracing::warn!(key = %job.key, segment = %job.file.path.display(), error = %e, "SSD write failed");
                JobOutcome::IoError
            }
            None => {
                bump(&self.counters.device_write_error);
                JobOutcome::IoError
            }
        };
    }

    /// Checksums the values of `jobs` and encodes their headers.
    fn encode_headers(&self, published: &Published, jobs: &mut [Job]) {
        for job in jobs {
            let crc = self.crc_of(published, &job.key, &job.pages, job.size);
            record::encode_header(job.header.as_mut_slice(), &job.key, job.size, job.loc.seq, crc);
        }
    }

    /// One write op per run of records reserved side by side in `jobs` (see [`adjacent_runs`]),
    /// appended to `ops`, with the jobs each op carries (`None`: the segment would not open).
    ///
    /// # Safety
    /// As [`IoOp::new`]: the jobs' headers and staging pages must stay valid and untouched by
    /// anyone else (but the caller filling the headers before the op is submitted) until the
    /// submit returns.
    unsafe fn push_write_ops(
        &self,
        published: &Published,
        jobs: &mut [Job],
        ops: &mut Vec<IoOp>,
        carried: &mut Vec<(std::ops::Range<usize>, Option<usize>)>,
    ) {
        let shape: Vec<(SegId, u64, u64, usize)> =
            jobs.iter().map(|j| (j.loc.seg, j.loc.offset, j.loc.len, 1 + j.pages.len())).collect();
        for run in adjacent_runs(&shape, MAX_WRITE_IOVECS) {
            let mut segs = Vec::new();
            for job in &mut jobs[run.clone()] {
                segs.push((job.header.as_mut_ptr(), job.header.len()));
                segs.extend(self.page_segments(published, &job.pages, job.size));
            }
            let first = &jobs[run.start];
            let op = match first.file.file() {
                Ok(f) => {
                    // SAFETY: the caller's contract; `f` stays open through the jobs' `file`.
                    ops.push(unsafe { IoOp::new(f, first.loc.offset, &segs, true) });
                    Some(ops.len() - 1)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a segment to write");
                    None
                }
            };
            carried.push((run, op));
        }
    }

    /// Writes the records of `jobs` from their staging pages (no lock held).
    ///
    /// With an engine that overlaps, large values go out as concurrent writes from registered
    /// buffers (see [`write_jobs_overlapped`](Self::write_jobs_overlapped)), so their segments
    /// are sized first: appends would queue behind each other. (A record written as one
    /// header-and-value request instead pins every staging page per request and checksums before
    /// writing: io_uring single 1 MiB puts measured 0.67 of raw that way, 0.76 this way.)
    /// Otherwise the records are checksummed, then those reserved side by side go out as one
    /// write each run (one system call; a lone appender pays ext4's per-write costs once per
    /// run).
    fn write_jobs(&self, engine: &dyn IoEngine, published: &Published, jobs: &mut [Job]) {
        for job in jobs.iter() {
            self.zero_padding(published, &job.pages, job.size);
        }
        let total: u64 = jobs.iter().map(|j| j.size).sum();
        if engine.overlaps() && total >= OVERLAP_MIN {
            for job in jobs.iter() {
                job.file.size_for_shared_writes();
            }
            self.write_jobs_overlapped(engine, published, jobs);
            return;
        }
        for job in jobs.iter() {
            if job.shared {
                job.file.size_for_shared_writes();
            }
        }
        self.encode_headers(published, jobs);
        let mut ops = Vec::new();
        let mut carried = Vec::new();
        // SAFETY: the headers are the jobs' own buffers, encoded above and not touched until the
        // submit returns; the staging pages belong to the committing slots (their writers are
        // done).
        unsafe { self.push_write_ops(published, jobs, &mut ops, &mut carried) };
        engine.submit(&mut ops);
        for (run, op) in carried {
            for job in &mut jobs[run] {
                let result = op.map(|i| match &ops[i].result {
                    Ok(()) => Ok(()),
                    Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                });
                self.count_write(job, result);
            }
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

/// What phase 1 of a resolve decided for one key.
enum Plan {
    Done(ResolvedEntry),
    Lead,
    Follow(Arc<Flight>),
}

impl SsdBackend {
    /// Resolves `keys` (one round: hits, misses and reads led here; keys being read by someone else
    /// come back as `Follow`).
    fn resolve_round(&self, keys: &[String], include_descs: bool) -> Vec<Plan> {
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

impl Drop for SsdBackend {
    fn drop(&mut self) {
        // An owner that forgot `shutdown` still gets the ordering right: deregister, then release.
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_core::{Clock, ManualClock};
    use umbp_testkit::LocalOnlyRegistrar;

    const PAGE: u64 = 4096;

    fn backend(dir: &std::path::Path, clock: &Arc<ManualClock>, staging_pages: u64) -> SsdBackend {
        let config = SsdConfig::builder([dir])
            .page_size(PAGE)
            .capacity_bytes(64 * PAGE)
            .staging_pages(staging_pages)
            .segment_bytes(256 * 1024)
            // Leases run on the manual clock; a long one makes the follower wait (half of it, in
            // real time) far longer than any test step.
            .read_lease_ttl(Duration::from_secs(60))
            .clock(Arc::clone(clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b
    }

    fn page_ptr(b: &SsdBackend, page: &PageLocation) -> *mut u8 {
        let r = b.buffer_ref(0).expect("arena");
        let base = r.local_region().expect("local").ptr().as_ptr();
        // SAFETY: the page index comes from the backend, so the offset lies inside the arena.
        unsafe { base.add((u64::from(page.page_index) * PAGE) as usize) }
    }

    fn put(b: &SsdBackend, key: &str, fill: u8, len: usize) {
        let a = b.batch_allocate(&[AllocateRequest::new(key, len as u64)]).remove(0);
        assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {key}");
        // SAFETY: the page is the slot's, inside the arena, and `len` fits one page.
        unsafe { std::ptr::write_bytes(page_ptr(b, &a.pages[0]), fill, len) };
        assert!(b.batch_commit(&[CommitRequest::new(a.slot_id, key)])[0].success, "commit {key}");
    }

    fn read(b: &SsdBackend, e: &ResolvedEntry) -> Vec<u8> {
        // SAFETY: the entry's page lies inside the arena and is leased to this reader.
        unsafe { std::slice::from_raw_parts(page_ptr(b, &e.pages[0]), e.size as usize) }.to_vec()
    }

    /// A hit resolved early in a batch whose resolve then waits on another key's read: by the time
    /// the batch returns, the hit's first lease has lapsed and its page went to an allocation. The
    /// entry must not point at that page (a miss, or a renewed lease on the same copy).
    #[test]
    fn a_hit_whose_lease_lapsed_while_the_batch_waited_is_revalidated() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let b = Arc::new(backend(dir.path(), &clock, 1));
        put(&b, "a", 0xAA, 3000);
        put(&b, "b", 0xBB, 3000);
        // Only "b"'s copy is cached now (one staging page); make "a" the cached one.
        b.drop_cached_copies();
        assert!(b.batch_resolve(&["a".to_owned()], false)[0].found);
        clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
        b.reaper_tick();
        // A read of "b" is in flight elsewhere: the batch follows it.
        let flight = Arc::new(Flight::default());
        b.inner.state.lock().flights.insert("b".into(), Arc::clone(&flight));
        let reader = {
            let b = Arc::clone(&b);
            std::thread::spawn(move || b.batch_resolve(&["a".to_owned(), "b".to_owned()], false))
        };
        // Wait until the reader took its lease on "a" and is following "b".
        let leased = |b: &SsdBackend| {
            let now = b.inner.config.clock.now();
            b.inner.state.lock().staged.get("a").is_some_and(|s| s.leased(now))
        };
        let start = Instant::now();
        while !leased(&b) {
            assert!(start.elapsed() < Duration::from_secs(10), "the reader never leased a");
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(20));
        // The lease lapses while the reader waits; a writer takes the page and fills it.
        clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
        let slot = b.batch_allocate(&[AllocateRequest::new("c", 3000)]).remove(0);
        assert_eq!(slot.outcome, AllocateOutcome::Allocated, "the unleased copy of a makes room");
        // SAFETY: the page is the slot's.
        unsafe { std::ptr::write_bytes(page_ptr(&b, &slot.pages[0]), 0xCC, 3000) };
        b.inner.state.lock().flights.remove("b");
        flight.finish();
        let entries = reader.join().expect("reader");
        if entries[0].found {
            assert_ne!(entries[0].pages, slot.pages, "a hit points at a page another writer owns");
            assert_eq!(read(&b, &entries[0]), vec![0xAA; 3000], "wrong bytes for a");
        }
        b.batch_abort(&[slot.slot_id]);
    }

    /// An engine that fails every op starting at `offset` with EIO.
    #[derive(Debug)]
    struct FailAt(u64);

    impl IoEngine for FailAt {
        fn name(&self) -> &'static str {
            "fail-at"
        }

        fn submit(&self, ops: &mut [IoOp]) {
            crate::io::PsyncEngine.submit(ops);
            for op in ops.iter_mut().filter(|op| op.offset() == self.0) {
                op.result = Err(io::Error::from_raw_os_error(libc::EIO));
            }
        }
    }

    #[test]
    fn a_read_error_while_scanning_is_a_torn_tail_not_a_failed_init() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let b = backend(dir.path(), &clock, 4);
        for (i, k) in ["a", "b", "c"].iter().enumerate() {
            put(&b, k, i as u8 + 1, 3000);
        }
        b.shutdown();
        drop(b);
        // Each record is 8 KiB: the second one's header cannot be read.
        let b = backend_uninit(dir.path(), &clock);
        let recovered = b.open_log(&FailAt(8192)).expect("init survives a read error");
        let keys: Vec<&str> = recovered.owned.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a"], "the records before the error are recovered");
        assert_eq!(b.inner.counters.recovery_torn_tail.load(Ordering::Relaxed), 1, "counted as a torn tail");
        assert!(recovered.log.segs.values().all(|s| s.sealed), "the segment is sealed");
    }

    fn backend_uninit(dir: &std::path::Path, clock: &Arc<ManualClock>) -> SsdBackend {
        let config = SsdConfig::builder([dir])
            .page_size(PAGE)
            .capacity_bytes(64 * PAGE)
            .staging_pages(4)
            .segment_bytes(256 * 1024)
            .clock(Arc::clone(clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        SsdBackend::new(config)
    }

    fn record_bytes(key: &str, value: &[u8], seq: u64, flags: u16) -> Vec<u8> {
        let hl = header_len(key.len()) as usize;
        let mut buf = vec![0u8; hl + record::align_up(value.len() as u64) as usize];
        buf[hl..hl + value.len()].copy_from_slice(value);
        let crc = record::data_crc(key.as_bytes(), value);
        record::encode_header_flags(&mut buf[..hl], key, value.len() as u64, seq, crc, flags);
        buf
    }

    /// Hand-made segment: a value, a CRC-valid tombstone of 3 bytes (malformed: skipped, the scan
    /// goes on), a value, then a CRC-valid header claiming an absurd size (a torn tail, no panic).
    #[test]
    fn recovery_rejects_malformed_tombstones_and_absurd_sizes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut seg = record_bytes("a", &[1u8; 100], 1, 0);
        seg.extend(record_bytes("t", &[9u8; 3], 2, record::FLAG_TOMBSTONE));
        seg.extend(record_bytes("b", &[2u8; 200], 3, 0));
        let mut absurd = vec![0u8; header_len(1) as usize];
        record::encode_header(&mut absurd, "z", u64::MAX - 1, 4, 0);
        seg.extend(absurd);
        seg.resize(seg.len() + 8192, 0);
        fs::write(dir.path().join(SegmentFile::segment_name(0)), &seg).expect("write segment");
        let clock = ManualClock::new();
        let b = backend(dir.path(), &clock, 4);
        let mut keys: Vec<String> = b.snapshot_owned_keys().into_iter().map(|e| e.key).collect();
        keys.sort();
        assert_eq!(keys, ["a", "b"], "the malformed tombstone is not a value");
        let stats = b.stats();
        assert_eq!((stats.recovery_corrupt, stats.torn_tails, stats.tombstones), (1, 1, 0), "{stats:?}");
        let e = b.batch_resolve(&["b".to_owned()], false).remove(0);
        assert_eq!(read(&b, &e), vec![2u8; 200]);
    }

    /// Dropping a key (the corrupt-read path does) while a reader holds a lease on its cached copy
    /// must not free the copy's pages under the reader.
    #[test]
    fn dropping_a_leased_key_defers_its_pages_to_the_lease_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let b = backend(dir.path(), &clock, 1);
        put(&b, "a", 0xAA, 3000);
        let e = b.batch_resolve(&["a".to_owned()], false).remove(0);
        assert!(e.found);
        {
            let now = clock.now();
            let mut state = b.inner.state.lock();
            assert!(state.drop_owned("a", PAGE, now).is_some());
        }
        assert_eq!(
            b.batch_allocate(&[AllocateRequest::new("c", 10)])[0].outcome,
            AllocateOutcome::Busy,
            "the leased page went to a writer while its reader copies"
        );
        assert_eq!(read(&b, &e), vec![0xAA; 3000]);
        clock.advance(b.config().read_lease_ttl() + Duration::from_millis(1));
        b.reaper_tick();
        assert_eq!(b.batch_allocate(&[AllocateRequest::new("c", 10)])[0].outcome, AllocateOutcome::Allocated);
    }

    #[test]
    fn split_segments_cuts_at_the_chunk_size_and_keeps_every_byte_in_order() {
        let mut arena = vec![0u8; 64 * 1024];
        let base = arena.as_mut_ptr();
        // SAFETY: every offset stays inside `arena`.
        let segs = unsafe { [(base, 12 * 1024), (base.add(16 * 1024), 4096), (base.add(32 * 1024), 20 * 1024)] };
        let chunks = split_segments(&segs, 8192);
        let lens: Vec<usize> = chunks.iter().map(|c| c.iter().map(|(_, l)| *l).sum()).collect();
        assert_eq!(lens, [8192, 8192, 8192, 8192, 4096]);
        let flat: Vec<(*mut u8, usize)> = chunks.into_iter().flatten().collect();
        assert_eq!(flat.iter().map(|(_, l)| l).sum::<usize>(), 36 * 1024);
        // SAFETY: inside `arena`.
        let (at_8k, at_16k) = unsafe { (base.add(8192), base.add(16 * 1024)) };
        assert_eq!(flat[0], (base, 8192));
        assert_eq!(flat[1], (at_8k, 4096));
        assert_eq!(flat[2], (at_16k, 4096));
    }

    /// An engine that holds every submit made from a thread whose name is in `held` until the test
    /// lets that name go (other threads pass straight through).
    #[derive(Debug, Default)]
    struct Gate {
        state: Mutex<(std::collections::HashSet<String>, std::collections::HashSet<String>)>,
        cv: Condvar,
    }

    impl Gate {
        fn hold(&self, name: &str) {
            self.state.lock().0.insert(name.to_owned());
        }

        /// Waits until a submit of thread `name` is being held.
        fn wait_entered(&self, name: &str) {
            let mut st = self.state.lock();
            while !st.1.contains(name) {
                self.cv.wait(&mut st);
            }
        }

        fn release(&self, name: &str) {
            self.state.lock().0.remove(name);
            self.cv.notify_all();
        }
    }

    impl IoEngine for Gate {
        fn name(&self) -> &'static str {
            "gate"
        }

        fn submit(&self, ops: &mut [IoOp]) {
            let name = std::thread::current().name().unwrap_or_default().to_owned();
            {
                let mut st = self.state.lock();
                if st.0.contains(&name) {
                    st.1.insert(name.clone());
                    self.cv.notify_all();
                    while st.0.contains(&name) {
                        self.cv.wait(&mut st);
                    }
                }
            }
            crate::io::PsyncEngine.submit(ops);
        }
    }

    /// Puts `key` on a named thread (its drive write held by `gate` when the name is held).
    fn spawn_put(b: &Arc<SsdBackend>, name: &str, key: &'static str, fill: u8) -> std::thread::JoinHandle<()> {
        let b = Arc::clone(b);
        std::thread::Builder::new().name(name.to_owned()).spawn(move || put(&b, key, fill, 3000)).expect("spawn")
    }

    fn gated(dir: &std::path::Path, clock: &Arc<ManualClock>) -> (Arc<SsdBackend>, Arc<Gate>) {
        let b = Arc::new(backend(dir, clock, 8));
        // No background pass may write or compact while the test orders the writes.
        b.stop_reaper();
        let gate = Arc::new(Gate::default());
        *b.inner.engine.write() = Some(Arc::clone(&gate) as Arc<dyn IoEngine>);
        (b, gate)
    }

    fn resolve_bytes(b: &SsdBackend, key: &str) -> Option<Vec<u8>> {
        let e = b.batch_resolve(&[key.to_owned()], false).remove(0);
        e.found.then(|| read(b, &e))
    }

    fn restarted(b: Arc<SsdBackend>, dir: &std::path::Path, clock: &Arc<ManualClock>) -> SsdBackend {
        b.shutdown();
        drop(b);
        backend(dir, clock, 8)
    }

    /// Two commits of one key in different batches: A reserves first and lands first; B starts
    /// while A's write is in flight and lands second. Whatever the node serves before a restart, it
    /// must serve after it (recovery keeps the record with the highest seq).
    #[test]
    fn a_restart_after_two_racing_commits_serves_the_same_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let (b, gate) = gated(dir.path(), &clock);
        gate.hold("a");
        gate.hold("b");
        let a = spawn_put(&b, "a", "k", 0xAA);
        gate.wait_entered("a");
        let bt = spawn_put(&b, "b", "k", 0xBB);
        // Time for B to reserve and reach the drive (or to wait for A, as it should).
        std::thread::sleep(Duration::from_millis(100));
        gate.release("a");
        a.join().expect("a");
        gate.release("b");
        bt.join().expect("b");
        let before = resolve_bytes(&b, "k").expect("k is served before the restart");
        assert_eq!(before, vec![0xAA; 3000], "the first commit wins");
        let b = restarted(b, dir.path(), &clock);
        let after = resolve_bytes(&b, "k").expect("k is recovered");
        assert_eq!(after, before, "the restart serves other bytes than the node did");
        assert_eq!(b.owned_key_count(), 1);
    }

    /// A commit of `k` is in flight when another commit of `k` starts; if the second one lands
    /// first, `k` is evicted and its tombstone written before the first lands. The node and a
    /// restart of it must agree about `k` (a record older than a tombstone on the drive is hidden
    /// at recovery, so it must not be served before either).
    #[test]
    fn a_key_evicted_while_an_older_commit_is_in_flight_agrees_after_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let (b, gate) = gated(dir.path(), &clock);
        gate.hold("late");
        let late = spawn_put(&b, "late", "k", 0xBB);
        gate.wait_entered("late");
        let early = spawn_put(&b, "early", "k", 0xAA);
        std::thread::sleep(Duration::from_millis(100));
        // Only if the second commit did not wait for the first: evict it and log the tombstone.
        b.evict(&["k".to_owned()]);
        b.inner.flush_tombstones();
        gate.release("late");
        late.join().expect("late");
        early.join().expect("early");
        let before = resolve_bytes(&b, "k");
        let b = restarted(b, dir.path(), &clock);
        assert_eq!(resolve_bytes(&b, "k"), before, "memory and recovery disagree about k");
    }

    /// Evicted, tombstone logged, then put again: the re-put is recovered after a restart.
    #[test]
    fn a_key_evicted_then_put_again_is_recovered_after_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let b = Arc::new(backend(dir.path(), &clock, 8));
        put(&b, "k", 0xAA, 3000);
        b.evict(&["k".to_owned()]);
        b.inner.flush_tombstones();
        put(&b, "k", 0xBB, 3000);
        let b = restarted(b, dir.path(), &clock);
        assert_eq!(resolve_bytes(&b, "k"), Some(vec![0xBB; 3000]));
    }

    /// Repeated overwrite (evict + put) and eviction under pressure: the segment files on the drive
    /// never exceed the capacity by more than the documented headroom
    /// ([`SsdConfig::disk_headroom_bytes`]).
    #[test]
    fn repeated_overwrite_and_eviction_keep_the_log_within_capacity_plus_headroom() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let config = SsdConfig::builder([dir.path()])
            .page_size(PAGE)
            .capacity_bytes(256 * PAGE)
            .staging_pages(8)
            .segment_bytes(32 * PAGE)
            .clock(Arc::clone(&clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let limit = config.capacity_bytes + config.disk_headroom_bytes();
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b.stop_reaper();
        let mut worst = 0;
        for i in 0..2000u32 {
            let key = format!("k{}", i % 300);
            b.evict(std::slice::from_ref(&key));
            put(&b, &key, i as u8, 3000);
            if i % 3 == 0 {
                b.reaper_tick();
            }
            worst = worst.max(segment_bytes_in(dir.path()));
            assert!(worst <= limit, "step {i}: {worst} bytes of segments > {limit} ({:?})", b.stats());
        }
        eprintln!("worst {worst} limit {limit}");
    }

    /// A one-directory backend with 4 KiB pages, `capacity_pages` of capacity and segments of 32
    /// records of 4 KiB-page values (8 KiB each: a header block and a value block), its reaper
    /// stopped so the test decides when log passes run.
    fn paced(dir: &std::path::Path, clock: &Arc<ManualClock>, capacity_pages: u64) -> (SsdBackend, u64) {
        let config = SsdConfig::builder([dir])
            .page_size(PAGE)
            .capacity_bytes(capacity_pages * PAGE)
            .staging_pages(8)
            .segment_bytes(32 * PAGE)
            .clock(Arc::clone(clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let limit = config.capacity_bytes + config.disk_headroom_bytes();
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b.stop_reaper();
        (b, limit)
    }

    /// Writers that append several segments between two log passes: the passes compact as many
    /// segments as the measured pace needs, so the files still never pass the capacity plus the
    /// headroom. (64 KiB values: a tombstone, 8 KiB, is small beside a record, as with real KV
    /// blocks; tombstones in force are live records the watermarks do not count.)
    #[test]
    fn bursts_between_passes_keep_the_log_within_capacity_plus_headroom() {
        const BIG: u64 = 64 * 1024;
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        // Records of 68 KiB (a header block and the value); 15 to a 1 MiB segment.
        let config = SsdConfig::builder([dir.path()])
            .page_size(BIG)
            .capacity_bytes(128 * BIG)
            .staging_pages(8)
            .segment_bytes(1 << 20)
            .clock(Arc::clone(&clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let limit = config.capacity_bytes + config.disk_headroom_bytes();
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b.stop_reaper();
        let mut worst = 0;
        for i in 0..1200u32 {
            let key = format!("k{}", i % 150);
            b.evict(std::slice::from_ref(&key));
            let a = b.batch_allocate(&[AllocateRequest::new(key.as_str(), BIG)]).remove(0);
            assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {key}");
            assert!(b.batch_commit(&[CommitRequest::new(a.slot_id, key.as_str())])[0].success, "commit {key}");
            // 40 overwrites between passes: 2.7 MiB, nearly three segments.
            if i % 40 == 39 {
                b.reaper_tick();
            }
            worst = worst.max(segment_bytes_in(dir.path()));
            assert!(worst <= limit, "step {i}: {worst} bytes of segments > {limit} ({:?})", b.stats());
        }
        assert!(b.stats().compaction_moved > 0, "compaction ran ({:?})", b.stats());
        eprintln!("worst {worst} limit {limit}");
    }

    /// Dead records far beyond an eighth of the capacity are left alone while the log is far from
    /// its capacity (moving them would only take bandwidth from the writers); compaction starts
    /// once the log comes near the capacity, and the files stay within capacity plus headroom.
    #[test]
    fn compaction_waits_until_the_log_needs_the_room() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        // 2 MiB of capacity; 64 values of 8 KiB records fill four segments.
        let (b, limit) = paced(dir.path(), &clock, 512);
        for i in 0..64u32 {
            put(&b, &format!("k{i}"), i as u8, 3000);
        }
        // Three quarters of the four segments die: 384 KiB of dead records, well past an eighth of
        // the capacity (256 KiB), which the earlier rule compacted at.
        let victims: Vec<String> = (0..64u32).filter(|i| i % 4 != 0).map(|i| format!("k{i}")).collect();
        assert!(b.evict(&victims).iter().all(|e| e.bytes_freed > 0));
        for _ in 0..10 {
            b.reaper_tick();
        }
        let s = b.stats();
        assert_eq!(s.compaction_moved, 0, "nothing was compacted while the room was not needed: {s:?}");
        let dead = {
            let state = b.inner.state.lock();
            state.log.file_bytes() - state.log.live_bytes()
        };
        assert!(dead > 512 * PAGE / 8, "the dead bytes ({dead}) are past an eighth of the capacity: {s:?}");
        // Keep writing: the log nears its capacity and compaction starts.
        let mut worst = 0;
        for i in 0..600u32 {
            put(&b, &format!("n{i}"), i as u8, 3000);
            if i % 4 == 3 {
                b.reaper_tick();
            }
            worst = worst.max(segment_bytes_in(dir.path()));
            assert!(worst <= limit, "step {i}: {worst} bytes of segments > {limit} ({:?})", b.stats());
        }
        assert!(b.stats().compaction_moved > 0, "compaction ran once the room was needed ({:?})", b.stats());
    }

    /// Eviction walks the LRU from its cold end and steps over a leased key and a spared one,
    /// evicting exactly as many keys as the target needs (no copy of the LRU is taken).
    #[test]
    fn eviction_takes_the_coldest_keys_in_order_and_steps_over_keys_in_use() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let b = backend(dir.path(), &clock, 8);
        b.stop_reaper();
        for k in ["a", "b", "c", "d", "e"] {
            put(&b, k, 1, 3000);
        }
        // `b` becomes the most recently used and leased: LRU order a, c, d, e, b.
        assert!(b.batch_resolve(&["b".to_owned()], false)[0].found);
        let now = clock.now();
        let mut state = b.inner.state.lock();
        let target = state.used - 2 * PAGE;
        b.inner.evict_down_to(&mut state, target, now, &["a".to_owned()]);
        let mut left: Vec<&String> = state.owned.keys().collect();
        left.sort();
        assert_eq!(left, ["a", "b", "e"], "c and d go: a is spared, b is leased and warm");
        assert_eq!(state.lru.oldest_first().cloned().collect::<Vec<_>>(), ["a", "e", "b"]);
        // Nothing evictable but spared or leased keys: the walk ends at the warm end.
        b.inner.evict_down_to(&mut state, 0, now, &["a".to_owned(), "e".to_owned()]);
        assert_eq!(state.owned.len(), 3);
    }

    /// Making room in staging drops the least recently used unleased cached copy, and only as many
    /// as needed: the use order is indexed, so this looks at leased copies and victims only.
    #[test]
    fn staging_pressure_drops_the_coldest_unleased_cached_copy() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let b = backend(dir.path(), &clock, 3);
        b.stop_reaper();
        for k in ["a", "b", "c"] {
            put(&b, k, 1, 3000);
        }
        // `a` is resolved (leased, most recently used); cache order b, c, a.
        assert!(b.batch_resolve(&["a".to_owned()], false)[0].found);
        assert_eq!(b.batch_allocate(&[AllocateRequest::new("x", 10)])[0].outcome, AllocateOutcome::Allocated);
        {
            let state = b.inner.state.lock();
            assert!(!state.staged.contains_key("b"), "b was the coldest unleased copy");
            assert!(state.staged.contains_key("a") && state.staged.contains_key("c"));
            assert_eq!(state.staged.len(), 2);
        }
        assert_eq!(b.batch_allocate(&[AllocateRequest::new("y", 10)])[0].outcome, AllocateOutcome::Allocated);
        let state = b.inner.state.lock();
        assert!(state.staged.contains_key("a") && !state.staged.contains_key("c"), "the leased copy stays");
        // With only a leased copy left, no more room is made: busy (the drive has room).
        drop(state);
        assert_eq!(b.batch_allocate(&[AllocateRequest::new("z", 10)])[0].outcome, AllocateOutcome::Busy);
    }

    /// Compaction finds a segment's records through the per-segment index: after every pass the
    /// index agrees with each key's record, no key points into a deleted segment, and records were
    /// moved (so the index was what compaction used).
    #[test]
    fn compaction_through_the_segment_index_keeps_every_key_on_a_live_segment() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let config = SsdConfig::builder([dir.path()])
            .page_size(PAGE)
            .capacity_bytes(256 * PAGE)
            .staging_pages(8)
            .segment_bytes(32 * PAGE)
            .clock(Arc::clone(&clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b.stop_reaper();
        for i in 0..600u32 {
            let key = format!("k{}", i % 150);
            b.evict(std::slice::from_ref(&key));
            put(&b, &key, i as u8, 3000);
            if i % 3 == 0 {
                b.reaper_tick();
                let state = b.inner.state.lock();
                state.owned.check();
                state.tombs.check();
                for (k, o) in state.owned.iter() {
                    assert!(state.log.segs.contains_key(&o.loc.seg), "step {i}: {k} in a deleted segment");
                }
                for (k, t) in state.tombs.iter() {
                    assert!(state.log.segs.contains_key(&t.loc.seg), "step {i}: tombstone of {k} in a deleted segment");
                }
            }
        }
        assert!(b.stats().compaction_moved > 0, "compaction ran ({:?})", b.stats());
        for i in 0..150u32 {
            let key = format!("k{i}");
            if let Some(v) = resolve_bytes(&b, &key) {
                assert_eq!(v.len(), 3000);
            }
        }
    }

    /// Waits (real time) up to `bound` for `cond`.
    fn eventually(bound: Duration, mut cond: impl FnMut() -> bool) -> bool {
        let end = Instant::now() + bound;
        while Instant::now() < end {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        cond()
    }

    /// The log thread is stuck in a drive write (a tombstone): slot and lease expiry still run on
    /// the reaper's interval.
    #[test]
    fn expiry_runs_while_the_log_thread_is_stuck_in_drive_io() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let config = SsdConfig::builder([dir.path()])
            .page_size(PAGE)
            .capacity_bytes(64 * PAGE)
            .staging_pages(8)
            .segment_bytes(256 * 1024)
            .read_lease_ttl(Duration::from_secs(5))
            .pending_ttl(Duration::from_secs(5))
            .reaper_interval(Duration::from_millis(5))
            .clock(Arc::clone(&clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b.stop_reaper();
        let gate = Arc::new(Gate::default());
        *b.inner.engine.write() = Some(Arc::clone(&gate) as Arc<dyn IoEngine>);
        gate.hold(LOG_THREAD);
        *b.reaper.lock() = Some(b.start_reaper().expect("reaper"));
        put(&b, "a", 1, 3000);
        put(&b, "b", 2, 3000);
        b.evict(&["a".to_owned()]);
        gate.wait_entered(LOG_THREAD);
        // A slot never committed and a read lease, both due once the clock moves on.
        let slot = b.batch_allocate(&[AllocateRequest::new("p", 10)]).remove(0);
        assert_eq!(slot.outcome, AllocateOutcome::Allocated);
        assert!(b.batch_resolve(&["b".to_owned()], false)[0].found);
        clock.advance(Duration::from_secs(6));
        let expired = eventually(Duration::from_secs(2), || {
            b.inner.counters.staging_expired_reclaim.load(Ordering::Relaxed) == 1
                && b.inner.state.lock().staged.get("b").is_some_and(|s| s.lease_until.is_none())
        });
        gate.release(LOG_THREAD);
        assert!(expired, "the slot and the lease expired while the log thread was held");
        assert!(!b.batch_commit(&[CommitRequest::new(slot.slot_id, "p")])[0].success, "the slot expired");
        b.shutdown();
    }

    /// A commit's drive write is held: allocate, a resolve of another key that reads the drive,
    /// and an evict, each on its own thread, complete within a bound (the state lock is not held
    /// across the write).
    #[test]
    fn the_state_lock_is_not_held_across_a_commits_drive_write() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let (b, gate) = gated(dir.path(), &clock);
        put(&b, "other", 0x11, 3000);
        put(&b, "victim", 0x22, 3000);
        // So the resolve of `other` has to read the drive.
        b.drop_cached_copies();
        gate.hold("w");
        let writer = spawn_put(&b, "w", "k", 0xAA);
        gate.wait_entered("w");
        let (tx, rx) = crossbeam_channel::unbounded::<&'static str>();
        let mut threads = Vec::new();
        let spawn = |name: &'static str, f: Box<dyn FnOnce(&SsdBackend) + Send>| {
            let (b, tx) = (Arc::clone(&b), tx.clone());
            std::thread::spawn(move || {
                f(&b);
                let _ = tx.send(name);
            })
        };
        threads.push(spawn(
            "allocate",
            Box::new(|b| {
                let a = b.batch_allocate(&[AllocateRequest::new("n", 10)]).remove(0);
                assert_eq!(a.outcome, AllocateOutcome::Allocated);
            }),
        ));
        threads.push(spawn("resolve", Box::new(|b| assert_eq!(resolve_bytes(b, "other"), Some(vec![0x11; 3000])))));
        threads.push(spawn(
            "evict",
            Box::new(|b| {
                let r = b.evict(&["victim".to_owned()]);
                assert!(r.len() == 1 && r[0].bytes_freed > 0, "{r:?}");
            }),
        ));
        let mut done = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while done.len() < 3 {
            match rx.recv_deadline(deadline) {
                Ok(name) => done.push(name),
                Err(_) => break,
            }
        }
        let held = !writer.is_finished();
        gate.release("w");
        writer.join().expect("writer");
        for t in threads {
            t.join().expect("a call panicked");
        }
        assert_eq!(done.len(), 3, "only {done:?} completed while a commit's write was held");
        assert!(held, "the commit's write was held throughout");
        assert_eq!(resolve_bytes(&b, "k"), Some(vec![0xAA; 3000]));
    }

    /// Retiring tombstones through the horizon index retires exactly the tombstones the rule
    /// names (no segment up to the horizon but its own), checked against a scan of all of them
    /// while eviction under pressure, re-puts and compaction make and drop tombstones.
    #[test]
    fn tombstones_retired_through_the_horizon_index_are_exactly_those_out_of_force() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let config = SsdConfig::builder([dir.path()])
            .page_size(PAGE)
            .capacity_bytes(128 * PAGE)
            .staging_pages(8)
            .segment_bytes(32 * PAGE)
            .clock(Arc::clone(&clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b.stop_reaper();
        let (mut seen, mut retired) = (0, 0);
        for i in 0..1500u32 {
            put(&b, &format!("k{}", (i * 7) % 400), i as u8, 3000);
            b.inner.flush_tombstones();
            if i % 5 == 0 {
                let mut state = b.inner.state.lock();
                let log = &state.log;
                let out: std::collections::BTreeSet<String> = state
                    .tombs
                    .iter()
                    .filter(|(_, t)| !log.segs.range(..=t.horizon).any(|(id, _)| *id != t.loc.seg))
                    .map(|(k, _)| k.clone())
                    .collect();
                let before: std::collections::BTreeSet<String> = state.tombs.keys().cloned().collect();
                seen = seen.max(before.len());
                retire_tombstones(&mut state);
                state.tombs.check();
                let after: std::collections::BTreeSet<String> = state.tombs.keys().cloned().collect();
                assert_eq!(before.difference(&after).cloned().collect::<std::collections::BTreeSet<_>>(), out);
                retired += out.len();
            }
            if i % 3 == 0 {
                b.reaper_tick();
            }
        }
        assert!(seen > 0 && retired > 0, "tombstones were made ({seen}) and retired ({retired})");
    }

    #[test]
    fn adjacent_runs_cut_at_gaps_other_segments_and_the_iovec_cap() {
        // (segment, offset, length, iovecs)
        let recs = [
            (1, 0, 8192, 2),
            (1, 8192, 8192, 2),
            (1, 16384, 4096, 2),
            // A gap (another caller's record lies between): a new run.
            (1, 24576, 8192, 2),
            // Another segment (rollover): a new run.
            (2, 0, 8192, 2),
            (2, 8192, 8192, 2),
        ];
        assert_eq!(adjacent_runs(&recs, 1024), vec![0..3, 3..4, 4..6]);
        // The cap: at most 5 iovecs a run, so two records of 2 each, then a new run.
        assert_eq!(adjacent_runs(&recs[..3], 5), vec![0..2, 2..3]);
        // A record carrying more than the cap alone is still one run (one op).
        assert_eq!(adjacent_runs(&[(1, 0, 8192, 9), (1, 8192, 4096, 1)], 4), vec![0..1, 1..2]);
        assert!(adjacent_runs(&[], 4).is_empty());
    }

    #[test]
    fn shared_with_others_counts_only_other_callers_writes() {
        let res = |seg: SegId, in_flight: u32| crate::store::Reservation {
            file: Arc::new(SegmentFile::new(seg, std::path::PathBuf::from("/nonexistent"), false, false, 0)),
            loc: Loc { seg, offset: 0, len: 4096, seq: 0 },
            in_flight,
        };
        let mut own = Vec::new();
        // This caller's first write, alone; then its own second and third: not shared.
        assert!(!shared_with_others(&res(1, 0), &mut own));
        assert!(!shared_with_others(&res(1, 1), &mut own));
        assert!(!shared_with_others(&res(1, 2), &mut own));
        // One more in flight than its own two: another caller's.
        assert!(shared_with_others(&res(1, 4), &mut own));
        // Counted per segment.
        assert!(!shared_with_others(&res(2, 0), &mut own));
        assert!(shared_with_others(&res(3, 1), &mut Vec::new()));
    }

    /// Wraps psync and records the shape of every write op: (offset, bytes, iovecs).
    #[derive(Debug, Default)]
    struct Recorder {
        writes: Mutex<Vec<(u64, usize, usize)>>,
    }

    impl IoEngine for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }

        fn submit(&self, ops: &mut [IoOp]) {
            for op in ops.iter() {
                let (write, bytes, iovecs) = op.shape();
                if write {
                    self.writes.lock().push((op.offset(), bytes, iovecs));
                }
            }
            crate::io::PsyncEngine.submit(ops);
        }
    }

    fn roomy(dir: &std::path::Path, clock: &Arc<ManualClock>) -> SsdBackend {
        let config = SsdConfig::builder([dir])
            .page_size(PAGE)
            .capacity_bytes(1024 * PAGE)
            .staging_pages(64)
            .segment_bytes(256 * 1024)
            .watermarks(None)
            .clock(Arc::clone(clock) as Arc<dyn Clock>)
            .build()
            .expect("config");
        let b = SsdBackend::new(config);
        b.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
        b
    }

    /// Puts `keys` in one batch, key `i` filled with `fill + i`, 3000 bytes each.
    fn put_batch(b: &SsdBackend, keys: &[String], fill: u8) {
        let reqs: Vec<AllocateRequest> = keys.iter().map(|k| AllocateRequest::new(k.clone(), 3000)).collect();
        let mut commits = Vec::new();
        for (i, (a, k)) in b.batch_allocate(&reqs).into_iter().zip(keys).enumerate() {
            assert_eq!(a.outcome, AllocateOutcome::Allocated, "allocate {k}");
            // SAFETY: the page is the slot's, inside the arena, and 3000 bytes fit one page.
            unsafe { std::ptr::write_bytes(page_ptr(b, &a.pages[0]), fill.wrapping_add(i as u8), 3000) };
            commits.push(CommitRequest::new(a.slot_id, k.clone()));
        }
        assert!(b.batch_commit(&commits).iter().all(|c| c.success), "commit");
    }

    /// A batch's records reserved side by side go out as one write per segment (a rollover in the
    /// middle of the batch cuts it in two), and every record comes back byte-exact after a restart:
    /// the coalesced write is the same bytes at the same places as one write per record.
    #[test]
    fn a_batch_goes_out_as_one_write_per_segment_and_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let b = roomy(dir.path(), &clock);
        b.stop_reaper();
        let rec = Arc::new(Recorder::default());
        *b.inner.engine.write() = Some(Arc::clone(&rec) as Arc<dyn IoEngine>);
        // 8 KiB records (a header block and a value page): 32 to a 256 KiB segment.
        let first: Vec<String> = (0..5).map(|i| format!("a{i}")).collect();
        put_batch(&b, &first, 10);
        assert_eq!(*rec.writes.lock(), vec![(0, 5 * 8192, 10)], "one write for the whole batch");
        rec.writes.lock().clear();
        // 27 records fill the first segment; the other 13 open the next.
        let second: Vec<String> = (0..40).map(|i| format!("b{i}")).collect();
        put_batch(&b, &second, 100);
        assert_eq!(*rec.writes.lock(), vec![(5 * 8192, 27 * 8192, 54), (0, 13 * 8192, 26)]);
        b.shutdown();
        drop(b);
        let b = roomy(dir.path(), &clock);
        assert_eq!(b.owned_key_count(), 45);
        for (keys, fill) in [(&first, 10u8), (&second, 100)] {
            for (i, k) in keys.iter().enumerate() {
                let bytes = resolve_bytes(&b, k).unwrap_or_else(|| panic!("{k} lost"));
                assert_eq!(bytes, vec![fill.wrapping_add(i as u8); 3000], "{k}");
            }
        }
    }

    /// A lone writer appends (the segment file is only as long as its records, its blocks
    /// allocated ahead); once a write finds another caller's write in flight in its segment, the
    /// file's size covers the whole segment, and both records survive a restart.
    #[test]
    fn a_lone_writer_appends_and_a_segment_shared_by_two_writers_is_sized() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let (b, gate) = gated(dir.path(), &clock);
        put(&b, "solo", 1, 3000);
        let seg = {
            let state = b.inner.state.lock();
            let (_, meta) = state.log.segs.iter().next().expect("a segment");
            Arc::clone(&meta.file)
        };
        let meta = fs::metadata(&seg.path).expect("stat");
        assert_eq!(meta.len(), 8192, "a lone writer appends");
        assert!(meta.blocks() * 512 >= 256 * 1024, "the segment's blocks are allocated ahead");
        assert!(!seg.is_sized());
        gate.hold("a");
        let a = spawn_put(&b, "a", "ka", 2);
        gate.wait_entered("a");
        spawn_put(&b, "b", "kb", 3).join().expect("b");
        assert!(seg.is_sized());
        assert_eq!(fs::metadata(&seg.path).expect("stat").len(), 256 * 1024, "sized for shared writes");
        gate.release("a");
        a.join().expect("a");
        let b = restarted(b, dir.path(), &clock);
        assert_eq!(resolve_bytes(&b, "solo"), Some(vec![1; 3000]));
        assert_eq!(resolve_bytes(&b, "ka"), Some(vec![2; 3000]));
        assert_eq!(resolve_bytes(&b, "kb"), Some(vec![3; 3000]));
    }
}
