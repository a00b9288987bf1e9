//! Helpers shared by the `pool_*` tests: a master on 127.0.0.1, a small DRAM node config, value
//! patterns and a bounded wait for the master's index. Every item is used by every `pool_*` file.

use std::time::Duration;

use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::pool_client::{DramConfig, Medium, PoolClient, PoolClientConfig, RecachePolicy};

/// The page size of every test medium.
pub(crate) const PAGE: u64 = 4096;

/// A master on an OS-assigned 127.0.0.1 port with default settings.
pub(crate) async fn master() -> MasterHandle {
    umbp_master::start(MasterConfig { listen: "127.0.0.1:0".parse().expect("addr"), ..MasterConfig::default() })
        .await
        .expect("master")
}

/// A node `id` lending `capacity` bytes of DRAM in `PAGE` pages, with a small bounce pool and no
/// re-caching (so each key is stored once).
pub(crate) fn config(master: &MasterHandle, id: &str, capacity: u64) -> PoolClientConfig {
    let mut config = PoolClientConfig::new(id, master.local_addr().to_string()).with_medium(Medium::Dram(DramConfig {
        capacity_bytes: capacity,
        prefault: false,
        ..DramConfig::default()
    }));
    config.page_size = PAGE;
    config.bounce_bytes = 1 << 20;
    config.recache = RecachePolicy::Off;
    config
}

/// A value of `len` bytes whose pattern depends on `seed`.
pub(crate) fn value(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(131)) as u8).collect()
}

/// Waits (at most 10 s) until the master indexes every key (heartbeats are asynchronous).
pub(crate) async fn indexed(client: &PoolClient, keys: &[impl AsRef<str>]) {
    let keys: Vec<String> = keys.iter().map(|k| k.as_ref().to_owned()).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let found = client.master().batch_lookup(&keys).await.expect("lookup");
        if found.iter().all(|f| *f) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "keys never indexed: {found:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
