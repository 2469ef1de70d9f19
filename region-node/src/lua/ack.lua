-- Acknowledges published dirty entries.
--
-- KEYS[1]  the dirty set (zset: member "tenant|day", score = p + n)
-- ARGV     pairs: member, score-as-published
--
-- A member is removed only if its score has not grown since the publisher
-- read it: a charge that landed after the read raised p + n, so the entry
-- stays dirty and is published again at the next flush. Returns how many
-- members were removed.
local removed = 0
for i = 1, #ARGV, 2 do
  local current = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if current and tonumber(current) <= tonumber(ARGV[i + 1]) then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return removed
