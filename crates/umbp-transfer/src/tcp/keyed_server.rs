//! The data server's side of keyed requests (GET_KEY, PUT_KEY): see [`keyed`](super::super::keyed)
//! for what they are and the rules kept, [`protocol`](super::protocol) for the bytes.

use std::io::IoSlice;
use std::sync::Arc;
use std::time::Instant;

use super::super::batch_wire::{self, BatchAnswer, PutChecksum};
use super::super::keyed::{ClosingSlot, KeyedHandler, KeyedLease, KeyedRange, KeyedRead, KeyedSlot, KeyedWrite};
use super::super::protocol::{
    CHECKSUM_LEN, Descriptor, FLAG_CHECKSUM, FLAG_SHARED, FrameError, MAX_KEY_LEN, MAX_REQUEST_BYTES,
    MAX_SHARED_RANGES, Reply, Request, SETTLE_LEN, Settle, Status, Trailer,
};
use super::{End, RegionGuard, ServerConn, bump, write_all_vectored_until};

/// A keyed read's lease, closed when dropped (sent, failed, or the connection broke).
struct OpenRead<'h> {
    handler: &'h dyn KeyedHandler,
    key: &'h str,
    lease: KeyedLease,
}

impl Drop for OpenRead<'_> {
    fn drop(&mut self) {
        self.handler.close_read(self.key, self.lease);
    }
}

/// A keyed write's slot, aborted when dropped unless committed.
struct OpenWrite<'h> {
    handler: &'h dyn KeyedHandler,
    key: &'h str,
    slot: KeyedSlot,
    settled: bool,
    /// The writer's checksum of the value, committed with it.
    crc32c: Option<u32>,
}

impl OpenWrite<'_> {
    /// Commits the slot if the value arrived before the slot's end; whether it was committed.
    fn commit(mut self) -> bool {
        self.settled = true;
        let received = Instant::now() <= self.slot.until;
        self.handler.close_write(self.key, self.slot, received, self.crc32c) && received
    }
}

impl Drop for OpenWrite<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.handler.close_write(self.key, self.slot, false, None);
        }
    }
}

/// A batch's open read leases, closed together when dropped (the client settled, or the
/// connection broke).
struct OpenReads<'h> {
    handler: &'h dyn KeyedHandler,
    reads: Vec<(&'h str, KeyedLease)>,
}

impl Drop for OpenReads<'_> {
    fn drop(&mut self) {
        if !self.reads.is_empty() {
            self.handler.close_reads(&self.reads);
        }
    }
}

/// A batch's open write slots (`None`: a key answered otherwise), aborted together when dropped
/// unless [`commit`](OpenWrites::commit) settled them.
struct OpenWrites<'h> {
    handler: &'h dyn KeyedHandler,
    /// `(key, slot, the writer's checksum)`.
    slots: Vec<Option<(&'h str, KeyedSlot, Option<u32>)>>,
}

impl OpenWrites<'_> {
    /// Commits each slot whose flag is 1, if the value arrived before the slot's end, and aborts
    /// the rest, in one call of the handler; a status per key. A flag other than 0 or 1 is a
    /// malformed settle (every slot is then aborted by the drop).
    fn commit(mut self, flags: &[u8]) -> Result<Vec<u8>, FrameError> {
        if let Some(bad) = flags.iter().zip(&self.slots).find(|(f, s)| s.is_some() && **f > 1) {
            return Err(FrameError::BadStatus(*bad.0));
        }
        let now = Instant::now();
        let slots = std::mem::take(&mut self.slots);
        let closing: Vec<ClosingSlot<'_>> = slots
            .iter()
            .zip(flags)
            .filter_map(|(s, flag)| {
                s.map(|(key, slot, crc32c)| ClosingSlot {
                    key,
                    slot,
                    received: *flag == 1 && now <= slot.until,
                    crc32c,
                })
            })
            .collect();
        let mut committed = self.handler.close_writes(&closing).into_iter().zip(&closing);
        let statuses = slots
            .iter()
            .map(|s| match s {
                Some(_) => match committed.next() {
                    Some((true, c)) if c.received => Status::Ok as u8,
                    _ => Status::Failed as u8,
                },
                None => Status::Failed as u8,
            })
            .collect();
        Ok(statuses)
    }
}

impl Drop for OpenWrites<'_> {
    fn drop(&mut self) {
        let aborts: Vec<ClosingSlot<'_>> = self
            .slots
            .iter()
            .flatten()
            .map(|&(key, slot, _)| ClosingSlot { key, slot, received: false, crc32c: None })
            .collect();
        if !aborts.is_empty() {
            self.handler.close_writes(&aborts);
        }
    }
}

/// `r` inside `guard`'s region, as host memory of this server: `None` for a region in device
/// memory or a range past its end. The one test [`ServerConn::guard_ranges`] and
/// [`ServerConn::ranges_ok`] apply to every range.
fn host_range(guard: &RegionGuard, r: &KeyedRange) -> Option<(*mut u8, usize)> {
    if !guard.region().location().is_host() {
        return None;
    }
    guard.range(r.offset, r.len).ok()
}

impl ServerConn<'_> {
    fn keyed_handler(&self) -> Option<Arc<dyn KeyedHandler>> {
        self.shared.keyed.read().clone()
    }

    /// Whether every range of a batch's answer is a live host range of this server and the lengths
    /// add up to `size` ([`guard_ranges`](Self::guard_ranges)'s test, without keeping the guards).
    /// `held` keeps one guard per region the batch has checked so far, for the batch's loop: a
    /// batch's values mostly lie in one region, and acquiring a guard takes and gives back the
    /// region's shared count, so per key — with a batch's two connections on two threads — that
    /// cache line bounced between cores (20–35 µs for 32 keys on the 16-core host).
    fn ranges_ok(&self, held: &mut Vec<(u64, RegionGuard)>, ranges: &[KeyedRange], size: u64) -> bool {
        let mut total = 0u64;
        for r in ranges {
            let at = match held.iter().position(|(id, _)| *id == r.region_id) {
                Some(at) => at,
                None => {
                    let Some(guard) = self.shared.regions.acquire_remote(r.region_id) else { return false };
                    held.push((r.region_id, guard));
                    held.len() - 1
                }
            };
            let Some(sum) = host_range(&held[at].1, r).and_then(|_| total.checked_add(r.len)) else { return false };
            total = sum;
        }
        total == size
    }

    /// Guards every range of a handler's answer and turns it into host memory: `None` when one is
    /// not a live host range of this server or the lengths do not add up to `size` (a handler bug,
    /// or a region deregistered meanwhile).
    fn guard_ranges(&self, ranges: &[KeyedRange], size: u64) -> Option<Vec<(RegionGuard, *mut u8, usize)>> {
        let mut out = Vec::with_capacity(ranges.len());
        let mut total = 0u64;
        for r in ranges {
            let guard = self.shared.regions.acquire_remote(r.region_id)?;
            let (ptr, len) = host_range(&guard, r)?;
            total = total.checked_add(r.len)?;
            out.push((guard, ptr, len));
        }
        (total == size).then_some(out)
    }

    /// GET_KEY: resolve, send the value with its trailer, close the lease.
    pub(super) fn get_key(&mut self, r: Request) -> Result<(), End> {
        if r.length > MAX_KEY_LEN {
            return Err(End::Malformed(FrameError::TooLong(r.length)));
        }
        let mut key = vec![0u8; r.length as usize];
        self.reader.read_exact_into(&mut key)?;
        // This reply is written now, not queued: everything queued goes out first, in order.
        self.flush()?;
        let status = self.serve_get_key(&r, &key)?;
        bump(&self.shared.metrics.requests[status as usize]);
        Ok(())
    }

    fn serve_get_key(&mut self, r: &Request, key: &[u8]) -> Result<Status, End> {
        // Before the resolve: a `MAPPED` answer states the lease from here, so the client's bound
        // (from before it sent the request) is never later than the lease's end.
        let received = Instant::now();
        let answer = |status: Status, length: u64| Reply { status, id: r.id, length }.encode();
        let handler = self.keyed_handler();
        let shared = r.flags == FLAG_SHARED;
        let (key, handler) = match (std::str::from_utf8(key), handler) {
            (Ok(key), Some(handler)) if (r.flags == 0 || shared) && r.region == 0 => (key, handler),
            (_, None) => return self.send_alone(&answer(Status::Unsupported, 0)).map(|()| Status::Unsupported),
            _ => return self.send_alone(&answer(Status::BadRequest, 0)).map(|()| Status::BadRequest),
        };
        let (size, ranges, lease, crc32c) = match handler.open_read(key) {
            KeyedRead::Hit { size, ranges, lease, crc32c } => (size, ranges, lease, crc32c),
            other => {
                let status = match other {
                    KeyedRead::Miss => Status::Miss,
                    KeyedRead::Busy => Status::Busy,
                    _ => Status::Unsupported,
                };
                return self.send_alone(&answer(status, 0)).map(|()| status);
            }
        };
        let open = OpenRead { handler: handler.as_ref(), key, lease };
        if size > r.offset {
            drop(open);
            return self.send_alone(&answer(Status::TooSmall, size)).map(|()| Status::TooSmall);
        }
        let Some(guarded) = self.guard_ranges(&ranges, size) else {
            drop(open);
            return self.send_alone(&answer(Status::Unsupported, 0)).map(|()| Status::Unsupported);
        };
        let lease_ns = u64::try_from(lease.until.saturating_duration_since(received).as_nanos()).unwrap_or(u64::MAX);
        if shared && lease_ns > 0 && !ranges.is_empty() && ranges.len() <= MAX_SHARED_RANGES {
            // The client copies from its own mappings: the regions' epochs (not our guards) tell it
            // when one goes away, so nothing here blocks a deregistration while it copies.
            drop(guarded);
            let descriptor = Descriptor {
                size,
                lease_ns,
                ranges: ranges.iter().map(|r| (r.region_id, r.offset, r.len)).collect(),
                crc32c,
            }
            .encode();
            let head = answer(Status::Mapped, descriptor.len() as u64);
            let deadline = Instant::now() + self.shared.config.io_timeout;
            write_all_vectored_until(
                &mut self.writer,
                &mut [IoSlice::new(&head), IoSlice::new(&descriptor)],
                deadline,
                &mut self.write_clock,
            )?;
            // The lease stays open until the client settles (or the connection ends: `open` closes
            // it on every path).
            self.reader.set_deadline(Some(Instant::now() + self.shared.config.io_timeout));
            let mut settle = [0u8; SETTLE_LEN];
            self.reader.read_exact_into(&mut settle)?;
            match Settle::decode(&settle).map_err(End::Malformed)? {
                Settle::Done => {
                    drop(open);
                    return Ok(Status::Mapped);
                }
                Settle::SendBytes => {}
            }
            let Some(guarded) = self.guard_ranges(&ranges, size) else {
                drop(open);
                return self.send_alone(&answer(Status::Unsupported, 0)).map(|()| Status::Unsupported);
            };
            return self.send_value(r.id, size, guarded, open, crc32c);
        }
        self.send_value(r.id, size, guarded, open, crc32c)
    }

    /// GET_KEYS: resolve every key, answer each with a `MAPPED` descriptor (or why not) in one
    /// reply, and keep the leases open until the client's settle frame (see
    /// [`batch_wire`](super::super::batch_wire)). Only a client that can map this server's regions
    /// asks it; a server with no keyed handler answers `UNSUPPORTED` for the whole request.
    pub(super) fn get_keys(&mut self, r: Request) -> Result<(), End> {
        if r.region != 0 {
            return Err(End::Malformed(FrameError::TooLong(r.region)));
        }
        let body = self.batch_body(&r, batch_wire::max_request_body())?;
        let entries = batch_wire::decode_request(&body, r.offset).map_err(End::Malformed)?;
        let Some(handler) = self.batch_handler(r.id)? else { return Ok(()) };
        // Before the first resolve: each descriptor states its lease from here, so the client's
        // bound (from before it sent the request) is never later than a lease's end.
        let received = Instant::now();
        let keys: Vec<&str> = entries.iter().map(|e| e.key).collect();
        let found = handler.open_reads(&keys);
        // The leases kept until the client settles, and those given up at once (a value the
        // client cannot take through its mappings).
        let mut open = OpenReads { handler: handler.as_ref(), reads: Vec::new() };
        let mut closing = OpenReads { handler: handler.as_ref(), reads: Vec::new() };
        let mut reply = Vec::with_capacity(batch_wire::reply_capacity(entries.len()));
        // The regions checked so far, one guard each, until the reply is encoded (`ranges_ok`).
        let mut held = Vec::with_capacity(1);
        for (e, read) in entries.iter().zip(found) {
            let refused = match read {
                KeyedRead::Hit { size, ranges, lease, crc32c } => {
                    let lease_ns =
                        u64::try_from(lease.until.saturating_duration_since(received).as_nanos()).unwrap_or(u64::MAX);
                    if size > e.cap {
                        closing.reads.push((e.key, lease));
                        BatchAnswer::TooSmall(size)
                    } else if lease_ns == 0
                        || ranges.is_empty()
                        || ranges.len() > MAX_SHARED_RANGES
                        || !self.ranges_ok(&mut held, &ranges, size)
                    {
                        // Not host memory of this server (device memory, a region going away), or
                        // a lease already over: the routed path serves it.
                        closing.reads.push((e.key, lease));
                        BatchAnswer::Other(Status::Unsupported)
                    } else {
                        open.reads.push((e.key, lease));
                        // Encoded from the ranges as they are: no descriptor built per key.
                        let ranges = ranges.iter().map(|r| (r.region_id, r.offset, r.len));
                        batch_wire::encode_mapped(&mut reply, size, lease_ns, crc32c, ranges);
                        continue;
                    }
                }
                KeyedRead::Miss => BatchAnswer::Other(Status::Miss),
                KeyedRead::Busy => BatchAnswer::Other(Status::Busy),
                _ => BatchAnswer::Other(Status::Unsupported),
            };
            batch_wire::encode_answer(&mut reply, &refused);
        }
        drop((closing, held));
        self.send_ok_with(r.id, &reply)?;
        bump(&self.shared.metrics.requests[Status::Mapped as usize]);
        if open.reads.is_empty() {
            return Ok(());
        }
        // The leases stay open until the client settles (or the connection ends: dropping `open`
        // closes them on every path).
        self.read_done_settle()
    }

    /// PUT_KEYS: allocate a slot per key, answer each with a `MAPPED` descriptor of its slot (or
    /// why not) in one reply, then take the client's settle frame and per-key flags, commit each
    /// slot it copied if the settle arrived before the slot's end (every byte the client wrote was
    /// written before it sent the settle, so this server's clock alone judges it), abort the rest,
    /// and answer one status byte per key (see [`batch_wire`](super::super::batch_wire)).
    pub(super) fn put_keys(&mut self, r: Request) -> Result<(), End> {
        let body = self.batch_body(&r, batch_wire::max_put_request_body())?;
        let entries = batch_wire::decode_put_request(&body, r.offset).map_err(End::Malformed)?;
        let Some(handler) = self.batch_handler(r.id)? else { return Ok(()) };
        let received = Instant::now();
        let writes: Vec<(&str, u64)> = entries.iter().map(|e| (e.key, e.size)).collect();
        let got = handler.open_writes(&writes, r.region);
        // One slot per key that got one (`None`: answered otherwise); slots refused here are
        // aborted together before the reply leaves.
        let mut open = OpenWrites { handler: handler.as_ref(), slots: Vec::with_capacity(entries.len()) };
        let mut refused = OpenWrites { handler: handler.as_ref(), slots: Vec::new() };
        let mut reply = Vec::with_capacity(batch_wire::reply_capacity(entries.len()));
        // The regions checked so far, one guard each, until the reply is encoded (`ranges_ok`).
        let mut held = Vec::with_capacity(1);
        for (e, write) in entries.iter().zip(got) {
            let (refusal, slot) = match write {
                KeyedWrite::Slot { ranges, slot } => {
                    let slot_ns =
                        u64::try_from(slot.until.saturating_duration_since(received).as_nanos()).unwrap_or(u64::MAX);
                    if slot_ns == 0
                        || ranges.is_empty()
                        || ranges.len() > MAX_SHARED_RANGES
                        || !self.ranges_ok(&mut held, &ranges, e.size)
                    {
                        refused.slots.push(Some((e.key, slot, None)));
                        (Some(Status::Unsupported), None)
                    } else {
                        // Encoded from the slot's ranges as they are: no descriptor built per key.
                        let pieces = ranges.iter().map(|r| (r.region_id, r.offset, r.len));
                        batch_wire::encode_mapped(&mut reply, e.size, slot_ns, None, pieces);
                        let crc32c = match e.checksum {
                            PutChecksum::Given(crc) => Some(crc),
                            // Set from the settle, below.
                            PutChecksum::None | PutChecksum::WhileCopying => None,
                        };
                        (None, Some((e.key, slot, crc32c)))
                    }
                }
                KeyedWrite::Exists => (Some(Status::Exists), None),
                KeyedWrite::NoSpace => (Some(Status::NoSpace), None),
                KeyedWrite::Busy => (Some(Status::Busy), None),
                KeyedWrite::Failed => (Some(Status::Failed), None),
                KeyedWrite::Unsupported => (Some(Status::Unsupported), None),
            };
            if let Some(status) = refusal {
                batch_wire::encode_answer(&mut reply, &BatchAnswer::Other(status));
            }
            open.slots.push(slot);
        }
        drop((refused, held));
        self.send_ok_with(r.id, &reply)?;
        if open.slots.iter().all(Option::is_none) {
            bump(&self.shared.metrics.requests[Status::Mapped as usize]);
            return Ok(());
        }
        // Every slot stays open until the client settles (or the connection ends: dropping `open`
        // aborts them on every path).
        self.read_done_settle()?;
        let mut copied = vec![0u8; entries.len()];
        self.reader.read_exact_into(&mut copied)?;
        if entries.iter().any(|e| e.checksum == PutChecksum::WhileCopying) {
            let mut sums = vec![0u8; entries.len() * batch_wire::SETTLE_CRC_LEN];
            self.reader.read_exact_into(&mut sums)?;
            let sums = sums.chunks_exact(batch_wire::SETTLE_CRC_LEN);
            for ((e, slot), sum) in entries.iter().zip(open.slots.iter_mut()).zip(sums) {
                if let (PutChecksum::WhileCopying, Some((_, _, crc32c))) = (e.checksum, slot) {
                    let mut le = [0u8; batch_wire::SETTLE_CRC_LEN];
                    le.copy_from_slice(sum);
                    *crc32c = Some(u32::from_le_bytes(le));
                }
            }
        }
        let statuses = open.commit(&copied).map_err(End::Malformed)?;
        self.send_ok_with(r.id, &statuses)?;
        bump(&self.shared.metrics.requests[Status::Mapped as usize]);
        Ok(())
    }

    /// A GET_KEYS or PUT_KEYS request's body (at most `max` bytes; `flags` must be [`FLAG_SHARED`]).
    fn batch_body(&mut self, r: &Request, max: u64) -> Result<Vec<u8>, End> {
        if r.length > max || r.flags != FLAG_SHARED {
            return Err(End::Malformed(FrameError::TooLong(r.length)));
        }
        let mut body = vec![0u8; r.length as usize];
        self.reader.read_exact_into(&mut body)?;
        Ok(body)
    }

    /// The keyed handler for a batch, after everything queued went out (a batch's replies are
    /// written now, in order); without one, the whole request is answered `UNSUPPORTED`: `None`.
    fn batch_handler(&mut self, id: u64) -> Result<Option<Arc<dyn KeyedHandler>>, End> {
        self.flush()?;
        let handler = self.keyed_handler();
        if handler.is_none() {
            self.send_alone(&Reply { status: Status::Unsupported, id, length: 0 }.encode())?;
            bump(&self.shared.metrics.requests[Status::Unsupported as usize]);
        }
        Ok(handler)
    }

    /// Writes an `OK` reply carrying `payload`, within one IO timeout.
    fn send_ok_with(&mut self, id: u64, payload: &[u8]) -> Result<(), End> {
        let head = Reply { status: Status::Ok, id, length: payload.len() as u64 }.encode();
        let deadline = Instant::now() + self.shared.config.io_timeout;
        write_all_vectored_until(
            &mut self.writer,
            &mut [IoSlice::new(&head), IoSlice::new(payload)],
            deadline,
            &mut self.write_clock,
        )?;
        Ok(())
    }

    /// Waits (within one IO timeout) for a batch's settle frame, which must be `Done`: a batch is
    /// never served as bytes (the client reads what it cannot map the routed way).
    fn read_done_settle(&mut self) -> Result<(), End> {
        self.reader.set_deadline(Some(Instant::now() + self.shared.config.io_timeout));
        let mut settle = [0u8; SETTLE_LEN];
        self.reader.read_exact_into(&mut settle)?;
        match Settle::decode(&settle).map_err(End::Malformed)? {
            Settle::Done => Ok(()),
            Settle::SendBytes => Err(End::Malformed(FrameError::BadStatus(Settle::SendBytes as u8))),
        }
    }

    /// Sends a keyed read's value from `guarded` with its trailer (judging `open`'s lease when the
    /// last byte left region memory), then closes the lease.
    fn send_value(
        &mut self,
        id: u64,
        size: u64,
        guarded: Vec<(RegionGuard, *mut u8, usize)>,
        open: OpenRead<'_>,
        crc32c: Option<u32>,
    ) -> Result<Status, End> {
        let head = Reply { status: Status::Ok, id, length: size }.encode();
        let mut slices = Vec::with_capacity(guarded.len() + 1);
        slices.push(IoSlice::new(&head));
        for (_, ptr, len) in &guarded {
            // SAFETY: `ptr..ptr + len` lies inside a host region of this server (bounds-checked by
            // `RegionGuard::range` in `guard_ranges`), which stays registered — so valid, per
            // `LocalRegion`'s invariant — while its guard in `guarded` lives, i.e. past this write.
            // The medium's read lease (`open`) keeps the pages the key's while it holds; a send that
            // outlives it is reported lapsed below. The slice is only read (by the kernel's `send`).
            slices.push(IoSlice::new(unsafe { std::slice::from_raw_parts(ptr.cast_const(), *len) }));
        }
        let deadline = Instant::now() + self.shared.config.io_timeout;
        write_all_vectored_until(&mut self.writer, &mut slices, deadline, &mut self.write_clock)?;
        // Every byte left region memory (it is in the kernel's buffer now): judge the lease, then
        // give it back before the trailer leaves.
        let trailer = if Instant::now() <= open.lease.until { Trailer::Intact } else { Trailer::Lapsed };
        drop(slices);
        drop(guarded);
        drop(open);
        self.send_alone(&trailer.encode(crc32c))?;
        Ok(if trailer == Trailer::Intact { Status::Ok } else { Status::Failed })
    }

    /// Writes `bytes` now, within one IO timeout.
    fn send_alone(&mut self, bytes: &[u8]) -> Result<(), End> {
        let deadline = Instant::now() + self.shared.config.io_timeout;
        write_all_vectored_until(&mut self.writer, &mut [IoSlice::new(bytes)], deadline, &mut self.write_clock)
            .map_err(End::Io)
    }

    /// PUT_KEY: allocate, receive the value into the slot, commit (or abort); the reply is queued
    /// like a WRITE's.
    pub(super) fn put_key(&mut self, r: Request) -> Result<(), End> {
        let key_len = r.offset;
        if key_len > MAX_KEY_LEN || key_len > r.length {
            return Err(End::Malformed(FrameError::TooLong(key_len)));
        }
        let mut key = vec![0u8; key_len as usize];
        self.reader.read_exact_into(&mut key)?;
        let mut rest = r.length - key_len;
        let crc32c = if r.flags & FLAG_CHECKSUM != 0 {
            if rest < CHECKSUM_LEN {
                return Err(End::Malformed(FrameError::TooLong(r.length)));
            }
            let mut crc = [0u8; CHECKSUM_LEN as usize];
            self.reader.read_exact_into(&mut crc)?;
            rest -= CHECKSUM_LEN;
            Some(u32::from_le_bytes(crc))
        } else {
            None
        };
        if r.flags & !FLAG_CHECKSUM == FLAG_SHARED && rest == 8 {
            return self.put_key_shared(&r, &key, crc32c);
        }
        let size = rest;
        let status = self.serve_put_key(&r, &key, size, crc32c)?;
        self.replies.payload_bytes += usize::try_from(size).unwrap_or(usize::MAX);
        self.queue(Reply { status, id: r.id, length: 0 }, None);
        bump(&self.shared.metrics.requests[status as usize]);
        Ok(())
    }

    fn serve_put_key(&mut self, r: &Request, key: &[u8], size: u64, crc32c: Option<u32>) -> Result<Status, End> {
        let handler = self.keyed_handler();
        let (key, handler) = match (std::str::from_utf8(key), handler) {
            (Ok(key), Some(handler)) if r.flags & !FLAG_CHECKSUM == 0 && !key.is_empty() => (key, handler),
            (_, None) => return self.discard(size).map(|()| Status::Unsupported),
            _ => return self.discard(size).map(|()| Status::BadRequest),
        };
        let (ranges, slot) = match handler.open_write(key, r.region, size) {
            KeyedWrite::Slot { ranges, slot } => (ranges, slot),
            other => {
                let status = match other {
                    KeyedWrite::Exists => Status::Exists,
                    KeyedWrite::NoSpace => Status::NoSpace,
                    KeyedWrite::Busy => Status::Busy,
                    KeyedWrite::Failed => Status::Failed,
                    _ => Status::Unsupported,
                };
                return self.discard(size).map(|()| status);
            }
        };
        let open = OpenWrite { handler: handler.as_ref(), key, slot, settled: false, crc32c };
        let Some(guarded) = self.guard_ranges(&ranges, size) else {
            drop(open);
            return self.discard(size).map(|()| Status::Unsupported);
        };
        for (_, ptr, len) in &guarded {
            // SAFETY: `ptr..ptr + len` lies inside a host region of this server (bounds-checked by
            // `RegionGuard::range`), kept registered (so valid) by its guard in `guarded` until after
            // this read; the slot's pages are this request's alone until it commits or aborts (the
            // medium hands a slot to one writer). Only handed to the kernel's `recv`. A broken
            // connection returns early: `open` aborts the slot.
            let dst = unsafe { std::slice::from_raw_parts_mut(*ptr, *len) };
            self.reader.read_exact_into(dst)?;
        }
        drop(guarded);
        Ok(if open.commit() { Status::Ok } else { Status::Failed })
    }

    /// PUT_KEY with [`FLAG_SHARED`]: the value's size follows the key (8 bytes), the value does not;
    /// the answer is written now (the client waits for it before it copies).
    fn put_key_shared(&mut self, r: &Request, key: &[u8], crc32c: Option<u32>) -> Result<(), End> {
        let mut size = [0u8; 8];
        self.reader.read_exact_into(&mut size)?;
        let size = u64::from_le_bytes(size);
        if size > MAX_REQUEST_BYTES {
            return Err(End::Malformed(FrameError::TooLong(size)));
        }
        // Everything queued goes out first, in order.
        self.flush()?;
        let status = self.serve_put_key_shared(r, key, size, crc32c)?;
        self.send_alone(&Reply { status, id: r.id, length: 0 }.encode())?;
        bump(&self.shared.metrics.requests[status as usize]);
        Ok(())
    }

    /// Allocates, answers `MAPPED` with the slot's ranges and how long the slot lasts, and waits for
    /// the client's settle: `Done` (it copied into its mappings) commits the slot if the settle
    /// arrived before the slot's end — every byte the client wrote was written before it sent the
    /// settle, so this server's clock alone judges it; `SendBytes` receives the value the TCP way.
    /// Any other end aborts the slot (`OpenWrite`'s drop).
    fn serve_put_key_shared(&mut self, r: &Request, key: &[u8], size: u64, crc32c: Option<u32>) -> Result<Status, End> {
        let received = Instant::now();
        let handler = self.keyed_handler();
        let (key, handler) = match (std::str::from_utf8(key), handler) {
            (Ok(key), Some(handler)) if !key.is_empty() => (key, handler),
            (_, None) => return Ok(Status::Unsupported),
            _ => return Ok(Status::BadRequest),
        };
        let (ranges, slot) = match handler.open_write(key, r.region, size) {
            KeyedWrite::Slot { ranges, slot } => (ranges, slot),
            KeyedWrite::Exists => return Ok(Status::Exists),
            KeyedWrite::NoSpace => return Ok(Status::NoSpace),
            KeyedWrite::Busy => return Ok(Status::Busy),
            KeyedWrite::Failed => return Ok(Status::Failed),
            KeyedWrite::Unsupported => return Ok(Status::Unsupported),
        };
        let open = OpenWrite { handler: handler.as_ref(), key, slot, settled: false, crc32c };
        let slot_ns = u64::try_from(slot.until.saturating_duration_since(received).as_nanos()).unwrap_or(u64::MAX);
        if self.guard_ranges(&ranges, size).is_none()
            || ranges.is_empty()
            || ranges.len() > MAX_SHARED_RANGES
            || slot_ns == 0
        {
            drop(open);
            return Ok(Status::Unsupported);
        }
        let descriptor = Descriptor {
            size,
            lease_ns: slot_ns,
            ranges: ranges.iter().map(|r| (r.region_id, r.offset, r.len)).collect(),
            crc32c: None,
        }
        .encode();
        let head = Reply { status: Status::Mapped, id: r.id, length: descriptor.len() as u64 }.encode();
        let deadline = Instant::now() + self.shared.config.io_timeout;
        write_all_vectored_until(
            &mut self.writer,
            &mut [IoSlice::new(&head), IoSlice::new(&descriptor)],
            deadline,
            &mut self.write_clock,
        )?;
        self.reader.set_deadline(Some(Instant::now() + self.shared.config.io_timeout));
        let mut settle = [0u8; SETTLE_LEN];
        self.reader.read_exact_into(&mut settle)?;
        match Settle::decode(&settle).map_err(End::Malformed)? {
            Settle::Done => Ok(if open.commit() { Status::Ok } else { Status::Failed }),
            Settle::SendBytes => {
                let Some(guarded) = self.guard_ranges(&ranges, size) else {
                    drop(open);
                    return self.discard(size).map(|()| Status::Unsupported);
                };
                for (_, ptr, len) in &guarded {
                    // SAFETY: as in `serve_put_key`: inside a host region of this server kept
                    // registered by its guard, the slot's pages this request's alone until it
                    // commits or aborts; only handed to the kernel's `recv`.
                    let dst = unsafe { std::slice::from_raw_parts_mut(*ptr, *len) };
                    self.reader.read_exact_into(dst)?;
                }
                drop(guarded);
                Ok(if open.commit() { Status::Ok } else { Status::Failed })
            }
        }
    }
}
