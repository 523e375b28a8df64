"""Rollback for layers that cannot take positions back: recurrent state and sliding windows.

Full-attention layers take a rejected draft back by masking its positions
(:mod:`scheduler.speculative.holes`). Two other kinds of layer cannot:

- recurrent layers (mlx-lm's ``ArraysCache``: Qwen 3.5's gated delta nets, Mamba 2,
  Nemotron-H) keep one state ``[B, ...]`` that every token updates; mlx-lm's kernels
  return only the state after the last token;
- sliding-window layers (``BatchRotatingKVCache``: Gemma 3) overwrite their oldest
  positions, the ones a rollback would need back.

Both honour mlx-lm's *right padding*: given each row's length (``lengths``), a forward
``[B, S]`` leaves each row's recurrent state after its own last real token (the padding
masked out of the scan and the convolution window), and a rotating cache drops the
padding when it is finalized (``BatchRotatingKVCache.prepare`` / ``finalize``).

:class:`Rewind` uses that twice:

1. the verify forward pads each row after its own drafts, so a row that accepts all its
   drafts (or had none) is exact in every layer at once;
2. when some row rejected a draft, these layers go back to their state before the step
   (saved as new handles on its arrays: a forward replaces most of them, and mlx-lm
   writes the rest in place, which a new handle does not see) and the kept tokens are
   fed again, padded to each row's count (a *replay* ``[B, max kept]``).

:func:`right_padding_refusal` checks, on the model itself, that its layers do honour
right padding (some mlx-lm models ignore ``lengths``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, make_prompt_cache

from scheduler.speculative.holes import HoledKVCache

# How far a padded forward may leave the next logits from an unpadded one, relative to
# their largest magnitude: rounding (a [1, 3] and a [1, 1] forward add in other orders;
# exactly 0 apart on the CPU, float32 and bfloat16, for the models here that honour
# padding). mlx-lm 0.32.2's Nemotron-H drops the real token's contribution to its SSM
# state when padded: 4.7% for a random one.
PROBE_TOLERANCE = 1e-2


def holed(caches: list) -> list:
    """``caches`` with every full-attention layer (``BatchKVCache``, float or quantized)
    as a :class:`HoledKVCache` (sharing its arrays); other layers as they are."""
    return [HoledKVCache.adopt(c) if isinstance(c, BatchKVCache) else c for c in caches]


class Rewind:
    """The decode batch's recurrent and sliding-window layers over one verify step.

    Args:
        caches: the batch's cache, one per layer; only ``ArraysCache`` and
            ``BatchRotatingKVCache`` layers are touched.

    The state of those layers is saved when this is made (before the step's forward).
    """

    def __init__(self, caches: list):
        self.layers = [c for c in caches if isinstance(c, (ArraysCache, BatchRotatingKVCache))]
        # New handles: mlx-lm updates some of these arrays in place (``left_padding -= n``,
        # ``keys[..., i] = k``), which rewrites every holder of the same handle.
        self._saved = [[_handle(a) for a in (c.cache if isinstance(c, ArraysCache) else c.state)]
                       for c in self.layers]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def pad(self, lengths: list[int], width: int) -> None:
        """Before a forward ``[B, width]``: row ``b``'s real tokens are its first
        ``lengths[b]``, the rest padding these layers must not take in."""
        if width > 1:
            for c in self.layers:
                if isinstance(c, BatchRotatingKVCache):
                    # mlx-lm 0.32.2 builds a [B, N > 1] forward's window mask before the
                    # update puts a rotated cache back in temporal order (which drops one
                    # more left-padding position): a row still left-padded would lose a
                    # key. In temporal order already, the mask and the update agree.
                    c._temporal_order()
        if all(n == width for n in lengths):
            return
        for c in self.layers:
            if isinstance(c, ArraysCache):
                c.lengths = mx.array(lengths)  # one each: a layer's forward subtracts from it in place
            else:
                c.prepare(lengths=lengths, right_padding=[width - k for k in lengths])

    def unpad(self) -> None:
        """After that forward: drop the padding (a rotating cache rolls it to the left,
        where it is masked as left padding)."""
        for c in self.layers:
            if isinstance(c, ArraysCache):
                c.lengths = None
            else:
                c.finalize()

    def restore(self) -> None:
        """Put these layers back as they were before the step."""
        for c, saved in zip(self.layers, self._saved):
            if isinstance(c, ArraysCache):
                c.cache = list(saved)
            else:
                c.state = tuple(saved)
                c._lengths = None


def _handle(a):
    """A new handle on array ``a`` (the same data until either is written), or ``a`` itself
    when it is not an array."""
    return mx.array(a) if isinstance(a, mx.array) else a


def needs_replay(rewind: Rewind, fed: list[int], kept: list[int]) -> bool:
    """Whether any row's recurrent or window state took in a token it does not keep
    (``fed[b]`` real tokens went in, ``kept[b]`` stay)."""
    return bool(rewind) and fed != kept


def replay(model, caches: list, rewind: Rewind, rows: list[list[int]], width: int) -> None:
    """Undo a verify step of ``width`` positions and feed each row's kept tokens
    ``rows[b]`` (its input token and the drafts it keeps) again: full-attention layers
    drop the step's positions and mask the replay's padding as holes, the others restart
    from their saved state. Lazy: evaluated with the next step."""
    rewind.restore()
    full = [c for c in caches if isinstance(c, HoledKVCache)]
    for c in full:
        c.trim(width)
    kept = [len(r) for r in rows]
    s = max(kept)
    rewind.pad(kept, s)
    model(mx.array([r + [r[0]] * (s - len(r)) for r in rows], dtype=mx.uint32), cache=caches)
    rewind.unpad()
    for c in full:
        c.reject([s - k for k in kept])


def right_padding_refusal(model) -> Optional[str]:
    """Why ``model``'s recurrent or sliding-window layers cannot roll back a draft, or
    None if they can: a forward of one token padded to three must leave the cache that
    forward of the token alone leaves (compared on the logits of the token after it).
    Runs small forwards: call it on the thread that owns the model."""

    def next_logits(padding: list[int]) -> mx.array:
        cache = make_prompt_cache(model)
        model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache)
        batch = holed(_as_batch(cache))
        rewind = Rewind(batch)
        rewind.pad([1], 1 + len(padding))
        model(mx.array([[7, *padding]]), cache=batch)
        rewind.unpad()
        for c in batch:
            if isinstance(c, HoledKVCache):
                c.reject([len(padding)])
        return model(mx.array([[10]]), cache=batch)[0, -1].astype(mx.float32)

    want, got = next_logits([]), next_logits([8, 9])
    gap = mx.abs(got - want).max().item()
    scale = max(mx.abs(want).max().item(), 1e-6)
    if gap > PROBE_TOLERANCE * scale:
        return (f"its recurrent or sliding-window layers do not honour right padding (two padding "
                f"tokens moved the next logits by {gap:.3g}, {gap / scale:.1%} of their largest)")
    return None


def _as_batch(cache: list) -> list:
    """One sequence's cache (``make_prompt_cache``) as a batch of one."""
    from mlx_lm.generate import _merge_caches

    return _merge_caches([cache])
