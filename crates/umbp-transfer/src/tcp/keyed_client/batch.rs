//! [`KeyedClient::get_shared_batch`]: many keys of one holder on this host in one GET_KEYS
//! exchange (see `batch_wire`), their bytes copied from this process's mappings of the holder's
//! regions.

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use super::super::batch_wire::{self, BatchAnswer, BatchEntry};
use super::{
    ExchangeError, FLAG_SHARED, KeyedClient, KeyedError, KeyedGet, Op, Request, Settle, Status, check_key,
    protocol_error, read_reply, send, write_frame,
};

/// How long a holder that failed a GET_KEYS (an older build closes the connection at the op) is
/// asked no batch.
const BATCHLESS_FOR: Duration = Duration::from_secs(30);

/// One key of [`KeyedClient::get_shared_batch`] and where its value goes.
#[derive(Debug, Clone, Copy)]
pub struct KeyedBatchItem<'a> {
    /// The key.
    pub key: &'a str,
    /// The destination's first byte.
    pub dst: NonNull<u8>,
    /// The destination's bytes.
    pub cap: usize,
}

impl KeyedClient {
    /// The most keys one [`get_shared_batch`](Self::get_shared_batch) takes.
    pub const MAX_BATCH_KEYS: usize = batch_wire::MAX_BATCH_KEYS;

    /// Reads `items` from the holder at `endpoint`, **on this host**, in one exchange: the holder
    /// resolves every key under its read lease and answers where each value lies in its shared
    /// memory; the client copies from its own mappings of the holder's regions, then ends every
    /// lease with one settle frame. One answer per item, in order: `Hit` (the copy ended inside
    /// the holder's lease, measured from before the request left), `Lapsed`, `Miss`, `Busy`,
    /// `TooSmall`, or `Unsupported` — the key (or the whole batch: a holder without a shared path
    /// here, one that serves no batches, a region the client cannot map) is for the routed path.
    ///
    /// # Safety
    /// Each `dst` is valid for writes of its `cap` bytes, no two overlap, and nobody else reads or
    /// writes them until this returns.
    ///
    /// # Errors
    /// A bad key, or [`KeyedError`]'s connection failures; the destinations' bytes are then
    /// unspecified, and the holder is asked no batch for a while.
    pub unsafe fn get_shared_batch(
        &self,
        endpoint: &str,
        items: &[KeyedBatchItem<'_>],
    ) -> Result<Vec<KeyedGet>, KeyedError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        if items.len() > Self::MAX_BATCH_KEYS {
            return Err(KeyedError::Protocol {
                endpoint: endpoint.to_owned(),
                message: format!("a batch of {} keys (at most {})", items.len(), Self::MAX_BATCH_KEYS),
            });
        }
        for item in items {
            check_key(item.key)?;
        }
        let unsupported = || vec![KeyedGet::Unsupported; items.len()];
        if self.batchless(endpoint) || !self.shared.usable(endpoint) {
            return Ok(unsupported());
        }
        let entries: Vec<BatchEntry<'_>> = items.iter().map(|i| BatchEntry { key: i.key, cap: i.cap as u64 }).collect();
        let body = batch_wire::encode_request(&entries);
        let request = |id| Request {
            op: Op::GetKeys,
            flags: FLAG_SHARED,
            id,
            region: 0,
            offset: items.len() as u64,
            length: body.len() as u64,
        };
        // SAFETY: this function's contract.
        let answer = self.exchange(endpoint, true, |stream, id| unsafe {
            // Before the request leaves: every lease's bound is measured from here.
            let sent = Instant::now();
            send(stream, &request(id).encode(), &[&body])?;
            self.read_batch_reply(stream, endpoint, id, items, sent)
        });
        answer.inspect_err(|e| {
            tracing::debug!(peer = endpoint, error = %e, "GET_KEYS failed; no batches to this holder for a while");
            self.batchless.lock().insert(endpoint.to_owned(), Instant::now() + BATCHLESS_FOR);
            if e.is_unreachable() {
                self.shared.forget(endpoint);
            }
        })
    }

    /// Whether `endpoint` is asked no batch now.
    fn batchless(&self, endpoint: &str) -> bool {
        let mut batchless = self.batchless.lock();
        match batchless.get(endpoint) {
            Some(until) if Instant::now() < *until => true,
            Some(_) => {
                batchless.remove(endpoint);
                false
            }
            None => false,
        }
    }

    /// Reads a GET_KEYS reply, copies every `MAPPED` value from the mappings and settles.
    ///
    /// # Safety
    /// As [`get_shared_batch`](Self::get_shared_batch).
    unsafe fn read_batch_reply(
        &self,
        stream: &mut std::net::TcpStream,
        endpoint: &str,
        id: u64,
        items: &[KeyedBatchItem<'_>],
        sent: Instant,
    ) -> Result<Vec<KeyedGet>, ExchangeError> {
        use std::io::Read as _;
        let reply = read_reply(stream, id)?;
        match reply.status {
            Status::Ok => {}
            Status::Unsupported if reply.length == 0 => return Ok(vec![KeyedGet::Unsupported; items.len()]),
            other => return Err(protocol_error(format!("unexpected GET_KEYS status {}", other.as_str()))),
        }
        if reply.length > batch_wire::max_reply_body() {
            return Err(protocol_error(format!("a GET_KEYS reply of {} bytes", reply.length)));
        }
        let mut body = vec![0u8; reply.length as usize];
        stream.read_exact(&mut body).map_err(|source| ExchangeError::Io { source, before_reply: false })?;
        let answers = batch_wire::decode_reply(&body, items.len())
            .map_err(|e| protocol_error(format!("bad GET_KEYS reply: {e}")))?;
        let mut mapped = false;
        let mut out = Vec::with_capacity(items.len());
        for (item, answer) in items.iter().zip(answers) {
            out.push(match answer {
                BatchAnswer::Mapped(d) => {
                    mapped = true;
                    if d.size > item.cap as u64 {
                        return Err(protocol_error(format!(
                            "a value of {} bytes for a destination of {}",
                            d.size, item.cap
                        )));
                    }
                    // SAFETY: the ranges add up to `d.size <= cap` bytes (checked by `decode` and
                    // above), valid for writes at `dst` and ours alone during the call (this
                    // function's contract).
                    match unsafe { self.shared.copy(endpoint, &d.ranges, item.dst) } {
                        // Judged when this key's copy ended (see `SharedReads`).
                        Ok(size) if sent.elapsed() <= Duration::from_nanos(d.lease_ns) => {
                            KeyedGet::Hit { size, crc32c: d.crc32c }
                        }
                        Ok(_) => KeyedGet::Lapsed,
                        Err(error) => {
                            tracing::debug!(peer = endpoint, %error, key = item.key, "no copy from the mapping");
                            KeyedGet::Unsupported
                        }
                    }
                }
                BatchAnswer::TooSmall(size) => KeyedGet::TooSmall(size),
                BatchAnswer::Other(Status::Miss) => KeyedGet::Miss,
                BatchAnswer::Other(Status::Busy) => KeyedGet::Busy,
                BatchAnswer::Other(_) => KeyedGet::Unsupported,
            });
        }
        if mapped {
            write_frame(stream, &Settle::Done.encode())?;
        }
        Ok(out)
    }
}
