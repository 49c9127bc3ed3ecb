// Package lua holds what every Lua script of leasehold's starts with.
package lua

// Prelude starts every script that reads TIME: effects replication where the
// server needs it asked for (TIME makes a script non-deterministic), and
// exact integer division on doubles. idiv is floor division with a
// non-negative remainder, corrected for the rounding of the float
// division; cdiv rounds up.
const Prelude = `
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
