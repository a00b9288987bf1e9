//! The SSD node bench in the bench suite (`cargo xtask bench`, `cargo bench -p umbp --bench
//! ssd_node`): the same measurements as `umbp bench ssd` — batch put and get of 1 MiB and 2 MiB
//! values through an SSD node's `PoolClient`, psync and io_uring, each beside raw `O_DIRECT`
//! sequential writes and reads of the same bytes on the same directory. `UMBP_BENCH_ROUNDS`
//! (default 5), `UMBP_BENCH_MIB` (bytes per batch, default 256) and `UMBP_BENCH_DIR` (default: the
//! target directory's tmp, on the disk the workspace is on; never the system temp dir, which may be
//! tmpfs) tune it.

fn main() {
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let dir = env("UMBP_BENCH_DIR").map_or_else(|| std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")), Into::into);
    let mut options = umbp::bench_ssd::SsdBenchOptions::new(dir);
    if let Some(rounds) = env("UMBP_BENCH_ROUNDS").and_then(|v| v.parse().ok()) {
        options.rounds = rounds;
    }
    if let Some(mib) = env("UMBP_BENCH_MIB").and_then(|v| v.parse::<u64>().ok()) {
        options.batch_bytes = mib << 20;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    match runtime.block_on(umbp::bench_ssd::run(options)) {
        Ok(report) => println!("{report}"),
        Err(e) => {
            eprintln!("ssd node bench: {e}");
            std::process::exit(1);
        }
    }
}
