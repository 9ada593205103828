-- A worker publishes its model's Eq. 9 coefficients, refitted online (routing.recalibration).
-- KEYS[1] step-time hash of the model
-- ARGV[1] c0  ARGV[2] c1  ARGV[3] c2  ARGV[4] c3 (ms)  ARGV[5] at (unix s)  ARGV[6] rows
-- ARGV[7] fit_mape ('' = unknown)  ARGV[8] ttft_error ('' = unknown)  ARGV[9] instance
-- ARGV[10] ttl_ms (a model nobody refits any more reverts to its configured coefficients)
-- ARGV[11] dispatch_ms ('' = unknown): the writer's median decision-to-engine delay
-- Returns the new version (one more than the last write's, by any worker of the model).
redis.call('HSET', KEYS[1], 'c0_ms', ARGV[1], 'c1_ms_per_token', ARGV[2],
  'c2_ms_per_ctx_token', ARGV[3], 'c3_ms_per_attn_unit', ARGV[4], 'at', ARGV[5],
  'rows', ARGV[6], 'instance', ARGV[9])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'fit_mape', ARGV[7])
else redis.call('HDEL', KEYS[1], 'fit_mape') end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'ttft_error', ARGV[8])
else redis.call('HDEL', KEYS[1], 'ttft_error') end
if ARGV[11] ~= nil and ARGV[11] ~= '' then redis.call('HSET', KEYS[1], 'dispatch_ms', ARGV[11])
else redis.call('HDEL', KEYS[1], 'dispatch_ms') end
local v = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('PEXPIRE', KEYS[1], ARGV[10])
return v
