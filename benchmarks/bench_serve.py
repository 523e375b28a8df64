"""Serving benchmark: prints figures, asserts nothing.

Scenarios, each against a real server process on loopback:

* ``startup``: process start to first answer of ``mlx-gateway serve`` on the demo model.
* ``single`` / ``concurrent``: TTFT and decode tokens/s for 1 and 8 streaming requests.
* ``burst``: 6 concurrent chat requests sharing a ~600-token system prompt with different
  ~300-token user texts, 3 rounds (cold, then repeated).
* ``conversation``: a 20-turn chat where each turn sends the whole history.
* ``constrained``: decode tokens/s of 8 concurrent requests with 0 and with 4 of them
  constrained by a JSON schema (``response_format``); the ratio is the mask's cost.

For burst and conversation it reports TTFT p50/p95 (seconds), prompt tokens computed
(prompt - cached, from ``usage``), the cached-token fraction and decode tokens/s, for each
``--prompt-concurrency`` given. ``--compare`` runs the same workload against
``mlx_lm.server`` on the same model.

Usage::

    python benchmarks/bench_serve.py [--model DIR] [--concurrency 1 2 4 8] [--compare]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ("the model cache token prompt server batch request tenant prefix memory apple code agent "
         "browser extension stream answer question system user assistant reason think water").split()


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, env=None, timeout: float = 300) -> tuple[subprocess.Popen, float]:
    """Start a server; returns (process, seconds until /v1/models answered)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < timeout:
        try:
            r = httpx.get(url + "/health", timeout=1)
            if r.status_code == 200:
                return proc, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {cmd}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("server did not start")


async def stream_chat(c: httpx.AsyncClient, messages, max_tokens: int, model: str, **extra) -> dict:
    t0 = time.monotonic()
    first, n, text, use = None, 0, "", {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                use = chunk["usage"]
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                piece = (d.get("content") or "") + (d.get("reasoning_content") or "")
                if piece:
                    first = first or time.monotonic()
                    n += 1
                    text += piece
    end = time.monotonic()
    cached = ((use.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return {"ttft": (first or end) - t0, "total": end - t0, "chunks": n, "text": text,
            "prompt": use.get("prompt_tokens", 0), "cached": cached,
            "completion": use.get("completion_tokens", n), "decode_s": end - (first or end)}


def summarize(results: list[dict], wall: float) -> dict:
    ttfts = sorted(r["ttft"] for r in results)
    p95 = ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))]
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    return {"ttft_p50": statistics.median(ttfts), "ttft_p95": p95, "computed": prompt - cached,
            "cached_frac": cached / prompt if prompt else 0.0,
            "tok_s": sum(r["completion"] for r in results) / wall}


async def burst(url: str, model: str, rounds: int = 3) -> dict:
    system = "You are a careful assistant. " + words(560, 0)
    users = [f"Page {i}: " + words(280, 100 + i) for i in range(6)]
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()
        for _ in range(rounds):
            out += await asyncio.gather(*(stream_chat(c, [{"role": "system", "content": system},
                                                          {"role": "user", "content": u}], 16, model) for u in users))
        return summarize(out, time.monotonic() - t0)


async def conversation(url: str, model: str, turns: int = 20) -> dict:
    messages = [{"role": "system", "content": "You help with code. " + words(200, 1)}]
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()
        for t in range(turns):
            messages.append({"role": "user", "content": words(60, 500 + t)})
            r = await stream_chat(c, messages, 24, model)
            out.append(r)
            messages.append({"role": "assistant", "content": r["text"]})
        return summarize(out, time.monotonic() - t0)


async def decode_speed(url: str, model: str, n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        t0 = time.monotonic()
        rs = await asyncio.gather(*(stream_chat(c, [{"role": "user", "content": words(30 + 20 * i, i)}], 64, model)
                                    for i in range(n)))
        wall = time.monotonic() - t0
    return {"ttft_p50": statistics.median(r["ttft"] for r in rs),
            "tok_s_per_request": statistics.median(r["completion"] / max(r["decode_s"], 1e-9) for r in rs),
            "tok_s_total": sum(r["completion"] for r in rs) / wall}


# Exactly 48 one-digit integers: longer than max_tokens, so constrained rows decode as
# long as free ones and the batch keeps its size.
DIGITS = {"type": "json_schema", "json_schema": {"name": "digits", "schema": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 48, "maxItems": 48}}}


async def constrained(url: str, model: str, n: int = 8, rounds: int = 3) -> dict:
    """Decode tokens/s of ``n`` concurrent requests, none or half of them constrained
    (median of ``rounds``), and the ratio half/none. Free rows get EOS banned
    (``logit_bias``) so that every row decodes all 64 tokens in both runs."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    no_eos = {"logit_bias": {str(t): -100 for t in load_tokenizer(Path(model)).eos_token_ids}}
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        for k in (0, n // 2):
            speeds = []
            for r in range(rounds):
                rs = await asyncio.gather(*(
                    stream_chat(c, [{"role": "user", "content": words(30, 1000 * r + 100 * k + i)}], 64, model,
                                **({"response_format": DIGITS} if i < k else no_eos))
                    for i in range(n)))
                # Decode only: from the first token of any row to the end of the last.
                window = max(x["total"] for x in rs) - min(x["ttft"] for x in rs)
                speeds.append(sum(x["completion"] for x in rs) / window)
            out[f"tok_s_{k}_of_{n}"] = statistics.median(speeds)
    out["ratio"] = out[f"tok_s_{n // 2}_of_{n}"] / out[f"tok_s_0_of_{n}"]
    return out


def gateway_cmd(model: str, port: int, pc: int) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port", str(port),
            "--prompt-concurrency", str(pc), "--decode-concurrency", "32", "--log-level", "WARNING"]


def mlx_lm_cmd(model: str, port: int, pc: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port),
            "--prompt-concurrency", str(pc), "--decode-concurrency", "32", "--log-level", "WARNING"]


def run_server(cmd_fn, model: str, pc: int, served: str, scenarios) -> dict:
    port = free_port()
    proc, _ = start(cmd_fn(model, port, pc), port)
    try:
        url = f"http://127.0.0.1:{port}"
        return {name: asyncio.run(fn(url, served)) for name, fn in scenarios}
    finally:
        proc.terminate()
        proc.wait(30)


def fmt(d: dict) -> str:
    return "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a tiny qwen3 demo model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--compare", action="store_true", help="also run mlx_lm.server on the same model")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--only", choices=["decode"], help="run only the decode scenarios (single, concurrent, "
                    "constrained) on the gateway")
    args = ap.parse_args()

    from gateway.models.demo_model import build_model_dir

    if not args.skip_startup:
        with tempfile.TemporaryDirectory() as home:
            port = free_port()
            env = dict(os.environ, MLX_GATEWAY_HOME=home)
            t0 = time.monotonic()
            proc, _ = start([sys.executable, "-m", "gateway.cli", "serve", "--model", "demo", "--port", str(port)], port, env=env)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            r.raise_for_status()
            print(f"startup (demo model built from scratch, process start to first answer): "
                  f"{time.monotonic() - t0:.2f} s")
            proc.terminate()
            proc.wait(30)

    # A qwen3 larger than the test models (4 layers, hidden 256, ~3M parameters) so that
    # prefill cost is visible on a CPU; still random weights.
    medium = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32}
    model = args.model or str(build_model_dir(Path(tempfile.gettempdir()) / "mlx-gateway-bench-qwen3-medium",
                                              "qwen3", overrides=medium))
    print(f"model: {model}")
    res = run_server(gateway_cmd, model, 8, model, [("single", lambda u, m: decode_speed(u, m, 1)),
                                                    ("concurrent8", lambda u, m: decode_speed(u, m, 8)),
                                                    ("constrained", constrained)])
    for k, v in res.items():
        print(f"mlx-gateway {k:12s} {fmt(v)}")
    if args.only == "decode":
        return

    servers = [("mlx-gateway", gateway_cmd)] + ([("mlx_lm.server", mlx_lm_cmd)] if args.compare else [])
    for pc in args.concurrency:
        for name, cmd in servers:
            res = run_server(cmd, model, pc, model, [("burst", burst), ("conversation", conversation)])
            for k, v in res.items():
                print(f"{name:14s} pc={pc} {k:12s} {fmt(v)}")


if __name__ == "__main__":
    main()
