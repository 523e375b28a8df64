"""A burst of long prompts under a small ``--memory-budget``: does memory stay under it?

Starts ``mlx-gateway serve`` (a subprocess) on a model with ``--memory-budget`` set to its
weights plus ``--headroom`` bytes, sends ``--requests`` concurrent completions of about
``--prompt-tokens`` tokens asking for ``--max-tokens`` each (``ignore_eos``), and samples
the server every 20 ms meanwhile: MLX's active memory (``mlx_gateway_mlx_memory_bytes``),
the prefix cache's bytes and the process's RSS. Prints the peaks against the budget and
every answer's status (200 with all its tokens, or 503 with ``Retry-After``), and MLX's
own peak (its allocator's, which sees between the samples too). Results:
``benchmarks/results/memory_burst.md``.

    python benchmarks/bench_memory_burst.py                 # the default model
    python benchmarks/bench_memory_burst.py --model PATH --requests 32
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.soak import Gateway, parse_metrics, rss_bytes  # noqa: E402


def weights_bytes(model: str, port: int) -> int:
    """Bytes of the model's weights as this backend serves them (a gateway started
    without a budget reports them: ``mlx_gateway_model_weights_bytes``)."""
    gw = Gateway(model, None, None, [], port)
    try:
        gw.wait_healthy()
        with httpx.Client(base_url=gw.url, timeout=10) as c:
            text = c.get("/metrics").text
    finally:
        gw.close()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("mlx_gateway_model_weights_bytes{")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--headroom", type=float, default=300e6, help="budget above the weights, bytes (default 300 MB)")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=800)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--port", type=int, default=18731)
    p.add_argument("--json", help="write the report here too")
    a = p.parse_args(argv)
    if a.model is None:
        from gateway.models.default_model import ensure_default_model

        a.model = str(ensure_default_model())
    budget = int(weights_bytes(a.model, a.port) + a.headroom)
    gw = Gateway(a.model, None, None, ["--memory-budget", str(budget), "--max-tokens", str(a.max_tokens)], a.port)
    peaks = {"mlx_active_mb": 0.0, "cache_mb": 0.0, "rss_mb": 0.0, "active_plus_cache_mb": 0.0}
    stop = threading.Event()
    try:
        gw.wait_healthy()

        def sample() -> None:
            with httpx.Client(base_url=gw.url, timeout=10) as c:
                while not stop.is_set():
                    m = parse_metrics(c.get("/metrics").text)
                    m["rss_mb"] = rss_bytes(gw.proc.pid) / 1e6
                    m["active_plus_cache_mb"] = m.get("mlx_active_mb", 0.0)  # cache arrays are MLX arrays too
                    for k in peaks:
                        peaks[k] = max(peaks[k], m.get(k, 0.0))
                    time.sleep(0.02)

        words = " ".join(f"w{i % 97}" for i in range(a.prompt_tokens))
        with httpx.Client(base_url=gw.url, timeout=60) as c:  # tokens per word, on 100 words
            probe = " ".join(words.split()[:100])
            n = c.post("/v1/completions", json={"model": "chat", "prompt": probe, "max_tokens": 1}).json()
            ratio = 100 / max(1, n["usage"]["prompt_tokens"])
        words = " ".join(words.split()[:max(1, int(a.prompt_tokens * ratio))])

        def ask(i: int):
            with httpx.Client(base_url=gw.url, timeout=3600) as c:
                r = c.post("/v1/completions", json={"model": "chat", "prompt": f"{i} {words}",
                                                    "max_tokens": a.max_tokens, "ignore_eos": True})
            body = r.json()
            ok = r.status_code == 200 and body["usage"]["completion_tokens"] == a.max_tokens
            return r.status_code, r.headers.get("retry-after"), ok, body.get("usage", {}).get("prompt_tokens")

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        with ThreadPoolExecutor(a.requests) as pool:
            answers = list(pool.map(ask, range(a.requests)))
        seconds = time.monotonic() - started
        stop.set()
        sampler.join()
        with httpx.Client(base_url=gw.url, timeout=10) as c:  # MLX's own peak since the server started
            mlx_peak = max((float(line.rsplit(" ", 1)[1]) for line in c.get("/metrics").text.splitlines()
                            if line.startswith('mlx_gateway_mlx_memory_bytes{kind="peak"}')), default=0.0)
    finally:
        stop.set()
        gw.close()
    report = {"model": a.model, "budget_mb": budget / 1e6, "requests": a.requests, "max_tokens": a.max_tokens,
              "prompt_tokens": answers[0][3], "seconds": round(seconds, 1),
              "statuses": {str(s): sum(1 for x in answers if x[0] == s) for s in {x[0] for x in answers}},
              "complete_200s": sum(1 for x in answers if x[2]),
              "503s_with_retry_after": sum(1 for x in answers if x[0] == 503 and x[1]),
              **{f"peak_{k}": round(v, 1) for k, v in peaks.items()}}
    report["peak_active_over_budget"] = round(peaks["mlx_active_mb"] / (budget / 1e6), 3)
    report["mlx_peak_mb"] = round(mlx_peak / 1e6, 1)  # between samples too (MLX's allocator)
    report["mlx_peak_over_budget"] = round(mlx_peak / budget, 3)
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
