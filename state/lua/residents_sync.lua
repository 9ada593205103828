-- Replace an instance's residents with the worker's own view, without undoing what happened
-- after the view was taken: a resident done since then (tombstone in the gone set) is not
-- re-added, and one added since then (arrived_at > view time) is not removed.
-- KEYS[1] residents hash  KEYS[2] gone zset (query id -> when it was done)
-- ARGV[1] view time (unix s)  ARGV[2] keep ms  ARGV[3..] pairs: query id, record
local view_at = tonumber(ARGV[1])
local keep = {}
for i = 3, #ARGV, 2 do
  local qid = ARGV[i]
  keep[qid] = true
  if not redis.call('ZSCORE', KEYS[2], qid) then redis.call('HSET', KEYS[1], qid, ARGV[i + 1]) end
end
local dropped = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local qid = all[i]
  if not keep[qid] then
    local arrived = tonumber(string.match(all[i + 1], '([^,]*)$'))
    if arrived == nil or arrived <= view_at then
      redis.call('HDEL', KEYS[1], qid)
      dropped = dropped + 1
    end
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return dropped
