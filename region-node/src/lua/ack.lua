-- Acknowledges published dirty entries.
--
-- KEYS[1]  the dirty set (zset: member "tenant|day", score = p + n)
-- KEYS[2]  the published set (zset: member "tenant|day", score = when the
--          region last published it, ms of Redis TIME)
-- ARGV[1]  forget after (ms): published-set entries older than this are
--          removed, so the set holds only what is still being deferred
-- ARGV     then pairs: member, score-as-published
--
-- A member is removed from the dirty set only if its score has not grown
-- since the publisher read it: a charge that landed after the read raised
-- p + n, so the entry stays dirty and is published again. Every member
-- acknowledged is stamped in the published set, whether or not it stayed
-- dirty. Returns how many members were removed from the dirty set.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local removed = 0
for i = 2, #ARGV, 2 do
  local current = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if current and tonumber(current) <= tonumber(ARGV[i + 1]) then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
  redis.call('ZADD', KEYS[2], now_ms, ARGV[i])
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now_ms - tonumber(ARGV[1])))
return removed
