-- Who runs the copy of a query that sits in one instance's route topic: that instance's
-- worker, or a rescuer re-routing it because the instance went silent. Exactly one wins.
-- All KEYS share the instance's hash tag (one script call per instance).
-- KEYS[i] claim key of query i on the instance (string; TTL)
-- ARGV[1] mode: 'run' (the worker, before it starts the query), 'rescue' (a rescuer takes
--         or renews a lease), 'rerouted' (the rescuer's copy elsewhere was acknowledged),
--         'returned' (the rescuer's copy went back to this very instance, which came back:
--         the claim is dropped, so this instance's worker runs one of its copies)
-- ARGV[2] rescuer id ('' for 'run')  ARGV[3] rescue lease ms  ARGV[4] ttl ms
-- Values: 'run' | 'rescue <id> <lease end ms>' | 'rerouted <id>'
-- Returns one outcome per key:
--   'won'  the caller owns the copy now (run: start it; rescue: re-route it; rerouted: marked;
--          returned: dropped)
--   'lost' someone else owns it for good (a worker started it, or it was re-routed)
--   'wait' (run) a live rescuer lease holds it: not re-routed yet, ask again later
--   'busy' (rescue) another rescuer's lease is live: leave it alone
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mode, who, lease, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local out = {}
for i, key in ipairs(KEYS) do
  local cur = redis.call('GET', key)
  local kind, holder, until_ms
  if cur then
    kind, holder, until_ms = string.match(cur, '^(%S+) ?(%S*) ?(%S*)$')
    until_ms = tonumber(until_ms) or 0
  end
  local expired = kind == 'rescue' and until_ms <= now_ms
  local verdict
  if mode == 'run' then
    if not cur or kind == 'run' or expired then
      redis.call('SET', key, 'run', 'PX', ttl)
      verdict = 'won'
    elseif kind == 'rescue' then
      verdict = 'wait'
    else
      verdict = 'lost'
    end
  elseif mode == 'rescue' then
    if not cur or expired or (kind == 'rescue' and holder == who) then
      redis.call('SET', key, 'rescue ' .. who .. ' ' .. string.format('%d', now_ms + lease), 'PX', ttl)
      verdict = 'won'
    elseif kind == 'rescue' then
      verdict = 'busy'
    else
      verdict = 'lost'
    end
  elseif mode == 'rerouted' then
    -- only the holder of the rescue claim (live or lapsed but not taken over) marks it
    if (kind == 'rescue' and holder == who) or (kind == 'rerouted' and holder == who) or not cur then
      redis.call('SET', key, 'rerouted ' .. who, 'PX', ttl)
      verdict = 'won'
    else
      verdict = 'lost'
    end
  elseif mode == 'returned' then
    -- a 'rerouted' mark here would make the worker skip both copies on this instance (bug 21)
    if (kind == 'rescue' and holder == who) or (kind == 'rerouted' and holder == who) or not cur then
      redis.call('DEL', key)
      verdict = 'won'
    else
      verdict = 'lost'
    end
  else
    return redis.error_reply('claim: unknown mode ' .. tostring(mode))
  end
  out[#out + 1] = verdict
end
return out
