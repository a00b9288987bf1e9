//! The master of umbp-rs: membership, the key → locations index, routing and eviction.
//!
//! The master is an **advisor**. It keeps the nodes' membership and last reported capacity and a
//! projection `key → [location]` built solely from heartbeat events; it holds no per-put state and
//! never touches bytes. Peers own the blocks and win every disagreement: a stale route costs a retry,
//! never data.
//!
//! # Owns
//! The metadata store ([`store`]), the routing strategies ([`routing`]), the eviction manager, the
//! registry reaper, the `UMBPMaster` gRPC service, and the cluster series it serves on Prometheus
//! `/metrics` when [`MasterConfig::metrics_listen`] is set (names in `umbp_metrics::names`).
//!
//! # Never
//! Knows a storage medium beyond its tier number and capacity, moves bytes, or holds state a peer's
//! full sync cannot rebuild.

mod config;
mod evictor;
mod metrics;
mod ratelimit;
pub mod routing;
mod server;
mod service;
pub mod store;

pub use config::{ConfigError, DEFAULT_EXPIRED_RETENTION, MIN_MESSAGE_BYTES, MasterConfig};
pub use evictor::{EvictionReport, ReapReport};
pub use server::{MasterError, MasterHandle, MasterStats, TOKEN_METADATA, start, start_with_store};

/// Runs a master until SIGINT or SIGTERM, then shuts it down gracefully. The entry point of
/// `umbp master`.
pub async fn run_until_signal(config: MasterConfig) -> Result<(), MasterError> {
    let handle = start(config).await?;
    wait_for_signal().await;
    tracing::info!("shutting down");
    handle.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
