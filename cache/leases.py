"""Leases: a fetched snapshot (:class:`CacheHit`) is held until released, and a held one is never evicted.

:class:`Leases` is the book of a manager's leases (:class:`cache.manager.PromptCacheManager`):
taking the first lease on an entry takes it out of the recency order, so it can be
neither evicted nor flushed; releasing the last one puts it back at the most recently
used end (a hit refreshes recency), and sheds its namespace's quota if it shrank meanwhile.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from .entries import Entry
from .lru import LRUEviction
from .metrics import CacheMetrics


class Lease:
    """An opaque hold on one snapshot; pass it to :meth:`PromptCacheManager.release`."""

    __slots__ = ("_entry", "id", "released")

    def __init__(self, entry: Entry, lease_id: int):
        self._entry = entry
        self.id = lease_id
        self.released = False

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Lease {self.id} {state} {self._entry.num_tokens} tokens>"


class Leases:
    """The leases handed out on one manager's entries (see the module docstring). The
    caller holds the manager's lock for every call.

    Args:
        eviction: the manager's recency order and evictions.
        metrics: where the ``leases`` gauge goes.
    """

    def __init__(self, eviction: LRUEviction, metrics: CacheMetrics):
        self.count = 0  # handed out and not yet released
        self._ids = itertools.count(1)
        self._eviction = eviction
        self._metrics = metrics

    def take(self, entry: Entry) -> Lease:
        """A new lease on ``entry``."""
        if entry.leases == 0:
            self._eviction.discard(entry)
        entry.leases += 1
        self.count += 1
        self._metrics.leases.set(self.count)
        return Lease(entry, next(self._ids))

    def give_back(self, lease: Lease) -> None:
        """End ``lease``; a second call is a no-op."""
        if lease.released:
            return
        lease.released = True
        entry = lease._entry
        entry.leases -= 1
        self.count -= 1
        if entry.leases == 0 and entry.alive:
            self._eviction.add(entry)  # most recently used end
            self._eviction.shed(entry.namespace)  # its quota shrank while it was leased
        self._metrics.leases.set(self.count)


@dataclass
class CacheHit:
    """Result of :meth:`PromptCacheManager.fetch`.

    Attributes:
        cache: a private copy of the layer caches restored to exactly
            ``cached_tokens`` tokens, or None when nothing usable was found.
        cached_tokens: tokens covered by ``cache`` (0 on a miss; ``<= len(tokens)-1``,
            or ``len(tokens)`` for a ``whole`` fetch).
        lease: the lease to release when the request no longer needs the snapshot
            kept (None on a miss).
        timings: seconds per phase: ``lookup``, ``copy``, ``restore``.
        source: ``"memory"``, or ``"disk"`` when the snapshot was read from the disk
            tier for this fetch.
    """

    cache: list[Any] | None = None
    cached_tokens: int = 0
    lease: Lease | None = None
    timings: dict[str, float] = field(default_factory=dict)
    source: str = "memory"
