//! The node's own external KV records (issue 21, item 2): the two-argument forms of the reference's
//! `report_external_kv_blocks(hashes, tier)`, `revoke_external_kv_blocks(hashes, tier)` and
//! `revoke_all_external_kv_blocks_at_tier(tier)`, for blocks this process holds outside the pool (an
//! engine's GPU HBM or pinned host memory). They go through the node's heartbeat outbox, not one RPC
//! each, and the node's external set is shipped again after every full sync, so a restarted master
//! rebuilds the index from its nodes (`master_client`'s `external_outbox.rs`). Matching is a
//! master call ([`MasterClient::match_external_kv`](crate::master_client::MasterClient::match_external_kv)).

use umbp_core::TierType;

use super::{PoolClient, PoolError};

impl PoolClient {
    /// This node holds the KV blocks `hashes` at `tier` outside the pool: queued for the node's next
    /// heartbeat, which is woken now (the master applies it with that heartbeat's seq).
    ///
    /// # Errors
    /// An empty `hashes` or hash, [`TierType::Unknown`], a closed client; a client that does not
    /// register with the master (a light client lending nothing) is refused: its reports would be
    /// ignored.
    pub fn report_external_kv_blocks(&self, hashes: &[String], tier: TierType) -> Result<(), PoolError> {
        self.check_registers()?;
        Ok(self.master().queue_external_kv_report(hashes, tier)?)
    }

    /// This node no longer holds `hashes` at `tier` (other tiers untouched). Queued as
    /// [`report_external_kv_blocks`](Self::report_external_kv_blocks) is.
    ///
    /// # Errors
    /// As [`report_external_kv_blocks`](Self::report_external_kv_blocks).
    pub fn revoke_external_kv_blocks(&self, hashes: &[String], tier: TierType) -> Result<(), PoolError> {
        self.check_registers()?;
        Ok(self.master().queue_external_kv_revoke(hashes, tier)?)
    }

    /// Every block this node holds at `tier` goes (the tier was wiped). Queued as
    /// [`report_external_kv_blocks`](Self::report_external_kv_blocks) is.
    ///
    /// # Errors
    /// [`TierType::Unknown`], a closed client, a client that does not register.
    pub fn revoke_all_external_kv_blocks_at_tier(&self, tier: TierType) -> Result<(), PoolError> {
        self.check_registers()?;
        Ok(self.master().queue_external_kv_revoke_all_at_tier(tier)?)
    }

    fn check_registers(&self) -> Result<(), PoolError> {
        if self.config.registers() {
            return Ok(());
        }
        Err(PoolError::Master(crate::master_client::MasterClientError::InvalidArgument(
            "this client does not register with the master (it lends no medium): external KV blocks need a \
             registered node (set register_client)"
                .into(),
        )))
    }
}
