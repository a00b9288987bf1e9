//! A holder killed with SIGKILL in the middle of a keyed get (one exchange with its data server,
//! `umbp_peer`'s `pool_client/fast.rs`): the reader gets an error or a miss — never bytes other
//! than the value's, never a hang — and keeps working afterwards.

use std::time::{Duration, Instant};

use umbp_peer::pool_client::{PoolClient, PoolClientConfig};

mod cli_support;

use cli_support::{Proc, TempDir, field, value};

/// Large enough that sending it over loopback takes far longer than the delay before the kill.
const VALUE: usize = 256 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_mid_read_is_a_clean_failure() {
    let dir = TempDir::new("keyed-kill");
    let (_master, line) = Proc::try_start(&dir.0, "master", &["master", "--listen", "127.0.0.1:0"], &[], "master")
        .unwrap_or_else(|e| panic!("{e}"));
    let address = field(&line, "listen").to_owned();
    let node_args = [
        "node",
        "--master",
        &address,
        "--node-id",
        "holder",
        "--medium",
        "dram",
        "--capacity",
        "320MiB",
        "--prefault",
        "false",
    ];
    let (mut holder, _) =
        Proc::try_start(&dir.0, "holder", &node_args, &[], "node holder").unwrap_or_else(|e| panic!("{e}"));
    let client = PoolClient::start(PoolClientConfig::new("reader", address.clone())).await.expect("client");
    let v = value("big", VALUE);
    client.put("big", &v).await.expect("put");
    // The put left the holder's location: the get is one keyed exchange, started at once.
    let reader = std::sync::Arc::new(client);
    let getter = {
        let reader = std::sync::Arc::clone(&reader);
        tokio::spawn(async move {
            let mut buf = vec![0u8; VALUE];
            let started = Instant::now();
            let r = reader.get("big", &mut buf).await;
            (r, buf, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    holder.kill9();
    let (r, buf, took) = tokio::time::timeout(Duration::from_secs(30), getter).await.expect("no hang").expect("task");
    match r {
        Ok(n) => {
            // The whole value crossed before the kill: then it must be the value.
            assert_eq!(n as usize, VALUE);
            assert!(buf == v, "a hit returned bytes other than the value");
            eprintln!("note: the read finished before the kill ({took:?})");
        }
        Err(e) => eprintln!("the read failed cleanly after {took:?}: {e}"),
    }
    // The reader still works: the key is gone with its holder (an error or a miss, promptly).
    let mut small = vec![0u8; 16];
    let started = Instant::now();
    let again = reader.get("big", &mut small).await;
    assert!(again.is_err(), "{again:?}");
    assert!(started.elapsed() < Duration::from_secs(15), "{:?}", started.elapsed());
    reader.close().await;
}
