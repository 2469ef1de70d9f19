-- Writes applied limits records into the region's copy, never moving one
-- back: every node of the region writes each record it applies, in any
-- order relative to the others.
--
-- KEYS      the copy's hashes (all in one slot: one bucket's), one per record
-- ARGV      triplets, one per key: field (the record's Kafka key), version,
--           body (JSON)
-- A field's value is "<version>|<body>". A field whose stored version is at
-- least the record's is left alone. Returns how many fields were written.
local written = 0
for i = 1, #KEYS do
  local a = (i - 1) * 3
  local field, version = ARGV[a + 1], tonumber(ARGV[a + 2])
  local cur = redis.call('HGET', KEYS[i], field)
  local have = cur and tonumber(string.match(cur, '^(%d+)|'))
  if not have or have < version then
    redis.call('HSET', KEYS[i], field, ARGV[a + 2] .. '|' .. ARGV[a + 3])
    written = written + 1
  end
end
return written
