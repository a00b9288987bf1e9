//! `umbp-master`: runs the umbp-rs master until SIGINT or SIGTERM.
//!
//! Settings come from the defaults, then `UMBP_*` environment variables, then these flags. The
//! `umbp master` command of the `umbp` binary wraps the same entry point.

use std::process::ExitCode;

use umbp_master::MasterConfig;

const HELP: &str = "\
umbp-master: the umbp-rs master (membership, key index, routing, eviction)

USAGE:
    umbp-master [--listen ADDR] [--token TOKEN]

OPTIONS:
    --listen ADDR   gRPC listen address [env: UMBP_MASTER_LISTEN] [default: 127.0.0.1:50051]
    --token TOKEN   cluster token every caller must present [env: UMBP_CLUSTER_TOKEN] [default: none]
    -h, --help      print this help

ENVIRONMENT (defaults in brackets):
    UMBP_HEARTBEAT_TTL_SEC [10]  UMBP_HEARTBEAT_INTERVAL_DIVISOR [2]  UMBP_MAX_MISSED_HEARTBEATS [3]
    UMBP_REAPER_INTERVAL_SEC [5]  UMBP_EVICTION_CHECK_INTERVAL_SEC [5]
    UMBP_EVICTION_HIGH_WATERMARK [0.9]  UMBP_EVICTION_LOW_WATERMARK [0.7]
    UMBP_LEASE_DURATION_SEC [2]  UMBP_EVICTKEY_DEADLINE_MS [1000]
    UMBP_ROUTE_PUT_SELECT_ALGO [most_available|random]  UMBP_ROUTE_PUT_NODE_AFFINITY [none|same|local]
    UMBP_MASTER_INDEX_SHARDS [32]  UMBP_GRPC_SHUTDOWN_DEADLINE_SEC [3]
    RUST_LOG [info]
";

fn parse_args(mut config: MasterConfig) -> Result<Option<MasterConfig>, String> {
    if let Ok(listen) = std::env::var("UMBP_MASTER_LISTEN") {
        config.listen = listen.parse().map_err(|e| format!("UMBP_MASTER_LISTEN={listen:?}: {e}"))?;
    }
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--listen" => {
                let v = value("--listen")?;
                config.listen = v.parse().map_err(|e| format!("--listen {v:?}: {e}"))?;
            }
            "--token" => config.cluster_token = Some(value("--token")?),
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    Ok(Some(config))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = match MasterConfig::from_env().map_err(|e| e.to_string()).and_then(parse_args) {
        Ok(Some(config)) => config,
        Ok(None) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("umbp-master: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("umbp-master: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(umbp_master::run_until_signal(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("umbp-master: {e}");
            ExitCode::FAILURE
        }
    }
}
