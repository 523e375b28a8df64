"""PromptCacheManager: snapshots in per-namespace radix trees, leases, LRU under two bounds.

Design sources:

- SGLang ``mem_cache/radix_cache.py``: compressed radix tree, lock refs that keep
  in-use state from being evicted, LRU eviction.
- vLLM v1 ``core/block_pool.py`` / ``kv_cache_manager.py``: reference counts, an
  O(1) free queue for eviction (here an ``OrderedDict`` of unleased entries), a hit
  capped at ``num_tokens - 1``, tenant isolation (``cache_salt``; here: namespaces).
- mlx-lm ``LRUPromptCache`` (models/cache.py), whose known problems (no refcounts, hits
  that do not refresh recency, an unenforced byte limit: mlx-lm #1390/#1807, a longer
  entry deleting its stored prefixes) this manager does the opposite of.

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
- Full-attention KV is paged (``pages.py``): each unique token's KV is held once per
  namespace, on the tree edge it belongs to, and counted once. Other layers are
  held per snapshot and counted with their ``.nbytes``. Eviction drops whole
  snapshots (``lru.py``); their pages go when no snapshot at or below them remains
  (``eviction.py`` predicts the bytes an eviction frees).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from prometheus_client import CollectorRegistry

from . import restore as rules
from .entries import Entry, Group, compact, path_pages
from .budget import CacheBudget
from .eviction import EvictionDryRun, NewKey
from .invariants import check_manager
from .leases import CacheHit, Lease, Leases
from .lru import LRUEviction
from .metrics import CacheMetrics
from .pages import PAGED_TYPE, assemble, is_paged, layout, token_bytes
from .prefix_report import PrefixReport, prefix_report
from .tiering import DiskLink, Spill

log = logging.getLogger(__name__)

# How many subtree nodes a lookup inspects for a longer, trimmable entry.
_BELOW_SEARCH_LIMIT = 64


class PromptCacheManager:
    """A bounded, leased, namespaced prefix cache of mlx-lm prompt-cache snapshots.

    Full-attention KV is stored once per unique token per namespace, in pages on the
    tree's edges (``pages.py``); other layer types are kept whole per snapshot. The
    recency order and the evictions (quotas, companions, the shared budget, flushes) are
    its part :attr:`eviction` (:class:`cache.lru.LRUEviction`).

    Args:
        max_bytes: bound on the bytes held: every page once, plus every snapshot's own
            non-paged layers (``.nbytes``).
        max_entries: bound on the number of stored snapshots.
        registry: prometheus ``CollectorRegistry`` for the metrics (``metrics.py``); a
            fresh private one if None (several managers may coexist in one process).
        budget: a byte bound shared with the prefix caches of other models
            (``budget.py``): after each insert, least recently used snapshots across
            all of them are dropped until their sum fits. None: only this manager's bounds.

    Thread-safe: one ``RLock`` guards the trees and the accounting; assembling and
    trimming a fetched snapshot happen outside the lock (the lease protects it).

    Raises:
        ValueError: for negative bounds.
    """

    def __init__(self, max_bytes: int, max_entries: int, registry: CollectorRegistry | None = None,
                 budget: CacheBudget | None = None):
        if max_bytes < 0 or max_entries < 0:
            raise ValueError("max_bytes and max_entries must be >= 0")
        self.max_bytes = int(max_bytes)
        self.max_entries = int(max_entries)
        self.metrics = CacheMetrics(registry)
        self.registry = self.metrics.registry
        self._lock = threading.RLock()
        self.version = 0  # bumped when an entry is stored or dropped (admission memoizes match_length on it)
        self._groups: dict[str, Group] = {}
        self._entries = 0
        self.disk: DiskLink | None = None
        self.eviction = LRUEviction(  # late-bound calls: the distributed ranks replace _drop
            self._lock, self.metrics, self.max_bytes, self.max_entries, nbytes=lambda: self.nbytes,
            namespace_bytes=self.namespace_bytes, num_entries=lambda: self._entries,
            drop=lambda e, spill: self._drop(e, spill), disk=lambda: self.disk)
        self.leases = Leases(self.eviction, self.metrics)
        self.budget = budget
        if budget is not None:
            budget.join(self.eviction)

    def attach_disk(self, link: "DiskLink") -> None:
        """Use a disk tier (``tiering.py``): evicted snapshots go to it, lookups that memory serves poorly try it."""
        self.disk = link

    # -- properties -----------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held: pages once each, plus the snapshots' own layers. Safe from any
        thread (a metrics scrape reads it while the engine inserts)."""
        with self._lock:
            return sum(g.nbytes for g in self._groups.values())

    @property
    def num_entries(self) -> int:
        """Stored snapshots."""
        return self._entries

    @property
    def num_leases(self) -> int:
        """Leases handed out and not yet released."""
        return self.leases.count

    def namespace_bytes(self, namespace: str) -> int:
        """Bytes held for ``namespace``."""
        return getattr(self._groups.get(namespace), "nbytes", 0)

    def namespace_tokens(self, namespace: str) -> int:
        """Unique tokens whose KV pages are held for ``namespace``."""
        return getattr(self._groups.get(namespace), "tokens", 0)

    # -- lookup ---------------------------------------------------------------
    def _select(self, namespace: str, tokens: Sequence[int], whole: bool = False) -> tuple[Entry, int] | None:
        """The entry and restore length giving the most tokens (<= len-1; with ``whole``,
        all of ``tokens`` where an entry restores them, else as without), or None. Lock held."""
        group = self._groups.get(namespace)
        if group is None:
            return None
        if whole:
            sel = group.tree.best_restore(tokens, _BELOW_SEARCH_LIMIT, whole=True)
            if sel is not None and sel[1] == len(tokens):
                return sel
        return group.tree.best_restore(tokens, _BELOW_SEARCH_LIMIT)

    def match_length(self, namespace: str, tokens: Sequence[int]) -> int:
        """Tokens :meth:`fetch` would restore now, without leasing, copying or refreshing recency."""
        with self._lock:
            sel = self._select(namespace, tokens)
        return 0 if sel is None else sel[1]

    def report(self, namespace: str, tokens: Sequence[int]) -> PrefixReport:
        """Where ``tokens`` leave the cache of ``namespace`` and what else holds them
        (:func:`cache.prefix_report.prefix_report`); leases, copies and refreshes nothing."""
        return prefix_report(self._lock, self._groups, self.eviction.evicted, namespace, tokens,
                             lambda: self.match_length(namespace, tokens))

    def namespaces(self) -> list[str]:
        """The namespaces that hold snapshots now."""
        with self._lock:
            return [ns for ns, g in self._groups.items() if g.tree.size]

    def fetch(self, namespace: str, tokens: Sequence[int], count: bool = True, whole: bool = False) -> CacheHit:
        """Find, lease, assemble and restore the best snapshot for ``tokens``.

        Args:
            namespace: the cache group; entries of other namespaces are never used.
            tokens: the full prompt (token ids).
            count: count the lookup in the hit-rate metrics (False for the server's
                own background work, e.g. next-turn precompute).
            whole: the caller knows the logits after ``tokens`` (an exact repeat,
                :mod:`scheduler.batch.first_tokens`): restore all of them where an entry can,
                else as without.

        With a disk tier, an entry on disk that restores more than memory would is read
        into memory first (``hit.source == "disk"``); that runs on the calling thread.

        Returns:
            A :class:`CacheHit`; ``hit.cache`` is None on a miss. The caller owns
            ``hit.cache`` and must :meth:`release` ``hit.lease`` when done.
        """
        t0 = time.perf_counter()
        from_disk = self.eviction.spills(namespace) and self._load_from_disk(namespace, tokens)
        with self._lock:
            sel = self._select(namespace, tokens, whole)
            if sel is not None:
                entry, target = sel
                lease = self.leases.take(entry)
                path, private = path_pages(entry.node), entry.private
            if count:
                self.metrics.looked_up(self.eviction.owners.get(namespace, namespace), len(tokens))
        t1 = time.perf_counter()
        timings = {"lookup": t1 - t0}
        if sel is None:
            if count:
                self.metrics.fetched(self.eviction.owners.get(namespace, namespace), timings, 0)
            return CacheHit(None, 0, None, {**timings, "copy": 0.0, "restore": 0.0})
        try:
            own = rules.safe_copy(private)
            for layer in own:
                if layer is not None and entry.num_tokens > target:
                    layer.trim(entry.num_tokens - target)
            t2 = time.perf_counter()
            cache = assemble(own, path, target)  # paged layers are copied where they are used
            mx.eval(rules.cache_arrays([c for c in own if c is not None]))
            t3 = time.perf_counter()
        except BaseException:
            self.release(lease)
            raise
        timings["copy"] = t2 - t1  # the snapshot's own layers: copied and trimmed
        timings["restore"] = t3 - t2  # paged layers: pages concatenated
        if count:
            self.metrics.fetched(self.eviction.owners.get(namespace, namespace), timings, target)
        return CacheHit(cache, target, lease, timings, "disk" if from_disk else "memory")

    def _load_from_disk(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Bring the disk entry that beats memory for ``tokens`` into memory; True if one did."""
        try:
            got = self.disk.load(namespace, tokens, self.match_length(namespace, tokens))
            return got is not None and self.insert(namespace, *got)
        except Exception:
            log.exception("restoring a snapshot from the disk tier failed")
            return False

    def release(self, lease: Lease | None) -> None:
        """Release a lease from :meth:`fetch`. Idempotent; ``None`` is ignored."""
        if lease is not None:
            with self._lock:
                self.leases.give_back(lease)

    # -- insert ---------------------------------------------------------------
    def refresh(self, namespace: str, tokens: Sequence[int], keep_for: float | None = None) -> bool:
        """If a snapshot keyed exactly ``tokens`` is stored, mark it recently used (and
        kept for ``keep_for`` seconds more, if given) and return True (the caller need not
        build one to :meth:`insert`)."""
        with self._lock:
            group = self._groups.get(namespace)
            node = group.tree.find(tokens) if group is not None else None
            if node is None or node.value is None:
                return False
            self.eviction.used(node.value, keep_for)
            return True

    def insert(self, namespace: str, tokens: Sequence[int], cache: list[Any], keep_for: float | None = None) -> bool:
        """Store ``cache`` as the snapshot after ``tokens``; the manager takes ownership.
        With ``keep_for`` (seconds: a cache breakpoint's ttl), it is evicted only after
        every snapshot without one, until that time has passed.

        Only the KV of tokens not yet held in ``namespace`` is copied into new pages;
        the other layers are compacted (a view would pin its parent's whole buffer).

        Args:
            namespace: the cache group.
            tokens: the key (token ids); the snapshot covers exactly these.
            cache: list of layer caches after exactly ``len(tokens)`` tokens (views
                into a batch buffer are fine). The caller must not write it afterwards.

        Returns:
            True if stored (or the key was already stored: its recency is
            refreshed and ``cache`` is dropped); False if refused because the
            bounds cannot be met without evicting leased snapshots.

        Raises:
            ValueError: if a layer's ``offset`` disagrees with ``len(tokens)``, or its
                paged layers differ in shape or dtype from the namespace's snapshots.
        """
        n = len(tokens)
        if n == 0:
            return False
        off = rules.token_count(cache)
        if off is not None and off != n:
            raise ValueError(f"cache covers {off} tokens but the key has {n}")
        if self.refresh(namespace, tokens, keep_for):
            return True
        shape = layout(cache)
        private = [None if is_paged(c) else c for c in cache]
        for layer in private:
            if layer is not None:
                layer.state = tree_map(compact, layer.state)
        mx.eval(rules.cache_arrays([c for c in private if c is not None]))
        entry = Entry(namespace, private, n, rules.is_trimmable(cache))
        with self._lock:
            group = self._groups.setdefault(namespace, Group())
            if group.layout is None or group.tree.size == 0:
                group.layout = shape
            elif group.layout != shape:
                raise ValueError("snapshot's KV layers differ in shape or dtype from the namespace's")
            m = group.tree.match(tokens)
            node = m.below if m.matched == n and m.below is not None and m.below.depth == n else None
            if node is not None and node.value is not None:  # raced with another insert
                self.eviction.used(node.value, keep_for)
                return True
            run = EvictionDryRun(NewKey(n, m.matched, m.below, entry.private_bytes, token_bytes(cache)))
            plan = self._eviction_plan(namespace, run)
            if plan is None:
                return False
            for victim, reason in plan:
                self._drop(victim, True)
                self.metrics.evictions.labels(reason=reason).inc()
            node = group.tree.insert(tokens)
            if node.pages is None:
                group.add_pages(node, cache)
            group.tree.set_value(node, entry)
            self.version += 1
            entry.node = node
            self.eviction.add(entry)
            self.eviction.used(entry, keep_for)
            self._entries += 1
            self._account(group, entry, +1)
        if self.budget is not None:
            self.budget.enforce()  # the models' caches together, least recently used first
        if self.disk is not None:
            self.disk.spill()  # what this insert evicted
        return True

    def _eviction_plan(self, namespace: str, run: EvictionDryRun) -> list[tuple[Entry, str]] | None:
        """:meth:`cache.lru.LRUEviction.plan` (the distributed ranks record and replay it). Lock held."""
        return self.eviction.plan(namespace, run)

    def _drop(self, entry: Entry, spill: bool = True) -> None:
        """Remove an unleased entry from its tree, the recency order and the accounting;
        with a disk tier, queue it for the disk if ``spill``. Lock held."""
        assert entry.leases == 0 and entry.alive
        if entry.keep_until > time.monotonic():
            self.metrics.kept_evicted.inc()  # memory forced out a breakpoint's prefix before its ttl
        self.eviction.discard(entry)
        group = self._groups[entry.namespace]
        self.eviction.evicted.add(entry.namespace, group.tree.key(entry.node))
        if spill and self.eviction.spills(entry.namespace):
            self.disk.evicted(self._spill_of(group, entry))
        group.tree.remove_value(entry.node)  # prunes the pages no snapshot needs any more
        self.version += 1
        entry.alive = False
        entry.node = None
        entry.private = None
        self._entries -= 1
        self._account(group, entry, -1)

    def _account(self, group: Group, entry: Entry, sign: int) -> None:
        """Update totals and gauges after ``entry`` was stored (+1) or dropped (-1); an emptied
        companion's gauges go (an adapter's namespace is one per load: unbounded). Lock held."""
        group.count(entry, sign)
        self.metrics.held(entry.namespace, group.by_type, group.page_bytes, group.tokens, PAGED_TYPE,
                          drop_empty=entry.namespace in self.eviction.owners)

    def forget(self, namespaces: Sequence[str]) -> int:
        """Drop the unleased snapshots of ``namespaces`` (and of their companions) and each one
        left empty (its tree, companion link, gauges): namespaces nothing asks for again (an
        unloaded LoRA adapter's: ``scheduler/lora``). Returns the snapshots dropped."""
        with self._lock:
            namespaces = {*namespaces, *(c for c, o in self.eviction.owners.items() if o in namespaces)}
            dropped = sum(self.eviction.flush(ns) for ns in namespaces)
            for ns in namespaces:
                if ns in self._groups and not self._groups[ns].tree.size:
                    del self._groups[ns]
                    self.eviction.owners.pop(ns, None)
            return dropped

    def close(self) -> None:
        """Leave the shared budget, if any (the model is unloaded)."""
        if self.budget is not None:
            self.budget.leave(self.eviction)

    # -- disk tier --------------------------------------------------------------
    def _spill_of(self, group: Group, entry: Entry) -> Spill:
        """What the disk tier needs of ``entry`` (references, no copy). Lock held."""
        return Spill(entry.namespace, group.tree.key(entry.node), path_pages(entry.node),
                     entry.private, entry.trimmable)

    def persist(self, timeout: float | None = None) -> int:
        """Write the stored snapshots to the disk tier (a graceful shutdown), most recently
        used first, and wait up to ``timeout`` seconds for the writes. A trimmable
        snapshot with longer ones below it is left out (they restore it). Runs on the
        thread that owns MLX; a no-op without a disk tier.

        Returns the number of snapshots submitted.
        """
        if self.disk is None:
            return 0
        with self._lock:
            leased = [n.value for g in self._groups.values() for n in g.tree.nodes()  # not in the LRU
                      if n.value is not None and n.value.leases]
            live = [e for e in (*self.eviction, *leased) if e.alive]
            spills = [self._spill_of(self._groups[e.namespace], e) for e in reversed(live)
                      if not (e.trimmable and e.node.children) and self.eviction.spills(e.namespace)]
        return self.disk.persist(spills, timeout)

    def sanity_check(self) -> None:
        """Assert the tree invariants, the pages and the accounting (``invariants.py``).
        Raises AssertionError on the first inconsistency."""
        with self._lock:
            check_manager(self)
