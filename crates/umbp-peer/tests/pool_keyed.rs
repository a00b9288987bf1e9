//! The single-key hot path (`fast.rs`): a client that lends no medium puts and gets one key in one
//! keyed exchange with the holder's data server, and every way that can go stale falls back to the
//! routed path without wrong bytes — a cached location whose key was removed and written again, a
//! holder that evicted the key, a holder that went away, a holder whose read lease ends before its
//! send does. (A holder killed mid-read, as a process: `crates/umbp/tests/cli_keyed_kill.rs`; a send
//! slowed past its lease by a reader that stops reading: `umbp-transfer`'s `tcp_keyed.rs`.)

mod pool_support;

use std::time::Duration;

use pool_support::{PAGE, config, indexed, master, value};
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig, PutOutcome};

fn light(m: &umbp_master::MasterHandle, id: &str) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, m.local_addr().to_string());
    c.bounce_bytes = 1 << 20;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_light_client_puts_and_gets_one_key_in_one_exchange_each() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let c = PoolClient::start(light(&m, "c")).await.expect("client");
    let v = value(1, 3 * PAGE as usize + 17);
    assert_eq!(c.put_outcome("k", &v).await, Ok(PutOutcome::Written));
    assert_eq!(c.stats().keyed_puts, 1, "written by one keyed exchange");
    assert_eq!(holder.medium().expect("medium").owned_key_count(), 1);
    // Read back from the location the put left: no route call, one exchange.
    let mut buf = vec![0u8; v.len() + 100];
    assert_eq!(c.get("k", &mut buf).await, Ok(v.len() as u64));
    assert_eq!(&buf[..v.len()], v.as_slice());
    // A second client, with no location: a route, then one exchange.
    indexed(&holder, &["k"]).await;
    let c2 = PoolClient::start(light(&m, "c2")).await.expect("client");
    buf.fill(0);
    assert_eq!(c2.get("k", &mut buf).await, Ok(v.len() as u64));
    assert_eq!(&buf[..v.len()], v.as_slice());
    assert_eq!((c.stats().keyed_gets, c2.stats().keyed_gets), (1, 1));
    // A buffer too small is the same error as on the routed path; a second put keeps the value.
    assert_eq!(c.get("k", &mut buf[..10]).await, Err(KeyError::BufferTooSmall { needed: v.len() as u64, got: 10 }));
    assert_eq!(c2.put_outcome("k", &value(2, 100)).await, Ok(PutOutcome::AlreadyPresent));
    assert_eq!(c.get("nope", &mut buf).await, Err(KeyError::Miss));
    for n in [&c, &c2, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stale_location_never_returns_the_old_bytes() {
    let m = master().await;
    let a = PoolClient::start(config(&m, "a", 256 * PAGE)).await.expect("a");
    let b = PoolClient::start(config(&m, "b", 256 * PAGE)).await.expect("b");
    let c = PoolClient::start(light(&m, "c")).await.expect("client");
    let other = PoolClient::start(light(&m, "other")).await.expect("client");
    let (v1, v2) = (value(3, 5000), value(4, 7000));
    c.put("k", &v1).await.expect("put");
    let mut buf = vec![0u8; 8192];
    assert_eq!(c.get("k", &mut buf).await, Ok(5000), "cached location");
    // Another client removes the key and writes it again (on whichever node the master picks).
    for n in [&a, &b] {
        n.flush();
    }
    indexed(&other, &["k"]).await;
    other.remove(&["k"]).await.expect("remove");
    other.put("k", &v2).await.expect("put again");
    for n in [&a, &b] {
        n.flush();
    }
    indexed(&other, &["k"]).await;
    // `c` still has the old location: the holder resolves the key itself, so it answers the new
    // value or a miss (then `c` routes) — never the removed bytes.
    buf.fill(0);
    assert_eq!(c.get("k", &mut buf).await, Ok(7000));
    assert_eq!(&buf[..7000], v2.as_slice());
    for n in [&c, &other, &a, &b] {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_evicted_the_key_makes_it_a_miss() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let c = PoolClient::start(light(&m, "c")).await.expect("client");
    c.put("k", &value(5, 9000)).await.expect("put");
    let evicted = holder.medium().expect("medium").evict(&["k".to_owned()]);
    assert!(evicted[0].bytes_freed > 0, "{evicted:?}");
    let mut buf = vec![0u8; 9000];
    assert_eq!(c.get("k", &mut buf).await, Err(KeyError::Miss));
    assert_eq!(c.stats().keyed_gets, 0);
    c.close().await;
    holder.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_that_went_away_makes_its_keys_misses_not_hangs() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let c = PoolClient::start(light(&m, "c")).await.expect("client");
    c.put("k", &value(6, 4096)).await.expect("put");
    holder.close().await;
    let mut buf = vec![0u8; 4096];
    let started = std::time::Instant::now();
    let r = c.get("k", &mut buf).await;
    assert!(matches!(r, Err(KeyError::Miss)), "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    c.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_send_outliving_the_holders_read_lease_is_discarded_then_read_again() {
    let m = master().await;
    // The holder's leases end at once: every keyed send it makes is marked lapsed.
    let mut hc = config(&m, "holder", 256 * PAGE);
    hc.read_lease = Duration::from_nanos(1);
    let holder = PoolClient::start(hc).await.expect("holder");
    let c = PoolClient::start(light(&m, "c")).await.expect("client");
    let v = value(7, 3 * PAGE as usize);
    c.put("k", &v).await.expect("put");
    holder.flush();
    indexed(&c, &["k"]).await;
    let mut buf = vec![0u8; v.len()];
    // The keyed read is discarded (counted); the routed path reads again (nobody reused the pages,
    // and the client's own lease rule is met), so the bytes are right.
    assert_eq!(c.get("k", &mut buf).await, Ok(v.len() as u64));
    assert_eq!(buf, v);
    assert_eq!(c.stats().keyed_gets, 0, "never a keyed hit");
    assert!(c.stats().lease_lapses >= 1);
    c.close().await;
    holder.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keyed_requests_off_routes_every_call() {
    let m = master().await;
    let mut hc = config(&m, "holder", 256 * PAGE);
    hc.keyed_requests = false;
    let holder = PoolClient::start(hc).await.expect("holder");
    let c = PoolClient::start(light(&m, "c")).await.expect("client");
    let v = value(8, 5000);
    // The client tries a keyed put; the holder answers unsupported, so the routed path writes it.
    c.put("k", &v).await.expect("put");
    holder.flush();
    indexed(&c, &["k"]).await;
    let mut buf = vec![0u8; 5000];
    assert_eq!(c.get("k", &mut buf).await, Ok(5000));
    assert_eq!(buf, v);
    assert_eq!((c.stats().keyed_puts, c.stats().keyed_gets), (0, 0));
    let mut off = light(&m, "off");
    off.keyed_requests = false;
    let off = PoolClient::start(off).await.expect("client");
    off.put("k2", &v).await.expect("put");
    assert_eq!(off.get("k", &mut buf).await, Ok(5000));
    assert_eq!((off.stats().keyed_puts, off.stats().keyed_gets), (0, 0));
    for n in [&c, &off, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_remembers_where_it_read_a_remote_key_unless_it_recaches_it() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let v = value(9, 6000);
    holder.put("k", &v).await.expect("put");
    holder.flush();
    indexed(&holder, &["k"]).await;
    // A node with a medium and no re-caching: the first get is routed (its own medium first), the
    // second one keyed, to the holder it found.
    let reader = PoolClient::start(config(&m, "reader", 256 * PAGE)).await.expect("reader");
    let mut buf = vec![0u8; 6000];
    assert_eq!(reader.get("k", &mut buf).await, Ok(6000));
    assert_eq!(reader.stats().keyed_gets, 0);
    buf.fill(0);
    assert_eq!(reader.get("k", &mut buf).await, Ok(6000));
    assert_eq!(buf, v);
    assert_eq!(reader.stats().keyed_gets, 1);
    // A node that re-caches what it fetches reads it locally next time, never from the holder.
    let mut rc = config(&m, "recacher", 256 * PAGE);
    rc.recache = umbp_peer::pool_client::RecachePolicy::Always;
    let recacher = PoolClient::start(rc).await.expect("recacher");
    assert_eq!(recacher.get("k", &mut buf).await, Ok(6000));
    assert_eq!(recacher.get("k", &mut buf).await, Ok(6000));
    assert_eq!(buf, v);
    assert_eq!(recacher.stats().keyed_gets, 0);
    for n in [&reader, &recacher, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}
