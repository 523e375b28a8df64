"""The CPU attention kernels among which :mod:`gateway.cpu.attention` chooses by
measurement at load. Each is called ``kernel(q, k, v, scale, mask)`` with queries
``[B, Hq, Tq, D]``, keys and values ``[B, Hk, Tk, D]`` (float32, ``Hq`` a multiple of
``Hk``) and a mask as ``mx.fast.scaled_dot_product_attention`` takes it, and returns
``softmax(scale * q @ k^T + mask) @ v`` ``[B, Hq, Tq, D]``, MLX's outputs to about 1e-6
(``tests/test_cpu_attention.py``).

The kernels (:data:`KERNELS`):

* ``mlx``: MLX's own, as it is.
* ``compiled-blocks``: blocks of :data:`COMPILED_BLOCK` queries (their scores stay in
  the CPU's cache), the softmax's ``exp`` written as array ops (the same polynomial) and
  fused by ``mx.compile`` into kernels the compiler vectorizes, and the normalizer taken
  by the ``@ v`` matmul itself (``v`` gets a column of ones).
* ``compiled-blocks-16``, ``compiled-blocks-8``: the same in blocks of 16 or 8 queries,
  for calls whose scores are many rows times many keys (a batch of rows over a shared
  prefix, a chunk of a long prompt), where 32 queries' scores no longer stay in the cache:
  on the 2-core machine of ``benchmarks/bench_cpu_attention.py``, a 512-wide 8-layer qwen3
  (8 query heads of 32) prefilling 512 tokens over 8,192 cached took 1,693 ms in blocks of
  32, 1,490 in 16, 1,332 in 8; six rows of 292 over 580 cached, 817 / 611 / 613 ms; one
  fresh 2,048-token prompt 777 ms in 32, 785 in 16. SmolLM2 (9 heads of 64): six rows
  8.0 / 7.0 / 8.1 s, one fresh prompt 9.0 s in 32, 9.6 in 16.
* ``compiled-decode``: for a few queries a row (a decode step, a verify step): the same
  compiled ``exp`` over all of a row's scores at once, the normalizer summed over them
  (a column of ones would copy every value for a single query). Over 2,000 keys MLX's
  scalar ``exp`` makes its own kernel about twice this one on SmolLM2's heads (0.84
  against 0.45 ms a layer here; 2.67 against 1.40 over 8,000), a tenth of a decode step.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import Callable, Optional, Union

import mlx.core as mx

LOG2E = 1.4426950408889634
# exp(x) = 2**i * P(f) with i = round(x * log2(e)), f the rest: the Cephes coefficients
# MLX's CPU exp uses (via github.com/akohlmey/fastermath), highest degree first.
POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
        2.402264791363012e-1, 6.931472028550421e-1, 1.0)
ROUND = 12582912.0  # 1.5 * 2**23: (y + ROUND) - ROUND rounds a float32 |y| < 2**22 to an integer

COMPILED_BLOCK = 32  # queries per block of the compiled-blocks kernel: [rep * 32, Tk] scores stay in cache
NARROW_BLOCKS = (16, 8)  # the narrower blocks of compiled-blocks-16 and -8, for many rows times many keys
_MASKED = -3.0e38  # a score that exp turns into 0 (finite: a fully masked row stays finite, as in MLX)

mlx_attention = mx.fast.scaled_dot_product_attention  # MLX's own, taken before attention.install() replaces it

Mask = Union[None, str, mx.array]


def _exp_parts(x: mx.array, rowmax: mx.array) -> tuple[mx.array, mx.array]:
    """For ``d = x - rowmax <= 0`` (float32): ``(bits of 2**i as int32, P(f))`` with
    ``exp(d) = 2**i * P(f)``. ``i`` is clamped at -126 (the smallest normal exponent), so
    ``exp`` of anything below about -87.3 comes out as about 1e-38 instead of 0."""
    y = mx.maximum((x - rowmax) * LOG2E, -126.0)
    i = (y + ROUND) - ROUND
    f = y - i
    p = POLY[0]
    for c in POLY[1:]:
        p = p * f + c
    return mx.left_shift(i.astype(mx.int32) + 127, 23), p


# shapeless: one trace for every shape (a decode step's key length grows by one each step).
_exp_parts_fused = mx.compile(_exp_parts, shapeless=True)


def _exp_shifted(x: mx.array, rowmax: mx.array) -> mx.array:
    bits, poly = _exp_parts_fused(x, rowmax)
    return bits.view(mx.float32) * poly  # view: shapeless compile cannot infer its shape


def exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x <= 0``, relative error about 1e-7 (same polynomial as
    MLX's CPU ``exp``); about 1e-38 instead of 0 below -87.3."""
    return _exp_shifted(x, mx.zeros((1,), x.dtype))


# ----------------------------------------------------------------------------- masks
def _mask_4d(mask: mx.array) -> mx.array:
    while mask.ndim < 4:
        mask = mx.expand_dims(mask, 0)
    return mask


# [the last array mask checked, weakly (held, a [B, 1, Tq, Tk] mask outlived its forward), whether it hides the future]
_seen_causal: list = [lambda: None, False]


def hides_future(mask: Mask, Tq: int, Tk: int) -> bool:
    """True when no query may see a key after its own position (``Tk - Tq + i`` for query
    ``i``): ``"causal"``, or a boolean array mask that is False there (mlx-lm's batch
    caches' masks: causal with padding, or a sliding window). Then a block of queries
    needs only the keys up to its last query. An array mask is checked once (the models
    pass one mask object to every layer of a forward)."""
    if isinstance(mask, str):
        return mask == "causal"
    if mask is None or mask.dtype != mx.bool_ or Tq == 1:
        return Tq == 1 and mask is None
    if _seen_causal[0]() is mask:
        return _seen_causal[1]
    future = mx.arange(Tk)[None] > mx.arange(Tk - Tq, Tk)[:, None]
    hides = not bool(mx.any(mx.logical_and(mask, future)).item())
    _seen_causal[:] = [weakref.ref(mask), hides]
    return hides


# ----------------------------------------------------------------------------- kernels
def _masked(scores: mx.array, m: mx.array, hk: int, rep: int) -> mx.array:
    """``scores`` ``[B, Hk, rep, Tq, Tk]`` under mask ``m``: 2-D ``[Tq, Tk]``, or 4-D
    ``[B or 1, 1 or Hq, Tq, Tk]`` (query head ``h`` is ``(h // rep, h % rep)``); a boolean
    mask hides with :data:`_MASKED`, another is added."""
    if m.ndim == 4:
        m = m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], hk, rep, *m.shape[2:])
    if m.dtype == mx.bool_:
        return mx.where(m, scores, mx.array(_MASKED, scores.dtype))
    return scores + m.astype(scores.dtype)


def blocks(Tq: int, Tk: int, block: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """``(start, end, keys)`` per block of queries: the keys it needs are ``[0, keys)``."""
    for s in range(0, Tq, block):
        e = min(Tq, s + block)
        yield s, e, (Tk - Tq + e) if causal else Tk


def compiled_blocks(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask,
                    block: Optional[int] = None) -> mx.array:
    """Attention in blocks of ``block`` queries (default :data:`COMPILED_BLOCK`), float32: per block and KV
    head, the ``rep`` query heads that share it are one ``[rep * n, D]`` matmul against
    the keys the block sees; the softmax's ``exp`` is :func:`_exp_shifted`; ``@ [v, 1]``
    gives the weighted values and their normalizer at once. Grouped-query heads: query
    head ``h`` uses key/value head ``h // rep``, as in MLX."""
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    causal = hides_future(mask, Tq, Tk)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"[scaled_dot_product_attention] Invalid mask_mode {mask}")
    elif mask is not None:
        mask = _mask_4d(mask)
    q = (q * mx.array(scale, q.dtype)).reshape(B, Hk, rep, Tq, D)
    kT = k.swapaxes(-1, -2)
    v1 = mx.concatenate([v, mx.ones((B, Hk, Tk, 1), v.dtype)], axis=-1)  # [.., D + 1]: the last column sums p
    outs = []
    for s, e, n in blocks(Tq, Tk, COMPILED_BLOCK if block is None else block, causal):
        rows = e - s
        qb = q[..., s:e, :].reshape(B, Hk, rep * rows, D)
        scores = (qb @ kT[..., :n]).reshape(B, Hk, rep, rows, n)
        if mask is not None:
            if isinstance(mask, str):
                m = mx.arange(n - rows, n)[:, None] >= mx.arange(n)[None]
            else:
                m = mask[..., s:e, :n]
            scores = _masked(scores, m, Hk, rep)
        p = _exp_shifted(scores, mx.max(scores, axis=-1, keepdims=True))
        o = p.reshape(B, Hk, rep * rows, n) @ v1[..., :n, :]
        outs.append((o[..., :D] / o[..., D:]).reshape(B, Hk, rep, rows, D))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, Hq, Tq, D)


def compiled_decode(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask) -> mx.array:
    """Attention for few queries a row, float32: per KV head, the ``rep`` query heads that
    share it are one ``[rep * Tq, D]`` matmul against all the keys; the softmax's ``exp``
    is :func:`_exp_shifted` and its normalizer the sum of ``p``. Grouped-query heads as in
    MLX (query head ``h`` uses key/value head ``h // rep``)."""
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    q = (q * mx.array(scale, q.dtype)).reshape(B, Hk, rep * Tq, D)
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, Hk, rep, Tq, Tk)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"[scaled_dot_product_attention] Invalid mask_mode {mask}")
        mask = mx.arange(Tk - Tq, Tk)[:, None] >= mx.arange(Tk)[None] if Tq > 1 else None
    if mask is not None:
        scores = _masked(scores, mask if mask.ndim == 2 else _mask_4d(mask), Hk, rep)
    p = _exp_shifted(scores, mx.max(scores, axis=-1, keepdims=True)).reshape(B, Hk, rep * Tq, Tk)
    out = (p @ v) / mx.sum(p, axis=-1, keepdims=True)
    return out.reshape(B, Hq, Tq, D)


def _mlx(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask) -> mx.array:
    return mlx_attention(q, k, v, scale=scale, mask=mask)


KERNELS: dict[str, Callable[[mx.array, mx.array, mx.array, float, Mask], mx.array]] = {
    "mlx": _mlx, "compiled-blocks": compiled_blocks, "compiled-decode": compiled_decode,
    **{f"compiled-blocks-{n}": functools.partial(compiled_blocks, block=n) for n in NARROW_BLOCKS},
}
