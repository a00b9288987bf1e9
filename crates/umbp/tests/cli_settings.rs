//! The command line's settings: size and duration syntax, the TOML file (unknown keys refused), the
//! precedence file < `UMBP_*` environment < flags, and help texts that state every default.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use clap::Parser;
use umbp::demo::DemoOptions;
use umbp::{
    Cli, Command, FileConfig, MediumKind, SettingsError, UnitError, format_duration, format_recache, format_size,
    parse_duration, parse_size, resolve_client, resolve_master, resolve_node,
};
use umbp_master::MasterConfig;
use umbp_master::routing::SelectAlgo;
use umbp_peer::pool_client::{DramConfig, Medium, PoolClientConfig, RecachePolicy};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |var| map.get(var).cloned()
}

fn file(text: &str) -> FileConfig {
    FileConfig::parse(text, Path::new("test.toml")).expect("valid file")
}

fn parse(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("umbp").chain(args.iter().copied())).expect("valid command line")
}

fn node_args(args: &[&str]) -> (umbp::NodeArgs, Option<String>) {
    let cli = parse(&[&["node"], args].concat());
    match cli.command {
        Command::Node(a) => (a, cli.token),
        other => panic!("parsed {other:?}"),
    }
}

fn master_args(args: &[&str]) -> (umbp::MasterArgs, Option<String>) {
    let cli = parse(&[&["master"], args].concat());
    match cli.command {
        Command::Master(a) => (a, cli.token),
        other => panic!("parsed {other:?}"),
    }
}

fn capacity(c: &PoolClientConfig) -> u64 {
    match &c.medium {
        Medium::Dram(d) => d.capacity_bytes,
        other => panic!("medium {other:?}"),
    }
}

#[test]
fn sizes_accept_binary_units_and_plain_bytes() {
    for (text, bytes) in [
        ("4096", 4096),
        ("0", 0),
        ("512KiB", 512 << 10),
        ("64MiB", 64 << 20),
        ("4GiB", 4 << 30),
        ("2TiB", 2 << 40),
        ("64mib", 64 << 20),
        ("2M", 2 << 20),
        ("8k", 8 << 10),
        ("7 MiB", 7 << 20),
        (" 100B ", 100),
        ("1_048_576", 1 << 20),
    ] {
        assert_eq!(parse_size(text), Ok(bytes), "{text:?}");
    }
}

#[test]
fn sizes_refuse_garbage_fractions_decimal_units_and_overflow() {
    for text in ["", "MiB", "-1", "1.5GiB", "12 parsecs", "4 G i B", "0x10"] {
        assert!(matches!(parse_size(text), Err(UnitError::BadSize { .. })), "{text:?}: {:?}", parse_size(text));
    }
    let err = parse_size("4GB").expect_err("ambiguous");
    assert!(matches!(err, UnitError::AmbiguousSize { .. }));
    assert!(err.to_string().contains("4GiB"), "suggests the binary unit: {err}");
    assert!(matches!(parse_size("99999999999TiB"), Err(UnitError::Overflow { .. })));
    assert!(matches!(parse_size("99999999999999999999999"), Err(UnitError::Overflow { .. })));
}

#[test]
fn durations_need_a_unit() {
    for (text, d) in [
        ("500ms", Duration::from_millis(500)),
        ("5s", Duration::from_secs(5)),
        ("2m", Duration::from_secs(120)),
        ("1h", Duration::from_secs(3600)),
        ("250us", Duration::from_micros(250)),
        ("0s", Duration::ZERO),
        ("10 s", Duration::from_secs(10)),
    ] {
        assert_eq!(parse_duration(text), Ok(d), "{text:?}");
    }
    for text in ["", "5", "s", "1.5s", "-1s", "5 sec", "5S", "ms500"] {
        assert!(parse_duration(text).is_err(), "{text:?} must be refused");
    }
}

#[test]
fn formatting_writes_what_parsing_reads() {
    assert_eq!(format_size(4 << 30), "4GiB");
    assert_eq!(format_size(1536 << 10), "1536KiB");
    assert_eq!(format_size(4097), "4097");
    assert_eq!(format_duration(Duration::from_millis(500)), "500ms");
    assert_eq!(format_duration(Duration::from_secs(10)), "10s");
}

#[test]
fn the_node_takes_each_setting_from_the_highest_layer_that_sets_it() {
    let f = file(
        r#"
        master_address = "10.0.0.1:1"
        cluster_token = "from-file"
        [node]
        node_id = "file-node"
        medium = "dram"
        capacity = "1GiB"
        page_size = 65536
        listen = "127.0.0.2"
        peer_port = 7001
        recache = "off"
        read_lease = "250ms"
        max_reroutes = 5
        "#,
    );
    // File only.
    let (none, _) = node_args(&[]);
    let c = resolve_node(&f, &env(&[]), &none, None).expect("file only");
    assert_eq!(
        (c.node_id.as_str(), c.master_address.as_str(), capacity(&c), c.page_size),
        ("file-node", "10.0.0.1:1", 1 << 30, 64 << 10)
    );
    assert_eq!(c.peer_listen, "127.0.0.2:7001".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.data_listen, "127.0.0.2:0".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.node_address, "127.0.0.2");
    assert_eq!(c.recache, RecachePolicy::Off);
    assert_eq!(c.read_lease, Duration::from_millis(250));
    assert_eq!(c.max_reroutes, 5);
    assert_eq!(c.cluster_token.as_deref(), Some("from-file"));
    assert_eq!(c.master.cluster_token.as_deref(), Some("from-file"), "the master client carries the token too");

    // The environment beats the file.
    let e = env(&[
        ("UMBP_MASTER_ADDRESS", "10.0.0.2:2"),
        ("UMBP_CLUSTER_TOKEN", "from-env"),
        ("UMBP_NODE_ID", "env-node"),
        ("UMBP_CAPACITY", "2GiB"),
        ("UMBP_PAGE_SIZE", "128KiB"),
        ("UMBP_NODE_ADDRESS", "127.0.0.3"),
        ("UMBP_PEER_SERVICE_PORT", "7002"),
        ("UMBP_IO_ENGINE_PORT", "7003"),
        ("UMBP_CACHE_REMOTE_FETCHES", "always"),
        ("UMBP_DRAM_READ_LEASE_MS", "750"),
        ("UMBP_HEARTBEAT_RPC_TIMEOUT_MS", "1234"),
    ]);
    let c = resolve_node(&f, &e, &none, None).expect("file + env");
    assert_eq!(
        (c.node_id.as_str(), c.master_address.as_str(), capacity(&c), c.page_size),
        ("env-node", "10.0.0.2:2", 2 << 30, 128 << 10)
    );
    assert_eq!(c.peer_listen, "127.0.0.3:7002".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.data_listen, "127.0.0.3:7003".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.recache, RecachePolicy::Always);
    assert_eq!(c.read_lease, Duration::from_millis(750));
    assert_eq!(c.cluster_token.as_deref(), Some("from-env"));
    assert_eq!(c.master.heartbeat_rpc_timeout, Duration::from_millis(1234), "the master client's own UMBP_*");

    // The flags beat both.
    let (flags, token) = node_args(&[
        "--token",
        "from-flag",
        "--master",
        "10.0.0.3:3",
        "--node-id",
        "flag-node",
        "--page-size",
        "256KiB",
        "--listen",
        "127.0.0.4",
        "--peer-port",
        "7004",
        "--data-port",
        "7005",
        "--recache",
        "1MiB",
        "--medium",
        "none",
    ]);
    let c = resolve_node(&f, &e, &flags, token.as_deref()).expect("file + env + flags");
    assert_eq!((c.node_id.as_str(), c.master_address.as_str(), c.page_size), ("flag-node", "10.0.0.3:3", 256 << 10));
    assert_eq!(c.medium, Medium::None);
    assert_eq!(c.peer_listen, "127.0.0.4:7004".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.data_listen, "127.0.0.4:7005".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.recache, RecachePolicy::UpTo(1 << 20));
    assert_eq!(c.cluster_token.as_deref(), Some("from-flag"));
    let (flags, token) = node_args(&["--capacity", "3GiB"]);
    assert_eq!(capacity(&resolve_node(&f, &e, &flags, token.as_deref()).expect("capacity flag")), 3 << 30);
}

#[test]
fn a_node_with_no_settings_gets_the_documented_defaults() {
    let (flags, _) = node_args(&["--node-id", "n1"]);
    let c = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect("defaults");
    let defaults = PoolClientConfig::new("n1", umbp::DEFAULT_MASTER_ADDRESS);
    assert_eq!(c.master_address, "127.0.0.1:50051");
    assert_eq!(c.medium, Medium::Dram(DramConfig::default()));
    assert_eq!(c.page_size, defaults.page_size);
    assert_eq!(c.peer_listen, "127.0.0.1:0".parse::<SocketAddr>().expect("addr"), "loopback unless told");
    assert_eq!(c.data_listen, "127.0.0.1:0".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.recache, defaults.recache);
    assert_eq!(c.cluster_token, None);
}

#[test]
fn the_master_takes_each_setting_from_the_highest_layer_that_sets_it() {
    let f = file(
        r#"
        cluster_token = "from-file"
        [master]
        listen = "127.0.0.1:6001"
        heartbeat_ttl = "20s"
        max_missed_heartbeats = 4
        route_put_algo = "random"
        eviction_high_watermark = 0.95
        eviction_low_watermark = 0.5
        route_get_lease = "3s"
        "#,
    );
    let (none, _) = master_args(&[]);
    let c = resolve_master(&f, &env(&[]), &none, None).expect("file only");
    assert_eq!(c.listen, "127.0.0.1:6001".parse::<SocketAddr>().expect("addr"));
    assert_eq!((c.heartbeat_ttl, c.max_missed_heartbeats), (Duration::from_secs(20), 4));
    assert_eq!(c.route_put_algo, SelectAlgo::Random);
    assert_eq!((c.eviction.high_watermark, c.eviction.low_watermark), (0.95, 0.5));
    assert_eq!(c.eviction.lease_duration, Duration::from_secs(3));
    assert_eq!(c.cluster_token.as_deref(), Some("from-file"));

    let e = env(&[
        ("UMBP_MASTER_LISTEN", "127.0.0.1:6002"),
        ("UMBP_HEARTBEAT_TTL_SEC", "30"),
        ("UMBP_ROUTE_PUT_SELECT_ALGO", "most_available"),
        ("UMBP_CLUSTER_TOKEN", "from-env"),
    ]);
    let c = resolve_master(&f, &e, &none, None).expect("file + env");
    assert_eq!(c.listen, "127.0.0.1:6002".parse::<SocketAddr>().expect("addr"));
    assert_eq!((c.heartbeat_ttl, c.max_missed_heartbeats), (Duration::from_secs(30), 4), "unset in env: file");
    assert_eq!(c.route_put_algo, SelectAlgo::MostAvailable);
    assert_eq!(c.cluster_token.as_deref(), Some("from-env"));

    let (flags, token) = master_args(&[
        "--listen",
        "127.0.0.1:6003",
        "--heartbeat-ttl",
        "40s",
        "--route-put-algo",
        "random",
        "--token",
        "from-flag",
    ]);
    let c = resolve_master(&f, &e, &flags, token.as_deref()).expect("file + env + flags");
    assert_eq!(c.listen, "127.0.0.1:6003".parse::<SocketAddr>().expect("addr"));
    assert_eq!(c.heartbeat_ttl, Duration::from_secs(40));
    assert_eq!(c.route_put_algo, SelectAlgo::Random);
    assert_eq!(c.cluster_token.as_deref(), Some("from-flag"));

    let c = resolve_master(&FileConfig::default(), &env(&[]), &none, None).expect("defaults");
    assert_eq!(c, MasterConfig::default(), "nothing set: the master's own defaults");
}

#[test]
fn umbp_master_has_a_flag_for_every_master_setting_and_flags_beat_the_environment() {
    let e = env(&[("UMBP_EVICTION_HIGH_WATERMARK", "0.8"), ("UMBP_MASTER_INDEX_SHARDS", "8")]);
    let (flags, _) = master_args(&[
        "--route-put-affinity",
        "local",
        "--heartbeat-interval-divisor",
        "4",
        "--eviction-check-interval",
        "250ms",
        "--eviction-high-watermark",
        "0.95",
        "--eviction-low-watermark",
        "0.5",
        "--lease-duration",
        "3s",
        "--evict-deadline",
        "700ms",
        "--index-shards",
        "64",
        "--shutdown-deadline",
        "9s",
        "--max-message-bytes",
        "8MiB",
        "--expired-retention",
        "90s",
    ]);
    let c = resolve_master(&FileConfig::default(), &e, &flags, None).expect("flags");
    assert_eq!(c.expired_retention, Duration::from_secs(90));
    assert_eq!(c.route_put_affinity, umbp_master::routing::Affinity::Local);
    assert_eq!(c.heartbeat_interval_divisor, 4);
    assert_eq!(c.eviction.check_interval, Duration::from_millis(250));
    assert_eq!((c.eviction.high_watermark, c.eviction.low_watermark), (0.95, 0.5));
    assert_eq!(c.eviction.lease_duration, Duration::from_secs(3));
    assert_eq!(c.eviction.evict_deadline, Duration::from_millis(700));
    assert_eq!(c.index_shards, 64);
    assert_eq!(c.shutdown_deadline, Duration::from_secs(9));
    assert_eq!(c.max_message_bytes, 8 << 20);
    // Without the flags the environment holds.
    let c = resolve_master(&FileConfig::default(), &e, &master_args(&[]).0, None).expect("env");
    assert_eq!((c.eviction.high_watermark, c.index_shards), (0.8, 8));
    // The retention of expired records: file, then environment, then flag.
    let f = file("[master]\nexpired_retention = \"2m\"");
    let none = master_args(&[]).0;
    assert_eq!(resolve_master(&f, &env(&[]), &none, None).expect("file").expired_retention, Duration::from_secs(120));
    let e = env(&[("UMBP_EXPIRED_RETENTION_SEC", "30")]);
    assert_eq!(resolve_master(&f, &e, &none, None).expect("env").expired_retention, Duration::from_secs(30));
    // A flag the master refuses is an error, not a silent default.
    let (flags, _) = master_args(&["--eviction-low-watermark", "0.99"]);
    assert!(resolve_master(&FileConfig::default(), &env(&[]), &flags, None).is_err(), "low above high");
}

#[test]
fn client_commands_join_without_a_medium_and_share_the_address_and_token_layers() {
    let f = file("master_address = \"10.0.0.1:1\"\ncluster_token = \"t\"\n[node]\nmax_reroutes = 7");
    let cli = parse(&["get", "k"]);
    let Command::Get(args) = cli.command else { panic!("get") };
    let c = resolve_client(&f, &env(&[]), &args.master, None, "cli-1".into()).expect("client");
    assert_eq!((c.node_id.as_str(), c.master_address.as_str()), ("cli-1", "10.0.0.1:1"));
    assert_eq!(c.medium, Medium::None);
    assert_eq!(c.max_reroutes, 7);
    assert_eq!(c.cluster_token.as_deref(), Some("t"));
    let cli = parse(&["get", "--master", "10.0.0.9:9", "k", "-"]);
    let Command::Get(args) = cli.command else { panic!("get") };
    let c = resolve_client(&f, &env(&[("UMBP_MASTER_ADDRESS", "10.0.0.2:2")]), &args.master, None, "c".into())
        .expect("client");
    assert_eq!(c.master_address, "10.0.0.9:9");
    assert_eq!(umbp::resolve_max_get_size(&f, &env(&[]), &args).expect("size"), umbp::DEFAULT_MAX_GET_SIZE);
}

/// The variables of what a node's pool client and a client command's share (the shared-memory
/// path, checksums, timeouts, reroutes, the bounce buffer) reach the client commands too: `UMBP_SHARED_MEMORY=0
/// umbp get` once took the shared path anyway.
#[test]
fn client_commands_take_the_pool_clients_variables() {
    let cli = parse(&["get", "k"]);
    let Command::Get(args) = cli.command else { panic!("get") };
    let vars = env(&[
        ("UMBP_SHARED_MEMORY", "false"),
        ("UMBP_CHECKSUMS", "false"),
        ("UMBP_RPC_TIMEOUT", "7s"),
        ("UMBP_MAX_REROUTES", "9"),
        ("UMBP_BOUNCE", "3MiB"),
    ]);
    let c = resolve_client(&FileConfig::default(), &vars, &args.master, None, "c".into()).expect("client");
    assert!(!c.shared_memory && !c.checksums, "the path and the checksums off");
    assert_eq!((c.rpc_timeout, c.max_reroutes, c.bounce_bytes), (Duration::from_secs(7), 9, 3 << 20));
    let defaults = resolve_client(&FileConfig::default(), &env(&[]), &args.master, None, "c".into()).expect("client");
    assert!(defaults.shared_memory && defaults.checksums);
    let bad = resolve_client(
        &FileConfig::default(),
        &env(&[("UMBP_SHARED_MEMORY", "maybe")]),
        &args.master,
        None,
        "c".into(),
    );
    assert!(bad.is_err_and(|e| e.to_string().contains("UMBP_SHARED_MEMORY")), "a bad value is named");
}

#[test]
fn unknown_keys_and_bad_values_in_the_file_are_errors_that_name_them() {
    for (text, needle) in [
        ("[node]\ncapacty = \"1GiB\"", "capacty"),
        ("colour = \"blue\"", "colour"),
        ("[master]\nheartbeat = \"1s\"", "heartbeat"),
        ("[nodes]\nnode_id = \"x\"", "nodes"),
        ("[node]\ncapacity = \"4GB\"", "4GiB"),
        ("[node]\ncapacity = -1", "negative"),
        ("[node]\nread_lease = 5", "duration"),
        ("[node]\nmedium = \"tape\"", "tape"),
        ("[master]\nlisten = \"nowhere\"", "listen"),
    ] {
        let err = FileConfig::parse(text, Path::new("bad.toml")).expect_err(text);
        let message = err.to_string();
        assert!(matches!(err, SettingsError::BadFile { .. }), "{message}");
        assert!(message.contains("bad.toml") && message.contains(needle), "{text:?}: {message}");
    }
    // A value the component refuses is refused with the file, naming the key.
    let err = FileConfig::parse("[master]\nroute_put_algo = \"fastest\"", Path::new("bad.toml"))
        .expect_err("unknown algorithm");
    assert!(err.to_string().contains("route_put_algo"), "{err}");
    let err = FileConfig::load(Path::new("/nonexistent/umbp.toml")).expect_err("missing file");
    assert!(err.to_string().contains("/nonexistent/umbp.toml"), "{err}");
}

#[test]
fn bad_environment_values_are_errors_that_name_the_variable() {
    let (flags, _) = node_args(&["--node-id", "n1"]);
    for (var, value) in [
        ("UMBP_CAPACITY", "lots"),
        ("UMBP_PAGE_SIZE", "4KB"),
        ("UMBP_MEDIUM", "tape"),
        ("UMBP_NODE_ADDRESS", "localhost:1"),
        ("UMBP_PEER_SERVICE_PORT", "70000"),
        ("UMBP_DRAM_PREFAULT", "maybe"),
        ("UMBP_CACHE_REMOTE_FETCHES", "sometimes"),
        ("UMBP_DRAM_READ_LEASE_MS", "0"),
        ("UMBP_HEARTBEAT_RPC_TIMEOUT_MS", "soon"),
    ] {
        let err = resolve_node(&FileConfig::default(), &env(&[(var, value)]), &flags, None).expect_err(var);
        assert!(err.to_string().contains(var), "{var}: {err}");
    }
    let err = resolve_master(&FileConfig::default(), &env(&[("UMBP_MASTER_LISTEN", "x")]), &master_args(&[]).0, None)
        .expect_err("bad listen");
    assert!(err.to_string().contains("UMBP_MASTER_LISTEN"), "{err}");
}

#[test]
fn a_node_needs_an_id_and_a_capacity_of_at_least_one_page() {
    let (none, _) = node_args(&[]);
    let err = resolve_node(&FileConfig::default(), &env(&[]), &none, None).expect_err("no id");
    assert!(matches!(err, SettingsError::Missing { .. }) && err.to_string().contains("--node-id"), "{err}");
    let (flags, _) = node_args(&["--node-id", "n1", "--capacity", "1MiB", "--page-size", "2MiB"]);
    assert!(resolve_node(&FileConfig::default(), &env(&[]), &flags, None).is_err());
    assert!(Cli::try_parse_from(["umbp", "node", "--capacity", "4GB"]).is_err(), "clap refuses bad sizes");
    assert!(Cli::try_parse_from(["umbp", "node", "--medium", "tape"]).is_err());
}

/// The help text of `umbp ARGS… --help`.
fn help(args: &[&str]) -> String {
    let err = Cli::try_parse_from(std::iter::once("umbp").chain(args.iter().copied()).chain(["--help"]))
        .expect_err("--help exits");
    assert_eq!(err.kind(), clap::error::ErrorKind::DisplayHelp);
    err.to_string()
}

#[test]
fn every_flag_of_every_command_states_its_default() {
    let cmd = <Cli as clap::CommandFactory>::command();
    for sub in cmd.get_subcommands() {
        let text = help(&[sub.get_name()]);
        for arg in sub.get_arguments().chain(cmd.get_arguments()) {
            let Some(long) = arg.get_long() else { continue };
            if matches!(long, "help" | "version") {
                continue;
            }
            let flag = format!("--{long}");
            let at = text.find(&flag).unwrap_or_else(|| panic!("`umbp {} --help` lists {flag}", sub.get_name()));
            let rest = &text[at..];
            let entry = rest[flag.len()..].find("\n  -").map_or(rest, |end| &rest[..flag.len() + end]);
            assert!(
                entry.contains("[default:"),
                "`umbp {} --help`: {flag} states no default:\n{entry}",
                sub.get_name()
            );
        }
        for arg in sub.get_positionals() {
            let name = arg.get_id().as_str();
            if matches!(name, "source" | "dest") {
                assert!(text.contains("[default: -]"), "{name} defaults to stdin/stdout");
            }
        }
    }
    assert!(help(&[]).contains("[master]") && help(&[]).contains("[node]"), "`umbp --help` shows the file's shape");
}

#[test]
fn the_defaults_in_the_help_are_the_real_defaults() {
    let node = help(&["node"]);
    let pool = PoolClientConfig::new("n", "m");
    let dram = DramConfig::default();
    for expected in [
        format!("[default: {}]", format_size(dram.capacity_bytes)),
        format!("[default: {}]", format_size(pool.page_size)),
        format!("[default: {}]", pool.peer_listen.ip()),
        format!("[default: {}]", format_recache(pool.recache)),
        format!("[default: {}]", dram.prefault),
        format!("[default: {}]", umbp::DEFAULT_MASTER_ADDRESS),
        format!("[default: {}]", MediumKind::Dram.as_str()),
    ] {
        assert!(node.contains(&expected), "`umbp node --help` lacks {expected}:\n{node}");
    }
    let master = help(&["master"]);
    let m = MasterConfig::default();
    for expected in [
        format!("[default: {}]", m.listen),
        format!("[default: {}]", format_duration(m.heartbeat_ttl)),
        format!("[default: {}]", m.max_missed_heartbeats),
        format!("[default: {}]", format_duration(m.reaper_interval)),
        format!("[default: {}]", format_duration(m.expired_retention)),
        format!("[default: {}]", m.route_put_algo),
    ] {
        assert!(master.contains(&expected), "`umbp master --help` lacks {expected}:\n{master}");
    }
    assert!(help(&["get"]).contains(&format!("[default: {}]", format_size(umbp::DEFAULT_MAX_GET_SIZE))));
    let demo = help(&["demo"]);
    let d = DemoOptions::default();
    for expected in [
        format!("[default: {}]", d.nodes),
        format!("[default: {}]", d.keys),
        format!("[default: {}]", format_size(d.min_value)),
        format!("[default: {}]", format_size(d.max_value)),
        format!("[default: {}]", format_size(d.capacity)),
        format!("[default: {}]", format_size(d.page_size)),
        format!("[default: {}]", d.batch),
        format!("[default: {}]", d.seed),
    ] {
        assert!(demo.contains(&expected), "`umbp demo --help` lacks {expected}:\n{demo}");
    }
}

#[test]
fn capacity_is_refused_where_it_would_be_ignored_and_pages_are_multiples_of_4kib() {
    // `--capacity` sizes a dram node; on any other medium it would be silently ignored.
    for (medium, instead) in [("ssd", "--ssd-capacity"), ("hbm", "--hbm-capacity"), ("none", "lends nothing")] {
        let (flags, _) = node_args(&["--node-id", "n", "--medium", medium, "--ssd-dir", "/d", "--capacity", "1GiB"]);
        let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err(medium);
        assert!(err.to_string().contains("--capacity") && err.to_string().contains(instead), "{medium}: {err}");
    }
    // A fleet-wide environment or file may set it for every node: not an error there.
    let (flags, _) = node_args(&["--node-id", "n", "--medium", "ssd", "--ssd-dir", "/d"]);
    resolve_node(&FileConfig::default(), &env(&[("UMBP_CAPACITY", "1GiB")]), &flags, None).expect("env capacity");

    for bad in ["3", "4095", "6KiB", "0"] {
        let (flags, _) = node_args(&["--node-id", "n", "--page-size", bad, "--capacity", "64MiB"]);
        let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err(bad);
        assert!(err.to_string().contains("multiple of 4KiB"), "{bad}: {err}");
    }
    for good in ["4KiB", "64KiB", "2MiB", "12KiB"] {
        let (flags, _) = node_args(&["--node-id", "n", "--page-size", good, "--capacity", "64MiB"]);
        resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect(good);
    }
}

#[test]
fn ssd_directories_are_created_only_when_asked() {
    let (flags, _) = node_args(&["--node-id", "s", "--medium", "ssd", "--ssd-dir", "/d"]);
    let c = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect("defaults");
    let Medium::Ssd(s) = &c.medium else { panic!("ssd") };
    assert!(!s.create_dirs, "refused by default");
    let (flags, _) = node_args(&["--node-id", "s", "--medium", "ssd", "--ssd-dir", "/d", "--ssd-create-dirs"]);
    let c = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect("flag");
    assert!(matches!(&c.medium, Medium::Ssd(s) if s.create_dirs));
    let (flags, _) = node_args(&["--node-id", "s", "--medium", "ssd", "--ssd-dir", "/d"]);
    let c = resolve_node(&FileConfig::default(), &env(&[("UMBP_SSD_CREATE_DIRS", "true")]), &flags, None).expect("env");
    assert!(matches!(&c.medium, Medium::Ssd(s) if s.create_dirs));
    let c = resolve_node(&file("[node]\nssd_create_dirs = true"), &env(&[]), &flags, None).expect("file");
    assert!(matches!(&c.medium, Medium::Ssd(s) if s.create_dirs));
}
