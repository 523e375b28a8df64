"""What storing a response costs, per backend of the Responses API's store (a script, not a test).

For each backend (memory, a SQLite file in a temporary directory, and Redis when ``--redis URL``
is given) it stores ``--chains`` conversations of ``--turns`` turns the way the route does
(each turn stored with its whole conversation, so entries grow along a chain), 16 stores
at once through :class:`ResponseStore` (worker threads included), then reads every entry
back. It prints the stores and reads per second and their latency percentiles, and the
entry sizes.

Usage::

    python benchmarks/bench_responses_store.py [--redis redis://127.0.0.1:6379/0] [--turns 20] [--chains 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.protocols.responses_store import ResponseStore  # noqa: E402
from gateway.protocols.responses_store_memory import MemoryBackend  # noqa: E402
from gateway.protocols.responses_store_redis import RedisBackend  # noqa: E402
from gateway.protocols.responses_store_sqlite import SQLiteBackend  # noqa: E402

TURN_TEXT = "an agent's turn with a tool result in it, " * 40  # ~1.7 KB of text per turn


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(store: ResponseStore, chains: int, turns: int) -> dict:
    puts: list[float] = []
    gets: list[float] = []
    sizes: list[int] = []

    async def chain(c: int) -> None:
        items: list[dict] = []
        for t in range(turns):
            items = items + [{"type": "message", "role": "user", "content": f"{c}/{t} {TURN_TEXT}"}]
            response = {"id": f"resp_{c}_{t}", "object": "response",
                        "output": [{"type": "message", "role": "assistant", "content": TURN_TEXT}]}
            t0 = time.perf_counter()
            assert await store.put("bench", response, items + response["output"])
            puts.append(time.perf_counter() - t0)
            items = items + response["output"]

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for c in range(chains):
            tg.start_soon(chain, c)
    put_wall = time.perf_counter() - start
    start = time.perf_counter()
    for c in range(chains):
        for t in range(turns):
            t0 = time.perf_counter()
            entry = await store.get("bench", f"resp_{c}_{t}")
            gets.append(time.perf_counter() - t0)
            sizes.append(entry.size)
    get_wall = time.perf_counter() - start
    return {"puts/s": len(puts) / put_wall, "put p50 ms": 1e3 * percentile(puts, 0.5),
            "put p99 ms": 1e3 * percentile(puts, 0.99), "gets/s": len(gets) / get_wall,
            "get p50 ms": 1e3 * percentile(gets, 0.5), "get p99 ms": 1e3 * percentile(gets, 0.99),
            "entry KB mean": sum(sizes) / len(sizes) / 1024, "entry KB max": max(sizes) / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redis", help="a Redis URL to measure too (its database is written under mlxgw-bench:*)")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--chains", type=int, default=16)
    args = p.parse_args()
    bounds = dict(max_responses=args.turns * args.chains, max_bytes=1 << 30)
    with tempfile.TemporaryDirectory() as tmp:
        backends = {"memory": lambda: MemoryBackend(**bounds),
                    "sqlite": lambda: SQLiteBackend(Path(tmp) / "responses.sqlite3", **bounds)}
        if args.redis:
            backends["redis"] = lambda: RedisBackend(args.redis, prefix="mlxgw-bench", ttl=600, **bounds)
        print(f"{args.chains} chains x {args.turns} turns, the chains stored at once")
        for name, make in backends.items():
            store = ResponseStore(make())
            figures = anyio.run(run, store, args.chains, args.turns)
            anyio.run(store.aclose)
            print(f"{name:7s} " + "  ".join(f"{k}={v:.1f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
