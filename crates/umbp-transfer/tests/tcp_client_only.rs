//! A client-only `TcpEngine` (`TcpEngine::client_only`): it listens on no port and runs no thread of
//! a server, advertises no endpoint, refuses memory for peers with a clear error, and still pushes
//! to and pulls from a serving engine from caller memory and from memory registered local only.
//!
//! One test in this binary: it counts the listening sockets of the whole process.

pub mod tcp_support;

use std::collections::HashSet;

use tcp_support::{HostBuf, engine, fast_config, item};
use umbp_core::{MemoryRegistrar, RegistrationError, TransferRef};
use umbp_transfer::{TcpEngine, TransferEngine, transfer};

/// Inodes of the TCP sockets in LISTEN state of this network namespace (IPv4 and IPv6).
fn listening_inodes() -> HashSet<u64> {
    let mut out = HashSet::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st tx:rx tr:when retrnsmt uid timeout inode
            if cols.len() > 9 && cols[3] == "0A" {
                out.extend(cols[9].parse::<u64>().ok());
            }
        }
    }
    out
}

/// Listening TCP sockets this process holds open.
fn own_listeners() -> usize {
    let listening = listening_inodes();
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_str()?;
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse::<u64>().ok()
        })
        .filter(|inode| listening.contains(inode))
        .count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("/proc/self/task").count()
}

#[test]
fn a_client_only_engine_serves_nothing_and_still_moves_bytes() {
    // The check itself: a serving engine is seen listening.
    let before = own_listeners();
    let serving = engine();
    assert_eq!(own_listeners(), before + 1, "a serving engine listens");
    assert!(serving.server().is_listening());

    let (listeners, threads_before) = (own_listeners(), threads());
    let client = TcpEngine::client_only(fast_config()).expect("client-only engine");
    assert_eq!(own_listeners(), listeners, "a client-only engine opens no listening socket");
    assert_eq!(threads(), threads_before, "and starts no thread");
    assert_eq!(client.endpoint(), "", "nothing to advertise");
    assert!(!client.server().is_listening());

    // Memory for peers: refused, saying why.
    let mut shared = HostBuf::zeroed(4096);
    match client.register_memory(shared.region()) {
        Err(RegistrationError::Refused { reason, .. }) => {
            assert!(reason.contains("serves no peers"), "the reason names it: {reason}");
        }
        other => panic!("registering memory for peers must be refused, got {other:?}"),
    }
    assert_eq!(client.server().region_count(), 0);

    // Local only: accepted, and usable as the local side of a transfer.
    let mut remote = HostBuf::zeroed(64 << 10);
    let remote_ref = remote.register(&serving);
    let mut src = HostBuf::with_pattern(16 << 10, 7);
    let src_ref = client.register_local_only(src.region()).expect("local-only registration");
    assert_eq!(client.server().region_count(), 1);
    transfer(&client, &[item(&src_ref, 0, &remote_ref, 4096, 16 << 10, 1)]).expect("push from registered memory");
    assert_eq!(&remote.bytes()[4096..4096 + (16 << 10)], src.bytes());

    // Caller memory registered with no engine, both ways.
    let mut back = HostBuf::zeroed(16 << 10);
    let back_ref = TransferRef::local(back.region());
    transfer(&client, &[item(&remote_ref, 4096, &back_ref, 0, 16 << 10, 2)]).expect("pull into caller memory");
    assert_eq!(back.bytes(), src.bytes());
    let mut loose = HostBuf::with_pattern(8192, 9);
    let loose_ref = TransferRef::local(loose.region());
    transfer(&client, &[item(&loose_ref, 0, &remote_ref, 32 << 10, 8192, 3)]).expect("push from caller memory");
    assert_eq!(&remote.bytes()[32 << 10..(32 << 10) + 8192], loose.bytes());

    // Deregistration works as on a serving engine.
    client.deregister(&src_ref);
    assert_eq!(client.server().region_count(), 0);
    drop(client);
    assert_eq!(own_listeners(), listeners);
}
