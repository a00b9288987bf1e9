//! The real GPU runtime, when the machine has one (skipped with a printed reason otherwise): device
//! count, set/get device and the scoped switch, malloc/free, host registration, blocking and
//! stream-ordered copies in every direction, streams and error strings. The same body runs on the
//! fake runtime everywhere, so the test itself is exercised on machines without a GPU.

use std::ptr::NonNull;
use std::sync::Arc;

use umbp_gpu::{CopyKind, DeviceGuard, FakeRuntime, GpuRuntime};

fn exercise(rt: &dyn GpuRuntime) {
    let count = rt.device_count().expect("device count");
    assert!(count >= 1);
    let last = count - 1;
    // A fresh thread has no current device, and a guard leaves it with none again (on the CUDA
    // driver API: no current context, so no context of a device the thread never asked for).
    std::thread::scope(|s| {
        s.spawn(|| {
            assert_eq!(rt.current_device().expect("current"), None, "a fresh thread has no device");
            {
                let _g = DeviceGuard::switch(rt, last).expect("switch");
                assert_eq!(rt.current_device().expect("current"), Some(last));
            }
            assert_eq!(rt.current_device().expect("current"), None, "the guard restored no device");
            if matches!(rt.name(), "cuda" | "fake") {
                assert!(rt.malloc(64).is_err(), "no implicit device 0 for an allocation");
            }
        });
    });
    {
        let _g = DeviceGuard::switch(rt, last).expect("switch");
        assert_eq!(rt.current_device().expect("current"), Some(last));
    }
    rt.set_device(0).expect("device 0");
    let len = 3 << 20;
    let src: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ (i >> 16) as u8).collect();
    let mut back = vec![0u8; len];
    let src_ptr = NonNull::new(src.as_ptr().cast_mut()).expect("non-null");
    let back_ptr = NonNull::new(back.as_mut_ptr()).expect("non-null");
    let a = rt.malloc(len).expect("malloc a");
    let b = rt.malloc(len).expect("malloc b");
    // A bare address tells its device (how a binding recognises a caller's device buffer).
    assert_eq!(rt.pointer_device(a).expect("pointer query"), Some(0), "device memory");
    // SAFETY: an address inside `b`'s allocation; only looked up, never dereferenced.
    let inside = unsafe { b.add(len - 1) };
    assert_eq!(rt.pointer_device(inside).expect("pointer query"), Some(0), "inside device memory");
    assert_eq!(rt.pointer_device(src_ptr).expect("pointer query"), None, "pageable host memory");
    // SAFETY: every range below lies inside its `len`-byte buffer; host buffers outlive the
    // registration and the stream synchronisation.
    unsafe {
        rt.host_register(back_ptr, len).expect("pin");
        assert_eq!(rt.pointer_device(back_ptr).expect("pointer query"), None, "pinned host memory");
        rt.memcpy(a, src_ptr, len, CopyKind::HostToDevice).expect("h2d");
        rt.memcpy(b, a, len, CopyKind::DeviceToDevice).expect("d2d");
        let stream = rt.stream_create().expect("stream");
        assert_eq!(stream.device(), 0);
        // Page-sized pieces in reverse order, all enqueued before one synchronisation.
        let page = 64 << 10;
        for i in (0..len / page).rev() {
            rt.memcpy_async(back_ptr.add(i * page), b.add(i * page), page, CopyKind::DeviceToHost, &stream)
                .expect("d2h async");
        }
        rt.stream_synchronize(&stream).expect("sync");
        assert!(back == src, "H2D, D2D, async D2H are byte-exact");
        // The same pages again through the batched copy (one call where the runtime has one).
        back.iter_mut().for_each(|b| *b = 0);
        let copies: Vec<_> = (0..len / page).rev().map(|i| (back_ptr.add(i * page), b.add(i * page), page)).collect();
        rt.memcpy_batch_async(&copies, CopyKind::DeviceToHost, &stream).expect("batched d2h");
        rt.stream_synchronize(&stream).expect("sync");
        eprintln!("{}: batched copy is one call: {}", rt.name(), rt.has_batched_copy());
        rt.stream_destroy(stream).expect("destroy");
        rt.host_unregister(back_ptr).expect("unpin");
        rt.free(a).expect("free a");
        rt.free(b).expect("free b");
    }
    assert!(back == src, "the batched D2H is byte-exact");
    assert!(!rt.error_string(2).is_empty());
    assert!(rt.malloc(0).is_err(), "a zero-byte allocation is refused");
    assert!(rt.set_device(count).is_err(), "a missing device is refused");
}

#[test]
fn the_runtime_contract_holds_on_the_fake() {
    exercise(&FakeRuntime::new(2));
}

#[test]
fn the_runtime_contract_holds_on_a_real_gpu() {
    let Some(rt) = umbp_gpu::probe() else {
        assert!(!umbp_gpu::gpu_required(), "UMBP_REQUIRE_GPU=1 but no HIP or CUDA runtime with a device was found");
        eprintln!("skipped: no HIP or CUDA runtime with a device found (set by umbp_gpu::probe)");
        return;
    };
    eprintln!("running on the {} runtime, {} devices", rt.name(), rt.device_count().unwrap_or(0));
    exercise(Arc::clone(&rt).as_ref());
}

#[test]
fn every_runtime_library_present_keeps_the_contract() {
    use umbp_gpu::RuntimeSelection;
    let mut ran = 0;
    for selection in [RuntimeSelection::Cuda, RuntimeSelection::CudaRuntime, RuntimeSelection::Hip] {
        match selection.load() {
            Ok(rt) if rt.device_count().is_ok_and(|n| n > 0) => {
                eprintln!("running on {selection} ({})", rt.name());
                exercise(rt.as_ref());
                ran += 1;
            }
            Ok(_) => eprintln!("skipped {selection}: loaded, but it sees no device"),
            Err(e) => eprintln!("skipped {selection}: {e}"),
        }
    }
    assert!(ran > 0 || !umbp_gpu::gpu_required(), "UMBP_REQUIRE_GPU=1 but no runtime library ran");
}
