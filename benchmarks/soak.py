"""Soak: mixed traffic against a real gateway for a given time, with its memory and its
leak counters sampled throughout.

The gateway is started here (``mlx-gateway serve`` in a subprocess) with a models file:
the text model (pinned), a second entry of it that is loaded and unloaded through the
admin API while traffic runs, and, when given, a vision model and an embedding model.
Workers then send, at random: agent sessions with tools (a tool call and its result in
the history) through chat completions, Messages and Responses (the latter chained by
``previous_response_id``), requests with an image (vision model), embeddings (embedding
model), chats switching between LoRA adapters and the base (``--adapter``), streams
cancelled after their first chunk, and bad inputs (which must get a 4xx, never a 5xx).

Every ``--sample-every`` seconds it records the process's resident memory, MLX's active
memory, the prefix caches' bytes, open leases, engine rows, asyncio tasks, threads and
open file descriptors (``/metrics``; see docs/metrics.md), and the bytes of first-token
log-probabilities kept for exact repeats (bounded, but part of MLX's active memory). The verdict:

* **RSS plateau**: the samples after the warm-up are cut in three windows, and the growth
  is ``median(last window) / median(first window) - 1``; medians of windows, not two
  samples, so one allocation burst or one freed arena does not decide it. The least-squares
  slope (MB per hour) is printed alongside, and the same growth of two parts of it: what
  lies outside MLX's allocator, and about what is held (RSS less the bytes glibc's malloc
  keeps free, ``mlx_gateway_heap_free_bytes``: exact while no idle trim has run, which
  steady traffic never leaves time for). On MLX's CPU backend the arrays are malloc'd,
  so the batch's freed buffers stay in the heap as free chunks that the RSS counts: a
  growth in RSS that the held part does not show is the allocator keeping memory, not a
  leak.
* **No leaks**: once traffic stops and the server is quiet, leases and rows are 0, and
  tasks, threads and descriptors are back to what they were at a quiet point after the
  warm-up (a first Responses call opens its store, a first load starts a thread: the
  warm-up pays those, so what is left after the soak is a leak).

Usage::

    python benchmarks/soak.py --model default --duration 7200 --plot soak.png
    python benchmarks/soak.py --model DIR --vision-model VLM_DIR --embedding-model EMB_DIR --duration 600

``--plot`` needs matplotlib (the ``bench`` extra); without it the table is printed alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_traffic import Traffic  # noqa: E402

COLUMNS = ("rss_mb", "heap_free_mb", "heap_used_mb", "py_blocks_k", "mlx_active_mb", "mlx_free_mb", "cache_mb", "first_tok_mb", "leases", "rows", "tasks", "threads", "fds")
MLX_KINDS = {"active": "mlx_active_mb", "cache": "mlx_free_mb"}  # mlx_memory_bytes{kind}: freed buffers MLX keeps
SERIES = {  # /metrics series -> (column, divisor)
    "mlx_gateway_mlx_memory_bytes": (None, 1e6), "mlx_gateway_prompt_cache_bytes": ("cache_mb", 1e6),
    "mlx_gateway_heap_free_bytes": ("heap_free_mb", 1e6),  # glibc only: freed, kept by malloc, in the RSS
    "mlx_gateway_heap_used_bytes": ("heap_used_mb", 1e6), "mlx_gateway_python_blocks": ("py_blocks_k", 1e3),
    "mlx_gateway_first_token_store_bytes": ("first_tok_mb", 1e6),  # bounded: scheduler/batch/first_tokens.py
    "mlx_gateway_prompt_cache_active_leases": ("leases", 1), "mlx_gateway_engine_rows": ("rows", 1),
    "mlx_gateway_asyncio_tasks": ("tasks", 1), "mlx_gateway_threads": ("threads", 1), "mlx_gateway_open_fds": ("fds", 1)}


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid``, bytes (``/proc`` on Linux, else ``ps``)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout
        return int(out.strip() or 0) * 1024


def parse_metrics(text: str) -> dict:
    """The soak's columns but RSS from a ``/metrics`` page (sums over models and groups)."""
    sums: Counter = Counter()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in SERIES:
                column, divisor = SERIES[s.name]
                column = column or MLX_KINDS.get(s.labels.get("kind"))
                if column:
                    sums[column] += s.value / divisor
    return dict(sums)


class Gateway:
    """``mlx-gateway serve`` with the soak's models file, in a subprocess."""

    def __init__(self, model: str, vision: Optional[str], embedding: Optional[str], args: list[str], port: int,
                 adapters: tuple[str, ...] = ()):
        self.dir = tempfile.TemporaryDirectory(prefix="soak-")
        self.adapters = tuple(f"a{i}" for i in range(len(adapters)))
        lora = ", ".join(f'{n} = "{a}"' for n, a in zip(self.adapters, adapters))
        lines = [f'[models.chat]\npath = "{model}"\npin = true\n' + (f"lora_modules = {{ {lora} }}\n" if lora else ""),
                 f'[models.spare]\npath = "{model}"\n']
        if vision:
            lines.append(f'[models.vision]\npath = "{vision}"\nkind = "vision"\npin = true\n')
        if embedding:
            lines.append(f'[models.embed]\npath = "{embedding}"\nkind = "embedding"\npin = true\n')
        models = Path(self.dir.name) / "models.toml"
        models.write_text("\n".join(lines))
        self.vision, self.embedding = bool(vision), bool(embedding)
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(Path(self.dir.name) / "gateway.log", "w+")
        env = dict(os.environ, MLX_GATEWAY_DATA_DIR=self.dir.name)
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--models", str(models),
                                      "--port", str(port), "--log-level", "warning", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError("the gateway exited:\n" + self.output())
                try:
                    if c.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise TimeoutError("the gateway did not become healthy:\n" + self.output())

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        self.dir.cleanup()


async def sample(gw: Gateway, client: httpx.AsyncClient, t0: float) -> dict:
    r = await client.get("/metrics")
    row = {"t": round(time.monotonic() - t0, 1), "rss_mb": rss_bytes(gw.proc.pid) / 1e6, **parse_metrics(r.text)}
    return {k: row.get(k, 0.0) for k in ("t", *COLUMNS)}


async def quiet(gw: Gateway, client: httpx.AsyncClient, t0: float, timeout: float = 60) -> dict:
    """A sample once no row runs and no lease is held (and tasks have settled), or at ``timeout``."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        row = await sample(gw, client, t0)
        if row["rows"] == 0 and row["leases"] == 0 and last is not None and row["tasks"] == last["tasks"]:
            return row
        last = row
    return await sample(gw, client, t0)


def growth(values: list[float]) -> float:
    """``median(last third) / median(first third) - 1`` (0 with fewer than 3 values)."""
    if len(values) < 3:
        return 0.0
    k = len(values) // 3
    first, last = statistics.median(values[:k]), statistics.median(values[-k:])
    return last / first - 1 if first else 0.0


def slope_per_hour(ts: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``ts`` (seconds), per hour."""
    if len(ts) < 2:
        return 0.0
    mt, mv = statistics.fmean(ts), statistics.fmean(values)
    den = sum((t - mt) ** 2 for t in ts)
    return 3600 * sum((t - mt) * (v - mv) for t, v in zip(ts, values)) / den if den else 0.0


async def soak(gw: Gateway, duration: float, warmup: float, workers: int, sample_every: float,
               load_every: float, seed: int = 0) -> dict:
    """Warm up, take a quiet baseline, soak for ``duration`` seconds sampling every
    ``sample_every``, then take the quiet end; the report (see the module docstring)."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=gw.url, timeout=120) as probe:
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as c:
            warm = Traffic(gw, c, seed)
            for name in warm.scenarios:  # every path once, then the mix
                await getattr(warm, name)()
            await warm.load_cycle()
            await warm.run(warmup, workers, load_every)
        baseline = await quiet(gw, probe, t0)
        samples: list[dict] = []
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as c:
            traffic = Traffic(gw, c, seed + 1)
            main = asyncio.ensure_future(traffic.run(duration, workers, load_every))
            while not main.done():
                samples.append(await sample(gw, probe, t0))
                await asyncio.wait({main}, timeout=sample_every)
            await main
            await traffic.unload()
        final = await quiet(gw, probe, t0)
    rss = [s["rss_mb"] for s in samples]
    return {
        "samples": samples, "baseline": baseline, "final": final,
        "rss_growth": growth(rss), "outside_mlx_growth": growth([outside_mlx(s) for s in samples]),
        "held_growth": growth([s["rss_mb"] - s["heap_free_mb"] for s in samples]),
        "heap_used_growth": growth([s["heap_used_mb"] for s in samples]),
        "py_blocks_growth": growth([s["py_blocks_k"] for s in samples]),
        "rss_mb_per_hour": slope_per_hour([s["t"] for s in samples], rss),
        "leaks": {"leases": final["leases"], "rows": final["rows"],
                  **{k: final[k] - baseline[k] for k in ("tasks", "threads", "fds")}},
        "statuses": {f"{n} {s}": k for (n, s), k in sorted((warm.statuses + traffic.statuses).items())},
        "failures": warm.failures + traffic.failures,
    }


def outside_mlx(sample: dict) -> float:
    """RSS not held by MLX's allocator (live arrays or freed buffers it keeps), MB: the
    interpreter's heap, the libraries', the tokenizers', and on MLX's CPU backend the
    arrays' freed buffers that malloc keeps (``heap_free_mb``)."""
    return sample["rss_mb"] - sample["mlx_active_mb"] - sample["mlx_free_mb"]


def table(report: dict, rows: int = 30) -> str:
    samples = report["samples"]
    step = max(1, len(samples) // rows)
    shown = samples[::step] + ([samples[-1]] if samples and (len(samples) - 1) % step else [])
    lines = ["t_s     " + " ".join(f"{c:>13}" for c in COLUMNS)]
    for name, s in [("base", report["baseline"]), *((f"{s['t']:<7}", s) for s in shown), ("end", report["final"])]:
        lines.append(f"{name:<8}" + " ".join(f"{s[c]:>13.1f}" for c in COLUMNS))
    return "\n".join(lines)


def plot(report: dict, path: str) -> bool:
    """Plot every column over time into ``path``; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    samples = report["samples"]
    fig, axes = plt.subplots(len(COLUMNS), 1, figsize=(9, 2 * len(COLUMNS)), sharex=True)
    for ax, col in zip(axes, COLUMNS):
        ax.plot([s["t"] for s in samples], [s[col] for s in samples])
        ax.set_ylabel(col)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="the text model (a directory, hub id, default or demo)")
    p.add_argument("--vision-model", help="also serve this vision model and send it images")
    p.add_argument("--embedding-model", help="also serve this embedding model and send it embeddings")
    p.add_argument("--duration", type=float, default=600, help="seconds of traffic after the warm-up")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up traffic (default: 10%% of the duration, at least 20)")
    p.add_argument("--workers", type=int, default=4, help="concurrent clients")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--load-every", type=float, default=30.0, help="seconds between two load/unload cycles of the spare model")
    p.add_argument("--adapter", action="append", default=[], help="serve this LoRA adapter on the text model and switch between it, the others and the base (repeatable)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--gateway-arg", action="append", default=[], help="one more argument for serve (repeatable)")
    p.add_argument("--plot", help="write the plot to this PNG (needs matplotlib)")
    p.add_argument("--json", help="write the samples and the verdict to this file")
    ns = p.parse_args(argv)
    gw = Gateway(ns.model, ns.vision_model, ns.embedding_model, ns.gateway_arg, ns.port, tuple(ns.adapter))
    try:
        gw.wait_healthy()
        warmup = ns.warmup if ns.warmup is not None else max(20.0, ns.duration / 10)
        report = asyncio.run(soak(gw, ns.duration, warmup, ns.workers, ns.sample_every, ns.load_every))
    finally:
        gw.close()
    print(table(report))
    print(f"RSS growth (median of the last third / first third after warm-up): {100 * report['rss_growth']:+.2f} %;"
          f" slope {report['rss_mb_per_hour']:+.1f} MB/h; outside MLX's allocator"
          f" {100 * report['outside_mlx_growth']:+.2f} %; held, about (RSS less the heap's free bytes)"
          f" {100 * report['held_growth']:+.2f} %; heap in use {100 * report['heap_used_growth']:+.2f} %;"
          f" Python's blocks {100 * report['py_blocks_growth']:+.2f} %")
    print("left once quiet:", report["leaks"])
    print("answers:", report["statuses"])
    for f in report["failures"]:
        print("unexpected:", f)
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1))
    if ns.plot and not plot(report, ns.plot):
        print("no plot: matplotlib is not installed (pip install 'mlx-gateway[bench]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
