//! The pool bench in the bench suite (`cargo xtask bench`, `cargo bench -p umbp --bench pool`): the
//! same measurements as `umbp bench` — batch put and get of 64 KiB and 1 MiB values locally against
//! memcpy and between two processes against a raw TCP stream, and single 64 KiB get latency — each
//! beside its same-run baseline. `UMBP_BENCH_ROUNDS` (default 5) sets the rounds per cell.

fn main() {
    let rounds = std::env::var("UMBP_BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(5);
    let options = umbp::bench::BenchOptions {
        rounds,
        // The child node is the `umbp` binary cargo built beside this bench.
        child_program: Some(env!("CARGO_BIN_EXE_umbp").into()),
        ..umbp::bench::BenchOptions::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    match runtime.block_on(umbp::bench::run(options)) {
        Ok(report) => print!("{report}"),
        Err(e) => {
            eprintln!("pool bench: {e}");
            std::process::exit(1);
        }
    }
}
