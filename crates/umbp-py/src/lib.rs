//! The native module of the `umbp` Python package (`umbp._umbp`).
//!
//! ```python
//! import umbp
//!
//! with umbp.Client.local(capacity_bytes=1 << 30) as pool:   # an embedded pool, nothing to start
//!     pool.put("k1", b"hello")
//!     assert pool.get("k1") == b"hello"
//!     assert pool.get("missing") is None
//! ```
//!
//! (Python, not a doctest: `python/tests/test_client.py` makes the same calls.)
//!
//! One class, `Pool` (`src/pool.rs`): a node of a umbp pool living in this Python process, either with
//! an embedded master (the *local* deployment, `Pool.local`) or joined to a
//! running master (the *distributed* deployment, `Pool.node`). Its methods take
//! keys, raw addresses (Python ints) or objects exporting the buffer protocol, and release the GIL
//! for every call that waits on I/O: the work runs on a tokio runtime this module owns.
//!
//! The Pythonic `umbp.Client` and the `mori.umbp` compatibility surface are pure Python over this
//! class (`python/umbp/`); per-key failures come back as `(kind, message)` pairs that the Python
//! side turns into the exceptions defined here.
//!
//! `cli_main` runs the `umbp` command line (crate `umbp`, feature `cli`) inside the interpreter, for
//! `python -m umbp`: one install gives an operator the pool's client and its command line.
//!
//! Built by maturin from `python/pyproject.toml`; `cargo check` builds it like any crate.

mod buffer;
mod errors;
mod master_client;
mod medium;
mod memcheck;
mod pool;

use std::sync::OnceLock;

use pyo3::prelude::*;

/// The runtime every call of this module runs on. Built on first use, never dropped (it lives as
/// long as the interpreter has the module loaded).
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    // Transfers block in place, so the runtime must be multi-threaded; a few threads are enough
    // for one process's node (the copies run on tokio's blocking pool).
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("umbp-py")
        .enable_all()
        .build()
        .map_err(|e| errors::InternalError::new_err(format!("starting the async runtime: {e}")))?;
    Ok(RUNTIME.get_or_init(|| rt))
}

/// Runs the `umbp` command line (the `umbp` binary's, linked in) with `argv` (the program name
/// first) and returns its exit status; the GIL is released while it runs. `python -m umbp` calls
/// it. Each call has its own runtime; `master`, `node` and the client commands install SIGINT and
/// SIGTERM handlers that stay installed (they chain to Python's own).
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> u8 {
    let args = argv.into_iter().map(std::ffi::OsString::from).collect();
    py.detach(move || umbp::cli_main(args))
}

/// The module: the `Pool` class, the command line, the exception hierarchy and the error-kind codes.
#[pymodule]
fn _umbp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::Pool>()?;
    m.add_class::<master_client::PyMasterClient>()?;
    m.add_class::<master_client::NodeMatch>()?;
    m.add_class::<master_client::HitCountEntry>()?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
