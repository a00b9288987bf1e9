//! The object medium's lifecycle: `init` (the store, the bucket check, recovery, the arena and its
//! registration, the workers and the reaper), `shutdown`, `clear_local`, and expiry.

use std::collections::HashMap;
use std::io;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{RecvTimeoutError, Sender};
use umbp_core::{LocalRegion, MemoryLocation};
use umbp_page::{PageBitmapAllocator, PageMemorySource};

use super::io::head_len;
use super::state::Owned;
use super::*;
use crate::record::{self, Name};
use crate::store::{self, StoreError};

/// The reaper thread's name (expiry only: no store IO).
const REAPER_THREAD: &str = "umbp-reaper-object";
/// The worker threads' name.
const WORKER_THREAD: &str = "umbp-object-io";

/// The background expiry thread.
pub(super) struct Reaper {
    stop: Sender<()>,
    thread: JoinHandle<()>,
}

fn store_error(context: &str, e: StoreError) -> BackendError {
    BackendError::Io { medium: NAME.into(), context: context.to_owned(), source: io::Error::other(e) }
}

impl ObjectBackend {
    /// `init`: opens the store, checks the bucket, recovers the prefix, maps and registers the
    /// arena, starts the threads, goes live. Any failure undoes what was done; `init` may be
    /// retried.
    pub(super) fn start(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
        let mut lifecycle = self.lifecycle.lock();
        match *lifecycle {
            Lifecycle::Live => return Ok(()),
            Lifecycle::ShutDown => return Err(BackendError::ShutDown(NAME.into())),
            Lifecycle::New => {}
        }
        let config = &self.inner.config;
        let store: Arc<dyn Store> = store::open(config).map_err(|e| store_error("opening the store", e))?.into();
        let deadline = Instant::now() + config.op_timeout;
        store
            .ensure_bucket(config.create_bucket, deadline)
            .map_err(|e| store_error(&format!("checking {}", config.url), e))?;
        let pool = Pool::start(WORKER_THREAD, config.io_threads).map_err(|e| BackendError::Io {
            medium: NAME.into(),
            context: "starting the worker threads".into(),
            source: e,
        })?;
        let (owned, next_seq, stale) =
            if config.recover { recover(config, &store, &pool)? } else { (Vec::new(), 1, Vec::new()) };
        let arena_len = config.staging_pages * config.page_size;
        let buffers = self.source.allocate(&[arena_len]).map_err(|e| BackendError::OutOfMemory {
            medium: NAME.into(),
            requested: arena_len,
            source: Box::new(e),
        })?;
        let undo = |e: BackendError| {
            self.source.release();
            Err(e)
        };
        let Some(base) = buffers.first().copied() else {
            return undo(BackendError::OutOfMemory {
                medium: NAME.into(),
                requested: arena_len,
                source: "the staging source returned no buffer".into(),
            });
        };
        let staging = match PageBitmapAllocator::new(config.page_size, &[arena_len]) {
            Ok(a) => a,
            Err(e) => return undo(BackendError::InvalidConfig(e.to_string())),
        };
        // SAFETY: `base` came from `self.source`, which keeps it mapped until `release`; the
        // registration is undone in `shutdown` (or below, on a failed init) before that.
        let region = unsafe { LocalRegion::new(base.base(), base.len(), MemoryLocation::Host) };
        let registered = match registrar.register_memory(region) {
            Ok(r) => r,
            Err(source) => return undo(BackendError::Registration { medium: NAME.into(), buffer_index: 0, source }),
        };
        let reaper = match self.start_reaper() {
            Ok(r) => r,
            Err(e) => {
                registrar.deregister(&registered);
                return undo(BackendError::Io {
                    medium: NAME.into(),
                    context: "starting the reaper".into(),
                    source: e,
                });
            }
        };
        let r#ref = registered.clone().truncated(arena_len);
        let desc = BufferDesc::from_ref(0, &r#ref);
        let arena = Arena { base: base.base(), len: arena_len as usize };
        let recovered = owned.len();
        self.inner.stopping.store(false, Ordering::Release);
        *self.inner.store.write() = Some(store);
        *self.inner.pool.write() = Some(pool);
        *self.inner.published.write() = Some(Arc::new(Published { registrar, registered, r#ref, desc, arena }));
        self.inner.state.lock().install(staging, config.capacity_bytes, owned, next_seq);
        *self.reaper.lock() = Some(reaper);
        *lifecycle = Lifecycle::Live;
        self.inner.delete_later(stale);
        tracing::info!(url = %config.url, capacity = config.capacity_bytes, recovered, "object medium live");
        Ok(())
    }

    /// `shutdown`: stops the reaper and the workers (the jobs already queued run; uploads and
    /// downloads without IO), then deregisters and releases the arena.
    pub(super) fn stop(&self) {
        let mut lifecycle = self.lifecycle.lock();
        if *lifecycle == Lifecycle::ShutDown {
            return;
        }
        *lifecycle = Lifecycle::ShutDown;
        if let Some(r) = self.reaper.lock().take() {
            drop(r.stop);
            if r.thread.join().is_err() {
                tracing::error!("the object medium's reaper thread panicked");
            }
        }
        self.inner.stopping.store(true, Ordering::Release);
        // Taken out first: a job finishing meanwhile may look the pool up (and find none).
        let pool = self.inner.pool.write().take();
        if let Some(p) = pool {
            p.stop();
        }
        let old = std::mem::replace(&mut *self.inner.state.lock(), State::new(self.inner.config.page_size));
        drop(old);
        self.inner.filled.notify_all();
        *self.inner.store.write() = None;
        // Deregister before release: a transport may still map the arena.
        if let Some(p) = self.inner.published.write().take() {
            p.registrar.deregister(&p.registered);
        }
        self.source.release();
    }

    /// `clear_local`: forgets every key and deletes their objects in the background.
    pub(super) fn clear(&self) {
        let now = self.inner.config.clock.now();
        let dropped = {
            let mut state = self.inner.state.lock();
            let dropped = state.clear(now);
            // Set under the lock so no allocation slips between the generation bump and the gate.
            self.inner.clear_pending.store(true, Ordering::Release);
            dropped
        };
        let names = dropped.iter().map(|(k, seq)| self.inner.name_of(k, *seq)).collect();
        self.inner.delete_later(names);
    }

    fn start_reaper(&self) -> io::Result<Reaper> {
        let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
        let inner = Arc::clone(&self.inner);
        let interval = inner.config.reaper_interval;
        let thread = std::thread::Builder::new().name(REAPER_THREAD.into()).spawn(move || {
            loop {
                match stopped.recv_timeout(interval) {
                    Err(RecvTimeoutError::Timeout) => inner.expire(),
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        })?;
        Ok(Reaper { stop, thread })
    }
}

impl Inner {
    /// Slot, lease and deferred-free expiry: metadata only.
    pub(super) fn expire(&self) {
        let now = self.config.clock.now();
        let mut state = self.state.lock();
        if state.is_live() {
            state.expire(now);
        }
    }
}

/// What recovery found: the owned keys, the next seq, and superseded objects to delete.
type Recovered = (Vec<(String, Owned)>, u64, Vec<String>);

/// Lists the prefix and re-indexes every object whose head checks: its name parses, its header
/// CRC holds, the header names the same key and seq as the name, and its length is the listed
/// size. Of several objects of one key the highest seq wins (the rest are returned for deletion);
/// the newest keys are kept up to the capacity. Returns the owned keys, the next seq and the stale
/// objects.
fn recover(config: &ObjectConfig, store: &Arc<dyn Store>, pool: &Pool) -> Result<Recovered, BackendError> {
    let prefix = config.url.prefix();
    // Its own deadline: a large prefix takes many requests, each bounded by `request_timeout`.
    let deadline = Instant::now() + config.recover_timeout.max(config.op_timeout);
    let listed = store.list(prefix, deadline).map_err(|e| store_error(&format!("listing {}", config.url), e))?;
    let mut newest: HashMap<String, (u64, String, u64)> = HashMap::new();
    let mut stale = Vec::new();
    let mut max_seq = 0;
    for (name, size) in listed {
        let Some(parsed) = Name::parse(prefix, &name) else { continue };
        max_seq = max_seq.max(parsed.seq);
        match newest.get(&parsed.key) {
            Some((seq, _, _)) if *seq > parsed.seq => stale.push(name),
            _ => {
                if let Some((_, old, _)) = newest.insert(parsed.key, (parsed.seq, name, size)) {
                    stale.push(old);
                }
            }
        }
    }
    // Check the heads on the workers, io_threads at a time.
    let (tx, rx) = crossbeam_channel::unbounded();
    let candidates = newest.len();
    let (done_tx, done_rx) = crossbeam_channel::bounded::<()>(candidates.max(1));
    for (key, (seq, name, size)) in newest {
        let tx = tx.clone();
        let done = done_tx.clone();
        let max_len = record::object_len(key.len(), config.max_value_pages * config.page_size);
        let store = Arc::clone(store);
        let job = Box::new(move || {
            let verdict = check_head(store.as_ref(), &key, seq, &name, size, max_len, deadline);
            let _ = tx.send((key, seq, size, name, verdict));
            let _ = done.send(());
        });
        if !pool.submit(job) {
            let _ = done_tx.send(());
        }
    }
    drop((tx, done_tx));
    // Every job signals once, whatever it found; each is bounded by `deadline`.
    for _ in 0..candidates {
        if done_rx.recv().is_err() {
            break;
        }
    }
    let mut found: Vec<(String, u64, u64, Option<u32>)> = Vec::new();
    let mut skipped = 0usize;
    while let Ok((key, seq, size, name, verdict)) = rx.try_recv() {
        match verdict {
            Ok(header) => found.push((key, seq, header.value_len, header.writer_crc)),
            Err(why) => {
                skipped += 1;
                tracing::warn!(object = %name, size, "{why}; not re-indexed");
            }
        }
    }
    // Newest first, up to the capacity.
    found.sort_by_key(|(_, seq, _, _)| std::cmp::Reverse(*seq));
    let mut used = 0u64;
    let mut owned = Vec::new();
    for (key, seq, size, crc32c) in found {
        let bytes = size.div_ceil(config.page_size) * config.page_size;
        if used + bytes > config.capacity_bytes {
            skipped += 1;
            tracing::warn!(key = %key, "over the capacity at recovery; not re-indexed");
            continue;
        }
        used += bytes;
        owned.push((key, Owned { size, seq, crc32c }));
    }
    if skipped > 0 || !stale.is_empty() {
        tracing::warn!(recovered = owned.len(), skipped, superseded = stale.len(), "object medium recovery");
    }
    // Seqs stay unique across restarts even if the store lost its newest objects.
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
    Ok((owned, (max_seq + 1).max(wall), stale))
}

/// Reads and checks one object's head; `Ok` carries its header.
fn check_head(
    store: &dyn Store,
    key: &str,
    seq: u64,
    name: &str,
    size: u64,
    max_len: u64,
    deadline: Instant,
) -> Result<record::Header, String> {
    if size > max_len {
        return Err(format!("{size} bytes, more than the largest value this medium stores"));
    }
    let head = store.get_head(name, head_len(key.len()), deadline).map_err(|e| e.to_string())?;
    let (header, got) = record::decode_head(&head).map_err(|e| e.to_string())?;
    if got != key || header.seq != seq {
        return Err(format!("the header names {got:?}@{}, the name {key:?}@{seq}", header.seq));
    }
    if record::object_len(key.len(), header.value_len) != size {
        return Err(format!("{size} bytes listed, the header says a {}-byte value", header.value_len));
    }
    Ok(header)
}
