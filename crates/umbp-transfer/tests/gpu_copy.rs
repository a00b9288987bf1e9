//! `GpuCopyEngine` over the fake GPU runtime: byte-exact host ↔ device ↔ device copies, one stream
//! synchronisation per device batch, pair selection by location, pinning, and selection inside the
//! composite engine.

use std::ptr::NonNull;
use std::sync::Arc;

use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, MetricSource, RemoteRegion, TransferRef};
use umbp_gpu::{FakeRuntime, GpuRuntime};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, GpuCopyConfig, GpuCopyEngine, LocalCopyEngine, TransferEngine,
    TransferItem, failed_tags, transfer,
};

/// Fake device memory of `len` bytes on `device`, freed on drop.
struct DevBuf {
    fake: Arc<FakeRuntime>,
    ptr: NonNull<u8>,
    len: usize,
    device: u32,
}

impl DevBuf {
    fn new(fake: &Arc<FakeRuntime>, device: u32, len: usize) -> Self {
        fake.set_device(device).expect("device");
        let ptr = fake.malloc(len).expect("malloc");
        Self { fake: Arc::clone(fake), ptr, len, device }
    }

    fn r(&self) -> TransferRef {
        // SAFETY: the allocation outlives every use of the ref in the test.
        TransferRef::local(unsafe {
            LocalRegion::new(self.ptr, self.len as u64, MemoryLocation::Gpu { device: self.device })
        })
    }

    /// Fake device memory is host memory: the test may read it.
    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` live bytes of host memory owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _guard = umbp_gpu::DeviceGuard::switch(self.fake.as_ref(), self.device).expect("device");
        // SAFETY: allocated in `new`, no copy in flight (copies finish in submit).
        unsafe { self.fake.free(self.ptr) }.expect("free");
    }
}

fn host_ref(bytes: &mut [u8]) -> TransferRef {
    let ptr = NonNull::new(bytes.as_mut_ptr()).expect("non-null");
    // SAFETY: the slice outlives every use of the ref in the test.
    TransferRef::local(unsafe { LocalRegion::new(ptr, bytes.len() as u64, MemoryLocation::Host) })
}

fn item(src: &TransferRef, so: u64, dst: &TransferRef, d: u64, size: u64, tag: u64) -> TransferItem {
    TransferItem { src: src.clone(), src_offset: so, dst: dst.clone(), dst_offset: d, size, tag }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8).collect()
}

fn engine(fake: &Arc<FakeRuntime>, config: GpuCopyConfig) -> GpuCopyEngine {
    GpuCopyEngine::new(Arc::clone(fake) as Arc<dyn GpuRuntime>, config).expect("engine")
}

#[test]
fn host_to_device_to_device_to_host_is_byte_exact() {
    let fake = Arc::new(FakeRuntime::new(2));
    let e = engine(&fake, GpuCopyConfig::default());
    let page = 4096u64;
    let mut src = pattern(8 * page as usize, 3);
    let (d0, d1) = (DevBuf::new(&fake, 0, 8 * page as usize), DevBuf::new(&fake, 1, 8 * page as usize));
    let mut back = vec![0u8; 8 * page as usize];
    let (rs, r0, r1, rb) = (host_ref(&mut src), d0.r(), d1.r(), host_ref(&mut back));
    // Scattered pages and a partial tail: host page i → device 0 page 7 - i.
    let h2d: Vec<_> =
        (0..8).map(|i| item(&rs, i * page, &r0, (7 - i) * page, if i == 7 { 100 } else { page }, i)).collect();
    transfer(&e, &h2d).expect("h2d");
    let d2d: Vec<_> = (0..8).map(|i| item(&r0, i * page, &r1, i * page, page, i)).collect();
    transfer(&e, &d2d).expect("d2d across devices");
    let d2h: Vec<_> =
        (0..8).map(|i| item(&r1, (7 - i) * page, &rb, i * page, if i == 7 { 100 } else { page }, i)).collect();
    transfer(&e, &d2h).expect("d2h");
    drop((rs, rb));
    assert_eq!(&back[..7 * page as usize + 100], &src[..7 * page as usize + 100], "round trip is byte-exact");
    assert!(back[7 * page as usize + 100..].iter().all(|b| *b == 0), "nothing past the tail is written");
    assert_eq!(&d0.bytes()[..100], &src[7 * page as usize..7 * page as usize + 100], "the tail landed on device 0");
    assert_eq!(fake.stats().refused_copies, 0);
}

#[test]
fn a_batch_of_small_pages_waits_once_per_device() {
    let fake = Arc::new(FakeRuntime::new(2));
    let e = engine(&fake, GpuCopyConfig { submit_threads: 1, ..GpuCopyConfig::default() });
    let page = 1024u64;
    let mut src = pattern(64 * page as usize, 9);
    let (d0, d1) = (DevBuf::new(&fake, 0, 128 * page as usize), DevBuf::new(&fake, 1, 128 * page as usize));
    let rs = host_ref(&mut src);
    // Every other destination page, so nothing coalesces: 64 segments, half to each device.
    let items: Vec<_> = (0..64)
        .map(|i| {
            let dst = if i % 2 == 0 { d0.r() } else { d1.r() };
            item(&rs, i * page, &dst, 2 * i * page, page, i)
        })
        .collect();
    let before = fake.stats();
    transfer(&e, &items).expect("copied");
    let after = fake.stats();
    assert_eq!(after.async_copies - before.async_copies, 64, "every page is one async copy");
    assert_eq!(after.stream_syncs - before.stream_syncs, 2, "one synchronisation per device");
    assert_eq!(after.sync_copies, before.sync_copies, "no blocking copies");
    assert_eq!(e.batches(), 2);
    for i in 0..64u64 {
        let d = if i % 2 == 0 { &d0 } else { &d1 };
        let at = (2 * i * page) as usize;
        assert_eq!(&d.bytes()[at..at + page as usize], &src[(i * page) as usize..((i + 1) * page) as usize]);
    }
}

#[test]
fn unbatched_engines_copy_one_blocking_segment_at_a_time() {
    let fake = Arc::new(FakeRuntime::new(1));
    let e = engine(&fake, GpuCopyConfig { batch: false, ..GpuCopyConfig::default() });
    let mut src = pattern(4096, 1);
    let d = DevBuf::new(&fake, 0, 8192);
    let (rs, rd) = (host_ref(&mut src), d.r());
    let items = [item(&rs, 0, &rd, 4096, 1024, 0), item(&rs, 2048, &rd, 0, 1024, 1)];
    transfer(&e, &items).expect("copied");
    let stats = fake.stats();
    assert_eq!((stats.sync_copies, stats.async_copies, stats.stream_syncs), (2, 0, 0));
    assert_eq!(&d.bytes()[4096..5120], &src[..1024]);
    assert_eq!(&d.bytes()[..1024], &src[2048..3072]);
}

#[test]
fn pairs_are_claimed_by_location_only_with_a_gpu_side() {
    let fake = Arc::new(FakeRuntime::new(1));
    let e = engine(&fake, GpuCopyConfig::default());
    let (mut a, mut b) = (vec![0u8; 64], vec![0u8; 64]);
    let (ha, hb) = (host_ref(&mut a), host_ref(&mut b));
    let d = DevBuf::new(&fake, 0, 64);
    let rd = d.r();
    assert!(!e.can_handle(&ha, &hb), "host ↔ host belongs to the local copy engine");
    assert!(e.can_handle(&ha, &rd) && e.can_handle(&rd, &hb) && e.can_handle(&rd, &rd));
    let other_device = {
        // SAFETY: never dereferenced: only its location is looked at.
        let region = unsafe { LocalRegion::new(d.ptr, 64, MemoryLocation::Gpu { device: 5 }) };
        TransferRef::local(region)
    };
    assert!(!e.can_handle(&ha, &other_device), "a device the runtime does not have");
    let remote = TransferRef::remote_only(
        RemoteRegion { endpoint: "127.0.0.1:1".into(), region_id: 1 },
        64,
        MemoryLocation::Gpu { device: 0 },
    );
    assert!(!e.can_handle(&ha, &remote), "remote memory is not local");
    // Out of range and unclaimable items are rejected by tag; nothing moves.
    let set = e.plan(&[item(&ha, 0, &rd, 32, 64, 7), item(&ha, 0, &hb, 0, 8, 8), item(&ha, 0, &rd, 0, 0, 9)]);
    assert_eq!(set.rejected_tags, vec![7, 8]);
    assert!(set.plans.is_empty(), "a 0-byte item is skipped");
    let err = transfer(&e, &[item(&ha, 0, &rd, 32, 64, 7)]).expect_err("rejected");
    assert_eq!(failed_tags(&err), vec![7]);
}

#[test]
fn only_refs_that_took_a_pin_count_give_one_back() {
    let fake = Arc::new(FakeRuntime::new(2));
    let e = engine(&fake, GpuCopyConfig { pin_device: 1, ..GpuCopyConfig::default() });
    let mut host = vec![0u8; 4096];
    let ptr = NonNull::new(host.as_mut_ptr()).expect("non-null");
    // SAFETY: `host` outlives every registration below.
    let (whole, head) = unsafe {
        (LocalRegion::new(ptr, 4096, MemoryLocation::Host), LocalRegion::new(ptr, 1024, MemoryLocation::Host))
    };
    let r_whole = e.register_memory(whole).expect("registers");
    let r_head = e.register_memory(head).expect("another length at the pinned base: accepted, no count");
    assert!(fake.is_host_registered(ptr));
    e.deregister(&r_head);
    e.deregister(&r_head);
    assert!(fake.is_host_registered(ptr), "a ref that took no count cannot unpin another's pin");
    e.deregister(&r_whole);
    assert!(!fake.is_host_registered(ptr) && e.pinned_bytes() == 0, "unpinned by its own ref");
    e.deregister(&r_whole);
    assert_eq!(fake.stats().host_unregisters, 1, "a repeated deregistration is a no-op");
    assert_eq!(fake.set_device_calls(0), 0, "pinning runs under the configured device only");
    assert!(fake.set_device_calls(1) >= 2);
    assert_eq!(fake.current_device().expect("current"), None, "the thread is left with no device");
}

#[test]
fn registration_pins_host_memory_once_and_accepts_device_memory() {
    let fake = Arc::new(FakeRuntime::new(1));
    let e = engine(&fake, GpuCopyConfig::default());
    let mut host = vec![0u8; 4096];
    let ptr = NonNull::new(host.as_mut_ptr()).expect("non-null");
    // SAFETY: `host` outlives both registrations.
    let region = unsafe { LocalRegion::new(ptr, 4096, MemoryLocation::Host) };
    let r1 = e.register_memory(region).expect("host registers");
    let r2 = e.register_memory(region).expect("twice shares the pin");
    assert!(e.is_pinned(ptr) && fake.is_host_registered(ptr));
    assert_eq!(e.pinned_bytes(), 4096);
    e.deregister(&r1);
    assert!(fake.is_host_registered(ptr), "still pinned for the second ref");
    e.deregister(&r2);
    assert!(!fake.is_host_registered(ptr) && e.pinned_bytes() == 0, "unpinned with the last ref");
    e.deregister(&r2);
    let d = DevBuf::new(&fake, 0, 256);
    // SAFETY: never dereferenced by the registration.
    let on_gpu = unsafe { LocalRegion::new(d.ptr, 256, MemoryLocation::Gpu { device: 0 }) };
    assert_eq!(
        e.register_memory(on_gpu).expect("device memory registers").location(),
        MemoryLocation::Gpu { device: 0 }
    );
    // SAFETY: as above.
    let missing = unsafe { LocalRegion::new(d.ptr, 256, MemoryLocation::Gpu { device: 3 }) };
    assert!(e.register_memory(missing).is_err(), "a device the runtime does not have");
    let unpinned = engine(&fake, GpuCopyConfig { pin_host_memory: false, ..GpuCopyConfig::default() });
    unpinned.register_memory(region).expect("accepted unpinned");
    assert!(!fake.is_host_registered(ptr));
}

#[test]
fn the_composite_sends_each_pair_to_the_engine_of_its_locations() {
    let fake = Arc::new(FakeRuntime::new(1));
    let gpu = Arc::new(engine(&fake, GpuCopyConfig::default()));
    let engines: Vec<Arc<dyn TransferEngine>> = vec![Arc::new(LocalCopyEngine::default()), gpu.clone()];
    let composite = CompositeTransferEngine::new(engines, CompositeConfig { bounce_bytes: 0 }).expect("composite");
    let mut src = pattern(8192, 5);
    let mut dst = vec![0u8; 8192];
    let d = DevBuf::new(&fake, 0, 8192);
    let (rs, rd, rdev) = (host_ref(&mut src), host_ref(&mut dst), d.r());
    transfer(&composite, &[item(&rs, 0, &rdev, 0, 8192, 0)]).expect("h2d");
    transfer(&composite, &[item(&rdev, 0, &rd, 0, 8192, 0)]).expect("d2h");
    transfer(&composite, &[item(&rs, 0, &rd, 0, 16, 0)]).expect("h2h");
    drop((rs, rd));
    assert_eq!(dst, src);
    assert_eq!(gpu.batches(), 2, "the two pairs with a GPU side, and only those");
    let ops = |engine: &str| -> u64 {
        composite
            .sample_metrics()
            .iter()
            .filter(|s| s.name == umbp_core::metric_names::TRANSFER_OPS_TOTAL)
            .filter(|s| s.labels.iter().any(|(k, v)| k == "engine" && v == engine))
            .map(|s| s.value)
            .sum()
    };
    assert_eq!((ops("GpuCopyEngine"), ops("LocalCopyEngine")), (2, 1));
}

#[test]
fn many_small_pages_spread_over_submitting_threads_and_failures_stay_with_their_plan() {
    let fake = Arc::new(FakeRuntime::new(1));
    let e = engine(&fake, GpuCopyConfig { submit_threads: 4, ..GpuCopyConfig::default() });
    let page = 512u64;
    let n = 256u64;
    let mut src = pattern((n * page) as usize, 11);
    let d = DevBuf::new(&fake, 0, (2 * n * page) as usize);
    let (rs, rd) = (host_ref(&mut src), d.r());
    // Host memory that claims to be on device 0: the fake refuses copies into it.
    let mut bogus = vec![0u8; page as usize];
    let liar = {
        let ptr = NonNull::new(bogus.as_mut_ptr()).expect("non-null");
        // SAFETY: `bogus` outlives the transfer; only the fake's checks look at it.
        TransferRef::local(unsafe { LocalRegion::new(ptr, page, MemoryLocation::Gpu { device: 0 }) })
    };
    let mut items: Vec<_> = (0..n).map(|i| item(&rs, i * page, &rd, 2 * i * page, page, i)).collect();
    items.push(item(&rs, 0, &liar, 0, page, 999));
    let before = fake.stats();
    let err = transfer(&e, &items).expect_err("the lying plan fails");
    assert_eq!(failed_tags(&err), vec![999], "only the failing plan's tag");
    let after = fake.stats();
    assert_eq!(after.async_copies - before.async_copies, n, "every good page copied once");
    assert_eq!(after.stream_syncs - before.stream_syncs, 4, "four submitting threads, one wait each");
    for i in 0..n {
        let at = (2 * i * page) as usize;
        assert_eq!(&d.bytes()[at..at + page as usize], &src[(i * page) as usize..((i + 1) * page) as usize]);
    }
    assert!(bogus.iter().all(|b| *b == 0), "nothing was written through the lie");
}

#[test]
fn a_runtime_with_a_batched_copy_gets_one_call_per_run_of_one_kind() {
    let fake = Arc::new(FakeRuntime::new(1).with_batched_copy());
    let e = engine(&fake, GpuCopyConfig::default());
    let page = 1024u64;
    let n = 64u64;
    let mut src = pattern((n * page) as usize, 21);
    let mut back = vec![0u8; (n * page) as usize];
    let d = DevBuf::new(&fake, 0, (2 * n * page) as usize);
    let (rs, rd, rb) = (host_ref(&mut src), d.r(), host_ref(&mut back));
    let put: Vec<_> = (0..n).map(|i| item(&rs, i * page, &rd, 2 * i * page, page, i)).collect();
    transfer(&e, &put).expect("h2d");
    let get: Vec<_> = (0..n).map(|i| item(&rd, 2 * i * page, &rb, i * page, page, i)).collect();
    transfer(&e, &get).expect("d2h");
    drop((rs, rb));
    assert_eq!(back, src);
    let stats = fake.stats();
    assert_eq!((stats.batched_calls, stats.batched_copies), (2, 2 * n), "one call per transfer");
    assert_eq!(stats.async_copies, 0, "no copy enqueued one by one");
    // A batched call the runtime refuses fails every plan with a copy in it, and nothing else.
    let mut bogus = vec![0u8; page as usize];
    let liar = {
        let ptr = NonNull::new(bogus.as_mut_ptr()).expect("non-null");
        // SAFETY: `bogus` outlives the transfer; only the fake's checks look at it.
        TransferRef::local(unsafe { LocalRegion::new(ptr, page, MemoryLocation::Gpu { device: 0 }) })
    };
    let mut src2 = pattern(page as usize, 1);
    let rs2 = host_ref(&mut src2);
    let err = transfer(&e, &[item(&rs2, 0, &rd, 0, page, 1), item(&rs2, 0, &liar, 0, page, 2)]).expect_err("refused");
    assert_eq!(failed_tags(&err), vec![1, 2], "the whole refused call fails");
    let unbatched = engine(&fake, GpuCopyConfig { driver_batch: false, ..GpuCopyConfig::default() });
    transfer(&unbatched, &[item(&rs2, 0, &rd, 0, page, 1)]).expect("one by one");
    assert_eq!(fake.stats().async_copies, 1, "driver_batch = false enqueues copies one by one");
}
