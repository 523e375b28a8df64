"""The CPU attention kernels among which :mod:`gateway.cpu.attention` chooses by
measurement at load. Each is called ``kernel(q, k, v, scale, mask)`` with queries
``[B, Hq, Tq, D]``, keys and values ``[B, Hk, Tk, D]`` (float32, ``Hq`` a multiple of
``Hk``) and a mask as ``mx.fast.scaled_dot_product_attention`` takes it, and returns
``softmax(scale * q @ k^T + mask) @ v`` ``[B, Hq, Tq, D]``, MLX's outputs to about 1e-6
(``tests/test_cpu_attention.py``).

The kernels (:data:`KERNELS`):

* ``mlx``: MLX's own, as it is.
* ``compiled-blocks``: blocks of :data:`COMPILED_BLOCK` queries (their scores stay in
  the CPU's cache), the softmax's ``exp`` written as array ops (MLX's polynomial) and
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

Memory: beside its ``[B, Hq, Tq, Tk]`` float32 scores (of a block of queries for
``compiled-blocks``) a compiled kernel holds their exponentials and a byte per score
(:func:`_exp2_shifted`), 2.25 score-sized arrays a call (MLX's own holds 1);
``compiled-blocks`` also copies the values once (``[v, 1]``). Both are what
``scheduler.admission.memory.MemoryGate`` reserves.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterator
from typing import Callable, Optional, Union

import mlx.core as mx

LOG2E = 1.4426950408889634
# exp(x) = 2**i * P(f) with i = round(x * log2(e)), f the rest: the Cephes coefficients
# MLX's CPU exp uses (via github.com/akohlmey/fastermath), highest degree first.
POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
        2.402264791363012e-1, 6.931472028550421e-1, 1.0)

COMPILED_BLOCK = 32  # queries per block of the compiled-blocks kernel: [rep * 32, Tk] scores stay in cache
NARROW_BLOCKS = (16, 8)  # the narrower blocks of compiled-blocks-16 and -8, for many rows times many keys
_MASKED = -3.0e38  # a score that exp turns into 0 (finite: a fully masked row stays finite, as in MLX)

mlx_attention = mx.fast.scaled_dot_product_attention  # MLX's own, taken before attention.install() replaces it

Mask = Union[None, str, mx.array]


# 2**y for y = x - rowmax <= 0 (x in log2 units: the kernels scale q by log2(e)), in three
# passes over the scores: i = ceil(y) as int8, P = 2**(y - i) as float32, and P's bits with
# i added to its exponent, in P's buffer (P has no other reader, so MLX donates it; a
# score-sized array read by two operations is not given to the second, whose input the
# first's task still holds). So a call holds the scores, P and a quarter-size i: 2.25
# score-sized arrays, measured with mx.get_peak_memory (MLX's own attention: 1). The
# polynomial cannot be one kernel with 2**i: mx.compile fuses a chain only 11 primitives
# deep (MLX's max_compile_depth), and in a shapeless trace every binary operation adds a
# Broadcast to that depth; as Horner's scheme beside 2**i (two outputs) it was split into
# kernels whose intermediates made 7 to 8 score-sized arrays.
def _recentred(poly: tuple[float, ...], by: float, times: float) -> tuple[float, ...]:
    """The coefficients (highest degree first) of ``times * P(f - by)`` for ``P`` of ``poly``."""
    degree = len(poly) - 1
    low = poly[::-1]  # c_k, lowest degree first
    return tuple(times * sum(low[k] * math.comb(k, j) * (-by) ** (k - j) for k in range(j, degree + 1))
                 for j in range(degree, -1, -1))


# 2**f = 2**(f + 0.5) / sqrt(2) for f in [-1, 0]: the Cephes polynomial, re-centred on -0.5
POLY_NEG = _recentred(POLY, -0.5, math.sqrt(0.5))


def _exponent(x: mx.array, rowmax: mx.array) -> mx.array:
    """``i = ceil(y)`` as int8 (the conversion truncates) for ``y = max(x - rowmax, -126)``
    (the smallest normal exponent)."""
    return mx.maximum(x - rowmax, -126.0).astype(mx.int8)


def _poly(x: mx.array, rowmax: mx.array, i: mx.array) -> mx.array:
    """``2**f`` in ``[0.5, 1]`` for the rest ``f = y - i`` in ``[-1, 0]`` (:data:`POLY_NEG`),
    in Estrin's scheme (powers ``f**2``, ``f**4``: shallow enough to fuse)."""
    c6, c5, c4, c3, c2, c1, c0 = POLY_NEG
    f = mx.maximum(x - rowmax, -126.0) - i.astype(mx.float32)
    f2 = mx.square(f)
    return mx.square(f2) * ((c4 + c5 * f) + c6 * f2) + ((c0 + c1 * f) + (c2 + c3 * f) * f2)


def _times_2_to_i(p: mx.array, i: mx.array) -> mx.array:
    """The float32 bits of ``p * 2**i`` as int32 for ``0.5 <= p <= 1``: ``p * 2**24`` is its
    mantissa plus the implicit bit (``2**23``, or ``2**24`` for ``p = 1``, the exponent's
    next bit), its exponent ``126 + i`` less that bit's 1 (a ``p`` a rounding below 0.5 or
    above 1 comes out a rounding off)."""
    return (p * 16777216.0).astype(mx.int32) + (i.astype(mx.int32) + 125) * 8388608


# shapeless: one trace for every shape (a decode step's key length grows by one each step).
_exponent_fused, _poly_fused, _times_2_to_i_fused = (
    mx.compile(f, shapeless=True) for f in (_exponent, _poly, _times_2_to_i))


def _exp2_shifted(x: mx.array, rowmax: mx.array) -> mx.array:
    """``2**(x - rowmax)`` for float32 ``x <= rowmax``: ``2**i * P``, ``2**-126`` (the smallest
    normal float32) where ``x - rowmax <= -126``."""
    i = _exponent_fused(x, rowmax)
    return _times_2_to_i_fused(_poly_fused(x, rowmax, i), i).view(mx.float32)


def exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x <= 0``, relative error about 1e-7 (MLX's CPU ``exp``'s
    polynomial, re-centred); about 1e-38 instead of 0 below -87.3."""
    return _exp2_shifted(x * LOG2E, mx.zeros((1,), x.dtype))


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
    mask hides with :data:`_MASKED`, another is added (times ``log2(e)``: the scores are in
    log2 units)."""
    if m.ndim == 4:
        m = m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], hk, rep, *m.shape[2:])
    if m.dtype == mx.bool_:
        return mx.where(m, scores, mx.array(_MASKED, scores.dtype))
    return scores + m.astype(scores.dtype) * LOG2E


def blocks(Tq: int, Tk: int, block: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """``(start, end, keys)`` per block of queries: the keys it needs are ``[0, keys)``."""
    for s in range(0, Tq, block):
        e = min(Tq, s + block)
        yield s, e, (Tk - Tq + e) if causal else Tk


def compiled_blocks(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask,
                    block: Optional[int] = None) -> mx.array:
    """Attention in blocks of ``block`` queries (default :data:`COMPILED_BLOCK`), float32: per block and KV
    head, the ``rep`` query heads that share it are one ``[rep * n, D]`` matmul against
    the keys the block sees; the softmax's ``exp`` is :func:`_exp2_shifted` (the scores in
    log2 units: ``q`` scaled by ``log2(e)``); ``@ [v, 1]`` gives the weighted values and
    their normalizer at once. Grouped-query heads: query
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
    q = (q * mx.array(scale * LOG2E, q.dtype)).reshape(B, Hk, rep, Tq, D)
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
        p = _exp2_shifted(scores, mx.max(scores, axis=-1, keepdims=True))
        o = p.reshape(B, Hk, rep * rows, n) @ v1[..., :n, :]
        outs.append((o[..., :D] / o[..., D:]).reshape(B, Hk, rep, rows, D))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(B, Hq, Tq, D)


def compiled_decode(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask) -> mx.array:
    """Attention for few queries a row, float32: per KV head, the ``rep`` query heads that
    share it are one ``[rep * Tq, D]`` matmul against all the keys; the softmax's ``exp``
    is :func:`_exp2_shifted` (the scores in log2 units: ``q`` scaled by ``log2(e)``) and its
    normalizer the sum of ``p``. Grouped-query heads as in MLX (query head ``h`` uses
    key/value head ``h // rep``)."""
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    q = (q * mx.array(scale * LOG2E, q.dtype)).reshape(B, Hk, rep * Tq, D)
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, Hk, rep, Tq, Tk)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"[scaled_dot_product_attention] Invalid mask_mode {mask}")
        mask = mx.arange(Tk - Tq, Tk)[:, None] >= mx.arange(Tk)[None] if Tq > 1 else None
    if mask is not None:
        scores = _masked(scores, mask if mask.ndim == 2 else _mask_4d(mask), Hk, rep)
    p = _exp2_shifted(scores, mx.max(scores, axis=-1, keepdims=True)).reshape(B, Hk, rep * Tq, Tk)
    out = (p @ v) / mx.sum(p, axis=-1, keepdims=True)
    return out.reshape(B, Hq, Tq, D)


def _mlx(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask) -> mx.array:
    return mlx_attention(q, k, v, scale=scale, mask=mask)


KERNELS: dict[str, Callable[[mx.array, mx.array, mx.array, float, Mask], mx.array]] = {
    "mlx": _mlx, "compiled-blocks": compiled_blocks, "compiled-decode": compiled_decode,
    **{f"compiled-blocks-{n}": functools.partial(compiled_blocks, block=n) for n in NARROW_BLOCKS},
}
