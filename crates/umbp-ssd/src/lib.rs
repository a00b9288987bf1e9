//! The SSD medium: values live in an append-only log on local drives and are served through one
//! registered host staging arena.
//!
//! A drive's bytes are not addressable by the transfer layer, so [`SsdBackend`] is the seed's
//! "shape 2": it publishes an ordinary registered host buffer (the staging arena, from
//! [`umbp_page::HostPageMemorySource`]) and moves bytes between it and the drive itself.
//!
//! - `batch_allocate` borrows staging pages and publishes them; the writer copies into them knowing
//!   nothing about drives.
//! - `batch_commit` spills the pages to the drive log and **gives the pages back** (they stay as a
//!   clean cached copy of the value until an allocation or a read needs them, so a read of a value
//!   just written costs no drive read).
//! - `batch_resolve` fills staging pages from the drive (one drive read for any number of concurrent
//!   resolves of a key) and publishes them under the SSD read lease, which has its own setting;
//!   `release_reads` gives them back as soon as the readers are done.
//!
//! Underneath is the drive log: an append-only sequence of segment files per directory (one
//! directory per drive, placement by free space), each holding 4 KiB-aligned records with a header
//! (magic, version, key, value size, sequence number, header CRC) and a CRC-32C over key and value.
//! Capacity is the drive's, not the arena's: what is advertised is `capacity_bytes`, and live
//! values (page-rounded) never exceed it; LRU eviction between watermarks keeps room, never touching
//! a key under a read lease or being read. Dead records (evicted, overwritten, cleared) are
//! reclaimed: a segment with nothing live is deleted at once, and a segment is compacted (its live
//! records rewritten at the head) and then deleted when the log needs the room, before it reaches
//! its capacity (see "Disk use"). At `init` the log is scanned and the index
//! rebuilt (torn or corrupt tails dropped, every record's CRC verified), so a restarted node
//! announces its keys in the full sync that follows registration. Every read is CRC-checked: a
//! corrupt record is a miss, a `Remove` for the master and a counted medium event, never wrong bytes.
//!
//! Background work runs on two threads every `reaper_interval`: the reaper proper expires slots
//! and read leases (metadata only, never drive IO), and the log thread deletes dead segments,
//! writes tombstones, compacts when the room is needed and syncs when due. A slow or stuck drive therefore
//! delays reclamation, never expiry. "Reaper pass" below means the log thread's pass for drive work.
//!
//! Drive IO goes through one of two engines chosen by [`IoEngineKind`]: `psync` (`preadv` /
//! `pwritev`, the portable default) or `io_uring` (a batch of records in one submission; for large
//! batches the CRC is computed while the drive works: values go out before their headers, and reads
//! arrive in chunks checked as they land). Otherwise the records a batch reserved side by side go
//! out as one write. io_uring keeps at most
//! [`SsdConfigBuilder::io_uring_rings`] rings (default 8), the staging arena registered with each
//! once; a batch that finds them all busy waits for one. Both use `O_DIRECT` where the directory's filesystem
//! allows it (probed) and buffered IO otherwise. A segment's blocks are allocated when it is
//! created (`fallocate`, keeping the file's size), so a lone writer appends into blocks already
//! there — ext4's cheapest path for `O_DIRECT` writes to new space; once a write finds another
//! caller's write in flight in its segment (or io_uring writes a large batch's values and headers
//! side by side), the file's size is raised to the whole segment, so neighbouring writes no longer
//! queue behind each other as appends do.
//!
//! # Durability
//! What a restart recovers, exactly (the process-crash case is pinned by `tests/crash_restart.rs`):
//!
//! - **A commit returns once its record's write has completed** — into the device with `O_DIRECT`
//!   (possibly only its volatile write cache), into the page cache otherwise. Nothing is synced per
//!   commit.
//! - **The hole rule.** Concurrent commits reserve neighbouring places in a segment and write them
//!   concurrently. The start-up scan of a segment stops at the first place that holds no valid
//!   header (zeroes of a write that never happened, a torn or failed write) and drops every record
//!   after it *in that segment* — acknowledged or not. Holes are not skipped: nothing after one can
//!   be trusted to start on a record boundary. A segment whose write failed is sealed at once, so
//!   no later commit lands behind a known hole.
//! - **Process crash** (SIGKILL, abort, OOM kill; the kernel keeps running): every record whose
//!   commit returned is recovered, unless it lies behind a hole — a write to the same segment that
//!   was reserved before it and had not completed when the process died. A node that dies with
//!   commits in flight can therefore lose acknowledged records of the segments those commits were
//!   writing. Evictions whose tombstone was not written yet (the reaper writes them each pass, and
//!   `shutdown` does) come back, with bytes that pass their CRC.
//! - **Power loss or kernel crash**: only what was synced survives. The reaper `fdatasync`s every
//!   segment written since its last sync every [`SsdConfigBuilder::sync_interval`] (default 1 s;
//!   checked on each reaper pass), [`SsdBackend::sync`] does it on demand and `shutdown` syncs
//!   everything; the directory is `fsync`ed after every segment file is created or deleted. A
//!   record survives a power loss if a sync that started after its commit returned completed before
//!   the power went (and the hole rule spares it: every write of the segment reserved before it had
//!   completed by that sync). Records acknowledged since the last completed sync — up to about
//!   `sync_interval` plus a reaper interval of them — may be lost: the unsynced parts of a
//!   segment read back as zeroes (preallocated blocks) or lie past its end (a size not yet synced),
//!   so the scan stops at the first lost record of each segment, dropping the rest of that segment.
//! - Whatever survives is CRC-checked: a torn record is dropped, never served.
//! - **Memory and recovery agree on which record of a key is live**: recovery keeps the one with
//!   the highest seq (taken when a commit reserves its place, or when an eviction is made), so a
//!   commit of a key waits while another batch is writing a record of the same key; it then finds
//!   the key owned and loses (the first commit wins, as the interface says) without writing. Two
//!   records of one key are therefore never in flight together, and every record published is
//!   newer than every tombstone of its key.
//!
//! # Disk use
//! The segment files of all directories together stay within `capacity_bytes` plus a headroom of
//! [`SsdConfig::disk_headroom_bytes`] = (number of directories + 1) × `segment_bytes` (each
//! directory's preallocated active segment, and the segment being compacted while its records are
//! rewritten), as long as the reaper keeps up (as many segments compacted per reaper pass as the
//! writers' pace needs, up to 16; pinned by the tests
//! `repeated_overwrite_and_eviction_keep_the_log_within_capacity_plus_headroom` and
//! `bursts_between_passes_keep_the_log_within_capacity_plus_headroom`). What keeps it:
//!
//! - The after-commit eviction watches the values' page-rounded bytes **plus their records'
//!   overhead** (header block, 4 KiB padding), so live records on the drive, not only values, stay
//!   between the watermarks. (The advertised `available_bytes` counts values only.)
//! - Compaction is paced by need, not by how much is dead: moving live records takes drive
//!   bandwidth from puts and gets, so dead records stay until the room is wanted. Each log pass
//!   measures how much the writers (commits and tombstones, not compaction's own copies) appended
//!   since the last pass; compaction runs once the segment files plus that expected growth (in
//!   whole segments) would pass the capacity plus one segment per directory. It then compacts the
//!   most wasteful sealed segment at least `reclaim_dead_ratio` dead, or else the oldest, whatever
//!   its dead share (a circular log: tombstones, a 4 KiB-aligned record each, 8 KiB for a short
//!   key, retire as the segments their horizon covers go), segment after segment until the room
//!   is there, up to two per segment of expected growth (a segment at least half dead frees half
//!   a segment) and 16 a pass.
//! - Tombstones in force are live records the watermarks do not count. With values of a page of
//!   1 MiB or more they are noise; with pages near 4 KiB, where a tombstone is as large as the
//!   record it hides, many evictions in a short time can keep the log above the bound until their
//!   horizons pass.
//! - `init` warns when a directory's filesystem has less free space (its own segments counted)
//!   than its share of the capacity plus its share of the headroom.
//!
//! Every segment file keeps a file descriptor open while it exists, so `init` refuses a
//! configuration whose worst case ([`SsdConfig::max_open_files`]: the capacity plus the headroom in
//! segments, a lock per directory, the io_uring rings) passes the process's open-file limit; 4 TiB
//! in 256 MiB segments needs about 16 400 descriptors.
//!
//! One medium per directory: `init` takes an exclusive `flock` on `.umbp-ssd.lock` in each
//! directory and holds it until `shutdown` (or the process ends), so a second medium on a directory
//! in use — in this process or another — fails its `init` with an error naming the directory.
//!
//! # Owns
//! The staging arena and its registration, the drive log and its index, slots, counted read leases, the
//! medium's LRU and the event outbox.
//!
//! # Never
//! Moves bytes to or from a peer or names a transfer engine: `init` receives only a
//! [`MemoryRegistrar`](umbp_core::MemoryRegistrar). Never holds its lock across drive IO: every call
//! takes what it needs under the lock, does the IO without it and re-checks afterwards. This crate
//! may not depend on the transfer layer, the peer, the master, tonic or tokio (`cargo xtask ci`
//! checks it: `[package.metadata.umbp] layer = "backend"`).
//!
//! # Reads release their staging pages; exhaustion is busy
//! A resolve's staged copy is held under a **counted** read lease: each hit adds a reader, and
//! [`release_reads`](umbp_core::MediumBackend::release_reads) (sent by the reader once its copy is
//! done) removes one; the last release ends the lease at once, so the copy's pages serve the next
//! read or write instead of sitting out the whole read lease. The lease's expiry stays the safety
//! net for a reader that died. A key dropped while a reader holds its copy keeps its pages until
//! that last release (or the expiry).
//!
//! A resolve that finds its key but no free staging page (every page pending or leased) answers
//! **busy** ([`ResolvedEntry::busy`](umbp_core::ResolvedEntry::busy)), never a miss: the key is
//! here, and the reader waits (bounded backoff) and asks this node again. So is a resolve that gave
//! up following another reader's drive read of the key. It is counted
//! (`umbp_backend_medium_events_total{event="staging_slot_full_reject"}`) and pinned by the test
//! `resolve_with_every_staging_page_leased_is_busy_not_a_miss`. The default arena
//! (`staging_pages` 128) stages a 128-key batch of single-page values at once; a larger batch is
//! served in rounds as its readers release.
//!
//! Writes likewise: an allocation the drive log has room for but no staging page is free for
//! (every page held by pending slots of writes in flight and by readers) answers
//! [`AllocateOutcome::Busy`](umbp_core::AllocateOutcome::Busy), never `FailedNoSpace`, and reserves
//! nothing; the writer commits the slots it got and asks this node again, so a batch put larger
//! than the arena goes through it in rounds. `FailedNoSpace` means the drive is full (after the
//! medium's own eviction, when it has watermarks). Counted as
//! `umbp_backend_medium_events_total{event="staging_allocate_busy"}` and
//! [`SsdStats::staging_busy_allocations`]; pinned by
//! `allocate_with_every_staging_page_held_is_busy_while_a_full_drive_is_no_space`.
//!
//! # Deliberate differences from the reference
//! - Values may span up to [`SsdConfigBuilder::max_value_pages`] pages (default 1, the reference's
//!   one key = one page); larger values are `Failed`, never `FailedNoSpace`.
//! - The drive contents survive a restart (the reference wipes them). An eviction is logged as a
//!   tombstone record (written by the reaper, and at `shutdown`), which stays in force while any
//!   segment that may hold an older record of its key exists; a restart therefore brings back no
//!   evicted key — unless the process died before the tombstone was written, in which case the key
//!   comes back with bytes that pass their CRC. `clear_local` deletes the whole log.
//! - Dead space is reclaimed; the reference never compacts.
//! - `clear_local` keeps leased staging pages until their lease ends or their last reader releases
//!   them (the reference frees them at once, under a reader's feet).
//! - A resolve with no free staging page answers busy, not a miss, and readers release their
//!   staging pages when their copy is done (the reference holds them for the whole lease and
//!   answers exhaustion as a miss). An allocation with no free staging page answers busy, not no
//!   space (the reference's writer then tried another node, or failed).
//!
//! # Platforms
//! Linux only (`O_DIRECT`, `preadv`/`pwritev`, io_uring and the host staging source).

mod backend;
mod config;
mod io;
mod record;
mod staged;
mod store;

pub use backend::{SsdBackend, SsdStats};
pub use config::{IoEngineKind, SsdConfig, SsdConfigBuilder, SsdConfigError, SsdSettings, Watermarks};

/// Builds an SSD medium and returns it as the interface (only the composition root names concrete
/// backends).
pub fn make_ssd_backend(config: SsdConfig) -> Box<dyn umbp_core::MediumBackend> {
    Box::new(SsdBackend::new(config))
}

/// Whether this process may use io_uring (`Err` carries why not: ENOSYS, EPERM, …). Tests and the
/// command line use it to skip or refuse the `io_uring` engine with a clear message.
pub fn io_uring_available() -> std::io::Result<()> {
    io::make_engine(IoEngineKind::IoUring, 8, 1).map(|_| ())
}
