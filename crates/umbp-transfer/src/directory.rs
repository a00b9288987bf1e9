//! Which remote buffers this node knows, per peer and per backend id.

use std::collections::BTreeMap;

use dashmap::DashMap;
use umbp_core::{BufferDesc, MAX_BACKENDS_PER_PEER, TransferRef};

use crate::warn::{WarnLimiter, warn_limited};

/// The most buffers one backend of a peer may publish: a descriptor with a larger buffer index is
/// skipped with a warning. Indexes come from peers, so they never size an allocation unchecked.
pub const MAX_BUFFERS_PER_BACKEND: u32 = 1 << 16;

/// One peer's published buffers: a shelf per backend id, keyed by buffer index (sparse: a peer
/// naming index 60 000 costs one entry, not 60 000).
#[derive(Debug, Default, Clone)]
struct PeerBuffers {
    shelves: [BTreeMap<u32, TransferRef>; MAX_BACKENDS_PER_PEER],
}

/// The remote buffers this node has learned from its peers (first contact: the peer's `GetPeerInfo`
/// descriptors are cached here), handed out as one snapshot per batch.
///
/// A cached descriptor is kept until the peer is forgotten: a later, different descriptor for the
/// same slot is ignored with a warning (a restarted peer must be forgotten first, which callers do
/// when a transfer to it fails).
///
/// Descriptors come from peers, so the warnings about skipped ones are rate-limited per kind (one
/// line every few seconds, with the count suppressed).
///
/// A [`DashMap`]: every operation touches one peer, so work on one peer (a first contact caching its
/// descriptors, a batch taking a snapshot) locks only that peer's shard of the map, never all peers.
#[derive(Debug, Default)]
pub struct PeerDirectory {
    peers: DashMap<String, PeerBuffers>,
    warns: WarnLimiter,
}

impl PeerDirectory {
    /// An empty directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Caches the descriptors `node` published. Descriptors with a backend id of 8 or more, a buffer
    /// index of [`MAX_BUFFERS_PER_BACKEND`] or more, or no remote handle, are skipped. Returns how many new descriptors were cached.
    pub fn cache_remote_buffers(&self, node: &str, descs: &[BufferDesc]) -> usize {
        let mut entry = self.peers.entry(node.to_owned()).or_default();
        let mut cached = 0;
        for desc in descs {
            let Some((shelf, incoming)) = Self::checked(&self.warns, node, &mut entry, desc) else { continue };
            match shelf.get(&desc.buffer_index) {
                Some(existing) if *existing != incoming => warn_limited!(
                    self.warns,
                    "changed_descriptor",
                    node,
                    backend_id = desc.backend_id,
                    buffer = desc.buffer_index,
                    "peer published a different descriptor for a cached buffer; keeping the cached one until the peer is forgotten"
                ),
                Some(_) => {}
                None => {
                    shelf.insert(desc.buffer_index, incoming);
                    cached += 1;
                }
            }
        }
        cached
    }

    /// Caches the descriptors `node` published, **replacing** any cached descriptor of the same
    /// `(backend_id, buffer_index)` that differs (a restarted peer publishes new handles). Skips what
    /// [`cache_remote_buffers`](Self::cache_remote_buffers) skips. One write lock for the whole batch:
    /// no reader sees half of it. Returns how many descriptors were added or replaced.
    pub fn replace_remote_buffers(&self, node: &str, descs: &[BufferDesc]) -> usize {
        let mut entry = self.peers.entry(node.to_owned()).or_default();
        Self::put_all(&self.warns, node, &mut entry, descs)
    }

    /// Makes `descs` the whole of what is known about `node` (first contact or reconnection:
    /// `GetPeerInfo` is authoritative), atomically: readers see the old table or the new one, never
    /// an empty one in between. Returns how many descriptors were cached.
    pub fn reset_remote_buffers(&self, node: &str, descs: &[BufferDesc]) -> usize {
        let mut fresh = PeerBuffers::default();
        let n = Self::put_all(&self.warns, node, &mut fresh, descs);
        self.peers.insert(node.to_owned(), fresh);
        n
    }

    fn put_all(warns: &WarnLimiter, node: &str, entry: &mut PeerBuffers, descs: &[BufferDesc]) -> usize {
        let mut changed = 0;
        for desc in descs {
            let Some((shelf, incoming)) = Self::checked(warns, node, entry, desc) else { continue };
            if shelf.get(&desc.buffer_index) != Some(&incoming) {
                shelf.insert(desc.buffer_index, incoming);
                changed += 1;
            }
        }
        changed
    }

    /// The shelf `desc` belongs on and the descriptor to cache, or `None` (with a rate-limited
    /// warning) for a descriptor a peer should not have sent: a backend id of 8 or more, no
    /// data-plane handle, or a buffer index of [`MAX_BUFFERS_PER_BACKEND`] or more.
    fn checked<'a>(
        warns: &WarnLimiter,
        node: &str,
        entry: &'a mut PeerBuffers,
        desc: &BufferDesc,
    ) -> Option<(&'a mut BTreeMap<u32, TransferRef>, TransferRef)> {
        let Some(shelf) = entry.shelves.get_mut(desc.backend_id as usize) else {
            warn_limited!(
                warns,
                "bad_backend_id",
                node,
                backend_id = desc.backend_id,
                "ignoring a descriptor with an out-of-range backend id"
            );
            return None;
        };
        let Some(remote) = desc.remote.clone() else {
            warn_limited!(
                warns,
                "no_remote_handle",
                node,
                buffer = desc.buffer_index,
                "ignoring a descriptor with no data-plane handle"
            );
            return None;
        };
        if desc.buffer_index >= MAX_BUFFERS_PER_BACKEND {
            warn_limited!(
                warns,
                "bad_buffer_index",
                node,
                buffer = desc.buffer_index,
                limit = MAX_BUFFERS_PER_BACKEND,
                "ignoring a descriptor with an out-of-range buffer index"
            );
            return None;
        }
        Some((shelf, TransferRef::remote_only(remote, desc.size, desc.location)))
    }

    /// Whether any buffer of `node` is cached.
    pub fn has_remote_buffers(&self, node: &str) -> bool {
        self.peers.get(node).is_some_and(|p| p.shelves.iter().any(|s| !s.is_empty()))
    }

    /// The buffers of one backend of `node`, by buffer index (`None` where nothing is cached), up to
    /// the largest cached index (so at most [`MAX_BUFFERS_PER_BACKEND`] entries). Empty for an
    /// unknown node or a backend id of 8 or more.
    pub fn remote_buffer_snapshot(&self, node: &str, backend_id: u32) -> Vec<Option<TransferRef>> {
        let Some(peer) = self.peers.get(node) else { return Vec::new() };
        let Some(shelf) = peer.shelves.get(backend_id as usize) else { return Vec::new() };
        let len = shelf.last_key_value().map_or(0, |(index, _)| *index as usize + 1);
        let mut out = vec![None; len];
        for (index, r) in shelf {
            out[*index as usize] = Some(r.clone());
        }
        out
    }

    /// Drops everything known about `node`.
    pub fn forget(&self, node: &str) {
        self.peers.remove(node);
    }
}

#[cfg(test)]
mod tests {
    use umbp_core::{MemoryLocation, RemoteRegion};

    use super::*;

    fn desc(backend_id: u32, buffer_index: u32, region_id: u64) -> BufferDesc {
        BufferDesc {
            backend_id,
            buffer_index,
            size: 4096,
            location: MemoryLocation::Host,
            remote: Some(RemoteRegion { endpoint: "127.0.0.1:9".into(), region_id }),
        }
    }

    #[test]
    fn caches_per_backend_shelves_and_forgets() {
        let d = PeerDirectory::new();
        assert!(!d.has_remote_buffers("n1"));
        assert_eq!(d.cache_remote_buffers("n1", &[desc(0, 0, 1), desc(1, 2, 2), desc(8, 0, 3)]), 2);
        assert!(d.has_remote_buffers("n1"));
        let shelf = d.remote_buffer_snapshot("n1", 1);
        assert_eq!(shelf.len(), 3);
        assert!(shelf[0].is_none() && shelf[1].is_none());
        assert_eq!(shelf[2].as_ref().and_then(|r| r.remote()).map(|r| r.region_id), Some(2));
        assert!(d.remote_buffer_snapshot("n1", 8).is_empty());
        assert!(d.remote_buffer_snapshot("nobody", 0).is_empty());
        d.forget("n1");
        assert!(!d.has_remote_buffers("n1"));
    }

    #[test]
    fn keeps_the_incumbent_descriptor() {
        let d = PeerDirectory::new();
        d.cache_remote_buffers("n1", &[desc(0, 0, 1)]);
        assert_eq!(d.cache_remote_buffers("n1", &[desc(0, 0, 99)]), 0);
        let r = d.remote_buffer_snapshot("n1", 0).remove(0);
        assert_eq!(r.and_then(|r| r.remote().map(|x| x.region_id)), Some(1));
    }

    #[test]
    fn replace_swaps_a_differing_descriptor_and_reset_replaces_the_table() {
        let d = PeerDirectory::new();
        d.cache_remote_buffers("n1", &[desc(0, 0, 1), desc(0, 1, 2)]);
        assert_eq!(d.replace_remote_buffers("n1", &[desc(0, 0, 1)]), 0, "identical: nothing changes");
        assert_eq!(d.replace_remote_buffers("n1", &[desc(0, 0, 99)]), 1);
        let shelf = d.remote_buffer_snapshot("n1", 0);
        assert_eq!(shelf[0].as_ref().and_then(|r| r.remote()).map(|r| r.region_id), Some(99));
        assert_eq!(shelf[1].as_ref().and_then(|r| r.remote()).map(|r| r.region_id), Some(2), "others kept");
        assert_eq!(d.reset_remote_buffers("n1", &[desc(1, 0, 7)]), 1);
        assert!(d.remote_buffer_snapshot("n1", 0).is_empty(), "reset drops what the peer no longer publishes");
        assert_eq!(d.remote_buffer_snapshot("n1", 1).len(), 1);
    }

    #[test]
    fn skips_descriptors_without_a_handle() {
        let d = PeerDirectory::new();
        let mut no_handle = desc(0, 0, 1);
        no_handle.remote = None;
        assert_eq!(d.cache_remote_buffers("n1", &[no_handle]), 0);
        assert!(!d.has_remote_buffers("n1"));
    }

    #[test]
    fn a_huge_buffer_index_is_skipped_not_allocated() {
        let d = PeerDirectory::new();
        assert_eq!(d.cache_remote_buffers("n1", &[desc(0, u32::MAX, 1), desc(0, MAX_BUFFERS_PER_BACKEND, 2)]), 0);
        assert!(!d.has_remote_buffers("n1"));
        assert!(d.remote_buffer_snapshot("n1", 0).is_empty());
        // The largest index allowed is cached, sparsely, and the snapshot reaches it.
        assert_eq!(d.cache_remote_buffers("n1", &[desc(0, MAX_BUFFERS_PER_BACKEND - 1, 3)]), 1);
        let shelf = d.remote_buffer_snapshot("n1", 0);
        assert_eq!(shelf.len(), MAX_BUFFERS_PER_BACKEND as usize);
        assert!(shelf[..shelf.len() - 1].iter().all(Option::is_none));
    }
}
