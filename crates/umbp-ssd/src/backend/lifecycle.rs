//! The lifecycle of the SSD medium: `init` (recovery, the staging arena, registration, the
//! background threads), `shutdown`, `clear_local`, and the reaper's expiry pass.

use std::thread::JoinHandle;

use super::*;

/// The reaper thread's name (expiry only).
pub(super) const REAPER_THREAD: &str = "umbp-reaper-SSD";
/// The log thread's name (tombstones, compaction, segment deletion, sync).
pub(super) const LOG_THREAD: &str = "umbp-log-SSD";

/// The background threads: the reaper (slot and lease expiry, no drive IO) and the log thread
/// (segment deletion, tombstone writes, compaction, periodic sync), so a slow drive never delays
/// expiry.
pub(super) struct Reaper {
    stop: Sender<()>,
    threads: Vec<JoinHandle<()>>,
}

impl SsdBackend {
    /// `init`: recovers the log, maps and registers the arena, starts the threads, goes live.
    pub(super) fn start(&self, registrar: Arc<dyn MemoryRegistrar>) -> Result<(), BackendError> {
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
            source: Box::new(e),
        })?;
        let Some(base) = buffers.first().copied() else {
            self.source.release();
            return Err(BackendError::OutOfMemory {
                medium: NAME.into(),
                requested: arena,
                source: "the staging source returned no buffer".into(),
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
        self.inner.state.lock().install(staging, total, log, owned, tombs);
        *self.reaper.lock() = Some(reaper);
        *self.inner.locks.lock() = locks;
        *lifecycle = Lifecycle::Live;
        tracing::info!(dirs = ?config.dirs, capacity = total, recovered, engine = engine_name, "SSD medium live");
        Ok(())
    }

    /// `shutdown`: stops the threads, logs the last tombstones, syncs, deregisters, releases.
    pub(super) fn stop(&self) {
        let mut lifecycle = self.lifecycle.lock();
        if *lifecycle == Lifecycle::ShutDown {
            return;
        }
        *lifecycle = Lifecycle::ShutDown;
        self.stop_reaper();
        // Log the last evictions, so the keys stay gone after a restart.
        self.inner.flush_tombstones();
        let old = std::mem::replace(&mut *self.inner.state.lock(), State::new(self.inner.config.page_size));
        // Make what was written durable before the process may go (outside the lock).
        for seg in old.log().segs.values() {
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

    /// `clear_local`: forgets every key and deletes the log's segments.
    pub(super) fn clear(&self) {
        let now = self.inner.config.clock.now();
        let dead = {
            let mut state = self.inner.state.lock();
            let dead = state.clear(now);
            self.inner.update_staging_gauge(&state);
            // Set under the lock so no allocation slips between the generation bump and the gate.
            self.inner.clear_pending.store(true, Ordering::Release);
            dead
        };
        // Deleting the files keeps a restart from bringing the cleared keys back.
        self.inner.delete_segments(dead);
    }

    /// Starts the reaper (expiry) and log threads.
    pub(super) fn start_reaper(&self) -> io::Result<Reaper> {
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

    /// Stops and joins the reaper and log threads.
    pub(super) fn stop_reaper(&self) {
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

    /// An IO error of this medium, with what it was doing.
    pub(super) fn io_error(context: String, source: io::Error) -> BackendError {
        BackendError::Io { medium: NAME.into(), context, source }
    }

    /// Registers the staging arena with the registrar.
    pub(super) fn register(
        &self,
        registrar: &dyn MemoryRegistrar,
        base: RawBuffer,
    ) -> Result<TransferRef, BackendError> {
        // SAFETY: `base` came from `self.source`, which keeps it mapped until `release`; the
        // registration is undone in `shutdown` (or on a failed init) before `release` is called.
        let region = unsafe { LocalRegion::new(base.base(), base.len(), MemoryLocation::Host) };
        // A shareable arena tells the registrar its file, so a same-host peer may map it.
        let registration = match base.shared_backing() {
            Some(backing) => registrar.register_shareable(region, backing),
            None => registrar.register_memory(region),
        };
        registration.map_err(|source| BackendError::Registration { medium: NAME.into(), buffer_index: 0, source })
    }
}

impl Inner {
    /// One reaper pass: expiry, then the log's work, in order (the background threads run the two
    /// halves on their own threads).
    pub(super) fn sweep(&self) {
        self.expire();
        self.log_pass();
    }

    /// Slot and lease expiry: metadata only, no drive IO, so it keeps its interval whatever the
    /// drive does.
    pub(super) fn expire(&self) {
        let now = self.config.clock.now();
        let mut state = self.state.lock();
        if !state.is_live() {
            return;
        }
        let expired = state.expire(now);
        self.counters.staging_expired_reclaim.fetch_add(expired, Ordering::Relaxed);
        self.update_staging_gauge(&state);
    }
}

/// Refuses a configuration whose worst case needs more open files than the process may have
/// ([`SsdConfig::max_open_files`]): better a clear error at `init` than `EMFILE` on some later
/// segment, which would fail commits one by one.
pub(super) fn check_open_file_limit(config: &SsdConfig) -> Result<(), BackendError> {
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
