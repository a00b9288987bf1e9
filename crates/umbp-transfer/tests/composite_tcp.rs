//! The composite engine over the real TCP data plane: registration merges the TCP handle into the
//! ref, and caller memory goes zero-copy whether it is registered or not — TCP takes any host memory
//! as its local side, so nothing is staged through the bounce pool and the pool's size no longer
//! limits an item. (Staging itself is covered in `composite.rs`, with an engine that requires
//! registration.)

use std::ptr::NonNull;
use std::sync::Arc;

use umbp_core::{LocalRegion, MemoryLocation, MemoryRegistrar, TransferRef};
use umbp_transfer::{
    CompositeConfig, CompositeTransferEngine, LocalCopyEngine, TcpEngine, TcpEngineConfig, TransferEngine,
    TransferItem, failed_tags, transfer,
};

fn node(bounce: u64) -> CompositeTransferEngine {
    let tcp = TcpEngine::new(TcpEngineConfig::default()).expect("tcp engine");
    CompositeTransferEngine::new(
        vec![Arc::new(LocalCopyEngine::default()), Arc::new(tcp)],
        CompositeConfig { bounce_bytes: bounce },
    )
    .expect("composite")
}

fn region(buf: &mut [u8]) -> LocalRegion {
    let ptr = NonNull::new(buf.as_mut_ptr()).expect("non-null");
    // SAFETY: every buffer outlives its registrations and transfers in these tests.
    unsafe { LocalRegion::new(ptr, buf.len() as u64, MemoryLocation::Host) }
}

/// What the owner publishes and a reader builds from the descriptor: the remote handle only.
fn published(r: &TransferRef) -> TransferRef {
    TransferRef::remote_only(r.remote().expect("registered with tcp").clone(), r.size(), r.location())
}

fn item(src: &TransferRef, so: u64, dst: &TransferRef, d: u64, size: u64, tag: u64) -> TransferItem {
    TransferItem { src: src.clone(), src_offset: so, dst: dst.clone(), dst_offset: d, size, tag }
}

#[test]
fn registration_merges_the_tcp_handle() {
    let a = node(0);
    let mut buf = vec![0u8; 4096];
    let r = a.register_memory(region(&mut buf)).expect("registered");
    assert!(r.has_local() && r.has_remote());
    a.deregister(&r);
}

#[test]
fn registered_and_unregistered_puts_and_gets_are_zero_copy_and_byte_exact() {
    let mut remote = vec![0u8; 4 << 20];
    let (a, b) = (node(256 << 10), node(0));
    let owned = b.register_memory(region(&mut remote)).expect("owner registers its medium");
    let target = published(&owned);

    // Registered caller memory: zero copy, one plan, no staging.
    let mut registered = (0..1 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>();
    let rr = a.register_memory(region(&mut registered)).expect("registered");
    let set = a.plan(&[item(&rr, 0, &target, 0, 1 << 20, 0)]);
    assert!(set.plans.iter().all(|p| p.staging.is_none()));
    assert!(a.submit(set.plans).expect("submitted").wait().is_empty());
    assert_eq!(remote[..1 << 20], registered[..]);

    // Unregistered caller memory, 1 MiB beside a 256 KiB pool: zero copy too, straight to TCP.
    let mut user = (0..1 << 20).map(|i| (i % 241) as u8).collect::<Vec<u8>>();
    let ru = TransferRef::local(region(&mut user));
    let puts: Vec<_> = (0..16).map(|i| item(&ru, i * 65536, &target, (1 << 20) + i * 65536, 65536, i)).collect();
    let set = a.plan(&puts);
    assert!(set.rejected_tags.is_empty());
    assert!(set.plans.iter().all(|p| p.staging.is_none()), "unregistered host memory is not staged for TCP");
    assert_eq!(set.plans.len(), 1, "one zero-copy plan (the pages are adjacent on both sides)");
    assert_eq!(a.engines()[set.plans[0].engine.expect("owned")].name(), "TcpEngine");
    assert!(a.submit(set.plans).expect("submitted").wait().is_empty());
    assert_eq!(remote[1 << 20..2 << 20], user[..]);

    // Get back into another unregistered buffer, also without staging.
    let mut back = vec![0u8; 1 << 20];
    let rb = TransferRef::local(region(&mut back));
    let gets: Vec<_> = (0..16).map(|i| item(&target, (1 << 20) + i * 65536, &rb, i * 65536, 65536, i)).collect();
    assert!(a.plan(&gets).plans.iter().all(|p| p.staging.is_none()));
    transfer(&a, &gets).expect("zero-copy gets");
    assert_eq!(back, user);
    a.deregister(&rr);
    b.deregister(&owned);
}

#[test]
fn unregistered_items_larger_than_the_pool_go_through_directly() {
    // Once staged (and an item larger than the pool failed); TCP now takes the caller's memory in
    // place, so the pool's size does not matter — not even with no pool at all.
    for bounce in [64 << 10, 0] {
        let mut remote = vec![0u8; 1 << 20];
        let (a, b) = (node(bounce), node(0));
        let owned = b.register_memory(region(&mut remote)).expect("registered");
        let target = published(&owned);
        let mut user = (0..1 << 20).map(|i| (i % 239) as u8).collect::<Vec<u8>>();
        let ru = TransferRef::local(region(&mut user));
        let items = [
            item(&ru, 0, &target, 0, 4096, 0),
            item(&ru, 4096, &target, 4096, 128 << 10, 1),
            item(&ru, 200_000, &target, 200_000, 4096, 2),
        ];
        transfer(&a, &items).expect("every item moves");
        assert_eq!(remote[..4096 + (128 << 10)], user[..4096 + (128 << 10)]);
        assert_eq!(remote[200_000..204_096], user[200_000..204_096]);
        b.deregister(&owned);
    }
}

#[test]
fn a_mixed_local_and_remote_batch_of_unregistered_memory_is_byte_exact() {
    let mut remote = vec![0u8; 1 << 20];
    let (a, b) = (node(64 << 10), node(0));
    let owned = b.register_memory(region(&mut remote)).expect("registered");
    let target = published(&owned);
    let mut user = (0..1 << 20).map(|i| (i % 233) as u8).collect::<Vec<u8>>();
    let mut copy = vec![0u8; 1 << 20];
    let (ru, rc) = (TransferRef::local(region(&mut user)), TransferRef::local(region(&mut copy)));
    // Local copies and remote puts of the same caller buffer in one batch.
    let items: Vec<_> = (0..16)
        .flat_map(|i| {
            [item(&ru, i * 65536, &rc, i * 65536, 65536, i), item(&ru, i * 65536, &target, i * 65536, 65536, 100 + i)]
        })
        .collect();
    let set = a.plan(&items);
    let names: std::collections::BTreeSet<&str> =
        set.plans.iter().map(|p| a.engines()[p.engine.expect("owned")].name()).collect();
    assert_eq!(names.into_iter().collect::<Vec<_>>(), vec!["LocalCopyEngine", "TcpEngine"]);
    assert!(set.plans.iter().all(|p| p.staging.is_none()));
    assert!(a.submit(set.plans).expect("submitted").wait().is_empty());
    assert_eq!(copy, user);
    assert_eq!(remote, user);
    b.deregister(&owned);
}

#[test]
fn a_deregistered_remote_region_fails_its_items() {
    let mut remote = vec![0u8; 8192];
    let (a, b) = (node(64 << 10), node(0));
    let owned = b.register_memory(region(&mut remote)).expect("registered");
    let target = published(&owned);
    b.deregister(&owned);
    let mut user = vec![1u8; 4096];
    let ru = TransferRef::local(region(&mut user));
    let failures = transfer(&a, &[item(&ru, 0, &target, 0, 4096, 9)]).expect_err("region is gone");
    assert_eq!(failed_tags(&failures), vec![9]);
}
