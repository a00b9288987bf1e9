//! Conversions between the store's types and what Redis holds: decimal strings, the compact encodings
//! of a node's tags and capacities, and the replica fields of an entry.
//!
//! Numbers are kept as decimal strings and compared in the scripts after zero-padding to 20 digits,
//! so every `u64` (incarnations are often nanosecond timestamps, above a Lua double's 2^53) keeps
//! its exact value and order.

use std::collections::HashMap;
use std::sync::Arc;

use umbp_core::TierType;

use crate::store::{KeyStats, Location, NodeRecord, NodeStatus, StoreError, TierCap};

/// A value Redis handed back that this store never writes: the data is not ours or was corrupted.
pub(super) fn corrupt(what: &str) -> StoreError {
    StoreError::Backend { message: format!("unexpected data in Redis: {what}"), retryable: false, source: None }
}

/// Tags as `len:tag` runs (any byte may appear in a tag).
pub(super) fn encode_tags(tags: &[String]) -> String {
    tags.iter().map(|tag| format!("{}:{tag}", tag.len())).collect()
}

/// The inverse of [`encode_tags`].
pub(super) fn decode_tags(mut s: &str) -> Result<Vec<String>, StoreError> {
    let mut tags = Vec::new();
    while !s.is_empty() {
        let (len, rest) = s.split_once(':').ok_or_else(|| corrupt("tags"))?;
        let len: usize = len.parse().map_err(|_| corrupt("tag length"))?;
        let tag = rest.get(..len).ok_or_else(|| corrupt("tag"))?;
        tags.push(tag.to_owned());
        s = rest.get(len..).ok_or_else(|| corrupt("tag"))?;
    }
    Ok(tags)
}

/// Capacities as `tier:total:available:page` joined by `,`.
pub(super) fn encode_caps(caps: &[TierCap]) -> String {
    let parts: Vec<String> = caps
        .iter()
        .map(|c| format!("{}:{}:{}:{}", c.tier.wire(), c.total_bytes, c.available_bytes, c.page_size))
        .collect();
    parts.join(",")
}

/// The inverse of [`encode_caps`]. A record an older master wrote has no page field
/// (`tier:total:available`): its page size reads as 0, unknown.
pub(super) fn decode_caps(s: &str) -> Result<Vec<TierCap>, StoreError> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|part| {
            let mut it = part.split(':');
            let mut next = || -> Result<u64, StoreError> {
                it.next().and_then(|v| v.parse().ok()).ok_or_else(|| corrupt("capacity"))
            };
            let tier = u32::try_from(next()?).map_err(|_| corrupt("tier"))?;
            let cap = TierCap::new(TierType::from_wire(tier), next()?, next()?);
            let page_size = match it.next() {
                None => 0,
                Some(v) => v.parse().map_err(|_| corrupt("page size"))?,
            };
            Ok(cap.with_page_size(page_size))
        })
        .collect()
}

/// Parses a decimal field; absent is 0.
pub(super) fn num(fields: &HashMap<String, String>, name: &str) -> Result<u64, StoreError> {
    fields.get(name).map_or(Ok(0), |v| v.parse().map_err(|_| corrupt(name)))
}

/// A node record from its hash (`HGETALL`); `None` for an absent (empty) hash.
pub(super) fn node_record(
    node_id: &str,
    mut fields: HashMap<String, String>,
) -> Result<Option<NodeRecord>, StoreError> {
    if fields.is_empty() {
        return Ok(None);
    }
    let mut take = |name: &str| fields.remove(name).unwrap_or_default();
    let status = match take("st").as_str() {
        "A" => NodeStatus::Alive,
        "E" => NodeStatus::Expired,
        _ => return Err(corrupt("node status")),
    };
    let (node_address, peer, data, tags, caps) = (take("addr"), take("peer"), take("data"), take("tags"), take("caps"));
    Ok(Some(NodeRecord {
        node_id: Arc::from(node_id),
        node_address,
        peer_address: Arc::from(peer),
        data_endpoint: Arc::from(data),
        tags: decode_tags(&tags)?,
        status,
        last_heartbeat_ms: num(&fields, "hb")?,
        registered_at_ms: num(&fields, "reg")?,
        last_applied_seq: num(&fields, "seq")?,
        caps: decode_caps(&caps)?,
        incarnation: num(&fields, "inc")?,
    }))
}

/// The replica field of `(node, tier)` in an entry: `tier|node`.
#[cfg(test)]
pub(super) fn replica_field(node_id: &str, tier: TierType) -> String {
    format!("{}|{node_id}", tier.wire())
}

/// Splits a replica field into `(tier, node)`; `None` for a stamp field.
pub(super) fn parse_replica_field(field: &str) -> Option<(TierType, &str)> {
    if field.starts_with('!') {
        return None;
    }
    let (tier, node) = field.split_once('|')?;
    Some((TierType::from_wire(tier.parse().ok()?), node))
}

/// The size in a replica value `size|sync_tag`.
pub(super) fn replica_size(value: &str) -> Result<u64, StoreError> {
    value.split_once('|').and_then(|(size, _)| size.parse().ok()).ok_or_else(|| corrupt("replica"))
}

/// The locations of an entry from its fields in order (`HGETALL` as a flat list), stamps skipped.
pub(super) fn entry_locations(flat: &[String]) -> Result<Vec<Location>, StoreError> {
    let mut out = Vec::new();
    for pair in flat.chunks_exact(2) {
        let [field, value] = pair else { continue };
        let Some((tier, node)) = parse_replica_field(field) else { continue };
        out.push(Location { node_id: Arc::from(node), tier, size: replica_size(value)? });
    }
    Ok(out)
}

/// The locations of an entry (`HGETALL` as a flat list) on nodes not in `exclude`.
pub(super) fn entry_locations_except(flat: &[String], exclude: &[String]) -> Result<Vec<Location>, StoreError> {
    let mut out = entry_locations(flat)?;
    if !exclude.is_empty() {
        out.retain(|l| !exclude.iter().any(|e| *e == *l.node_id));
    }
    Ok(out)
}

/// Route-get stamps from an entry's stamps field (`lease|accessed|count`); `None` if the entry is
/// absent.
pub(super) fn key_stats(value: Option<&str>) -> Result<Option<KeyStats>, StoreError> {
    let Some(value) = value else { return Ok(None) };
    let mut it = value.split('|').map(|v| v.parse::<u64>().map_err(|_| corrupt("entry stamps")));
    let mut next = || it.next().unwrap_or_else(|| Err(corrupt("entry stamps")));
    let stats = KeyStats { lease_until_ms: next()?, last_accessed_ms: next()?, access_count: next()? };
    if it.next().is_some() {
        return Err(corrupt("entry stamps"));
    }
    Ok(Some(stats))
}

#[cfg(test)]
mod tests {
    use super::super::keys;
    use super::*;

    #[test]
    fn tags_and_caps_round_trip() {
        let tags = vec!["role=a".to_owned(), String::new(), "x:3:,|y".to_owned()];
        assert_eq!(decode_tags(&encode_tags(&tags)).ok(), Some(tags));
        let caps =
            vec![TierCap::new(TierType::Dram, u64::MAX, 7).with_page_size(2 << 20), TierCap::new(TierType::Ssd, 0, 0)];
        assert_eq!(decode_caps(&encode_caps(&caps)).ok(), Some(caps));
        assert_eq!(decode_caps("").ok(), Some(Vec::new()));
        assert!(decode_caps("2:x:1").is_err());
        assert!(decode_caps("2:10:1:x").is_err());
        // An older master's record (no page field): page size unknown.
        assert_eq!(decode_caps("2:10:1").ok(), Some(vec![TierCap::new(TierType::Dram, 10, 1)]));
        assert!(decode_tags("9:ab").is_err());
    }

    #[test]
    fn replica_fields_split_at_the_first_bar() {
        assert_eq!(parse_replica_field(&replica_field("n|1", TierType::Hbm)), Some((TierType::Hbm, "n|1")));
        assert_eq!(parse_replica_field(keys::STAMPS), None);
        assert_eq!(replica_size("42|7").ok(), Some(42));
    }

    #[test]
    fn stamps_parse_or_report_corruption() {
        let stats = key_stats(Some("9|8|7")).ok().flatten();
        assert_eq!(stats, Some(KeyStats { lease_until_ms: 9, last_accessed_ms: 8, access_count: 7 }));
        assert_eq!(key_stats(None).ok(), Some(None));
        assert!(key_stats(Some("9|8")).is_err());
        assert!(key_stats(Some("9|8|7|6")).is_err());
        assert!(key_stats(Some("9|x|7")).is_err());
    }
}
