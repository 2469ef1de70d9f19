-- The region's newcomer gate: admits a tenant the configuration does not
-- name, at most ARGV[3] new ones a second and ARGV[4] a day, counted across
-- every node of the region. Runs once per (node, tenant, day): the node
-- remembers whom it saw admitted (region-node/src/newcomers.rs).
--
-- KEYS[1]  the day's set of admitted newcomers (tl:{b0..}:nt:<day>)
-- KEYS[2]  the region's one-second newcomer counter (tl:{b0..}:nt:rate)
-- ARGV[1]  tenant
-- ARGV[2]  TTL of the day's set, seconds
-- ARGV[3]  max new tenants per second
-- ARGV[4]  max new tenants per day
--
-- Returns {outcome, retry_ms}: outcome 0 already admitted today, 1 admitted
-- now, 2 refused (the day's quota is spent), 3 refused (this second's quota
-- is spent; retry_ms is what is left of the second).
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then
  return {0, 0}
end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return {2, 0}
end
local n = redis.call('INCR', KEYS[2])
if n == 1 then
  redis.call('PEXPIRE', KEYS[2], 1000)
end
if n > tonumber(ARGV[3]) then
  local left = redis.call('PTTL', KEYS[2])
  if left < 0 then
    -- A counter without a TTL (it cannot happen through this script) would
    -- close the gate for good: give it one.
    redis.call('PEXPIRE', KEYS[2], 1000)
    left = 1000
  end
  return {3, left}
end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2], 'NX')
return {1, 0}
