"""Invariants of :class:`cache.manager.PromptCacheManager`, asserted by its ``sanity_check``
(tests call it after every operation; it is O(tree size), never on the serving path)."""

from __future__ import annotations

from typing import Any

from . import restore as rules
from .entries import Entry
from .pages import pages_bytes
from .tree import Node


def check_manager(mgr: Any) -> None:
    """Assert the tree invariants (``tree.py``), the pages and the accounting. O(tree size).

    Checks: bounds hold; every non-root node holds pages covering exactly its edge,
    and the page bytes and unique tokens per namespace equal their sums; entry,
    byte and per-(type, namespace) totals equal the sums over live entries; every
    unleased entry is in the LRU and no leased one is; lease counts add up; each
    snapshot's ``offset`` equals its node depth.

    Raises:
        AssertionError: on the first inconsistency.
    """
    seen: list[Entry] = []
    for ns, group in mgr._groups.items():
        def check(node: Node, ns: str = ns) -> None:
            e = node.value
            assert isinstance(e, Entry) and e.alive and e.node is node
            assert e.namespace == ns, "entry in another namespace's tree"
            assert e.num_tokens == node.depth
            off = rules.token_count([c for c in e.private if c is not None])
            assert off is None or off == node.depth
            assert (e.leases == 0) == (e in mgr.eviction)
            seen.append(e)

        group.tree.sanity_check(check)
        page_bytes = tokens = 0
        for node in group.tree.nodes():
            if node.parent is None:
                continue
            assert node.pages is not None and sum(p.length for p in node.pages) == len(node.edge)
            page_bytes += pages_bytes(node.pages)
            tokens += len(node.edge)
        assert (page_bytes, tokens) == (group.page_bytes, group.tokens), f"pages of {ns}"
        mine = [e for e in seen if e.namespace == ns]
        assert group.private_bytes == sum(e.private_bytes for e in mine)
        sums: dict[str, list[int]] = {}
        for e in mine:
            for typ, b in e.by_type.items():
                s = sums.setdefault(typ, [0, 0])
                s[0] += b
                s[1] += 1
        assert {t: g for t, g in group.by_type.items() if g != [0, 0]} == sums, f"gauges of {ns}"
    assert len(seen) == mgr._entries
    assert sum(e.leases for e in seen) == mgr.leases.count
    assert len(mgr.eviction) == sum(1 for e in seen if e.leases == 0)
    assert mgr.nbytes <= mgr.max_bytes, "byte bound broken"
    assert mgr._entries <= mgr.max_entries, "entry bound broken"
    for ns, q in mgr.eviction.quotas.items():
        assert mgr.eviction.quota_bytes(ns) <= q or all(
            e.leases for e in seen if mgr.eviction.quota_key(e.namespace) == ns
        ), f"quota of {ns} broken"
