//! An HBM node through `PoolClient`: byte-exact puts and gets between host buffers and HBM, and
//! between the caller's own device buffers and HBM (registered with `register_memory_at`, moved with
//! `batch_put_raw` / `batch_get_raw`: no slice ever covers device memory), with
//! multi-page values and partial tails. Over the fake GPU runtime everywhere; over the real runtime
//! when the machine has a GPU (skipped with a printed reason otherwise).

use std::ptr::NonNull;
use std::sync::Arc;

use umbp_core::{MemoryLocation, TierType};
use umbp_gpu::{CopyKind, FakeRuntime, GpuRuntime, RuntimeSelection};
use umbp_master::MasterHandle;
use umbp_peer::pool_client::{HbmConfig, Medium, PoolClient};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

/// Sizes: sub-page, one page, multi-page with a partial tail, ten pages less one byte.
const SIZES: [usize; 4] = [100, PAGE as usize, 3 * PAGE as usize + 17, 10 * PAGE as usize - 1];

async fn hbm_node(master: &MasterHandle, id: &str, runtime: RuntimeSelection) -> PoolClient {
    let config =
        config(master, id, 0).with_medium(Medium::Hbm(HbmConfig { device: 0, capacity_bytes: 4 << 20, runtime }));
    PoolClient::start(config).await.expect("hbm node starts")
}

async fn host_round_trip(node: &PoolClient, prefix: &str) {
    assert_eq!(node.medium().expect("medium").tier(), TierType::Hbm);
    let keys: Vec<String> = (0..8).map(|i| format!("{prefix}-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, SIZES[i % SIZES.len()])).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in node.batch_put(&items).await {
        r.expect("put host → HBM");
    }
    node.flush();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    indexed(node, &key_refs).await;
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0xEE; v.len() + 8]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (i, r) in node.batch_get(&key_refs, &mut slices).await.iter().enumerate() {
        assert_eq!(r.as_ref().ok().copied(), Some(values[i].len() as u64), "get {}", keys[i]);
        assert_eq!(&bufs[i][..values[i].len()], values[i].as_slice(), "bytes of {}", keys[i]);
        assert!(bufs[i][values[i].len()..].iter().all(|b| *b == 0xEE), "nothing written past the value");
    }
}

/// Puts every value from one device buffer of `runtime` and gets it back into another, both
/// registered with the node as GPU memory; returns the values read back (copied to the host).
async fn device_round_trip(node: &PoolClient, runtime: &dyn GpuRuntime, prefix: &str) {
    let values: Vec<Vec<u8>> = (0..4).map(|i| value(100 + i, SIZES[i])).collect();
    let total: usize = values.iter().map(Vec::len).sum();
    runtime.set_device(0).expect("device 0");
    let src = runtime.malloc(total).expect("device source");
    let dst = runtime.malloc(total).expect("device destination");
    let host: Vec<u8> = values.concat();
    let host_ptr = NonNull::new(host.as_ptr().cast_mut()).expect("non-null");
    // SAFETY: `src` holds `total` device bytes; `host` is `total` host bytes.
    unsafe { runtime.memcpy(src, host_ptr, total, CopyKind::HostToDevice) }.expect("stage the values");
    let gpu = MemoryLocation::Gpu { device: 0 };
    // SAFETY: both allocations live until the end of this function, after deregistration.
    unsafe {
        node.register_memory_at(src, total as u64, gpu).expect("register source");
        node.register_memory_at(dst, total as u64, gpu).expect("register destination");
    }
    let keys: Vec<String> = (0..4).map(|i| format!("{prefix}-{i}")).collect();
    let mut offsets = Vec::new();
    let mut at = 0usize;
    for v in &values {
        offsets.push(at);
        at += v.len();
    }
    // The registered device ranges go in as raw pointers: no Rust slice may cover device memory.
    let items: Vec<(&str, NonNull<u8>, usize)> = keys
        .iter()
        .zip(&offsets)
        .zip(&values)
        // `wrapping_add`: an address computation only, never dereferenced here.
        .map(|((k, o), v)| (k.as_str(), NonNull::new(src.as_ptr().wrapping_add(*o)).expect("non-null"), v.len()))
        .collect();
    // SAFETY: every range lies inside `src`, registered above as device memory and live (and not
    // written by anyone else) until after the call.
    for r in unsafe { node.batch_put_raw(&items) }.await {
        r.expect("put device → HBM");
    }
    node.flush();
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    indexed(node, &key_refs).await;
    let targets: Vec<(NonNull<u8>, usize)> = offsets
        .iter()
        .zip(&values)
        .map(|(o, v)| (NonNull::new(dst.as_ptr().wrapping_add(*o)).expect("non-null"), v.len()))
        .collect();
    // SAFETY: every range lies inside `dst`, registered above as device memory, live until after the
    // call; the ranges do not overlap and nothing else touches them.
    let got = unsafe { node.batch_get_raw(&key_refs, &targets) }.await;
    for (i, r) in got.iter().enumerate() {
        assert_eq!(r.as_ref().ok().copied(), Some(values[i].len() as u64), "get {} into device memory", keys[i]);
    }
    let mut back = vec![0u8; total];
    let back_ptr = NonNull::new(back.as_mut_ptr()).expect("non-null");
    // SAFETY: as above, device to host.
    unsafe { runtime.memcpy(back_ptr, dst, total, CopyKind::DeviceToHost) }.expect("read back");
    assert_eq!(back, host, "device → HBM → device is byte-exact");
    node.deregister_memory(src);
    node.deregister_memory(dst);
    // SAFETY: deregistered, no copy in flight.
    unsafe {
        runtime.free(src).expect("free");
        runtime.free(dst).expect("free");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hbm_node_round_trips_host_and_device_buffers_on_the_fake_runtime() {
    let m = master().await;
    let node = hbm_node(&m, "hbm-fake", RuntimeSelection::Fake { devices: 1 }).await;
    host_round_trip(&node, "host").await;
    let caller = FakeRuntime::new(1);
    device_round_trip(&node, &caller, "dev").await;
    node.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hbm_node_round_trips_host_and_device_buffers_on_a_real_gpu() {
    let Some(gpu) = umbp_gpu::probe() else {
        assert!(!umbp_gpu::gpu_required(), "UMBP_REQUIRE_GPU=1 but no HIP or CUDA runtime with a device was found");
        eprintln!("skipped: no HIP or CUDA runtime with a device found (set by umbp_gpu::probe)");
        return;
    };
    eprintln!("running on the {} runtime", gpu.name());
    let m = master().await;
    let node = hbm_node(&m, "hbm-real", RuntimeSelection::Auto).await;
    host_round_trip(&node, "host").await;
    device_round_trip(&node, Arc::clone(&gpu).as_ref(), "dev").await;
    node.close().await;
    m.shutdown().await;
}

/// Other nodes reach an HBM node's device memory over TCP: its data server stages their reads and
/// writes through host memory with its GPU runtime. A client-only node and a DRAM node (too small
/// to be routed to, so their keys land on the HBM node) put multi-page values with partial tails
/// into HBM and get them back byte-exact; the HBM node reads the same keys from its own device
/// memory, and the other nodes read a key the HBM node wrote itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn other_nodes_put_to_and_get_from_hbm_over_tcp_byte_exact() {
    cross_node_round_trip(RuntimeSelection::Fake { devices: 1 }).await;
}

/// The same over the machine's real GPU runtime (skipped with a printed reason without one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn other_nodes_put_to_and_get_from_hbm_over_tcp_on_a_real_gpu() {
    let Some(gpu) = umbp_gpu::probe() else {
        assert!(!umbp_gpu::gpu_required(), "UMBP_REQUIRE_GPU=1 but no HIP or CUDA runtime with a device was found");
        eprintln!("skipped: no HIP or CUDA runtime with a device found (set by umbp_gpu::probe)");
        return;
    };
    eprintln!("running on the {} runtime", gpu.name());
    cross_node_round_trip(RuntimeSelection::Auto).await;
}

async fn cross_node_round_trip(runtime: RuntimeSelection) {
    let m = master().await;
    let node = hbm_node(&m, "hbm-served", runtime).await;
    let client = PoolClient::start(config(&m, "client", 0).with_medium(Medium::None)).await.expect("client starts");
    let dram = PoolClient::start(config(&m, "dram", 16 * PAGE)).await.expect("dram node starts");
    let mut all_keys = Vec::new();
    let mut all_values = Vec::new();
    for (who, writer) in [("client", &client), ("dram", &dram)] {
        let keys: Vec<String> = (0..8).map(|i| format!("{who}-remote-{i}")).collect();
        let values: Vec<Vec<u8>> = (0..8).map(|i| value(10 * i + who.len(), SIZES[i % SIZES.len()])).collect();
        let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        for (i, r) in writer.batch_put(&items).await.iter().enumerate() {
            r.as_ref().unwrap_or_else(|e| panic!("{who} puts {} into remote HBM: {e:?}", keys[i]));
        }
        all_keys.extend(keys);
        all_values.extend(values);
    }
    node.flush();
    indexed(&client, &all_keys).await;
    assert_eq!(node.medium().expect("medium").owned_key_count(), all_keys.len(), "every key is in HBM");
    assert_eq!(dram.medium().expect("medium").owned_key_count(), 0, "the small DRAM node was not routed to");

    node.put("hbm-own", &all_values[2]).await.expect("the HBM node's own put");
    node.flush();
    indexed(&client, &["hbm-own"]).await;
    all_keys.push("hbm-own".to_owned());
    all_values.push(all_values[2].clone());

    let key_refs: Vec<&str> = all_keys.iter().map(String::as_str).collect();
    for (who, reader) in [("client", &client), ("dram", &dram), ("hbm", &node)] {
        let mut bufs: Vec<Vec<u8>> = all_values.iter().map(|v| vec![0xEE; v.len() + 8]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        for (i, r) in reader.batch_get(&key_refs, &mut slices).await.iter().enumerate() {
            assert_eq!(r.as_ref().ok().copied(), Some(all_values[i].len() as u64), "{who} gets {}: {r:?}", all_keys[i]);
            assert_eq!(&bufs[i][..all_values[i].len()], all_values[i].as_slice(), "{who}: bytes of {}", all_keys[i]);
            assert!(bufs[i][all_values[i].len()..].iter().all(|b| *b == 0xEE), "{who}: nothing past {}", all_keys[i]);
        }
    }
    // One key alone, through the single-key API, from the client.
    let mut buf = vec![0u8; all_values[3].len()];
    assert_eq!(client.get(&all_keys[3], &mut buf).await, Ok(buf.len() as u64));
    assert_eq!(buf, all_values[3]);
    client.close().await;
    dram.close().await;
    node.close().await;
    m.shutdown().await;
}

/// Caller memory registrations may not overlap: a second registration of a range (at the same base
/// or overlapping) is refused instead of silently replacing (and leaking) the first; after
/// deregistration the range registers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_caller_registrations_are_refused() {
    let m = master().await;
    let node = hbm_node(&m, "hbm-regs", RuntimeSelection::Fake { devices: 1 }).await;
    let mut host = vec![0u8; 8192];
    let base = NonNull::new(host.as_mut_ptr()).expect("non-null");
    let middle = NonNull::new(host[4096..].as_mut_ptr()).expect("non-null");
    let inside = NonNull::new(host[100..].as_mut_ptr()).expect("non-null");
    // SAFETY: `host` outlives every registration (all deregistered before it drops).
    unsafe {
        node.register_memory(base, 4096).expect("first registration");
        assert!(node.register_memory(base, 4096).is_err(), "the same range again");
        assert!(node.register_memory(base, 8192).is_err(), "the same base, longer");
        assert!(node.register_memory(inside, 64).is_err(), "inside the first range");
        assert!(
            node.register_memory_at(inside, 64, MemoryLocation::Gpu { device: 0 }).is_err(),
            "inside, at another location"
        );
        node.register_memory(middle, 4096).expect("the adjacent range does not overlap");
    }
    node.deregister_memory(base);
    // SAFETY: as above.
    unsafe { node.register_memory(base, 4096) }.expect("registers again after deregistration");
    node.deregister_memory(base);
    node.deregister_memory(middle);
    node.close().await;
    m.shutdown().await;
}

/// A node that lends no HBM touches no GPU unless its config asks: by default its GPU copy engine is
/// absent (caller device memory cannot be registered, so nothing probed or pinned with a GPU), and
/// with `gpu_runtime` set it moves the caller's device buffers to and from its DRAM medium.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_hbm_node_uses_a_gpu_only_when_asked() {
    let m = master().await;
    let caller = FakeRuntime::new(1);
    caller.set_device(0).expect("device 0");
    let len = 3 * PAGE as usize + 5;
    let dev = caller.malloc(2 * len).expect("device buffer");
    let gpu = MemoryLocation::Gpu { device: 0 };
    let plain = PoolClient::start(config(&m, "dram-plain", 64 * PAGE)).await.expect("starts");
    assert_eq!(plain.pointer_device(dev).expect("query"), None, "no GPU runtime: nothing is device memory to it");
    // SAFETY: `dev` lives until the end of the test (deregistered before it is freed).
    let registered = unsafe { plain.register_memory_at(dev, 2 * len as u64, gpu) }.is_ok();
    // SAFETY: the range lies inside `dev`, live for the call; no engine of this node may copy it.
    let put = unsafe { plain.batch_put_raw(&[("plain-key", dev, len)]).await };
    assert!(put[0].is_err(), "no GPU engine on a DRAM node by default: device memory cannot move");
    if registered {
        plain.deregister_memory(dev);
    }
    plain.close().await;
    let mut asked = config(&m, "dram-gpu", 64 * PAGE);
    asked.gpu_runtime = Some(RuntimeSelection::Fake { devices: 1 });
    let node = PoolClient::start(asked).await.expect("starts");
    let v = value(7, len);
    // A bare address tells where it lives (how the Python binding picks the location).
    assert_eq!(node.pointer_device(dev).expect("query"), Some(0), "the caller's device buffer");
    let host_ptr = NonNull::new(v.as_ptr().cast_mut()).expect("non-null");
    assert_eq!(node.pointer_device(host_ptr).expect("query"), None, "host memory");
    let v_ptr = NonNull::new(v.as_ptr().cast_mut()).expect("non-null");
    // SAFETY: `dev` holds `2 * len` device bytes, `v` is `len` host bytes.
    unsafe { caller.memcpy(dev, v_ptr, len, CopyKind::HostToDevice) }.expect("stage");
    // SAFETY: `dev` lives until after deregistration below.
    unsafe { node.register_memory_at(dev, 2 * len as u64, gpu) }.expect("GPU engine present when asked");
    let out = NonNull::new(dev.as_ptr().wrapping_add(len)).expect("non-null");
    // SAFETY: both ranges lie inside the registered device buffer, live for the calls, disjoint.
    unsafe {
        assert_eq!(node.batch_put_raw(&[("dev-key", dev, len)]).await, vec![Ok(())]);
        node.flush();
        indexed(&node, &["dev-key"]).await;
        assert_eq!(node.batch_get_raw(&["dev-key"], &[(out, len)]).await, vec![Ok(len as u64)]);
    }
    let mut back = vec![0u8; len];
    let back_ptr = NonNull::new(back.as_mut_ptr()).expect("non-null");
    // SAFETY: `out` holds `len` device bytes, `back` `len` host bytes.
    unsafe { caller.memcpy(back_ptr, out, len, CopyKind::DeviceToHost) }.expect("read back");
    assert_eq!(back, v, "device → DRAM → device is byte-exact");
    node.deregister_memory(dev);
    node.close().await;
    // SAFETY: deregistered, no copy in flight.
    unsafe { caller.free(dev) }.expect("free");
    m.shutdown().await;
}

/// Bad HBM settings are refused at start with the cause named: a device the runtime does not have,
/// and a runtime the machine does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_device_or_runtime_is_refused_at_start() {
    let m = master().await;
    let missing_device = config(&m, "no-device", 0).with_medium(Medium::Hbm(HbmConfig {
        device: 3,
        capacity_bytes: 4 << 20,
        runtime: RuntimeSelection::Fake { devices: 1 },
    }));
    let err = PoolClient::start(missing_device).await.expect_err("device 3 of 1");
    assert!(err.to_string().contains("device 3"), "{err}");
    if umbp_gpu::probe().is_none() {
        let no_runtime = config(&m, "no-runtime", 0).with_medium(Medium::Hbm(HbmConfig {
            device: 0,
            capacity_bytes: 4 << 20,
            runtime: RuntimeSelection::Auto,
        }));
        let err = PoolClient::start(no_runtime).await.expect_err("no GPU here");
        assert!(err.to_string().contains("GPU runtime auto"), "{err}");
    }
    m.shutdown().await;
}

/// A value held by another node reaches the caller's device buffer, and a device buffer's value
/// reaches another node — whole and in ranges, over TCP and through shared memory: the network
/// lands in the bounce pool and the GPU engine copies it on (what an engine that loads KV into
/// its GPU pool from another node's pages needs; SGLang's direct linker does exactly that).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_buffers_read_and_write_values_held_by_another_node() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 64 * PAGE)).await.expect("holder");
    let caller = FakeRuntime::new(1);
    caller.set_device(0).expect("device 0");
    let len = 3 * PAGE as usize + 5;
    let dev = caller.malloc(4 * len).expect("device buffer");
    let at = |off: usize| NonNull::new(dev.as_ptr().wrapping_add(off)).expect("non-null");
    let read_back = |off: usize, n: usize| {
        let mut host = vec![0u8; n];
        let p = NonNull::new(host.as_mut_ptr()).expect("non-null");
        // SAFETY: `dev` holds `4 * len` device bytes, `off + n` of them asked; `host` is `n` bytes.
        unsafe { caller.memcpy(p, at(off), n, CopyKind::DeviceToHost) }.expect("read back");
        host
    };
    for (n, shared) in [false, true].into_iter().enumerate() {
        let mut c =
            umbp_peer::pool_client::PoolClientConfig::new(format!("gpu-reader-{n}"), m.local_addr().to_string());
        c.gpu_runtime = Some(RuntimeSelection::Fake { devices: 1 });
        c.shared_memory = shared;
        let reader = PoolClient::start(c).await.expect("reader");
        // SAFETY: `dev` lives until the end of the test (deregistered before it is freed).
        unsafe { reader.register_memory_at(dev, 4 * len as u64, MemoryLocation::Gpu { device: 0 }) }.expect("register");
        let (key, v) = (format!("held-{n}"), value(40 + n, len));
        holder.put(&key, &v).await.expect("put at the holder");
        indexed(&reader, &[key.as_str()]).await;
        // SAFETY: every range lies inside the registered device buffer, live for the calls.
        unsafe {
            assert_eq!(reader.batch_get_raw(&[key.as_str()], &[(at(0), len)]).await, vec![Ok(len as u64)], "{n}");
            let parts = vec![(at(len), 100, 7u64), (at(len + 100), PAGE as usize, PAGE + 3)];
            assert_eq!(reader.batch_get_ranges_raw(&[key.as_str()], &[parts]).await, vec![Ok(len as u64)], "{n}");
        }
        assert_eq!(read_back(0, len), v, "a remote value in device memory, whole ({n})");
        assert_eq!(read_back(len, 100), v[7..107], "a range of it ({n})");
        assert_eq!(read_back(len + 100, PAGE as usize), v[PAGE as usize + 3..2 * PAGE as usize + 3], "({n})");
        // And the other way: a device buffer's value put to the holder.
        let (key2, v2) = (format!("from-device-{n}"), value(50 + n, len));
        let v2_ptr = NonNull::new(v2.as_ptr().cast_mut()).expect("non-null");
        // SAFETY: `2 * len + len` bytes of `dev`; `v2` is `len` host bytes.
        unsafe { caller.memcpy(at(2 * len), v2_ptr, len, CopyKind::HostToDevice) }.expect("stage");
        // SAFETY: the range lies inside the registered device buffer, live for the call.
        let put = unsafe { reader.batch_put_raw(&[(key2.as_str(), at(2 * len), len)]).await };
        assert_eq!(put, vec![Ok(())], "{n}");
        let mut back = vec![0u8; len];
        assert_eq!(holder.get(&key2, &mut back).await, Ok(len as u64), "{n}");
        assert_eq!(back, v2, "a device buffer's value at the holder ({n})");
        reader.deregister_memory(dev);
        reader.close().await;
    }
    // SAFETY: deregistered, no copy in flight.
    unsafe { caller.free(dev) }.expect("free");
    holder.close().await;
    m.shutdown().await;
}
