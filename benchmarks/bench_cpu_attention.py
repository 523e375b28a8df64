"""The CPU attention kernels of gateway/cpu/attention_kernels.py (MLX's own, the compiled-exp
blocks of 32, 16 and 8 queries, the compiled-exp decode kernel) on the default model's shapes, with glibc's malloc and
with gateway/cpu/allocator.py's setting; prints milliseconds (fastest of interleaved
runs), asserts nothing.

Shapes (``[B, Tq, Tk]``, 9 query and 3 KV heads of 64, SmolLM2-135M's): a 2,048-token
prefill chunk from an empty cache, a 512-token chunk over 3,000 cached tokens, a 95-token
chat turn over 2,000, the load-time measurements' 256 over 1,024 and four rows of 64 over
1,024, six rows of 292 over 872 (a burst joining over a shared prefix), a 512-token chunk
over 8,704, six decode rows over 900, one over 2,000 and one over 8,000. Prefill shapes get the causal boolean mask mlx-lm's batch
caches give. Each allocator setting runs in its own process, and the kernels take turns
within it. ``--heads HQ,HK,D`` measures other shapes.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_cpu_attention.py [--heads 9,3,64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = [("prefill 2048 from 0", 1, 2048, 2048), ("chunk 512 over 3000", 1, 512, 3512),
          ("turn 95 over 2000", 1, 95, 2095), ("load-time 256 over 768", 1, 256, 1024),
          ("load-time wide 4 x 64 over 1024", 4, 64, 1024), ("6 rows 292 over 872", 6, 292, 872),
          ("chunk 512 over 8704", 1, 512, 8704), ("decode 6 x 900", 6, 1, 900), ("decode 1 x 2000", 1, 1, 2000), ("decode 1 x 8000", 1, 1, 8000)]

KERNEL_NAMES = ("mlx", "compiled-blocks", "compiled-blocks-16", "compiled-blocks-8", "compiled-decode")


def measure(heads: tuple[int, int, int], rounds: int) -> dict:
    """This process's figures (ms) per shape and kernel."""
    import mlx.core as mx

    from gateway.cpu import attention
    from gateway.cpu.measure import race

    hq, hk, d = heads
    attention._can_compile()
    out = {}
    for name, b, tq, tk in SHAPES:
        q, k, v = (mx.random.normal(s) for s in ((b, hq, tq, d), (b, hk, tk, d), (b, hk, tk, d)))
        mask = (mx.arange(tk - tq, tk)[:, None] >= mx.arange(tk)[None])[None, None] if tq > 1 else None
        mx.eval(q, k, v, *([mask] if mask is not None else []))
        kernels = list(attention.KERNELS)
        times = race({n: (lambda f=attention.KERNELS[n]: f(q, k, v, d ** -0.5, mask)) for n in kernels},
                     rounds, sync=mx.eval)
        out[name] = {n: 1e3 * s for n, s in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size (default SmolLM2-135M's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=["glibc", "keep freed"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    if args.child:
        if args.child == "keep freed":
            from gateway.cpu.allocator import Allocator

            Allocator().keep_freed_memory()
        print(json.dumps(measure(heads, args.rounds)))
        return
    env = {k: v for k, v in os.environ.items() if k != "MLX_GATEWAY_MALLOC_TUNE"}
    runs = {}
    for label in ("glibc", "keep freed"):
        res = subprocess.run([sys.executable, __file__, "--heads", args.heads, "--rounds", str(args.rounds),
                              "--child", label], env=env, capture_output=True, text=True, check=True)
        runs[label] = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"heads {heads[0]}/{heads[1]} of {heads[2]}, float32, ms (fastest of {args.rounds})")
    print("| shape | malloc | " + " | ".join(KERNEL_NAMES) + " |")
    print("|---|---|" + "---|" * len(KERNEL_NAMES))
    for name, *_ in SHAPES:
        for label, figures in runs.items():
            row = figures[name]
            cells = [f"{row[k]:.2f}" if k in row else "-" for k in KERNEL_NAMES]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
