//! The `umbp` command line as a library function, [`cli_main`]: the `umbp` binary is a one-line
//! `main` around it, and the Python package's native module calls it for `python -m umbp`, so one
//! install of either gives an operator the same commands.

use std::borrow::Cow;
use std::ffi::OsString;
use std::fmt;
use std::io::{IsTerminal, Read, Write};
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::task::Poll;
use std::time::{Duration, Instant};

use crate::{
    BenchSuite, Cli, Command, FileConfig, GetArgs, KeysArgs, MasterAddress, PutArgs, SettingsError, bench,
    bench_checksum, bench_metadata, bench_ranged, bench_soak, bench_ssd, demo, format_size, human_size, resolve_client,
    resolve_master, resolve_master_address, resolve_max_get_size, resolve_node,
};
use anyhow::{Context, anyhow, bail};
use clap::Parser;
use umbp_peer::master_client::{MasterClientError, NodeLiveness, NodeStatusReport};
use umbp_peer::pool_client::{KeyError, Medium, PoolClient, PoolError, PutOutcome};

/// Exit status when a key is missing.
const EXIT_MISSING: u8 = 1;
/// Exit status of bad usage or configuration (clap uses it too).
const EXIT_USAGE: u8 = 2;
/// Exit status of every other failure.
const EXIT_FAILURE: u8 = 3;
/// Exit status of a client command stopped by SIGINT or SIGTERM (the shell's 128 + SIGINT).
const EXIT_INTERRUPTED: u8 = 130;
/// Exit status when the reader of stdout went away (`umbp stat | head -1`): the shell's 128 +
/// SIGPIPE, what a process killed by the signal reports.
const EXIT_PIPE_CLOSED: u8 = 141;

/// How long `rm` keeps retrying a key a reader holds (a route-get lease is 2 s and an SSD read lease
/// 3 s by default; readers release theirs as soon as their copy is done).
const REMOVE_WAIT: Duration = Duration::from_secs(10);

/// Keys longer than this are shown shortened in messages (a key can be kilobytes).
const KEY_SHOWN_MAX: usize = 100;

/// How long `put` and `rm` wait for the master to see the change (one heartbeat of the node that
/// holds the key).
const VISIBLE_WAIT: Duration = Duration::from_secs(15);

/// The `umbp` command line: parses `args` (the program name first, as `std::env::args_os` gives
/// them), runs the command and returns its exit status. The `umbp` binary and the Python package's
/// `python -m umbp` both call it, so it never exits the process itself: clap's `--help` and usage
/// errors are printed and returned as 0 and 2. Each call builds its own async runtime; logging is set
/// up by the first call in a process (a later call logs through it). SIGINT and SIGTERM stop
/// `master`, `node` and the client commands cleanly once their handlers are in (tokio's, which chain
/// to a handler the host process had, e.g. Python's).
pub fn cli_main(args: Vec<OsString>) -> u8 {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` go to stdout with status 0, usage errors to stderr with 2.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(EXIT_USAGE);
        }
    };
    // Processes that run until stopped log their life at info; one-shot commands (the client
    // commands and the demo, whose summary is the point) only warnings.
    init_logs(if matches!(cli.command, Command::Master(_) | Command::Node(_)) { "info" } else { "warn" });
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("umbp: starting the async runtime: {e}");
            return EXIT_FAILURE;
        }
    };
    let env = |var: &str| std::env::var(var).ok();
    match runtime.block_on(run(cli, &env)) {
        Ok(code) => code,
        Err(e) if e.chain().any(|c| c.downcast_ref::<StdoutClosed>().is_some()) => EXIT_PIPE_CLOSED,
        Err(e) => {
            let usage = e.downcast_ref::<ConfigurationError>().is_some()
                || e.chain().any(|c| {
                    c.downcast_ref::<SettingsError>().is_some()
                        || matches!(c.downcast_ref::<demo::DemoError>(), Some(demo::DemoError::Options(_)))
                        || matches!(c.downcast_ref::<bench::BenchError>(), Some(bench::BenchError::Options(_)))
                });
            warn_line(&format!("umbp: {}", describe(&e)));
            if usage { EXIT_USAGE } else { EXIT_FAILURE }
        }
    }
}

/// The reader of stdout went away: the command stops quietly (exit status 141), leaving the pool
/// cleanly on its way out.
#[derive(Debug)]
struct StdoutClosed;

impl fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("stdout was closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// A failure that comes from how the command was set up (a port in use, a wrong token, a node id
/// another process holds), not from the pool: exit status 2, as for a bad setting. It is the
/// context of the error it explains, and says what was being done.
#[derive(Debug)]
struct ConfigurationError(String);

impl fmt::Display for ConfigurationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigurationError {}

/// Writes one line to stdout; a closed stdout is [`StdoutClosed`] instead of the panic `println!`
/// gives (Rust ignores SIGPIPE, so the write fails with `EPIPE`).
fn out(line: impl fmt::Display) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(anyhow::Error::new(StdoutClosed)),
        Err(e) => Err(anyhow::Error::new(e).context("writing stdout")),
    }
}

/// Writes one line to stderr; a closed stderr is ignored (`eprintln!` would panic).
fn warn_line(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// `key` for a message: in full up to [`KEY_SHOWN_MAX`] bytes, else its start, an ellipsis and its
/// length.
fn shown(key: &str) -> Cow<'_, str> {
    if key.len() <= KEY_SHOWN_MAX {
        return Cow::Borrowed(key);
    }
    let mut end = 64;
    while !key.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}… ({} bytes)", &key[..end], key.len()))
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

/// Logs go to stderr, so stdout stays clean for `umbp get KEY -`. Only the first call in a process
/// installs the subscriber (a host such as Python may run several commands).
fn init_logs(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

async fn run(cli: Cli, env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<u8> {
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
            let max = resolve_max_get_size(&file, env, args)?;
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
            out(&report)?;
            Ok(if report.passed() { 0 } else { EXIT_FAILURE })
        }
        Command::Bench(args) if args.suite == Some(BenchSuite::Ssd) => {
            let report = bench_ssd::run(bench_ssd::SsdBenchOptions::from_args(args)?).await?;
            if args.json {
                out(report.to_json())?
            } else {
                out(&report)?
            }
            Ok(0)
        }
        Command::Bench(args) if args.suite == Some(BenchSuite::Ranged) => {
            let report = bench_ranged::run(bench_ranged::RangedOptions::from_args(args)).await?;
            if args.json {
                out(report.to_json())?
            } else {
                out(&report)?
            }
            Ok(0)
        }
        Command::Bench(args) if args.suite == Some(BenchSuite::Checksum) => {
            let report = bench_checksum::run(bench_checksum::ChecksumOptions::from_args(args)).await?;
            if args.json {
                out(report.to_json())?
            } else {
                out(&report)?
            }
            Ok(0)
        }
        Command::Bench(args) if args.suite == Some(BenchSuite::Soak) => {
            out(&bench_soak::run(bench_soak::SoakOptions::from_args(args)).await?)?;
            Ok(0)
        }
        Command::Bench(args) if args.suite == Some(BenchSuite::Metadata) => {
            let report = bench_metadata::run(bench_metadata::MetadataBenchOptions::from_args(args)).await?;
            if args.json {
                out(report.to_json())?
            } else {
                out(&report)?
            }
            Ok(0)
        }
        Command::Bench(args) => {
            let report = bench::run(bench::BenchOptions::from_args(args)).await?;
            if args.json {
                out(report.to_json())?
            } else {
                out(&report)?
            }
            Ok(0)
        }
        Command::BenchChild(args) => {
            bench::serve_child(&args.master, args.capacity).await?;
            Ok(0)
        }
        Command::ChaosClient(args) => crate::chaos::run(args).await,
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

async fn run_master(config: umbp_master::MasterConfig) -> anyhow::Result<u8> {
    let signal = shutdown_signal()?;
    let listen = config.listen;
    let handle = umbp_master::start(config).await.with_context(|| format!("starting the master on {listen}"))?;
    // A supervisor may close the pipe once it has read the ready line: the master runs on.
    let _ = match handle.metrics_addr() {
        Some(m) => out(format_args!("master ready listen={} metrics={m}", handle.local_addr())),
        None => out(format_args!("master ready listen={}", handle.local_addr())),
    };
    signal.await;
    handle.shutdown().await;
    tracing::info!("master stopped");
    Ok(0)
}

async fn run_node(config: umbp_peer::pool_client::PoolClientConfig) -> anyhow::Result<u8> {
    let signal = shutdown_signal()?;
    if config.peer_listen.ip().is_unspecified() {
        tracing::warn!(
            listen = %config.peer_listen.ip(),
            "a wildcard listen address is advertised as is: nodes on other hosts cannot reach this one"
        );
    }
    let (id, master) = (config.node_id.clone(), config.master_address.clone());
    // The name and the capacity come from the medium itself (every medium has both); a few add a
    // detail here.
    let medium = config.medium.name();
    let detail = match &config.medium {
        Medium::Ssd(s) => format!(" engine={} dirs={}", s.io_engine, s.dirs.len()),
        Medium::Hbm(h) => format!(" device={}", h.device),
        _ => String::new(),
    };
    let capacity = match &config.medium {
        Medium::None => "0".to_owned(),
        m => format!("{}{detail}", format_size(m.capacity_bytes())),
    };
    // An SSD node keeps one descriptor per log segment (about 16k for 4 TiB of 256 MiB segments) and
    // refuses to start when the soft limit cannot cover its worst case; the data server holds up to a
    // few thousand connections. The common soft default (1024) is far below the usual hard limit.
    // Best effort: on failure the medium's own check says what to raise.
    match umbp_peer::raise_open_file_limit() {
        Ok(limit) => tracing::debug!(limit, "open-files soft limit"),
        Err(e) => tracing::debug!(error = %e, "could not raise the open-files soft limit"),
    }
    let client = match PoolClient::start(config).await {
        Ok(c) => c,
        Err(e) => return Err(start_failure(e, &id, &master)),
    };
    // Ready means servable: the keys a medium recovered (an SSD node's log) are in the master's
    // index before the ready line, so a reader that starts on it finds them.
    let indexed = until_recovered_keys_indexed(&client).await;
    let peer = client.peer_address().map_or_else(|| "-".to_owned(), |a| a.to_string());
    // `metrics=` only when the endpoint is on: scripts read the ready line by key.
    let metrics = client.metrics_address().map(|m| format!(" metrics={m}")).unwrap_or_default();
    let keys = client.medium().map(|m| format!(" keys={}", m.owned_key_count())).unwrap_or_default();
    let _ = out(format_args!(
        "node {id} ready peer={peer} data={} medium={medium} capacity={capacity}{keys} master={master}{metrics}",
        client.data_endpoint()
    ));
    if !indexed {
        tracing::warn!(node = %id, "the master has not indexed every recovered key yet; they become readable as it does");
    }
    let superseded = tokio::select! {
        () = signal => false,
        // Another process started under this id (a supervisor's restart, or a mistake): the newer one
        // owns the id at the master now, and this one would only serve keys nobody is routed to.
        () = client.master().wait_superseded() => true,
    };
    client.close().await;
    if superseded {
        return Err(anyhow::Error::new(ConfigurationError(format!(
            "node {id} stopped: a newer process registered with the same --node-id and took over; \
             give each process its own id"
        ))));
    }
    tracing::info!(node = %id, "node stopped");
    Ok(0)
}

/// Why `umbp node` could not start, with the hint and the exit status that fit: "is `umbp master`
/// running there?" only when the master could not be reached, exit status 2 for what the operator
/// must fix in the setup (a port in use, a wrong token, a bad directory), 3 for the rest.
fn start_failure(e: PoolError, id: &str, master: &str) -> anyhow::Error {
    let unreachable = |m: &MasterClientError| match m {
        MasterClientError::Connect { .. } | MasterClientError::Timeout { .. } => true,
        MasterClientError::Rpc { status, .. } => {
            matches!(status.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded)
        }
        _ => false,
    };
    let (hint, configuration) = match &e {
        PoolError::Master(m) if unreachable(m) => (Some("is `umbp master` running there?"), false),
        PoolError::Master(MasterClientError::Rpc { status, .. })
            if matches!(status.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied) =>
        {
            (Some("check the cluster token (--token, UMBP_CLUSTER_TOKEN)"), true)
        }
        PoolError::Master(MasterClientError::AlreadyRegistered { .. }) => {
            (Some("another process runs under this --node-id"), true)
        }
        PoolError::Master(MasterClientError::Config(_) | MasterClientError::InvalidArgument(_))
        | PoolError::Config(_) => (None, true),
        e if e.is_bind_failure() => (None, true),
        _ => (None, false),
    };
    let mut text = format!("starting node {id} (master {master})");
    if let Some(h) = hint {
        text = format!("{text}; {h}");
    }
    let e = anyhow::Error::new(e);
    if configuration { e.context(ConfigurationError(text)) } else { e.context(text) }
}

/// Waits (at most [`VISIBLE_WAIT`]) until the master's index holds as many keys of this node as its
/// medium owns: what it recovered at start-up reaches the master with the first full sync.
async fn until_recovered_keys_indexed(client: &PoolClient) -> bool {
    let Some(medium) = client.medium() else { return true };
    let owned = medium.owned_key_count() as u64;
    if owned == 0 {
        return true;
    }
    let deadline = Instant::now() + VISIBLE_WAIT;
    loop {
        let indexed = client
            .master()
            .cluster_status()
            .await
            .ok()
            .and_then(|s| s.nodes.iter().find(|n| n.node_id == client.node_id()).map(|n| n.key_count));
        if indexed.is_some_and(|k| k >= owned) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs one client command's `work`, then leaves the pool; SIGINT or SIGTERM cuts the work short (exit
/// status 130) but still leaves cleanly, so the master is not left waiting for a heartbeat. A panic
/// in `work` leaves cleanly too, then goes on unwinding.
async fn interruptible(client: &PoolClient, work: impl Future<Output = anyhow::Result<u8>>) -> anyhow::Result<u8> {
    let signal = shutdown_signal()?;
    let mut work = Box::pin(work);
    let caught =
        std::future::poll_fn(|cx| match std::panic::catch_unwind(AssertUnwindSafe(|| work.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(r)) => Poll::Ready(Ok(r)),
            Err(panic) => Poll::Ready(Err(panic)),
        });
    let result = tokio::select! {
        r = caught => r,
        () = signal => {
            warn_line("umbp: interrupted");
            Ok(Ok(EXIT_INTERRUPTED))
        }
    };
    client.close().await;
    match result {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
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

async fn put(client: &PoolClient, args: &PutArgs, value: &[u8]) -> anyhow::Result<u8> {
    let key = shown(&args.key);
    let mut outcome = client.put_outcome(&args.key, value).await.map_err(|e| anyhow!("put {key}: {e}"))?;
    if outcome == PutOutcome::AlreadyPresent && args.replace {
        // Values are write-once: replacing is removing, then writing. A reader in between misses.
        let removed = remove_keys(client, std::slice::from_ref(&args.key)).await?;
        if let Some(k) = removed.held.first() {
            bail!("put {}: the stored value could not be removed (a reader holds it); nothing was written", shown(k));
        }
        if !until_indexed(client, std::slice::from_ref(&args.key), false).await {
            bail!("put {key}: the master still lists the old value after {VISIBLE_WAIT:?}; nothing was written");
        }
        outcome = client.put_outcome(&args.key, value).await.map_err(|e| anyhow!("put {key}: {e}"))?;
    }
    if outcome == PutOutcome::AlreadyPresent {
        out(format_args!(
            "kept {key}: already present, its stored value was kept{}",
            if args.replace { " (another writer stored it again)" } else { " (pass --replace to overwrite it)" }
        ))?;
        return Ok(0);
    }
    // A get from another process finds the key through the master, which hears of it at the holder's
    // next heartbeat: return once it has, so `put` then `get` always works.
    let visible = until_indexed(client, std::slice::from_ref(&args.key), true).await;
    out(format_args!("stored {key} ({})", human_size(value.len() as u64)))?;
    if !visible {
        warn_line(&format!(
            "umbp: note: the master has not indexed {key} yet; other clients find it after the next heartbeat"
        ));
    }
    Ok(0)
}

async fn get(client: &PoolClient, args: &GetArgs, max: u64) -> anyhow::Result<u8> {
    let key = shown(&args.key);
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
            Ok(0)
        }
        Err(KeyError::Miss) => {
            warn_line(&format!("umbp: {key}: not found"));
            Ok(EXIT_MISSING)
        }
        Err(KeyError::BufferTooSmall { needed, .. }) => {
            bail!(
                "{key}: the value is {needed} bytes, more than --max-size {}; pass --max-size {needed}",
                format_size(max)
            )
        }
        Err(e) => bail!("get {key}: {e}"),
    }
}

fn write_stdout(value: &[u8]) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(value).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(anyhow::Error::new(StdoutClosed)),
        Err(e) => Err(anyhow::Error::new(e).context("writing stdout")),
    }
}

async fn exists(client: &PoolClient, args: &KeysArgs) -> anyhow::Result<u8> {
    let keys: Vec<&str> = args.keys.iter().map(String::as_str).collect();
    let found = client.batch_exists(&keys).await.map_err(|e| anyhow!("{e}"))?;
    for (key, present) in keys.iter().zip(&found) {
        out(format_args!("{}\t{}", if *present { "present" } else { "missing" }, shown(key)))?;
    }
    Ok(if found.iter().all(|f| *f) { 0 } else { EXIT_MISSING })
}

/// What [`remove_keys`] found, per key.
#[derive(Debug, Default)]
struct Removal {
    /// Removed keys and the bytes each freed.
    removed: Vec<(String, u64)>,
    /// Keys no node held.
    missing: Vec<String>,
    /// Keys still held when [`REMOVE_WAIT`] ran out: a reader kept leasing them.
    held: Vec<String>,
}

/// Removes every replica of each key. A key a reader holds (its read lease) cannot be freed yet:
/// it is retried until the lease ends, at most [`REMOVE_WAIT`].
async fn remove_keys(client: &PoolClient, keys: &[String]) -> anyhow::Result<Removal> {
    let mut result = Removal::default();
    let mut pending: Vec<String> = keys.to_vec();
    let deadline = Instant::now() + REMOVE_WAIT;
    loop {
        let refs: Vec<&str> = pending.iter().map(String::as_str).collect();
        let freed = client.remove(&refs).await.map_err(|e| anyhow!("{e}"))?;
        let not_freed: Vec<&str> = refs.iter().zip(&freed).filter(|(_, b)| **b == 0).map(|(k, _)| *k).collect();
        let present = if not_freed.is_empty() {
            Vec::new()
        } else {
            client.batch_exists(&not_freed).await.map_err(|e| anyhow!("{e}"))?
        };
        let mut still = Vec::new();
        for (key, bytes) in pending.iter().zip(&freed).filter(|(_, b)| **b > 0) {
            result.removed.push((key.clone(), *bytes));
        }
        for (key, present) in not_freed.iter().zip(present) {
            if present { still.push((*key).to_owned()) } else { result.missing.push((*key).to_owned()) }
        }
        pending = still;
        if pending.is_empty() {
            return Ok(result);
        }
        if Instant::now() >= deadline {
            result.held = pending;
            return Ok(result);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn remove(client: &PoolClient, args: &KeysArgs) -> anyhow::Result<u8> {
    let r = remove_keys(client, &args.keys).await?;
    for (key, bytes) in &r.removed {
        out(format_args!("removed\t{}\t{}", shown(key), human_size(*bytes)))?;
    }
    for key in &r.missing {
        out(format_args!("missing\t{}", shown(key)))?;
    }
    for key in &r.held {
        out(format_args!("held\t{}\t(a reader kept it leased for {REMOVE_WAIT:?}; try again)", shown(key)))?;
    }
    let removed: Vec<String> = r.removed.iter().map(|(k, _)| k.clone()).collect();
    if !removed.is_empty() && !until_indexed(client, &removed, false).await {
        warn_line("umbp: note: the master still lists some removed keys; it drops them at the next heartbeat");
    }
    Ok(if !r.held.is_empty() {
        EXIT_FAILURE
    } else if !r.missing.is_empty() {
        EXIT_MISSING
    } else {
        0
    })
}

fn age(d: Duration) -> String {
    if d.as_secs() >= 120 { format!("{}m ago", d.as_secs() / 60) } else { format!("{:.1}s ago", d.as_secs_f64()) }
}

fn capacity_cells(node: &NodeStatusReport) -> (String, String) {
    let tiers: Vec<String> = node.tier_capacities.iter().map(|(t, _)| t.to_string().to_lowercase()).collect();
    let total: u64 = node.tier_capacities.iter().map(|(_, c)| c.total_bytes).sum();
    let free: u64 = node.tier_capacities.iter().map(|(_, c)| c.available_bytes).sum();
    (tiers.join(","), format!("{} / {}", human_size(total.saturating_sub(free)), human_size(total)))
}

fn liveness(n: &NodeStatusReport) -> &'static str {
    match n.status {
        NodeLiveness::Alive => "alive",
        NodeLiveness::Expired => "expired",
        _ => "unknown",
    }
}

/// Prints `rows` under `header` as aligned columns (the columns in `right` right-aligned).
fn table<const N: usize>(header: [&str; N], rows: &[[String; N]], right: &[usize]) -> anyhow::Result<()> {
    let mut widths = header.map(str::len);
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: [&str; N]| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if right.contains(&i) { s.push_str(&format!("{cell:>w$}  ")) } else { s.push_str(&format!("{cell:<w$}  ")) }
        }
        s.trim_end().to_owned()
    };
    out(line(header))?;
    for row in rows {
        out(line(std::array::from_fn(|i| row[i].as_str())))?;
    }
    Ok(())
}

/// The cluster as the master sees it: nodes (they lend a medium) and clients (they only read and
/// write) in two tables. This command's own client is left out.
async fn stat(client: &PoolClient, address: &str) -> anyhow::Result<u8> {
    let status = client.master().cluster_status().await.map_err(|e| anyhow!("cluster status: {e}"))?;
    let others: Vec<&NodeStatusReport> = status.nodes.iter().filter(|n| n.node_id != client.node_id()).collect();
    let (nodes, clients): (Vec<&NodeStatusReport>, Vec<&NodeStatusReport>) =
        others.into_iter().partition(|n| n.is_storage());
    let alive = nodes.iter().filter(|n| n.status == NodeLiveness::Alive).count();
    let expired = nodes.iter().chain(&clients).filter(|n| n.status == NodeLiveness::Expired).count();
    let plural = |n: u64, word: &str| format!("{n} {word}{}", if n == 1 { "" } else { "s" });
    out(format_args!(
        "master {address}: {} ({alive} alive), {}, {}",
        plural(nodes.len() as u64, "node"),
        plural(clients.len() as u64, "client"),
        plural(status.total_keys, "key")
    ))?;
    if expired > 0 {
        out(format_args!(
            "(an expired record is listed for {} after it expired, then removed)",
            crate::format_duration(status.expired_retention)
        ))?;
    }
    let peer = |n: &NodeStatusReport| if n.peer_address.is_empty() { "-".to_owned() } else { n.peer_address.clone() };
    if !nodes.is_empty() {
        let rows: Vec<[String; 7]> = nodes
            .iter()
            .map(|n| {
                let (tier, used) = capacity_cells(n);
                let id = shown(&n.node_id).into_owned();
                [id, liveness(n).into(), tier, used, n.key_count.to_string(), age(n.last_heartbeat_age), peer(n)]
            })
            .collect();
        out("")?;
        table(["NODE", "STATUS", "TIER", "USED / CAPACITY", "KEYS", "HEARTBEAT", "PEER"], &rows, &[4])?;
    }
    if !clients.is_empty() {
        let rows: Vec<[String; 4]> = clients
            .iter()
            .map(|n| [shown(&n.node_id).into_owned(), liveness(n).into(), age(n.last_heartbeat_age), peer(n)])
            .collect();
        out("")?;
        table(["CLIENT", "STATUS", "HEARTBEAT", "PEER"], &rows, &[])?;
    }
    Ok(0)
}
