//! HBM-node put/get throughput against the GPU runtime's own pinned copies of the same bytes, measured
//! in the same run (`docs/benchmarks.md`, "HBM node").
//!
//! For each page size: an HBM node (one page = one value) with a real master in this process; a
//! pinned host buffer registered with the node; `batch_put` of every page as its own key, then
//! `batch_get` of every key into a second pinned buffer, timed end to end (routing at the master,
//! allocation, copies, commit). Beside it, on the same runtime and device: the GPU copy engine alone
//! (no control plane; one `cuMemcpyAsync` per page, and the driver's batched copy), one blocking
//! `cuMemcpy` per page (the reference's one-copy-per-page path) and one bulk copy of all the bytes.
//! Every figure is the median of `--iters` runs; the last get is checked byte for byte.
//!
//! ```text
//! cargo run --release -p umbp-peer --example hbm_bench -- [--total-mib 512] [--iters 5] [--fake]
//! ```
//!
//! Without a GPU it refuses to run unless `--fake` is given (the fake runtime measures host memcpy).

use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{LocalRegion, MemoryLocation, TransferRef};
use umbp_gpu::{CopyKind, FakeRuntime, GpuRuntime, RuntimeSelection};
use umbp_master::MasterConfig;
use umbp_peer::pool_client::{HbmConfig, Medium, PoolClient, PoolClientConfig, RecachePolicy};
use umbp_transfer::{GpuCopyConfig, GpuCopyEngine, TransferItem, transfer};

const SIZES: [u64; 4] = [64 << 10, 256 << 10, 1 << 20, 4 << 20];

struct Args {
    total: u64,
    iters: usize,
    fake: bool,
    unbatched: bool,
}

fn args() -> Args {
    let mut a = Args { total: 512 << 20, iters: 5, fake: false, unbatched: false };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--total-mib" => a.total = it.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(512) << 20,
            "--iters" => a.iters = it.next().and_then(|v| v.parse().ok()).unwrap_or(5).max(1),
            "--fake" => a.fake = true,
            "--unbatched" => a.unbatched = true,
            "--bench" => {}
            other => eprintln!("ignoring unknown argument {other:?}"),
        }
    }
    a
}

/// Page-aligned host memory, freed on drop.
struct HostBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl HostBuf {
    fn new(len: usize, seed: u8) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) }).expect("host allocation");
        // SAFETY: `len` bytes just allocated.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8;
        }
        Self { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` live bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::from_size_align(self.len, 4096).expect("layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<F: FnMut()>(iters: usize, mut f: F) -> Duration {
    f(); // warm-up
    median(
        (0..iters)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed()
            })
            .collect(),
    )
}

/// The runtime's own copies of `total` bytes in `page`-byte pieces between pinned host memory and the
/// device: (per-page blocking copies, one bulk copy), each (H2D, D2H).
fn baselines(rt: &dyn GpuRuntime, total: u64, page: u64, iters: usize) -> [(Duration, Duration); 2] {
    let len = total as usize;
    let host = HostBuf::new(len, 1);
    let back = HostBuf::new(len, 2);
    rt.set_device(0).expect("device 0");
    let dev = rt.malloc(len).expect("device buffer");
    // SAFETY: both buffers live until the unregister below.
    unsafe {
        rt.host_register(host.ptr, len).expect("pin");
        rt.host_register(back.ptr, len).expect("pin");
    }
    let n = (total / page) as usize;
    let p = page as usize;
    let per_page_h2d = time(iters, || {
        for i in 0..n {
            // SAFETY: page `i` lies inside both `len`-byte buffers (`n * p <= len`).
            unsafe { rt.memcpy(dev.add(i * p), host.ptr.add(i * p), p, CopyKind::HostToDevice) }.expect("copy");
        }
    });
    let per_page_d2h = time(iters, || {
        for i in 0..n {
            // SAFETY: as above.
            unsafe { rt.memcpy(back.ptr.add(i * p), dev.add(i * p), p, CopyKind::DeviceToHost) }.expect("copy");
        }
    });
    // SAFETY: both buffers hold `len` bytes.
    let bulk_h2d = time(iters, || unsafe { rt.memcpy(dev, host.ptr, len, CopyKind::HostToDevice) }.expect("copy"));
    // SAFETY: as above.
    let bulk_d2h = time(iters, || unsafe { rt.memcpy(back.ptr, dev, len, CopyKind::DeviceToHost) }.expect("copy"));
    // SAFETY: registered above; no copy in flight; allocated above.
    unsafe {
        rt.host_unregister(host.ptr).expect("unpin");
        rt.host_unregister(back.ptr).expect("unpin");
        rt.free(dev).expect("free");
    }
    [(per_page_h2d, per_page_d2h), (bulk_h2d, bulk_d2h)]
}

/// The GPU copy engine alone: every page as one item, host ↔ device, (H2D, D2H).
fn engine_only(
    rt: &Arc<dyn GpuRuntime>,
    total: u64,
    page: u64,
    iters: usize,
    config: GpuCopyConfig,
) -> (Duration, Duration) {
    let engine = GpuCopyEngine::new(Arc::clone(rt), config).expect("engine");
    let len = total as usize;
    let mut host = HostBuf::new(len, 3);
    rt.set_device(0).expect("device 0");
    let dev = rt.malloc(len).expect("device buffer");
    use umbp_core::MemoryRegistrar;
    // SAFETY: both regions live until the end of this function, after deregistration.
    let (h, d) = unsafe {
        (
            LocalRegion::new(NonNull::new(host.bytes_mut().as_mut_ptr()).expect("ptr"), total, MemoryLocation::Host),
            LocalRegion::new(dev, total, MemoryLocation::Gpu { device: 0 }),
        )
    };
    let (hr, dr): (TransferRef, TransferRef) =
        (engine.register_memory(h).expect("reg"), engine.register_memory(d).expect("reg"));
    let n = total / page;
    // Every other page reversed, so nothing coalesces: one copy per page, as a pool batch is.
    let items = |to_dev: bool| -> Vec<TransferItem> {
        (0..n)
            .map(|i| {
                let (a, b) = (i * page, (n - 1 - i) * page);
                if to_dev {
                    TransferItem { src: hr.clone(), src_offset: a, dst: dr.clone(), dst_offset: b, size: page, tag: i }
                } else {
                    TransferItem { src: dr.clone(), src_offset: b, dst: hr.clone(), dst_offset: a, size: page, tag: i }
                }
            })
            .collect()
    };
    let (put, get) = (items(true), items(false));
    let h2d = time(iters, || transfer(&engine, &put).expect("h2d"));
    let d2h = time(iters, || transfer(&engine, &get).expect("d2h"));
    engine.deregister(&hr);
    // SAFETY: deregistered; no copy in flight.
    unsafe { rt.free(dev) }.expect("free");
    (h2d, d2h)
}

/// The pool: an HBM node, `batch_put` of every page as a key and `batch_get` of every key.
async fn pool(master: &str, selection: RuntimeSelection, total: u64, page: u64, iters: usize) -> (Duration, Duration) {
    let n = (total / page) as usize;
    let mut config =
        PoolClientConfig::new(format!("hbm-bench-{page}"), master.to_owned()).with_medium(Medium::Hbm(HbmConfig {
            device: 0,
            capacity_bytes: total * (iters as u64 + 2),
            runtime: selection,
        }));
    config.page_size = page;
    config.recache = RecachePolicy::Off;
    config.bounce_bytes = 1 << 20;
    let node = PoolClient::start(config).await.expect("hbm node");
    let src = HostBuf::new(total as usize, 7);
    let mut dst = HostBuf::new(total as usize, 0);
    // SAFETY: both buffers outlive the node's use of them (deregistered below).
    unsafe {
        node.register_memory(src.ptr, total).expect("register source");
        node.register_memory(dst.ptr, total).expect("register destination");
    }
    let p = page as usize;
    let mut put_times = Vec::new();
    let mut last_keys = Vec::new();
    for round in 0..=iters {
        let keys: Vec<String> = (0..n).map(|i| format!("r{round}-p{page}-{i}")).collect();
        let items: Vec<(&str, &[u8])> =
            keys.iter().enumerate().map(|(i, k)| (k.as_str(), &src.bytes()[i * p..(i + 1) * p])).collect();
        let t = Instant::now();
        for r in node.batch_put(&items).await {
            r.expect("put");
        }
        if round > 0 {
            put_times.push(t.elapsed()); // round 0 is the warm-up
        }
        last_keys = keys;
    }
    node.flush();
    let key_refs: Vec<&str> = last_keys.iter().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !node.master().batch_lookup(&last_keys).await.expect("lookup").iter().all(|f| *f) {
        assert!(Instant::now() < deadline, "keys never indexed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut get_times = Vec::new();
    for round in 0..=iters {
        let mut slices: Vec<&mut [u8]> = dst.bytes_mut().chunks_mut(p).collect();
        let t = Instant::now();
        for r in node.batch_get(&key_refs, &mut slices).await {
            r.expect("get");
        }
        if round > 0 {
            get_times.push(t.elapsed());
        }
    }
    assert!(dst.bytes() == src.bytes(), "get is byte-exact");
    node.deregister_memory(src.ptr);
    node.deregister_memory(dst.ptr);
    node.close().await;
    (median(put_times), median(get_times))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let a = args();
    let (rt, selection): (Arc<dyn GpuRuntime>, RuntimeSelection) = match umbp_gpu::probe() {
        Some(rt) if !a.fake => (rt, RuntimeSelection::Auto),
        _ if a.fake => (Arc::new(FakeRuntime::new(1)), RuntimeSelection::Fake { devices: 1 }),
        _ => {
            eprintln!("no GPU runtime found; pass --fake to measure the fake runtime (host memcpy)");
            std::process::exit(2);
        }
    };
    let master =
        umbp_master::start(MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() })
            .await
            .expect("master");
    let addr = master.local_addr().to_string();
    println!(
        "runtime={} total={} MiB per size, median of {} runs{}",
        rt.name(),
        a.total >> 20,
        a.iters,
        if a.unbatched { ", engine unbatched" } else { "" }
    );
    println!();
    println!(
        "| page | op | pool GB/s | engine GB/s (a call per copy) | engine GB/s (driver batch) | memcpy/page GB/s | bulk memcpy GB/s | pool / per-page | pool / bulk |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for page in SIZES {
        let total = a.total - a.total % page;
        let [per_page, bulk] = baselines(rt.as_ref(), total, page, a.iters);
        let batch = !a.unbatched;
        let one = engine_only(
            &rt,
            total,
            page,
            a.iters,
            GpuCopyConfig { batch, driver_batch: false, ..GpuCopyConfig::default() },
        );
        let engine = engine_only(&rt, total, page, a.iters, GpuCopyConfig { batch, ..GpuCopyConfig::default() });
        let (put, get) = pool(&addr, selection, total, page, a.iters).await;
        for (op, p, e1, e, pp, b) in [
            ("put (H2D)", put, one.0, engine.0, per_page.0, bulk.0),
            ("get (D2H)", get, one.1, engine.1, per_page.1, bulk.1),
        ] {
            let (pg, e1g, eg, ppg, bg) =
                (gbps(total, p), gbps(total, e1), gbps(total, e), gbps(total, pp), gbps(total, b));
            println!(
                "| {} KiB | {op} | {pg:.1} | {e1g:.1} | {eg:.1} | {ppg:.1} | {bg:.1} | {:.2} | {:.2} |",
                page >> 10,
                pg / ppg,
                pg / bg
            );
        }
    }
    master.shutdown().await;
}
