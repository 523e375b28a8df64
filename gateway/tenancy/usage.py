"""Per-tenant usage for ``GET /v1/usage``: totals since start and over the current window.

The window is the current clock minute (``window_seconds`` aligned to the Unix
epoch), the same span as the per-minute rate limits. Event-loop thread only.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

WINDOW_SECONDS = 60


@dataclass
class Counts:
    """Requests and tokens (prompt tokens include the cached ones)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class UsageBook:
    """Usage counters per tenant name."""

    def __init__(self, clock: Callable[[], float] = time.time, window_seconds: int = WINDOW_SECONDS):
        self.clock = clock
        self.window_seconds = window_seconds
        self.started = int(clock())
        self._total: dict[str, Counts] = {}
        self._window: dict[str, tuple[int, Counts]] = {}

    def _current(self, tenant: str) -> tuple[Counts, Counts]:
        start = int(self.clock()) // self.window_seconds * self.window_seconds
        w = self._window.get(tenant)
        if w is None or w[0] != start:
            w = self._window[tenant] = (start, Counts())
        return self._total.setdefault(tenant, Counts()), w[1]

    def add(self, tenant: str, requests: int = 0, prompt: int = 0, cached: int = 0, completion: int = 0) -> None:
        """Count usage of ``tenant`` now."""
        for c in self._current(tenant):
            c.requests += requests
            c.prompt_tokens += prompt
            c.cached_tokens += cached
            c.completion_tokens += completion

    def report(self, tenant: str) -> dict:
        """The JSON answer for one tenant."""
        total, window = self._current(tenant)
        start = self._window[tenant][0]
        return {"object": "usage", "tenant": tenant,
                "window": {"start": start, "seconds": self.window_seconds, **asdict(window)},
                "total": {"since": self.started, **asdict(total)}}
