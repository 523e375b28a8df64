"""Stored responses in Redis (``--responses-store redis://...``), shared by the replicas of a
cluster: a chain started on one replica continues on any other, and survives any replica.

Keys, per tenant ``T`` (the ``{T}`` hash tag keeps a tenant's keys in one Redis Cluster slot,
beside its limits of :mod:`gateway.tenancy.limits_store`)::

    mlxgw:{T}:responses:body   hash {id: entry JSON}
    mlxgw:{T}:responses:used   sorted set {id: last use, ms on the Redis server's clock}
    mlxgw:{T}:responses:size   hash {id: bytes of the entry}
    mlxgw:{T}:responses:bytes  string: the sum of the sizes

Every operation is one Lua script (atomic across replicas): it drops the tenant's entries
unused for the TTL, does its work (a store evicts the least recently used entries past the
bounds; a read moves the entry to the most recently used end) and sets the four keys to
expire after the TTL, so a tenant that stops using the store leaves nothing behind. The TTL
and the bounds are each replica's own settings, sent with each call.

Calls run on worker threads with redis-py's blocking client (a connection pool); each waits
at most ``timeout`` seconds (default :data:`TIMEOUT`) for a connection or a reply and is
retried once (a pooled connection from before a Redis restart is dead), so a Redis that does
not answer costs a call about 2 s. redis-py (``redis>=5``) is imported only when a store is
created.
"""

from __future__ import annotations

from typing import Optional

from gateway.protocols.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, Outcome, check_bounds
from gateway.tenancy.limits_store import redacted

TIMEOUT = 1.0  # seconds a store call waits for each Redis reply (one retry: about 2 s in all)

_LIB = """
if redis.replicate_commands then redis.replicate_commands() end
local body, used, sizes, total = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function drop(id)
  local s = tonumber(redis.call('HGET', sizes, id) or 0) or 0
  redis.call('HDEL', body, id)
  redis.call('HDEL', sizes, id)
  redis.call('ZREM', used, id)
  if s ~= 0 then redis.call('DECRBY', total, s) end
end
local function expire(now, ttl)
  if ttl > 0 then
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', used, '-inf', '(' .. (now - ttl))) do drop(id) end
  end
end
local function stamp(now)
  local top = redis.call('ZRANGE', used, -1, -1, 'WITHSCORES')
  if top[2] and tonumber(top[2]) >= now then return tonumber(top[2]) + 1 end
  return now
end
local function totals()
  local n = redis.call('ZCARD', used)
  local b = tonumber(redis.call('GET', total) or 0) or 0
  if n == 0 and b ~= 0 then redis.call('DEL', total) b = 0 end
  return n, b
end
local function keep(ttl)
  if ttl > 0 then for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end end
end
"""

# ARGV: id, entry, size, max responses, max bytes, TTL ms (0: none).
# Returns {stored (0/1), evicted, count, bytes}.
PUT = _LIB + """
local id, size = ARGV[1], tonumber(ARGV[3])
local maxn, maxb, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now = now_ms()
expire(now, ttl)
drop(id)
if size > maxb then
  local n, b = totals()
  return {0, 0, n, b}
end
redis.call('ZADD', used, stamp(now), id)
redis.call('HSET', body, id, ARGV[2])
redis.call('HSET', sizes, id, size)
redis.call('INCRBY', total, size)
local n, b = totals()
local evicted = 0
while n > maxn or b > maxb do
  local oldest = redis.call('ZRANGE', used, 0, 0)[1]
  if not oldest or oldest == id then break end
  drop(oldest)
  evicted = evicted + 1
  n, b = totals()
end
keep(ttl)
return {1, evicted, n, b}
"""

# ARGV: id, TTL ms (0: none). Returns {found (0/1), count, bytes[, entry]}.
GET = _LIB + """
local id, ttl = ARGV[1], tonumber(ARGV[2])
local now = now_ms()
expire(now, ttl)
local entry = redis.call('HGET', body, id)
if not entry then
  if redis.call('ZSCORE', used, id) then drop(id) end
  local n, b = totals()
  return {0, n, b}
end
redis.call('ZADD', used, stamp(now), id)
keep(ttl)
local n, b = totals()
return {1, n, b, entry}
"""

# ARGV: id. Returns {deleted (0/1), count, bytes}.
DELETE = _LIB + """
local id = ARGV[1]
local had = redis.call('HEXISTS', body, id)
drop(id)
local n, b = totals()
return {had, n, b}
"""


class RedisBackend:
    """Per-tenant LRU tables in the Redis at ``url`` (``redis://``, ``rediss://`` or
    ``unix://``; see the module docstring), bounded by ``max_responses`` and ``max_bytes``
    per tenant; an entry unused for ``ttl`` seconds (None: never) expires. Nothing is
    contacted until the first call.

    Raises:
        ValueError: a bound below 1.
        ImportError: redis-py is not installed.
    """

    blocking = True
    torn_at_open = 0

    def __init__(self, url: str, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl: Optional[float] = None, *, timeout: float = TIMEOUT, prefix: str = "mlxgw"):
        check_bounds(max_responses, max_bytes)
        import redis
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError
        from redis.retry import Retry

        self.url, self.prefix = url, prefix
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._ttl_ms = int(ttl * 1000) if ttl else 0
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 1), retry_on_error=[ConnectionError],
                                            health_check_interval=0)
        self._put = self._client.register_script(PUT)
        self._get = self._client.register_script(GET)
        self._delete = self._client.register_script(DELETE)

    def describe(self) -> str:
        return redacted(self.url)

    def totals(self) -> dict[str, tuple[int, int]]:
        return {}

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self.prefix}:{{{tenant}}}:responses"
        return [f"{base}:body", f"{base}:used", f"{base}:size", f"{base}:bytes"]

    def put(self, tenant: str, rid: str, body: bytes) -> Outcome:
        r = self._put(keys=self._keys(tenant),
                      args=[rid, body, len(body), self.max_responses, self.max_bytes, self._ttl_ms])
        return Outcome(bool(int(r[0])), int(r[2]), int(r[3]), evicted=int(r[1]))

    def get(self, tenant: str, rid: str) -> Outcome:
        r = self._get(keys=self._keys(tenant), args=[rid, self._ttl_ms])
        return Outcome(bool(int(r[0])), int(r[1]), int(r[2]), body=bytes(r[3]) if len(r) > 3 else None)

    def delete(self, tenant: str, rid: str) -> Outcome:
        r = self._delete(keys=self._keys(tenant), args=[rid])
        return Outcome(bool(int(r[0])), int(r[1]), int(r[2]))

    def close(self) -> None:
        self._client.close()
