"""A hash index of token prefixes, so the admission policy finds which in-flight
request shares the longest prefix with a waiting one in O(log L) dictionary lookups
instead of comparing the two prompts token by token (O(L) Python steps per pair).

A prompt's prefix is hashed at every :data:`BLOCK` tokens as a chain
(``h[k] = hash((h[k-1], block k))``, seeded with the cache namespace), computed once per
request and kept on it. Since ``h[k]`` covers the whole prefix up to block ``k``, "the
other prompt shares ``k`` blocks" is monotone in ``k`` and a binary search over one
prompt's hashes, tested against the other's hash set, finds the shared block prefix;
the last partial block is then compared exactly. The same
block-hash chain keys vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``).

A hash collision (64-bit) could only misjudge whether a request should wait for a
shared prefix: what the prefix cache restores is always matched token by token.
"""

from __future__ import annotations

from typing import Generic, Sequence, TypeVar

BLOCK = 16  # tokens per hashed block

T = TypeVar("T")


class PrefixKey:
    """A prompt's chain hashes (``hashes[k]`` covers its first ``(k+1) * BLOCK`` tokens)
    and the same hashes as a set, for O(1) membership tests."""

    __slots__ = ("hashes", "members")

    def __init__(self, namespace: str, tokens: Sequence[int]) -> None:
        h = hash(namespace)
        hashes = []
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            h = hash((h, tuple(tokens[start:start + BLOCK])))
            hashes.append(h)
        self.hashes = hashes
        self.members = frozenset(hashes)


def shared_blocks(query: PrefixKey, other: PrefixKey) -> int:
    """Full blocks the two prompts share from the start (binary search, O(log L))."""
    hashes, members = query.hashes, other.members
    lo, hi = 0, len(hashes)  # invariant: the first `lo` blocks are shared
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in members:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_prefix(tokens: Sequence[int], key: PrefixKey, other_tokens: Sequence[int], other: PrefixKey) -> int:
    """Exact common-prefix length (tokens) of two prompts: whole blocks by hash, then at
    most one block and a tail compared token by token."""
    i = shared_blocks(key, other) * BLOCK
    n = min(len(tokens), len(other_tokens))
    while i < n and tokens[i] == other_tokens[i]:
        i += 1
    return i


class PrefixIndex(Generic[T]):
    """A few values (requests in prefill, or chosen in one pick) with their prompts.

    :meth:`longest` returns, for a query prompt, every value that shares at least one
    block with it and the exact shared length: O(values x log L) hash lookups and at most
    a block of token comparisons per value, instead of O(values x L).
    """

    def __init__(self) -> None:
        self._items: list[tuple[T, Sequence[int], PrefixKey]] = []

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, value: T, tokens: Sequence[int], key: PrefixKey) -> None:
        """Index ``value``, whose prompt is ``tokens`` with prefix key ``key``."""
        self._items.append((value, tokens, key))

    def longest(self, tokens: Sequence[int], key: PrefixKey) -> list[tuple[T, int]]:
        """``(value, shared tokens)`` for each value sharing at least one full block with
        ``tokens``, longest first."""
        out = []
        for value, other_tokens, other in self._items:
            if key.hashes and key.hashes[0] in other.members:
                out.append((value, shared_prefix(tokens, key, other_tokens, other)))
        out.sort(key=lambda x: -x[1])
        return out
