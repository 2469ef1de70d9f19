-- Acknowledges published entries of one bucket's dirty set.
--
-- KEYS[1]   the bucket's dirty set (zset: member "tenant|label", the label
--           of a day or another period: shared/src/period.rs)
-- KEYS[2..] the tenant hash of each acknowledged member, in ARGV order
-- ARGV[1]   relaxed_ms (relaxed_flush_interval)
-- ARGV      then triplets: member, label, P + N as published
--
-- Every acknowledged counter is stamped with the time of its publication
-- (`g:<label>:s`, Redis clock): the decision script schedules its next one a
-- relaxed interval later. A member leaves the dirty set (and its hash loses
-- the period's publish state `g:<label>:d`) only if its counter has not grown
-- since the publisher read it: a charge that landed after the read raised
-- P + N, so the entry stays dirty, due again a relaxed interval from now (an
-- urgent entry keeps score 0). A member whose counter is gone (expired,
-- lost) just leaves.
-- Returns how many members left the dirty set.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local removed = 0
for i = 2, #ARGV, 3 do
  local k = KEYS[(i + 1) / 3 + 1]
  local gp = 'g:' .. ARGV[i + 1] .. ':'
  local c = redis.call('HMGET', k, gp .. 'p', gp .. 'n', gp .. 'd')
  local p = tonumber(c[1])
  if p then redis.call('HSET', k, gp .. 's', now_ms) end
  if not p or p + (tonumber(c[2]) or 0) <= tonumber(ARGV[i + 2]) then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
    if p then redis.call('HDEL', k, gp .. 'd') end
  elseif tonumber(c[3]) ~= 2 then
    redis.call('ZADD', KEYS[1], 'XX', now_ms + tonumber(ARGV[1]), ARGV[i])
  end
end
return removed
