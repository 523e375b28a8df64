"""MLX's CPU attention against gateway/cpu/attention.py, with glibc's default malloc and
with gateway/cpu/allocator.py's setting; prints milliseconds (medians), asserts nothing.

Shapes (``[B, Hq/Hk, Tq, Tk]``, the benchmark model's 8 query and 4 KV heads of 32):
a 95-token chat turn over 2000 cached tokens, one decode row over 2000, six decode rows
over 900, a 512-token prefill chunk over 3000, six 300-token suffixes over 900 (the
serving benchmark's cold burst). Also ``exp`` alone, and a float32 multiply of 12 M
elements (what a fresh allocation's page faults cost). Each allocator setting runs in
its own process.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_cpu_attention.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [("turn", 1, 95, 2000), ("decode 1x2000", 1, 1, 2000), ("decode 6x900", 6, 1, 900),
          ("chunk 512x3000", 1, 512, 3000), ("burst 6x300x900", 6, 300, 900)]


def ms(fn, reps: int = 9) -> float:
    """Median wall milliseconds of ``fn()`` evaluated, after one untimed call."""
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure() -> dict:
    """This process's figures (ms)."""
    import mlx.core as mx

    from gateway.cpu import attention

    out = {}
    x = -mx.random.uniform(0, 30, (1_500_000,))
    big = mx.random.normal((12_000_000,))
    mx.eval(x, big)
    out["exp 1.5M: mx.exp"] = ms(lambda: mx.exp(x))
    out["exp 1.5M: compiled"] = ms(lambda: attention.exp_nonpositive(x))
    out["multiply 12M"] = ms(lambda: big * 2.0)
    for name, b, tq, tk in SHAPES:
        q, k, v = (mx.random.normal((b, h, t, 32)) for h, t in ((8, tq), (4, tk), (4, tk)))
        mx.eval(q, k, v)
        mask = "causal" if tq > 1 else None
        for label, fn in (("mlx", attention._mlx_attention), ("ours", attention.attention)):
            out[f"{name}: {label}"] = ms(lambda: fn(q, k, v, scale=32 ** -0.5, mask=mask))
    return out


def main() -> None:
    if "--child" in sys.argv:
        if "--tuned" in sys.argv:
            from gateway.cpu.allocator import keep_freed_memory

            keep_freed_memory()
        print(json.dumps(measure()))
        return
    env = {k: v for k, v in os.environ.items() if k != "MLX_GATEWAY_MALLOC_TUNE"}
    runs = {}
    for label, flags in (("glibc default", []), ("freed memory kept", ["--tuned"])):
        res = subprocess.run([sys.executable, __file__, "--child", *flags], env=env, capture_output=True,
                             text=True, check=True)
        runs[label] = json.loads(res.stdout.strip().splitlines()[-1])
    labels = list(runs)
    print(f"{'ms (median)':28s}" + "".join(f"{label:>20s}" for label in labels))
    for key in runs[labels[0]]:
        print(f"{key:28s}" + "".join(f"{runs[label][key]:20.2f}" for label in labels))


if __name__ == "__main__":
    main()
