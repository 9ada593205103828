-- First sight of a query id: remember its body hash. Same id again: duplicate or conflict.
-- Batched: a window is one call on a single Redis; on a Redis Cluster all KEYS share one
-- hash tag (a dedupe bucket), so a window is a few calls.
-- KEYS[i] dedupe hash of query i (sha, routed)  ARGV[1] ttl ms
-- ARGV[2] the body sha256 of each query, in the order of KEYS, joined by '\n' (one argument,
-- not one per query: the client packs each argument in Python)
-- Returns {verdict_1, routed_1, verdict_2, routed_2, ...} (routed '' when not routed yet).
-- On a single Redis KEYS is empty and the keys come in ARGV[3], joined by '\n' (the
-- client packs one argument once, not each key); on a Redis Cluster they are KEYS.
--! include _window_keys.lua
local keys = window_keys(ARGV[3])
if keys == nil then
  return redis.error_reply('dedupe: no keys')
end
local shas, pos = ARGV[2], 1
local out = {}
for i, key in ipairs(keys) do
  local stop = string.find(shas, '\n', pos, true)
  if (stop == nil) ~= (i == #keys) then
    return redis.error_reply('dedupe: ARGV[2] must hold one body hash per key')
  end
  local want = string.sub(shas, pos, (stop or 0) - 1)
  pos = (stop or 0) + 1
  local got = redis.call('HMGET', key, 'sha', 'routed')
  if not got[1] then
    redis.call('HSET', key, 'sha', want)
    redis.call('PEXPIRE', key, ARGV[1])
    out[#out + 1] = 'new'
    out[#out + 1] = ''
  else
    out[#out + 1] = (got[1] == want) and 'duplicate' or 'conflict'
    out[#out + 1] = got[2] or ''
  end
end
return out
