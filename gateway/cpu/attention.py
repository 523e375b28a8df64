"""Attention for MLX's CPU backend: the kernel that a measurement at load finds fastest.

On the CPU, ``mx.fast.scaled_dot_product_attention`` runs MLX's unfused fallback
(``mlx/fast.cpp``): ``q @ k^T``, mask, ``softmax(precise=True)``, ``@ v``, over every
key for every query. On Linux x86-64 MLX's ``exp`` is its Cephes polynomial on
``Simd<float, 1>`` with out-of-line ``fma`` calls, one element at a time (about 60-70 M
elements/s on the 2-core machine of ``benchmarks/bench_cpu_attention.py``), so a
2,048-token prefill chunk of SmolLM2-135M (9 query heads of 64) spends about 0.7 s per
layer in attention, 20 s of a chunk whose matmuls take 4: the ``[Tq, Tk]`` scores are
38 M elements per layer, half of them masked.

The kernels are in :mod:`gateway.cpu.attention_kernels` (``mlx``, MLX's own;
``compiled-blocks`` for prefill; ``compiled-decode`` for a few queries a row).

Which one runs is decided per model at load (:func:`choose_for_model`): each kernel is
timed on the model's own head counts, head size and dtype, on a prefill shape (a chunk of
:data:`PREFILL_SHAPES`: queries over keys; candidates :data:`PREFILL_KERNELS`) and a
decode step over a short, a medium and a long context (:data:`DECODE_BUCKETS`;
candidates :data:`DECODE_KERNELS`: around 1,000 keys MLX's own and the compiled one are
even, beyond it the compiled one pulls ahead), and the fastest is used for each (MLX's own
unless another wins by :data:`gateway.cpu.measure.MARGIN`); the log says what was chosen
with the figures. Shapes no model was measured for run MLX's own.

:func:`attention` is what :func:`install` puts in place of
``mx.fast.scaled_dot_product_attention`` for the whole process, which is how mlx-lm's
models reach it (``mlx_lm.models.base``). Calls it does not cover (attention sinks, an
explicit stream, ``force_fused``, float16 and bfloat16, inputs not of rank 4) go to MLX's
own. Every kernel gives MLX's outputs to about 1e-6 in float32
(``tests/test_cpu_attention.py``), and a row's result does not depend on the other rows of
its batch, so batched and cached paths stay equivalent to a cold single-request run.
``MLX_GATEWAY_CPU_ATTENTION=0`` keeps MLX's own everywhere; ``compiled-blocks`` needs
``g++`` on the PATH (MLX compiles CPU kernels with it) and is not a candidate without it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Iterator
from typing import Optional, Union

import mlx.core as mx

from gateway.cpu.attention_kernels import KERNELS, Mask, exp_nonpositive, mlx_attention
from gateway.cpu.measure import Choice, pick, race

log = logging.getLogger("mlx_gateway")

# (queries, keys) of the prefill timings at load: a chunk over earlier context (a fresh chunk's
# figure is dominated by per-call costs that long prompts, where attention matters, do not pay)
PREFILL_SHAPES = ((256, 1024),)
FEW_QUERIES = 16  # calls with at most this many queries a row (decode, verifying drafts) take the decode kernel
# (fewest keys, keys timed) per decode bucket: a decode call over k keys takes the kernel
# timed for the last bucket whose fewest is <= k (a short, a medium and a long context)
DECODE_BUCKETS = ((0, 1024), (1536, 2048), (4096, 8192))
PREFILL_KERNELS = ("mlx", "compiled-blocks")  # the candidates timed for prefill calls
DECODE_KERNELS = ("mlx", "compiled-decode")  # and for decode calls (compiled-blocks, one block there, is
# compiled-decode plus a copy of the values)

# (query heads, KV heads, head size, dtype) -> (prefill kernel, one decode kernel per DECODE_BUCKETS)
_plans: dict[tuple, tuple[str, ...]] = {}


def plan(hq: int, hk: int, d: int, dtype, prefill: str, decode: Union[str, tuple[str, ...]]) -> None:
    """Use kernel ``prefill`` for calls with more than :data:`FEW_QUERIES` queries per row
    and ``decode`` for the others (a decode step's one, a verify step's few), on attention
    of that shape (names from :data:`KERNELS`). ``decode`` is one name for every context
    length or one per :data:`DECODE_BUCKETS`.

    Raises:
        KeyError: an unknown kernel name.
        ValueError: a tuple of decode kernels not one per bucket.
    """
    decode = (decode,) * len(DECODE_BUCKETS) if isinstance(decode, str) else tuple(decode)
    if len(decode) != len(DECODE_BUCKETS):
        raise ValueError(f"{len(decode)} decode kernels for {len(DECODE_BUCKETS)} buckets")
    for name in (prefill, *decode):
        KERNELS[name]  # noqa: B018 (raises KeyError)
    _plans[(hq, hk, d, dtype)] = (prefill, *decode)


def planned(hq: int, hk: int, d: int, dtype) -> Optional[tuple[str, ...]]:
    """The kernels used for that shape, ``(prefill, decode per DECODE_BUCKETS...)``, or
    None (MLX's own)."""
    return _plans.get((hq, hk, d, dtype))


def _bucket(keys: int) -> int:
    """The index in :data:`DECODE_BUCKETS` of a decode call over ``keys`` keys."""
    return max(i for i, (fewest, _) in enumerate(DECODE_BUCKETS) if fewest <= keys)


def forget_plans() -> None:
    """Every shape back to MLX's own attention."""
    _plans.clear()


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Mask = None, **kwargs) -> mx.array:
    """``softmax(scale * q @ k^T + mask) @ v``, as ``mx.fast.scaled_dot_product_attention``,
    with the kernel planned for its shape (:func:`plan`; MLX's own where none is).

    Args:
        q: queries ``[B, Hq, Tq, D]``.
        k, v: keys and values ``[B, Hk, Tk, D]`` (``Hq`` a multiple of ``Hk``: grouped-query).
        scale: multiplies ``q``.
        mask: None; ``"causal"`` (query ``i`` sees keys ``<= Tk - Tq + i``); a boolean
            array (True: attend) or an additive one, broadcastable to ``[B, Hq, Tq, Tk]``.
        kwargs: ``sinks``, ``stream``, ``force_fused``: given, MLX's own computes it.

    Returns:
        ``[B, Hq, Tq, D]`` in the inputs' dtype.

    Raises:
        ValueError: a mask mode other than ``"causal"``.
    """
    if (any(v_ is not None and v_ is not False for v_ in kwargs.values()) or q.ndim != 4
            or not q.dtype == k.dtype == v.dtype == mx.float32):
        return mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)
    kernels = _plans.get((q.shape[1], k.shape[1], q.shape[3], q.dtype))
    if kernels is None:
        return mlx_attention(q, k, v, scale=scale, mask=mask)
    if q.shape[2] > FEW_QUERIES:
        return KERNELS[kernels[0]](q, k, v, scale, mask)
    return KERNELS[kernels[1 + _bucket(k.shape[2])]](q, k, v, scale, mask)


def install() -> None:
    """Make ``mx.fast.scaled_dot_product_attention`` :func:`attention`, process-wide."""
    mx.fast.scaled_dot_product_attention = attention


def uninstall() -> None:
    """Give ``mx.fast.scaled_dot_product_attention`` back to MLX's own."""
    mx.fast.scaled_dot_product_attention = mlx_attention


@contextlib.contextmanager
def installed(prefill: Optional[str] = None, decode: Union[None, str, tuple[str, ...]] = None,
              shapes=()) -> Iterator[None]:
    """:func:`install` for the duration of a ``with`` block; with ``prefill`` and
    ``decode`` (as :func:`plan` takes them), those kernels planned for each
    ``(hq, hk, d, dtype)`` of ``shapes`` meanwhile."""
    saved = dict(_plans)
    for shape in shapes:
        plan(*shape, prefill, decode)
    install()
    try:
        yield
    finally:
        uninstall()
        _plans.clear()
        _plans.update(saved)


# ----------------------------------------------------------------------------- the choice
def attention_shapes(model) -> set[tuple]:
    """The ``(query heads, KV heads, head size, dtype)`` of every attention call of a
    forward of ``model`` (traced lazily on two tokens: nothing is computed)."""
    seen: set[tuple] = set()
    current = mx.fast.scaled_dot_product_attention

    def record(q, k, v, *, scale, mask=None, **kwargs):
        seen.add((q.shape[1], k.shape[1], q.shape[3], q.dtype))
        return mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)

    mx.fast.scaled_dot_product_attention = record
    try:
        model(mx.array([[1, 2]]))
    finally:
        mx.fast.scaled_dot_product_attention = current
    return seen


def _candidates(names: tuple[str, ...]) -> list[str]:
    """``names`` less the compiled kernels where MLX cannot compile (no ``g++``)."""
    return [name for name in names if not name.startswith("compiled-") or _can_compile()]


@functools.cache
def _can_compile() -> bool:
    """``g++`` is on the PATH and MLX compiled the ``exp`` kernel (once per process)."""
    if shutil.which("g++") is None:
        return False
    try:
        mx.eval(exp_nonpositive(mx.zeros((1,))))
    except RuntimeError as e:  # e.g. a temporary directory that cannot hold or load the kernel
        log.warning("MLX could not compile the CPU attention kernel (%s)", e)
        return False
    return True


def measure_shape(hq: int, hk: int, d: int, dtype, rounds: int = 4) -> tuple[dict[str, float], ...]:
    """Seconds of each candidate kernel (fastest of ``rounds``, after two warm-up calls) on
    attention of that shape: :data:`PREFILL_KERNELS` on the :data:`PREFILL_SHAPES` chunks
    with a causal boolean mask (as mlx-lm's batch caches give; a kernel's figure is their
    sum), and :data:`DECODE_KERNELS` on one query over each of :data:`DECODE_BUCKETS`' keys
    with a boolean mask showing every key (what a batch cache gives a row without padding).
    Returns ``(prefill, decode per bucket...)``."""
    chunks = []
    for i, (tq, tk) in enumerate(PREFILL_SHAPES):
        q, k, v = (mx.random.normal(shape, key=kk).astype(dtype) for shape, kk in
                   zip(((1, hq, tq, d), (1, hk, tk, d), (1, hk, tk, d)), mx.random.split(mx.random.key(2 + i), 3)))
        chunks.append((q, k, v, (mx.arange(tk - tq, tk)[:, None] >= mx.arange(tk)[None])[None, None]))
    steps = []
    for i, (_, keys) in enumerate(DECODE_BUCKETS):
        q, k, v = (mx.random.normal(shape, key=kk).astype(dtype) for shape, kk in
                   zip(((1, hq, 1, d), (1, hk, keys, d), (1, hk, keys, d)), mx.random.split(mx.random.key(10 + i), 3)))
        steps.append((q, k, v, mx.ones((1, 1, 1, keys), dtype=mx.bool_)))
    mx.eval(chunks, steps)
    scale = d ** -0.5
    prefill = race({n: (lambda f=KERNELS[n]: [f(q, k, v, scale, m) for q, k, v, m in chunks])
                    for n in _candidates(PREFILL_KERNELS)}, rounds, sync=mx.eval, warmup=2)
    decodes = tuple(race({n: (lambda f=KERNELS[n], a=a: f(*a[:3], scale, a[3])) for n in _candidates(DECODE_KERNELS)},
                         rounds, sync=mx.eval, warmup=2) for a in steps)
    return (prefill, *decodes)


def _decode_label(i: int) -> str:
    fewest = DECODE_BUCKETS[i][0]
    if i + 1 == len(DECODE_BUCKETS):
        return f"over {fewest}+ keys"
    return f"over {fewest}-{DECODE_BUCKETS[i + 1][0] - 1} keys"


def choose(hq: int, hk: int, d: int, dtype, prefill: dict[str, float], *decodes: dict[str, float]) -> list[Choice]:
    """Plan the fastest kernels for that shape from their timings (:func:`pick`: MLX's
    own unless another beats it by the margin): ``prefill``'s and one per
    :data:`DECODE_BUCKETS` (``decodes``, in that order); returns the choices.

    Raises:
        ValueError: not one decode timing per bucket.
    """
    if len(decodes) != len(DECODE_BUCKETS):
        raise ValueError(f"{len(decodes)} decode timings for {len(DECODE_BUCKETS)} buckets")
    shape = f"[{hq} query / {hk} KV heads of {d}]"
    p = pick(prefill, "mlx")
    dd = tuple(pick(t, "mlx") for t in decodes)
    plan(hq, hk, d, dtype, p, dd)
    return [Choice(f"attention, prefill {shape}", p, dict(prefill))] + [
        Choice(f"attention, decode {_decode_label(i)} {shape}", name, dict(t))
        for i, (name, t) in enumerate(zip(dd, decodes))]


def choose_for_model(model, rounds: int = 4) -> list[Choice]:
    """Measure and plan the attention kernels for every attention shape of ``model``
    (float32 ones; others keep MLX's own), when MLX runs on the CPU and
    ``MLX_GATEWAY_CPU_ATTENTION`` is not 0; installs :func:`attention`. Logs and
    returns the choices (a reason instead of figures where nothing was measured)."""
    from gateway.cpu import cpu_backend

    why = ("MLX_GATEWAY_CPU_ATTENTION=0" if os.environ.get("MLX_GATEWAY_CPU_ATTENTION", "1") == "0"
           else None if cpu_backend() else "MLX runs on a GPU")
    if why is not None:
        return [Choice("attention", "mlx", reason=why).log()]
    choices = []
    for hq, hk, d, dtype in sorted(attention_shapes(model), key=str):
        if dtype != mx.float32:
            choices.append(Choice(f"attention [{hq}/{hk} heads of {d}, {dtype}]", "mlx",
                                  reason="not float32").log())
            continue
        if planned(hq, hk, d, dtype) is not None:
            continue  # another model of the same shape measured it
        choices += [c.log() for c in choose(hq, hk, d, dtype, *measure_shape(hq, hk, d, dtype, rounds))]
    install()
    return choices
