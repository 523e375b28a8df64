"""Which snapshots to evict so that a new one fits: a dry run over shared pages.

With paged KV (``pages.py``) dropping a snapshot frees its own non-paged layers, plus
the pages of every tree node left with no snapshot at or below it: its own node if
that is now a leaf, and upwards through valueless branch nodes whose other children
are gone too. Dropping a snapshot that has others below it frees only its own
layers. :class:`EvictionDryRun` follows those rules without touching the tree, so the
manager can tell *before* evicting anything whether an insert can fit at all (it is
refused, evicting nothing, when it cannot; ``manager.py``).

The new snapshot's own cost depends on the drops too: it needs pages only for the
tokens its key does not share with the tree, and a drop that frees part of that
shared path makes it pay for those tokens again (:meth:`EvictionDryRun.new_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .pages import pages_bytes


@dataclass
class NewKey:
    """The snapshot being inserted, as the dry run sees it.

    Attributes:
        tokens: its key's length (tokens).
        matched: tokens of the key already in the tree.
        below: the tree node where the match stopped (``Match.below``), or None.
        own_bytes: its non-paged layers (bytes).
        token_bytes: KV bytes per token of its paged layers.
    """

    tokens: int
    matched: int
    below: Any
    own_bytes: int
    token_bytes: int


class EvictionDryRun:
    """Simulated drops of unleased entries; counts the bytes they would free.

    Args:
        key: the snapshot to make room for.
    """

    def __init__(self, key: NewKey):
        self.key = key
        self.dropped: set[int] = set()  # ids of entries dropped so far
        self.freed: set[int] = set()  # ids of tree nodes whose pages are freed
        self._gone_children: dict[int, int] = {}  # node id -> children freed so far
        self.plan: list[tuple[Any, str]] = []

    def new_bytes(self) -> int:
        """Bytes the new snapshot takes after the drops so far: its own layers plus the
        KV of every token of its key that the tree will not hold."""
        keep = self.key.matched
        node = self.key.below
        while node is not None and node.parent is not None and id(node) in self.freed:
            keep = min(keep, node.parent.depth)
            node = node.parent
        return self.key.own_bytes + self.key.token_bytes * (self.key.tokens - keep)

    def drop(self, entry: Any, reason: str) -> int:
        """Simulate dropping ``entry`` (a manager ``Entry``); returns the bytes freed."""
        self.dropped.add(id(entry))
        self.plan.append((entry, reason))
        freed = entry.private_bytes
        node = entry.node
        while (
            node.parent is not None
            and len(node.children) == self._gone_children.get(id(node), 0)
            and (node.value is None or id(node.value) in self.dropped)
        ):
            freed += pages_bytes(node.pages)
            self.freed.add(id(node))
            self._gone_children[id(node.parent)] = self._gone_children.get(id(node.parent), 0) + 1
            node = node.parent
        return freed
