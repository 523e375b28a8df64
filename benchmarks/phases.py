"""Timers wrapped around functions for the duration of a benchmark run only, so serving
carries no timing code of its own: :class:`Phases` splits a thread's time by the
functions it runs through (used by ``bench_host_cost.py`` for a decode step and by
``bench_cache.py`` for a prefix-cache hit), the phases of a decode step, the engine's
and mlx-lm's (:func:`install`), and a gateway serving with them switched on and off from
another process (``python benchmarks/phases.py OUT SERVE_ARGS...``: :func:`serve_profiled`,
:func:`switch_served_timers`)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path


class Phases:
    """Exclusive CPU time of the calling thread per phase of functions wrapped by
    :meth:`wrap` (seconds, ``time.thread_time``, per thread's call stack: a phase's
    callees are not counted in it), until :meth:`remove`; ``counts[phase]`` counts the
    calls. CPU time, not wall time: the machine's other load, which preempts the thread,
    is left out (mostly); ``clock=time.perf_counter`` times wall time instead."""

    def __init__(self, clock=time.thread_time):
        self.clock = clock  # time.perf_counter: wall time (a latency's split)
        self.acc: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._stacks = threading.local()
        self._wrapped: list = []

    def wrap(self, owner, attr: str, phase: str) -> None:
        """Time ``owner.attr`` (a class's function or a module's) as ``phase``."""
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        acc, counts, stacks, clock = self.acc, self.counts, self._stacks, self.clock

        def timed(*args, **kwargs):
            stack = getattr(stacks, "s", None)
            if stack is None:
                stack = stacks.s = []
            stack.append(0.0)
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t
                inner = stack.pop()
                acc[phase] += dt - inner
                counts[phase] += 1
                if stack:
                    stack[-1] += dt

        timed.__wrapped__ = fn
        setattr(owner, attr, timed)
        self._wrapped.append((owner, attr, fn))

    def remove(self) -> None:
        for owner, attr, fn in reversed(self._wrapped):
            setattr(owner, attr, fn)
        self._wrapped.clear()

    def snapshot(self) -> dict:
        return {"acc": dict(self.acc), "counts": dict(self.counts)}


class TimedMx:
    """``mlx.core`` as mlx-lm's generate module sees it, its ``eval`` and ``async_eval``
    timed (the wait for a step's result, the dispatch of the next)."""

    def __init__(self, mx, phases: Phases):
        self._mx = mx
        self.__dict__["eval"] = mx.eval
        self.__dict__["async_eval"] = mx.async_eval
        phases.wrap(self, "eval", "wait for the step's result (forward compute)")
        phases.wrap(self, "async_eval", "dispatch of the next step")

    def __getattr__(self, name):
        return getattr(self._mx, name)


STEP_PHASE = "step graph: sampling, logits processors, token lists"
PREFILL_PHASE = "prefill (not a decode step's)"
# The forward's part of a step on the stepping thread: what a loop around the model alone costs too.
FORWARD_PHASES = ("forward graph building", "dispatch of the next step", "wait for the step's result (forward compute)",
                  PREFILL_PHASE)


def install(phases: Phases, model, rows: bool = False) -> None:
    """Wrap the functions of a decode step, the engine's and mlx-lm's (shared parts
    count under the same names on both sides), and ``model``'s forward (None: not).

    With ``rows``, also the engine's functions called once per row and step (a token's
    event, the hop of a row's events): a wrapped call costs about 3 µs of its own (here,
    half of it counted in the caller), 200 µs a step at 32 streams, which mlx-lm's side,
    with no per-row functions of its own wrapped, does not pay; so they are off unless
    asked for, and count in the batch's accounting."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

    generate = sys.modules[GenerationBatch.__module__]  # (mlx_lm.generate is also a function's name)

    phases._wrapped.append((generate, "mx", generate.mx))  # put back by remove, so install can run again
    generate.mx = TimedMx(mx, phases)
    if model is not None:
        phases.wrap(type(model), "__call__", "forward graph building")
    phases.wrap(GenerationBatch, "_step", STEP_PHASE)
    phases.wrap(PromptProcessingBatch, "prompt", PREFILL_PHASE)
    phases.wrap(GenerationBatch, "next", "stop/EOS checks, responses")
    phases.wrap(GenerationBatch, "filter", "row insert/filter")
    phases.wrap(BatchGenerator, "_next", "scheduling (generator)")
    try:
        from scheduler.batch import Batch
        from scheduler.batch.decode_batch import JoiningGenerationBatch
        from scheduler.batch.generator import JoiningBatchGenerator
        from scheduler.batch.insertion import RowInsertion
        from scheduler.engine.core import EngineCore
        from scheduler.engine.loop import EngineLoop
    except ImportError:  # mlx-lm alone
        return
    phases.wrap(JoiningGenerationBatch, "plain_next", "stop/EOS checks, responses")
    phases.wrap(JoiningGenerationBatch, "filter", "row insert/filter")
    phases.wrap(JoiningBatchGenerator, "_next", "scheduling (generator)")
    phases.wrap(RowInsertion, "join_ready", "row insert/filter")
    phases.wrap(Batch, "step", "scheduling (batch: chunk plan, accounting)")
    phases.wrap(Batch, "_save_snapshot", "snapshot of a finished row")
    if rows:
        phases.wrap(Batch, "_token_event", "token events (counters, metrics, fair share)")
        phases.wrap(EngineCore, "send", "hop to the event loop")
    phases.wrap(EngineLoop, "_turn_once", "scheduling (loop: admission, turns)")
    try:
        from gateway.conversation.textout import TextAssembler
        from gateway.protocols.openai_completions import CompletionFormat
    except ImportError:
        return
    phases.wrap(TextAssembler, "feed", "detokenizing")
    phases.wrap(CompletionFormat, "piece", "SSE encoding")


def per_step(before: dict, after: dict) -> tuple[dict, int]:
    """Seconds per decode step of each phase between two snapshots, and the steps."""
    steps = after["counts"].get(STEP_PHASE, 0) - before["counts"].get(STEP_PHASE, 0)
    out = {k: (v - before["acc"].get(k, 0.0)) / max(steps, 1) for k, v in after["acc"].items()}
    return {k: v for k, v in out.items() if v > 0}, steps


def serve_profiled(out: str, argv: list[str]) -> None:
    """``mlx-gateway serve argv`` with :func:`install`'s timers installed while the file
    ``out`` with the suffix ``.on`` exists (looked at every 0.1 s), removed while it does
    not; the phases' running totals, and whether they are installed, go to ``out`` (JSON)
    as often."""
    phases, installed = Phases(), [False]

    def watch() -> None:
        while True:
            time.sleep(0.1)
            try:
                on = Path(out).with_suffix(".on").exists()
                if on != installed[0]:  # (the forward's graph building counts in the step's graph here)
                    install(phases, None) if on else phases.remove()
                    installed[0] = on
                Path(out + ".tmp").write_text(json.dumps({**phases.snapshot(), "on": on}))
                os.replace(out + ".tmp", out)
            except Exception as e:  # said, and the benchmark's wait times out
                print(f"phases watcher: {e!r}", file=sys.stderr)

    threading.Thread(target=watch, daemon=True).start()
    from gateway.cli import main as cli_main

    sys.exit(cli_main(["serve", *argv]))


def switch_served_timers(out: Path, on: bool) -> dict:
    """Install (``on``) or remove the timers of the gateway :func:`serve_profiled` serves
    with ``out``; returns its phases' totals once it has, 0.3 s on (a finished run's last
    step counted)."""
    flag = out.with_suffix(".on")
    flag.touch() if on else flag.unlink(missing_ok=True)
    deadline = time.monotonic() + 60
    while json.loads(out.read_text())["on"] != on:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the profiled gateway did not switch its timers {'on' if on else 'off'} in 60 s")
        time.sleep(0.05)
    time.sleep(0.3)
    return json.loads(out.read_text())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    serve_profiled(sys.argv[1], sys.argv[2:])
