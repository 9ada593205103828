-- Move a query's reservation to spent at its actual cost. Once per id: a second settle is a no-op.
-- KEYS[1] ledger hash  KEYS[2] reservations hash  KEYS[3] settled hash
-- ARGV[1] query id  ARGV[2] actual nano  ARGV[3] expire-at unix s (0 = none)
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 0 end
local amount = redis.call('HGET', KEYS[2], ARGV[1])
if amount then
  redis.call('HINCRBY', KEYS[1], 'reserved', '-' .. amount)
  redis.call('HDEL', KEYS[2], ARGV[1])
end
redis.call('HINCRBY', KEYS[1], 'spent', ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
if ARGV[3] ~= '0' then
  for k = 1, 3 do redis.call('EXPIREAT', KEYS[k], ARGV[3]) end
end
return 1
