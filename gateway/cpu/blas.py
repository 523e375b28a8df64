"""Fast BLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel for Linux bundles the reference BLAS (``libblas`` from netlib),
which runs a 512x512 float32 matmul at about 5 GFLOP/s on a 2-core x86-64 machine; the
system OpenBLAS (Debian/Ubuntu package ``libopenblas0-pthread``) runs it at about 170.
Preloading OpenBLAS (``LD_PRELOAD``) makes MLX's ``cblas_*`` calls resolve to it; outputs
agree to about 1e-4 (``benchmarks/bench_blas.py`` measures both). On macOS, MLX uses
Metal and Accelerate, and nothing here applies.

:func:`ensure_fast_blas` is called first thing by ``mlx-gateway serve``: it re-executes the
process with OpenBLAS preloaded when the library is installed but not loaded, and
otherwise warns how to install it. ``MLX_GATEWAY_FAST_BLAS=0`` turns both off.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from typing import Optional

from gateway.cpu import cpu_backend

log = logging.getLogger("mlx_gateway")

# Where Debian and Ubuntu put the pthread OpenBLAS, per architecture.
CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL (openblas-threads)
    "/usr/lib64/libopenblas.so.0",
)
INSTALL_HINT = ("install it with 'sudo apt-get install libopenblas0-pthread' (Debian/Ubuntu) "
                "or 'sudo dnf install openblas-threads' (Fedora/RHEL)")


def openblas_loaded(maps_path: str = "/proc/self/maps") -> bool:
    """True if an OpenBLAS library is mapped into this process (Linux only)."""
    try:
        with open(maps_path) as f:
            return any("libopenblas" in line for line in f)
    except OSError:
        return False


def find_openblas() -> Optional[str]:
    """Path of the system's pthread OpenBLAS, or None."""
    for pattern in CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            if os.path.exists(path):
                return path
    return None


def needs_fast_blas() -> bool:
    """True on Linux when MLX would run matmuls on the CPU with its bundled reference BLAS."""
    if not sys.platform.startswith("linux") or os.environ.get("MLX_GATEWAY_FAST_BLAS", "1") == "0":
        return False
    return cpu_backend() and not openblas_loaded()


def ensure_fast_blas() -> None:
    """Re-execute this process's command line (``sys.orig_argv``) with OpenBLAS preloaded
    when MLX would otherwise use the slow reference BLAS; warn when OpenBLAS is not
    installed. Call before any thread starts.

    Does not return when it re-executes (``os.execve``).
    """
    if not needs_fast_blas():
        return
    path = find_openblas()
    if path is None:
        log.warning("MLX runs on the CPU with its bundled reference BLAS, about 35x slower than "
                    "OpenBLAS for prefill: %s, then restart (MLX_GATEWAY_FAST_BLAS=0 silences this)",
                    INSTALL_HINT)
        return
    if path in os.environ.get("LD_PRELOAD", ""):
        log.warning("LD_PRELOAD names %s but OpenBLAS is not loaded; MLX uses its slow reference BLAS", path)
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = f"{path} {env['LD_PRELOAD']}".strip() if env.get("LD_PRELOAD") else path
    log.info("restarting with LD_PRELOAD=%s so that MLX's CPU matmuls use OpenBLAS", path)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
