"""Rank 0: its batch, generator and prefix cache record what the followers replay.

See :mod:`scheduler.distributed`.
"""

from __future__ import annotations

import logging
import threading
import time

from cache import PromptCacheManager
from scheduler.batch import Batch
from scheduler.distributed.cluster import Cluster, ClusterLost, SyncedGenerationBatch, entry_key
from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.batch.insertion import RowInsertion
from scheduler.request import ErrorEvent
from scheduler.sampling import greedy

log = logging.getLogger("mlx_gateway.distributed")

HEARTBEAT_SECONDS = 1.0
# An engine thread that has not taken a heartbeat for this long is stuck (in a collective
# whose peer is gone, with a backend whose loss this rank cannot see): the cluster stops.
STUCK_SECONDS = 60.0


class Recorder:
    """Operations rank 0 applied since its last message (engine thread only)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.ops: list = []
        self.stopped = False

    def record(self, *op) -> None:
        self.ops.append(op)

    def flush(self, *last) -> None:
        """Send what was recorded (and ``last``) to the followers."""
        if last:
            self.ops.append(last)
        ops, self.ops = self.ops, []
        self.cluster.broadcast(ops)


class LeaderCache(PromptCacheManager):
    """Rank 0's prefix cache (the class of the manager it already has): records its
    evictions, refusals and releases for the followers."""

    def _lead(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._planned: set[int] = set()

    def _eviction_plan(self, namespace, run):
        plan = super()._eviction_plan(namespace, run)
        self._recorder.record("plan", namespace, run.key.tokens,
                              None if plan is None else [entry_key(self, e) for e, _ in plan])
        self._planned = set() if plan is None else {id(e) for e, _ in plan}
        return plan

    def _drop(self, entry, spill: bool = True) -> None:
        if id(entry) in self._planned:
            self._planned.discard(id(entry))
        else:
            self._recorder.record("drop", entry_key(self, entry))
        super()._drop(entry, spill)

    def release(self, lease) -> None:
        if lease is not None and not lease.released:
            self._recorder.record("release", lease.id)
        super().release(lease)


class LeaderGenerator(JoiningBatchGenerator):
    """Rank 0's generator: sends the recorded operations and the step's chunk before each
    step, and its sampled tokens after each decode forward."""

    generation_batch_class = SyncedGenerationBatch
    joins_apart = False  # every rank runs the same forwards, the tokens synced after each decode step

    def __init__(self, model, recorder: Recorder, batch: "LeaderBatch", **kwargs):
        super().__init__(model, **kwargs)
        self._recorder = recorder
        self._owner = batch
        self._generation_batch.sync = self._sync

    def _next(self):
        self._recorder.flush("step", self.prefill_step_size, len(self._generation_batch), self.hold_decode)
        return super()._next()

    def _sync(self, gb) -> None:
        tokens = gb._next_tokens.tolist()
        rows = [self._owner.active.get(uid) for uid in gb.uids]
        # A row failing this step on rank 0 (its sampler, processors or grammar) fails on
        # every rank, so the next forward has the same rows everywhere.
        faults = [int(a is not None and a.error() is not None) for a in rows]
        self._owner.cluster.broadcast((tokens, faults))


class LeaderInsertion(RowInsertion):
    """Rank 0's row insertion (the class of its batch's, see :meth:`LeaderBatch._lead`):
    records each row started, paused, resumed or dropped, and the outcome."""

    recorder: Recorder

    preemptible = False  # a preemption is no operation the followers mirror: rows reserve their whole answer

    def start_row(self, r, extra_checkpoints=(), background: bool = False, carry=None):
        spec = (r.id, list(r.tokens), r.params.max_tokens, r.params.ignore_eos, list(r.checkpoints), r.namespace,
                dict(r.keep))
        self.recorder.record("start", spec, tuple(extra_checkpoints), background)
        a = super().start_row(r, extra_checkpoints, background, carry)
        self.recorder.record("check", "start", r.id, None if a is None else a.cached)
        return a

    def pause(self, a) -> bool:
        self.recorder.record("pause", a.request.id)
        ok = super().pause(a)
        self.recorder.record("check", "pause", a.request.id, ok)
        return ok

    def resume(self, a) -> bool:
        self.recorder.record("resume", a.request.id)
        ok = super().resume(a)
        self.recorder.record("check", "resume", a.request.id, ok)
        return ok

    def drop_paused(self, a) -> None:
        self.recorder.record("drop_paused", a.request.id)
        super().drop_paused(a)


class LeaderBatch(Batch):
    """Rank 0's batch (the class of the engine's batch, see :func:`lead`): records every
    operation for the followers."""

    def _lead(self, cluster: Cluster, recorder: Recorder) -> None:
        self.cluster = cluster
        self.recorder = recorder
        # the followers' rows start as theirs do, from a forward
        self.first_tokens = self.insertion.first_tokens = None
        self.insertion.__class__ = LeaderInsertion
        self.insertion.recorder = recorder

    def _new_generator(self):
        return LeaderGenerator(self.model, self.recorder, self, max_tokens=1 << 30, sampler=greedy,
                               completion_batch_size=self.decode_concurrency,
                               prefill_batch_size=self.prompt_concurrency, prefill_step_size=self.prefill_step_size)

    def cancel(self, request_id: str, reason: str) -> bool:
        self.recorder.record("cancel", request_id, reason)
        ok = super().cancel(request_id, reason)
        self.recorder.record("check", "cancel", request_id, ok)
        return ok

    def _fail_row(self, a, message: str) -> None:
        # Failures of rank 0's own (a token event, a snapshot extract) happen nowhere else.
        self.recorder.record("fail", a.request.id)
        super()._fail_row(a, message)

    def preempt_precomputes(self) -> None:
        if any(a.precompute is not None for a in self.active.values()):
            self.recorder.record("preempt")
        super().preempt_precomputes()

    def close(self) -> None:
        super().close()
        if not self.recorder.stopped and not self.cluster.failed:
            self.recorder.stopped = True
            self.cluster.stopped = True
            try:
                self.recorder.flush("stop")
            except Exception as e:
                self.cluster.fail(f"telling the other ranks to stop failed: {e}")

    def _fail_batch(self, error: Exception) -> None:
        """A step raised: with a rank lost (or the ranks out of step) nothing can be
        served, so the requests end with a 503 and the server stops."""
        reason = f"a rank of the cluster failed: {error}"
        for a in list(self.active.values()):
            self.failures.count(a)
            self._finish(a, ErrorEvent(503, reason))
        self.cluster.fail(reason)
        raise ClusterLost(reason) from error


def lead(engine, cluster: Cluster) -> None:
    """Make ``engine`` (not started yet) rank 0's: its batch and prefix cache record for
    the followers, and a heartbeat thread keeps them in step while it idles."""
    cache = engine.prompt_cache
    if cache.disk is not None:
        raise ValueError("the prompt cache's disk tier is not supported across ranks")
    cluster.connect()
    cluster.on_fail.append(lambda reason: _end_requests(engine, reason))
    recorder = Recorder(cluster)
    cache.__class__ = LeaderCache
    cache._lead(recorder)
    batch = engine.core.batch
    batch.__class__ = LeaderBatch
    batch._lead(cluster, recorder)
    threading.Thread(target=_heartbeat, args=(engine, cluster, recorder), name="cluster-heartbeat",
                     daemon=True).start()


def _end_requests(engine, reason: str) -> None:
    """End the requests in the batch with a 503 (any thread: the engine thread may be
    stuck in a collective; their sinks only post to the event loop)."""
    rows = list(engine.core.batch.active.values()) + list(engine.core.classes.paused)
    for a in rows:
        if a.precompute is None:
            engine.core.send(a.request, [ErrorEvent(503, f"a rank of the cluster failed: {reason}")])


def _heartbeat(engine, cluster: Cluster, recorder: Recorder) -> None:
    """Every :data:`HEARTBEAT_SECONDS`, send what is recorded (the last step's snapshots,
    releases) from the engine thread: followers catch up, and a lost peer is noticed
    while idle too."""
    while not engine.alive and not cluster.failed:
        time.sleep(0.1)

    def beat() -> None:
        if not recorder.stopped and not cluster.failed:
            recorder.flush()

    while not cluster.failed and not recorder.stopped:
        time.sleep(HEARTBEAT_SECONDS)
        if not engine.alive:
            return
        try:
            engine.call(beat, timeout=STUCK_SECONDS)
        except TimeoutError:
            if engine.alive and not recorder.stopped:
                cluster.fail(f"the engine has not finished a step in {STUCK_SECONDS:g} s: a rank is lost or stuck")
            return
        except Exception as e:
            if engine.alive or not recorder.stopped:
                cluster.fail(f"lost contact with the other ranks: {e}")
            return
