-- First sight of a query id: remember its body hash. Same id again: duplicate or conflict.
-- Batched: all KEYS share one hash tag (a dedupe bucket), so a window is a few calls.
-- KEYS[i] dedupe hash of query i (sha, routed)  ARGV[1] ttl ms  ARGV[i + 1] body sha256 of query i
-- Returns {verdict_1, routed_1, verdict_2, routed_2, ...} (routed '' when not routed yet).
local out = {}
for i, key in ipairs(KEYS) do
  local want = ARGV[i + 1]
  local sha = redis.call('HGET', key, 'sha')
  if not sha then
    redis.call('HSET', key, 'sha', want)
    redis.call('PEXPIRE', key, ARGV[1])
    out[#out + 1] = 'new'
    out[#out + 1] = ''
  else
    out[#out + 1] = (sha == want) and 'duplicate' or 'conflict'
    out[#out + 1] = redis.call('HGET', key, 'routed') or ''
  end
end
return out
