//! `umbp bench --breakdown`: where the time of one get and one put goes (issue 16, item 6),
//! measured with the pool's phase spans ([`phases`]), not guessed.
//!
//! A [`PhaseLayer`] records each phase span's wall time (from its creation to its close) and busy
//! time (while its future was being polled), by span name. The process's global subscriber only
//! logs, so the bench with `--breakdown` runs on a runtime of its own whose every thread (and the
//! thread that drives it) uses a dispatcher holding the layer ([`on_recording_runtime`]). After the
//! bench's own latency probe, [`measure`] runs single 64 KiB remote puts of distinct keys, then single
//! gets of the keys it put, on both client paths (the default keyed one and the routed one of a
//! client with `keyed_requests = false`) in blocks alternating the paths, recording only during each
//! block, and reports per path and phase: calls, p50 wall and busy time, and the phase's share of the
//! whole call's p50.
//!
//! The holder runs in a child process: its spans (`umbp.peer.*`) are recorded there, not here.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::span::{Attributes, Id};
use tracing::{Dispatch, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{EnvFilter, Layer, Registry};
use umbp_peer::pool_client::phases;
use umbp_peer::pool_client::{PoolClient, PutOutcome};

use crate::bench::{BenchError, LATENCY_VALUE, WARM_UP, latency_blocks};
use crate::units::human_size;

/// The pseudo-phase of a whole get: its wall time outside every direct phase (gate, planning, thread
/// hand-offs between the phases).
pub const GET_OTHER: &str = "umbp.get (outside the phases)";
/// The pseudo-phase of a whole put: its wall time outside every direct phase.
pub const PUT_OTHER: &str = "umbp.put (outside the phases)";

/// One closed span.
#[derive(Debug, Clone, Copy)]
struct Sample {
    wall: Duration,
    busy: Duration,
}

/// Where the layer's samples go: kept only while armed ([`start`](Self::start) to
/// [`stop`](Self::stop)).
#[derive(Debug, Default)]
pub struct Recorder {
    armed: AtomicBool,
    samples: Mutex<HashMap<&'static str, Vec<Sample>>>,
}

impl Recorder {
    /// Drops what was recorded and records from now on.
    pub fn start(&self) {
        if let Ok(mut s) = self.samples.lock() {
            s.clear();
        }
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Stops recording; what was recorded since [`start`](Self::start), by span name: (wall, busy)
    /// per closed span.
    pub fn stop(&self) -> Samples {
        self.armed.store(false, Ordering::SeqCst);
        let taken = self.samples.lock().map(|mut s| std::mem::take(&mut *s)).unwrap_or_default();
        Samples(taken)
    }

    /// How many spans named `name` closed since [`start`](Self::start) (while armed).
    pub fn closed(&self, name: &str) -> usize {
        self.samples.lock().map_or(0, |s| s.get(name).map_or(0, Vec::len))
    }

    fn record(&self, name: &'static str, wall: Duration, busy: Duration) {
        if !self.armed.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(mut s) = self.samples.lock() {
            s.entry(name).or_default().push(Sample { wall, busy });
        }
    }

    /// The recorder of the phase layer in the current thread's dispatcher, if it has one.
    pub fn current() -> Option<Arc<Recorder>> {
        tracing::dispatcher::get_default(|d| d.downcast_ref::<PhaseLayer>().map(|l| Arc::clone(&l.recorder)))
    }
}

/// Closed spans by name, from one armed stretch of a [`Recorder`].
#[derive(Debug, Default)]
pub struct Samples(HashMap<&'static str, Vec<Sample>>);

impl Samples {
    /// The span names recorded.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.0.keys().copied()
    }

    /// How many spans named `name` closed.
    pub fn calls(&self, name: &str) -> usize {
        self.0.get(name).map_or(0, Vec::len)
    }

    /// Adds the spans of `other` (another armed stretch) to these.
    pub fn absorb(&mut self, other: Samples) {
        for (name, samples) in other.0 {
            self.0.entry(name).or_default().extend(samples);
        }
    }
}

/// A span's timing while it is open.
struct Timing {
    opened: Instant,
    entered: Option<Instant>,
    busy: Duration,
    /// For a whole call: the wall time of its direct phases closed so far.
    phases: Duration,
}

/// The layer that times the phase spans (target [`phases::TARGET`]); give it only those spans
/// (see [`dispatch`]).
#[derive(Debug, Clone)]
pub struct PhaseLayer {
    recorder: Arc<Recorder>,
}

fn whole_call(name: &str) -> Option<&'static str> {
    match name {
        phases::GET => Some(GET_OTHER),
        phases::PUT => Some(PUT_OTHER),
        _ => None,
    }
}

impl<S> Layer<S> for PhaseLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, _attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let timing = Timing { opened: Instant::now(), entered: None, busy: Duration::ZERO, phases: Duration::ZERO };
            span.extensions_mut().insert(timing);
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(t) = span.extensions_mut().get_mut::<Timing>()
        {
            t.entered = Some(Instant::now());
        }
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(t) = span.extensions_mut().get_mut::<Timing>()
            && let Some(entered) = t.entered.take()
        {
            t.busy += entered.elapsed();
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(t) = span.extensions_mut().remove::<Timing>() else { return };
        let wall = t.opened.elapsed();
        let name = span.name();
        // A direct phase of a whole call counts toward the call's phases (a nested one, such as the
        // RPC inside a resolve, is inside its own phase already).
        if let Some(parent) = span.parent()
            && whole_call(parent.name()).is_some()
            && let Some(pt) = parent.extensions_mut().get_mut::<Timing>()
        {
            pt.phases += wall;
        }
        self.recorder.record(name, wall, t.busy);
        if let Some(other) = whole_call(name) {
            self.recorder.record(other, wall.saturating_sub(t.phases), Duration::ZERO);
        }
    }
}

/// A dispatcher that logs as the CLI does (`RUST_LOG`, default `warn`, to stderr) and times the
/// phase spans into `recorder`.
pub fn dispatch(recorder: Arc<Recorder>) -> Dispatch {
    let logs = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let subscriber = Registry::default()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(false).with_filter(logs))
        .with(PhaseLayer { recorder }.with_filter(filter_fn(|m| m.target() == phases::TARGET)));
    Dispatch::new(subscriber)
}

thread_local! {
    /// The recording dispatcher, while a thread of the recording runtime runs.
    static SCOPED: RefCell<Option<tracing::dispatcher::DefaultGuard>> = const { RefCell::new(None) };
}

/// Runs `make()`'s future to completion on a fresh multi-thread runtime (as many workers as the
/// CLI's) whose threads, and the thread that drives it, record the phase spans (see [`dispatch`]),
/// on a thread of its own; blocks until it is done.
pub fn run_recording<T, F, Fut>(make: F) -> Result<T, BenchError>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T>,
{
    let thread = std::thread::Builder::new()
        .name("umbp-bench-breakdown".into())
        .spawn(move || -> Result<T, BenchError> {
            let dispatch = dispatch(Arc::new(Recorder::default()));
            let _here = tracing::dispatcher::set_default(&dispatch);
            let on_start = dispatch.clone();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .on_thread_start(move || {
                    SCOPED.with(|s| *s.borrow_mut() = Some(tracing::dispatcher::set_default(&on_start)));
                })
                .on_thread_stop(|| SCOPED.with(|s| drop(s.borrow_mut().take())))
                .build()
                .map_err(|e| BenchError::Failed(format!("starting the recording runtime: {e}")))?;
            let out = runtime.block_on(make());
            runtime.shutdown_timeout(Duration::from_secs(2));
            Ok(out)
        })
        .map_err(|e| BenchError::Failed(format!("starting the recording thread: {e}")))?;
    thread.join().map_err(|_| BenchError::Failed("the recording runtime panicked".into()))?
}

/// [`run_recording`] from async code: the caller's task waits without blocking its runtime.
pub async fn on_recording_runtime<T, F, Fut>(make: F) -> Result<T, BenchError>
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T>,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("umbp-bench-breakdown-wait".into())
        .spawn(move || {
            let _ = tx.send(run_recording(make));
        })
        .map_err(|e| BenchError::Failed(format!("starting the recording thread: {e}")))?;
    rx.await.map_err(|_| BenchError::Failed("the recording runtime stopped without a result".into()))?
}

/// One phase's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct PhaseStat {
    /// The span name ([`phases`]), or [`GET_OTHER`] / [`PUT_OTHER`].
    pub name: &'static str,
    /// Spans closed (more than the calls when a call repeats a phase, e.g. a re-route).
    pub calls: usize,
    /// Median wall time, µs.
    pub p50_us: f64,
    /// Median busy time (polled), µs; `None` for the pseudo-phase outside the phases.
    pub busy_p50_us: Option<f64>,
    /// `p50_us` / the whole call's p50.
    pub share: f64,
}

impl PhaseStat {
    /// Nested inside another phase (the RPC or medium call inside a resolve, allocate, commit).
    pub fn nested(&self) -> bool {
        self.name.split('.').count() > 3
    }
}

/// Where the time of one kind of single-key call went.
#[derive(Debug, Clone, PartialEq)]
pub struct OpBreakdown {
    /// `get` or `put`.
    pub op: &'static str,
    /// Whole calls recorded.
    pub calls: usize,
    /// The whole call's median, µs.
    pub p50_us: f64,
    /// The whole call's 99th percentile, µs.
    pub p99_us: f64,
    /// The phases in the order they run, each with its share of `p50_us`; then the time outside them.
    pub phases: Vec<PhaseStat>,
}

fn percentile(sorted: &[f64], p: usize) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn micros(samples: &[Sample], of: impl Fn(&Sample) -> Duration) -> Vec<f64> {
    let mut v: Vec<f64> = samples.iter().map(|s| of(s).as_secs_f64() * 1e6).collect();
    v.sort_by(f64::total_cmp);
    v
}

impl OpBreakdown {
    /// The figures of `samples` for the whole call `whole`, its `phase_names` (those with no span
    /// recorded are left out) and the time outside them (`other`).
    pub fn from_samples(
        op: &'static str,
        samples: &Samples,
        whole: &'static str,
        phase_names: &[&'static str],
        other: &'static str,
    ) -> Self {
        let empty = Vec::new();
        let calls_of = |name: &str| samples.0.get(name).unwrap_or(&empty);
        let wall = micros(calls_of(whole), |s| s.wall);
        let p50 = percentile(&wall, 50);
        let share = |x: f64| if p50 > 0.0 { x / p50 } else { 0.0 };
        let mut phases: Vec<PhaseStat> = Vec::new();
        for name in phase_names.iter().copied().chain([other]) {
            let recorded = calls_of(name);
            if recorded.is_empty() {
                continue;
            }
            let p = percentile(&micros(recorded, |s| s.wall), 50);
            let busy = (name != other).then(|| percentile(&micros(recorded, |s| s.busy), 50));
            phases.push(PhaseStat { name, calls: recorded.len(), p50_us: p, busy_p50_us: busy, share: share(p) });
        }
        Self { op, calls: wall.len(), p50_us: p50, p99_us: percentile(&wall, 99), phases }
    }

    /// The phase named `name`, if it was recorded.
    pub fn phase(&self, name: &str) -> Option<&PhaseStat> {
        self.phases.iter().find(|p| p.name == name)
    }

    fn to_json(&self) -> String {
        let phases: Vec<String> = self
            .phases
            .iter()
            .map(|p| {
                format!(
                    "{{\"name\":\"{}\",\"calls\":{},\"p50_us\":{:.1},\"busy_p50_us\":{},\"share\":{:.4}}}",
                    p.name,
                    p.calls,
                    p.p50_us,
                    p.busy_p50_us.map_or_else(|| "null".to_owned(), |b| format!("{b:.1}")),
                    p.share
                )
            })
            .collect();
        format!(
            "{{\"calls\":{},\"p50_us\":{:.1},\"p99_us\":{:.1},\"phases\":[{}]}}",
            self.calls,
            self.p50_us,
            self.p99_us,
            phases.join(",")
        )
    }
}

/// Where the time of one single-key remote get and one put goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Breakdown {
    /// The client path: `keyed` (the default) or `routed` (`keyed_requests = false`).
    pub path: &'static str,
    /// Bytes per value.
    pub value_bytes: u64,
    /// The single puts.
    pub put: OpBreakdown,
    /// The single gets (of the keys the puts wrote).
    pub get: OpBreakdown,
}

/// The heading of the breakdown's table.
pub const BREAKDOWN_HEADER: &str = "| op | phase | spans | p50 µs | busy p50 µs | share of the call's p50 |";

impl Breakdown {
    /// Figures of recorded single gets and puts of the client path `path`.
    pub fn new(path: &'static str, value_bytes: u64, put: &Samples, get: &Samples) -> Self {
        Self {
            path,
            value_bytes,
            put: OpBreakdown::from_samples("put", put, phases::PUT, &phases::PUT_PHASES, PUT_OTHER),
            get: OpBreakdown::from_samples("get", get, phases::GET, &phases::GET_PHASES, GET_OTHER),
        }
    }

    /// The breakdown as one JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"path\":\"{}\",\"value_bytes\":{},\"put\":{},\"get\":{}}}",
            self.path,
            self.value_bytes,
            self.put.to_json(),
            self.get.to_json()
        )
    }
}

impl fmt::Display for Breakdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Where the time of one {} remote put and get goes on the {} path ({} of each, in blocks alternating \
             with the other path; phase spans, wall time from a span's \
             start to its end; busy: while its future was polled; medians). Single-key calls: their phases run \
             one after another (in a batch, one chunk's phases overlap another's and do not add up). A phase \
             marked ↳ lies inside the one above. The holder's spans (umbp.peer.*) are recorded in its own \
             process, not here.",
            human_size(self.value_bytes),
            self.path,
            self.get.calls
        )?;
        writeln!(f)?;
        writeln!(f, "{BREAKDOWN_HEADER}")?;
        write!(f, "|---|---|---|---|---|---|")?;
        for op in [&self.put, &self.get] {
            write!(
                f,
                "\n| {} | whole call (p99 {:.0} µs) | {} | {:.0} | | 100% |",
                op.op, op.p99_us, op.calls, op.p50_us
            )?;
            for p in &op.phases {
                let indent = if p.nested() { "↳ " } else { "" };
                let busy = p.busy_p50_us.map_or_else(String::new, |b| format!("{b:.0}"));
                write!(
                    f,
                    "\n| {} | {indent}{} | {} | {:.0} | {busy} | {:.0}% |",
                    op.op,
                    p.name,
                    p.calls,
                    p.p50_us,
                    p.share * 100.0
                )?;
            }
        }
        Ok(())
    }
}

/// Times `calls` single 64 KiB puts of distinct keys from `keyed` (the default client) and from
/// `routed` (`keyed_requests = false`), both nodes without a medium, so every put is remote and
/// written; then `calls` single gets of those keys by the client that put them. Each kind runs in
/// [`LATENCY_BLOCKS`](crate::bench::LATENCY_BLOCKS) blocks alternating the paths, each block recorded
/// by the phase layer of this thread's dispatcher (the bench must run under
/// [`on_recording_runtime`]), after `WARM_UP` unrecorded calls per path. The keys are removed
/// afterwards. Returns (keyed, routed).
pub async fn measure(
    keyed: &PoolClient,
    routed: &PoolClient,
    calls: usize,
) -> Result<(Breakdown, Breakdown), BenchError> {
    let recorder = Recorder::current()
        .ok_or_else(|| BenchError::Failed("--breakdown: no phase recorder on this runtime".into()))?;
    let value = vec![9u8; LATENCY_VALUE];
    let clients = [keyed, routed];
    let paths = ["keyed", "routed"];
    let keys: [Vec<String>; 2] =
        paths.map(|path| (0..WARM_UP + calls).map(|i| format!("bench-breakdown-{path}-{i}")).collect());
    crate::progress::note(format_args!("umbp bench: {calls} single puts and gets per client path for the breakdown"));
    let put_one = async |client: &PoolClient, key: &str| match client.put_outcome(key, &value).await {
        Ok(PutOutcome::Written) => Ok(()),
        Ok(PutOutcome::AlreadyPresent) => Err(BenchError::Failed(format!("breakdown put: {key} was already present"))),
        Err(e) => Err(BenchError::Failed(format!("breakdown put: {e}"))),
    };
    for p in 0..2 {
        for key in &keys[p][..WARM_UP] {
            put_one(clients[p], key).await?;
        }
    }
    let mut put = [Samples::default(), Samples::default()];
    for (b, block) in latency_blocks(calls).into_iter().enumerate() {
        for p in [b % 2, (b + 1) % 2] {
            recorder.start();
            let mut failed = None;
            for key in &keys[p][WARM_UP + block.start..WARM_UP + block.end] {
                if let Err(e) = put_one(clients[p], key).await {
                    failed = Some(e);
                    break;
                }
            }
            put[p].absorb(recorder.stop());
            if let Some(e) = failed {
                return Err(e);
            }
        }
    }
    let all: Vec<String> = keys.concat();
    crate::bench::until_indexed(keyed, &all).await?;
    let mut buf = vec![0u8; LATENCY_VALUE];
    for p in 0..2 {
        for key in &keys[p][..WARM_UP] {
            clients[p].get(key, &mut buf).await.map_err(|e| BenchError::Failed(format!("breakdown get: {e}")))?;
        }
    }
    let mut get = [Samples::default(), Samples::default()];
    for (b, block) in latency_blocks(calls).into_iter().enumerate() {
        for p in [b % 2, (b + 1) % 2] {
            recorder.start();
            let mut failed = None;
            for key in &keys[p][WARM_UP + block.start..WARM_UP + block.end] {
                buf.fill(0);
                if let Err(e) = clients[p].get(key, &mut buf).await {
                    failed = Some(e);
                    break;
                }
            }
            get[p].absorb(recorder.stop());
            if let Some(e) = failed {
                return Err(BenchError::Failed(format!("breakdown get: {e}")));
            }
            if buf != value {
                return Err(BenchError::Failed("breakdown get returned other bytes than were put".into()));
            }
        }
    }
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    let _ = keyed.remove(&refs).await;
    let [put_keyed, put_routed] = put;
    let [get_keyed, get_routed] = get;
    Ok((
        Breakdown::new(paths[0], LATENCY_VALUE as u64, &put_keyed, &get_keyed),
        Breakdown::new(paths[1], LATENCY_VALUE as u64, &put_routed, &get_routed),
    ))
}

#[cfg(test)]
mod tests {
    use umbp_master::MasterConfig;
    use umbp_peer::pool_client::{DramConfig, Medium, PoolClientConfig};

    use super::*;

    /// The phases a remote single-key put records in the writer's process.
    const REMOTE_PUT: [&str; 8] = [
        phases::PUT,
        phases::PUT_ROUTE,
        phases::PUT_ALLOCATE,
        phases::PUT_ALLOCATE_RPC,
        phases::PUT_TRANSFER,
        phases::PUT_COMMIT,
        phases::PUT_COMMIT_RPC,
        phases::PUT_ABORT,
    ];
    /// The phases a remote single-key get records in the reader's process.
    const REMOTE_GET: [&str; 6] = [
        phases::GET,
        phases::GET_ROUTE,
        phases::GET_RESOLVE,
        phases::GET_RESOLVE_RPC,
        phases::GET_TRANSFER,
        phases::GET_RELEASE,
    ];

    #[test]
    fn a_batch_cell_sums_its_chunks_phases_per_batch() {
        let span = |ms: u64| Sample { wall: Duration::from_millis(ms), busy: Duration::ZERO };
        let mut s = Samples::default();
        // Two batch gets of three chunks each; no put was recorded.
        s.0.insert(phases::GET, vec![span(10), span(30)]);
        s.0.insert(phases::GET_TRANSFER, vec![span(4), span(4), span(4), span(6), span(6), span(6)]);
        s.0.insert(phases::GET_ROUTE, vec![span(1); 6]);
        let cells = BatchPhases::cells("same host (shm)", 1 << 20, &s);
        assert_eq!(cells.len(), 1, "a cell for the get only: {cells:?}");
        let get = &cells[0];
        assert_eq!((get.cell.as_str(), get.batches), ("same host (shm) get 1 MiB", 2));
        assert_eq!(get.phases.iter().map(|p| p.name).collect::<Vec<_>>(), [phases::GET_ROUTE, phases::GET_TRANSFER]);
        let transfer = &get.phases[1];
        assert!((transfer.spans_per_batch - 3.0).abs() < 1e-9);
        assert!((transfer.ms_per_batch - 15.0).abs() < 1e-6, "(12 + 18) / 2: {transfer:?}");
        let table = batch_phases_table(&cells);
        assert!(
            table.contains(BATCH_PHASES_HEADER)
                && table.contains("| same host (shm) get 1 MiB | umbp.get.transfer | 3.0 |")
        );
        assert!(get.to_json().starts_with("{\"cell\":\"same host (shm) get 1 MiB\",\"batches\":2,"));
    }

    fn config(id: &str, master: &str, medium: Medium) -> PoolClientConfig {
        let mut c = PoolClientConfig::new(id, master).with_medium(medium);
        c.page_size = 64 << 10;
        c
    }

    /// A master on loopback and a node lending `capacity_bytes` of DRAM: the master, its address,
    /// the holder.
    async fn master_and_holder(capacity_bytes: u64) -> (umbp_master::MasterHandle, String, PoolClient) {
        let master = umbp_master::start(MasterConfig {
            listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            ..MasterConfig::default()
        })
        .await
        .expect("master");
        let addr = master.local_addr().to_string();
        let dram = Medium::Dram(DramConfig { capacity_bytes, ..DramConfig::default() });
        let holder = PoolClient::start(config("holder", &addr, dram)).await.expect("holder");
        (master, addr, holder)
    }

    /// What one test run recorded.
    struct Recorded {
        /// A routed remote put and get (the client's keyed requests off).
        put: Samples,
        get: Samples,
        /// A keyed remote put and get (the default).
        keyed_put: Samples,
        keyed_get: Samples,
        /// A get on the holder itself.
        local: Samples,
    }

    fn assert_recorded(what: &str, samples: &Samples, names: &[&str]) {
        for name in names {
            assert!(samples.calls(name) >= 1, "{what} recorded no {name}: {:?}", samples.names().collect::<Vec<_>>());
        }
    }

    /// Remote puts and gets between two nodes of one process, routed and keyed, then a local get
    /// on the holder: every phase span of each path is recorded (the holder's peer-service spans
    /// too, as the holder is in this process), and the breakdown's figures come from them.
    #[test]
    fn the_layer_records_every_phase_of_a_get_and_a_put() {
        let r = run_recording(|| async {
            let (master, addr, holder) = master_and_holder(8 << 20).await;
            let mut routed = config("routed", &addr, Medium::None);
            routed.keyed_requests = false;
            let routed = PoolClient::start(routed).await.expect("routed client");
            let keyed = PoolClient::start(config("keyed", &addr, Medium::None)).await.expect("keyed client");
            let recorder = Recorder::current().expect("the recording runtime has a recorder");
            let value = vec![3u8; LATENCY_VALUE];
            let mut buf = vec![0u8; LATENCY_VALUE];
            let mut one = async |client: &PoolClient, key: &str| {
                recorder.start();
                client.put(key, &value).await.expect("put");
                let put = recorder.stop();
                holder.flush();
                crate::bench::until_indexed(client, &[key.to_owned()]).await.expect("indexed");
                buf.fill(0);
                recorder.start();
                client.get(key, &mut buf).await.expect("remote get");
                let get = recorder.stop();
                assert_eq!(buf, value);
                (put, get)
            };
            let (put, get) = one(&routed, "routed").await;
            let (keyed_put, keyed_get) = one(&keyed, "keyed").await;
            let mut buf = vec![0u8; LATENCY_VALUE];
            recorder.start();
            holder.get("routed", &mut buf).await.expect("local get");
            let local = recorder.stop();
            routed.close().await;
            keyed.close().await;
            holder.close().await;
            master.shutdown().await;
            Recorded { put, get, keyed_put, keyed_get, local }
        })
        .expect("recording runtime");
        let (put, get) = (&r.put, &r.get);
        assert_recorded("routed put", put, &[&REMOTE_PUT[..], &[phases::PEER_ALLOCATE, phases::PEER_COMMIT]].concat());
        assert_recorded("routed get", get, &[&REMOTE_GET[..], &[phases::PEER_RESOLVE]].concat());
        assert_recorded("keyed put", &r.keyed_put, &[phases::PUT, phases::PUT_ROUTE, phases::PUT_KEYED]);
        assert_recorded("keyed get", &r.keyed_get, &[phases::GET, phases::GET_KEYED]);
        assert_recorded(
            "local get",
            &r.local,
            &[phases::GET, phases::GET_LOCAL, phases::GET_RESOLVE_MEDIUM, phases::GET_TRANSFER],
        );
        assert_eq!(put.calls(phases::PUT), 1, "one whole put");
        assert_eq!(get.calls(phases::GET), 1, "one whole get");
        let breakdown = Breakdown::new("routed", LATENCY_VALUE as u64, put, get);
        for (op, names) in [(&breakdown.put, &REMOTE_PUT[1..]), (&breakdown.get, &REMOTE_GET[1..])] {
            assert_eq!(op.calls, 1);
            assert!(op.p50_us > 0.0);
            for name in names {
                let p = op.phase(name).unwrap_or_else(|| panic!("{} breakdown has no {name}", op.op));
                assert!(p.p50_us <= op.p50_us, "{name} lies inside the whole call");
            }
            let other = op.phases.last().expect("the time outside the phases");
            assert!(other.name.ends_with("(outside the phases)"));
            let direct: f64 =
                op.phases.iter().filter(|p| !p.nested() && p.busy_p50_us.is_some()).map(|p| p.p50_us).sum();
            assert!(direct + other.p50_us <= op.p50_us * 1.0001 + 1.0, "phases of one call add up to at most the call");
        }
        let text = breakdown.to_string();
        assert!(text.contains(BREAKDOWN_HEADER) && text.contains("one after another"), "{text}");
        assert!(breakdown.to_json().contains("\"umbp.get.route\"") && text.contains("on the routed path"));
        let keyed = Breakdown::new("keyed", LATENCY_VALUE as u64, &r.keyed_put, &r.keyed_get);
        assert!(keyed.get.phase(phases::GET_KEYED).is_some() && keyed.get.phase(phases::GET_RESOLVE).is_none());
        assert!(keyed.to_json().starts_with("{\"path\":\"keyed\""));
    }

    /// A light client's batch put and get with a holder on this host (one process): each chunk's
    /// keyed exchange records its steps — the holder's answer, the copies, the end of the exchange —
    /// and the batch cells show them.
    #[test]
    fn a_same_host_batch_records_the_steps_of_each_chunk() {
        let (put, get) = run_recording(|| async {
            let (master, addr, holder) = master_and_holder(16 << 20).await;
            let client = PoolClient::start(config("light", &addr, Medium::None)).await.expect("light client");
            let recorder = Recorder::current().expect("the recording runtime has a recorder");
            // 4 MiB: a put in two chunks of 2 MiB, a get in three of 1, 2 and 1 MiB (`Spread`),
            // each one exchange.
            let keys: Vec<String> = (0..8).map(|i| format!("batch-{i}")).collect();
            let values: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i; 512 << 10]).collect();
            let items: Vec<(&str, &[u8])> =
                keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
            recorder.start();
            let written = client.batch_put(&items).await;
            let put = recorder.stop();
            assert!(written.iter().all(Result::is_ok), "{written:?}");
            holder.flush();
            crate::bench::until_indexed(&client, &keys).await.expect("indexed");
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let mut bufs: Vec<Vec<u8>> = values.iter().map(|v| vec![0u8; v.len()]).collect();
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
            recorder.start();
            let read = client.batch_get(&refs, &mut slices).await;
            // A chunk's settle frame goes out after its answers came back: wait (bounded) for both.
            let deadline = Instant::now() + Duration::from_secs(5);
            while recorder.closed(phases::GET_KEYED_SETTLE) < 3 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let get = recorder.stop();
            assert!(read.iter().all(Result::is_ok) && bufs == values, "byte-exact: {read:?}");
            assert_eq!(
                (client.stats().keyed_puts, client.stats().keyed_gets),
                (8, 8),
                "every key through a keyed exchange"
            );
            client.close().await;
            holder.close().await;
            master.shutdown().await;
            (put, get)
        })
        .expect("recording runtime");
        let put_steps =
            [phases::PUT_KEYED_REPLY, phases::PUT_KEYED_COPY, phases::PUT_KEYED_ROUTE_WAIT, phases::PUT_KEYED_COMMIT];
        let get_steps = [phases::GET_KEYED_REPLY, phases::GET_KEYED_COPY, phases::GET_KEYED_SETTLE];
        assert_recorded("same-host batch put", &put, &[&[phases::PUT, phases::PUT_KEYED][..], &put_steps].concat());
        assert_recorded("same-host batch get", &get, &[&[phases::GET, phases::GET_KEYED][..], &get_steps].concat());
        let mut both = put;
        both.absorb(get);
        let cells = BatchPhases::cells("same host (shm)", 512 << 10, &both);
        let get = cells.iter().find(|c| c.cell.contains(" get ")).expect("a get cell");
        for name in get_steps {
            let p = get.phases.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("no {name}: {get:?}"));
            assert!((p.spans_per_batch - 3.0).abs() < 1e-9, "one {name} per chunk: {p:?}");
        }
        let put = cells.iter().find(|c| c.cell.contains(" put ")).expect("a put cell");
        assert!(put_steps.iter().all(|n| put.phases.iter().any(|p| p.name == *n)), "{put:?}");
        assert!(batch_phases_table(&cells).contains("| ↳ umbp.get.keyed.copy | 3.0 |"));
    }
}

/// Runs `fut` with `recorder` (the phase layer's, under `--breakdown`; `None` otherwise) armed, and
/// adds what it recorded to `into`.
pub async fn recorded<T>(recorder: Option<&Recorder>, into: &mut Samples, fut: impl Future<Output = T>) -> T {
    let Some(recorder) = recorder else { return fut.await };
    recorder.start();
    let out = fut.await;
    into.absorb(recorder.stop());
    out
}

/// One phase of a batch cell: its chunks' spans.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPhase {
    /// The span name ([`phases`]).
    pub name: &'static str,
    /// Spans per batch (one per chunk and round of it; more with re-reads).
    pub spans_per_batch: f64,
    /// Median wall time of one span, µs.
    pub p50_us: f64,
    /// The spans' wall time summed per batch, ms: above the batch's own time where chunks overlap.
    pub ms_per_batch: f64,
}

/// Where the time of one batch cell went (`--breakdown`): the phase spans of its chunks, beside the
/// whole batch's time, so the next lever on a host shows (control calls or copies).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchPhases {
    /// The cell: path, op and value size.
    pub cell: String,
    /// Batches recorded.
    pub batches: usize,
    /// The median batch, ms.
    pub batch_p50_ms: f64,
    /// The phases recorded, in the order they run.
    pub phases: Vec<BatchPhase>,
}

/// The heading of the batch-phase table.
pub const BATCH_PHASES_HEADER: &str =
    "| cell | phase | spans per batch | span p50 µs | summed ms per batch | batch p50 ms |";

impl BatchPhases {
    /// The put and the get cell of `path` for `value_bytes` values, from the spans of their batches.
    pub fn cells(path: &str, value_bytes: u64, samples: &Samples) -> Vec<Self> {
        [("put", phases::PUT, &phases::PUT_PHASES[..]), ("get", phases::GET, &phases::GET_PHASES[..])]
            .into_iter()
            .filter_map(|(op, whole, names)| {
                let batches = samples.0.get(whole).filter(|b| !b.is_empty())?;
                let n = batches.len() as f64;
                let phases = names
                    .iter()
                    .filter_map(|name| {
                        let spans = samples.0.get(name).filter(|s| !s.is_empty())?;
                        let sum: f64 = spans.iter().map(|s| s.wall.as_secs_f64() * 1e3).sum();
                        Some(BatchPhase {
                            name,
                            spans_per_batch: spans.len() as f64 / n,
                            p50_us: percentile(&micros(spans, |s| s.wall), 50),
                            ms_per_batch: sum / n,
                        })
                    })
                    .collect();
                Some(Self {
                    cell: format!("{path} {op} {}", human_size(value_bytes)),
                    batches: batches.len(),
                    batch_p50_ms: percentile(&micros(batches, |s| s.wall), 50) / 1e3,
                    phases,
                })
            })
            .collect()
    }

    /// The cell as one JSON object.
    pub fn to_json(&self) -> String {
        let phases: Vec<String> = self
            .phases
            .iter()
            .map(|p| {
                format!(
                    "{{\"name\":\"{}\",\"spans_per_batch\":{:.2},\"p50_us\":{:.1},\"ms_per_batch\":{:.3}}}",
                    p.name, p.spans_per_batch, p.p50_us, p.ms_per_batch
                )
            })
            .collect();
        format!(
            "{{\"cell\":\"{}\",\"batches\":{},\"batch_p50_ms\":{:.3},\"phases\":[{}]}}",
            self.cell,
            self.batches,
            self.batch_p50_ms,
            phases.join(",")
        )
    }
}

/// The batch cells' phases as one markdown table, after a line that says how to read it.
pub fn batch_phases_table(cells: &[BatchPhases]) -> String {
    let mut out = String::from(
        "Where the time of a batch goes (the remote and same-host cells; phase spans of every chunk, wall \
         time; chunks run in a pipeline, so a phase's summed time may exceed the batch's own):\n\n",
    );
    out.push_str(BATCH_PHASES_HEADER);
    out.push_str("\n|---|---|---|---|---|---|");
    for c in cells {
        for p in &c.phases {
            let indent = if p.name.split('.').count() > 3 { "↳ " } else { "" };
            out.push_str(&format!(
                "\n| {} | {indent}{} | {:.1} | {:.0} | {:.2} | {:.2} |",
                c.cell, p.name, p.spans_per_batch, p.p50_us, p.ms_per_batch, c.batch_p50_ms
            ));
        }
    }
    out
}
