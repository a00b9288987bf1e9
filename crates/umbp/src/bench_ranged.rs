//! `umbp bench ranged`: a ranged get against a whole-value get of the same bytes (issue 21, item 4:
//! a 1 MiB value read as 8 ranges into 8 buffers at ≥ 0.9× of one whole-value get).
//!
//! A master in this process, a DRAM node in a child process (`umbp bench-child`, as the pool
//! suite's remote rows) and two client-only nodes here: over TCP (`shared_memory = false`) and
//! through shared memory. Every round, per path, a batch of values is put once, then read twice —
//! whole (`batch_get`, one buffer per key) and as 8 equal ranges per key into 8 buffers
//! (`batch_get_ranges`) — which goes first alternating by round; every read is compared byte for
//! byte; each cell is the median of the rounds, and the ratio is ranged / whole.

use std::fmt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use umbp_master::routing::Affinity;
use umbp_peer::pool_client::{Medium, PoolClient};

use crate::bench::{
    BenchError, bench_master, fail, gbps, median, node_config, poison, stamp_values, start_child, start_node,
    until_indexed, verify,
};
use crate::cli::BenchArgs;
use crate::progress::Progress;
use crate::units::human_size;

/// The value size measured.
pub const VALUE: usize = 1 << 20;

/// Ranges per value.
pub const RANGES: usize = 8;

/// What the ranged bench runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangedOptions {
    /// Rounds per cell; the medians are reported. Default: 5.
    pub rounds: usize,
    /// Bytes per batch (at least 1 MiB). Default: 64 MiB.
    pub batch_bytes: u64,
    /// The program run as the child node. Default: this executable.
    pub child_program: Option<PathBuf>,
}

impl RangedOptions {
    /// The options of `umbp bench ranged` (`--rounds`, `--batch-bytes`).
    pub fn from_args(args: &BenchArgs) -> Self {
        Self {
            rounds: args.rounds.unwrap_or(5),
            batch_bytes: args.batch_bytes.unwrap_or(64 << 20),
            child_program: None,
        }
    }

    fn validate(&self) -> Result<(), BenchError> {
        if self.rounds == 0 {
            return Err(BenchError::Options("--rounds must be at least 1".into()));
        }
        if self.batch_bytes < VALUE as u64 {
            return Err(BenchError::Options(format!(
                "--batch-bytes must be at least 1MiB (one value), got {}",
                human_size(self.batch_bytes)
            )));
        }
        Ok(())
    }

    /// DRAM the child lends: one round's batch (removed after it), with room below the master's
    /// eviction watermark.
    fn child_capacity(&self) -> u64 {
        let stored = self.batch_bytes;
        (stored + stored / 2 + (64 << 20)).div_ceil(64 << 10) * (64 << 10)
    }
}

/// One path's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct RangedRow {
    /// `remote (TCP)` or `same host (shm)`.
    pub path: &'static str,
    /// Median GB/s of the ranged gets.
    pub ranged_gbps: f64,
    /// Median GB/s of the whole-value gets.
    pub whole_gbps: f64,
}

impl RangedRow {
    /// Ranged over whole: 1.0 is as fast.
    pub fn ratio(&self) -> f64 {
        self.ranged_gbps / self.whole_gbps
    }
}

/// The bench's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct RangedReport {
    /// Rounds per cell.
    pub rounds: usize,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// One row per path.
    pub rows: Vec<RangedRow>,
}

impl RangedReport {
    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"path\":\"{}\",\"ranged_gbps\":{:.4},\"whole_gbps\":{:.4},\"ratio\":{:.4}}}",
                    r.path,
                    r.ranged_gbps,
                    r.whole_gbps,
                    r.ratio()
                )
            })
            .collect();
        format!(
            "{{\"suite\":\"ranged\",\"value_bytes\":{VALUE},\"ranges\":{RANGES},\"rounds\":{},\"batch_bytes\":{},\
             \"rows\":[{}]}}",
            self.rounds,
            self.batch_bytes,
            rows.join(",")
        )
    }
}

impl fmt::Display for RangedReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Ranged against whole-value batch gets: {} values read as {RANGES} ranges into {RANGES} buffers, \
             batches of {}, medians of {} rounds",
            human_size(VALUE as u64),
            human_size(self.batch_bytes),
            self.rounds
        )?;
        writeln!(f)?;
        writeln!(f, "| path | ranged GB/s | whole GB/s | ranged/whole |")?;
        writeln!(f, "|---|---|---|---|")?;
        for r in &self.rows {
            writeln!(f, "| {} | {:.2} | {:.2} | {:.2} |", r.path, r.ranged_gbps, r.whole_gbps, r.ratio())?;
        }
        Ok(())
    }
}

/// Runs the bench (see the module docs).
///
/// # Errors
/// Bad options, a master, child or node that does not start, or a put or get that fails or returns
/// other bytes than were put.
pub async fn run(options: RangedOptions) -> Result<RangedReport, BenchError> {
    options.validate()?;
    let master = bench_master(Affinity::None).await?;
    let result = measure(&options, &master.local_addr().to_string()).await;
    master.shutdown().await;
    result
}

async fn measure(options: &RangedOptions, master: &str) -> Result<RangedReport, BenchError> {
    let program = match &options.child_program {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| BenchError::Child(format!("finding this executable: {e}")))?,
    };
    let (child, _raw) = start_child(&program, master, options.child_capacity()).await?;
    let mut tcp_config = node_config("ranged-tcp", master, Medium::None);
    tcp_config.shared_memory = false;
    let tcp = start_node(tcp_config).await?;
    let shm = match start_node(node_config("ranged-shm", master, Medium::None)).await {
        Ok(shm) => shm,
        Err(e) => {
            tcp.close().await;
            return Err(e);
        }
    };
    let result = measure_rows(&[("remote (TCP)", &tcp), ("same host (shm)", &shm)], options).await;
    tcp.close().await;
    shm.close().await;
    drop(child);
    Ok(RangedReport { rounds: options.rounds, batch_bytes: options.batch_bytes, rows: result? })
}

async fn measure_rows(
    paths: &[(&'static str, &PoolClient)],
    options: &RangedOptions,
) -> Result<Vec<RangedRow>, BenchError> {
    let n = options.batch_bytes as usize / VALUE;
    let bytes = n * VALUE;
    let part = VALUE / RANGES;
    let mut data: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; VALUE]).collect();
    let mut whole_out: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; VALUE]).collect();
    // Each value's 8 ranges land in 8 buffers of their own; joined, they must be the value.
    let mut parts_out: Vec<Vec<u8>> = (0..n * RANGES).map(|_| vec![0u8; part]).collect();
    let mut samples: Vec<(Vec<f64>, Vec<f64>)> = paths.iter().map(|_| (Vec::new(), Vec::new())).collect();
    let mut progress = Progress::new("umbp bench ranged: rounds".to_owned(), options.rounds);
    for round in 0..options.rounds {
        for (p, (path, client)) in paths.iter().enumerate() {
            let keys: Vec<String> = (0..n).map(|i| format!("ranged-{p}-{round}-{i}")).collect();
            stamp_values(&mut data, (u64::from(p as u32) << 40) | round as u64);
            let items: Vec<(&str, &[u8])> = keys.iter().zip(&data).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
            fail(&format!("{path} put"), &client.batch_put(&items).await)?;
            until_indexed(client, &keys).await?;
            let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let whole_first = round % 2 == 0;
            for turn in 0..2 {
                if (turn == 0) == whole_first {
                    poison(&mut whole_out);
                    let mut slices: Vec<&mut [u8]> = whole_out.iter_mut().map(Vec::as_mut_slice).collect();
                    let t = Instant::now();
                    let r = client.batch_get(&key_refs, &mut slices).await;
                    samples[p].1.push(gbps(bytes, t));
                    fail(&format!("{path} whole get"), &r)?;
                } else {
                    poison(&mut parts_out);
                    let mut lists: Vec<Vec<(&mut [u8], u64)>> = parts_out
                        .chunks_mut(RANGES)
                        .map(|bufs| {
                            bufs.iter_mut().enumerate().map(|(j, b)| (b.as_mut_slice(), (j * part) as u64)).collect()
                        })
                        .collect();
                    let t = Instant::now();
                    let r = client.batch_get_ranges(&key_refs, &mut lists).await;
                    samples[p].0.push(gbps(bytes, t));
                    fail(&format!("{path} ranged get"), &r)?;
                }
            }
            verify(path, &whole_out, &data)?;
            let joined: Vec<Vec<u8>> = parts_out.chunks(RANGES).map(<[Vec<u8>]>::concat).collect();
            verify(path, &joined, &data)?;
            // The read leases lapse, then the keys go (the child lends room for one round).
            tokio::time::sleep(Duration::from_millis(600)).await;
            let _ = client.remove(&key_refs).await;
        }
        progress.advance(1);
    }
    progress.finish();
    Ok(paths
        .iter()
        .zip(samples)
        .map(|((path, _), (ranged, whole))| RangedRow { path, ranged_gbps: median(ranged), whole_gbps: median(whole) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_refuse_what_cannot_run_and_the_ratio_is_ranged_over_whole() {
        let ok = RangedOptions { rounds: 1, batch_bytes: 1 << 20, child_program: None };
        assert!(ok.validate().is_ok());
        assert!(RangedOptions { rounds: 0, ..ok.clone() }.validate().is_err());
        assert!(RangedOptions { batch_bytes: 1000, ..ok }.validate().is_err());
        let r = RangedRow { path: "remote (TCP)", ranged_gbps: 1.8, whole_gbps: 2.0 };
        assert!((r.ratio() - 0.9).abs() < 1e-9);
        let report = RangedReport { rounds: 1, batch_bytes: 1 << 20, rows: vec![r] };
        assert!(report.to_string().contains("| remote (TCP) | 1.80 | 2.00 | 0.90 |"), "{report}");
        assert!(report.to_json().contains("\"ratio\":0.9000"), "{}", report.to_json());
    }
}
