-- One instance's live state as four values, so the router parses one string per instance
-- instead of hundreds of RESP bulk strings. Read-only.
-- KEYS[1] heartbeat hash  KEYS[2] residents hash  KEYS[3] slots zset
-- KEYS[4] recently-finished list
-- Returns {heartbeat "k\0v\0k\0v", residents "qid\0record\0qid\0record", slots used,
--          finished "record\0record" (newest first)}
return {
  table.concat(redis.call('HGETALL', KEYS[1]), '\0'),
  table.concat(redis.call('HGETALL', KEYS[2]), '\0'),
  redis.call('ZCARD', KEYS[3]),
  table.concat(redis.call('LRANGE', KEYS[4], 0, -1), '\0'),
}
