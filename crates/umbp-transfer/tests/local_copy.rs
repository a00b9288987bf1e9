//! `LocalCopyEngine`, ported from the reference's `test_transfer_engine` checklist, plus byte-exact
//! round trips of multi-page, scattered, partial-tail and parallel copies.

use std::ptr::NonNull;

use umbp_core::{LocalRegion, MemoryLocation, RemoteRegion, TransferRef};
use umbp_transfer::{
    FailureKind, LocalCopyConfig, LocalCopyEngine, TransferEngine, TransferItem, failed_tags, transfer,
};

/// A heap buffer and its ref; the buffer outlives the ref in every test.
struct Buf {
    bytes: Vec<u8>,
}

impl Buf {
    fn filled(len: usize, seed: u8) -> Self {
        Self { bytes: (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect() }
    }

    fn zeroed(len: usize) -> Self {
        Self { bytes: vec![0; len] }
    }

    fn r(&mut self) -> TransferRef {
        let ptr = NonNull::new(self.bytes.as_mut_ptr()).expect("non-null");
        // SAFETY: the Vec is never resized and outlives every use of the ref in the test.
        TransferRef::local(unsafe { LocalRegion::new(ptr, self.bytes.len() as u64, MemoryLocation::Host) })
    }
}

fn item(src: &TransferRef, so: u64, dst: &TransferRef, d: u64, size: u64, tag: u64) -> TransferItem {
    TransferItem { src: src.clone(), src_offset: so, dst: dst.clone(), dst_offset: d, size, tag }
}

#[test]
fn copies_every_scattered_page() {
    let (mut a, mut b) = (Buf::filled(8 * 1024, 7), Buf::zeroed(8 * 1024));
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::default();
    // Out of order, non-adjacent: page 5 → 0, page 1 → 6, page 3 → 3.
    let items = [
        item(&ra, 5 * 1024, &rb, 0, 1024, 0),
        item(&ra, 1024, &rb, 6 * 1024, 1024, 1),
        item(&ra, 3 * 1024, &rb, 3 * 1024, 1024, 2),
    ];
    transfer(&e, &items).expect("all copied");
    assert_eq!(b.bytes[..1024], a.bytes[5 * 1024..6 * 1024]);
    assert_eq!(b.bytes[6 * 1024..7 * 1024], a.bytes[1024..2 * 1024]);
    assert_eq!(b.bytes[3 * 1024..4 * 1024], a.bytes[3 * 1024..4 * 1024]);
    assert!(b.bytes[1024..3 * 1024].iter().all(|x| *x == 0), "untouched pages stay zero");
}

#[test]
fn coalesces_contiguous_segments_into_one_plan() {
    let (mut a, mut b) = (Buf::filled(4096, 1), Buf::zeroed(4096));
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::default();
    let items: Vec<_> = (0..4).map(|i| item(&ra, i * 1024, &rb, i * 1024, 1024, i)).collect();
    let set = e.plan(&items);
    assert!(set.rejected_tags.is_empty());
    assert_eq!(set.plans.len(), 1);
    assert_eq!(set.plans[0].segments.len(), 1);
    assert_eq!(set.plans[0].segments[0].len, 4096);
    assert_eq!(set.plans[0].tags, vec![0, 1, 2, 3]);
    let failures = e.submit(set.plans).expect("submitted").wait();
    assert!(failures.is_empty());
    assert_eq!(a.bytes, b.bytes);
}

#[test]
fn separate_plan_per_buffer_pair() {
    let (mut a, mut b, mut c) = (Buf::filled(2048, 1), Buf::zeroed(2048), Buf::zeroed(2048));
    let (ra, rb, rc) = (a.r(), b.r(), c.r());
    let e = LocalCopyEngine::default();
    let set =
        e.plan(&[item(&ra, 0, &rb, 0, 1024, 0), item(&ra, 1024, &rc, 0, 1024, 1), item(&ra, 0, &rb, 1024, 1024, 2)]);
    assert_eq!(set.plans.len(), 2);
    assert_eq!(set.plans[0].tags, vec![0, 2]);
    assert_eq!(set.plans[1].tags, vec![1]);
}

#[test]
fn rejects_out_of_bounds_without_copying() {
    let (mut a, mut b) = (Buf::filled(2048, 3), Buf::zeroed(2048));
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::default();
    let items = [item(&ra, 0, &rb, 0, 1024, 0), item(&ra, 1024, &rb, 1500, 1024, 1), item(&ra, u64::MAX, &rb, 0, 2, 2)];
    let set = e.plan(&items);
    assert_eq!(set.rejected_tags, vec![1, 2]);
    assert_eq!(set.plans.len(), 1);
    let failures = transfer(&e, &items).expect_err("tags 1 and 2 fail");
    assert_eq!(failed_tags(&failures), vec![1, 2]);
    assert!(failures.iter().all(|f| f.kind == FailureKind::Rejected));
    assert_eq!(b.bytes[..1024], a.bytes[..1024], "the good item still moved");
    assert!(b.bytes[1024..].iter().all(|x| *x == 0), "tail bytes untouched");
}

#[test]
fn refuses_an_endpoint_it_cannot_address() {
    let (mut a, mut b) = (Buf::filled(64, 3), Buf::zeroed(64));
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::default();
    assert!(e.can_handle(&ra, &rb));
    let remote = TransferRef::remote_only(
        RemoteRegion { endpoint: "10.0.0.1:1".into(), region_id: 1 },
        64,
        MemoryLocation::Host,
    );
    assert!(!e.can_handle(&ra, &remote));
    assert!(!e.can_handle(&remote, &rb));
    let mut g = Buf::zeroed(64);
    let gpu_ptr = NonNull::new(g.bytes.as_mut_ptr()).expect("non-null");
    // SAFETY: never dereferenced: only used to ask can_handle.
    let gpu = TransferRef::local(unsafe { LocalRegion::new(gpu_ptr, 64, MemoryLocation::Gpu { device: 0 }) });
    assert!(!e.can_handle(&ra, &gpu), "GPU memory is not the host engine's");
    let set = e.plan(&[item(&ra, 0, &remote, 0, 8, 9)]);
    assert_eq!(set.rejected_tags, vec![9]);
}

#[test]
fn zero_byte_items_are_skipped_and_empty_batches_succeed() {
    let (mut a, mut b) = (Buf::filled(64, 3), Buf::zeroed(64));
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::default();
    let set = e.plan(&[item(&ra, 0, &rb, 0, 0, 1)]);
    assert!(set.plans.is_empty() && set.rejected_tags.is_empty());
    transfer(&e, &[]).expect("empty is ok");
}

#[test]
fn partial_tail_pages_write_only_their_bytes() {
    let (mut a, mut b) = (Buf::filled(3 * 1024, 5), Buf::zeroed(4 * 1024));
    b.bytes.fill(0xEE);
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::default();
    // A 2.5-page value: two full pages and a 512-byte tail.
    let items =
        [item(&ra, 0, &rb, 0, 1024, 0), item(&ra, 1024, &rb, 1024, 1024, 0), item(&ra, 2048, &rb, 2048, 512, 0)];
    transfer(&e, &items).expect("copied");
    assert_eq!(b.bytes[..2560], a.bytes[..2560]);
    assert!(b.bytes[2560..].iter().all(|x| *x == 0xEE), "nothing written past the value");
}

#[test]
fn parallel_copy_of_a_large_batch_is_byte_exact() {
    let page = 2 << 20;
    let (mut a, mut b) = (Buf::filled(64 * page, 9), Buf::zeroed(64 * page));
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::new(LocalCopyConfig { threads: 4, parallel_threshold: 1 << 20, min_chunk: 256 << 10 });
    // Reverse the page order so nothing coalesces and every thread gets several segments.
    let items: Vec<_> =
        (0..64u64).map(|i| item(&ra, i * page as u64, &rb, (63 - i) * page as u64, page as u64, i)).collect();
    transfer(&e, &items).expect("copied");
    for i in 0..64 {
        assert_eq!(b.bytes[(63 - i) * page..(64 - i) * page], a.bytes[i * page..(i + 1) * page], "page {i}");
    }
}

#[test]
fn submit_rechecks_hand_built_plans() {
    let (mut a, mut b) = (Buf::filled(64, 3), Buf::zeroed(64));
    let (ra, rb) = (a.r(), b.r());
    let e = LocalCopyEngine::default();
    let mut set = e.plan(&[item(&ra, 0, &rb, 0, 64, 4)]);
    set.plans[0].segments[0].len = 1 << 30;
    let failures = e.submit(set.plans).expect("submitted").wait();
    assert_eq!(failed_tags(&failures), vec![4]);
    assert!(b.bytes.iter().all(|x| *x == 0), "an out-of-range plan copies nothing");
}

#[test]
fn overlapping_copies_inside_one_buffer_are_memmove() {
    let mut a = Buf::filled(4096, 1);
    let original = a.bytes.clone();
    let ra = a.r();
    transfer(&LocalCopyEngine::default(), &[item(&ra, 0, &ra, 100, 2000, 0)]).expect("copied");
    assert_eq!(a.bytes[100..2100], original[..2000]);
}

fn parallel_engine() -> LocalCopyEngine {
    LocalCopyEngine::new(LocalCopyConfig { threads: 4, parallel_threshold: 1 << 20, min_chunk: 256 << 10 })
}

#[test]
fn an_overlapping_copy_on_the_parallel_path_is_memmove() {
    // 16 MiB from offset 0 to offset 100 of one buffer: split over threads, chunk k would write
    // bytes chunk k + 1 still has to read.
    const LEN: usize = 16 << 20;
    let mut a = Buf::filled(LEN + 100, 1);
    let original = a.bytes.clone();
    let ra = a.r();
    transfer(&parallel_engine(), &[item(&ra, 0, &ra, 100, LEN as u64, 0)]).expect("copied");
    assert!(a.bytes[100..] == original[..LEN], "the parallel path must copy as memmove does");
    assert_eq!(a.bytes[..100], original[..100]);
}

#[test]
fn chained_items_on_the_parallel_path_copy_in_item_order() {
    // Item 0 fills b from a; item 1 copies b on to c; item 2 overwrites a's second half from its
    // first half. In item order c ends up with a's original bytes.
    const LEN: usize = 8 << 20;
    let (mut a, mut b, mut c) = (Buf::filled(LEN, 2), Buf::zeroed(LEN), Buf::zeroed(LEN));
    let original = a.bytes.clone();
    let (ra, rb, rc) = (a.r(), b.r(), c.r());
    let items = [
        item(&ra, 0, &rb, 0, LEN as u64, 0),
        item(&rb, 0, &rc, 0, LEN as u64, 1),
        item(&ra, 0, &ra, LEN as u64 / 2, LEN as u64 / 2, 2),
    ];
    transfer(&parallel_engine(), &items).expect("copied");
    assert!(b.bytes == original);
    assert!(c.bytes == original, "item 1 read what item 0 wrote");
    assert!(a.bytes[LEN / 2..] == original[..LEN / 2]);
}

/// Names of this process's threads that are copy threads.
fn copy_threads() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task").flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.starts_with("umbp-copy-") {
            out.push((task.file_name().to_string_lossy().into_owned(), comm.trim().to_owned()));
        }
    }
    out.sort();
    out
}

#[test]
fn parallel_submits_reuse_the_engines_copy_threads() {
    // The engine keeps `threads - 1` copy threads from its first parallel submit on: later submits
    // start none (spawning per submit cost more than a pipelined chunk's copy).
    let page = 1 << 20;
    let (mut a, mut b) = (Buf::filled(16 * page, 5), Buf::zeroed(16 * page));
    let (ra, rb) = (a.r(), b.r());
    let e = parallel_engine();
    let items: Vec<_> =
        (0..16u64).map(|i| item(&ra, i * page as u64, &rb, (15 - i) * page as u64, page as u64, i)).collect();
    transfer(&e, &items).expect("copied");
    let kept = copy_threads();
    assert_eq!(kept.len(), 3, "threads - 1 copy threads: {kept:?}");
    for round in 0..20u8 {
        b.bytes.fill(round);
        transfer(&e, &items).expect("copied");
        assert!(b.bytes[..page] == a.bytes[15 * page..], "round {round}");
    }
    assert_eq!(copy_threads(), kept, "the same threads copied every later submit");
    drop(e);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !copy_threads().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(copy_threads(), Vec::new(), "a dropped engine's copy threads exit");
}

#[test]
fn concurrent_parallel_submits_share_the_copy_threads_byte_exact() {
    let page = 1 << 20;
    let e = parallel_engine();
    std::thread::scope(|s| {
        for t in 0..6u8 {
            let e = &e;
            s.spawn(move || {
                let (mut a, mut b) = (Buf::filled(8 * page, t), Buf::zeroed(8 * page));
                let (ra, rb) = (a.r(), b.r());
                let items: Vec<_> =
                    (0..8u64).map(|i| item(&ra, i * page as u64, &rb, (7 - i) * page as u64, page as u64, i)).collect();
                for _ in 0..10 {
                    b.bytes.fill(0);
                    transfer(e, &items).expect("copied");
                    for i in 0..8 {
                        assert!(b.bytes[(7 - i) * page..(8 - i) * page] == a.bytes[i * page..(i + 1) * page]);
                    }
                }
            });
        }
    });
    assert_eq!(copy_threads().len(), 3, "six submitting threads, one set of copy threads");
}
