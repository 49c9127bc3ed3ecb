package tiered

import (
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
// State, a string: "P level exp claim down ver rem full since used at"
// (poolState, in µs of TIME). read writes nothing.
//
// Reply: {granted, claimed, now, since, level, exp, claim, down, ver, rem,
// full, since, used, at}, read by parsePoolReply.
var poolLua = lua.Prelude + lua.Record + `
local names = {'level', 'exp', 'claim', 'down', 'ver', 'rem', 'full', 'since', 'used', 'at'}
local s, bad = read_record(KEYS[1], 'P', names)
if not s then return bad end
local op = ARGV[1]
local a = {}
for i = 3, #ARGV do a[#a + 1] = tonumber(ARGV[i]) end
local granted, claimed, since = 0, 0, 0
if op == 'take' then
  -- a: n, need, hold (-1: never lapse), low water, claim, lead, version
  local usable = s.level
  if a[3] >= 0 and now + a[3] > s.exp then usable = 0 end
  if a[7] < s.ver then
  elseif usable >= a[1] then granted = a[1]
  elseif usable >= a[2] then granted = usable end
  s.level = s.level - granted
  usable = usable - granted
  if granted > 0 then s.used = s.used + granted else s.used = s.used + a[1] end
  local low = a[4]
  if s.at > 0 and now > s.at then
    local q = cdiv(s.used * a[6], now - s.at)
    if q > low then low = q end
  end
  if usable < low and now >= s.claim then s.claim = now + a[5]; claimed = 1 end
elseif op == 'put' then
  -- a: n, exp, version, parent remaining, parent reset (-1: window), since
  local window = a[5] < 0
  if a[3] > s.ver and s.ver ~= 0 and s.level > 0 then
    if not window then granted = s.level end
    s.level = 0
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
  s.down = 0
  if a[3] > s.ver then s.ver = a[3] end
  s.rem = a[4]
  s.used = 0
  s.at = now
elseif op == 'fail' then
  s.down = now
elseif op == 'give' then
  -- a: n, since (0: bucket pool)
  if a[2] == 0 or (a[2] >= s.at and now < s.exp) then s.level = s.level + a[1] end
elseif op == 'drain' then
  if s.exp > 0 and now >= s.exp then granted = s.level; since = s.since; s.level = 0 end
elseif op ~= 'read' then
  return redis.error_reply('ERR leasehold pool: unknown op ' .. tostring(op))
end
local out = {granted, claimed, now, since}
local vals = {}
for _, name in ipairs(names) do out[#out + 1] = s[name]; vals[#vals + 1] = string.format('%.0f', s[name]) end
if op ~= 'read' then
  redis.call('SET', KEYS[1], 'P ' .. table.concat(vals, ' '), 'PX', ARGV[2])
end
return out
`

var poolScript = redis.NewScript(poolLua)

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
redis.call('SET', KEYS[1], string.format('R %.0f %.0f %.0f %.0f', s.world, s.own, s.claim, s.down), 'PX', ARGV[2])
return {claimed, now, s.world, s.own, s.claim, s.down}
`

var regionScript = redis.NewScript(regionLua)
