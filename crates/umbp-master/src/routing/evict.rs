//! Eviction policy: which (node, tier) must shed bytes and which keys go first.
//!
//! The master decides and the peer makes it final: the manager sends the chosen keys in `EvictKey`
//! and changes no state of its own. A key the peer protects (leased or pinned) frees 0 bytes and stays
//! indexed; its bytes go back to its bucket's budget so the round continues with the next-oldest keys
//! ([`VictimPicker`]), and the manager leaves it out of the next few rounds.
//!
//! # Units
//! A medium reports its capacity in what it allocates, whole pages, while the index records each
//! key's byte length. Budgets and spending are both in the capacity's unit: a victim is charged its
//! page-rounded size ([`charged_bytes`]); spending byte lengths against a page budget evicted about
//! page/value times the keys needed (2.7 times with 64 KiB pages and 24 KiB values).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use umbp_core::TierType;

use super::error::RoutingConfigError;
use super::types::{Candidate, TierSlot};

/// The eviction manager's settings. The defaults are the reference's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvictionConfig {
    /// A (node, tier) whose used fraction reaches this is under pressure (default 0.9).
    pub high_watermark: f64,
    /// Pressure is relieved down to this used fraction (default 0.7); the gap to the high mark keeps
    /// the manager from evicting a few bytes on every tick.
    pub low_watermark: f64,
    /// How often the manager looks for pressure (`UMBP_EVICTION_CHECK_INTERVAL_SEC`, default 5 s).
    pub check_interval: Duration,
    /// How long a routed get protects its key from eviction (`UMBP_LEASE_DURATION_SEC`, default
    /// 2 s): long enough for the reader to resolve the key on the peer, which then takes its own lease.
    pub lease_duration: Duration,
    /// Deadline of one `EvictKey` call (`UMBP_EVICTKEY_DEADLINE_MS`, default 1 s), so a hung peer
    /// cannot stall the eviction of the others.
    pub evict_deadline: Duration,
}

impl Default for EvictionConfig {
    fn default() -> Self {
        Self {
            high_watermark: 0.9,
            low_watermark: 0.7,
            check_interval: Duration::from_secs(5),
            lease_duration: Duration::from_secs(2),
            evict_deadline: Duration::from_secs(1),
        }
    }
}

impl EvictionConfig {
    /// Checks `0 < low < high <= 1` (which also rejects NaN) and that every duration is non-zero.
    pub fn validate(&self) -> Result<(), RoutingConfigError> {
        let (high, low) = (self.high_watermark, self.low_watermark);
        if !(0.0 < low && low < high && high <= 1.0) {
            return Err(RoutingConfigError::InvalidWatermarks { high, low });
        }
        for (name, value) in [
            ("check_interval", self.check_interval),
            ("lease_duration", self.lease_duration),
            ("evict_deadline", self.evict_deadline),
        ] {
            if value.is_zero() {
                return Err(RoutingConfigError::ZeroDuration { name });
            }
        }
        Ok(())
    }
}

/// A node and its media, as [`plan_eviction`] reads them; implemented for [`Candidate`] (the same
/// alive list put routing uses) and for a plain `(node_id, tiers)` pair.
pub trait NodeTiers {
    /// The node's id.
    fn node_id(&self) -> &Arc<str>;
    /// The node's media and their capacity.
    fn tiers(&self) -> &[TierSlot];
}

impl NodeTiers for Candidate {
    fn node_id(&self) -> &Arc<str> {
        &self.node_id
    }

    fn tiers(&self) -> &[TierSlot] {
        &self.tiers
    }
}

impl NodeTiers for (Arc<str>, Vec<TierSlot>) {
    fn node_id(&self) -> &Arc<str> {
        &self.0
    }

    fn tiers(&self) -> &[TierSlot] {
        &self.1
    }
}

/// What a key of `size` bytes occupies on a medium of `page_size`-byte pages: its size rounded up to
/// whole pages, in which the medium counts its capacity. A page size of 0 (unknown: a node older than
/// the field) charges the size itself.
pub const fn charged_bytes(size: u64, page_size: u64) -> u64 {
    if page_size == 0 { size } else { size.div_ceil(page_size).saturating_mul(page_size) }
}

/// Bytes to free on one (node, tier).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Bucket {
    /// The node under pressure.
    pub node_id: Arc<str>,
    /// The medium under pressure.
    pub tier: TierType,
    /// Bytes to free to come back to the low watermark, in the medium's capacity unit (whole pages).
    pub budget_bytes: u64,
    /// The medium's page size (0: unknown); each victim spends its [`charged_bytes`].
    pub page_size: u64,
}

/// A key the store offers for eviction: unleased, with its location and last access.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EvictionCandidate {
    /// The key.
    pub key: String,
    /// The node holding this copy.
    pub node_id: Arc<str>,
    /// The medium holding this copy.
    pub tier: TierType,
    /// The value's byte length, as indexed; the medium holds it in whole pages, so a victim spends
    /// [`charged_bytes`] of its bucket's budget.
    pub size: u64,
    /// When a get last routed to the key (ms on the master's clock); smaller is older.
    pub last_accessed_ms: u64,
}

/// The (node, tier) buckets that must shed bytes, in input order.
///
/// For each medium with `total > 0`: `used = total - available` (0 if a node reports more free than
/// total); if `used / total >= high`, the budget is `used - floor(total × low)`. Every medium is
/// treated alike, SSD included. `high` and `low` are expected to have passed
/// [`EvictionConfig::validate`].
///
/// The arithmetic is done in integers with the watermarks rounded to a millionth, so the budget is
/// exact for the decimal the operator wrote: `0.7` of 80 GiB is 60129542144 bytes, where the binary
/// `0.7 × total` of the reference comes out one byte short.
pub fn plan_eviction<N: NodeTiers>(nodes: &[N], high: f64, low: f64) -> Vec<Bucket> {
    let (high, low) = (parts_per_million(high), parts_per_million(low));
    let mut buckets = Vec::new();
    for node in nodes {
        for slot in node.tiers() {
            if slot.total_bytes == 0 {
                continue;
            }
            let total = u128::from(slot.total_bytes);
            let used = u128::from(slot.total_bytes.saturating_sub(slot.available_bytes));
            if used * PPM < total * high {
                continue;
            }
            let budget = used.saturating_sub(total * low / PPM);
            // `budget <= used <= total`, so it always fits back into u64.
            let budget_bytes = u64::try_from(budget).unwrap_or(u64::MAX);
            if budget_bytes > 0 {
                buckets.push(Bucket {
                    node_id: node.node_id().clone(),
                    tier: slot.tier,
                    budget_bytes,
                    page_size: slot.page_size,
                });
            }
        }
    }
    buckets
}

pub(crate) const PPM: u128 = 1_000_000;

/// A watermark as an integer count of millionths, clamped to `0..=1` (NaN reads as 0).
pub(crate) fn parts_per_million(fraction: f64) -> u128 {
    // `as` saturates and maps NaN to 0; the clamp keeps an unvalidated value inside 0..=1.
    ((fraction * 1e6).round() as u128).min(PPM)
}

/// Least recently used victims, grouped by node, each node's keys oldest first.
///
/// Candidates are sorted oldest first (stable, so equal stamps keep the store's order); a candidate
/// is taken while its own (node, tier) budget is still positive, and its page-rounded size
/// ([`charged_bytes`]) is subtracted from that budget only, so buckets are independent. The last
/// victim of a bucket may overshoot the budget: a key cannot be half evicted. Candidates of a
/// (node, tier) without a bucket are never taken.
///
/// This is one pass of a [`VictimPicker`]; the eviction manager uses the picker itself, so that
/// bytes a victim did not free go back to its bucket and the round continues down the list.
pub fn select_victims(candidates: Vec<EvictionCandidate>, buckets: &[Bucket]) -> HashMap<Arc<str>, Vec<String>> {
    let mut victims: HashMap<Arc<str>, Vec<String>> = HashMap::new();
    for victim in VictimPicker::new(candidates, buckets).take(|_| false) {
        victims.entry(victim.node_id).or_default().push(victim.key);
    }
    victims
}

/// The victim selection of one eviction round, which can continue down the LRU lists.
///
/// A peer frees 0 bytes for a key it protects (leased or pinned). Without feedback those keys would
/// use up their bucket's budget on every round while nothing is freed. The manager therefore
/// [`settle`](Self::settle)s each victim with what its peer freed (the pages not freed go back to the
/// budget) and calls [`take`](Self::take) again, which continues with the next-oldest candidates not
/// taken yet.
#[derive(Debug, Clone)]
pub struct VictimPicker {
    /// Not yet taken, oldest first (stable).
    remaining: Vec<EvictionCandidate>,
    budgets: foldhash::HashMap<(Arc<str>, TierType), Budget>,
}

/// What is left of one bucket's budget, and the page size its victims are charged in.
#[derive(Debug, Clone, Copy)]
struct Budget {
    left: u64,
    page_size: u64,
}

impl VictimPicker {
    /// A picker over `candidates` (any order) for the positive budgets of `buckets`.
    pub fn new(mut candidates: Vec<EvictionCandidate>, buckets: &[Bucket]) -> Self {
        let budgets: foldhash::HashMap<(Arc<str>, TierType), Budget> = buckets
            .iter()
            .filter(|bucket| bucket.budget_bytes > 0)
            .map(|b| ((b.node_id.clone(), b.tier), Budget { left: b.budget_bytes, page_size: b.page_size }))
            .collect();
        candidates.retain(|c| budgets.contains_key(&(c.node_id.clone(), c.tier)));
        candidates.sort_by_key(|candidate| candidate.last_accessed_ms);
        Self { remaining: candidates, budgets }
    }

    /// The next victims, oldest first: each remaining candidate whose bucket still has budget is taken
    /// and its page-rounded size ([`charged_bytes`]) spent. A candidate for which `skip` answers true (e.g. a key its peer protected in
    /// a recent round) is dropped for the rest of the round without spending budget. Untaken
    /// candidates of exhausted buckets stay for a later call after a [`refund`](Self::refund).
    pub fn take(&mut self, mut skip: impl FnMut(&EvictionCandidate) -> bool) -> Vec<EvictionCandidate> {
        let mut taken = Vec::new();
        let budgets = &mut self.budgets;
        self.remaining.retain(|candidate| {
            let Some(budget) = budgets.get_mut(&(candidate.node_id.clone(), candidate.tier)) else { return false };
            if budget.left == 0 {
                return true;
            }
            if skip(candidate) {
                return false;
            }
            budget.left = budget.left.saturating_sub(charged_bytes(candidate.size, budget.page_size));
            taken.push(candidate.clone());
            false
        });
        taken
    }

    /// Gives `bytes` (in the capacity's unit) back to the (node, tier) budget.
    pub fn refund(&mut self, node_id: &Arc<str>, tier: TierType, bytes: u64) {
        if let Some(budget) = self.budgets.get_mut(&(node_id.clone(), tier)) {
            budget.left = budget.left.saturating_add(bytes);
        }
    }

    /// Accounts a taken victim whose peer reported `freed` bytes (its value's length, or 0 for a key
    /// it protected): refunds the part of its charge that was not freed, and returns the capacity the
    /// medium got back — the page-rounded `freed`, at most the victim's charge — for the caller to
    /// credit to the node's recorded capacity.
    pub fn settle(&mut self, victim: &EvictionCandidate, freed: u64) -> u64 {
        let page_size = self.budgets.get(&(victim.node_id.clone(), victim.tier)).map_or(0, |b| b.page_size);
        let charge = charged_bytes(victim.size, page_size);
        let returned = charged_bytes(freed.min(victim.size), page_size);
        if returned < charge {
            self.refund(&victim.node_id, victim.tier, charge - returned);
        }
        returned
    }

    /// Whether another [`take`](Self::take) could return anything.
    pub fn has_more(&self) -> bool {
        self.remaining.iter().any(|c| self.budgets.get(&(c.node_id.clone(), c.tier)).is_some_and(|b| b.left > 0))
    }
}
