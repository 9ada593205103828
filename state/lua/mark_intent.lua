-- Record, before its messages are produced, where a deduped query is being routed and the
-- exact decision sent, so that a successor router re-sends the same decision to the same
-- instance after a crash instead of deciding again. The first intent wins: a query already
-- marked routed, or whose recorded intent is another one, belongs to the router that got
-- there first (this one was paused mid-window past its group session, a zombie) and must
-- not be produced again.
-- A query a rescuer re-routes from a silent instance (its entry in ARGV[2]) is routed
-- already, to that instance, and its rescue claim (claim.lua) made it this router's: its
-- intent replaces the one recorded, unless the query was marked routed elsewhere meanwhile
-- (another rescuer re-routed it while this router was paused with it).
-- KEYS[i] dedupe hash of query i (on a Redis Cluster all KEYS share one hash tag)
-- ARGV[1] each query's intent "<instance id>\n<decision json>", in the order of KEYS,
-- joined by the byte 0x1e (JSON and instance ids never hold it)
-- ARGV[2] (optional: absent or '' when none is re-routed) the instance each query is
-- re-routed from, or '', joined by '\n'
-- Returns one entry per key: 1 recorded (or already this very intent), 0 no dedupe entry,
-- or the instance id the query is taken by (routed to, or intended for by another router).
-- A dedupe entry is a hash of sha, routed and intent only: it exists iff one of them does.
-- On a single Redis KEYS is empty and the keys come in ARGV[3], joined by '\n' (the
-- client packs one argument once, not each key); on a Redis Cluster they are KEYS.
--! include _window_keys.lua
local keys = window_keys(ARGV[3])
if keys == nil then
  return redis.error_reply('mark_intent: no keys')
end
local n = #keys
local intents, froms = ARGV[1], ARGV[2] or ''
local ipos, fpos = 1, 1
local out = {}
for i, key in ipairs(keys) do
  local istop = string.find(intents, '\30', ipos, true)
  if (istop == nil) ~= (i == n) then
    return redis.error_reply('mark_intent: ARGV[1] must hold one intent per key')
  end
  local intent = string.sub(intents, ipos, (istop or 0) - 1)
  ipos = (istop or 0) + 1
  local from = ''
  if froms ~= '' then
    local fstop = string.find(froms, '\n', fpos, true)
    if (fstop == nil) ~= (i == n) then
      return redis.error_reply('mark_intent: ARGV[2] must hold one instance (or none) per key')
    end
    from = string.sub(froms, fpos, (fstop or 0) - 1)
    fpos = (fstop or 0) + 1
  end
  local got = redis.call('HMGET', key, 'sha', 'routed', 'intent')
  local routed, held = got[2], got[3]
  if not (got[1] or routed or held) then
    out[i] = 0
  else
    local mine = string.match(intent, '^[^\n]*')
    if from ~= '' then
      if routed and routed ~= from and routed ~= mine then
        out[i] = routed
      else
        redis.call('HSET', key, 'intent', intent)
        out[i] = 1
      end
    elseif routed then
      out[i] = routed
    elseif held and held ~= intent then
      out[i] = string.match(held, '^[^\n]*')
    else
      redis.call('HSET', key, 'intent', intent)
      out[i] = 1
    end
  end
end
return out
