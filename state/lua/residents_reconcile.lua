-- Drop residents the worker no longer runs (after a restart or lost updates).
-- KEYS[1] residents hash  ARGV: query ids to keep
local keep = {}
for _, qid in ipairs(ARGV) do keep[qid] = true end
local dropped = 0
for _, qid in ipairs(redis.call('HKEYS', KEYS[1])) do
  if not keep[qid] then
    redis.call('HDEL', KEYS[1], qid)
    dropped = dropped + 1
  end
end
return dropped
