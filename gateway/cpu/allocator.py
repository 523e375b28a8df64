"""glibc malloc that keeps freed memory for reuse (Linux, MLX on the CPU), where it pays.

MLX's CPU backend allocates every array with ``malloc`` and frees it when the array
dies; it keeps no buffer cache of its own (its Metal allocator does). glibc serves
large requests with fresh ``mmap`` pages (or trims the heap top back to the kernel on
``free``), so each new buffer page-faults on first write: on the 2-core VM of
``benchmarks/bench_cpu_attention.py`` about 3 µs per 4 KiB page, so a float32 multiply of
12 M elements took 53 ms, against 8 ms once memory is reused.

:data:`SETTINGS` (``mallopt(3)``): no ``mmap`` for large blocks (``M_MMAP_MAX=0``) and no
trimming below 1 GiB of free heap top (``M_TRIM_THRESHOLD``). Memory freed after a
prefill chunk then stays in the process for the next one; the resident size follows the
peak, like jemalloc or tcmalloc with their defaults (:mod:`gateway.cpu.idle_trim` gives it
back after a quiet spell).

Whether that is faster depends on the machine and on the kernels in use (attention that
works in blocks makes few large buffers), so :meth:`Allocator.choose` measures it at load, on a
prefill-shaped workload of the served model, first with glibc's behaviour, then with the
settings, and keeps them only if they win by :data:`gateway.cpu.measure.MARGIN`. Otherwise
it sets :data:`GLIBC_LIKE`: glibc's own values once its dynamic threshold has grown to its
ceiling (``mmap`` above 32 MiB, trim above 64 MiB), since ``mallopt`` cannot switch the
dynamic threshold back on. ``MLX_GATEWAY_MALLOC_TUNE=0`` leaves glibc alone; ``=1`` sets
the settings without measuring.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Callable, Optional

from gateway.cpu.measure import Choice, pick, race

log = logging.getLogger("mlx_gateway")

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30))
# glibc's defaults after its dynamic mmap threshold reached its 64-bit ceiling
# (DEFAULT_MMAP_THRESHOLD_MAX, 32 MiB; the trim threshold follows at twice that).
GLIBC_LIKE = ((M_MMAP_MAX, 65536), (M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20))

def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


def unavailable() -> Optional[str]:
    """Why glibc's malloc cannot be tuned here (``MLX_GATEWAY_MALLOC_TUNE=0``, not Linux
    with glibc), or None; imports nothing (:func:`one_arena` runs before MLX does)."""
    if os.environ.get("MLX_GATEWAY_MALLOC_TUNE", "") == "0":
        return "MLX_GATEWAY_MALLOC_TUNE=0"
    if not sys.platform.startswith("linux") or not _glibc():
        return "not Linux with glibc"
    return None


def _mallopt(settings) -> Optional[str]:
    libc = ctypes.CDLL(None)
    for param, value in settings:
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            log.warning("glibc refused mallopt(%d, %d)", param, value)
            return f"mallopt({param}, {value}) failed"
    return None


def one_arena() -> Optional[str]:
    """Have every thread allocate from glibc's main arena (``M_ARENA_MAX=1``); called first
    thing by ``serve``, before MLX is imported and any thread starts, since glibc reuses
    the arenas it already made once the limit is set. Returns why it did not (not Linux
    with glibc, ``MLX_GATEWAY_MALLOC_TUNE=0``), or None.

    Why: with an arena per thread (glibc's default), MLX's stream threads allocate from
    heaps of at most 64 MiB of their own, and in 3 of 9 fresh servers of the default model
    the compiled attention kernel timed 1.7-2.5x slower; with one, 10 of 10 timed as fast
    as it can (``malloc_info``: 12 heaps without, 1 with; docs/deployment.md)."""
    return unavailable() or _mallopt(((M_ARENA_MAX, 1),))


WORKLOAD_TOKENS = (384, 1536)  # (queries, keys) of the prefill-shaped workload :meth:`Allocator.choose` times


def prefill_workload(model, shapes: set[tuple], attention: Callable) -> Optional[Callable[[], list]]:
    """A call doing prefill-shaped work of ``model`` on the CPU: ``attention`` (the planned
    kernels) of its first float32 shape (``(query heads, KV heads, head size, dtype)``)
    over :data:`WORKLOAD_TOKENS` with a causal mask, and an MLP-sized matmul pair on those
    queries; what it returns goes to ``mx.eval``. None when the model has no float32
    attention."""
    import mlx.core as mx  # here: this module is imported before MLX (one_arena)

    shapes = sorted(s for s in shapes if s[3] == mx.float32)
    if not shapes:
        return None
    hq, hk, d, _ = shapes[0]
    args = getattr(model, "args", None)
    hidden = int(getattr(args, "hidden_size", 0) or hq * d)
    inter = int(getattr(args, "intermediate_size", 0) or 4 * hidden)
    tq, tk = WORKLOAD_TOKENS
    keys = mx.random.split(mx.random.key(2), 5)
    q, k, v = (mx.random.normal(s, key=kk) for s, kk in
               zip(((1, hq, tq, d), (1, hk, tk, d), (1, hk, tk, d)), keys[:3]))
    x = mx.random.normal((tq, hidden), key=keys[3])
    w1, w2 = mx.random.normal((hidden, inter), key=keys[4]) * 0.02, mx.random.normal((inter, hidden)) * 0.02
    mask = (mx.arange(tk - tq, tk)[:, None] >= mx.arange(tk)[None])[None, None]
    mx.eval(q, k, v, x, w1, w2, mask)

    def work():
        h = x @ w1
        return [attention(q, k, v, scale=d ** -0.5, mask=mask), (h * mx.sigmoid(h)) @ w2]

    return work


def decide(seconds: dict[str, float]) -> str:
    """``"keep freed"`` or ``"glibc"`` from the workload's time under each
    (:func:`gateway.cpu.measure.pick`: glibc's unless the setting wins by the margin)."""
    return pick(seconds, "glibc")


class Allocator:
    """glibc's malloc settings in this process (the CPU tuning, :class:`gateway.backend.CpuTuning`,
    holds the one that serves): whether freed memory is kept (:data:`SETTINGS`) and what
    :meth:`choose` decided."""

    def __init__(self):
        self.kept = False  # the settings are in force
        self.decided: Optional[str] = None  # "keep freed" or "glibc", once chosen

    def keep_freed_memory(self) -> Optional[str]:
        """Apply :data:`SETTINGS` now, without measuring, where they can apply (see
        :func:`unavailable`). Returns why it did not, or None."""
        why = unavailable() or _mallopt(SETTINGS)
        self.kept = why is None
        return why

    def give_back_freed_memory(self) -> Optional[str]:
        """Undo :meth:`keep_freed_memory` (:data:`GLIBC_LIKE`); returns why it could not, or None."""
        why = _mallopt(GLIBC_LIKE)
        if why is None:
            self.kept = False
        return why

    def as_it_will_serve(self) -> None:
        """Before the measurements at load, where :meth:`choose` has not decided yet: set
        :data:`GLIBC_LIKE`, which blocks under 32 MiB get whatever it decides, so that
        every path is timed with the heap as it will serve. Why: glibc's dynamic thresholds
        grow only as a process frees large blocks, so a fresh process's history decided
        whether a kernel's 1-4 MiB temporaries page-faulted on every call (the figures:
        docs/deployment.md, "the allocator setting")."""
        if unavailable() is None and self.decided is None:
            self.give_back_freed_memory()

    def choose(self, workload: Callable[[], object], sync: Callable[[object], None], rounds: int = 3) -> Choice:
        """Time ``workload`` under glibc's behaviour, then with :data:`SETTINGS`, then with
        glibc's values again (:data:`GLIBC_LIKE`), and keep the faster (:func:`decide`; glibc's
        figure the better of its two); ``MLX_GATEWAY_MALLOC_TUNE=1`` keeps the settings
        unmeasured. Once: a later call returns the settings in force. Logs the choice.

        Args:
            workload: a call doing prefill-shaped work of the served model, passed to ``sync``.
            sync: waits for the work (``mx.eval``).
        """
        what = "allocator (freed memory kept for reuse, or glibc's)"
        why = unavailable()
        if why is not None:
            return Choice(what, "glibc", reason=why).log()
        if self.decided is not None:
            return Choice(what, self.decided, reason="decided at the first model's load")
        if os.environ.get("MLX_GATEWAY_MALLOC_TUNE", "") == "1":
            why = self.keep_freed_memory()
            self.decided = "keep freed" if why is None else "glibc"
            return Choice(what, self.decided, reason=why or "MLX_GATEWAY_MALLOC_TUNE=1").log()
        # glibc's, the setting's, then glibc's again (as it would stay): the first block also
        # grows the heap, so glibc's figure is the faster of its two
        seconds = {"glibc": race({"glibc": workload}, rounds, sync=sync)["glibc"]}
        if self.keep_freed_memory() is None:
            seconds["keep freed"] = race({"keep freed": workload}, rounds, sync=sync)["keep freed"]
            self.give_back_freed_memory()
            seconds["glibc"] = min(seconds["glibc"], race({"glibc": workload}, rounds, sync=sync)["glibc"])
        chosen = decide(seconds) if "keep freed" in seconds else "glibc"
        if chosen == "keep freed":
            self.keep_freed_memory()
        self.decided = chosen
        return Choice(what, chosen, seconds).log()
