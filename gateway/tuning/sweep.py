"""The settings ``mlx-gateway tune`` tries, each against a fresh ``serve`` process,
within a time budget, and the one it recommends.

One flag at a time around the base setting (the flags given, else ``serve``'s
defaults): ``--prompt-concurrency`` (prompts prefilled together), ``--prefill-step-size``
(tokens per prompt per step with nothing decoding) and ``--prefill-budget`` (seconds a
prefill step may take beside decoding streams: the chunk sizes; 0 turns chunking off).
The flags take turns, so a budget that runs out still leaves a few values of each. A
setting is skipped when the time spent plus the slowest run so far (with its start-up)
would pass ``budget`` seconds.

:func:`recommend`: the most output tokens/s among the settings with no failed request,
an inter-token gap p99 within ``max_gap`` seconds and a TTFT p95 within 25 % of the best;
else the lowest TTFT p95.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import httpx

from gateway.tuning.workload import Request, run_workload

FLAGS = ("prompt_concurrency", "prefill_step_size", "prefill_budget")
SWEEP = {"prompt_concurrency": [1, 2, 4, 8], "prefill_step_size": [512, 1024, 2048, 4096],
         "prefill_budget": [0.0, 0.1, 0.2, 0.4]}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Result:
    """One setting and its figures (:func:`gateway.tuning.workload.run_workload`'s), or
    why it did not run (``skipped``)."""

    setting: dict
    figures: dict = field(default_factory=dict)
    skipped: Optional[str] = None
    start_s: float = 0.0


def settings(base: dict, sweep: dict = SWEEP) -> list[dict]:
    """The base setting, then one flag changed at a time, the flags taking turns."""
    out = [dict(base)]
    columns = [[{**base, k: v} for v in values if v != base[k]] for k, values in sweep.items()]
    for i in range(max(map(len, columns), default=0)):
        out += [col[i] for col in columns if i < len(col)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, setting: dict, extra: list[str],
                 timeout: float = 600) -> tuple[subprocess.Popen, int, float]:
    """``mlx-gateway serve`` of ``model`` with ``setting``; returns (process, port,
    seconds until ``/health`` answered 200).

    Raises:
        RuntimeError: it exited or did not become healthy within ``timeout``.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--served-model-name", "tune",
           "--port", str(port), "--log-level", "WARNING", "--no-precompute-next-turn", *extra]
    for k in FLAGS:
        cmd += [flag(k), str(setting[k])]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited ({proc.returncode}): {proc.stderr.read().decode()[-800:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port, time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"serve did not become healthy within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def sweep(model: str, requests: list[Request], token_prompts: list[list[int]], bias: dict, base: dict,
          budget: float, extra: list[str] = (), timeout: Optional[float] = None,
          on_result: Optional[Callable[[int, int, Result, float], None]] = None,
          values: dict = SWEEP) -> list[Result]:
    """Run the workload against each setting of :func:`settings` within ``budget`` seconds.

    Args:
        timeout: seconds one run may take (its unfinished requests count as failed);
            None: three times the base setting's run, at least 60.
        on_result: called after each setting with ``(index, count, result, elapsed)``.
    """
    todo = settings(base, values)
    results: list[Result] = []
    t0 = time.monotonic()
    slowest = 0.0
    for i, s in enumerate(todo):
        elapsed = time.monotonic() - t0
        if results and elapsed + slowest > budget:
            r = Result(s, skipped=f"time budget ({budget:.0f} s) spent")
        else:
            r = Result(s)
            tic = time.monotonic()
            try:
                proc, port, r.start_s = start_server(model, s, list(extra))
            except RuntimeError as e:
                r.skipped = str(e).splitlines()[0][:200]
            else:
                try:
                    limit = timeout or max(60.0, 3 * results[0].figures.get("wall_s", 20.0) if results else 600.0)
                    r.figures = asyncio.run(run_workload(f"http://127.0.0.1:{port}", "tune", requests, token_prompts,
                                                         bias, limit))
                finally:
                    stop_server(proc)
            slowest = max(slowest, time.monotonic() - tic)
        results.append(r)
        if on_result is not None:
            on_result(i, len(todo), r, time.monotonic() - t0)
    return results


def recommend(results: list[Result], max_gap: float) -> Optional[Result]:
    """The setting to use (see the module docstring); None when none ran."""
    ran = [r for r in results if r.figures and r.figures.get("ttft_p95") == r.figures.get("ttft_p95")]
    if not ran:
        return None
    best_p95 = min(r.figures["ttft_p95"] for r in ran)
    ok = [r for r in ran if not r.figures["failed"] and r.figures["gap_p99"] <= max_gap
          and r.figures["ttft_p95"] <= 1.25 * best_p95]
    if ok:
        return max(ok, key=lambda r: r.figures["tok_s"])
    return min(ran, key=lambda r: (r.figures["failed"], r.figures["ttft_p95"]))


def flags_of(setting: dict) -> str:
    """The ``serve`` flags of a setting."""
    return " ".join(f"{flag(k)} {setting[k]}" for k in FLAGS)
