"""Serving benchmark: mlx-gateway side by side with ``mlx_lm.server``; prints figures,
asserts nothing.

Each scenario runs against a fresh server process on loopback (``benchmarks/scenarios.py``):

* ``stall``: 4 streams decoding when a 3000-token prompt arrives: their inter-token gaps
  (max, median, and median before it arrived), the long prompt's TTFT, and its TTFT
  alone (the mean of two other such prompts, one before the streams and one after).
* ``burst``: 6 concurrent chats sharing a ~600-token system prompt with different
  ~300-token user texts: the cold round's wall time, then TTFT of 2 fully cached rounds.
* ``conversation``: a 20-turn chat where each turn sends the whole history.
* ``load``: 16 agents at once, 4 turns each: output tokens/s, TTFT p50/p95, failures,
  prompt tokens computed against the ideal (every distinct prompt prefix once).
* with ``--decode``: TTFT and decode tokens/s for 1 and 8 streams, and the cost of
  constrained decoding (8 streams, 0 or 4 of them with a JSON schema).

``--compare`` runs the same workload against ``mlx_lm.server`` on the same model in the
same run (``--repeat N``: N times, the servers taking turns, each figure the median), then
prints the issue's goals as a table of ratios; ``--out DIR`` also writes ``results.json``,
``goals.md`` and ``compare.png`` (matplotlib: ``pip install -e '.[bench]'``). On Linux,
preload the system OpenBLAS (``gateway/cpu/blas.py``) for both servers. The gateway runs
with its defaults, speculative decoding included: the random model's greedy answers fall
into loops that prompt lookup drafts, so its decode steps deliver several tokens
(``--gateway-args="--speculative off"`` for plain steps); the stall scenario's gap
medians are taken over the gaps between steps, since one step's tokens arrive together.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_serve.py --compare [--out benchmarks/results] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scenarios import (  # noqa: E402
    burst, constrained, conversation, decode_speed, free_port, load, medium_model, phase_breakdown, pyplot, serving,
    stall, write_results,
)

from gateway.telemetry.request_log import read_json_log  # noqa: E402


GATEWAY_ARGS: list[str] = []  # extra `serve` flags (--gateway-args)


def gateway_cmd(model: str, port: int, pc: int) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port", str(port),
            "--prompt-concurrency", str(pc), "--decode-concurrency", "32", "--log-format", "json", *GATEWAY_ARGS]


def mlx_lm_cmd(model: str, port: int, pc: int) -> list[str]:
    return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port),
            "--prompt-concurrency", str(pc), "--decode-concurrency", "32", "--log-level", "WARNING"]


def run_server(cmd_fn, model: str, pc: int, served: str, scenarios, log_path: Path | None = None) -> dict:
    """Run ``scenarios`` against a fresh server; its output goes to ``log_path`` if given."""
    port = free_port()
    log = open(log_path, "w") if log_path else None
    try:
        with serving(cmd_fn(model, port, pc), port, log=log) as (url, _):
            return {name: asyncio.run(fn(url, served)) for name, fn in scenarios}
    finally:
        if log:
            log.close()


def median_of(results: list[dict]) -> dict:
    """Per numeric key, the median over the repeats' result dicts (non-numbers are dropped)."""
    keys = [k for k in results[0] if all(isinstance(r.get(k), (int, float)) for r in results)]
    return {k: statistics.median(r[k] for r in results) for k in keys}


def fmt(d: dict) -> str:
    return "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())


# (scenario, metric, goal as text, check on the gateway/mlx_lm ratio or on the gateway's
# own value, "ratio" or "value"): issue-13 goals, measured side by side in one run.
GOALS = [("stall", "gap_max", "<= 0.35 s", lambda v: v <= 0.35, "value"),
         ("stall", "gap_p50 / gap_alone_p50", "<= 1.5", lambda v: v <= 1.5, "value"),
         ("stall", "long_ttft", "<= 1.0x", lambda v: v <= 1.0, "ratio"),
         ("stall", "long_ttft / long_alone_ttft", "<= 1.25 (>= 0.8x alone)", lambda v: v <= 1.25, "value"),
         ("burst", "warm_ttft_p50", "<= 0.6x", lambda v: v <= 0.6, "ratio"),
         ("burst", "cold_wall", "<= 0.5x", lambda v: v <= 0.5, "ratio"),
         ("conversation", "ttft_p50", "<= 0.9x", lambda v: v <= 0.9, "ratio"),
         ("load", "tok_s", ">= 1.2x", lambda v: v >= 1.2, "ratio"),
         ("load", "ttft_p50", "<= 0.8x", lambda v: v <= 0.8, "ratio"),
         ("load", "ttft_p95", "<= 0.5x", lambda v: v <= 0.5, "ratio"),
         ("load", "errors", "0", lambda v: v == 0, "value"),
         ("load", "computed / ideal", "<= 1.05", lambda v: v <= 1.05, "value")]
SCENARIOS = {"stall": stall, "burst": burst, "conversation": conversation, "load": load}


def metric(res: dict, name: str) -> float:
    if " / " in name:
        a, b = name.split(" / ")
        return res[a] / res[b] if res[b] else float("nan")
    return res[name]


def goals_table(results: dict) -> str:
    """Markdown: each goal with both servers' figures, the ratio and whether it is met."""
    ours, theirs = results["mlx-gateway"], results.get("mlx_lm.server")
    rows = ["| scenario | metric | mlx-gateway | mlx_lm.server | ratio | goal | met |", "|---|---|---|---|---|---|---|"]
    for scenario, name, goal, ok, kind in GOALS:
        if scenario not in ours:
            continue
        a = metric(ours[scenario], name)
        b = metric(theirs[scenario], name) if theirs and scenario in theirs else float("nan")
        ratio = a / b if b else float("nan")
        judged = ratio if kind == "ratio" else a
        met = "yes" if judged == judged and ok(judged) else "no"
        shown = f"{ratio:.2f}" if ratio == ratio else ""  # no ratio of a zero (errors: 0 and 0)
        rows.append(f"| {scenario} | {name} | {a:.3f} | {b:.3f} | {shown} | {goal} | {met} |")
    return "\n".join(rows)


def plot(results: dict, path: Path) -> bool:
    """Bar charts of each scenario's figures for both servers (needs matplotlib)."""
    plt = pyplot()
    if plt is None:
        return False
    panels = [("stall", ["gap_max", "gap_p50", "long_ttft"], "seconds"),
              ("burst", ["cold_wall", "cold_ttft_p50", "warm_ttft_p50", "warm_ttft_p95"], "seconds"),
              ("conversation", ["ttft_p50", "ttft_p95"], "seconds"), ("load", ["ttft_p50", "ttft_p95"], "seconds"),
              ("load", ["tok_s"], "output tokens/s")]
    panels = [p for p in panels if p[0] in results["mlx-gateway"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    axes = list(axes[0])
    for ax, (scenario, names, unit) in zip(axes, panels):
        for k, (server, res) in enumerate(results.items()):
            vals = [res[scenario][n] for n in names]
            ax.bar([i + 0.4 * k for i in range(len(names))], vals, width=0.4, label=server)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
        ax.set_title(scenario)
        ax.set_ylabel(unit)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a tiny qwen3 demo model)")
    ap.add_argument("--prompt-concurrency", type=int, default=8, help="for both servers (default %(default)s)")
    ap.add_argument("--compare", action="store_true", help="also run mlx_lm.server on the same model")
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--decode", action="store_true", help="also the decode scenarios (single, concurrent, "
                    "constrained) on the gateway")
    ap.add_argument("--repeat", type=int, default=1, help="run each scenario this many times per server, "
                    "servers taking turns; each figure is the median (default %(default)s)")
    ap.add_argument("--out", type=Path, help="write results.json, goals.md and compare.png here")
    ap.add_argument("--gateway-args", default="", help="extra flags for `mlx-gateway serve`, e.g. "
                    "'--prefill-budget 0'")
    args = ap.parse_args()
    GATEWAY_ARGS.extend(args.gateway_args.split())

    model = args.model or medium_model()
    print(f"model: {model}")
    if args.decode:
        res = run_server(gateway_cmd, model, 8, model, [("single", lambda u, m: decode_speed(u, m, 1)),
                                                        ("concurrent8", lambda u, m: decode_speed(u, m, 8)),
                                                        ("constrained", constrained)])
        for k, v in res.items():
            print(f"mlx-gateway    {k:12s} {fmt(v)}")

    servers = [("mlx-gateway", gateway_cmd)] + ([("mlx_lm.server", mlx_lm_cmd)] if args.compare else [])
    runs: dict = {name: {} for name, _ in servers}  # name -> key -> [one result per repeat]
    for _ in range(args.repeat):
        # Servers take turns per scenario, so that a slow minute of a noisy machine falls on
        # both; a fresh server per scenario, so that no scenario starts with another's cache.
        for scenario in args.scenarios:
            for name, cmd in servers:
                with tempfile.TemporaryDirectory() as tmp:
                    log_path = Path(tmp) / "server.log" if name == "mlx-gateway" else None  # its phases and choices
                    res = run_server(cmd, model, args.prompt_concurrency, model, [(scenario, SCENARIOS[scenario])],
                                     log_path)
                    print(f"{name:14s} {scenario:12s} {fmt(res[scenario])}", flush=True)
                    if log_path is not None:  # what the gateway chose at load on this machine
                        for rec in read_json_log(log_path):
                            message = rec.get("message", "")
                            if "chosen by measurement" in message or "prefill forward costs" in message:
                                print(f"{'':14s} {message}", flush=True)
                        if scenario in ("burst", "conversation"):
                            res[f"{scenario}_warm_phases"] = phase_breakdown(log_path)
                            print(f"{'':14s} {scenario + ' warm-hit phases (median s)':12s} "
                                  f"{fmt(res[f'{scenario}_warm_phases'])}", flush=True)
                for key, value in res.items():
                    runs[name].setdefault(key, []).append(value)
    results = {name: {key: median_of(values) for key, values in by_key.items()} for name, by_key in runs.items()}
    if args.repeat > 1:
        for name in results:
            for scenario in args.scenarios:
                print(f"{name:14s} {scenario:12s} median of {args.repeat}: {fmt(results[name][scenario])}")
    table = goals_table(results)
    print(table)
    if args.out:
        write_results(args.out, {"results.json": results, "goals.md": table})
        if not plot(results, args.out / "compare.png"):
            print("matplotlib is not installed: no plot (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
