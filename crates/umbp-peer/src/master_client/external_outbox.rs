//! The node's own external KV records, shipped through its heartbeat (issue 21, item 2; the design's
//! "Shipping and restart"): the two-argument forms [`MasterClient::queue_external_kv_report`] and
//! friends queue a change, the next heartbeat round numbers the queued changes into delta bundles
//! of their own (no key events), and they travel and are re-sent under those seqs exactly as key
//! events are — applied in order, re-acknowledged after a lost ack, never applied across a gap.
//!
//! The node also keeps its current external set (`tier → hashes`: what it reported minus what it
//! revoked). A full sync (after a gap, an outbox overflow, a clear, or a re-registration once the
//! master forgot the node — a restarted master) drops the queued changes with the key deltas; it
//! says `external_full_sync`, so the master drops the node's old records at its first chunk, and once
//! the sync is acknowledged the whole set is queued again as reports. So a restarted master rebuilds
//! the index from its nodes without restarting them, and a revoke lost with replaced deltas never
//! lingers. A node that never queued a change sends no `external_full_sync`: records a light client
//! reports on its behalf are left alone.

use std::collections::{BTreeMap, HashSet, VecDeque};

use prost::Message;
use umbp_core::TierType;
use umbp_proto::convert::tier_to_wire;
use umbp_proto::v1 as pb;

use super::{Inner, MasterClient, MasterClientError};

/// Most hashes in one queued bundle (a bundle of 64-digit hashes stays near 300 KB, well under a
/// request's byte budget).
const HASHES_PER_BUNDLE: usize = 4096;

/// The node's external KV state beside the heartbeat's seq state.
#[derive(Debug, Default)]
pub(super) struct ExternalOutbox {
    /// `tier → hashes` the node holds as far as the master should know; `None` until the first
    /// queued change.
    set: Option<BTreeMap<TierType, HashSet<String>>>,
    /// Changes not yet numbered into a bundle.
    pending: Vec<pb::ExternalKvEvent>,
    /// Numbered changes not yet acknowledged, ascending seqs (each also has an empty key bundle of
    /// the same seq in the heartbeat outbox).
    bundles: VecDeque<pb::ExternalKvBundle>,
}

impl ExternalOutbox {
    /// Whether the node keeps an external set (its full syncs then say so).
    pub(super) fn in_use(&self) -> bool {
        self.set.is_some()
    }

    fn queue(&mut self, op: pb::ExternalKvOp, tier: TierType, hashes: Vec<String>) {
        let set = self.set.get_or_insert_with(BTreeMap::new);
        match op {
            pb::ExternalKvOp::ExternalKvReport => set.entry(tier).or_default().extend(hashes.iter().cloned()),
            pb::ExternalKvOp::ExternalKvRevoke => {
                if let Some(held) = set.get_mut(&tier) {
                    for h in &hashes {
                        held.remove(h);
                    }
                }
            }
            pb::ExternalKvOp::ExternalKvRevokeAllAtTier => {
                set.remove(&tier);
            }
        }
        if hashes.is_empty() {
            self.pending.push(pb::ExternalKvEvent { op: op as i32, tier: tier_to_wire(tier), hashes });
            return;
        }
        for part in hashes.chunks(HASHES_PER_BUNDLE) {
            self.pending.push(pb::ExternalKvEvent { op: op as i32, tier: tier_to_wire(tier), hashes: part.to_vec() });
        }
    }

    /// Takes the pending changes, cut into bundles of at most [`HASHES_PER_BUNDLE`] hashes, for the
    /// caller to number.
    pub(super) fn take_pending(&mut self) -> Vec<Vec<pb::ExternalKvEvent>> {
        let mut out: Vec<Vec<pb::ExternalKvEvent>> = Vec::new();
        let mut hashes = 0;
        for event in std::mem::take(&mut self.pending) {
            let n = event.hashes.len().max(1);
            match out.last_mut() {
                Some(bundle) if hashes + n <= HASHES_PER_BUNDLE => bundle.push(event),
                _ => {
                    hashes = 0;
                    out.push(vec![event]);
                }
            }
            hashes += n;
        }
        out
    }

    /// Records a numbered bundle.
    pub(super) fn push_bundle(&mut self, seq: u64, events: Vec<pb::ExternalKvEvent>) {
        self.bundles.push_back(pb::ExternalKvBundle { seq, events });
    }

    /// The bundle numbered `seq`, if it carries changes.
    pub(super) fn bundle(&self, seq: u64) -> Option<&pb::ExternalKvBundle> {
        self.bundles.iter().find(|b| b.seq == seq)
    }

    /// Bytes the bundle `seq` adds to a request.
    pub(super) fn bundle_len(&self, seq: u64) -> usize {
        self.bundle(seq).map_or(0, |b| super::wire::nested_len(b.encoded_len()))
    }

    /// The master acknowledged every seq up to `acked`.
    pub(super) fn acked(&mut self, acked: u64) {
        while self.bundles.front().is_some_and(|b| b.seq <= acked) {
            self.bundles.pop_front();
        }
    }

    /// A full sync replaces the queued deltas: their changes are in the set, sent again after it.
    pub(super) fn drop_queued(&mut self) {
        self.pending.clear();
        self.bundles.clear();
    }

    /// After an acknowledged full sync with `external_full_sync` (the master dropped the node's
    /// records): queues the whole set again as reports. Returns whether anything was queued.
    pub(super) fn replay(&mut self) -> bool {
        let Some(set) = self.set.take() else { return false };
        for (tier, hashes) in &set {
            let mut all: Vec<String> = hashes.iter().cloned().collect();
            all.sort_unstable();
            if !all.is_empty() {
                self.queue(pb::ExternalKvOp::ExternalKvReport, *tier, all);
            }
        }
        self.set = Some(set);
        !self.pending.is_empty()
    }
}

impl Inner {
    /// Numbers the pending external changes into delta bundles of their own (no key events), after
    /// the round's key bundles. Caller holds the send lock.
    pub(super) fn bundle_external(&self) {
        let mut st = self.state.lock();
        for events in st.external.take_pending() {
            let seq = st.next_seq;
            st.next_seq += 1;
            st.outbox.push_back(pb::EventBundle { seq, events: Vec::new() });
            st.external.push_bundle(seq, events);
        }
    }
}

fn check(hashes: &[String], tier: TierType) -> Result<(), MasterClientError> {
    if tier == TierType::Unknown {
        return Err(MasterClientError::InvalidArgument("an external block needs a tier (HBM, DRAM or SSD)".into()));
    }
    if hashes.iter().any(String::is_empty) {
        return Err(MasterClientError::InvalidArgument("a hash must not be empty".into()));
    }
    Ok(())
}

impl MasterClient {
    fn queue_external(&self, op: pb::ExternalKvOp, hashes: &[String], tier: TierType) -> Result<(), MasterClientError> {
        if self.inner.shut_down.load(std::sync::atomic::Ordering::Acquire) {
            return Err(MasterClientError::ShutDown);
        }
        check(hashes, tier)?;
        self.inner.state.lock().external.queue(op, tier, hashes.to_vec());
        self.flush();
        Ok(())
    }

    /// This node holds `hashes` at `tier` outside the pool: queued for the next heartbeat (woken now)
    /// and kept in the node's external set, which every full sync ships again (see the module docs).
    /// Needs the heartbeat loop (or [`heartbeat_once`](Self::heartbeat_once)) to reach the master.
    ///
    /// # Errors
    /// An empty `hashes` or hash, [`TierType::Unknown`]; [`ShutDown`](MasterClientError::ShutDown).
    pub fn queue_external_kv_report(&self, hashes: &[String], tier: TierType) -> Result<(), MasterClientError> {
        if hashes.is_empty() {
            return Err(MasterClientError::InvalidArgument("hashes must not be empty".into()));
        }
        self.queue_external(pb::ExternalKvOp::ExternalKvReport, hashes, tier)
    }

    /// This node no longer holds `hashes` at `tier`: queued as
    /// [`queue_external_kv_report`](Self::queue_external_kv_report) is.
    ///
    /// # Errors
    /// As [`queue_external_kv_report`](Self::queue_external_kv_report).
    pub fn queue_external_kv_revoke(&self, hashes: &[String], tier: TierType) -> Result<(), MasterClientError> {
        if hashes.is_empty() {
            return Err(MasterClientError::InvalidArgument("hashes must not be empty".into()));
        }
        self.queue_external(pb::ExternalKvOp::ExternalKvRevoke, hashes, tier)
    }

    /// This node's `tier` was wiped: every block of it at `tier` goes. Queued as
    /// [`queue_external_kv_report`](Self::queue_external_kv_report) is.
    ///
    /// # Errors
    /// [`TierType::Unknown`]; [`ShutDown`](MasterClientError::ShutDown).
    pub fn queue_external_kv_revoke_all_at_tier(&self, tier: TierType) -> Result<(), MasterClientError> {
        self.queue_external(pb::ExternalKvOp::ExternalKvRevokeAllAtTier, &[], tier)
    }

    /// Hashes in the node's external set (what it reported minus what it revoked), all tiers.
    pub fn external_kv_block_count(&self) -> usize {
        self.inner.state.lock().external.set.as_ref().map_or(0, |set| set.values().map(HashSet::len).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("h{i}")).collect()
    }

    #[test]
    fn changes_are_cut_into_bounded_bundles_and_the_set_follows_them() {
        let mut x = ExternalOutbox::default();
        assert!(!x.in_use());
        x.queue(pb::ExternalKvOp::ExternalKvReport, TierType::Hbm, owned(HASHES_PER_BUNDLE + 10));
        x.queue(pb::ExternalKvOp::ExternalKvRevoke, TierType::Hbm, owned(5));
        x.queue(pb::ExternalKvOp::ExternalKvRevokeAllAtTier, TierType::Dram, Vec::new());
        let bundles = x.take_pending();
        let sizes: Vec<usize> = bundles.iter().map(|b| b.iter().map(|e| e.hashes.len().max(1)).sum()).collect();
        assert_eq!(sizes, [HASHES_PER_BUNDLE, 16], "{sizes:?}");
        assert!(x.in_use());
        assert_eq!(x.set.as_ref().map(|s| s[&TierType::Hbm].len()), Some(HASHES_PER_BUNDLE + 5));
        for (i, events) in bundles.into_iter().enumerate() {
            x.push_bundle(i as u64 + 1, events);
        }
        x.acked(1);
        assert!(x.bundle(1).is_none() && x.bundle(2).is_some());
        x.drop_queued();
        assert!(x.replay(), "the whole set is queued again");
        let replayed: usize = x.take_pending().iter().flatten().map(|e| e.hashes.len()).sum();
        assert_eq!(replayed, HASHES_PER_BUNDLE + 5);
    }
}
