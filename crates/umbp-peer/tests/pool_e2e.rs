//! End to end in one process: a real master and three `PoolClient` nodes with DRAM media on
//! 127.0.0.1, bytes moving over the real TCP data plane. Batch put/get byte-exact across local and
//! remote keys, multi-page values with partial tails, dedup, remove, clear, bad input per key, and a
//! re-route after a full node.

use std::time::Duration;

use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

async fn node(master: &MasterHandle, id: &str, capacity: u64) -> PoolClient {
    PoolClient::start(config(master, id, capacity)).await.expect("node starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_put_and_get_are_byte_exact_across_local_and_remote_nodes() {
    let m = master().await;
    let nodes = [node(&m, "n1", 4 << 20).await, node(&m, "n2", 4 << 20).await, node(&m, "n3", 4 << 20).await];
    // Sizes: sub-page, exactly one page, multi-page with a partial tail.
    let sizes = [100usize, PAGE as usize, 3 * PAGE as usize + 17, 10 * PAGE as usize - 1];
    let keys: Vec<String> = (0..24).map(|i| format!("key-{i}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().enumerate().map(|(i, _)| value(i, sizes[i % sizes.len()])).collect();
    // Each node writes a third of the keys: most land remotely (most_available spreads them).
    for (n, node) in nodes.iter().enumerate() {
        let items: Vec<(&str, &[u8])> = (n * 8..n * 8 + 8).map(|i| (keys[i].as_str(), values[i].as_slice())).collect();
        for r in node.batch_put(&items).await {
            r.expect("put");
        }
    }
    // Remote commits queue their ADDs on the holders: ship every node's outbox now.
    for node in &nodes {
        node.flush();
    }
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    indexed(&nodes[0], &key_refs).await;
    // Every node reads every key; buffers are larger than the values (filled up to the size).
    for node in &nodes {
        let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0xEE; v.len() + 8]).collect();
        let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
        let results = node.batch_get(&key_refs, &mut slices).await;
        for (i, r) in results.iter().enumerate() {
            assert_eq!(r.as_ref().ok().copied(), Some(values[i].len() as u64), "get {} on {}", keys[i], node.node_id());
            assert_eq!(&bufs[i][..values[i].len()], values[i].as_slice(), "bytes of {}", keys[i]);
            assert!(bufs[i][values[i].len()..].iter().all(|b| *b == 0xEE), "nothing written past the value");
        }
    }
    let placed: Vec<u64> = nodes.iter().map(|n| n.medium().expect("medium").owned_key_count() as u64).collect();
    assert_eq!(placed.iter().sum::<u64>(), 24, "each key stored once: {placed:?}");
    assert!(placed.iter().filter(|c| **c > 0).count() >= 2, "keys spread over nodes: {placed:?}");
    for n in &nodes {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dedup_remove_clear_and_bad_input() {
    let m = master().await;
    let a = node(&m, "a", 1 << 20).await;
    let b = node(&m, "b", 1 << 20).await;
    let v = value(7, 5000);
    a.put("k", &v).await.expect("put");
    a.flush();
    indexed(&a, &["k"]).await;
    // Dedup: the second put of the same key is a success and stores nothing new.
    b.put("k", &v).await.expect("dedup put");
    let total: usize = [&a, &b].iter().map(|n| n.medium().expect("m").owned_key_count()).sum();
    assert_eq!(total, 1);

    // Bad input gets a clear error per key and never disturbs its neighbours.
    let results = a.batch_put(&[("", b"x"), ("empty", b""), ("fine", b"ok")]).await;
    assert_eq!(results[0], Err(KeyError::EmptyKey));
    assert_eq!(results[1], Err(KeyError::EmptyValue));
    assert_eq!(results[2], Ok(()));
    let huge = vec![0u8; 2 << 20];
    let too_large = a.put("huge", &huge).await;
    assert!(matches!(too_large, Err(KeyError::TooLarge { size, .. }) if size == 2 << 20), "{too_large:?}");
    assert!(too_large.as_ref().err().is_some_and(|e| !e.is_retryable()));
    let mut small = vec![0u8; 10];
    assert_eq!(b.get("k", &mut small).await, Err(KeyError::BufferTooSmall { needed: 5000, got: 10 }));
    let mut buf = vec![0u8; 5000];
    assert_eq!(b.get("missing", &mut buf).await, Err(KeyError::Miss));
    assert_eq!(b.get("", &mut buf).await, Err(KeyError::EmptyKey));

    // Remove drops every replica the pool knows of. The reads above took a read lease on the holder
    // and released it when they were done (the copy, or the buffer check, was over), so nothing
    // protects the key any more: the remove frees it at once.
    let freed = b.remove(&["k"]).await.expect("remove");
    assert_eq!(freed, vec![5000], "a key whose readers are done is not held");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while a.exists("k").await.expect("exists") {
        assert!(tokio::time::Instant::now() < deadline, "removed key still indexed");
        a.flush();
        b.flush();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(b.get("k", &mut buf).await, Err(KeyError::Miss));

    // Clear: the node's keys are gone at once, from its medium and from the master's index; the
    // other node's keys stay; writes reopen after the master's ack. The master places each key on
    // the roomier node, so keys are written until both nodes hold some.
    let (mut on_a, mut on_b) = (Vec::new(), Vec::new());
    for n in 0..16 {
        if !on_a.is_empty() && !on_b.is_empty() {
            break;
        }
        let key = format!("c-{n}");
        a.put(&key, &v).await.expect("put");
        let keys = std::slice::from_ref(&key);
        match (a.medium().expect("m").batch_contains(keys)[0], b.medium().expect("m").batch_contains(keys)[0]) {
            (true, false) => on_a.push(key),
            (false, true) => on_b.push(key),
            other => panic!("{key} is stored once: {other:?}"),
        }
    }
    assert!(!on_a.is_empty() && !on_b.is_empty(), "keys on both nodes: a {on_a:?}, b {on_b:?}");
    a.flush();
    b.flush();
    indexed(&a, &on_a.iter().chain(&on_b).collect::<Vec<_>>()).await;
    a.clear().await.expect("clear");
    assert_eq!(a.medium().expect("m").owned_key_count(), 0, "the cleared node holds nothing");
    for key in &on_a {
        assert!(!a.exists(key).await.expect("exists"), "{key} is still indexed after the clear");
        assert_eq!(b.get(key, &mut buf).await, Err(KeyError::Miss), "{key}");
    }
    for key in &on_b {
        assert_eq!(a.get(key, &mut buf).await, Ok(v.len() as u64), "{key} on the other node stays");
        assert_eq!(buf, v);
    }
    a.put("c-after", &v).await.expect("writes reopen after the clear");
    a.close().await;
    b.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_node_is_excluded_and_the_put_reroutes() {
    let m = master().await;
    // "full" advertises the most room, but its pages are all reserved (pending slots the master cannot
    // see until the next heartbeat): every put routed there gets FailedNoSpace and must re-route.
    let full = node(&m, "full", 2 << 20).await;
    let other = node(&m, "other", 1 << 20).await;
    let medium = full.medium().expect("medium");
    let hog: Vec<umbp_core::AllocateRequest> =
        (0..512).map(|i| umbp_core::AllocateRequest::new(format!("hog-{i}"), PAGE)).collect();
    assert!(medium.batch_allocate(&hog).iter().all(|a| a.outcome == umbp_core::AllocateOutcome::Allocated));
    let writer = PoolClient::start(PoolClientConfig::new("writer", m.local_addr().to_string())).await.expect("client");
    let values: Vec<Vec<u8>> = (0..20).map(|i| value(i, PAGE as usize)).collect();
    let keys: Vec<String> = (0..20).map(|i| format!("r-{i}")).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    for r in writer.batch_put(&items).await {
        r.expect("every key lands after a re-route");
    }
    assert_eq!(full.medium().expect("m").owned_key_count(), 0, "nothing fit on the full node");
    assert_eq!(other.medium().expect("m").owned_key_count(), 20, "every key re-routed to the other node");
    // The keys first went to the full node (it advertises the most room) and came back: re-routed.
    assert!(writer.stats().reroutes > 0, "a re-route happened: {:?}", writer.stats());
    writer.close().await;
    full.close().await;
    other.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_pressure_eviction_keeps_puts_succeeding_and_gets_are_exact_or_miss() {
    let m = umbp_master::start(MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        heartbeat_ttl: Duration::from_millis(400),
        heartbeat_interval_divisor: 4,
        eviction: umbp_master::routing::EvictionConfig {
            check_interval: Duration::from_millis(100),
            lease_duration: Duration::from_millis(50),
            ..umbp_master::routing::EvictionConfig::default()
        },
        ..MasterConfig::default()
    })
    .await
    .expect("master");
    // Three nodes of 64 pages each: 192 pages in the pool; the workload writes 3x that.
    let nodes = [node(&m, "p1", 64 * PAGE).await, node(&m, "p2", 64 * PAGE).await, node(&m, "p3", 64 * PAGE).await];
    let total = 3 * 192;
    let keys: Vec<String> = (0..total).map(|i| format!("pressure-{i:04}")).collect();
    let values: Vec<Vec<u8>> = (0..total).map(|i| value(i, PAGE as usize - (i % 7) * 13)).collect();
    let mut retries = 0;
    for chunk in (0..total).collect::<Vec<_>>().chunks(16) {
        let writer = &nodes[chunk[0] % 3];
        let mut pending: Vec<usize> = chunk.to_vec();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !pending.is_empty() {
            let items: Vec<(&str, &[u8])> =
                pending.iter().map(|i| (keys[*i].as_str(), values[*i].as_slice())).collect();
            let results = writer.batch_put(&items).await;
            let failed: Vec<usize> =
                pending.iter().zip(&results).filter(|(_, r)| r.is_err()).map(|(i, _)| *i).collect();
            if failed.is_empty() {
                break;
            }
            // The pool is full until the master's next eviction round frees room.
            assert!(tokio::time::Instant::now() < deadline, "eviction never made room: {:?}", results);
            retries += 1;
            pending = failed;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        writer.flush();
    }
    // The workload overflowed the pool, so eviction ran: on demand for the puts that found no room,
    // or in a background round, whichever came first.
    let stats = m.stats();
    assert!(stats.eviction_rounds + stats.on_demand_evictions > 0, "eviction never ran: {stats:?}");
    assert!(stats.evict_bytes_freed > 0, "eviction freed nothing: {stats:?}");
    // Every key reads back exactly or is a miss: never wrong bytes.
    let reader = &nodes[1];
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; PAGE as usize]; total];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let results = reader.batch_get(&key_refs, &mut slices).await;
    let mut hits = 0;
    for (i, r) in results.iter().enumerate() {
        match r {
            Ok(size) => {
                assert_eq!(*size as usize, values[i].len(), "size of {}", keys[i]);
                assert_eq!(&bufs[i][..values[i].len()], values[i].as_slice(), "bytes of {}", keys[i]);
                hits += 1;
            }
            Err(KeyError::Miss) => {}
            Err(e) => panic!("{}: {e}", keys[i]),
        }
    }
    assert!(hits > 0 && hits < total, "some keys survive, the oldest were evicted: {hits} hits, {retries} retries");
    for n in &nodes {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_remote_write_is_visible_to_other_nodes_long_before_the_heartbeat_interval() {
    // The default heartbeat interval is 5 s; the holder's peer service wakes its heartbeat on commit.
    let m = master().await;
    let holder = node(&m, "holder", 1 << 20).await;
    let writer = PoolClient::start(PoolClientConfig::new("writer", m.local_addr().to_string())).await.expect("writer");
    let reader = PoolClient::start(PoolClientConfig::new("reader", m.local_addr().to_string())).await.expect("reader");
    let v = value(3, 3000);
    let start = tokio::time::Instant::now();
    writer.put("fresh", &v).await.expect("put");
    let mut buf = vec![0u8; 3000];
    loop {
        match reader.get("fresh", &mut buf).await {
            Ok(3000) => break,
            Ok(other) => panic!("wrong size {other}"),
            Err(KeyError::Miss) => {}
            Err(e) => panic!("{e}"),
        }
        assert!(start.elapsed() < Duration::from_secs(2), "not visible within 2 s of the put");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(buf, v);
    for n in [&writer, &reader, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}
