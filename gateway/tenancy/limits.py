"""Per-tenant rate and concurrency limits: token buckets checked before any work.

Each limited quantity (requests, prompt tokens, completion tokens per minute) is a
token bucket whose capacity is one minute's worth and which refills continuously at
``limit / 60`` per second. Requests and prompt tokens are taken up front (the prompt
once it is tokenized, before the engine sees it); completion tokens are charged as
they are produced and may drive their bucket below zero, in which case the tenant's
next request waits until it is positive again. Headers follow OpenAI's
``x-ratelimit-*`` convention.

With a shared store (``--limits-store``, :mod:`gateway.tenancy.limits_store`) the buckets
and the concurrency slots that count are the store's, shared by every replica:
:meth:`Limiter.begin` asks it (one atomic script), the prompt is checked against the
store's levels as :meth:`Limiter.begin` read them and taken from the store in the
background, completion tokens are sent in batches (at most one round trip per request per
``store.flush_interval``) and a slot is released in the background. The replica's own
buckets follow the store's levels (each answer of the store lowers them to its levels) and
its own use, so that while the store does not answer (``store.usable()`` is False) this
replica decides from where the cluster was, with its part of each tenant's requests
(:class:`~gateway.tenancy.limits_outage.TrafficPart`, else 1 / the replicas sharing the
store) of each limit's rate and concurrency; what it admits and charges meanwhile is sent
to the store on its return (:mod:`gateway.tenancy.limits_outage`).

All methods run on the event loop thread (no locking needed).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gateway.http.errors import APIError
from gateway.tenancy.limits_outage import TrafficPart
from gateway.tenancy.tenants import Tenant


class TokenBucket:
    """A token bucket of ``capacity`` tokens refilled at ``rate`` tokens per second."""

    def __init__(self, capacity: float, rate: float, now: float):
        self.capacity = float(capacity)
        self.rate = float(rate)
        self.level = float(capacity)
        self.stamp = now

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are available (0 if they are now)."""
        self.refill(now)
        return 0.0 if self.level >= n else (n - self.level) / self.rate

    def take(self, n: float) -> None:
        """Remove ``n`` tokens (the level may go negative: a debt)."""
        self.level -= n

    def reset_after(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, (self.capacity - self.level) / self.rate)

    def resize(self, capacity: float, rate: float) -> None:
        """New limits (after a reload); the level is kept within the new capacity."""
        self.capacity, self.rate = float(capacity), float(rate)
        self.level = min(self.level, self.capacity)


def _duration(seconds: float) -> str:
    """OpenAI's reset format, e.g. ``1s``, ``6m0s``, ``250ms``."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


@dataclass
class _TenantState:
    requests: Optional[TokenBucket] = None
    prompt: Optional[TokenBucket] = None
    completion: Optional[TokenBucket] = None
    in_flight: int = 0
    tenant: Optional[Tenant] = None
    traffic: TrafficPart = field(default_factory=TrafficPart)  # this replica's part of its requests
    seen: dict = field(default_factory=dict)  # bucket -> (level, time) the shared store last gave
    alone: bool = False  # deciding without the store since its last answer

    def buckets(self):
        """(bucket, per-minute limit attribute of the tenant) of each bucket it has."""
        return ((b, a) for b, a in ((self.requests, "requests_per_minute"), (self.prompt, "prompt_tokens_per_minute"),
                                    (self.completion, "completion_tokens_per_minute")) if b is not None)


@dataclass
class Verdict:
    """A shared store's answer to :meth:`Limiter.begin`: ``refused`` is None (admitted: a
    request taken, the slot leased) or the limit hit (requests|completion_tokens|
    prompt_tokens|concurrency), ``wait`` the seconds until it would pass, ``held`` the
    tenant's slots held in the cluster, and the levels of its buckets (after the take)."""

    refused: Optional[str]
    wait: float
    held: int
    requests: float
    completion: float
    prompt: float


# (limit label, Tenant attribute, unit in messages)
_MESSAGES = {"requests": ("requests_per_minute", "requests"),
             "completion_tokens": ("completion_tokens_per_minute", "completion tokens"),
             "prompt_tokens": ("prompt_tokens_per_minute", "prompt tokens")}


def _mirror(limit: Optional[int], level: float, now: float) -> Optional[TokenBucket]:
    """A local copy of a shared bucket whose level was ``level`` at ``now``."""
    if limit is None:
        return None
    bucket = TokenBucket(limit, limit / 60.0, now)
    bucket.level = min(bucket.capacity, level)
    return bucket


@dataclass
class Ticket:
    """One admitted request's hold on its tenant's limits; :meth:`close` releases its
    concurrency slot (idempotent). ``state`` is the tenant's buckets, shared with the
    limiter (a reload resizes them in place). With a shared store, ``lease`` is the slot's
    id there and ``view`` (when the store admitted it) copies of the store's request and
    prompt buckets as :meth:`Limiter.begin` read them."""

    limiter: "Limiter"
    tenant: Tenant
    state: _TenantState
    closed: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    lease: Optional[str] = None
    view: Optional[_TenantState] = None
    unsent: int = 0  # completion tokens not yet sent to the shared store
    _timer: Any = None

    def charge_prompt(self, n: int) -> None:
        """Take ``n`` prompt tokens, before the request reaches the engine.

        Raises:
            APIError: 429 (``Retry-After``) when the bucket lacks ``n`` tokens now;
                413 when ``n`` is more than a whole minute's allowance.
        """
        bucket = self.state.prompt
        if bucket is None:
            return
        if n > bucket.capacity:
            raise APIError(413, f"the prompt has {n} tokens, more than this key's limit of "
                           f"{int(bucket.capacity)} prompt tokens per minute", param="messages",
                           code="tokens_over_limit")
        now = self.limiter.clock()
        shown = self.view if self.view is not None and self.view.prompt is not None else self.state
        wait = shown.prompt.wait_for(n, now)
        if wait > 0:
            raise self.limiter._refuse(self.tenant, shown, "prompt_tokens", wait,
                                       f"rate limit of {self.tenant.prompt_tokens_per_minute} prompt tokens "
                                       f"per minute reached ({n} needed)")
        if shown is not self.state:
            shown.prompt.take(n)
            bucket.refill(now)
        if self.limiter.store is not None:
            self.limiter.store.charge(self.tenant, "prompt", n)
        bucket.take(n)
        self.headers = self.limiter._headers(shown)

    def charge_completion(self, n: int = 1) -> None:
        """Count ``n`` generated tokens (never refused: the bucket may go into debt). With
        a shared store they are sent in one batch per ``store.flush_interval`` and at
        :meth:`close`."""
        bucket = self.state.completion
        if bucket is not None:
            bucket.refill(self.limiter.clock())
            bucket.take(n)
            store = self.limiter.store
            if store is not None and not self.closed:
                self.unsent += n
                if self._timer is None:
                    self._timer = store.later(store.flush_interval, self._flush)

    def _flush(self) -> None:
        self._timer = None
        n, self.unsent = self.unsent, 0
        if n and not self.closed:
            self.limiter.store.charge(self.tenant, "completion", n)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.state.in_flight -= 1
            store = self.limiter.store
            if store is not None:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                n, self.unsent = self.unsent, 0
                store.release(self.tenant, self.lease, n)


class Limiter:
    """The limits of every tenant. ``on_limited(tenant, limit)`` is called for each 429
    (``limit`` is requests|prompt_tokens|completion_tokens|concurrency).

    ``store`` (None: this process's buckets only) is a shared store such as
    :class:`gateway.tenancy.limits_store.RedisLimitsStore`: with it the limits hold for
    every replica sharing it, and this process's buckets are the fallback while it does
    not answer."""

    def __init__(self, on_limited: Callable[[str, str], None] = lambda t, k: None,
                 clock: Callable[[], float] = time.monotonic, store=None):
        self.clock = clock
        self.on_limited = on_limited
        self.store = store
        self._states: dict[str, _TenantState] = {}
        if store is not None:
            store.levels = self.levels

    def levels(self) -> dict[str, tuple]:
        """Each tenant's ``(tenant, requests, completion, prompt)``: the levels the shared
        store last gave, refilled to now at the whole rate (None where it gave none), for
        a store that lost its data: the cluster's levels but for what the replicas took
        since (they send it)."""
        now = self.clock()
        out = {}
        for name, st in self._states.items():
            if st.tenant is None:
                continue
            row = [st.tenant]
            for attr, limit in (("requests", st.tenant.requests_per_minute),
                                ("completion", st.tenant.completion_tokens_per_minute),
                                ("prompt", st.tenant.prompt_tokens_per_minute)):
                seen = st.seen.get(attr)
                row.append(None if seen is None or not limit else min(limit, seen[0] + (now - seen[1]) * limit / 60))
            out[name] = tuple(row)
        return out

    def _share(self, st: _TenantState, share: float, now: float) -> None:
        """Refill ``st``'s buckets up to ``now`` at their rate so far, then set each one's
        rate to ``share`` of its limit per second."""
        for bucket, attr in st.buckets():
            bucket.refill(now)
            bucket.rate = getattr(st.tenant, attr) / 60.0 * share

    def _state(self, tenant: Tenant) -> _TenantState:
        """The tenant's buckets, created or resized to its current limits."""
        st = self._states.get(tenant.name)
        if st is None:
            st = self._states[tenant.name] = _TenantState()
        st.tenant = tenant
        now = self.clock()
        for attr, limit in (("requests", tenant.requests_per_minute),
                            ("prompt", tenant.prompt_tokens_per_minute),
                            ("completion", tenant.completion_tokens_per_minute)):
            bucket = getattr(st, attr)
            if limit is None:
                setattr(st, attr, None)
            elif bucket is None:
                setattr(st, attr, TokenBucket(limit, limit / 60.0, now))
            elif bucket.capacity != limit:
                bucket.resize(limit, limit / 60.0)
        return st

    def _refuse(self, tenant: Tenant, st: _TenantState, limit: str, wait: float, message: str) -> APIError:
        self.on_limited(tenant.name, limit)
        retry = max(1, math.ceil(wait))
        return APIError(429, message, code="rate_limit_exceeded",
                        headers={**self._headers(st), "Retry-After": str(retry)})

    def _headers(self, st: _TenantState) -> dict[str, str]:
        """``x-ratelimit-*`` headers for the request and prompt-token buckets of ``st``."""
        now = self.clock()
        out: dict[str, str] = {}
        for name, bucket in (("requests", st.requests), ("tokens", st.prompt)):
            if bucket is None:
                continue
            bucket.refill(now)
            out[f"x-ratelimit-limit-{name}"] = str(int(bucket.capacity))
            out[f"x-ratelimit-remaining-{name}"] = str(max(0, int(bucket.level)))
            out[f"x-ratelimit-reset-{name}"] = _duration(bucket.reset_after())
        return out

    async def begin(self, tenant: Tenant) -> Ticket:
        """Admit one request of ``tenant`` or refuse it; nothing is taken when refused.
        With a shared store that answers, its buckets and slots decide (one round trip,
        at most ``store.timeout``); else this process's.

        Raises:
            APIError: 429 with ``Retry-After`` when the tenant has ``max_concurrent``
                requests in flight, no request left this minute, or a completion-token
                debt.
        """
        st = self._state(tenant)
        store = self.store
        lease, taken = None, False
        if store is not None and any(v is not None for v in (
                tenant.requests_per_minute, tenant.prompt_tokens_per_minute,
                tenant.completion_tokens_per_minute, tenant.max_concurrent)):
            lease = store.lease_id() if tenant.max_concurrent is not None else None
            if store.usable():
                verdict = await store.begin(tenant, lease)
                if verdict is not None:
                    return self._admit_shared(tenant, st, verdict, lease)
                taken = store.in_doubt  # the store may count this request itself
        ticket = self._admit_local(tenant, st, taken)
        if lease is not None:
            ticket.lease = lease
            store.track(tenant, lease)
        return ticket

    def _admit_shared(self, tenant: Tenant, st: _TenantState, v: Verdict, lease: Optional[str]) -> Ticket:
        now = self.clock()
        view = _TenantState(requests=_mirror(tenant.requests_per_minute, v.requests, now),
                            prompt=_mirror(tenant.prompt_tokens_per_minute, v.prompt, now))
        # this replica's buckets follow the cluster's (what the store read), for when it
        # must decide alone; its own take below keeps them at most the store's
        self._share(st, 1.0, now)
        st.alone = False
        st.seen = {"requests": (v.requests, now), "completion": (v.completion, now), "prompt": (v.prompt, now)}
        if st.requests is not None and v.refused != "concurrency":
            st.traffic.saw(v.requests, v.refused is None, st.requests.capacity, st.requests.rate, now)
        for bucket, level in ((st.requests, v.requests), (st.prompt, v.prompt), (st.completion, v.completion)):
            if bucket is not None:
                bucket.level = min(bucket.level, level + (1 if bucket is st.requests and v.refused is None else 0))
        if v.refused == "concurrency":
            raise self._refuse(tenant, view, "concurrency", 1,
                               f"tenant has {v.held} requests in flight (limit {tenant.max_concurrent})")
        if v.refused is not None:
            attr, unit = _MESSAGES[v.refused]
            raise self._refuse(tenant, view, v.refused, v.wait,
                               f"rate limit of {getattr(tenant, attr)} {unit} per minute reached")
        if st.requests is not None:
            st.requests.take(1)
        st.in_flight += 1
        if lease is not None:
            self.store.track(tenant, lease)
        return Ticket(self, tenant, st, headers=self._headers(view), lease=lease, view=view)

    def _admit_local(self, tenant: Tenant, st: _TenantState, taken: bool = False) -> Ticket:
        """Admit from this replica's buckets: alone (no store), or while a shared store does
        not answer: then with this replica's part of the tenant's traffic (``st.traffic``)
        of each limit, the request charged to the store on its return (unless ``taken``: a
        check-and-take the store may still run)."""
        now = self.clock()
        store = self.store
        share = st.traffic.share(store.outage.peers) if store is not None else 1.0
        self._share(st, share, now)
        if store is not None and not st.alone:
            # from now on this replica spends its share of what the cluster had left (the
            # others spend theirs), and of the refill
            st.alone = True
            st.traffic.forget_anchor()
            for bucket, _ in st.buckets():
                bucket.level *= share
        max_concurrent = tenant.max_concurrent
        if max_concurrent is not None and share < 1.0:
            max_concurrent = max(1, math.ceil(max_concurrent * share))
        if max_concurrent is not None and st.in_flight >= max_concurrent:
            raise self._refuse(tenant, st, "concurrency", 1,
                               f"tenant has {st.in_flight} requests in flight (limit {tenant.max_concurrent})")
        # (bucket, tokens needed now, limit label, per-minute limit, unit); completion
        # tokens need only a level >= 0 (no debt), the others one token.
        checks = ((st.requests, 1, "requests", tenant.requests_per_minute, "requests"),
                  (st.completion, 0, "completion_tokens", tenant.completion_tokens_per_minute, "completion tokens"),
                  (st.prompt, 1, "prompt_tokens", tenant.prompt_tokens_per_minute, "prompt tokens"))
        for bucket, need, label, limit, unit in checks:
            wait = bucket.wait_for(need, now) if bucket is not None else 0.0
            if wait > 0:
                raise self._refuse(tenant, st, label, wait, f"rate limit of {limit} {unit} per minute reached")
        if st.requests is not None:
            st.requests.take(1)
            if store is not None and not taken:
                store.charge(tenant, "requests", 1)
        st.in_flight += 1
        return Ticket(self, tenant, st, headers=self._headers(st))

    async def aclose(self) -> None:
        """Stop the shared store's background work and close its connections (slots still
        held expire by their TTL)."""
        if self.store is not None:
            await self.store.aclose()
