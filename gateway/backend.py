"""What MLX computes on in this process, decided once, and the tuning that holds every
choice made for it.

:func:`backend` decides on its first call (``serve``, at start) from MLX's default device
(:func:`kind_of`) and returns the process's tuning, whose calls are the same on every
backend: :class:`CpuTuning` (``mlx[cpu]``: each path measured at load, its parts in
:mod:`gateway.cpu`), :class:`MetalTuning` (the budget is Metal's recommended working set,
the weights are wired) and :class:`Tuning` (CUDA: MLX's own paths). docs/deployment.md.
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
    ``device_type`` (``mx.default_device().type.name``: ``"cpu"`` or ``"gpu"``) where
    Metal and CUDA are, or are not, available."""
    if device_type != "gpu":
        return "cpu"
    return "metal" if metal else "cuda" if cuda else "cpu"


def weights_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters as they are now (shapes and dtypes: nothing is read)."""
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


class Tuning:
    """A backend's tuning; this one (CUDA) keeps MLX's own paths.

    Args:
        kind: ``"cpu"``, ``"metal"`` or ``"cuda"``.
        memory: bytes the process may use (None: unknown).
    """

    merge_streams = 1  # streams a decode batch's merge spreads over (the loader tells the engine thread)
    trims_idle = False  # the freed heap goes back to the kernel after a quiet spell
    budget_source = f"{BUDGET_SHARE:.0%} of this machine's memory"  # for the log

    def __init__(self, kind: str, memory: Optional[int] = None):
        self.kind = kind
        self.memory = memory

    def start(self, model_dir: Optional[str]) -> None:
        """At start-up, before any thread, with the first model's directory: nothing here."""

    def memory_budget(self) -> int:
        """The default ``--memory-budget`` (bytes): :data:`BUDGET_SHARE` of :attr:`memory`,
        :data:`FALLBACK_BUDGET` where unknown."""
        return int(BUDGET_SHARE * self.memory) if self.memory else FALLBACK_BUDGET

    def served_bytes(self, model: nn.Module) -> int:
        """Bytes ``model``'s weights will take once served (here: as stored)."""
        return weights_bytes(model)

    def prepare_weights(self, model: nn.Module, measure: bool = True, decided: Optional[str] = None) -> Optional[str]:
        """Read ``model``'s weights as they will serve; returns how they were changed
        (``"float32"``), or None (here: as stored). ``decided`` (``"float32"`` or ``"as
        stored"``): as an earlier load of the same files found, unmeasured."""
        mx.eval(model.parameters())
        return None

    def prepare(self, model: nn.Module, measure: bool = True) -> list[Choice]:
        """What to set for ``model`` once its weights are read; returns the choices made
        (here: none)."""
        return []


class MetalTuning(Tuning):
    """Metal: the default budget is the recommended working set
    (``max_recommended_working_set_size``: what the GPU can use without paging), and each
    model's weights are wired (``mx.set_wired_limit``, at most that working set), so that
    macOS does not page them out between requests. mlx-lm's batch generator raises the
    limit to the working set while it lives and then gives back this one.

    Args:
        info: ``mx.device_info()``.
    """

    def __init__(self, info: Mapping, memory: Optional[int] = None):
        super().__init__("metal", memory)
        self.working_set = int(info.get("max_recommended_working_set_size") or 0)
        self.wired = 0  # bytes of weights wired so far
        if self.working_set:
            self.budget_source = "Metal's recommended working set"

    def memory_budget(self) -> int:
        return self.working_set or super().memory_budget()

    def prepare(self, model: nn.Module, measure: bool = True) -> list[Choice]:
        """Add ``model``'s weights to the wired limit (at most the working set; an unloaded
        model's are not taken off: the limit is a ceiling, not a reservation)."""
        if self.working_set:
            self.wired = min(self.working_set, self.wired + weights_bytes(model))
            mx.set_wired_limit(self.wired)
            log.info("Metal: wired limit %.0f MB for the weights (working set %.0f MB)",
                     self.wired / 1e6, self.working_set / 1e6)
        return []


class CpuTuning(Tuning):
    """MLX on the CPU: each replacement of MLX's own path chosen by a measurement here
    (:mod:`gateway.cpu.measure`): OpenBLAS at start (:mod:`gateway.cpu.blas`), float32
    weights as a model is read (:mod:`gateway.cpu.weights`), then its attention kernels
    (:attr:`attention`) and, for the first model of the process, the allocator setting
    (:attr:`allocator`, timed on a prefill-shaped workload with those kernels) and the
    merges' streams (:attr:`merges`, :mod:`gateway.cpu.merges`)."""

    def __init__(self, memory: Optional[int] = None):
        super().__init__("cpu", memory)
        self.attention = attention.Plans()
        self.allocator = allocator.Allocator()
        self.merges: Optional[Choice] = None  # the merges' streams, once measured

    @property
    def merge_streams(self) -> int:
        return merges.CANDIDATES[self.merges.chosen] if self.merges is not None else 1

    @property
    def trims_idle(self) -> bool:
        return allocator.unavailable() is None

    def start(self, model_dir: Optional[str]) -> None:
        """:func:`gateway.cpu.blas.ensure_fast_blas` on a matmul of the model's shape (it
        may re-execute the process)."""
        from gateway.cpu.blas import ensure_fast_blas, matmul_shape

        ensure_fast_blas(matmul_shape(model_dir))

    def served_bytes(self, model: nn.Module) -> int:
        return weights.served_bytes(model)

    def prepare_weights(self, model: nn.Module, measure: bool = True, decided: Optional[str] = None) -> Optional[str]:
        """:func:`gateway.cpu.weights.float32_weights_for_cpu_backend` (``measure`` false:
        unmeasured, as ranks of a split model must decide alike; ``decided``: ``"float32"``
        or ``"as stored"``, as an earlier load of the same files found, unmeasured), then read."""
        why = weights.float32_weights_for_cpu_backend(model, allocator=self.allocator, measure=measure,
                                                      decided=decided)
        mx.eval(model.parameters())
        return "float32" if why is None else None

    def prepare(self, model: nn.Module, measure: bool = True, rounds: int = 4) -> list[Choice]:
        """Measure and set the attention kernels for ``model``'s shapes and, once per
        process, the allocator setting and the merges' streams, on a stream of the calling
        thread's own (a model loads while the engine loop steps the others); returns the
        choices (each logged), the last the seconds they took.

        ``measure`` false keeps MLX's own paths unmeasured: for a model split across ranks
        (``mlx.launch``), where a rank that finished measuring waits in the next collective
        while the others still measure, and on shared cores that wait takes the CPU the
        others' measurements need (their timings, and the load, then ran 7x longer)."""
        if not measure:
            return [Choice("CPU paths", "MLX's own", reason="split across ranks: not measured, every rank alike").log()]
        tic, stream = time.perf_counter(), mx.new_stream(mx.default_device())
        try:
            with mx.stream(stream):
                self.allocator.as_it_will_serve()  # the kernels timed with the heap as it will serve
                choices = self.attention.choose_for_model(model, rounds)
                shapes = attention.attention_shapes(model)
                if allocator.unavailable() is None and self.allocator.decided is None:
                    workload = allocator.prefill_workload(model, shapes, self.attention.attention)
                    if workload is not None:
                        choices.append(self.allocator.choose(workload, mx.eval, max(1, rounds - 2)))
                if self.merges is None:
                    choices.append(merges.choose(model, shapes, max(1, rounds - 1)))
                    self.merges = choices[-1] if choices[-1].seconds else None  # no float32 attention: the next model
        finally:
            mx.synchronize(stream)
        choices.append(Choice("CPU path measurements", "done", reason=f"{time.perf_counter() - tic:.2f} s").log())
        return choices


def tuning_for(kind: str, info: Mapping, memory: Optional[int]) -> Tuning:
    """The tuning of backend ``kind`` (:func:`kind_of`), given the device's ``info``
    (``mx.device_info()``) and the bytes the process may use."""
    if kind == "metal":
        return MetalTuning(info, memory)
    return Tuning("cuda", memory) if kind == "cuda" else CpuTuning(memory)


@functools.cache
def backend() -> Tuning:
    """This process's tuning, decided on the first call."""
    cuda = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()
    kind = kind_of(mx.default_device().type.name, mx.metal.is_available(), cuda)
    info = mx.device_info() if kind != "cpu" else {}
    log.info("MLX computes on %s here (%s)", kind, info.get("device_name", mx.default_device()))
    return tuning_for(kind, info, memory_limit_bytes())
