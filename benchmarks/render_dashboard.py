"""Render the main panels of the Grafana dashboard to a PNG, without Grafana.

Starts a gateway (``mlx-gateway serve``, three tenants) and a Prometheus scraping it every
second with the project's config and rules, runs a multi-tenant chat workload of varying
load, then range-queries the panels' own PromQL (``grafana/dashboards/mlx-gateway.json``)
and draws them with matplotlib, one subplot per panel, titled as in the dashboard.

Needs ``prometheus`` on PATH and ``pip install -e ".[bench]"`` (matplotlib).

Usage::

    python benchmarks/render_dashboard.py [--model DIR] [--duration 90] [--out docs/dashboard.png]
    python benchmarks/render_dashboard.py --load benchmarks/results/dashboard.json   # re-render only
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from promstack import Prometheus, free_port, load_dashboard, substitute, words  # noqa: E402
from scenarios import gateway_cmd, serving  # noqa: E402

# Dashboard panels drawn, in grid order (titles as in the dashboard).
PANELS = ["Token hit rate", "Hit rate per tenant", "Prompt tokens saved / s", "Cache memory by group",
          "Time to first token", "Queue time", "Time per output token", "Evictions / s", "Tokens / s", "Batch sizes",
          "Running and waiting", "Memory", "Requests / s by status", "Rate limited (429) / s",
          "Usage tokens / s by tenant", "Scheduled work share"]
RATE_WINDOW = "10s"  # $__rate_interval for 1 s scrapes: ten samples per rate
TENANTS = {  # name -> (API key, tenants file settings, agents per load level)
    "alice": ("mgw-render-alice", 'cache_group = "alice"\ncache_bytes = "64M"\n', 1),
    "bob": ("mgw-render-bob", "weight = 2.0\n", 2),
    "carol": ("mgw-render-carol", "requests_per_minute = 6\n", 1),
}


# ---------------------------------------------------------------------- run
def write_tenants(path: Path) -> None:
    path.write_text("\n".join(
        f'[tenants.{name}]\nkey_sha256 = ["{hashlib.sha256(key.encode()).hexdigest()}"]\n{extra}'
        for name, (key, extra, _) in TENANTS.items()))


async def agent(url: str, name: str, key: str, n: int, stop_at: float, seed: int) -> None:
    """Multi-turn chats with the tenant's system prompt until ``stop_at`` (monotonic s)."""
    rng = random.Random(seed)
    system = f"You are {name}'s assistant. " + words(300 + 40 * n, sum(map(ord, name)))
    async with httpx.AsyncClient(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as c:
        while time.monotonic() < stop_at:
            messages = [{"role": "system", "content": system}]
            for turn in range(rng.randint(2, 6)):
                if time.monotonic() >= stop_at:
                    return
                messages.append({"role": "user", "content": words(rng.randint(20, 120), rng.randint(0, 10**6))})
                r = await c.post("/v1/chat/completions", json={
                    "messages": messages, "max_tokens": rng.randint(8, 48), "temperature": 0.7})
                if r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    messages.pop()
                    continue
                r.raise_for_status()
                messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
                await asyncio.sleep(rng.uniform(0, 0.5))


async def run_workload(url: str, duration: float) -> None:
    """Three load levels (x1, x2, x1 agents per tenant), a third of ``duration`` each."""
    for level, factor in enumerate((1, 2, 1)):
        stop_at = time.monotonic() + duration / 3
        await asyncio.gather(*(agent(url, name, key, i, stop_at, 1000 * level + 10 * i + j)
                               for j, (name, (key, _, agents)) in enumerate(TENANTS.items())
                               for i in range(agents * factor)))


def record(model: str, duration: float) -> dict:
    """Run gateway, Prometheus and the workload; return the panels' range-query results."""
    with tempfile.TemporaryDirectory() as tmp:
        tenants = Path(tmp) / "tenants.toml"
        write_tenants(tenants)
        port = free_port()
        cmd = gateway_cmd(port, "--model", model, "--tenants", str(tenants), "--prompt-concurrency", "4",
                          "--log-level", "WARNING")
        with serving(cmd, port, log=sys.stdout, cwd=ROOT, stop_wait=30) as (url, _):
            with Prometheus(f"127.0.0.1:{port}") as prom:
                time.sleep(3)
                start = time.time()
                asyncio.run(run_workload(url, duration))
                time.sleep(5)
                end = time.time()
                return {"start": start, "end": end, "panels": query_panels(prom, start, end)}

def query_panels(prom: Prometheus, start: float, end: float, step: float = 1.0) -> list[dict]:
    panels = {p["title"]: p for p in load_dashboard()["panels"] if p.get("type") == "timeseries"}
    out = []
    for title in PANELS:
        p = panels[title]
        series = []
        for t in p["targets"]:
            expr = substitute(t["expr"], {"instance": ".*", "tenant": ".*", "model": ".*"}, RATE_WINDOW)
            for s in prom.query_range(expr, start, end, step):
                legend = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: s["metric"].get(m.group(1), ""),
                                t.get("legendFormat") or "") or expr
                series.append({"legend": legend, "t": [float(x) - start for x, _ in s["values"]],
                               "v": [float(v) for _, v in s["values"]]})
        out.append({"title": title, "unit": p["fieldConfig"]["defaults"].get("unit", "short"),
                    "stack": p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] != "none",
                    "series": series})
    return out


# ---------------------------------------------------------------------- draw
def render(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    plt.style.use("dark_background")
    cols = 4
    rows = (len(data["panels"]) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.1 * rows), squeeze=False)
    fig.patch.set_facecolor("#111217")
    for ax, panel in zip(axes.flat, data["panels"]):
        ax.set_facecolor("#181b1f")
        ax.set_title(panel["title"], loc="left", fontsize=10, color="#d8d9da")
        series = sorted(panel["series"], key=lambda s: s["legend"])
        if panel["stack"] and series:
            # Stack on one time grid; a series without a point (or NaN) there adds 0.
            ts = sorted({t for s in series for t in s["t"]})
            values = [dict(zip(s["t"], s["v"])) for s in series]
            ax.stackplot(ts, *[[v if (v := d.get(t, 0.0)) == v else 0.0 for t in ts] for d in values],
                         labels=[s["legend"] for s in series], alpha=0.6)
        else:
            for s in series:
                ax.plot(s["t"], s["v"], linewidth=1.2, label=s["legend"])
        unit = panel["unit"]
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
            ax.set_ylim(0, 1.05)
        elif unit == "bytes":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 2**20:.0f} MiB"))
        elif unit == "s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s"))
        ax.set_xlim(0, data["end"] - data["start"])
        ax.tick_params(labelsize=7, colors="#8e8e8e")
        ax.grid(True, color="#2c3235", linewidth=0.5)
        for side in ax.spines.values():
            side.set_color("#2c3235")
        if series:
            ax.legend(fontsize=6.5, loc="upper left", frameon=False, ncol=2)
    for ax in axes.flat[len(data["panels"]):]:
        ax.set_visible(False)
    fig.suptitle("MLX Gateway (seconds since the workload started)", x=0.01, ha="left", fontsize=11, color="#d8d9da")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, facecolor=fig.get_facecolor())
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a small random-weight qwen3)")
    ap.add_argument("--duration", type=float, default=90, help="workload seconds (default %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    ap.add_argument("--save", type=Path, default=ROOT / "benchmarks" / "results" / "dashboard.json",
                    help="where to keep the range-query results (default %(default)s)")
    ap.add_argument("--load", type=Path, help="render these saved results instead of running")
    args = ap.parse_args()
    if args.load:
        data = json.loads(args.load.read_text())
    else:
        from scenarios import medium_model  # the same model as bench_serve.py

        model = args.model or medium_model()
        data = record(model, args.duration)
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(data))
    render(data, args.out)


if __name__ == "__main__":
    main()
