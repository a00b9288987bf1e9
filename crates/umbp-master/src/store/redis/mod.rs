//! [`RedisStore`]: the metadata store in a Redis, shared by any number of masters.
//!
//! It gives the same answers as [`InMemoryStore`](super::InMemoryStore) on the same calls (the store
//! contract suite, `tests/store_*.rs`, runs against both). Every write is one Lua script
//! ([`scripts`]), so each is atomic in Redis the way the in-memory store's node lock makes it
//! atomic in one process; reads that need no atomicity are pipelined plain commands.
//!
//! # Key layout
//! Every key of a store starts with `{PREFIX}:` (prefix [`DEFAULT_PREFIX`] unless configured), so
//! several stores can share one Redis database. The braces are a Redis Cluster *hash tag*: all keys
//! of a store hash to one slot, so every script's keys live on one shard and the scripts run
//! unchanged on a cluster (on one of its shards; spreading the index over shards is client-side
//! sharding's job, each shard a store with its own prefix).
//!
//! | Key | Type | Holds |
//! |---|---|---|
//! | `{P}:nodes` | set | ids of every node with a record |
//! | `{P}:n:<node>` | hash | the record: `st` (`A` alive / `E` expired), `inc`, `hb`, `reg`, `seq`, `addr`, `peer`, `data`, `tags`, `caps`, and while a chunked full sync runs `fsb` (its baseline) and `fsn` (the next chunk) |
//! | `{P}:nk:<node>` | hash | the node's reverse index: `key →` how many tiers it holds the key on (`HLEN` = the node's key count) |
//! | `{P}:k:<key>` | hash | the entry: `<tier>\|<node> → <size>\|<sync tag>` per replica, and `!` → `<lease until>\|<last access>\|<access count>` (the route-get stamps, one field so that a route-get writes them in one `HSET`; written with the entry's first replica) |
//! | `{P}:keys` | string | the number of entries (distinct keys) |
//! | `{P}:x:<hash>`, `{P}:xn:<tier>:<node>` | hash, set | the external KV index (see [`external`]) |
//! | `{P}:lease:<name>` | string | the holder's token of a master lease (`duties`: the reaper and eviction rounds), with a TTL on Redis's clock |
//!
//! Numbers are decimal strings; tags are `len:tag` runs and capacities `tier:total:available`
//! joined by `,` ([`codec`]). A replica exists only for an ALIVE node: registration, expiry and
//! unregister wipe a node's replicas in the same script as its record, so reads never consult
//! records. An entry with no replica is deleted with its stamps.
//!
//! # Errors
//! A Redis that cannot be reached, times out ([`RedisTimeouts`]) or is loading gives a retryable
//! [`StoreError::Backend`] ([`ErrorKind::Unavailable`](umbp_core::ErrorKind::Unavailable)); data
//! this store did not write, a non-retryable one. Nothing waits longer than the timeouts.
//!
//! # Costs
//! A write costs one round trip; wiping or sweeping a node runs in one script over its keys (Redis
//! serves nothing else meanwhile, as the in-memory store holds a shard lock). One Redis thread serves
//! every master, so the scripts spend as few `redis.call`s as the semantics allow (each costs about
//! a microsecond of Redis CPU beyond the command's own work, converting arguments and reply):
//!
//! - a heartbeat ADD of a key no entry has yet is one `HSET` (entry, stamps and replica) plus its
//!   share of one `EXISTS` per run of 32 ADDs; of an existing entry, one `HMGET` and at most one
//!   `HSET`. The node's reverse index and the entry count change once per heartbeat (one `HMGET`,
//!   one `HSET` of every changed key, one `INCRBY`), not once per event. An event is three
//!   arguments (`A<tier>`/`R<tier>`, key, replica value), the values built by the master, not by
//!   the script;
//! - a route-get of a found key is one `HGETALL` (replicas and stamps) and one `HSET` of the stamps;
//!   the master drops the stamps and the excluded nodes' replicas from the reply;
//! - the node list and the peer view are one read-only script each (one round trip).
//!
//! Calls block on Redis; made from a worker of a multi-thread tokio runtime they run under
//! `block_in_place`, so a master handler that calls the store from an async fn does not hold one of
//! the runtime's few workers for a Redis round trip.

mod codec;
mod conn;
mod external;
mod keys;
mod scripts;

use std::collections::HashMap;
use std::fmt;
use std::fmt::Write as _;
use std::sync::Arc;

use redis::{Connection, Script};
use umbp_core::{KvEventKind, TierType};

use conn::Pool;
pub use conn::RedisTimeouts;

use super::{
    EvictionCandidate, ExternalKvMatch, ExternalReport, HeartbeatApply, HeartbeatKind, HeartbeatOutcome, KeyStats,
    Location, MetadataStore, NodeRecord, NodeStatus, PeerView, RegisterOutcome, Registration, StoreError, TierCap,
};

/// The key prefix of [`RedisStore::connect`].
pub const DEFAULT_PREFIX: &str = "umbp";

/// Retries of the capacity compare-and-set before it reports contention as a retryable error.
const CAS_ATTEMPTS: usize = 64;

/// The [`MetadataStore`] in Redis.
///
/// ```no_run
/// use umbp_master::store::{MetadataStore, RedisStore};
///
/// # fn main() -> Result<(), umbp_master::store::StoreError> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379/0")?;
/// assert_eq!(store.key_count()?, 0);
/// # Ok(())
/// # }
/// ```
pub struct RedisStore {
    pool: Pool,
    prefix: String,
    base: String,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore").field("url", &self.pool.url()).field("prefix", &self.prefix).finish()
    }
}

impl RedisStore {
    /// A store at `url` (`redis://HOST:PORT[/DB]`) under [`DEFAULT_PREFIX`], with the default
    /// timeouts. Connects once, loading the scripts, so a wrong address fails here.
    ///
    /// # Errors
    /// An invalid URL; Redis unreachable (retryable).
    pub fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with(url, DEFAULT_PREFIX, RedisTimeouts::default())
    }

    /// A store at `url` whose keys start with `{prefix}:`.
    ///
    /// # Errors
    /// An empty prefix or one with a brace; an invalid URL; Redis unreachable (retryable).
    pub fn connect_with(url: &str, prefix: &str, timeouts: RedisTimeouts) -> Result<Self, StoreError> {
        if prefix.is_empty() || prefix.contains(['{', '}']) {
            return Err(StoreError::InvalidArgument { reason: "Redis key prefix must be non-empty, without braces" });
        }
        let store = Self { pool: Pool::new(url, timeouts)?, prefix: prefix.to_owned(), base: keys::base(prefix) };
        store.pool.with(|con| redis::cmd("PING").query::<()>(con))?;
        Ok(store)
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The route-get stamps of a key in the index, as [`InMemoryStore::key_stats`](super::InMemoryStore::key_stats).
    ///
    /// # Errors
    /// Backend failures.
    pub fn key_stats(&self, key: &str) -> Result<Option<KeyStats>, StoreError> {
        let value: Option<String> =
            self.pool.with(|con| redis::cmd("HGET").arg(keys::entry(&self.base, key)).arg(keys::STAMPS).query(con))?;
        codec::key_stats(value.as_deref())
    }

    fn invoke<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        args: impl FnOnce(&mut redis::ScriptInvocation<'_>),
    ) -> Result<T, StoreError> {
        let mut invocation = script.prepare_invoke();
        invocation.arg(&self.base);
        args(&mut invocation);
        self.pool.with(|con: &mut Connection| invocation.invoke(con))
    }

    /// Reads, changes and compare-and-sets an ALIVE node's caps on `tier`.
    fn adjust_available(
        &self,
        node_id: &str,
        tier: TierType,
        to: impl Fn(&TierCap) -> u64,
    ) -> Result<Option<TierCap>, StoreError> {
        let node_key = keys::node(&self.base, node_id);
        for _ in 0..CAS_ATTEMPTS {
            let (status, raw): (Option<String>, Option<String>) =
                self.pool.with(|con| redis::cmd("HMGET").arg(&node_key).arg("st").arg("caps").query(con))?;
            let (Some("A"), Some(raw)) = (status.as_deref(), raw) else { return Ok(None) };
            let mut caps = codec::decode_caps(&raw)?;
            let Some(cap) = caps.iter_mut().find(|c| c.tier == tier) else { return Ok(None) };
            cap.available_bytes = to(cap);
            let after = *cap;
            let written: i64 = self.invoke(&scripts::CAPS_CAS, |inv| {
                inv.arg(node_id).arg(&raw).arg(codec::encode_caps(&caps));
            })?;
            if written == 1 {
                return Ok(Some(after));
            }
        }
        Err(StoreError::Backend {
            message: format!("capacity of node {node_id} changed under {CAS_ATTEMPTS} attempts"),
            retryable: true,
            source: None,
        })
    }

    fn records(&self, alive_only: bool) -> Result<Vec<NodeRecord>, StoreError> {
        let reply: Vec<(String, HashMap<String, String>)> = self.invoke(&scripts::NODES, |inv| {
            inv.arg(if alive_only { "1" } else { "0" });
        })?;
        let mut out = Vec::with_capacity(reply.len());
        for (id, fields) in reply {
            if let Some(record) = codec::node_record(&id, fields)?
                && (!alive_only || record.status == NodeStatus::Alive)
            {
                out.push(record);
            }
        }
        out.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        Ok(out)
    }
}

/// A script's `{code, number}` reply.
fn coded(reply: &(String, String)) -> Result<(&str, u64), StoreError> {
    let value = reply.1.parse().map_err(|_| codec::corrupt("script reply"))?;
    Ok((reply.0.as_str(), value))
}

impl MetadataStore for RedisStore {
    fn register(&self, reg: Registration, now_ms: u64, stale_after_ms: u64) -> Result<RegisterOutcome, StoreError> {
        if reg.node_id.is_empty() {
            return Err(StoreError::InvalidArgument { reason: "empty node_id" });
        }
        let reply: (String, String) = self.invoke(&scripts::REGISTER, |inv| {
            inv.arg(&reg.node_id)
                .arg(now_ms)
                .arg(now_ms.saturating_sub(stale_after_ms))
                .arg(reg.incarnation)
                .arg(&reg.node_address)
                .arg(&reg.peer_address)
                .arg(&reg.data_endpoint)
                .arg(codec::encode_tags(&reg.tags))
                .arg(codec::encode_caps(&reg.tier_capacities));
        })?;
        Ok(match coded(&reply)? {
            ("R", _) => RegisterOutcome::Registered,
            ("E", _) => RegisterOutcome::AlreadyExists,
            ("P", previous) => RegisterOutcome::Replaced { previous },
            ("S", current) => RegisterOutcome::Superseded { current },
            _ => return Err(codec::corrupt("register reply")),
        })
    }

    fn unregister_incarnation(&self, node_id: &str, incarnation: u64) -> Result<bool, StoreError> {
        let erased: i64 = self.invoke(&scripts::UNREGISTER, |inv| {
            inv.arg(node_id).arg(incarnation);
        })?;
        Ok(erased == 1)
    }

    fn apply_heartbeat(&self, hb: HeartbeatApply) -> Result<HeartbeatOutcome, StoreError> {
        let HeartbeatApply { node_id, now_ms, caps, kind, incarnation } = hb;
        let reply: (String, String) = self.invoke(&scripts::HEARTBEAT, |inv| {
            inv.arg(&node_id).arg(now_ms).arg(codec::encode_caps(&caps)).arg(incarnation);
            let (events, tag) = match &kind {
                HeartbeatKind::Keepalive => {
                    inv.arg("K");
                    return;
                }
                HeartbeatKind::Delta { seq, events } => {
                    inv.arg("D").arg(*seq).arg(seq.saturating_sub(1));
                    (events, 0)
                }
                HeartbeatKind::FullSyncChunk { baseline_seq, chunk_index, is_final, events } => {
                    inv.arg("S")
                        .arg(*baseline_seq)
                        .arg(*chunk_index)
                        .arg(if *is_final { "1" } else { "0" })
                        .arg(chunk_index.saturating_add(1));
                    (events, *baseline_seq)
                }
            };
            // The replica values are built here, not in the script: Redis's one thread is the
            // scarce CPU.
            let (mut op, mut value) = (String::new(), String::new());
            for event in events.iter().filter(|e| e.tier != TierType::Unknown) {
                op.clear();
                value.clear();
                let _ = match event.kind {
                    KvEventKind::Add => write!(op, "A{}", event.tier.wire()),
                    KvEventKind::Remove => write!(op, "R{}", event.tier.wire()),
                };
                let _ = write!(value, "{}|{tag}", event.size);
                inv.arg(op.as_str()).arg(event.key.as_str()).arg(value.as_str());
            }
        })?;
        Ok(match coded(&reply)? {
            ("A", acked_seq) => HeartbeatOutcome::Applied { acked_seq },
            ("R", acked_seq) => HeartbeatOutcome::AlreadyApplied { acked_seq },
            ("G", acked_seq) => HeartbeatOutcome::SeqGap { acked_seq },
            ("U", _) => HeartbeatOutcome::Unknown,
            ("S", current) => HeartbeatOutcome::Superseded { current },
            _ => return Err(codec::corrupt("heartbeat reply")),
        })
    }

    fn expire_stale(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        let mut ids: Vec<String> = self.invoke(&scripts::EXPIRE, |inv| {
            inv.arg(cutoff_ms);
        })?;
        ids.sort();
        Ok(ids)
    }

    fn remove_expired(&self, cutoff_ms: u64) -> Result<Vec<String>, StoreError> {
        let mut ids: Vec<String> = self.invoke(&scripts::REMOVE_EXPIRED, |inv| {
            inv.arg(cutoff_ms);
        })?;
        ids.sort();
        Ok(ids)
    }

    fn credit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<(), StoreError> {
        self.adjust_available(node_id, tier, |cap| cap.available_bytes.saturating_add(bytes).min(cap.total_bytes))?;
        Ok(())
    }

    fn debit_capacity(&self, node_id: &str, tier: TierType, bytes: u64) -> Result<Option<TierCap>, StoreError> {
        self.adjust_available(node_id, tier, |cap| cap.available_bytes.saturating_sub(bytes))
    }

    fn lookup(&self, key: &str) -> Result<Vec<Location>, StoreError> {
        let flat: Vec<String> =
            self.pool.with(|con| redis::cmd("HGETALL").arg(keys::entry(&self.base, key)).query(con))?;
        codec::entry_locations(&flat)
    }

    fn batch_lookup_for_route_get(
        &self,
        keys: &[String],
        exclude: &[String],
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Vec<Vec<Location>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let reply: Vec<Vec<String>> = self.invoke(&scripts::ROUTE_GET, |inv| {
            inv.arg(now_ms).arg(now_ms.saturating_add(lease_ms)).arg(exclude.len());
            for node in exclude {
                inv.arg(node.as_str());
            }
            for key in keys {
                inv.arg(key.as_str());
            }
        })?;
        if reply.len() != keys.len() {
            return Err(codec::corrupt("route-get reply length"));
        }
        reply.iter().map(|flat| codec::entry_locations_except(flat, exclude)).collect()
    }

    fn batch_exists(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let lens: Vec<usize> = self.pool.with(|con| {
            let mut pipe = redis::pipe();
            for key in keys {
                pipe.cmd("HLEN").arg(keys::entry(&self.base, key));
            }
            pipe.query(con)
        })?;
        Ok(lens.into_iter().map(|len| len > keys::STAMP_FIELDS).collect())
    }

    fn enumerate_eviction_candidates(
        &self,
        buckets: &[(String, TierType)],
        now_ms: u64,
        max_per_bucket: usize,
    ) -> Result<Vec<EvictionCandidate>, StoreError> {
        let mut distinct: Vec<(&str, TierType)> = Vec::with_capacity(buckets.len());
        for (node, tier) in buckets {
            if !distinct.iter().any(|(n, t)| *n == node.as_str() && t == tier) {
                distinct.push((node.as_str(), *tier));
            }
        }
        if distinct.is_empty() {
            return Ok(Vec::new());
        }
        let reply: Vec<Vec<String>> = self.invoke(&scripts::EVICTION, |inv| {
            inv.arg(now_ms);
            for (node, tier) in &distinct {
                inv.arg(*node).arg(tier.wire());
            }
        })?;
        let mut out = Vec::new();
        for ((node, tier), flat) in distinct.iter().zip(reply) {
            let node_id: Arc<str> = Arc::from(*node);
            let mut bucket = flat
                .chunks_exact(3)
                .map(|t| {
                    let parse = |v: &str| v.parse::<u64>().map_err(|_| codec::corrupt("eviction reply"));
                    Ok(EvictionCandidate {
                        key: Arc::from(t[0].as_str()),
                        node_id: Arc::clone(&node_id),
                        tier: *tier,
                        size: parse(&t[1])?,
                        last_accessed_ms: parse(&t[2])?,
                    })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            bucket.sort_by(|a, b| (a.last_accessed_ms, &*a.key).cmp(&(b.last_accessed_ms, &*b.key)));
            if max_per_bucket > 0 {
                bucket.truncate(max_per_bucket);
            }
            out.extend(bucket);
        }
        Ok(out)
    }

    fn get_node(&self, node_id: &str) -> Result<Option<NodeRecord>, StoreError> {
        let fields: HashMap<String, String> =
            self.pool.with(|con| redis::cmd("HGETALL").arg(keys::node(&self.base, node_id)).query(con))?;
        codec::node_record(node_id, fields)
    }

    fn is_alive(&self, node_id: &str) -> Result<bool, StoreError> {
        let status: Option<String> =
            self.pool.with(|con| redis::cmd("HGET").arg(keys::node(&self.base, node_id)).arg("st").query(con))?;
        Ok(status.as_deref() == Some("A"))
    }

    fn list_alive(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.records(true)
    }

    fn list_nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.records(false)
    }

    fn alive_peer_view(&self) -> Result<HashMap<Arc<str>, PeerView>, StoreError> {
        let reply: Vec<(String, String, String)> = self.invoke(&scripts::PEERS, |_| {})?;
        Ok(reply
            .into_iter()
            .map(|(id, peer, data)| {
                (Arc::from(id), PeerView { peer_address: Arc::from(peer), data_endpoint: Arc::from(data) })
            })
            .collect())
    }

    fn key_count(&self) -> Result<u64, StoreError> {
        let count: Option<u64> = self.pool.with(|con| redis::cmd("GET").arg(keys::key_total(&self.base)).query(con))?;
        Ok(count.unwrap_or(0))
    }

    fn node_key_count(&self, node_id: &str) -> Result<u64, StoreError> {
        let (status, count): (Option<String>, u64) = self.pool.with(|con| {
            redis::pipe()
                .cmd("HGET")
                .arg(keys::node(&self.base, node_id))
                .arg("st")
                .cmd("HLEN")
                .arg(keys::node_keys(&self.base, node_id))
                .query(con)
        })?;
        Ok(if status.as_deref() == Some("A") { count } else { 0 })
    }

    fn report_external_kv(
        &self,
        node_id: &str,
        hashes: &[String],
        tier: TierType,
    ) -> Result<ExternalReport, StoreError> {
        self.x_report(node_id, hashes, tier)
    }

    fn revoke_external_kv(&self, node_id: &str, hashes: &[String], tier: TierType) -> Result<(), StoreError> {
        self.x_revoke(node_id, hashes, tier)
    }

    fn revoke_all_external_kv_at_tier(&self, node_id: &str, tier: TierType) -> Result<(), StoreError> {
        self.x_revoke_all(node_id, tier)
    }

    fn match_external_kv(&self, hashes: &[String], count_as_hit: bool) -> Result<Vec<ExternalKvMatch>, StoreError> {
        self.x_match(hashes, count_as_hit)
    }

    fn external_kv_hit_counts(&self, hashes: &[String]) -> Result<Vec<(String, u64)>, StoreError> {
        self.x_hit_counts(hashes)
    }

    fn acquire_lease(&self, name: &str, holder: &str, _now_ms: u64, ttl_ms: u64) -> Result<bool, StoreError> {
        super::check_lease_args(name, holder, ttl_ms)?;
        let held: i64 = self.invoke(&scripts::LEASE_ACQUIRE, |inv| {
            inv.arg(name).arg(holder).arg(ttl_ms);
        })?;
        Ok(held == 1)
    }

    fn release_lease(&self, name: &str, holder: &str) -> Result<bool, StoreError> {
        let released: i64 = self.invoke(&scripts::LEASE_RELEASE, |inv| {
            inv.arg(name).arg(holder);
        })?;
        Ok(released == 1)
    }
}
