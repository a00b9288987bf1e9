//! The client's slot-TTL and read-lease checks read the clock injected with
//! `PoolClient::builder(..).clock(..)` (a `umbp_core::Clock`), as the media do, not the real one:
//!
//! - with the clock standing still, puts and gets succeed;
//! - with a clock that moves a minute each time it is read, a put's slot is past its pending TTL
//!   before the copy starts (`SlotExpired`) and a get's copy ends after its read lease
//!   (`LeaseExpired`), though both take microseconds of real time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use umbp_core::{Clock, ManualClock};
use umbp_peer::pool_client::{KeyError, PoolClient};

mod pool_support;

use pool_support::{PAGE, config, indexed, master, value};

/// A [`ManualClock`] moved forward by `step` every time it is read.
#[derive(Debug)]
struct Ticking {
    clock: Arc<ManualClock>,
    step: Mutex<Duration>,
}

impl Clock for Ticking {
    fn now(&self) -> Instant {
        self.clock.advance(*self.step.lock());
        self.clock.now()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_ttl_and_read_lease_checks_read_the_injected_clock() {
    let master = master().await;
    let clock = Arc::new(Ticking { clock: ManualClock::new(), step: Mutex::new(Duration::ZERO) });
    let node = PoolClient::builder_from(config(&master, "n1", 64 * PAGE))
        .clock(Arc::clone(&clock) as Arc<dyn Clock>)
        .start()
        .await
        .expect("node starts");
    let v = value(1, 3 * PAGE as usize);
    let mut buf = vec![0u8; v.len()];

    // Standing still: everything fits its TTL and lease.
    node.put("still", &v).await.expect("put with the clock standing still");
    indexed(&node, &["still"]).await;
    assert_eq!(node.get("still", &mut buf).await.expect("get"), v.len() as u64);
    assert_eq!(buf, v);

    // A minute per read of the clock: the 30 s pending TTL and the 500 ms lease are always over.
    *clock.step.lock() = Duration::from_secs(60);
    let err = node.put("late", &v).await.expect_err("the slot expired by the injected clock");
    assert!(matches!(err, KeyError::SlotExpired { .. }), "{err:?}");
    let err = node.get("still", &mut buf).await.expect_err("the lease lapsed by the injected clock");
    assert!(matches!(err, KeyError::LeaseExpired { .. }), "{err:?}");
    let stats = node.stats();
    assert!(stats.slot_expiries > 0 && stats.lease_lapses > 0, "{stats:?}");

    // Still again: the same node reads and writes as before.
    *clock.step.lock() = Duration::ZERO;
    node.put("after", &v).await.expect("put after");
    assert_eq!(node.get("still", &mut buf).await.expect("get after"), v.len() as u64);
    node.close().await;
}
