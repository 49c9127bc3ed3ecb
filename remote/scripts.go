package remote

import "github.com/redis/go-redis/v9"

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
//
// A lease never refuses while need tokens are there: it grants n, or the
// level if at least min, or n future-dated within maxdelay, or the level
// if at least need, or need future-dated within maxdelay, in that order;
// a refusal's retry is the wait for need, never for n.
//
// State, a string: "level carry last version burst rate per"
//
//	level    whole tokens; negative while future-dated grants or debt are out
//	carry    refill progress toward the next token, in [0, per): a token
//	         arrives each time carry reaches per, and every µs adds rate
//	last     µs of Redis TIME when level was computed
//	version  policy version; burst, rate, per: the limit under it
//
// A newer request version rescales the bucket (tokens used are kept,
// clamped to the new burst); an older one is refused for leases ("stale")
// and applied under the bucket's own limit for returns and debits.
//
// Reply: {granted, delay_us, remaining, retry_us, reset_us, now_us,
// version, stale, created}; created is 1 when the key did not exist (new,
// expired, or evicted by the server).
//
// Errors: "LEASEHOLD_CORRUPT ..." when the key holds a foreign value or
// another type (WRONGTYPE, caught with pcall so every server reports it the
// same way).
var bucketLua = `
if redis.replicate_commands then pcall(redis.replicate_commands) end

local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then q = q - 1; r = r + b elseif r >= b then q = q + 1; r = r - b end
  return q, r
end
local function cdiv(a, b)
  local q, r = idiv(a, b)
  if r > 0 then q = q + 1 end
  return q
end

local op = ARGV[1]
local n = tonumber(ARGV[2])
local minn = tonumber(ARGV[3])
local rate = tonumber(ARGV[4])
local per = tonumber(ARGV[5])
local burst = tonumber(ARGV[6])
local version = tonumber(ARGV[7])
local maxdelay = tonumber(ARGV[8])
local floor = tonumber(ARGV[9])
local margin = tonumber(ARGV[10])
local need = tonumber(ARGV[11])

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local s = {}
local function waitfor(from, to)
  if to <= from then return 0 end
  local q, r = idiv(to - from, s.rate)
  return q * s.per + cdiv(r * s.per - s.carry, s.rate)
end
local function refill()
  if now <= s.last then return end
  local elapsed = now - s.last
  s.last = now
  if s.level >= s.burst then s.carry = 0; return end
  local need = s.burst - s.level
  local q, r = idiv(elapsed, s.per)
  if q >= cdiv(need, s.rate) then s.level = s.burst; s.carry = 0; return end
  local tk, c = idiv(r * s.rate + s.carry, s.per)
  s.level = s.level + q * s.rate + tk
  s.carry = c
  if s.level >= s.burst then s.level = s.burst; s.carry = 0 end
end

local stale = 0
local raw = redis.pcall('GET', KEYS[1])
if type(raw) == 'table' and raw.err then
  return redis.error_reply('LEASEHOLD_CORRUPT ' .. raw.err)
end
local created = 0
if not raw then
  created = 1
  s = {level = burst, carry = 0, last = now, version = version, burst = burst, rate = rate, per = per}
else
  local level, carry, last, ver, sburst, srate, sper =
    string.match(raw, '^(%-?%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+)$')
  if not level then return redis.error_reply('LEASEHOLD_CORRUPT bucket holds a value leasehold did not write') end
  s = {level = tonumber(level), carry = tonumber(carry), last = tonumber(last), version = tonumber(ver),
       burst = tonumber(sburst), rate = tonumber(srate), per = tonumber(sper)}
  if s.rate < 1 or s.per < 1 or s.burst < 1 or s.carry >= s.per then
    return redis.error_reply('LEASEHOLD_CORRUPT bucket state out of range')
  end
  if s.version > version then
    stale = 1
    refill()
  elseif s.version < version or s.burst ~= burst or s.rate ~= rate or s.per ~= per then
    refill()
    if s.level >= 0 then
      local used = s.burst - s.level
      if used > burst then used = burst end
      s.level = burst - used
    end
    s.carry = 0; s.version = version; s.burst = burst; s.rate = rate; s.per = per
  else
    refill()
  end
end

local granted, delay, retry = 0, 0, 0
if op == 'lease' then
  if stale == 1 then
  elseif s.level >= n then granted = n
  elseif s.level >= minn then granted = s.level
  else
    local d = waitfor(s.level - n, 0)
    local dneed = waitfor(s.level - need, 0)
    if maxdelay > 0 and d <= maxdelay then granted = n; delay = d
    elseif s.level >= need then granted = s.level
    elseif maxdelay > 0 and dneed <= maxdelay then granted = need; delay = dneed
    else retry = dneed end
  end
  s.level = s.level - granted
elseif op == 'return' then
  s.level = s.level + n
  if s.level >= s.burst then s.level = s.burst; s.carry = 0 end
elseif op == 'debit' then
  s.level = s.level - n
  if s.level < floor then s.level = floor end
else
  return redis.error_reply('LEASEHOLD_BADOP ' .. tostring(op))
end

local reset = waitfor(s.level, s.burst)
local ttl = math.floor(reset / 1000 + 0.5) + margin
redis.call('SET', KEYS[1], string.format('%.0f %.0f %.0f %.0f %.0f %.0f %.0f',
  s.level, s.carry, s.last, s.version, s.burst, s.rate, s.per), 'PX', ttl)
local remaining = s.level
if remaining < 0 then remaining = 0 end
return {granted, delay, remaining, retry, reset, now, s.version, stale, created}
`

var bucketScript = redis.NewScript(bucketLua)

// heartbeatLua keeps a sorted set of members scored by Redis TIME in ms.
// KEYS[1] the fleet key; ARGV[1] member; ARGV[2] expiry in ms.
// Reply: the number of members heard from within the expiry.
var heartbeatLua = `
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - expiry)
redis.call('PEXPIRE', KEYS[1], 2 * expiry)
return redis.call('ZCARD', KEYS[1])
`

var heartbeatScript = redis.NewScript(heartbeatLua)

// setPolicyLua stores a policy record if its version is newer.
// KEYS[1] the policy key; ARGV: version, rate, period µs, burst, ttl ms.
// The record is the string "version rate period_us burst". Like every key
// leasehold writes it has a TTL, a long one (PolicyTTL): limiters republish
// the version they enforce when they find no record, so an expired record
// heals itself at the next poll.
// Reply: {applied (0/1), stored record string}; parsePolicyReply reads it.
// Every applied change is PUBLISHed on the policy key's name.
var setPolicyLua = `
if redis.replicate_commands then pcall(redis.replicate_commands) end
local version, rate, period, burst, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' and cur.err then
  return redis.error_reply('LEASEHOLD_CORRUPT ' .. cur.err)
end
if cur then
  local stored = string.match(cur, '^(%d+) %d+ %d+ %d+$')
  if not stored then return redis.error_reply('LEASEHOLD_CORRUPT policy record') end
  if tonumber(stored) >= tonumber(version) then return {0, cur} end
end
local rec = version .. ' ' .. rate .. ' ' .. period .. ' ' .. burst
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
