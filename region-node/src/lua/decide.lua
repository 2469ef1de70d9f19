-- tierlimit decision script: every windowed tier of one tenant's request
-- (node and region tiers, of the plan and of each descriptor) and the
-- region's global budget, evaluated together and charged all-or-nothing in
-- one round trip. Key scheme: shared/src/keys.rs. Arguments are laid out by
-- region-node/src/storage/script.rs, the only reader of these positions and
-- of the reply.
--
-- It runs on every decision that reaches Redis, so it is written for Redis'
-- CPU (BENCHMARKS.md, "Where the decision script's instructions go"): three
-- commands on the common path (TIME, one HMGET, one HSET); one table per
-- tier, allocated once with every field it will hold; numbers read from ARGV
-- only on the path that needs them; values read from Redis written back as
-- the same strings when unchanged (Redis formats a Lua number with
-- snprintf, which costs more than the rest of a field); a reply of integers
-- in fixed positions (Redis converts a reply element by element, so names
-- beside the values doubled its cost).
--
-- KEYS[1]   the tenant hash   tl:{B}:t:T   (whole-tenant tier states, the
--           PN counter of each day, its publish state)
-- KEYS[2]   the bucket's dirty set   tl:{B}:dirty
-- KEYS[3..] tiers kept outside the tenant hash (key-scoped, windows over a
--           day, the sliding log), in the order their tiers name them
--
-- ARGV[1]   op: "check" | "refund" | "peek"
-- ARGV[2]   deadline in Redis' clock, ms (0 = none): a call that reaches
--           Redis after it does nothing and answers denied = expired (the
--           node gave up at its store_timeout and answered from its fail
--           mode, so charging now would count the request twice)
-- ARGV[3]   tenant id (the dirty-set member is "T|day")
-- ARGV[4]   the day the node computed; if Redis' clock says otherwise the
--           broadcast is not for this day (others = 0)
-- ARGV[5]   epoch candidate, used if today's counter does not exist yet;
--           also makes sliding-log members unique
-- ARGV[6]   TTL of the tenant hash, s (retention + 1 day): days older than
--           TTL/86400 are dropped from the hash when a new day starts
-- ARGV[7]   global limit per day (0 = no global tier)
-- ARGV[8]   global cost: units the request charges to the PN counter
-- ARGV[9]   broadcast total for (T, day), all actors
-- ARGV[10]  own cap: most this region's actor may reach (-1 = none); set by
--           the node when its broadcast view is stale
-- ARGV[11]  urgent_at: this region's P − N at which (T, day) must be
--           published at the next flush (-1 = never)
-- ARGV[12]  relaxed_ms: how long after its last publication a (T, day)
--           that is not urgent is due again (relaxed_flush_interval)
-- ARGV[13]  refund record: index in KEYS of the set of refund handles used
--           for the charge's day (0 = a free-form refund, or not a refund)
-- ARGV[14]  refund handle id (unique per charge; "-" when none)
-- ARGV[15]  the charge's Redis time, ms: a refund by handle gives back only
--           to a window the charge was in, and to the global count only on
--           the charge's day
-- ARGV[16]  lease_max: a check that is allowed may also take a lease of up
--           to this many more units (0 = no lease; see "Leases" below)
-- ARGV[17]  lease_share: a lease takes at most 1/lease_share of what every
--           tier (and the global budget) leaves after the request
-- ARGV[18]  K, the number of windowed tiers; then 7 values per tier:
--           location (0 = tenant hash, i = KEYS[i]), field prefix in the
--           hash, algorithm code (1 fixed window, 2 sliding window,
--           3 token bucket, 4 sliding log), limit, window_ms, burst, cost
-- then      triplets epoch, P, N: this region's actors in the broadcast
--
-- Reply: a list in fixed positions (parsed in script.rs, which checks [1]):
--   [1] layout version (3)          [9]  day
--   [2] allowed 1|0                 [10] raised (units the rollback check
--   [3] denied: 0 none, 1 tier,          added to P, see below)
--       2 global, 3 expired         [11] refunded (global units a refund
--   [4] denied tier (1-based)            gave back)
--   [5] retry_ms (-1 = never)       [12] duplicate (1: the handle was used
--   [6] now_ms (Redis TIME)              already, nothing given back)
--   [7] own_p                       [13] granted (units of lease charged
--   [8] own_n                            beyond the request's cost)
--                                   [14] global remaining (-1: no global tier)
--   [15] epoch, naming this region's actor of the day's PN counter
--   then remaining, reset_ms of each tier, in call order.
--
-- Numbers are Lua doubles: exact integers up to 2^53.

local A = ARGV
local call = redis.call
local floor = math.floor
local VERSION = 3

local t = redis.call('TIME')
local now_us = t[1] * 1000000 + t[2]
local now_ms = floor(now_us / 1000)

local function int(x) return string.format('%.0f', x) end

local deadline = A[2] + 0
if deadline > 0 and now_ms > deadline then
  return { VERSION, 0, 3, 0, 0, now_ms, 0, 0, 0, 0, 0, 0, 0, -1, '' }
end

local op = A[1]
local day = floor(now_ms / 86400000)
local node_day = A[4] + 0
if day - node_day > 1 or node_day - day > 1 then
  return redis.error_reply('ERR tierlimit: node clock is more than a day off Redis TIME')
end

-- Read: one HMGET of the tenant hash for the day's counter and every tier
-- kept there; one HMGET per tier kept in a key of its own. Field names per
-- algorithm code (the sliding log is a zset of its own and has none).
local FIELDS = { { 'w', 'c' }, { 'w', 'c', 'p' }, { 't', 'f' } }
local gp = 'g:' .. day .. ':'
local fields = { gp .. 'e', gp .. 'p', gp .. 'n', gp .. 'd', false, false, false, false, false, false, false, false }
local nf = 4
local K = A[18] + 0
local tiers = {}
for i = 1, K do
  local a = 11 + i * 7
  local alg = A[a + 3] + 0
  -- Every field a tier will hold, so the table is allocated once.
  local tier = { loc = A[a + 1] + 0, alg = alg, limit = A[a + 4] + 0, w = A[a + 5] + 0, cost = A[a + 7] + 0,
    burst = 0, prefix = false, first = 0, ok = false, remaining = 0, reset = 0, retry = 0, ttl_ms = 0,
    idx = 0, used = 0, cur = 0, prev = 0, s1 = false, s3 = false, e = 0, ahead = 0, new_ahead = 0, had = false }
  if alg == 3 then tier.burst = A[a + 6] + 0 end
  if tier.loc == 0 then
    local prefix = A[a + 2]
    tier.prefix = prefix
    tier.first = nf
    local f = FIELDS[alg]
    for j = 1, #f do nf = nf + 1; fields[nf] = prefix .. f[j] end
  end
  tiers[i] = tier
end
local h = call('HMGET', KEYS[1], unpack(fields, 1, nf))

-- Algorithms: `eval` reads a tier's state (s1, s2, s3: its fields, false
-- when absent) and sets on the tier the decision (ok, remaining, reset,
-- retry) and what `commit` and `refund` need; nothing here writes.
--
-- Fixed window: w = window index, c = units in it.
-- Sliding window: the current window's c and the previous one's p, the
-- previous weighted by how much of it still overlaps.
-- GCRA (token bucket): the theoretical arrival time (TAT). One unit is
-- emitted every e = w/limit; up to `burst` units may be spent ahead of time
-- (tau = e*burst). The TAT is kept as whole microseconds `t` plus a
-- fraction `f`, and all comparisons are made on `ahead` = TAT − now, a
-- small number: absolute times (~1.8e15 µs) are only 0.25 µs apart as
-- doubles, which would make a full burst fail by a rounding error when e is
-- not a whole number.
-- Exact sliding log: one zset entry per unit, scored by its time in ms.
local function eval(tier, s1, s2, s3)
  local alg, limit, w, c = tier.alg, tier.limit, tier.w, tier.cost
  if alg == 1 then
    local idx = floor(now_ms / w)
    local used = 0
    if s1 and s1 + 0 == idx then used = (s2 and s2 + 0) or 0; tier.s1 = s1 end
    local reset = (idx + 1) * w - now_ms
    tier.idx = idx; tier.used = used
    tier.ok = used + c <= limit; tier.remaining = limit - used; tier.reset = reset; tier.retry = 0
    tier.ttl_ms = reset + 1000
    if not tier.ok then
      if c > limit then tier.retry = -1 else tier.retry = reset end
    end
  elseif alg == 2 then
    local idx = floor(now_ms / w)
    local sw = s1 and s1 + 0
    local cur, prev = 0, 0
    if sw == idx then
      cur = (s2 and s2 + 0) or 0; prev = (s3 and s3 + 0) or 0
      tier.s1 = s1; tier.s3 = s3
    elseif sw == idx - 1 then
      prev = (s2 and s2 + 0) or 0
      tier.s3 = s2
    end
    local elapsed = now_ms - idx * w
    local est = prev * ((w - elapsed) / w) + cur
    local remaining = floor(limit - est)
    if remaining < 0 then remaining = 0 end
    local reset = (idx + 1) * w - now_ms
    tier.idx = idx; tier.cur = cur; tier.prev = prev
    tier.ok = est + c <= limit; tier.remaining = remaining; tier.reset = reset; tier.retry = 0
    tier.ttl_ms = 2 * w + 1000
    if not tier.ok then
      if c > limit then
        tier.retry = -1
      elseif cur + c <= limit then
        -- blocked by the weighted previous window: wait until it fades enough
        tier.retry = math.ceil(w * (1 - (limit - c - cur) / prev) - elapsed)
      else
        -- blocked by the current window: wait into the next one until
        -- cur * (1 - t/w) + c <= limit
        tier.retry = reset + math.ceil(w * (1 - (limit - c) / cur))
      end
      if tier.retry ~= -1 and tier.retry < 1 then tier.retry = 1 end
    end
  elseif alg == 3 then
    local burst = tier.burst
    local e = (w * 1000) / limit
    local tau = e * burst
    local ahead = 0
    local tat = s1 and s1 + 0
    if tat and tat >= now_us then ahead = (tat - now_us) + ((s2 and s2 + 0) or 0) end
    local new_ahead = ahead + c * e
    local remaining = floor((tau - ahead) / e)
    if remaining < 0 then remaining = 0 end
    tier.e = e; tier.ahead = ahead; tier.new_ahead = new_ahead; tier.had = tat and true or false
    tier.ok = new_ahead <= tau; tier.remaining = remaining; tier.retry = 0
    tier.ttl_ms = math.ceil(new_ahead / 1000) + 1000
    if not tier.ok then
      if c > burst then tier.retry = -1 else tier.retry = math.max(1, math.ceil((new_ahead - tau) / 1000)) end
    end
    tier.reset = math.ceil((tier.ok and new_ahead or ahead) / 1000)
  else
    local key = KEYS[tier.loc]
    call('ZREMRANGEBYSCORE', key, '-inf', int(now_ms - w))
    local used = call('ZCARD', key)
    tier.used = used
    tier.ok = used + c <= limit; tier.remaining = limit - used; tier.reset = w; tier.retry = 0
    if not tier.ok then
      local newest = call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if newest[2] then tier.reset = newest[2] + w - now_ms end
      if c > limit then
        tier.retry = -1
      else
        -- the (used + c - limit)-th oldest entry must leave the window
        local nth = call('ZRANGE', key, used + c - limit - 1, used + c - limit - 1, 'WITHSCORES')
        tier.retry = math.max(1, nth[2] + w - now_ms)
      end
    end
  end
end

for _, tier in ipairs(tiers) do
  if tier.alg == 4 then
    eval(tier)
  elseif tier.loc == 0 then
    local f = tier.first
    eval(tier, h[f + 1], h[f + 2], h[f + 3])
  else
    local s = call('HMGET', KEYS[tier.loc], unpack(FIELDS[tier.alg]))
    eval(tier, s[1], s[2], s[3])
  end
end

-- The region's PN counter for (T, day), in the tenant hash. Its epoch lives
-- beside it, so a Redis that lost the tenant starts a new actor atomically
-- with the first charge.
local new_day = not h[1]
local epoch = h[1] or A[5]
local own_p = (h[2] and h[2] + 0) or 0
local own_n = (h[3] and h[3] + 0) or 0
local n_read = own_n
local dstate = (h[4] and h[4] + 0) or 0

-- This region's actors in the broadcast. The part of the current epoch is
-- what the aggregator already holds from us: Redis below it has rolled back
-- (an AOF everysec crash, an RDB restore, a failover to a lagging replica)
-- with the epoch kept. Raise P and N to it: otherwise the region would
-- re-admit what it already spent, and the aggregator, whose max-merge
-- ignores a counter below what it saw, would stay short for good.
local mine_p, mine_n = 0, 0
if day == node_day then
  for i = 19 + K * 7, #A, 3 do
    if A[i] == epoch then
      mine_p = A[i + 1] + 0; mine_n = A[i + 2] + 0
    end
  end
end
local raised = 0
if mine_p > own_p or mine_n > own_n then
  raised = math.max(0, mine_p - own_p)
  own_p = math.max(own_p, mine_p)
  own_n = math.max(own_n, mine_n)
end

local glimit = A[7] + 0
local gcost = A[8] + 0
local global_ok, global_remaining, global_retry = true, -1, 0
if glimit > 0 then
  local others = 0
  if day == node_day then
    others = math.max(0, A[9] - (mine_p - mine_n))
  end
  local own = own_p - own_n
  global_remaining = glimit - others - own
  local cap = A[10] + 0
  if cap >= 0 and cap - own < global_remaining then global_remaining = cap - own end
  if global_remaining < 0 then global_remaining = 0 end
  if op == 'check' then
    global_ok = gcost <= global_remaining
    if not global_ok then global_retry = 86400000 - now_ms % 86400000 end
  end
end

local refunded, duplicate, granted = 0, 0, 0
local function reply(allowed, denied, denied_tier, retry)
  local out = { VERSION, allowed, denied, denied_tier, retry, now_ms, own_p, own_n, day, raised, refunded,
    duplicate, granted, global_remaining, epoch, nil, nil, nil, nil }
  local n = 15
  for _, tier in ipairs(tiers) do
    out[n + 1] = tier.remaining; out[n + 2] = tier.reset; n = n + 2
  end
  return out
end

-- Writes: one HSET of the tenant hash; keys of their own are written apart.
-- Window indexes and counts go to Redis as Lua numbers (Redis formats them
-- exactly); microsecond times and the PN counter need %.0f.
local hset = { false, false, false, false, false, false, false, false, false, false, false, false, false, false,
  false, false }
local nh = 0
local function put(f, v) hset[nh + 1] = f; hset[nh + 2] = v; nh = nh + 2 end
local function write(tier, v1, v2, v3)
  if tier.loc == 0 then
    local f = FIELDS[tier.alg]
    local prefix = tier.prefix
    put(prefix .. f[1], v1); put(prefix .. f[2], v2)
    if v3 then put(prefix .. f[3], v3) end
  else
    local f = FIELDS[tier.alg]
    if v3 then
      call('HSET', KEYS[tier.loc], f[1], v1, f[2], v2, f[3], v3)
    else
      call('HSET', KEYS[tier.loc], f[1], v1, f[2], v2)
    end
    call('PEXPIRE', KEYS[tier.loc], int(tier.ttl_ms))
  end
end
local function tat(a)
  local whole = floor(a)
  return int(now_us + whole), string.format('%.17g', a - whole)
end

-- Charges c units to a tier.
local function commit(tier, c)
  local alg = tier.alg
  if alg == 1 then
    write(tier, tier.s1 or tier.idx, tier.used + c)
  elseif alg == 2 then
    write(tier, tier.s1 or tier.idx, tier.cur + c, tier.s3 or tier.prev)
  elseif alg == 3 then
    local t1, t2 = tat(tier.new_ahead); write(tier, t1, t2)
  else
    -- Members are unique per call (the epoch candidate is a fresh random
    -- id), added in chunks: Lua's unpack() takes at most ~8000 values.
    local key = KEYS[tier.loc]
    local args = {}
    local tag = int(now_us) .. ':' .. A[5] .. ':'
    local score = int(now_ms)
    for i = 1, c do
      args[#args + 1] = score
      args[#args + 1] = tag .. i
      if #args >= 1000 then
        call('ZADD', key, unpack(args))
        args = {}
      end
    end
    if #args > 0 then call('ZADD', key, unpack(args)) end
    call('PEXPIRE', key, int(tier.w + 1000))
  end
end

-- Gives c units back to a tier (never below zero).
local function refund(tier, c)
  local alg = tier.alg
  if alg == 1 then
    if tier.used > 0 then write(tier, tier.idx, math.max(0, tier.used - c)) end
  elseif alg == 2 then
    if tier.cur > 0 then write(tier, tier.idx, math.max(0, tier.cur - c), tier.prev) end
  elseif alg == 3 then
    if tier.had then
      local t1, t2 = tat(math.max(0, tier.ahead - c * tier.e)); write(tier, t1, t2)
    end
  else
    if tier.used > 0 then call('ZPOPMAX', KEYS[tier.loc], c) end
  end
end

-- The counter changed: write it, and mark (T, day) dirty in the bucket's
-- set only when its publish state changes (clean → dirty, or → urgent), so a
-- busy tenant costs no ZADD per request. The score is when the entry is
-- due: 0 (urgent) sorts first; otherwise a relaxed interval after its last
-- publication (`g:<day>:s`, stamped by ack.lua), or now if it was never
-- published or that is long past. The first counter of a new day of a
-- tenant that counted on an earlier day (midnight: every active tenant at
-- once) is due at a point of the relaxed interval fixed by the tenant's
-- hash, so the region's publishes after midnight spread over the interval
-- instead of all falling due at the first flush; urgency is unaffected.
local function counter_changed()
  put(fields[2], int(own_p))
  if own_n == n_read then put(fields[3], h[3] or '0') else put(fields[3], int(own_n)) end
  local rolled_over = false
  if new_day then
    put(fields[1], epoch)
    -- A new day: forget days past retention, and give the hash its TTL.
    local ttl = A[6] + 0
    local keep_from = day - floor(ttl / 86400)
    local kept = { int(day) }
    local listed = call('HGET', KEYS[1], 'gd')
    if listed then
      for d in string.gmatch(listed, '%d+') do
        local dn = d + 0
        if dn < day then rolled_over = true end
        if dn >= keep_from then
          if dn ~= day then kept[#kept + 1] = d end
        else
          call('HDEL', KEYS[1], 'g:' .. d .. ':e', 'g:' .. d .. ':p', 'g:' .. d .. ':n', 'g:' .. d .. ':d',
            'g:' .. d .. ':s')
        end
      end
    end
    put('gd', table.concat(kept, ','))
    call('EXPIRE', KEYS[1], ttl)
  end
  local urgent_at = A[11] + 0
  local want = 1
  if urgent_at >= 0 and own_p - own_n >= urgent_at then want = 2 end
  if dstate == 0 or (want == 2 and dstate ~= 2) then
    local score = 0
    if want == 1 then
      local relaxed = A[12] + 0
      local stamped = call('HGET', KEYS[1], gp .. 's')
      score = math.max(now_ms, ((stamped and stamped + 0) or 0) + relaxed)
      if rolled_over and relaxed > 0 then
        score = now_ms + tonumber(string.sub(redis.sha1hex(A[3]), 1, 8), 16) % relaxed
      end
    end
    call('ZADD', KEYS[2], score, A[3] .. '|' .. int(day))
    put(fields[4], want)
  end
end

local function flush()
  if nh > 0 then call('HSET', KEYS[1], unpack(hset, 1, nh)) end
end

if op == 'peek' then
  -- A peek charges nothing, but persists a rollback raise: the publisher
  -- raises a counter it found below its broadcast part this way.
  if raised > 0 then counter_changed(); flush() end
  return reply(1, 0, 0, 0)
end

if op == 'refund' then
  -- A refund by handle: once per handle, and only into what the charge was
  -- in (its windows, its day). The record of used handles is written only
  -- here, so checks stay cheap; it lives as long as the day's counter.
  local by_handle = A[13] + 0 > 0
  local charged_at = A[15] + 0
  if by_handle then
    local rf = KEYS[A[13] + 0]
    if call('SADD', rf, A[14]) == 0 then
      duplicate = 1
      return reply(1, 0, 0, 0)
    end
    call('EXPIRE', rf, A[6])
  end
  for _, tier in ipairs(tiers) do
    local same_window = true
    if by_handle then
      if tier.alg >= 3 then
        same_window = now_ms - charged_at < tier.w
      else
        same_window = floor(charged_at / tier.w) == floor(now_ms / tier.w)
      end
    end
    if same_window then refund(tier, tier.cost) end
  end
  -- N never exceeds P: the counter cannot go below zero.
  local back = math.min(gcost, own_p - own_n)
  if by_handle and floor(charged_at / 86400000) ~= day then back = 0 end
  refunded = math.max(0, back)
  if back > 0 or raised > 0 then
    own_n = own_n + math.max(0, back)
    counter_changed()
  end
  flush()
  return reply(1, 0, 0, 0)
end

-- op == 'check': deny if any tier denies; retry after the longest wait.
local denied, denied_tier, retry = 0, 0, 0
local function deny(what, i, r)
  if denied == 0 then denied = what; denied_tier = i end
  if r < 0 or retry < 0 then retry = -1 elseif r > retry then retry = r end
end
for i, tier in ipairs(tiers) do
  if not tier.ok then deny(1, i, tier.retry) end
end
if not global_ok then deny(2, 0, global_retry) end

-- Leases. An allowed check may charge `granted` more units, which the node
-- then spends in process (region-node/src/lease.rs) until the first of its
-- tiers' windows ends. They are charged here like any other unit, so the sum
-- of outstanding leases never exceeds what the limits leave; a lease takes
-- at most 1/lease_share of what is left, so near the limit leases shrink to
-- nothing and every decision comes here again. Only fixed and sliding
-- windows lease: a unit charged to them now belongs to the current window,
-- which is what the lease's lifetime follows (GCRA and the exact log keep
-- no window a lease could die with).
if denied == 0 then
  local lease_max = A[16] + 0
  if lease_max > 0 and K > 0 then
    local share = math.max(1, A[17] + 0)
    local room = lease_max * share
    for _, tier in ipairs(tiers) do
      if tier.alg > 2 then room = 0; break end
      room = math.min(room, tier.remaining - tier.cost)
    end
    if global_remaining >= 0 then room = math.min(room, global_remaining - gcost) end
    granted = math.min(lease_max, floor(math.max(0, room) / share))
  end
end

-- Remaining units are reported after this request only if it was charged.
if denied == 0 then
  for _, tier in ipairs(tiers) do
    local c = tier.cost + granted
    commit(tier, c)
    tier.remaining = math.max(0, tier.remaining - c)
  end
  if global_remaining >= 0 then global_remaining = math.max(0, global_remaining - gcost - granted) end
  own_p = own_p + gcost + granted
  counter_changed()
elseif raised > 0 then
  counter_changed()
end
flush()

return reply(denied == 0 and 1 or 0, denied, denied_tier, retry)
