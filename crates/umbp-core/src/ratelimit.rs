//! A rate limiter for repeated warnings: at most one line per window, and the line says how many
//! were held back since the last one, so a peer that fails every round (or a store that fails every
//! call) costs one line per window instead of one per event. Shared by the master, the master
//! client and anything else that logs what a peer can repeat; it decides, the caller logs.

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The clock every limiter measures from: the first use in the process. A static `Instant` lets
/// [`RateLimited::every`] be `const`, so a warning site is one `static`.
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// One warning site's limiter. Lock-free; usable as a `static`.
///
/// ```
/// use std::time::Duration;
/// use umbp_core::RateLimited;
///
/// static STORE_FAILED: RateLimited = RateLimited::every(Duration::from_secs(3600));
/// assert_eq!(STORE_FAILED.check(), Some(0)); // logged, nothing held back before it
/// assert_eq!(STORE_FAILED.check(), None); // held back (and counted)
/// ```
#[derive(Debug)]
pub struct RateLimited {
    window_ms: u64,
    /// Milliseconds after [`EPOCH`] of the last line let through, plus one (0 = never).
    last_ms: AtomicU64,
    /// Events held back since that line.
    suppressed: AtomicU64,
}

impl RateLimited {
    /// The window most warning sites use.
    pub const WINDOW: Duration = Duration::from_secs(10);

    /// A limiter that lets one line through per `window` (at least 1 ms).
    pub const fn every(window: Duration) -> Self {
        let ms = window.as_millis();
        let window_ms = if ms > u64::MAX as u128 {
            u64::MAX
        } else if ms == 0 {
            1
        } else {
            ms as u64
        };
        Self { window_ms, last_ms: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// Records one event. `Some(held_back)` when this one should be logged (with the number of events
    /// held back since the last logged one), `None` when it is held back.
    pub fn check(&self) -> Option<u64> {
        self.check_at(u64::try_from(EPOCH.elapsed().as_millis()).unwrap_or(u64::MAX).saturating_add(1))
    }

    /// [`check`](Self::check) at `now_ms` (milliseconds after the epoch, plus one).
    fn check_at(&self, now_ms: u64) -> Option<u64> {
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != 0 && now_ms.saturating_sub(last) < self.window_ms {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        // One winner per window among concurrent callers; the others count as held back.
        if self.last_ms.compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed).is_err() {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(self.suppressed.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_window_with_the_count_held_back() {
        let limit = RateLimited::every(Duration::from_secs(10));
        assert_eq!(limit.check_at(1), Some(0), "the first event is logged");
        for t in 2..1001 {
            assert_eq!(limit.check_at(t), None);
        }
        // The next window: the next line reports the 999 held back.
        assert_eq!(limit.check_at(10_001), Some(999));
        assert_eq!(limit.check_at(10_002), None);
    }

    #[test]
    fn concurrent_callers_log_once_per_window() {
        let limit = RateLimited::every(Duration::from_secs(3600));
        let lines: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> =
                (0..4).map(|_| s.spawn(|| (0..1000).filter_map(|_| limit.check()).collect::<Vec<u64>>())).collect();
            handles.into_iter().flat_map(|h| h.join().expect("thread")).collect()
        });
        assert_eq!(lines.len(), 1, "one line for the window");
        // Every other event is held back and counted exactly once: in the line (an event of
        // another thread may land between the winner's claim and its read of the count) or in
        // the count left for the next line.
        assert_eq!(lines[0] + limit.suppressed.load(Ordering::Relaxed), 3999);
    }

    #[test]
    fn a_zero_window_lets_every_event_through() {
        let limit = RateLimited::every(Duration::ZERO);
        assert_eq!((limit.check_at(1), limit.check_at(2), limit.check_at(3)), (Some(0), Some(0), Some(0)));
    }
}
