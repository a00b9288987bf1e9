//! The event outbox every medium keeps, with the auto-flush semantic they share.

use crate::{AutoFlushHook, KvEvent};

/// A medium's unshipped events and its auto-flush hook.
///
/// One semantic for every medium: the hook fires once when the outbox grows to the threshold; a drain
/// ([`take`](Self::take) or [`clear`](Self::clear)) re-arms it; a threshold of 0 disables it. The
/// outbox lives behind the medium's lock, so the hook runs under that lock (see [`AutoFlushHook`]).
#[derive(Default)]
pub struct EventOutbox {
    events: Vec<KvEvent>,
    auto_flush: Option<(usize, AutoFlushHook)>,
}

impl std::fmt::Debug for EventOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventOutbox")
            .field("events", &self.events.len())
            .field("auto_flush_threshold", &self.auto_flush.as_ref().map(|(t, _)| *t))
            .finish()
    }
}

impl EventOutbox {
    /// Appends `event`; runs the hook when this push brings the outbox to the threshold.
    pub fn push(&mut self, event: KvEvent) {
        self.events.push(event);
        // Fires once per crossing: the length passes the threshold exactly once between drains.
        if let Some((threshold, hook)) = &self.auto_flush
            && *threshold > 0
            && self.events.len() == *threshold
        {
            hook();
        }
    }

    /// Every unshipped event, in order; the outbox is left empty (re-arming the hook).
    pub fn take(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Drops every unshipped event (a full-sync snapshot or a clear replaces them).
    pub fn clear(&mut self) {
        self.events.clear();
    }

    /// Installs (or, with `None`, removes) the hook and its threshold.
    pub fn set_auto_flush(&mut self, threshold: usize, hook: Option<AutoFlushHook>) {
        self.auto_flush = hook.map(|hook| (threshold, hook));
    }

    /// Unshipped events.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether nothing is waiting to be shipped.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn event(i: usize) -> KvEvent {
        KvEvent::add(format!("k{i}"), crate::TierType::Dram, 1)
    }

    #[test]
    fn the_hook_fires_once_per_crossing_and_a_drain_re_arms_it() {
        let fired = Arc::new(AtomicUsize::new(0));
        let f = Arc::clone(&fired);
        let mut outbox = EventOutbox::default();
        outbox.set_auto_flush(
            3,
            Some(Arc::new(move || {
                f.fetch_add(1, Ordering::SeqCst);
            })),
        );
        for i in 0..5 {
            outbox.push(event(i));
        }
        assert_eq!(fired.load(Ordering::SeqCst), 1, "once at the third event, not again at 4 and 5");
        assert_eq!(outbox.take().len(), 5);
        for i in 0..3 {
            outbox.push(event(i));
        }
        assert_eq!(fired.load(Ordering::SeqCst), 2, "re-armed by the drain");
        outbox.clear();
        outbox.set_auto_flush(0, Some(Arc::new(|| panic!("threshold 0 disables the hook"))));
        outbox.push(event(9));
        assert_eq!(outbox.len(), 1);
    }
}
