-- List devices of one lock shard whose lease has expired, and push each lease out by
-- ARGV[3] ms so the next monitor tick does not claim it again while this one is
-- reclaiming it.
-- KEYS[1] the shard's lease index   ARGV[1] now ms   ARGV[2] batch size   ARGV[3] claim ms
-- ARGV[4] the shard's lock hash key prefix: a device's lock is ARGV[4] .. device, a key in
-- KEYS[1]'s hash slot (the prefix carries the shard's hash tag: devices/locks.py)
-- Returns a flat list: device, holder, fence, device, holder, fence, ...
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, device in ipairs(due) do
  local lock = ARGV[4] .. device
  local holder = redis.call('HGET', lock, 'holder')
  if holder then
    redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[3]), device)
    table.insert(out, device)
    table.insert(out, holder)
    table.insert(out, redis.call('HGET', lock, 'fence'))
  else
    redis.call('ZREM', KEYS[1], device)
  end
end
return out
