//! The Lua scripts of [`RedisStore`](super::RedisStore): one per operation that must be atomic.
//!
//! Each runs as one `EVALSHA` (Redis runs a script to completion before any other command), is loaded
//! with `SCRIPT LOAD` when a connection is made, and is loaded again when Redis answers `NOSCRIPT`
//! (after a restart or a `SCRIPT FLUSH`: the `redis` crate's [`Script`] does that). `ARGV[1]` is
//! always the store's key base `{PREFIX}:`; the scripts build the names of the keys they touch from
//! it, all under the one hash tag (see the module docs' layout).
//!
//! Numbers travel and are stored as decimal strings; `lt`/`gt` compare them after zero-padding to 20
//! digits, so `u64`s above 2^53 keep their order (Lua numbers are doubles).
//!
//! **Invariant** every script keeps: a replica field exists only for a node whose record is ALIVE
//! (registration, expiry and unregister wipe the node's replicas in the same script that changes
//! its record), so reads need not consult the node records.

use std::sync::LazyLock;

use redis::Script;
use umbp_core::TierType;

/// Helpers shared by every script: number order, the node wipe, replica add / remove / sweep.
fn prelude() -> String {
    let tiers: Vec<String> = TierType::ALL.iter().map(|t| format!("'{}'", t.wire())).collect();
    format!(
        r#"
local TIERS = {{{tiers}}}
local function pad(s) return string.rep('0', 20 - #s) .. s end
local function lt(a, b) return pad(a) < pad(b) end
local function gt(a, b) return pad(a) > pad(b) end
local base = ARGV[1]
local function entry_key(key) return base .. 'k:' .. key end
local function drop_if_empty(ek)
  if redis.call('HLEN', ek) <= {stamps} then
    redis.call('DEL', ek)
    redis.call('DECR', base .. 'keys')
  end
end
-- Drops every replica of the node and its reverse index.
local function wipe(id)
  local nk = base .. 'nk:' .. id
  for _, key in ipairs(redis.call('HKEYS', nk)) do
    local ek = entry_key(key)
    for _, t in ipairs(TIERS) do redis.call('HDEL', ek, t .. '|' .. id) end
    drop_if_empty(ek)
  end
  redis.call('DEL', nk)
end
-- ADD: inserts or refreshes (node, tier); a duplicate overwrites the size. `tag` (a full sync's
-- baseline) marks the replica as reported by that sync; nil keeps the replica's mark.
local function add(id, nk, tier, key, size, tag, now)
  local ek = entry_key(key)
  if redis.call('EXISTS', ek) == 0 then
    redis.call('HSET', ek, '!l', '0', '!a', now, '!c', '0')
    redis.call('INCR', base .. 'keys')
  end
  local field = tier .. '|' .. id
  local old = redis.call('HGET', ek, field)
  if old then
    if not tag then tag = string.sub(old, string.find(old, '|', 1, true) + 1) end
    redis.call('HSET', ek, field, size .. '|' .. tag)
  else
    redis.call('HSET', ek, field, size .. '|' .. (tag or '0'))
    redis.call('HINCRBY', nk, key, 1)
  end
end
-- REMOVE: deletes exactly (key, node, tier); the key goes with its last replica.
local function remove(id, nk, tier, key)
  local ek = entry_key(key)
  if redis.call('HDEL', ek, tier .. '|' .. id) == 1 then
    if redis.call('HINCRBY', nk, key, -1) <= 0 then redis.call('HDEL', nk, key) end
    drop_if_empty(ek)
  end
end
-- The sweep of a completed full sync: drops the node's replicas not marked with `keep`.
local function sweep(id, nk, keep)
  for _, key in ipairs(redis.call('HKEYS', nk)) do
    local ek = entry_key(key)
    for _, t in ipairs(TIERS) do
      local field = t .. '|' .. id
      local v = redis.call('HGET', ek, field)
      if v and string.sub(v, string.find(v, '|', 1, true) + 1) ~= keep then
        redis.call('HDEL', ek, field)
        if redis.call('HINCRBY', nk, key, -1) <= 0 then redis.call('HDEL', nk, key) end
      end
    end
    drop_if_empty(ek)
  end
end
"#,
        tiers = tiers.join(", "),
        stamps = super::keys::STAMP_FIELDS,
    )
}

fn script(body: &str) -> Script {
    Script::new(&format!("{}{body}", prelude()))
}

/// `register`. ARGV: base, id, now, fresh_since (`now - stale_after`, saturating), incarnation,
/// address, peer, data endpoint, tags, caps. Returns `{code, incarnation}`: `R` registered, `P`
/// replaced (the previous incarnation), `E` already exists, `S` superseded (the current one).
pub(super) static REGISTER: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local id, now, fresh_since, inc = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local nkey = base .. 'n:' .. id
local rec = redis.call('HMGET', nkey, 'st', 'inc', 'hb')
local code, prev = 'R', '0'
if rec[1] then
  local cur = rec[2]
  if inc ~= '0' and cur ~= '0' and lt(inc, cur) then return {'S', cur} end
  if rec[1] == 'A' and not lt(rec[3], fresh_since) then
    if inc == '0' or cur == '0' or inc == cur then return {'E', '0'} end
    code, prev = 'P', cur
  end
end
wipe(id)
redis.call('DEL', nkey)
redis.call('HSET', nkey, 'st', 'A', 'inc', inc, 'hb', now, 'reg', now, 'seq', '0',
  'addr', ARGV[6], 'peer', ARGV[7], 'data', ARGV[8], 'tags', ARGV[9], 'caps', ARGV[10])
redis.call('SADD', base .. 'nodes', id)
return {code, prev}
"#,
    )
});

/// `unregister_incarnation`. ARGV: base, id, incarnation. Returns 1 if a record was erased.
pub(super) static UNREGISTER: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local id, inc = ARGV[2], ARGV[3]
local nkey = base .. 'n:' .. id
local cur = redis.call('HGET', nkey, 'inc')
if not cur then return 0 end
if inc ~= '0' and cur ~= '0' and inc ~= cur then return 0 end
wipe(id)
redis.call('DEL', nkey)
redis.call('SREM', base .. 'nodes', id)
return 1
"#,
    )
});

/// `apply_heartbeat`. ARGV: base, id, now, caps, incarnation, kind, then for a delta (`D`): seq,
/// seq - 1, and events; for a full-sync chunk (`S`): baseline, chunk index, final (`1`/`0`), the
/// next chunk index (saturating) and events; a keepalive (`K`) has nothing more. Events are `A`/`R`, tier, key, size quadruples.
/// Returns `{code, seq}`: `A` applied, `R` already applied, `G` gap, `U` unknown, `S` superseded
/// (with the incarnation that stands).
pub(super) static HEARTBEAT: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local id, now, caps, inc, kind = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local nkey = base .. 'n:' .. id
local nk = base .. 'nk:' .. id
local rec = redis.call('HMGET', nkey, 'st', 'inc', 'hb', 'seq', 'fsb', 'fsn')
local st, cur, hb, last, fsb, fsn = rec[1], rec[2], rec[3], rec[4], rec[5], rec[6]
if not st then return {'U', '0'} end
if inc ~= '0' and cur ~= '0' and inc ~= cur then
  if lt(inc, cur) then return {'S', cur} end
  return {'U', '0'}
end
if st ~= 'A' then return {'U', '0'} end
if gt(now, hb) then redis.call('HSET', nkey, 'hb', now) end
redis.call('HSET', nkey, 'caps', caps)
if kind == 'K' then return {'A', last} end
local function apply(first, tag)
  for i = first, #ARGV, 4 do
    if ARGV[i] == 'A' then
      add(id, nk, ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tag, now)
    elseif not tag then
      remove(id, nk, ARGV[i + 1], ARGV[i + 2])
    end
  end
end
if kind == 'D' then
  local seq, prev = ARGV[7], ARGV[8]
  if not gt(seq, last) then return {'R', last} end
  if prev == last and not fsb then
    redis.call('HSET', nkey, 'seq', seq)
    apply(9, nil)
    return {'A', seq}
  end
  redis.call('HDEL', nkey, 'fsb', 'fsn')
  return {'G', last}
end
local baseline, chunk, final = ARGV[7], ARGV[8], ARGV[9] == '1'
local in_order
if chunk == '0' then
  in_order = (not fsb) or not lt(baseline, fsb)
else
  in_order = fsb and fsb == baseline and fsn == chunk
end
if not gt(baseline, last) then return {'R', last} end
if not in_order then
  if (not fsb) or not lt(baseline, fsb) then redis.call('HDEL', nkey, 'fsb', 'fsn') end
  return {'G', last}
end
if final then
  redis.call('HDEL', nkey, 'fsb', 'fsn')
  redis.call('HSET', nkey, 'seq', baseline)
  last = baseline
else
  redis.call('HSET', nkey, 'fsb', baseline, 'fsn', ARGV[10])
end
apply(11, baseline)
if final then sweep(id, nk, baseline) end
return {'A', last}
"#,
    )
});

/// `expire_stale`. ARGV: base, cutoff. Returns the ids expired.
pub(super) static EXPIRE: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local cutoff = ARGV[2]
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', base .. 'nodes')) do
  local nkey = base .. 'n:' .. id
  local rec = redis.call('HMGET', nkey, 'st', 'hb')
  if rec[1] == 'A' and lt(rec[2], cutoff) then
    redis.call('HSET', nkey, 'st', 'E')
    redis.call('HDEL', nkey, 'fsb', 'fsn')
    wipe(id)
    out[#out + 1] = id
  end
end
return out
"#,
    )
});

/// `remove_expired`. ARGV: base, cutoff. Returns the ids removed.
pub(super) static REMOVE_EXPIRED: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local cutoff = ARGV[2]
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', base .. 'nodes')) do
  local nkey = base .. 'n:' .. id
  local rec = redis.call('HMGET', nkey, 'st', 'hb')
  if rec[1] == 'E' and lt(rec[2], cutoff) then
    wipe(id)
    redis.call('DEL', nkey)
    redis.call('SREM', base .. 'nodes', id)
    out[#out + 1] = id
  end
end
return out
"#,
    )
});

/// The compare-and-set behind `credit_capacity` / `debit_capacity`: ARGV: base, id, the caps read,
/// the caps to write. Writes (returns 1) only if the node is ALIVE and its caps are still the ones
/// read.
pub(super) static CAPS_CAS: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local nkey = base .. 'n:' .. ARGV[2]
local rec = redis.call('HMGET', nkey, 'st', 'caps')
if rec[1] ~= 'A' or rec[2] ~= ARGV[3] then return 0 end
redis.call('HSET', nkey, 'caps', ARGV[4])
return 1
"#,
    )
});

/// `batch_lookup_for_route_get`. ARGV: base, now, lease_until, the number of excluded nodes, the
/// excluded nodes, then the keys. Returns per key its `tier, node, size` triples (not excluded);
/// every key with one gets the lease and access stamps.
pub(super) static ROUTE_GET: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local now, lease_until, nex = ARGV[2], ARGV[3], tonumber(ARGV[4])
local excluded = {}
for i = 5, 4 + nex do excluded[ARGV[i]] = true end
local res = {}
for i = 5 + nex, #ARGV do
  local ek = entry_key(ARGV[i])
  local all = redis.call('HGETALL', ek)
  local out = {}
  for j = 1, #all, 2 do
    local f = all[j]
    if string.sub(f, 1, 1) ~= '!' then
      local bar = string.find(f, '|', 1, true)
      local node = string.sub(f, bar + 1)
      if not excluded[node] then
        local v = all[j + 1]
        out[#out + 1] = string.sub(f, 1, bar - 1)
        out[#out + 1] = node
        out[#out + 1] = string.sub(v, 1, string.find(v, '|', 1, true) - 1)
      end
    end
  end
  if #out > 0 then
    local stamps = redis.call('HMGET', ek, '!l', '!a')
    if gt(lease_until, stamps[1]) then redis.call('HSET', ek, '!l', lease_until) end
    if gt(now, stamps[2]) then redis.call('HSET', ek, '!a', now) end
    redis.call('HINCRBY', ek, '!c', 1)
  end
  res[#res + 1] = out
end
return res
"#,
    )
});

/// `enumerate_eviction_candidates` (read-only). ARGV: base, now, then `node, tier` pairs (distinct).
/// Returns per bucket its unleased replicas as `key, size, last_accessed` triples (unsorted).
pub(super) static EVICTION: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local now = ARGV[2]
local res = {}
for i = 3, #ARGV, 2 do
  local id, tier = ARGV[i], ARGV[i + 1]
  local out = {}
  if redis.call('HGET', base .. 'n:' .. id, 'st') == 'A' then
    local field = tier .. '|' .. id
    for _, key in ipairs(redis.call('HKEYS', base .. 'nk:' .. id)) do
      local v = redis.call('HMGET', entry_key(key), field, '!l', '!a')
      if v[1] and not gt(v[2], now) then
        out[#out + 1] = key
        out[#out + 1] = string.sub(v[1], 1, string.find(v[1], '|', 1, true) - 1)
        out[#out + 1] = v[3]
      end
    end
  end
  res[#res + 1] = out
end
return res
"#,
    )
});

/// `acquire_lease`: takes the lease with `SET NX PX`, or renews it (compare-and-renew) when the
/// holder already has it. ARGV: base, name, holder, ttl_ms. Returns 1 if the holder holds it after.
/// The TTL runs on Redis's clock, so masters' clocks need not agree.
pub(super) static LEASE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local k = base .. 'lease:' .. ARGV[2]
if redis.call('GET', k) == ARGV[3] then
  redis.call('PEXPIRE', k, ARGV[4])
  return 1
end
if redis.call('SET', k, ARGV[3], 'NX', 'PX', ARGV[4]) then return 1 end
return 0
"#,
    )
});

/// `release_lease`: compare-and-delete. ARGV: base, name, holder. Returns 1 if released.
pub(super) static LEASE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local k = base .. 'lease:' .. ARGV[2]
if redis.call('GET', k) == ARGV[3] then
  redis.call('DEL', k)
  return 1
end
return 0
"#,
    )
});

/// Every script, for loading them all when a connection is made.
pub(super) fn all() -> [&'static Script; 10] {
    [
        &REGISTER,
        &UNREGISTER,
        &HEARTBEAT,
        &EXPIRE,
        &REMOVE_EXPIRED,
        &CAPS_CAS,
        &ROUTE_GET,
        &EVICTION,
        &LEASE_ACQUIRE,
        &LEASE_RELEASE,
    ]
}
