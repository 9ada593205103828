-- Record the instance a deduped query was routed to; only while its dedupe entry lives.
-- KEYS[1] dedupe hash  ARGV[1] instance id
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'routed', ARGV[1])
return 1
