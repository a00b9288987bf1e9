//! The data server's warnings under a flood of bad connections are rate-limited, and nothing is
//! lost: each line carries how many of its kind were suppressed. So are the peer directory's about
//! bad descriptors. (Its own test binary: it
//! installs a process-wide tracing subscriber that captures every warning.)

pub mod tcp_support;

use std::collections::HashMap;
use std::io::Write;
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tcp_support::fast_config;
use umbp_core::MetricSource;
use umbp_transfer::{DataServerConfig, TcpEngine, TcpEngineConfig};

/// A warning line as captured.
#[derive(Debug, Clone, Default)]
struct Line {
    target: String,
    message: String,
    kind: Option<String>,
    suppressed: Option<u64>,
}

static LINES: Mutex<Vec<Line>> = Mutex::new(Vec::new());

/// Captures WARN and ERROR events into [`LINES`].
struct Capture;

impl tracing::field::Visit for Line {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "kind" => self.kind = Some(value.to_owned()),
            "message" => self.message = value.to_owned(),
            _ => {}
        }
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if field.name() == "suppressed" {
            self.suppressed = Some(value);
        }
    }
}

impl tracing::Subscriber for Capture {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut line = Line { target: event.metadata().target().to_owned(), ..Line::default() };
        event.record(&mut line);
        LINES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(line);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

fn lines() -> Vec<Line> {
    LINES.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
}

fn hello_bytes(token: &str) -> Vec<u8> {
    let mut h = b"UMBP".to_vec();
    h.extend_from_slice(&2u16.to_le_bytes()); // protocol version 2
    h.extend_from_slice(&u16::try_from(token.len()).expect("short token").to_le_bytes());
    h.extend_from_slice(token.as_bytes());
    h
}

#[test]
fn per_connection_warnings_are_rate_limited_with_a_count() {
    tracing::subscriber::set_global_default(Capture).expect("the only subscriber of this binary");
    const EACH: usize = 300;
    let interval = Duration::from_secs(1);
    let server = TcpEngine::new(TcpEngineConfig {
        server: DataServerConfig {
            handshake_timeout: Duration::from_millis(200),
            warn_interval: interval,
            ..fast_config().server
        },
        cluster_token: Some("the token".into()),
        ..fast_config()
    })
    .expect("server");
    let endpoint = server.endpoint().to_owned();
    let started = Instant::now();
    // Three kinds of refusals, EACH of every kind: silent sockets (timed out, or closed to make
    // room for newer ones), garbage instead of a hello, and a wrong token.
    let mut held = Vec::new();
    for _ in 0..EACH {
        held.push(TcpStream::connect(&endpoint).expect("silent"));
        let mut garbage = TcpStream::connect(&endpoint).expect("garbage");
        let _ = garbage.write_all(b"GET / HTTP/1.1\r\n\r\n");
        held.push(garbage);
        let mut wrong = TcpStream::connect(&endpoint).expect("wrong token");
        let _ = wrong.write_all(&hello_bytes("not the token"));
        held.push(wrong);
    }
    let refused = |reason: &str| -> u64 {
        server
            .sample_metrics()
            .iter()
            .filter(|m| m.name == umbp_core::metric_names::TRANSFER_TCP_SERVER_REFUSED_TOTAL)
            .find(|m| m.labels.iter().any(|(k, v)| k == "reason" && v == reason))
            .map_or(0, |m| m.value)
    };
    // Every event is either a line of its kind or counted in a later line's `suppressed`: once the
    // server has flushed, the lines account for every refusal its metrics counted.
    let kinds = ["handshake_timeout", "handshake_limit", "malformed_hello", "unauthorized"];
    let accounted = |kind: &str| -> u64 {
        lines()
            .iter()
            .filter(|l| l.kind.as_deref() == Some(kind))
            .map(|l| l.suppressed.unwrap_or(0) + u64::from(!l.message.contains("suppressed")))
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let silent = refused("handshake_timeout") + refused("handshake_limit");
        let settled = silent >= EACH as u64
            && refused("malformed_hello") >= EACH as u64
            && refused("unauthorized") >= EACH as u64
            && kinds.iter().all(|k| accounted(k) == refused(k));
        if settled {
            break;
        }
        let written = lines().iter().filter(|l| l.target.starts_with("umbp_transfer")).count();
        assert!(written < 3 * EACH / 10, "{written} warning lines for {} refusals", 3 * EACH);
        assert!(
            Instant::now() < deadline,
            "warnings do not account for the refusals: {:?}",
            kinds.iter().map(|k| (k, accounted(k), refused(k))).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = started.elapsed();
    let ours: Vec<Line> = lines().into_iter().filter(|l| l.target.starts_with("umbp_transfer")).collect();
    let mut per_kind: HashMap<String, usize> = HashMap::new();
    for l in &ours {
        *per_kind.entry(l.kind.clone().unwrap_or_default()).or_default() += 1;
    }
    // At most one line per interval per kind, plus the flush of its tail.
    let bound = (elapsed.as_secs_f64() / interval.as_secs_f64()).ceil() as usize + 2;
    for (kind, n) in &per_kind {
        assert!(*n <= bound, "{n} lines of kind {kind:?} in {elapsed:?} (bound {bound}): {ours:#?}");
    }
    assert!(per_kind.keys().all(|k| !k.is_empty()), "every warning names its kind: {ours:#?}");
    assert!(ours.iter().any(|l| l.suppressed.unwrap_or(0) > 0), "the suppressed count is reported");
    assert!(ours.len() < 3 * EACH / 10, "{} lines for {} refusals", ours.len(), 3 * EACH);
    drop(held);

    // Descriptors a peer publishes are input too: a thousand bad ones are one line (the directory
    // limits per kind with the default interval of 5 s, far longer than this takes).
    let directory = umbp_transfer::PeerDirectory::new();
    let bad: Vec<umbp_core::BufferDesc> = (0..1000)
        .map(|i| umbp_core::BufferDesc {
            backend_id: 0,
            buffer_index: i,
            size: 4096,
            location: umbp_core::MemoryLocation::Host,
            remote: None,
        })
        .collect();
    assert_eq!(directory.cache_remote_buffers("peer", &bad), 0);
    assert_eq!(directory.reset_remote_buffers("peer", &bad), 0);
    let skipped = lines().iter().filter(|l| l.kind.as_deref() == Some("no_remote_handle")).count();
    assert_eq!(skipped, 1, "one line for 2,000 skipped descriptors");
}
