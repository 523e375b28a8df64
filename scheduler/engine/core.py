"""What one model's engine does on the engine loop's thread: admission, stepping, the
idle books. :class:`EngineCore` is the part the loop steps (:class:`scheduler.engine.loop.Engine`);
:class:`scheduler.engine.Engine` holds it and offers what other threads call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Optional

from mlx_lm.models.cache import make_prompt_cache
from prometheus_client import CollectorRegistry

from cache import PromptCacheManager
from cache.restore import always_trimmable
from scheduler.admission.arrivals import Arrivals
from scheduler.batch import DECODING, Batch
from scheduler.admission.classes import LatencyClasses
from scheduler.admission.memory import gate_for
from scheduler.admission.preemption import Reservations
from scheduler.batch.chunking import ChunkPlanner
from scheduler.batch.first_tokens import FirstTokenStore
from scheduler.batch.forward_cost import ForwardCost
from scheduler.engine.loop import EngineLoop
from scheduler.metrics import SchedulerMetrics
from scheduler.admission.policy import Admission, InFlight, WaitingQueue
from scheduler.admission.precompute import PrecomputeBook, PrecomputeMetrics
from scheduler.request import DoneEvent, EngineRequest, ErrorEvent, Event, ProgressEvent, PromptEvent, SamplingParams
from scheduler.speculative import SpeculationConfig
from scheduler.batch.rows import RECENT, AdmissionRecord, EngineStats, WaitingCounts

log = logging.getLogger("mlx_gateway.engine")

# Seconds a graceful stop waits for the prompt cache's snapshots to reach the disk tier.
PERSIST_SECONDS = 60.0


class EngineCore:
    """One model's waiting queue, batch and prefix cache, as the engine loop drives them
    (every method runs on the loop's thread but the idle books', which say so). See
    :class:`scheduler.engine.Engine` for the arguments."""

    def __init__(self, model, eos_token_ids: set[int], prompt_cache: PromptCacheManager, loop: EngineLoop, *,
                 prompt_concurrency: int, decode_concurrency: int, prefill_step_size: int, prefill_budget: float,
                 max_waiting: int, registry: Optional[CollectorRegistry], pad_free_prefill: bool, name: str,
                 speculation: SpeculationConfig = SpeculationConfig(), forward_cost: Optional[ForwardCost] = None):
        self.model = model
        self.name = name
        self.eos_token_ids = set(eos_token_ids)
        self.prompt_cache = prompt_cache
        self.prompt_concurrency = max(1, prompt_concurrency)
        self.decode_concurrency = max(self.prompt_concurrency, decode_concurrency)
        self.prefill_step_size = prefill_step_size
        self._loop = loop
        self.chunks = ChunkPlanner(prefill_step_size, prefill_budget, loop.decode_share, forward_cost)
        self.max_waiting = max_waiting
        self.pad_free_prefill = pad_free_prefill
        fresh = make_prompt_cache(model)
        self.trimmable = always_trimmable(fresh)
        draft = speculation.num_draft_tokens if speculation.method != "off" else 0
        self.memory = gate_for(model, fresh, prefill_step_size, draft)  # admission by predicted memory
        registry = registry or CollectorRegistry()
        self.metrics = SchedulerMetrics(registry)
        self.precomputes = PrecomputeBook(PrecomputeMetrics(registry))
        self.stats = EngineStats()
        # Recent admissions in order, for tests, benchmarks and debugging; bounded.
        self.admission_log: deque[AdmissionRecord] = deque(maxlen=RECENT)
        self.waiting = WaitingQueue(loop.fair)
        self.batch = Batch(model, self.eos_token_ids, prompt_concurrency=self.prompt_concurrency,
                           decode_concurrency=self.decode_concurrency, prefill_step_size=prefill_step_size,
                           trimmable=self.trimmable, prompt_cache=prompt_cache, chunks=self.chunks,
                           metrics=self.metrics, stats=self.stats, precomputes=self.precomputes, fair=loop.fair,
                           send=self.send, speculation=speculation,
                           first_tokens=FirstTokenStore(metrics=self.metrics))
        self.classes = LatencyClasses(self.waiting, self.batch, loop, self.metrics, self.prompt_concurrency,
                                       self.decode_concurrency)
        self._waiting_counts = WaitingCounts()  # submitted, not yet admitted or cancelled
        self.reservations = Reservations(self.memory, self.batch, self.classes.paused, self.waiting,
                                         self._waiting_counts, self.metrics, self.send)  # growth, preemption
        self.closed = False  # set on the loop thread when the engine leaves it
        self._idle = threading.Condition()
        self._is_idle = True  # updated between steps only, so readers see a consistent state
        self.error: Optional[BaseException] = None
        self._reserved = 0  # next-turn precomputes being rendered (Engine.reserve_precompute)
        # Requests the gateway is rendering and tokenizing; each one ending wakes the loop.
        self.arrivals = Arrivals(lambda: self._loop.post(("arrived", None)))

    # ----------------------------------------------------------------- the idle books (any thread)
    def enqueue(self, request: EngineRequest) -> None:
        """Count a submitted request as waiting (thread-safe).

        Raises:
            EngineOverloaded, TenantQueueFull: see :meth:`scheduler.engine.Engine.submit`.
        """
        self._waiting_counts.add(request, self.max_waiting)
        with self._idle:
            self._is_idle = False

    def reserve(self, limit: int) -> bool:
        """Count a next-turn precompute being rendered, unless ``limit`` already are (thread-safe)."""
        with self._idle:
            if self._reserved >= limit:
                return False
            self._reserved += 1
            self._is_idle = False
            return True

    @property
    def idle(self) -> bool:
        """No request waiting or running, no next-turn precompute pending (thread-safe)."""
        with self._idle:
            return self._is_idle

    def wait_idle(self, timeout: float) -> bool:
        """Block until :attr:`idle`; False after ``timeout`` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: self._is_idle, timeout)

    @property
    def num_waiting(self) -> int:
        """Requests submitted, not yet admitted or cancelled (thread-safe)."""
        return self._waiting_counts.total

    # ----------------------------------------------------------------- on the loop thread
    @property
    def has_waiting(self) -> bool:
        return bool(len(self.waiting))

    @property
    def has_rows(self) -> bool:
        return bool(self.batch.active)

    @property
    def busy(self) -> bool:
        """Rows in the batch, paused or requests waiting."""
        return self.has_rows or self.has_waiting or bool(self.classes.paused)

    @property
    def serving(self) -> bool:
        """Some row is a request (not a next-turn precompute)."""
        return self.batch.serving()

    @property
    def num_prefilling(self) -> int:
        return self.batch.num_prefilling()

    @property
    def prefill_class(self) -> int:
        """The best latency class among the rows prefilling (a next-turn precompute ranks
        below every class); 3 when none prefills."""
        return min((a.rank for a in self.batch.prefilling()), default=3)

    @property
    def interactive_busy(self) -> bool:
        """An interactive request waits for admission, prefills or decodes."""
        return 0 in self.waiting.classes() or any(a.rank == 0 for a in self.batch.active.values())

    @property
    def num_decoding(self) -> int:
        return sum(map(DECODING, self.batch.active.values()))

    def precompute_due(self) -> Optional[float]:
        """Seconds until a pending next-turn precompute may start; None if none."""
        return self.precomputes.seconds_until_due()

    def open_on_loop(self) -> None:
        """Make the batch generator (loop thread)."""
        self.batch.open()

    def close_on_loop(self, reason: str, persist: bool) -> None:
        """Leave the loop (loop thread): every waiting and running request ends with a 503
        ``reason``; with ``persist`` the prompt cache is written to its disk tier."""
        if self.closed:
            return
        self.closed = True
        self.batch.drop_all(reason)
        for a in self.classes.paused:
            self.send(a.request, [ErrorEvent(503, reason)])
            self.batch.insertion.drop_paused(a)
        self.classes.paused.clear()
        for r in self.waiting.drain():
            self.send(r, [ErrorEvent(503, reason)])
        self.batch.close()
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
            self.waiting.add(payload)
        elif kind == "precompute":
            self.end_reservation()
            if payload is not None:
                self.precomputes.add(payload)
        elif kind == "cancel":
            self._cancel(*payload)

    def refuse(self, kind: str, payload, reason: str) -> None:
        """An inbox item that arrived after the engine left its loop (any thread)."""
        if kind == "submit":
            self._waiting_counts.remove(payload)
            self.send(payload, [ErrorEvent(503, reason)])
        elif kind == "precompute":
            self.end_reservation()

    def admit(self, preempt: bool, quiet: bool) -> None:
        """Admit waiting requests into free batch slots (loop thread).

        Args:
            preempt: a request waits in some engine of the loop: drop running precomputes.
            quiet: no engine of the loop has a request waiting, running or being
                prepared: a due next-turn precompute may start.
        """
        if preempt:
            self.batch.preempt_precomputes()
        self.reservations.grow()
        if not (len(self.waiting) or self.classes.paused or self.batch.num_prefilling()):
            # decoding rows alone (or none): nothing to resume, pause or admit (a turn's checks below, skipped)
            if quiet and not self.batch.active and self.precomputes.seconds_until_due() == 0:
                self._start_precompute()
            return
        back = self.classes.resume_streams()
        allowed = self.classes.allowed()
        self.classes.make_room(spare=back)
        prefilling = self.batch.num_prefilling()
        free = min(self.prompt_concurrency - prefilling, self.decode_concurrency - len(self.batch.active))
        if free <= 0 or not len(self.waiting):
            return
        if self.pad_free_prefill and prefilling:
            return
        n = 1 if self.pad_free_prefill else free
        picks = self.reservations.take_resumed(n, allowed)  # preempted rows first
        lower_room = self.classes.lower_room()
        if lower_room is not None:  # interactive first, then the lower classes within their room
            classes = {0, 1, 2} if allowed is None else allowed
            picks += self._pick(n - len(picks), classes & {0})
            picks += self._pick(min(n - len(picks), lower_room), classes - {0})
        else:
            picks += self._pick(n - len(picks), allowed)
        for i, admission in enumerate(picks):
            verdict = self.reservations.verdict(admission.request)
            if verdict == "wait":
                self.reservations.put_back(picks[i:], self._matched)
                return
            self._waiting_counts.remove(admission.request)
            if verdict == "fits":
                try:
                    self._insert(admission)
                except BaseException:  # the engine stops: this request is told, the rest wait to be ended
                    self.send(admission.request, [ErrorEvent(500, "the engine failed admitting the request")])
                    self.reservations.put_back(picks[i + 1:], self._matched)
                    raise

    def _matched(self, r: EngineRequest) -> int:
        """Tokens of ``r``'s prompt the prefix cache holds now."""
        return self.prompt_cache.match_length(r.namespace, r.tokens)

    def _pick(self, n: int, classes: Optional[set[int]]) -> list[Admission]:
        if n <= 0 or (classes is not None and not classes):
            return []
        in_flight = [InFlight(a.request, a.pending_snapshots) for a in self.batch.prefilling()]
        return self.waiting.pick(n, self._matched, in_flight, self.prompt_cache.version, classes)

    def step(self, decode_only: bool = False, decoding_elsewhere: int = 0, share: float = 1.0) -> None:
        """One step of the batch (loop thread): see :meth:`Batch.step`. While interactive
        requests are about (:attr:`EngineLoop.interactive_recent`), a step that prefills
        a lower class is cut to the loop's interactive budget (or one decode step,
        when longer), so that the next interactive request waits at most about that long;
        while an interactive row decodes, lower classes do not prefill
        (:meth:`LatencyClasses.streams_first <scheduler.admission.classes.LatencyClasses.streams_first>`)."""
        lower = any(a.rank > 0 for a in self.batch.prefilling())
        decode_only = decode_only or (lower and self.classes.streams_first())
        recent = lower and self._loop.interactive_recent()
        cap = max(self._loop.interactive_budget, self.chunks.decode_step) if recent else None
        self.batch.step(decode_only=decode_only, decoding_elsewhere=decoding_elsewhere, cap=cap, share=share)

    def end_turn(self, hold: bool) -> None:
        """After a loop turn: hold precomputes back while some engine serves (``hold``),
        and publish the gauges and the idle state."""
        if hold:
            self.precomputes.hold()
        self._notify_idle()

    def end_reservation(self) -> None:
        """A reserved next-turn precompute was taken or dropped (any thread)."""
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
        active = self.batch.active
        queued = self.waiting.count_by_class()
        for a in self.classes.paused:
            queued[a.request.priority] = queued.get(a.request.priority, 0) + 1
        filling = self.batch.prefilling()
        self.metrics.publish_queue(sum(a.prompt_left for a in filling) if filling else 0, len(active),
                                   self._waiting_counts.total, queued)
        self.batch.rates.publish(idle=not active)
        self._notify_idle_state()

    def _notify_idle_state(self) -> None:
        if self.batch.active and not self._is_idle:  # busy, as it was: nothing to update (the lock not taken)
            return
        with self._idle:
            running = not self.closed and self.error is None
            self._is_idle = not (self.batch.active or self.classes.paused or len(self.waiting)
                                 or self._waiting_counts.total or (running and (len(self.precomputes) or self._reserved)))
            if self._is_idle:  # (a waiter waits for idle: a busy engine staying busy wakes no one)
                self._idle.notify_all()

    def send(self, request: EngineRequest, events: list[Event]) -> None:
        try:
            request.sink(events)
        except Exception:  # a broken sink fails only its own request
            log.exception("sink of request %s raised", request.id)

    # ----------------------------------------------------------------- admission
    def _insert(self, admission: Admission) -> None:
        r = admission.request
        carry = getattr(r, "carry", None)  # a preempted row's (scheduler.admission.preemption)
        a = self.batch.insertion.start_row(r, admission.extra_checkpoints, carry=carry)
        if a is None:
            self.stats.failed += 1
            return
        self.reservations.admitted(a)
        if carry is not None:  # it goes on: counted when first admitted
            return
        cached = a.cached
        if r.priority == 0:
            self._loop.saw_interactive()
        self.stats.admitted += 1
        self.stats.cached_tokens += cached
        self.admission_log.append(AdmissionRecord(r.id, r.tenant, len(r.tokens), cached))
        self.metrics.work_of(r.tenant).inc(len(r.tokens) - cached)
        if admission.waited_for_prefix and cached:
            self.stats.grouping_saved_tokens += cached
            self.metrics.grouping_saved_tokens.inc(cached)
        self.metrics.queue_time.labels(r.tenant).observe(time.monotonic() - r.arrival)
        if cached:
            self.precomputes.on_hit(r.namespace, r.tokens, cached)
        self.send(r, [PromptEvent(cached, a.cache_source), ProgressEvent(cached, len(r.tokens))])

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
        a = self.batch.insertion.start_row(r, background=True)  # snapshots at n, the one it exists for
        if a is None:
            self.precomputes.outcome("failed")
            return
        a.precompute = p

    def _cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """End ``request_id`` early, paused, waiting or in the batch, and count it."""
        paused = next((a for a in self.classes.paused if a.request.id == request_id), None)
        r = self.waiting.remove(request_id) if paused is None else None
        if paused is not None:
            self.classes.paused.remove(paused)
            self.batch.insertion.drop_paused(paused)
            self.send(paused.request, [DoneEvent(reason)])
        elif r is not None:
            self._waiting_counts.remove(r)
            self.send(r, [DoneEvent(reason)])
        elif not self.batch.cancel(request_id, reason):
            return
        if reason == "cancelled":
            self.stats.cancelled += 1
            self.metrics.cancelled.inc()
        else:
            self.stats.finished += 1


