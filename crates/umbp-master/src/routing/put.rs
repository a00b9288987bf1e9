//! Put routing: `most_available` | `random` × affinity `none` | `same` | `local`, with projected
//! capacity across a batch and excludes.

use rand::Rng;
use umbp_core::TierType;

use super::config::{Affinity, PutStrategyConfig, SelectAlgo};
use super::evict::charged_bytes;
use super::types::{Candidate, PutDecision, PutPlacement};

/// Decides where each key of a put batch is written.
///
/// The strategy holds only its [`PutStrategyConfig`]; every call works on its own batch-local copy
/// of the capacities and on the generator it is handed, so one instance serves any number of
/// threads without a lock.
///
/// # Algorithm (per batch)
/// - **Eligible** media are the (node, tier) slots of non-excluded candidates whose projected free
///   bytes are at least the key's size rounded up to the medium's pages ([`charged_bytes`]: media
///   report capacity in whole pages); a node's slots are visited in ascending tier order, which only
///   matters for ties.
/// - **SelectByAlgo(size, preferred)**: a preferred node that fits the key anywhere wins with its
///   roomiest medium; otherwise `most_available` takes the roomiest eligible slot (the first listed
///   wins a tie) and `random` draws one weighted by free bytes.
/// - **Projected capacity**: each routed key's page-rounded size is subtracted from its slot in the
///   copy, so later keys of the same batch see the reservation. The caller's candidates are never modified.
/// - Per key: `exists` → [`PutDecision::AlreadyExists`] (no capacity used); size 0 or no eligible
///   slot → [`PutDecision::Unavailable`]; otherwise the affinity decides:
///   - `none`: SelectByAlgo;
///   - `local`: SelectByAlgo preferring the requester's node;
///   - `same`: if one slot fits the whole non-dedup total, every key goes to that pinned slot; once
///     the pin misses (or if nothing fit the total) it is dropped for good and each key uses
///     SelectByAlgo preferring the node the previous key landed on (re-anchoring as nodes fill).
///
/// Every affinity falls back to plain SelectByAlgo over all slots, so affinity never makes a key
/// unroutable that the base algorithm could place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RoutePutStrategy {
    config: PutStrategyConfig,
}

impl RoutePutStrategy {
    /// A strategy with the given settings.
    pub const fn new(config: PutStrategyConfig) -> Self {
        Self { config }
    }

    /// The settings this strategy was built with.
    pub const fn config(&self) -> PutStrategyConfig {
        self.config
    }

    /// Routes one batch: one decision per entry of `sizes`, in order.
    ///
    /// - `requester`: the writer's node id (used by `local`; may be empty or unknown).
    /// - `sizes[i]`, `exists[i]`: key *i*'s size in bytes and whether the master's index already
    ///   holds it. If the two lengths differ the request is malformed and every key is
    ///   [`PutDecision::Unavailable`] (the reference's best-effort answer, never a panic).
    /// - `candidates`: the **alive** nodes only; the caller filters the registry.
    /// - `exclude`: node ids to skip, e.g. peers that just answered `FailedNoSpace`. An excluded
    ///   requester gets no `local` preference.
    /// - `rng`: drives `random` draws; pass `&mut rand::rng()` in service code and a seeded generator
    ///   in tests for reproducible decisions.
    pub fn select_batch<R: Rng + ?Sized>(
        &self,
        requester: &str,
        sizes: &[u64],
        exists: &[bool],
        candidates: &[Candidate],
        exclude: &[String],
        rng: &mut R,
    ) -> Vec<PutDecision> {
        if sizes.len() != exists.len() {
            tracing::error!(
                sizes = sizes.len(),
                exists = exists.len(),
                "put route batch has mismatched sizes and exists lists; every key is unavailable"
            );
            return vec![PutDecision::Unavailable; sizes.len()];
        }

        let mut projection = Projection::new(candidates, exclude, self.config.algo);
        let mut out = Vec::with_capacity(sizes.len());

        let local = match self.config.affinity {
            Affinity::Local => projection.group_of_node(requester),
            Affinity::None | Affinity::Same => None,
        };
        // `same`: the pinned slot (whole-batch fit) and the anchor group preferred after it misses.
        let mut pin: Option<usize> = None;
        let mut anchor: Option<Group> = None;
        if self.config.affinity == Affinity::Same {
            let total = sizes
                .iter()
                .zip(exists)
                .filter(|&(_, &exists)| !exists)
                .fold(0u64, |acc, (&size, _)| acc.saturating_add(size));
            if total > 0
                && let Some(slot) = projection.select(total, None, rng)
            {
                pin = Some(slot);
                anchor = Some(projection.group_of_slot(slot));
            }
        }

        for (&size, &exists) in sizes.iter().zip(exists) {
            if exists {
                out.push(PutDecision::AlreadyExists);
                continue;
            }
            if size == 0 {
                out.push(PutDecision::Unavailable);
                continue;
            }
            let chosen = match self.config.affinity {
                Affinity::None => projection.select(size, None, rng),
                Affinity::Local => projection.select(size, local, rng),
                Affinity::Same => match pin.filter(|&slot| projection.fits(slot, size)) {
                    Some(slot) => Some(slot),
                    None => {
                        pin = None;
                        let chosen = projection.select(size, anchor, rng);
                        if let Some(slot) = chosen {
                            anchor = Some(projection.group_of_slot(slot));
                        }
                        chosen
                    }
                },
            };
            out.push(match chosen {
                Some(slot) => projection.take(slot, size),
                None => PutDecision::Unavailable,
            });
        }
        out
    }
}

/// The slots of one node inside [`Projection::slots`]: `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    start: u32,
    end: u32,
}

/// One (node, tier) with its projected free bytes.
#[derive(Debug, Clone, Copy)]
struct Slot {
    /// Index into the caller's candidates.
    node: u32,
    tier: TierType,
    available: u64,
    /// The medium's page size (0: unknown): a key takes its page-rounded size of `available`.
    page_size: u64,
    /// The node's slots, so an anchor can be found from any of them without a second table.
    group: Group,
}

impl Slot {
    /// What a key of `size` bytes takes of this medium: whole pages, the unit it reports.
    const fn charge(&self, size: u64) -> u64 {
        charged_bytes(size, self.page_size)
    }

    const fn fits(&self, size: u64) -> bool {
        self.available >= self.charge(size)
    }
}

/// The batch-local copy of the capacities: the non-excluded slots, grouped per node, each node's
/// slots in ascending tier order.
#[derive(Debug)]
struct Projection<'a> {
    candidates: &'a [Candidate],
    slots: Vec<Slot>,
    algo: SelectAlgo,
}

impl<'a> Projection<'a> {
    fn new(candidates: &'a [Candidate], exclude: &[String], algo: SelectAlgo) -> Self {
        let mut slots = Vec::with_capacity(candidates.iter().map(|c| c.tiers.len()).sum());
        for (node, candidate) in candidates.iter().enumerate() {
            if exclude.iter().any(|excluded| **excluded == *candidate.node_id) {
                continue;
            }
            let (Ok(node), Ok(start)) = (u32::try_from(node), u32::try_from(slots.len())) else {
                // More than 4 billion slots: the rest of the list is ignored rather than mis-indexed.
                break;
            };
            // `Unknown` is not a medium a peer can allocate on; a slot reported under it is skipped.
            slots.extend(candidate.tiers.iter().filter(|t| t.tier != TierType::Unknown).map(|t| Slot {
                node,
                tier: t.tier,
                available: t.available_bytes,
                page_size: t.page_size,
                group: Group { start, end: start },
            }));
            let Ok(end) = u32::try_from(slots.len()) else {
                break;
            };
            let group = Group { start, end };
            let node_slots = &mut slots[start as usize..end as usize];
            node_slots.sort_by_key(|slot| slot.tier);
            for slot in node_slots {
                slot.group = group;
            }
        }
        Self { candidates, slots, algo }
    }

    /// The slots of the node named `node_id`, if it is a candidate, not excluded and has any.
    fn group_of_node(&self, node_id: &str) -> Option<Group> {
        if node_id.is_empty() {
            return None;
        }
        self.slots.iter().find(|slot| *self.candidates[slot.node as usize].node_id == *node_id).map(|slot| slot.group)
    }

    fn group_of_slot(&self, slot: usize) -> Group {
        self.slots[slot].group
    }

    fn fits(&self, slot: usize, size: u64) -> bool {
        self.slots[slot].fits(size)
    }

    /// SelectByAlgo: the preferred node's roomiest fitting slot, else the configured algorithm over
    /// every slot. `size` must be non-zero (a fitting slot then has non-zero free bytes, which the
    /// scans below rely on).
    fn select<R: Rng + ?Sized>(&self, size: u64, preferred: Option<Group>, rng: &mut R) -> Option<usize> {
        debug_assert!(size > 0, "zero-sized keys are answered before selection");
        if let Some(group) = preferred {
            let range = group.start as usize..group.end as usize;
            if let Some(slot) = roomiest(&self.slots[range.clone()], size) {
                return Some(range.start + slot);
            }
        }
        match self.algo {
            SelectAlgo::MostAvailable => roomiest(&self.slots, size),
            SelectAlgo::Random => weighted(&self.slots, size, rng),
        }
    }

    /// Reserves a key of `size` bytes (its pages) on `slot` and returns the placement.
    fn take(&mut self, slot: usize, size: u64) -> PutDecision {
        let entry = &mut self.slots[slot];
        // Selection only returns slots that fit, so this never underflows; if it ever did, refusing
        // the key is safer than over-committing a peer.
        let Some(left) = entry.available.checked_sub(entry.charge(size)) else {
            tracing::error!(slot, size, available = entry.available, "projected capacity underflow");
            return PutDecision::Unavailable;
        };
        entry.available = left;
        let candidate = &self.candidates[entry.node as usize];
        PutDecision::Routed(PutPlacement {
            node_id: candidate.node_id.clone(),
            tier: entry.tier,
            peer_address: candidate.peer_address.clone(),
        })
    }
}

/// The index of the slot with the most free bytes among those fitting `size` (the first wins a
/// tie). `size > 0`, so a fitting slot always beats the initial 0.
fn roomiest(slots: &[Slot], size: u64) -> Option<usize> {
    let mut best = None;
    let mut best_available = 0;
    for (index, slot) in slots.iter().enumerate() {
        if slot.fits(size) && slot.available > best_available {
            best = Some(index);
            best_available = slot.available;
        }
    }
    best
}

/// A fitting slot drawn with probability proportional to its free bytes. The sum is taken in `u128`
/// so a cluster of many large media cannot overflow it.
fn weighted<R: Rng + ?Sized>(slots: &[Slot], size: u64, rng: &mut R) -> Option<usize> {
    let total: u128 = slots.iter().filter(|slot| slot.fits(size)).map(|slot| u128::from(slot.available)).sum();
    if total == 0 {
        return None;
    }
    let mut draw = match u64::try_from(total) {
        Ok(total) => u128::from(rng.random_range(0..total)),
        Err(_) => rng.random_range(0..total),
    };
    let mut last = None;
    for (index, slot) in slots.iter().enumerate() {
        if !slot.fits(size) {
            continue;
        }
        let weight = u128::from(slot.available);
        if draw < weight {
            return Some(index);
        }
        draw -= weight;
        last = Some(index);
    }
    // Unreachable: `draw < total` and the weights sum to `total`.
    last
}
