"""Which backend MLX computes on in this process, decided once, and what is tuned for it.

:func:`backend` decides on its first call (``serve`` makes it at start, before any model
loads) from MLX's default device (:func:`kind_of`): ``cpu`` where it is the CPU
(``mlx[cpu]`` on Linux, or a Mac told to compute on the CPU), ``metal`` on Apple silicon,
``cuda`` with ``mlx[cuda]``. It returns that backend's tuning, one object for the
process's life that holds every choice made for it, with the same calls on every backend:

- ``start(model_dir)``: at start-up, before any thread (the CPU's OpenBLAS re-execution);
- ``memory_budget()``: the default ``--memory-budget`` (bytes);
- ``served_bytes(model)``: what a model's weights will take once served (bytes);
- ``prepare_weights(model, measure)``: the weights as they will serve, read and evaluated
  (float32 on the CPU where measured faster); returns ``"float32"`` when they were
  changed, else None;
- ``prepare(model, measure)``: the rest, once the weights are in (the CPU's attention
  kernels, allocator and batch-merge streams; Metal's wired limit);
- ``merge_streams``: the streams a decode batch's merge spreads over, which the loader
  gives the engine thread (:func:`scheduler.batch_merge.spread_merges`);
- ``trims_idle``: the freed heap goes back to the kernel after a quiet spell.

The tunings: :class:`CpuTuning` (each path measured at load, docs/deployment.md, its
parts in :mod:`gateway.cpu`); :class:`MetalTuning` (the budget is Metal's recommended working set,
and the weights are wired); :class:`Tuning` for CUDA (MLX's own paths).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Mapping, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from gateway.cpu import allocator, attention, merges, weights
from gateway.cpu.measure import Choice
from gateway.cpu.weights import memory_limit_bytes

log = logging.getLogger("mlx_gateway")

BUDGET_SHARE = 0.75  # default budget on the CPU and CUDA: this share of the memory the process may use
FALLBACK_BUDGET = 16 << 30  # bytes, where the memory cannot be read


def kind_of(device_type: str, metal: bool, cuda: bool) -> str:
    """``"cpu"``, ``"metal"`` or ``"cuda"``: the backend of a default device of
    ``device_type`` (``"cpu"`` or ``"gpu"``, as ``mx.default_device().type`` names it)
    where Metal and CUDA are, or are not, available. A GPU is Metal's where both are."""
    if device_type != "gpu":
        return "cpu"
    return "metal" if metal else "cuda" if cuda else "cpu"


def weights_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters as they are now (shapes and dtypes: nothing is read)."""
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


class Tuning:
    """A GPU backend's tuning (CUDA; Metal's adds to it): MLX's own paths.

    Args:
        kind: ``"cuda"`` or ``"metal"``.
        memory: bytes the process may use (None: unknown), for the default budget.
    """

    merge_streams = 1
    trims_idle = False

    def __init__(self, kind: str, memory: Optional[int] = None):
        self.kind = kind
        self.memory = memory

    def start(self, model_dir: Optional[str]) -> None:
        """Nothing to set up at start on a GPU."""

    def memory_budget(self) -> int:
        """:data:`BUDGET_SHARE` of :attr:`memory` (bytes), :data:`FALLBACK_BUDGET` where unknown."""
        return int(BUDGET_SHARE * self.memory) if self.memory else FALLBACK_BUDGET

    @property
    def budget_source(self) -> str:
        """Where :meth:`memory_budget` comes from, for the log."""
        return f"{BUDGET_SHARE:.0%} of this machine's memory" if self.memory else "this machine's memory unknown"

    def served_bytes(self, model: nn.Module) -> int:
        """The weights' bytes as stored (a GPU serves them so)."""
        return weights_bytes(model)

    def prepare_weights(self, model: nn.Module, measure: bool = True) -> Optional[str]:
        """Read the weights as stored; returns None (unchanged)."""
        mx.eval(model.parameters())
        return None

    def prepare(self, model: nn.Module, measure: bool = True) -> list:
        """Nothing to choose on this backend; returns no choices."""
        return []


class MetalTuning(Tuning):
    """Metal (Apple silicon): the default budget is Metal's recommended working set
    (``max_recommended_working_set_size``: what the GPU can use without paging, below the
    machine's memory), and each model's weights are wired (``mx.set_wired_limit``, up to
    that working set), so that macOS does not page them out between requests. mlx-lm's
    batch generator raises the wired limit to the working set while it lives and gives
    back the one in force before it, which is then this one.

    Args:
        info: ``mx.device_info()`` (``max_recommended_working_set_size``, ``memory_size``: bytes).
    """

    def __init__(self, info: Mapping):
        super().__init__("metal", info.get("memory_size"))
        self.working_set = int(info.get("max_recommended_working_set_size") or 0)
        self.wired = 0  # bytes of weights wired so far (never more than the working set)

    def memory_budget(self) -> int:
        """The recommended working set (bytes), else what :class:`Tuning` gives."""
        return self.working_set or super().memory_budget()

    @property
    def budget_source(self) -> str:
        return "Metal's recommended working set" if self.working_set else super().budget_source

    def prepare(self, model: nn.Module, measure: bool = True) -> list:
        """Wire ``model``'s weights too: the wired limit becomes the weights prepared so
        far, at most the working set. Models unloaded are not subtracted (the limit is a
        ceiling, not a reservation)."""
        if self.working_set:
            self.wired = min(self.working_set, self.wired + weights_bytes(model))
            mx.set_wired_limit(self.wired)
            log.info("Metal: wired limit %.0f MB for the weights (recommended working set %.0f MB)",
                     self.wired / 1e6, self.working_set / 1e6)
        return []


class CpuTuning(Tuning):
    """MLX on the CPU (``mlx[cpu]``): each replacement of MLX's own path, chosen by a
    measurement on this machine (:mod:`gateway.cpu.measure`), and the choices made:
    OpenBLAS at start (:mod:`gateway.cpu.blas`); float32 weights as a model is read
    (:mod:`gateway.cpu.weights`); then its attention kernels (:attr:`attention`,
    :mod:`gateway.cpu.attention`) and, for the first model of the process, the allocator
    setting (:attr:`allocator`, measured on a prefill-shaped workload of that model with
    those kernels) and the streams a decode batch's merge spreads over (:attr:`merges`,
    :mod:`gateway.cpu.merges`).

    Args:
        memory: bytes the process may use (None: unknown).
    """

    def __init__(self, memory: Optional[int] = None):
        super().__init__("cpu", memory)
        self.attention = attention.Plans()
        self.allocator = allocator.Allocator()
        self.merges: Optional[Choice] = None  # the batch merges' streams, once measured

    @property
    def merge_streams(self) -> int:
        """Streams a decode batch's merge spreads over: the measured choice's, else 1."""
        return merges.CANDIDATES[self.merges.chosen] if self.merges is not None else 1

    @property
    def trims_idle(self) -> bool:
        """glibc's malloc can be tuned here, so the heap it keeps is given back when idle."""
        return allocator.unavailable() is None

    def start(self, model_dir: Optional[str]) -> None:
        """Re-execute with OpenBLAS preloaded where a matmul of the first model's shape
        measures faster on it, or warn (:func:`gateway.cpu.blas.ensure_fast_blas`); before
        any thread. Does not return when it re-executes."""
        from gateway.cpu.blas import ensure_fast_blas, matmul_shape

        ensure_fast_blas(matmul_shape(model_dir))

    def served_bytes(self, model: nn.Module) -> int:
        """As float32 where :meth:`prepare_weights` would convert them, else as stored."""
        return weights.served_bytes(model)

    def prepare_weights(self, model: nn.Module, measure: bool = True) -> Optional[str]:
        """float32 weights where one of the model's layers measures faster so
        (:func:`gateway.cpu.weights.float32_weights_for_cpu_backend`; unmeasured where
        ``measure`` is false, as ranks of a split model must decide alike), then read;
        returns ``"float32"`` when converted, else None."""
        why = weights.float32_weights_for_cpu_backend(model, allocator=self.allocator, measure=measure)
        mx.eval(model.parameters())
        return "float32" if why is None else None

    def prepare(self, model: nn.Module, measure: bool = True, rounds: int = 4) -> list[Choice]:
        """Measure and set the attention kernels for ``model``'s shapes and, once per
        process, the allocator setting and the batch merges' streams; returns the choices
        (each is logged), the last a note of the seconds the measurements took. They run
        on a stream of the calling thread's own (a model loads while the engine loop steps
        the others).

        ``measure`` false keeps MLX's own paths unmeasured: for a model split across ranks
        (``mlx.launch``), where a rank that finished measuring waits in the next collective
        while the others still measure, and on shared cores that wait takes the CPU the
        others' measurements need (their timings, and the load, then ran 7x longer)."""
        if not measure:
            return [Choice("CPU paths", "MLX's own", reason="split across ranks: not measured, every rank alike").log()]
        stream = mx.new_stream(mx.default_device())
        try:
            with mx.stream(stream):
                return self._choose(model, rounds)
        finally:
            mx.synchronize(stream)

    def _choose(self, model: nn.Module, rounds: int) -> list[Choice]:
        tic = time.perf_counter()
        self.allocator.as_it_will_serve()  # the kernels timed with the heap as it will serve
        choices = self.attention.choose_for_model(model, rounds)
        if allocator.unavailable() is None and self.allocator.decided is None:
            workload = allocator.prefill_workload(model, attention.attention_shapes(model), self.attention.attention)
            if workload is not None:
                choices.append(self.allocator.choose(workload, mx.eval, max(1, rounds - 2)))
        if self.merges is None:
            choice = merges.choose(model, attention.attention_shapes(model), max(1, rounds - 1))
            self.merges = choice if choice.seconds else None  # a model with no float32 attention: the next one
            choices.append(choice)
        choices.append(Choice("CPU path measurements", "done", reason=f"{time.perf_counter() - tic:.2f} s").log())
        return choices


def tuning_for(kind: str, info: Mapping, memory: Optional[int]) -> Tuning:
    """The tuning of backend ``kind`` (:func:`kind_of`), given the device's ``info``
    (``mx.device_info()``) and the bytes the process may use."""
    if kind == "metal":
        return MetalTuning(info)
    return Tuning("cuda", memory) if kind == "cuda" else CpuTuning(memory)


@functools.cache
def backend() -> Tuning:
    """This process's backend tuning (see the module docstring), decided on the first call."""
    metal = mx.metal.is_available()
    cuda = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
    kind = kind_of(mx.default_device().type.name, metal, cuda)
    info = mx.device_info() if kind != "cpu" else {}
    tuning = tuning_for(kind, info, memory_limit_bytes())
    log.info("MLX computes on %s here (%s)", kind, info.get("device_name", mx.default_device()))
    return tuning
