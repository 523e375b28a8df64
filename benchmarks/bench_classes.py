"""An extension beside agents: latency classes measured on one server.

Workload (``--seconds`` per phase, default 30), on the demo model (random weights,
float32) unless ``--model`` says otherwise:

- 3 agent clients (tenant ``agent``), each sending ~3,000-token prompts with new content
  back to back, 16-token answers;
- 1 extension client (tenant ``ext``) sending a ~200-token prompt every 2 s, 32-token
  streamed answers.

Each mode runs three phases on one fresh server, the prefix cache flushed before each:
the agents alone (before any interactive request, so they prefill as on a gateway without
an extension), the extension alone, then both. Figures: the extension's TTFT p50/p95
and largest inter-token gap (both alone and beside the agents), the agents' prompt tokens
per second (alone and beside the extension), and whether every answer beside the others
is the text it was alone (greedy). Modes: ``classes`` (``ext`` is ``interactive``, ``agent``
``standard``) and ``standard`` (both ``standard``: the gateway without latency classes).
Targets (issue "latency classes"): TTFT p95 beside / alone <= 1.5, gap max <= 0.35 s, agents'
tokens/s beside / alone >= 0.9, outputs identical.

    LD_PRELOAD=<system OpenBLAS> python benchmarks/bench_classes.py [--seconds 30] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.tuning.workload import quantile as pct  # noqa: E402
from scenarios import free_port, gateway_cmd, serving, sse_chunks, write_results  # noqa: E402

WORDS = ("page article summary title link button price review comment reply user author date news story "
         "market weather sport music video photo travel food recipe code error function class module").split()
KEYS = {"agent": "mgw-bench-agent", "ext": "mgw-bench-ext", "admin": "mgw-bench-admin"}
MODEL = "mlx-gateway-demo"


def tenants_file(path: Path, classes: bool) -> Path:
    def digest(k: str) -> str:
        return hashlib.sha256(k.encode()).hexdigest()

    ext_priority = "interactive" if classes else "standard"
    path.write_text(f'[admin]\nkey_sha256 = ["{digest(KEYS["admin"])}"]\n\n'
                    f'[tenants.agent]\nkey_sha256 = ["{digest(KEYS["agent"])}"]\npriority = "standard"\n\n'
                    f'[tenants.ext]\nkey_sha256 = ["{digest(KEYS["ext"])}"]\npriority = "{ext_priority}"\n')
    return path


def text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def chat(c: httpx.AsyncClient, key: str, content: str, max_tokens: int) -> dict:
    """One streamed greedy chat: its text, TTFT, the gaps between its chunks and usage."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {}}
    t0 = time.monotonic()
    times, out, use = [], [], {}
    async for chunk in sse_chunks(c, body, headers={"Authorization": f"Bearer {key}"}):
        use = chunk.get("usage") or use
        for ch in chunk.get("choices", []):
            piece = ch.get("delta", {}).get("content") or ""
            if piece:
                times.append(time.monotonic())
                out.append(piece)
    return {"ttft": (times[0] if times else time.monotonic()) - t0, "gaps": [b - a for a, b in zip(times, times[1:])],
            "text": "".join(out), "prompt": use.get("prompt_tokens", 0)}


async def extension(c: httpx.AsyncClient, seconds: float, results: dict) -> None:
    """A prompt every 2 s (~200 tokens, 32-token answers), numbered so phases compare."""
    start, i, jobs = time.monotonic(), 0, []
    while time.monotonic() - start < seconds:
        jobs.append(asyncio.create_task(_keep(results, i, chat(c, KEYS["ext"], text(56, 1000 + i), 32))))
        i += 1
        await asyncio.sleep(max(0.0, start + 2.0 * i - time.monotonic()))
    await asyncio.gather(*jobs)


async def agent(c: httpx.AsyncClient, who: int, seconds: float, results: dict) -> None:
    """~3,000-token prompts with new content, back to back, 16-token answers."""
    start, i = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        await _keep(results, (who, i), chat(c, KEYS["agent"], text(840, 10_000 * (who + 1) + i), 16))
        i += 1


async def _keep(results: dict, key, job) -> None:
    results[key] = await job


async def phase(url: str, seconds: float, ext: bool, agents: bool) -> tuple[dict, dict, float]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        r = await c.post("/admin/cache/flush", json={}, headers={"Authorization": f"Bearer {KEYS['admin']}"})
        r.raise_for_status()
        ext_results, agent_results = {}, {}
        t0 = time.monotonic()
        jobs = ([extension(c, seconds, ext_results)] if ext else []) + \
               ([agent(c, k, seconds, agent_results) for k in range(3)] if agents else [])
        await asyncio.gather(*jobs)
        return ext_results, agent_results, time.monotonic() - t0


def run_mode(mode: str, seconds: float, model: str, extra: list[str], log_dir: Path | None = None) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        tenants = tenants_file(Path(tmp) / "tenants.toml", classes=(mode == "classes"))
        cmd = gateway_cmd(port, "--model", model, "--tenants", str(tenants), *extra)
        log = open(log_dir / f"classes-{mode}.log", "w") if log_dir else None
        with serving(cmd, port, log=log) as (url, _):
            # The agents alone first: no interactive request has been seen yet, so their
            # prompts prefill as they would on a gateway with no extension at all.
            _, alone_agents, agents_wall = asyncio.run(phase(url, seconds, ext=False, agents=True))
            alone_ext, _, _ = asyncio.run(phase(url, seconds, ext=True, agents=False))
            both_ext, both_agents, both_wall = asyncio.run(phase(url, seconds, ext=True, agents=True))
    same = [both_ext[k]["text"] == alone_ext[k]["text"] for k in both_ext if k in alone_ext]
    same += [both_agents[k]["text"] == alone_agents[k]["text"] for k in both_agents if k in alone_agents]
    tok_s = lambda res, wall: sum(r["prompt"] for r in res.values()) / wall  # noqa: E731
    return {"mode": mode, "ext_ttft_p50_alone": pct([r["ttft"] for r in alone_ext.values()], 0.5),
            "ext_ttft_p95_alone": pct([r["ttft"] for r in alone_ext.values()], 0.95),
            "ext_ttft_p50": pct([r["ttft"] for r in both_ext.values()], 0.5),
            "ext_ttft_p95": pct([r["ttft"] for r in both_ext.values()], 0.95),
            "ext_gap_max_alone": max((g for r in alone_ext.values() for g in r["gaps"]), default=0.0),
            "ext_gap_max": max((g for r in both_ext.values() for g in r["gaps"]), default=0.0),
            "agent_prompt_tok_s_alone": tok_s(alone_agents, agents_wall),
            "agent_prompt_tok_s": tok_s(both_agents, both_wall), "ext_requests": len(both_ext),
            "agent_requests": len(both_agents), "outputs_compared": len(same), "outputs_identical": all(same),
            "ext_prompt_tokens": statistics.mean(r["prompt"] for r in both_ext.values()),
            "agent_prompt_tokens": statistics.mean(r["prompt"] for r in both_agents.values())}


def table(rows: list[dict]) -> str:
    out = ["| mode | ext TTFT p50 alone / beside (s) | ext TTFT p95 alone / beside (s) | p95 ratio (<= 1.5) "
           "| ext gap max alone / beside (s) (<= 0.35) | agents prompt tok/s alone / beside | ratio (>= 0.9) "
           "| outputs identical |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['mode']} | {r['ext_ttft_p50_alone']:.3f} / {r['ext_ttft_p50']:.3f} "
            f"| {r['ext_ttft_p95_alone']:.3f} / {r['ext_ttft_p95']:.3f} "
            f"| {r['ext_ttft_p95'] / r['ext_ttft_p95_alone']:.2f} "
            f"| {r['ext_gap_max_alone']:.3f} / {r['ext_gap_max']:.3f} "
            f"| {r['agent_prompt_tok_s_alone']:.0f} / {r['agent_prompt_tok_s']:.0f} "
            f"| {r['agent_prompt_tok_s'] / r['agent_prompt_tok_s_alone']:.2f} "
            f"| {'yes' if r['outputs_identical'] else 'NO'} ({r['outputs_compared']}) |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="seconds per phase (default 30)")
    p.add_argument("--model", default="demo", help="the model to serve (default: the demo model)")
    p.add_argument("--modes", default="classes,standard", help="comma-separated: classes, standard")
    p.add_argument("--gateway-args", default="", help="extra `serve` flags, space-separated")
    p.add_argument("--out", help="write classes.json and classes.md into this directory")
    p.add_argument("--logs", help="write each server's log into this directory")
    a = p.parse_args()
    logs = Path(a.logs) if a.logs else None
    rows = [run_mode(m, a.seconds, a.model, a.gateway_args.split(), logs) for m in a.modes.split(",")]
    md = table(rows)
    print(md)
    if a.out:
        write_results(a.out, {"classes.json": rows, "classes.md": md})


if __name__ == "__main__":
    main()
