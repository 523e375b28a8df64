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
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from cache.kinds import batch_kind_of
from scheduler.speculative.holes import HoledKVCache

REPLAYED = ("recurrent", "window")  # the rollback strategies (cache.kinds) this module carries out

# How far a padded forward may leave the next logits from an unpadded one, relative to
# their largest magnitude: rounding (a [1, 3] and a [1, 1] forward add in other orders;
# exactly 0 apart on the CPU, float32 and bfloat16, for the models here that honour
# padding). mlx-lm 0.32.2's Nemotron-H drops the real token's contribution to its SSM
# state when padded: 4.7% for a random one.
PROBE_TOLERANCE = 1e-2


def holed(caches: list) -> list:
    """``caches`` with every layer whose kind rolls back by ``mask`` (full attention,
    ``BatchKVCache`` float or quantized) as a :class:`HoledKVCache` (sharing its arrays);
    other layers as they are."""
    return [HoledKVCache.adopt(c) if _rollback(c) == "mask" else c for c in caches]


def _rollback(layer) -> Optional[str]:
    return batch_kind_of(layer).rollback


class Rewind:
    """The decode batch's recurrent and sliding-window layers over one verify step.

    Args:
        caches: the batch's cache, one per layer; only the layers whose kind rolls back by
            ``recurrent`` (``ArraysCache``) or ``window`` (``BatchRotatingKVCache``) are
            touched (:mod:`cache.kinds`).

    The state of those layers is saved when this is made (before the step's forward).
    """

    def __init__(self, caches: list):
        self.layers = [c for c in caches if _rollback(c) in REPLAYED]
        # New handles: mlx-lm updates some of these arrays in place (``left_padding -= n``,
        # ``keys[..., i] = k``), which rewrites every holder of the same handle.
        self._saved = [[_handle(a) for a in ((*c.cache, c.left_padding) if _rollback(c) == "recurrent" else c.state)]
                       for c in self.layers]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def pad(self, lengths: list[int], width: int) -> None:
        """Before a forward ``[B, width]``: row ``b``'s real tokens are its first
        ``lengths[b]``, the rest padding these layers must not take in."""
        if width > 1:
            for c in self.layers:
                if _rollback(c) == "window":
                    # mlx-lm 0.32.2 builds a [B, N > 1] forward's window mask before the
                    # update puts a rotated cache back in temporal order (which drops one
                    # more left-padding position): a row still left-padded would lose a
                    # key. In temporal order already, the mask and the update agree.
                    c._temporal_order()
        if all(n == width for n in lengths):
            return
        for c in self.layers:
            if _rollback(c) == "recurrent":
                c.lengths = mx.array(lengths)  # one each: a layer's forward subtracts from it in place
            else:
                c.prepare(lengths=lengths, right_padding=[width - k for k in lengths])

    def unpad(self) -> None:
        """After that forward: drop the padding (a rotating cache rolls it to the left,
        where it is masked as left padding)."""
        for c in self.layers:
            if _rollback(c) == "recurrent":
                c.lengths = None
            else:
                c.finalize()

    def restore(self) -> None:
        """Put these layers back as they were before the step (new handles each time, so
        the saved state survives what the next forward writes in place)."""
        for c, saved in zip(self.layers, self._saved):
            fresh = [_handle(a) for a in saved]
            if _rollback(c) == "recurrent":
                c.cache, c.left_padding, c.lengths = fresh[:-1], fresh[-1], None
            else:
                c.state = tuple(fresh)
                c._lengths = None


def _handle(a):
    """A new handle on array ``a`` sharing its buffer (no copy): writing ``a`` in place
    then copies it first, and this handle keeps the old values. Non-arrays as they are."""
    return mx.stop_gradient(a) if isinstance(a, mx.array) else a


def take_back(caches: list, rejected: list[int]) -> None:
    """Every full-attention layer of ``caches`` drops the last ``rejected[b]`` positions
    of row ``b`` (:meth:`HoledKVCache.reject`); other layers are left alone."""
    for c in caches:
        if isinstance(c, HoledKVCache):
            c.reject(rejected)


def needs_replay(rewind: Rewind, fed: list[int], kept: list[int]) -> bool:
    """Whether any row's recurrent or window state took in a token it does not keep
    (``fed[b]`` real tokens went in, ``kept[b]`` stay)."""
    return bool(rewind) and fed != kept


def replay(model, caches: list, rewind: Rewind, rows: list[list[int]], width: int) -> None:
    """Undo a verify step of ``width`` positions and feed each row's kept tokens
    ``rows[b]`` (its input token and the drafts it keeps) again: full-attention layers
    drop the step's positions and mask the replay's padding as holes, the others restart
    from their saved state. Evaluated before it returns, so that the verify step's
    measured cost includes it."""
    rewind.restore()
    for c in caches:
        if isinstance(c, HoledKVCache):
            c.trim(width)
    kept = [len(r) for r in rows]
    s = max(kept)
    rewind.pad(kept, s)
    model(mx.array([r + [r[0]] * (s - len(r)) for r in rows], dtype=mx.uint32), cache=caches)
    rewind.unpad()
    take_back(caches, [s - k for k in kept])
    mx.eval([a for c in caches for a in held_arrays(c)])


def held_arrays(cache) -> list:
    """The arrays one batch layer cache holds (to evaluate them without ``state``, which
    compacts a holed cache)."""
    if _rollback(cache) == "recurrent":
        return [a for a in cache.cache if a is not None]
    return [a for _, a in tree_flatten((cache.keys, cache.values)) if isinstance(a, mx.array)]


def right_padding_refusal(model) -> Optional[str]:
    """Why ``model``'s recurrent or sliding-window layers cannot roll back a draft, or
    None if they can. Two rows of different lengths (so one is left-padded) take one
    batched step of three positions, the first row padded after its one token; then one
    more token each. Each row's logits must be those of the same tokens fed to it alone,
    unpadded. Runs small forwards: call it on the thread that owns the model."""
    prompts, steps = [[1, 2, 3, 4, 5, 6], [3, 4, 5, 6]], [[7], [7, 11, 12]]

    def prefilled(prompt):
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        return cache

    want = []
    for prompt, step in zip(prompts, steps):
        cache = prefilled(prompt)
        model(mx.array([step]), cache=cache)
        want.append(model(mx.array([[10]]), cache=cache)[0, -1].astype(mx.float32))
    batch = holed(_as_batch([prefilled(p) for p in prompts]))
    rewind = Rewind(batch)
    rewind.pad([len(s) for s in steps], 3)
    model(mx.array([s + [8] * (3 - len(s)) for s in steps]), cache=batch)
    rewind.unpad()
    take_back(batch, [3 - len(s) for s in steps])
    got = model(mx.array([[10], [10]]), cache=batch)[:, -1].astype(mx.float32)
    for row, expected in enumerate(want):
        gap = mx.abs(got[row] - expected).max().item()
        scale = max(mx.abs(expected).max().item(), 1e-6)
        if gap > PROBE_TOLERANCE * scale:
            return (f"its recurrent or sliding-window layers do not honour right padding (a padded batch "
                    f"moved a row's next logits by {gap:.3g}, {gap / scale:.1%} of their largest)")
    return None


def _as_batch(caches: list[list]) -> list:
    """Sequences' caches (``make_prompt_cache`` each) as one left-padded batch."""
    from compat.mlx_lm import merge_caches

    return merge_caches(caches)
