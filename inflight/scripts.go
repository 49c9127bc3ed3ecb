package inflight

import "github.com/redis/go-redis/v9"

// slotsLua keeps a key's slots in a hash, holder → "count expiry_µs
// want", by Redis TIME; want is the holding the holder last asked for, so
// that holders learn that others wait and give back what they hold beyond
// their use. The field "#v" (no holder name has a '#') holds "version
// limit": the newest policy version that set the key's limit, which
// decides a call under an older one. slotsFor in store.go is its Go twin;
// keep the two in step. KEYS[1] the slots key; ARGV[1] holder; ARGV[2]
// hold; ARGV[3] limit; ARGV[4] term in µs; ARGV[5] policy version.
// Reply: {held, in use, waiting, version, limit}.
var slotsLua = `
if redis.replicate_commands then pcall(redis.replicate_commands) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local holder, want, limit, term, version = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local all = redis.pcall('HGETALL', KEYS[1])
if all.err then return redis.error_reply('LEASEHOLD_CORRUPT ' .. all.err) end
local others, waiting, mine, last, stored = 0, 0, 0, now, -1
for i = 1, #all, 2 do
  if all[i] == '#v' then
    local v, l = string.match(all[i + 1], '^(%d+) (%d+)$')
    if not v then return redis.error_reply('LEASEHOLD_CORRUPT slots version') end
    stored = tonumber(v)
    if stored >= version then version, limit = stored, tonumber(l) end
  else
    local c, e, w = string.match(all[i + 1], '^(%d+) (%d+) (%d+)$')
    if not c then return redis.error_reply('LEASEHOLD_CORRUPT slots record') end
    c, e, w = tonumber(c), tonumber(e), tonumber(w)
    if e <= now then
      redis.call('HDEL', KEYS[1], all[i])
    elseif all[i] == holder then
      mine = c
    else
      others = others + c
      if w > c then waiting = waiting + w - c end
      if e > last then last = e end
    end
  end
end
if version > stored then redis.call('HSET', KEYS[1], '#v', string.format('%.0f %.0f', version, limit)) end
local held = want
if want > mine then held = math.max(mine, math.min(want, limit - others)) end
if held > 0 or want > 0 then
  redis.call('HSET', KEYS[1], holder, string.format('%.0f %.0f %.0f', held, now + term, want))
  if now + term > last then last = now + term end
else
  redis.call('HDEL', KEYS[1], holder)
end
redis.call('PEXPIRE', KEYS[1], math.ceil((last - now) / 1000) + 1000)
return {held, others + held, waiting, version, limit}
`

var slotsScript = redis.NewScript(slotsLua)

// policyLua keeps a concurrency limit's policy record, a string that
// starts with its version: ARGV[1] a record to store if its version
// (ARGV[2]) is newer than the stored one's ("" only reads); ARGV[3] its
// TTL in ms. A record someone else overwrote is replaced by a newer one.
// Reply: the record after the call, "" if none. memoryBackend.policy in
// store.go is its Go twin.
var policyLua = `
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' and cur.err then return redis.error_reply('LEASEHOLD_CORRUPT ' .. cur.err) end
if ARGV[1] ~= '' then
  local v = cur and tonumber(string.match(cur, '^(%d+) '))
  if not v or v < tonumber(ARGV[2]) then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
    cur = ARGV[1]
  end
end
return cur or ''
`

var policyScript = redis.NewScript(policyLua)
