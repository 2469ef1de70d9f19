-- A measurement prototype, not loaded by any node: the bench plan's check
-- (node fixed window + region sliding window + global budget, everything
-- allowed) with every tier's state in ONE binary field of the tenant hash
-- (struct.pack of doubles) and 9 arguments. It answers how cheap the
-- decision script could be with that storage layout (BENCHMARKS.md, "The
-- script rewritten for Redis' CPU"): it has none of decide.lua's
-- generality (any number and kind of tiers, refunds, peeks, leases, the
-- rollback check, urgency, new-day cleanup), so it is a lower bound.
--
--   scripts/script-profile bench/prototypes/decide_packed.lua
--
-- (its arguments are the words of decide_packed.args beside it).
--
-- ARGV: tenant|day member, deadline, global limit, broadcast total, epoch
-- candidate, node tier limit and window ms, region tier limit and window ms.
local A = ARGV
local call = redis.call
local floor = math.floor
local t = redis.call('TIME')
local now_us = t[1] * 1000000 + t[2]
local now_ms = floor(now_us / 1000)
local deadline = A[2] + 0
if deadline > 0 and now_ms > deadline then return { 3, 0, 3 } end
local day = floor(now_ms / 86400000)
local gp = 'g:' .. day .. ':'
local fe, fpp, fn, fd = gp .. 'e', gp .. 'p', gp .. 'n', gp .. 'd'
local h = call('HMGET', KEYS[1], fe, fpp, fn, fd, 'ts')
-- tiers: fixed (limit A[6], w A[7]), sliding (limit A[8], w A[9])
local l1, w1, l2, w2 = A[6] + 0, A[7] + 0, A[8] + 0, A[9] + 0
local i1, c1, i2, c2, p2 = 0, 0, 0, 0, 0
if h[5] then i1, c1, i2, c2, p2 = struct.unpack('<ddddd', h[5]) end
local cost = 1
local idx1 = floor(now_ms / w1)
local used1 = 0
if i1 == idx1 then used1 = c1 end
local ok1 = used1 + cost <= l1
local idx2 = floor(now_ms / w2)
local cur, prev = 0, 0
if i2 == idx2 then cur = c2; prev = p2 elseif i2 == idx2 - 1 then prev = c2 end
local elapsed = now_ms - idx2 * w2
local est = prev * ((w2 - elapsed) / w2) + cur
local ok2 = est + cost <= l2
local own_p = (h[2] and h[2] + 0) or 0
local own_n = (h[3] and h[3] + 0) or 0
local glimit = A[3] + 0
local grem = glimit - (A[4] - 0) - (own_p - own_n)
local okg = cost <= grem
if ok1 and ok2 and okg then
  own_p = own_p + cost
  local hs = { fpp, string.format('%.0f', own_p), 'ts', struct.pack('<ddddd', idx1, used1 + cost, idx2, cur + cost, prev) }
  if not h[1] then hs[5] = fe; hs[6] = A[5] end
  if not h[4] then hs[#hs + 1] = fd; hs[#hs + 1] = 1; call('ZADD', KEYS[2], now_ms, A[1]) end
  call('HSET', KEYS[1], unpack(hs))
  return { 3, 1, 0, 0, 0, now_ms, own_p, own_n, day, 0, 0, 0, 0, grem - cost, h[1] or A[5], l1 - used1 - cost, (idx1 + 1) * w1 - now_ms, floor(l2 - est - cost), (idx2 + 1) * w2 - now_ms }
end
return { 3, 0, 1 }
