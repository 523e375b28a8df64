"""The decode batch's KV cache with holes: per-row rollback of rejected drafts.

mlx-lm's ``BatchKVCache`` keeps every row of the batch at one write index (``_idx``,
left padding in front): a verification forward writes ``1 + K`` positions for every row,
and rows that accepted different numbers of drafts would each have to drop a different
number of positions from their end. Trimming the batch by the least any row rejected is
free; the rest would mean shifting each row's whole KV to the right (what mlx-lm's
``finalize`` does with ``dynamic_roll``), measured here at about 20 ms per row of 1,500
tokens for a 135M model (30 layers): a third of a decode step.

:class:`HoledKVCache` instead leaves those positions where they are and masks them: the
attention mask (:meth:`HoledKVCache.make_mask`) hides a row's holes as it hides its left
padding, and each row's ``offset`` (its RoPE position) counts only its real tokens, so
every later token sees exactly the keys it would have seen without the draft. Holes are
squeezed out when a row is extracted (a snapshot, a paused row) and when they grow past
:data:`COMPACT_FRACTION` of the batch (:meth:`HoledKVCache.compact`, one gather).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from cache.quantized import BatchQuantizedKVCache, QuantizedKVRow

# Compact when the row with most holes has this share of the batch's positions as holes
# (and at least COMPACT_MIN of them): attention then reads at most ~1/3 more keys than
# needed, and a compaction (a copy of the batch's KV) runs at most once per that many
# rejected positions.
COMPACT_FRACTION = 0.25
COMPACT_MIN = 64


class HoledKVCache(BatchKVCache):
    """``BatchKVCache`` ``[B, H, T, D]`` whose rows may have holes: positions that a
    rejected draft was written to. ``holes`` is ``None`` or a bool array ``[B, n]``
    (``n <= _idx``; positions past ``n`` are no holes); ``offset[b]`` counts row ``b``'s
    real tokens."""

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.holes: Optional[mx.array] = None
        self._hole_count = 0  # holes made since the last compaction (most in one row per rejection)

    @classmethod
    def adopt(cls, cache: BatchKVCache) -> "HoledKVCache":
        """``cache`` (float or quantized) as a :class:`HoledKVCache` sharing its arrays (no
        copy); ``cache`` itself must not be used afterwards.

        Raises:
            TypeError: ``cache`` is another kind of cache.
        """
        if isinstance(cache, HoledKVCache):
            return cache
        kind = {BatchKVCache: HoledKVCache, BatchQuantizedKVCache: HoledQuantizedKVCache}.get(type(cache))
        if kind is None:
            raise TypeError(f"cannot speculate over a {type(cache).__name__}")
        holed = kind.__new__(kind)
        holed.__dict__.update(cache.__dict__)
        holed.holes = None
        holed._hole_count = 0
        return holed

    def _holes_to(self, n: int) -> mx.array:
        """``holes`` cut or padded (no holes) to ``n`` positions: ``[B, n]``."""
        h = self.holes
        if h.shape[1] >= n:
            return h[:, :n]
        return mx.concatenate([h, mx.zeros((h.shape[0], n - h.shape[1]), dtype=mx.bool_)], axis=1)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        """The causal mask of ``N`` new tokens over the left padding and the holes:
        bool ``[B, 1, N, _idx + N]``."""
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        if self.holes is None:
            return mask
        return mask & ~self._holes_to(self._idx + N)[:, None, None, :]

    def reject(self, rejected: list[int]) -> None:
        """Drop the last ``rejected[b]`` positions of each row ``b`` (tokens of a draft it
        did not accept): the batch is trimmed by the least of them, the rest become holes."""
        least = min(rejected)
        if least:
            self.trim(least)
        extra = [r - least for r in rejected]
        if not any(extra):
            return
        e = mx.array(extra)
        new = mx.arange(self._idx)[None] >= (self._idx - e)[:, None]
        self.holes = new if self.holes is None else (self._holes_to(self._idx) | new)
        self.offset = self.offset - e
        self._maybe_compact(max(extra))

    def trim(self, n):
        n = super().trim(n)
        if self.holes is not None and self.holes.shape[1] > self._idx:
            self.holes = self.holes[:, : self._idx]
        return n

    def _maybe_compact(self, added: int) -> None:
        self._hole_count += added
        if self._hole_count >= max(COMPACT_MIN, COMPACT_FRACTION * self._idx):
            self.compact()

    def compact(self) -> None:
        """Squeeze the holes out: each row's real tokens right-aligned at the new write
        index, the batch as long as its longest row (one gather of the KV, evaluated here,
        so that the old buffer goes before another layer's is copied). The new buffer
        keeps the old one's size: the positions freed are room for the next tokens, which
        would otherwise grow it (another copy) at the next step."""
        if self.holes is None or self.keys is None:
            return
        real = (~self._holes_to(self._idx)) & (mx.arange(self._idx)[None] >= self.left_padding[:, None])
        counts = real.sum(axis=1)
        n = int(counts.max().item())
        size = tree_flatten(self.keys)[0][1].shape[2]
        # Position j of the new row b holds the (j - (n - counts[b]))-th real token of b
        # (positions past n: any, written before they are read).
        pos = mx.arange(self._idx)[None]
        order = mx.argsort(mx.where(real, pos, pos + self._idx), axis=1)  # real positions first, in order
        slot = mx.arange(size)[None] - (n - counts)[:, None]
        index = mx.take_along_axis(order, mx.clip(slot, 0, self._idx - 1), axis=1)  # [B, size]
        gather = index[:, None, :, None]
        self.keys, self.values = tree_map(lambda x: mx.take_along_axis(x[..., : self._idx, :], gather, axis=2),
                                          (self.keys, self.values))
        mx.eval(self.keys, self.values)
        self.left_padding = n - counts
        self._idx = n
        self.holes = None
        self._hole_count = 0

    def filter(self, batch_indices):
        holes, before = self.holes, self._idx
        super().filter(batch_indices)
        if holes is not None:
            shift = before - self._idx  # the left padding the rows kept no longer need
            self.holes = holes[mx.array(batch_indices)][:, shift:]

    def extend(self, other):
        mine, theirs = self.holes, getattr(other, "holes", None)
        my_idx, their_idx = self._idx, other._idx
        my_rows, their_rows = self.offset.shape[0], other.offset.shape[0]
        super().extend(other)
        if mine is None and theirs is None:
            return

        def placed(h, rows, idx):  # right-aligned at the new _idx, as the parent pads the KV
            h = mx.zeros((rows, 0), dtype=mx.bool_) if h is None else h[:, :idx]
            return mx.pad(h, [(0, 0), (self._idx - idx, idx - h.shape[1])])

        self.holes = mx.concatenate([placed(mine, my_rows, my_idx), placed(theirs, their_rows, their_idx)])

    def extract(self, idx):
        if self.holes is None:
            return super().extract(idx)
        pad = int(self.left_padding[idx].item())
        holes = self._holes_to(self._idx)[idx].tolist()
        keep = mx.array([p for p in range(pad, self._idx) if not holes[p]], dtype=mx.int32)
        row = self._new_row()
        row.keys, row.values = tree_map(lambda x: mx.contiguous(mx.take(x[idx: idx + 1, :, : self._idx], keep, axis=2)),
                                        (self.keys, self.values))
        row.offset = int(keep.size)
        return row

    def _new_row(self) -> KVCache:
        """An empty cache of one sequence, of the kind this batch's rows are."""
        return KVCache()

    @property
    def state(self):
        if self.holes is not None:
            self.compact()
        return super().state

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v
        self.holes = None


class HoledQuantizedKVCache(HoledKVCache, BatchQuantizedKVCache):
    """A :class:`HoledKVCache` whose storage is quantized (``--kv-bits``,
    :class:`cache.quantized.BatchQuantizedKVCache`): keys and values are ``(packed,
    scales, biases)`` triples ``[B, H, T, *]``, gathered together. A token's quantized
    vectors do not depend on its neighbours, so rolling back or squeezing out holes leaves
    what a cold run stores."""

    def _new_row(self) -> QuantizedKVRow:
        return QuantizedKVRow(self.group_size, self.bits)
