"""PromptCacheManager: snapshots in per-namespace radix trees, leases, LRU under two bounds.

Design sources:

- SGLang ``mem_cache/radix_cache.py``: compressed radix tree, lock refs that keep
  in-use state from being evicted, LRU eviction.
- vLLM v1 ``core/block_pool.py`` / ``kv_cache_manager.py``: reference counts, an
  O(1) free queue for eviction (here an ``OrderedDict`` of unleased entries), a hit
  capped at ``num_tokens - 1``, tenant isolation (``cache_salt``; here: namespaces).
- mlx-lm ``LRUPromptCache`` (models/cache.py) and its known problems: no refcounts,
  hits that do not refresh recency, a byte limit that is not enforced (mlx-lm
  #1390/#1807), inserting a longer entry deleting its stored prefixes. This manager
  does the opposite on each point.

Rules:

- A fetch returns the snapshot whose restore gives the most tokens, capped at
  ``len(tokens) - 1`` (so at least one token is processed and logits exist); see
  ``restore.py`` for which cache types can be trimmed. A longer stored entry (e.g.
  prompt + completion) serves a shorter query when all its layers are trimmable.
- A fetch with a hit takes a *lease* on the snapshot; a leased snapshot is not
  evictable and not flushable. Releasing the last lease puts the snapshot at the
  most-recently-used end (a hit refreshes recency).
- ``nbytes <= max_bytes`` and ``num_entries <= max_entries`` hold at every moment:
  an insert evicts least recently used unleased snapshots first and is refused
  (returns False, evicting nothing) when even evicting all of them would not make
  room. Inserting a longer key never drops its stored prefixes.
- Byte accounting uses each layer's ``.nbytes`` (whole buffers); buffers shared by
  two snapshots (copy-on-write) are counted twice, so the bound is conservative.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from prometheus_client import CollectorRegistry

from . import restore as rules
from .metrics import CacheMetrics
from .tree import Node, RadixTree

# How many subtree nodes a lookup inspects for a longer, trimmable entry.
_BELOW_SEARCH_LIMIT = 64


class _Entry:
    """One stored snapshot (internal)."""

    __slots__ = ("namespace", "node", "cache", "num_tokens", "nbytes", "by_type", "leases", "alive")

    def __init__(self, namespace: str, cache: list[Any], num_tokens: int, by_type: dict[str, int]):
        self.namespace = namespace
        self.node: Node | None = None
        self.cache = cache
        self.num_tokens = num_tokens
        self.by_type = by_type
        self.nbytes = sum(by_type.values())
        self.leases = 0
        self.alive = True


class Lease:
    """An opaque hold on one snapshot; pass it to :meth:`PromptCacheManager.release`."""

    __slots__ = ("_entry", "id", "released")

    def __init__(self, entry: _Entry, lease_id: int):
        self._entry = entry
        self.id = lease_id
        self.released = False

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.id} {state} {self._entry.num_tokens} tokens>"


@dataclass
class CacheHit:
    """Result of :meth:`PromptCacheManager.fetch`.

    Attributes:
        cache: a private copy of the layer caches restored to exactly
            ``cached_tokens`` tokens, or None when nothing usable was found.
        cached_tokens: tokens covered by ``cache`` (0 on a miss; ``<= len(tokens)-1``).
        lease: the lease to release when the request no longer needs the snapshot
            kept (None on a miss).
        timings: seconds per phase: ``lookup``, ``copy``, ``restore``.
    """

    cache: list[Any] | None = None
    cached_tokens: int = 0
    lease: Lease | None = None
    timings: dict[str, float] = field(default_factory=dict)


class PromptCacheManager:
    """A bounded, leased, namespaced prefix cache of mlx-lm prompt-cache snapshots.

    Args:
        max_bytes: bound on the bytes of all stored snapshots (sum of ``.nbytes``).
        max_entries: bound on the number of stored snapshots.
        registry: prometheus ``CollectorRegistry`` for the metrics (see
            ``metrics.py``); a fresh private one if None (several managers may
            coexist in one process).

    Thread-safe: one ``RLock`` guards the trees and the accounting; copying and
    trimming a fetched snapshot happen outside the lock (the lease protects it).

    Raises:
        ValueError: for negative bounds.
    """

    def __init__(self, max_bytes: int, max_entries: int, registry: CollectorRegistry | None = None):
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("max_bytes and max_entries must be >= 0")
        self.max_bytes = int(max_bytes)
        self.max_entries = int(max_entries)
        self.metrics = CacheMetrics(registry)
        self.registry = self.metrics.registry
        self._lock = threading.RLock()
        # Bumped whenever an entry is stored or dropped: a match_length answer stays
        # valid while it is unchanged (the admission policy memoizes on it).
        self.version = 0
        self._trees: dict[str, RadixTree] = {}
        self._lru: OrderedDict[_Entry, None] = OrderedDict()  # unleased entries, oldest first
        self._bytes = 0
        self._leased_bytes = 0
        self._entries = 0
        self._num_leases = 0
        self._lease_ids = itertools.count(1)
        self._gauge: dict[tuple[str, str], list[int]] = {}  # (type, ns) -> [bytes, entries]
        self._ns_bytes: dict[str, int] = {}  # namespace -> bytes stored
        self._quotas: dict[str, int] = {}  # namespace -> byte quota

    # -- properties -----------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of all stored snapshots."""
        return self._bytes

    @property
    def num_entries(self) -> int:
        """Stored snapshots."""
        return self._entries

    @property
    def num_leases(self) -> int:
        """Leases handed out and not yet released."""
        return self._num_leases

    def namespace_bytes(self, namespace: str) -> int:
        """Bytes stored for ``namespace``."""
        return self._ns_bytes.get(namespace, 0)

    def set_quotas(self, quotas: dict[str, int]) -> None:
        """Set per-namespace byte quotas (within ``max_bytes``), replacing earlier ones.

        A namespace over its new quota sheds unleased snapshots, oldest first, now
        (eviction reason ``quota``); one leased now goes when its last lease is released.
        Namespaces absent from ``quotas`` have none.

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
        """Drop unleased snapshots of ``namespace``, oldest first, while it is over its
        quota (eviction reason ``quota``). Lock held."""
        q = self._quotas.get(namespace)
        if q is None or self.namespace_bytes(namespace) <= q:
            return
        for e in [e for e in self._lru if e.namespace == namespace]:
            if self.namespace_bytes(namespace) <= q:
                break
            self._drop(e)
            self.metrics.evictions.labels(reason="quota").inc()

    # -- lookup ---------------------------------------------------------------
    def _select(self, namespace: str, tokens: Sequence[int]) -> tuple[_Entry, int] | None:
        """The entry and restore length giving the most tokens (<= len-1), or None. Lock held."""
        tree = self._trees.get(namespace)
        limit = len(tokens) - 1
        if tree is None or limit < 1:
            return None
        m = tree.match(tokens)
        best: tuple[_Entry, int] | None = None
        # 1) entries at or below the divergence point share `matched` tokens.
        t_below = min(m.matched, limit)
        if m.below is not None and t_below > 0:
            for node in tree.descendants_with_value(m.below, _BELOW_SEARCH_LIMIT):
                e = node.value
                if rules.can_restore(e.cache, node.depth, t_below):
                    best = (e, t_below)
                    break
        # 2) entries on the path (whole key is a prefix of the query), deepest first.
        for node in reversed(m.path):
            t = min(node.depth, limit)
            if best is not None and t <= best[1]:
                break
            if rules.can_restore(node.value.cache, node.depth, t):
                best = (node.value, t)
                break
        return best

    def match_length(self, namespace: str, tokens: Sequence[int]) -> int:
        """Tokens :meth:`fetch` would restore now, without leasing, copying or refreshing recency."""
        with self._lock:
            sel = self._select(namespace, tokens)
        return 0 if sel is None else sel[1]

    def fetch(self, namespace: str, tokens: Sequence[int], count: bool = True) -> CacheHit:
        """Find, lease, copy and restore the best snapshot for ``tokens``.

        Args:
            namespace: the cache group; entries of other namespaces are never used.
            tokens: the full prompt (token ids).
            count: count the lookup in the hit-rate metrics (False for the server's
                own background work, e.g. next-turn precompute).

        Returns:
            A :class:`CacheHit`; ``hit.cache`` is None on a miss. The caller owns
            ``hit.cache`` and must :meth:`release` ``hit.lease`` when done.
        """
        t0 = time.perf_counter()
        with self._lock:
            sel = self._select(namespace, tokens)
            lease = None
            if sel is not None:
                entry, _ = sel
                lease = Lease(entry, next(self._lease_ids))
                self._acquire(entry)
            if count:
                self.metrics.queries.labels(cache_group=namespace).inc()
                self.metrics.query_tokens.labels(cache_group=namespace).inc(len(tokens))
        t1 = time.perf_counter()
        timings = {"lookup": t1 - t0, "copy": 0.0, "restore": 0.0}
        if sel is None:
            if count:
                self.metrics.fetch_seconds.labels(phase="lookup").observe(timings["lookup"])
            return CacheHit(None, 0, None, timings)
        entry, target = sel
        try:
            cache = rules.safe_copy(entry.cache)
            t2 = time.perf_counter()
            rules.restore(cache, entry.num_tokens, target)
            t3 = time.perf_counter()
        except BaseException:
            self.release(lease)
            raise
        timings["copy"] = t2 - t1
        timings["restore"] = t3 - t2
        if count:
            for phase, secs in timings.items():
                self.metrics.fetch_seconds.labels(phase=phase).observe(secs)
            self.metrics.hits.labels(cache_group=namespace).inc()
            self.metrics.hit_tokens.labels(cache_group=namespace).inc(target)
        return CacheHit(cache, target, lease, timings)

    # -- leases ---------------------------------------------------------------
    def _acquire(self, entry: _Entry) -> None:
        if entry.leases == 0:
            self._lru.pop(entry, None)
            self._leased_bytes += entry.nbytes
        entry.leases += 1
        self._num_leases += 1
        self.metrics.leases.set(self._num_leases)

    def release(self, lease: Lease | None) -> None:
        """Release a lease from :meth:`fetch`. Idempotent; ``None`` is ignored."""
        if lease is None:
            return
        with self._lock:
            if lease.released:
                return
            lease.released = True
            entry = lease._entry
            entry.leases -= 1
            self._num_leases -= 1
            if entry.leases == 0:
                self._leased_bytes -= entry.nbytes
                if entry.alive:
                    self._lru[entry] = None  # most recently used end
                    self._shed(entry.namespace)  # its quota shrank while it was leased
            self.metrics.leases.set(self._num_leases)

    # -- insert / evict -------------------------------------------------------
    def refresh(self, namespace: str, tokens: Sequence[int]) -> bool:
        """If a snapshot keyed exactly ``tokens`` is stored, mark it recently used and
        return True (the caller need not build one to :meth:`insert`)."""
        with self._lock:
            tree = self._trees.get(namespace)
            node = tree.find(tokens) if tree is not None else None
            if node is None or node.value is None:
                return False
            if node.value.leases == 0:
                self._lru.move_to_end(node.value)
            return True

    def insert(self, namespace: str, tokens: Sequence[int], cache: list[Any]) -> bool:
        """Store ``cache`` as the snapshot after ``tokens``; the manager takes ownership.

        Args:
            namespace: the cache group.
            tokens: the key (token ids); the snapshot covers exactly these.
            cache: list of layer caches after exactly ``len(tokens)`` tokens. The
                caller must not write it afterwards (hand over a
                ``restore.safe_copy`` if you keep using yours).

        Returns:
            True if stored (or the key was already stored: its recency is
            refreshed and ``cache`` is dropped); False if refused because the
            bounds cannot be met without evicting leased snapshots.

        Raises:
            ValueError: if a layer's ``offset`` disagrees with ``len(tokens)``.
        """
        n = len(tokens)
        if n == 0:
            return False
        off = rules.token_count(cache)
        if off is not None and off != n:
            raise ValueError(f"cache covers {off} tokens but the key has {n}")
        if self.refresh(namespace, tokens):
            return True
        by_type = rules.nbytes_by_type(cache)
        mx.eval(rules.cache_arrays(cache))
        entry = _Entry(namespace, list(cache), n, by_type)
        with self._lock:
            tree = self._trees.setdefault(namespace, RadixTree())
            node = tree.find(tokens)
            if node is not None and node.value is not None:  # raced with another insert
                if node.value.leases == 0:
                    self._lru.move_to_end(node.value)
                return True
            plan = self._eviction_plan(namespace, entry.nbytes)
            if plan is None:
                return False
            for victim, reason in plan:
                self._drop(victim)
                self.metrics.evictions.labels(reason=reason).inc()
            node = tree.insert(tokens)
            tree.set_value(node, entry)
            self.version += 1
            entry.node = node
            self._lru[entry] = None
            self._bytes += entry.nbytes
            self._entries += 1
            self._account(entry, +1)
            return True

    def _eviction_plan(self, namespace: str, nbytes: int) -> list[tuple[_Entry, str]] | None:
        """Unleased entries to drop (LRU first, with the reason) so that a new
        ``nbytes``-byte entry of ``namespace`` fits its group's quota and the global
        bounds; None when that is impossible. Nothing is changed. Lock held."""
        if nbytes > self.max_bytes or self.max_entries < 1:
            return None
        plan: list[tuple[_Entry, str]] = []
        chosen: set[int] = set()
        total_b, total_e = self._bytes, self._entries
        quota = self._quotas.get(namespace)
        if quota is not None:
            group_b = self.namespace_bytes(namespace)
            for e in self._lru:
                if group_b + nbytes <= quota:
                    break
                if e.namespace == namespace:
                    plan.append((e, "quota"))
                    chosen.add(id(e))
                    group_b -= e.nbytes
                    total_b -= e.nbytes
                    total_e -= 1
            if group_b + nbytes > quota:
                return None
        for e in self._lru:
            if total_e + 1 <= self.max_entries and total_b + nbytes <= self.max_bytes:
                break
            if id(e) in chosen:
                continue
            plan.append((e, "bytes" if total_b + nbytes > self.max_bytes else "entries"))
            total_b -= e.nbytes
            total_e -= 1
        if total_e + 1 > self.max_entries or total_b + nbytes > self.max_bytes:
            return None
        return plan

    def _drop(self, entry: _Entry) -> None:
        """Remove an unleased entry from its tree and the accounting. Lock held."""
        assert entry.leases == 0 and entry.alive
        self._lru.pop(entry, None)
        tree = self._trees[entry.namespace]
        tree.remove_value(entry.node)
        self.version += 1
        entry.alive = False
        entry.node = None
        entry.cache = None
        self._bytes -= entry.nbytes
        self._entries -= 1
        self._account(entry, -1)

    def _account(self, entry: _Entry, sign: int) -> None:
        for typ, b in entry.by_type.items():
            g = self._gauge.setdefault((typ, entry.namespace), [0, 0])
            g[0] += sign * b
            g[1] += sign
            self.metrics.bytes.labels(cache_type=typ, cache_group=entry.namespace).set(g[0])
            self.metrics.entries.labels(cache_type=typ, cache_group=entry.namespace).set(g[1])
        self._ns_bytes[entry.namespace] = self._ns_bytes.get(entry.namespace, 0) + sign * entry.nbytes

    def flush(self, namespace: str | None = None) -> int:
        """Drop every unleased snapshot of ``namespace`` (all namespaces if None).

        Returns:
            The number of snapshots dropped (leased ones are kept).
        """
        with self._lock:
            victims = [e for e in self._lru if namespace is None or e.namespace == namespace]
            for e in victims:
                self._drop(e)
            if victims:
                self.metrics.evictions.labels(reason="flush").inc(len(victims))
            for ns in [ns for ns, t in self._trees.items() if t.size == 0]:
                del self._trees[ns]
            return len(victims)

    # -- debugging ------------------------------------------------------------
    def sanity_check(self) -> None:
        """Assert the tree invariants (``tree.py``) and the accounting. O(entries + nodes).

        Checks: bounds hold; byte/entry totals and per-(type, namespace) gauges
        equal the sums over live entries; every unleased entry is in the LRU and no
        leased one is; lease counts add up; each snapshot's ``offset`` equals its
        node depth.

        Raises:
            AssertionError: on the first inconsistency.
        """
        with self._lock:
            seen: list[_Entry] = []
            current = [""]

            def check(node: Node) -> None:
                e = node.value
                assert isinstance(e, _Entry) and e.alive and e.node is node
                assert e.namespace == current[0], "entry in another namespace's tree"
                assert e.num_tokens == node.depth
                off = rules.token_count(e.cache)
                assert off is None or off == node.depth
                assert (e.leases == 0) == (e in self._lru)
                seen.append(e)

            for ns, tree in self._trees.items():
                current[0] = ns
                tree.sanity_check(check)
            assert len(seen) == self._entries
            assert sum(e.nbytes for e in seen) == self._bytes
            assert sum(e.nbytes for e in seen if e.leases) == self._leased_bytes
            assert sum(e.leases for e in seen) == self._num_leases
            assert len(self._lru) == sum(1 for e in seen if e.leases == 0)
            assert self._bytes <= self.max_bytes, "byte bound broken"
            assert self._entries <= self.max_entries, "entry bound broken"
            for ns, q in self._quotas.items():
                assert self.namespace_bytes(ns) <= q or all(
                    e.leases for e in seen if e.namespace == ns
                ), f"quota of {ns} broken"
                assert self.namespace_bytes(ns) == sum(e.nbytes for e in seen if e.namespace == ns)
            sums: dict[tuple[str, str], list[int]] = {}
            for e in seen:
                for typ, b in e.by_type.items():
                    s = sums.setdefault((typ, e.namespace), [0, 0])
                    s[0] += b
                    s[1] += 1
            for key, g in self._gauge.items():
                assert sums.get(key, [0, 0]) == g, f"gauge {key}"
