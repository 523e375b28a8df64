"""A model's prefill and decode on MLX's CPU backend with its weights as stored (e.g. 4-bit)
and as float32 (``gateway/cpu/weights.py``, what ``mlx-gateway serve`` loads on the CPU);
prints figures, asserts nothing.

Each variant is loaded fresh, then a ``--prompt``-token prefill (best of ``--reps``) and
the mean of 10 decode steps after it are timed, with the CPU attention kernels and
allocator setting ``serve`` would measure and choose for it. ``--half`` adds a float16 variant. The default model is
SmolLM2-135M-Instruct (Q4_1) from the gateway's model cache (``mlx-gateway
fetch-default-model`` puts it there).

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_cpu_weights.py [--model DIR] [--prompt 287] [--reps 2] [--half]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from gateway.backend import backend  # noqa: E402
from gateway.cpu.weights import float32_weights  # noqa: E402
from gateway.models import default_model  # noqa: E402


def measure(path: str, variant: str, n_prompt: int, reps: int) -> tuple[float, float, float]:
    """(weights MB, best prefill seconds, mean decode step milliseconds) for ``variant``:
    ``stored``, ``float32`` or ``float16``."""
    model, _ = mlx_lm.load(path)
    if variant == "float32":
        why = float32_weights(model, limit_bytes=1 << 40)
        if why is not None:
            print(f"  float32: {why}")
    elif variant == "float16":
        float32_weights(model, limit_bytes=1 << 40)
        model.update(tree_map(lambda p: p.astype(mx.float16) if p.dtype == mx.float32 else p, model.parameters()))
    mx.eval(model.parameters())
    backend().prepare(model)  # the attention kernels and allocator serve would measure and take
    mb = sum(p.nbytes for _, p in tree_flatten(model.parameters())) / 1e6
    prompt = mx.array([[(7 * i) % 900 + 10 for i in range(n_prompt)]])
    best, cache = float("inf"), None
    for _ in range(reps):
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        mx.eval(model(prompt, cache=cache))
        best = min(best, time.perf_counter() - t)
    token = mx.array([[11]])
    mx.eval(model(token, cache=cache))
    t = time.perf_counter()
    for _ in range(10):
        mx.eval(model(token, cache=cache))
    return mb, best, (time.perf_counter() - t) / 10 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the cached default model)")
    ap.add_argument("--prompt", type=int, default=287, help="prompt tokens")
    ap.add_argument("--reps", type=int, default=2, help="prefills per variant (best is reported)")
    ap.add_argument("--half", action="store_true", help="also time float16 weights")
    args = ap.parse_args()
    path = args.model or str(default_model.default_model_dir())
    if not default_model.is_ready(path) and not (Path(path) / "config.json").is_file():
        sys.exit(f"no model at {path}: run `mlx-gateway fetch-default-model` or pass --model")
    print(f"{path}: {args.prompt}-token prefill, then decode steps")
    print("| weights | MB | prefill (s) | decode step (ms) |\n|---|---|---|---|")
    for variant in ("stored", "float32", *(["float16"] if args.half else [])):
        mb, prefill, step = measure(path, variant, args.prompt, args.reps)
        print(f"| {variant} | {mb:.0f} | {prefill:.2f} | {step:.1f} |", flush=True)


if __name__ == "__main__":
    main()
