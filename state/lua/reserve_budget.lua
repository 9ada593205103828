-- Reserve predicted spend in a tenant's ledger for one period, atomically.
-- Money is in integer nano-USD (exact in Lua doubles below 2^53); the strings in ARGV are
-- handed to HINCRBY unchanged so no float formatting ever touches the ledger.
-- KEYS[1] ledger hash (limit, reserved, spent)  KEYS[2] reservations hash (qid -> nano)
-- KEYS[3] settled hash (qid -> nano)
-- ARGV[1] limit nano  ARGV[2] expire-at unix s (0 = none)  ARGV[3..] pairs: query id, amount nano
-- Accept iff reserved + spent + amount <= limit, in the given order. Re-reserving a held id
-- returns 1 and adds nothing; a settled id returns 0 (its spend is already booked).
redis.call('HSET', KEYS[1], 'limit', ARGV[1])
local limit = tonumber(ARGV[1])
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
local spent = tonumber(redis.call('HGET', KEYS[1], 'spent') or '0')
local out = {}
for i = 3, #ARGV, 2 do
  local qid = ARGV[i]
  local amount = tonumber(ARGV[i + 1])
  if redis.call('HEXISTS', KEYS[2], qid) == 1 then
    out[#out + 1] = 1
  elseif redis.call('HEXISTS', KEYS[3], qid) == 1 then
    out[#out + 1] = 0
  elseif reserved + spent + amount <= limit then
    redis.call('HSET', KEYS[2], qid, ARGV[i + 1])
    redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[i + 1])
    reserved = reserved + amount
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if ARGV[2] ~= '0' then
  for k = 1, 3 do redis.call('EXPIREAT', KEYS[k], ARGV[2]) end
end
return out
