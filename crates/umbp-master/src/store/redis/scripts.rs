//! The Lua scripts of [`RedisStore`](super::RedisStore): one per operation that must be atomic.
//!
//! Each runs as one `EVALSHA` (Redis runs a script to completion before any other command), is loaded
//! with `SCRIPT LOAD` when a connection is made, and is loaded again when Redis answers `NOSCRIPT`
//! (after a restart or a `SCRIPT FLUSH`: the `redis` crate's [`Script`] does that). `ARGV[1]` is
//! always the store's key base `{PREFIX}:`; the scripts build the names of the keys they touch from
//! it, all under the one hash tag (see the module docs' layout).
//!
//! Numbers travel and are stored as canonical decimal strings (no leading zero); `lt`/`gt` compare
//! them by length, then bytewise, without building a string
//! digits, so `u64`s above 2^53 keep their order (Lua numbers are doubles).
//!
//! **Invariant** every script keeps: a replica field exists only for a node whose record is ALIVE
//! (registration, expiry and unregister wipe the node's replicas in the same script that changes
//! its record), so reads need not consult the node records.

use std::sync::LazyLock;

use redis::Script;
use umbp_core::TierType;

/// Helpers shared by every script: number order, the stamps, the node wipe, replica add / remove /
/// sweep.
///
/// Redis's CPU goes mostly to the `redis.call`s a script makes (each converts its arguments and
/// reply and dispatches a command), so the helpers make as few as the semantics allow: an ADD is one
/// `HMGET` and one `HSET` (the stamps written with the entry's first replica), the count of entries
/// changes once per script (`flush_keys`), and a heartbeat's changes to its node's reverse index
/// are summed per key and written once per bundle (`nk_flush`): one `HMGET` and one `HSET` for
/// hundreds of events.
fn prelude() -> String {
    let tiers: Vec<String> = TierType::ALL.iter().map(|t| format!("'{}'", t.wire())).collect();
    format!(
        r#"
local TIERS = {{{tiers}}}
local STAMPS = '{stamps_field}'
local CHUNK = 500
local function lt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function gt(a, b) return lt(b, a) end
local base = ARGV[1]
local function entry_key(key) return base .. 'k:' .. key end
-- The stamps `lease|accessed|count` of an entry (absent: all 0).
local function stamps_of(v)
  local l, a, c = string.match(v or '', '^(%d+)|(%d+)|(%d+)$')
  if not l then return '0', '0', '0' end
  return l, a, c
end
-- Entries created minus entries deleted by this script, written by `flush_keys`.
local keys_delta = 0
local function flush_keys()
  if keys_delta ~= 0 then redis.call('INCRBY', base .. 'keys', keys_delta) end
  keys_delta = 0
end
-- Runs `cmd` over `args` in calls of at most CHUNK arguments after `head` (Lua's stack bounds unpack).
local function chunked(cmd, head, args)
  for i = 1, #args, CHUNK do
    redis.call(cmd, head, unpack(args, i, math.min(i + CHUNK - 1, #args)))
  end
end
local function drop_if_empty(ek)
  if redis.call('HLEN', ek) <= {stamps} then
    redis.call('DEL', ek)
    keys_delta = keys_delta - 1
  end
end
-- The heartbeat's pending changes to its node's reverse index: per key, the change of the count of
-- tiers not yet written (`nk_delta`, keys in first-touched order in `nk_order`) and, where known
-- without reading it, the count at the start of the script (`nk_base`).
local nk_delta, nk_order, nk_base = {{}}, {{}}, {{}}
local function nk_bump(key, d)
  local cur = nk_delta[key]
  if cur == nil then
    nk_order[#nk_order + 1] = key
    cur = 0
  end
  nk_delta[key] = cur + d
end
-- Writes the pending changes of the reverse index `nk`: one HMGET for the counts not known, one
-- HSET of the new counts, one HDEL of the keys the node no longer holds.
local function nk_flush(nk)
  local unknown = {{}}
  for _, key in ipairs(nk_order) do
    if nk_base[key] == nil and nk_delta[key] ~= 0 then unknown[#unknown + 1] = key end
  end
  for i = 1, #unknown, CHUNK do
    local last = math.min(i + CHUNK - 1, #unknown)
    local got = redis.call('HMGET', nk, unpack(unknown, i, last))
    for j = i, last do nk_base[unknown[j]] = tonumber(got[j - i + 1] or '0') end
  end
  local set, del = {{}}, {{}}
  for _, key in ipairs(nk_order) do
    local d = nk_delta[key]
    if d ~= 0 then
      local n = nk_base[key] + d
      if n > 0 then
        set[#set + 1] = key
        set[#set + 1] = string.format('%d', n)
      else
        del[#del + 1] = key
      end
    end
  end
  chunked('HSET', nk, set)
  chunked('HDEL', nk, del)
  nk_delta, nk_order, nk_base = {{}}, {{}}, {{}}
end
-- The external KV index (`external.rs`): `x:<hash>` holds a field `<tier>|<node>` per holder and
-- the hit count under HITS; `xn:<tier>:<node>` is the set of the node's hashes at the tier. A hash
-- goes with its last holder, its hit count with it.
local HITS = '!'
local function xdrop(xk, field)
  if redis.call('HDEL', xk, field) == 1 and redis.call('HLEN', xk) == 1 and redis.call('HEXISTS', xk, HITS) == 1 then
    redis.call('DEL', xk)
  end
end
-- Drops every external record of the node at tier `t`.
local function xwipe_tier(id, t)
  local xs = base .. 'xn:' .. t .. ':' .. id
  local field = t .. '|' .. id
  for _, h in ipairs(redis.call('SMEMBERS', xs)) do xdrop(base .. 'x:' .. h, field) end
  redis.call('DEL', xs)
end
-- Drops every replica of the node, its reverse index and its external records.
local function wipe(id)
  for _, t in ipairs(TIERS) do xwipe_tier(id, t) end
  local nk = base .. 'nk:' .. id
  local fields = {{}}
  for i, t in ipairs(TIERS) do fields[i] = t .. '|' .. id end
  for _, key in ipairs(redis.call('HKEYS', nk)) do
    local ek = entry_key(key)
    redis.call('HDEL', ek, unpack(fields))
    drop_if_empty(ek)
  end
  redis.call('DEL', nk)
end
-- Creates the absent entry `ek` of `key` with its stamps `fresh` (never leased, accessed now, no
-- access) and the replica `field` = `value`, in one HSET.
local function create(ek, key, field, value, fresh)
  redis.call('HSET', ek, STAMPS, fresh, field, value)
  keys_delta = keys_delta + 1
  -- The node held no tier of a key without an entry: its count at the start is what this script
  -- has taken off since.
  if nk_base[key] == nil then nk_base[key] = -(nk_delta[key] or 0) end
  nk_bump(key, 1)
end
-- ADD: inserts or refreshes the replica `field` (`tier|node`) of `key` with `value`
-- (`size|sync tag`); a duplicate overwrites the size. With `keep`, a replica already there keeps
-- its sync tag (a delta); without, it takes the one in `value` (a full sync's baseline).
local function add(ek, key, field, value, keep, fresh)
  local got = redis.call('HMGET', ek, field, STAMPS)
  local old = got[1]
  if old then
    if keep then
      value = string.sub(value, 1, string.find(value, '|', 1, true)) .. string.sub(old, string.find(old, '|', 1, true) + 1)
    end
    if value ~= old then redis.call('HSET', ek, field, value) end
  elseif got[2] then
    redis.call('HSET', ek, field, value)
    nk_bump(key, 1)
  else
    create(ek, key, field, value, fresh)
  end
end
-- REMOVE: deletes exactly the replica `field` of `key`; the key goes with its last replica.
local function remove(field, key)
  local ek = entry_key(key)
  if redis.call('HDEL', ek, field) == 1 then
    nk_bump(key, -1)
    drop_if_empty(ek)
  end
end
-- The sweep of a completed full sync (pending reverse-index changes written): drops the node's
-- replicas not marked with `keep`.
local function sweep(id, nk, keep)
  local fields = {{}}
  for i, t in ipairs(TIERS) do fields[i] = t .. '|' .. id end
  for _, key in ipairs(redis.call('HKEYS', nk)) do
    local ek = entry_key(key)
    local got = redis.call('HMGET', ek, unpack(fields))
    local held, gone = 0, {{}}
    for i, field in ipairs(fields) do
      local v = got[i]
      if v then
        held = held + 1
        if string.sub(v, string.find(v, '|', 1, true) + 1) ~= keep then gone[#gone + 1] = field end
      end
    end
    if #gone > 0 then
      redis.call('HDEL', ek, unpack(gone))
      if held > #gone then
        redis.call('HSET', nk, key, held - #gone)
      else
        redis.call('HDEL', nk, key)
      end
      drop_if_empty(ek)
    end
  end
end
"#,
        tiers = tiers.join(", "),
        stamps = super::keys::STAMP_FIELDS,
        stamps_field = super::keys::STAMPS,
    )
}

pub(super) fn script(body: &str) -> Script {
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
flush_keys()
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
flush_keys()
return 1
"#,
    )
});

/// `apply_heartbeat`. ARGV: base, id, now, caps, incarnation, kind, then for a delta (`D`): seq,
/// seq - 1, and events; for a full-sync chunk (`S`): baseline, chunk index, final (`1`/`0`), the
/// next chunk index (saturating) and events; a keepalive (`K`) has nothing more. Events are
/// triples: `A<tier>` / `R<tier>`, key, replica value (`size|0` in a delta, `size|baseline` in a
/// chunk).
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
if gt(now, hb) then
  redis.call('HSET', nkey, 'hb', now, 'caps', caps)
else
  redis.call('HSET', nkey, 'caps', caps)
end
if kind == 'K' then return {'A', last} end
-- Applies the events from ARGV[first] on (REMOVEs only for a delta), then writes what they changed
-- of the reverse index and the count of entries. Runs of up to RUN ADDs are checked with one
-- EXISTS: when none of their entries exists (a node reporting new blocks, the common case), each
-- event is one HSET of stamps and replica and no read. A key repeated inside such a run finds the
-- entry its first ADD created, stamps `fresh` included: HSET's count of new fields tells the three
-- cases apart, and writing `fresh` again changes nothing.
local RUN = 32
local function apply(first, delta)
  local fresh = '0|' .. now .. '|0'
  local fields = {}
  local function field_of(op)
    local field = fields[op]
    if not field then
      field = string.sub(op, 2) .. '|' .. id
      fields[op] = field
    end
    return field
  end
  local ADD = string.byte('A')
  local i, n = first, #ARGV
  while i <= n do
    local eks, j = {}, i
    while j <= n and #eks < RUN and string.byte(ARGV[j]) == ADD do
      eks[#eks + 1] = entry_key(ARGV[j + 1])
      j = j + 3
    end
    if #eks > 1 and redis.call('EXISTS', unpack(eks)) == 0 then
      for k = 1, #eks do
        local at = i + 3 * (k - 1)
        local key = ARGV[at + 1]
        local added = redis.call('HSET', eks[k], STAMPS, fresh, field_of(ARGV[at]), ARGV[at + 2])
        if added == 2 then
          keys_delta = keys_delta + 1
          if nk_base[key] == nil then nk_base[key] = -(nk_delta[key] or 0) end
          nk_bump(key, 1)
        elseif added == 1 then
          nk_bump(key, 1)
        end
      end
    else
      if j == i then j = i + 3 end
      for at = i, j - 1, 3 do
        local key = ARGV[at + 1]
        if string.byte(ARGV[at]) == ADD then
          add(entry_key(key), key, field_of(ARGV[at]), ARGV[at + 2], delta, fresh)
        elseif delta then
          remove(field_of(ARGV[at]), key)
        end
      end
    end
    i = j
  end
  nk_flush(nk)
  flush_keys()
end
if kind == 'D' then
  local seq, prev = ARGV[7], ARGV[8]
  if not gt(seq, last) then return {'R', last} end
  if prev == last and not fsb then
    redis.call('HSET', nkey, 'seq', seq)
    apply(9, true)
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
apply(11, false)
if final then
  sweep(id, nk, baseline)
  flush_keys()
end
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
flush_keys()
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
flush_keys()
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
/// excluded nodes, then the keys. Returns per key its entry as `HGETALL` gave it (before the
/// stamps were written; the caller drops the stamps and the excluded nodes' replicas); every key
/// with a replica on a node not excluded gets its stamps in one `HSET`: the lease and access time
/// moved forward (never back), one more access.
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
  local stamps, found = nil, false
  for j = 1, #all, 2 do
    local f = all[j]
    if f == STAMPS then
      stamps = all[j + 1]
    elseif nex == 0 or not excluded[string.sub(f, string.find(f, '|', 1, true) + 1)] then
      found = true
    end
  end
  if found then
    local l, a, c = '0', '0', 0
    if stamps then
      local p1 = string.find(stamps, '|', 1, true)
      local p2 = string.find(stamps, '|', p1 + 1, true)
      l, a, c = string.sub(stamps, 1, p1 - 1), string.sub(stamps, p1 + 1, p2 - 1), tonumber(string.sub(stamps, p2 + 1))
    end
    if gt(lease_until, l) then l = lease_until end
    if gt(now, a) then a = now end
    redis.call('HSET', ek, STAMPS, l .. '|' .. a .. '|' .. string.format('%d', c + 1))
  end
  res[#res + 1] = all
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
      local v = redis.call('HMGET', entry_key(key), field, STAMPS)
      if v[1] then
        local l, a = stamps_of(v[2])
        if not gt(l, now) then
          out[#out + 1] = key
          out[#out + 1] = string.sub(v[1], 1, string.find(v[1], '|', 1, true) - 1)
          out[#out + 1] = a
        end
      end
    end
  end
  res[#res + 1] = out
end
return res
"#,
    )
});

/// `list_alive` / `list_nodes` (read-only): every record in one round trip. ARGV: base, `1` for ALIVE
/// records only (else `0`). Returns `{id, HGETALL of the record}` per node.
pub(super) static NODES: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local alive_only = ARGV[2] == '1'
local res = {}
for _, id in ipairs(redis.call('SMEMBERS', base .. 'nodes')) do
  local nkey = base .. 'n:' .. id
  if not alive_only or redis.call('HGET', nkey, 'st') == 'A' then
    local all = redis.call('HGETALL', nkey)
    if #all > 0 then res[#res + 1] = {id, all} end
  end
end
return res
"#,
    )
});

/// `alive_peer_view` (read-only; a route-get takes it before every lookup): ARGV: base. Returns
/// `{id, peer address, data endpoint}` per ALIVE node, in one round trip and one `HMGET` a node.
pub(super) static PEERS: LazyLock<Script> = LazyLock::new(|| {
    script(
        r#"
local res = {}
for _, id in ipairs(redis.call('SMEMBERS', base .. 'nodes')) do
  local rec = redis.call('HMGET', base .. 'n:' .. id, 'st', 'peer', 'data')
  if rec[1] == 'A' then res[#res + 1] = {id, rec[2] or '', rec[3] or ''} end
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
pub(super) fn all() -> [&'static Script; 16] {
    [
        &super::external::REPORT,
        &super::external::REVOKE,
        &super::external::REVOKE_ALL,
        &super::external::MATCH,
        &REGISTER,
        &UNREGISTER,
        &HEARTBEAT,
        &EXPIRE,
        &REMOVE_EXPIRED,
        &CAPS_CAS,
        &ROUTE_GET,
        &EVICTION,
        &NODES,
        &PEERS,
        &LEASE_ACQUIRE,
        &LEASE_RELEASE,
    ]
}
