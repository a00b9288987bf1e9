//! `CompositeTransferEngine`: the one engine a node holds.

use std::collections::BTreeMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use umbp_core::{
    LocalRegion, MemoryLocation, MemoryRegistrar, MetricSample, MetricSource, RegistrationError, TransferRef,
    metric_names,
};

use crate::engine::{
    BounceCopy, FailureKind, PlanSet, Staging, SumOf, SummedTransfer, TransferDirection, TransferEngine,
    TransferFailure, TransferHandle, TransferItem, TransferPlan,
};
use crate::planning::in_range;
use crate::shm::ShmServer;

/// Staged items start on this alignment inside the bounce pool (a cache line: copies stay aligned).
const BOUNCE_ALIGN: u64 = 64;

/// Settings of a [`CompositeTransferEngine`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompositeConfig {
    /// Size of the bounce pool that stages caller memory no engine can address directly (0 disables
    /// staging). A batch larger than the pool runs in pool-sized rounds; a single item larger than the
    /// pool is rejected. Default: 64 MiB.
    pub bounce_bytes: u64,
}

impl Default for CompositeConfig {
    fn default() -> Self {
        Self { bounce_bytes: 64 << 20 }
    }
}

/// Per engine and direction: plans, failed plans, bytes of successful plans, nanoseconds from
/// submit to completion.
#[derive(Debug, Default)]
struct DirStats {
    plans: AtomicU64,
    failed: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
}

#[derive(Debug, Default)]
struct Stats {
    /// `[engine][direction]`.
    engines: Vec<[DirStats; 3]>,
    rejected_items: AtomicU64,
}

impl Stats {
    fn charge(&self, engine: usize, dir: TransferDirection, plans: u64, failed: u64, bytes: u64, nanos: u64) {
        if let Some(s) = self.engines.get(engine).map(|e| &e[dir.index()]) {
            s.plans.fetch_add(plans, Ordering::Relaxed);
            s.failed.fetch_add(failed, Ordering::Relaxed);
            s.bytes.fetch_add(bytes, Ordering::Relaxed);
            s.nanos.fetch_add(nanos, Ordering::Relaxed);
        }
    }
}

/// The bounce pool: one anonymous host mapping, registered with every engine.
struct Bounce {
    base: NonNull<u8>,
    len: usize,
    /// The merged registration of the whole pool.
    r: TransferRef,
    /// One staged round at a time owns the pool.
    lock: Mutex<()>,
}

// SAFETY: the mapping is plain memory owned by the pool for its whole life; access to its bytes is
// serialised by `lock` (one round at a time).
unsafe impl Send for Bounce {}
// SAFETY: as above.
unsafe impl Sync for Bounce {}

impl fmt::Debug for Bounce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bounce").field("len", &self.len).finish_non_exhaustive()
    }
}

/// The engine a node holds: registration fans out to every engine and the handles merge into one
/// [`TransferRef`]; each (src, dst) pair goes to the first engine that can handle it (engines are
/// added in preference order and are disjoint in practice); caller memory that no engine can address
/// as given is staged through one bounce pool in pool-sized rounds; items nobody can move are
/// rejected by tag. Staging is for engines that need registered local memory (an RDMA engine) and
/// memory they cannot read directly: [`LocalCopyEngine`](crate::LocalCopyEngine) and
/// [`TcpEngine`](crate::TcpEngine) take unregistered host memory in place, so with them an
/// unregistered caller buffer goes zero-copy.
///
/// `submit` starts asynchronous engines (TCP) first, then runs synchronous ones (the in-process
/// copy) while those are in flight, then the staged rounds. Every engine is measured per
/// direction (plans, failures, bytes, seconds) through [`MetricSource`]; an engine never used
/// publishes nothing.
pub struct CompositeTransferEngine {
    engines: Vec<Arc<dyn TransferEngine>>,
    stats: Arc<Stats>,
    bounce: Option<Bounce>,
    /// The epoch of the next `plan` call that stages anything.
    next_epoch: AtomicU64,
    /// The node's shared-memory server: shareable regions are handed to it (see
    /// [`with_shm_server`](Self::with_shm_server)).
    shm_server: Option<Arc<ShmServer>>,
}

impl fmt::Debug for CompositeTransferEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.engines.iter().map(|e| e.name()).collect();
        f.debug_struct("CompositeTransferEngine").field("engines", &names).field("bounce", &self.bounce).finish()
    }
}

/// A staged item: the item with the caller side replaced by the bounce pool.
struct StagedItem {
    engine: usize,
    round: u32,
    /// Whether the pool is the item's source (a push through the pool).
    pool_is_src: bool,
    item: TransferItem,
    copy: BounceCopy,
}

impl CompositeTransferEngine {
    /// A composite over `engines` (in preference order). Maps and registers the bounce pool when
    /// `config.bounce_bytes > 0`.
    pub fn new(engines: Vec<Arc<dyn TransferEngine>>, config: CompositeConfig) -> Result<Self, RegistrationError> {
        let stats = Arc::new(Stats {
            engines: engines.iter().map(|_| Default::default()).collect(),
            rejected_items: AtomicU64::new(0),
        });
        let mut this = Self { engines, stats, bounce: None, next_epoch: AtomicU64::new(1), shm_server: None };
        if config.bounce_bytes > 0 {
            this.bounce = Some(this.map_bounce(config.bounce_bytes)?);
        }
        Ok(this)
    }

    /// The engines, in preference order.
    pub fn engines(&self) -> &[Arc<dyn TransferEngine>] {
        &self.engines
    }

    /// The same composite handing every region registered
    /// [shareable](MemoryRegistrar::register_shareable) to `server`, under the region id the data
    /// plane gave it (so same-host peers can map it by the id their refs carry), and taking it back
    /// from `server` first when the region is deregistered (so a peer's mapping reads as stale
    /// before any engine forgets the region). The server's endpoint must be this node's data
    /// endpoint.
    pub fn with_shm_server(mut self, server: Arc<ShmServer>) -> Self {
        self.shm_server = Some(server);
        self
    }

    /// The shared-memory server, when there is one.
    pub fn shm_server(&self) -> Option<&Arc<ShmServer>> {
        self.shm_server.as_ref()
    }

    /// Bytes of successful plans the engine named `name` moved so far, every direction together
    /// (0 for an engine not in the composite or never used): what a test asserts to know which path
    /// the bytes took.
    pub fn moved_bytes(&self, name: &str) -> u64 {
        self.engines
            .iter()
            .zip(&self.stats.engines)
            .filter(|(e, _)| e.name() == name)
            .flat_map(|(_, dirs)| dirs.iter())
            .map(|s| s.bytes.load(Ordering::Relaxed))
            .sum()
    }

    /// Whether `r` is a region this node's shared-memory server may know: its remote handle names
    /// the server's endpoint.
    fn shared_id(&self, r: &TransferRef) -> Option<(&ShmServer, u64)> {
        let server = self.shm_server.as_deref()?;
        let remote = r.remote()?;
        let ours = crate::shm::socket_name(&remote.endpoint).is_ok_and(|name| name == server.socket_name());
        ours.then_some((server, remote.region_id))
    }

    /// Bytes of the bounce pool (0 when staging is off).
    pub fn bounce_bytes(&self) -> u64 {
        self.bounce.as_ref().map_or(0, |b| b.len as u64)
    }

    fn map_bounce(&self, bytes: u64) -> Result<Bounce, RegistrationError> {
        let refused = |reason: String| RegistrationError::Refused { transport: "bounce pool".into(), reason };
        let len =
            usize::try_from(bytes).map_err(|_| refused(format!("{bytes} bytes do not fit this address space")))?;
        // SAFETY: a fresh private anonymous mapping aliases nothing; it is unmapped in `Drop`.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(|e| refused(format!("mapping {bytes} bytes: {e}")))?;
        let base = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| refused("mmap returned null".into()))?;
        // SAFETY: the mapping is valid for `len` bytes until `Drop`, which deregisters first.
        let region = unsafe { LocalRegion::new(base, bytes, MemoryLocation::Host) };
        match self.register_local_only(region) {
            Ok(r) => Ok(Bounce { base, len, r, lock: Mutex::new(()) }),
            Err(e) => {
                // SAFETY: nothing registered the mapping; it is ours to unmap.
                let _ = unsafe { rustix::mm::munmap(ptr, len) };
                Err(e)
            }
        }
    }

    fn select(&self, src: &TransferRef, dst: &TransferRef) -> Option<usize> {
        self.engines.iter().position(|e| e.can_handle(src, dst))
    }

    /// Re-targets an item no engine takes as given through the bounce pool, if possible: returns the
    /// engine, the item with the caller side replaced by the pool (at offset 0), the copy to make and
    /// whether the pool is the item's source (a push).
    ///
    /// The caller side is host memory (copied to or from the pool with a memcpy) or device memory
    /// an engine moves to and from the pool (a GPU buffer read from, or written to, a peer over
    /// TCP: the network lands in the pool and the GPU engine copies it on; see `run_staged`).
    fn stage(&self, item: &TransferItem) -> Option<(usize, TransferItem, BounceCopy, bool)> {
        let bounce = self.bounce.as_ref()?;
        let local = |r: &TransferRef| r.local_region().is_some();
        let host = |r: &TransferRef| r.local_region().is_some_and(|l| l.location().is_host());
        // Host memory, or memory an engine moves between it and the pool (in that direction).
        let reachable = |user: &TransferRef, into_pool: bool| {
            host(user)
                || (local(user)
                    && if into_pool {
                        self.select(user, &bounce.r).is_some()
                    } else {
                        self.select(&bounce.r, user).is_some()
                    })
        };
        if item.size > bounce.len as u64 {
            return None;
        }
        let copy = |user: &TransferRef, user_offset| BounceCopy {
            user: user.clone(),
            user_offset,
            bounce_offset: 0,
            len: item.size,
            tag: item.tag,
        };
        if reachable(&item.src, true)
            && in_range(&item.src, item.src_offset, item.size)
            && let Some(e) = self.select(&bounce.r, &item.dst)
        {
            let staged = TransferItem { src: bounce.r.clone(), src_offset: 0, ..item.clone() };
            return Some((e, staged, copy(&item.src, item.src_offset), true));
        }
        if reachable(&item.dst, false)
            && in_range(&item.dst, item.dst_offset, item.size)
            && let Some(e) = self.select(&item.src, &bounce.r)
        {
            let staged = TransferItem { dst: bounce.r.clone(), dst_offset: 0, ..item.clone() };
            return Some((e, staged, copy(&item.dst, item.dst_offset), false));
        }
        None
    }

    fn plan_staged(&self, epoch: u64, staged: Vec<StagedItem>, set: &mut PlanSet) {
        // Group by (round, engine, pool side) in first-appearance order: every plan of a group has
        // the pool on the same side.
        let mut groups: Vec<((u32, usize, bool), Vec<StagedItem>)> = Vec::new();
        for s in staged {
            let key = (s.round, s.engine, s.pool_is_src);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, v)) => v.push(s),
                None => groups.push((key, vec![s])),
            }
        }
        for ((round, engine, pool_is_src), group) in groups {
            let items: Vec<TransferItem> = group.iter().map(|s| s.item.clone()).collect();
            let sub = self.engines[engine].plan(&items);
            self.stats.rejected_items.fetch_add(sub.rejected_tags.len() as u64, Ordering::Relaxed);
            set.rejected_tags.extend(sub.rejected_tags);
            // Which plan each staged item landed in: its pool range lies inside one of that plan's
            // segments (pool offsets are unique within a round). Sorted ranges, binary search.
            let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
            for (index, plan) in sub.plans.iter().enumerate() {
                for seg in &plan.segments {
                    let off = if pool_is_src { seg.src_offset } else { seg.dst_offset };
                    ranges.push((off, off.saturating_add(seg.len), index));
                }
            }
            ranges.sort_unstable();
            let mut copies: Vec<Vec<BounceCopy>> = vec![Vec::new(); sub.plans.len()];
            for s in &group {
                if let Some(index) = containing(&ranges, s.copy.bounce_offset, s.copy.len) {
                    copies[index].push(s.copy.clone());
                }
            }
            for (mut plan, copies) in sub.plans.into_iter().zip(copies) {
                plan.engine = Some(engine);
                plan.staging = Some(Staging { epoch, round, pool_is_src, copies });
                set.plans.push(plan);
            }
        }
    }

    /// Checks a staged plan before any byte moves: its pool side is this composite's pool and its
    /// segments stay inside it, and every copy names host caller memory in range (not the pool) and a
    /// pool range the plan's segments carry. Returns the plan's pool ranges.
    fn validate_staged(&self, bounce: &Bounce, plan: &TransferPlan) -> Result<Vec<(u64, u64)>, &'static str> {
        let staging = plan.staging.as_ref().ok_or("plan is not staged")?;
        let pool_side = if staging.pool_is_src { &plan.src } else { &plan.dst };
        if pool_side.local_region().map(|l| l.ptr()) != Some(bounce.base) || pool_side.size() > bounce.len as u64 {
            return Err("the staged side of the plan is not this engine's bounce pool");
        }
        if !crate::planning::plan_in_range(plan) {
            return Err("plan reaches outside its buffers");
        }
        let mut ranges: Vec<(u64, u64, usize)> = plan
            .segments
            .iter()
            .map(|seg| {
                let off = if staging.pool_is_src { seg.src_offset } else { seg.dst_offset };
                (off, off + seg.len, 0)
            })
            .collect();
        ranges.sort_unstable();
        let pool_start = bounce.base.as_ptr() as usize;
        let pool_end = pool_start + bounce.len;
        for c in &staging.copies {
            let user = c.user.local_region().ok_or("a staged copy has no local memory")?;
            if !in_range(&c.user, c.user_offset, c.len) || c.user.size() > user.len() {
                return Err("a staged copy reaches outside the caller's buffer");
            }
            if !user.location().is_host() {
                // Device memory is copied by an engine, never by the CPU, and is not the pool.
                if containing(&ranges, c.bounce_offset, c.len).is_none() {
                    return Err("a staged copy's pool range is not part of the plan");
                }
                continue;
            }
            let (Ok(user_off), Ok(len)) = (usize::try_from(c.user_offset), usize::try_from(c.len)) else {
                return Err("a staged copy does not fit this address space");
            };
            let user_start = user.ptr().as_ptr() as usize + user_off;
            if user_start < pool_end && pool_start < user_start + len {
                return Err("a staged copy's caller memory is the bounce pool");
            }
            if containing(&ranges, c.bounce_offset, c.len).is_none() {
                return Err("a staged copy's pool range is not part of the plan");
            }
        }
        Ok(ranges.into_iter().map(|(a, b, _)| (a, b)).collect())
    }

    /// Runs the staged plans round by round under the pool lock: check, copy in, transfer, wait,
    /// copy out. Rounds are keyed by (epoch, round), so plan sets from different `plan` calls never
    /// share the pool; plans of one round whose pool ranges collide fail instead of corrupting each
    /// other.
    fn run_staged(&self, plans: Vec<TransferPlan>, failures: &mut Vec<TransferFailure>) {
        let fail = |failures: &mut Vec<TransferFailure>, p: TransferPlan, message: &str| {
            failures.push(TransferFailure::new(p.tags, FailureKind::Local, message, "CompositeTransferEngine"));
        };
        let Some(bounce) = self.bounce.as_ref() else {
            for p in plans {
                fail(failures, p, "no bounce pool");
            }
            return;
        };
        let mut rounds: BTreeMap<(u64, u32), Vec<TransferPlan>> = BTreeMap::new();
        for p in plans {
            let key = p.staging.as_ref().map_or((0, 0), |s| (s.epoch, s.round));
            rounds.entry(key).or_default().push(p);
        }
        let _pool = bounce.lock.lock();
        for (_, round) in rounds {
            let mut checked = Vec::with_capacity(round.len());
            let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
            for p in round {
                match self.validate_staged(bounce, &p) {
                    Ok(r) => {
                        ranges.extend(r.into_iter().map(|(a, b)| (a, b, checked.len())));
                        checked.push(p);
                    }
                    Err(message) => fail(failures, p, message),
                }
            }
            let colliding = colliding_owners(ranges, checked.len());
            let mut plans = Vec::with_capacity(checked.len());
            for (p, collides) in checked.into_iter().zip(colliding) {
                if collides {
                    fail(failures, p, "staged plans of one round share bounce-pool bytes");
                } else {
                    plans.push(p);
                }
            }
            let mut device_in = Vec::new();
            for plan in &plans {
                if let Some(s) = plan.staging.as_ref().filter(|s| s.pool_is_src) {
                    for c in &s.copies {
                        if is_device(c) {
                            device_in.push(device_item(bounce, c, true));
                        } else {
                            copy_user_bounce(bounce, c, true);
                        }
                    }
                }
            }
            // A copy into the pool that failed leaves garbage there: its tag fails with it.
            failures.extend(self.copy_device(device_in));
            let mut by_engine: Vec<(usize, Vec<TransferPlan>)> = Vec::new();
            for p in plans {
                let e = p.engine.unwrap_or(usize::MAX);
                match by_engine.iter_mut().find(|(k, _)| *k == e) {
                    Some((_, v)) => v.push(p),
                    None => by_engine.push((e, vec![p])),
                }
            }
            for (engine, plans) in by_engine {
                let pulls: Vec<Staging> =
                    plans.iter().filter_map(|p| p.staging.clone()).filter(|s| !s.pool_is_src).collect();
                let mut handle = self.submit_group(engine, plans);
                let round_failures = handle.wait();
                let failed = crate::engine::failed_tags(&round_failures);
                let mut device_out = Vec::new();
                for c in pulls.iter().flat_map(|s| &s.copies) {
                    if failed.binary_search(&c.tag).is_ok() {
                        continue;
                    }
                    if is_device(c) {
                        device_out.push(device_item(bounce, c, false));
                    } else {
                        copy_user_bounce(bounce, c, false);
                    }
                }
                failures.extend(round_failures);
                failures.extend(self.copy_device(device_out));
            }
        }
    }

    /// Runs staged copies between the pool and device memory on the engines that move them (the
    /// GPU engine), waits, and answers their failures (an item no engine takes fails by its tag).
    fn copy_device(&self, items: Vec<TransferItem>) -> Vec<TransferFailure> {
        let mut failures = Vec::new();
        let mut by_engine: Vec<(usize, Vec<TransferItem>)> = Vec::new();
        for item in items {
            match self.select(&item.src, &item.dst) {
                Some(e) => match by_engine.iter_mut().find(|(k, _)| *k == e) {
                    Some((_, v)) => v.push(item),
                    None => by_engine.push((e, vec![item])),
                },
                None => failures.push(TransferFailure::new(
                    vec![item.tag],
                    FailureKind::Rejected,
                    "no engine copies between the bounce pool and this device memory",
                    "CompositeTransferEngine",
                )),
            }
        }
        for (engine, items) in by_engine {
            let set = self.engines[engine].plan(&items);
            if !set.rejected_tags.is_empty() {
                failures.push(TransferFailure::new(
                    set.rejected_tags,
                    FailureKind::Rejected,
                    "a staged device copy was refused",
                    self.engines[engine].name(),
                ));
            }
            let plans = set
                .plans
                .into_iter()
                .map(|mut p| {
                    p.engine = Some(engine);
                    p
                })
                .collect();
            failures.extend(self.submit_group(engine, plans).wait());
        }
        failures
    }

    /// Submits the plans of an engine whose failures fall back
    /// ([`TransferEngine::fallback_on_failure`]): waits for them (such an engine completes in
    /// submit), then hands every failed plan to the next engine after it that can handle the plan's
    /// pair, as submitted groups of their own. A failed plan no later engine can handle keeps its
    /// failure.
    fn submit_with_fallback(&self, engine: usize, plans: Vec<TransferPlan>, subs: &mut Vec<SubHandle>) {
        let copies = plans.clone();
        let mut handle = self.submit_group(engine, plans);
        let failures = handle.wait();
        if failures.is_empty() {
            return;
        }
        let failed = crate::engine::failed_tags(&failures);
        let mut retried: Vec<u64> = Vec::new();
        let mut next: Vec<(usize, Vec<TransferPlan>)> = Vec::new();
        for mut plan in copies {
            if !plan.tags.iter().any(|t| failed.binary_search(t).is_ok()) {
                continue;
            }
            let Some(e) = (engine + 1..self.engines.len()).find(|&e| self.engines[e].can_handle(&plan.src, &plan.dst))
            else {
                continue;
            };
            plan.engine = Some(e);
            retried.extend(&plan.tags);
            match next.iter_mut().find(|(k, _)| *k == e) {
                Some((_, v)) => v.push(plan),
                None => next.push((e, vec![plan])),
            }
        }
        retried.sort_unstable();
        retried.dedup();
        // What no later engine took keeps its failure; the rest is the next engine's to answer.
        let kept: Vec<TransferFailure> = failures
            .into_iter()
            .filter_map(|mut f| {
                f.tags.retain(|t| retried.binary_search(t).is_err());
                (!f.tags.is_empty()).then_some(f)
            })
            .collect();
        if !kept.is_empty() {
            subs.push(SubHandle::settled(kept));
        }
        for (e, plans) in next {
            tracing::debug!(
                from = self.engines[engine].name(),
                to = self.engines[e].name(),
                plans = plans.len(),
                "plans handed to the next engine"
            );
            subs.push(self.submit_group(e, plans));
        }
    }

    /// Submits one engine's plans and returns a handle that charges the stats when waited.
    fn submit_group(&self, engine: usize, plans: Vec<TransferPlan>) -> SubHandle {
        let charges: Vec<(TransferDirection, u64, Vec<u64>)> =
            plans.iter().map(|p| (p.direction, p.bytes(), p.tags.clone())).collect();
        let start = Instant::now();
        let Some(e) = self.engines.get(engine) else {
            let tags = charges.iter().flat_map(|c| c.2.iter().copied()).collect();
            return SubHandle::settled(vec![TransferFailure::new(
                tags,
                FailureKind::Local,
                "plan has no owning engine",
                "CompositeTransferEngine",
            )]);
        };
        match e.submit(plans) {
            Ok(handle) => SubHandle {
                engine,
                start,
                charges,
                handle: Some(handle),
                settled: Vec::new(),
                stats: Some(Arc::clone(&self.stats)),
            },
            Err(mut failure) => {
                failure.tags = charges.iter().flat_map(|c| c.2.iter().copied()).collect();
                if failure.message.is_empty() {
                    failure.message = format!("{} submitted nothing", e.name());
                }
                for (dir, _, _) in &charges {
                    self.stats.charge(engine, *dir, 1, 1, 0, 0);
                }
                SubHandle::settled(vec![failure])
            }
        }
    }
}

/// The owner (third field) of the range in `ranges` (sorted by start) that contains
/// `[offset, offset + len)`, if any.
fn containing(ranges: &[(u64, u64, usize)], offset: u64, len: u64) -> Option<usize> {
    let end = offset.checked_add(len)?;
    let at = ranges.partition_point(|r| r.0 <= offset).checked_sub(1)?;
    let (start, stop, owner) = ranges[at];
    (start <= offset && end <= stop).then_some(owner)
}

/// For each of `owners` owners, whether one of its ranges overlaps a range of another owner.
fn colliding_owners(mut ranges: Vec<(u64, u64, usize)>, owners: usize) -> Vec<bool> {
    let mut hit = vec![false; owners];
    ranges.retain(|r| r.1 > r.0);
    ranges.sort_unstable();
    // The range reaching furthest so far and its owner: a later range starting before that end
    // overlaps it (and every range overlapping an earlier one is found this way or through the
    // range that reaches further).
    let mut reach: Option<(u64, usize)> = None;
    for (start, end, owner) in ranges {
        if let Some((far, far_owner)) = reach
            && start < far
            && far_owner != owner
        {
            hit[owner] = true;
            hit[far_owner] = true;
        }
        if reach.is_none_or(|(far, _)| end > far) {
            reach = Some((end, owner));
        }
    }
    hit
}

/// Copies one staged item between the caller's memory and the pool (`into_bounce`: caller → pool).
/// The copy was checked by `validate_staged`; the checks here only keep the pointer arithmetic in
/// bounds should that ever change.
/// Whether a staged copy's caller side is device memory (copied by an engine, not the CPU).
fn is_device(c: &BounceCopy) -> bool {
    c.user.local_region().is_some_and(|l| !l.location().is_host())
}

/// The transfer item of a staged copy between the pool and device memory.
fn device_item(bounce: &Bounce, c: &BounceCopy, into_bounce: bool) -> TransferItem {
    let (pool, user) = ((bounce.r.clone(), c.bounce_offset), (c.user.clone(), c.user_offset));
    let ((src, src_offset), (dst, dst_offset)) = if into_bounce { (user, pool) } else { (pool, user) };
    TransferItem { src, src_offset, dst, dst_offset, size: c.len, tag: c.tag }
}

fn copy_user_bounce(bounce: &Bounce, c: &BounceCopy, into_bounce: bool) {
    let Some(user) = c.user.local_region() else { return };
    let in_user = in_range(&c.user, c.user_offset, c.len) && c.user.size() <= user.len();
    let in_pool = c.bounce_offset.checked_add(c.len).is_some_and(|end| end <= bounce.len as u64);
    let (Ok(user_off), Ok(pool_off), Ok(len)) =
        (usize::try_from(c.user_offset), usize::try_from(c.bounce_offset), usize::try_from(c.len))
    else {
        return;
    };
    if !in_user || !in_pool {
        return;
    }
    // SAFETY: both ranges were checked just above against the caller's region (valid under
    // `LocalRegion`'s invariant for the duration of the transfer) and the pool mapping (held under
    // its lock by the caller of this function); `copy` (memmove) is defined even if they overlapped,
    // which `validate_staged` refuses anyway.
    unsafe {
        let user_ptr = user.ptr().as_ptr().add(user_off);
        let pool_ptr = bounce.base.as_ptr().add(pool_off);
        if into_bounce {
            std::ptr::copy(user_ptr, pool_ptr, len);
        } else {
            std::ptr::copy(pool_ptr, user_ptr, len);
        }
    }
}

impl Drop for CompositeTransferEngine {
    fn drop(&mut self) {
        if let Some(bounce) = self.bounce.take() {
            let _guard = bounce.lock.lock();
            self.deregister(&bounce.r);
            // SAFETY: deregistered above; no engine or round references the mapping any more.
            let _ = unsafe { rustix::mm::munmap(bounce.base.as_ptr().cast(), bounce.len) };
        }
    }
}

/// One engine's submitted group: waits, then charges the engine's stats.
struct SubHandle {
    engine: usize,
    start: Instant,
    /// (direction, bytes, tags) per plan.
    charges: Vec<(TransferDirection, u64, Vec<u64>)>,
    handle: Option<Box<dyn TransferHandle>>,
    settled: Vec<TransferFailure>,
    stats: Option<Arc<Stats>>,
}

impl fmt::Debug for SubHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubHandle").field("engine", &self.engine).field("plans", &self.charges.len()).finish()
    }
}

impl SubHandle {
    fn settled(failures: Vec<TransferFailure>) -> Self {
        Self {
            engine: usize::MAX,
            start: Instant::now(),
            charges: Vec::new(),
            handle: None,
            settled: failures,
            stats: None,
        }
    }

    fn wait(&mut self) -> Vec<TransferFailure> {
        let mut failures = std::mem::take(&mut self.settled);
        let Some(mut handle) = self.handle.take() else { return failures };
        let sub = handle.wait();
        let nanos = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if let Some(stats) = &self.stats {
            let failed = crate::engine::failed_tags(&sub);
            // Time is charged to each direction in proportion to its plans (one wait covers them all).
            let total_plans = self.charges.len().max(1) as u64;
            for dir in TransferDirection::ALL {
                let mine: Vec<_> = self.charges.iter().filter(|c| c.0 == dir).collect();
                if mine.is_empty() {
                    continue;
                }
                let failed_plans =
                    mine.iter().filter(|c| c.2.iter().any(|t| failed.binary_search(t).is_ok())).count() as u64;
                let ok_bytes: u64 =
                    mine.iter().filter(|c| !c.2.iter().any(|t| failed.binary_search(t).is_ok())).map(|c| c.1).sum();
                let share = nanos / total_plans * mine.len() as u64;
                stats.charge(self.engine, dir, mine.len() as u64, failed_plans, ok_bytes, share);
            }
        }
        failures.extend(sub);
        failures
    }
}

/// The composite's handle: failures settled at submit (staged rounds, engines that posted nothing)
/// plus one sub-handle per engine.
#[derive(Debug)]
struct FanOutHandle {
    settled: Vec<TransferFailure>,
    subs: Vec<SubHandle>,
    waited: bool,
}

impl TransferHandle for FanOutHandle {
    fn wait(&mut self) -> Vec<TransferFailure> {
        if self.waited {
            return Vec::new();
        }
        self.waited = true;
        let mut failures = std::mem::take(&mut self.settled);
        for sub in &mut self.subs {
            failures.extend(sub.wait());
        }
        failures
    }
}

impl Drop for FanOutHandle {
    fn drop(&mut self) {
        // The work may still touch caller memory: drain it before the caller may free that memory.
        let _ = self.wait();
    }
}

impl CompositeTransferEngine {
    /// Registers `region` with every engine (`local_only`: as memory peers must never address) and
    /// merges the handles.
    fn register_with_all(&self, region: LocalRegion, local_only: bool) -> Result<TransferRef, RegistrationError> {
        let mut merged = TransferRef::local(region);
        let mut claimed = false;
        let mut first_error = None;
        for engine in &self.engines {
            let part = if local_only { engine.register_local_only(region) } else { engine.register_memory(region) };
            match part {
                Ok(part) => {
                    claimed = true;
                    if let Some(remote) = part.remote() {
                        if merged.remote().is_none() {
                            merged = merged.with_remote(remote.clone());
                        } else {
                            // One remote handle per ref: a second transport's would be unreachable.
                            tracing::warn!(
                                engine = engine.name(),
                                "a second engine published a remote handle; dropping it"
                            );
                            engine.deregister(&part);
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(engine = engine.name(), error = %e, "engine did not register the region");
                    first_error.get_or_insert(e);
                }
            }
        }
        if claimed {
            Ok(merged)
        } else {
            Err(first_error
                .unwrap_or(RegistrationError::Unsupported { len: region.len(), location: region.location() }))
        }
    }
}

impl MemoryRegistrar for CompositeTransferEngine {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.register_with_all(region, false)
    }

    /// Takes the region back from the shared-memory server first (peers' mappings read as stale at
    /// once), then from every engine.
    fn deregister(&self, r: &TransferRef) {
        if let Some((server, region_id)) = self.shared_id(r) {
            server.deregister(region_id);
        }
        for engine in &self.engines {
            engine.deregister(r);
        }
    }

    /// Registers `region` with every engine (the data plane gives it its region id), then, with a
    /// shared-memory server ([`with_shm_server`](Self::with_shm_server)), hands the server the file
    /// under that id. A region the server refuses is still registered: peers reach it over TCP.
    #[cfg(unix)]
    fn register_shareable(
        &self,
        region: LocalRegion,
        backing: umbp_core::SharedBacking<'_>,
    ) -> Result<TransferRef, RegistrationError> {
        let r = self.register_with_all(region, false)?;
        if let Some((server, region_id)) = self.shared_id(&r)
            && let Err(e) = server.register(region_id, backing.fd(), backing.offset(), region.len())
        {
            tracing::warn!(region_id, error = %e, "region not shared with same-host peers; they use TCP");
        }
        Ok(r)
    }
}

impl MetricSource for CompositeTransferEngine {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let label = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        let mut out = Vec::new();
        for (engine, dirs) in self.engines.iter().zip(&self.stats.engines) {
            for dir in TransferDirection::ALL {
                let s = &dirs[dir.index()];
                let plans = s.plans.load(Ordering::Relaxed);
                if plans == 0 {
                    continue;
                }
                let failed = s.failed.load(Ordering::Relaxed);
                let base = vec![label("engine", engine.name()), label("direction", dir.as_str())];
                let with_status = |status: &str| {
                    let mut l = base.clone();
                    l.push(label("status", status));
                    l
                };
                out.push(MetricSample::counter(
                    metric_names::TRANSFER_OPS_TOTAL,
                    metric_names::TRANSFER_OPS_TOTAL_HELP,
                    with_status("ok"),
                    plans.saturating_sub(failed),
                ));
                if failed > 0 {
                    out.push(MetricSample::counter(
                        metric_names::TRANSFER_OPS_TOTAL,
                        metric_names::TRANSFER_OPS_TOTAL_HELP,
                        with_status("failed"),
                        failed,
                    ));
                }
                out.push(MetricSample::counter(
                    metric_names::TRANSFER_BYTES_TOTAL,
                    metric_names::TRANSFER_BYTES_TOTAL_HELP,
                    base.clone(),
                    s.bytes.load(Ordering::Relaxed),
                ));
                let mut seconds = MetricSample::counter(
                    metric_names::TRANSFER_SECONDS_TOTAL,
                    metric_names::TRANSFER_SECONDS_TOTAL_HELP,
                    base,
                    s.nanos.load(Ordering::Relaxed),
                );
                seconds.scale = 1e-9;
                out.push(seconds);
            }
            for mut sample in engine.sample_metrics() {
                sample.labels.insert(0, label("engine", engine.name()));
                out.push(sample);
            }
        }
        let rejected = self.stats.rejected_items.load(Ordering::Relaxed);
        if rejected > 0 {
            out.push(MetricSample::counter(
                metric_names::TRANSFER_OPS_TOTAL,
                metric_names::TRANSFER_OPS_TOTAL_HELP,
                vec![label("engine", "none"), label("direction", "none"), label("status", "rejected")],
                rejected,
            ));
        }
        out
    }
}

impl TransferEngine for CompositeTransferEngine {
    fn name(&self) -> &str {
        "CompositeTransferEngine"
    }

    fn register_local_only(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.register_with_all(region, true)
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        if self.select(src, dst).is_some() {
            return true;
        }
        let probe = TransferItem { src: src.clone(), src_offset: 0, dst: dst.clone(), dst_offset: 0, size: 1, tag: 0 };
        self.stage(&probe).is_some()
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        let mut set = PlanSet::default();
        let mut direct: Vec<Vec<TransferItem>> = vec![Vec::new(); self.engines.len()];
        let mut staged = Vec::new();
        let (mut round, mut cursor) = (0u32, 0u64);
        let pool = self.bounce_bytes();
        for item in items {
            if item.size == 0 {
                continue;
            }
            if let Some(e) = self.select(&item.src, &item.dst) {
                direct[e].push(item.clone());
                continue;
            }
            let Some((engine, mut staged_item, mut copy, bounce_is_src)) = self.stage(item) else {
                self.stats.rejected_items.fetch_add(1, Ordering::Relaxed);
                set.rejected_tags.push(item.tag);
                continue;
            };
            // Place the item in the current round, or open the next one (chunking, not failing).
            let mut offset = cursor.next_multiple_of(BOUNCE_ALIGN);
            if offset + item.size > pool {
                round += 1;
                offset = 0;
            }
            cursor = offset + item.size;
            copy.bounce_offset = offset;
            if bounce_is_src {
                staged_item.src_offset = offset;
            } else {
                staged_item.dst_offset = offset;
            }
            staged.push(StagedItem { engine, round, pool_is_src: bounce_is_src, item: staged_item, copy });
        }
        for (engine, items) in direct.into_iter().enumerate() {
            if items.is_empty() {
                continue;
            }
            let sub = self.engines[engine].plan(&items);
            self.stats.rejected_items.fetch_add(sub.rejected_tags.len() as u64, Ordering::Relaxed);
            set.rejected_tags.extend(sub.rejected_tags);
            set.plans.extend(sub.plans.into_iter().map(|mut p| {
                p.engine = Some(engine);
                p
            }));
        }
        if !staged.is_empty() {
            let epoch = self.next_epoch.fetch_add(1, Ordering::Relaxed);
            self.plan_staged(epoch, staged, &mut set);
        }
        set
    }

    /// The engine every item selects, summing as it copies (the in-process copy does), charged to
    /// that engine's stats; `None` when the items select different engines, none, or one that
    /// does not sum.
    fn transfer_summed(&self, items: &[TransferItem], sum_of: SumOf) -> Option<SummedTransfer> {
        let engine = self.select(&items.first()?.src, &items.first()?.dst)?;
        if !items.iter().all(|i| self.select(&i.src, &i.dst) == Some(engine)) {
            return None;
        }
        let started = Instant::now();
        let out = self.engines[engine].transfer_summed(items, sum_of)?;
        let failed: std::collections::HashSet<u64> = out.failures.iter().flat_map(|f| f.tags.iter().copied()).collect();
        let bytes: u64 = items.iter().filter(|i| !failed.contains(&i.tag)).map(|i| i.size).sum();
        let nanos = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.stats.charge(engine, TransferDirection::Local, 1, u64::from(!failed.is_empty()), bytes, nanos);
        Some(out)
    }

    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        let mut settled = Vec::new();
        let mut direct: Vec<(usize, Vec<TransferPlan>)> = Vec::new();
        let mut staged = Vec::new();
        for plan in plans {
            match (plan.engine, plan.staging.is_some()) {
                (Some(e), false) if e < self.engines.len() => match direct.iter_mut().find(|(k, _)| *k == e) {
                    Some((_, v)) => v.push(plan),
                    None => direct.push((e, vec![plan])),
                },
                (Some(e), true) if e < self.engines.len() => staged.push(plan),
                _ => settled.push(TransferFailure::new(
                    plan.tags,
                    FailureKind::NotSubmitted,
                    "plan has no owning engine",
                    self.name(),
                )),
            }
        }
        // Asynchronous engines first (the network starts moving at once), then the synchronous
        // ones (the in-process copy runs on this thread while the network works: the local part
        // of a mixed batch is done "in the gap"), then the staged rounds, which complete inline.
        // A stable sort keeps the engines' preference order within each kind.
        direct.sort_by_key(|(e, _)| self.engines[*e].completes_in_submit());
        let mut subs: Vec<SubHandle> = Vec::with_capacity(direct.len());
        for (e, plans) in direct {
            if self.engines[e].fallback_on_failure() {
                self.submit_with_fallback(e, plans, &mut subs);
            } else {
                subs.push(self.submit_group(e, plans));
            }
        }
        if !staged.is_empty() {
            self.run_staged(staged, &mut settled);
        }
        Ok(Box::new(FanOutHandle { settled, subs, waited: false }))
    }
}
