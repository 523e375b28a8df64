"""The Lua scripts of :mod:`gateway.tenancy.limits_store`, one per operation; each runs
atomically in Redis. Buckets are hashes ``{l: level, t: stamp in ms}`` refilled from the
server's clock (``TIME``); a bucket key expires once it would be full again (absent = full).
"""

_LIB = """
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function level(key, cap, now)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, t = tonumber(v[1]), tonumber(v[2])
  if l == nil or t == nil then return cap end
  if now > t then l = l + (now - t) * cap / 60000 end
  if l > cap then l = cap end
  return l
end
local function save(key, cap, l, now)
  redis.call('HSET', key, 'l', tostring(l), 't', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((cap - l) * 60000 / cap) + 1000)
end
"""

# KEYS: requests, completion, prompt, leases. ARGV: requests, completion tokens, prompt
# tokens per minute (0: none), max concurrent (0: none), lease id, lease TTL (ms).
# Returns {refused (0 none, 1 requests, 2 completion_tokens, 3 prompt_tokens, 4 concurrency),
# wait ms, slots held, request level, completion level, prompt level}.
BEGIN = _LIB + """
local now = now_ms()
local caps = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])}
local need = {1, 0, 1}
local lv = {0, 0, 0}
local maxc = tonumber(ARGV[4])
local held = 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  held = redis.call('ZCARD', KEYS[4])
end
for i = 1, 3 do
  if caps[i] > 0 then lv[i] = level(KEYS[i], caps[i], now) end
end
local refused, wait = 0, 0
if maxc > 0 and held >= maxc then
  refused, wait = 4, 1000
else
  for i = 1, 3 do
    if caps[i] > 0 and lv[i] < need[i] then
      refused, wait = i, (need[i] - lv[i]) * 60000 / caps[i]
      break
    end
  end
end
if refused == 0 then
  if caps[1] > 0 then
    lv[1] = lv[1] - 1
    save(KEYS[1], caps[1], lv[1], now)
  end
  if maxc > 0 then
    local ttl = tonumber(ARGV[6])
    redis.call('ZADD', KEYS[4], now + ttl, ARGV[5])
    redis.call('PEXPIRE', KEYS[4], 2 * ttl)
    held = held + 1
  end
end
return {refused, tostring(wait), held, tostring(lv[1]), tostring(lv[2]), tostring(lv[3])}
"""

# KEYS: prompt, completion, requests buckets, leases. ARGV: per bucket its limit per minute
# (0: none) and what to take, then the lease ids to remove. Debt allowed.
SETTLE = _LIB + """
local now = now_ms()
for i = 1, 3 do
  local cap, n = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  if cap > 0 and n > 0 then save(KEYS[i], cap, level(KEYS[i], cap, now) - n, now) end
end
for i = 7, #ARGV do redis.call('ZREM', KEYS[4], ARGV[i]) end
return 1
"""

# After an outage, one tenant. KEYS: requests, completion, prompt buckets. ARGV: 1 when
# Redis lost its data meanwhile (a restart), then per bucket: limit per minute (0: none),
# what this replica took while on its own, the level the store last gave it refilled to
# now. A bucket Redis lost is set to that level less what this replica took (when another
# replica has not set it first); any other is charged what was taken. Debt allowed.
SYNC = _LIB + """
local now = now_ms()
local lost = ARGV[1] == '1'
for i = 1, 3 do
  local cap, used, mine = tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  if cap > 0 then
    if lost and redis.call('EXISTS', KEYS[i]) == 0 then
      local l = math.min(cap, mine) - used
      if l < cap then save(KEYS[i], cap, l, now) end
    elseif used > 0 then
      save(KEYS[i], cap, level(KEYS[i], cap, now) - used, now)
    end
  end
end
return 1
"""

# KEYS: the replicas (sorted set {replica id: expiry ms}), the data's epoch. ARGV: this
# replica's id, how long its entry lives (ms), an epoch to set if there is none (Redis
# started empty). Returns {replicas present, the epoch}.
PRESENCE = _LIB + """
local now = now_ms()
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
redis.call('SET', KEYS[2], ARGV[3], 'NX')
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2])}
"""

# KEYS: leases. ARGV: lease TTL (ms), lease ids... Returns the slots held.
REFRESH = _LIB + """
local now = now_ms()
local ttl = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + ttl, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * ttl)
return redis.call('ZCARD', KEYS[1])
"""
