//! The HBM medium through a real composite transfer engine: what it registers, where its descriptors
//! say its memory lives, and that a mislabelled location visibly selects the wrong engine (the seed's
//! "Testing" section: this is the only thing that catches a wrong `location()` / `device()`).

use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_core::{
    AllocateOutcome, AllocateRequest, CommitRequest, LocalRegion, MediumBackend, MemoryLocation, MemoryRegistrar,
    RegistrationError, TierType, TransferRef,
};
use umbp_gpu::{FakeRuntime, GpuRuntime};
use umbp_hbm::{HbmConfig, HbmPageMemorySource, make_hbm_backend};
use umbp_page::{PageBackend, PageBackendConfig, PageMemorySource, RawBuffer, SourceError};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, GpuCopyConfig, GpuCopyEngine, LocalCopyEngine, TransferEngine,
    TransferItem, transfer,
};

/// A registrar that records every location it is asked to register, then forwards to the composite.
#[derive(Debug)]
struct Recording {
    inner: Arc<CompositeTransferEngine>,
    seen: Mutex<Vec<MemoryLocation>>,
}

impl MemoryRegistrar for Recording {
    fn register_memory(&self, region: LocalRegion) -> Result<TransferRef, RegistrationError> {
        self.seen.lock().push(region.location());
        self.inner.register_memory(region)
    }

    fn deregister(&self, r: &TransferRef) {
        self.inner.deregister(r);
    }
}

struct Node {
    fake: Arc<FakeRuntime>,
    gpu: Arc<GpuCopyEngine>,
    composite: Arc<CompositeTransferEngine>,
    registrar: Arc<Recording>,
}

fn node() -> Node {
    let fake = Arc::new(FakeRuntime::new(1));
    let gpu = Arc::new(
        GpuCopyEngine::new(Arc::clone(&fake) as Arc<dyn GpuRuntime>, GpuCopyConfig::default()).expect("engine"),
    );
    let engines: Vec<Arc<dyn TransferEngine>> = vec![Arc::new(LocalCopyEngine::default()), gpu.clone()];
    let composite =
        Arc::new(CompositeTransferEngine::new(engines, CompositeConfig { bounce_bytes: 0 }).expect("composite"));
    let registrar = Arc::new(Recording { inner: Arc::clone(&composite), seen: Mutex::new(Vec::new()) });
    Node { fake, gpu, composite, registrar }
}

/// Writes `value` into the medium as `key` through the composite and reads it back.
fn round_trip(backend: &dyn MediumBackend, engine: &CompositeTransferEngine, key: &str, value: &mut [u8]) -> Vec<u8> {
    let size = value.len() as u64;
    let a = backend.batch_allocate(&[AllocateRequest::new(key.to_owned(), size)]).pop().expect("one result");
    assert_eq!(a.outcome, AllocateOutcome::Allocated);
    let page = backend.page_size();
    let src_ptr = NonNull::new(value.as_mut_ptr()).expect("non-null");
    // SAFETY: `value` outlives the transfers below.
    let src = TransferRef::local(unsafe { LocalRegion::new(src_ptr, size, MemoryLocation::Host) });
    let items: Vec<TransferItem> = a
        .pages
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let off = i as u64 * page;
            TransferItem {
                src: src.clone(),
                src_offset: off,
                dst: backend.buffer_ref(p.buffer_index as usize).expect("buffer"),
                dst_offset: u64::from(p.page_index) * page,
                size: page.min(size - off),
                tag: 0,
            }
        })
        .collect();
    transfer(engine, &items).expect("put");
    assert!(backend.batch_commit(&[CommitRequest::new(a.slot_id, key.to_owned())])[0].success);
    let resolved = backend.batch_resolve(&[key.to_owned()], true).pop().expect("one result");
    assert!(resolved.found);
    let mut out = vec![0u8; value.len()];
    let dst_ptr = NonNull::new(out.as_mut_ptr()).expect("non-null");
    // SAFETY: `out` outlives the transfer below.
    let dst = TransferRef::local(unsafe { LocalRegion::new(dst_ptr, size, MemoryLocation::Host) });
    let items: Vec<TransferItem> = resolved
        .pages
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let off = i as u64 * page;
            TransferItem {
                src: backend.buffer_ref(p.buffer_index as usize).expect("buffer"),
                src_offset: u64::from(p.page_index) * page,
                dst: dst.clone(),
                dst_offset: off,
                size: page.min(size - off),
                tag: 0,
            }
        })
        .collect();
    transfer(engine, &items).expect("get");
    out
}

#[test]
fn hbm_registers_gpu_memory_of_its_device_and_moves_through_the_gpu_engine() {
    let n = node();
    let backend = make_hbm_backend(
        Arc::clone(&n.fake) as Arc<dyn GpuRuntime>,
        &HbmConfig::new(0, 64 << 10),
        PageBackendConfig::new(TierType::Dram, 4096, vec![]),
    )
    .expect("backend");
    backend.init(Arc::clone(&n.registrar) as Arc<dyn MemoryRegistrar>).expect("init");
    // The registration contract, asserted explicitly.
    assert_eq!(n.registrar.seen.lock().last().copied(), Some(MemoryLocation::Gpu { device: 0 }));
    let r0 = backend.buffer_ref(0).expect("buffer 0");
    assert_eq!(r0.location().device(), Some(0));
    assert_eq!(r0.location(), MemoryLocation::Gpu { device: 0 });
    let base = r0.local_region().expect("local").ptr();
    assert_eq!(FakeRuntime::device_of(base, r0.size() as usize), Some(0), "the ref points at device memory");
    // A multi-page value with a partial tail, byte-exact, through the GPU engine only.
    let mut value: Vec<u8> = (0..3 * 4096 + 123).map(|i| (i % 251) as u8).collect();
    let back = round_trip(backend.as_ref(), &n.composite, "k", &mut value);
    assert_eq!(back, value);
    assert_eq!(n.gpu.batches(), 2, "one batch for the put, one for the get");
    assert_eq!(n.fake.stats().refused_copies, 0);
    backend.shutdown();
    assert_eq!(n.fake.live_bytes(), 0, "shutdown frees the device memory");
}

#[test]
fn an_hbm_medium_on_device_1_never_touches_device_0() {
    // The caller thread has no current device, as a fresh thread of the CUDA driver API: nothing
    // may fall back to device 0 (which would create a context on a GPU the node does not use).
    let fake = Arc::new(FakeRuntime::new(2));
    let runtime = Arc::clone(&fake) as Arc<dyn GpuRuntime>;
    let gpu = Arc::new(
        GpuCopyEngine::new(Arc::clone(&runtime), GpuCopyConfig { pin_device: 1, ..GpuCopyConfig::default() })
            .expect("engine"),
    );
    let engines: Vec<Arc<dyn TransferEngine>> = vec![Arc::new(LocalCopyEngine::default()), gpu.clone()];
    let composite =
        Arc::new(CompositeTransferEngine::new(engines, CompositeConfig { bounce_bytes: 1 << 20 }).expect("composite"));
    let backend = make_hbm_backend(
        Arc::clone(&runtime),
        &HbmConfig::new(1, 64 << 10),
        PageBackendConfig::new(TierType::Hbm, 4096, vec![]),
    )
    .expect("backend");
    backend.init(Arc::clone(&composite) as Arc<dyn MemoryRegistrar>).expect("init");
    let mut pinned = vec![0u8; 8192];
    let pinned_ptr = NonNull::new(pinned.as_mut_ptr()).expect("non-null");
    // SAFETY: `pinned` outlives the registration (deregistered below).
    let pinned_ref = composite
        .register_memory(unsafe { LocalRegion::new(pinned_ptr, 8192, MemoryLocation::Host) })
        .expect("host memory registers");
    assert!(gpu.is_pinned(pinned_ptr));
    let mut value: Vec<u8> = (0..2 * 4096 + 99).map(|i| (i % 253) as u8).collect();
    let back = round_trip(backend.as_ref(), &composite, "k", &mut value);
    assert_eq!(back, value);
    composite.deregister(&pinned_ref);
    backend.shutdown();
    drop(composite);
    drop(gpu);
    assert_eq!(fake.live_bytes(), 0);
    assert_eq!(fake.set_device_calls(0), 0, "device 0 was never made current");
    assert!(fake.set_device_calls(1) > 0);
    assert_eq!(fake.current_device().expect("current"), None, "every guard restored \"no device\"");
}

/// Device memory that claims to be host memory: the bug the location contract exists to catch.
#[derive(Debug)]
struct Mislabelled(HbmPageMemorySource);

impl PageMemorySource for Mislabelled {
    fn allocate(&self, sizes: &[u64]) -> Result<Vec<RawBuffer>, SourceError> {
        self.0.allocate(sizes)
    }
    fn release(&self) {
        self.0.release();
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Host
    }
    fn name(&self) -> &str {
        "Mislabelled"
    }
}

#[test]
fn a_mislabelled_location_selects_the_wrong_engine_visibly() {
    let n = node();
    let source = HbmPageMemorySource::new(Arc::clone(&n.fake) as Arc<dyn GpuRuntime>, 0).expect("device 0");
    let backend =
        PageBackend::new(PageBackendConfig::new(TierType::Hbm, 4096, vec![64 << 10]), Box::new(Mislabelled(source)))
            .expect("backend");
    backend.init(Arc::clone(&n.registrar) as Arc<dyn MemoryRegistrar>).expect("init");
    assert_eq!(n.registrar.seen.lock().last().copied(), Some(MemoryLocation::Host), "the registrar saw the lie");
    assert_eq!(backend.buffer_ref(0).expect("buffer").location().device(), None);
    // The fake's device memory is host memory, so the host engine's memcpy "works" here; on a real
    // GPU it would fault. What the test pins down is who moved the bytes: not the GPU engine.
    let mut value = vec![7u8; 5000];
    let back = round_trip(&backend, &n.composite, "k", &mut value);
    assert_eq!(back, value);
    assert_eq!(n.gpu.batches(), 0, "the GPU engine never saw the pair");
    assert_eq!(n.fake.stats().bytes_copied, 0, "no GPU runtime copy happened");
    backend.shutdown();
}
