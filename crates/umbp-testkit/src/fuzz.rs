//! What the fuzz harnesses of every crate share (issue 19): an allocator that refuses oversized
//! requests, and the case-count scale. Each harness installs the allocator itself:
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: umbp_testkit::fuzz::CappedAlloc = umbp_testkit::fuzz::CappedAlloc;
//! ```

/// Fails any single allocation over 64 MiB (the process aborts with "memory allocation of N bytes
/// failed"): no length a peer or a drive states may size a buffer before it is checked against
/// what actually arrived. Nothing these harnesses do legitimately needs that much at once.
#[derive(Debug, Clone, Copy)]
pub struct CappedAlloc;

/// The largest single allocation [`CappedAlloc`] grants.
pub const ALLOC_CAP: usize = 64 << 20;

// SAFETY: forwards to the system allocator unchanged, or reports failure (null) for an oversized
// request, which every caller must already handle.
unsafe impl std::alloc::GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc` is passed through.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `alloc_zeroed` is passed through.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_CAP {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's contract for `realloc` is passed through.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

/// `n` cases, times `UMBP_FUZZ_SCALE` when set (e.g. 100 for a long run without nightly).
pub fn cases(n: u32) -> u32 {
    let scale = std::env::var("UMBP_FUZZ_SCALE").ok().and_then(|s| s.parse::<u32>().ok()).unwrap_or(1);
    n.saturating_mul(scale.max(1))
}
