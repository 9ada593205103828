-- Reserve capacity slots on one instance, all or per id, atomically. Idempotent per id.
-- KEYS[1] slots zset (member = query id, score = last touch, Redis server time)
-- ARGV[1] max slots  ARGV[2] lease seconds (0 = slots never expire)
-- ARGV[3] the query ids, joined by '\n' (one argument, not one per query)
-- Returns one 1/0 per id, in order.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[2])
if lease > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - lease)) end
local max = tonumber(ARGV[1])
local used = redis.call('ZCARD', KEYS[1])
local ids, pos = ARGV[3], 1
local out = {}
while pos <= #ids + 1 do
  local stop = string.find(ids, '\n', pos, true)
  local qid = string.sub(ids, pos, (stop or 0) - 1)
  pos = (stop or #ids + 1) + 1
  if redis.call('ZSCORE', KEYS[1], qid) then
    out[#out + 1] = 1
  elseif used < max then
    redis.call('ZADD', KEYS[1], now, qid)
    used = used + 1
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
