-- A request left the instance: drop the resident, free its capacity slot, and leave a
-- tombstone so a resync built from an older view cannot re-add it. Idempotent.
-- KEYS[1] heartbeat hash  KEYS[2] residents hash  KEYS[3] slots zset  KEYS[4] gone zset
-- ARGV[1] query id  ARGV[2] at (unix s)  ARGV[3] tombstone keep seconds
-- Optional, for a request the engine ran: KEYS[5] recently-finished list
-- ARGV[4] "prompt,output,arrived_at,finished_at"  ARGV[5] entries kept  ARGV[6] keep ms.
-- Only the first done of a query (it was still a resident) records it.
local removed = redis.call('HDEL', KEYS[2], ARGV[1]) + redis.call('ZREM', KEYS[3], ARGV[1])
local at = tonumber(ARGV[2])
local first = redis.call('ZSCORE', KEYS[4], ARGV[1]) == false
redis.call('ZADD', KEYS[4], at, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. (at - tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[4], math.floor(tonumber(ARGV[3]) * 1000))
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'at', ARGV[2]) end
if KEYS[5] and ARGV[4] and ARGV[4] ~= '' and first then
  redis.call('LPUSH', KEYS[5], ARGV[4])
  redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[5]) - 1)
  redis.call('PEXPIRE', KEYS[5], tonumber(ARGV[6]))
end
return removed
