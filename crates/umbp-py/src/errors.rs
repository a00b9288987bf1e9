//! The exception hierarchy and how a per-key [`KeyError`] becomes a `(kind, message)` pair.
//!
//! Kinds follow [`umbp_core::ErrorKind`] (what the caller does next), plus `NOT_FOUND` for a miss.
//! Batch calls return the pairs instead of raising, so one bad key never hides the others' results;
//! `umbp.Client` raises the matching exception where a single answer is asked for.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use umbp_core::ErrorKind;
use umbp_peer::pool_client::{KeyError, PoolError};

create_exception!(_umbp, Error, PyException, "Base class of every error the umbp pool raises.");
create_exception!(
    _umbp,
    InvalidInputError,
    Error,
    "The request can never succeed as given (empty key or value, a buffer too small, a value larger \
     than the pool, a bad address): fix it, do not retry it."
);
create_exception!(
    _umbp,
    RetryError,
    Error,
    "A transient condition (no room now, a node busy, a lease lapsed): the same call may succeed later."
);
create_exception!(_umbp, UnavailableError, Error, "The master or a peer cannot be reached: retry after it is back.");
create_exception!(_umbp, ClosedError, Error, "The client was closed: open a new one.");
create_exception!(_umbp, InternalError, Error, "A bug or a broken invariant: report it.");
create_exception!(_umbp, NotFoundError, Error, "The key is not in the pool.");

/// What `ConfigError` says of itself.
const CONFIG_ERROR_DOC: &str = "A node's settings are invalid (an unknown medium, a required setting missing, a setting of \
     the wrong type or of another medium): an InvalidInputError and a ValueError.";

/// `ConfigError(InvalidInputError, ValueError)`: made at run time because an exception class with
/// two bases cannot be declared with `create_exception!`.
fn config_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    TYPE.get_or_try_init(py, || {
        let bases = PyTuple::new(py, [py.get_type::<InvalidInputError>(), py.get_type::<PyValueError>()])?;
        let attrs = PyDict::new(py);
        attrs.set_item("__doc__", CONFIG_ERROR_DOC)?;
        attrs.set_item("__module__", "umbp._umbp")?;
        let ty = py.get_type::<PyType>().call1(("ConfigError", bases, attrs))?;
        Ok(ty.cast_into::<PyType>()?.unbind())
    })
    .map(|t| t.bind(py))
}

/// A `ConfigError` carrying `message` (the error of making the class, should that fail).
pub(crate) fn config_error(py: Python<'_>, message: impl Into<String>) -> PyErr {
    match config_error_type(py) {
        Ok(ty) => PyErr::from_type(ty.clone(), message.into()),
        Err(e) => e,
    }
}

/// Kind code of [`ErrorKind::InvalidInput`].
pub(crate) const INVALID_INPUT: u8 = 0;
/// Kind code of [`ErrorKind::Retry`].
pub(crate) const RETRY: u8 = 1;
/// Kind code of [`ErrorKind::Unavailable`].
pub(crate) const UNAVAILABLE: u8 = 2;
/// Kind code of [`ErrorKind::Closed`].
pub(crate) const CLOSED: u8 = 3;
/// Kind code of [`ErrorKind::Internal`].
pub(crate) const INTERNAL: u8 = 4;
/// Kind code of a miss.
pub(crate) const NOT_FOUND: u8 = 5;

/// Adds the exceptions and the kind codes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("InvalidInputError", py.get_type::<InvalidInputError>())?;
    m.add("RetryError", py.get_type::<RetryError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("ConfigError", config_error_type(py)?)?;
    m.add("KIND_INVALID_INPUT", INVALID_INPUT)?;
    m.add("KIND_RETRY", RETRY)?;
    m.add("KIND_UNAVAILABLE", UNAVAILABLE)?;
    m.add("KIND_CLOSED", CLOSED)?;
    m.add("KIND_INTERNAL", INTERNAL)?;
    m.add("KIND_NOT_FOUND", NOT_FOUND)?;
    Ok(())
}

/// The kind code of a per-key error.
pub(crate) fn key_kind(e: &KeyError) -> u8 {
    match e {
        KeyError::Miss => NOT_FOUND,
        KeyError::EmptyKey
        | KeyError::EmptyValue
        | KeyError::TooLarge { .. }
        | KeyError::BufferTooSmall { .. }
        | KeyError::NoBuffer
        | KeyError::Refused { .. } => INVALID_INPUT,
        KeyError::NoSpace { .. }
        | KeyError::Busy { .. }
        | KeyError::LeaseExpired { .. }
        | KeyError::SlotExpired { .. } => RETRY,
        KeyError::Unreachable { .. } | KeyError::Transfer { .. } | KeyError::Routing(_) => UNAVAILABLE,
        KeyError::Closed => CLOSED,
        _ => INTERNAL,
    }
}

/// The code of an [`ErrorKind`].
pub(crate) fn kind_code(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::InvalidInput => INVALID_INPUT,
        ErrorKind::Retry => RETRY,
        ErrorKind::Unavailable => UNAVAILABLE,
        ErrorKind::Closed => CLOSED,
        _ => INTERNAL,
    }
}

/// The exception of a kind code, carrying `message`.
pub(crate) fn exception(kind: u8, message: String) -> PyErr {
    match kind {
        INVALID_INPUT => InvalidInputError::new_err(message),
        RETRY => RetryError::new_err(message),
        UNAVAILABLE => UnavailableError::new_err(message),
        CLOSED => ClosedError::new_err(message),
        NOT_FOUND => NotFoundError::new_err(message),
        _ => InternalError::new_err(message),
    }
}

/// The exception of a per-key error.
pub(crate) fn key_error(e: &KeyError) -> PyErr {
    exception(key_kind(e), e.to_string())
}

/// The kind code of a node's error: bad settings and bind failures are the caller's to fix, a
/// master that cannot be reached is unavailable.
pub(crate) fn pool_kind(e: &PoolError) -> u8 {
    match e {
        PoolError::Config(_) => INVALID_INPUT,
        PoolError::Medium(m) => kind_code(m.kind()),
        PoolError::Registry(r) => kind_code(r.kind()),
        PoolError::Closed => CLOSED,
        PoolError::Master(_) => UNAVAILABLE,
        e if e.is_bind_failure() => INVALID_INPUT,
        _ => INTERNAL,
    }
}

/// The message of a node's error: `context`, the error, and its whole source chain (a bind error
/// names the port only in its source).
pub(crate) fn pool_message(context: &str, e: &PoolError) -> String {
    let mut message = format!("{context}: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let text = s.to_string();
        // Many errors already print their source; say each cause once.
        if !message.contains(&text) {
            message.push_str(&format!(": {text}"));
        }
        source = s.source();
    }
    message
}

/// The exception of a node that could not start, stop, clear or register, with the error's whole
/// source chain in the message.
pub(crate) fn pool_error(context: &str, e: &PoolError) -> PyErr {
    exception(pool_kind(e), pool_message(context, e))
}

/// The exception of a node that could not start: what the caller must fix (bad settings, a medium
/// that refused them, a port in use) is a `ConfigError`, the rest as [`pool_error`].
pub(crate) fn start_error(py: Python<'_>, kind: u8, message: String) -> PyErr {
    if kind == INVALID_INPUT { config_error(py, message) } else { exception(kind, message) }
}
