-- tierlimit decision script: every windowed tier of one tenant's request
-- (node and region tiers, of the plan and of each descriptor) and the
-- region's global budget, evaluated together and charged all-or-nothing in
-- one round trip. Key scheme: shared/src/keys.rs. Arguments are laid out by
-- region-node/src/storage/script.rs, the only reader of these positions.
--
-- KEYS[1]   the tenant hash   tl:{B}:t:T   (whole-tenant tier states, the
--           PN counter of each day, its publish state)
-- KEYS[2]   the bucket's dirty set   tl:{B}:dirty
-- KEYS[3..] tiers kept outside the tenant hash (key-scoped, windows over a
--           day, the sliding log), in the order their tiers name them
--
-- ARGV[1]   op: "check" | "refund" | "peek"
-- ARGV[2]   deadline in Redis' clock, ms (0 = none): a call that reaches
--           Redis after it does nothing and answers denied = 'expired' (the
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
--           hash, algorithm code, limit, window_ms, burst, cost
-- then      triplets epoch, P, N: this region's actors in the broadcast
--
-- Returns name, value pairs (parsed by name in script.rs):
--   allowed 1|0; denied '' | 'tier' | 'global' | 'expired'; denied_tier
--   (1-based, when 'tier'); retry_ms (-1 = never); now_ms (Redis TIME);
--   tiers {remaining, reset_ms, ...} in call order; own_p, own_n, epoch, day
--   (this region's PN counter); global_remaining (absent: no global tier);
--   raised (units the rollback check added to P, see below); refunded
--   (global units given back by a refund), duplicate (1: the handle was
--   used already, nothing given back); granted (units of lease charged
--   beyond the request's cost, every tier and the PN counter alike).
--
-- Numbers are Lua doubles: exact integers up to 2^53. Integers are written
-- back with %.0f so no precision is lost to tostring's 14 digits.

local op = ARGV[1]
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)

local function int(x) return string.format('%.0f', x) end

local deadline = tonumber(ARGV[2])
if deadline > 0 and now_ms > deadline then
  return { 'allowed', 0, 'denied', 'expired', 'now_ms', now_ms }
end

local day = math.floor(now_ms / 86400000)
local node_day = tonumber(ARGV[4])
if math.abs(day - node_day) > 1 then
  return redis.error_reply('ERR tierlimit: node clock is more than a day off Redis TIME')
end

-- Algorithms. Each `eval` reads its state from `s` (the values of its
-- `fields`, false when absent) and returns the decision with the numbers
-- its `commit` and `refund` turn into the values to write back (`refund`
-- answers nil when there is nothing to give back); `ttl_ms` is the life its
-- state needs when kept in a key of its own. Nothing here writes, and
-- nothing is formatted before it is written: most calls write one of the
-- two, and a denied call neither. Small integers (window indexes, counts)
-- go to Redis as Lua numbers; microsecond times need int() (tostring keeps
-- only 14 digits).

local fixed_window = { fields = { 'w', 'c' } }
function fixed_window.eval(s, limit, w, _burst, c)
  local idx = math.floor(now_ms / w)
  local used = 0
  if tonumber(s[1]) == idx then used = tonumber(s[2]) or 0 end
  local reset = (idx + 1) * w - now_ms
  local r = { ok = used + c <= limit, remaining = limit - used, reset = reset, retry = 0,
    ttl_ms = reset + 1000, idx = idx, used = used }
  if not r.ok then
    if c > limit then r.retry = -1 else r.retry = reset end
  end
  return r
end
function fixed_window.commit(r, c) return { r.idx, r.used + c } end
function fixed_window.refund(r, c)
  if r.used > 0 then return { r.idx, math.max(0, r.used - c) } end
end

local sliding_window = { fields = { 'w', 'c', 'p' } }
function sliding_window.eval(s, limit, w, _burst, c)
  local idx = math.floor(now_ms / w)
  local sw = tonumber(s[1])
  local cur, prev = 0, 0
  if sw == idx then
    cur = tonumber(s[2]) or 0; prev = tonumber(s[3]) or 0
  elseif sw == idx - 1 then
    prev = tonumber(s[2]) or 0
  end
  local elapsed = now_ms - idx * w
  local est = prev * ((w - elapsed) / w) + cur
  local remaining = math.floor(limit - est)
  if remaining < 0 then remaining = 0 end
  local reset = (idx + 1) * w - now_ms
  local r = { ok = est + c <= limit, remaining = remaining, reset = reset, retry = 0,
    ttl_ms = 2 * w + 1000, idx = idx, cur = cur, prev = prev }
  if not r.ok then
    if c > limit then
      r.retry = -1
    elseif cur + c <= limit then
      -- blocked by the weighted previous window: wait until it fades enough
      r.retry = math.ceil(w * (1 - (limit - c - cur) / prev) - elapsed)
    else
      -- blocked by the current window: wait into the next one until
      -- cur * (1 - t/w) + c <= limit
      r.retry = reset + math.ceil(w * (1 - (limit - c) / cur))
    end
    if r.retry ~= -1 and r.retry < 1 then r.retry = 1 end
  end
  return r
end
function sliding_window.commit(r, c) return { r.idx, r.cur + c, r.prev } end
function sliding_window.refund(r, c)
  if r.cur > 0 then return { r.idx, math.max(0, r.cur - c), r.prev } end
end

-- GCRA: the theoretical arrival time (TAT). One unit is emitted every
-- e = w/limit; up to `burst` units may be spent ahead of time (tau = e*burst).
-- The TAT is kept as whole microseconds `t` plus a fraction `f`, and all
-- comparisons are made on `ahead` = TAT − now, a small number: absolute
-- times (~1.8e15 µs) are only 0.25 µs apart as doubles, which would make a
-- full burst fail by a rounding error when e is not a whole number.
local token_bucket = { fields = { 't', 'f' } }
function token_bucket.eval(s, limit, w, burst, c)
  local e = (w * 1000) / limit
  local tau = e * burst
  local ahead = 0
  local tat = tonumber(s[1])
  if tat and tat >= now_us then ahead = (tat - now_us) + (tonumber(s[2]) or 0) end
  local new_ahead = ahead + c * e
  local remaining = math.floor((tau - ahead) / e)
  if remaining < 0 then remaining = 0 end
  local r = { ok = new_ahead <= tau, remaining = remaining, retry = 0, e = e, ahead = ahead,
    new_ahead = new_ahead, had = tat ~= nil, ttl_ms = math.ceil(new_ahead / 1000) + 1000 }
  if not r.ok then
    if c > burst then r.retry = -1 else r.retry = math.max(1, math.ceil((new_ahead - tau) / 1000)) end
  end
  r.reset = math.ceil((r.ok and new_ahead or ahead) / 1000)
  return r
end
local function tat_state(a)
  local whole = math.floor(a)
  return { int(now_us + whole), string.format('%.17g', a - whole) }
end
function token_bucket.commit(r, _c) return tat_state(r.new_ahead) end
function token_bucket.refund(r, c)
  if r.had then return tat_state(math.max(0, r.ahead - c * r.e)) end
end

-- Exact sliding log: one zset entry per unit, scored by its time in ms.
-- Always in a key of its own; reads and writes it directly.
local sliding_log = { zset = true }
function sliding_log.eval_key(key, limit, w, _burst, c)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now_ms - w))
  local used = redis.call('ZCARD', key)
  local r = { ok = used + c <= limit, remaining = limit - used, reset = w, retry = 0 }
  if not r.ok then
    local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    if newest[2] then r.reset = tonumber(newest[2]) + w - now_ms end
    if c > limit then
      r.retry = -1
    else
      -- the (used + c - limit)-th oldest entry must leave the window
      local nth = redis.call('ZRANGE', key, used + c - limit - 1, used + c - limit - 1, 'WITHSCORES')
      r.retry = math.max(1, tonumber(nth[2]) + w - now_ms)
    end
  end
  function r.do_commit()
    -- Members are unique per call (the epoch candidate is a fresh random
    -- id), added in chunks: Lua's unpack() takes at most ~8000 values.
    local args = {}
    local tag = int(now_us) .. ':' .. ARGV[5] .. ':'
    for i = 1, c do
      args[#args + 1] = int(now_ms)
      args[#args + 1] = tag .. i
      if #args >= 1000 then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
    if #args > 0 then redis.call('ZADD', key, unpack(args)) end
    redis.call('PEXPIRE', key, int(w + 1000))
  end
  function r.do_refund()
    if used > 0 then redis.call('ZPOPMAX', key, c) end
  end
  return r
end

local algorithms = { fixed_window, sliding_window, token_bucket, sliding_log }

-- Read: one HMGET of the tenant hash for the day's counter and every tier
-- kept there; one HMGET per tier kept in a key of its own.
local gp = 'g:' .. day .. ':'
local fields = { gp .. 'e', gp .. 'p', gp .. 'n', gp .. 'd', gp .. 's' }
local K = tonumber(ARGV[18])
local tiers = {}
for i = 1, K do
  local a = 18 + (i - 1) * 7
  local tier = { loc = tonumber(ARGV[a + 1]), prefix = ARGV[a + 2], alg = algorithms[tonumber(ARGV[a + 3])],
    limit = tonumber(ARGV[a + 4]), w = tonumber(ARGV[a + 5]), burst = tonumber(ARGV[a + 6]),
    cost = tonumber(ARGV[a + 7]) }
  if tier.loc == 0 then
    tier.first = #fields
    for _, f in ipairs(tier.alg.fields) do fields[#fields + 1] = tier.prefix .. f end
  end
  tiers[i] = tier
end
local h = redis.call('HMGET', KEYS[1], unpack(fields))

for _, tier in ipairs(tiers) do
  local alg = tier.alg
  if alg.zset then
    tier.r = alg.eval_key(KEYS[tier.loc], tier.limit, tier.w, tier.burst, tier.cost)
  else
    local s
    if tier.loc == 0 then
      s = {}
      for j = 1, #alg.fields do s[j] = h[tier.first + j] end
    else
      s = redis.call('HMGET', KEYS[tier.loc], unpack(alg.fields))
    end
    tier.r = alg.eval(s, tier.limit, tier.w, tier.burst, tier.cost)
  end
end

-- The region's PN counter for (T, day), in the tenant hash. Its epoch lives
-- beside it, so a Redis that lost the tenant starts a new actor atomically
-- with the first charge.
local new_day = not h[1]
local epoch = h[1] or ARGV[5]
local own_p = tonumber(h[2]) or 0
local own_n = tonumber(h[3]) or 0
local dstate = tonumber(h[4]) or 0

-- This region's actors in the broadcast. The part of the current epoch is
-- what the aggregator already holds from us: Redis below it has rolled back
-- (an AOF everysec crash, an RDB restore, a failover to a lagging replica)
-- with the epoch kept. Raise P and N to it: otherwise the region would
-- re-admit what it already spent, and the aggregator, whose max-merge
-- ignores a counter below what it saw, would stay short for good.
local mine_p, mine_n = 0, 0
local parts_from = 19 + K * 7
if day == node_day then
  for i = parts_from, #ARGV, 3 do
    if ARGV[i] == epoch then
      mine_p = tonumber(ARGV[i + 1]); mine_n = tonumber(ARGV[i + 2])
    end
  end
end
local raised = 0
if mine_p > own_p or mine_n > own_n then
  raised = math.max(0, mine_p - own_p)
  own_p = math.max(own_p, mine_p)
  own_n = math.max(own_n, mine_n)
end

local glimit = tonumber(ARGV[7])
local gcost = tonumber(ARGV[8])
local global_ok, global_remaining, global_retry = true, -1, 0
if glimit > 0 then
  local others = 0
  if day == node_day then
    others = math.max(0, tonumber(ARGV[9]) - (mine_p - mine_n))
  end
  local own = own_p - own_n
  global_remaining = glimit - others - own
  local cap = tonumber(ARGV[10])
  if cap >= 0 and cap - own < global_remaining then global_remaining = cap - own end
  if global_remaining < 0 then global_remaining = 0 end
  if op == 'check' then
    global_ok = gcost <= global_remaining
    if not global_ok then global_retry = 86400000 - now_ms % 86400000 end
  end
end

local refunded, duplicate, granted = 0, 0, 0
local function reply(allowed, denied, denied_tier, retry)
  local out = { 'allowed', allowed, 'denied', denied, 'denied_tier', denied_tier, 'retry_ms', retry,
    'now_ms', now_ms, 'own_p', own_p, 'own_n', own_n, 'epoch', epoch, 'day', day, 'raised', raised,
    'refunded', refunded, 'duplicate', duplicate, 'granted', granted }
  local tr = {}
  for i, tier in ipairs(tiers) do
    tr[2 * i - 1] = tier.r.remaining; tr[2 * i] = tier.r.reset
  end
  out[#out + 1] = 'tiers'; out[#out + 1] = tr
  if global_remaining >= 0 then
    out[#out + 1] = 'global_remaining'; out[#out + 1] = global_remaining
  end
  return out
end

-- Writes: one HSET of the tenant hash; keys of their own are written apart.
local hset = {}
local function put(f, v) hset[#hset + 1] = f; hset[#hset + 1] = v end
local function write(tier, values)
  if not values then return end
  local f = tier.alg.fields
  if tier.loc == 0 then
    for j = 1, #f do put(tier.prefix .. f[j], values[j]) end
  else
    local args = {}
    for j = 1, #f do args[#args + 1] = f[j]; args[#args + 1] = values[j] end
    redis.call('HSET', KEYS[tier.loc], unpack(args))
    redis.call('PEXPIRE', KEYS[tier.loc], int(tier.r.ttl_ms or 1000))
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
local rolled_over = false
local function counter_changed()
  put(gp .. 'p', int(own_p)); put(gp .. 'n', int(own_n))
  if new_day then
    put(gp .. 'e', epoch)
    -- A new day: forget days past retention, and give the hash its TTL.
    local ttl = tonumber(ARGV[6])
    local keep_from = day - math.floor(ttl / 86400)
    local kept = { int(day) }
    local listed = redis.call('HGET', KEYS[1], 'gd')
    if listed then
      for d in string.gmatch(listed, '%d+') do
        if tonumber(d) < day then rolled_over = true end
        if tonumber(d) >= keep_from then
          if tonumber(d) ~= day then kept[#kept + 1] = d end
        else
          redis.call('HDEL', KEYS[1], 'g:' .. d .. ':e', 'g:' .. d .. ':p', 'g:' .. d .. ':n', 'g:' .. d .. ':d',
            'g:' .. d .. ':s')
        end
      end
    end
    put('gd', table.concat(kept, ','))
    redis.call('EXPIRE', KEYS[1], ttl)
  end
  local urgent_at = tonumber(ARGV[11])
  local want = 1
  if urgent_at >= 0 and own_p - own_n >= urgent_at then want = 2 end
  if dstate == 0 or (want == 2 and dstate ~= 2) then
    local score = 0
    if want == 1 then
      local relaxed = tonumber(ARGV[12])
      score = math.max(now_ms, (tonumber(h[5]) or 0) + relaxed)
      if rolled_over and relaxed > 0 then
        score = now_ms + tonumber(string.sub(redis.sha1hex(ARGV[3]), 1, 8), 16) % relaxed
      end
    end
    redis.call('ZADD', KEYS[2], score, ARGV[3] .. '|' .. int(day))
    put(gp .. 'd', want)
  end
end

local function flush()
  if #hset > 0 then redis.call('HSET', KEYS[1], unpack(hset)) end
end

if op == 'peek' then
  -- A peek charges nothing, but persists a rollback raise: the publisher
  -- raises a counter it found below its broadcast part this way.
  if raised > 0 then counter_changed(); flush() end
  return reply(1, '', 0, 0)
end

if op == 'refund' then
  -- A refund by handle: once per handle, and only into what the charge was
  -- in (its windows, its day). The record of used handles is written only
  -- here, so checks stay cheap; it lives as long as the day's counter.
  local by_handle = tonumber(ARGV[13]) > 0
  local charged_at = tonumber(ARGV[15])
  if by_handle then
    local rf = KEYS[tonumber(ARGV[13])]
    if redis.call('SADD', rf, ARGV[14]) == 0 then
      duplicate = 1
      return reply(1, '', 0, 0)
    end
    redis.call('EXPIRE', rf, ARGV[6])
  end
  local function same_window(tier)
    if not by_handle then return true end
    if tier.alg == token_bucket or tier.alg == sliding_log then
      return now_ms - charged_at < tier.w
    end
    return math.floor(charged_at / tier.w) == math.floor(now_ms / tier.w)
  end
  for _, tier in ipairs(tiers) do
    if same_window(tier) then
      if tier.alg.zset then tier.r.do_refund() else write(tier, tier.alg.refund(tier.r, tier.cost)) end
    end
  end
  -- N never exceeds P: the counter cannot go below zero.
  local back = math.min(gcost, own_p - own_n)
  if by_handle and math.floor(charged_at / 86400000) ~= day then back = 0 end
  refunded = math.max(0, back)
  if back > 0 or raised > 0 then
    own_n = own_n + math.max(0, back)
    counter_changed()
  end
  flush()
  return reply(1, '', 0, 0)
end

-- op == 'check': deny if any tier denies; retry after the longest wait.
local denied, denied_tier, retry = '', 0, 0
local function deny(what, i, r)
  if denied == '' then denied = what; denied_tier = i end
  if r < 0 or retry < 0 then retry = -1 elseif r > retry then retry = r end
end
for i, tier in ipairs(tiers) do
  if not tier.r.ok then deny('tier', i, tier.r.retry) end
end
if not global_ok then deny('global', 0, global_retry) end

-- Leases. An allowed check may charge `granted` more units, which the node
-- then spends in process (region-node/src/lease.rs) until the first of its
-- tiers' windows ends. They are charged here like any other unit, so the sum
-- of outstanding leases never exceeds what the limits leave; a lease takes
-- at most 1/lease_share of what is left, so near the limit leases shrink to
-- nothing and every decision comes here again. Only fixed and sliding
-- windows lease: a unit charged to them now belongs to the current window,
-- which is what the lease's lifetime follows (GCRA and the exact log keep
-- no window a lease could die with).
if denied == '' then
  local lease_max = tonumber(ARGV[16])
  if lease_max > 0 and K > 0 then
    local share = math.max(1, tonumber(ARGV[17]))
    local room = lease_max * share
    for _, tier in ipairs(tiers) do
      if tier.alg ~= fixed_window and tier.alg ~= sliding_window then room = 0; break end
      room = math.min(room, tier.r.remaining - tier.cost)
    end
    if global_remaining >= 0 then room = math.min(room, global_remaining - gcost) end
    granted = math.min(lease_max, math.floor(math.max(0, room) / share))
  end
end

-- Remaining units are reported after this request only if it was charged.
if denied == '' then
  for _, tier in ipairs(tiers) do
    local c = tier.cost + granted
    if tier.alg.zset then tier.r.do_commit() else write(tier, tier.alg.commit(tier.r, c)) end
    tier.r.remaining = math.max(0, tier.r.remaining - c)
  end
  if global_remaining >= 0 then global_remaining = math.max(0, global_remaining - gcost - granted) end
  own_p = own_p + gcost + granted
  counter_changed()
elseif raised > 0 then
  counter_changed()
end
flush()

return reply(denied == '' and 1 or 0, denied, denied_tier, retry)
