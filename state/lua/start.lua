-- Record one start of a query by a worker process (one script: no key is ever left without
-- its TTL, and no MULTI/EXEC, which a Redis Cluster client does badly while it re-discovers
-- the cluster after a failover).
-- KEYS[1] the query's start hash  ARGV[1] ttl ms  ARGV[2] the starting worker process's token
-- The hash holds '#' (every start, numbered) and one field per worker process that started
-- the query. A retry within one process (a stage retried, this script re-sent after a lost
-- reply) is a new start but not a new process: only a process that died mid-inference is
-- followed by another one.
-- Returns {this start's number (1 the first time), the worker processes that started it}.
local n = redis.call('HINCRBY', KEYS[1], '#', 1)
redis.call('HSETNX', KEYS[1], 'p:' .. ARGV[2], 1)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {n, redis.call('HLEN', KEYS[1]) - 1}
