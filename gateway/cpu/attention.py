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
``compiled-blocks`` in blocks of 32, 16 or 8 queries for prefill; ``compiled-decode`` for
a few queries a row).

Which one runs is decided per model at load (:meth:`Plans.choose_for_model`): each kernel
is timed on the model's own head counts, head size and dtype, on the prefill chunks of
:data:`PREFILL_BUCKETS`, the decode steps of :data:`DECODE_BUCKETS` and the verify steps
of :data:`VERIFY_QUERIES` queries over the same keys (speculative decoding's drafts), and
the fastest is used for each (MLX's own unless another wins by
:data:`gateway.cpu.measure.MARGIN`); the log gives the figures, docs/deployment.md the
ones measured here. Shapes no model was measured for run MLX's own.

:meth:`Plans.attention` is what :meth:`Plans.install` puts in place of
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
from typing import Iterable, Optional, Union

import mlx.core as mx

from gateway.cpu.attention_kernels import KERNELS, Mask, exp_nonpositive, mlx_attention
from gateway.cpu.measure import Choice, confirmed_race, pick

log = logging.getLogger("mlx_gateway")

# (fewest rows x keys, rows, queries and keys timed) per prefill bucket: a prefill call of B
# rows over k keys takes the kernel timed for the last bucket whose fewest is <= B * k; the
# timings at load are of chunks over earlier context (a fresh chunk's figure is dominated by
# per-call costs that long prompts, where attention matters, do not pay): one row's, and a
# batch's of rows joining over a shared prefix
PREFILL_BUCKETS = ((0, 1, 256, 1024), (4096, 4, 64, 1024))
FEW_QUERIES = 16  # calls with at most this many queries a row (decode, verifying drafts) take a decode kernel
# (fewest keys, keys timed) per decode bucket: a decode call over k keys takes the kernel
# timed for the last bucket whose fewest is <= k (a short, a medium, a longer and a long
# context: under about 500 keys a compiled kernel's fixed cost per call outweighs its faster
# exp, 1.1-2.2x MLX's own time at 64-256 keys on the heads of the test models and SmolLM2);
# calls of one query take the decode step's kernel, calls of 2 to FEW_QUERIES the verify
# step's, timed on VERIFY_QUERIES queries over the same keys
DECODE_BUCKETS = ((0, 256), (512, 1024), (1536, 2048), (4096, 8192))
VERIFY_QUERIES = 6  # queries a row of the timed verify step (5 drafts and the input token)
PREFILL_KERNELS = ("mlx", "compiled-blocks")  # the candidates timed for prefill calls
# and for prefill calls of many rows times many keys, where narrower blocks may keep scores in the cache
WIDE_PREFILL_KERNELS = PREFILL_KERNELS + ("compiled-blocks-16", "compiled-blocks-8")
PREFILL_CANDIDATES = (PREFILL_KERNELS, WIDE_PREFILL_KERNELS)  # per PREFILL_BUCKETS
DECODE_KERNELS = ("mlx", "compiled-decode")  # and for decode calls (compiled-blocks, one block there, is
# compiled-decode plus a copy of the values)

def _per_bucket(names: Union[str, tuple[str, ...]], buckets: tuple, what: str) -> tuple[str, ...]:
    names = (names,) * len(buckets) if isinstance(names, str) else tuple(names)
    if len(names) != len(buckets):
        raise ValueError(f"{len(names)} {what} kernels for {len(buckets)} buckets")
    return names


def _bucket(buckets: tuple, size: int) -> int:
    """The index in ``buckets`` (:data:`PREFILL_BUCKETS`: ``size`` is rows x keys;
    :data:`DECODE_BUCKETS`: keys) of the last bucket whose fewest is <= ``size``."""
    return max(i for i, (fewest, *_) in enumerate(buckets) if fewest <= size)


def uninstall() -> None:
    """Give ``mx.fast.scaled_dot_product_attention`` back to MLX's own."""
    mx.fast.scaled_dot_product_attention = mlx_attention


class Plans:
    """The kernels planned per attention shape in this process (the CPU tuning,
    :class:`gateway.backend.CpuTuning`, holds the one that serves), and :meth:`attention`,
    which runs them."""

    def __init__(self):
        # (query heads, KV heads, head size, dtype) -> (one prefill kernel per PREFILL_BUCKETS,
        # one decode kernel per DECODE_BUCKETS, one verify kernel per DECODE_BUCKETS)
        self._plans: dict[tuple, tuple[str, ...]] = {}

    def plan(self, hq: int, hk: int, d: int, dtype, prefill: Union[str, tuple[str, ...]],
             decode: Union[str, tuple[str, ...]], verify: Union[None, str, tuple[str, ...]] = None) -> None:
        """Use kernel ``prefill`` for calls with more than :data:`FEW_QUERIES` queries per row,
        ``decode`` for calls of one (a decode step) and ``verify`` (default: ``decode``) for
        the others (a verify step's few), on attention of that shape (names from
        :data:`KERNELS`). ``prefill`` is one name for every call or one per
        :data:`PREFILL_BUCKETS`; ``decode`` and ``verify`` one for every context length or one
        per :data:`DECODE_BUCKETS`.

        Raises:
            KeyError: an unknown kernel name.
            ValueError: a tuple of kernels not one per bucket.
        """
        prefill = _per_bucket(prefill, PREFILL_BUCKETS, "prefill")
        decode = _per_bucket(decode, DECODE_BUCKETS, "decode")
        verify = decode if verify is None else _per_bucket(verify, DECODE_BUCKETS, "verify")
        for name in (*prefill, *decode, *verify):
            KERNELS[name]  # noqa: B018 (raises KeyError)
        self._plans[(hq, hk, d, dtype)] = (*prefill, *decode, *verify)

    def planned(self, hq: int, hk: int, d: int, dtype) -> Optional[tuple[str, ...]]:
        """The kernels used for that shape, ``(prefill per PREFILL_BUCKETS..., decode per
        DECODE_BUCKETS..., verify per DECODE_BUCKETS...)``, or None (MLX's own)."""
        return self._plans.get((hq, hk, d, dtype))

    def forget(self, shapes: Optional[Iterable[tuple]] = None) -> None:
        """``shapes`` (``(query heads, KV heads, head size, dtype)`` each, as
        :func:`attention_shapes` gives them), or every shape, back to MLX's own attention."""
        if shapes is None:
            self._plans.clear()
        for shape in shapes or ():
            self._plans.pop(tuple(shape), None)

    def attention(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Mask = None,
                  **kwargs) -> mx.array:
        """``softmax(scale * q @ k^T + mask) @ v``, as ``mx.fast.scaled_dot_product_attention``,
        with the kernel planned for its shape (:meth:`plan`; MLX's own where none is).

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
        kernels = self._plans.get((q.shape[1], k.shape[1], q.shape[3], q.dtype))
        if kernels is None:
            return mlx_attention(q, k, v, scale=scale, mask=mask)
        if q.shape[2] > FEW_QUERIES:
            return KERNELS[kernels[_bucket(PREFILL_BUCKETS, q.shape[0] * k.shape[2])]](q, k, v, scale, mask)
        regime = len(PREFILL_BUCKETS) + (0 if q.shape[2] == 1 else len(DECODE_BUCKETS))  # decode, or verify
        return KERNELS[kernels[regime + _bucket(DECODE_BUCKETS, k.shape[2])]](q, k, v, scale, mask)

    def install(self) -> None:
        """Make ``mx.fast.scaled_dot_product_attention`` :meth:`attention`, process-wide."""
        mx.fast.scaled_dot_product_attention = self.attention

    @contextlib.contextmanager
    def installed(self, prefill: Union[None, str, tuple[str, ...]] = None,
                  decode: Union[None, str, tuple[str, ...]] = None, shapes=(),
                  verify: Union[None, str, tuple[str, ...]] = None) -> Iterator[None]:
        """:meth:`install` for the duration of a ``with`` block; with ``prefill``, ``decode``
        and ``verify`` (as :meth:`plan` takes them), those kernels planned for each
        ``(hq, hk, d, dtype)`` of ``shapes`` meanwhile."""
        saved = dict(self._plans)
        for shape in shapes:
            self.plan(*shape, prefill, decode, verify)
        self.install()
        try:
            yield
        finally:
            uninstall()
            self._plans.clear()
            self._plans.update(saved)

    def choose(self, hq: int, hk: int, d: int, dtype, *timings: dict[str, float]) -> list[Choice]:
        """Plan the fastest kernels for that shape from their timings (:func:`pick`: MLX's
        own unless another beats it by the margin): one per :data:`PREFILL_BUCKETS`, then one
        per :data:`DECODE_BUCKETS` for decode steps and one per :data:`DECODE_BUCKETS` for
        verify steps (``timings``, in that order); returns the choices.

        Raises:
            ValueError: not one timing per bucket.
        """
        p, n = len(PREFILL_BUCKETS), len(DECODE_BUCKETS)
        if len(timings) != p + 2 * n:
            raise ValueError(f"{len(timings)} timings for {p} prefill, {n} decode and {n} verify buckets")
        shape = f"[{hq} query / {hk} KV heads of {d}]"
        chosen = [pick(t, "mlx") for t in timings]
        self.plan(hq, hk, d, dtype, tuple(chosen[:p]), tuple(chosen[p:p + n]), tuple(chosen[p + n:]))
        return [Choice(f"attention, {label} {shape}", name, dict(t))
                for label, name, t in zip(labels(), chosen, timings)]

    def choose_for_model(self, model, rounds: int = 4) -> list[Choice]:
        """Measure and plan the attention kernels for every attention shape of ``model``
        (float32 ones; others keep MLX's own), unless ``MLX_GATEWAY_CPU_ATTENTION`` is 0;
        installs :meth:`attention`. Logs and returns the choices (a reason instead of
        figures where nothing was measured)."""
        if os.environ.get("MLX_GATEWAY_CPU_ATTENTION", "1") == "0":
            return [Choice("attention", "mlx", reason="MLX_GATEWAY_CPU_ATTENTION=0").log()]
        choices = []
        for hq, hk, d, dtype in sorted(attention_shapes(model), key=str):
            if dtype != mx.float32:
                choices.append(Choice(f"attention [{hq}/{hk} heads of {d}, {dtype}]", "mlx",
                                      reason="not float32").log())
                continue
            if self.planned(hq, hk, d, dtype) is not None:
                continue  # another model of the same shape measured it
            choices += [c.log() for c in self.choose(hq, hk, d, dtype, *measure_shape(hq, hk, d, dtype, rounds))]
        self.install()
        return choices


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
    """Seconds of each candidate kernel (fastest of ``rounds``, after two warm-up calls,
    raced again where MLX's own wins: :func:`gateway.cpu.measure.confirmed_race`) on
    attention of that shape: :data:`PREFILL_KERNELS`, then :data:`WIDE_PREFILL_KERNELS`, on
    each of :data:`PREFILL_BUCKETS`' chunks with a causal boolean mask (as mlx-lm's batch
    caches give), and :data:`DECODE_KERNELS` on one query, then on :data:`VERIFY_QUERIES`,
    over each of :data:`DECODE_BUCKETS`' keys with a causal boolean mask, each query seeing
    the keys up to its own position (what a batch cache gives a row without padding). Returns ``(prefill per bucket..., decode per bucket..., verify per bucket...)``."""
    chunks = []
    for i, (_, b, tq, tk) in enumerate(PREFILL_BUCKETS):
        q, k, v = (mx.random.normal(shape, key=kk).astype(dtype) for shape, kk in
                   zip(((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, d)), mx.random.split(mx.random.key(2 + i), 3)))
        chunks.append((q, k, v, (mx.arange(tk - tq, tk)[:, None] >= mx.arange(tk)[None])[None, None]))
    steps = []
    for tq in (1, VERIFY_QUERIES):
        for i, (_, keys) in enumerate(DECODE_BUCKETS):
            q, k, v = (mx.random.normal(shape, key=kk).astype(dtype) for shape, kk in
                       zip(((1, hq, tq, d), (1, hk, keys, d), (1, hk, keys, d)),
                           mx.random.split(mx.random.key(10 + i), 3)))
            steps.append((q, k, v, (mx.arange(keys - tq, keys)[:, None] >= mx.arange(keys)[None])[None, None]))
    mx.eval(chunks, steps)
    scale = d ** -0.5
    calls = [*zip(chunks, PREFILL_CANDIDATES), *((a, DECODE_KERNELS) for a in steps)]
    return tuple(confirmed_race({n: (lambda f=KERNELS[n], a=a: f(*a[:3], scale, a[3])) for n in _candidates(names)},
                                "mlx", rounds, sync=mx.eval, warmup=2) for a, names in calls)


def _label(fewests: list[int], i: int, unit: str) -> str:
    if i + 1 == len(fewests):
        return f"over {fewests[i]}+ {unit}"
    return f"over {fewests[i]}-{fewests[i + 1] - 1} {unit}"


def labels() -> list[str]:
    """What each planned kernel is for, in :func:`planned`'s order (as the log names them)."""
    prefill = [b[0] for b in PREFILL_BUCKETS]
    decode = [b[0] for b in DECODE_BUCKETS]
    return ([f"prefill {_label(prefill, i, 'rows x keys')}" for i in range(len(prefill))]
            + [f"decode {_label(decode, i, 'keys')}" for i in range(len(decode))]
            + [f"verify {_label(decode, i, 'keys')}" for i in range(len(decode))])
