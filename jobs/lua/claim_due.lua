-- Claim up to ARGV[2] members of a deadline set whose time has come, removing them so
-- that no other monitor claims them too.
-- KEYS[1] deadline set (member -> due ms)   ARGV[1] now ms   ARGV[2] batch size
-- Returns the claimed members, earliest first.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #due > 0 then
  redis.call('ZREM', KEYS[1], unpack(due))
end
return due
