//! Which path the bench's same-host batches took, key by key: how many were put and got in one
//! keyed exchange with the holder (the fast path the same-host rows are meant to measure), how
//! many puts were copied while the master routed them, and how many such copies were withdrawn.
//! A same-host figure far below its neighbours' is read with this first: keys that fell back to
//! the routed path (a holder that answered busy, a failed exchange) still move their bytes through
//! shared memory, so the bench's TCP check does not catch them.

use std::fmt;

use umbp_peer::pool_client::PoolClientStats;

use crate::units::human_size;

/// The same-host batches of one value size, over every round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SameHostKeys {
    /// The value size.
    pub value_bytes: u64,
    /// Keys put (and got) in the same-host batches.
    pub keys: u64,
    /// Of those, written in a keyed exchange (`PoolClientStats::keyed_puts`).
    pub keyed_puts: u64,
    /// Of those, copied while the master routed them (`PoolClientStats::puts_copied_ahead`).
    pub copied_ahead: u64,
    /// Keys copied ahead and then withdrawn (`PoolClientStats::puts_withdrawn`).
    pub withdrawn: u64,
    /// Keys read in a keyed exchange (`PoolClientStats::keyed_gets`).
    pub keyed_gets: u64,
}

impl SameHostKeys {
    /// No keys yet, for `value_bytes` values.
    pub fn new(value_bytes: u64) -> Self {
        Self { value_bytes, ..Self::default() }
    }

    /// Adds one round of `keys` keys: what the client's counters moved by from `before` to `after`.
    pub fn add(&mut self, keys: u64, before: &PoolClientStats, after: &PoolClientStats) {
        self.keys += keys;
        self.keyed_puts += after.keyed_puts.saturating_sub(before.keyed_puts);
        self.copied_ahead += after.puts_copied_ahead.saturating_sub(before.puts_copied_ahead);
        self.withdrawn += after.puts_withdrawn.saturating_sub(before.puts_withdrawn);
        self.keyed_gets += after.keyed_gets.saturating_sub(before.keyed_gets);
    }

    /// As one JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"value_bytes\":{},\"keys\":{},\"keyed_puts\":{},\"copied_ahead\":{},\"withdrawn\":{},\"keyed_gets\":{}}}",
            self.value_bytes, self.keys, self.keyed_puts, self.copied_ahead, self.withdrawn, self.keyed_gets
        )
    }
}

impl fmt::Display for SameHostKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "same-host {} batches, {} keys: {} put in a keyed exchange ({} copied while routed, {} withdrawn), \
             {} got in a keyed exchange; the rest took the routed path",
            human_size(self.value_bytes),
            self.keys,
            self.keyed_puts,
            self.copied_ahead,
            self.withdrawn,
            self.keyed_gets
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_adds_what_the_counters_moved_by() {
        // `PoolClientStats` is non-exhaustive: set its public fields one by one.
        let mut before = PoolClientStats::default();
        (before.keyed_puts, before.puts_copied_ahead, before.keyed_gets) = (10, 4, 7);
        let mut after = PoolClientStats::default();
        (after.keyed_puts, after.puts_copied_ahead, after.puts_withdrawn, after.keyed_gets) = (70, 60, 2, 71);
        let mut keys = SameHostKeys::new(1 << 20);
        keys.add(64, &before, &after);
        keys.add(64, &after, &after);
        assert_eq!(
            keys,
            SameHostKeys {
                value_bytes: 1 << 20,
                keys: 128,
                keyed_puts: 60,
                copied_ahead: 56,
                withdrawn: 2,
                keyed_gets: 64
            }
        );
        assert_eq!(
            keys.to_json(),
            "{\"value_bytes\":1048576,\"keys\":128,\"keyed_puts\":60,\"copied_ahead\":56,\"withdrawn\":2,\"keyed_gets\":64}"
        );
        assert!(keys.to_string().starts_with("same-host 1 MiB batches, 128 keys: 60 put in a keyed exchange"));
    }
}
