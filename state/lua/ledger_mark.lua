-- Declare the budget ledger complete after a rebuild, iff the caller still holds the lease.
-- A Redis that restarted empty during the rebuild lost the lease too, so a rebuild written
-- partly into the old Redis can never mark the new one complete.
-- KEYS[1] ledger mark  KEYS[2] lease  ARGV[1] token  ARGV[2] mark value
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2])
return 1
