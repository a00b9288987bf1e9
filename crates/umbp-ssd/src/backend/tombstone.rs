//! Tombstones of the SSD medium: an eviction is logged as a small record, so a restart does not
//! bring the key back; a tombstone stays in force while a segment that may hold an older record
//! of its key exists (retired by [`State::retire_tombstones`]).

use super::write::shared_with_others;
use super::*;

impl Inner {
    /// Writes the queued tombstones (one small record each, in one engine batch) and puts them in
    /// force. A tombstone lost to a failed write or a crash only lets its key come back after a
    /// restart, with bytes that still pass their CRC.
    pub(super) fn flush_tombstones(&self) {
        let Some(engine) = self.engine() else { return };
        let (mut batch, generation) = {
            let mut state = self.state.lock();
            let pending = state.take_tomb_pending();
            if pending.is_empty() {
                return;
            }
            let generation = state.generation();
            let mut own_writes = Vec::new();
            let batch: Vec<(String, u64, u64, crate::store::Reservation, bool)> = pending
                .into_iter()
                .map(|(key, seq, horizon)| {
                    let res = state.log_mut().reserve(record_len(key.len(), 8));
                    let shared = shared_with_others(&res, &mut own_writes);
                    (key, seq, horizon, res, shared)
                })
                .collect();
            (batch, generation)
        };
        let mut bufs = Vec::with_capacity(batch.len());
        let mut ops = Vec::with_capacity(batch.len());
        let mut op_of = Vec::with_capacity(batch.len());
        for (key, seq, horizon, res, shared) in &batch {
            if *shared {
                res.file.size_for_shared_writes();
            }
            let hl = header_len(key.len()) as usize;
            let Ok(mut buf) = AlignedBuf::zeroed(res.loc.len as usize) else {
                op_of.push(None);
                continue;
            };
            let value = horizon.to_le_bytes();
            buf.as_mut_slice()[hl..hl + 8].copy_from_slice(&value);
            let crc = record::data_crc(key.as_bytes(), &value);
            record::encode_header_flags(&mut buf.as_mut_slice()[..hl], key, 8, *seq, crc, record::FLAG_TOMBSTONE, 0);
            match res.file.file() {
                Ok(f) => {
                    let (ptr, len) = (buf.as_mut_ptr(), buf.len());
                    // SAFETY: `buf` is kept in `bufs` until after the submit; `f` stays open
                    // through `res.file`.
                    ops.push(unsafe { IoOp::new(f, res.loc.offset, &[(ptr, len)], true) });
                    op_of.push(Some(ops.len() - 1));
                }
                Err(_) => op_of.push(None),
            }
            bufs.push(buf);
        }
        engine.submit(&mut ops);
        let mut state = self.state.lock();
        for ((key, seq, horizon, res, _), o) in batch.drain(..).zip(op_of) {
            state.log_mut().finish_write(res.loc.seg);
            let ok = o.is_some_and(|i| ops[i].result.is_ok());
            if !ok {
                state.log_mut().seal(res.loc.seg);
                tracing::warn!(key = %key, "could not log an eviction; the key may come back after a restart");
                continue;
            }
            state.land_tombstone(key, Loc { seq, ..res.loc }, horizon, generation, self.config.clock.now());
        }
        drop(bufs);
    }
}
