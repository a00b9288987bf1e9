//! The exception hierarchy and how a per-key [`KeyError`] becomes a `(kind, message)` pair.
//!
//! Kinds follow [`umbp_core::ErrorKind`] (what the caller does next), plus `NOT_FOUND` for a miss.
//! Batch calls return the pairs instead of raising, so one bad key never hides the others' results;
//! `umbp.Client` raises the matching exception where a single answer is asked for.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
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

/// The exception of a node that could not start, stop, clear or register, with the error's whole
/// source chain in the message (a bind error names the port only in its source).
pub(crate) fn pool_error(context: &str, e: &PoolError) -> PyErr {
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
    exception(pool_kind(e), message)
}
