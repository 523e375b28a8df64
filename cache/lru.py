"""The prefix cache's recency order and evictions: which unleased snapshots go, and when.

:class:`LRUEviction`, held by :class:`cache.manager.PromptCacheManager`, keeps its
unleased snapshots in least-recently-used order and has them dropped:

- to make room for an insert (:meth:`~LRUEviction.plan`: the namespace's quota first,
  then the global ``max_bytes`` / ``max_entries`` bounds, planned with ``eviction.py``'s
  dry run before anything is dropped);
- to bring a namespace back under its byte quota (:meth:`~LRUEviction.set_quotas`);
- for a byte bound shared with other models' caches (:meth:`~LRUEviction.oldest_use`,
  :meth:`~LRUEviction.evict_oldest`; ``budget.py``);
- on request (:meth:`~LRUEviction.flush`).

A snapshot kept by a cache breakpoint (until its ``keep_until``, monotonic seconds) goes
after every other one. A dropped snapshot goes to the disk tier, when there is one,
except on a flush and for a companion namespace (:meth:`~LRUEviction.add_companion`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

from .entries import Entry
from .eviction import EvictionDryRun
from .metrics import CacheMetrics
from .prefix_report import EvictedKeys


class LRUEviction:
    """Recency, quotas and companions of one prefix cache; drops go through the manager.

    Public: recency (:meth:`add`, :meth:`discard`, :meth:`used`, iteration over the
    unleased entries, oldest first), :meth:`plan`, :meth:`set_quotas`, :meth:`shed`,
    :meth:`add_companion`, :meth:`spills`, :meth:`oldest_use`, :meth:`evict_oldest`,
    :meth:`flush`. Its own state: the unleased entries in order, the quotas (bytes per
    namespace) and the companions (namespace -> owner).

    Args:
        lock: the manager's ``RLock``; methods marked "Lock held" expect the caller to
            hold it, the others take it.
        metrics: where evictions and quotas are counted.
        max_bytes, max_entries: the manager's bounds (bytes, snapshots).
        nbytes: the bytes the manager holds now; ``namespace_bytes(ns)``: those of ``ns``.
        num_entries: the snapshots the manager holds now.
        drop: ``drop(entry, spill)`` removes an unleased entry from the manager (and, with
            ``spill``, hands it to the disk tier); it calls :meth:`discard`. Lock held.
        disk: the manager's disk link now (None: no disk tier).
    """

    def __init__(self, lock: threading.RLock, metrics: CacheMetrics, max_bytes: int, max_entries: int, *,
                 nbytes: Callable[[], int], namespace_bytes: Callable[[str], int], num_entries: Callable[[], int],
                 drop: Callable[[Entry, bool], None], disk: Callable[[], object]):
        self._lock = lock
        self.metrics = metrics
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._nbytes = nbytes
        self.namespace_bytes = namespace_bytes
        self._num_entries = num_entries
        self._drop = drop
        self._disk = disk
        self._order: OrderedDict[Entry, None] = OrderedDict()  # unleased entries, oldest first
        self.quotas: dict[str, int] = {}  # namespace -> byte quota
        self.owners: dict[str, str] = {}  # companion namespace -> its owner (add_companion)
        self.evicted = EvictedKeys()  # the dropped snapshots' keys, for explaining misses (prefix_report.py)

    @property
    def nbytes(self) -> int:
        """The manager's bytes (what the shared budget, ``budget.py``, bounds)."""
        return self._nbytes()

    # -- recency --------------------------------------------------------------
    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._order

    def add(self, entry: Entry) -> None:
        """``entry`` is unleased now: at the most recently used end. Lock held."""
        self._order[entry] = None
        entry.used = time.monotonic()

    def discard(self, entry: Entry) -> None:
        """``entry`` is leased or dropped: out of the order. Lock held."""
        self._order.pop(entry, None)

    def used(self, entry: Entry, keep_for: float | None = None) -> None:
        """``entry`` was used again: kept behind the others for at least ``keep_for`` more
        seconds (a cache breakpoint's ttl; nothing if falsy), and at the most recently
        used end if unleased. Lock held."""
        if keep_for:
            entry.keep_until = max(entry.keep_until, time.monotonic() + keep_for)
        if entry.leases == 0:
            self._order.move_to_end(entry)
            entry.used = time.monotonic()

    def order(self) -> list[Entry]:
        """Unleased entries in the order they go: least recently used first, those kept by
        a cache breakpoint (until their ``keep_until``) after all the others. Lock held."""
        now = time.monotonic()
        return [e for e in self._order if e.keep_until <= now] + [e for e in self._order if e.keep_until > now]

    # -- making room ----------------------------------------------------------
    def plan(self, namespace: str, run: EvictionDryRun) -> list[tuple[Entry, str]] | None:
        """Unleased entries to drop (LRU first, with the reason) so that the new snapshot
        of ``run`` fits its group's quota and the global bounds (``run.new_bytes()``
        grows when a drop frees the path the new key shares); None when that is
        impossible. Nothing is changed. Lock held."""
        if self.max_entries < 1:
            return None
        total_b, total_e = self._nbytes(), self._num_entries()
        key = self.quota_key(namespace)
        quota = self.quotas.get(key)
        if quota is not None:
            group_b = self.quota_bytes(key)
            order = self.order()
            for e in order:
                if group_b + run.new_bytes() <= quota:
                    break
                if self.quota_key(e.namespace) == key:
                    freed = run.drop(e, "quota")
                    group_b -= freed
                    total_b -= freed
                    total_e -= 1
            if group_b + run.new_bytes() > quota:
                return None
        for e in self.order():
            if total_e + 1 <= self.max_entries and total_b + run.new_bytes() <= self.max_bytes:
                break
            if id(e) in run.dropped:
                continue
            reason = "bytes" if total_b + run.new_bytes() > self.max_bytes else "entries"
            total_b -= run.drop(e, reason)
            total_e -= 1
        if total_e + 1 > self.max_entries or total_b + run.new_bytes() > self.max_bytes:
            return None
        return run.plan

    # -- companion namespaces -------------------------------------------------
    def add_companion(self, namespace: str, owner: str) -> None:
        """Make ``namespace`` a companion of ``owner`` (e.g. a draft model's rows of a
        cache group: ``scheduler/speculative/draft_snapshots.py``): its snapshots count in
        ``owner``'s byte quota, and stay off the disk tier (neither written when evicted
        or persisted nor looked up there: only this process's engine can use them).

        Raises:
            ValueError: ``namespace`` is ``owner``, or already a companion of another.
        """
        with self._lock:
            if namespace == owner or self.owners.get(namespace, owner) != owner:
                raise ValueError(f"{namespace!r} cannot be a companion of {owner!r}")
            self.owners[namespace] = owner
            self.shed(namespace)

    def spills(self, namespace: str) -> bool:
        """Whether ``namespace``'s snapshots go to (and come from) the disk tier."""
        return self._disk() is not None and namespace not in self.owners

    def quota_key(self, namespace: str) -> str:
        """The namespace whose quota covers ``namespace`` (its owner, or itself)."""
        return self.owners.get(namespace, namespace)

    def quota_bytes(self, key: str) -> int:
        """Bytes held under ``key``'s quota: its own and its companions'. Lock held."""
        return self.namespace_bytes(key) + sum(self.namespace_bytes(c) for c, o in self.owners.items() if o == key)

    # -- quotas ---------------------------------------------------------------
    def set_quotas(self, quotas: dict[str, int]) -> None:
        """Set per-namespace byte quotas (within ``max_bytes``), replacing earlier ones.

        A namespace's quota covers its companions (:meth:`add_companion`). A namespace
        over its new quota sheds unleased snapshots, oldest first, now (eviction reason
        ``quota``); one leased now goes when its last lease is released. Namespaces absent
        from ``quotas`` have none.

        Raises:
            ValueError: for a negative quota.
        """
        if any(q < 0 for q in quotas.values()):
            raise ValueError("quotas must be >= 0")
        with self._lock:
            for ns in self.quotas.keys() - quotas.keys():
                self.metrics.quota.remove(ns)
            self.quotas = {ns: int(q) for ns, q in quotas.items()}
            for ns, q in self.quotas.items():
                self.metrics.quota.labels(cache_group=ns).set(q)
                self.shed(ns)

    def shed(self, namespace: str) -> None:
        """Drop unleased snapshots under ``namespace``'s quota (its own and its owner's or
        companions'), oldest first, while they are over it (eviction reason ``quota``).
        Lock held."""
        key = self.quota_key(namespace)
        q = self.quotas.get(key)
        if q is None or self.quota_bytes(key) <= q:
            return
        for e in [e for e in self.order() if self.quota_key(e.namespace) == key]:
            if self.quota_bytes(key) <= q:
                break
            self._drop(e, True)
            self.metrics.evictions.labels(reason="quota").inc()

    # -- a shared budget, a flush ---------------------------------------------
    def oldest_use(self) -> float | None:
        """Last use (monotonic seconds) of the snapshot :meth:`evict_oldest` would drop
        (``inf`` when only snapshots kept by a breakpoint are left); None when every
        snapshot is leased or none is stored (``budget.py``)."""
        with self._lock:
            head = next(iter(self.order()), None)
            if head is None:
                return None
            return head.used if head.keep_until <= time.monotonic() else float("inf")

    def evict_oldest(self, reason: str) -> bool:
        """Drop the least recently used unleased snapshot, those kept by a breakpoint last
        (to the disk tier, if any), counted as an eviction for ``reason``; False if there
        is none."""
        with self._lock:
            head = next(iter(self.order()), None)
            if head is None:
                return False
            self._drop(head, True)
            self.metrics.evictions.labels(reason=reason).inc()
        disk = self._disk()
        if disk is not None:
            disk.spill()
        return True

    def flush(self, namespace: str | None = None) -> int:
        """Drop every unleased snapshot of ``namespace`` and of its companions
        (:meth:`add_companion`; all namespaces if None).

        Returns:
            The number of snapshots dropped (leased ones are kept).
        """
        with self._lock:
            victims = [e for e in self._order
                       if namespace is None or namespace in (e.namespace, self.owners.get(e.namespace))]
            for e in victims:
                self._drop(e, False)
            if victims:
                self.metrics.evictions.labels(reason="flush").inc(len(victims))
            return len(victims)
