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

The switch is measured, like every CPU replacement (:mod:`gateway.cpu.measure`): before
re-executing, the process times a float32 matmul of the served model's shape (a
:data:`CHUNK`-token chunk through its MLP's first projection, :func:`matmul_shape`) on
the bundled BLAS and passes the figure on (``MLX_GATEWAY_BLAS_BUNDLED_S``); the
re-executed process times the same matmul on OpenBLAS and, unless OpenBLAS wins by the
margin, re-executes once more without it. The log gives both figures.

The re-execution also sets ``OPENBLAS_THREAD_TIMEOUT`` (:data:`THREAD_TIMEOUT`) unless the
user set it: OpenBLAS reads it when it loads, so it must be there at process start.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
import json
from pathlib import Path
from typing import Optional

from gateway.cpu.measure import Choice, pick, race

log = logging.getLogger("mlx_gateway")

# Where Debian and Ubuntu put the pthread OpenBLAS, per architecture.
CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL (openblas-threads)
    "/usr/lib64/libopenblas.so.0",
)
CHUNK = 32  # tokens of the timed matmul
DEFAULT_SHAPE = (576, 1536)  # (hidden, intermediate) of the default model, when no config is at hand
BUNDLED_ENV = "MLX_GATEWAY_BLAS_BUNDLED_S"  # the bundled BLAS's time, passed to the re-executed process
# OpenBLAS's idle worker threads spin for 2**N CPU cycles before they sleep, N read from
# OPENBLAS_THREAD_TIMEOUT when the library loads (clamped to 4..30; its build default 28).
# Spinning between a decode step's small matmuls takes a core from the engine thread and
# the event loop; N=4 (the minimum) measured faster (docs/deployment.md, Linux section).
THREAD_TIMEOUT = "4"
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


def matmul_shape(model_dir: Optional[str]) -> tuple[int, int]:
    """``(hidden, intermediate)`` sizes from ``model_dir``'s ``config.json`` (its text
    config for a vision model), or :data:`DEFAULT_SHAPE` when it cannot be read."""
    try:
        config = json.loads((Path(model_dir or "") / "config.json").read_text())
        config = config.get("text_config", config)
        return int(config["hidden_size"]), int(config.get("intermediate_size") or 4 * config["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_SHAPE


def time_matmul(shape: tuple[int, int], rounds: int = 3) -> float:
    """Seconds (fastest of ``rounds``) of a float32 ``[CHUNK, hidden] @ [hidden, intermediate]``."""
    import mlx.core as mx

    hidden, inter = shape
    x, w = mx.random.normal((CHUNK, hidden), key=mx.random.key(0)), mx.random.normal((hidden, inter))
    mx.eval(x, w)
    return race({"matmul": lambda: x @ w}, rounds, budget=0.5, sync=mx.eval)["matmul"]


def decide(seconds: dict[str, float]) -> str:
    """``"openblas"`` or ``"bundled"`` from the matmul's time on each (the bundled one
    unless OpenBLAS wins by the margin)."""
    return pick(seconds, "bundled")


def _reexec(env: dict) -> None:
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _settle_after_reexec(shape: tuple[int, int]) -> None:
    """In the process re-executed with OpenBLAS: time the matmul here and keep OpenBLAS,
    or re-execute without it (``MLX_GATEWAY_FAST_BLAS=0``) if the bundled one was faster."""
    bundled = os.environ.pop(BUNDLED_ENV)
    try:
        seconds = {"bundled": float(bundled), "openblas": time_matmul(shape)}
    except ValueError:
        return
    chosen = decide(seconds)
    Choice(f"BLAS [{CHUNK} x {shape[0]} @ {shape[0]} x {shape[1]} float32]", chosen, seconds).log()
    if chosen == "openblas":
        log.info("OpenBLAS's idle threads spin 2**N cycles before sleeping: OPENBLAS_THREAD_TIMEOUT=%s",
                 os.environ.get("OPENBLAS_THREAD_TIMEOUT", "unset (28)"))
    if chosen == "bundled":
        env = dict(os.environ)
        env["LD_PRELOAD"] = " ".join(p for p in env.get("LD_PRELOAD", "").split() if "libopenblas" not in p)
        env["MLX_GATEWAY_FAST_BLAS"] = "0"
        _reexec(env)


def ensure_fast_blas(shape: tuple[int, int] = DEFAULT_SHAPE) -> None:
    """Re-execute this process's command line (``sys.orig_argv``) with OpenBLAS preloaded
    when MLX, computing on the CPU (the caller's to know), would otherwise use the slow
    reference BLAS and a matmul of ``shape`` (``(hidden, intermediate)``,
    :func:`matmul_shape`) is faster on it (measured on both sides of the re-execution);
    warn when OpenBLAS is not installed. Call before any thread starts.

    Does not return when it re-executes (``os.execve``).
    """
    if os.environ.get(BUNDLED_ENV) is not None:
        if openblas_loaded():
            _settle_after_reexec(shape)
        else:
            os.environ.pop(BUNDLED_ENV)
        return
    if (not sys.platform.startswith("linux") or os.environ.get("MLX_GATEWAY_FAST_BLAS", "1") == "0"
            or openblas_loaded()):
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
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)  # a user's value wins
    env[BUNDLED_ENV] = repr(time_matmul(shape))
    log.info("restarting with LD_PRELOAD=%s to time MLX's CPU matmuls on OpenBLAS", path)
    _reexec(env)
