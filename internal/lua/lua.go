// Package lua holds what every Lua script of leasehold's starts with.
package lua

// Prelude starts every script that reads TIME: effects replication where the
// server needs it asked for (TIME makes a script non-deterministic), and
// exact integer division on doubles. idiv is floor division with a
// non-negative remainder, corrected for the rounding of the float
// division; cdiv rounds up.
//
// format is string.format for records of whole numbers below 2^53,
// written with %d (and %0Nd): Lua 5.1 casts a %d argument to C long, which
// holds them exactly on every 64-bit Unix server and formats them in half
// the time of %.0f (a bucket state's ten numbers: 1.6–1.8 µs against
// 3.6–4.1 µs in a loop in Redis 7.0; a lease call's script, 10% faster).
// Where long is narrower (32-bit servers, Windows
// ports) the check below fails and format is format_f, which writes %.0f
// instead: the same text (but "-0" for a negative zero), slower.
const Prelude = `
if redis.replicate_commands then pcall(redis.replicate_commands) end

local function format_f(f, ...)
  return string.format((string.gsub(f, '%%(0?%d*)d', '%%%1.0f')), ...)
end
local format = string.format
if string.format('%d %d', 2^53 - 1, -2^53) ~= '9007199254740991 -9007199254740992' then
  format = format_f
end

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
`

// Record reads a record kept as one string, "TAG v1 v2 …", of whole
// numbers: read_record(KEYS[1], tag, names) returns the record as a table
// by name (all 0 when the key is absent), or an error reply, ready to
// return, for a key that holds anything else. It also sets now, the
// server's TIME in µs.
const Record = `
local now
local function read_record(key, tag, names, fewest)
  local raw = redis.pcall('GET', key)
  if type(raw) == 'table' and raw.err then
    return nil, redis.error_reply('LEASEHOLD_CORRUPT ' .. raw.err)
  end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local s = {}
  for _, name in ipairs(names) do s[name] = 0 end
  if not raw then return s end
  local f = {}
  for v in string.gmatch(raw, '%S+') do f[#f + 1] = v end
  if #f > #names + 1 or #f < (fewest or #names) + 1 or f[1] ~= tag then
    return nil, redis.error_reply('LEASEHOLD_CORRUPT ' .. tag .. ' record')
  end
  for i, name in ipairs(names) do
    local v = tonumber(f[i + 1] or '0')
    if not v or v ~= math.floor(v) then
      return nil, redis.error_reply('LEASEHOLD_CORRUPT ' .. tag .. ' record')
    end
    s[name] = v
  end
  return s
end
`
