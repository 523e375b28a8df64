"""The engine: one thread that owns the model, the caches and the batch.

Every MLX call happens on this thread. The async side talks to it through a
thread-safe inbox (``submit``, ``cancel``) and receives events through each request's
``sink``. The loop blocks on the inbox only when there is no work, so a new request is
admitted on the next step, never after a timer (mlx-lm's server polls every 0.1 s and
runs 0.5 s budgets; see the project's field notes).

The engine decides what enters the batch and when (admission, next-turn precomputes);
the running batch itself is :class:`scheduler.batch.Batch`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from typing import Optional

from mlx_lm.models.cache import make_prompt_cache
from prometheus_client import CollectorRegistry

from cache import PromptCacheManager
from cache.restore import always_trimmable
from scheduler.arrivals import Arrivals, gather
from scheduler.batch import Batch
from scheduler.chunking import ChunkPlanner
from scheduler.metrics import SchedulerMetrics
from scheduler.policy import Admission, InFlight, WaitingQueue
from scheduler.precompute import Precompute, PrecomputeBook, PrecomputeMetrics
from scheduler.request import (
    DoneEvent,
    EngineRequest,
    ErrorEvent,
    Event,
    ProgressEvent,
    PromptEvent,
    SamplingParams,
)
from scheduler.rows import (
    RECENT, AdmissionRecord, EngineDead, EngineOverloaded, EngineStats, TenantQueueFull, WaitingCounts,
)

# The errors and records are importable from here too.
__all__ = ["PERSIST_SECONDS", "AdmissionRecord", "Engine", "EngineDead", "EngineOverloaded", "EngineStats",
           "TenantQueueFull"]

log = logging.getLogger("mlx_gateway.engine")


# Seconds a graceful stop waits for the prompt cache's snapshots to reach the disk tier.
PERSIST_SECONDS = 60.0


class Engine:
    """Owns the model on a dedicated thread and serves :class:`EngineRequest`s.

    Args:
        model: an mlx-lm model (``mlx_lm.load``).
        eos_token_ids: token ids that end a generation.
        prompt_cache: the prefix-cache manager; snapshots are saved at each request's
            checkpoints and after it finishes (prompt + completion).
        prompt_concurrency: prompts prefilled together (prefill batch size).
        decode_concurrency: sequences decoded together (decode batch size).
        prefill_step_size: most tokens per prompt per prefill step while nothing decodes.
        prefill_budget: seconds a prefill step may take while other sequences decode
            (0: no budget). See :mod:`scheduler.chunking`.
        max_waiting: waiting requests before :meth:`submit` raises :class:`EngineOverloaded`.
        registry: where the scheduler metrics are registered.
        pad_free_prefill: when true, only prompts that need no padding prefill
            together (set by the batch-equivalence guard for models whose padded
            batches are not exact).
        gather_wait: seconds an idle engine with a request to start waits for requests
            still being prepared (:attr:`arrivals`, :mod:`scheduler.arrivals`); 0: never.
    """

    def __init__(
        self,
        model,
        eos_token_ids: set[int],
        prompt_cache: PromptCacheManager,
        *,
        prompt_concurrency: int = 8,
        decode_concurrency: int = 32,
        prefill_step_size: int = 2048,
        prefill_budget: float = 0.0,
        max_waiting: int = 1024,
        registry: Optional[CollectorRegistry] = None,
        pad_free_prefill: bool = False,
        gather_wait: float = 0.0,
    ):
        self.model = model
        self.eos_token_ids = set(eos_token_ids)
        self.prompt_cache = prompt_cache
        self.prompt_concurrency = max(1, prompt_concurrency)
        self.decode_concurrency = max(self.prompt_concurrency, decode_concurrency)
        self.prefill_step_size = prefill_step_size
        self.chunks = ChunkPlanner(prefill_step_size, prefill_budget)
        self.max_waiting = max_waiting
        self.gather_wait = max(0.0, gather_wait)
        self.pad_free_prefill = pad_free_prefill
        self.trimmable = always_trimmable(make_prompt_cache(model))
        registry = registry or CollectorRegistry()
        self.metrics = SchedulerMetrics(registry)
        self.precomputes = PrecomputeBook(PrecomputeMetrics(registry))
        self.stats = EngineStats()
        # Recent admissions in order, for tests, benchmarks and debugging; bounded.
        self.admission_log: deque[AdmissionRecord] = deque(maxlen=RECENT)

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting = WaitingQueue()
        self._batch = Batch(
            model, self.eos_token_ids, prompt_concurrency=self.prompt_concurrency,
            decode_concurrency=self.decode_concurrency, prefill_step_size=prefill_step_size,
            trimmable=self.trimmable, prompt_cache=prompt_cache, chunks=self.chunks, metrics=self.metrics,
            stats=self.stats, precomputes=self.precomputes, fair=self._waiting.fair, send=self._send,
        )
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._stop_reason = "engine stopped"
        self._idle = threading.Condition()
        self._is_idle = True  # updated between steps only, so readers see a consistent state
        self.error: Optional[BaseException] = None
        self._waiting_counts = WaitingCounts()  # submitted, not yet admitted or cancelled
        self._reserved = 0  # next-turn precomputes being rendered (reserve_precompute)
        # Requests the gateway is rendering and tokenizing; each one ending wakes the loop.
        self.arrivals = Arrivals(lambda: self._inbox.put(("arrived", None)))

    # ----------------------------------------------------------------- public API
    @property
    def alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="mlx-gateway-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0, reason: str = "engine stopped") -> None:
        """Stop the thread; requests still waiting or running end with a 503 error event
        whose message is ``reason``."""
        self._stop_reason = reason
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request (thread-safe).

        Raises:
            EngineDead: the engine thread is not running.
            EngineOverloaded: ``max_waiting`` requests are already waiting.
            TenantQueueFull: ``request.max_queued`` requests of its tenant are waiting.
        """
        if not self.alive:
            raise EngineDead(f"engine is not running: {self.error!r}")
        self._waiting_counts.add(request, self.max_waiting)
        with self._idle:
            self._is_idle = False
        self._inbox.put(("submit", request))
        if not self._thread.is_alive():  # died between the check and the put
            self._drain_inbox_after_stop(f"engine stopped: {self.error!r}")

    def reserve_precompute(self, limit: int = 8) -> bool:
        """Announce a next-turn precompute that is being rendered (thread-safe): until its
        :meth:`submit_precompute`, the engine does not count as idle. False (nothing
        reserved) when ``limit`` renders are already in flight or the engine is not running."""
        with self._idle:
            if self._reserved >= limit or not self.alive:
                return False
            self._reserved += 1
            self._is_idle = False
            return True

    def submit_precompute(self, p: Optional[Precompute]) -> None:
        """Queue a reserved next-turn precompute, or None when its render gave nothing
        (thread-safe; see :mod:`scheduler.precompute`). It runs only while the engine has
        nothing else to do, and is dropped when a request arrives."""
        self._inbox.put(("precompute", p))  # the reservation ends when the engine takes it
        if not self.alive:  # stopped meanwhile: nothing will take it
            self._notify_idle_state()

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request early (thread-safe); it leaves the batch on the engine's next step
        with a :class:`DoneEvent` whose finish reason is ``reason``: ``"cancelled"`` (the
        client left; counted as a cancellation) or ``"stop"`` (the gateway matched a stop
        string; counted as finished, and its prompt + completion are cached)."""
        self._inbox.put(("cancel", (request_id, reason)))

    def call(self, fn, timeout: float = 60.0):
        """Run ``fn()`` on the engine thread between steps and return its result.

        Raises:
            EngineDead: the engine is not running.
            TimeoutError: no answer within ``timeout`` seconds.
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

    @property
    def idle(self) -> bool:
        """No request waiting or running, no next-turn precompute pending (thread-safe)."""
        with self._idle:
            return self._is_idle

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no request is waiting or running; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while not self._is_idle:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def prime_metrics(self, tenants, cache_groups) -> None:
        """Create the per-tenant and per-cache-group series at 0 (thread-safe)."""
        for t in tenants:
            self.metrics.queue_time.labels(t)
            self.metrics.work.labels(t)
        self.prompt_cache.metrics.prime(cache_groups)

    @property
    def num_running(self) -> int:
        return len(self._batch.active)

    @property
    def num_waiting(self) -> int:
        return self._waiting_counts.total

    # ----------------------------------------------------------------- the loop
    def _run(self) -> None:
        try:
            self._batch.open()
            while not self._stopping:
                if not (self._batch.active or len(self._waiting)):
                    # Idle: block until something arrives, or until a precompute is due.
                    due = self.precomputes.seconds_until_due()
                    try:
                        self._handle(self._inbox.get(timeout=due) if due is None or due > 0 else
                                     self._inbox.get_nowait())
                    except queue.Empty:
                        pass
                while True:
                    try:
                        self._handle(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if self._stopping:
                    break
                if self.gather_wait > 0 and self.arrivals.preparing and len(self._waiting) and not self._batch.active:
                    self._gather()
                    if self._stopping:
                        break
                self._admit()
                if self._batch.active:
                    self._batch.step()
                if len(self._waiting) or self._batch.serving():
                    self.precomputes.hold()
                self._notify_idle()
        except BaseException as e:  # the engine itself broke: report, fail everyone
            self.error = e
            log.error("engine thread died:\n%s", traceback.format_exc())
        finally:
            reason = f"engine stopped: {self.error!r}" if self.error else self._stop_reason
            self._batch.drop_all(reason)
            for r in self._waiting.drain():
                self._send(r, [ErrorEvent(503, reason)])
            self._drain_inbox_after_stop(reason)
            self._batch.close()
            self.precomputes.clear()
            if self.error is None:
                self._persist_cache()
            self._waiting_counts.clear()
            self._notify_idle()

    def _gather(self) -> None:
        """Idle, with a request to start: take in the requests still being prepared, for at
        most ``gather_wait`` seconds (:func:`scheduler.arrivals.gather`)."""
        waited = gather(self.arrivals, self._inbox, self._handle, self.gather_wait, lambda: self._stopping)
        self.metrics.gather_wait.observe(waited)

    def _persist_cache(self) -> None:
        """At a graceful stop, hand the prompt cache's snapshots to its disk tier (if any)
        and wait for the writes (at most ``PERSIST_SECONDS``)."""
        try:
            n = self.prompt_cache.persist(timeout=PERSIST_SECONDS)
            if n:
                log.info("wrote %d prompt-cache snapshots to disk", n)
        except Exception:
            log.exception("writing the prompt cache to disk failed")

    def _drain_inbox_after_stop(self, reason: str) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._send(payload, [ErrorEvent(503, reason)])
            elif kind == "call":
                fn, box, done = payload
                box["error"] = EngineDead(reason)
                done.set()

    def _notify_idle(self) -> None:
        # After every loop turn, so that a cancelled or failed prefill leaves the gauge too.
        self.metrics.prefill_remaining.set(sum(
            len(a.request.tokens) - a.cached - a.processed for a in self._batch.active.values() if not a.decoding
        ))
        self.metrics.running.set(len(self._batch.active))
        self.metrics.waiting.set(self._waiting_counts.total)
        self._batch.update_rates(idle=not self._batch.active)
        self._notify_idle_state()

    def _notify_idle_state(self) -> None:
        with self._idle:
            running = not self._stopping and self.error is None
            self._is_idle = not (self._batch.active or len(self._waiting) or self._waiting_counts.total
                                 or (running and (len(self.precomputes) or self._reserved)))
            self._idle.notify_all()

    def _handle(self, item) -> None:
        kind, payload = item
        if kind == "submit":
            self._waiting.add(payload)
        elif kind == "precompute":
            with self._idle:
                self._reserved = max(0, self._reserved - 1)
            if payload is not None:
                self.precomputes.add(payload)
        elif kind == "cancel":
            self._cancel(*payload)
        elif kind == "call":
            fn, box, done = payload
            try:
                box["value"] = fn()
            except BaseException as e:
                box["error"] = e
            done.set()
        elif kind == "stop":
            self._stopping = True
        # "arrived" (a preparation ended, scheduler.arrivals) only wakes the loop.

    def _send(self, request: EngineRequest, events: list[Event]) -> None:
        try:
            request.sink(events)
        except Exception:  # a broken sink fails only its own request
            log.exception("sink of request %s raised", request.id)

    # ----------------------------------------------------------------- admission
    def _in_flight(self) -> list[InFlight]:
        return [
            InFlight(a.request, a.pending_snapshots) for a in self._batch.active.values() if not a.decoding
        ]

    def _admit(self) -> None:
        if len(self._waiting):
            self._batch.preempt_precomputes()
        prefilling = self._batch.num_prefilling()
        free = min(
            self.prompt_concurrency - prefilling,
            self.decode_concurrency - len(self._batch.active),
        )
        if free <= 0:
            return
        if not len(self._waiting):
            # Nothing else to do, and no request on its way: a due precompute may start.
            if not (self._batch.active or self.arrivals.preparing) and self.precomputes.seconds_until_due() == 0:
                self._start_precompute()
            return
        if self.pad_free_prefill and prefilling:
            return
        picks = self._waiting.pick(
            1 if self.pad_free_prefill else free,
            lambda r: self.prompt_cache.match_length(r.namespace, r.tokens),
            self._in_flight(),
            self.prompt_cache.version,
        )
        for admission in picks:
            self._waiting_counts.remove(admission.request)
            self._insert(admission)

    def _insert(self, admission: Admission) -> None:
        r = admission.request
        a = self._batch.start_row(r, admission.extra_checkpoints)
        if a is None:
            self.stats.failed += 1
            return
        cached = a.cached
        self.stats.admitted += 1
        self.stats.cached_tokens += cached
        self.admission_log.append(AdmissionRecord(r.id, r.tenant, len(r.tokens), cached))
        self.metrics.work.labels(r.tenant).inc(len(r.tokens) - cached)
        if admission.waited_for_prefix and cached:
            self.stats.grouping_saved_tokens += cached
            self.metrics.grouping_saved_tokens.inc(cached)
        self.metrics.queue_time.labels(r.tenant).observe(time.monotonic() - r.arrival)
        if cached:
            self.precomputes.on_hit(r.namespace, r.tokens, cached)
        self._send(r, [PromptEvent(cached, a.cache_source), ProgressEvent(cached, len(r.tokens))])

    # ----------------------------------------------------------------- precompute
    def _start_precompute(self) -> None:
        """Prefill the newest pending next-turn precompute (the engine has nothing else to
        do). It is snapshotted at its full length right after prefill, then
        leaves the batch without generating (:meth:`Batch._finish_precompute
        <scheduler.batch.Batch._finish_precompute>`)."""
        p = self.precomputes.pop()
        n = len(p.tokens)
        if n < 2 or self.prompt_cache.match_length(p.namespace, p.tokens) >= n - 1:
            self.precomputes.outcome("cached")
            return
        r = EngineRequest(p.id, p.tokens, SamplingParams(max_tokens=1), sink=lambda events: None,
                          checkpoints=[n], namespace=p.namespace, tenant=p.tenant)
        a = self._batch.start_row(r, background=True)
        if a is None:
            self.precomputes.outcome("failed")
            return
        a.precompute = p
        a.pending_snapshots = [n]  # the one snapshot it exists for

    def _cancel(self, request_id: str, reason: str = "cancelled") -> None:
        r = self._waiting.remove(request_id)
        if r is not None:
            self._waiting_counts.remove(r)
            self._send(r, [DoneEvent(reason)])
            self._count_early_end(reason)
            return
        if self._batch.cancel(request_id, reason):
            self._count_early_end(reason)

    def _count_early_end(self, reason: str) -> None:
        if reason == "cancelled":
            self.stats.cancelled += 1
            self.metrics.cancelled.inc()
        else:
            self.stats.finished += 1

