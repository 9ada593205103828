-- A request left the instance: drop the resident and free its capacity slot. Idempotent.
-- KEYS[1] heartbeat hash  KEYS[2] residents hash  KEYS[3] slots zset
-- ARGV[1] query id  ARGV[2] at
local removed = redis.call('HDEL', KEYS[2], ARGV[1]) + redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'at', ARGV[2]) end
return removed
