//! Connections to Redis: a small pool of synchronous connections with connect and I/O timeouts, and
//! the mapping of the client's errors onto [`StoreError`].

use std::time::Duration;

use parking_lot::Mutex;
use redis::{Client, Connection, ConnectionLike, RedisError};

use super::scripts;
use crate::store::StoreError;

/// Idle connections kept for reuse; more are opened under load and closed when returned.
const MAX_IDLE: usize = 16;

/// How long to wait for Redis: to connect, and for each reply.
///
/// The defaults (1 s, 2 s) keep a master's answer inside its clients' RPC deadline (3 s) while Redis
/// hangs (stopped, or busy in another master's long script): the client gets a retryable
/// `UNAVAILABLE` in time to try another master instead of a deadline of its own. A command that
/// timed out may still run in Redis; every master call is safe to repeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisTimeouts {
    /// TCP connect (and handshake) timeout.
    pub connect: Duration,
    /// Read and write timeout of every command (a script that wipes a large node runs within it).
    pub io: Duration,
}

impl Default for RedisTimeouts {
    fn default() -> Self {
        Self { connect: Duration::from_secs(1), io: Duration::from_secs(2) }
    }
}

/// A pool of connections to one Redis.
pub(super) struct Pool {
    client: Client,
    url: String,
    timeouts: RedisTimeouts,
    idle: Mutex<Vec<Connection>>,
}

impl Pool {
    /// A pool for `url` (`redis://HOST:PORT[/DB]`); connects nothing yet.
    pub(super) fn new(url: &str, timeouts: RedisTimeouts) -> Result<Self, StoreError> {
        let client = Client::open(url).map_err(|err| StoreError::Backend {
            message: format!("invalid Redis URL {url:?}: {err}"),
            retryable: false,
            source: Some(Box::new(err)),
        })?;
        Ok(Self { client, url: url.to_owned(), timeouts, idle: Mutex::new(Vec::new()) })
    }

    /// The URL the pool connects to.
    pub(super) fn url(&self) -> &str {
        &self.url
    }

    /// A new connection with the timeouts set and every script loaded (`SCRIPT LOAD`).
    fn connect(&self) -> Result<Connection, StoreError> {
        let mut con = self.client.get_connection_with_timeout(self.timeouts.connect).map_err(|e| self.error(e))?;
        con.set_read_timeout(Some(self.timeouts.io)).map_err(|e| self.error(e))?;
        con.set_write_timeout(Some(self.timeouts.io)).map_err(|e| self.error(e))?;
        for script in scripts::all() {
            script.load(&mut con).map_err(|e| self.error(e))?;
        }
        Ok(con)
    }

    /// Runs `f` on a pooled connection. A connection whose call failed on I/O is dropped, not reused,
    /// and so is every idle one (after a Redis restart they are all dead). A call that failed on a
    /// pooled connection because the connection was gone (closed, reset: not a timeout, after which
    /// the command may have run) is made once more on a new connection, so a restarted Redis costs
    /// no caller an error.
    ///
    /// The call blocks on Redis; see [`blocking_io`] for callers on an async runtime.
    pub(super) fn with<T>(&self, f: impl FnMut(&mut Connection) -> redis::RedisResult<T>) -> Result<T, StoreError> {
        blocking_io(|| self.with_blocking(f))
    }

    fn with_blocking<T>(&self, mut f: impl FnMut(&mut Connection) -> redis::RedisResult<T>) -> Result<T, StoreError> {
        let pooled = self.idle.lock().pop();
        let was_pooled = pooled.is_some();
        let mut con = match pooled {
            Some(con) => con,
            None => self.connect()?,
        };
        match f(&mut con) {
            Ok(value) => {
                self.put_back(con);
                Ok(value)
            }
            Err(err) if is_transient(&err) => {
                self.idle.lock().clear();
                if was_pooled && is_gone(&err) {
                    let mut fresh = self.connect()?;
                    let value = f(&mut fresh).map_err(|e| self.error(e))?;
                    self.put_back(fresh);
                    return Ok(value);
                }
                Err(self.error(err))
            }
            Err(err) => {
                if con.is_open() {
                    self.put_back(con);
                }
                Err(self.error(err))
            }
        }
    }

    fn put_back(&self, con: Connection) {
        let mut idle = self.idle.lock();
        if idle.len() < MAX_IDLE {
            idle.push(con);
        }
    }

    /// The store error for a client error: retryable when Redis could not be reached or answered
    /// that it is busy (loading, a failover), not when it refused the command.
    fn error(&self, err: RedisError) -> StoreError {
        let retryable = is_transient(&err);
        let message = if retryable {
            format!("Redis at {} is unreachable (retry later): {err}", self.url)
        } else {
            format!("Redis at {} failed: {err}", self.url)
        };
        StoreError::Backend { message, retryable, source: Some(Box::new(err)) }
    }
}

/// Runs `f`, which waits on Redis, without stalling the async runtime it may be called from: on a
/// worker of a multi-thread tokio runtime through [`tokio::task::block_in_place`] (the worker's
/// other tasks move to another thread while `f` waits), elsewhere (a `spawn_blocking` thread, no
/// runtime, a current-thread runtime) directly.
///
/// The store is synchronous; a master handler that calls it straight from an async fn would
/// otherwise hold one of the runtime's few workers (one per core) for each Redis round trip, so a
/// 2-core master kept at most two Redis calls in flight and its other requests waited meanwhile.
fn blocking_io<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Whether the connection was found closed or reset before a reply could come (the command did not
/// run: a Redis that restarted closed it), as opposed to a timeout.
fn is_gone(err: &RedisError) -> bool {
    !err.is_timeout() && (err.is_connection_dropped() || err.is_unrecoverable_error())
}

/// Whether the failure is of the connection or of a Redis that is temporarily not serving.
fn is_transient(err: &RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    err.is_io_error()
        || err.is_timeout()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_cluster_error()
        || matches!(
            err.kind(),
            ErrorKind::Server(ServerErrorKind::BusyLoading | ServerErrorKind::MasterDown | ServerErrorKind::ReadOnly)
        )
}
