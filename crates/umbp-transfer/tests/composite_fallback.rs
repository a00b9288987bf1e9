//! The composite engine's fallback: a failed plan of an engine that says
//! `fallback_on_failure` is handed, in the same `submit`, to the next engine that can handle its
//! pair; an engine that does not say so keeps its failures, and so does a failed plan no later
//! engine can take. Selection is by order: the first engine that can handle a pair owns it.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, MetricSource, RegistrationError, TransferRef};
use umbp_transfer::{
    CompletedHandle, CompositeConfig, CompositeTransferEngine, FailureKind, LocalCopyEngine, PlanSet,
    TransferDirection, TransferEngine, TransferFailure, TransferHandle, TransferItem, TransferPlan, failed_tags,
    transfer,
};

/// Claims every pair of local host memory and fails every plan it is given (a short path whose
/// mapping went stale), counting the plans.
#[derive(Debug)]
struct Failing {
    falls_back: bool,
    submitted: AtomicU64,
}

impl Failing {
    fn new(falls_back: bool) -> Arc<Self> {
        Arc::new(Self { falls_back, submitted: AtomicU64::new(0) })
    }
}

impl MemoryRegistrar for Failing {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        Ok(TransferRef::local(region))
    }

    fn deregister(&self, _r: &TransferRef) {}
}

impl MetricSource for Failing {}

impl TransferEngine for Failing {
    fn name(&self) -> &str {
        "Failing"
    }

    fn completes_in_submit(&self) -> bool {
        true
    }

    fn fallback_on_failure(&self) -> bool {
        self.falls_back
    }

    fn can_handle(&self, src: &TransferRef, dst: &TransferRef) -> bool {
        src.has_local() && dst.has_local()
    }

    fn plan(&self, items: &[TransferItem]) -> PlanSet {
        // One plan per item is enough here.
        let plans = items
            .iter()
            .map(|i| TransferPlan {
                src: i.src.clone(),
                dst: i.dst.clone(),
                segments: vec![umbp_transfer::Segment {
                    src_offset: i.src_offset,
                    dst_offset: i.dst_offset,
                    len: i.size,
                }],
                tags: vec![i.tag],
                direction: TransferDirection::Local,
                engine: None,
                staging: None,
            })
            .collect();
        PlanSet { plans, rejected_tags: Vec::new() }
    }

    fn submit(&self, plans: Vec<TransferPlan>) -> Result<Box<dyn TransferHandle>, TransferFailure> {
        self.submitted.fetch_add(plans.len() as u64, Ordering::SeqCst);
        let failures = plans
            .into_iter()
            .map(|p| TransferFailure::new(p.tags, FailureKind::UnknownRegion, "stale", "Failing"))
            .collect();
        Ok(Box::new(CompletedHandle::new(failures)))
    }
}

fn host(buf: &mut [u8]) -> TransferRef {
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: every buffer outlives the transfers that use it.
    TransferRef::local(unsafe { LocalRegion::new(ptr, buf.len() as u64, MemoryLocation::Host) })
}

fn composite(engines: Vec<Arc<dyn TransferEngine>>) -> CompositeTransferEngine {
    CompositeTransferEngine::new(engines, CompositeConfig { bounce_bytes: 0 }).expect("composite")
}

fn items(src: &TransferRef, dst: &TransferRef) -> Vec<TransferItem> {
    (0..4)
        .map(|i| TransferItem {
            src: src.clone(),
            src_offset: i * 1024,
            dst: dst.clone(),
            dst_offset: i * 1024,
            size: 1024,
            tag: i,
        })
        .collect()
}

#[test]
fn a_failed_plan_of_a_fallback_engine_is_moved_by_the_next_engine() {
    let failing = Failing::new(true);
    let c = composite(vec![Arc::clone(&failing) as Arc<dyn TransferEngine>, Arc::new(LocalCopyEngine::default())]);
    let mut src = (0..4096).map(|i| (i % 253) as u8).collect::<Vec<u8>>();
    let mut dst = vec![0u8; 4096];
    let (s, d) = (host(&mut src), host(&mut dst));
    let set = c.plan(&items(&s, &d));
    assert!(set.plans.iter().all(|p| p.engine == Some(0)), "the first engine that can handle the pair owns it");
    transfer(&c, &items(&s, &d)).expect("the local copy took every failed plan over");
    assert_eq!(dst, src);
    assert_eq!(failing.submitted.load(Ordering::SeqCst), 4);
    assert_eq!((c.moved_bytes("Failing"), c.moved_bytes("LocalCopyEngine")), (0, 4096));
}

#[test]
fn an_engine_without_fallback_or_with_no_next_engine_keeps_its_failures() {
    let mut src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    let (s, d) = (host(&mut src), host(&mut dst));
    for (falls_back, next) in [(false, true), (true, false)] {
        let failing = Failing::new(falls_back);
        let mut engines: Vec<Arc<dyn TransferEngine>> = vec![failing];
        if next {
            engines.push(Arc::new(LocalCopyEngine::default()));
        }
        let c = composite(engines);
        let failures = transfer(&c, &items(&s, &d)).expect_err("nobody moved the bytes");
        assert_eq!(failed_tags(&failures), [0, 1, 2, 3], "falls_back={falls_back} next={next}");
        assert!(failures.iter().all(|f| f.kind == FailureKind::UnknownRegion));
        assert_eq!(c.moved_bytes("LocalCopyEngine"), 0);
    }
    assert_eq!(dst, vec![0u8; 4096]);
}
