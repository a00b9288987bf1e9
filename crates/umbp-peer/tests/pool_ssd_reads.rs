//! An SSD node serves any number of reads: every read releases the staging page it copied from as
//! soon as its copy is done, and a read that finds every staging page in use waits the holder out
//! (busy) instead of reporting the key missing. The node has 16 staging pages and a 30 s read
//! lease, so only releases can give pages back during a test (before releases existed, the 17th
//! distinct read was `not found` and the next put found no room).

use std::path::PathBuf;
use std::time::Duration;

use umbp_master::MasterHandle;
use umbp_peer::pool_client::{Medium, PoolClient, SsdConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

const STAGING_PAGES: u64 = 16;

fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("umbp-pool-ssd-reads").tempdir_in(std::env::temp_dir()).expect("tempdir")
}

async fn ssd_node(master: &MasterHandle, dirs: Vec<PathBuf>) -> PoolClient {
    let ssd = SsdConfig {
        dirs,
        capacity_bytes: 32 << 20,
        staging_pages: STAGING_PAGES,
        // Far longer than any test: a page comes back only when its reader releases it.
        read_lease: Duration::from_secs(30),
        ..SsdConfig::default()
    };
    PoolClient::start(config(master, "ssd", 0).with_medium(Medium::Ssd(ssd))).await.expect("ssd node starts")
}

/// A client-only node, as one `umbp get` or `umbp put` process starts one.
async fn cli(master: &MasterHandle, id: &str) -> PoolClient {
    PoolClient::start(reader_config(master, id)).await.expect("client starts")
}

/// A client-only node's settings. It knows the node's read lease (the client drops a copy that
/// took longer than the lease it assumes): with the 500 ms default a copy slowed down by a loaded
/// machine came back `LeaseExpired`, though the node's lease had 30 s to run.
fn reader_config(master: &MasterHandle, id: &str) -> umbp_peer::pool_client::PoolClientConfig {
    let mut c = config(master, id, 0).with_medium(Medium::None);
    c.read_lease = Duration::from_secs(30);
    c
}

/// Value `i`: sub-page to a whole page (one staging page each).
fn val(i: usize) -> Vec<u8> {
    value(i, 512 + (i * 37) % (PAGE as usize - 512))
}

/// Puts `keys` in batches no larger than half the arena (a batch's slots hold staging pages until
/// they commit).
async fn put_all(writer: &PoolClient, keys: &[String]) {
    for (c, chunk) in keys.chunks(STAGING_PAGES as usize / 2).enumerate() {
        let values: Vec<Vec<u8>> = (0..chunk.len()).map(|j| val(c * (STAGING_PAGES as usize / 2) + j)).collect();
        let items: Vec<(&str, &[u8])> = chunk.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        for (k, r) in chunk.iter().zip(writer.batch_put(&items).await) {
            r.unwrap_or_else(|e| panic!("put {k}: {e}"));
        }
    }
    writer.flush();
}

async fn get_one(client: &PoolClient, key: &str, expected: &[u8]) {
    let mut buf = vec![0xEE; PAGE as usize];
    let r = client.get(key, &mut buf).await;
    assert_eq!(r, Ok(expected.len() as u64), "get {key}");
    assert_eq!(&buf[..expected.len()], expected, "bytes of {key}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_sequential_cli_style_gets_from_a_sixteen_page_ssd_node_all_succeed() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let writer = cli(&m, "writer").await;
    let keys: Vec<String> = (0..200).map(|i| format!("seq-{i}")).collect();
    put_all(&writer, &keys).await;
    indexed(&writer, &keys).await;
    writer.close().await;
    for (i, key) in keys.iter().enumerate() {
        // Each get is a fresh client on a runtime of its own that closes and is dropped right
        // after, as an `umbp get` process exits: nothing it left running in the background
        // survives, so its release must have left by the time `close` returns.
        let reader = reader_config(&m, &format!("get-{i}"));
        let (key, expected) = (key.clone(), val(i));
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build();
            let outcome = rt.map_err(|e| e.to_string()).and_then(|rt| {
                rt.block_on(async {
                    let reader = PoolClient::start(reader).await.map_err(|e| e.to_string())?;
                    let mut buf = vec![0xEE; PAGE as usize];
                    let r = reader.get(&key, &mut buf).await;
                    reader.close().await;
                    match r {
                        Ok(n) if buf[..n as usize] == expected[..] => Ok(()),
                        other => Err(format!("get {key}: {other:?}")),
                    }
                })
            });
            let _ = tx.send(outcome);
        });
        rx.await.expect("the reader thread answers").unwrap_or_else(|e| panic!("one-shot reader {i}: {e}"));
        if i % 20 == 19 {
            let putter = cli(&m, &format!("put-{i}")).await;
            let v = value(10_000 + i, 700);
            putter.put(&format!("interleaved-{i}"), &v).await.unwrap_or_else(|e| panic!("put after get {i}: {e}"));
            // The master hears of the write through the SSD node's heartbeat.
            indexed(&putter, &[format!("interleaved-{i}")]).await;
            get_one(&putter, &format!("interleaved-{i}"), &v).await;
            putter.close().await;
        }
    }
    ssd.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_key_batch_get_from_a_sixteen_page_ssd_node_is_byte_exact() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let writer = cli(&m, "writer").await;
    let keys: Vec<String> = (0..1000).map(|i| format!("batch-{i}")).collect();
    put_all(&writer, &keys).await;
    indexed(&writer, &keys).await;
    let reader = cli(&m, "reader").await;
    let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0xEE; PAGE as usize]; keys.len()];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    let results = reader.batch_get(&key_refs, &mut slices).await;
    for (i, r) in results.iter().enumerate() {
        let v = val(i);
        assert_eq!(r, &Ok(v.len() as u64), "get {}", keys[i]);
        assert_eq!(&bufs[i][..v.len()], v.as_slice(), "bytes of {}", keys[i]);
    }
    // The batch's pages all came back: a put fits, and the node reads its own keys (the local
    // path releases too).
    let v = value(77_777, 900);
    writer.put("after-the-batch", &v).await.expect("a put after the batch");
    let own: Vec<&str> = key_refs[..100].to_vec();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0xEE; PAGE as usize]; own.len()];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
    for (i, r) in ssd.batch_get(&own, &mut slices).await.iter().enumerate() {
        assert_eq!(r, &Ok(val(i).len() as u64), "local get {}", own[i]);
        assert_eq!(&bufs[i][..val(i).len()], val(i).as_slice());
    }
    writer.put("after-the-local-batch", &v).await.expect("a put after the local batch");
    reader.close().await;
    writer.close().await;
    ssd.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_readers_of_one_ssd_node_wait_for_pages_instead_of_missing() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let writer = cli(&m, "writer").await;
    let keys: Vec<String> = (0..96).map(|i| format!("conc-{i}")).collect();
    put_all(&writer, &keys).await;
    indexed(&writer, &keys).await;
    // Four readers, each a batch of 48 keys (overlapping): 192 reads at once against 16 pages.
    let readers: Vec<PoolClient> = {
        let mut v = Vec::new();
        for r in 0..4 {
            v.push(cli(&m, &format!("reader-{r}")).await);
        }
        v
    };
    let runs = readers.iter().enumerate().map(|(r, reader)| {
        let keys = &keys;
        async move {
            let idx: Vec<usize> = (0..48).map(|j| (r * 24 + j) % keys.len()).collect();
            let ks: Vec<&str> = idx.iter().map(|i| keys[*i].as_str()).collect();
            let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; PAGE as usize]; ks.len()];
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            let results = reader.batch_get(&ks, &mut slices).await;
            for ((i, r), b) in idx.iter().zip(&results).zip(&bufs) {
                let v = val(*i);
                assert_eq!(r, &Ok(v.len() as u64), "get {}", keys[*i]);
                assert_eq!(&b[..v.len()], v.as_slice(), "bytes of {}", keys[*i]);
            }
        }
    });
    futures_join_all(runs.collect()).await;
    for reader in &readers {
        reader.close().await;
    }
    writer.put("after-the-readers", &value(5, 100)).await.expect("a put after the readers");
    writer.close().await;
    ssd.close().await;
    m.shutdown().await;
}

/// Runs futures concurrently on this task (no extra dependency).
async fn futures_join_all<F: std::future::Future<Output = ()>>(futures: Vec<F>) {
    let mut futures: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut done = vec![false; futures.len()];
    std::future::poll_fn(|cx| {
        for (f, d) in futures.iter_mut().zip(done.iter_mut()) {
            if !*d && f.as_mut().poll(cx).is_ready() {
                *d = true;
            }
        }
        if done.iter().all(|d| *d) { std::task::Poll::Ready(()) } else { std::task::Poll::Pending }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_that_fails_for_its_buffer_still_releases_its_staging_page() {
    let m = master().await;
    let dir = tempdir();
    let ssd = ssd_node(&m, vec![dir.path().to_path_buf()]).await;
    let writer = cli(&m, "writer").await;
    let keys: Vec<String> = (0..2 * STAGING_PAGES as usize).map(|i| format!("small-{i}")).collect();
    put_all(&writer, &keys).await;
    indexed(&writer, &keys).await;
    let reader = cli(&m, "reader").await;
    for (i, key) in keys.iter().enumerate() {
        // Every value is at least 512 bytes: the read is resolved (a staging page filled and
        // leased), then fails for the caller's buffer.
        let mut tiny = [0u8; 16];
        let r = reader.get(key, &mut tiny).await;
        assert!(
            matches!(r, Err(umbp_peer::pool_client::KeyError::BufferTooSmall { needed, .. }) if needed == val(i).len() as u64),
            "{key}: {r:?}"
        );
    }
    // Twice the arena's pages were resolved and never copied: every one came back.
    for (i, key) in keys.iter().enumerate() {
        get_one(&reader, key, &val(i)).await;
    }
    reader.close().await;
    writer.close().await;
    ssd.close().await;
    m.shutdown().await;
}
