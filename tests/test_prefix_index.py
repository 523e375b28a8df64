"""The policy's prefix index gives the exact common-prefix length a token-by-token
comparison gives, and the radix tree's bisecting comparison does too."""

from __future__ import annotations

import random

from cache.checkpoints import common_prefix
from cache.tree import _common
from scheduler.admission.prefix_index import BLOCK, PrefixIndex, PrefixKey


def test_shared_prefix_is_exact_on_random_branches():
    rng = random.Random(3)
    base = [rng.randrange(100) for _ in range(600)]
    prompts = []
    for _ in range(60):
        cut = rng.randrange(0, 600)
        tail = [rng.randrange(100) for _ in range(rng.randrange(0, 80))]
        prompts.append(base[:cut] + tail)
    index = PrefixIndex()
    for i, p in enumerate(prompts[:8]):
        index.add(i, p, PrefixKey("ns", p))
    for q in prompts[8:]:
        got = dict(index.longest(q, PrefixKey("ns", q)))
        for i, p in enumerate(prompts[:8]):
            want = common_prefix(q, p)
            if want >= BLOCK:
                assert got[i] == want, (i, got[i], want)
            else:
                assert i not in got or got[i] == want


def test_other_namespaces_share_nothing():
    p = list(range(200))
    index = PrefixIndex()
    index.add("a", p, PrefixKey("group-a", p))
    assert index.longest(p, PrefixKey("group-b", p)) == []
    assert index.longest(p, PrefixKey("group-a", p)) == [("a", 200)]


def test_tree_edge_comparison_matches_a_plain_loop():
    rng = random.Random(5)
    for _ in range(300):
        edge = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 700)))
        a = list(edge[: rng.randrange(0, len(edge) + 1)]) + [rng.randrange(4) for _ in range(rng.randrange(0, 50))]
        a0 = rng.randrange(0, 3)
        a = [9] * a0 + a
        assert _common(a, a0, edge) == common_prefix(a[a0:], edge)
