//! Settings of an [`SsdBackend`](crate::SsdBackend), built and validated by [`SsdConfigBuilder`].

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use umbp_core::{Clock, ErrorKind, SystemClock};

use crate::record::{ALIGN, MAX_KEY_LEN, header_len};

/// The longest TTL, lease or interval a config may set (30 days).
const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Which engine does the drive IO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum IoEngineKind {
    /// Blocking `preadv` / `pwritev`: portable, the default.
    #[default]
    Psync,
    /// Linux io_uring: a batch of records goes to the drive in one submission.
    IoUring,
}

impl IoEngineKind {
    /// The name used in configuration (`psync`, `io_uring`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Psync => "psync",
            Self::IoUring => "io_uring",
        }
    }
}

impl fmt::Display for IoEngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for IoEngineKind {
    type Err = SsdConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "psync" => Ok(Self::Psync),
            "io_uring" | "io-uring" | "uring" => Ok(Self::IoUring),
            other => Err(SsdConfigError(format!("unknown io engine {other:?} (expected psync or io_uring)"))),
        }
    }
}

/// A configuration that can never work; the message names the setting.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid SSD configuration: {0}")]
pub struct SsdConfigError(pub String);

impl SsdConfigError {
    /// What the caller does next: fix the configuration ([`ErrorKind::InvalidInput`]).
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidInput
    }
}

/// The operator's settings of an SSD medium: the one place their names (the settings file's
/// `[node.ssd]` keys), defaults and meaning are written. The node's `Medium::Ssd` holds one, and
/// [`builder`](Self::builder) turns it into a full [`SsdConfig`] (the settings not here keep the
/// builder's defaults), whose [`build`](SsdConfigBuilder::build) validates it.
///
/// Sizes read `"32GiB"` or bytes, durations `"3s"`, `sync_interval` also `"off"`.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct SsdSettings {
    /// One directory per drive; values are placed by free space. Required (at least one).
    pub dirs: Vec<PathBuf>,
    /// Drive bytes to lend, split evenly across the directories. Default: 32 GiB.
    #[serde(with = "umbp_core::units::serde::size")]
    pub capacity_bytes: u64,
    /// The io engine (`psync`, `io_uring`). Default: psync.
    #[serde(with = "umbp_core::units::serde::from_str")]
    pub io_engine: IoEngineKind,
    /// Pages of the host staging arena (writes in flight plus reads being served): one page per
    /// value of a 128-key batch, so a batch get or put of 128 single-page values on this node is
    /// staged at once (a larger batch goes through in rounds: reads wait for pages their readers
    /// release, writes for pages their commits give back; the node answers the rest busy). It
    /// bounds concurrency, never how many keys a batch may hold. Default: 128.
    pub staging_pages: u64,
    /// The SSD read lease (its own setting: a reader of a staged page also waited for the drive).
    /// Default: 3 s.
    #[serde(with = "umbp_core::units::serde::duration")]
    pub read_lease: Duration,
    /// How often the medium `fdatasync`s the segments written since its last sync (`None`, `"off"`
    /// in the file: only at shutdown). Commits do not wait for it: it bounds what a power loss can
    /// take. Default: 1 s.
    #[serde(with = "umbp_core::units::serde::period_or_off")]
    pub sync_interval: Option<Duration>,
    /// The largest value, in pages (`page_size` each); a larger value is refused. At most
    /// `staging_pages`. Default: 1 (one key, one page, as the reference stores them).
    pub max_value_pages: u64,
    /// Keep a committed value's staging pages as a clean copy until they are needed again, so a
    /// read of a value just written skips the drive. Default: true (off only where every read must
    /// reach the drive, as in `umbp bench ssd`).
    pub cache_committed: bool,
    /// Create a directory of `dirs` that does not exist. Off by default: a missing directory is
    /// usually an unmounted drive, and creating it would fill the root file system instead.
    /// Default: false.
    pub create_dirs: bool,
}

impl Default for SsdSettings {
    fn default() -> Self {
        Self {
            dirs: Vec::new(),
            capacity_bytes: 32 << 30,
            io_engine: IoEngineKind::Psync,
            staging_pages: 128,
            read_lease: Duration::from_secs(3),
            sync_interval: Some(Duration::from_secs(1)),
            max_value_pages: 1,
            cache_committed: true,
            create_dirs: false,
        }
    }
}

impl SsdSettings {
    /// A builder of pages of `page_size` with these settings (every other one at its default).
    pub fn builder(&self, page_size: u64) -> SsdConfigBuilder {
        SsdConfig::builder(self.dirs.iter().cloned())
            .page_size(page_size)
            .capacity_bytes(self.capacity_bytes)
            .io_engine(self.io_engine)
            .staging_pages(self.staging_pages)
            .read_lease_ttl(self.read_lease)
            .sync_interval(self.sync_interval)
            .max_value_pages(self.max_value_pages)
            .cache_committed(self.cache_committed)
    }

    /// Whether a value of `max_value_pages` can be staged: in `1..=staging_pages` (the medium
    /// stages a whole value at once). One of [`validate`](Self::validate)'s rules, on its own for a
    /// caller that checks before it knows the page size.
    pub fn check_value_pages(&self) -> Result<(), SsdConfigError> {
        value_pages_fit(self.max_value_pages, self.staging_pages)
    }

    /// Checks these settings with pages of `page_size` (the rules of [`SsdConfigBuilder::build`]).
    pub fn validate(&self, page_size: u64) -> Result<(), SsdConfigError> {
        self.builder(page_size).build().map(drop)
    }
}

/// LRU eviction between two fill levels of the drive capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Watermarks {
    /// Evict once used bytes reach this fraction of capacity (or an allocation would not fit).
    pub high: f64,
    /// Evict down to this fraction.
    pub low: f64,
}

impl Default for Watermarks {
    fn default() -> Self {
        Self { high: 0.9, low: 0.7 }
    }
}

/// Validated settings of an [`SsdBackend`](crate::SsdBackend). Build one with [`SsdConfig::builder`].
#[derive(Clone)]
pub struct SsdConfig {
    pub(crate) dirs: Vec<PathBuf>,
    pub(crate) capacity_bytes: u64,
    pub(crate) page_size: u64,
    pub(crate) staging_pages: u64,
    pub(crate) max_value_pages: u64,
    pub(crate) segment_bytes: u64,
    pub(crate) io_engine: IoEngineKind,
    pub(crate) queue_depth: u32,
    pub(crate) io_uring_rings: u32,
    pub(crate) direct_io: bool,
    pub(crate) preallocate: bool,
    pub(crate) watermarks: Option<Watermarks>,
    pub(crate) single_flight: bool,
    pub(crate) recover: bool,
    pub(crate) cache_committed: bool,
    pub(crate) shareable_staging: bool,
    pub(crate) reclaim_dead_ratio: f64,
    pub(crate) pending_ttl: Duration,
    pub(crate) read_lease_ttl: Duration,
    pub(crate) reaper_interval: Duration,
    pub(crate) sync_interval: Option<Duration>,
    pub(crate) clock: Arc<dyn Clock>,
}

impl fmt::Debug for SsdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SsdConfig")
            .field("dirs", &self.dirs)
            .field("capacity_bytes", &self.capacity_bytes)
            .field("page_size", &self.page_size)
            .field("staging_pages", &self.staging_pages)
            .field("max_value_pages", &self.max_value_pages)
            .field("segment_bytes", &self.segment_bytes)
            .field("io_engine", &self.io_engine)
            .field("queue_depth", &self.queue_depth)
            .field("io_uring_rings", &self.io_uring_rings)
            .field("direct_io", &self.direct_io)
            .field("preallocate", &self.preallocate)
            .field("watermarks", &self.watermarks)
            .field("single_flight", &self.single_flight)
            .field("recover", &self.recover)
            .field("cache_committed", &self.cache_committed)
            .field("shareable_staging", &self.shareable_staging)
            .field("reclaim_dead_ratio", &self.reclaim_dead_ratio)
            .field("pending_ttl", &self.pending_ttl)
            .field("read_lease_ttl", &self.read_lease_ttl)
            .field("reaper_interval", &self.reaper_interval)
            .field("sync_interval", &self.sync_interval)
            .finish_non_exhaustive()
    }
}

impl SsdConfig {
    /// Drive bytes the segment files may take beyond `capacity_bytes`: (directories + 1) ×
    /// `segment_bytes` (each directory's preallocated active segment and the segment being
    /// compacted; see the crate docs, "Disk use"). Leave this much free on the drives too.
    pub fn disk_headroom_bytes(&self) -> u64 {
        (self.dirs.len() as u64 + 1) * self.segment_bytes
    }

    /// File descriptors the medium may hold open at once, at worst: one per segment file (each
    /// stays open while the segment exists) for the capacity plus the headroom in whole segments
    /// plus each directory's partly filled active segment, one lock per directory, and one per
    /// io_uring ring. `init` refuses a configuration whose worst case passes the process's
    /// open-file limit (`RLIMIT_NOFILE`, `ulimit -n`), naming both: raise the limit, or
    /// `segment_bytes`. For scale: 4 TiB in the default 256 MiB segments needs about 16 400, more
    /// than the usual default soft limit of 1024. The rest of the process (sockets, other files)
    /// needs descriptors of its own on top.
    pub fn max_open_files(&self) -> u64 {
        let dirs = self.dirs.len() as u64;
        let segments = (self.capacity_bytes + self.disk_headroom_bytes()).div_ceil(self.segment_bytes) + dirs;
        let rings = match self.io_engine {
            IoEngineKind::IoUring => u64::from(self.io_uring_rings),
            IoEngineKind::Psync => 0,
        };
        segments + dirs + rings
    }

    /// A builder storing values in `dirs` (one directory per drive) with every other setting at its
    /// default.
    pub fn builder<I, P>(dirs: I) -> SsdConfigBuilder
    where
        I: IntoIterator<Item = P>,
        P: Into<PathBuf>,
    {
        SsdConfigBuilder { config: SsdConfig::defaults(dirs.into_iter().map(Into::into).collect()) }
    }

    fn defaults(dirs: Vec<PathBuf>) -> Self {
        // The operator's settings take their defaults from the one place they are written.
        let s = SsdSettings::default();
        Self {
            dirs,
            capacity_bytes: s.capacity_bytes,
            page_size: 2 << 20,
            staging_pages: s.staging_pages,
            max_value_pages: s.max_value_pages,
            segment_bytes: 256 << 20,
            io_engine: s.io_engine,
            queue_depth: 256,
            io_uring_rings: 8,
            direct_io: true,
            preallocate: true,
            watermarks: Some(Watermarks::default()),
            single_flight: true,
            recover: true,
            cache_committed: s.cache_committed,
            shareable_staging: false,
            reclaim_dead_ratio: 0.5,
            pending_ttl: Duration::from_secs(30),
            read_lease_ttl: s.read_lease,
            reaper_interval: Duration::from_millis(200),
            sync_interval: s.sync_interval,
            clock: SystemClock::shared(),
        }
    }

    /// The drive directories.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }
    /// Drive bytes the medium advertises and fills.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }
    /// The page size.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }
    /// Whether the staging arena is a sealed memory file same-host peers may map.
    pub fn shareable_staging(&self) -> bool {
        self.shareable_staging
    }
    /// The staging arena's pages.
    pub fn staging_pages(&self) -> u64 {
        self.staging_pages
    }
    /// The io engine.
    pub fn io_engine(&self) -> IoEngineKind {
        self.io_engine
    }
    /// The pending-slot TTL.
    pub fn pending_ttl(&self) -> Duration {
        self.pending_ttl
    }
    /// The SSD read lease.
    pub fn read_lease_ttl(&self) -> Duration {
        self.read_lease_ttl
    }
}

/// A value of `max_value_pages` pages must fit the staging arena of `staging_pages`.
fn value_pages_fit(max_value_pages: u64, staging_pages: u64) -> Result<(), SsdConfigError> {
    if max_value_pages == 0 || max_value_pages > staging_pages {
        return Err(SsdConfigError(format!(
            "max_value_pages {max_value_pages} must be in 1..=staging_pages ({staging_pages})"
        )));
    }
    Ok(())
}

/// Builds an [`SsdConfig`]; [`build`](Self::build) rejects every setting that can never work.
#[derive(Debug, Clone)]
pub struct SsdConfigBuilder {
    config: SsdConfig,
}

impl SsdConfigBuilder {
    /// Drive bytes to use, split evenly across the directories. It is what the medium advertises:
    /// live values (each rounded up to whole pages) never exceed it. Default: 32 GiB.
    pub fn capacity_bytes(mut self, bytes: u64) -> Self {
        self.config.capacity_bytes = bytes;
        self
    }

    /// Page size: the node's (the pool's KV block size); a multiple of 4 KiB. Default: 2 MiB.
    pub fn page_size(mut self, bytes: u64) -> Self {
        self.config.page_size = bytes;
        self
    }

    /// Pages of the registered host staging arena: how many writes in flight plus reads being
    /// served (leased) the node can hold at once. Default: 128, a page per value of a 128-key
    /// batch of single-page values (256 MiB of host memory at the default 2 MiB page). A reader
    /// releases its pages as soon as its copy is done, and a resolve that finds no free page
    /// answers busy (the reader waits and asks again), so a smaller arena or a larger batch is
    /// served in rounds, never missed.
    pub fn staging_pages(mut self, pages: u64) -> Self {
        self.config.staging_pages = pages;
        self
    }

    /// The largest value, in pages; larger values are `Failed` (no peer would do better). The
    /// reference stores one key in one page; values of several pages are staged in several
    /// (not necessarily adjacent) staging pages. At most `staging_pages`. Default: 1.
    pub fn max_value_pages(mut self, pages: u64) -> Self {
        self.config.max_value_pages = pages;
        self
    }

    /// Size of one log segment file; a multiple of 4 KiB holding at least one largest record.
    /// Default: 256 MiB.
    pub fn segment_bytes(mut self, bytes: u64) -> Self {
        self.config.segment_bytes = bytes;
        self
    }

    /// The io engine. Default: psync.
    pub fn io_engine(mut self, kind: IoEngineKind) -> Self {
        self.config.io_engine = kind;
        self
    }

    /// Entries of each io_uring ring. Default: 256.
    pub fn queue_depth(mut self, depth: u32) -> Self {
        self.config.queue_depth = depth;
        self
    }

    /// The most io_uring rings the medium keeps (each registers the staging arena once, when
    /// made). A batch takes a free ring for its IO; when every ring is busy it waits for one
    /// rather than making another, so this many batches at most do drive IO at once. Default: 8.
    pub fn io_uring_rings(mut self, rings: u32) -> Self {
        self.config.io_uring_rings = rings;
        self
    }

    /// Open segments with `O_DIRECT` where the filesystem allows it (probed per directory; buffered
    /// IO otherwise). Default: true.
    pub fn direct_io(mut self, on: bool) -> Self {
        self.config.direct_io = on;
        self
    }

    /// Allocate each new segment file's blocks when it is created (`fallocate`, keeping the
    /// file's size): a lone writer appends into them (ext4's cheapest path for `O_DIRECT` writes
    /// to new space), and once writes share a segment its size is raised to the whole segment, so
    /// the filesystem no longer serialises neighbouring writes as it does appends. A segment on
    /// the drive occupies its full size from the start. Default: true.
    pub fn preallocate(mut self, on: bool) -> Self {
        self.config.preallocate = on;
        self
    }

    /// LRU eviction between watermarks (`0 < low < high <= 1`), or `None` to never evict on its own
    /// (a full medium then answers `FailedNoSpace` and only the master evicts). Default: 0.9 / 0.7.
    pub fn watermarks(mut self, watermarks: Option<Watermarks>) -> Self {
        self.config.watermarks = watermarks;
        self
    }

    /// Coalesce concurrent reads of one key into one drive read. Default: true.
    pub fn single_flight(mut self, on: bool) -> Self {
        self.config.single_flight = on;
        self
    }

    /// Rebuild the index from the log at `init` (false: wipe the directories instead, as the
    /// reference does). Default: true.
    pub fn recover(mut self, on: bool) -> Self {
        self.config.recover = on;
        self
    }

    /// Keep a committed value's staging pages as a clean cached copy until another allocation or
    /// read needs them (a read of a just-written key then needs no drive read). Default: true.
    pub fn cache_committed(mut self, on: bool) -> Self {
        self.config.cache_committed = on;
        self
    }

    /// Allocate the staging arena as a sealed memory file (`umbp_page`'s
    /// `HostMemoryOptions::shareable`) and register it with its file, so a peer on this host may map
    /// it and copy staged values through the shared-memory data path instead of TCP (the node's
    /// `shared_memory` setting). Leases and commits still go through this medium. Default: false.
    pub fn shareable_staging(mut self, on: bool) -> Self {
        self.config.shareable_staging = on;
        self
    }

    /// When the log needs room on the drives (see the crate docs, "Disk use"), the sealed segment
    /// with the largest dead fraction at or above this one is compacted (its live records are
    /// rewritten at the log head and the file deleted); the oldest sealed segment when none is
    /// that dead. Fully dead segments are always deleted, at once. In `(0, 1]`. Default: 0.5.
    pub fn reclaim_dead_ratio(mut self, ratio: f64) -> Self {
        self.config.reclaim_dead_ratio = ratio;
        self
    }

    /// How long an allocated, uncommitted slot holds its staging pages. Default: 30 s.
    pub fn pending_ttl(mut self, ttl: Duration) -> Self {
        self.config.pending_ttl = ttl;
        self
    }

    /// How long a resolve keeps the staged copy for its reader (and the key safe from eviction).
    /// Its own setting, longer than DRAM's: a remote reader of a staged page also waits for the
    /// drive. Default: 3 s.
    pub fn read_lease_ttl(mut self, ttl: Duration) -> Self {
        self.config.read_lease_ttl = ttl;
        self
    }

    /// How often the reaper sweeps expired slots and leases and reclaims dead log space.
    /// Default: 200 ms.
    pub fn reaper_interval(mut self, interval: Duration) -> Self {
        self.config.reaper_interval = interval;
        self
    }

    /// How often the reaper `fdatasync`s every segment written since its last sync (`None`: only
    /// at `shutdown`). Commits do not wait for it: a record is safe from a power loss only once a
    /// sync that started after its commit returned has completed (see the crate docs,
    /// "Durability"). Checked on each reaper pass, so the effective period is at least the reaper
    /// interval. Default: 1 s.
    pub fn sync_interval(mut self, interval: Option<Duration>) -> Self {
        self.config.sync_interval = interval;
        self
    }

    /// The time source of TTLs and leases. Default: the system clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.config.clock = clock;
        self
    }

    /// Validates and returns the config.
    pub fn build(self) -> Result<SsdConfig, SsdConfigError> {
        let c = self.config;
        let bad = |m: String| Err(SsdConfigError(m));
        if c.dirs.is_empty() {
            return bad("at least one directory is required".into());
        }
        for (i, d) in c.dirs.iter().enumerate() {
            if d.as_os_str().is_empty() {
                return bad(format!("directory {i} is an empty path"));
            }
            if c.dirs[..i].contains(d) {
                return bad(format!("directory {} is listed twice", d.display()));
            }
        }
        if c.page_size == 0 || !c.page_size.is_multiple_of(ALIGN) {
            return bad(format!("page_size {} must be a positive multiple of {ALIGN}", c.page_size));
        }
        if c.staging_pages == 0 || c.staging_pages > u64::from(u32::MAX) {
            return bad(format!("staging_pages {} must be in 1..=2^32-1", c.staging_pages));
        }
        if c.staging_pages.checked_mul(c.page_size).is_none_or(|b| b > isize::MAX as u64) {
            return bad("the staging arena (staging_pages x page_size) is too large".into());
        }
        value_pages_fit(c.max_value_pages, c.staging_pages)?;
        let dirs = c.dirs.len() as u64;
        if c.capacity_bytes / dirs < c.page_size {
            return bad(format!(
                "capacity_bytes {} gives each of {dirs} directories less than one {}-byte page",
                c.capacity_bytes, c.page_size
            ));
        }
        let largest = header_len(MAX_KEY_LEN) + c.max_value_pages * c.page_size;
        if !c.segment_bytes.is_multiple_of(ALIGN) || c.segment_bytes < largest {
            return bad(format!(
                "segment_bytes {} must be a multiple of {ALIGN} holding the largest record ({largest} bytes)",
                c.segment_bytes
            ));
        }
        if c.queue_depth == 0 || c.queue_depth > 32768 {
            return bad(format!("queue_depth {} must be in 1..=32768", c.queue_depth));
        }
        if c.io_uring_rings == 0 || c.io_uring_rings > 1024 {
            return bad(format!("io_uring_rings {} must be in 1..=1024", c.io_uring_rings));
        }
        if let Some(w) = c.watermarks
            && !(w.low > 0.0 && w.low < w.high && w.high <= 1.0)
        {
            return bad(format!("watermarks need 0 < low < high <= 1, got low {} high {}", w.low, w.high));
        }
        if !(c.reclaim_dead_ratio > 0.0 && c.reclaim_dead_ratio <= 1.0) {
            return bad(format!("reclaim_dead_ratio {} must be in (0, 1]", c.reclaim_dead_ratio));
        }
        for (name, value) in [
            ("pending_ttl", c.pending_ttl),
            ("read_lease_ttl", c.read_lease_ttl),
            ("reaper_interval", c.reaper_interval),
            ("sync_interval", c.sync_interval.unwrap_or(c.reaper_interval)),
        ] {
            if value.is_zero() || value > MAX_DURATION {
                return bad(format!("{name} of {value:?} must be greater than 0 and at most {MAX_DURATION:?}"));
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b() -> SsdConfigBuilder {
        SsdConfig::builder(["/tmp/x"]).page_size(4096).capacity_bytes(1 << 20).segment_bytes(1 << 20)
    }

    #[test]
    fn defaults_are_valid() {
        assert!(SsdConfig::builder(["/tmp/a", "/tmp/b"]).build().is_ok());
        // A page per value of a 128-key batch at the default page size.
        assert_eq!(SsdConfig::builder(["/tmp/a"]).build().map(|c| c.staging_pages()).ok(), Some(128));
        assert!(b().build().is_ok());
    }

    #[test]
    fn impossible_settings_are_rejected() {
        let no_dirs: [&str; 0] = [];
        assert!(SsdConfig::builder(no_dirs).build().is_err());
        assert!(SsdConfig::builder(["/a", "/a"]).build().is_err());
        assert!(b().page_size(1000).build().is_err());
        assert!(b().page_size(0).build().is_err());
        assert!(b().staging_pages(0).build().is_err());
        assert!(b().max_value_pages(129).build().is_err());
        assert!(b().staging_pages(16).max_value_pages(17).build().is_err());
        assert!(b().capacity_bytes(100).build().is_err());
        assert!(b().segment_bytes(4096).build().is_err());
        assert!(b().segment_bytes((1 << 20) + 1).build().is_err());
        assert!(b().watermarks(Some(Watermarks { high: 0.5, low: 0.7 })).build().is_err());
        assert!(b().watermarks(Some(Watermarks { high: 1.1, low: 0.7 })).build().is_err());
        assert!(b().watermarks(Some(Watermarks { high: 0.9, low: 0.0 })).build().is_err());
        assert!(b().watermarks(None).build().is_ok());
        assert!(b().read_lease_ttl(Duration::ZERO).build().is_err());
        assert!(b().reclaim_dead_ratio(0.0).build().is_err());
        assert!(b().queue_depth(0).build().is_err());
        assert!(b().io_uring_rings(0).build().is_err());
        assert!(b().io_uring_rings(1025).build().is_err());
        assert!(b().sync_interval(Some(Duration::ZERO)).build().is_err());
        assert!(b().sync_interval(None).build().is_ok());
    }

    #[test]
    fn settings_defaults_are_the_builders_and_read_the_file_syntax() {
        let s = SsdSettings::default();
        let c = SsdConfig::builder(["/tmp/a"]).build().expect("valid");
        assert_eq!(
            (c.capacity_bytes, c.staging_pages, c.max_value_pages, c.io_engine, c.read_lease_ttl, c.sync_interval),
            (s.capacity_bytes, s.staging_pages, s.max_value_pages, s.io_engine, s.read_lease, s.sync_interval)
        );
        assert_eq!(c.cache_committed, s.cache_committed);
        let s: SsdSettings = serde_json::from_str(
            r#"{"dirs":["/d"],"capacity_bytes":"1GiB","io_engine":"io_uring","read_lease":"500ms","sync_interval":"off","max_value_pages":4}"#,
        )
        .expect("valid");
        assert_eq!((s.capacity_bytes, s.io_engine, s.sync_interval), (1 << 30, IoEngineKind::IoUring, None));
        assert_eq!((s.read_lease, s.max_value_pages, s.staging_pages), (Duration::from_millis(500), 4, 128));
        assert!(serde_json::from_str::<SsdSettings>(r#"{"max_value_page":4}"#).is_err(), "unknown key");
        assert!(s.validate(4096).is_ok());
        let too_large = SsdSettings { max_value_pages: 129, dirs: vec!["/d".into()], ..SsdSettings::default() };
        assert!(too_large.check_value_pages().is_err(), "the same rule on its own");
        assert!(SsdSettings::default().check_value_pages().is_ok());
        let err = too_large.validate(4096).expect_err("more pages than the arena");
        assert!(err.to_string().contains("max_value_pages"), "{err}");
        assert_eq!(err.kind(), ErrorKind::InvalidInput);
        assert_eq!("aio".parse::<IoEngineKind>().expect_err("unknown").kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn engine_names_parse() {
        assert_eq!("psync".parse::<IoEngineKind>(), Ok(IoEngineKind::Psync));
        assert_eq!("io_uring".parse::<IoEngineKind>(), Ok(IoEngineKind::IoUring));
        assert!("aio".parse::<IoEngineKind>().is_err());
        assert_eq!(IoEngineKind::IoUring.to_string(), "io_uring");
    }
}
