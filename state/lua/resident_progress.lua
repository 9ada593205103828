-- Token progress of a resident request. Ignored when the request is gone (done wins a race).
-- KEYS[1] heartbeat hash  KEYS[2] residents hash
-- ARGV[1] query id  ARGV[2] prefilled tokens  ARGV[3] decoded tokens  ARGV[4] at
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if not cur then return 0 end
local prompt, _, _, predicted, arrived = string.match(cur, '^([^,]*),([^,]*),([^,]*),([^,]*),([^,]*)$')
if not prompt then return redis.error_reply('resident ' .. ARGV[1] .. ' has a malformed record') end
local prefilled = math.min(tonumber(ARGV[2]), tonumber(prompt))
local decoded = tonumber(ARGV[3])
-- a decoding request has its whole prompt in the KV cache (ResidentRequest's invariant)
if decoded > 0 then prefilled = tonumber(prompt) end
redis.call('HSET', KEYS[2], ARGV[1],
  prompt .. ',' .. string.format('%d', prefilled) .. ',' .. string.format('%d', decoded) .. ',' .. predicted .. ',' .. arrived)
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'at', ARGV[4]) end
return 1
