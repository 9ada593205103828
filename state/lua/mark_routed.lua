-- Record the instance each deduped query was routed to; only while its dedupe entry lives.
-- The route intent (mark_intent.lua) has served its purpose once the query is marked: it
-- is dropped, so a dedupe entry stays small for its whole TTL.
-- KEYS[i] dedupe hash of query i (on a Redis Cluster all KEYS share one hash tag)
-- ARGV[1] the instance id of each query, in the order of KEYS, joined by '\n'
-- Returns how many entries were marked.
-- On a single Redis KEYS is empty and the keys come in ARGV[2], joined by '\n' (the
-- client packs one argument once, not each key); on a Redis Cluster they are KEYS.
--! include _window_keys.lua
local keys = window_keys(ARGV[2])
if keys == nil then
  return redis.error_reply('mark_routed: no keys')
end
local ids, pos = ARGV[1], 1
local n = 0
for i, key in ipairs(keys) do
  local stop = string.find(ids, '\n', pos, true)
  if (stop == nil) ~= (i == #keys) then
    return redis.error_reply('mark_routed: ARGV[1] must hold one instance id per key')
  end
  local instance = string.sub(ids, pos, (stop or 0) - 1)
  pos = (stop or 0) + 1
  -- an entry holds its body hash beside the intent, so a dropped intent proves it lives
  -- (the usual case: one command less than asking first)
  if redis.call('HDEL', key, 'intent') == 1 or redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, 'routed', instance)
    n = n + 1
  end
end
return n
