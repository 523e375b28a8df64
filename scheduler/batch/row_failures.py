"""How a batch's failures stay its own: the base class of :class:`scheduler.batch.Batch`
(engine thread only). A row whose sampler, processors, grammar or cache extraction
failed ends alone with a 500, the other rows keep their exact tokens; a step that raised
fails the rows in it and the batch starts afresh (``tests/test_row_faults.py``)."""

from __future__ import annotations

import logging
import os
import traceback

import mlx.core as mx

from scheduler.request import ErrorEvent
from scheduler.batch.rows import Row

log = logging.getLogger("mlx_gateway.engine")


class RowFailures:
    """Failing rows alone, or the whole batch: uses the batch's ``gen``, ``active``,
    ``stats``, ``metrics`` and ``precomputes``, and its ``_finish``, ``close`` and
    ``open``. Not usable on its own."""

    def _fail_row(self, a: Row, message: str) -> None:
        """Take ``a`` out of the batch and end it with a 500 ``message``; the other rows go on."""
        self.gen.remove([a.uid])
        self._count_failure(a)
        self._finish(a, ErrorEvent(500, message))

    def _count_failure(self, a: Row) -> None:
        if a.precompute is not None:
            self.precomputes.outcome("failed")
        else:
            self.stats.failed += 1

    def _fail_faulty_rows(self) -> None:
        """Fail, alone, each row whose sampler, processors or grammar raised this step;
        its pending token (sampled by the broken callable) is never sent."""
        for a in list(self.active.values()):
            reason = a.error()
            if reason is None:
                continue
            log.error("request %s failed: %s", a.request.id, reason)
            self._fail_row(a, reason)

    def _fail_batch(self, error: Exception) -> None:
        """A batch step raised: fail the requests in it, start a fresh batch, keep serving."""
        log.error("engine step failed; failing %d requests:\n%s", len(self.active), traceback.format_exc())
        self.metrics.engine_errors.inc()
        for a in list(self.active.values()):
            self._count_failure(a)
            self._finish(a, ErrorEvent(500, f"engine step failed: {error}"))
        self.close()
        self.open()
        # MLX's global PRNG key may now be an array of the failed graph, which would fail
        # every later unseeded sample: start a fresh key.
        mx.random.seed(int.from_bytes(os.urandom(4), "little"))
