//! [`KeyedClient`]: keyed gets and puts (one exchange with the holder, see
//! [`keyed`](super::keyed)) on the calling thread.
//!
//! No worker thread, no channel: the caller writes the request and reads the reply on a pooled
//! connection of its own, so a single get costs one round trip and no thread hand-off. Connections
//! are pooled per endpoint (a few idle ones each, closed after
//! [`idle_timeout`](KeyedClientConfig::idle_timeout)); an idle one is checked for an end of stream
//! before reuse, and a GET lost with a reused connection is sent once more on a fresh one (a GET
//! may be repeated: the holder takes and ends its own lease). A PUT is never resent: whether the
//! holder committed it before the connection broke cannot be known, so the caller takes the routed
//! path (which finds the key if it was).
//!
//! [`get_shared`](KeyedClient::get_shared) is the same exchange for a holder on this host: the
//! holder may answer with where the value lies in its shared regions instead of the bytes, and the
//! client copies them from its own mappings (see `shm`'s `SharedReads` for the rules), then tells
//! the holder to end the lease — or, on any doubt, to send the bytes after all.

use std::collections::HashMap;
use std::io::{self, Read};
use std::net::TcpStream;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::io::{configure, dial, idle_and_open};
use super::protocol::{
    self, Descriptor, FLAG_CHECKSUM, FLAG_SHARED, MAX_KEY_LEN, Op, REPLY_LEN, Reply, Request, Settle, Status,
    TRAILER_LEN, Trailer,
};
use crate::engine::FailureKind;
use crate::shm::SharedReads;

mod batch;
pub use self::batch::{KeyedBatchItem, KeyedBatchPut, SentGetBatch};

/// The smallest value [`KeyedClient::put_shared`] copies through a mapping. Measured with a holder
/// in another process on a 2-core VM (`tests/keyed_shm_latency.rs`, p50): 64 KiB 12.6 µs over TCP
/// against 15.0 µs shared (the extra round trip), 1 MiB 233 µs against 57 µs; the two meet near
/// 80 KiB.
pub(crate) const SHARED_PUT_MIN: usize = 128 << 10;

/// Settings of a [`KeyedClient`].
#[derive(Clone)]
pub struct KeyedClientConfig {
    /// The cluster token presented in the handshake. Default: none.
    pub cluster_token: Option<String>,
    /// Connecting and the handshake must finish within this. Default: 2 s.
    pub connect_timeout: Duration,
    /// Each read or write of a request or reply must progress within this. Default: 30 s.
    pub io_timeout: Duration,
    /// Idle connections kept per endpoint. Default: the cores available, at least 8 — a batch
    /// with a holder on this host runs one exchange per core at once, and every connection past
    /// this many is closed when its exchange ends, to be dialled again by the next batch (the
    /// holder starting a thread for each).
    pub idle_per_peer: usize,
    /// An idle connection older than this is closed rather than reused (keep it below the
    /// servers' idle timeout, 60 s by default). Default: 30 s.
    pub idle_timeout: Duration,
}

// Manual `Debug`: the cluster token must never reach a log line.
impl std::fmt::Debug for KeyedClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedClientConfig")
            .field("cluster_token", &self.cluster_token.as_ref().map(|_| "<redacted>"))
            .field("connect_timeout", &self.connect_timeout)
            .field("io_timeout", &self.io_timeout)
            .field("idle_per_peer", &self.idle_per_peer)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

impl Default for KeyedClientConfig {
    fn default() -> Self {
        Self {
            cluster_token: None,
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(30),
            idle_per_peer: std::thread::available_parallelism().map_or(8, |n| n.get().max(8)),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

/// What a keyed get found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedGet {
    /// The value is in the destination.
    Hit {
        /// The value's size.
        size: u64,
        /// The CRC-32C its writer put with the value, for the caller to check the destination's
        /// bytes against (this client never reads them).
        crc32c: Option<u32>,
    },
    /// The holder does not hold the key.
    Miss,
    /// The holder holds it but cannot serve it now: ask again shortly.
    Busy,
    /// The value (this many bytes) is larger than the destination; nothing was written.
    TooSmall(u64),
    /// The send outlived the holder's read lease: the destination's bytes are not the value.
    Lapsed,
    /// The holder serves no keyed reads of this key: take the routed path.
    Unsupported,
    /// The copied bytes do not match the checksum the writer put with the value (only for a batch
    /// item that asked to be verified): the destination's bytes are not the value.
    Corrupt {
        /// The writer's checksum.
        expected: u32,
        /// The copy's.
        got: u32,
    },
}

/// What a keyed put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyedPut {
    /// Written and committed on the holder.
    Written,
    /// The holder already held the key; its value was kept.
    Exists,
    /// The holder has no room.
    NoSpace,
    /// The holder has room but no staging page now: ask again shortly.
    Busy,
    /// The holder could not store it (allocation or commit failed, or the value arrived after the
    /// slot's end).
    Failed,
    /// The holder serves no keyed writes here: take the routed path.
    Unsupported,
    /// Copied, then not committed because the writer's `confirm` withheld it
    /// ([`KeyedClient::put_shared_batch_confirmed`]): the holder aborted its slot.
    Withdrawn,
}

/// Why a keyed request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum KeyedError {
    /// The key is empty or longer than the protocol allows: fix the key.
    #[error("a keyed request's key must be 1 to {max} bytes, got {len}")]
    BadKey {
        /// The key's length.
        len: usize,
        /// The longest accepted.
        max: u64,
    },
    /// No connection could be made (nothing listens, refused handshake, …): the holder may be
    /// gone; take the routed path.
    #[error("{message}")]
    Connect {
        /// The holder's data endpoint.
        endpoint: String,
        /// What failed (naming the endpoint).
        message: String,
        /// What kind of failure.
        kind: FailureKind,
    },
    /// The connection broke or timed out mid-exchange: take the routed path.
    #[error("keyed request to {endpoint} failed: {source}")]
    Io {
        /// The holder's data endpoint.
        endpoint: String,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The holder answered something that is not the protocol (an older server closes the
    /// connection at the unknown op, which reads as [`Io`](Self::Io)).
    #[error("keyed request to {endpoint}: {message}")]
    Protocol {
        /// The holder's data endpoint.
        endpoint: String,
        /// What was wrong.
        message: String,
    },
}

impl KeyedError {
    /// Whether the holder could not be reached at all (no connection): its process may be gone.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Connect { kind: FailureKind::ConnectionLost | FailureKind::Timeout, .. })
    }
}

/// One pooled connection.
struct Conn {
    stream: TcpStream,
    idle_since: Instant,
}

impl Conn {
    /// Whether an idle connection is still open.
    fn alive(&self) -> bool {
        idle_and_open(&self.stream)
    }
}

/// Keyed gets and puts on the calling thread (see the module docs).
pub struct KeyedClient {
    config: KeyedClientConfig,
    hello: Vec<u8>,
    idle: Mutex<HashMap<String, Vec<Conn>>>,
    next_id: AtomicU64,
    /// Mappings of same-host holders' regions, for [`get_shared`](Self::get_shared).
    shared: SharedReads,
    /// Holders asked no GET_KEYS until then (see `batch`).
    batchless: Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for KeyedClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedClient").field("config", &self.config).finish_non_exhaustive()
    }
}

impl KeyedClient {
    /// A client with no connection yet.
    ///
    /// # Errors
    /// The token is longer than the protocol allows (1024 bytes).
    pub fn new(config: KeyedClientConfig) -> Result<Self, KeyedError> {
        let token = config.cluster_token.as_deref().unwrap_or("").as_bytes();
        let hello = protocol::encode_hello(token)
            .map_err(|e| KeyedError::Protocol { endpoint: String::new(), message: format!("cluster token: {e}") })?;
        let shared = SharedReads::new(token, config.io_timeout);
        Ok(Self {
            config,
            hello,
            idle: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            shared,
            batchless: Mutex::new(HashMap::new()),
        })
    }

    /// As [`new`](Self::new), with [`get_shared`](Self::get_shared) and
    /// [`put_shared`](Self::put_shared) mapping holders' regions through `shm` — the same client
    /// the process's [`SharedMemoryEngine`](crate::SharedMemoryEngine) uses
    /// ([`with_client`](crate::SharedMemoryEngine::with_client)), so batches and single keys share
    /// one connection and one mapping per holder region. `shm` presents its own token (the cluster
    /// token, as here).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_shm_client(config: KeyedClientConfig, shm: Arc<crate::shm::ShmClient>) -> Result<Self, KeyedError> {
        let mut client = Self::new(config)?;
        client.shared = SharedReads::with_client(shm);
        Ok(client)
    }

    /// Reads `key`'s value from the holder at `endpoint` into `dst` (at most `cap` bytes).
    ///
    /// # Safety
    /// `dst` is valid for writes of `cap` bytes, and nobody else reads or writes them until this
    /// returns.
    ///
    /// # Errors
    /// See [`KeyedError`]; on an error the destination's bytes are unspecified.
    pub unsafe fn get(&self, endpoint: &str, key: &str, dst: NonNull<u8>, cap: usize) -> Result<KeyedGet, KeyedError> {
        check_key(key)?;
        let request =
            |id| Request { op: Op::GetKey, flags: 0, id, region: 0, offset: cap as u64, length: key.len() as u64 };
        // SAFETY: this function's contract.
        self.exchange(endpoint, true, |stream, id| unsafe {
            send(stream, &request(id).encode(), &[key.as_bytes()])?;
            read_get_reply(stream, id, dst, cap)
        })
    }

    /// As [`get`](Self::get), for a holder that may be on this host: when its shared-memory server
    /// is reachable here (same kernel and network namespace, this user or an allowed group, the
    /// cluster token), the holder may answer with the value's place in its shared regions; the
    /// value is then copied from this process's mappings of them, under the holder's read lease
    /// (judged here: see the TCP `protocol` module, "Keyed gets over shared memory"), and the lease
    /// is ended by a settle frame that needs no answer. A holder without the path, a region this
    /// client cannot map, or a mapping gone stale is served the TCP way within the same exchange.
    ///
    /// # Safety
    /// As [`get`](Self::get).
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub unsafe fn get_shared(
        &self,
        endpoint: &str,
        key: &str,
        dst: NonNull<u8>,
        cap: usize,
    ) -> Result<KeyedGet, KeyedError> {
        check_key(key)?;
        if !self.shared.usable(endpoint) {
            // SAFETY: this function's contract.
            return unsafe { self.get(endpoint, key, dst, cap) };
        }
        let request = |id| Request {
            op: Op::GetKey,
            flags: FLAG_SHARED,
            id,
            region: 0,
            offset: cap as u64,
            length: key.len() as u64,
        };
        // SAFETY: this function's contract.
        let answer = self.exchange(endpoint, true, |stream, id| unsafe {
            // Before the request leaves: the lease's bound is measured from here.
            let sent = Instant::now();
            send(stream, &request(id).encode(), &[key.as_bytes()])?;
            self.read_shared_reply(stream, endpoint, id, dst, cap, sent)
        });
        match answer {
            Ok(Some(got)) => Ok(got),
            Ok(None) => {
                // A server older than the flag: ask it the old way (and not the new one for a while).
                self.shared.remember(endpoint);
                // SAFETY: this function's contract.
                unsafe { self.get(endpoint, key, dst, cap) }
            }
            Err(e) => {
                if e.is_unreachable() {
                    self.shared.forget(endpoint);
                }
                Err(e)
            }
        }
    }

    /// Keyed gets ([`get_shared`](Self::get_shared)) and puts ([`put_shared`](Self::put_shared))
    /// whose bytes were copied through a mapping, and those bytes: `(gets, puts, bytes)`.
    pub fn shared_copies(&self) -> (u64, u64, u64) {
        self.shared.copied()
    }

    /// As [`put`](Self::put), for a holder that may be on this host: when its shared-memory server
    /// is reachable here, only the key and the value's size are sent; the holder allocates and
    /// answers with the slot's place in its shared regions, the value is copied into this
    /// process's mappings of them, and a settle frame asks the holder to commit — which it does
    /// only when the settle arrived before the slot's end (every byte was written before the
    /// settle left, so the holder's clock alone judges it). A region this client cannot map is
    /// written the TCP way within the same exchange (the value follows a `SendBytes` settle).
    ///
    /// A value smaller than 128 KiB (`SHARED_PUT_MIN`) is sent the TCP way at once: the shared put costs a
    /// second round trip, which only a large value's copy repays.
    ///
    /// # Errors
    /// As [`put`](Self::put).
    pub fn put_shared(
        &self,
        endpoint: &str,
        key: &str,
        tier: u64,
        value: &[u8],
        crc32c: Option<u32>,
    ) -> Result<KeyedPut, KeyedError> {
        check_key(key)?;
        if value.len() < SHARED_PUT_MIN
            || value.len() as u64 > protocol::MAX_REQUEST_BYTES
            || !self.shared.usable(endpoint)
        {
            return self.put(endpoint, key, tier, value, crc32c);
        }
        let (checksum_flag, crc) = checksum_field(crc32c);
        let crc = crc.as_ref().map_or(&[][..], |b| &b[..]);
        let answer = self.exchange(endpoint, false, |stream, id| {
            let length = key.len() as u64 + crc.len() as u64 + 8;
            let flags = FLAG_SHARED | checksum_flag;
            let head = Request { op: Op::PutKey, flags, id, region: tier, offset: key.len() as u64, length };
            send(stream, &head.encode(), &[key.as_bytes(), crc, &(value.len() as u64).to_le_bytes()])?;
            let reply = read_reply(stream, id)?;
            match reply.status {
                Status::Mapped => {}
                Status::BadRequest if reply.length == 0 => return Ok(None),
                _ => return put_answer(reply).map(Some),
            }
            let mid = |source| ExchangeError::Io { source, before_reply: false };
            let len = usize::try_from(reply.length)
                .ok()
                .filter(|l| *l <= Descriptor::max_len())
                .ok_or_else(|| protocol_error(format!("a MAPPED descriptor of {} bytes", reply.length)))?;
            let mut bytes = vec![0u8; len];
            stream.read_exact(&mut bytes).map_err(mid)?;
            let descriptor = Descriptor::decode(&bytes).map_err(|e| protocol_error(format!("bad descriptor: {e}")))?;
            if descriptor.size != value.len() as u64 {
                return Err(protocol_error(format!(
                    "a slot of {} bytes for a value of {}",
                    descriptor.size,
                    value.len()
                )));
            }
            match self.shared.copy_in(endpoint, &descriptor.ranges, value) {
                Ok(_) => write_frame(stream, &Settle::Done.encode())?,
                Err(error) => {
                    tracing::debug!(peer = endpoint, %error, "keyed put: no copy into the mapping; sending the bytes");
                    let settle = Settle::SendBytes.encode();
                    super::io::write_all_vectored(stream, &mut [io::IoSlice::new(&settle), io::IoSlice::new(value)])
                        .map_err(mid)?;
                }
            }
            let reply = read_reply(stream, id).map_err(|e| match e {
                ExchangeError::Io { source, .. } => ExchangeError::Io { source, before_reply: false },
                other => other,
            })?;
            put_answer(reply).map(Some)
        });
        match answer {
            Ok(Some(put)) => Ok(put),
            Ok(None) => {
                // A server older than the flag: ask it the old way (and not the new one for a while).
                self.shared.remember(endpoint);
                self.put(endpoint, key, tier, value, crc32c)
            }
            Err(e) => {
                if e.is_unreachable() {
                    self.shared.forget(endpoint);
                }
                Err(e)
            }
        }
    }

    /// Reads the answer to a GET_KEY with [`FLAG_SHARED`]: a `MAPPED` descriptor (copied from the
    /// mappings, then settled) or any ordinary answer; `None`: the server refused the flag.
    ///
    /// # Safety
    /// As [`get`](Self::get).
    unsafe fn read_shared_reply(
        &self,
        stream: &mut TcpStream,
        endpoint: &str,
        id: u64,
        dst: NonNull<u8>,
        cap: usize,
        sent: Instant,
    ) -> Result<Option<KeyedGet>, ExchangeError> {
        let reply = read_reply(stream, id)?;
        let mid = |source| ExchangeError::Io { source, before_reply: false };
        match reply.status {
            Status::Mapped => {}
            Status::BadRequest if reply.length == 0 => return Ok(None),
            // SAFETY: this function's contract.
            _ => return unsafe { read_get_body(stream, reply, dst, cap) }.map(Some),
        }
        let len = usize::try_from(reply.length)
            .ok()
            .filter(|l| *l <= Descriptor::max_len())
            .ok_or_else(|| protocol_error(format!("a MAPPED descriptor of {} bytes", reply.length)))?;
        let mut bytes = vec![0u8; len];
        stream.read_exact(&mut bytes).map_err(mid)?;
        let descriptor = Descriptor::decode(&bytes).map_err(|e| protocol_error(format!("bad descriptor: {e}")))?;
        if descriptor.size > cap as u64 {
            return Err(protocol_error(format!("a value of {} bytes for a destination of {cap}", descriptor.size)));
        }
        // SAFETY: the ranges add up to `descriptor.size <= cap` bytes (checked by `decode` and
        // above), valid for writes at `dst` and ours alone during the call (this function's
        // contract).
        match unsafe { self.shared.copy(endpoint, &descriptor.ranges, dst) } {
            Ok(size) => {
                // The lease's bound: from before the request left (see `SharedReads`).
                let intact = sent.elapsed() <= Duration::from_nanos(descriptor.lease_ns);
                write_frame(stream, &Settle::Done.encode())?;
                Ok(Some(if intact { KeyedGet::Hit { size, crc32c: descriptor.crc32c } } else { KeyedGet::Lapsed }))
            }
            Err(error) => {
                tracing::debug!(peer = endpoint, %error, "keyed get: no copy from the mapping; asking for the bytes");
                write_frame(stream, &Settle::SendBytes.encode())?;
                let reply = read_reply(stream, id).map_err(|e| match e {
                    ExchangeError::Io { source, .. } => ExchangeError::Io { source, before_reply: false },
                    other => other,
                })?;
                // SAFETY: this function's contract.
                unsafe { read_get_body(stream, reply, dst, cap) }.map(Some)
            }
        }
    }

    /// Writes `value` under `key` on the holder at `endpoint`, on its medium of `tier` (a
    /// `TierType` as a number).
    ///
    /// # Errors
    /// See [`KeyedError`]; a connection that broke mid-exchange leaves unknown whether the holder
    /// committed the value.
    pub fn put(
        &self,
        endpoint: &str,
        key: &str,
        tier: u64,
        value: &[u8],
        crc32c: Option<u32>,
    ) -> Result<KeyedPut, KeyedError> {
        check_key(key)?;
        let (flags, crc) = checksum_field(crc32c);
        let crc = crc.as_ref().map_or(&[][..], |b| &b[..]);
        let length = key.len() as u64 + crc.len() as u64 + value.len() as u64;
        if length > protocol::MAX_REQUEST_BYTES {
            return Err(KeyedError::Protocol {
                endpoint: endpoint.to_owned(),
                message: format!("a value of {} bytes is larger than one keyed request may carry", value.len()),
            });
        }
        self.exchange(endpoint, false, |stream, id| {
            let head = Request { op: Op::PutKey, flags, id, region: tier, offset: key.len() as u64, length };
            send(stream, &head.encode(), &[key.as_bytes(), crc, value])?;
            put_answer(read_reply(stream, id)?)
        })
    }

    /// Closes the idle connections to `endpoint` (its holder went away) and unmaps its regions.
    pub fn forget(&self, endpoint: &str) {
        self.idle.lock().remove(endpoint);
        self.shared.forget(endpoint);
    }

    /// Runs one exchange on a pooled or fresh connection; a `resendable` request lost with a reused
    /// connection before any reply byte is sent once more on a fresh one.
    fn exchange<T>(
        &self,
        endpoint: &str,
        resendable: bool,
        mut run: impl FnMut(&mut TcpStream, u64) -> Result<T, ExchangeError>,
    ) -> Result<T, KeyedError> {
        let mut reused = self.take_idle(endpoint);
        loop {
            let was_reused = reused.is_some();
            let mut stream = match reused.take() {
                Some(s) => s,
                None => self.connect(endpoint)?,
            };
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            match run(&mut stream, id).map_err(|e| e.into_keyed(endpoint)) {
                Ok(v) => {
                    self.put_idle(endpoint, stream);
                    return Ok(v);
                }
                Err((e, before_reply)) => {
                    if resendable && was_reused && before_reply {
                        tracing::debug!(%endpoint, error = %e, "keyed request lost with a reused connection; resending");
                        continue;
                    }
                    return Err(e);
                }
            }
        }
    }

    fn take_idle(&self, endpoint: &str) -> Option<TcpStream> {
        let mut idle = self.idle.lock();
        let conns = idle.get_mut(endpoint)?;
        while let Some(c) = conns.pop() {
            if c.idle_since.elapsed() < self.config.idle_timeout && c.alive() {
                return Some(c.stream);
            }
        }
        None
    }

    fn put_idle(&self, endpoint: &str, stream: TcpStream) {
        let mut idle = self.idle.lock();
        let conns = idle.entry(endpoint.to_owned()).or_default();
        if conns.len() < self.config.idle_per_peer {
            conns.push(Conn { stream, idle_since: Instant::now() });
        }
    }

    fn connect(&self, endpoint: &str) -> Result<TcpStream, KeyedError> {
        let stream = dial(endpoint, self.config.connect_timeout, self.config.connect_timeout, &self.hello)
            .map_err(|f| KeyedError::Connect { endpoint: endpoint.to_owned(), message: f.message, kind: f.kind })?;
        configure(&stream, self.config.io_timeout).map_err(|e| KeyedError::Connect {
            endpoint: endpoint.to_owned(),
            message: format!("configuring the socket: {e}"),
            kind: super::io::failure_kind(&e),
        })?;
        Ok(stream)
    }
}

/// An exchange's failure before it is tied to an endpoint.
enum ExchangeError {
    /// A socket error; `before_reply`: no reply byte had arrived (the request may be resent).
    Io {
        source: io::Error,
        before_reply: bool,
    },
    Protocol(String),
}

impl ExchangeError {
    fn into_keyed(self, endpoint: &str) -> (KeyedError, bool) {
        match self {
            Self::Io { source, before_reply } => {
                (KeyedError::Io { endpoint: endpoint.to_owned(), source }, before_reply)
            }
            Self::Protocol(message) => (KeyedError::Protocol { endpoint: endpoint.to_owned(), message }, false),
        }
    }
}

fn protocol_error(message: String) -> ExchangeError {
    ExchangeError::Protocol(message)
}

fn check_key(key: &str) -> Result<(), KeyedError> {
    if key.is_empty() || key.len() as u64 > MAX_KEY_LEN {
        return Err(KeyedError::BadKey { len: key.len(), max: MAX_KEY_LEN });
    }
    Ok(())
}

/// Writes the header and the payload parts in one gather write.
fn send(stream: &mut TcpStream, head: &[u8], parts: &[&[u8]]) -> Result<(), ExchangeError> {
    let mut slices: Vec<io::IoSlice<'_>> = Vec::with_capacity(parts.len() + 1);
    slices.push(io::IoSlice::new(head));
    slices.extend(parts.iter().map(|p| io::IoSlice::new(p)));
    super::io::write_all_vectored(stream, &mut slices)
        .map_err(|source| ExchangeError::Io { source, before_reply: true })
}

/// What a PUT_KEY's final reply says.
fn put_answer(reply: Reply) -> Result<KeyedPut, ExchangeError> {
    if reply.length != 0 {
        return Err(protocol_error(format!("a PUT_KEY reply carries {} bytes", reply.length)));
    }
    Ok(match reply.status {
        Status::Ok => KeyedPut::Written,
        Status::Exists => KeyedPut::Exists,
        Status::NoSpace => KeyedPut::NoSpace,
        Status::Busy => KeyedPut::Busy,
        Status::Failed => KeyedPut::Failed,
        Status::Unsupported => KeyedPut::Unsupported,
        other => return Err(protocol_error(format!("unexpected PUT_KEY status {}", other.as_str()))),
    })
}

/// Writes a small frame after a reply began (a failure is mid-exchange).
fn write_frame(stream: &mut TcpStream, frame: &[u8]) -> Result<(), ExchangeError> {
    super::io::write_all_vectored(stream, &mut [io::IoSlice::new(frame)])
        .map_err(|source| ExchangeError::Io { source, before_reply: false })
}

/// Reads a reply header for request `id`.
fn read_reply(stream: &mut TcpStream, id: u64) -> Result<Reply, ExchangeError> {
    let mut head = [0u8; REPLY_LEN];
    stream.read_exact(&mut head).map_err(|source| ExchangeError::Io { source, before_reply: true })?;
    let reply = Reply::decode(&head).map_err(|e| protocol_error(format!("bad reply: {e}")))?;
    if reply.id != id {
        return Err(protocol_error(format!("reply to request {} while waiting for {id}", reply.id)));
    }
    Ok(reply)
}

/// A PUT_KEY's checksum field: the flag to set, and the bytes that follow the key (none without
/// a checksum).
fn checksum_field(crc32c: Option<u32>) -> (u8, Option<[u8; 4]>) {
    (if crc32c.is_some() { FLAG_CHECKSUM } else { 0 }, crc32c.map(u32::to_le_bytes))
}

/// Reads a GET_KEY reply: the value straight into `dst`, then its trailer.
///
/// # Safety
/// As [`KeyedClient::get`].
unsafe fn read_get_reply(
    stream: &mut TcpStream,
    id: u64,
    dst: NonNull<u8>,
    cap: usize,
) -> Result<KeyedGet, ExchangeError> {
    let reply = read_reply(stream, id)?;
    // SAFETY: this function's contract.
    unsafe { read_get_body(stream, reply, dst, cap) }
}

/// Reads what follows an ordinary GET_KEY reply header: the value straight into `dst`, then its
/// trailer; or nothing.
///
/// # Safety
/// As [`KeyedClient::get`].
unsafe fn read_get_body(
    stream: &mut TcpStream,
    reply: Reply,
    dst: NonNull<u8>,
    cap: usize,
) -> Result<KeyedGet, ExchangeError> {
    let mid = |source| ExchangeError::Io { source, before_reply: false };
    match reply.status {
        Status::Ok => {
            let len = usize::try_from(reply.length).ok().filter(|l| *l <= cap).ok_or_else(|| {
                protocol_error(format!("a value of {} bytes for a destination of {cap}", reply.length))
            })?;
            // SAFETY: `len <= cap` (checked above) bytes at `dst`, valid for writes and ours alone
            // during the call (the caller's contract). Only handed to the kernel's `recv`.
            let buf = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr(), len) };
            stream.read_exact(buf).map_err(mid)?;
            let mut trailer = [0u8; TRAILER_LEN];
            stream.read_exact(&mut trailer).map_err(mid)?;
            match Trailer::decode(&trailer).map_err(|e| protocol_error(format!("bad trailer: {e}")))? {
                (Trailer::Intact, crc32c) => Ok(KeyedGet::Hit { size: reply.length, crc32c }),
                (Trailer::Lapsed, _) => Ok(KeyedGet::Lapsed),
            }
        }
        Status::TooSmall => Ok(KeyedGet::TooSmall(reply.length)),
        status if reply.length != 0 => {
            Err(protocol_error(format!("a GET_KEY {} reply carries {} bytes", status.as_str(), reply.length)))
        }
        Status::Miss => Ok(KeyedGet::Miss),
        Status::Busy => Ok(KeyedGet::Busy),
        Status::Unsupported => Ok(KeyedGet::Unsupported),
        other => Err(protocol_error(format!("unexpected GET_KEY status {}", other.as_str()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A same-host batch runs one exchange per core at once; a pool that keeps fewer idle
    /// connections closes the rest after every batch, and the next batch dials them again (on a
    /// 16-core host: 8 connects and 8 holder threads per batch, 1 MiB batch gets at 0.51–0.58 of
    /// memcpy).
    #[test]
    fn the_idle_pool_keeps_a_connection_per_core() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let config = KeyedClientConfig::default();
        assert!(config.idle_per_peer >= cores, "{} idle for {cores} cores", config.idle_per_peer);
        assert!(config.idle_per_peer >= 8, "{}", config.idle_per_peer);
    }
}
