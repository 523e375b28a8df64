"""An engine's seat on an engine loop: joining, leaving, posting and calling.

Every engine (:class:`scheduler.engine.Engine`, :class:`scheduler.engine.embedding.EmbeddingEngine`)
holds one :class:`LoopSeat`. The seat knows the loop-side part the loop steps (its
``member``: what :class:`scheduler.engine.loop.Engine` describes), whether the loop is the
engine's own (started and stopped with it) or shared by every model of a gateway, and
whether the engine has started.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable

from scheduler.batch.rows import EngineDead
from scheduler.engine.loop import EngineLoop

log = logging.getLogger("mlx_gateway.engine")


class Seated:
    """What every engine (:class:`scheduler.engine.Engine`,
    :class:`scheduler.engine.embedding.EmbeddingEngine`) answers through its :attr:`seat`."""

    seat: "LoopSeat"

    @property
    def loop(self) -> EngineLoop:
        """The loop this engine runs on."""
        return self.seat.loop

    @property
    def alive(self) -> bool:
        """True while the engine is served by a running loop."""
        return self.seat.alive

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn()`` on the engine thread between steps and return its result.

        Raises:
            EngineDead: the engine is not running.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        return self.seat.call(fn, timeout)


class LoopSeat:
    """Where ``member`` sits on ``loop`` (see the module docstring).

    Args:
        member: the loop-side part; it has ``name``, ``error`` and ``closed`` (set on the
            loop thread when it leaves the loop).
        loop: the engine loop it runs on.
        own: the loop is the engine's alone: :meth:`start` starts it and :meth:`stop` stops it.
    """

    def __init__(self, member, loop: EngineLoop, own: bool):
        self.member = member
        self.loop = loop
        self.own = own
        self.started = False

    @property
    def alive(self) -> bool:
        """True while the member is served by a running loop."""
        m = self.member
        return self.started and not m.closed and m.error is None and self.loop.alive

    def start(self, timeout: float = 60.0) -> None:
        """Join the loop: a loop of its own is started here; a shared one opens the member on
        its thread between two steps.

        Raises:
            EngineDead, TimeoutError: the shared loop is not running or did not take it.
        """
        self.loop.attach(self.member, timeout)
        self.started = True
        if self.own:
            self.loop.start()

    def stop(self, timeout: float = 10.0, reason: str = "engine stopped") -> None:
        """Leave the loop; its waiting and running requests end with a 503 ``reason``. A loop
        of its own is stopped; a shared one keeps serving the others."""
        if self.own:
            self.loop.stop(timeout, reason)
        elif self.started:
            try:
                self.loop.detach(self.member, reason, timeout)
            except TimeoutError:
                log.warning("the engine loop did not release %s within %g s", self.member.name, timeout)

    def call(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn()`` on the loop thread between steps and return its result.

        Raises:
            EngineDead: the engine is not running.
            TimeoutError: no answer within ``timeout`` seconds.
        """
        if not self.alive:
            raise EngineDead("engine is not running")
        return self.loop.call(fn, timeout)

    def post(self, kind: str, payload) -> None:
        """Put an item for the member in the loop's inbox (thread-safe); a loop that died
        meanwhile answers it at once (:meth:`EngineLoop.drain_after_stop`)."""
        self.loop.post(("engine", (self.member, kind, payload)))
        if not self.loop.alive and self.started:  # the loop died between the check and the put
            self.loop.drain_after_stop(f"engine stopped: {self.loop.error!r}")

    def post_call(self, fn: Callable[[], Any], timeout: float) -> Future:
        """:meth:`call` without waiting: a Future holds its result or its error."""
        done: Future = Future()

        def wait() -> None:
            try:
                done.set_result(self.call(fn, timeout))
            except BaseException as e:
                log.warning("a call posted to the engine of %s failed: %r", self.member.name, e)
                done.set_exception(e)

        threading.Thread(target=wait, name="engine-call-waiter", daemon=True).start()
        return done
