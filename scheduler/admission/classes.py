"""Latency classes on one model's engine (engine loop thread only): which classes may
prefill a step, the prefills and decoding rows paused for a better class and put back,
and how many lower-class prompts prefill together while interactive requests are about.
See docs/scheduling.md ("Latency classes") for the rules and their measurements.
"""

from __future__ import annotations

from typing import Optional

from scheduler.admission.policy import ClassShare, WaitingQueue
from scheduler.batch import Batch
from scheduler.batch.rows import Row
from scheduler.engine.loop import EngineLoop
from scheduler.metrics import SchedulerMetrics


class LatencyClasses:
    """The class rules of one model's engine, held by :class:`scheduler.engine.core.EngineCore`.
    Public: :attr:`paused`, :meth:`lower_room`, :meth:`streams_first`, :meth:`make_room`,
    :meth:`resume_streams`, :meth:`allowed`. Its own state: the rows paused for a better
    class, and one share meter per decision (:class:`scheduler.admission.policy.ClassShare`).

    Args:
        waiting: the engine's waiting queue (read only).
        batch: the engine's running batch; rows are paused and resumed through its
            :attr:`~scheduler.batch.Batch.insertion`.
        loop: the engine loop (whether interactive requests are about; the lower
            classes' guaranteed share, ``batch_share``).
        metrics: where pauses and resumes are counted.
        prompt_concurrency, decode_concurrency: the batch's prompt and decode slots.
    """

    def __init__(self, waiting: WaitingQueue, batch: Batch, loop: EngineLoop, metrics: SchedulerMetrics,
                 prompt_concurrency: int, decode_concurrency: int):
        self._waiting = waiting
        self._batch = batch
        self._loop = loop
        self.metrics = metrics
        self.prompt_concurrency = prompt_concurrency
        self.decode_concurrency = decode_concurrency
        self.paused: list[Row] = []  # rows paused for a better class, prefilling or decoding
        self._share = ClassShare(loop.batch_share)  # prefill turns of the lower classes
        self._stream_share = ClassShare(loop.batch_share)  # their prefill while an interactive row decodes
        self._resume_share = ClassShare(loop.batch_share)  # their paused streams' place in a full batch

    def lower_room(self) -> Optional[int]:
        """While interactive requests are about (:meth:`EngineLoop.interactive_recent`),
        one standard or batch prompt prefills at a time, so that the step a new interactive
        request waits for holds one prompt's chunk, not several: how many more may start
        now. None: no limit."""
        if not self._loop.interactive_recent():
            return None
        lower = sum(1 for a in self._batch.prefilling() if a.rank in (1, 2))
        return max(0, 1 - lower)

    def streams_first(self) -> bool:
        """An interactive row decodes while only lower classes prefill: this step decodes
        only, so its next token comes after a decode step rather than after a prefill
        chunk too; except on the lower classes' guaranteed share of steps
        (:class:`scheduler.admission.policy.ClassShare`)."""
        rows = list(self._batch.active.values())
        if any(not a.decoding and a.rank == 0 for a in rows) or not any(a.decoding and a.rank == 0 for a in rows):
            return False
        lower = {a.rank for a in rows if not a.decoding and a.precompute is None}
        return not lower or self._stream_share.allowed({0} | lower) == {0}

    def make_room(self, spare: frozenset = frozenset()) -> None:
        """The decode batch is full and requests of a better class than some decoding row
        wait: pause decoding rows of the lowest classes (the latest first), one per such
        request of the best class waiting and free prompt slot, their whole state kept
        (:meth:`RowInsertion.pause <scheduler.batch.insertion.RowInsertion.pause>`); not the rows of
        ``spare`` (request ids: put back this turn). They go on where they stopped, with the
        tokens they would have had (:meth:`resume_streams`)."""
        if len(self._batch.active) < self.decode_concurrency or not len(self._waiting):
            return
        best = min(self._waiting.classes())
        victims = sorted((a for a in self._batch.active.values() if a.decoding and a.precompute is None
                          and a.rank > best and a.request.id not in spare), key=lambda a: (-a.rank, -a.request.arrival))
        n = min(self._waiting.count_by_class().get(best, 0), len(victims),
                self.prompt_concurrency - self._batch.num_prefilling())
        for a in victims[:max(0, n)]:
            if self._batch.insertion.pause(a):
                self.paused.append(a)
                self.metrics.decode_pauses.labels(str(a.request.priority)).inc()

    def resume_streams(self) -> frozenset:
        """Put paused decoding rows back (the best class, then the earliest, first) while
        the decode batch has room and no request of a better class waits for it, or when
        their guaranteed share of turns comes round (:class:`scheduler.admission.policy.ClassShare`:
        they always finish); the request ids put back."""
        if not self.paused:
            return frozenset()
        streams = sorted((a for a in self.paused if a.decoding), key=lambda a: (a.rank, a.request.arrival))
        best_waiting = min(self._waiting.classes(), default=3)
        back = set()
        for a in streams:
            if len(self._batch.active) >= self.decode_concurrency:
                break
            if a.rank > best_waiting and a.rank not in self._resume_share.allowed({best_waiting, a.rank}):
                break
            self.paused.remove(a)
            if self._batch.insertion.resume(a):
                back.add(a.request.id)
        return frozenset(back)

    def allowed(self) -> Optional[set[int]]:
        """Latency classes: pause the prefill of rows below the best class waiting,
        prefilling or paused (their cache kept), and resume paused rows the allowed
        classes include, while prompt slots are free; the classes that may be admitted
        now (None: every class, when only one is present)."""
        if not (len(self._waiting) or self.paused or self._batch.num_prefilling()):
            return None  # decoding rows alone: no class present (a count, not the scans below)
        filling = self._batch.prefilling()  # rows prefilling
        present = self._waiting.classes() | {a.request.priority for a in self.paused} | {
            a.request.priority for a in filling if a.precompute is None}
        if len(present) <= 1 and not self.paused:
            return None
        allowed = self._share.allowed(present)
        lower = allowed - {min(present)}
        if (lower and self._batch.num_prefilling() >= self.prompt_concurrency
                and not any(a.rank in lower for a in filling)):
            allowed = lower  # a share turn with no prompt slot for it: the lower class alone
        for a in [a for a in filling if a.precompute is None and a.request.priority not in allowed]:
            if self._batch.insertion.pause(a):
                self.paused.append(a)
                self.metrics.pauses.labels(str(a.request.priority)).inc()
        self.paused.sort(key=lambda a: (a.request.priority, a.request.arrival))
        for a in [a for a in self.paused if a.request.priority in allowed and not a.decoding]:
            room = self.lower_room()
            if (self._batch.num_prefilling() >= self.prompt_concurrency
                    or len(self._batch.active) >= self.decode_concurrency or room == 0):
                break
            self.paused.remove(a)
            if self._batch.insertion.resume(a):
                self.metrics.resumes.labels(str(a.request.priority)).inc()
        return allowed
