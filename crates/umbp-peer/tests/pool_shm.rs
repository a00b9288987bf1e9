//! The same-host shared-memory path through `PoolClient`: batches between nodes of one host move
//! their bytes through mappings of the holders' memory files (the TCP engine moves none), byte-exact
//! both ways; with `shared_memory` off on either side every byte goes over TCP; a holder that closes
//! leaves readers with clean misses.

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};
use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

const SHM: &str = "SharedMemoryEngine";
const TCP: &str = "TcpEngine";

fn make_keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

fn make_values(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| value(i, if i % 3 == 0 { 64 << 10 } else { 2 * PAGE as usize + 17 * i })).collect()
}

async fn put_all(client: &PoolClient, keys: &[String], values: &[Vec<u8>]) {
    let pairs: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for (k, r) in keys.iter().zip(client.batch_put(&pairs).await) {
        r.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
}

async fn get_all(client: &PoolClient, keys: &[String], values: &[Vec<u8>]) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = client.batch_get(&refs, &mut slices).await;
    for ((k, r), (buf, v)) in keys.iter().zip(got).zip(bufs.iter().zip(values)) {
        assert_eq!(r, Ok(v.len() as u64), "{k}");
        assert!(buf == v, "{k} byte-exact");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_between_nodes_of_one_host_take_the_shared_path() {
    let m = master().await;
    let a = PoolClient::start(config(&m, "a", 8 << 20)).await.expect("node a");
    let b = PoolClient::start(config(&m, "b", 8 << 20)).await.expect("node b");
    let light = PoolClient::start(PoolClientConfig::new("light", m.local_addr().to_string())).await.expect("client");

    let (keys, values) = (make_keys("shm", 24), make_values(24));
    put_all(&light, &keys, &values).await;
    indexed(&light, &keys).await;
    // The batch put was routed once and written to each holder in one exchange per chunk
    // (PUT_KEYS), which also told the client where each key lies.
    assert_eq!(light.stats().keyed_puts, 24, "every key written in a batched same-host exchange");
    let put_bytes = light.transferred_bytes(SHM);
    get_all(&light, &keys, &values).await;
    let total: u64 = values.iter().map(|v| v.len() as u64).sum();
    assert_eq!(light.transferred_bytes(TCP), 0, "the TCP engine moved no bytes");
    assert!(light.transferred_bytes(SHM) >= 2 * total, "puts and gets through the mappings");
    // The batch get asked each holder once per chunk (GET_KEYS) instead of resolving over RPC and
    // copying on the engine: every key was a keyed read, each byte copied once.
    assert_eq!(light.stats().keyed_gets, 24, "every key read in a batched same-host exchange");
    assert_eq!(light.transferred_bytes(SHM), put_bytes + total, "each value copied once, from the mapping");

    // A node reading keys the other holds: its own keys are in-process copies, the rest shared.
    // The first batch takes the routed path (a node looks at its own medium first) and remembers
    // where it found the other's keys; the second reads those in batched exchanges.
    get_all(&a, &keys, &values).await;
    get_all(&b, &keys, &values).await;
    assert_eq!((a.transferred_bytes(TCP), b.transferred_bytes(TCP)), (0, 0));
    assert!(a.transferred_bytes(SHM) > 0 && b.transferred_bytes(SHM) > 0, "both nodes hold some keys");
    let remembered = a.stats().keyed_gets;
    get_all(&a, &keys, &values).await;
    let batched = a.stats().keyed_gets - remembered;
    assert!(batched > 0 && batched < 24, "a's second batch read b's keys ({batched}) in batched exchanges");
    assert_eq!(a.transferred_bytes(TCP), 0);

    // A holder that closes deregisters its regions: readers get misses or errors, never wrong bytes.
    b.close().await;
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = light.batch_get(&refs, &mut slices).await;
    for ((k, r), (buf, v)) in keys.iter().zip(got).zip(bufs.iter().zip(&values)) {
        if r.is_ok() {
            assert!(buf == v, "{k}: a hit is byte-exact");
        }
    }
    light.close().await;
    a.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_path_off_on_either_side_tcp_moves_the_bytes() {
    let m = master().await;
    // The holder without the path (no memory files, no socket), a reader with it.
    let mut off = config(&m, "off", 8 << 20);
    off.shared_memory = false;
    let holder = PoolClient::start(off).await.expect("node");
    let reader = PoolClient::start(PoolClientConfig::new("on", m.local_addr().to_string())).await.expect("client");
    let (keys, values) = (make_keys("tcp", 12), make_values(12));
    put_all(&reader, &keys, &values).await;
    indexed(&reader, &keys).await;
    get_all(&reader, &keys, &values).await;
    assert_eq!(reader.transferred_bytes(SHM), 0);
    assert!(reader.transferred_bytes(TCP) > 0);

    // A reader without the path, a holder with it.
    let shared = PoolClient::start(config(&m, "shared", 8 << 20)).await.expect("node");
    let mut no_path = PoolClientConfig::new("no-path", m.local_addr().to_string());
    no_path.shared_memory = false;
    let plain = PoolClient::start(no_path).await.expect("client");
    let (keys, values) = (make_keys("plain", 12), make_values(12));
    put_all(&plain, &keys, &values).await;
    indexed(&plain, &keys).await;
    get_all(&plain, &keys, &values).await;
    assert_eq!(plain.transferred_bytes(SHM), 0);
    assert!(plain.transferred_bytes(TCP) > 0);
    for c in [&reader, &plain, &holder, &shared] {
        c.close().await;
    }
}
