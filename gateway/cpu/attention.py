"""Attention for MLX's CPU backend whose softmax ``exp`` is one compiled kernel.

On the CPU, ``mx.fast.scaled_dot_product_attention`` runs MLX's unfused fallback
(``mlx/fast.cpp``): ``q @ k^T``, mask, ``softmax(precise=True)``, ``@ v``. On Linux x86-64
the softmax's ``exp`` is MLX's Cephes polynomial (``mlx/backend/cpu/simd/math.h``) on
``Simd<float, 1>``, one element at a time through out-of-line ``fma`` calls: about
40-67 M elements/s here, so a 95-token turn over 2000 cached tokens spends most of its
prefill in ``exp`` (``benchmarks/bench_prefill_ops.py``).

:func:`attention` computes the same thing with the same polynomial written as MLX array
ops, fused by ``mx.compile`` into one elementwise kernel that the compiler vectorizes:
about 3x faster ``exp``, and attention over that shape 45 ms -> 19 ms with
:mod:`gateway.cpu.allocator`'s setting (``benchmarks/bench_cpu_attention.py``). It then
normalizes after ``@ v`` (``[.., Tq, D]``) instead of before (``[.., Tq, Tk]``). Outputs
agree with MLX's to about 1e-6 in float32 (``tests/test_cpu_attention.py``); a row's
result does not depend on the other rows of its batch, so batched and cached paths stay
equivalent to a cold single-request run.

:func:`install` replaces ``mx.fast.scaled_dot_product_attention`` for the whole process,
which is how mlx-lm's models reach it (``mlx_lm.models.base``). Calls it does not cover
(attention sinks, an explicit stream, ``force_fused``) go to MLX's own.
``mlx-gateway serve`` installs it when MLX runs on the CPU, ``g++`` is on the PATH (MLX
compiles CPU kernels with it; without it the ops would run unfused) and the allocator
setting below is in force.
``MLX_GATEWAY_CPU_ATTENTION=0`` keeps MLX's. It makes more temporary arrays than MLX's
fallback, so it relies on :mod:`gateway.cpu.allocator` reusing freed memory: with glibc's
default malloc, large prefill chunks page-fault enough to be slower than MLX's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Optional, Union

import mlx.core as mx

log = logging.getLogger("mlx_gateway")

LOG2E = 1.4426950408889634
# exp(x) = 2**i * P(f) with i = round(x * log2(e)), f the rest: the Cephes coefficients
# MLX's CPU exp uses (via github.com/akohlmey/fastermath), highest degree first.
POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
        2.402264791363012e-1, 6.931472028550421e-1, 1.0)
ROUND = 12582912.0  # 1.5 * 2**23: (y + ROUND) - ROUND rounds a float32 |y| < 2**22 to an integer

_mlx_attention = mx.fast.scaled_dot_product_attention


def _exp_parts(x: mx.array) -> tuple[mx.array, mx.array]:
    """For ``x <= 0`` (float32): ``(bits of 2**i as int32, P(f))`` with ``exp(x) = 2**i * P(f)``.
    ``i`` is clamped at -126 (the smallest normal exponent), so ``exp`` of anything below
    about -87.3 comes out as about 1e-38 instead of 0."""
    y = mx.maximum(x * LOG2E, -126.0)
    i = (y + ROUND) - ROUND
    f = y - i
    p = POLY[0]
    for c in POLY[1:]:
        p = p * f + c
    return mx.left_shift(i.astype(mx.int32) + 127, 23), p


# shapeless: one trace for every shape (a decode step's key length grows by one each step).
_exp_parts_fused = mx.compile(_exp_parts, shapeless=True)


def exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x <= 0``, relative error about 1e-7 (same polynomial as
    MLX's CPU ``exp``); about 1e-38 instead of 0 below -87.3."""
    bits, poly = _exp_parts_fused(x)
    return bits.view(mx.float32) * poly  # view: shapeless compile cannot infer its shape


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
              mask: Union[None, str, mx.array] = None, **kwargs) -> mx.array:
    """``softmax(scale * q @ k^T + mask) @ v``, as ``mx.fast.scaled_dot_product_attention``.

    Args:
        q: queries ``[B, Hq, Tq, D]``.
        k, v: keys and values ``[B, Hk, Tk, D]`` (``Hq`` a multiple of ``Hk``: grouped-query).
        scale: multiplies ``q``.
        mask: None; ``"causal"`` (query ``i`` sees keys ``<= Tk - Tq + i``); a boolean
            array (True: attend) or an additive one, broadcastable to ``[B, Hq, Tq, Tk]``.
        kwargs: ``sinks``, ``stream``, ``force_fused``: given, MLX's own computes it, as
            it does inputs not of rank 4, of mixed dtypes, or other than float32, float16
            and bfloat16.

    Returns:
        ``[B, Hq, Tq, D]`` in the inputs' dtype. float16 and bfloat16 take the softmax in
        float32 and normalize before ``@ v``, as MLX does.
    """
    if (any(v_ is not None and v_ is not False for v_ in kwargs.values()) or q.ndim != 4
            or not q.dtype == k.dtype == v.dtype or q.dtype not in (mx.float32, mx.float16, mx.bfloat16)):
        return _mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    q = q * mx.array(scale, q.dtype)
    if rep > 1:  # [B, Hk, rep, Tq, D] against [B, Hk, 1, Tk, D]
        q = q.reshape(B, Hk, rep, Tq, D)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"[scaled_dot_product_attention] Invalid mask_mode {mask}")
        mask = mx.arange(Tk - Tq, Tk)[:, None] >= mx.arange(Tk)[None]
    if mask is not None:
        if rep > 1 and mask.ndim >= 3:
            mask = (mx.expand_dims(mask, -3) if mask.shape[-3] == 1
                    else mask.reshape(*mask.shape[:-3], Hk, rep, *mask.shape[-2:]))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    low = scores.dtype != mx.float32
    if low:
        scores = scores.astype(mx.float32)
    p = exp_nonpositive(scores - mx.max(scores, axis=-1, keepdims=True))
    total = p.sum(axis=-1, keepdims=True)
    if low:
        out = (p / total).astype(v.dtype) @ v
    else:
        out = (p @ v) / total
    return out.reshape(B, Hq, Tq, -1) if rep > 1 else out


def install() -> None:
    """Make ``mx.fast.scaled_dot_product_attention`` :func:`attention`, process-wide."""
    mx.fast.scaled_dot_product_attention = attention


def uninstall() -> None:
    """Give ``mx.fast.scaled_dot_product_attention`` back to MLX's own."""
    mx.fast.scaled_dot_product_attention = _mlx_attention


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block."""
    install()
    try:
        yield
    finally:
        uninstall()


def install_for_cpu_backend() -> Optional[str]:
    """:func:`install` when MLX runs on the CPU and can compile kernels (``g++`` on the
    PATH), unless ``MLX_GATEWAY_CPU_ATTENTION=0``; compiles the kernel once. Returns why
    it did not install, or None."""
    from gateway.cpu import cpu_backend

    if os.environ.get("MLX_GATEWAY_CPU_ATTENTION", "1") == "0":
        return "MLX_GATEWAY_CPU_ATTENTION=0"
    if not cpu_backend():
        return "MLX runs on a GPU"
    if shutil.which("g++") is None:
        log.warning("no g++ on the PATH: MLX cannot compile CPU kernels, so attention keeps MLX's "
                    "scalar exp (about 2x slower prefill); install g++ to speed it up")
        return "no g++"
    try:
        mx.eval(exp_nonpositive(mx.zeros((1,))))  # the one-off kernel compile, before requests
    except RuntimeError as e:  # e.g. a temporary directory that cannot hold or load the kernel
        log.warning("MLX could not compile the CPU attention kernel (%s); keeping MLX's attention", e)
        return f"compile failed: {e}"
    install()
    return None
