"""glibc malloc that keeps freed memory for reuse (Linux, MLX on the CPU).

MLX's CPU backend allocates every array with ``malloc`` and frees it when the array
dies; it keeps no buffer cache of its own (its Metal allocator does). glibc serves
large requests with fresh ``mmap`` pages (or trims the heap top back to the kernel on
``free``), so each new buffer page-faults on first write. A prefill chunk's attention
scores are ``[B, H, Tq, Tk]`` float32, tens of MB per layer, and on the 2-core VM these
benchmarks run on, a fault costs about 3 µs per 4 KiB page: a float32 multiply of 12 M
elements took 53 ms, against 8 ms once memory is reused
(``benchmarks/bench_cpu_attention.py``).

:func:`keep_freed_memory` sets, with ``mallopt(3)``: one arena (``M_ARENA_MAX=1``, so the
engine thread's buffers come from the main heap too), no ``mmap`` for large blocks
(``M_MMAP_MAX=0``) and no trimming below 1 GiB of free heap top (``M_TRIM_THRESHOLD``).
Memory freed after a long prefill then stays in the process for the next one instead of
going back to the kernel; the resident size follows the peak, like jemalloc or
tcmalloc with their defaults. ``MLX_GATEWAY_MALLOC_TUNE=0`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Optional

log = logging.getLogger("mlx_gateway")

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 1 << 30))


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


def keep_freed_memory() -> Optional[str]:
    """Apply :data:`SETTINGS` with ``mallopt`` on Linux with glibc when MLX runs on the CPU,
    unless ``MLX_GATEWAY_MALLOC_TUNE=0``. Call before any thread starts (arenas are
    per thread). Returns why it did not, or None.

    A setting glibc refuses (``mallopt`` returns 0) is logged and reported as the reason.
    """
    from gateway.cpu import cpu_backend

    if os.environ.get("MLX_GATEWAY_MALLOC_TUNE", "1") == "0":
        return "MLX_GATEWAY_MALLOC_TUNE=0"
    if not sys.platform.startswith("linux") or not _glibc():
        return "not Linux with glibc"
    if not cpu_backend():
        return "MLX runs on a GPU"
    libc = ctypes.CDLL(None)
    for param, value in SETTINGS:
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            log.warning("glibc refused mallopt(%d, %d); freed memory may go back to the kernel", param, value)
            return f"mallopt({param}, {value}) failed"
    return None
