//! Master leases in the store (`acquire_lease` / `release_lease`): one holder at a time, renewal by
//! the holder, takeover once the TTL lapsed, release on shutdown (contract tests, run against both).

#![expect(
    clippy::unwrap_used,
    reason = "contract tests are plain functions that `contract!` wraps in #[test]; clippy exempts only the latter"
)]

#[macro_use]
#[path = "store_support/contract.rs"]
mod contract;
mod store_support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use store_support::*;
use umbp_master::store::{MetadataStore, StoreError};

/// Wall-clock ms: the Redis store runs a lease's TTL on Redis's clock, so the in-memory store is given
/// the real time too and both see the same expiry.
fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

fn one_holder_at_a_time_and_the_holder_renews(kind: Kind) {
    let store = kind.one();
    assert!(store.acquire_lease("duties", "m1", now(), 10_000).unwrap());
    assert!(!store.acquire_lease("duties", "m2", now(), 10_000).unwrap(), "m1's lease runs");
    assert!(store.acquire_lease("duties", "m1", now(), 10_000).unwrap(), "the holder renews");
    // Another name is another lease.
    assert!(store.acquire_lease("other", "m2", now(), 10_000).unwrap());
    assert!(!store.acquire_lease("other", "m1", now(), 10_000).unwrap());
}

fn a_lapsed_lease_is_taken_over(kind: Kind) {
    let store = kind.one();
    assert!(store.acquire_lease("duties", "m1", now(), 150).unwrap());
    assert!(!store.acquire_lease("duties", "m2", now(), 150).unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert!(store.acquire_lease("duties", "m2", now(), 10_000).unwrap(), "m1 stopped renewing");
    assert!(!store.acquire_lease("duties", "m1", now(), 10_000).unwrap(), "m1 lost it");
}

fn only_the_holder_releases(kind: Kind) {
    let store = kind.one();
    assert!(store.acquire_lease("duties", "m1", now(), 10_000).unwrap());
    assert!(!store.release_lease("duties", "m2").unwrap(), "not m2's to release");
    assert!(!store.acquire_lease("duties", "m2", now(), 10_000).unwrap());
    assert!(store.release_lease("duties", "m1").unwrap());
    assert!(!store.release_lease("duties", "m1").unwrap(), "already released");
    assert!(store.acquire_lease("duties", "m2", now(), 10_000).unwrap(), "taken at once after a release");
}

fn a_lease_needs_a_name_a_holder_and_a_ttl(kind: Kind) {
    let store = kind.one();
    for (name, holder, ttl) in [("", "m1", 1), ("duties", "", 1), ("duties", "m1", 0)] {
        assert!(matches!(store.acquire_lease(name, holder, now(), ttl), Err(StoreError::InvalidArgument { .. })));
    }
}

contract!(
    one_holder_at_a_time_and_the_holder_renews,
    a_lapsed_lease_is_taken_over,
    only_the_holder_releases,
    a_lease_needs_a_name_a_holder_and_a_ttl,
);
