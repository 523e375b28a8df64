"""Next-turn precompute: prefill what a conversation's next request will start with.

When a chat reply finishes, the gateway renders the conversation plus that reply the
way the template will show it in the next request (a thinking model's ``<think>``
block dropped, the reply re-tokenized as the client will send it back) up to where
the next user message begins, and hands the tokens to the engine as a
:class:`Precompute`. The engine prefills it only when it has nothing else to do (no
request waiting, prefilling or decoding), in budget-sized chunks, and drops it the
moment a request arrives (chunk granularity: that request's first token waits at most
one chunk). The prefix lands in the prompt cache like any snapshot. It becomes due
:data:`GRACE` seconds after the reply ended *and* after the engine last served a
request (:meth:`PrecomputeBook.hold`): a client that sends its next request at once
(an agent, a script, the next round of a burst) finds the engine free rather than busy
with a chunk of precompute.

This module is the bookkeeping: the pending queue (newest first, bounded) and the
accounting of precomputed tokens later *used* by a real request's cache hit or
*wasted* (the conversation went on without them).
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client import CollectorRegistry, Counter

_IDS = itertools.count(1)
GRACE = 0.1  # seconds from a reply's end before its precompute may start


@dataclass
class Precompute:
    """A lowest-priority prefill of ``tokens`` (the next turn's shared prefix) into the
    prefix cache of ``namespace``; nothing is generated for it."""

    tokens: list[int]
    namespace: str = "default"
    tenant: str = "default"
    id: str = ""
    due: float = field(default_factory=lambda: time.monotonic() + GRACE)  # monotonic seconds

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"precompute-{next(_IDS)}"


@dataclass
class _Stored:
    namespace: str
    tokens: array
    start: int  # tokens already cached when it was prefilled


class PrecomputeMetrics:
    """``mlx_gateway_precompute_total{outcome}`` and ``mlx_gateway_precompute_tokens_total{outcome}``."""

    def __init__(self, registry: CollectorRegistry):
        self.runs = Counter(
            "mlx_gateway_precompute", "Next-turn precomputes by outcome: stored, preempted (a request "
            "arrived), dropped (queue full), cached (nothing to compute), failed.",
            ["outcome"], registry=registry)
        self.tokens = Counter(
            "mlx_gateway_precompute_tokens", "Next-turn precompute tokens: computed, later used by a "
            "request's cache hit, or wasted (the conversation moved on without using them).",
            ["outcome"], registry=registry)
        for o in ("stored", "preempted", "dropped", "cached", "failed"):
            self.runs.labels(o)
        for o in ("computed", "used", "wasted"):
            self.tokens.labels(o)


class PrecomputeBook:
    """Pending precomputes and the use of stored ones (engine thread only).

    A stored precompute is *used* when a request's cache hit reaches into the tokens it
    computed (counted once), and *wasted* when it is forgotten unused: a newer stored
    precompute of the same namespace extends its tokens (the conversation moved on
    without it), or more than ``max_tracked`` of the namespace are tracked. Tokens are
    kept as compact arrays (8 bytes each).

    Args:
        metrics: where outcomes are counted.
        max_pending: precomputes waiting to run; adding one more drops the oldest.
        max_tracked: stored precomputes tracked per namespace.
    """

    def __init__(self, metrics: PrecomputeMetrics, max_pending: int = 16, max_tracked: int = 32):
        self.metrics = metrics
        self.max_pending = max_pending
        self.max_tracked = max_tracked
        self._pending: deque[Precompute] = deque()
        self._held_until = 0.0  # monotonic seconds; see hold()
        self._stored: dict[str, deque[_Stored]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, p: Precompute) -> None:
        """Queue ``p``; it replaces pending precomputes of its namespace whose tokens it
        extends (the conversation moved on)."""
        kept = deque(q for q in self._pending if not (q.namespace == p.namespace and _extends(p.tokens, q.tokens)))
        for _ in range(len(self._pending) - len(kept)):
            self.metrics.runs.labels("dropped").inc()
        kept.appendleft(p)
        while len(kept) > self.max_pending:
            kept.pop()
            self.metrics.runs.labels("dropped").inc()
        self._pending = kept

    def clear(self) -> None:
        """Drop every pending precompute (the engine stops)."""
        self._pending.clear()

    def hold(self) -> None:
        """The engine is serving requests: no precompute is due before :data:`GRACE`
        seconds from now."""
        self._held_until = time.monotonic() + GRACE

    def seconds_until_due(self) -> Optional[float]:
        """Seconds until the newest pending precompute may start (0: now); None if none."""
        if not self._pending:
            return None
        return max(0.0, self._pending[0].due - time.monotonic(), self._held_until - time.monotonic())

    def pop(self) -> Optional[Precompute]:
        """The newest pending precompute, or None."""
        return self._pending.popleft() if self._pending else None

    def outcome(self, name: str) -> None:
        self.metrics.runs.labels(name).inc()

    def stored(self, p: Precompute, start: int) -> None:
        """``p`` is in the prefix cache; tokens ``start:`` were computed for it."""
        computed = len(p.tokens) - start
        self.metrics.tokens.labels("computed").inc(computed)
        self.metrics.runs.labels("stored").inc()
        tracked = self._stored.setdefault(p.namespace, deque())
        tokens = array("q", p.tokens)
        for s in [s for s in tracked if _extends(tokens, s.tokens)]:
            tracked.remove(s)  # superseded by this one
            self._forget(s)
        tracked.append(_Stored(p.namespace, tokens, start))
        while len(tracked) > self.max_tracked:
            self._forget(tracked.popleft())

    def on_hit(self, namespace: str, tokens: list[int], cached: int) -> None:
        """A request of ``namespace`` restored ``cached`` tokens of ``tokens``: credit the
        stored precompute whose computed tokens that reached into (once; it is then no
        longer tracked)."""
        tracked = self._stored.get(namespace)
        if not tracked:
            return
        for s in tracked:
            m = min(cached, len(s.tokens))
            if m > s.start and array("q", tokens[:m]) == s.tokens[:m]:
                tracked.remove(s)
                self.metrics.tokens.labels("used").inc(m - s.start)
                return

    def _forget(self, s: _Stored) -> None:
        wasted = len(s.tokens) - s.start
        self.metrics.tokens.labels("wasted").inc(wasted)


def _extends(longer, shorter) -> bool:
    """``longer`` starts with ``shorter`` (token lists or arrays of one kind)."""
    return len(longer) >= len(shorter) and longer[:len(shorter)] == shorter
