"""The workload ``mlx-gateway tune`` measures a setting with, and one run of it.

The synthetic workload (:func:`synthetic`) mixes what a gateway serves at once:

* a burst of ``burst`` chats sent together, sharing a ``system``-token prefix (a system
  prompt: the prefix cache and the shared-prefix prefill matter), ``user`` new tokens each;
* ``streams`` interactive streams (``user``-token prompts) starting over the first 2 s,
  whose inter-token gaps show how long prefill steps hold decoding;
* ``agents`` agent requests of ``agent_tokens`` tokens each (a coding agent's first
  request is tens of thousands), arriving while the streams decode.

A replayed log (:func:`from_log`) instead sends each line of a ``--log-format json``
request log at its time, with its prompt, cached and completion token counts.

Prompts are token ids sent to ``/v1/completions``, so their lengths are exact; EOS is
banned so every answer has its full length. :func:`run_workload` reports TTFT p50/p95
(seconds), the inter-token gap p99 and max (seconds) and output tokens/s.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway.telemetry.request_log import read_json_log


@dataclass(frozen=True)
class Request:
    """One request of a workload: sent ``at`` seconds after the start; its prompt is
    ``tokens`` long, the first ``shared`` of them common to its ``group``; ``out``
    tokens are generated."""

    at: float
    group: str
    shared: int
    tokens: int
    out: int


def synthetic(burst: int = 6, system: int = 600, user: int = 200, streams: int = 6, stream_out: int = 64,
              agents: int = 2, agent_tokens: int = 4000, agent_out: int = 16) -> list[Request]:
    """The synthetic workload (see the module docstring)."""
    reqs = [Request(0.0, "burst", system, system + user, 32) for _ in range(burst)]
    reqs += [Request(0.3 * i, f"stream{i}", 0, user, stream_out) for i in range(streams)]
    reqs += [Request(1.0 + 1.5 * i, "agent", agent_tokens // 2, agent_tokens, agent_out) for i in range(agents)]
    return sorted(reqs, key=lambda r: r.at)


def from_log(path: Path) -> list[Request]:
    """The requests of a JSON request log (``serve --log-format json``), replayed from the
    first one's time; lines without token counts are skipped.

    Raises:
        ValueError: no line has token counts.
    """
    rows = []
    for d in read_json_log(path):
        if d.get("prompt_tokens") and d.get("ts") and d.get("status") == 200:
            ts = datetime.datetime.fromisoformat(d["ts"].replace("Z", "+00:00")).timestamp()
            rows.append((ts, d))
    if not rows:
        raise ValueError(f"{path}: no request lines with token counts (serve with --log-format json)")
    t0 = min(ts for ts, _ in rows)
    return [Request(ts - t0, d.get("tenant") or "default", d.get("cached_tokens", 0), d["prompt_tokens"],
                    max(1, d.get("completion_tokens", 1))) for ts, d in rows]


def prompts(requests: list[Request], vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids per request: its group's shared prefix, then fresh random ids (away from
    the ends of the vocabulary, where special tokens sit)."""
    rng = random.Random(seed)
    pools: dict[str, list[int]] = {}
    out = []
    lo, hi = min(10, vocab // 4), max(11, vocab - 10)
    for r in requests:
        pool = pools.setdefault(r.group, [])
        while len(pool) < r.shared:
            pool.append(rng.randrange(lo, hi))
        shared = min(r.shared, r.tokens - 1)
        out.append(pool[:shared] + [rng.randrange(lo, hi) for _ in range(r.tokens - shared)])
    return out


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the nearest rank); NaN for none."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


async def run_workload(url: str, model: str, requests: list[Request], token_prompts: list[list[int]],
                       bias: dict, timeout: float) -> dict:
    """Send the requests at their times; figures of the run (see the module docstring).
    A request that fails or is still running after ``timeout`` seconds counts in
    ``failed`` (the run's other figures cover the rest)."""
    ttfts: list[float] = []
    gaps: list[float] = []
    produced, failed = 0, 0

    async def one(client: httpx.AsyncClient, req: Request, prompt: list[int]) -> None:
        nonlocal produced, failed
        await asyncio.sleep(req.at)
        body = {"model": model, "prompt": prompt, "max_tokens": req.out, "temperature": 0, "stream": True,
                "logit_bias": bias}
        t0, times = time.monotonic(), []
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                        times.append(time.monotonic())
        except (httpx.HTTPError, ValueError):
            failed += 1
        if times:
            ttfts.append(times[0] - t0)
            gaps.extend(b - a for a, b in zip(times, times[1:]))
        produced += len(times)

    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(client, r, p)) for r, p in zip(requests, token_prompts)]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        failed += len(pending)
        wall = time.monotonic() - t0
    return {"ttft_p50": statistics.median(ttfts) if ttfts else float("nan"), "ttft_p95": quantile(ttfts, 0.95),
            "gap_p99": quantile(gaps, 0.99), "gap_max": max(gaps, default=0.0), "tok_s": produced / wall,
            "wall_s": wall, "failed": failed}
