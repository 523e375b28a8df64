"""One model across processes: rank 0 schedules, the other ranks mirror its batch.

Under ``mlx.launch`` (``mx.distributed`` with more than one process) every rank loads the
same model split with mlx-lm's own splits: tensor parallel (``model.shard(group)``) or,
with ``--pipeline``, pipeline parallel (``model.model.pipeline(group)``). Rank 0 runs the
HTTP front, the engine loop and the scheduler as in one process; the other ranks
(*followers*) run no server, only a :class:`~scheduler.batch.Batch` and a prefix cache of
their own, which they keep in step with rank 0's by replaying, in the same order, the
operations rank 0 applied to its batch and cache:

* rank 0's batch (:class:`~scheduler.distributed.leader.LeaderBatch`) records each
  operation it is asked for (start a row over its cached prefix, pause, resume, cancel,
  drop precomputes) before running it, and the outcome after it (a follower that gets
  another outcome stops: it diverged);
* rank 0's generator (:class:`~scheduler.distributed.leader.LeaderGenerator`) sends
  everything recorded so far just before each step, with the step's prefill chunk as rank
  0 decided it (chunk sizes depend on measured times; followers never decide one);
* rank 0's prefix cache (:class:`~scheduler.distributed.leader.LeaderCache`) records the
  decisions that depend on time or on bytes (which snapshots an insert evicts, or whether
  it is refused; quota, budget and flush evictions; lease releases); a follower's cache
  (:class:`~scheduler.distributed.follower.FollowerCache`) never evicts on its own and
  takes those decisions from the stream, at the same point;
* in each decode step, after the forward, rank 0's sampled tokens (and which rows' sampler
  or processors failed) are sent to the followers and replace theirs
  (:class:`~scheduler.distributed.cluster.SyncedGenerationBatch`): a follower needs
  neither the request's sampler nor its logits processors (grammar masks), and its rows
  finish exactly when rank 0's do.

Messages go from rank 0 to each follower over a TCP link of their own
(:meth:`~scheduler.distributed.cluster.Cluster.connect`: a follower waiting for the next
one sleeps, where one blocked in a ring collective spins), or through ``all_sum`` as
mlx_lm.server does where there is no ring hostfile. Rank 0 sends a heartbeat every second.
A peer's process ending closes its link, which the other side notices at once (a
collective in flight with it may raise ``connection to a peer was lost``, or never
return); a peer that vanishes silently fails the link's keepalive or send timeout (about
20 s); without links, an engine that finishes no step for 60 s counts as stuck. Then
rank 0 ends its requests with a 503 and exits with status 1 (within seconds, even with its
engine thread stuck), a follower exits with status 1. A row rank 0 fails (its grammar, its
sampler, a snapshot it could not take) fails on every rank before the next forward.

Modules: :mod:`~scheduler.distributed.cluster` (the group, links, failure),
:mod:`~scheduler.distributed.leader` (rank 0), :mod:`~scheduler.distributed.follower`
(the others); :mod:`gateway.ranks` starts them from ``mlx-gateway serve``.
"""

from scheduler.distributed.cluster import Cluster, ClusterLost, current, init
from scheduler.distributed.follower import follow
from scheduler.distributed.leader import lead

__all__ = ["Cluster", "ClusterLost", "current", "follow", "init", "lead"]
