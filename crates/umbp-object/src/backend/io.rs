//! Commit (uploads) and resolve (downloads): the jobs the worker pool runs, and how their outcome
//! is published.
//!
//! A caller waits for its jobs up to `op_timeout` and never with the state lock held. A job
//! publishes its own outcome under the lock; for a commit it first checks whether its caller gave
//! up (the batch's `abandoned` flag, set under the same lock), so a commit answered failed never
//! becomes a key later.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crossbeam_channel::Sender;
use umbp_core::{CommitRequest, CommitResult, KvEvent, PageLocation, ResolvedEntry};

use super::state::{Owned, TIER};
use super::{Arena, Inner};
use crate::record::{self, HEADER_LEN, MAX_KEY_LEN};
use crate::store::StoreError;

/// One value to upload: its slot's pages now belong to the job.
struct Upload {
    index: usize,
    key: String,
    size: u64,
    pages: Vec<PageLocation>,
    generation: u64,
    seq: u64,
    crc32c: Option<u32>,
}

/// One value to download into a filling copy's pages (which belong to the job).
struct Download {
    key: String,
    size: u64,
    seq: u64,
    pages: Vec<PageLocation>,
    flight: u64,
}

/// How a download ended.
enum Fetched {
    /// The value is in the pages, checked.
    Filled,
    /// The store no longer has the value, or holds damaged bytes for it: the key is gone.
    Lost(String),
    /// The store could not be asked (unreachable, failing past the retries, stopping): the key
    /// stays, this read misses.
    Failed,
}

/// What the commits of one batch share with their jobs.
struct Batch {
    results: Sender<(usize, Uploaded)>,
    /// Set (under the state lock) when the caller stopped waiting.
    abandoned: AtomicBool,
}

const FAILED: CommitResult = CommitResult { success: false, bytes_committed: 0 };

/// What a worker hands back for one upload of a commit batch.
enum Uploaded {
    /// The upload failed (already cleaned up): the commit answers failed.
    Failed,
    /// The object is in the store, not yet published: the committing thread publishes it (or
    /// deletes it), in request order, so the batch's `Add` events follow its commit order.
    Stored { upload: Upload, name: String },
}

impl Arena {
    /// The bytes of `pages` holding a `size`-byte value, in value order.
    ///
    /// # Safety
    /// The pages must lie in the arena, and no one may write them while the slices live.
    unsafe fn read(&self, pages: &[PageLocation], size: u64, page_size: u64, out: &mut Vec<u8>) {
        let mut left = size;
        for p in pages {
            let n = left.min(page_size) as usize;
            let at = u64::from(p.page_index) * page_size;
            debug_assert!(at as usize + n <= self.len);
            // SAFETY: the caller's contract: in the arena, not written meanwhile.
            let src = unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(at as usize), n) };
            out.extend_from_slice(src);
            left -= n as u64;
        }
    }

    /// Writes `value` into `pages`, in value order.
    ///
    /// # Safety
    /// The pages must lie in the arena and belong to the caller (no reader or writer meanwhile).
    unsafe fn write(&self, pages: &[PageLocation], value: &[u8], page_size: u64) {
        for (p, chunk) in pages.iter().zip(value.chunks(page_size as usize)) {
            let at = u64::from(p.page_index) * page_size;
            debug_assert!(at as usize + chunk.len() <= self.len);
            // SAFETY: the caller's contract; `chunk` is at most a page and the page is in the arena.
            unsafe { std::ptr::copy_nonoverlapping(chunk.as_ptr(), self.base.as_ptr().add(at as usize), chunk.len()) };
        }
    }
}

impl Inner {
    /// `batch_commit`: takes the slots, uploads them on the workers, waits up to `op_timeout`.
    /// Commits of one key inside the batch go in waves, in request order, so the first one wins as
    /// it would one batch after another (the later ones then find the key owned).
    pub(super) fn commit(self: &Arc<Self>, requests: &[CommitRequest]) -> Vec<CommitResult> {
        let mut results = vec![FAILED; requests.len()];
        let mut todo: Vec<usize> = (0..requests.len()).collect();
        while !todo.is_empty() {
            let mut seen = HashSet::new();
            let (wave, later): (Vec<usize>, Vec<usize>) =
                todo.into_iter().partition(|&i| seen.insert(requests[i].key.as_str()));
            self.commit_wave(requests, &wave, &mut results);
            todo = later;
        }
        results
    }

    /// Commits `requests[i]` for every `i` of `wave` (no key twice), filling `results`.
    fn commit_wave(self: &Arc<Self>, requests: &[CommitRequest], wave: &[usize], results: &mut [CommitResult]) {
        let now = self.config.clock.now();
        let mut uploads = Vec::new();
        {
            let mut state = self.state.lock();
            for &index in wave {
                let r = &requests[index];
                let Some(slot) = state.pending.remove(&r.slot_id) else { continue };
                let stale = slot.generation != state.generation || slot.deadline <= now;
                if stale || r.key.len() > MAX_KEY_LEN {
                    state.free_pages(&slot.pages);
                    state.unreserve(slot.size);
                    continue;
                }
                if let Some(o) = state.owned.get(&r.key) {
                    // Lost a commit race: the first value stays, the writer still succeeded.
                    let size = o.size;
                    state.free_pages(&slot.pages);
                    state.unreserve(slot.size);
                    results[index] = CommitResult { success: true, bytes_committed: size };
                    continue;
                }
                let seq = state.next_seq();
                uploads.push(Upload {
                    index,
                    key: r.key.clone(),
                    size: slot.size,
                    pages: slot.pages,
                    generation: slot.generation,
                    seq,
                    crc32c: r.crc32c,
                });
            }
        }
        if uploads.is_empty() {
            return;
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let batch = Arc::new(Batch { results: tx, abandoned: AtomicBool::new(false) });
        let deadline = Instant::now() + self.config.op_timeout;
        let mut outstanding = uploads.len();
        for up in uploads {
            let (inner, batch2) = (Arc::clone(self), Arc::clone(&batch));
            let job = Box::new(move || inner.run_upload(up, &batch2, deadline));
            if !self.submit(job) {
                // Stopping: the job was dropped unrun; shutdown resets the state and its pages.
                outstanding -= 1;
            }
        }
        let mut stored: Vec<(Upload, String)> = Vec::new();
        let mut take = |i: usize, u: Uploaded, results: &mut [CommitResult]| match u {
            Uploaded::Failed => results[i] = FAILED,
            Uploaded::Stored { upload, name } => stored.push((upload, name)),
        };
        while outstanding > 0 {
            match rx.recv_deadline(deadline) {
                Ok((i, u)) => {
                    take(i, u, results);
                    outstanding -= 1;
                }
                Err(_) => break,
            }
        }
        if outstanding > 0 {
            {
                let _state = self.state.lock();
                batch.abandoned.store(true, Ordering::Relaxed);
            }
            // Jobs that finished before the flag was set sent their uploads first.
            while let Ok((i, u)) = rx.try_recv() {
                take(i, u, results);
            }
            tracing::warn!(
                timeout = ?self.config.op_timeout,
                "object store uploads outlasted op_timeout; their commits answer failed"
            );
        }
        self.publish(stored, results);
    }

    /// Publishes the stored objects of one commit wave in request order (the `Add` events follow
    /// the commit order), under one lock: each becomes its key's value, unless the state moved on
    /// (a reset, a stop) or another commit of the key published first — then its object goes.
    fn publish(self: &Arc<Self>, mut stored: Vec<(Upload, String)>, results: &mut [CommitResult]) {
        stored.sort_by_key(|(up, _)| up.index);
        let mut dead = Vec::new();
        {
            let mut state = self.state.lock();
            for (up, name) in stored {
                let result = if up.generation != state.generation || !state.is_live() {
                    state.unreserve(up.size);
                    state.free_pages(&up.pages);
                    dead.push(name);
                    FAILED
                } else if let Some(o) = state.owned.get(&up.key) {
                    // Another commit of the key published first: it stays, ours goes.
                    let size = o.size;
                    state.unreserve(up.size);
                    state.free_pages(&up.pages);
                    dead.push(name);
                    CommitResult { success: true, bytes_committed: size }
                } else {
                    state.owned.insert(up.key.clone(), Owned { size: up.size, seq: up.seq, crc32c: up.crc32c });
                    state.push_event(KvEvent::add(up.key.clone(), TIER, up.size));
                    if self.config.cache_committed {
                        state.cache_copy(&up.key, up.pages, up.size);
                    } else {
                        state.free_pages(&up.pages);
                    }
                    CommitResult { success: true, bytes_committed: up.size }
                };
                results[up.index] = result;
            }
        }
        self.delete_later(dead);
    }

    /// A worker's upload: the object's bytes out of the slot's pages, the PUT, the outcome.
    fn run_upload(self: &Arc<Self>, up: Upload, batch: &Batch, deadline: Instant) {
        let name = self.name_of(&up.key, up.seq);
        let outcome = match (self.store(), self.published()) {
            (Some(store), Some(p)) if !self.stopping.load(Ordering::Acquire) && Instant::now() < deadline => {
                // The value goes straight after room for the head, which is written once its CRC
                // is known: one copy out of the pages.
                let head_len = head_len(up.key.len()) as usize;
                let mut body = Vec::with_capacity(head_len + up.size as usize);
                body.resize(head_len, 0);
                // SAFETY: the pages are this upload's (taken from its slot under the lock) until
                // it gives them back below; the arena outlives the workers.
                unsafe { p.arena.read(&up.pages, up.size, self.config.page_size, &mut body) };
                let crc = crc32c::crc32c(&body[head_len..]);
                body[..head_len].copy_from_slice(&record::encode_head(&up.key, up.size, up.seq, crc, up.crc32c));
                store.put(&name, &body, deadline)
            }
            _ => Err(StoreError::Skipped {
                op: "put",
                name: name.clone(),
                why: "stopping, or past the commit's deadline",
            }),
        };
        let mut dead = Vec::new();
        {
            let mut state = self.state.lock();
            let index = up.index;
            let handed = match outcome {
                Err(e) => {
                    tracing::warn!(key = %up.key, error = %e, "object upload failed; the commit answers failed");
                    state.unreserve(up.size);
                    state.free_pages(&up.pages);
                    Uploaded::Failed
                }
                Ok(()) if batch.abandoned.load(Ordering::Relaxed) => {
                    // The caller stopped waiting: nobody publishes it.
                    state.unreserve(up.size);
                    state.free_pages(&up.pages);
                    dead.push(name);
                    Uploaded::Failed
                }
                // The committing thread publishes it, in request order (`publish`).
                Ok(()) => Uploaded::Stored { upload: up, name },
            };
            // Sent under the lock, so a caller that gives up after it finds the upload queued.
            let _ = batch.results.send((index, handed));
        }
        self.delete_later(dead);
    }

    /// `batch_resolve`: hits from filled copies; downloads for the rest, waited for up to
    /// `op_timeout` (a key still filling then is busy).
    pub(super) fn resolve(self: &Arc<Self>, keys: &[String], include_descs: bool) -> Vec<ResolvedEntry> {
        let now = self.config.clock.now();
        let until = now + self.config.read_lease_ttl;
        let mut out = vec![ResolvedEntry::miss(); keys.len()];
        // (index, flight) of every key waiting for a copy to fill.
        let mut waiting: Vec<(usize, u64)> = Vec::new();
        let mut downloads = Vec::new();
        {
            let mut state = self.state.lock();
            for (i, key) in keys.iter().enumerate() {
                let Some(owned) = state.owned.get(key).copied() else { continue };
                if let Some((pages, size, lease)) = state.hold(key, now, until) {
                    out[i] = self.hit(pages, size, lease, owned.crc32c, include_descs);
                    continue;
                }
                if let Some(c) = state.copies.get_mut(key) {
                    // Filling for another resolve (or earlier in this batch): wait for it too.
                    c.waiters += 1;
                    waiting.push((i, c.flight));
                    continue;
                }
                let Some(pages) = state.take_pages(owned.size.div_ceil(self.config.page_size), now) else {
                    out[i] = ResolvedEntry::busy();
                    continue;
                };
                let flight = state.next_flight();
                state.start_copy(key, pages.clone(), owned.size, flight);
                waiting.push((i, flight));
                downloads.push(Download { key: key.clone(), size: owned.size, seq: owned.seq, pages, flight });
            }
        }
        if waiting.is_empty() {
            return out;
        }
        let deadline = Instant::now() + self.config.op_timeout;
        for d in downloads {
            let inner = Arc::clone(self);
            if !self.submit(Box::new(move || inner.run_download(d, deadline))) {
                tracing::debug!("object medium stopping: a download was dropped");
            }
        }
        let mut state = self.state.lock();
        loop {
            let filling =
                waiting.iter().any(|(i, f)| state.copies.get(&keys[*i]).is_some_and(|c| c.flight == *f && c.filling));
            if !filling || self.filled.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        let now = self.config.clock.now();
        let until = now + self.config.read_lease_ttl;
        for (i, flight) in waiting {
            let key = &keys[i];
            let Some(c) = state.copies.get_mut(key).filter(|c| c.flight == flight) else {
                // The download failed (or a clear dropped the copy): nothing to serve here now.
                continue;
            };
            c.waiters = c.waiters.saturating_sub(1);
            if c.filling {
                out[i] = ResolvedEntry::busy();
                continue;
            }
            let crc32c = state.owned.get(key).and_then(|o| o.crc32c);
            if let Some((pages, size, lease)) = state.hold(key, now, until) {
                out[i] = self.hit(pages, size, lease, crc32c, include_descs);
            }
        }
        out
    }

    /// A worker's download: the GET, the checks (key, seq, length, CRC), the copy into the pages,
    /// the outcome.
    fn run_download(self: &Arc<Self>, d: Download, deadline: Instant) {
        let name = self.name_of(&d.key, d.seq);
        let limit = record::object_len(d.key.len(), d.size);
        let outcome = match (self.store(), self.published()) {
            (Some(store), Some(p)) if !self.stopping.load(Ordering::Acquire) && Instant::now() < deadline => {
                match store.get(&name, limit, deadline) {
                    Ok(bytes) => match record::check_object(&bytes, &d.key, d.seq) {
                        Ok((value, _)) => {
                            // SAFETY: the pages are this download's (its filling copy's) until it
                            // publishes below; the arena outlives the workers.
                            unsafe { p.arena.write(&d.pages, value, self.config.page_size) };
                            Fetched::Filled
                        }
                        Err(e) => Fetched::Lost(format!("damaged object {name}: {e}")),
                    },
                    Err(StoreError::NotFound { .. }) => Fetched::Lost(format!("object {name} is gone from the store")),
                    Err(e) => {
                        tracing::warn!(key = %d.key, error = %e, "object download failed; the key answers a miss");
                        Fetched::Failed
                    }
                }
            }
            _ => Fetched::Failed,
        };
        let mut state = self.state.lock();
        let ours = state.copies.get(&d.key).is_some_and(|c| c.flight == d.flight && c.filling);
        if !ours {
            // A clear or shutdown dropped the copy meanwhile: its pages were left to us.
            state.free_pages(&d.pages);
        } else if let Fetched::Filled = outcome {
            if let Some(c) = state.copies.get_mut(&d.key) {
                c.filling = false;
            }
        } else {
            let _ = state.copies.remove(&d.key);
            state.free_pages(&d.pages);
            if let Fetched::Lost(why) = outcome
                && state.owned.get(&d.key).is_some_and(|o| o.seq == d.seq)
            {
                // The store lost the value or it is damaged: the key is gone, and the master is told.
                tracing::warn!(key = %d.key, "{why}; the key is dropped");
                let now = self.config.clock.now();
                let _ = state.drop_owned(&d.key, now);
                state.push_event(KvEvent::remove(d.key.clone(), TIER));
            }
        }
        drop(state);
        self.filled.notify_all();
    }
}

/// Bytes of an object's head (header and key) for a key of `key_len` bytes.
pub(super) fn head_len(key_len: usize) -> u64 {
    (HEADER_LEN + key_len) as u64
}
