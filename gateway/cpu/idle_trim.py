"""Give the freed heap back to the kernel once the engine has been idle a while (Linux CPU).

:mod:`gateway.cpu.allocator` keeps freed memory in the process, so that the next prefill
reuses it instead of page-faulting it in again. The resident size then stays at the peak
of the largest step so far (a long prompt's attention scores: hundreds of MB) for as long
as the process lives, which is what ``top`` and a container's memory limit see.

:class:`IdleTrimmer` calls glibc's ``malloc_trim(0)`` once the engine has taken no step and
had no request waiting or running for ``MLX_GATEWAY_IDLE_TRIM_SECONDS`` (default 30;
0 turns it off), then not again until the engine has worked. The next request after a
trim page-faults its buffers in once more (about 3 µs per 4 KiB page on the 2-core
machine of ``benchmarks/bench_cpu_attention.py``), which is what waiting 30 s makes
rare. The prompt cache's snapshots are live arrays and are not touched.

A server that is never quiet would keep the freed heap forever, and it grows as the heap
fragments (+38 MB over 90 minutes of the soak in ``benchmarks/results/soak.md``, which is
what ``top`` counts beyond the memory budget). So while the engine works, the trimmer also
reads the free heap at most once every ``busy_every`` seconds (60 by default) and trims
when it exceeds ``busy_free_limit`` (``serve`` sets an eighth of the memory budget) and the
resident size has grown by as much since the last trim: freed memory the heap keeps
resident goes back within a minute of passing an eighth of the budget, at the cost of
page-faulting those buffers in again once a minute at most (about 0.5 s of CPU a minute
for 700 MB at 3 µs per page).
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("mlx_gateway")

DEFAULT_SECONDS = 30.0
BUSY_FREE_SHARE = 8  # while busy, the free heap kept stays under 1/8 of the memory budget


def idle_seconds_setting() -> float:
    """``MLX_GATEWAY_IDLE_TRIM_SECONDS`` (seconds; 0 or less: never trim), default
    :data:`DEFAULT_SECONDS`.

    Raises:
        ValueError: the variable is not a finite number.
    """
    raw = os.environ.get("MLX_GATEWAY_IDLE_TRIM_SECONDS")
    if raw is None or not raw.strip():
        return DEFAULT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"MLX_GATEWAY_IDLE_TRIM_SECONDS must be a finite number of seconds, not {raw!r}")
    return seconds


def resident_bytes() -> Optional[int]:
    """This process's resident set size in bytes (``/proc/self/statm``); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later), bytes."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_bytes() -> Optional[tuple[int, int]]:
    """``(in use, free)`` bytes of glibc's malloc: every live block, those of the arenas
    (``uordblks``) and those mapped on their own (``hblkhd``: blocks over the ``mmap``
    threshold, where :mod:`gateway.cpu.allocator` leaves one), MLX's CPU arrays and the
    tokenizers' buffers among them (not the interpreter's small objects, which live in its
    own arenas); and :func:`heap_free_bytes`. One walk of the free lists for both; None
    where there is no ``mallinfo2``."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError, TypeError):  # TypeError: Windows' CDLL takes no None
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


def heap_free_bytes() -> Optional[int]:
    """Bytes glibc's malloc holds free in its arenas (``mallinfo2``'s ``fordblks``, which
    includes the fast bins' ``fsmblks``): memory the process freed but keeps. On MLX's CPU
    backend arrays are malloc'd, so a batch's freed buffers land here, and the resident
    size counts their touched pages until a trim (:func:`release_free_memory`) hands them
    back: the blocks then stay free in malloc's lists, so this is an upper bound of the
    freed bytes resident. None where there is no ``mallinfo2`` (not glibc, glibc before
    2.33, not a POSIX ``dlopen``).

    It walks the free lists under the arena lock: about 7 ms with 8,000 free chunks on
    the 2-core machine of ``benchmarks/bench_cpu_attention.py``, time other threads'
    mallocs wait, so read it every few seconds at most (a scrape), not per step.
    """
    heap = heap_bytes()
    return None if heap is None else heap[1]


def release_free_memory() -> bool:
    """glibc's ``malloc_trim(0)``: return the heap's free pages to the kernel. True if
    some were returned; False where there is no ``malloc_trim`` (not glibc)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return trim(0) == 1


class IdleTrimmer:
    """Decides when to trim; :meth:`poll` is called every few seconds from one thread.

    Args:
        activity: the engine's step count while it is idle, None while it is busy (a
            request waiting or running) or not loaded yet.
        idle_seconds: quiet time (seconds) before a trim.
        trim: returns the heap's free pages to the kernel (True if any).
        clock: seconds, monotonic.
        busy_free_limit: while busy, trim once the free heap exceeds this many bytes and
            the resident size has grown by as many since the last trim (None: only when
            idle). The free heap alone would not do: a trim returns the free blocks' pages
            but leaves the blocks on malloc's free lists, so it reads the same after one.
        busy_every: seconds between two reads of the free heap while busy.
        free_bytes: the free heap now, bytes (:func:`heap_free_bytes`).
        resident: the resident size now, bytes (:func:`resident_bytes`).
    """

    def __init__(self, activity: Callable[[], Optional[int]], idle_seconds: float,
                 trim: Callable[[], bool] = release_free_memory, clock: Callable[[], float] = time.monotonic,
                 busy_free_limit: Optional[int] = None, busy_every: float = 60.0,
                 free_bytes: Callable[[], Optional[int]] = heap_free_bytes,
                 resident: Callable[[], Optional[int]] = resident_bytes):
        self.activity = activity
        self.idle_seconds = idle_seconds
        self.trim = trim
        self.clock = clock
        self.busy_free_limit = busy_free_limit
        self.busy_every = busy_every
        self.free_bytes = free_bytes
        self.resident = resident
        self._after: Optional[int] = None  # the resident size after the last trim, bytes
        self.trims = 0
        self.busy_trims = 0
        self._seen: Optional[int] = None
        self._since = clock()
        self._done = False
        self._busy_read = clock()

    def poll(self) -> bool:
        """Trim if the engine has been quiet for ``idle_seconds`` since it last worked
        and has not been trimmed since, or if it works, the free heap is over
        ``busy_free_limit`` and the resident size has grown by as much since the last trim
        (read at most every ``busy_every`` seconds); returns whether it trimmed."""
        now, steps = self.clock(), self.activity()
        if steps is None or steps != self._seen:  # busy, or it has stepped since the last poll
            self._seen, self._since, self._done = steps, now, False
            return self._poll_busy(now)
        if self._done or now - self._since < self.idle_seconds:
            return False
        self._done = True
        return self._trim(f"idle for {self.idle_seconds:.0f} s")

    def _poll_busy(self, now: float) -> bool:
        if self.busy_free_limit is None or now - self._busy_read < self.busy_every:
            return False
        self._busy_read = now
        resident = self.resident()
        if self._after is not None and resident is not None and resident - self._after <= self.busy_free_limit:
            return False  # not grown since the last trim: its free blocks are still the kernel's
        free = self.free_bytes()
        if free is None or free <= self.busy_free_limit:
            return False
        self.busy_trims += 1
        return self._trim(f"busy with {free / 1e6:.0f} MB of free heap (limit {self.busy_free_limit / 1e6:.0f} MB)")

    def _trim(self, why: str) -> bool:
        before, t0 = self.resident(), time.perf_counter()
        released = self.trim()
        self.trims += 1
        after = self._after = self.resident()
        if before is not None and after is not None:
            log.info("%s: returned %.0f MB of freed memory to the kernel in %.0f ms (resident %.0f MB)",
                     why, (before - after) / 1e6, 1e3 * (time.perf_counter() - t0), after / 1e6)
        return released

    def start(self) -> threading.Thread:
        """Poll every quarter of ``idle_seconds`` (at least every second) in a daemon thread."""
        period = max(1.0, self.idle_seconds / 4)

        def loop() -> None:
            while True:
                try:
                    time.sleep(period)
                    self.poll()
                except Exception:  # never let the watcher take anything down
                    log.exception("trimming idle memory failed")

        t = threading.Thread(target=loop, name="idle-trim", daemon=True)
        t.start()
        return t
