-- Many lock operations in one atomic call, in order: releases (each handing the lock to
-- the head of its queue) and acquires, with writes to a sorted set (the caller's
-- deadlines) that depend on how each acquire turned out. One round trip for a whole
-- batch of step transitions instead of one per release and one per acquire.
-- The operations come in groups, one per lock shard (devices/locks.py); every key is
-- declared. On a Redis Cluster a call carries one group, so it stays in one hash slot; on
-- a single Redis one call carries every group of the batch.
-- KEYS, for group g (1, 2, ...): KEYS[4g-3] the shard's lease index   KEYS[4g-2] its queue
-- arrival counter   KEYS[4g-1] its epoch   KEYS[4g] its sorted set, where the group's
-- conditional and unconditional writes go; after the groups, each op's lock hash, fence
-- counter and wait queue at KEYS[op.k], KEYS[op.k + 1], KEYS[op.k + 2]
-- ARGV[1] JSON: {"groups": [{"ops": [...], "zadd": [[score, member]], "zrem": [member]}]};
-- an op is
--   {"o": "r", "d": device, "k": key index, "h": holder, "f": fence, "l": lease ms for the next holder}
--   {"o": "a", "d": device, "k": key index, "h": holder, "p": priority, "l": lease ms,
--    "g": [[score, member]] written when granted, "q": [[score, member]] when not}
--   {"o": "e", "d": device, "k": key index, "h": holder, "f": fence, "l": lease ms}
-- Returns JSON, per group one entry per op: a release gives [1, next holder, next fence]
-- after a hand-off, [0] when the lock is now free, [-1] when the caller no longer held it;
-- an acquire gives [1, fence], [0, queue position], or [-1] while the shard's epoch is
-- missing (Redis lost the lock state: see acquire.lua); an extend gives [1] when the lease
-- was pushed out, [0] when the caller no longer holds the lock. Same rules as release.lua /
-- acquire.lua / extend.lua.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local req = cjson.decode(ARGV[1])
local out = {}

local function zadd_all(zset, pairs)
  for _, p in ipairs(pairs or {}) do
    redis.call('ZADD', zset, p[1], p[2])
  end
end

local function release(g, op)
  local lock, fence_key, queue = KEYS[op.k], KEYS[op.k + 1], KEYS[op.k + 2]
  if redis.call('HGET', lock, 'holder') ~= op.h or redis.call('HGET', lock, 'fence') ~= tostring(op.f) then
    return {-1}
  end
  local head = redis.call('ZPOPMIN', queue)
  if #head == 0 then
    redis.call('DEL', lock)
    redis.call('ZREM', KEYS[g + 1], op.d)
    return {0}
  end
  local fence = redis.call('INCR', fence_key)
  redis.call('HSET', lock, 'holder', head[1], 'fence', fence, 'since', now)
  redis.call('ZADD', KEYS[g + 1], now + op.l, op.d)
  return {1, head[1], fence}
end

local function extend(g, op)
  local lock = KEYS[op.k]
  if redis.call('HGET', lock, 'holder') ~= op.h or redis.call('HGET', lock, 'fence') ~= tostring(op.f) then
    return {0}
  end
  redis.call('ZADD', KEYS[g + 1], now + op.l, op.d)
  return {1}
end

local function acquire(g, ready, op)
  local zset = KEYS[g + 4]
  if not ready then
    zadd_all(zset, op.q)
    return {-1}
  end
  local lock, fence_key, queue = KEYS[op.k], KEYS[op.k + 1], KEYS[op.k + 2]
  local holder = redis.call('HGET', lock, 'holder')
  if holder == op.h then
    zadd_all(zset, op.g)
    return {1, tonumber(redis.call('HGET', lock, 'fence'))}
  end
  if not holder and redis.call('ZCARD', queue) == 0 then
    local fence = redis.call('INCR', fence_key)
    redis.call('HSET', lock, 'holder', op.h, 'fence', fence, 'since', now)
    redis.call('ZADD', KEYS[g + 1], now + op.l, op.d)
    zadd_all(zset, op.g)
    return {1, fence}
  end
  if not redis.call('ZSCORE', queue, op.h) then
    local seq = redis.call('INCR', KEYS[g + 2])
    redis.call('ZADD', queue, (9 - op.p) * 1099511627776 + seq, op.h)
  end
  zadd_all(zset, op.q)
  return {0, redis.call('ZRANK', queue, op.h) + 1}
end

for i, group in ipairs(req.groups) do
  -- g: offset of the group's shard keys (KEYS[g + 1] .. KEYS[g + 4])
  local g = 4 * (i - 1)
  local ready = redis.call('EXISTS', KEYS[g + 3]) == 1
  local results = {}
  for _, op in ipairs(group.ops or {}) do
    if op.o == 'r' then
      table.insert(results, release(g, op))
    elseif op.o == 'e' then
      table.insert(results, extend(g, op))
    else
      table.insert(results, acquire(g, ready, op))
    end
  end
  zadd_all(KEYS[g + 4], group.zadd)
  if #(group.zrem or {}) > 0 then
    redis.call('ZREM', KEYS[g + 4], unpack(group.zrem))
  end
  -- An empty Lua table encodes as {} (an object): the caller reads a missing list as empty.
  table.insert(out, results)
end
return cjson.encode(out)
