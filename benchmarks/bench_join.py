"""Warm rows joining a decoding batch: mlx-lm's ``BatchGenerator`` against the gateway's
``JoiningBatchGenerator`` (``scheduler/batch/generator.py``), same model, same run; prints
figures, asserts nothing.

One row decodes; six rows whose prompts (580 + 300 tokens) are cached up to their last
token are inserted at once. Reported: seconds from their insertion until all six have
their first token, the mean step time while the seven rows decode, and forward calls of
the joining step. Median of ``--reps``.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python benchmarks/bench_join.py
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the counting model and prefilled caches of the tests

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from conftest import CountingModel, prefilled  # noqa: E402
from scenarios import medium_model, timed  # noqa: E402

from scheduler.batch.generator import JoiningBatchGenerator  # noqa: E402


def join_once(cls, model: CountingModel, prompts, caches) -> tuple[float, int]:
    """(seconds until the six warm rows have a token, forward calls of the joining step)."""
    gen = cls(model, max_tokens=1 << 20, prefill_batch_size=8, completion_batch_size=16)
    gen.insert([[5, 6, 7, 8, 9]], max_tokens=[64])
    while not gen.next()[1]:
        pass
    copies = [copy.deepcopy(c) for c in caches]  # what the prefix cache hands out
    mx.eval([x.state for c in copies for x in c])
    t0 = time.perf_counter()
    uids = set(gen.insert_segments([[[p[-1]]] for p in prompts], max_tokens=[8] * len(prompts),
                                   caches=copies, all_tokens=[p[:-1] for p in prompts]))
    model.calls = 0
    gen.next()
    calls = model.calls
    while uids:
        uids -= {g.uid for g in gen.next()[1]}
    seconds = time.perf_counter() - t0
    gen.close()
    return seconds, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the serving benchmark's qwen3)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    model = CountingModel(mlx_lm.load(args.model or medium_model())[0])
    rng = random.Random(0)
    system = [rng.randrange(10, 900) for _ in range(580)]
    prompts = [system + [rng.randrange(10, 900) for _ in range(300)] for _ in range(6)]
    caches = [prefilled(model.model, p[:-1]) for p in prompts]
    out = {}
    for name, cls in (("mlx-lm BatchGenerator", BatchGenerator), ("JoiningBatchGenerator", JoiningBatchGenerator)):
        _, (_, calls) = timed(lambda: join_once(cls, model, prompts, caches), 1, warmup=True)
        seconds = timed(lambda: join_once(cls, model, prompts, caches)[0], args.reps, stat=sorted)[0]
        out[name] = seconds[len(seconds) // 2]
        print(f"{name:22s} six warm rows to first token: {1e3 * out[name]:6.1f} ms (median of {args.reps}, "
              f"min {1e3 * seconds[0]:.1f})  forward calls in the joining step: {calls}")
    print(f"ratio: {out['JoiningBatchGenerator'] / out['mlx-lm BatchGenerator']:.2f}")


if __name__ == "__main__":
    main()
