//! The reader's and writer's side: connect to a same-host holder, authenticate, map its regions.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustix::mm::{Advice, MapFlags, ProtFlags};

use super::epochs::{EpochTable, check_backing};
use super::wire::{self, Status};
use super::{Refusal, ShmError, socket_name, stream};

/// Settings of a [`ShmClient`].
#[derive(Debug, Clone)]
pub struct ShmClientConfig {
    /// The cluster token to present.
    pub token: Vec<u8>,
    /// The timeout of each socket call. Default: 5 s.
    pub io_timeout: Duration,
    /// Fill each new mapping's page tables on a background thread (`populate_in_background`), so
    /// copies do not fault page by page. Default: on.
    pub populate: bool,
}

impl ShmClientConfig {
    /// Defaults with cluster token `token`.
    pub fn new(token: impl Into<Vec<u8>>) -> Self {
        Self { token: token.into(), io_timeout: Duration::from_secs(5), populate: true }
    }
}

/// One authenticated connection to a holder's server.
#[derive(Debug)]
struct Peer {
    stream: Mutex<UnixStream>,
    table: Arc<EpochTable>,
}

/// Connects to holders' shared-memory servers and maps their regions; see the [module docs](super).
///
/// Keeps one connection per holder (its end tells that the holder went away) and one mapping per
/// (holder, region id), replaced when the holder's epoch table no longer names its epoch.
#[derive(Debug)]
pub struct ShmClient {
    config: ShmClientConfig,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    /// Holder endpoint → region id → mapping (nested, so a lookup by `&str` allocates nothing).
    regions: Mutex<HashMap<String, HashMap<u64, Arc<SharedMapping>>>>,
}

impl ShmClient {
    /// A client with no connection yet.
    pub fn new(config: ShmClientConfig) -> Self {
        Self { config, peers: Mutex::new(HashMap::new()), regions: Mutex::new(HashMap::new()) }
    }

    /// The mapping of region `region_id` of the holder whose data endpoint is `endpoint`: the cached
    /// one while its epoch is current, else a fresh one (connecting and authenticating first when
    /// there is no connection). A request lost with a broken connection is sent once more on a new
    /// one; a holder that is gone then fails cleanly ([`ShmError::Io`]).
    pub fn region(&self, endpoint: &str, region_id: u64) -> Result<Arc<SharedMapping>, ShmError> {
        {
            let mut regions = self.regions.lock();
            if let Some(held) = regions.get_mut(endpoint) {
                match held.get(&region_id) {
                    Some(mapping) if mapping.is_current() => return Ok(Arc::clone(mapping)),
                    // Stale: unmapped once its last user lets go.
                    Some(_) => {
                        held.remove(&region_id);
                    }
                    None => {}
                }
            }
        }
        let mapping = match self.fetch(endpoint, region_id) {
            Err(ShmError::Io { .. }) => {
                self.forget_peer(endpoint);
                self.fetch(endpoint, region_id)?
            }
            other => other?,
        };
        let mapping = Arc::new(mapping);
        if self.config.populate {
            populate_in_background(&mapping);
        }
        self.regions.lock().entry(endpoint.to_owned()).or_default().insert(region_id, Arc::clone(&mapping));
        Ok(mapping)
    }

    /// Drops the cached mapping of one region (it is unmapped when its last user lets go).
    pub fn evict(&self, endpoint: &str, region_id: u64) {
        if let Some(held) = self.regions.lock().get_mut(endpoint) {
            held.remove(&region_id);
        }
    }

    /// Drops the connection to a holder and every mapping of its regions.
    pub fn forget_peer(&self, endpoint: &str) {
        self.peers.lock().remove(endpoint);
        // Unmapped (when no copy holds them) after the lock is released.
        let held = self.regions.lock().remove(endpoint);
        drop(held);
    }

    /// Drops every connection and every mapping (unmapped when no copy holds them).
    pub fn clear(&self) {
        self.peers.lock().clear();
        let held = std::mem::take(&mut *self.regions.lock());
        drop(held);
    }

    /// Drops every mapping whose epoch is no longer current and every connection the holder closed
    /// (with that holder's mappings); returns how many mappings were dropped.
    ///
    /// This is what returns a dead or deregistered holder's memory to the system: a mapping keeps
    /// the pages of the holder's file alive (a crashed node's whole arena would stay resident in
    /// every reader that mapped it) until the last process unmaps it. The `PoolClient` calls it
    /// periodically and whenever it finds a holder's connection dead. It never waits: a
    /// connection busy with a request right now is checked at the next sweep, and no lock is held
    /// while the dropped mappings are unmapped (a large `munmap` takes a while).
    pub fn sweep(&self) -> usize {
        let peers: Vec<(String, Arc<Peer>)> =
            self.peers.lock().iter().map(|(e, p)| (e.clone(), Arc::clone(p))).collect();
        let gone: Vec<String> = peers
            .into_iter()
            .filter(|(_, p)| p.stream.try_lock().is_some_and(|s| hung_up(&s)))
            .map(|(e, _)| e)
            .collect();
        {
            let mut held = self.peers.lock();
            for endpoint in &gone {
                held.remove(endpoint);
            }
        }
        // Dropped after the lock is released: the last `Arc` of each unmaps it.
        let mut dropped: Vec<Arc<SharedMapping>> = Vec::new();
        self.regions.lock().retain(|peer, held| {
            if gone.contains(peer) {
                dropped.extend(held.drain().map(|(_, m)| m));
                return false;
            }
            held.retain(|_, m| {
                let keep = m.is_current();
                if !keep {
                    dropped.push(Arc::clone(m));
                }
                keep
            });
            !held.is_empty()
        });
        let n = dropped.len();
        if n > 0 {
            tracing::debug!(mappings = n, holders_gone = gone.len(), "shared-memory sweep unmapped stale mappings");
        }
        n
    }

    /// Mappings cached now.
    pub fn cached_regions(&self) -> usize {
        self.regions.lock().values().map(HashMap::len).sum()
    }

    /// Connections held now (one per holder, open or not yet found closed).
    pub fn peer_count(&self) -> usize {
        self.peers.lock().len()
    }

    /// Whether a connection to `endpoint` was made and not forgotten (open or not).
    pub fn has_peer(&self, endpoint: &str) -> bool {
        self.peers.lock().contains_key(endpoint)
    }

    /// Whether the connection to `endpoint` is open and the holder has not closed it.
    pub fn connected(&self, endpoint: &str) -> bool {
        self.peers.lock().get(endpoint).is_some_and(|p| !hung_up(&p.stream.lock()))
    }

    /// Makes sure a live, authenticated connection to `endpoint`'s server exists: one the holder
    /// closed is forgotten first (with every mapping of that holder: a restarted holder at the same
    /// endpoint is another process, whose regions the old mappings are not), then a new one is
    /// made when there is none.
    pub fn connect(&self, endpoint: &str) -> Result<(), ShmError> {
        if self.has_peer(endpoint) && !self.connected(endpoint) {
            self.forget_peer(endpoint);
            // A holder found dead: others may be too; unmap what they leave behind now.
            self.sweep();
        }
        self.peer(endpoint).map(|_| ())
    }

    fn peer(&self, endpoint: &str) -> Result<Arc<Peer>, ShmError> {
        if let Some(peer) = self.peers.lock().get(endpoint) {
            return Ok(Arc::clone(peer));
        }
        let peer = Arc::new(self.handshake(endpoint)?);
        self.peers.lock().insert(endpoint.to_owned(), Arc::clone(&peer));
        Ok(peer)
    }

    fn handshake(&self, endpoint: &str) -> Result<Peer, ShmError> {
        let io = |context| move |source| ShmError::Io { peer: endpoint.to_owned(), context, source };
        let name = socket_name(endpoint)?;
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(io("naming the socket"))?;
        let mut stream = UnixStream::connect_addr(&addr).map_err(io("connecting"))?;
        stream.set_read_timeout(Some(self.config.io_timeout)).map_err(io("setting a timeout"))?;
        stream.set_write_timeout(Some(self.config.io_timeout)).map_err(io("setting a timeout"))?;
        let hello = wire::encode_hello(&self.config.token).map_err(|e| ShmError::Invalid(e.to_string()))?;
        wire::send_with_fd(&mut stream, &hello, None).map_err(io("sending the hello"))?;
        let mut reply = [0u8; wire::HELLO_REPLY_LEN];
        let file = wire::recv_with_fd(&mut stream, &mut reply).map_err(io("reading the hello reply"))?;
        let (status, slots, _server_id) = wire::decode_hello_reply(&reply);
        let refused = |reason| ShmError::Refused { peer: endpoint.to_owned(), reason };
        match Status::from_byte(status) {
            Some(Status::Ok) => {}
            Some(Status::BadToken) => return Err(refused(Refusal::Token)),
            Some(Status::Forbidden) => return Err(refused(Refusal::Credentials)),
            Some(Status::BadRequest) => return Err(refused(Refusal::Hello)),
            _ => return Err(protocol(endpoint, format!("hello answered with status {status}"))),
        }
        let file = file.ok_or_else(|| protocol(endpoint, "no epoch table with the hello reply".into()))?;
        let table = EpochTable::open(&file, slots).map_err(io("mapping the epoch table"))?;
        Ok(Peer { stream: Mutex::new(stream), table: Arc::new(table) })
    }

    /// Asks `endpoint` for region `region_id` and maps it.
    fn fetch(&self, endpoint: &str, region_id: u64) -> Result<SharedMapping, ShmError> {
        let peer = self.peer(endpoint)?;
        let io = |context| move |source| ShmError::Io { peer: endpoint.to_owned(), context, source };
        let (status, reply, file) = {
            let mut stream = peer.stream.lock();
            wire::send_with_fd(&mut stream, &wire::encode_request(region_id), None).map_err(io("sending a request"))?;
            let mut bytes = [0u8; wire::REGION_REPLY_LEN];
            let file = wire::recv_with_fd(&mut stream, &mut bytes).map_err(io("reading a region reply"))?;
            let (status, reply) = wire::decode_region_reply(&bytes);
            (status, reply, file)
        };
        match Status::from_byte(status) {
            Some(Status::Ok) => {}
            Some(Status::UnknownRegion) => {
                return Err(ShmError::UnknownRegion { peer: endpoint.to_owned(), region_id });
            }
            _ => return Err(protocol(endpoint, format!("region request answered with status {status}"))),
        }
        let file = file.ok_or_else(|| protocol(endpoint, "no file with a region reply".into()))?;
        if reply.epoch == 0 || reply.slot >= peer.table.slots() {
            return Err(protocol(endpoint, format!("region reply {reply:?} outside the epoch table")));
        }
        // Never trust a file to be as long as promised: a mapping past its end would fault.
        check_backing(&file, reply.offset, reply.len).map_err(|e| protocol(endpoint, e.to_string()))?;
        let mapping = SharedMapping::map(
            endpoint,
            region_id,
            &file,
            reply.offset,
            reply.len,
            reply.epoch,
            reply.slot,
            Arc::clone(&peer.table),
        )
        .map_err(io("mapping a region"))?;
        if !mapping.is_current() {
            return Err(ShmError::Stale { peer: endpoint.to_owned(), region_id });
        }
        Ok(mapping)
    }
}

fn protocol(endpoint: &str, reason: String) -> ShmError {
    ShmError::Protocol { peer: endpoint.to_owned(), reason }
}

/// Whether the other end closed `stream` (a holder that exited or shut its server), without waiting.
fn hung_up(stream: &UnixStream) -> bool {
    let mut fds = [rustix::event::PollFd::new(stream, rustix::event::PollFlags::RDHUP)];
    match rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })) {
        Ok(0) => false,
        Ok(_) => !fds[0].revents().is_empty(),
        Err(_) => true,
    }
}

/// Bytes one populate step covers. The populating thread holds the mapping only for one step at a
/// time, so a sweep or an eviction unmaps it at most one step later. Small, because a step holds
/// the process's `mmap_lock` for reading while it faults the pages in, and every `mmap` and
/// `munmap` of the process (a large allocation, a buffer freed, the exit's unmapping) waits for the
/// step to end: 64 MiB steps (16,384 faults) held a one-shot `umbp get` on the 2-core VM ~19 ms at
/// its exit, 37 ms in all against 4 ms before the populating.
const POPULATE_STEP: usize = 2 << 20;

/// How long a fresh mapping waits before its page tables are filled. A one-shot client (`umbp
/// get`) copies one value and exits within a few ms; populating a 512 MiB mapping beside it took
/// two thirds of its CPU time on two cores and its exit's `munmap` tore the page tables down again
/// (p50 14.5 ms against 4 ms). A client that stays gets its mappings populated shortly after.
const POPULATE_DELAY: Duration = Duration::from_millis(200);

/// Fills the page tables of a fresh mapping on a thread of its own, step by step
/// (`MADV_POPULATE_WRITE`: every page mapped writable, no byte touched). Without it every 4 KiB page
/// of the mapping costs the first copy into or out of it a page fault (shared memory files get no
/// huge pages unless the host enables shmem THP): measured on the 2-core VM, a single 1 MiB put
/// through an unpopulated mapping took p50 789 µs, populated 519 µs, TCP 735 µs. The price is page
/// tables, ~2 MiB per GiB mapped, which a reader that touches the whole region pays anyway; the
/// holder's pages themselves exist already (it prefaults its medium) or are its lent memory. A
/// kernel without `MADV_POPULATE_WRITE` (before 5.14), or any failure, only ends the populating.
fn populate_in_background(mapping: &Arc<SharedMapping>) {
    let weak = Arc::downgrade(mapping);
    let spawned = std::thread::Builder::new().name("umbp-shm-populate".into()).spawn(move || {
        std::thread::sleep(POPULATE_DELAY);
        let mut offset = 0usize;
        loop {
            let Some(m) = weak.upgrade() else { return };
            if offset >= m.map_len || !m.is_current() {
                return;
            }
            let len = POPULATE_STEP.min(m.map_len - offset);
            // SAFETY: `[offset, offset + len)` lies inside the mapping, which `m` keeps mapped for the
            // call; populating changes no byte of it.
            let done = unsafe { rustix::mm::madvise(m.map_base.add(offset).as_ptr().cast(), len, Advice::LinuxPopulateWrite) };
            if let Err(e) = done {
                tracing::debug!(peer = %m.peer, region = m.region_id, error = %e, "stopped populating a shared mapping");
                return;
            }
            offset += len;
        }
    });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "could not start populating a shared mapping; its pages fault in on first use");
    }
}

/// A holder's region mapped into this process (`MAP_SHARED`, read-write), valid memory for as long
/// as this value lives — even after the holder deregistered the region or exited, since the mapping
/// keeps the pages — but **current** only while the holder's epoch table names its epoch. Unmapped
/// on drop.
#[derive(Debug)]
pub struct SharedMapping {
    peer: String,
    region_id: u64,
    /// The start of the mapping (page-aligned, at or before the region).
    map_base: NonNull<u8>,
    map_len: usize,
    /// Where the region starts in the mapping.
    delta: usize,
    len: u64,
    epoch: u64,
    slot: u32,
    table: Arc<EpochTable>,
}

// SAFETY: the mapping is plain shared memory owned by this value; it has no thread affinity.
unsafe impl Send for SharedMapping {}
// SAFETY: `&self` methods only read the epoch atomically and copy bytes into or out of caller
// buffers; concurrent writers are other processes in any case, which no Rust type can exclude.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    #[expect(clippy::too_many_arguments, reason = "one call site; the fields of a region reply")]
    fn map(
        peer: &str,
        region_id: u64,
        file: &OwnedFd,
        offset: u64,
        len: u64,
        epoch: u64,
        slot: u32,
        table: Arc<EpochTable>,
    ) -> io::Result<Self> {
        let page = rustix::param::page_size() as u64;
        let aligned = offset - offset % page;
        let delta = offset - aligned;
        let map_len = usize::try_from(delta + len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: a null hint and no MAP_FIXED: a fresh range. `check_backing` found the file at
        // least `offset + len` bytes long and sealed against shrinking, so every mapped page stays
        // backed (no SIGBUS) for the mapping's life.
        let ptr = unsafe {
            rustix::mm::mmap(
                ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                file.as_fd(),
                aligned,
            )
        }?;
        let map_base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        // The holder advises its own mapping the same way. Where the host lets shared memory have
        // huge pages only when asked (`shmem_enabled` = `advise`), a reader's mapping without the
        // advice maps the holder's 2 MiB pages with 4 KiB entries: ~2 MiB of page tables per GiB
        // mapped instead of ~4 KiB (copy speed measured the same either way on the 2-core VM).
        // Elsewhere the advice changes nothing; a refusal (a kernel without THP) leaves 4 KiB
        // pages, which work.
        // SAFETY: the range is the mapping just made; advice changes no byte of it.
        if let Err(e) = unsafe { rustix::mm::madvise(ptr, map_len, Advice::LinuxHugepage) } {
            tracing::debug!(peer, region = region_id, error = %e, "madvise(MADV_HUGEPAGE) of a shared mapping failed");
        }
        Ok(Self { peer: peer.to_owned(), region_id, map_base, map_len, delta: delta as usize, len, epoch, slot, table })
    }

    /// The holder's data endpoint.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// The region's id on the holder.
    pub fn region_id(&self) -> u64 {
        self.region_id
    }

    /// The region's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty (never: the server refuses empty regions).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The registration this mapping is of.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether the holder still has the region registered under this mapping's epoch.
    pub fn is_current(&self) -> bool {
        self.table.load(self.slot) == self.epoch
    }

    /// The region's first byte in this process; valid for [`len`](Self::len) bytes while `self`
    /// lives. Bytes read through it are only good if [`is_current`](Self::is_current) held before
    /// and after the read.
    pub fn as_ptr(&self) -> NonNull<u8> {
        // SAFETY: `delta < page size <= map_len`, inside the mapping.
        unsafe { self.map_base.add(self.delta) }
    }

    /// Copies `dst.len()` bytes from `offset` of the region into `dst`; [`ShmError::Stale`] when the
    /// region was not current before or after the copy (the bytes in `dst` are then not to be used).
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), ShmError> {
        let src = self.range(offset, dst.len())?;
        self.check_current()?;
        // SAFETY: `range` checked `offset + len <= self.len`, inside the live mapping; `dst` is a
        // distinct buffer of this process. Another process may write the bytes meanwhile: the epoch
        // check below and the holder's leases decide whether they are good, not the copy.
        unsafe { ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        self.check_current()
    }

    /// As [`read_at`](Self::read_at), with stores that stream past the cache (`stream`): for a
    /// batch larger than the cache keeps, whose destination lines ordinary stores would each first
    /// read from memory. `seen` runs over the region's bytes just copied, while the copy's loads
    /// have left them in this core's cache, and before the epoch is checked again: bytes of a
    /// region the holder deregistered meanwhile fail as stale, summed or not.
    pub(crate) fn read_streamed_at(
        &self,
        offset: u64,
        dst: &mut [u8],
        seen: impl FnOnce(&[u8]),
    ) -> Result<(), ShmError> {
        let src = self.range(offset, dst.len())?;
        self.check_current()?;
        // SAFETY: as in `read_at`.
        unsafe { stream::copy(dst.as_mut_ptr(), src, dst.len()) };
        // SAFETY: inside the live mapping (`range`). The holder's read lease keeps these bytes
        // unwritten while a reader holds it; a holder that broke that would make the sum disagree
        // with the writer's (a reported corruption), and the epoch check below catches a region
        // reused meanwhile.
        seen(unsafe { std::slice::from_raw_parts(src, dst.len()) });
        self.check_current()
    }

    /// Copies `src` to `offset` of the region, with stores that stream past the cache (the holder
    /// does not read a value it stores; `stream`); [`ShmError::Stale`] when the region was not
    /// current before or after the copy (the write must then be treated as failed).
    pub fn write_at(&self, offset: u64, src: &[u8]) -> Result<(), ShmError> {
        let dst = self.range(offset, src.len())?;
        self.check_current()?;
        // SAFETY: as in `read_at`, the other way round; the mapping is read-write.
        unsafe { stream::copy(dst, src.as_ptr(), src.len()) };
        self.check_current()
    }

    fn range(&self, offset: u64, len: usize) -> Result<*mut u8, ShmError> {
        let out_of_range = || ShmError::OutOfRange { offset, len: len as u64, region_len: self.len };
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.len => {}
            _ => return Err(out_of_range()),
        }
        let offset = usize::try_from(offset).map_err(|_| out_of_range())?;
        // SAFETY: `offset + len <= self.len`, checked above, so the pointer stays in the mapping.
        Ok(unsafe { self.as_ptr().as_ptr().add(offset) })
    }

    fn check_current(&self) -> Result<(), ShmError> {
        if self.is_current() {
            Ok(())
        } else {
            Err(ShmError::Stale { peer: self.peer.clone(), region_id: self.region_id })
        }
    }
}

#[cfg(test)]
impl SharedMapping {
    /// A mapping of `file`'s first `len` bytes as region 1, current while slot `slot` of `table`
    /// holds `epoch`: a holder's region without a holder, for the copy loops' unit tests.
    pub(crate) fn for_tests(
        file: &OwnedFd,
        len: u64,
        table: Arc<EpochTable>,
        slot: u32,
        epoch: u64,
    ) -> io::Result<Self> {
        Self::map("test", 1, file, 0, len, epoch, slot, table)
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping of `map_len` bytes, unmapped once; no reference into it outlives
        // `self` (`as_ptr`'s contract).
        if let Err(err) = unsafe { rustix::mm::munmap(self.map_base.as_ptr().cast(), self.map_len) } {
            tracing::error!(peer = %self.peer, error = %err, "munmap of a shared region failed");
        }
    }
}
