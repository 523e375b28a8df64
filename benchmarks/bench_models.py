"""Two models in one gateway against two single-model gateways; prints figures, asserts nothing.

Two different random-weight models of the benchmark's medium size (``scenarios.MEDIUM``,
float32): A is qwen3 (seed 0, the other benchmarks' model), B is llama with the same sizes
(seed 1). Two setups, each started fresh as subprocesses (``benchmarks/scenarios.py``):

* ``one gateway``: ``mlx-gateway serve --model A --model B``: one engine thread steps both
  models' batches;
* ``two gateways``: ``serve --model A`` and ``serve --model B`` on two ports, running at
  the same time.

The same workload runs against both, for ``--seconds`` (default 30): two client groups at
once, each client sending its next request as soon as its last one ended (requests begun
before the deadline run to their end), greedy, streamed over the OpenAI chat API:

* model A, chat: 4 clients, each request a fresh ~200-token user message, 64-token answers;
* model B, agents: 2 clients, each request ~1500 tokens: the client's own ~1100-token
  system prompt (the same on every request, so the prefix cache serves it after the first)
  and a fresh ~400-token user message, 32-token answers.

EOS (and, on the demo tokenizer, partial UTF-8 byte tokens) is banned with ``logit_bias``, so
every answer has its full length. Figures per setup: output tokens/s of both models together
and of each (tokens over the group's wall time), TTFT p50/p95 per model (request sent to first
content chunk), requests and failures, and peak RSS of the server process(es), summed over the
two gateways: ``VmHWM`` of ``/proc/PID/status`` on Linux, else the largest RSS sampled every
0.2 s (``soak.rss_bytes``: ``ps -o rss``; the table says which). The table shows both setups and
the ratio one gateway / two gateways. ``--repeat N`` runs the setups N times, taking turns,
each figure the median; ``--out DIR`` writes ``models.json`` and ``models.md``. On Linux,
preload the system OpenBLAS (``gateway/cpu/blas.py``).

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_models.py [--seconds 30] [--repeat 1] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios import (  # noqa: E402
    MEDIUM, free_port, long_text, medium_model, start, steady_stream_bias, stream_chat, summarize, words, write_results,
)
from soak import rss_bytes  # noqa: E402

CHAT = {"clients": 4, "prompt": 200, "answer": 64}
AGENT = {"clients": 2, "system": 1100, "user": 400, "answer": 32}


def second_model() -> str:
    """Directory of model B: llama with the medium sizes, seed 1 (built once, in the temp directory)."""
    from gateway.models.demo_model import build_model_dir

    return str(build_model_dir(Path(tempfile.gettempdir()) / "mlx-gateway-bench-llama-medium", "llama",
                               seed=1, overrides=MEDIUM))


def gateway_cmd(models: list[str], port: int) -> list[str]:
    """``mlx-gateway serve`` for ``models`` on ``port``, with bench_serve.py's batch sizes."""
    flags = [f for m in models for f in ("--model", m)]
    return [sys.executable, "-m", "gateway.cli", "serve", *flags, "--port", str(port),
            "--prompt-concurrency", "8", "--decode-concurrency", "32", "--log-format", "json"]


class PeakRss:
    """Peak resident memory of a process: VmHWM on Linux, else RSS sampled every 0.2 s."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.method = "VmHWM" if Path(f"/proc/{pid}/status").exists() else "ps -o rss sampled"
        if self.method != "VmHWM":
            threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except Exception:  # the process ended
                return

    def read(self) -> int:
        """Peak bytes so far (call before the process ends)."""
        self._stop.set()
        if self.method == "VmHWM":
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return self.peak


async def client_loop(url: str, model: str, deadline: float, make_messages, answer: int, bias: dict,
                      out: list, errors: list) -> None:
    """Send ``make_messages(k)`` for k = 0, 1, ... back to back until ``deadline``."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        k = 0
        while time.monotonic() < deadline:
            try:
                out.append(await stream_chat(c, make_messages(k), answer, model, logit_bias=bias))
            except httpx.HTTPError as e:
                errors.append(f"{model}: {type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
            k += 1


async def workload(urls: dict[str, str], a: str, b: str, seconds: float, prompts: dict) -> dict:
    """Both client groups at once for ``seconds``: figures per model and in total."""
    # One short request per model first, so that no first-call cost falls in the window.
    for m in (a, b):
        async with httpx.AsyncClient(base_url=urls[m], timeout=600) as c:
            await stream_chat(c, [{"role": "user", "content": "hello"}], 4, m)
    res = {m: [] for m in (a, b)}
    errors: list[str] = []
    ends = {}

    async def group(m: str, n: int, make, answer: int) -> None:
        await asyncio.gather(*(client_loop(urls[m], m, deadline, make(i), answer, prompts["bias"], res[m], errors)
                               for i in range(n)))
        ends[m] = time.monotonic()

    chat = lambda i: lambda k: [{"role": "user", "content": words(prompts["chat_words"], 1000 * i + k)}]  # noqa: E731
    agent = lambda i: lambda k: [{"role": "system", "content": prompts["systems"][i]},  # noqa: E731
                                 {"role": "user", "content": words(prompts["user_words"], 50_000 + 1000 * i + k)}]
    t0 = time.monotonic()
    deadline = t0 + seconds
    await asyncio.gather(group(a, CHAT["clients"], chat, CHAT["answer"]),
                         group(b, AGENT["clients"], agent, AGENT["answer"]))
    out = {"errors": len(errors), "first_error": errors[0] if errors else ""}
    for tag, m in (("A", a), ("B", b)):
        s = summarize(res[m], ends[m] - t0) if res[m] else {"tok_s": 0.0, "ttft_p50": float("nan"),
                                                           "ttft_p95": float("nan"), "cached_frac": 0.0}
        out.update({f"{tag}_tok_s": s["tok_s"], f"{tag}_ttft_p50": s["ttft_p50"], f"{tag}_ttft_p95": s["ttft_p95"],
                    f"{tag}_requests": len(res[m]), f"{tag}_cached_frac": s["cached_frac"],
                    f"{tag}_prompt_tokens": statistics.median(r["prompt"] for r in res[m]) if res[m] else 0})
    out["total_tok_s"] = out["A_tok_s"] + out["B_tok_s"]
    return out


def run_setup(groups: list[list[str]], a: str, b: str, seconds: float, prompts: dict) -> dict:
    """Start one gateway per entry of ``groups`` (the models it serves), run the workload,
    read peak RSS, stop them. A server that fails to start has its output printed."""
    procs, urls, rss, logs = [], {}, [], []
    try:
        for models in groups:
            port = free_port()
            log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
            logs.append(log)
            try:
                proc, _ = start(gateway_cmd(models, port), port, log=log)
            except RuntimeError:
                log.flush()
                print(f"server failed: {' '.join(gateway_cmd(models, port))}\n{Path(log.name).read_text()[-4000:]}",
                      file=sys.stderr)
                raise
            procs.append(proc)
            rss.append(PeakRss(proc.pid))
            urls.update({m: f"http://127.0.0.1:{port}" for m in models})
        res = asyncio.run(workload(urls, a, b, seconds, prompts))
        res["peak_rss_mib"] = sum(r.read() for r in rss) / 2**20
        res["rss_method"] = rss[0].method
        if res["errors"]:
            for log in logs:
                log.flush()
                res.setdefault("server_log_tail", []).append(Path(log.name).read_text()[-2000:])
        return res
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()
            os.unlink(log.name)


ROWS = [("total_tok_s", "output tokens/s, both models", "{:.1f}"),
        ("A_tok_s", "A (chat) output tokens/s", "{:.1f}"), ("A_ttft_p50", "A TTFT p50 (s)", "{:.3f}"),
        ("A_ttft_p95", "A TTFT p95 (s)", "{:.3f}"), ("A_requests", "A requests", "{:.0f}"),
        ("B_tok_s", "B (agents) output tokens/s", "{:.1f}"), ("B_ttft_p50", "B TTFT p50 (s)", "{:.3f}"),
        ("B_ttft_p95", "B TTFT p95 (s)", "{:.3f}"), ("B_requests", "B requests", "{:.0f}"),
        ("peak_rss_mib", "peak RSS of the server(s), MiB", "{:.0f}"), ("errors", "failed requests", "{:.0f}")]


def table(results: dict, rss_method: str) -> str:
    """Markdown: each figure for both setups and the ratio one / two gateways."""
    one, two = results["one gateway"], results["two gateways"]
    rows = ["| figure | one gateway (A+B) | two gateways (A, B) | ratio one/two |", "|---|---|---|---|"]
    for key, name, f in ROWS:
        name = name + f" ({rss_method}, summed)" if key == "peak_rss_mib" else name
        ratio = f"{one[key] / two[key]:.2f}" if two[key] else ""
        rows.append(f"| {name} | {f.format(one[key])} | {f.format(two[key])} | {ratio} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30, help="workload duration per setup (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1, help="run the setups this many times, taking turns; "
                    "each figure is the median (default %(default)s)")
    ap.add_argument("--out", type=Path, help="write models.json and models.md here")
    args = ap.parse_args()

    a, b = medium_model(), second_model()
    print(f"model A: {a}\nmodel B: {b}")
    chat_words = len(long_text(a, CHAT["prompt"], 0).split())
    user_words = len(long_text(b, AGENT["user"], 0).split())
    prompts = {"bias": steady_stream_bias(a), "chat_words": chat_words, "user_words": user_words,
               "systems": [long_text(b, AGENT["system"], 900 + i) for i in range(AGENT["clients"])]}
    assert steady_stream_bias(b) == prompts["bias"], "the two models should share the demo tokenizer"
    setups = {"one gateway": [[a, b]], "two gateways": [[a], [b]]}
    runs: dict = {name: [] for name in setups}
    for rep in range(args.repeat):
        order = list(setups) if rep % 2 == 0 else list(setups)[::-1]
        for name in order:
            res = run_setup(setups[name], a, b, args.seconds, prompts)
            runs[name].append(res)
            print(f"{name:13s} " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in res.items() if k != "server_log_tail"), flush=True)
            if res["errors"]:
                print("\n".join(res.get("server_log_tail", [])), file=sys.stderr)
    results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
               for name, rs in runs.items()}
    rss_method = runs["one gateway"][0]["rss_method"]
    md = (f"Two models ({args.seconds:g} s, {'median of ' + str(args.repeat) if args.repeat > 1 else 'one run'}): "
          f"A {CHAT['clients']} chat clients, B {AGENT['clients']} agent clients\n\n" + table(results, rss_method))
    print(md)
    if args.out:
        write_results(args.out, {"models.json": {"seconds": args.seconds, "repeat": args.repeat, "rss_method": rss_method,
                                                 "chat": CHAT, "agent": AGENT, "results": results, "runs": runs},
                                 "models.md": md})


if __name__ == "__main__":
    main()
