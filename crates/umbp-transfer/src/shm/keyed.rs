//! [`SharedReads`]: the shared-memory half of a keyed get (`KeyedClient::get_shared`) or put
//! (`KeyedClient::put_shared`). The holder's
//! data server answers a same-host client's GET_KEY with where the value lies in its regions (a
//! `MAPPED` descriptor, see the TCP `protocol` module) and keeps the read lease open; this copies
//! the ranges out of the client's mappings of those regions, checking every rule that makes the
//! bytes the value:
//!
//! - **the lease covers the copy**: the caller keeps the bytes only when the copy ended within the
//!   lease's length (`lease_ns`, which the holder measures from when it *received* the request) of
//!   when the caller *sent* the request. No clock is shared: the send precedes the receipt, and both
//!   processes' `CLOCK_MONOTONIC` advance at the same rate — they run on one kernel, and a time
//!   namespace only adds a constant offset to a clock, never changes its rate — so the copy's end,
//!   in the holder's time, is before the lease's end. (Comparing two processes' `Instant`s directly
//!   would need the same offset, which time namespaces break; this rule needs none.)
//! - **a stale mapping is never read**: each range is copied with
//!   [`SharedMapping::read_at`], which checks the region's epoch before and after the copy; and the
//!   holder's connection is checked after its answer arrived (a holder that answered is alive, so a
//!   hung-up connection belongs to a dead predecessor at the same endpoint, whose mappings are
//!   dropped before any is used).
//! - **no SIGBUS**: every mapping is of a file sealed against shrinking (see the module docs of
//!   [`shm`](super)), so a holder stopped, killed or deregistering mid-copy leaves valid memory.
//! - **a put's bytes are committed only in time**: [`copy_in`](SharedReads::copy_in) writes a
//!   keyed put's value into the slot the holder allocated, through the same mappings (epochs
//!   checked likewise); the holder commits when the client's settle frame arrives before the
//!   slot's end — the bytes were all written before the settle left — and aborts otherwise.
//! - **any doubt takes TCP**: a region the client cannot map (not shareable, such as an SSD staging
//!   arena; a refused handshake) or one that went stale makes the caller ask the holder for the bytes
//!   over the same exchange, under the same lease.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::fanout::{Piece, Source, Target};
use super::{SharedMapping, ShmClient, ShmClientConfig, ShmError};

/// How long a holder without a usable shared path is asked for bytes instead.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// The keyed client's mappings of same-host holders' regions, and a memory of holders without a
/// shared path (see the module docs).
#[derive(Debug)]
pub(crate) struct SharedReads {
    client: Arc<ShmClient>,
    /// Holder endpoint → until when it is asked for bytes only.
    refused: Mutex<HashMap<String, Instant>>,
    gets: AtomicU64,
    puts: AtomicU64,
    bytes: AtomicU64,
}

impl SharedReads {
    /// No connection yet; the handshake presents `token`.
    pub(crate) fn new(token: &[u8], io_timeout: Duration) -> Self {
        let config = ShmClientConfig { io_timeout, ..ShmClientConfig::new(token) };
        Self::with_client(Arc::new(ShmClient::new(config)))
    }

    /// Over `client`, shared with the process's other users of the shared path (the engine's
    /// batches): one connection and one mapping per holder region in all.
    pub(crate) fn with_client(client: Arc<ShmClient>) -> Self {
        Self {
            client,
            refused: Mutex::new(HashMap::new()),
            gets: AtomicU64::new(0),
            puts: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    /// Whether to offer `endpoint` a `MAPPED` answer now: it is not remembered as pathless, and a
    /// live connection to its shared-memory server exists (made now when there is none; a holder
    /// on another host, or with the path off, has no server here and is remembered).
    pub(crate) fn usable(&self, endpoint: &str) -> bool {
        {
            let mut refused = self.refused.lock();
            match refused.get(endpoint) {
                Some(&until) if Instant::now() < until => return false,
                Some(_) => {
                    refused.remove(endpoint);
                }
                None => {}
            }
        }
        match self.client.connect(endpoint) {
            Ok(()) => true,
            Err(error) => {
                tracing::debug!(peer = endpoint, %error, "no shared path for keyed gets; using TCP for a while");
                self.remember(endpoint);
                false
            }
        }
    }

    /// Leaves `endpoint` to the TCP bytes for a while.
    pub(crate) fn remember(&self, endpoint: &str) {
        self.refused.lock().insert(endpoint.to_owned(), Instant::now() + RETRY_AFTER);
    }

    /// Copies the value the ranges `(region id, offset, len)` of `endpoint`'s regions hold, in
    /// order, to `dst`. `Err`: nothing in `dst` is to be used (the caller asks for the bytes).
    ///
    /// # Safety
    /// As [`Copier::copy`].
    pub(crate) unsafe fn copy(
        &self,
        endpoint: &str,
        ranges: &[(u64, u64, u64)],
        dst: NonNull<u8>,
    ) -> Result<u64, ShmError> {
        // SAFETY: this function's contract is the copier's.
        unsafe { self.copier(endpoint)?.copy(ranges, dst) }
    }

    /// Copies `src` into the ranges `(region id, offset, len)` of `endpoint`'s regions, in order
    /// (a keyed put's slot; the holder commits it when told). `Err`: the slot must not be committed
    /// as written (the caller sends the bytes instead).
    pub(crate) fn copy_in(&self, endpoint: &str, ranges: &[(u64, u64, u64)], src: &[u8]) -> Result<u64, ShmError> {
        self.copier(endpoint)?.copy_in(ranges, src)
    }

    /// The copies of one answer of `endpoint` (a keyed exchange, or every key of a batch): checks
    /// the holder's connection once, here. The holder answered, so it is alive: a connection it
    /// closed is a predecessor's, and its mappings are dropped before any is used. Once per batch,
    /// not per key: the check is a `poll` and a few locks of the process-wide client, which 16
    /// threads copying 64 KiB values would otherwise take ~1,000 times per 64 MiB batch.
    pub(crate) fn copier(&self, endpoint: &str) -> Result<Copier<'_>, ShmError> {
        self.client.connect(endpoint).inspect_err(|_| self.remember(endpoint))?;
        Ok(Copier { reads: self, endpoint: endpoint.to_owned(), held: Vec::new(), gets: 0, puts: 0, bytes: 0 })
    }

    /// Keyed gets and puts whose bytes were copied through a mapping, and those bytes.
    pub(crate) fn copied(&self) -> (u64, u64, u64) {
        (self.gets.load(Ordering::Relaxed), self.puts.load(Ordering::Relaxed), self.bytes.load(Ordering::Relaxed))
    }

    /// Drops the connection to `endpoint` and its mappings (it went away).
    pub(crate) fn forget(&self, endpoint: &str) {
        self.client.forget_peer(endpoint);
    }
}

/// The copies of one answer of a holder: see [`SharedReads::copier`]. Keeps the mappings it used
/// (a batch's values usually lie in one region) and adds its counts to the client's when dropped.
pub(crate) struct Copier<'r> {
    reads: &'r SharedReads,
    endpoint: String,
    held: Vec<(u64, Arc<SharedMapping>)>,
    gets: u64,
    puts: u64,
    bytes: u64,
}

impl Copier<'_> {
    /// Copies the value the ranges `(region id, offset, len)` hold, in order, to `dst`. `Err`:
    /// nothing in `dst` is to be used (the caller asks for the bytes).
    ///
    /// # Safety
    /// `dst` is valid for writes of the ranges' total length, and nobody else reads or writes those
    /// bytes until this returns.
    pub(crate) unsafe fn copy(&mut self, ranges: &[(u64, u64, u64)], dst: NonNull<u8>) -> Result<u64, ShmError> {
        let copied = self.each_range(ranges, |mapping, offset, at, len| {
            // SAFETY: `at + len` is at most the ranges' total (the sum of the lens, in order), for
            // which `dst` is valid and ours alone (this function's contract).
            let part = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr().add(at), len) };
            mapping.read_at(offset, part)
        })?;
        self.gets += 1;
        self.bytes += copied;
        Ok(copied)
    }

    /// Copies `src` into the ranges `(region id, offset, len)`, in order (a keyed put's slot).
    /// `Err`: the slot must not be committed as written.
    pub(crate) fn copy_in(&mut self, ranges: &[(u64, u64, u64)], src: &[u8]) -> Result<u64, ShmError> {
        let total = ranges.iter().try_fold(0u64, |t, r| t.checked_add(r.2));
        if total != Some(src.len() as u64) {
            return Err(ShmError::Invalid(format!("slot ranges for a value of {} bytes", src.len())));
        }
        let copied = self.each_range(ranges, |mapping, offset, at, len| {
            let part = src.get(at..at + len).ok_or_else(|| ShmError::Invalid("a range past the value".into()))?;
            mapping.write_at(offset, part)
        })?;
        self.puts += 1;
        self.bytes += copied;
        Ok(copied)
    }

    /// The ranges `(region id, offset, len)` of one value, mapped here, for a copy elsewhere (a
    /// batch's copies fanned out, see `fanout`): the mappings stay valid while the pieces live,
    /// and each copy checks its region's epoch. `Err`: the value is for TCP.
    pub(crate) fn pieces(&mut self, ranges: &[(u64, u64, u64)]) -> Result<Vec<Piece>, ShmError> {
        let targets = self.targets(ranges)?;
        Ok(targets
            .into_iter()
            .map(|t| Piece { source: Source::Mapping(t.mapping), offset: t.offset, len: t.len })
            .collect())
    }

    /// The ranges `(region id, offset, len)` mapped here (a put's slot, for a write elsewhere: a
    /// batch's writes fanned out, see `fanout::write_values`); each write checks its region's
    /// epoch. `Err`: the ranges are not to be copied through the mappings.
    pub(crate) fn targets(&mut self, ranges: &[(u64, u64, u64)]) -> Result<Vec<Target>, ShmError> {
        ranges
            .iter()
            .map(|&(region_id, offset, len)| {
                let mapping = self.mapping(region_id)?;
                let len = usize::try_from(len).map_err(|_| ShmError::OutOfRange {
                    offset,
                    len,
                    region_len: mapping.len(),
                })?;
                Ok(Target { mapping, offset, len })
            })
            .collect()
    }

    /// A copy of [`pieces`](Self::pieces) failed with `error`: a region that went stale is
    /// forgotten, so the next answer maps it afresh.
    pub(crate) fn failed(&mut self, error: &ShmError) {
        if let ShmError::Stale { region_id, .. } = error {
            self.reads.client.evict(&self.endpoint, *region_id);
            self.held.retain(|(id, _)| id != region_id);
        }
    }

    /// Counts a value of `bytes` read through [`pieces`](Self::pieces).
    pub(crate) fn count_get(&mut self, bytes: u64) {
        self.gets += 1;
        self.bytes += bytes;
    }

    /// Counts a value of `bytes` written through [`targets`](Self::targets).
    pub(crate) fn count_put(&mut self, bytes: u64) {
        self.puts += 1;
        self.bytes += bytes;
    }

    /// Runs `copy(mapping, offset in the region, offset in the value, len)` over the ranges, in
    /// order; returns the bytes covered. Each copy checks its region's epoch (`read_at`,
    /// `write_at`), so a mapping kept here that went stale is never read.
    fn each_range(
        &mut self,
        ranges: &[(u64, u64, u64)],
        mut copy: impl FnMut(&SharedMapping, u64, usize, usize) -> Result<(), ShmError>,
    ) -> Result<u64, ShmError> {
        let mut at = 0usize;
        for &(region_id, offset, len) in ranges {
            let mapping = self.mapping(region_id)?;
            let len =
                usize::try_from(len).map_err(|_| ShmError::OutOfRange { offset, len, region_len: mapping.len() })?;
            if let Err(e) = copy(&mapping, offset, at, len) {
                if matches!(e, ShmError::Stale { .. }) {
                    self.reads.client.evict(&self.endpoint, region_id);
                    self.held.retain(|(id, _)| *id != region_id);
                }
                return Err(e);
            }
            at += len;
        }
        Ok(at as u64)
    }

    /// The mapping of `region_id`: the one this copier used last, while current, else the
    /// client's (mapped now when it has none).
    fn mapping(&mut self, region_id: u64) -> Result<Arc<SharedMapping>, ShmError> {
        if let Some((_, m)) = self.held.iter().find(|(id, m)| *id == region_id && m.is_current()) {
            return Ok(Arc::clone(m));
        }
        let mapping = self.reads.client.region(&self.endpoint, region_id).inspect_err(|e| {
            if !matches!(e, ShmError::Stale { .. }) {
                // Not shareable (an SSD staging arena, say), or the server failed: use TCP.
                self.reads.remember(&self.endpoint);
            }
        })?;
        self.held.retain(|(id, _)| *id != region_id);
        self.held.push((region_id, Arc::clone(&mapping)));
        Ok(mapping)
    }
}

impl Drop for Copier<'_> {
    fn drop(&mut self) {
        self.reads.gets.fetch_add(self.gets, Ordering::Relaxed);
        self.reads.puts.fetch_add(self.puts, Ordering::Relaxed);
        self.reads.bytes.fetch_add(self.bytes, Ordering::Relaxed);
    }
}
