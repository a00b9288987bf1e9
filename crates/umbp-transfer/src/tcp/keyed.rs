//! Keyed requests: a get or a put in one exchange with the holder.
//!
//! A routed get costs a route call to the master, a resolve call to the holder's peer service, the
//! data transfer and a release — three round trips and several thread hand-offs before the first
//! byte. A keyed request names the key on the data plane instead of a region: the holder's data
//! server asks the node's [`KeyedHandler`] to resolve the key under a read lease, sends the value
//! straight from the medium's pages, ends the lease and says in a trailer whether the lease covered
//! the whole send — all on the connection's own thread, in one exchange. A keyed put likewise
//! allocates, receives the value straight into the slot's pages and commits.
//!
//! The transfer layer still moves bytes only: what a key means (which medium, which pages, which
//! lease) is the handler's, which the node (`umbp-peer`) implements over its media. The wire format
//! is in [`protocol`](super::protocol) ("Keyed requests"); the client is
//! [`KeyedClient`](super::KeyedClient).
//!
//! Correctness rules the server keeps:
//! - bytes are sent only from ranges of live host regions of this server, bounds-checked as a READ's
//!   (a handler that names anything else gets its lease closed and the request refused);
//! - a read lease is closed on every path, also when the connection breaks mid-send;
//! - a send that ends after the lease's end is marked lapsed in the trailer, so the reader discards
//!   the bytes (the pages may have been reused under it) and never returns them as a hit;
//! - a slot is committed only when its value arrived in full before the slot's end, and aborted on
//!   every other path.

use std::time::Instant;

/// A byte range of a region registered with this node's data server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedRange {
    /// The region's id, as its registration assigned it (`TransferRef::remote().region_id`).
    pub region_id: u64,
    /// Byte offset inside the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The read lease a keyed read holds while its bytes are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedLease {
    /// The medium's lease id (0: the medium took none).
    pub id: u64,
    /// The medium that served the key.
    pub backend_id: u32,
    /// Until when the lease protects the pages, measured from before the resolve (conservative). A
    /// send that ends later is marked lapsed.
    pub until: Instant,
}

/// The slot a keyed write fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedSlot {
    /// The medium's slot id.
    pub id: u64,
    /// The medium holding the slot.
    pub backend_id: u32,
    /// Until when the slot may be written and committed (its pending TTL minus a margin, from
    /// before the allocation). A value that arrives later is aborted.
    pub until: Instant,
}

/// What a keyed read found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyedRead {
    /// The value, as ranges in order (their lengths add up to `size`), under `lease`.
    Hit {
        /// The value's size.
        size: u64,
        /// Where its bytes are.
        ranges: Vec<KeyedRange>,
        /// The lease to close once the bytes are sent.
        lease: KeyedLease,
        /// The CRC-32C its writer put with the value, sent on for the reader to check.
        crc32c: Option<u32>,
    },
    /// Not held here.
    Miss,
    /// Held here, but not servable now (every staging page held): ask again shortly.
    Busy,
    /// Not servable by a keyed read (a value in device memory): use the routed path.
    Unsupported,
}

/// What a keyed write got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyedWrite {
    /// A slot: the value goes into `ranges`, in order (their lengths add up to the value's size).
    Slot {
        /// Where the value's bytes go.
        ranges: Vec<KeyedRange>,
        /// The slot to commit or abort.
        slot: KeyedSlot,
    },
    /// The key is held here already; its value is kept.
    Exists,
    /// No room here.
    NoSpace,
    /// Room, but no staging page now: ask again shortly.
    Busy,
    /// The allocation failed.
    Failed,
    /// Not writable by a keyed write (no medium of the tier, device memory): use the routed path.
    Unsupported,
}

/// What a node's data server asks of the node to serve keyed requests. Implemented by the node over
/// its media; called on the data server's connection threads, concurrently.
///
/// Every `open_read` that returns [`KeyedRead::Hit`] is followed by exactly one `close_read` of its
/// lease, and every `open_write` that returns [`KeyedWrite::Slot`] by exactly one `close_write` of its
/// slot, whatever happens to the connection. The batch forms (`open_reads`, `close_reads`,
/// `open_writes`, `close_writes`: GET_KEYS and PUT_KEYS) keep the same rule per key; their defaults
/// call the single forms key by key, and a handler overrides them to ask its media once per batch
/// (a 64 KiB batch of 64 MiB is 1,024 keys).
pub trait KeyedHandler: Send + Sync {
    /// Resolves `key` for reading, taking a read lease on a hit.
    fn open_read(&self, key: &str) -> KeyedRead;
    /// Ends the lease of a keyed read (its bytes were sent, or the send failed).
    fn close_read(&self, key: &str, lease: KeyedLease);
    /// Reserves a slot of `size` bytes for `key` on the medium of `tier` (`TierType` as a number).
    fn open_write(&self, key: &str, tier: u64, size: u64) -> KeyedWrite;
    /// Commits the slot when `received` (the whole value arrived in time), with the writer's
    /// CRC-32C of the value when it sent one, else aborts it. Returns whether it was committed.
    fn close_write(&self, key: &str, slot: KeyedSlot, received: bool, crc32c: Option<u32>) -> bool;

    /// [`open_read`](Self::open_read) of every key, one answer per key in order.
    fn open_reads(&self, keys: &[&str]) -> Vec<KeyedRead> {
        keys.iter().map(|key| self.open_read(key)).collect()
    }

    /// [`close_read`](Self::close_read) of every `(key, lease)`.
    fn close_reads(&self, reads: &[(&str, KeyedLease)]) {
        for (key, lease) in reads {
            self.close_read(key, *lease);
        }
    }

    /// [`open_write`](Self::open_write) of every `(key, size)` on tier `tier`, one answer per
    /// write in order.
    fn open_writes(&self, writes: &[(&str, u64)], tier: u64) -> Vec<KeyedWrite> {
        writes.iter().map(|(key, size)| self.open_write(key, tier, *size)).collect()
    }

    /// [`close_write`](Self::close_write) of every slot, one answer (committed or not) per slot in
    /// order.
    fn close_writes(&self, slots: &[ClosingSlot<'_>]) -> Vec<bool> {
        slots.iter().map(|c| self.close_write(c.key, c.slot, c.received, c.crc32c)).collect()
    }
}

/// One slot of [`KeyedHandler::close_writes`]: commit it when `received`, else abort it.
#[derive(Debug, Clone, Copy)]
pub struct ClosingSlot<'a> {
    /// The key the slot was opened for.
    pub key: &'a str,
    /// The slot.
    pub slot: KeyedSlot,
    /// The whole value arrived before the slot's end.
    pub received: bool,
    /// The writer's CRC-32C of the value, when it sent one.
    pub crc32c: Option<u32>,
}

impl std::fmt::Debug for dyn KeyedHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyedHandler")
    }
}
