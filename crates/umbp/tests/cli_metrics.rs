//! `--metrics-addr` on `umbp master` and `umbp node`: the settings' precedence (file < `UMBP_*` <
//! flag), and real processes whose `/metrics` is fetched over HTTP, as `curl` would.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::Parser;
use umbp::{Cli, FileConfig, resolve_master, resolve_node};

mod metrics_support;

use metrics_support::scrape;

const UMBP: &str = env!("CARGO_BIN_EXE_umbp");

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    move |var| map.get(var).cloned()
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("addr")
}

#[test]
fn metrics_addr_comes_from_file_then_env_then_flag_and_defaults_to_none() {
    let file = FileConfig::parse(
        "[master]\nmetrics_addr = \"127.0.0.1:7001\"\n[node]\nnode_id = \"n1\"\nmetrics_addr = \"127.0.0.1:7002\"\n",
        Path::new("test.toml"),
    )
    .expect("file");
    let master = |args: &[&str]| match Cli::try_parse_from([&["umbp", "master"], args].concat()).expect("cli").command {
        umbp::Command::Master(a) => a,
        other => panic!("{other:?}"),
    };
    let node = |args: &[&str]| match Cli::try_parse_from([&["umbp", "node"], args].concat()).expect("cli").command {
        umbp::Command::Node(a) => a,
        other => panic!("{other:?}"),
    };
    let none = env(&[]);
    let m_env = env(&[("UMBP_MASTER_METRICS_ADDR", "127.0.0.1:7101")]);
    let n_env = env(&[("UMBP_NODE_METRICS_ADDR", "127.0.0.1:7102"), ("UMBP_NODE_ID", "n1")]);

    assert_eq!(resolve_master(&FileConfig::default(), &none, &master(&[]), None).expect("m").metrics_listen, None);
    assert_eq!(
        resolve_master(&file, &none, &master(&[]), None).expect("m").metrics_listen,
        Some(addr("127.0.0.1:7001"))
    );
    assert_eq!(
        resolve_master(&file, &m_env, &master(&[]), None).expect("m").metrics_listen,
        Some(addr("127.0.0.1:7101"))
    );
    let flag = master(&["--metrics-addr", "127.0.0.1:7201"]);
    assert_eq!(resolve_master(&file, &m_env, &flag, None).expect("m").metrics_listen, Some(addr("127.0.0.1:7201")));

    let bare = node(&["--node-id", "n1"]);
    assert_eq!(resolve_node(&FileConfig::default(), &none, &bare, None).expect("n").metrics_listen, None);
    assert_eq!(resolve_node(&file, &none, &node(&[]), None).expect("n").metrics_listen, Some(addr("127.0.0.1:7002")));
    assert_eq!(resolve_node(&file, &n_env, &node(&[]), None).expect("n").metrics_listen, Some(addr("127.0.0.1:7102")));
    let flag = node(&["--metrics-addr", "127.0.0.1:7202"]);
    assert_eq!(resolve_node(&file, &n_env, &flag, None).expect("n").metrics_listen, Some(addr("127.0.0.1:7202")));

    assert!(resolve_node(&file, &env(&[("UMBP_NODE_METRICS_ADDR", "nowhere")]), &node(&[]), None).is_err());
    let help = format!("{}", <Cli as clap::CommandFactory>::command().render_long_help());
    assert!(help.contains("metrics_addr"), "the file's shape documents metrics_addr");
}

/// A child process, killed on drop, whose stdout lines arrive on a channel.
struct Proc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(UMBP)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn umbp");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self { child, lines }
    }

    /// The ready line's `metrics=` and `listen=` values (when present).
    fn ready(&self) -> HashMap<String, String> {
        let line = self.lines.recv_timeout(Duration::from_secs(30)).expect("a ready line within 30 s");
        assert!(line.contains(" ready "), "{line}");
        line.split_whitespace().filter_map(|w| w.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn curl_of_running_master_and_node_processes_shows_their_series() {
    let master = Proc::start(&["master", "--listen", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0"]);
    let m = master.ready();
    let node = Proc::start(&[
        "node",
        "--master",
        &m["listen"],
        "--node-id",
        "proc-n1",
        "--capacity",
        "8MiB",
        "--page-size",
        "64KiB",
        "--prefault",
        "false",
        "--metrics-addr",
        "127.0.0.1:0",
    ]);
    let n = node.ready();
    // The master learns the node at registration; the node's medium series appear at its first call,
    // its state gauges at once.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let master_text = scrape(&m["metrics"]);
        let node_text = scrape(&n["metrics"]);
        let master_ok = master_text.contains("umbp_master_nodes{status=\"alive\"} 1")
            && master_text.contains("umbp_master_capacity_total_bytes{node=\"proc-n1\",tier=\"DRAM\"} 8388608");
        let node_ok = node_text.lines().any(|l| {
            l.starts_with("umbp_backend_medium_state{") && l.contains("node=\"proc-n1\"") && l.contains("tier=\"DRAM\"")
        });
        if master_ok && node_ok {
            break;
        }
        assert!(Instant::now() < deadline, "series never appeared:\nmaster:\n{master_text}\nnode:\n{node_text}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
