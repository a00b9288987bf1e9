//! The external KV index calls of [`MasterClient`] (issue 21, item 2): report, revoke and match KV
//! blocks a node holds outside the pool (an engine's GPU HBM or pinned host memory), so a scheduler
//! can route a request to the node that already holds its prefix.
//!
//! These are the three-argument forms, one RPC each, for schedulers and sidecars reporting on
//! behalf of a registered node; they need no heartbeat and no medium. A
//! [`connect_light`](MasterClient::connect_light) client lends nothing and starts nothing: it may
//! [`register`](MasterClient::register) (as a client record) so that its own id can hold blocks, or
//! report for other live nodes. The master ignores (answers `recorded = false`) a report for a node
//! that is not live, and drops a node's records when it expires, so records reported here are tied
//! to the named node's registration and are not replayed by any full sync.

use std::sync::Arc;

use umbp_core::{BackendRegistry, TierType};
use umbp_proto::convert::{tier_from_wire, tier_to_wire};
use umbp_proto::v1 as pb;

use super::{MasterClient, MasterClientConfig, MasterClientError, NodeRegistration};

/// One node that holds some of the hashes a [`match_external_kv`](MasterClient::match_external_kv)
/// asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalKvNodeMatch {
    /// The holding node.
    pub node_id: String,
    /// Its peer-service address as registered; empty for a node that registered none.
    pub peer_address: String,
    /// The matched hashes by tier, fastest tier first, each in request order; a hash held on two
    /// tiers is in both.
    pub hashes_by_tier: Vec<(TierType, Vec<String>)>,
}

impl ExternalKvNodeMatch {
    /// Distinct hashes matched on this node (a hash on two tiers counts once): how much of the
    /// prompt the node holds.
    pub fn matched_hash_count(&self) -> usize {
        let mut all: Vec<&str> =
            self.hashes_by_tier.iter().flat_map(|(_, hashes)| hashes.iter().map(String::as_str)).collect();
        all.sort_unstable();
        all.dedup();
        all.len()
    }
}

fn check(node_id: &str, tier: TierType) -> Result<(), MasterClientError> {
    if node_id.is_empty() {
        return Err(MasterClientError::InvalidArgument("node_id must not be empty".into()));
    }
    if tier == TierType::Unknown {
        return Err(MasterClientError::InvalidArgument("an external block needs a tier (HBM, DRAM or SSD)".into()));
    }
    Ok(())
}

fn check_hashes(hashes: &[String]) -> Result<(), MasterClientError> {
    if hashes.is_empty() {
        return Err(MasterClientError::InvalidArgument("hashes must not be empty".into()));
    }
    Ok(())
}

impl MasterClient {
    /// A client of the master that lends no medium and starts no heartbeat: for schedulers and
    /// sidecars that report, revoke and match external KV blocks (and route, look up or read the
    /// cluster status). Nothing is registered until [`register`](Self::register).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub async fn connect_light(
        master_addr: &str,
        config: MasterClientConfig,
        node: NodeRegistration,
    ) -> Result<Self, MasterClientError> {
        Self::connect(master_addr, config, node, Arc::new(BackendRegistry::new())).await
    }

    /// Records at the master that `node_id` holds the KV blocks `hashes` at `tier` (additive).
    /// Returns whether the master recorded them: `false` when `node_id` is not a live registered node
    /// (the report is ignored).
    ///
    /// # Errors
    /// An empty `node_id` or `hashes`, [`TierType::Unknown`], more hashes than the master takes in
    /// one call (16384) — [`InvalidArgument`](MasterClientError::InvalidArgument) or the master's
    /// `INVALID_ARGUMENT` — and RPC failures.
    pub async fn report_external_kv_blocks(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<bool, MasterClientError> {
        check(node_id, tier)?;
        check_hashes(hashes)?;
        let request = pb::ReportExternalKvBlocksRequest {
            node_id: node_id.into(),
            hashes: hashes.to_vec(),
            tier: tier_to_wire(tier),
        };
        let reply = self
            .inner
            .call("ReportExternalKvBlocks", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                c.report_external_kv_blocks(r).await
            })
            .await?;
        Ok(reply.recorded)
    }

    /// Drops the records of `hashes` of `node_id` at `tier` (no liveness check; absent ones are
    /// ignored).
    ///
    /// # Errors
    /// As [`report_external_kv_blocks`](Self::report_external_kv_blocks).
    pub async fn revoke_external_kv_blocks(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<(), MasterClientError> {
        check(node_id, tier)?;
        check_hashes(hashes)?;
        let request = pb::RevokeExternalKvBlocksRequest {
            node_id: node_id.into(),
            hashes: hashes.to_vec(),
            tier: tier_to_wire(tier),
        };
        self.inner
            .call("RevokeExternalKvBlocks", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                c.revoke_external_kv_blocks(r).await
            })
            .await?;
        Ok(())
    }

    /// Drops every record of `node_id` at `tier` (a wiped tier; no liveness check).
    ///
    /// # Errors
    /// An empty `node_id`, [`TierType::Unknown`]; RPC failures.
    pub async fn revoke_all_external_kv_blocks_at_tier(
        &self,
        node_id: &str,
        tier: TierType,
    ) -> Result<(), MasterClientError> {
        check(node_id, tier)?;
        let request = pb::RevokeAllExternalKvBlocksAtTierRequest { node_id: node_id.into(), tier: tier_to_wire(tier) };
        self.inner
            .call("RevokeAllExternalKvBlocksAtTier", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                c.revoke_all_external_kv_blocks_at_tier(r).await
            })
            .await?;
        Ok(())
    }

    /// Per node that holds any of `hashes` (sorted by node id), the hashes it holds by tier. With
    /// `count_as_hit` (the real routing path only), each distinct matched hash's hit counter goes up
    /// by one. An empty `hashes` matches nothing (no RPC).
    ///
    /// # Errors
    /// More hashes than the master takes in one call; RPC failures.
    pub async fn match_external_kv(
        &self,
        hashes: &[String],
        count_as_hit: bool,
    ) -> Result<Vec<ExternalKvNodeMatch>, MasterClientError> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let request = pb::MatchExternalKvRequest { hashes: hashes.to_vec(), count_as_hit };
        let reply = self
            .inner
            .call("MatchExternalKv", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                c.match_external_kv(r).await
            })
            .await?;
        let named = |indexes: Vec<u32>| -> Result<Vec<String>, MasterClientError> {
            indexes
                .into_iter()
                .map(|i| {
                    hashes.get(i as usize).cloned().ok_or(MasterClientError::MalformedReply {
                        rpc: "MatchExternalKv",
                        reason: format!("hash index {i} of a {}-hash request", hashes.len()),
                    })
                })
                .collect()
        };
        reply
            .matches
            .into_iter()
            .map(|m| {
                let hashes_by_tier = m
                    .hashes_by_tier
                    .into_iter()
                    .map(|t| Ok((tier_from_wire(t.tier), named(t.hash_indexes)?)))
                    .collect::<Result<_, MasterClientError>>()?;
                Ok(ExternalKvNodeMatch { node_id: m.node_id, peer_address: m.peer_address, hashes_by_tier })
            })
            .collect()
    }

    /// `(hash, hit count)` for each distinct hash of `hashes` a counted match found while some node
    /// held it (sparse: others are left out), in request order.
    ///
    /// # Errors
    /// More hashes than the master takes in one call; RPC failures.
    pub async fn get_external_kv_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, MasterClientError> {
        if hashes.is_empty() {
            return Ok(Vec::new());
        }
        let request = pb::GetExternalKvHitCountsRequest { hashes: hashes.to_vec() };
        let reply = self
            .inner
            .call("GetExternalKvHitCounts", self.inner.config.rpc_timeout, request, |mut c, r| async move {
                c.get_external_kv_hit_counts(r).await
            })
            .await?;
        Ok(reply.entries.into_iter().map(|e| (e.hash, e.hit_count_total)).collect())
    }
}
