-- Acquire a device lock, or join the device's wait queue.
-- KEYS[1] lock hash {holder, fence, since}   KEYS[2] fence counter   KEYS[3] wait queue (zset)
-- KEYS[4] lease index (zset device -> lease expiry ms)   KEYS[5] queue arrival counter
-- KEYS[6] epoch: exists while Redis holds the lock state; gone after Redis lost its data
-- KEYS[4..6] are those of the device's lock shard, in the hash slot of KEYS[1..3] (devices/locks.py)
-- ARGV[1] holder   ARGV[2] priority 0..9 (9 most urgent)   ARGV[3] lease ms   ARGV[4] device name
-- Returns {1, fence} when granted (also when the caller already holds it: re-acquire is
-- idempotent, so a redelivered task does not queue behind itself), {0, position} when
-- queued, or {-1, 0} when the epoch is missing: granting now could hand a device that is
-- still executing a command to a second holder, so nothing is granted until the lock
-- state has been rebuilt from the database.
if redis.call('EXISTS', KEYS[6]) == 0 then
  return {-1, 0}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local holder = redis.call('HGET', KEYS[1], 'holder')
if holder == ARGV[1] then
  return {1, tonumber(redis.call('HGET', KEYS[1], 'fence'))}
end
if not holder and redis.call('ZCARD', KEYS[3]) == 0 then
  local fence = redis.call('INCR', KEYS[2])
  redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'fence', fence, 'since', now)
  redis.call('ZADD', KEYS[4], now + tonumber(ARGV[3]), ARGV[4])
  return {1, fence}
end
if not redis.call('ZSCORE', KEYS[3], ARGV[1]) then
  -- Lower score is served first: priority band, then arrival order within the band.
  -- 2^40 arrivals per band fit exactly in a double's 53-bit mantissa.
  local seq = redis.call('INCR', KEYS[5])
  local score = (9 - tonumber(ARGV[2])) * 1099511627776 + seq
  redis.call('ZADD', KEYS[3], score, ARGV[1])
end
return {0, redis.call('ZRANK', KEYS[3], ARGV[1]) + 1}
