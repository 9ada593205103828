-- Give back reservations of queries that will not run. Unknown or settled ids: no-op.
-- KEYS[1] ledger hash  KEYS[2] reservations hash  ARGV: query ids
local released = 0
for _, qid in ipairs(ARGV) do
  local amount = redis.call('HGET', KEYS[2], qid)
  if amount then
    redis.call('HINCRBY', KEYS[1], 'reserved', '-' .. amount)
    redis.call('HDEL', KEYS[2], qid)
    released = released + 1
  end
end
return released
