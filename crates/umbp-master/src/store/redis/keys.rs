//! Names of the Redis keys of one [`RedisStore`](super::RedisStore) (see the module docs' layout).
//!
//! Every name starts with the store's *base*, `{PREFIX}:`: the braces are a Redis Cluster hash tag,
//! so every key of a store hashes to one slot and each script's keys (declared or built inside the
//! script from the base) are served by one shard.

/// The base of every key of a store with `prefix`: `{prefix}:`.
pub(super) fn base(prefix: &str) -> String {
    format!("{{{prefix}}}:")
}

/// The set of node ids that have a record (the scripts build it from the base).
#[cfg(test)]
pub(super) fn nodes(base: &str) -> String {
    format!("{base}nodes")
}

/// A node's record (a hash).
pub(super) fn node(base: &str, node_id: &str) -> String {
    format!("{base}n:{node_id}")
}

/// A node's reverse index: `key → tiers it holds the key on` (a hash).
pub(super) fn node_keys(base: &str, node_id: &str) -> String {
    format!("{base}nk:{node_id}")
}

/// A key's entry: its replicas and route-get stamps (a hash).
pub(super) fn entry(base: &str, key: &str) -> String {
    format!("{base}k:{key}")
}

/// The number of entries (distinct keys) in the index.
pub(super) fn key_total(base: &str) -> String {
    format!("{base}keys")
}

/// Entry field of the route-get stamps, `lease_until|last_accessed|access_count` (decimal): one
/// field, so that a route-get writes all three in one `HSET`.
pub(super) const STAMPS: &str = "!";
/// Stamp fields every entry carries (an entry with no more fields than these holds no replica).
pub(super) const STAMP_FIELDS: usize = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_a_store_carries_its_hash_tag() {
        let b = base("umbp");
        assert_eq!(b, "{umbp}:");
        for name in [nodes(&b), node(&b, "n1"), node_keys(&b, "n1"), entry(&b, "k{x}"), key_total(&b)] {
            assert!(name.starts_with("{umbp}:"), "{name}");
        }
    }
}
