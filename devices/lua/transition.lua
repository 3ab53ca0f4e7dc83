-- Many lock operations in one atomic call, in order: releases (each handing the lock to
-- the head of its queue) and acquires, with writes to a sorted set (the caller's
-- deadlines) that depend on how each acquire turned out. One round trip for a whole
-- batch of step transitions instead of one per release and one per acquire.
-- KEYS[1] lease index   KEYS[2] queue arrival counter   KEYS[3] epoch   KEYS[4] the sorted
-- set the conditional and unconditional writes go to
-- ARGV[1..3] key prefixes of the per-device lock hash, fence counter and wait queue (the
-- device's {name} is appended)   ARGV[4] JSON: {"ops": [...], "zadd": [[score, member]],
-- "zrem": [member]}; an op is
--   {"o": "r", "d": device, "h": holder, "f": fence, "l": lease ms for the next holder}
--   {"o": "a", "d": device, "h": holder, "p": priority, "l": lease ms,
--    "g": [[score, member]] written when granted, "q": [[score, member]] when not}
-- Returns JSON, one entry per op: a release gives [1, next holder, next fence] after a
-- hand-off, [0] when the lock is now free, [-1] when the caller no longer held it; an
-- acquire gives [1, fence], [0, queue position], or [-1] while the epoch is missing
-- (Redis lost the lock state: see acquire.lua). Same rules as release.lua / acquire.lua.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local req = cjson.decode(ARGV[4])
local ready = redis.call('EXISTS', KEYS[3]) == 1
local out = {}

local function zadd_all(pairs)
  for _, p in ipairs(pairs or {}) do
    redis.call('ZADD', KEYS[4], p[1], p[2])
  end
end

local function release(op)
  local lock = ARGV[1] .. '{' .. op.d .. '}'
  local queue = ARGV[3] .. '{' .. op.d .. '}'
  if redis.call('HGET', lock, 'holder') ~= op.h or redis.call('HGET', lock, 'fence') ~= tostring(op.f) then
    return {-1}
  end
  local head = redis.call('ZPOPMIN', queue)
  if #head == 0 then
    redis.call('DEL', lock)
    redis.call('ZREM', KEYS[1], op.d)
    return {0}
  end
  local fence = redis.call('INCR', ARGV[2] .. '{' .. op.d .. '}')
  redis.call('HSET', lock, 'holder', head[1], 'fence', fence, 'since', now)
  redis.call('ZADD', KEYS[1], now + op.l, op.d)
  return {1, head[1], fence}
end

local function acquire(op)
  if not ready then
    zadd_all(op.q)
    return {-1}
  end
  local lock = ARGV[1] .. '{' .. op.d .. '}'
  local queue = ARGV[3] .. '{' .. op.d .. '}'
  local holder = redis.call('HGET', lock, 'holder')
  if holder == op.h then
    zadd_all(op.g)
    return {1, tonumber(redis.call('HGET', lock, 'fence'))}
  end
  if not holder and redis.call('ZCARD', queue) == 0 then
    local fence = redis.call('INCR', ARGV[2] .. '{' .. op.d .. '}')
    redis.call('HSET', lock, 'holder', op.h, 'fence', fence, 'since', now)
    redis.call('ZADD', KEYS[1], now + op.l, op.d)
    zadd_all(op.g)
    return {1, fence}
  end
  if not redis.call('ZSCORE', queue, op.h) then
    local seq = redis.call('INCR', KEYS[2])
    redis.call('ZADD', queue, (9 - op.p) * 1099511627776 + seq, op.h)
  end
  zadd_all(op.q)
  return {0, redis.call('ZRANK', queue, op.h) + 1}
end

for _, op in ipairs(req.ops) do
  if op.o == 'r' then
    table.insert(out, release(op))
  else
    table.insert(out, acquire(op))
  end
end
zadd_all(req.zadd)
if #(req.zrem or {}) > 0 then
  redis.call('ZREM', KEYS[4], unpack(req.zrem))
end
return cjson.encode(out)
