"""The engine's data types: a running request's row, the stats and admission records
it keeps, and the waiting counts behind the errors :meth:`Engine.submit
<scheduler.engine.Engine.submit>` raises."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Optional

from scheduler.batch.faults import RowFault
from scheduler.admission.precompute import Precompute
from scheduler.request import EngineRequest
from scheduler.speculative.step import SpeculationStats

RECENT = 4096  # requests remembered in admission_log and stats.generated_by_request


class EngineDead(RuntimeError):
    """The engine thread has stopped; no request can be served (HTTP 503)."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (HTTP 503 with Retry-After)."""


class TenantQueueFull(RuntimeError):
    """The tenant already has ``max_queued`` requests waiting (HTTP 429 with Retry-After)."""


class WaitingCounts:
    """Requests submitted and not yet admitted or cancelled, in all (:attr:`total`) and
    per tenant (a request admitted once, waiting again, in the total only); thread-safe."""

    def __init__(self) -> None:
        self.total = 0
        self._by_tenant: dict[str, int] = {}
        self._again: set[str] = set()  # ids of requests waiting again (preempted)
        self._lock = threading.Lock()

    def add(self, request: EngineRequest, max_waiting: int, again: bool = False) -> None:
        """Count ``request`` as waiting; ``again``: it was admitted already (a preempted
        request), it counts in the total but not toward its tenant's ``max_queued``.

        Raises:
            EngineOverloaded: ``max_waiting`` requests are already waiting.
            TenantQueueFull: ``request.max_queued`` requests of its tenant are waiting.
        """
        t = request.tenant
        with self._lock:
            if self.total >= max_waiting:
                raise EngineOverloaded(f"{self.total} requests are already waiting")
            if again:
                self.total += 1
                self._again.add(request.id)
                return
            mine = self._by_tenant.get(t, 0)
            if request.max_queued is not None and mine >= request.max_queued:
                raise TenantQueueFull(f"{mine} requests of this tenant are already waiting")
            self.total += 1
            self._by_tenant[t] = mine + 1

    def remove(self, request: EngineRequest) -> None:
        """``request`` no longer waits (admitted or cancelled)."""
        with self._lock:
            self.total -= 1
            if request.id in self._again:
                self._again.discard(request.id)
                return
            left = self._by_tenant.get(request.tenant, 1) - 1
            if left > 0:
                self._by_tenant[request.tenant] = left
            else:
                self._by_tenant.pop(request.tenant, None)

    def clear(self) -> None:
        """Nothing waits any more (the engine stopped)."""
        with self._lock:
            self.total = 0
            self._by_tenant.clear()
            self._again.clear()


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


# Steps in a row that may hold lower-class decoding rows back for an interactive prefill.
MAX_HOLDS = 4
# Prefill progress events go out at most this often, unless the prompt advanced by this fraction.
PROGRESS_SECONDS = 0.1
PROGRESS_FRACTION = 0.05


@dataclass
class Row:
    """One request in the running batch (``uid`` is its row in the ``BatchGenerator``).

    ``lease`` pins its restored cache entry until prefill ends; ``cached`` is the prompt
    tokens restored from the prefix cache and ``processed`` those prefilled since;
    ``pending_snapshots`` are the absolute prompt offsets (tokens) where it will still
    save a snapshot; ``marks`` where its prefill segments end. A row paused for a better
    latency class (:meth:`RowInsertion.pause <scheduler.batch.insertion.RowInsertion.pause>`:
    its prefill between two chunks, or its decoding when the decode batch is full) is out of the generator
    and holds its state in ``paused``; ``progress_base`` is what it had prefilled when it
    was put back (the generator counts from there).
    """

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
    marks: list[int] = field(default_factory=list)
    # While paused: (its cache, the tokens it covers) for a prefilling row, a
    # scheduler.batch.decode_batch.DecodingState for a decoding one.
    paused: Any = None
    progress_base: int = 0
    progress_sent: tuple = (0.0, 0)  # (monotonic seconds, tokens) of the last progress event
    # Started from a kept first token (scheduler.batch.first_tokens): its
    # scheduler.batch.decode_batch.DecodingState until it joins the decode batch at the next step.
    joining: Any = None

    @cached_property
    def share_key(self) -> tuple[str, float]:
        """(tenant, weight): what its generated tokens are counted under."""
        return self.request.tenant, self.request.weight

    @property
    def prompt_left(self) -> int:
        """Prompt tokens not yet in its cache (the last one included, which is fed as the
        row joins the decoding batch)."""
        return len(self.request.tokens) - self.cached - self.processed

    def progress_due(self, total: int, now: float) -> bool:
        """A prefill progress event is due (and counted as sent): :data:`PROGRESS_SECONDS`
        since the last one, or :data:`PROGRESS_FRACTION` of the prompt more prefilled. Small
        chunks (a lower class beside interactive requests) would otherwise send one per
        step, waking the event loop and the client every few milliseconds."""
        at, tokens = self.progress_sent
        if now - at < PROGRESS_SECONDS and self.processed - tokens < PROGRESS_FRACTION * total:
            return False
        self.progress_sent = (now, self.processed)
        return True

    @property
    def rank(self) -> int:
        """Its latency class (0 interactive, 1 standard, 2 batch); 3 for a next-turn
        precompute, below every class."""
        return 3 if self.precompute is not None else self.request.priority

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
    grouping_saved_tokens: int = 0
    max_prefill_batch: int = 0
    max_decode_batch: int = 0
    generated_by_request: dict[str, int] = field(default_factory=dict)  # last 4096 requests
    speculation: SpeculationStats = field(default_factory=SpeculationStats)


class TokenRates:
    """Prefill and decode tokens per second, published once a second of work has passed
    (the ``prefill_rate`` and ``decode_rate`` gauges of :class:`scheduler.metrics.SchedulerMetrics`).
    The batch adds to :attr:`prefilled` (tokens) as rows advance, and counts generated
    tokens with :meth:`count` (stats, metrics, the tenants' fair share
    :class:`scheduler.admission.fairness.FairShare`)."""

    def __init__(self, metrics, stats: "EngineStats", fair):
        self.metrics, self.stats, self.fair = metrics, stats, fair
        self.start, self.prefilled, self.decoded = time.monotonic(), 0, 0

    def count(self, counted: dict) -> None:
        """Account generated tokens, ``{(tenant, weight): tokens}``: one update per tenant
        and step rather than per token."""
        n = sum(counted.values())
        self.stats.decode_tokens += n
        self.metrics.decode_tokens.inc(n)
        self.decoded += n
        for (tenant, weight), k in counted.items():
            self.metrics.work_of(tenant).inc(k)
            self.fair.charge(tenant, k, weight)

    def publish(self, idle: bool) -> None:
        """Publish the rates if a second has passed since the last (0 when ``idle``: the engine has no rows)."""
        now = time.monotonic()
        if idle or now - self.start >= 1.0:
            seconds = now - self.start
            self.metrics.prefill_rate.set(0 if idle else self.prefilled / seconds)
            self.metrics.decode_rate.set(0 if idle else self.decoded / seconds)
            self.start, self.prefilled, self.decoded = now, 0, 0


def holds_decode(rows: Iterable[Row], held: int = 0) -> bool:
    """A step's prefill runs alone, the decoding rows waiting (their KV untouched): an
    interactive prompt beside decoding rows all of lower classes, while no prefilling row
    has only its last token left (it would join the decode batch this step, and needs
    the decode forward), and for at most :data:`MAX_HOLDS` steps in a row (``held``: the
    steps held just before), so lower-class streams always advance. Such a step also owes
    them no decode-only step first (:class:`scheduler.batch.chunking.DecodeShare`)."""
    rows = list(rows)
    prefilling = [a for a in rows if not a.decoding]
    decoding = [a for a in rows if a.decoding]
    return (held < MAX_HOLDS and any(a.rank == 0 for a in prefilling) and bool(decoding)
            and all(a.rank > 0 for a in decoding)
            and all(a.prompt_left > 1 for a in prefilling))
