//! The five external-KV-index RPCs of the `UMBPMaster` service (issue 21, item 2): validate, call
//! the store on the blocking pool, encode. The contract is the store's (`store::MetadataStore`'s
//! `*_external_kv*` methods); this module adds the wire shapes, the per-call limits with their
//! numbers in the error, and the counter of reports ignored because their node is not alive.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tonic::Status;
use umbp_core::TierType;
use umbp_proto::v1;

use crate::service::{MasterService, store_status, tier_from_wire, tier_to_wire};
use crate::store::{ExternalReport, MAX_EXTERNAL_KV_HASHES, MetadataStore, StoreError};

/// Counters of the external index calls.
#[derive(Debug, Default)]
pub(crate) struct ExternalStats {
    pub(crate) reports_recorded: AtomicU64,
    pub(crate) reports_rejected_not_alive: AtomicU64,
}

/// Refuses a call of more hashes than one call takes, naming the limit (the store would refuse it
/// too, with a fixed message).
fn check_len(hashes: &[String]) -> Result<(), Status> {
    if hashes.len() > MAX_EXTERNAL_KV_HASHES {
        return Err(Status::invalid_argument(format!(
            "{} hashes in one call; at most {MAX_EXTERNAL_KV_HASHES}: split the request",
            hashes.len()
        )));
    }
    Ok(())
}

fn node_and_tier(node_id: &str, tier: i32) -> Result<TierType, Status> {
    if node_id.is_empty() {
        return Err(Status::invalid_argument("node_id must not be empty"));
    }
    match tier_from_wire(tier) {
        TierType::Unknown => Err(Status::invalid_argument(format!("tier {tier} is not HBM, DRAM or SSD"))),
        t => Ok(t),
    }
}

/// Runs a store call off the async workers (a Redis store blocks on its round trip).
async fn on_store<T: Send + 'static>(
    store: &Arc<dyn MetadataStore>,
    f: impl FnOnce(&dyn MetadataStore) -> Result<T, StoreError> + Send + 'static,
) -> Result<T, Status> {
    let store = Arc::clone(store);
    crate::service::blocking(move || f(&*store)).await
}

impl MasterService {
    pub(crate) async fn report_external(
        &self,
        r: v1::ReportExternalKvBlocksRequest,
    ) -> Result<v1::ReportExternalKvBlocksResponse, Status> {
        let tier = node_and_tier(&r.node_id, r.tier)?;
        check_len(&r.hashes)?;
        let node_id = r.node_id.clone();
        let outcome = on_store(&self.store, move |s| s.report_external_kv(&r.node_id, &r.hashes, tier)).await?;
        let recorded = outcome == ExternalReport::Recorded;
        if recorded {
            self.stats.external.reports_recorded.fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats.external.reports_rejected_not_alive.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(node = %node_id, "external KV report of a node that is not alive ignored");
        }
        Ok(v1::ReportExternalKvBlocksResponse { recorded })
    }

    pub(crate) async fn revoke_external(
        &self,
        r: v1::RevokeExternalKvBlocksRequest,
    ) -> Result<v1::RevokeExternalKvBlocksResponse, Status> {
        let tier = node_and_tier(&r.node_id, r.tier)?;
        check_len(&r.hashes)?;
        on_store(&self.store, move |s| s.revoke_external_kv(&r.node_id, &r.hashes, tier)).await?;
        Ok(v1::RevokeExternalKvBlocksResponse {})
    }

    pub(crate) async fn revoke_all_external(
        &self,
        r: v1::RevokeAllExternalKvBlocksAtTierRequest,
    ) -> Result<v1::RevokeAllExternalKvBlocksAtTierResponse, Status> {
        let tier = node_and_tier(&r.node_id, r.tier)?;
        on_store(&self.store, move |s| s.revoke_all_external_kv_at_tier(&r.node_id, tier)).await?;
        Ok(v1::RevokeAllExternalKvBlocksAtTierResponse {})
    }

    pub(crate) async fn match_external(
        &self,
        r: v1::MatchExternalKvRequest,
    ) -> Result<v1::MatchExternalKvResponse, Status> {
        check_len(&r.hashes)?;
        if r.hashes.is_empty() {
            return Ok(v1::MatchExternalKvResponse::default());
        }
        // On the async worker, as the other read paths: the in-memory store answers a 1,024-hash
        // match in tens of microseconds, less than a hop to the blocking pool; the Redis store moves
        // its round trip off the worker itself (`block_in_place`).
        let matches = self.store.match_external_kv(&r.hashes, r.count_as_hit).map_err(store_status)?;
        let view =
            if matches.is_empty() { Default::default() } else { self.store.alive_peer_view().map_err(store_status)? };
        let matches = matches
            .into_iter()
            .map(|m| v1::ExternalKvNodeMatch {
                peer_address: view.get(&m.node_id).map(|p| p.peer_address.to_string()).unwrap_or_default(),
                node_id: m.node_id.to_string(),
                hashes_by_tier: m
                    .hashes_by_tier
                    .into_iter()
                    .map(|(tier, hash_indexes)| v1::TierHashes { tier: tier_to_wire(tier), hash_indexes })
                    .collect(),
            })
            .collect();
        Ok(v1::MatchExternalKvResponse { matches })
    }

    pub(crate) async fn external_hit_counts(
        &self,
        r: v1::GetExternalKvHitCountsRequest,
    ) -> Result<v1::GetExternalKvHitCountsResponse, Status> {
        check_len(&r.hashes)?;
        if r.hashes.is_empty() {
            return Ok(v1::GetExternalKvHitCountsResponse::default());
        }
        let counts = self.store.external_kv_hit_counts(&r.hashes).map_err(store_status)?;
        let entries =
            counts.into_iter().map(|(hash, hit_count_total)| v1::HitCountEntry { hash, hit_count_total }).collect();
        Ok(v1::GetExternalKvHitCountsResponse { entries })
    }
}

static EXTERNAL_SKIPPED: umbp_core::RateLimited = umbp_core::RateLimited::every(umbp_core::RateLimited::WINDOW);

/// The external KV changes of one heartbeat, by the seq of the bundle each rides with.
#[derive(Default)]
pub(crate) struct HeartbeatExternal {
    by_seq: std::collections::HashMap<u64, Vec<v1::ExternalKvEvent>>,
}

impl HeartbeatExternal {
    /// Takes the request's external bundles out of it.
    pub(crate) fn take(r: &mut v1::HeartbeatRequest) -> Self {
        let mut by_seq: std::collections::HashMap<u64, Vec<v1::ExternalKvEvent>> = Default::default();
        for bundle in std::mem::take(&mut r.external_bundles) {
            by_seq.entry(bundle.seq).or_default().extend(bundle.events);
        }
        Self { by_seq }
    }

    /// Applies the changes that ride with the bundle `seq`, which the store just applied (or had
    /// applied before: the changes are idempotent, and a bundle re-sent after a lost ack must not
    /// lose them). An event the store refuses as invalid (tier unknown, a bad hash, too many) is
    /// skipped and counted, never failing the heartbeat: the node would re-send it forever.
    pub(crate) fn apply(
        &mut self,
        store: &dyn MetadataStore,
        stats: &crate::service::ServiceStats,
        node_id: &str,
        seq: u64,
    ) -> Result<(), Status> {
        let Some(events) = self.by_seq.remove(&seq) else { return Ok(()) };
        let mut skipped = 0u64;
        for event in events {
            let tier = tier_from_wire(event.tier);
            let result = match v1::ExternalKvOp::try_from(event.op) {
                Ok(v1::ExternalKvOp::ExternalKvReport) => {
                    store.report_external_kv(node_id, &event.hashes, tier).map(|o| {
                        if o == ExternalReport::Recorded {
                            stats.external.reports_recorded.fetch_add(1, Ordering::Relaxed);
                        } else {
                            stats.external.reports_rejected_not_alive.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                }
                Ok(v1::ExternalKvOp::ExternalKvRevoke) => store.revoke_external_kv(node_id, &event.hashes, tier),
                Ok(v1::ExternalKvOp::ExternalKvRevokeAllAtTier) => store.revoke_all_external_kv_at_tier(node_id, tier),
                Err(_) => Err(StoreError::InvalidArgument { reason: "unknown external KV op" }),
            };
            match result {
                Ok(()) => {}
                Err(StoreError::InvalidArgument { .. }) => skipped += 1,
                Err(e) => return Err(crate::service::store_status(e)),
            }
        }
        if skipped > 0 {
            stats.events_skipped.fetch_add(skipped, Ordering::Relaxed);
            if let Some(held_back) = EXTERNAL_SKIPPED.check() {
                tracing::warn!(node = %node_id, skipped, held_back, "dropped invalid external KV events of a heartbeat");
            }
        }
        Ok(())
    }
}

/// Drops every external record of the node (the accepted first chunk of a full sync that carries an
/// external set: revokes lost with the deltas it replaces must not linger).
pub(crate) fn clear_node(store: &dyn MetadataStore, node_id: &str) -> Result<(), Status> {
    for tier in TierType::ALL {
        store.revoke_all_external_kv_at_tier(node_id, tier).map_err(crate::service::store_status)?;
    }
    Ok(())
}
