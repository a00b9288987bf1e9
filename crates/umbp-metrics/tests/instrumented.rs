//! `InstrumentedBackend` and the publisher against a medium with no metrics code of its own
//! (`MockBackend`), through a local Prometheus recorder (no global recorder, so tests never race).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use umbp_core::{
    AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, MetricSample, MetricSource, ReadRelease, TierType,
};
use umbp_metrics::{InstrumentedBackend, MetricPublisher, MetricsExporter, Op, Status, names};
use umbp_testkit::{LocalOnlyRegistrar, MockBackend, MockConfig};

const PAGE: u64 = 4096;

/// `name{labels}` → value, from the Prometheus text format (labels sorted, so lookups are stable).
fn parse(text: &str) -> BTreeMap<(String, BTreeMap<String, String>), f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let (series, value) = line.rsplit_once(' ').expect("series and value");
        let (name, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let labels = labels
            .split(',')
            .filter(|l| !l.is_empty())
            .map(|l| {
                let (k, v) = l.split_once('=').expect("k=v");
                (k.to_owned(), v.trim_matches('"').to_owned())
            })
            .collect();
        out.insert((name.to_owned(), labels), value.parse().expect("value"));
    }
    out
}

/// The value of the one series `name` whose labels include every pair of `labels`.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let series = parse(text);
    let hits: Vec<f64> = series
        .iter()
        .filter(|((n, l), _)| n == name && labels.iter().all(|(k, v)| l.get(*k).map(String::as_str) == Some(*v)))
        .map(|(_, v)| *v)
        .collect();
    assert!(hits.len() <= 1, "{name} {labels:?} matches {} series", hits.len());
    hits.first().copied()
}

fn mock(tier: TierType, pages: u32) -> (Arc<dyn MediumBackend>, Arc<InstrumentedBackend>) {
    let inner: Arc<dyn MediumBackend> =
        Arc::new(MockBackend::new(MockConfig { tier, page_size: PAGE, pages, ..MockConfig::default() }));
    let wrapped = Arc::new(InstrumentedBackend::new(inner));
    wrapped.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    (Arc::clone(&wrapped) as Arc<dyn MediumBackend>, wrapped)
}

fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|k| (*k).to_owned()).collect()
}

/// Puts `names` (one page each): allocate, commit.
fn put(b: &dyn MediumBackend, names: &[&str]) {
    let reqs: Vec<_> = names.iter().map(|k| AllocateRequest::new(*k, PAGE)).collect();
    let slots = b.batch_allocate(&reqs);
    let commits: Vec<_> = slots
        .iter()
        .zip(names)
        .filter(|(s, _)| s.outcome == AllocateOutcome::Allocated)
        .map(|(s, k)| CommitRequest::new(s.slot_id, *k))
        .collect();
    b.batch_commit(&commits);
}

/// Every generic series, with its labels, after one sequence touching every op and status that the
/// mock can produce.
#[test]
fn a_medium_with_no_metrics_code_appears_under_its_tier_with_every_generic_series() {
    let (backend, _) = mock(TierType::Ssd, 4);
    put(backend.as_ref(), &["a", "b"]);
    // exists, no_space (2 pages left, 3 asked), failed (size 0).
    let r = backend.batch_allocate(&[
        AllocateRequest::new("a", PAGE),
        AllocateRequest::new("big", 3 * PAGE),
        AllocateRequest::new("zero", 0),
    ]);
    assert_eq!(
        r.iter().map(|r| r.outcome).collect::<Vec<_>>(),
        [AllocateOutcome::AlreadyExists, AllocateOutcome::FailedNoSpace, AllocateOutcome::Failed]
    );
    let slot = backend.batch_allocate(&[AllocateRequest::new("c", PAGE)])[0].slot_id;
    backend.batch_abort(&[slot]);
    backend.batch_commit(&[CommitRequest::new(999_999, "ghost")]);
    backend.batch_resolve(&keys(&["b", "nope"]), false);
    backend.batch_contains(&keys(&["a", "nope"]));
    std::thread::sleep(Duration::from_millis(600)); // past the mock's 500 ms read lease on "b"
    backend.evict(&keys(&["b", "nope"]));

    let exporter = MetricsExporter::new(&[], Duration::from_secs(60));
    exporter.add_backend(&backend);
    let text = exporter.render();
    let ssd = [("tier", "SSD"), ("backend", "MockBackend")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut l = ssd.to_vec();
        l.extend_from_slice(extra);
        l
    };
    for (op, status) in [
        ("allocate", "ok"),
        ("allocate", "exists"),
        ("allocate", "no_space"),
        ("allocate", "failed"),
        ("commit", "ok"),
        ("commit", "failed"),
        ("abort", "ok"),
        ("resolve", "ok"),
        ("resolve", "miss"),
        ("evict", "ok"),
        ("evict", "miss"),
        ("lookup", "ok"),
        ("lookup", "miss"),
    ] {
        assert!(
            value(&text, names::OPS_TOTAL, &with(&[("op", op), ("status", status)])).is_some(),
            "{op}/{status}\n{text}"
        );
    }
    for op in names::OPS {
        assert!(value(&text, names::BATCHES_TOTAL, &with(&[("op", op)])).is_some(), "batches {op}");
        assert!(value(&text, names::OP_SECONDS_TOTAL, &with(&[("op", op)])).is_some(), "seconds {op}");
    }
    for op in ["commit", "resolve", "evict"] {
        assert!(value(&text, names::BYTES_TOTAL, &with(&[("op", op)])).is_some(), "bytes {op}");
    }
    // The mock's own gauge passes through under the same stamps.
    assert!(value(&text, names::MEDIUM_STATE, &with(&[("state", "pages_in_use")])).is_some(), "{text}");
    // Help text reaches the output.
    assert!(text.contains(&format!("# HELP {} ", names::OPS_TOTAL)), "{text}");
}

/// A known sequence gives exact counts, in the decorator and in the published series, and later
/// traffic only ever adds.
#[test]
fn counters_are_exact_and_monotonic_for_a_known_sequence() {
    let (backend, wrapped) = mock(TierType::Dram, 16);
    let exporter = MetricsExporter::new(&[], Duration::from_secs(60));
    exporter.add_backend(&backend);
    let dram = |extra: &[(&'static str, &'static str)]| {
        let mut l = vec![("tier", "DRAM"), ("backend", "MockBackend")];
        l.extend_from_slice(extra);
        l
    };

    put(backend.as_ref(), &["k1", "k2", "k3"]); // 1 allocate batch of 3, 1 commit batch of 3
    backend.batch_resolve(&keys(&["k1", "k2", "x"]), false); // 2 hits, 1 miss
    let a = wrapped.counts(Op::Allocate);
    assert_eq!((a.batches, a.entries(Status::Ok)), (1, 3));
    let c = wrapped.counts(Op::Commit);
    assert_eq!((c.batches, c.entries(Status::Ok), c.bytes), (1, 3, 3 * PAGE));
    let r = wrapped.counts(Op::Resolve);
    assert_eq!((r.batches, r.entries(Status::Ok), r.entries(Status::Miss), r.bytes), (1, 2, 1, 2 * PAGE));

    let text = exporter.render();
    assert_eq!(value(&text, names::OPS_TOTAL, &dram(&[("op", "allocate"), ("status", "ok")])), Some(3.0));
    assert_eq!(value(&text, names::BATCHES_TOTAL, &dram(&[("op", "commit")])), Some(1.0));
    assert_eq!(value(&text, names::BYTES_TOTAL, &dram(&[("op", "commit")])), Some((3 * PAGE) as f64));
    assert_eq!(value(&text, names::OPS_TOTAL, &dram(&[("op", "resolve"), ("status", "miss")])), Some(1.0));
    assert_eq!(value(&text, names::BYTES_TOTAL, &dram(&[("op", "resolve")])), Some((2 * PAGE) as f64));
    let seconds_before = value(&text, names::OP_SECONDS_TOTAL, &dram(&[("op", "resolve")])).expect("seconds");

    // Publishing again without traffic changes nothing (deltas, not re-adds).
    let again = exporter.render();
    assert_eq!(value(&again, names::OPS_TOTAL, &dram(&[("op", "allocate"), ("status", "ok")])), Some(3.0));
    assert_eq!(value(&again, names::BYTES_TOTAL, &dram(&[("op", "commit")])), Some((3 * PAGE) as f64));

    put(backend.as_ref(), &["k4"]);
    backend.batch_resolve(&keys(&["k4"]), false);
    let later = exporter.render();
    assert_eq!(value(&later, names::OPS_TOTAL, &dram(&[("op", "allocate"), ("status", "ok")])), Some(4.0));
    assert_eq!(value(&later, names::BATCHES_TOTAL, &dram(&[("op", "allocate")])), Some(2.0));
    assert_eq!(value(&later, names::BYTES_TOTAL, &dram(&[("op", "commit")])), Some((4 * PAGE) as f64));
    assert_eq!(value(&later, names::OPS_TOTAL, &dram(&[("op", "resolve"), ("status", "ok")])), Some(3.0));
    let seconds_after = value(&later, names::OP_SECONDS_TOTAL, &dram(&[("op", "resolve")])).expect("seconds");
    assert!(seconds_after >= seconds_before && seconds_after > 0.0, "{seconds_before} -> {seconds_after}");
    // Ops that never ran have no series at all.
    assert_eq!(value(&later, names::BATCHES_TOTAL, &dram(&[("op", "evict")])), None);
}

/// A medium that publishes its own state under the generic names.
#[derive(Debug)]
struct DeviceStats {
    errors: std::sync::atomic::AtomicU64,
}

impl MetricSource for DeviceStats {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        let l = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        vec![
            MetricSample::counter(
                names::MEDIUM_EVENTS_TOTAL,
                names::MEDIUM_EVENTS_TOTAL_HELP,
                // A source may not set `tier=`: the publisher's stamp wins.
                vec![l("event", "device_read_error"), l("tier", "FAKE")],
                self.errors.load(std::sync::atomic::Ordering::Relaxed),
            ),
            MetricSample::counter(
                names::MEDIUM_BYTES_TOTAL,
                names::MEDIUM_BYTES_TOTAL_HELP,
                vec![l("event", "spill")],
                8192,
            ),
            MetricSample::gauge(names::MEDIUM_STATE, names::MEDIUM_STATE_HELP, vec![l("state", "queue_depth")], 7),
        ]
    }
}

#[test]
fn a_mediums_own_samples_pass_through_with_its_labels() {
    let source = Arc::new(DeviceStats { errors: 3.into() });
    let exporter = MetricsExporter::new(&[("node".to_owned(), "n7".to_owned())], Duration::from_secs(60));
    let stamps = vec![("tier".to_owned(), "SSD".to_owned()), ("backend".to_owned(), "SsdBackend".to_owned())];
    exporter.add_source("backend:SsdBackend", stamps, Arc::clone(&source) as Arc<dyn MetricSource + Send + Sync>);
    let text = exporter.render();
    let ssd = [("node", "n7"), ("tier", "SSD"), ("backend", "SsdBackend")];
    let with = |extra: (&'static str, &'static str)| {
        let mut l = ssd.to_vec();
        l.push(extra);
        l
    };
    assert_eq!(value(&text, names::MEDIUM_EVENTS_TOTAL, &with(("event", "device_read_error"))), Some(3.0));
    assert_eq!(value(&text, names::MEDIUM_BYTES_TOTAL, &with(("event", "spill"))), Some(8192.0));
    assert_eq!(value(&text, names::MEDIUM_STATE, &with(("state", "queue_depth"))), Some(7.0));
    assert!(!text.contains("FAKE"), "a source cannot override tier=\n{text}");
    source.errors.store(5, std::sync::atomic::Ordering::Relaxed);
    let text = exporter.render();
    assert_eq!(value(&text, names::MEDIUM_EVENTS_TOTAL, &with(("event", "device_read_error"))), Some(5.0));
}

/// A source publishing fixed samples, changed by the test between publishes.
#[derive(Debug, Default)]
struct Fixed(parking_lot::Mutex<Vec<MetricSample>>);

impl MetricSource for Fixed {
    fn sample_metrics(&self) -> Vec<MetricSample> {
        self.0.lock().clone()
    }
}

#[test]
fn publisher_ships_counter_deltas_ships_a_reset_whole_and_scales() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let mut publisher = MetricPublisher::new();
    let counter = |v| MetricSample::counter(names::MEDIUM_EVENTS_TOTAL, "h", vec![("event".into(), "x".into())], v);
    let seconds = |v| {
        let mut s = MetricSample::counter(names::OP_SECONDS_TOTAL, "h", vec![("op".into(), "commit".into())], v);
        s.scale = 1e-9;
        s
    };
    let read = |r: &metrics_exporter_prometheus::PrometheusRecorder, name: &str| {
        value(&r.handle().render(), name, &[]).expect("series")
    };
    publisher.publish("s", &[], vec![counter(10), seconds(2_000_000_000)], &recorder);
    assert_eq!(read(&recorder, names::MEDIUM_EVENTS_TOTAL), 10.0);
    assert!((read(&recorder, names::OP_SECONDS_TOTAL) - 2.0).abs() < 1e-9);
    publisher.publish("s", &[], vec![counter(15), seconds(3_000_000_000)], &recorder);
    assert_eq!(read(&recorder, names::MEDIUM_EVENTS_TOTAL), 15.0);
    assert!((read(&recorder, names::OP_SECONDS_TOTAL) - 3.0).abs() < 1e-9);
    // The source restarted and counted 4 since: those 4 are shipped whole (as Prometheus reads a
    // counter reset), the baseline moves to 4; then +2.
    publisher.publish("s", &[], vec![counter(4)], &recorder);
    assert_eq!(read(&recorder, names::MEDIUM_EVENTS_TOTAL), 19.0);
    publisher.publish("s", &[], vec![counter(6)], &recorder);
    assert_eq!(read(&recorder, names::MEDIUM_EVENTS_TOTAL), 21.0);
    // A second source of the same series has baselines of its own.
    publisher.publish("t", &[], vec![counter(1)], &recorder);
    assert_eq!(read(&recorder, names::MEDIUM_EVENTS_TOTAL), 22.0);
    // Gauges are readings.
    let gauge = |v| MetricSample::gauge(names::MEDIUM_STATE, "h", vec![], v);
    publisher.publish("s", &[], vec![gauge(9)], &recorder);
    publisher.publish("s", &[], vec![gauge(2)], &recorder);
    assert_eq!(read(&recorder, names::MEDIUM_STATE), 2.0);

    let fixed = Arc::new(Fixed::default());
    fixed.0.lock().push(counter(1));
    let exporter = MetricsExporter::new(&[], Duration::from_secs(60));
    exporter.add_source("fixed", vec![], fixed);
    assert_eq!(value(&exporter.render(), names::MEDIUM_EVENTS_TOTAL, &[]), Some(1.0));
}

/// More threads than owned shards at once (some write the shared shard), then short-lived threads
/// that recycle shard ids: every call is still counted exactly once.
#[test]
fn counts_are_exact_across_many_threads_and_recycled_shards() {
    let (backend, wrapped) = mock(TierType::Dram, 16);
    put(backend.as_ref(), &["hot"]);
    let hot = keys(&["hot", "cold"]);
    std::thread::scope(|s| {
        for _ in 0..48 {
            s.spawn(|| {
                for _ in 0..50 {
                    backend.batch_resolve(&hot, false);
                }
            });
        }
    });
    for _ in 0..64 {
        std::thread::scope(|s| {
            s.spawn(|| backend.batch_resolve(&hot, false));
        });
    }
    let r = wrapped.counts(Op::Resolve);
    let calls = 48 * 50 + 64;
    assert_eq!(r.batches, calls);
    assert_eq!((r.entries(Status::Ok), r.entries(Status::Miss)), (calls, calls));
    assert_eq!(r.bytes, calls * PAGE);
}

/// The first small call is timed; an untimed one is charged the latest timed small call's duration,
/// so a quiet medium's mean latency is a measured one from the first call on.
#[test]
fn untimed_small_calls_are_charged_the_latest_timed_duration() {
    let (backend, wrapped) = mock(TierType::Dram, 16);
    let miss = keys(&["absent"]);
    backend.batch_resolve(&miss, false);
    let first = wrapped.counts(Op::Resolve).nanos;
    assert!(first > 0);
    backend.batch_resolve(&miss, false);
    let r = wrapped.counts(Op::Resolve);
    assert_eq!((r.batches, r.nanos), (2, 2 * first));
}

/// `names` is the complete list: the TCP engine's series are there, under their exported names.
#[test]
fn names_include_the_tcp_engine_series() {
    assert_eq!(names::TRANSFER_TCP_SERVER_REQUESTS_TOTAL, "umbp_transfer_tcp_server_requests_total");
    assert_eq!(names::TRANSFER_TCP_CONNECTIONS_OPENED_TOTAL, "umbp_transfer_tcp_connections_opened_total");
    assert!(names::TRANSFER_TCP_ALL.iter().all(|n| n.starts_with("umbp_transfer_tcp_")));
}

/// An existence check (`batch_contains`) is a lookup: it never moves the resolve series — neither
/// the read bytes nor the hit and miss counts the read-bandwidth and hit-rate panels use.
#[test]
fn exists_traffic_moves_lookup_not_resolve() {
    let (backend, wrapped) = mock(TierType::Dram, 16);
    put(backend.as_ref(), &["k1", "k2"]);
    backend.batch_resolve(&keys(&["k1", "x"]), true);
    let exporter = MetricsExporter::new(&[], Duration::from_secs(60));
    exporter.add_backend(&backend);
    let before_text = exporter.render();
    let resolve_before = wrapped.counts(Op::Resolve);

    for _ in 0..3 {
        assert_eq!(backend.batch_contains(&keys(&["k1", "k2", "x"])), [true, true, false]);
    }

    assert_eq!(wrapped.counts(Op::Resolve), resolve_before, "a lookup moved the resolve counters");
    let lookup = wrapped.counts(Op::Lookup);
    assert_eq!((lookup.batches, lookup.entries(Status::Ok), lookup.entries(Status::Miss), lookup.bytes), (3, 6, 3, 0));
    let text = exporter.render();
    let dram = |extra: &[(&'static str, &'static str)]| {
        let mut l = vec![("tier", "DRAM"), ("backend", "MockBackend")];
        l.extend_from_slice(extra);
        l
    };
    for labels in [&[("op", "resolve"), ("status", "ok")][..], &[("op", "resolve"), ("status", "miss")]] {
        assert_eq!(
            value(&text, names::OPS_TOTAL, &dram(labels)),
            value(&before_text, names::OPS_TOTAL, &dram(labels)),
            "{labels:?}"
        );
    }
    assert_eq!(
        value(&text, names::BYTES_TOTAL, &dram(&[("op", "resolve")])),
        value(&before_text, names::BYTES_TOTAL, &dram(&[("op", "resolve")]))
    );
    assert_eq!(value(&text, names::OPS_TOTAL, &dram(&[("op", "lookup"), ("status", "ok")])), Some(6.0));
    assert_eq!(value(&text, names::BYTES_TOTAL, &dram(&[("op", "lookup")])), None, "a lookup has no bytes");
}

/// A scaled counter (seconds shipped from nanoseconds) is a `metrics` gauge inside, but the rendered
/// text types it `counter`: it is a monotonic total.
#[test]
fn scaled_counters_are_typed_counter_in_the_rendered_text() {
    let (backend, _) = mock(TierType::Dram, 16);
    put(backend.as_ref(), &["k1"]);
    let exporter = MetricsExporter::new(&[], Duration::from_secs(60));
    exporter.add_backend(&backend);
    let text = exporter.render();
    assert!(text.contains(&format!("# TYPE {} counter\n", names::OP_SECONDS_TOTAL)), "{text}");
    assert!(!text.contains(&format!("# TYPE {} gauge", names::OP_SECONDS_TOTAL)), "{text}");
    // Gauges stay gauges, integer counters stay counters.
    assert!(text.contains(&format!("# TYPE {} gauge\n", names::MEDIUM_STATE)), "{text}");
    assert!(text.contains(&format!("# TYPE {} counter\n", names::OPS_TOTAL)), "{text}");
}

/// The decorator forwards a reader's release (so a wrapped medium's leases end at the release,
/// not at their expiry) and counts a busy resolve as `no_space`, never as a miss.
#[test]
fn releases_reach_the_wrapped_medium_and_busy_is_not_a_miss() {
    let inner = Arc::new(MockBackend::new(MockConfig { page_size: PAGE, pages: 4, ..MockConfig::default() }));
    let wrapped = Arc::new(InstrumentedBackend::new(Arc::clone(&inner) as Arc<dyn MediumBackend>));
    wrapped.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    put(wrapped.as_ref(), &["k"]);
    let hit = wrapped.batch_resolve(&keys(&["k"]), false).remove(0);
    assert!(hit.found && hit.lease != 0, "a hit names its lease: {hit:?}");
    assert_eq!(wrapped.evict(&keys(&["k"]))[0].bytes_freed, 0, "leased");
    wrapped.release_reads(&[ReadRelease::new("k", hit.lease)]);
    assert_eq!(inner.calls().release_reads, 1, "the release reached the medium");
    assert_eq!(wrapped.evict(&keys(&["k"]))[0].bytes_freed, PAGE, "the released key is evictable at once");

    put(wrapped.as_ref(), &["b"]);
    inner.answer_busy(1);
    let before = wrapped.counts(Op::Resolve);
    assert!(wrapped.batch_resolve(&keys(&["b"]), false)[0].busy);
    let after = wrapped.counts(Op::Resolve);
    assert_eq!(after.entries(Status::NoSpace) - before.entries(Status::NoSpace), 1, "busy counts as no_space");
    assert_eq!(after.entries(Status::Miss), before.entries(Status::Miss), "busy is not a miss");
}

/// A busy allocation (room, but no staging page free now) counts as `no_space` like a busy
/// resolve: not a failure, not a slot, and no bytes.
#[test]
fn a_busy_allocation_counts_as_no_space_not_as_failed() {
    let inner = Arc::new(MockBackend::new(MockConfig { page_size: PAGE, pages: 4, ..MockConfig::default() }));
    let wrapped = Arc::new(InstrumentedBackend::new(Arc::clone(&inner) as Arc<dyn MediumBackend>));
    wrapped.init(Arc::new(LocalOnlyRegistrar::new())).expect("init");
    inner.answer_allocate_busy(2);
    let before = wrapped.counts(Op::Allocate);
    let r = wrapped.batch_allocate(&[
        AllocateRequest::new("a", 10),
        AllocateRequest::new("b", 10),
        AllocateRequest::new("c", 10),
    ]);
    let outcomes: Vec<AllocateOutcome> = r.iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, [AllocateOutcome::Busy, AllocateOutcome::Busy, AllocateOutcome::Allocated]);
    let after = wrapped.counts(Op::Allocate);
    assert_eq!(after.entries(Status::NoSpace) - before.entries(Status::NoSpace), 2, "busy counts as no_space");
    assert_eq!(after.entries(Status::Failed), before.entries(Status::Failed), "busy is not a failure");
    assert_eq!(after.entries(Status::Ok) - before.entries(Status::Ok), 1);
}
