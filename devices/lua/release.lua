-- Release a device lock held under (holder, fence) and hand it to the head of the queue.
-- KEYS[1] lock hash   KEYS[2] fence counter   KEYS[3] wait queue   KEYS[4] lease index
-- ARGV[1] holder   ARGV[2] fence   ARGV[3] lease ms for the next holder   ARGV[4] device name
-- ARGV[5] "force": release whoever holds it (operator action / monitor reclaim)
-- Returns {-1} when the caller is not the current holder (stale: nothing changes),
-- {0} when the lock is now free, or {1, next_holder, next_fence} after a hand-off.
local holder = redis.call('HGET', KEYS[1], 'holder')
if ARGV[5] ~= 'force' then
  if holder ~= ARGV[1] or redis.call('HGET', KEYS[1], 'fence') ~= ARGV[2] then
    return {-1}
  end
end
local head = redis.call('ZPOPMIN', KEYS[3])
if #head == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[4], ARGV[4])
  return {0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fence = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'holder', head[1], 'fence', fence, 'since', now)
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[4])
return {1, head[1], fence}
