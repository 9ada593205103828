-- Record the instance each deduped query was routed to; only while its dedupe entry lives.
-- The route intent (mark_intent.lua) has served its purpose once the query is marked: it
-- is dropped, so a dedupe entry stays small for its whole TTL.
-- KEYS[i] dedupe hash of query i (one hash tag)  ARGV[i] instance id
-- Returns how many entries were marked.
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, 'routed', ARGV[i])
    redis.call('HDEL', key, 'intent')
    n = n + 1
  end
end
return n
