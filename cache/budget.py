"""One byte bound over the prefix caches of several models, least recently used first.

A gateway serving several models keeps one :class:`~cache.manager.PromptCacheManager`
per model (their snapshots have different shapes, and each model's disk tier is keyed
by its identity), each with its own bound (the model's share). A :class:`CacheBudget`
bounds their sum: after each insert, and whenever the bound shrinks (a model's weights
were loaded), the least recently used unleased snapshot *across all of them* is dropped
until the sum fits (eviction reason ``budget``; a dropped snapshot goes to its model's
disk tier when it has one). Leased snapshots are never dropped, so the sum can stay
above the bound while requests hold more than it; it comes back under it as they end.

Recency is each snapshot's last use (``time.monotonic()``), comparable across managers.
Used on the thread that owns MLX (dropping a snapshot frees MLX arrays), like the
managers themselves.
"""

from __future__ import annotations

import threading
from typing import Optional, Protocol


class Bounded(Protocol):
    """What the budget needs of a prompt cache: its eviction part (:class:`cache.lru.LRUEviction`)."""

    @property
    def nbytes(self) -> int: ...

    def oldest_use(self) -> Optional[float]: ...

    def evict_oldest(self, reason: str) -> bool: ...


class CacheBudget:
    """A byte bound shared by several prompt-cache managers (see the module docstring).

    Args:
        max_bytes: bound on the sum of the managers' ``nbytes`` (bytes).

    Raises:
        ValueError: a negative bound.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = int(max_bytes)
        self._managers: list[Bounded] = []
        self._lock = threading.Lock()

    def join(self, manager: Bounded) -> None:
        """Count ``manager`` under this bound (a model was loaded)."""
        with self._lock:
            if manager not in self._managers:
                self._managers.append(manager)

    def leave(self, manager: Bounded) -> None:
        """Stop counting ``manager`` (its model was unloaded)."""
        with self._lock:
            if manager in self._managers:
                self._managers.remove(manager)

    @property
    def nbytes(self) -> int:
        """Bytes held by every manager together (thread-safe read)."""
        with self._lock:
            managers = list(self._managers)
        return sum(m.nbytes for m in managers)

    def set_max_bytes(self, max_bytes: int) -> int:
        """A new bound; drops snapshots now if the sum is over it (MLX thread). Returns
        the number dropped."""
        self.max_bytes = max(0, int(max_bytes))
        return self.enforce()

    def enforce(self) -> int:
        """Drop least recently used unleased snapshots, across every manager, until the
        sum fits the bound or only leased ones are left (MLX thread). Returns the number
        dropped."""
        dropped = 0
        while True:
            with self._lock:
                managers = list(self._managers)
            if sum(m.nbytes for m in managers) <= self.max_bytes:
                return dropped
            oldest = [(m.oldest_use(), i) for i, m in enumerate(managers)]
            candidates = [(used, i) for used, i in oldest if used is not None]
            if not candidates:
                return dropped
            _, i = min(candidates)
            if not managers[i].evict_oldest("budget"):
                return dropped
            dropped += 1
