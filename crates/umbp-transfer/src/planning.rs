//! Planning shared by every engine: range checks, grouping by buffer pair in first-appearance order,
//! and coalescing of runs adjacent on both sides.

use std::collections::HashMap;

use umbp_core::TransferRef;

use crate::engine::{PlanSet, Segment, TransferDirection, TransferItem, TransferPlan};

/// Identifies one side of a pair: the same buffer always gives the same key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum SideKey {
    /// Process-local memory, by base address and the ref's size (a truncated and a full ref of one
    /// buffer are different sides: a plan is checked against the size of the ref it carries).
    Local(usize, u64),
    /// A region on a data server, and the ref's size.
    Remote(String, u64, u64),
}

impl SideKey {
    /// The local identity of a ref (its base address and size), if it has one.
    pub(crate) fn local(r: &TransferRef) -> Option<Self> {
        r.local_region().map(|l| Self::Local(l.ptr().as_ptr() as usize, r.size()))
    }

    /// The remote identity of a ref, if it has one.
    pub(crate) fn remote(r: &TransferRef) -> Option<Self> {
        r.remote().map(|rr| Self::Remote(rr.endpoint.clone(), rr.region_id, r.size()))
    }
}

/// Whether `[offset, offset + size)` lies inside `r`.
pub(crate) fn in_range(r: &TransferRef, offset: u64, size: u64) -> bool {
    size <= r.size() && offset <= r.size() - size
}

/// Builds plans from items. `classify` returns the direction and the pair identity of an item this
/// engine can serve, or `None` to reject it. Items out of range on either side are rejected; 0-byte
/// items are skipped.
pub(crate) fn plan_pairs(
    items: &[TransferItem],
    mut classify: impl FnMut(&TransferItem) -> Option<(TransferDirection, SideKey, SideKey)>,
) -> PlanSet {
    let mut set = PlanSet::default();
    let mut by_pair: HashMap<(SideKey, SideKey), usize> = HashMap::new();
    for item in items {
        if item.size == 0 {
            continue;
        }
        if !in_range(&item.src, item.src_offset, item.size) || !in_range(&item.dst, item.dst_offset, item.size) {
            set.rejected_tags.push(item.tag);
            continue;
        }
        let Some((direction, src_key, dst_key)) = classify(item) else {
            set.rejected_tags.push(item.tag);
            continue;
        };
        let index = *by_pair.entry((src_key, dst_key)).or_insert_with(|| {
            set.plans.push(TransferPlan {
                src: item.src.clone(),
                dst: item.dst.clone(),
                segments: Vec::new(),
                tags: Vec::new(),
                direction,
                engine: None,
                staging: None,
            });
            set.plans.len() - 1
        });
        let plan = &mut set.plans[index];
        push_segment(plan, item);
    }
    set
}

fn push_segment(plan: &mut TransferPlan, item: &TransferItem) {
    let adjacent = plan.segments.last_mut().filter(|last| {
        last.src_offset.checked_add(last.len) == Some(item.src_offset)
            && last.dst_offset.checked_add(last.len) == Some(item.dst_offset)
            && last.len.checked_add(item.size).is_some()
    });
    match adjacent {
        Some(last) => last.len += item.size,
        None => {
            plan.segments.push(Segment { src_offset: item.src_offset, dst_offset: item.dst_offset, len: item.size })
        }
    }
    if plan.tags.last() != Some(&item.tag) {
        plan.tags.push(item.tag);
    }
}

/// Whether every segment of `plan` lies inside both of its refs (submit re-checks hand-built plans).
pub(crate) fn plan_in_range(plan: &TransferPlan) -> bool {
    plan.segments.iter().all(|s| in_range(&plan.src, s.src_offset, s.len) && in_range(&plan.dst, s.dst_offset, s.len))
}
