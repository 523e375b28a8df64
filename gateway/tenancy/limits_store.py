"""The tenants' limits shared by every gateway replica, in Redis (``--limits-store URL``).

Keys, per tenant ``T`` (the ``{T}`` hash tag keeps a tenant's keys in one Redis Cluster slot)::

    mlxgw:{T}:requests     hash {l: level, t: stamp in ms}   token bucket, requests per minute
    mlxgw:{T}:prompt       hash                              prompt tokens per minute
    mlxgw:{T}:completion   hash                              completion tokens per minute (may be < 0: debt)
    mlxgw:{T}:leases       sorted set {lease id: expiry ms}  concurrency slots

and for the cluster: ``mlxgw:{cluster}:replicas`` (sorted set {replica id: expiry ms}: the
replicas present) and ``mlxgw:{cluster}:epoch`` (a random value set when the data starts:
a Redis restarted empty has a new one).

A bucket refills at ``limit / 60`` per second up to ``limit``, computed from the Redis
server's clock (``TIME``), so replicas' clocks do not matter; a bucket key expires once it
would be full again (absent = full). The limits themselves travel with each call (the
caller's tenants file), so a reload (SIGHUP) on one replica takes effect for its calls at once.

Every operation is one Lua script (:mod:`gateway.tenancy.limits_scripts`; registered once per
store: EVALSHA, loaded again after a Redis restart), so each check-and-take is atomic across
replicas:

- ``BEGIN``: drop expired leases, check concurrency, requests, completion debt and prompt
  tokens in the order of the in-process limiter, then take a request and add the lease
  (expiry now + ``lease_ttl``); answers the verdict and the levels for the headers.
- ``SETTLE``: take prompt and completion tokens and requests (debt allowed) and remove
  ended requests' leases. One writer task sends them, one call per tenant with what accumulated while the
  previous call was in flight, so a burst of requests costs few round trips.
- ``REFRESH``: push the expiry of this replica's running requests' leases (every
  ``lease_ttl / 3``), so a replica that dies stops refreshing and its slots expire after
  ``lease_ttl`` (30 s).
- ``PRESENCE``: every 2 s, this replica's entry in the replicas present (kept 6 s); answers
  how many are, and the data's epoch.
- ``SYNC``: after an outage, per tenant, what this replica took meanwhile (and, when Redis
  lost its data, its own levels for the buckets no replica has set again yet).

No request waits on Redis more than ``timeout`` (50 ms): a call that fails or times out
marks the store down (logged once), the limiter then uses this replica's own buckets
(:class:`gateway.tenancy.limits.Limiter`), which follow the store's levels, with
``1 / replicas present`` of each limit (:mod:`gateway.tenancy.limits_outage`); requests make
no Redis call at all, and a background task pings Redis every ``probe_interval`` (2 s)
until it answers. It then sends what this replica admitted and charged meanwhile (SYNC)
before requests use the store again (logged once), and re-adds the leases of requests still
running here (also those admitted locally). ``mlx_gateway_limits_store_up`` is 1 while the
store is used, 0 while it is not.

redis-py (``redis>=5``) is imported only when a store is created.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from typing import Callable, Optional

from gateway.async_tasks import cancel_and_wait
from gateway.tenancy.limits import Verdict
from gateway.tenancy.limits_outage import PRESENCE_SECONDS, PRESENCE_TTL, Outage, Owed
from gateway.tenancy.limits_scripts import BEGIN, PRESENCE, REFRESH, SETTLE, SYNC
from gateway.tenancy.limits_url import check_url, redacted
from gateway.tenancy.tenants import Tenant

log = logging.getLogger("mlx_gateway.limits")

TIMEOUT = 0.05  # seconds a request may wait on Redis
PROBE_SECONDS = 2.0  # while down: seconds between pings
LEASE_TTL = 30.0  # seconds a slot outlives its last refresh
FLUSH_SECONDS = 0.25  # a running request sends its completion tokens at most this often
CONCURRENT_CALLS = 32  # per replica: more wait for one to end (within the timeout), on warm connections

_REFUSED = (None, "requests", "completion_tokens", "prompt_tokens", "concurrency")


class RedisLimitsStore:
    """The shared buckets and slots of :class:`~gateway.tenancy.limits.Limiter`, in Redis at
    ``url`` (``redis://``, ``rediss://`` or ``unix://``). Used on one event loop at a time;
    the connection and the background task start on first use.

    Raises:
        ValueError: see :func:`check_url`.
    """

    def __init__(self, url: str, *, timeout: float = TIMEOUT, probe_interval: float = PROBE_SECONDS,
                 lease_ttl: float = LEASE_TTL, refresh_interval: Optional[float] = None,
                 flush_interval: float = FLUSH_SECONDS, prefix: str = "mlxgw",
                 clock: Callable[[], float] = time.monotonic):
        check_url(url)
        self.url = url
        self.timeout = timeout
        self.probe_interval = probe_interval
        self.lease_ttl = lease_ttl
        self.refresh_interval = refresh_interval if refresh_interval is not None else lease_ttl / 3
        self.flush_interval = flush_interval
        self.prefix = prefix
        self.clock = clock
        self.up = True
        self._replica = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._seq = itertools.count(1)
        self._leases: dict[str, set[str]] = {}  # tenant -> lease ids of requests running here
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._client = None
        self._scripts: dict[str, object] = {}
        self._owed: dict[str, Owed] = {}  # what the writer is to send, per tenant
        self._writer: Optional[asyncio.Task] = None
        self._maintainer: Optional[asyncio.Task] = None
        self._lock: Optional[asyncio.Lock] = None
        self._slots: Optional[asyncio.Semaphore] = None
        self._next_probe = 0.0
        self._closed = False
        self._catching_up = False
        self.outage = Outage()
        self.last_error: Optional[BaseException] = None
        self.in_doubt = False  # the last BEGIN that failed may have been run by Redis
        # tenant name -> (tenant, its requests, completion, prompt levels here): set by the Limiter
        self.levels: Callable[[], dict] = dict

    # ------------------------------------------------------------------ setup
    def _ensure(self) -> Optional[asyncio.AbstractEventLoop]:
        """The running loop, with the client, scripts and background task made for it
        (None outside a loop)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        if self._closed:
            return None
        if loop is not self._loop:
            import redis.asyncio as aioredis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError

            self._loop = loop
            # One immediate retry: a pooled connection from before a Redis restart is dead,
            # the retry reconnects (all within ``timeout``, which bounds every call).
            pool = aioredis.ConnectionPool.from_url(
                self.url, max_connections=4 * CONCURRENT_CALLS, socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout, retry=Retry(NoBackoff(), 1),
                retry_on_error=[ConnectionError], decode_responses=True, health_check_interval=0)
            self._client = aioredis.Redis.from_pool(pool)
            self._scripts = {name: self._client.register_script(src) for name, src in
                             (("begin", BEGIN), ("settle", SETTLE), ("refresh", REFRESH), ("sync", SYNC),
                              ("presence", PRESENCE))}
            self._lock = asyncio.Lock()
            self._slots = asyncio.Semaphore(CONCURRENT_CALLS)
            self._owed, self._writer = {}, None
            self._maintainer = loop.create_task(self._maintain())
        return loop

    def _key(self, tenant: str, what: str) -> str:
        return f"{self.prefix}:{{{tenant}}}:{what}"

    # ------------------------------------------------------------------ health
    def usable(self) -> bool:
        """Whether requests should ask the store (False while it is down, catching up after
        an outage, or closed: no call at all)."""
        return self.up and not self._closed and not self._catching_up

    def share(self) -> float:
        """An even share of each limit (1 / the replicas present), for a tenant whose part
        of the traffic here is not known."""
        return self.outage.share()

    def _down(self, error: BaseException) -> None:
        self._next_probe = self.clock() + self.probe_interval
        if self._catching_up:
            self.up = False
        elif self.up:
            self.up = False
            log.warning("limits store %s does not answer (%s): this gateway applies the tenants' limits on "
                        "its own meanwhile", redacted(self.url), type(error).__name__ +
                        (f": {error}" if str(error) else ""), extra={"replica": self._replica})

    def _up(self) -> None:
        if not self.up:
            self.up = True
            log.info("limits store %s answers again: the tenants' limits are shared again", redacted(self.url),
                     extra={"replica": self._replica})

    async def _call(self, name: str, keys: list[str], args: list) -> Optional[object]:
        """Run script ``name``; None (and the store marked down) when it fails or takes
        more than ``timeout``."""
        async def run():
            async with self._slots:
                return await self._scripts[name](keys=keys, args=args)

        try:
            return await asyncio.wait_for(run(), self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # timeouts, connection and server errors alike
            self.last_error = e
            self._down(e)
            return None

    async def _maintain(self) -> None:
        """Refresh the leases of running requests and this replica's presence while up;
        ping while down."""
        tick = min(self.probe_interval, self.refresh_interval, PRESENCE_SECONDS) / 2
        next_refresh = self.clock() + self.refresh_interval
        next_presence = 0.0
        while not self._closed:  # not only the cancellation: one may be lost (gateway.async_tasks)
            now = self.clock()
            try:
                if not self.up:
                    if now >= self._next_probe:
                        await self._probe()
                        next_refresh = self.clock() + self.refresh_interval
                        next_presence = self.clock() + PRESENCE_SECONDS
                else:
                    if now >= next_presence:
                        next_presence = now + PRESENCE_SECONDS
                        await self._presence()
                    if now >= next_refresh:
                        next_refresh = now + self.refresh_interval
                        await self._refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # never seen; the loop must outlive it
                log.exception("limits store: maintenance failed")
            await asyncio.sleep(tick)

    async def _presence(self) -> Optional[bool]:
        """Tell the store this replica is there; read how many are (:attr:`Outage.peers`)
        and the data's epoch. True when the store's data is not the one this replica saw
        last (it restarted empty), None when the store did not answer."""
        r = await self._call("presence", [f"{self.prefix}:{{cluster}}:replicas", f"{self.prefix}:{{cluster}}:epoch"],
                             [self._replica, int(PRESENCE_TTL * 1000), secrets.token_hex(8)])
        if r is None:
            return None
        seen, self.outage.epoch = self.outage.epoch, str(r[1])
        self.outage.peers = max(1, int(r[0]))
        return seen is not None and seen != self.outage.epoch

    async def _probe(self) -> None:
        self._next_probe = self.clock() + self.probe_interval
        try:
            # Connections from before the outage may be dead (a restarted server): start afresh.
            await asyncio.wait_for(self._client.connection_pool.disconnect(), self.timeout)
            await asyncio.wait_for(self._client.ping(), self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("limits store: probe failed: %r", e)
            return
        self._catching_up = True  # the calls below may run; requests do not use the store yet
        try:
            lost = await self._presence()
            synced = lost is not None and await self._sync(lost)
        finally:
            self._catching_up = False
        if not synced:
            return
        self._up()
        for o in self.outage.take().values():  # charged while the sync ran: sent as usual
            self._owe(o.tenant, o.prompt, o.completion, requests=o.requests)
        await self._refresh()  # the requests running here hold their slots again

    async def _sync(self, lost: bool) -> bool:
        """:meth:`Outage.sync` through this store; False when it failed."""
        return await self.outage.sync(self._call, self._key, self.levels(), lost, self.clock())

    async def _refresh(self) -> None:
        async with self._lock:
            ttl = int(self.lease_ttl * 1000)
            for name, ids in list(self._leases.items()):
                if not ids:
                    del self._leases[name]
                elif await self._call("refresh", [self._key(name, "leases")], [ttl, *ids]) is None:
                    return

    # ------------------------------------------------------------------ operations
    def lease_id(self) -> str:
        """A new lease id, unique in the cluster."""
        return f"{self._replica}-{next(self._seq)}"

    async def begin(self, tenant: Tenant, lease: Optional[str]) -> Optional[Verdict]:
        """The store's check-and-take for one request of ``tenant`` (its lease added when
        admitted); None when the store failed or did not answer in time."""
        if self._ensure() is None:
            return None
        t = tenant.name
        keys = [self._key(t, "requests"), self._key(t, "completion"), self._key(t, "prompt"), self._key(t, "leases")]
        args = [tenant.requests_per_minute or 0, tenant.completion_tokens_per_minute or 0,
                tenant.prompt_tokens_per_minute or 0, tenant.max_concurrent or 0, lease or "",
                int(self.lease_ttl * 1000)]
        r = await self._call("begin", keys, args)
        if r is None:
            # A call that timed out was sent, and Redis may run it yet (a slow or paused
            # server): its take is then counted there, not again on the store's return.
            from redis.exceptions import TimeoutError as RedisTimeout

            self.in_doubt = isinstance(self.last_error, (TimeoutError, RedisTimeout))
            return None
        return Verdict(_REFUSED[int(r[0])], float(r[1]) / 1000, int(r[2]), float(r[3]), float(r[4]), float(r[5]))

    def track(self, tenant: Tenant, lease: str) -> None:
        """``lease`` is a running request of ``tenant`` here: refreshed until released."""
        self._leases.setdefault(tenant.name, set()).add(lease)

    def later(self, delay: float, callback: Callable[[], None]):
        """``callback`` in ``delay`` seconds on the running loop (its handle; None outside one)."""
        try:
            return asyncio.get_running_loop().call_later(delay, callback)
        except RuntimeError:
            return None

    def _owe(self, tenant: Tenant, prompt: int = 0, completion: int = 0, lease: Optional[str] = None,
             requests: int = 0) -> None:
        """Add to what the writer sends. While the store is down (or catching up), charges
        wait for its return (:class:`Outage`) and leases expire by their TTL."""
        if not self.up or self._catching_up or self._ensure() is None:
            if not self._closed and (requests or prompt or completion):
                self.outage.record(tenant, requests, prompt, completion)
            return
        owed = self._owed.get(tenant.name)
        if owed is None:
            owed = self._owed[tenant.name] = Owed(tenant)
        owed.add(tenant, requests, prompt, completion)
        if lease is not None:
            owed.leases.append(lease)
        if self._writer is None or self._writer.done():
            self._writer = self._loop.create_task(self._write())

    async def _write(self) -> None:
        """Send what is owed, one SETTLE per tenant, until nothing is: a single task, so
        charges made while a call is in flight go together in the next one, and a burst of
        requests costs a round trip per tenant, not per request."""
        while self._owed and self.up:
            owed, self._owed = self._owed, {}
            # Under the lock: a refresh in flight cannot re-add a lease after its removal.
            async with self._lock:
                pending = list(owed.items())
                for k, (name, o) in enumerate(pending):
                    t = o.tenant
                    args = [t.prompt_tokens_per_minute or 0, o.prompt, t.completion_tokens_per_minute or 0,
                            o.completion, t.requests_per_minute or 0, o.requests, *o.leases]
                    keys = [self._key(name, "prompt"), self._key(name, "completion"), self._key(name, "requests"),
                            self._key(name, "leases")]
                    if await self._call("settle", keys, args) is None:
                        for _, left in pending[k:]:  # sent on the store's return
                            self.outage.record(left.tenant, left.requests, left.prompt, left.completion)
                        break
        if not self.up:
            for o in self._owed.values():
                self.outage.record(o.tenant, o.requests, o.prompt, o.completion)
            self._owed = {}

    def charge(self, tenant: Tenant, kind: str, n: int) -> None:
        """Take ``n`` from ``tenant``'s ``kind`` (requests|prompt|completion) bucket, in the
        background."""
        if n > 0:
            self._owe(tenant, **{kind: n})

    def release(self, tenant: Tenant, lease: Optional[str], completion: int) -> None:
        """A request ended: its last ``completion`` tokens and its lease, in the background."""
        if lease is not None:
            ids = self._leases.get(tenant.name)
            if ids is not None:
                ids.discard(lease)
        if lease is not None or completion > 0:
            self._owe(tenant, completion=completion, lease=lease)

    async def drain(self) -> None:
        """Wait until what is owed has been sent (tests; a graceful stop)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)

    async def aclose(self) -> None:
        """Send what is pending (ended requests' releases, token charges: each call bounded
        by ``timeout``), stop the background task and close the connections; leases of
        requests still running here are not released (they expire after ``lease_ttl``). Nothing
        is sent after."""
        await self.drain()
        self._closed = True
        if self._maintainer is not None:
            if not await cancel_and_wait(self._maintainer):
                log.warning("limits store: the maintenance task did not end; closing without it")
            self._maintainer = None
        if self._client is not None:
            try:
                await asyncio.wait_for(self._client.aclose(), 5.0)
            except Exception:
                pass
        self._client, self._loop = None, None

