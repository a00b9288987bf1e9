//! `umbp node --medium ssd`: the SSD settings come from the file < `UMBP_*` environment < flags,
//! with their documented defaults, and impossible ones are refused with the setting's name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use umbp::{Cli, Command, FileConfig, SettingsError, resolve_node};
use umbp_peer::pool_client::{IoEngineKind, Medium, PoolClientConfig, SsdConfig};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |var| map.get(var).cloned()
}

fn file(text: &str) -> FileConfig {
    FileConfig::parse(text, Path::new("test.toml")).expect("valid file")
}

fn node_args(args: &[&str]) -> umbp::NodeArgs {
    let cli = Cli::try_parse_from(["umbp", "node"].into_iter().chain(args.iter().copied())).expect("command line");
    match cli.command {
        Command::Node(a) => a,
        other => panic!("parsed {other:?}"),
    }
}

fn ssd(c: &PoolClientConfig) -> &SsdConfig {
    match &c.medium {
        Medium::Ssd(s) => s,
        other => panic!("medium {other:?}"),
    }
}

#[test]
fn ssd_settings_take_the_highest_layer_that_sets_them() {
    let f = file(
        r#"
        [node]
        node_id = "s1"
        medium = "ssd"
        ssd_dirs = ["/file/a", "/file/b"]
        ssd_capacity = "8GiB"
        ssd_io_engine = "io_uring"
        ssd_staging_pages = 8
        ssd_read_lease = "2s"
        "#,
    );
    let c = resolve_node(&f, &env(&[]), &node_args(&[]), None).expect("file only");
    let s = ssd(&c);
    assert_eq!(s.dirs, [PathBuf::from("/file/a"), PathBuf::from("/file/b")]);
    assert_eq!(
        (s.capacity_bytes, s.io_engine, s.staging_pages, s.read_lease),
        (8 << 30, IoEngineKind::IoUring, 8, Duration::from_secs(2))
    );

    let e = env(&[
        ("UMBP_SSD_DIRS", "/env/a, /env/b,/env/c"),
        ("UMBP_SSD_CAPACITY", "1GiB"),
        ("UMBP_SSD_IO_ENGINE", "psync"),
        ("UMBP_SSD_STAGING_PAGES", "32"),
        ("UMBP_SSD_READ_LEASE_MS", "750"),
    ]);
    let c = resolve_node(&f, &e, &node_args(&[]), None).expect("env over file");
    let s = ssd(&c);
    assert_eq!(s.dirs.len(), 3);
    assert_eq!(
        (s.capacity_bytes, s.io_engine, s.staging_pages, s.read_lease),
        (1 << 30, IoEngineKind::Psync, 32, Duration::from_millis(750))
    );

    let flags = node_args(&[
        "--ssd-dir",
        "/flag/x",
        "--ssd-dir",
        "/flag/y",
        "--ssd-capacity",
        "64MiB",
        "--ssd-io-engine",
        "io_uring",
        "--ssd-staging-pages",
        "4",
        "--ssd-read-lease",
        "100ms",
    ]);
    let c = resolve_node(&f, &e, &flags, None).expect("flags over env");
    let s = ssd(&c);
    assert_eq!(s.dirs, [PathBuf::from("/flag/x"), PathBuf::from("/flag/y")]);
    assert_eq!(
        (s.capacity_bytes, s.io_engine, s.staging_pages, s.read_lease),
        (64 << 20, IoEngineKind::IoUring, 4, Duration::from_millis(100))
    );
}

#[test]
fn an_ssd_node_gets_the_documented_defaults_and_needs_a_directory() {
    let c = resolve_node(
        &FileConfig::default(),
        &env(&[]),
        &node_args(&["--node-id", "s1", "--medium", "ssd", "--ssd-dir", "/d"]),
        None,
    )
    .expect("defaults");
    let s = ssd(&c);
    let d = SsdConfig::default();
    assert_eq!(
        (s.capacity_bytes, s.io_engine, s.staging_pages, s.read_lease),
        (32 << 30, IoEngineKind::Psync, 128, d.read_lease)
    );
    assert_eq!(d.read_lease, Duration::from_secs(3));

    let err =
        resolve_node(&FileConfig::default(), &env(&[]), &node_args(&["--node-id", "s1", "--medium", "ssd"]), None)
            .expect_err("no directory");
    assert!(matches!(err, SettingsError::Missing { .. }) && err.to_string().contains("--ssd-dir"), "{err}");
}

#[test]
fn bad_ssd_settings_are_errors_that_name_them() {
    let base = ["--node-id", "s1", "--medium", "ssd", "--ssd-dir", "/d"];
    let flags = node_args(&[&base[..], &["--ssd-io-engine", "aio"]].concat());
    let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err("bad engine");
    assert!(err.to_string().contains("--ssd-io-engine"), "{err}");
    let err = resolve_node(&FileConfig::default(), &env(&[("UMBP_SSD_READ_LEASE_MS", "0")]), &node_args(&base), None)
        .expect_err("zero lease");
    assert!(err.to_string().contains("UMBP_SSD_READ_LEASE_MS"), "{err}");
    let flags = node_args(&[&base[..], &["--ssd-capacity", "1MiB", "--page-size", "2MiB"]].concat());
    let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err("capacity below a page");
    assert!(err.to_string().contains("ssd_capacity"), "{err}");
    assert!(Cli::try_parse_from(["umbp", "node", "--medium", "ssd", "--ssd-capacity", "4GB"]).is_err());
}

#[test]
fn the_ssd_sync_interval_takes_the_highest_layer_and_can_be_off() {
    let base = ["--node-id", "s1", "--medium", "ssd", "--ssd-dir", "/d"];
    let none = FileConfig::default();
    let sync = |f: &FileConfig, e: &[(&str, &str)], extra: &[&str]| {
        let c = resolve_node(f, &env(e), &node_args(&[&base[..], extra].concat()), None).expect("settings");
        ssd(&c).sync_interval
    };
    assert_eq!(SsdConfig::default().sync_interval, Some(Duration::from_secs(1)), "the documented default");
    assert_eq!(sync(&none, &[], &[]), Some(Duration::from_secs(1)));
    let f = file(
        r#"
        [node]
        ssd_sync_interval = "5s"
        "#,
    );
    assert_eq!(sync(&f, &[], &[]), Some(Duration::from_secs(5)), "file");
    assert_eq!(
        sync(&f, &[("UMBP_SSD_SYNC_INTERVAL", "250ms")], &[]),
        Some(Duration::from_millis(250)),
        "env over file"
    );
    assert_eq!(
        sync(&f, &[("UMBP_SSD_SYNC_INTERVAL", "250ms")], &["--ssd-sync-interval", "2s"]),
        Some(Duration::from_secs(2)),
        "flag over env"
    );
    assert_eq!(sync(&f, &[], &["--ssd-sync-interval", "off"]), None, "off: only at shutdown");
    assert_eq!(sync(&none, &[("UMBP_SSD_SYNC_INTERVAL", "off")], &[]), None);

    let err = resolve_node(&none, &env(&[]), &node_args(&[&base[..], &["--ssd-sync-interval", "0s"]].concat()), None)
        .expect_err("zero interval");
    assert!(err.to_string().contains("--ssd-sync-interval"), "{err}");
    let err =
        resolve_node(&none, &env(&[("UMBP_SSD_SYNC_INTERVAL", "soon")]), &node_args(&base), None).expect_err("bad env");
    assert!(err.to_string().contains("UMBP_SSD_SYNC_INTERVAL"), "{err}");
    // A value the component refuses is refused with the file, naming the key.
    let err =
        FileConfig::parse("[node]\nssd_sync_interval = \"5\"\n", Path::new("t.toml")).expect_err("bad file value");
    assert!(err.to_string().contains("ssd_sync_interval"), "{err}");
}

#[test]
fn help_states_the_ssd_sync_interval_and_its_default() {
    use clap::CommandFactory;
    let help = Cli::command().find_subcommand_mut("node").expect("node").render_long_help().to_string();
    for needle in ["--ssd-sync-interval", "[env: UMBP_SSD_SYNC_INTERVAL] [default: 1s]"] {
        assert!(help.contains(needle), "missing {needle:?} in:\n{help}");
    }
}

#[test]
fn the_ssd_max_value_pages_takes_the_highest_layer_and_stays_within_the_staging_arena() {
    let base = ["--node-id", "s1", "--medium", "ssd", "--ssd-dir", "/d"];
    let none = FileConfig::default();
    let pages = |f: &FileConfig, e: &[(&str, &str)], extra: &[&str]| {
        let c = resolve_node(f, &env(e), &node_args(&[&base[..], extra].concat()), None).expect("settings");
        ssd(&c).max_value_pages
    };
    assert_eq!(SsdConfig::default().max_value_pages, 1, "the documented default");
    assert_eq!(pages(&none, &[], &[]), 1);
    let f = file(
        r#"
        [node]
        ssd_max_value_pages = 2
        "#,
    );
    assert_eq!(pages(&f, &[], &[]), 2, "file");
    assert_eq!(pages(&f, &[("UMBP_SSD_MAX_VALUE_PAGES", "3")], &[]), 3, "env over file");
    assert_eq!(pages(&f, &[("UMBP_SSD_MAX_VALUE_PAGES", "3")], &["--ssd-max-value-pages", "4"]), 4, "flag over env");

    // More pages than the staging arena holds (128 by default) could never be staged.
    let err =
        resolve_node(&none, &env(&[]), &node_args(&[&base[..], &["--ssd-max-value-pages", "129"]].concat()), None)
            .expect_err("above the staging pages");
    assert!(err.to_string().contains("ssd_max_value_pages"), "{err}");
    let flags = node_args(&[&base[..], &["--ssd-max-value-pages", "129", "--ssd-staging-pages", "129"]].concat());
    assert_eq!(ssd(&resolve_node(&none, &env(&[]), &flags, None).expect("within a larger arena")).max_value_pages, 129);
    let err = resolve_node(&none, &env(&[("UMBP_SSD_MAX_VALUE_PAGES", "0")]), &node_args(&base), None)
        .expect_err("zero pages");
    assert!(err.to_string().contains("ssd_max_value_pages"), "{err}");
    let err = resolve_node(&none, &env(&[("UMBP_SSD_MAX_VALUE_PAGES", "two")]), &node_args(&base), None)
        .expect_err("bad env");
    assert!(err.to_string().contains("UMBP_SSD_MAX_VALUE_PAGES"), "{err}");
    let err = FileConfig::parse("[node]\nssd_max_value_pages = \"2\"\n", Path::new("t.toml")).expect_err("a string");
    assert!(err.to_string().contains("ssd_max_value_pages"), "{err}");
}

#[test]
fn help_states_the_ssd_max_value_pages_and_its_default() {
    use clap::CommandFactory;
    let help = Cli::command().find_subcommand_mut("node").expect("node").render_long_help().to_string();
    for needle in ["--ssd-max-value-pages", "[env: UMBP_SSD_MAX_VALUE_PAGES] [default: 1]"] {
        assert!(help.contains(needle), "missing {needle:?} in:\n{help}");
    }
    let top = Cli::command().render_long_help().to_string();
    assert!(top.contains("max_value_pages = 1") && top.contains("UMBP_SSD_MAX_VALUE_PAGES"), "{top}");
}

/// The setting reaches the medium: a node resolved with `--ssd-max-value-pages 2` stores and serves a
/// two-page value, one resolved without it refuses the same value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_resolved_with_ssd_max_value_pages_stores_values_of_that_many_pages() {
    let master = umbp_master::start(umbp_master::MasterConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        ..umbp_master::MasterConfig::default()
    })
    .await
    .expect("master");
    let address = master.local_addr().to_string();
    // A directory on the work disk: the medium opens its log with O_DIRECT, which tmpfs refuses.
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cli-ssd-max-pages-{}", std::process::id()));
    let page = 64 << 10;
    let value: Vec<u8> = (0..2 * page).map(|i| (i % 251) as u8).collect();
    for (id, extra, fits) in [("wide", &["--ssd-max-value-pages", "2"][..], true), ("narrow", &[][..], false)] {
        let dir = root.join(id);
        std::fs::create_dir_all(&dir).expect("dir");
        let dir_arg = dir.to_str().expect("utf-8 path");
        let args = [
            "--node-id",
            id,
            "--medium",
            "ssd",
            "--ssd-dir",
            dir_arg,
            "--ssd-capacity",
            "16MiB",
            "--page-size",
            "64KiB",
            "--master",
            &address,
        ];
        let config = resolve_node(&FileConfig::default(), &env(&[]), &node_args(&[&args[..], extra].concat()), None)
            .expect("settings");
        let node = umbp_peer::pool_client::PoolClient::start(config).await.expect("ssd node");
        let put = node.put(&format!("{id}-two-pages"), &value).await;
        if fits {
            put.expect("a two-page value fits two pages");
            let mut back = vec![0u8; value.len()];
            let got = node.get(&format!("{id}-two-pages"), &mut back).await.expect("get");
            assert_eq!((got, back == value), (value.len() as u64, true), "read back byte-exact");
        } else {
            assert!(put.is_err(), "one page per value by default");
        }
        node.close().await;
    }
    master.shutdown().await;
    let _ = std::fs::remove_dir_all(&root);
}
