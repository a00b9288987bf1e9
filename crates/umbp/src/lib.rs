//! The umbp-rs command line: the `umbp` binary and the pieces of it worth testing on their own.
//!
//! `umbp master` runs the master, `umbp node` a node lending one medium, `umbp put` / `get` /
//! `exists` / `rm` / `stat` are client commands (each joins the pool as a node with no medium for
//! its duration), `umbp demo` runs a master and three nodes in one process with a verified
//! workload, and `umbp bench` measures batch put/get beside memcpy and raw-TCP baselines (`umbp bench
//! ssd`: an SSD node beside raw `O_DIRECT` IO on the same directory).
//!
//! # Owns
//! - The command line ([`Cli`]) and its help, which states every default.
//! - Settings: the TOML file ([`FileConfig`]), the `UMBP_*` environment and the flags, merged in that
//!   order of precedence ([`resolve_master`], [`resolve_node`], [`resolve_client`]).
//! - Size and duration syntax ([`parse_size`], [`parse_duration`]).
//! - The demo ([`demo::run`]) and the benches ([`bench::run`], [`bench_ssd::run`]).
//!
//! # Never
//! Implements pool behaviour: placement, transfers and the heartbeat belong to `umbp-master` and
//! `umbp-peer`; this crate only configures and starts them. Never names a concrete medium or
//! transfer engine (that is `PoolClient`'s job), and never binds anything but 127.0.0.1 unless told.
#![forbid(unsafe_code)]

pub mod bench;
pub mod bench_ssd;
mod cli;
pub mod demo;
mod progress;
mod settings;
mod units;

pub use cli::{
    BENCH_AFTER_HELP, BenchArgs, BenchChildArgs, BenchSuite, CONFIG_FILE_HELP, Cli, Command, DemoArgs, GetArgs,
    KeysArgs, MASTER_ENV_HELP, MasterAddress, MasterArgs, MediumKind, NODE_AFTER_HELP, NodeArgs, PutArgs,
    SsdEngineChoice, StatArgs,
};
pub use settings::{
    ClientSettings, DEFAULT_MASTER_ADDRESS, DEFAULT_MAX_GET_SIZE, EnvGetter, FileConfig, NodeSettings, Settings,
    SettingsError, format_recache, parse_recache, resolve_client, resolve_master, resolve_master_address,
    resolve_max_get_size, resolve_node,
};
pub use units::{UnitError, format_duration, format_size, human_size, parse_duration, parse_size};
