-- Extend the lease of the current holder.
-- KEYS[1] lock hash   KEYS[2] lease index   ARGV[1] holder   ARGV[2] fence   ARGV[3] lease ms
-- ARGV[4] device name.  Returns 1 when extended, 0 when the caller no longer holds the lock.
if redis.call('HGET', KEYS[1], 'holder') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'fence') ~= ARGV[2] then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[4])
return 1
