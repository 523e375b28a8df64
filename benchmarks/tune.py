"""Sweep the scheduling flags against a workload and recommend a setting (a script; it
prints figures and asserts nothing).

Flags swept: ``--prompt-concurrency``, ``--decode-concurrency`` and ``--prefill-budget``,
one at a time around a base setting (``--grid`` for every combination). Each setting
runs the workload against a fresh ``mlx-gateway serve`` and reports TTFT p50/p95, the
decoding streams' inter-token gap p99 (seconds) and output tokens/s.

Workloads, sent as token-id prompts to ``/v1/completions`` (so lengths are exact):

* ``synthetic`` (default): 10 interactive streams (200-token prompts sharing 120
  tokens, 96 tokens out) start over 2 s while 3 agent requests (2500-token prompts
  sharing a 1500-token prefix, 32 tokens out) arrive at 1.0, 2.5 and 4.0 s.
* ``--replay LOG``: a request log written with ``--log-format json``: each line's
  arrival time, tenant, prompt, cached and completion token counts are replayed (the
  cached part as a prefix shared within the tenant, the rest fresh tokens).

The recommendation: the highest tokens/s among the settings whose gap p99 is within
``--max-gap`` seconds and whose TTFT p95 is within 25% of the best; else the lowest TTFT
p95. ``--out DIR`` writes ``tune.json``, ``tune.md`` and ``tune.png``.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/tune.py [--model DIR] [--replay requests.log] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios import free_port, medium_model, pyplot, start, steady_stream_bias  # noqa: E402

BASE = {"prompt_concurrency": 8, "decode_concurrency": 32, "prefill_budget": 0.2}
SWEEP = {"prompt_concurrency": [1, 2, 4, 8], "decode_concurrency": [8, 32], "prefill_budget": [0, 0.1, 0.2, 0.4]}


def synthetic() -> list[dict]:
    """Request specs: ``at`` (s), ``group``, ``shared`` and ``tokens`` (prompt), ``out``."""
    specs = [{"at": 0.2 * i, "group": "chat", "shared": 120, "tokens": 200, "out": 96} for i in range(10)]
    specs += [{"at": t, "group": "agent", "shared": 1500, "tokens": 2500, "out": 32} for t in (1.0, 2.5, 4.0)]
    return specs


def from_log(path: Path) -> list[dict]:
    """Request specs replaying a JSON request log (lines without token counts skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("prompt_tokens") and d.get("ts") and d.get("status") == 200:
            ts = datetime.datetime.fromisoformat(d["ts"].replace("Z", "+00:00")).timestamp()
            rows.append((ts, d))
    if not rows:
        raise SystemExit(f"{path}: no request lines with token counts (serve with --log-format json)")
    t0 = min(ts for ts, _ in rows)
    return [{"at": ts - t0, "group": d.get("tenant") or "default", "shared": d.get("cached_tokens", 0),
             "tokens": d["prompt_tokens"], "out": max(1, d.get("completion_tokens", 1))} for ts, d in rows]


def prompts(specs: list[dict], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    pools: dict[str, list[int]] = {}
    out = []
    for s in specs:
        pool = pools.setdefault(s["group"], [rng.randrange(10, vocab - 10) for _ in range(8192)])
        shared = min(s["shared"], s["tokens"] - 1, len(pool))
        out.append(pool[:shared] + [rng.randrange(10, vocab - 10) for _ in range(s["tokens"] - shared)])
    return out


async def run_workload(url: str, model: str, specs: list[dict], token_prompts: list[list[int]], bias: dict) -> dict:
    ttfts, gaps, produced = [], [], 0

    async def one(spec: dict, prompt: list[int]) -> None:
        nonlocal produced
        await asyncio.sleep(spec["at"])
        body = {"model": model, "prompt": prompt, "max_tokens": spec["out"], "temperature": 0, "stream": True,
                "logit_bias": bias}
        t0, times = time.monotonic(), []
        async with c.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and any(ch.get("text") for ch in json.loads(line[6:])["choices"]):
                    times.append(time.monotonic())
        if times:
            ttfts.append(times[0] - t0)
            gaps.extend(b - a for a, b in zip(times, times[1:]))
        produced += len(times)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=256)) as c:
        t0 = time.monotonic()
        await asyncio.gather(*(one(s, p) for s, p in zip(specs, token_prompts)))
        wall = time.monotonic() - t0
    ttfts.sort()
    gaps.sort()
    return {"ttft_p50": statistics.median(ttfts), "ttft_p95": ttfts[int(0.95 * (len(ttfts) - 1))],
            "gap_p99": gaps[int(0.99 * (len(gaps) - 1))] if gaps else 0.0, "tok_s": produced / wall}


def settings(grid: bool) -> list[dict]:
    if grid:
        keys = list(SWEEP)
        return [dict(zip(keys, values)) for values in itertools.product(*(SWEEP[k] for k in keys))]
    out = [dict(BASE)]
    for key, values in SWEEP.items():
        out += [{**BASE, key: v} for v in values if v != BASE[key]]
    return out


def recommend(rows: list[dict], max_gap: float) -> dict:
    best_p95 = min(r["ttft_p95"] for r in rows)
    ok = [r for r in rows if r["gap_p99"] <= max_gap and r["ttft_p95"] <= 1.25 * best_p95]
    return max(ok, key=lambda r: r["tok_s"]) if ok else min(rows, key=lambda r: r["ttft_p95"])


def table(rows: list[dict]) -> str:
    lines = ["| prompt-concurrency | decode-concurrency | prefill-budget (s) | TTFT p50 (s) | TTFT p95 (s) "
             "| gap p99 (s) | tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_concurrency']} | {r['decode_concurrency']} | {r['prefill_budget']} | "
                     f"{r['ttft_p50']:.3f} | {r['ttft_p95']:.3f} | {r['gap_p99']:.3f} | {r['tok_s']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    labels = [f"pc={r['prompt_concurrency']}\ndc={r['decode_concurrency']}\nbudget={r['prefill_budget']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    x = range(len(rows))
    axes[0].bar([i - 0.2 for i in x], [r["ttft_p50"] for r in rows], width=0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [r["ttft_p95"] for r in rows], width=0.4, label="p95")
    axes[0].set_title("TTFT (s)")
    axes[0].legend(fontsize=8)
    axes[1].bar(x, [r["gap_p99"] for r in rows])
    axes[1].set_title("inter-token gap p99 (s)")
    axes[2].bar(x, [r["tok_s"] for r in rows])
    axes[2].set_title("output tokens/s")
    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the medium random-weight qwen3 of bench_serve)")
    ap.add_argument("--replay", type=Path, help="a JSON request log to replay instead of the synthetic workload")
    ap.add_argument("--grid", action="store_true", help="every combination instead of one flag at a time")
    ap.add_argument("--max-gap", type=float, default=0.35, help="inter-token gap p99 a setting must keep (s)")
    ap.add_argument("--out", type=Path, help="write tune.json, tune.md and tune.png here")
    args = ap.parse_args()

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model = args.model or medium_model()
    specs = from_log(args.replay) if args.replay else synthetic()
    vocab = len(load_tokenizer(Path(model))._tokenizer.get_vocab())
    token_prompts = prompts(specs, vocab)
    bias = steady_stream_bias(model)
    print(f"model: {model}; workload: {len(specs)} requests ({'replay of ' + str(args.replay) if args.replay else 'synthetic'})")
    rows = []
    for s in settings(args.grid):
        port = free_port()
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port", str(port),
               "--log-level", "WARNING", "--prompt-concurrency", str(s["prompt_concurrency"]),
               "--decode-concurrency", str(s["decode_concurrency"]), "--prefill-budget", str(s["prefill_budget"])]
        proc, _ = start(cmd, port)
        try:
            res = asyncio.run(run_workload(f"http://127.0.0.1:{port}", model, specs, token_prompts, bias))
        finally:
            proc.terminate()
            proc.wait(30)
        rows.append({**s, **res})
        print(table([rows[-1]]).splitlines()[-1], flush=True)
    md = table(rows)
    best = recommend(rows, args.max_gap)
    advice = (f"recommended: --prompt-concurrency {best['prompt_concurrency']} --decode-concurrency "
              f"{best['decode_concurrency']} --prefill-budget {best['prefill_budget']}")
    print(md)
    print(advice)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune.json").write_text(json.dumps(rows, indent=1))
        (args.out / "tune.md").write_text(md + "\n\n" + advice + "\n")
        if not plot(rows, args.out / "tune.png"):
            print("matplotlib is not installed: no plot (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
