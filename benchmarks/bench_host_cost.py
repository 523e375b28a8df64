"""The engine's host cost per decode step (everything outside the model's forward),
split by phase, against mlx-lm's ``BatchGenerator`` loop on the same model in the same
process and, with ``--http``, against ``mlx_lm.server`` over HTTP; prints figures and
ratios, asserts nothing.

The model's forward is made negligible on purpose (``--model tiny``: the 2-layer test
model of ``tests/conftest.py``, a few hundred microseconds a step; ``medium``: the
benchmarks' medium model, ``benchmarks/scenarios.py``; or a model directory), so what a
step costs beyond it is the host's: Python bookkeeping, graph building, sampling, stop
checks, the hop to the event loop, and over HTTP detokenizing and SSE.

For each ``--streams`` count S, each side decodes S greedy streams of ``--decode``
tokens (distinct random prompts of ``--prompt`` tokens, EOS never ending them) in turns:

* forward: S rows' forward and argmax alone, evaluated each step (a prefilled mlx-lm
  ``KVCache``), no pipelining: what a step cannot cost less than;
* mlx-lm: ``BatchGenerator.next_generated`` in a loop (what ``batch_generate`` runs);
* engine: :class:`scheduler.Engine` (speculation off), each stream a
  :class:`gateway.conversation.generation.Generation` read by a task on this thread's
  asyncio loop, so the hop from the engine thread to the event loop is counted;
* with ``--http``: ``mlx-gateway serve`` and ``mlx_lm.server`` streaming
  ``/v1/completions`` to S concurrent clients.

A step's time is read from the window where every stream was decoding: its length over
the steps in it (``host_cost_http.steady_step``); host cost is a step's time less the
forward's. Over HTTP each side's throughput is printed too: all its tokens over the wall
time from the requests to the last token. Each repetition has
two passes, in turns: a timing pass with no timers in this process, which gives the
rates and every ratio of them, and a profiled pass of mlx-lm's side and the engine, with
timers wrapped around their functions for the pass only (:class:`Phases`; exclusive
time, a phase's callees not counted in it; serving carries no timing code of its own),
which gives the split by phase and the host CPU beyond the forward (the forward's phases
subtracted). Over HTTP one gateway serves both, its timers installed for its profiled
runs alone (``phases.py``'s ``serve_profiled``), which take turns with the others in the
timing pass; its profiled rate and its process's CPU per token (every server's is taken,
from ``/proc``: what wall time on a loaded machine hides), printed beside, show the timers'
own cost. The forward's own compute shows up as "wait for the step's result"
(``mx.eval``/``tolist``). Figures are medians of ``--repeat`` runs, the sides alternating
within a pass; ratios are of the medians.

Usage::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/bench_host_cost.py [--model tiny|medium|DIR] [--streams 1,4,16,32] \\
        [--decode 128] [--repeat 3] [--http] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from host_cost_http import DROPS, HTTP, http_streams, raw_streams, serve_env, steady_share, steady_step, throughput  # noqa: E402
from phases import FORWARD_PHASES, Phases, install, per_step, switch_served_timers  # noqa: E402


# ----------------------------------------------------------------------------- the sides
def prompts(vocab: int, streams: int, n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 1) for _ in range(n)] for _ in range(streams)]


def forward_only(model, rows: list[list[int]], decode: int) -> float:
    """Seconds per step of the rows' forward and argmax alone, evaluated each step."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(rows), cache=cache)
    y = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(y)
    t = time.perf_counter()
    for _ in range(decode - 1):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    return (time.perf_counter() - t) / (decode - 1)


def thread_cpu(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has run so far (Linux, macOS: its pthread CPU clock)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def process_cpu(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far, all its threads (``/proc``, in 10 ms
    ticks; NaN where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def mlx_lm_side(model, rows: list[list[int]], decode: int) -> float:
    from mlx_lm.generate import BatchGenerator

    from scheduler.sampling import greedy

    gen = BatchGenerator(model, max_tokens=decode, stop_tokens=None, sampler=greedy,
                         completion_batch_size=max(32, len(rows)), prefill_batch_size=8)
    gen.insert(rows, [decode] * len(rows))
    stamps: dict[int, list[float]] = defaultdict(list)
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            stamps[r.uid].append(now)
    gen.close()
    return steady_step(list(stamps.values()))


def engine_side(engine, rows: list[list[int]], decode: int) -> float:
    from gateway.conversation.generation import Generation
    from scheduler import SamplingParams
    from scheduler.request import TokenEvent

    async def run() -> float:
        params = SamplingParams(max_tokens=decode, ignore_eos=True)
        gens = [Generation(f"h-{uuid.uuid4().hex[:12]}", engine, r, params, []) for r in rows]
        stamps: list[list[float]] = []

        async def read(g) -> None:
            mine = []
            async for ev in g.events():
                if isinstance(ev, TokenEvent):
                    mine.append(time.perf_counter())
            stamps.append(mine)

        with engine.arrivals.prepare():
            for g in gens:
                g.submit()
        await asyncio.gather(*(read(g) for g in gens))
        return steady_step(stamps)

    return asyncio.run(run())


# ----------------------------------------------------------------------------- the run
def model_dir_of(name: str) -> str:
    if name == "tiny":
        from tests.conftest import model_path

        return str(model_path("qwen3"))
    if name == "medium":
        from scenarios import medium_model

        return medium_model()
    return name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, medium or a model directory")
    ap.add_argument("--streams", default="1,4,16,32")
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--http", action="store_true", help="also over HTTP: mlx-gateway serve and mlx_lm.server")
    ap.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                    help="the HTTP clients: httpx's, parsing each event, or plain sockets (host_cost_http.raw_streams)")
    ap.add_argument("--out", help="directory for host_cost.json and host_cost.md")
    ap.add_argument("--row-phases", action="store_true",
                    help="also time the engine's per-row functions (token events, the hop), at about 3 us a call "
                         "added to the engine's side (benchmarks/phases.py install)")
    args = ap.parse_args()

    import mlx_lm

    from cache import PromptCacheManager
    from scheduler import Engine
    from scheduler.speculative import SpeculationConfig

    model_dir = model_dir_of(args.model)
    model, tok = mlx_lm.load(model_dir)
    vocab = model.args.vocab_size if hasattr(model, "args") else 1000
    streams = [int(s) for s in args.streams.split(",")]
    conc = str(max(32, max(streams)))
    engine = Engine(model, tok.eos_token_ids, PromptCacheManager(max_bytes=1 << 30, max_entries=8),
                    decode_concurrency=int(conc), speculation=SpeculationConfig(method="off"))
    engine.start()
    servers, urls = [], {}
    if args.http:
        from scenarios import free_port, start, steady_stream_bias

        bias = steady_stream_bias(model_dir)
        profile_file = Path(tempfile.mkdtemp()) / "gateway-phases.json"
        flags = ["--model", model_dir, "--served-model-name", "m", "--speculative", "off",
                 "--decode-concurrency", conc, "--no-precompute-next-turn"]
        gport, mport = free_port(), free_port()
        # One gateway, its timers installed for its profiled runs alone: a second process would measure its
        # CPU paths again at load (gateway/cpu/measure.py) and could choose others under the machine's load.
        gw, _ = start([sys.executable, str(ROOT / "benchmarks" / "phases.py"), str(profile_file), "--port", str(gport),
                       *flags], gport, env=serve_env())
        ml, _ = start([sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--port", str(mport),
                       "--decode-concurrency", conc, "--log-level", "WARNING"], mport)
        servers, pids = [gw, ml], {"gateway http": gw.pid, "gateway http, profiled": gw.pid, "mlx_lm.server": ml.pid}
        gateway = (f"http://127.0.0.1:{gport}", "m")
        urls = {"gateway http": gateway, "gateway http, profiled": gateway, "mlx_lm.server": (f"http://127.0.0.1:{mport}", model_dir)}
    client = raw_streams if args.client == "raw" else http_streams
    phases = Phases()
    results: dict = {}
    try:
        warm = prompts(vocab, 2, args.prompt, 999)
        mlx_lm_side(model, warm, 8), engine_side(engine, warm, 8)
        for url, name in urls.values():
            asyncio.run(client(url, name, warm, 8, bias))
        seed, in_process = 0, {"forward": lambda rows, n: forward_only(model, rows, n),
                               "mlx-lm": lambda rows, n: mlx_lm_side(model, rows, n),
                               "engine": lambda rows, n: engine_side(engine, rows, n)}
        for s in streams:
            runs, cpu, dropped, wall = defaultdict(list), defaultdict(list), defaultdict(int), defaultdict(list)
            split: dict = defaultdict(lambda: defaultdict(list))
            for rep in range(args.repeat):
                # the timing pass, no timers in this process (the gateway's own, installed for its profiled runs
                # alone, are in its process), and the profiled pass in process: in turns, which goes first alternating
                for profiled in ((False, True) if rep % 2 == 0 else (True, False)):
                    sides = ["mlx-lm", "engine"] if profiled else [
                        "forward", "mlx-lm", "engine", "gateway http", "gateway http, profiled", "mlx_lm.server"]
                    sides = [x for x in sides if x in in_process or x in urls]
                    if rep % 2:  # (the forward first in the timing pass)
                        sides = sides[:1 - profiled] + sides[1 - profiled:][::-1]
                    if profiled:
                        install(phases, model, rows=args.row_phases)
                    for side in sides:
                        seed += 1
                        key = side + ", profiled" * profiled
                        rows = prompts(vocab, s, args.prompt, seed)
                        if side in in_process:
                            before = phases.snapshot()
                            host = [threading.main_thread()] + ([engine.loop._thread] if side == "engine" else [])
                            cpu0 = sum(thread_cpu(t) for t in host)
                            sec = in_process[side](rows, args.decode)
                            used = sum(thread_cpu(t) for t in host) - cpu0
                            if profiled:
                                ph, steps = per_step(before, phases.snapshot())
                                # the host threads' CPU per step, the forward's part on them (timed in the same run) left out
                                cpu[side].append(used / max(steps, 1) - sum(ph.get(k, 0.0) for k in FORWARD_PHASES))
                                for k, v in ph.items():
                                    split[side][k].append(v)
                            elif side == "forward":
                                cpu[side].append(used / args.decode)
                        else:
                            if side.startswith("gateway"):
                                before = switch_served_timers(profile_file, side.endswith("profiled"))
                            else:
                                time.sleep(0.3)
                            cpu0 = process_cpu(pids[side])
                            stamps, began, failed = asyncio.run(client(*urls[side], rows, args.decode, bias))
                            sec = steady_step(stamps)
                            wall[side].append(throughput(stamps, began))
                            share = steady_share(stamps)
                            if stamps and share < 0.5:
                                print(f"  {side}: only {share:.0%} of the tokens came while every stream was decoding",
                                      flush=True)
                            cpu[side].append((process_cpu(pids[side]) - cpu0) / max(1, (s - len(failed)) * args.decode))
                            dropped[side] += len(failed)
                            if failed:  # counted, left out of the figure
                                print(f"  {side}: {len(failed)} of {s} streams failed: {failed[0]}", flush=True)
                            if side == "gateway http, profiled":
                                for k, v in per_step(before, switch_served_timers(profile_file, True))[0].items():
                                    split["gateway http"][k].append(v)
                        runs[key].append(sec)
                    phases.remove()
            med = {k: statistics.median(v) for k, v in runs.items()}
            results[s] = {"step_s": med, "runs": dict(runs), "cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
                          "throughput": {k: statistics.median(v) for k, v in wall.items()},
                          "dropped": {k: f"{n} of {s * args.repeat}" for k, n in dropped.items() if n},
                          "phases": {side: {k: statistics.median(v) for k, v in ph.items()}
                                     for side, ph in split.items()}}
            report(s, results[s])
    finally:
        phases.remove()
        engine.stop()
        for p in servers:
            p.terminate()
            p.wait(60)
    md = table(results, args.model)
    print(md)
    if args.out:
        from scenarios import write_results

        write_results(args.out, {"host_cost.json": {str(k): v for k, v in results.items()}, "host_cost.md": md})


def report(s: int, r: dict) -> None:
    med, fwd, cpu = r["step_s"], r["step_s"]["forward"], r["cpu_s"]
    print(f"\n{s} streams: forward alone {fwd * 1e3:.3f} ms/step, its thread's CPU {cpu['forward'] * 1e3:.3f} ms/step")
    for side in ("mlx-lm", "engine"):
        print(f"  {side:14s} host CPU beyond the forward {cpu[side] * 1e3:7.3f} ms/step (profiled runs)")
    print(f"  engine host CPU ÷ mlx-lm's: {cpu['engine'] / max(1e-9, cpu['mlx-lm']):.2f}")
    for side, sec in med.items():
        if side != "forward":
            ref = med["mlx-lm, profiled" if side in ("mlx-lm, profiled", "engine, profiled") else "mlx-lm"]
            print(f"  {side:22s} {sec * 1e3:7.3f} ms/step, host {max(0.0, sec - fwd) * 1e3:7.3f} ms, "
                  f"{s / sec:8.1f} tok/s, {ref / sec:.2f}x mlx-lm's rate"
                  + (f", server CPU {cpu[side] * 1e3:.3f} ms/token, throughput {r['throughput'][side]:.1f} tok/s"
                     if side in HTTP else ""))
    if "mlx_lm.server" in med:
        print(f"  gateway over HTTP (unprofiled): {med['mlx_lm.server'] / med['gateway http']:.2f}x mlx_lm.server's "
              f"rate, {med['engine'] / med['gateway http']:.2f}x the engine's in process; throughput "
              f"{r['throughput']['gateway http'] / r['throughput']['mlx_lm.server']:.2f}x mlx_lm.server's")
    for side in (x for x in ("engine", "gateway http") if x in med):
        print(f"  {side} profiled ÷ unprofiled rate (the timers' cost): {med[side] / med[side + ', profiled']:.2f}")
    for side, n in r["dropped"].items():
        print(f"  {side}: {n} streams failed, left out of its figure")
    for side, ph in r["phases"].items():
        print(f"  {side} per step (profiled runs, exclusive, us):")
        for k, v in sorted(ph.items(), key=lambda kv: -kv[1]):
            print(f"      {v * 1e6:9.1f}  {k}")


def table(results: dict, model: str) -> str:
    http = "gateway http" in next(iter(results.values()))["step_s"]
    head = ["streams", "forward ms/step", "host CPU beyond the forward, mlx-lm ms/step (P)", "engine ms/step (P)",
            "engine ÷ mlx-lm (P)", "engine tok/s ÷ mlx-lm's"]
    if http:
        head += ["gateway http tok/s", "gateway http tok/s (P)", "mlx_lm.server tok/s", "gateway http ÷ mlx_lm.server",
                 "gateway http ÷ engine", "throughput, gateway http ÷ mlx_lm.server",
                 "server CPU ms/token: gateway http, (P), mlx_lm.server"]
    lines = [f"Model: {model}. (P): from the profiled runs, the phase timers installed (in process, and over "
             "HTTP in the same gateway, switched on for those runs alone); every other figure, every ratio of rates "
             "included, from the runs with no timers installed, which alternate with them. Host CPU: the CPU time "
             "of the stepping threads (the engine's and the event loop's; mlx-lm's loop) per decode step, less the "
             "forward's part on them (graph building, dispatch, the wait for its result, prefill; timed in the same "
             "run). Server CPU: the server process's, all its threads (the forward's, and OpenBLAS's spinning: "
             "mlx_lm.server's without OPENBLAS_THREAD_TIMEOUT), while it streamed, per token it sent. Rates: in the window "
             "where every stream was decoding; throughput: all the tokens over the wall time from the requests to "
             "the last token.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, r in results.items():
        med, cpu = r["step_s"], r["cpu_s"]
        ml, en = cpu["mlx-lm"], cpu["engine"]
        cells = [f"{s}", f"{med['forward'] * 1e3:.3f}", f"{ml * 1e3:.3f}", f"{en * 1e3:.3f}", f"{en / max(ml, 1e-9):.2f}",
                 f"{med['mlx-lm'] / med['engine']:.2f}"]
        if http:
            cells += [f"{s / med[c]:.0f}" for c in HTTP]
            put = r["throughput"]
            cells += [f"{med['mlx_lm.server'] / med['gateway http']:.2f}", f"{med['engine'] / med['gateway http']:.2f}",
                      f"{put['gateway http'] / put['mlx_lm.server']:.2f}", ", ".join(f"{cpu[c] * 1e3:.2f}" for c in HTTP)]
        lines.append("| " + " | ".join(cells) + " |")
    drops = [f"{side} {n} at {s} streams" for s, r in results.items() for side, n in r["dropped"].items()]
    if drops:  # the cause named where it is known
        cause = f" {DROPS}." if all(d.startswith("mlx_lm.server") for d in drops) else ""
        lines += ["", f"Streams that failed, left out of the figures: {'; '.join(drops)}.{cause}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
