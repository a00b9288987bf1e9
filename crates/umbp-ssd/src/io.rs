//! Drive IO: one trait, two engines (`psync`, `io_uring`), and the aligned buffers `O_DIRECT` needs.
//!
//! An engine takes a batch of positioned, vectored reads and writes and completes all of them. The
//! psync engine runs them one after another with `preadv` / `pwritev`; the io_uring engine submits the
//! whole batch to a ring at once and waits for every completion, so a batch of several keys keeps the
//! drive's queue full. Short transfers are finished, `EINTR` is retried, and each operation reports
//! its own result.

use std::alloc::{self, Layout};
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::ptr::NonNull;

use parking_lot::{Condvar, Mutex};

use crate::config::IoEngineKind;
use crate::record::ALIGN;

/// A zeroed heap buffer aligned to [`ALIGN`], usable as an `O_DIRECT` source or target.
pub(crate) struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is uniquely owned heap memory with no thread affinity.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads through `as_slice`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zeroed bytes (at least one alignment unit is allocated, so `len` 0 is valid).
    pub(crate) fn zeroed(len: usize) -> io::Result<Self> {
        let layout = Layout::from_size_align(len.max(ALIGN as usize), ALIGN as usize)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `layout` has a non-zero size (at least `ALIGN`).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| io::Error::from(io::ErrorKind::OutOfMemory))?;
        Ok(Self { ptr, len })
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised (zeroed at allocation) bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len.max(ALIGN as usize), ALIGN as usize);
        if let Ok(layout) = layout {
            // SAFETY: allocated in `zeroed` with exactly this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish()
    }
}

/// One positioned, vectored read or write.
pub(crate) struct IoOp {
    fd: RawFd,
    offset: u64,
    iov: Vec<libc::iovec>,
    write: bool,
    /// Set by the engine.
    pub(crate) result: io::Result<()>,
}

// SAFETY: the iovecs are addresses of memory the creator vouched for in `IoOp::new`; nothing in an
// op is tied to the creating thread.
unsafe impl Send for IoOp {}

impl fmt::Debug for IoOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoOp")
            .field("fd", &self.fd)
            .field("offset", &self.offset)
            .field("segments", &self.iov.len())
            .field("write", &self.write)
            .finish_non_exhaustive()
    }
}

impl IoOp {
    /// An operation on `file` at `offset` over `segments` (address, length).
    ///
    /// # Safety
    /// Every segment must be valid memory (readable for a write, writable for a read, and not
    /// accessed by anyone else during a read) of its length, and `file` must stay open, until the
    /// engine's `submit` of this op has returned.
    pub(crate) unsafe fn new(file: &File, offset: u64, segments: &[(*mut u8, usize)], write: bool) -> Self {
        // Adjacent segments (neighbouring staging pages) become one: fewer iovecs, and a single
        // one can use a registered buffer.
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(segments.len());
        for &(p, l) in segments {
            if let Some(last) = iov.last_mut()
                && last.iov_base.cast::<u8>().wrapping_add(last.iov_len) == p
            {
                last.iov_len += l;
            } else {
                iov.push(libc::iovec { iov_base: p.cast(), iov_len: l });
            }
        }
        // Not done until an engine says so: an op an engine never reached is never "ok".
        Self { fd: file.as_raw_fd(), offset, iov, write, result: Err(io::Error::other("not submitted")) }
    }

    /// Where the op starts in its file.
    #[cfg(test)]
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// Whether the op writes, its bytes and its iovecs.
    #[cfg(test)]
    pub(crate) fn shape(&self) -> (bool, usize, usize) {
        (self.write, self.total(), self.iov.len())
    }

    fn total(&self) -> usize {
        self.iov.iter().map(|v| v.iov_len).sum()
    }
}

/// Drops the first `n` bytes from `iov`.
fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
    let mut skip = 0;
    for v in iov.iter_mut() {
        if n == 0 {
            break;
        }
        if n >= v.iov_len {
            n -= v.iov_len;
            skip += 1;
        } else {
            // SAFETY: `n < iov_len`, so the pointer stays inside the segment.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n) }.cast();
            v.iov_len -= n;
            n = 0;
        }
    }
    iov.drain(..skip);
}

/// Completes `op` with blocking `preadv` / `pwritev` calls, from wherever it stands.
fn run_psync(op: &mut IoOp) -> io::Result<()> {
    let mut offset = op.offset;
    let mut iov = std::mem::take(&mut op.iov);
    while !iov.is_empty() {
        let cnt = iov.len().min(1024) as libc::c_int;
        let off = libc::off_t::try_from(offset).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let n = if op.write {
            // SAFETY: the iovecs describe valid memory (`IoOp::new`'s contract); the fd is open.
            unsafe { libc::pwritev(op.fd, iov.as_ptr(), cnt, off) }
        } else {
            // SAFETY: as above; read targets are exclusively ours.
            unsafe { libc::preadv(op.fd, iov.as_ptr(), cnt, off) }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the segment ends before the record"));
        }
        offset += n as u64;
        advance(&mut iov, n as usize);
    }
    Ok(())
}

/// A drive IO engine: completes every op of a batch and sets each op's result.
pub(crate) trait IoEngine: Send + Sync + fmt::Debug {
    /// The engine's name (`psync`, `io_uring`) for logs.
    fn name(&self) -> &'static str;

    /// Runs every op; returns when all are complete.
    fn submit(&self, ops: &mut [IoOp]);

    /// Tells the engine about the staging arena, which it may register with the kernel (io_uring
    /// fixed buffers: no page pinning per request). Default: ignored.
    ///
    /// # Safety
    /// `base` must stay valid for `len` bytes until the engine is dropped.
    unsafe fn register_arena(&self, base: *mut u8, len: usize) {
        let _ = (base, len);
    }

    /// Whether the engine overlaps IO with the caller's work in [`submit_split`](Self::submit_split)
    /// and [`submit_ordered`](Self::submit_ordered). Where it does not (psync: one blocking call
    /// at a time), splitting a transfer only adds system calls, so callers should not.
    fn overlaps(&self) -> bool {
        false
    }

    /// Runs `ops[..split]`, calls `meanwhile` while they are in flight, then runs `ops[split..]`
    /// (whose buffers `meanwhile` may still be filling) and returns when every op is complete.
    fn submit_split(&self, ops: &mut [IoOp], split: usize, meanwhile: &mut dyn FnMut()) {
        let _ = split;
        meanwhile();
        self.submit(ops);
    }

    /// Runs every op and calls `on_complete(i)` as op `i` completes (in completion order, on the
    /// calling thread), so the caller can work on finished ops while the rest are in flight.
    fn submit_ordered(&self, ops: &mut [IoOp], on_complete: &mut dyn FnMut(usize)) {
        self.submit(ops);
        for i in 0..ops.len() {
            on_complete(i);
        }
    }
}

/// `preadv` / `pwritev`, one op after another.
#[derive(Debug, Default)]
pub(crate) struct PsyncEngine;

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn submit(&self, ops: &mut [IoOp]) {
        for op in ops {
            op.result = run_psync(op);
        }
    }
}

/// io_uring: a batch goes to one ring in one submission. Rings are pooled: a caller takes one for
/// its batch and puts it back, so concurrent callers never share a ring or a lock across IO. The
/// pool is bounded: at most `max_rings` rings exist at once (idle or in use), each registering the
/// staging arena once, when it is made; a caller that finds every ring in use waits for one to
/// come back rather than making another, so concurrency never multiplies rings, their kernel
/// memory (locked, counted against `RLIMIT_MEMLOCK` on older kernels) or arena registrations.
///
/// A ring goes back to the pool only after every request it took from a batch has completed, and
/// every request carries its batch's generation, so a completion can never be taken for another
/// batch's. When `io_uring_enter` fails for a reason other than `EINTR`, `EAGAIN` or `EBUSY`, the
/// batch waits for every request the kernel already took (the kernel may still be reading or
/// writing their memory) and the ring is dropped, never reused.
pub(crate) struct UringEngine {
    depth: u32,
    /// The most rings that exist at once.
    max_rings: usize,
    pool: Mutex<Pool>,
    /// Signalled when a ring goes back to the pool or stops counting against `max_rings`.
    ring_free: Condvar,
    /// The staging arena `(base, len)`, registered as fixed buffer 0 of every ring.
    arena: Mutex<Option<(usize, usize)>>,
    /// Tests: the next wait fails with this errno (after the batch went to the kernel).
    #[cfg(test)]
    inject_wait_error: Mutex<Option<i32>>,
    /// Tests: how many times the arena was registered with a ring.
    #[cfg(test)]
    registrations: std::sync::atomic::AtomicUsize,
}

/// The rings of an engine.
struct Pool {
    /// Rings no batch is using.
    idle: Vec<Ring>,
    /// Rings that exist: idle, in use, or being made.
    alive: usize,
    /// Tests: the most rings that ever existed at once.
    #[cfg(test)]
    peak: usize,
}

/// A ring and, when the arena is registered with it, the arena's address range.
struct Ring {
    io: io_uring::IoUring,
    fixed: Option<(usize, usize)>,
    /// The generation of the batch in flight; the high 32 bits of every request's `user_data`.
    generation: u32,
    /// Tests: requests pushed as fixed-buffer reads and writes.
    #[cfg(test)]
    fixed_requests: usize,
}

/// `user_data` of op `index` of batch `generation`.
fn tag(generation: u32, index: usize) -> u64 {
    (u64::from(generation) << 32) | (index as u64 & 0xFFFF_FFFF)
}

/// The `(generation, index)` of a `user_data`.
fn untag(user_data: u64) -> (u32, usize) {
    ((user_data >> 32) as u32, (user_data & 0xFFFF_FFFF) as usize)
}

impl Ring {
    fn new(io: io_uring::IoUring) -> Self {
        Self {
            io,
            fixed: None,
            generation: 0,
            #[cfg(test)]
            fixed_requests: 0,
        }
    }

    /// Registers `arena` as fixed buffer 0 (best effort: without it every request is vectored).
    fn register(&mut self, arena: Option<(usize, usize)>) {
        let Some((base, len)) = arena else { return };
        let iov = [libc::iovec { iov_base: base as *mut libc::c_void, iov_len: len }];
        // SAFETY: the arena stays mapped until the engine (and with it every ring) is dropped
        // (`register_arena`'s contract).
        match unsafe { self.io.submitter().register_buffers(&iov) } {
            Ok(()) => self.fixed = Some((base, len)),
            Err(e) => tracing::debug!(error = %e, "io_uring buffer registration refused; using vectored IO"),
        }
    }
}

impl fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UringEngine")
            .field("depth", &self.depth)
            .field("max_rings", &self.max_rings)
            .finish_non_exhaustive()
    }
}

/// Whether an `io_uring_enter` error only means "try again" (nothing is wrong with the ring).
fn retryable(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::Interrupted || matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EBUSY))
}

impl UringEngine {
    /// An engine of at most `max_rings` rings (at least one) of `depth` entries each; fails when
    /// the kernel refuses io_uring (ENOSYS on old kernels, EPERM under seccomp or
    /// `io_uring_disabled`).
    pub(crate) fn new(depth: u32, max_rings: usize) -> io::Result<Self> {
        // The first ring is made now, so a kernel without io_uring is found out at once.
        let ring = Ring::new(io_uring::IoUring::new(depth)?);
        Ok(Self {
            depth,
            max_rings: max_rings.max(1),
            pool: Mutex::new(Pool {
                idle: vec![ring],
                alive: 1,
                #[cfg(test)]
                peak: 1,
            }),
            ring_free: Condvar::new(),
            arena: Mutex::new(None),
            #[cfg(test)]
            inject_wait_error: Mutex::new(None),
            #[cfg(test)]
            registrations: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Registers the arena with `ring` (counted, for tests).
    fn register(&self, ring: &mut Ring, arena: Option<(usize, usize)>) {
        ring.register(arena);
        #[cfg(test)]
        if ring.fixed.is_some() {
            self.registrations.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Pushes `ops[from..to]` onto the ring's submission queue, tagged with the ring's generation;
    /// returns how many fit.
    fn push(ring: &mut Ring, ops: &[IoOp], from: usize, to: usize) -> usize {
        use io_uring::{opcode, types};
        let fixed = ring.fixed;
        let generation = ring.generation;
        let mut queued = 0usize;
        let mut sq = ring.io.submission();
        for (i, op) in ops.iter().enumerate().take(to).skip(from) {
            let cnt = op.iov.len() as u32;
            // One segment inside the registered arena: a fixed-buffer request.
            let single = match (fixed, op.iov.as_slice()) {
                (Some((base, len)), [v])
                    if (v.iov_base as usize) >= base
                        && (v.iov_base as usize) + v.iov_len <= base + len
                        && u32::try_from(v.iov_len).is_ok() =>
                {
                    Some((v.iov_base.cast::<u8>(), v.iov_len as u32))
                }
                _ => None,
            };
            #[cfg(test)]
            if single.is_some() {
                ring.fixed_requests += 1;
            }
            let entry = match (single, op.write) {
                (Some((p, n)), true) => opcode::WriteFixed::new(types::Fd(op.fd), p, n, 0).offset(op.offset).build(),
                (Some((p, n)), false) => opcode::ReadFixed::new(types::Fd(op.fd), p, n, 0).offset(op.offset).build(),
                (None, true) => opcode::Writev::new(types::Fd(op.fd), op.iov.as_ptr(), cnt).offset(op.offset).build(),
                (None, false) => opcode::Readv::new(types::Fd(op.fd), op.iov.as_ptr(), cnt).offset(op.offset).build(),
            };
            // SAFETY: the iovec arrays and the memory they name stay valid until every request the
            // kernel took has completed: `run_hooked` does not return before that (it waits even
            // when the ring fails), and `ops` is borrowed for the whole call (`IoOp::new`'s
            // contract covers the memory until the submit returns).
            if unsafe { sq.push(&entry.user_data(tag(generation, i))) }.is_err() {
                break;
            }
            queued += 1;
        }
        queued
    }

    /// Submits what is queued and waits for at least one completion, retrying `EINTR`, `EAGAIN`
    /// and `EBUSY`; an error is a failure of the ring itself.
    fn wait(&self, ring: &mut Ring) -> io::Result<()> {
        #[cfg(test)]
        if let Some(errno) = self.inject_wait_error.lock().take() {
            // As if the enter that submitted the batch failed afterwards: submit for real first, so
            // the requests are in the kernel's hands.
            let _ = ring.io.submit();
            return Err(io::Error::from_raw_os_error(errno));
        }
        match ring.io.submit_and_wait(1) {
            Ok(_) => Ok(()),
            Err(e) if retryable(&e) => {
                if e.raw_os_error() == Some(libc::EAGAIN) {
                    // Out of kernel resources for now: give them a moment.
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
                // The caller reaps (EBUSY: the completion queue is full; reaping makes room) and
                // waits again.
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Runs `ops` (which must fit the ring) with the hooks of `submit_split` / `submit_ordered`.
    /// Returns `false` when the ring failed: the caller must not put it back in the pool.
    fn run_hooked(
        &self,
        ring: &mut Ring,
        ops: &mut [IoOp],
        split: usize,
        meanwhile: &mut dyn FnMut(),
        on_complete: &mut dyn FnMut(usize),
    ) -> bool {
        ring.generation = ring.generation.wrapping_add(1);
        let generation = ring.generation;
        // Leftovers of an earlier batch (there should be none): never taken for this one's.
        ring.io.completion().for_each(drop);
        let first = Self::push(ring, ops, 0, split);
        loop {
            match ring.io.submit() {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // Any other failure shows again (and is handled) in the reaping loop below.
                _ => break,
            }
        }
        meanwhile();
        let second = Self::push(ring, ops, split, ops.len());
        debug_assert_eq!(first + second, ops.len(), "the caller checked that the batch fits the ring");
        // Which ops went onto the ring, in push order.
        let queued: Vec<usize> = (0..first).chain(split..split + second).collect();
        let mut done = vec![false; ops.len()];
        let mut remaining = queued.len();
        let mut reap = |ring: &mut Ring, done: &mut [bool], remaining: &mut usize, ops: &mut [IoOp]| {
            let completed: Vec<(u64, i32)> = ring.io.completion().map(|cqe| (cqe.user_data(), cqe.result())).collect();
            for (user_data, res) in completed {
                let (g, i) = untag(user_data);
                if g != generation || i >= ops.len() || done[i] {
                    continue;
                }
                done[i] = true;
                *remaining -= 1;
                ops[i].result = Self::finish(&mut ops[i], res);
                on_complete(i);
            }
        };
        while remaining > 0 {
            if let Err(e) = self.wait(ring) {
                // The ring failed. Requests the kernel already took may still be reading or
                // writing the caller's memory: wait for every one of them before returning.
                let mut sq = ring.io.submission();
                sq.sync();
                let untaken = sq.len().min(remaining);
                drop(sq);
                tracing::error!(error = %e, in_flight = remaining - untaken, "io_uring_enter failed; waiting for the requests in flight, then dropping the ring");
                // The last `untaken` pushes never reached the kernel (and never will: the ring is
                // not entered again).
                for &i in queued.iter().rev().take(untaken) {
                    if !done[i] {
                        done[i] = true;
                        remaining -= 1;
                        ops[i].result = Err(io::Error::new(e.kind(), format!("io_uring submit: {e}")));
                    }
                }
                let started = std::time::Instant::now();
                let mut warned = started;
                while remaining > 0 {
                    reap(ring, &mut done, &mut remaining, ops);
                    if remaining == 0 {
                        break;
                    }
                    if warned.elapsed() >= std::time::Duration::from_secs(10) {
                        warned = std::time::Instant::now();
                        tracing::error!(remaining, waited = ?started.elapsed(), "still waiting for io_uring requests of a failed ring");
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                return false;
            }
            reap(ring, &mut done, &mut remaining, ops);
        }
        true
    }

    /// The result of an op whose completion reported `res`; a short transfer is finished here.
    fn finish(op: &mut IoOp, res: i32) -> io::Result<()> {
        if res < 0 {
            return Err(io::Error::from_raw_os_error(-res));
        }
        let n = res as usize;
        if n >= op.total() {
            Ok(())
        } else if n == 0 && !op.write {
            Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the segment ends before the record"))
        } else {
            // A short transfer: finish it synchronously (rare; the kernel may split IO).
            advance(&mut op.iov, n);
            op.offset += n as u64;
            run_psync(op)
        }
    }

    /// An idle ring from the pool; a new one while fewer than `max_rings` exist; otherwise waits
    /// for one to come back. `None` when the kernel will not make a ring (memlock limits), in
    /// which case the caller runs its batch with psync. A caller holds at most one ring at a
    /// time (no engine call is made while holding one), so waiting cannot deadlock.
    fn take_ring(&self) -> Option<Ring> {
        let mut pool = self.pool.lock();
        loop {
            if let Some(ring) = pool.idle.pop() {
                return Some(ring);
            }
            if pool.alive < self.max_rings {
                break;
            }
            self.ring_free.wait(&mut pool);
        }
        pool.alive += 1;
        #[cfg(test)]
        {
            pool.peak = pool.peak.max(pool.alive);
        }
        drop(pool);
        // Made outside the pool's lock: creating and registering a ring are system calls.
        match io_uring::IoUring::new(self.depth) {
            Ok(io) => {
                let mut ring = Ring::new(io);
                self.register(&mut ring, *self.arena.lock());
                Some(ring)
            }
            Err(e) => {
                self.pool.lock().alive -= 1;
                self.ring_free.notify_one();
                tracing::debug!(error = %e, "no io_uring ring available; running the batch with psync");
                None
            }
        }
    }

    /// Gives a ring back after a batch: to the pool if it is healthy (`ok`), else it is dropped
    /// (every request it took has completed by then) and a new one may be made in its place.
    fn put_ring(&self, ring: Ring, ok: bool) {
        let failed = {
            let mut pool = self.pool.lock();
            if ok {
                pool.idle.push(ring);
                None
            } else {
                pool.alive -= 1;
                Some(ring)
            }
        };
        // Closed outside the lock.
        drop(failed);
        self.ring_free.notify_one();
    }

    /// Runs `ops` in batches of at most the ring's size; `false` when the ring failed (ops of the
    /// batches after the failure are not run and report an error).
    fn run(&self, ring: &mut Ring, ops: &mut [IoOp]) -> bool {
        let cap = (ring.io.params().sq_entries() as usize).max(1);
        for chunk in ops.chunks_mut(cap) {
            let n = chunk.len();
            if !self.run_hooked(ring, chunk, n, &mut || {}, &mut |_| {}) {
                return false;
            }
        }
        true
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&self, ops: &mut [IoOp]) {
        if ops.is_empty() {
            return;
        }
        match self.take_ring() {
            Some(mut ring) => {
                let ok = self.run(&mut ring, ops);
                self.put_ring(ring, ok);
            }
            None => PsyncEngine.submit(ops),
        }
    }

    unsafe fn register_arena(&self, base: *mut u8, len: usize) {
        let arena = Some((base as usize, len));
        *self.arena.lock() = arena;
        // Rings made from now on register it when made; a ring in use now keeps vectored IO (the
        // backend registers the arena at `init`, before any IO).
        let mut pool = self.pool.lock();
        for ring in pool.idle.iter_mut() {
            self.register(ring, arena);
        }
    }

    fn overlaps(&self) -> bool {
        true
    }

    fn submit_split(&self, ops: &mut [IoOp], split: usize, meanwhile: &mut dyn FnMut()) {
        let ring = (ops.len() <= self.depth as usize && split <= ops.len()).then(|| self.take_ring()).flatten();
        match ring {
            Some(mut ring) => {
                let ok = self.run_hooked(&mut ring, ops, split, meanwhile, &mut |_| {});
                self.put_ring(ring, ok);
            }
            None => {
                // The second part must not go out before `meanwhile` has finished it.
                meanwhile();
                self.submit(ops);
            }
        }
    }

    fn submit_ordered(&self, ops: &mut [IoOp], on_complete: &mut dyn FnMut(usize)) {
        let ring = (ops.len() <= self.depth as usize).then(|| self.take_ring()).flatten();
        match ring {
            Some(mut ring) => {
                let n = ops.len();
                let ok = self.run_hooked(&mut ring, ops, n, &mut || {}, on_complete);
                self.put_ring(ring, ok);
            }
            None => {
                self.submit(ops);
                (0..ops.len()).for_each(on_complete);
            }
        }
    }
}

/// Builds the engine `kind` names (`depth` and `rings`: io_uring's ring size and most rings).
pub(crate) fn make_engine(kind: IoEngineKind, depth: u32, rings: usize) -> io::Result<Box<dyn IoEngine>> {
    Ok(match kind {
        IoEngineKind::Psync => Box::new(PsyncEngine),
        IoEngineKind::IoUring => Box::new(UringEngine::new(depth, rings)?),
    })
}

/// Opens (creating if asked) a segment file, with `O_DIRECT` when `direct`.
pub(crate) fn open_segment(path: &Path, create: bool, direct: bool) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    if create {
        options.create_new(true);
    }
    if direct {
        options.custom_flags(libc::O_DIRECT);
    }
    options.open(path)
}

/// Whether `dir`'s filesystem takes `O_DIRECT` reads and writes (tmpfs, for one, refuses them).
pub(crate) fn probe_direct_io(dir: &Path) -> bool {
    let path = dir.join(format!(".umbp-direct-probe-{}", std::process::id()));
    let ok = (|| -> io::Result<()> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        let mut buf = AlignedBuf::zeroed(ALIGN as usize)?;
        let len = buf.len();
        // SAFETY: `buf` outlives the submit and is only used by this op.
        let mut op = unsafe { IoOp::new(&file, 0, &[(buf.as_mut_ptr(), len)], true) };
        run_psync(&mut op)?;
        // SAFETY: as above.
        let mut op = unsafe { IoOp::new(&file, 0, &[(buf.as_mut_ptr(), len)], false) };
        run_psync(&mut op)
    })()
    .is_ok();
    let _ = std::fs::remove_file(&path);
    ok
}

#[cfg(test)]
mod tests {
    use umbp_testkit::require;

    use super::*;

    fn round_trip(engine: &dyn IoEngine) {
        let dir = tempfile::tempdir().expect("tempdir");
        let direct = probe_direct_io(dir.path());
        let file = open_segment(&dir.path().join("seg"), true, direct).expect("open");
        let mut a = AlignedBuf::zeroed(8192).expect("buf");
        let mut b = AlignedBuf::zeroed(4096).expect("buf");
        a.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
        b.as_mut_slice().fill(0xAB);
        let (pa, pb) = (a.as_mut_ptr(), b.as_mut_ptr());
        // SAFETY: the buffers outlive the submits.
        let mut ops = unsafe {
            vec![IoOp::new(&file, 0, &[(pa, 8192), (pb, 4096)], true), IoOp::new(&file, 16384, &[(pb, 4096)], true)]
        };
        engine.submit(&mut ops);
        assert!(ops.iter().all(|o| o.result.is_ok()), "{ops:?}");
        let mut out = AlignedBuf::zeroed(12288).expect("buf");
        let po = out.as_mut_ptr();
        // SAFETY: as above.
        let mut ops = unsafe { vec![IoOp::new(&file, 0, &[(po, 12288)], false)] };
        engine.submit(&mut ops);
        assert!(ops[0].result.is_ok());
        assert_eq!(&out.as_slice()[..8192], a.as_slice());
        assert!(out.as_slice()[8192..].iter().all(|x| *x == 0xAB));
        // Reading past the end of the file is an error, not silent zeroes.
        // SAFETY: as above.
        let mut ops = unsafe { vec![IoOp::new(&file, 65536, &[(po, 4096)], false)] };
        engine.submit(&mut ops);
        assert!(ops[0].result.is_err());
    }

    #[test]
    fn io_uring_uses_the_registered_arena_for_single_segment_requests() {
        let engine = match UringEngine::new(16, 4) {
            Ok(engine) => engine,
            Err(e) => return require::skip(require::IO_URING, format_args!("io_uring unavailable here ({e})")),
        };
        let mut arena = AlignedBuf::zeroed(64 * 1024).expect("arena");
        let base = arena.as_mut_ptr();
        // SAFETY: `arena` outlives `engine` (declared before it is dropped at the end of the test:
        // the engine is dropped first as it is used last below).
        unsafe { engine.register_arena(base, arena.len()) };
        assert!(engine.pool.lock().idle.iter().all(|r| r.fixed.is_some()), "the arena is every ring's fixed buffer");
        let fixed_requests = || engine.pool.lock().idle.iter().map(|r| r.fixed_requests).sum::<usize>();
        let dir = tempfile::tempdir().expect("tempdir");
        let file = open_segment(&dir.path().join("seg"), true, probe_direct_io(dir.path())).expect("open");
        arena.as_mut_slice()[..8192].iter_mut().enumerate().for_each(|(i, x)| *x = (i % 13) as u8);
        // Two adjacent segments coalesce into one fixed request.
        // SAFETY: both halves lie in the arena, which outlives the submit.
        let mut ops = [unsafe { IoOp::new(&file, 0, &[(base, 4096), (base.add(4096), 4096)], true) }];
        assert_eq!(ops[0].iov.len(), 1, "adjacent segments coalesce");
        engine.submit(&mut ops);
        assert!(ops[0].result.is_ok());
        assert_eq!(fixed_requests(), 1, "the coalesced write went out as a fixed-buffer request");
        // SAFETY: as above; the read lands in the arena's second half.
        let mut ops = [unsafe { IoOp::new(&file, 0, &[(base.add(32 * 1024), 8192)], false) }];
        engine.submit(&mut ops);
        assert!(ops[0].result.is_ok());
        assert_eq!(fixed_requests(), 2, "the read into the arena went out as a fixed-buffer request");
        let a = arena.as_slice();
        assert_eq!(&a[32 * 1024..32 * 1024 + 8192], &a[..8192]);
        // A buffer outside the arena is vectored IO.
        let mut outside = AlignedBuf::zeroed(4096).expect("buf");
        // SAFETY: `outside` outlives the submit.
        let mut ops = [unsafe { IoOp::new(&file, 0, &[(outside.as_mut_ptr(), 4096)], false) }];
        engine.submit(&mut ops);
        assert!(ops[0].result.is_ok());
        assert_eq!(fixed_requests(), 2, "memory outside the arena is not a fixed buffer");
        assert_eq!(outside.as_slice(), &arena.as_slice()[..4096]);
        drop(engine);
    }

    /// A pipe whose write end gets `fill` bytes after `delay` (a read of the read end stays in
    /// flight until then).
    fn delayed_pipe(delay: std::time::Duration, fill: u8) -> (File, std::thread::JoinHandle<()>) {
        use std::io::Write;
        use std::os::fd::FromRawFd;
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just created and are owned by these files alone.
        let (r, mut w) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
        let writer = std::thread::spawn(move || {
            std::thread::sleep(delay);
            w.write_all(&[fill; 4096]).expect("pipe write");
        });
        (r, writer)
    }

    /// A completion left on a pooled ring by an earlier batch (here a timeout that fires in the
    /// middle of the next batch) is never taken for the next batch's op.
    #[test]
    fn io_uring_ignores_a_stale_completion_from_an_earlier_batch() {
        let engine = match UringEngine::new(16, 4) {
            Ok(engine) => engine,
            Err(e) => return require::skip(require::IO_URING, format_args!("io_uring unavailable here ({e})")),
        };
        let mut ring = engine.take_ring().expect("a ring");
        let ts = io_uring::types::Timespec::new().nsec(30_000_000);
        let stale = io_uring::opcode::Timeout::new(&ts).build().user_data(tag(ring.generation, 0));
        // SAFETY: `ts` outlives the timeout (the test waits well past it before returning).
        unsafe { ring.io.submission().push(&stale) }.expect("push");
        ring.io.submit().expect("submit");
        engine.put_ring(ring, true);
        let (pipe, writer) = delayed_pipe(std::time::Duration::from_millis(200), 0x5A);
        let mut buf = AlignedBuf::zeroed(4096).expect("buf");
        // SAFETY: `buf` outlives the submit and only this op uses it.
        let mut ops = [unsafe { IoOp::new(&pipe, 0, &[(buf.as_mut_ptr(), 4096)], false) }];
        engine.submit(&mut ops);
        writer.join().expect("writer");
        assert!(ops[0].result.is_ok(), "the timeout's completion was taken for the read: {:?}", ops[0].result);
        assert!(buf.as_slice().iter().all(|b| *b == 0x5A), "the read's bytes landed");
    }

    /// When io_uring_enter fails for real, the batch does not return while the kernel still holds
    /// its requests, and the ring is not put back in the pool.
    #[test]
    fn io_uring_waits_for_requests_in_flight_when_the_ring_fails_and_drops_the_ring() {
        let engine = match UringEngine::new(16, 4) {
            Ok(engine) => engine,
            Err(e) => return require::skip(require::IO_URING, format_args!("io_uring unavailable here ({e})")),
        };
        // The read cannot complete before the writer writes, 150 ms after this.
        let start = std::time::Instant::now();
        let (pipe, writer) = delayed_pipe(std::time::Duration::from_millis(150), 0x33);
        let mut buf = AlignedBuf::zeroed(4096).expect("buf");
        // SAFETY: `buf` outlives the submit and only this op uses it.
        let mut ops = [unsafe { IoOp::new(&pipe, 0, &[(buf.as_mut_ptr(), 4096)], false) }];
        *engine.inject_wait_error.lock() = Some(libc::EIO);
        engine.submit(&mut ops);
        let waited = start.elapsed();
        writer.join().expect("writer");
        assert!(waited >= std::time::Duration::from_millis(150), "returned after {waited:?} with the read in flight");
        assert!(ops[0].result.is_ok(), "the request completed for real: {:?}", ops[0].result);
        assert!(buf.as_slice().iter().all(|b| *b == 0x33));
        assert!(engine.pool.lock().idle.is_empty(), "a failed ring went back to the pool");
        assert_eq!(engine.pool.lock().alive, 0, "a failed ring no longer counts against the bound");
        // The engine still works (with a fresh ring).
        let (pipe, writer) = delayed_pipe(std::time::Duration::ZERO, 0x44);
        // SAFETY: as above.
        let mut ops = [unsafe { IoOp::new(&pipe, 0, &[(buf.as_mut_ptr(), 4096)], false) }];
        engine.submit(&mut ops);
        writer.join().expect("writer");
        assert!(ops[0].result.is_ok());
        assert_eq!(engine.pool.lock().idle.len(), 1);
    }

    /// Many threads submitting at once, each batch held in flight for a while: no more rings are
    /// ever made than the bound (each registering the arena once), the callers beyond it wait for
    /// a ring instead of making one, and every batch completes.
    #[test]
    fn concurrent_batches_never_make_more_rings_than_the_bound() {
        const BOUND: usize = 3;
        const THREADS: usize = 12;
        let engine = match UringEngine::new(16, BOUND) {
            Ok(engine) => engine,
            Err(e) => return require::skip(require::IO_URING, format_args!("io_uring unavailable here ({e})")),
        };
        let mut arena = AlignedBuf::zeroed(THREADS * 4096).expect("arena");
        let base = arena.as_mut_ptr() as usize;
        // SAFETY: `arena` outlives `engine`, which is dropped at the end of the scope below.
        unsafe { engine.register_arena(base as *mut u8, arena.len()) };
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let engine = &engine;
                s.spawn(move || {
                    for round in 0..2u8 {
                        // A read that stays in flight until its pipe is written, 50 ms from now:
                        // every thread holds its ring that long.
                        let fill = (t as u8).wrapping_mul(2).wrapping_add(round);
                        let (pipe, writer) = delayed_pipe(std::time::Duration::from_millis(50), fill);
                        let page = (base + t * 4096) as *mut u8;
                        // SAFETY: each thread reads into its own page of the arena, which
                        // outlives the submit.
                        let mut ops = [unsafe { IoOp::new(&pipe, 0, &[(page, 4096)], false) }];
                        engine.submit(&mut ops);
                        writer.join().expect("writer");
                        assert!(ops[0].result.is_ok(), "thread {t}: {:?}", ops[0].result);
                        // SAFETY: the read into this thread's page has completed.
                        let got = unsafe { std::slice::from_raw_parts(page, 4096) };
                        assert!(got.iter().all(|b| *b == fill), "thread {t} round {round}");
                    }
                });
            }
        });
        let pool = engine.pool.lock();
        assert!(pool.peak <= BOUND, "{} rings existed at once (bound {BOUND})", pool.peak);
        assert!(pool.alive <= BOUND && pool.idle.len() == pool.alive, "every ring came back");
        let registrations = engine.registrations.load(std::sync::atomic::Ordering::Relaxed);
        assert!(registrations <= BOUND, "the arena was registered {registrations} times");
        drop(pool);
        drop(engine);
    }

    #[test]
    fn psync_round_trips() {
        round_trip(&PsyncEngine);
    }

    #[test]
    fn io_uring_round_trips_or_skips() {
        match UringEngine::new(64, 4) {
            Ok(engine) => round_trip(&engine),
            Err(e) => require::skip(require::IO_URING, format_args!("io_uring unavailable here ({e})")),
        }
    }

    #[test]
    fn advance_drops_whole_and_partial_segments() {
        let mut buf = [0u8; 10];
        let p = buf.as_mut_ptr();
        let mut iov = vec![
            libc::iovec { iov_base: p.cast(), iov_len: 4 },
            libc::iovec {
                // SAFETY: inside `buf`.
                iov_base: unsafe { p.add(4) }.cast(),
                iov_len: 6,
            },
        ];
        advance(&mut iov, 5);
        assert_eq!(iov.len(), 1);
        assert_eq!(iov[0].iov_len, 5);
    }
}
