package remote

import (
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/internal/lua"
)

// luaPrelude starts every bucket script (see lua.Prelude).
const luaPrelude = lua.Prelude

// bucketLua is one token bucket per key, refilled lazily from Redis TIME.
// apply in bucket.go is its Go twin; keep the two in step.
//
// Every number is a whole number below 2^53, so double arithmetic is exact:
// limits arrive in lowest terms with (rate+1)·per < 2^53, products are split
// by idiv before they could grow past that, and idiv corrects the rounding
// of the float division.
//
// KEYS[1]  the bucket key, prefix{policy:key}
// ARGV[1]  op: "lease", "return" or "debit"
// ARGV[2]  n: tokens wanted (lease), given back (return) or charged (debit)
// ARGV[3]  min: fewest tokens a lease grants now rather than future-date n
// ARGV[4]  rate  } the refill: rate tokens every per microseconds,
// ARGV[5]  per   } in lowest terms
// ARGV[6]  burst
// ARGV[7]  version of the caller's policy
// ARGV[8]  maxdelay: µs ahead a lease on an empty bucket may be future-dated
// ARGV[9]  floor: the lowest level debt may take a bucket to (-maxDebt)
// ARGV[10] margin: ms a key outlives its time to full (TTLMargin)
// ARGV[11] need: fewest tokens that serve the caller, at most min
// ARGV[12] holder: the capacity-grant holder (grant, ungrant)
// ARGV[13] running: grant units the holder runs at now (grant); 1 for a
// return that releases the holder's record (Stock.Release)
// ARGV[14] term: µs a grant lasts from this call (grant)
// ARGV[15] maxholders: most grants the bucket keeps (grant)
// ARGV[16] gburst: local burst a new grant takes from the level (grant)
// ARGV[17] spent: every token admitted without the store since the mark (debit)
// ARGV[18] mark born, ARGV[19] mark spill: the caller's Result.Mark
// (debit; absent or born 0: charge n)
// ARGV[20] unused
// ARGV[21] keep: tokens the holder still holds of its record and goes on
// spending (lease with a holder)
// ARGV[22] seq: the holder's call number, rising with each call (lease);
// for a return, the number of the call whose answer the holder last had
// ARGV[23] spend: tokens of a lease granted now that the holder hands at
// once to the callers waiting on it, not counted under its record
// KEYS[2]  the bucket's capacity grants and stock records,
// prefix{policy:key}:grants
//
// Stock records: a lease that names a holder (ARGV[12]) is counted under
// the holder's record until its term (ARGV[14]) ends, as k tokens held:
// what the holder said it still holds (keep) plus what the lease granted,
// less the tokens of a lease granted now that it spends at once (spend).
// The bucket's cap is burst minus every record's burst and stock, so the
// bucket and everything held never pass burst at any instant, and in any
// window w the fleet admits at most burst + rate·w with nothing decaying.
// A call with a seq no higher than the record's is a late one (it was
// overtaken by a later call of the same holder): it changes nothing. A
// return naming the holder and the seq of its record takes the tokens off
// the record; any return adds to the level only up to the cap. At most
// maxholders (ARGV[15]) records are kept; a lease past that grants at most
// need, and unrecorded (reply field 14 is 0): the caller spends them at
// once.
//
// Capacity grants (see grants.go): a grant is a share s of the bucket's
// rate, in units of 1/grantUnits, and a burst b, until exp (Redis TIME).
// While grants live the bucket refills at rate·(G−Σs)/G up to burst−Σb,
// piecewise: each grant gives its rate back from its own expiry. Its carry
// then counts in per·G units, the part below per kept in the grants
// record ("frac|id s b exp want|..."). "grant" creates or renews the
// caller's grant by proportional share of the wants (n, in units); a new
// grant's burst grows toward gburst while the grants' bursts fit Burst,
// taking what the level holds of it as the holder's first tokens. A rate
// falls only to what the holder says it runs at, and rises above that only
// while the level is not negative (no future-dated tokens or debt out,
// which were timed at the rate the grants left). The reply of a grant is
// {share, burst, remaining, tokens, reset, now, version, stale, created,
// 0, holders}. "ungrant" gives back n unspent tokens (at most b) and the
// rate from now. A new limit ends every grant.
//
// A lease never refuses while need tokens are there: it grants n, or the
// level if at least min, or n future-dated within maxdelay, or the level
// if at least need, or need future-dated within maxdelay, in that order;
// a refusal's retry is the wait for need, never for n.
//
// State, a string: "level carry last version burst rate per born spill
// owed" (a state of the first seven, written before spill marks, reads
// with the rest 0)
//
//	level    whole tokens; negative while future-dated grants or debt are out
//	carry    refill progress toward the next token, in [0, per): a token
//	         arrives each time carry reaches per, and every µs adds rate
//	last     µs of Redis TIME when level was computed
//	version  policy version; burst, rate, per: the limit under it
//	born     µs of Redis TIME when the bucket was made
//	spill    refill lost at the cap that no debit has claimed: a debit
//	         with a mark of this bucket is charged spent less what
//	         spilled since the mark, and claims it
//	owed     the part of a negative level debits charged: while more
//	         than burst/8 is out, no grant is offered more than half its
//	         allocation
//
// A newer request version rescales the bucket (tokens used are kept,
// clamped to the new burst); an older one is refused for leases ("stale")
// and applied under the bucket's own limit for returns and debits.
//
// Reply: {granted, delay_us, remaining, retry_us, reset_us, now_us,
// version, stale, created, 0, holders, born, spill}; created is 1 when the key did not exist (new,
// expired, or evicted by the server).
//
// A lease or a return on a bucket without grants, absent or kept under
// the caller's limit and version, runs on a plain path at the script's
// head: the same steps on locals, without the general path's table and
// closures, which cost Redis a quarter of a cold lease's script time
// (TestPlainPathTwinsAgree holds it to the Go twin).
//
// Errors: "LEASEHOLD_CORRUPT ..." when the key holds a foreign value or
// another type (WRONGTYPE, caught with pcall so every server reports it the
// same way).
var bucketLua = luaPrelude + strings.NewReplacer("GRANT_UNITS", strconv.Itoa(grantUnits), "GRANT_RETRY", strconv.FormatInt(grantRetry.Microseconds(), 10), "MAX_GRANT_RATE_PER", strconv.FormatInt(maxGrantRatePer, 10), "MAX_DEBT", strconv.FormatInt(maxDebt, 10)).Replace(`
local op = ARGV[1]
local n = tonumber(ARGV[2])
local minn = tonumber(ARGV[3])
local rate = tonumber(ARGV[4])
local per = tonumber(ARGV[5])
local burst = tonumber(ARGV[6])
local version = tonumber(ARGV[7])
local maxdelay = tonumber(ARGV[8])
local margin = tonumber(ARGV[10])
local need = tonumber(ARGV[11])
local G = GRANT_UNITS
local MAXSPILL = MAX_DEBT

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local graw
if KEYS[2] then
  graw = redis.pcall('GET', KEYS[2])
  if type(graw) == 'table' and graw.err then
    return redis.error_reply('LEASEHOLD_CORRUPT ' .. graw.err)
  end
end
local raw = redis.pcall('GET', KEYS[1])
if type(raw) == 'table' and raw.err then
  return redis.error_reply('LEASEHOLD_CORRUPT ' .. raw.err)
end

-- The plain path: a lease or a return on a bucket without grants,
-- absent or kept under the caller's limit, runs here on locals, without
-- the general path's table and closures, which cost Redis about a
-- quarter of a cold lease's script time. It gives the general path's
-- answers (the steps are the general path's with no grants and no
-- rescale); anything else falls through to it.
if (op == 'lease' or op == 'return') and not graw and (ARGV[12] or '') == '' and rate >= 1 and per >= 1 and burst >= 1 then
  local level, carry, last, born, spill, owed, created
  if not raw then
    level, carry, last, born, spill, owed, created = burst, 0, now, now, 0, 0, 1
  else
    local l, c, la, v, b, r, p, bo, sp, ow =
      string.match(raw, '^(%-?%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
    if l and v == ARGV[7] and b == ARGV[6] and r == ARGV[4] and p == ARGV[5] and tonumber(c) < per then
      level, carry, last, born, spill, owed, created =
        tonumber(l), tonumber(c), tonumber(la), tonumber(bo), tonumber(sp), tonumber(ow), 0
    end
  end
  if level then
    if now > last then
      local q, rm = idiv(now - last, per)
      local tk, c2 = idiv(rm * rate + carry, per)
      local tokens
      if q > math.floor((MAXSPILL - tk) / rate) then tokens = MAXSPILL else tokens = q * rate + tk end
      if level >= burst then
        spill = math.min(spill + tokens, MAXSPILL); carry = 0
      elseif tokens >= burst - level then
        spill = math.min(spill + tokens - (burst - level), MAXSPILL); level = burst; carry = 0
      else
        level = level + tokens; carry = c2
      end
      last = now
    end
    if level >= 0 then owed = 0 elseif owed > -level then owed = -level end
    local function wait(from, to)
      if to <= from then return 0 end
      local q, r = idiv(to - from, rate)
      return q * per + cdiv(r * per - carry, rate)
    end
    local granted, delay, retry = 0, 0, 0
    if op == 'return' then
      level = level + n
      if level >= burst then level = burst; carry = 0 end
    else
      if level >= n then granted = n
      elseif level >= minn then granted = level
      else
        local d, dneed = wait(level - n, 0), wait(level - need, 0)
        if maxdelay > 0 and d <= maxdelay then granted = n; delay = d
        elseif level >= need then granted = level
        elseif maxdelay > 0 and dneed <= maxdelay then granted = need; delay = dneed
        else retry = dneed end
      end
      level = level - granted
    end
    local reset = wait(level, burst)
    redis.call('SET', KEYS[1], format('%d %d %d %d %d %d %d %d %d %d',
      level, carry, last, version, burst, rate, per, born, spill, owed), 'PX', math.floor(reset / 1000 + 0.5) + margin)
    local remaining = level
    if remaining < 0 then remaining = 0 end
    return {granted, delay, remaining, retry, reset, now, version, 0, created, 0, 0, born, spill}
  end
end

local floor = tonumber(ARGV[9])
local holder = ARGV[12] or ''
local running = tonumber(ARGV[13] or '0')
local term = tonumber(ARGV[14] or '0')
local maxholders = tonumber(ARGV[15] or '0')
local gburst = tonumber(ARGV[16] or '0')
local spent = tonumber(ARGV[17] or '0')
local markborn = tonumber(ARGV[18] or '0')
local markspill = tonumber(ARGV[19] or '0')
local keep = tonumber(ARGV[21] or '0')
local seq = tonumber(ARGV[22] or '0')
local spend = tonumber(ARGV[23] or '0')

local grants, gfrac = {}, 0
if graw then
  local f, rest = string.match(graw, '^(%d+)(.*)$')
  if not f or tonumber(f) >= G then return redis.error_reply('LEASEHOLD_CORRUPT grants record') end
  gfrac = tonumber(f)
  local total = 0
  for part in string.gmatch(rest, '|([^|]*)') do
    local id, gs, gb, ge, gw, gk, gq = string.match(part, '^(%S+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
    if not id then
      id, gs, gb, ge, gw = string.match(part, '^(%S+) (%d+) (%d+) (%d+) (%d+)$')
      gk, gq = '0', '0'
    end
    if not id then return redis.error_reply('LEASEHOLD_CORRUPT grants record') end
    grants[#grants + 1] = {id = id, s = tonumber(gs), b = tonumber(gb), exp = tonumber(ge), w = tonumber(gw),
      k = tonumber(gk), q = tonumber(gq)}
    total = total + tonumber(gs)
  end
  if total > G then return redis.error_reply('LEASEHOLD_CORRUPT grants record') end
  table.sort(grants, function(a, b) return a.exp < b.exp end)
end
-- gsum returns the records' total share, and their bursts and stock,
-- which the bucket's cap leaves out.
local function gsum()
  local S, B = 0, 0
  for _, g in ipairs(grants) do S = S + g.s; B = B + g.b + g.k end
  return S, B
end
-- flows counts the records of capacity grants (a holder with a want).
local function flows()
  local c = 0
  for _, g in ipairs(grants) do if g.w > 0 then c = c + 1 end end
  return c
end
local function findrec(id)
  for i, g in ipairs(grants) do if g.id == id then return g, i end end
end

local s = {}
local function waitfor(from, to)
  if to <= from then return 0 end
  local q, r = idiv(to - from, s.rate)
  return q * s.per + cdiv(r * s.per - s.carry, s.rate)
end
-- netwait is waitfor at the rate the live grants leave, as if they stay
-- (-1: they leave nothing); future-dated tokens are never early when a
-- grant ends sooner.
local function netwait(from, to)
  if #grants == 0 then return waitfor(from, to) end
  if to <= from then return 0 end
  local S = gsum()
  local r, p = s.rate * (G - S), s.per * G
  if r <= 0 then return -1 end
  local q, rm = idiv(to - from, r)
  return q * p + cdiv(rm * p - (s.carry * G + gfrac), r)
end
-- seg refills elapsed µs at r tokens every p µs up to cap from carry c,
-- and returns the new carry.
local function seg(elapsed, r, p, cap, c)
  if r <= 0 then
    if s.level >= cap then return 0 end
    return c
  end
  local q, rm = idiv(elapsed, p)
  local tk, c2 = idiv(rm * r + c, p)
  local tokens
  if q > math.floor((MAXSPILL - tk) / r) then tokens = MAXSPILL else tokens = q * r + tk end
  if s.level >= cap then
    s.spill = math.min(s.spill + tokens, MAXSPILL)
    return 0
  end
  if tokens >= cap - s.level then
    s.spill = math.min(s.spill + tokens - (cap - s.level), MAXSPILL)
    s.level = cap
    return 0
  end
  s.level = s.level + tokens
  return c2
end
local function refill()
  if now <= s.last then return end
  if #grants == 0 then
    s.carry = seg(now - s.last, s.rate, s.per, s.burst, s.carry)
    s.last = now
    return
  end
  local c = s.carry * G + gfrac
  while #grants > 0 do
    local S, B = gsum()
    local stop = math.min(now, grants[1].exp)
    if stop > s.last then
      c = seg(stop - s.last, s.rate * (G - S), s.per * G, s.burst - B, c)
      s.last = stop
    end
    if grants[1].exp > now then break end
    table.remove(grants, 1)
  end
  s.carry, gfrac = idiv(c, G)
  if #grants == 0 then
    gfrac = 0
    if now > s.last then s.carry = seg(now - s.last, s.rate, s.per, s.burst, s.carry) end
  end
  s.last = now
end

-- clamp keeps the level within the cap the records leave.
local function clamp()
  local _, B = gsum()
  if s.level >= s.burst - B then s.level = s.burst - B; s.carry = 0; gfrac = 0 end
end

local stale = 0
if raw and string.sub(raw, 1, 2) == 'S ' then
  -- A shaped bucket (shapeLua) whose policy went back to one token
  -- bucket: read its first limit as the plain state, a window as a bucket
  -- that has used what the window holds; the rescale below applies.
  local ver, nparts, rest = string.match(raw, '^S (%d+) (%d+)(.*)$')
  local segs = {}
  if rest then for x in string.gmatch(rest, ';([^;]*)') do segs[#segs + 1] = x end end
  local seg = segs[1] or ''
  local f = {}
  for x in string.gmatch(string.sub(seg, 3), '%S+') do f[#f + 1] = tonumber(x) end
  local wsub = 1
  if f[4] and f[4] >= 1 then wsub = math.max(1, math.floor(f[4] / 100)) end
  if not ver or #segs ~= tonumber(nparts) or #segs < 1 then
    return redis.error_reply('LEASEHOLD_CORRUPT bucket holds a value leasehold did not write')
  elseif string.sub(seg, 1, 1) == 'g' and #f == 6 then
    raw = format('%d %d %d %s %d %d %d', f[1], f[2], f[3], ver, f[4], f[5], f[6])
  elseif string.sub(seg, 1, 1) == 'w' and #f >= 5 and f[3] and f[3] >= 1 and f[4] >= 1 and
      #f == 4 + cdiv(f[4], wsub) + cdiv(f[4], 10 * wsub) + 2 then
    local wrate, wper, base, wlast = f[3], f[4], f[1], math.max(now, f[2])
    local lo = idiv(wlast - wper, wsub)
    local u = 0
    for i = 5, #f do if base + i - 5 >= lo then u = u + f[i] end end
    if u > wrate then u = wrate end
    raw = format('%d 0 %d %s %d %d %d', wrate - u, wlast, ver, wrate, wrate, wper)
  else
    return redis.error_reply('LEASEHOLD_CORRUPT bucket holds a value leasehold did not write')
  end
end
local created = 0
if not raw then
  created = 1
  local _, B = gsum()
  s = {level = burst - B, carry = 0, last = now, version = version, burst = burst, rate = rate, per = per,
       born = now, spill = 0, owed = 0}
  gfrac = 0
else
  local level, carry, last, ver, sburst, srate, sper, tail =
    string.match(raw, '^(%-?%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)(.*)$')
  local sborn, sspill, sowed = 0, 0, 0
  if tail and tail ~= '' then
    sborn, sspill, sowed = string.match(tail, '^ (%d+) (%d+) (%d+)$')
    if not sborn then level = nil end
  end
  if not level then return redis.error_reply('LEASEHOLD_CORRUPT bucket holds a value leasehold did not write') end
  s = {level = tonumber(level), carry = tonumber(carry), last = tonumber(last), version = tonumber(ver),
       burst = tonumber(sburst), rate = tonumber(srate), per = tonumber(sper), born = tonumber(sborn), spill = tonumber(sspill),
       owed = tonumber(sowed)}
  if s.rate < 1 or s.per < 1 or s.burst < 1 or s.carry >= s.per then
    return redis.error_reply('LEASEHOLD_CORRUPT bucket state out of range')
  end
  if s.version > version then
    stale = 1
    refill()
  elseif s.version < version or s.burst ~= burst or s.rate ~= rate or s.per ~= per then
    refill()
    -- A new limit ends every grant; stock still held stays counted.
    local kept = {}
    for _, g in ipairs(grants) do
      if g.k > 0 then g.s = 0; g.b = 0; g.w = 0; kept[#kept + 1] = g end
    end
    grants = kept; gfrac = 0
    if s.level >= 0 then
      local used = s.burst - s.level
      if used > burst then used = burst end
      s.level = burst - used
    end
    s.carry = 0; s.version = version; s.burst = burst; s.rate = rate; s.per = per
    clamp()
  else
    refill()
  end
end

if s.level >= 0 then s.owed = 0 elseif s.owed > -s.level then s.owed = -s.level end
local granted, delay, retry, held = 0, 0, 0, 0
if op == 'lease' then
  local mine, late
  if holder ~= '' then
    mine = findrec(holder)
    late = mine and seq <= mine.q
    if mine or #grants < maxholders then held = 1 else n = need; minn = need; maxdelay = 0 end
  end
  if stale == 1 or late then
  elseif s.level >= n then granted = n
  elseif s.level >= minn then granted = s.level
  else
    local d = netwait(s.level - n, 0)
    local dneed = netwait(s.level - need, 0)
    if maxdelay > 0 and d >= 0 and d <= maxdelay then granted = n; delay = d
    elseif s.level >= need then granted = s.level
    elseif maxdelay > 0 and dneed >= 0 and dneed <= maxdelay then granted = need; delay = dneed
    elseif dneed >= 0 then retry = dneed
    else retry = math.min(grants[1].exp - now, GRANT_RETRY) end
  end
  s.level = s.level - granted
  if held == 1 and stale == 0 and not late then
    if not mine then
      mine = {id = holder, s = 0, b = 0, exp = 0, w = 0, k = 0, q = 0}
      grants[#grants + 1] = mine
    end
    mine.k = keep + granted; mine.q = seq
    if delay == 0 then mine.k = mine.k - math.min(granted, spend) end
    if mine.k > 0 and now + delay + term > mine.exp then mine.exp = now + delay + term end
    table.sort(grants, function(a, b) return a.exp < b.exp end)
    clamp()
  end
  if late or stale == 1 then held = 0 end
elseif op == 'return' and holder ~= '' then
  local mine = findrec(holder)
  if mine and running == 1 then
    -- A release (ARGV[13] 1): the holder holds nothing more.
    if mine.q <= seq then mine.k = 0 end
  elseif mine and mine.q == seq then
    mine.k = mine.k - n
    if mine.k < 0 then mine.k = 0 end
  end
  s.level = s.level + n
  clamp()
elseif op == 'return' then
  local _, B = gsum()
  s.level = s.level + n
  if s.level >= s.burst - B then s.level = s.burst - B; s.carry = 0; gfrac = 0 end
elseif op == 'debit' then
  local charge = n
  if markborn ~= 0 and markborn == s.born and spent > 0 then
    local avail = s.spill - markspill
    if avail < 0 then avail = 0 end
    local forgiven = math.min(spent, avail)
    s.spill = s.spill - forgiven
    charge = spent - forgiven
  end
  s.level = s.level - charge
  if s.level < floor then s.level = floor end
  if markborn ~= 0 and markborn == s.born then
    s.owed = math.min(s.owed + charge, math.max(0 - s.level, 0))
  end
elseif op == 'grant' then
  local mine = findrec(holder)
  if stale == 0 and s.rate * s.per <= MAX_GRANT_RATE_PER and ((mine and mine.w > 0) or flows() < maxholders) then
    local S, B = gsum()
    -- Proportional share (Doorman): wants that fit are met; past
    -- capacity, a want up to the equal share is met and the spare goes to
    -- the rest in proportion to what they want beyond it.
    local wants, sumw = {}, 0
    for _, g in ipairs(grants) do
      if g ~= mine and g.w > 0 then wants[#wants + 1] = g.w; sumw = sumw + g.w end
    end
    wants[#wants + 1] = n; sumw = sumw + n
    local alloc = n
    if sumw > G then
      local e = math.floor(G / #wants)
      if n > e then
        local spare, excess = G, 0
        for _, w in ipairs(wants) do
          if w <= e then spare = spare - w else spare = spare - e; excess = excess + w - e end
        end
        alloc = e + math.floor(spare * (n - e) / excess)
      end
    end
    if not mine then
      -- A holder without a share yet is kept, so that its want counts
      -- when the others renew.
      mine = {id = holder, s = 0, b = 0, exp = 0, w = 0, k = 0, q = 0}
      grants[#grants + 1] = mine
    end
    local cur = mine.s
    local offer = math.min(alloc, G - (S - cur))
    -- Future-dated tokens or debt are out, timed at the rate the grants
    -- leave: no share may rise above what the holder runs at until they
    -- are paid.
    local base = math.min(running, cur)
    if offer > base and s.level < 0 then offer = base end
    -- While debits' debt is out, half the rate goes to paying it.
    local half = math.floor(alloc / 2)
    if offer > half and s.owed > math.floor(s.burst / 8) then offer = half end
    local counted = math.max(offer, math.min(running, cur))
    -- A holder asking for less burst than it has gave the rest up
    -- before it asked: the room is the bucket's again. The grant's
    -- burst grows to what was asked while the grants' bursts fit Burst;
    -- the tokens it takes from the level are the holder's.
    if gburst > 0 and gburst < mine.b then B = B - (mine.b - gburst); mine.b = gburst end
    local grow = math.min(gburst - mine.b, s.burst - B)
    local tokens = 0
    if grow > 0 then
      tokens = math.min(grow, math.max(s.level, 0))
      s.level = s.level - tokens
      mine.b = mine.b + grow
    end
    if mine.b < 1 then
      -- No burst left to give: a share could not be spent.
      offer = 0; counted = 0
    end
    mine.s = counted; mine.w = n
    if now + term > mine.exp then mine.exp = now + term end
    granted = offer; delay = mine.b; retry = tokens
  end
elseif op == 'ungrant' then
  local g, i = findrec(holder)
  if g then
    -- Its stock, if any, stays counted until reported or its term.
    s.level = s.level + math.min(n, g.b)
    g.s = 0; g.b = 0; g.w = 0
    if g.k == 0 then table.remove(grants, i) end
  end
  clamp()
else
  return redis.error_reply('LEASEHOLD_BADOP ' .. tostring(op))
end

local live = {}
for _, g in ipairs(grants) do
  if g.s > 0 or g.b > 0 or g.w > 0 or g.k > 0 then live[#live + 1] = g end
end
grants = live
-- The key outlives every grant: absent means full, and full is only
-- true once the grants are gone.
local reset = waitfor(s.level, s.burst)
local maxexp = now
for _, g in ipairs(grants) do if g.exp > maxexp then maxexp = g.exp end end
reset = reset + (maxexp - now)
local ttl = math.floor(reset / 1000 + 0.5) + margin
redis.call('SET', KEYS[1], format('%d %d %d %d %d %d %d %d %d %d',
  s.level, s.carry, s.last, s.version, s.burst, s.rate, s.per, s.born, s.spill, s.owed), 'PX', ttl)
if #grants > 0 then
  local parts = {format('%d', gfrac)}
  for _, g in ipairs(grants) do
    parts[#parts + 1] = format('%s %d %d %d %d %d %d', g.id, g.s, g.b, g.exp, g.w, g.k, g.q)
  end
  -- As long as the bucket: a refill after an expiry needs the record.
  redis.call('SET', KEYS[2], table.concat(parts, '|'), 'PX', ttl)
elseif graw then
  redis.call('DEL', KEYS[2])
end
local remaining = s.level
if remaining < 0 then remaining = 0 end
local holders = flows()
return {granted, delay, remaining, retry, reset, now, s.version, stale, created, 0, holders, s.born, s.spill, held}
`)

var bucketScript = redis.NewScript(bucketLua)

// heartbeatLua keeps a sorted set of members scored by Redis TIME in ms.
// KEYS[1] the fleet key; ARGV[1] member; ARGV[2] expiry in ms.
// Reply: the number of members heard from within the expiry.
//
// A silence of the whole set longer than half the expiry (Redis paused or
// cut off from every member; see silenceShift) moves every member's score
// forward by the silence less half the expiry, so the heartbeats queued
// behind it do not find their peers expired: the first to land would
// otherwise count itself alone.
var heartbeatLua = `
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = tonumber(ARGV[2])
local top = redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if top[2] then
  local shift = now - tonumber(top[2]) - math.floor(expiry / 2)
  if shift > 0 then
    local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
    for i = 1, #all, 2 do
      redis.call('ZADD', KEYS[1], tonumber(all[i + 1]) + shift, all[i])
    end
  end
end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - expiry)
redis.call('PEXPIRE', KEYS[1], 2 * expiry)
return redis.call('ZCARD', KEYS[1])
`

var heartbeatScript = redis.NewScript(heartbeatLua)

// setPolicyLua stores a policy record if its version is newer.
// KEYS[1] the policy key; ARGV: version, rate, period µs, burst, ttl ms,
// shape. The record is the string "version rate period_us burst", followed
// by a space and the shape (JSON, see PolicyRecord) when there is one.
// Like every key
// leasehold writes it has a TTL, a long one (policyTTL): limiters republish
// the version they enforce when they find no record, so an expired record
// heals itself at the next poll.
// Reply: {applied (0/1), stored record string}; parsePolicyReply reads it.
// Every applied change is PUBLISHed on the policy key's name.
var setPolicyLua = `
if redis.replicate_commands then pcall(redis.replicate_commands) end
local version, rate, period, burst, ttl, shape = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' and cur.err then
  return redis.error_reply('LEASEHOLD_CORRUPT ' .. cur.err)
end
if cur then
  local stored = string.match(cur, '^(%d+) %d+ %d+ %d+$') or string.match(cur, '^(%d+) %d+ %d+ %d+ {')
  if not stored then return redis.error_reply('LEASEHOLD_CORRUPT policy record') end
  if tonumber(stored) >= tonumber(version) then return {0, cur} end
end
local rec = version .. ' ' .. rate .. ' ' .. period .. ' ' .. burst
if shape and shape ~= '' then rec = rec .. ' ' .. shape end
redis.call('SET', KEYS[1], rec, 'PX', ttl)
redis.call('PUBLISH', KEYS[1], rec)
return {1, rec}
`

var setPolicyScript = redis.NewScript(setPolicyLua)

// peekLua reads a bucket without changing it: the raw state, the server's
// TIME and the key's remaining TTL, in one atomic call.
// KEYS[1] the bucket key. Reply: {state or false, seconds, microseconds,
// pttl}.
var peekLua = `
local raw = redis.pcall('GET', KEYS[1])
if type(raw) == 'table' and raw.err then
  return redis.error_reply('LEASEHOLD_CORRUPT ' .. raw.err)
end
local t = redis.call('TIME')
return {raw, t[1], t[2], redis.call('PTTL', KEYS[1])}
`

var peekScript = redis.NewScript(peekLua)

// shapeLua is a shaped bucket: several limits on one key, each a token
// bucket or a sliding window, decided together in one atomic call.
// applyShape in shape.go is its Go twin; keep the two in step.
//
// KEYS[1]  the bucket key
// ARGV[1]  op: "lease", "return" or "debit"
// ARGV[2]  n     ARGV[3] min (unused: shapes never future-date)
// ARGV[4]  need  ARGV[5] version
// ARGV[6]  floor: the lowest level debt may take a bucket to (-maxDebt)
// ARGV[7]  margin: ms a key outlives its time to empty/full
// ARGV[8]  hold: µs after a lease its tokens may be spent
// ARGV[9]  since: µs of store time of the earliest grant a return gives
//
//	back (0: none)
//
// ARGV[10] the number of limits k, then k times: kind ("g" bucket, "w"
//
//	window), rate, per (µs; a bucket's in lowest terms, a window's
//	period as given), burst
//
// State, a string: "S version k" then one ";"-separated part per limit:
//
//	g level carry last burst rate per      (as bucketLua's state)
//	w base last rate per c1 ... cM         (sub-window counters)
//
// A window of period per is cut in sub-windows of sub = max(1,
// floor(per/100)) µs (WindowSlots); counter ci holds the tokens of
// sub-window base+i-1, which count until (base+i)·sub + per. A lease's
// tokens go in the sub-window of now + hold (hold ≤ per/10), the last
// moment they may be spent, so every window that could see them spent
// counts them. M = ceil(per/sub) + ceil(per/(10·sub)) + 2 is fixed by
// the period, a counter holds at most the rate, and counters are written
// zero-padded to the rate's digits, so the key's size does not depend on
// traffic.
//
// A lease takes the same tokens from every part: n if all have them, else
// the fewest any part has if that covers need, else nothing, with the
// longest wait for need. Reply: bucketLua's nine fields, then binding
// (0-based index of the limit that decided).
var shapeLua = luaPrelude + `
local op = ARGV[1]
local n = tonumber(ARGV[2])
local need = tonumber(ARGV[4])
local version = tonumber(ARGV[5])
local floor = tonumber(ARGV[6])
local margin = tonumber(ARGV[7])
local hold = tonumber(ARGV[8])
local since = tonumber(ARGV[9])
local k = tonumber(ARGV[10])
local maxdebt = -floor

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- token bucket parts, as in bucketLua
local function gwait(p, from, to)
  if to <= from then return 0 end
  local q, r = idiv(to - from, p.rate)
  return q * p.per + cdiv(r * p.per - p.carry, p.rate)
end
local function grefill(p)
  if now <= p.last then return end
  local elapsed = now - p.last
  p.last = now
  if p.level >= p.burst then p.carry = 0; return end
  local q, r = idiv(elapsed, p.per)
  if q >= cdiv(p.burst - p.level, p.rate) then p.level = p.burst; p.carry = 0; return end
  local tk, c = idiv(r * p.rate + p.carry, p.per)
  p.level = p.level + q * p.rate + tk
  p.carry = c
  if p.level >= p.burst then p.level = p.burst; p.carry = 0 end
end

-- window parts
local function wnew(rate, per, at)
  local w = {window = true, rate = rate, per = per, last = at, c = {}}
  w.sub = math.max(1, math.floor(per / 100))
  w.m = cdiv(per, w.sub) + cdiv(per, 10 * w.sub) + 2
  for i = 1, w.m do w.c[i] = 0 end
  w.base = idiv(at - per, w.sub)
  return w
end
local function wshift(w)
  if now <= w.last then return end
  w.last = now
  local lo = idiv(now - w.per, w.sub)
  local d = lo - w.base
  if d <= 0 then return end
  for i = 1, w.m do
    local j = i + d
    if j <= w.m then w.c[i] = w.c[j] else w.c[i] = 0 end
  end
  w.base = lo
end
local function wsum(w)
  local s = 0
  for i = 1, w.m do s = s + w.c[i] end
  return s
end
local function wslot(w, at) -- 1-based; below 1 once that sub-window has left
  local i = idiv(at, w.sub) - w.base + 1
  if i > w.m then i = w.m end
  return i
end
local function wwait(w, kk)
  local excess = wsum(w) + kk - w.rate
  if excess <= 0 then return 0 end
  local dropped = 0
  for i = 1, w.m do
    dropped = dropped + w.c[i]
    if dropped >= excess then return (w.base + i) * w.sub + w.per - w.last end
  end
  return w.per
end
local function wreset(w)
  for i = w.m, 1, -1 do
    if w.c[i] > 0 then return (w.base + i) * w.sub + w.per - w.last end
  end
  return 0
end

local function avail(p)
  if p.window then
    local a = p.rate - wsum(p)
    if a < 0 then a = 0 end
    return a
  end
  return p.level
end
local function used(p)
  if p.window then return wsum(p) end
  return p.burst - p.level
end
local function fresh(l, u)
  if l.kind == 'w' then
    local w = wnew(l.rate, l.per, now)
    if u > 0 then w.c[wslot(w, now)] = math.min(u, w.rate) end
    return w
  end
  if u < 0 then u = 0 end
  if u > l.burst then u = l.burst end
  return {level = l.burst - u, carry = 0, last = now, burst = l.burst, rate = l.rate, per = l.per}
end
local function same(p, l)
  if p.window then return l.kind == 'w' and p.rate == l.rate and p.per == l.per end
  return l.kind == 'g' and p.rate == l.rate and p.per == l.per and p.burst == l.burst
end
local function rescale(p, l)
  if not p.window and l.kind == 'g' then
    if p.level >= 0 then
      local u = p.burst - p.level
      if u > l.burst then u = l.burst end
      p.level = l.burst - u
    end
    p.carry = 0; p.burst = l.burst; p.rate = l.rate; p.per = l.per
    return p
  elseif p.window and l.kind == 'w' and p.per == l.per then
    p.rate = l.rate
    return p
  elseif p.window and l.kind == 'w' then
    local w = fresh(l, 0)
    local last = wreset(p)
    if last > 0 then
      local i = wslot(w, now + last - p.per - 1)
      if i < 1 then i = 1 end
      w.c[i] = math.min(wsum(p), w.rate)
    end
    return w
  end
  return fresh(l, used(p))
end

local ls = {}
for i = 1, k do
  local a = 10 + (i - 1) * 4
  ls[i] = {kind = ARGV[a + 1], rate = tonumber(ARGV[a + 2]), per = tonumber(ARGV[a + 3]), burst = tonumber(ARGV[a + 4])}
end

local raw = redis.pcall('GET', KEYS[1])
if type(raw) == 'table' and raw.err then
  return redis.error_reply('LEASEHOLD_CORRUPT ' .. raw.err)
end
local bad = 'LEASEHOLD_CORRUPT bucket holds a value leasehold did not write'
local created, stale = 0, 0
local sver, parts = version, {}
if not raw then
  created = 1
  for i = 1, k do parts[i] = fresh(ls[i], 0) end
else
  if string.sub(raw, 1, 2) == 'S ' then
    local ver, nparts, rest = string.match(raw, '^S (%d+) (%d+)(.*)$')
    if not ver then return redis.error_reply(bad) end
    sver = tonumber(ver)
    for seg in string.gmatch(rest, ';([^;]*)') do
      local kind = string.sub(seg, 1, 1)
      local f = {}
      for x in string.gmatch(string.sub(seg, 3), '%S+') do f[#f + 1] = tonumber(x) end
      local p
      if kind == 'g' and #f == 6 then
        p = {level = f[1], carry = f[2], last = f[3], burst = f[4], rate = f[5], per = f[6]}
        if not p.rate or p.rate < 1 or p.per < 1 or p.burst < 1 or p.carry >= p.per then return redis.error_reply(bad) end
      elseif kind == 'w' and #f >= 5 then
        p = wnew(f[3], f[4], f[2])
        p.base = f[1]
        if not p.rate or p.rate < 1 or #f ~= 4 + p.m then return redis.error_reply(bad) end
        for i = 1, p.m do p.c[i] = f[4 + i] end
      else
        return redis.error_reply(bad)
      end
      parts[#parts + 1] = p
    end
    if #parts ~= tonumber(nparts) or #parts < 1 then return redis.error_reply(bad) end
  else
    local level, carry, last, ver, sburst, srate, sper, tail =
      string.match(raw, '^(%-?%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)(.*)$')
    -- A plain bucket's born and spill, if any, do not carry over.
    if tail and tail ~= '' and not string.match(tail, '^ %d+ %d+ %d+$') then level = nil end
    if not level then return redis.error_reply(bad) end
    sver = tonumber(ver)
    parts[1] = {level = tonumber(level), carry = tonumber(carry), last = tonumber(last), burst = tonumber(sburst),
      rate = tonumber(srate), per = tonumber(sper)}
    local p = parts[1]
    if p.rate < 1 or p.per < 1 or p.burst < 1 or p.carry >= p.per then
      return redis.error_reply('LEASEHOLD_CORRUPT bucket state out of range')
    end
  end
  for i = 1, #parts do
    if parts[i].window then wshift(parts[i]) else grefill(parts[i]) end
  end
  if sver > version then
    stale = 1
  else
    local match = #parts == k
    if match then
      for i = 1, k do if not same(parts[i], ls[i]) then match = false end end
    end
    if sver < version or not match then
      local np = {}
      for i = 1, k do
        if parts[i] then np[i] = rescale(parts[i], ls[i]) else np[i] = fresh(ls[i], 0) end
      end
      parts = np
      sver = version
    end
  end
end

local granted, retry, binding = 0, 0, 0
if op == 'lease' then
  if stale == 0 then
    local least = avail(parts[1])
    for i = 2, #parts do
      local a = avail(parts[i])
      if a < least then least = a; binding = i - 1 end
    end
    if least >= n then granted = n
    elseif least >= need then granted = least
    else
      for i = 1, #parts do
        local p, w = parts[i], 0
        if p.window then w = wwait(p, need) else w = gwait(p, p.level - need, 0) end
        if w > retry then retry = w; binding = i - 1 end
      end
    end
    if granted > 0 then
      for i = 1, #parts do
        local p = parts[i]
        if p.window then
          local s = wslot(p, p.last + hold)
          p.c[s] = p.c[s] + granted
        else p.level = p.level - granted end
      end
    end
  end
elseif op == 'return' then
  for i = 1, #parts do
    local p = parts[i]
    if p.window then
      if since > 0 then
        local s = wslot(p, since + hold)
        if s >= 1 then
          p.c[s] = p.c[s] - n
          if p.c[s] < 0 then p.c[s] = 0 end
        end
      end
    else
      p.level = p.level + n
      if p.level >= p.burst then p.level = p.burst; p.carry = 0 end
    end
  end
elseif op == 'debit' then
  for i = 1, #parts do
    local p = parts[i]
    if p.window then
      local s = wslot(p, p.last)
      p.c[s] = math.min(p.c[s] + n, p.rate)
    else
      p.level = p.level - n
      if p.level < floor then p.level = floor end
    end
  end
else
  return redis.error_reply('LEASEHOLD_BADOP ' .. tostring(op))
end

local remaining, reset = avail(parts[1]), 0
local out = {format('S %d %d', sver, #parts)}
for i = 1, #parts do
  local p = parts[i]
  local a, r = avail(p), 0
  if a < remaining then remaining = a end
  if p.window then
    r = wreset(p)
    local seg = {format('w %d %d %d %d', p.base, p.last, p.rate, p.per)}
    local cf = '%0' .. #format('%d', p.rate) .. 'd'
    for j = 1, p.m do seg[j + 1] = format(cf, p.c[j]) end
    out[i + 1] = table.concat(seg, ' ')
  else
    r = gwait(p, p.level, p.burst)
    out[i + 1] = format('g %d %d %d %d %d %d', p.level, p.carry, p.last, p.burst, p.rate, p.per)
  end
  if r > reset then reset = r end
end
local ttl = math.floor(reset / 1000 + 0.5) + margin
redis.call('SET', KEYS[1], table.concat(out, ';'), 'PX', ttl)
if remaining < 0 then remaining = 0 end
return {granted, 0, remaining, retry, reset, now, sver, stale, created, binding}
`

var shapeScript = redis.NewScript(shapeLua)

// weighLua keeps a hash of region -> "weight deadline_ms" by Redis TIME.
// KEYS[1] the world key; ARGV[1] region; ARGV[2] weight; ARGV[3] expiry ms.
// Reply: the sum of the live weights.
var weighLua = `
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = tonumber(ARGV[3])
local kind = redis.pcall('TYPE', KEYS[1])
if type(kind) == 'table' and kind.err then return redis.error_reply('LEASEHOLD_CORRUPT ' .. kind.err) end
if kind.ok ~= 'hash' and kind.ok ~= 'none' then
  return redis.error_reply('LEASEHOLD_CORRUPT world key is a ' .. kind.ok)
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. (now + expiry))
local all = redis.call('HGETALL', KEYS[1])
local sum = 0
for i = 1, #all, 2 do
  local w, deadline = string.match(all[i + 1], '^(%d+) (%d+)$')
  if not w or tonumber(deadline) <= now then
    redis.call('HDEL', KEYS[1], all[i])
  else
    sum = sum + tonumber(w)
  end
end
redis.call('PEXPIRE', KEYS[1], 2 * expiry)
return sum
`

var weighScript = redis.NewScript(weighLua)
