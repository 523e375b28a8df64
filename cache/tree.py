"""A compressed token prefix tree (radix tree) whose nodes may hold snapshots.

Idea from SGLang's ``mem_cache/radix_cache.py`` (compressed edges keyed by their
first token); unlike SGLang, a node holds a whole per-layer cache *snapshot*
(SGLang's ``MambaRadixCache`` does the same for recurrent state) instead of a KV
index range, and leases are per snapshot (see ``manager.py``).

Invariants (checked by :meth:`RadixTree.sanity_check`):

1. The root has an empty edge and depth 0; every other node has a non-empty edge
   and ``depth == parent.depth + len(edge)``.
2. ``parent.children[edge[0]] is node`` for every non-root node.
3. A non-root node without a snapshot has at least two children (edges are
   compressed; dead leaves and chain nodes are removed or merged).
4. ``node.value.node is node`` for every node holding a value.

Lookup walks at most ``len(tokens)`` tokens of edges: O(matched length).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any


class Node:
    """One tree node: ``edge`` (tuple of token ids from the parent), ``depth`` (tokens from root)."""

    __slots__ = ("edge", "depth", "parent", "children", "value", "pages")

    def __init__(self, edge: tuple[int, ...], depth: int, parent: "Node | None"):
        self.edge = edge
        self.depth = depth
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.value: Any = None
        self.pages: Any = None  # the edge's data, owned by the tree's hooks (pages.py)


class Match:
    """Result of :meth:`RadixTree.match`.

    Attributes:
        matched: tokens of the query found in the tree (``<= len(query)``).
        path: nodes holding a value whose whole key is a prefix of the query,
            shallowest first (their ``depth <= matched``).
        below: the node whose subtree holds every key that shares exactly
            ``matched`` tokens with the query beyond ``path`` (or None); values in
            that subtree have ``depth >= matched``.
    """

    __slots__ = ("matched", "path", "below")

    def __init__(self, matched: int, path: list[Node], below: Node | None):
        self.matched = matched
        self.path = path
        self.below = below


def _common(a: Sequence[int], a0: int, b: tuple[int, ...]) -> int:
    """Length of the common prefix of ``a[a0:]`` and ``b``."""
    n = min(len(a) - a0, len(b))
    i = 0
    # compare in blocks at C speed (tuple equality)
    block = 256
    while i + block <= n and tuple(a[a0 + i : a0 + i + block]) == b[i : i + block]:
        i += block
    # then bisect the first mismatch in the last block, still comparing slices in C
    hi = min(n, i + block)
    while i < hi:
        mid = (i + hi + 1) // 2
        if tuple(a[a0 + i : a0 + mid]) == b[i:mid]:
            i = mid
        else:
            hi = mid - 1
    return i


class RadixTree:
    """A token radix tree mapping token sequences to values (here: snapshot entries).

    Not thread-safe; the manager holds its lock around every call.

    Args:
        hooks: optional object told about edge changes, to keep per-edge data
            (``node.pages``) in step: ``split(upper, lower, k)`` after an edge was
            split ``k`` tokens in (``upper`` is the new node), ``merge(node, child)``
            before a valueless ``node`` is merged into its only child, and
            ``prune(node)`` after a dead leaf was removed.
    """

    def __init__(self, hooks: Any = None) -> None:
        self.root = Node((), 0, None)
        self.size = 0  # nodes holding a value
        self.hooks = hooks

    # -- lookup ---------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> Match:
        """Walk ``tokens`` down the tree; O(matched tokens)."""
        node = self.root
        pos = 0
        path: list[Node] = []
        n = len(tokens)
        while True:
            if node.value is not None and node is not self.root:
                path.append(node)
            if pos == n:
                return Match(pos, path, node)
            child = node.children.get(tokens[pos])
            if child is None:
                return Match(pos, path, node)
            k = _common(tokens, pos, child.edge)
            if k < len(child.edge):
                return Match(pos + k, path, child)
            pos += k
            node = child

    def find(self, tokens: Sequence[int]) -> Node | None:
        """The node whose key is exactly ``tokens`` (with or without a value), or None."""
        m = self.match(tokens)
        node = m.below
        if m.matched == len(tokens) and node is not None and node.depth == len(tokens):
            return node
        return None

    def best_restore(self, tokens: Sequence[int], search_limit: int = 64,
                     whole: bool = False) -> tuple[Any, int] | None:
        """The value whose restore gives the most of ``tokens``, capped at ``len(tokens) - 1``
        (so at least one token is computed and logits exist; with ``whole``, at
        ``len(tokens)``: the caller has the logits), and that many tokens; or None.

        Values must have ``can_restore(wanted_tokens) -> bool``. Candidates: values at or
        below the point where ``tokens`` leaves the tree (they share ``matched`` tokens;
        BFS, at most ``search_limit`` nodes), and values on the path, deepest first.
        O(matched tokens + search_limit).
        """
        limit = len(tokens) - (0 if whole else 1)
        if limit < 1:
            return None
        m = self.match(tokens)
        best: tuple[Any, int] | None = None
        t_below = min(m.matched, limit)
        if m.below is not None and t_below > 0:
            for node in self.descendants_with_value(m.below, search_limit):
                if node.value.can_restore(t_below):
                    best = (node.value, t_below)
                    break
        for node in reversed(m.path):
            t = min(node.depth, limit)
            if best is not None and t <= best[1]:
                break
            if node.value.can_restore(t):
                best = (node.value, t)
                break
        return best

    def descendants_with_value(self, node: Node, limit: int) -> Iterator[Node]:
        """Value-holding nodes in ``node``'s subtree, shallowest first (BFS), at most ``limit`` visited."""
        queue = [node]
        i = 0
        while i < len(queue) and i < limit:
            cur = queue[i]
            i += 1
            if cur.value is not None:
                yield cur
            queue.extend(cur.children.values())

    # -- mutation -------------------------------------------------------------
    def insert(self, tokens: Sequence[int]) -> Node:
        """Return the node for key ``tokens``, creating/splitting nodes as needed."""
        node = self.root
        pos = 0
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                new = Node(tuple(tokens[pos:]), n, node)
                node.children[tokens[pos]] = new
                return new
            k = _common(tokens, pos, child.edge)
            if k < len(child.edge):
                # split child's edge at k
                mid = Node(child.edge[:k], node.depth + k, node)
                node.children[tokens[pos]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                if self.hooks is not None:
                    self.hooks.split(mid, child, k)
                child = mid
            pos += k
            node = child
        return node

    def set_value(self, node: Node, value: Any) -> None:
        if node.value is None:
            self.size += 1
        node.value = value

    def remove_value(self, node: Node) -> None:
        """Drop ``node``'s value and restore invariant 3 (prune dead leaves, merge chains)."""
        if node.value is not None:
            self.size -= 1
        node.value = None
        self._compact(node)

    def _compact(self, node: Node) -> None:
        while node is not self.root and node.value is None:
            parent = node.parent
            assert parent is not None
            if not node.children:
                del parent.children[node.edge[0]]
                node.parent = None
                if self.hooks is not None:
                    self.hooks.prune(node)
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                if self.hooks is not None:
                    self.hooks.merge(node, child)
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
                node.parent = None
                node.children = {}
            return

    def key(self, node: Node) -> list[int]:
        """The full token key of ``node`` (O(depth))."""
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.edge)
            node = node.parent
        out: list[int] = []
        for e in reversed(parts):
            out.extend(e)
        return out

    def nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def sanity_check(self, check_value: Callable[[Node], None] | None = None) -> None:
        """Assert invariants 1-4 (and ``check_value(node)`` for value nodes). O(tree size).

        Raises:
            AssertionError: on the first broken invariant.
        """
        assert self.root.edge == () and self.root.depth == 0 and self.root.parent is None
        count = 0
        for node in self.nodes():
            for t, child in node.children.items():
                assert child.parent is node, "parent link"
                assert len(child.edge) > 0, "empty edge"
                assert child.edge[0] == t, "child keyed by first edge token"
                assert child.depth == node.depth + len(child.edge), "depth"
            if node is not self.root and node.value is None:
                assert len(node.children) >= 2, "uncompressed node without value"
            if node.value is not None:
                count += 1
                if check_value is not None:
                    check_value(node)
        assert count == self.size, f"size {self.size} != {count}"
