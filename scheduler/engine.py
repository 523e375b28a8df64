"""The engine of one model: its waiting queue, its running batch and its prefix cache.

Every MLX call happens on the engine loop's thread (:mod:`scheduler.loop`), which
serves the engines of every model: an engine started alone gets a loop of its own. The
async side talks to it through the loop's thread-safe inbox (``submit``, ``cancel``,
``call``) and receives events through each request's ``sink``. The loop blocks on the
inbox only when there is no work, so a new request is admitted on the next step, never
after a timer (mlx-lm's server polls every 0.1 s and runs 0.5 s budgets; see the
project's field notes).

The engine decides what enters its batch and when (admission, next-turn precomputes);
the running batch itself is :class:`scheduler.batch.Batch`. It owns its prefix cache:
the gateway asks it to flush, set quotas or report (:meth:`Engine.flush_cache`,
:meth:`Engine.set_cache_quotas`, :meth:`Engine.cache_bytes`), never the cache itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional

from mlx_lm.models.cache import make_prompt_cache
from prometheus_client import CollectorRegistry

from cache import PromptCacheManager
from cache.restore import always_trimmable
from scheduler.arrivals import Arrivals
from scheduler.batch import Batch
from scheduler.chunking import ChunkPlanner
from scheduler.fairness import FairShare
from scheduler.loop import EngineLoop
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
    """Serves :class:`EngineRequest` s on one model, from an :class:`EngineLoop` thread.

    Args:
        model: an mlx-lm model (``mlx_lm.load``).
        eos_token_ids: token ids that end a generation.
        prompt_cache: the prefix-cache manager, owned by the engine from now on;
            snapshots are saved at each request's checkpoints and after it finishes
            (prompt + completion).
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
            Used by the loop :meth:`start` makes; a shared loop has its own.
        loop: the engine loop to run on (shared by every model of a gateway); None: the
            loop :meth:`start` makes for this engine alone.
        name: the served model's name, for logs.
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
        loop: Optional[EngineLoop] = None,
        name: str = "model",
    ):
        self.model = model
        self.name = name
        self.eos_token_ids = set(eos_token_ids)
        self.prompt_cache = prompt_cache
        self.prompt_concurrency = max(1, prompt_concurrency)
        self.decode_concurrency = max(self.prompt_concurrency, decode_concurrency)
        self.prefill_step_size = prefill_step_size
        self._loop = loop
        self._own_loop = loop is None
        if self._own_loop:
            self._loop = EngineLoop(gather_wait=gather_wait)
        self.chunks = ChunkPlanner(prefill_step_size, prefill_budget, self._loop.decode_share)
        self.max_waiting = max_waiting
        self.pad_free_prefill = pad_free_prefill
        self.trimmable = always_trimmable(make_prompt_cache(model))
        registry = registry or CollectorRegistry()
        self.metrics = SchedulerMetrics(registry)
        self.precomputes = PrecomputeBook(PrecomputeMetrics(registry))
        self.stats = EngineStats()
        # Recent admissions in order, for tests, benchmarks and debugging; bounded.
        self.admission_log: deque[AdmissionRecord] = deque(maxlen=RECENT)

        fair: FairShare = self._loop.fair
        self._waiting = WaitingQueue(fair)
        self._batch = Batch(
            model, self.eos_token_ids, prompt_concurrency=self.prompt_concurrency,
            decode_concurrency=self.decode_concurrency, prefill_step_size=prefill_step_size,
            trimmable=self.trimmable, prompt_cache=prompt_cache, chunks=self.chunks, metrics=self.metrics,
            stats=self.stats, precomputes=self.precomputes, fair=fair, send=self._send,
        )
        self._started = False
        self._closed = False  # set on the loop thread when the engine leaves it
        self._idle = threading.Condition()
        self._is_idle = True  # updated between steps only, so readers see a consistent state
        self.error: Optional[BaseException] = None
        self._waiting_counts = WaitingCounts()  # submitted, not yet admitted or cancelled
        self._reserved = 0  # next-turn precomputes being rendered (reserve_precompute)
        # Requests the gateway is rendering and tokenizing; each one ending wakes the loop.
        self.arrivals = Arrivals(lambda: self._loop.post(("arrived", None)))

    # ----------------------------------------------------------------- public API
    @property
    def loop(self) -> EngineLoop:
        """The loop this engine runs on."""
        return self._loop

    @property
    def alive(self) -> bool:
        """True while the engine is served by a running loop."""
        return self._started and not self._closed and self.error is None and self._loop.alive

    def start(self, timeout: float = 60.0) -> None:
        """Start serving: on a loop of its own (started here), or attached to the shared
        loop given at construction (opened on its thread between two steps).

        Raises:
            EngineDead, TimeoutError: the shared loop is not running or did not take it.
        """
        self._loop.attach(self, timeout)
        self._started = True
        if self._own_loop:
            self._loop.start()

    def stop(self, timeout: float = 10.0, reason: str = "engine stopped") -> None:
        """Stop serving; requests still waiting or running end with a 503 error event
        whose message is ``reason``. With a disk tier, the prompt cache is written to it
        first. An engine on a loop of its own stops that loop; one on a shared loop
        leaves it (the model is unloaded) and the loop serves the others."""
        if self._own_loop:
            self._loop.stop(timeout, reason)
        elif self._started:
            try:
                self._loop.detach(self, reason, timeout)
            except TimeoutError:
                log.warning("the engine loop did not release %s within %g s", self.name, timeout)

    def submit(self, request: EngineRequest) -> None:
        """Queue a request (thread-safe).

        Raises:
            EngineDead: the engine is not running.
            EngineOverloaded: ``max_waiting`` requests are already waiting.
            TenantQueueFull: ``request.max_queued`` requests of its tenant are waiting.
        """
        if not self.alive:
            raise EngineDead(f"engine is not running: {self.error!r}")
        self._waiting_counts.add(request, self.max_waiting)
        with self._idle:
            self._is_idle = False
        self._post("submit", request)

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
        (thread-safe; see :mod:`scheduler.precompute`). It runs only while no engine of the
        loop has anything else to do, and is dropped when a request arrives."""
        self._post("precompute", p)  # the reservation ends when the engine takes it
        if not self.alive:  # stopped meanwhile: nothing will take it
            self._end_reservation()

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End a request early (thread-safe); it leaves the batch on the engine's next step
        with a :class:`DoneEvent` whose finish reason is ``reason``: ``"cancelled"`` (the
        client left; counted as a cancellation) or ``"stop"`` (the gateway matched a stop
        string; counted as finished, and its prompt + completion are cached)."""
        self._post("cancel", (request_id, reason))

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn()`` on the engine thread between steps and return its result.

        Raises:
            EngineDead: the engine is not running.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        if not self.alive:
            raise EngineDead("engine is not running")
        return self._loop.call(fn, timeout)

    # The prefix cache, asked for through the engine (its snapshots are MLX arrays:
    # whatever may free them runs on the engine thread).
    def flush_cache(self, cache_group: Optional[str] = None, timeout: float = 60.0) -> int:
        """Drop the unleased prefix-cache snapshots of ``cache_group`` (every group when
        None), on the engine thread; returns how many were dropped. Blocks the caller.

        Raises:
            EngineDead, TimeoutError: see :meth:`call`.
        """
        return self.call(lambda: self.prompt_cache.flush(cache_group), timeout)

    def set_cache_quotas(self, quotas: Callable[[], dict[str, int]], timeout: float = 60.0) -> Future:
        """Apply per-cache-group byte quotas on the engine thread (a smaller one evicts
        snapshots), without waiting: safe from a signal handler on the event loop.
        ``quotas()`` is read when it runs, so two posts applied in either order leave the
        newest table.

        Returns:
            A Future done once they are applied; it holds :class:`EngineDead`,
            :class:`TimeoutError` or the error raised if they could not be.
        """
        return self._post_call(lambda: self.prompt_cache.set_quotas(quotas()), timeout)

    def kv_bytes(self, timeout: float = 60.0) -> int:
        """Bytes of the running batch's KV caches (asked on the engine thread; 0 when idle).

        Raises:
            EngineDead, TimeoutError: see :meth:`call`.
        """
        return self.call(self._batch.kv_bytes, timeout)

    @property
    def cache_bytes(self) -> int:
        """Bytes the prefix cache holds (thread-safe read)."""
        return self.prompt_cache.nbytes

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

    # ----------------------------------------------------------------- posting
    def _post(self, kind: str, payload) -> None:
        self._loop.post(("engine", (self, kind, payload)))
        if not self._loop.alive and self._started:  # the loop died between the check and the put
            self._loop.drain_after_stop(f"engine stopped: {self._loop.error!r}")

    def _post_call(self, fn: Callable[[], Any], timeout: float) -> Future:
        done: Future = Future()

        def wait() -> None:
            try:
                done.set_result(self.call(fn, timeout))
            except BaseException as e:
                log.warning("a call posted to the engine of %s failed: %r", self.name, e)
                done.set_exception(e)

        threading.Thread(target=wait, name="engine-call-waiter", daemon=True).start()
        return done

    # ----------------------------------------------------------------- on the loop thread
    @property
    def has_waiting(self) -> bool:
        return bool(len(self._waiting))

    @property
    def has_rows(self) -> bool:
        return bool(self._batch.active)

    @property
    def busy(self) -> bool:
        """Rows in the batch or requests waiting."""
        return self.has_rows or self.has_waiting

    @property
    def serving(self) -> bool:
        """Some row is a request (not a next-turn precompute)."""
        return self._batch.serving()

    @property
    def num_prefilling(self) -> int:
        return self._batch.num_prefilling()

    @property
    def num_decoding(self) -> int:
        return len(self._batch.active) - self._batch.num_prefilling()

    def precompute_due(self) -> Optional[float]:
        """Seconds until a pending next-turn precompute may start; None if none."""
        return self.precomputes.seconds_until_due()

    def open_on_loop(self) -> None:
        """Make the batch generator (loop thread)."""
        self._batch.open()

    def close_on_loop(self, reason: str, persist: bool) -> None:
        """Leave the loop (loop thread): every waiting and running request ends with a 503
        ``reason``; with ``persist`` the prompt cache is written to its disk tier."""
        if self._closed:
            return
        self._closed = True
        self._batch.drop_all(reason)
        for r in self._waiting.drain():
            self._send(r, [ErrorEvent(503, reason)])
        self._batch.close()
        self.precomputes.clear()
        if persist:
            self._persist_cache()
        self._waiting_counts.clear()
        with self._idle:
            self._reserved = 0
        self._notify_idle()

    def handle(self, kind: str, payload) -> None:
        """An inbox item for this engine (loop thread)."""
        if kind == "submit":
            self._waiting.add(payload)
        elif kind == "precompute":
            self._end_reservation()
            if payload is not None:
                self.precomputes.add(payload)
        elif kind == "cancel":
            self._cancel(*payload)

    def refuse(self, kind: str, payload, reason: str) -> None:
        """An inbox item that arrived after the engine left its loop (any thread)."""
        if kind == "submit":
            self._waiting_counts.remove(payload)
            self._send(payload, [ErrorEvent(503, reason)])
        elif kind == "precompute":
            self._end_reservation()

    def admit(self, preempt: bool, quiet: bool) -> None:
        """Admit waiting requests into free batch slots (loop thread).

        Args:
            preempt: a request waits in some engine of the loop: drop running precomputes.
            quiet: no engine of the loop has a request waiting, running or being
                prepared: a due next-turn precompute may start.
        """
        if preempt:
            self._batch.preempt_precomputes()
        prefilling = self._batch.num_prefilling()
        free = min(
            self.prompt_concurrency - prefilling,
            self.decode_concurrency - len(self._batch.active),
        )
        if free <= 0:
            return
        if not len(self._waiting):
            if quiet and not self._batch.active and self.precomputes.seconds_until_due() == 0:
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

    def step(self, decode_only: bool = False, decoding_elsewhere: int = 0) -> None:
        """One step of the batch (loop thread): see :meth:`Batch.step`."""
        self._batch.step(decode_only=decode_only, decoding_elsewhere=decoding_elsewhere)

    def end_turn(self, hold: bool) -> None:
        """After a loop turn: hold precomputes back while some engine serves (``hold``),
        and publish the gauges and the idle state."""
        if hold:
            self.precomputes.hold()
        self._notify_idle()

    # ----------------------------------------------------------------- internals
    def _end_reservation(self) -> None:
        with self._idle:
            self._reserved = max(0, self._reserved - 1)
        self._notify_idle_state()

    def _persist_cache(self) -> None:
        """Hand the prompt cache's snapshots to its disk tier (if any) and wait for the
        writes (at most ``PERSIST_SECONDS``)."""
        try:
            n = self.prompt_cache.persist(timeout=PERSIST_SECONDS)
            if n:
                log.info("wrote %d prompt-cache snapshots to disk (model %s)", n, self.name)
        except Exception:
            log.exception("writing the prompt cache of %s to disk failed", self.name)

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
            running = not self._closed and self.error is None
            self._is_idle = not (self._batch.active or len(self._waiting) or self._waiting_counts.total
                                 or (running and (len(self.precomputes) or self._reserved)))
            self._idle.notify_all()

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
        a = self._batch.start_row(r, background=True)  # snapshots at n, the one it exists for
        if a is None:
            self.precomputes.outcome("failed")
            return
        a.precompute = p

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

