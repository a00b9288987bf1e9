//! Rate-limited warnings: a peer can make the data plane refuse it thousands of times a second
//! (silent sockets, wrong tokens, garbage, bad descriptors), and each refusal must not cost a log
//! line.
//!
//! Each kind of warning gets at most one line per interval; the line carries `suppressed`, how many
//! of that kind were dropped since the previous line. A kind whose interval has passed with
//! suppressed events still pending is reported by [`WarnLimiter::flush`] (the data server's
//! acceptor calls it as it wakes, at least once a second), so the count of a burst's tail is never
//! lost.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// One kind's window.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// When the last line of this kind was written.
    last: Instant,
    /// Events of this kind dropped since.
    suppressed: u64,
}

/// At most one warning line per kind per interval (see the module docs).
#[derive(Debug)]
pub(crate) struct WarnLimiter {
    interval: Duration,
    windows: Mutex<HashMap<&'static str, Window>>,
}

/// The interval of a limiter nobody configured (the data server's default `warn_interval`).
const DEFAULT_WARN_INTERVAL: Duration = Duration::from_secs(5);

impl Default for WarnLimiter {
    fn default() -> Self {
        Self::new(DEFAULT_WARN_INTERVAL)
    }
}

impl WarnLimiter {
    /// A limiter writing at most one line per kind every `interval`.
    pub(crate) fn new(interval: Duration) -> Self {
        Self { interval, windows: Mutex::new(HashMap::new()) }
    }

    /// Whether a warning of `kind` may be written now: `Some(suppressed)` (the events of `kind`
    /// dropped since its previous line), or `None` (this one is dropped and counted).
    pub(crate) fn admit(&self, kind: &'static str) -> Option<u64> {
        let now = Instant::now();
        let mut windows = self.windows.lock();
        match windows.get_mut(kind) {
            Some(w) if now.duration_since(w.last) < self.interval => {
                w.suppressed = w.suppressed.saturating_add(1);
                None
            }
            Some(w) => {
                let suppressed = std::mem::take(&mut w.suppressed);
                w.last = now;
                Some(suppressed)
            }
            None => {
                windows.insert(kind, Window { last: now, suppressed: 0 });
                Some(0)
            }
        }
    }

    /// Reports, through `emit(kind, suppressed)`, every kind whose interval has passed with dropped
    /// events not reported yet (and starts a new interval for it).
    pub(crate) fn flush(&self, mut emit: impl FnMut(&'static str, u64)) {
        let now = Instant::now();
        let mut due = Vec::new();
        {
            let mut windows = self.windows.lock();
            for (kind, w) in windows.iter_mut() {
                if w.suppressed > 0 && now.duration_since(w.last) >= self.interval {
                    due.push((*kind, std::mem::take(&mut w.suppressed)));
                    w.last = now;
                }
            }
        }
        for (kind, suppressed) in due {
            emit(kind, suppressed);
        }
    }

    /// [`flush`](Self::flush) as warning lines.
    pub(crate) fn flush_to_log(&self, source: &'static str) {
        self.flush(|kind, suppressed| {
            tracing::warn!(kind, suppressed, "{source}: more warnings of this kind were suppressed");
        });
    }
}

/// `tracing::warn!` through a [`WarnLimiter`]: `warn_limited!(limiter, "kind", fields.., "message")`.
/// The line gets the fields `kind` and `suppressed`.
macro_rules! warn_limited {
    ($limiter:expr, $kind:literal, $($rest:tt)+) => {
        if let Some(suppressed) = $limiter.admit($kind) {
            ::tracing::warn!(kind = $kind, suppressed, $($rest)+);
        }
    };
}
pub(crate) use warn_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_tail_is_counted() {
        let limiter = WarnLimiter::new(Duration::from_millis(200));
        assert_eq!(limiter.admit("a"), Some(0));
        assert_eq!(limiter.admit("b"), Some(0), "kinds are limited separately");
        for _ in 0..99 {
            assert_eq!(limiter.admit("a"), None);
        }
        let mut flushed = Vec::new();
        limiter.flush(|k, n| flushed.push((k, n)));
        assert!(flushed.is_empty(), "nothing is due inside the interval");
        std::thread::sleep(Duration::from_millis(250));
        limiter.flush(|k, n| flushed.push((k, n)));
        assert_eq!(flushed, vec![("a", 99)]);
        assert_eq!(limiter.admit("a"), None, "a flush starts a new interval");
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(limiter.admit("a"), Some(1));
    }
}
