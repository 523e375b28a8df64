"""The engine loop: the one thread that owns every MLX call, for every served model.

MLX is used from this thread only (on Metal, MLX from several threads at once is a
crash class), so one gateway serving several models runs one :class:`EngineLoop` and
attaches one :class:`scheduler.engine.Engine` per model to it. Each engine keeps its
own waiting queue, batch and prefix cache; the loop decides whose step runs when:

* every turn, every engine with decoding rows decodes one token, so no model's streams
  wait for another model's work longer than one turn;
* the engines whose prefilling rows are of the best latency class among them
  (interactive, standard, batch; the others keep a small guaranteed share of turns) run
  a prefill chunk each turn, sharing one step's budget, and their chunks are sized with
  the decoding rows of *every* model counted (:mod:`scheduler.batch.chunking`): the
  chunked-prefill gap bound holds across models, and a short prompt of one model does
  not wait for another model's turn;
* next-turn precomputes run only when no engine has a request waiting or running, and
  any request arriving for any model preempts them;
* the tenants' fair share (VTC, :mod:`scheduler.admission.fairness`) is one set of counters for
  all models: work a tenant gets on one model counts on the others.

The async side talks to it through a thread-safe inbox and never blocks it; the loop
blocks on the inbox only when no engine has work. One engine failing in a way its own
batch cannot contain (a bug outside a model step) is detached with that error; the
others keep serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from operator import itemgetter
from typing import Any, Callable, Optional, Protocol

from scheduler.admission.arrivals import Arrivals, gather
from scheduler.batch.chunking import DecodeShare
from scheduler.admission.fairness import FairShare
from scheduler.metrics import SchedulerMetrics
from scheduler.admission.policy import ClassShare
from scheduler.batch.rows import EngineDead
from scheduler.batch.faults import inject_fault
from scheduler.engine.watchdog import Heartbeat

log = logging.getLogger("mlx_gateway.engine")

# Seconds after an interactive request during which lower classes prefill in short steps.
INTERACTIVE_WINDOW = 30.0
# Seconds a loop holds its next step for an interactive request the gateway is tokenizing.
INTERACTIVE_ARRIVAL_WAIT = 0.02


class Engine(Protocol):
    """What the loop sees of a model's engine (:class:`scheduler.engine.core.EngineCore`, which
    :class:`scheduler.engine.Engine` holds; :class:`scheduler.engine.embedding.EmbeddingEngine`);
    every method runs on the loop's thread."""

    name: str
    error: Optional[BaseException]
    arrivals: Arrivals
    metrics: SchedulerMetrics

    @property
    def busy(self) -> bool: ...  # rows in the batch or requests waiting

    @property
    def has_waiting(self) -> bool: ...

    @property
    def has_rows(self) -> bool: ...

    @property
    def serving(self) -> bool: ...  # a row is a request (not a next-turn precompute)

    @property
    def num_prefilling(self) -> int: ...

    @property
    def num_decoding(self) -> int: ...

    @property
    def prefill_class(self) -> int: ...  # the best latency class prefilling (3: none)

    @property
    def interactive_busy(self) -> bool: ...  # an interactive request waits, prefills or decodes

    def precompute_due(self) -> Optional[float]: ...

    def open_on_loop(self) -> None: ...

    def close_on_loop(self, reason: str, persist: bool) -> None: ...

    def handle(self, kind: str, payload) -> None: ...

    def refuse(self, kind: str, payload, reason: str) -> None: ...

    def admit(self, preempt: bool, quiet: bool) -> None: ...

    def step(self, decode_only: bool = False, decoding_elsewhere: int = 0, share: float = 1.0) -> None: ...

    def end_turn(self, hold: bool) -> None: ...


class EngineLoop:
    """The thread that steps every attached :class:`Engine` (see the module docstring).

    Args:
        gather_wait: seconds an idle loop with a request to start waits for requests the
            gateway is still preparing for any model (:mod:`scheduler.admission.arrivals`); 0: never.
        name: the thread's name.
        batch_share: the guaranteed share of prefill steps of the latency classes below
            the best one present (:class:`scheduler.admission.policy.ClassShare`), in each engine and
            across them.
        interactive_budget: seconds a step that prefills only standard or batch prompts
            may take while interactive requests are about (:data:`INTERACTIVE_WINDOW`):
            a new interactive request waits for the step in progress, then prefills alone.
    """

    def __init__(self, gather_wait: float = 0.0, name: str = "mlx-gateway-engine", batch_share: float = 0.05,
                 interactive_budget: float = 0.005) -> None:
        self.gather_wait = max(0.0, gather_wait)
        self.batch_share = batch_share
        self.interactive_budget = max(0.0, interactive_budget)
        self._share = ClassShare(batch_share)
        self._last_interactive = float("-inf")  # monotonic seconds of the latest interactive admission
        self._awaited: dict[int, int] = {}  # per engine, interactive preparations already waited for
        self.name = name
        self.fair = FairShare()  # one set of tenant counters for every model
        self.decode_share = DecodeShare()  # decode-only time owed after a prefill chunk, for every model
        self.error: Optional[BaseException] = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._engines: list[Engine] = []  # loop thread only (before start: the starting thread)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._stop_reason = "engine stopped"
        self.beat = Heartbeat()  # each turn's start and end, for scheduler.engine.watchdog

    def saw_interactive(self) -> None:
        """An interactive request was admitted (loop thread)."""
        self._last_interactive = time.monotonic()

    def interactive_recent(self) -> bool:
        """An interactive request was admitted in the last :data:`INTERACTIVE_WINDOW` seconds."""
        return time.monotonic() - self._last_interactive < INTERACTIVE_WINDOW

    # ----------------------------------------------------------------- thread-safe API
    @property
    def alive(self) -> bool:
        """True while the loop's thread runs."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called (or a stop item taken): the loop is ending (any thread)."""
        return self._stopping

    @property
    def waiting_work(self) -> bool:
        """An inbox item or a submitted request not yet admitted (any thread; a snapshot)."""
        engines = list(self._engines)
        return not self._stopping and (not self._inbox.empty() or any(getattr(e, "num_waiting", 0) for e in engines))

    def start(self) -> None:
        """Start the thread; engines attached before it opens their batches on it."""
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0, reason: str = "engine stopped") -> None:
        """Stop the thread: every engine's waiting and running requests end with a 503
        error event whose message is ``reason``; prompt caches with a disk tier are
        written to it first (a graceful stop)."""
        self._stop_reason = reason
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def post(self, item: tuple) -> None:
        """Put ``item`` in the inbox (thread-safe)."""
        self._inbox.put(item)

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn()`` on the loop's thread between two steps and return its result.

        Raises:
            EngineDead: the loop is not running.
            TimeoutError: no answer within ``timeout`` seconds (it may still run later).
            Exception: whatever ``fn`` raised.
        """
        if not self.alive:
            raise EngineDead("engine is not running")
        box: dict = {}
        done = threading.Event()
        self._inbox.put(("call", (fn, box, done)))
        if not done.wait(timeout):
            raise TimeoutError("engine did not answer")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def attach(self, engine: Engine, timeout: float = 60.0) -> None:
        """Serve ``engine`` from this loop: before :meth:`start` it is opened when the
        thread starts; after, its batch is opened on the thread between two steps (the
        hand-over of a model loaded elsewhere).

        Raises:
            EngineDead, TimeoutError: see :meth:`call` (after start only).
        """
        if self._thread is None:
            self._engines.append(engine)
            return
        self.call(lambda: self._open(engine), timeout)

    def detach(self, engine: Engine, reason: str, timeout: float = 60.0, persist: bool = True) -> None:
        """Stop serving ``engine``: its requests end with a 503 ``reason``; with
        ``persist``, its prompt cache goes to its disk tier (if it has one). A no-op when
        the loop is not running (the engine stopped with it).

        Raises:
            TimeoutError: the loop did not take it within ``timeout`` seconds.
        """
        try:
            self.call(lambda: self._close(engine, reason, persist), timeout)
        except EngineDead:
            pass

    # ----------------------------------------------------------------- the thread
    def _open(self, engine: Engine) -> None:
        engine.open_on_loop()
        self._engines.append(engine)

    def _close(self, engine: Engine, reason: str, persist: bool) -> None:
        if engine in self._engines:
            self._engines.remove(engine)
            engine.close_on_loop(reason, persist)

    def _preparing(self) -> int:
        return sum(e.arrivals.preparing for e in self._engines)

    def _run(self) -> None:
        try:
            for e in list(self._engines):
                e.open_on_loop()
            while not self._stopping:
                engines = list(self._engines)
                if not any(e.busy for e in engines):
                    # Idle: block until something arrives, or until a precompute is due.
                    dues = [d for d in (e.precompute_due() for e in engines) if d is not None]
                    due = min(dues) if dues else None
                    try:
                        self._handle(self._inbox.get(timeout=due) if due is None or due > 0 else
                                     self._inbox.get_nowait())
                    except queue.Empty:
                        pass
                self.beat.begin()
                self._drain_inbox()
                if self._stopping:
                    break
                engines = list(self._engines)
                if (self.gather_wait > 0 and any(e.has_waiting for e in engines)
                        and not any(e.has_rows for e in engines) and self._preparing()):
                    self._gather(engines)
                    if self._stopping:
                        break
                self._await_interactive(engines)
                if self._stopping:
                    break
                inject_fault()
                self._turn_once(engines)
                self.beat.end()
        except BaseException as e:  # the loop itself broke: report, fail everyone
            self.error = e
            log.error("engine thread died:\n%s", traceback.format_exc())
        finally:
            reason = f"engine stopped: {self.error!r}" if self.error else self._stop_reason
            for e in list(self._engines):
                try:
                    e.close_on_loop(reason, persist=self.error is None)
                except Exception:
                    log.exception("closing the engine of %s failed", e.name)
            self._engines.clear()
            self.drain_after_stop(reason)

    def _turn_once(self, engines: list[Engine]) -> None:
        """One turn: admissions, then one step of each engine with rows (the engines
        prefilling the best class share the prefill budget; the others only decode), then
        the idle books."""
        someone_waits = any(e.has_waiting for e in engines)
        quiet = not (someone_waits or any(e.serving for e in engines) or self._preparing())
        for e in engines:
            self._guarded(e, e.admit, preempt=someone_waits, quiet=quiet)
        active = [(e, e.num_prefilling, e.num_decoding) for e in self._engines if e.has_rows]  # counted once
        prefilling = [e for e, p, _ in active if p]
        if prefilling:  # the best latency class first, in turn among equals (and a share for the rest)
            classes = {e: e.prefill_class for e in prefilling}
            allowed = self._share.allowed(set(classes.values()))
            prefilling = [e for e in prefilling if classes[e] in allowed]
        decoding = sum(map(itemgetter(2), active))
        for e, _, d in active:
            if e in prefilling:  # each with its share of the step's prefill budget
                self._guarded(e, e.step, decoding_elsewhere=decoding - d, share=1.0 / len(prefilling))
            elif d:
                self._guarded(e, e.step, decode_only=True)
        engines = list(self._engines)
        hold = any(e.has_waiting or e.serving for e in engines)
        for e in engines:
            e.end_turn(hold)

    def _guarded(self, engine: Engine, fn: Callable[..., None], **kwargs) -> None:
        """Run ``fn(**kwargs)``; if it raises, detach ``engine`` with that error (its requests end
        with a 503), and keep serving the others."""
        try:
            fn(**kwargs)
        except Exception as e:
            log.error("the engine of %s failed and stops:\n%s", engine.name, traceback.format_exc())
            engine.error = e
            self._close(engine, f"engine stopped: {e!r}", persist=False)

    def _gather(self, engines: list[Engine]) -> None:
        """Idle, with a request to start: take in the requests still being prepared, for at
        most ``gather_wait`` seconds (:func:`scheduler.admission.arrivals.gather`)."""
        waiting = [e for e in engines if e.has_waiting]
        waited = gather(self._preparing, self._inbox, self._handle, self.gather_wait, lambda: self._stopping)
        for e in waiting:
            e.metrics.gather_wait.observe(waited)

    def _await_interactive(self, engines: list[Engine]) -> None:
        """An interactive request began being prepared (template, tokenizer) since the last
        such wait, while no interactive request waits, prefills or decodes: hold the next
        step, which would be lower-class work, until it is submitted (at most
        :data:`INTERACTIVE_ARRIVAL_WAIT` seconds, once per preparation), so that it starts
        at that step instead of waiting for it to end (:func:`scheduler.admission.arrivals.gather`)."""
        entered = {id(e): e.arrivals.interactive_entered for e in engines}
        new = [e for e in engines if entered[id(e)] > self._awaited.get(id(e), 0) and e.arrivals.interactive]
        self._awaited = entered
        if not new or any(e.interactive_busy for e in engines):
            return
        gather(lambda: sum(e.arrivals.interactive for e in new), self._inbox, self._handle,
               INTERACTIVE_ARRIVAL_WAIT, lambda: self._stopping)

    def _drain_inbox(self) -> None:
        inbox = self._inbox  # (this thread alone takes from it: not empty means an item; no Empty raised a turn)
        while not inbox.empty():
            self._handle(inbox.get_nowait())

    def _handle(self, item) -> None:
        kind, payload = item
        if kind == "engine":  # (engine, kind, payload): a submit, cancel or precompute
            engine, what, data = payload
            if engine in self._engines:
                engine.handle(what, data)
            else:
                engine.refuse(what, data, f"engine stopped: {engine.error!r}" if engine.error else "engine stopped")
        elif kind == "call":
            fn, box, done = payload
            try:
                box["value"] = fn()
            except BaseException as e:
                box["error"] = e
            done.set()
        elif kind == "stop":
            self._stopping = True
        # "arrived" (a preparation ended, scheduler.admission.arrivals) only wakes the loop.

    def drain_after_stop(self, reason: str) -> None:
        """Answer what is left in the inbox of a stopped loop: submits with a 503
        ``reason``, calls with :class:`EngineDead` (any thread)."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "engine":
                engine, what, data = payload
                engine.refuse(what, data, reason)
            elif kind == "call":
                fn, box, done = payload
                box["error"] = EngineDead(reason)
                done.set()
