//! The composite engine over the real TCP data plane: registration merges the TCP handle into the
//! ref, registered caller memory goes zero-copy, unregistered caller memory is staged through the
//! bounce pool in rounds, and an item larger than the pool fails alone.

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
fn zero_copy_and_staged_puts_and_gets_are_byte_exact() {
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

    // Unregistered caller memory, 1 MiB through a 256 KiB pool: staged in rounds.
    let mut user = (0..1 << 20).map(|i| (i % 241) as u8).collect::<Vec<u8>>();
    let ru = TransferRef::local(region(&mut user));
    let puts: Vec<_> = (0..16).map(|i| item(&ru, i * 65536, &target, (1 << 20) + i * 65536, 65536, i)).collect();
    let set = a.plan(&puts);
    let rounds: std::collections::BTreeSet<u32> =
        set.plans.iter().filter_map(|p| p.staging.as_ref().map(|s| s.round)).collect();
    assert_eq!(rounds.len(), 4, "1 MiB through a 256 KiB pool");
    assert!(a.submit(set.plans).expect("submitted").wait().is_empty());
    assert_eq!(remote[1 << 20..2 << 20], user[..]);

    // Staged get back into another unregistered buffer.
    let mut back = vec![0u8; 1 << 20];
    let rb = TransferRef::local(region(&mut back));
    let gets: Vec<_> = (0..16).map(|i| item(&target, (1 << 20) + i * 65536, &rb, i * 65536, 65536, i)).collect();
    transfer(&a, &gets).expect("staged gets");
    assert_eq!(back, user);
    a.deregister(&rr);
    b.deregister(&owned);
}

#[test]
fn an_item_larger_than_the_pool_fails_alone() {
    let mut remote = vec![0u8; 1 << 20];
    let (a, b) = (node(64 << 10), node(0));
    let owned = b.register_memory(region(&mut remote)).expect("registered");
    let target = published(&owned);
    let mut user = vec![7u8; 1 << 20];
    let ru = TransferRef::local(region(&mut user));
    let items = [
        item(&ru, 0, &target, 0, 4096, 0),
        item(&ru, 4096, &target, 4096, 128 << 10, 1),
        item(&ru, 200_000, &target, 200_000, 4096, 2),
    ];
    let failures = transfer(&a, &items).expect_err("tag 1 is larger than the pool");
    assert_eq!(failed_tags(&failures), vec![1]);
    assert!(remote[..4096].iter().all(|x| *x == 7));
    assert!(remote[200_000..204_096].iter().all(|x| *x == 7));
    assert!(remote[4096..4096 + (128 << 10)].iter().all(|x| *x == 0));
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
