"""The other ranks: a batch and a prefix cache that replay rank 0's, in order.

See :mod:`scheduler.distributed`.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

from cache import PromptCacheManager
from scheduler.batch import Batch
from scheduler.batch.chunking import ChunkPlanner
from scheduler.distributed.cluster import Cluster, ClusterLost, SyncedGenerationBatch
from scheduler.admission.fairness import FairShare
from scheduler.batch.generator import JoiningBatchGenerator
from scheduler.metrics import SchedulerMetrics
from scheduler.request import EngineRequest, SamplingParams
from scheduler.batch.rows import EngineStats
from scheduler.sampling import greedy

UNBOUNDED = 1 << 62


class Stream:
    """The operations from rank 0, in order (a follower's engine thread)."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._ops: deque = deque()
        self.chunk = 0  # rank 0's prefill chunk for the next step (tokens)
        self.decoding = 0  # rows in rank 0's decode batch as that step starts
        self.hold_decode = False  # that step skips its decode forward (rank 0's generator's flag)

    def next(self):
        while not self._ops:
            self._ops.extend(self.cluster.broadcast())
        return self._ops.popleft()


class FollowerCache(PromptCacheManager):
    """A follower's prefix cache: the same trees as rank 0's, with the evictions,
    refusals and releases rank 0 decided (it never evicts on its own)."""

    def __init__(self, stream: Stream):
        super().__init__(UNBOUNDED, UNBOUNDED)
        self.stream = stream
        self._leases: dict = {}

    def fetch(self, namespace, tokens, count: bool = True, whole: bool = False):
        hit = super().fetch(namespace, tokens, count, whole)
        if hit.lease is not None:
            self._leases[hit.lease.id] = hit.lease
        return hit

    def release(self, lease) -> None:
        if lease is not None:
            self._leases.pop(lease.id, None)
        super().release(lease)

    def _eviction_plan(self, namespace, run):
        while True:
            op = self.stream.next()
            if op[0] == "plan":
                break
            if not self.apply(op):
                raise ClusterLost(f"out of step with rank 0: a snapshot insert met {op[0]!r}")
        _, ns, length, victims = op
        if (ns, length) != (namespace, run.key.tokens):
            raise ClusterLost(f"out of step with rank 0: a snapshot of {run.key.tokens} tokens is stored here, "
                              f"one of {length} there")
        if victims is None:
            return None
        return [(self._entry(key), "rank0") for key in victims]

    def _entry(self, key):
        namespace, tokens = key
        group = self._groups.get(namespace)
        node = group.tree.find(tokens) if group is not None else None
        if node is None or node.value is None:
            raise ClusterLost("out of step with rank 0: a snapshot it evicts is not here")
        return node.value

    def apply(self, op) -> bool:
        """Apply a cache decision of rank 0 (False: ``op`` is not one)."""
        if op[0] == "drop":
            with self._lock:
                self._drop(self._entry(op[1]))
        elif op[0] == "release":
            lease = self._leases.pop(op[1], None)
            if lease is not None:
                super().release(lease)
        else:
            return False
        return True


class _NoPrecomputes:
    """A follower keeps no next-turn precompute books."""

    def stored(self, *args) -> None:
        pass

    def outcome(self, *args) -> None:
        pass


class FollowerGenerator(JoiningBatchGenerator):
    """A follower's generator: rank 0's chunk for each step, rank 0's sampled tokens."""

    generation_batch_class = SyncedGenerationBatch
    joins_apart = False  # every rank runs the same forwards, the tokens synced after each decode step

    def __init__(self, model, stream: Stream, batch: "FollowerBatch", **kwargs):
        super().__init__(model, **kwargs)
        self._ops = stream
        self._owner = batch
        self._generation_batch.sync = self._sync

    def _next(self):
        self.prefill_step_size = self._ops.chunk
        self.hold_decode = self._ops.hold_decode
        if len(self._generation_batch) != self._ops.decoding:
            raise ClusterLost(f"out of step with rank 0: {len(self._generation_batch)} rows decode here, "
                              f"{self._ops.decoding} there")
        return super()._next()

    def _sync(self, gb) -> None:
        tokens, faults = self._ops.cluster.broadcast()
        if len(tokens) != len(gb.uids):
            raise ClusterLost(f"out of step with rank 0: {len(gb.uids)} rows decode here, {len(tokens)} there")
        gb._next_tokens = mx.array(tokens, dtype=gb._next_tokens.dtype)
        for uid, fault in zip(gb.uids, faults):
            a = self._owner.active.get(uid)
            if fault and a is not None:
                a.fault.mark(RuntimeError("its sampler or logits processors failed on rank 0"))


class FollowerBatch(Batch):
    """A follower's batch: rank 0's operations replayed."""

    def __init__(self, model, eos_token_ids, stream: Stream, *, prompt_concurrency: int, decode_concurrency: int,
                 prefill_step_size: int, trimmable: bool):
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
        super().__init__(model, set(eos_token_ids), prompt_concurrency=prompt_concurrency,
                         decode_concurrency=max(prompt_concurrency, decode_concurrency),
                         prefill_step_size=prefill_step_size, trimmable=trimmable,
                         prompt_cache=FollowerCache(stream), chunks=ChunkPlanner(prefill_step_size, 0.0),
                         metrics=SchedulerMetrics(registry), stats=EngineStats(), precomputes=_NoPrecomputes(),
                         fair=FairShare(), send=lambda request, events: None)
        self.stream = stream
        self.paused: dict[str, object] = {}
        self._outcome = None  # of the last operation, for its "check"

    def _new_generator(self):
        return FollowerGenerator(self.model, self.stream, self, max_tokens=1 << 30, sampler=greedy,
                                 completion_batch_size=self.decode_concurrency,
                                 prefill_batch_size=self.prompt_concurrency, prefill_step_size=self.prefill_step_size)

    def run(self) -> None:
        """Replay rank 0's operations until it says stop.

        Raises:
            ClusterLost: an outcome differs from rank 0's.
            RuntimeError: a collective failed (a rank is gone).
        """
        self.open()
        try:
            while True:
                op = self.stream.next()
                if not self._apply(op):
                    return
        finally:
            self.drop_all("stopped")
            self.close()

    def _apply(self, op) -> bool:
        kind = op[0]
        if self.prompt_cache.apply(op):
            return True
        if kind == "start":
            (rid, tokens, max_tokens, ignore_eos, checkpoints, namespace, keep), extra, background = op[1:]
            r = EngineRequest(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                              sink=lambda events: None,
                              checkpoints=checkpoints, namespace=namespace, keep=keep)
            a = self.insertion.start_row(r, extra, background)
            if a is not None and background:
                a.precompute = True
            self._outcome = None if a is None else a.cached
        elif kind == "pause":
            a = self.by_id.get(op[1])
            self._outcome = a is not None and self.insertion.pause(a)
            if self._outcome:
                self.paused[op[1]] = a
        elif kind == "resume":
            a = self.paused.pop(op[1], None)
            self._outcome = a is not None and self.insertion.resume(a)
        elif kind == "cancel":
            self._outcome = self.cancel(op[1], op[2])
        elif kind == "preempt":
            self.preempt_precomputes()
        elif kind == "step":
            self.stream.chunk, self.stream.decoding, self.stream.hold_decode = op[1], op[2], op[3]
            self.step()
        elif kind == "fail":
            a = self.by_id.get(op[1])
            if a is not None:  # else already failed here by the same fault
                super()._fail_row(a, "failed on rank 0")
        elif kind == "drop_paused":
            a = self.paused.pop(op[1], None)
            if a is not None:
                self.insertion.drop_paused(a)
        elif kind == "check":
            _, what, rid, outcome = op
            if outcome != self._outcome:
                raise ClusterLost(f"out of step with rank 0: {what} of request {rid} gave {self._outcome!r} "
                                  f"here and {outcome!r} there")
        elif kind == "stop":
            self.stream.cluster.stopped = True
            return False
        else:
            raise ClusterLost(f"out of step with rank 0: unexpected {kind!r}")
        return True

    def _fail_batch(self, error: Exception) -> None:
        raise error


def follow(cluster: Cluster, model, eos_token_ids, *, prompt_concurrency: int, decode_concurrency: int,
           prefill_step_size: int, trimmable: bool) -> None:
    """Serve as a follower until rank 0 stops; a lost rank or a divergence raises
    :class:`ClusterLost`."""
    stream = Stream(cluster)
    batch = FollowerBatch(model, eos_token_ids, stream, prompt_concurrency=prompt_concurrency,
                          decode_concurrency=decode_concurrency, prefill_step_size=prefill_step_size,
                          trimmable=trimmable)
    try:
        batch.run()
    except ClusterLost:
        raise
    except Exception as e:
        raise ClusterLost(f"lost contact with rank 0: {e}") from e
