//! What only the Redis store has: scripts re-loaded after Redis forgot them, prompt retryable errors
//! while Redis is unreachable and recovery when it is back, the key layout under one hash tag, and
//! stores isolated by prefix and database. Every test starts its own `redis-server`.
//!
//! Also contract tests (run against every store) aimed at the Redis scripts' batching: a bundle's
//! runs of new keys created without reads, its reverse-index changes written once at its end.

#[macro_use]
#[path = "store_support/contract.rs"]
mod contract;
mod store_support;

use std::time::{Duration, Instant};

use store_support::*;
use umbp_core::{ErrorKind, KvEvent, TierType};
use umbp_master::store::{HeartbeatOutcome, MetadataStore, RedisStore, RedisTimeouts, StoreError};

fn raw(server: &RedisServer, db: u8) -> redis::Connection {
    redis::Client::open(server.url(db)).and_then(|c| c.get_connection()).expect("raw connection")
}

fn fast() -> RedisTimeouts {
    RedisTimeouts { connect: Duration::from_millis(500), io: Duration::from_millis(500) }
}

#[test]
fn scripts_are_loaded_again_after_redis_forgot_them() {
    let server = RedisServer::start();
    let store = server.store("umbp");
    register(&store, "a", 0);
    redis::cmd("SCRIPT").arg("FLUSH").query::<()>(&mut raw(&server, 0)).expect("SCRIPT FLUSH");
    // EVALSHA answers NOSCRIPT; the store loads the script again and the call succeeds.
    assert_eq!(delta(&store, "a", 1, 1, vec![add("k", 1)]), HeartbeatOutcome::Applied { acked_seq: 1 });
    assert_eq!(store.batch_lookup_for_route_get(&keys(&["k"]), &[], 2, 10).unwrap()[0].len(), 1);
}

#[test]
fn an_unreachable_redis_fails_promptly_with_a_retryable_error() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
        listener.local_addr().expect("addr").port()
    };
    let started = Instant::now();
    let err = RedisStore::connect_with(&format!("redis://127.0.0.1:{port}/0"), "umbp", fast()).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    assert!(err.is_retryable(), "{err}");
    assert_eq!(err.kind(), ErrorKind::Unavailable);
    assert!(err.to_string().contains("unreachable"), "{err}");

    let bad = RedisStore::connect_with("http://nope", "umbp", fast()).unwrap_err();
    assert!(!bad.is_retryable(), "{bad}");
    assert!(matches!(
        RedisStore::connect_with("redis://127.0.0.1/0", "", fast()),
        Err(StoreError::InvalidArgument { .. })
    ));
}

#[test]
fn a_store_recovers_when_its_redis_comes_back() {
    let server = RedisServer::start();
    let url = server.url(0);
    let port = server.port();
    let store = RedisStore::connect_with(&url, "umbp", fast()).expect("connect");
    register(&store, "a", 0);
    drop(server);
    // Every call fails at once, retryable, while Redis is down (pooled connections included).
    for _ in 0..3 {
        let started = Instant::now();
        let err = store.key_count().unwrap_err();
        assert!(err.is_retryable(), "{err}");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
        let err = store.register(registration("b"), 1, STALE).unwrap_err();
        assert!(err.is_retryable(), "{err}");
    }
    // A new Redis on the same port (the index is gone): the same store serves again.
    let _again = RedisServer::start_on(port);
    assert_eq!(store.key_count().unwrap(), 0);
    assert!(store.get_node("a").unwrap().is_none(), "a restarted Redis has an empty index");
    register(&store, "a", 10);
    assert_eq!(delta(&store, "a", 11, 1, vec![add("k", 1)]), HeartbeatOutcome::Applied { acked_seq: 1 });
}

#[test]
fn a_redis_restart_costs_no_call_an_error() {
    let server = RedisServer::start();
    let port = server.port();
    let store = std::sync::Arc::new(RedisStore::connect_with(&server.url(0), "umbp", fast()).expect("connect"));
    // Fill the pool with several idle connections (concurrent callers each take one).
    let callers: Vec<_> = (0..4)
        .map(|_| {
            let store = std::sync::Arc::clone(&store);
            std::thread::spawn(move || {
                for _ in 0..50 {
                    store.key_count().unwrap();
                }
            })
        })
        .collect();
    for c in callers {
        c.join().unwrap();
    }
    drop(server);
    let _again = RedisServer::start_on(port);
    // Every idle connection is dead; the first call finds out, drops them all and retries once on a
    // new connection: no caller sees the restart.
    for _ in 0..8 {
        assert_eq!(store.key_count().unwrap(), 0);
    }
    register(&*store, "a", 10);
}

#[test]
fn every_key_lives_under_the_store_hash_tag_and_stores_are_isolated() {
    let server = RedisServer::start();
    let (one, two) = (server.store("one"), server.store("two"));
    let other_db = RedisStore::connect_with(&server.url(1), "one", RedisTimeouts::default()).expect("db 1");
    for store in [&one, &two] {
        register(store, "a", 0);
    }
    assert_eq!(delta(&one, "a", 1, 1, vec![add("k", 1), add("k2", 2)]), HeartbeatOutcome::Applied { acked_seq: 1 });
    store_support::route_get_once(&one, "k");
    assert_eq!(two.key_count().unwrap(), 0);
    assert!(two.lookup("k").unwrap().is_empty());
    assert!(other_db.get_node("a").unwrap().is_none(), "database 1 is another index");
    let names: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut raw(&server, 0)).expect("KEYS");
    assert!(!names.is_empty());
    for name in &names {
        assert!(name.starts_with("{one}:") || name.starts_with("{two}:"), "{name}");
    }
    for expected in ["{one}:nodes", "{one}:n:a", "{one}:nk:a", "{one}:k:k", "{one}:k:k2", "{one}:keys"] {
        assert!(names.iter().any(|n| n == expected), "{expected} missing from {names:?}");
    }
    // Redis Cluster hashes only the first `{…}` of a name: even an index key with braces of its own
    // stays in the store's slot.
    register(&one, "b", 0);
    assert_eq!(delta(&one, "b", 1, 1, vec![add("{x}", 1)]).acked_seq(), Some(1));
    let names: Vec<String> = redis::cmd("KEYS").arg("{one}:*").query(&mut raw(&server, 0)).expect("KEYS");
    let tag = |name: &str| name.split_once('{').and_then(|(_, rest)| rest.split_once('}')).map(|(t, _)| t.to_owned());
    assert!(names.iter().any(|n| n == "{one}:k:{x}"), "{names:?}");
    assert!(names.iter().all(|n| tag(n).as_deref() == Some("one")), "{names:?}");
}

/// A Lua script that keeps Redis busy (serving nothing else) for ARGV[1] milliseconds.
const BUSY_LUA: &str = "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] \
     repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - s >= ARGV[1] * 1000 return 1";

/// A master handler may call the (synchronous) store straight from an async fn: while the call
/// waits on a busy Redis, the runtime's other tasks still run (the one worker is handed over).
#[test]
fn a_store_call_on_an_async_worker_leaves_the_runtime_running() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let server = RedisServer::start();
    let store = Arc::new(server.store("umbp"));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let mut con = raw(&server, 0);
    let busy = std::thread::spawn(move || redis::cmd("EVAL").arg(BUSY_LUA).arg(0).arg(800).query::<i64>(&mut con));
    std::thread::sleep(Duration::from_millis(100));
    runtime.block_on(async {
        let calling = Arc::new(AtomicBool::new(false));
        let call = tokio::spawn({
            let (store, calling) = (Arc::clone(&store), Arc::clone(&calling));
            async move {
                calling.store(true, Ordering::SeqCst);
                store.key_count()
            }
        });
        // Waits on this thread (block_on's, not a worker: it drives no timers).
        while !calling.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(50));
        let started = Instant::now();
        let ran_after = tokio::spawn(async move { started.elapsed() }).await.unwrap();
        assert!(ran_after < Duration::from_millis(300), "the runtime stalled {ran_after:?} behind a Redis call");
        assert_eq!(call.await.unwrap().unwrap(), 0);
    });
    assert_eq!(busy.join().unwrap().unwrap(), 1);
}

/// CI must not pass with the Redis subject silently skipped: no `redis-server`, a failed test that
/// says what to install.
#[test]
#[should_panic(expected = "install Debian's redis-server")]
fn a_missing_redis_server_fails_the_redis_subject() {
    let _ = RedisServer::start_binary("/nonexistent/redis-server", 1);
}

fn counts(store: &Subject) -> (u64, u64, u64) {
    let count = |node| store.node_key_count(node).expect("store call");
    (store.key_count().expect("store call"), count("a"), count("b"))
}

/// One delta with runs of new keys longer than a script's run, repeats inside a run, a second tier,
/// keys another node already holds, and keys removed and added back in the same bundle: every count
/// and stamp as if the events were applied one by one.
fn large_bundles_apply_as_their_events_in_order(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    register(&store, "b", 0);
    let shared: Vec<KvEvent> = (0..10).map(|i| add(&format!("s{i}"), 1)).collect();
    assert_eq!(delta(&store, "b", 5, 1, shared), HeartbeatOutcome::Applied { acked_seq: 1 });
    assert_eq!(route_get_once(&store, "s0").len(), 1);
    let before = store.key_stats("s0").expect("s0 indexed");

    let mut events: Vec<KvEvent> = (0..10).map(|i| add(&format!("n{i}"), i)).collect();
    events.push(add("n3", 100)); // a repeat inside a run of new keys
    events.push(KvEvent::add("n2", TierType::Hbm, 22)); // a second tier inside the run
    events.extend((10..70).map(|i| add(&format!("n{i}"), i)));
    events.push(KvEvent::add("n5", TierType::Hbm, 55));
    events.extend((0..10).map(|i| add(&format!("s{i}"), 2)));
    events.extend([rm("n7"), add("n7", 77), rm("n8"), add("n9", 99), add("n9", 98)]);
    events.extend([add("gone", 1), rm("gone"), add("back", 1), rm("back"), add("back", 3)]);
    assert_eq!(delta(&store, "a", 10, 1, events), HeartbeatOutcome::Applied { acked_seq: 1 });

    // a: n0..n69 but n8, s0..s9, back; b: s0..s9.
    assert_eq!(counts(&store), (70 - 1 + 10 + 1, 69 + 10 + 1, 10));
    assert_eq!(locs(&store, "n3"), vec![("a".to_owned(), TierType::Dram, 100)]);
    assert_eq!(locs(&store, "n2"), vec![("a".to_owned(), TierType::Hbm, 22), ("a".to_owned(), TierType::Dram, 2)]);
    assert_eq!(locs(&store, "n5"), vec![("a".to_owned(), TierType::Hbm, 55), ("a".to_owned(), TierType::Dram, 5)]);
    assert_eq!(locs(&store, "n7"), vec![("a".to_owned(), TierType::Dram, 77)]);
    assert_eq!(locs(&store, "n9"), vec![("a".to_owned(), TierType::Dram, 98)]);
    assert!(locs(&store, "n8").is_empty() && locs(&store, "gone").is_empty());
    assert_eq!(locs(&store, "back"), vec![("a".to_owned(), TierType::Dram, 3)]);
    assert_eq!(locs(&store, "s4"), vec![("a".to_owned(), TierType::Dram, 2), ("b".to_owned(), TierType::Dram, 1)]);
    assert_eq!(store.key_stats("s0"), Some(before), "a new replica leaves the stamps alone");
    let fresh = store.key_stats("n7").expect("n7 indexed");
    assert_eq!((fresh.lease_until_ms, fresh.last_accessed_ms, fresh.access_count), (0, 10, 0));

    // Every DRAM replica of a's n-keys goes (n2 stays on HBM), n5's HBM one too, then n5 (held on
    // two tiers before the bundle) and n10 come back: their entries are new, their counts in a's
    // reverse index are not.
    let mut removes: Vec<KvEvent> = (0..70).map(|i| rm(&format!("n{i}"))).collect();
    removes.extend([KvEvent::remove("n5", TierType::Hbm), add("n5", 505), add("n10", 1010)]);
    assert_eq!(delta(&store, "a", 20, 2, removes).acked_seq(), Some(2));
    assert_eq!(counts(&store), (10 + 1 + 1 + 1 + 1, 10 + 1 + 1 + 1 + 1, 10));
    assert_eq!(locs(&store, "n2"), vec![("a".to_owned(), TierType::Hbm, 22)]);
    assert_eq!(locs(&store, "n5"), vec![("a".to_owned(), TierType::Dram, 505)]);
    assert_eq!(locs(&store, "n10"), vec![("a".to_owned(), TierType::Dram, 1010)]);

    // A full sync in two chunks: new keys, a repeat, keys already there; the sweep drops the rest.
    let mut first: Vec<KvEvent> = (0..40).map(|i| add(&format!("m{i}"), i)).collect();
    first.extend([KvEvent::add("n5", TierType::Hbm, 56), add("s0", 4), add("m1", 11)]);
    assert_eq!(chunk(&store, "a", 30, 9, 0, false, first).acked_seq(), Some(2));
    let second: Vec<KvEvent> = (40..80).map(|i| add(&format!("m{i}"), i)).collect();
    assert_eq!(chunk(&store, "a", 31, 9, 1, true, second).acked_seq(), Some(9));
    // a: m0..m79, n5 (HBM), s0; b: s0..s9.
    assert_eq!(counts(&store), (80 + 1 + 10, 80 + 1 + 1, 10));
    assert_eq!(locs(&store, "m1"), vec![("a".to_owned(), TierType::Dram, 11)]);
    assert_eq!(locs(&store, "s0"), vec![("a".to_owned(), TierType::Dram, 4), ("b".to_owned(), TierType::Dram, 1)]);
    assert_eq!(locs(&store, "s1"), vec![("b".to_owned(), TierType::Dram, 1)]);
    assert!(locs(&store, "back").is_empty());
}

/// Route-gets of a batch with misses, repeats and excluded nodes stamp each found key once per
/// occurrence, never move the lease or the access time back, and hand back only the locations.
fn route_get_batches_stamp_each_found_key(kind: Kind) {
    let store = kind.one();
    register(&store, "a", 0);
    register(&store, "b", 0);
    assert_eq!(delta(&store, "a", 5, 1, vec![add("k", 1), add("j", 2)]).acked_seq(), Some(1));
    assert_eq!(delta(&store, "b", 5, 1, vec![add("k", 3)]).acked_seq(), Some(1));
    let batch = keys(&["k", "miss", "k", "j"]);
    let found = store.batch_lookup_for_route_get(&batch, &["b".to_owned()], 100, 50).expect("store call");
    let nodes: Vec<Vec<String>> = found.iter().map(|l| l.iter().map(|loc| loc.node_id.to_string()).collect()).collect();
    assert_eq!(nodes, vec![vec!["a".to_owned()], vec![], vec!["a".to_owned()], vec!["a".to_owned()]]);
    assert_eq!(found[0][0].size, 1);
    let k = store.key_stats("k").expect("k indexed");
    assert_eq!((k.lease_until_ms, k.last_accessed_ms, k.access_count), (150, 100, 2));
    // An older call (a slow master) moves neither stamp back; a batch with only excluded nodes
    // stamps nothing.
    store.batch_lookup_for_route_get(&keys(&["k"]), &[], 90, 5).expect("store call");
    let k = store.key_stats("k").expect("k indexed");
    assert_eq!((k.lease_until_ms, k.last_accessed_ms, k.access_count), (150, 100, 3));
    let none = store.batch_lookup_for_route_get(&keys(&["j"]), &["a".to_owned()], 200, 5).expect("store call");
    assert!(none[0].is_empty());
    let j = store.key_stats("j").expect("j indexed");
    assert_eq!((j.lease_until_ms, j.last_accessed_ms, j.access_count), (150, 100, 1));
    assert_eq!(store.key_stats("miss"), None);
}

contract!(large_bundles_apply_as_their_events_in_order, route_get_batches_stamp_each_found_key);
