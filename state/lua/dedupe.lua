-- First sight of a query id: remember its body hash. Same id again: duplicate or conflict.
-- KEYS[1] dedupe hash (sha, routed)  ARGV[1] body sha256  ARGV[2] ttl ms
-- Returns {verdict, routed-to or ''}.
local sha = redis.call('HGET', KEYS[1], 'sha')
if not sha then
  redis.call('HSET', KEYS[1], 'sha', ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {'new', ''}
end
local routed = redis.call('HGET', KEYS[1], 'routed') or ''
if sha == ARGV[1] then return {'duplicate', routed} end
return {'conflict', routed}
