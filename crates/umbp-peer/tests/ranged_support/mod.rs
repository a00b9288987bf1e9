//! A helper shared by the ranged `pool_*` tests (every item used by each file that includes it).

use umbp_peer::pool_client::{KeyError, PoolClient};

/// Reads `parts` (`(offset, len)`) of `key` through `client`; the value's size and the parts
/// (each buffer starts as `0xEE`, so a part left unwritten shows).
pub(crate) async fn read_parts(
    client: &PoolClient,
    key: &str,
    parts: &[(u64, usize)],
) -> (Result<u64, KeyError>, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = parts.iter().map(|(_, len)| vec![0xEE; *len]).collect();
    let mut lists = vec![bufs.iter_mut().zip(parts).map(|(b, (off, _))| (b.as_mut_slice(), *off)).collect::<Vec<_>>()];
    let r = client.batch_get_ranges(&[key], &mut lists).await.remove(0);
    drop(lists);
    (r, bufs)
}
