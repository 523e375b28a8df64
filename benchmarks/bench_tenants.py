"""Fair-share benchmark: prints figures, asserts nothing.

An "agent" tenant floods the gateway with long prompts; half a second later a "browser"
tenant sends a few short ones. Reported: the browser's TTFT p50/p95 (seconds) and the
agent's total time, with the two as separate tenants (fair share) and with both using
one tenant's key (no fair share: longest-cached-prefix, then arrival order), on the same
server flags.

Usage::

    python benchmarks/bench_tenants.py [--model DIR] [--agent-requests 24] [--browser-requests 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from scenarios import free_port, start, stream_chat, words  # noqa: E402

from gateway.tenancy.tenants import hash_key  # noqa: E402

KEYS = {"agent": "mgw-bench-agent", "browser": "mgw-bench-browser"}


def tenants_file(directory: Path) -> Path:
    path = directory / "tenants.toml"
    path.write_text("".join(f'[tenants.{n}]\nkey_sha256 = ["{hash_key(k)}"]\n\n' for n, k in KEYS.items()))
    return path


async def run(url: str, browser_key: str, n_agent: int, n_browser: int) -> dict:
    async def as_tenant(key: str, messages, max_tokens: int) -> dict:
        async with httpx.AsyncClient(base_url=url, timeout=900, headers={"Authorization": f"Bearer {key}"}) as c:
            return await stream_chat(c, messages, max_tokens, "bench")

    t0 = time.monotonic()
    agent = [asyncio.create_task(as_tenant(KEYS["agent"], [{"role": "user", "content": words(700, 1000 + i)}], 16))
             for i in range(n_agent)]
    await asyncio.sleep(0.5)
    browser = await asyncio.gather(*(as_tenant(browser_key, [{"role": "user", "content": words(30, 50 + i)}], 16)
                                     for i in range(n_browser)))
    browser_done = time.monotonic() - t0
    await asyncio.gather(*agent)
    ttfts = sorted(r["ttft"] for r in browser)
    return {"browser_ttft_p50": statistics.median(ttfts), "browser_ttft_p95": ttfts[-1] if len(ttfts) < 20
            else ttfts[int(0.95 * (len(ttfts) - 1))], "browser_done": browser_done,
            "agent_done": time.monotonic() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: a 4-layer hidden-256 random qwen3)")
    p.add_argument("--agent-requests", type=int, default=24)
    p.add_argument("--browser-requests", type=int, default=6)
    p.add_argument("--prompt-concurrency", type=int, default=2)
    args = p.parse_args()
    from gateway.models.demo_model import build_model_dir

    medium = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 768,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    model = args.model or str(build_model_dir(Path(tempfile.gettempdir()) / "mlx-gateway-bench-qwen3-medium",
                                              "qwen3", overrides=medium))
    with tempfile.TemporaryDirectory() as d:
        tenants = tenants_file(Path(d))
        for label, browser_key in (("fair share (two tenants)", KEYS["browser"]),
                                   ("one tenant (no fair share)", KEYS["agent"])):
            port = free_port()
            cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port", str(port), "--tenants",
                   str(tenants), "--served-model-name", "bench", "--prompt-concurrency", str(args.prompt_concurrency)]
            proc, _ = start(cmd, port)
            try:
                r = asyncio.run(run(f"http://127.0.0.1:{port}", browser_key, args.agent_requests,
                                    args.browser_requests))
            finally:
                proc.terminate()
                proc.wait(30)
            print(f"{label:28s} browser TTFT p50 {r['browser_ttft_p50']:.2f}s p95 {r['browser_ttft_p95']:.2f}s"
                  f" | browser done {r['browser_done']:.1f}s | agent done {r['agent_done']:.1f}s", flush=True)


if __name__ == "__main__":
    main()
