//! The duty lease: which of the masters sharing one metadata store runs the work only one may do.
//!
//! Any number of masters answer nodes and clients from one store, but the registry reaper and the
//! eviction rounds (background and relief) must run in one of them: two reapers would only double
//! the work, two eviction rounds would each evict a budget from the same media. Each master tries
//! to take the store's lease [`DUTY_LEASE`] every [`RENEW_EVERY`] under a token of its own; the one
//! that holds it runs those duties, and renews it (compare-and-renew) while it lives. A holder that
//! dies stops renewing: another master takes the lease within [`TTL`] + [`RENEW_EVERY`]. A master
//! shutting down releases it, so the next one takes it at its next attempt.
//!
//! A master counts itself the holder only until `TTL - SAFETY` after the *start* of its last
//! successful attempt: a master cut off from the store stops its duties before the lease can lapse
//! in the store and another master take it, so two never run them at once (bar a clock that runs
//! `SAFETY` slower than the store's over one TTL).
//!
//! With the in-process store there is one master per store and the lease is always its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::watch;

use crate::service::now_ms;
use crate::store::MetadataStore;
use umbp_core::RateLimited;

/// The lease's name in the store.
pub(crate) const DUTY_LEASE: &str = "duties";
/// How long a lease lasts without renewal.
pub(crate) const TTL: Duration = Duration::from_secs(3);
/// How often the holder renews it and the others try to take it.
pub(crate) const RENEW_EVERY: Duration = Duration::from_secs(1);
/// How long before the store's expiry a holder stops counting itself the holder.
const SAFETY: Duration = Duration::from_millis(500);

static LEASE_FAILED: RateLimited = RateLimited::every(RateLimited::WINDOW);

/// One master's view of the duty lease.
#[derive(Debug)]
pub(crate) struct DutyLease {
    store: Arc<dyn MetadataStore>,
    /// This master's token: unique per process and start.
    holder: String,
    /// Until when this master may act as the holder; `None` when it is not.
    held_until: Mutex<Option<Instant>>,
}

impl DutyLease {
    /// The lease of a master listening on `addr`.
    pub(crate) fn new(store: Arc<dyn MetadataStore>, addr: std::net::SocketAddr) -> Self {
        let holder = format!("{addr}/{}/{:016x}", std::process::id(), rand::random::<u64>());
        Self { store, holder, held_until: Mutex::new(None) }
    }

    /// Whether this master holds the lease now (and may run the duties).
    pub(crate) fn held(&self) -> bool {
        self.held_until.lock().is_some_and(|until| Instant::now() < until)
    }

    /// This master's token.
    pub(crate) fn holder(&self) -> &str {
        &self.holder
    }

    /// One attempt to take or renew the lease; updates [`held`](Self::held).
    pub(crate) async fn attempt(self: &Arc<Self>) -> bool {
        let started = Instant::now();
        let this = Arc::clone(self);
        let ttl_ms = u64::try_from(TTL.as_millis()).unwrap_or(u64::MAX);
        let result =
            tokio::task::spawn_blocking(move || this.store.acquire_lease(DUTY_LEASE, &this.holder, now_ms(), ttl_ms))
                .await;
        let held = match result {
            Ok(Ok(held)) => held,
            Ok(Err(e)) => {
                if let Some(held_back) = LEASE_FAILED.check() {
                    tracing::warn!(error = %e, held_back, "duty lease: store call failed; not running the reaper and eviction meanwhile");
                }
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "duty lease: store task failed");
                false
            }
        };
        let mut until = self.held_until.lock();
        let was = until.is_some_and(|u| Instant::now() < u);
        *until = held.then(|| started + TTL.saturating_sub(SAFETY));
        if held && !was {
            tracing::info!(holder = %self.holder, "this master now runs the reaper and eviction (duty lease taken)");
        } else if !held && was {
            tracing::info!(holder = %self.holder, "duty lease lost: another master runs the reaper and eviction");
        }
        held
    }

    /// Gives the lease up if this master holds it (shutdown).
    pub(crate) async fn release(self: &Arc<Self>) {
        *self.held_until.lock() = None;
        let this = Arc::clone(self);
        match tokio::task::spawn_blocking(move || this.store.release_lease(DUTY_LEASE, &this.holder)).await {
            Ok(Ok(true)) => tracing::debug!("duty lease released"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "duty lease release failed; it lapses by itself"),
            Err(e) => tracing::debug!(error = %e, "duty lease release task failed"),
        }
    }
}

/// Takes or renews the lease every [`RENEW_EVERY`] until stopped.
pub(crate) async fn lease_loop(lease: Arc<DutyLease>, mut stop: watch::Receiver<bool>) {
    loop {
        lease.attempt().await;
        tokio::select! {
            _ = tokio::time::sleep(RENEW_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}
