//! umbp-rs, a distributed KV-cache buffer pool: the crate a Rust program adds to join the pool, and
//! the `umbp` command line.
//!
//! A process joins the pool as a **node** ([`PoolClient`]): it lends one storage medium to the pool
//! ([`Medium`]: host DRAM, GPU HBM, local SSDs) or none (a client-only node), and puts and gets
//! values by key across every node. A **master** (`umbp master`) keeps membership and the key index
//! and decides placement; the bytes move between nodes directly.
//!
//! ```no_run
//! use umbp::{DramConfig, ErrorKind, KeyError, Medium, PoolClient};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! // A node lending 1 GiB of DRAM to the pool whose master runs at 127.0.0.1:50051
//! // (`umbp master`).
//! let pool = PoolClient::builder("node-1", "127.0.0.1:50051")
//!     .medium(Medium::Dram(DramConfig { capacity_bytes: 1 << 30, ..DramConfig::default() }))
//!     .start()
//!     .await?;
//!
//! pool.put("llama-70b/blk/0", b"a block of KV cache").await?;
//! let mut buf = vec![0u8; 64 << 10];
//! let len = pool.get("llama-70b/blk/0", &mut buf).await?;
//! assert_eq!(&buf[..len as usize], b"a block of KV cache");
//!
//! // Every error says what to do next.
//! match pool.get("never-put", &mut buf).await {
//!     Err(KeyError::Miss) => {}
//!     Err(err) if err.kind() == ErrorKind::Retry => { /* a node busy: try again shortly */ }
//!     Err(err) if err.kind() == ErrorKind::Unavailable => { /* the master unreachable: retry later */ }
//!     other => panic!("{other:?}"),
//! }
//! pool.close().await;
//! # Ok(())
//! # }
//! ```
//!
//! # Features
//! - `dram` (default), `ssd`, `hbm`: the media this build can lend (forwarded to `umbp-peer`: a
//!   build without one has no [`Medium`] variant for it, nor its crates). A client-only node needs
//!   none.
//! - `cli` (default): the `umbp` binary and what only it needs (the command line, the settings
//!   file, logging, the master, the demo and the benches); it takes every medium. A program that
//!   only joins the pool turns default features off and picks its media:
//!   `umbp = { version = "0.1", default-features = false, features = ["dram"] }`.
//!
//! # Owns
//! - The public face of the pool: the client API re-exported from `umbp-peer` ([`PoolClient`] and
//!   its settings, results and errors) and [`ErrorKind`].
//! - The command line (`umbp master`, `node`, `put`, `get`, `exists`, `rm`, `stat`, `demo`,
//!   `bench`), its settings (file → environment → flags) and the demo; public only for the binary,
//!   the Python package (`umbp-py` links `cli_main`) and the tests (hidden from these docs).
//!
//! # Never
//! Implements pool behaviour: placement, transfers and the heartbeat belong to `umbp-master` and
//! `umbp-peer`; this crate only re-exports, configures and starts them. Never names a concrete
//! medium or transfer engine beyond choosing one from settings, and never binds anything but
//! 127.0.0.1 unless told.
#![forbid(unsafe_code)]

#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_breakdown;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_checksum;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_cli;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_keyed;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_latency;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_memcpy;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_metadata;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_ranged;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_soak;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod bench_ssd;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod chaos;
#[cfg(feature = "cli")]
mod cli;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod demo;
#[cfg(feature = "cli")]
mod entry;
#[cfg(feature = "cli")]
mod progress;
#[cfg(feature = "cli")]
mod settings;
#[cfg(feature = "cli")]
mod units;

#[cfg(feature = "cli")]
#[doc(hidden)]
pub use cli::{
    BENCH_AFTER_HELP, BenchArgs, BenchChildArgs, BenchSuite, CONFIG_FILE_HELP, Cli, Command, DemoArgs, GetArgs,
    KeysArgs, MASTER_ENV_HELP, MasterAddress, MasterArgs, MasterClientArgs, MediumKind, NODE_AFTER_HELP, NodeArgs,
    PutArgs, SsdEngineChoice, StatArgs,
};
#[cfg(feature = "cli")]
#[doc(hidden)]
pub use entry::cli_main;
#[cfg(feature = "cli")]
#[doc(hidden)]
pub use settings::{
    ClientSettings, DEFAULT_MASTER_ADDRESS, DEFAULT_MAX_GET_SIZE, EnvGetter, FileConfig, NodeSettings, Settings,
    SettingsError, format_recache, parse_recache, resolve_client, resolve_master, resolve_master_address,
    resolve_max_get_size, resolve_node,
};
#[cfg(feature = "cli")]
#[doc(hidden)]
pub use units::{UnitError, format_duration, format_size, human_size, parse_duration, parse_size};

// The client API: what a program that joins the pool names.
#[cfg(feature = "hbm")]
pub use umbp_peer::HbmConfig;
#[cfg(feature = "ssd")]
pub use umbp_peer::SsdConfig;
#[cfg(feature = "ssd")]
pub use umbp_peer::pool_client::IoEngineKind;
pub use umbp_peer::pool_client::{RuntimeSelection, SharedError};
pub use umbp_peer::{
    DramConfig, ErrorKind, KeyError, MasterClientConfig, MasterClientError, Medium, PoolClient, PoolClientBuilder,
    PoolClientConfig, PoolClientStats, PoolError, PutOutcome, RecachePolicy, raise_open_file_limit,
};
