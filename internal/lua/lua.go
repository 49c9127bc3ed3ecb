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
