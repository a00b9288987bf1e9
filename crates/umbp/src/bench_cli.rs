//! `umbp get` as a process, end to end (issue 16, deliverable 3): the wall time of spawning the
//! `umbp` binary to get one 64 KiB value from the bench's remote node, stdout to `/dev/null`,
//! beside the same binary's `umbp --version` in the same run (what starting a process costs here,
//! before any pool work). Runs alternate, so both see the same load.

use std::fmt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::bench::BenchError;
use crate::units::human_size;

/// Spawns of each command timed.
pub const CLI_RUNS: usize = 30;

/// Wall-time percentiles of a command run as a process, milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessTimes {
    /// Runs timed.
    pub runs: usize,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile (of 30 runs: the slowest).
    pub p99_ms: f64,
}

impl ProcessTimes {
    fn of(mut ms: Vec<f64>) -> Self {
        ms.sort_by(f64::total_cmp);
        let runs = ms.len();
        Self { runs, p50_ms: ms[runs / 2], p99_ms: ms[(runs * 99 / 100).min(runs - 1)] }
    }

    fn to_json(&self) -> String {
        format!("{{\"runs\":{},\"p50_ms\":{:.2},\"p99_ms\":{:.2}}}", self.runs, self.p50_ms, self.p99_ms)
    }
}

/// `umbp get KEY` as a process beside `umbp --version`.
#[derive(Debug, Clone, PartialEq)]
pub struct CliGet {
    /// Bytes of the value got.
    pub value_bytes: u64,
    /// `umbp get KEY --master ADDR > /dev/null`.
    pub get: ProcessTimes,
    /// `umbp --version > /dev/null`: the cost of starting the process.
    pub version: ProcessTimes,
}

impl CliGet {
    /// The measurement as one JSON object.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"value_bytes\":{},\"get\":{},\"version\":{}}}",
            self.value_bytes,
            self.get.to_json(),
            self.version.to_json()
        )
    }
}

impl fmt::Display for CliGet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`umbp get` of a {} value as a process, {} runs: p50 {:.1} ms, p99 {:.1} ms \
             (`umbp --version`: p50 {:.1} ms, p99 {:.1} ms)",
            human_size(self.value_bytes),
            self.get.runs,
            self.get.p50_ms,
            self.get.p99_ms,
            self.version.p50_ms,
            self.version.p99_ms
        )
    }
}

/// Times `program get KEY --master MASTER` and `program --version`, [`CLI_RUNS`] each, alternating;
/// `key` holds `value_bytes` bytes. Every run must exit 0.
///
/// # Errors
/// A run could not be spawned or failed.
pub async fn measure(program: &Path, master: &str, key: &str, value_bytes: u64) -> Result<CliGet, BenchError> {
    crate::progress::note(format_args!("umbp bench: {CLI_RUNS} `umbp get` processes beside `umbp --version`"));
    let (program, master, key) = (program.to_owned(), master.to_owned(), key.to_owned());
    tokio::task::spawn_blocking(move || {
        let max = value_bytes.to_string();
        let get_args = ["get", key.as_str(), "--master", master.as_str(), "--max-size", max.as_str()];
        // One of each first, untimed: the binary's pages are in the page cache for every timed run.
        run(&program, &["--version"])?;
        run(&program, &get_args)?;
        let (mut get, mut version) = (Vec::with_capacity(CLI_RUNS), Vec::with_capacity(CLI_RUNS));
        for _ in 0..CLI_RUNS {
            version.push(run(&program, &["--version"])?);
            get.push(run(&program, &get_args)?);
        }
        Ok(CliGet { value_bytes, get: ProcessTimes::of(get), version: ProcessTimes::of(version) })
    })
    .await
    .map_err(|e| BenchError::Failed(format!("the `umbp get` runs panicked: {e}")))?
}

/// Runs `program args` to completion, output discarded; its wall time in milliseconds.
fn run(program: &Path, args: &[&str]) -> Result<f64, BenchError> {
    let started = Instant::now();
    let status = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| BenchError::Failed(format!("spawning {} {}: {e}", program.display(), args.join(" "))))?;
    let ms = started.elapsed().as_secs_f64() * 1e3;
    if !status.success() {
        return Err(BenchError::Failed(format!("{} {}: {status}", program.display(), args.join(" "))));
    }
    Ok(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_thirty_runs_are_the_median_and_the_slowest() {
        let t = ProcessTimes::of((1..=30).rev().map(f64::from).collect());
        assert_eq!((t.runs, t.p50_ms, t.p99_ms), (30, 16.0, 30.0));
        let one = ProcessTimes::of(vec![4.0]);
        assert_eq!((one.p50_ms, one.p99_ms), (4.0, 4.0));
        assert_eq!(t.to_json(), "{\"runs\":30,\"p50_ms\":16.00,\"p99_ms\":30.00}");
    }
}
