"""The ranks of one ``mlx.launch``: the group, rank 0's message links, failure.

See :mod:`scheduler.distributed`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import select
import signal
import socket
import sys
import threading
from typing import Optional

import mlx.core as mx
import numpy as np

from cache import PromptCacheManager
from scheduler.batch.decode_batch import JoiningGenerationBatch

log = logging.getLogger("mlx_gateway.distributed")

HARD_EXIT_SECONDS = 5.0  # after a failure, rank 0 exits by then even if its engine thread is stuck
HELLO_SECONDS = 10.0  # a connection to rank 0's link port must present its key within this
# A link whose peer stops acknowledging (machine gone, network cut: no FIN) fails after this
# many seconds of unacknowledged data (Linux TCP_USER_TIMEOUT) or of silent keepalive probes.
LINK_TIMEOUT_SECONDS = 20


class ClusterLost(RuntimeError):
    """A rank of the cluster is gone, or a follower diverged from rank 0."""


class Cluster:
    """This process's place in the ``mlx.launch`` group and how the model is split."""

    def __init__(self, group, pipeline: bool):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.pipeline = pipeline
        self.error: Optional[str] = None
        self._failed = threading.Event()
        self._links: list = []  # rank 0: a socket per follower; a follower: rank 0's
        self.on_fail: list = []  # called with the reason on the first failure
        self.stopped = False  # rank 0 said stop: links closing now is no failure

    @property
    def split(self) -> str:
        return "pipeline" if self.pipeline else "tensor"

    def shard(self, model) -> None:
        """Split ``model`` (lazily loaded) across the group with mlx-lm's own split.

        Raises:
            ValueError: the architecture has no such split in mlx-lm.
        """
        if self.pipeline:
            inner = getattr(model, "model", None)
            if not hasattr(inner, "pipeline"):
                raise ValueError(f"mlx-lm has no pipeline split for {type(model).__module__}; drop --pipeline")
            inner.pipeline(self.group)
        else:
            if not hasattr(model, "shard"):
                raise ValueError(f"mlx-lm has no tensor-parallel split for {type(model).__module__}; "
                                 "try --pipeline")
            model.shard(self.group)

    # -- messages from rank 0 ----------------------------------------------------
    def connect(self, timeout: float = 120.0) -> None:
        """Open rank 0's message links: rank 0 listens on its address of the ring's
        hostfile and sends the port and a random key to the others through one
        ``all_sum``; each follower connects and presents the key. Waiting for a message
        then costs nothing (a follower blocked in a ring collective spins on its socket,
        tens of percent of a core). Without a readable hostfile (other backends), the
        messages go through ``all_sum`` instead."""
        host = _rank0_host()
        if self.rank == 0 and host is not None:
            server = socket.create_server((host, 0))
            server.settimeout(timeout)
            key = os.urandom(16)
            header = [server.getsockname()[1], *key]
        else:
            server, header = None, [0] * 17
        header = self.exchange(header)
        if header[0] == 0:
            return
        key = bytes(header[1:])
        if self.rank == 0:
            links = {}
            try:
                while len(links) < self.size - 1:
                    conn, _ = server.accept()
                    conn.settimeout(HELLO_SECONDS)
                    try:
                        hello = _recv_exact(conn, 20)
                    except OSError:  # a stray connection (a port scan, a probe): not a rank
                        conn.close()
                        continue
                    if hello[:16] != key:
                        conn.close()
                        continue
                    _tune(conn)
                    links[int.from_bytes(hello[16:], "little")] = conn
            finally:
                server.close()
            self._links = [links[r] for r in sorted(links)]
        else:
            conn = socket.create_connection((host, header[0]), timeout=timeout)
            _tune(conn)
            conn.sendall(key + self.rank.to_bytes(4, "little"))
            self._links = [conn]
        threading.Thread(target=self._watch, name="cluster-watch", daemon=True).start()

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank (rank 0 passes it, the others None)."""
        if self._links:
            if self.rank == 0:
                data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
                frame = len(data).to_bytes(8, "little") + data
                for conn in self._links:
                    conn.sendall(frame)
                return obj
            conn = self._links[0]
            n = int.from_bytes(_recv_exact(conn, 8), "little")
            return pickle.loads(_recv_exact(conn, n))
        if self.rank == 0:
            data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
            # One collective at a time, in the same order on every rank.
            mx.eval(mx.distributed.all_sum(mx.array([data.size], dtype=mx.int32), group=self.group))
            mx.eval(mx.distributed.all_sum(mx.array(data), group=self.group))
            return obj
        n = mx.distributed.all_sum(mx.array([0], dtype=mx.int32), group=self.group).item()
        out = mx.distributed.all_sum(mx.zeros((n,), dtype=mx.uint8), group=self.group)
        mx.eval(out)
        return pickle.loads(np.array(out).tobytes())

    def exchange(self, values: list[int]) -> list[int]:
        """Rank 0's ``values`` on every rank (the others pass as many zeros)."""
        out = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        return out.tolist()

    # -- failure -------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """Record the first failure and stop this process: rank 0 through its graceful
        shutdown (SIGTERM), then status 1 (at once, the reason on stderr, while no server
        has taken SIGTERM yet or after it gave it back); a follower at once."""
        if self._failed.is_set():
            return
        self.error = reason
        self._failed.set()
        log.error("distributed serving stopped on rank %d of %d: %s", self.rank, self.size, reason)
        for hook in self.on_fail:
            try:
                hook(reason)
            except Exception:
                log.exception("ending the requests in flight failed")
        if self.rank == 0:
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                # (no server holds SIGTERM, not yet or no longer: there is nothing to drain, and
                # the default action would end the process before it said why)
                _hard_exit(f"mlx-gateway: {reason}")
            os.kill(os.getpid(), signal.SIGTERM)
            # A collective in flight when a peer dies may never return: then the engine
            # thread cannot end, and neither can the graceful shutdown.
            timer = threading.Timer(HARD_EXIT_SECONDS, _hard_exit, args=(f"mlx-gateway: {reason}",))
            timer.daemon = True
            timer.start()

    def _watch(self) -> None:
        """Notice at once a peer whose link closes (its process ended), even while this
        rank is blocked in a collective that will not return."""
        poller = select.poll()
        for conn in self._links:
            poller.register(conn, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        while not self.failed:
            if self.stopped:  # rank 0 said stop: the links close now, and poll() would spin
                return
            if poller.poll(1000) and not self.stopped:
                who = "rank 0" if self.rank else "a follower rank"
                self.fail(f"{who} is gone: [ring] connection to a peer was lost")
                if self.rank:
                    _hard_exit(f"mlx-gateway: rank {self.rank}: {self.error}")
                return

    @property
    def failed(self) -> bool:
        return self._failed.is_set()


_cluster: Optional[Cluster] = None


def init(pipeline: bool = False) -> Optional[Cluster]:
    """Join the ``mlx.launch`` group; None when this process runs alone."""
    global _cluster
    group = mx.distributed.init()
    if group.size() <= 1:
        _cluster = None
        return None
    _cluster = Cluster(group, pipeline)
    log.info("rank %d of %d, %s parallel", _cluster.rank, _cluster.size, _cluster.split)
    return _cluster


def current() -> Optional[Cluster]:
    """The cluster this process is part of, if any."""
    return _cluster


def _hard_exit(message: str) -> None:
    log.error("%s; exiting", message)
    for h in logging.getLogger().handlers:
        h.flush()
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def _rank0_host() -> Optional[str]:
    """Rank 0's address in the ring backend's hostfile (``MLX_HOSTFILE``), if readable."""
    try:
        with open(os.environ["MLX_HOSTFILE"]) as f:
            hosts = json.load(f)
        return str(hosts[0][0]).rsplit(":", 1)[0].strip("[]")  # "[::1]:5000" too
    except Exception:
        return None


def _tune(conn: socket.socket) -> None:
    """A link: blocking, no Nagle delay, and a peer that stops answering noticed within
    about :data:`LINK_TIMEOUT_SECONDS` (keepalive probes while idle; on Linux also a bound on
    unacknowledged sends) instead of the kernel's retransmission timeout (minutes)."""
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = ("TCP_KEEPIDLE", "TCP_KEEPALIVE")  # Linux, macOS
    for name, value in ((next((n for n in idle if hasattr(socket, n)), None), 5), ("TCP_KEEPINTVL", 5),
                        ("TCP_KEEPCNT", max(1, LINK_TIMEOUT_SECONDS // 5 - 1)),
                        ("TCP_USER_TIMEOUT", LINK_TIMEOUT_SECONDS * 1000)):
        if name is not None and hasattr(socket, name):
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _recv_exact(conn, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("rank 0 closed its link")
        buf += chunk
    return bytes(buf)


def entry_key(manager: PromptCacheManager, entry) -> tuple:
    return entry.namespace, tuple(manager._groups[entry.namespace].tree.key(entry.node))


class SyncedGenerationBatch(JoiningGenerationBatch):
    """The decode batch whose sampled tokens are rank 0's on every rank: after each
    forward, ``sync(self)`` sends them (rank 0) or puts them in place (followers)."""

    sync = None

    def _step(self):
        tokens, logprobs = super()._step()
        mx.eval(self._next_tokens)  # the forward's collectives end before the next message
        self.sync(self)
        return tokens, logprobs
