//! `umbp-master`: runs the umbp-rs master until SIGINT or SIGTERM.
//!
//! Settings come from the defaults, then `UMBP_*` environment variables, then these flags. The
//! `umbp master` command of the `umbp` binary wraps the same entry point.

use std::process::ExitCode;
use std::time::Duration;

use umbp_master::MasterConfig;

/// `--help`, with the defaults read from [`MasterConfig::default`] so they cannot drift.
fn help() -> String {
    let d = MasterConfig::default();
    let e = &d.eviction;
    format!(
        "\
umbp-master: the umbp-rs master (membership, key index, routing, eviction)

USAGE:
    umbp-master [OPTIONS]

Durations take a unit: 500ms, 5s, 2m, 1h. Flags override the environment, which overrides the defaults.

OPTIONS:                                   [env]                              [default]
    --listen ADDR                          UMBP_MASTER_LISTEN                 {listen}
    --token TOKEN                          UMBP_CLUSTER_TOKEN                 none
    --heartbeat-ttl DUR                    UMBP_HEARTBEAT_TTL_SEC             {ttl:?}
    --heartbeat-interval-divisor N         UMBP_HEARTBEAT_INTERVAL_DIVISOR    {div}
    --max-missed-heartbeats N              UMBP_MAX_MISSED_HEARTBEATS         {missed}
    --reaper-interval DUR                  UMBP_REAPER_INTERVAL_SEC           {reaper:?}
    --expired-retention DUR                UMBP_EXPIRED_RETENTION_SEC         {retention:?}
    --eviction-check-interval DUR          UMBP_EVICTION_CHECK_INTERVAL_SEC   {check:?}
    --eviction-high-watermark F            UMBP_EVICTION_HIGH_WATERMARK       {high}
    --eviction-low-watermark F             UMBP_EVICTION_LOW_WATERMARK        {low}
    --lease-duration DUR                   UMBP_LEASE_DURATION_SEC            {lease:?}
    --evict-deadline DUR                   UMBP_EVICTKEY_DEADLINE_MS          {evict:?}
    --route-put-algo most_available|random UMBP_ROUTE_PUT_SELECT_ALGO         {algo}
    --route-put-affinity none|same|local   UMBP_ROUTE_PUT_NODE_AFFINITY       {affinity}
    --index-shards N (1..=4096)            UMBP_MASTER_INDEX_SHARDS           {shards}
    --shutdown-deadline DUR                UMBP_GRPC_SHUTDOWN_DEADLINE_SEC    {shutdown:?}
    --max-message-bytes N                  UMBP_MASTER_MAX_MESSAGE_BYTES      {msg}
    --metrics-addr ADDR                    UMBP_MASTER_METRICS_ADDR           none (no /metrics)
    -h, --help                             print this help

    UMBP_METADATA_BACKEND may only be `inmemory`. Logging: RUST_LOG [info].
",
        listen = d.listen,
        ttl = d.heartbeat_ttl,
        div = d.heartbeat_interval_divisor,
        missed = d.max_missed_heartbeats,
        reaper = d.reaper_interval,
        retention = d.expired_retention,
        check = e.check_interval,
        high = e.high_watermark,
        low = e.low_watermark,
        lease = e.lease_duration,
        evict = e.evict_deadline,
        algo = d.route_put_algo,
        affinity = d.route_put_affinity,
        shards = d.index_shards,
        shutdown = d.shutdown_deadline,
        msg = d.max_message_bytes,
    )
}

/// `500ms`, `5s`, `2m`, `1h` (a bare number is refused: the unit is never guessed).
fn parse_duration(flag: &str, v: &str) -> Result<Duration, String> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (number, unit) = v.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("{flag} {v:?}: expected a number and a unit (500ms, 5s)"))?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1_000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => return Err(format!("{flag} {v:?}: unit must be ms, s, m or h")),
    };
    ms.map(Duration::from_millis).ok_or_else(|| format!("{flag} {v:?}: too large"))
}

fn parse_value<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    v.trim().parse().map_err(|e| format!("{flag} {v:?}: {e}"))
}

fn parse_args(
    mut config: MasterConfig,
    args: impl IntoIterator<Item = String>,
) -> Result<Option<MasterConfig>, String> {
    if let Ok(listen) = std::env::var("UMBP_MASTER_LISTEN") {
        config.listen = listen.parse().map_err(|e| format!("UMBP_MASTER_LISTEN={listen:?}: {e}"))?;
    }
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(None);
        }
        // `--flag value` or `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        let mut value = || inline.clone().or_else(|| args.next()).ok_or_else(|| format!("{flag} needs a value"));
        let f = flag.as_str();
        match f {
            "--listen" => config.listen = parse_value(f, &value()?)?,
            "--token" => config.cluster_token = Some(value()?).filter(|t| !t.is_empty()),
            "--heartbeat-ttl" => config.heartbeat_ttl = parse_duration(f, &value()?)?,
            "--heartbeat-interval-divisor" => config.heartbeat_interval_divisor = parse_value(f, &value()?)?,
            "--max-missed-heartbeats" => config.max_missed_heartbeats = parse_value(f, &value()?)?,
            "--reaper-interval" => config.reaper_interval = parse_duration(f, &value()?)?,
            "--expired-retention" => config.expired_retention = parse_duration(f, &value()?)?,
            "--eviction-check-interval" => config.eviction.check_interval = parse_duration(f, &value()?)?,
            "--eviction-high-watermark" => config.eviction.high_watermark = parse_value(f, &value()?)?,
            "--eviction-low-watermark" => config.eviction.low_watermark = parse_value(f, &value()?)?,
            "--lease-duration" => config.eviction.lease_duration = parse_duration(f, &value()?)?,
            "--evict-deadline" => config.eviction.evict_deadline = parse_duration(f, &value()?)?,
            "--route-put-algo" => config.route_put_algo = parse_value(f, &value()?)?,
            "--route-put-affinity" => config.route_put_affinity = parse_value(f, &value()?)?,
            "--index-shards" => config.index_shards = parse_value(f, &value()?)?,
            "--shutdown-deadline" => config.shutdown_deadline = parse_duration(f, &value()?)?,
            "--max-message-bytes" => config.max_message_bytes = parse_value(f, &value()?)?,
            "--metrics-addr" => config.metrics_listen = Some(parse_value(f, &value()?)?),
            other => return Err(format!("unknown argument {other:?} (see --help)")),
        }
    }
    config.validate().map_err(|e| e.to_string())?;
    Ok(Some(config))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config =
        match MasterConfig::from_env().map_err(|e| e.to_string()).and_then(|c| parse_args(c, std::env::args().skip(1)))
        {
            Ok(Some(config)) => config,
            Ok(None) => {
                print!("{}", help());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn every_setting_has_a_flag() {
        let c = parse_args(
            MasterConfig::default(),
            args(&[
                "--listen=127.0.0.1:9",
                "--heartbeat-ttl",
                "4s",
                "--heartbeat-interval-divisor",
                "4",
                "--max-missed-heartbeats=5",
                "--reaper-interval",
                "500ms",
                "--expired-retention",
                "2m",
                "--eviction-check-interval",
                "2s",
                "--eviction-high-watermark",
                "0.8",
                "--eviction-low-watermark",
                "0.5",
                "--lease-duration",
                "3s",
                "--evict-deadline",
                "250ms",
                "--route-put-algo",
                "random",
                "--route-put-affinity",
                "same",
                "--index-shards",
                "64",
                "--shutdown-deadline",
                "1m",
                "--max-message-bytes",
                "1048576",
                "--token",
                "t",
                "--metrics-addr",
                "127.0.0.1:9091",
            ]),
        )
        .expect("valid")
        .expect("not help");
        assert_eq!(c.listen.port(), 9);
        assert_eq!(
            (c.heartbeat_ttl, c.heartbeat_interval_divisor, c.max_missed_heartbeats),
            (Duration::from_secs(4), 4, 5)
        );
        assert_eq!(c.reaper_interval, Duration::from_millis(500));
        assert_eq!(c.expired_retention, Duration::from_secs(120));
        assert_eq!((c.eviction.high_watermark, c.eviction.low_watermark), (0.8, 0.5));
        assert_eq!(c.eviction.check_interval, Duration::from_secs(2));
        assert_eq!(c.eviction.lease_duration, Duration::from_secs(3));
        assert_eq!(c.eviction.evict_deadline, Duration::from_millis(250));
        assert_eq!(c.route_put_algo.as_str(), "random");
        assert_eq!(c.route_put_affinity.as_str(), "same");
        assert_eq!((c.index_shards, c.max_message_bytes), (64, 1 << 20));
        assert_eq!(c.shutdown_deadline, Duration::from_secs(60));
        assert_eq!(c.cluster_token.as_deref(), Some("t"));
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9091".parse().expect("addr")));
    }

    #[test]
    fn bad_flags_are_errors() {
        for bad in [
            &["--heartbeat-ttl", "5"][..],
            &["--evict-deadline", "0ms"],
            &["--route-put-algo", "fastest"],
            &["--eviction-low-watermark", "0.95"],
            &["--bogus"],
            &["--index-shards"],
        ] {
            assert!(parse_args(MasterConfig::default(), args(bad)).is_err(), "{bad:?}");
        }
        assert_eq!(parse_args(MasterConfig::default(), args(&["--help"])), Ok(None));
    }

    #[test]
    fn help_lists_every_flag_with_its_default() {
        let h = help();
        for flag in [
            "--heartbeat-ttl",
            "--eviction-high-watermark",
            "--evict-deadline",
            "--max-message-bytes",
            "--metrics-addr",
            "--expired-retention",
            "300s",
            "10s",
            "0.9",
            "most_available",
        ] {
            assert!(h.contains(flag), "{flag}");
        }
    }
}
