-- Reserve predicted spend in a tenant's ledger for one period, atomically.
-- Money is in integer nano-USD (exact in Lua doubles below 2^53); the strings in ARGV are
-- handed to HINCRBY unchanged so no float formatting ever touches the ledger.
-- KEYS[1] ledger hash (limit, reserved, spent)  KEYS[2] reservations hash (qid -> nano)
-- KEYS[3] settled hash (qid -> nano)
-- ARGV[1] limit nano  ARGV[2] expire-at unix s (0 = none)
-- ARGV[3] the query ids, joined by '\n'  ARGV[4] their amounts in nano-USD, in the same
-- order, joined by '\n' (two arguments, not two per query: the client packs each in Python)
-- Accept iff reserved + spent + amount <= limit, in the given order. Re-reserving a held id
-- returns 1 and adds nothing; a settled id returns 0 (its spend is already booked).
redis.call('HSET', KEYS[1], 'limit', ARGV[1])
local limit = tonumber(ARGV[1])
local reserved = tonumber(redis.call('HGET', KEYS[1], 'reserved') or '0')
local spent = tonumber(redis.call('HGET', KEYS[1], 'spent') or '0')
local qids, amounts = ARGV[3], ARGV[4]
local qpos, apos = 1, 1
local out = {}
while qpos <= #qids + 1 do
  local qstop = string.find(qids, '\n', qpos, true)
  local astop = string.find(amounts, '\n', apos, true)
  if (qstop == nil) ~= (astop == nil) then
    return redis.error_reply('reserve_budget: one amount per query id')
  end
  local qid = string.sub(qids, qpos, (qstop or 0) - 1)
  local nano = string.sub(amounts, apos, (astop or 0) - 1)
  qpos, apos = (qstop or #qids + 1) + 1, (astop or 0) + 1
  local amount = tonumber(nano)
  if redis.call('HEXISTS', KEYS[2], qid) == 1 then
    out[#out + 1] = 1
  elseif redis.call('HEXISTS', KEYS[3], qid) == 1 then
    out[#out + 1] = 0
  elseif reserved + spent + amount <= limit then
    redis.call('HSET', KEYS[2], qid, nano)
    redis.call('HINCRBY', KEYS[1], 'reserved', nano)
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
