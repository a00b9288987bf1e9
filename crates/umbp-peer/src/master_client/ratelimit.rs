//! A tiny rate limiter for repeated warnings: at most one line per window, and the line says how many
//! were held back since the last one, so a peer that fails every round (or a store that fails every
//! call) costs one line per window instead of one per event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The window of [`RateLimited::every`] most warnings use.
pub(super) const WARN_WINDOW: Duration = Duration::from_secs(10);

/// One warning site's limiter. Lock-free; shareable.
#[derive(Debug)]
pub(super) struct RateLimited {
    window_ms: u64,
    origin: Instant,
    /// Milliseconds after `origin` of the last line let through, plus one (0 = never).
    last_ms: AtomicU64,
    /// Events held back since that line.
    suppressed: AtomicU64,
}

impl RateLimited {
    /// A limiter that lets one line through per `window`.
    pub(super) fn every(window: Duration) -> Self {
        Self {
            window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1),
            origin: Instant::now(),
            last_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Records one event. `Some(held_back)` when this one should be logged (with the number of events
    /// held back since the last logged one), `None` when it is held back.
    pub(super) fn check(&self) -> Option<u64> {
        let now = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX).saturating_add(1);
        let last = self.last_ms.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < self.window_ms {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        // One winner per window among concurrent callers; the others count as held back.
        if self.last_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err() {
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
        let limit = RateLimited::every(Duration::from_secs(3600));
        assert_eq!(limit.check(), Some(0), "the first event is logged");
        for _ in 0..999 {
            assert_eq!(limit.check(), None);
        }
        // A new window: the next line reports the 999 held back.
        limit.last_ms.store(1, Ordering::Relaxed);
        let fresh = RateLimited { origin: limit.origin - Duration::from_secs(7200), ..limit };
        assert_eq!(fresh.check(), Some(999));
        assert_eq!(fresh.check(), None);
    }

    #[test]
    fn concurrent_callers_log_once_per_window() {
        let limit = std::sync::Arc::new(RateLimited::every(Duration::from_secs(3600)));
        let logged: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let limit = std::sync::Arc::clone(&limit);
                    s.spawn(move || (0..1000).filter(|_| limit.check().is_some()).count() as u64)
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).sum()
        });
        assert_eq!(logged, 1);
        assert_eq!(limit.suppressed.load(Ordering::Relaxed), 3999);
    }
}
