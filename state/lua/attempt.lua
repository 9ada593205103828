-- Count one more start of a query by a worker (INCR and its TTL in one step: no count is
-- ever left without a TTL, and no MULTI/EXEC is needed, which a Redis Cluster client does
-- badly while it re-discovers the cluster after a failover).
-- KEYS[1] attempt counter of the query  ARGV[1] ttl ms
-- Returns the count (1 the first time).
local n = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return n
