"""Where a prompt leaves the prefix cache, and what the cache knows of why.

:func:`prefix_report` answers, for a prompt and its namespace, without leasing, copying
or refreshing recency: how many of its tokens the namespace's tree holds, how many a fetch
would restore now (fewer on a cache that cannot be trimmed, where no snapshot sits at the
divergence), the stored tokens that continue where the prompt leaves the tree (none: the
stored keys end there, the prompt only adds to them), the other namespace holding a
longer prefix of it, and the longest evicted key that is a prefix of it
(:class:`EvictedKeys`, a bounded record the eviction part keeps).

Only token ids are read (no MLX array), under the manager's lock (taken per tree walk). The gateway turns the
answer into a cause (``gateway.telemetry.cache_explain``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

STORED_NEXT = 32  # stored tokens reported after the divergence (an excerpt's worth)
OTHER_GROUPS = 64  # other namespaces searched for a longer prefix
EVICTED_KEPT = 4096  # evicted keys remembered, all namespaces together
EVICTED_CHECKED = 128  # evicted keys compared against one prompt (the longest first)


def _digest(tokens: Any, n: int) -> int:
    """A hash of the first ``n`` token ids (``tokens``: their int64 bytes)."""
    return hash(tokens[:8 * n])


class EvictedKeys:
    """The keys of the last :data:`EVICTED_KEPT` dropped snapshots (length and a hash,
    never the tokens) with the wall-clock time (seconds since the epoch) each went.
    Not thread-safe: the manager's lock guards it."""

    def __init__(self, kept: int = EVICTED_KEPT):
        self.kept = kept
        self._keys: OrderedDict[tuple[str, int, int], float] = OrderedDict()

    def add(self, namespace: str, key: Sequence[int]) -> None:
        """Remember that the snapshot keyed ``key`` (token ids) left ``namespace`` now."""
        raw = np.asarray(key, dtype=np.int64).tobytes()
        k = (namespace, len(key), _digest(raw, len(key)))
        self._keys.pop(k, None)
        self._keys[k] = time.time()
        while len(self._keys) > self.kept:
            self._keys.popitem(last=False)

    def candidates(self, namespace: str, length: int, above: int) -> list[tuple[int, int, float]]:
        """``(tokens, hash, evicted_at)`` of the longest :data:`EVICTED_CHECKED` remembered
        keys of ``namespace`` longer than ``above`` and at most ``length`` tokens (lock held)."""
        return sorted(((n, h, t) for (ns, n, h), t in self._keys.items()
                       if ns == namespace and above < n <= length), reverse=True)[:EVICTED_CHECKED]

    @staticmethod
    def longest_prefix(candidates: list[tuple[int, int, float]], tokens: Sequence[int]) -> Optional[tuple[int, float]]:
        """The first of ``candidates`` (:meth:`candidates`) that is a prefix of ``tokens``:
        ``(tokens, evicted_at)``, or None (no lock needed)."""
        if not candidates:
            return None
        raw = np.asarray(tokens, dtype=np.int64).tobytes()
        return next(((n, t) for n, h, t in candidates if _digest(raw, n) == h), None)


@dataclass
class PrefixReport:
    """What the cache holds of one prompt (tokens throughout).

    Attributes:
        matched: tokens of the prompt its namespace's tree holds (a common prefix).
        restorable: tokens a fetch would restore now (``<= matched``, ``<= len - 1``).
        stored_next: up to :data:`STORED_NEXT` stored tokens that follow the ``matched``
            ones where the prompt has others; empty when no stored key goes on there.
        elsewhere: ``(namespace, matched)`` of the other namespace holding the longest
            prefix, when it is longer than ``matched``.
        evicted: ``(tokens, evicted_at)`` of the longest evicted key that is a prefix of
            the prompt longer than ``matched`` (wall-clock seconds), or None.
    """

    matched: int
    restorable: int
    stored_next: list[int]
    elsewhere: Optional[tuple[str, int]] = None
    evicted: Optional[tuple[int, float]] = None


def _stored_next(match: Any) -> list[int]:
    """The stored tokens after the point where a match stopped (any branch)."""
    node = match.below
    if node is None:
        return []
    if node.depth > match.matched:  # stopped inside this node's edge
        start = len(node.edge) - (node.depth - match.matched)
        return list(node.edge[start:start + STORED_NEXT])
    child = next(iter(node.children.values()), None)
    return [] if child is None else list(child.edge[:STORED_NEXT])


def prefix_report(lock: Any, groups: dict[str, Any], evicted: EvictedKeys, namespace: str, tokens: Sequence[int],
                  restorable: Callable[[], int]) -> PrefixReport:
    """The :class:`PrefixReport` of ``tokens`` in ``namespace``. The manager's ``lock`` is
    taken for each tree walk on its own (the engine thread is not held up for all of them);
    other namespaces are walked only while the prompt's own leaves tokens to find.

    Args:
        lock: the manager's lock.
        groups: the manager's namespaces (name -> ``entries.Group``).
        evicted: the eviction part's record of dropped keys.
        namespace: the prompt's namespace.
        tokens: the prompt (token ids).
        restorable: what a fetch would restore now (the manager's ``match_length``; lock held).
    """
    with lock:
        group = groups.get(namespace)
        matched, nxt = 0, []
        if group is not None:
            m = group.tree.match(tokens)
            matched, nxt = m.matched, _stored_next(m) if m.matched < len(tokens) else []
        restore = restorable()
        others = [ns for ns in groups if ns != namespace][:OTHER_GROUPS]
        cands = evicted.candidates(namespace, len(tokens), matched)
    best = None
    for ns in others if matched < len(tokens) - 1 else ():
        with lock:
            g = groups.get(ns)
            n = g.tree.match(tokens).matched if g is not None else 0
        if n > matched and (best is None or n > best[1]):
            best = (ns, n)
    return PrefixReport(matched, min(restore, matched), nxt, best, EvictedKeys.longest_prefix(cands, tokens))
