"""A burst of long prompts under a small ``--memory-budget``: does memory stay under it?

Starts ``mlx-gateway serve`` (a subprocess) on a model with ``--memory-budget`` set to its
weights plus ``--headroom`` bytes, sends ``--requests`` concurrent completions of about
``--prompt-tokens`` tokens asking for ``--max-tokens`` each (``ignore_eos``), and samples
the server every 20 ms meanwhile: MLX's active memory (``mlx_gateway_mlx_memory_bytes``),
the prefix cache's bytes and the process's RSS. Prints the peaks against the budget and
every answer's status (200 with all its tokens, or 503 with ``Retry-After``), and MLX's
own peak (its allocator's, which sees between the samples too). Results:
``benchmarks/results/memory_burst.md``.

With ``--no-max-tokens`` the requests are chat completions that give no ``max_tokens``
(the model's EOS ends them, or the context's end, here ``--max-tokens-limit``), and
``--compare`` runs the burst twice: first with every row reserving its whole
``max_tokens`` (``MLX_GATEWAY_RESERVATION_QUANTUM=0``, as before growing reservations),
then with growth and preemption (``scheduler/admission/preemption.py``); each report adds
the preemptions and their resumes.

    python benchmarks/bench_memory_burst.py                 # the default model
    python benchmarks/bench_memory_burst.py --model PATH --requests 32
    python benchmarks/bench_memory_burst.py --no-max-tokens --max-tokens-limit 1024 --compare
"""

from __future__ import annotations

import argparse
import json
import os
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


def counter(text: str, name: str, **labels) -> float:
    """The sum of the ``name`` samples on a ``/metrics`` page whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(x.value for fam in text_string_to_metric_families(text) for x in fam.samples
               if x.name == name and all(x.labels.get(k) == v for k, v in labels.items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--headroom", type=float, default=300e6, help="budget above the weights, bytes (default 300 MB)")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt-tokens", type=int, default=800)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--port", type=int, default=18731)
    p.add_argument("--no-max-tokens", action="store_true",
                   help="chat requests without max_tokens, EOS honoured (they run to EOS or --max-tokens-limit)")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="the context's end for --no-max-tokens")
    p.add_argument("--compare", action="store_true",
                   help="run twice: every row reserving its whole max_tokens (before growth), then with growth")
    p.add_argument("--json", help="write the report here too")
    a = p.parse_args(argv)
    if a.model is None:
        from gateway.models.default_model import ensure_default_model

        a.model = str(ensure_default_model())
    budget = int(weights_bytes(a.model, a.port) + a.headroom)
    reports = []
    for quantum in (["0", None] if a.compare else [os.environ.get("MLX_GATEWAY_RESERVATION_QUANTUM")]):
        if quantum is None:
            os.environ.pop("MLX_GATEWAY_RESERVATION_QUANTUM", None)
        else:
            os.environ["MLX_GATEWAY_RESERVATION_QUANTUM"] = quantum
        report = burst(a, budget)
        report["growth"] = quantum != "0"
        reports.append(report)
        print(json.dumps(report, indent=1), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(reports if a.compare else reports[0], indent=1) + "\n")
    return 0


def burst(a, budget: int) -> dict:
    """One burst against a fresh server under ``budget`` bytes; its report."""
    limits = ["--max-tokens-limit", str(a.max_tokens_limit)] if a.no_max_tokens else ["--max-tokens", str(a.max_tokens)]
    gw = Gateway(a.model, None, None, ["--memory-budget", str(budget), *limits], a.port)
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
                if a.no_max_tokens:
                    r = c.post("/v1/chat/completions", json={"model": "chat", "temperature": 0, "messages": [
                        {"role": "user", "content": f"{i} {words}"}]})
                else:
                    r = c.post("/v1/completions", json={"model": "chat", "prompt": f"{i} {words}",
                                                        "max_tokens": a.max_tokens, "ignore_eos": True})
            body = r.json()
            usage = body.get("usage", {})
            reason = (body.get("choices") or [{}])[0].get("finish_reason")
            # complete: all its tokens (max_tokens), or without one, ended by EOS or by the context's end
            ok = r.status_code == 200 and (reason == "stop" or usage["completion_tokens"] == (
                a.max_tokens_limit if a.no_max_tokens else a.max_tokens))
            return r.status_code, r.headers.get("retry-after"), ok, usage.get("prompt_tokens"), usage.get(
                "completion_tokens", 0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        with ThreadPoolExecutor(a.requests) as pool:
            answers = list(pool.map(ask, range(a.requests)))
        seconds = time.monotonic() - started
        stop.set()
        sampler.join()
        with httpx.Client(base_url=gw.url, timeout=10) as c:  # MLX's own peak since the server started
            text = c.get("/metrics").text
            mlx_peak = max((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith('mlx_gateway_mlx_memory_bytes{kind="peak"}')), default=0.0)
    finally:
        stop.set()
        gw.close()
    report = {"model": a.model, "budget_mb": budget / 1e6, "requests": a.requests,
              "max_tokens": "none (limit %d)" % a.max_tokens_limit if a.no_max_tokens else a.max_tokens,
              "completion_tokens": sum(x[4] or 0 for x in answers),
              "preemptions": counter(text, "mlx_gateway_preemptions_total", outcome="requeued"),
              "length_ends_alone": counter(text, "mlx_gateway_preemptions_total", outcome="length"),
              "resumes_from_cache": counter(text, "mlx_gateway_preemption_resumes_total", how="cache"),
              "resumes_recomputed": counter(text, "mlx_gateway_preemption_resumes_total", how="recompute"),
              "mean_decode_batch": round(counter(text, "mlx_gateway_decode_batch_size_sum")
                                         / max(1.0, counter(text, "mlx_gateway_decode_batch_size_count")), 2),
              "prompt_tokens": answers[0][3], "seconds": round(seconds, 1),
              "statuses": {str(s): sum(1 for x in answers if x[0] == s) for s in {x[0] for x in answers}},
              "complete_200s": sum(1 for x in answers if x[2]),
              "503s_with_retry_after": sum(1 for x in answers if x[0] == 503 and x[1]),
              **{f"peak_{k}": round(v, 1) for k, v in peaks.items()}}
    report["peak_active_over_budget"] = round(peaks["mlx_active_mb"] / (budget / 1e6), 3)
    report["mlx_peak_mb"] = round(mlx_peak / 1e6, 1)  # between samples too (MLX's allocator)
    report["mlx_peak_over_budget"] = round(mlx_peak / budget, 3)
    return report


if __name__ == "__main__":
    raise SystemExit(main())
