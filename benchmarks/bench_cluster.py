"""Prefix affinity across replicas: two gateways behind SGLang's router against one gateway.

Workload: ``--conversations`` agent conversations (default 8) of ``--turns`` turns (default
6), all conversations at once, each turn sent when the conversation's last one ended. A
conversation starts with its own system prompt of ``--system-tokens`` tokens (default 400;
random words, new per conversation) and a first user message; each later turn appends the
assistant's answer and a new user message (~40 tokens), so every prompt but the first of a
conversation starts with the previous one. Greedy (temperature 0), streamed OpenAI chat
completions, ``--max-tokens`` (default 16) per answer, EOS and partial UTF-8 byte tokens
banned with ``logit_bias`` so that every answer has its full length.

Three setups, each started fresh as subprocesses (``tests/cluster_stack.py``), in one run:

* ``cache_aware``: 2 ``mlx-gateway serve`` replicas behind ``sglang_router.launch_router
  --policy cache_aware`` with the cluster's flags (``ROUTER_FLAGS``);
* ``round_robin``: the same with ``--policy round_robin``;
* ``single``: 1 replica, sent to directly (no router).

Figures per setup: the prefix-cache hit rate (sum of ``usage.prompt_tokens_details.cached_tokens``
over sum of ``prompt_tokens``) over the turns after each conversation's first, and over all
turns; TTFT p50/p95 (request sent to first content chunk); completion tokens per second over
the wall time; the wall time; the requests each replica answered. Then the ratios to the
single replica. Targets: hit rate of cache_aware / single >= 0.95
(round_robin shown for comparison); tokens/s of 2 replicas / 1 >= 1.6 with the replicas on two
machines. On one machine the two replicas share its cores, so that ratio is not the target's.

The model is the tests' tiny random-weight qwen3 (``tests/conftest.py``, ``model_path("qwen3")``)
unless ``--model PATH`` says otherwise (``--model medium``: the other benchmarks' 4-layer qwen3,
``scenarios.MEDIUM``, on which prefill costs more than the HTTP round trips).
Needs ``pip install 'sglang-router==0.3.2'``.

    LD_PRELOAD=<system OpenBLAS> python benchmarks/bench_cluster.py \\
        [--conversations 8] [--turns 6] [--max-tokens 16] [--model PATH] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cluster_stack import Cluster, Replica, router_available  # noqa: E402
from gateway.tuning.workload import quantile as pct  # noqa: E402
from scenarios import long_text, medium_model, sse_chunks, steady_stream_bias, words, write_results  # noqa: E402

USER_WORDS = 30  # words per new user message (about 40 tokens)
SETUPS = ("cache_aware", "round_robin", "single")


def default_model() -> str:
    from conftest import model_path  # the tests' tiny models, built once under .test-models/

    return str(model_path("qwen3"))


async def turn(c: httpx.AsyncClient, model: str, messages: list, max_tokens: int, bias: dict) -> dict:
    """One streamed greedy chat: its text, TTFT and usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": bias}
    t0 = time.monotonic()
    first, text, use = None, [], {}
    async for chunk in sse_chunks(c, body):
        use = chunk.get("usage") or use
        for ch in chunk.get("choices", []):
            piece = (ch.get("delta") or {}).get("content") or ""
            if piece:
                first = first or time.monotonic()
                text.append(piece)
    end = time.monotonic()
    if not use:
        raise RuntimeError("the stream carried no usage")
    return {"ttft": (first or end) - t0, "text": "".join(text), "prompt": use["prompt_tokens"],
            "cached": (use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "completion": use["completion_tokens"]}


async def conversation(c: httpx.AsyncClient, model: str, k: int, system: str, turns: int, max_tokens: int,
                       bias: dict) -> list[dict]:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task {k}: " + words(USER_WORDS, 1000 * k)}]
    out = []
    for t in range(turns):
        r = await turn(c, model, messages, max_tokens, bias)
        out.append({**r, "turn": t})
        messages += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": f"Step {t + 1}: " + words(USER_WORDS, 1000 * k + t + 1)}]
    return out


async def workload(url: str, model: str, systems: list[str], turns: int, max_tokens: int,
                   bias: dict) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(systems) + 4, max_keepalive_connections=len(systems) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        t0 = time.monotonic()
        convs = await asyncio.gather(*(conversation(c, model, k, s, turns, max_tokens, bias)
                                       for k, s in enumerate(systems)))
        return [r for conv in convs for r in conv], time.monotonic() - t0


def warm_up(replicas: list[Replica], model: str) -> None:
    """One short request to each replica directly (first-call costs out of the figures; its
    prompt shares nothing with the workload's)."""
    for r in replicas:
        resp = r.client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "warm up " + words(20, 99)}]})
        resp.raise_for_status()


def figures(results: list[dict], wall: float, served: list[int]) -> dict:
    later = [r for r in results if r["turn"] > 0]
    rate = lambda rs: sum(r["cached"] for r in rs) / max(1, sum(r["prompt"] for r in rs))  # noqa: E731
    return {"hit_rate_later": rate(later), "hit_rate_all": rate(results),
            "ttft_p50": pct([r["ttft"] for r in results], 0.5), "ttft_p95": pct([r["ttft"] for r in results], 0.95),
            "completion_tokens": sum(r["completion"] for r in results),
            "tok_s": sum(r["completion"] for r in results) / wall, "wall": wall, "requests": len(results),
            "prompt_tokens": sum(r["prompt"] for r in results), "served": served}


def run_setup(name: str, model: str, systems: list[str], a: argparse.Namespace, bias: dict, tmp: Path) -> dict:
    logs = tmp / name
    logs.mkdir()
    if name == "single":
        replica = Replica(logs, Path(model), name="replica1")
        try:
            replica.start().wait_ready()
            warm_up([replica], model)
            before = replica.generated()
            results, wall = asyncio.run(workload(replica.url, model, systems, a.turns, a.max_tokens, bias))
            return figures(results, wall, [replica.generated() - before])
        finally:
            replica.close()
    with Cluster(logs, Path(model), 2, policy=name, front=False) as cluster:
        warm_up(cluster.replicas, model)
        before = [r.generated() for r in cluster.replicas]
        results, wall = asyncio.run(workload(cluster.router.url, model, systems, a.turns, a.max_tokens, bias))
        return figures(results, wall, [r.generated() - b for r, b in zip(cluster.replicas, before)])


def table(rows: dict[str, dict]) -> str:
    out = ["| setup | hit rate, turns 2+ | hit rate, all turns | TTFT p50 (s) | TTFT p95 (s) | completion tok/s "
           "| wall (s) | requests per replica |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        setup = "1 replica, direct" if name == "single" else f"2 replicas, router {name}"
        out.append(f"| {setup} | {r['hit_rate_later']:.3f} | {r['hit_rate_all']:.3f} | {r['ttft_p50']:.3f} "
                   f"| {r['ttft_p95']:.3f} | {r['tok_s']:.1f} | {r['wall']:.2f} "
                   f"| {' / '.join(map(str, r['served']))} |")
    return "\n".join(out)


def ratios(rows: dict[str, dict]) -> str:
    single = rows.get("single")
    if single is None:
        return ""
    lines = []
    for name in ("cache_aware", "round_robin"):
        if name in rows:
            r = rows[name]
            hit = r["hit_rate_later"] / single["hit_rate_later"] if single["hit_rate_later"] else float("nan")
            lines.append(f"- {name}: hit rate (turns 2+) / single = {hit:.3f}"
                         f"{' (target >= 0.95)' if name == 'cache_aware' else ''}; "
                         f"tokens/s / single = {r['tok_s'] / single['tok_s']:.2f}")
    lines.append(f"The tokens/s target (>= 1.6x) is for replicas on two machines; here the two replicas "
                 f"and the client share this machine's {os.cpu_count()} CPU cores, so that ratio only shows "
                 f"what routing costs, not what a second machine adds.")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8, help="conversations at once (default %(default)s)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (default %(default)s)")
    p.add_argument("--system-tokens", type=int, default=400,
                   help="tokens of each conversation's system prompt (default %(default)s)")
    p.add_argument("--model", help="model directory, or `medium` for the other benchmarks' 4-layer qwen3 "
                   "(default: the tests' tiny qwen3)")
    p.add_argument("--setups", default=",".join(SETUPS), help="comma-separated: " + ", ".join(SETUPS))
    p.add_argument("--out", type=Path, help="write cluster.json and cluster.md into this directory")
    a = p.parse_args()
    setups = [s for s in a.setups.split(",") if s]
    unknown = set(setups) - set(SETUPS)
    if unknown:
        p.error(f"unknown setups: {', '.join(sorted(unknown))}")
    why = router_available()
    if why and any(s != "single" for s in setups):
        sys.exit(f"bench_cluster: {why}")
    model = medium_model() if a.model == "medium" else a.model or default_model()
    bias = steady_stream_bias(model)
    systems = ["You are a careful coding agent. " + long_text(model, a.system_tokens, 500 + k)
               for k in range(a.conversations)]
    print(f"model: {model}\n{a.conversations} conversations x {a.turns} turns at once, ~{a.system_tokens}-token "
          f"system prompts, {a.max_tokens}-token answers; {os.cpu_count()} CPU cores", flush=True)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        for name in setups:
            rows[name] = run_setup(name, model, systems, a, bias, Path(tmp))
            r = rows[name]
            print(f"{name}: hit rate {r['hit_rate_later']:.3f} (turns 2+), {r['hit_rate_all']:.3f} (all); "
                  f"{r['tok_s']:.1f} tok/s; wall {r['wall']:.2f} s; per replica {r['served']}", flush=True)
    md = table(rows) + "\n\n" + ratios(rows)
    print()
    print(md)
    if a.out:
        write_results(a.out, {"cluster.json": {"args": {k: str(v) for k, v in vars(a).items()}, "results": rows},
                              "cluster.md": md})


if __name__ == "__main__":
    main()
