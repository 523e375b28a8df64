"""What a replica of a shared limits store (:mod:`gateway.tenancy.limits_store`) keeps so
that an outage of the store costs the tenants' limits little:

- :class:`Owed`: a tenant's charges (requests, prompt and completion tokens) and lease
  releases not yet sent to the store;
- :class:`Outage`: how many replicas share the store (each applies ``1 / peers`` of every
  limit while it decides alone), the store's data epoch (a store restarted empty has a new
  one), and the charges made while the store did not answer, sent when it answers again
  (:data:`~gateway.tenancy.limits_scripts.SYNC`).

Without it, a replica that loses the store would apply each tenant's whole limit on its
own, from a bucket that only counted its own requests: up to ``peers`` times the limit,
plus a full bucket's burst per replica, and a store restarted empty would start every
tenant with a full bucket again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from gateway.tenancy.tenants import Tenant

PRESENCE_SECONDS = 2.0  # a replica tells the store it is there this often
PRESENCE_TTL = 6.0  # and is counted as one of the peers this long after


@dataclass
class Owed:
    """Charges and lease releases of one tenant not yet sent."""

    tenant: Tenant
    requests: int = 0
    prompt: int = 0
    completion: int = 0
    leases: list[str] = field(default_factory=list)

    def add(self, tenant: Tenant, requests: int = 0, prompt: int = 0, completion: int = 0) -> None:
        self.tenant = tenant
        self.requests += requests
        self.prompt += prompt
        self.completion += completion


class Outage:
    """The peers and epoch last read from the store, and the charges made while it was
    down (per tenant), for :meth:`RedisLimitsStore._probe` to send on its return."""

    def __init__(self):
        self.peers = 1  # replicas present in the store at the last look (this one included)
        self.epoch: Optional[str] = None  # the store's data epoch at the last look
        self.unsynced: dict[str, Owed] = {}

    def share(self) -> float:
        """The part of each limit this replica applies while it decides alone: ``1 / peers``."""
        return 1.0 / max(1, self.peers)

    def record(self, tenant: Tenant, requests: int = 0, prompt: int = 0, completion: int = 0) -> None:
        owed = self.unsynced.get(tenant.name)
        if owed is None:
            owed = self.unsynced[tenant.name] = Owed(tenant)
        owed.add(tenant, requests, prompt, completion)

    def take(self) -> dict[str, Owed]:
        taken, self.unsynced = self.unsynced, {}
        return taken

    def put_back(self, taken: dict[str, Owed]) -> None:
        for name, o in taken.items():
            self.record(o.tenant, o.requests, o.prompt, o.completion)

    async def sync(self, call: Callable[..., Awaitable], key: Callable[[str, str], str], levels: dict,
                   lost: bool, now: float) -> bool:
        """Send what was taken here while the store was down, one SYNC per tenant (and, when
        the store lost its data, the levels it last gave this replica, refilled to now);
        False when a call failed (what was not sent waits for the next return).

        Args:
            call: the store's ``_call(script, keys, args)`` (None on failure).
            key: the store's key of (tenant, bucket).
            levels: :meth:`Limiter.levels`.
            lost: the store restarted empty.
            now: the store's clock.
        """
        taken = self.take()
        names = sorted(set(taken) | (set(levels) if lost else set()))
        for k, name in enumerate(names):
            owed, here = taken.get(name), levels.get(name)
            tenant = here[0] if here is not None else owed.tenant
            args = ["1" if lost else "0"]
            for i, (cap, attr) in enumerate(((tenant.requests_per_minute, "requests"),
                                             (tenant.completion_tokens_per_minute, "completion"),
                                             (tenant.prompt_tokens_per_minute, "prompt"))):
                cap = cap or 0
                seen = here[1 + i] if here is not None and here[1 + i] is not None else cap
                args += [cap, getattr(owed, attr) if owed is not None else 0, repr(float(seen))]
            keys = [key(name, "requests"), key(name, "completion"), key(name, "prompt")]
            if await call("sync", keys, args) is None:
                self.put_back({n: taken[n] for n in names[k:] if n in taken})
                return False
        return True


class TrafficPart:
    """This replica's part of one tenant's requests in the cluster, for the share of the
    tenant's limits it applies alone while the store is down: a tenant whose requests all
    come here (prefix or session affinity) keeps its whole limit here, one spread over N
    replicas about 1/N. Estimated between two answers of the store, from the fall of the
    tenant's shared requests bucket (what the cluster took) against the requests admitted
    here; None until known.

    A saturated tenant gives about one sample a second (its bucket refills one request at a
    time), so the first samples are averaged (each weighs ``1 / samples``, the start of an
    exponential average corrected for its bias as in Adam, Kingma & Ba 2015), then smoothed
    by ``SMOOTHING``; the even share applies until ``MIN_SAMPLES`` are in. An average started
    from its first sample alone stays far from the part for tens of seconds: two replicas
    sharing a tenant half and half read 0.41 and 0.0 ten seconds in, and applied 0.66 of
    its limit between them while the store was down."""

    SMOOTHING = 0.1
    MIN_SAMPLES = 5

    def __init__(self):
        self.level: Optional[float] = None  # the store's level at the anchor (after its take)
        self.at = 0.0
        self.own = 0  # requests admitted here (through the store) since the anchor
        self.part: Optional[float] = None
        self.samples = 0

    def saw(self, level: float, admitted: bool, capacity: float, rate: float, now: float) -> None:
        """The store answered: its requests ``level`` (after this request's take when
        ``admitted``) at ``now``; ``capacity`` and ``rate`` (per second) of the bucket."""
        self.own += 1 if admitted else 0
        if self.level is None:
            self.level, self.at, self.own = level, now, 0
            return
        taken = min(capacity, self.level + rate * (now - self.at)) - level
        if taken >= 1:
            sample = min(1.0, self.own / taken)
            self.samples += 1
            weight = max(self.SMOOTHING, 1.0 / self.samples)
            self.part = sample if self.part is None else self.part + weight * (sample - self.part)
            self.level, self.at, self.own = level, now, 0

    def forget_anchor(self) -> None:
        """Requests admitted without the store: the next answer starts a new estimate."""
        self.level, self.own = None, 0

    def share(self, peers: int) -> float:
        """The part of the tenant's limits to apply here alone: :attr:`part`, at least half
        an even share (its traffic may move here), 1/``peers`` while unknown (fewer than
        ``MIN_SAMPLES``)."""
        even = 1.0 / max(1, peers)
        if self.part is None or self.samples < self.MIN_SAMPLES:
            return even
        return min(1.0, max(self.part, even / 2))
