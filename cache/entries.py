"""What the prompt-cache manager stores: snapshot entries, per-namespace groups whose
radix tree edges own KV pages (``manager.py`` is the policy; ``leases.py`` the holds on them)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import restore as rules
from .pages import PAGED_TYPE, Page, cut, pages_bytes, split_pages
from .tree import Node, RadixTree


class Entry:
    """One stored snapshot (internal): its node, its own (non-paged) layers, its leases.

    ``private`` is the layer list with ``None`` where a layer is paged (its KV lives in
    the pages along ``node``'s path, see ``pages.py``).
    """

    __slots__ = ("namespace", "node", "private", "num_tokens", "private_bytes", "by_type",
                 "trimmable", "leases", "alive", "used", "keep_until")

    def __init__(self, namespace: str, private: list[Any], num_tokens: int, trimmable: bool):
        self.namespace = namespace
        self.node: Node | None = None
        self.private = private
        self.num_tokens = num_tokens
        self.trimmable = trimmable
        self.by_type = rules.nbytes_by_type([c for c in private if c is not None])
        for c in private:
            if c is None:
                self.by_type.setdefault(PAGED_TYPE, 0)
        self.private_bytes = sum(self.by_type.values())
        self.leases = 0
        self.alive = True
        self.used = 0.0  # monotonic seconds of its last use (stored, hit or released)
        self.keep_until = 0.0  # monotonic seconds until which a cache breakpoint keeps it

    def can_restore(self, wanted: int) -> bool:
        """Can this snapshot be brought to exactly ``wanted`` tokens (``restore.py`` rules)?"""
        return rules.restorable(self.num_tokens, wanted, self.trimmable)


class Group:
    """One namespace: its radix tree, whose edges own pages (``pages.py``), and its totals.

    Also the tree's hooks: keeps ``page_bytes`` and ``tokens`` (unique tokens with
    pages) in step when edges are split, merged or pruned.
    """

    def __init__(self) -> None:
        self.tree = RadixTree(hooks=self)
        self.layout: tuple | None = None  # paged-layer signature of its snapshots
        self.page_bytes = 0
        self.tokens = 0
        self.private_bytes = 0
        self.by_type: dict[str, list[int]] = {}  # class name -> [private bytes, entries]

    @property
    def nbytes(self) -> int:
        return self.page_bytes + self.private_bytes

    def split(self, upper: Node, lower: Node, k: int) -> None:
        upper.pages, lower.pages = split_pages(lower.pages, k)

    def merge(self, node: Node, child: Node) -> None:
        child.pages = node.pages + child.pages

    def prune(self, node: Node) -> None:
        self.page_bytes -= pages_bytes(node.pages)
        self.tokens -= len(node.edge)
        node.pages = None

    def count(self, entry: Entry, sign: int) -> None:
        """Count ``entry``'s own bytes in the totals: stored (+1) or dropped (-1)."""
        self.private_bytes += sign * entry.private_bytes
        for typ, b in entry.by_type.items():
            g = self.by_type.setdefault(typ, [0, 0])
            g[0] += sign * b
            g[1] += sign

    def add_pages(self, node: Node, cache: list[Any]) -> None:
        """Give a new leaf the pages of its edge, cut from ``cache``."""
        node.pages = [cut(cache, node.parent.depth, node.depth)]
        self.page_bytes += node.pages[0].nbytes
        self.tokens += len(node.edge)


def path_pages(node: Node) -> list[Page]:
    """The pages from the root down to ``node``, in token order. Lock held."""
    parts = []
    while node.parent is not None:
        parts.append(node.pages)
        node = node.parent
    return [p for pages in reversed(parts) for p in pages]


def compact(x):
    """A compact copy of an array (a view pins its parent's buffer); other leaves as they are."""
    return mx.contiguous(x) if isinstance(x, mx.array) else x
