"""How a batch's failures stay its own (engine thread only). A row whose sampler,
processors, grammar or cache extraction failed ends alone with a 500, the other rows
keep their exact tokens; a step that raised fails the rows in it and the batch starts
afresh (``tests/test_row_faults.py``)."""

from __future__ import annotations

import logging
import os
import traceback
from operator import attrgetter
from typing import Callable, Iterable

import mlx.core as mx

from scheduler.admission.precompute import PrecomputeBook
from scheduler.batch.faults import RowFault
from scheduler.batch.rows import EngineStats, Row
from scheduler.metrics import SchedulerMetrics
from scheduler.request import ErrorEvent, Event

log = logging.getLogger("mlx_gateway.engine")
_has_mask = attrgetter("request.mask")


def _fault_or_mask(a: Row):
    """``a``'s recorded fault, else its grammar mask (either may make :meth:`Row.error` say why it fails)."""
    return a.fault.error or a.request.mask


class RowFailures:
    """Counts and ends failed rows, held by :class:`scheduler.batch.Batch`. Public:
    :meth:`count`, :meth:`fail`, :meth:`fail_faulty`, :meth:`fail_step`.

    Args:
        stats: a failed request is counted in ``stats.failed``.
        precomputes: a failed next-turn precompute is counted there.
        metrics: a failed step is counted in ``engine_errors``.
        finish: takes a row out of the batch's tables, releases its lease and sends it
            an event (:meth:`Batch._finish <scheduler.batch.Batch._finish>`).
    """

    def __init__(self, stats: EngineStats, precomputes: PrecomputeBook, metrics: SchedulerMetrics,
                 finish: Callable[[Row, Event], None]):
        self._stats = stats
        self._precomputes = precomputes
        self._metrics = metrics
        self._finish = finish
        self._raised = 0  # RowFault.raised at the last scan

    def count(self, a: Row) -> None:
        """Count ``a`` as failed (a request, or a next-turn precompute)."""
        if a.precompute is not None:
            self._precomputes.outcome("failed")
        else:
            self._stats.failed += 1

    def fail(self, a: Row, message: str) -> None:
        """Count ``a`` and end it with a 500 ``message`` (it is out of the generator)."""
        self.count(a)
        self._finish(a, ErrorEvent(500, message))

    def fail_faulty(self, rows: Iterable[Row], fail_row: Callable[[Row, str], None]) -> None:
        """Fail, alone (``fail_row``), each of ``rows`` whose sampler, processors or grammar
        raised this step; its pending token (sampled by the broken callable) is never sent.
        The rows' faults are scanned only when some row's grew (:attr:`RowFault.raised`)."""
        raised, self._raised = self._raised != RowFault.raised, RowFault.raised
        suspect = _fault_or_mask if raised else _has_mask  # (most steps: the masks alone, a scan in C)
        for a in list(filter(suspect, rows)):  # (a list: fail_row takes rows out of the batch)
            reason = a.error()
            if reason is None:
                continue
            log.error("request %s failed: %s", a.request.id, reason)
            fail_row(a, reason)

    def fail_step(self, rows: list[Row], error: Exception) -> None:
        """A batch step raised ``error``: fail every one of ``rows`` with a 500. The caller
        then starts a fresh generator."""
        log.error("engine step failed; failing %d requests:\n%s", len(rows), traceback.format_exc())
        self._metrics.engine_errors.inc()
        for a in rows:
            self.fail(a, f"engine step failed: {error}")
        # MLX's global PRNG key may now be an array of the failed graph, which would fail
        # every later unseeded sample: start a fresh key.
        mx.random.seed(int.from_bytes(os.urandom(4), "little"))
