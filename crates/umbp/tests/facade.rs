//! The facade: a program that names only `umbp::…` (and a master to talk to) joins the pool as a
//! DRAM node, puts, gets, sees a miss as a miss and a closed client as closed.

use umbp::{DramConfig, KeyError, Medium, PoolClient, PoolClientConfig, PutOutcome, RecachePolicy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_naming_only_the_facade_puts_and_gets() {
    let listen = "127.0.0.1:0".parse().expect("addr");
    let master = umbp_master::start(umbp_master::MasterConfig { listen, ..Default::default() }).await.expect("master");

    let mut config = PoolClientConfig::new("facade-node", master.local_addr().to_string());
    config.medium = Medium::Dram(DramConfig { capacity_bytes: 8 << 20, prefault: false, ..DramConfig::default() });
    config.page_size = 4096;
    config.bounce_bytes = 1 << 20;
    config.recache = RecachePolicy::Off;
    let pool = PoolClient::start(config).await.expect("the node starts");

    let value: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(pool.put_outcome("facade/k", &value).await.expect("put"), PutOutcome::Written);
    assert_eq!(pool.put_outcome("facade/k", &value).await.expect("put"), PutOutcome::AlreadyPresent);
    let mut buf = vec![0u8; 16 << 10];
    let len = pool.get("facade/k", &mut buf).await.expect("get");
    assert_eq!(&buf[..len as usize], &value[..]);

    match pool.get("facade/never-put", &mut buf).await {
        Err(KeyError::Miss) => {}
        other => panic!("a key never put is a miss, got {other:?}"),
    }
    pool.close().await;
    match pool.get("facade/k", &mut buf).await {
        Err(err @ KeyError::Closed) => assert!(!err.is_retryable()),
        other => panic!("a closed client answers closed, got {other:?}"),
    }
    master.shutdown().await;
}
