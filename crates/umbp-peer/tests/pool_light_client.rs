//! The light client: a `PoolClient` that lends no medium opens no listening socket (no data server,
//! no peer service), never registers with the master (no heartbeat, nothing to unregister) and
//! still puts, gets, checks and removes keys on a DRAM node; one that opts in
//! (`register_client`) or serves `/metrics` is registered and listed as a client.
//!
//! One test in this binary: it counts the listening sockets of the whole process.

mod pool_support;

use std::collections::HashSet;

use pool_support::{PAGE, config, indexed, master, value};
use umbp_peer::master_client::NodeRole;
use umbp_peer::pool_client::{Medium, PoolClient, PoolClientConfig};

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

/// The ids the master lists, and the role of `id` if listed.
async fn listed(by: &PoolClient, id: &str) -> (Vec<String>, Option<NodeRole>) {
    let status = by.master().cluster_status().await.expect("cluster status");
    let role = status.nodes.iter().find(|n| n.node_id == id).map(|n| n.role);
    (status.nodes.into_iter().map(|n| n.node_id).collect(), role)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_medium_is_light_and_one_that_asks_is_listed() {
    let m = master().await;
    let n1 = PoolClient::start(config(&m, "n1", 4 << 20)).await.expect("dram node");
    assert!(!n1.data_endpoint().is_empty(), "a node that lends a medium serves data");

    // The light client: no listener, no endpoint, no record at the master.
    let before = own_listeners();
    let light = PoolClient::start(PoolClientConfig::new("light", m.local_addr().to_string())).await.expect("starts");
    assert_eq!(own_listeners(), before, "a medium-less client opens no listening socket");
    assert_eq!(light.data_endpoint(), "", "it serves no data");
    assert!(light.peer_address().is_none(), "and no peer service");
    let (ids, _) = listed(&n1, "light").await;
    assert_eq!(ids, ["n1"], "the master never heard of the light client");
    let stats = light.master().stats();
    assert_eq!((stats.registrations, stats.heartbeats_sent), (0, 0), "no registration, no heartbeat");

    // It reads and writes the pool: route put, route get, lookup, remove, clear.
    let keys: Vec<String> = (0..6).map(|i| format!("light-{i}")).collect();
    let values: Vec<Vec<u8>> =
        (0..6).map(|i| value(i, if i == 0 { 64 << 10 } else { 3 * PAGE as usize + i })).collect();
    let pairs: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for r in light.batch_put(&pairs).await {
        r.expect("put through a light client");
    }
    indexed(&light, &keys).await;
    for (k, v) in keys.iter().zip(&values) {
        let mut buf = vec![0u8; v.len() + 16];
        assert_eq!(light.get(k, &mut buf).await, Ok(v.len() as u64), "{k}");
        assert_eq!(&buf[..v.len()], v.as_slice(), "{k} byte-exact through the light client");
        let mut buf = vec![0u8; v.len()];
        assert_eq!(n1.get(k, &mut buf).await, Ok(v.len() as u64), "{k} is on the node");
        assert_eq!(&buf, v);
    }
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    assert_eq!(light.batch_exists(&key_refs).await.expect("exists"), vec![true; keys.len()]);
    assert!(!light.exists("never-written").await.expect("exists"));
    let freed = light.remove(&key_refs[..2]).await.expect("remove");
    assert!(freed.iter().all(|b| *b > 0), "removed through a light client: {freed:?}");
    let mut buf = vec![0u8; 64 << 10];
    assert!(light.get(&keys[0], &mut buf).await.is_err(), "a removed key is gone");
    light.clear().await.expect("clear of a node with nothing to clear");
    assert_eq!(light.master().stats().registrations, 0, "still never registered");
    light.close().await;
    let (ids, _) = listed(&n1, "light").await;
    assert_eq!(ids, ["n1"], "nothing to unregister, nothing left behind");

    // The opt-in: registered, listed as a client, still serving no data.
    let mut asked = PoolClientConfig::new("listed", m.local_addr().to_string());
    asked.register_client = true;
    assert!(asked.registers());
    let before = own_listeners();
    let listed_client = PoolClient::start(asked).await.expect("starts");
    assert_eq!(own_listeners(), before, "registering opens no port either");
    assert_eq!(listed_client.data_endpoint(), "");
    assert_eq!(listed(&n1, "listed").await.1, Some(NodeRole::Client), "an opted-in client is listed as a client");
    let mut buf = vec![0u8; values[2].len()];
    assert_eq!(listed_client.get(&keys[2], &mut buf).await, Ok(values[2].len() as u64));
    assert_eq!(buf, values[2]);
    listed_client.close().await;
    assert_eq!(listed(&n1, "listed").await.1, None, "and unregistered at close");

    // Serving /metrics registers too (an operator who scrapes it wants it listed).
    let mut scraped = PoolClientConfig::new("scraped", m.local_addr().to_string()).with_medium(Medium::None);
    scraped.metrics_listen = Some("127.0.0.1:0".parse().expect("addr"));
    assert!(scraped.registers());
    let scraped = PoolClient::start(scraped).await.expect("starts");
    assert_eq!(listed(&n1, "scraped").await.1, Some(NodeRole::Client));
    scraped.close().await;

    n1.close().await;
    m.shutdown().await;
}
