//! `umbp bench checksum`: what the end-to-end checksum costs (issue 19, item 4: at most 10 % on
//! 1 MiB batch gets).
//!
//! A master in this process and a DRAM node in a child process (`umbp bench-child`, as the pool
//! suite's remote rows), and four client-only nodes here: over TCP (`shared_memory = false`) and
//! through shared memory, each with `checksums` on and off. Every round, per path and value size,
//! both clients of the path put a batch of their own keys (the on-client computes each value's
//! CRC-32C, the off-client none), then both read **the on-client's keys** — the same bytes from the
//! same pages, which carry their checksum: the on-client checks every copy against it, the
//! off-client does not. Which of the two goes first alternates by round, every read is compared
//! byte for byte, and each cell is the median of the rounds. The ratio on/off is the cost (1.0: none).

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

/// The value sizes measured.
pub const VALUE_SIZES: [usize; 2] = [64 << 10, 1 << 20];

/// What the checksum bench runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChecksumOptions {
    /// Rounds per cell; the medians are reported. Default: 5.
    pub rounds: usize,
    /// Bytes per batch (at least 1 MiB). Default: 64 MiB.
    pub batch_bytes: u64,
    /// The program run as the child node. Default: this executable.
    pub child_program: Option<PathBuf>,
}

impl ChecksumOptions {
    /// The options of `umbp bench checksum` (`--rounds`, `--batch-bytes`).
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
        if self.batch_bytes < (1 << 20) {
            return Err(BenchError::Options(format!(
                "--batch-bytes must be at least 1MiB (one value of each size), got {}",
                human_size(self.batch_bytes)
            )));
        }
        Ok(())
    }

    /// DRAM the child lends: one round's two batches of one path (removed after it), with room
    /// below the master's eviction watermark.
    fn child_capacity(&self) -> u64 {
        let stored = 2 * self.batch_bytes;
        (stored + stored / 2 + (64 << 20)).div_ceil(64 << 10) * (64 << 10)
    }
}

/// One cell: the same operation with checksums on and off.
#[derive(Debug, Clone, PartialEq)]
pub struct ChecksumRow {
    /// `remote (TCP)` or `same host (shm)`.
    pub path: &'static str,
    /// `put` or `get`.
    pub op: &'static str,
    /// Bytes per value.
    pub value_bytes: u64,
    /// Median GB/s with checksums on.
    pub on_gbps: f64,
    /// Median GB/s with checksums off.
    pub off_gbps: f64,
}

impl ChecksumRow {
    /// On over off: 1.0 is free, 0.9 a 10 % cost.
    pub fn ratio(&self) -> f64 {
        self.on_gbps / self.off_gbps
    }
}

/// The bench's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct ChecksumReport {
    /// Rounds per cell.
    pub rounds: usize,
    /// Bytes per batch.
    pub batch_bytes: u64,
    /// One row per path, operation and value size.
    pub rows: Vec<ChecksumRow>,
}

impl ChecksumReport {
    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let rows: Vec<String> = self
            .rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"path\":\"{}\",\"op\":\"{}\",\"value_bytes\":{},\"checksums_on_gbps\":{:.4},\
                     \"checksums_off_gbps\":{:.4},\"ratio\":{:.4}}}",
                    r.path,
                    r.op,
                    r.value_bytes,
                    r.on_gbps,
                    r.off_gbps,
                    r.ratio()
                )
            })
            .collect();
        format!(
            "{{\"suite\":\"checksum\",\"rounds\":{},\"batch_bytes\":{},\"rows\":[{}]}}",
            self.rounds,
            self.batch_bytes,
            rows.join(",")
        )
    }
}

impl fmt::Display for ChecksumReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "End-to-end checksums on against off: batches of {}, medians of {} rounds (a get on reads the \
             same keys as a get off, and checks each copy)",
            human_size(self.batch_bytes),
            self.rounds
        )?;
        writeln!(f)?;
        writeln!(f, "| path | op | value | checksums on GB/s | off GB/s | on/off |")?;
        writeln!(f, "|---|---|---|---|---|---|")?;
        for r in &self.rows {
            writeln!(
                f,
                "| {} | {} | {} | {:.2} | {:.2} | {:.2} |",
                r.path,
                r.op,
                human_size(r.value_bytes),
                r.on_gbps,
                r.off_gbps,
                r.ratio()
            )?;
        }
        Ok(())
    }
}

/// Runs the bench (see the module docs).
///
/// # Errors
/// Bad options, a master, child or node that does not start, or a put or get that fails or returns
/// other bytes than were put.
pub async fn run(options: ChecksumOptions) -> Result<ChecksumReport, BenchError> {
    options.validate()?;
    let master = bench_master(Affinity::None).await?;
    let result = measure(&options, &master.local_addr().to_string()).await;
    master.shutdown().await;
    result
}

/// A client-only node here, with the two path and checksum settings.
async fn client(master: &str, id: &str, shared_memory: bool, checksums: bool) -> Result<PoolClient, BenchError> {
    let mut c = node_config(id, master, Medium::None);
    c.shared_memory = shared_memory;
    c.checksums = checksums;
    start_node(c).await
}

async fn measure(options: &ChecksumOptions, master: &str) -> Result<ChecksumReport, BenchError> {
    let program = match &options.child_program {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(|e| BenchError::Child(format!("finding this executable: {e}")))?,
    };
    let (child, _raw) = start_child(&program, master, options.child_capacity()).await?;
    let mut clients = Vec::new();
    for (id, shm, on) in
        [("tcp-on", false, true), ("tcp-off", false, false), ("shm-on", true, true), ("shm-off", true, false)]
    {
        match client(master, id, shm, on).await {
            Ok(c) => clients.push(c),
            Err(e) => {
                for c in &clients {
                    c.close().await;
                }
                return Err(e);
            }
        }
    }
    let result = match clients.as_slice() {
        [tcp_on, tcp_off, shm_on, shm_off] => {
            let paths = [("remote (TCP)", tcp_on, tcp_off), ("same host (shm)", shm_on, shm_off)];
            measure_rows(&paths, options.rounds, options.batch_bytes as usize).await
        }
        _ => Err(BenchError::Failed("four clients".into())),
    };
    for c in &clients {
        c.close().await;
    }
    drop(child);
    Ok(ChecksumReport { rounds: options.rounds, batch_bytes: options.batch_bytes, rows: result? })
}

/// (put on, put off, get on, get off) GB/s samples of one cell.
#[derive(Default)]
struct Cell([Vec<f64>; 4]);

async fn measure_rows(
    paths: &[(&'static str, &PoolClient, &PoolClient)],
    rounds: usize,
    batch: usize,
) -> Result<Vec<ChecksumRow>, BenchError> {
    let mut rows = Vec::new();
    for value in VALUE_SIZES {
        let n = batch / value;
        let bytes = n * value;
        let mut data: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let mut out_on: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let mut out_off: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value]).collect();
        let mut cells: Vec<Cell> = paths.iter().map(|_| Cell::default()).collect();
        let mut progress =
            Progress::new(format!("umbp bench checksum: {} values, rounds", human_size(value as u64)), rounds);
        for round in 0..rounds {
            for (p, (path, on, off)) in paths.iter().enumerate() {
                let keys = |who: &str| -> Vec<String> {
                    (0..n).map(|i| format!("checksum-{p}-{who}-{value}-{round}-{i}")).collect()
                };
                let (keys_on, keys_off) = (keys("on"), keys("off"));
                stamp_values(&mut data, (u64::from(p as u32) << 40) | (value as u64) << 8 | round as u64);
                // Alternate who goes first, so a drift in the machine's load reaches both alike.
                let on_first = round % 2 == 0;
                let (put_on, put_off) = if on_first {
                    let a = put_timed(on, &keys_on, &data, bytes, path).await?;
                    (a, put_timed(off, &keys_off, &data, bytes, path).await?)
                } else {
                    let b = put_timed(off, &keys_off, &data, bytes, path).await?;
                    (put_timed(on, &keys_on, &data, bytes, path).await?, b)
                };
                until_indexed(on, &keys_on).await?;
                until_indexed(on, &keys_off).await?;
                // Both read the on-client's keys (each carries its checksum): only the check differs.
                let (get_on, get_off) = if on_first {
                    let a = get_timed(on, &keys_on, &mut out_on, bytes, path).await?;
                    (a, get_timed(off, &keys_on, &mut out_off, bytes, path).await?)
                } else {
                    let b = get_timed(off, &keys_on, &mut out_off, bytes, path).await?;
                    (get_timed(on, &keys_on, &mut out_on, bytes, path).await?, b)
                };
                verify(path, &out_on, &data)?;
                verify(path, &out_off, &data)?;
                for (samples, x) in cells[p].0.iter_mut().zip([put_on, put_off, get_on, get_off]) {
                    samples.push(x);
                }
                // The read leases lapse, then the keys go (the child lends room for one round).
                tokio::time::sleep(Duration::from_millis(600)).await;
                for keys in [&keys_on, &keys_off] {
                    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                    let _ = on.remove(&refs).await;
                }
            }
            progress.advance(1);
        }
        progress.finish();
        for ((path, _, _), Cell([put_on, put_off, get_on, get_off])) in paths.iter().zip(cells) {
            for (op, on, off) in [("put", put_on, put_off), ("get", get_on, get_off)] {
                rows.push(ChecksumRow {
                    path,
                    op,
                    value_bytes: value as u64,
                    on_gbps: median(on),
                    off_gbps: median(off),
                });
            }
        }
    }
    Ok(rows)
}

async fn put_timed(
    client: &PoolClient,
    keys: &[String],
    data: &[Vec<u8>],
    bytes: usize,
    what: &str,
) -> Result<f64, BenchError> {
    let items: Vec<(&str, &[u8])> = keys.iter().zip(data).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    let t = Instant::now();
    let results = client.batch_put(&items).await;
    let rate = gbps(bytes, t);
    fail(&format!("{what} put"), &results)?;
    Ok(rate)
}

async fn get_timed(
    client: &PoolClient,
    keys: &[String],
    out: &mut [Vec<u8>],
    bytes: usize,
    what: &str,
) -> Result<f64, BenchError> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    poison(out);
    let mut slices: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
    let t = Instant::now();
    let results = client.batch_get(&refs, &mut slices).await;
    let rate = gbps(bytes, t);
    fail(&format!("{what} get"), &results)?;
    Ok(rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_refuse_what_cannot_run() {
        let ok = ChecksumOptions { rounds: 1, batch_bytes: 1 << 20, child_program: None };
        assert!(ok.validate().is_ok());
        assert!(ChecksumOptions { rounds: 0, ..ok.clone() }.validate().is_err());
        let err = ChecksumOptions { batch_bytes: 1000, ..ok }.validate().expect_err("too small");
        assert!(err.to_string().contains("--batch-bytes"), "{err}");
    }

    #[test]
    fn the_ratio_is_on_over_off() {
        let r = ChecksumRow { path: "remote (TCP)", op: "get", value_bytes: 1 << 20, on_gbps: 1.8, off_gbps: 2.0 };
        assert!((r.ratio() - 0.9).abs() < 1e-9);
        let report = ChecksumReport { rounds: 1, batch_bytes: 1 << 20, rows: vec![r] };
        assert!(report.to_string().contains("| remote (TCP) | get | 1 MiB | 1.80 | 2.00 | 0.90 |"), "{report}");
        assert!(report.to_json().contains("\"ratio\":0.9000"), "{}", report.to_json());
    }
}
