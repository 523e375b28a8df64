"""Stored responses in this process's memory (``--responses-store memory``): lost at exit.

One least-recently-used table per tenant (an ordered dict of id -> (entry JSON, last use)),
bounded by count and bytes. Called on the event loop only (no I/O, no locks).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Optional

from gateway.protocols.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_RESPONSES, Outcome, check_bounds


class MemoryBackend:
    """Per-tenant LRU tables bounded by ``max_responses`` and ``max_bytes``; an entry unused
    for ``ttl`` seconds (None: never) expires. ``clock``: seconds, for the TTL.

    Raises:
        ValueError: from the constructor, for a bound below 1.
    """

    blocking = False
    torn_at_open = 0

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl: Optional[float] = None, clock: Callable[[], float] = time.time):
        check_bounds(max_responses, max_bytes)
        self.max_responses, self.max_bytes, self.ttl, self.clock = max_responses, max_bytes, ttl, clock
        self._tables: dict[str, OrderedDict[str, tuple[bytes, float]]] = {}
        self._bytes: dict[str, int] = {}

    def describe(self) -> str:
        return "memory"

    def totals(self) -> dict[str, tuple[int, int]]:
        return {t: self._totals(t) for t in self._tables}

    def _totals(self, tenant: str) -> tuple[int, int]:
        return len(self._tables.get(tenant, ())), self._bytes.get(tenant, 0)

    def _drop(self, tenant: str, rid: str) -> bool:
        table = self._tables.get(tenant)
        entry = table.pop(rid, None) if table is not None else None
        if entry is None:
            return False
        self._bytes[tenant] -= len(entry[0])
        if not table:
            del self._tables[tenant], self._bytes[tenant]
        return True

    def _expire(self, tenant: str, now: float) -> None:
        table = self._tables.get(tenant)
        while self.ttl is not None and table and next(iter(table.values()))[1] < now - self.ttl:
            self._drop(tenant, next(iter(table)))

    def put(self, tenant: str, rid: str, body: bytes) -> Outcome:
        now = self.clock()
        self._drop(tenant, rid)
        self._expire(tenant, now)
        if len(body) > self.max_bytes:
            return Outcome(False, *self._totals(tenant))
        table = self._tables.setdefault(tenant, OrderedDict())
        table[rid] = (body, now)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + len(body)
        evicted = 0
        while len(table) > self.max_responses or self._bytes[tenant] > self.max_bytes:
            _, (old, _) = table.popitem(last=False)
            self._bytes[tenant] -= len(old)
            evicted += 1
        return Outcome(True, *self._totals(tenant), evicted=evicted)

    def get(self, tenant: str, rid: str) -> Outcome:
        now = self.clock()
        self._expire(tenant, now)
        table = self._tables.get(tenant)
        entry = table.get(rid) if table is not None else None
        if entry is None:
            return Outcome(False, *self._totals(tenant))
        table[rid] = (entry[0], now)
        table.move_to_end(rid)
        return Outcome(True, *self._totals(tenant), body=entry[0])

    def delete(self, tenant: str, rid: str) -> Outcome:
        done = self._drop(tenant, rid)
        return Outcome(done, *self._totals(tenant))

    def close(self) -> None:
        self._tables.clear()
        self._bytes.clear()
