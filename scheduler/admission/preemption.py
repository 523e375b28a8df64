"""Reservations that grow, and preemption when they cannot (engine loop thread only).

A row is admitted with the KV of its prompt plus a grant of ``min(max_tokens, QUANTUM)``
new tokens reserved (:mod:`scheduler.admission.memory`), not its whole ``max_tokens``.
Before its tokens pass its grant, :meth:`Reservations.grow` grows it by another
``QUANTUM`` if that fits (the prefix cache's unleased least recently used snapshots give
way first, as for an admission). When it does not, a row is *preempted* as vLLM's
recompute preemption picks it (``vllm/v1/core/sched/scheduler.py``: the lowest priority,
then the latest arrived; it may be the growing row itself), never when it would leave
no row running: the row is taken out of the batch, its KV (prompt and the tokens it
generated) stored in the prefix cache as a snapshot (``Batch._save_snapshot``, the store a
finished row takes), and its request put back at the head of the waiting queue as a
:class:`Resumed` request: its prompt is the old prompt plus every token it generated,
its ``max_tokens`` what is left. Readmitted, it restores that prefix from the prefix
cache (or prefills what was evicted meanwhile: recompute) through the ordinary
insertion path, and goes on streaming to the same client:

- the token it had sampled but not yet reported is reported at preemption, so the
  readmitted row starts from a fed-back token and samples the next one: no token is
  sampled twice or lost, and a seeded sampler's key chain goes on;
- its sampler and logits processors (repetition penalty, logit bias, a grammar's
  matcher, a thinking budget) are the same objects, and their token context is the
  same prompt plus generated tokens, so greedy tokens are those of an uninterrupted run;
- its events go through a sink that drops the second prompt and progress events and
  reports the first admission's ``cache_written``, so usage is as if uninterrupted (the
  gateway's detokenizer and stop strings just see more tokens);
- its restore stays out of the cache hit-rate metrics; it is counted in
  ``mlx_gateway_preemptions_total`` and ``mlx_gateway_preemption_resumes_total``.

A row alone that cannot grow even with an empty cache ends with ``finish_reason:
length``. Rows with images (a vision model's positions, M-RoPE state outside the KV)
and rows under a LoRA adapter are not preempted: they reserve their whole ``max_tokens``
at admission, as before growth, so they never need to grow.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Optional

from scheduler.admission.memory import MemoryGate
from scheduler.admission.policy import Admission, WaitingQueue
from scheduler.batch import Batch
from scheduler.batch.decode_batch import INT32_LIMIT
from scheduler.batch.rows import Row, WaitingCounts
from scheduler.metrics import SchedulerMetrics
from scheduler.request import DoneEvent, EngineRequest, ErrorEvent, Event, ProgressEvent, PromptEvent

NO_BOUND = 1 << 62  # a preempted request is never refused by the waiting bound


@dataclass
class Carry:
    """What a preempted row's request carries to its readmission: its ``sampler`` and
    ``processors`` (the generator's, wrapped by ``fault``), the tokens it ``generated``,
    its first admission's ``written`` (``DoneEvent.cache_written``), the client's
    ``sink``, and its request's ``max_tokens`` in all."""

    sampler: Any
    processors: list
    fault: Any
    generated: int
    written: int
    sink: Callable[[list[Event]], None]
    max_tokens: int


@dataclass
class Resumed(EngineRequest):
    """A preempted row's request, back in the waiting queue (see the module docstring)."""

    carry: Optional[Carry] = None


def movable(r: EngineRequest) -> bool:
    """``r``'s row may grow and be preempted: no image positions, no LoRA adapter."""
    return r.adapter is None and (not r.tokens or max(r.tokens) < INT32_LIMIT)


def _continuing(carry: Carry) -> Callable[[list[Event]], None]:
    """The sink of a resumed request: ``carry.sink`` without the second prompt and progress
    events, its end reporting the first admission's ``cache_written``."""

    def deliver(events: list[Event]) -> None:
        out = [DoneEvent(e.finish_reason, carry.written) if isinstance(e, DoneEvent) else e
               for e in events if not isinstance(e, (PromptEvent, ProgressEvent))]
        if out:
            carry.sink(out)

    return deliver


class Reservations:
    """Each row's grant of new tokens, its growth and preemption, and the memory verdict of
    a waiting request; held by :class:`scheduler.engine.core.EngineCore`. Its own state:
    ``grants``, by request id ``(new tokens granted, tokens it had generated when
    admitted)``.

    Args:
        gate: the model's :class:`~scheduler.admission.memory.MemoryGate`.
        batch: the running batch; ``paused``: the rows paused for a better latency
            class (they hold their reservation).
        waiting, counts: the waiting queue and its counts, where preempted requests go.
        metrics: where preemptions, memory waits and refusals are counted.
        send: delivers events to a request's sink.
    """

    def __init__(self, gate: MemoryGate, batch: Batch, paused: list[Row], waiting: WaitingQueue,
                 counts: WaitingCounts, metrics: SchedulerMetrics, send: Callable[[EngineRequest, list[Event]], None]):
        self.gate, self.batch, self.paused, self.waiting, self.counts = gate, batch, paused, waiting, counts
        self.metrics, self.send = metrics, send
        self.grants: dict[str, tuple[int, int]] = {}

    def movable(self, r: EngineRequest) -> bool:
        """``r``'s row may grow and be preempted: :func:`movable`, and the batch's insertion
        can preempt (a cluster's leader cannot: its followers mirror every row operation,
        and preemption is not one of them)."""
        return self.batch.insertion.preemptible and movable(r)

    def _rows(self) -> list[Row]:
        return [*self.batch.active.values(), *self.paused]

    def _specs(self, rows: list[Row], grown: Optional[Row] = None) -> list[tuple[int, int, int]]:
        """``rows`` as :meth:`MemoryGate.held` takes them; ``grown``'s grant one quantum larger."""
        g, out = self.gate, []
        for a in rows:
            grant = self.grants.get(a.request.id, (a.request.params.max_tokens,))[0]
            if a is grown:
                grant = min(a.request.params.max_tokens, grant + g.quantum)
            out.append((len(a.request.tokens), grant, 0 if a.decoding else g.prefill_need(len(a.request.tokens))))
        return out

    def verdict(self, r: EngineRequest) -> str:
        """``fits``, ``wait`` or ``never`` for the waiting ``r`` by its predicted memory
        (:meth:`MemoryGate.decide`); a ``never`` is answered here: a 503, or for a
        :class:`Resumed` request, its end with ``finish_reason: length``."""
        gate, rows, cache = self.gate, self._rows(), self.batch.prompt_cache
        cached = 0
        if isinstance(r, Resumed):  # its own snapshot (keyed before its pending token) gives way last
            cache.refresh(r.namespace, r.tokens[:-1])
            cached = cache.match_length(r.namespace, r.tokens)
        held = gate.held(self._specs(rows))
        while True:
            mine = (len(r.tokens), gate.first_grant(r.params.max_tokens, self.movable(r)),
                    gate.prefill_need(len(r.tokens), cached))  # a preempted row's KV restored: it prefills one token
            need = gate.held([*self._specs(rows), mine]) - held  # (the batch's padding to its longest row included)
            alone = gate.held([mine])
            verdict = gate.decide(need, held, cache, bool(rows), alone=alone)
            if not cached or verdict != "fits" or cache.match_length(r.namespace, r.tokens) >= cached:
                break
            cached = 0  # its own snapshot gave way: judged again as the recompute it now is
        if verdict == "never" and isinstance(r, Resumed):
            self.metrics.preemptions.labels(str(r.priority), "length").inc()
            self.send(r, [DoneEvent("length")])
        elif verdict == "never":
            self.metrics.memory_refused.inc()
            room = gate.room() or 0
            self.send(r, [ErrorEvent(503, f"the request needs {alone / 2**20:.1f} MiB (the KV of its prompt and "
                                          f"its first {gate.first_grant(r.params.max_tokens, self.movable(r))} tokens, a copy "
                                          "of its largest layer as the batch grows, its prefill's activations"
                                          f"{', the attention scores of its steps' if gate.heads else ''}) and the memory budget leaves "
                                          f"{max(0, room) / 2**20:.1f} MiB after the weights: retry with fewer "
                                          "tokens, or raise --memory-budget")])
        elif verdict == "wait":
            self.metrics.memory_waits.inc()
        return verdict

    def take_resumed(self, n: int, allowed: Optional[set[int]] = None) -> list[Admission]:
        """Up to ``n`` preempted requests from the head of the waiting queue, admitted first,
        of the ``allowed`` latency classes (None: all)."""
        return [Admission(r, [], False) for r in self.waiting.take(
            n, lambda r: isinstance(r, Resumed) and (allowed is None or r.priority in allowed))]

    def put_back(self, admissions: list[Admission], cached_len: Callable[[EngineRequest], int]) -> None:
        """Picked ``admissions`` that wait for memory go back to the head of the queue, in order."""
        self.waiting.put_back([p for p in admissions if not isinstance(p.request, Resumed)], cached_len)
        for p in reversed([p for p in admissions if isinstance(p.request, Resumed)]):
            self.waiting.add_first(p.request)

    def admitted(self, a: Row) -> None:
        """``a`` joined the batch: record its first grant; a resumed row goes on counting
        its tokens where it stopped."""
        r = a.request
        carry = getattr(r, "carry", None)
        if carry is not None:
            a.generated = carry.generated
            full = a.cached >= len(r.tokens) - 1
            self.metrics.preemption_resumes.labels("cache" if full else "recompute").inc()
        self.grants[r.id] = (self.gate.first_grant(r.params.max_tokens, self.movable(r)), a.generated)

    def grow(self) -> None:
        """Before a step: grow the grant of each decoding row whose next step may pass it,
        the best latency class and the earliest first; preempt rows where that does not
        fit (see the module docstring)."""
        gate, rows = self.gate, self._rows()
        # the grants of rows gone (more grants than rows: a precompute's row has none). Only then:
        # a scan of the rows' requests at every step, the first touch of them after a forward, cost
        # 40-60 us at 32 streams on the 2-core CPU (their objects out of the cache), 6 us once in it
        if len(self.grants) > len(rows):
            for gone in self.grants.keys() - set(map(attrgetter("request.id"), rows)):  # (a scan in C)
                del self.grants[gone]
        if gate.room is None or gate.room() is None:
            return
        gate.fit_cache(gate.held(self._specs(rows)), self.batch.prompt_cache)
        tried: set[str] = set()
        for a in sorted((a for a in self.batch.active.values() if a.decoding and a.request.id in self.grants),
                        key=lambda a: (a.rank, a.request.arrival)):
            r = a.request
            if self.batch.by_id.get(r.id) is not a:
                continue  # preempted or ended for an earlier row's growth
            new, base = self.grants[r.id]
            if a.generated - base + 1 + gate.draft <= new or new >= r.params.max_tokens:
                continue
            step = min(gate.quantum, r.params.max_tokens - new)
            while True:
                rows = self._rows()
                held = gate.held(self._specs(rows))
                extra = gate.held(self._specs(rows, grown=a)) - held
                if gate.decide(extra, held, self.batch.prompt_cache, True, alone=0) == "fits":
                    self.grants[r.id] = (new + step, base)
                    break
                victim = self._victim(tried)
                if victim is None:
                    if len(self._rows()) <= 1 and self.batch.cancel(r.id, "length"):  # alone: it ends here
                        self.batch.stats.finished += 1
                        self.metrics.preemptions.labels(str(r.priority), "length").inc()
                    break
                tried.add(victim.request.id)
                self._preempt(victim)
                if victim is a:
                    break

    def _victim(self, tried: set[str]) -> Optional[Row]:
        """The row to preempt: a decoding row paused for a better latency class (it holds
        memory and gives no tokens), else a decoding request's row of the lowest class, the
        latest arrived; None when one row or none is left, or no row may be preempted."""
        if len(self._rows()) <= 1:
            return None
        rows = [a for a in self._rows() if a.decoding and a.joining is None and a.precompute is None
                and a.request.id not in tried and self.movable(a.request)]
        paused = {id(a) for a in self.paused}
        return max(rows, key=lambda a: (id(a) in paused, a.rank, a.request.arrival), default=None)

    def _preempt(self, a: Row) -> None:
        """Take ``a`` out of the batch, its KV into the prefix cache, and put its request back
        at the head of the waiting queue as a :class:`Resumed` one."""
        if any(p is a for p in self.paused):
            self.paused[:] = [p for p in self.paused if p is not a]
            outcome, tokens, state = self.batch.insertion.preempt_paused(a, self.batch._save_snapshot)
        else:
            outcome, tokens, state = self.batch.insertion.preempt(a, self.batch._save_snapshot)
        if outcome != "out":
            return
        r = a.request
        old = getattr(r, "carry", None)
        carry = Carry(state.sampler, state.processors, a.fault, a.generated,
                      old.written if old else max(0, a.stored - a.cached), old.sink if old else r.sink,
                      old.max_tokens if old else r.params.max_tokens)
        fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(EngineRequest)}
        fields.update(tokens=tokens, params=dataclasses.replace(r.params, max_tokens=carry.max_tokens - a.generated),
                      sink=_continuing(carry), max_queued=None, prefix_key=None)
        resumed = Resumed(**fields, carry=carry)
        self.grants.pop(r.id, None)
        self.counts.add(resumed, NO_BOUND, again=True)
        self.waiting.add_first(resumed)
        self.metrics.preemptions.labels(str(r.priority), "requeued").inc()
