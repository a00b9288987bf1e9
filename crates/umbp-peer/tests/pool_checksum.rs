//! End-to-end checksums (`PoolClientConfig::checksums`): every put path stores its value's CRC-32C
//! with the value, and a bit flipped in the holder's memory after the put is a counted corruption
//! and a miss on every read path — keyed over TCP, keyed through the shared-memory mapping, routed
//! — never wrong bytes. With checksums off at the reader, the same flip comes back as a hit with the
//! flipped byte: the control that proves the flip reaches the reader.

use umbp_core::{ReadRelease, value_crc32c};
use umbp_peer::pool_client::{KeyError, PoolClient, PoolClientConfig};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

fn light(master: &umbp_master::MasterHandle, id: &str, change: impl FnOnce(&mut PoolClientConfig)) -> PoolClientConfig {
    let mut c = PoolClientConfig::new(id, master.local_addr().to_string());
    c.bounce_bytes = 1 << 20;
    change(&mut c);
    c
}

/// The checksum `holder`'s medium answers for `key` (its read lease released at once).
fn stored_crc(holder: &PoolClient, key: &str) -> Option<u32> {
    let medium = holder.medium().expect("a medium");
    let e = medium.batch_resolve(&[key.to_owned()], false).remove(0);
    assert!(e.found, "{key} is held");
    medium.release_reads(&[ReadRelease::new(key, e.lease)]);
    e.crc32c
}

/// Flips one bit of byte `at` of `key`'s value in `holder`'s medium memory.
fn flip_a_bit(holder: &PoolClient, key: &str, at: u64) {
    let medium = holder.medium().expect("a medium");
    let e = medium.batch_resolve(&[key.to_owned()], false).remove(0);
    assert!(e.found && at < e.size, "{key} is held and has byte {at}");
    let page = e.pages[usize::try_from(at / e.page_size).expect("small")];
    let buffer = medium.buffer_ref(page.buffer_index as usize).expect("the page's buffer");
    let local = buffer.local_region().expect("host memory");
    let offset = u64::from(page.page_index) * e.page_size + at % e.page_size;
    assert!(offset < local.len());
    // SAFETY: inside the medium's live buffer (checked above); no copy of this key runs now.
    unsafe { *local.ptr().as_ptr().add(usize::try_from(offset).expect("small")) ^= 0x10 };
    medium.release_reads(&[ReadRelease::new(key, e.lease)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_put_path_stores_the_values_checksum_and_off_stores_none() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let writer = PoolClient::start(light(&m, "writer", |_| {})).await.expect("writer");
    let plain = PoolClient::start(light(&m, "plain", |c| c.checksums = false)).await.expect("writer");
    let tcp = PoolClient::start(light(&m, "tcp", |c| c.shared_memory = false)).await.expect("writer");
    let values: Vec<Vec<u8>> = (0..6).map(|i| value(i, 3 * PAGE as usize + 17 * i)).collect();
    // Single puts are keyed (a large one through the shared mapping, a small one as bytes); a light
    // client's batch to a holder on this host is one PUT_KEYS, summed on its chunk's thread; a
    // batch without the shared path is routed (allocate, transfer, commit); a holder's own put
    // goes to its medium, and its own batch is summed as it is copied into its pages.
    writer.put("keyed", &values[0]).await.expect("keyed put");
    let big = value(9, 256 << 10);
    writer.put("keyed-shared", &big).await.expect("keyed put through the mapping");
    tcp.put("keyed-tcp", &values[1]).await.expect("keyed put over TCP");
    let r = writer.batch_put(&[("routed-a", &values[2]), ("routed-b", &values[3])]).await;
    assert_eq!(r, vec![Ok(()), Ok(())]);
    assert_eq!(writer.stats().keyed_puts, 4, "the batch went as one PUT_KEYS (after two single keyed puts)");
    let r = tcp.batch_put(&[("routed-tcp", &values[1]), ("routed-tcp-2", &values[0])]).await;
    assert_eq!(r, vec![Ok(()), Ok(())]);
    assert_eq!(tcp.stats().keyed_puts, 1, "without the shared path the batch was routed");
    holder.put("local", &values[4]).await.expect("local put");
    let r = holder.batch_put(&[("local-a", &values[2]), ("local-b", &big), ("local-c", &values[5])]).await;
    assert_eq!(r, vec![Ok(()), Ok(()), Ok(())]);
    plain.put("unchecked", &values[5]).await.expect("put without a checksum");
    for (key, v) in [
        ("keyed", &values[0]),
        ("keyed-shared", &big),
        ("keyed-tcp", &values[1]),
        ("routed-a", &values[2]),
        ("routed-b", &values[3]),
        ("routed-tcp", &values[1]),
        ("routed-tcp-2", &values[0]),
        ("local", &values[4]),
        ("local-a", &values[2]),
        ("local-b", &big),
        ("local-c", &values[5]),
    ] {
        assert_eq!(stored_crc(&holder, key), Some(value_crc32c(v)), "{key}: the writer's checksum is stored");
    }
    assert_eq!(stored_crc(&holder, "unchecked"), None, "checksums off: none computed");
    // A value put without one reads back unchecked, and fine.
    indexed(&writer, &["unchecked"]).await;
    let mut buf = vec![0u8; values[5].len()];
    assert_eq!(writer.get("unchecked", &mut buf).await, Ok(values[5].len() as u64));
    assert_eq!(buf, values[5]);
    for n in [&writer, &plain, &tcp, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bit_flipped_in_the_holders_memory_is_a_miss_on_every_read_path_never_wrong_bytes() {
    let m = master().await;
    let holder = PoolClient::start(config(&m, "holder", 256 * PAGE)).await.expect("holder");
    let shm = PoolClient::start(light(&m, "shm", |_| {})).await.expect("reader");
    let tcp = PoolClient::start(light(&m, "tcp", |c| c.shared_memory = false)).await.expect("reader");
    let unchecked = PoolClient::start(light(&m, "unchecked", |c| c.checksums = false)).await.expect("reader");
    let len = 2 * PAGE as usize + 99;
    let keys = ["a", "b", "c", "d", "clean"];
    let values: Vec<Vec<u8>> = (0..keys.len()).map(|i| value(100 + i, len)).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().zip(&values).map(|(k, v)| (*k, v.as_slice())).collect();
    assert!(shm.batch_put(&items).await.iter().all(Result::is_ok));
    indexed(&shm, &keys).await;
    for (i, key) in keys[..4].iter().enumerate() {
        flip_a_bit(&holder, key, (i as u64 * 1999) % len as u64);
    }

    // The control: without checksums the flipped byte reaches the caller as a hit.
    let mut buf = vec![0u8; len];
    assert_eq!(unchecked.get("a", &mut buf).await, Ok(len as u64), "unchecked, the corruption is a hit");
    let wrong = buf.iter().zip(&values[0]).filter(|(x, y)| x != y).count();
    assert_eq!(wrong, 1, "exactly the flipped byte differs");
    assert_eq!(unchecked.stats().checksum_failures, 0);

    // Keyed through the shared mapping, keyed over TCP, routed (a batch): a miss each, counted.
    let mut buf = vec![0u8; len];
    assert_eq!(shm.get("a", &mut buf).await, Err(KeyError::Miss), "keyed, shared mapping");
    assert_eq!(tcp.get("b", &mut buf).await, Err(KeyError::Miss), "keyed, TCP");
    let (mut x, mut y) = (vec![0u8; len], vec![0u8; len]);
    let mut bufs = [x.as_mut_slice(), y.as_mut_slice()];
    let got = tcp.batch_get(&["c", "clean"], &mut bufs).await;
    assert_eq!(got, vec![Err(KeyError::Miss), Ok(len as u64)], "routed over TCP: the corrupt key misses alone");
    assert_eq!(y, values[4], "the clean key of the same batch is intact");
    let mut bufs = [x.as_mut_slice(), y.as_mut_slice()];
    let got = shm.batch_get(&["d", "clean"], &mut bufs).await;
    assert_eq!(got, vec![Err(KeyError::Miss), Ok(len as u64)], "routed through the mapping");
    assert!(shm.stats().checksum_failures >= 2, "{:?}", shm.stats());
    assert!(tcp.stats().checksum_failures >= 2, "{:?}", tcp.stats());

    // The holder's own reads of its medium are checked too.
    let mut buf = vec![0u8; len];
    assert_eq!(holder.get("a", &mut buf).await, Err(KeyError::Miss), "a local read");
    assert!(holder.stats().checksum_failures >= 1);
    for n in [&shm, &tcp, &unchecked, &holder] {
        n.close().await;
    }
    m.shutdown().await;
}
