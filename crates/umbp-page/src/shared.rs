//! Shareable host memory: each buffer a sealed memory file (`memfd`) mapped `MAP_SHARED`, so that a
//! transport may hand the file to another process on the same host, which maps the same pages.
//!
//! The file is created `MFD_CLOEXEC | MFD_ALLOW_SEALING`, sized with `ftruncate`, then sealed with
//! `F_SEAL_SHRINK | F_SEAL_GROW` and finally `F_SEAL_SEAL`: nobody holding the descriptor — this
//! process or a peer it was passed to — can shrink the file under a mapping (which would turn a read
//! of the lost pages into a `SIGBUS`), grow it, or lift the seals. A peer's mapping keeps the pages
//! alive after this process unmaps them or dies, so the worst a peer sees is stale bytes, never a
//! fault; the transfer layer's epochs keep it from reading those.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::ptr::{self, NonNull};

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::source::RawBuffer;

/// The name every memory file gets (shown as `/memfd:umbp-host (deleted)` in `/proc/PID/maps`).
const MEMFD_NAME: &str = "umbp-host";

/// The seals every shareable buffer carries.
#[cfg(test)]
fn required_seals() -> SealFlags {
    SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL
}

/// A sealed memory file of `len` bytes (hugetlb pages of `hugepage_size` bytes when given, `len`
/// then a multiple of it) mapped read-write `MAP_SHARED`; the buffer starts at offset 0 of the file.
/// On error nothing stays mapped or open.
pub(crate) fn map_memfd(len: u64, hugepage_size: Option<u64>) -> io::Result<(RawBuffer, OwnedFd)> {
    let len_usize = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut flags = MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING;
    if let Some(huge) = hugepage_size {
        // MFD_HUGE_SHIFT is MAP_HUGE_SHIFT: log2 of the page size in bits 26..32.
        let encoded = huge.trailing_zeros() << libc::MFD_HUGE_SHIFT;
        flags |= MemfdFlags::HUGETLB | MemfdFlags::from_bits_retain(encoded);
    }
    let fd = rustix::fs::memfd_create(MEMFD_NAME, flags)?;
    rustix::fs::ftruncate(&fd, len)?;
    // Sealed before the mapping exists and before anyone else can hold the descriptor.
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SEAL)?;
    // SAFETY: a null hint and no MAP_FIXED: the kernel picks a fresh range, so no existing memory is
    // replaced; the file is `len` bytes long and sealed against shrinking, so every page is backed.
    let ptr = unsafe {
        rustix::mm::mmap(ptr::null_mut(), len_usize, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
    }?;
    let Some(base) = NonNull::new(ptr.cast::<u8>()) else {
        return Err(io::Error::other("mmap returned a null address"));
    };
    // SAFETY: `base` is a fresh read-write mapping of `len` bytes of `fd` from offset 0; the source
    // keeps both (its `Mapping`) until it unmaps the buffer and then closes the file.
    let buffer = unsafe { RawBuffer::new_shared(base, len, fd.as_fd(), 0) };
    Ok((buffer, fd))
}

/// Where the host says whether shared memory (a `memfd` among it) may get transparent huge pages.
const SHMEM_THP: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The host's shmem THP mode (`always`, `within_size`, `advise`, `never`, `deny`, `force`), or
/// `None` where the file is missing (a kernel without THP) or unreadable.
pub(crate) fn shmem_thp_mode() -> Option<String> {
    selected_mode(&std::fs::read_to_string(SHMEM_THP).ok()?).map(str::to_owned)
}

/// The bracketed choice of a sysfs mode list: `advise` in `always within_size [advise] never`.
fn selected_mode(list: &str) -> Option<&str> {
    list.split_whitespace().find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
}

/// Whether a shareable buffer advised `MADV_HUGEPAGE` still gets only 4 KiB pages on a host whose
/// shmem THP mode is `mode`: the advice counts for shared memory only under `advise` and above.
pub(crate) fn shmem_thp_refused(mode: &str) -> bool {
    matches!(mode, "never" | "deny")
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use rustix::io::Errno;

    use super::*;
    use crate::{HostMemoryOptions, HostPageMemorySource, PageMemorySource, SourceError};

    fn shareable(options: HostMemoryOptions) -> HostPageMemorySource {
        HostPageMemorySource::new(HostMemoryOptions { shareable: true, ..options })
    }

    /// Maps `len` bytes of `fd` from `offset` a second time, as a peer process would.
    fn map_again(fd: impl AsFd, offset: u64, len: usize) -> *mut u8 {
        // SAFETY: a fresh range (null hint, no MAP_FIXED), unmapped by the caller.
        let ptr = unsafe {
            rustix::mm::mmap(ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, offset)
        }
        .expect("a second mapping");
        ptr.cast()
    }

    fn unmap_raw(ptr: *mut u8, len: usize) {
        // SAFETY: a mapping made by `map_again` of `len` bytes, unmapped once.
        unsafe { rustix::mm::munmap(ptr.cast(), len) }.expect("munmap");
    }

    #[test]
    fn the_shmem_thp_mode_is_the_bracketed_word() {
        assert_eq!(selected_mode("always within_size advise [never] deny force\n"), Some("never"));
        assert_eq!(selected_mode("[advise] never"), Some("advise"));
        assert_eq!(selected_mode("always never"), None);
        assert!(shmem_thp_refused("never") && shmem_thp_refused("deny"));
        assert!(!shmem_thp_refused("advise") && !shmem_thp_refused("within_size") && !shmem_thp_refused("force"));
        // This host's own file parses, where it exists.
        if std::path::Path::new(SHMEM_THP).exists() {
            assert!(shmem_thp_mode().is_some(), "{SHMEM_THP} read but no mode found");
        }
    }

    #[test]
    fn a_shareable_buffer_is_a_sealed_memfd_of_its_length() {
        let s = shareable(HostMemoryOptions::default());
        let buffers = s.allocate(&[10_000, 64 << 10]).expect("allocate");
        assert_eq!(buffers.len(), 2);
        assert_eq!(buffers[0].len(), 12_288, "rounded to 4 KiB as private memory is");
        for b in &buffers {
            let backing = b.shared_backing().expect("a shareable buffer names its file");
            assert_eq!(backing.offset(), 0);
            let stat = rustix::fs::fstat(backing.fd()).expect("fstat");
            assert_eq!(stat.st_size as u64, b.len(), "the file is exactly the buffer");
            assert_eq!(rustix::fs::fcntl_get_seals(backing.fd()).expect("seals"), required_seals());
            let flags = rustix::io::fcntl_getfd(backing.fd()).expect("fd flags");
            assert!(flags.contains(rustix::io::FdFlags::CLOEXEC), "never leaks into a child");
        }
        let private = HostPageMemorySource::new(HostMemoryOptions::default());
        assert!(private.allocate(&[4096]).expect("allocate")[0].shared_backing().is_none(), "off by default");
    }

    #[test]
    fn the_seals_refuse_truncation_growth_and_new_seals() {
        let s = shareable(HostMemoryOptions::default());
        let b = s.allocate(&[8192]).expect("allocate").remove(0);
        let fd = b.shared_backing().expect("shared").fd();
        assert_eq!(rustix::fs::ftruncate(fd, 4096), Err(Errno::PERM), "F_SEAL_SHRINK");
        assert_eq!(rustix::fs::ftruncate(fd, 0), Err(Errno::PERM), "F_SEAL_SHRINK");
        assert_eq!(rustix::fs::ftruncate(fd, 1 << 20), Err(Errno::PERM), "F_SEAL_GROW");
        assert_eq!(rustix::fs::fcntl_add_seals(fd, SealFlags::WRITE), Err(Errno::PERM), "F_SEAL_SEAL");
        // Through a new open file description too (what `/proc/PID/fd/N` gives another process).
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let reopened = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("reopen");
        assert_eq!(reopened.set_len(0).map_err(|e| e.raw_os_error()), Err(Some(libc::EPERM)));
    }

    #[test]
    fn a_second_mapping_sees_the_same_bytes_both_ways() {
        let s = shareable(HostMemoryOptions::default());
        let b = s.allocate(&[3 * 4096]).expect("allocate").remove(0);
        let len = b.len() as usize;
        let path = format!("/proc/self/fd/{}", b.shared_backing().expect("shared").fd().as_raw_fd());
        let reopened = std::fs::OpenOptions::new().read(true).write(true).open(&path).expect("reopen");
        let peer = map_again(&reopened, 0, len);
        // SAFETY: both are live read-write mappings of `len` bytes; this test is their only user.
        let (mine, theirs) = unsafe {
            (std::slice::from_raw_parts_mut(b.base().as_ptr(), len), std::slice::from_raw_parts_mut(peer, len))
        };
        mine[..4096].fill(0xA5);
        assert!(theirs[..4096].iter().all(|&x| x == 0xA5), "the peer sees this process's writes");
        theirs[8192..].fill(0x5A);
        assert!(mine[8192..].iter().all(|&x| x == 0x5A), "this process sees the peer's writes");
        // Mapping a page in the middle (a region's offset in the file) works as well.
        let page = map_again(&reopened, 8192, 4096);
        // SAFETY: a live mapping of one page.
        assert_eq!(unsafe { *page }, 0x5A);
        unmap_raw(page, 4096);
        // The source releasing its buffer leaves the peer's mapping valid: the file lives on with it.
        s.release();
        assert!(theirs[..4096].iter().all(|&x| x == 0xA5), "still readable after the owner let go");
        theirs[0] = 1;
        unmap_raw(peer, len);
    }

    #[test]
    fn shareable_memory_keeps_prefault_and_transparent_huge_page_advice() {
        let s = shareable(HostMemoryOptions::default());
        let b = s.allocate(&[256 << 10]).expect("allocate").remove(0);
        let mut residency = vec![0u8; b.len().div_ceil(4096) as usize];
        // SAFETY: `mincore` reads the page tables of our live mapping and writes one byte per page.
        let rc = unsafe { libc::mincore(b.base().as_ptr().cast(), b.len() as usize, residency.as_mut_ptr()) };
        assert_eq!(rc, 0);
        assert!(residency.iter().all(|r| r & 1 == 1), "prefault populated every page");
        let lazy = shareable(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
        let l = lazy.allocate(&[256 << 10]).expect("allocate").remove(0);
        // SAFETY: as above.
        let rc = unsafe { libc::mincore(l.base().as_ptr().cast(), l.len() as usize, residency.as_mut_ptr()) };
        assert_eq!(rc, 0);
        assert!(residency.iter().all(|r| r & 1 == 0), "nothing faulted in without prefault");
    }

    #[test]
    fn the_shmem_thp_mode_is_looked_at_for_advised_shareable_memory_only() {
        let s = shareable(HostMemoryOptions::default());
        s.allocate(&[4096]).expect("allocate");
        assert!(s.noted_shmem_thp(), "a shareable buffer advised huge pages checks the host's mode");
        let private = HostPageMemorySource::new(HostMemoryOptions::default());
        private.allocate(&[4096]).expect("allocate");
        assert!(!private.noted_shmem_thp(), "private memory's advice does not depend on shmem THP");
        let unadvised = shareable(HostMemoryOptions {
            transparent_hugepages: false,
            use_hugepages: false,
            ..HostMemoryOptions::default()
        });
        unadvised.allocate(&[4096]).expect("allocate");
        assert!(!unadvised.noted_shmem_thp(), "no advice, nothing to say about it");
    }

    #[test]
    fn shareable_mappings_are_advised_for_transparent_huge_pages_unless_turned_off() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            return umbp_testkit::require::skip(
                umbp_testkit::require::THP,
                "this kernel has no transparent huge pages",
            );
        }
        let advised = |options: HostMemoryOptions| {
            let s = shareable(HostMemoryOptions { prefault: false, ..options });
            let b = s.allocate(&[4 << 20]).expect("allocate").remove(0);
            crate::host::tests::vm_flags_at(b.base().as_ptr() as usize).split_whitespace().any(|f| f == "hg")
        };
        assert!(advised(HostMemoryOptions::default()), "advised MADV_HUGEPAGE by default");
        assert!(!advised(HostMemoryOptions { transparent_hugepages: false, ..HostMemoryOptions::default() }));
    }

    #[test]
    fn shareable_hugepages_fall_back_to_a_normal_memfd() {
        let s = shareable(HostMemoryOptions { use_hugepages: true, ..HostMemoryOptions::default() });
        let b = s.allocate(&[3 << 20]).expect("allocate").remove(0);
        let backing = b.shared_backing().expect("either way a memfd");
        let size = rustix::fs::fstat(backing.fd()).expect("fstat").st_size as u64;
        assert_eq!(size, b.len());
        if s.used_hugetlb() {
            assert_eq!(b.len(), 4 << 20, "a hugetlb memfd is whole huge pages");
        } else {
            eprintln!("note: no hugetlb pages here; fell back to a normal memfd");
            assert_eq!(b.len(), 3 << 20);
        }
        assert_eq!(rustix::fs::fcntl_get_seals(backing.fd()).expect("seals"), required_seals());
    }

    #[test]
    fn a_failed_shareable_call_gives_back_what_it_made() {
        let s = shareable(HostMemoryOptions { prefault: false, ..HostMemoryOptions::default() });
        let kept = s.allocate(&[4096]).expect("allocate");
        let err = s.allocate(&[4096, u64::MAX / 2]).expect_err("no address space for that");
        assert!(matches!(err, SourceError::Allocation { requested, .. } if requested == u64::MAX / 2), "{err:?}");
        assert_eq!(s.mapped_bytes(), 4096, "only the earlier call's buffer is held");
        assert!(kept[0].shared_backing().is_some());
        let err = s.allocate(&[u64::MAX]).expect_err("overflows");
        assert!(matches!(err, SourceError::Invalid { .. }), "{err:?}");
    }
}
