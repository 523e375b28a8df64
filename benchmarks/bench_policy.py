"""Admission-policy cost (a script, not a test): seconds per :meth:`WaitingQueue.pick`
with many waiting requests, on the engine's real prefix cache.

Workload: ``--waiting`` requests (default 256) of ``--tokens`` tokens (default 3000)
from 4 tenants, in groups of 8 that share a 1500-token system prompt; 8 requests in
prefill that share a prefix with a quarter of the waiting ones (so those are deferred
behind them, the expensive case); the prefix cache holds one snapshot per group
prefix. Each round picks up to 8 requests and puts them back, so the queue stays full.

Usage::

    python benchmarks/bench_policy.py [--waiting 256] [--tokens 3000] [--rounds 50]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cache import PromptCacheManager  # noqa: E402
from scheduler.admission.policy import InFlight, WaitingQueue  # noqa: E402
from scheduler.request import EngineRequest, SamplingParams  # noqa: E402


def tiny_cache(n: int) -> list:
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
    return [c]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waiting", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    rng = random.Random(0)
    groups = [[rng.randrange(50_000) for _ in range(1500)] for _ in range(args.waiting // 8)]
    manager = PromptCacheManager(1 << 34, 4096)
    for g in groups[: len(groups) // 2]:  # half the groups have their system prompt cached
        manager.insert("default", g, tiny_cache(len(g)))

    def request(i: int) -> EngineRequest:
        g = groups[i // 8]
        tail = [rng.randrange(50_000) for _ in range(args.tokens - len(g))]
        return EngineRequest(f"r{i}", g + tail, SamplingParams(), lambda ev: None, tenant=f"t{i % 4}")

    queue = WaitingQueue()
    waiting = [request(i) for i in range(args.waiting)]
    for r in waiting:
        queue.add(r)
    # In flight: requests of the uncached groups 1..8 past the cache, with a snapshot
    # still pending at the end of the shared system prompt.
    uncached = groups[len(groups) // 2:]
    flights = [InFlight(EngineRequest(f"f{k}", uncached[k % len(uncached)] + [1, 2, 3] * 500, SamplingParams(),
                                      lambda ev: None), [1500]) for k in range(8)]

    def cached_len(r: EngineRequest) -> int:
        return manager.match_length(r.namespace, r.tokens)

    times, picked = [], 0
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        chosen = queue.pick(8, cached_len, flights, manager.version)
        times.append(time.perf_counter() - t0)
        picked += len(chosen)
        for a in chosen:
            queue.add(a.request)
    times.sort()
    print(f"waiting={args.waiting} tokens={args.tokens} in_flight={len(flights)}: pick() "
          f"p50={statistics.median(times) * 1e3:.3f} ms p95={times[int(0.95 * (len(times) - 1))] * 1e3:.3f} ms "
          f"max={times[-1] * 1e3:.3f} ms ({picked / args.rounds:.1f} admitted per pick)")


if __name__ == "__main__":
    main()
