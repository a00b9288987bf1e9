//! The node's media, by tier, and the helpers that merge their event streams.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::backend::MediumBackend;
use crate::error::RegistryError;
use crate::types::{KvEvent, MAX_BACKENDS_PER_PEER, TierType};

#[derive(Debug)]
struct Entry {
    id: u32,
    backend: Arc<dyn MediumBackend>,
}

/// The media of one node, keyed by tier, each with a stable backend id in `0..8`.
///
/// Every medium on a node shares one page size. Iteration is in ascending tier order (HBM, DRAM,
/// SSD): deterministic, and no preference — the routing plane does not tier.
#[derive(Debug, Default)]
pub struct BackendRegistry {
    by_tier: BTreeMap<TierType, Entry>,
    next_id: u32,
    page_size: u64,
}

impl BackendRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a backend and returns its id. A backend for a tier already present replaces the old one
    /// and keeps its id. Refuses a page size different from the registered media's, a tier of
    /// `Unknown` and a ninth distinct tier; a refusal changes nothing.
    pub fn register(&mut self, backend: Arc<dyn MediumBackend>) -> Result<u32, RegistryError> {
        let tier = backend.tier();
        if tier == TierType::Unknown {
            return Err(RegistryError::UnknownTier(tier));
        }
        let page_size = backend.page_size();
        // A lone backend being replaced may change the page size: nothing else shares it.
        let others_present = self.by_tier.keys().any(|t| *t != tier);
        if others_present && page_size != self.page_size {
            return Err(RegistryError::PageSizeMismatch { tier, got: page_size, expected: self.page_size });
        }
        let id = match self.by_tier.get(&tier) {
            Some(existing) => existing.id,
            None => {
                if self.next_id as usize >= MAX_BACKENDS_PER_PEER {
                    return Err(RegistryError::TooManyBackends { max: MAX_BACKENDS_PER_PEER });
                }
                let id = self.next_id;
                self.next_id += 1;
                id
            }
        };
        self.by_tier.insert(tier, Entry { id, backend });
        self.page_size = page_size;
        Ok(id)
    }

    /// The id of a registered backend (compared by identity), or `None`.
    pub fn backend_id(&self, backend: &Arc<dyn MediumBackend>) -> Option<u32> {
        self.by_tier.values().find(|e| Arc::ptr_eq(&e.backend, backend)).map(|e| e.id)
    }

    /// The id of the backend serving `tier`.
    pub fn id_of_tier(&self, tier: TierType) -> Option<u32> {
        self.by_tier.get(&tier).map(|e| e.id)
    }

    /// The backend serving `tier`; `None` is normal (the node does not lend that medium).
    pub fn get(&self, tier: TierType) -> Option<&Arc<dyn MediumBackend>> {
        self.by_tier.get(&tier).map(|e| &e.backend)
    }

    /// The backend with id `id`.
    pub fn by_id(&self, id: u32) -> Option<&Arc<dyn MediumBackend>> {
        self.by_tier.values().find(|e| e.id == id).map(|e| &e.backend)
    }

    /// Every backend, ascending by tier.
    pub fn all(&self) -> Vec<Arc<dyn MediumBackend>> {
        self.by_tier.values().map(|e| Arc::clone(&e.backend)).collect()
    }

    /// Every `(id, backend)`, ascending by tier.
    pub fn entries(&self) -> impl Iterator<Item = (u32, &Arc<dyn MediumBackend>)> {
        self.by_tier.values().map(|e| (e.id, &e.backend))
    }

    /// The shared page size; 0 while empty.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// How many media are registered.
    pub fn len(&self) -> usize {
        self.by_tier.len()
    }

    /// Whether no medium is registered (a client-only node).
    pub fn is_empty(&self) -> bool {
        self.by_tier.is_empty()
    }
}

/// Drains every backend's outbox into one stream, in list order. The heartbeat ships the result under
/// one sequence space — never a sequence per medium.
pub fn drain_all_backends<'a>(backends: impl IntoIterator<Item = &'a Arc<dyn MediumBackend>>) -> Vec<KvEvent> {
    backends.into_iter().flat_map(|b| b.drain_pending_events()).collect()
}

/// Takes every backend's full-sync snapshot (which also clears its outbox) into one stream, in list
/// order.
pub fn snapshot_all_backends_for_full_sync<'a>(
    backends: impl IntoIterator<Item = &'a Arc<dyn MediumBackend>>,
) -> Vec<KvEvent> {
    backends.into_iter().flat_map(|b| b.snapshot_owned_keys_for_full_sync()).collect()
}
