//! `umbp`: the umbp-rs command line. See `umbp --help`; the settings and the demo live in the
//! library half of this crate.

use std::io::{IsTerminal, Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use clap::Parser;
use umbp::{
    BenchSuite, Cli, Command, FileConfig, GetArgs, KeysArgs, MasterAddress, PutArgs, SettingsError, bench, bench_ssd,
    demo, format_size, human_size, resolve_client, resolve_master, resolve_master_address, resolve_max_get_size,
    resolve_node,
};
use umbp_peer::master_client::{NodeLiveness, NodeStatusReport};
use umbp_peer::pool_client::{KeyError, Medium, PoolClient};

/// Exit status when a key is missing.
const EXIT_MISSING: u8 = 1;
/// Exit status of bad usage or configuration (clap uses it too).
const EXIT_USAGE: u8 = 2;
/// Exit status of every other failure.
const EXIT_FAILURE: u8 = 3;
/// Exit status of a client command stopped by SIGINT or SIGTERM (the shell's 128 + SIGINT).
const EXIT_INTERRUPTED: u8 = 130;

/// How long `put` and `rm` wait for the master to see the change (one heartbeat of the node that
/// holds the key).
const VISIBLE_WAIT: Duration = Duration::from_secs(15);

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Processes that run until stopped log their life at info; one-shot commands (the client
    // commands and the demo, whose summary is the point) only warnings.
    init_logs(if matches!(cli.command, Command::Master(_) | Command::Node(_)) { "info" } else { "warn" });
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("umbp: starting the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let env = |var: &str| std::env::var(var).ok();
    match runtime.block_on(run(cli, &env)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("umbp: {}", describe(&e));
            let usage = e.chain().any(|c| {
                c.downcast_ref::<SettingsError>().is_some()
                    || matches!(c.downcast_ref::<demo::DemoError>(), Some(demo::DemoError::Options(_)))
                    || matches!(c.downcast_ref::<bench::BenchError>(), Some(bench::BenchError::Options(_)))
            });
            ExitCode::from(if usage { EXIT_USAGE } else { EXIT_FAILURE })
        }
    }
}

/// The error and its causes on one line, skipping a cause whose text its parent already includes
/// (many errors print their source as part of their own message).
fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut previous = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !previous.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        previous = text;
    }
    out
}

/// Logs go to stderr, so stdout stays clean for `umbp get KEY -`.
fn init_logs(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

async fn run(cli: Cli, env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<ExitCode> {
    let token = cli.token.as_deref();
    let file = || FileConfig::discover(cli.config.as_deref(), env);
    match &cli.command {
        Command::Master(args) => {
            let config = resolve_master(&file()?, env, args, token)?;
            run_master(config).await
        }
        Command::Node(args) => {
            let config = resolve_node(&file()?, env, args, token)?;
            run_node(config).await
        }
        Command::Put(args) => {
            let file = file()?;
            let value = read_source(args.source.as_deref())?;
            let client = join(&file, env, &args.master, token).await?;
            interruptible(&client, put(&client, args, &value)).await
        }
        Command::Get(args) => {
            let file = file()?;
            let max = resolve_max_get_size(&file, args);
            let client = join(&file, env, &args.master, token).await?;
            interruptible(&client, get(&client, args, max)).await
        }
        Command::Exists(args) => {
            let file = file()?;
            let client = join(&file, env, &args.master, token).await?;
            interruptible(&client, exists(&client, args)).await
        }
        Command::Rm(args) => {
            let file = file()?;
            let client = join(&file, env, &args.master, token).await?;
            interruptible(&client, remove(&client, args)).await
        }
        Command::Stat(args) => {
            let file = file()?;
            let address = resolve_master_address(&file, env, &args.master);
            let client = join(&file, env, &args.master, token).await?;
            interruptible(&client, stat(&client, &address)).await
        }
        Command::Demo(args) => {
            let report = demo::run(demo::DemoOptions::from_args(args)).await?;
            println!("{report}");
            Ok(if report.passed() { ExitCode::SUCCESS } else { ExitCode::from(EXIT_FAILURE) })
        }
        Command::Bench(args) if args.suite == Some(BenchSuite::Ssd) => {
            let report = bench_ssd::run(bench_ssd::SsdBenchOptions::from_args(args)?).await?;
            if args.json {
                println!("{}", report.to_json());
            } else {
                println!("{report}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(args) => {
            let report = bench::run(bench::BenchOptions::from_args(args)).await?;
            if args.json {
                println!("{}", report.to_json());
            } else {
                println!("{report}");
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::BenchChild(args) => {
            bench::serve_child(&args.master, args.capacity).await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed before it returns its future, so a
/// signal that arrives after the ready line is never lost.
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                _ = int.recv() => tracing::info!("SIGINT: shutting down"),
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}

async fn run_master(config: umbp_master::MasterConfig) -> anyhow::Result<ExitCode> {
    let signal = shutdown_signal()?;
    let listen = config.listen;
    let handle = umbp_master::start(config).await.with_context(|| format!("starting the master on {listen}"))?;
    match handle.metrics_addr() {
        Some(m) => println!("master ready listen={} metrics={m}", handle.local_addr()),
        None => println!("master ready listen={}", handle.local_addr()),
    }
    signal.await;
    handle.shutdown().await;
    tracing::info!("master stopped");
    Ok(ExitCode::SUCCESS)
}

async fn run_node(config: umbp_peer::pool_client::PoolClientConfig) -> anyhow::Result<ExitCode> {
    let signal = shutdown_signal()?;
    if config.peer_listen.ip().is_unspecified() {
        tracing::warn!(
            listen = %config.peer_listen.ip(),
            "a wildcard listen address is advertised as is: nodes on other hosts cannot reach this one"
        );
    }
    let (id, master) = (config.node_id.clone(), config.master_address.clone());
    let (medium, capacity) = match &config.medium {
        Medium::Dram(d) => ("dram", format_size(d.capacity_bytes)),
        Medium::Ssd(s) => {
            ("ssd", format!("{} engine={} dirs={}", format_size(s.capacity_bytes), s.io_engine, s.dirs.len()))
        }
        Medium::Hbm(h) => ("hbm", format!("{} device={}", format_size(h.capacity_bytes), h.device)),
        _ => ("none", "0".to_owned()),
    };
    raise_open_files_limit();
    let client = PoolClient::start(config)
        .await
        .with_context(|| format!("starting node {id} (master {master}); is `umbp master` running there?"))?;
    let peer = client.peer_address().map_or_else(|| "-".to_owned(), |a| a.to_string());
    // `metrics=` only when the endpoint is on: scripts read the ready line by key.
    let metrics = client.metrics_address().map(|m| format!(" metrics={m}")).unwrap_or_default();
    println!(
        "node {id} ready peer={peer} data={} medium={medium} capacity={capacity} master={master}{metrics}",
        client.data_endpoint()
    );
    signal.await;
    client.close().await;
    tracing::info!(node = %id, "node stopped");
    Ok(ExitCode::SUCCESS)
}

/// Runs one client command's `work`, then leaves the pool; SIGINT or SIGTERM cuts the work short (exit
/// status 130) but still leaves cleanly, so the master is not left waiting for a heartbeat.
async fn interruptible(
    client: &PoolClient,
    work: impl Future<Output = anyhow::Result<ExitCode>>,
) -> anyhow::Result<ExitCode> {
    let signal = shutdown_signal()?;
    let result = tokio::select! {
        r = work => r,
        () = signal => {
            eprintln!("umbp: interrupted");
            Ok(ExitCode::from(EXIT_INTERRUPTED))
        }
    };
    client.close().await;
    result
}

/// Joins the pool as a node with no medium for the duration of one command.
async fn join(
    file: &FileConfig,
    env: &dyn Fn(&str) -> Option<String>,
    master: &MasterAddress,
    token: Option<&str>,
) -> anyhow::Result<PoolClient> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let node_id = format!("cli-{}-{nanos:08x}", std::process::id());
    let config = resolve_client(file, env, master, token, node_id)?;
    let address = config.master_address.clone();
    PoolClient::start(config).await.with_context(|| format!("joining the pool through the master at {address}"))
}

/// Waits until the master's index says `present` for every key, at most [`VISIBLE_WAIT`].
async fn until_indexed(client: &PoolClient, keys: &[String], present: bool) -> bool {
    let deadline = Instant::now() + VISIBLE_WAIT;
    loop {
        match client.master().batch_lookup(keys).await {
            Ok(found) if found.iter().all(|f| *f == present) => return true,
            _ if Instant::now() >= deadline => return false,
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

fn read_source(source: Option<&Path>) -> anyhow::Result<Vec<u8>> {
    match source {
        None => read_stdin(),
        Some(p) if p == Path::new("-") => read_stdin(),
        Some(p) => std::fs::read(p).with_context(|| format!("reading {}", p.display())),
    }
}

fn read_stdin() -> anyhow::Result<Vec<u8>> {
    let mut data = Vec::new();
    std::io::stdin().lock().read_to_end(&mut data).context("reading stdin")?;
    Ok(data)
}

async fn put(client: &PoolClient, args: &PutArgs, value: &[u8]) -> anyhow::Result<ExitCode> {
    client.put(&args.key, value).await.map_err(|e| anyhow!("put {}: {e}", args.key))?;
    // A get from another process finds the key through the master, which hears of it at the holder's
    // next heartbeat: return once it has, so `put` then `get` always works.
    let visible = until_indexed(client, std::slice::from_ref(&args.key), true).await;
    println!("stored {} ({})", args.key, human_size(value.len() as u64));
    if !visible {
        eprintln!(
            "umbp: note: the master has not indexed {} yet; other clients find it after the next heartbeat",
            args.key
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn get(client: &PoolClient, args: &GetArgs, max: u64) -> anyhow::Result<ExitCode> {
    let len = usize::try_from(max).context("--max-size does not fit in memory")?;
    let mut buf = vec![0u8; len];
    match client.get(&args.key, &mut buf).await {
        Ok(size) => {
            let value = &buf[..size as usize];
            match args.dest.as_deref() {
                None => write_stdout(value)?,
                Some(p) if p == Path::new("-") => write_stdout(value)?,
                Some(p) => std::fs::write(p, value).with_context(|| format!("writing {}", p.display()))?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(KeyError::Miss) => {
            eprintln!("umbp: {}: not found", args.key);
            Ok(ExitCode::from(EXIT_MISSING))
        }
        Err(KeyError::BufferTooSmall { needed, .. }) => {
            bail!(
                "{}: the value is {needed} bytes, more than --max-size {}; pass --max-size {needed}",
                args.key,
                format_size(max)
            )
        }
        Err(e) => bail!("get {}: {e}", args.key),
    }
}

fn write_stdout(value: &[u8]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(value).and_then(|()| out.flush()).context("writing stdout")
}

async fn exists(client: &PoolClient, args: &KeysArgs) -> anyhow::Result<ExitCode> {
    let keys: Vec<&str> = args.keys.iter().map(String::as_str).collect();
    let found = client.batch_exists(&keys).await.map_err(|e| anyhow!("{e}"))?;
    for (key, present) in keys.iter().zip(&found) {
        println!("{}\t{key}", if *present { "present" } else { "missing" });
    }
    Ok(if found.iter().all(|f| *f) { ExitCode::SUCCESS } else { ExitCode::from(EXIT_MISSING) })
}

async fn remove(client: &PoolClient, args: &KeysArgs) -> anyhow::Result<ExitCode> {
    let keys: Vec<&str> = args.keys.iter().map(String::as_str).collect();
    let freed = client.remove(&keys).await.map_err(|e| anyhow!("{e}"))?;
    for (key, bytes) in keys.iter().zip(&freed) {
        if *bytes > 0 {
            println!("removed\t{key}\t{}", human_size(*bytes));
        } else {
            println!("not removed\t{key}\t(no node held it, or a reader held it just now)");
        }
    }
    let removed: Vec<String> = keys.iter().zip(&freed).filter(|(_, b)| **b > 0).map(|(k, _)| (*k).to_owned()).collect();
    if !removed.is_empty() && !until_indexed(client, &removed, false).await {
        eprintln!("umbp: note: the master still lists some removed keys; it drops them at the next heartbeat");
    }
    Ok(ExitCode::SUCCESS)
}

fn age(d: Duration) -> String {
    if d.as_secs() >= 120 { format!("{}m ago", d.as_secs() / 60) } else { format!("{:.1}s ago", d.as_secs_f64()) }
}

fn capacity_cells(node: &NodeStatusReport) -> (String, String) {
    if node.tier_capacities.is_empty() {
        return ("-".into(), "- (client)".into());
    }
    let tiers: Vec<String> = node.tier_capacities.iter().map(|(t, _)| t.to_string().to_lowercase()).collect();
    let total: u64 = node.tier_capacities.iter().map(|(_, c)| c.total_bytes).sum();
    let free: u64 = node.tier_capacities.iter().map(|(_, c)| c.available_bytes).sum();
    (tiers.join(","), format!("{} / {}", human_size(total.saturating_sub(free)), human_size(total)))
}

async fn stat(client: &PoolClient, address: &str) -> anyhow::Result<ExitCode> {
    let status = client.master().cluster_status().await.map_err(|e| anyhow!("cluster status: {e}"))?;
    let nodes: Vec<&NodeStatusReport> = status.nodes.iter().filter(|n| n.node_id != client.node_id()).collect();
    let alive = nodes.iter().filter(|n| n.status == NodeLiveness::Alive).count();
    let plural = |n: u64, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    println!(
        "master {address}: {} ({alive} alive), {}",
        plural(nodes.len() as u64, "node"),
        plural(status.total_keys, "key")
    );
    if nodes.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<[String; 7]> = nodes
        .iter()
        .map(|n| {
            let (tier, used) = capacity_cells(n);
            let status = match n.status {
                NodeLiveness::Alive => "alive",
                NodeLiveness::Expired => "expired",
                _ => "unknown",
            };
            let peer = if n.peer_address.is_empty() { "-".to_owned() } else { n.peer_address.clone() };
            [n.node_id.clone(), status.into(), tier, used, n.key_count.to_string(), age(n.last_heartbeat_age), peer]
        })
        .collect();
    let header = ["NODE", "STATUS", "TIER", "USED / CAPACITY", "KEYS", "HEARTBEAT", "PEER"];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; 7]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            // Numbers right-aligned, text left-aligned.
            if i == 4 { s.push_str(&format!("{cell:>w$}  ")) } else { s.push_str(&format!("{cell:<w$}  ")) }
        }
        s.trim_end().to_owned()
    };
    println!();
    println!("{}", line(header));
    for row in &rows {
        println!("{}", line(std::array::from_fn(|i| row[i].as_str())));
    }
    Ok(ExitCode::SUCCESS)
}

/// Raises this process's soft limit on open files to its hard limit, as servers do: an SSD node keeps
/// one descriptor per log segment (about 16k for 4 TiB of 256 MiB segments) and refuses to start when
/// the soft limit cannot cover its worst case, and the common soft default (1024) is far below the
/// usual hard limit. Best effort: a failure leaves the limit as it was, and the medium's own check
/// then says what to raise.
fn raise_open_files_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid, writable rlimit for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 || limit.rlim_cur >= limit.rlim_max {
        return;
    }
    let before = limit.rlim_cur;
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: `limit` is a valid rlimit; raising the soft limit up to the hard one needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } == 0 {
        tracing::debug!(from = before, to = limit.rlim_cur, "raised the open-files soft limit to the hard limit");
    }
}
