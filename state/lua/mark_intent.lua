-- Record, before its messages are produced, where a deduped query is being routed and the
-- exact decision sent, so that a successor router re-sends the same decision to the same
-- instance after a crash instead of deciding again. Only while the dedupe entry lives and
-- only if the query is not marked routed yet (a final mark is never overwritten).
-- KEYS[i] dedupe hash of query i (one hash tag)  ARGV[i] "<instance id>\n<decision json>"
-- Returns how many entries were marked.
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 and redis.call('HEXISTS', key, 'routed') == 0 then
    redis.call('HSET', key, 'intent', ARGV[i])
    n = n + 1
  end
end
return n
