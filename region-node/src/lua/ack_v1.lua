-- Acknowledges published entries of key scheme 1's region-wide dirty set
-- (`tl:dirty`, member "tenant|day", score P + N), left by nodes of the
-- previous version (see region-node/src/legacy.rs).
--
-- KEYS[1]  tl:dirty
-- ARGV     pairs: member, P + N as published
--
-- A member leaves only if a node of the old version has not charged it
-- since it was read (its score did not grow). Returns how many left.
local removed = 0
for i = 1, #ARGV, 2 do
  local current = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if current and tonumber(current) <= tonumber(ARGV[i + 1]) then
    removed = removed + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return removed
