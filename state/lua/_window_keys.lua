-- Included by the window scripts (state.redis_core inlines each `--! include FILE` line):
-- the keys of the call. On a Redis Cluster they are KEYS (all of one hash tag); on a single
-- Redis KEYS is empty and they come in one argument, joined by '\n' (the client packs one
-- argument once, not each key). nil when neither holds any.
local function window_keys(joined)
  if #KEYS > 0 then
    return KEYS
  end
  if joined == nil or joined == '' then
    return nil
  end
  local keys, at = {}, 1
  while true do
    local stop = string.find(joined, '\n', at, true)
    keys[#keys + 1] = string.sub(joined, at, (stop or 0) - 1)
    if not stop then
      return keys
    end
    at = stop + 1
  end
end
