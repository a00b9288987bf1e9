//! [`ShardedStore`]: the index spread over several stores (several Redis processes) by key hash.
//!
//! Shard 0 is the *directory*: node records as routing, status and capacity read them, and the
//! leases. Every shard keeps its own copy of each node's record (registration, incarnation, seq,
//! liveness) beside the replicas of the keys that hash to it, so each shard stays a complete
//! [`MetadataStore`] whose scripts (one per atomic write) run unchanged: a shard applies exactly the
//! part of a heartbeat its keys need, under the same seq rules.
//!
//! - **Keys** live in shard `fnv1a(key) % N`: a lookup, a route get or an existence check of a
//!   batch costs one call per shard it touches; key counts and eviction candidates add up the
//!   shards (each key is in one, so the sums are exact).
//! - **Membership writes** go to every shard: registration, unregister, expiry and removal.
//! - **A heartbeat** goes to every shard with that shard's events (a keepalive or an empty part
//!   still moves the shard's liveness and seq), and the answers combine into one: all shards must
//!   agree on the ack. A shard that answers otherwise — it lost the node (a restarted Redis:
//!   `Unknown`), missed a bundle (`SeqGap`), or holds another seq (a heartbeat half applied before
//!   a failure) — makes the heartbeat ask the node to register or full-sync again, which every
//!   shard then takes from a fresh baseline, so the shards converge as a single store recovers.
//!   Re-sending a heartbeat after a failure that left some shards applied is safe: those answer
//!   `AlreadyApplied` with the same seq.
//! - **Capacity** (credit and debit of routed bytes) lives in the directory, which routing reads.
//!
//! The shard list is fixed: every master must be given the same endpoints in the same order;
//! changing it is a new, empty index (nodes re-register and full-sync, as after a Redis restart).
//!
//! On Redis Cluster each shard is a store with its own key prefix: the prefix is the hash tag, so a
//! shard's keys sit in one slot, and prefixes whose slots land on different cluster masters spread
//! the shards over them.

use std::collections::HashMap;
use std::sync::Arc;

use umbp_core::TierType;

use super::{
    EvictionCandidate, ExternalKvMatch, ExternalReport, HeartbeatApply, HeartbeatKind, HeartbeatOutcome, Location,
    MetadataStore, NodeRecord, PeerView, RegisterOutcome, Registration, StoreError, TierCap,
};

/// The shard of `key` among `n`: FNV-1a (64 bit) of its bytes, modulo `n`. Fixed forever: every
/// master, of every version, must place a key in the same shard.
pub fn shard_of(key: &str, n: usize) -> usize {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for b in key.bytes() {
        hash = (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    // `n` is at least 1 (checked at construction) and far below 2^64.
    (hash % n as u64) as usize
}

/// A [`MetadataStore`] over several stores, by key hash ([`shard_of`]). The first shard is the
/// directory (node records as routing and status read them, capacity, leases); every shard keeps its
/// own copy of each node's record beside its keys, so each stays a complete store: membership writes
/// go to every shard, a heartbeat to every shard with that shard's events (the answers combine; any
/// disagreement asks the node to register or full-sync again), reads only to the shards of their
/// keys. Every master must list the same shards in the same order.
#[derive(Debug)]
pub struct ShardedStore {
    shards: Vec<Arc<dyn MetadataStore>>,
}

impl ShardedStore {
    /// The index over `shards`; the first is the directory.
    ///
    /// # Errors
    /// No shard.
    pub fn new(shards: Vec<Arc<dyn MetadataStore>>) -> Result<Self, StoreError> {
        if shards.is_empty() {
            return Err(StoreError::InvalidArgument { reason: "a sharded store needs at least one shard" });
        }
        Ok(Self { shards })
    }

    /// The number of shards.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    fn directory(&self) -> &dyn MetadataStore {
        &*self.shards[0]
    }

    /// `(shard, indices of the keys in it)` for every shard a batch touches, in shard order.
    fn group<'a>(&self, keys: impl Iterator<Item = &'a str>) -> Vec<(usize, Vec<usize>)> {
        let mut by_shard: Vec<Vec<usize>> = vec![Vec::new(); self.shards.len()];
        for (i, key) in keys.enumerate() {
            by_shard[shard_of(key, self.shards.len())].push(i);
        }
        by_shard.into_iter().enumerate().filter(|(_, idx)| !idx.is_empty()).collect()
    }

    /// Runs `f` on every shard; the union of the ids it returns, sorted and without repeats.
    fn union_ids(
        &self,
        f: impl Fn(&dyn MetadataStore) -> Result<Vec<String>, StoreError>,
    ) -> Result<Vec<String>, StoreError> {
        let mut ids = Vec::new();
        for shard in &self.shards {
            ids.extend(f(&**shard)?);
        }
        ids.sort();
        ids.dedup();
        Ok(ids)
    }
}

/// One answer from the answers of every shard to the same heartbeat (see the module docs).
fn combine(outcomes: &[HeartbeatOutcome]) -> HeartbeatOutcome {
    use HeartbeatOutcome::{AlreadyApplied, Applied, SeqGap, Superseded, Unknown};
    if let Some(current) =
        outcomes.iter().filter_map(|o| if let Superseded { current } = o { Some(*current) } else { None }).max()
    {
        return Superseded { current };
    }
    if outcomes.contains(&Unknown) {
        return Unknown;
    }
    let acks: Vec<u64> = outcomes.iter().filter_map(|o| o.acked_seq()).collect();
    let low = acks.iter().copied().min().unwrap_or(0);
    if outcomes.iter().any(|o| matches!(o, SeqGap { .. })) || acks.iter().any(|&a| a != low) {
        // A shard that cannot follow, or shards that disagree: a fresh full sync realigns them all.
        return SeqGap { acked_seq: low };
    }
    if outcomes.iter().any(|o| matches!(o, Applied { .. })) {
        Applied { acked_seq: low }
    } else {
        AlreadyApplied { acked_seq: low }
    }
}

impl MetadataStore for ShardedStore {
    fn register(&self, reg: Registration, now_ms: u64, stale_after_ms: u64) -> Result<RegisterOutcome, StoreError> {
        // The directory decides. Each other shard applies the same registration under its own
        // compare-and-set, so concurrent registrations of several incarnations end with the
        // highest one in every shard, whatever the order they reach the shards in.
        let outcome = self.directory().register(reg.clone(), now_ms, stale_after_ms)?;
        if matches!(outcome, RegisterOutcome::Superseded { .. }) {
            return Ok(outcome);
        }
        for shard in &self.shards[1..] {
            let here = shard.register(reg.clone(), now_ms, stale_after_ms)?;
            if outcome.is_registered() && here == RegisterOutcome::AlreadyExists {
                // The shard still holds this process's live record (it outlived a directory that
                // forgot the node): wipe it as the directory's registration did.
                shard.unregister_incarnation(&reg.node_id, reg.incarnation)?;
                shard.register(reg.clone(), now_ms, stale_after_ms)?;
            }
        }
        Ok(outcome)
    }

    fn unregister_incarnation(&self, node_id: &str, incarnation: u64) -> Result<bool, StoreError> {
        let mut erased = false;
        for shard in &self.shards {
            erased |= shard.unregister_incarnation(node_id, incarnation)?;
        }
        Ok(erased)
    }

    fn apply_heartbeat(&self, hb: HeartbeatApply) -> Result<HeartbeatOutcome, StoreError> {
        let n = self.shards.len();
        let split = |events: &[umbp_core::KvEvent]| {
            let mut parts = vec![Vec::new(); n];
            for e in events {
                parts[shard_of(&e.key, n)].push(e.clone());
            }
            parts
        };
        let kinds: Vec<HeartbeatKind> = match &hb.kind {
            HeartbeatKind::Keepalive => vec![HeartbeatKind::Keepalive; n],
            HeartbeatKind::Delta { seq, events } => {
                split(events).into_iter().map(|events| HeartbeatKind::Delta { seq: *seq, events }).collect()
            }
            HeartbeatKind::FullSyncChunk { baseline_seq, chunk_index, is_final, events } => split(events)
                .into_iter()
                .map(|events| HeartbeatKind::FullSyncChunk {
                    baseline_seq: *baseline_seq,
                    chunk_index: *chunk_index,
                    is_final: *is_final,
                    events,
                })
                .collect(),
        };
        let mut outcomes = Vec::with_capacity(n);
        for (shard, kind) in self.shards.iter().zip(kinds) {
            outcomes.push(shard.apply_heartbeat(HeartbeatApply {
                node_id: hb.node_id.clone(),
                now_ms: hb.now_ms,
                caps: hb.caps.clone(),
                kind,
                incarnation: hb.incarnation,
            })?);
        }
        Ok(combine(&outcomes))
    }

    fn expire_stale(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        self.union_ids(|s| s.expire_stale(cutoff_ms))
    }

    fn remove_expired(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        self.union_ids(|s| s.remove_expired(cutoff_ms))
    }

    fn credit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<(), StoreError> {
        self.directory().credit_capacity(node_id, tier, bytes)
    }

    fn debit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<Option<TierCap>, StoreError> {
        self.directory().debit_capacity(node_id, tier, bytes)
    }

    fn lookup(&self, key: &str) -> Result<Vec<Location>, StoreError> {
        self.shards[shard_of(key, self.shards.len())].lookup(key)
    }

    fn batch_lookup_for_route_get(
        &self,
        keys: &[String],
        exclude: &[String],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Vec<Vec<Location>>, StoreError> {
        let mut out = vec![Vec::new(); keys.len()];
        for (shard, idx) in self.group(keys.iter().map(String::as_str)) {
            let part: Vec<String> = idx.iter().map(|&i| keys[i].clone()).collect();
            let found = self.shards[shard].batch_lookup_for_route_get(&part, exclude, now_ms, lease_ms)?;
            for (i, locations) in idx.into_iter().zip(found) {
                out[i] = locations;
            }
        }
        Ok(out)
    }

    fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        let mut out = vec![false; keys.len()];
        for (shard, idx) in self.group(keys.iter().map(String::as_str)) {
            let part: Vec<String> = idx.iter().map(|&i| keys[i].clone()).collect();
            for (i, found) in idx.into_iter().zip(self.shards[shard].batch_exists(&part)?) {
                out[i] = found;
            }
        }
        Ok(out)
    }

    fn enumerate_eviction_candidates(
        &self,
        buckets: &[(String, TierType)],
        now_ms: u64,
        max_per_bucket: usize,
    ) -> Result<Vec<EvictionCandidate>, StoreError> {
        let mut all = Vec::new();
        for shard in &self.shards {
            all.extend(shard.enumerate_eviction_candidates(buckets, now_ms, max_per_bucket)?);
        }
        // Regroup by bucket in request order (a repeated bucket once), oldest first, capped.
        let mut out = Vec::with_capacity(all.len());
        let mut seen: Vec<(&str, TierType)> = Vec::new();
        for (node, tier) in buckets {
            if seen.contains(&(node.as_str(), *tier)) {
                continue;
            }
            seen.push((node.as_str(), *tier));
            let mut bucket: Vec<EvictionCandidate> =
                all.iter().filter(|c| *c.node_id == **node && c.tier == *tier).cloned().collect();
            bucket.sort_by(|a, b| (a.last_accessed_ms, &*a.key).cmp(&(b.last_accessed_ms, &*b.key)));
            if max_per_bucket > 0 {
                bucket.truncate(max_per_bucket);
            }
            out.extend(bucket);
        }
        Ok(out)
    }

    fn get_node(&self, node_id: &str) -> Result<Option<NodeRecord>, StoreError> {
        self.directory().get_node(node_id)
    }

    fn is_alive(&self, node_id: &str) -> Result<bool, StoreError> {
        self.directory().is_alive(node_id)
    }

    fn list_alive(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.directory().list_alive()
    }

    fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.directory().list_nodes()
    }

    fn alive_peer_view(&self) -> Result<HashMap<Arc<str>, PeerView>, StoreError> {
        self.directory().alive_peer_view()
    }

    fn key_count(&self) -> Result<u64, StoreError> {
        let mut total = 0u64;
        for shard in &self.shards {
            total = total.saturating_add(shard.key_count()?);
        }
        Ok(total)
    }

    fn node_key_count(&self, node_id: &str) -> Result<u64, StoreError> {
        let mut total = 0u64;
        for shard in &self.shards {
            total = total.saturating_add(shard.node_key_count(node_id)?);
        }
        Ok(total)
    }

    fn report_external_kv(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<ExternalReport, StoreError> {
        super::external::check_node_tier(node_id, tier)?;
        super::external::check_hashes(hashes, true)?;
        // Each hash's records live in the shard of the hash; each shard checks the node's liveness
        // in its own copy of the record (membership writes reach every shard).
        let mut outcome = ExternalReport::Recorded;
        for (shard, idx) in self.group(hashes.iter().map(String::as_str)) {
            let part: Vec<String> = idx.iter().map(|&i| hashes[i].clone()).collect();
            if self.shards[shard].report_external_kv(node_id, &part, tier)? == ExternalReport::NodeNotAlive {
                outcome = ExternalReport::NodeNotAlive;
            }
        }
        Ok(outcome)
    }

    fn revoke_external_kv(&self, node_id: &str, hashes: &[String], tier: TierType) -> Result<(), StoreError> {
        super::external::check_node_tier(node_id, tier)?;
        super::external::check_hashes(hashes, true)?;
        for (shard, idx) in self.group(hashes.iter().map(String::as_str)) {
            let part: Vec<String> = idx.iter().map(|&i| hashes[i].clone()).collect();
            self.shards[shard].revoke_external_kv(node_id, &part, tier)?;
        }
        Ok(())
    }

    fn revoke_all_external_kv_at_tier(&self, node_id: &str, tier: TierType) -> Result<(), StoreError> {
        for shard in &self.shards {
            shard.revoke_all_external_kv_at_tier(node_id, tier)?;
        }
        Ok(())
    }

    fn match_external_kv(&self, hashes: &[String], count_as_hit: bool) -> Result<Vec<ExternalKvMatch>, StoreError> {
        super::external::check_hashes(hashes, false)?;
        let wanted = super::external::distinct(hashes);
        let mut hits: Vec<(u32, Arc<str>, TierType)> = Vec::new();
        for (shard, idx) in self.group(wanted.iter().map(|(_, h)| *h)) {
            let part: Vec<String> = idx.iter().map(|&i| wanted[i].1.to_owned()).collect();
            for m in self.shards[shard].match_external_kv(&part, count_as_hit)? {
                for (tier, found) in m.hashes_by_tier {
                    // The shard's indexes are into `part`; map them back to the request's.
                    for local in found {
                        if let Some(&(index, _)) = idx.get(local as usize).and_then(|&i| wanted.get(i)) {
                            hits.push((index, Arc::clone(&m.node_id), tier));
                        }
                    }
                }
            }
        }
        Ok(super::external::group_matches(hits.iter().map(|(i, node, tier)| (*i, &**node, *tier))))
    }

    fn external_kv_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, StoreError> {
        super::external::check_hashes(hashes, false)?;
        let wanted = super::external::distinct(hashes);
        let mut counts: Vec<Option<u64>> = vec![None; wanted.len()];
        for (shard, idx) in self.group(wanted.iter().map(|(_, h)| *h)) {
            let part: Vec<String> = idx.iter().map(|&i| wanted[i].1.to_owned()).collect();
            let found: HashMap<String, u64> = self.shards[shard].external_kv_hit_counts(&part)?.into_iter().collect();
            for i in idx {
                counts[i] = found.get(wanted[i].1).copied();
            }
        }
        Ok(wanted.iter().zip(counts).filter_map(|((_, h), c)| c.map(|c| ((*h).to_owned(), c))).collect())
    }

    fn acquire_lease(&self, name: &str, holder: &str, now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError> {
        self.directory().acquire_lease(name, holder, now_ms, ttl_ms)
    }

    fn release_lease(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
        self.directory().release_lease(name, holder)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_always_lands_in_the_same_shard() {
        // Pinned values: changing the hash would move every key of every deployed index.
        assert_eq!(shard_of("", 3), (0xcbf2_9ce4_8422_2325u64 % 3) as usize);
        assert_eq!(shard_of("a", 1), 0);
        let spread: std::collections::HashSet<usize> = (0..64).map(|i| shard_of(&format!("k{i}"), 3)).collect();
        assert_eq!(spread.len(), 3, "keys spread over every shard");
    }

    #[test]
    fn shards_that_disagree_ask_for_a_full_sync() {
        use HeartbeatOutcome::*;
        assert_eq!(combine(&[Applied { acked_seq: 4 }, AlreadyApplied { acked_seq: 4 }]), Applied { acked_seq: 4 });
        assert_eq!(combine(&[AlreadyApplied { acked_seq: 4 }; 2]), AlreadyApplied { acked_seq: 4 });
        assert_eq!(combine(&[Applied { acked_seq: 4 }, Applied { acked_seq: 3 }]), SeqGap { acked_seq: 3 });
        assert_eq!(combine(&[Applied { acked_seq: 4 }, Unknown]), Unknown);
        assert_eq!(combine(&[Unknown, Superseded { current: 9 }]), Superseded { current: 9 });
        assert_eq!(combine(&[Applied { acked_seq: 4 }, SeqGap { acked_seq: 4 }]), SeqGap { acked_seq: 4 });
    }
}
