"""Quantized KV caches that batch: ``--kv-bits 8|4`` (MLX's affine quantization).

mlx-lm has ``QuantizedKVCache`` for one sequence, but no batch form: its server does
not quantize at all, and continuous batching needs a cache that can be merged from
rows, left-padded, filtered and extended. Here:

- :class:`QuantizedKVRow`: one sequence's cache (mlx-lm's ``QuantizedKVCache``) that
  merges into a batch; what the prefix cache stores and restores.
- :class:`BatchQuantizedKVCache`: the batch ``[B, H, T, *]`` as mlx-lm's
  ``BatchKVCache`` keeps it (left padding, one write index), with keys and values each
  a ``(packed uint32 [B, H, T, D * bits / 32], scales [B, H, T, D / group], biases
  [B, H, T, D / group])`` triple from ``mx.quantize``.

mlx-lm's attention (``mlx_lm.models.base.scaled_dot_product_attention``) sees the
``bits`` attribute and runs ``quantized_scaled_dot_product_attention`` (a
``quantized_matmul`` over the packed keys and values). Each token's vectors are
quantized on their own, group by group, so a token's stored values do not depend on
the rows beside it, on where prefill chunks were cut, or on whether they came from the
prefix cache: batched, chunked and cached paths stay exact against a cold single
request with the same ``--kv-bits``.

Bytes per token and layer: ``2 H (D bits / 8 + 2 (D / group) s)`` for scales and biases
of ``s`` bytes (the model's dtype), against ``2 H D s`` in float: 0.28 (8 bits) and 0.16
(4 bits) of float32 at group 64, 0.53 and 0.28 of float16.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache, dynamic_roll

from .kinds import kind_of

BITS = (4, 8)


class QuantizedKVRow(QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` for one sequence, mergeable into a
    :class:`BatchQuantizedKVCache` (what batching a row needs)."""

    @classmethod
    def merge(cls, caches: list[Any]) -> "BatchQuantizedKVCache":
        return BatchQuantizedKVCache.merge(caches)

    @property
    def state(self):
        """mlx-lm's state, with the arrays cut to ``offset`` (not the 256-token steps they
        grow by), so that a stored snapshot holds exactly its tokens."""
        if self.keys is not None and self.offset < self.keys[0].shape[2]:
            keys, values = self.keys_and_values()
        else:
            keys, values = self.keys, self.values
        return keys, values, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.group_size, self.bits = v

    @classmethod
    def of(cls, cache: QuantizedKVCache) -> "QuantizedKVRow":
        """``cache`` (e.g. read back from the disk tier as mlx-lm's class) as a row."""
        if isinstance(cache, cls):
            return cache
        row = cls(cache.group_size, cache.bits)
        row.keys, row.values, row.offset = cache.keys, cache.values, cache.offset
        return row


def quantized_caches(model, bits: int, group_size: int) -> list[Any]:
    """One :class:`QuantizedKVRow` per layer of ``model``.

    Raises:
        ValueError: ``bits`` is not 4 or 8, or a layer keeps a cache whose kind does not
            ``quantize`` (:mod:`cache.kinds`: only full attention, mlx-lm's ``KVCache``;
            sliding windows and recurrent state stay float).
    """
    from mlx_lm.models.cache import make_prompt_cache

    if bits not in BITS:
        raise ValueError(f"kv_bits must be 4 or 8, not {bits}")
    layers = make_prompt_cache(model)
    kinds = sorted({type(c).__name__ for c in layers if not kind_of(c).quantize})
    if kinds:
        raise ValueError(f"cannot quantize the KV cache of a model whose layers keep {', '.join(kinds)} caches "
                         "(only full-attention KVCache layers can be quantized)")
    return [QuantizedKVRow(group_size, bits) for _ in layers]


def quantize_kv(model, bits: int, group_size: int = 64) -> None:
    """Make ``model`` keep quantized KV: ``make_prompt_cache(model)`` (every new sequence,
    in mlx-lm and here) then gives :class:`QuantizedKVRow` layers.

    Raises:
        ValueError: as :func:`quantized_caches`, or ``group_size`` does not divide the
            model's head dimension (from its config: ``head_dim``, else hidden size over
            attention heads).
    """
    layers = len(quantized_caches(model, bits, group_size))  # checks the model once
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None) or (
        getattr(args, "hidden_size", 0) // max(1, getattr(args, "num_attention_heads", 1) or 1))
    if head_dim and head_dim % group_size:
        raise ValueError(f"kv_group_size {group_size} does not divide the model's head dimension {head_dim}")
    model.make_cache = lambda: [QuantizedKVRow(group_size, bits) for _ in range(layers)]


def _empty_like(x: mx.array, rows: int, length: int) -> mx.array:
    return mx.zeros((rows, x.shape[1], length, x.shape[3]), dtype=x.dtype)


class BatchQuantizedKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` with quantized storage (see the module docstring):
    ``keys`` and ``values`` are ``(packed, scales, biases)`` triples, each ``[B, H, T, *]``."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size, self.bits = group_size, bits

    def update_and_fetch(self, keys, values):
        B, H, n, _ = keys.shape
        prev = self._idx
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step
            if self.keys is None:
                self.keys = tuple(_empty_like(x, B, grow) for x in qk)
                self.values = tuple(_empty_like(x, B, grow) for x in qv)
            else:
                def extend(x):
                    return mx.concatenate([x[..., :prev, :], _empty_like(x, x.shape[0], grow)], axis=2)

                self.keys, self.values = tree_map(extend, (self.keys, self.values))
        self.offset = self.offset + n
        self._idx += n
        for stored, new in ((self.keys, qk), (self.values, qv)):
            for s, x in zip(stored, new):
                s[..., prev: self._idx, :] = x
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def finalize(self):
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = tree_map(lambda x: dynamic_roll(x, padding[:, None], axis=2),
                                              (self.keys, self.values))
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    def filter(self, batch_indices):
        index = mx.array(batch_indices)
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[index], (self.keys, self.values))
        self.offset = self.offset[index]
        self.left_padding = self.left_padding[index]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., shift:, :], (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: "BatchQuantizedKVCache"):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        template = (self if self.keys is not None else other).keys, (self if self.keys is not None else other).values

        def placed(c):
            if c.keys is None:
                rows = c.offset.shape[0]
                kv = tree_map(lambda x: _empty_like(x, rows, 0), template)
            else:
                kv = (c.keys, c.values)
            left = idx - c._idx

            def pad(x):
                x = x[..., : c._idx, :]
                return mx.pad(x, [(0, 0), (0, 0), (left, size - left - x.shape[2]), (0, 0)])

            return tree_map(pad, kv), c.left_padding + left

        (mine, lp_a), (theirs, lp_b) = placed(self), placed(other)
        self.keys, self.values = tree_map(lambda a, b: mx.concatenate([a, b]), mine, theirs)
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([lp_a, lp_b])
        self._idx = idx

    def extract(self, idx) -> QuantizedKVRow:
        row = QuantizedKVRow(self.group_size, self.bits)
        pad = int(self.left_padding[idx].item())
        row.keys, row.values = tree_map(lambda x: mx.contiguous(x[idx: idx + 1, :, pad: self._idx]),
                                        (self.keys, self.values))
        row.offset = self._idx - pad
        return row

    @classmethod
    def merge(cls, caches: list[Any], room: int = 0) -> "BatchQuantizedKVCache":
        """Left-pad and stack row caches (:class:`QuantizedKVRow`) into one batch; ``room``
        more positions are allocated for the tokens to come."""
        first = next((c for c in caches if c.keys is not None), caches[0])
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], first.group_size, first.bits)
        if longest == 0:
            return batch
        size = -(-(longest + room) // cls.step) * cls.step if room > 0 else longest
        keys = tuple(_empty_like(x, len(caches), size) for x in first.keys)
        values = tuple(_empty_like(x, len(caches), size) for x in first.values)
        for i, (c, n) in enumerate(zip(caches, lengths)):
            if n:
                for stored, row in ((keys, c.keys), (values, c.values)):
                    for s, x in zip(stored, row):
                        s[i: i + 1, :, longest - n: longest] = x[..., :n, :]
        batch.keys, batch.values = keys, values
        batch.offset += longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return tree_reduce(lambda a, x: a + x.nbytes, (self.keys, self.values), 0)

