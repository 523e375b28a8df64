"""Paged KV storage: each radix tree edge owns the KV of its own tokens, stored once.

A snapshot of ``L`` tokens used to be a whole copy of every layer's KV for tokens
``[0, L)``, so twenty snapshots along one conversation held the shared prefix twenty
times. Here the attention KV of a stored snapshot is split into *pages* hung on the
prefix tree's edges: the node for tokens ``[a, b)`` of a key holds the keys and
values of exactly those tokens for every paged layer, and every snapshot below it
shares them. Memory is then proportional to the unique tokens in the tree, like
SGLang's RadixAttention (``mem_cache/radix_cache.py``, a KV index range per radix
node) and vLLM's prefix caching (refcounted blocks shared by every request with
that prefix, copy-on-write where a branch diverges).

Unlike vLLM, pages are not fixed-size blocks: MLX models attend over one contiguous
``[B, H, T, D]`` buffer (no paged-attention kernel), so a restore concatenates pages
anyway, and aligning pages to tree edges makes that a handful of copies instead of
``T / block`` of them, with no partially filled last block. A page belongs to one
node; a node's pages are freed with the node when no stored snapshot is at or below
it (:class:`cache.tree.RadixTree` prunes it), which happens exactly once.

What is paged: the kinds whose ``paged`` column says so (:mod:`cache.kinds`): full-attention
layers, float (``KVCache``) or quantized (:class:`cache.quantized.QuantizedKVRow`,
``--kv-bits``: its keys and values are each a ``(packed, scales, biases)`` triple, paged
together). Everything else is kept whole per snapshot: recurrent state (``ArraysCache``), sliding windows (``RotatingKVCache``,
bounded by the window), list caches.

Edge operations (called by the tree, see ``RadixTree`` hooks):

- split an edge at ``k`` tokens: the page containing ``k`` is cut in two, each half
  a compact copy (a view would pin the whole old buffer and break the byte count);
- merge a valueless node into its only child: page lists are joined, no copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .kinds import kind_of
from .quantized import QuantizedKVRow

PAGED_TYPE = "KVCache"  # the cache_type label of paged bytes (float or quantized) in the metrics


class Page:
    """KV of ``length`` consecutive tokens for every paged layer of one snapshot layout.

    Attributes:
        arrays: every paged layer's arrays in layer order, keys then values: ``(k, v)``
            for a float layer, ``(k_packed, k_scales, k_biases, v_packed, v_scales,
            v_biases)`` for a quantized one; each ``[1, H, length, *]``, compact (own
            buffers, evaluated).
        length: tokens covered.
        kinds: per paged layer, ``None`` (float) or its ``(group_size, bits)``.
        nbytes: bytes of ``arrays`` (exact: no growth padding).
    """

    __slots__ = ("arrays", "length", "kinds", "nbytes")

    def __init__(self, arrays: tuple[mx.array, ...], length: int, kinds: tuple = ()):
        self.arrays = arrays
        self.length = length
        self.kinds = kinds
        self.nbytes = sum(int(a.nbytes) for a in arrays)


def _quantized(layer: Any) -> bool:
    return isinstance(layer.keys, (tuple, list))


def _leaves(layer: Any) -> list[mx.array]:
    """A paged layer's arrays, keys then values (two, or six when quantized)."""
    if _quantized(layer):
        return [*layer.keys, *layer.values]
    return [layer.keys, layer.values]


def _kind(layer: Any):
    """``None`` for a float layer, ``(group_size, bits)`` for a quantized one."""
    return (layer.group_size, layer.bits) if _quantized(layer) else None


def is_paged(layer: Any) -> bool:
    """True if ``layer`` (one mlx-lm layer cache) is stored as pages: its kind is ``paged``
    (:mod:`cache.kinds`; keys and values ``[1, H, >= offset, *]``, or triples of them when
    quantized, grown in 256-token steps) and it holds tokens."""
    return kind_of(layer).paged and getattr(layer, "keys", None) is not None


def layout(cache: Sequence[Any]) -> tuple:
    """The paged-layer signature of a snapshot: ``((layer index, kind, ((shape sans T,
    dtype), ...) of its arrays), ...)``. Snapshots stored in one tree must share it."""
    return tuple(
        (i, _kind(c), tuple((tuple(a.shape[:2]) + tuple(a.shape[3:]), str(a.dtype)) for a in _leaves(c)))
        for i, c in enumerate(cache) if is_paged(c)
    )


def cut(cache: Sequence[Any], start: int, end: int) -> Page:
    """A compact page of tokens ``[start, end)`` of the paged layers of ``cache``.

    Args:
        cache: a snapshot (list of layer caches) covering at least ``end`` tokens.
        start, end: token offsets, ``0 <= start < end``.
    """
    paged = [c for c in cache if is_paged(c)]
    arrays = [mx.contiguous(a[..., start:end, :]) for c in paged for a in _leaves(c)]
    mx.eval(arrays)
    return Page(tuple(arrays), end - start, tuple(_kind(c) for c in paged))


def token_bytes(cache: Sequence[Any]) -> int:
    """Bytes one token's KV takes in pages, over the paged layers of ``cache``."""
    return sum(a.nbytes // a.shape[2] for c in cache if is_paged(c) for a in _leaves(c))


def split_pages(pages: list[Page], k: int) -> tuple[list[Page], list[Page]]:
    """Split an edge's pages at token ``k`` (``0 < k < total``) into (first k, rest).

    Only the page containing ``k`` is copied (two compact halves); the others move as
    they are.
    """
    upper: list[Page] = []
    pos = 0
    for i, p in enumerate(pages):
        if pos + p.length <= k:
            upper.append(p)
            pos += p.length
            if pos == k:
                return upper, list(pages[i + 1 :])
            continue
        a = k - pos
        head = tuple(mx.contiguous(x[..., :a, :]) for x in p.arrays)
        tail = tuple(mx.contiguous(x[..., a:, :]) for x in p.arrays)
        mx.eval(head + tail)
        return upper + [Page(head, a, p.kinds)], [Page(tail, p.length - a, p.kinds), *pages[i + 1 :]]
    raise ValueError(f"cannot split {pos} tokens of pages at {k}")


def pages_bytes(pages: Sequence[Page]) -> int:
    """Bytes held by ``pages``."""
    return sum(p.nbytes for p in pages)


def assemble(private: Sequence[Any], path: Sequence[Page], tokens: int) -> list[Any]:
    """Rebuild a snapshot's paged layers at ``tokens`` tokens from the pages on its path.

    Args:
        private: the snapshot's layer list as stored: its own (already safe-copied and
            trimmed) non-paged layers, and ``None`` where a layer is paged.
        path: the pages from the root along the snapshot's key, in token order,
            covering at least ``tokens`` tokens.
        tokens: tokens to restore (``> 0``).

    Returns:
        The layer list with every ``None`` replaced by a :class:`PagedKVCache` over the
        first ``tokens`` tokens of the pages (no copy yet; see that class), or for a
        quantized layer a :class:`cache.quantized.QuantizedKVRow` of them joined.

    Raises:
        ValueError: if the pages cover fewer than ``tokens`` tokens.
    """
    used: list[tuple[Page, int]] = []  # (page, tokens of it used)
    need = tokens
    for p in path:
        if need <= 0:
            break
        used.append((p, min(p.length, need)))
        need -= p.length
    if need > 0:
        raise ValueError(f"pages cover {tokens - need} tokens, {tokens} wanted")
    out = list(private)
    kinds = iter(used[0][0].kinds if used else ())
    first = 0  # index in a page's arrays of the next paged layer's first array
    for i, layer in enumerate(out):
        if layer is not None:
            continue
        kind = next(kinds)
        n = 6 if kind is not None else 2
        pieces = [[p.arrays[first + j] if m == p.length else p.arrays[first + j][..., :m, :] for p, m in used]
                  for j in range(n)]
        first += n
        if kind is None:
            out[i] = PagedKVCache(pieces[0], pieces[1])
        else:  # quantized: the pages joined here (a batch merge copies them once more)
            # one page: a new handle on its buffer (a row written in place copies it first)
            joined = tuple(mx.stop_gradient(x[0]) if len(x) == 1 else mx.concatenate(x, axis=2) for x in pieces)
            row = QuantizedKVRow(*kind)
            row.keys, row.values, row.offset = joined[:3], joined[3:], tokens
            out[i] = row
    return out


class PagedKVCache(KVCache):
    """A ``KVCache`` restored from pages, which copies them only once, where they are used.

    ``keys`` / ``values`` (``[1, H, offset, D]``) are the pages concatenated on first
    access. :meth:`merge` (what mlx-lm's batch generator calls to put rows into a
    ``BatchKVCache``) writes each page straight into the batch buffer instead, so a
    restore into a batch copies the prefix once, as restoring a whole stored copy did.

    Args:
        keys, values: the pages' arrays in token order, each ``[1, H, n_i, D]``.
    """

    def __init__(self, keys: list[mx.array], values: list[mx.array]):
        super().__init__()
        self._pages = (list(keys), list(values))
        self.offset = sum(k.shape[2] for k in keys)

    def _materialize(self) -> None:
        if self._pages is not None:
            ks, vs = self._pages
            self._pages = None
            # one page: a new handle on its buffer (a write in place copies it first)
            self._keys = mx.stop_gradient(ks[0]) if len(ks) == 1 else mx.concatenate(ks, axis=2)
            self._values = mx.stop_gradient(vs[0]) if len(vs) == 1 else mx.concatenate(vs, axis=2)

    @property
    def keys(self):
        self._materialize()
        return self._keys

    @keys.setter
    def keys(self, v):
        self._pages = None if v is not None else getattr(self, "_pages", None)
        self._keys = v

    @property
    def values(self):
        self._materialize()
        return self._values

    @values.setter
    def values(self, v):
        self._values = v

    def pieces(self) -> list[tuple[mx.array, mx.array]]:
        """The (keys, values) pieces covering ``[0, offset)`` in order, without copying."""
        if self._pages is not None:
            return list(zip(*self._pages))
        return [(self._keys[..., : self.offset, :], self._values[..., : self.offset, :])]

    @classmethod
    def merge(cls, caches: Sequence[Any], room: int = 0, into: Optional[BatchKVCache] = None) -> BatchKVCache:
        """Left-pad and stack row caches (``KVCache`` or paged) into one ``BatchKVCache``
        ``[B, H, T, D]``, copying each page once. ``room=0`` gives mlx-lm's
        ``BatchKVCache.merge`` (``T = max_len``); ``room > 0`` leaves space for that many
        more tokens (``T`` rounded up to the cache's 256-token step), so the next
        ``update_and_fetch`` writes in place instead of reallocating the whole batch.

        With ``into`` (a decode batch's layer cache holding tokens), the result is ``into``
        extended with the rows after its own, as ``into.extend(merge(caches))`` gives, but
        written into one new buffer: every token is copied once (extending copies the new
        rows twice and the batch once or twice more). ``into`` itself is left as it was.
        """
        rows = [c.pieces() if isinstance(c, PagedKVCache) else
                ([(c.keys[..., : c.offset, :], c.values[..., : c.offset, :])] if c.keys is not None else [])
                for c in caches]
        lengths = [sum(k.shape[2] for k, _ in r) for r in rows]
        before = into._idx if into is not None else 0
        longest = max(lengths + [before])
        if longest == 0:
            return BatchKVCache([0] * len(caches))
        k0, v0 = next(r[0] for r in rows if r) if any(rows) else (into.keys, into.values)
        step = BatchKVCache.step
        size = -(-(longest + room) // step) * step if room > 0 else longest
        b0 = into.keys.shape[0] if into is not None else 0
        keys = mx.zeros((b0 + len(rows), k0.shape[1], size, k0.shape[3]), dtype=k0.dtype)
        values = mx.zeros((b0 + len(rows), v0.shape[1], size, v0.shape[3]), dtype=v0.dtype)
        shift = longest - before  # the batch's rows move right by this much
        if into is not None and before:
            keys[:b0, :, shift:longest] = into.keys[..., :before, :]
            values[:b0, :, shift:longest] = into.values[..., :before, :]
        padding = [longest - n for n in lengths]
        for i, (pad, r) in enumerate(zip(padding, rows)):
            pos, row = pad, b0 + i
            for k, v in r:
                n = k.shape[2]
                keys[row : row + 1, :, pos : pos + n] = k
                values[row : row + 1, :, pos : pos + n] = v
                pos += n
        batch = BatchKVCache(padding)
        batch.offset += longest
        if into is not None:
            batch.left_padding = mx.concatenate([into.left_padding + shift, batch.left_padding])
            batch.offset = mx.concatenate([into.offset, batch.offset])
        batch.keys, batch.values = keys, values
        batch._idx = longest
        return batch

    @staticmethod
    def can_merge_into(batch: Any, caches: Sequence[Any]) -> bool:
        """Whether :meth:`merge` can take ``batch`` as ``into`` for rows ``caches``: a plain
        ``BatchKVCache`` holding tokens (no right padding pending) and float rows whose
        heads, head size and dtype match it."""
        if type(batch) is not BatchKVCache or batch.keys is None or batch._right_padding is not None:
            return False
        for c in caches:
            if isinstance(c, PagedKVCache):  # its pieces: reading .keys would join its pages
                pieces = c.pieces()
                if not pieces:
                    return False
                k, v = pieces[0]
            elif isinstance(c, KVCache) and c.keys is not None:
                k, v = c.keys, c.values
            else:
                return False
            if (k.dtype != batch.keys.dtype or k.shape[1] != batch.keys.shape[1] or k.shape[3] != batch.keys.shape[3]
                    or v.shape[3] != batch.values.shape[3]):
                return False
        return True
