-- A request arrived on the instance (queued). Idempotent: re-adding overwrites.
-- KEYS[1] heartbeat hash  KEYS[2] residents hash  KEYS[3] slots zset  KEYS[4] gone zset
-- ARGV[1] query id  ARGV[2] "prompt,prefilled,decoded,predicted,arrived_at"  ARGV[3] at  ARGV[4] keep ms
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('ZREM', KEYS[4], ARGV[1])  -- a re-delivered query is resident again
-- touch the heartbeat's time only while it lives: never resurrect an expired instance
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'at', ARGV[3]) end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[3], 'XX', tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1])
return 1
