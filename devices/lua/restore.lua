-- Rebuild one device's lock after Redis lost its data (the database is the authority).
-- KEYS[1] lock hash   KEYS[2] fence counter   KEYS[3] lease index
-- ARGV[1] holder ("" when nobody is executing on the device)   ARGV[2] highest fence the
-- database has seen for the device   ARGV[3] lease ms   ARGV[4] device name
-- The fence counter never goes below what the database saw, so tokens keep increasing.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local floor = tonumber(ARGV[2])
if tonumber(redis.call('GET', KEYS[2]) or '0') < floor then
  redis.call('SET', KEYS[2], floor)
end
if ARGV[1] ~= '' and not redis.call('HGET', KEYS[1], 'holder') then
  redis.call('HSET', KEYS[1], 'holder', ARGV[1], 'fence', ARGV[5], 'since', now)
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[4])
end
return 1
