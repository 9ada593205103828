-- Worker heartbeat: instance metadata with a TTL; keeps residents and held slots fresh.
-- KEYS[1] heartbeat hash  KEYS[2] residents hash  KEYS[3] slots zset
-- ARGV[1] model  ARGV[2] max_concurrency  ARGV[3] at (unix s)  ARGV[4] ttl_ms
-- ARGV[5] residents keep ms  ARGV[6] engine_running ('' = unknown)  ARGV[7] engine_waiting
-- ARGV[8] engine_kv_usage (0..1, '' = unknown)
redis.call('HSET', KEYS[1], 'model', ARGV[1], 'max_concurrency', ARGV[2], 'at', ARGV[3])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'engine_running', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'engine_waiting', ARGV[7]) end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'engine_kv_usage', ARGV[8]) end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIRE', KEYS[2], ARGV[5])
  -- a slot held by a resident request stays leased while the request runs
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  for _, qid in ipairs(redis.call('HKEYS', KEYS[2])) do
    redis.call('ZADD', KEYS[3], 'XX', now, qid)
  end
end
return 1
