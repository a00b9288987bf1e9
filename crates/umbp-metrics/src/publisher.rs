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
/// counter is incremented by its increase since the previous sample of the same series (a decrease
/// rebases silently: the source restarted), each times the sample's `scale`.
///
/// The publisher stamps the source's labels (`tier=`, `backend=` for a medium) on every sample; a
/// sample label with the same name as a source label is dropped, so a source cannot override them.
///
/// A counter with a scale other than 1 (nanoseconds shipped as seconds) becomes a `metrics` gauge
/// moved by the scaled increase: `metrics` counters are integers. Its value is still a monotonic
/// total, and `rate()` over it is what the dashboard asks for.
#[derive(Debug, Default)]
pub struct MetricPublisher {
    /// Last raw value of each counter series, keyed by source id, name and labels.
    baselines: HashMap<String, u64>,
    /// Names whose help text was handed to the recorder.
    described: HashSet<&'static str>,
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
                    // A decrease means the source restarted its count: ship nothing, rebase.
                    let delta = sample.value.saturating_sub(last);
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
