//! The master of umbp-rs: membership, the key → locations index, routing and eviction.
//!
//! The master is an **advisor**. It keeps the nodes' membership and last reported capacity and a
//! projection `key → [location]` built solely from heartbeat events; it holds no per-put state and
//! never touches bytes. Peers own the blocks and win every disagreement: a stale route costs a retry,
//! never data.
//!
//! ```
//! use std::time::{SystemTime, UNIX_EPOCH};
//!
//! use umbp_master::MasterConfig;
//! use umbp_master::store::{RegisterOutcome, Registration};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runtime = tokio::runtime::Runtime::new()?;
//! runtime.block_on(async {
//!     // Port 0 picks a free port; nodes and clients dial `local_addr` (`umbp node --master …`).
//!     let config = MasterConfig { listen: "127.0.0.1:0".parse()?, ..MasterConfig::default() };
//!     let master = umbp_master::start(config).await?;
//!     assert_ne!(master.local_addr().port(), 0);
//!
//!     // What a node's registration does, through the store the service answers from.
//!     let now_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
//!     let peer_address = "127.0.0.1:7000".into();
//!     let node = Registration { node_id: "node-1".into(), peer_address, ..Default::default() };
//!     assert_eq!(master.store().register(node, now_ms, 30_000)?, RegisterOutcome::Registered);
//!     assert_eq!(master.store().list_alive()?.len(), 1);
//!     master.shutdown().await;
//!     Ok(())
//! })
//! # }
//! ```
//!
//! # Owns
//! The metadata store ([`store`]), the routing strategies ([`routing`]), the eviction manager, the
//! registry reaper, the external KV index (records of KV blocks nodes hold outside the pool, which a
//! scheduler matches to route a prompt; `docs/design/external-kv-index.md`), the `UMBPMaster` gRPC
//! service, and the cluster series it serves on Prometheus
//! `/metrics` when [`MasterConfig::metrics_listen`] is set (names in `umbp_metrics::names`).
//!
//! # Node incarnations
//! Every registration carries the registering process's *incarnation* (the master client takes
//! wall-clock microseconds when it is created, so a restart is higher). A registration of a higher
//! incarnation than a live record's replaces it at once — a node restarted after `kill -9` rejoins
//! immediately instead of being refused until its old record expires (three heartbeat TTLs, 30 s by
//! default) — and wipes the old registration's locations; the restarted node then full-syncs what it
//! holds. The old incarnation's heartbeats change nothing and are answered `UNKNOWN` with
//! `superseded`, its unregister erases nothing, and a registration of a lower incarnation is refused
//! with `FAILED_PRECONDITION`: two live processes with one id end with the newer one registered and
//! the older one told (its master client stops for good, see `umbp_peer::master_client`). Incarnation
//! 0 (an older client) keeps the plain compare-and-set. See the [`store`] contract.
//!
//! # Retention of expired records
//! A node silent for [`MasterConfig::expiry_after`] expires: its locations go, its row stays listed
//! (status `EXPIRED`) for [`MasterConfig::expired_retention`] (default
//! [`DEFAULT_EXPIRED_RETENTION`], 5 minutes; env `UMBP_EXPIRED_RETENTION_SEC`), then the reaper
//! removes it, so the cluster status does not grow with every crashed process. The status reply says
//! each record's role (`NODE_ROLE_STORAGE` for a node that lends a medium, `NODE_ROLE_CLIENT` for one
//! that does not), its incarnation and the retention.
//!
//! # On-demand eviction
//! The background eviction round runs every `check_interval` (5 s). A put route that finds no node
//! with room does not wait for it: it evicts least recently used, unleased keys synchronously on the
//! roomiest medium that could hold the value (at least the bytes needed, down to the low watermark),
//! credits what the peer confirmed freed to the node's recorded capacity and routes again. Routed
//! bytes are debited from the recorded capacity until the node's next heartbeat reports its own
//! figure, and a route that takes a medium past the high watermark queues one relief eviction, so
//! concurrent writers are not all sent to the same last bytes. One eviction runs at a time; a put
//! that waited for another's routes again first (no stampede). Details in the evictor's module docs.
//!
//! # Several masters
//! Masters started with the same `metadata` Redis share one index and answer the same nodes and
//! clients (which take a list of master addresses and fail over). Each is stateless apart from
//! caches; what each keeps in its own memory, and why that is safe:
//! - the **duty lease** (a key in the store, see the `lease` module): the registry reaper and the
//!   eviction rounds run only on its holder; another master takes it over within 4 s of the
//!   holder's death (TTL 3 s, attempts every 1 s), at once after a graceful shutdown;
//! - **relief evictions** (a route ran a medium past the high watermark) run only on the holder too;
//!   the per-master `relief_pending` flag only keeps one master from queueing two;
//! - **on-demand evictions** (a put found no room) run on the master answering the put, which cannot
//!   wait for another: two masters may evict on one medium at once, costing at most one extra
//!   budget of evicted keys, never a wrong answer (a key evicted twice frees 0 bytes the second time);
//! - **routed bytes** are debited from the node's recorded capacity *in the store* (a compare-and-set),
//!   so concurrent routes on different masters never place the same room twice;
//! - the evictor's peer connections and its memory of keys peers refused are caches: a new holder
//!   starts without them and at worst asks for a protected key once more;
//! - the heartbeat seq of every node is in its store record, so a heartbeat answered by another
//!   master continues the same stream.
//!
//! Several Redis URLs (`redis://a,redis://b,…`) shard the index by key hash
//! ([`store::ShardedStore`]): the first holds the node records as routing reads them and the leases.
//! What each failure costs: `docs/architecture.md`, "Metadata in Redis".
//!
//! # Logs
//! A storage node joining or leaving is one INFO line with its settings as `key=value`; a client (an
//! engine process, every CLI command) joining or leaving is DEBUG. A warning that can repeat on every
//! request or round (a failing store, a failing peer, events of an unknown kind) is printed at most
//! once per 10 s with the number held back (`held_back=`).
//!
//! # Never
//! Knows a storage medium beyond its tier number and capacity, moves bytes, or holds state a peer's
//! full sync cannot rebuild.

mod config;
mod evictor;
mod external;
#[doc(hidden)]
pub mod fuzzing;
mod lease;
mod metrics;
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
