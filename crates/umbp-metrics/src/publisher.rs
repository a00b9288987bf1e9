//! `MetricPublisher`: `MetricSource` samples → `metrics`-crate series.

use std::collections::{HashMap, HashSet};

use metrics::{Key, Label, Level, Metadata, Recorder, SharedString};
use umbp_core::{MetricKind, MetricSample};

/// Labels a source stamps on every sample it publishes (`tier=`, `backend=` for a medium).
pub type Labels = Vec<(String, String)>;

fn metadata() -> Metadata<'static> {
    Metadata::new("umbp", Level::INFO, Some(module_path!()))
}

/// Turns [`MetricSample`]s into series of a [`metrics::Recorder`]: a gauge is set to its reading, a
/// counter is incremented by its increase since the previous sample of the same series, each times
/// the sample's `scale`. A decrease means the source restarted its count: its new value is shipped
/// whole (what it counted since the restart), as Prometheus reads a counter reset.
///
/// The publisher stamps the source's labels (`tier=`, `backend=` for a medium) on every sample; a
/// sample label with the same name as a source label is dropped, so a source cannot override them.
///
/// A counter with a scale other than 1 (nanoseconds shipped as seconds) becomes a `metrics` gauge
/// moved by the scaled increase: `metrics` counters are integers. Its value is still a monotonic
/// total, so [`retype_scaled_counters`](Self::retype_scaled_counters) types it `counter` in the
/// rendered text; `rate()` over it is what the dashboard asks for.
#[derive(Debug, Default)]
pub struct MetricPublisher {
    /// Last raw value of each counter series, keyed by source id, name and labels.
    baselines: HashMap<String, u64>,
    /// Names whose help text was handed to the recorder.
    described: HashSet<&'static str>,
    /// Counter names published with a scale (kept as `metrics` gauges, rendered as counters).
    scaled_counters: HashSet<&'static str>,
}

impl MetricPublisher {
    /// An empty publisher: the first sample of each counter ships its whole value.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets every counter baseline (the next samples ship their whole values).
    pub fn reset(&mut self) {
        self.baselines.clear();
    }

    /// Publishes `samples` of the source `source_id` into `sink`, stamping `source_labels` on each.
    pub fn publish(
        &mut self,
        source_id: &str,
        source_labels: &[(String, String)],
        samples: Vec<MetricSample>,
        sink: &dyn Recorder,
    ) {
        for sample in samples {
            if sample.name.is_empty() {
                continue;
            }
            let mut labels: Vec<Label> = source_labels.iter().map(|(k, v)| Label::new(k.clone(), v.clone())).collect();
            labels.extend(
                sample
                    .labels
                    .iter()
                    .filter(|(k, _)| !source_labels.iter().any(|(s, _)| s == k))
                    .map(|(k, v)| Label::new(k.clone(), v.clone())),
            );
            let integral = sample.scale == 1.0;
            if !integral && sample.kind == MetricKind::Counter {
                self.scaled_counters.insert(sample.name);
            }
            if self.described.insert(sample.name) {
                let help = SharedString::const_str(sample.help);
                match sample.kind {
                    MetricKind::Counter if integral => sink.describe_counter(sample.name.into(), None, help),
                    _ => sink.describe_gauge(sample.name.into(), None, help),
                }
            }
            let key = Key::from_parts(sample.name, labels);
            match sample.kind {
                MetricKind::Gauge => sink.register_gauge(&key, &metadata()).set(sample.value as f64 * sample.scale),
                MetricKind::Counter => {
                    let id = baseline_key(source_id, &key);
                    let last = self.baselines.insert(id, sample.value).unwrap_or(0);
                    // A decrease means the source restarted its count: ship the new value whole.
                    let delta = if sample.value >= last { sample.value - last } else { sample.value };
                    if integral {
                        sink.register_counter(&key, &metadata()).increment(delta);
                    } else {
                        // Touched even at 0, so an idle series stays fresh in the exporter.
                        sink.register_gauge(&key, &metadata()).increment(delta as f64 * sample.scale);
                    }
                }
            }
        }
    }
}

impl MetricPublisher {
    /// `text` (the Prometheus exposition of the recorder this publisher feeds) with the `# TYPE`
    /// line of every scaled counter saying `counter` instead of `gauge`.
    pub fn retype_scaled_counters(&self, text: String) -> String {
        if self.scaled_counters.is_empty() {
            return text;
        }
        let mut out = String::with_capacity(text.len());
        for line in text.split_inclusive('\n') {
            let scaled = line
                .strip_prefix("# TYPE ")
                .and_then(|rest| rest.trim_end().strip_suffix(" gauge"))
                .is_some_and(|name| self.scaled_counters.contains(name));
            if scaled {
                out.push_str(&line.replacen(" gauge", " counter", 1));
            } else {
                out.push_str(line);
            }
        }
        out
    }
}

/// `source\0name\0k=v\0k=v…`: unique per series of a source.
fn baseline_key(source_id: &str, key: &Key) -> String {
    let mut id = String::with_capacity(64);
    id.push_str(source_id);
    id.push('\0');
    id.push_str(key.name());
    for l in key.labels() {
        id.push('\0');
        id.push_str(l.key());
        id.push('=');
        id.push_str(l.value());
    }
    id
}
