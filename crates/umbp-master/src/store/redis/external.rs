//! The external KV index in Redis (see the store's `external` module for the contract).
//!
//! | Key | Type | Holds |
//! |---|---|---|
//! | `{P}:x:<hash>` | hash | `<tier>\|<node> → 1` per holder, and `! →` the hash's hit count once counted |
//! | `{P}:xn:<tier>:<node>` | set | the node's hashes at the tier (revoke-all and the node's wipe) |
//!
//! Every change is one script; the node's wipe (`xwipe_tier` in the scripts' prelude) runs inside
//! the registration, unregister, expiry and removal scripts, in the same step as its locations. A
//! hash goes with its last holder, and its hit count with it. A report checks the node's record in
//! the same script, so it can never land after the node's wipe.

use std::sync::LazyLock;

use redis::Script;
use umbp_core::TierType;

use super::super::external::{self, ExternalKvMatch, ExternalReport};
use super::{RedisStore, StoreError, codec};

/// `report_external_kv`. ARGV: base, node, tier, hashes. Returns 1 if recorded, 0 if the node is not
/// ALIVE (nothing written).
pub(super) static REPORT: LazyLock<Script> = LazyLock::new(|| {
    super::scripts::script(
        r#"
local id, tier = ARGV[2], ARGV[3]
if redis.call('HGET', base .. 'n:' .. id, 'st') ~= 'A' then return 0 end
local field = tier .. '|' .. id
local hs = {}
for i = 4, #ARGV do
  redis.call('HSET', base .. 'x:' .. ARGV[i], field, '1')
  hs[#hs + 1] = ARGV[i]
end
chunked('SADD', base .. 'xn:' .. tier .. ':' .. id, hs)
return 1
"#,
    )
});

/// `revoke_external_kv`. ARGV: base, node, tier, hashes. Returns 1.
pub(super) static REVOKE: LazyLock<Script> = LazyLock::new(|| {
    super::scripts::script(
        r#"
local id, tier = ARGV[2], ARGV[3]
local field = tier .. '|' .. id
local hs = {}
for i = 4, #ARGV do
  xdrop(base .. 'x:' .. ARGV[i], field)
  hs[#hs + 1] = ARGV[i]
end
chunked('SREM', base .. 'xn:' .. tier .. ':' .. id, hs)
return 1
"#,
    )
});

/// `revoke_all_external_kv_at_tier`. ARGV: base, node, tier. Returns 1.
pub(super) static REVOKE_ALL: LazyLock<Script> = LazyLock::new(|| {
    super::scripts::script(
        r#"
xwipe_tier(ARGV[2], ARGV[3])
return 1
"#,
    )
});

/// `match_external_kv`. ARGV: base, `1` to count hits (else `0`), distinct hashes. Returns per hash
/// the fields of its entry (holders, and the hit field if counted before); with counting, a held
/// hash's count goes up by one.
pub(super) static MATCH: LazyLock<Script> = LazyLock::new(|| {
    super::scripts::script(
        r#"
local count = ARGV[2] == '1'
local res = {}
for i = 3, #ARGV do
  local xk = base .. 'x:' .. ARGV[i]
  local fields = redis.call('HKEYS', xk)
  if count and #fields > 0 then redis.call('HINCRBY', xk, HITS, 1) end
  res[#res + 1] = fields
end
return res
"#,
    )
});

/// The hit-count field of an entry (also the prelude's `HITS`).
const HITS: &str = "!";

impl RedisStore {
    fn entry_key(&self, hash: &str) -> String {
        format!("{}x:{hash}", self.base)
    }

    pub(super) fn x_report(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<ExternalReport, StoreError> {
        external::check_node_tier(node_id, tier)?;
        external::check_hashes(hashes, true)?;
        let recorded: i64 = self.invoke(&REPORT, |inv| {
            inv.arg(node_id).arg(tier.wire());
            for hash in hashes {
                inv.arg(hash.as_str());
            }
        })?;
        Ok(if recorded == 1 { ExternalReport::Recorded } else { ExternalReport::NodeNotAlive })
    }

    pub(super) fn x_revoke(&self, node_id: &str, hashes: &[String], tier: TierType) -> Result<(), StoreError> {
        external::check_node_tier(node_id, tier)?;
        external::check_hashes(hashes, true)?;
        let _: i64 = self.invoke(&REVOKE, |inv| {
            inv.arg(node_id).arg(tier.wire());
            for hash in hashes {
                inv.arg(hash.as_str());
            }
        })?;
        Ok(())
    }

    pub(super) fn x_revoke_all(&self, node_id: &str, tier: TierType) -> Result<(), StoreError> {
        external::check_node_tier(node_id, tier)?;
        let _: i64 = self.invoke(&REVOKE_ALL, |inv| {
            inv.arg(node_id).arg(tier.wire());
        })?;
        Ok(())
    }

    pub(super) fn x_match(&self, hashes: &[String], count_as_hit: bool) -> Result<Vec<ExternalKvMatch>, StoreError> {
        external::check_hashes(hashes, false)?;
        let wanted = external::distinct(hashes);
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let reply: Vec<Vec<String>> = self.invoke(&MATCH, |inv| {
            inv.arg(if count_as_hit { "1" } else { "0" });
            for (_, hash) in &wanted {
                inv.arg(*hash);
            }
        })?;
        if reply.len() != wanted.len() {
            return Err(codec::corrupt("external match reply length"));
        }
        let mut hits = Vec::new();
        for ((index, _), fields) in wanted.iter().zip(&reply) {
            for field in fields.iter().filter(|f| f.as_str() != HITS) {
                let (tier, node) = field.split_once('|').ok_or_else(|| codec::corrupt("external record field"))?;
                let tier = tier.parse::<u32>().map(TierType::from_wire).map_err(|_| codec::corrupt("external tier"))?;
                hits.push((*index, node, tier));
            }
        }
        Ok(external::group_matches(hits))
    }

    pub(super) fn x_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, StoreError> {
        external::check_hashes(hashes, false)?;
        let wanted = external::distinct(hashes);
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let counts: Vec<Option<u64>> = self.pool.with(|con| {
            let mut pipe = redis::pipe();
            for (_, hash) in &wanted {
                pipe.cmd("HGET").arg(self.entry_key(hash)).arg(HITS);
            }
            pipe.query(con)
        })?;
        Ok(wanted
            .into_iter()
            .zip(counts)
            .filter_map(|((_, h), c)| c.filter(|&c| c > 0).map(|c| (h.to_owned(), c)))
            .collect())
    }
}
