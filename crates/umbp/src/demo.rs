//! `umbp demo`: an embedded master and a few DRAM nodes in this process on 127.0.0.1, a verified
//! put/get workload, and a summary a newcomer can read.

use std::collections::HashSet;
use std::fmt;
use std::time::{Duration, Instant};

use umbp_master::{MasterConfig, MasterHandle};
use umbp_peer::pool_client::{DramConfig, KeyError, Medium, PoolClient, PoolClientConfig, RecachePolicy};

use crate::cli::DemoArgs;
use crate::progress::Progress;
use crate::units::{format_size, human_size};

/// Keys the get phase asks for that were never written: they must come back as misses.
const NEVER_WRITTEN: usize = 16;

/// How long the demo waits for the master to index every written key.
const INDEX_WAIT: Duration = Duration::from_secs(10);

/// What the demo runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoOptions {
    /// Nodes to start (at least 2: one writes, another reads). Default: 3.
    pub nodes: usize,
    /// Keys written. Default: 512.
    pub keys: usize,
    /// Smallest value. Default: 16 KiB.
    pub min_value: u64,
    /// Largest value. Default: 1 MiB.
    pub max_value: u64,
    /// DRAM each node lends. Default: 128 MiB.
    pub capacity: u64,
    /// Page size of every node. Default: 64 KiB.
    pub page_size: u64,
    /// Keys per batch. Default: 64.
    pub batch: usize,
    /// Seed of the sizes and bytes. Default: 1.
    pub seed: u64,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            nodes: 3,
            keys: 512,
            min_value: 16 << 10,
            max_value: 1 << 20,
            capacity: 128 << 20,
            page_size: 64 << 10,
            batch: 64,
            seed: 1,
        }
    }
}

impl DemoOptions {
    /// The defaults overridden by the flags that are set.
    pub fn from_args(args: &DemoArgs) -> Self {
        let d = Self::default();
        Self {
            nodes: args.nodes.unwrap_or(d.nodes),
            keys: args.keys.unwrap_or(d.keys),
            min_value: args.min_value.unwrap_or(d.min_value),
            max_value: args.max_value.unwrap_or(d.max_value),
            capacity: args.capacity.unwrap_or(d.capacity),
            page_size: args.page_size.unwrap_or(d.page_size),
            batch: args.batch.unwrap_or(d.batch),
            seed: args.seed.unwrap_or(d.seed),
        }
    }

    fn validate(&self) -> Result<(), DemoError> {
        let bad = |reason: String| Err(DemoError::Options(reason));
        if self.nodes < 2 {
            return bad(format!("--nodes {} : the demo needs at least 2 (one writes, another reads)", self.nodes));
        }
        if self.keys == 0 || self.batch == 0 {
            return bad("--keys and --batch must be at least 1".into());
        }
        if self.min_value == 0 || self.min_value > self.max_value {
            return bad(format!(
                "value sizes must satisfy 0 < --min-value ({}) <= --max-value ({})",
                format_size(self.min_value),
                format_size(self.max_value)
            ));
        }
        if self.page_size == 0 || self.capacity < self.max_value.max(self.page_size) {
            return bad(format!(
                "--capacity {} must hold the largest value ({}) and a page ({})",
                format_size(self.capacity),
                format_size(self.max_value),
                format_size(self.page_size)
            ));
        }
        Ok(())
    }
}

/// Why the demo could not run (a failed verification is a [`DemoReport`], not an error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// The options can never work.
    #[error("{0}")]
    Options(String),
    /// The embedded master did not start.
    #[error("starting the master: {0}")]
    Master(#[from] umbp_master::MasterError),
    /// A node did not start.
    #[error("starting node {node}: {source}")]
    Node {
        /// The node.
        node: String,
        /// The cause.
        #[source]
        source: umbp_peer::pool_client::PoolError,
    },
}

/// One node's share, after the workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePlacement {
    /// The node id.
    pub node_id: String,
    /// Keys its medium holds.
    pub keys: u64,
    /// Bytes of its medium in use.
    pub used_bytes: u64,
    /// Bytes its medium lends.
    pub total_bytes: u64,
    /// Keys the master's index holds for it.
    pub indexed_keys: u64,
}

/// What the demo did and found.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoReport {
    /// The options it ran with.
    pub options: DemoOptions,
    /// The master's address.
    pub master: String,
    /// Keys the put phase wrote, and their bytes.
    pub put_keys: usize,
    /// Bytes written.
    pub put_bytes: u64,
    /// Wall time of the put phase.
    pub put_time: Duration,
    /// Keys whose put failed, with the first few errors.
    pub put_failures: Vec<(String, String)>,
    /// Time until the master indexed every key (heartbeats are asynchronous).
    pub index_time: Duration,
    /// Keys the get phase asked for (written and never written).
    pub get_keys: usize,
    /// Bytes read.
    pub get_bytes: u64,
    /// Wall time of the get phase.
    pub get_time: Duration,
    /// Hits served by the reading node's own medium.
    pub local_hits: usize,
    /// Hits served by another node.
    pub remote_hits: usize,
    /// Misses of never-written keys (expected).
    pub expected_misses: usize,
    /// Misses of written keys (a failure).
    pub unexpected_misses: Vec<String>,
    /// Hits whose bytes or size differ from what was written (a failure).
    pub wrong_bytes: Vec<String>,
    /// Hits of never-written keys (a failure).
    pub phantom_hits: Vec<String>,
    /// Gets that failed with an error other than a miss.
    pub get_errors: Vec<(String, String)>,
    /// Where the keys landed.
    pub placement: Vec<NodePlacement>,
}

impl DemoReport {
    /// Whether every written key was stored and read back byte-exact, and nothing else was found.
    pub fn passed(&self) -> bool {
        self.put_failures.is_empty()
            && self.unexpected_misses.is_empty()
            && self.wrong_bytes.is_empty()
            && self.phantom_hits.is_empty()
            && self.get_errors.is_empty()
    }
}

fn rate(bytes: u64, time: Duration) -> String {
    let secs = time.as_secs_f64().max(1e-9);
    format!("{}/s", human_size((bytes as f64 / secs) as u64))
}

fn list(items: &[String]) -> String {
    let mut s = items.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    if items.len() > 5 {
        s.push_str(&format!(", … ({} in all)", items.len()));
    }
    s
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let o = &self.options;
        writeln!(
            f,
            "umbp demo: a master and {} DRAM nodes in this process on 127.0.0.1 (master {})",
            o.nodes, self.master
        )?;
        writeln!(
            f,
            "  each node lends {} in {} pages; values of {} to {}; batches of {}",
            human_size(o.capacity),
            human_size(o.page_size),
            human_size(o.min_value),
            human_size(o.max_value),
            o.batch
        )?;
        writeln!(f)?;
        let failed = self.put_failures.len();
        writeln!(
            f,
            "put  {} keys, {} from n1: {:.3} s, {} ({} failed)",
            self.put_keys,
            human_size(self.put_bytes),
            self.put_time.as_secs_f64(),
            rate(self.put_bytes, self.put_time),
            failed
        )?;
        for (key, error) in self.put_failures.iter().take(5) {
            writeln!(f, "       {key}: {error}")?;
        }
        writeln!(f, "     the master indexed every key {:.3} s later (heartbeats)", self.index_time.as_secs_f64())?;
        writeln!(
            f,
            "get  {} keys from n2 ({} written + {} never written): {:.3} s, {}",
            self.get_keys,
            self.put_keys,
            NEVER_WRITTEN,
            self.get_time.as_secs_f64(),
            rate(self.get_bytes, self.get_time)
        )?;
        writeln!(
            f,
            "     hits {} ({} on n2 itself, {} from other nodes over TCP), misses {} (all never written: {})",
            self.local_hits + self.remote_hits,
            self.local_hits,
            self.remote_hits,
            self.expected_misses + self.unexpected_misses.len(),
            if self.unexpected_misses.is_empty() { "yes" } else { "NO" }
        )?;
        writeln!(
            f,
            "     wrong bytes {}, errors {}",
            self.wrong_bytes.len() + self.phantom_hits.len(),
            self.get_errors.len()
        )?;
        if !self.unexpected_misses.is_empty() {
            writeln!(f, "     written but missing: {}", list(&self.unexpected_misses))?;
        }
        if !self.wrong_bytes.is_empty() {
            writeln!(f, "     wrong bytes: {}", list(&self.wrong_bytes))?;
        }
        if !self.phantom_hits.is_empty() {
            writeln!(f, "     found but never written: {}", list(&self.phantom_hits))?;
        }
        for (key, error) in self.get_errors.iter().take(5) {
            writeln!(f, "     {key}: {error}")?;
        }
        writeln!(f)?;
        writeln!(f, "placement        keys        used / capacity   master's index")?;
        for p in &self.placement {
            writeln!(
                f,
                "  {:<10} {:>8}   {:>10} / {:<10} {:>8} keys",
                p.node_id,
                p.keys,
                human_size(p.used_bytes),
                human_size(p.total_bytes),
                p.indexed_keys
            )?;
        }
        let total: u64 = self.placement.iter().map(|p| p.keys).sum();
        writeln!(f, "  {:<10} {:>8}", "total", total)?;
        writeln!(f)?;
        if self.passed() {
            write!(f, "result: PASS — every key read back byte-exact, every never-written key a miss")
        } else {
            write!(f, "result: FAIL — see above")
        }
    }
}

/// A small deterministic generator (splitmix64): the demo needs repeatable sizes and bytes, not
/// quality randomness.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A size in `[min, max]`, log-uniform so small and large values both show up.
    fn size(&mut self, min: u64, max: u64) -> u64 {
        let unit = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
        ((lo + unit * (hi - lo)).exp() as u64).clamp(min, max)
    }

    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let word = self.next().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

/// Starts the master and the nodes, runs the workload, stops everything and reports.
///
/// Needs a multi-threaded tokio runtime (the nodes' transfers block in place).
pub async fn run(options: DemoOptions) -> Result<DemoReport, DemoError> {
    options.validate()?;
    let master = umbp_master::start(MasterConfig {
        listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        // Heartbeat every second, so the master's view catches up quickly.
        heartbeat_ttl: Duration::from_secs(2),
        ..MasterConfig::default()
    })
    .await?;
    let mut nodes = Vec::with_capacity(options.nodes);
    for n in 1..=options.nodes {
        match start_node(&master, &format!("n{n}"), &options).await {
            Ok(node) => nodes.push(node),
            Err(e) => {
                for node in &nodes {
                    node.close().await;
                }
                master.shutdown().await;
                return Err(e);
            }
        }
    }
    crate::progress::note(format_args!("umbp demo: a master and {} nodes up on 127.0.0.1", nodes.len()));
    let report = workload(&master, &nodes, &options).await;
    for node in &nodes {
        node.close().await;
    }
    master.shutdown().await;
    Ok(report)
}

async fn start_node(master: &MasterHandle, id: &str, options: &DemoOptions) -> Result<PoolClient, DemoError> {
    let mut config = PoolClientConfig::new(id, master.local_addr().to_string()).with_medium(Medium::Dram(DramConfig {
        capacity_bytes: options.capacity,
        prefault: false,
        ..DramConfig::default()
    }));
    config.page_size = options.page_size;
    config.bounce_bytes = 16 << 20;
    // Off, so the placement table shows where the master put each key (a re-cached copy on the
    // reader would count twice).
    config.recache = RecachePolicy::Off;
    PoolClient::start(config).await.map_err(|source| DemoError::Node { node: id.to_owned(), source })
}

async fn workload(master: &MasterHandle, nodes: &[PoolClient], o: &DemoOptions) -> DemoReport {
    let (writer, reader) = (&nodes[0], &nodes[1]);
    let mut rng = SplitMix(o.seed);
    let keys: Vec<String> = (0..o.keys).map(|i| format!("demo/{:016x}/{i:05}", o.seed)).collect();
    let values: Vec<Vec<u8>> = keys
        .iter()
        .map(|_| {
            let mut v = vec![0u8; rng.size(o.min_value, o.max_value) as usize];
            rng.fill(&mut v);
            v
        })
        .collect();
    let put_bytes: u64 = values.iter().map(|v| v.len() as u64).sum();

    // Put: every batch from n1; the master spreads them over the nodes.
    let mut put_failures = Vec::new();
    let started = Instant::now();
    let mut progress = Progress::new("umbp demo: put", keys.len());
    for (key_batch, value_batch) in keys.chunks(o.batch).zip(values.chunks(o.batch)) {
        let items: Vec<(&str, &[u8])> =
            key_batch.iter().map(String::as_str).zip(value_batch.iter().map(Vec::as_slice)).collect();
        for ((key, _), result) in items.iter().zip(writer.batch_put(&items).await) {
            if let Err(e) = result {
                put_failures.push(((*key).to_owned(), e.to_string()));
            }
        }
        progress.advance(key_batch.len());
    }
    progress.finish();
    let put_time = started.elapsed();
    let failed: HashSet<String> = put_failures.iter().map(|(k, _)| k.clone()).collect();

    // Wait until the master has heard of every stored key: n2 finds keys through the master.
    let started = Instant::now();
    for node in nodes {
        node.flush();
    }
    let stored: Vec<String> = keys.iter().filter(|k| !failed.contains(*k)).cloned().collect();
    loop {
        let found = writer.master().batch_lookup(&stored).await.unwrap_or_default();
        if found.len() == stored.len() && found.iter().all(|f| *f) || started.elapsed() > INDEX_WAIT {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let index_time = started.elapsed();

    // Get: everything from n2, plus keys nobody wrote.
    let on_reader: HashSet<String> =
        reader.medium().map(|m| m.snapshot_owned_keys().into_iter().map(|e| e.key).collect()).unwrap_or_default();
    let absent: Vec<String> = (0..NEVER_WRITTEN).map(|i| format!("demo/{:016x}/never-written-{i}", o.seed)).collect();
    let all: Vec<&str> = keys.iter().chain(&absent).map(String::as_str).collect();
    let expected: Vec<Option<&Vec<u8>>> =
        values.iter().map(Some).chain(std::iter::repeat_n(None, NEVER_WRITTEN)).collect();
    let mut bufs: Vec<Vec<u8>> =
        expected.iter().map(|v| vec![0u8; v.map_or(o.max_value as usize, |v| v.len())]).collect();
    let mut results = Vec::with_capacity(all.len());
    let started = Instant::now();
    let mut progress = Progress::new("umbp demo: get", all.len());
    for (key_batch, buf_batch) in all.chunks(o.batch).zip(bufs.chunks_mut(o.batch)) {
        let mut slices: Vec<&mut [u8]> = buf_batch.iter_mut().map(Vec::as_mut_slice).collect();
        results.extend(reader.batch_get(key_batch, &mut slices).await);
        progress.advance(key_batch.len());
    }
    progress.finish();
    let get_time = started.elapsed();

    let mut report = DemoReport {
        options: o.clone(),
        master: master.local_addr().to_string(),
        put_keys: o.keys,
        put_bytes,
        put_time,
        put_failures,
        index_time,
        get_keys: all.len(),
        get_bytes: 0,
        get_time,
        local_hits: 0,
        remote_hits: 0,
        expected_misses: 0,
        unexpected_misses: Vec::new(),
        wrong_bytes: Vec::new(),
        phantom_hits: Vec::new(),
        get_errors: Vec::new(),
        placement: Vec::new(),
    };
    for (i, result) in results.into_iter().enumerate() {
        let key = all[i].to_owned();
        match (result, expected[i]) {
            (Ok(size), Some(value)) => {
                report.get_bytes += size;
                if size as usize == value.len() && bufs[i][..value.len()] == value[..] {
                    if on_reader.contains(&key) {
                        report.local_hits += 1;
                    } else {
                        report.remote_hits += 1;
                    }
                } else {
                    report.wrong_bytes.push(key);
                }
            }
            (Ok(_), None) => report.phantom_hits.push(key),
            (Err(KeyError::Miss), None) => report.expected_misses += 1,
            (Err(KeyError::Miss), Some(_)) if failed.contains(&key) => {}
            (Err(KeyError::Miss), Some(_)) => report.unexpected_misses.push(key),
            (Err(e), _) => report.get_errors.push((key, e.to_string())),
        }
    }

    let status = writer.master().cluster_status().await.unwrap_or_default();
    for node in nodes {
        let indexed = status.nodes.iter().find(|s| s.node_id == node.node_id()).map_or(0, |s| s.key_count);
        let (keys, used, total) = node.medium().map_or((0, 0, 0), |m| {
            let c = m.capacity();
            (m.owned_key_count() as u64, c.total_bytes.saturating_sub(c.available_bytes), c.total_bytes)
        });
        report.placement.push(NodePlacement {
            node_id: node.node_id().to_owned(),
            keys,
            used_bytes: used,
            total_bytes: total,
            indexed_keys: indexed,
        });
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_stay_in_range_and_vary() {
        let mut rng = SplitMix(7);
        let sizes: Vec<u64> = (0..1000).map(|_| rng.size(16 << 10, 1 << 20)).collect();
        assert!(sizes.iter().all(|s| (16 << 10..=1 << 20).contains(s)));
        assert!(sizes.iter().any(|s| *s < 64 << 10) && sizes.iter().any(|s| *s > 512 << 10));
    }

    #[test]
    fn bad_options_are_refused() {
        for o in [
            DemoOptions { nodes: 1, ..DemoOptions::default() },
            DemoOptions { keys: 0, ..DemoOptions::default() },
            DemoOptions { min_value: 2 << 20, ..DemoOptions::default() },
            DemoOptions { capacity: 512 << 10, ..DemoOptions::default() },
        ] {
            assert!(o.validate().is_err(), "{o:?}");
        }
    }
}
