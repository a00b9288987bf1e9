//! [`KeyedMedia`]: the node's answer to keyed requests on its data server (a get or a put in one
//! exchange, see `umbp_transfer`'s `keyed` module): the same media, slot rules and change hook as
//! the gRPC service, without the gRPC round trips.
//!
//! A keyed read resolves the key on the first medium that holds it (ascending tier, as
//! `BatchResolveKeys`), under the medium's read lease; the data server sends the pages and closes
//! the lease, and marks the send lapsed when it ended after `read_lease` from before the resolve.
//! A keyed write allocates on the medium of the request's tier; the data server receives the value
//! into the slot's pages and closes the slot: committed (the change hook then wakes the heartbeat,
//! as a gRPC commit does) when the value arrived before the slot's pending TTL minus a margin,
//! aborted otherwise.

use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{AllocateOutcome, AllocateRequest, CommitRequest, MediumBackend, PageLocation, ReadRelease, TierType};
use umbp_transfer::{ClosingSlot, KeyedHandler, KeyedLease, KeyedRange, KeyedRead, KeyedSlot, KeyedWrite};

use super::service::PeerService;
use crate::pool_client::slot_deadline;

/// One medium as keyed requests see it.
struct Medium {
    id: u32,
    tier: TierType,
    backend: Arc<dyn MediumBackend>,
}

/// Serves keyed requests from the node's media (see the module docs).
pub struct KeyedMedia {
    media: Vec<Medium>,
    service: PeerService,
    read_lease: Duration,
    pending_ttl: Duration,
}

impl std::fmt::Debug for KeyedMedia {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedMedia")
            .field("media", &self.media.len())
            .field("read_lease", &self.read_lease)
            .field("pending_ttl", &self.pending_ttl)
            .finish_non_exhaustive()
    }
}

/// The ranges of a value of `size` bytes on `pages` of `page_size` bytes of `backend`'s buffers,
/// contiguous pages of one buffer merged; `None` when a buffer has no data-server registration or
/// the pages cannot hold the value. `regions` keeps the `(buffer index, region id)` pairs looked
/// up so far (a batch shares them: most of its values lie in one buffer).
fn ranges(
    backend: &dyn MediumBackend,
    pages: &[PageLocation],
    page_size: u64,
    size: u64,
    regions: &mut Vec<(u32, u64)>,
) -> Option<Vec<KeyedRange>> {
    if page_size == 0 || pages.len() as u64 != size.div_ceil(page_size) {
        return None;
    }
    let mut out: Vec<KeyedRange> = Vec::with_capacity(1);
    for (p, page) in pages.iter().enumerate() {
        let len = page_size.min(size - p as u64 * page_size);
        let region_id = match regions.iter().find(|(b, _)| *b == page.buffer_index) {
            Some((_, id)) => *id,
            None => {
                let r = backend.buffer_ref(page.buffer_index as usize)?;
                let id = r.remote()?.region_id;
                regions.push((page.buffer_index, id));
                id
            }
        };
        let offset = u64::from(page.page_index) * page_size;
        match out.last_mut() {
            Some(last) if last.region_id == region_id && last.offset + last.len == offset => last.len += len,
            _ => out.push(KeyedRange { region_id, offset, len }),
        }
    }
    Some(out)
}

impl KeyedMedia {
    /// Keyed requests over `service`'s media (its registry's, in ascending tier) and its change
    /// hook. `read_lease` and `pending_ttl` are the media's (the node's `read_lease` and
    /// `pending_ttl` settings).
    pub fn new(service: &PeerService, read_lease: Duration, pending_ttl: Duration) -> Self {
        let media =
            service.media().map(|(id, tier, backend)| Medium { id, tier, backend: Arc::clone(backend) }).collect();
        Self { media, service: service.clone(), read_lease, pending_ttl }
    }
}

impl KeyedHandler for KeyedMedia {
    // The single forms are batches of one: one rule for which medium answers, when a read is
    // busy rather than missing, and what a slot's deadline is.
    fn open_read(&self, key: &str) -> KeyedRead {
        self.open_reads(&[key]).pop().unwrap_or(KeyedRead::Miss)
    }

    fn close_read(&self, key: &str, lease: KeyedLease) {
        self.close_reads(&[(key, lease)]);
    }

    fn open_write(&self, key: &str, tier: u64, size: u64) -> KeyedWrite {
        self.open_writes(&[(key, size)], tier).pop().unwrap_or(KeyedWrite::Failed)
    }

    fn close_write(&self, key: &str, slot: KeyedSlot, received: bool, crc32c: Option<u32>) -> bool {
        self.close_writes(&[ClosingSlot { key, slot, received, crc32c }]).first().copied().unwrap_or(false)
    }

    /// Each medium in turn resolves, in one call, the keys no earlier medium holds: a key is read
    /// from the first medium (ascending tier) that holds it, busy when one that holds it cannot
    /// serve it now and none after it can, a miss otherwise.
    fn open_reads(&self, keys: &[&str]) -> Vec<KeyedRead> {
        let mut out: Vec<Option<KeyedRead>> = vec![None; keys.len()];
        let mut busy = vec![false; keys.len()];
        let mut unplaced: Vec<ReadRelease> = Vec::new();
        for medium in &self.media {
            let left: Vec<usize> = (0..keys.len()).filter(|&i| out[i].is_none()).collect();
            if left.is_empty() {
                break;
            }
            let asked: Vec<String> = left.iter().map(|&i| keys[i].to_owned()).collect();
            // The leases run from before the resolve: conservative.
            let start = Instant::now();
            let entries = medium.backend.batch_resolve(&asked, false);
            let mut regions = Vec::with_capacity(1);
            for (&i, entry) in left.iter().zip(entries) {
                if entry.busy {
                    busy[i] = true;
                    continue;
                }
                if !entry.found {
                    continue;
                }
                let lease = KeyedLease { id: entry.lease, backend_id: medium.id, until: start + self.read_lease };
                let backend = medium.backend.as_ref();
                out[i] = Some(match ranges(backend, &entry.pages, entry.page_size, entry.size, &mut regions) {
                    Some(ranges) => KeyedRead::Hit { size: entry.size, ranges, lease, crc32c: entry.crc32c },
                    None => {
                        // Device memory (no host registration) or a layout the pages cannot
                        // hold: the routed path serves it (and judges it).
                        if lease.id != 0 {
                            unplaced.push(ReadRelease::new(keys[i], lease.id));
                        }
                        KeyedRead::Unsupported
                    }
                });
            }
            if !unplaced.is_empty() {
                medium.backend.release_reads(&std::mem::take(&mut unplaced));
            }
        }
        out.into_iter()
            .zip(busy)
            .map(|(read, busy)| read.unwrap_or(if busy { KeyedRead::Busy } else { KeyedRead::Miss }))
            .collect()
    }

    /// One `release_reads` per medium.
    fn close_reads(&self, reads: &[(&str, KeyedLease)]) {
        for medium in &self.media {
            let mine: Vec<ReadRelease> = reads
                .iter()
                .filter(|(_, lease)| lease.id != 0 && lease.backend_id == medium.id)
                .map(|(key, lease)| ReadRelease::new(*key, lease.id))
                .collect();
            if !mine.is_empty() {
                medium.backend.release_reads(&mine);
            }
        }
    }

    /// One `batch_allocate` on the tier's medium (and one `batch_abort` for slots it cannot
    /// describe).
    fn open_writes(&self, writes: &[(&str, u64)], tier: u64) -> Vec<KeyedWrite> {
        let tier = u32::try_from(tier).map_or(TierType::Unknown, TierType::from_wire);
        let Some(medium) = self.media.iter().find(|m| m.tier == tier) else {
            return vec![KeyedWrite::Unsupported; writes.len()];
        };
        let mut out: Vec<KeyedWrite> = vec![KeyedWrite::Failed; writes.len()];
        // A zero-size write fails alone (as `open_write`); the rest are asked in one call.
        let asked: Vec<usize> = (0..writes.len()).filter(|&i| writes[i].1 > 0).collect();
        let requests: Vec<AllocateRequest> =
            asked.iter().map(|&i| AllocateRequest { key: writes[i].0.to_owned(), size: writes[i].1 }).collect();
        let start = Instant::now();
        let results = medium.backend.batch_allocate(&requests);
        let mut regions = Vec::with_capacity(1);
        let mut aborts = Vec::new();
        for (&i, result) in asked.iter().zip(results) {
            out[i] = match result.outcome {
                AllocateOutcome::Allocated => {
                    let ttl = if result.pending_ttl_ms > 0 {
                        Duration::from_millis(result.pending_ttl_ms)
                    } else {
                        self.pending_ttl
                    };
                    let slot =
                        KeyedSlot { id: result.slot_id, backend_id: medium.id, until: slot_deadline(start, ttl) };
                    let backend = medium.backend.as_ref();
                    match ranges(backend, &result.pages, result.page_size, writes[i].1, &mut regions) {
                        Some(ranges) => KeyedWrite::Slot { ranges, slot },
                        None => {
                            aborts.push(result.slot_id);
                            KeyedWrite::Unsupported
                        }
                    }
                }
                AllocateOutcome::AlreadyExists => KeyedWrite::Exists,
                AllocateOutcome::FailedNoSpace => KeyedWrite::NoSpace,
                AllocateOutcome::Busy => KeyedWrite::Busy,
                _ => KeyedWrite::Failed,
            };
        }
        if !aborts.is_empty() {
            medium.backend.batch_abort(&aborts);
        }
        out
    }

    /// One `batch_commit` and one `batch_abort` per medium; the change hook once.
    fn close_writes(&self, slots: &[ClosingSlot<'_>]) -> Vec<bool> {
        let mut out = vec![false; slots.len()];
        let mut changed = false;
        for medium in &self.media {
            let commits: Vec<usize> =
                (0..slots.len()).filter(|&i| slots[i].slot.backend_id == medium.id && slots[i].received).collect();
            let aborts: Vec<u64> =
                slots.iter().filter(|c| c.slot.backend_id == medium.id && !c.received).map(|c| c.slot.id).collect();
            if !aborts.is_empty() {
                medium.backend.batch_abort(&aborts);
            }
            if commits.is_empty() {
                continue;
            }
            let requests: Vec<CommitRequest> = commits
                .iter()
                .map(|&i| CommitRequest::new(slots[i].slot.id, slots[i].key).with_crc32c(slots[i].crc32c))
                .collect();
            for (&i, result) in commits.iter().zip(medium.backend.batch_commit(&requests)) {
                out[i] = result.success;
                changed |= result.success;
            }
        }
        if changed {
            self.service.changed();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use umbp_core::{BackendRegistry, MemoryRegistrar};
    use umbp_testkit::{MockBackend, MockConfig};
    use umbp_transfer::{DataServer, DataServerConfig};

    use super::*;

    const PAGE: u64 = 4096;

    /// A node's keyed handler over one mock DRAM medium registered with a data server (so its
    /// pages have regions to answer with).
    fn media() -> (KeyedMedia, Arc<MockBackend>, Arc<DataServer>) {
        let server = Arc::new(DataServer::start(DataServerConfig::default()).expect("a data server on loopback"));
        let mock = Arc::new(MockBackend::new(MockConfig {
            tier: TierType::Dram,
            page_size: PAGE,
            pages: 64,
            ..MockConfig::default()
        }));
        let registrar: Arc<dyn MemoryRegistrar> = server.clone();
        mock.init(registrar).expect("the medium registers");
        let mut registry = BackendRegistry::new();
        registry.register(mock.clone()).expect("registered");
        let service = PeerService::new(Arc::new(registry), server.endpoint());
        (KeyedMedia::new(&service, Duration::from_secs(60), Duration::from_secs(60)), mock, server)
    }

    /// A GET_KEYS or PUT_KEYS batch asks the medium once per step, not once per key, and answers
    /// each key as the key-by-key forms do.
    #[test]
    fn a_batch_asks_the_medium_once_per_step() {
        let (keyed, mock, _server) = media();
        let tier = u64::from(TierType::Dram.wire());
        let keys = ["a", "b", "c", "d"];
        let writes: Vec<(&str, u64)> = keys.iter().map(|k| (*k, 2 * PAGE)).collect();
        let before = mock.calls();
        let opened = keyed.open_writes(&writes, tier);
        let slots: Vec<KeyedSlot> = opened
            .iter()
            .map(|w| match w {
                KeyedWrite::Slot { ranges, slot } => {
                    assert_eq!(ranges.iter().map(|r| r.len).sum::<u64>(), 2 * PAGE);
                    *slot
                }
                other => panic!("a slot, not {other:?}"),
            })
            .collect();
        // `d` arrived late: aborted, the rest committed.
        let closing: Vec<ClosingSlot<'_>> = keys
            .iter()
            .zip(&slots)
            .map(|(key, slot)| ClosingSlot { key, slot: *slot, received: *key != "d", crc32c: Some(7) })
            .collect();
        assert_eq!(keyed.close_writes(&closing), [true, true, true, false]);
        let after = mock.calls();
        assert_eq!(after.batch_allocate - before.batch_allocate, 1, "one allocation for four keys");
        assert_eq!(after.batch_commit - before.batch_commit, 1, "one commit for three keys");
        assert_eq!(after.batch_abort - before.batch_abort, 1, "one abort for the late key");

        // A second write of a committed key, and the single form (a batch of one).
        assert_eq!(keyed.open_writes(&[("a", PAGE)], tier), [KeyedWrite::Exists]);
        assert_eq!(keyed.open_write("a", tier, PAGE), KeyedWrite::Exists);

        let before = mock.calls();
        let reads = keyed.open_reads(&keys);
        assert_eq!(mock.calls().batch_resolve - before.batch_resolve, 1, "one resolve for four keys");
        let mut leases = Vec::new();
        for (key, read) in keys.iter().zip(&reads) {
            match (key, read) {
                (&"d", KeyedRead::Miss) => {}
                (_, KeyedRead::Hit { size, lease, crc32c, .. }) => {
                    assert_eq!((*size, *crc32c), (2 * PAGE, Some(7)), "{key}");
                    leases.push((*key, *lease));
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(leases.len(), 3);
        let before = mock.calls();
        keyed.close_reads(&leases);
        assert_eq!(mock.calls().release_reads - before.release_reads, 1, "one release for three leases");
    }
}
