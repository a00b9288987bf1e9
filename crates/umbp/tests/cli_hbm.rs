//! `umbp node --medium hbm`: the HBM flags, their `UMBP_HBM_*` variables and `[node]` keys in the
//! precedence file < environment < flags, their defaults in `--help`, and an HBM node started from the
//! resolved settings over the fake GPU runtime.

use std::collections::HashMap;
use std::path::Path;

use clap::{CommandFactory, Parser};
use umbp::{Cli, Command, FileConfig, SettingsError, resolve_node};
use umbp_peer::pool_client::{HbmConfig, Medium, PoolClient, RuntimeSelection};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |var| map.get(var).cloned()
}

fn node_args(args: &[&str]) -> umbp::NodeArgs {
    let cli =
        Cli::try_parse_from(["umbp", "node"].into_iter().chain(args.iter().copied())).expect("valid command line");
    match cli.command {
        Command::Node(a) => a,
        other => panic!("parsed {other:?}"),
    }
}

fn hbm(c: &umbp_peer::pool_client::PoolClientConfig) -> HbmConfig {
    match &c.medium {
        Medium::Hbm(h) => h.clone(),
        other => panic!("not an hbm medium: {other:?}"),
    }
}

#[test]
fn hbm_settings_follow_file_then_env_then_flags() {
    let f = FileConfig::parse(
        "[node]\nnode_id = \"g1\"\nmedium = \"hbm\"\nhbm_device = 1\nhbm_capacity = \"256MiB\"\nhbm_runtime = \"fake:2\"\n",
        Path::new("test.toml"),
    )
    .expect("valid file");
    let none = node_args(&[]);
    let c = resolve_node(&f, &env(&[]), &none, None).expect("file");
    assert_eq!(
        hbm(&c),
        HbmConfig { device: 1, capacity_bytes: 256 << 20, runtime: RuntimeSelection::Fake { devices: 2 } }
    );
    let e = env(&[("UMBP_HBM_DEVICE", "0"), ("UMBP_HBM_CAPACITY", "64MiB"), ("UMBP_HBM_RUNTIME", "cuda")]);
    let c = resolve_node(&f, &e, &none, None).expect("file + env");
    assert_eq!(hbm(&c), HbmConfig { device: 0, capacity_bytes: 64 << 20, runtime: RuntimeSelection::Cuda });
    let flags = node_args(&["--hbm-device", "3", "--hbm-capacity", "1GiB", "--hbm-runtime", "hip"]);
    let c = resolve_node(&f, &e, &flags, None).expect("file + env + flags");
    assert_eq!(hbm(&c), HbmConfig { device: 3, capacity_bytes: 1 << 30, runtime: RuntimeSelection::Hip });
    // Defaults, and the medium chosen on the command line.
    let c = resolve_node(&FileConfig::default(), &env(&[]), &node_args(&["--node-id", "g", "--medium", "hbm"]), None)
        .expect("defaults");
    assert_eq!(hbm(&c), HbmConfig::default());
    assert_eq!(
        c.medium,
        Medium::Hbm(HbmConfig { device: 0, capacity_bytes: 1 << 30, runtime: RuntimeSelection::Auto })
    );
}

#[test]
fn bad_hbm_settings_are_refused_with_the_setting_named() {
    let flags = node_args(&["--node-id", "g", "--medium", "hbm", "--hbm-runtime", "opencl"]);
    let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err("unknown runtime");
    assert!(err.to_string().contains("opencl"), "{err}");
    let flags = node_args(&["--node-id", "g", "--medium", "hbm", "--hbm-capacity", "1KiB"]);
    let err = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect_err("smaller than a page");
    assert!(matches!(err, SettingsError::Invalid { setting: "hbm_capacity", .. }), "{err}");
    let flags = node_args(&["--node-id", "g", "--medium", "hbm"]);
    let err =
        resolve_node(&FileConfig::default(), &env(&[("UMBP_HBM_DEVICE", "gpu0")]), &flags, None).expect_err("bad env");
    assert!(err.to_string().contains("UMBP_HBM_DEVICE"), "{err}");
}

#[test]
fn help_states_the_hbm_defaults() {
    let help = Cli::command().find_subcommand_mut("node").expect("node").render_long_help().to_string();
    for needle in
        ["--hbm-device", "[env: UMBP_HBM_DEVICE] [default: 0]", "--hbm-capacity", "[default: 1GiB]", "--hbm-runtime"]
    {
        assert!(help.contains(needle), "missing {needle:?} in:\n{help}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hbm_node_starts_from_resolved_settings_on_the_fake_runtime() {
    let master = umbp_master::start(umbp_master::MasterConfig {
        listen: "127.0.0.1:0".parse().expect("addr"),
        ..umbp_master::MasterConfig::default()
    })
    .await
    .expect("master");
    let flags = node_args(&[
        "--node-id",
        "g",
        "--master",
        &master.local_addr().to_string(),
        "--medium",
        "hbm",
        "--hbm-capacity",
        "8MiB",
        "--hbm-runtime",
        "fake",
        "--page-size",
        "64KiB",
    ]);
    let config = resolve_node(&FileConfig::default(), &env(&[]), &flags, None).expect("settings");
    let node = PoolClient::start(config).await.expect("node starts");
    let value: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
    node.put("k", &value).await.expect("put");
    let mut back = vec![0u8; value.len()];
    assert_eq!(node.get("k", &mut back).await, Ok(value.len() as u64));
    assert_eq!(back, value);
    assert_eq!(format!("{:?}", node.medium().expect("medium").tier()), "Hbm");
    node.close().await;
    master.shutdown().await;
}
