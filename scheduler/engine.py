"""The engine: one thread that owns the model, the caches and the batch.

Every MLX call happens on this thread. The async side talks to it through a
thread-safe inbox (``submit``, ``cancel``) and receives events through each request's
``sink``. The loop blocks on the inbox only when there is no work, so a new request is
admitted on the next step, never after a timer (mlx-lm's server polls every 0.1 s and
runs 0.5 s budgets; see the project's field notes).

Batching is mlx-lm's ``BatchGenerator`` (continuous batching with left padding). A
request's prompt is inserted as *segments* cut at its own checkpoint offsets, so
prefill never crosses a checkpoint and each request's snapshot is extracted at exactly
its own boundary, whatever the other rows of the batch are doing.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache
from prometheus_client import CollectorRegistry

from cache import PromptCacheManager
from cache.restore import always_trimmable
from scheduler.chunking import ChunkPlanner
from scheduler.faults import RowFault
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
    TokenEvent,
)
from scheduler.sampling import greedy, make_processors, make_sampler

log = logging.getLogger("mlx_gateway.engine")

_RECENT = 4096  # requests remembered in admission_log and stats.generated_by_request


# Seconds a graceful stop waits for the prompt cache's snapshots to reach the disk tier.
PERSIST_SECONDS = 60.0


class EngineDead(RuntimeError):
    """The engine thread has stopped; no request can be served (HTTP 503)."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (HTTP 503 with Retry-After)."""


class TenantQueueFull(RuntimeError):
    """The tenant already has ``max_queued`` requests waiting (HTTP 429 with Retry-After)."""


@dataclass(frozen=True)
class AdmissionRecord:
    """One admission, as the scheduler decided it (tokens).

    ``work`` is the uncached prompt tokens charged to the tenant at admission.
    """

    request_id: str
    tenant: str
    prompt_tokens: int
    cached_tokens: int

    @property
    def work(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass
class _Active:
    request: EngineRequest
    uid: int
    lease: Any
    cached: int
    pending_snapshots: list[int]
    processed: int = 0
    generated: int = 0
    decoding: bool = False
    stored: int = 0  # longest prompt prefix this request stored in the prefix cache (tokens)
    fault: RowFault = field(default_factory=RowFault)
    precompute: Optional[Precompute] = None  # a next-turn precompute: no client, lowest priority
    cache_source: str = "memory"  # where its cached prefix came from: "memory" or "disk"

    def error(self) -> Optional[str]:
        """Why this row must fail now (its sampler, a processor or its grammar raised), or None."""
        if self.fault.error is not None:
            return f"sampling failed: {self.fault.error}"
        mask = self.request.mask
        if mask is not None and mask.error is not None:
            return f"constrained decoding failed: {mask.error}"
        return None


@dataclass
class EngineStats:
    """Counters read by tests and benchmarks (tokens unless noted)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    steps: int = 0
    snapshots_saved: int = 0
    grouping_saved_tokens: int = 0
    max_prefill_batch: int = 0
    max_decode_batch: int = 0
    generated_by_request: dict[str, int] = field(default_factory=dict)  # last 4096 requests


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
    ):
        self.model = model
        self.eos_token_ids = set(eos_token_ids)
        self.prompt_cache = prompt_cache
        self.prompt_concurrency = max(1, prompt_concurrency)
        self.decode_concurrency = max(self.prompt_concurrency, decode_concurrency)
        self.prefill_step_size = prefill_step_size
        self.chunks = ChunkPlanner(prefill_step_size, prefill_budget)
        self.max_waiting = max_waiting
        self.pad_free_prefill = pad_free_prefill
        self.trimmable = always_trimmable(make_prompt_cache(model))
        registry = registry or CollectorRegistry()
        self.metrics = SchedulerMetrics(registry)
        self.precomputes = PrecomputeBook(PrecomputeMetrics(registry))
        self.stats = EngineStats()
        # Recent admissions in order, for tests, benchmarks and debugging; bounded.
        self.admission_log: deque[AdmissionRecord] = deque(maxlen=_RECENT)

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting = WaitingQueue()
        self._active: dict[int, _Active] = {}
        self._by_id: dict[str, _Active] = {}
        self._gen: Optional[BatchGenerator] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._stop_reason = "engine stopped"
        self._step_prefilled_at = 0.0
        self._idle = threading.Condition()
        self._is_idle = True  # updated between steps only, so readers see a consistent state
        self.error: Optional[BaseException] = None
        self._waiting_count = 0  # submitted, not yet admitted or cancelled
        self._reserved = 0  # next-turn precomputes being rendered (reserve_precompute)
        self._waiting_by_tenant: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._rate_window = [time.monotonic(), 0, 0]  # [start, prefill tokens, decode tokens]

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
        t = request.tenant
        with self._count_lock:
            if self._waiting_count >= self.max_waiting:
                raise EngineOverloaded(f"{self._waiting_count} requests are already waiting")
            mine = self._waiting_by_tenant.get(t, 0)
            if request.max_queued is not None and mine >= request.max_queued:
                raise TenantQueueFull(f"{mine} requests of this tenant are already waiting")
            self._waiting_count += 1
            self._waiting_by_tenant[t] = mine + 1
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
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        return self._waiting_count

    # ----------------------------------------------------------------- the loop
    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            max_tokens=1 << 30,
            sampler=greedy,
            completion_batch_size=self.decode_concurrency,
            prefill_batch_size=self.prompt_concurrency,
            prefill_step_size=self.prefill_step_size,
        )

    def _run(self) -> None:
        try:
            self._gen = self._new_generator()
            while not self._stopping:
                if not (self._active or len(self._waiting)):
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
                self._admit()
                if self._active:
                    self._step()
                self._notify_idle()
        except BaseException as e:  # the engine itself broke: report, fail everyone
            self.error = e
            log.error("engine thread died:\n%s", traceback.format_exc())
        finally:
            reason = f"engine stopped: {self.error!r}" if self.error else self._stop_reason
            for a in list(self._active.values()):
                self._send(a.request, [ErrorEvent(503, reason)])
                self.prompt_cache.release(a.lease)
            self._active.clear()
            self._by_id.clear()
            for r in self._waiting.drain():
                self._send(r, [ErrorEvent(503, reason)])
            self._drain_inbox_after_stop(reason)
            self._drop_generator()
            self.precomputes.clear()
            if self.error is None:
                self._persist_cache()
            with self._count_lock:
                self._waiting_count = 0
                self._waiting_by_tenant.clear()
            self._notify_idle()

    def _persist_cache(self) -> None:
        """At a graceful stop, hand the prompt cache's snapshots to its disk tier (if any)
        and wait for the writes (at most ``PERSIST_SECONDS``)."""
        try:
            n = self.prompt_cache.persist(timeout=PERSIST_SECONDS)
            if n:
                log.info("wrote %d prompt-cache snapshots to disk", n)
        except Exception:
            log.exception("writing the prompt cache to disk failed")

    def _drop_generator(self) -> None:
        """Close the batch generator and drop it here, so that its clean-up (it restores
        Metal's wired-memory limit) runs on the engine thread, not wherever the garbage
        collector would find it."""
        gen, self._gen = self._gen, None
        if gen is not None:
            try:
                gen.close()
            except Exception:
                log.exception("closing the batch generator failed")
            del gen

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

    def _uncount_waiting(self, request: EngineRequest) -> None:
        with self._count_lock:
            self._waiting_count -= 1
            left = self._waiting_by_tenant.get(request.tenant, 1) - 1
            if left > 0:
                self._waiting_by_tenant[request.tenant] = left
            else:
                self._waiting_by_tenant.pop(request.tenant, None)

    def _notify_idle(self) -> None:
        # After every loop turn, so that a cancelled or failed prefill leaves the gauge too.
        self.metrics.prefill_remaining.set(sum(
            len(a.request.tokens) - a.cached - a.processed for a in self._active.values() if not a.decoding
        ))
        self.metrics.running.set(len(self._active))
        self.metrics.waiting.set(self._waiting_count)
        self._update_rates(idle=not self._active)
        self._notify_idle_state()

    def _notify_idle_state(self) -> None:
        with self._idle:
            running = not self._stopping and self.error is None
            self._is_idle = not (self._active or len(self._waiting) or self._waiting_count
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

    def _send(self, request: EngineRequest, events: list[Event]) -> None:
        try:
            request.sink(events)
        except Exception:  # a broken sink fails only its own request
            log.exception("sink of request %s raised", request.id)

    # ----------------------------------------------------------------- admission
    def _num_prefilling(self) -> int:
        return sum(1 for a in self._active.values() if not a.decoding)

    def _in_flight(self) -> list[InFlight]:
        return [
            InFlight(a.request, a.pending_snapshots) for a in self._active.values() if not a.decoding
        ]

    def _admit(self) -> None:
        if len(self._waiting):
            self._preempt_precomputes()
        prefilling = self._num_prefilling()
        free = min(
            self.prompt_concurrency - prefilling,
            self.decode_concurrency - len(self._active),
        )
        if free <= 0:
            return
        if not len(self._waiting):
            if not self._active and self.precomputes.seconds_until_due() == 0:  # nothing else to do
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
            self._uncount_waiting(admission.request)
            self._insert(admission)

    def _start_row(self, r: EngineRequest, extra_checkpoints=(), background: bool = False) -> Optional[_Active]:
        """Fetch ``r``'s cached prefix and put its prompt into the batch, cut into segments at
        its checkpoints; None (``r`` failed with a 500) if that raised. A ``background``
        row's lookup stays out of the hit-rate metrics."""
        lease = None
        r.timings["engine_admitted"] = time.monotonic()
        try:
            hit = self.prompt_cache.fetch(r.namespace, r.tokens, count=not background)
            r.timings["engine_restored"] = time.monotonic()
            lease, cached = hit.lease, hit.cached_tokens
            marks = sorted({p for p in [*r.checkpoints, *extra_checkpoints] if cached < p < len(r.tokens)})
            cuts = [cached, *marks, len(r.tokens)]
            segments = [r.tokens[a:b] for a, b in zip(cuts, cuts[1:])]
            stop = StopSequences([[t] for t in sorted(self.eos_token_ids)])
            fault = RowFault()
            processors = make_processors(r.params) + ([r.mask] if r.mask is not None else [])
            (uid,) = self._gen.insert_segments(
                [segments],
                max_tokens=[r.params.max_tokens],
                caches=[hit.cache],
                all_tokens=[list(r.tokens[:cached])],
                samplers=[fault.sampler(make_sampler(r.params))],
                logits_processors=[fault.processors(processors)],
                stop_sequences=[stop],
            )
        except Exception as e:
            self.prompt_cache.release(lease)
            log.exception("request %s could not be admitted", r.id)
            self._send(r, [ErrorEvent(500, f"could not start the request: {e}")])
            return None
        # Caches that cannot be trimmed also get a snapshot where the final one-token
        # segment starts, len-1 (exact repeats), and at len right after prefill when the
        # next turn shares the whole prompt.
        n = len(r.tokens)
        snapshots = list(marks)
        if not self.trimmable:  # a trimmable cache gets both from the prompt + completion snapshot
            snapshots += [*([n - 1] if n - 1 > cached else []), *([n] if n in r.checkpoints and n > cached else [])]
        active = _Active(r, uid, lease, cached, sorted(set(snapshots)), fault=fault, cache_source=hit.source)
        self._active[uid] = active
        self._by_id[r.id] = active
        return active

    def _insert(self, admission: Admission) -> None:
        r = admission.request
        a = self._start_row(r, admission.extra_checkpoints)
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
        leaves the batch without generating (:meth:`_finish_precompute`)."""
        p = self.precomputes.pop()
        n = len(p.tokens)
        if n < 2 or self.prompt_cache.match_length(p.namespace, p.tokens) >= n - 1:
            self.precomputes.outcome("cached")
            return
        r = EngineRequest(p.id, p.tokens, SamplingParams(max_tokens=1), sink=lambda events: None,
                          checkpoints=[n], namespace=p.namespace, tenant=p.tenant)
        a = self._start_row(r, background=True)
        if a is None:
            self.precomputes.outcome("failed")
            return
        a.precompute = p
        a.pending_snapshots = [n]  # the one snapshot it exists for

    def _finish_precompute(self, a: _Active) -> None:
        """``a``'s prefix is stored (or could not be): take it out of the batch."""
        self._gen.remove([a.uid])
        self._finish(a, DoneEvent("stop"))  # its sink discards events
        if a.stored >= len(a.request.tokens):
            self.precomputes.stored(a.precompute, a.cached)
        else:
            self.precomputes.outcome("failed")

    def _preempt_precomputes(self) -> None:
        """A request waits: drop every precompute in the batch now (its finished chunks are
        lost; at most one chunk of work delayed the request)."""
        for a in [a for a in self._active.values() if a.precompute is not None]:
            self._gen.remove([a.uid])
            self._finish(a, DoneEvent("cancelled"))  # its sink discards events
            self.precomputes.outcome("preempted")

    def _cancel(self, request_id: str, reason: str = "cancelled") -> None:
        r = self._waiting.remove(request_id)
        if r is not None:
            self._uncount_waiting(r)
            self._send(r, [DoneEvent(reason)])
            self._count_early_end(reason)
            return
        a = self._by_id.get(request_id)
        if a is None:
            return
        # A complete answer is cached like any other; so is a cancelled one's prompt on a
        # trimmable cache, which keeps no len-1 snapshot (a client's regenerate is often a
        # cancel and the same prompt again).
        if a.decoding and (reason == "stop" or self.trimmable):
            try:
                extracted = self._gen.extract_cache([a.uid]).get(a.uid)
            except Exception:
                log.exception("extracting the cache of request %s failed", a.request.id)
                extracted = None
            if extracted is not None:
                self._save_snapshot(a, extracted[1], extracted[0])
        self._gen.remove([a.uid])
        self._finish(a, DoneEvent(reason, max(0, a.stored - a.cached)))
        self._count_early_end(reason)

    def _count_early_end(self, reason: str) -> None:
        if reason == "cancelled":
            self.stats.cancelled += 1
            self.metrics.cancelled.inc()
        else:
            self.stats.finished += 1

    def _finish(self, a: _Active, event: Event, before: Optional[list[Event]] = None) -> None:
        """Drop ``a`` from the engine, release its lease, send ``before`` then ``event``."""
        self._active.pop(a.uid, None)
        self._by_id.pop(a.request.id, None)
        self.prompt_cache.release(a.lease)
        a.lease = None
        self._send(a.request, [*(before or []), event])

    # ----------------------------------------------------------------- stepping
    def _step(self) -> None:
        prefilling = self._num_prefilling()
        decoding = len(self._active) - prefilling
        if prefilling and not decoding and all(a.precompute is not None for a in self._active.values()):
            chunk = self.chunks.idle_chunk(prefilling)  # preemptible: a request waits at most one chunk
        else:
            chunk = self.chunks.next_chunk(prefilling, decoding)
        self._gen.prefill_step_size = chunk
        tic = time.perf_counter()
        try:
            prompt_responses, gen_responses = self._gen.next()
        except Exception as e:
            self._fail_batch(e)
            return
        seconds = time.perf_counter() - tic
        self._step_prefilled_at = time.monotonic()  # the step's prompts are in the cache now
        self.stats.steps += 1
        if prefilling:
            self.metrics.prefill_batch.observe(prefilling)
            self.stats.max_prefill_batch = max(self.stats.max_prefill_batch, prefilling)
        if decoding:
            self.metrics.decode_batch.observe(decoding)
            self.stats.max_decode_batch = max(self.stats.max_decode_batch, decoding)
        prefilled = 0
        for pr in prompt_responses:
            a = self._active.get(pr.uid)
            if a is not None:
                prefilled += self._on_prompt_progress(a, pr)
        self.chunks.record(chunk, prefilled, decoding, seconds)
        self._fail_faulty_rows()
        events: dict[int, list[Event]] = {}
        for gr in gen_responses:
            a = self._active.get(gr.uid)
            if a is None:
                continue
            try:
                events.setdefault(gr.uid, []).append(self._token_event(a, gr))
            except Exception as e:
                log.exception("request %s failed while decoding", a.request.id)
                self._fail_row(a, f"decoding failed: {e}")
                events.pop(gr.uid, None)
                continue
            if gr.finish_reason is not None:
                self._save_snapshot(a, gr.all_tokens, gr.prompt_cache)
                self.stats.finished += 1
                self._finish(a, DoneEvent(gr.finish_reason, max(0, a.stored - a.cached)), events.pop(gr.uid))
        for uid, evs in events.items():
            a = self._active.get(uid)
            if a is not None:
                self._send(a.request, evs)

    def _fail_row(self, a: _Active, message: str) -> None:
        """Take ``a`` out of the batch and end it with a 500 ``message``; the other rows go on."""
        self._gen.remove([a.uid])
        self._count_failure(a)
        self._finish(a, ErrorEvent(500, message))

    def _count_failure(self, a: _Active) -> None:
        if a.precompute is not None:
            self.precomputes.outcome("failed")
        else:
            self.stats.failed += 1

    def _fail_faulty_rows(self) -> None:
        """Fail, alone, each row whose sampler, processors or grammar raised this step;
        its pending token (sampled by the broken callable) is never sent."""
        for a in list(self._active.values()):
            reason = a.error()
            if reason is None:
                continue
            log.error("request %s failed: %s", a.request.id, reason)
            self._fail_row(a, reason)

    def _update_rates(self, idle: bool) -> None:
        """Publish prefill/decode tokens per second once a second of work has passed;
        0 when the engine goes idle."""
        start, pre, dec = self._rate_window
        now = time.monotonic()
        if idle:
            self.metrics.prefill_rate.set(0)
            self.metrics.decode_rate.set(0)
            self._rate_window = [now, 0, 0]
        elif now - start >= 1.0:
            self.metrics.prefill_rate.set(pre / (now - start))
            self.metrics.decode_rate.set(dec / (now - start))
            self._rate_window = [now, 0, 0]

    def _token_event(self, a: _Active, gr) -> TokenEvent:
        if not a.generated:
            a.request.timings["engine_first_token"] = time.monotonic()
        a.generated += 1
        self.stats.decode_tokens += 1
        recent = self.stats.generated_by_request
        recent[a.request.id] = a.generated
        if len(recent) > _RECENT:
            del recent[next(iter(recent))]
        self.metrics.decode_tokens.inc()
        self.metrics.work.labels(a.request.tenant).inc()
        self._waiting.fair.charge(a.request.tenant, 1, a.request.weight)
        self._rate_window[2] += 1
        p = a.request.params
        if not p.logprobs:
            return TokenEvent(gr.token)
        lp = gr.logprobs
        chosen = lp[gr.token].item()
        top = None
        if p.top_logprobs:
            k = min(p.top_logprobs, lp.shape[-1])
            idx = mx.argpartition(-lp, k - 1)[:k]
            vals = lp[idx]
            order = mx.argsort(-vals)
            top = list(zip(idx[order].tolist(), vals[order].tolist()))
        return TokenEvent(gr.token, chosen, top)

    def _on_prompt_progress(self, a: _Active, pr) -> int:
        """Account ``a``'s prefill progress; returns the prompt tokens prefilled this step."""
        done = pr.progress[0] if isinstance(pr.progress, tuple) else 0
        delta = max(0, done - a.processed)
        if done > a.processed:
            self.stats.prefill_tokens += done - a.processed
            self.metrics.prefill_tokens.inc(done - a.processed)
            self._rate_window[1] += done - a.processed
            a.processed = done
            if not pr.end_of_prompt:
                self._send(a.request, [ProgressEvent(a.cached + done, len(a.request.tokens))])
        position = a.cached + a.processed
        if pr.end_of_prompt:
            a.request.timings["engine_prefilled"] = self._step_prefilled_at
            a.decoding = True
            self.prompt_cache.release(a.lease)
            a.lease = None
            # The row's cache now holds exactly the prompt (its first token is sampled,
            # not yet fed back): the moment for a checkpoint at len(prompt).
            position = len(a.request.tokens)
        if (pr.end_of_segment or pr.end_of_prompt) and position in a.pending_snapshots:
            a.pending_snapshots = [p for p in a.pending_snapshots if p > position]
            try:
                extracted = self._gen.extract_cache([a.uid]).get(a.uid)
            except Exception as e:  # fails this request alone
                log.exception("extracting the cache of request %s failed", a.request.id)
                self._fail_row(a, f"saving its prompt cache failed: {e}")
                return delta
            if extracted is not None:
                cache, tokens = extracted
                self._save_snapshot(a, tokens, cache)
        if pr.end_of_prompt and a.precompute is not None:
            self._finish_precompute(a)
        return delta

    def _save_snapshot(self, a: _Active, tokens, cache) -> None:
        """Store ``cache`` (covering ``tokens``) for ``a``'s namespace.

        Caches extracted from a batch are views that pin the whole batch buffer
        ``[B, H, T, D]``; the manager copies out only what it keeps (the KV of tokens it
        does not hold yet, and the other layers compacted).
        """
        if not tokens or cache is None:
            return
        try:
            if self.prompt_cache.refresh(a.request.namespace, tokens):  # e.g. an exact repeat: no copy
                a.stored = max(a.stored, min(len(tokens), len(a.request.tokens)))
                return
            if self.prompt_cache.insert(a.request.namespace, list(tokens), cache):
                self.stats.snapshots_saved += 1
                a.stored = max(a.stored, min(len(tokens), len(a.request.tokens)))
        except Exception:
            log.exception("saving a snapshot for request %s failed", a.request.id)

    def _fail_batch(self, error: Exception) -> None:
        """A batch step raised: fail the requests in it, start a fresh batch, keep serving."""
        log.error("engine step failed; failing %d requests:\n%s", len(self._active), traceback.format_exc())
        self.metrics.engine_errors.inc()
        for a in list(self._active.values()):
            self._count_failure(a)
            self._finish(a, ErrorEvent(500, f"engine step failed: {error}"))
        self._drop_generator()
        self._gen = self._new_generator()
        # MLX's global PRNG key may now be an array of the failed graph, which would fail
        # every later unseeded sample: start a fresh key.
        mx.random.seed(int.from_bytes(os.urandom(4), "little"))
