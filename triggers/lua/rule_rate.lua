-- A trigger rule's sliding window of acted-on messages, shared by every bridge replica.
-- KEYS[1] sorted set of the window's messages (unique member -> time ms)
-- KEYS[2] marker that a drop in this window was already reported
-- ARGV[1] limit   ARGV[2] window ms   ARGV[3] now ms   ARGV[4] unique member
-- Returns 0: admitted; 1: dropped, the first drop reported this window; 2: dropped, already reported.
local now = tonumber(ARGV[3])
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], now, ARGV[4])
  redis.call('PEXPIRE', KEYS[1], window)
  return 0
end
-- Reported once per window: a flood must not turn into one database write per message.
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', window) then
  return 1
end
return 2
