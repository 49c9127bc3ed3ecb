package tiered

import (
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/leasehold/leasehold/internal/lua"
)

// poolLua is the pool record in Redis; the poolOp types in pool.go are its
// Go twin, one branch per op with the same steps.
//
// KEYS[1]  the pool key (keys.Pool)
// ARGV[1]  op: take, put, fail, give, drain or read
// ARGV[2]  the record's TTL in ms
// ARGV[3…] the op's arguments, as its encode method writes them
//
// State, a string: "P level exp claim down ver rem full since used at
// gper gat gfrac gexp gcap share renew asks seen bat" (poolState, in µs of
// TIME); a record of the first ten fields (written before grant pools)
// reads with the rest 0. read writes nothing. Every op first accrues a
// grant pool's grant (poolState.accrue).
//
// Reply: {granted, claimed, now, since, ended, then the record's fields},
// read by parsePoolReply.
var poolLua = lua.Prelude + lua.Record + `
local names = {'level', 'exp', 'claim', 'down', 'ver', 'rem', 'full', 'since', 'used', 'at',
  'gper', 'gat', 'gfrac', 'gexp', 'gcap', 'share', 'renew', 'asks', 'seen', 'bat'}
local s, bad = read_record(KEYS[1], 'P', names, 10)
if not s then return bad end
local op = ARGV[1]
local a = {}
for i = 3, #ARGV do a[#a + 1] = tonumber(ARGV[i]) end
local granted, claimed, since, ended = 0, 0, 0, 0
if s.gper > 0 then
  local e = math.min(now, s.gexp)
  if e > s.gat then
    local k = idiv((e - s.gat) * FRAC - s.gfrac, s.gper)
    local g = s.level - s.bat
    if g + k >= s.gcap then
      if s.gcap > g then s.level = s.bat + s.gcap end
      s.gat = e; s.gfrac = 0
    else
      local adv = k * s.gper + s.gfrac
      s.level = s.level + k
      local q, r = idiv(adv, FRAC)
      s.gat = s.gat + q; s.gfrac = r
    end
  end
end
if op == 'take' then
  -- a: n, need, hold (-1: never lapse), low water, claim, lead, version
  local usable = s.level
  local full = s.renew > 0 and s.gcap > 0 and s.level - s.bat >= s.gcap
  if a[3] >= 0 and now + a[3] > s.exp then usable = 0 end
  if a[7] < s.ver then
  elseif usable >= a[1] then granted = a[1]
  elseif usable >= a[2] then granted = usable end
  s.bat = s.bat - math.max(granted - (s.level - s.bat), 0)
  s.level = s.level - granted
  usable = usable - granted
  if granted > 0 then s.used = s.used + granted else s.used = s.used + a[1] end
  s.seen = now
  if s.renew > 0 then
    if a[7] > s.ver then s.gper = 0; s.renew = now end
    local due = now >= s.renew or (full and now >= s.at + a[5]) or (granted == 0 and s.rem > 0)
    if due and now >= s.claim then s.claim = now + a[5]; claimed = 1 end
  else
    local low = a[4]
    if s.at > 0 and now > s.at then
      local q = cdiv(s.used * a[6], now - s.at)
      if q > low then low = q end
    end
    if usable < low and now >= s.claim then s.claim = now + a[5]; claimed = 1 end
  end
elseif op == 'put' then
  -- a: n, exp, version, parent remaining, parent reset (-1: window), since
  local window = a[5] < 0
  if a[3] > s.ver and s.ver ~= 0 and s.level > 0 then
    if not window then granted = s.level end
    s.level = 0
    s.bat = 0
  end
  if not window then
    s.exp = a[2]
    s.full = now + a[5]
  elseif a[1] == 0 then
  else
    if s.level > 0 then granted = s.level; since = s.since end
    s.level = 0
    s.exp = a[2]
    s.since = a[6]
  end
  s.level = s.level + a[1]
  if not window then s.bat = s.bat + a[1] end
  s.down = 0
  if a[3] > s.ver then s.ver = a[3] end
  s.rem = a[4]
  if s.renew == 0 then
    s.used = 0
    s.at = now
  end
elseif op == 'grant' then
  -- a: share, gper, cap, tokens, grant exp, renew, exp, version, parent remaining, parent reset
  if a[8] > s.ver and s.ver ~= 0 and s.level > 0 then granted = s.level; s.level = 0; s.bat = 0 end
  s.level = s.level + a[4]
  if a[2] ~= s.gper or s.gper <= 0 or now >= s.gexp then s.gat = now; s.gfrac = 0 end
  s.gper = a[2]; s.gexp = a[5]; s.gcap = a[3]
  s.share = a[1]; s.renew = a[6]
  if a[6] == 0 then s.gper = 0; s.asks = 0 else s.asks = s.asks + 1 end
  s.exp = a[7]; s.full = now + a[10]
  s.down = 0
  if a[8] > s.ver then s.ver = a[8] end
  s.rem = a[9]
  s.used = 0
  s.at = now
elseif op == 'fail' then
  s.down = now
elseif op == 'give' then
  -- a: n, since (0: bucket pool)
  if a[2] == 0 or (a[2] >= s.at and now < s.exp) then s.level = s.level + a[1] end
  if a[2] == 0 then s.bat = s.bat + a[1] end
elseif op == 'drain' then
  -- a: idle (a grant pool ends its grant only once no take came for it)
  if s.exp > 0 and now >= s.exp and (s.renew == 0 or now >= s.seen + a[1]) then
    if s.renew > 0 then
      ended = 1
      for _, f in ipairs({'gper', 'gat', 'gfrac', 'gexp', 'gcap', 'share', 'renew', 'asks'}) do s[f] = 0 end
    end
    granted = s.level; since = s.since; s.level = 0; s.bat = 0
  end
elseif op ~= 'read' then
  return redis.error_reply('ERR leasehold pool: unknown op ' .. tostring(op))
end
local out = {granted, claimed, now, since, ended}
local vals = {}
for _, name in ipairs(names) do out[#out + 1] = s[name]; vals[#vals + 1] = format('%d', s[name]) end
if op ~= 'read' then
  redis.call('SET', KEYS[1], 'P ' .. table.concat(vals, ' '), 'PX', ARGV[2])
end
return out
`

var poolScript = redis.NewScript(strings.ReplaceAll(poolLua, "FRAC", strconv.Itoa(fracUnits)))

// regionLua is the region record in Redis; the regionOp types in
// region.go are its Go twin.
//
// KEYS[1]  the region key (keys.Region)
// ARGV[1]  op: beat, fail or weigh
// ARGV[2]  the record's TTL in ms
// ARGV[3…] the op's arguments, as its encode method writes them
//
// State, a string: "R world own claim down" (regionState, µs of TIME).
// Reply: {claimed, now, world, own, claim, down}, read by
// parseRegionReply.
var regionLua = lua.Prelude + lua.Record + `
local s, bad = read_record(KEYS[1], 'R', {'world', 'own', 'claim', 'down'})
if not s then return bad end
local op = ARGV[1]
local claimed = 0
if op == 'beat' then
  if now >= s.claim then s.claim = now + tonumber(ARGV[3]); claimed = 1 end
elseif op == 'fail' then
  s.down = now
elseif op == 'weigh' then
  s.world = tonumber(ARGV[3])
  s.own = tonumber(ARGV[4])
  s.down = 0
else
  return redis.error_reply('ERR leasehold region: unknown op ' .. tostring(op))
end
redis.call('SET', KEYS[1], format('R %d %d %d %d', s.world, s.own, s.claim, s.down), 'PX', ARGV[2])
return {claimed, now, s.world, s.own, s.claim, s.down}
`

var regionScript = redis.NewScript(regionLua)
