-- Record the instance each deduped query was routed to; only while its dedupe entry lives.
-- KEYS[i] dedupe hash of query i (one hash tag)  ARGV[i] instance id
-- Returns how many entries were marked.
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, 'routed', ARGV[i])
    n = n + 1
  end
end
return n
