-- tierlimit decision script: every windowed tier of one tenant's request
-- (node and region tiers, of the plan and of each descriptor) and the
-- region's global budget, evaluated together and charged all-or-nothing in
-- one round trip. Key scheme: shared/src/keys.rs. Arguments are laid out by
-- region-node/src/storage/script.rs, the only reader of these positions and
-- of the reply.
--
-- It runs on every decision that reaches Redis, so it is written for Redis'
-- CPU (BENCHMARKS.md, "Where the decision script's instructions go"): three
-- commands on the common path (TIME, one HMGET, one HSET); no closures
-- (each call would allocate them and capture their upvalues) and no C
-- calls where an operator does (x - x % w is floor's work); one array per
-- tier, allocated once; every number of the call in one packed argument
-- (Redis makes a Lua string of each argument, and a number in text costs a
-- strtod); values that did not change are
-- not written back, and numbers are written formatted with %d (Redis
-- formats a Lua number with %.17g, which costs more than the rest of the
-- field); a reply of integers in fixed positions, holding only what the
-- node cannot compute itself (Redis converts a reply element by element,
-- so names beside the values doubled its cost, and each item costs it
-- about 360 instructions).
--
-- KEYS[1]   the tenant hash   tl:{B}:t:T   (whole-tenant tier states, the
--           PN counter of each day, its publish state)
-- KEYS[2]   the bucket's dirty set   tl:{B}:dirty
-- KEYS[3..] tiers kept outside the tenant hash (key-scoped, windows over a
--           day, the sliding log), in the order their tiers name them;
--           then, for a refund by handle, the set of used handles
--
-- ARGV[1]   op: "check" | "refund" | "peek"
-- ARGV[2]   tenant id (the dirty-set member is "T|day")
-- ARGV[3]   the field prefix of the day the node computed, "g:<day>:"
--           (built by the node: a concatenation here costs a Lua string)
-- ARGV[4]   epoch candidate, used if today's counter does not exist yet;
--           also makes sliding-log members unique
-- ARGV[5]   every number of the call, packed as little-endian doubles
--           (`struct`, format '<d' each; exact integers up to 2^53). One
--           argument instead of twenty: Redis makes a Lua string of each
--           argument and the script a `strtod` of each number (about 1.5 k
--           instructions a number in all; struct.unpack costs a tenth of
--           it). In order:
--             deadline in Redis' clock, ms (0 = none): a call that reaches
--               Redis after it does nothing and answers outcome -2
--               (expired: the node gave up at its store_timeout and
--               answered from its fail mode, so charging now would count
--               the request twice)
--             the node's day (its estimate of Redis' clock): the day of the
--               broadcast it sends. Redis' clock decides the day: a check
--               made for another day does nothing and answers outcome -3
--               (the node sends it again with Redis' day); a refund or a
--               peek goes on, without the rollback raise (the parts are of
--               another day) and with others = the whole broadcast total,
--               never 0
--             TTL of the tenant hash, s (retention + 1 day): days older
--               than TTL/86400 are dropped from the hash when a new day
--               starts
--             global limit per day (0 = no global tier)
--             global cost: units the request charges to the PN counter
--             broadcast total for (T, day), all actors
--             own cap: most this region's actor may reach (-1 = none); set
--               by the node when its broadcast view is stale
--             urgent_at: this region's P − N at which (T, day) must be
--               published at the next flush (-1 = never)
--             relaxed_ms: how long after its last publication a (T, day)
--               that is not urgent is due again (relaxed_flush_interval)
--             the op's own three: a check's lease want, lease_share and
--               life_ms (see "Leases" below; want 0 = no lease); a refund's
--               index in KEYS of the set of used refund handles (0 = a
--               free-form refund), the charge's Redis time in ms (a refund
--               by handle gives back only to a window the charge was in,
--               and to the global count only on the charge's day) and 0; a
--               peek's 0, 0 and 0
--             K, the number of windowed tiers
--             E, the number of global tiers of other periods than the day
--               (hour, ISO week, calendar month: "Other periods" below)
--             per tier: where its state is (0: the tenant hash, under the
--               field prefix ARGV[5 + i]; i: KEYS[i]), algorithm code (1
--               fixed window, 2 sliding window, 3 token bucket, 4 sliding
--               log), limit, window_ms, cost, burst (the token bucket's)
--             per other period j: its start and end in ms (computed by the
--               node: the script does no calendar arithmetic), its limit,
--               its broadcast total, own cap (-1 none), urgent_at (-1
--               never), the number of this region's actors in its
--               broadcast, and their P and N
--             per actor of this region in the day's broadcast: its P and N
-- ARGV[5 + i]  tier i's field prefix in the tenant hash ("-" for a tier
--           in a key of its own), i = 1..K
-- ARGV[5 + K + j]  other period j's field prefix, "g:<label>:" (labels:
--           shared/src/period.rs), j = 1..E
-- then      a refund's handle id ("-" when none) and its expiry, Redis ms
--           (0 = none): from then on every window the charge touched has
--           ended, and the refund is refused
-- then      the epochs of each other period's actors, period by period
-- then      the epoch of each actor of this region in the day's broadcast,
--           in the order of their P and N above
--
-- Reply: a list in fixed positions, parsed in script.rs with the call in
-- hand. It holds only what the node cannot compute from its own call (a
-- reply item costs Redis about 360 instructions): no layout version (the
-- SHA the node calls by pins this text), no window's reset (the node has
-- the window and now_ms), no global remaining (the node has the limit, the
-- broadcast and its own parts).
--   [1] outcome: 0 allowed (a refund and a peek always are), i > 0 denied
--       by tier i, -1 denied by the day's global tier, -(3 + j) by other
--       period j's, -2 expired (nothing done; the reply is then
--       { -2, now_ms }), -3 a check made for another day or period than
--       Redis' clock is in (nothing done; the reply is then { -3, now_ms })
--   [2] now_ms (Redis TIME; the day is now_ms / 86400000)
--   [3] own_p   [4] own_n: this region's PN counter for the day
--   [5] raised: units the rollback check added to P (see below)
--   [6] the op's units: a check's lease granted beyond its cost; a
--       refund's global units given back (-1: the handle was used already,
--       -2: the handle expired; nothing given back either way); a peek's 0
--   [7] epoch, naming this region's actor of the day's PN counter
--   then each tier's remaining, in call order, followed by its reset_ms
--       for a token bucket or a sliding log (state-dependent)
--   then each other period's global remaining (after the call)
--   then, when denied, retry_ms (-1 = never).
--
-- Numbers are Lua doubles: exact integers up to 2^53.

local A = ARGV
local unpack_n = struct.unpack
local call = redis.call
local floor = math.floor
local fmt = string.format

-- A tier is an array with every field it will hold, allocated once; these
-- name its positions. (With named fields, a table of string keys, the
-- script ran 10 k instructions more per call.) loc: 0 = the tenant hash,
-- i = KEYS[i]; first: its fields' offset in the HMGET; ok, remaining,
-- reset, retry: the decision; s1, s3: fields as read that are written back
-- unchanged (false when they change); idx, n1, n2: what the algorithm
-- computed (window index, count, previous count; for GCRA the time ahead
-- before and after the request, and emit, the time one unit takes).
local LOC, ALG, LIMIT, WIN, COST, BURST, FIRST = 1, 2, 3, 4, 5, 6, 7
local OK, REMAINING, RESET, RETRY, TTL_MS = 8, 9, 10, 11, 12
local IDX, N1, N2, EMIT, S1, S3 = 13, 14, 15, 16, 17, 18
-- Units of the day's counter at which the tenant hash is rewritten with the
-- day's fields first (see the writes below).
local BUSY_DAY = 64

local deadline, node_day, ttl, glimit, gcost, btotal, own_cap, urgent_at, relaxed, op1, op2, op3, K, E, pos =
  unpack_n('<dddddddddddddd', A[5])

local t = redis.call('TIME')
local now_us = t[1] * 1000000 + t[2]
local now_ms = (now_us - now_us % 1000) / 1000

if deadline > 0 and now_ms > deadline then
  return { -2, now_ms }
end

local op = A[1]
local day = (now_ms - now_ms % 86400000) / 86400000
if day - node_day > 1 or node_day - day > 1 then
  return redis.error_reply('ERR tierlimit: node clock is more than a day off Redis TIME')
end
-- One clock decides the day: Redis'. A check carries the broadcast of the
-- node's day; for another day it would read others' spend of the wrong
-- day (0 just after the node's early midnight), so it does nothing and the
-- node sends it again with Redis' day.
if day ~= node_day and op == 'check' then
  return { -3, now_ms }
end
-- The day's field prefix: the node's own when it agrees, since formatting
-- a number costs more than the rest of a field name.
local gp = A[3]
if day ~= node_day then gp = 'g:' .. fmt('%d', day) .. ':' end

-- Read: one HMGET of the tenant hash for the day's counter and every tier
-- kept there; one HMGET per tier kept in a key of its own. A tier's fields
-- are <prefix>w, <prefix>c and <prefix>p (fixed and sliding windows: the
-- window index, its count, the previous window's count) or <prefix>t and
-- <prefix>f (GCRA); the sliding log is a zset of its own and has none.
local fields = { gp .. 'e', gp .. 'p', gp .. 'n', gp .. 'd', false, false, false }
local nf = 4
local tiers = { false, false, false, false }
for i = 1, K do
  local loc, alg, limit, w, cost, burst
  loc, alg, limit, w, cost, burst, pos = unpack_n('<dddddd', A[5], pos)
  local tier = { loc, alg, limit, w, cost, burst, nf, true, 0, 0, 0, 0, 0, 0, 0, 0, false, false }
  if loc == 0 then
    local prefix = A[5 + i] -- <tier id>:
    if alg == 3 then
      fields[nf + 1] = prefix .. 't'; fields[nf + 2] = prefix .. 'f'; nf = nf + 2
    else
      fields[nf + 1] = prefix .. 'w'; fields[nf + 2] = prefix .. 'c'; nf = nf + 2
      if alg == 2 then fields[nf + 1] = prefix .. 'p'; nf = nf + 1 end
    end
  end
  tiers[i] = tier
end
-- Other periods (hour, ISO week, calendar month): a global tier each,
-- with a PN counter of its own under its prefix, decided with the rest.
-- An array per period, allocated only for tenants that have them; these
-- name its positions. open: Redis' clock is in the period (a check made for
-- another one does nothing and answers -3, as for the day; a refund gives
-- nothing back to a period that has ended: a closed period never changes).
local XPRE, XSTART, XEND, XLIM, XBT, XCAP, XURG, XNP, XPARTS, XFIRST = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
local XOPEN, XP, XN, XNREAD, XEPOCH, XNEW, XREM, XCHANGED, XOTH = 11, 12, 13, 14, 15, 16, 17, 18, 19
local xs = {}
local first_epoch = 6 + K + E
if op == 'refund' then first_epoch = first_epoch + 2 end
for j = 1, E do
  local s0, e0, lim, bt, cap, urg, np
  s0, e0, lim, bt, cap, urg, np, pos = unpack_n('<ddddddd', A[5], pos)
  local parts = {}
  for i = 1, np do
    parts[2 * i - 1], parts[2 * i], pos = unpack_n('<dd', A[5], pos)
  end
  local prefix = A[5 + K + j]
  local open = s0 <= now_ms and now_ms < e0
  if not open and op == 'check' then return { -3, now_ms } end
  fields[nf + 1] = prefix .. 'e'; fields[nf + 2] = prefix .. 'p'
  fields[nf + 3] = prefix .. 'n'; fields[nf + 4] = prefix .. 'd'
  xs[j] = { prefix, s0, e0, lim, bt, cap, urg, np, parts, nf, open, 0, 0, 0, false, false, -1, false, 0 }
  nf = nf + 4
end
-- The epochs of the other periods' actors come first, then the day's.
local x_epoch = first_epoch
for j = 1, E do first_epoch = first_epoch + xs[j][XNP] end
local h = call('HMGET', KEYS[1], unpack(fields, 1, nf))

-- Evaluate every tier: the decision (ok, remaining, reset, retry) and what
-- the writes below need; nothing here writes.
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
for i = 1, K do
  local tier = tiers[i]
  local alg, limit, w, c = tier[ALG], tier[LIMIT], tier[WIN], tier[COST]
  local s1, s2, s3
  if alg == 4 then
    -- no fields
  elseif tier[LOC] == 0 then
    local f = tier[FIRST]
    s1, s2, s3 = h[f + 1], h[f + 2], h[f + 3]
  elseif alg == 3 then
    local s = call('HMGET', KEYS[tier[LOC]], 't', 'f')
    s1, s2 = s[1], s[2]
  else
    local s = call('HMGET', KEYS[tier[LOC]], 'w', 'c', 'p')
    s1, s2, s3 = s[1], s[2], s[3]
  end
  if alg == 1 then
    local idx = (now_ms - now_ms % w) / w
    local used = 0
    if s1 and s1 + 0 == idx then used = (s2 and s2 + 0) or 0; tier[S1] = s1 end
    local reset = (idx + 1) * w - now_ms
    tier[IDX] = idx; tier[N1] = used
    tier[REMAINING] = limit - used; tier[RESET] = reset
    tier[TTL_MS] = reset + 1000
    if used + c > limit then
      tier[OK] = false
      if c > limit then tier[RETRY] = -1 else tier[RETRY] = reset end
    end
  elseif alg == 2 then
    local idx = (now_ms - now_ms % w) / w
    local sw = s1 and s1 + 0
    local cur, prev = 0, 0
    if sw == idx then
      cur = (s2 and s2 + 0) or 0; prev = (s3 and s3 + 0) or 0
      tier[S1] = s1; tier[S3] = s3
    elseif sw == idx - 1 then
      prev = (s2 and s2 + 0) or 0
      tier[S3] = s2
    end
    local elapsed = now_ms - idx * w
    local est = prev * ((w - elapsed) / w) + cur
    local remaining = 0
    if est < limit then remaining = limit - est; remaining = remaining - remaining % 1 end
    local reset = (idx + 1) * w - now_ms
    tier[IDX] = idx; tier[N1] = cur; tier[N2] = prev
    tier[REMAINING] = remaining; tier[RESET] = reset
    tier[TTL_MS] = 2 * w + 1000
    if est + c > limit then
      tier[OK] = false
      local r
      if c > limit then
        r = -1
      elseif cur + c <= limit then
        -- blocked by the weighted previous window: wait until it fades enough
        r = math.ceil(w * (1 - (limit - c - cur) / prev) - elapsed)
      else
        -- blocked by the current window: wait into the next one until
        -- cur * (1 - t/w) + c <= limit
        r = reset + math.ceil(w * (1 - (limit - c) / cur))
      end
      if r ~= -1 and r < 1 then r = 1 end
      tier[RETRY] = r
    end
  elseif alg == 3 then
    local burst = tier[BURST]
    local e = (w * 1000) / limit
    local tau = e * burst
    local ahead = 0
    local tat = s1 and s1 + 0
    if tat and tat >= now_us then ahead = (tat - now_us) + ((s2 and s2 + 0) or 0) end
    local new_ahead = ahead + c * e
    local remaining = floor((tau - ahead) / e)
    if remaining < 0 then remaining = 0 end
    tier[EMIT] = e; tier[N1] = ahead; tier[N2] = new_ahead; tier[S1] = tat and s1 or false
    tier[REMAINING] = remaining
    tier[TTL_MS] = math.ceil(new_ahead / 1000) + 1000
    if new_ahead > tau then
      tier[OK] = false
      if c > burst then tier[RETRY] = -1 else tier[RETRY] = math.max(1, math.ceil((new_ahead - tau) / 1000)) end
      tier[RESET] = math.ceil(ahead / 1000)
    else
      tier[RESET] = math.ceil(new_ahead / 1000)
    end
  else
    local key = KEYS[tier[LOC]]
    call('ZREMRANGEBYSCORE', key, '-inf', fmt('%d', now_ms - w))
    local used = call('ZCARD', key)
    tier[N1] = used
    tier[REMAINING] = limit - used; tier[RESET] = w
    if used + c > limit then
      tier[OK] = false
      local newest = call('ZRANGE', key, -1, -1, 'WITHSCORES')
      if newest[2] then tier[RESET] = newest[2] + w - now_ms end
      if c > limit then
        tier[RETRY] = -1
      else
        -- the (used + c - limit)-th oldest entry must leave the window
        local nth = call('ZRANGE', key, used + c - limit - 1, used + c - limit - 1, 'WITHSCORES')
        tier[RETRY] = math.max(1, nth[2] + w - now_ms)
      end
    end
  end
end

-- The region's PN counter for (T, day), in the tenant hash. Its epoch lives
-- beside it, so a Redis that lost the tenant starts a new actor atomically
-- with the first charge.
local new_day = not h[1]
local epoch = h[1] or A[4]
local own_p = (h[2] and h[2] + 0) or 0
local own_n = 0
if h[3] and h[3] ~= '0' then own_n = h[3] + 0 end
local n_read = own_n
local dstate = h[4] -- false (clean), '1' (dirty) or '2' (urgent)

-- This region's actors in the broadcast. The part of the current epoch is
-- what the aggregator already holds from us: Redis below it has rolled back
-- (an AOF everysec crash, an RDB restore, a failover to a lagging replica)
-- with the epoch kept. Raise P and N to it: otherwise the region would
-- re-admit what it already spent, and the aggregator, whose max-merge
-- ignores a counter below what it saw, would stay short for good.
local mine_p, mine_n = 0, 0
if day == node_day then
  for i = first_epoch, #A do
    local p, n
    p, n, pos = unpack_n('<dd', A[5], pos)
    if A[i] == epoch then mine_p = p; mine_n = n end
  end
end
local raised = 0
if mine_p > own_p or mine_n > own_n then
  raised = math.max(0, mine_p - own_p)
  own_p = math.max(own_p, mine_p)
  own_n = math.max(own_n, mine_n)
end
local p_before = own_p

local global_ok, global_remaining, global_retry = true, -1, 0
if glimit > 0 then
  -- On another day (a refund or a peek) mine is 0: the whole broadcast
  -- total counts as others', never nothing.
  local others = btotal - (mine_p - mine_n)
  if others < 0 then others = 0 end
  local own = own_p - own_n
  global_remaining = glimit - others - own
  if own_cap >= 0 and own_cap - own < global_remaining then
    global_remaining = own_cap - own
  end
  if global_remaining < 0 then global_remaining = 0 end
  if op == 'check' then
    global_ok = gcost <= global_remaining
    if not global_ok then global_retry = 86400000 - now_ms % 86400000 end
  end
end

-- Each other period's counter, raised to its actor's broadcast part like
-- the day's, and its remaining (the same arithmetic as the day's).
local x_denied, x_retry = 0, 0
for j = 1, E do
  local x = xs[j]
  local f = x[XFIRST]
  local xe = h[f + 1]
  local xp = (h[f + 2] and h[f + 2] + 0) or 0
  local xn = 0
  if h[f + 3] and h[f + 3] ~= '0' then xn = h[f + 3] + 0 end
  x[XNREAD] = xn; x[XNEW] = not xe; x[XEPOCH] = xe or A[4]
  local mp, mn = 0, 0
  if x[XOPEN] then
    local parts = x[XPARTS]
    for i = 1, x[XNP] do
      if A[x_epoch + i - 1] == x[XEPOCH] then mp = parts[2 * i - 1]; mn = parts[2 * i] end
    end
  end
  x_epoch = x_epoch + x[XNP]
  if mp > xp or mn > xn then
    xp = math.max(xp, mp); xn = math.max(xn, mn); x[XCHANGED] = true
  end
  x[XP] = xp; x[XN] = xn
  if x[XLIM] > 0 then
    local others = x[XBT] - (mp - mn)
    if others < 0 then others = 0 end
    x[XOTH] = others
    local own = xp - xn
    local rem = x[XLIM] - others - own
    if x[XCAP] >= 0 and x[XCAP] - own < rem then rem = x[XCAP] - own end
    if rem < 0 then rem = 0 end
    x[XREM] = rem
    if op == 'check' and gcost > rem then
      if x_denied == 0 then x_denied = j end
      local r = x[XEND] - now_ms
      if r > x_retry then x_retry = r end
    end
  end
end

-- Writes: pairs for one HSET of the tenant hash (`hs`, `nh` values);
-- tiers in keys of their own are written apart. Numbers are formatted
-- with %d (Redis would format a Lua number with %.17g, which costs more);
-- values that did not change (a window's index, the previous count) are
-- not written again.
local hs = { false, false, false, false }
local nh = 0
local outcome, retry = 0, 0
local refunded, granted = 0, 0
local changed = raised > 0

if op == 'refund' then
  -- A refund by handle: once per handle, and only into what the charge was
  -- in (its windows, its day), until every window it touched has ended.
  -- The record of used handles is written only here, so checks stay cheap;
  -- it lives as long as the day's counter, and longer when the charge
  -- touched a longer window, so that a handle never outlives its record.
  local by_handle = op1 > 0
  local charged_at = op2
  local fresh = true
  if by_handle then
    local rf = KEYS[op1]
    local expires_at = A[7 + K + E] + 0
    if expires_at > 0 and now_ms >= expires_at then
      -- Every window of the charge has ended: nothing left to give back,
      -- nothing written.
      fresh = false; refunded = -2; changed = false
    elseif call('SADD', rf, A[6 + K + E]) == 0 then
      -- Used already: nothing given back and nothing written, not even a
      -- rollback raise (the next call raises again).
      fresh = false; refunded = -1; changed = false
    else
      local keep_until = now_ms + ttl * 1000
      if expires_at + 1000 > keep_until then keep_until = expires_at + 1000 end
      -- Relative (PEXPIRE, not PEXPIREAT): the same in Redis' clock, and
      -- right under a script-level fake clock too (lua_model.rs).
      local left = call('PTTL', rf)
      if left < 0 or now_ms + left < keep_until then
        call('PEXPIRE', rf, fmt('%d', keep_until - now_ms))
      end
    end
  end
  if fresh then
    -- Gives a tier its cost back (never below zero).
    for i = 1, K do
      local tier = tiers[i]
      local alg, w, c = tier[ALG], tier[WIN], tier[COST]
      local same_window = true
      if by_handle then
        if alg >= 3 then
          same_window = now_ms - charged_at < w
        else
          same_window = floor(charged_at / w) == floor(now_ms / w)
        end
      end
      if same_window then
        local v1, v2, v3 = nil, nil, nil
        if alg == 1 then
          if tier[N1] > 0 then v1 = tier[IDX]; v2 = math.max(0, tier[N1] - c) end
        elseif alg == 2 then
          if tier[N1] > 0 then v1 = tier[IDX]; v2 = math.max(0, tier[N1] - c); v3 = tier[N2] end
        elseif alg == 3 then
          if tier[S1] then
            local a = math.max(0, tier[N1] - c * tier[EMIT])
            local whole = floor(a)
            v1 = fmt('%d', now_us + whole); v2 = fmt('%.17g', a - whole)
          end
        elseif tier[N1] > 0 then
          -- The sliding log gives back units of the log, not a count: which
          -- ones decides when the room comes back. By handle, the charge's
          -- own members (scored at its time, named now_us:<id>:j with the
          -- handle's id), so the refund frees exactly the room the charge
          -- took, until it would have left the window anyway. Free-form,
          -- tied to no charge, the oldest: they would leave first. (Popping
          -- the newest gave a refunded old charge a whole new window of
          -- room: A at 0 s, B at 59 s, refund A pops B, C is admitted, and
          -- at 60 s A leaves and D is admitted, three in one window.)
          local key = KEYS[tier[LOC]]
          if by_handle then
            local tag = ':' .. A[6 + K + E] .. ':'
            local at = fmt('%d', charged_at)
            local members = call('ZRANGE', key, at, at, 'BYSCORE')
            local gone, n = {}, 0
            for j = 1, #members do
              if n >= c then break end
              local m = members[j]
              if string.find(m, tag, 1, true) then
                n = n + 1; gone[#gone + 1] = m
                if #gone >= 1000 then call('ZREM', key, unpack(gone)); gone = {} end
              end
            end
            if #gone > 0 then call('ZREM', key, unpack(gone)) end
          else
            call('ZPOPMIN', key, c)
          end
        end
        if v2 then
          if alg < 3 then v2 = fmt('%d', v2) end
          if tier[LOC] == 0 then
            -- a count above zero means the window was the current one: its
            -- index and previous count are in Redis already
            local f = tier[FIRST]
            if alg == 3 then
              hs[nh + 1] = fields[f + 1]; hs[nh + 2] = v1; nh = nh + 2
            end
            hs[nh + 1] = fields[f + 2]; hs[nh + 2] = v2; nh = nh + 2
          elseif alg == 3 then
            call('HSET', KEYS[tier[LOC]], 't', v1, 'f', v2)
            call('PEXPIRE', KEYS[tier[LOC]], fmt('%d', tier[TTL_MS]))
          else
            if v3 then
              call('HSET', KEYS[tier[LOC]], 'w', v1, 'c', v2, 'p', v3)
            else
              call('HSET', KEYS[tier[LOC]], 'w', v1, 'c', v2)
            end
            call('PEXPIRE', KEYS[tier[LOC]], fmt('%d', tier[TTL_MS]))
          end
        end
      end
    end
    -- N never exceeds P: the counter cannot go below zero.
    local back = math.min(gcost, own_p - own_n)
    if by_handle and floor(charged_at / 86400000) ~= day then back = 0 end
    if back > 0 then
      refunded = back
      own_n = own_n + back
      changed = true
    end
    -- Other periods: only into one still open, and by handle only into
    -- the period the charge was in.
    for j = 1, E do
      local x = xs[j]
      local xback = math.min(gcost, x[XP] - x[XN])
      if not x[XOPEN] or (by_handle and (charged_at < x[XSTART] or charged_at >= x[XEND])) then xback = 0 end
      if xback > 0 then
        x[XN] = x[XN] + xback
        x[XCHANGED] = true
      end
    end
  end
elseif op == 'check' then
  -- Deny if any tier denies; retry after the longest wait.
  for i = 1, K do
    local tier = tiers[i]
    if not tier[OK] then
      local r = tier[RETRY]
      if outcome == 0 then outcome = i end
      if r < 0 or retry < 0 then retry = -1 elseif r > retry then retry = r end
    end
  end
  if not global_ok then
    if outcome == 0 then outcome = -1 end
    if retry >= 0 and global_retry > retry then retry = global_retry end
  end
  if x_denied > 0 then
    if outcome == 0 then outcome = -(3 + x_denied) end
    if retry >= 0 and x_retry > retry then retry = x_retry end
  end

  if outcome == 0 then
    -- Leases. An allowed check may charge `granted` more units, which the
    -- node then spends in process (region-node/src/lease.rs). They are
    -- charged here like any other unit, so the sum of outstanding leases
    -- never exceeds what the limits leave. The node asks for `want` (what
    -- it expects to spend in half a lease's `life` ms at its recent rate;
    -- 0 = no lease). With less than `life` left before a tier's window or
    -- the day ends, the want shrinks in proportion (so at a steady rate a
    -- lease is spent before its window ends, and dies with it: it never
    -- crosses into the next window or day). A lease takes at most
    -- 1/lease_share of what every tier and the global budget leave after the
    -- request (lease_share = 2 × the region's nodes), and none below 2
    -- units, so near the limit (fewer than 2 × lease_share left) every
    -- decision comes here again. Only fixed and sliding windows lease: a
    -- unit charged to them now belongs to the current window, which is what
    -- the lease's lifetime follows (GCRA and the exact log keep no window a
    -- lease could die with). The node's twin: script::lease_grant.
    if op1 > 0 and K > 0 then
      local want, share, life = op1, math.max(1, op2), op3
      local left = 86400000 - now_ms % 86400000
      for j = 1, E do
        local x = xs[j]
        if x[XEND] - now_ms < left then left = x[XEND] - now_ms end
      end
      for i = 1, K do
        local tier = tiers[i]
        if tier[ALG] > 2 then want = 0; break end
        if tier[RESET] < left then left = tier[RESET] end
      end
      if left < life then want = floor(want * left / life) end
      local room = want * share
      for i = 1, K do
        local tier = tiers[i]
        room = math.min(room, tier[REMAINING] - tier[COST])
      end
      if global_remaining >= 0 then room = math.min(room, global_remaining - gcost) end
      for j = 1, E do
        local x = xs[j]
        if x[XREM] >= 0 then room = math.min(room, x[XREM] - gcost) end
      end
      granted = math.min(want, floor(math.max(0, room) / share))
      if granted < 2 then granted = 0 end
    end

    -- Charge every tier. Remaining units are reported after this request
    -- only if it was charged.
    for i = 1, K do
      local tier = tiers[i]
      local alg, c = tier[ALG], tier[COST] + granted
      if alg <= 2 then
        local count = fmt('%d', tier[N1] + c)
        if tier[LOC] == 0 then
          local f = tier[FIRST]
          if not tier[S1] then
            -- a new window: its index, and the previous count it rolled over
            hs[nh + 1] = fields[f + 1]; hs[nh + 2] = tier[IDX]; nh = nh + 2
            if alg == 2 then hs[nh + 1] = fields[f + 3]; hs[nh + 2] = tier[S3] or tier[N2]; nh = nh + 2 end
          end
          hs[nh + 1] = fields[f + 2]; hs[nh + 2] = count; nh = nh + 2
        else
          if alg == 2 then
            call('HSET', KEYS[tier[LOC]], 'w', tier[S1] or tier[IDX], 'c', count, 'p', tier[S3] or tier[N2])
          else
            call('HSET', KEYS[tier[LOC]], 'w', tier[S1] or tier[IDX], 'c', count)
          end
          call('PEXPIRE', KEYS[tier[LOC]], fmt('%d', tier[TTL_MS]))
        end
      elseif alg == 3 then
        local a = tier[N2]
        local whole = floor(a)
        local t1, t2 = fmt('%d', now_us + whole), fmt('%.17g', a - whole)
        if tier[LOC] == 0 then
          local f = tier[FIRST]
          hs[nh + 1] = fields[f + 1]; hs[nh + 2] = t1; hs[nh + 3] = fields[f + 2]; hs[nh + 4] = t2; nh = nh + 4
        else
          call('HSET', KEYS[tier[LOC]], 't', t1, 'f', t2)
          call('PEXPIRE', KEYS[tier[LOC]], fmt('%d', tier[TTL_MS]))
        end
      else
        -- Members are unique per call (the epoch candidate is a fresh
        -- random id), added in chunks: Lua's unpack() takes at most ~8000
        -- values.
        local key = KEYS[tier[LOC]]
        local args = {}
        local tag = fmt('%d', now_us) .. ':' .. A[4] .. ':'
        local score = fmt('%d', now_ms)
        for j = 1, c do
          args[#args + 1] = score
          args[#args + 1] = tag .. j
          if #args >= 1000 then
            call('ZADD', key, unpack(args))
            args = {}
          end
        end
        if #args > 0 then call('ZADD', key, unpack(args)) end
        call('PEXPIRE', key, fmt('%d', tier[WIN] + 1000))
      end
      local left = tier[REMAINING] - c
      if left < 0 then left = 0 end
      tier[REMAINING] = left
    end
    if global_remaining >= 0 then
      global_remaining = global_remaining - gcost - granted
      if global_remaining < 0 then global_remaining = 0 end
    end
    own_p = own_p + gcost + granted
    changed = true
    for j = 1, E do
      local x = xs[j]
      x[XP] = x[XP] + gcost + granted
      x[XCHANGED] = true
    end
  end
end
-- op == 'peek' charges nothing, but persists a rollback raise: the
-- publisher raises a counter it found below its broadcast part this way.

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
if changed then
  hs[nh + 1] = fields[2]; hs[nh + 2] = fmt('%d', own_p); nh = nh + 2
  if own_n ~= n_read or new_day then hs[nh + 1] = fields[3]; hs[nh + 2] = fmt('%d', own_n); nh = nh + 2 end
  local rolled_over = false
  if new_day then
    hs[nh + 1] = fields[1]; hs[nh + 2] = epoch; nh = nh + 2
    -- A new day: forget days past retention (the hash is rewritten in
    -- order, and given its TTL, below).
    local keep_from = day - floor(ttl / 86400)
    local kept = { fmt('%d', day) }
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
    hs[nh + 1] = 'gd'; hs[nh + 2] = table.concat(kept, ','); nh = nh + 2
  end
  local want = 1
  if urgent_at >= 0 and own_p - own_n >= urgent_at then want = 2 end
  if not dstate or (want == 2 and dstate ~= '2') then
    local score = 0
    if want == 1 then
      local stamped = call('HGET', KEYS[1], gp .. 's')
      score = math.max(now_ms, ((stamped and stamped + 0) or 0) + relaxed)
      if rolled_over and relaxed > 0 then
        score = now_ms + tonumber(string.sub(redis.sha1hex(A[2]), 1, 8), 16) % relaxed
      end
    end
    call('ZADD', KEYS[2], score, A[2] .. '|' .. gp:sub(3, -2))
    hs[nh + 1] = fields[4]; hs[nh + 2] = want; nh = nh + 2
  end
end
-- Other periods' counters: written and marked dirty as the day's (member
-- "T|<label>"). A period's first counter forgets the same kind's periods
-- before the previous one (listed in `gx`), and keeps the hash at least
-- until the period has ended plus the day counters' TTL: a month tier keeps
-- its tenant's hash for the month, while day fields still go as `gd` says.
local x_keep = 0
-- The periods listed in `gx`, as this call leaves them: read once and
-- written once, so two periods new in one call (an hour and a month at a
-- month's first hour; two zones' days) each see the other's changes.
local gx = false
for j = 1, E do
  local x = xs[j]
  if x[XCHANGED] then
    local f = x[XFIRST]
    hs[nh + 1] = fields[f + 2]; hs[nh + 2] = fmt('%d', x[XP]); nh = nh + 2
    if x[XN] ~= x[XNREAD] or x[XNEW] then hs[nh + 1] = fields[f + 3]; hs[nh + 2] = fmt('%d', x[XN]); nh = nh + 2 end
    local prefix = x[XPRE]
    local label = prefix:sub(3, -2)
    if x[XNEW] then
      hs[nh + 1] = fields[f + 1]; hs[nh + 2] = x[XEPOCH]; nh = nh + 2
      -- A label is <letter?><index><@zone?>: periods of one kind and zone
      -- (the letter and the zone) replace each other.
      local letter, digits, zone = label:match('^(%a?)(%d+)(.*)$')
      local kind, index = letter .. zone, tonumber(digits)
      if not gx then
        gx = {}
        local listed = call('HGET', KEYS[1], 'gx')
        if listed then
          for l in string.gmatch(listed, '[^,]+') do gx[#gx + 1] = l end
        end
      end
      local kept = { label }
      for _, l in ipairs(gx) do
        if l ~= label then
          local ll, ld, lz = l:match('^(%a?)(%d+)(.*)$')
          if ll and ll .. lz == kind and tonumber(ld) < index - 1 then
            local g = 'g:' .. l .. ':'
            call('HDEL', KEYS[1], g .. 'e', g .. 'p', g .. 'n', g .. 'd', g .. 's')
          else
            kept[#kept + 1] = l
          end
        end
      end
      gx = kept
      local keep = x[XEND] - now_ms + ttl * 1000
      if keep > x_keep then x_keep = keep end
    end
    local want = 1
    if x[XURG] >= 0 and x[XP] - x[XN] >= x[XURG] then want = 2 end
    local xstate = h[f + 4]
    if not xstate or (want == 2 and xstate ~= '2') then
      local score = 0
      if want == 1 then
        local stamped = call('HGET', KEYS[1], prefix .. 's')
        score = math.max(now_ms, ((stamped and stamped + 0) or 0) + relaxed)
      end
      call('ZADD', KEYS[2], score, A[2] .. '|' .. label)
      hs[nh + 1] = fields[f + 4]; hs[nh + 2] = want; nh = nh + 2
    end
    changed = true
  end
end
if gx then hs[nh + 1] = 'gx'; hs[nh + 2] = table.concat(gx, ','); nh = nh + 2 end
-- The tenant's day just became busy (a charge took the counter past
-- BUSY_DAY): the tenant hash is rewritten in the order its readers want, the
-- day's counter, then the region's tiers, then the rest (node tiers, `gd`,
-- the days kept). A small hash is a listpack, where HMGET and HSET find a
-- field by walking the fields before it, and fields are appended as they
-- are first written: the day's counter came after every earlier day's and
-- every node's tier fields, and each one ahead of it costs every decision
-- 600 to 800 instructions. The rewrite costs 0.3 to 0.7 M instructions,
-- about what 35 decisions save, so it waits for a busy day rather than the
-- day's first charge (most tenants of a large region charge a few units a
-- day, and midnight would pay it for every tenant at once): BENCHMARKS.md,
-- "Today's fields first". A hash past the listpack's size (128 fields by
-- default) is a hash table, where order costs nothing: not rewritten.
local all = false
if p_before < BUSY_DAY and own_p >= BUSY_DAY then
  all = call('HGETALL', KEYS[1])
  if #all > 256 then all = false end
end
if all then
  -- Each field once: this call's value if it writes one, else the stored.
  local val, names, seen = {}, {}, {}
  for j = 1, #all, 2 do val[all[j]] = all[j + 1]; names[#names + 1] = all[j] end
  for j = 1, nh, 2 do
    if not val[hs[j]] then names[#names + 1] = hs[j] end
    val[hs[j]] = hs[j + 1]
  end
  local ordered, no = {}, 0
  for j = 1, 4 do
    local f = fields[j]
    if val[f] then ordered[no + 1] = f; ordered[no + 2] = val[f]; no = no + 2; seen[f] = true end
  end
  for pass = 1, 2 do
    for j = 1, #names do
      local f = names[j]
      if not seen[f] and ((pass == 1) == (string.sub(f, 1, 2) == 'r:')) then
        ordered[no + 1] = f; ordered[no + 2] = val[f]; no = no + 2; seen[f] = true
      end
    end
  end
  local pttl = call('PTTL', KEYS[1])
  call('DEL', KEYS[1])
  call('HSET', KEYS[1], unpack(ordered, 1, no))
  if pttl > 0 then call('PEXPIRE', KEYS[1], pttl) end
elseif nh > 0 then
  call('HSET', KEYS[1], unpack(hs, 1, nh))
end
-- A new day gives the hash its TTL, after the write: the first charge of a
-- tenant creates the hash.
if new_day and changed then call('EXPIRE', KEYS[1], ttl) end
if x_keep > 0 then
  local left = call('PTTL', KEYS[1])
  if left < x_keep then call('PEXPIRE', KEYS[1], fmt('%d', x_keep)) end
elseif new_day and changed and E > 0 then
  -- The day's EXPIRE above must not cut a longer period's counter short.
  local keep = ttl * 1000
  for j = 1, E do
    local x = xs[j]
    if x[XOPEN] and x[XEND] - now_ms + ttl * 1000 > keep then keep = x[XEND] - now_ms + ttl * 1000 end
  end
  call('PEXPIRE', KEYS[1], fmt('%d', keep))
end

local out = { outcome, now_ms, own_p, own_n, raised, refunded + granted, epoch, nil, nil }
local no = 7
for i = 1, K do
  local tier = tiers[i]
  out[no + 1] = tier[REMAINING]; no = no + 1
  if tier[ALG] > 2 then out[no + 1] = tier[RESET]; no = no + 1 end
end
-- Each other period's remaining after the call (as the node computes the
-- day's from own P and N).
for j = 1, E do
  local x = xs[j]
  local rem = -1
  if x[XLIM] > 0 then
    local own = x[XP] - x[XN]
    rem = x[XLIM] - x[XOTH] - own
    if x[XCAP] >= 0 and x[XCAP] - own < rem then rem = x[XCAP] - own end
    if rem < 0 then rem = 0 end
  end
  out[no + 1] = rem; no = no + 1
end
if outcome ~= 0 then out[no + 1] = retry end
return out
