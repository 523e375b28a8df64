"""Admission order for waiting requests: by latency class, fair across tenants within a
class, longest cached prefix first within a tenant, shared prefixes computed once.

Latency classes (a request's ``priority``: 0 interactive, 1 standard, 2 batch) are
served in order: :meth:`WaitingQueue.pick` takes only the classes it is allowed (the
engine allows the best class waiting or prefilling, and now and then every class:
:class:`ClassShare`). Within a class, the backlogged tenant with the least weighted
work so far goes next (:mod:`scheduler.admission.fairness`). Within a tenant, two rules from
SGLang's scheduler (``managers/schedule_policy.py``):

* ``lpm``: waiting requests are admitted in order of how many prompt tokens the prefix
  cache can restore, longest first; above :data:`LPM_MAX_WAITING` waiting requests the
  order falls back to arrival (FCFS), so that sorting stays cheap and nobody starves.
* in-batch prefix sharing: a request that shares at least :data:`MIN_SHARED_PREFIX`
  uncached tokens with a request being prefilled (or admitted in the same pick) waits
  until that request has saved a snapshot inside the shared part, then restores it
  instead of computing the shared tokens again.

Shared prefixes are found through a :class:`~scheduler.admission.prefix_index.PrefixIndex` of the
requests in prefill and those chosen so far, not by comparing prompts pairwise, and each
request's cached length is asked of the prefix cache once per pick: with 256 waiting
requests a pick takes about a millisecond or less at the median, on a loaded 2-core machine
(``benchmarks/results/scheduling_runs.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from cache.checkpoints import divergence_snapshot
from scheduler.admission.fairness import FairShare
from scheduler.admission.prefix_index import PrefixIndex, PrefixKey
from scheduler.request import EngineRequest

LPM_MAX_WAITING = 128
MIN_SHARED_PREFIX = 32


class ClassShare:
    """The guaranteed share of steps of the classes below the best one present: each step
    in which lower-class work waits while a better class runs earns them ``share`` of a
    step; once a whole step is earned, that step also serves one lower class (taken in
    turn among them), beside the best one: the best class's prompts are never taken out
    of the batch for it. With ``share`` 0.05, batch work gets at least one step in twenty
    under a steady stream of interactive requests, and always finishes.

    Args:
        share: the fraction of such steps (0: none; lower classes wait for the better
            ones to be done).
    """

    def __init__(self, share: float) -> None:
        self.share = max(0.0, min(1.0, share))
        self._credit = 0.0
        self._turn = 0

    def allowed(self, present: set[int]) -> set[int]:
        """The classes that may prefill this step, of the classes ``present`` (waiting,
        prefilling or paused); counts one step."""
        if len(present) <= 1:
            return set(present)
        self._credit += self.share
        if self._credit < 1.0:
            return {min(present)}
        self._credit -= 1.0
        best, *lower = sorted(present)
        self._turn += 1
        return {best, lower[self._turn % len(lower)]}


@dataclass
class InFlight:
    """A request in prefill, seen by the policy.

    ``pending_snapshots`` are the absolute prompt offsets (tokens) at which it will still
    save a snapshot.
    """

    request: EngineRequest
    pending_snapshots: list[int]


def key_of(r: EngineRequest) -> PrefixKey:
    """``r``'s :class:`PrefixKey`, computed once and kept on it."""
    if r.prefix_key is None:
        r.prefix_key = PrefixKey(r.namespace, r.tokens)
    return r.prefix_key


@dataclass
class Admission:
    """A request chosen for admission, with ``extra_checkpoints`` added so that waiting
    requests that share its prefix can restore it."""

    request: EngineRequest
    extra_checkpoints: list[int]
    waited_for_prefix: bool


class WaitingQueue:
    """Waiting requests in arrival order, with the admission policy in :meth:`pick`.

    ``fair`` holds the tenants' virtual token counters; :meth:`pick` charges each
    admission's uncached prompt tokens to it, the engine charges generated tokens.
    """

    def __init__(self, fair: Optional[FairShare] = None) -> None:
        self._items: list[EngineRequest] = []
        self._deferred: set[str] = set()
        self._per_tenant: dict[str, int] = {}
        self._matched: dict[str, tuple[int, int]] = {}  # request id -> (cache version, cached tokens)
        self.fair = fair or FairShare()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def classes(self) -> set[int]:
        """The latency classes of the waiting requests."""
        return {r.priority for r in self._items}

    def count_by_class(self) -> dict[int, int]:
        """Waiting requests per latency class."""
        out: dict[int, int] = {}
        for r in self._items:
            out[r.priority] = out.get(r.priority, 0) + 1
        return out

    def add(self, request: EngineRequest) -> None:
        t = request.tenant
        if not self._per_tenant.get(t):
            self.fair.on_backlogged(t, [u for u, k in self._per_tenant.items() if k])
        self._per_tenant[t] = self._per_tenant.get(t, 0) + 1
        self._items.append(request)

    def add_first(self, request: EngineRequest) -> None:
        """Put ``request`` at the head of the queue (a preempted row's request: vLLM puts
        preempted requests back at the head of its waiting queue too)."""
        self.add(request)
        self._items.insert(0, self._items.pop())

    def take(self, n: int, which: Callable[[EngineRequest], bool]) -> list[EngineRequest]:
        """Remove and return up to ``n`` requests for which ``which`` holds, in queue order
        (no fair-share charge: preempted requests were charged when first admitted)."""
        found = [r for r in self._items if which(r)][:max(0, n)]
        for r in found:
            self.remove(r.id)
        return found

    def remove(self, request_id: str) -> Optional[EngineRequest]:
        for i, r in enumerate(self._items):
            if r.id == request_id:
                self._deferred.discard(request_id)
                self._matched.pop(request_id, None)
                self._per_tenant[r.tenant] -= 1
                return self._items.pop(i)
        return None

    def put_back(self, admissions: list["Admission"], cached_len: Callable[[EngineRequest], int]) -> None:
        """Return picked ``admissions`` to the head of the queue, in their order (they may
        not start yet: :mod:`scheduler.admission.memory`), refunding their fair-share charge."""
        for a in reversed(admissions):
            r = a.request
            self._items.insert(0, r)
            self._per_tenant[r.tenant] = self._per_tenant.get(r.tenant, 0) + 1
            self.fair.charge(r.tenant, -(len(r.tokens) - cached_len(r)), r.weight)

    def drain(self) -> list[EngineRequest]:
        items, self._items = self._items, []
        self._deferred.clear()
        self._matched.clear()
        self._per_tenant.clear()
        return items

    def pick(
        self,
        n: int,
        cached_len: Callable[[EngineRequest], int],
        in_flight: Iterable[InFlight],
        cache_version: Optional[int] = None,
        classes: Optional[set[int]] = None,
    ) -> list[Admission]:
        """Choose up to ``n`` requests to admit now and remove them from the queue.

        Repeatedly takes, in the best latency class left, the tenant with the smallest
        virtual counter that still has an eligible request, and from it the request with
        the longest cached prefix (arrival order above :data:`LPM_MAX_WAITING` waiting
        requests); each pick charges its uncached prompt tokens to the tenant.

        Args:
            n: free prefill slots.
            cached_len: tokens of a request's prompt the prefix cache can restore now.
            in_flight: requests currently in prefill.
            cache_version: the prefix cache's :attr:`version`; while it is unchanged,
                ``cached_len`` answers from earlier picks are reused (None: ask again).
            classes: the latency classes that may be admitted (None: every class).

        Returns:
            The admissions, in admission order.
        """
        if n <= 0 or not self._items:
            return []
        matched = self._matched

        def cached(r: EngineRequest) -> int:  # once per cache version, and lazily in FCFS mode
            memo = matched.get(r.id)
            if memo is None or cache_version is None or memo[0] != cache_version:
                memo = matched[r.id] = (cache_version, cached_len(r))
            return memo[1]

        queues: dict[tuple[int, str], list[EngineRequest]] = {}
        for r in self._items:
            if classes is None or r.priority in classes:
                queues.setdefault((r.priority, r.tenant), []).append(r)
        if len(self._items) <= LPM_MAX_WAITING:
            for q in queues.values():
                q.sort(key=lambda r: -cached(r))  # stable: ties keep arrival order
        heads = {k: 0 for k in queues}
        flights: PrefixIndex[InFlight] = PrefixIndex()
        for f in in_flight:
            flights.add(f, f.request.tokens, key_of(f.request))
        leaders: PrefixIndex[Admission] = PrefixIndex()
        chosen: list[Admission] = []
        while len(chosen) < n and heads:
            key = min(heads, key=lambda k: (k[0], self.fair.counter(k[1]), queues[k][0].arrival))
            tenant = key[1]
            q, i = queues[key], heads[key]
            r = q[i]
            heads[key] = i + 1
            if heads[key] >= len(q):
                del heads[key]
            m = cached(r)
            if self._waits_for_flight(r, m, flights) or self._joins_leader(r, m, leaders):
                self._deferred.add(r.id)
                continue
            chosen.append(Admission(r, [], r.id in self._deferred))
            leaders.add(chosen[-1], r.tokens, key_of(r))
            self.fair.charge(tenant, len(r.tokens) - m, r.weight)
        for a in chosen:
            self.remove(a.request.id)
        return chosen

    @staticmethod
    def _waits_for_flight(r: EngineRequest, m: int, flights: PrefixIndex[InFlight]) -> bool:
        """True if an in-prefill request shares ``MIN_SHARED_PREFIX`` uncached tokens with
        ``r`` and will save a snapshot inside them that ``r`` can restore."""
        if not flights:
            return False
        for f, shared in flights.longest(r.tokens, key_of(r)):
            if shared - m >= MIN_SHARED_PREFIX and any(
                m < p <= shared and p < len(r.tokens) for p in f.pending_snapshots
            ):
                return True
        return False

    @staticmethod
    def _joins_leader(r: EngineRequest, m: int, leaders: PrefixIndex[Admission]) -> bool:
        """True if a request chosen in this pick shares ``MIN_SHARED_PREFIX`` uncached
        tokens with ``r``; the leader then also saves a snapshot where they diverge, where
        :func:`cache.checkpoints.divergence_snapshot` places it."""
        if not leaders:
            return False
        for a, shared in leaders.longest(r.tokens, key_of(r)):
            # The leader must compute the shared part itself: both start from m.
            if shared - m >= MIN_SHARED_PREFIX and shared < len(r.tokens):
                point = min(shared, len(a.request.tokens) - 1)
                if point > m:
                    # (A checkpoint above m is not cached: the leader computes and saves it.)
                    extra = divergence_snapshot(point, m, [*a.request.checkpoints, *a.extra_checkpoints],
                                                MIN_SHARED_PREFIX)
                    if extra is not None and extra not in a.extra_checkpoints:
                        a.extra_checkpoints.append(extra)
                    return True
        return False
