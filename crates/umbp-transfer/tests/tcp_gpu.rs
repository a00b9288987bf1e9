//! The TCP data plane serving GPU regions: a server engine started with the fake GPU runtime
//! registers device memory, and a plain client engine writes and reads it byte-exact through the
//! server's host staging — single requests, batches of small reads that share the staging buffer,
//! requests larger than the staging buffer, out-of-range refusals, a failing device copy and
//! deregistration. The fake refuses a copy whose sides are not where its kind says, so a green run
//! proves the server moved the bytes with the runtime (host → device for a WRITE, device → host
//! for a READ), never with the CPU.

pub mod tcp_support;

use std::ptr::NonNull;
use std::sync::Arc;

use tcp_support::{HostBuf, fast_config, item};
use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, MetricSource, RegistrationError, TransferRef};
use umbp_gpu::{CopyKind, FakeRuntime, GpuRuntime};
use umbp_transfer::{
    DataServer, DataServerConfig, FailureKind, TcpEngine, TcpEngineConfig, TransferFailure, TransferItem, transfer,
};

/// The server's staging buffer in these tests: far smaller than the largest request.
const STAGING: usize = 64 << 10;
/// The device region: sixteen staging buffers and an odd tail.
const LEN: usize = 16 * STAGING + 777;
/// The device the region lives on (of two: the server must switch to it).
const DEVICE: u32 = 1;

fn kinds(failures: &[TransferFailure]) -> Vec<FailureKind> {
    failures.iter().map(|f| f.kind).collect()
}

/// Device memory of the fake, freed on drop.
struct DeviceBuf {
    runtime: Arc<FakeRuntime>,
    ptr: NonNull<u8>,
    len: usize,
}

impl DeviceBuf {
    fn new(runtime: &Arc<FakeRuntime>, device: u32, len: usize) -> Self {
        runtime.set_device(device).expect("device");
        let ptr = runtime.malloc(len).expect("device memory");
        let zeros = vec![0u8; len];
        // SAFETY: `len` device bytes at `ptr`, `len` host bytes in `zeros`.
        unsafe { runtime.memcpy(ptr, NonNull::from(zeros.as_slice()).cast(), len, CopyKind::HostToDevice) }
            .expect("zero the device memory");
        Self { runtime: Arc::clone(runtime), ptr, len }
    }

    fn region(&self) -> LocalRegion {
        // SAFETY: each test declares its device buffers before the engines, so the engines stop (and
        // deregister nothing left in flight) before the memory is freed.
        unsafe { LocalRegion::new(self.ptr, self.len as u64, MemoryLocation::Gpu { device: DEVICE }) }
    }

    /// The device bytes, copied to the host with the runtime (only while no transfer runs).
    fn read(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        let dst = NonNull::new(out.as_mut_ptr()).expect("non-null");
        // SAFETY: `len` host bytes at `dst`, `len` device bytes at `ptr`.
        unsafe { self.runtime.memcpy(dst, self.ptr, self.len, CopyKind::DeviceToHost) }.expect("read back");
        out
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by this fake in `new`; the engines using it have stopped.
        let _ = unsafe { self.runtime.free(self.ptr) };
    }
}

/// A server engine over `runtime` with a small staging buffer, and a client engine whose requests
/// may be as large as the whole region (so one request spans many staging pieces).
fn engines(runtime: &Arc<FakeRuntime>) -> (TcpEngine, TcpEngine) {
    let mut server_config = fast_config();
    server_config.server.gpu_staging_bytes = STAGING;
    let gpu: Arc<dyn GpuRuntime> = Arc::clone(runtime) as Arc<dyn GpuRuntime>;
    let server = TcpEngine::with_gpu_runtime(server_config, gpu).expect("server engine");
    let client = TcpEngine::new(TcpEngineConfig { chunk_size: 4 << 20, ..fast_config() }).expect("client engine");
    assert!(server.server().serves_gpu_memory());
    assert!(!client.server().serves_gpu_memory());
    (server, client)
}

/// A remote ref claiming `size` bytes of `r`'s region, so planning lets an out-of-range item through
/// and the server must refuse it.
fn oversized(r: &TransferRef, size: u64) -> TransferRef {
    TransferRef::remote_only(r.remote().expect("registered").clone(), size, MemoryLocation::Gpu { device: DEVICE })
}

fn staged_bytes(engine: &TcpEngine) -> u64 {
    engine
        .sample_metrics()
        .iter()
        .find(|s| s.name == "umbp_transfer_tcp_server_gpu_staged_bytes_total")
        .map_or(0, |s| s.value)
}

#[test]
fn a_gpu_region_is_written_and_read_byte_exact_through_staging() {
    let fake = Arc::new(FakeRuntime::new(2));
    let dev = DeviceBuf::new(&fake, DEVICE, LEN);
    let mut src = HostBuf::with_pattern(LEN, 11);
    let mut back = HostBuf::zeroed(LEN + 8);
    let (server, client) = engines(&fake);
    let gpu_ref = server.register_memory(dev.region()).expect("a GPU region registers with a GPU-enabled server");
    assert_eq!(gpu_ref.location(), MemoryLocation::Gpu { device: DEVICE });
    assert_eq!(gpu_ref.remote().expect("published").endpoint, server.endpoint());
    let before = fake.stats();

    // One request of the whole region: sixteen staging pieces and a tail, host → device.
    let src_ref = TransferRef::local(src.region());
    transfer(&client, &[item(&src_ref, 0, &gpu_ref, 0, LEN as u64, 1)]).expect("write the whole region");
    assert_eq!(dev.read(), src.bytes(), "device memory holds the payload");

    // And back: device → host, larger than staging too.
    let back_ref = TransferRef::local(back.region());
    transfer(&client, &[item(&gpu_ref, 0, &back_ref, 0, LEN as u64, 2)]).expect("read the whole region");
    assert_eq!(&back.bytes()[..LEN], src.bytes());
    assert!(back.bytes()[LEN..].iter().all(|&b| b == 0), "nothing written past the read");

    let after = fake.stats();
    assert_eq!(after.refused_copies, before.refused_copies, "every copy went the way it claimed");
    let pieces = LEN.div_ceil(STAGING) as u64;
    assert!(after.sync_copies - before.sync_copies >= 2 * pieces, "each piece is one runtime copy: {after:?}");
    assert!(after.host_registers > before.host_registers, "the staging buffer is pinned");
    assert_eq!(staged_bytes(&server), 2 * LEN as u64);
}

#[test]
fn many_small_reads_and_writes_share_the_staging_buffer() {
    const PAGE: usize = 4096;
    const PAGES: usize = 128; // 512 KiB: each of the 4 connections carries more than a staging buffer
    let fake = Arc::new(FakeRuntime::new(2));
    let dev = DeviceBuf::new(&fake, DEVICE, LEN);
    let mut src = HostBuf::with_pattern(PAGES * PAGE, 12);
    let mut back = HostBuf::zeroed(PAGES * PAGE);
    let (server, client) = engines(&fake);
    let gpu_ref = server.register_memory(dev.region()).expect("registers");
    let (src_ref, back_ref) = (TransferRef::local(src.region()), TransferRef::local(back.region()));

    // Scattered pages (every other one, from offset 100), then read back in a shuffled order.
    let at = |i: usize| (100 + 2 * i * PAGE) as u64;
    let writes: Vec<TransferItem> =
        (0..PAGES).map(|i| item(&src_ref, (i * PAGE) as u64, &gpu_ref, at(i), PAGE as u64, i as u64)).collect();
    transfer(&client, &writes).expect("scattered writes");
    let device = dev.read();
    for i in 0..PAGES {
        let (d, s) = (at(i) as usize, i * PAGE);
        assert_eq!(&device[d..d + PAGE], &src.bytes()[s..s + PAGE], "page {i} on the device");
        assert!(device[d + PAGE..d + 2 * PAGE].iter().all(|&b| b == 0), "the gap after page {i} is untouched");
    }
    let reads: Vec<TransferItem> =
        (0..PAGES).rev().map(|i| item(&gpu_ref, at(i), &back_ref, (i * PAGE) as u64, PAGE as u64, i as u64)).collect();
    transfer(&client, &reads).expect("scattered reads");
    assert_eq!(back.bytes(), src.bytes());
    assert_eq!(fake.stats().refused_copies, 0);
}

#[test]
fn out_of_range_requests_on_a_gpu_region_are_refused_and_the_connection_keeps_serving() {
    let fake = Arc::new(FakeRuntime::new(2));
    let dev = DeviceBuf::new(&fake, DEVICE, LEN);
    let mut src = HostBuf::with_pattern(2 * STAGING, 13);
    let mut back = HostBuf::zeroed(2 * STAGING);
    let (server, client) = engines(&fake);
    let gpu_ref = server.register_memory(dev.region()).expect("registers");
    let wide = oversized(&gpu_ref, (LEN + 4 * STAGING) as u64);
    let (src_ref, back_ref) = (TransferRef::local(src.region()), TransferRef::local(back.region()));
    let copies = fake.stats().sync_copies;

    // Past the end by a little and by more than a staging buffer; a write of a payload larger than
    // staging is discarded in full, so the stream stays in sync.
    let refused = transfer(
        &client,
        &[
            item(&src_ref, 0, &wide, (LEN - 10) as u64, 20, 1),
            item(&src_ref, 0, &wide, (LEN - STAGING) as u64, 2 * STAGING as u64, 2),
        ],
    )
    .expect_err("writes past the end");
    assert!(kinds(&refused).iter().all(|k| *k == FailureKind::OutOfRange), "{refused:?}");
    let refused = transfer(&client, &[item(&wide, (LEN - 1) as u64, &back_ref, 0, 2 * STAGING as u64, 3)])
        .expect_err("read past the end");
    assert_eq!(kinds(&refused), vec![FailureKind::OutOfRange]);
    assert_eq!(fake.stats().sync_copies, copies, "a refused request touches no device memory");
    assert!(dev.read().iter().all(|&b| b == 0));

    // The same connections still serve: a write and a read at the very end of the region.
    let end = (LEN - 2 * STAGING) as u64;
    transfer(&client, &[item(&src_ref, 0, &gpu_ref, end, 2 * STAGING as u64, 4)]).expect("write at the end");
    transfer(&client, &[item(&gpu_ref, end, &back_ref, 0, 2 * STAGING as u64, 5)]).expect("read at the end");
    assert_eq!(back.bytes(), src.bytes());
}

#[test]
fn a_failing_device_copy_is_answered_as_a_device_error_and_the_connection_keeps_serving() {
    let fake = Arc::new(FakeRuntime::new(2));
    // Host memory registered as if it were on the device: the fake refuses every staging copy of
    // it, as a real runtime fails a copy of memory that is not where it claims to be.
    let mut not_device = HostBuf::zeroed(LEN);
    let dev = DeviceBuf::new(&fake, DEVICE, LEN);
    let mut src = HostBuf::with_pattern(LEN, 14);
    let mut back = HostBuf::zeroed(LEN);
    let (server, client) = engines(&fake);
    let region = not_device.region();
    // SAFETY: the same host memory, described as device memory; only the fake sees the pointer.
    let lying = unsafe { LocalRegion::new(region.ptr(), region.len(), MemoryLocation::Gpu { device: DEVICE }) };
    let bad_ref = server.register_memory(lying).expect("registers");
    let gpu_ref = server.register_memory(dev.region()).expect("registers");
    let (src_ref, back_ref) = (TransferRef::local(src.region()), TransferRef::local(back.region()));

    for (size, tag) in [(100u64, 1), (LEN as u64, 2)] {
        let failed = transfer(&client, &[item(&src_ref, 0, &bad_ref, 0, size, tag)]).expect_err("write");
        assert_eq!(kinds(&failed), vec![FailureKind::RemoteDevice], "{failed:?}");
        let failed = transfer(&client, &[item(&bad_ref, 0, &back_ref, 0, size, tag)]).expect_err("read");
        assert_eq!(kinds(&failed), vec![FailureKind::RemoteDevice], "{failed:?}");
    }
    assert!(not_device.bytes().iter().all(|&b| b == 0), "nothing was written into the refused memory");
    assert!(fake.stats().refused_copies >= 4);

    transfer(&client, &[item(&src_ref, 0, &gpu_ref, 0, LEN as u64, 3)]).expect("a good region still works");
    transfer(&client, &[item(&gpu_ref, 0, &back_ref, 0, LEN as u64, 4)]).expect("and reads back");
    assert_eq!(back.bytes(), src.bytes());
}

#[test]
fn host_regions_stay_zero_copy_on_a_gpu_enabled_server() {
    let fake = Arc::new(FakeRuntime::new(2));
    let mut remote = HostBuf::zeroed(LEN);
    let mut src = HostBuf::with_pattern(LEN, 15);
    let mut back = HostBuf::zeroed(LEN);
    let (server, client) = engines(&fake);
    let host_ref = remote.register(&server);
    let (src_ref, back_ref) = (TransferRef::local(src.region()), TransferRef::local(back.region()));
    transfer(&client, &[item(&src_ref, 0, &host_ref, 0, LEN as u64, 1)]).expect("write");
    transfer(&client, &[item(&host_ref, 0, &back_ref, 0, LEN as u64, 2)]).expect("read");
    assert_eq!(remote.bytes(), src.bytes());
    assert_eq!(back.bytes(), src.bytes());
    let stats = fake.stats();
    assert_eq!((stats.sync_copies, stats.host_registers), (0, 0), "host regions never touch the runtime");
    assert_eq!(staged_bytes(&server), 0);
}

#[test]
fn deregistering_a_gpu_region_makes_it_unknown() {
    let fake = Arc::new(FakeRuntime::new(2));
    let dev = DeviceBuf::new(&fake, DEVICE, LEN);
    let mut back = HostBuf::zeroed(4096);
    let (server, client) = engines(&fake);
    let gpu_ref = server.register_memory(dev.region()).expect("registers");
    let back_ref = TransferRef::local(back.region());
    transfer(&client, &[item(&gpu_ref, 0, &back_ref, 0, 4096, 1)]).expect("read while registered");
    server.deregister(&gpu_ref);
    let failed = transfer(&client, &[item(&gpu_ref, 0, &back_ref, 0, 4096, 2)]).expect_err("gone");
    assert_eq!(kinds(&failed), vec![FailureKind::UnknownRegion]);
}

#[test]
fn gpu_regions_need_a_runtime_with_the_device_and_are_never_local_only() {
    let fake = Arc::new(FakeRuntime::new(2));
    let dev = DeviceBuf::new(&fake, DEVICE, 4096);
    let plain = DataServer::start(DataServerConfig::default()).expect("server");
    assert!(matches!(plain.register_memory(dev.region()), Err(RegistrationError::Unsupported { .. })));
    let (server, _client) = engines(&fake);
    use umbp_transfer::TransferEngine as _;
    // SAFETY: never dereferenced: device 5 does not exist, so registration must refuse it.
    let elsewhere = unsafe { LocalRegion::new(dev.ptr, 4096, MemoryLocation::Gpu { device: 5 }) };
    assert!(matches!(server.register_memory(elsewhere), Err(RegistrationError::Unsupported { .. })));
    assert!(matches!(server.register_local_only(dev.region()), Err(RegistrationError::Unsupported { .. })));
    let gpu = Arc::clone(&fake) as Arc<dyn GpuRuntime>;
    let alone = DataServer::start_with_gpu(DataServerConfig::default(), gpu).expect("server with a runtime");
    let r = alone.register_memory(dev.region()).expect("a lone server with a runtime registers device memory");
    alone.deregister(&r);
    assert_eq!(alone.region_count(), 0);
}
