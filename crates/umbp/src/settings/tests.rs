//! The table against the tree, the help and the components: every key has one row, with a flag and
//! a variable of its stem; the help states the components' defaults; the component tables and the
//! flat keys of earlier files give the same settings.

use std::collections::HashSet;
use std::path::Path;

use clap::{CommandFactory, Parser};
use toml::{Table, Value};

use super::table::{Scope, TABLE};
use super::*;
use crate::cli::{Cli, Command};

/// Every leaf of `t` (arrays are leaves) as a dotted path, with its value.
fn leaves(t: &Table, prefix: &str, out: &mut Vec<(String, Value)>) {
    for (k, v) in t {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            Value::Table(inner) => leaves(inner, &key, out),
            other => out.push((key, other.clone())),
        }
    }
}

/// The default tree with every optional setting present (None would leave its key out).
fn default_tree_with_every_key() -> Vec<(String, Value)> {
    let mut s = Settings { cluster_token: Some("t".into()), ..Settings::default() };
    s.node.node_id = Some("n".into());
    s.node.metrics_addr = Some(SocketAddr::from(([127, 0, 0, 1], 1)));
    s.node.shared_memory_group = Some(GroupSetting::Name("umbp".into()));
    s.node.dram.numa_node = Some(0);
    s.node.cxl.path = Some("/dev/dax0.0".into());
    s.node.object.url = Some("s3://bucket/prefix".into());
    s.node.object.endpoint = Some("http://127.0.0.1:9000".into());
    s.master.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 1)));
    s.master.metadata = Some("redis://127.0.0.1:1/0".into());
    let tree = Table::try_from(&s).expect("the settings serialize");
    let mut out = Vec::new();
    leaves(&tree, "", &mut out);
    out
}

/// The default of each path, as the help writes it (`none` for an unset optional).
fn default_text(path: &str) -> String {
    let tree = Table::try_from(Settings::default()).expect("serialize");
    match layer::get(&tree, path) {
        None => "none".into(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(a)) if a.is_empty() => "none".into(),
        Some(other) => other.to_string(),
    }
}

#[test]
fn every_key_of_the_tree_has_exactly_one_row_and_every_row_a_key() {
    let keys = default_tree_with_every_key();
    for (key, _) in &keys {
        let rows = TABLE.iter().filter(|r| r.path == key).count();
        assert_eq!(rows, 1, "{key} has {rows} rows in the table");
    }
    let paths: HashSet<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    for row in TABLE {
        assert!(paths.contains(row.path), "row {} names no key of the tree", row.path);
    }
    // Names are unambiguous: each variable, flat key and (per command) flag belongs to one row.
    let mut vars = HashSet::new();
    let mut keys_seen = HashSet::new();
    let mut flags = HashSet::new();
    for row in TABLE {
        for (var, _) in row.env {
            assert!(vars.insert(*var), "{var} is in two rows");
        }
        for key in row.legacy.iter().chain([&row.path]) {
            assert!(keys_seen.insert(*key), "{key} is in two rows");
        }
        assert!(flags.insert((row.scope, row.flag)), "{} is in two rows", row.flag);
    }
}

#[test]
fn every_setting_is_a_flag_a_variable_and_a_key_of_one_stem() {
    for row in TABLE {
        let stem = row.flag.strip_prefix("--").expect("a long flag").replace('-', "_");
        // The key's stem: its path below the command's table, without a `_bytes` unit.
        let scoped = row.path.split_once('.').map_or(row.path, |(_, rest)| rest);
        let key = scoped.replace('.', "_");
        assert!(
            key.contains(&stem) || key.replace("_bytes", "").contains(&stem),
            "{}: key {key} and flag {} differ",
            row.path,
            row.flag
        );
        let (var, _) = row.env.first().expect("every setting has a variable");
        let var = var.strip_prefix("UMBP_").expect("UMBP_").to_ascii_lowercase();
        let var = var.strip_suffix("_sec").or_else(|| var.strip_suffix("_ms")).unwrap_or(&var);
        assert!(var.contains(&stem), "{}: variable {var} and flag {} differ", row.path, row.flag);
    }
}

/// The help entry of `flag` in `umbp CMD --help`.
fn help_entry(cmd: &str, flag: &str) -> String {
    let mut root = Cli::command();
    // Building propagates the global flags (`--token`) into each subcommand.
    root.build();
    let help = root.find_subcommand_mut(cmd).expect("subcommand").render_long_help().to_string();
    let at = [format!(" {flag} <"), format!(" {flag}\n")]
        .iter()
        .find_map(|needle| help.find(needle.as_str()))
        .unwrap_or_else(|| panic!("`umbp {cmd} --help` lists {flag}"));
    let rest = &help[at + 1..];
    let end = [rest.find("\n  -"), rest.find("\n      --")].into_iter().flatten().min().unwrap_or(rest.len());
    rest[..end].to_owned()
}

#[test]
fn each_flags_help_states_its_variables_and_the_components_default() {
    for row in TABLE {
        let cmd = match row.scope {
            Scope::Master => "master",
            Scope::Node | Scope::Global | Scope::MasterClient | Scope::PoolClient => "node",
            Scope::Client => "get",
        };
        let entry = help_entry(cmd, row.flag);
        for (var, _) in row.env {
            assert!(entry.contains(var), "{}: the help does not name {var}:\n{entry}", row.flag);
        }
        let default = format!("[default: {}", default_text(row.path));
        let at = entry.find(&default).unwrap_or_else(|| panic!("{}: the help lacks {default}]:\n{entry}", row.flag));
        let next = entry[at + default.len()..].chars().next();
        assert!(matches!(next, Some(']' | ',')), "{}: the help's default is not {default}]:\n{entry}", row.flag);
    }
}

fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |var| pairs.iter().find(|(k, _)| *k == var).map(|(_, v)| (*v).to_owned())
}

fn node_args(args: &[&str]) -> NodeArgs {
    match Cli::parse_from(["umbp", "node"].iter().chain(args)).command {
        Command::Node(a) => a,
        other => panic!("{other:?}"),
    }
}

#[test]
fn component_tables_and_the_flat_keys_of_earlier_files_give_the_same_settings() {
    let flat = FileConfig::parse(
        r#"
        [master]
        route_get_lease = "3s"
        evict_deadline = "700ms"
        eviction_check_interval = "2s"
        eviction_high_watermark = 0.8
        eviction_low_watermark = 0.6
        [node]
        node_id = "n"
        medium = "ssd"
        capacity = "1GiB"
        prefault = false
        hugepages = true
        numa_node = 1
        ssd_dirs = ["/a", "/b"]
        ssd_capacity = "8GiB"
        ssd_io_engine = "io_uring"
        ssd_staging_pages = 16
        ssd_max_value_pages = 4
        ssd_read_lease = "2s"
        ssd_create_dirs = true
        ssd_sync_interval = "off"
        hbm_device = 2
        hbm_capacity = "2GiB"
        hbm_runtime = "fake"
        "#,
        Path::new("flat.toml"),
    )
    .expect("flat keys");
    let tables = FileConfig::parse(
        r#"
        [master.eviction]
        lease_duration = "3s"
        evict_deadline = "700ms"
        check_interval = "2s"
        high_watermark = 0.8
        low_watermark = 0.6
        [node]
        node_id = "n"
        medium = "ssd"
        [node.dram]
        capacity_bytes = "1GiB"
        prefault = false
        use_hugepages = true
        numa_node = 1
        [node.ssd]
        dirs = ["/a", "/b"]
        capacity_bytes = "8GiB"
        io_engine = "io_uring"
        staging_pages = 16
        max_value_pages = 4
        read_lease = "2s"
        create_dirs = true
        sync_interval = "off"
        [node.hbm]
        device = 2
        capacity_bytes = "2GiB"
        runtime = "fake"
        "#,
        Path::new("tables.toml"),
    )
    .expect("component tables");
    let (a, b) = (flat.settings().expect("flat"), tables.settings().expect("tables"));
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    assert_eq!(a.node.ssd.max_value_pages, 4);
    assert_eq!(a.master.eviction.lease_duration, std::time::Duration::from_secs(3));
    assert_eq!((a.node.dram.numa_node, a.node.hbm.device), (Some(1), 2));
    let none = node_args(&[]);
    let (a, b) = (
        resolve_node(&flat, &env(&[]), &none, None).expect("flat"),
        resolve_node(&tables, &env(&[]), &none, None).expect("tables"),
    );
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    // The same setting written both ways is an error, not a silent pick.
    let err = FileConfig::parse("[node]\nssd_max_value_pages = 2\n[node.ssd]\nmax_value_pages = 3", Path::new("t"))
        .expect_err("twice");
    assert!(err.to_string().contains("ssd_max_value_pages"), "{err}");
}

#[test]
fn a_variable_of_the_flags_stem_beats_the_references_name_and_flags_beat_both() {
    let e = env(&[("UMBP_NODE_PEER_PORT", "7001"), ("UMBP_PEER_SERVICE_PORT", "7002"), ("UMBP_PENDING_TTL", "9s")]);
    let c = resolve_node(&FileConfig::default(), &e, &node_args(&["--node-id", "n"]), None).expect("env");
    assert_eq!((c.peer_listen.port(), c.pending_ttl), (7001, std::time::Duration::from_secs(9)));
    let flags = node_args(&["--node-id", "n", "--peer-port", "7003", "--pending-ttl", "1s", "--bounce", "8MiB"]);
    let c = resolve_node(&FileConfig::default(), &e, &flags, None).expect("flags");
    assert_eq!(
        (c.peer_listen.port(), c.pending_ttl, c.bounce_bytes),
        (7003, std::time::Duration::from_secs(1), 8 << 20)
    );
    let err =
        resolve_node(&FileConfig::default(), &env(&[("UMBP_BOUNCE", "4GB")]), &node_args(&["--node-id", "n"]), None)
            .expect_err("ambiguous size");
    assert!(err.to_string().contains("UMBP_BOUNCE"), "{err}");
}

#[test]
fn checksums_are_on_by_default_and_off_by_flag_variable_or_file() {
    let none = env(&[]);
    let on = resolve_node(&FileConfig::default(), &none, &node_args(&["--node-id", "n"]), None).expect("defaults");
    assert!(on.checksums, "on by default");
    let off = node_args(&["--node-id", "n", "--checksums", "false"]);
    assert!(!resolve_node(&FileConfig::default(), &none, &off, None).expect("flag").checksums, "--checksums false");
    let by_env = env(&[("UMBP_CHECKSUMS", "false")]);
    let c = resolve_node(&FileConfig::default(), &by_env, &node_args(&["--node-id", "n"]), None).expect("env");
    assert!(!c.checksums, "UMBP_CHECKSUMS=false");
    let file = FileConfig::parse("[node]\nchecksums = false\n", Path::new("t")).expect("a file");
    let c = resolve_node(&file, &none, &node_args(&["--node-id", "n"]), None).expect("file");
    assert!(!c.checksums, "[node] checksums = false");
}

#[test]
fn a_shared_memory_group_is_a_gid_or_a_name_from_flag_variable_or_file() {
    let none = env(&[]);
    let id = node_args(&["--node-id", "n"]);
    let plain = resolve_node(&FileConfig::default(), &none, &id, None).expect("defaults");
    assert_eq!(plain.shared_memory_group, None, "this user only by default");
    let by_flag = node_args(&["--node-id", "n", "--shared-memory-group", "4242"]);
    let c = resolve_node(&FileConfig::default(), &none, &by_flag, None).expect("a gid");
    assert_eq!(c.shared_memory_group, Some(4242));
    // `root` is group 0 on every Linux host: a name is looked up.
    let by_env = env(&[("UMBP_SHARED_MEMORY_GROUP", "root")]);
    assert_eq!(resolve_node(&FileConfig::default(), &by_env, &id, None).expect("env").shared_memory_group, Some(0));
    let file = FileConfig::parse("[node]\nshared_memory_group = 77\n", Path::new("t")).expect("a file");
    assert_eq!(resolve_node(&file, &none, &id, None).expect("file").shared_memory_group, Some(77));

    // A group the host does not know, by any layer, is an error naming it.
    let unknown = env(&[("UMBP_SHARED_MEMORY_GROUP", "umbp-no-such-group-4f2a")]);
    let err = resolve_node(&FileConfig::default(), &unknown, &id, None).expect_err("unknown group");
    assert!(matches!(err, SettingsError::Invalid { setting: "--shared-memory-group", .. }), "{err}");
    assert!(err.to_string().contains("umbp-no-such-group-4f2a"), "{err}");
    let negative = FileConfig::parse("[node]\nshared_memory_group = -1\n", Path::new("t")).expect_err("gid -1");
    assert!(negative.to_string().contains("node.shared_memory_group: gid -1 is out of range"), "{negative}");

    // The flag where it could admit no one is refused; the same key in a file many nodes share is not.
    let off = node_args(&["--node-id", "n", "--shared-memory", "false", "--shared-memory-group", "1"]);
    let err = resolve_node(&FileConfig::default(), &none, &off, None).expect_err("the path off");
    assert!(err.to_string().contains("--shared-memory false"), "{err}");
    let lends_nothing = node_args(&["--node-id", "n", "--medium", "none", "--shared-memory-group", "1"]);
    let err = resolve_node(&FileConfig::default(), &none, &lends_nothing, None).expect_err("medium none");
    assert!(err.to_string().contains("medium none"), "{err}");
    let shared =
        FileConfig::parse("[node]\nmedium = \"none\"\nshared_memory_group = 1\n", Path::new("t")).expect("file");
    assert_eq!(resolve_node(&shared, &none, &id, None).expect("a shared file").shared_memory_group, Some(1));
}

#[test]
fn settings_errors_say_what_to_do_next() {
    let missing =
        SettingsError::ReadFile { path: "/x".into(), source: std::io::Error::from(std::io::ErrorKind::NotFound) };
    assert_eq!(missing.kind(), ErrorKind::InvalidInput);
    let unreadable = SettingsError::ReadFile {
        path: "/x".into(),
        source: std::io::Error::from(std::io::ErrorKind::PermissionDenied),
    };
    assert_eq!(unreadable.kind(), ErrorKind::Unavailable);
    let bad_file = FileConfig::parse("colour = 1", Path::new("t")).expect_err("unknown key");
    assert_eq!(bad_file.kind(), ErrorKind::InvalidInput);
    let bad_env = resolve_node(&FileConfig::default(), &env(&[("UMBP_CAPACITY", "lots")]), &node_args(&[]), None)
        .expect_err("bad env");
    assert!(matches!(bad_env, SettingsError::BadEnv { .. }) && bad_env.kind() == ErrorKind::InvalidInput);
    let missing_id = resolve_node(&FileConfig::default(), &env(&[]), &node_args(&[]), None).expect_err("no id");
    assert!(matches!(missing_id, SettingsError::Missing { .. }) && missing_id.kind() == ErrorKind::InvalidInput);
    let invalid =
        resolve_node(&FileConfig::default(), &env(&[]), &node_args(&["--node-id", "n", "--page-size", "3"]), None)
            .expect_err("bad page");
    assert!(matches!(invalid, SettingsError::Invalid { .. }) && invalid.kind() == ErrorKind::InvalidInput);
    let master = SettingsError::from(umbp_master::ConfigError::Invalid("x".into()));
    assert_eq!(master.kind(), ErrorKind::InvalidInput);
    // A cross-field rule of the master client: its request cap above half its message limit.
    let f = FileConfig::parse("[node.master]\nmax_request_bytes = \"64MiB\"", Path::new("t")).expect("in range");
    let client = resolve_node(&f, &env(&[]), &node_args(&["--node-id", "n"]), None).expect_err("no headroom");
    assert!(matches!(client, SettingsError::MasterClient(_)) && client.kind() == ErrorKind::InvalidInput);
}

fn master_args(args: &[&str]) -> MasterArgs {
    match Cli::parse_from(["umbp", "master"].iter().chain(args)).command {
        Command::Master(a) => a,
        other => panic!("{other:?}"),
    }
}

/// The master's variables (the reference's names, moved here from `umbp-master` with the table).
#[test]
fn the_masters_variables_override_its_defaults() {
    let e = env(&[
        ("UMBP_HEARTBEAT_TTL_SEC", "4"),
        ("UMBP_HEARTBEAT_INTERVAL_DIVISOR", "4"),
        ("UMBP_MASTER_INDEX_SHARDS", "8"),
        ("UMBP_ROUTE_PUT_SELECT_ALGO", "random"),
        ("UMBP_EVICTKEY_DEADLINE_MS", "250"),
        ("UMBP_CLUSTER_TOKEN", "s3cret"),
        ("UMBP_EXPIRED_RETENTION_SEC", "0"),
    ]);
    let c = resolve_master(&FileConfig::default(), &e, &master_args(&[]), None).expect("valid env");
    assert_eq!(c.heartbeat_interval(), std::time::Duration::from_secs(1));
    assert_eq!(c.index_shards, 8);
    assert_eq!(c.route_put_algo, umbp_master::routing::SelectAlgo::Random);
    assert_eq!(c.eviction.evict_deadline, std::time::Duration::from_millis(250));
    assert_eq!(c.cluster_token.as_deref(), Some("s3cret"));
    assert_eq!(c.expired_retention, std::time::Duration::ZERO);

    let e = env(&[
        ("UMBP_ROUTE_PUT_SELECT_ALGO", " Random "),
        ("UMBP_ROUTE_PUT_NODE_AFFINITY", "local"),
        ("UMBP_METADATA_BACKEND", "inmemory"),
        ("UMBP_MASTER_MAX_MESSAGE_BYTES", "1048576"),
    ]);
    let c = resolve_master(&FileConfig::default(), &e, &master_args(&[]), None).expect("valid env");
    assert_eq!(
        (c.route_put_algo, c.route_put_affinity),
        (umbp_master::routing::SelectAlgo::Random, umbp_master::routing::Affinity::Local)
    );
    assert_eq!(c.max_message_bytes, 1 << 20);
}

#[test]
fn garbage_in_the_masters_variables_is_an_error_naming_the_variable() {
    const BAD: &[(&str, &str)] = &[
        ("UMBP_HEARTBEAT_TTL_SEC", "ten"),
        ("UMBP_HEARTBEAT_TTL_SEC", "-1"),
        ("UMBP_HEARTBEAT_TTL_SEC", "0"),
        ("UMBP_MASTER_INDEX_SHARDS", "5000"),
        ("UMBP_EVICTION_HIGH_WATERMARK", "1.5"),
        ("UMBP_ROUTE_PUT_SELECT_ALGO", "fastest"),
        ("UMBP_ROUTE_PUT_NODE_AFFINITY", "sticky"),
        ("UMBP_METADATA_BACKEND", "redis"),
        ("UMBP_MASTER_MAX_MESSAGE_BYTES", "1000"),
        ("UMBP_EXPIRED_RETENTION_SEC", "5m"),
    ];
    for i in 0..BAD.len() {
        let (var, value) = BAD[i];
        let err = resolve_master(&FileConfig::default(), &env(&BAD[i..=i]), &master_args(&[]), None).expect_err(value);
        assert!(err.to_string().contains(var), "{var}={value}: {err}");
    }
}

/// The master client's variables (the reference's names, moved here from `umbp-peer` with the
/// table), read by `umbp node` and by the client commands.
#[test]
fn the_master_clients_variables_override_its_defaults() {
    let e = env(&[
        ("UMBP_HEARTBEAT_RPC_TIMEOUT_MS", "250"),
        ("UMBP_HEARTBEAT_EVENTS_PER_BUNDLE", "8"),
        ("UMBP_HEARTBEAT_MAX_BUNDLES_PER_RPC", "2"),
        ("UMBP_AUTO_FLUSH_EVENT_THRESHOLD", "0"),
        ("UMBP_RPC_SHUTDOWN_TIMEOUT_MS", "100"),
        ("UMBP_HEARTBEAT_MAX_OUTBOX_EVENTS", "64"),
        ("UMBP_FULL_SYNC_CHUNK_EVENTS", "10"),
        ("UMBP_HEARTBEAT_MAX_REQUEST_BYTES", "65536"),
        ("UMBP_MASTER_RPC_TIMEOUT_MS", "500"),
        ("UMBP_CLEAR_TIMEOUT_MS", "700"),
        ("UMBP_CLUSTER_TOKEN", "s3cret"),
    ]);
    let ms = std::time::Duration::from_millis;
    for c in [
        resolve_node(&FileConfig::default(), &e, &node_args(&["--node-id", "n"]), None).expect("node").master,
        resolve_client(&FileConfig::default(), &e, &MasterAddress::default(), None, "c".into()).expect("client").master,
    ] {
        assert_eq!(c.heartbeat_rpc_timeout, ms(250));
        assert_eq!((c.events_per_bundle, c.max_bundles_per_rpc, c.auto_flush_event_threshold), (8, 2, 0));
        assert_eq!(c.shutdown_timeout, ms(100));
        assert_eq!((c.max_outbox_events, c.full_sync_chunk_events, c.max_request_bytes), (64, 10, 65536));
        assert_eq!((c.rpc_timeout, c.clear_timeout), (ms(500), ms(700)));
        assert_eq!(c.cluster_token.as_deref(), Some("s3cret"));
        c.validate().expect("valid");
        assert!(!format!("{c:?}").contains("s3cret"), "Debug must not print the token");
    }
    // The file's [node.master] and the flags, in their order.
    let f =
        FileConfig::parse("[node.master]\nrpc_timeout = \"9s\"\nevents_per_bundle = 7", Path::new("t")).expect("file");
    let c = resolve_node(&f, &env(&[]), &node_args(&["--node-id", "n"]), None).expect("file");
    assert_eq!((c.master.rpc_timeout, c.master.events_per_bundle), (ms(9000), 7));
    let flags = node_args(&["--node-id", "n", "--master-rpc-timeout", "4s", "--events-per-bundle", "3"]);
    let c = resolve_node(&f, &env(&[("UMBP_MASTER_RPC_TIMEOUT_MS", "500")]), &flags, None).expect("flags");
    assert_eq!((c.master.rpc_timeout, c.master.events_per_bundle), (ms(4000), 3));
}

#[test]
fn garbage_in_the_master_clients_variables_is_an_error_naming_the_variable() {
    const BAD: &[(&str, &str)] = &[
        ("UMBP_HEARTBEAT_RPC_TIMEOUT_MS", "soon"),
        ("UMBP_HEARTBEAT_RPC_TIMEOUT_MS", "0"),
        ("UMBP_HEARTBEAT_EVENTS_PER_BUNDLE", "-1"),
        ("UMBP_HEARTBEAT_MAX_BUNDLES_PER_RPC", "0"),
        ("UMBP_AUTO_FLUSH_EVENT_THRESHOLD", "1.5"),
        ("UMBP_RPC_SHUTDOWN_TIMEOUT_MS", ""),
        ("UMBP_HEARTBEAT_MAX_REQUEST_BYTES", "100"),
    ];
    for i in 0..BAD.len() {
        let (var, value) = BAD[i];
        let e = env(&BAD[i..=i]);
        let err = resolve_node(&FileConfig::default(), &e, &node_args(&["--node-id", "n"]), None).expect_err(value);
        assert!(err.to_string().contains(var), "{var}={value:?}: {err}");
        let err =
            resolve_client(&FileConfig::default(), &e, &MasterAddress::default(), None, "c".into()).expect_err(value);
        assert!(err.to_string().contains(var), "{var}={value:?}: {err}");
    }
}

/// The file's shape in `umbp --help`: every key of the table under its `[table]`, with the
/// component's default where it has one (an unset optional shows an example).
#[test]
fn the_files_shape_in_the_help_lists_every_key_with_its_default() {
    let mut shown = std::collections::HashMap::new();
    let mut table = String::new();
    for line in crate::cli::CONFIG_FILE_HELP.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.split(']').next()) {
            table = header.to_owned();
        } else if let Some((key, value)) = line.split_once(" = ") {
            let key = key.trim();
            let path = if table.is_empty() { key.to_owned() } else { format!("{table}.{key}") };
            let value = value.split(" #").next().unwrap_or(value).trim().to_owned();
            shown.insert(path, value);
        }
    }
    let defaults = Table::try_from(Settings::default()).expect("serialize");
    for row in TABLE {
        let value = shown.get(row.path).unwrap_or_else(|| panic!("`umbp --help` lacks {}", row.path));
        match layer::get(&defaults, row.path) {
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(default) => assert_eq!(*value, default.to_string(), "the help's default of {}", row.path),
            None => {}
        }
    }
}

#[test]
fn the_settings_debug_never_shows_the_cluster_token() {
    let f = FileConfig::parse("cluster_token = \"s3cret-token\"", Path::new("t")).expect("file");
    let file = format!("{f:?}");
    assert!(!file.contains("s3cret-token") && file.contains("<redacted>"), "{file}");
    let shown = format!("{:?}", f.settings().expect("settings"));
    assert!(!shown.contains("s3cret-token") && shown.contains("<redacted>"), "{shown}");
}

/// A list of masters (several masters on one Redis) is one setting, taken whole from the flag, the
/// environment or the file, in that order.
#[test]
fn a_list_of_masters_is_read_whole_from_flag_env_and_file() {
    let file = FileConfig::parse("master_address = \"f1:1,f2:2\"", Path::new("t")).expect("file");
    let none = MasterAddress::default();
    assert_eq!(resolve_master_address(&file, &env(&[]), &none), "f1:1,f2:2");
    let e = env(&[("UMBP_MASTER_ADDRESS", "e1:1,e2:2")]);
    assert_eq!(resolve_master_address(&file, &e, &none), "e1:1,e2:2");
    let flag = MasterAddress { master: Some("a:50051,b:50051".into()) };
    assert_eq!(resolve_master_address(&file, &e, &flag), "a:50051,b:50051");
    let addrs = umbp_peer::master_client::parse_master_addresses(&resolve_master_address(&file, &e, &flag));
    assert_eq!(addrs.expect("a valid list"), ["a:50051", "b:50051"]);
}
