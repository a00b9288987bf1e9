//! The external KV index: advisory records of KV blocks a node holds *outside* the pool (an
//! engine's GPU HBM or pinned host memory), which a scheduler matches to route a request to the
//! node that already holds its prefix (issue 21, item 2; `docs/design/external-kv-index.md`).
//!
//! A record is `(hash, node, tier)`; each hash also carries a hit counter that a counted match
//! bumps. The index is separate from the key index: no size, no lease, no eviction, and it never
//! routes a get or a put. Both stores keep it under the same contract (the `store_external`
//! contract tests):
//!
//! - a report of a node that is not ALIVE records nothing ([`ExternalReport::NodeNotAlive`]): a
//!   ghost's records would otherwise route requests to nothing forever;
//! - revokes need no live node (cleaning up after a dead node is allowed);
//! - expiry, unregister and (re-)registration drop the node's records in the same step as its
//!   locations, so a new incarnation starts with none;
//! - a hash's hit counter lives as long as any node holds the hash (the reference keeps counters for
//!   a TTL after the last holder goes; tying them to the records bounds them without a sweeper).
//!
//! This module holds the argument checks and the in-memory half ([`ExternalIndex`], one map by
//! hash and one by node, behind one lock; the [`InMemoryStore`](super::InMemoryStore) takes the
//! node's lock around it so a report never lands after the node's wipe).

use std::collections::HashMap as StdHashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use foldhash::{HashMap, HashSet};
use parking_lot::RwLock;
use umbp_core::TierType;

use super::StoreError;

/// Most hashes one external-index call takes (a prompt of 256k tokens in 16-token pages).
pub const MAX_EXTERNAL_KV_HASHES: usize = 16_384;

/// Longest hash accepted, in bytes (SGLang's are 64 hex digits).
pub const MAX_EXTERNAL_KV_HASH_BYTES: usize = 1024;

/// What [`MetadataStore::report_external_kv`](super::MetadataStore::report_external_kv) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExternalReport {
    /// The records stand (added, or already there).
    Recorded,
    /// The node is not registered and ALIVE: nothing was recorded.
    NodeNotAlive,
}

/// One node that holds some of the hashes a match asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalKvMatch {
    /// The holding node.
    pub node_id: Arc<str>,
    /// The matched hashes by tier, as indexes into the request's hashes (a repeated hash is named by
    /// its first occurrence): tiers in ascending order (fastest first), indexes ascending; a hash on
    /// two tiers is in both. No tier is empty. Indexes, not strings: the caller has the strings,
    /// and a match of 1,024 hashes would otherwise copy each matched one per holder and tier.
    pub hashes_by_tier: Vec<(TierType, Vec<u32>)>,
}

impl ExternalKvMatch {
    /// Distinct hashes matched on this node (a hash on two tiers counts once).
    pub fn matched_hash_count(&self) -> usize {
        let mut all: Vec<u32> = self.hashes_by_tier.iter().flat_map(|(_, idx)| idx.iter().copied()).collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    }
}

/// Checks the hashes of a call: at most [`MAX_EXTERNAL_KV_HASHES`], each non-empty and at most
/// [`MAX_EXTERNAL_KV_HASH_BYTES`]; `required` also refuses an empty list.
pub(crate) fn check_hashes(hashes: &[String], required: bool) -> Result<(), StoreError> {
    if required && hashes.is_empty() {
        return Err(StoreError::InvalidArgument { reason: "hashes must not be empty" });
    }
    if hashes.len() > MAX_EXTERNAL_KV_HASHES {
        return Err(StoreError::InvalidArgument { reason: "too many hashes in one call (at most 16384)" });
    }
    if hashes.iter().any(|h| h.is_empty() || h.len() > MAX_EXTERNAL_KV_HASH_BYTES) {
        return Err(StoreError::InvalidArgument { reason: "a hash must be 1 to 1024 bytes" });
    }
    Ok(())
}

/// Checks the node and tier of a report or revoke.
pub(crate) fn check_node_tier(node_id: &str, tier: TierType) -> Result<(), StoreError> {
    if node_id.is_empty() {
        return Err(StoreError::InvalidArgument { reason: "empty node_id" });
    }
    if tier == TierType::Unknown {
        return Err(StoreError::InvalidArgument { reason: "an external block needs a tier (HBM, DRAM or SSD)" });
    }
    Ok(())
}

/// The request's hashes without repeats, in first-seen order, each with its request index (a match
/// counts each hash once).
pub(crate) fn distinct(hashes: &[String]) -> Vec<(u32, &str)> {
    if hashes.len() <= 1 {
        return hashes.iter().map(String::as_str).map(|h| (0, h)).collect();
    }
    let mut seen: HashSet<&str> = HashSet::with_capacity_and_hasher(hashes.len(), Default::default());
    // Lossless: a call takes at most MAX_EXTERNAL_KV_HASHES hashes.
    hashes.iter().enumerate().filter(|(_, h)| seen.insert(h.as_str())).map(|(i, h)| (i as u32, h.as_str())).collect()
}

/// Builds the per-node answer from `(request index, node, tier)` hits.
pub(crate) fn group_matches<'a>(hits: impl IntoIterator<Item = (u32, &'a str, TierType)>) -> Vec<ExternalKvMatch> {
    let mut by_node: HashMap<&str, Vec<(TierType, u32)>> = HashMap::default();
    for (index, node, tier) in hits {
        by_node.entry(node).or_default().push((tier, index));
    }
    let mut out: Vec<ExternalKvMatch> = by_node
        .into_iter()
        .map(|(node, mut found)| {
            found.sort_unstable();
            found.dedup();
            let mut hashes_by_tier: Vec<(TierType, Vec<u32>)> = Vec::new();
            for (tier, index) in found {
                match hashes_by_tier.last_mut() {
                    Some((t, list)) if *t == tier => list.push(index),
                    _ => hashes_by_tier.push((tier, vec![index])),
                }
            }
            ExternalKvMatch { node_id: Arc::from(node), hashes_by_tier }
        })
        .collect();
    out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    out
}

/// One hash's holders and hit counter.
struct Entry {
    /// `(node, tier)`; never empty (the entry goes with its last holder).
    holders: Vec<(Arc<str>, TierType)>,
    hits: AtomicU64,
}

#[derive(Default)]
struct Maps {
    by_hash: HashMap<Arc<str>, Entry>,
    /// `node → tier → hashes`, for revoke-all and the node's wipe.
    by_node: HashMap<Arc<str>, StdHashMap<TierType, HashSet<Arc<str>>>>,
}

impl Maps {
    /// Drops `(hash, node, tier)`; the entry goes with its last holder. The by-node side is the
    /// caller's.
    fn drop_holder(&mut self, hash: &str, node_id: &str, tier: TierType) {
        let Some(entry) = self.by_hash.get_mut(hash) else { return };
        entry.holders.retain(|(n, t)| !(*t == tier && &**n == node_id));
        if entry.holders.is_empty() {
            self.by_hash.remove(hash);
        }
    }
}

/// The in-memory external index (see the module docs). Liveness is the caller's: it holds the
/// node's lock around [`report`](Self::report) and [`wipe_node`](Self::wipe_node).
#[derive(Default)]
pub(crate) struct ExternalIndex {
    maps: RwLock<Maps>,
}

impl ExternalIndex {
    /// Records that `node_id` holds `hashes` at `tier` (additive).
    pub(crate) fn report(&self, node_id: &str, hashes: &[String], tier: TierType) {
        let mut maps = self.maps.write();
        let Maps { by_hash, by_node } = &mut *maps;
        let node: Arc<str> = match by_node.get_key_value(node_id) {
            Some((k, _)) => Arc::clone(k),
            None => Arc::from(node_id),
        };
        let held = by_node.entry(Arc::clone(&node)).or_default().entry(tier).or_default();
        for hash in hashes {
            if held.contains(hash.as_str()) {
                continue;
            }
            let key: Arc<str> = match by_hash.get_key_value(hash.as_str()) {
                Some((k, _)) => Arc::clone(k),
                None => Arc::from(hash.as_str()),
            };
            by_hash
                .entry(Arc::clone(&key))
                .or_insert_with(|| Entry { holders: Vec::new(), hits: AtomicU64::new(0) })
                .holders
                .push((Arc::clone(&node), tier));
            held.insert(key);
        }
    }

    /// Drops `hashes` of `node_id` at `tier`.
    pub(crate) fn revoke(&self, node_id: &str, hashes: &[String], tier: TierType) {
        let mut maps = self.maps.write();
        let Some(held) = maps.by_node.get_mut(node_id).and_then(|tiers| tiers.get_mut(&tier)) else { return };
        let gone: Vec<Arc<str>> = hashes.iter().filter_map(|h| held.take(h.as_str())).collect();
        for hash in &gone {
            maps.drop_holder(hash, node_id, tier);
        }
        prune_node(&mut maps, node_id);
    }

    /// Drops every hash of `node_id` at `tier`.
    pub(crate) fn revoke_all_at_tier(&self, node_id: &str, tier: TierType) {
        let mut maps = self.maps.write();
        let Some(held) = maps.by_node.get_mut(node_id).and_then(|tiers| tiers.remove(&tier)) else { return };
        for hash in &held {
            maps.drop_holder(hash, node_id, tier);
        }
        prune_node(&mut maps, node_id);
    }

    /// Drops every record of `node_id` (expiry, unregister, registration).
    pub(crate) fn wipe_node(&self, node_id: &str) {
        let mut maps = self.maps.write();
        let Some(tiers) = maps.by_node.remove(node_id) else { return };
        for (tier, held) in tiers {
            for hash in &held {
                maps.drop_holder(hash, node_id, tier);
            }
        }
    }

    /// Per node, the requested hashes it holds; with `count_as_hit`, each distinct matched hash's
    /// counter goes up by one.
    pub(crate) fn matches(&self, hashes: &[String], count_as_hit: bool) -> Vec<ExternalKvMatch> {
        let wanted = distinct(hashes);
        let maps = self.maps.read();
        let mut hits: Vec<(u32, &str, TierType)> = Vec::with_capacity(wanted.len());
        for (index, hash) in wanted {
            let Some(entry) = maps.by_hash.get(hash) else { continue };
            if count_as_hit {
                entry.hits.fetch_add(1, Ordering::Relaxed);
            }
            hits.extend(entry.holders.iter().map(|(node, tier)| (index, &**node, *tier)));
        }
        group_matches(hits)
    }

    /// `(hash, count)` for each distinct requested hash whose count is above 0, in request order.
    pub(crate) fn hit_counts(&self, hashes: &[String]) -> Vec<(String, u64)> {
        let maps = self.maps.read();
        distinct(hashes)
            .into_iter()
            .filter_map(|(_, hash)| {
                let count = maps.by_hash.get(hash)?.hits.load(Ordering::Relaxed);
                (count > 0).then(|| (hash.to_owned(), count))
            })
            .collect()
    }

    /// Records of the node (for tests and diagnostics).
    #[cfg(test)]
    fn node_records(&self, node_id: &str) -> usize {
        self.maps.read().by_node.get(node_id).map_or(0, |tiers| tiers.values().map(HashSet::len).sum())
    }
}

/// Removes a node's empty tier sets, and its row once none is left.
fn prune_node(maps: &mut Maps, node_id: &str) {
    if let Some(tiers) = maps.by_node.get_mut(node_id) {
        tiers.retain(|_, held| !held.is_empty());
        if tiers.is_empty() {
            maps.by_node.remove(node_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(list: &[&str]) -> Vec<String> {
        list.iter().map(|h| (*h).to_owned()).collect()
    }

    #[test]
    fn the_index_forgets_a_hash_with_its_last_holder_and_a_node_with_its_last_hash() {
        let index = ExternalIndex::default();
        index.report("a", &owned(&["h1", "h2"]), TierType::Hbm);
        index.report("a", &owned(&["h1"]), TierType::Dram);
        index.report("b", &owned(&["h1"]), TierType::Hbm);
        assert_eq!(index.node_records("a"), 3);
        index.revoke("a", &owned(&["h1", "h2", "nope"]), TierType::Hbm);
        assert_eq!(index.node_records("a"), 1);
        assert!(!index.maps.read().by_hash.contains_key("h2"));
        index.revoke_all_at_tier("a", TierType::Dram);
        assert!(!index.maps.read().by_node.contains_key("a"));
        index.wipe_node("b");
        assert!(index.maps.read().by_hash.is_empty() && index.maps.read().by_node.is_empty());
    }

    #[test]
    fn argument_checks() {
        assert!(check_hashes(&[], true).is_err());
        assert!(check_hashes(&[], false).is_ok());
        assert!(check_hashes(&owned(&[""]), false).is_err());
        assert!(check_hashes(&["x".repeat(MAX_EXTERNAL_KV_HASH_BYTES + 1)], false).is_err());
        assert!(check_hashes(&vec!["h".to_owned(); MAX_EXTERNAL_KV_HASHES + 1], false).is_err());
        assert!(check_hashes(&vec!["h".to_owned(); MAX_EXTERNAL_KV_HASHES], true).is_ok());
        assert!(check_node_tier("", TierType::Hbm).is_err());
        assert!(check_node_tier("a", TierType::Unknown).is_err());
    }
}
