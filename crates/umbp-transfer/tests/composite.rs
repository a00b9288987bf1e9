//! `CompositeTransferEngine`: the reference's composite checklist, bounce staging in rounds, clean
//! failure of an item larger than the pool, and per-engine metrics. A fake RDMA-like engine
//! ("FakeWire": registered memory only, exactly one remote side) stands in for the network so every
//! branch is exercised in-process; the TCP engine's own tests cover the wire.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};
use umbp_core::{
    LocalRegion, MemoryLocation, MemoryRegistrar, MetricSample, MetricSource, RegistrationError, RemoteRegion,
    TransferRef,
};
use umbp_transfer::{
    CompletedHandle, CompositeConfig, CompositeTransferEngine, FailureKind, LocalCopyEngine, PlanSet,
    TransferDirection, TransferEngine, TransferFailure, TransferHandle, TransferItem, TransferPlan, failed_tags,
    transfer,
};

/// Regions every fake node registered, by (endpoint, region id): the "network".
type Fabric = Arc<Mutex<HashMap<(String, u64), LocalRegion>>>;

#[derive(Debug)]
struct FakeWire {
    endpoint: String,
    fabric: Fabric,
    next_id: AtomicU64,
    plan_calls: AtomicUsize,
    planned_items: AtomicUsize,
    deregistered: AtomicUsize,
    submit_nothing: bool,
    /// Label every plan `Local` instead of push or pull (an engine whose directions say nothing
    /// about which side is the caller's).
    direction_local: bool,
    /// Set when a handle of this engine is waited.
    waited: Arc<AtomicBool>,
}

impl FakeWire {
    fn new(endpoint: &str, fabric: &Fabric) -> Arc<Self> {
        Arc::new(Self {
            endpoint: endpoint.into(),
            fabric: fabric.clone(),
            next_id: AtomicU64::new(1),
            plan_calls: AtomicUsize::new(0),
            planned_items: AtomicUsize::new(0),
            deregistered: AtomicUsize::new(0),
            submit_nothing: false,
            direction_local: false,
            waited: Arc::new(AtomicBool::new(false)),
        })
    }

    fn is_mine(&self, r: &TransferRef) -> bool {
        r.remote().is_some_and(|x| x.endpoint == self.endpoint) && r.local_region().is_some()
    }

    fn is_peer(&self, r: &TransferRef) -> bool {
        r.remote().is_some_and(|x| x.endpoint != self.endpoint)
    }

    fn resolve(&self, r: &TransferRef) -> Option<LocalRegion> {
        let rr = r.remote()?;
        self.fabric.lock().get(&(rr.endpoint.clone(), rr.region_id)).copied()
    }
}

/// One copy a fake handle makes when waited.
#[derive(Debug, Clone, Copy)]
struct FakeCopy {
    src: LocalRegion,
    dst: LocalRegion,
    src_offset: u64,
    dst_offset: u64,
    len: u64,
}

/// Moves its bytes in `wait` only — never on drop — so a caller that drops it unwaited loses them.
#[derive(Debug)]
struct FlagHandle {
    copies: Vec<FakeCopy>,
    inner: CompletedHandle,
    waited: Arc<AtomicBool>,
}

impl TransferHandle for FlagHandle {
    fn wait(&mut self) -> Vec<TransferFailure> {
        for c in self.copies.drain(..) {
            // SAFETY: ranges were checked at plan time against refs no larger than their regions;
            // every region in these tests outlives its transfers.
            unsafe {
                std::ptr::copy(
                    c.src.ptr().as_ptr().add(c.src_offset as usize),
                    c.dst.ptr().as_ptr().add(c.dst_offset as usize),
                    c.len as usize,
                )
            };
        }
        self.waited.store(true, Ordering::SeqCst);
        self.inner.wait()
    }
}

impl MemoryRegistrar for FakeWire {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        self.fabric.lock().insert((self.endpoint.clone(), id), region);
        Ok(TransferRef::local(region).with_remote(RemoteRegion { endpoint: self.endpoint.clone(), region_id: id }))
    }

    fn deregister(&self, r: &TransferRef) {
        if let Some(rr) = r.remote().filter(|x| x.endpoint == self.endpoint)
            && self.fabric.lock().remove(&(rr.endpoint.clone(), rr.region_id)).is_some()
        {
            self.deregistered.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl MetricSource for FakeWire {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        vec![MetricSample::counter("umbp_transfer_fake_calls_total", "calls", vec![], 1)]
    }
}

impl TransferEngine for FakeWire {
    fn name(&self) -> &str {
        "FakeWire"
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        (self.is_mine(src) && self.is_peer(dst)) || (self.is_peer(src) && self.is_mine(dst))
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        self.plan_calls.fetch_add(1, Ordering::SeqCst);
        self.planned_items.fetch_add(items.len(), Ordering::SeqCst);
        let mut set = PlanSet::default();
        for it in items {
            let ok_range = it.src_offset + it.size <= it.src.size() && it.dst_offset + it.size <= it.dst.size();
            if !self.can_handle(&it.src, &it.dst) || !ok_range {
                set.rejected_tags.push(it.tag);
                continue;
            }
            let direction = if self.direction_local {
                TransferDirection::Local
            } else if self.is_peer(&it.dst) {
                TransferDirection::Push
            } else {
                TransferDirection::Pull
            };
            set.plans.push(TransferPlan {
                src: it.src.clone(),
                dst: it.dst.clone(),
                segments: vec![umbp_transfer::Segment {
                    src_offset: it.src_offset,
                    dst_offset: it.dst_offset,
                    len: it.size,
                }],
                tags: vec![it.tag],
                direction,
                engine: None,
                staging: None,
            });
        }
        set
    }

    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        if self.submit_nothing {
            return Err(TransferFailure::new(vec![], FailureKind::NotSubmitted, "", self.name()));
        }
        let mut copies = Vec::new();
        let mut failures = Vec::new();
        for p in &plans {
            let src = if self.is_mine(&p.src) { p.src.local_region().copied() } else { self.resolve(&p.src) };
            let dst = if self.is_mine(&p.dst) { p.dst.local_region().copied() } else { self.resolve(&p.dst) };
            let (Some(src), Some(dst)) = (src, dst) else {
                failures.push(TransferFailure::new(p.tags.clone(), FailureKind::UnknownRegion, "no such region", "b"));
                continue;
            };
            copies.extend(p.segments.iter().map(|s| FakeCopy {
                src,
                dst,
                src_offset: s.src_offset,
                dst_offset: s.dst_offset,
                len: s.len,
            }));
        }
        Ok(Box::new(FlagHandle { copies, inner: CompletedHandle::new(failures), waited: self.waited.clone() }))
    }
}

struct Buf(Vec<u8>);

impl Buf {
    fn pattern(len: usize, seed: u8) -> Self {
        Self((0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect())
    }

    fn region(&mut self) -> LocalRegion {
        let ptr = NonNull::new(self.0.as_mut_ptr()).expect("non-null");
        // SAFETY: the Vec is never resized and outlives every transfer in the test.
        unsafe { LocalRegion::new(ptr, self.0.len() as u64, MemoryLocation::Host) }
    }

    /// The caller's buffer as an unregistered ref (no engine knows it).
    fn unregistered(&mut self) -> TransferRef {
        TransferRef::local(self.region())
    }
}

fn item(src: &TransferRef, so: u64, dst: &TransferRef, d: u64, size: u64, tag: u64) -> TransferItem {
    TransferItem { src: src.clone(), src_offset: so, dst: dst.clone(), dst_offset: d, size, tag }
}

/// A local node (Local + FakeWire "a") and a peer's registered region on FakeWire "b".
struct Net {
    composite: CompositeTransferEngine,
    wire: Arc<FakeWire>,
    peer_wire: Arc<FakeWire>,
}

fn net(bounce: u64) -> Net {
    let fabric = Fabric::default();
    let wire = FakeWire::new("a", &fabric);
    let peer_wire = FakeWire::new("b", &fabric);
    let composite = CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), wire.clone()],
        CompositeConfig { bounce_bytes: bounce },
    )
    .expect("composite");
    Net { composite, wire, peer_wire }
}

/// What a peer publishes: its region as a remote-only ref.
fn remote_view(r: &TransferRef) -> TransferRef {
    TransferRef::remote_only(r.remote().expect("registered").clone(), r.size(), r.location())
}

fn find<'a>(samples: &'a [MetricSample], name: &str, labels: &[(&str, &str)]) -> Option<&'a MetricSample> {
    samples
        .iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v)))
}

#[test]
fn registration_fans_out_and_merges_handles() {
    let n = net(0);
    let mut buf = Buf::pattern(4096, 1);
    let merged = n.composite.register_memory(buf.region()).expect("registered");
    assert!(merged.has_local(), "the host pointer survives the merge");
    assert_eq!(merged.remote().map(|r| r.endpoint.as_str()), Some("a"), "and carries the wire handle");
    n.composite.deregister(&merged);
    assert_eq!(n.wire.deregistered.load(Ordering::SeqCst), 1, "deregistration reaches every engine");
}

#[test]
fn selects_per_pair_and_plans_once_per_engine() {
    let n = net(0);
    let (mut a, mut b, mut peer) = (Buf::pattern(4096, 1), Buf::pattern(4096, 2), Buf::pattern(4096, 3));
    let ra = n.composite.register_memory(a.region()).expect("reg");
    let rb = n.composite.register_memory(b.region()).expect("reg");
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let items = [item(&ra, 0, &rb, 0, 1024, 0), item(&ra, 1024, &rp, 0, 1024, 1), item(&ra, 2048, &rb, 2048, 1024, 2)];
    let set = n.composite.plan(&items);
    assert!(set.rejected_tags.is_empty());
    assert_eq!(n.wire.plan_calls.load(Ordering::SeqCst), 1);
    assert_eq!(n.wire.planned_items.load(Ordering::SeqCst), 1);
    assert!(set.plans.iter().all(|p| p.engine.is_some()), "every plan names its engine");
    let failures = n.composite.submit(set.plans).expect("submitted").wait();
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(peer.0[..1024], a.0[1024..2048]);
    assert_eq!(b.0[..1024], a.0[..1024]);
}

#[test]
fn rejects_a_pair_no_engine_claims() {
    let composite =
        CompositeTransferEngine::new(vec![Arc::new(LocalCopyEngine::default())], CompositeConfig { bounce_bytes: 0 })
            .expect("composite");
    let mut a = Buf::pattern(64, 1);
    let ra = a.unregistered();
    let remote =
        TransferRef::remote_only(RemoteRegion { endpoint: "x".into(), region_id: 1 }, 64, MemoryLocation::Host);
    let set = composite.plan(&[item(&ra, 0, &remote, 0, 8, 42)]);
    assert!(set.plans.is_empty());
    assert_eq!(set.rejected_tags, vec![42]);
    let m = composite.sample_metrics();
    let rejected = find(&m, "umbp_transfer_ops_total", &[("engine", "none"), ("status", "rejected")]).expect("series");
    assert_eq!(rejected.value, 1);
}

#[test]
fn fails_tags_when_a_sub_engine_submits_nothing() {
    let fabric = Fabric::default();
    let wire =
        Arc::new(FakeWire { submit_nothing: true, ..Arc::into_inner(FakeWire::new("a", &fabric)).expect("sole") });
    let peer_wire = FakeWire::new("b", &fabric);
    let composite = CompositeTransferEngine::new(vec![wire.clone()], CompositeConfig { bounce_bytes: 0 }).expect("c");
    let (mut a, mut p) = (Buf::pattern(64, 1), Buf::pattern(64, 2));
    let ra = composite.register_memory(a.region()).expect("reg");
    let rp = remote_view(&peer_wire.register_memory(p.region()).expect("reg"));
    let failures = transfer(&composite, &[item(&ra, 0, &rp, 0, 64, 5)]).expect_err("nothing posted");
    assert_eq!(failed_tags(&failures), vec![5]);
    assert!(failures[0].message.contains("FakeWire submitted nothing"), "{}", failures[0].message);
    let m = composite.sample_metrics();
    assert_eq!(
        find(&m, "umbp_transfer_ops_total", &[("engine", "FakeWire"), ("status", "failed")]).map(|s| s.value),
        Some(1)
    );
}

#[test]
fn unregistered_caller_memory_is_staged_in_pool_sized_rounds() {
    // A 4 KiB pool and 10 KiB of caller memory: three rounds each way, all bytes exact.
    let n = net(4096);
    let mut peer = Buf(vec![0; 16 * 1024]);
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let mut user = Buf::pattern(10 * 1024, 7);
    let ru = user.unregistered();
    assert!(n.composite.can_handle(&ru, &rp), "stageable pairs are claimed");
    let puts: Vec<_> = (0..10).map(|i| item(&ru, i * 1024, &rp, (15 - i) * 1024, 1024, i)).collect();
    let set = n.composite.plan(&puts);
    assert!(set.rejected_tags.is_empty());
    let rounds: std::collections::BTreeSet<u32> =
        set.plans.iter().filter_map(|p| p.staging.as_ref().map(|s| s.round)).collect();
    assert_eq!(rounds.len(), 3, "10 KiB through a 4 KiB pool takes three rounds");
    assert!(n.composite.submit(set.plans).expect("submitted").wait().is_empty());
    for i in 0..10 {
        assert_eq!(peer.0[(15 - i) * 1024..(16 - i) * 1024], user.0[i * 1024..(i + 1) * 1024], "put {i}");
    }
    let mut back = Buf(vec![0; 10 * 1024]);
    let rb = back.unregistered();
    let gets: Vec<_> = (0..10).map(|i| item(&rp, (15 - i) * 1024, &rb, i * 1024, 1024, i)).collect();
    transfer(&n.composite, &gets).expect("staged gets");
    assert_eq!(back.0, user.0);
}

#[test]
fn an_item_larger_than_the_pool_fails_cleanly_while_the_rest_succeed() {
    let n = net(4096);
    let mut peer = Buf(vec![0; 16 * 1024]);
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let mut user = Buf::pattern(16 * 1024, 3);
    let ru = user.unregistered();
    let items =
        [item(&ru, 0, &rp, 0, 2048, 0), item(&ru, 2048, &rp, 2048, 8192, 1), item(&ru, 10240, &rp, 10240, 2048, 2)];
    let failures = transfer(&n.composite, &items).expect_err("the big one fails");
    assert_eq!(failed_tags(&failures), vec![1]);
    assert_eq!(peer.0[..2048], user.0[..2048]);
    assert_eq!(peer.0[10240..12288], user.0[10240..12288]);
    assert!(peer.0[2048..10240].iter().all(|x| *x == 0), "nothing of the failed item landed");
}

#[test]
fn registered_caller_memory_goes_zero_copy() {
    let n = net(4096);
    let mut peer = Buf(vec![0; 8192]);
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let mut user = Buf::pattern(8192, 4);
    let ru = n.composite.register_memory(user.region()).expect("reg");
    let set = n.composite.plan(&[item(&ru, 0, &rp, 0, 8192, 0)]);
    assert!(set.plans.iter().all(|p| p.staging.is_none()), "no staging for registered memory");
    assert!(n.composite.submit(set.plans).expect("submitted").wait().is_empty());
    assert_eq!(peer.0, user.0);
}

#[test]
fn charges_bytes_and_plans_to_the_engine_that_carried_them() {
    let n = net(0);
    let (mut a, mut b) = (Buf::pattern(1024, 1), Buf(vec![0; 1024]));
    let (ra, rb) = (a.unregistered(), b.unregistered());
    transfer(&n.composite, &[item(&ra, 0, &rb, 0, 1024, 0)]).expect("copied");
    let m = n.composite.sample_metrics();
    let local = [("engine", "LocalCopyEngine"), ("direction", "local")];
    let ok = find(&m, "umbp_transfer_ops_total", &[local[0], local[1], ("status", "ok")]).expect("ops");
    assert_eq!(ok.value, 1);
    assert_eq!(find(&m, "umbp_transfer_bytes_total", &local).map(|s| s.value), Some(1024));
    let secs = find(&m, "umbp_transfer_seconds_total", &local).expect("seconds");
    assert!((secs.scale - 1e-9).abs() < f64::EPSILON);
}

#[test]
fn an_unused_engine_publishes_no_transfer_counters() {
    let n = net(0);
    let (mut a, mut b) = (Buf::pattern(64, 1), Buf(vec![0; 64]));
    transfer(&n.composite, &[item(&a.unregistered(), 0, &b.unregistered(), 0, 64, 0)]).expect("copied");
    let m = n.composite.sample_metrics();
    assert!(
        !m.iter().any(|s| s.name.starts_with("umbp_transfer_")
            && s.name != "umbp_transfer_fake_calls_total"
            && s.labels.iter().any(|(k, v)| k == "engine" && v == "FakeWire")),
        "FakeWire moved nothing: {m:?}"
    );
    // An engine's own samples come through with its engine label.
    let own = find(&m, "umbp_transfer_fake_calls_total", &[("engine", "FakeWire")]).expect("own samples forwarded");
    assert_eq!(own.value, 1);
}

#[test]
fn dropping_an_unwaited_handle_drains_it() {
    let n = net(0);
    let (mut a, mut p) = (Buf::pattern(64, 1), Buf(vec![0; 64]));
    let ra = n.composite.register_memory(a.region()).expect("reg");
    let rp = remote_view(&n.peer_wire.register_memory(p.region()).expect("reg"));
    let set = n.composite.plan(&[item(&ra, 0, &rp, 0, 64, 0)]);
    let handle = n.composite.submit(set.plans).expect("submitted");
    assert!(!n.wire.waited.load(Ordering::SeqCst));
    assert!(p.0.iter().all(|x| *x == 0), "the fake moves bytes only when waited");
    drop(handle);
    assert!(n.wire.waited.load(Ordering::SeqCst), "drop waited for the sub-engine's work");
    assert_eq!(p.0, a.0, "and the work finished before drop returned");
}

#[test]
fn a_plan_without_an_engine_fails_by_tag() {
    let n = net(0);
    let (mut a, mut b) = (Buf::pattern(64, 1), Buf(vec![0; 64]));
    let mut set = n.composite.plan(&[item(&a.unregistered(), 0, &b.unregistered(), 0, 64, 3)]);
    set.plans[0].engine = None;
    let failures = n.composite.submit(set.plans).expect("handle").wait();
    assert_eq!(failed_tags(&failures), vec![3]);
    assert!(b.0.iter().all(|x| *x == 0));
}

#[test]
fn plan_sets_submitted_together_do_not_share_the_pool() {
    // Two plan calls each stage one round at pool offset 0; joined in one submit they must run as
    // separate rounds.
    let n = net(4096);
    let mut peer = Buf(vec![0; 8192]);
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let (mut u1, mut u2) = (Buf::pattern(4096, 1), Buf::pattern(4096, 2));
    let (r1, r2) = (u1.unregistered(), u2.unregistered());
    let first = n.composite.plan(&[item(&r1, 0, &rp, 0, 4096, 1)]);
    let second = n.composite.plan(&[item(&r2, 0, &rp, 4096, 4096, 2)]);
    let epochs: Vec<u64> =
        first.plans.iter().chain(&second.plans).filter_map(|p| p.staging.as_ref().map(|s| s.epoch)).collect();
    assert_eq!(epochs.len(), 2);
    assert_ne!(epochs[0], epochs[1], "every plan call has its own epoch");
    let plans = first.plans.into_iter().chain(second.plans).collect();
    assert!(n.composite.submit(plans).expect("submitted").wait().is_empty());
    assert_eq!(peer.0[..4096], u1.0[..]);
    assert_eq!(peer.0[4096..], u2.0[..]);

    // The same for pulls.
    let (mut b1, mut b2) = (Buf(vec![0; 4096]), Buf(vec![0; 4096]));
    let (rb1, rb2) = (b1.unregistered(), b2.unregistered());
    let first = n.composite.plan(&[item(&rp, 0, &rb1, 0, 4096, 1)]);
    let second = n.composite.plan(&[item(&rp, 4096, &rb2, 0, 4096, 2)]);
    let plans = first.plans.into_iter().chain(second.plans).collect();
    assert!(n.composite.submit(plans).expect("submitted").wait().is_empty());
    assert_eq!(b1.0, u1.0);
    assert_eq!(b2.0, u2.0);
}

#[test]
fn staged_plans_that_share_pool_bytes_fail_instead_of_corrupting() {
    let n = net(4096);
    let mut peer = Buf(vec![0; 8192]);
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let (mut u1, mut u2) = (Buf::pattern(4096, 1), Buf::pattern(4096, 2));
    let (r1, r2) = (u1.unregistered(), u2.unregistered());
    let first = n.composite.plan(&[item(&r1, 0, &rp, 0, 4096, 1)]);
    let mut second = n.composite.plan(&[item(&r2, 0, &rp, 4096, 4096, 2)]);
    // Forge the second set into the first one's round.
    let epoch = first.plans[0].staging.as_ref().expect("staged").epoch;
    second.plans[0].staging.as_mut().expect("staged").epoch = epoch;
    let plans = first.plans.into_iter().chain(second.plans).collect();
    let failures = n.composite.submit(plans).expect("submitted").wait();
    assert_eq!(failed_tags(&failures), vec![1, 2]);
    assert!(peer.0.iter().all(|x| *x == 0), "no byte of a colliding plan moved");
}

#[test]
fn a_bad_staged_copy_fails_its_plan_before_any_byte_moves() {
    let n = net(4096);
    let mut peer = Buf::pattern(8192, 9);
    let before = peer.0.clone();
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let mut user = Buf::pattern(4096, 1);
    let ru = user.unregistered();
    // A push whose copy reaches past the caller's buffer, beside a good one.
    let mut set = n.composite.plan(&[item(&ru, 0, &rp, 0, 2048, 1), item(&ru, 2048, &rp, 4096, 2048, 2)]);
    assert_eq!(set.plans.len(), 2, "the fake makes one plan per item");
    set.plans[0].staging.as_mut().expect("staged").copies[0].user_offset = 1 << 20;
    let failures = n.composite.submit(set.plans).expect("submitted").wait();
    assert_eq!(failed_tags(&failures), vec![1]);
    assert_eq!(failures[0].kind, FailureKind::Local);
    assert_eq!(peer.0[..4096], before[..4096], "no byte of the bad plan reached the wire");
    assert_eq!(peer.0[4096..6144], user.0[2048..], "the good plan moved");

    // A pull whose copy names a pool range the plan does not carry: the caller's buffer stays as it was.
    let mut back = Buf(vec![0xAA; 4096]);
    let rb = back.unregistered();
    let mut set = n.composite.plan(&[item(&rp, 0, &rb, 0, 4096, 3)]);
    set.plans[0].staging.as_mut().expect("staged").copies[0].bounce_offset = 64;
    let failures = n.composite.submit(set.plans).expect("submitted").wait();
    assert_eq!(failed_tags(&failures), vec![3]);
    assert!(back.0.iter().all(|x| *x == 0xAA), "a failed staged pull leaves the caller's buffer untouched");
}

#[test]
fn a_failed_staged_pull_leaves_the_caller_buffer_untouched() {
    let n = net(4096);
    let gone =
        TransferRef::remote_only(RemoteRegion { endpoint: "b".into(), region_id: 77 }, 4096, MemoryLocation::Host);
    let mut back = Buf(vec![0xAA; 4096]);
    let rb = back.unregistered();
    let failures = transfer(&n.composite, &[item(&gone, 0, &rb, 0, 4096, 4)]).expect_err("no such region");
    assert_eq!(failed_tags(&failures), vec![4]);
    assert!(back.0.iter().all(|x| *x == 0xAA));
}

#[test]
fn the_pool_side_comes_from_planning_not_from_the_direction_label() {
    let fabric = Fabric::default();
    let wire =
        Arc::new(FakeWire { direction_local: true, ..Arc::into_inner(FakeWire::new("a", &fabric)).expect("sole") });
    let peer_wire = FakeWire::new("b", &fabric);
    let composite =
        CompositeTransferEngine::new(vec![wire.clone()], CompositeConfig { bounce_bytes: 4096 }).expect("c");
    let mut peer = Buf(vec![0; 4096]);
    let rp = remote_view(&peer_wire.register_memory(peer.region()).expect("reg"));
    let mut user = Buf::pattern(2048, 5);
    let ru = user.unregistered();
    transfer(&composite, &[item(&ru, 0, &rp, 1024, 2048, 1)]).expect("staged push");
    assert_eq!(peer.0[1024..3072], user.0[..]);
    let mut back = Buf(vec![0; 2048]);
    let rb = back.unregistered();
    transfer(&composite, &[item(&rp, 1024, &rb, 0, 2048, 2)]).expect("staged pull");
    assert_eq!(back.0, user.0);
}

#[test]
fn push_and_pull_staged_in_one_round() {
    let n = net(8192);
    let mut peer = Buf::pattern(8192, 3);
    let original = peer.0.clone();
    let rp = remote_view(&n.peer_wire.register_memory(peer.region()).expect("reg"));
    let mut user = Buf::pattern(2048, 4);
    let mut back = Buf(vec![0; 2048]);
    let (ru, rb) = (user.unregistered(), back.unregistered());
    let set = n.composite.plan(&[item(&ru, 0, &rp, 0, 2048, 1), item(&rp, 4096, &rb, 0, 2048, 2)]);
    let rounds: std::collections::BTreeSet<(u64, u32)> =
        set.plans.iter().filter_map(|p| p.staging.as_ref().map(|s| (s.epoch, s.round))).collect();
    assert_eq!(rounds.len(), 1, "both fit one round");
    assert!(n.composite.submit(set.plans).expect("submitted").wait().is_empty());
    assert_eq!(peer.0[..2048], user.0[..]);
    assert_eq!(back.0[..], original[4096..6144]);
}

/// A FakeWire whose transfers stay "in flight" until the test opens a gate: its handle's `wait`
/// blocks on the gate before moving any byte. Its `submit` records what the caller's `probe`
/// buffer held at that moment, so the test can tell what ran before the network started.
#[derive(Debug)]
struct GatedWire {
    inner: Arc<FakeWire>,
    gate: Arc<(Mutex<bool>, Condvar)>,
    probe: LocalRegion,
    probe_at_submit: Mutex<Option<Vec<u8>>>,
}

impl GatedWire {
    fn open(&self) {
        *self.gate.0.lock() = true;
        self.gate.1.notify_all();
    }
}

#[derive(Debug)]
struct GatedHandle {
    inner: Box<dyn TransferHandle>,
    gate: Arc<(Mutex<bool>, Condvar)>,
}

impl TransferHandle for GatedHandle {
    fn wait(&mut self) -> Vec<TransferFailure> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut open = self.gate.0.lock();
        while !*open {
            if self.gate.1.wait_until(&mut open, deadline).timed_out() {
                return vec![TransferFailure::new(vec![], FailureKind::Timeout, "gate never opened", "GatedWire")];
            }
        }
        drop(open);
        self.inner.wait()
    }
}

impl MemoryRegistrar for GatedWire {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.inner.register_memory(region)
    }

    fn deregister(&self, r: &TransferRef) {
        self.inner.deregister(r);
    }
}

impl MetricSource for GatedWire {}

impl TransferEngine for GatedWire {
    fn name(&self) -> &str {
        "GatedWire"
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        self.inner.can_handle(src, dst)
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        self.inner.plan(items)
    }

    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        // SAFETY: the probe is a live test buffer; nothing writes it while this runs (the local copy
        // runs on this same thread, before or after this call).
        let seen = unsafe { std::slice::from_raw_parts(self.probe.ptr().as_ptr(), self.probe.len() as usize) }.to_vec();
        *self.probe_at_submit.lock() = Some(seen);
        let inner = self.inner.submit(plans)?;
        Ok(Box::new(GatedHandle { inner, gate: self.gate.clone() }))
    }
}

#[test]
fn a_mixed_batch_copies_locally_while_the_remote_part_is_in_flight() {
    let fabric = Fabric::default();
    let wire = FakeWire::new("a", &fabric);
    let peer_wire = FakeWire::new("b", &fabric);
    let mut src = Buf::pattern(8192, 6);
    let mut copy = Buf(vec![0; 4096]);
    let mut peer = Buf(vec![0; 4096]);
    let gated = Arc::new(GatedWire {
        inner: wire.clone(),
        gate: Arc::new((Mutex::new(false), Condvar::new())),
        probe: copy.region(),
        probe_at_submit: Mutex::new(None),
    });
    // The copy engine comes first in preference order (and so its plans come first in the plan
    // set): submit must still start the network before it copies.
    let composite = CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), gated.clone()],
        CompositeConfig { bounce_bytes: 0 },
    )
    .expect("composite");
    let rs = composite.register_memory(src.region()).expect("reg");
    let rc = copy.unregistered();
    let rp = remote_view(&peer_wire.register_memory(peer.region()).expect("reg"));
    let set = composite.plan(&[item(&rs, 0, &rc, 0, 4096, 1), item(&rs, 4096, &rp, 0, 4096, 2)]);
    let engines: Vec<usize> = set.plans.iter().map(|p| p.engine.expect("owned")).collect();
    assert_eq!(engines, vec![0, 1], "the local plan comes first in the plan set");

    let mut handle = composite.submit(set.plans).expect("submitted");
    assert_eq!(
        gated.probe_at_submit.lock().as_deref(),
        Some(&[0u8; 4096][..]),
        "the remote plan was submitted before the local copy ran"
    );
    assert_eq!(copy.0[..], src.0[..4096], "the local copy is done when submit returns ...");
    assert!(!wire.waited.load(Ordering::SeqCst), "... while the remote plan is still in flight");
    assert!(peer.0.iter().all(|x| *x == 0));

    gated.open();
    let failures = handle.wait();
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(peer.0[..], src.0[4096..]);
    assert!(wire.waited.load(Ordering::SeqCst));
}
