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
use umbp_transfer::{KeyedHandler, KeyedLease, KeyedRange, KeyedRead, KeyedSlot, KeyedWrite};

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
/// the pages cannot hold the value.
fn ranges(backend: &dyn MediumBackend, pages: &[PageLocation], page_size: u64, size: u64) -> Option<Vec<KeyedRange>> {
    if page_size == 0 || pages.len() as u64 != size.div_ceil(page_size) {
        return None;
    }
    let mut out: Vec<KeyedRange> = Vec::with_capacity(1);
    let mut regions: Vec<(u32, u64)> = Vec::with_capacity(1);
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

    fn medium(&self, id: u32) -> Option<&Medium> {
        self.media.iter().find(|m| m.id == id)
    }
}

impl KeyedHandler for KeyedMedia {
    fn open_read(&self, key: &str) -> KeyedRead {
        let keys = [key.to_owned()];
        let mut busy = false;
        for medium in &self.media {
            // The lease runs from before the resolve: conservative.
            let start = Instant::now();
            let Some(entry) = medium.backend.batch_resolve(&keys, false).into_iter().next() else { continue };
            if entry.busy {
                busy = true;
                continue;
            }
            if !entry.found {
                continue;
            }
            let lease = KeyedLease { id: entry.lease, backend_id: medium.id, until: start + self.read_lease };
            return match ranges(medium.backend.as_ref(), &entry.pages, entry.page_size, entry.size) {
                Some(ranges) => KeyedRead::Hit { size: entry.size, ranges, lease, crc32c: entry.crc32c },
                None => {
                    // Device memory (no host registration) or a layout the pages cannot hold: the
                    // routed path serves it (and judges it).
                    self.close_read(key, lease);
                    KeyedRead::Unsupported
                }
            };
        }
        if busy { KeyedRead::Busy } else { KeyedRead::Miss }
    }

    fn close_read(&self, key: &str, lease: KeyedLease) {
        if lease.id == 0 {
            return;
        }
        if let Some(m) = self.medium(lease.backend_id) {
            m.backend.release_reads(&[ReadRelease::new(key, lease.id)]);
        }
    }

    fn open_write(&self, key: &str, tier: u64, size: u64) -> KeyedWrite {
        let tier = u32::try_from(tier).map_or(TierType::Unknown, TierType::from_wire);
        let Some(medium) = self.media.iter().find(|m| m.tier == tier) else { return KeyedWrite::Unsupported };
        if size == 0 {
            return KeyedWrite::Failed;
        }
        let start = Instant::now();
        let request = [AllocateRequest { key: key.to_owned(), size }];
        let Some(result) = medium.backend.batch_allocate(&request).into_iter().next() else {
            return KeyedWrite::Failed;
        };
        match result.outcome {
            AllocateOutcome::Allocated => {}
            AllocateOutcome::AlreadyExists => return KeyedWrite::Exists,
            AllocateOutcome::FailedNoSpace => return KeyedWrite::NoSpace,
            AllocateOutcome::Busy => return KeyedWrite::Busy,
            _ => return KeyedWrite::Failed,
        }
        let ttl =
            if result.pending_ttl_ms > 0 { Duration::from_millis(result.pending_ttl_ms) } else { self.pending_ttl };
        let slot = KeyedSlot { id: result.slot_id, backend_id: medium.id, until: slot_deadline(start, ttl) };
        match ranges(medium.backend.as_ref(), &result.pages, result.page_size, size) {
            Some(ranges) => KeyedWrite::Slot { ranges, slot },
            None => {
                medium.backend.batch_abort(&[result.slot_id]);
                KeyedWrite::Unsupported
            }
        }
    }

    fn close_write(&self, key: &str, slot: KeyedSlot, received: bool, crc32c: Option<u32>) -> bool {
        let Some(medium) = self.medium(slot.backend_id) else { return false };
        if !received {
            medium.backend.batch_abort(&[slot.id]);
            return false;
        }
        let commit = CommitRequest::new(slot.id, key).with_crc32c(crc32c);
        let committed = medium.backend.batch_commit(&[commit]).first().is_some_and(|r| r.success);
        if committed {
            self.service.changed();
        }
        committed
    }
}
