"""The prefix cache's recency order and evictions: which unleased snapshots go, and dropping them.

:class:`LRUEviction` is the side of :class:`cache.manager.PromptCacheManager` that keeps
its unleased snapshots in least-recently-used order and drops them:

- to make room for an insert (:meth:`~LRUEviction._eviction_plan`: the namespace's quota
  first, then the global ``max_bytes`` / ``max_entries`` bounds, planned with
  ``eviction.py``'s dry run before anything is dropped);
- to bring a namespace back under its byte quota (:meth:`~LRUEviction.set_quotas`);
- for a byte bound shared with other models' caches (:meth:`~LRUEviction.oldest_use`,
  :meth:`~LRUEviction.evict_oldest`; ``budget.py``);
- on request (:meth:`~LRUEviction.flush`).

A snapshot kept by a cache breakpoint (until its ``keep_until``, monotonic seconds) goes
after every other one. A dropped snapshot goes to the disk tier, when there is one,
except on a flush and for a companion namespace (:meth:`~LRUEviction.add_companion`).
"""

from __future__ import annotations

import time

from .entries import Entry
from .eviction import EvictionDryRun


class LRUEviction:
    """Recency and eviction: the base class of :class:`cache.manager.PromptCacheManager`.

    Uses the manager's state: ``_lock`` (an ``RLock``; methods marked "Lock held" expect
    the caller to hold it), ``_lru`` (unleased entries, oldest first), ``_groups``,
    ``_quotas``, ``_owners``, ``_entries``, ``version``, ``max_bytes``, ``max_entries``, ``metrics``
    and ``disk``; and its ``nbytes``, ``namespace_bytes``, ``_spill_of`` and ``_account``.
    Not usable on its own.
    """

    # -- recency --------------------------------------------------------------
    @staticmethod
    def _keep(entry: Entry, keep_for: float | None) -> None:
        """Keep ``entry`` behind the others in the eviction order for at least ``keep_for``
        more seconds (a cache breakpoint's ttl); nothing if ``keep_for`` is falsy."""
        if keep_for:
            entry.keep_until = max(entry.keep_until, time.monotonic() + keep_for)

    def _touch(self, entry: Entry) -> None:
        """Move an unleased entry to the most recently used end. Lock held."""
        self._lru.move_to_end(entry)
        entry.used = time.monotonic()

    def _eviction_order(self) -> list[Entry]:
        """Unleased entries in the order they go: least recently used first, those kept by
        a cache breakpoint (until their ``keep_until``) after all the others. Lock held."""
        now = time.monotonic()
        return [e for e in self._lru if e.keep_until <= now] + [e for e in self._lru if e.keep_until > now]

    # -- making room ----------------------------------------------------------
    def _eviction_plan(self, namespace: str, run: EvictionDryRun) -> list[tuple[Entry, str]] | None:
        """Unleased entries to drop (LRU first, with the reason) so that the new snapshot
        of ``run`` fits its group's quota and the global bounds (``run.new_bytes()``
        grows when a drop frees the path the new key shares); None when that is
        impossible. Nothing is changed. Lock held."""
        if self.max_entries < 1:
            return None
        total_b, total_e = self.nbytes, self._entries
        key = self._quota_key(namespace)
        quota = self._quotas.get(key)
        if quota is not None:
            group_b = self._quota_bytes(key)
            order = self._eviction_order()
            for e in order:
                if group_b + run.new_bytes() <= quota:
                    break
                if self._quota_key(e.namespace) == key:
                    freed = run.drop(e, "quota")
                    group_b -= freed
                    total_b -= freed
                    total_e -= 1
            if group_b + run.new_bytes() > quota:
                return None
        for e in self._eviction_order():
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

    def _drop(self, entry: Entry, spill: bool = True) -> None:
        """Remove an unleased entry from its tree and the accounting; with a disk tier,
        queue it for the disk unless ``spill`` is False. Lock held."""
        assert entry.leases == 0 and entry.alive
        if entry.keep_until > time.monotonic():
            self.metrics.kept_evicted.inc()  # memory forced out a breakpoint's prefix before its ttl
        self._lru.pop(entry, None)
        group = self._groups[entry.namespace]
        if spill and self._spills(entry.namespace):
            self.disk.evicted(self._spill_of(group, entry))
        group.tree.remove_value(entry.node)  # prunes the pages no snapshot needs any more
        self.version += 1
        entry.alive = False
        entry.node = None
        entry.private = None
        self._entries -= 1
        self._account(group, entry, -1)

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
            if namespace == owner or self._owners.get(namespace, owner) != owner:
                raise ValueError(f"{namespace!r} cannot be a companion of {owner!r}")
            self._owners[namespace] = owner
            self._shed(namespace)

    def _spills(self, namespace: str) -> bool:
        """Whether ``namespace``'s snapshots go to (and come from) the disk tier."""
        return self.disk is not None and namespace not in self._owners

    def _quota_key(self, namespace: str) -> str:
        """The namespace whose quota covers ``namespace`` (its owner, or itself)."""
        return self._owners.get(namespace, namespace)

    def _quota_bytes(self, key: str) -> int:
        """Bytes held under ``key``'s quota: its own and its companions'. Lock held."""
        return self.namespace_bytes(key) + sum(self.namespace_bytes(c) for c, o in self._owners.items() if o == key)

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
            for ns in self._quotas.keys() - quotas.keys():
                self.metrics.quota.remove(ns)
            self._quotas = {ns: int(q) for ns, q in quotas.items()}
            for ns, q in self._quotas.items():
                self.metrics.quota.labels(cache_group=ns).set(q)
                self._shed(ns)

    def _shed(self, namespace: str) -> None:
        """Drop unleased snapshots under ``namespace``'s quota (its own and its owner's or
        companions'), oldest first, while they are over it (eviction reason ``quota``).
        Lock held."""
        key = self._quota_key(namespace)
        q = self._quotas.get(key)
        if q is None or self._quota_bytes(key) <= q:
            return
        for e in [e for e in self._eviction_order() if self._quota_key(e.namespace) == key]:
            if self._quota_bytes(key) <= q:
                break
            self._drop(e)
            self.metrics.evictions.labels(reason="quota").inc()

    # -- a shared budget, a flush ---------------------------------------------
    def oldest_use(self) -> float | None:
        """Last use (monotonic seconds) of the snapshot :meth:`evict_oldest` would drop
        (``inf`` when only snapshots kept by a breakpoint are left); None when every
        snapshot is leased or none is stored (``budget.py``)."""
        with self._lock:
            head = next(iter(self._eviction_order()), None)
            if head is None:
                return None
            return head.used if head.keep_until <= time.monotonic() else float("inf")

    def evict_oldest(self, reason: str) -> bool:
        """Drop the least recently used unleased snapshot, those kept by a breakpoint last
        (to the disk tier, if any), counted as an eviction for ``reason``; False if there
        is none."""
        with self._lock:
            head = next(iter(self._eviction_order()), None)
            if head is None:
                return False
            self._drop(head)
            self.metrics.evictions.labels(reason=reason).inc()
        if self.disk is not None:
            self.disk.spill()
        return True

    def flush(self, namespace: str | None = None) -> int:
        """Drop every unleased snapshot of ``namespace`` and of its companions
        (:meth:`add_companion`; all namespaces if None).

        Returns:
            The number of snapshots dropped (leased ones are kept).
        """
        with self._lock:
            victims = [e for e in self._lru
                       if namespace is None or namespace in (e.namespace, self._owners.get(e.namespace))]
            for e in victims:
                self._drop(e, spill=False)
            if victims:
                self.metrics.evictions.labels(reason="flush").inc(len(victims))
            return len(victims)
