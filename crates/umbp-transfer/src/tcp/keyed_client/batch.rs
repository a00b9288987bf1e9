//! [`KeyedClient::get_shared_batch`] and [`KeyedClient::put_shared_batch`]: many keys of one
//! holder on this host in one GET_KEYS or PUT_KEYS exchange (see `batch_wire`), their bytes copied
//! from (or into) this process's mappings of the holder's regions.

use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::super::batch_wire::{self, BatchAnswer, BatchEntry, PutChecksum, PutEntry};
use super::{
    ExchangeError, FLAG_SHARED, KeyedClient, KeyedError, KeyedGet, KeyedPut, Op, Request, Settle, Status, check_key,
    protocol_error, read_reply, send, write_frame,
};
use crate::phases;
use crate::shm::fanout::{self, Dst, ValueCopy};
use crate::shm::{Copier, SharedReads, ShmError};

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
    /// Check the copy against the checksum its writer put with the value right after the copy,
    /// while its bytes are still in the cache (a value put without one is not checked): a mismatch
    /// is [`KeyedGet::Corrupt`].
    pub verify: bool,
    /// Write the destination with stores that stream past the cache: for a batch of at least
    /// [`stream_threshold`](crate::stream_threshold) bytes, too large for the cache to keep (a
    /// checked value is then summed from the holder's bytes as the copy read them).
    pub stream: bool,
}

/// A GET_KEYS request [`KeyedClient::send_get_shared_batch`] sent, its answer still to be read by
/// [`KeyedClient::finish_get_shared_batch_then`]. Dropped unfinished, it closes its connection:
/// the holder then ends the batch's leases at once.
#[derive(Debug)]
pub struct SentGetBatch {
    endpoint: String,
    stream: std::net::TcpStream,
    id: u64,
    sent: Instant,
    /// The request's body: the keys and capacities the answer is for.
    body: Vec<u8>,
}

/// A GET_KEYS request's body for `(key, destination bytes)` pairs.
fn get_keys_body<'a>(keys: impl Iterator<Item = (&'a str, usize)>) -> Vec<u8> {
    let entries: Vec<BatchEntry<'_>> = keys.map(|(key, cap)| BatchEntry { key, cap: cap as u64 }).collect();
    batch_wire::encode_request(&entries)
}

/// A GET_KEYS request's header (shared memory: the holder answers where the values lie).
fn get_keys_request(id: u64, keys: usize, body: &[u8]) -> Request {
    Request { op: Op::GetKeys, flags: FLAG_SHARED, id, region: 0, offset: keys as u64, length: body.len() as u64 }
}

/// One value of [`KeyedClient::put_shared_batch`].
#[derive(Debug, Clone, Copy)]
pub struct KeyedBatchPut<'a> {
    /// The key.
    pub key: &'a str,
    /// The value (1 byte or more).
    pub value: &'a [u8],
    /// The checksum stored with it.
    pub checksum: PutChecksum,
}

impl KeyedClient {
    /// The most keys one [`get_shared_batch`](Self::get_shared_batch) takes.
    pub const MAX_BATCH_KEYS: usize = batch_wire::MAX_BATCH_KEYS;
    /// The largest GET_KEYS request [`send_get_shared_batch`](Self::send_get_shared_batch) sends
    /// from the caller's thread: inside an idle loopback socket's send buffer, so the write does
    /// not wait for the holder to read.
    pub const PRESEND_MAX_BYTES: usize = 64 << 10;

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
    /// A bad key, or [`KeyedError`]'s connection failures before the answers; the destinations'
    /// bytes are then unspecified, and the holder is asked no batch for a while. (A settle frame
    /// that cannot be sent after the copies only ends the leases later: the answers stand.)
    pub unsafe fn get_shared_batch(
        &self,
        endpoint: &str,
        items: &[KeyedBatchItem<'_>],
    ) -> Result<Vec<KeyedGet>, KeyedError> {
        let mut answers = None;
        // SAFETY: this function's contract.
        let sent = unsafe { self.get_shared_batch_then(endpoint, items, |a| answers = Some(a)) };
        match (answers, sent) {
            (Some(answers), _) => Ok(answers),
            (None, Err(e)) => Err(e),
            (None, Ok(())) => Err(KeyedError::Protocol {
                endpoint: endpoint.to_owned(),
                message: "a GET_KEYS exchange ended without answers".into(),
            }),
        }
    }

    /// [`get_shared_batch`](Self::get_shared_batch) that hands the answers to `answered` as soon as
    /// the copies are judged, **before** the settle frame that ends the holder's leases goes out:
    /// the caller's wait does not include that send (tens of microseconds on loopback, where the
    /// kernel runs the holder's side of it inside this thread's `send`). Once `answered` is called
    /// nothing here touches a destination again. `Ok(())` when the answers were handed over and
    /// the leases settled; `Err` when the exchange failed before the answers (`answered` is then
    /// not called) or the settle frame could not be sent after them (the holder's leases then run
    /// out by themselves, and it is asked no batch for a while).
    ///
    /// # Safety
    /// As [`get_shared_batch`](Self::get_shared_batch), until `answered` is called.
    ///
    /// # Errors
    /// As above.
    pub unsafe fn get_shared_batch_then(
        &self,
        endpoint: &str,
        items: &[KeyedBatchItem<'_>],
        answered: impl FnOnce(Vec<KeyedGet>) + Send,
    ) -> Result<(), KeyedError> {
        if items.is_empty() {
            answered(Vec::new());
            return Ok(());
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
        if self.batchless(endpoint) || !self.shared.usable(endpoint) {
            answered(vec![KeyedGet::Unsupported; items.len()]);
            return Ok(());
        }
        let mut answered = Some(answered);
        let body = get_keys_body(items.iter().map(|i| (i.key, i.cap)));
        // SAFETY: this function's contract.
        let answer = self.exchange(endpoint, true, |stream, id| unsafe {
            // Before the request leaves: every lease's bound is measured from here.
            let sent = Instant::now();
            let reply = tracing::trace_span!(target: phases::TARGET, phases::GET_KEYED_REPLY).entered();
            send(stream, &get_keys_request(id, items.len(), &body).encode(), &[&body])?;
            self.answer_and_settle(stream, endpoint, id, items, sent, reply, &mut answered)
        });
        answer.inspect_err(|e| self.batch_failed(endpoint, e))
    }

    /// Sends the GET_KEYS request of a batch of `keys` (each with its destination's bytes) to the
    /// holder at `endpoint`, on this host, **from the calling thread**, on an idle connection;
    /// [`finish_get_shared_batch_then`](Self::finish_get_shared_batch_then) then reads the answer
    /// and copies, on another thread. A caller that hands the copying to a blocking thread sends
    /// first: the holder resolves while the hand-off (25–55 µs on a 16-core host, at times 200)
    /// runs. `None` — nothing was sent; use
    /// [`get_shared_batch_then`](Self::get_shared_batch_then) — for an empty or oversized batch,
    /// a bad key, a holder asked no batches or without a shared path here, a request over
    /// [`PRESEND_MAX_BYTES`](Self::PRESEND_MAX_BYTES), no idle connection (a new one's handshake
    /// would wait on the holder), or a failed write. Blocks for nothing but one write to a connected, idle socket.
    pub fn send_get_shared_batch(&self, endpoint: &str, keys: &[(&str, usize)]) -> Option<SentGetBatch> {
        if keys.is_empty() || keys.len() > Self::MAX_BATCH_KEYS || keys.iter().any(|(key, _)| check_key(key).is_err()) {
            return None;
        }
        if self.batchless(endpoint) || !self.shared.usable(endpoint) {
            return None;
        }
        let body = get_keys_body(keys.iter().copied());
        if body.len() > Self::PRESEND_MAX_BYTES {
            return None;
        }
        let mut stream = self.take_idle(endpoint)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Before the request leaves: every lease's bound is measured from here.
        let sent = Instant::now();
        // A failed write drops the connection (one the holder closed while it was idle).
        send(&mut stream, &get_keys_request(id, keys.len(), &body).encode(), &[&body]).ok()?;
        Some(SentGetBatch { endpoint: endpoint.to_owned(), stream, id, sent, body })
    }

    /// Reads the answer to a batch [`send_get_shared_batch`](Self::send_get_shared_batch) sent,
    /// copies, hands the answers to `answered` and settles, as
    /// [`get_shared_batch_then`](Self::get_shared_batch_then) does. `items` are the keys that
    /// were sent, in order, with their destinations: any other batch is refused (its answers
    /// would land in the wrong buffers) before a byte is read. A connection lost before the reply
    /// (one the holder closed while it was idle) is asked again on a fresh one.
    ///
    /// # Safety
    /// As [`get_shared_batch`](Self::get_shared_batch), until `answered` is called.
    ///
    /// # Errors
    /// As [`get_shared_batch_then`](Self::get_shared_batch_then), and
    /// [`KeyedError::Protocol`] for items that are not the batch that was sent.
    pub unsafe fn finish_get_shared_batch_then(
        &self,
        sent: SentGetBatch,
        items: &[KeyedBatchItem<'_>],
        answered: impl FnOnce(Vec<KeyedGet>) + Send,
    ) -> Result<(), KeyedError> {
        let SentGetBatch { endpoint, mut stream, id, sent, body } = sent;
        // Compared while the holder resolves: it costs the caller nothing it would not wait anyway.
        if get_keys_body(items.iter().map(|i| (i.key, i.cap))) != body {
            return Err(KeyedError::Protocol {
                endpoint,
                message: "the items to finish a GET_KEYS with are not the batch that was sent".into(),
            });
        }
        let mut answered = Some(answered);
        let reply = tracing::trace_span!(target: phases::TARGET, phases::GET_KEYED_REPLY).entered();
        // SAFETY: this function's contract.
        let result = unsafe { self.answer_and_settle(&mut stream, &endpoint, id, items, sent, reply, &mut answered) };
        match result.map_err(|e| e.into_keyed(&endpoint)) {
            Ok(()) => {
                self.put_idle(&endpoint, stream);
                Ok(())
            }
            Err((e, before_reply)) => match answered.take() {
                Some(answered) if before_reply => {
                    tracing::debug!(%endpoint, error = %e, "GET_KEYS lost with a reused connection; asking again");
                    drop(stream);
                    // SAFETY: this function's contract; `answered` was not called.
                    unsafe { self.get_shared_batch_then(&endpoint, items, answered) }
                }
                _ => {
                    self.batch_failed(&endpoint, &e);
                    Err(e)
                }
            },
        }
    }

    /// Reads a GET_KEYS reply, copies, hands the answers to `answered` (taken once: the exchange
    /// is run again only for a failure before the reply) and sends the settle frame.
    ///
    /// # Safety
    /// As [`get_shared_batch`](Self::get_shared_batch).
    #[expect(clippy::too_many_arguments)]
    unsafe fn answer_and_settle(
        &self,
        stream: &mut std::net::TcpStream,
        endpoint: &str,
        id: u64,
        items: &[KeyedBatchItem<'_>],
        sent: Instant,
        reply: tracing::span::EnteredSpan,
        answered: &mut Option<impl FnOnce(Vec<KeyedGet>) + Send>,
    ) -> Result<(), ExchangeError> {
        // SAFETY: this function's contract.
        let settle = unsafe { self.read_batch_reply(stream, endpoint, id, items, sent, reply, answered)? };
        if settle {
            tracing::trace_span!(target: phases::TARGET, phases::GET_KEYED_SETTLE)
                .in_scope(|| write_frame(stream, &Settle::Done.encode()))?;
        }
        Ok(())
    }

    /// A failed GET_KEYS: the holder is asked no batch for a while, and forgotten if unreachable.
    fn batch_failed(&self, endpoint: &str, e: &KeyedError) {
        tracing::debug!(peer = endpoint, error = %e, "GET_KEYS failed; no batches to this holder for a while");
        self.batchless.lock().insert(endpoint.to_owned(), Instant::now() + BATCHLESS_FOR);
        if e.is_unreachable() {
            self.shared.forget(endpoint);
        }
    }

    /// Writes `items` to tier `tier` of the holder at `endpoint`, **on this host**, in one
    /// exchange: the holder allocates a slot per key and answers where each lies in its shared
    /// memory; the client copies the values in through its own mappings and tells the holder which
    /// it copied; the holder commits those (if told before the slot's end) and answers each. One
    /// answer per item, in order: `Written`, `Exists`, `NoSpace`, `Busy`, `Failed` (not committed:
    /// a copy that could not be made, or a slot that ended first), or `Unsupported` (the whole
    /// batch, for a holder without a shared path here or one that serves no batches).
    ///
    /// # Errors
    /// A bad key or an empty value, or [`KeyedError`]'s connection failures; whether the holder
    /// committed any value is then unknown (a PUT is never resent), and the holder is asked no
    /// batch for a while.
    pub fn put_shared_batch(
        &self,
        endpoint: &str,
        tier: u64,
        items: &[KeyedBatchPut<'_>],
    ) -> Result<Vec<KeyedPut>, KeyedError> {
        self.put_shared_batch_confirmed(endpoint, tier, items, &mut || vec![true; items.len()])
    }

    /// [`put_shared_batch`](Self::put_shared_batch) that commits only what `confirm` allows: once
    /// every value is copied in, and before the holder is told which to commit, `confirm` is asked
    /// (one flag per item, in order; a missing flag is `false`). A key it does not confirm has its
    /// slot aborted and is answered [`KeyedPut::Withdrawn`].
    ///
    /// This is how a writer copies while it still waits for a decision made elsewhere (the
    /// master's placement): `confirm` may block, though for less than the slot's life — a value
    /// confirmed after its slot's end is answered `Failed`. It is not asked when no key got a slot.
    ///
    /// # Errors
    /// As [`put_shared_batch`](Self::put_shared_batch).
    pub fn put_shared_batch_confirmed(
        &self,
        endpoint: &str,
        tier: u64,
        items: &[KeyedBatchPut<'_>],
        confirm: &mut dyn FnMut() -> Vec<bool>,
    ) -> Result<Vec<KeyedPut>, KeyedError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let bad = |message: String| KeyedError::Protocol { endpoint: endpoint.to_owned(), message };
        if items.len() > Self::MAX_BATCH_KEYS {
            return Err(bad(format!("a batch of {} keys (at most {})", items.len(), Self::MAX_BATCH_KEYS)));
        }
        for item in items {
            check_key(item.key)?;
            if item.value.is_empty() || item.value.len() as u64 > super::protocol::MAX_REQUEST_BYTES {
                return Err(bad(format!("a value of {} bytes for {}", item.value.len(), item.key)));
            }
        }
        if self.batchless(endpoint) || !self.shared.usable(endpoint) {
            return Ok(vec![KeyedPut::Unsupported; items.len()]);
        }
        let entries: Vec<PutEntry<'_>> =
            items.iter().map(|i| PutEntry { key: i.key, size: i.value.len() as u64, checksum: i.checksum }).collect();
        let body = batch_wire::encode_put_request(&entries);
        let answer = self.exchange(endpoint, false, |stream, id| {
            let reply = tracing::trace_span!(target: phases::TARGET, phases::PUT_KEYED_REPLY).entered();
            let head = Request {
                op: Op::PutKeys,
                flags: FLAG_SHARED,
                id,
                region: tier,
                offset: items.len() as u64,
                length: body.len() as u64,
            };
            send(stream, &head.encode(), &[&body])?;
            self.finish_put_batch(stream, endpoint, id, items, &mut *confirm, reply)
        });
        answer.inspect_err(|e| {
            tracing::debug!(peer = endpoint, error = %e, "PUT_KEYS failed; no batches to this holder for a while");
            self.batchless.lock().insert(endpoint.to_owned(), Instant::now() + BATCHLESS_FOR);
            if e.is_unreachable() {
                self.shared.forget(endpoint);
            }
        })
    }

    /// Reads a PUT_KEYS reply, copies every value into its slot, settles with the per-key flags
    /// and reads the holder's verdicts.
    fn finish_put_batch(
        &self,
        stream: &mut std::net::TcpStream,
        endpoint: &str,
        id: u64,
        items: &[KeyedBatchPut<'_>],
        confirm: &mut dyn FnMut() -> Vec<bool>,
        reply_span: tracing::span::EnteredSpan,
    ) -> Result<Vec<KeyedPut>, ExchangeError> {
        use std::io::Read as _;
        let mid = |source| ExchangeError::Io { source, before_reply: false };
        let reply = read_reply(stream, id)?;
        match reply.status {
            Status::Ok => {}
            Status::Unsupported if reply.length == 0 => return Ok(vec![KeyedPut::Unsupported; items.len()]),
            other => return Err(protocol_error(format!("unexpected PUT_KEYS status {}", other.as_str()))),
        }
        if reply.length > batch_wire::max_reply_body() {
            return Err(protocol_error(format!("a PUT_KEYS reply of {} bytes", reply.length)));
        }
        let mut body = vec![0u8; reply.length as usize];
        stream.read_exact(&mut body).map_err(mid)?;
        let answers = batch_wire::decode_reply(&body, items.len())
            .map_err(|e| protocol_error(format!("bad PUT_KEYS reply: {e}")))?;
        // Plan every slot's write, then fan the writes out (`fanout::write_values`): the chunk's
        // exchange is paid once while every core copies.
        let mut out = Vec::with_capacity(items.len());
        let mut indexes: Vec<usize> = Vec::new();
        let mut writes: Vec<fanout::ValueWrite<'_>> = Vec::new();
        // A slot is open for every mapped answer, written or not: the settle frame ends it.
        let mut slots = false;
        let mut copier = BatchCopier::new(&self.shared, endpoint);
        for (i, (item, answer)) in items.iter().zip(answers).enumerate() {
            out.push(match answer {
                BatchAnswer::Mapped(d) => {
                    slots = true;
                    if d.size != item.value.len() as u64 {
                        return Err(protocol_error(format!(
                            "a slot of {} bytes for a value of {}",
                            d.size,
                            item.value.len()
                        )));
                    }
                    match copier.get().and_then(|c| c.targets(&d.ranges)) {
                        Ok(targets) => {
                            let sum = item.checksum == PutChecksum::WhileCopying;
                            indexes.push(i);
                            writes.push(fanout::ValueWrite { src: item.value, targets, sum });
                            // Unless its write fails; the holder's verdict follows.
                            KeyedPut::Written
                        }
                        Err(error) => {
                            tracing::debug!(peer = endpoint, %error, key = item.key, "no mapping for the slot");
                            KeyedPut::Failed
                        }
                    }
                }
                BatchAnswer::Other(Status::Exists) => KeyedPut::Exists,
                BatchAnswer::Other(Status::NoSpace) => KeyedPut::NoSpace,
                BatchAnswer::Other(Status::Busy) => KeyedPut::Busy,
                BatchAnswer::Other(Status::Failed) => KeyedPut::Failed,
                BatchAnswer::Other(_) | BatchAnswer::TooSmall(_) => KeyedPut::Unsupported,
            });
        }
        let mut copied = vec![0u8; items.len()];
        // Summed while copied: one CRC-32C per key after the flags (see `batch_wire`).
        let late = items.iter().any(|i| i.checksum == PutChecksum::WhileCopying);
        let mut sums = vec![0u8; if late { items.len() * batch_wire::SETTLE_CRC_LEN } else { 0 }];
        drop(reply_span);
        let written = tracing::trace_span!(target: phases::TARGET, phases::PUT_KEYED_COPY)
            .in_scope(|| fanout::write_values(&writes));
        for ((i, write), result) in indexes.into_iter().zip(&writes).zip(written) {
            match result {
                Ok(sum) => {
                    copied[i] = 1;
                    copier.count_put(write.src.len() as u64);
                    if let Some(sum) = sum {
                        let at = i * batch_wire::SETTLE_CRC_LEN;
                        sums[at..at + batch_wire::SETTLE_CRC_LEN].copy_from_slice(&sum.to_le_bytes());
                    }
                }
                Err(error) => {
                    tracing::debug!(peer = endpoint, %error, key = items[i].key, "no copy into the mapping");
                    copier.failed(&error);
                    out[i] = KeyedPut::Failed;
                }
            }
        }
        if !slots {
            return Ok(out);
        }
        let confirmed = tracing::trace_span!(target: phases::TARGET, phases::PUT_KEYED_ROUTE_WAIT).in_scope(confirm);
        let _commit = tracing::trace_span!(target: phases::TARGET, phases::PUT_KEYED_COMMIT).entered();
        for (i, (flag, put)) in copied.iter_mut().zip(out.iter_mut()).enumerate() {
            if *flag == 1 && !confirmed.get(i).copied().unwrap_or(false) {
                // Copied but not to be kept: the holder aborts the slot.
                *flag = 0;
                *put = KeyedPut::Withdrawn;
            }
        }
        super::super::io::write_all_vectored(
            stream,
            &mut [
                std::io::IoSlice::new(&Settle::Done.encode()),
                std::io::IoSlice::new(&copied),
                std::io::IoSlice::new(&sums),
            ],
        )
        .map_err(mid)?;
        let verdict = read_reply(stream, id).map_err(|e| match e {
            ExchangeError::Io { source, .. } => mid(source),
            other => other,
        })?;
        if verdict.status != Status::Ok || verdict.length != items.len() as u64 {
            return Err(protocol_error(format!("a PUT_KEYS verdict of {} bytes", verdict.length)));
        }
        let mut statuses = vec![0u8; items.len()];
        stream.read_exact(&mut statuses).map_err(mid)?;
        for ((put, flag), status) in out.iter_mut().zip(&copied).zip(statuses) {
            if *flag == 1 && status != Status::Ok as u8 {
                *put = KeyedPut::Failed;
            }
        }
        Ok(out)
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

    /// Reads a GET_KEYS reply, copies every `MAPPED` value from the mappings and hands the answers
    /// to `answered` (taken once); whether leases are open (a settle frame is then owed). When the
    /// copies fan out, the answers are judged and handed over on the pool thread that ran them
    /// (`fanout::copy_values_then`): the caller's wait does not include this thread's wake-up.
    ///
    /// # Safety
    /// As [`get_shared_batch`](Self::get_shared_batch).
    #[expect(clippy::too_many_arguments)]
    unsafe fn read_batch_reply(
        &self,
        stream: &mut std::net::TcpStream,
        endpoint: &str,
        id: u64,
        items: &[KeyedBatchItem<'_>],
        sent: Instant,
        reply_span: tracing::span::EnteredSpan,
        answered: &mut Option<impl FnOnce(Vec<KeyedGet>) + Send>,
    ) -> Result<bool, ExchangeError> {
        use std::io::Read as _;
        let reply = read_reply(stream, id)?;
        match reply.status {
            Status::Ok => {}
            Status::Unsupported if reply.length == 0 => {
                if let Some(answered) = answered.take() {
                    answered(vec![KeyedGet::Unsupported; items.len()]);
                }
                return Ok(false);
            }
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
        let mut out: Vec<Option<KeyedGet>> = vec![None; items.len()];
        // The values to copy, beside each copy: (item index, its lease, its checksum, whether to
        // check it).
        let mut planned: Vec<(usize, u64, Option<u32>, bool)> = Vec::new();
        let mut copies: Vec<ValueCopy> = Vec::new();
        let mut copier = BatchCopier::new(&self.shared, endpoint);
        for (i, (item, answer)) in items.iter().zip(answers).enumerate() {
            out[i] = match answer {
                BatchAnswer::Mapped(d) => {
                    mapped = true;
                    if d.size > item.cap as u64 {
                        return Err(protocol_error(format!(
                            "a value of {} bytes for a destination of {}",
                            d.size, item.cap
                        )));
                    }
                    match copier.get().and_then(|c| c.pieces(&d.ranges)) {
                        Ok(pieces) => {
                            let check = item.verify && d.crc32c.is_some();
                            planned.push((i, d.lease_ns, d.crc32c, check));
                            copies.push(ValueCopy {
                                pieces,
                                dst: Dst::Range(item.dst),
                                sum: check,
                                streamed: item.stream,
                            });
                            None
                        }
                        Err(error) => {
                            tracing::debug!(peer = endpoint, %error, key = item.key, "no copy from the mapping");
                            Some(KeyedGet::Unsupported)
                        }
                    }
                }
                BatchAnswer::TooSmall(size) => Some(KeyedGet::TooSmall(size)),
                BatchAnswer::Other(Status::Miss) => Some(KeyedGet::Miss),
                BatchAnswer::Other(Status::Busy) => Some(KeyedGet::Busy),
                BatchAnswer::Other(_) => Some(KeyedGet::Unsupported),
            };
        }
        drop(reply_span);
        // The items' keys, for the log line of a failed copy (the items, holding raw destinations,
        // do not go to the pool thread).
        let keys: Vec<&str> = items.iter().map(|i| i.key).collect();
        let judge = move |copied: Vec<fanout::Copied>| {
            // Judged when the last copy ended, which is no earlier than any one's (see
            // `SharedReads`).
            let elapsed = sent.elapsed();
            for ((i, lease_ns, crc32c, check), copied) in planned.into_iter().zip(copied) {
                out[i] = Some(match copied {
                    fanout::Copied::Done { size, crc32c: got } if elapsed <= Duration::from_nanos(lease_ns) => {
                        copier.count_get(size);
                        match (crc32c.filter(|_| check), got) {
                            (Some(expected), Some(got)) if got != expected => KeyedGet::Corrupt { expected, got },
                            _ => KeyedGet::Hit { size, crc32c },
                        }
                    }
                    fanout::Copied::Done { .. } => KeyedGet::Lapsed,
                    fanout::Copied::Failed(error) => {
                        tracing::debug!(peer = endpoint, %error, key = keys[i], "no copy from the mapping");
                        copier.failed(&error);
                        KeyedGet::Unsupported
                    }
                });
            }
            // The batch's copies are counted (`shared_copies`) before its answers are out: a
            // caller that reads the counts once answered sees them.
            drop(copier);
            if let Some(answered) = answered.take() {
                answered(out.into_iter().map(|a| a.unwrap_or(KeyedGet::Unsupported)).collect());
            }
        };
        // SAFETY: each value's ranges add up to `d.size <= cap` bytes (checked by `decode` and
        // above), valid for writes at its `dst`, no two overlapping and ours alone during the call
        // (this function's contract); the destinations are not touched once `judge` has run.
        tracing::trace_span!(target: phases::TARGET, phases::GET_KEYED_COPY)
            .in_scope(|| unsafe { fanout::copy_values_then(&copies, judge) });
        Ok(mapped)
    }
}

/// A batch's [`Copier`], made at its first mapped answer: one connection check for the batch.
/// When it cannot be made, every mapped answer of the batch is refused alike.
struct BatchCopier<'r> {
    shared: &'r SharedReads,
    endpoint: &'r str,
    copier: Option<Result<Copier<'r>, ()>>,
}

impl<'r> BatchCopier<'r> {
    fn new(shared: &'r SharedReads, endpoint: &'r str) -> Self {
        Self { shared, endpoint, copier: None }
    }

    fn get(&mut self) -> Result<&mut Copier<'r>, ShmError> {
        let (shared, endpoint) = (self.shared, self.endpoint);
        let made = self.copier.get_or_insert_with(|| {
            shared.copier(endpoint).map_err(|error| {
                tracing::debug!(peer = endpoint, %error, "no shared-memory connection for the batch");
            })
        });
        made.as_mut().map_err(|()| ShmError::Invalid(format!("no shared-memory connection to {endpoint}")))
    }

    /// [`Copier::count_get`], on the batch's copier (made at the value's `pieces`).
    fn count_get(&mut self, bytes: u64) {
        if let Some(Ok(copier)) = &mut self.copier {
            copier.count_get(bytes);
        }
    }

    /// [`Copier::count_put`], likewise (made at the value's `targets`).
    fn count_put(&mut self, bytes: u64) {
        if let Some(Ok(copier)) = &mut self.copier {
            copier.count_put(bytes);
        }
    }

    /// [`Copier::failed`], likewise.
    fn failed(&mut self, error: &ShmError) {
        if let Some(Ok(copier)) = &mut self.copier {
            copier.failed(error);
        }
    }
}
