-- The device lock's one script (devices/locks.py): every change to a device lock is made
-- here. A call applies a list of operations on many devices, atomically and in order:
-- acquires (a grant or a place in the queue), releases (each handing the lock to the head
-- of its queue), lease extends, the reclaim of expired leases and the restore of locks
-- after Redis lost its data; with writes to a sorted set (the caller's deadlines) that
-- depend on how each acquire turned out. A single operation is a call with one operation.
-- The operations come in groups, one per lock shard; on a Redis Cluster a call carries one
-- group, so it stays in one hash slot; on a single Redis one call carries every group.
-- KEYS, for a group: KEYS[s] the shard's lease index (zset device -> lease expiry ms),
-- KEYS[s + 1] its queue arrival counter, KEYS[s + 2] its epoch (exists while Redis holds
-- the lock state; gone after Redis lost its data), and KEYS[z] its part of the sorted set,
-- when the group writes to one; each device operation's lock hash {holder, fence, since},
-- fence counter and wait queue (zset) at KEYS[op.k], KEYS[op.k + 1], KEYS[op.k + 2].
-- ARGV[1] JSON: {"groups": [{"s": index, "z": index or absent, "ops": [...],
-- "zadd": [[score, member]], "zrem": [member]}]}; an op is
--   {"o": "a", "d": device, "k": key index, "h": holder, "p": priority 0..9 (9 most urgent),
--    "l": lease ms, "g": [[score, member]] written when granted, "q": [[score, member]] when not,
--    "gc": [member] removed when granted}
--   {"o": "r", "d": device, "k": key index, "h": holder, "f": fence, "l": lease ms for the
--    next holder, "x": true to release whoever holds it (operator, monitor)}
--   {"o": "e", "d": device, "k": key index, "h": holder, "f": fence, "l": lease ms}
--   {"o": "q", "d": device, "k": key index, "h": holder}: leave the device's wait queue
--   {"o": "c", "t": now ms, "n": at most this many, "l": claim ms, "p": the shard's lock
--    hash key prefix: a device's lock hash is p .. device, in KEYS[s]'s hash slot}
--   {"o": "s", "d": device, "k": key index, "h": executing holder or "", "f": its fence,
--    "m": the highest fence the database saw for the device, "l": lease ms}
--   {"o": "u", as "a", plus "v": the holder to displace, "vf": its fence, "vp": its priority}:
--    an urgent acquire that preempts (see "Urgent preemption" below)
-- Returns JSON, per group one entry per op:
--   acquire: [1, fence] when granted, [2, fence] when the caller already holds it (re-acquire
--     is idempotent, so a redelivered task does not queue behind itself; the caller took
--     nothing, so undoing its transition must not hand the lock on), [0, position, waiting]
--     when queued (once: asking again keeps the place; waiting 1 when the caller was in the
--     queue already, so undoing its transition must not take that place away), or [-1] while the shard's epoch is
--     missing: granting then could hand a device still executing a command to a second
--     holder, so nothing is granted until the lock state has been rebuilt (op "s").
--   release: [1, next holder, next fence] after a hand-off, [0, 0, 0] when the lock is now free,
--     [-1] when the caller no longer held it (stale: nothing changes).
--   extend: [1] when the lease was pushed out to now + l, [0] when the caller no longer
--     holds the lock.
--   dequeue: [1] when the holder left the queue, [0] when it was not in it.
--   reclaim: [device, holder, fence, device, ...]: up to n devices of the shard whose lease
--     ran out by t, each lease pushed out to t + l so the next monitor tick does not claim
--     it again while it is being reclaimed (a lease entry without a lock is dropped).
--   restore: [1]; the fence counter is raised to m (tokens keep increasing) and an
--     executing holder gets its lock back, unless the lock is held already.
--   preempt: [3, fence] when v (under fence vf) was displaced and the caller holds the lock
--     under a new fence; otherwise what an acquire ("a") answers.
-- Shared concurrency limits (slots; the section "slots" below): an acquire may carry
-- "n" (the slot-needs hash key), "sq" (the slot arrival counter key) and "sl": the slots
-- it needs, [[holders zset key, waiters zset key, at most, "limit=value"]], one per (limit,
-- label value); an acquire that waits for a slot replies [0, position, waiting, "limit=value"];
-- a release and a dequeue carry "n" when slots are in use. A release whose hand-off or
-- freed slots granted other devices' locks appends them, [device, holder, fence, ...], as
-- the 4th element of its reply ([0, 0, 0, extra] when it handed its own device to nobody).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local req = cjson.decode(ARGV[1])
local out = {}

-- Lower score is served first: priority band, then arrival order within the band.
-- 2^40 arrivals per band fit exactly in a double's 53-bit mantissa.
local BAND = 1099511627776

local function zadd_all(zset, pairs)
  for _, p in ipairs(pairs or {}) do
    redis.call('ZADD', zset, p[1], p[2])
  end
end

-- A grant's sorted-set writes: what it adds ("g"), and what it ends ("gc": e.g. the queue
-- deadline of a row that waited before and asks again).
local function granted_writes(zset, op)
  zadd_all(zset, op.g)
  if op.gc and #op.gc > 0 then
    redis.call('ZREM', zset, unpack(op.gc))
  end
end

-- === slots: shared concurrency limits =======================================================
-- A command a limit applies to needs, beside its device's lock, one slot of each
-- (limit, label value) it falls under: at most "n" holders per slot set. It takes its
-- device's lock and its slots together or neither (nobody holds a device while waiting for
-- a slot): blocked by a slot, it waits in that slot set's waiters (priority band, then
-- arrival), its device's lock left free. A holder's slots go with its device lock: released
-- (or reclaimed after its lease ran out) together; the freed slots are handed on to their
-- waiters, each taking its device's lock when that is free (an extra grant of the release)
-- or joining its device's queue when it is not. What a holder needs lives in the needs hash
-- (holder -> JSON {d, lk, fk, qk, ik: its device and its lock, fence, queue and lease index
-- keys, sc: its score, m: its slots}). These keys live outside the device shards' hash
-- slots, so slots are only used on a single Redis (devices/locks.py passes none to a cluster).

local function slot_need(needs, holder)
  if not needs then
    return nil
  end
  local raw = redis.call('HGET', needs, holder)
  return raw and cjson.decode(raw)
end

-- The first slot set that blocks a holder of score sc: full, or with a waiter ahead of it.
local function slot_blocked(m, sc, holder)
  for _, l in ipairs(m) do
    if redis.call('ZCARD', l[1]) >= l[3] then
      return l
    end
    local head = redis.call('ZRANGE', l[2], 0, 0, 'WITHSCORES')
    if #head > 0 and head[1] ~= holder and tonumber(head[2]) < sc then
      return l
    end
  end
  return nil
end

local function slot_take(need, holder)
  for _, l in ipairs(need.m) do
    redis.call('ZADD', l[1], now, holder)
    redis.call('ZREM', l[2], holder)
  end
end

local function slot_wait(need, l, holder)
  for _, other in ipairs(need.m) do
    if other[2] ~= l[2] then
      redis.call('ZREM', other[2], holder)
    end
  end
  redis.call('ZADD', l[2], need.sc, holder)
end

-- An acquire that needs slots: its need is remembered (a holder asking again keeps its
-- first score, so its place). Returns the need, or nil when the acquire needs none.
local function slot_need_note(s, op)
  if not op.sl or #op.sl == 0 or not op.n then
    return nil
  end
  local need = slot_need(op.n, op.h)
  if need then
    return need
  end
  local seq = redis.call('INCR', op.sq)
  need = {d = op.d, lk = KEYS[op.k], fk = KEYS[op.k + 1], qk = KEYS[op.k + 2], ik = KEYS[s],
          sc = (9 - op.p) * BAND + seq, m = op.sl}
  redis.call('HSET', op.n, op.h, cjson.encode(need))
  return need
end

-- A free device's acquire that needs slots: nil when it may be granted (its slots taken),
-- else its queued reply (it waits for the slot set that blocks it).
local function slot_gate(need, op)
  local blocked = slot_blocked(need.m, need.sc, op.h)
  if not blocked then
    slot_take(need, op.h)
    return nil
  end
  local waiting = redis.call('ZSCORE', blocked[2], op.h) and 1 or 0
  slot_wait(need, blocked, op.h)
  return {0, redis.call('ZRANK', blocked[2], op.h) + 1, waiting, blocked[4]}
end

-- The releasing holder gives its slots back; returns the slot sets it freed.
local function slot_free(needs, holder)
  local need = slot_need(needs, holder)
  if not need then
    return {}
  end
  for _, l in ipairs(need.m) do
    redis.call('ZREM', l[1], holder)
    redis.call('ZREM', l[2], holder)
  end
  redis.call('HDEL', needs, holder)
  return need.m
end

-- The next holder of a released device: the head of its queue that its slots do not block
-- (its slots taken); a blocked one moves to its blocking slot set's waiters.
local function slot_next(needs, queue)
  while true do
    local head = redis.call('ZPOPMIN', queue)
    if #head == 0 or not needs then
      return head
    end
    local need = slot_need(needs, head[1])
    if not need then
      return head
    end
    local blocked = slot_blocked(need.m, need.sc, head[1])
    if not blocked then
      slot_take(need, head[1])
      return head
    end
    slot_wait(need, blocked, head[1])
  end
end

-- Hand the freed slot sets to their waiters, in order: a waiter takes its device's lock
-- and its slots when its device is free and nothing blocks it, joins its device's queue
-- when the device is busy, or moves to the next slot set that blocks it. The grants, as a
-- flat list [device, holder, fence, ...], are added to extra.
local function slot_serve(needs, freed, lease, extra)
  for _, l in ipairs(freed) do
    while redis.call('ZCARD', l[1]) < l[3] do
      local head = redis.call('ZRANGE', l[2], 0, 0)
      if #head == 0 then
        break
      end
      local holder = head[1]
      redis.call('ZREM', l[2], holder)
      local need = slot_need(needs, holder)
      if need and redis.call('HGET', need.lk, 'holder') ~= holder then
        local blocked = slot_blocked(need.m, need.sc, holder)
        redis.call('ZREM', need.qk, holder)
        if blocked then
          slot_wait(need, blocked, holder)
        elseif redis.call('HEXISTS', need.lk, 'holder') == 1 or redis.call('ZCARD', need.qk) > 0 then
          redis.call('ZADD', need.qk, need.sc, holder)
        else
          local fence = redis.call('INCR', need.fk)
          redis.call('HSET', need.lk, 'holder', holder, 'fence', fence, 'since', now)
          redis.call('ZADD', need.ik, now + lease, need.d)
          slot_take(need, holder)
          table.insert(extra, need.d)
          table.insert(extra, holder)
          table.insert(extra, fence)
        end
      end
    end
  end
end

-- A queued holder leaves: the slot sets' waiters too, and its need (unless it holds slots:
-- granted meanwhile, its need goes with its release).
local function slot_leave(needs, holder)
  local need = slot_need(needs, holder)
  if not need then
    return 0
  end
  local left = 0
  for _, l in ipairs(need.m) do
    if redis.call('ZSCORE', l[1], holder) then
      return left
    end
    left = left + redis.call('ZREM', l[2], holder)
  end
  redis.call('HDEL', needs, holder)
  return left
end
-- === end of slots ===========================================================================

local function holds(lock, op)
  return redis.call('HGET', lock, 'holder') == op.h and redis.call('HGET', lock, 'fence') == tostring(op.f)
end

local function acquire(s, zset, ready, op)
  if not ready then
    zadd_all(zset, op.q)
    return {-1}
  end
  local lock, fence_key, queue = KEYS[op.k], KEYS[op.k + 1], KEYS[op.k + 2]
  local holder = redis.call('HGET', lock, 'holder')
  if holder == op.h then
    granted_writes(zset, op)
    return {2, tonumber(redis.call('HGET', lock, 'fence'))}
  end
  local need = slot_need_note(s, op)
  if not holder and redis.call('ZCARD', queue) == 0 then
    local queued = need and slot_gate(need, op)
    if queued then
      zadd_all(zset, op.q)
      return queued
    end
    local fence = redis.call('INCR', fence_key)
    redis.call('HSET', lock, 'holder', op.h, 'fence', fence, 'since', now)
    redis.call('ZADD', KEYS[s], now + op.l, op.d)
    granted_writes(zset, op)
    return {1, fence}
  end
  local waiting = 1
  if not redis.call('ZSCORE', queue, op.h) then
    local seq = redis.call('INCR', KEYS[s + 1])
    redis.call('ZADD', queue, (9 - op.p) * BAND + seq, op.h)
    waiting = 0
  end
  zadd_all(zset, op.q)
  return {0, redis.call('ZRANK', queue, op.h) + 1, waiting}
end

local function release(s, op)
  local lock, fence_key, queue = KEYS[op.k], KEYS[op.k + 1], KEYS[op.k + 2]
  if not op.x and not holds(lock, op) then
    return {-1}
  end
  local freed = op.n and slot_free(op.n, redis.call('HGET', lock, 'holder') or op.h) or {}
  local head = slot_next(op.n, queue)
  local result
  if #head == 0 then
    redis.call('DEL', lock)
    redis.call('ZREM', KEYS[s], op.d)
    result = {0, 0, 0}
  else
    local fence = redis.call('INCR', fence_key)
    redis.call('HSET', lock, 'holder', head[1], 'fence', fence, 'since', now)
    redis.call('ZADD', KEYS[s], now + op.l, op.d)
    result = {1, head[1], fence}
  end
  local extra = {}
  slot_serve(op.n, freed, op.l, extra)
  if #extra > 0 then
    table.insert(result, extra)
  end
  return result
end

local function extend(s, op)
  if not holds(KEYS[op.k], op) then
    return {0}
  end
  redis.call('ZADD', KEYS[s], now + op.l, op.d)
  return {1}
end

local function dequeue(op)
  local left = redis.call('ZREM', KEYS[op.k + 2], op.h)
  if op.n then
    left = math.max(left, slot_leave(op.n, op.h))
  end
  return {left}
end

local function reclaim(s, op)
  local due = redis.call('ZRANGEBYSCORE', KEYS[s], '-inf', op.t, 'LIMIT', 0, op.n)
  local claimed = {}
  for _, device in ipairs(due) do
    local lock = op.p .. device
    local holder = redis.call('HGET', lock, 'holder')
    if holder then
      redis.call('ZADD', KEYS[s], op.t + op.l, device)
      table.insert(claimed, device)
      table.insert(claimed, holder)
      table.insert(claimed, redis.call('HGET', lock, 'fence'))
    else
      redis.call('ZREM', KEYS[s], device)
    end
  end
  return claimed
end

local function restore(s, op)
  local lock, fence_key = KEYS[op.k], KEYS[op.k + 1]
  if tonumber(redis.call('GET', fence_key) or '0') < op.m then
    redis.call('SET', fence_key, op.m)
  end
  if op.h ~= '' and not redis.call('HGET', lock, 'holder') then
    redis.call('HSET', lock, 'holder', op.h, 'fence', op.f, 'since', now)
    redis.call('ZADD', KEYS[s], now + op.l, op.d)
  end
  return {1}
end

-- --- Urgent preemption (docs/orchestration.md#urgent-preemption) -------------------------
-- An urgent holder takes the lock from the holder the caller names (v, under fence vf: a
-- compare-and-set, so only the command the caller decided to preempt is displaced). In one
-- step: the fence grows (v's token is stale from now on: its release, extend and late
-- replies are refused), v goes back to the queue at the head of its priority band (score
-- band * BAND: arrival numbers start at 1, so it is served before every waiter of its own
-- priority and after every waiter of a higher one), and the caller leaves the queue and
-- holds the lock with a lease. When v no longer holds the lock under vf (it ended, the
-- lock moved on), the operation is a plain acquire: granted if free, else queued. So it is
-- when v holds slots of a shared concurrency limit: such a command is never preempted (its
-- slots would stay taken while it waits, or be handed on by nobody).
local function preempt(s, zset, ready, op)
  local lock, fence_key, queue = KEYS[op.k], KEYS[op.k + 1], KEYS[op.k + 2]
  if not ready or not holds(lock, {h = op.v, f = op.vf}) or slot_need(op.n, op.v) then
    return acquire(s, zset, ready, op)
  end
  local fence = redis.call('INCR', fence_key)
  redis.call('ZREM', queue, op.h)
  redis.call('ZADD', queue, (9 - op.vp) * BAND, op.v)
  redis.call('HSET', lock, 'holder', op.h, 'fence', fence, 'since', now)
  redis.call('ZADD', KEYS[s], now + op.l, op.d)
  granted_writes(zset, op)
  return {3, fence}
end
-- --- end of urgent preemption -----------------------------------------------------------

-- An unknown operation is refused before anything is written (a script is not rolled back).
local KINDS = {a = true, r = true, e = true, q = true, c = true, s = true, u = true}
for _, group in ipairs(req.groups) do
  for _, op in ipairs(group.ops or {}) do
    if not KINDS[op.o] then
      return redis.error_reply('transition.lua: unknown operation ' .. tostring(op.o))
    end
  end
end

for _, group in ipairs(req.groups) do
  local s = group.s
  local zset = group.z and KEYS[group.z]
  local ready = nil -- the epoch, read at the group's first acquire
  local results = {}
  for _, op in ipairs(group.ops or {}) do
    local result
    if op.o == 'a' or op.o == 'u' then
      if ready == nil then
        ready = redis.call('EXISTS', KEYS[s + 2]) == 1
      end
      result = (op.o == 'a' and acquire or preempt)(s, zset, ready, op)
    elseif op.o == 'r' then
      result = release(s, op)
    elseif op.o == 'e' then
      result = extend(s, op)
    elseif op.o == 'q' then
      result = dequeue(op)
    elseif op.o == 'c' then
      result = reclaim(s, op)
    else
      result = restore(s, op)
    end
    table.insert(results, result)
  end
  zadd_all(zset, group.zadd)
  if #(group.zrem or {}) > 0 then
    redis.call('ZREM', zset, unpack(group.zrem))
  end
  -- An empty Lua table encodes as {} (an object): the caller reads a missing list as empty.
  table.insert(out, results)
end
return cjson.encode(out)
