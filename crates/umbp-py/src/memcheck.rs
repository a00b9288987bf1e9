//! Whether an address range is mapped in this process: a bad pointer from Python becomes an
//! `InvalidInputError`, not a segfault in a copy thread.

/// Whether every page of `[ptr, ptr + len)` is mapped (`mincore` answers `ENOMEM` for an unmapped
/// page). A zero length or a range that wraps the address space is not.
pub(crate) fn range_mapped(ptr: usize, len: usize) -> bool {
    if ptr == 0 || len == 0 {
        return false;
    }
    let Some(end) = ptr.checked_add(len) else { return false };
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
    let start = ptr - ptr % page;
    let span = end - start;
    let pages = span.div_ceil(page);
    // mincore fills one byte per page; check in chunks so a huge registration needs little memory.
    const CHUNK_PAGES: usize = 1 << 16;
    let mut vec = vec![0u8; pages.min(CHUNK_PAGES)];
    let mut at = start;
    let mut left = pages;
    while left > 0 {
        let n = left.min(CHUNK_PAGES);
        // SAFETY: `vec` has room for `n` bytes, one per page of the `n * page` bytes asked about;
        // mincore only inspects the mapping, it never touches the memory.
        let rc = unsafe { libc::mincore(at as *mut libc::c_void, n * page, vec.as_mut_ptr()) };
        if rc != 0 {
            return false;
        }
        at += n * page;
        left -= n;
    }
    true
}
