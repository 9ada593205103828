-- The router's LRU model of one instance's prefix cache (routing.prefix.LruPrefixModel, the
-- same rules): the blocks of a query routed there, or finished there, become the most
-- recent, its first block the very most recent (vLLM frees a request's blocks tail first, so
-- its tail is evicted first); the least recent go while the blocks' tokens exceed the capacity.
-- KEYS[1] zset block hash -> recency (a counter)  KEYS[2] hash block hash -> tokens, plus
-- '#seq' (the counter), '#total' (tokens held) and '#cap' (a capacity a worker reconciled
-- with the engine's own hit counters; absent until then)
-- ARGV[1] capacity tokens  ARGV[2] tokens per block  ARGV[3] keep ms  ARGV[4] '1': store
-- ARGV[1] as the reconciled capacity, '0': the configured one, used only while none is stored
-- ARGV[5..] block hashes
local cap = tonumber(ARGV[1])
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[2], '#cap', ARGV[1])
else
  local stored = redis.call('HGET', KEYS[2], '#cap')
  if stored then cap = tonumber(stored) end
end
local bt = tonumber(ARGV[2])
local n = #ARGV - 4
local seq = redis.call('HINCRBY', KEYS[2], '#seq', 1)
local total = tonumber(redis.call('HGET', KEYS[2], '#total') or '0')
for i = 1, n do
  local h = ARGV[4 + i]
  local old = redis.call('HGET', KEYS[2], h)
  if old then total = total - tonumber(old) end
  redis.call('HSET', KEYS[2], h, ARGV[2])
  total = total + bt
  redis.call('ZADD', KEYS[1], seq * 65536 + (n - i + 1), h)
end
local evicted = 0
while total > cap + 1e-9 do
  local gone = redis.call('ZPOPMIN', KEYS[1])
  if #gone == 0 then total = 0 break end
  local t = redis.call('HGET', KEYS[2], gone[1])
  if t then total = total - tonumber(t) end
  redis.call('HDEL', KEYS[2], gone[1])
  evicted = evicted + 1
end
redis.call('HSET', KEYS[2], '#total', tostring(total))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return evicted
