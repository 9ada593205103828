-- Book what Kafka shows into one tenant's ledger for one period. Idempotent per query id and
-- safe beside workers settling concurrently (same rules as settle.lua / reserve_budget.lua):
-- a settled id is never booked twice; an id settled here that was reserved moves from
-- reserved to spent; a routed id neither reserved nor settled is reserved at its worst case.
-- No limit check: this spend already happened (or is running), it is not being asked for.
-- KEYS[1] ledger hash  KEYS[2] reservations hash  KEYS[3] settled hash
-- ARGV[1] limit nano  ARGV[2] expire-at unix s (0 = none)  ARGV[3] n settled pairs
-- ARGV[4..] n pairs (query id, actual nano), then pairs (query id, worst-case nano)
-- Returns {settled booked now, reservations booked now}.
redis.call('HSET', KEYS[1], 'limit', ARGV[1])
local n = tonumber(ARGV[3])
local booked, held = 0, 0
local last = 3 + 2 * n
for i = 4, last, 2 do
  local qid = ARGV[i]
  if redis.call('HEXISTS', KEYS[3], qid) == 0 then
    local amount = redis.call('HGET', KEYS[2], qid)
    if amount then
      redis.call('HINCRBY', KEYS[1], 'reserved', '-' .. amount)
      redis.call('HDEL', KEYS[2], qid)
    end
    redis.call('HINCRBY', KEYS[1], 'spent', ARGV[i + 1])
    redis.call('HSET', KEYS[3], qid, ARGV[i + 1])
    booked = booked + 1
  end
end
for i = last + 1, #ARGV, 2 do
  local qid = ARGV[i]
  if redis.call('HEXISTS', KEYS[3], qid) == 0 and redis.call('HEXISTS', KEYS[2], qid) == 0 then
    redis.call('HSET', KEYS[2], qid, ARGV[i + 1])
    redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[i + 1])
    held = held + 1
  end
end
if ARGV[2] ~= '0' then
  for k = 1, 3 do redis.call('EXPIREAT', KEYS[k], ARGV[2]) end
end
return {booked, held}
