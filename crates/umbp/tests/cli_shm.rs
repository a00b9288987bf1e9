//! The same-host shared-memory path with real processes: two `umbp node` processes and this test
//! process as a client on one host. Batch puts and gets are byte-exact through mappings of the
//! nodes' memory files with the client's TCP engine moving no bytes; a holder SIGKILLed, or
//! stopped with SIGTERM (its regions deregistered while mapped), in the middle of a stream of batch
//! gets leaves the reader with hits that are the values and clean failures (never a `SIGBUS`,
//! never a hang); nodes started with the path off (flag or variable) get every byte over TCP.

use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

const SHM: &str = "SharedMemoryEngine";
const TCP: &str = "TcpEngine";

fn start_master(dir: &TempDir) -> (Proc, String) {
    let (master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    (master, address)
}

fn start_node(dir: &TempDir, master: &str, id: &str, capacity: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut args =
        vec!["node", "--master", master, "--node-id", id, "--medium", "dram", "--capacity", capacity, "--prefault"];
    args.extend(["false", "--page-size", "64KiB"]);
    args.extend(extra);
    let (node, _) = Proc::try_start(&dir.0, id, &args, env, &format!("node {id}")).unwrap_or_else(|e| panic!("{e}"));
    node
}

fn batch(prefix: &str, n: usize, len: usize) -> (Vec<String>, Vec<Vec<u8>>) {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let values = keys.iter().map(|k| value(k, len)).collect();
    (keys, values)
}

async fn put_all(client: &PoolClient, keys: &[String], values: &[Vec<u8>]) {
    let pairs: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for (k, r) in keys.iter().zip(client.batch_put(&pairs).await) {
        r.unwrap_or_else(|e| panic!("put {k}: {e}"));
    }
}

/// Gets every key in one batch: the results and the buffers.
async fn get_all(client: &PoolClient, keys: &[String], len: usize) -> (Vec<Result<u64, String>>, Vec<Vec<u8>>) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let got = client.batch_get(&refs, &mut slices).await;
    (got.into_iter().map(|r| r.map_err(|e| e.to_string())).collect(), bufs)
}

/// Waits (at most 10 s) until the master indexes every key.
async fn indexed(client: &PoolClient, keys: &[String]) {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !client.batch_exists(&refs).await.expect("exists").iter().all(|f| *f) {
        assert!(Instant::now() < deadline, "keys never indexed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_with_two_node_processes_go_through_shared_memory() {
    let dir = TempDir::new("shm-batches");
    let (_master, address) = start_master(&dir);
    let _n1 = start_node(&dir, &address, "n1", "64MiB", &[], &[]);
    let _n2 = start_node(&dir, &address, "n2", "64MiB", &[], &[]);
    let client = PoolClient::start(PoolClientConfig::new("client", address.clone())).await.expect("client");

    let len = 256 << 10;
    let (keys, values) = batch("shm", 64, len);
    put_all(&client, &keys, &values).await;
    indexed(&client, &keys).await;
    let (got, bufs) = get_all(&client, &keys, len).await;
    for ((k, r), (buf, v)) in keys.iter().zip(got).zip(bufs.iter().zip(&values)) {
        assert_eq!(r, Ok(len as u64), "{k}");
        assert!(buf == v, "{k} byte-exact");
    }
    let total = (keys.len() * len) as u64;
    assert_eq!(client.transferred_bytes(TCP), 0, "the TCP engine moved no bytes");
    assert_eq!(client.transferred_bytes(SHM), 2 * total, "every put and get byte went through a mapping");
    // Single keys too: a keyed get and a keyed put (large enough for the shared put) are copied
    // through the same mappings, counted as shared-memory bytes, and the TCP engine moves none.
    let mut one = vec![0u8; len];
    assert_eq!(client.get(&keys[0], &mut one).await.expect("single get"), len as u64);
    assert!(one == values[0], "single get byte-exact");
    client.put("shm-single", &value("shm-single", len)).await.expect("single put");
    let stats = client.stats();
    // The batches were keyed too (one GET_KEYS or PUT_KEYS per holder chunk), then one each.
    let batched = keys.len() as u64;
    assert_eq!(
        (stats.keyed_gets, stats.keyed_puts),
        (batched + 1, batched + 1),
        "the batches and both single calls took the keyed path"
    );
    assert_eq!(client.transferred_bytes(TCP), 0, "the TCP engine moved no bytes for single keys either");
    assert_eq!(client.transferred_bytes(SHM), 2 * total + 2 * len as u64, "single-key bytes counted");
    // Both nodes hold some keys (the master spreads the batch), so both servers were used.
    let status = client.master().cluster_status().await.expect("status");
    assert_eq!(status.nodes.len(), 2, "{status:?}");
    client.close().await;
}

/// How a holder is stopped in the middle of a stream of batch gets.
#[derive(Clone, Copy, Debug)]
enum Stop {
    /// SIGKILL: its regions stay registered in its epoch table forever; the hung-up connection and
    /// the failing resolves end the reads.
    Kill,
    /// SIGTERM: the node closes, deregistering every region while the reader has it mapped (the
    /// epochs go to 0 under the reader's copies).
    Term,
}

/// Batch gets back to back from a holder process, which is stopped by `stop` meanwhile: every hit
/// is the value, the failures are clean (no `SIGBUS`, no hang, no panic) and the reader works
/// afterwards.
async fn stream_of_gets_while_the_holder_stops(name: &str, stop: Stop) {
    let dir = TempDir::new(name);
    let (_master, address) = start_master(&dir);
    let mut holder = start_node(&dir, &address, "holder", "192MiB", &[], &[]);
    let client = Arc::new(PoolClient::start(PoolClientConfig::new("reader", address.clone())).await.expect("client"));
    let len = 1 << 20;
    let (keys, values) = batch("stop", 128, len);
    put_all(&client, &keys, &values).await;
    indexed(&client, &keys).await;

    let reader = {
        let (client, keys, values) = (Arc::clone(&client), keys.clone(), values.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let mut rounds = 0;
            loop {
                let (got, bufs) = get_all(&client, &keys, len).await;
                rounds += 1;
                let mut failed = 0;
                for ((k, r), (buf, v)) in keys.iter().zip(got).zip(bufs.iter().zip(&values)) {
                    match r {
                        Ok(n) => {
                            assert_eq!(n, len as u64, "{k}");
                            assert!(buf == v, "{k}: a hit returned bytes other than the value");
                        }
                        Err(_) => failed += 1,
                    }
                }
                if failed > 0 || started.elapsed() > Duration::from_secs(20) {
                    return (rounds, failed);
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    match stop {
        Stop::Kill => holder.kill9(),
        Stop::Term => {
            let status = std::process::Command::new("kill")
                .args(["-TERM", &holder.child.id().to_string()])
                .status()
                .expect("kill runs");
            assert!(status.success());
        }
    }
    let (rounds, failed) =
        tokio::time::timeout(Duration::from_secs(60), reader).await.expect("no hang").expect("no panic, no SIGBUS");
    assert!(failed > 0, "the holder stopped ({stop:?}), yet {rounds} rounds all hit");
    eprintln!("{stop:?}: {rounds} rounds of batch gets; the last failed {failed} of {} keys cleanly", keys.len());
    assert!(client.transferred_bytes(SHM) > 0);

    // The reader still works, promptly: the keys are gone with their holder.
    let started = Instant::now();
    let mut small = vec![0u8; 16];
    assert!(client.get(&keys[0], &mut small).await.is_err());
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_mid_batch_is_a_clean_failure() {
    stream_of_gets_while_the_holder_stops("shm-kill", Stop::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_deregistering_its_mapped_regions_is_a_clean_failure() {
    stream_of_gets_while_the_holder_stops("shm-term", Stop::Term).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_with_the_path_off_move_every_byte_over_tcp() {
    let dir = TempDir::new("shm-off");
    let (_master, address) = start_master(&dir);
    let _n1 = start_node(&dir, &address, "n1", "64MiB", &["--shared-memory", "false"], &[]);
    let _n2 = start_node(&dir, &address, "n2", "64MiB", &[], &[("UMBP_SHARED_MEMORY", "false")]);
    let client = PoolClient::start(PoolClientConfig::new("client", address.clone())).await.expect("client");
    let len = 128 << 10;
    let (keys, values) = batch("off", 32, len);
    put_all(&client, &keys, &values).await;
    indexed(&client, &keys).await;
    let (got, bufs) = get_all(&client, &keys, len).await;
    for ((k, r), (buf, v)) in keys.iter().zip(got).zip(bufs.iter().zip(&values)) {
        assert_eq!(r, Ok(len as u64), "{k}");
        assert!(buf == v, "{k} byte-exact");
    }
    assert_eq!(client.transferred_bytes(SHM), 0, "neither node serves its memory");
    assert_eq!(client.transferred_bytes(TCP), 2 * (keys.len() * len) as u64);
    client.close().await;
}
