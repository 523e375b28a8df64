"""The engine loop's watchdog: a stalled loop is reported, not left answering healthy.

The loop thread marks each turn (:class:`Heartbeat`: one ``begin`` and one ``end``, a
few attribute writes). A :class:`Watchdog` thread looks at those marks every
``interval`` seconds and calls the loop *stalled* when

* a turn has run for longer than the bound, or
* work waits (an inbox item, a submitted request not yet admitted) and the loop has not
  begun a turn for longer than the bound since the watchdog first saw that work.

The bound is ``max(floor, FACTOR * longest of the last WINDOW turns)``. The turns are
measured on this machine for this model mix, so a big model whose prefill chunks take
seconds gets a bound of its own; the floor (``--engine-stall-seconds``, default 60 s)
covers what the window has not seen yet: the first step of a new shape, which compiles
kernels, or a prompt longer than any before. ``FACTOR`` is a margin, not a measurement:
the scheduler already sizes each prefill chunk to a time budget
(:mod:`scheduler.chunking`), so the turns of a live loop stay within a few times of each
other, and a turn ten times the longest recent one is a hang, not a slow step.

On a stall the watchdog sets :attr:`Heartbeat.stalled` (``/health`` then answers 503
``stalled``), raises its metrics, logs the stack of every thread once, and calls
``on_fault("stalled", detail)``; when the turn ends the stall clears. A loop that died
(its thread raised) calls ``on_fault("dead", detail)`` once. What the gateway does then
(keep serving, or end the requests in flight and exit for the service manager to
restart it) is its choice: ``--on-engine-fault``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("mlx_gateway.engine")

FACTOR = 10.0  # the bound is this many times the longest recent turn (see the module docstring)
WINDOW = 512  # turns whose durations set the bound
DEFAULT_FLOOR = 60.0  # seconds; the bound is never below it (--engine-stall-seconds)


class Heartbeat:
    """The loop's turn marks: written by the loop thread only, read by the watchdog
    (plain attribute reads and writes; a torn read is at worst one tick late)."""

    def __init__(self) -> None:
        self.turn_started: Optional[float] = None  # monotonic seconds of the turn running, None between turns
        self.last = time.monotonic()  # monotonic seconds of the latest turn's start or end
        self.durations: deque[float] = deque(maxlen=WINDOW)  # seconds of the latest turns
        self.turns = 0
        self.stalled: Optional[str] = None  # why the loop is stalled, set by the watchdog; None: it is not

    def begin(self) -> None:
        """A turn begins (loop thread)."""
        self.turn_started = self.last = time.monotonic()

    def end(self) -> None:
        """The turn ends (loop thread)."""
        now = time.monotonic()
        if self.turn_started is not None:
            self.durations.append(now - self.turn_started)
        self.turn_started, self.last = None, now
        self.turns += 1


def thread_stacks() -> str:
    """The current stack of every thread of the process, named, as text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


class Watchdog:
    """Watches an engine loop (:class:`scheduler.engine.loop.EngineLoop`: its ``beat``,
    ``alive``, ``stopping``, ``error`` and ``waiting_work``) from a thread of its own.

    Args:
        loop: the engine loop.
        floor: seconds; the smallest stall bound (see the module docstring).
        registry: where the metrics go (None: a registry of its own).
        on_fault: called on the watchdog's thread as ``on_fault(kind, detail)`` with
            ``kind`` ``"stalled"`` (once per stall) or ``"dead"`` (once); None: nothing.
        interval: seconds between two looks (default: a quarter of ``floor``, at most 1 s).
    """

    def __init__(self, loop, floor: float = DEFAULT_FLOOR, registry: Optional[CollectorRegistry] = None,
                 on_fault: Optional[Callable[[str, str], None]] = None, interval: Optional[float] = None):
        self.loop = loop
        self.beat: Heartbeat = loop.beat
        self.floor = max(0.1, floor)
        self.on_fault = on_fault
        self.interval = interval if interval is not None else min(1.0, self.floor / 4)
        self._pending_since: Optional[float] = None
        self._dead_reported = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        registry = registry or CollectorRegistry()
        self.stalled_gauge = Gauge("mlx_gateway_engine_stalled",
                                   "1 while the engine loop is stalled (a turn past its bound, or work waiting "
                                   "and no turn begun for that long), else 0.", registry=registry)
        self.faults = Counter("mlx_gateway_engine_faults",
                              "Engine loop faults seen by the watchdog: stalls (each one once) and a dead loop.",
                              ["kind"], registry=registry)
        for kind in ("stalled", "dead"):
            self.faults.labels(kind)
        self.bound_gauge = Gauge("mlx_gateway_engine_stall_bound_seconds",
                                 "Seconds a turn of the engine loop may take before it counts as stalled: "
                                 "max(--engine-stall-seconds, 10 x the longest of the last 512 turns).",
                                 registry=registry)
        self.bound_gauge.set_function(self.bound)

    def bound(self) -> float:
        """Seconds a turn may take before the loop counts as stalled."""
        durations = list(self.beat.durations)
        return max(self.floor, FACTOR * max(durations, default=0.0))

    def start(self) -> None:
        """Start watching (a daemon thread)."""
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (before the loop stops, so that its last turn is not taken for a stall)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check(time.monotonic())
            except Exception:
                log.exception("the engine watchdog failed a check")

    def stall(self, now: float) -> Optional[str]:
        """Why the loop is stalled at ``now`` (monotonic seconds), or None."""
        beat, bound = self.beat, self.bound()
        started = beat.turn_started
        if started is not None and now - started > bound:
            self._pending_since = None
            return f"an engine step has run for {now - started:.1f} s (bound {bound:.1f} s)"
        if started is None and self.loop.waiting_work:
            if self._pending_since is None or self._pending_since < beat.last:
                self._pending_since = max(now, beat.last)
            if now - self._pending_since > bound:
                return f"work has waited {now - self._pending_since:.1f} s without an engine step (bound {bound:.1f} s)"
            return None
        self._pending_since = None
        return None

    def check(self, now: float) -> None:
        """One look: report a dead loop once, a stall once per stall, and its end."""
        if self.loop.error is not None:
            if not self._dead_reported:
                self._dead_reported = True
                self.faults.labels("dead").inc()
                self._fault("dead", f"the engine loop died: {self.loop.error!r}")
            return
        if not self.loop.alive or self.loop.stopping:  # a stop writing the caches to disk is no stall
            return
        why = self.stall(now)
        if why is not None and self.beat.stalled is None:
            self.beat.stalled = why
            self.stalled_gauge.set(1)
            self.faults.labels("stalled").inc()
            log.error("engine loop stalled: %s; the stack of every thread:\n%s", why, thread_stacks())
            self._fault("stalled", why)
        elif why is None and self.beat.stalled is not None:
            log.warning("engine loop stepping again after a stall (%s)", self.beat.stalled)
            self.beat.stalled = None
            self.stalled_gauge.set(0)

    def _fault(self, kind: str, detail: str) -> None:
        if self.on_fault is not None:
            self.on_fault(kind, detail)
