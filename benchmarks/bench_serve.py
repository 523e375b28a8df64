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
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios import (  # noqa: E402
    burst, constrained, conversation, decode_speed, free_port, stall, start,
)


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
    ap.add_argument("--only", choices=["decode", "stall"], help="decode: only the decode scenarios (single, "
                    "concurrent, constrained) on the gateway; stall: only the decode-stall scenario")
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
    servers = [("mlx-gateway", gateway_cmd)] + ([("mlx_lm.server", mlx_lm_cmd)] if args.compare else [])
    if args.only == "stall":
        for name, cmd in servers:
            res = run_server(cmd, model, 8, model, [("stall", stall)])
            print(f"{name:14s} stall        {fmt(res['stall'])}")
        return
    res = run_server(gateway_cmd, model, 8, model, [("single", lambda u, m: decode_speed(u, m, 1)),
                                                    ("concurrent8", lambda u, m: decode_speed(u, m, 8)),
                                                    ("constrained", constrained)])
    for k, v in res.items():
        print(f"mlx-gateway {k:12s} {fmt(v)}")
    if args.only == "decode":
        return

    for pc in args.concurrency:
        for name, cmd in servers:
            res = run_server(cmd, model, pc, model, [("burst", burst), ("conversation", conversation)])
            for k, v in res.items():
                print(f"{name:14s} pc={pc} {k:12s} {fmt(v)}")


if __name__ == "__main__":
    main()
