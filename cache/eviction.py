"""Which snapshots to evict so that a new one fits: a dry run over shared pages.

With paged KV (``pages.py``) dropping a snapshot frees its own non-paged layers, plus
the pages of every tree node left with no snapshot at or below it: its own node if
that is now a leaf, and upwards through valueless branch nodes whose other children
are gone too. Dropping a snapshot that has others below it frees only its own
layers. :class:`EvictionDryRun` follows those rules without touching the tree, so the
manager can tell *before* evicting anything whether an insert can fit at all (it is
refused, evicting nothing, when it cannot; ``manager.py``).

The dry run never frees a *pinned* node (the path the new snapshot will hang from), so
the bytes it predicts are an upper bound on the bytes after the real evictions.
"""

from __future__ import annotations

from typing import Any

from .pages import pages_bytes


class EvictionDryRun:
    """Simulated drops of unleased entries; counts bytes and entries they would free.

    Args:
        pinned: ids of tree nodes that must not be counted as freed.
    """

    def __init__(self, pinned: set[int]):
        self.pinned = pinned
        self.dropped: set[int] = set()  # ids of entries dropped so far
        self._gone_children: dict[int, int] = {}  # node id -> children freed so far
        self.plan: list[tuple[Any, str]] = []

    def drop(self, entry: Any, reason: str) -> int:
        """Simulate dropping ``entry`` (a manager ``_Entry``); returns the bytes freed."""
        self.dropped.add(id(entry))
        self.plan.append((entry, reason))
        freed = entry.private_bytes
        node = entry.node
        while (
            node.parent is not None
            and id(node) not in self.pinned
            and len(node.children) == self._gone_children.get(id(node), 0)
            and (node.value is None or id(node.value) in self.dropped)
        ):
            freed += pages_bytes(node.pages or ())
            self._gone_children[id(node.parent)] = self._gone_children.get(id(node.parent), 0) + 1
            node = node.parent
        return freed
