//! What only the Redis store has: scripts re-loaded after Redis forgot them, prompt retryable errors
//! while Redis is unreachable and recovery when it is back, the key layout under one hash tag, and
//! stores isolated by prefix and database. Every test starts its own `redis-server`.

mod store_support;

use std::time::{Duration, Instant};

use store_support::*;
use umbp_core::ErrorKind;
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

/// CI must not pass with the Redis subject silently skipped: no `redis-server`, a failed test that
/// says what to install.
#[test]
#[should_panic(expected = "install Debian's redis-server")]
fn a_missing_redis_server_fails_the_redis_subject() {
    let _ = RedisServer::start_binary("/nonexistent/redis-server", 1);
}
