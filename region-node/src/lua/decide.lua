-- tierlimit decision script: node tier, region tier and the region's global
-- budget, evaluated together and charged all-or-nothing in one round trip.
--
-- KEYS[1] node-tier state     tl:{T}:n:<node>:<key>:<algorithm code>
-- KEYS[2] region-tier state   tl:{T}:r:<key>:<algorithm code>
--         (the code is in the key because each algorithm keeps another
--         Redis type there; a reload that changes it starts afresh)
-- KEYS[3] dirty set           tl:dirty   (zset: member "T|day", score p+n)
-- KEYS[4..6] PN counters      tl:{T}:g:<d> for d = node_day-1, node_day,
--            node_day+1: the script picks the one of Redis' own day, so a
--            node whose clock is off around midnight still charges the
--            right day (and every key stays declared, as Cluster requires)
--
-- ARGV[1]  op: "check" | "refund" | "peek"
-- ARGV[2]  cost (>= 1; 0 for peek)
-- ARGV[3..6]   node tier:   algorithm code (0 = no tier), limit, window_ms, burst
-- ARGV[7..10]  region tier: algorithm code (0 = no tier), limit, window_ms, burst
-- ARGV[11] global limit per day (0 = no global tier)
-- ARGV[12] broadcast total for (T, day) as last seen (all actors)
-- ARGV[13] own cap: most this region's current actor may reach (-1 = none);
--          set by the node when its broadcast view is stale
-- ARGV[14] epoch candidate, used only if today's PN counter does not exist
-- ARGV[15] tenant id (for the dirty-set member)
-- ARGV[16] the day the node computed (KEYS[5] is for this day); if Redis'
--          clock says otherwise the broadcast is not for this day (others=0)
-- ARGV[17] TTL of the PN counter in seconds
-- ARGV[18] deadline in Redis' clock, ms (0 = none): a call that reaches Redis
--          after it does nothing and answers denied = 'expired'. The node gave
--          up on it at its store_timeout and answered from its fail mode, so
--          charging it now would count the request twice.
-- ARGV[19..] pairs: epoch, part — this region's actors in the broadcast
--
-- Returns a flat list of name, value pairs (parsed by name in
-- region-node/src/storage/script.rs, so a field can be added without
-- breaking a reader):
--   allowed           1 or 0
--   denied            '' | 'node' | 'region' | 'global' | 'expired'
--                     ('expired': the call reached Redis after its deadline
--                     and did nothing)
--   retry_ms          ms until the request could pass; -1 = never
--   now_ms            Redis TIME
--   node_remaining, node_reset_ms       (absent: no node tier)
--   region_remaining, region_reset_ms   (absent: no region tier)
--   own_p, own_n, epoch, day            this region's PN counter for the day
--   global_remaining                    (absent: no global tier)
--
-- Numbers are Lua doubles: exact integers up to 2^53, which microsecond
-- timestamps (~1.8e15) and counts stay far below. Integers are written back
-- with %.0f so no precision is lost to tostring's 14 digits.

local op = ARGV[1]
local cost = tonumber(ARGV[2])

local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)

local function int(x) return string.format('%.0f', x) end

local deadline = tonumber(ARGV[18]) or 0
if deadline > 0 and now_ms > deadline then
  return { 'allowed', 0, 'denied', 'expired', 'now_ms', now_ms }
end

-- The reply: name, value pairs (see the header).
local function reply(allowed, denied, retry, node, region, own_p, own_n, epoch, day, global_remaining)
  local out = { 'allowed', allowed, 'denied', denied, 'retry_ms', retry, 'now_ms', now_ms,
    'own_p', own_p, 'own_n', own_n, 'epoch', epoch, 'day', day }
  if node then
    out[#out + 1] = 'node_remaining'; out[#out + 1] = node.remaining
    out[#out + 1] = 'node_reset_ms'; out[#out + 1] = node.reset
  end
  if region then
    out[#out + 1] = 'region_remaining'; out[#out + 1] = region.remaining
    out[#out + 1] = 'region_reset_ms'; out[#out + 1] = region.reset
  end
  if global_remaining >= 0 then
    out[#out + 1] = 'global_remaining'; out[#out + 1] = global_remaining
  end
  return out
end

-- Each algorithm: eval(key, limit, window_ms, burst, cost) returns
--   ok, remaining (before this request), reset_ms, retry_ms, commit_fn, refund_fn
-- eval never writes; commit() charges cost, refund() gives cost back.

local function fixed_window(key, limit, w, _burst, c)
  local idx = math.floor(now_ms / w)
  local s = redis.call('HMGET', key, 'w', 'c')
  local used = 0
  if tonumber(s[1]) == idx then used = tonumber(s[2]) or 0 end
  local reset = (idx + 1) * w - now_ms
  local ok = used + c <= limit
  local remaining = limit - used
  local retry = 0
  if not ok then
    if c > limit then retry = -1 else retry = reset end
  end
  local function commit()
    redis.call('HSET', key, 'w', int(idx), 'c', int(used + c))
    redis.call('PEXPIRE', key, int(reset + 1000))
  end
  local function refund()
    if used > 0 then
      redis.call('HSET', key, 'w', int(idx), 'c', int(math.max(0, used - c)))
    end
  end
  return ok, remaining, reset, retry, commit, refund
end

local function sliding_window(key, limit, w, _burst, c)
  local idx = math.floor(now_ms / w)
  local s = redis.call('HMGET', key, 'w', 'c', 'p')
  local sw = tonumber(s[1])
  local cur, prev = 0, 0
  if sw == idx then
    cur = tonumber(s[2]) or 0; prev = tonumber(s[3]) or 0
  elseif sw == idx - 1 then
    prev = tonumber(s[2]) or 0
  end
  local elapsed = now_ms - idx * w
  local weight = (w - elapsed) / w
  local est = prev * weight + cur
  local ok = est + c <= limit
  local remaining = math.floor(limit - est)
  if remaining < 0 then remaining = 0 end
  local reset = (idx + 1) * w - now_ms
  local retry = 0
  if not ok then
    if c > limit then
      retry = -1
    elseif cur + c <= limit then
      -- blocked by the weighted previous window: wait until it fades enough
      local need = w * (1 - (limit - c - cur) / prev)
      retry = math.ceil(need - elapsed)
    else
      -- blocked by the current window: wait into the next one until
      -- cur * (1 - t/w) + c <= limit
      local need = w * (1 - (limit - c) / cur)
      retry = reset + math.ceil(need)
    end
    if retry ~= -1 and retry < 1 then retry = 1 end
  end
  local function commit()
    redis.call('HSET', key, 'w', int(idx), 'c', int(cur + c), 'p', int(prev))
    redis.call('PEXPIRE', key, int(2 * w + 1000))
  end
  local function refund()
    if cur > 0 then
      redis.call('HSET', key, 'w', int(idx), 'c', int(math.max(0, cur - c)), 'p', int(prev))
    end
  end
  return ok, remaining, reset, retry, commit, refund
end

-- GCRA: the theoretical arrival time (TAT). One unit is emitted every
-- e = w/limit; up to `burst` units may be spent ahead of time (tau = e*burst).
-- The TAT is kept as whole microseconds `t` plus a fraction `f`, and all
-- comparisons are made on `ahead` = TAT − now, a small number: absolute
-- times (~1.8e15 µs) are only 0.25 µs apart as doubles, which would make a
-- full burst fail by a rounding error when e is not a whole number.
local function token_bucket(key, limit, w, burst, c)
  local e = (w * 1000) / limit
  local tau = e * burst
  local s = redis.call('HMGET', key, 't', 'f')
  local ahead = 0
  local t = tonumber(s[1])
  if t and t >= now_us then ahead = (t - now_us) + (tonumber(s[2]) or 0) end
  local new_ahead = ahead + c * e
  local ok = new_ahead <= tau
  local remaining = math.floor((tau - ahead) / e)
  if remaining < 0 then remaining = 0 end
  local retry = 0
  if not ok then
    if c > burst then retry = -1 else retry = math.max(1, math.ceil((new_ahead - tau) / 1000)) end
  end
  local reset = math.ceil((ok and new_ahead or ahead) / 1000)
  local function store(a)
    local whole = math.floor(a)
    redis.call('HSET', key, 't', int(now_us + whole), 'f', string.format('%.17g', a - whole))
    redis.call('PEXPIRE', key, int(math.ceil(a / 1000) + 1000))
  end
  local function commit() store(new_ahead) end
  local function refund()
    local back = ahead - c * e
    if back < 0 then back = 0 end
    store(back)
  end
  return ok, remaining, reset, retry, commit, refund
end

-- Exact sliding log: one zset entry per unit, scored by its time in ms.
local function sliding_log(key, limit, w, _burst, c)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now_ms - w))
  local used = redis.call('ZCARD', key)
  local ok = used + c <= limit
  local remaining = limit - used
  local reset = w
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if newest[2] then reset = tonumber(newest[2]) + w - now_ms end
  if ok then reset = w end
  local retry = 0
  if not ok then
    if c > limit then
      retry = -1
    else
      -- the (used + c - limit)-th oldest entry must leave the window
      local nth = redis.call('ZRANGE', key, used + c - limit - 1, used + c - limit - 1, 'WITHSCORES')
      retry = tonumber(nth[2]) + w - now_ms
      if retry < 1 then retry = 1 end
    end
  end
  local function commit()
    -- Members are unique per call (ARGV[14] is a fresh random id), and
    -- added in chunks: Lua's unpack() takes at most ~8000 values.
    local args = {}
    local tag = int(now_us) .. ':' .. ARGV[14] .. ':'
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
  local function refund()
    if used > 0 then redis.call('ZPOPMAX', key, c) end
  end
  return ok, remaining, reset, retry, commit, refund
end

local algorithms = { fixed_window, sliding_window, token_bucket, sliding_log }

local function tier(first_argv, key, c)
  local code = tonumber(ARGV[first_argv])
  if code == 0 then return nil end
  local limit = tonumber(ARGV[first_argv + 1])
  local w = tonumber(ARGV[first_argv + 2])
  local burst = tonumber(ARGV[first_argv + 3])
  local ok, remaining, reset, retry, commit, refund = algorithms[code](key, limit, w, burst, c)
  return { ok = ok, remaining = remaining, reset = reset, retry = retry, commit = commit, refund = refund }
end

local node = tier(3, KEYS[1], cost)
local region = tier(7, KEYS[2], cost)

-- The region's PN counter for (T, day). Its epoch lives inside the hash, so a
-- Redis that lost its data starts a new actor atomically with the first
-- charge, and no key outside the tenant's hash slot is needed for it.
local day = math.floor(now_ms / 86400000)
local node_day = tonumber(ARGV[16])
if math.abs(day - node_day) > 1 then
  return redis.error_reply('ERR tierlimit: node clock is more than a day off Redis TIME')
end
local gkey = KEYS[5 + day - node_day]
local g = redis.call('HMGET', gkey, 'e', 'p', 'n')
local epoch = g[1] or ARGV[14]
local own_p = tonumber(g[2]) or 0
local own_n = tonumber(g[3]) or 0
local own = own_p - own_n

local glimit = tonumber(ARGV[11])
local global_ok, global_remaining, global_retry = true, -1, 0
if glimit > 0 then
  local others = 0
  if day == node_day then
    local mine = 0
    for i = 19, #ARGV, 2 do
      if ARGV[i] == epoch then mine = tonumber(ARGV[i + 1]) end
    end
    others = tonumber(ARGV[12]) - mine
    if others < 0 then others = 0 end
  end
  global_remaining = glimit - others - own
  local cap = tonumber(ARGV[13])
  if cap >= 0 and cap - own < global_remaining then global_remaining = cap - own end
  if global_remaining < 0 then global_remaining = 0 end
  if op == 'check' then
    global_ok = cost <= global_remaining
    if not global_ok then global_retry = (86400000 - now_ms % 86400000) end
  end
end

if op == 'peek' then
  return reply(1, '', 0, node, region, own_p, own_n, epoch, day, global_remaining)
end

if op == 'refund' then
  if node then node.refund() end
  if region then region.refund() end
  -- N never exceeds P: the counter cannot go below zero.
  if own_p > 0 then
    local back = math.min(cost, own_p - own_n)
    if back > 0 then
      own_n = own_n + back
      redis.call('HSET', gkey, 'n', int(own_n))
      redis.call('ZADD', KEYS[3], int(own_p + own_n), ARGV[15] .. '|' .. int(day))
    end
  end
  return reply(1, '', 0, node, region, own_p, own_n, epoch, day, global_remaining)
end

-- op == 'check': deny if any tier denies; retry after the longest wait.
local denied, retry = '', 0
local function deny(tier, r)
  if denied == '' then denied = tier end
  if r < 0 or retry < 0 then retry = -1 elseif r > retry then retry = r end
end
if node and not node.ok then deny('node', node.retry) end
if region and not region.ok then deny('region', region.retry) end
if not global_ok then deny('global', global_retry) end

-- Remaining units are reported after this request only if it was charged.
if denied == '' then
  if node then node.commit(); node.remaining = math.max(0, node.remaining - cost) end
  if region then region.commit(); region.remaining = math.max(0, region.remaining - cost) end
  if global_remaining >= 0 then global_remaining = math.max(0, global_remaining - cost) end
  own_p = own_p + cost
  redis.call('HSET', gkey, 'e', epoch, 'p', int(own_p), 'n', int(own_n))
  redis.call('EXPIRE', gkey, ARGV[17])
  redis.call('ZADD', KEYS[3], int(own_p + own_n), ARGV[15] .. '|' .. int(day))
end

return reply(denied == '' and 1 or 0, denied, retry, node, region, own_p, own_n, epoch, day,
  global_remaining)
