"""MLX CPU speed with the bundled reference BLAS and with the system OpenBLAS preloaded
(a script, not a test; Linux).

For each, in a fresh process: float32 matmul GFLOP/s (512x512 and 2048x2048), the time
to prefill ``--tokens`` prompt tokens (default 2200) on the medium benchmark model
(qwen3, 4 layers, hidden 256), and the largest difference between the two runs' logits.

Usage::

    python benchmarks/bench_blas.py [--tokens 2200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))



def measure(tokens: int, out: str) -> None:
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from gateway.cpu.blas import openblas_loaded
    from scenarios import medium_model

    res = {"openblas_loaded": openblas_loaded()}
    for n in (512, 2048):
        a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
        mx.eval(a @ b)
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            mx.eval(a @ b)
            reps += 1
        res[f"gflops_{n}"] = 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9
    model, _ = mlx_lm.load(medium_model())
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array([[(i * 7919) % 900 + 5 for i in range(tokens)]])
    t0 = time.perf_counter()
    cache = make_prompt_cache(model)
    logits = None
    for start in range(0, tokens, 2048):
        logits = model(prompt[:, start:start + 2048], cache=cache)
        mx.eval(logits)
    res["prefill_s"] = time.perf_counter() - t0
    np.save(out, np.array(logits[0, -1].astype(mx.float32)))
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2200)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        measure(args.tokens, args.child)
        return
    import numpy as np

    from gateway.cpu.blas import find_openblas

    lib = find_openblas()
    if lib is None:
        sys.exit("no system OpenBLAS found (apt-get install libopenblas0-pthread)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, preload in (("bundled", None), ("openblas", lib)):
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            env["MLX_GATEWAY_FAST_BLAS"] = "0"
            if preload:
                env["LD_PRELOAD"] = preload
            out = os.path.join(tmp, f"{name}.npy")
            line = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--child", out],
                                  env=env, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            results[name] = json.loads(line)
            results[name]["logits"] = np.load(out)
    for name, r in results.items():
        print(f"{name:9s} openblas_loaded={r['openblas_loaded']}  matmul 512: {r['gflops_512']:.1f} GFLOP/s  "
              f"2048: {r['gflops_2048']:.1f} GFLOP/s  prefill {args.tokens} tokens: {r['prefill_s']:.2f} s")
    diff = float(np.abs(results["bundled"]["logits"] - results["openblas"]["logits"]).max())
    print(f"speed-up: matmul 512 {results['openblas']['gflops_512'] / results['bundled']['gflops_512']:.1f}x, "
          f"prefill {results['bundled']['prefill_s'] / results['openblas']['prefill_s']:.1f}x; "
          f"max |logit difference| {diff:.2e}")


if __name__ == "__main__":
    main()
