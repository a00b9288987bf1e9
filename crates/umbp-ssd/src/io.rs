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

use parking_lot::Mutex;

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

/// io_uring: a batch goes to one ring in one submission. Rings are pooled: a caller takes one (or
/// makes one) for its batch and puts it back, so concurrent callers never share a ring or a lock
/// across IO.
pub(crate) struct UringEngine {
    depth: u32,
    rings: Mutex<Vec<Ring>>,
    /// The staging arena `(base, len)`, registered as fixed buffer 0 of every ring.
    arena: Mutex<Option<(usize, usize)>>,
}

/// A ring and, when the arena is registered with it, the arena's address range.
struct Ring {
    io: io_uring::IoUring,
    fixed: Option<(usize, usize)>,
}

impl Ring {
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
        f.debug_struct("UringEngine").field("depth", &self.depth).finish_non_exhaustive()
    }
}

impl UringEngine {
    /// An engine whose rings have `depth` entries; fails when the kernel refuses io_uring (ENOSYS on
    /// old kernels, EPERM under seccomp or `io_uring_disabled`).
    pub(crate) fn new(depth: u32) -> io::Result<Self> {
        let ring = Ring { io: io_uring::IoUring::new(depth)?, fixed: None };
        Ok(Self { depth, rings: Mutex::new(vec![ring]), arena: Mutex::new(None) })
    }

    /// Pushes `ops[from..to]` onto the ring's submission queue; returns how many fit.
    fn push(ring: &mut Ring, ops: &[IoOp], from: usize, to: usize) -> usize {
        use io_uring::{opcode, types};
        let fixed = ring.fixed;
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
            let entry = match (single, op.write) {
                (Some((p, n)), true) => opcode::WriteFixed::new(types::Fd(op.fd), p, n, 0).offset(op.offset).build(),
                (Some((p, n)), false) => opcode::ReadFixed::new(types::Fd(op.fd), p, n, 0).offset(op.offset).build(),
                (None, true) => opcode::Writev::new(types::Fd(op.fd), op.iov.as_ptr(), cnt).offset(op.offset).build(),
                (None, false) => opcode::Readv::new(types::Fd(op.fd), op.iov.as_ptr(), cnt).offset(op.offset).build(),
            };
            // SAFETY: the iovec arrays and the memory they name stay valid until every completion
            // has been reaped by the caller (`IoOp::new`'s contract; `ops` is borrowed for the whole
            // call that reaps them).
            if unsafe { sq.push(&entry.user_data(i as u64)) }.is_err() {
                break;
            }
            queued += 1;
        }
        queued
    }

    /// Runs `ops` (which must fit the ring) with the hooks of `submit_split` / `submit_ordered`.
    fn run_hooked(
        ring: &mut Ring,
        ops: &mut [IoOp],
        split: usize,
        meanwhile: &mut dyn FnMut(),
        on_complete: &mut dyn FnMut(usize),
    ) {
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
        let mut done = vec![false; ops.len()];
        let mut remaining = first + second;
        while remaining > 0 {
            match ring.io.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    // io_uring_enter itself failed with an error other than EINTR or EBUSY: only a
                    // broken ring (bad fd or memory) does that, and it takes no further entry.
                    for (i, d) in done.iter().enumerate() {
                        if !d {
                            ops[i].result = Err(io::Error::new(e.kind(), format!("io_uring submit: {e}")));
                        }
                    }
                    return;
                }
            }
            let completed: Vec<(usize, i32)> =
                ring.io.completion().map(|cqe| (cqe.user_data() as usize, cqe.result())).collect();
            for (i, res) in completed {
                if i >= ops.len() || done[i] {
                    continue;
                }
                done[i] = true;
                remaining -= 1;
                ops[i].result = Self::finish(&mut ops[i], res);
                on_complete(i);
            }
        }
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

    /// A ring from the pool, or a new one; `None` when the kernel will not give one (memlock
    /// limits), in which case the caller runs its batch with psync.
    fn take_ring(&self) -> Option<Ring> {
        let taken = self.rings.lock().pop();
        taken.or_else(|| match io_uring::IoUring::new(self.depth) {
            Ok(io) => {
                let mut ring = Ring { io, fixed: None };
                ring.register(*self.arena.lock());
                Some(ring)
            }
            Err(e) => {
                tracing::debug!(error = %e, "no io_uring ring available; running the batch with psync");
                None
            }
        })
    }

    fn put_ring(&self, ring: Ring) {
        let mut rings = self.rings.lock();
        // Keep a few rings for the next callers; drop the rest.
        if rings.len() < 16 {
            rings.push(ring);
        }
    }

    fn run(&self, ring: &mut Ring, ops: &mut [IoOp]) {
        let queued = Self::push(ring, ops, 0, ops.len());
        let mut done = vec![None::<i32>; queued];
        let mut remaining = queued;
        while remaining > 0 {
            match ring.io.submit_and_wait(1) {
                Ok(_) => {}
                // Interrupted, or the completion queue is full (EBUSY): reap and go on.
                Err(e) if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    // The ring itself failed (not an op): the kernel took no entry it could still be
                    // working on, so failing the unfinished ops is safe.
                    for (i, d) in done.iter().enumerate() {
                        if d.is_none() {
                            ops[i].result = Err(io::Error::new(e.kind(), format!("io_uring submit: {e}")));
                        }
                    }
                    return;
                }
            }
            for cqe in ring.io.completion() {
                let i = cqe.user_data() as usize;
                if let Some(slot) = done.get_mut(i)
                    && slot.is_none()
                {
                    *slot = Some(cqe.result());
                    remaining -= 1;
                }
            }
        }
        for (i, res) in done.into_iter().enumerate() {
            let op = &mut ops[i];
            let res = res.unwrap_or(-libc::EIO);
            op.result = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else {
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
            };
        }
        // Ops the ring had no room for run on the next round.
        if queued < ops.len() {
            self.run(ring, &mut ops[queued..]);
        }
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
                self.run(&mut ring, ops);
                self.put_ring(ring);
            }
            None => PsyncEngine.submit(ops),
        }
    }

    unsafe fn register_arena(&self, base: *mut u8, len: usize) {
        let arena = Some((base as usize, len));
        *self.arena.lock() = arena;
        for ring in self.rings.lock().iter_mut() {
            ring.register(arena);
        }
    }

    fn overlaps(&self) -> bool {
        true
    }

    fn submit_split(&self, ops: &mut [IoOp], split: usize, meanwhile: &mut dyn FnMut()) {
        let ring = (ops.len() <= self.depth as usize && split <= ops.len()).then(|| self.take_ring()).flatten();
        match ring {
            Some(mut ring) => {
                Self::run_hooked(&mut ring, ops, split, meanwhile, &mut |_| {});
                self.put_ring(ring);
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
                Self::run_hooked(&mut ring, ops, n, &mut || {}, on_complete);
                self.put_ring(ring);
            }
            None => {
                self.submit(ops);
                (0..ops.len()).for_each(on_complete);
            }
        }
    }
}

/// Builds the engine `kind` names.
pub(crate) fn make_engine(kind: IoEngineKind, depth: u32) -> io::Result<Box<dyn IoEngine>> {
    Ok(match kind {
        IoEngineKind::Psync => Box::new(PsyncEngine),
        IoEngineKind::IoUring => Box::new(UringEngine::new(depth)?),
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
        let Ok(engine) = UringEngine::new(16) else {
            eprintln!("skipped: io_uring unavailable here");
            return;
        };
        let mut arena = AlignedBuf::zeroed(64 * 1024).expect("arena");
        let base = arena.as_mut_ptr();
        // SAFETY: `arena` outlives `engine` (declared before it is dropped at the end of the test:
        // the engine is dropped first as it is used last below).
        unsafe { engine.register_arena(base, arena.len()) };
        let registered = engine.rings.lock().iter().all(|r| r.fixed.is_some());
        let dir = tempfile::tempdir().expect("tempdir");
        let file = open_segment(&dir.path().join("seg"), true, probe_direct_io(dir.path())).expect("open");
        arena.as_mut_slice()[..8192].iter_mut().enumerate().for_each(|(i, x)| *x = (i % 13) as u8);
        // Two adjacent segments coalesce into one fixed request.
        // SAFETY: both halves lie in the arena, which outlives the submit.
        let mut ops = [unsafe { IoOp::new(&file, 0, &[(base, 4096), (base.add(4096), 4096)], true) }];
        assert_eq!(ops[0].iov.len(), 1, "adjacent segments coalesce");
        engine.submit(&mut ops);
        assert!(ops[0].result.is_ok());
        // SAFETY: as above; the read lands in the arena's second half.
        let mut ops = [unsafe { IoOp::new(&file, 0, &[(base.add(32 * 1024), 8192)], false) }];
        engine.submit(&mut ops);
        assert!(ops[0].result.is_ok());
        let a = arena.as_slice();
        assert_eq!(&a[32 * 1024..32 * 1024 + 8192], &a[..8192]);
        eprintln!("fixed buffers registered: {registered}");
        drop(engine);
    }

    #[test]
    fn psync_round_trips() {
        round_trip(&PsyncEngine);
    }

    #[test]
    fn io_uring_round_trips_or_skips() {
        match UringEngine::new(64) {
            Ok(engine) => round_trip(&engine),
            Err(e) => eprintln!("skipped: io_uring unavailable here ({e})"),
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
