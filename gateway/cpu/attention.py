"""Attention for MLX's CPU backend: the kernel that a measurement at load finds fastest.

On the CPU, ``mx.fast.scaled_dot_product_attention`` runs MLX's unfused fallback
(``mlx/fast.cpp``): ``q @ k^T``, mask, ``softmax(precise=True)``, ``@ v``, over every
key for every query. On Linux x86-64 MLX's ``exp`` is its Cephes polynomial on
``Simd<float, 1>`` with out-of-line ``fma`` calls, one element at a time (about 60-70 M
elements/s on the 2-core machine of ``benchmarks/bench_cpu_attention.py``), so a
2,048-token prefill chunk of SmolLM2-135M (9 query heads of 64) spends about 0.7 s per
layer in attention, 20 s of a chunk whose matmuls take 4: the ``[Tq, Tk]`` scores are
38 M elements per layer, half of them masked.

The kernels here (:data:`KERNELS`):

* ``mlx``: MLX's own, as it is.
* ``compiled-blocks``: blocks of :data:`COMPILED_BLOCK` queries (their scores stay in
  the CPU's cache), the softmax's ``exp`` written as array ops (the same polynomial) and
  fused by ``mx.compile`` into kernels the compiler vectorizes, and the normalizer taken
  by the ``@ v`` matmul itself (``v`` gets a column of ones).
* ``compiled-decode``: for a few queries a row (a decode step, a verify step): the same
  compiled ``exp`` over all of a row's scores at once, the normalizer summed over them
  (a column of ones would copy every value for a single query). Over 2,000 keys MLX's
  scalar ``exp`` makes its own kernel about twice this one on SmolLM2's heads (0.84
  against 0.45 ms a layer here; 2.67 against 1.40 over 8,000), a tenth of a decode step.

A third, MLX's own on blocks of 128 queries (under a causal mask a block sees only the
keys before its end), was removed: in no measurement at load on the machines measured did
it beat MLX's own by the margin (e.g. 36.00 against 36.35 ms on SmolLM2's prefill shape),
and the compiled kernel beat it wherever that one could be built.

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
from typing import Callable, Optional, Union

import mlx.core as mx

from gateway.cpu.measure import Choice, pick, race

log = logging.getLogger("mlx_gateway")

LOG2E = 1.4426950408889634
# exp(x) = 2**i * P(f) with i = round(x * log2(e)), f the rest: the Cephes coefficients
# MLX's CPU exp uses (via github.com/akohlmey/fastermath), highest degree first.
POLY = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
        2.402264791363012e-1, 6.931472028550421e-1, 1.0)
ROUND = 12582912.0  # 1.5 * 2**23: (y + ROUND) - ROUND rounds a float32 |y| < 2**22 to an integer

COMPILED_BLOCK = 32  # queries per block of the compiled-blocks kernel: [rep * 32, Tk] scores stay in cache
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
_MASKED = -3.0e38  # a score that exp turns into 0 (finite: a fully masked row stays finite, as in MLX)

_mlx_attention = mx.fast.scaled_dot_product_attention

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


_seen_causal: list = [None, False]  # [the last array mask checked, whether it hides the future]


def _hides_future(mask: Mask, Tq: int, Tk: int) -> bool:
    """True when no query may see a key after its own position (``Tk - Tq + i`` for query
    ``i``): ``"causal"``, or a boolean array mask that is False there (mlx-lm's batch
    caches' masks: causal with padding, or a sliding window). Then a block of queries
    needs only the keys up to its last query. An array mask is checked once (the models
    pass one mask object to every layer of a forward)."""
    if isinstance(mask, str):
        return mask == "causal"
    if mask is None or mask.dtype != mx.bool_ or Tq == 1:
        return Tq == 1 and mask is None
    if _seen_causal[0] is mask:
        return _seen_causal[1]
    future = mx.arange(Tk)[None] > mx.arange(Tk - Tq, Tk)[:, None]
    hides = not bool(mx.any(mx.logical_and(mask, future)).item())
    _seen_causal[:] = [mask, hides]
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


def _blocks(Tq: int, Tk: int, block: int, causal: bool) -> Iterator[tuple[int, int, int]]:
    """``(start, end, keys)`` per block of queries: the keys it needs are ``[0, keys)``."""
    for s in range(0, Tq, block):
        e = min(Tq, s + block)
        yield s, e, (Tk - Tq + e) if causal else Tk


def _compiled_blocks(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask) -> mx.array:
    """Attention in blocks of :data:`COMPILED_BLOCK` queries, float32: per block and KV
    head, the ``rep`` query heads that share it are one ``[rep * n, D]`` matmul against
    the keys the block sees; the softmax's ``exp`` is :func:`_exp_shifted`; ``@ [v, 1]``
    gives the weighted values and their normalizer at once. Grouped-query heads: query
    head ``h`` uses key/value head ``h // rep``, as in MLX."""
    B, Hq, Tq, D = q.shape
    Hk, Tk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    causal = _hides_future(mask, Tq, Tk)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"[scaled_dot_product_attention] Invalid mask_mode {mask}")
    elif mask is not None:
        mask = _mask_4d(mask)
    q = (q * mx.array(scale, q.dtype)).reshape(B, Hk, rep, Tq, D)
    kT = k.swapaxes(-1, -2)
    v1 = mx.concatenate([v, mx.ones((B, Hk, Tk, 1), v.dtype)], axis=-1)  # [.., D + 1]: the last column sums p
    outs = []
    for s, e, n in _blocks(Tq, Tk, COMPILED_BLOCK, causal):
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


def _compiled_decode(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Mask) -> mx.array:
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
    return _mlx_attention(q, k, v, scale=scale, mask=mask)


KERNELS: dict[str, Callable[[mx.array, mx.array, mx.array, float, Mask], mx.array]] = {
    "mlx": _mlx, "compiled-blocks": _compiled_blocks, "compiled-decode": _compiled_decode,
}

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
        return _mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)
    kernels = _plans.get((q.shape[1], k.shape[1], q.shape[3], q.dtype))
    if kernels is None:
        return _mlx_attention(q, k, v, scale=scale, mask=mask)
    if q.shape[2] > FEW_QUERIES:
        return KERNELS[kernels[0]](q, k, v, scale, mask)
    return KERNELS[kernels[1 + _bucket(k.shape[2])]](q, k, v, scale, mask)


def install() -> None:
    """Make ``mx.fast.scaled_dot_product_attention`` :func:`attention`, process-wide."""
    mx.fast.scaled_dot_product_attention = attention


def uninstall() -> None:
    """Give ``mx.fast.scaled_dot_product_attention`` back to MLX's own."""
    mx.fast.scaled_dot_product_attention = _mlx_attention


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
        return _mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)

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
