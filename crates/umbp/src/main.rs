//! `umbp`: the umbp-rs command line. See `umbp --help`; the commands, the settings and the demo live
//! in the library half of this crate (`umbp::cli_main`), which the Python package runs too.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(umbp::cli_main(std::env::args_os().collect()))
}
