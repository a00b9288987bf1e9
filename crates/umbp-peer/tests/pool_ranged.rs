//! Ranged gets and puts (`PoolClient::batch_get_ranges` / `batch_put_ranges`, issue 21): parts of
//! stored values into buffers of their own, byte-exact, over TCP (only the requested bytes cross
//! it), through the shared mapping and from the node's own medium; values assembled from parts and
//! published whole; bad ranges fail their key alone; on DRAM, SSD, CXL and object holders.

use umbp_core::{ReadRelease, value_crc32c};
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig, PutOutcome, PutParts};

mod pool_support;
mod ranged_support;

use pool_support::{PAGE, config, indexed, master, value};
use ranged_support::read_parts;

fn light(master: &umbp_master::MasterHandle, id: &str, shared_memory: bool) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, master.local_addr().to_string());
    c.bounce_bytes = 1 << 20;
    c.shared_memory = shared_memory;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranges_of_a_value_read_byte_exact_on_every_path_and_only_they_cross_tcp() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let tcp = PoolClient::start(light(&m, "tcp", false)).await.expect("reader");
    let shm = PoolClient::start(light(&m, "shm", true)).await.expect("reader");
    let size = 3 * PAGE as usize + 123;
    let v = value(21, size);
    tcp.put("v", &v).await.expect("put");
    indexed(&tcp, &["v"]).await;
    // Across a page boundary, a whole middle page and more, the last byte, out of order.
    let parts = [(PAGE - 96, 100), (size as u64 - 1, 1), (PAGE + 4, PAGE as usize + 10), (0, 3)];
    for (who, client) in [("tcp", &tcp), ("shm", &shm), ("the holder itself", &holder)] {
        let before = client.transferred_bytes("TcpEngine");
        let (r, bufs) = read_parts(client, "v", &parts).await;
        assert_eq!(r, Ok(size as u64), "{who}: the value's size");
        for ((off, len), b) in parts.iter().zip(&bufs) {
            assert_eq!(b.as_slice(), &v[*off as usize..*off as usize + len], "{who}: {len} bytes at {off}");
        }
        let moved = client.transferred_bytes("TcpEngine") - before;
        let wanted: u64 = parts.iter().map(|(_, len)| *len as u64).sum();
        if who == "tcp" {
            assert_eq!(moved, wanted, "over TCP only the requested bytes, not the value's {size}");
        } else {
            assert_eq!(moved, 0, "{who}: nothing over TCP");
        }
    }
    // Eight ranges tiling the value read the same bytes as one whole get.
    let eighth = size / 8;
    let tiling: Vec<(u64, usize)> =
        (0..8).map(|i| ((i * eighth) as u64, if i == 7 { size - 7 * eighth } else { eighth })).collect();
    let (r, bufs) = read_parts(&tcp, "v", &tiling).await;
    assert_eq!(r, Ok(size as u64));
    assert_eq!(bufs.concat(), v, "the eight parts are the value");
    for n in [&tcp, &shm, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_ranges_fail_their_key_alone() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 64 * PAGE)).await.expect("holder");
    let reader = PoolClient::start(light(&m, "reader", false)).await.expect("reader");
    let size = PAGE as usize + 10;
    let v = value(22, size);
    reader.put("k", &v).await.expect("put");
    indexed(&reader, &["k"]).await;
    let (mut a, mut b, mut c, mut d, mut e) = (vec![0u8; 8], vec![0u8; 8], vec![0u8; 8], vec![0u8; 20], vec![0u8; 8]);
    let mut lists = vec![
        vec![(a.as_mut_slice(), 0), (b.as_mut_slice(), 4)], // overlapping
        vec![(c.as_mut_slice(), size as u64 - 4)],          // past the end
        vec![],                                             // none
        vec![(d.as_mut_slice(), 100)],                      // good
        vec![(e.as_mut_slice(), 0)],                        // a missing key
    ];
    let keys = ["k", "k", "k", "k", "absent", "no-list"];
    let r = reader.batch_get_ranges(&keys, &mut lists).await;
    drop(lists);
    let kinds: Vec<&str> = r
        .iter()
        .map(|r| match r {
            Ok(_) => "ok",
            Err(KeyError::BadRanges { .. }) => "bad",
            Err(KeyError::Miss) => "miss",
            Err(KeyError::NoBuffer) => "no buffer",
            Err(_) => "other",
        })
        .collect();
    assert_eq!(kinds, ["bad", "bad", "bad", "ok", "miss", "no buffer"], "{r:?}");
    assert!(r[0].as_ref().unwrap_err().to_string().contains("overlap"), "{:?}", r[0]);
    assert!(r[1].as_ref().unwrap_err().to_string().contains("past the value"), "{:?}", r[1]);
    assert_eq!(r[3], Ok(size as u64));
    assert_eq!(d.as_slice(), &v[100..120]);
    // Every read lease was released (the good key's, and those of the keys refused after their
    // resolve): the holder frees the value at once when it is removed. Releases leave in the
    // background; `close` waits for those in flight, so the remove cannot overtake them.
    reader.close().await;
    let freed = holder.remove(&["k"]).await.expect("remove");
    assert_eq!(freed, [size as u64], "a lease left behind would keep the value (0 freed)");
    holder.close().await;
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_value_put_from_ranges_is_the_ranges_assembled_and_checksummed_whole() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let tcp = PoolClient::start(light(&m, "tcp", false)).await.expect("writer");
    let shm = PoolClient::start(light(&m, "shm", true)).await.expect("writer");
    let size = 3 * PAGE as usize + 77;
    for (n, (who, writer)) in [("tcp", &tcp), ("shm", &shm), ("the holder itself", &holder)].into_iter().enumerate() {
        let v = value(30 + n, size);
        // Three parts from three buffers, given out of order, cutting pages anywhere.
        let (head, rest) = v.split_at(PAGE as usize - 5);
        let (middle, tail) = rest.split_at(PAGE as usize + 11);
        let parts = vec![(tail, (head.len() + middle.len()) as u64), (head, 0), (middle, head.len() as u64)];
        let key = format!("assembled-{n}");
        let r = writer.batch_put_ranges(&[(key.as_str(), size as u64, parts.clone())]).await;
        assert_eq!(r, vec![Ok(PutOutcome::Written)], "{who}");
        indexed(writer, &[key.as_str()]).await;
        let mut buf = vec![0u8; size];
        assert_eq!(tcp.get(&key, &mut buf).await, Ok(size as u64), "{who}: a whole get, checked");
        assert_eq!(buf, v, "{who}: the value is the parts assembled");
        let medium = holder.medium().expect("medium");
        let e = medium.batch_resolve(std::slice::from_ref(&key), false).remove(0);
        medium.release_reads(&[ReadRelease::new(key.as_str(), e.lease)]);
        assert_eq!(e.crc32c, Some(value_crc32c(&v)), "{who}: the checksum is the assembled value's");
        // Written once: the same key again is already present.
        let again = writer.batch_put_ranges(&[(key.as_str(), size as u64, parts)]).await;
        assert_eq!(again, vec![Ok(PutOutcome::AlreadyPresent)], "{who}");
    }
    for n in [&tcp, &shm, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parts_that_do_not_tile_their_value_write_nothing() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 64 * PAGE)).await.expect("holder");
    let writer = PoolClient::start(light(&m, "writer", false)).await.expect("writer");
    let v = value(40, 100);
    let items: Vec<(&str, u64, PutParts<'_>)> = vec![
        ("gap", 100, vec![(&v[..40], 0), (&v[50..], 50)]),
        ("overlap", 100, vec![(&v[..60], 0), (&v[50..], 50)]),
        ("short", 120, vec![(&v[..], 0)]),
        ("long", 80, vec![(&v[..], 0)]),
        ("none", 100, vec![]),
        ("good", 100, vec![(&v[30..], 30), (&v[..30], 0)]),
    ];
    let r = writer.batch_put_ranges(&items).await;
    for (i, (key, _, _)) in items.iter().enumerate().take(5) {
        assert!(matches!(r[i], Err(KeyError::BadRanges { .. })), "{key}: {:?}", r[i]);
    }
    assert_eq!(r[5], Ok(PutOutcome::Written));
    let medium = holder.medium().expect("medium");
    assert_eq!(medium.owned_key_count(), 1, "only the good value was written");
    assert_eq!(
        medium.batch_contains(&items.iter().map(|(k, _, _)| (*k).to_owned()).collect::<Vec<_>>()),
        [false, false, false, false, false, true]
    );
    writer.close().await;
    holder.close().await;
    m.shutdown().await;
}

/// A holder lending `medium`, with the pool tests' page size and no re-caching.
async fn holder_with(m: &umbp_master::MasterHandle, medium: umbp_peer::pool_client::Medium) -> PoolClient {
    PoolClient::start(config(m, "holder", 0).with_medium(medium)).await.expect("holder starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranged_puts_and_gets_round_trip_across_nodes_on_the_ssd_cxl_and_object_media() {
    use umbp_peer::pool_client::{CxlConfig, Medium, ObjectSettings, SsdConfig};
    let object_dir = tempfile::Builder::new().prefix("umbp-ranged-object").tempdir().expect("tempdir");
    let ssd_dir = tempfile::Builder::new().prefix("umbp-ranged-ssd").tempdir().expect("tempdir");
    let cxl_file = tempfile::Builder::new().prefix("umbp-ranged-cxl").tempfile_in("/dev/shm").expect("tmpfs file");
    let media = [
        (
            "ssd",
            Medium::Ssd(SsdConfig {
                dirs: vec![ssd_dir.path().to_owned()],
                capacity_bytes: 4 << 20,
                staging_pages: 32,
                ..SsdConfig::default()
            }),
        ),
        ("cxl", Medium::Cxl(CxlConfig::new(cxl_file.path(), 4 << 20))),
        (
            "object (a directory store)",
            Medium::Object(ObjectSettings {
                url: Some(format!("file://{}", object_dir.path().display())),
                capacity_bytes: 4 << 20,
                staging_pages: 16,
                ..ObjectSettings::default()
            }),
        ),
    ];
    for (name, medium) in media {
        let m = master().await;
        let holder = holder_with(&m, medium).await;
        let reader = PoolClient::start(light(&m, "reader", false)).await.expect("reader");
        // One page: the SSD medium stores one key per page.
        let size = PAGE as usize - 1;
        let v = value(50, size);
        let parts: Vec<(&[u8], u64)> = vec![(&v[1000..], 1000), (&v[..10], 0), (&v[10..1000], 10)];
        let r = reader.batch_put_ranges(&[("k", size as u64, parts)]).await;
        assert_eq!(r, vec![Ok(PutOutcome::Written)], "{name}: a put from ranges");
        indexed(&reader, &["k"]).await;
        let (r, bufs) = read_parts(&reader, "k", &[(4000, 95), (0, 1), (2048, 100)]).await;
        assert_eq!(r, Ok(size as u64), "{name}");
        assert_eq!(bufs, [v[4000..].to_vec(), v[..1].to_vec(), v[2048..2148].to_vec()], "{name}: the ranges");
        let mut whole = vec![0u8; size];
        assert_eq!(reader.get("k", &mut whole).await, Ok(size as u64), "{name}: a whole get, checked");
        assert_eq!(whole, v, "{name}: the value is the parts assembled");
        reader.close().await;
        holder.close().await;
        m.shutdown().await;
    }
}
