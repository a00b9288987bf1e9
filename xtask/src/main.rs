//! `cargo xtask`: see the library docs (`xtask/src/lib.rs`) for the tasks.
#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    match xtask::run(std::env::args().skip(1).collect()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
