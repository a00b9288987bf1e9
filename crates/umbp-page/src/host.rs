//! Host DRAM as a paged medium: private anonymous mappings (reference §3), or, with
//! [`HostMemoryOptions::shareable`], sealed memory files another process on this host may map.
//!
//! Each buffer is one `mmap`, rounded up to 4 KiB. With huge pages requested, hugetlb is tried first
//! and any failure (commonly: no pages reserved in `/proc/sys/vm/nr_hugepages`) falls back to a normal
//! mapping advised `MADV_HUGEPAGE`, so transparent huge pages still apply where the kernel allows;
//! the fallback is logged once per source. After mapping: optional NUMA binding (`mbind`; failure
//! only warns, once per source) and optional prefault (`MADV_POPULATE_WRITE`), so the first transfer
//! into a page does not pay for the page fault. Only a kernel without `MADV_POPULATE_WRITE` (before
//! 5.14) gets the fallback of one write per page; any other populate failure means the memory cannot
//! be backed, and the allocation fails instead of touching it (which would be an OOM kill or a
//! `SIGBUS`).
//!
//! # Platforms
//! Linux only: `mbind` (`SYS_mbind`), `MAP_HUGETLB` with `MAP_HUGE_SHIFT`, `MADV_POPULATE_WRITE` and
//! `/proc/meminfo` have no portable equivalent.

// Fail the build on other targets with one clear message instead of a screen of unresolved `libc`
// and `rustix` names: every piece of this source (hugetlb flags, `mbind`, `MADV_POPULATE_WRITE`,
// `/proc/meminfo`) is Linux-specific, and `PageBackend` without a host source is not a useful crate.
#[cfg(not(target_os = "linux"))]
compile_error!(
    "umbp-page supports Linux only: HostPageMemorySource needs mmap with MAP_HUGETLB/MAP_HUGE_SHIFT, \
     mbind (SYS_mbind) and madvise(MADV_POPULATE_WRITE)"
);

use std::ffi::c_void;
use std::io;
use std::os::fd::OwnedFd;
use std::ptr::{self, NonNull};

use parking_lot::Mutex;
use rustix::io::Errno;
use rustix::mm::{Advice, MapFlags, ProtFlags};
use umbp_core::MemoryLocation;

use crate::source::{PageMemorySource, RawBuffer, SourceError};

/// The name this source reports.
const NAME: &str = "HostPageMemorySource";
/// The base page size every mapping is rounded to.
const BASE_PAGE: u64 = 4096;
/// The largest NUMA node we build a node mask for (the kernel refuses masks over one 4 KiB page of
/// bits anyway); larger nodes are reported and skipped rather than allocating a huge mask.
const MAX_NUMA_NODE: u32 = 8 * 4096 - 2;

/// Settings of a [`HostPageMemorySource`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMemoryOptions {
    /// Try hugetlb pages of [`hugepage_size`](Self::hugepage_size) first, falling back to normal pages
    /// advised for transparent huge pages. Default: `false`.
    pub use_hugepages: bool,
    /// The hugetlb page size; with `use_hugepages` set it must be a power of two of at least 4 KiB
    /// (the kernel picks the pool by its log2). Default: 2 MiB.
    pub hugepage_size: u64,
    /// Bind each buffer to this NUMA node (`MPOL_BIND`); a failing bind only warns, once per source.
    /// Default: `None` (the kernel's policy).
    pub numa_node: Option<u32>,
    /// Fault every page in at allocation time; memory the kernel cannot back then fails the
    /// allocation. Default: `true`.
    pub prefault: bool,
    /// Advise normal (non-hugetlb) mappings `MADV_HUGEPAGE`, so the kernel backs them with
    /// transparent huge pages where it can (THP `madvise` or `always` mode): a long-lived arena
    /// copied in and out at memory speed, and pinned for `O_DIRECT` IO, pays a TLB miss and a page
    /// pin per 2 MiB instead of per 4 KiB. Best effort: THP off (`never`) is not an error.
    /// Default: `true`.
    pub transparent_hugepages: bool,
    /// Make every buffer shareable with other processes on this host: a sealed memory file
    /// (`memfd_create`, sealed against shrinking and growing) mapped `MAP_SHARED` instead of a private
    /// anonymous mapping, with the same huge-page, NUMA and prefault behaviour. Each buffer then
    /// reports its file ([`RawBuffer::shared_backing`]) so the registrar may hand it to a same-host
    /// peer; see `shared.rs` for what the seals guarantee. Default: `false`.
    pub shareable: bool,
}

impl Default for HostMemoryOptions {
    fn default() -> Self {
        Self {
            use_hugepages: false,
            hugepage_size: 2 * 1024 * 1024,
            numa_node: None,
            prefault: true,
            transparent_hugepages: true,
            shareable: false,
        }
    }
}

/// One mapping this source owns.
#[derive(Debug)]
struct Mapping {
    /// Base and mapped length (the usable size reported).
    buffer: RawBuffer,
    /// Whether it is backed by hugetlb pages.
    hugetlb: bool,
    /// The memory file behind a shareable buffer, closed (by drop) after the buffer is unmapped.
    _file: Option<OwnedFd>,
}

#[derive(Debug, Default)]
struct State {
    mappings: Vec<Mapping>,
    /// The hugetlb fallback has been logged.
    warned_hugetlb_fallback: bool,
    /// A failed NUMA bind has been logged.
    warned_numa_bind: bool,
    /// That shareable buffers get no transparent huge pages on this host has been logged.
    noted_shmem_thp: bool,
}

/// How a buffer is populated: `madvise(MADV_POPULATE_WRITE)` outside tests.
type Populate = fn(&RawBuffer) -> rustix::io::Result<()>;

/// Host memory from private anonymous mappings; see the module docs.
///
/// Every buffer stays mapped until [`release`](PageMemorySource::release) or drop.
#[derive(Debug)]
pub struct HostPageMemorySource {
    options: HostMemoryOptions,
    state: Mutex<State>,
    populate: Populate,
}

impl HostPageMemorySource {
    /// A source that maps memory as `options` say. Nothing is mapped until
    /// [`allocate`](PageMemorySource::allocate).
    pub fn new(options: HostMemoryOptions) -> Self {
        Self { options, state: Mutex::new(State::default()), populate: populate_write }
    }

    /// A source whose prefault step calls `populate` instead of `MADV_POPULATE_WRITE`, to inject its
    /// failures.
    #[cfg(test)]
    fn with_populate(options: HostMemoryOptions, populate: Populate) -> Self {
        Self { options, state: Mutex::new(State::default()), populate }
    }

    /// The settings.
    pub fn options(&self) -> &HostMemoryOptions {
        &self.options
    }

    /// Whether any buffer currently held is backed by hugetlb pages (false after a fallback).
    pub fn used_hugetlb(&self) -> bool {
        self.state.lock().mappings.iter().any(|m| m.hugetlb)
    }

    /// Bytes currently mapped, across all buffers.
    pub fn mapped_bytes(&self) -> u64 {
        self.state.lock().mappings.iter().map(|m| m.buffer.len()).sum()
    }

    /// Whether the hugetlb fallback warning has been emitted.
    #[cfg(test)]
    pub(crate) fn warned_hugetlb_fallback(&self) -> bool {
        self.state.lock().warned_hugetlb_fallback
    }

    /// Whether the shmem THP mode has been looked at (once, for the first shareable buffer advised
    /// huge pages).
    #[cfg(test)]
    pub(crate) fn noted_shmem_thp(&self) -> bool {
        self.state.lock().noted_shmem_thp
    }

    /// Whether the failed-bind warning has been emitted.
    #[cfg(test)]
    pub(crate) fn warned_numa_bind(&self) -> bool {
        self.state.lock().warned_numa_bind
    }

    /// Whether the held buffer at `base` is backed by hugetlb pages; `None` when no buffer starts there.
    #[cfg(test)]
    pub(crate) fn hugetlb_at(&self, base: NonNull<u8>) -> Option<bool> {
        self.state.lock().mappings.iter().find(|m| m.buffer.base() == base).map(|m| m.hugetlb)
    }

    /// Buffers currently held.
    #[cfg(test)]
    pub(crate) fn mapping_count(&self) -> usize {
        self.state.lock().mappings.len()
    }

    fn invalid(reason: String) -> SourceError {
        SourceError::Invalid { source_name: NAME.to_owned(), reason }
    }

    /// A fresh read-write mapping of `len` bytes: a sealed memory file when the buffers are
    /// shareable (with the file), else private anonymous memory.
    fn map(&self, len: u64, hugepage_size: Option<u64>) -> io::Result<(RawBuffer, Option<OwnedFd>)> {
        if self.options.shareable {
            crate::shared::map_memfd(len, hugepage_size).map(|(buffer, file)| (buffer, Some(file)))
        } else {
            map_anonymous(len, hugepage_size).map(|buffer| (buffer, None))
        }
    }

    /// Maps, binds and prefaults one buffer of at least `size` bytes. On error nothing of this buffer
    /// stays mapped.
    fn map_one(&self, state: &mut State, size: u64) -> Result<Mapping, SourceError> {
        let len = round_up(size, BASE_PAGE)
            .ok_or_else(|| Self::invalid(format!("{size} bytes overflow when rounded up to {BASE_PAGE}")))?;
        let mut mapping = None;
        if self.options.use_hugepages {
            let huge = self.options.hugepage_size;
            let huge_len = round_up(size, huge)
                .ok_or_else(|| Self::invalid(format!("{size} bytes overflow when rounded up to {huge}")))?;
            match self.map(huge_len, Some(huge)) {
                Ok((buffer, file)) => mapping = Some(Mapping { buffer, hugetlb: true, _file: file }),
                Err(err) => {
                    if !state.warned_hugetlb_fallback {
                        state.warned_hugetlb_fallback = true;
                        tracing::warn!(
                            source = NAME,
                            hugepage_size = huge,
                            error = %err,
                            meminfo = %hugepage_meminfo(),
                            "hugetlb mapping failed; falling back to normal pages with transparent huge pages"
                        );
                    }
                }
            }
        }
        let mapping = match mapping {
            Some(mapping) => mapping,
            None => {
                let (buffer, file) = self.map(len, None).map_err(|source| SourceError::Allocation {
                    source_name: NAME.to_owned(),
                    requested: size,
                    source,
                })?;
                if self.options.use_hugepages || self.options.transparent_hugepages {
                    if file.is_some() && !state.noted_shmem_thp {
                        state.noted_shmem_thp = true;
                        note_shmem_thp();
                    }
                    // Best effort: THP may be disabled ("never"), which is not an error for us.
                    // SAFETY: `buffer` is a live mapping of exactly `len()` bytes owned by this call.
                    let advised =
                        unsafe { rustix::mm::madvise(buffer_ptr(&buffer), map_len(&buffer), Advice::LinuxHugepage) };
                    if let Err(err) = advised {
                        tracing::debug!(source = NAME, error = %err, "madvise(MADV_HUGEPAGE) failed");
                    }
                }
                Mapping { buffer, hugetlb: false, _file: file }
            }
        };
        if let Some(node) = self.options.numa_node
            && let Err(reason) = bind_to_node(&mapping.buffer, node)
            && !state.warned_numa_bind
        {
            // The memory is still usable, only not placed; one warning per source is enough.
            state.warned_numa_bind = true;
            tracing::warn!(source = NAME, node, error = %reason, "mbind(MPOL_BIND) failed; memory not bound");
        }
        if self.options.prefault {
            let stride = if mapping.hugetlb { self.options.hugepage_size } else { BASE_PAGE };
            if let Err(errno) = prefault_with(&mapping.buffer, stride, self.populate) {
                unmap(&mapping.buffer);
                return Err(SourceError::Allocation {
                    source_name: NAME.to_owned(),
                    requested: size,
                    source: io::Error::from_raw_os_error(errno.raw_os_error()),
                });
            }
        }
        Ok(mapping)
    }
}

/// An owned region of host memory of the kind a [`HostPageMemorySource`] with default options hands
/// out — an anonymous mapping advised for transparent huge pages, prefaulted — for code that needs a
/// buffer like the pool's own, such as a benchmark baseline that must pay the same per-page costs
/// (a page pin per `O_DIRECT` request, a TLB entry per copy) as the medium it is compared with.
/// Unmapped on drop (its source releases its mapping).
#[derive(Debug)]
pub struct HostRegion {
    /// Owns the mapping: dropping it unmaps the region.
    _source: HostPageMemorySource,
    buffer: RawBuffer,
    /// Where the region starts in `buffer`: its first huge-page boundary.
    offset: usize,
    len: usize,
}

impl HostRegion {
    /// A zeroed region of `len` bytes (more than zero). The mapping behind it is whole 2 MiB huge
    /// pages long, so that huge pages can back even a short region, as they back a medium's arena.
    pub fn new(len: usize) -> Result<Self, SourceError> {
        if len == 0 {
            return Err(HostPageMemorySource::invalid("a region of 0 bytes".to_owned()));
        }
        let options = HostMemoryOptions::default();
        let huge = options.hugepage_size;
        // One huge page more than the whole pages asked for, so the region can start on a huge-page
        // boundary whatever address the kernel picks (older kernels do not align large mappings).
        let mapped = (len as u64)
            .checked_next_multiple_of(huge)
            .and_then(|l| l.checked_add(huge))
            .ok_or_else(|| HostPageMemorySource::invalid(format!("a region of {len} bytes")))?;
        let source = HostPageMemorySource::new(options);
        let buffer = source
            .allocate(&[mapped])?
            .pop()
            .ok_or_else(|| HostPageMemorySource::invalid(format!("no mapping for a region of {len} bytes")))?;
        let offset = buffer.base().as_ptr().align_offset(huge as usize);
        Ok(Self { _source: source, buffer, offset, len })
    }

    /// The region's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the buffer is a live read-write mapping of at least `offset + len` bytes (`offset`
        // is under one huge page, which `new` mapped extra) owned by `self._source`, unmapped only
        // when `self` drops; `&self` keeps it alive and unwritten.
        unsafe { std::slice::from_raw_parts(self.buffer.base().as_ptr().add(self.offset), self.len) }
    }

    /// The region's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.buffer.base().as_ptr().add(self.offset), self.len) }
    }
}

impl Drop for HostPageMemorySource {
    fn drop(&mut self) {
        self.release();
    }
}

impl PageMemorySource for HostPageMemorySource {
    fn allocate(&self, sizes: &[u64]) -> Result<Vec<RawBuffer>, SourceError> {
        let huge = self.options.hugepage_size;
        if self.options.use_hugepages && (!huge.is_power_of_two() || huge < BASE_PAGE) {
            return Err(Self::invalid(format!("hugepage_size {huge} is not a power of two of at least {BASE_PAGE}")));
        }
        // Held across the mmaps: allocation happens at init, and a concurrent release must not miss
        // buffers of a call in flight.
        let mut state = self.state.lock();
        let mut mapped: Vec<Mapping> = Vec::with_capacity(sizes.len());
        for &size in sizes.iter().filter(|&&s| s != 0) {
            match self.map_one(&mut state, size) {
                Ok(mapping) => mapped.push(mapping),
                Err(err) => {
                    // All or nothing: give back this call's buffers only.
                    for mapping in mapped {
                        unmap(&mapping.buffer);
                    }
                    return Err(err);
                }
            }
        }
        let buffers = mapped.iter().map(|m| m.buffer).collect();
        state.mappings.extend(mapped);
        Ok(buffers)
    }

    fn release(&self) {
        let mappings = std::mem::take(&mut self.state.lock().mappings);
        for mapping in mappings {
            unmap(&mapping.buffer);
        }
    }

    fn location(&self) -> MemoryLocation {
        MemoryLocation::Host
    }

    fn name(&self) -> &str {
        NAME
    }
}

/// `value` rounded up to a multiple of `align` (a power of two), `None` on overflow or when it does
/// not fit the address space.
fn round_up(value: u64, align: u64) -> Option<u64> {
    let rounded = value.checked_add(align - 1)? & !(align - 1);
    usize::try_from(rounded).ok().map(|_| rounded)
}

fn buffer_ptr(buffer: &RawBuffer) -> *mut c_void {
    buffer.base().as_ptr().cast()
}

fn map_len(buffer: &RawBuffer) -> usize {
    // Every mapping's length came from a `usize` (see `round_up`).
    buffer.len() as usize
}

/// A private, read-write anonymous mapping of `len` bytes (`len` fits a `usize`, checked by
/// `round_up`); hugetlb pages of `hugepage_size` bytes when given.
fn map_anonymous(len: u64, hugepage_size: Option<u64>) -> io::Result<RawBuffer> {
    let len_usize = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut flags = MapFlags::PRIVATE;
    if let Some(huge) = hugepage_size {
        // MAP_HUGE_SHIFT encoding: log2 of the page size in bits 26..32, next to MAP_HUGETLB.
        let encoded = huge.trailing_zeros() << libc::MAP_HUGE_SHIFT;
        flags |= MapFlags::HUGETLB | MapFlags::from_bits_retain(encoded);
    }
    // SAFETY: a null hint and no MAP_FIXED: the kernel picks a fresh range, so no existing memory is
    // replaced.
    let ptr =
        unsafe { rustix::mm::mmap_anonymous(ptr::null_mut(), len_usize, ProtFlags::READ | ProtFlags::WRITE, flags) }?;
    let Some(base) = NonNull::new(ptr.cast::<u8>()) else {
        // Only possible with MAP_FIXED at 0, which we never ask for.
        return Err(io::Error::other("mmap returned a null address"));
    };
    // SAFETY: `base` is a fresh read-write mapping of `len` bytes, unmapped only by `unmap`, which this
    // module calls only when the source gives the buffer back (release, drop, or a failed call that
    // never handed it out).
    Ok(unsafe { RawBuffer::new(base, len) })
}

/// Unmaps `buffer`; a failure is logged and the buffer forgotten anyway (retrying cannot help).
fn unmap(buffer: &RawBuffer) {
    // SAFETY: `buffer` is a mapping made by `map_anonymous` that the caller owns and drops right after
    // (taken out of the source's state by `release`, or never handed out by a failed `allocate`), so
    // it is unmapped exactly once; `release`'s contract has the user deregister and stop using it.
    let result = unsafe { rustix::mm::munmap(buffer_ptr(buffer), map_len(buffer)) };
    if let Err(err) = result {
        tracing::error!(source = NAME, base = ?buffer.base(), len = buffer.len(), error = %err, "munmap failed");
    }
}

/// Binds `buffer` to NUMA node `node` with `MPOL_BIND`; the error says why it did not bind (the
/// caller decides whether to warn).
fn bind_to_node(buffer: &RawBuffer, node: u32) -> io::Result<()> {
    if node > MAX_NUMA_NODE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("NUMA node {node} is out of range (at most {MAX_NUMA_NODE})"),
        ));
    }
    let bits = libc::c_ulong::BITS;
    let mut mask = vec![0 as libc::c_ulong; node as usize / bits as usize + 1];
    mask[node as usize / bits as usize] |= 1 << (node % bits);
    // The kernel reads `maxnode - 1` bits, so pass one more than the mask holds.
    let maxnode = (mask.len() as libc::c_ulong) * libc::c_ulong::from(bits) + 1;
    // SAFETY: `mbind` only changes the policy of the range, which is our own live mapping of `len`
    // bytes; `mask` outlives the call and holds `maxnode - 1` bits.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            buffer_ptr(buffer),
            map_len(buffer),
            libc::MPOL_BIND as libc::c_ulong,
            mask.as_ptr(),
            maxnode,
            0 as libc::c_ulong,
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// `madvise(MADV_POPULATE_WRITE)` over the whole buffer (Linux 5.14+).
fn populate_write(buffer: &RawBuffer) -> rustix::io::Result<()> {
    // SAFETY: populating only faults pages of our own live mapping in; contents stay zero.
    unsafe { rustix::mm::madvise(buffer_ptr(buffer), map_len(buffer), Advice::LinuxPopulateWrite) }
}

/// What a failed `MADV_POPULATE_WRITE` means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PopulateFailure {
    /// The kernel does not know the advice (`EINVAL` before 5.14, `ENOSYS`, `EOPNOTSUPP`): touching
    /// each page is the fallback.
    Unsupported,
    /// The memory cannot be backed (`ENOMEM`, `EFAULT`: a fault would `SIGBUS`, `EHWPOISON`, …):
    /// touching it would get the process OOM-killed or `SIGBUS`ed, so the allocation fails.
    CannotBack,
}

fn classify_populate_error(errno: Errno) -> PopulateFailure {
    if errno == Errno::INVAL || errno == Errno::NOSYS || errno == Errno::OPNOTSUPP {
        PopulateFailure::Unsupported
    } else {
        PopulateFailure::CannotBack
    }
}

/// Faults every page of `buffer` in with `populate`; where the kernel lacks it, one write per
/// `stride`. Memory the kernel cannot back is an error, and nothing is touched.
fn prefault_with(
    buffer: &RawBuffer,
    stride: u64,
    populate: impl FnOnce(&RawBuffer) -> rustix::io::Result<()>,
) -> Result<(), Errno> {
    let Err(errno) = populate(buffer) else { return Ok(()) };
    match classify_populate_error(errno) {
        PopulateFailure::Unsupported => {
            tracing::debug!(source = NAME, error = %errno, "MADV_POPULATE_WRITE unsupported; touching each page");
            touch_pages(buffer, stride);
            Ok(())
        }
        PopulateFailure::CannotBack => Err(errno),
    }
}

/// Writes one zero byte every `stride` bytes of a fresh mapping, faulting each page in.
fn touch_pages(buffer: &RawBuffer, stride: u64) {
    let base = buffer.base().as_ptr();
    // A stride is a page size (4 KiB or a hugepage size no larger than the mapping), so it fits.
    for offset in (0..map_len(buffer)).step_by(stride as usize) {
        // SAFETY: `offset < len`, inside our live read-write mapping; nobody else has the buffer yet,
        // and writing zero keeps the contents of fresh anonymous memory unchanged.
        unsafe { base.add(offset).write_volatile(0) };
    }
}

/// Tells the operator, once per source, when a shareable buffer's huge-page advice will count for
/// nothing: the host keeps shared memory on 4 KiB pages (`shmem_enabled` `never` or `deny`), so the
/// medium and every same-host reader's mapping of it take 4 KiB page faults and ~2 MiB of page
/// tables per GiB mapped, per process. On the 2-core VM, same-host batch copies read ~1.05 of
/// memcpy from memory under `advise` against 0.84–0.92 under `never` (separate runs;
/// docs/benchmarks.md, "Shared memory with huge pages").
fn note_shmem_thp() {
    if let Some(mode) = crate::shared::shmem_thp_mode()
        && crate::shared::shmem_thp_refused(&mode)
    {
        tracing::info!(
            source = NAME,
            shmem_enabled = %mode,
            "shared memory gets 4 KiB pages on this host; for 2 MiB pages on the same-host path, \
             set /sys/kernel/mm/transparent_hugepage/shmem_enabled to advise (as root)"
        );
    }
}

/// The `HugePages_Total` and `HugePages_Free` lines of `/proc/meminfo`, for the fallback warning.
fn hugepage_meminfo() -> String {
    match std::fs::read_to_string("/proc/meminfo") {
        Ok(text) => hugepage_lines(&text),
        Err(err) => format!("/proc/meminfo unreadable: {err}"),
    }
}

/// The `HugePages_Total` and `HugePages_Free` lines of a `/proc/meminfo` text, whitespace collapsed
/// and joined by `", "`.
fn hugepage_lines(meminfo: &str) -> String {
    let lines: Vec<String> = meminfo
        .lines()
        .filter(|l| l.starts_with("HugePages_Total:") || l.starts_with("HugePages_Free:"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    if lines.is_empty() { "no HugePages lines in /proc/meminfo".to_owned() } else { lines.join(", ") }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::process::Command;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tracing::{Level, Metadata, Subscriber, span};

    use super::*;

    fn source(options: HostMemoryOptions) -> HostPageMemorySource {
        HostPageMemorySource::new(options)
    }

    /// The `VmFlags` line of `/proc/self/smaps` for the mapping containing `addr`.
    pub(crate) fn vm_flags_at(addr: usize) -> String {
        let text = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in text.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((start, end)) = range.split_once('-')
                && let (Ok(start), Ok(end)) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16))
            {
                inside = (start..end).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.to_owned();
            }
        }
        panic!("no mapping at {addr:#x}")
    }

    #[test]
    fn normal_mappings_are_advised_for_transparent_huge_pages_unless_turned_off() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            return umbp_testkit::require::skip(
                umbp_testkit::require::THP,
                "this kernel has no transparent huge pages",
            );
        }
        let advised = |options: HostMemoryOptions| {
            let s = source(HostMemoryOptions { prefault: false, ..options });
            let b = s.allocate(&[4 << 20]).expect("allocate").pop().expect("one buffer");
            vm_flags_at(b.base().as_ptr() as usize).split_whitespace().any(|f| f == "hg")
        };
        assert!(advised(HostMemoryOptions::default()), "advised MADV_HUGEPAGE by default");
        assert!(!advised(HostMemoryOptions { transparent_hugepages: false, ..HostMemoryOptions::default() }));
    }

    #[test]
    fn a_host_region_is_zeroed_writable_and_exactly_as_long_as_asked() {
        let mut r = HostRegion::new(5000).expect("region");
        assert_eq!(r.as_slice().len(), 5000);
        assert_eq!(r.as_slice().as_ptr() as usize % (2 << 20), 0, "starts on a huge-page boundary");
        assert!(r.as_slice().iter().all(|b| *b == 0));
        r.as_mut_slice().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        assert!(r.as_slice().iter().enumerate().all(|(i, b)| *b == i as u8));
        assert!(matches!(HostRegion::new(0), Err(SourceError::Invalid { .. })));
    }

    /// Writes a pattern over the whole buffer and reads it back.
    fn check_round_trip(buffer: &RawBuffer, seed: u8) {
        let len = map_len(buffer);
        // SAFETY: the buffer is a live read-write mapping of `len` bytes owned by the test's source.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buffer.base().as_ptr(), len) };
        assert!(bytes.iter().step_by(4096).all(|&b| b == 0), "fresh memory is zeroed");
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == (i as u8).wrapping_mul(31).wrapping_add(seed)));
    }

    /// `mincore` over `[addr, addr + len)`: one residency byte per 4 KiB page, or `ENOMEM` when part
    /// of the range is not mapped. `out` is reused so that the call itself allocates nothing.
    fn mincore(addr: *mut u8, len: usize, out: &mut Vec<u8>) -> Result<(), Errno> {
        out.clear();
        out.resize(len.div_ceil(4096), 0);
        // SAFETY: `mincore` only reads the page tables of the range and writes `len / 4096` bytes
        // (rounded up) to `out`, which holds that many.
        let rc = unsafe { libc::mincore(addr.cast(), len, out.as_mut_ptr()) };
        if rc == 0 { Ok(()) } else { Err(Errno::from_io_error(&io::Error::last_os_error()).unwrap_or(Errno::IO)) }
    }

    /// How many 4 KiB pages of `buffer` are resident.
    fn resident_pages(buffer: &RawBuffer) -> usize {
        let mut out = Vec::new();
        mincore(buffer.base().as_ptr(), map_len(buffer), &mut out).unwrap();
        out.iter().filter(|&&b| b & 1 != 0).count()
    }

    #[test]
    fn defaults_match_the_reference() {
        let o = HostMemoryOptions::default();
        assert!(!o.use_hugepages);
        assert_eq!(o.hugepage_size, 2 << 20);
        assert_eq!(o.numa_node, None);
        assert!(o.prefault);
        assert!(!o.shareable, "private memory until the shared data path is on by default");
    }

    #[test]
    fn identity() {
        let s = source(HostMemoryOptions::default());
        assert_eq!(s.location(), MemoryLocation::Host);
        assert_eq!(s.device(), None);
        assert_eq!(s.name(), "HostPageMemorySource");
        assert_eq!(s.options(), &HostMemoryOptions::default());
    }

    #[test]
    fn allocates_one_buffer_per_size_rounded_to_4k() {
        let s = source(HostMemoryOptions::default());
        let buffers = s.allocate(&[10_000, 64 * 1024]).unwrap();
        assert_eq!(buffers.len(), 2);
        assert_eq!(buffers[0].len(), 12_288);
        assert_eq!(buffers[1].len(), 64 * 1024);
        for (i, b) in buffers.iter().enumerate() {
            assert_eq!(b.len() % 4096, 0);
            assert_eq!(resident_pages(b), map_len(b) / 4096, "prefault faulted every page in");
            check_round_trip(b, i as u8);
        }
        assert_ne!(buffers[0].base(), buffers[1].base());
        assert_eq!(s.mapped_bytes(), 12_288 + 64 * 1024);
        assert!(!s.used_hugetlb());
    }

    #[test]
    fn zero_sizes_are_skipped() {
        let s = source(HostMemoryOptions::default());
        let buffers = s.allocate(&[0, 4096, 0]).unwrap();
        assert_eq!(buffers.len(), 1);
        assert!(s.allocate(&[0]).unwrap().is_empty());
        assert!(s.allocate(&[]).unwrap().is_empty());
        assert_eq!(s.mapping_count(), 1);
    }

    #[test]
    fn calls_accumulate_and_release_is_idempotent() {
        let s = source(HostMemoryOptions::default());
        s.allocate(&[4096]).unwrap();
        s.allocate(&[8192, 4096]).unwrap();
        assert_eq!(s.mapping_count(), 3);
        s.release();
        assert_eq!(s.mapping_count(), 0);
        s.release();
        assert_eq!(s.mapped_bytes(), 0);
        // Still usable after a release.
        let b = s.allocate(&[4096]).unwrap();
        check_round_trip(&b[0], 7);
    }

    /// Counts WARN events on the thread it is installed on.
    struct WarnCounter(Arc<AtomicUsize>);

    impl Subscriber for WarnCounter {
        fn enabled(&self, _: &Metadata<'_>) -> bool {
            true
        }
        fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
            span::Id::from_u64(1)
        }
        fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
        fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
        fn event(&self, event: &tracing::Event<'_>) {
            if *event.metadata().level() == Level::WARN {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        fn enter(&self, _: &span::Id) {}
        fn exit(&self, _: &span::Id) {}
    }

    /// Runs `f` and returns the WARN events it emitted on this thread.
    fn warnings_of(f: impl FnOnce()) -> usize {
        let warns = Arc::new(AtomicUsize::new(0));
        tracing::subscriber::with_default(WarnCounter(Arc::clone(&warns)), f);
        warns.load(Ordering::SeqCst)
    }

    #[test]
    fn hugepages_fall_back_per_buffer_and_warn_once() {
        const HUGE: u64 = 2 << 20;
        let s = source(HostMemoryOptions { use_hugepages: true, ..HostMemoryOptions::default() });
        let calls: [&[u64]; 2] = [&[3 << 20, 4096], &[1 << 20]];
        let mut fell_back = 0;
        let warns = warnings_of(|| {
            for (c, sizes) in calls.iter().enumerate() {
                let buffers = s.allocate(sizes).unwrap();
                assert_eq!(buffers.len(), sizes.len());
                for (i, (buf, &size)) in buffers.iter().zip(sizes.iter()).enumerate() {
                    check_round_trip(buf, (c * 8 + i) as u8);
                    // Each buffer on its own: hugetlb may run out part way through (a few pages
                    // reserved), so some buffers get huge pages and later ones fall back.
                    match s.hugetlb_at(buf.base()) {
                        Some(true) => {
                            assert_eq!(buf.len() % HUGE, 0, "a hugetlb buffer is a hugepage multiple: {buf:?}");
                            assert!(buf.len() >= size && buf.len() - size < HUGE, "{buf:?} for {size} bytes");
                        }
                        Some(false) => {
                            fell_back += 1;
                            assert_eq!(buf.len(), size.next_multiple_of(BASE_PAGE), "a fallback buffer is 4 KiB pages");
                        }
                        None => panic!("buffer {buf:?} is not held by the source"),
                    }
                }
            }
        });
        eprintln!("note: {fell_back} of 3 buffers fell back to normal pages");
        assert_eq!(s.warned_hugetlb_fallback(), fell_back > 0);
        assert_eq!(warns, usize::from(fell_back > 0), "one fallback warning per source, none without a fallback");
        assert_eq!(s.used_hugetlb(), fell_back < 3);
    }

    #[test]
    fn hugepage_size_must_be_a_power_of_two_of_at_least_4k() {
        let s =
            source(HostMemoryOptions { use_hugepages: true, hugepage_size: 3 << 20, ..HostMemoryOptions::default() });
        assert!(matches!(s.allocate(&[4096]), Err(SourceError::Invalid { .. })));
        assert_eq!(s.mapping_count(), 0);
        let s = source(HostMemoryOptions { use_hugepages: true, hugepage_size: 2048, ..HostMemoryOptions::default() });
        assert!(matches!(s.allocate(&[4096]), Err(SourceError::Invalid { .. })));
        // Without huge pages the size is not used, so it is not checked.
        let s = source(HostMemoryOptions { hugepage_size: 3 << 20, ..HostMemoryOptions::default() });
        assert_eq!(s.allocate(&[4096]).unwrap().len(), 1);
    }

    #[test]
    fn absurd_size_fails_without_leaking_the_call() {
        let s = source(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
        let kept = s.allocate(&[8192]).unwrap();
        let err = s.allocate(&[4096, u64::MAX / 2]).unwrap_err();
        assert!(matches!(err, SourceError::Allocation { requested, .. } if requested == u64::MAX / 2), "{err:?}");
        // Earlier calls untouched, this call's first buffer given back.
        assert_eq!(s.mapping_count(), 1);
        check_round_trip(&kept[0], 1);
        assert_eq!(s.allocate(&[4096]).unwrap().len(), 1);
        assert_eq!(s.mapping_count(), 2);
    }

    #[test]
    fn overflowing_size_is_invalid() {
        let s = source(HostMemoryOptions::default());
        assert!(matches!(s.allocate(&[4096, u64::MAX]), Err(SourceError::Invalid { .. })));
        let s = source(HostMemoryOptions { use_hugepages: true, ..HostMemoryOptions::default() });
        assert!(matches!(s.allocate(&[u64::MAX - 4096]), Err(SourceError::Invalid { .. })));
        assert_eq!(s.mapping_count(), 0);
    }

    /// The memory policy `/proc/self/numa_maps` shows for the mapping containing `addr` (the line with
    /// the greatest start address not above it), or why it cannot be read.
    fn numa_policy_at(addr: usize) -> Result<String, String> {
        let text = std::fs::read_to_string("/proc/self/numa_maps").map_err(|e| e.to_string())?;
        let mut best: Option<(usize, &str)> = None;
        for line in text.lines() {
            let mut fields = line.split_whitespace();
            let (Some(start), Some(policy)) = (fields.next(), fields.next()) else { continue };
            let Ok(start) = usize::from_str_radix(start, 16) else { continue };
            if start <= addr && best.is_none_or(|(b, _)| start > b) {
                best = Some((start, policy));
            }
        }
        best.map(|(_, p)| p.to_owned()).ok_or_else(|| format!("no mapping at {addr:#x}"))
    }

    #[test]
    fn numa_node_zero_binds_when_mbind_is_permitted() {
        let s = source(HostMemoryOptions { numa_node: Some(0), ..HostMemoryOptions::default() });
        let b = s.allocate(&[1 << 20]).unwrap();
        check_round_trip(&b[0], 3);
        // Whether mbind itself is permitted depends on the kernel (CONFIG_NUMA) and the sandbox
        // (container seccomp profiles often refuse it): probe it on a mapping of our own.
        let probe = map_anonymous(4096, None).unwrap();
        let permitted = bind_to_node(&probe, 0);
        assert!(bind_to_node(&probe, 1000).is_err(), "a node this machine lacks cannot be bound");
        unmap(&probe);
        match permitted {
            Ok(()) => {
                assert!(!s.warned_numa_bind(), "mbind to node 0 works here, yet the source warned");
                match numa_policy_at(b[0].base().as_ptr() as usize) {
                    Ok(policy) => assert_eq!(policy, "bind:0", "the buffer's policy in /proc/self/numa_maps"),
                    Err(why) => eprintln!("note: /proc/self/numa_maps unreadable ({why}); bind not verified"),
                }
            }
            Err(err) => {
                eprintln!("note: mbind to node 0 refused here ({err}); only the warning is checked");
                assert!(s.warned_numa_bind(), "a refused bind must be reported");
            }
        }
    }

    #[test]
    fn failed_numa_bind_warns_once_per_source() {
        for node in [1000, u32::MAX] {
            let s = source(HostMemoryOptions { numa_node: Some(node), ..HostMemoryOptions::default() });
            let warns = warnings_of(|| {
                let a = s.allocate(&[4096, 8192]).unwrap();
                let b = s.allocate(&[4096]).unwrap();
                for (i, buf) in a.iter().chain(&b).enumerate() {
                    check_round_trip(buf, i as u8);
                }
            });
            assert_eq!(warns, 1, "node {node}: three unbound buffers, one warning");
            assert!(s.warned_numa_bind());
            // A second source warns for itself.
            let t = source(HostMemoryOptions { numa_node: Some(node), ..HostMemoryOptions::default() });
            assert_eq!(warnings_of(|| drop(t.allocate(&[4096]).unwrap())), 1, "node {node}: a second source");
        }
    }

    #[test]
    fn without_prefault() {
        let s = source(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
        let b = s.allocate(&[256 * 1024]).unwrap();
        assert_eq!(resident_pages(&b[0]), 0, "nothing faulted in without prefault");
        check_round_trip(&b[0], 6);
    }

    #[test]
    fn populate_errors_are_classified() {
        for errno in [Errno::INVAL, Errno::NOSYS, Errno::OPNOTSUPP, Errno::NOTSUP] {
            assert_eq!(classify_populate_error(errno), PopulateFailure::Unsupported, "{errno:?}");
        }
        for errno in [Errno::NOMEM, Errno::FAULT, Errno::HWPOISON, Errno::PERM, Errno::AGAIN, Errno::INTR] {
            assert_eq!(classify_populate_error(errno), PopulateFailure::CannotBack, "{errno:?}");
        }
    }

    #[test]
    fn unsupported_populate_touches_every_page() {
        for errno in [Errno::INVAL, Errno::NOSYS, Errno::OPNOTSUPP] {
            let buffer = map_anonymous(5 * 4096, None).unwrap();
            assert_eq!(resident_pages(&buffer), 0);
            assert_eq!(prefault_with(&buffer, BASE_PAGE, |_| Err(errno)), Ok(()), "{errno:?}");
            assert_eq!(resident_pages(&buffer), 5, "{errno:?}: the fallback faulted each page in");
            check_round_trip(&buffer, 8);
            unmap(&buffer);
        }
    }

    #[test]
    fn unbackable_populate_fails_without_touching() {
        for errno in [Errno::NOMEM, Errno::FAULT, Errno::HWPOISON] {
            let buffer = map_anonymous(5 * 4096, None).unwrap();
            assert_eq!(prefault_with(&buffer, BASE_PAGE, |_| Err(errno)), Err(errno));
            assert_eq!(resident_pages(&buffer), 0, "{errno:?}: no page was touched");
            unmap(&buffer);
        }
    }

    /// Populate that reports `ENOMEM` for 3-page buffers and really populates the others.
    fn enomem_for_three_pages(buffer: &RawBuffer) -> rustix::io::Result<()> {
        if buffer.len() == 3 * 4096 { Err(Errno::NOMEM) } else { populate_write(buffer) }
    }

    #[test]
    fn unbackable_memory_fails_the_allocation_and_gives_back_the_call() {
        let s = HostPageMemorySource::with_populate(HostMemoryOptions::default(), enomem_for_three_pages);
        let kept = s.allocate(&[4096]).unwrap();
        let err = s.allocate(&[8192, 3 * 4096, 4096]).unwrap_err();
        let SourceError::Allocation { requested, source, .. } = &err else { panic!("{err:?}") };
        assert_eq!((*requested, source.raw_os_error()), (3 * 4096, Some(libc::ENOMEM)), "{err}");
        assert_eq!((s.mapping_count(), s.mapped_bytes()), (1, 4096), "the failed call's buffers are gone");
        check_round_trip(&kept[0], 9);
        // Without prefault the same source never populates, so the size is fine.
        let s = HostPageMemorySource::with_populate(
            HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() },
            enomem_for_three_pages,
        );
        assert_eq!(s.allocate(&[3 * 4096]).unwrap().len(), 1);
    }

    #[test]
    fn populating_hugetlb_memory_without_reserved_pages_is_an_error_not_a_sigbus() {
        // A MAP_NORESERVE hugetlb mapping with no free huge pages maps fine but cannot be backed: a
        // write would SIGBUS this process. MADV_POPULATE_WRITE reports that instead, and must not be
        // "worked around" by touching.
        let plain = map_anonymous(4096, None).unwrap();
        let supported = populate_write(&plain);
        unmap(&plain);
        if let Err(errno) = supported {
            eprintln!("skipped: MADV_POPULATE_WRITE unsupported here ({errno})");
            return;
        }
        let huge = 2usize << 20;
        let flags = MapFlags::PRIVATE
            | MapFlags::HUGETLB
            | MapFlags::NORESERVE
            | MapFlags::from_bits_retain(21 << libc::MAP_HUGE_SHIFT);
        // SAFETY: a null hint and no MAP_FIXED: a fresh range, unmapped below.
        let mapped =
            unsafe { rustix::mm::mmap_anonymous(ptr::null_mut(), huge, ProtFlags::READ | ProtFlags::WRITE, flags) };
        let ptr = match mapped {
            Ok(ptr) => ptr,
            Err(errno) => {
                eprintln!("skipped: no hugetlb support here ({errno})");
                return;
            }
        };
        let Some(base) = NonNull::new(ptr.cast::<u8>()) else { panic!("mmap returned null") };
        // SAFETY: a fresh mapping of `huge` bytes, unmapped below and never read or written.
        let buffer = unsafe { RawBuffer::new(base, huge as u64) };
        match prefault_with(&buffer, huge as u64, populate_write) {
            Ok(()) => eprintln!("note: a free huge page backed the mapping; nothing to check"),
            Err(errno) => assert_eq!(classify_populate_error(errno), PopulateFailure::CannotBack, "{errno:?}"),
        }
        unmap(&buffer);
    }

    /// Set in the child process [`drop_unmaps_every_buffer`] starts.
    const DROP_CHILD: &str = "UMBP_PAGE_HOST_DROP_CHILD";

    #[test]
    fn drop_unmaps_every_buffer() {
        // "Unmapped" is only observable while no other thread maps into the freed range, and sibling
        // tests map memory all the time; so the check runs in a child process that runs this test alone.
        if std::env::var_os(DROP_CHILD).is_some() {
            let s = source(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
            let buffers = s.allocate(&[4096, 8192, 3 << 20]).unwrap();
            let mut scratch = Vec::with_capacity(1024);
            for b in &buffers {
                assert_eq!(mincore(b.base().as_ptr(), map_len(b), &mut scratch), Ok(()), "{b:?} mapped before drop");
            }
            drop(s);
            for b in &buffers {
                let after = mincore(b.base().as_ptr(), map_len(b), &mut scratch);
                assert_eq!(after, Err(Errno::NOMEM), "{b:?} still mapped after the source dropped");
            }
            return;
        }
        let exe = std::env::current_exe().unwrap();
        let output = Command::new(exe)
            .args(["--exact", "host::tests::drop_unmaps_every_buffer", "--test-threads=1", "--nocapture"])
            .env(DROP_CHILD, "1")
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "the child failed:\n{text}");
        assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
    }

    #[test]
    fn meminfo_lines_are_extracted() {
        let sample = "MemTotal:       16384 kB\nHugePages_Total:     512\nHugePages_Free:      500\n\
                      HugePages_Rsvd:        3\nHugepagesize:       2048 kB\n";
        assert_eq!(hugepage_lines(sample), "HugePages_Total: 512, HugePages_Free: 500");
        assert_eq!(hugepage_lines("MemTotal: 1 kB\n"), "no HugePages lines in /proc/meminfo");

        // This machine's, when it has the lines: exactly `HugePages_Total: N, HugePages_Free: M`, M ≤ N.
        let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") else {
            assert!(hugepage_meminfo().starts_with("/proc/meminfo unreadable: "));
            return;
        };
        let text = hugepage_meminfo();
        if !meminfo.contains("HugePages_Total:") {
            assert_eq!(text, "no HugePages lines in /proc/meminfo");
            return;
        }
        let fields: Vec<(&str, u64)> = text
            .split(", ")
            .map(|part| match part.split_once(": ") {
                Some((name, n)) => (name, n.parse().unwrap_or_else(|e| panic!("{part:?} in {text:?}: {e}"))),
                None => panic!("{part:?} in {text:?} is not `name: count`"),
            })
            .collect();
        let [("HugePages_Total", total), ("HugePages_Free", free)] = fields[..] else {
            panic!("unexpected shape: {text:?}");
        };
        assert!(free <= total, "{text}");
    }

    #[test]
    fn round_up_checks_overflow() {
        assert_eq!(round_up(1, 4096), Some(4096));
        assert_eq!(round_up(4096, 4096), Some(4096));
        assert_eq!(round_up(u64::MAX, 4096), None);
        assert_eq!(round_up(u64::MAX - 4095, 4096), Some(u64::MAX - 4095));
    }
}
