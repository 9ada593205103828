-- Take or renew the lease on rebuilding the budget ledger from Kafka (one router at a time).
-- KEYS[1] ledger mark  KEYS[2] lease  ARGV[1] token  ARGV[2] lease ms  ARGV[3] 'take'|'renew'
-- 'marked': the ledger is complete (nothing to rebuild); 'ours': the caller holds the lease
-- (taken now or renewed); 'held': another router holds it; 'lost': a renew found the lease
-- gone or another's (it expired, or Redis restarted empty: what was written is suspect).
if redis.call('EXISTS', KEYS[1]) == 1 then return 'marked' end
local holder = redis.call('GET', KEYS[2])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  return 'ours'
end
if ARGV[3] == 'renew' then return 'lost' end
if holder then return 'held' end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 'ours'
