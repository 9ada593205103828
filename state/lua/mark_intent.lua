-- Record, before its messages are produced, where a deduped query is being routed and the
-- exact decision sent, so that a successor router re-sends the same decision to the same
-- instance after a crash instead of deciding again. The first intent wins: a query already
-- marked routed, or whose recorded intent is another one, belongs to the router that got
-- there first (this one was paused mid-window past its group session, a zombie) and must
-- not be produced again.
-- A query a rescuer re-routes from a silent instance (ARGV[n + i] names that instance) is
-- routed already, to that instance, and its rescue claim (claim.lua) made it this router's:
-- its intent replaces the one recorded, unless the query was marked routed elsewhere
-- meanwhile (another rescuer re-routed it while this router was paused with it).
-- KEYS[i] dedupe hash of query i (one hash tag)  ARGV[i] "<instance id>\n<decision json>"
-- ARGV[n + i] (optional, n = #KEYS) the instance query i is re-routed from, or ''
-- Returns one entry per key: 1 recorded (or already this very intent), 0 no dedupe entry,
-- or the instance id the query is taken by (routed to, or intended for by another router).
local n = #KEYS
local out = {}
for i, key in ipairs(KEYS) do
  local from = ARGV[n + i] or ''
  if redis.call('EXISTS', key) == 0 then
    out[i] = 0
  else
    local routed = redis.call('HGET', key, 'routed')
    local mine = string.match(ARGV[i], '^[^\n]*')
    if from ~= '' then
      if routed and routed ~= from and routed ~= mine then
        out[i] = routed
      else
        redis.call('HSET', key, 'intent', ARGV[i])
        out[i] = 1
      end
    elseif routed then
      out[i] = routed
    else
      local held = redis.call('HGET', key, 'intent')
      if held and held ~= ARGV[i] then
        out[i] = string.match(held, '^[^\n]*')
      else
        redis.call('HSET', key, 'intent', ARGV[i])
        out[i] = 1
      end
    end
  end
end
return out
