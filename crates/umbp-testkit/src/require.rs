//! Skips that a run can forbid: a test that needs something of the machine (io_uring, transparent
//! huge pages, a reachable open-file limit) skips where it is missing, unless the run sets the
//! feature's `UMBP_REQUIRE_*` variable to `1` (as `umbp_gpu::gpu_required` does for GPUs). A machine
//! that has the feature sets it (`cargo xtask ci` does, for this CI machine's features), so a broken
//! probe or a lost feature fails the test instead of skipping it green with a line nobody reads.

use std::fmt::Display;

/// io_uring (the SSD medium's second engine).
pub const IO_URING: &str = "UMBP_REQUIRE_IO_URING";
/// Transparent huge pages (`/sys/kernel/mm/transparent_hugepage`, advised by `madvise`).
pub const THP: &str = "UMBP_REQUIRE_THP";
/// An open-file limit a test can reach and raise (soft limit at most 2^24, hard limit at least 400).
pub const OPEN_FILES: &str = "UMBP_REQUIRE_OPEN_FILES";

/// Whether the run demands the feature of `var` (`var` set to `1`).
pub fn required(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v.trim() == "1")
}

/// Skips a test for lack of the feature of `var`: prints why, or panics when the run demands the
/// feature. The caller returns after it.
///
/// # Panics
/// When `var` is set to `1`.
pub fn skip(var: &str, why: impl Display) {
    assert!(!required(var), "{var}=1 but the test would skip: {why}");
    eprintln!("skipped: {why} (set {var}=1 to fail instead)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unset_or_other_value_does_not_require() {
        assert!(!required("UMBP_REQUIRE_SURELY_UNSET_FEATURE"));
        skip("UMBP_REQUIRE_SURELY_UNSET_FEATURE", "nothing");
    }
}
