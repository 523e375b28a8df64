"""The engine of an embedding model: batches of inputs, one forward each (engine thread only).

An embedding model generates nothing: a request is a list of token sequences and its
answer is one vector per sequence. :class:`EmbeddingEngine` attaches to the same
:class:`scheduler.engine.loop.EngineLoop` as the generating models, so every MLX call still
happens on the loop's thread, and the loop steps it like a prefilling engine: each turn
it runs one forward over the waiting inputs of every request (up to
``max_batch_inputs`` sequences and ``max_batch_tokens`` padded tokens), shortest first
so that a batch pads little, and sends each request its vectors once all of its inputs
are done. A request larger than one batch is spread over several turns, and the
decoding rows of other models advance between them.

The model is any callable ``embed(sequences: list[list[int]]) -> mx.array [B, D]``
(:class:`gateway.models.embedding.EmbeddingModel`): padding, attention mask and pooling
are its business; the engine only asks that a sequence's vector does not depend on the
other sequences of its batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
from prometheus_client import CollectorRegistry

from scheduler.admission.arrivals import Arrivals
from scheduler.engine.loop import EngineLoop
from scheduler.engine.seat import LoopSeat, Seated
from scheduler.metrics import SchedulerMetrics
from scheduler.request import ErrorEvent
from scheduler.batch.rows import EngineDead, EngineOverloaded, EngineStats

log = logging.getLogger("mlx_gateway.engine")


@dataclass
class EmbeddingsEvent:
    """A request's answer: ``vectors [n, D]`` float32, one row per input, in input order."""

    vectors: np.ndarray


@dataclass(eq=False)
class EmbeddingRequest:
    """Token sequences to embed.

    Attributes:
        id: unique request id (for cancellation).
        inputs: the sequences (token ids), each ``len >= 1``.
        sink: called on the engine thread with a list holding one
            :class:`EmbeddingsEvent` (or an ``ErrorEvent``); it must not block.
        tenant: for metrics.
        priority: the latency class (0 interactive, 1 standard, 2 batch).
    """

    id: str
    inputs: list[list[int]]
    sink: Callable[[list], None]
    tenant: str = "default"
    priority: int = 1
    arrival: float = field(default_factory=time.monotonic)
    _vectors: dict = field(default_factory=dict, repr=False)  # input index -> vector (engine thread)
    _next: int = 0  # inputs handed to a batch so far


class EmbeddingEngine(Seated):
    """Serves :class:`EmbeddingRequest` s for one embedding model on an engine loop (see
    the module docstring). Has the parts of :class:`scheduler.engine.Engine` the gateway
    and the loop use; it keeps no prefix cache.

    Args:
        embed: the model's batched forward (``list[list[int]] -> mx.array [B, D]``).
        loop: the shared engine loop (None: one of its own, started by :meth:`start`).
        max_batch_inputs: most sequences in one forward.
        max_batch_tokens: most padded tokens (longest sequence x sequences) in one forward.
        max_waiting: waiting requests before :meth:`submit` raises :class:`EngineOverloaded`.
        registry: where its metrics go.
        name: the served model's name, for logs.
    """

    trimmable = False
    prompt_cache = None  # no prefix cache: nothing to flush, persist or bound

    def __init__(self, embed: Callable[[list[list[int]]], object], loop: Optional[EngineLoop] = None, *,
                 max_batch_inputs: int = 32, max_batch_tokens: int = 8192, max_waiting: int = 1024,
                 registry: Optional[CollectorRegistry] = None, name: str = "model"):
        self.embed = embed
        self.name = name
        self.max_batch_inputs = max(1, max_batch_inputs)
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.max_waiting = max_waiting
        self.metrics = SchedulerMetrics(registry or CollectorRegistry())
        self.stats = EngineStats()
        self.error: Optional[BaseException] = None
        self.seat = LoopSeat(self, loop or EngineLoop(), own=loop is None)
        self._queue: deque[EmbeddingRequest] = deque()  # loop thread only
        self._count = 0  # submitted and not yet answered (any thread, under _idle)
        self._idle = threading.Condition()
        self.closed = False  # set on the loop thread when it leaves the loop
        self.arrivals = Arrivals(lambda: self.seat.loop.post(("arrived", None)))

    # ----------------------------------------------------------------- thread-safe API
    def start(self, timeout: float = 60.0) -> None:
        """Attach to the loop (and start it, when it is this engine's own)."""
        self.seat.start(timeout)

    def stop(self, timeout: float = 10.0, reason: str = "engine stopped") -> None:
        """Leave the loop; waiting requests end with a 503 ``reason``."""
        self.seat.stop(timeout, reason)

    def submit(self, request: EmbeddingRequest) -> None:
        """Queue a request (thread-safe).

        Raises:
            EngineDead: the engine is not running.
            EngineOverloaded: ``max_waiting`` requests are already waiting.
        """
        if not self.alive:
            raise EngineDead(f"engine is not running: {self.error!r}")
        with self._idle:
            if self._count >= self.max_waiting:
                raise EngineOverloaded(f"{self._count} requests are already waiting")
            self._count += 1
        self.seat.post("submit", request)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Drop a request that has not been answered (thread-safe); its sink gets nothing more."""
        self.seat.post("cancel", request_id)

    # What the gateway asks of every engine; an embedding model has no prefix cache.
    def flush_cache(self, cache_group: Optional[str] = None, timeout: float = 60.0) -> int:
        return 0

    def apply_quotas(self, quotas, timeout: float = 60.0) -> Future:
        done: Future = Future()
        done.set_result(None)
        return done

    def close_cache(self) -> None:
        pass

    def kv_bytes(self, timeout: float = 60.0) -> int:
        return 0

    @property
    def cache_bytes(self) -> int:
        return 0

    def reserve_precompute(self, limit: int = 8) -> bool:
        return False

    def submit_precompute(self, p) -> None:
        return None

    def prime_metrics(self, tenants, cache_groups) -> None:
        for t in tenants:
            self.metrics.queue_time.labels(t)
            self.metrics.work.labels(t)

    @property
    def idle(self) -> bool:
        with self._idle:
            return self._count == 0

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until every request is answered; False after ``timeout`` seconds."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._count, timeout)

    @property
    def num_running(self) -> int:
        return 0

    @property
    def num_waiting(self) -> int:
        return self._count

    # ----------------------------------------------------------------- the loop's side
    @property
    def busy(self) -> bool:
        return bool(self._queue)

    has_waiting = has_rows = serving = busy  # every waiting input is a request's, prefilled in turn

    @property
    def num_prefilling(self) -> int:
        return 1 if self._queue else 0

    num_decoding = 0

    @property
    def prefill_class(self) -> int:
        return min((r.priority for r in self._queue), default=3)

    @property
    def interactive_busy(self) -> bool:
        return any(r.priority == 0 for r in self._queue)

    def precompute_due(self) -> Optional[float]:
        return None

    def open_on_loop(self) -> None:
        return None

    def close_on_loop(self, reason: str, persist: bool) -> None:
        if self.closed:
            return
        self.closed = True
        while self._queue:
            self._answer(self._queue.popleft(), [ErrorEvent(503, reason)])

    def handle(self, kind: str, payload) -> None:
        if kind == "submit":
            self._queue.append(payload)
        elif kind == "cancel":
            for r in list(self._queue):
                if r.id == payload:
                    self._queue.remove(r)
                    self._done()
                    self.stats.cancelled += 1

    def refuse(self, kind: str, payload, reason: str) -> None:
        if kind == "submit":
            self._answer(payload, [ErrorEvent(503, reason)])

    def admit(self, preempt: bool, quiet: bool) -> None:
        return None

    def step(self, decode_only: bool = False, decoding_elsewhere: int = 0, share: float = 1.0) -> None:
        """One forward over the next batch of waiting inputs (best latency class first)."""
        if decode_only or not self._queue:
            return
        batch = self._next_batch()
        seqs = [r.inputs[i] for r, i in batch]
        order = sorted(range(len(seqs)), key=lambda k: len(seqs[k]))  # alike lengths pad little
        tic = time.perf_counter()
        try:
            import mlx.core as mx

            out = self.embed([seqs[k] for k in order])
            mx.eval(out)
            vectors = np.array(out.astype(mx.float32))
        except Exception as e:
            log.exception("embedding step failed")
            self.metrics.engine_errors.inc()
            for r in {id(r): r for r, _ in batch}.values():
                if r in self._queue:
                    self._queue.remove(r)
                self.stats.failed += 1
                self._answer(r, [ErrorEvent(500, f"embedding failed: {e}")])
            return
        self.stats.steps += 1
        self.stats.prefill_tokens += sum(len(s) for s in seqs)
        self.metrics.prefill_tokens.inc(sum(len(s) for s in seqs))
        self.metrics.prefill_batch.observe(len(seqs))
        self.stats.max_prefill_batch = max(self.stats.max_prefill_batch, len(seqs))
        log.debug("embedded %d inputs in %.3f s", len(seqs), time.perf_counter() - tic)
        for row, k in enumerate(order):
            r, i = batch[k]
            r._vectors[i] = vectors[row]
        for r in {id(r): r for r, _ in batch}.values():
            if len(r._vectors) == len(r.inputs):
                self._queue.remove(r)
                self.stats.finished += 1
                self.metrics.queue_time.labels(r.tenant).observe(time.monotonic() - r.arrival)
                self._answer(r, [EmbeddingsEvent(np.stack([r._vectors[i] for i in range(len(r.inputs))]))])

    def end_turn(self, hold: bool) -> None:
        self.metrics.waiting.set(self._count)

    # ----------------------------------------------------------------- internals
    def _next_batch(self) -> list[tuple[EmbeddingRequest, int]]:
        """Inputs not yet embedded, best class first then arrival order, within the bounds."""
        batch: list[tuple[EmbeddingRequest, int]] = []
        longest = 0
        for r in sorted(self._queue, key=lambda r: r.priority):
            while r._next < len(r.inputs):
                n = len(r.inputs[r._next])
                wide = max(longest, n) * (len(batch) + 1)
                if batch and (len(batch) >= self.max_batch_inputs or wide > self.max_batch_tokens):
                    return batch
                batch.append((r, r._next))
                longest = max(longest, n)
                r._next += 1
        return batch

    def _answer(self, r: EmbeddingRequest, events: list) -> None:
        try:
            r.sink(events)
        except Exception:
            log.exception("sink of request %s raised", r.id)
        self._done()

    def _done(self) -> None:
        with self._idle:
            self._count = max(0, self._count - 1)
            self._idle.notify_all()
